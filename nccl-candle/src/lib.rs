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
//!
//! Ranks of one process sharing a GPU share its CUDA context: start the process with
//! `CUDA_MODULE_LOADING=EAGER` (nccl-rs's `Comm::init_all` refuses such ranks without it) and
//! call [`load_kernels`] on each rank's device before any rank's first collective (candle
//! loads a kernel module at its first use, and a load can wait for the other rank's
//! collective, which waits for it).
//!
//! Errors are [`Error`]; it converts into `candle_core::Error` (and back, losslessly), so `?`
//! works on this crate's calls inside candle code, and [`Error::find_in`] finds the typed
//! error inside candle's. The tensor-parallel layers are candle
//! [`Module`](candle_core::Module)s as well.
//!
//! The default feature `cuda` builds candle's CUDA backend (candle-core's and candle-nn's
//! `cuda`, whose kernels nvcc compiles at build time). Without it, as on docs.rs, the crate
//! and its API are the same but candle has no CUDA device, so the collectives refuse every
//! tensor: that build is for the documentation.

// Without `cuda`, the private CUDA paths (candle ops' `cuda_fwd`) are left out, and what only
// they use would be reported unused: those lints are the `cuda` build's, where all of it is used.
#![cfg_attr(not(feature = "cuda"), allow(unused_imports, unused_macros, dead_code))]

mod agree;
mod collectives;
mod cuda_device;
pub mod ddp;
pub mod decode;
mod error;
mod gather;
mod kernels;
pub mod models;
mod op;
pub mod tp;

pub use agree::fingerprint;
pub use collectives::{
    all_gather, all_reduce, all_reduce_in_place, broadcast_in_place, reduce_scatter,
};
pub use error::{CheckpointFault, Error, Result};
pub use gather::all_gather_dim;
pub use kernels::load_kernels;
