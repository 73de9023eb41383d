//! The tensor-parallel epilogue of a row-parallel layer: the all-reduce of its partial
//! output, the residual add and RMSNorm. Here: the shape rules every path checks first, and
//! the unfused sequence (the default of
//! [`Collectives::all_reduce_add_rms_norm`](super::Collectives::all_reduce_add_rms_norm)).

use candle_core::Tensor;
use nccl::ReduceOp;

use super::Collectives;
use crate::{Error, Result};

/// Refuses tensors the epilogue cannot take, before any collective: `partial` and
/// `residual` of one shape (at least one dimension, the last `hidden`), `weight` of
/// `[hidden]`, all three of one element type. Depends only on shapes and types, so ranks
/// that make the same call refuse alike.
pub(crate) fn check(
    op: &'static str,
    partial: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
) -> Result<()> {
    let Some(&hidden) = partial.dims().last() else {
        return Err(Error::Shape {
            op,
            why: "the partial output is a scalar; it needs a last dimension to normalise".into(),
        });
    };
    if partial.dims() != residual.dims() {
        return Err(Error::Shape {
            op,
            why: format!(
                "the partial output {:?} and the residual {:?} differ in shape",
                partial.dims(),
                residual.dims()
            ),
        });
    }
    if weight.dims() != [hidden] {
        return Err(Error::Shape {
            op,
            why: format!(
                "the norm's weight is {:?}, not [{hidden}] (the last dimension of {:?})",
                weight.dims(),
                partial.dims()
            ),
        });
    }
    let dtypes = [partial.dtype(), residual.dtype(), weight.dtype()];
    if dtypes.iter().any(|&d| d != dtypes[0]) {
        return Err(Error::Argument {
            op,
            why: format!(
                "the partial output, residual and weight are {:?}: they need one element type",
                dtypes
            ),
        });
    }
    Ok(())
}

/// The epilogue's local part on the sums: `(sum + residual, rms_norm(that) · weight)`.
pub(crate) fn add_rms_norm(
    sum: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    // candle's add makes a new contiguous tensor, which its rms_norm requires.
    let residual = (sum + residual)?;
    let normed = candle_nn::ops::rms_norm(&residual, &weight.contiguous()?, eps)?;
    Ok((residual, normed))
}

/// The unfused epilogue over `ranks`: the all-reduce (sum) of `partial`, then
/// [`add_rms_norm`]. Checked by the caller ([`check`]).
pub(crate) fn unfused<C: Collectives + ?Sized>(
    ranks: &C,
    partial: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    let sum = ranks.all_reduce(&partial.contiguous()?, ReduceOp::Sum)?;
    add_rms_norm(&sum, residual, weight, eps)
}
