//! The end of a communicator's life: finalize and destroy (collective, orderly), abort, and
//! what dropping does; see the [module docs](super#end-of-life).

use std::time::Duration;

use super::in_flight::{release_on_thread, Release};
use super::state::{Actor, Cause, Failure, FailureState};
use super::Comm;
use crate::calls;
use crate::error::{Error, Result, ResultCode};
use crate::thread_group;

impl Comm {
    /// Flushes all operations and releases network resources (`ncclCommFinalize`, NCCL
    /// 2.14). It is collective: every rank calls it, then [`Comm::destroy`]. Returns once the
    /// communicator is quiescent (a nonblocking one is polled to completion).
    ///
    /// NCCL's finalize waits for every kernel of the communicator, on any stream, and a
    /// blocking communicator's cannot be interrupted; so the work enqueued so far, on the
    /// communicator's stream and on every other stream its operations ran on, is waited for
    /// first, for at most [`Comm::drop_timeout`] (as [`Comm::synchronize_all_timeout`]).
    /// Work not done by then fails the call with [`Error::Timeout`] before NCCL sees it: the
    /// communicator is as it was (abort it, or drop it, which aborts).
    ///
    /// NCCL's finalize also waits until every CUDA graph that captured this communicator's
    /// operations is destroyed (see the [module docs](super#end-of-life)): destroy such
    /// graphs first.
    pub fn finalize(&self) -> Result<()> {
        self.lib.require_call(&calls::ncclCommFinalize)?;
        thread_group::ensure_outside("Comm::finalize")?;
        // Refused first as NCCL's call would be (failed, suspended), with that call's error.
        drop(self.usable(&calls::ncclCommFinalize)?);
        self.synchronize_all_timeout(self.drop_timeout)?;
        // SAFETY: live handle under its lock; no other argument.
        unsafe { comm_call!(self, |raw| ncclCommFinalize(raw)) }
    }

    /// Frees the communicator (`ncclCommDestroy`). Without a prior [`Comm::finalize`] this
    /// is an intra-node collective that every rank on the node must call; after a finalize
    /// it is local.
    ///
    /// NCCL's destroy waits for every kernel of the communicator, on any stream, and cannot
    /// be interrupted; so, as a drop does, the work enqueued so far on the communicator's
    /// stream and on every other stream its operations ran on is waited for first, for at
    /// most [`Comm::drop_timeout`] (zero: it must have finished already). Work not done by
    /// then, or an asynchronous error meanwhile, is a failure as below (abort the
    /// communicator, or drop it, which aborts): a kernel waiting for a peer that never
    /// comes would otherwise hold the destroy, and the caller, forever.
    ///
    /// Like rusqlite's `Connection::close`, a failure gives the communicator back with the
    /// error, still allocated: abort it, or drop it (which aborts). `?` converts the pair
    /// into the error alone, dropping (so aborting) the communicator. A communicator with an
    /// asynchronous error is given back without calling NCCL, whose destroy would refuse it
    /// (`ncclCommDestroy` checks the same error first); only an abort frees it then.
    ///
    /// If an [`AbortHandle`](crate::AbortHandle) or a [`Watchdog`](crate::Watchdog) already
    /// aborted the communicator, nothing is left to free and the error says why it was
    /// aborted.
    ///
    /// A CUDA graph that captured this communicator's operations and is still alive holds
    /// NCCL's destroy until it is destroyed, and on the last rank of this process to end the
    /// communicator every rank's graphs do (see the [module docs](super#end-of-life)):
    /// destroy such graphs first.
    ///
    /// The call into NCCL itself is not bounded: as an intra-node collective it waits for the
    /// other ranks of the node to end the communicator the orderly way, and one that aborted
    /// instead (a peer whose own destroy refused, or whose watchdog fired) leaves it waiting
    /// indefinitely (seen on 4×H100, NCCL 2.32.3). Where a peer may fail, end the
    /// communicator by dropping it: a drop bounds the same destroy by
    /// [`Comm::drop_timeout`] and goes on (see [`Comm::releases_in_flight`]).
    // The pair is rusqlite's shape; destroy is called once per communicator, so its size
    // costs nothing.
    #[allow(clippy::result_large_err)]
    pub fn destroy(self) -> std::result::Result<(), (Comm, Error)> {
        match self.destroy_raw() {
            Ok(()) => Ok(()),
            Err(err) => Err((self, err)),
        }
    }

