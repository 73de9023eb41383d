//! Fault tolerance: detecting failed peers, aborting from another thread, a watchdog, and
//! continuing with the survivors (`ncclCommRevoke`, `ncclCommShrink`, `ncclCommGrow`).
//!
//! When a rank dies (its process is killed, its node drops off the network), its peers'
//! collectives never complete: within a node they usually just spin inside their kernels,
//! across nodes NCCL may report `ncclRemoteError` or `ncclSystemError` asynchronously. This
//! module gives the survivors the tools NCCL documents to notice that, stop cleanly and go on.
//!
//! # Detecting a failure
//!
//! * [`Comm::synchronize_timeout`] waits for the work enqueued on the communicator's stream,
//!   polling both the stream and `ncclCommGetAsyncError`: it returns [`Error::Timeout`] or
//!   the asynchronous error instead of blocking forever. [`Comm::synchronize_all_timeout`]
//!   does the same for every stream the communicator's operations ran on.
//! * A [`Watchdog`] ([`Comm::watchdog`]) does the same from a thread of its own, like
//!   `torch.distributed`'s per-communicator timeout, and then aborts, revokes or marks the
//!   communicator failed ([`WatchdogAction`]). The owner's next call, or the wait it is in,
//!   returns an error that says the watchdog did it and why.
//!
//! # Aborting from another thread
//!
//! NCCL allows aborting a communicator while another thread uses it only for *nonblocking*
//! communicators ([`CommConfig::blocking(false)`](crate::CommConfig::blocking)), and only
//! while no thread is inside an NCCL call on it. An [`AbortHandle`] ([`Comm::abort_handle`])
//! keeps those rules:
//!
//! * Every NCCL call on a communicator is made under the communicator's lock; so is the
//!   abort, which therefore never overlaps a call. A nonblocking call returns quickly
//!   (NCCL finishes it in the background), so the lock is never held for long.
//! * A blocking communicator would hold that lock for as long as its call blocks, possibly
//!   forever; `abort_handle` and `watchdog` therefore refuse blocking communicators with
//!   [`Error::InvalidUsage`].
//! * Between the first operation enqueued in a [`Group`](crate::Group) and the end of that
//!   group, NCCL's thread-local group state refers to the communicator. An abort requested
//!   in that window is *deferred*: the communicator is marked aborted at once (every further
//!   enqueue on it fails), and `ncclCommAbort` runs as soon as the group has ended.
//! * An abort is idempotent: aborting a communicator that is already aborted or destroyed
//!   returns [`AbortOutcome::AlreadyReleased`] (never an error, never a double free).
//!
//! After an out-of-band abort, the owning [`Comm`]'s calls fail with an error describing the
//! abort: [`Error::Timeout`] for a watchdog timeout, the [`Error::Nccl`] the watchdog saw
//! for an asynchronous error, and [`Error::InvalidUsage`] for a plain
//! [`AbortHandle::abort`]. Dropping the `Comm` then does nothing, and [`Comm::abort`] is a
//! no-op returning `Ok`. Waits that were in progress ([`Comm::synchronize`],
//! [`Comm::wait_ready`]) return that error too, also when the aborted kernels let the stream
//! drain.
//!
//! # Continuing with the survivors
//!
//! * [`Comm::revoke`] (NCCL 2.28.7) stops the operations in flight and quiesces the
//!   communicator, which stays valid for [`Comm::shrink`], [`Comm::split`], abort and
//!   destroy; new operations on it are refused (by this crate, with a clear error, before
//!   NCCL would refuse them), and [`Comm::finalize`] is no longer allowed.
//! * [`Comm::shrink`] (NCCL 2.27) is called by the surviving ranks only and builds a
//!   communicator without the excluded ranks. With [`ShrinkMode::Abort`] NCCL first aborts
//!   the operations still outstanding on the parent, which is what a recovery after a
//!   failure needs. The parent must still be aborted (or destroyed) afterwards.
//! * [`Comm::recover`] is the whole recovery in one call: it shrinks where NCCL can, and
//!   where it cannot (a parent whose peer died over the network carries `ncclRemoteError`,
//!   and NCCL refuses to shrink a communicator in error; NCCL older than 2.27 has no shrink)
//!   it aborts the parent and builds the survivors' communicator from a fresh unique id,
//!   shared the same way as at start-up.
//! * [`Comm::get_unique_id_for_grow`], [`Comm::grow`] and [`Comm::join_grow`] (NCCL 2.29)
//!   add ranks to a communicator. On an older library they return [`Error::Unsupported`].
//!
//! Every version gate uses [`Library::require`](crate::library::Library::require), so a too-old NCCL gives
//! [`Error::Unsupported`] instead of a missing symbol.
//!
//! # Recovering from a dead rank
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use cudarc::driver::CudaStream;
//! use nccl::{Comm, CommConfig, ReduceOp, ShrinkMode, UniqueId};
//!
//! /// One step of a job whose rank `dead` may fail (learnt from the launcher, a heartbeat...).
//! fn step(stream: Arc<CudaStream>, id: &UniqueId, rank: usize, world: usize, dead: usize)
//!     -> nccl::Result<()> {
//!     let config = CommConfig::new()
//!         .blocking(false)
//!         .ready_timeout(Duration::from_secs(30));
//!     let comm = Comm::init_rank_with_config(stream.clone(), id, rank, world, &config)?;
//!     let mut grads = stream.alloc_zeros::<f32>(1 << 20)?;
//!     comm.all_reduce_in_place(&mut grads, ReduceOp::Sum)?;
//!     match comm.synchronize_timeout(Duration::from_secs(10)) {
//!         Ok(()) => Ok(()),
//!         Err(err) if err.is_fatal() => {
//!             let survivors = comm.shrink(&[dead], ShrinkMode::Abort, Some(&config))?;
//!             comm.abort()?;
//!             survivors.all_reduce_in_place(&mut grads, ReduceOp::Sum)?;
//!             survivors.synchronize_timeout(Duration::from_secs(10))
//!         }
//!         Err(err) => Err(err),
//!     }
//! }
//! ```
//!
//! Over the socket transport NCCL 2.28 records a dead peer as an asynchronous error on the
//! parent and then refuses `ncclCommShrink` on it (also after a revoke); survivors then abort
//! the parent and create a new communicator from a fresh unique id instead.
//!
//! # The watchdog's progress probe
//!
//! While the communicator is ready, the watchdog records a CUDA event on the communicator's
//! stream (under the communicator's lock, so never while NCCL is enqueueing) and checks it at
//! every poll; an event still pending `timeout` after it was recorded trips the watchdog.
//! So the timeout covers everything on that stream, computation included: choose it longer
//! than the longest stretch of work of any kind queued there. While the stream is being
//! captured into a CUDA graph no probe is recorded; capture in
//! `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL` or `RELAXED` mode, as the watchdog's event queries
//! from its own thread would invalidate a capture in `GLOBAL` mode. A nonblocking call that
//! stays in progress longer than `timeout` also trips it. While the owner has the
//! communicator in an open [`Group`](crate::Group) the watchdog does not look at it at all
//! (`ncclGroupEnd` updates the state it would read).

