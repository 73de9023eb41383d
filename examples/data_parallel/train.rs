//! Training: one step's gradient and its average over the ranks, the global loss, and the
//! epoch loop shared by the N-rank run and the 1-GPU reference.

use std::time::Instant;

use nccl::{Comm, PreMulSum, ReduceOp};

use crate::model::Replica;
use crate::options::Options;
use crate::Error;

/// How the ranks average their gradients.
pub enum Averaging<'c> {
    Avg,
    PreMulSum(PreMulSum<'c, f32>),
}

impl Averaging<'_> {
    pub fn name(&self) -> &'static str {
        match self {
            Averaging::Avg => "ncclAvg",
            Averaging::PreMulSum(_) => "PreMulSum(1/n)",
        }
    }
}

/// The communicator side of a replica: `None` for the 1-GPU reference.
pub type Link<'a, 'c> = Option<(&'a Comm, &'a Averaging<'c>)>;

/// Waits for the replica's stream: through the communicator when there is one, which returns
/// with NCCL's error instead of hanging if a peer died.
pub fn sync(replica: &Replica, link: &Link<'_, '_>) -> Result<(), Error> {
    match link {
        Some((comm, _)) => comm.synchronize()?,
        None => replica.stream.synchronize()?,
    }
    Ok(())
}

/// Loss over the whole dataset: the sum over the shards, divided by the dataset size.
pub fn global_loss(
    replica: &mut Replica,
    link: &Link<'_, '_>,
    samples: usize,
) -> Result<f64, Error> {
    replica.loss()?;
    if let Some((comm, _)) = link {
        comm.all_reduce_in_place(&mut replica.loss_sum, ReduceOp::Sum)?;
    }
    sync(replica, link)?;
    let sum = replica.stream.clone_dtoh(&replica.loss_sum)?;
    Ok(sum[0] / samples as f64)
}

/// Enqueues step `s`'s gradient: this replica's part, then the average over the ranks. Every
/// rank scales its sum by `n / global batch`, so the average is the mean over the global batch.
pub fn gradient(
    replica: &mut Replica,
    link: &Link<'_, '_>,
    s: usize,
    options: &Options,
) -> Result<(), Error> {
    let ranks = link.map_or(1, |(comm, _)| comm.size());
    replica.gradients(s, ranks as f32 / options.batch as f32)?;
    if let Some((comm, averaging)) = link {
        // One all-reduce per step: the whole gradient is one flat buffer.
        match averaging {
            Averaging::Avg => comm.all_reduce_in_place(&mut replica.grads, ReduceOp::Avg)?,
            Averaging::PreMulSum(op) => comm.all_reduce_in_place(&mut replica.grads, op)?,
        }
    }
    Ok(())
}

pub struct Epoch {
    pub loss: f64,
    /// Training steps only.
    pub train_s: f64,
    /// Steps plus the loss evaluation.
    pub total_s: f64,
}

/// Trains for `options.epochs`, returning the loss before training and each epoch's record.
pub fn train(
    replica: &mut Replica,
    link: &Link<'_, '_>,
    options: &Options,
    mut on_epoch: impl FnMut(usize, &Epoch),
) -> Result<(f64, Vec<Epoch>), Error> {
    let initial = global_loss(replica, link, options.samples)?;
    let mut epochs = Vec::with_capacity(options.epochs);
    for epoch in 1..=options.epochs {
        let start = Instant::now();
        for s in 0..replica.steps {
            gradient(replica, link, s, options)?;
            replica.apply(options.lr)?;
        }
        sync(replica, link)?;
        let train_s = start.elapsed().as_secs_f64();
        let loss = global_loss(replica, link, options.samples)?;
        let record = Epoch {
            loss,
            train_s,
            total_s: start.elapsed().as_secs_f64(),
        };
        on_epoch(epoch, &record);
        epochs.push(record);
    }
    Ok((initial, epochs))
}

/// Samples per second over the epochs given.
pub fn throughput(epochs: &[Epoch], samples: usize) -> f64 {
    let seconds: f64 = epochs.iter().map(|e| e.train_s).sum();
    (epochs.len() * samples) as f64 / seconds
}
