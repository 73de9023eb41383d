//! The owner of a communicator's raw handle and its state: [`Shared`] holds the lock that
//! every NCCL call on the communicator is made under, and [`State`] what the lock guards (the
//! handle, group membership, a deferred abort, the [`Failure`] that ended its use, and the
//! other streams its operations ran on).
//!
//! Like rusqlite's `InnerConnection`, this is the one place that owns the `ncclComm_t`: it is
//! taken out exactly once, by destroy or abort (see `close.rs` and [`crate::fault`]).

use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, DriverError};
use nccl_sys::ncclComm_t;
use parking_lot::{Mutex, MutexGuard};

use super::in_flight::{release_on_thread, Release, ABORT_WAIT, ABORT_WAIT_IN_PROGRESS};
use super::streams::ForeignStreams;
use crate::calls::{self, Call};
use crate::diagnostics::flight::{FlightRing, RawOp, RingHolder, Who};
use crate::error::{Error, Result, ResultCode};
use crate::library::Library;

/// The raw handle, shared with the handles that may outlive a borrow of the `Comm` (abort
/// handles, watchdogs). The mutex serialises every NCCL call on the communicator and guards
/// its fault state (see [`crate::fault`]).
///
/// Aligned to a cache line and no larger than one, so the lock word, the handle and its
/// fault state, which every enqueue reads, share a single line.
///
/// The lock is parking_lot's: one byte, taken and released inline without touching the
/// process's panic count, where std's reads it twice and releases out of line (the enqueue
/// path meets all of that cache-cold). It does not poison, which is what this state wants:
/// a thread that panicked between NCCL calls leaves the handle as it was.
#[repr(align(64))]
pub(crate) struct Shared {
    state: Mutex<State>,
    pub(crate) blocking: bool,
}

// SAFETY: the raw handle is only used while holding the mutex, so calls on it never overlap,
// and NCCL allows a communicator to be used from different threads one at a time.
unsafe impl Send for Shared {}
// SAFETY: as above; shared references only reach the handle through the mutex.
unsafe impl Sync for Shared {}

impl Shared {
    /// The shared state of a live handle, which it now owns, recording its operations in
    /// `flight` (none: the recorder is off).
    pub(crate) fn new(raw: ncclComm_t, blocking: bool, flight: Option<Box<FlightRing>>) -> Self {
        let mut state = State::new(raw);
        state.flight = flight;
        Self {
            state: Mutex::new(state),
            blocking,
        }
    }

    #[inline(always)]
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// The state if its lock is free within `wait`; for reports that must never wait on a
    /// holder that waits for them (see `RecordedGraph`).
    pub(crate) fn try_lock_for(&self, wait: std::time::Duration) -> Option<MutexGuard<'_, State>> {
        self.state.try_lock_for(wait)
    }

    /// The state if its lock is free now; for descriptions, which must never wait.
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, State>> {
        self.state.try_lock()
    }
}

/// A recorded graph's reports reach the communicator's ring through its shared state, under
/// its lock, waited for at most `wait` (see `RecordedGraph`).
impl RingHolder for Shared {
    fn with_ring(&self, wait: Duration, f: &mut dyn FnMut(&mut FlightRing)) {
        if let Some(mut state) = self.try_lock_for(wait) {
            if let Some(ring) = state.flight.as_deref_mut() {
                f(ring);
            }
        }
    }
}

