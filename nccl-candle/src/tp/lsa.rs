//! [`LsaCollectives`]: tensor-parallel collectives whose bf16 sums run the all-reduce kernels
//! nccl-rs ships ([`nccl::device::LsaAllReduce`], one-shot, no NCCL launch), and whose
//! row-parallel epilogue (sum, residual add, RMSNorm) runs its fused kernel, the rest through
//! NCCL, for ranks in one LSA team (one host's NVLink).

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, DType, InplaceOp3, Layout, Shape, Storage, Tensor,
};
use half::bf16;
use nccl::cudarc::driver::CudaStream;
use nccl::device::{LsaAlgorithm, LsaAllReduce, LsaEpilogue};
use nccl::diagnostics::flight::{GraphCaptureMark, RecordedGraph};
use nccl::{Comm, ReduceOp};

use super::{epilogue, Collectives};
use crate::op::{check, extent, Failure};
use crate::{Error, Result};

/// The shipped kernels, borrowed mutably by each call (a `RefCell` inside the cell, so that
/// the communicator itself stays reachable by shared reference).
type Kernels<'a> = RefCell<LsaAllReduce<'a, bf16>>;

self_cell::self_cell!(
    /// A communicator and the shipped kernels that borrow it, owned together so that a
    /// [`TpGroup`](super::TpGroup) can hold them.
    struct Owned {
        owner: Comm,
        #[not_covariant]
        dependent: Kernels,
    }
);

/// [`Collectives`] on a [`Comm`] whose ranks share one LSA team: sums of bf16 tensors of up to
/// `max_elements` run nccl-rs's shipped kernels (`LsaAlgorithm::Auto`: the one-shot flags
/// kernel for small messages, NCCL for larger ones), and so does the row-parallel epilogue
/// ([`Collectives::all_reduce_add_rms_norm`]: sum, residual add and RMSNorm as one fused
/// kernel where [`LsaCollectives::fuses`] says so); everything else NCCL. The tensors must be
/// on the communicator's stream (candle's device stream the communicator was made on).
///
/// # A refusal on one rank puts every rank's kernels out of step
///
/// A shipped kernel pairs with its peers' kernels by call count alone: a call that one rank
/// refuses while its peers launched theirs (a tensor on another stream, not contiguous or
/// not on the GPU, an allocation that fails, candle's own checks of the op) would otherwise
/// leave that rank one call behind, and its next call would pair with its peers' previous
/// one and return `Ok` with a wrong sum. So every refusal of a bf16 sum or a fused epilogue
/// here, wherever it arises once the kernels' path was chosen, puts this rank's kernels out
/// of step for good (`LsaAllReduce::put_out_of_step`):
///
/// * the refusing call returns its own error (the reason);
/// * every later bf16 sum or fused epilogue on this rank is refused at once with
///   [`nccl::Error::InvalidUsage`] ("out of step"), wrapped in [`Error::Nccl`];
/// * the peers' kernels of the call this rank missed give up after
///   [`kernel_timeout`](Self::kernel_timeout) (300 s unless [set](Self::set_kernel_timeout));
///   that call returned `Ok` there (the launch is asynchronous) but its output is wrong, and
///   their next call, or [`check`](Self::check), fails with [`nccl::Error::Timeout`].
///
/// A refusal that every rank makes alike (the epilogue's shapes, a tensor on the CPU on every
/// rank) goes the same way: a rank cannot know that its peers refused too. No rank's call
/// then pairs with another call's data. To go on, drop the `LsaCollectives`
/// (or the [`TpGroup`](super::TpGroup) holding it) on every rank and make new ones on a new
/// communicator; [`status`](Self::status) says, without waiting, whether this rank's kernels
/// still serve calls. A sum that NCCL runs (past the kernels' size, or another type or
/// operation) is an NCCL collective like any other: a peer that refused it leaves this rank
/// waiting in NCCL (nccl-rs's watchdog or an `AbortHandle` ends that).
pub struct LsaCollectives {
    owned: Owned,
    rank: usize,
    size: usize,
}

