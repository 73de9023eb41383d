//! Synthetic data, identical on every rank: a counter-based RNG and the teacher network that
//! labels the samples.

use crate::model::INPUTS;

/// Hidden units of the teacher network that produces the targets.
const TEACHER_HIDDEN: usize = 8;
/// Amplitude of the label noise, uniform in `[-NOISE, NOISE]`.
const NOISE: f64 = 0.01;
/// Seed of everything random: the dataset, the teacher and the initial parameters.
const SEED: u64 = 0x5eed_da7a_9a2a_11e1;

/// SplitMix64's output function: a good 64-bit mixer, so `mix(key)` is a counter-based RNG.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in `[-1, 1)`, a pure function of `(stream, index)`: any rank can produce any sample
/// (or parameter) on its own, with no state to keep in sync and bitwise the same everywhere.
pub fn uniform(stream: u64, index: u64) -> f64 {
    let bits = mix(SEED ^ mix(stream.wrapping_mul(0x632b_e59b_d9b4_e019) ^ index));
    (bits >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

/// Random streams, one per kind of value.
pub mod streams {
    pub const TEACHER: u64 = 1;
    pub const FEATURES: u64 = 2;
    pub const NOISE: u64 = 3;
    pub const LAYER1: u64 = 4;
    pub const LAYER2: u64 = 5;
}

/// The network that labels the data: `y = c + sum_h v_h softsign(b_h + W_h . x) + noise`.
/// Softsign (`z / (1 + |z|)`) rather than tanh so that the labels use only correctly rounded
/// IEEE operations and come out bitwise the same on every machine, whatever its libm.
pub struct Teacher {
    w: Vec<f64>,
    b: Vec<f64>,
    v: Vec<f64>,
    c: f64,
}

impl Teacher {
    pub fn new() -> Self {
        let mut next = (0u64..).map(|i| uniform(streams::TEACHER, i));
        let scale = 2.0 / (INPUTS as f64).sqrt(); // pre-activations of about unit size
        let w = next
            .by_ref()
            .take(TEACHER_HIDDEN * INPUTS)
            .map(|u| u * scale);
        let w: Vec<f64> = w.collect();
        let b: Vec<f64> = next.by_ref().take(TEACHER_HIDDEN).collect();
        let v: Vec<f64> = next.by_ref().take(TEACHER_HIDDEN).collect();
        let c = next.next().unwrap_or_default();
        Teacher { w, b, v, c }
    }

    pub fn label(&self, x: &[f32]) -> f64 {
        let mut y = self.c;
        for h in 0..TEACHER_HIDDEN {
            let row = &self.w[h * INPUTS..(h + 1) * INPUTS];
            let z = self.b[h]
                + row
                    .iter()
                    .zip(x)
                    .map(|(w, &x)| w * f64::from(x))
                    .sum::<f64>();
            y += self.v[h] * (z / (1.0 + z.abs()));
        }
        y
    }
}

/// Samples `range` of the global dataset: features row-major (`INPUTS` per sample), labels.
pub struct Data {
    pub x: Vec<f32>,
    pub y: Vec<f32>,
}

impl Data {
    pub fn generate(teacher: &Teacher, range: std::ops::Range<usize>) -> Data {
        let mut x = Vec::with_capacity(range.len() * INPUTS);
        let mut y = Vec::with_capacity(range.len());
        for i in range {
            let start = x.len();
            // Unit-variance features: uniform in [-sqrt 3, sqrt 3).
            x.extend((0..INPUTS).map(|k| {
                (3f64.sqrt() * uniform(streams::FEATURES, (i * INPUTS + k) as u64)) as f32
            }));
            let noise = NOISE * uniform(streams::NOISE, i as u64);
            y.push((teacher.label(&x[start..]) + noise) as f32);
        }
        Data { x, y }
    }
}
