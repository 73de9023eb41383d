//! The watchdog: a thread that watches one nonblocking communicator and aborts, revokes or
//! marks it failed when it reports an error or stops making progress, and reports what the
//! diagnostics knew then (the flight record, NCCL's RAS verdict).
//!
//! Past 600 lines on purpose: the trip's report (flight record, RAS) is part of tripping and
//! stays beside it; the decisions themselves are in `Monitor`, tested on their own.

use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaEvent, CudaStream};

use super::abort::act;
use super::require_nonblocking;
use crate::calls;
use crate::comm::state::{Action, Actor, Cause, Failure, FailureState, State};
use crate::comm::{record_of, Comm, Shared};
use crate::diagnostics::flight::{self, FlightRecord, Who};
use crate::diagnostics::ras::{RasOutcome, RasQuery};
use crate::error::{Error, Result, ResultCode};
use crate::library::Library;
use crate::release::Version;

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
    /// and the owner decides (typically [`Comm::shrink`] with [`ShrinkMode::Abort`](crate::ShrinkMode::Abort), or
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
    ras_query: bool,
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
            ras_query: true,
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
    /// only reacts to asynchronous errors and to calls stuck in progress. Probing also
    /// watches the other streams the communicator's operations ran on
    /// ([`Comm::enqueue_on`] and the like): the last operation on one of them that stays
    /// unfinished for the timeout, counted from the poll that first saw it pending, trips
    /// the watchdog too. A newer operation on that stream starts the count again (it is
    /// the one then watched); as on the communicator's own stream, work queued behind more
    /// than the timeout's worth of earlier work trips it.
    pub fn probe_stream(mut self, probe: bool) -> Self {
        self.probe_stream = probe;
        self
    }

    /// Whether to ask NCCL's RAS for its verdict when tripping (default `true`; see
    /// [`WatchdogTrip::ras`]). The query is made after the watchdog acted, from its own
    /// thread, and takes at most [`DEFAULT_RAS_TIMEOUT`](crate::diagnostics::ras::DEFAULT_RAS_TIMEOUT);
    /// dropping the watchdog meanwhile waits for it.
    pub fn ras_query(mut self, ask: bool) -> Self {
        self.ras_query = ask;
        self
    }

    /// The timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// Why and when a [`Watchdog`] tripped, with what the diagnostics knew then (see
/// [`crate::diagnostics`]); `Display` writes the whole report.
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
    /// The communicator's flight record, taken before the watchdog acted; `None` where the
    /// recorder is off.
    pub flight_record: Option<FlightRecord>,
    /// Where the flight record was written (`NCCL_RS_FLIGHT_RECORDER_DIR`), or why it could
    /// not be; `None` where that variable is not set (or the recorder is off).
    pub flight_record_file: Option<std::result::Result<PathBuf, String>>,
    /// NCCL's RAS verdict, asked after the watchdog acted (so with
    /// [`WatchdogAction::Abort`] this rank's communicator may already be missing from it:
    /// [`WatchdogAction::Report`] leaves it for RAS to see), or why RAS did not answer.
    /// [`RasOutcome::Pending`] while being asked: see [`Watchdog::trip_report`].
    pub ras: RasOutcome,
}

impl fmt::Display for WatchdogTrip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "watchdog tripped ({:?}): {}", self.action, self.reason)?;
        if let Some(err) = &self.action_error {
            writeln!(f, "the action failed: {err}")?;
        }
        match &self.flight_record {
            Some(record) => write!(f, "{record}")?,
            None => writeln!(f, "no flight record (the recorder is off)")?,
        }
        match &self.flight_record_file {
            Some(Ok(path)) => writeln!(f, "flight record written to {}", path.display())?,
            Some(Err(why)) => writeln!(f, "the flight record could not be written: {why}")?,
            None => {}
        }
        write!(f, "{}", self.ras)
    }
}

struct WatchdogShared {
    stop: Mutex<bool>,
    wake: Condvar,
    trip: Mutex<Option<WatchdogTrip>>,
    /// Signalled when the trip is stored, and when its RAS verdict is in.
    reported: Condvar,
    /// Set (under `trip`'s lock) once the trip's report is complete: the record's file
    /// written where asked, RAS's verdict in.
    report_done: std::sync::atomic::AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A thread that watches one nonblocking communicator and acts when it fails or stops
/// making progress; see the [module docs](super). Stops (and joins its thread) when dropped.
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
    /// The trip, if the watchdog has tripped. Its [`WatchdogTrip::ras`] may still be
    /// [`RasOutcome::Pending`]; [`Watchdog::trip_report`] waits for it.
    pub fn trip(&self) -> Option<WatchdogTrip> {
        lock(&self.shared.trip).clone()
    }

