//! Reading each launcher's variables: the variable names, one reading per launcher found,
//! and the checks that one launcher's numbers agree with each other.

use std::fmt;

use super::Launcher;
use crate::bootstrap::env::{lookup, Vars};
use crate::bootstrap::{BootstrapError, Result};

/// One variable that was read, kept with its name for error messages.
#[derive(Debug, Clone, Copy)]
pub(super) struct Var {
    pub(super) name: &'static str,
    pub(super) value: usize,
}

impl fmt::Display for Var {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.name, self.value)
    }
}

/// What one launcher's variables say.
#[derive(Debug, Clone)]
pub(super) struct Reading {
    pub(super) launcher: Launcher,
    pub(super) rank: Var,
    /// `None` only for PMIx, which exports no size variable of its own.
    pub(super) size: Option<Var>,
    pub(super) local_rank: Option<Var>,
    pub(super) local_size: Option<Var>,
}

impl Reading {
    /// Whether this (outer) reading counts the same processes as an innermost launcher of
    /// `world_size` ranks. One that counts fewer describes per-node agents (`srun` or
    /// `mpirun` starting torchrun, `srun` starting `mpirun`'s daemons) and is not compared; a
    /// PMIx rank with no size to compare is not either.
    pub(super) fn describes_ranks(&self, world_size: usize) -> bool {
        self.size.is_some_and(|size| size.value >= world_size)
    }

    /// The error for a launch of several ranks without a local rank.
    pub(super) fn missing_local_rank(&self) -> BootstrapError {
        let wanted = match self.launcher {
            Launcher::Torchrun => TORCHRUN.local_rank,
            Launcher::OpenMpi => OPEN_MPI.local_rank,
            Launcher::MpichOrPmi => PMI.local_rank,
            Launcher::Pmix => "OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID",
            Launcher::Slurm | Launcher::None => SLURM_LOCALID,
        };
        incomplete(self.launcher, self.rank.name, wanted)
    }

    pub(super) fn describe(&self) -> String {
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

pub(super) const PMIX_RANK: &str = "PMIX_RANK";
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
        validate_against_size(reading, size)?;
    }
    if let Some(local_size) = reading.local_size {
        validate_against_local_size(reading, local_size)?;
    }
    Ok(())
}

/// The world size is at least 1 and above the rank, the local rank and the local size.
fn validate_against_size(reading: &Reading, size: Var) -> Result<()> {
    if size.value == 0 {
        return Err(env_error(size, "the world size must be at least 1".into()));
    }
    if reading.rank.value >= size.value {
        let reason = format!(
            "the rank must be less than the world size {} ({})",
            size.value, size.name
        );
        return Err(env_error(reading.rank, reason));
    }
    if let Some(local_size) = reading.local_size.filter(|v| v.value > size.value) {
        let reason = format!("more ranks on this node than in the job ({size})");
        return Err(env_error(local_size, reason));
    }
    if let Some(local_rank) = reading.local_rank.filter(|v| v.value >= size.value) {
        let reason = format!("the local rank must be less than the world size ({size})");
        return Err(env_error(local_rank, reason));
    }
    Ok(())
}

/// The local size is at least 1 and above the local rank.
fn validate_against_local_size(reading: &Reading, local_size: Var) -> Result<()> {
    if local_size.value == 0 {
        let reason = "the number of ranks on this node must be at least 1".into();
        return Err(env_error(local_size, reason));
    }
    if let Some(local_rank) = reading.local_rank.filter(|v| v.value >= local_size.value) {
        let reason =
            format!("the local rank must be less than the ranks on this node ({local_size})");
        return Err(env_error(local_rank, reason));
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
    validate(&reading).map(|()| Some(reading))
}

pub(super) fn incomplete(launcher: Launcher, present: &str, missing: &str) -> BootstrapError {
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
                counts.extend(std::iter::repeat_n(count, repeat));
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
    let reading = Reading {
        launcher: Launcher::Slurm,
        rank,
        size: Some(size),
        local_rank: number(vars, SLURM_LOCALID)?,
        local_size: slurm_local_size(vars)?,
    };
    validate(&reading).map(|()| Some(reading))
}

/// The ranks of the step on this node. The step's own per-node layout is authoritative; it is
/// a hint only, so an unexpected format falls back to `SLURM_NTASKS_PER_NODE` instead of
/// failing the launch.
fn slurm_local_size(vars: Vars<'_>) -> Result<Option<Var>> {
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
    match step_local_size {
        Some(size) => Ok(Some(size)),
        None => number(vars, SLURM_NTASKS_PER_NODE),
    }
}

/// Reads every launcher's variables, innermost launcher first: torchrun-style variables are
/// set by a per-node agent started by an MPI launcher or `srun`, and MPI launchers may run
/// inside a Slurm step, so the earlier entries win when the later ones describe the agents.
pub(super) fn read_all(vars: Vars<'_>, only: Option<Launcher>) -> Result<Vec<Reading>> {
    let wanted = |launcher: Launcher| only.is_none_or(|only| only == launcher);
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
pub(super) fn fill_pmix_size(vars: Vars<'_>, readings: &mut [Reading]) -> Result<()> {
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
}
