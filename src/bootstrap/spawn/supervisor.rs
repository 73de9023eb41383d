//! Watching the ranks [`spawn_local`](super::spawn_local) started: reaping them, noticing
//! the first failure, stopping the rest, and telling the program.

use std::process::{Child, ExitStatus};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::bootstrap::util::{io_error, lock, wait_for, Interrupt};
use crate::bootstrap::{BootstrapError, ChildExit, Result};

/// How often the supervisor looks at the children.
const SUPERVISION_PERIOD: Duration = Duration::from_millis(20);

/// The exit code that reports `status` to a shell: the child's own code, or 128 + signal.
fn exit_code(status: &ExitStatus) -> i32 {
    if let Some(code) = status.code() {
        return code;
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return 128 + signal;
        }
    }
    1
}

/// Whether `status` is that of a process ended by our own kill (`SIGKILL`).
fn ended_by_kill(status: &ExitStatus) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal() == Some(9)
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        true
    }
}

/// The error for the failed ranks, first failure first.
fn child_failed(failed: &[ChildExit]) -> Option<BootstrapError> {
    let (first, others) = failed.split_first()?;
    Some(BootstrapError::ChildFailed {
        rank: first.rank,
        pid: first.pid,
        status: first.status,
        exit_code: exit_code(&first.status),
        also_failed: others.to_vec(),
    })
}

/// A hook of [`LocalJob::on_failure`].
pub(super) type Hook = Box<dyn FnOnce(&BootstrapError) + Send>;

#[derive(Default)]
struct State {
    /// Rank 0 dropped the job: stop everything.
    stop_requested: bool,
    all_exited: bool,
    /// Ranks that failed on their own, in the order they were seen to end.
    failed: Vec<ChildExit>,
    /// Hooks still to run at the first failure.
    hooks: Vec<Hook>,
}

/// What the supervisor thread and the job's handle share: the ranks' failures, the hooks
/// still to run, and whether the job is over; `changed` wakes whoever waits on it.
#[derive(Default)]
struct Record {
    state: Mutex<State>,
    changed: Condvar,
}

impl Record {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn failure(&self) -> Option<BootstrapError> {
        child_failed(&self.lock().failed)
    }

    fn add_hook(&self, hook: Hook) {
        let mut state = self.lock();
        match child_failed(&state.failed) {
            Some(error) => {
                drop(state);
                run_hooks(vec![hook], &error);
            }
            None => state.hooks.push(hook),
        }
    }

    /// Records ranks that failed; at the first failure, runs the hooks.
    fn record_failures(&self, failed: Vec<ChildExit>) {
        if failed.is_empty() {
            return;
        }
        let mut state = self.lock();
        let first = state.failed.is_empty();
        state.failed.extend(failed);
        let hooks = std::mem::take(&mut state.hooks);
        let error = child_failed(&state.failed);
        drop(state);
        self.changed.notify_all();
        if let (true, Some(error)) = (first, error) {
            run_hooks(hooks, &error);
        }
    }
}

/// Runs failure hooks, containing their panics: the watching thread must go on to reap the
/// ranks.
fn run_hooks(hooks: Vec<Hook>, error: &BootstrapError) {
    for hook in hooks {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(error)));
    }
}

impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("Record")
            .field("failed", &state.failed)
            .field("all_exited", &state.all_exited)
            .finish_non_exhaustive()
    }
}

/// Watches the spawned ranks from a background thread.
#[derive(Debug)]
pub(super) struct Supervisor {
    record: Arc<Record>,
    thread: Option<JoinHandle<()>>,
    count: usize,
}

impl Supervisor {
    /// Starts watching `children`; if no thread can be started, stops them and fails.
    pub(super) fn start(children: Vec<(usize, Child)>) -> Result<Self> {
        let record = Arc::new(Record::default());
        let count = children.len();
        let watcher = Arc::clone(&record);
        // The children move into the thread only once it runs; keep them here until then.
        let handoff = Arc::new(Mutex::new(Some(children)));
        let taken = Arc::clone(&handoff);
        let spawned = thread::Builder::new()
            .name("nccl-rs-local-ranks".to_owned())
            .spawn(move || {
                let children = lock(&taken).take().unwrap_or_default();
                supervise(&watcher, children);
            });
        match spawned {
            Ok(thread) => Ok(Supervisor {
                record,
                thread: Some(thread),
                count,
            }),
            Err(e) => {
                let mut children = lock(&handoff).take().unwrap_or_default();
                stop_all(&mut children);
                Err(io_error(
                    "starting the thread that watches the local ranks",
                    e,
                ))
            }
        }
    }

    /// The number of ranks watched.
    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// The failure of the ranks so far, if any.
    pub(super) fn failure(&self) -> Option<BootstrapError> {
        self.record.failure()
    }

    /// Runs `hook` at the first failure (at once if there was one).
    pub(super) fn on_failure(&self, hook: Hook) {
        self.record.add_hook(hook);
    }

    /// Ends a wait as soon as a rank has failed, with that failure.
    pub(super) fn interrupt(&self) -> Interrupt {
        let record = Arc::clone(&self.record);
        Interrupt::new(move || record.failure())
    }

    /// Waits until every rank has exited; fails if one failed.
    pub(super) fn wait(mut self) -> Result<()> {
        {
            let mut state = self.record.lock();
            while !state.all_exited {
                state = wait_for(&self.record.changed, state, None);
            }
        }
        self.join();
        self.record.failure().map_or(Ok(()), Err)
    }

