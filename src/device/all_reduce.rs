//! [`LsaAllReduce`]: the all-reduce this crate ships as device code, for small messages
//! inside one LSA team (all ranks on one host's NVLink or one GPU), where NCCL's own kernels
//! spend most of their time on synchronisation.

use std::marker::PhantomData;
use std::time::Duration;

use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::shipped;
use super::{DevComm, DevCommRequirements};
use crate::agreement::{all_gather_rows, Wait};
use crate::calls;
use crate::comm::{Comm, ContextId};
use crate::dtype::NcclType;
use crate::error::{Error, Refusal, Result};
use crate::memory::NcclBuffer;
use crate::op::ReduceOp;
use crate::release::Version;
use crate::thread_group;
use crate::window::{Window, WindowFlags};

/// Threads per CTA of the shipped kernels.
const THREADS: u32 = 512;
/// The most CTAs a call runs (and the LSA barriers the device communicator holds): few
/// enough that every CTA of every rank is resident at once, even two ranks on one GPU.
const MAX_CTAS: u32 = 16;
/// Bytes one thread moves per step.
const VECTOR: usize = 16;
/// Size of the kernels' `State` (see `allreduce.cu`), in u64 words.
const STATE_WORDS: usize = 8;
/// The first NCCL whose device communicator the shipped kernels can read.
const SINCE: Version = Version::new(2, 29, 2);
/// How long a flags kernel waits for its peers by default.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// `ncclAllReduce` (sum) on the communicator.
    Nccl,
}

/// How [`LsaAllReduce::all_reduce_add_rms_norm`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LsaEpilogue {
    /// One kernel: the flags all-reduce, the residual add and the norm (each rank reduces
    /// a row, adds, normalises, with no second pass over memory and no second launch).
    Fused,
    /// The all-reduce with this algorithm (in place on the input), then a second kernel for
    /// the residual add and the norm: what a program without the fused kernel does.
    Separate(LsaAlgorithm),
}

/// The most 16-byte vectors of a row one thread of the norm keeps (the kernels' registers).
const NORM_VECTORS_PER_THREAD: usize = 4;

/// The all-reduce (sum) of the kernels this crate ships, for small messages on one
/// communicator whose ranks form one LSA team (one host's NVLink, or ranks sharing a GPU),
/// where NCCL's own kernels spend most of their time on synchronisation.
///
/// # Schemes
///
/// Both are one-shot: every rank reduces the whole message from every rank's copy, in rank
/// order, accumulating in `f32`, so every rank ends with the same bits.
///
/// * [`LsaAlgorithm::OneShotFlags`]: each rank stores its input straight into every peer's
///   scratch slot; the receiver waits on its own slots until no element holds the sentinel
///   (negative zero; an input's negative zero is sent as +0, which sums the same). Three
///   scratch buffers rotate by call and each call clears the previous call's, so no barrier
///   is needed at all (the Lamport scheme TensorRT-LLM's and FlashInfer's one-shot kernels
///   use).
/// * [`LsaAlgorithm::OneShotBarrier`]: each rank copies its input into its own scratch slot,
///   meets its peers at NCCL's LSA barrier, and reads every peer's slot; two buffers
///   alternate by call, so one barrier a call suffices.
///
/// [`LsaAlgorithm::Auto`] picks by message size (see [`LsaAllReduce::choose`]), and
/// [`LsaAlgorithm::Nccl`] calls `ncclAllReduce`, which [`Auto`](LsaAlgorithm::Auto) also
/// picks past the scratch's size.
///
/// # What the ranks must keep alike
///
/// Peers never read or write the caller's buffers (only the scratch window this type owns),
/// so any device buffer of the communicator's context works, and the borrow checker's rules
/// for it are cudarc's. As with NCCL's collectives, every rank must make the same calls in
/// the same order with the same count and algorithm: the kernels of one call wait for the
/// peers' kernels of that call. Unlike NCCL's, a flags kernel whose peers never come gives
/// up after [`LsaAllReduce::timeout`] instead of spinning forever: its output is then wrong,
/// the instance's call counters no longer match the peers', and [`LsaAllReduce::check`]
/// says so; drop it (on every rank). The barrier scheme waits in NCCL's barrier, which has
/// no timeout.
///
/// A launch is refused once the communicator was aborted, destroyed, failed or suspended,
/// and while a [`Group`](crate::Group) is open on the thread (a kernel cannot wait for the
/// group's end). An abort from another thread while a kernel runs frees the scratch window
/// under it: the kernel may then fault (a CUDA error on this context); it ends by itself
/// within the timeout.
///
/// Created collectively by every rank ([`LsaAllReduce::new`]); each owns a scratch window of
/// `(3 × ranks + 2) × max_count` elements, a device communicator and a few words of state.
/// Calls take `&mut self`: one at a time, in the same order on every rank.
pub struct LsaAllReduce<'c, T: LsaElem> {
    comm: &'c Comm,
    // Dropped before the window and the state: a device communicator waits for the kernels
    // that took it.
    dev_comm: DevComm<'c>,
    flags: CudaFunction,
    barrier: CudaFunction,
    fused_norm: CudaFunction,
    add_norm: CudaFunction,
    scratch: Window<'c, u32>,
    state: CudaSlice<u64>,
    /// Bytes of one rank's slot of one buffer: `max_count` elements, rounded up to 16.
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

