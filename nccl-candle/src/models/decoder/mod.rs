//! The decoder of the Llama family, this rank's part of it: rotary attention with a KV
//! cache (grouped-query, optional q/k/v/o biases, Qwen3's per-head q/k norms, Mistral's
//! sliding window), a SwiGLU MLP or a mixture of them (Mixtral, Qwen3-MoE:
//! [`experts`](super::experts)), RMSNorms, a vocab-parallel embedding and head.

//!
//! How the weights split over the ranks: see [`plan`](super::plan).
//!
//! Just past 600 lines: the layers' host-driven pass and their loading from a checkpoint
//! read the same shapes; the static step (`static_step.rs`) and the rotary frequencies
//! (`rope.rs`) are apart.

use candle_core::{DType, Device, Tensor, D};

use super::checkpoint::Checkpoint;
use super::config::ModelConfig;
use super::experts::ExpertsMlp;
use super::plan::{column, expected_tensors, row_parallel, vocab_rows, whole, Blocks, Plan};
use super::rope::inverse_frequencies;
use crate::decode::{attend, KvCache, PositionIndex};
use crate::tp::{masked_lookup, RowParallelLinear, StackedLinear, TpGroup};
use crate::{fingerprint, Error, Result};

mod static_step;

fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(&x.contiguous()?, weight, eps)?)
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
    /// q, k and v, stacked.
    qkv: StackedLinear,
    o: RowParallelLinear,
    /// Qwen3's per-head norms of queries and keys.
    qk_norm: Option<(Tensor, Tensor)>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    cache: KvCache,
}

impl Attention {
    fn load(
        vb: &Blocks,
        group: &TpGroup,
        cfg: &ModelConfig,
        plan: &Plan,
        max_seq: usize,
    ) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let mine = (plan.rank, plan.ranks);
        let qk_norm = match cfg.qk_norm {
            true => Some((
                whole(&vb.pp("q_norm"), "weight", hd)?,
                whole(&vb.pp("k_norm"), "weight", hd)?,
            )),
            false => None,
        };
        Ok(Self {
            qkv: StackedLinear::new(&[
                column(&vb.pp("q_proj"), cfg.q_width(), h, cfg.qkv_bias, mine)?,
                column(
                    &vb.pp("k_proj"),
                    cfg.kv_width(),
                    h,
                    cfg.qkv_bias,
                    plan.kv_part,
                )?,
                column(
                    &vb.pp("v_proj"),
                    cfg.kv_width(),
                    h,
                    cfg.qkv_bias,
                    plan.kv_part,
                )?,
            ])?,
            o: row_parallel(&vb.pp("o_proj"), group, cfg.q_width(), h, cfg.o_bias)?,
            qk_norm,
            heads: plan.heads,
            kv_heads: plan.kv_heads,
            head_dim: hd,
            cache: KvCache::new(max_seq),
        })
    }

    /// This rank's heads' output, `[b, seq, heads / N * head_dim]` (o_proj's input), for
    /// `x` (`[b, seq, hidden]`) at `positions`.
    fn heads_out(&mut self, x: &Tensor, positions: &Positions, eps: f32) -> Result<Tensor> {
        let (b, seq, _) = x.dims3()?;
        let split =
            |t: Tensor, n: usize| -> Result<Tensor> { Ok(t.reshape((b, seq, n, self.head_dim))?) };
        let [q, k, v] = self.qkv.forward_n(x)?;
        let mut q = split(q, self.heads)?;
        let mut k = split(k, self.kv_heads)?;
        let v = split(v, self.kv_heads)?;
        if let Some((q_norm, k_norm)) = &self.qk_norm {
            q = rms_norm(&q, q_norm, eps)?;
            k = rms_norm(&k, k_norm, eps)?;
        }
        let rope = positions.rope();
        let heads_first = |t: Tensor| -> Result<Tensor> { Ok(t.transpose(1, 2)?.contiguous()?) };
        let q = candle_nn::rotary_emb::rope(&heads_first(q)?, &rope.cos, &rope.sin)?;
        let k = candle_nn::rotary_emb::rope(&heads_first(k)?, &rope.cos, &rope.sin)?;
        let v = heads_first(v)?;
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let mask = match positions {
            Positions::Device { mask, index, .. } => {
                // Scores and softmax in f32 whatever the weights' type, as the reference
                // models do.
                let (keys, values) = self.cache.write_at(&k, &v, index)?;
                return attend(&q, &keys, &values, mask, scale, DType::F32);
            }
            Positions::Host { mask, .. } => *mask,
        };
        let (k, v) = self.cache.append(&k, &v)?;
        let rep = self.heads / self.kv_heads;
        let k = repeat_kv(k, rep)?.contiguous()?;
        let v = repeat_kv(v, rep)?.contiguous()?;
        // Scores and softmax in f32 whatever the weights' type, as the reference models do.
        let mut scores = (q
            .to_dtype(DType::F32)?
            .matmul(&k.to_dtype(DType::F32)?.t()?)?
            * scale)?;
        if let Some(mask) = mask {
            scores = scores.broadcast_add(mask)?;
        }
        let weights = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
        Ok(weights
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, seq, self.heads * self.head_dim))?)
    }
}

