//! A Llama-style decoder split over a tensor-parallel group: RMSNorm, rotary attention with
//! a KV cache (grouped-query when `kv_heads < heads`), SwiGLU MLP, a vocab-parallel
//! embedding and a column-parallel head whose logits are gathered. Each rank holds
//! `heads / N` query heads and `kv_heads / N` key/value heads (q, k, v column-parallel, o
//! row-parallel) and `intermediate / N` MLP features (gate, up column-parallel, down
//! row-parallel): two all-reduces per layer, one for the embedding, one all-gather for the
//! logits. With a one-rank group it is the plain model.
//!
//! Fused ([`Llama::set_fused`]), the forward pass is arranged so that each row-parallel
//! output goes through the group's epilogue op, `TpGroup::all_reduce_add_rms_norm` (sum,
//! residual add, RMSNorm: one kernel with `LsaCollectives`): o_proj's with the layer's
//! `post_attention_layernorm`, down_proj's with the next layer's `input_layernorm` (the final
//! norm after the last layer). The first layer's input norm stays a plain RMSNorm. The same
//! model, the same roundings; only the norms' sums of squares may go in another order.
//!
//! Tensor names follow Hugging Face's Llama (`model.layers.0.self_attn.q_proj.weight`, ...).
//!
//! Why past 600 lines: one model, its two ways of taking positions (host-driven and the static
//! step a graph captures) side by side, so that what differs between them is seen at once.

use candle_core::{DType, Device, Tensor, D};
use candle_nn::var_builder::ShardedVarBuilder;
use nccl_candle::decode::{attend, KvCache, PositionIndex, StaticDecode, StepInputs};
use nccl_candle::tp::{
    load_replicated, ColumnParallelLinear, RowParallelLinear, StackedLinear, TpGroup,
    VocabParallelEmbedding,
};
use nccl_candle::{Error, Result};

/// Rotary embedding base.
pub const ROPE_THETA: f64 = 10_000.0;
/// RMSNorm's epsilon.
pub const RMS_EPS: f32 = 1e-5;

/// A model's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Config {
    /// Tokens.
    pub vocab: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the MLP.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (a divisor of `heads`; fewer is grouped-query attention).
    pub kv_heads: usize,
}

impl Config {
    /// About 20M parameters: quick to check anywhere, too small for tensor parallelism to
    /// pay. Grouped-query (16 query heads, 8 key/value heads).
    pub fn small() -> Self {
        Self {
            vocab: 8192,
            hidden: 512,
            intermediate: 1408,
            layers: 4,
            heads: 16,
            kv_heads: 8,
        }
    }

    /// About 1.9G parameters (Llama-2-7B's widths, 8 layers): where splitting the decode's
    /// weight reads over GPUs should pay.
    pub fn large() -> Self {
        Self {
            vocab: 32000,
            hidden: 4096,
            intermediate: 11008,
            layers: 8,
            heads: 32,
            kv_heads: 32,
        }
    }

    /// About 7.4G parameters (Llama-2-70B's widths, grouped-query, 8 layers): a decode step
    /// reads 14.8 GB of bf16 weights, long enough on one GPU for the launches of candle's
    /// kernels (about a millisecond a step) not to hide what splitting the reads saves.
    pub fn xl() -> Self {
        Self {
            vocab: 32000,
            hidden: 8192,
            intermediate: 28672,
            layers: 8,
            heads: 64,
            kv_heads: 8,
        }
    }

    /// The width of a head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// The number of parameters.
    pub fn parameters(&self) -> usize {
        let kv = self.kv_heads * self.head_dim();
        let attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv;
        let mlp = 3 * self.hidden * self.intermediate;
        let layer = attention + mlp + 2 * self.hidden;
        2 * self.vocab * self.hidden + self.layers * layer + self.hidden
    }

