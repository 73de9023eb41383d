//! The mixture-of-experts MLP of Mixtral and Qwen3-MoE, expert parallel: every rank holds
//! the router and `E / N` experts whole (see [`plan`](super::plan)).
//!
//! Each token's router logits go through a softmax (in `f32`), the `experts_per_token` best
//! experts are chosen and their weights kept (divided by their sum where the family does),
//! and the token's output is the weighted sum of those experts' SwiGLU MLPs.
//!
//! Over a communicator the tokens (the same on every rank: attention is tensor parallel)
//! are shared out, each rank dispatching its share to the experts' ranks with nccl-rs's
//! expert exchange, running its own experts on the rows it received, and combining the
//! outputs back; an all-gather then gives every rank every token's output. Without one
//! (one rank, threads), each rank runs its experts on every token and the ranks sum.

use candle_core::{DType, Tensor, D};

use super::config::{ExpertsConfig, ModelConfig};
use super::plan::{Blocks, ExpertNames, Plan};
use crate::tp::{ExpertsKey, TpGroup};
use crate::Result;

/// This rank's part of a mixture-of-experts MLP.
#[derive(Debug, Clone)]
pub(super) struct ExpertsMlp {
    /// `[experts, hidden]`, whole.
    router: Tensor,
    /// This rank's experts' gate and up projections, transposed for the batched product:
    /// `[local, hidden, 2 × features]`.
    gate_up: Tensor,
    /// Their down projections, transposed: `[local, features, hidden]`.
    down: Tensor,
    /// This rank's first expert.
    first: usize,
    local: usize,
    features: usize,
    top_k: usize,
    norm_topk_prob: bool,
    key: ExpertsKey,
}

impl ExpertsMlp {
    /// Layer `layer`'s mixture, this rank's experts of it; `None` for a dense layer.
    pub(super) fn load(
        blocks: &Blocks,
        cfg: &ModelConfig,
        plan: &Plan,
        layer: usize,
        dtype: DType,
    ) -> Result<Option<Self>> {
        let (Some(names), Some(experts)) = (ExpertNames::new(cfg, layer), &cfg.experts) else {
            return Ok(None);
        };
        let ExpertsConfig {
            experts: count,
            experts_per_token,
            expert_intermediate_size: features,
            norm_topk_prob,
            ..
        } = *experts;
        let h = cfg.hidden_size;
        let router = blocks.whole(&names.router, &[count, h])?;
        let first = plan.rank * plan.local_experts;
        let mut gate_up = Vec::with_capacity(plan.local_experts);
        let mut down = Vec::with_capacity(plan.local_experts);
        for [gate, up, down_name] in &names.experts[first..first + plan.local_experts] {
            let gate = blocks.whole(gate, &[features, h])?;
            let up = blocks.whole(up, &[features, h])?;
            gate_up.push(Tensor::cat(&[gate, up], 0)?);
            down.push(blocks.whole(down_name, &[h, features])?);
        }
        Ok(Some(Self {
            router,
            gate_up: Tensor::stack(&gate_up, 0)?.transpose(1, 2)?.contiguous()?,
            down: Tensor::stack(&down, 0)?.transpose(1, 2)?.contiguous()?,
            first,
            local: plan.local_experts,
            features,
            top_k: experts_per_token,
            norm_topk_prob,
            key: ExpertsKey {
                experts: count,
                top_k: experts_per_token,
                hidden: h,
                dtype,
            },
        }))
    }

    /// What the group's exchanges are made for.
    pub(super) fn key(&self) -> ExpertsKey {
        self.key
    }

    /// The MLP's output for `x` (`[b, seq, hidden]`, the same on every rank), the same on
    /// every rank: every expert's share, summed over the ranks.
    ///
    /// The host-driven pass (`capturable` false) runs each expert on the rows routed to it
    /// only (the counts read back on the host once a dispatch ended, or the routing without
    /// an exchange). The static step a CUDA graph captures (`capturable`) never waits on the
    /// host, and runs the same kernels eagerly as in the graph: each local expert on every
    /// row slot of the exchange's class (every token without an exchange), which reads every
    /// local expert's weights whatever the routing.
    pub(super) fn forward(&self, group: &TpGroup, x: &Tensor, capturable: bool) -> Result<Tensor> {
        let (b, seq, h) = x.dims3()?;
        let tokens = b * seq;
        if tokens == 0 {
            return Ok(x.zeros_like()?);
        }
        let x = x.reshape((tokens, h))?;
        let Some(max_tokens) = group.expert_exchange_tokens(self.key) else {
            let (routing, weights) = self.route(&x)?;
            let partial = match capturable {
                true => self.every_token(&x, &routing, &weights)?,
                false => self.routed_tokens(&x, &routing, &weights)?,
            };
            return Ok(group.layer_sum(partial)?.reshape((b, seq, h))?);
        };
        let mut outputs = Vec::new();
        for share in shares(tokens, group.size(), max_tokens, group.rank()) {
            let mine = x.narrow(0, share.mine, share.len)?.contiguous()?;
            let (routing, weights) = self.route(&mine)?;
            let out = group.exchange_experts(
                self.key,
                &mine,
                &routing,
                &weights,
                share.most,
                &mut |received, counts| match capturable {
                    true => self.experts(received),
                    false => self.counted(received, counts),
                },
            )?;
            let out = match share.len < share.most {
                true => {
                    let pad = Tensor::zeros((share.most - share.len, h), x.dtype(), x.device())?;
                    Tensor::cat(&[out, pad], 0)?
                }
                false => out,
            };
            outputs.push(group.all_gather_dim(&out, 0)?.narrow(0, 0, share.count)?);
        }
        Ok(Tensor::cat(&outputs, 0)?.reshape((b, seq, h))?)
    }

