//! [`ExpertExchange`]: mixture-of-experts dispatch and combine across the ranks of a
//! communicator — each token sent to the ranks holding its top-k experts, and the experts'
//! outputs brought back and summed with the router's weights — by kernels this crate ships
//! (stores into the peers' memory of one LSA team), or, where no LSA team spans the ranks,
//! by NCCL's all-to-all-v with the same results.
//!
//! The rooms: `layout.rs` (the kernels' state, the scratch geometry, sizes: the device ABI),
//! `fallback.rs` (the all-to-all-v path), `create.rs` (what each rank prepares and the
//! ranks' agreement), this file (the calls, their checks, the out-of-step rules and the
//! drop, as [`LsaAllReduce`](super::LsaAllReduce)'s).
//!
//! Past 600 lines on purpose: an instance's life (each call's checks, launch and flight
//! entry, the out-of-step state, the bad-routing report, the drop that stops the kernels
//! before freeing what they use) keeps one set of invariants, stated once here; a third of
//! the file is the type's documentation.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};

use super::all_reduce::{
    stream_work_ends_within, HostWords, KernelStopRegistration, LsaElem, AFTER_STOP,
};
use super::DevComm;
use crate::calls;
use crate::comm::{Comm, ContextId};
use crate::diagnostics::flight::{FlightRing, RawShipped, ShippedKernel};
use crate::error::{Error, Result};
use crate::thread_group;
use crate::window::Window;

mod create;
mod fallback;
mod layout;

use layout::{Geometry, Work, BAD_ENTRY_WORD, BAD_VALUE_WORD, MAX_CTAS};
pub use layout::{MAX_ENTRIES, MAX_EXPERTS, MAX_RANKS};

/// Threads per CTA of the exchange's kernels.
const THREADS: u32 = 512;
/// How long a kernel waits for its peers by default.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The shape of a mixture-of-experts layer's exchange, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExpertShape {
    /// Experts in all; rank `r` holds experts `r × L .. (r + 1) × L`, `L = experts / ranks`.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Elements of a token row.
    pub hidden: usize,
    /// Tokens a rank sends per call at most.
    pub max_tokens: usize,
}

impl ExpertShape {
    /// The shape of `experts` experts, `top_k` per token, rows of `hidden` elements, at most
    /// `max_tokens` tokens a rank per call.
    pub fn new(experts: usize, top_k: usize, hidden: usize, max_tokens: usize) -> Self {
        Self {
            experts,
            top_k,
            hidden,
            max_tokens,
        }
    }

    /// Local experts per rank of `ranks`.
    pub fn local_experts(&self, ranks: usize) -> usize {
        self.experts / ranks.max(1)
    }

    /// Rows of `hidden` elements a dispatch's receive buffer (and a combine's expert output)
    /// holds on each rank of `ranks`: `local_experts × ranks × max_tokens`, expert `le`'s rows
    /// from `le × ranks × max_tokens` on.
    pub fn received_rows(&self, ranks: usize) -> usize {
        self.local_experts(ranks)
            .saturating_mul(ranks)
            .saturating_mul(self.max_tokens)
    }
}

/// How an [`ExpertExchange`] moves its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum ExchangePath {
    /// The shipped kernels where every rank can run them (one LSA team, NCCL 2.29.2+), else
    /// all-to-all-v.
    #[default]
    Auto,
    /// The shipped kernels: stores into the peers' memory of one LSA team.
    Lsa,
    /// NCCL's all-to-all-v (grouped sends and receives) between local packing kernels: any
    /// communicator, any NCCL; each dispatch waits on the host for the row counts, which
    /// the kernels leave in host-mapped memory (not capturable in a CUDA graph).
    AllToAllV,
}

