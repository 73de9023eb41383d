//! The example's self-checks: each prints a PASS/FAIL line on rank 0, and every rank learns
//! the verdicts that decide its control flow.

use std::fmt;

use nccl::{Comm, ReduceOp};

use crate::data::Data;
use crate::kernels::Kernels;
use crate::model::{Replica, Shape};
use crate::options::Options;
use crate::ranks;
use crate::train::{throughput, train, Epoch};
use crate::Error;

/// N ranks vs 1 GPU: `max |p_N - p_1| <= PARAM_TOLERANCE * max(1, max |p_1|)`. The runs differ
/// only in the order of float additions, which moves the parameters by about 1e-6 at the
/// defaults (a float32 CPU model of these kernels gives 5e-7), so this leaves a wide margin; a
/// real bug (a wrong scale, a rank's gradient left out) changes the trajectory outright.
const PARAM_TOLERANCE: f32 = 1e-4;
/// N ranks vs 1 GPU: `|loss_N - loss_1| <= LOSS_TOLERANCE * loss_1`, every epoch.
const LOSS_TOLERANCE: f64 = 1e-4;
/// First averaged gradient vs float64 on the host: `max |g - g64| <= GRAD_TOLERANCE * max |g64|`.
const GRAD_TOLERANCE: f64 = 1e-4;

/// The largest of `values`, or NaN if any is NaN (`f64::max` would drop it, and a NaN must fail
/// a check, never pass it).
fn largest(values: impl IntoIterator<Item = f64>) -> f64 {
    values.into_iter().fold(0.0, |m: f64, v| {
        if m.is_nan() || v.is_nan() {
            f64::NAN
        } else {
            m.max(v)
        }
    })
}

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

/// After the broadcast: did every rank receive rank 0's parameters bit for bit? Every rank
/// learns the total number of wrong values, so that all take the same branch afterwards.
pub fn check_broadcast(
    comm: &Comm,
    replica: &Replica,
    init: &[f32],
    verdicts: &mut Verdicts,
) -> Result<bool, Error> {
    let stream = &replica.stream;
    comm.synchronize()?;
    let received = stream.clone_dtoh(&replica.params)?;
    let wrong = received
        .iter()
        .zip(init)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    let mut total = stream.clone_htod(&[wrong as u64])?;
    comm.all_reduce_in_place(&mut total, ReduceOp::Sum)?;
    comm.synchronize()?;
    let total = stream.clone_dtoh(&total)?[0];
    verdicts.check(
        total == 0,
        format_args!(
            "broadcast: every rank holds rank 0's {} initial parameters bit for bit (values \
             differing, all ranks together: {total})",
            init.len()
        ),
    );
    Ok(total == 0)
}

/// Rank 0: the averaged gradient now in `replica.grads` against float64 on the host, over the
/// samples of global batch 0 (`0, S, 2S, ...`).
pub fn check_gradient(
    replica: &Replica,
    full: &Data,
    init: &[f32],
    options: &Options,
    verdicts: &mut Verdicts,
) -> Result<(), Error> {
    let steps = options.steps_per_epoch();
    let batch0: Vec<usize> = (0..options.batch).map(|j| j * steps).collect();
    let expected = replica.shape.gradient_f64(init, full, &batch0);
    let got = replica.stream.clone_dtoh(&replica.grads)?;
    let scale = largest(expected.iter().map(|g| g.abs()));
    let err = largest(
        got.iter()
            .zip(&expected)
            .map(|(&a, &b)| (f64::from(a) - b).abs()),
    );
    verdicts.check(
        err <= GRAD_TOLERANCE * scale,
        format_args!(
            "gradient: the averaged gradient of batch 0 matches float64 on the host (max error \
             {err:.2e} <= {GRAD_TOLERANCE:.0e} x max |g| {scale:.3e})"
        ),
    );
    Ok(())
}