/// The raw handle and its fault state, guarded by the communicator's lock.
pub(crate) struct State {
    /// The NCCL handle; null once aborted or destroyed.
    pub(crate) ptr: ncclComm_t,
    /// Groups open on the owner's thread that contain this communicator.
    pub(crate) open_groups: u32,
    /// An abort or revoke requested while a group was open, run when the last one ends.
    pub(crate) deferred: Option<Action>,
    /// Why the communicator can no longer run work, if it cannot. Boxed so the state stays
    /// small: every enqueue reads it next to the lock word and the pointer.
    pub(crate) failure: Option<Box<Failure>>,
    /// Whether `ncclCommSuspend` released the communicator's dynamic GPU memory (and no
    /// `ncclCommResume` restored it yet): only calls marked `while_suspended` may be made.
    pub(crate) suspended: bool,
    /// The streams besides its own that its operations were enqueued on, with an event
    /// recorded after the last one on each (see `streams.rs`). Boxed, and made at the first
    /// such stream, so a communicator that only uses its own stream keeps the small state.
    pub(crate) foreign: Option<Box<ForeignStreams>>,
    /// The flight recorder's ring of the last operations (see
    /// [`crate::diagnostics::flight`]); `None` when it is off. Kept after the handle is
    /// released, so a failed or aborted communicator's last operations can still be read.
    pub(crate) flight: Option<Box<FlightRing>>,
    /// Kernels of this crate that reach the peers through the communicator's mappings (the
    /// shipped LSA kernels), by their owner's id: stopped before anything lets go of them
    /// (see [`State::stop_kernels`]). Boxed and made at the first, as `foreign`.
    pub(crate) kernel_stops: Option<Box<KernelStops>>,
}

/// The kernel stops registered on a communicator, by their owner's id.
pub(crate) type KernelStops = Vec<(usize, Arc<dyn KernelStop>)>;

/// How long a stopped kernel that is running is given to see its stop and return (they look
/// every 1 024 spins of a wait, microseconds apart), after every stop's word is written.
pub(crate) const KERNEL_STOP_NOTICE: Duration = Duration::from_millis(10);

/// Stops an owner's kernels that use the communicator's mappings (running, queued or replayed
/// from a graph) so that none touches a peer or its owner's memory afterwards; bounded.
/// Called under the communicator's lock, which its owner takes to unregister.
pub(crate) trait KernelStop: Send + Sync {
    /// Writes the kernels' stop word and waits (bounded) until the GPU wrote it: `true` once
    /// it is written (every kernel of the owner that starts later returns at once, and a
    /// running one within [`KERNEL_STOP_NOTICE`]), `false` if that could not be made sure.
    fn signal(&self) -> bool;

    /// The owner's number in the communicator's flight recorder
    /// (`FlightRing::new_shipped_instance`), if it has one: a stop that was written marks it
    /// stopped there.
    fn flight_instance(&self) -> Option<u32> {
        None
    }
}

impl State {
    pub(crate) fn new(ptr: ncclComm_t) -> Self {
        Self {
            ptr,
            open_groups: 0,
            deferred: None,
            failure: None,
            suspended: false,
            foreign: None,
            flight: None,
            kernel_stops: None,
        }
    }

    /// Records an operation just handed to NCCL in the flight recorder, if it is on.
    #[inline(always)]
    pub(crate) fn record_op(&mut self, op: RawOp) {
        if let Some(ring) = self.flight.as_deref_mut() {
            ring.record(op);
        }
    }

    /// Fails unless `call` may be made now: never once released, after a failure only
    /// calls that inspect, tear down or rebuild the communicator, and while suspended only
    /// calls that inspect, resume or tear it down.
    #[inline]
    pub(crate) fn usable_for(&self, call: &'static Call, rank: usize) -> Result<()> {
        if !self.ptr.is_null() && self.failure.is_none() && !self.suspended {
            return Ok(());
        }
        self.unusable_for(call, rank)
    }

    #[cold]
    #[inline(never)]
    fn unusable_for(&self, call: &'static Call, rank: usize) -> Result<()> {
        if self.ptr.is_null() {
            return Err(self.released_error(call.name, rank));
        }
        match &self.failure {
            Some(failure) if !call.after_failure => return Err(failure.to_error(call.name, rank)),
            _ => {}
        }
        if self.suspended && !call.while_suspended {
            return Err(Error::Suspended {
                call: call.name,
                rank,
            });
        }
        Ok(())
    }

