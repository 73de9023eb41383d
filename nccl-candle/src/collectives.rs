//! The collectives on whole tensors (all-reduce, all-gather, reduce-scatter, broadcast), as
//! candle ops on the tensor's CUDA storage.

use candle_core::{
    backend::BackendStorage, CpuStorage, CudaStorage, CustomOp1, DType, InplaceOp1, Layout, Shape,
    Tensor,
};
use nccl::{Comm, NcclType, Operation, ReduceOp};

use crate::op::{check, extent, Failure};
use crate::{Error, Result};

/// Runs `$body` with `$T` the Rust element type of `$dtype` (those both candle and NCCL
/// have); `$other` for the rest.
macro_rules! with_type {
    ($dtype:expr, $T:ident => $body:expr, $other:expr) => {
        match $dtype {
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F8E4M3 => {
                type $T = float8::F8E4M3;
                $body
            }
            _ => $other,
        }
    };
}

/// The in-place collectives, as candle's in-place op on the tensor's storage.
enum InPlaceKind {
    AllReduce(ReduceOp),
    Broadcast(usize),
}

struct InPlace<'c> {
    comm: &'c Comm,
    kind: InPlaceKind,
    /// This crate's typed error, kept here while candle carries only its text.
    failure: Failure,
}

impl InPlace<'_> {
    fn op(&self) -> &'static str {
        match self.kind {
            InPlaceKind::AllReduce(_) => "all_reduce_in_place",
            InPlaceKind::Broadcast(_) => "broadcast_in_place",
        }
    }

    #[cfg(feature = "cuda")]
    fn run<T: NcclType + candle_core::cuda::CudaDType>(
        &self,
        storage: &mut CudaStorage,
        (start, end): (usize, usize),
    ) -> candle_core::Result<()> {
        let stream = storage.device.cuda_stream();
        let slice = storage.as_cuda_slice_mut::<T>()?;
        let mut view = slice
            .try_slice_mut(start..end)
            .ok_or_else(|| self.failure.record(Error::NotContiguous { op: self.op() }))?;
        let call = match self.kind {
            InPlaceKind::AllReduce(op) => Operation::all_reduce_in_place(&mut view, op),
            InPlaceKind::Broadcast(root) => Operation::broadcast_in_place(&mut view, root),
        };
        self.comm
            .enqueue_on(&stream, call)
            .map_err(|err| self.failure.record(Error::Nccl(err)))
    }
}

impl InplaceOp1 for InPlace<'_> {
    fn name(&self) -> &'static str {
        self.op()
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(self.failure.record(Error::NotCuda {
            op: self.op(),
            device: "the CPU".into(),
        }))
    }

    // Without `cuda` (the docs' build) candle has no CUDA storage: its default refuses.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let range = extent(self.op(), layout, &self.failure)?;
        let dtype = storage.dtype();
        with_type!(dtype, T => self.run::<T>(storage, range), {
            Err(self.failure.record(Error::UnsupportedDType { op: self.op(), dtype }))
        })
    }
}

/// The out-of-place collectives, as candle's custom op making a new tensor.
enum OutKind {
    AllReduce(ReduceOp),
    AllGather,
    ReduceScatter(ReduceOp),
}

struct OutOfPlace<'c> {
    comm: &'c Comm,
    kind: OutKind,
    shape: Shape,
    /// This crate's typed error, kept here while candle carries only its text.
    failure: Failure,
}

impl OutOfPlace<'_> {
    fn op(&self) -> &'static str {
        match self.kind {
            OutKind::AllReduce(_) => "all_reduce",
            OutKind::AllGather => "all_gather",
            OutKind::ReduceScatter(_) => "reduce_scatter",
        }
    }

    #[cfg(feature = "cuda")]
    fn run<T: NcclType + candle_core::cuda::CudaDType>(
        &self,
        storage: &CudaStorage,
        (start, end): (usize, usize),
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let device = storage.device.clone();
        let stream = device.cuda_stream();
        // Outside the storage only if candle's layout were inconsistent: refused, not a panic.
        let send = storage
            .as_cuda_slice::<T>()?
            .try_slice(start..end)
            .ok_or_else(|| self.failure.record(Error::NotContiguous { op: self.op() }))?;
        // SAFETY: NCCL writes every element of the output before anything can read it: the
        // shape was computed for this collective (all-reduce: the input's count; all-gather:
        // size times it; reduce-scatter: a size-th of it), and on failure the slice is
        // dropped unread.
        let mut recv = unsafe { device.alloc::<T>(self.shape.elem_count()) }?;
        let call = match self.kind {
            OutKind::AllReduce(op) => Operation::all_reduce(&send, &mut recv, op),
            OutKind::AllGather => Operation::all_gather(&send, &mut recv),
            OutKind::ReduceScatter(op) => Operation::reduce_scatter(&send, &mut recv, op),
        };
        self.comm
            .enqueue_on(&stream, call)
            .map_err(|err| self.failure.record(Error::Nccl(err)))?;
        Ok((
            CudaStorage::wrap_cuda_slice(recv, device),
            self.shape.clone(),
        ))
    }
}

