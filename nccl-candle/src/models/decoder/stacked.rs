//! Column-parallel projections of one input run as one product: this rank's rows of q, k and
//! v (or of gate and up) stacked at load, so a decode step reads them in one kernel instead
//! of one each (measured on a Qwen3 checkpoint's graph step: seven products a layer, each at
//! about half the bandwidth of a stacked one). The outputs are views of the one result.

use candle_core::{Tensor, D};
use candle_nn::{Linear, Module};

use crate::{Error, Result};

#[derive(Debug, Clone)]
pub(super) struct Stacked {
    linear: Linear,
    /// Each projection's output width on this rank.
    widths: Vec<usize>,
}

impl Stacked {
    /// The projections `parts` (this rank's rows of each, all with a bias or none) as one.
    pub(super) fn new(parts: &[Linear]) -> Result<Self> {
        let widths = parts
            .iter()
            .map(|p| p.weight().dim(0))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let weights: Vec<&Tensor> = parts.iter().map(Linear::weight).collect();
        let biases: Vec<&Tensor> = parts.iter().filter_map(Linear::bias).collect();
        let bias = match biases.len() {
            0 => None,
            n if n == parts.len() => Some(Tensor::cat(&biases, 0)?),
            n => {
                return Err(Error::Argument {
                    op: "CausalLm::load",
                    why: format!("{n} of {} stacked projections have a bias", parts.len()),
                })
            }
        };
        Ok(Self {
            linear: Linear::new(Tensor::cat(&weights, 0)?, bias),
            widths,
        })
    }

    /// Each projection of `x` (`[.., in]`), `[.., width]` views of one product.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let all = self.linear.forward(x)?;
        let mut start = 0;
        let mut out = Vec::with_capacity(self.widths.len());
        for &width in &self.widths {
            out.push(all.narrow(D::Minus1, start, width)?);
            start += width;
        }
        Ok(out)
    }

    /// The first `N` projections of `x`, as [`forward`](Self::forward).
    pub(super) fn forward_n<const N: usize>(&self, x: &Tensor) -> Result<[Tensor; N]> {
        let parts = self.forward(x)?;
        let count = parts.len();
        parts.try_into().map_err(|_| Error::Argument {
            op: "CausalLm::forward",
            why: format!("{count} stacked projections, {N} expected"),
        })
    }
}