/// What a rank prepares on its own before the ranks agree.
struct Prepared {
    flags: CudaFunction,
    barrier: CudaFunction,
    fused_norm: CudaFunction,
    add_norm: CudaFunction,
    scratch: NcclBuffer<u32>,
    state: CudaSlice<u64>,
    slot_bytes: usize,
}

/// Scratch bytes per rank slot for `max_count` elements of `T`, and the scratch's words for
/// `ranks` ranks; `None` on overflow.
fn scratch_size<T>(max_count: usize, ranks: usize) -> Option<(usize, usize)> {
    let slot = max_count
        .checked_mul(std::mem::size_of::<T>())?
        .checked_next_multiple_of(VECTOR)?;
    let words = ranks.checked_mul(3)?.checked_add(2)?.checked_mul(slot)? / 4;
    Some((slot, words))
}

/// The grid for `count` elements of `T`: one thread per 16 bytes, in CTAs of [`THREADS`]
/// (fewer, a multiple of 32, for a message that fits one CTA: a smaller CTA starts and
/// ends sooner), at most [`MAX_CTAS`] of them. A function of the count alone, so every rank
/// runs the same grid.
fn grid<T>(count: usize) -> (u32, u32) {
    let vectors = (count * std::mem::size_of::<T>()).div_ceil(VECTOR);
    let ctas = vectors
        .div_ceil(THREADS as usize)
        .clamp(1, MAX_CTAS as usize) as u32;
    let threads = if ctas == 1 {
        vectors.next_multiple_of(32).clamp(32, THREADS as usize) as u32
    } else {
        THREADS
    };
    (ctas, threads)
}

