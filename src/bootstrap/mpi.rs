//! Exchanging the unique id over an MPI communicator (feature `mpi`).
//!
//! ```no_run
//! use mpi::traits::*;
//! use nccl::bootstrap::mpi::{exchange_id_mpi, placement_from_mpi};
//!
//! # fn main() -> nccl::Result<()> {
//! let universe = mpi::initialize().expect("MPI initialises once");
//! let world = universe.world();
//! let placement = placement_from_mpi(&world);
//! let id = exchange_id_mpi(&world)?;
//! // Comm::init_rank(stream, &id, placement.rank, placement.world_size) on GPU
//! // placement.device_ordinal(visible GPUs)?.
//! # let _ = (placement, id);
//! # Ok(())
//! # }
//! ```

use ::mpi::collective::SystemOperation;
use ::mpi::topology::Communicator;
use ::mpi::traits::{CommunicatorCollectives, Root};

use super::ids::{agreed_count, count_message, IdCount, COUNT_MESSAGE_LEN};
use super::{root_rank, BootstrapError, Launcher, Placement};
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

/// The rank that creates the id and broadcasts it.
const ROOT: ::mpi::Rank = 0;

/// Rank 0 of `world` creates a [`UniqueId`] with [`UniqueId::new`] and broadcasts it
/// (`MPI_Bcast`); every rank returns it. Collective: every rank of `world` must call it.
///
/// The broadcast carries a status byte before the 128 id bytes, so that when rank 0 cannot
/// create the id the other ranks fail too instead of receiving garbage; rank 0 returns its
/// own error.
pub fn exchange_id_mpi(world: &impl Communicator) -> crate::Result<UniqueId> {
    exchange_id_mpi_with(world, UniqueId::new)
}

/// Like [`exchange_id_mpi`], but rank 0 creates the id by calling `make_id`.
pub fn exchange_id_mpi_with(
    world: &impl Communicator,
    make_id: impl FnOnce() -> crate::Result<UniqueId>,
) -> crate::Result<UniqueId> {
    let mut message = [0u8; 1 + UNIQUE_ID_BYTES];
    let mut root_error = None;
    if world.rank() == ROOT {
        match make_id() {
            Ok(id) => {
                message[0] = 1;
                message[1..].copy_from_slice(id.as_bytes());
            }
            Err(error) => root_error = Some(error),
        }
    }
    world.process_at_rank(ROOT).broadcast_into(&mut message[..]);
    if let Some(error) = root_error {
        return Err(error);
    }
    if message[0] != 1 {
        return Err(BootstrapError::Config(
            "rank 0 could not create the NCCL unique id (see rank 0's error)".to_owned(),
        )
        .into());
    }
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    bytes.copy_from_slice(&message[1..]);
    Ok(UniqueId::from_bytes(bytes))
}

/// Gives every rank of `world` the same `count` unique ids, for
/// [`Comm::init_rank_scalable`](crate::Comm::init_rank_scalable), created as NCCL's guide
/// asks: id `i` by the first rank of the `i`-th of `count` even groups of ranks
/// ([`rank_has_root`](super::rank_has_root)), each then broadcast from its creator
/// (`MPI_Bcast`, one per id, in order). Collective: every rank of `world` must call it.
///
/// The number of ids is rank 0's: rank 0 resolves `count` (under [`IdCount::Auto`], from the
/// world size and whether the NCCL it loaded has `ncclCommInitRankScalable`) and broadcasts
/// it first, so that ranks that loaded different NCCL releases, or none, still take part in
/// the same broadcasts. A rank whose own `count` is exactly another number fails with
/// [`BootstrapError::IdCountMismatch`]; the ranks agree on that (`MPI_Allreduce`) before any
/// id moves, so that then every rank fails, none left waiting.
///
/// Each id's broadcast carries a status byte, as in [`exchange_id_mpi`]: a creator that fails
/// makes every rank fail instead of joining with garbage.
pub fn exchange_ids_mpi(world: &impl Communicator, count: IdCount) -> crate::Result<Vec<UniqueId>> {
    exchange_ids_mpi_with(world, count, UniqueId::new)
}

