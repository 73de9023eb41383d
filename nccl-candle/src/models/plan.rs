//! Which part of each tensor a rank holds ([`Plan`], from the configuration and the world
//! size alone, so every rank computes the same), every tensor the configuration implies, and
//! reading a rank's blocks from the checkpoint.
//!
//! How the weights split over `N` ranks: q, k, v, gate and up by output rows (each rank a
//! block of whole heads, of MLP features), o and down by input columns
//! ([`RowParallelLinear`](crate::tp::RowParallelLinear), whose sum is the layer's one
//! all-reduce); the embedding table and the head by vocabulary rows, `ceil(vocab / N)` a rank
//! with the last block padded with zero rows, so any vocabulary splits; key/value heads split
//! when `N` divides them and are replicated when they divide `N` (each rank holds the one
//! key/value head its query heads read, as vLLM does), anything else is refused.
//!
//! A mixture of experts (Mixtral, Qwen3-MoE) splits by expert instead: rank `r` of `N` holds
//! experts `r × E / N .. (r + 1) × E / N` whole (`E` a multiple of `N`), and every rank the
//! router; the tokens go to their experts' ranks and back (expert parallelism).

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Tensor};
use candle_nn::Linear;

use super::checkpoint::Checkpoint;
use super::config::{Family, ModelConfig};
use crate::tp::{RowParallelLinear, TpGroup};
use crate::{Error, Result};

/// How the model lies over the group: what each rank holds. Depends only on the
/// configuration and the world size, so every rank computes the same plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) rank: usize,
    pub(super) ranks: usize,
    /// Query heads on each rank.
    pub(super) heads: usize,
    /// Key/value heads on each rank.
    pub(super) kv_heads: usize,
    /// Which block of the key/value heads this rank holds, of how many blocks.
    pub(super) kv_part: (usize, usize),
    /// MLP features on each rank.
    pub(super) intermediate: usize,
    /// Vocabulary rows on each rank (the last rank's padded with zeros).
    pub(super) vocab_rows: usize,
    /// Experts on each rank (0 without a mixture of experts); this rank's are
    /// `rank × local_experts ..`.
    pub(super) local_experts: usize,
}

impl Plan {
    pub(super) fn new(cfg: &ModelConfig, rank: usize, ranks: usize) -> Result<Self> {
        let refuse = |name: &str, len: usize| Error::NotDivisible {
            name: name.to_string(),
            shape: vec![len],
            dim: 0,
            world_size: ranks,
        };
        if !cfg.num_attention_heads.is_multiple_of(ranks) {
            return Err(refuse("num_attention_heads", cfg.num_attention_heads));
        }
        // Whether some layer has a dense MLP (without walking the layers: their count is
        // the file's, unchecked here): all of them without experts; with them, layer 0 when
        // the step skips it, or a dense layer the list names.
        let layers = cfg.num_hidden_layers;
        let dense_layers = match &cfg.experts {
            None => layers > 0,
            Some(e) => {
                layers > 0
                    && (e.decoder_sparse_step > 1 || e.dense_layers.iter().any(|&l| l < layers))
            }
        };
        if dense_layers && !cfg.intermediate_size.is_multiple_of(ranks) {
            return Err(refuse("intermediate_size", cfg.intermediate_size));
        }
        let local_experts = match &cfg.experts {
            Some(experts) if !experts.experts.is_multiple_of(ranks) => {
                return Err(refuse("num_experts", experts.experts));
            }
            Some(experts) => experts.experts / ranks,
            None => 0,
        };
        let kv = cfg.num_key_value_heads;
        let (kv_heads, kv_part) = if kv.is_multiple_of(ranks) {
            (kv / ranks, (rank, ranks))
        } else if ranks.is_multiple_of(kv) {
            // Replicated: ranks / kv ranks share each key/value head, the one their query
            // heads read (query head h reads h / (heads / kv); a rank's heads / ranks
            // query heads divide heads / kv, so they all read the same one).
            (1, (rank * kv / ranks, kv))
        } else {
            return Err(refuse("num_key_value_heads", kv));
        };
        Ok(Self {
            rank,
            ranks,
            heads: cfg.num_attention_heads / ranks,
            kv_heads,
            kv_part,
            intermediate: cfg.intermediate_size / ranks,
            vocab_rows: cfg.vocab_size.div_ceil(ranks),
            local_experts,
        })
    }

