//! Host-side helpers of the tensor-parallel tests: random data and the host's computation
//! of a whole layer.
#![allow(dead_code)] // each test crate uses its own part

use candle_core::Tensor;

/// Values in [-1, 1) from a seed (xorshift).
pub fn data(seed: u64, len: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `x W^T + b` on the host, in f64: `x` `[rows, inp]`, `w` `[out, inp]`, `b` `[out]`.
pub fn host_linear(x: &[f32], w: &[f32], b: &[f32], inp: usize, out: usize) -> Vec<f32> {
    x.chunks(inp)
        .flat_map(|row| {
            (0..out).map(move |o| {
                let dot: f64 = (0..inp)
                    .map(|i| f64::from(row[i]) * f64::from(w[o * inp + i]))
                    .sum();
                (dot + f64::from(b[o])) as f32
            })
        })
        .collect()
}

/// Columns `range` of each row (of `width`) of `x`.
pub fn columns(x: &[f32], width: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    x.chunks(width)
        .flat_map(|row| row[range.clone()].to_vec())
        .collect()
}

/// Asserts that `got` holds `want` within `tolerance` per element.
pub fn close(got: &Tensor, want: &[f32], tolerance: f32, what: &str) {
    let got = got
        .flatten_all()
        .and_then(|t| t.to_dtype(candle_core::DType::F32))
        .and_then(|t| t.to_vec1::<f32>())
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance,
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

/// The row-parallel epilogue on the host, in f64: `h = sum + residual` and its RMSNorm,
/// `h · weight / sqrt(mean(h²) + eps)`, per row of `weight.len()`.
pub fn host_add_rms_norm(
    sum: &[f32],
    residual: &[f32],
    weight: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>) {
    let hidden = weight.len();
    let h: Vec<f64> = sum
        .iter()
        .zip(residual)
        .map(|(&s, &r)| f64::from(s) + f64::from(r))
        .collect();
    let normed = h
        .chunks(hidden)
        .flat_map(|row| {
            let mean = row.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
            let scale = 1.0 / (mean + f64::from(eps)).sqrt();
            row.iter()
                .zip(weight)
                .map(move |(v, &w)| (v * scale * f64::from(w)) as f32)
        })
        .collect();
    (h.iter().map(|&v| v as f32).collect(), normed)
}
