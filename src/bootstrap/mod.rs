//! Starting a multi-process job: which rank am I, and how do the ranks agree on a
//! [`UniqueId`]?
//!
//! NCCL leaves both questions to the application. Rank 0 creates the id with
//! [`UniqueId::new`]; every other rank must receive those 128 bytes before calling
//! `Comm::init_rank`. This module answers them without MPI:
//!
//! 1. [`Placement::from_env`] reads the rank, world size and local rank exported by the launcher
//!    (Open MPI, MPICH/Hydra/PMI, PMIx, Slurm's `srun`, `torchrun`, or none at all).
//! 2. [`exchange_id`] hands rank 0's id to every rank over TCP ([`TcpRendezvous`]) or, when all
//!    ranks share one machine, through a file ([`FileRendezvous`]); [`exchange_ids`] hands out
//!    several, for NCCL's scalable init ([`IdCount`]: by itself above
//!    [`SCALABLE_RANKS_PER_ID`] ranks, or when `NCCL_RS_UNIQUE_IDS` asks).
//! 3. [`spawn_local`] turns a plain `cargo run` into a job of one process per GPU.
//!
//! With the `mpi` feature, `mpi::exchange_id_mpi` broadcasts the id over an existing MPI
//! communicator instead.
//!
//! ```no_run
//! use nccl::bootstrap::{exchange_id, Exchange, Placement};
//!
//! # fn main() -> nccl::Result<()> {
//! let placement = Placement::from_env()?;
//! let id = exchange_id(&placement, Exchange::Auto)?;
//! // Pick the GPU with `placement.device_ordinal(device_count)?` (one visible GPU: that one;
//! // otherwise the local rank), then
//! // `Comm::init_rank(stream, &id, placement.rank, placement.world_size)`.
//! # let _ = id;
//! # Ok(())
//! # }
//! ```
//!
//! # Ways to start a job
//!
//! * **`mpirun -n 8 ./app`** (Open MPI, MPICH, Intel MPI): the rank comes from the MPI
//!   variables. Set `NCCL_RS_ADDR=<host of rank 0>:<port>` (or `MASTER_ADDR`/`MASTER_PORT`)
//!   for a job on several nodes, e.g. `mpirun -x NCCL_RS_ADDR=node0:29500 ...`; on one node no
//!   address is needed (file rendezvous), provided the launcher exports the local size.
//! * **`srun -n 8 ./app`** (Slurm): the rank comes from the step variables and the job key
//!   from `SLURM_JOB_ID`; set `NCCL_RS_ADDR` or `MASTER_ADDR`/`MASTER_PORT` as for MPI when
//!   the step spans nodes.
//! * **`torchrun --nproc-per-node 8 --no-python ./app`**, or any tool exporting `RANK`,
//!   `WORLD_SIZE`, `LOCAL_RANK` and `MASTER_ADDR`/`MASTER_PORT` (as torchrun does).
//! * **No launcher**: `cargo run --example x` is rank 0 of 1, unless the program calls
//!   [`spawn_local`] with its GPU count: then the process becomes rank 0 and re-executes
//!   itself once per other rank, so `cargo run` on a 4-GPU machine runs 4 ranks.
//!
//! # More ranks than GPUs
//!
//! To develop and test a multi-GPU program on one GPU, several ranks can share it in one of
//! two shapes ([`GpuSharing`] says what each exercises); the ranks time-slice the GPU, so
//! this is for correctness, not speed:
//!
//! * **simulated hosts** (any NCCL, any rank count): `NCCL_RS_LOCAL_RANKS=4 cargo run
//!   --example allreduce` on a one-GPU machine. [`spawn_local`] chooses this shape by itself
//!   when it has more ranks than GPUs (it says so on standard error) and gives every rank it
//!   starts its own `NCCL_HOSTID`. Under another launcher, set `NCCL_RS_GPU_SHARING=hosts`
//!   and a distinct `NCCL_HOSTID` per rank, e.g. `mpirun -np 4 -x NCCL_RS_GPU_SHARING=hosts
//!   -x NCCL_SOCKET_IFNAME=lo sh -c 'NCCL_HOSTID=rank$OMPI_COMM_WORLD_RANK exec ./app'`.
//! * **a shared GPU** (NCCL 2.30+, two ranks per GPU, one LSA team: windows, RMA, the device
//!   API): `NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_RS_LOCAL_RANKS=2 cargo run --example windows`,
//!   or `mpirun -np 2 -x NCCL_MULTI_RANK_GPU_ENABLE=1 -x NCCL_RS_GPU_SHARING=shared ./app`.
//!
//! # Environment variables
//!
//! Placement detection ([`Placement::from_vars`]):
//!
//! | variable | meaning |
//! | --- | --- |
//! | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | Open MPI rank and size |
//! | `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` | Open MPI rank and ranks on this node |
//! | `PMI_RANK`, `PMI_SIZE` | MPICH/Hydra/Intel MPI/PMI-2 rank and size |
//! | `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` | Hydra's rank and ranks on this node |
//! | `PMIX_RANK` | PMIx rank; the size is taken from `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE` or Slurm |
//! | `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (else `SLURM_NTASKS`), `SLURM_LOCALID` | Slurm step rank, size, local rank |
//! | `SLURM_STEP_TASKS_PER_NODE` with `SLURM_NODEID`, else `SLURM_NTASKS_PER_NODE` | Slurm ranks on this node (optional) |
//! | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | torchrun-style rank, size, local rank, local size |
//! | `NCCL_RS_LAUNCHER` | read only this launcher's variables: `openmpi`, `mpich`, `pmix`, `slurm`, `torchrun` or `none` |
//!
//! A launcher counts as present when its rank or size variable is set; it must then set both.
//! Empty values count as unset. No launcher at all means rank 0 of 1.
//!
//! Slurm variables are used only inside a job step, that is when `SLURM_STEP_ID`,
//! `SLURM_STEPID` or `SLURM_STEP_NUM_TASKS` is set. A batch script or an `salloc` shell also
//! carries `SLURM_PROCID=0` and the allocation's `SLURM_NTASKS`, but a program started there
//! directly is not one of those tasks: reading them would make it wait forever for ranks that
//! `srun` never started. `NCCL_RS_LAUNCHER=slurm` reads them anyway.
//!
//! Rendezvous ([`Exchange::from_vars`]):
//!
//! | variable | meaning |
//! | --- | --- |
//! | `NCCL_RS_ADDR` | `host:port` where rank 0 listens for the TCP rendezvous (`[v6]:port` for IPv6) |
//! | `MASTER_ADDR`, `MASTER_PORT` | used when `NCCL_RS_ADDR` is unset, as torchrun exports them; when `TORCHELASTIC_USE_AGENT_STORE=True` (torchrun's agent already listens on `MASTER_PORT`), the port after it |
//! | `NCCL_RS_JOB_KEY` | names the job, so that two jobs on one address or one directory cannot mix |
//! | `NCCL_RS_RENDEZVOUS_KEY` | the secret of the encrypted, authenticated TCP rendezvous ([`RendezvousKey`]): at least 64 hexadecimal digits (32 bytes, e.g. `openssl rand -hex 32`), the same on every rank; unset means the unencrypted protocol |
//! | `NCCL_RS_RENDEZVOUS_DIR` | directory of the file rendezvous (default: [`std::env::temp_dir`]) |
//! | `NCCL_RS_BOOTSTRAP_TIMEOUT` | seconds every rank waits for the others (default 300) |
//! | `NCCL_RS_UNIQUE_IDS` | how many unique ids [`exchange_ids`], [`Comm::from_env`](crate::Comm::from_env) and [`LocalJob::init_comm`] hand out: `auto` (default: one, or one per [`SCALABLE_RANKS_PER_ID`] ranks on NCCL 2.23+) or a count from 1 to the world size; several ids are joined with [`Comm::init_rank_scalable`](crate::Comm::init_rank_scalable) ([`IdCount`]) |
//! | `NCCL_RS_LOCAL_RANKS` | overrides the rank count given to [`spawn_local`] |
//! | `NCCL_RS_GPU_SHARING` | `off`, `hosts` or `shared`: how ranks share GPUs when a node has more ranks than GPUs ([`GpuSharing`]) |
//!
//! Without `NCCL_RS_JOB_KEY`, the key is derived from, in order: `SLURM_JOB_ID` (with
//! `SLURM_STEP_ID` when set), `OMPI_MCA_ess_base_jobid`, `PMIX_NAMESPACE`,
//! `TORCHELASTIC_RUN_ID`; failing all, the fixed key `nccl-rs-default`, which is only safe
//! while one job at a time runs on a rendezvous address or directory. The key is sent as a
//! 64-bit hash; it tells jobs apart and is not a secret.
//!
//! The secret is `NCCL_RS_RENDEZVOUS_KEY`: with it every rank speaks the TCP protocol's
//! version 3, which encrypts the id and only hands it to ranks holding the same key
//! ([`TcpTransport`] says what it protects against). Pass it to every rank like the address,
//! e.g. `mpirun -x NCCL_RS_RENDEZVOUS_KEY ...` (`srun` and `torchrun` pass the environment on);
//! [`spawn_local`] draws a fresh one for the ranks it starts. A rank with a key and a rank 0
//! without one (or the reverse) fail with [`BootstrapError::Authentication`] saying so. The
//! file rendezvous ignores it (the file is private to its user) but still rejects a malformed
//! one.
//!
//! Several exchanges under one key (e.g. one per communicator) must run one after the other,
//! in the same order on every rank; both methods keep them apart (TCP by counting rounds, the
//! file rendezvous by skipping a publication the rank already used). A distinct key per
//! exchange, or splitting an existing communicator, avoids the question.
//!
//! # Several launchers at once
//!
//! Launchers nest: `srun` may start `torchrun` agents, which start the ranks, or start Open
//! MPI's daemons, which start the ranks. The innermost launcher is believed, in this order:
//! torchrun-style, Open MPI, MPICH/PMI, PMIx, Slurm. Every other launcher present must either
//! agree (same rank and size, as when `srun --mpi=pmix` exports PMIx and Slurm variables) or
//! describe fewer processes than the innermost one (it counted per-node agents). Anything else
//! — same size but another rank, or more processes — is a [`BootstrapError::Conflict`];
//! `NCCL_RS_LAUNCHER` settles it.
//!
//!
//! # Wire protocols
//!
//! Both rendezvous methods speak a small versioned protocol: [`TcpTransport`] and
//! [`FileTransport`] describe them byte by byte.
//!
//! # Rooms
//!
//! `launch` reads the launchers' variables into a [`Placement`] and picks the GPU;
//! `env` reads the rendezvous settings; `ids` is how many ids an exchange hands out and who
//! creates them; [`Rendezvous`] is what TCP and the file method share
//! (rank, world size, job key, deadline, the exchange); `tcp` and `file` are the two
//! [`Transport`]s, each with its wire format in a `wire` room; `history` remembers past
//! exchanges so that repeated ones stay apart; `sharing` is how ranks share a GPU; `spawn` is [`spawn_local`] and its supervisor;
//! `join` is the glue to the rest of the crate ([`Comm::from_env`](crate::Comm::from_env),
//! [`LocalJob::init_comm`]); `mpi` (feature `mpi`) broadcasts the id over MPI.
//!
//! `bootstrap` uses only [`UniqueId`], [`Comm::init_rank`](crate::Comm::init_rank) and
//! [`Comm::init_rank_scalable`](crate::Comm::init_rank_scalable), [`EncryptionKey`](crate::EncryptionKey)
//! (derived from a [`RendezvousKey`]),
//! [`library::cuda_device_count`](crate::library::cuda_device_count), the loaded library's
//! [`Version`](crate::Version) (`sharing` checks it) and [`crate::Error`] from the rest of the
//! crate; nothing else in the crate depends on it but [`crate::Error`]'s
//! `Bootstrap` variant.

