//! The choice of the next token from a model's logits: greedy, or drawn from the softmax at
//! a temperature with nucleus (top-p) truncation, from a seeded generator.
//!
//! Tensor-parallel ranks each choose for themselves instead of exchanging the choice: the
//! logits [`CausalLm::forward`](super::CausalLm::forward) returns are the same bytes on
//! every rank, and everything here is a deterministic function of them and of the seed (one
//! pass in index order, a stable sort under a total order, no hash maps, no threads), so
//! ranks with samplers made alike choose alike.

use candle_core::{DType, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{Error, Result};

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The token of the largest logit (the lowest index among equal ones).
    Greedy,
    /// A draw from softmax(logits / temperature), keeping the smallest set of top tokens
    /// whose probability reaches top_p (1.0 = all).
    Random {
        /// Divides the logits before the softmax: finite and above 0 (below 1 sharpens, above
        /// 1 flattens).
        temperature: f64,
        /// The probability mass kept, in (0, 1]: the most likely tokens whose probabilities
        /// together first reach it (at least one).
        top_p: f64,
        /// The generator's seed: the same seed gives the same draws for the same logits.
        seed: u64,
    },
}

/// Chooses tokens from logits as its [`Sampling`] says, with its own seeded generator
/// (`rand`'s `StdRng`, ChaCha12: the same stream for a seed on every platform with this
/// crate's pinned `rand`).
#[derive(Debug, Clone)]
pub struct Sampler {
    sampling: Sampling,
    /// `None` for greedy, which draws nothing.
    rng: Option<StdRng>,
}

const OP: &str = "Sampler::sample";

impl Sampler {
    /// A sampler for `sampling`. [`Error::Argument`] naming the field when a temperature is
    /// not finite and above 0, or a top_p is not in (0, 1].
    pub fn new(sampling: Sampling) -> Result<Self> {
        let rng = match sampling {
            Sampling::Greedy => None,
            Sampling::Random {
                temperature,
                top_p,
                seed,
            } => {
                // Written so that NaN fails too.
                if !(temperature.is_finite() && temperature > 0.0) {
                    return Err(Error::Argument {
                        op: "Sampler::new",
                        why: format!("temperature {temperature}: must be finite and above 0"),
                    });
                }
                if !(top_p > 0.0 && top_p <= 1.0) {
                    return Err(Error::Argument {
                        op: "Sampler::new",
                        why: format!("top_p {top_p}: must be in (0, 1]"),
                    });
                }
                Some(StdRng::seed_from_u64(seed))
            }
        };
        Ok(Self { sampling, rng })
    }

    /// How it chooses.
    pub fn sampling(&self) -> Sampling {
        self.sampling
    }

    /// The next token of each row of `logits` (`[b, vocab]`, any float type, on any device:
    /// copied to the host as f32). Every rank that passes the same logits with a sampler
    /// made alike (and called alike before) picks the same tokens.
    ///
    /// [`Error::Argument`] when `logits` is not `[b, vocab]` with `vocab` at least 1, or
    /// holds a NaN or an infinity (named by row and token), rather than a choice made from
    /// them; nothing is drawn from the generator then.
    pub fn sample(&mut self, logits: &Tensor) -> Result<Vec<u32>> {
        let dims = logits.dims();
        let &[_, vocab] = dims else {
            return Err(Error::Argument {
                op: OP,
                why: format!("logits of shape {dims:?}, not [batch, vocab]"),
            });
        };
        if vocab == 0 {
            return Err(Error::Argument {
                op: OP,
                why: "logits over an empty vocabulary".into(),
            });
        }
        if u32::try_from(vocab).is_err() {
            return Err(Error::Argument {
                op: OP,
                why: format!("a vocabulary of {vocab} tokens does not fit u32 ids"),
            });
        }
        let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        // Every row checked before any draw, so a refusal leaves the generator as it was.
        for (r, row) in rows.iter().enumerate() {
            if let Some((i, x)) = row.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                return Err(Error::Argument {
                    op: OP,
                    why: format!("row {r}: the logit of token {i} is {x}"),
                });
            }
        }
        let mut tokens = Vec::with_capacity(rows.len());
        for row in &rows {
            let token = match (self.sampling, self.rng.as_mut()) {
                (
                    Sampling::Random {
                        temperature, top_p, ..
                    },
                    Some(rng),
                ) => draw(row, temperature, top_p, rng),
                _ => greedy(row),
            };
            // The vocabulary fits u32 (checked above), so every index does.
            tokens.push(token as u32);
        }
        Ok(tokens)
    }
}

