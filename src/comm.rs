//! Communicators: creation, queries, and their end of life.
//!
//! A [`Comm`] is one rank of an NCCL communicator, bound to one GPU and to a default CUDA
//! stream on which its operations run. It is `Send` (it may move to another thread) but not
//! `Sync`: NCCL forbids issuing operations on one communicator from several threads at once,
//! and ranks must issue operations in the same order, which concurrent callers could not
//! guarantee.
//!
//! # End of life
//!
//! `ncclCommDestroy` is an intra-node collective: every rank on the node must call it, or it
//! blocks forever. Dropping a `Comm` therefore never destroys it. Drop first waits, for at most
//! [`Comm::drop_timeout`] (10 s by default), for the work already enqueued on the
//! communicator's stream, so results of the last operations are not cut short, and then calls
//! `ncclCommAbort`, which releases the communicator without waiting for peers. It never panics
//! and never blocks forever, also when a peer has died. For an orderly shutdown in which all
//! ranks take part, call [`Comm::finalize`] and then [`Comm::destroy`]; both report errors.
//! A communicator that failed (see [`crate::fault`]) is aborted at once, without the wait,
//! and one already aborted from another thread is left alone.

use std::cell::Cell;
use std::marker::PhantomData;
use std::os::raw::c_int;
use std::ptr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use nccl_sys::ncclComm_t;

use crate::config::{CommConfig, RawConfig};
use crate::error::{Error, Result, ResultCode};
use crate::fault::{Failure, FailureState, Handle};
use crate::group;
use crate::id::UniqueId;
use crate::library::{self, Library, Version};

/// How long [`Drop`] waits for enqueued work before aborting, unless changed with
/// [`Comm::set_drop_timeout`].
pub const DEFAULT_DROP_TIMEOUT: Duration = Duration::from_secs(10);

/// The raw handle, shared with the handles that may outlive a borrow of the `Comm` (abort
/// handles, watchdogs). The mutex serialises every NCCL call on the communicator and guards
/// its fault state (see [`crate::fault`]).
///
/// Aligned to a cache line and no larger than one, so the lock word, the handle and its
/// fault state, which every enqueue reads, share a single line.
#[repr(align(64))]
pub(crate) struct CommCore {
    handle: Mutex<Handle>,
    blocking: bool,
}

// SAFETY: the raw handle is only used while holding the mutex, so calls on it never overlap,
// and NCCL allows a communicator to be used from different threads one at a time.
unsafe impl Send for CommCore {}
// SAFETY: as above; shared references only reach the handle through the mutex.
unsafe impl Sync for CommCore {}

impl CommCore {
    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, Handle> {
        // A poisoned lock only means another thread panicked between NCCL calls; the handle
        // itself is still what it was.
        self.handle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One rank of an NCCL communicator.
pub struct Comm {
    core: Arc<CommCore>,
    stream: Arc<CudaStream>,
    lib: &'static Library,
    rank: usize,
    size: usize,
    device: usize,
    ready_timeout: Duration,
    drop_timeout: Duration,
    _not_sync: PhantomData<Cell<()>>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device)
            .field("blocking", &self.core.blocking)
            .field("released", &self.core.lock().ptr.is_null())
            .finish()
    }
}

impl Comm {
    /// Joins the communicator named by `id` as `rank` of `size`, on the device of `stream`
    /// (`ncclCommInitRank`). Every rank must call this, each in its own thread or process
    /// (or use [`Comm::init_all`] for one process driving several GPUs).
    ///
    /// The stream's CUDA context is made current first: NCCL binds the communicator to the
    /// current device. Operations run on `stream` unless another stream is given per call.
    pub fn init_rank(
        stream: Arc<CudaStream>,
        id: &UniqueId,
        rank: usize,
        size: usize,
    ) -> Result<Comm> {
        Self::init_rank_with_config(stream, id, rank, size, &CommConfig::default())
    }

