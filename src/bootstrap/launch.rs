//! Finding out which rank this process is, from the variables its launcher exported.

use std::fmt;

use super::util::{lookup, process_var};
use super::{BootstrapError, Result};

/// Overrides launcher detection: only the named launcher's variables are read.
pub(crate) const LAUNCHER_VAR: &str = "NCCL_RS_LAUNCHER";

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
    fn from_setting(value: &str) -> Option<Self> {
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

/// Where this process sits in the job: its rank, the number of ranks, and its rank among the
/// ranks on this node.
///
/// Build it with [`Launch::from_env`]; see the [module documentation](super) for the variables
/// read and the rules applied when several launchers' variables are present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of ranks in the job.
    pub world_size: usize,
    /// This process's rank among the ranks on its node; selects its GPU when the node's GPUs
    /// are shared out among its ranks (see [`Launch::device_ordinal`]).
    pub local_rank: usize,
    /// The number of ranks on this node, when the launcher says.
    pub local_world_size: Option<usize>,
    /// The launcher whose variables were used.
    pub launcher: Launcher,
}

/// One variable that was read, kept with its name for error messages.
#[derive(Debug, Clone, Copy)]
struct Var {
    name: &'static str,
    value: usize,
}

impl fmt::Display for Var {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.name, self.value)
    }
}

/// What one launcher's variables say.
#[derive(Debug, Clone)]
struct Reading {
    launcher: Launcher,
    rank: Var,
    /// `None` only for PMIx, which exports no size variable of its own.
    size: Option<Var>,
    local_rank: Option<Var>,
    local_size: Option<Var>,
}

impl Reading {
    fn describe(&self) -> String {
        let mut vars = vec![self.rank.to_string()];
        vars.extend(self.size.map(|v| v.to_string()));
        vars.extend(self.local_rank.map(|v| v.to_string()));
        match self.size {
            Some(size) => format!(
                "{} says rank {} of {} ({})",
                self.launcher,
                self.rank.value,
                size.value,
                vars.join(", ")
            ),
            None => format!(
                "{} says rank {} ({})",
                self.launcher,
                self.rank.value,
                vars.join(", ")
            ),
        }
    }
}

/// The variables that name a launcher's rank, size, local rank and local size.
struct Names {
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
}

const TORCHRUN: Names = Names {
    launcher: Launcher::Torchrun,
    rank: "RANK",
    size: "WORLD_SIZE",
    local_rank: "LOCAL_RANK",
    local_size: "LOCAL_WORLD_SIZE",
};

const OPEN_MPI: Names = Names {
    launcher: Launcher::OpenMpi,
    rank: "OMPI_COMM_WORLD_RANK",
    size: "OMPI_COMM_WORLD_SIZE",
    local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
};

const PMI: Names = Names {
    launcher: Launcher::MpichOrPmi,
    rank: "PMI_RANK",
    size: "PMI_SIZE",
    local_rank: "MPI_LOCALRANKID",
    local_size: "MPI_LOCALNRANKS",
};

const PMIX_RANK: &str = "PMIX_RANK";
const SLURM_PROCID: &str = "SLURM_PROCID";
const SLURM_STEP_NUM_TASKS: &str = "SLURM_STEP_NUM_TASKS";
const SLURM_NTASKS: &str = "SLURM_NTASKS";
const SLURM_LOCALID: &str = "SLURM_LOCALID";
const SLURM_NTASKS_PER_NODE: &str = "SLURM_NTASKS_PER_NODE";
const SLURM_STEP_TASKS_PER_NODE: &str = "SLURM_STEP_TASKS_PER_NODE";
const SLURM_NODEID: &str = "SLURM_NODEID";
/// Any of these marks a process started by `srun` (a job step), as opposed to a batch script
/// or an `salloc` shell, which carry `SLURM_PROCID=0` and the job's `SLURM_NTASKS` without
/// being one of those tasks.
const SLURM_STEP_MARKERS: [&str; 3] = ["SLURM_STEP_ID", "SLURM_STEPID", SLURM_STEP_NUM_TASKS];

type Vars<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Reads variable `name` as a non-negative integer.
fn number(vars: Vars<'_>, name: &'static str) -> Result<Option<Var>> {
    let Some(text) = lookup(vars, name) else {
        return Ok(None);
    };
    text.trim()
        .parse::<usize>()
        .map(|value| Some(Var { name, value }))
        .map_err(|_| BootstrapError::Env {
            var: name.to_owned(),
            value: text.clone(),
            reason: "expected a non-negative integer".to_owned(),
        })
}

fn env_error(var: Var, reason: String) -> BootstrapError {
    BootstrapError::Env {
        var: var.name.to_owned(),
        value: var.value.to_string(),
        reason,
    }
}

