//! All-reduce across every rank, with known data, verified and timed.
//!
//! Runs unchanged under `mpirun -np N`, `srun -n N`, a torchrun-style launcher, or with no
//! launcher at all, in which case it starts one process per visible GPU itself:
//!
//! ```text
//! cargo run --release --example allreduce                      # one process per local GPU
//! mpirun --allow-run-as-root -np 4 target/release/examples/allreduce
//! cargo run --release --example allreduce -- --elements 16777216 --iters 50
//! ```
//!
//! Rank `r` contributes `r + 1 + (i % 7)` at element `i`, so after a sum every element must
//! equal `n(n+1)/2 + n * (i % 7)` on every rank.

use std::process::ExitCode;
use std::time::Instant;

use nccl::bootstrap::spawn_local;
use nccl::ReduceOp;

struct Options {
    elements: usize,
    iters: usize,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        elements: 64 << 20, // 256 MiB of f32
        iters: 20,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<usize, String> {
            args.next()
                .ok_or_else(|| format!("{name} needs a value"))?
                .parse()
                .map_err(|e| format!("{name}: {e}"))
        };
        match arg.as_str() {
            "--elements" => options.elements = value("--elements")?,
            "--iters" => options.iters = value("--iters")?.max(1),
            "-h" | "--help" => {
                return Err("usage: allreduce [--elements N] [--iters N]".to_string());
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(options)
}

fn run(options: &Options) -> nccl::Result<()> {
    // Under a launcher this only reads the environment; without one it re-executes this
    // program once per extra GPU and makes this process rank 0.
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    let placement = job.placement().clone();
    let (comm, stream) = job.init_comm()?;
    let device = comm.device();
    let (rank, n) = (comm.rank(), comm.size());
    if rank == 0 {
        println!(
            "all-reduce of {} f32 ({} MiB) over {n} ranks ({}{}), NCCL {}",
            options.elements,
            (options.elements * 4) >> 20,
            placement.launcher,
            if job.uses_mpi() { ", id over MPI" } else { "" },
            nccl::version()?
        );
    }

    let input: Vec<f32> = (0..options.elements)
        .map(|i| (rank + 1 + i % 7) as f32)
        .collect();
    let send = stream.clone_htod(&input)?;
    let mut recv = stream.alloc_zeros::<f32>(options.elements)?;

    // Correctness first.
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
    comm.synchronize()?;
    let result = stream.clone_dtoh(&recv)?;
    let base = (n * (n + 1) / 2) as f32;
    let wrong = result
        .iter()
        .enumerate()
        .filter(|&(i, &v)| v != base + (n * (i % 7)) as f32)
        .count();
    if wrong > 0 {
        return Err(nccl::Error::InvalidUsage(format!(
            "rank {rank}: {wrong} of {} elements are wrong (first: {})",
            result.len(),
            result[0]
        )));
    }

    // Then speed: back-to-back launches timed between synchronisations, after a warm-up.
    // The warm-up's completion lines the ranks up, so no rank times its wait for the others.
    for _ in 0..3 {
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
    }
    comm.synchronize()?;
    let start = Instant::now();
    for _ in 0..options.iters {
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
    }
    comm.synchronize()?;
    let seconds = start.elapsed().as_secs_f64() / options.iters as f64;
    // Report the slowest rank's time, as the job is as fast as its slowest rank.
    let mut slowest = stream.clone_htod(&[seconds])?;
    comm.all_reduce_in_place(&mut slowest, ReduceOp::Max)?;
    let seconds = stream.clone_dtoh(&slowest)?[0];
    println!("rank {rank}/{n} on GPU {device}: result verified");
    if rank == 0 {
        let bytes = (options.elements * 4) as f64;
        let algbw = bytes / seconds / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        println!(
            "{:.1} us per all-reduce (slowest rank, {} iterations): algbw {algbw:.1} GB/s, busbw {busbw:.1} GB/s",
            seconds * 1e6,
            options.iters
        );
    }

    drop(comm);
    job.wait()?;
    Ok(())
}

fn main() -> ExitCode {
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("allreduce: {err}");
            ExitCode::FAILURE
        }
    }
}