impl LsaCollectives {
    /// Takes `comm` and creates the shipped kernels on it for up to `max_elements` bf16
    /// elements: collective, every rank with the same `max_elements`; a rank that cannot
    /// (NCCL before 2.29.2, ranks in several LSA teams, ...) fails on every rank alike.
    pub fn new(comm: Comm, max_elements: usize) -> Result<Self> {
        let (rank, size) = (comm.rank(), comm.size());
        let owned = Owned::try_new(comm, |comm| {
            LsaAllReduce::<bf16>::new(comm, max_elements).map(RefCell::new)
        })?;
        Ok(Self { owned, rank, size })
    }

    /// How long a shipped kernel waits for its peers before giving up (300 s unless set).
    pub fn kernel_timeout(&self) -> Duration {
        self.owned
            .with_dependent(|_, kernels| kernels.borrow().timeout())
    }

    /// Sets [`kernel_timeout`](Self::kernel_timeout) for the calls made from now on
    /// (`LsaAllReduce::set_timeout`): how long the peers of a rank that refused a call alone
    /// wait before their kernels give up. Every rank alike, before the `LsaCollectives` goes
    /// into a [`TpGroup`](super::TpGroup): the expert exchanges the group makes for a
    /// mixture of experts when it loads take it too.
    pub fn set_kernel_timeout(&self, timeout: Duration) {
        self.owned
            .with_dependent(|_, kernels| kernels.borrow_mut().set_timeout(timeout));
    }

    /// Whether this rank's kernels still serve calls, without waiting for the GPU
    /// (`LsaAllReduce::status`): [`nccl::Error::InvalidUsage`] once a call was refused here
    /// alone (out of step), [`nccl::Error::Timeout`] once a kernel gave up waiting for its
    /// peers. Either way, drop it on every rank and make a new one.
    pub fn status(&self) -> Result<()> {
        self.owned
            .with_dependent(|_, kernels| kernels.borrow().status())
            .map_err(Error::Nccl)
    }

    /// Waits, for at most [`kernel_timeout`](Self::kernel_timeout) and ten seconds more, for
    /// the work enqueued so far on the communicator's stream, then reports as
    /// [`status`](Self::status) does (`LsaAllReduce::check`).
    pub fn check(&self) -> Result<()> {
        self.owned
            .with_dependent(|_, kernels| kernels.borrow().check())
            .map_err(Error::Nccl)
    }

    /// Runs `call`, a call that chose the shipped kernels' path, and puts the kernels out of
    /// step if it fails: the one path every refusal of that path goes through (see
    /// [`LsaCollectives`]). Kernels that refuse already (out of step, or given up) keep
    /// their first reason.
    fn shipped<R>(&self, op: &'static str, call: impl FnOnce() -> Result<R>) -> Result<R> {
        let result = call();
        if let Err(err) = &result {
            self.put_out_of_step(&format!("{op} refused on this rank alone: {err}"));
        }
        result
    }

    fn put_out_of_step(&self, why: &str) {
        self.owned.with_dependent(|_, kernels| {
            let mut kernels = kernels.borrow_mut();
            if kernels.status().is_ok() {
                kernels.put_out_of_step(why);
            }
        });
    }
}

/// bf16 elements in the fused kernel's 16-byte vector: a row's length is a multiple of it.
const VECTOR_ELEMS: usize = 8;
/// The longest row the fused kernel normalises, in bf16 elements (2 048 vectors; see
/// `LsaAllReduce::all_reduce_add_rms_norm`).
const MAX_HIDDEN: usize = 16_384;

/// Whether rows of `hidden` elements, `len` in all, fit the fused kernel of an
/// [`LsaAllReduce`] made for `max_count` elements (an empty tensor has nothing to fuse).
fn fused_shape_fits(len: usize, hidden: usize, max_count: usize) -> bool {
    len > 0
        && hidden > 0
        && hidden.is_multiple_of(VECTOR_ELEMS)
        && hidden <= MAX_HIDDEN
        && len <= max_count
}

/// Whether two tensors share one storage (candle refuses to write one while reading it).
fn same_storage(a: &Tensor, b: &Tensor) -> bool {
    // One read lock at a time: the storages' addresses inside their shared locks.
    let address = |t: &Tensor| std::ptr::from_ref::<Storage>(&t.storage_and_layout().0).addr();
    address(a) == address(b)
}

