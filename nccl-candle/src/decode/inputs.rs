//! What a static decode step reads from device memory (its token ids and position) and where
//! it leaves its result, so that one captured graph serves every step of a sequence.

use std::sync::{Arc, Mutex};

use candle_core::{
    backend::BackendStorage, CpuStorage, CudaStorage, DType, Device, InplaceOp1, Layout, Tensor,
};
use nccl::cudarc::driver::{CudaContext, CudaEvent, PinnedHostSlice};

use crate::{cuda_device, Error, Result};

/// A decode step's inputs and outputs in device memory: the token ids (`[batch, 1]`, `u32`)
/// and the position (one `u32`) the step reads, the logits (`[batch, vocab]`, `f32`) and
/// greedy tokens (`[batch]`, `u32`) it writes, and the constants its masks are made of. The
/// host writes the inputs before each step ([`DecodeGraph`](super::DecodeGraph) does it); a
/// step made of candle ops reads them through [`ids`](Self::ids),
/// [`rope_rows`](Self::rope_rows), [`mask`](Self::mask) and
/// [`position_index`](Self::position_index) and ends with [`finish`](Self::finish).
pub struct StepInputs {
    batch: usize,
    vocab: usize,
    max_seq: usize,
    /// `[batch + 1]`: the ids, then the position (one host-to-device copy a step).
    packed: Tensor,
    /// `[max_seq]`, `u32`: `0..max_seq`.
    keys: Tensor,
    /// `[max_seq]`, `f32`: minus infinity and zero, the mask's two values.
    hidden: Tensor,
    shown: Tensor,
    logits: Tensor,
    greedy: Tensor,
    /// CUDA: page-locked memory the inputs are uploaded from, and the event after the last
    /// upload (a copy from pageable memory can hold the context's staging buffer while the
    /// stream waits in a collective for a peer that shares the GPU and needs that buffer).
    staged: Option<(Staging, CudaEvent)>,
}

/// Page-locked buffers given back by dropped inputs, by device, kept for the next inputs of
/// the same length and never freed: freeing page-locked memory (`cuMemFreeHost`) waits for
/// the whole context, and ranks of one process sharing a GPU share one context, so a rank
/// freeing it while its peer has already launched the next collective (a capture refused
/// after the agreement, then an eager pass) waits for a collective that waits for this rank.
/// A few buffers of a batch's ids and a position each, per process.
static STAGING_POOL: Mutex<Vec<(usize, PinnedHostSlice<u32>)>> = Mutex::new(Vec::new());

/// A page-locked buffer of the pool, given back to it when dropped.
struct Staging {
    ordinal: usize,
    pinned: Option<PinnedHostSlice<u32>>,
}

impl Staging {
    /// A buffer of `len` values on `ctx`'s device: one given back earlier, else a new one.
    fn take(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let ordinal = ctx.ordinal();
        let reused = {
            let mut pool = STAGING_POOL
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            pool.iter()
                .position(|(o, p)| *o == ordinal && p.len() == len)
                .map(|i| pool.swap_remove(i).1)
        };
        let pinned = match reused {
            Some(pinned) => pinned,
            // SAFETY: u32 has no invalid bits, and every upload writes all `len` values
            // before copying them.
            None => unsafe { ctx.alloc_pinned::<u32>(len) }.map_err(cuda_error)?,
        };
        Ok(Self {
            ordinal,
            pinned: Some(pinned),
        })
    }

    /// The buffer (held from `take` until the drop gives it back).
    fn get(&mut self) -> Result<&mut PinnedHostSlice<u32>> {
        self.pinned.as_mut().ok_or_else(|| Error::Argument {
            op: "StepInputs::write",
            why: "its page-locked buffer was given back".into(),
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // A copy still reading it is waited for by the next user (the buffer's own event,
        // which every copy records and `as_mut_slice` waits for).
        if let Some(pinned) = self.pinned.take() {
            STAGING_POOL
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push((self.ordinal, pinned));
        }
    }
}

impl std::fmt::Debug for StepInputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepInputs")
            .field("batch", &self.batch)
            .field("vocab", &self.vocab)
            .field("max_seq", &self.max_seq)
            .finish()
    }
}

