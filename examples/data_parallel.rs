//! Data-parallel training of a small MLP: the use case this crate grew from.
//!
//! Every rank holds a full copy of a 2-layer MLP (`64 -> hidden -> 1`, tanh), trains it with
//! SGD on its own shard of a synthetic regression dataset, and keeps the copies in lockstep
//! with NCCL:
//!
//! * rank 0 initialises the parameters and `broadcast_in_place` hands them to everyone;
//! * every step each rank computes the gradient of its part of the global batch with NVRTC
//!   kernels, and one `all_reduce_in_place(.., ReduceOp::Avg)` (or a [`PreMulSum`] by `1/n`
//!   with `--premulsum`) over the flattened gradient turns it into the global-batch gradient;
//! * every epoch the loss over the whole dataset is a `Sum` all-reduce of per-rank sums.
//!
//! The example then checks itself and prints PASS/FAIL lines (and exits 1 on a FAIL): the
//! broadcast delivered rank 0's parameters bit for bit; the first averaged gradient equals a
//! float64 host computation on the global batch; all ranks end with bitwise-identical
//! parameters; and rank 0, training the same model alone on its GPU with no NCCL, ends within
//! a stated tolerance of the N-rank run.
//!
//! Runs unchanged under `mpirun -np N`, `srun -n N`, a torchrun-style launcher, or with no
//! launcher at all, in which case it starts one process per visible GPU itself:
//!
//! ```text
//! cargo run --release --example data_parallel                  # one process per local GPU
//! mpirun --allow-run-as-root -np 4 target/release/examples/data_parallel
//! srun -n 4 --gpus-per-task=1 target/release/examples/data_parallel
//! cargo run --release --example data_parallel -- --epochs 40 --hidden 256 --premulsum
//! ```
//!
//! # Why the N-rank run can match the 1-GPU run
//!
//! The global batch of every step is the same set of samples whatever the number of ranks,
//! and each rank takes `batch / n` of it. With `S = samples / batch` steps per epoch, step `s`
//! uses the samples `s, s + S, s + 2S, ...` of the dataset. Rank `r` holds the contiguous
//! shard `r * samples/n .. (r+1) * samples/n`, which is exactly `batch / n` of those (`samples`
//! is a multiple of `batch`, and `batch` of `n`). Every rank scales its gradient sum by
//! `n / batch`; averaging over the `n` ranks gives `1 / batch` times the sum over the global
//! batch, the gradient a single GPU computes. The two runs differ only in the order of float
//! additions, hence the tolerance of the last check.
//!
//! The defaults (`--samples 53760 --batch 840`) divide evenly for every world size from 1 to
//! 8; other sizes must keep `samples % batch == 0` and `batch % n == 0`.
//!
//! The model is tiny (8449 parameters at the default width), so a step costs a few kernel
//! launches and one small all-reduce, and the time per epoch mostly measures latency, not
//! arithmetic: raise `--hidden` and `--batch` to see the compute part shrink with more GPUs.
//!
//! # Where things are
//!
//! This file joins the job, runs the session and sets the exit status; `data_parallel/` holds
//! `options` (the flags), `data` (the RNG, the teacher network, the dataset), `model` (the
//! parameter layout, the float64 host gradient, a replica on one GPU), `kernels` (the CUDA
//! source and its NVRTC compilation), `train` (a step, the loss, the epoch loop) and `checks`
//! (the PASS/FAIL lines).

#[path = "data_parallel/checks.rs"]
mod checks;
#[path = "data_parallel/data.rs"]
mod data;
#[path = "data_parallel/kernels.rs"]
mod kernels;
#[path = "data_parallel/model.rs"]
mod model;
#[path = "data_parallel/options.rs"]
mod options;
#[path = "data_parallel/train.rs"]
mod train;

use std::fmt;
use std::process::ExitCode;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError};
use nccl::bootstrap::{spawn_local, BootstrapError};
use nccl::{Comm, PreMulSum};

use checks::{check_broadcast, check_gradient, check_identical, check_reference, Run, Verdicts};
use data::{Data, Teacher};
use kernels::Kernels;
use model::{Replica, Shape, INPUTS};
use options::{parse_options, Command, Options, USAGE};
use train::{gradient, sync, throughput, train, Averaging, Link};

