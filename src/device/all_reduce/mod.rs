//! [`LsaAllReduce`]: the all-reduce this crate ships as device code, for small messages
//! inside one LSA team (all ranks on one host's NVLink or one GPU), where NCCL's own kernels
//! spend most of their time on synchronisation.
//!
//! Past 600 lines on purpose: an instance's life (creation agreed on every rank, each
//! launch's checks and flight entry, the out-of-step state, the stop every owner path runs,
//! the drop) keeps one set of invariants on one lock, which this file states once; the
//! epilogue, the all-gather, the setup, the kernels' state, the stop word and the choice of
//! kernel have rooms of their own.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use parking_lot::MutexGuard;

use super::{shipped, DevComm, DevCommRequirements};
use crate::calls;
use crate::comm::state::State;
use crate::comm::{Comm, ContextId};
use crate::diagnostics::flight::{FlightRing, RawShipped, ShippedKernel};
use crate::dtype::NcclType;
use crate::error::{Error, Refusal, Result};
use crate::op::ReduceOp;
use crate::release::Version;
use crate::thread_group;
use crate::window::{Window, WindowFlags};

/// Threads per CTA of the shipped kernels.
const THREADS: u32 = 512;
/// The most CTAs a barrier or fused call runs (and the barrier inboxes per rank): few
/// enough that every CTA of every rank is resident at once, even two ranks on one GPU.
const MAX_CTAS: u32 = 16;
/// The most CTAs a one- or two-shot flags call runs: more memory traffic in flight for large
/// messages, and still every CTA of two ranks resident on one GPU (64 registers a thread:
/// two 512-thread CTAs an SM, 264 on an H100, 216 on an A100, against 128).
const FLAGS_MAX_CTAS: u32 = 64;
/// The smallest CTA of a flags kernel (for messages that fill fewer than [`FLAGS_MAX_CTAS`]
/// of them): a small message spread over more SMs, each storing less into the peers, ends
/// sooner (4×H100, one-shot at 4 ranks, f32: 4.38 µs at 8 KiB and 4.56 at 32 KiB in CTAs of
/// 128 threads, against 4.82 and 4.98 in CTAs of 512).
const FLAGS_MIN_THREADS: u32 = 128;
/// Bytes one thread moves per step.
const VECTOR: usize = 16;
/// The most 32-vector chunks of a row (`kMaxChunks`): 2 048 vectors.
const NORM_CHUNKS: usize = 64;
/// The barrier inboxes' bytes per rank: a 4-byte flag per CTA per peer.
const INBOX_BYTES: usize = MAX_CTAS as usize * 4;
/// The first NCCL whose device communicator the shipped kernels can read: the headers they
/// were compiled against.
const SINCE: Version = shipped::ABI.version();
/// How long a kernel waits for its peers by default.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

mod all_gather;
mod choice;
mod epilogue;
mod setup;
mod state;
mod stop;

use choice::{auto_choice, flags_grid, grid};
pub use epilogue::LsaEpilogue;
use setup::{agree, prepare};
pub(in crate::device) use setup::{HostWords, HOST_WORDS};
use state::KernelState;
pub(in crate::device) use stop::Registration as KernelStopRegistration;
pub(in crate::device) use stop::{stream_work_ends_within, AFTER_STOP};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// An element type the shipped all-reduce kernels sum: `f32`, [`half::bf16`], [`half::f16`].
pub trait LsaElem: NcclType + sealed::Sealed {
    /// The kernels' name suffix.
    #[doc(hidden)]
    const SUFFIX: &'static str;
    /// A 32-bit word of sentinels (the type's negative zero in every lane).
    #[doc(hidden)]
    const SENTINEL_WORD: u32;
}

impl LsaElem for f32 {
    const SUFFIX: &'static str = "f32";
    const SENTINEL_WORD: u32 = 0x8000_0000;
}
impl LsaElem for half::bf16 {
    const SUFFIX: &'static str = "bf16";
    const SENTINEL_WORD: u32 = 0x8000_8000;
}
impl LsaElem for half::f16 {
    const SUFFIX: &'static str = "f16";
    const SENTINEL_WORD: u32 = 0x8000_8000;
}

