//! Which block of a tensor a rank holds, and loading it through candle's
//! `ShardedVarBuilder` with the checks candle leaves out when it shards.

use std::ops::Range;

use candle_core::Tensor;
use candle_nn::var_builder::{Shard, ShardedVarBuilder};

use super::TpGroup;
use crate::{Error, Result};

/// The indices `rank` holds of a dimension of length `len` split evenly over `world_size`
/// ranks: `rank * len / world_size ..` the next rank's start. `None` when the dimension
/// does not split evenly or `rank` is not below `world_size`.
pub fn shard_range(len: usize, rank: usize, world_size: usize) -> Option<Range<usize>> {
    if world_size == 0 || rank >= world_size || !len.is_multiple_of(world_size) {
        return None;
    }
    let block = len / world_size;
    Some(rank * block..(rank + 1) * block)
}

/// The name candle gives `name` under `vb`'s prefix, for errors.
fn path(vb: &ShardedVarBuilder, name: &str) -> String {
    let prefix = vb.prefix();
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// The error candle's error is about, under the backtrace, path and context it may carry.
fn root(err: &candle_core::Error) -> &candle_core::Error {
    match err {
        candle_core::Error::WithBacktrace { inner, .. }
        | candle_core::Error::WithPath { inner, .. }
        | candle_core::Error::Context { inner, .. } => root(inner),
        other => other,
    }
}

/// Loads this rank's block along `dim` of the tensor `name` of whole shape `shape` (every
/// rank's whole tensor when the group has one rank or `dim` is `None`), in `vb`'s type on its
/// device, checked: a `shape` that does not split is [`Error::NotDivisible`] before anything
/// is read, a tensor in the file that does not split is [`Error::NotDivisible`] with the
/// file's shape, and a block of another shape than `shape`'s is [`Error::ShardShape`] (candle
/// checks the shape only when it does not shard). All depend only on the arguments, the
/// file and the world size, so every rank that passes the same comes to the same verdict.
pub(crate) fn load_block(
    vb: &ShardedVarBuilder,
    group: &TpGroup,
    name: &str,
    shape: &[usize],
    dim: Option<usize>,
) -> Result<Tensor> {
    let world_size = group.size();
    let full_name = path(vb, name);
    let mut expected = shape.to_vec();
    let hints = match dim {
        Some(dim) if world_size > 1 => {
            // candle's ShardedSafeTensors shards the first two dimensions only.
            if dim >= shape.len() || dim > 1 {
                return Err(Error::Argument {
                    op: "tensor-parallel load",
                    why: format!(
                        "{full_name}: cannot shard dimension {dim} of {shape:?} (only 0 or 1)"
                    ),
                });
            }
            if shard_range(shape[dim], group.rank(), world_size).is_none() {
                return Err(Error::NotDivisible {
                    name: full_name,
                    shape: shape.to_vec(),
                    dim,
                    world_size,
                });
            }
            expected[dim] /= world_size;
            Shard {
                dim,
                rank: group.rank(),
                world_size,
            }
        }
        // World size 1: candle loads the whole tensor and checks its shape itself.
        _ => Shard::default(),
    };
    let loaded = vb
        .get_with_hints(shape, name, hints)
        .map_err(|err| match root(&err) {
            candle_core::Error::ShapeMismatchSplit {
                shape,
                dim,
                n_parts,
            } => Error::NotDivisible {
                name: full_name.clone(),
                shape: shape.dims().to_vec(),
                dim: *dim,
                world_size: *n_parts,
            },
            candle_core::Error::UnexpectedShape { got, .. } => Error::ShardShape {
                name: full_name.clone(),
                expected: expected.clone(),
                got: got.dims().to_vec(),
            },
            _ => Error::Candle(err),
        })?;
    if loaded.dims() != expected.as_slice() {
        return Err(Error::ShardShape {
            name: full_name,
            expected,
            got: loaded.dims().to_vec(),
        });
    }
    Ok(loaded)
}

/// Loads the whole tensor `name` of shape `shape` through `vb` on every rank (a norm's
/// weight, a row-parallel layer's bias), checking its shape: [`Error::ShardShape`]
/// otherwise.
pub fn load_replicated(vb: &ShardedVarBuilder, name: &str, shape: &[usize]) -> Result<Tensor> {
    load_block(vb, &TpGroup::single(), name, shape, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_tile_the_dimension_in_rank_order() {
        for world_size in 1..=8 {
            let len = 24 * world_size;
            let mut next = 0;
            for rank in 0..world_size {
                let range = shard_range(len, rank, world_size).unwrap();
                assert_eq!(range.start, next);
                assert_eq!(range.len(), 24);
                next = range.end;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn uneven_splits_and_bad_ranks_have_no_block() {
        assert_eq!(shard_range(10, 0, 4), None);
        assert_eq!(shard_range(12, 4, 4), None);
        assert_eq!(shard_range(12, 0, 0), None);
        assert_eq!(shard_range(0, 1, 2), Some(0..0));
    }
}