/// The kernels for one call; a call made from inside another (none does) is refused.
fn busy<'k, 'a>(kernels: &'k Kernels<'a>) -> Result<std::cell::RefMut<'k, LsaAllReduce<'a, bf16>>> {
    kernels.try_borrow_mut().map_err(|_| {
        Error::Nccl(nccl::Error::InvalidUsage(
            "LsaCollectives: a call from inside another call".into(),
        ))
    })
}

/// Refuses a tensor whose device stream is not the communicator's: the kernels run on the
/// communicator's stream and candle's work is ordered on its device's, so they must be one.
fn same_stream(comm: &Comm, stream: &Arc<CudaStream>) -> Result<()> {
    if Arc::ptr_eq(comm.stream(), stream) {
        return Ok(());
    }
    Err(Error::Nccl(nccl::Error::InvalidArgument(
        "LsaCollectives: the tensor's device stream is not the communicator's".into(),
    )))
}

impl LsaCollectives {
    /// Whether [`all_reduce_add_rms_norm`](Collectives::all_reduce_add_rms_norm) runs these
    /// tensors through the fused kernel (otherwise the unfused sequence): all three bf16 on
    /// a CUDA device and contiguous, of the shapes the op takes, `partial` in storage of its
    /// own, rows of a multiple of 8 elements and at most 16 384, at most `max_elements` (of
    /// [`new`](Self::new)) in all, and `eps` finite and non-negative. Depends only on the
    /// tensors' shapes, types, layouts and devices, so ranks that make the same call choose
    /// alike.
    pub fn fuses(&self, partial: &Tensor, residual: &Tensor, weight: &Tensor, eps: f32) -> bool {
        let tensors = [partial, residual, weight];
        let max_count = self
            .owned
            .with_dependent(|_, kernels| kernels.borrow().max_count());
        epilogue::check(FUSED, partial, residual, weight).is_ok()
            && tensors
                .iter()
                .all(|t| t.dtype() == DType::BF16 && t.device().is_cuda() && t.is_contiguous())
            && fused_shape_fits(partial.elem_count(), weight.elem_count(), max_count)
            && eps.is_finite()
            && eps >= 0.0
            && !same_storage(partial, residual)
            && !same_storage(partial, weight)
    }
}

impl Collectives for LsaCollectives {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if op != ReduceOp::Sum || tensor.dtype() != DType::BF16 {
            return self
                .owned
                .with_dependent(|comm, _| crate::all_reduce(comm, tensor, op));
        }
        self.shipped("all_reduce", || {
            // Refused at once, without pairing, once the kernels are out of step or gave up
            // (also where the size would take NCCL's path).
            self.status()?;
            let call = ShippedSum {
                owned: &self.owned,
                failure: Failure::default(),
            };
            check("all_reduce", tensor)?;
            tensor
                .apply_op1_no_bwd(&call)
                .map_err(|err| call.failure.take(err))
        })
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        self.owned
            .with_dependent(|comm, _| crate::all_gather(comm, tensor))
    }

    fn graph_capture_mark(&self) -> Option<GraphCaptureMark> {
        Some(self.owned.borrow_owner().graph_capture_mark())
    }

    fn record_graph(
        &self,
        began: GraphCaptureMark,
        ended: GraphCaptureMark,
        stream: u64,
    ) -> Option<RecordedGraph> {
        Some(self.owned.borrow_owner().record_graph(began, ended, stream))
    }

    fn discard_capture(&self, began: GraphCaptureMark, ended: GraphCaptureMark, stream: u64) {
        self.owned
            .borrow_owner()
            .discard_capture(began, ended, stream);
    }

    fn comm(&self) -> Option<&Comm> {
        Some(self.owned.borrow_owner())
    }

    fn kernel_timeout(&self) -> Option<Duration> {
        Some(LsaCollectives::kernel_timeout(self))
    }

    /// One fused kernel (the all-reduce, the add and the norm;
    /// `LsaAllReduce::all_reduce_add_rms_norm_to` with [`LsaEpilogue::Fused`]) where
    /// [`fuses`](LsaCollectives::fuses) says so, the unfused sequence otherwise. The fused
    /// kernel rounds where the unfused sequence rounds; its sum of squares goes in another
    /// order than candle's `rms_norm`, so the normed output may differ from it in the last
    /// bit.
    fn all_reduce_add_rms_norm(
        &self,
        partial: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        if partial.dtype() != DType::BF16 {
            // Neither the fused kernel nor a shipped sum: NCCL's all-reduce, if any.
            epilogue::check(FUSED, partial, residual, weight)?;
            return epilogue::unfused(self, partial, residual, weight, eps);
        }
        // bf16: the sum is the shipped kernels' (fused or not), so a refusal before it ends
        // is this path's. What follows the unfused sum is local: it pairs with nothing.
        let fused = self.shipped(FUSED, || {
            self.status()?;
            epilogue::check(FUSED, partial, residual, weight)?;
            if self.fuses(partial, residual, weight, eps) {
                self.fused(partial, residual, weight, eps).map(Ok)
            } else {
                let sum = self.all_reduce(&partial.contiguous()?, ReduceOp::Sum)?;
                Ok(Err(sum))
            }
        })?;
        match fused {
            Ok(outputs) => Ok(outputs),
            Err(sum) => epilogue::add_rms_norm(&sum, residual, weight, eps),
        }
    }
}

