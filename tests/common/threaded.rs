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

/// Copies between the host and a rank's GPU through page-locked memory, for ranks that are
/// threads of one process.
///
/// Two ranks of one process on one GPU share one CUDA context, and a copy from or to pageable
/// host memory goes through that context's staging buffer. A rank whose pageable
/// device-to-host copy waits for its own kernel (a kernel that waits for the other rank)
/// holds the staging buffer, so the other rank's pageable host-to-device copy, and with it
/// that rank's launch, waits too: both sit until a kernel gives up (seen with `LsaAllReduce`
/// on one H100: one rank's kernel started only after its peer's had timed out). Page-locked
/// copies are plain DMA on the rank's own stream and need no staging buffer.
pub struct Staging<T> {
    host: cudarc::driver::PinnedHostSlice<T>,
    stream: Arc<CudaStream>,
}

impl<T> Drop for Staging<T> {
    fn drop(&mut self) {
        // A copy still queued reads the room: it ends before the room is freed (a test that
        // panics between an upload and its download drops this too).
        let _ = self.stream.synchronize();
    }
}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy> Staging<T> {
    /// Page-locked room for `len` elements, for copies on `stream`. Made before any kernel
    /// that waits for another rank is launched: allocating may wait for the GPU.
    pub fn new(stream: &Arc<CudaStream>, len: usize) -> Self {
        // SAFETY: the memory is zeroed below, through a raw pointer, before any reference to
        // it is made; flags 0: cached (not write-combined), since the host reads it back.
        let mut host = unsafe { stream.context().alloc_pinned_with_flags::<T>(len.max(1), 0) }
            .expect("page-locked host memory");
        let ptr = host.as_mut_ptr().expect("page-locked memory idle");
        // SAFETY: `ptr` holds `len.max(1)` elements of T, for which all-zero bits are valid.
        unsafe { std::ptr::write_bytes(ptr, 0, len.max(1)) };
        Staging {
            host,
            stream: stream.clone(),
        }
    }

    /// Copies `src` into `dst` (at least as long) on the stream; returns once enqueued.
    pub fn upload(&mut self, src: &[T], dst: &mut impl cudarc::driver::DevicePtrMut<T>) {
        assert!(src.len() <= self.host.len() && src.len() <= dst.len());
        // The previous copy through this room is done before the room is written again.
        self.stream.synchronize().expect("stream");
        let room = self.host.as_mut_slice().expect("page-locked memory idle");
        room[..src.len()].copy_from_slice(src);
        let (ptr, _written) = dst.device_ptr_mut(&self.stream);
        // SAFETY: `room[..src.len()]` is page-locked host memory owned by `self`, left
        // untouched until the stream is synchronised (here or in `download`); `ptr` holds at
        // least `src.len()` elements, ordered on this stream by its guard.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                ptr,
                &room[..src.len()],
                self.stream.cu_stream(),
            )
        }
        .expect("host-to-device copy");
    }

    /// `src` copied to the host, once the stream's work so far is done.
    pub fn download(&mut self, src: &impl cudarc::driver::DevicePtr<T>) -> Vec<T> {
        let n = src.len();
        assert!(n <= self.host.len());
        self.stream.synchronize().expect("stream");
        let room = self.host.as_mut_slice().expect("page-locked memory idle");
        {
            let (ptr, _read) = src.device_ptr(&self.stream);
            // SAFETY: `room[..n]` is page-locked host memory owned by `self`, read only after
            // the synchronisation below; `ptr` holds `n` elements, ordered by its guard.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut room[..n],
                    ptr,
                    self.stream.cu_stream(),
                )
            }
            .expect("device-to-host copy");
        }
        self.stream.synchronize().expect("stream");
        room[..n].to_vec()
    }
}