    /// Each token's experts (`[tokens, top_k]`, `u32`, best first) and their weights
    /// (`[tokens, top_k]`, `f32`).
    fn route(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        if x.dim(0)? == 0 {
            // No launch of a sort over no rows.
            let device = x.device();
            return Ok((
                Tensor::zeros((0, self.top_k), DType::U32, device)?,
                Tensor::zeros((0, self.top_k), DType::F32, device)?,
            ));
        }
        let logits = x.matmul(&self.router.t()?)?.to_dtype(DType::F32)?;
        let probabilities = candle_nn::ops::softmax_last_dim(&logits)?;
        let routing = probabilities
            .arg_sort_last_dim(false)?
            .narrow(D::Minus1, 0, self.top_k)?
            .contiguous()?;
        let mut weights = probabilities.gather(&routing, D::Minus1)?;
        if self.norm_topk_prob {
            weights = weights.broadcast_div(&weights.sum_keepdim(D::Minus1)?)?;
        }
        Ok((routing, weights.contiguous()?))
    }

    /// This rank's experts on their rows: `rows` `[local, n, hidden]` to `[local, n, hidden]`,
    /// `down(silu(gate(x)) × up(x))` for each expert's rows in one batched product each.
    fn experts(&self, rows: &Tensor) -> Result<Tensor> {
        let gate_up = rows.matmul(&self.gate_up)?;
        let gate = gate_up.narrow(D::Minus1, 0, self.features)?;
        let up = gate_up.narrow(D::Minus1, self.features, self.features)?;
        let gated = (candle_nn::ops::silu(&gate)? * up)?;
        Ok(gated.matmul(&self.down)?)
    }

    /// Local expert `local`'s MLP on its rows `rows` (`[n, hidden]`).
    fn expert(&self, local: usize, rows: &Tensor) -> Result<Tensor> {
        let gate_up = rows.matmul(&self.gate_up.get(local)?)?;
        let gate = gate_up.narrow(D::Minus1, 0, self.features)?;
        let up = gate_up.narrow(D::Minus1, self.features, self.features)?;
        let gated = (candle_nn::ops::silu(&gate)? * up)?;
        Ok(gated.matmul(&self.down.get(local)?)?)
    }

    /// [`experts`](Self::experts) on each expert's first `counts[e]` rows only (read back
    /// on the host), the other rows' outputs zeros.
    fn counted(&self, received: &Tensor, counts: &Tensor) -> Result<Tensor> {
        let (local, slots, h) = received.dims3()?;
        let device = received.device();
        // The dispatch ended before its counts are read: no copy waits behind it.
        device.synchronize()?;
        let counts: Vec<i32> = counts.to_vec1()?;
        let mut parts = Vec::with_capacity(2 * local);
        for (expert, &count) in counts.iter().enumerate().take(local) {
            let count = usize::try_from(count).unwrap_or(0).min(slots);
            if count > 0 {
                let rows = received.get(expert)?.narrow(0, 0, count)?;
                parts.push(self.expert(expert, &rows)?);
            }
            if count < slots {
                parts.push(Tensor::zeros((slots - count, h), received.dtype(), device)?);
            }
        }
        Ok(Tensor::cat(&parts, 0)?.reshape((local, slots, h))?)
    }

