//! Attention of one query position over a whole preallocated cache.

use candle_core::{DType, Tensor};

use crate::{Error, Result};

/// Attention of the step's queries `q` (`[b, heads, 1, head_dim]`, rotated) over every
/// position of a layer's cache, `keys` and `values` (`[b, kv_heads, max_seq, head_dim]`),
/// with the additive `mask` (`[1, max_seq]`, from [`StepInputs::mask`](super::StepInputs::mask))
/// hiding the positions the query may not see. Scores are `q·k * scale`, computed and
/// normalised (softmax) in `scores_dtype`, weights cast back to the values' type. Grouped
/// query heads share their key/value head through the batched product's shape (no copy of
/// the cache per query head). Returns `[b, 1, heads * head_dim]`, o_proj's input.
pub fn attend(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: &Tensor,
    scale: f64,
    scores_dtype: DType,
) -> Result<Tensor> {
    let (b, heads, seq, dim) = q.dims4()?;
    let (kb, kv_heads, max_seq, kdim) = keys.dims4()?;
    if seq != 1
        || kb != b
        || kdim != dim
        || kv_heads == 0
        || !heads.is_multiple_of(kv_heads)
        || values.dims() != keys.dims()
        || mask.dims() != [1, max_seq]
    {
        return Err(Error::Shape {
            op: "attend",
            why: format!(
                "queries {:?}, keys {:?}, values {:?}, mask {:?}",
                q.dims(),
                keys.dims(),
                values.dims(),
                mask.dims()
            ),
        });
    }
    let q = q
        .contiguous()?
        .reshape((b, kv_heads, heads / kv_heads, dim))?;
    let scores = (q
        .to_dtype(scores_dtype)?
        .matmul(&keys.to_dtype(scores_dtype)?.t()?)?
        * scale)?
        .broadcast_add(&mask.to_dtype(scores_dtype)?)?;
    let weights = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(values.dtype())?;
    Ok(weights.matmul(values)?.reshape((b, 1, heads * dim))?)
}
