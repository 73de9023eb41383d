//! Waiting on a communicator: for a nonblocking call to finish, for the work on its stream,
//! and reading its asynchronous error on the way, so a failed peer is reported instead of
//! hanging.

use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;

use super::Comm;
use crate::calls;
use crate::error::{Error, Result, ResultCode};

impl Comm {
    /// Polls `ncclCommGetAsyncError` until the communicator is no longer in progress.
    ///
    /// For a nonblocking communicator this is how creation, split and enqueueing finish; for
    /// a blocking one it returns at once unless an asynchronous error is pending.
    ///
    /// Returns early with the failure if the communicator was aborted, revoked or reported
    /// failed by an [`AbortHandle`](crate::AbortHandle) or a [`Watchdog`](crate::Watchdog).
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        match self.poll_in_progress("the communicator to become ready", Some(timeout), true)? {
            ResultCode::Success => Ok(()),
            code => Err(self.lib.error("ncclCommGetAsyncError", code)),
        }
    }

    /// The one polling loop: reads `ncclCommGetAsyncError` until the communicator is no longer
    /// in progress, and returns its state then (success or the error it reports). With
    /// `stop_at_failure`, a failure recorded meanwhile (abort, revoke, watchdog) ends the wait
    /// with its error; without, the wait goes on for NCCL's jobs that still finish on a failed
    /// communicator (shrink). `what` names what is awaited, for the timeout error.
    pub(crate) fn poll_in_progress(
        &self,
        what: &str,
        timeout: Option<Duration>,
        stop_at_failure: bool,
    ) -> Result<ResultCode> {
        let start = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            let code = if stop_at_failure {
                self.check_failure("Comm::wait_ready")?;
                self.async_code()?
            } else {
                self.async_code_raw()?
            };
            if code != ResultCode::InProgress {
                return Ok(code);
            }
            if timeout.is_some_and(|limit| start.elapsed() >= limit) {
                return Err(Error::Timeout {
                    what: format!("{what} on rank {}", self.rank),
                    waited: start.elapsed(),
                });
            }
            backoff.wait();
        }
    }

    /// Fails with the recorded failure, if the communicator has one.
    pub(crate) fn check_failure(&self, call: &'static str) -> Result<()> {
        self.shared.lock().check_failure(call, self.rank)
    }

    pub(crate) fn async_code(&self) -> Result<ResultCode> {
        let mut code = nccl_sys::ncclResult_t::ncclSuccess;
        let status = self.with_raw(&calls::ncclCommGetAsyncError, |raw| {
            // SAFETY: live handle under the lock; `code` is a valid out-pointer.
            unsafe { self.lib.api().ncclCommGetAsyncError(raw, &mut code) }
        })?;
        self.lib.check(calls::ncclCommGetAsyncError.name, status)?;
        Ok(ResultCode::from_raw(code))
    }

    /// `ncclCommGetAsyncError` as is, also on a communicator marked failed (not released).
    pub(crate) fn async_code_raw(&self) -> Result<ResultCode> {
        let state = self.shared.lock();
        if state.ptr.is_null() {
            return Err(state.released_error("ncclCommGetAsyncError", self.rank));
        }
        let mut code = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: live handle under its lock; `code` is a valid out-pointer.
        let status = unsafe { self.lib.api().ncclCommGetAsyncError(state.ptr, &mut code) };
        self.lib.check(calls::ncclCommGetAsyncError.name, status)?;
        Ok(ResultCode::from_raw(code))
    }

    /// The communicator's asynchronous error, if it has one (`ncclCommGetAsyncError`).
    ///
    /// `Ok(None)` means healthy (or, for a nonblocking communicator, still progressing).
    /// An error here is fatal: the communicator must be aborted.
    pub fn async_error(&self) -> Result<Option<Error>> {
        Ok(match self.async_code()? {
            ResultCode::Success | ResultCode::InProgress => None,
            code => Some(self.lib.error("ncclCommGetAsyncError", code)),
        })
    }

    /// Waits until all work enqueued so far on the communicator's stream has finished,
    /// checking the communicator's asynchronous error while waiting, so a failed peer is
    /// reported instead of hanging. Gives up with [`Error::Timeout`] after `timeout`.
    ///
    /// Only the communicator's own stream: operations enqueued on other streams
    /// ([`Comm::enqueue_on`] and the like) are waited for by
    /// [`Comm::synchronize_all_timeout`], and by the end of the communicator's life.
    pub fn synchronize_timeout(&self, timeout: Duration) -> Result<()> {
        self.wait_stream(&self.stream, Some(timeout))
    }

    /// Waits until all work enqueued so far on the communicator's stream has finished,
    /// returning early with the communicator's asynchronous error if one occurs. Only the
    /// communicator's own stream, as [`Comm::synchronize_timeout`].
    pub fn synchronize(&self) -> Result<()> {
        self.wait_stream(&self.stream, None)
    }

    /// Waits, as [`Comm::synchronize_timeout`], for the communicator's stream and for every
    /// other stream its operations were enqueued on ([`Comm::enqueue_on`],
    /// [`Group::enqueue_on`](crate::Group::enqueue_on), [`Comm::enqueue_v_on`], one-sided
    /// RMA's `*_on`): on each, up to the last of its operations there (earlier work on those
    /// streams included, later work not). What dropping or destroying the communicator waits
    /// for. Fails with [`Error::Cuda`] where one of those streams could not be tracked (a
    /// CUDA error when recording on it), since then nobody can say. Operations captured into
    /// a CUDA graph are not seen: their work runs where the graph is launched.
    pub fn synchronize_all_timeout(&self, timeout: Duration) -> Result<()> {
        self.wait_work(&self.stream, true, Some(timeout), true)
    }

    pub(crate) fn wait_stream(&self, stream: &CudaStream, timeout: Option<Duration>) -> Result<()> {
        self.wait_work(stream, false, timeout, true)
    }

    /// [`Comm::synchronize_all_timeout`] for [`Comm::destroy`]: a failure recorded on the
    /// communicator without an asynchronous error (a watchdog's report, a revoke) allows a
    /// destroy, so it does not end the wait; only an asynchronous error or its release do.
    pub(crate) fn wait_all_to_end(&self, timeout: Duration) -> Result<()> {
        self.wait_work(&self.stream, true, Some(timeout), false)
    }

    /// The one wait for work: until the work enqueued so far on `stream`, and with `others`
    /// the work recorded on the other streams this communicator used, has finished. With
    /// `stop_at_failure`, a failure recorded meanwhile ends the wait with its error (and is
    /// reported even when the work drained, as an abort lets it); without, only an
    /// asynchronous error or the communicator's release do.
    fn wait_work(
        &self,
        stream: &CudaStream,
        others: bool,
        timeout: Option<Duration>,
        stop_at_failure: bool,
    ) -> Result<()> {
        let start = Instant::now();
        let expired = |start: Instant| timeout.is_some_and(|limit| start.elapsed() >= limit);
        let mut backoff = Backoff::new();
        // NCCL forbids CUDA work on the communicator's streams while it is in progress (only
        // possible here after an earlier call timed out): wait for it first, issuing nothing.
        let code = self.poll_in_progress(
            "the communicator to finish its last call before synchronizing",
            timeout,
            stop_at_failure,
        )?;
        if code != ResultCode::Success {
            return Err(self.lib.error("ncclCommGetAsyncError", code));
        }
        // What the event completes after, for the flight recorder: every operation recorded
        // so far (this thread is the only one that enqueues on the communicator).
        let covers = self.shared.lock().flight.as_deref().map(|r| r.next_seq());
        let done = stream.record_event(None)?;
        let check = |call| {
            let state = self.shared.lock();
            match (stop_at_failure, state.ptr.is_null()) {
                (true, _) => state.check_failure(call, self.rank),
                (false, true) => Err(state.released_error(call, self.rank)),
                (false, false) => Ok(()),
            }
        };
        loop {
            if done.try_is_complete()? && (!others || self.foreign_streams_done()?) {
                // Work cut short by an abort from another thread also completes: report the
                // abort rather than success (and do not take it for completed work).
                check("Comm::synchronize")?;
                if let Some(covers) = covers {
                    self.mark_completed_before(stream, covers);
                }
                return Ok(());
            }
            check("Comm::synchronize")?;
            let code = self.async_code_raw()?;
            if !matches!(code, ResultCode::Success | ResultCode::InProgress) {
                return Err(self.lib.error("ncclCommGetAsyncError", code));
            }
            if expired(start) {
                let what = if others {
                    format!("work on the streams of rank {}", self.rank)
                } else {
                    format!("work on the stream of rank {}", self.rank)
                };
                return Err(Error::Timeout {
                    what,
                    waited: start.elapsed(),
                });
            }
            backoff.wait();
        }
    }

    /// The flight recorder learns that `stream` ran past every operation numbered below
    /// `seq`; only the communicator's own stream counts (see [`crate::diagnostics::flight`]),
    /// and only while nothing stopped its kernels (a revoke or an abort also drains it).
    fn mark_completed_before(&self, stream: &CudaStream, seq: u64) {
        if stream.cu_stream() != self.stream.cu_stream() {
            return;
        }
        let mut state = self.shared.lock();
        if state.ptr.is_null() || state.failure.is_some() {
            return;
        }
        if let Some(ring) = state.flight.as_deref_mut() {
            ring.completed_before(seq);
        }
    }

    /// The failure recorded on this communicator (by [`Comm::revoke`], an [`AbortHandle`](crate::AbortHandle) or
    /// a [`Watchdog`](crate::Watchdog)), as the error its calls now get; `None` while it is usable.
    pub fn failure(&self) -> Option<Error> {
        self.shared()
            .lock()
            .check_failure("Comm::failure", self.rank())
            .err()
    }
}

/// Polling pace: spin briefly (most waits are short), then yield, then sleep in steps that
/// grow to at most 50 µs, so a long wait costs little CPU and a timed wait ends at most about
/// 50 µs late.
pub(crate) struct Backoff {
    polls: u32,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Self { polls: 0 }
    }

    pub(crate) fn wait(&mut self) {
        self.polls = self.polls.saturating_add(1);
        match self.polls {
            0..=64 => std::hint::spin_loop(),
            65..=1024 => std::thread::yield_now(),
            n => std::thread::sleep(Duration::from_micros(u64::from((n - 1024).min(50)))),
        }
    }
}
