//! Stopping an instance's kernels before anything lets go of what they use: NCCL's abort,
//! revoke and shrink-abort (which unmap the peers' scratch, or wait for the stream work queued
//! before NCCL's last kernel, and stop only NCCL's own kernels), and the instance's own drop.
//!
//! # The invariant
//!
//! An instance's stop is registered on its communicator (`State::kernel_stops`) from its
//! creation until the instance knows that none of its kernels can still run. Whoever lets go
//! of the mappings or the memory the kernels use runs the stop first: the communicator's
//! `State::stop_kernels`, under its lock, on every abort (the owner's, a drop's, an
//! [`AbortHandle`](crate::AbortHandle)'s, a [`Watchdog`](crate::Watchdog)'s), revoke and
//! shrink with [`ShrinkMode::Abort`](crate::ShrinkMode::Abort) (so also `recover`); and the
//! instance's drop, which first gives its kernels [`Comm::drop_timeout`] to end on their own,
//! then runs its stop under the same lock ([`Registration::stop_now`]). A stop sets the
//! instance's `timed_out` word on the device: a kernel that starts afterwards returns at once
//! (writing NaN over its output, touching no peer), and a waiting one sees it within 1 024
//! spins and returns the same way. The memory the stop writes and the kernels read (the
//! state, the host-mapped `gave_up` word) outlives the registration: a dropped instance
//! whose kernels did not end leaks it rather than free it under them.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::comm::{Comm, KernelStop};

/// How long a stop waits for its word to be written (its own stream, which nothing else uses).
const WRITE_WAIT: Duration = Duration::from_secs(1);

/// What a stop runs for one instance.
struct Stopper {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The communicator's stream, on which the state is freed: made to wait for the write, so
    /// a write the GPU runs late never lands in freed memory.
    comm_stream: Arc<CudaStream>,
    /// Device address of the instance's `timed_out` word.
    timed_out: u64,
    /// Set, before the word is written, for the instance's host side: a stopped instance
    /// refuses every later call (its kernels would return at once, doing nothing), whether
    /// or not a kernel of it was running to notice.
    stopped: Arc<AtomicBool>,
    /// The instance's number in the communicator's flight recorder.
    flight_instance: Option<u32>,
}

impl KernelStop for Stopper {
    fn flight_instance(&self) -> Option<u32> {
        self.flight_instance
    }

    fn signal(&self) -> bool {
        self.stopped.store(true, Ordering::Release);
        if self.ctx.bind_to_thread().is_err() {
            return false;
        }
        // SAFETY: `timed_out` is a 4-byte word inside the instance's state, which lives as
        // long as this stopper is registered (the invariant above; our caller holds the
        // communicator's lock, under which it is unregistered); `stream` belongs to the
        // stopper and to this context.
        let rc = unsafe { sys::cuMemsetD32Async(self.timed_out, 1, 1, self.stream.cu_stream()) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return false;
        }
        // The state is freed on the communicator's stream, which may be before the GPU runs
        // this write (its wait below is bounded): order the free after it. Without the event
        // the stop counts as unwritten (its owner then leaks the state).
        match self.stream.record_event(None) {
            Ok(written) if self.comm_stream.wait(&written).is_ok() => {}
            _ => return false,
        }
        let start = Instant::now();
        loop {
            // SAFETY: a live stream of this context.
            match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
                sys::CUresult::CUDA_SUCCESS => return true,
                sys::CUresult::CUDA_ERROR_NOT_READY if start.elapsed() < WRITE_WAIT => {
                    std::thread::sleep(Duration::from_micros(50));
                }
                _ => return false,
            }
        }
    }
}

/// An instance's stopper, registered on its communicator while the instance's kernels may
/// run (see the invariant above).
pub(in crate::device) struct Registration<'c> {
    comm: &'c Comm,
    id: usize,
}

impl<'c> Registration<'c> {
    /// Registers a stopper for the kernels that watch the 4-byte word at device address
    /// `timed_out`, a word of their state (`KernelState::timed_out` for the all-reduce's;
    /// another kernel family reuses the stop with its own): the stop sets it to 1 on `stream`
    /// (made before the ranks' agreement: making a stream can wait for the whole context)
    /// and sets `stopped` for the instance. The word stays allocated while the stopper is
    /// registered (the invariant above).
    pub(in crate::device) fn new(
        comm: &'c Comm,
        timed_out: u64,
        stream: Arc<CudaStream>,
        stopped: Arc<AtomicBool>,
        flight_instance: Option<u32>,
    ) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(1);
        let ctx = comm.context().clone();
        let comm_stream = comm.stream().clone();
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        comm.register_kernel_stop(
            id,
            Arc::new(Stopper {
                ctx,
                stream,
                comm_stream,
                timed_out,
                stopped,
                flight_instance,
            }),
        );
        Self { comm, id }
    }

    /// Runs this instance's stop now, under the communicator's lock, and gives running
    /// kernels the notice: `true` once its word is written, by this call or by an abort or
    /// revoke before it (which took the stop out), `false` if it could not be (the stop then
    /// stays registered, for the next abort to try again).
    pub(in crate::device) fn stop_now(&self) -> bool {
        self.comm.run_kernel_stop(self.id)
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.comm.unregister_kernel_stop(self.id);
    }
}

/// How long a drop waits for its kernels to return once their stop is written (they return
/// within microseconds once they run; a kernel queued behind work that never ends does not).
pub(in crate::device) const AFTER_STOP: Duration = Duration::from_secs(1);

/// Whether everything enqueued on `comm`'s stream so far (every kernel an instance launched
/// on it among it) ends within `limit`; `false` where that cannot be known. What a drop asks
/// before it frees what its kernels use.
pub(in crate::device) fn stream_work_ends_within(comm: &Comm, limit: Duration) -> bool {
    if comm.context().bind_to_thread().is_err() {
        return false;
    }
    let Ok(done) = comm.stream().record_event(None) else {
        return false;
    };
    let start = Instant::now();
    loop {
        match done.try_is_complete() {
            Ok(true) => return true,
            Ok(false) if start.elapsed() < limit => {
                std::thread::sleep(Duration::from_micros(200));
            }
            _ => return false,
        }
    }
}