/// Which kernel an all-reduce of [`LsaAllReduce`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum LsaAlgorithm {
    /// Chosen by size ([`LsaAllReduce::choose`]).
    #[default]
    Auto,
    /// One-shot, no barrier: data written into the peers' scratch, sentinel-checked.
    OneShotFlags,
    /// One-shot with NCCL's LSA barrier.
    OneShotBarrier,
    /// Two-shot, no barrier: each rank sums a 1/ranks chunk (reduce-scatter) and writes the
    /// sum into every peer's scratch (all-gather), both sentinel-checked.
    TwoShotFlags,
    /// `ncclAllReduce` (sum) on the communicator.
    Nccl,
}

/// The all-reduce (sum) of the kernels this crate ships, for small messages on one
/// communicator whose ranks form one LSA team (one host's NVLink, or ranks sharing a GPU),
/// where NCCL's own kernels spend most of their time on synchronisation.
///
/// # Schemes
///
/// Every scheme sums in rank order, accumulating in `f32`, so every rank ends with the same
/// bits, and the same bits whichever scheme ran.
///
/// * [`LsaAlgorithm::OneShotFlags`]: each rank stores its input straight into every peer's
///   scratch slot; the receiver waits on its own slots until no element holds the sentinel
///   (negative zero; an input's negative zero is sent as +0, which sums the same). Three
///   scratch buffers rotate by call and each call clears the previous call's, so no barrier
///   is needed at all (the Lamport scheme TensorRT-LLM's and FlashInfer's one-shot kernels
///   use).
/// * [`LsaAlgorithm::TwoShotFlags`]: the message is cut into one chunk per rank; each rank
///   stores chunk j into rank j's scratch, rank j sums its chunk (waiting on the sentinel)
///   and stores the sum into every peer's scratch, where they wait for it. Each rank moves
///   its message twice in all instead of once per peer, at the cost of a second wait: for
///   larger messages at more ranks. The same buffers, rotation and clearing as the flags.
///   Its CTAs wait on each other's pushes, so every CTA of the grid (up to 64 of 512 threads)
///   must be resident at once, as the fused kernel's (16): where a GPU is shared with limits
///   (MPS thread percentages, green contexts, a kernel that keeps SMs busy) it times out
///   instead; force the one-shot or NCCL there.
/// * [`LsaAlgorithm::OneShotBarrier`]: each rank copies its input into its own scratch slot,
///   meets its peers at a barrier (NCCL's LSA barrier's scheme, flags in the scratch window,
///   with a timeout), and reads every peer's slot; two buffers alternate by call, so one
///   barrier a call suffices. Slower than the flags (2×H100: 6.5 µs against 3.0 at 8 B with
///   NCCL's own barrier); kept for data where the sentinel must not be assumed away.
///
/// [`LsaAlgorithm::Auto`] picks by message size (see [`LsaAllReduce::choose`]), and
/// [`LsaAlgorithm::Nccl`] calls `ncclAllReduce`, which [`Auto`](LsaAlgorithm::Auto) also
/// picks for large messages and past the scratch's size.
///
/// # What the ranks must keep alike, and failures
///
/// Peers never read or write the caller's buffers (only the scratch window this type owns),
/// so any device buffer of the communicator's context works, at any alignment, and the
/// borrow checker's rules for it are cudarc's. As with NCCL's collectives, every rank must
/// make the same calls in the same order with the same count and algorithm: the kernels of
/// one call wait for the peers' kernels of that call. Unlike NCCL's, a kernel whose peers
/// do not come gives up after [`LsaAllReduce::timeout`] (300 s unless set) instead of
/// spinning forever: its output is then wrong, and from then on the instance refuses every
/// call ([`Error::Timeout`], read from host-mapped memory without waiting for the GPU; a
/// kernel replayed from a CUDA graph returns at once, sending nothing, so its peers give up
/// too rather than take another call's data). Any refused call (a
/// [`Group`](crate::Group) open on the thread, a buffer of another context, a communicator
/// that failed, a count past [`max_count`](Self::max_count), lengths that differ, a failed
/// launch) puts the instance out of step on the rank that refused: no rank can know whether
/// its peers refused the same call or launched theirs, which would then wait for this
/// rank's, so it refuses every later call ([`Error::InvalidUsage`]) rather than pair with a
/// stale one, and the peers' kernels of a call they made alone give up. A caller that
/// refuses on its own after deciding to call (a framework's checks) says so with
/// [`put_out_of_step`](Self::put_out_of_step). After either, drop the instance on every
/// rank and make a new one.
///
/// A launch is refused once the communicator was aborted, destroyed, failed, revoked or
/// suspended. Nothing lets go of the instance's kernels before stopping them (the invariant
/// is written down in `src/device/all_reduce/stop.rs`): an abort (the owner's, an
/// [`AbortHandle`](crate::AbortHandle)'s, a [`Watchdog`](crate::Watchdog)'s, a dropped
/// communicator's), [`Comm::revoke`], [`Comm::shrink`] with
/// [`ShrinkMode::Abort`](crate::ShrinkMode::Abort) and [`Comm::recover`] first stop them,
/// running, queued or replayed from a graph (a device word they read when they start and
/// watch while they wait), give running ones 10 ms to return (measured ending well within
/// it; a kernel descheduled for longer could still touch a peer after NCCL's unmapping),
/// then let NCCL act; the instance refuses every later call. A stopped or failed call writes
/// NaN over its outputs (never stale memory).
///
/// Dropping the instance gives its kernels [`Comm::drop_timeout`] to end on their own (a
/// peer may be late to the last call), then stops them and gives them a second more: a
/// dropped instance leaves no kernel running that nothing can stop, whatever comes after it.
/// Kernels that still have not ended (queued behind work that never ends) keep their small
/// state, leaked; the scratch window and device communicator wait and leak as their own drops
/// say. The kernels' module stays loaded for the life of the process. A CUDA graph that
/// captured its calls must not be replayed after the instance is dropped. The shipped PTX
/// needs driver 580 or later (CUDA 13.0's PTX ISA 9.0) on GPUs other than sm_90.
///
/// The barrier kernel meets every peer of a team of any size; the flags kernels' scratch
/// grows with the team, and nothing else bounds it.
///
/// Two ranks driven by threads of one process on one GPU (the shared-GPU shape) keep their
/// calls in step: a rank's allocation or free there (creating an instance, dropping a refused
/// one) can wait for the GPU while the other rank's kernel or agreement spins on it waiting
/// for this rank; with one process per rank (the usual shape) nothing of the kind happens.
/// In that shape, read results back through page-locked memory (or after the stream is
/// synchronised): a thread waiting in a copy to pageable host memory for its rank's kernel
/// (which waits for the other rank) holds up the other thread's event waits in the same CUDA
/// context, [`check`](Self::check)'s and [`new`](Self::new)'s own included, so that rank
/// never launches its half and the
/// kernel times out (measured on driver 580: the other rank's event wait lasted until the
/// kernel gave up; page-locked read-backs leave it at microseconds). The instance then
/// refuses every later call with [`Error::Timeout`]; no result is wrong. nccl-rs's own
/// read-backs wait for the stream before copying.
///
/// Created collectively by every rank ([`LsaAllReduce::new`]); each owns a scratch window of
/// `(3 × ranks + 2)` slots of `max_count` elements and 16 bytes, a device communicator and
/// 7 KiB of state (each CTA's call counts, the fused kernel's partial sums).
/// Calls take `&mut self`: one at a time, in the same order on every rank.
pub struct LsaAllReduce<'c, T: LsaElem> {
    /// Taken back (or, if its kernels may still run and the stop could not be written, left
    /// registered) by `Drop`, before the memory it writes is freed (see `stop.rs`).
    stop: ManuallyDrop<stop::Registration<'c>>,
    comm: &'c Comm,
    // Dropped before the window and the state: a device communicator waits for the kernels
    // that took it.
    dev_comm: DevComm<'c>,
    flags: CudaFunction,
    twoshot: CudaFunction,
    all_gather: CudaFunction,
    barrier: CudaFunction,
    fused_norm: CudaFunction,
    add_norm: CudaFunction,
    scratch: Window<'c, u32>,
    /// Freed by `Drop` once the kernels ended, else leaked (they read it when they start).
    state: ManuallyDrop<CudaSlice<KernelState>>,
    /// As `state` (a kernel that gives up writes it).
    gave_up: ManuallyDrop<HostWords>,
    /// The threads of a barrier CTA, where a test set them ([`Self::set_barrier_threads`]).
    barrier_threads: Option<u32>,
    /// Set by the instance's stop (an abort, revoke, shrink with abort, or its drop): every
    /// later call is refused, even if no kernel was running to notice the stop.
    stopped: Arc<AtomicBool>,
    /// Its number in the communicator's flight recorder (`None`: the recorder is off).
    flight_instance: Option<u32>,
    /// Set when a call was refused on this rank alone after its peers may have gone ahead
    /// (another context, a group open, an unusable communicator): the instance is out of
    /// step, and every later call is refused.
    out_of_step: Option<String>,
    /// Bytes of one rank's slot of one buffer: `max_count` elements rounded up to 16, and one
    /// 16-byte vector more (a two-shot call's two chunks).
    slot_bytes: usize,
    max_count: usize,
    timeout: Duration,
    _elem: PhantomData<T>,
}