    /// [`Comm::init_rank`] with a configuration (`ncclCommInitRankConfig`, NCCL 2.14).
    pub fn init_rank_with_config(
        stream: Arc<CudaStream>,
        id: &UniqueId,
        rank: usize,
        size: usize,
        config: &CommConfig,
    ) -> Result<Comm> {
        let lib = library::get()?;
        group::ensure_outside("Comm::init_rank")?;
        let (my_rank, nranks) = rank_and_size(rank, size)?;
        let mut raw_config = config.to_raw(lib)?;
        stream.context().bind_to_thread()?;
        let mut raw: ncclComm_t = ptr::null_mut();
        let status = match raw_config.as_mut() {
            // SAFETY: `raw` is a valid out-pointer; the id is passed by value as NCCL expects.
            None => unsafe {
                lib.api()
                    .ncclCommInitRank(&mut raw, nranks, id.to_raw(), my_rank)
            },
            // SAFETY: as above, and `cfg` is an initialised ncclConfig_t whose strings live in
            // `raw_config` until the call returns (NCCL copies what it keeps).
            Some(cfg) => unsafe {
                lib.api()
                    .ncclCommInitRankConfig(&mut raw, nranks, id.to_raw(), my_rank, cfg)
            },
        };
        let call = if raw_config.as_mut().is_some() {
            "ncclCommInitRankConfig"
        } else {
            "ncclCommInitRank"
        };
        Self::adopt(lib, raw, stream, config, call, status).map_err(|err| match err {
            // Say what a nonblocking init waits for: usually a rank that never joined.
            Error::Timeout { waited, .. } => Error::Timeout {
                what: format!(
                    "{call} of rank {rank} of {size} to complete (every rank must join with \
                     the same id; one has not, or the bootstrap network is unreachable); the \
                     communicator was aborted"
                ),
                waited,
            },
            other => other,
        })
    }

    /// Creates one communicator per stream, all in this process (`ncclCommInitAll`); rank `i`
    /// runs on the device of `streams[i]`. Every stream must be on a different GPU, in that
    /// GPU's primary context (the one `CudaContext::new` returns).
    ///
    /// Operations on these communicators must be issued from one thread inside a
    /// [`Group`](crate::Group), or each communicator must be moved to its own thread.
    pub fn init_all(streams: &[Arc<CudaStream>]) -> Result<Vec<Comm>> {
        let lib = library::get()?;
        group::ensure_outside("Comm::init_all")?;
        if streams.is_empty() {
            return Err(Error::invalid("init_all needs at least one stream"));
        }
        let mut devices = Vec::with_capacity(streams.len());
        for (i, stream) in streams.iter().enumerate() {
            let ctx = stream.context();
            if !ctx.is_primary() {
                return Err(Error::invalid(format!(
                    "stream {i} is not in the primary context of device {}; ncclCommInitAll \
                     uses primary contexts",
                    ctx.ordinal()
                )));
            }
            let ordinal = ctx.ordinal();
            if let Some(j) = devices.iter().position(|&d| d == ordinal as c_int) {
                return Err(Error::invalid(format!(
                    "streams {j} and {i} are both on device {ordinal}; each rank needs its own GPU"
                )));
            }
            devices.push(c_int::try_from(ordinal).map_err(|_| {
                Error::invalid(format!("device ordinal {ordinal} does not fit a C int"))
            })?);
        }
        let ndev = c_int::try_from(devices.len())
            .map_err(|_| Error::invalid("too many streams for ncclCommInitAll"))?;
        let mut raws: Vec<ncclComm_t> = vec![ptr::null_mut(); devices.len()];
        // SAFETY: `raws` has room for `ndev` handles and `devices` holds `ndev` ordinals.
        let status = unsafe {
            lib.api()
                .ncclCommInitAll(raws.as_mut_ptr(), ndev, devices.as_ptr())
        };
        if let Err(err) = lib.check("ncclCommInitAll", status) {
            for raw in raws.into_iter().filter(|raw| !raw.is_null()) {
                // SAFETY: a handle NCCL returned and nobody else holds; the init failed, so
                // it is released without waiting for peers.
                let _ = unsafe { lib.api().ncclCommAbort(raw) };
            }
            return Err(err);
        }
        let config = CommConfig::default();
        let mut comms = Vec::with_capacity(raws.len());
        for (raw, stream) in raws.into_iter().zip(streams) {
            comms.push(Self::wrap(lib, raw, stream.clone(), &config)?);
        }
        Ok(comms)
    }

    /// Takes ownership of a handle NCCL just produced, finishing a nonblocking creation and
    /// reading back the rank, size and device. On failure the handle is aborted.
    pub(crate) fn adopt(
        lib: &'static Library,
        raw: ncclComm_t,
        stream: Arc<CudaStream>,
        config: &CommConfig,
        call: &'static str,
        status: std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>,
    ) -> Result<Comm> {
        match lib.check_pending(call, status) {
            Ok(_) if raw.is_null() => Err(Error::Nccl {
                call,
                code: ResultCode::InternalError,
                description: "NCCL reported success but returned no communicator".into(),
                last_error: None,
            }),
            // Wrapping first means any later failure aborts the handle through Drop.
            Ok(_) => Self::wrap(lib, raw, stream, config),
            Err(err) => {
                if !raw.is_null() {
                    // SAFETY: a handle from a failed init that nobody else holds.
                    let _ = unsafe { lib.api().ncclCommAbort(raw) };
                }
                Err(err)
            }
        }
    }