mod abort;
mod resize;
mod watchdog;

use crate::calls;
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::release::Version;

pub use abort::{AbortHandle, AbortOutcome};
pub use resize::{Recovered, ShrinkMode, Survivor};
pub use watchdog::{Watchdog, WatchdogAction, WatchdogOptions, WatchdogTrip};

/// First NCCL with `ncclCommShrink`.
pub const SHRINK_SINCE: Version = calls::ncclCommShrink.since;

/// First NCCL with `ncclCommRevoke`.
pub const REVOKE_SINCE: Version = calls::ncclCommRevoke.since;

/// First NCCL with `ncclCommGrow` and `ncclCommGetUniqueId`.
pub const GROW_SINCE: Version = calls::ncclCommGrow.since;

fn require_nonblocking(comm: &Comm, what: &str) -> Result<()> {
    if comm.is_blocking() {
        return Err(Error::usage(format!(
            "{what} needs a nonblocking communicator (CommConfig::blocking(false)): NCCL only \
             allows aborting a communicator from another thread when no thread can be blocked \
             inside a call on it"
        )));
    }
    Ok(())
}

/// [`Library::require`](crate::library::Library::require) on a version alone, so the gates can be tested without a library.
#[cfg(test)]
pub(crate) fn gate(api: &'static str, needs: Version, found: Version) -> Result<()> {
    if found >= needs {
        Ok(())
    } else {
        Err(Error::Unsupported { api, needs, found })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abort_handle_and_watchdog_cross_threads() {
        fn send_sync_clone<T: Send + Sync + Clone>() {}
        fn send<T: Send>() {}
        send_sync_clone::<AbortHandle>();
        send::<Watchdog>();
    }

    #[test]
    fn version_gates_match_nccl_releases() {
        let on = |v: Version| {
            [
                ("ncclCommShrink", SHRINK_SINCE),
                ("ncclCommRevoke", REVOKE_SINCE),
                ("ncclCommGrow", GROW_SINCE),
                ("ncclCommGetUniqueId", GROW_SINCE),
            ]
            .map(|(api, needs)| gate(api, needs, v).is_ok())
        };
        assert_eq!(on(Version::new(2, 26, 6)), [false, false, false, false]);
        assert_eq!(on(Version::new(2, 27, 3)), [true, false, false, false]);
        // The test machines' 2.28 libraries: revoke from 2.28.7 on, no grow.
        assert_eq!(on(Version::new(2, 28, 3)), [true, false, false, false]);
        assert_eq!(on(Version::new(2, 28, 7)), [true, true, false, false]);
        assert_eq!(on(Version::new(2, 29, 0)), [true, true, true, true]);
        assert_eq!(on(Version::HEADER), [true, true, true, true]);
        match gate(calls::ncclCommGrow.name, GROW_SINCE, Version::new(2, 28, 9)) {
            Err(Error::Unsupported { api, needs, found }) => {
                assert_eq!(api, "ncclCommGrow");
                assert_eq!(needs, Version::new(2, 29, 0));
                assert_eq!(found, Version::new(2, 28, 9));
            }
            other => panic!("{other:?}"),
        }
    }
}