/// Gathers every rank's parameters and compares them bit for bit with this rank's, which it
/// returns. All ranks receive the same gathered buffer, so they reach the same verdict.
pub fn check_identical(
    comm: &Comm,
    replica: &Replica,
    steps: usize,
    verdicts: &mut Verdicts,
) -> Result<Vec<f32>, Error> {
    let stream = &replica.stream;
    let n = comm.size();
    let mut gathered = stream.alloc_zeros::<f32>(n * replica.params.len())?;
    comm.all_gather(&replica.params, &mut gathered)?;
    comm.synchronize()?;
    let params = stream.clone_dtoh(&replica.params)?;
    let gathered = stream.clone_dtoh(&gathered)?;
    let differing: Vec<usize> = gathered
        .chunks(params.len())
        .enumerate()
        .filter(|(_, other)| {
            other
                .iter()
                .zip(&params)
                .any(|(a, b)| a.to_bits() != b.to_bits())
        })
        .map(|(r, _)| r)
        .collect();
    let detail = if differing.is_empty() {
        String::new()
    } else {
        format!(" (ranks {differing:?} differ from rank {})", comm.rank())
    };
    verdicts.check(
        differing.is_empty(),
        format_args!(
            "identical: all {} hold bitwise-identical parameters after {steps} steps{detail}",
            ranks(n)
        ),
    );
    Ok(params)
}

/// The outcome of the data-parallel training, on rank 0.
pub struct Run {
    pub ranks: usize,
    pub params: Vec<f32>,
    pub epochs: Vec<Epoch>,
}

/// Rank 0: trains the same model alone, on the whole dataset with the whole global batch per
/// step, the same kernels and initial parameters and no NCCL, and compares it with the run.
pub fn check_reference(
    comm: &Comm,
    kernels: &Kernels,
    options: &Options,
    full: &Data,
    init: &[f32],
    run: &Run,
    verdicts: &mut Verdicts,
) -> Result<(), Error> {
    println!(
        "reference: rank 0 trains the same model alone on GPU {} ({} samples per step, no NCCL)",
        comm.device(),
        options.batch
    );
    let stream = comm.stream();
    let shape = Shape {
        hidden: options.hidden,
    };
    let mut alone = Replica::new(stream, kernels, shape, full, options.batch, init)?;
    let (_, reference) = train(&mut alone, &None, options, |_, _| {})?;
    let expected = stream.clone_dtoh(&alone.params)?;
    let (loss_n, loss_1) = match (run.epochs.last(), reference.last()) {
        (Some(a), Some(b)) => (a.loss, b.loss),
        _ => (f64::NAN, f64::NAN),
    };
    println!(
        "reference: final loss {loss_1:.9}; {} epochs in {:.1} ms of training, {:.2} M samples/s",
        reference.len(),
        reference.iter().map(|e| e.train_s).sum::<f64>() * 1e3,
        throughput(&reference, options.samples) / 1e6
    );

    let n = ranks(run.ranks);
    let magnitude = largest(expected.iter().map(|p| f64::from(p.abs()))).max(1.0);
    let max_diff = largest(
        run.params
            .iter()
            .zip(&expected)
            .map(|(a, b)| f64::from((a - b).abs())),
    );
    let bound = f64::from(PARAM_TOLERANCE) * magnitude;
    verdicts.check(
        max_diff <= bound,
        format_args!(
            "{n} vs 1 GPU: max |parameter difference| {max_diff:.2e} <= {bound:.2e} \
             ({PARAM_TOLERANCE:.0e} x max(1, max |parameter|))"
        ),
    );
    let worst = largest(
        run.epochs
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a.loss - b.loss).abs() / b.loss),
    );
    verdicts.check(
        worst <= LOSS_TOLERANCE,
        format_args!(
            "{n} vs 1 GPU: final loss {loss_n:.9} vs {loss_1:.9}; largest relative loss \
             difference over the epochs {worst:.2e} <= {LOSS_TOLERANCE:.0e}"
        ),
    );
    Ok(())
}