/// Why the example stopped.
#[derive(Debug)]
pub enum Error {
    /// NCCL, the CUDA driver or the bootstrap failed.
    Nccl(nccl::Error),
    /// The kernels could not be compiled (NVRTC missing or a compile error).
    Kernels(String),
    /// The options do not fit this job (exit status 2, like a bad flag).
    Usage(String),
    /// Checks failed; the FAIL lines were printed by rank 0.
    Failed { rank: usize, count: u32 },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Nccl(err) => write!(f, "{err}"),
            Error::Kernels(msg) | Error::Usage(msg) => f.write_str(msg),
            Error::Failed { rank: 0, count } => write!(f, "{count} check(s) failed"),
            Error::Failed { rank, count } => write!(
                f,
                "rank {rank}: {count} check(s) failed (rank 0 printed the FAIL lines)"
            ),
        }
    }
}

impl From<nccl::Error> for Error {
    fn from(err: nccl::Error) -> Self {
        Error::Nccl(err)
    }
}

impl From<DriverError> for Error {
    fn from(err: DriverError) -> Self {
        Error::Nccl(err.into())
    }
}

impl From<BootstrapError> for Error {
    fn from(err: BootstrapError) -> Self {
        Error::Nccl(err.into())
    }
}

/// "1 rank", "4 ranks".
pub fn ranks(n: usize) -> String {
    format!("{n} rank{}", if n == 1 { "" } else { "s" })
}

/// Everything between joining the communicator and leaving it. Every rank makes the same
/// NCCL calls in the same order; returns the number of failed checks, which all ranks agree on.
fn session(
    comm: &Comm,
    stream: &Arc<CudaStream>,
    kernels: &Kernels,
    options: &Options,
) -> Result<u32, Error> {
    let (rank, n) = (comm.rank(), comm.size());
    let shape = Shape {
        hidden: options.hidden,
    };
    let averaging = if options.premulsum {
        Averaging::PreMulSum(PreMulSum::with_host_scalar(comm, 1.0 / n as f32)?)
    } else {
        Averaging::Avg
    };
    let link: Link<'_, '_> = Some((comm, &averaging));
    let shard_len = options.samples / n;
    let shard = rank * shard_len..(rank + 1) * shard_len;
    if rank == 0 {
        println!(
            "data_parallel: MLP {INPUTS} -> {} -> 1 (tanh), {} parameters; {} samples, global \
             batch {}, lr {}, {} epochs",
            shape.hidden,
            shape.params(),
            options.samples,
            options.batch,
            options.lr,
            options.epochs
        );
        println!(
            "{}, NCCL {}, gradients averaged by {}; per rank: {shard_len} samples, {} per step, \
             {} steps per epoch",
            ranks(n),
            nccl::version()?,
            averaging.name(),
            options.batch / n,
            options.steps_per_epoch()
        );
    }
    println!(
        "rank {rank}/{n}: GPU {}, samples {}..{}",
        comm.device(),
        shard.start,
        shard.end
    );
    let mut verdicts = Verdicts {
        print: rank == 0,
        failed: 0,
    };

    let teacher = Teacher::new();
    let data = Data::generate(&teacher, shard);
    // Rank 0 also needs the whole dataset, for the host gradient check and the reference.
    let full = (rank == 0).then(|| Data::generate(&teacher, 0..options.samples));
    // Rank 0 draws the initial parameters; the others start from garbage (NaN) and receive rank
    // 0's values in the broadcast. (They compute the expected values too, but only to check
    // what arrived; a real job would load rank 0's checkpoint instead.)
    let init = shape.initial_params();
    let start = if rank == 0 {
        init.clone()
    } else {
        vec![f32::NAN; init.len()]
    };
    let mut replica = Replica::new(stream, kernels, shape, &data, options.batch / n, &start)?;
    comm.broadcast_in_place(&mut replica.params, 0)?;
    if !check_broadcast(comm, &replica, &init, &mut verdicts)? {
        return Ok(verdicts.failed);
    }

    // The first averaged gradient is the gradient of global batch 0, which rank 0 recomputes
    // in float64 on the host: this checks the kernels and the averaging in one go.
    gradient(&mut replica, &link, 0, options)?;
    sync(&replica, &link)?;
    if let Some(full) = &full {
        check_gradient(&replica, full, &init, options, &mut verdicts)?;
    }

    let print = rank == 0;
    let (initial, epochs) = train(&mut replica, &link, options, |epoch, e| {
        if print {
            println!(
                "epoch {epoch:>3}/{}  loss {:.9}  {:8.3} ms  (train {:.3} ms, {:.2} M samples/s)",
                options.epochs,
                e.loss,
                e.total_s * 1e3,
                e.train_s * 1e3,
                options.samples as f64 / e.train_s / 1e6
            );
        }
    })?;
    let final_loss = epochs.last().map_or(initial, |e| e.loss);
    if rank == 0 {
        let steady = match epochs.get(1..) {
            Some(rest) if !rest.is_empty() => format!(
                " (epochs 2..{}: {:.2} M samples/s)",
                epochs.len(),
                throughput(rest, options.samples) / 1e6
            ),
            _ => String::new(),
        };
        println!(
            "{}: {} epochs in {:.1} ms of training, {:.2} M samples/s{steady}",
            ranks(n),
            epochs.len(),
            epochs.iter().map(|e| e.train_s).sum::<f64>() * 1e3,
            throughput(&epochs, options.samples) / 1e6
        );
    }
    verdicts.check(
        final_loss < initial,
        format_args!("training: the loss fell from {initial:.9} to {final_loss:.9}"),
    );

    let steps = epochs.len() * options.steps_per_epoch();
    let params = check_identical(comm, &replica, steps, &mut verdicts)?;
    drop(replica);

    // Meanwhile the other ranks wait in the broadcast below.
    if let Some(full) = &full {
        let run = Run {
            ranks: n,
            params,
            epochs,
        };
        check_reference(comm, kernels, options, full, &init, &run, &mut verdicts)?;
    }

    // Rank 0's count covers every check; hand it to all ranks so that they exit alike.
    let mut failed = stream.clone_htod(&[verdicts.failed])?;
    comm.broadcast_in_place(&mut failed, 0)?;
    comm.synchronize()?;
    Ok(stream.clone_dtoh(&failed)?[0])
}