    fn destroy_raw(&self) -> Result<()> {
        const CALL: &str = "ncclCommDestroy";
        if let Some(err) = self.async_error()? {
            return Err(err);
        }
        // A failure recorded without an asynchronous error (a watchdog's report, a revoke)
        // allows a destroy: the wait goes on through it.
        self.wait_all_to_end(self.drop_timeout)?;
        let mut state = self.shared.lock();
        if state.ptr.is_null() {
            return Err(state.released_error(CALL, self.rank));
        }
        // Best effort: NCCL finds its device itself, but its cleanup may use the current
        // context.
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: live handle under its lock. The lock is held through the call so that a
        // failed destroy leaves the handle where it was, owned by this `Comm`.
        let status = unsafe { self.lib.api().ncclCommDestroy(state.ptr) };
        // In progress (a nonblocking communicator) means NCCL's job frees it: it is gone.
        self.lib.check_pending(CALL, status)?;
        state.take(Failure::owner(FailureState::Released));
        Ok(())
    }

    /// Aborts the communicator (`ncclCommAbort`): stops its outstanding operations and frees
    /// it without waiting for peers. After a failure every rank should abort.
    ///
    /// Aborting a communicator that an [`AbortHandle`](crate::AbortHandle) or a
    /// [`Watchdog`](crate::Watchdog) already aborted is a no-op that returns `Ok`. Where
    /// CUDA graphs that captured it are still alive, NCCL's abort goes on past 1 s on a
    /// thread of its own until they are destroyed, its kernels stopped (see the
    /// [module docs](super#end-of-life)).
    pub fn abort(self) -> Result<()> {
        // Already released means another thread did it: `self` is still owned here.
        self.shared.lock().abort(
            self.lib,
            self.stream.context(),
            &self.who(),
            Failure::owner(FailureState::Released),
        )
    }

    /// Called when waiting for this communicator to leave `ncclInProgress` failed (timeout,
    /// or a failure recorded meanwhile): if it is still in progress, it is aborted, because
    /// NCCL forbids any CUDA work on its streams until it is ready, and the caller is about
    /// to record its buffers' events there (cudarc's guards). Returns the error to report,
    /// which says so.
    pub(crate) fn abandon_in_progress(&self, err: Error) -> Error {
        if !matches!(self.async_code_raw(), Ok(ResultCode::InProgress)) {
            return err;
        }
        self.abort_stalled(
            "a nonblocking call to complete",
            "NCCL allows no CUDA work on its streams while a call on it is still in progress",
            err,
        )
    }

    /// Aborts the communicator because `what` did not happen (the error `err`, usually a
    /// timeout), so that nothing else touches it; `why` ends the error's text. Returns the
    /// error to report, which says so.
    pub(crate) fn abort_stalled(&self, what: &'static str, why: &str, err: Error) -> Error {
        let waited = match &err {
            Error::Timeout { waited, .. } => *waited,
            _ => Duration::ZERO,
        };
        let aborted = self.shared.lock().abort(
            self.lib,
            self.stream.context(),
            &self.who(),
            Failure {
                state: FailureState::Released,
                by: Actor::Owner,
                cause: Cause::Stalled { what, waited },
            },
        );
        match (err, aborted) {
            (Error::Timeout { what, waited }, Ok(_)) => Error::Timeout {
                what: format!("{what}; the communicator was aborted, since {why}"),
                waited,
            },
            (err, _) => err,
        }
    }
}

/// Lets `comm.destroy()?` work: the communicator a failed [`Comm::destroy`] gives back is
/// dropped here, which aborts it.
impl From<(Comm, Error)> for Error {
    fn from((comm, err): (Comm, Error)) -> Self {
        drop(comm);
        err
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let (live, failed, suspended) = {
            let state = self.shared.lock();
            (
                !state.ptr.is_null(),
                state.failure.is_some(),
                state.suspended,
            )
        };
        if !live {
            return;
        }
        // Let the last operations finish, on every stream they ran on, unless the
        // communicator already failed or is stuck in progress (every call waits until it is
        // ready, so a communicator still in progress here has timed out and its work will
        // not finish). A dead peer or the timeout ends the wait, and the abort below then
        // cancels what is left, on every stream (NCCL's kernels watch the communicator's
        // abort flag). Only work known to be finished takes the orderly way. A suspended
        // one has no work left (suspending synchronised the device) and no proxy sends to
        // drain: it is aborted at once.
        let start = std::time::Instant::now();
        let healthy = !failed && !suspended && matches!(self.async_code(), Ok(ResultCode::Success));
        let wait = match &self.siblings {
            Some(siblings) => siblings.drop_wait(self.drop_timeout),
            None => self.drop_timeout,
        };
        if healthy && !wait.is_zero() {
            // Its own stream and every other stream its operations ran on: NCCL's destroy
            // waits for every kernel of the communicator, and nothing could abort one once
            // the destroy has the handle. A failure recorded meanwhile ends the wait (and
            // the abort below follows).
            match self.synchronize_all_timeout(wait) {
                // Its work is done: end it the orderly way, which lets NCCL's network proxy
                // finish sending what peers still need.
                Ok(()) => {
                    let left = wait.saturating_sub(start.elapsed());
                    if !left.is_zero() {
                        self.destroy_within(left);
                        return;
                    }
                }
                Err(Error::Timeout { .. }) => {
                    if let Some(siblings) = &self.siblings {
                        siblings.timed_out();
                    }
                }
                Err(_) => {}
            }
        }
        // Errors have nowhere to go from a drop; the handle is gone either way.
        let _ = self.shared.lock().abort(
            self.lib,
            self.stream.context(),
            &self.who(),
            Failure::owner(FailureState::Released),
        );
    }
}