    fn wrap(
        lib: &'static Library,
        raw: ncclComm_t,
        stream: Arc<CudaStream>,
        config: &CommConfig,
    ) -> Result<Comm> {
        let mut comm = Comm {
            core: Arc::new(CommCore {
                handle: Mutex::new(Handle::new(raw)),
                blocking: config.is_blocking(),
            }),
            stream,
            lib,
            rank: 0,
            size: 0,
            device: 0,
            ready_timeout: config.ready_timeout,
            drop_timeout: DEFAULT_DROP_TIMEOUT,
            _not_sync: PhantomData,
        };
        // A communicator that never became ready has no work to wait for: if anything below
        // fails, Drop aborts it at once.
        comm.drop_timeout = Duration::ZERO;
        comm.wait_ready(comm.ready_timeout)?;
        comm.size = comm.query("ncclCommCount", |lib, raw, out| {
            // SAFETY: `raw` is a live handle (held under the lock) and `out` a valid int.
            unsafe { lib.api().ncclCommCount(raw, out) }
        })?;
        comm.rank = comm.query("ncclCommUserRank", |lib, raw, out| {
            // SAFETY: as above.
            unsafe { lib.api().ncclCommUserRank(raw, out) }
        })?;
        comm.device = comm.query("ncclCommCuDevice", |lib, raw, out| {
            // SAFETY: as above.
            unsafe { lib.api().ncclCommCuDevice(raw, out) }
        })?;
        let stream_device = comm.stream.context().ordinal();
        if stream_device != comm.device {
            return Err(Error::invalid(format!(
                "the communicator is on device {} but its stream is on device {stream_device}",
                comm.device
            )));
        }
        comm.drop_timeout = DEFAULT_DROP_TIMEOUT;
        Ok(comm)
    }

    fn query(
        &self,
        call: &'static str,
        f: impl FnOnce(
            &Library,
            ncclComm_t,
            &mut c_int,
        ) -> std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>,
    ) -> Result<usize> {
        let mut value: c_int = -1;
        let status = self.with_raw(call, |raw| f(self.lib, raw, &mut value))?;
        self.lib.check(call, status)?;
        usize::try_from(value).map_err(|_| Error::Nccl {
            call,
            code: ResultCode::InternalError,
            description: format!("NCCL returned the negative value {value}"),
            last_error: None,
        })
    }

    /// Runs `f` with the raw handle while holding the communicator's lock; fails if the
    /// communicator was already aborted or destroyed, or, for calls that enqueue work, if it
    /// failed (see [`crate::fault`]).
    #[inline]
    pub(crate) fn with_raw<R>(
        &self,
        call: &'static str,
        f: impl FnOnce(ncclComm_t) -> R,
    ) -> Result<R> {
        let handle = self.core.lock();
        handle.usable_for(call, self.rank)?;
        Ok(f(handle.ptr))
    }

    pub(crate) fn core(&self) -> &Arc<CommCore> {
        &self.core
    }

    /// Completes a call on this communicator: `ncclInProgress` from a nonblocking
    /// communicator is waited out (NCCL forbids any other call, and any CUDA work on its
    /// streams, until the communicator is ready again).
    #[inline]
    pub(crate) fn complete(
        &self,
        call: &'static str,
        status: std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>,
    ) -> Result<()> {
        if matches!(status, Ok(nccl_sys::ncclResult_t::ncclSuccess)) {
            return Ok(());
        }
        self.complete_slow(call, status)
    }

    #[cold]
    #[inline(never)]
    fn complete_slow(
        &self,
        call: &'static str,
        status: std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>,
    ) -> Result<()> {
        if self.lib.check_pending(call, status)? {
            self.wait_ready(self.ready_timeout)?;
        }
        Ok(())
    }

