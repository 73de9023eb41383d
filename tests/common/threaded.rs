//! GPU tests that run every rank as a thread of one process: the communicators made one per
//! thread, each rank's work on its own thread, multicast off, and a deadline that ends a hung
//! test instead of the whole run hanging.

use std::sync::{mpsc, Arc, Barrier};
use std::time::Duration;

use cudarc::driver::CudaStream;
use nccl::{Comm, CommConfig, UniqueId};

/// Multicast (NVLS) stays off in anything that launches NCCL (the runner sets it too), and
/// GPU 0 may hold two ranks where the threaded tests put two there (see `shape`).
pub fn nvls_off() {
    super::shape::setup();
}

/// The GPU of each rank of the threaded tests: one GPU each where there are 2+, else GPU 0
/// twice (NCCL 2.30+); see [`super::shape::threaded`].
pub fn devices() -> Vec<usize> {
    super::shape::threaded_devices()
}

/// The start of a threaded GPU test: `None` (the test then passes, having said why, and the
/// suite's summary lists it as skipped) where its ranks cannot run here, else the
/// [`Deadline`] that ends it if it hangs past `limit`.
pub fn gpu_test(test: &'static str, limit: Duration) -> Option<Deadline> {
    super::shape::threaded(test)?;
    Some(Deadline::new(test, limit))
}

/// Aborts the whole process, saying which test hung, unless dropped within `limit`: a rank
/// that fails while its peers wait in a collective would otherwise hang the run.
pub struct Deadline(Option<mpsc::Sender<()>>);

impl Deadline {
    pub fn new(test: &'static str, limit: Duration) -> Self {
        let (tx, rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                eprintln!(
                    "{test}: no result after {limit:?}; a rank probably failed while its peers \
                     wait in a collective (see the panics above). Aborting the process."
                );
                std::process::abort();
            }
        });
        Deadline(Some(tx))
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// One communicator per stream (stream `i` for rank `i`), each created by its own thread with
/// `config` (a blocking init waits for every rank, so they cannot be made one after another).
pub fn init_threaded(streams: Vec<Arc<CudaStream>>, config: &CommConfig) -> Vec<Comm> {
    let n = streams.len();
    let id = UniqueId::new().expect("ncclGetUniqueId");
    std::thread::scope(|s| {
        let handles: Vec<_> = streams
            .into_iter()
            .enumerate()
            .map(|(rank, stream)| {
                let id = &id;
                s.spawn(move || {
                    Comm::init_rank_with_config(stream, id, rank, n, config)
                        .unwrap_or_else(|e| panic!("rank {rank}: init: {e}"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs `f` for every rank, each on its own thread owning its communicator.
pub fn per_rank<R: Send>(comms: Vec<Comm>, f: impl Fn(Comm, &Barrier) -> R + Sync) -> Vec<R> {
    let barrier = Barrier::new(comms.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (f, barrier) = (&f, &barrier);
                s.spawn(move || f(comm, barrier))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
