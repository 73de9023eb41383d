//! Stopping an instance's kernels before its communicator is aborted: NCCL's abort unmaps the
//! peers' scratch that the kernels store to and read from, and stops only NCCL's own kernels.
//! The abort (from an [`AbortHandle`](crate::AbortHandle) or a [`Watchdog`](crate::Watchdog),
//! under the communicator's lock) first sets the instance's `timed_out` word on the device:
//! a kernel that starts after it returns at once, and a waiting one sees it within 1 024
//! spins and returns without touching a peer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::comm::{Comm, KernelStop};
use crate::error::Result;

/// How long a stop waits for its word to be written (its own stream, which nothing else uses).
const WRITE_WAIT: Duration = Duration::from_secs(1);
/// How long it then leaves running kernels to see the word and return (they look every 1 024
/// spins of a wait, microseconds apart).
const NOTICE: Duration = Duration::from_millis(10);
/// Byte offset of `timed_out` in the kernels' `State` (see `allreduce.cu`).
const TIMED_OUT_OFFSET: u64 = 48;

/// What an abort runs for one instance.
struct Stopper {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The communicator's stream, on which the state is freed: made to wait for the write, so
    /// a write the GPU runs late never lands in freed memory.
    comm_stream: Arc<CudaStream>,
    /// Device address of the instance's `State::timed_out`.
    timed_out: u64,
}

impl KernelStop for Stopper {
    fn stop(&self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: `timed_out` is a 4-byte word inside the instance's state, which is freed
        // only after the instance unregisters this stopper under the communicator's lock,
        // held by our caller; `stream` belongs to the stopper and to this context.
        let rc = unsafe { sys::cuMemsetD32Async(self.timed_out, 1, 1, self.stream.cu_stream()) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return;
        }
        // The state is freed on the communicator's stream once the instance is dropped, which
        // may be before the GPU runs this write (its wait below is bounded): order the free
        // after it. Without the event the write is waited for in full instead.
        match self.stream.record_event(None) {
            Ok(written) => {
                let _ = self.comm_stream.wait(&written);
            }
            Err(_) => {
                let _ = self.stream.synchronize();
            }
        }
        let start = Instant::now();
        loop {
            // SAFETY: a live stream of this context.
            match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
                sys::CUresult::CUDA_SUCCESS => break,
                sys::CUresult::CUDA_ERROR_NOT_READY if start.elapsed() < WRITE_WAIT => {
                    std::thread::sleep(Duration::from_micros(50));
                }
                _ => return,
            }
        }
        std::thread::sleep(NOTICE);
    }
}

/// An instance's stopper, registered on its communicator until dropped (first of the
/// instance's fields, before the state the stopper writes is freed).
pub(super) struct Registration<'c> {
    comm: &'c Comm,
    id: usize,
}

impl<'c> Registration<'c> {
    /// Registers a stopper for the kernels whose state starts at device address `state`.
    pub(super) fn new(comm: &'c Comm, state: u64) -> Result<Self> {
        static NEXT: AtomicUsize = AtomicUsize::new(1);
        let ctx = comm.context().clone();
        let stream = ctx.new_stream()?;
        let comm_stream = comm.stream().clone();
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        comm.register_kernel_stop(
            id,
            Arc::new(Stopper {
                ctx,
                stream,
                comm_stream,
                timed_out: state + TIMED_OUT_OFFSET,
            }),
        );
        Ok(Self { comm, id })
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.comm.unregister_kernel_stop(self.id);
    }
}