    /// Whether expert `expert` is this rank's.
    pub(super) fn holds_expert(&self, expert: usize) -> bool {
        (self.rank * self.local_experts..(self.rank + 1) * self.local_experts).contains(&expert)
    }

    /// This rank's vocabulary rows that exist (the rest of its block is padding).
    pub(super) fn vocab_range(&self, vocab: usize) -> std::ops::Range<usize> {
        let start = (self.rank * self.vocab_rows).min(vocab);
        start..((self.rank + 1) * self.vocab_rows).min(vocab)
    }
}

/// How a tensor lies over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Split {
    /// Whole on every rank (norms, row-parallel biases).
    Whole,
    /// A block of rows (dimension 0): query heads, MLP features.
    Rows,
    /// A block of rows of the key/value heads (split or replicated, see [`Plan`]).
    KvRows,
    /// A block of columns (dimension 1): o_proj and down_proj.
    Columns,
    /// Vocabulary rows, the last rank's padded.
    Vocab,
    /// Whole on the rank that holds this expert, absent elsewhere.
    Expert(usize),
}

/// The tensors of a mixture-of-experts layer's MLP under `mlp` (`model.layers.{i}.` and
/// Mixtral's `block_sparse_moe` or Qwen3-MoE's `mlp`): the router's name, then each
/// expert's gate, up and down projections' names.
pub(super) struct ExpertNames {
    pub(super) router: String,
    /// For each expert: gate, up, down (weights).
    pub(super) experts: Vec<[String; 3]>,
}

impl ExpertNames {
    pub(super) fn new(cfg: &ModelConfig, layer: usize) -> Option<Self> {
        let experts = cfg.experts.as_ref().filter(|e| e.is_sparse(layer))?;
        let p = format!("model.layers.{layer}");
        let (prefix, [gate, up, down]) = match cfg.family {
            Family::Mixtral => (format!("{p}.block_sparse_moe"), ["w1", "w3", "w2"]),
            _ => (format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"]),
        };
        Some(Self {
            router: format!("{prefix}.gate.weight"),
            experts: (0..experts.experts)
                .map(|e| [gate, up, down].map(|name| format!("{prefix}.experts.{e}.{name}.weight")))
                .collect(),
        })
    }
}

/// Every tensor the configuration implies, with its whole shape and how it splits.
pub(super) fn expected_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>, Split)> {
    use Split::*;
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.q_width(), cfg.kv_width());
    let v = cfg.vocab_size;
    let mut all = vec![
        ("model.embed_tokens.weight".to_string(), vec![v, h], Vocab),
        ("model.norm.weight".to_string(), vec![h], Whole),
    ];
    if !cfg.tie_word_embeddings {
        all.push(("lm_head.weight".to_string(), vec![v, h], Vocab));
    }
    for layer in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{layer}");
        let a = format!("{p}.self_attn");
        all.extend([
            (format!("{p}.input_layernorm.weight"), vec![h], Whole),
            (
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                Whole,
            ),
            (format!("{a}.q_proj.weight"), vec![q, h], Rows),
            (format!("{a}.k_proj.weight"), vec![kv, h], KvRows),
            (format!("{a}.v_proj.weight"), vec![kv, h], KvRows),
            (format!("{a}.o_proj.weight"), vec![h, q], Columns),
        ]);
        match (ExpertNames::new(cfg, layer), &cfg.experts) {
            (Some(names), Some(experts)) => {
                let (e, ei) = (experts.experts, experts.expert_intermediate_size);
                all.push((names.router, vec![e, h], Whole));
                for (expert, [gate, up, down]) in names.experts.into_iter().enumerate() {
                    all.extend([
                        (gate, vec![ei, h], Expert(expert)),
                        (up, vec![ei, h], Expert(expert)),
                        (down, vec![h, ei], Expert(expert)),
                    ]);
                }
            }
            _ => all.extend([
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h], Rows),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h], Rows),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i], Columns),
            ]),
        }
        if cfg.qkv_bias {
            all.extend([
                (format!("{a}.q_proj.bias"), vec![q], Rows),
                (format!("{a}.k_proj.bias"), vec![kv], KvRows),
                (format!("{a}.v_proj.bias"), vec![kv], KvRows),
            ]);
        }
        if cfg.o_bias {
            all.push((format!("{a}.o_proj.bias"), vec![h], Whole));
        }
        if cfg.mlp_bias {
            all.extend([
                (format!("{p}.mlp.gate_proj.bias"), vec![i], Rows),
                (format!("{p}.mlp.up_proj.bias"), vec![i], Rows),
                (format!("{p}.mlp.down_proj.bias"), vec![h], Whole),
            ]);
        }
        if cfg.qk_norm {
            all.extend([
                (format!("{a}.q_norm.weight"), vec![hd], Whole),
                (format!("{a}.k_norm.weight"), vec![hd], Whole),
            ]);
        }
    }
    all
}