    /// This rank's experts' share of every token's output (`[tokens, hidden]`), each expert
    /// on the tokens routed to it (the routing read back on the host), weighted and summed
    /// in `f32` in expert order.
    fn routed_tokens(&self, x: &Tensor, routing: &Tensor, weights: &Tensor) -> Result<Tensor> {
        let (tokens, h) = x.dims2()?;
        let device = x.device();
        // Nothing of this rank's waits for a peer when the routing is copied back.
        device.synchronize()?;
        let experts: Vec<u32> = routing.flatten_all()?.to_vec1()?;
        let chosen: Vec<f32> = weights.flatten_all()?.to_vec1()?;
        let mut out = Tensor::zeros((tokens, h), DType::F32, device)?;
        for local in 0..self.local {
            let expert = self.first + local;
            let (rows, row_weights): (Vec<u32>, Vec<f32>) = experts
                .iter()
                .zip(&chosen)
                .enumerate()
                .filter(|(_, (&e, _))| e as usize == expert)
                .map(|(entry, (_, &w))| ((entry / self.top_k) as u32, w))
                .unzip();
            if rows.is_empty() {
                continue;
            }
            let index = Tensor::new(rows.as_slice(), device)?;
            let row_weights = Tensor::new(row_weights.as_slice(), device)?.unsqueeze(1)?;
            let y = self
                .expert(local, &x.index_select(&index, 0)?)?
                .to_dtype(DType::F32)?
                .broadcast_mul(&row_weights)?;
            out = out.index_add(&index, &y, 0)?;
        }
        Ok(out.to_dtype(x.dtype())?)
    }

    /// This rank's experts' share of every token's output (`[tokens, hidden]`): each expert
    /// run on every token, weighted by the token's weight for it (0 where not chosen), summed
    /// in `f32`.
    fn every_token(&self, x: &Tensor, routing: &Tensor, weights: &Tensor) -> Result<Tensor> {
        let (tokens, h) = x.dims2()?;
        let rows = x
            .unsqueeze(0)?
            .broadcast_as((self.local, tokens, h))?
            .contiguous()?;
        let outputs = self.experts(&rows)?.to_dtype(DType::F32)?;
        // [tokens, top_k, local]: whether choice k of the token is local expert l.
        let local = Tensor::arange(
            self.first as u32,
            (self.first + self.local) as u32,
            x.device(),
        )?
        .reshape((1, 1, self.local))?;
        let chosen = routing
            .unsqueeze(2)?
            .broadcast_eq(&local)?
            .to_dtype(DType::F32)?;
        // [local, tokens, 1]: each local expert's weight for each token.
        let local_weights = chosen
            .broadcast_mul(&weights.unsqueeze(2)?)?
            .sum(1)?
            .t()?
            .unsqueeze(2)?;
        Ok(outputs
            .broadcast_mul(&local_weights)?
            .sum(0)?
            .to_dtype(x.dtype())?)
    }
}

/// One exchange call's tokens: `count` tokens from `start` on, at most `most` a rank, this
/// rank's `len` of them from `mine` on (rank `r` takes `start + r × most ..`, the last ranks
/// fewer or none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Share {
    start: usize,
    count: usize,
    most: usize,
    mine: usize,
    len: usize,
}

/// The calls `tokens` tokens take over `ranks` ranks at most `max_tokens` a rank per call,
/// and `rank`'s part of each: the same calls on every rank.
fn shares(tokens: usize, ranks: usize, max_tokens: usize, rank: usize) -> Vec<Share> {
    let per_call = ranks.max(1) * max_tokens.max(1);
    (0..tokens)
        .step_by(per_call)
        .map(|start| {
            let count = (tokens - start).min(per_call);
            let most = count.div_ceil(ranks.max(1));
            let mine = (start + rank * most).min(start + count);
            let len = (start + count - mine).min(most);
            Share {
                start,
                count,
                most,
                mine,
                len,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_token_once_in_rank_order() {
        for ranks in 1..=5 {
            for max_tokens in [1, 3, 8, 64] {
                for tokens in 0..200 {
                    let all: Vec<Vec<Share>> = (0..ranks)
                        .map(|r| shares(tokens, ranks, max_tokens, r))
                        .collect();
                    let mut next = 0;
                    for call in 0..all[0].len() {
                        let first = all[0][call];
                        assert!(first.most <= max_tokens && first.count <= ranks * max_tokens);
                        for (rank, calls) in all.iter().enumerate() {
                            let share = calls[call];
                            // The same call on every rank.
                            assert_eq!(
                                (share.start, share.count, share.most),
                                (first.start, first.count, first.most)
                            );
                            assert_eq!(
                                share.mine, next,
                                "{tokens} tokens, {ranks} ranks, rank {rank}"
                            );
                            assert!(share.len <= share.most);
                            next += share.len;
                        }
                        assert_eq!(next, first.start + first.count);
                    }
                    assert_eq!(
                        next, tokens,
                        "{tokens} tokens over {ranks} ranks by {max_tokens}"
                    );
                    assert!(all.iter().all(|c| c.len() == all[0].len()));
                }
            }
        }
    }
}