mod bytes;
mod env;
mod error;
mod file;
mod history;
mod ids;
#[cfg(test)]
mod ids_tests;
mod join;
mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
mod rendezvous;
mod sharing;
mod spawn;
mod tcp;
mod util;

pub use env::{DEFAULT_JOB_KEY, DEFAULT_TIMEOUT};
pub use error::{BootstrapError, ChildExit, Result};
pub use file::{FileRendezvous, FileTransport};
pub use ids::{rank_has_root, root_rank, IdCount, MAX_EXCHANGED_IDS, SCALABLE_RANKS_PER_ID};
pub use launch::{Launcher, Placement};
pub use rendezvous::{Rendezvous, Transport};
pub use sharing::GpuSharing;
pub use spawn::{spawn_local, LocalJob};
pub use tcp::{
    RejectedPeer, RendezvousKey, ServeReport, TcpRendezvous, TcpServer, TcpTransport, MIN_KEY_BYTES,
};

use crate::UniqueId;
use env::{address_from, process_var, vars, Vars};

/// How the ranks exchange the unique id.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Exchange {
    /// Choose from the environment, see [`Exchange::from_vars`].
    Auto,
    /// Over TCP, rank 0 serving.
    Tcp(TcpRendezvous),
    /// Through a file, all ranks on one machine.
    File(FileRendezvous),
}