    /// Refuses sizes that do not split into whole heads over `world_size` ranks. Depends only
    /// on the configuration and the world size, so every rank gives the same verdict.
    pub fn check(&self, world_size: usize) -> Result<()> {
        let invalid = |why: String| {
            Err(Error::Argument {
                op: "llama config",
                why,
            })
        };
        if self.heads == 0 || self.kv_heads == 0 || !self.hidden.is_multiple_of(self.heads) {
            return invalid(format!("{} heads do not split {}", self.heads, self.hidden));
        }
        if !self.heads.is_multiple_of(self.kv_heads) || !self.head_dim().is_multiple_of(2) {
            return invalid(format!(
                "{} heads need a whole number of query heads per key/value head ({}) and an \
                 even head width",
                self.heads, self.kv_heads
            ));
        }
        for (what, n) in [
            ("query heads", self.heads),
            ("key/value heads", self.kv_heads),
            ("MLP features", self.intermediate),
            ("tokens", self.vocab),
        ] {
            if !n.is_multiple_of(world_size) {
                return invalid(format!("{n} {what} do not split over {world_size} ranks"));
            }
        }
        Ok(())
    }
}

/// RMSNorm with a learned scale, whole on every rank.
#[derive(Debug, Clone)]
struct RmsNorm {
    weight: Tensor,
}

impl RmsNorm {
    fn load(vb: &ShardedVarBuilder, hidden: usize) -> Result<Self> {
        Ok(Self {
            weight: load_replicated(vb, "weight", &[hidden])?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(
            &x.contiguous()?,
            &self.weight,
            RMS_EPS,
        )?)
    }
}

/// Repeats each key/value head `n` times, for grouped-query attention.
fn repeat_kv(x: Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x);
    }
    let (b, heads, seq, dim) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .broadcast_as((b, heads, n, seq, dim))?
        .reshape((b, heads * n, seq, dim))?)
}

/// This rank's attention heads.
#[derive(Debug)]
struct Attention {
    /// q, k and v.
    qkv: StackedLinear,
    o: RowParallelLinear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    cache: KvCache,
}

impl Attention {
    fn load(vb: &ShardedVarBuilder, group: &TpGroup, cfg: &Config, max_seq: usize) -> Result<Self> {
        let (hidden, head_dim) = (cfg.hidden, cfg.head_dim());
        let kv = cfg.kv_heads * head_dim;
        Ok(Self {
            qkv: StackedLinear::from_columns(&[
                ColumnParallelLinear::load(&vb.pp("q_proj"), group, hidden, hidden, false)?,
                ColumnParallelLinear::load(&vb.pp("k_proj"), group, hidden, kv, false)?,
                ColumnParallelLinear::load(&vb.pp("v_proj"), group, hidden, kv, false)?,
            ])?,
            o: RowParallelLinear::load(&vb.pp("o_proj"), group, hidden, hidden, false)?,
            heads: cfg.heads / group.size(),
            kv_heads: cfg.kv_heads / group.size(),
            head_dim,
            cache: KvCache::new(max_seq),
        })
    }

    /// `x`: `[b, seq, hidden]` at `positions`.
    fn forward(&mut self, x: &Tensor, positions: &Positions) -> Result<Tensor> {
        let heads = self.heads_out(x, positions)?;
        self.o.forward(&heads)
    }

