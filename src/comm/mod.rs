//! Communicators: creation, queries, and their end of life.
//!
//! A [`Comm`] is one rank of an NCCL communicator, bound to one GPU and to a default CUDA
//! stream on which its operations run. It is `Send` (it may move to another thread) but not
//! `Sync`: NCCL forbids issuing operations on one communicator from several threads at once,
//! and ranks must issue operations in the same order, which concurrent callers could not
//! guarantee.
//!
//! The rooms: `state.rs` owns the raw handle and its state (one owner, as rusqlite's
//! `InnerConnection`); `init.rs` creates communicators, `child.rs` splits them, `wait.rs`
//! waits on them, `streams.rs` tracks the other streams their operations ran on,
//! `suspend.rs` releases and restores their memory, `status.rs` describes them (`Debug`,
//! `Display`), `flight_record.rs` copies their flight recorder's ring, `close.rs` ends them
//! and `in_flight.rs` runs destroys and aborts on threads of their own and lists those still
//! running. Failure handling (abort
//! handles, the watchdog, revoke/shrink/grow) lives in [`crate::fault`].
//!
//! # End of life
//!
//! Dropping a `Comm` first waits, for at most [`Comm::drop_timeout`] (10 s by default), for the
//! work already enqueued on the communicator's stream and on every other stream its
//! operations were enqueued on ([`Comm::enqueue_on`], [`Group::enqueue_on`](crate::Group::enqueue_on),
//! [`Comm::enqueue_v_on`], one-sided RMA's `*_on`; each such stream gets an event recorded
//! after the operation), so results of the last operations are not cut short and no kernel
//! of it is left running: NCCL's destroy waits for every kernel of the communicator, on any
//! stream, and once it has the handle nothing could abort one. Then, within what is left of
//! that time, it ends the communicator the
//! orderly way, `ncclCommDestroy`, which lets NCCL's network proxy finish sending what peers
//! still need for operations this rank already saw complete: `ncclCommAbort` would cut those
//! sends off and fail the peer's operation ("Connection closed by remote peer"). Destroy
//! cannot be interrupted and waits for ranks of this node that are connected to this rank's
//! proxy to end the communicator too, so it runs on a thread of its own; past the time left,
//! the drop returns and that thread finishes the destroy whenever NCCL does. Such releases
//! are listed by [`Comm::releases_in_flight`] and can be waited for with
//! [`Comm::wait_for_releases`]; a destroy cannot be aborted (NCCL forbids aborting a
//! communicator being destroyed), but it holds no GPU work, only a thread and NCCL's host
//! resources. A communicator
//! that failed (see [`crate::fault`]), or whose work on any of its streams did not finish in
//! time, is aborted at once (`ncclCommAbort`, which stops its kernels on every stream and
//! never waits for peers); one already aborted from another
//! thread is left alone. So a drop never panics and never blocks for longer than its
//! timeout (and, where CUDA graphs that captured the communicator are alive, the abort's
//! second; see below), also when a peer has died. For an orderly shutdown in which all ranks take part
//! and errors are reported, call [`Comm::finalize`] and then [`Comm::destroy`]; each first
//! waits for the same work within the same bound and fails with [`Error::Timeout`] (the
//! communicator as it was) where it does not finish, instead of blocking in NCCL forever.
//! Work captured into a CUDA graph is not seen: it runs wherever the graph is launched.
//! Communicators created together ([`Comm::init_all`], [`Comm::split_all`]) share the wait:
//! once the drop of one of them timed out, the others abort at once, so dropping all of them
//! takes one drop timeout.
//! [`Comm::destroy`] that fails gives the communicator back with the error (as rusqlite's
//! `Connection::close` does), so it is never left neither destroyed nor aborted.
//!
//! CUDA graphs that captured a communicator's operations hold NCCL's release of it: both
//! `ncclCommDestroy` and `ncclCommAbort` wait until every such graph (and its instances) is
//! destroyed (`commDestroySync` in `src/init.cc`, 2.28 to 2.32), and with several ranks in
//! one process the last rank to end the communicator waits for every rank's graphs. The
//! thread that would destroy the graph is often the one ending the communicator, so every
//! abort (by its owner, a drop, an [`AbortHandle`](crate::AbortHandle) or a
//! [`Watchdog`](crate::Watchdog)) runs on a thread of its own: it sets the flags the
//! communicator's kernels watch at once (replays of those graphs stop too) and is waited for
//! 1 s, past which it goes on there, listed by [`Comm::releases_in_flight`], until the
//! graphs are gone. [`Comm::finalize`] and [`Comm::destroy`] wait for them in NCCL, holding
//! the communicator (no abort can interrupt them): destroy such graphs first, or drop the
//! communicator, which bounds the wait.
//!
//! With several ranks of one communicator in one process (threads, or [`Comm::init_all`]),
//! NCCL frees them together: `ncclCommDestroy` and `ncclCommAbort` (`commReclaim` in
//! `src/init.cc`, 2.28 to 2.30.7) return at once on every rank but the last to call, which
//! then frees all of them, windows included, with frees that synchronise each rank's GPU
//! (once the CUDA graphs that captured any of them are destroyed, see above).
//! So until every rank in the process has ended (destroyed, aborted or dropped) a
//! communicator, no rank may enqueue work that waits for a peer, such as a collective on
//! another communicator: the last rank's cleanup would wait for that work, and the work for
//! the last rank. A barrier between the ranks after ending it is enough.