    /// Stops and reaps every rank.
    pub(super) fn stop(mut self) {
        self.record.lock().stop_requested = true;
        self.record.changed.notify_all();
        self.join();
    }

    fn join(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Kills every child and reaps it; returns the exits that were failures of their own (a
/// child that ended unsuccessfully before the kill reached it).
pub(super) fn stop_all(children: &mut Vec<(usize, Child)>) -> Vec<ChildExit> {
    for (_, child) in children.iter_mut() {
        let _ = child.kill();
    }
    let mut failed = Vec::new();
    for (rank, mut child) in children.drain(..) {
        if let Ok(status) = child.wait() {
            if !status.success() && !ended_by_kill(&status) {
                failed.push(ChildExit {
                    rank,
                    pid: child.id(),
                    status,
                });
            }
        }
    }
    failed
}

/// Reaps the children that have exited; returns those that failed.
fn reap_exited(children: &mut Vec<(usize, Child)>) -> Vec<ChildExit> {
    let mut failed = Vec::new();
    let mut index = 0;
    while index < children.len() {
        let (rank, child) = &mut children[index];
        let status = match child.try_wait() {
            Ok(status) => status,
            // The child can no longer be watched: stop it rather than lose track of it.
            Err(_) => {
                let _ = child.kill();
                child.wait().ok()
            }
        };
        let Some(status) = status else {
            index += 1;
            continue;
        };
        if !status.success() {
            failed.push(ChildExit {
                rank: *rank,
                pid: child.id(),
                status,
            });
        }
        children.swap_remove(index);
    }
    failed
}

/// The watching thread: reaps children as they exit; at the first failure, records it, runs
/// the hooks and stops the others; at rank 0's request, stops them all.
fn supervise(record: &Record, mut children: Vec<(usize, Child)>) {
    while !children.is_empty() {
        let failed = reap_exited(&mut children);
        let failing = !failed.is_empty();
        record.record_failures(failed);
        if failing {
            record.record_failures(stop_all(&mut children));
        }
        if record.lock().stop_requested {
            stop_all(&mut children);
        }
        if children.is_empty() {
            break;
        }
        // Sleep until the next look, waking early when rank 0 drops the job.
        let state = record.lock();
        if !state.stop_requested {
            drop(wait_for(&record.changed, state, Some(SUPERVISION_PERIOD)));
        }
    }
    record.lock().all_exited = true;
    record.changed.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn sh(script: &str) -> Child {
        Command::new("sh")
            .args(["-c", script])
            .spawn()
            .expect("spawn sh")
    }

    #[test]
    fn stopping_lists_own_failures_but_not_the_ranks_it_killed() {
        let mut children = vec![
            (1, sh("exit 3")),
            (2, sh("sleep 30")),
            (3, sh("exit 0")),
            (4, sh("exit 5")),
        ];
        // Let the short ones end (unreaped) before the kill.
        thread::sleep(Duration::from_millis(300));
        let failed = stop_all(&mut children);
        assert!(children.is_empty());
        let ranks: Vec<(usize, i32)> = failed
            .iter()
            .map(|exit| (exit.rank, exit_code(&exit.status)))
            .collect();
        assert_eq!(ranks, vec![(1, 3), (4, 5)]);
    }

    #[test]
    fn reaping_reports_failed_children_and_keeps_running_ones() {
        let mut children = vec![(1, sh("exit 4")), (2, sh("sleep 30")), (3, sh("exit 0"))];
        thread::sleep(Duration::from_millis(300));
        let failed = reap_exited(&mut children);
        assert_eq!(failed.len(), 1);
        assert_eq!((failed[0].rank, exit_code(&failed[0].status)), (1, 4));
        assert_eq!(children.len(), 1);
        assert_eq!(children[0].0, 2);
        assert!(stop_all(&mut children).is_empty());
    }

    #[test]
    fn failures_run_hooks_once_and_late_hooks_at_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let record = Record::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&calls);
        record.add_hook(Box::new(move |error| {
            assert!(error.to_string().contains("local rank 2"), "{error}");
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        record.add_hook(Box::new(|_| panic!("a panicking hook is contained")));
        assert!(record.failure().is_none());
        let status = Command::new("sh")
            .args(["-c", "exit 7"])
            .status()
            .expect("sh");
        record.record_failures(vec![ChildExit {
            rank: 2,
            pid: 1,
            status,
        }]);
        record.record_failures(vec![ChildExit {
            rank: 1,
            pid: 2,
            status,
        }]);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let error = record.failure().expect("failure recorded");
        assert!(
            matches!(
                &error,
                BootstrapError::ChildFailed { rank: 2, exit_code: 7, also_failed, .. }
                    if also_failed.len() == 1 && also_failed[0].rank == 1
            ),
            "{error:?}"
        );
        assert!(
            error.to_string().contains("failed too: local rank 1"),
            "{error}"
        );
        let counter = Arc::clone(&calls);
        record.add_hook(Box::new(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn exit_codes() {
        let ok = Command::new("sh").args(["-c", "exit 3"]).status();
        if let Ok(status) = ok {
            assert_eq!(exit_code(&status), 3);
        }
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(exit_code(&ExitStatus::from_raw(9)), 128 + 9);
        }
    }
}