    /// Fails with the recorded failure, or because the communicator was released.
    pub(crate) fn check_failure(&self, call: &'static str, rank: usize) -> Result<()> {
        if self.ptr.is_null() {
            return Err(self.released_error(call, rank));
        }
        match &self.failure {
            Some(failure) => Err(failure.to_error(call, rank)),
            None => Ok(()),
        }
    }

    /// The error for a call on a released communicator.
    pub(crate) fn released_error(&self, call: &'static str, rank: usize) -> Error {
        match &self.failure {
            Some(failure) if failure.by != Actor::Owner => failure.to_error(call, rank),
            _ => Error::usage(format!(
                "{call} on a communicator that was already aborted or destroyed"
            )),
        }
    }

    /// Takes the raw handle out (null if it was already taken), recording why. The other
    /// streams' events go with it: an abort stops the kernels they wait for, and a destroy is
    /// only handed work that finished.
    pub(crate) fn take(&mut self, failure: Failure) -> ncclComm_t {
        let raw = std::mem::replace(&mut self.ptr, ptr::null_mut());
        self.deferred = None;
        self.foreign = None;
        self.record(failure.state, failure);
        raw
    }

    /// Aborts the communicator (`ncclCommAbort`): takes the raw handle out, recording
    /// `failure` as its release, stops this crate's kernels, and hands it to NCCL, which
    /// sets the flags its kernels watch and frees it without waiting for peers. Does
    /// nothing if it was already released. The one place a live communicator is aborted
    /// (owner, drop, abort handle, watchdog). NCCL's abort runs on a thread of its own,
    /// waited for at most [`ABORT_WAIT`]: it also waits for the CUDA graphs that captured
    /// the communicator to be destroyed, which may be this caller's to do (see
    /// `in_flight.rs`); an abort still running then is `Ok` (its kernels are stopped) and
    /// listed by [`Comm::releases_in_flight`](super::Comm::releases_in_flight).
    pub(crate) fn abort(
        &mut self,
        lib: &'static Library,
        ctx: &Arc<CudaContext>,
        who: &Who,
        failure: Failure,
    ) -> Result<()> {
        if self.ptr.is_null() {
            self.take(Failure {
                state: FailureState::Released,
                ..failure
            });
            return Ok(());
        }
        // A nonblocking call still in progress: NCCL's abort first joins its job, which may
        // still be enqueuing kernels on the caller's streams, and only then waits for graphs;
        // the caller records its buffers' events there once the abort returns, so it is given
        // longer.
        let mut code = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: live handle under its lock; `code` is a valid out-pointer.
        let queried = unsafe { lib.api().ncclCommGetAsyncError(self.ptr, &mut code) };
        let in_progress = lib
            .check(calls::ncclCommGetAsyncError.name, queried)
            .is_ok()
            && ResultCode::from_raw(code) == ResultCode::InProgress;
        let wait = if in_progress {
            ABORT_WAIT_IN_PROGRESS
        } else {
            ABORT_WAIT
        };
        let raw = self.take(Failure {
            state: FailureState::Released,
            ..failure
        });
        // Best effort, for the stops below.
        let _ = ctx.bind_to_thread();
        // This crate's own kernels first: NCCL's abort stops only NCCL's.
        self.stop_kernels();
        // An abort from another thread than the owner's needs a nonblocking communicator
        // that no group holds, which the callers check (see `crate::fault`).
        release_on_thread(lib, ctx, who, Release::Abort, raw, wait).unwrap_or(Ok(()))
    }

