//! Creating communicators: joining by unique id, one process over several GPUs, and taking
//! ownership of a handle NCCL produced.

use std::marker::PhantomData;
use std::os::raw::c_int;
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaStream;
use nccl_sys::ncclComm_t;

use super::state::Shared;
use super::{Comm, ContextId, Siblings, DEFAULT_DROP_TIMEOUT};
use crate::calls::{self, Call};
use crate::config::CommConfig;
use crate::diagnostics::flight::{self, FlightRing};
use crate::error::{Error, Result, ResultCode};
use crate::id::UniqueId;
use crate::library::{self, Library};
use crate::release::Version;
use crate::thread_group;

/// What a remote or system error during initialisation usually means, added to NCCL's text.
const PEER_GAVE_UP: &str = "nccl-rs: during initialisation this usually means that another rank \
    gave up first (its ready timeout ran out because a rank never joined, or it failed) and \
    closed its connections; see CommConfig::ready_timeout";

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
        Self::join(stream, Ids::One(id), rank, size, config)
    }

    /// Joins the communicator named by several unique ids (`ncclCommInitRankScalable`, NCCL
    /// 2.23), so that NCCL's bootstrap spreads over several roots: each id's root serves an
    /// even share of the ranks instead of one root serving all of them.
    ///
    /// When it pays: NCCL makes ranks queue for their root once it serves more than
    /// `NCCL_UID_STAGGER_THRESHOLD` ranks (256 by default; then each waits its turn at
    /// `NCCL_UID_STAGGER_RATE`, 7000 connections a second), so one id per 256 ranks keeps
    /// every root under that bound; [`bootstrap::SCALABLE_RANKS_PER_ID`](crate::bootstrap::SCALABLE_RANKS_PER_ID)
    /// is that figure, and the rendezvous of [`crate::bootstrap`] hands out that many ids by
    /// itself ([`bootstrap::IdCount`](crate::bootstrap::IdCount)). Below a few hundred ranks
    /// one id is as fast. For best effect NCCL's guide asks that the ids be created on ranks
    /// spread evenly over the job ([`bootstrap::rank_has_root`](crate::bootstrap::rank_has_root)
    /// says which).
    ///
    /// Checked here: `ids` is not empty, has no id twice, and holds at most `size` ids (NCCL's
    /// limit, one root per rank). Left to the caller, since no rank can see the others' ids
    /// before joining: **every rank passes the same ids in the same order** (the bootstrap
    /// rendezvous guarantees this for what it hands out; a rank with other ids or another
    /// order joins another communicator or none, and the init fails or times out). Only the
    /// first id names the communicator in NCCL's logs. One id behaves like
    /// [`Comm::init_rank_with_config`].
    pub fn init_rank_scalable(
        stream: Arc<CudaStream>,
        ids: &[UniqueId],
        rank: usize,
        size: usize,
    ) -> Result<Comm> {
        Self::init_rank_scalable_with_config(stream, ids, rank, size, &CommConfig::default())
    }

    /// [`Comm::init_rank_scalable`] with a configuration; a nonblocking one returns once NCCL
    /// accepted the call and waits for readiness like [`Comm::init_rank_with_config`].
    pub fn init_rank_scalable_with_config(
        stream: Arc<CudaStream>,
        ids: &[UniqueId],
        rank: usize,
        size: usize,
        config: &CommConfig,
    ) -> Result<Comm> {
        Self::join(stream, Ids::Several(ids), rank, size, config)
    }

    /// The one path of every join by unique id: checks, binds the stream's context, calls the
    /// NCCL function `ids` asks for and adopts the handle.
    fn join(
        stream: Arc<CudaStream>,
        ids: Ids<'_>,
        rank: usize,
        size: usize,
        config: &CommConfig,
    ) -> Result<Comm> {
        let lib = library::get()?;
        thread_group::ensure_outside(match ids {
            Ids::One(_) => "Comm::init_rank",
            Ids::Several(_) => "Comm::init_rank_scalable",
        })?;
        let (my_rank, nranks) = rank_and_size(rank, size)?;
        super::streams::check_own_stream(&stream)?;
        if let Ids::Several(list) = ids {
            lib.require_call(&calls::ncclCommInitRankScalable)?;
            check_ids(list, size)?;
        }
        let mut raw_config = config.to_raw(lib)?;
        stream.context().bind_to_thread()?;
        crate::encryption::network_started();
        let mut raw: ncclComm_t = ptr::null_mut();
        let (call, status) = match (ids, raw_config.as_mut()) {
            (Ids::One(id), None) => (
                calls::ncclCommInitRank.name,
                // SAFETY: `raw` is a valid out-pointer; the id is passed by value as NCCL
                // expects.
                unsafe {
                    lib.api()
                        .ncclCommInitRank(&mut raw, nranks, id.to_raw(), my_rank)
                },
            ),
            (Ids::One(id), Some(cfg)) => (
                calls::ncclCommInitRankConfig.name,
                // SAFETY: as above, and `cfg` is an initialised ncclConfig_t whose strings live
                // in `raw_config` until the call returns (NCCL copies what it keeps).
                unsafe {
                    lib.api()
                        .ncclCommInitRankConfig(&mut raw, nranks, id.to_raw(), my_rank, cfg)
                },
            ),
            (Ids::Several(list), cfg) => {
                let mut raw_ids: Vec<nccl_sys::ncclUniqueId> =
                    list.iter().map(|id| id.to_raw()).collect();
                // `check_ids` bounded the count by `size`, which fits a C int.
                let n_ids = raw_ids.len() as c_int;
                let cfg = cfg.map_or(ptr::null_mut(), |cfg| cfg as *mut _);
                (
                    calls::ncclCommInitRankScalable.name,
                    // SAFETY: `raw` is a valid out-pointer; `raw_ids` holds `n_ids` ids and
                    // outlives the call (NCCL copies them before returning); `cfg` is null
                    // (NCCL's defaults) or an initialised ncclConfig_t as above.
                    unsafe {
                        lib.api().ncclCommInitRankScalable(
                            &mut raw,
                            nranks,
                            my_rank,
                            n_ids,
                            raw_ids.as_mut_ptr(),
                            cfg,
                        )
                    },
                )
            }
        };
        Self::adopt(lib, raw, stream, config, call, status).map_err(|err| match err {
            // Say what a nonblocking init waits for: usually a rank that never joined.
            Error::Timeout { waited, .. } => Error::Timeout {
                what: format!(
                    "{call} of rank {rank} of {size} to complete (every rank must join with \
                     the same {}; one has not, or the bootstrap network is unreachable); the \
                     communicator was aborted",
                    match ids {
                        Ids::One(_) => "id",
                        Ids::Several(_) => "ids in the same order",
                    }
                ),
                waited,
            },
            // A peer that gave up first (its own timeout) closed its connections.
            Error::Nccl {
                call,
                code: code @ (ResultCode::RemoteError | ResultCode::SystemError),
                description,
                last_error,
            } => Error::Nccl {
                call,
                code,
                description,
                last_error: Some(format!(
                    "{}{PEER_GAVE_UP}",
                    last_error.map_or(String::new(), |said| format!("{}; ", said.trim()))
                )),
            },
            other => crate::encryption::explain(other),
        })
    }

    /// Creates one communicator per stream, all in this process (`ncclCommInitAll`); rank `i`
    /// runs on the device of `streams[i]`. Every stream must be in its GPU's primary context
    /// (the one `CudaContext::new` returns), and on a different GPU, unless NCCL lets ranks
    /// share one: with `NCCL_MULTI_RANK_GPU_ENABLE=1` set before the first communicator of
    /// the process (NCCL 2.30+, experimental in NCCL), up to two ranks may share a GPU, each
    /// on a stream of its own (two ranks' kernels on one stream would wait for each other
    /// forever). Set `NCCL_RUNTIME_CONNECT=0` with it: a connection NCCL makes lazily while
    /// the other rank's kernel already waits on this GPU can hang both (seen on NCCL 2.32.3
    /// when a collective's configuration asked for more CTAs than were connected), and make
    /// each rank's buffers before the collectives that use them: an allocation can wait for
    /// the GPU while the other rank's kernel spins there waiting for this rank. For the same
    /// reason ranks sharing a GPU here need `CUDA_MODULE_LOADING=EAGER` in the environment
    /// before the process first uses CUDA (lazily, the CUDA 12.2+ default, a kernel's first
    /// use can wait for the whole context: seen hanging both ranks on one H200); without it
    /// `init_all` refuses them with [`Error::InvalidArgument`], before NCCL is called (see
    /// [`library::lazy_module_loading`]). Ranks of one process sharing a GPU through
    /// [`Comm::init_rank`] on threads need the same.
    ///
    /// Operations on these communicators must be issued from one thread inside a
    /// [`Group`](crate::Group), or each communicator must be moved to its own thread.
    pub fn init_all(streams: &[Arc<CudaStream>]) -> Result<Vec<Comm>> {
        let lib = library::get()?;
        thread_group::ensure_outside("Comm::init_all")?;
        if streams.is_empty() {
            return Err(Error::invalid("init_all needs at least one stream"));
        }
        let mut devices = Vec::with_capacity(streams.len());
        for (i, stream) in streams.iter().enumerate() {
            super::streams::check_own_stream(stream)?;
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
                check_shared_device(lib, streams, j, i, ordinal)?;
            }
            devices.push(c_int::try_from(ordinal).map_err(|_| {
                Error::invalid(format!("device ordinal {ordinal} does not fit a C int"))
            })?);
        }
        let ndev = c_int::try_from(devices.len())
            .map_err(|_| Error::invalid("too many streams for ncclCommInitAll"))?;
        crate::encryption::network_started();
        let mut raws: Vec<ncclComm_t> = vec![ptr::null_mut(); devices.len()];
        // SAFETY: `raws` has room for `ndev` handles and `devices` holds `ndev` ordinals.
        let status = unsafe {
            lib.api()
                .ncclCommInitAll(raws.as_mut_ptr(), ndev, devices.as_ptr())
        };
        if let Err(err) = lib.check(calls::ncclCommInitAll.name, status) {
            for raw in raws.into_iter().filter(|raw| !raw.is_null()) {
                // SAFETY: a handle NCCL returned and nobody else holds; the init failed, so
                // it is released without waiting for peers.
                let _ = unsafe { lib.api().ncclCommAbort(raw) };
            }
            return Err(err);
        }
        // Every handle gets its owner before anything else can fail, so an error below
        // aborts all of them (through Drop) instead of leaking the rest.
        let config = CommConfig::default();
        let siblings = Arc::new(Siblings::default());
        let mut comms: Vec<Comm> = raws
            .into_iter()
            .zip(streams)
            .map(|(raw, stream)| {
                let mut comm = Self::own(lib, raw, stream.clone(), &config);
                comm.siblings = Some(siblings.clone());
                comm
            })
            .collect();
        for comm in &mut comms {
            comm.read_back()?;
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
            // Owning first means any later failure aborts the handle through Drop.
            Ok(_) => {
                let mut comm = Self::own(lib, raw, stream, config);
                comm.read_back()?;
                Ok(comm)
            }
            Err(err) => {
                if !raw.is_null() {
                    // SAFETY: a handle from a failed init that nobody else holds.
                    let _ = unsafe { lib.api().ncclCommAbort(raw) };
                }
                Err(err)
            }
        }
    }

    /// Takes ownership of a live handle. Until [`Comm::read_back`] succeeds the
    /// communicator has no work to wait for: dropping it aborts at once.
    fn own(
        lib: &'static Library,
        raw: ncclComm_t,
        stream: Arc<CudaStream>,
        config: &CommConfig,
    ) -> Comm {
        Comm {
            shared: Arc::new(Shared::new(
                raw,
                config.is_blocking(),
                FlightRing::new(
                    flight::capacity(config.flight_recorder),
                    stream.cu_stream() as u64,
                    config.name(),
                ),
            )),
            context: ContextId::of(stream.context()),
            stream,
            lib,
            rank: 0,
            size: 0,
            device: 0,
            ready_timeout: config.ready_timeout,
            drop_timeout: Duration::ZERO,
            siblings: None,
            copy_engine: config.copy_engine(lib.version()),
            rma_setup: std::cell::Cell::new(super::RmaSetup::Pending),
            _not_sync: PhantomData,
        }
    }

    /// Waits until a new communicator is ready and reads back its rank, size and device.
    fn read_back(&mut self) -> Result<()> {
        self.wait_ready(self.ready_timeout)?;
        self.size = self.query(&calls::ncclCommCount, |lib, raw, out| {
            // SAFETY: `raw` is a live handle (held under the lock) and `out` a valid int.
            unsafe { lib.api().ncclCommCount(raw, out) }
        })?;
        self.rank = self.query(&calls::ncclCommUserRank, |lib, raw, out| {
            // SAFETY: as above.
            unsafe { lib.api().ncclCommUserRank(raw, out) }
        })?;
        self.device = self.query(&calls::ncclCommCuDevice, |lib, raw, out| {
            // SAFETY: as above.
            unsafe { lib.api().ncclCommCuDevice(raw, out) }
        })?;
        let stream_device = self.stream.context().ordinal();
        if stream_device != self.device {
            return Err(Error::invalid(format!(
                "the communicator is on device {} but its stream is on device {stream_device}",
                self.device
            )));
        }
        self.drop_timeout = DEFAULT_DROP_TIMEOUT;
        Ok(())
    }

    fn query(
        &self,
        row: &'static Call,
        f: impl FnOnce(
            &Library,
            ncclComm_t,
            &mut c_int,
        ) -> std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>,
    ) -> Result<usize> {
        let mut value: c_int = -1;
        let call = row.name;
        let status = self.with_raw(row, |raw| f(self.lib, raw, &mut value))?;
        self.lib.check(call, status)?;
        usize::try_from(value).map_err(|_| Error::Nccl {
            call,
            code: ResultCode::InternalError,
            description: format!("NCCL returned the negative value {value}"),
            last_error: None,
        })
    }
}