impl StepInputs {
    /// Inputs of `batch` rows for a model of `vocab` tokens and `max_seq` positions on
    /// `device` (a CUDA device for a graph; any device for the eager step).
    pub fn new(batch: usize, vocab: usize, max_seq: usize, device: &Device) -> Result<Self> {
        if batch == 0 || vocab == 0 || max_seq == 0 || max_seq > u32::MAX as usize {
            return Err(Error::Argument {
                op: "StepInputs::new",
                why: format!("batch {batch}, vocab {vocab}, max_seq {max_seq}"),
            });
        }
        let staged = match device {
            Device::Cuda(cuda) => {
                let ctx = cuda_device::stream(cuda)?.context().clone();
                let pinned = Staging::take(&ctx, batch + 1)?;
                Some((pinned, ctx.new_event(None).map_err(cuda_error)?))
            }
            _ => None,
        };
        Ok(Self {
            staged,
            batch,
            vocab,
            max_seq,
            packed: Tensor::zeros(batch + 1, DType::U32, device)?,
            keys: Tensor::arange(0u32, max_seq as u32, device)?,
            hidden: Tensor::full(f32::NEG_INFINITY, max_seq, device)?,
            shown: Tensor::zeros(max_seq, DType::F32, device)?,
            logits: Tensor::zeros((batch, vocab), DType::F32, device)?,
            greedy: Tensor::zeros(batch, DType::U32, device)?,
        })
    }

    /// The rows of a step.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The positions a step may be at: `0..max_seq`.
    pub fn max_seq(&self) -> usize {
        self.max_seq
    }

    /// Writes the step's token ids (`batch` of them) and position (below `max_seq`) into
    /// device memory, on the device's stream (ordered after the previous step), from
    /// page-locked memory on a CUDA device (waiting first for the previous upload from it).
    pub fn write(&mut self, ids: &[u32], position: usize) -> Result<()> {
        if ids.len() != self.batch || position >= self.max_seq {
            return Err(Error::Argument {
                op: "StepInputs::write",
                why: format!(
                    "{} ids at position {position} for a batch of {} and {} positions",
                    ids.len(),
                    self.batch,
                    self.max_seq
                ),
            });
        }
        let mut values = ids.to_vec();
        values.push(position as u32);
        let Some((staging, uploaded)) = &mut self.staged else {
            self.packed.inplace_op1(&WriteHost::Pageable(values))?;
            return Ok(());
        };
        // The previous upload has left the page-locked buffer before it is overwritten.
        uploaded.synchronize().map_err(cuda_error)?;
        let pinned = staging.get()?;
        pinned
            .as_mut_slice()
            .map_err(cuda_error)?
            .copy_from_slice(&values);
        self.packed.inplace_op1(&WriteHost::Pinned(pinned))?;
        if let Device::Cuda(cuda) = self.packed.device() {
            let stream = cuda_device::stream(cuda)?;
            uploaded.record(&stream).map_err(cuda_error)?;
        }
        Ok(())
    }

    /// The token ids, `[batch, 1]`.
    pub fn ids(&self) -> Result<Tensor> {
        Ok(self
            .packed
            .narrow(0, 0, self.batch)?
            .reshape((self.batch, 1))?)
    }

    /// The position, `[1]`: a fresh tensor (a step's ops cannot change the inputs), clamped
    /// below `max_seq` on the device, so that whatever the inputs' memory holds, an index
    /// made of it stays inside tensors of `max_seq` rows.
    pub fn position(&self) -> Result<Tensor> {
        let last = (self.max_seq - 1) as u32;
        Ok(self.packed.narrow(0, self.batch, 1)?.minimum(last)?)
    }

    /// The position's rows of rotary tables `cos`, `sin` (`[max_seq, head_dim / 2]`):
    /// `[1, head_dim / 2]` each.
    pub fn rope_rows(&self, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor)> {
        let at = self.position()?;
        Ok((cos.index_select(&at, 0)?, sin.index_select(&at, 0)?))
    }

    /// The additive mask over every key position, `[1, max_seq]` in `dtype`: zero where the
    /// step's query may see the key (at or before the position and, with a `window` `w`,
    /// fewer than `w` positions before it), minus infinity elsewhere.
    pub fn mask(&self, window: Option<usize>, dtype: DType) -> Result<Tensor> {
        let at = self.position()?;
        let mut hide = self.keys.broadcast_gt(&at)?;
        if let Some(w) = window {
            // Key j is too old when j + w <= position.
            let w = u32::try_from(w.min(self.max_seq)).unwrap_or(u32::MAX) as f64;
            let shifted = self.keys.affine(1.0, w)?;
            hide = hide.maximum(&shifted.broadcast_le(&at)?)?;
        }
        Ok(hide
            .where_cond(&self.hidden, &self.shown)?
            .to_dtype(dtype)?
            .unsqueeze(0)?)
    }