impl<T: LsaElem> std::fmt::Debug for LsaAllReduce<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LsaAllReduce")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("elem", &T::SUFFIX)
            .field("max_count", &self.max_count)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// A shipped kernel of the instance's scratch and call counter.
#[derive(Clone, Copy)]
enum Kernel {
    AllReduce(LsaAlgorithm),
    AllGather,
}

impl<'c, T: LsaElem> LsaAllReduce<'c, T> {
    /// Creates the all-reduce on `comm` for messages of up to `max_count` elements: every
    /// rank calls it, with the same `max_count`. Loads the shipped kernels (once per CUDA
    /// context), allocates and registers the scratch window, creates a device communicator.
    ///
    /// The ranks agree before anything collective: a rank that cannot take part (NCCL before
    /// 2.29.2, no device-API support, ranks in more than one LSA team, a GPU older than
    /// sm_80, an allocation that failed) returns its own error and every other rank
    /// [`Error::RankRefused`]; a `max_count` or element type that differs gives
    /// [`Error::RankMismatch`] on every rank.
    ///
    /// No [`Group`](crate::Group) may be open on the calling thread, on any rank: the
    /// agreement is itself an NCCL collective, which an open group would hold back. A rank
    /// with one open is refused at once ([`Error::InvalidUsage`]) without taking part, so
    /// its peers wait in the agreement: on a nonblocking communicator until its
    /// [`ready_timeout`](Comm::ready_timeout) (then it is aborted), on a blocking one
    /// possibly without bound (NCCL's first collective may wait inside the call for the
    /// peers' connections). This is the caller's rule, as it is for every NCCL collective.
    pub fn new(comm: &'c Comm, max_count: usize) -> Result<Self> {
        // The rule above: nothing here can tell the peers without a collective of its own.
        thread_group::ensure_outside("LsaAllReduce::new")?;
        let prepared = prepare::<T>(comm, max_count);
        let refusal = prepared
            .as_ref()
            .err()
            .map_or(0, |err| Refusal::of(err).code());
        let row = [refusal, std::mem::size_of::<T>() as u64, max_count as u64];
        let agreed = agree(comm, row);
        let prepared = prepared?;
        agreed?;
        let scratch = comm
            .register_window(prepared.scratch, WindowFlags::COLL_SYMMETRIC)
            .map_err(Error::from)?;
        // The kernels need no NCCL barriers (theirs live in the scratch window).
        let reqs = DevCommRequirements::new();
        let dev_comm = DevComm::create(comm, &reqs, shipped::ABI);
        // The ranks meet once more after NCCL's local work of the creation: no rank returns,
        // and so launches a kernel that spins for its peers, while a peer may still allocate
        // or copy there (on a shared GPU that work can wait for the spinning kernel); and a
        // creation that failed on one rank after NCCL's own exchanges fails on all. (One that
        // fails before them, or a registration that fails on one rank, leaves its peers in
        // NCCL's exchange: until the ready timeout aborts a nonblocking communicator, and
        // without bound where NCCL's exchange blocks inside the call.)
        let refusal = dev_comm
            .as_ref()
            .err()
            .map_or(0, |err| Refusal::of(err).code());
        let agreed = agree(comm, [refusal, row[1], row[2]]);
        let dev_comm = dev_comm?;
        agreed?;
        // Numbered after the last agreement, before anything that can fail on one rank alone:
        // every rank that gets here numbers its instances alike.
        let flight_instance = comm
            .shared()
            .lock()
            .flight
            .as_deref_mut()
            .map(FlightRing::new_shipped_instance);
        let state = {
            let (ptr, _read) = prepared.state.device_ptr(comm.stream());
            ptr
        };
        // After the last meeting nothing can fail on one rank alone.
        let stopped = Arc::new(AtomicBool::new(false));
        let stop = stop::Registration::new(
            comm,
            state + std::mem::offset_of!(KernelState, timed_out) as u64,
            prepared.stop_stream,
            stopped.clone(),
            flight_instance,
        );
        Ok(Self {
            stop: ManuallyDrop::new(stop),
            comm,
            dev_comm,
            flags: prepared.flags,
            twoshot: prepared.twoshot,
            all_gather: prepared.all_gather,
            barrier: prepared.barrier,
            fused_norm: prepared.fused_norm,
            add_norm: prepared.add_norm,
            scratch,
            state: ManuallyDrop::new(prepared.state),
            gave_up: ManuallyDrop::new(prepared.gave_up),
            barrier_threads: None,
            stopped,
            flight_instance,
            out_of_step: None,
            slot_bytes: prepared.slot_bytes,
            max_count,
            timeout: DEFAULT_TIMEOUT,
            _elem: PhantomData,
        })
    }

