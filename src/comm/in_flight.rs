//! Destroys that outlived the drop which started them: each is registered until NCCL
//! returns, so a process can list them ([`Comm::destroys_in_flight`]) and wait for them
//! ([`Comm::wait_for_destroys`]), e.g. before it exits.
//!
//! Why they cannot be aborted instead: NCCL forbids `ncclCommAbort` on a communicator that
//! another thread is destroying, and `ncclCommDestroy` frees the handle as it returns, so
//! once the destroy has the handle nothing may touch it again (2.28 to 2.30.7
//! `src/init.cc`). What makes that acceptable: a drop hands a communicator to the destroy
//! only once every kernel of it has finished, on its own stream and on every other stream
//! its operations ran on (see `streams.rs`); whatever is left for NCCL is host-side:
//!
//! * the network proxy draining the sends of collectives that already completed on this
//!   rank (a peer host that vanished without a reset holds it until TCP gives up);
//! * ranks of this node connected to this rank's proxy ending the communicator too (the
//!   proxy service thread runs while local peers are connected, `ncclProxyService` in
//!   `src/proxy.cc`, and the destroy joins it);
//! * CUDA graphs that captured the communicator being destroyed (`commDestroySync` polls
//!   until `localPersistentRefs` is zero);
//! * with several ranks of the communicator in one process, the last rank to end it does
//!   the others' cleanup too (`commReclaim`).
//!
//! A destroy still running there holds a thread and NCCL's host resources, not a kernel of
//! the communicator's operations. The exception is work captured into a CUDA graph, which
//! the communicator cannot see: a graph that captured it keeps the destroy waiting until
//! the graph is destroyed, and a launch of it whose kernel never ends could only have been
//! stopped by an abort before the destroy began.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Comm;
use crate::error::{Error, Result};

/// A destroy that a dropped communicator handed to a thread of its own and that NCCL has not
/// finished yet ([`Comm::destroys_in_flight`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestroyInFlight {
    /// The communicator's rank.
    pub rank: usize,
    /// Its number of ranks.
    pub size: usize,
    /// Its CUDA device.
    pub device: usize,
    /// When the destroy started.
    pub since: Instant,
}

impl std::fmt::Display for DestroyInFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} of {} on device {}, destroying for {:.1?}",
            self.rank,
            self.size,
            self.device,
            self.since.elapsed()
        )
    }
}

/// The destroys in flight, each with the number its [`Registration`] removes it by.
struct Registry {
    next: u64,
    running: Vec<(u64, DestroyInFlight)>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    next: 0,
    running: Vec::new(),
});
/// Signalled whenever a destroy finishes.
static FINISHED: Condvar = Condvar::new();

/// The registry; a thread that panicked while holding it left it consistent (every change
/// is one push or one removal).
fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A destroy's place in the registry, from before its thread starts until NCCL returned (or
/// the thread could not start): dropping it removes the destroy.
pub(crate) struct Registration(u64);

impl Registration {
    pub(crate) fn new(rank: usize, size: usize, device: usize) -> Self {
        let mut registry = registry();
        let id = registry.next;
        registry.next += 1;
        registry.running.push((
            id,
            DestroyInFlight {
                rank,
                size,
                device,
                since: Instant::now(),
            },
        ));
        Registration(id)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        registry().running.retain(|(id, _)| *id != self.0);
        FINISHED.notify_all();
    }
}

impl Comm {
    /// The destroys that dropped communicators of this process handed to threads of their
    /// own and that NCCL has not finished yet; see the [module docs](super#end-of-life).
    /// They cannot be aborted (NCCL forbids aborting a communicator being destroyed); what
    /// they still wait for is host-side, since a drop destroys only once every kernel of
    /// the communicator has finished: the network proxy's last sends, ranks of this node
    /// ending the communicator too, CUDA graphs that captured it.
    pub fn destroys_in_flight() -> Vec<DestroyInFlight> {
        registry()
            .running
            .iter()
            .map(|(_, destroy)| destroy.clone())
            .collect()
    }

    /// Waits until no destroy is in flight ([`Comm::destroys_in_flight`]), for at most
    /// `timeout`: for a process that wants NCCL's teardown done before it exits.
    /// [`Error::Timeout`], naming those still running, where some are.
    pub fn wait_for_destroys(timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut registry = registry();
        loop {
            if registry.running.is_empty() {
                return Ok(());
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let running: Vec<String> = registry
                    .running
                    .iter()
                    .map(|(_, destroy)| destroy.to_string())
                    .collect();
                return Err(Error::Timeout {
                    what: format!(
                        "{} communicator destroy(s) handed over by a drop to finish ({})",
                        running.len(),
                        running.join("; ")
                    ),
                    waited: start.elapsed(),
                });
            }
            registry = FINISHED
                .wait_timeout(registry, left)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test, since the registry is the process's: tests running beside it would see
    // each other's destroys.
    #[test]
    fn destroys_are_listed_and_waited_for_until_they_finish() {
        assert!(Comm::wait_for_destroys(Duration::ZERO).is_ok(), "none yet");
        let first = Registration::new(0, 2, 0);
        let second = Registration::new(1, 2, 1);
        let listed = Comm::destroys_in_flight();
        assert_eq!(listed.len(), 2);
        assert_eq!((listed[0].rank, listed[0].device), (0, 0));
        assert_eq!((listed[1].rank, listed[1].size), (1, 2));
        assert!(listed[1].to_string().starts_with("rank 1 of 2 on device 1"));
        // Still running: the wait times out and names them.
        match Comm::wait_for_destroys(Duration::from_millis(20)) {
            Err(Error::Timeout { what, waited }) => {
                assert!(what.starts_with("2 communicator destroy(s)"), "{what}");
                assert!(what.contains("rank 0 of 2 on device 0"), "{what}");
                assert!(waited >= Duration::from_millis(20));
            }
            other => panic!("{other:?}"),
        }
        drop(first);
        assert_eq!(Comm::destroys_in_flight().len(), 1);
        // One finishing on another thread ends a wait in progress.
        let finisher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(second);
        });
        let start = Instant::now();
        Comm::wait_for_destroys(Duration::from_secs(30)).expect("the last one finished");
        assert!(start.elapsed() < Duration::from_secs(10));
        finisher.join().unwrap();
        assert!(Comm::destroys_in_flight().is_empty());
    }
}
