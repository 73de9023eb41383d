//! The self-checks: rank 0's one-GPU reference run, the replicas' bitwise equality, the
//! loss's fall, and the verdicts every rank agrees on.

use std::fmt;

use candle_core::{DType, Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use nccl::{Comm, ReduceOp};
use nccl_candle::ddp::sorted_vars;

use crate::data::{batch, Shard};
use crate::model::{Gpt, DTYPE};
use crate::options::Options;
use crate::Failure;

/// The final loss (the mean of the last steps) must be at most this fraction of the first
/// step's loss. The first loss is about ln(vocab) (4.2 to 6.2 here); the successor
/// statistics alone take it to ln 16 = 2.8, reading `a` and `b` off the context towards 0;
/// a run that does not learn stays near 1.
pub const LOSS_FALL: f64 = 0.9;
/// The number of last steps whose mean is the final loss.
pub const FINAL_STEPS: usize = 10;

/// Counts failed checks; rank 0 prints every verdict.
pub struct Verdicts {
    pub print: bool,
    pub failed: u32,
}

impl Verdicts {
    pub fn check(&mut self, ok: bool, what: fmt::Arguments<'_>) {
        if !ok {
            self.failed += 1;
        }
        if self.print {
            println!("{} {what}", if ok { "PASS" } else { "FAIL" });
        }
    }
}

/// The AdamW settings of both runs.
pub fn adamw(vars: &VarMap, lr: f64) -> candle_core::Result<AdamW> {
    AdamW::new(
        vars.all_vars(),
        ParamsAdamW {
            lr,
            ..ParamsAdamW::default()
        },
    )
}

/// Rank 0 alone: a second model with `initial`'s values, trained for `options.check_steps`
/// steps on whole global batches (every rank's share of each step, rebuilt from every rank's
/// sampler), with no collective. Returns the loss of each step.
pub fn reference_losses(
    initial: &VarMap,
    options: &Options,
    world: usize,
    device: &Device,
) -> Result<Vec<f32>, Failure> {
    let config = options.size.config();
    let mut vars = VarMap::new();
    let model = Gpt::new(
        &config,
        VarBuilder::from_varmap(&vars, DTYPE, device),
        device,
    )?;
    for (name, var) in sorted_vars(initial) {
        vars.set_one(&name, var.as_tensor())?;
    }
    let mut opt = adamw(&vars, options.lr)?;
    let local_batch = options.global_batch / world;
    let mut shards = (0..world)
        .map(|rank| Shard::new(rank, world, options.seed, local_batch))
        .collect::<Result<Vec<_>, _>>()?;
    let mut losses = Vec::with_capacity(options.check_steps);
    for step in 0..options.check_steps {
        let indices: Vec<usize> = shards
            .iter_mut()
            .flat_map(|shard| shard.indices(step).to_vec())
            .collect();
        let (input, target) = batch(&indices, options.seed, &config, device)?;
        let loss = model.loss(&input, &target)?;
        opt.set_learning_rate(options.lr_at(step));
        opt.backward_step(&loss)?;
        losses.push(loss.detach());
    }
    Ok(Tensor::stack(&losses, 0)?.to_vec1()?)
}

/// Compares the distributed run's global losses with the reference's, step by step: the
/// largest relative difference (NaN if any loss is NaN, which must fail).
pub fn largest_relative_difference(distributed: &[f32], reference: &[f32]) -> f64 {
    distributed
        .iter()
        .zip(reference)
        .map(|(&d, &r)| ((d as f64) - (r as f64)).abs() / (r as f64).abs())
        .fold(0.0, |m: f64, v| {
            if m.is_nan() || v.is_nan() {
                f64::NAN
            } else {
                m.max(v)
            }
        })
}

/// The number of parameter values, over all ranks, that differ in any bit from another
/// rank's, and the number of values per rank: every parameter (in name order) as its f32
/// bits, all-reduced with Max and with Min; where all ranks hold the same bits, both equal
/// this rank's.
pub fn differing_values(
    comm: &Comm,
    vars: &VarMap,
    device: &Device,
) -> Result<(u64, usize), Failure> {
    let mut bits: Vec<u32> = Vec::new();
    for (_, var) in sorted_vars(vars) {
        let values = var
            .as_tensor()
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        bits.extend(values.iter().map(|v| v.to_bits()));
    }
    let len = bits.len();
    let local = Tensor::from_vec(bits.clone(), len, device)?;
    let max = nccl_candle::all_reduce(comm, &local, ReduceOp::Max)?.to_vec1::<u32>()?;
    let min = nccl_candle::all_reduce(comm, &local, ReduceOp::Min)?.to_vec1::<u32>()?;
    let differing = bits
        .iter()
        .zip(max.iter().zip(&min))
        .filter(|(b, (hi, lo))| b != hi || b != lo)
        .count();
    let total = Tensor::from_vec(vec![differing as i64], 1, device)?;
    let total = nccl_candle::all_reduce(comm, &total, ReduceOp::Sum)?.to_vec1::<i64>()?;
    Ok((total.first().copied().unwrap_or(0) as u64, len))
}
