//! A group's expert exchanges: nccl-rs's [`ExpertExchange`] (mixture-of-experts dispatch and
//! combine, expert parallel) on the group's communicator, run on candle tensors.
//!
//! A dispatch fills each local expert's rows in a buffer of `ranks × max_tokens` rows per
//! expert, and the experts then run on the whole buffer (a batched product, the same launch
//! whatever the routing, capturable in a CUDA graph). So that the buffer is not much larger
//! than the rows a call sends, a set holds one exchange per size class ([`TOKEN_CLASSES`]) and
//! a call takes the smallest that holds its tokens.

use std::time::Duration;

use candle_core::{DType, Tensor};
use half::{bf16, f16};
use nccl::device::{
    ExchangePath, ExpertExchange, ExpertShape, LsaElem, MAX_ENTRIES, MAX_EXPERTS, MAX_RANKS,
};
use nccl::Comm;

use crate::{Error, Result};

/// Tokens a rank sends per call at most, in each size class (capped at nccl-rs's
/// `MAX_ENTRIES / top_k`): decode's one token, small batches, prompts (in calls of the
/// largest class).
pub(crate) const TOKEN_CLASSES: [usize; 3] = [1, 8, 64];

/// The experts a set serves: `experts` of rows of `hidden` elements of `dtype`, `top_k` a
/// token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ExpertsKey {
    pub(crate) experts: usize,
    pub(crate) top_k: usize,
    pub(crate) hidden: usize,
    pub(crate) dtype: DType,
}

/// One exchange, of the element type of the model.
enum Exchange<'c> {
    Bf16(ExpertExchange<'c, bf16>),
    F16(ExpertExchange<'c, f16>),
    F32(ExpertExchange<'c, f32>),
}

impl Exchange<'_> {
    fn set_timeout(&mut self, timeout: Duration) {
        match self {
            Exchange::Bf16(e) => e.set_timeout(timeout),
            Exchange::F16(e) => e.set_timeout(timeout),
            Exchange::F32(e) => e.set_timeout(timeout),
        }
    }

    fn timeout(&self) -> Duration {
        match self {
            Exchange::Bf16(e) => e.timeout(),
            Exchange::F16(e) => e.timeout(),
            Exchange::F32(e) => e.timeout(),
        }
    }

    fn path(&self) -> ExchangePath {
        match self {
            Exchange::Bf16(e) => e.path(),
            Exchange::F16(e) => e.path(),
            Exchange::F32(e) => e.path(),
        }
    }
}

/// The exchanges of one [`ExpertsKey`], one per size class, made together on every rank.
pub(crate) struct ExpertSet<'c> {
    key: ExpertsKey,
    classes: Vec<Exchange<'c>>,
}

impl ExpertsKey {
    /// Whether nccl-rs's exchange takes this shape over `ranks` ranks: at most its experts
    /// and ranks, `top_k` within the experts, rows of whole 16-byte vectors. Depends on the
    /// key and the rank count only, so every rank answers alike; where it says no, the
    /// layers run their experts on every token and sum over the ranks instead.
    pub(crate) fn exchangeable(&self, ranks: usize) -> bool {
        let row_bytes = self.hidden * self.dtype.size_in_bytes();
        matches!(self.dtype, DType::BF16 | DType::F16 | DType::F32)
            && ranks <= MAX_RANKS
            && self.experts <= MAX_EXPERTS
            && self.experts.is_multiple_of(ranks.max(1))
            && (1..=self.experts).contains(&self.top_k)
            && self.top_k <= MAX_ENTRIES
            && row_bytes > 0
            && row_bytes.is_multiple_of(16)
    }
}

impl<'c> ExpertSet<'c> {
    /// Makes the set's exchanges on `comm` (collective: every rank with the same key; the
    /// ranks agree inside each `ExpertExchange::new`, so a refusal is every rank's), each
    /// with `timeout` (`ExpertExchange::set_timeout`) where one is given.
    pub(crate) fn new(comm: &'c Comm, key: ExpertsKey, timeout: Option<Duration>) -> Result<Self> {
        let mut classes = Vec::new();
        for max_tokens in class_sizes(key.top_k) {
            let shape = ExpertShape::new(key.experts, key.top_k, key.hidden, max_tokens);
            let path = ExchangePath::Auto;
            let mut exchange = match key.dtype {
                DType::BF16 => Exchange::Bf16(ExpertExchange::new(comm, shape, path)?),
                DType::F16 => Exchange::F16(ExpertExchange::new(comm, shape, path)?),
                DType::F32 => Exchange::F32(ExpertExchange::new(comm, shape, path)?),
                other => {
                    return Err(Error::UnsupportedDType {
                        op: "expert exchange",
                        dtype: other,
                    })
                }
            };
            if let Some(timeout) = timeout {
                exchange.set_timeout(timeout);
            }
            classes.push(exchange);
        }
        Ok(Self { key, classes })
    }