/// Where a pass's positions come from: the host (a prompt, an eager step: the offset is
/// known, the caches are appended to) or the device (a static step: [`StepInputs`]).
enum Positions<'a> {
    Host {
        rope: Rope,
        mask: Option<&'a Tensor>,
    },
    Device {
        rope: Rope,
        mask: Tensor,
        /// The position as the caches' index (one for every layer).
        index: PositionIndex,
    },
}

impl Positions<'_> {
    fn rope(&self) -> &Rope {
        match self {
            Positions::Host { rope, .. } | Positions::Device { rope, .. } => rope,
        }
    }
}

/// This rank's MLP features: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
struct Mlp {
    /// gate and up, stacked.
    gate_up: StackedLinear,
    down: RowParallelLinear,
}

impl Mlp {
    fn load(vb: &Blocks, group: &TpGroup, cfg: &ModelConfig, plan: &Plan) -> Result<Self> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        let mine = (plan.rank, plan.ranks);
        Ok(Self {
            gate_up: StackedLinear::new(&[
                column(&vb.pp("gate_proj"), i, h, bias, mine)?,
                column(&vb.pp("up_proj"), i, h, bias, mine)?,
            ])?,
            down: row_parallel(&vb.pp("down_proj"), group, i, h, bias)?,
        })
    }

    /// This rank's `silu(gate(x)) * up(x)`: down_proj's input.
    fn gated(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up] = self.gate_up.forward_n(x)?;
        Ok((candle_nn::ops::silu(&gate)? * up)?)
    }
}

/// A layer's feed-forward part.
#[derive(Debug, Clone)]
enum FeedForward {
    /// Tensor parallel: this rank's MLP features.
    Dense(Mlp),
    /// Expert parallel: the router and this rank's experts.
    Experts(ExpertsMlp),
}

#[derive(Debug)]
struct Layer {
    input_norm: Tensor,
    attention: Attention,
    post_attention_norm: Tensor,
    mlp: FeedForward,
}

/// Rotary tables of some positions, `[seq, head_dim / 2]`.
#[derive(Debug, Clone)]
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

/// The model's output on a batch, this rank's part of a tensor-parallel decoder of the
/// Llama family loaded from a Hugging Face checkpoint.
///
/// Every rank of the group loads the same checkpoint with the same arguments, then calls
/// [`forward`](Self::forward) with the same token ids (each call is collectives on every
/// rank), as with any tensor-parallel model.
///
/// Not `Clone`: a copy would share the KV caches' storage, which candle writes in place.
#[derive(Debug)]
pub struct CausalLm {
    config: ModelConfig,
    group: TpGroup,
    plan: Plan,
    /// This rank's rows of the embedding table, padded to `plan.vocab_rows`.
    embed: Tensor,
    /// The first token of this rank's rows.
    vocab_start: usize,
    /// This rank's rows of the head; `None` when tied to the embedding table.
    head: Option<Tensor>,
    layers: Vec<Layer>,
    norm: Tensor,
    /// Rotary tables of positions `0..max_seq`.
    cos: Tensor,
    sin: Tensor,
    max_seq: usize,
    eps: f32,
    /// Bytes of the checkpoint's data this rank read (in the files' types).
    shard_bytes: usize,
    /// Positions the KV caches hold.
    cached: usize,
    /// A forward pass failed after the first layer's cache took its positions: the caches
    /// disagree on what they hold until [`reset`](CausalLm::reset).
    broken: bool,
    fused: bool,
}