    /// Polls `ncclCommGetAsyncError` until the communicator is no longer in progress.
    ///
    /// For a nonblocking communicator this is how creation, split and enqueueing finish; for
    /// a blocking one it returns at once unless an asynchronous error is pending.
    ///
    /// Returns early with the failure if the communicator was aborted, revoked or reported
    /// failed by an [`AbortHandle`](crate::AbortHandle) or a [`Watchdog`](crate::Watchdog).
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            self.check_failure("Comm::wait_ready")?;
            match self.async_code()? {
                ResultCode::Success => return Ok(()),
                ResultCode::InProgress => {}
                code => return Err(self.lib.error("ncclCommGetAsyncError", code)),
            }
            if start.elapsed() >= timeout {
                return Err(Error::Timeout {
                    what: format!("communicator rank {} to become ready", self.rank),
                    waited: start.elapsed(),
                });
            }
            backoff.wait();
        }
    }

    /// Fails with the recorded failure, if the communicator has one.
    pub(crate) fn check_failure(&self, call: &'static str) -> Result<()> {
        self.core.lock().check_failure(call, self.rank)
    }

    pub(crate) fn async_code(&self) -> Result<ResultCode> {
        let mut code = nccl_sys::ncclResult_t::ncclSuccess;
        let status = self.with_raw("ncclCommGetAsyncError", |raw| {
            // SAFETY: live handle under the lock; `code` is a valid out-pointer.
            unsafe { self.lib.api().ncclCommGetAsyncError(raw, &mut code) }
        })?;
        self.lib.check("ncclCommGetAsyncError", status)?;
        Ok(ResultCode::from_raw(code))
    }

    /// `ncclCommGetAsyncError` as is, also on a communicator marked failed (not released).
    fn async_code_raw(&self) -> Result<ResultCode> {
        let handle = self.core.lock();
        if handle.ptr.is_null() {
            return Err(handle.released_error("ncclCommGetAsyncError", self.rank));
        }
        let mut code = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: live handle under its lock; `code` is a valid out-pointer.
        let status = unsafe { self.lib.api().ncclCommGetAsyncError(handle.ptr, &mut code) };
        self.lib.check("ncclCommGetAsyncError", status)?;
        Ok(ResultCode::from_raw(code))
    }

    /// The communicator's asynchronous error, if it has one (`ncclCommGetAsyncError`).
    ///
    /// `Ok(None)` means healthy (or, for a nonblocking communicator, still progressing).
    /// An error here is fatal: the communicator must be aborted.
    pub fn async_error(&self) -> Result<Option<Error>> {
        Ok(match self.async_code()? {
            ResultCode::Success | ResultCode::InProgress => None,
            code => Some(self.lib.error("ncclCommGetAsyncError", code)),
        })
    }

    /// Waits until all work enqueued so far on the communicator's stream has finished,
    /// checking the communicator's asynchronous error while waiting, so a failed peer is
    /// reported instead of hanging. Gives up with [`Error::Timeout`] after `timeout`.
    pub fn synchronize_timeout(&self, timeout: Duration) -> Result<()> {
        Self::wait_stream(self, &self.stream, Some(timeout))
    }

    /// Waits until all work enqueued so far on the communicator's stream has finished,
    /// returning early with the communicator's asynchronous error if one occurs.
    pub fn synchronize(&self) -> Result<()> {
        Self::wait_stream(self, &self.stream, None)
    }

    fn wait_stream(&self, stream: &CudaStream, timeout: Option<Duration>) -> Result<()> {
        let start = Instant::now();
        let expired = |start: Instant| timeout.is_some_and(|limit| start.elapsed() >= limit);
        let mut backoff = Backoff::new();
        // NCCL forbids CUDA work on the communicator's streams while it is in progress (only
        // possible here after an earlier call timed out): wait for it first, issuing nothing.
        loop {
            self.check_failure("Comm::synchronize")?;
            match self.async_code()? {
                ResultCode::Success => break,
                ResultCode::InProgress => {}
                code => return Err(self.lib.error("ncclCommGetAsyncError", code)),
            }
            if expired(start) {
                return Err(Error::Timeout {
                    what: format!(
                        "communicator rank {} to finish its last call before synchronizing",
                        self.rank
                    ),
                    waited: start.elapsed(),
                });
            }
            backoff.wait();
        }
        let done = stream.record_event(None)?;
        loop {
            if done.try_is_complete()? {
                // Work cut short by an abort from another thread also completes: report the
                // abort rather than success.
                return self.check_failure("Comm::synchronize");
            }
            self.check_failure("Comm::synchronize")?;
            if let Some(err) = self.async_error()? {
                return Err(err);
            }
            if expired(start) {
                return Err(Error::Timeout {
                    what: format!("work on the stream of rank {}", self.rank),
                    waited: start.elapsed(),
                });
            }
            backoff.wait();
        }
    }

    /// Splits the communicator (`ncclCommSplit`, NCCL 2.18). Ranks passing the same `color`
    /// form a new communicator, ordered by `key` (then by their rank here). A rank passing
    /// `None` takes part in the call but joins no communicator and gets `Ok(None)`.
    ///
    /// Every rank of this communicator must call it, with no NCCL work outstanding on it.
    /// The child uses this communicator's stream and inherits its configuration.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Comm>> {
        self.split_with(color, key, None, self.stream.clone())
    }

    /// [`Comm::split`] with a configuration for the child (or `None` to inherit this one's)
    /// and the stream the child will use (on the same device).
    pub fn split_with(
        &self,
        color: Option<u32>,
        key: i32,
        config: Option<&CommConfig>,
        stream: Arc<CudaStream>,
    ) -> Result<Option<Comm>> {
        self.lib.require("ncclCommSplit", Version::new(2, 18, 0))?;
        group::ensure_outside("Comm::split")?;
        let color = split_color(color)?;
        self.check_stream_device(&stream, "split stream")?;
        let child_config = self.child_config(config);
        let mut raw_config = RawConfig::inherit_or(config, self.lib)?;
        let cfg_ptr = raw_config.as_mut_ptr();
        self.create_child(
            "ncclCommSplit",
            stream,
            &child_config,
            color != nccl_sys::NCCL_SPLIT_NOCOLOR,
            |raw, child| {
                // SAFETY: live parent handle under its lock; `child` stays valid until NCCL's
                // job has written it (see `create_child`); `cfg_ptr` is null or an
                // initialised config alive until the call returns (NCCL copies it).
                unsafe {
                    self.lib
                        .api()
                        .ncclCommSplit(raw, color, key, child, cfg_ptr)
                }
            },
        )
    }

    /// The configuration a child (split, shrink, grow) is adopted with. No config means
    /// NCCL's "inherit the parent's": then the blocking mode and readiness timeout follow the
    /// parent too; a given config inherits only the blocking mode, if it leaves it unset.
    pub(crate) fn child_config(&self, config: Option<&CommConfig>) -> CommConfig {
        match config {
            Some(config) => config.clone().inherit_blocking(self.core.blocking),
            None => CommConfig::default()
                .blocking(self.core.blocking)
                .ready_timeout(self.ready_timeout),
        }
    }

    /// Runs a call that creates a child of this communicator (split, shrink, grow) and adopts
    /// the child.
    ///
    /// For a nonblocking parent NCCL writes the child handle from its background job, after
    /// the call has returned, and keeps the parent in progress until then. So the handle's
    /// slot lives on the heap, and is read only once the parent has settled; if it never
    /// settles (timeout), the slot is leaked rather than freed under NCCL's feet.
    /// `expect_child` is false for a split without color, which yields no communicator.
    pub(crate) fn create_child(
        &self,
        call: &'static str,
        stream: Arc<CudaStream>,
        child_config: &CommConfig,
        expect_child: bool,
        issue: impl FnOnce(
            ncclComm_t,
            *mut ncclComm_t,
        )
            -> std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>,
    ) -> Result<Option<Comm>> {
        self.stream.context().bind_to_thread()?;
        let slot: *mut ncclComm_t = Box::into_raw(Box::new(ptr::null_mut()));
        // SAFETY (of the reads and the free below): `slot` came from Box::into_raw and is
        // only freed once NCCL can no longer write to it.
        let free_slot = |slot: *mut ncclComm_t| drop(unsafe { Box::from_raw(slot) });
        let status = match self.with_raw(call, |raw| issue(raw, slot)) {
            Ok(status) => status,
            Err(err) => {
                free_slot(slot);
                return Err(err);
            }
        };
        let parent_error = match self.lib.check_pending(call, status) {
            // The parent settles when every member has joined the child, so the wait is the
            // child's creation timeout, not the parent's (which may be short, for detecting
            // failures). On a timeout NCCL's job may still write the slot: it stays allocated.
            Ok(_) => self.settle(call, child_config.ready_timeout)?,
            Err(err) => {
                // The call failed before starting anything; a partial child is aborted.
                // SAFETY: see above; NCCL returned, nothing runs in the background.
                let partial = unsafe { *slot };
                free_slot(slot);
                if !partial.is_null() {
                    // SAFETY: a handle from a failed creation that nobody else holds.
                    let _ = unsafe { self.lib.api().ncclCommAbort(partial) };
                }
                return Err(err);
            }
        };
        // SAFETY: the parent has settled, so NCCL's job has finished writing the slot.
        let child = unsafe { *slot };
        free_slot(slot);
        match (child.is_null(), expect_child) {
            (true, false) => Ok(None),
            (true, true) => Err(match parent_error {
                ResultCode::Success => Error::Nccl {
                    call,
                    code: ResultCode::InternalError,
                    description: "NCCL reported success but returned no communicator".into(),
                    last_error: None,
                },
                code => self.lib.error(call, code),
            }),
            (false, _) => Comm::adopt(
                self.lib,
                child,
                stream,
                child_config,
                call,
                Ok(nccl_sys::ncclResult_t::ncclSuccess),
            )
            .map(Some),
        }
    }

    /// Waits until the communicator is no longer in progress and returns its state then
    /// (success, or the error it reports). Unlike [`Comm::wait_ready`], an error state is a
    /// result here: after a failure NCCL's jobs (shrink) still finish on a failed parent.
    pub(crate) fn settle(&self, call: &'static str, timeout: Duration) -> Result<ResultCode> {
        let start = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            let code = self.async_code_raw()?;
            if code != ResultCode::InProgress {
                return Ok(code);
            }
            if start.elapsed() >= timeout {
                return Err(Error::Timeout {
                    what: format!("{call} on rank {} to complete", self.rank),
                    waited: start.elapsed(),
                });
            }
            backoff.wait();
        }
    }

    /// Splits several communicators driven by this thread (for example from
    /// [`Comm::init_all`]) in one group, so the blocking split of one rank does not wait
    /// forever for the others. `colors[i]` and `keys[i]` apply to `comms[i]`.
    pub fn split_all(
        comms: &[Comm],
        colors: &[Option<u32>],
        keys: &[i32],
    ) -> Result<Vec<Option<Comm>>> {
        if comms.len() != colors.len() || comms.len() != keys.len() {
            return Err(Error::invalid(format!(
                "split_all got {} communicators, {} colors and {} keys",
                comms.len(),
                colors.len(),
                keys.len()
            )));
        }
        let Some(first) = comms.first() else {
            return Ok(Vec::new());
        };
        let lib = first.lib;
        lib.require("ncclCommSplit", Version::new(2, 18, 0))?;
        if comms.iter().any(|c| c.core.blocking != first.core.blocking) {
            return Err(Error::invalid(
                "split_all cannot mix blocking and nonblocking communicators",
            ));
        }
        let colors = colors
            .iter()
            .map(|&color| split_color(color))
            .collect::<Result<Vec<_>>>()?;
        let mut children: Vec<ncclComm_t> = vec![ptr::null_mut(); comms.len()];
        let mut group = group::RawGroup::start(lib)?;
        // Aborts from other threads wait until the group has ended (see `crate::fault`).
        let _entered = group::Membership::enter(comms.iter());
        for (i, comm) in comms.iter().enumerate() {
            let child = &mut children[i];
            let status = comm.with_raw("ncclCommSplit", |raw| {
                // SAFETY: live handle under its lock; `child` outlives the group, where NCCL
                // fills it in; a null config inherits the parent's.
                unsafe {
                    lib.api()
                        .ncclCommSplit(raw, colors[i], keys[i], child, ptr::null_mut())
                }
            });
            let checked = status.and_then(|status| lib.check_pending("ncclCommSplit", status));
            if let Err(err) = checked {
                group.end_ignoring_errors();
                return Err(err);
            }
        }
        let pending = group.end();
        drop(_entered);
        let pending = pending?;
        if pending {
            // As in `create_child`: NCCL's jobs write the children and keep the parents in
            // progress until done. If a parent never settles, the slots stay allocated.
            for parent in comms {
                if let Err(err) = parent.settle("ncclCommSplit", parent.ready_timeout) {
                    std::mem::forget(children);
                    return Err(err);
                }
            }
        }
        let mut out = Vec::with_capacity(comms.len());
        let mut first_err = None;
        for ((raw, parent), color) in children.into_iter().zip(comms).zip(&colors) {
            if *color == nccl_sys::NCCL_SPLIT_NOCOLOR || raw.is_null() {
                out.push(None);
                continue;
            }
            let config = CommConfig::default().blocking(parent.core.blocking);
            match Comm::adopt(
                lib,
                raw,
                parent.stream.clone(),
                &config,
                "ncclCommSplit",
                Ok(nccl_sys::ncclResult_t::ncclSuccess),
            ) {
                Ok(child) => out.push(Some(child)),
                Err(err) => {
                    first_err.get_or_insert(err);
                    out.push(None);
                }
            }
        }
        match first_err {
            Some(err) => Err(err),
            None => Ok(out),
        }
    }

    /// This process's rank in the communicator, as reported by NCCL.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the communicator, as reported by NCCL.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The CUDA device ordinal the communicator runs on, as reported by NCCL.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The communicator's default stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context of the communicator's stream.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.stream.context()
    }

    /// Whether calls on this communicator block (the default) or may return in progress.
    pub fn is_blocking(&self) -> bool {
        self.core.blocking
    }

    /// The NCCL library this communicator was created with.
    pub fn library(&self) -> &'static Library {
        self.lib
    }

    /// How long a nonblocking communicator may stay in progress before a call fails.
    pub fn ready_timeout(&self) -> Duration {
        self.ready_timeout
    }

    /// Sets how long a nonblocking communicator may stay in progress before a call fails
    /// with [`Error::Timeout`] (for example a short one once creation, which can take long,
    /// is over).
    pub fn set_ready_timeout(&mut self, timeout: Duration) {
        self.ready_timeout = timeout;
    }

    /// How long [`Drop`] waits for enqueued work before aborting.
    pub fn drop_timeout(&self) -> Duration {
        self.drop_timeout
    }

    /// Sets how long [`Drop`] waits for enqueued work before aborting (zero aborts at once).
    pub fn set_drop_timeout(&mut self, timeout: Duration) {
        self.drop_timeout = timeout;
    }

    /// The raw `ncclComm_t`, for NCCL functions this crate does not wrap.
    ///
    /// # Safety
    ///
    /// The handle must not be used after the `Comm` is dropped, aborted or destroyed, must
    /// not be destroyed or aborted through it, and must not be used concurrently with calls
    /// through this `Comm`.
    pub unsafe fn as_raw(&self) -> ncclComm_t {
        self.core.lock().ptr
    }

    pub(crate) fn core_ptr(&self) -> *const CommCore {
        Arc::as_ptr(&self.core)
    }

    /// Flushes all operations and releases network resources (`ncclCommFinalize`, NCCL
    /// 2.14). It is collective: every rank calls it, then [`Comm::destroy`]. Returns once the
    /// communicator is quiescent (a nonblocking one is polled to completion).
    pub fn finalize(&self) -> Result<()> {
        self.lib
            .require("ncclCommFinalize", Version::new(2, 14, 0))?;
        group::ensure_outside("Comm::finalize")?;
        let status = self.with_raw("ncclCommFinalize", |raw| {
            // SAFETY: live handle under its lock.
            unsafe { self.lib.api().ncclCommFinalize(raw) }
        })?;
        self.complete("ncclCommFinalize", status)
    }

    /// Frees the communicator (`ncclCommDestroy`). Without a prior [`Comm::finalize`] this
    /// is an intra-node collective that every rank on the node must call; after a finalize
    /// it is local.
    ///
    /// If an [`AbortHandle`](crate::AbortHandle) or a [`Watchdog`](crate::Watchdog) already
    /// aborted the communicator, nothing is left to free and the error says why it was
    /// aborted.
    pub fn destroy(self) -> Result<()> {
        self.release("ncclCommDestroy", |lib, raw| {
            // SAFETY: the handle was taken out of the core, so no one else can use it.
            unsafe { lib.api().ncclCommDestroy(raw) }
        })
    }

    /// Aborts the communicator (`ncclCommAbort`): stops its outstanding operations and frees
    /// it without waiting for peers. After a failure every rank should abort.
    ///
    /// Aborting a communicator that an [`AbortHandle`](crate::AbortHandle) or a
    /// [`Watchdog`](crate::Watchdog) already aborted is a no-op that returns `Ok`.
    pub fn abort(self) -> Result<()> {
        let raw = {
            let mut handle = self.core.lock();
            if handle.ptr.is_null() {
                // Only another thread can have released it: `self` is still owned here.
                return Ok(());
            }
            handle.take(Failure::owner(FailureState::Released))
        };
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the handle was taken out of the core, so no one else can use it.
        let status = unsafe { self.lib.api().ncclCommAbort(raw) };
        self.lib.check("ncclCommAbort", status)
    }

    fn release(
        &self,
        call: &'static str,
        f: impl FnOnce(
            &Library,
            ncclComm_t,
        ) -> std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>,
    ) -> Result<()> {
        let raw = {
            let mut handle = self.core.lock();
            if handle.ptr.is_null() {
                return Err(handle.released_error(call, self.rank));
            }
            handle.take(Failure::owner(FailureState::Released))
        };
        // Best effort: the calls find their device themselves, but NCCL's cleanup may touch
        // the current context.
        let _ = self.stream.context().bind_to_thread();
        self.lib.check(call, f(self.lib, raw))
    }

    /// Checks that `stream` is on this communicator's device.
    #[inline]
    pub(crate) fn check_stream_device(&self, stream: &CudaStream, what: &str) -> Result<()> {
        // The communicator's own stream needs no lookup.
        if std::ptr::eq(stream, &*self.stream) || stream.context().ordinal() == self.device {
            return Ok(());
        }
        Err(self.wrong_stream_device(stream, what))
    }

    #[cold]
    #[inline(never)]
    fn wrong_stream_device(&self, stream: &CudaStream, what: &str) -> Error {
        Error::invalid(format!(
            "{what} is on device {} but the communicator (rank {}) is on device {}",
            stream.context().ordinal(),
            self.rank,
            self.device
        ))
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let (live, failed) = {
            let handle = self.core.lock();
            (!handle.ptr.is_null(), handle.failure.is_some())
        };
        if !live {
            return;
        }
        // Let the last operations finish, unless the communicator already failed or is stuck
        // in progress (every call waits until it is ready, so a communicator still in
        // progress here has timed out and its work will not finish). A dead peer or the
        // timeout ends the wait, and the abort below then cancels what is left.
        let healthy = !failed && matches!(self.async_code(), Ok(ResultCode::Success));
        if healthy && !self.drop_timeout.is_zero() {
            let _ = self.wait_stream(&self.stream, Some(self.drop_timeout));
        }
        let raw = self
            .core
            .lock()
            .take(Failure::owner(FailureState::Released));
        if !raw.is_null() {
            let _ = self.stream.context().bind_to_thread();
            // SAFETY: the handle was taken out of the core, so no one else can use it; abort
            // never waits for peers.
            let _ = unsafe { self.lib.api().ncclCommAbort(raw) };
        }
    }
}