    /// Stops every registered kernel of this crate (see [`KernelStop`]), then gives the
    /// running ones [`KERNEL_STOP_NOTICE`] to return: what every path that lets go of the
    /// communicator's mappings, or stops NCCL's work on it, runs first (abort, revoke,
    /// shrink with abort; the owner's own drop runs its stop alone). A stop whose word was
    /// written is taken out (its kernels return at once whenever they run); one that could
    /// not be written stays, so that the next path tries again.
    ///
    /// The invariant, for every owner of shipped kernels (`LsaAllReduce`): its stop is
    /// registered here from its creation until it knows none of its kernels can still run,
    /// and the memory the stop writes and the kernels read lives at least as long as the
    /// stop is registered (leaked, if need be); only this function (under the lock) and the
    /// owner's drop (its own stop, under the lock) run it.
    pub(crate) fn stop_kernels(&mut self) {
        let Some(stops) = self.kernel_stops.as_mut() else {
            return;
        };
        if stops.is_empty() {
            return;
        }
        let written: Vec<bool> = stops.iter().map(|(_, stop)| stop.signal()).collect();
        if let Some(ring) = self.flight.as_deref_mut() {
            for ((_, stop), _) in stops.iter().zip(&written).filter(|(_, w)| **w) {
                if let Some(instance) = stop.flight_instance() {
                    ring.shipped_stopped(instance);
                }
            }
        }
        std::thread::sleep(KERNEL_STOP_NOTICE);
        let mut written = written.into_iter();
        stops.retain(|_| !written.next().unwrap_or(false));
    }

    /// Carries out `action` now (no group holds the communicator), recording `failure`.
    pub(crate) fn run(
        &mut self,
        lib: &'static Library,
        ctx: &Arc<CudaContext>,
        who: &Who,
        action: Action,
        failure: Failure,
    ) -> Result<()> {
        match action {
            Action::Report => {
                self.record(FailureState::Failed, failure);
                Ok(())
            }
            Action::Abort => self.abort(lib, ctx, who, failure),
            Action::Revoke => {
                // NCCL's revoke quiesces only its own kernels, and waits for the stream work
                // queued before its last launch (a shipped kernel waiting for its peers).
                self.stop_kernels();
                // SAFETY: live handle under its lock; the flags must be NCCL_REVOKE_DEFAULT.
                let status = unsafe {
                    lib.api()
                        .ncclCommRevoke(self.ptr, nccl_sys::NCCL_REVOKE_DEFAULT)
                };
                lib.check_pending(calls::ncclCommRevoke.name, status)?;
                self.record(FailureState::Revoked, failure);
                Ok(())
            }
        }
    }

    /// Records a failure; an earlier one keeps its cause and author, and the state only
    /// ever gets worse (failed, then revoked, then released).
    pub(crate) fn record(&mut self, state: FailureState, failure: Failure) {
        match &mut self.failure {
            Some(previous) => previous.state = previous.state.max(state),
            None => self.failure = Some(Box::new(Failure { state, ..failure })),
        }
    }
}

/// What happened to a communicator, from least to most final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum FailureState {
    /// Marked failed by a watchdog ([`WatchdogAction::Report`]); still allocated.
    Failed,
    /// Revoked: quiesced, and only shrink, split, abort and destroy remain.
    Revoked,
    /// Aborted or destroyed: the handle is gone.
    Released,
}

/// Who acted on the communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Actor {
    Owner,
    AbortHandle,
    Watchdog,
}

/// Why a communicator was acted on.
#[derive(Debug, Clone)]
pub(crate) enum Cause {
    /// Asked for explicitly.
    Requested,
    /// No progress: `what` did not happen within `waited`.
    Stalled {
        what: &'static str,
        waited: Duration,
    },
    /// `ncclCommGetAsyncError` reported an error.
    AsyncError {
        code: ResultCode,
        description: String,
        last_error: Option<String>,
    },
    /// A CUDA call of the watchdog failed (a sticky error of the context, usually).
    Cuda(DriverError),
}

/// A failure recorded on a communicator.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) state: FailureState,
    pub(crate) by: Actor,
    pub(crate) cause: Cause,
}

impl Failure {
    /// The owner aborted, destroyed or revoked the communicator itself.
    pub(crate) fn owner(state: FailureState) -> Self {
        Self {
            state,
            by: Actor::Owner,
            cause: Cause::Requested,
        }
    }

