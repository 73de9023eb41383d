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
//!   the asynchronous error instead of blocking forever.
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
//! Every version gate uses [`Library::require`], so a too-old NCCL gives
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

use std::os::raw::c_int;
use std::ptr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, DriverError};
use nccl_sys::ncclComm_t;

use crate::comm::{rank_and_size, Comm, CommCore};
use crate::config::{CommConfig, RawConfig};
use crate::error::{Error, Result, ResultCode};
use crate::group;
use crate::id::{UniqueId, UNIQUE_ID_BYTES};
use crate::library::{self, Library, Version};

/// First NCCL with `ncclCommShrink`.
pub const SHRINK_SINCE: Version = Version::new(2, 27, 0);
/// First NCCL with `ncclCommRevoke`.
pub const REVOKE_SINCE: Version = Version::new(2, 28, 7);
/// First NCCL with `ncclCommGrow` and `ncclCommGetUniqueId`.
pub const GROW_SINCE: Version = Version::new(2, 29, 0);

// ---------------------------------------------------------------------------------------
// Shared state of a communicator (behind `CommCore`'s lock)
// ---------------------------------------------------------------------------------------

/// The raw handle and its fault state, guarded by the communicator's lock.
pub(crate) struct Handle {
    /// The NCCL handle; null once aborted or destroyed.
    pub(crate) ptr: ncclComm_t,
    /// Groups open on the owner's thread that contain this communicator.
    pub(crate) open_groups: u32,
    /// An abort or revoke requested while a group was open, run when the last one ends.
    pub(crate) deferred: Option<Action>,
    /// Why the communicator can no longer run work, if it cannot. Boxed so the handle stays
    /// small: every enqueue reads it next to the lock word and the pointer.
    pub(crate) failure: Option<Box<Failure>>,
}

impl Handle {
    pub(crate) fn new(ptr: ncclComm_t) -> Self {
        Self {
            ptr,
            open_groups: 0,
            deferred: None,
            failure: None,
        }
    }

    /// Fails unless `call` may be made now: never once released, and after a failure only
    /// calls that inspect, tear down or rebuild the communicator.
    #[inline]
    pub(crate) fn usable_for(&self, call: &'static str, rank: usize) -> Result<()> {
        if !self.ptr.is_null() && self.failure.is_none() {
            return Ok(());
        }
        self.unusable_for(call, rank)
    }

    #[cold]
    #[inline(never)]
    fn unusable_for(&self, call: &'static str, rank: usize) -> Result<()> {
        if self.ptr.is_null() {
            return Err(self.released_error(call, rank));
        }
        match &self.failure {
            Some(failure) if !allowed_after_failure(call) => Err(failure.to_error(call, rank)),
            _ => Ok(()),
        }
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

    /// Takes the raw handle out (null if it was already taken), recording why.
    pub(crate) fn take(&mut self, failure: Failure) -> ncclComm_t {
        let raw = std::mem::replace(&mut self.ptr, ptr::null_mut());
        self.deferred = None;
        self.record(failure.state, failure);
        raw
    }

    /// Records a failure; an earlier one keeps its cause and author, and the state only
    /// ever gets worse (failed, then revoked, then released).
    fn record(&mut self, state: FailureState, failure: Failure) {
        match &mut self.failure {
            Some(previous) => previous.state = previous.state.max(state),
            None => self.failure = Some(Box::new(Failure { state, ..failure })),
        }
    }
}

/// Calls allowed on a communicator that failed but was not released: queries, tear-down,
/// and the calls that build a replacement from it.
fn allowed_after_failure(call: &str) -> bool {
    matches!(
        call,
        "ncclCommGetAsyncError"
            | "ncclCommCount"
            | "ncclCommUserRank"
            | "ncclCommCuDevice"
            | "ncclRedOpDestroy"
            | "ncclCommDeregister"
            | "ncclCommWindowDeregister"
            | "ncclCommSplit"
            | "ncclCommShrink"
            | "ncclCommRevoke"
            | "ncclCommAbort"
            | "ncclCommDestroy"
    )
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
    Handle,
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
            Actor::Handle => " through an AbortHandle",
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
    fn state(self) -> FailureState {
        match self {
            Action::Report => FailureState::Failed,
            Action::Revoke => FailureState::Revoked,
            Action::Abort => FailureState::Released,
        }
    }
}

/// The outcome of [`AbortHandle::abort`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbortOutcome {
    /// `ncclCommAbort` ran; the communicator is gone.
    Aborted,
    /// The communicator is in a [`Group`](crate::Group) still open on its owner's thread: it
    /// is marked aborted now and `ncclCommAbort` runs when that group ends.
    Deferred,
    /// It was already aborted or destroyed (or an abort is already pending); nothing done.
    AlreadyReleased,
}

/// What [`act`] must do, decided from the bookkeeping alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Nothing: already released, or the same action already happened or is pending.
    Nothing,
    /// Recorded; NCCL is called when the owner's open group ends.
    Deferred,
    /// Recorded (a report needs no NCCL call).
    Recorded,
    /// Call NCCL now.
    Run,
}

/// Records `failure` for `action` on `handle` and decides whether NCCL must be called now.
fn plan(handle: &mut Handle, action: Action, failure: &Failure) -> Step {
    if handle.ptr.is_null() || handle.deferred == Some(Action::Abort) {
        return Step::Nothing;
    }
    let state = handle.failure.as_ref().map(|f| f.state);
    if action == Action::Revoke && state >= Some(FailureState::Revoked) {
        return Step::Nothing;
    }
    if action == Action::Report {
        if state.is_some() {
            return Step::Nothing;
        }
        handle.record(FailureState::Failed, failure.clone());
        return Step::Recorded;
    }
    if handle.open_groups > 0 {
        handle.record(action.state(), failure.clone());
        handle.deferred = handle.deferred.max(Some(action));
        return Step::Deferred;
    }
    Step::Run
}

/// Carries out `action` on the communicator behind `handle` (its lock held), recording
/// `failure`.
fn act(
    handle: &mut Handle,
    lib: &Library,
    ctx: &CudaContext,
    action: Action,
    failure: Failure,
) -> Result<AbortOutcome> {
    match plan(handle, action, &failure) {
        Step::Nothing => Ok(AbortOutcome::AlreadyReleased),
        Step::Deferred => Ok(AbortOutcome::Deferred),
        Step::Recorded => Ok(AbortOutcome::Aborted),
        Step::Run => {
            run_action(handle, lib, ctx, action, failure)?;
            Ok(AbortOutcome::Aborted)
        }
    }
}