/// The index of the largest value under `f32::total_cmp`, the lowest among equal ones.
fn greedy(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in row.iter().enumerate().skip(1) {
        if x.total_cmp(&row[best]).is_gt() {
            best = i;
        }
    }
    best
}

/// One draw from softmax(row / temperature) truncated to its top-`top_p` nucleus (`row`
/// finite and not empty).
fn draw(row: &[f32], temperature: f64, top_p: f64, rng: &mut StdRng) -> usize {
    let top = row[greedy(row)];
    // Unnormalised probabilities, the largest 1: no overflow, and only tokens far below the
    // top (which no draw could pick anyway) underflow to 0.
    let weights: Vec<f64> = row
        .iter()
        .map(|&x| ((f64::from(x) - f64::from(top)) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    // Candidates in the order the draw walks: every token in index order when all are kept
    // (no sort needed); otherwise the most likely first, equal logits by index (a stable
    // sort of indices under a total order), cut where their mass first reaches top_p.
    let order: Vec<usize> = if top_p >= 1.0 {
        (0..row.len()).collect()
    } else {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let mut mass = 0.0;
        let mut keep = order.len();
        for (n, &i) in order.iter().enumerate() {
            mass += weights[i];
            if mass >= top_p * total {
                keep = n + 1;
                break;
            }
        }
        order.truncate(keep);
        order
    };
    let kept: f64 = order.iter().map(|&i| weights[i]).sum();
    let mut u = rng.random::<f64>() * kept;
    for &i in &order {
        u -= weights[i];
        if u < 0.0 {
            return i;
        }
    }
    // Rounding left `u` at or just above the sum: the last candidate with any weight.
    order
        .iter()
        .rev()
        .copied()
        .find(|&i| weights[i] > 0.0)
        .unwrap_or(order[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn logits(rows: &[&[f32]]) -> Tensor {
        let vocab = rows[0].len();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_vec(flat, (rows.len(), vocab), &Device::Cpu).unwrap()
    }

    fn random(temperature: f64, top_p: f64, seed: u64) -> Sampler {
        Sampler::new(Sampling::Random {
            temperature,
            top_p,
            seed,
        })
        .unwrap()
    }

    fn softmax(row: &[f32], temperature: f64) -> Vec<f64> {
        let e: Vec<f64> = row
            .iter()
            .map(|&x| (f64::from(x) / temperature).exp())
            .collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|v| v / z).collect()
    }

    /// Pearson's chi-square statistic of `counts` against `expected` probabilities.
    fn chi_square(counts: &[usize], expected: &[f64]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(expected)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    #[test]
    fn greedy_picks_the_max_and_the_lowest_index_of_a_tie() {
        let mut s = Sampler::new(Sampling::Greedy).unwrap();
        let l = logits(&[
            &[0.1, 3.0, 3.0, -1.0],
            &[5.0, 1.0, 2.0, 5.0],
            &[-3.0, -2.0, -9.0, -2.5],
        ]);
        assert_eq!(s.sample(&l).unwrap(), [1, 0, 1]);
        // Any float type, converted on the way.
        let bf16 = l.to_dtype(DType::BF16).unwrap();
        assert_eq!(s.sample(&bf16).unwrap(), [1, 0, 1]);
    }

    #[test]
    fn a_tiny_top_p_is_greedy() {
        let row: &[f32] = &[0.5, 2.0, 1.9, 2.0, -4.0];
        let mut s = random(1.5, 1e-9, 7);
        for _ in 0..200 {
            assert_eq!(s.sample(&logits(&[row])).unwrap(), [1]);
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_sequence() {
        let row: Vec<f32> = (0..1000).map(|i| ((i * 37) % 11) as f32 * 0.1).collect();
        let l = logits(&[&row, &row]);
        let draws = |seed: u64, top_p: f64| -> Vec<u32> {
            let mut s = random(1.0, top_p, seed);
            (0..20).flat_map(|_| s.sample(&l).unwrap()).collect()
        };
        for top_p in [1.0, 0.9] {
            assert_eq!(draws(3, top_p), draws(3, top_p));
            assert_ne!(draws(3, top_p), draws(4, top_p));
        }
        // A clone goes on with the same stream.
        let mut a = random(0.8, 0.95, 11);
        a.sample(&l).unwrap();
        let mut b = a.clone();
        assert_eq!(a.sample(&l).unwrap(), b.sample(&l).unwrap());
    }

    #[test]
    fn draws_follow_the_softmax_at_the_temperature() {
        let row: &[f32] = &[0.0, 1.0, 2.0, 0.5, -1.0];
        let n = 20_000;
        for temperature in [0.7, 1.0, 2.5] {
            let mut s = random(temperature, 1.0, 42);
            let mut counts = vec![0usize; row.len()];
            let rows = vec![row; 100];
            for _ in 0..n / 100 {
                for t in s.sample(&logits(&rows)).unwrap() {
                    counts[t as usize] += 1;
                }
            }
            // 4 degrees of freedom: P(chi2 > 30) is about 5e-6 for a sampler that is right;
            // a wrong temperature (e.g. none) moves these counts by hundreds.
            let chi2 = chi_square(&counts, &softmax(row, temperature));
            assert!(chi2 < 30.0, "T={temperature}: {counts:?}, chi2 {chi2}");
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus_and_renormalises() {
        // Probabilities 0.5, 0.3, 0.2 (token order shuffled): top_p 0.75 keeps the first two.
        let p = [0.2f64, 0.5, 0.3];
        let row: Vec<f32> = p.iter().map(|v| v.ln() as f32).collect();
        let mut s = random(1.0, 0.75, 9);
        let mut counts = [0usize; 3];
        for _ in 0..100 {
            for t in s.sample(&logits(&vec![row.as_slice(); 100])).unwrap() {
                counts[t as usize] += 1;
            }
        }
        assert_eq!(counts[0], 0, "{counts:?}");
        let chi2 = chi_square(&counts[1..], &[0.5 / 0.8, 0.3 / 0.8]);
        assert!(chi2 < 25.0, "{counts:?}, chi2 {chi2}");
        // Exactly reaching top_p stops there: 0.5 alone is enough for top_p 0.5.
        let mut s = random(1.0, 0.5, 9);
        for _ in 0..50 {
            assert_eq!(s.sample(&logits(&[&row])).unwrap(), [1]);
        }
    }

    #[test]
    fn bad_arguments_are_refused() {
        let named = |sampling: Sampling, field: &str| match Sampler::new(sampling) {
            Err(Error::Argument { op, why }) => {
                assert_eq!(op, "Sampler::new");
                assert!(why.contains(field), "{why}");
            }
            other => panic!("{sampling:?}: {other:?}"),
        };
        for temperature in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            named(
                Sampling::Random {
                    temperature,
                    top_p: 1.0,
                    seed: 0,
                },
                "temperature",
            );
        }
        for top_p in [0.0, -0.5, 1.5, f64::NAN] {
            named(
                Sampling::Random {
                    temperature: 1.0,
                    top_p,
                    seed: 0,
                },
                "top_p",
            );
        }
        let refused = |sampler: &mut Sampler, l: &Tensor, what: &str| match sampler.sample(l) {
            Err(Error::Argument { op, why }) => {
                assert_eq!(op, OP);
                assert!(why.contains(what), "{why}");
            }
            other => panic!("{other:?}"),
        };
        for mut s in [Sampler::new(Sampling::Greedy).unwrap(), random(1.0, 0.9, 1)] {
            refused(&mut s, &logits(&[&[1.0, f32::NAN]]), "token 1 is NaN");
            refused(&mut s, &logits(&[&[0.0], &[f32::INFINITY]]), "row 1");
            let flat = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
            refused(&mut s, &flat, "not [batch, vocab]");
            let empty = Tensor::zeros((2, 0), DType::F32, &Device::Cpu).unwrap();
            refused(&mut s, &empty, "empty vocabulary");
        }
        // A refusal draws nothing: the stream goes on as if it had not happened.
        let row: Vec<f32> = (0..50).map(|i| (i % 7) as f32).collect();
        let (mut a, mut b) = (random(1.0, 1.0, 5), random(1.0, 1.0, 5));
        assert!(a.sample(&logits(&[&row, &[f32::NAN; 50]])).is_err());
        for _ in 0..10 {
            assert_eq!(
                a.sample(&logits(&[&row])).unwrap(),
                b.sample(&logits(&[&row])).unwrap()
            );
        }
    }
}