impl Plan {
    /// The elements of a tensor of whole `shape` split as `split` that this rank reads
    /// (padding rows not counted: they are not read).
    pub(super) fn local_elements(&self, shape: &[usize], split: Split, vocab: usize) -> usize {
        let whole: usize = shape.iter().product();
        let row = whole / shape.first().copied().unwrap_or(1).max(1);
        match split {
            Split::Whole => whole,
            Split::Rows | Split::Columns => whole / self.ranks,
            Split::KvRows => whole / self.kv_part.1,
            Split::Vocab => self.vocab_range(vocab).len() * row,
            Split::Expert(expert) if self.holds_expert(expert) => whole,
            Split::Expert(_) => 0,
        }
    }
}

/// This rank's blocks of the checkpoint's tensors, read from the files with positioned
/// reads, only this rank's bytes: one read a block of whole rows, or rows a few MiB at a time
/// for a block of columns, then one upload. candle's sharded reader copies a block byte by
/// byte (measured on one H200 host, a 2.2 GB checkpoint: 233 MB/s a rank for two ranks,
/// against 5.4 GB/s for one rank, which candle reads whole), and maps the files, which a
/// file changed meanwhile turns into undefined behaviour; here it is an error or other
/// numbers. Names are relative to a prefix, as candle's `VarBuilder`'s.
#[derive(Clone)]
pub(super) struct Blocks {
    checkpoint: Arc<Checkpoint>,
    prefix: String,
    dtype: DType,
    device: Device,
    /// The bytes of the block being read, kept from one block to the next: fresh memory for
    /// each would be paged in again (a fresh buffer a block halved the load's speed).
    scratch: Arc<Mutex<Vec<u8>>>,
}

/// How many bytes of whole rows a block of columns reads at once.
const ROWS_AT_ONCE: usize = 4 << 20;

impl Blocks {
    pub(super) fn new(checkpoint: &Checkpoint, dtype: DType, device: &Device) -> Self {
        Self {
            checkpoint: Arc::new(checkpoint.clone()),
            prefix: String::new(),
            dtype,
            device: device.clone(),
            scratch: Arc::default(),
        }
    }

    /// The scratch buffer, `len` bytes of it.
    fn scratch(&self, len: usize) -> std::sync::MutexGuard<'_, Vec<u8>> {
        // A panic elsewhere leaves only bytes behind, all overwritten before use.
        let mut scratch = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        if scratch.len() < len {
            scratch.resize(len, 0);
        }
        scratch
    }

    /// The same files under `prefix.name`.
    pub(super) fn pp(&self, name: impl std::fmt::Display) -> Self {
        Self {
            prefix: self.path(&name.to_string()),
            ..self.clone()
        }
    }

    fn path(&self, name: &str) -> String {
        match self.prefix.is_empty() {
            true => name.to_string(),
            false => format!("{}.{name}", self.prefix),
        }
    }

    /// The element type `path` is stored in, its shape checked against `shape`: the
    /// checkpoint's check and the plan guarantee both (anything else is
    /// [`Error::ShardShape`]).
    fn stored(&self, path: &str, shape: &[usize]) -> Result<DType> {
        let info = self.checkpoint.tensors().get(path);
        match info {
            Some(info) if info.shape == shape => Ok(info.dtype),
            _ => Err(Error::ShardShape {
                name: path.to_string(),
                expected: shape.to_vec(),
                got: info.map(|i| i.shape.clone()).unwrap_or_default(),
            }),
        }
    }

    /// Block `part.0` of `part.1` along `dim` of `name` (whole shape `shape`, 1 or 2
    /// dimensions), in the model's type on its device: [`Error::ShardShape`] for another
    /// shape, [`Error::NotDivisible`] when it does not split.
    pub(super) fn get(
        &self,
        name: &str,
        shape: &[usize],
        dim: usize,
        part: (usize, usize),
    ) -> Result<Tensor> {
        let path = self.path(name);
        let stored = self.stored(&path, shape)?;
        if shape.is_empty() || shape.len() > 2 || dim >= shape.len() {
            return Err(Error::Argument {
                op: "CausalLm::load",
                why: format!("{path}: cannot split dimension {dim} of {shape:?}"),
            });
        }
        let (rank, ranks) = part;
        if ranks == 0 || rank >= ranks || !shape[dim].is_multiple_of(ranks) {
            return Err(Error::NotDivisible {
                name: path,
                shape: shape.to_vec(),
                dim,
                world_size: ranks,
            });
        }
        let size = stored.size_in_bytes();
        let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
        let row = cols * size;
        let mut local = shape.to_vec();
        local[dim] /= ranks;
        let len = local.iter().product::<usize>() * size;
        let mut scratch = self.scratch(len);
        let bytes = &mut scratch[..len];
        // One rank's block along any dimension is the whole tensor: whole rows.
        if dim == 0 || ranks == 1 {
            self.checkpoint
                .read_tensor_bytes(&path, (rank * len) as u64, bytes)?;
        } else {
            // A run of each row, from whole rows read a few MiB at a time.
            let run = local[1] * size;
            let batch = (ROWS_AT_ONCE / row.max(1)).clamp(1, rows);
            let mut chunk = vec![0u8; batch * row];
            for first in (0..rows).step_by(batch) {
                let count = batch.min(rows - first);
                let chunk = &mut chunk[..count * row];
                self.checkpoint
                    .read_tensor_bytes(&path, (first * row) as u64, chunk)?;
                for (i, r) in chunk.chunks_exact(row).enumerate() {
                    let at = (first + i) * run;
                    bytes[at..at + run].copy_from_slice(&r[rank * run..(rank + 1) * run]);
                }
            }
        }
        let block = Tensor::from_raw_buffer(bytes, stored, &local, &self.device)?;
        Ok(block.to_dtype(self.dtype)?)
    }

    /// The whole tensor `name` of shape `shape`.
    pub(super) fn whole(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get(name, shape, 0, (0, 1))
    }
}