/// Calls NCCL for `action` now (no group is open).
fn run_action(
    handle: &mut Handle,
    lib: &Library,
    ctx: &CudaContext,
    action: Action,
    failure: Failure,
) -> Result<()> {
    match action {
        Action::Report => {
            handle.record(FailureState::Failed, failure);
            Ok(())
        }
        Action::Abort => {
            let raw = handle.take(Failure {
                state: FailureState::Released,
                ..failure
            });
            if raw.is_null() {
                return Ok(());
            }
            // Best effort: NCCL finds its device itself, but its cleanup may use the
            // current context.
            let _ = ctx.bind_to_thread();
            // SAFETY: the handle was taken out of the shared state under its lock, so no
            // other thread can use it; the communicator is nonblocking (checked when the
            // abort handle or watchdog was made) and no group holds it (`open_groups == 0`),
            // as NCCL requires for an abort from another thread.
            let status = unsafe { lib.api().ncclCommAbort(raw) };
            lib.check("ncclCommAbort", status)
        }
        Action::Revoke => {
            // SAFETY: live handle under its lock; the flags must be NCCL_REVOKE_DEFAULT.
            let status = unsafe {
                lib.api()
                    .ncclCommRevoke(handle.ptr, nccl_sys::NCCL_REVOKE_DEFAULT)
            };
            lib.check_pending("ncclCommRevoke", status)?;
            handle.record(FailureState::Revoked, failure);
            Ok(())
        }
    }
}

// ---------------------------------------------------------------------------------------
// Abort handle
// ---------------------------------------------------------------------------------------

/// Aborts a nonblocking communicator from any thread; see the [module docs](self).
///
/// Made by [`Comm::abort_handle`]. It keeps the communicator's shared state alive (not the
/// NCCL communicator: once the `Comm` is dropped or destroyed, `abort` does nothing).
#[derive(Clone)]
pub struct AbortHandle {
    core: Arc<CommCore>,
    lib: &'static Library,
    ctx: Arc<CudaContext>,
    rank: usize,
}

impl std::fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortHandle")
            .field("rank", &self.rank)
            .field("released", &self.is_released())
            .finish()
    }
}

impl AbortHandle {
    /// Aborts the communicator (`ncclCommAbort`), unless it is already aborted or
    /// destroyed. Safe to call from any thread, at any time, any number of times.
    ///
    /// If its owner has it in a [`Group`](crate::Group) that is still open, the abort is
    /// [deferred](AbortOutcome::Deferred) to the end of that group. An error means NCCL
    /// reported one while aborting; the communicator is released either way.
    pub fn abort(&self) -> Result<AbortOutcome> {
        let mut handle = self.core.lock();
        act(
            &mut handle,
            self.lib,
            &self.ctx,
            Action::Abort,
            Failure {
                state: FailureState::Released,
                by: Actor::Handle,
                cause: Cause::Requested,
            },
        )
    }

    /// Whether the communicator was aborted or destroyed (by anyone).
    pub fn is_released(&self) -> bool {
        self.core.lock().ptr.is_null()
    }

    /// The rank of the communicator this handle aborts.
    pub fn rank(&self) -> usize {
        self.rank
    }
}

// ---------------------------------------------------------------------------------------
// Watchdog
// ---------------------------------------------------------------------------------------

/// What a [`Watchdog`] does when it trips.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WatchdogAction {
    /// `ncclCommAbort`: stop everything and free the communicator (the default). Recover by
    /// creating a new communicator.
    #[default]
    Abort,
    /// `ncclCommRevoke` (NCCL 2.28.7): stop the operations in flight but keep the
    /// communicator, so the owner can [`shrink`](Comm::shrink) it.
    Revoke,
    /// Only mark the communicator failed: the owner's waits and enqueues return the failure
    /// and the owner decides (typically [`Comm::shrink`] with [`ShrinkMode::Abort`], or
    /// [`Comm::abort`]). Kernels stuck on the GPU keep spinning until then.
    Report,
}

impl WatchdogAction {
    fn action(self) -> Action {
        match self {
            WatchdogAction::Abort => Action::Abort,
            WatchdogAction::Revoke => Action::Revoke,
            WatchdogAction::Report => Action::Report,
        }
    }
}

/// Settings of a [`Watchdog`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchdogOptions {
    timeout: Duration,
    action: WatchdogAction,
    poll_interval: Duration,
    probe_stream: bool,
}

impl WatchdogOptions {
    /// Trip after `timeout` without progress; abort; poll every `timeout / 20` (between
    /// 1 ms and 100 ms); probe the stream.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            action: WatchdogAction::Abort,
            poll_interval: (timeout / 20)
                .clamp(Duration::from_millis(1), Duration::from_millis(100)),
            probe_stream: true,
        }
    }

    /// What to do when tripping.
    pub fn action(mut self, action: WatchdogAction) -> Self {
        self.action = action;
        self
    }

    /// How often the watchdog looks (bounds the detection delay beyond the timeout).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.max(Duration::from_micros(100));
        self
    }

    /// Whether to probe the stream with events (default `true`); without it the watchdog
    /// only reacts to asynchronous errors and to calls stuck in progress.
    pub fn probe_stream(mut self, probe: bool) -> Self {
        self.probe_stream = probe;
        self
    }

    /// The timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// Why and when a [`Watchdog`] tripped.
#[derive(Debug, Clone)]
pub struct WatchdogTrip {
    /// What the watchdog saw, as the error the owner's calls now get.
    pub reason: String,
    /// What it did.
    pub action: WatchdogAction,
    /// When it acted.
    pub at: Instant,
    /// Whether the action itself failed (an error from `ncclCommAbort`, for example).
    pub action_error: Option<String>,
}

struct WatchdogShared {
    stop: Mutex<bool>,
    wake: Condvar,
    trip: Mutex<Option<WatchdogTrip>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A thread that watches one nonblocking communicator and acts when it fails or stops
/// making progress; see the [module docs](self). Stops (and joins its thread) when dropped.
pub struct Watchdog {
    shared: Arc<WatchdogShared>,
    thread: Option<JoinHandle<()>>,
    options: WatchdogOptions,
    rank: usize,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("rank", &self.rank)
            .field("options", &self.options)
            .field("tripped", &self.trip().is_some())
            .finish()
    }
}

