//! Safe, zero-overhead Rust bindings to NVIDIA NCCL, on top of [`cudarc`].
//!
//! ```no_run
//! use nccl::{Comm, ReduceOp};
//!
//! fn main() -> nccl::Result<()> {
//!     // Rank, size, GPU and unique id from the launcher (`mpirun`, `srun`, torchrun-style);
//!     // without one, a single rank on GPU 0.
//!     let (comm, stream) = Comm::from_env()?;
//!     let mut grads = stream.clone_htod(&vec![1.0f32; 1 << 20])?;
//!     comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?; // average over every rank
//!     comm.synchronize()?;
//!     Ok(())
//! }
//! ```
//!
//! Add it with `cargo add nccl-rs`; the library is imported as `nccl`.
//!
//! NCCL is loaded at run time (see [`library`]): building needs neither NCCL nor libclang,
//! and a program runs against whatever NCCL 2.x the machine has, with APIs newer than the
//! library returning [`Error::Unsupported`] instead of crashing.
//!
//! # Data-parallel training in a nutshell
//!
//! ```no_run
//! # fn main() -> nccl::Result<()> {
//! use cudarc::driver::CudaContext;
//! use nccl::{Comm, ReduceOp, UniqueId};
//!
//! # let (rank, world, local_rank) = (0usize, 1usize, 0usize);
//! # fn share(id: Option<UniqueId>) -> UniqueId { id.unwrap() }
//! // The GPU's default stream: while a context has no other stream, cudarc tracks no
//! // per-buffer events, so handing buffers to NCCL costs nothing over raw pointers.
//! let stream = CudaContext::new(local_rank)?.default_stream();
//! // Rank 0 creates the id; every rank gets it (MPI, a file, a socket: see `bootstrap`).
//! let id = share((rank == 0).then(UniqueId::new).transpose()?);
//! let comm = Comm::init_rank(stream.clone(), &id, rank, world)?;
//!
//! let mut params = stream.clone_htod(&vec![0.5f32; 1 << 20])?;
//! comm.broadcast_in_place(&mut params, 0)?; // everyone starts from rank 0's parameters
//! let mut grads = stream.alloc_zeros::<f32>(1 << 20)?;
//! // ... compute gradients into `grads` ...
//! comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?; // average over ranks
//! comm.synchronize()?;
//! # Ok(())
//! # }
//! ```
//!
//! # Map of the crate
//!
//! | NCCL concept | module | main items |
//! |---|---|---|
//! | loading, versions | [`library`] | [`version`], [`Version`], [`library::load_from`] |
//! | NCCL's effective parameters | [`params`] | [`params::all`], [`params::get`], [`Param`], [`ParamValue`] |
//! | errors | [`error`] | [`Error`], [`ResultCode`] |
//! | unique id | [`id`] | [`UniqueId`] |
//! | communicator: create (one id or several), split, wait, end | [`comm`] (`init`, `child`, `wait`, `close`, `state`) | [`Comm`], [`Comm::init_rank_scalable`] |
//! | suspend and resume, memory figures, status | [`comm`] (`suspend`, `status`) | [`Comm::suspend`], [`Comm::resume`], [`MemStats`], [`CommStatus`] |
//! | configuration | [`config`] | [`CommConfig`] |
//! | per-collective configuration | [`coll_config`] | [`CollConfig`], [`Operation::with_config`] |
//! | element types | [`dtype`] | [`NcclType`], [`DataType`] |
//! | reductions | [`op`] | [`ReduceOp`], [`PreMulSum`] |
//! | collectives | [`collectives`] (`operation`, `rules`, `dispatch`) | [`Operation`], [`Comm::all_reduce`], ... |
//! | variable-count collectives | [`collectives::vector`] (`layout`, `operation`, `rules`, `plan`, `dispatch`, `checked`) | [`VOperation`], [`Layout`], [`Comm::all_to_all_v`], [`Comm::exchange_counts`] |
//! | point-to-point | [`p2p`] | [`Comm::send`], [`Comm::recv`] |
//! | groups, simulated groups | [`group`] | [`Group`], [`Group::simulate`] |
//! | failures: abort, watchdog, revoke, shrink, grow | [`fault`] (`abort`, `watchdog`, `resize`) | [`AbortHandle`], [`Watchdog`], [`Comm::shrink`], [`Comm::recover`] |
//! | finding the rank that hangs a job: flight recorder, NCCL's RAS, preflight diagnostics | [`diagnostics`] (`flight`, `ras`) | [`Comm::flight_record`], [`diagnostics::flight::compare`], [`diagnostics::ras::query`] |
//! | NCCL memory, registration | [`memory`] | [`NcclBuffer`], [`Comm::register`] |
//! | windows, one-sided RMA | [`window`] | [`Window`], [`Comm::register_window`], [`Window::put_signal`] |
//! | communicator properties | [`properties`] | [`Comm::properties`], [`CommProperties`] |
//! | encrypting NCCL's sockets | [`encryption`] | [`set_encryption`], [`EncryptionKey`] |
//! | starting N processes | [`bootstrap`] | launcher detection, id exchange |
//!
//! # Words used here, one meaning each
//!
//! * **raw handle**: NCCL's `ncclComm_t`. It has one owner, the communicator's shared state
//!   (`comm/state.rs`), and leaves it exactly once, through destroy or abort.
//! * **[`AbortHandle`]**: a clonable capability to abort a communicator from another thread.
//! * **operation**: one NCCL call with its buffers ([`Operation`]): a collective (all-reduce,
//!   broadcast, ...) or a point-to-point transfer (send, receive).
//! * **v-collective**: a collective whose per-rank counts may differ ([`VOperation`]); it
//!   expands into several operations in one group. Its **layout** ([`Layout`]) says where
//!   each rank's **segment** (count and displacement, in elements) lies in a buffer.
//! * **the communicator's stream**: where a [`Comm`]'s operations run unless a call names
//!   another ([`Comm::stream`]). **A default stream** is only ever CUDA's: the stream a
//!   context has without creating one (`CudaContext::default_stream`).
//! * **failure**: why a communicator can no longer run operations (marked failed, revoked,
//!   aborted), recorded with who acted and why; its calls then return it as their error.
//! * **in progress**: NCCL's `ncclInProgress`: a nonblocking communicator still finishing a
//!   call. Nothing else may be called on it, and no CUDA work may go to its streams, until it
//!   is **ready** again ([`Comm::wait_ready`]).
//! * **check** turns a status NCCL returned into a `Result`; **complete** finishes a call on
//!   a communicator (check, then wait until ready); **synchronize** waits for the work queued
//!   on a stream, watching the communicator's asynchronous error meanwhile.
//! * **placement**: where a process sits in the job: rank, size, local rank
//!   ([`bootstrap::Placement`], read from the launcher's variables). Handing an operation to
//!   NCCL is **dispatch**; "launch" is left to launchers (`mpirun`, `srun`, `torchrun`) and
//!   to CUDA's kernel launches (an event NCCL records when a collective's kernel has started
//!   is the **kernel-started event**, NCCL's `launchCompletionEvent`).