/// What a [`dispatch`](ExpertExchange::dispatch) hands to its
/// [`combine`](ExpertExchange::combine): only the instance's latest dispatch can be combined,
/// once.
#[derive(Debug)]
#[must_use = "combine the dispatch's expert outputs with it"]
pub struct Dispatched {
    instance: u64,
    call: u64,
    tokens: usize,
}

impl Dispatched {
    /// Tokens this rank dispatched.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

/// Mixture-of-experts dispatch and combine across a communicator's ranks, expert parallel:
/// rank `r` holds experts `r × L .. (r + 1) × L` of [`ExpertShape::experts`].
///
/// # Calls
///
/// [`dispatch`](Self::dispatch) takes this rank's tokens (`tokens × hidden` elements) and
/// their routing (`tokens × top_k` expert numbers, `-1` for none) and fills, for each local
/// expert `le`, the rows it received from every rank — packed, first rank 0's in token
/// order, then rank 1's, ... — at rows `le × ranks × max_tokens ..` of the receive buffer,
/// with their number in `recv_counts[le]` (rows past it are left as they were).
/// [`combine`](Self::combine) takes the experts' outputs in that same layout and gives each
/// token `sum over k of weight[t][k] × output(t, k)`, accumulated in `f32` in `k` order and
/// rounded once: the same bits on every run and on both paths.
///
/// # Paths
///
/// [`ExchangePath::Lsa`]: one kernel per call on each rank: dispatch stores each (token,
/// expert) row straight into the expert owner's scratch window with a count per (expert,
/// source) published after it; the owner waits for the counts and copies the rows out in the
/// packed order. Combine stores each row back into its source's window beside a flag, and
/// the source sums as they arrive. Capturable in CUDA graphs; every rank must be in one LSA
/// team (one host's NVLink, or ranks sharing a GPU) with NCCL 2.29.2+.
/// [`ExchangePath::AllToAllV`]: packing kernels around NCCL's all-to-all-v of the counts and
/// of the rows (each dispatch waits on the host for the counts: not capturable).
///
/// # Bad routing
///
/// An expert number outside `-1 .. experts`, or one repeated within a token, cannot be known
/// on the host without reading the routing back: the kernels drop that entry on every rank
/// alike (nothing is stored out of bounds, the ranks stay in step), write NaN over that
/// token's combined output, and report the first such entry, which
/// [`check`](Self::check) returns as [`Error::InvalidArgument`].
/// [`check_routing`](Self::check_routing) checks routing held on the host before it is
/// uploaded.
///
/// # What the ranks must keep alike, and failures
///
/// As [`LsaAllReduce`](super::LsaAllReduce)'s: every rank makes the same calls in the same
/// order (token counts may differ); a kernel whose peers do not come gives up after
/// [`timeout`](Self::timeout) (a dispatch's outputs are then unspecified, a combine writes
/// NaN over its tokens, and the instance refuses every later call with [`Error::Timeout`]);
/// a call refused on one rank alone (a bad length, a buffer of another context or
/// misaligned, a group open, a stale [`Dispatched`]) puts the instance out of step there for
/// good, and on the LSA path the peers' kernels give up. On the all-to-all-v path the peers
/// of a rank that refused wait in NCCL's send/receive, as for any NCCL collective one rank
/// skips: a [`Watchdog`](crate::Watchdog) (or an abort) ends that. Aborts, revokes and
/// shrinks with abort stop the LSA kernels first; a dropped instance lets its kernels end
/// (or stops them) before freeing what they use. Buffers of rows (`x`, the receive buffer,
/// the experts' outputs, `out`) must be 16-byte aligned. Both paths run the shipped
/// kernels: a GPU from sm_80 on (driver 580+ off sm_90).
///
/// A CUDA graph that captured calls must not be replayed after the instance is dropped, and
/// must hold each combine after its dispatch (as the calls themselves must come): a graph
/// of combines alone could let a peer's next rows overwrite ones still being summed.
pub struct ExpertExchange<'c, T: LsaElem> {
    /// Taken back by `Drop` once the kernels ended (LSA path only).
    stop: Option<ManuallyDrop<KernelStopRegistration<'c>>>,
    comm: &'c Comm,
    path: Path<'c>,
    geometry: Geometry,
    shape: ExpertShape,
    /// CTAs per call.
    ctas: u32,
    work: Work,
    /// The kernels' work buffers; freed by `Drop` once they ended, else leaked.
    work_buffers: ManuallyDrop<CudaSlice<u32>>,
    /// The kernels' [`layout::MoeState`], as u64 words; as `work_buffers`.
    state: ManuallyDrop<CudaSlice<u64>>,
    /// The host-mapped words (gave up, bad entry, its value); as `state`.
    host_words: ManuallyDrop<HostWords>,
    stopped: Arc<AtomicBool>,
    /// Its number in the communicator's flight recorder (LSA path, recorder on).
    flight_instance: Option<u32>,
    out_of_step: Option<String>,
    timeout: Duration,
    /// This instance, for its [`Dispatched`].
    id: u64,
    /// Dispatches made so far, and the one a combine may take.
    dispatches: u64,
    pending: Option<u64>,
    _elem: PhantomData<T>,
}