impl Watchdog {
    /// The trip, if the watchdog has tripped.
    pub fn trip(&self) -> Option<WatchdogTrip> {
        lock(&self.shared.trip).clone()
    }

    /// Whether its thread is still watching (it ends after tripping, or once the
    /// communicator is released).
    pub fn is_watching(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// The settings it runs with.
    pub fn options(&self) -> &WatchdogOptions {
        &self.options
    }

    /// Stops the watchdog and waits for its thread; same as dropping it.
    pub fn stop(self) {}

    fn spawn(comm: &Comm, options: WatchdogOptions) -> Result<Watchdog> {
        if options.timeout.is_zero() {
            return Err(Error::invalid("the watchdog timeout must be positive"));
        }
        if options.action == WatchdogAction::Revoke {
            comm.library().require("ncclCommRevoke", REVOKE_SINCE)?;
        }
        require_nonblocking(comm, "a watchdog")?;
        let shared = Arc::new(WatchdogShared {
            stop: Mutex::new(false),
            wake: Condvar::new(),
            trip: Mutex::new(None),
        });
        let worker = Worker {
            core: comm.core().clone(),
            lib: comm.library(),
            stream: comm.stream().clone(),
            rank: comm.rank(),
            options: options.clone(),
            shared: shared.clone(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{}", comm.rank()))
            .spawn(move || worker.run())
            .map_err(|e| Error::usage(format!("could not start the watchdog thread: {e}")))?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
            options,
            rank: comm.rank(),
        })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        *lock(&self.shared.stop) = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            // The thread never blocks for long (one poll holds the communicator's lock
            // briefly), and it catches no panics of its own: a join error only means it
            // panicked, which has nowhere to go here.
            let _ = thread.join();
        }
    }
}

/// The watchdog thread's state.
struct Worker {
    core: Arc<CommCore>,
    lib: &'static Library,
    stream: Arc<CudaStream>,
    rank: usize,
    options: WatchdogOptions,
    shared: Arc<WatchdogShared>,
}

impl Worker {
    /// Sleeps one poll interval; `true` when asked to stop.
    fn sleep(&self) -> bool {
        let stop = lock(&self.shared.stop);
        if *stop {
            return true;
        }
        let (stop, _) = self
            .shared
            .wake
            .wait_timeout(stop, self.options.poll_interval)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *stop
    }

    fn run(self) {
        let mut monitor = Monitor::new(self.options.timeout);
        let mut probe: Option<CudaEvent> = None;
        while !self.sleep() {
            let mut handle = self.core.lock();
            if handle.ptr.is_null() || handle.failure.is_some() {
                // Released, or failed and already reported: nothing left to watch.
                return;
            }
            if handle.open_groups > 0 {
                // The owner's thread has it in an open NCCL group, and `ncclGroupEnd` (made
                // without this lock) updates the state `ncclCommGetAsyncError` reads: stay
                // out of NCCL until the group has ended.
                continue;
            }
            let now = Instant::now();
            let verdict = match self.observe(&handle, &mut probe, &mut monitor, now) {
                Ok(verdict) => verdict,
                Err(cause) => Verdict::Trip(cause),
            };
            if let Verdict::Trip(cause) = verdict {
                self.trip(&mut handle, cause);
                return;
            }
        }
    }

    /// One poll, under the communicator's lock.
    fn observe(
        &self,
        handle: &Handle,
        probe: &mut Option<CudaEvent>,
        monitor: &mut Monitor,
        now: Instant,
    ) -> std::result::Result<Verdict, Cause> {
        let mut code = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: live handle (checked non-null by the caller) under the communicator's
        // lock; `code` is a valid out-pointer.
        let status = unsafe { self.lib.api().ncclCommGetAsyncError(handle.ptr, &mut code) };
        let seen = match status.map(ResultCode::from_raw) {
            Ok(ResultCode::Success) => Seen::from_code(ResultCode::from_raw(code)),
            Ok(failed) => Seen::Error(failed),
            Err(_) => Seen::Error(ResultCode::InternalError),
        };
        let probe_done = match probe {
            Some(event) if self.options.probe_stream => {
                Some(event.try_is_complete().map_err(Cause::Cuda)?)
            }
            _ => None,
        };
        let verdict = monitor.observe(now, seen, probe_done);
        if probe_done == Some(true) {
            *probe = None;
        }
        if verdict == Verdict::Probe && self.options.probe_stream {
            let capturing = self.stream.capture_status().map_err(Cause::Cuda)?;
            if capturing == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                // Recording is allowed: the communicator is ready (NCCL is not enqueueing
                // on its streams) and its lock keeps the owner's NCCL calls out meanwhile.
                *probe = Some(self.stream.record_event(None).map_err(Cause::Cuda)?);
                monitor.probe_recorded(now);
            }
        }
        Ok(verdict)
    }

    fn trip(&self, handle: &mut Handle, cause: Cause) {
        // NCCL's own texts for an asynchronous error.
        let cause = match cause {
            Cause::AsyncError { code, .. } => match self.lib.error("ncclCommGetAsyncError", code) {
                Error::Nccl {
                    description,
                    last_error,
                    ..
                } => Cause::AsyncError {
                    code,
                    description,
                    last_error,
                },
                _ => Cause::AsyncError {
                    code,
                    description: code.name().to_string(),
                    last_error: None,
                },
            },
            other => other,
        };
        let action = self.options.action.action();
        let failure = Failure {
            state: action.state(),
            by: Actor::Watchdog,
            cause,
        };
        let reason = failure
            .to_error("the owner's next call", self.rank)
            .to_string();
        let result = act(handle, self.lib, self.stream.context(), action, failure);
        let action_error = match result {
            Err(err) if action == Action::Revoke => {
                // Revoking failed: fall back to aborting, which always releases.
                let fallback = Failure {
                    state: FailureState::Released,
                    by: Actor::Watchdog,
                    cause: Cause::Requested,
                };
                let _ = act(
                    handle,
                    self.lib,
                    self.stream.context(),
                    Action::Abort,
                    fallback,
                );
                Some(format!("{err}; aborted instead"))
            }
            Err(err) => Some(err.to_string()),
            Ok(_) => None,
        };
        *lock(&self.shared.trip) = Some(WatchdogTrip {
            reason,
            action: self.options.action,
            at: Instant::now(),
            action_error,
        });
    }
}

/// The communicator's state as one poll saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    Ready,
    InProgress,
    Error(ResultCode),
}

