//! One-sided RMA on windows (NCCL 2.29): [`Window::put_signal`], [`Window::signal`] and
//! [`Window::wait_signal`].
//!
//! `put_signal` writes elements of a local window into a peer's window and then raises a
//! signal on the peer; `signal` raises one without data; `wait_signal` makes a stream wait
//! until given numbers of signals have arrived, after which the data put before them is
//! visible. Only the initiator calls `put_signal`: the target takes part only through its
//! `wait_signal`. Each call returns once the operation is enqueued on the stream.
//!
//! # Rules (NCCL's `docs/api/p2p.rst` and `rmaTaskAppend` in `src/enqueue.cc`, 2.29 to 2.32)
//!
//! * The peer's window is named by **this rank's own** handle of the collectively registered
//!   window: call `put_signal` on your `Window` of that registration. Offsets into it are in
//!   elements here (bytes in C) and are checked against this rank's window length and the
//!   target's (learnt at registration; from NCCL 2.30.7 ranks may register different sizes,
//!   and NCCL itself checks only the local one). A put to this rank itself is refused.
//! * The source must lie in a window registered with [`WindowFlags::COLL_SYMMETRIC`] on the
//!   same communicator, so it is a [`WindowView`].
//! * Signals are numbered by [`Signal::index`] below the communicator's `numRmaSig` and
//!   [`Signal::context`] below its `numRmaCtx` ([`CommConfig`](crate::CommConfig), NCCL 2.31;
//!   both 1 by default, and `NCCL_NUM_RMA_CTX` overrides the configuration). NCCL 2.29 and
//!   2.30 know only signal 0 of context 0: anything else is [`Error::Unsupported`] there.
//!   From 2.31 NCCL itself checks the upper bounds, which only it knows, and refuses others
//!   with `ncclInvalidArgument` (not fatal).
//! * Operations to one peer on one context arrive in order; a signal guarantees that the
//!   data of every earlier put to that peer and context has arrived.
//! * The source must not be written until the put has completed on its stream; the borrow
//!   and cudarc's event tracking take care of that for work on other streams.
//! * The communicator must support host RMA (`hostRmaSupport` of
//!   [`Comm::properties`](crate::Comm::properties)), and the CUDA driver must be 12.5 or
//!   newer; otherwise the calls fail with [`Error::Unavailable`] before reaching NCCL.
//! * Capturing RMA into a CUDA graph needs NCCL 2.30.3.
//!
//! # Setting RMA up: every rank at once
//!
//! NCCL sets RMA up with a step every rank of the communicator must take together (a window
//! registration of its own, a bootstrap all-gather and a barrier: `ncclRmaCeInit` in
//! `src/dev_runtime.cc`), and when depends on the version:
//!
//! * 2.29 and 2.30: at the first `ncclPutSignal`, `ncclSignal` or `ncclWaitSignal` on each
//!   rank (`ncclRmaCeInitTask`, v2.29.2 `src/enqueue.cc:2779`, v2.30.7 `:2912`). Ranks that
//!   never make an RMA call would leave the others waiting forever. So this crate takes that
//!   step at the first window registration on the communicator, where every rank is
//!   present: once the window is registered, each rank signals the next and waits for one
//!   signal from the previous, on the communicator's stream, and waits for that. Where not
//!   every rank can (on any rank: no host RMA support, a CUDA driver older than 12.5, or
//!   NCCL's own rank-local checks of its first RMA call not known to pass; the ranks agree on
//!   it at registration), the window still registers, RMA stays off on that communicator and
//!   every RMA call is refused with [`Error::Unavailable`].
//!
//!   NCCL's first RMA call checks, on its own rank, before anything collective:
//!   `hostRmaSupport` from 2.29.4 (computed from values every rank gathered, so the same on
//!   every rank, and reported by [`Comm::properties`](crate::Comm::properties)), and on
//!   2.29.2/2.29.3 symmetric support and, across nodes, `rmaProxySupport` (v2.29.3
//!   `rmaTaskAppend`, `src/enqueue.cc:2691`), which depends on each process's network plugin
//!   and is reported nowhere. A rank refused there returns `ncclInvalidArgument` at once while
//!   the others go on into the collective set-up (`ncclRmaCeInit`: a window registration of
//!   NCCL's own) and wait for it forever, and a set-up that failed on every rank made the
//!   registration fail. So the step is only taken where those checks are known to pass on
//!   every rank: on 2.29.2/2.29.3 only on communicators without GIN, whose registered window
//!   proves a single node. What can still fail is inside NCCL's
//!   collective set-up (an allocation, its signal window, a stream); that fails the
//!   registration with NCCL's error, as a failure of NCCL's own registration would.
//! * 2.31 and later: at the first window registration (or at creation, with
//!   `rmaEagerInit`/`NCCL_RMA_EAGER_INIT`), which is collective anyway; nothing to do here.
//!   A signal or wait before any registration is `ncclInvalidUsage` there, which cannot
//!   happen here (RMA calls are methods of a registered window).
//!
//! A wait changes what the window holds, so no view of it may be alive across one:
//!
//! ```compile_fail
//! fn f(window: &mut nccl::Window<'_, f32>) -> nccl::Result<()> {
//!     let source = window.view(0..4)?;
//!     window.wait_signal(&[nccl::SignalWait::new(1, 1)])?;
//!     window.put_signal(&source, 1, 4, nccl::Signal::default())
//! }
//! ```
//!
//! # Mismatched counts hang the stream
//!
//! `wait_signal` waits on the GPU until the counts it names have arrived. If the peers send
//! fewer signals, the stream never proceeds: nothing fails, the work behind it just never
//! runs. Wait for such streams with [`Comm::synchronize_timeout`](crate::Comm::synchronize_timeout)
//! or guard the communicator with a [`Watchdog`](crate::Watchdog), which turn the hang into
//! [`Error::Timeout`]. Signals that arrive later still release the stream.