impl Exchange {
    /// Resolves [`Exchange::Auto`] from this process's environment.
    pub fn from_env(placement: &Placement) -> Result<Exchange> {
        Self::from_vars(placement, process_var)
    }

    /// Resolves [`Exchange::Auto`] from the variables `vars` returns: TCP when `NCCL_RS_ADDR`
    /// or `MASTER_ADDR`/`MASTER_PORT` is set; else the file rendezvous when every rank is on
    /// this node ([`Placement::is_single_node`], or no launcher); else an error asking for an
    /// address.
    pub fn from_vars(
        placement: &Placement,
        vars: impl Fn(&str) -> Option<String>,
    ) -> Result<Exchange> {
        let vars: Vars<'_> = &vars;
        if address_from(vars)?.is_some() {
            return TcpRendezvous::from_vars(placement, vars).map(Exchange::Tcp);
        }
        if placement.is_single_node() || placement.launcher == Launcher::None {
            // The file method does not use the key (the file's permissions protect the id),
            // but a malformed key is still a mistake to report rather than ignore.
            tcp::key_from(vars)?;
            return FileRendezvous::from_vars(placement, vars).map(Exchange::File);
        }
        Err(BootstrapError::Config(format!(
            "the {} ranks of this {} launch may span several nodes (ranks on this node: {}), \
             so the file rendezvous cannot be used; set {} to host:port of rank 0, or {} and {}",
            placement.world_size,
            placement.launcher,
            placement
                .local_world_size
                .map_or_else(|| "unknown".to_owned(), |n| n.to_string()),
            vars::ADDR,
            vars::MASTER_ADDR,
            vars::MASTER_PORT,
        )))
    }
}