impl Seen {
    fn from_code(code: ResultCode) -> Self {
        match code {
            ResultCode::Success => Seen::Ready,
            ResultCode::InProgress => Seen::InProgress,
            other => Seen::Error(other),
        }
    }
}

/// What the watchdog should do after a poll.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// Nothing.
    Fine,
    /// Record a progress probe on the stream now.
    Probe,
    /// Act.
    Trip(Cause),
}

impl PartialEq for Cause {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Cause::Requested, Cause::Requested) => true,
            (Cause::Stalled { what: a, waited: x }, Cause::Stalled { what: b, waited: y }) => {
                a == b && x == y
            }
            (Cause::AsyncError { code: a, .. }, Cause::AsyncError { code: b, .. }) => a == b,
            (Cause::Cuda(a), Cause::Cuda(b)) => a == b,
            _ => false,
        }
    }
}

/// The watchdog's decisions, free of CUDA and NCCL so they can be tested on their own.
#[derive(Debug)]
pub(crate) struct Monitor {
    timeout: Duration,
    in_progress_since: Option<Instant>,
    probe_since: Option<Instant>,
}

impl Monitor {
    pub(crate) fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            in_progress_since: None,
            probe_since: None,
        }
    }

    /// `probe_done`: the state of the outstanding probe (`None`: there is none).
    pub(crate) fn observe(
        &mut self,
        now: Instant,
        seen: Seen,
        probe_done: Option<bool>,
    ) -> Verdict {
        match seen {
            Seen::Error(code) => Verdict::Trip(Cause::AsyncError {
                code,
                description: String::new(),
                last_error: None,
            }),
            Seen::InProgress => {
                let since = *self.in_progress_since.get_or_insert(now);
                let waited = now.saturating_duration_since(since);
                if waited >= self.timeout {
                    Verdict::Trip(Cause::Stalled {
                        what: "a nonblocking NCCL call to complete",
                        waited,
                    })
                } else {
                    Verdict::Fine
                }
            }
            Seen::Ready => {
                self.in_progress_since = None;
                match (probe_done, self.probe_since) {
                    (Some(false), Some(since)) => {
                        let waited = now.saturating_duration_since(since);
                        if waited >= self.timeout {
                            Verdict::Trip(Cause::Stalled {
                                what: "work enqueued on the communicator's stream to finish",
                                waited,
                            })
                        } else {
                            Verdict::Fine
                        }
                    }
                    (Some(false), None) => Verdict::Fine,
                    (Some(true), _) | (None, _) => {
                        self.probe_since = None;
                        Verdict::Probe
                    }
                }
            }
        }
    }

    pub(crate) fn probe_recorded(&mut self, now: Instant) {
        self.probe_since = Some(now);
    }
}

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

// ---------------------------------------------------------------------------------------
// Shrink, revoke, grow
// ---------------------------------------------------------------------------------------

/// A survivor's place in the communicator that [`Comm::recover`] builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Survivor {
    /// Its rank among the survivors.
    pub rank: usize,
    /// The number of survivors.
    pub size: usize,
}

/// The survivors' communicator from [`Comm::recover`].
#[derive(Debug)]
pub struct Recovered {
    /// The new communicator, without the failed ranks.
    pub comm: Comm,
    /// `None` when NCCL shrank the old communicator; otherwise the error that made the
    /// shrink impossible, and the communicator was rebuilt from a fresh unique id.
    pub shrink_error: Option<Error>,
}

/// How [`Comm::shrink`] treats the parent's outstanding operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ShrinkMode {
    /// `NCCL_SHRINK_DEFAULT`: the parent must be healthy and idle (planned scale-down).
    #[default]
    Default,
    /// `NCCL_SHRINK_ABORT`: first abort the parent's outstanding operations (recovery after a
    /// failure). The child shares no resources with the parent.
    Abort,
}

impl ShrinkMode {
    fn raw(self) -> c_int {
        match self {
            ShrinkMode::Default => nccl_sys::NCCL_SHRINK_DEFAULT,
            ShrinkMode::Abort => nccl_sys::NCCL_SHRINK_ABORT,
        }
    }
}

/// Checks a shrink's exclusion list and converts it for NCCL (sorted, as NCCL wants it).
/// This rank's place among the survivors when the ranks in `failed` are gone: ranks keep
/// their order, as `ncclCommShrink` numbers them.
fn survivor_of(rank: usize, size: usize, failed: &[usize]) -> Result<Survivor> {
    exclude_list(failed, rank, size)?;
    Ok(Survivor {
        rank: rank - failed.iter().filter(|&&r| r < rank).count(),
        size: size - failed.len(),
    })
}

pub(crate) fn exclude_list(exclude: &[usize], rank: usize, size: usize) -> Result<Vec<c_int>> {
    if exclude.is_empty() {
        return Err(Error::invalid(
            "shrink needs at least one rank to exclude (NCCL refuses an empty list)",
        ));
    }
    let mut list = Vec::with_capacity(exclude.len());
    for &excluded in exclude {
        if excluded >= size {
            return Err(Error::invalid(format!(
                "cannot exclude rank {excluded} from a communicator of {size} ranks"
            )));
        }
        if excluded == rank {
            return Err(Error::invalid(format!(
                "rank {rank} excludes itself: excluded ranks must not call shrink"
            )));
        }
        // `excluded < size`, and sizes fit a C int (NCCL reported them as one).
        list.push(
            c_int::try_from(excluded)
                .map_err(|_| Error::invalid(format!("rank {excluded} does not fit a C int")))?,
        );
    }
    list.sort_unstable();
    if let Some(pair) = list.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(Error::invalid(format!(
            "rank {} is excluded twice",
            pair[0]
        )));
    }
    Ok(list)
}

/// Checks the new size of a grow.
pub(crate) fn grow_size(old: usize, new: usize) -> Result<c_int> {
    if new <= old {
        return Err(Error::invalid(format!(
            "grow must add ranks: the communicator has {old}, the new size is {new}"
        )));
    }
    c_int::try_from(new)
        .map_err(|_| Error::invalid(format!("communicator size {new} does not fit a C int")))
}

/// [`Library::require`] on a version alone, so the gates can be tested without a library.
#[cfg(test)]
pub(crate) fn gate(api: &'static str, needs: Version, found: Version) -> Result<()> {
    if found >= needs {
        Ok(())
    } else {
        Err(Error::Unsupported { api, needs, found })
    }
}