impl Comm {
    /// Drop's orderly end: `ncclCommDestroy`, waited for at most `limit`. The handle is gone
    /// afterwards (destroyed, aborted, or handed to a destroy still running).
    ///
    /// Why not abort, as after a failure: a collective completes on a rank once its GPU
    /// kernel has handed its last sends to NCCL's proxy thread, which puts them on the
    /// network afterwards (`sendProxyProgress`, `src/transport/net.cc`). `ncclCommAbort`
    /// stops the proxy at once (its progress loop leaves on the abort flag, 2.28 to 2.30.7
    /// `src/proxy.cc`) and closes the sockets, so a peer still receiving the same collective
    /// fails with "Connection closed by remote peer"; `ncclCommFinalize` only asks the proxy
    /// to stop. `ncclCommDestroy` joins the proxy thread, which drains its operations before
    /// the sockets close.
    ///
    /// Why bounded: destroy waits for that drain (a peer host that vanished without a reset
    /// holds it until TCP gives up) and for the ranks of this node connected to this rank's
    /// proxy to end the communicator too (the proxy service loop runs while local peers are
    /// connected). It cannot be interrupted, so it runs on a thread of its own; past `limit`
    /// that thread keeps the handle and finishes the destroy (or, if NCCL refuses it, the
    /// abort) whenever NCCL returns, and the drop goes on. The thread is listed meanwhile
    /// ([`Comm::releases_in_flight`]). It waits for none of the kernels the communicator's
    /// operations enqueued: the drop hands over only a communicator whose work finished on
    /// every stream it used (work captured into CUDA graphs aside; see `in_flight.rs` for
    /// what is left and why no abort may follow).
    fn destroy_within(&self, limit: Duration) {
        let mut state = self.shared.lock();
        let raw = state.take(Failure::owner(FailureState::Released));
        drop(state);
        if raw.is_null() {
            return;
        }
        // Done or not, the handle is NCCL's (or the release thread's) now; errors have
        // nowhere to go from a drop.
        let _ = release_on_thread(
            self.lib,
            self.stream.context(),
            &self.who(),
            Release::Destroy,
            raw,
            limit,
        );
    }
}

/// Communicators created together ([`Comm::init_all`], [`Comm::split_all`]) usually fail
/// together: the ranks of one job in one process wait for each other. A program drops them
/// one after another (a `Vec<Comm>`), and each drop may wait [`Comm::drop_timeout`] for its
/// stream; once one of them timed out, the others abort at once, so dropping N communicators
/// whose peers died takes one drop timeout, not N.
#[derive(Debug, Default)]
pub(crate) struct Siblings {
    stuck: std::sync::atomic::AtomicBool,
}

impl Siblings {
    /// How long a drop may wait for its stream, given its own timeout.
    fn drop_wait(&self, timeout: Duration) -> Duration {
        if self.stuck.load(std::sync::atomic::Ordering::Relaxed) {
            Duration::ZERO
        } else {
            timeout
        }
    }

    /// Records that a drop timed out waiting.
    fn timed_out(&self) {
        self.stuck.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siblings_share_one_drop_timeout() {
        let siblings = Siblings::default();
        let timeout = Duration::from_secs(10);
        assert_eq!(siblings.drop_wait(timeout), timeout);
        assert_eq!(siblings.drop_wait(timeout), timeout);
        // Once one drop timed out, the others abort without waiting.
        siblings.timed_out();
        assert_eq!(siblings.drop_wait(timeout), Duration::ZERO);
        assert_eq!(siblings.drop_wait(Duration::from_secs(1)), Duration::ZERO);
    }
}