/// Gives every rank the same [`UniqueId`]; rank 0 creates it with [`UniqueId::new`].
///
/// See [`exchange_id_with`].
pub fn exchange_id(placement: &Placement, method: Exchange) -> crate::Result<UniqueId> {
    exchange_id_with(placement, method, UniqueId::new)
}

/// Gives every rank the same [`UniqueId`]; rank 0 creates it by calling `make_id`, the others
/// never call it.
///
/// A job of one rank needs no exchange: `make_id` is called and its id returned. Otherwise
/// [`Exchange::Auto`] is resolved with [`Exchange::from_env`], and an explicit rendezvous must
/// agree with `placement` on rank and world size. Returns on rank 0 once every rank holds the id.
pub fn exchange_id_with(
    placement: &Placement,
    method: Exchange,
    make_id: impl FnOnce() -> crate::Result<UniqueId>,
) -> crate::Result<UniqueId> {
    if placement.world_size == 1 && placement.rank == 0 {
        return make_id();
    }
    match resolve(placement, method)? {
        Exchange::Tcp(tcp) => checked(placement, &tcp)?.exchange_with(make_id),
        Exchange::File(file) => checked(placement, &file)?.exchange_with(make_id),
        Exchange::Auto => Err(unresolved()),
    }
}

/// Gives every rank the same unique ids, as many as the rendezvous's [`IdCount`] says
/// (`NCCL_RS_UNIQUE_IDS` for [`Exchange::Auto`]; by default one, or one per
/// [`SCALABLE_RANKS_PER_ID`] ranks on NCCL 2.23+), for
/// [`Comm::init_rank_scalable`](crate::Comm::init_rank_scalable); rank 0 creates them with
/// [`UniqueId::new`]. See [`exchange_ids_with`].
pub fn exchange_ids(placement: &Placement, method: Exchange) -> crate::Result<Vec<UniqueId>> {
    exchange_ids_with(placement, method, UniqueId::new)
}