impl LsaCollectives {
    /// The fused epilogue, for tensors [`fuses`](Self::fuses) accepts.
    fn fused(
        &self,
        partial: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        let call = FusedEpilogue {
            owned: &self.owned,
            eps,
            outputs: RefCell::new(None),
            failure: Failure::default(),
        };
        // In place on `partial` only for the mutable access the kernel's signature asks of
        // it: the fused kernel leaves it as it was.
        partial
            .inplace_op3(residual, weight, &call)
            .map_err(|err| call.failure.take(err))?;
        let (residual_out, out) = call.outputs.take().ok_or_else(|| {
            Error::Candle(candle_core::Error::Msg(format!(
                "{FUSED}: candle returned without running the op"
            )))
        })?;
        let tensor = |storage| {
            Tensor::from_storage(
                Storage::Cuda(storage),
                partial.shape().clone(),
                BackpropOp::none(),
                false,
            )
        };
        Ok((tensor(residual_out), tensor(out)))
    }
}

/// The name of the fused epilogue in errors.
const FUSED: &str = "all_reduce_add_rms_norm";

/// The fused epilogue as candle's in-place op on the partial output (read, never written),
/// the residual and the norm's weight; its two results are new storages, left in `outputs`.
struct FusedEpilogue<'a> {
    owned: &'a Owned,
    eps: f32,
    /// The new residual and the normed output, once the kernel is enqueued.
    outputs: RefCell<Option<(CudaStorage, CudaStorage)>>,
    failure: Failure,
}