use std::os::raw::c_int;
use std::sync::OnceLock;

use cudarc::driver::sys::{cudaError_enum, CUstreamCaptureStatus};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError};
use nccl_sys::ncclWaitSignalDesc_t;

use super::view::WindowView;
use super::{Window, WindowFlags};
use crate::calls::{self, Call};
use crate::comm::comm_call;
use crate::comm::{Comm, Membership, RmaSetup};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::properties::GinType;
use crate::release::Version;
use crate::thread_group::{self, RawGroup};

/// First NCCL with `ncclPutSignal`, `ncclSignal` and `ncclWaitSignal`.
pub const RMA_SINCE: Version = calls::ncclPutSignal.since;
/// First NCCL that captures one-sided RMA into CUDA graphs.
pub const RMA_GRAPH_CAPTURE_SINCE: Version = Version::new(2, 30, 3);
/// First NCCL with more than one RMA context and signal (`numRmaCtx`, `numRmaSig`).
pub const RMA_SIGNALS_SINCE: Version = Version::new(2, 31, 0);
/// First NCCL that sets RMA up at the first window registration (or at creation with
/// `rmaEagerInit`) instead of at the first RMA call.
pub const RMA_SETUP_AT_REGISTRATION_SINCE: Version = Version::new(2, 31, 0);
/// The oldest CUDA driver NCCL runs one-sided RMA on (12.5, as `cuDriverGetVersion` codes
/// it).
pub const RMA_MIN_DRIVER: i32 = 12050;

/// Which signal an RMA operation raises or waits for; see the [module docs](crate::window::rma).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Signal {
    /// The signal index (`sigIdx`), below the communicator's `numRmaSig`.
    pub index: u32,
    /// The RMA context (`ctx`), below the communicator's `numRmaCtx`.
    pub context: u32,
}

impl Signal {
    /// Signal `index` of context `context`.
    pub const fn new(index: u32, context: u32) -> Self {
        Self { index, context }
    }

    /// `(sigIdx, ctx)` for NCCL `found`.
    fn to_raw(self, found: Version) -> Result<(c_int, c_int)> {
        if found < RMA_SIGNALS_SINCE && self != Signal::default() {
            return Err(Error::Unsupported {
                api: "RMA signal indices and contexts other than 0",
                needs: RMA_SIGNALS_SINCE,
                found,
            });
        }
        let int = |value: u32, what: &str| {
            c_int::try_from(value)
                .map_err(|_| Error::invalid(format!("the RMA {what} {value} does not fit a C int")))
        };
        Ok((
            int(self.index, "signal index")?,
            int(self.context, "context")?,
        ))
    }
}

/// One entry of [`Window::wait_signal`]: wait for `count` signals `signal` from `peer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SignalWait {
    /// The rank the signals come from.
    pub peer: usize,
    /// How many signals to wait for (at least 1).
    pub count: u32,
    /// Which signal.
    pub signal: Signal,
}

