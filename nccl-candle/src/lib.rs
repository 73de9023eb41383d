//! NCCL collectives on candle tensors, through nccl-rs.
//!
//! candle keeps a CUDA tensor's data in a cudarc `CudaSlice` (`candle_core::CudaStorage`),
//! the same cudarc nccl-rs takes, so a collective runs on the tensor's own memory, with no
//! copy, on the stream of the tensor's device (`CudaDevice::cuda_stream`), ordered after the
//! candle work that produced it when both ran from the same host thread (candle's
//! `Device::new_cuda` uses CUDA's per-thread default stream; a tensor made on one thread and
//! reduced from another is ordered only by the caller, e.g. with `Device::new_cuda_with_stream`
//! shared by both). Every rank calls the same functions in the same order, as with NCCL itself.
//!
//! The in-place collectives write the tensor's storage, which candle shares between a
//! tensor and its clones, views, `detach`, and `contiguous()` or same-type `to_dtype` of an
//! already contiguous tensor: all of them see the result, as with candle's own in-place ops.
//!
//! Refused before NCCL, with [`Error`]: tensors not on a CUDA device, tensors that are not
//! contiguous (a view with strides; call `.contiguous()` first), and element types NCCL has
//! no type for (`i16`). These refusals are this rank's alone, as NCCL's own argument errors
//! are: a peer that passed a good tensor waits in the collective (the watchdog or an
//! `AbortHandle` of nccl-rs ends it), so every rank must pass tensors of the same kind. nccl-rs's own checks follow (the stream's device against the
//! communicator's, sizes, the library version for `F8E4M3`).
//!
//! [`all_gather_dim`] gathers along any dimension. [`tp`] has tensor parallelism for
//! inference: column- and row-parallel linear layers and a vocab-parallel embedding, loaded
//! shard by shard through candle's `ShardedVarBuilder`.
//!
//! Run on 2×H100 with NCCL 2.32.3, with the data- and tensor-parallel modules ([`ddp`],
//! [`tp`]) and their examples (see this crate's README).

use candle_core::{
    backend::BackendStorage, CpuStorage, CudaStorage, CustomOp1, DType, InplaceOp1, Layout, Shape,
    Tensor,
};
use nccl::{Comm, NcclType, Operation, ReduceOp};

mod agree;
pub mod ddp;
mod gather;
pub mod tp;

pub use agree::fingerprint;
pub use gather::all_gather_dim;