/// A column-parallel projection: this rank's rows of the weight (and bias).
pub(super) fn column(
    vb: &Blocks,
    out: usize,
    inp: usize,
    bias: bool,
    part: (usize, usize),
) -> Result<Linear> {
    let weight = vb.get("weight", &[out, inp], 0, part)?;
    let bias = match bias {
        true => Some(vb.get("bias", &[out], 0, part)?),
        false => None,
    };
    Ok(Linear::new(weight, bias))
}

/// A row-parallel projection: this rank's columns of the weight, and all of the bias.
pub(super) fn row_parallel(
    vb: &Blocks,
    group: &TpGroup,
    inp: usize,
    out: usize,
    bias: bool,
) -> Result<RowParallelLinear> {
    let part = (group.rank(), group.size());
    let weight = vb.get("weight", &[out, inp], 1, part)?;
    let bias = match bias {
        true => Some(vb.whole("bias", &[out])?),
        false => None,
    };
    Ok(RowParallelLinear::from_block(group, weight, bias, inp, out))
}

pub(super) fn whole(vb: &Blocks, name: &str, len: usize) -> Result<Tensor> {
    vb.whole(name, &[len])
}

/// This rank's rows of a `[vocab, hidden]` table, zero-padded to the plan's block.
pub(super) fn vocab_rows(
    blocks: &Blocks,
    name: &str,
    plan: &Plan,
    cfg: &ModelConfig,
) -> Result<Tensor> {
    let range = plan.vocab_range(cfg.vocab_size);
    let h = cfg.hidden_size;
    let (dtype, device) = (blocks.dtype, &blocks.device);
    let stored = blocks.stored(name, &[cfg.vocab_size, h])?;
    let rows = if range.is_empty() {
        Tensor::zeros((0, h), dtype, device)?
    } else {
        // Rows of a row-major table are one run of bytes.
        let row_bytes = h * stored.size_in_bytes();
        let len = range.len() * row_bytes;
        let mut scratch = blocks.scratch(len);
        let bytes = &mut scratch[..len];
        blocks
            .checkpoint
            .read_tensor_bytes(name, (range.start * row_bytes) as u64, bytes)?;
        Tensor::from_raw_buffer(bytes, stored, &[range.len(), h], device)?.to_dtype(dtype)?
    };
    let pad = plan.vocab_rows - range.len();
    if pad == 0 {
        return Ok(rows);
    }
    Ok(Tensor::cat(
        &[rows, Tensor::zeros((pad, h), dtype, device)?],
        0,
    )?)
}
