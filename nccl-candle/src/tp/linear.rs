//! Linear layers split over a tensor-parallel group: by output features (column-parallel)
//! or by input features (row-parallel).

use candle_core::Tensor;
use candle_nn::var_builder::ShardedVarBuilder;
use candle_nn::{Linear, Module};

use super::epilogue;
use super::shard::load_block;
use super::TpGroup;
use crate::{Error, Result};

/// Refuses an input whose last dimension is not `features`.
fn check_input(op: &'static str, x: &Tensor, features: usize) -> Result<()> {
    match x.dims().last() {
        Some(&last) if last == features && x.rank() >= 2 => Ok(()),
        _ => Err(Error::Shape {
            op,
            why: format!(
                "the input {:?} must have at least two dimensions, the last of {features}",
                x.dims()
            ),
        }),
    }
}

/// `y = x W^T + b` with `W` (`[out, in]`) and `b` (`[out]`) split by rows over the group:
/// rank `r` holds output features `r * out / N ..` the next rank's start, and computes that
/// block of `y` from the whole input. Inference only (the collectives have no backward).
#[derive(Debug, Clone)]
pub struct ColumnParallelLinear {
    group: TpGroup,
    pub(super) linear: Linear,
    in_features: usize,
    out_features: usize,
}

impl ColumnParallelLinear {
    /// Loads this rank's rows of `weight` (`[out_features, in_features]` in the file) and,
    /// when `bias`, of `bias` (`[out_features]`) under `vb`'s prefix, in `vb`'s type on its
    /// device. [`Error::NotDivisible`] when `out_features` does not split over the group,
    /// [`Error::ShardShape`] when the file's tensors have other shapes; the same on every
    /// rank that passes the same arguments and file (see the [module](super) on agreement).
    pub fn load(
        vb: &ShardedVarBuilder,
        group: &TpGroup,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = load_block(vb, group, "weight", &[out_features, in_features], Some(0))?;
        let bias = match bias {
            true => Some(load_block(vb, group, "bias", &[out_features], Some(0))?),
            false => None,
        };
        Ok(Self {
            group: group.clone(),
            linear: Linear::new(weight, bias),
            in_features,
            out_features,
        })
    }

    /// This rank's block of the output: `x` (`[.., in_features]`, at least two dimensions)
    /// gives `[.., out_features / N]`. No collective.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("ColumnParallelLinear::forward", x, self.in_features)?;
        Ok(self.linear.forward(x)?)
    }

    /// The whole output, `[.., out_features]`, the same on every rank: this rank's block
    /// all-gathered along the last dimension.
    pub fn forward_gathered(&self, x: &Tensor) -> Result<Tensor> {
        let block = self.forward(x)?;
        let last = block.rank() - 1;
        self.group.layer_gather(&block, last)
    }

    /// The input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// The output features of the whole layer.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The output features this rank computes.
    pub fn local_out_features(&self) -> usize {
        self.out_features / self.group.size()
    }

    /// This rank's rows of the weight, `[out_features / N, in_features]`.
    pub fn weight(&self) -> &Tensor {
        self.linear.weight()
    }
}

/// [`ColumnParallelLinear::forward`] (this rank's block of the output, no collective) as a
/// candle module, for candle-nn code (`x.apply(&layer)`, a `candle_nn::Sequential`, a
/// `&dyn Module`); this crate's errors come out as candle's (see [`Error`]'s conversion).
impl Module for ColumnParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(ColumnParallelLinear::forward(self, x)?)
    }
}

/// `y = x W^T + b` with `W` (`[out, in]`) split by columns over the group: rank `r` holds
/// input features `r * in / N ..` the next rank's start and takes that block of `x` (what a
/// [`ColumnParallelLinear`] left on it); the partial products are summed over the ranks
/// (all-reduce), then the whole bias is added once. Inference only (the collectives have
/// no backward).
#[derive(Debug, Clone)]
pub struct RowParallelLinear {
    group: TpGroup,
    /// This rank's columns of the weight, without the bias.
    linear: Linear,
    bias: Option<Tensor>,
    in_features: usize,
    out_features: usize,
}