/// What goes wrong in a collective on tensors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tensor is not on a CUDA device.
    #[error("{op}: the tensor is on {device}, not on a CUDA device")]
    NotCuda {
        /// The collective.
        op: &'static str,
        /// The tensor's device, as candle names it.
        device: String,
    },
    /// The tensor's elements are not one contiguous run (call `.contiguous()` first).
    #[error("{op}: the tensor is not contiguous (call .contiguous() first)")]
    NotContiguous {
        /// The collective.
        op: &'static str,
    },
    /// NCCL has no type for the tensor's elements.
    #[error("{op}: NCCL has no element type for {dtype:?}")]
    UnsupportedDType {
        /// The collective.
        op: &'static str,
        /// The tensor's element type.
        dtype: DType,
    },
    /// The tensor's shape does not suit the collective.
    #[error("{op}: {why}")]
    Shape {
        /// The collective.
        op: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// An argument is outside what the call accepts (a root past the ranks, a rank past
    /// the world size, a global batch that does not split, a group's rank past its size).
    #[error("{op}: {why}")]
    Argument {
        /// The call.
        op: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A variable cannot take part in a data-parallel call on this rank (on the CPU or on
    /// another GPU than the communicator's, not contiguous, an element type NCCL lacks, a
    /// name given twice, a gradient of another shape or type than its variable).
    #[error("{op}: variable {name:?}: {why}")]
    Variable {
        /// The call.
        op: &'static str,
        /// The variable's name.
        name: String,
        /// What is wrong with it.
        why: String,
    },
    /// The ranks disagree on what must be the same on all of them (the variables' names,
    /// shapes and element types, a bucket size, a root). Every rank returns this error, found
    /// by an exchange of fingerprints before any collective that depends on it.
    #[error("{what} differ between the ranks: rank(s) {ranks:?} disagree with rank 0")]
    Mismatch {
        /// What was compared.
        what: &'static str,
        /// The ranks whose fingerprint differs from rank 0's.
        ranks: Vec<usize>,
    },
    /// Other ranks failed their own checks before a data-parallel call (their error says
    /// why), so this rank refused it too rather than wait for them.
    #[error("{op}: rank(s) {ranks:?} refused the call (their error says why)")]
    PeerRefused {
        /// The call.
        op: &'static str,
        /// The ranks that refused.
        ranks: Vec<usize>,
    },
    /// A dimension of a tensor to shard over a tensor-parallel group does not split evenly
    /// over its ranks (found from the layer's arguments, or in the weights file).
    #[error("{name}: dimension {dim} of {shape:?} does not split over {world_size} ranks")]
    NotDivisible {
        /// The tensor's name (the full path in the weights file).
        name: String,
        /// Its whole shape.
        shape: Vec<usize>,
        /// The dimension sharded.
        dim: usize,
        /// The number of ranks.
        world_size: usize,
    },
    /// A tensor loaded from the weights (a rank's shard, or a whole replicated tensor) does
    /// not have the shape the layer expects.
    #[error("{name}: loaded a tensor of shape {got:?}, expected {expected:?}")]
    ShardShape {
        /// The tensor's name (the full path in the weights file).
        name: String,
        /// The shape the layer expects.
        expected: Vec<usize>,
        /// The shape loaded.
        got: Vec<usize>,
    },
    /// Ranks simulated on threads ([`tp::ThreadedCollectives`]) could not exchange tensors:
    /// another rank's thread panicked during an exchange.
    #[error("threaded collectives: {0}")]
    Threaded(String),
    /// NCCL or nccl-rs refused or failed the collective.
    #[error(transparent)]
    Nccl(#[from] nccl::Error),
    /// candle failed (allocation, storage access).
    #[error(transparent)]
    Candle(candle_core::Error),
}

impl From<candle_core::Error> for Error {
    fn from(err: candle_core::Error) -> Self {
        Error::Candle(err)
    }
}

/// The result of this crate's functions.
pub type Result<T> = std::result::Result<T, Error>;

/// Checks what this crate checks of a tensor before NCCL sees it.
fn check(op: &'static str, tensor: &Tensor) -> Result<()> {
    if !tensor.device().is_cuda() {
        return Err(Error::NotCuda {
            op,
            device: format!("{:?}", tensor.device().location()),
        });
    }
    if !tensor.is_contiguous() {
        return Err(Error::NotContiguous { op });
    }
    match tensor.dtype() {
        DType::I16 => Err(Error::UnsupportedDType {
            op,
            dtype: tensor.dtype(),
        }),
        _ => Ok(()),
    }
}

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

/// The typed error of a collective run inside candle's op machinery, whose own error type
/// keeps only text (`candle_core::Error::Wrapped` cannot be downcast): the op records it
/// here and hands candle its text; the caller takes it back.
#[derive(Default)]
struct Failure(std::cell::RefCell<Option<Error>>);

impl Failure {
    /// Records `err` and gives candle its text.
    fn record(&self, err: Error) -> candle_core::Error {
        let text = err.to_string();
        *self.0.borrow_mut() = Some(err);
        candle_core::Error::Msg(text)
    }

    /// The error to report for candle's `err`: the typed one recorded, else candle's own.
    fn take(&self, err: candle_core::Error) -> Error {
        self.0.borrow_mut().take().unwrap_or(Error::Candle(err))
    }
}

/// The first and one-past-last element of a contiguous layout.
fn extent(
    op: &'static str,
    layout: &Layout,
    failure: &Failure,
) -> candle_core::Result<(usize, usize)> {
    layout
        .contiguous_offsets()
        .ok_or_else(|| failure.record(Error::NotContiguous { op }))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_errors_come_back_through_candle() {
        let failure = Failure::default();
        let through = failure.record(Error::Nccl(nccl::Error::InvalidArgument("a size".into())));
        assert!(through.to_string().contains("a size"), "{through}");
        match failure.take(through) {
            Error::Nccl(nccl::Error::InvalidArgument(text)) => assert_eq!(text, "a size"),
            other => panic!("{other:?}"),
        }
        // Nothing recorded: candle's own error.
        let own = candle_core::Error::Msg("candle's own".into());
        assert!(matches!(failure.take(own), Error::Candle(_)));
    }
}
