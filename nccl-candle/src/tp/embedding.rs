//! An embedding table split by rows (tokens) over a tensor-parallel group.

use candle_core::{DType, Tensor};
use candle_nn::var_builder::ShardedVarBuilder;

use super::shard::load_block;
use super::TpGroup;
use crate::{Error, Result};

/// The rows of `table` (`[rows, hidden]`, rows `start..start + rows` of a whole table) for
/// `ids` (any shape; `u8`, `u32` or `i64`): `[ids.., hidden]`, with zeros for ids outside
/// `start..start + rows`. Each id falls in exactly one rank's block, so the sum of every
/// rank's result is the whole table's lookup, exactly (adding zeros rounds nothing). An id
/// outside the whole table (negative, or at least its length) gets zeros on every rank.
///
/// Ids outside the block are first replaced by a valid index (0, so the lookup is
/// well-defined on any device), then their rows are zeroed.
pub fn masked_lookup(table: &Tensor, ids: &Tensor, start: usize) -> Result<Tensor> {
    const OP: &str = "masked_lookup";
    let (rows, hidden) = table.dims2().map_err(|_| Error::Shape {
        op: OP,
        why: format!("the table {:?} must be [rows, hidden]", table.dims()),
    })?;
    match ids.dtype() {
        DType::U8 | DType::U32 | DType::I64 => {}
        dtype => return Err(Error::UnsupportedDType { op: OP, dtype }),
    }
    let start = i64::try_from(start).map_err(|_| Error::Shape {
        op: OP,
        why: format!("the block's start {start} does not fit an i64"),
    })?;
    let rows_i64 = i64::try_from(rows).map_err(|_| Error::Shape {
        op: OP,
        why: format!("{rows} rows do not fit an i64"),
    })?;
    let mut shape = ids.dims().to_vec();
    shape.push(hidden);
    if rows == 0 {
        // Nothing to look up, and index 0 of an empty table is outside its memory (candle's
        // CUDA gather does not check bounds).
        return Ok(Tensor::zeros(shape, table.dtype(), table.device())?);
    }
    // i64 so that ids below the block's start go negative rather than wrap.
    let local = ids.to_dtype(DType::I64)?.affine(1.0, -(start as f64))?;
    let inside = local.ge(0i64)?.mul(&local.lt(rows_i64)?)?;
    let safe = inside.where_cond(&local, &local.zeros_like()?)?;
    let found = table.index_select(&safe.flatten_all()?, 0)?;
    // Selected, not multiplied by 0: row 0 may hold an infinity, and 0 * inf is NaN.
    let keep = inside
        .flatten_all()?
        .unsqueeze(1)?
        .broadcast_as(found.shape())?;
    Ok(keep
        .where_cond(&found, &found.zeros_like()?)?
        .reshape(shape)?)
}

/// An embedding table `[vocab, hidden]` split by rows over the group: rank `r` holds tokens
/// `r * vocab / N ..` the next rank's start, looks up the ids it holds (zeros for the
/// others, see [`masked_lookup`]) and an all-reduce sums the ranks' rows. Ids outside
/// `0..vocab` embed to zeros, on one rank as on several. Inference only (the collectives have
/// no backward).
#[derive(Debug, Clone)]
pub struct VocabParallelEmbedding {
    group: TpGroup,
    /// This rank's rows.
    table: Tensor,
    /// The first token this rank holds.
    start: usize,
    vocab: usize,
    hidden: usize,
}

impl VocabParallelEmbedding {
    /// Loads this rank's rows of `weight` (`[vocab, hidden]` in the file) under `vb`'s
    /// prefix, in `vb`'s type on its device. [`Error::NotDivisible`] when `vocab` does not
    /// split over the group, [`Error::ShardShape`] when the file's table has another shape.
    pub fn load(
        vb: &ShardedVarBuilder,
        group: &TpGroup,
        vocab: usize,
        hidden: usize,
    ) -> Result<Self> {
        let table = load_block(vb, group, "weight", &[vocab, hidden], Some(0))?;
        Ok(Self {
            group: group.clone(),
            table,
            start: group.rank() * (vocab / group.size()),
            vocab,
            hidden,
        })
    }