/// Like [`exchange_ids_mpi`], with each creating rank calling `make_id`.
pub fn exchange_ids_mpi_with(
    world: &impl Communicator,
    count: IdCount,
    mut make_id: impl FnMut() -> crate::Result<UniqueId>,
) -> crate::Result<Vec<UniqueId>> {
    // MPI sizes and ranks are non-negative by definition.
    let size = world.size() as usize;
    let me = world.rank() as usize;
    let count = agree_on_count(world, count, size)?;
    let mut ids = Vec::with_capacity(count);
    let mut own_error = None;
    for index in 0..count {
        let root = root_rank(index, size, count);
        let mut message = [0u8; 1 + UNIQUE_ID_BYTES];
        if root == me {
            match make_id() {
                Ok(id) => {
                    message[0] = 1;
                    message[1..].copy_from_slice(id.as_bytes());
                }
                Err(error) => own_error = Some(error),
            }
        }
        world
            .process_at_rank(root as ::mpi::Rank)
            .broadcast_into(&mut message[..]);
        if message[0] != 1 {
            // Every rank takes part in every broadcast before giving up, so none is left
            // waiting in one.
            own_error.get_or_insert_with(|| {
                BootstrapError::Config(format!(
                    "rank {root} could not create NCCL unique id {index} (see its error)"
                ))
                .into()
            });
            continue;
        }
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        bytes.copy_from_slice(&message[1..]);
        ids.push(UniqueId::from_bytes(bytes));
    }
    match own_error {
        Some(error) => Err(error),
        None => Ok(ids),
    }
}

/// Rank 0's id count, on every rank, or an error on every rank: rank 0 settles `own` and
/// broadcasts it, then all ranks agree that each can take it. Every rank makes both
/// collective calls whatever happens, so that no rank is left waiting in one.
fn agree_on_count(world: &impl Communicator, own: IdCount, size: usize) -> crate::Result<usize> {
    let mut message = [0u8; COUNT_MESSAGE_LEN];
    let mut root_error = None;
    if world.rank() == ROOT {
        let settled = own.resolve_for_host(size);
        message = count_message(&settled);
        root_error = settled.err();
    }
    world.process_at_rank(ROOT).broadcast_into(&mut message[..]);
    let agreed = agreed_count(&message, own, size);
    let mine = i32::from(agreed.is_ok());
    let mut everyone = 0i32;
    world.all_reduce_into(&mine, &mut everyone, SystemOperation::min());
    if let Some(error) = root_error {
        return Err(error.into());
    }
    let count = agreed?;
    if everyone == 0 {
        return Err(BootstrapError::Config(format!(
            "another rank expects another number of NCCL unique ids than rank 0's {count} \
             (see that rank's IdCountMismatch error)"
        ))
        .into());
    }
    Ok(count)
}

/// This process's [`Placement`] from MPI itself: rank and size of `world`, and the local rank and
/// size from the ranks sharing this node (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`).
/// Collective: every rank of `world` must call it.
pub fn placement_from_mpi(world: &impl Communicator) -> Placement {
    let node = world.split_shared(world.rank());
    // MPI ranks and sizes are non-negative by definition.
    let count = |value: ::mpi::Rank| usize::try_from(value).unwrap_or(0);
    Placement {
        rank: count(world.rank()),
        world_size: count(world.size()),
        local_rank: count(node.rank()),
        local_world_size: Some(count(node.size())),
        // Name the launcher that started MPI when its variables say; MPI itself is PMI-based.
        launcher: Placement::from_env()
            .ok()
            .map(|placement| placement.launcher)
            .filter(|launcher| *launcher != Launcher::None)
            .unwrap_or(Launcher::MpichOrPmi),
    }
}