    /// The largest message the shipped kernels take (larger ones go to NCCL under
    /// [`LsaAlgorithm::Auto`], and are refused under a forced kernel).
    pub fn max_count(&self) -> usize {
        self.max_count
    }

    /// The communicator.
    pub fn comm(&self) -> &'c Comm {
        self.comm
    }

    /// How long a kernel waits for its peers before giving up (300 s unless set).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets [`timeout`](Self::timeout) for the calls enqueued from now on (a kernel already
    /// captured in a CUDA graph keeps the one it was captured with).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The algorithm [`LsaAlgorithm::Auto`] runs for `count` elements: by the message's
    /// size and the number of ranks, from measurements on 4×H100 (NCCL 2.32.3): fewer than
    /// four ranks, the one-shot flags kernel up to 4 MiB; four or more, the one-shot up to
    /// 64 KiB and the two-shot to 2 MiB; NCCL past those, and for a message past
    /// [`max_count`](Self::max_count).
    pub fn choose(&self, count: usize) -> LsaAlgorithm {
        auto_choice(
            count.saturating_mul(std::mem::size_of::<T>()),
            self.comm.size(),
            count <= self.max_count,
        )
    }

    /// Sums `send` over the ranks into `recv` on the communicator's stream, with `algorithm`
    /// (the one run is returned). Both hold the same number of elements, on the
    /// communicator's GPU; every rank makes the same call.
    pub fn all_reduce(
        &mut self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        algorithm: LsaAlgorithm,
    ) -> Result<LsaAlgorithm> {
        let result = self.all_reduce_checked(send, recv, algorithm);
        self.refused_here(result)
    }

    // The body of the call above: its refusals go through `refused_here`.
    fn all_reduce_checked(
        &mut self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        algorithm: LsaAlgorithm,
    ) -> Result<LsaAlgorithm> {
        let count = send.len();
        if recv.len() != count {
            return Err(Error::invalid(format!(
                "LsaAllReduce: the receive buffer holds {} elements, the send buffer {count}",
                recv.len()
            )));
        }
        let chosen = self.resolve(count, algorithm)?;
        if chosen == LsaAlgorithm::Nccl {
            self.comm.all_reduce(send, recv, ReduceOp::Sum)?;
            return Ok(chosen);
        }
        self.ready(&[
            (send.stream().context(), "the send buffer"),
            (recv.stream().context(), "the receive buffer"),
        ])?;
        let stream = self.comm.stream();
        let (src, _read) = send.device_ptr(stream);
        let (dst, _written) = recv.device_ptr_mut(stream);
        self.launch(Kernel::AllReduce(chosen), src, dst, count)?;
        Ok(chosen)
    }

    /// [`all_reduce`](Self::all_reduce) in place: `buf` holds the sum afterwards.
    pub fn all_reduce_in_place(
        &mut self,
        buf: &mut impl DevicePtrMut<T>,
        algorithm: LsaAlgorithm,
    ) -> Result<LsaAlgorithm> {
        let result = self.all_reduce_in_place_checked(buf, algorithm);
        self.refused_here(result)
    }

    // The body of the call above: its refusals go through `refused_here`.
    fn all_reduce_in_place_checked(
        &mut self,
        buf: &mut impl DevicePtrMut<T>,
        algorithm: LsaAlgorithm,
    ) -> Result<LsaAlgorithm> {
        let count = buf.len();
        let chosen = self.resolve(count, algorithm)?;
        if chosen == LsaAlgorithm::Nccl {
            self.comm.all_reduce_in_place(buf, ReduceOp::Sum)?;
            return Ok(chosen);
        }
        self.ready(&[(buf.stream().context(), "the buffer")])?;
        let stream = self.comm.stream();
        let (ptr, _written) = buf.device_ptr_mut(stream);
        self.launch(Kernel::AllReduce(chosen), ptr, ptr, count)?;
        Ok(chosen)
    }

    /// Whether the kernels gave up waiting ([`Error::Timeout`]), the instance is out of step
    /// (a call refused on this rank) or its kernels were stopped (an abort, revoke or shrink
    /// with abort; both [`Error::InvalidUsage`]), without waiting for the GPU: what every
    /// call checks first.
    pub fn status(&self) -> Result<()> {
        if let Some(why) = &self.out_of_step {
            return Err(Error::usage(format!(
                "LsaAllReduce on rank {}: out of step with its peers since a call was refused \
                 here alone ({why}); drop it on every rank and make a new one",
                self.comm.rank()
            )));
        }
        // A stop (abort, revoke, shrink) makes the kernels leave through the give-up
        // path too: said as what it was, not as a timeout.
        if self.stopped.load(Ordering::Acquire) {
            return Err(Error::usage(format!(
                "LsaAllReduce on rank {}: its kernels were stopped (its communicator was \
                 aborted, revoked or shrunk with ShrinkMode::Abort, or a shrink that aborts \
                 failed); drop it on every rank and make a new one",
                self.comm.rank()
            )));
        }
        if self.gave_up.is_set() {
            self.flight_mark(FlightRing::shipped_gave_up);
            return Err(Error::Timeout {
                what: format!(
                    "LsaAllReduce on rank {}: a kernel's peers to send their data (it gave up \
                     after {:?}; its output, and every later one, is wrong): drop it on every \
                     rank and make a new one",
                    self.comm.rank(),
                    self.timeout
                ),
                waited: self.timeout,
            });
        }
        Ok(())
    }

    /// Waits, for at most [`timeout`](Self::timeout) and ten seconds more, for the work
    /// enqueued so far on the communicator's stream, then reports as
    /// [`status`](Self::status) does.
    pub fn check(&self) -> Result<()> {
        let limit = self.timeout.saturating_add(Duration::from_secs(10));
        self.comm.wait_stream(self.comm.stream(), Some(limit))?;
        self.status()
    }

    /// `result` of a call, after putting the instance out of step if it is an error: a rank
    /// cannot know whether its peers refused the same call (their kernels may be waiting for
    /// this rank's), so no refusal leaves the instance in step.
    fn refused_here<R>(&mut self, result: Result<R>) -> Result<R> {
        // A refusal of `status` itself (given up, stopped, out of step) keeps its own error.
        if let Err(err) = &result {
            if self.status().is_ok() {
                self.put_out_of_step(format!("a call was refused here: {err}"));
            }
        }
        result
    }

    /// Puts the instance out of step with its peers for good, saying `why`: for a caller that
    /// refused a call on this rank alone after deciding to run a shipped kernel (its own
    /// checks, an allocation, a framework's op checks), while the peers may have launched
    /// theirs. Every later call of this instance on this rank is then refused
    /// ([`Error::InvalidUsage`]), and the peers' kernels of the missing call give up after
    /// [`timeout`](Self::timeout), so their later calls are refused too ([`Error::Timeout`]):
    /// no rank's call pairs with another call's data. The first reason is kept.
    pub fn put_out_of_step(&mut self, why: impl Into<String>) {
        if self.out_of_step.is_none() {
            self.out_of_step = Some(why.into());
        }
    }

    /// What a shipped kernel needs on this rank before it is launched: the instance in step,
    /// no group open on this thread, the buffers in the communicator's context. A refusal
    /// here may be this rank's alone while its peers launch, so it puts the instance out of
    /// step for good (the peers' kernels give up, and so do this rank's later calls).
    fn ready(&mut self, buffers: &[(&Arc<CudaContext>, &str)]) -> Result<()> {
        self.status()?;
        // Launched at once, not at a group's end: inside a group it would run before the
        // group's NCCL calls, in an order of its own.
        let alone =
            thread_group::ensure_outside("LsaAllReduce with a shipped kernel").and_then(|()| {
                buffers.iter().try_for_each(|(ctx, what)| {
                    self.comm.check_context_of(ContextId::of(ctx), || ctx, what)
                })
            });
        if let Err(err) = alone {
            self.put_out_of_step("a group open, or a buffer in another CUDA context");
            return Err(err);
        }
        Ok(())
    }

    /// The algorithm a call of `count` elements runs, once the instance is in step (every
    /// call checks [`status`](Self::status) first, NCCL's path too).
    fn resolve(&self, count: usize, algorithm: LsaAlgorithm) -> Result<LsaAlgorithm> {
        self.status()?;
        match algorithm {
            LsaAlgorithm::Auto => Ok(self.choose(count)),
            LsaAlgorithm::Nccl => Ok(LsaAlgorithm::Nccl),
            kernel if count <= self.max_count => Ok(kernel),
            kernel => Err(Error::invalid(format!(
                "LsaAllReduce: {kernel:?} takes at most {} elements (max_count), not {count}",
                self.max_count
            ))),
        }
    }

    /// The communicator's lock, once it may still run work: refused once it was aborted,
    /// destroyed, failed or suspended (its window and device communicator are gone or
    /// going); an abort from another thread waits for the launch made under it.
    fn usable(&mut self) -> Result<MutexGuard<'c, State>> {
        match self.comm.usable(&calls::ncclAllReduce) {
            Ok(guard) => Ok(guard),
            Err(err) => {
                self.put_out_of_step("the communicator could no longer run work");
                Err(err)
            }
        }
    }

    /// Launches `kernel` on `count` elements per rank from `src` into `dst` (`count` elements,
    /// or `count` × ranks for the all-gather).
    fn launch(&mut self, kernel: Kernel, src: u64, dst: u64, count: usize) -> Result<()> {
        let mut usable = self.usable()?;
        if count == 0 {
            return Ok(());
        }
        let (function, (ctas, threads)) = match kernel {
            Kernel::AllReduce(LsaAlgorithm::OneShotBarrier) => {
                let (ctas, threads) = grid::<T>(count, MAX_CTAS);
                (
                    &self.barrier,
                    (ctas, self.barrier_threads.unwrap_or(threads)),
                )
            }
            Kernel::AllReduce(LsaAlgorithm::TwoShotFlags) => {
                (&self.twoshot, flags_grid::<T>(count))
            }
            Kernel::AllReduce(_) => (&self.flags, flags_grid::<T>(count)),
            // A thread per 16-byte LL line, which carries 8 bytes.
            Kernel::AllGather => (
                &self.all_gather,
                flags_grid::<u8>(2 * count * std::mem::size_of::<T>()),
            ),
        };
        let stream = self.comm.stream();
        let scratch = self.scratch.as_raw() as u64;
        let timeout_ns = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX);
        let cfg = LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let (state, state_written) = self.state.device_ptr_mut(stream);
        // SAFETY: the kernels' parameters are (const ncclDevComm*, ncclWindow_t, size_t slot,
        // const T* in, T* out, size_t count, State*, unsigned long long timeout_ns), pushed
        // in that order. `src` holds `count` elements of T and `dst` `count` (all-reduce) or
        // `count` × ranks (all-gather) on this context (checked by `ready` and the callers),
        // ordered on this stream by their guards; the kernel writes only `dst`, its own state
        // (a KernelState, whose `gave_up` is the live HostWords word's device address) and the
        // scratch window, inside `(3 × ranks + 2) × slot_bytes + ranks × INBOX_BYTES` bytes
        // since count ≤ max_count (two-shot: 2 × ceil(vectors / ranks) ≤ the slot's vectors;
        // the all-gather: count ≤ max_count / 2, its 2 × count × size
        // bytes of lines within a slot); a flags grid is at most FLAGS_MAX_CTAS CTAs and a
        // barrier grid MAX_CTAS (each CTA's call count in the state; the flags kernels touch
        // no inbox).
        let launched = unsafe {
            stream
                .launch_builder(function)
                .arg(&self.dev_comm)
                .arg(&scratch)
                .arg(&self.slot_bytes)
                .arg(&src)
                .arg(&dst)
                .arg(&count)
                .arg(&state)
                .arg(&timeout_ns)
                .launch(cfg)
        };
        drop(state_written);
        let shipped = match kernel {
            Kernel::AllReduce(LsaAlgorithm::OneShotBarrier) => ShippedKernel::OneShotBarrier,
            Kernel::AllReduce(LsaAlgorithm::TwoShotFlags) => ShippedKernel::TwoShotFlags,
            Kernel::AllReduce(_) => ShippedKernel::OneShotFlags,
            Kernel::AllGather => ShippedKernel::AllGather,
        };
        record_launch::<T>(
            &mut usable,
            self.flight_instance,
            shipped,
            count,
            stream.cu_stream() as u64,
            launched.is_err(),
        );
        if let Err(err) = launched {
            self.put_out_of_step("a kernel launch failed here");
            return Err(err.into());
        }
        Ok(())
    }

    /// Runs `mark` on the communicator's flight recorder with this instance's number, where
    /// the recorder is on. Takes the communicator's lock: never called under it.
    fn flight_mark(&self, mark: fn(&mut FlightRing, u32)) {
        if let Some(instance) = self.flight_instance {
            if let Some(ring) = self.comm.shared().lock().flight.as_deref_mut() {
                mark(ring, instance);
            }
        }
    }

    /// Runs barrier CTAs of `threads` threads (1 to 512) from now on, for tests: the barrier
    /// must meet every peer however few threads a CTA has (fewer than the ranks included).
    ///
    /// # Safety
    ///
    /// Every rank sets the same `threads` before the same call: CTA b of every rank meets at
    /// barrier b and then reads the vectors its peers' CTA b wrote, so grids that differ
    /// between ranks read vectors not yet written (wrong sums, no error).
    #[doc(hidden)]
    pub unsafe fn set_barrier_threads(&mut self, threads: u32) -> Result<()> {
        if !(1..=THREADS).contains(&threads) {
            return Err(Error::invalid(format!(
                "barrier CTAs take 1 to {THREADS} threads, not {threads}"
            )));
        }
        self.barrier_threads = Some(threads);
        Ok(())
    }
}