    /// This rank's heads' output, `[b, seq, heads / N * head_dim]`: o_proj's input.
    fn heads_out(&mut self, x: &Tensor, positions: &Positions) -> Result<Tensor> {
        let (b, seq, _) = x.dims3()?;
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            Ok(t.reshape((b, seq, n, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let mut qkv = self.qkv.forward(x)?.into_iter();
        let mut next = || {
            qkv.next().ok_or_else(|| Error::Argument {
                op: "Llama::forward",
                why: "q, k and v: fewer than three projections".into(),
            })
        };
        let q = heads(next()?, self.heads)?;
        let k = heads(next()?, self.kv_heads)?;
        let v = heads(next()?, self.kv_heads)?;
        let (cos, sin) = (&positions.cos, &positions.sin);
        let q = candle_nn::rotary_emb::rope(&q, cos, sin)?;
        let k = candle_nn::rotary_emb::rope(&k, cos, sin)?;
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        if let Some(index) = &positions.index {
            let mask = positions.mask.as_ref().ok_or_else(|| Error::Argument {
                op: "Llama::decode_step",
                why: "a device-positioned step without its mask".into(),
            })?;
            let (keys, values) = self.cache.write_at(&k, &v, index)?;
            // Scores in the model's type, as the host-driven pass below.
            return attend(&q, &keys, &values, mask, scale, q.dtype());
        }
        let (k, v) = self.cache.append(&k, &v)?;
        let rep = self.heads / self.kv_heads;
        let k = repeat_kv(k, rep)?.contiguous()?;
        let v = repeat_kv(v, rep)?.contiguous()?;
        let mut scores = (q.matmul(&k.t()?)? * scale)?;
        if let Some(mask) = &positions.mask {
            scores = scores.broadcast_add(mask)?;
        }
        let weights = candle_nn::ops::softmax_last_dim(&scores)?;
        Ok(weights
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, seq, self.heads * self.head_dim))?)
    }
}

/// A pass's positions: their rotary rows, the additive mask (`None`: nothing hidden), and,
/// for a static decode step, the position on the device as the caches' index.
struct Positions {
    cos: Tensor,
    sin: Tensor,
    mask: Option<Tensor>,
    index: Option<PositionIndex>,
}

/// This rank's MLP features: `down(silu(gate(x)) * up(x))`.
#[derive(Debug)]
struct Mlp {
    /// gate and up.
    gate_up: StackedLinear,
    down: RowParallelLinear,
}

impl Mlp {
    fn load(vb: &ShardedVarBuilder, group: &TpGroup, cfg: &Config) -> Result<Self> {
        let (h, i) = (cfg.hidden, cfg.intermediate);
        Ok(Self {
            gate_up: StackedLinear::from_columns(&[
                ColumnParallelLinear::load(&vb.pp("gate_proj"), group, h, i, false)?,
                ColumnParallelLinear::load(&vb.pp("up_proj"), group, h, i, false)?,
            ])?,
            down: RowParallelLinear::load(&vb.pp("down_proj"), group, i, h, false)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.down.forward(&self.gated(x)?)
    }

    /// This rank's `silu(gate(x)) * up(x)`: down_proj's input.
    fn gated(&self, x: &Tensor) -> Result<Tensor> {
        let parts = self.gate_up.forward(x)?;
        let [gate, up] = parts.as_slice() else {
            return Err(Error::Argument {
                op: "Llama::forward",
                why: "gate and up: not two projections".into(),
            });
        };
        Ok((candle_nn::ops::silu(gate)? * up)?)
    }
}

#[derive(Debug)]
struct Block {
    attention_norm: RmsNorm,
    attention: Attention,
    mlp_norm: RmsNorm,
    mlp: Mlp,
}

/// The decoder, this rank's part of it.
#[derive(Debug)]
pub struct Llama {
    group: TpGroup,
    vocab: usize,
    /// Positions the caches hold.
    cached: usize,
    embed: VocabParallelEmbedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: ColumnParallelLinear,
    /// Rotary tables, `[max_seq, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
    max_seq: usize,
    dtype: DType,
    /// Whether the row-parallel outputs go through the group's epilogue op.
    fused: bool,
}

impl Llama {
    /// Loads this rank's part of the model through `vb` (its type and device), with room for
    /// `max_seq` positions. `cfg` must pass [`Config::check`] for the group's size.
    pub fn load(
        vb: &ShardedVarBuilder,
        group: &TpGroup,
        cfg: &Config,
        max_seq: usize,
    ) -> Result<Self> {
        cfg.check(group.size())?;
        let model = vb.pp("model");
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let layer = model.pp("layers").pp(i);
            blocks.push(Block {
                attention_norm: RmsNorm::load(&layer.pp("input_layernorm"), cfg.hidden)?,
                attention: Attention::load(&layer.pp("self_attn"), group, cfg, max_seq)?,
                mlp_norm: RmsNorm::load(&layer.pp("post_attention_layernorm"), cfg.hidden)?,
                mlp: Mlp::load(&layer.pp("mlp"), group, cfg)?,
            });
        }
        let (cos, sin) = rope_tables(cfg.head_dim(), max_seq, vb.dtype(), vb.device())?;
        Ok(Self {
            group: group.clone(),
            vocab: cfg.vocab,
            cached: 0,
            embed: VocabParallelEmbedding::load(
                &model.pp("embed_tokens"),
                group,
                cfg.vocab,
                cfg.hidden,
            )?,
            blocks,
            norm: RmsNorm::load(&model.pp("norm"), cfg.hidden)?,
            lm_head: ColumnParallelLinear::load(
                &vb.pp("lm_head"),
                group,
                cfg.hidden,
                cfg.vocab,
                false,
            )?,
            cos,
            sin,
            max_seq,
            dtype: vb.dtype(),
            fused: false,
        })
    }

    /// Runs the forward pass fused (`true`: each row-parallel output through
    /// `TpGroup::all_reduce_add_rms_norm`, see the module's description) or as the plain
    /// model (`false`, the default). Every rank must choose alike.
    pub fn set_fused(&mut self, fused: bool) {
        self.fused = fused;
    }

    /// The logits of the last position, `[b, vocab]`, the same on every rank, for `ids`
    /// (`[b, seq]`, `u32`) at positions `offset..offset + seq`, after positions `0..offset`
    /// went through earlier calls (the KV cache holds them).
    pub fn forward(&mut self, ids: &Tensor, offset: usize) -> Result<Tensor> {
        let (_, seq) = ids.dims2()?;
        if seq == 0 || offset + seq > self.max_seq {
            return Err(Error::Argument {
                op: "Llama::forward",
                why: format!(
                    "positions {offset}..{} outside the model's 0..{}",
                    offset + seq,
                    self.max_seq
                ),
            });
        }
        let positions = Positions {
            cos: self.cos.narrow(0, offset, seq)?,
            sin: self.sin.narrow(0, offset, seq)?,
            mask: match seq {
                1 => None,
                _ => Some(causal_mask(seq, offset, self.dtype, ids.device())?),
            },
            index: None,
        };
        if offset != self.cached {
            return Err(Error::Argument {
                op: "Llama::forward",
                why: format!("offset {offset} with {} positions cached", self.cached),
            });
        }
        let x = self.embed.forward(ids)?;
        let logits = self.layers_and_head(x, &positions)?;
        self.cached = offset + seq;
        Ok(logits)
    }

    /// The layers, the final norm and the head on the embeddings `x`: the last position's
    /// logits, `[b, vocab]`.
    fn layers_and_head(&mut self, x: Tensor, positions: &Positions) -> Result<Tensor> {
        let seq = x.dim(1)?;
        let last = match self.fused {
            true => self.forward_fused(x, positions)?.narrow(1, seq - 1, 1)?,
            false => {
                let x = self.forward_blocks(x, positions)?;
                self.norm.forward(&x.narrow(1, seq - 1, 1)?)?
            }
        };
        Ok(self.lm_head.forward_gathered(&last)?.squeeze(1)?)
    }

    /// The decoder layers on the embeddings `x`: the residual stream after the last one.
    fn forward_blocks(&mut self, mut x: Tensor, positions: &Positions) -> Result<Tensor> {
        for block in &mut self.blocks {
            let attended = block
                .attention
                .forward(&block.attention_norm.forward(&x)?, positions)?;
            x = (x + attended)?;
            x = (&x + block.mlp.forward(&block.mlp_norm.forward(&x)?)?)?;
        }
        Ok(x)
    }

    /// The decoder layers and the final norm on the embeddings `x`, each row-parallel output
    /// summed, added to the residual stream and normalised for the next sublayer in one op:
    /// the final norm of every position.
    fn forward_fused(&mut self, mut x: Tensor, positions: &Positions) -> Result<Tensor> {
        // `x` is the residual stream, `h` its norm for the next sublayer.
        let first = self
            .blocks
            .first()
            .map_or(&self.norm, |b| &b.attention_norm);
        let mut h = first.forward(&x)?;
        for i in 0..self.blocks.len() {
            let next = match self.blocks.get(i + 1) {
                Some(block) => block.attention_norm.weight.clone(),
                None => self.norm.weight.clone(),
            };
            let block = &mut self.blocks[i];
            let heads = block.attention.heads_out(&h, positions)?;
            (x, h) = block.attention.o.forward_add_rms_norm(
                &heads,
                &x,
                &block.mlp_norm.weight,
                RMS_EPS,
            )?;
            let gated = block.mlp.gated(&h)?;
            (x, h) = block
                .mlp
                .down
                .forward_add_rms_norm(&gated, &x, &next, RMS_EPS)?;
        }
        Ok(h)
    }

    /// Forgets every position (empties the KV caches, keeping their memory).
    pub fn reset(&mut self) -> Result<()> {
        self.cached = 0;
        for block in &mut self.blocks {
            block.attention.cache.reset()?;
        }
        Ok(())
    }
}

// SAFETY: a step touches the weights, the rotary tables, the blocks' caches (allocated by the
// prompt's append, kept by `reset` and by a prompt of the same batch), the inputs and the
// group's collectives, all owned here or by the inputs; it enqueues candle ops and the
// group's collectives on the device's stream only, keeps no tensor it makes, and refuses
// inputs of another `max_seq` or batch.
unsafe impl StaticDecode for Llama {
    fn device(&self) -> &Device {
        self.cos.device()
    }

