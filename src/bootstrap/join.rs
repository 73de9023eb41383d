//! Joining a communicator from a placement: choosing the GPU, taking its stream, exchanging
//! the id, `ncclCommInitRank`. The glue between `bootstrap` and the rest of the crate.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::env::{lookup, process_var};
use super::sharing::HOST_ID_VAR;
use super::{exchange_ids, BootstrapError, Exchange, GpuSharing, Placement};
use crate::comm::Comm;
use crate::UniqueId;

/// How this process's rank shares a GPU, when it must.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sharing {
    pub(super) sharing: GpuSharing,
    /// Whether this process already looks like a host of its own to NCCL without an
    /// `NCCL_HOSTID` (rank 0 of [`spawn_local`](super::spawn_local), whose spawned ranks
    /// carry ids of their own).
    pub(super) own_host: bool,
}

impl Sharing {
    /// As `NCCL_RS_GPU_SHARING` says (off when unset), for a process some launcher started.
    pub(super) fn from_env() -> super::Result<Sharing> {
        Ok(Sharing {
            sharing: GpuSharing::from_vars(&process_var)?.unwrap_or(GpuSharing::Off),
            own_host: false,
        })
    }
}

/// The GPU of the rank `placement` describes, from the GPUs this process sees, sharing one
/// with other ranks as `sharing` allows.
pub(super) fn device_of(placement: &Placement, sharing: Sharing) -> crate::Result<usize> {
    let visible = crate::library::cuda_device_count()?;
    let device = placement.device_ordinal_sharing(visible, sharing.sharing)?;
    if sharing.sharing != GpuSharing::Off && placement.outnumbers(visible) {
        let ranks = placement
            .local_world_size
            .unwrap_or(placement.local_rank + 1);
        let version = crate::library::get().ok().map(|lib| lib.version());
        sharing
            .sharing
            .check(ranks, visible, version, &process_var)?;
        if sharing.sharing == GpuSharing::SimulatedHosts
            && !sharing.own_host
            && lookup(&process_var, HOST_ID_VAR).is_none()
        {
            return Err(BootstrapError::Config(format!(
                "NCCL_RS_GPU_SHARING=hosts: local rank {} shares GPU {device}, so NCCL must see                  it as a host of its own: give every rank a distinct {HOST_ID_VAR}, e.g.                  `mpirun -np {ranks} ... sh -c '{HOST_ID_VAR}=rank$OMPI_COMM_WORLD_RANK exec                  ./app'`",
                placement.local_rank
            ))
            .into());
        }
    }
    Ok(device)
}

/// Joins the communicator described by `placement` on its GPU ([`device_of`]).
pub(super) fn init_comm(
    placement: &Placement,
    sharing: Sharing,
    exchange: impl FnOnce() -> crate::Result<Vec<UniqueId>>,
) -> crate::Result<(Comm, Arc<CudaStream>)> {
    let device = device_of(placement, sharing)?;
    // The default stream: see `LocalJob::init_comm`.
    let stream = CudaContext::new(device)?.default_stream();
    let comm = join_on(placement, sharing, stream.clone(), exchange)?;
    Ok((comm, stream))
}

/// Joins the communicator described by `placement` on `stream`, which must be on its GPU
/// ([`device_of`]): with `ncclCommInitRank` when the exchange handed out one id, else with
/// `ncclCommInitRankScalable`.
pub(super) fn join_on(
    placement: &Placement,
    sharing: Sharing,
    stream: Arc<CudaStream>,
    exchange: impl FnOnce() -> crate::Result<Vec<UniqueId>>,
) -> crate::Result<Comm> {
    let device = device_of(placement, sharing)?;
    let on = stream.context().ordinal();
    if on != device {
        return Err(crate::Error::invalid(format!(
            "rank {} runs on device {device}, but the stream is on device {on}",
            placement.rank
        )));
    }
    let ids = exchange()?;
    let (rank, size) = (placement.rank, placement.world_size);
    match ids.as_slice() {
        [id] => Comm::init_rank(stream, id, rank, size),
        several => Comm::init_rank_scalable(stream, several, rank, size),
    }
}

impl Comm {
    /// The common case in one call, for programs started by a launcher (`mpirun`, `srun`,
    /// torchrun-style): reads rank and size from the environment ([`Placement::from_env`]),
    /// picks its GPU ([`Placement::device_ordinal`]: the only one this process sees, else the
    /// local rank; with `NCCL_RS_GPU_SHARING` set, ranks may share one, see
    /// [`GpuSharing`]), takes its default stream (see
    /// [`LocalJob::init_comm`](super::LocalJob::init_comm) for why), exchanges the unique ids
    /// ([`Exchange::Auto`]: TCP when an address is set, else a file on one node; as many as
    /// `NCCL_RS_UNIQUE_IDS` says, by default one, or one per
    /// [`SCALABLE_RANKS_PER_ID`](super::SCALABLE_RANKS_PER_ID) ranks on NCCL 2.23+) and joins
    /// ([`Comm::init_rank`], or [`Comm::init_rank_scalable`] with several ids).
    ///
    /// Without a launcher this is a single rank on GPU 0; to start one process per GPU
    /// instead, use [`spawn_local`](super::spawn_local) and
    /// [`LocalJob::init_comm`](super::LocalJob::init_comm).
    pub fn from_env() -> crate::Result<(Comm, Arc<CudaStream>)> {
        let placement = Placement::from_env()?;
        init_comm(&placement, Sharing::from_env()?, || {
            exchange_ids(&placement, Exchange::Auto)
        })
    }
}