impl RowParallelLinear {
    /// Loads this rank's columns of `weight` (`[out_features, in_features]` in the file)
    /// and, when `bias`, all of `bias` (`[out_features]`) under `vb`'s prefix, in `vb`'s type
    /// on its device. [`Error::NotDivisible`] when `in_features` does not split over the
    /// group, [`Error::ShardShape`] when the file's tensors have other shapes.
    pub fn load(
        vb: &ShardedVarBuilder,
        group: &TpGroup,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = load_block(vb, group, "weight", &[out_features, in_features], Some(1))?;
        let bias = match bias {
            true => Some(load_block(vb, group, "bias", &[out_features], None)?),
            false => None,
        };
        Ok(Self {
            group: group.clone(),
            linear: Linear::new(weight, None),
            bias,
            in_features,
            out_features,
        })
    }

    /// From this rank's block of the weight (`[out_features, in_features / N]`) and the
    /// whole bias, already loaded (the models' own reader).
    pub(crate) fn from_block(
        group: &TpGroup,
        weight: Tensor,
        bias: Option<Tensor>,
        in_features: usize,
        out_features: usize,
    ) -> Self {
        Self {
            group: group.clone(),
            linear: Linear::new(weight, None),
            bias,
            in_features,
            out_features,
        }
    }

    /// The whole output `[.., out_features]`, the same on every rank, from this rank's block
    /// of the input `x` (`[.., in_features / N]`, at least two dimensions).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("RowParallelLinear::forward", x, self.local_in_features())?;
        let partial = self.linear.forward(x)?;
        let sum = self.group.layer_sum(partial)?;
        match &self.bias {
            // After the reduction, so that the bias counts once, not once per rank.
            Some(bias) => Ok(sum.broadcast_add(bias)?),
            None => Ok(sum),
        }
    }

    /// The layer followed by the residual add and RMSNorm, as a transformer block uses it:
    /// `h = residual + forward(x)`, returned with its norm, `(h, rms_norm(h) · norm_weight)`
    /// (`norm_weight`: `[out_features]`). Without a bias the sum, the add and the norm are
    /// one [`TpGroup::all_reduce_add_rms_norm`] (one fused kernel with
    /// [`LsaCollectives`](super::LsaCollectives) where the tensors fit); with one, the bias
    /// must come after the sum and before the add, so this runs as [`forward`](Self::forward)
    /// then the add and the norm. Skip mode leaves the sum out, as in `forward`.
    pub fn forward_add_rms_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        norm_weight: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "RowParallelLinear::forward_add_rms_norm";
        check_input(OP, x, self.local_in_features())?;
        let partial = self.linear.forward(x)?;
        match &self.bias {
            None => self
                .group
                .all_reduce_add_rms_norm(&partial, residual, norm_weight, eps),
            Some(bias) => {
                // Refused before the sum, as the fused path would be.
                epilogue::check(OP, &partial, residual, norm_weight)?;
                let sum = self.group.layer_sum(partial)?.broadcast_add(bias)?;
                epilogue::add_rms_norm(&sum, residual, norm_weight, eps)
            }
        }
    }

    /// The input features of the whole layer.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// The input features this rank takes.
    pub fn local_in_features(&self) -> usize {
        self.in_features / self.group.size()
    }

    /// The output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// This rank's columns of the weight, `[out_features, in_features / N]`.
    pub fn weight(&self) -> &Tensor {
        self.linear.weight()
    }
}

/// [`RowParallelLinear::forward`] (the whole output, summed over the group) as a candle
/// module, for candle-nn code (`x.apply(&layer)`, a `candle_nn::Sequential`, a
/// `&dyn Module`); this crate's errors come out as candle's (see [`Error`]'s conversion).
impl Module for RowParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(RowParallelLinear::forward(self, x)?)
    }
}