//! # Safety guarantees
//!
//! Every operation is validated before NCCL sees it: buffer lengths against NCCL's count
//! rules, roots and peers against the communicator size, buffers and streams against the
//! communicator's device, element types and APIs against the loaded library's version. A
//! rejected call returns [`Error::InvalidArgument`] and enqueues nothing. Buffers are cudarc
//! slices whose event tracking is honoured, so work on other streams is ordered correctly.
//!
//! A [`Comm`] can move between threads but not be shared by them:
//!
//! ```compile_fail
//! fn assert_sync<T: Sync>() {}
//! assert_sync::<nccl::Comm>();
//! ```
//!
//! and a [`Group`] stays on the thread that opened it:
//!
//! ```compile_fail
//! fn assert_send<T: Send>() {}
//! assert_send::<nccl::Group<'static>>();
//! ```

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod agreement;
pub mod bootstrap;
mod calls;
pub mod coll_config;
pub mod collectives;
pub mod comm;
pub mod config;
pub mod device;
pub mod diagnostics;
pub mod dtype;
pub mod encryption;
pub mod error;
pub mod fault;
pub mod group;
pub mod id;
mod inline_list;
pub mod library;
pub mod memory;
pub mod op;
pub mod p2p;
pub mod params;
pub mod properties;
mod release;
mod thread_group;
pub mod window;

pub use coll_config::CollConfig;
pub use collectives::{Construction, Layout, Operation, VOperation};
pub use comm::{Comm, CommStatus, MemStats, Release, ReleaseInFlight};
pub use config::CommConfig;
pub use dtype::{DataType, NcclType};
pub use encryption::{set_encryption, EncryptionKey};
pub use error::{Error, Refusal, Result, ResultCode};
pub use fault::{
    AbortHandle, AbortOutcome, Recovered, ShrinkMode, Survivor, Watchdog, WatchdogAction,
    WatchdogOptions, WatchdogTrip,
};
pub use group::{Group, Simulation};
pub use id::UniqueId;
pub use library::version;
pub use memory::{NcclBuffer, Registration};
pub use op::{PreMulSum, ReduceOp, Reduction};
pub use params::{Param, ParamValue, Params};
pub use properties::CommProperties;
pub use release::Version;
pub use window::{
    RegisterError, Signal, SignalWait, Window, WindowFlags, WindowView, WindowViewMut,
};

/// The raw bindings, for NCCL functions this crate does not wrap.
pub use nccl_sys as sys;

/// The cudarc version this crate is built on, re-exported so users name the same types.
pub use cudarc;