/// The path an instance runs, with what it owns for it.
enum Path<'c> {
    Lsa(Lsa<'c>),
    AllToAllV(fallback::Fallback),
}

/// The LSA path's window, device communicator and kernels.
struct Lsa<'c> {
    // Dropped before the window: a device communicator waits for the kernels that took it.
    dev_comm: DevComm<'c>,
    scratch: Window<'c, u32>,
    dispatch: CudaFunction,
    combine: CudaFunction,
}

impl<T: LsaElem> std::fmt::Debug for ExpertExchange<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertExchange")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("elem", &T::SUFFIX)
            .field("shape", &self.shape)
            .field("path", &self.path())
            .finish_non_exhaustive()
    }
}

/// A call's launch: `ctas` CTAs (sized at creation so that every CTA of two ranks sharing the
/// GPU is resident at once) of [`THREADS`].
fn launch_config(ctas: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (ctas.clamp(1, MAX_CTAS), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl<'c, T: LsaElem> ExpertExchange<'c, T> {
    /// Creates the exchange on `comm` for `shape`: every rank calls it with the same shape
    /// and path. The ranks agree before anything collective (a rank that cannot take part
    /// returns its own error and every other [`Error::RankRefused`]; shapes that differ give
    /// [`Error::RankMismatch`] everywhere); [`ExchangePath::Auto`] takes the shipped kernels
    /// only where every rank can run them.
    ///
    /// `shape` needs `experts` a multiple of the ranks and at most [`MAX_EXPERTS`], `top_k`
    /// from 1 to `experts`, `max_tokens × top_k` at most [`MAX_ENTRIES`], rows of a multiple
    /// of 16 bytes, and at most [`MAX_RANKS`] ranks. The LSA path's scratch window holds
    /// `2 × received_rows + max_tokens × top_k` rows per rank.
    ///
    /// No [`Group`](crate::Group) may be open on the calling thread, on any rank (as for
    /// [`LsaAllReduce::new`](super::LsaAllReduce::new)).
    pub fn new(comm: &'c Comm, shape: ExpertShape, path: ExchangePath) -> Result<Self> {
        create::create(comm, shape, path)
    }

    /// The path the ranks agreed on ([`ExchangePath::Lsa`] or [`ExchangePath::AllToAllV`]).
    pub fn path(&self) -> ExchangePath {
        match self.path {
            Path::Lsa(_) => ExchangePath::Lsa,
            Path::AllToAllV(_) => ExchangePath::AllToAllV,
        }
    }

    /// The shape.
    pub fn shape(&self) -> ExpertShape {
        self.shape
    }

    /// The communicator.
    pub fn comm(&self) -> &'c Comm {
        self.comm
    }

    /// Local experts on each rank.
    pub fn local_experts(&self) -> usize {
        self.geometry.local_experts as usize
    }

    /// How long a kernel waits for its peers before giving up (300 s unless set).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets [`timeout`](Self::timeout) for the calls enqueued from now on (a kernel captured
    /// in a CUDA graph keeps the one it was captured with).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Checks routing held on the host (`tokens × top_k` expert numbers, `-1` for none)
    /// before it is uploaded: every number in `-1 .. experts`, none repeated within a token.
    pub fn check_routing(&self, routing: &[i32]) -> Result<()> {
        check_routing(&self.shape, routing)
    }

    /// Sends this rank's `tokens` rows `x` (`tokens × hidden` elements) to the experts
    /// `routing` names (`tokens × top_k`), and receives this rank's experts' rows into
    /// `recv_x` (at least [`ExpertShape::received_rows`] rows) with each local expert's count
    /// in `recv_counts` (at least [`local_experts`](Self::local_experts) entries), on the
    /// communicator's stream. Every rank makes the call; token counts may differ.
    pub fn dispatch(
        &mut self,
        x: &impl DevicePtr<T>,
        routing: &impl DevicePtr<i32>,
        recv_x: &mut impl DevicePtrMut<T>,
        recv_counts: &mut impl DevicePtrMut<i32>,
    ) -> Result<Dispatched> {
        let result = self.dispatch_checked(x, routing, recv_x, recv_counts);
        self.refused_here(result)
    }

    fn dispatch_checked(
        &mut self,
        x: &impl DevicePtr<T>,
        routing: &impl DevicePtr<i32>,
        recv_x: &mut impl DevicePtrMut<T>,
        recv_counts: &mut impl DevicePtrMut<i32>,
    ) -> Result<Dispatched> {
        self.status()?;
        let shape = self.shape;
        let ranks = self.comm.size();
        let tokens = self.tokens_of(x.len(), "x")?;
        expect_len("routing", routing.len(), tokens * shape.top_k)?;
        expect_at_least(
            "recv_x",
            recv_x.len(),
            shape.received_rows(ranks).saturating_mul(shape.hidden),
        )?;
        expect_at_least("recv_counts", recv_counts.len(), self.local_experts())?;
        self.ready(&[
            (x.stream().context(), "x"),
            (routing.stream().context(), "the routing"),
            (recv_x.stream().context(), "recv_x"),
            (recv_counts.stream().context(), "recv_counts"),
        ])?;
        let stream = self.comm.stream().clone();
        let (xp, _x) = x.device_ptr(&stream);
        let (rp, _r) = routing.device_ptr(&stream);
        let (recv, _recv) = recv_x.device_ptr_mut(&stream);
        let (counts, _counts) = recv_counts.device_ptr_mut(&stream);
        aligned(&[(xp, "x"), (recv, "recv_x")])?;
        let tokens_arg = tokens as u32;
        let call = self.dispatches;
        match &mut self.path {
            Path::Lsa(lsa) => {
                let mut usable = usable(self.comm)?;
                let timeout_ns = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX);
                let scratch = lsa.scratch.as_raw() as u64;
                let (state, _state) = self.state.device_ptr_mut(&stream);
                // SAFETY: nccl_rs_moe_dispatch(const ncclDevComm*, ncclWindow_t, Geometry,
                // Work, const uint4* x, const int* topk, unsigned tokens, uint4* recv_x,
                // int* recv_counts, MoeState*, unsigned long long), pushed in that order. `x`
                // holds `tokens` rows and the routing `tokens × top_k` entries (checked
                // above, tokens × top_k ≤ MAX_ENTRIES by the shape), 16-byte aligned where
                // read as vectors; the kernel writes `recv_x` only below received_rows rows
                // and `recv_counts` below local_experts (both checked), its own state, its
                // work buffers (sized by `layout::work_words`) and the scratch window inside
                // the geometry's total (allocated at creation), at positions below
                // max_tokens per (expert, source) since a token names an expert once (bad
                // entries are dropped on the device).
                let launched = unsafe {
                    stream
                        .launch_builder(&lsa.dispatch)
                        .arg(&lsa.dev_comm)
                        .arg(&scratch)
                        .arg(&self.geometry)
                        .arg(&self.work)
                        .arg(&xp)
                        .arg(&rp)
                        .arg(&tokens_arg)
                        .arg(&recv)
                        .arg(&counts)
                        .arg(&state)
                        .arg(&timeout_ns)
                        .launch(launch_config(self.ctas))
                };
                record_launch::<T>(
                    &mut usable,
                    self.flight_instance,
                    ShippedKernel::ExpertDispatch,
                    tokens,
                    &stream,
                    launched.is_err(),
                );
                launched.map_err(|err| {
                    self.out_of_step
                        .get_or_insert_with(|| "a kernel launch failed here".into());
                    Error::from(err)
                })?;
            }
            Path::AllToAllV(fallback) => {
                let (state, _state) = self.state.device_ptr_mut(&stream);
                fallback.dispatch(
                    self.comm,
                    &self.geometry,
                    &self.work,
                    &self.host_words,
                    fallback::DispatchArgs {
                        x: xp,
                        routing: rp,
                        tokens: tokens_arg,
                        recv_x: recv,
                        recv_counts: counts,
                        state,
                        timeout: self.timeout,
                        ctas: self.ctas,
                    },
                )?;
            }
        }
        self.dispatches += 1;
        self.pending = Some(call);
        Ok(Dispatched {
            instance: self.id,
            call,
            tokens,
        })
    }

    /// Sends each received row's expert output (`expert_out`, in
    /// [`dispatch`](Self::dispatch)'s receive layout) back to its token's rank, and sums
    /// there into `out` (`tokens × hidden`) with `weights` (`tokens × top_k`, `f32`):
    /// `out[t] = sum over k of weights[t][k] × output(t, k)`, in `f32`, in `k` order, rounded
    /// once; a token routed nowhere gets zeros. Takes the latest dispatch's [`Dispatched`].
    pub fn combine(
        &mut self,
        dispatched: Dispatched,
        expert_out: &impl DevicePtr<T>,
        weights: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let result = self.combine_checked(dispatched, expert_out, weights, out);
        self.refused_here(result)
    }

    fn combine_checked(
        &mut self,
        dispatched: Dispatched,
        expert_out: &impl DevicePtr<T>,
        weights: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.status()?;
        if dispatched.instance != self.id || self.pending != Some(dispatched.call) {
            return Err(Error::invalid(format!(
                "ExpertExchange::combine on rank {}: this Dispatched is not the instance's \
                 latest dispatch still to combine (dispatch #{}, the pending one {:?})",
                self.comm.rank(),
                dispatched.call,
                self.pending
            )));
        }
        let shape = self.shape;
        let tokens = dispatched.tokens;
        expect_at_least(
            "expert_out",
            expert_out.len(),
            shape
                .received_rows(self.comm.size())
                .saturating_mul(shape.hidden),
        )?;
        expect_len("weights", weights.len(), tokens * shape.top_k)?;
        expect_len("out", out.len(), tokens * shape.hidden)?;
        self.ready(&[
            (expert_out.stream().context(), "expert_out"),
            (weights.stream().context(), "the weights"),
            (out.stream().context(), "out"),
        ])?;
        let stream = self.comm.stream().clone();
        let (eo, _eo) = expert_out.device_ptr(&stream);
        let (wp, _w) = weights.device_ptr(&stream);
        let (op, _o) = out.device_ptr_mut(&stream);
        aligned(&[(eo, "expert_out"), (op, "out")])?;
        let tokens_arg = tokens as u32;
        match &mut self.path {
            Path::Lsa(lsa) => {
                let mut usable = usable(self.comm)?;
                let timeout_ns = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX);
                let scratch = lsa.scratch.as_raw() as u64;
                let (state, _state) = self.state.device_ptr_mut(&stream);
                // SAFETY: nccl_rs_moe_combine_T(const ncclDevComm*, ncclWindow_t, Geometry,
                // Work, const uint4* expert_out, const float* weights, T* out, unsigned
                // tokens, MoeState*, unsigned long long), in that order. It reads
                // `expert_out` below the received rows (checked) at the packed rows the
                // latest dispatch recorded in the work buffers, `weights` and writes `out`
                // for `tokens` tokens (checked, the dispatch's own count), its state and the
                // scratch window's combine rows and flags (entries < max_tokens × top_k).
                let launched = unsafe {
                    stream
                        .launch_builder(&lsa.combine)
                        .arg(&lsa.dev_comm)
                        .arg(&scratch)
                        .arg(&self.geometry)
                        .arg(&self.work)
                        .arg(&eo)
                        .arg(&wp)
                        .arg(&op)
                        .arg(&tokens_arg)
                        .arg(&state)
                        .arg(&timeout_ns)
                        .launch(launch_config(self.ctas))
                };
                record_launch::<T>(
                    &mut usable,
                    self.flight_instance,
                    ShippedKernel::ExpertCombine,
                    tokens,
                    &stream,
                    launched.is_err(),
                );
                launched.map_err(|err| {
                    self.out_of_step
                        .get_or_insert_with(|| "a kernel launch failed here".into());
                    Error::from(err)
                })?;
            }
            Path::AllToAllV(fallback) => {
                fallback.combine(
                    self.comm,
                    &self.geometry,
                    &self.work,
                    fallback::CombineArgs {
                        expert_out: eo,
                        weights: wp,
                        out: op,
                        tokens: tokens_arg,
                        ctas: self.ctas,
                    },
                )?;
            }
        }
        self.pending = None;
        Ok(())
    }

    /// Whether the kernels gave up ([`Error::Timeout`]), the instance is out of step or its
    /// kernels were stopped ([`Error::InvalidUsage`]), without waiting for the GPU: what every
    /// call checks first. Bad routing is not among them (see [`check`](Self::check)).
    pub fn status(&self) -> Result<()> {
        if let Some(why) = &self.out_of_step {
            return Err(Error::usage(format!(
                "ExpertExchange on rank {}: out of step with its peers since a call was \
                 refused here alone ({why}); drop it on every rank and make a new one",
                self.comm.rank()
            )));
        }
        // A stop (abort, revoke, shrink) makes the kernels leave through the give-up
        // path too: said as what it was, not as a timeout.
        if self.stopped.load(Ordering::Acquire) {
            return Err(Error::usage(format!(
                "ExpertExchange on rank {}: its kernels were stopped (its communicator was \
                 aborted, revoked or shrunk with ShrinkMode::Abort); drop it on every rank and \
                 make a new one",
                self.comm.rank()
            )));
        }
        if self.host_words.is_set() {
            return Err(Error::Timeout {
                what: format!(
                    "ExpertExchange on rank {}: a kernel's peers to send their rows (it gave up \
                     after {:?}; its outputs are NaN): drop it on every rank and make a new one",
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
    /// [`status`](Self::status) does, and bad routing a dispatch since the last `check` met
    /// ([`Error::InvalidArgument`] naming the first entry; the report is taken, and the
    /// instance stays usable: every rank's kernels dropped the entry alike).
    pub fn check(&self) -> Result<()> {
        let limit = self.timeout.saturating_add(Duration::from_secs(10));
        self.comm.wait_stream(self.comm.stream(), Some(limit))?;
        self.status()?;
        let bad = self.host_words.word(BAD_ENTRY_WORD);
        if bad == 0 {
            return Ok(());
        }
        let value = self.host_words.word(BAD_VALUE_WORD) as i32;
        self.host_words.clear(BAD_ENTRY_WORD);
        let entry = (bad - 1) as usize;
        let k = self.shape.top_k.max(1);
        Err(Error::invalid(format!(
            "ExpertExchange on rank {}: routing entry {entry} (token {}, choice {}) is {value}: \
             expert numbers lie in -1..{} and a token names an expert once; the entry was \
             dropped (on every rank alike) and the token's combined output is NaN",
            self.comm.rank(),
            entry / k,
            entry % k,
            self.shape.experts
        )))
    }

    /// Puts the instance out of step for good, saying `why` (see
    /// [`LsaAllReduce::put_out_of_step`](super::LsaAllReduce::put_out_of_step)).
    pub fn put_out_of_step(&mut self, why: impl Into<String>) {
        if self.out_of_step.is_none() {
            self.out_of_step = Some(why.into());
        }
    }

    fn refused_here<R>(&mut self, result: Result<R>) -> Result<R> {
        if let Err(err) = &result {
            if self.status().is_ok() {
                self.put_out_of_step(format!("a call was refused here: {err}"));
            }
        }
        result
    }

    /// Tokens in a buffer of `len` elements.
    fn tokens_of(&self, len: usize, what: &str) -> Result<usize> {
        let hidden = self.shape.hidden;
        if !len.is_multiple_of(hidden) || len / hidden > self.shape.max_tokens {
            return Err(Error::invalid(format!(
                "ExpertExchange: {what} holds {len} elements: whole rows of {hidden}, at most \
                 {} of them (max_tokens)",
                self.shape.max_tokens
            )));
        }
        Ok(len / hidden)
    }

    fn ready(&mut self, buffers: &[(&Arc<CudaContext>, &str)]) -> Result<()> {
        thread_group::ensure_outside("ExpertExchange")?;
        buffers.iter().try_for_each(|(ctx, what)| {
            self.comm.check_context_of(ContextId::of(ctx), || ctx, what)
        })
    }

    /// Runs `mark` on the communicator's flight recorder with this instance's number, where
    /// it has one. Takes the communicator's lock: never called under it.
    fn flight_mark(&self, mark: fn(&mut FlightRing, u32)) {
        if let Some(instance) = self.flight_instance {
            if let Some(ring) = self.comm.shared().lock().flight.as_deref_mut() {
                mark(ring, instance);
            }
        }
    }
}

/// Records a launch of `kernel` by instance `instance` (`count` tokens) in the communicator's
/// flight recorder, under its lock `state`, which the launch holds; `refused` where the launch
/// failed.
fn record_launch<T: LsaElem>(
    state: &mut crate::comm::state::State,
    instance: Option<u32>,
    kernel: ShippedKernel,
    count: usize,
    stream: &CudaStream,
    refused: bool,
) {
    if let (Some(instance), Some(ring)) = (instance, state.flight.as_deref_mut()) {
        ring.record_shipped(RawShipped::launch(
            instance,
            kernel,
            T::DATA_TYPE,
            count,
            stream.cu_stream() as u64,
            refused,
        ));
    }
}

/// The communicator's lock, once it may still run work (an abort from another thread waits
/// for the launch made under it).
fn usable(comm: &Comm) -> Result<parking_lot::MutexGuard<'_, crate::comm::state::State>> {
    comm.usable(&calls::ncclAlltoAll)
}

fn expect_len(what: &str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(Error::invalid(format!(
            "ExpertExchange: {what} holds {len} elements, not {expected}"
        )));
    }
    Ok(())
}

fn expect_at_least(what: &str, len: usize, needed: usize) -> Result<()> {
    if len < needed {
        return Err(Error::invalid(format!(
            "ExpertExchange: {what} holds {len} elements, fewer than the {needed} it needs"
        )));
    }
    Ok(())
}

fn aligned(ptrs: &[(u64, &str)]) -> Result<()> {
    match ptrs.iter().find(|(p, _)| p % 16 != 0) {
        Some((p, what)) => Err(Error::invalid(format!(
            "ExpertExchange: {what} at {p:#x} is not 16-byte aligned (its rows move as 16-byte \
             vectors)"
        ))),
        None => Ok(()),
    }
}

/// See [`ExpertExchange::check_routing`].
fn check_routing(shape: &ExpertShape, routing: &[i32]) -> Result<()> {
    let k = shape.top_k.max(1);
    if !routing.len().is_multiple_of(k) || routing.len() / k > shape.max_tokens {
        return Err(Error::invalid(format!(
            "ExpertExchange: the routing holds {} entries: whole tokens of top_k = {k}, at \
             most max_tokens = {}",
            routing.len(),
            shape.max_tokens
        )));
    }
    for (t, token) in routing.chunks_exact(k).enumerate() {
        for (c, &e) in token.iter().enumerate() {
            let repeated = e >= 0 && token[..c].contains(&e);
            if e < -1 || e as i64 >= shape.experts as i64 || repeated {
                return Err(Error::invalid(format!(
                    "ExpertExchange: token {t}'s choice {c} is {e}: expert numbers lie in \
                     -1..{} and a token names an expert once",
                    shape.experts
                )));
            }
        }
    }
    Ok(())
}

/// A process-wide number for each instance (its [`Dispatched`] carry it).
fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// As [`LsaAllReduce`](super::LsaAllReduce)'s drop: the kernels get
/// [`Comm::drop_timeout`] to end, then are stopped and get a second more; what they use is
/// freed only once they ended, else leaked.
impl<T: LsaElem> Drop for ExpertExchange<'_, T> {
    fn drop(&mut self) {
        let mut ended = stream_work_ends_within(self.comm, self.comm.drop_timeout());
        let mut written = true;
        if !ended {
            written = self.stop.as_ref().is_none_or(|stop| stop.stop_now());
            if written {
                self.flight_mark(FlightRing::shipped_stopped);
            }
            ended = stream_work_ends_within(self.comm, AFTER_STOP);
        }
        if self.host_words.is_set() {
            self.flight_mark(FlightRing::shipped_gave_up);
        }
        self.flight_mark(FlightRing::shipped_instance_dropped);
        if ended {
            // SAFETY: no kernel of the instance can run any more; none is touched again.
            unsafe {
                if let Some(stop) = self.stop.as_mut() {
                    ManuallyDrop::drop(stop);
                }
                ManuallyDrop::drop(&mut self.state);
                ManuallyDrop::drop(&mut self.work_buffers);
                ManuallyDrop::drop(&mut self.host_words);
            }
        } else if written {
            // A kernel still queued returns at once when it runs (reading its state only).
            // SAFETY: not touched again; the rest is leaked.
            if let Some(stop) = self.stop.as_mut() {
                unsafe { ManuallyDrop::drop(stop) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_routing_checks_range_repeats_and_length() {
        let shape = ExpertShape::new(8, 2, 16, 3);
        assert!(check_routing(&shape, &[0, 1, 7, -1, -1, -1]).is_ok());
        assert!(check_routing(&shape, &[]).is_ok());
        for bad in [[0, 8], [-2, 1], [3, 3]] {
            let err = check_routing(&shape, &[0, 1, bad[0], bad[1]]).unwrap_err();
            assert!(err.to_string().contains("token 1"), "{err}");
        }
        assert!(check_routing(&shape, &[0, 1, 2]).is_err());
        assert!(check_routing(&shape, &[0; 8]).is_err());
    }

    #[test]
    fn received_rows_are_local_experts_by_ranks_by_tokens() {
        let shape = ExpertShape::new(256, 8, 7168, 128);
        assert_eq!(shape.local_experts(8), 32);
        assert_eq!(shape.received_rows(8), 32 * 8 * 128);
    }
}