/// One NCCL call on a communicator's handle, in one line: the handle is lent to the call
/// under the communicator's lock (failing first, with the reason, if the communicator was
/// aborted or failed), the C function's name labels any error, and the status is completed
/// (a nonblocking call still in progress is waited out). The call site names the handle's
/// binding, wraps the macro in `unsafe` and says why the arguments are sound:
///
/// ```ignore
/// // SAFETY: live handle under its lock; `id` is a valid, writable ncclUniqueId.
/// unsafe { comm_call!(self, |raw| ncclCommGetUniqueId(raw, &mut id)) }?;
/// ```
macro_rules! comm_call {
    ($comm:expr, |$raw:ident| $f:ident($($arg:expr),* $(,)?)) => {{
        let comm: &$crate::comm::Comm = $comm;
        let call = &$crate::calls::$f;
        let status = comm.with_raw(call, |$raw| comm.library().api().$f($($arg),*))?;
        comm.complete(call, status)
    }};
}
pub(crate) use comm_call;

mod child;
mod close;
mod flight_record;
mod in_flight;
mod init;
mod job_slot;
mod lease;
pub(crate) use init::{MULTI_RANK_GPU_MAX, MULTI_RANK_GPU_SINCE, MULTI_RANK_GPU_VAR};
mod membership;
pub(crate) mod state;
mod status;
mod streams;
mod suspend;
mod wait;

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use nccl_sys::ncclComm_t;
use parking_lot::MutexGuard;

pub(crate) use close::Siblings;
pub(crate) use flight_record::record_of;
pub use in_flight::{Release, ReleaseInFlight};
pub(crate) use init::rank_and_size;
pub(crate) use job_slot::JobSlot;
pub(crate) use lease::Lease;
pub(crate) use membership::Membership;
pub(crate) use state::{KernelStop, Shared, State, KERNEL_STOP_NOTICE};
pub use status::CommStatus;
pub(crate) use streams::check_own_stream;
pub use suspend::MemStats;
pub(crate) use wait::Backoff;

use crate::calls::Call;
use crate::error::{Error, Result};
use crate::library::Library;

/// How long [`Drop`] may take (the wait for enqueued work, then the orderly destroy), unless
/// changed with [`Comm::set_drop_timeout`].
pub const DEFAULT_DROP_TIMEOUT: Duration = Duration::from_secs(10);

/// The address of a [`CudaContext`], compared and never followed: whether a buffer belongs
/// to a communicator's context, known without reading through either again. Equal
/// addresses mean the same context because both are alive when compared (the
/// communicator's through its stream, a buffer's through the buffer an operation borrows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ContextId(usize);

/// Where one-sided RMA stands on a communicator whose NCCL sets it up at the first RMA call
/// (2.29, 2.30), a step every rank must take together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RmaSetup {
    /// Not yet: the next window registration sets it up on every rank.
    Pending,
    /// Done (or not needed by this NCCL).
    Ready,
    /// Not every rank could take part when it was tried: RMA calls are refused, since the
    /// first one would wait for ranks that never join.
    Refused,
}

impl ContextId {
    #[inline(always)]
    pub(crate) fn of(ctx: &Arc<CudaContext>) -> Self {
        Self(Arc::as_ptr(ctx) as usize)
    }
}

/// One rank of an NCCL communicator.
pub struct Comm {
    shared: Arc<Shared>,
    stream: Arc<CudaStream>,
    /// The context of `stream`.
    context: ContextId,
    lib: &'static Library,
    rank: usize,
    size: usize,
    device: usize,
    ready_timeout: Duration,
    drop_timeout: Duration,
    /// Shared by communicators created together, so dropping them all is bounded.
    siblings: Option<Arc<Siblings>>,
    /// Whether NCCL may pick copy engines for its collectives (CTA policy `ZERO`).
    copy_engine: bool,
    /// Whether one-sided RMA was set up where every rank was present (NCCL 2.29 and 2.30;
    /// see [`crate::window::rma`]).
    pub(crate) rma_setup: Cell<RmaSetup>,
    _not_sync: PhantomData<Cell<()>>,
}

