//! Finding out which rank this process is, from the variables its launcher exported, and
//! which GPU it should use. The launchers' variables are read in [`readers`].

mod readers;

use std::fmt;

use self::readers::{fill_pmix_size, incomplete, read_all, Reading, Var, PMIX_RANK};
use super::env::{lookup, process_var, vars, Vars};
use super::{BootstrapError, GpuSharing, Result};

/// The program that started this process, as far as its environment tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Launcher {
    /// Open MPI's `mpirun`/`mpiexec`/`prterun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// MPICH, Intel MPI or another Hydra/PMI-1/PMI-2 launcher, including `srun --mpi=pmi2`
    /// (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`).
    MpichOrPmi,
    /// A PMIx launcher that exports only `PMIX_RANK` (e.g. `srun --mpi=pmix`); the world size
    /// comes from another launcher's variables.
    Pmix,
    /// A Slurm job step started by `srun` (`SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, ...).
    Slurm,
    /// `torchrun` or anything exporting the same variables (`RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`), including the ranks started by [`spawn_local`](super::spawn_local).
    Torchrun,
    /// No launcher: the process was started on its own.
    None,
}

impl Launcher {
    /// A human-readable name, as used in error messages.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::OpenMpi => "Open MPI",
            Launcher::MpichOrPmi => "MPICH/PMI",
            Launcher::Pmix => "PMIx",
            Launcher::Slurm => "Slurm",
            Launcher::Torchrun => "torchrun-style",
            Launcher::None => "no launcher",
        }
    }

    /// Parses a value of `NCCL_RS_LAUNCHER`.
    pub(crate) fn from_setting(value: &str) -> Option<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "openmpi" | "ompi" | "open-mpi" => Some(Launcher::OpenMpi),
            "mpich" | "pmi" | "hydra" | "intelmpi" => Some(Launcher::MpichOrPmi),
            "pmix" => Some(Launcher::Pmix),
            "slurm" | "srun" => Some(Launcher::Slurm),
            "torchrun" | "torch" | "env" => Some(Launcher::Torchrun),
            "none" | "single" => Some(Launcher::None),
            _ => None,
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where this process is placed in the job: its rank, the number of ranks, and its rank among
/// the ranks on this node, as the launcher said.
///
/// Build it with [`Placement::from_env`]; see the [module documentation](super) for the
/// variables read and the rules applied when several launchers' variables are present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of ranks in the job.
    pub world_size: usize,
    /// This process's rank among the ranks on its node; selects its GPU when the node's GPUs
    /// are shared out among its ranks (see [`Placement::device_ordinal`]).
    pub local_rank: usize,
    /// The number of ranks on this node, when the launcher says.
    pub local_world_size: Option<usize>,
    /// The launcher whose variables were used.
    pub launcher: Launcher,
}

impl Placement {
    /// Rank 0 of a single-process job, as when no launcher variables are set.
    pub fn single_process() -> Self {
        Placement {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: Some(1),
            launcher: Launcher::None,
        }
    }

    /// Detects the placement from this process's environment. See
    /// [`Placement::from_vars`].
    pub fn from_env() -> Result<Self> {
        Self::from_vars(process_var)
    }

    /// Detects the placement from the variables `vars` returns (`None` for unset).
    ///
    /// Empty values count as unset. Errors name the variables involved: a value that is not a
    /// number, a rank not below the world size, a world size of 0, a launcher whose rank is set
    /// without its size (or the other way round), or two launchers disagreeing about this
    /// process (see the [module documentation](super#several-launchers-at-once)).
    pub fn from_vars(vars: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let vars: Vars<'_> = &vars;
        let only = only_launcher(vars)?;
        if only == Some(Launcher::None) {
            return Ok(Self::single_process());
        }
        let mut readings = read_all(vars, only)?;
        fill_pmix_size(vars, &mut readings)?;
        match readings.split_first() {
            Some((primary, others)) => Self::from_readings(primary, others),
            None => match only {
                Some(launcher) => Err(BootstrapError::Env {
                    var: vars::LAUNCHER.to_owned(),
                    value: launcher.name().to_owned(),
                    reason: format!("none of {launcher}'s rank variables are set"),
                }),
                None => Ok(Self::single_process()),
            },
        }
    }

    /// Believes `primary` (the innermost launcher), checked against and completed by the
    /// `others`.
    fn from_readings(primary: &Reading, others: &[Reading]) -> Result<Self> {
        let Some(size) = primary.size else {
            return Err(incomplete(
                Launcher::Pmix,
                PMIX_RANK,
                "a world size (PMI_SIZE, OMPI_COMM_WORLD_SIZE or SLURM_STEP_NUM_TASKS)",
            ));
        };
        let world_size = size.value;
        let (local_rank, local_size) = merge_locals(primary, others, world_size)?;
        let local_rank = match local_rank {
            Some(var) => var.value,
            None if world_size == 1 => 0,
            None => return Err(primary.missing_local_rank()),
        };
        let local_world_size = local_size
            .map(|v| v.value)
            .or((world_size == 1).then_some(1));
        if let Some(local_world_size) = local_world_size.filter(|&n| local_rank >= n) {
            return Err(BootstrapError::Conflict {
                first: primary.describe(),
                second: format!("the launch data say this node has only {local_world_size} ranks"),
            });
        }
        Ok(Placement {
            rank: primary.rank.value,
            world_size,
            local_rank,
            local_world_size,
            launcher: primary.launcher,
        })
    }