impl SignalWait {
    /// Wait for `count` signals 0 of context 0 from `peer`.
    pub const fn new(peer: usize, count: u32) -> Self {
        Self {
            peer,
            count,
            signal: Signal::new(0, 0),
        }
    }

    /// The same wait, on another signal.
    pub const fn on(self, signal: Signal) -> Self {
        Self { signal, ..self }
    }
}

fn check_peer(peer: usize, size: usize, api: &str) -> Result<c_int> {
    if peer >= size {
        return Err(Error::invalid(format!(
            "{api}: peer {peer} is out of range for a communicator of {size} ranks"
        )));
    }
    // The size came from NCCL as a C int.
    Ok(peer as c_int)
}

/// The byte offset of a put of `count` elements at element `offset` of a window of
/// `window_len` elements.
fn put_extent(offset: usize, count: usize, window_len: usize, elem: usize) -> Result<usize> {
    match offset.checked_add(count) {
        Some(end) if end <= window_len => Ok(offset * elem),
        _ => Err(Error::invalid(format!(
            "ncclPutSignal: {count} elements at offset {offset} do not fit the window of \
             {window_len} elements"
        ))),
    }
}

/// The most elements a put to `peer` may reach: this rank's window length (what NCCL checks)
/// and the target's (`peer_len`, learnt at registration; from NCCL 2.30.7 it may be
/// smaller, and NCCL does not check it). A put to this rank itself is refused: it has no
/// peer to signal, and a copy within the window does the same.
fn put_bound(me: usize, peer: usize, own_len: usize, peer_len: Option<usize>) -> Result<usize> {
    if peer == me {
        return Err(Error::invalid(format!(
            "ncclPutSignal: the peer {peer} is this rank; put to another rank (or copy within \
             the window)"
        )));
    }
    Ok(peer_len.map_or(own_len, |len| len.min(own_len)))
}

/// The source of a put must be a view of a symmetric window of the same communicator.
fn check_source(same_comm: bool, flags: WindowFlags) -> Result<()> {
    if !same_comm {
        return Err(Error::invalid(
            "ncclPutSignal: the source is a window of another communicator",
        ));
    }
    if !flags.contains(WindowFlags::COLL_SYMMETRIC) {
        return Err(Error::invalid(
            "ncclPutSignal: the source must lie in a window registered with \
             WindowFlags::COLL_SYMMETRIC",
        ));
    }
    Ok(())
}

/// NCCL's descriptors for `waits`, checked.
fn wait_descriptors(
    waits: &[SignalWait],
    size: usize,
    found: Version,
) -> Result<Vec<ncclWaitSignalDesc_t>> {
    if waits.is_empty() {
        return Err(Error::invalid("ncclWaitSignal needs at least one wait"));
    }
    if c_int::try_from(waits.len()).is_err() {
        return Err(Error::invalid(format!(
            "ncclWaitSignal: {} waits do not fit a C int",
            waits.len()
        )));
    }
    waits
        .iter()
        .map(|wait| {
            let peer = check_peer(wait.peer, size, calls::ncclWaitSignal.name)?;
            let count = match c_int::try_from(wait.count) {
                Ok(count) if count > 0 => count,
                _ => {
                    return Err(Error::invalid(format!(
                        "ncclWaitSignal: the count for peer {} must be between 1 and {}, got {}",
                        wait.peer,
                        c_int::MAX,
                        wait.count
                    )))
                }
            };
            let (sig_idx, ctx) = wait.signal.to_raw(found)?;
            Ok(ncclWaitSignalDesc_t {
                opCnt: count,
                peer,
                sigIdx: sig_idx,
                ctx,
            })
        })
        .collect()
}

/// The CUDA driver's version, as `cuDriverGetVersion` codes it (12050 is 12.5).
fn driver_version() -> Result<i32> {
    static VERSION: OnceLock<i32> = OnceLock::new();
    if let Some(version) = VERSION.get() {
        return Ok(*version);
    }
    let mut version = 0;
    // SAFETY: `version` is a valid out-pointer; cuDriverGetVersion has no other
    // preconditions (it works before cuInit). Only reached with a live communicator, so the
    // driver library is loaded.
    let rc = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    if rc != cudaError_enum::CUDA_SUCCESS {
        return Err(Error::Cuda(DriverError(rc)));
    }
    Ok(*VERSION.get_or_init(|| version))
}