    fn group(&self) -> &TpGroup {
        &self.group
    }

    fn vocab(&self) -> usize {
        self.vocab
    }

    fn max_seq(&self) -> usize {
        self.max_seq
    }

    fn cached(&self) -> usize {
        self.cached
    }

    fn cache_batch(&self) -> Option<usize> {
        self.blocks.first().and_then(|b| b.attention.cache.batch())
    }

    fn prefill(&mut self, ids: &Tensor) -> Result<Tensor> {
        self.reset()?;
        self.forward(ids, 0)
    }

    fn check_step(&self, batch: usize) -> Result<u64> {
        if self.cached == 0 || self.cache_batch() != Some(batch) {
            return Err(Error::Argument {
                op: "Llama::decode_step",
                why: format!(
                    "{} positions of batch {:?} held: a step of batch {batch} needs a prompt \
                     of that batch first",
                    self.cached,
                    self.cache_batch()
                ),
            });
        }
        Ok(nccl_candle::fingerprint(&(self.fused, self.vocab)))
    }

    fn decode_step(&mut self, inputs: &StepInputs) -> Result<()> {
        if inputs.max_seq() != self.max_seq || self.cache_batch() != Some(inputs.batch()) {
            return Err(Error::Argument {
                op: "Llama::decode_step",
                why: format!(
                    "inputs of batch {} and {} positions for caches of batch {:?} and {}",
                    inputs.batch(),
                    inputs.max_seq(),
                    self.cache_batch(),
                    self.max_seq
                ),
            });
        }
        let (cos, sin) = inputs.rope_rows(&self.cos, &self.sin)?;
        let kv_heads = self.blocks.first().map_or(1, |b| b.attention.kv_heads);
        let head_dim = self.blocks.first().map_or(2, |b| b.attention.head_dim);
        let positions = Positions {
            cos,
            sin,
            mask: Some(inputs.mask(None, self.dtype)?),
            index: Some(inputs.position_index((inputs.batch(), kv_heads, 1, head_dim))?),
        };
        let x = self.embed.forward(&inputs.ids()?)?;
        let logits = self.layers_and_head(x, &positions)?;
        inputs.finish(&logits)
    }