    /// The error a call on the communicator gets.
    pub(crate) fn to_error(&self, call: &'static str, rank: usize) -> Error {
        let verb = match self.state {
            FailureState::Failed => "marked failed",
            FailureState::Revoked => "revoked",
            FailureState::Released => "aborted",
        };
        let who = match self.by {
            Actor::Owner => "",
            Actor::AbortHandle => " through an AbortHandle",
            Actor::Watchdog => " by its watchdog",
        };
        let hint = match self.state {
            FailureState::Failed => {
                "; abort it, or shrink it with ShrinkMode::Abort to go on without the failed ranks"
            }
            FailureState::Revoked => "; only shrink, split, abort and destroy remain possible",
            FailureState::Released => "",
        };
        match &self.cause {
            Cause::Requested => Error::usage(format!(
                "{call} on rank {rank}: the communicator was {verb}{who}{hint}"
            )),
            Cause::Stalled { what, waited } => Error::Timeout {
                what: format!(
                    "{what} on rank {rank}; the communicator was {verb}{who}, so {call} cannot \
                     go on{hint}"
                ),
                waited: *waited,
            },
            Cause::AsyncError {
                code,
                description,
                last_error,
            } => Error::Nccl {
                call: "ncclCommGetAsyncError",
                code: *code,
                description: format!(
                    "{description} (on rank {rank}; the communicator was {verb}{who}, so {call} \
                     cannot go on{hint})"
                ),
                last_error: last_error.clone(),
            },
            Cause::Cuda(err) => Error::Cuda(*err),
        }
    }
}

/// What to do with a communicator that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Action {
    Report,
    Revoke,
    Abort,
}

