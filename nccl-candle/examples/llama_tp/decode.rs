//! Greedy decoding with the KV cache, timed per step, and the comparison of two runs.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use nccl_candle::decode::{DecodeGraph, GraphNodes, StaticDecode};
use nccl_candle::{Error, Result};

use crate::model::{argmax, Llama};

/// What each decode step is fed.
#[derive(Debug, Clone, Copy)]
pub enum Feed<'a> {
    /// The token the model just chose.
    Greedy,
    /// `tokens[s]` after step `s` (another run's choices, so that two runs see the same
    /// inputs even where a near-tie made them choose differently).
    Forced(&'a [Vec<u32>]),
}

impl Feed<'_> {
    /// The ids step `step` (after the prompt's pass, step 0) is fed, one per row: the run's
    /// last choice, or the forced row (refused, naming `op`, when there is none of `batch`).
    fn input(&self, run: &Run, step: usize, batch: usize, op: &'static str) -> Result<Vec<u32>> {
        let row = match self {
            Feed::Greedy => run.tokens.get(step - 1),
            Feed::Forced(tokens) => tokens.get(step - 1),
        };
        match row {
            Some(row) if row.len() == batch => Ok(row.clone()),
            _ => Err(Error::Argument {
                op,
                why: format!("no tokens to feed step {step} of {batch} rows"),
            }),
        }
    }
}

/// One decode of a batch.
#[derive(Debug, Clone, Default)]
pub struct Run {
    /// The model's choice at each step (step 0: after the prompt), one per row.
    pub tokens: Vec<Vec<u32>>,
    /// The logits of each step, rows one after the other, when recorded.
    pub logits: Vec<Vec<f32>>,
    /// The prompt's forward pass and its choice.
    pub prefill: Duration,
    /// Each later step: its forward pass and choice, ready on the host.
    pub steps: Vec<Duration>,
    /// What the captured step is made of (graph runs).
    pub nodes: Option<GraphNodes>,
}

