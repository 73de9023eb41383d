//! Variables in the order every rank agrees on, their checks, and the parameter broadcast.

use std::hash::Hash;
use std::sync::PoisonError;

use candle_core::{DType, DeviceLocation, Var};
use candle_nn::VarMap;
use nccl::Comm;

use crate::agree::{agree, fingerprint};
use crate::{broadcast_in_place, Error, Result};

/// The variables of `vars` with their names, sorted by name: the order in which every rank
/// visits them (a `VarMap` is a hash map, whose order differs between processes).
pub fn sorted_vars(vars: &VarMap) -> Vec<(String, Var)> {
    // A poisoned lock only says another thread panicked while holding it; the map of
    // reference-counted variables is still whole, and is only read here.
    let map = vars.data().lock().unwrap_or_else(PoisonError::into_inner);
    let mut list: Vec<(String, Var)> = map
        .iter()
        .map(|(name, var)| (name.clone(), var.clone()))
        .collect();
    drop(map);
    list.sort_by(|a, b| a.0.cmp(&b.0));
    list
}

/// `vars` sorted by name (a stable sort: a name given twice keeps its order, and is refused
/// by [`check_names`]).
pub(crate) fn sort_by_name(vars: &[(String, Var)]) -> Vec<(String, Var)> {
    let mut list = vars.to_vec();
    list.sort_by(|a, b| a.0.cmp(&b.0));
    list
}

/// What ranks must agree on about a list of variables: names, dimensions, element types.
pub(crate) fn layout(vars: &[(String, Var)]) -> Vec<(&str, &[usize], &'static str)> {
    vars.iter()
        .map(|(name, var)| (name.as_str(), var.dims(), var.dtype().as_str()))
        .collect()
}

/// The fingerprint of a call on `vars` with its other agreed arguments.
pub(crate) fn fingerprint_of(op: &str, args: &impl Hash, vars: &[(String, Var)]) -> u64 {
    fingerprint(&(op, args, layout(vars)))
}

/// Whether NCCL has an element type for `dtype` (those both candle and NCCL have).
pub(crate) fn nccl_has(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::U8
            | DType::U32
            | DType::I32
            | DType::I64
            | DType::F16
            | DType::BF16
            | DType::F32
            | DType::F64
            | DType::F8E4M3
    )
}

/// Refuses a name given twice in a list sorted by name.
pub(crate) fn check_names(op: &'static str, sorted: &[(String, Var)]) -> Result<()> {
    match sorted.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        Some(pair) => Err(Error::Variable {
            op,
            name: pair[0].0.clone(),
            why: "the name is given twice".into(),
        }),
        None => Ok(()),
    }
}

/// Refuses a variable that cannot take part in a collective on `comm`: not on the
/// communicator's GPU, not contiguous, or of an element type NCCL lacks.
pub(crate) fn check_var(op: &'static str, comm: &Comm, name: &str, var: &Var) -> Result<()> {
    let refuse = |why: String| {
        Err(Error::Variable {
            op,
            name: name.to_owned(),
            why,
        })
    };
    match var.device().location() {
        DeviceLocation::Cuda { gpu_id } if gpu_id == comm.device() => {}
        other => {
            return refuse(format!(
                "it is on {other:?}, not on the communicator's GPU {}",
                comm.device()
            ))
        }
    }
    if !var.is_contiguous() {
        return refuse("it is not contiguous".into());
    }
    if !nccl_has(var.dtype()) {
        return refuse(format!("NCCL has no element type for {:?}", var.dtype()));
    }
    Ok(())
}

/// Gives every rank the root's values of the variables of `vars` (visited in name order).
///
/// The ranks first agree on the variables' names, shapes and element types and on `root`
/// (one all-gather of fingerprints): when they differ, or when a rank cannot take part (a
/// variable on the CPU or on another GPU, a root past the ranks), every rank returns an
/// error ([`Error::Mismatch`], or the rank's own error there and [`Error::PeerRefused`] on
/// the others) and no variable is touched. Then each variable is broadcast in place.
pub fn broadcast_vars(comm: &Comm, vars: &VarMap, root: usize) -> Result<()> {
    broadcast_sorted(comm, &sorted_vars(vars), root)
}

/// [`broadcast_vars`] for a list of named variables (sorted by name here; names must be
/// unique).
pub fn broadcast_var_list(comm: &Comm, vars: &[(String, Var)], root: usize) -> Result<()> {
    broadcast_sorted(comm, &sort_by_name(vars), root)
}

fn broadcast_sorted(comm: &Comm, sorted: &[(String, Var)], root: usize) -> Result<()> {
    const OP: &str = "broadcast_vars";
    let local = (|| {
        if root >= comm.size() {
            return Err(Error::Argument {
                op: OP,
                why: format!("root {root} is not one of the {} ranks", comm.size()),
            });
        }
        check_names(OP, sorted)?;
        sorted
            .iter()
            .try_for_each(|(name, var)| check_var(OP, comm, name, var))
    })();
    agree(
        comm,
        OP,
        "the variables (names, shapes, element types) or the root",
        fingerprint_of(OP, &root, sorted),
        local,
    )?;
    // One broadcast per variable, straight into its memory, rather than through buckets:
    // this runs once, and buckets would cost a second copy of the parameters and two copies
    // of every value, against a few microseconds of launch per variable (milliseconds for
    // hundreds of variables, once).
    sorted
        .iter()
        .try_for_each(|(_, var)| broadcast_in_place(comm, var.as_tensor(), root))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn var(dims: &[usize], dtype: DType) -> Var {
        Var::zeros(dims, dtype, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_var_map_comes_out_in_name_order() {
        let map = VarMap::new();
        for name in ["b.weight", "a.bias", "c", "a.weight"] {
            map.get(
                2,
                name,
                candle_nn::Init::Const(0.0),
                DType::F32,
                &Device::Cpu,
            )
            .unwrap();
        }
        let names: Vec<String> = sorted_vars(&map).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a.bias", "a.weight", "b.weight", "c"]);
    }

    #[test]
    fn names_given_twice_are_refused() {
        let list = sort_by_name(&[
            ("w".into(), var(&[2], DType::F32)),
            ("v".into(), var(&[2], DType::F32)),
            ("w".into(), var(&[3], DType::F32)),
        ]);
        match check_names("op", &list) {
            Err(Error::Variable { name, .. }) => assert_eq!(name, "w"),
            other => panic!("{other:?}"),
        }
        assert!(check_names("op", &list[..2]).is_ok());
    }

    #[test]
    fn the_fingerprint_covers_names_shapes_types_and_arguments() {
        let one = |name: &str, dims: &[usize], dtype, arg: usize| {
            fingerprint_of("op", &arg, &[(name.into(), var(dims, dtype))])
        };
        let base = one("w", &[2, 3], DType::F32, 0);
        assert_eq!(base, one("w", &[2, 3], DType::F32, 0));
        assert_ne!(base, one("v", &[2, 3], DType::F32, 0));
        assert_ne!(base, one("w", &[3, 2], DType::F32, 0));
        assert_ne!(base, one("w", &[2, 3], DType::BF16, 0));
        assert_ne!(base, one("w", &[2, 3], DType::F32, 1));
    }
}