/// Checks that one launcher's numbers are consistent with each other.
fn validate(reading: &Reading) -> Result<()> {
    if let Some(size) = reading.size {
        if size.value == 0 {
            return Err(env_error(size, "the world size must be at least 1".into()));
        }
        if reading.rank.value >= size.value {
            return Err(env_error(
                reading.rank,
                format!(
                    "the rank must be less than the world size {} ({})",
                    size.value, size.name
                ),
            ));
        }
        if let Some(local_size) = reading.local_size {
            if local_size.value > size.value {
                return Err(env_error(
                    local_size,
                    format!("more ranks on this node than in the job ({})", size),
                ));
            }
        }
        if let Some(local_rank) = reading.local_rank {
            if local_rank.value >= size.value {
                return Err(env_error(
                    local_rank,
                    format!("the local rank must be less than the world size ({size})"),
                ));
            }
        }
    }
    if let Some(local_size) = reading.local_size {
        if local_size.value == 0 {
            return Err(env_error(
                local_size,
                "the number of ranks on this node must be at least 1".into(),
            ));
        }
        if let Some(local_rank) = reading.local_rank {
            if local_rank.value >= local_size.value {
                return Err(env_error(
                    local_rank,
                    format!(
                        "the local rank must be less than the ranks on this node ({local_size})"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Reads a launcher that exports rank and size under fixed names.
fn read_standard(vars: Vars<'_>, names: &Names) -> Result<Option<Reading>> {
    let rank = number(vars, names.rank)?;
    let size = number(vars, names.size)?;
    let local_rank = number(vars, names.local_rank)?;
    let local_size = number(vars, names.local_size)?;
    let (rank, size) = match (rank, size) {
        // Local variables alone do not make a launch (some tools export LOCAL_RANK only).
        (None, None) => return Ok(None),
        (Some(rank), Some(size)) => (rank, size),
        (Some(rank), None) => return Err(incomplete(names.launcher, rank.name, names.size)),
        (None, Some(size)) => return Err(incomplete(names.launcher, size.name, names.rank)),
    };
    let reading = Reading {
        launcher: names.launcher,
        rank,
        size: Some(size),
        local_rank,
        local_size,
    };
    validate(&reading)?;
    Ok(Some(reading))
}

fn incomplete(launcher: Launcher, present: &str, missing: &str) -> BootstrapError {
    BootstrapError::Incomplete {
        launcher,
        present: present.to_owned(),
        missing: missing.to_owned(),
    }
}

/// Reads `PMIX_RANK`; the size is filled in later from another launcher.
fn read_pmix(vars: Vars<'_>) -> Result<Option<Reading>> {
    Ok(number(vars, PMIX_RANK)?.map(|rank| Reading {
        launcher: Launcher::Pmix,
        rank,
        size: None,
        local_rank: None,
        local_size: None,
    }))
}

/// Parses Slurm's compressed tasks-per-node list (`"4(x2),3"` means 4, 4, 3).
fn parse_tasks_per_node(text: &str) -> Option<Vec<usize>> {
    let mut counts = Vec::new();
    for part in text.trim().split(',') {
        let part = part.trim();
        match part.split_once("(x") {
            Some((count, repeat)) => {
                let count: usize = count.trim().parse().ok()?;
                let repeat: usize = repeat.strip_suffix(')')?.trim().parse().ok()?;
                // Bound the expansion: a node list longer than this is not a real allocation.
                if counts.len().saturating_add(repeat) > 1 << 20 {
                    return None;
                }
                counts.extend(std::iter::repeat(count).take(repeat));
            }
            None => counts.push(part.parse().ok()?),
        }
    }
    Some(counts)
}

/// Reads a Slurm job step. Outside a step (batch script, `salloc` shell) the Slurm variables
/// describe the allocation, not this process, and are ignored unless `forced`.
fn read_slurm(vars: Vars<'_>, forced: bool) -> Result<Option<Reading>> {
    let in_step = SLURM_STEP_MARKERS
        .iter()
        .any(|name| lookup(vars, name).is_some());
    if !in_step && !forced {
        return Ok(None);
    }
    let Some(rank) = number(vars, SLURM_PROCID)? else {
        return Ok(None);
    };
    let size = match number(vars, SLURM_STEP_NUM_TASKS)? {
        Some(size) => size,
        None => number(vars, SLURM_NTASKS)?.ok_or_else(|| {
            incomplete(
                Launcher::Slurm,
                SLURM_PROCID,
                "SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)",
            )
        })?,
    };
    let local_rank = number(vars, SLURM_LOCALID)?;
    // The step's own per-node layout is authoritative; it is a hint only, so an unexpected
    // format falls back to SLURM_NTASKS_PER_NODE instead of failing the launch.
    let step_local_size = lookup(vars, SLURM_STEP_TASKS_PER_NODE).and_then(|text| {
        let counts = parse_tasks_per_node(&text)?;
        let node = match number(vars, SLURM_NODEID).ok().flatten() {
            Some(node) => node.value,
            None if counts.len() == 1 => 0,
            None => return None,
        };
        counts.get(node).map(|&value| Var {
            name: SLURM_STEP_TASKS_PER_NODE,
            value,
        })
    });
    let local_size = match step_local_size {
        Some(size) => Some(size),
        None => number(vars, SLURM_NTASKS_PER_NODE)?,
    };
    let reading = Reading {
        launcher: Launcher::Slurm,
        rank,
        size: Some(size),
        local_rank,
        local_size,
    };
    validate(&reading)?;
    Ok(Some(reading))
}

/// Reads every launcher's variables, innermost launcher first: torchrun-style variables are
/// set by a per-node agent started by an MPI launcher or `srun`, and MPI launchers may run
/// inside a Slurm step, so the earlier entries win when the later ones describe the agents.
fn read_all(vars: Vars<'_>, only: Option<Launcher>) -> Result<Vec<Reading>> {
    let wanted = |launcher: Launcher| only.map_or(true, |only| only == launcher);
    let mut readings = Vec::new();
    if wanted(Launcher::Torchrun) {
        readings.extend(read_standard(vars, &TORCHRUN)?);
    }
    if wanted(Launcher::OpenMpi) {
        readings.extend(read_standard(vars, &OPEN_MPI)?);
    }
    // PMIx shims may export PMI_SIZE next to PMIX_RANK without PMI_RANK: that size belongs
    // to the PMIx reading, not to an incomplete PMI one.
    let pmi_size_serves_pmix = lookup(vars, PMI.rank).is_none()
        && lookup(vars, PMIX_RANK).is_some()
        && wanted(Launcher::Pmix);
    if wanted(Launcher::MpichOrPmi) && !pmi_size_serves_pmix {
        readings.extend(read_standard(vars, &PMI)?);
    }
    if wanted(Launcher::Pmix) {
        readings.extend(read_pmix(vars)?);
    }
    if wanted(Launcher::Slurm) {
        readings.extend(read_slurm(vars, only == Some(Launcher::Slurm))?);
    }
    Ok(readings)
}

/// PMIx exports no world size: borrow it (and the local rank) from the MPI or Slurm variables
/// that describe the same rank, or take `PMI_SIZE` when that is all there is.
fn fill_pmix_size(vars: Vars<'_>, readings: &mut [Reading]) -> Result<()> {
    let Some(index) = readings.iter().position(|r| r.launcher == Launcher::Pmix) else {
        return Ok(());
    };
    let pmix_rank = readings[index].rank.value;
    let donor = readings
        .iter()
        .find(|r| r.launcher != Launcher::Pmix && r.size.is_some() && r.rank.value == pmix_rank)
        .cloned();
    let pmix = &mut readings[index];
    match donor {
        Some(donor) => {
            pmix.size = donor.size;
            pmix.local_rank = donor.local_rank;
            pmix.local_size = donor.local_size;
        }
        // A PMIx shim exporting PMI_SIZE may export Hydra's local variables as well.
        None => {
            pmix.size = number(vars, PMI.size)?;
            pmix.local_rank = number(vars, PMI.local_rank)?;
            pmix.local_size = number(vars, PMI.local_size)?;
        }
    }
    validate(pmix)
}

impl Launch {
    /// Rank 0 of a single-process job, as when no launcher variables are set.
    pub fn single_process() -> Self {
        Launch {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: Some(1),
            launcher: Launcher::None,
        }
    }

    /// Detects the launch from this process's environment. See [`Launch::from_vars`].
    pub fn from_env() -> Result<Self> {
        Self::from_vars(process_var)
    }

    /// Detects the launch from the variables `vars` returns (`None` for unset).
    ///
    /// Empty values count as unset. Errors name the variables involved: a value that is not a
    /// number, a rank not below the world size, a world size of 0, a launcher whose rank is set
    /// without its size (or the other way round), or two launchers disagreeing about this
    /// process (see the [module documentation](super#several-launchers-at-once)).
    pub fn from_vars(vars: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let vars: Vars<'_> = &vars;
        let only = match lookup(vars, LAUNCHER_VAR) {
            None => None,
            Some(text) => {
                Some(
                    Launcher::from_setting(&text).ok_or_else(|| BootstrapError::Env {
                        var: LAUNCHER_VAR.to_owned(),
                        value: text.clone(),
                        reason: "expected one of openmpi, mpich, pmix, slurm, torchrun, none"
                            .to_owned(),
                    })?,
                )
            }
        };
        if only == Some(Launcher::None) {
            return Ok(Self::single_process());
        }
        let mut readings = read_all(vars, only)?;
        fill_pmix_size(vars, &mut readings)?;
        let Some(primary) = readings.first().cloned() else {
            return match only {
                Some(launcher) => Err(BootstrapError::Env {
                    var: LAUNCHER_VAR.to_owned(),
                    value: launcher.name().to_owned(),
                    reason: format!("none of {launcher}'s rank variables are set"),
                }),
                None => Ok(Self::single_process()),
            };
        };
        let Some(size) = primary.size else {
            return Err(incomplete(
                Launcher::Pmix,
                PMIX_RANK,
                "a world size (PMI_SIZE, OMPI_COMM_WORLD_SIZE or SLURM_STEP_NUM_TASKS)",
            ));
        };
        let mut local_rank = primary.local_rank;
        let mut local_size = primary.local_size;
        for other in &readings[1..] {
            let Some(other_size) = other.size else {
                // A PMIx rank with no size to compare: only a rank that matches is useful.
                continue;
            };
            if other_size.value < size.value {
                // An outer launcher that started per-node agents (srun or mpirun running
                // torchrun, mpirun's daemons started by srun): it counts agents, not ranks.
                continue;
            }
            let local_conflict = matches!(
                (local_rank, other.local_rank),
                (Some(a), Some(b)) if a.value != b.value
            );
            if other_size.value > size.value
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
        let local_rank = match local_rank {
            Some(var) => var.value,
            None if size.value == 1 => 0,
            None => {
                let wanted = match primary.launcher {
                    Launcher::Torchrun => TORCHRUN.local_rank,
                    Launcher::OpenMpi => OPEN_MPI.local_rank,
                    Launcher::MpichOrPmi => PMI.local_rank,
                    Launcher::Pmix => "OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID",
                    Launcher::Slurm | Launcher::None => SLURM_LOCALID,
                };
                return Err(incomplete(primary.launcher, primary.rank.name, wanted));
            }
        };
        let local_world_size = local_size
            .map(|v| v.value)
            .or((size.value == 1).then_some(1));
        if let Some(local_world_size) = local_world_size {
            if local_rank >= local_world_size {
                return Err(BootstrapError::Conflict {
                    first: primary.describe(),
                    second: format!(
                        "the launch data say this node has only {local_world_size} ranks"
                    ),
                });
            }
        }
        Ok(Launch {
            rank: primary.rank.value,
            world_size: size.value,
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
    /// * At least as many GPUs visible as ranks on this node ([`Launch::local_world_size`], or
    ///   when the launcher does not say, more GPUs than the local rank): the local rank, so
    ///   that the ranks of a node share its GPUs out one each.
    /// * Otherwise (no GPU, or several GPUs but fewer than the ranks on this node) a
    ///   [`BootstrapError::NoDevice`] naming both counts and the fix. Every rank of such a
    ///   node fails alike, rather than some ranks running and the others not.
    ///
    /// Two ranks given the same GPU (say, two ranks in a one-GPU container each) are refused
    /// by NCCL itself when they join ("duplicate GPU").
    pub fn device_ordinal(&self, visible_gpus: usize) -> Result<usize> {
        let fits = match (visible_gpus, self.local_world_size) {
            (0, _) => false,
            (1, _) => return Ok(0),
            (visible, Some(local_ranks)) => local_ranks <= visible && self.local_rank < visible,
            (visible, None) => self.local_rank < visible,
        };
        if fits {
            Ok(self.local_rank)
        } else {
            Err(BootstrapError::NoDevice {
                local_rank: self.local_rank,
                local_ranks: self.local_world_size,
                visible: visible_gpus,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_per_node_lists() {
        assert_eq!(parse_tasks_per_node("4"), Some(vec![4]));
        assert_eq!(parse_tasks_per_node("2(x3)"), Some(vec![2, 2, 2]));
        assert_eq!(parse_tasks_per_node("4(x2),3"), Some(vec![4, 4, 3]));
        assert_eq!(parse_tasks_per_node("4(x"), None);
        assert_eq!(parse_tasks_per_node("x"), None);
        assert_eq!(parse_tasks_per_node("1(x99999999999)"), None);
    }

    #[test]
    fn launcher_setting_names() {
        assert_eq!(Launcher::from_setting("OpenMPI"), Some(Launcher::OpenMpi));
        assert_eq!(Launcher::from_setting(" slurm "), Some(Launcher::Slurm));
        assert_eq!(Launcher::from_setting("nope"), None);
    }
}