impl Comm {
    /// A handle that aborts this communicator from any thread; see the [module docs](self).
    ///
    /// Only for nonblocking communicators: NCCL does not allow aborting a blocking one from
    /// another thread ([`Error::InvalidUsage`]).
    pub fn abort_handle(&self) -> Result<AbortHandle> {
        require_nonblocking(self, "an abort handle")?;
        Ok(AbortHandle {
            core: self.core().clone(),
            lib: self.library(),
            ctx: self.context().clone(),
            rank: self.rank(),
        })
    }

    /// Starts a [`Watchdog`] that aborts this (nonblocking) communicator when it reports an
    /// asynchronous error or makes no progress for `timeout`.
    pub fn watchdog(&self, timeout: Duration) -> Result<Watchdog> {
        Watchdog::spawn(self, WatchdogOptions::new(timeout))
    }

    /// Starts a [`Watchdog`] with explicit settings.
    pub fn watchdog_with(&self, options: WatchdogOptions) -> Result<Watchdog> {
        Watchdog::spawn(self, options)
    }

    /// The failure recorded on this communicator (by [`Comm::revoke`], an [`AbortHandle`] or
    /// a [`Watchdog`]), as the error its calls now get; `None` while it is usable.
    pub fn failure(&self) -> Option<Error> {
        self.core()
            .lock()
            .check_failure("Comm::failure", self.rank())
            .err()
    }

    /// Revokes the communicator (`ncclCommRevoke`, NCCL 2.28.7): stops the operations in
    /// flight, waits (up to [`Comm::ready_timeout`]) until it is quiescent, and leaves it
    /// valid for [`Comm::shrink`], [`Comm::split`], abort and destroy. New operations and
    /// [`Comm::finalize`] are refused afterwards. Revoking again is a no-op.
    ///
    /// This is a local call: each rank revokes its own communicator.
    pub fn revoke(&self) -> Result<()> {
        self.library().require("ncclCommRevoke", REVOKE_SINCE)?;
        group::ensure_outside("Comm::revoke")?;
        {
            let mut handle = self.core().lock();
            handle.usable_for("ncclCommRevoke", self.rank())?;
            let revoked = handle
                .failure
                .as_ref()
                .is_some_and(|f| f.state >= FailureState::Revoked);
            if !revoked {
                let _ = self.context().bind_to_thread();
                run_action(
                    &mut handle,
                    self.library(),
                    self.context(),
                    Action::Revoke,
                    Failure::owner(FailureState::Revoked),
                )?;
            }
        }
        self.settle("ncclCommRevoke", self.ready_timeout())
            .map(drop)
    }

    /// Builds a communicator of the surviving ranks (`ncclCommShrink`, NCCL 2.27): every
    /// rank of this communicator except those in `exclude` must call it, with the same
    /// list; ranks are renumbered in order, filling the gaps. The child uses this
    /// communicator's stream and, without `config`, inherits its configuration.
    ///
    /// With [`ShrinkMode::Abort`] NCCL first aborts the operations outstanding on this
    /// communicator (work stuck waiting for a dead rank). Afterwards this communicator must
    /// still be aborted or destroyed. Shrinking is allowed after a failure was recorded
    /// (watchdog [`Report`](WatchdogAction::Report) or [`Comm::revoke`]), not after an abort.
    pub fn shrink(
        &self,
        exclude: &[usize],
        mode: ShrinkMode,
        config: Option<&CommConfig>,
    ) -> Result<Comm> {
        let lib = self.library();
        lib.require("ncclCommShrink", SHRINK_SINCE)?;
        group::ensure_outside("Comm::shrink")?;
        let mut list = exclude_list(exclude, self.rank(), self.size())?;
        let count =
            c_int::try_from(list.len()).map_err(|_| Error::invalid("too many ranks to exclude"))?;
        let child_config = self.child_config(config);
        let mut raw_config = RawConfig::inherit_or(config, lib)?;
        let cfg_ptr = raw_config.as_mut_ptr();
        // The exclude list is boxed with the call: NCCL may read it from its background job.
        let list_ptr = list.as_mut_ptr();
        let child = self.create_child(
            "ncclCommShrink",
            self.stream().clone(),
            &child_config,
            true,
            |raw, child| {
                // SAFETY: live parent handle under its lock; `list` holds `count` ranks and
                // outlives the parent's settling in `create_child`; `child` stays valid until
                // NCCL's job wrote it; `cfg_ptr` is null or an initialised config alive until
                // the call returns.
                unsafe {
                    lib.api()
                        .ncclCommShrink(raw, list_ptr, count, child, cfg_ptr, mode.raw())
                }
            },
        );
        free_unless_still_read(child, list, "ncclCommShrink")
    }