    /// Whether a CUDA graph can capture its calls: the shipped kernels' path in every class
    /// (NCCL's all-to-all-v path waits on the host for the row counts). Chosen alike on
    /// every rank when the set was made.
    pub(crate) fn capturable(&self) -> bool {
        self.classes
            .iter()
            .all(|class| class.path() == ExchangePath::Lsa)
    }

    /// How long each class's kernels wait for their peers before giving up, smallest class
    /// first.
    pub(crate) fn timeouts(&self) -> Vec<Duration> {
        self.classes.iter().map(Exchange::timeout).collect()
    }

    pub(crate) fn key(&self) -> ExpertsKey {
        self.key
    }

    /// The most tokens a rank sends in one call.
    pub(crate) fn max_tokens(&self) -> usize {
        class_sizes(self.key.top_k).last().copied().unwrap_or(1)
    }

    /// Dispatches this rank's tokens `x` (`[tokens, hidden]`) to the experts `routing`
    /// (`[tokens, top_k]`, `u32`) names, runs `experts` on the rows this rank's experts
    /// received (`[local experts, ranks × max_tokens, hidden]`, each expert's first
    /// `counts[e]` rows filled, `counts` `[local experts]` `i32` on the device; it gives the
    /// outputs in the same shape, rows past the counts unread), and
    /// combines their outputs back with `weights` (`[tokens, top_k]`, `f32`): this rank's
    /// tokens' outputs, `[tokens, hidden]`. `most` is the most tokens any rank sends in this
    /// call (the same on every rank): it picks the class.
    pub(crate) fn run(
        &mut self,
        x: &Tensor,
        routing: &Tensor,
        weights: &Tensor,
        most: usize,
        experts: &mut dyn FnMut(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let index = class_sizes(self.key.top_k)
            .iter()
            .position(|&max| max >= most)
            .ok_or_else(|| Error::Argument {
                op: "expert exchange",
                why: format!(
                    "{most} tokens a rank in one call, past the largest class ({})",
                    self.max_tokens()
                ),
            })?;
        match &mut self.classes[index] {
            Exchange::Bf16(e) => cuda::run(e, x, routing, weights, experts),
            Exchange::F16(e) => cuda::run(e, x, routing, weights, experts),
            Exchange::F32(e) => cuda::run(e, x, routing, weights, experts),
        }
    }
}

/// The classes' token counts for `top_k` choices a token.
fn class_sizes(top_k: usize) -> Vec<usize> {
    let cap = (MAX_ENTRIES / top_k.max(1)).max(1);
    let mut sizes: Vec<usize> = TOKEN_CLASSES.iter().map(|&c| c.min(cap)).collect();
    sizes.dedup();
    sizes
}

/// The element types an exchange runs on candle's CUDA tensors.
#[cfg(feature = "cuda")]
trait ExchangeElem:
    LsaElem + candle_core::cuda_backend::CudaDType + nccl::cudarc::driver::ValidAsZeroBits
{
}
#[cfg(feature = "cuda")]
impl<T> ExchangeElem for T where
    T: LsaElem + candle_core::cuda_backend::CudaDType + nccl::cudarc::driver::ValidAsZeroBits
{
}
#[cfg(not(feature = "cuda"))]
trait ExchangeElem: LsaElem {}
#[cfg(not(feature = "cuda"))]
impl<T: LsaElem> ExchangeElem for T {}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;

    use candle_core::op::BackpropOp;
    use candle_core::{CudaStorage, Storage, Tensor};
    use nccl::cudarc::driver::CudaView;
    use nccl::device::ExpertExchange;

    use super::ExchangeElem;
    use crate::{Error, Result};

    const OP: &str = "expert exchange";

    /// `f` on `t`'s elements (contiguous, on a CUDA device) as `S`.
    fn with_view<S: candle_core::cuda_backend::CudaDType, R>(
        t: &Tensor,
        f: impl FnOnce(CudaView<'_, S>) -> Result<R>,
    ) -> Result<R> {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cuda) = &*storage else {
            return Err(Error::NotCuda {
                op: OP,
                device: format!("{:?}", t.device().location()),
            });
        };
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or(Error::NotContiguous { op: OP })?;
        let view = cuda
            .as_cuda_slice::<S>()?
            .try_slice(start..end)
            .ok_or(Error::NotContiguous { op: OP })?;
        f(view)
    }