fn check_driver(version: i32) -> Result<()> {
    if version < RMA_MIN_DRIVER {
        return Err(Error::Unavailable {
            api: "one-sided RMA",
            reason: format!(
                "NCCL needs a CUDA 12.5 or newer driver for it; this one is {}.{}",
                version / 1000,
                (version % 1000) / 10
            ),
        });
    }
    Ok(())
}

/// Whether NCCL `version` sets RMA up at the first RMA call (2.29, 2.30).
pub(crate) fn lazy_setup(version: Version) -> bool {
    (RMA_SINCE..RMA_SETUP_AT_REGISTRATION_SINCE).contains(&version)
}

/// Whether NCCL's rank-local checks of its first RMA call (`rmaTaskAppend` in
/// `src/enqueue.cc`) will pass on this rank, from what the communicator reports before its
/// window is registered: `host_rma` (`hostRmaSupport`, 2.29.4) and `gin` (the GIN type, which
/// 2.29.2 and 2.29.3 report too). See the [module docs](self#setting-rma-up-every-rank-at-once).
///
/// * 2.29.4 and later check `hostRmaSupport`, which NCCL computes from values all ranks
///   gathered (v2.29.7 `src/init.cc:1477`): the answer is the report itself.
/// * 2.29.2 and 2.29.3 check `symmetricSupport`, then refuse `nNodes > 1` without
///   `rmaProxySupport` (v2.29.3 `src/enqueue.cc:2691-2699`). A registered window proves
///   symmetric support, which needs `ginSupport || nNodes == 1` (`src/init.cc:1442`), so a
///   communicator without GIN has one node and passes. With GIN it may span nodes, and
///   `rmaProxySupport` is each process's own state of its network plugin's RMA part
///   (`src/plugin/net.cc`), which nothing reports: the answer is no.
pub(crate) fn local_checks_pass(host_rma: Option<bool>, gin: Option<GinType>) -> bool {
    match host_rma {
        Some(supported) => supported,
        None => gin == Some(GinType::None),
    }
}

/// Whether this rank needs RMA set up at this registration and can take the step: a lazy
/// NCCL, not set up yet, NCCL's rank-local checks known to pass ([`local_checks_pass`]), a
/// driver NCCL runs RMA on. The ranks agree on it through the registration's exchange, so
/// that either every rank takes NCCL's collective step or none does.
pub(crate) fn can_set_up(comm: &Comm, checks_pass: bool) -> bool {
    lazy_setup(comm.library().version())
        && comm.rma_setup.get() == RmaSetup::Pending
        && checks_pass
        && driver_version().is_ok_and(|v| check_driver(v).is_ok())
}

/// Records the registration's verdict on RMA for `comm`: set up (`done`), or off when the
/// NCCL needed the step and not every rank could take it.
pub(crate) fn record_setup(comm: &Comm, done: bool) {
    let state = if done || !lazy_setup(comm.library().version()) {
        RmaSetup::Ready
    } else {
        RmaSetup::Refused
    };
    comm.rma_setup.set(state);
}

