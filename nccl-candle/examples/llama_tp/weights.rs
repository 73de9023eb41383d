//! The model's weights from a seed, written as safetensors, and a fingerprint of such a file
//! for the ranks to agree on.
//!
//! Every value comes from the seed, the tensor's name and the index of its 64 Ki-element
//! chunk alone (splitmix64 on the host), so any process, with any number of threads,
//! writes the same bytes: each rank can make its own file instead of sharing one. Matrices
//! are uniform with standard deviation 0.02 (activations stay near unit scale through the
//! RMSNorms), norm scales uniform in `[0.9, 1.1)`; stored as bf16, so loading them as f32
//! gives exactly the same values.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::{Device, Tensor};
use half::bf16;
use nccl_candle::fingerprint;

use crate::model::Config;

/// Values per independently seeded chunk.
const CHUNK: usize = 1 << 16;
/// Standard deviation of matrix entries.
const STD: f32 = 0.02;

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy)]
enum Init {
    /// Uniform, mean 0, standard deviation [`STD`].
    Matrix,
    /// Uniform in `[0.9, 1.1)`.
    NormScale,
}

/// Every tensor of the model: name, shape, how it is drawn.
fn tensors(cfg: &Config) -> Vec<(String, Vec<usize>, Init)> {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let kv = cfg.kv_heads * cfg.head_dim();
    let mut all = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![cfg.vocab, h],
            Init::Matrix,
        ),
        ("model.norm.weight".to_string(), vec![h], Init::NormScale),
        (
            "lm_head.weight".to_string(),
            vec![cfg.vocab, h],
            Init::Matrix,
        ),
    ];
    for layer in 0..cfg.layers {
        let p = format!("model.layers.{layer}");
        all.extend([
            (
                format!("{p}.input_layernorm.weight"),
                vec![h],
                Init::NormScale,
            ),
            (
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                Init::NormScale,
            ),
            (
                format!("{p}.self_attn.q_proj.weight"),
                vec![h, h],
                Init::Matrix,
            ),
            (
                format!("{p}.self_attn.k_proj.weight"),
                vec![kv, h],
                Init::Matrix,
            ),
            (
                format!("{p}.self_attn.v_proj.weight"),
                vec![kv, h],
                Init::Matrix,
            ),
            (
                format!("{p}.self_attn.o_proj.weight"),
                vec![h, h],
                Init::Matrix,
            ),
            (
                format!("{p}.mlp.gate_proj.weight"),
                vec![i, h],
                Init::Matrix,
            ),
            (format!("{p}.mlp.up_proj.weight"), vec![i, h], Init::Matrix),
            (
                format!("{p}.mlp.down_proj.weight"),
                vec![h, i],
                Init::Matrix,
            ),
        ]);
    }
    all
}

/// splitmix64's next output.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills chunk `index` of tensor `name`.
fn fill(seed: u64, name: &str, index: usize, init: Init, out: &mut [bf16]) {
    let mut state = fingerprint(&(seed, name, index));
    // Half-width of a uniform of standard deviation STD.
    let width = STD * 3f32.sqrt();
    for value in out {
        // 24 random bits, exact in f32: uniform in [-1, 1).
        let unit = (splitmix64(&mut state) >> 40) as f32 / (1u32 << 23) as f32 - 1.0;
        *value = bf16::from_f32(match init {
            Init::Matrix => unit * width,
            Init::NormScale => 1.0 + 0.1 * unit,
        });
    }
}

/// The values of one tensor, drawn on `threads` threads.
fn draw(seed: u64, name: &str, len: usize, init: Init, threads: usize) -> Vec<bf16> {
    let mut values = vec![bf16::ZERO; len];
    let mut chunks: Vec<(usize, &mut [bf16])> = values.chunks_mut(CHUNK).enumerate().collect();
    let per_thread = chunks.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        for share in chunks.chunks_mut(per_thread) {
            scope.spawn(move || {
                for (index, chunk) in share.iter_mut() {
                    fill(seed, name, *index, init, chunk);
                }
            });
        }
    });
    values
}

/// Every tensor of the model for `seed`, bf16 on the host.
pub fn generate(
    cfg: &Config,
    seed: u64,
    threads: usize,
) -> candle_core::Result<HashMap<String, Tensor>> {
    tensors(cfg)
        .into_iter()
        .map(|(name, shape, init)| {
            let len = shape.iter().product();
            let values = draw(seed, &name, len, init, threads);
            let tensor = Tensor::from_vec(values, shape, &Device::Cpu)?;
            Ok((name, tensor))
        })
        .collect()
}

/// Writes the model for `seed` to `path` as safetensors.
pub fn write(cfg: &Config, seed: u64, path: &Path, threads: usize) -> candle_core::Result<()> {
    candle_core::safetensors::save(&generate(cfg, seed, threads)?, path)
}

/// A fingerprint of a safetensors file that is quick to take: its length, its header (every
/// tensor's name, type, shape and place) and 4 KiB at 64 places spread over it. Two files
/// with the same fingerprint are the same file for the ranks' agreement, short of a change
/// between those places.
pub fn file_fingerprint(path: &Path) -> std::io::Result<u64> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut head = [0u8; 8];
    file.read_exact(&mut head)?;
    let header_len = u64::from_le_bytes(head).min(len.saturating_sub(8));
    let mut header = vec![0u8; usize::try_from(header_len).unwrap_or(0)];
    file.read_exact(&mut header)?;
    let mut samples = Vec::new();
    let mut sample = vec![0u8; 4096];
    for i in 0..64u64 {
        let at = len.saturating_sub(4096) / 63 * i;
        file.seek(SeekFrom::Start(at))?;
        let n = file.read(&mut sample)?;
        samples.extend_from_slice(&sample[..n]);
    }
    Ok(fingerprint(&(len, header, samples)))
}