/// NCCL's switch for several ranks on one GPU (NCCL 2.30+, experimental), read once per
/// process like NCCL's own parameters.
pub(crate) const MULTI_RANK_GPU_VAR: &str = "NCCL_MULTI_RANK_GPU_ENABLE";
/// The first NCCL with [`MULTI_RANK_GPU_VAR`].
pub(crate) const MULTI_RANK_GPU_SINCE: Version = Version::new(2, 30, 0);
/// How many ranks NCCL documents as sharing one GPU.
pub(crate) const MULTI_RANK_GPU_MAX: usize = 2;

/// Whether `NCCL_MULTI_RANK_GPU_ENABLE` is a non-zero number in this process's environment.
pub(crate) fn multi_rank_gpu_enabled() -> bool {
    std::env::var(MULTI_RANK_GPU_VAR)
        .ok()
        .and_then(|text| text.trim().parse::<i64>().ok())
        .is_some_and(|value| value != 0)
}

/// Streams `first` and `second` of an `init_all` are on one device: allowed only where NCCL
/// lets ranks share a GPU, at most [`MULTI_RANK_GPU_MAX`] of them, each on its own stream.
fn check_shared_device(
    lib: &Library,
    streams: &[Arc<CudaStream>],
    first: usize,
    second: usize,
    ordinal: usize,
) -> Result<()> {
    let refuse = |why: String| {
        Err(Error::invalid(format!(
            "streams {first} and {second} are both on device {ordinal}: {why}"
        )))
    };
    if !multi_rank_gpu_enabled() {
        return refuse(format!(
            "each rank needs its own GPU, unless {MULTI_RANK_GPU_VAR}=1 (NCCL \
             {MULTI_RANK_GPU_SINCE}+) lets two ranks share one"
        ));
    }
    if lib.version() < MULTI_RANK_GPU_SINCE {
        return refuse(format!(
            "ranks sharing a GPU need NCCL {MULTI_RANK_GPU_SINCE}+, the loaded NCCL is {}",
            lib.version()
        ));
    }
    let sharing = streams[..=second]
        .iter()
        .filter(|s| s.context().ordinal() == ordinal)
        .count();
    if sharing > MULTI_RANK_GPU_MAX {
        return refuse(format!(
            "NCCL shares a GPU among at most {MULTI_RANK_GPU_MAX} ranks"
        ));
    }
    if let Some(same) = streams[..second]
        .iter()
        .position(|s| s.cu_stream() == streams[second].cu_stream())
    {
        return refuse(format!(
            "streams {same} and {second} are the same stream; ranks sharing a GPU need a \
             stream each (`CudaContext::new_stream`)"
        ));
    }
    // Both ranks are in one CUDA context. With lazy loading a kernel's first lookup or
    // launch can wait for the whole context, where the other rank's collective spins until
    // this rank joins it: both hang (seen on one H200: candle's first bf16 add after a
    // collective, NCCL 2.32.3).
    if library::lazy_module_loading()? {
        return refuse(
            "CUDA loads kernels lazily here (CUDA_MODULE_LOADING unset or LAZY, the default \
             since CUDA 12.2), and ranks of one process sharing a GPU share its context: a \
             kernel's first use can then wait for the other rank's collective, which waits \
             for this rank. Set CUDA_MODULE_LOADING=EAGER in the environment before the \
             process first uses CUDA"
                .into(),
        );
    }
    Ok(())
}