/// Takes NCCL's RMA set-up step on every communicator of `comms` together (see the module
/// docs): each rank signals the next and waits for the previous one, all in one group, then
/// waits for the stream. Used right after a registration, where every rank is present.
pub(crate) fn set_up(comms: &[&Comm]) -> Result<()> {
    let Some(first) = comms.first() else {
        return Ok(());
    };
    let lib = first.library();
    // Entered before the group starts, so it is left (running an abort deferred meanwhile)
    // only after the group has ended, also on an early return.
    let mut membership = Membership::enter(comms.iter().copied());
    let mut group = RawGroup::start(lib)?;
    let mut failure = None;
    for comm in comms {
        let (r, n) = (comm.rank(), comm.size());
        // Sizes came from NCCL as C ints.
        let (next, prev) = (((r + 1) % n) as c_int, ((r + n - 1) % n) as c_int);
        let mut wait = [ncclWaitSignalDesc_t {
            opCnt: 1,
            peer: prev,
            sigIdx: 0,
            ctx: 0,
        }];
        let stream = comm.stream().cu_stream() as nccl_sys::cudaStream_t;
        let issued = comm
            .with_raw(&calls::ncclSignal, |raw| {
                // SAFETY: live communicator under its lock; `next` is a rank of it; signal
                // and context 0 exist on every version; flags are reserved (0).
                unsafe { lib.api().ncclSignal(next, 0, 0, 0, raw, stream) }
            })
            .and_then(|status| lib.check_pending(calls::ncclSignal.name, status))
            .and_then(|_| {
                comm.with_raw(&calls::ncclWaitSignal, |raw| {
                    // SAFETY: live communicator under its lock; one checked descriptor that
                    // outlives the call (NCCL copies it).
                    unsafe { lib.api().ncclWaitSignal(1, wait.as_mut_ptr(), raw, stream) }
                })
            })
            .and_then(|status| lib.check_pending(calls::ncclWaitSignal.name, status));
        if let Err(err) = issued {
            failure = Some(err);
            break;
        }
    }
    let ended = group.end();
    if let Some(err) = membership.leave("RMA set-up") {
        failure.get_or_insert(err);
    }
    if let Err(err) = ended {
        failure.get_or_insert(err);
    }
    // Nonblocking communicators finish the group (and NCCL's set-up) in the background.
    for comm in comms {
        let timeout = (!comm.is_blocking()).then(|| comm.ready_timeout());
        let settled = match timeout {
            Some(limit) => comm
                .wait_ready(limit)
                .map_err(|err| comm.abandon_in_progress(err)),
            None => Ok(()),
        };
        let waited = settled.and_then(|()| {
            comm.wait_stream(comm.stream(), timeout)
                .map_err(|err| match err {
                    Error::Timeout { .. } => comm.abort_stalled(
                        "the RMA set-up signals to arrive",
                        "a late rank would pair with them",
                        err,
                    ),
                    other => other,
                })
        });
        if let Err(err) = waited {
            failure.get_or_insert(err);
        }
    }
    match failure {
        Some(err) => Err(err),
        None => Ok(()),
    }
}