impl InplaceOp3 for FusedEpilogue<'_> {
    fn name(&self) -> &'static str {
        FUSED
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        Err(self.failure.record(Error::NotCuda {
            op: FUSED,
            device: "the CPU".into(),
        }))
    }

    // Without `cuda` (the docs' build) candle has no CUDA storage: its default refuses.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        partial: &mut CudaStorage,
        partial_layout: &Layout,
        residual: &CudaStorage,
        residual_layout: &Layout,
        weight: &CudaStorage,
        weight_layout: &Layout,
    ) -> candle_core::Result<()> {
        let (start, end) = extent(FUSED, partial_layout, &self.failure)?;
        let residual_range = extent(FUSED, residual_layout, &self.failure)?;
        let weight_range = extent(FUSED, weight_layout, &self.failure)?;
        let not_contiguous = || self.failure.record(Error::NotContiguous { op: FUSED });
        let device = partial.device.clone();
        let stream = device.cuda_stream();
        let residual = residual
            .as_cuda_slice::<bf16>()?
            .try_slice(residual_range.0..residual_range.1)
            .ok_or_else(not_contiguous)?;
        let weight = weight
            .as_cuda_slice::<bf16>()?
            .try_slice(weight_range.0..weight_range.1)
            .ok_or_else(not_contiguous)?;
        let mut partial = partial
            .as_cuda_slice_mut::<bf16>()?
            .try_slice_mut(start..end)
            .ok_or_else(not_contiguous)?;
        // SAFETY: the kernel writes every element of both (rows × hidden of each) before
        // anything can read them; on failure they are dropped unread.
        let mut residual_out = unsafe { device.alloc::<bf16>(end - start) }?;
        // SAFETY: as above.
        let mut out = unsafe { device.alloc::<bf16>(end - start) }?;
        self.owned
            .with_dependent(|comm, kernels| {
                same_stream(comm, &stream)?;
                busy(kernels)?
                    .all_reduce_add_rms_norm_to(
                        &mut partial,
                        &residual,
                        &weight,
                        self.eps,
                        &mut residual_out,
                        &mut out,
                        LsaEpilogue::Fused,
                    )
                    .map_err(Error::Nccl)
            })
            .map_err(|err| self.failure.record(err))?;
        *self.outputs.borrow_mut() = Some((
            CudaStorage::wrap_cuda_slice(residual_out, device.clone()),
            CudaStorage::wrap_cuda_slice(out, device),
        ));
        Ok(())
    }
}

/// The sum of a bf16 tensor over the ranks, out of place, through the shipped kernels.
struct ShippedSum<'a> {
    owned: &'a Owned,
    failure: Failure,
}

impl CustomOp1 for ShippedSum<'_> {
    fn name(&self) -> &'static str {
        "all_reduce"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(self.failure.record(Error::NotCuda {
            op: "all_reduce",
            device: "the CPU".into(),
        }))
    }

    // Without `cuda` (the docs' build) candle has no CUDA storage: its default refuses.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (start, end) = extent("all_reduce", layout, &self.failure)?;
        let device = storage.device.clone();
        let stream = device.cuda_stream();
        let send = storage
            .as_cuda_slice::<bf16>()?
            .try_slice(start..end)
            .ok_or_else(|| {
                self.failure
                    .record(Error::NotContiguous { op: "all_reduce" })
            })?;
        // SAFETY: the all-reduce writes every element of the output before anything can read
        // it; on failure the slice is dropped unread.
        let mut recv = unsafe { device.alloc::<bf16>(end - start) }?;
        self.owned
            .with_dependent(|comm, kernels| {
                same_stream(comm, &stream)?;
                busy(kernels)?
                    .all_reduce(&send, &mut recv, LsaAlgorithm::Auto)
                    .map_err(Error::Nccl)
            })
            .map_err(|err| self.failure.record(err))?;
        Ok((
            CudaStorage::wrap_cuda_slice(recv, device),
            layout.shape().clone(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_shapes_follow_the_kernel_rules() {
        // Decode rows of the example's models, within the elements the kernels were made for.
        assert!(fused_shape_fits(8 * 4096, 4096, 8 * 4096));
        assert!(fused_shape_fits(8192, 8192, 8 * 8192));
        assert!(fused_shape_fits(3 * 520, 520, 4096));
        assert!(fused_shape_fits(MAX_HIDDEN, MAX_HIDDEN, MAX_HIDDEN));
        // Past the elements (a prompt's pass), rows not of whole vectors or too long, empty.
        assert!(!fused_shape_fits(32 * 4096, 4096, 8 * 4096));
        assert!(!fused_shape_fits(4 * 36, 36, 4096));
        assert!(!fused_shape_fits(MAX_HIDDEN + 8, MAX_HIDDEN + 8, 1 << 20));
        assert!(!fused_shape_fits(0, 4096, 4096));
        assert!(!fused_shape_fits(0, 0, 4096));
    }

    #[test]
    fn views_of_one_storage_are_told_apart_from_copies() {
        let device = candle_core::Device::Cpu;
        let t = Tensor::zeros((2, 8), DType::F32, &device).unwrap();
        let row = t.get(1).unwrap();
        assert!(same_storage(&t, &row));
        assert!(same_storage(&t, &t.clone()));
        assert!(!same_storage(&t, &t.copy().unwrap()));
    }
}
