//! Releases (destroys and aborts) that outlived the call which started them: each runs on a
//! thread of its own and is registered until NCCL returns, so a process can list them
//! ([`Comm::releases_in_flight`]) and wait for them ([`Comm::wait_for_releases`]), e.g.
//! before it exits.
//!
//! Why a destroy cannot be aborted instead: NCCL forbids `ncclCommAbort` on a communicator
//! that another thread is destroying, and `ncclCommDestroy` frees the handle as it returns,
//! so once the destroy has the handle nothing may touch it again (2.28 to 2.32 `src/init.cc`).
//! What makes that acceptable: a drop hands a communicator to the destroy only once every
//! kernel of it has finished, on its own stream and on every other stream its operations ran
//! on (see `streams.rs`); whatever is left for NCCL is host-side:
//!
//! * the network proxy draining the sends of collectives that already completed on this
//!   rank (a peer host that vanished without a reset holds it until TCP gives up);
//! * ranks of this node connected to this rank's proxy ending the communicator too (the
//!   proxy service thread runs while local peers are connected, `ncclProxyService` in
//!   `src/proxy.cc`, and the destroy joins it);
//! * CUDA graphs that captured the communicator's operations (`commDestroySync` polls until
//!   `localPersistentRefs` is zero, which only the destruction of every such graph and its
//!   instances brings);
//! * with several ranks of the communicator in one process, the last rank to end it does
//!   the others' cleanup too (`commReclaim`), so it waits for their graphs as well.
//!
//! An abort waits for the last two as well: `ncclCommAbort` first sets the abort flags every
//! kernel of the communicator watches (so its kernels stop, on every stream, graph launches
//! included), then reclaims, and a graph that captured the communicator holds the reclaim
//! until the graph is destroyed. The graph's owner is often the very thread that aborts (or
//! one waiting for the aborting thread, or for the communicator's lock that an abort holds),
//! so an abort that waited for it would never return. So every abort runs on a thread of its
//! own and is waited for [`ABORT_WAIT`], which an abort with no graph to wait for stays well
//! within; past it the abort goes on there, its kernels already stopped, and the caller goes
//! on.
//!
//! A release still running holds a thread and NCCL's host resources, not a kernel of the
//! communicator's operations. The exception is work captured into a CUDA graph, which the
//! communicator cannot see: a graph that captured it keeps a destroy waiting until the
//! graph is destroyed, and a launch of it whose kernel never ends could only have been
//! stopped by an abort before the destroy began.

use std::sync::Arc;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use nccl_sys::ncclComm_t;

use super::Comm;
use crate::calls;
use crate::diagnostics::flight::Who;
use crate::error::{Error, Result};
use crate::library::Library;

/// How long an abort is waited for before it is left to go on on its thread (see the
/// [module docs](self)): `ncclCommAbort` with no CUDA graph to wait for returns within
/// milliseconds, and its first act, setting the flags its kernels watch, within
/// microseconds of the call.
pub(crate) const ABORT_WAIT: Duration = Duration::from_secs(1);

/// [`ABORT_WAIT`] for a communicator with a nonblocking call still in progress: NCCL's abort
/// joins that call's job (which may still be enqueuing kernels on the caller's streams)
/// before it waits for graphs, and the job leaves at once on the abort's flags, so the
/// abort is waited for until past the join wherever that takes less than this.
pub(crate) const ABORT_WAIT_IN_PROGRESS: Duration = Duration::from_secs(10);

/// How a communicator is being released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Release {
    /// `ncclCommDestroy`, a drop's orderly end (`ncclCommAbort` if NCCL refuses it).
    Destroy,
    /// `ncclCommAbort`.
    Abort,
}

/// A release (destroy or abort) that runs on a thread of its own and that NCCL has not
/// finished yet ([`Comm::releases_in_flight`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseInFlight {
    /// Destroy or abort.
    pub release: Release,
    /// The communicator's rank.
    pub rank: usize,
    /// Its number of ranks.
    pub size: usize,
    /// Its CUDA device.
    pub device: usize,
    /// When the release started.
    pub since: Instant,
}

impl std::fmt::Display for ReleaseInFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let doing = match self.release {
            Release::Destroy => "destroying",
            Release::Abort => "aborting",
        };
        write!(
            f,
            "rank {} of {} on device {}, {doing} for {:.1?}",
            self.rank,
            self.size,
            self.device,
            self.since.elapsed()
        )
    }
}

/// The releases in flight, each with the number its [`Registration`] removes it by.
struct Registry {
    next: u64,
    running: Vec<(u64, ReleaseInFlight)>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    next: 0,
    running: Vec::new(),
});
/// Signalled whenever a release finishes.
static FINISHED: Condvar = Condvar::new();

/// The registry; a thread that panicked while holding it left it consistent (every change
/// is one push or one removal).
fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A release's place in the registry, from before its thread starts until NCCL returned (or
/// the thread could not start): dropping it removes the release.
struct Registration(u64);

