//! Joining a communicator from a placement: choosing the GPU, taking its stream, exchanging
//! the id, `ncclCommInitRank`. The glue between `bootstrap` and the rest of the crate.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::{exchange_id, Exchange, Placement};
use crate::comm::Comm;
use crate::UniqueId;

/// The GPU of the rank `placement` describes, from the GPUs this process sees.
pub(super) fn device_of(placement: &Placement) -> crate::Result<usize> {
    let visible = crate::library::cuda_device_count()?;
    Ok(placement.device_ordinal(visible)?)
}

/// Joins the communicator described by `placement` on its GPU ([`device_of`]).
pub(super) fn init_comm(
    placement: &Placement,
    exchange: impl FnOnce() -> crate::Result<UniqueId>,
) -> crate::Result<(Comm, Arc<CudaStream>)> {
    // The default stream: see `LocalJob::init_comm`.
    let stream = CudaContext::new(device_of(placement)?)?.default_stream();
    let comm = join_on(placement, stream.clone(), exchange)?;
    Ok((comm, stream))
}

/// Joins the communicator described by `placement` on `stream`, which must be on its GPU
/// ([`device_of`]).
pub(super) fn join_on(
    placement: &Placement,
    stream: Arc<CudaStream>,
    exchange: impl FnOnce() -> crate::Result<UniqueId>,
) -> crate::Result<Comm> {
    let device = device_of(placement)?;
    let on = stream.context().ordinal();
    if on != device {
        return Err(crate::Error::invalid(format!(
            "rank {} runs on device {device}, but the stream is on device {on}",
            placement.rank
        )));
    }
    let id = exchange()?;
    Comm::init_rank(stream, &id, placement.rank, placement.world_size)
}

impl Comm {
    /// The common case in one call, for programs started by a launcher (`mpirun`, `srun`,
    /// torchrun-style): reads rank and size from the environment ([`Placement::from_env`]),
    /// picks its GPU ([`Placement::device_ordinal`]: the only one this process sees, else the
    /// local rank), takes its default stream (see
    /// [`LocalJob::init_comm`](super::LocalJob::init_comm) for why), exchanges the unique id
    /// ([`Exchange::Auto`]: TCP when an address is set, else a file on one node) and joins.
    ///
    /// Without a launcher this is a single rank on GPU 0; to start one process per GPU
    /// instead, use [`spawn_local`](super::spawn_local) and
    /// [`LocalJob::init_comm`](super::LocalJob::init_comm).
    pub fn from_env() -> crate::Result<(Comm, Arc<CudaStream>)> {
        let placement = Placement::from_env()?;
        init_comm(&placement, || exchange_id(&placement, Exchange::Auto))
    }
}