impl CausalLm {
    /// Loads this rank's part of the model in `checkpoint` into `dtype` on `device`, with
    /// room for `max_seq` positions, over `group` (every rank calls it with the same
    /// arguments and device kind). Before anything is read, every rank checks what it can
    /// check alone (the plan: heads and MLP features split over the ranks, key/value heads
    /// split or replicate; every tensor the configuration implies is there with its shape and
    /// a float type; `max_seq` within `max_position_embeddings`) and the ranks compare the
    /// checkpoint's [fingerprint](Checkpoint::fingerprint) and these arguments: a refusal or
    /// a difference on any rank is an error on every rank ([`Error::PeerRefused`],
    /// [`Error::Mismatch`]), before any other collective. A rank that fails to read its
    /// shard tells the others the same way after loading.
    ///
    /// Every rank must reach this call: a rank that failed to open its checkpoint must take
    /// part as a refusal ([`load_dir`](Self::load_dir) does that). Each rank reads only its
    /// blocks' bytes, with positioned reads (no mapping): a file another process changes
    /// meanwhile gives an error or other weights, never undefined behaviour.
    pub fn load(
        checkpoint: &Checkpoint,
        group: &TpGroup,
        dtype: DType,
        device: &Device,
        max_seq: usize,
    ) -> Result<Self> {
        let cfg = checkpoint.config();
        // The fingerprint's own failure (a file unreadable here) is this rank's refusal.
        let checked = Self::check(checkpoint, group, dtype, max_seq).and_then(|plan| {
            let fp = checkpoint.fingerprint()?;
            Ok((plan, fingerprint(&(fp, format!("{dtype:?}"), max_seq))))
        });
        let (plan, fp, local) = match checked {
            Ok((plan, fp)) => (Some(plan), fp, Ok(())),
            Err(err) => (None, 0, Err(err)),
        };
        group.agree_checked("checkpoints and load arguments", fp, local, device)?;
        // agree_checked returned this rank's own error when it had one.
        let plan = plan.ok_or_else(|| unreachable_state("no plan after the agreement"))?;
        let (model, local) = match Self::read(checkpoint, group, cfg, plan, dtype, device, max_seq)
        {
            Ok(model) => (Some(model), Ok(())),
            Err(err) => (None, Err(err)),
        };
        group.agree_checked("loaded shards", fp, local, device)?;
        let model = model.ok_or_else(|| unreachable_state("no model after the agreement"))?;
        // Every rank loaded its shards: the exchanges of the mixtures of experts (collective).
        if let Some(key) = model.layers.iter().find_map(|layer| match &layer.mlp {
            FeedForward::Experts(experts) => Some(experts.key()),
            FeedForward::Dense(_) => None,
        }) {
            group.prepare_experts(key, device)?;
        }
        Ok(model)
    }

    /// [`Checkpoint::open`] then [`load`](Self::load), with a failure to open the
    /// directory on this rank counted as its refusal in the ranks' agreement: every rank
    /// returns an error (its own, or [`Error::PeerRefused`]) instead of some waiting for a
    /// rank that could not open its copy. Prefer it to opening the checkpoint separately.
    pub fn load_dir(
        dir: impl AsRef<std::path::Path>,
        group: &TpGroup,
        dtype: DType,
        device: &Device,
        max_seq: usize,
    ) -> Result<Self> {
        match Checkpoint::open(dir) {
            Ok(checkpoint) => Self::load(&checkpoint, group, dtype, device, max_seq),
            Err(err) => {
                group.agree_checked("checkpoints and load arguments", 0, Err(err), device)?;
                Err(unreachable_state("a refusal agreed as none"))
            }
        }
    }