impl Comm {
    /// This process's rank in the communicator, as reported by NCCL.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the communicator, as reported by NCCL.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The CUDA device ordinal the communicator runs on, as reported by NCCL.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The communicator's stream: where its operations run unless a call names another
    /// (not to be confused with a CUDA context's default stream, which it often is).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context of the communicator's stream.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.stream.context()
    }

    /// Whether calls on this communicator block (the default) or may return in progress.
    pub fn is_blocking(&self) -> bool {
        self.shared.blocking
    }

    /// The NCCL library this communicator was created with.
    pub fn library(&self) -> &'static Library {
        self.lib
    }

    /// Whether NCCL may run this communicator's all-gather, all-to-all, gather and scatter
    /// on copy engines (its CTA policy includes [`CtaPolicy::ZERO`](crate::config::CtaPolicy::ZERO),
    /// from the config or `NCCL_CTA_POLICY`, on NCCL 2.28 or later). NCCL then decides per
    /// rank, from whether that rank's buffers lie in symmetric windows, so every rank of a
    /// gather passes its receive buffer (see [`Operation::gather`](crate::Operation::gather)).
    /// From NCCL 2.31 a call's own [`CollConfig`](crate::CollConfig) policy overrides this
    /// for that call (unless `NCCL_CTA_POLICY` is set), and the same rules follow it.
    pub fn copy_engine(&self) -> bool {
        self.copy_engine
    }

    /// How long a nonblocking communicator may stay in progress before a call fails.
    pub fn ready_timeout(&self) -> Duration {
        self.ready_timeout
    }

    /// Sets how long a nonblocking communicator may stay in progress before a call fails
    /// with [`Error::Timeout`] (for example a short one once creation, which can take long,
    /// is over).
    pub fn set_ready_timeout(&mut self, timeout: Duration) {
        self.ready_timeout = timeout;
    }

    /// How long [`Drop`] may take in all: waiting for enqueued work (on every stream the
    /// communicator's operations ran on), then the orderly destroy (see the
    /// [module docs](self#end-of-life)); work not done by then is aborted. Also how long
    /// [`Comm::finalize`] and [`Comm::destroy`] wait for that work before they fail.
    pub fn drop_timeout(&self) -> Duration {
        self.drop_timeout
    }

    /// Sets how long [`Drop`] may take ([`Comm::drop_timeout`]); zero aborts at once, without
    /// waiting for enqueued work or for the network proxy to finish sending (and lets
    /// [`Comm::finalize`] and [`Comm::destroy`] go on only where the work already finished).
    /// Windows wait
    /// for their work within the same bound before deregistering, so with zero a window
    /// whose work has not finished yet is leaked (never freed while NCCL may still map it):
    /// close windows first, or synchronize, when their memory matters.
    pub fn set_drop_timeout(&mut self, timeout: Duration) {
        self.drop_timeout = timeout;
    }

    /// The raw `ncclComm_t`, for NCCL functions this crate does not wrap.
    ///
    /// # Safety
    ///
    /// The handle must not be used after the `Comm` is dropped, aborted or destroyed, must
    /// not be destroyed or aborted through it, and must not be used concurrently with calls
    /// through this `Comm`.
    pub unsafe fn as_raw(&self) -> ncclComm_t {
        self.shared.lock().ptr
    }

    /// The version of the NCCL library the communicator runs on.
    pub(crate) fn library_version(&self) -> crate::release::Version {
        self.lib.version()
    }

    pub(crate) fn shared_ptr(&self) -> *const Shared {
        Arc::as_ptr(&self.shared)
    }

    /// Runs `f` with the raw handle while holding the communicator's lock; fails if the
    /// communicator was already aborted or destroyed, or, for calls that enqueue work, if it
    /// failed (see [`crate::fault`]).
    pub(crate) fn with_raw<R>(
        &self,
        call: &'static Call,
        f: impl FnOnce(ncclComm_t) -> R,
    ) -> Result<R> {
        let state = self.usable(call)?;
        Ok(f(state.ptr))
    }

    /// The communicator's state, locked, once `call` may be made on it (see
    /// [`Comm::with_raw`]); for the enqueue path, which must stay one inlined run of code
    /// (a closure's body is judged before the kind it matches on is known).
    #[inline(always)]
    pub(crate) fn usable(&self, call: &'static Call) -> Result<MutexGuard<'_, State>> {
        let state = self.shared.lock();
        state.usable_for(call, self.rank)?;
        Ok(state)
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Registers `stop`, run before the communicator is aborted (see [`KernelStop`]), under
    /// `id` (unique to the owner); [`Comm::unregister_kernel_stop`]
    /// takes it back.
    pub(crate) fn register_kernel_stop(&self, id: usize, stop: Arc<dyn KernelStop>) {
        self.shared
            .lock()
            .kernel_stops
            .get_or_insert_with(Default::default)
            .push((id, stop));
    }

    /// Runs the stop registered under `id` now, under the lock, then waits
    /// [`KERNEL_STOP_NOTICE`]; takes it out once its word is written. `true` if written (or
    /// already run and taken out by an abort, revoke or shrink), `false` if not (it stays).
    pub(crate) fn run_kernel_stop(&self, id: usize) -> bool {
        let mut state = self.shared.lock();
        let Some(stops) = state.kernel_stops.as_mut() else {
            return true;
        };
        let Some(at) = stops.iter().position(|(owner, _)| *owner == id) else {
            return true;
        };
        let written = stops[at].1.signal();
        std::thread::sleep(KERNEL_STOP_NOTICE);
        if written {
            stops.remove(at);
        }
        written
    }

    /// Takes back what [`Comm::register_kernel_stop`] registered under `id`, if an abort did
    /// not run it already; after this no abort touches the owner's kernels' state.
    pub(crate) fn unregister_kernel_stop(&self, id: usize) {
        if let Some(stops) = self.shared.lock().kernel_stops.as_mut() {
            stops.retain(|(owner, _)| *owner != id);
        }
    }

    /// Completes a call on this communicator: `ncclInProgress` from a nonblocking
    /// communicator is waited out (NCCL forbids any other call, and any CUDA work on its
    /// streams, until the communicator is ready again).
    #[inline]
    pub(crate) fn complete(
        &self,
        call: &'static Call,
        status: std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>,
    ) -> Result<()> {
        if matches!(status, Ok(nccl_sys::ncclResult_t::ncclSuccess)) {
            return Ok(());
        }
        self.complete_slow(call, status)
    }

    #[cold]
    #[inline(never)]
    fn complete_slow(
        &self,
        call: &'static Call,
        status: std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>,
    ) -> Result<()> {
        if self.lib.check_pending(call.name, status)? {
            if let Err(err) = self.wait_ready(self.ready_timeout) {
                return Err(self.abandon_in_progress(err));
            }
        }
        Ok(())
    }

    /// The one rule for streams and buffers handed to this communicator: they must belong to
    /// its CUDA context (the same device, and the same context on it: a stream or an
    /// allocation of another context is not usable from the kernels NCCL launches there).
    /// Streams and buffers of the communicator's own stream or context pass by a pointer
    /// comparison.
    #[inline]
    pub(crate) fn check_context(&self, ctx: &Arc<CudaContext>, what: &str) -> Result<()> {
        if Arc::ptr_eq(ctx, self.context()) || ctx.cu_ctx() == self.context().cu_ctx() {
            return Ok(());
        }
        Err(self.wrong_context(ctx, what))
    }

    /// [`Comm::check_context`] for a buffer whose context was noted in `id`: a comparison
    /// of addresses when it is the communicator's own context, else the whole rule on the
    /// context `ctx` gives.
    #[inline(always)]
    pub(crate) fn check_context_of<'c>(
        &self,
        id: ContextId,
        ctx: impl FnOnce() -> &'c Arc<CudaContext>,
        what: &str,
    ) -> Result<()> {
        if id == self.context {
            return Ok(());
        }
        self.check_context(ctx(), what)
    }

    /// [`Comm::check_context`] for a stream.
    #[inline(always)]
    pub(crate) fn check_stream(&self, stream: &CudaStream, what: &str) -> Result<()> {
        if std::ptr::eq(stream, &*self.stream) {
            return Ok(());
        }
        self.check_context(stream.context(), what)
    }

    #[cold]
    #[inline(never)]
    fn wrong_context(&self, ctx: &CudaContext, what: &str) -> Error {
        let ordinal = ctx.ordinal();
        let place = if ordinal == self.device {
            format!("in another CUDA context of device {ordinal}")
        } else {
            format!("on device {ordinal}")
        };
        Error::invalid(format!(
            "{what} is {place}, but the communicator (rank {}) runs in the context of device \
             {} (use that context, e.g. `comm.context()` or `CudaContext::new({})`)",
            self.rank, self.device, self.device
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comm_is_send_but_not_sync() {
        fn assert_send<T: Send>() {}
        assert_send::<Comm>();
        // `Comm: !Sync` is checked by the compile-fail doctest on `Comm`'s module.
    }
}