/// Records a launch of `kernel` by instance `instance` (on `count` elements per rank, on the
/// raw stream `stream`) in the communicator's flight recorder, under its lock `state`, which
/// the launch holds (see `crate::diagnostics::flight`); `refused` where the launch failed.
#[inline(always)]
fn record_launch<T: LsaElem>(
    state: &mut State,
    instance: Option<u32>,
    kernel: ShippedKernel,
    count: usize,
    stream: u64,
    refused: bool,
) {
    if let (Some(instance), Some(ring)) = (instance, state.flight.as_deref_mut()) {
        ring.record_shipped(RawShipped::launch(
            instance,
            kernel,
            T::DATA_TYPE,
            count,
            stream,
            refused,
        ));
    }
}

/// Lets go of the instance's kernels before their memory (see `stop.rs`): they get
/// [`Comm::drop_timeout`] to end on their own (a peer may be late to the last call), then
/// are stopped and get `AFTER_STOP` more. Kernels that still have not ended (queued behind
/// work that never ends) keep the state and the `gave_up` word, leaked; the device
/// communicator and the scratch window then wait and leak as their own drops say.
impl<T: LsaElem> Drop for LsaAllReduce<'_, T> {
    fn drop(&mut self) {
        let mut ended = stop::stream_work_ends_within(self.comm, self.comm.drop_timeout());
        let mut written = true;
        if !ended {
            written = self.stop.stop_now();
            if written {
                self.flight_mark(FlightRing::shipped_stopped);
            }
            ended = stop::stream_work_ends_within(self.comm, AFTER_STOP);
        }
        if self.gave_up.is_set() {
            self.flight_mark(FlightRing::shipped_gave_up);
        }
        self.flight_mark(FlightRing::shipped_instance_dropped);
        if ended {
            // SAFETY: no kernel of the instance can run any more (none is enqueued that did
            // not end), and none of the three is touched again.
            unsafe {
                ManuallyDrop::drop(&mut self.stop);
                ManuallyDrop::drop(&mut self.state);
                ManuallyDrop::drop(&mut self.gave_up);
            }
        } else if written {
            // The word is written: a kernel still queued returns at once when it runs,
            // reading the state and nothing else; one still running may write `gave_up`.
            // SAFETY: not touched again; the other two are leaked.
            unsafe { ManuallyDrop::drop(&mut self.stop) };
        }
        // Otherwise all three are leaked, the stop still registered for the next abort.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinels_are_negative_zero() {
        assert_eq!(f32::from_bits(f32::SENTINEL_WORD), -0.0);
        assert!(f32::from_bits(f32::SENTINEL_WORD).is_sign_negative());
        let low = (half::bf16::SENTINEL_WORD & 0xffff) as u16;
        assert!(half::bf16::from_bits(low) == half::bf16::ZERO);
        assert!(half::bf16::from_bits(low).is_sign_negative());
        let high = (half::f16::SENTINEL_WORD >> 16) as u16;
        assert!(half::f16::from_bits(high).is_sign_negative());
        assert!(half::f16::from_bits(high) == half::f16::ZERO);
    }
}