    /// What a rank checks alone before loading.
    fn check(
        checkpoint: &Checkpoint,
        group: &TpGroup,
        dtype: DType,
        max_seq: usize,
    ) -> Result<Plan> {
        let cfg = checkpoint.config();
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Argument {
                op: "CausalLm::load",
                why: format!("{dtype:?} is not a float type the models run in"),
            });
        }
        if max_seq == 0 || max_seq > cfg.max_position_embeddings {
            return Err(Error::Argument {
                op: "CausalLm::load",
                why: format!(
                    "max_seq {max_seq} outside 1..={} (max_position_embeddings)",
                    cfg.max_position_embeddings
                ),
            });
        }
        // Nine tensors a layer at least, and three an expert: a layer or expert count past
        // the files' tensors is refused before a list of that many names is made.
        let held = checkpoint.tensors().len();
        let experts = cfg.experts.as_ref().map_or(0, |e| e.experts);
        if cfg.num_hidden_layers > held / 9 || experts > held / 3 {
            return Err(Error::Checkpoint {
                path: checkpoint.dir().join(super::checkpoint::CONFIG_FILE),
                fault: crate::CheckpointFault::Tensor,
                why: format!(
                    "num_hidden_layers {} and {experts} experts but the weights files hold \
                     {held} tensors",
                    cfg.num_hidden_layers,
                ),
            });
        }
        let plan = Plan::new(cfg, group.rank(), group.size())?;
        for (name, shape, _) in expected_tensors(cfg) {
            checkpoint.expect(&name, &shape)?;
        }
        Ok(plan)
    }

    fn read(
        checkpoint: &Checkpoint,
        group: &TpGroup,
        cfg: &ModelConfig,
        plan: Plan,
        dtype: DType,
        device: &Device,
        max_seq: usize,
    ) -> Result<Self> {
        let vb = Blocks::new(checkpoint, dtype, device);
        let model = vb.pp("model");
        let h = cfg.hidden_size;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let layer = model.pp("layers").pp(i);
            layers.push(Layer {
                input_norm: whole(&layer.pp("input_layernorm"), "weight", h)?,
                attention: Attention::load(&layer.pp("self_attn"), group, cfg, &plan, max_seq)?,
                post_attention_norm: whole(&layer.pp("post_attention_layernorm"), "weight", h)?,
                mlp: match ExpertsMlp::load(&vb, cfg, &plan, i, dtype)? {
                    Some(experts) => FeedForward::Experts(experts),
                    None => FeedForward::Dense(Mlp::load(&layer.pp("mlp"), group, cfg, &plan)?),
                },
            });
        }
        let norm = whole(&model.pp("norm"), "weight", h)?;
        let vocab = vocab_rows(&vb, "model.embed_tokens.weight", &plan, cfg)?;
        let head = match cfg.tie_word_embeddings {
            true => None,
            false => Some(vocab_rows(&vb, "lm_head.weight", &plan, cfg)?),
        };
        let angles: Vec<f64> = {
            let inverse = inverse_frequencies(cfg);
            (0..max_seq)
                .flat_map(|p| inverse.iter().map(move |f| p as f64 * f))
                .collect()
        };
        let half = cfg.head_dim / 2;
        let table = |f: fn(f64) -> f64| -> Result<Tensor> {
            let values: Vec<f32> = angles.iter().map(|&a| f(a) as f32).collect();
            Ok(Tensor::from_vec(values, (max_seq, half), device)?.to_dtype(dtype)?)
        };
        Ok(Self {
            config: cfg.clone(),
            group: group.clone(),
            plan,
            embed: vocab,
            vocab_start: plan.vocab_range(cfg.vocab_size).start,
            head,
            layers,
            norm,
            cos: table(f64::cos)?,
            sin: table(f64::sin)?,
            max_seq,
            eps: cfg.rms_norm_eps as f32,
            shard_bytes: expected_tensors(cfg)
                .iter()
                .map(|(name, shape, split)| {
                    let size = checkpoint
                        .tensors()
                        .get(name)
                        .map_or(0, |t| t.dtype.size_in_bytes());
                    plan.local_elements(shape, *split, cfg.vocab_size) * size
                })
                .sum(),
            cached: 0,
            broken: false,
            fused: false,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The positions the model has room for.
    pub fn max_seq(&self) -> usize {
        self.max_seq
    }

    /// The positions the KV caches hold (the `offset` the next [`forward`](Self::forward)
    /// takes).
    pub fn cached(&self) -> usize {
        self.cached
    }

    /// Runs each row-parallel output through the group's fused epilogue
    /// ([`TpGroup::all_reduce_add_rms_norm`]: one kernel with
    /// [`LsaCollectives`](crate::tp::LsaCollectives) where the tensors fit) or as the plain
    /// sequence (`false`, the default). The same model; only the norms' sums may go in
    /// another order. Every rank must choose alike.
    pub fn set_fused(&mut self, fused: bool) {
        self.fused = fused;
    }

    /// The logits of the last position, `[b, vocab]` in f32, the same on every rank, for
    /// `ids` (`[b, seq]`, `u32`) at positions `offset..offset + seq`; `offset` must be
    /// [`cached`](Self::cached) (the earlier positions went through earlier calls). Ids past
    /// the vocabulary embed to zeros.
    ///
    /// Every rank calls it with the same ids and offset: a refusal here (a stale offset, a
    /// sequence past `max_seq`, ids of another shape) is this rank's alone, and its peers
    /// then wait in the pass's collectives (as with any collective; the communicator's
    /// watchdog or abort ends the wait). A pass that fails past the embedding leaves the
    /// caches partly written: the model refuses every pass until [`reset`](Self::reset).
    pub fn forward(&mut self, ids: &Tensor, offset: usize) -> Result<Tensor> {
        let (_, seq) = ids.dims2()?;
        if self.broken {
            return Err(Error::Argument {
                op: "CausalLm::forward",
                why: "an earlier pass failed midway and left the KV caches partly written: \
                      reset() first"
                    .into(),
            });
        }
        if offset != self.cached || seq == 0 || seq > self.max_seq - offset {
            return Err(Error::Argument {
                op: "CausalLm::forward",
                why: format!(
                    "positions {offset}..{} with {} cached and room for {}",
                    offset.saturating_add(seq),
                    self.cached,
                    self.max_seq
                ),
            });
        }
        let rope = Rope {
            cos: self.cos.narrow(0, offset, seq)?,
            sin: self.sin.narrow(0, offset, seq)?,
        };
        let mask = mask(seq, offset, self.config.sliding_window, ids.device())?;
        let embedded = masked_lookup(&self.embed, ids, self.vocab_start)?;
        let x = self.group.layer_sum(embedded)?;
        // From here on some caches may take these positions and others not, should a layer
        // fail: broken until it ends.
        self.broken = true;
        let positions = Positions::Host {
            rope,
            mask: mask.as_ref(),
        };
        let last = self.layers_forward(x, &positions)?.narrow(1, seq - 1, 1)?;
        self.broken = false;
        self.cached = offset + seq;
        self.logits(&last)
    }

    /// The logits, `[b, vocab]` f32, of the normed last positions `last` (`[b, 1, hidden]`).
    fn logits(&self, last: &Tensor) -> Result<Tensor> {
        let head = self.head.as_ref().unwrap_or(&self.embed);
        let block = last.squeeze(1)?.matmul(&head.t()?)?;
        let logits = self.group.layer_gather(&block, 1)?;
        Ok(logits
            .narrow(1, 0, self.config.vocab_size)?
            .to_dtype(DType::F32)?)
    }

    /// The layers and the final norm: the normed residual stream of every position.
    fn layers_forward(&mut self, mut x: Tensor, positions: &Positions) -> Result<Tensor> {
        let eps = self.eps;
        let group = &self.group;
        // The static step's kernels never wait on the host (a graph captures them).
        let capturable = matches!(positions, Positions::Device { .. });
        if !self.fused {
            for layer in &mut self.layers {
                let h = rms_norm(&x, &layer.input_norm, eps)?;
                let heads = layer.attention.heads_out(&h, positions, eps)?;
                x = (x + layer.attention.o.forward(&heads)?)?;
                let h = rms_norm(&x, &layer.post_attention_norm, eps)?;
                let out = match &layer.mlp {
                    FeedForward::Dense(mlp) => mlp.down.forward(&mlp.gated(&h)?)?,
                    FeedForward::Experts(experts) => experts.forward(group, &h, capturable)?,
                };
                x = (&x + out)?;
            }
            return rms_norm(&x, &self.norm, eps);
        }
        // `x` the residual stream, `h` its norm for the next sublayer: each row-parallel
        // sum, the residual add and the next norm as one op.
        let first = self.layers.first().map_or(&self.norm, |l| &l.input_norm);
        let mut h = rms_norm(&x, first, eps)?;
        for i in 0..self.layers.len() {
            let next = match self.layers.get(i + 1) {
                Some(layer) => layer.input_norm.clone(),
                None => self.norm.clone(),
            };
            let layer = &mut self.layers[i];
            let heads = layer.attention.heads_out(&h, positions, eps)?;
            (x, h) = layer.attention.o.forward_add_rms_norm(
                &heads,
                &x,
                &layer.post_attention_norm,
                eps,
            )?;
            (x, h) = match &layer.mlp {
                FeedForward::Dense(mlp) => {
                    mlp.down
                        .forward_add_rms_norm(&mlp.gated(&h)?, &x, &next, eps)?
                }
                FeedForward::Experts(experts) => {
                    // The experts' output is whole already: the add and the norm only.
                    let x = (&x + experts.forward(group, &h, capturable)?)?;
                    let h = rms_norm(&x, &next, eps)?;
                    (x, h)
                }
            };
        }
        Ok(h)
    }

    /// Forgets every position (empties the KV caches, keeping their memory, cleared).
    pub fn reset(&mut self) -> Result<()> {
        self.cached = 0;
        self.broken = true;
        for layer in &mut self.layers {
            layer.attention.cache.reset()?;
        }
        self.broken = false;
        Ok(())
    }

    /// The bytes of the checkpoint's data this rank read, in the files' types: its part of
    /// the split tensors and the whole of the others (what loading moved from the files).
    pub fn shard_bytes(&self) -> usize {
        self.shard_bytes
    }

    /// This rank's query heads, key/value heads, MLP features and vocabulary rows.
    pub fn local_sizes(&self) -> (usize, usize, usize, usize) {
        let p = &self.plan;
        (p.heads, p.kv_heads, p.intermediate, p.vocab_rows)
    }

    /// The experts of each mixture-of-experts layer this rank holds (0 for a dense model).
    pub fn local_experts(&self) -> usize {
        self.plan.local_experts
    }

    /// Whether the mixture-of-experts layers send each token to its experts' ranks and back
    /// (nccl-rs's expert exchange, made at load); `false` for a dense model, one rank, a
    /// group without a communicator, a shape the exchange does not take (rows not of whole
    /// 16-byte vectors, more than its experts or ranks) or where it could not be made on
    /// every rank (a GPU before sm_80, ...): each rank then runs its experts on every token
    /// and the ranks sum, the same model.
    pub fn exchanges_experts(&self) -> bool {
        self.layers.iter().any(|layer| match &layer.mlp {
            FeedForward::Experts(experts) => {
                self.group.expert_exchange_tokens(experts.key()).is_some()
            }
            FeedForward::Dense(_) => false,
        })
    }
}

/// An error for a state the agreement rules out (kept typed rather than a panic).
fn unreachable_state(why: &str) -> Error {
    Error::Argument {
        op: "CausalLm::load",
        why: why.into(),
    }
}

/// The additive mask of `seq` queries at positions `offset..` over keys `0..offset + seq`:
/// minus infinity where a key is later than the query or (with a window `w`) `w` or more
/// positions earlier (a query sees itself and the `w - 1` before it, as Hugging Face's and
/// vLLM's Mistral do). `None` when nothing is masked.
fn mask(
    seq: usize,
    offset: usize,
    window: Option<usize>,
    device: &Device,
) -> Result<Option<Tensor>> {
    let keys = offset + seq;
    let hidden = |i: usize, j: usize| {
        let query = offset + i;
        j > query || window.is_some_and(|w| query - j >= w)
    };
    let any = (0..seq).any(|i| (0..keys).any(|j| hidden(i, j)));
    if !any {
        return Ok(None);
    }
    let values: Vec<f32> = (0..seq)
        .flat_map(|i| (0..keys).map(move |j| if hidden(i, j) { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Some(Tensor::from_vec(values, (seq, keys), device)?))
}

/// Greedy choice per row of `logits` (`[b, vocab]`).
pub fn argmax(logits: &Tensor) -> Result<Tensor> {
    Ok(logits.argmax(D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_hide_the_keys_they_should() {
        let m = mask(3, 2, Some(2), &Device::Cpu).unwrap().unwrap();
        let rows = m.to_vec2::<f32>().unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(rows[0], [inf, 0.0, 0.0, inf, inf]);
        assert_eq!(rows[2], [inf, inf, inf, 0.0, 0.0]);
        assert!(mask(1, 5, None, &Device::Cpu).unwrap().is_none());
        assert!(mask(1, 5, Some(6), &Device::Cpu).unwrap().is_none());
        assert!(mask(1, 5, Some(5), &Device::Cpu).unwrap().is_some());
    }
}