impl Action {
    pub(crate) fn state(self) -> FailureState {
        match self {
            Action::Report => FailureState::Failed,
            Action::Revoke => FailureState::Revoked,
            Action::Abort => FailureState::Released,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn shared_state_fits_one_cache_line() {
        assert_eq!(std::mem::align_of::<Shared>(), 64);
        assert_eq!(std::mem::size_of::<Shared>(), 64);
    }

    pub(crate) fn null_state() -> State {
        State::new(ptr::null_mut())
    }

    pub(crate) fn live_state() -> State {
        // Never passed to NCCL: the tests below only exercise the bookkeeping.
        State::new(std::ptr::NonNull::<nccl_sys::ncclComm>::dangling().as_ptr())
    }

    #[test]
    fn calls_after_a_failure_are_refused_except_management() {
        let mut state = live_state();
        assert!(state.usable_for(&calls::ncclAllReduce, 1).is_ok());
        state.record(
            FailureState::Failed,
            Failure {
                state: FailureState::Failed,
                by: Actor::Watchdog,
                cause: Cause::Stalled {
                    what: "work enqueued on the communicator's stream to finish",
                    waited: Duration::from_secs(5),
                },
            },
        );
        let err = state.usable_for(&calls::ncclAllReduce, 1).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("marked failed by its watchdog"), "{text}");
        assert!(text.contains("ncclAllReduce cannot go on"), "{text}");
        assert!(text.contains("rank 1"), "{text}");
        assert!(text.contains("ShrinkMode::Abort"), "{text}");
        for call in [
            &calls::ncclCommShrink,
            &calls::ncclCommAbort,
            &calls::ncclCommGetAsyncError,
        ] {
            assert!(state.usable_for(call, 1).is_ok(), "{}", call.name);
        }
        assert!(state.check_failure("Comm::synchronize", 1).is_err());
        // A later revoke keeps the cause and author, and gets worse only.
        state.record(FailureState::Revoked, Failure::owner(FailureState::Revoked));
        let failure = state.failure.clone().unwrap();
        assert_eq!(failure.state, FailureState::Revoked);
        assert_eq!(failure.by, Actor::Watchdog);
        state.record(FailureState::Failed, Failure::owner(FailureState::Failed));
        assert_eq!(state.failure.as_ref().unwrap().state, FailureState::Revoked);
        // Taking the handle out marks it released.
        let raw = state.take(Failure::owner(FailureState::Released));
        assert!(!raw.is_null());
        assert!(state.ptr.is_null());
        let text = state
            .usable_for(&calls::ncclCommShrink, 1)
            .unwrap_err()
            .to_string();
        assert!(text.contains("aborted by its watchdog"), "{text}");
    }

    #[test]
    fn errors_name_who_acted_and_why() {
        let released_by_owner = {
            let mut h = live_state();
            h.take(Failure::owner(FailureState::Released));
            h
        };
        let text = released_by_owner
            .usable_for(&calls::ncclAllReduce, 0)
            .unwrap_err()
            .to_string();
        assert!(text.contains("already aborted or destroyed"), "{text}");
        assert!(null_state().usable_for(&calls::ncclAllReduce, 0).is_err());

        let by_handle = Failure {
            state: FailureState::Released,
            by: Actor::AbortHandle,
            cause: Cause::Requested,
        };
        let text = by_handle.to_error("ncclBroadcast", 2).to_string();
        assert!(text.contains("aborted through an AbortHandle"), "{text}");
        assert!(text.contains("ncclBroadcast on rank 2"), "{text}");

        let async_err = Failure {
            state: FailureState::Released,
            by: Actor::Watchdog,
            cause: Cause::AsyncError {
                code: ResultCode::RemoteError,
                description: "remote process exited or there was a network error".into(),
                last_error: Some("peer 3 closed the connection".into()),
            },
        };
        let err = async_err.to_error("Comm::synchronize", 0);
        assert_eq!(err.nccl_code(), Some(ResultCode::RemoteError));
        assert!(err.is_fatal());
        let text = err.to_string();
        assert!(text.contains("aborted by its watchdog"), "{text}");
        assert!(text.contains("peer 3 closed the connection"), "{text}");

        let revoked = Failure::owner(FailureState::Revoked).to_error("ncclAllReduce", 0);
        assert!(revoked
            .to_string()
            .contains("only shrink, split, abort and destroy"));
    }

    #[test]
    fn a_suspended_communicator_takes_only_queries_resume_and_tear_down() {
        let mut state = live_state();
        state.suspended = true;
        for call in [
            &calls::ncclAllReduce,
            &calls::ncclSend,
            &calls::ncclCommSplit,
            &calls::ncclCommShrink,
            &calls::ncclCommWindowRegister,
            &calls::ncclCommWindowDeregister,
            &calls::ncclCommRegister,
            &calls::ncclCommFinalize,
            &calls::ncclCommSuspend,
            &calls::ncclPutSignal,
        ] {
            match state.usable_for(call, 3) {
                Err(Error::Suspended { call: name, rank }) => {
                    assert_eq!((name, rank), (call.name, 3));
                }
                other => panic!("{}: {other:?}", call.name),
            }
        }
        for call in [
            &calls::ncclCommResume,
            &calls::ncclCommMemStats,
            &calls::ncclCommGetAsyncError,
            &calls::ncclCommCount,
            &calls::ncclCommAbort,
            &calls::ncclCommDestroy,
        ] {
            assert!(state.usable_for(call, 3).is_ok(), "{}", call.name);
        }
        let text = state
            .usable_for(&calls::ncclAllReduce, 3)
            .unwrap_err()
            .to_string();
        assert!(text.contains("ncclAllReduce on rank 3"), "{text}");
        assert!(text.contains("Comm::resume"), "{text}");
        // A failure recorded meanwhile wins: it is what the caller must act on.
        state.record(FailureState::Failed, Failure::owner(FailureState::Failed));
        assert!(matches!(
            state.usable_for(&calls::ncclAllReduce, 3),
            Err(Error::InvalidUsage(_))
        ));
        // Resumed and healthy again: the fast path passes.
        let mut state = live_state();
        state.suspended = true;
        state.suspended = false;
        assert!(state.usable_for(&calls::ncclAllReduce, 3).is_ok());
        // Released while suspended: the release is what is reported.
        let mut state = live_state();
        state.suspended = true;
        state.take(Failure::owner(FailureState::Released));
        assert!(matches!(
            state.usable_for(&calls::ncclCommResume, 3),
            Err(Error::InvalidUsage(_))
        ));
    }
}