impl CustomOp1 for OutOfPlace<'_> {
    fn name(&self) -> &'static str {
        self.op()
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(self.failure.record(Error::NotCuda {
            op: self.op(),
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
        let range = extent(self.op(), layout, &self.failure)?;
        let dtype = storage.dtype();
        with_type!(dtype, T => self.run::<T>(storage, range), {
            Err(self.failure.record(Error::UnsupportedDType { op: self.op(), dtype }))
        })
    }
}

/// Reduces `tensor` over every rank, in place (`ncclAllReduce`): every rank ends with the
/// reduction of all ranks' tensors, which must have the same shape and type.
pub fn all_reduce_in_place(comm: &Comm, tensor: &Tensor, op: ReduceOp) -> Result<()> {
    let call = InPlace {
        comm,
        kind: InPlaceKind::AllReduce(op),
        failure: Failure::default(),
    };
    check(call.op(), tensor)?;
    tensor
        .inplace_op1(&call)
        .map_err(|err| call.failure.take(err))
}

/// The reduction of `tensor` over every rank, as a new tensor of its shape.
pub fn all_reduce(comm: &Comm, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
    let call = OutOfPlace {
        comm,
        kind: OutKind::AllReduce(op),
        shape: tensor.shape().clone(),
        failure: Failure::default(),
    };
    check(call.op(), tensor)?;
    tensor
        .apply_op1_no_bwd(&call)
        .map_err(|err| call.failure.take(err))
}

/// Every rank's `tensor`, concatenated along the first dimension in rank order
/// (`ncclAllGather`): a tensor `size` times as long in that dimension. A scalar is gathered
/// into a vector of `size` elements.
pub fn all_gather(comm: &Comm, tensor: &Tensor) -> Result<Tensor> {
    let mut dims = tensor.dims().to_vec();
    match dims.first_mut() {
        Some(first) => {
            *first = first.checked_mul(comm.size()).ok_or_else(|| Error::Shape {
                op: "all_gather",
                why: format!(
                    "{:?} gathered over {} ranks overflows",
                    tensor.dims(),
                    comm.size()
                ),
            })?
        }
        None => dims.push(comm.size()),
    }
    let call = OutOfPlace {
        comm,
        kind: OutKind::AllGather,
        shape: Shape::from(dims),
        failure: Failure::default(),
    };
    check(call.op(), tensor)?;
    tensor
        .apply_op1_no_bwd(&call)
        .map_err(|err| call.failure.take(err))
}

/// This rank's block of the reduction of every rank's `tensor` (`ncclReduceScatter`): the
/// reduction split along the first dimension into `size` equal blocks, block `rank` here.
/// The first dimension must be a multiple of the number of ranks.
pub fn reduce_scatter(comm: &Comm, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
    const OP: &str = "reduce_scatter";
    let size = comm.size();
    let mut dims = tensor.dims().to_vec();
    match dims.first_mut() {
        Some(first) if *first % size == 0 => *first /= size,
        _ => {
            return Err(Error::Shape {
                op: OP,
                why: format!(
                    "the first dimension of {:?} is not a multiple of the {size} ranks",
                    tensor.dims()
                ),
            })
        }
    }
    let call = OutOfPlace {
        comm,
        kind: OutKind::ReduceScatter(op),
        shape: Shape::from(dims),
        failure: Failure::default(),
    };
    check(call.op(), tensor)?;
    tensor
        .apply_op1_no_bwd(&call)
        .map_err(|err| call.failure.take(err))
}

/// Copies the root's `tensor` into `tensor` on every other rank, in place (`ncclBroadcast`).
pub fn broadcast_in_place(comm: &Comm, tensor: &Tensor, root: usize) -> Result<()> {
    let call = InPlace {
        comm,
        kind: InPlaceKind::Broadcast(root),
        failure: Failure::default(),
    };
    check(call.op(), tensor)?;
    tensor
        .inplace_op1(&call)
        .map_err(|err| call.failure.take(err))
}
