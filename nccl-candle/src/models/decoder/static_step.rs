//! [`CausalLm`] as a [`StaticDecode`] model: the decode step a CUDA graph captures, reading
//! its ids and position from device memory ([`crate::decode`]).

use candle_core::{DType, Device, Tensor};

use super::{masked_lookup, CausalLm, Positions, Rope};
use crate::decode::{StaticDecode, StepInputs};
use crate::tp::TpGroup;
use crate::{fingerprint, Error, Result};

// SAFETY: a step touches the weights, the rotary tables, the layers' caches (allocated by
// the prompt's append and kept by `reset` and by a prompt of the same batch, which
// `DecodeGraph::prefill` requires), the inputs and the group's collectives, all owned here
// or by the inputs; it enqueues candle ops and the group's collectives on the device's
// stream only (the expert exchange's waits for its own dispatch and combine happen outside
// a capture only, and its all-to-all-v path, which waits on the host, is refused a capture
// by `check_step`), keeps no tensor it makes, and refuses inputs of another `max_seq` or
// batch.
unsafe impl StaticDecode for CausalLm {
    fn device(&self) -> &Device {
        self.embed.device()
    }

    fn group(&self) -> &TpGroup {
        &self.group
    }

    fn vocab(&self) -> usize {
        self.config.vocab_size
    }

    fn max_seq(&self) -> usize {
        self.max_seq
    }

    fn cached(&self) -> usize {
        self.cached
    }

    fn cache_batch(&self) -> Option<usize> {
        self.layers.first().and_then(|l| l.attention.cache.batch())
    }

    fn prefill(&mut self, ids: &Tensor) -> Result<Tensor> {
        self.reset()?;
        self.forward(ids, 0)
    }

    fn check_step(&self, batch: usize) -> Result<u64> {
        // Before anything collective, alike on every rank (the path was chosen alike): a
        // capture of NCCL's all-to-all-v path would fail inside and leave the exchange out of
        // step, the host-driven pass with it.
        if self.exchanges_experts() && !self.group.expert_exchanges_capturable() {
            return Err(Error::Argument {
                op: "CausalLm::decode_step",
                why: "the expert exchange runs NCCL's all-to-all-v here (no LSA team, or NCCL \
                      before 2.29.2), which waits on the host for its row counts: no CUDA \
                      graph can capture it (step eagerly: DecodeGraph::eager)"
                    .into(),
            });
        }
        if self.broken || self.cached == 0 || self.cache_batch() != Some(batch) {
            return Err(Error::Argument {
                op: "CausalLm::decode_step",
                why: format!(
                    "{} positions of batch {:?} held{}: a step of batch {batch} needs a \
                     prompt of that batch first",
                    self.cached,
                    self.cache_batch(),
                    if self.broken {
                        " after a failed pass"
                    } else {
                        ""
                    }
                ),
            });
        }
        Ok(fingerprint(&(self.fused, self.local_sizes())))
    }

    fn decode_step(&mut self, inputs: &StepInputs) -> Result<()> {
        if self.broken
            || inputs.max_seq() != self.max_seq
            || self.cache_batch() != Some(inputs.batch())
        {
            return Err(Error::Argument {
                op: "CausalLm::decode_step",
                why: format!(
                    "inputs of batch {} and {} positions for caches of batch {:?} and {} \
                     positions{}",
                    inputs.batch(),
                    inputs.max_seq(),
                    self.cache_batch(),
                    self.max_seq,
                    if self.broken {
                        ", after a failed pass (reset first)"
                    } else {
                        ""
                    }
                ),
            });
        }
        let (cos, sin) = inputs.rope_rows(&self.cos, &self.sin)?;
        let b = inputs.batch();
        let positions = Positions::Device {
            rope: Rope { cos, sin },
            mask: inputs.mask(self.config.sliding_window, DType::F32)?,
            index: inputs.position_index((b, self.plan.kv_heads, 1, self.config.head_dim))?,
        };
        let embedded = masked_lookup(&self.embed, &inputs.ids()?, self.vocab_start)?;
        // A step that fails midway leaves nothing inconsistent: its position is counted
        // only after it (set_cached), and the next step writes that position again.
        let x = self.group.layer_sum(embedded)?;
        let last = self.layers_forward(x, &positions)?;
        inputs.finish(&self.logits(&last)?)
    }

    fn set_cached(&mut self, cached: usize) -> Result<()> {
        if cached > self.max_seq {
            return Err(Error::Argument {
                op: "CausalLm::set_cached",
                why: format!("{cached} positions with room for {}", self.max_seq),
            });
        }
        for layer in &mut self.layers {
            layer.attention.cache.set_len(cached)?;
        }
        self.cached = cached;
        Ok(())
    }
}