    /// Whether every rank runs on this node: the job has one rank, or the launcher reported as
    /// many ranks on this node as in the job.
    pub fn is_single_node(&self) -> bool {
        self.world_size == 1 || self.local_world_size == Some(self.world_size)
    }

    /// The CUDA device ordinal this rank should use, given what this process sees.
    ///
    /// `visible_gpus` is the device count CUDA reports (e.g. `CudaContext::device_count()`).
    /// CUDA applies `CUDA_VISIBLE_DEVICES` before numbering devices, so the ordinal counts
    /// visible devices only: with `CUDA_VISIBLE_DEVICES=2,3`, ordinal 0 is physical GPU 2.
    ///
    /// * Exactly one GPU visible: ordinal 0, whatever the local rank. This is the shape of
    ///   `srun --gpus-per-task=1`, a one-GPU container, or a wrapper that sets
    ///   `CUDA_VISIBLE_DEVICES` per rank.
    /// * At least as many GPUs visible as ranks on this node ([`Placement::local_world_size`], or
    ///   when the launcher does not say, more GPUs than the local rank): the local rank, so
    ///   that the ranks of a node share its GPUs out one each.
    /// * Otherwise (no GPU, or several GPUs but fewer than the ranks on this node) a
    ///   [`BootstrapError::NoDevice`] naming both counts and the fix. Every rank of such a
    ///   node fails alike, rather than some ranks running and the others not.
    ///
    /// Two ranks given the same GPU (say, two ranks in a one-GPU container each) are refused
    /// by NCCL itself when they join ("duplicate GPU"), unless they share it on purpose: see
    /// [`Placement::device_ordinal_sharing`].
    pub fn device_ordinal(&self, visible_gpus: usize) -> Result<usize> {
        self.device_ordinal_sharing(visible_gpus, GpuSharing::Off)
    }

    /// Like [`Placement::device_ordinal`], but where the node has more ranks than visible
    /// GPUs and `sharing` is not [`GpuSharing::Off`], the ranks share the GPUs out in turn
    /// (local rank modulo the GPU count) instead of failing.
    pub fn device_ordinal_sharing(
        &self,
        visible_gpus: usize,
        sharing: GpuSharing,
    ) -> Result<usize> {
        let fits = match (visible_gpus, self.local_world_size) {
            (0, _) => false,
            (1, _) => return Ok(0),
            (visible, Some(local_ranks)) => local_ranks <= visible && self.local_rank < visible,
            (visible, None) => self.local_rank < visible,
        };
        if fits {
            Ok(self.local_rank)
        } else if visible_gpus > 0 && sharing != GpuSharing::Off {
            Ok(self.local_rank % visible_gpus)
        } else {
            Err(BootstrapError::NoDevice {
                local_rank: self.local_rank,
                local_ranks: self.local_world_size,
                visible: visible_gpus,
            })
        }
    }

    /// Whether the ranks of this node outnumber `visible_gpus`, so that some must share one.
    pub(crate) fn outnumbers(&self, visible_gpus: usize) -> bool {
        self.local_world_size.unwrap_or(self.local_rank + 1) > visible_gpus
    }
}

/// Checks the outer launchers that count the same processes against `primary` (same rank,
/// same local rank) and takes the local rank and size from them where `primary` lacks one.
fn merge_locals(
    primary: &Reading,
    others: &[Reading],
    world_size: usize,
) -> Result<(Option<Var>, Option<Var>)> {
    let mut local_rank = primary.local_rank;
    let mut local_size = primary.local_size;
    for other in others.iter().filter(|o| o.describes_ranks(world_size)) {
        let local_conflict = matches!(
            (local_rank, other.local_rank),
            (Some(a), Some(b)) if a.value != b.value
        );
        if other.size.map(|v| v.value) != Some(world_size)
            || other.rank.value != primary.rank.value
            || local_conflict
        {
            return Err(BootstrapError::Conflict {
                first: primary.describe(),
                second: other.describe(),
            });
        }
        local_rank = local_rank.or(other.local_rank);
        local_size = local_size.or(other.local_size);
    }
    Ok((local_rank, local_size))
}

/// The launcher `NCCL_RS_LAUNCHER` names, if set.
fn only_launcher(vars: Vars<'_>) -> Result<Option<Launcher>> {
    let Some(text) = lookup(vars, vars::LAUNCHER) else {
        return Ok(None);
    };
    match Launcher::from_setting(&text) {
        Some(launcher) => Ok(Some(launcher)),
        None => Err(BootstrapError::Env {
            var: vars::LAUNCHER.to_owned(),
            value: text,
            reason: "expected one of openmpi, mpich, pmix, slurm, torchrun, none".to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launcher_setting_names() {
        assert_eq!(Launcher::from_setting("OpenMPI"), Some(Launcher::OpenMpi));
        assert_eq!(Launcher::from_setting(" slurm "), Some(Launcher::Slurm));
        assert_eq!(Launcher::from_setting("nope"), None);
    }
}