/// Validates and converts a rank and size for NCCL's `int` parameters.
pub(crate) fn rank_and_size(rank: usize, size: usize) -> Result<(c_int, c_int)> {
    if size == 0 {
        return Err(Error::invalid(
            "a communicator needs at least one rank (size 0)",
        ));
    }
    if rank >= size {
        return Err(Error::invalid(format!(
            "rank {rank} is out of range for a communicator of size {size}"
        )));
    }
    let size = c_int::try_from(size)
        .map_err(|_| Error::invalid(format!("communicator size {size} does not fit a C int")))?;
    Ok((rank as c_int, size))
}

fn split_color(color: Option<u32>) -> Result<c_int> {
    match color {
        None => Ok(nccl_sys::NCCL_SPLIT_NOCOLOR),
        Some(color) => c_int::try_from(color).map_err(|_| {
            Error::invalid(format!(
                "split color {color} is too large (at most {})",
                c_int::MAX
            ))
        }),
    }
}

/// Polling pace: spin briefly (most waits are short), then yield, then sleep in steps that
/// grow to at most 50 µs, so a long wait costs little CPU and a timed wait ends at most about
/// 50 µs late.
pub(crate) struct Backoff {
    polls: u32,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Self { polls: 0 }
    }

    pub(crate) fn wait(&mut self) {
        self.polls = self.polls.saturating_add(1);
        match self.polls {
            0..=64 => std::hint::spin_loop(),
            65..=1024 => std::thread::yield_now(),
            n => std::thread::sleep(Duration::from_micros(u64::from((n - 1024).min(50)))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_state_fits_one_cache_line() {
        assert_eq!(std::mem::align_of::<CommCore>(), 64);
        assert_eq!(std::mem::size_of::<CommCore>(), 64);
    }

    #[test]
    fn rank_and_size_are_checked() {
        assert_eq!(rank_and_size(0, 1).unwrap(), (0, 1));
        assert_eq!(rank_and_size(3, 4).unwrap(), (3, 4));
        assert!(rank_and_size(0, 0)
            .unwrap_err()
            .to_string()
            .contains("size 0"));
        let err = rank_and_size(4, 4).unwrap_err().to_string();
        assert!(err.contains("rank 4 is out of range"), "{err}");
        let err = rank_and_size(0, usize::MAX).unwrap_err().to_string();
        assert!(err.contains("does not fit"), "{err}");
    }

    #[test]
    fn split_colors() {
        assert_eq!(split_color(None).unwrap(), -1);
        assert_eq!(split_color(Some(7)).unwrap(), 7);
        assert!(split_color(Some(u32::MAX)).is_err());
    }

    #[test]
    fn comm_is_send_but_not_sync() {
        fn assert_send<T: Send>() {}
        assert_send::<Comm>();
        // `Comm: !Sync` is checked by the compile-fail doctest on `Comm`'s module.
    }
}