impl<T: NcclType> Window<'_, T> {
    /// What every RMA call checks before NCCL sees it.
    fn rma_ready(&self, row: &'static Call, stream: &CudaStream) -> Result<()> {
        let api = row.name;
        let lib = self.comm().library();
        lib.require_call(row)?;
        thread_group::ensure_outside(api)?;
        self.comm().check_stream(stream, "the stream")?;
        if self.comm().rma_setup.get() != RmaSetup::Ready && lazy_setup(lib.version()) {
            return Err(Error::Unavailable {
                api,
                reason: format!(
                    "NCCL {} sets RMA up at the first RMA call, a step every rank takes \
                     together; not every rank could take it when this communicator's first \
                     window was registered (no host RMA support, a CUDA driver older than \
                     12.5, or, on NCCL 2.29.2/2.29.3, which do not report host RMA support, a \
                     communicator with GIN, which may span nodes without NCCL's RMA proxy, \
                     on some rank), so RMA is off here",
                    lib.version()
                ),
            });
        }
        if self.host_rma == Some(false) {
            return Err(Error::Unavailable {
                api,
                reason: "the communicator has no host RMA support (ncclCommQueryProperties \
                         reports hostRmaSupport = false)"
                    .into(),
            });
        }
        check_driver(driver_version()?)?;
        if lib.version() < RMA_GRAPH_CAPTURE_SINCE
            && stream.capture_status()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        {
            return Err(Error::Unsupported {
                api: "one-sided RMA during CUDA graph capture",
                needs: RMA_GRAPH_CAPTURE_SINCE,
                found: lib.version(),
            });
        }
        Ok(())
    }

    /// Puts `source` into rank `peer`'s copy of this window at element `offset`, then raises
    /// `signal` on `peer` (`ncclPutSignal`, NCCL 2.29), on the communicator's stream. See the
    /// [module docs](crate::window::rma).
    pub fn put_signal(
        &self,
        source: &WindowView<'_, T>,
        peer: usize,
        offset: usize,
        signal: Signal,
    ) -> Result<()> {
        self.put_signal_on(self.comm().stream(), source, peer, offset, signal)
    }

    /// [`Window::put_signal`] on `stream` (on the communicator's device); a stream other
    /// than the communicator's own is noted as for [`Comm::enqueue_on`](crate::Comm::enqueue_on),
    /// so ending the communicator waits for the work there too (as for `signal_on` and
    /// `wait_signal_on`).
    pub fn put_signal_on(
        &self,
        stream: &CudaStream,
        source: &WindowView<'_, T>,
        peer: usize,
        offset: usize,
        signal: Signal,
    ) -> Result<()> {
        const ROW: &Call = &calls::ncclPutSignal;
        const API: &str = ROW.name;
        self.rma_ready(ROW, stream)?;
        let lib = self.comm().library();
        let peer = check_peer(peer, self.comm().size(), API)?;
        let (sig_idx, ctx) = signal.to_raw(lib.version())?;
        check_source(
            source.comm().shared_ptr() == self.comm().shared_ptr(),
            source.window_flags(),
        )?;
        let target = peer as usize;
        let target_len = put_bound(
            self.comm().rank(),
            target,
            self.len(),
            self.peer_len(target),
        )?;
        let count = source.len();
        let byte_offset = put_extent(offset, count, target_len, std::mem::size_of::<T>())?;
        let win = self.as_raw();
        // Orders the stream after earlier writes of the source; records the read afterwards.
        let (src, _read) = source.device_ptr(stream);
        let cu_stream = stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: live communicator under its lock; `src` points to `count` elements of a
        // symmetric window of this communicator, borrowed until the call returns and ordered
        // by cudarc's events; `win` is this rank's handle of a window registered on it, and
        // `byte_offset + count` elements fit this rank's window; the peer, signal and context
        // were checked; flags are reserved (0).
        let called = unsafe {
            comm_call!(self.comm(), |raw| ncclPutSignal(
                src as *const std::ffi::c_void,
                count,
                T::DATA_TYPE.raw(),
                peer,
                win,
                byte_offset,
                sig_idx,
                ctx,
                0,
                raw,
                cu_stream,
            ))
        };
        self.comm().note_stream(stream);
        called
    }

    /// Raises `signal` on rank `peer` without data (`ncclSignal`, NCCL 2.29), on the
    /// communicator's stream.
    pub fn signal(&self, peer: usize, signal: Signal) -> Result<()> {
        self.signal_on(self.comm().stream(), peer, signal)
    }

    /// [`Window::signal`] on `stream` (on the communicator's device).
    pub fn signal_on(&self, stream: &CudaStream, peer: usize, signal: Signal) -> Result<()> {
        const ROW: &Call = &calls::ncclSignal;
        const API: &str = ROW.name;
        self.rma_ready(ROW, stream)?;
        let lib = self.comm().library();
        let peer = check_peer(peer, self.comm().size(), API)?;
        let (sig_idx, ctx) = signal.to_raw(lib.version())?;
        let cu_stream = stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: live communicator under its lock; peer, signal and context checked; flags
        // are reserved (0).
        let called = unsafe {
            comm_call!(self.comm(), |raw| ncclSignal(
                peer, sig_idx, ctx, 0, raw, cu_stream
            ))
        };
        self.comm().note_stream(stream);
        called
    }

    /// Makes the communicator's stream wait until every wait in `waits` has received its
    /// count of signals (`ncclWaitSignal`, NCCL 2.29); the data put before them, into this
    /// window or any other, is then visible on the stream.
    ///
    /// It takes the window mutably, as peers' puts change its contents: no view of it is
    /// alive across the wait, and with cudarc's event tracking later readers on other
    /// streams wait for it. Puts into *other* windows become visible on `stream` too, but
    /// only this window records the wait: read another window that peers put into on this
    /// stream, or order your other stream after this one yourself (that window's own events
    /// know nothing of the wait). Counts the peers never send hang the stream (see the
    /// [module docs](crate::window::rma)).
    pub fn wait_signal(&mut self, waits: &[SignalWait]) -> Result<()> {
        let stream = self.comm().stream().clone();
        self.wait_signal_on(&stream, waits)
    }

    /// [`Window::wait_signal`] on `stream` (on the communicator's device).
    pub fn wait_signal_on(&mut self, stream: &CudaStream, waits: &[SignalWait]) -> Result<()> {
        const ROW: &Call = &calls::ncclWaitSignal;
        self.rma_ready(ROW, stream)?;
        let comm = self.comm();
        let lib = comm.library();
        let mut descs = wait_descriptors(waits, comm.size(), lib.version())?;
        let n_desc = descs.len() as c_int;
        // Orders the wait after earlier uses of the window; records it as a write.
        let (_, _write) = self.buffer.device_ptr_mut(stream);
        let cu_stream = stream.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: live communicator under its lock; `descs` holds `n_desc` checked
        // descriptors and outlives the call (NCCL copies them into its tasks).
        let called = unsafe {
            comm_call!(comm, |raw| ncclWaitSignal(
                n_desc,
                descs.as_mut_ptr(),
                raw,
                cu_stream
            ))
        };
        comm.note_stream(stream);
        called
    }
}

#[cfg(test)]
mod tests;