fn run(options: &Options) -> Result<(), Error> {
    // Under a launcher this only reads the environment; without one it re-executes this
    // program once per extra GPU and makes this process rank 0.
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    options
        .validate_for(job.placement().world_size)
        .map_err(Error::Usage)?;
    // The library's rule picks the GPU (one visible: that one; one per local rank: the local
    // rank's), so `srun --gpus-per-task=1` and one-GPU containers work as they are.
    let ctx = CudaContext::new(job.device()?)?;
    // Compute and communication share the GPU's default stream: with no stream of its own
    // the context keeps no per-buffer events, so no synchronisation is added to any call.
    let stream = ctx.default_stream();
    // Compiled before joining, so that a missing NVRTC fails every rank before any waits.
    let kernels = Kernels::compile(&ctx)?;
    let comm = job.init_comm_on(stream.clone())?;
    let rank = comm.rank();

    let failed = session(&comm, &stream, &kernels, options)?;

    drop(comm);
    let waited = job.wait();
    if failed > 0 {
        // The spawned ranks failed the same checks; report those, not their exit status.
        return Err(Error::Failed {
            rank,
            count: failed,
        });
    }
    waited?;
    if rank == 0 {
        println!("data_parallel: all checks passed");
    }
    Ok(())
}

fn main() -> ExitCode {
    let options = match parse_options(std::env::args().skip(1)) {
        Ok(Command::Run(options)) => options,
        Ok(Command::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("data_parallel: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Error::Usage(message)) => {
            eprintln!("data_parallel: {message}");
            ExitCode::from(2)
        }
        Err(err) => {
            eprintln!("data_parallel: {err}");
            ExitCode::FAILURE
        }
    }
}
