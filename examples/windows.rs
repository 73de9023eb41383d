//! Symmetric memory windows: an all-reduce on a window, then a one-sided ring in which every
//! rank puts its data into the next rank's window and waits for the previous rank's, both
//! checked against the values every rank can compute on the host.
//!
//! Runs unchanged under `mpirun -np N`, `srun -n N`, a torchrun-style launcher, or with no
//! launcher at all, in which case it starts one process per visible GPU itself:
//!
//! ```text
//! cargo run --release --example windows                       # one process per local GPU
//! mpirun --allow-run-as-root -np 2 target/release/examples/windows
//! cargo run --release --example windows -- --elements 1048576
//! ```
//!
//! Windows need NCCL 2.27, one-sided RMA 2.29 and a CUDA 12.5 driver; where the library or
//! the system lacks them the example says so and skips that part.

use std::process::ExitCode;
use std::time::Duration;

use nccl::bootstrap::spawn_local;
use nccl::{Comm, NcclBuffer, ReduceOp, Signal, SignalWait, Window, WindowFlags};

/// Rank `rank`'s value at element `i` of the all-reduce input.
fn input(rank: usize, i: usize) -> f32 {
    (rank + 1 + i % 7) as f32
}

/// Rank `rank`'s value at element `i` of what it puts into the ring.
fn ring_value(rank: usize, i: usize) -> f32 {
    (rank * 1000 + i % 997) as f32
}

fn fail(rank: usize, what: &str, got: &[f32], want: impl Fn(usize) -> f32) -> nccl::Result<()> {
    match (0..got.len()).find(|&i| got[i] != want(i)) {
        None => Ok(()),
        Some(i) => Err(nccl::Error::InvalidUsage(format!(
            "rank {rank}: {what}: element {i} is {}, expected {}",
            got[i],
            want(i)
        ))),
    }
}

/// Registers a window of `len` elements, or says why this system has none.
fn register(comm: &Comm, len: usize) -> nccl::Result<Option<Window<'_, f32>>> {
    let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), len)?;
    match comm.register_window(buffer, WindowFlags::COLL_SYMMETRIC) {
        Ok(window) => Ok(Some(window)),
        Err(err) if err.error().is_unsupported() => {
            if comm.rank() == 0 {
                println!("no windows here: {}", err.error());
            }
            Ok(None)
        }
        Err(err) => Err(err.into()),
    }
}

fn symmetric_all_reduce(comm: &Comm, elements: usize) -> nccl::Result<bool> {
    let (rank, n) = (comm.rank(), comm.size());
    let Some(mut window) = register(comm, elements)? else {
        return Ok(false);
    };
    let stream = comm.stream();
    let data: Vec<f32> = (0..elements).map(|i| input(rank, i)).collect();
    stream.memcpy_htod(&data, &mut window)?;
    // A window is a buffer like any other for the collectives; NCCL picks its symmetric
    // kernels where they apply.
    comm.all_reduce_in_place(&mut window, ReduceOp::Sum)?;
    comm.synchronize_timeout(Duration::from_secs(60))?;
    let result = stream.clone_dtoh(&window)?;
    let base = (n * (n + 1) / 2) as f32;
    fail(rank, "symmetric all-reduce", &result, |i| {
        base + (n * (i % 7)) as f32
    })?;
    // Deregister (local) and get the buffer back.
    let buffer = window.close().map_err(|(_, err)| err)?;
    println!(
        "rank {rank}/{n}: all-reduce of {} f32 on a symmetric window verified",
        buffer.len()
    );
    Ok(true)
}

fn rma_ring(comm: &Comm, elements: usize) -> nccl::Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    if n < 2 {
        println!("rank {rank}: the RMA ring needs 2 ranks");
        return Ok(());
    }
    let version = comm.library().version();
    if version < nccl::window::rma::RMA_SINCE {
        if rank == 0 {
            println!("NCCL {version} has no one-sided RMA (2.29); skipping the ring");
        }
        return Ok(());
    }
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    // Elements [0, m) are what this rank sends, [m, 2m) receive the previous rank's.
    let Some(mut window) = register(comm, 2 * elements)? else {
        return Ok(());
    };
    let stream = comm.stream();
    let mine: Vec<f32> = (0..elements).map(|i| ring_value(rank, i)).collect();
    stream.memcpy_htod(&mine, &mut window.view_mut(0..elements)?)?;
    // One-sided: only the sender calls put_signal; the peer's window is named by this
    // rank's own handle of the collectively registered window.
    let sent = window.put_signal(
        &window.view(0..elements)?,
        next,
        elements,
        Signal::default(),
    );
    if let Err(err) = sent {
        if err.is_unsupported() {
            if rank == 0 {
                println!("no one-sided RMA here: {err}");
            }
            return Ok(());
        }
        return Err(err);
    }
    window.wait_signal(&[SignalWait::new(prev, 1)])?;
    // A wait for a signal that never comes would hang the stream: wait with a bound.
    comm.synchronize_timeout(Duration::from_secs(60))?;
    let got = stream.clone_dtoh(&window.view(elements..2 * elements)?)?;
    fail(rank, "RMA ring", &got, |i| ring_value(prev, i))?;
    println!("rank {rank}/{n}: received rank {prev}'s {elements} f32 by put_signal, verified");
    Ok(())
}

fn run(elements: usize) -> nccl::Result<()> {
    // Under a launcher this only reads the environment; without one it re-executes this
    // program once per extra GPU and makes this process rank 0.
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    let (comm, _stream) = job.init_comm()?;
    if comm.rank() == 0 {
        println!(
            "windows over {} ranks, NCCL {}",
            comm.size(),
            nccl::version()?
        );
    }
    if comm.library().version() < nccl::window::SYMMETRIC_SINCE {
        if comm.rank() == 0 {
            println!(
                "NCCL {}: symmetric windows need {} (earlier symmetric kernels could corrupt data)",
                nccl::version()?,
                nccl::window::SYMMETRIC_SINCE
            );
        }
    } else if symmetric_all_reduce(&comm, elements)? {
        rma_ring(&comm, elements)?;
    }
    drop(comm);
    job.wait()?;
    Ok(())
}

fn main() -> ExitCode {
    let mut elements = 1 << 20;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next().map(|v| v.parse::<usize>())) {
            ("--elements", Some(Ok(value))) if value > 0 => elements = value,
            _ => {
                eprintln!("usage: windows [--elements N]");
                return ExitCode::from(2);
            }
        }
    }
    match run(elements) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("windows: {err}");
            ExitCode::FAILURE
        }
    }
}