    /// The trip once it is complete (RAS answered, failed to, or was not asked), waiting up
    /// to `wait` for the watchdog to trip and for RAS; what there is when `wait` runs out.
    pub fn trip_report(&self, wait: Duration) -> Option<WatchdogTrip> {
        let deadline = crate::diagnostics::ras::deadline_after(wait);
        let mut trip = lock(&self.shared.trip);
        loop {
            let settled = trip.is_some()
                && self
                    .shared
                    .report_done
                    .load(std::sync::atomic::Ordering::Acquire);
            let left = deadline.saturating_duration_since(Instant::now());
            if settled || left.is_zero() {
                return trip.clone();
            }
            trip = self
                .shared
                .reported
                .wait_timeout(trip, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
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
            comm.library().require_call(&calls::ncclCommRevoke)?;
        }
        require_nonblocking(comm, "a watchdog")?;
        let shared = Arc::new(WatchdogShared {
            stop: Mutex::new(false),
            wake: Condvar::new(),
            trip: Mutex::new(None),
            reported: Condvar::new(),
            report_done: std::sync::atomic::AtomicBool::new(false),
        });
        let worker = Worker {
            comm: comm.shared().clone(),
            lib: comm.library(),
            stream: comm.stream().clone(),
            rank: comm.rank(),
            who: comm.who(),
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
    comm: Arc<Shared>,
    lib: &'static Library,
    stream: Arc<CudaStream>,
    rank: usize,
    /// Whose flight record it takes.
    who: Who,
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
        let mut probe: Option<Probe> = None;
        while !self.sleep() {
            let mut state = self.comm.lock();
            if state.ptr.is_null() || state.failure.is_some() {
                // Released, or failed and already reported: nothing left to watch.
                return;
            }
            if state.open_groups > 0 {
                // The owner's thread has it in an open NCCL group, and `ncclGroupEnd` (made
                // without this lock) updates the state `ncclCommGetAsyncError` reads: stay
                // out of NCCL until the group has ended.
                continue;
            }
            let now = Instant::now();
            let verdict = match self.observe(&mut state, &mut probe, &mut monitor, now) {
                Ok(verdict) => verdict,
                Err(cause) => Verdict::Trip(cause),
            };
            if let Verdict::Trip(cause) = verdict {
                self.trip(&mut state, cause);
                drop(state);
                // Off the communicator's lock and off this thread: the slow parts of the
                // report (a file, RAS's answer within its 2 s) must not delay a drop of the
                // watchdog, which joins this thread.
                let shared = Arc::clone(&self.shared);
                let detached = std::thread::Builder::new()
                    .name("nccl-rs-trip-report".into())
                    .spawn(move || complete_report(&shared));
                if detached.is_err() {
                    complete_report(&self.shared);
                }
                return;
            }
        }
    }

    /// One poll, under the communicator's lock.
    fn observe(
        &self,
        state: &mut State,
        probe: &mut Option<Probe>,
        monitor: &mut Monitor,
        now: Instant,
    ) -> std::result::Result<Verdict, Cause> {
        let mut code = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: live handle (checked non-null by the caller) under the communicator's
        // lock; `code` is a valid out-pointer.
        let status = unsafe { self.lib.api().ncclCommGetAsyncError(state.ptr, &mut code) };
        let seen = match status.map(ResultCode::from_raw) {
            Ok(ResultCode::Success) => Seen::from_code(ResultCode::from_raw(code)),
            Ok(failed) => Seen::Error(failed),
            Err(_) => Seen::Error(ResultCode::InternalError),
        };
        let probe_done = match probe {
            Some(probe) if self.options.probe_stream => {
                Some(probe.event.try_is_complete().map_err(Cause::Cuda)?)
            }
            _ => None,
        };
        let verdict = monitor.observe(now, seen, probe_done);
        if probe_done == Some(true) {
            // The stream ran past the probe, so past every operation recorded before it.
            if let (Some(done), Some(ring)) = (probe.take(), state.flight.as_deref_mut()) {
                ring.completed_before(done.covers);
            }
        }
        if let Verdict::Trip(_) = verdict {
            return Ok(verdict);
        }
        // The other streams its operations ran on: their events, re-recorded by each new
        // operation there, are the probes (the watchdog cannot record on streams it does not
        // hold). Timed from the poll that first saw the last record pending.
        if let (true, Some(streams)) = (self.options.probe_stream, state.foreign.as_deref_mut()) {
            if let Some(waited) = streams
                .stalled(now, self.options.timeout)
                .map_err(Cause::Cuda)?
            {
                return Ok(Verdict::Trip(Cause::Stalled {
                    what: "work enqueued on another of the communicator's streams to finish",
                    waited,
                }));
            }
        }
        if verdict == Verdict::Probe && self.options.probe_stream {
            let capturing = self.stream.capture_status().map_err(Cause::Cuda)?;
            if capturing == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                // Recording is allowed: the communicator is ready (NCCL is not enqueueing
                // on its streams) and its lock keeps the owner's NCCL calls out meanwhile.
                let covers = state.flight.as_deref().map_or(0, |ring| ring.next_seq());
                let event = self.stream.record_event(None).map_err(Cause::Cuda)?;
                *probe = Some(Probe { event, covers });
                monitor.probe_recorded(now);
            }
        }
        Ok(verdict)
    }

    fn trip(&self, state: &mut State, cause: Cause) {
        // NCCL's own texts for an asynchronous error.
        let cause = match cause {
            Cause::AsyncError { code, .. } => {
                match self.lib.error(calls::ncclCommGetAsyncError.name, code) {
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
                }
            }
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
        // Before acting, as the communicator was when it hung.
        let flight_record = record_of(state, self.who.clone(), &format!("watchdog: {reason}"));
        let result = act(
            state,
            self.lib,
            self.stream.context(),
            &self.who,
            action,
            failure,
        );
        let action_error = match result {
            Err(err) if action == Action::Revoke => {
                // Revoking failed: fall back to aborting, which always releases.
                let fallback = Failure {
                    state: FailureState::Released,
                    by: Actor::Watchdog,
                    cause: Cause::Requested,
                };
                let _ = act(
                    state,
                    self.lib,
                    self.stream.context(),
                    &self.who,
                    Action::Abort,
                    fallback,
                );
                Some(format!("{err}; aborted instead"))
            }
            Err(err) => Some(err.to_string()),
            Ok(_) => None,
        };
        let ras = if !self.options.ras_query {
            RasOutcome::NotAsked("WatchdogOptions::ras_query(false)".into())
        } else if self.lib.version() < RAS_SINCE {
            RasOutcome::NotAsked(format!(
                "NCCL {} has no RAS (it came with {RAS_SINCE})",
                self.lib.version()
            ))
        } else {
            RasOutcome::Pending
        };
        *lock(&self.shared.trip) = Some(WatchdogTrip {
            reason,
            action: self.options.action,
            at: Instant::now(),
            action_error,
            flight_record,
            flight_record_file: None,
            ras,
        });
        self.shared.reported.notify_all();
    }
}

/// Completes a trip's report: writes the flight record where the environment says, and asks
/// RAS where the trip is waiting for it; wakes `trip_report` either way.
fn complete_report(shared: &WatchdogShared) {
    let record = lock(&shared.trip)
        .as_ref()
        .and_then(|t| t.flight_record.clone());
    if let Some(written) = record.as_ref().and_then(flight::write_to_env_dir) {
        if let Some(trip) = lock(&shared.trip).as_mut() {
            trip.flight_record_file = Some(written);
        }
    }
    let pending = lock(&shared.trip)
        .as_ref()
        .is_some_and(|t| matches!(t.ras, RasOutcome::Pending));
    if pending {
        let outcome = match RasQuery::new().run() {
            Ok(status) => RasOutcome::Answered(status),
            Err(err) => RasOutcome::NotAnswered(err.to_string()),
        };
        if let Some(trip) = lock(&shared.trip).as_mut() {
            trip.ras = outcome;
        }
    }
    {
        // Under the lock `trip_report` waits with, so its wake-up is not lost.
        let _trip = lock(&shared.trip);
        shared
            .report_done
            .store(true, std::sync::atomic::Ordering::Release);
    }
    shared.reported.notify_all();
}

/// The first NCCL with RAS.
const RAS_SINCE: Version = Version::new(2, 24, 0);

/// A progress probe: an event recorded on the communicator's stream, and the flight
/// recorder's next sequence number then (every operation below it completes before it).
struct Probe {
    event: CudaEvent,
    covers: u64,
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

impl Comm {
    /// Starts a [`Watchdog`] that aborts this (nonblocking) communicator when it reports an
    /// asynchronous error or makes no progress for `timeout`.
    pub fn watchdog(&self, timeout: Duration) -> Result<Watchdog> {
        Watchdog::spawn(self, WatchdogOptions::new(timeout))
    }

    /// Starts a [`Watchdog`] with explicit settings.
    pub fn watchdog_with(&self, options: WatchdogOptions) -> Result<Watchdog> {
        Watchdog::spawn(self, options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