/// A prompt of `batch` rows of `len` tokens from `seed`, `[batch * len]` row by row.
pub fn prompt(vocab: usize, batch: usize, len: usize, seed: u64) -> Vec<u32> {
    let mut state = seed ^ 0x5EED_0F7E_57AB;
    (0..batch * len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Decodes `new_tokens` tokens (the first from the prompt's pass) after `prompt` (`batch`
/// rows), from an empty cache. Each step ends with its tokens on the host, so its time is
/// the whole step, device work included.
pub fn decode(
    model: &mut Llama,
    prompt: &[u32],
    batch: usize,
    new_tokens: usize,
    feed: Feed<'_>,
    record: bool,
    device: &Device,
) -> Result<Run> {
    let prompt_len = prompt.len() / batch.max(1);
    model.reset()?;
    let mut run = Run::default();
    let keep = |run: &mut Run, logits: &Tensor| -> Result<()> {
        if record {
            let host = logits
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            run.logits.push(host);
        }
        Ok(())
    };
    let start = Instant::now();
    let ids = Tensor::from_vec(prompt.to_vec(), (batch, prompt_len), device)?;
    let logits = model.forward(&ids, 0)?;
    run.tokens.push(argmax(&logits)?.to_vec1::<u32>()?);
    run.prefill = start.elapsed();
    keep(&mut run, &logits)?;
    for step in 1..new_tokens {
        let input = feed.input(&run, step, batch, "decode")?;
        let start = Instant::now();
        let ids = Tensor::from_vec(input, (batch, 1), device)?;
        let logits = model.forward(&ids, prompt_len + step - 1)?;
        run.tokens.push(argmax(&logits)?.to_vec1::<u32>()?);
        run.steps.push(start.elapsed());
        keep(&mut run, &logits)?;
    }
    Ok(run)
}

/// How [`decode_static`] runs its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steps {
    /// The static step run eagerly (the kernels a graph replays, each launched).
    Eager,
    /// The static step captured into a CUDA graph once and replayed per token.
    Graph,
}

/// [`decode`] through the static decode step (`nccl_candle::decode`): the prompt's pass as
/// usual, then the steps read their ids and position from device memory, replayed from a
/// CUDA graph captured after the prompt or run eagerly. A step's time is its inputs'
/// upload, the replay (or launches) and its greedy tokens on the host; the capture (once per
/// call, after the prompt) is in [`Run::prefill`]'s neighbour, not in the steps.
#[allow(clippy::too_many_arguments)]
pub fn decode_static(
    model: &mut Llama,
    prompt: &[u32],
    batch: usize,
    new_tokens: usize,
    feed: Feed<'_>,
    record: bool,
    device: &Device,
    steps: Steps,
) -> Result<Run> {
    let prompt_len = prompt.len() / batch.max(1);
    let mut run = Run::default();
    let start = Instant::now();
    let ids = Tensor::from_vec(prompt.to_vec(), (batch, prompt_len), device)?;
    let logits = model.prefill(&ids)?;
    run.tokens.push(argmax(&logits)?.to_vec1::<u32>()?);
    run.prefill = start.elapsed();
    if record {
        run.logits.push(
            logits
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
    }
    let mut graph = match steps {
        Steps::Graph => DecodeGraph::capture(model, batch)?,
        Steps::Eager => DecodeGraph::eager(model, batch)?,
    };
    run.nodes = graph.nodes()?;
    for step in 1..new_tokens {
        let input = feed.input(&run, step, batch, "decode_static")?;
        let start = Instant::now();
        graph.step(&input)?;
        run.tokens.push(graph.greedy_tokens()?);
        run.steps.push(start.elapsed());
        if record {
            run.logits
                .push(graph.logits()?.flatten_all()?.to_vec1::<f32>()?);
        }
    }
    Ok(run)
}

/// The median of `times` after the first `warmup`, in milliseconds (`NaN` when none).
pub fn median_ms(times: &[Duration], warmup: usize) -> f64 {
    let mut ms: Vec<f64> = times
        .iter()
        .skip(warmup)
        .map(|t| t.as_secs_f64() * 1e3)
        .collect();
    if ms.is_empty() {
        return f64::NAN;
    }
    ms.sort_by(f64::total_cmp);
    ms[ms.len() / 2]
}

/// The check's logit tolerance for `dtype`, relative to the largest |logit| of the
/// reference. f32: 1e-3 (the same sums in another order differ by ~1e-6 relative).
/// bf16: 5e-2: a rank's partial sum is rounded to bf16 before the all-reduce (whose own sum
/// rounds at each step) where one GPU rounds once, and those 1-ulp differences (2^-8
/// relative) travel through every layer; simulated on CPU (tests/llama_tp_cpu.rs) the
/// largest difference was 1.3% (small model) and 1.7% (8 layers of width 1024). A sharding
/// bug moves logits by about their own size.
pub fn relative_tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 | DType::F64 => 1e-3,
        _ => 5e-2,
    }
}

/// `relative` times the largest |logit| of `reference` (recorded).
pub fn tolerance(reference: &Run, relative: f32) -> f32 {
    let largest = reference
        .logits
        .iter()
        .flatten()
        .filter(|v| v.is_finite())
        .fold(0f32, |m, v| m.max(v.abs()));
    relative * largest
}

/// How a run compares with a reference run fed the same tokens.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    /// Choices compared (steps times rows).
    pub compared: usize,
    /// Choices that differ where the reference's logits of the two tokens are within twice
    /// the tolerance: the logit bound allows it.
    pub near_ties: usize,
    /// Choices that differ otherwise.
    pub mismatches: usize,
    /// The largest |logit difference|.
    pub max_diff: f32,
    /// Logits that are NaN or infinite, in either run.
    pub non_finite: usize,
}

impl Verdict {
    /// Whether the run passes with logit tolerance `tolerance`.
    pub fn passed(&self, tolerance: f32) -> bool {
        self.mismatches == 0 && self.non_finite == 0 && self.max_diff <= tolerance
    }
}

/// Compares `run` with `reference` (both recorded, `run` fed `reference`'s tokens).
pub fn compare(reference: &Run, run: &Run, vocab: usize, tolerance: f32) -> Verdict {
    let mut verdict = Verdict::default();
    let steps = reference.tokens.iter().zip(&run.tokens);
    let logits = reference.logits.iter().zip(&run.logits);
    for ((want, got), (want_logits, got_logits)) in steps.zip(logits) {
        for (&a, &b) in want_logits.iter().zip(got_logits) {
            if !a.is_finite() || !b.is_finite() {
                verdict.non_finite += 1;
            } else {
                verdict.max_diff = verdict.max_diff.max((a - b).abs());
            }
        }
        for (row, (&w, &g)) in want.iter().zip(got).enumerate() {
            verdict.compared += 1;
            if w == g {
                continue;
            }
            let logit = |token: u32| {
                want_logits
                    .get(row * vocab + token as usize)
                    .copied()
                    .unwrap_or(f32::NAN)
            };
            let gap = logit(w) - logit(g);
            if gap <= 2.0 * tolerance {
                verdict.near_ties += 1;
            } else {
                verdict.mismatches += 1;
            }
        }
    }
    if reference.tokens.len() != run.tokens.len() || reference.logits.len() != run.logits.len() {
        verdict.mismatches += 1;
    }
    verdict
}

/// The number of NaN or infinite logits of a recorded run.
pub fn non_finite(run: &Run) -> usize {
    run.logits
        .iter()
        .flatten()
        .filter(|v| !v.is_finite())
        .count()
}