fn prepare<T: LsaElem>(comm: &Comm, max_count: usize) -> Result<Prepared> {
    let lib = comm.library();
    lib.require("nccl-rs's shipped device kernels", SINCE)?;
    if max_count == 0 {
        return Err(Error::invalid("LsaAllReduce needs max_count of at least 1"));
    }
    let props = comm.properties()?;
    if !props.device_api_support {
        return Err(Error::Unavailable {
            api: "LsaAllReduce",
            reason: "the communicator has no device-API support".into(),
        });
    }
    if props.lsa_teams != Some(1) {
        return Err(Error::Unavailable {
            api: "LsaAllReduce",
            reason: format!(
                "its kernels need every rank in one LSA team (one host's NVLink, or ranks \
                 sharing a GPU); this communicator has {} LSA teams",
                props
                    .lsa_teams
                    .map_or_else(|| "an unknown number of".into(), |n| n.to_string())
            ),
        });
    }
    let (slot_bytes, words) = scratch_size::<T>(max_count, comm.size())
        .ok_or_else(|| Error::invalid(format!("LsaAllReduce: max_count {max_count} overflows")))?;
    let ctx = comm.context();
    ctx.bind_to_thread()?;
    let module = shipped::load(ctx)?;
    let flags = module.function(&format!("nccl_rs_oneshot_flags_{}", T::SUFFIX))?;
    let barrier = module.function(&format!("nccl_rs_oneshot_barrier_{}", T::SUFFIX))?;
    let fused_norm = module.function(&format!("nccl_rs_fused_add_rms_norm_{}", T::SUFFIX))?;
    let add_norm = module.function(&format!("nccl_rs_add_rms_norm_{}", T::SUFFIX))?;
    let fill = module.function("nccl_rs_fill_u32")?;
    let stream = comm.stream();
    let mut scratch = NcclBuffer::<u32>::alloc_zeros(stream, words)?;
    let state = stream.alloc_zeros::<u64>(STATE_WORDS)?;
    // The flags buffers start as sentinels (the barrier buffers need nothing). Peers first
    // write into them after this rank's window registration, whose exchange runs on this
    // stream after this fill.
    let sentinels = 3 * comm.size() * slot_bytes / 4;
    let sentinel = T::SENTINEL_WORD;
    let cfg = LaunchConfig {
        grid_dim: (
            sentinels.div_ceil(THREADS as usize).clamp(1, 1024) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    {
        let (ptr, _written) = scratch.device_ptr_mut(stream);
        // SAFETY: nccl_rs_fill_u32(uint32_t*, size_t, uint32_t) writes `sentinels` words from
        // `ptr`, inside the `words`-word buffer (sentinels <= words).
        unsafe {
            stream
                .launch_builder(&fill)
                .arg(&ptr)
                .arg(&sentinels)
                .arg(&sentinel)
                .launch(cfg)?;
        }
    }
    Ok(Prepared {
        flags,
        barrier,
        fused_norm,
        add_norm,
        scratch,
        state,
        slot_bytes,
    })
}

const CALL: &str = "LsaAllReduce::new";
const WIDTH: usize = 3;

/// Every rank's verdict, element size and `max_count`, all-gathered: each rank returns its
/// own error, the others [`Error::RankRefused`]; differing sizes give
/// [`Error::RankMismatch`] everywhere.
fn agree(comm: &Comm, row: [u64; WIDTH]) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let wait = Wait {
        limit: |comm| Some(comm.ready_timeout()),
        what: "LsaAllReduce's agreement exchange to finish",
        explain: None,
    };
    let all = all_gather_rows(&[comm], &[row.to_vec()], WIDTH, &wait)?;
    let rows: Vec<&[u64]> = all[0].chunks_exact(WIDTH).collect();
    if let Some((rank, reason)) = rows
        .iter()
        .enumerate()
        .find_map(|(rank, row)| Refusal::from_code(row[0]).map(|r| (rank, r)))
    {
        return Err(Error::RankRefused {
            call: CALL,
            rank,
            reason,
        });
    }
    for (field, i) in [("element size", 1), ("max_count", 2)] {
        if let Some((rank, row)) = rows.iter().enumerate().find(|(_, r)| r[i] != rows[0][i]) {
            return Err(Error::RankMismatch {
                call: CALL,
                field,
                first: 0,
                expected: rows[0][i],
                rank,
                value: row[i],
            });
        }
    }
    Ok(())
}

impl<'c, T: LsaElem> LsaAllReduce<'c, T> {
    /// Creates the all-reduce on `comm` for messages of up to `max_count` elements: every
    /// rank calls it, with the same `max_count`. Loads the shipped kernels, allocates and
    /// registers the scratch window, creates a device communicator with 16 LSA
    /// barriers.
    ///
    /// The ranks agree before anything collective: a rank that cannot take part (NCCL before
    /// 2.29.2, no device-API support, ranks in more than one LSA team, a GPU older than
    /// sm_80, an allocation that failed) returns its own error and every other rank
    /// [`Error::RankRefused`]; a `max_count` or element type that differs gives
    /// [`Error::RankMismatch`] on every rank.
    pub fn new(comm: &'c Comm, max_count: usize) -> Result<Self> {
        // Refused alike on every rank that has a group open (the same calls on every rank).
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
        let reqs = DevCommRequirements::new().lsa_barriers(MAX_CTAS);
        let dev_comm = DevComm::create(comm, &reqs, shipped::ABI)?;
        Ok(Self {
            comm,
            dev_comm,
            flags: prepared.flags,
            barrier: prepared.barrier,
            fused_norm: prepared.fused_norm,
            add_norm: prepared.add_norm,
            scratch,
            state: prepared.state,
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

    /// How long a flags kernel waits for its peers before giving up (30 s unless set).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets [`timeout`](Self::timeout) for the calls enqueued from now on (a kernel already
    /// captured in a CUDA graph keeps the one it was captured with).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The algorithm [`LsaAlgorithm::Auto`] runs for `count` elements, from measurements on
    /// H100s (NCCL 2.32.3, NVLS off): the flags kernel up to `max_count`, NCCL past it.
    pub fn choose(&self, count: usize) -> LsaAlgorithm {
        if count <= self.max_count {
            LsaAlgorithm::OneShotFlags
        } else {
            LsaAlgorithm::Nccl
        }
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
        let count = send.len();
        if recv.len() != count {
            return Err(Error::invalid(format!(
                "LsaAllReduce: the receive buffer holds {} elements, the send buffer {count}",
                recv.len()
            )));
        }
        self.check_buffer(send.stream().context(), "the send buffer")?;
        self.check_buffer(recv.stream().context(), "the receive buffer")?;
        let chosen = self.resolve(count, algorithm)?;
        if chosen == LsaAlgorithm::Nccl {
            self.comm.all_reduce(send, recv, ReduceOp::Sum)?;
            return Ok(chosen);
        }
        let stream = self.comm.stream();
        let (src, _read) = send.device_ptr(stream);
        let (dst, _written) = recv.device_ptr_mut(stream);
        self.launch(chosen, src, dst, count)?;
        Ok(chosen)
    }

    /// [`all_reduce`](Self::all_reduce) in place: `buf` holds the sum afterwards.
    pub fn all_reduce_in_place(
        &mut self,
        buf: &mut impl DevicePtrMut<T>,
        algorithm: LsaAlgorithm,
    ) -> Result<LsaAlgorithm> {
        let count = buf.len();
        self.check_buffer(buf.stream().context(), "the buffer")?;
        let chosen = self.resolve(count, algorithm)?;
        if chosen == LsaAlgorithm::Nccl {
            self.comm.all_reduce_in_place(buf, ReduceOp::Sum)?;
            return Ok(chosen);
        }
        let stream = self.comm.stream();
        let (ptr, _written) = buf.device_ptr_mut(stream);
        self.launch(chosen, ptr, ptr, count)?;
        Ok(chosen)
    }

    /// The tensor-parallel epilogue of a row-parallel layer, on `rows × hidden` elements
    /// (`hidden` = `weight.len()`): `x` holds this rank's partial sums; afterwards `residual`
    /// holds `T(T(Σ x) + residual)` and `out` that row-normalised,
    /// `T(h · rsqrt(mean(h²) + eps) · weight)` (RMSNorm, accumulated in `f32`), the same on
    /// every rank. With [`LsaEpilogue::Fused`] in one kernel; with
    /// [`LsaEpilogue::Separate`] as an all-reduce in place on `x`, then a second kernel. Both
    /// round where the separate sequence rounds, so they agree bit for bit where the
    /// all-reduce sums alike (two ranks, or the shipped kernels: every rank in rank order).
    ///
    /// `hidden` must be a multiple of 16 bytes' worth of elements and at most 2 048 of
    /// those vectors (16 384 16-bit elements); every buffer must start 16-byte aligned;
    /// `x`, `residual` and `out` hold the same whole number of rows; fused, at most
    /// [`max_count`](Self::max_count) elements. Every rank makes the same call.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_add_rms_norm(
        &mut self,
        x: &mut impl DevicePtrMut<T>,
        residual: &mut impl DevicePtrMut<T>,
        weight: &impl DevicePtr<T>,
        eps: f32,
        out: &mut impl DevicePtrMut<T>,
        how: LsaEpilogue,
    ) -> Result<()> {
        let (len, hidden) = (x.len(), weight.len());
        let per_vector = VECTOR / std::mem::size_of::<T>();
        let refuse = |why: String| {
            Err(Error::invalid(format!(
                "LsaAllReduce::all_reduce_add_rms_norm: {why}"
            )))
        };
        if hidden == 0 || !hidden.is_multiple_of(per_vector) {
            return refuse(format!(
                "the hidden size (weight's length) {hidden} is not a positive multiple of \
                 {per_vector} elements (16 bytes)"
            ));
        }
        if hidden / per_vector > NORM_VECTORS_PER_THREAD * THREADS as usize {
            return refuse(format!(
                "the hidden size {hidden} is past the kernels' {} elements",
                NORM_VECTORS_PER_THREAD * THREADS as usize * per_vector
            ));
        }
        if residual.len() != len || out.len() != len || !len.is_multiple_of(hidden) {
            return refuse(format!(
                "x, residual and out hold {len}, {} and {} elements, not the same whole number \
                 of rows of {hidden}",
                residual.len(),
                out.len()
            ));
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return refuse(format!("eps {eps} is not a finite non-negative number"));
        }
        if how == LsaEpilogue::Fused && len > self.max_count {
            return refuse(format!(
                "{len} elements fused, past max_count {}",
                self.max_count
            ));
        }
        self.check_buffer(x.stream().context(), "x")?;
        self.check_buffer(residual.stream().context(), "the residual")?;
        self.check_buffer(weight.stream().context(), "the weight")?;
        self.check_buffer(out.stream().context(), "the output")?;
        if let LsaEpilogue::Separate(algorithm) = how {
            self.all_reduce_in_place(x, algorithm)?;
        }
        let rows = len / hidden;
        let stream = self.comm.stream();
        let (x, _x) = x.device_ptr_mut(stream);
        let (residual, _residual) = residual.device_ptr_mut(stream);
        let (weight, _weight) = weight.device_ptr(stream);
        let (out, _out) = out.device_ptr_mut(stream);
        if [x, residual, weight, out]
            .iter()
            .any(|p| p % VECTOR as u64 != 0)
        {
            return refuse("a buffer does not start 16-byte aligned".into());
        }
        self.launch_norm(how, [x, residual, weight, out], rows, hidden, eps)
    }

    fn launch_norm(
        &mut self,
        how: LsaEpilogue,
        [x, residual, weight, out]: [u64; 4],
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        thread_group::ensure_outside("LsaAllReduce::all_reduce_add_rms_norm")?;
        let _usable = self.comm.usable(&calls::ncclAllReduce)?;
        if rows == 0 {
            return Ok(());
        }
        let vectors = hidden * std::mem::size_of::<T>() / VECTOR;
        let cfg = LaunchConfig {
            grid_dim: (rows.min(MAX_CTAS as usize) as u32, 1, 1),
            block_dim: (
                vectors.next_multiple_of(32).clamp(32, THREADS as usize) as u32,
                1,
                1,
            ),
            shared_mem_bytes: 0,
        };
        let stream = self.comm.stream();
        if let LsaEpilogue::Separate(_) = how {
            // SAFETY: nccl_rs_add_rms_norm_T(const T* sums, T* residual, const T* weight, T* out,
            // size_t rows, size_t hidden, float eps): `x`, `residual` and `out` hold
            // rows × hidden elements and `weight` hidden, 16-byte aligned (checked), on this
            // context, ordered on this stream by the caller's guards; a CTA handles whole rows
            // of at most NORM_VECTORS_PER_THREAD vectors per thread (checked).
            unsafe {
                stream
                    .launch_builder(&self.add_norm)
                    .arg(&x)
                    .arg(&residual)
                    .arg(&weight)
                    .arg(&out)
                    .arg(&rows)
                    .arg(&hidden)
                    .arg(&eps)
                    .launch(cfg)?;
            }
            return Ok(());
        }
        let scratch = self.scratch.as_raw() as u64;
        let timeout_ns = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX);
        let (state, _state) = self.state.device_ptr_mut(stream);
        // SAFETY: nccl_rs_fused_add_rms_norm_T(const ncclDevComm*, ncclWindow_t, size_t slot,
        // const T* in, T* residual, const T* weight, T* out, size_t rows, size_t hidden,
        // float eps, State*, unsigned long long timeout_ns), in that order. The buffers are
        // as for the separate kernel above; the scratch is used as by the flags all-reduce of
        // rows × hidden <= max_count elements (checked); the grid is at most MAX_CTAS CTAs.
        unsafe {
            stream
                .launch_builder(&self.fused_norm)
                .arg(&self.dev_comm)
                .arg(&scratch)
                .arg(&self.slot_bytes)
                .arg(&x)
                .arg(&residual)
                .arg(&weight)
                .arg(&out)
                .arg(&rows)
                .arg(&hidden)
                .arg(&eps)
                .arg(&state)
                .arg(&timeout_ns)
                .launch(cfg)?;
        }
        Ok(())
    }

    /// Waits for the calls enqueued so far and reports whether a flags kernel gave up
    /// waiting for its peers ([`Error::Timeout`]; the instance is then out of step with its
    /// peers: drop it on every rank).
    pub fn check(&self) -> Result<()> {
        let stream = self.comm.stream();
        let state = stream.clone_dtoh(&self.state)?;
        stream.synchronize()?;
        // State::timed_out: the first u32 of word 6 (after 2 call counters and 3 sizes, and
        // the two `done` counters in word 5).
        if state[6] as u32 != 0 {
            return Err(Error::Timeout {
                what: format!(
                    "LsaAllReduce on rank {}: a kernel's peers to send their data (it gave up \
                     after {:?}; its output is wrong and its peers may still wait)",
                    self.comm.rank(),
                    self.timeout
                ),
                waited: self.timeout,
            });
        }
        Ok(())
    }

    fn check_buffer(
        &self,
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        what: &str,
    ) -> Result<()> {
        self.comm.check_context_of(ContextId::of(ctx), || ctx, what)
    }

    fn resolve(&self, count: usize, algorithm: LsaAlgorithm) -> Result<LsaAlgorithm> {
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

    fn launch(&mut self, algorithm: LsaAlgorithm, src: u64, dst: u64, count: usize) -> Result<()> {
        // Launched at once, not at a group's end: inside a group it would run before the
        // group's NCCL calls, in an order of its own.
        thread_group::ensure_outside("LsaAllReduce::all_reduce with a shipped kernel")?;
        // Under the communicator's lock, refused once it was aborted, destroyed, failed or
        // suspended (its window and device communicator are gone or going): an abort from
        // another thread waits for the launch.
        let _usable = self.comm.usable(&calls::ncclAllReduce)?;
        if count == 0 {
            return Ok(());
        }
        let function = match algorithm {
            LsaAlgorithm::OneShotBarrier => &self.barrier,
            _ => &self.flags,
        };
        let stream = self.comm.stream();
        let scratch = self.scratch.as_raw() as u64;
        let timeout_ns = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX);
        let (ctas, threads) = grid::<T>(count);
        let cfg = LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let (state, _state) = self.state.device_ptr_mut(stream);
        // SAFETY: the kernels' parameters are (const ncclDevComm*, ncclWindow_t, size_t slot,
        // const T* in, T* out, size_t count, State*, unsigned long long timeout_ns), pushed
        // in that order. `src` and `dst` hold `count` elements of T on this context (checked
        // by the callers), ordered on this stream by their guards; the kernel writes only
        // `dst`, its own state (STATE_WORDS words) and the scratch window, inside
        // `(3 × ranks + 2) × slot_bytes` bytes since count ≤ max_count; the grid is at most
        // MAX_CTAS CTAs, the device communicator's LSA barrier count.
        unsafe {
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
                .launch(cfg)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_holds_three_buffers_per_rank_and_two_more() {
        assert_eq!(scratch_size::<f32>(1, 2), Some((16, (3 * 2 + 2) * 16 / 4)));
        assert_eq!(scratch_size::<half::bf16>(8, 4), Some((16, 14 * 16 / 4)));
        assert_eq!(scratch_size::<f32>(5, 4), Some((32, 14 * 32 / 4)));
        assert_eq!(scratch_size::<f32>(usize::MAX / 2, 2), None);
        assert_eq!(scratch_size::<f32>(1 << 20, usize::MAX / 2), None);
    }

    #[test]
    fn grids_cover_the_message_up_to_the_barrier_count() {
        assert_eq!(grid::<f32>(1), (1, 32));
        assert_eq!(grid::<f32>(4 * 32), (1, 32));
        assert_eq!(grid::<f32>(4 * 33), (1, 64));
        assert_eq!(grid::<f32>(4 * 512), (1, 512));
        assert_eq!(grid::<f32>(4 * 512 + 1), (2, 512));
        assert_eq!(grid::<half::bf16>(8 * 512 * 3), (3, 512));
        assert_eq!(grid::<f32>(1 << 30), (MAX_CTAS, 512));
    }

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