/// Like [`exchange_ids`], with rank 0 creating each id by calling `make_id`.
///
/// The ids are all created on rank 0 (each `ncclGetUniqueId` starts a bootstrap root of its
/// own, a thread with its own port, in rank 0's process): that spreads the roots' work over
/// threads but keeps their connections on rank 0's host. NCCL's guide would rather have the
/// roots on ranks spread over the job ([`rank_has_root`]); the `mpi` feature's exchange does
/// that.
pub fn exchange_ids_with(
    placement: &Placement,
    method: Exchange,
    mut make_id: impl FnMut() -> crate::Result<UniqueId>,
) -> crate::Result<Vec<UniqueId>> {
    let method = match (placement.world_size, placement.rank, method) {
        // A job of one rank needs no exchange, and one id.
        (1, 0, _) => return Ok(vec![make_id()?]),
        (_, _, method) => resolve(placement, method)?,
    };
    match method {
        Exchange::Tcp(tcp) => checked(placement, &tcp)?.exchange_ids_with(make_id),
        Exchange::File(file) => checked(placement, &file)?.exchange_ids_with(make_id),
        Exchange::Auto => Err(unresolved()),
    }
}

/// Resolves [`Exchange::Auto`] from the environment.
fn resolve(placement: &Placement, method: Exchange) -> crate::Result<Exchange> {
    Ok(match method {
        Exchange::Auto => Exchange::from_env(placement)?,
        other => other,
    })
}

/// `from_env` never returns Auto.
fn unresolved() -> crate::Error {
    BootstrapError::Config("Exchange::Auto could not be resolved".to_owned()).into()
}

/// `rendezvous`, which must agree with `placement` on rank and world size.
fn checked<'a, T: Transport>(
    placement: &Placement,
    rendezvous: &'a Rendezvous<T>,
) -> crate::Result<&'a Rendezvous<T>> {
    let (rank, world_size) = (rendezvous.rank(), rendezvous.world_size());
    if (rank, world_size) != (placement.rank, placement.world_size) {
        return Err(BootstrapError::Config(format!(
            "the rendezvous is set up for rank {rank} of {world_size}, but the launcher says \
             rank {} of {}",
            placement.rank, placement.world_size
        ))
        .into());
    }
    Ok(rendezvous)
}
