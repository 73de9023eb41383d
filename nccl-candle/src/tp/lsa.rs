//! [`LsaCollectives`]: tensor-parallel collectives whose bf16 sums run the all-reduce kernels
//! nccl-rs ships ([`nccl::device::LsaAllReduce`], one-shot, no NCCL launch), the rest through
//! NCCL, for ranks in one LSA team (one host's NVLink).

use std::cell::RefCell;

use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Shape, Tensor};
use half::bf16;
use nccl::device::{LsaAlgorithm, LsaAllReduce};
use nccl::{Comm, ReduceOp};

use super::Collectives;
use crate::{check, extent, Error, Failure, Result};

type Kernels<'a> = LsaAllReduce<'a, bf16>;

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
/// kernel for small messages, NCCL for larger ones), everything else NCCL. The tensors must be
/// on the communicator's stream (candle's device stream the communicator was made on).
pub struct LsaCollectives {
    owned: RefCell<Owned>,
    rank: usize,
    size: usize,
}

impl LsaCollectives {
    /// Takes `comm` and creates the shipped kernels on it for up to `max_elements` bf16
    /// elements: collective, every rank with the same `max_elements`; a rank that cannot
    /// (NCCL before 2.29.2, ranks in several LSA teams, ...) fails on every rank alike.
    pub fn new(comm: Comm, max_elements: usize) -> Result<Self> {
        let (rank, size) = (comm.rank(), comm.size());
        let owned = Owned::try_new(comm, |comm| LsaAllReduce::<bf16>::new(comm, max_elements))?;
        Ok(Self {
            owned: RefCell::new(owned),
            rank,
            size,
        })
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
                .borrow()
                .with_dependent(|comm, _| crate::all_reduce(comm, tensor, op));
        }
        let call = ShippedSum {
            owned: &self.owned,
            failure: Failure::default(),
        };
        check("all_reduce", tensor)?;
        tensor
            .apply_op1_no_bwd(&call)
            .map_err(|err| call.failure.take(err))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        self.owned
            .borrow()
            .with_dependent(|comm, _| crate::all_gather(comm, tensor))
    }
}

/// The sum of a bf16 tensor over the ranks, out of place, through the shipped kernels.
struct ShippedSum<'a> {
    owned: &'a RefCell<Owned>,
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
        let mut owned = self.owned.borrow_mut();
        owned
            .with_dependent_mut(|comm, kernels| {
                // The kernels run on the communicator's stream; candle's work is ordered on
                // its device's stream: they must be one.
                if !std::sync::Arc::ptr_eq(comm.stream(), &stream) {
                    return Err(Error::Nccl(nccl::Error::InvalidArgument(
                        "LsaCollectives: the tensor's device stream is not the communicator's"
                            .into(),
                    )));
                }
                kernels
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