    /// Builds the communicator of the survivors after the ranks in `failed` died, and
    /// aborts this one. Called by every survivor, with the same `failed` list.
    ///
    /// First it tries [`Comm::shrink`] with [`ShrinkMode::Abort`], NCCL's fast path that
    /// reuses this communicator's connections. NCCL cannot always take it: it refuses to
    /// shrink a communicator whose asynchronous error is set (in every version up to 2.32,
    /// `ncclCommShrink` checks the parent with the same test as any other call, after clearing
    /// the abort flag that would skip it), which is what a dead peer leaves behind when ranks
    /// talk over the network (`ncclRemoteError` from the socket or IB transport); NVLink peers
    /// usually just stall, and then shrinking works. A library older than 2.27 has no shrink
    /// at all. In those cases the survivors start over: this communicator is aborted, survivor
    /// 0 creates a fresh [`UniqueId`], `share_id` hands it to every survivor (exactly as for a
    /// first start: rank 0 passes `Some(id)` and gets it back, the others pass `None` and get
    /// rank 0's; see [`crate::bootstrap`]), and all of them initialise a new communicator.
    ///
    /// Either way this communicator is aborted afterwards (its calls then fail, and dropping
    /// it does nothing), and the survivors keep their order: survivor ranks are numbered from 0 in the
    /// order of their old ranks, as `ncclCommShrink` numbers them. The new communicator uses
    /// `config`, or this one's blocking mode and ready timeout. [`Recovered::shrink_error`]
    /// says which way was taken.
    ///
    /// If only some survivors can shrink, the others wait in the shrink until the new
    /// communicator's ready timeout expires and then rebuild too; `share_id` must therefore
    /// wait at least that long for survivor 0. With a blocking communicator that wait has no
    /// bound, so recovery needs nonblocking communicators (as detecting the failure does).
    ///
    /// `failed` is checked first (non-empty, in range, without this rank, no duplicates): a
    /// bad list returns [`Error::InvalidArgument`] and leaves this communicator as it was.
    ///
    /// ```no_run
    /// # use nccl::{bootstrap::FileRendezvous, Comm, CommConfig};
    /// # fn f(comm: Comm, dead: usize) -> nccl::Result<()> {
    /// let config = CommConfig::new().blocking(false);
    /// let recovered = comm.recover(&[dead], Some(&config), |survivor, id| {
    ///     let rendezvous = FileRendezvous::new("/tmp/job-42", survivor.rank, survivor.size)
    ///         .with_job_key("after-failure-1");
    ///     Ok(rendezvous.exchange(id)?)
    /// })?;
    /// if let Some(why) = &recovered.shrink_error {
    ///     eprintln!("rebuilt the communicator: NCCL could not shrink it ({why})");
    /// }
    /// let comm = recovered.comm;
    /// # Ok(()) }
    /// ```
    pub fn recover(
        &self,
        failed: &[usize],
        config: Option<&CommConfig>,
        share_id: impl FnOnce(Survivor, Option<UniqueId>) -> Result<UniqueId>,
    ) -> Result<Recovered> {
        group::ensure_outside("Comm::recover")?;
        let survivor = survivor_of(self.rank(), self.size(), failed)?;
        let stream = self.stream().clone();
        let child_config = self.child_config(config);
        let shrink_error = match self.shrink(failed, ShrinkMode::Abort, config) {
            Ok(comm) => {
                // The parent's resources are still held; NCCL leaves freeing them to us.
                let _ = self.abort_in_place();
                return Ok(Recovered {
                    comm,
                    shrink_error: None,
                });
            }
            Err(err) => err,
        };
        // Its kernels may still spin on the stream the new communicator will use: abort them
        // first. The parent is dead either way; what its abort reports changes nothing.
        let _ = self.abort_in_place();
        let fresh = if survivor.rank == 0 {
            Some(UniqueId::new()?)
        } else {
            None
        };
        let id = share_id(survivor, fresh)?;
        let comm =
            Comm::init_rank_with_config(stream, &id, survivor.rank, survivor.size, &child_config)?;
        Ok(Recovered {
            comm,
            shrink_error: Some(shrink_error),
        })
    }

    /// `ncclCommAbort` by the owner without giving up the `Comm`: later calls on it fail,
    /// and dropping it does nothing.
    fn abort_in_place(&self) -> Result<AbortOutcome> {
        let mut handle = self.core().lock();
        act(
            &mut handle,
            self.library(),
            self.context(),
            Action::Abort,
            Failure {
                state: FailureState::Released,
                by: Actor::Owner,
                cause: Cause::Requested,
            },
        )
    }

    /// A unique id for growing this communicator (`ncclCommGetUniqueId`, NCCL 2.29). Called
    /// on one existing rank (the coordinator), which passes it to [`Comm::grow`] and sends
    /// it to the new ranks for [`Comm::join_grow`]. Each id can be used for one grow only.
    pub fn get_unique_id_for_grow(&self) -> Result<UniqueId> {
        let lib = self.library();
        lib.require("ncclCommGetUniqueId", GROW_SINCE)?;
        group::ensure_outside("Comm::get_unique_id_for_grow")?;
        let mut raw = nccl_sys::ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        let status = self.with_raw("ncclCommGetUniqueId", |comm| {
            // SAFETY: live handle under its lock; `raw` is a valid, writable id.
            unsafe { lib.api().ncclCommGetUniqueId(comm, &mut raw) }
        })?;
        self.complete("ncclCommGetUniqueId", status)?;
        Ok(UniqueId::from_raw(&raw))
    }

    /// Grows the communicator to `new_size` ranks (`ncclCommGrow`, NCCL 2.29); called by
    /// every existing rank, with no operation outstanding. The coordinator passes the id from
    /// [`Comm::get_unique_id_for_grow`], the other existing ranks `None`; the new ranks call
    /// [`Comm::join_grow`]. Existing ranks keep their numbers. Destroy or abort this
    /// communicator afterwards.
    pub fn grow(
        &self,
        new_size: usize,
        id: Option<&UniqueId>,
        config: Option<&CommConfig>,
    ) -> Result<Comm> {
        let lib = self.library();
        lib.require("ncclCommGrow", GROW_SINCE)?;
        group::ensure_outside("Comm::grow")?;
        let nranks = grow_size(self.size(), new_size)?;
        let child_config = self.child_config(config);
        let mut raw_config = RawConfig::inherit_or(config, lib)?;
        let cfg_ptr = raw_config.as_mut_ptr();
        // Boxed like the child slot: NCCL's job may read it after the call returned.
        let raw_id = id.map(|id| Box::new(id.to_raw()));
        let id_ptr = raw_id
            .as_deref()
            .map_or(ptr::null(), |id| id as *const nccl_sys::ncclUniqueId);
        let child = self.create_child(
            "ncclCommGrow",
            self.stream().clone(),
            &child_config,
            true,
            |raw, child| {
                // SAFETY: live parent handle under its lock; `id_ptr` is null or points to an
                // id alive until the call returns; `child` stays valid until NCCL's job wrote
                // it; `cfg_ptr` null or an initialised config alive until the call returns.
                // Existing ranks pass rank -1, as NCCL requires.
                unsafe {
                    lib.api()
                        .ncclCommGrow(raw, nranks, id_ptr, -1, child, cfg_ptr)
                }
            },
        );
        free_unless_still_read(child, raw_id, "ncclCommGrow")
    }

    /// Joins a growing communicator as new rank `rank` of `new_size` (`ncclCommGrow` without
    /// a parent, NCCL 2.29), on the device of `stream`, with the id the coordinator sent.
    pub fn join_grow(
        stream: Arc<CudaStream>,
        id: &UniqueId,
        rank: usize,
        new_size: usize,
        config: Option<&CommConfig>,
    ) -> Result<Comm> {
        let lib = library::get()?;
        lib.require("ncclCommGrow", GROW_SINCE)?;
        group::ensure_outside("Comm::join_grow")?;
        let (rank, nranks) = rank_and_size(rank, new_size)?;
        let config = config.cloned().unwrap_or_default();
        let mut raw_config = config.to_raw(lib)?;
        let cfg_ptr = raw_config.as_mut_ptr();
        let raw_id = id.to_raw();
        stream.context().bind_to_thread()?;
        let mut child: ncclComm_t = ptr::null_mut();
        // SAFETY: no parent (new ranks pass null); `raw_id` and the config outlive the call;
        // `child` is a valid out-pointer.
        let status = unsafe {
            lib.api()
                .ncclCommGrow(ptr::null_mut(), nranks, &raw_id, rank, &mut child, cfg_ptr)
        };
        Comm::adopt(lib, child, stream, &config, "ncclCommGrow", status)
    }

