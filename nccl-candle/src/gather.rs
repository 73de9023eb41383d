//! All-gather along any dimension, from NCCL's all-gather, which concatenates along the first.

use candle_core::Tensor;
use nccl::Comm;

use crate::{Error, Result};

/// Every rank's `tensor`, concatenated along dimension `dim` in rank order: a tensor `size`
/// times as long in that dimension, the same on every rank. Every rank must pass the same
/// shape, type and `dim`.
///
/// NCCL concatenates along the first dimension only, so the tensor is gathered with a new
/// leading rank axis (`[size, ..]`, no copy before the collective when `tensor` is
/// contiguous) and that axis is then moved next to `dim` and merged into it (one copy, none
/// when `dim` is 0).
pub fn all_gather_dim(comm: &Comm, tensor: &Tensor, dim: usize) -> Result<Tensor> {
    gather_along(tensor, dim, comm.size(), |stacked| {
        crate::all_gather(comm, stacked)
    })
}

/// [`all_gather_dim`] with the first-dimension all-gather `gather` of `size` ranks (NCCL's,
/// a simulated one, or none in a skip mode).
pub(crate) fn gather_along(
    tensor: &Tensor,
    dim: usize,
    size: usize,
    gather: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let dims = tensor.dims().to_vec();
    if dim >= dims.len() {
        return Err(Error::Shape {
            op: "all_gather_dim",
            why: format!("dimension {dim} is past the last of {dims:?}"),
        });
    }
    let mut merged = dims.clone();
    merged[dim] = merged[dim].checked_mul(size).ok_or_else(|| Error::Shape {
        op: "all_gather_dim",
        why: format!("{dims:?} gathered over {size} ranks overflows"),
    })?;
    let stacked = gather(&tensor.unsqueeze(0)?.contiguous()?)?;
    if dim == 0 {
        return Ok(stacked.reshape(merged)?);
    }
    // [size, d0, .., dk] -> [d0, .., size, d_dim, ..]: rank r's block of `dim` then comes
    // after ranks 0..r's, which is the concatenation once the two axes are merged.
    let mut order: Vec<usize> = (1..=dim).collect();
    order.push(0);
    order.extend(dim + 1..=dims.len());
    Ok(stacked.permute(order)?.contiguous()?.reshape(merged)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// What `size` ranks' tensors `rank_tensor(r)` gathered along `dim` must be.
    fn check(dims: &[usize], dim: usize, size: usize) {
        let count: usize = dims.iter().product();
        let rank_tensor = |r: usize| {
            let values: Vec<f32> = (0..count).map(|i| (r * 1000 + i) as f32).collect();
            Tensor::from_vec(values, dims, &Device::Cpu).unwrap()
        };
        let all: Vec<Tensor> = (0..size).map(rank_tensor).collect();
        let want = Tensor::cat(&all, dim).unwrap();
        // The first-dimension gather a collective does, here on the host.
        let got = gather_along(&rank_tensor(0), dim, size, |stacked| {
            assert_eq!(stacked.dim(0).unwrap(), 1);
            let each: Vec<Tensor> = (0..size)
                .map(|r| rank_tensor(r).unsqueeze(0).unwrap())
                .collect();
            Ok(Tensor::cat(&each, 0)?)
        })
        .unwrap();
        assert_eq!(got.dims(), want.dims(), "{dims:?} along {dim}");
        assert_eq!(
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "{dims:?} along {dim} over {size}"
        );
    }

    #[test]
    fn gathers_along_every_dimension_in_rank_order() {
        for size in [1, 2, 3] {
            check(&[5], 0, size);
            for dim in 0..3 {
                check(&[2, 3, 4], dim, size);
            }
            check(&[2, 1, 3, 2], 3, size);
        }
    }

    #[test]
    fn a_dimension_past_the_last_is_refused() {
        let t = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = gather_along(&t, 2, 2, |_| unreachable!()).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
    }
}