/// The unique ids a join names: one (`ncclCommInitRank[Config]`) or a list
/// (`ncclCommInitRankScalable`).
#[derive(Clone, Copy)]
enum Ids<'a> {
    One(&'a UniqueId),
    Several(&'a [UniqueId]),
}

/// What `ncclCommInitRankScalable` accepts: at least one id, at most one per rank (NCCL
/// returns `ncclInvalidArgument` otherwise), and no id twice (two roots at one address).
pub(crate) fn check_ids(ids: &[UniqueId], size: usize) -> Result<()> {
    if ids.is_empty() {
        return Err(Error::invalid(
            "init_rank_scalable needs at least one unique id",
        ));
    }
    if ids.len() > size {
        return Err(Error::invalid(format!(
            "{} unique ids for a communicator of {size} ranks: NCCL allows at most one per rank",
            ids.len()
        )));
    }
    for (i, id) in ids.iter().enumerate() {
        if let Some(j) = ids[..i].iter().position(|earlier| earlier == id) {
            return Err(Error::invalid(format!(
                "unique ids {j} and {i} are the same id: each names a bootstrap root of its own"
            )));
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn scalable_ids_are_checked() {
        let id = |b: u8| UniqueId::from_bytes([b; crate::id::UNIQUE_ID_BYTES]);
        assert!(check_ids(&[id(1), id(2)], 2).is_ok());
        assert!(check_ids(&[id(1)], 1).is_ok());
        let err = check_ids(&[], 4).unwrap_err().to_string();
        assert!(err.contains("at least one unique id"), "{err}");
        let err = check_ids(&[id(1), id(2), id(3)], 2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("3 unique ids") && err.contains("at most one per rank"),
            "{err}"
        );
        let err = check_ids(&[id(1), id(2), id(1)], 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("ids 0 and 2 are the same"), "{err}");
    }
}