    /// The position as an index of `shape` (`[b, kv_heads, 1, head_dim]`, a step's keys),
    /// for [`KvCache::write_at`](super::KvCache::write_at); one a step serves every layer.
    pub fn position_index(&self, shape: (usize, usize, usize, usize)) -> Result<PositionIndex> {
        let index = self
            .position()?
            .reshape((1, 1, 1, 1))?
            .broadcast_as(shape)?
            .contiguous()?;
        Ok(PositionIndex {
            index,
            max_seq: self.max_seq,
        })
    }

    /// Writes a step's logits (`[batch, vocab]`, any float type) into the outputs, as `f32`,
    /// and their greedy tokens.
    pub fn finish(&self, logits: &Tensor) -> Result<()> {
        if logits.dims() != [self.batch, self.vocab] {
            return Err(Error::Shape {
                op: "StepInputs::finish",
                why: format!(
                    "logits {:?} for [{}, {}]",
                    logits.dims(),
                    self.batch,
                    self.vocab
                ),
            });
        }
        let logits = logits.to_dtype(DType::F32)?.contiguous()?;
        self.logits.slice_set(&logits, 0, 0)?;
        self.greedy.slice_set(&logits.argmax(1)?, 0, 0)?;
        Ok(())
    }

    /// The last step's logits, `[batch, vocab]` `f32` (the next step overwrites them: copy
    /// what must outlive it).
    pub fn logits(&self) -> &Tensor {
        &self.logits
    }

    /// The last step's greedy tokens, `[batch]` `u32`.
    pub fn greedy(&self) -> &Tensor {
        &self.greedy
    }
}

/// A step's position as a `scatter` index ([`StepInputs::position_index`]): below the
/// inputs' `max_seq` whatever happened to their memory, and made only there, so that a
/// cache's device-positioned write ([`KvCache::write_at`](super::KvCache::write_at)) cannot
/// land outside it.
#[derive(Debug)]
pub struct PositionIndex {
    index: Tensor,
    max_seq: usize,
}

impl PositionIndex {
    /// The index, `u32`, every element the position.
    pub(crate) fn tensor(&self) -> &Tensor {
        &self.index
    }

    /// The positions of the inputs it was made from: every element is below it.
    pub fn max_seq(&self) -> usize {
        self.max_seq
    }

    /// The keys' shape it indexes.
    pub fn dims(&self) -> &[usize] {
        self.index.dims()
    }
}

fn cuda_error(e: impl std::fmt::Display) -> Error {
    Error::Argument {
        op: "StepInputs",
        why: format!("CUDA: {e}"),
    }
}

/// Copies host values into a `u32` tensor's storage on its device's stream.
enum WriteHost<'a> {
    /// From a vector (the CPU).
    Pageable(Vec<u32>),
    /// From page-locked memory (ordered by the caller's event).
    Pinned(&'a PinnedHostSlice<u32>),
}

impl WriteHost<'_> {
    fn len(&self) -> usize {
        match self {
            WriteHost::Pageable(v) => v.len(),
            WriteHost::Pinned(p) => p.len(),
        }
    }
}

impl InplaceOp1 for WriteHost<'_> {
    fn name(&self) -> &'static str {
        "write_host"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        match (self, storage, layout.contiguous_offsets()) {
            (WriteHost::Pageable(v), CpuStorage::U32(data), Some((start, end)))
                if end - start == v.len() =>
            {
                data[start..end].copy_from_slice(v);
                Ok(())
            }
            _ => Err(candle_core::Error::Msg(
                "write_host: not the inputs' storage".into(),
            )),
        }
    }

    // Without `cuda` (the docs' build) candle has no CUDA storage: its default refuses.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::Msg("write_host: not contiguous".into()));
        };
        if end - start != self.len() || storage.dtype() != DType::U32 {
            return Err(candle_core::Error::Msg(
                "write_host: not the inputs' storage".into(),
            ));
        }
        let stream = storage.device.cuda_stream();
        let slice = storage.as_cuda_slice_mut::<u32>()?;
        let mut view = slice
            .try_slice_mut(start..end)
            .ok_or_else(|| candle_core::Error::Msg("write_host: outside the storage".into()))?;
        match self {
            WriteHost::Pageable(v) => stream.memcpy_htod(v, &mut view),
            WriteHost::Pinned(p) => stream.memcpy_htod(*p, &mut view),
        }
        .map_err(|e| candle_core::Error::Msg(format!("write_host: {e}")))
    }
}
