//! Data-parallel training of a small GPT (candle-nn) over NCCL, on generated sequences.
//!
//! Every rank holds a whole replica; rank 0 draws the initial parameters from `--seed` and
//! `broadcast_vars` hands them to the others. Each step, every rank takes `global / ranks`
//! sequences of the global batch (`DistributedSampler`), and a `DistributedOptimizer` (AdamW)
//! averages the gradients over the ranks in 25 MiB buckets before stepping. The sequences
//! are computed, not downloaded (`x[t+1] = (a x[t] + b) mod vocab`, see `gpt_ddp/data.rs`).
//!
//! Runs unchanged under `mpirun -np N`, `srun -n N`, a torchrun-style launcher, or with no
//! launcher at all, in which case it starts one process per visible GPU itself:
//!
//! ```text
//! cargo run --release --example gpt_ddp                              # one process per GPU
//! CUDA_VISIBLE_DEVICES=0 cargo run --release --example gpt_ddp -- --model large   # 1 GPU
//! CUDA_VISIBLE_DEVICES=0,1 target/release/examples/gpt_ddp --model large          # 2 GPUs
//! mpirun --allow-run-as-root -np 4 target/release/examples/gpt_ddp --model large
//! NCCL_RS_LOCAL_RANKS=2 target/release/examples/gpt_ddp        # 2 ranks whatever is visible
//! ```
//!
//! It checks itself, and exits 1 on every rank when a check fails (the ranks agree on the
//! verdicts first, so none is left waiting):
//!
//! * with more than one rank, rank 0 first trains a second copy of the initial model alone
//!   for `--check-steps` steps on each step's whole global batch (while the other ranks wait
//!   in an all-reduce for its outcome), and the distributed run's global loss (the mean over ranks
//!   of each rank's mean loss) must match it at every one of those steps within
//!   `--tolerance` (relative, default 1e-3). The runs differ only in the order of float
//!   additions (per-rank matrix products and means, the all-reduce): a float32 simulation of
//!   the tiny model on the CPU (two replicas averaged in software against one model) differed
//!   by at most 2.3e-7 over 10 steps; the GPU's figure is printed. A missing or wrong
//!   average changes the trajectory outright (though not a uniform scale of the gradient,
//!   which AdamW divides out: `tests/gpu_ddp.rs` checks the values of the average);
//! * after training, all ranks' parameters are identical bit for bit (all-reduce Max and Min
//!   of their bits against each rank's own);
//! * the loss fell: the mean of the last 10 steps is at most 90% of the first step's.
//!
//! Rank 0 then prints the throughput: tokens per second over the steps between `--warmup`
//! and the last `--measure-steps` (timed between device synchronisations, slowest rank),
//! and, over those last steps, the share of a step spent averaging gradients (packing and
//! all-reducing, timed with a synchronisation before and after, which the other steps do not
//! pay).

#[path = "gpt_ddp/checks.rs"]
mod checks;
#[path = "gpt_ddp/data.rs"]
mod data;
#[path = "gpt_ddp/model.rs"]
mod model;
#[path = "gpt_ddp/options.rs"]
mod options;

use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::process::ExitCode;
use std::time::Instant;