    /// The embeddings of `ids` (any shape; `u8`, `u32` or `i64`): `[ids.., hidden]`, the same
    /// on every rank.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mine = masked_lookup(&self.table, ids, self.start)?;
        self.group.layer_sum(mine)
    }

    /// The number of tokens of the whole table.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The width of an embedding.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The tokens this rank holds.
    pub fn local_range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.table.dims()[0]
    }
}

/// [`VocabParallelEmbedding::forward`] as a candle module, for candle-nn code (`ids.apply(&emb)`,
/// a `candle_nn::Sequential`, a `&dyn Module`); this crate's errors come out as candle's (see
/// [`Error`]'s conversion).
impl candle_core::Module for VocabParallelEmbedding {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        Ok(VocabParallelEmbedding::forward(self, ids)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A table of `rows` rows whose row `i` is `[start + i; hidden]`.
    fn table(start: usize, rows: usize, hidden: usize) -> Tensor {
        let values: Vec<f32> = (0..rows)
            .flat_map(|i| vec![(start + i) as f32; hidden])
            .collect();
        Tensor::from_vec(values, (rows, hidden), &Device::Cpu).unwrap()
    }

    #[test]
    fn ids_outside_the_block_get_zeros() {
        let ids = Tensor::new(&[[0u32, 3, 4], [5, 7, 8]], &Device::Cpu).unwrap();
        let got = masked_lookup(&table(4, 4, 2), &ids, 4).unwrap();
        assert_eq!(got.dims(), &[2, 3, 2]);
        let want = [
            [[0.0, 0.0], [0.0, 0.0], [4.0, 4.0]],
            [[5.0, 5.0], [7.0, 7.0], [0.0, 0.0]],
        ];
        assert_eq!(got.to_vec3::<f32>().unwrap(), want);
    }

    #[test]
    fn blocks_sum_to_the_whole_lookup_and_unknown_ids_to_zeros() {
        let (vocab, hidden) = (12, 3);
        let ids = Tensor::new(&[11i64, 0, 5, -1, 12, 6], &Device::Cpu).unwrap();
        let whole = masked_lookup(&table(0, vocab, hidden), &ids, 0).unwrap();
        for world_size in [2, 3, 4] {
            let block = vocab / world_size;
            let mut sum = Tensor::zeros((6, hidden), DType::F32, &Device::Cpu).unwrap();
            for rank in 0..world_size {
                let part = masked_lookup(&table(rank * block, block, hidden), &ids, rank * block);
                sum = (sum + part.unwrap()).unwrap();
            }
            assert_eq!(
                sum.to_vec2::<f32>().unwrap(),
                whole.to_vec2::<f32>().unwrap()
            );
        }
        let rows: Vec<f32> = whole
            .to_vec2::<f32>()
            .unwrap()
            .iter()
            .map(|r| r[0])
            .collect();
        assert_eq!(rows, [11.0, 0.0, 5.0, 0.0, 0.0, 6.0]);
    }

    #[test]
    fn infinities_in_the_table_stay_in_their_rows() {
        let table = Tensor::new(&[[f32::INFINITY, 1.0], [2.0, 3.0]], &Device::Cpu).unwrap();
        let ids = Tensor::new(&[0u32, 5, 11], &Device::Cpu).unwrap();
        let got = masked_lookup(&table, &ids, 10).unwrap();
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            [[0.0, 0.0], [0.0, 0.0], [2.0, 3.0]]
        );
        let empty = Tensor::zeros((0, 2), DType::F32, &Device::Cpu).unwrap();
        let got = masked_lookup(&empty, &ids, 0).unwrap();
        assert_eq!(got.to_vec2::<f32>().unwrap(), [[0.0, 0.0]; 3]);
    }

    #[test]
    fn float_ids_and_flat_tables_are_refused() {
        let ids = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let err = masked_lookup(&table(0, 2, 2), &ids, 0).unwrap_err();
        assert!(matches!(err, Error::UnsupportedDType { .. }), "{err}");
        let ids = Tensor::new(&[1u32], &Device::Cpu).unwrap();
        let flat = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        let err = masked_lookup(&flat, &ids, 0).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
    }
}