    /// Marks this communicator as part of a group open on this thread.
    pub(crate) fn group_enter(&self) {
        let mut handle = self.core().lock();
        handle.open_groups = handle.open_groups.saturating_add(1);
    }

    /// Ends a group membership; runs an abort or revoke deferred meanwhile. Returns the
    /// communicator's failure, if it has one now, as the error of `call`.
    pub(crate) fn group_leave(&self, call: &'static str) -> Option<Error> {
        let mut handle = self.core().lock();
        handle.open_groups = handle.open_groups.saturating_sub(1);
        if handle.open_groups == 0 {
            if let Some(action) = handle.deferred.take() {
                // The failure was recorded when the action was requested; keep it.
                let failure = handle
                    .failure
                    .as_deref()
                    .cloned()
                    .unwrap_or_else(|| Failure::owner(action.state()));
                // Errors have nowhere to go: the communicator is marked failed either way.
                let _ = run_action(&mut handle, self.library(), self.context(), action, failure);
            }
        }
        handle.check_failure(call, self.rank()).err()
    }
}

/// Ends a call that creates a child communicator from an argument NCCL's background job reads
/// (the rank list of a shrink, the id of a grow). Once the parent settled the argument is
/// freed; if it never did, the job may still read it, so it is leaked on purpose.
fn free_unless_still_read<A>(
    child: Result<Option<Comm>>,
    argument: A,
    call: &'static str,
) -> Result<Comm> {
    match child {
        Ok(child) => {
            drop(argument);
            child.ok_or_else(|| Error::usage(format!("{call} returned no communicator")))
        }
        Err(err) => {
            std::mem::forget(argument);
            Err(err)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survivors_keep_their_order() {
        let place = |rank, failed: &[usize]| survivor_of(rank, 6, failed).unwrap();
        assert_eq!(place(0, &[2]), Survivor { rank: 0, size: 5 });
        assert_eq!(place(3, &[2]), Survivor { rank: 2, size: 5 });
        assert_eq!(place(5, &[4, 0]), Survivor { rank: 3, size: 4 });
        assert_eq!(place(1, &[5, 0, 3]), Survivor { rank: 0, size: 3 });
        // Bad lists are refused before anything happens.
        for failed in [&[][..], &[6], &[1], &[2, 2]] {
            let err = survivor_of(1, 6, failed).unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument(_)),
                "{failed:?}: {err}"
            );
        }
    }

    #[test]
    fn abort_handle_and_watchdog_cross_threads() {
        fn send_sync_clone<T: Send + Sync + Clone>() {}
        fn send<T: Send>() {}
        send_sync_clone::<AbortHandle>();
        send::<Watchdog>();
    }

    #[test]
    fn exclusion_lists_are_checked_and_sorted() {
        assert_eq!(exclude_list(&[3, 1], 0, 4).unwrap(), vec![1, 3]);
        assert_eq!(exclude_list(&[2], 0, 4).unwrap(), vec![2]);
        let err = |e: &[usize], rank, size| exclude_list(e, rank, size).unwrap_err().to_string();
        assert!(err(&[], 0, 4).contains("at least one rank"));
        assert!(err(&[4], 0, 4).contains("cannot exclude rank 4"));
        assert!(err(&[1, 0], 0, 4).contains("excludes itself"));
        assert!(err(&[2, 1, 2], 0, 4).contains("rank 2 is excluded twice"));
    }

    #[test]
    fn grow_sizes_are_checked() {
        assert_eq!(grow_size(2, 3).unwrap(), 3);
        assert!(grow_size(4, 4)
            .unwrap_err()
            .to_string()
            .contains("must add"));
        assert!(grow_size(4, 2).is_err());
        assert!(grow_size(1, usize::MAX).is_err());
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
        match gate("ncclCommGrow", GROW_SINCE, Version::new(2, 28, 9)) {
            Err(Error::Unsupported { api, needs, found }) => {
                assert_eq!(api, "ncclCommGrow");
                assert_eq!(needs, Version::new(2, 29, 0));
                assert_eq!(found, Version::new(2, 28, 9));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn shrink_modes_map_to_nccl_flags() {
        assert_eq!(ShrinkMode::Default.raw(), 0);
        assert_eq!(ShrinkMode::Abort.raw(), 1);
        assert_eq!(ShrinkMode::default(), ShrinkMode::Default);
    }

    fn null_handle() -> Handle {
        Handle::new(ptr::null_mut())
    }

    fn live_handle() -> Handle {
        // Never passed to NCCL: the tests below only exercise the bookkeeping.
        Handle::new(std::ptr::NonNull::<nccl_sys::ncclComm>::dangling().as_ptr())
    }

    #[test]
    fn calls_after_a_failure_are_refused_except_management() {
        let mut handle = live_handle();
        assert!(handle.usable_for("ncclAllReduce", 1).is_ok());
        handle.record(
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
        let err = handle.usable_for("ncclAllReduce", 1).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("marked failed by its watchdog"), "{text}");
        assert!(text.contains("ncclAllReduce cannot go on"), "{text}");
        assert!(text.contains("rank 1"), "{text}");
        assert!(text.contains("ShrinkMode::Abort"), "{text}");
        for call in ["ncclCommShrink", "ncclCommAbort", "ncclCommGetAsyncError"] {
            assert!(handle.usable_for(call, 1).is_ok(), "{call}");
        }
        assert!(handle.check_failure("Comm::synchronize", 1).is_err());
        // A later revoke keeps the cause and author, and gets worse only.
        handle.record(FailureState::Revoked, Failure::owner(FailureState::Revoked));
        let failure = handle.failure.clone().unwrap();
        assert_eq!(failure.state, FailureState::Revoked);
        assert_eq!(failure.by, Actor::Watchdog);
        handle.record(FailureState::Failed, Failure::owner(FailureState::Failed));
        assert_eq!(
            handle.failure.as_ref().unwrap().state,
            FailureState::Revoked
        );
        // Taking the handle out marks it released.
        let raw = handle.take(Failure::owner(FailureState::Released));
        assert!(!raw.is_null());
        assert!(handle.ptr.is_null());
        let text = handle
            .usable_for("ncclCommShrink", 1)
            .unwrap_err()
            .to_string();
        assert!(text.contains("aborted by its watchdog"), "{text}");
    }

    #[test]
    fn errors_name_who_acted_and_why() {
        let released_by_owner = {
            let mut h = live_handle();
            h.take(Failure::owner(FailureState::Released));
            h
        };
        let text = released_by_owner
            .usable_for("ncclAllReduce", 0)
            .unwrap_err()
            .to_string();
        assert!(text.contains("already aborted or destroyed"), "{text}");
        assert!(null_handle().usable_for("ncclAllReduce", 0).is_err());

        let by_handle = Failure {
            state: FailureState::Released,
            by: Actor::Handle,
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
    fn actions_are_planned_deferred_and_idempotent() {
        let by = |actor| Failure {
            state: FailureState::Released,
            by: actor,
            cause: Cause::Requested,
        };
        // Outside a group: run now.
        let mut h = live_handle();
        assert_eq!(plan(&mut h, Action::Abort, &by(Actor::Handle)), Step::Run);

        // Inside a group: recorded at once, NCCL deferred; the handle stays until then.
        let mut h = live_handle();
        h.open_groups = 1;
        assert_eq!(
            plan(&mut h, Action::Abort, &by(Actor::Handle)),
            Step::Deferred
        );
        assert_eq!(h.deferred, Some(Action::Abort));
        assert!(!h.ptr.is_null());
        let text = h.usable_for("ncclAllReduce", 0).unwrap_err().to_string();
        assert!(text.contains("aborted through an AbortHandle"), "{text}");
        // A second abort, or a revoke, while one is pending does nothing.
        assert_eq!(
            plan(&mut h, Action::Abort, &by(Actor::Handle)),
            Step::Nothing
        );
        assert_eq!(
            plan(&mut h, Action::Revoke, &by(Actor::Watchdog)),
            Step::Nothing
        );

        // A deferred revoke is upgraded by a later abort.
        let mut h = live_handle();
        h.open_groups = 2;
        assert_eq!(
            plan(&mut h, Action::Revoke, &by(Actor::Watchdog)),
            Step::Deferred
        );
        assert_eq!(
            plan(&mut h, Action::Abort, &by(Actor::Handle)),
            Step::Deferred
        );
        assert_eq!(h.deferred, Some(Action::Abort));
        assert_eq!(h.failure.as_ref().unwrap().by, Actor::Watchdog);
        assert_eq!(h.failure.as_ref().unwrap().state, FailureState::Released);

        // Released: nothing, whatever is asked.
        let mut h = null_handle();
        for action in [Action::Abort, Action::Revoke, Action::Report] {
            assert_eq!(plan(&mut h, action, &by(Actor::Handle)), Step::Nothing);
        }

        // A report only records, once; a revoke after it still runs.
        let mut h = live_handle();
        assert_eq!(
            plan(&mut h, Action::Report, &by(Actor::Watchdog)),
            Step::Recorded
        );
        assert_eq!(h.failure.as_ref().unwrap().state, FailureState::Failed);
        assert_eq!(
            plan(&mut h, Action::Report, &by(Actor::Watchdog)),
            Step::Nothing
        );
        assert_eq!(plan(&mut h, Action::Revoke, &by(Actor::Owner)), Step::Run);
    }

    #[test]
    fn monitor_trips_on_errors_stalls_and_stuck_calls() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(5);
        let at = |s: u64| t0 + Duration::from_millis(s);

        // An asynchronous error trips at once.
        let mut m = Monitor::new(timeout);
        assert!(matches!(
            m.observe(at(0), Seen::Error(ResultCode::RemoteError), None),
            Verdict::Trip(Cause::AsyncError {
                code: ResultCode::RemoteError,
                ..
            })
        ));

        // A ready communicator asks for a probe; a completed probe asks for the next one.
        let mut m = Monitor::new(timeout);
        assert_eq!(m.observe(at(0), Seen::Ready, None), Verdict::Probe);
        m.probe_recorded(at(0));
        assert_eq!(m.observe(at(100), Seen::Ready, Some(false)), Verdict::Fine);
        assert_eq!(m.observe(at(200), Seen::Ready, Some(true)), Verdict::Probe);
        m.probe_recorded(at(200));
        // A probe pending for the timeout trips.
        assert_eq!(m.observe(at(5100), Seen::Ready, Some(false)), Verdict::Fine);
        match m.observe(at(5200), Seen::Ready, Some(false)) {
            Verdict::Trip(Cause::Stalled { what, waited }) => {
                assert!(what.contains("stream"));
                assert_eq!(waited, Duration::from_secs(5));
            }
            other => panic!("{other:?}"),
        }

        // A call in progress for the timeout trips; readiness in between resets the clock.
        let mut m = Monitor::new(timeout);
        assert_eq!(m.observe(at(0), Seen::InProgress, None), Verdict::Fine);
        assert_eq!(m.observe(at(4000), Seen::InProgress, None), Verdict::Fine);
        assert_eq!(m.observe(at(4500), Seen::Ready, None), Verdict::Probe);
        assert_eq!(m.observe(at(6000), Seen::InProgress, None), Verdict::Fine);
        assert_eq!(m.observe(at(10_999), Seen::InProgress, None), Verdict::Fine);
        assert!(matches!(
            m.observe(at(11_000), Seen::InProgress, None),
            Verdict::Trip(Cause::Stalled { .. })
        ));
    }

    #[test]
    fn watchdog_options_defaults() {
        let o = WatchdogOptions::new(Duration::from_secs(10));
        assert_eq!(o.timeout(), Duration::from_secs(10));
        assert_eq!(o.action, WatchdogAction::Abort);
        assert_eq!(o.poll_interval, Duration::from_millis(100));
        assert!(o.probe_stream);
        let o = WatchdogOptions::new(Duration::from_millis(10))
            .action(WatchdogAction::Report)
            .poll_interval(Duration::ZERO)
            .probe_stream(false);
        assert_eq!(o.poll_interval, Duration::from_micros(100));
        assert_eq!(o.action, WatchdogAction::Report);
        assert!(!o.probe_stream);
        assert_eq!(
            WatchdogOptions::new(Duration::from_millis(10)).poll_interval,
            Duration::from_millis(1)
        );
    }
}