    /// Outside a capture, waits until `device`'s stream has run all it holds (inside one,
    /// nothing runs: nothing to wait for).
    ///
    /// Why: ranks that share one CUDA context (threads on one GPU) share the driver's
    /// staging buffers for copies from pageable memory, and candle uploads small host data
    /// (strided layouts) that way at many ops. A rank that sends few tokens or none would
    /// run ahead on the host, queueing such uploads behind an exchange that waits for its
    /// peer, while the peer's own upload before the launch that rank waits for needs a
    /// staging buffer (the hazard the crate's agreements and read-backs avoid the same way).
    /// A rank that waits here holds none. The host-driven pass waits after each dispatch
    /// anyway, to read the counts.
    fn settle(device: &candle_core::CudaDevice) -> Result<()> {
        let stream = device.cuda_stream();
        let capturing = !matches!(
            stream.capture_status(),
            Ok(nccl::cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        );
        if !capturing {
            stream
                .synchronize()
                .map_err(|e| Error::Nccl(nccl::Error::from(e)))?;
        }
        Ok(())
    }

    pub(super) fn run<T: ExchangeElem>(
        exchange: &mut ExpertExchange<'_, T>,
        x: &Tensor,
        routing: &Tensor,
        weights: &Tensor,
        experts: &mut dyn FnMut(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let result = run_checked(exchange, x, routing, weights, experts);
        if let Err(err) = &result {
            // Whatever failed here, this rank's calls no longer pair with its peers'.
            exchange.put_out_of_step(format!("a call failed on this rank: {err}"));
        }
        result
    }

    fn run_checked<T: ExchangeElem>(
        exchange: &mut ExpertExchange<'_, T>,
        x: &Tensor,
        routing: &Tensor,
        weights: &Tensor,
        experts: &mut dyn FnMut(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let device = x.device().as_cuda_device()?.clone();
        // The exchange runs on the communicator's stream, candle on its device's: one.
        if !Arc::ptr_eq(exchange.comm().stream(), &device.cuda_stream()) {
            return Err(Error::Nccl(nccl::Error::InvalidArgument(
                "expert exchange: the tensors' device stream is not the communicator's".into(),
            )));
        }
        let shape = exchange.shape();
        let ranks = exchange.comm().size();
        let local = exchange.local_experts();
        let tokens = x.dim(0)?;
        let rows = shape.received_rows(ranks);
        // Zeroed: the rows past each expert's count go through the experts too.
        let mut recv_x = device.alloc_zeros::<T>(rows * shape.hidden)?;
        let mut recv_counts = device.alloc_zeros::<i32>(local.max(1))?;
        let dispatched = with_view::<T, _>(x, |xv| {
            with_view::<u32, _>(routing, |rv| {
                // SAFETY: u32 and i32 have one size and alignment and every bit pattern is
                // a value of both; the kernels read expert numbers, below `experts`, which
                // fit either (a number past i32::MAX reads negative and is dropped as bad
                // routing, as any number outside -1..experts).
                let rv = unsafe { rv.transmute::<i32>(rv.len()) }
                    .ok_or(Error::NotContiguous { op: OP })?;
                exchange
                    .dispatch(&xv, &rv, &mut recv_x, &mut recv_counts)
                    .map_err(Error::Nccl)
            })
        })?;
        let received = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(recv_x, device.clone())),
            (local, rows / local.max(1), shape.hidden),
            BackpropOp::none(),
            false,
        );
        let counts = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(recv_counts, device.clone())),
            local.max(1),
            BackpropOp::none(),
            false,
        )
        .narrow(0, 0, local)?;
        // Outside a capture, this rank waits here for its dispatch to end (its peers' rows
        // in), and below for its combine: see `settle`.
        settle(&device)?;
        let outputs = experts(&received, &counts)?;
        if outputs.dims() != received.dims() || outputs.dtype() != received.dtype() {
            return Err(Error::Shape {
                op: OP,
                why: format!(
                    "the experts gave {:?} {:?} for rows {:?} {:?}",
                    outputs.dims(),
                    outputs.dtype(),
                    received.dims(),
                    received.dtype()
                ),
            });
        }
        let outputs = outputs.contiguous()?;
        // SAFETY: combine writes every element of its tokens' rows (zeros for a token
        // routed nowhere) before anything reads them; on failure it is dropped unread. One
        // element at least: an allocation of none is not made.
        let len = (tokens * shape.hidden).max(1);
        let mut out = unsafe { device.alloc::<T>(len) }?;
        with_view::<T, _>(&outputs, |ov| {
            with_view::<f32, _>(weights, |wv| {
                let mut out = out
                    .try_slice_mut(0..tokens * shape.hidden)
                    .ok_or(Error::NotContiguous { op: OP })?;
                exchange
                    .combine(dispatched, &ov, &wv, &mut out)
                    .map_err(Error::Nccl)
            })
        })?;
        settle(&device)?;
        let out = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(out, device)),
            len,
            BackpropOp::none(),
            false,
        );
        Ok(out
            .narrow(0, 0, tokens * shape.hidden)?
            .reshape((tokens, shape.hidden))?)
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use candle_core::Tensor;
    use nccl::device::ExpertExchange;

    use super::ExchangeElem;
    use crate::Result;

    pub(super) fn run<T: ExchangeElem>(
        exchange: &mut ExpertExchange<'_, T>,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &mut dyn FnMut(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        exchange.put_out_of_step("candle built without CUDA");
        Err(crate::cuda_device::not_compiled())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_stay_within_the_kernels_entries() {
        assert_eq!(class_sizes(2), [1, 8, 64]);
        assert_eq!(class_sizes(MAX_ENTRIES / 4), [1, 4]);
        assert_eq!(class_sizes(MAX_ENTRIES), [1]);
    }
}