    fn set_cached(&mut self, cached: usize) -> Result<()> {
        if cached > self.max_seq {
            return Err(Error::Argument {
                op: "Llama::set_cached",
                why: format!("{cached} positions with room for {}", self.max_seq),
            });
        }
        for block in &mut self.blocks {
            block.attention.cache.set_len(cached)?;
        }
        self.cached = cached;
        Ok(())
    }
}

/// Rotary tables for positions `0..max_seq`: `cos` and `sin` of `p * theta^(-2i/head_dim)`,
/// `[max_seq, head_dim / 2]`, computed in f64 on the host.
fn rope_tables(
    head_dim: usize,
    max_seq: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let angles: Vec<f64> = (0..max_seq)
        .flat_map(|p| {
            (0..half).map(move |i| p as f64 * ROPE_THETA.powf(-2.0 * i as f64 / head_dim as f64))
        })
        .collect();
    let table = |f: fn(f64) -> f64| -> Result<Tensor> {
        let values: Vec<f32> = angles.iter().map(|&a| f(a) as f32).collect();
        Ok(Tensor::from_vec(values, (max_seq, half), device)?.to_dtype(dtype)?)
    };
    Ok((table(f64::cos)?, table(f64::sin)?))
}

/// `[seq, offset + seq]`: 0 where query `i` (position `offset + i`) may see key `j`, minus
/// infinity where `j` is later.
fn causal_mask(seq: usize, offset: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let keys = offset + seq;
    let values: Vec<f32> = (0..seq)
        .flat_map(|i| {
            (0..keys).map(move |j| {
                if j > offset + i {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(values, (seq, keys), device)?.to_dtype(dtype)?)
}

/// Greedy choice per row of `logits` (`[b, vocab]`), on the device.
pub fn argmax(logits: &Tensor) -> Result<Tensor> {
    Ok(logits.argmax(D::Minus1)?)
}