use candle_core::{Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use nccl::bootstrap::spawn_local;
use nccl::{Comm, ReduceOp};
use nccl_candle::ddp::{broadcast_vars, sorted_vars, DistributedOptimizer};

use checks::{
    adamw, differing_values, largest_relative_difference, reference_losses, Verdicts, FINAL_STEPS,
    LOSS_FALL,
};
use data::{batch, Shard};
use model::{Gpt, DTYPE};
use options::{parse_options, Command, Options, USAGE};

/// Why the example stopped.
#[derive(Debug)]
pub enum Failure {
    /// The options do not fit this job (exit status 2, like a bad flag).
    Usage(String),
    /// Checks failed; rank 0 printed the FAIL lines.
    Checks { rank: usize, count: u32 },
    /// candle, NCCL, the bootstrap or nccl-candle failed.
    Error(Box<dyn std::error::Error + Send + Sync>),
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for Failure {
    fn from(err: E) -> Self {
        Failure::Error(Box::new(err))
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Usage(message) => f.write_str(message),
            Failure::Checks { rank: 0, count } => write!(f, "{count} check(s) failed"),
            Failure::Checks { rank, count } => write!(
                f,
                "rank {rank}: {count} check(s) failed (rank 0 printed the FAIL lines)"
            ),
            Failure::Error(err) => write!(f, "{err}"),
        }
    }
}

/// What the training loop measured on this rank.
struct Measured {
    /// Every step's loss on this rank (its mean over its tokens), still on the device.
    losses: Vec<Tensor>,
    /// Seconds of the timed window (steps `warmup..steps - measure`).
    timed_s: f64,
    /// Seconds of the measured steps (the last `measure`), synchronised at each end.
    measured_s: f64,
    /// Seconds spent averaging gradients in the measured steps.
    averaging_s: f64,
}

/// Trains for `options.steps` steps; every rank makes the same collectives.
fn train(
    model: &Gpt,
    opt: &mut DistributedOptimizer<'_, candle_nn::AdamW>,
    shard: &mut Shard,
    options: &Options,
    device: &Device,
) -> Result<Measured, Failure> {
    let config = options.size.config();
    let (timed_start, timed_end) = (options.warmup, options.steps - options.measure_steps);
    let mut losses = Vec::with_capacity(options.steps);
    let mut clock = Instant::now();
    let (mut timed_s, mut measured_s) = (0.0, 0.0);
    for step in 0..options.steps {
        if step == timed_start {
            device.synchronize()?;
            clock = Instant::now();
        }
        if step == timed_end {
            device.synchronize()?;
            timed_s = clock.elapsed().as_secs_f64();
            opt.averager_mut().set_timing(true);
        }
        let step_start = Instant::now();
        let (input, target) = batch(shard.indices(step), options.seed, &config, device)?;
        let loss = model.loss(&input, &target)?;
        opt.set_learning_rate(options.lr_at(step));
        opt.backward_step(&loss)?;
        losses.push(loss.detach());
        if step >= timed_end {
            device.synchronize()?;
            measured_s += step_start.elapsed().as_secs_f64();
        }
    }
    device.synchronize()?;
    if timed_end == options.steps {
        timed_s = clock.elapsed().as_secs_f64();
    }
    let averaging_s = opt
        .averager()
        .timing()
        .map_or(0.0, |t| t.total.as_secs_f64());
    Ok(Measured {
        losses,
        timed_s,
        measured_s,
        averaging_s,
    })
}

/// What each rank sets up before the first collective.
struct Prepared {
    vars: VarMap,
    model: Gpt,
    shard: Shard,
    /// Rank 0's one-GPU losses, with more than one rank and the checks on.
    reference: Option<Vec<f32>>,
}

/// Builds the model and this rank's shard; on rank 0, draws the initial parameters from the
/// seed and runs the one-GPU reference. No collective: the other ranks wait meanwhile.
fn prepare(
    comm: &Comm,
    device: &Device,
    options: &Options,
    how: &str,
) -> Result<Prepared, Failure> {
    let (rank, world) = (comm.rank(), comm.size());
    let config = options.size.config();
    let local_batch = options.global_batch / world;
    // Rank 0 draws the initial parameters; the others' draws are overwritten by the
    // broadcast.
    if rank == 0 {
        device.set_seed(options.seed)?;
    }
    let vars = VarMap::new();
    let model = Gpt::new(
        &config,
        VarBuilder::from_varmap(&vars, DTYPE, device),
        device,
    )?;
    let params: usize = sorted_vars(&vars).iter().map(|(_, v)| v.elem_count()).sum();
    let shard = Shard::new(rank, world, options.seed, local_batch)?;
    if rank == 0 {
        println!(
            "gpt_ddp: GPT {}: {} layers, d_model {}, {} heads, seq {}, vocab {}: {params} \
             parameters ({:.1} M, f32)",
            options.size.name(),
            config.layers,
            config.d_model,
            config.heads,
            config.seq,
            config.vocab,
            params as f64 / 1e6
        );
        println!(
            "{world} rank(s) ({how}), NCCL {}; global batch {} sequences ({local_batch} per \
             rank) x {} tokens, {} steps, AdamW lr {} (warm-up {} steps), seed {}",
            nccl::version()?,
            options.global_batch,
            config.seq,
            options.steps,
            options.lr,
            options.lr_warmup,
            options.seed
        );
    }
    println!(
        "rank {rank}/{world}: GPU {}, {} steps per epoch of the {}-sequence dataset",
        comm.device(),
        shard.steps_per_epoch(),
        data::DATASET_LEN
    );
    let reference = if options.check && world > 1 && rank == 0 {
        let start = Instant::now();
        let losses = reference_losses(&vars, options, world, device)?;
        println!(
            "reference: rank 0 trained {} steps alone on the whole global batch ({:.1} s)",
            options.check_steps,
            start.elapsed().as_secs_f64()
        );
        Some(losses)
    } else {
        None
    };
    Ok(Prepared {
        vars,
        model,
        shard,
        reference,
    })
}

/// Every rank learns whether every rank got through `stage` (a flag all-reduced with Max),
/// so that a rank's failure ends every rank instead of leaving the others waiting in the
/// next collective. Returns this rank's own error first.
fn agree_stage<T>(
    comm: &Comm,
    device: &Device,
    stage: &str,
    local: Result<T, Failure>,
) -> Result<T, Failure> {
    let flag = Tensor::new(&[u32::from(local.is_err())], device)?;
    let any: Vec<u32> = nccl_candle::all_reduce(comm, &flag, ReduceOp::Max)?.to_vec1()?;
    let value = local?;
    match any.first() {
        Some(0) => Ok(value),
        _ => Err(Failure::Error(
            format!("another rank failed {stage} (its error says why)").into(),
        )),
    }
}

/// Refuses, on every rank, a job whose ranks were given different options (under a
/// launcher, each rank parses its own command line): a fingerprint of the options,
/// all-reduced with Max and with Min, must come back as this rank's own. Also the job's
/// first collective, which makes NCCL connect the ranks for small all-reduces before rank 0
/// keeps the others waiting in one (see [`session`]).
fn agree_options(comm: &Comm, device: &Device, options: &Options) -> Result<(), Failure> {
    let mut hasher = DefaultHasher::new();
    format!("{options:?}").hash(&mut hasher);
    let mine = hasher.finish() as i64;
    let local = Tensor::new(&[mine], device)?;
    let max: Vec<i64> = nccl_candle::all_reduce(comm, &local, ReduceOp::Max)?.to_vec1()?;
    let min: Vec<i64> = nccl_candle::all_reduce(comm, &local, ReduceOp::Min)?.to_vec1()?;
    if max != [mine] || min != [mine] {
        return Err(Failure::Usage(
            "the ranks were given different options".into(),
        ));
    }
    Ok(())
}

/// Everything between joining the communicator and leaving it. Returns the number of failed
/// checks, which every rank agrees on.
fn session(comm: &Comm, device: &Device, options: &Options, how: &str) -> Result<u32, Failure> {
    let (rank, world) = (comm.rank(), comm.size());
    let print = rank == 0;
    agree_options(comm, device, options)?;
    // Rank 0's reference runs here while the other ranks wait in the agreement.
    let prepared = prepare(comm, device, options, how);
    let Prepared {
        vars,
        model,
        mut shard,
        reference,
    } = agree_stage(comm, device, "to set up", prepared)?;
    broadcast_vars(comm, &vars, 0)?;
    let mut opt = DistributedOptimizer::with_bucket_bytes(
        comm,
        adamw(&vars, options.lr)?,
        &vars,
        options.bucket_bytes,
    )?;
    if print {
        println!(
            "gradients: {} bucket(s) of at most {} MiB, averaged with ncclAvg",
            opt.averager().buckets().len(),
            options.bucket_bytes >> 20
        );
    }

    let measured = train(&model, &mut opt, &mut shard, options, device)?;
    // The global loss of each step: the mean of the ranks' means (equal token counts).
    let local = Tensor::stack(&measured.losses, 0)?;
    let global: Vec<f32> = nccl_candle::all_reduce(comm, &local, ReduceOp::Avg)?.to_vec1()?;
    // The job is as fast as its slowest rank.
    let times = Tensor::new(
        &[measured.timed_s, measured.measured_s, measured.averaging_s],
        device,
    )?;
    let times: Vec<f64> = nccl_candle::all_reduce(comm, &times, ReduceOp::Max)?.to_vec1()?;
    if print {
        let params = sorted_vars(&vars).iter().map(|(_, v)| v.elem_count()).sum();
        report(options, params, world, &global, &times);
    }

    let mut verdicts = Verdicts { print, failed: 0 };
    if options.check {
        if let Some(reference) = &reference {
            let k = options.check_steps;
            let worst = largest_relative_difference(&global[..k], reference);
            verdicts.check(
                worst <= options.tolerance,
                format_args!(
                    "loss vs 1 GPU: steps 0..{k} of {world} ranks match rank 0 alone on the \
                     global batch, max relative difference {worst:.2e} (tolerance {:.0e}; \
                     step 0: {:.6} vs {:.6})",
                    options.tolerance, global[0], reference[0]
                ),
            );
        } else if print {
            println!("SKIP loss vs 1 GPU: one rank");
        }
        let (differing, len) = differing_values(comm, &vars, device)?;
        verdicts.check(
            differing == 0,
            format_args!(
                "parameters identical bit for bit on all {world} ranks after {} steps ({len} \
                 values each; differing, all ranks together: {differing})",
                options.steps
            ),
        );
        let initial = global[0] as f64;
        let last = &global[global.len() - FINAL_STEPS.min(global.len())..];
        let final_loss = last.iter().map(|&l| l as f64).sum::<f64>() / last.len() as f64;
        verdicts.check(
            final_loss <= LOSS_FALL * initial,
            format_args!(
                "loss fell from {initial:.4} (step 0) to {final_loss:.4} (mean of the last {} \
                 steps; at most {LOSS_FALL} x the first)",
                last.len()
            ),
        );
    }
    // Rank 0 alone judged the reference; every rank takes the largest count.
    let failed = Tensor::new(&[verdicts.failed], device)?;
    let failed: Vec<u32> = nccl_candle::all_reduce(comm, &failed, ReduceOp::Max)?.to_vec1()?;
    Ok(failed.first().copied().unwrap_or(0))
}

/// Rank 0's loss curve and results table.
fn report(options: &Options, params: usize, world: usize, global: &[f32], times: &[f64]) {
    let every = (options.steps / 10).max(1);
    let curve: Vec<String> = global
        .iter()
        .enumerate()
        .filter(|(step, _)| step % every == 0 || step + 1 == global.len())
        .map(|(step, loss)| format!("{step}: {loss:.4}"))
        .collect();
    println!("loss (global mean): {}", curve.join(", "));
    let config = options.size.config();
    let (timed_s, measured_s, averaging_s) = (times[0], times[1], times[2]);
    let timed_steps = options.steps - options.measure_steps - options.warmup;
    let tokens = (options.global_batch * config.seq * timed_steps) as f64;
    let step_ms = timed_s / timed_steps as f64 * 1e3;
    println!(
        "| model | params | ranks | global batch | steps | timed steps | tokens/s | step ms | \
         all-reduce ms | all-reduce share |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let (averaging, share) = match options.measure_steps {
        0 => ("-".to_string(), "not measured".to_string()),
        _ if world == 1 => ("0".to_string(), "0% (one rank)".to_string()),
        m => (
            format!("{:.3}", averaging_s / m as f64 * 1e3),
            format!(
                "{:.1}% (of {:.3} ms, last {m} steps)",
                100.0 * averaging_s / measured_s,
                measured_s / m as f64 * 1e3
            ),
        ),
    };
    println!(
        "| {} | {:.2} M | {world} | {} | {} | {timed_steps} (from step {}) | {:.0} | \
         {step_ms:.3} | {averaging} | {share} |",
        options.size.name(),
        params as f64 / 1e6,
        options.global_batch,
        options.steps,
        options.warmup,
        tokens / timed_s
    );
}

fn run(options: &Options) -> Result<(), Failure> {
    // Under a launcher this only reads the environment; without one it re-executes this
    // program once per extra GPU and makes this process rank 0.
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    let placement = job.placement().clone();
    options
        .validate_for(placement.world_size)
        .map_err(Failure::Usage)?;
    let ordinal = job.device()?;
    // candle's device and the communicator share one stream of their own (nccl-rs refuses
    // the per-thread default stream, which names another stream on each thread).
    let device = Device::new_cuda_with_stream(ordinal)?;
    let stream = device.as_cuda_device()?.cuda_stream();
    let comm = job.init_comm_on(stream)?;
    let rank = comm.rank();
    let how = format!(
        "{}{}",
        placement.launcher,
        if job.uses_mpi() { ", id over MPI" } else { "" }
    );

    let failed = session(&comm, &device, options, &how)?;

    drop(comm);
    let waited = job.wait();
    if failed > 0 {
        // The spawned ranks failed the same checks; report those, not their exit status.
        return Err(Failure::Checks {
            rank,
            count: failed,
        });
    }
    waited?;
    if rank == 0 {
        if options.check {
            println!("gpt_ddp: all checks passed");
        } else {
            println!("gpt_ddp: done (checks skipped)");
        }
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
            eprintln!("gpt_ddp: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(message)) => {
            eprintln!("gpt_ddp: {message}");
            ExitCode::from(2)
        }
        Err(err) => {
            eprintln!("gpt_ddp: {err}");
            ExitCode::FAILURE
        }
    }
}