impl Registration {
    fn new(who: &Who, release: Release) -> Self {
        let mut registry = registry();
        let id = registry.next;
        registry.next += 1;
        registry.running.push((
            id,
            ReleaseInFlight {
                release,
                rank: who.rank,
                size: who.size,
                device: who.device,
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

/// A raw handle moving to the thread that releases it.
struct OwnedHandle(ncclComm_t);

// SAFETY: the handle is taken out of its communicator's state before it moves, so exactly one
// thread uses it, and NCCL allows a communicator to be ended from any thread.
unsafe impl Send for OwnedHandle {}

impl OwnedHandle {
    fn into_raw(self) -> ncclComm_t {
        self.0
    }
}

/// `release` of `raw` (taken out of its communicator's state, so no other call can use it)
/// on a thread of its own, listed in flight until NCCL returns; waits for it for at most
/// `limit` once that thread runs. NCCL's result if it returned by then, `None` if it goes on
/// there. Where no thread can be started, aborts it here.
pub(crate) fn release_on_thread(
    lib: &'static Library,
    ctx: &Arc<CudaContext>,
    who: &Who,
    release: Release,
    raw: ncclComm_t,
    limit: Duration,
) -> Option<Result<()>> {
    let handle = OwnedHandle(raw);
    let owned_ctx = ctx.clone();
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Result<()>>();
    let registration = Registration::new(who, release);
    let spawned = std::thread::Builder::new()
        .name(format!("nccl-rs release rank {}", who.rank))
        .spawn(move || {
            let _registration = registration;
            let raw = handle.into_raw();
            // Best effort: NCCL finds its device itself, but its cleanup may use the current
            // context.
            let _ = owned_ctx.bind_to_thread();
            let _ = started_tx.send(());
            let result = release_now(lib, raw, release);
            let _ = done_tx.send(result);
        });
    match spawned {
        Ok(_) => {
            // The limit counts from the thread's start: an abort's flags are set at once
            // then, whatever it waits for afterwards.
            let _ = started_rx.recv();
            done_rx.recv_timeout(limit).ok()
        }
        // No thread: the closure (and the registration) was dropped unrun, so the handle is
        // still only ours. Aborted here whatever was asked: a destroy may wait for peers
        // without bound, an abort does not.
        Err(_) => {
            let _ = ctx.bind_to_thread();
            Some(release_now(lib, raw, Release::Abort))
        }
    }
}

/// `release` of `raw`, which the caller alone holds, in NCCL.
fn release_now(lib: &Library, raw: ncclComm_t, release: Release) -> Result<()> {
    match release {
        Release::Destroy => {
            // SAFETY: the caller alone holds the handle (taken out of its state); a drop
            // hands it over only once its work is complete (every stream it used was
            // waited for).
            let status = unsafe { lib.api().ncclCommDestroy(raw) };
            let destroyed = lib.check(calls::ncclCommDestroy.name, status);
            if destroyed.is_err() {
                // A refused destroy leaves the handle allocated: free it the other way.
                // SAFETY: as above; NCCL did not free it.
                let _ = unsafe { lib.api().ncclCommAbort(raw) };
            }
            destroyed
        }
        Release::Abort => {
            // SAFETY: the caller alone holds the handle (taken out of its state under its
            // lock); NCCL allows ending a communicator from any thread.
            let status = unsafe { lib.api().ncclCommAbort(raw) };
            lib.check(calls::ncclCommAbort.name, status)
        }
    }
}

impl Comm {
    /// The releases of communicators of this process that run on threads of their own and
    /// that NCCL has not finished yet; see the [module docs](super#end-of-life): destroys a
    /// drop handed over past its timeout, and aborts that went on past their wait (1 s)
    /// because CUDA graphs that captured the communicator are still alive. What they wait
    /// for is host-side (their kernels finished, or were stopped by the abort's flags): the
    /// network proxy's last sends, ranks of this node ending the communicator too, CUDA
    /// graphs that captured it. A destroy cannot be aborted (NCCL forbids aborting a
    /// communicator being destroyed).
    pub fn releases_in_flight() -> Vec<ReleaseInFlight> {
        registry()
            .running
            .iter()
            .map(|(_, release)| release.clone())
            .collect()
    }

    /// Waits until no release is in flight ([`Comm::releases_in_flight`]), for at most
    /// `timeout`: for a process that wants NCCL's teardown done before it exits (destroy the
    /// CUDA graphs that captured its communicators first). [`Error::Timeout`], naming those
    /// still running, where some are.
    pub fn wait_for_releases(timeout: Duration) -> Result<()> {
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
                    .map(|(_, release)| release.to_string())
                    .collect();
                return Err(Error::Timeout {
                    what: format!(
                        "{} communicator release(s) running on threads of their own to finish ({})",
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
    // each other's releases.
    #[test]
    fn releases_are_listed_and_waited_for_until_they_finish() {
        assert!(Comm::wait_for_releases(Duration::ZERO).is_ok(), "none yet");
        let who = |rank, device| Who {
            rank,
            size: 2,
            device,
        };
        let first = Registration::new(&who(0, 0), Release::Destroy);
        let second = Registration::new(&who(1, 1), Release::Abort);
        let listed = Comm::releases_in_flight();
        assert_eq!(listed.len(), 2);
        assert_eq!((listed[0].rank, listed[0].device), (0, 0));
        assert_eq!((listed[1].rank, listed[1].size), (1, 2));
        assert_eq!(listed[1].release, Release::Abort);
        assert!(listed[0]
            .to_string()
            .starts_with("rank 0 of 2 on device 0, destroying"));
        assert!(listed[1]
            .to_string()
            .starts_with("rank 1 of 2 on device 1, aborting"));
        // Still running: the wait times out and names them.
        match Comm::wait_for_releases(Duration::from_millis(20)) {
            Err(Error::Timeout { what, waited }) => {
                assert!(what.starts_with("2 communicator release(s)"), "{what}");
                assert!(what.contains("rank 0 of 2 on device 0"), "{what}");
                assert!(waited >= Duration::from_millis(20));
            }
            other => panic!("{other:?}"),
        }
        drop(first);
        assert_eq!(Comm::releases_in_flight().len(), 1);
        // One finishing on another thread ends a wait in progress.
        let finisher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(second);
        });
        let start = Instant::now();
        Comm::wait_for_releases(Duration::from_secs(30)).expect("the last one finished");
        assert!(start.elapsed() < Duration::from_secs(10));
        finisher.join().unwrap();
        assert!(Comm::releases_in_flight().is_empty());
    }
}
