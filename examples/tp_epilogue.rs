//! The tensor-parallel epilogue (all-reduce, residual add, RMSNorm) three ways, in device
//! time: NCCL's all-reduce on a symmetric window then the norm as a second kernel, the
//! shipped one-shot flags all-reduce then the same kernel, and the shipped fused kernel
//! (`LsaAllReduce::all_reduce_add_rms_norm` with `LsaEpilogue::Fused`). bf16, decode-sized
//! rows (hidden 4096 and 8192, 1 to 4 rows: 8 to 64 KiB per rank), one process per GPU,
//! each path captured `--iters` times in a CUDA graph and replayed `--launches` times between
//! two events, as nccl-tests' `-G` does; the slowest rank's time per call is reported. Every
//! path is first checked against the others on the same random inputs.
//!
//! ```text
//! cargo run --release --example tp_epilogue                  # one process per local GPU
//! mpirun -np 2 target/release/examples/tp_epilogue --iters 50 --launches 20
//! ```

use std::process::ExitCode;
use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use nccl::bootstrap::spawn_local;
use nccl::device::{LsaAlgorithm, LsaAllReduce, LsaEpilogue};
use nccl::{Comm, NcclBuffer, ReduceOp, Window, WindowFlags};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const EPS: f32 = 1e-5;
const SHAPES: [(usize, usize); 6] = [
    (1, 4096),
    (2, 4096),
    (4, 4096),
    (1, 8192),
    (2, 8192),
    (4, 8192),
];

struct Options {
    iters: usize,
    launches: usize,
}

fn parse() -> Result<Options, String> {
    let mut options = Options {
        iters: 20,
        launches: 20,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<usize, String> {
            args.next()
                .ok_or_else(|| format!("{name} needs a value"))?
                .parse::<usize>()
                .map_err(|e| format!("{name}: {e}"))
                .map(|v| v.max(1))
        };
        match arg.as_str() {
            "--iters" => options.iters = value("--iters")?,
            "--launches" => options.launches = value("--launches")?,
            "-h" | "--help" => return Err("usage: tp_epilogue [--iters N] [--launches N]".into()),
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(options)
}

/// Random bf16 in [-1, 1), the same for every rank's `seed`.
fn random(seed: u64, len: usize) -> Vec<bf16> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

/// One rank's buffers for one shape: `x` in a symmetric window (NCCL's symmetric kernels
/// need it there; the shipped kernels take any buffer).
struct Buffers<'c> {
    x: Window<'c, bf16>,
    residual: CudaSlice<bf16>,
    weight: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
}

/// The three paths.
const PATHS: [(&str, LsaEpilogue); 3] = [
    ("nccl", LsaEpilogue::Separate(LsaAlgorithm::Nccl)),
    ("flags", LsaEpilogue::Separate(LsaAlgorithm::OneShotFlags)),
    ("fused", LsaEpilogue::Fused),
];

fn issue(ar: &mut LsaAllReduce<'_, bf16>, b: &mut Buffers<'_>, how: LsaEpilogue) -> Res<()> {
    ar.all_reduce_add_rms_norm(&mut b.x, &mut b.residual, &b.weight, EPS, &mut b.out, how)?;
    Ok(())
}

/// Runs every path once on the same inputs; returns each path's (residual, out).
fn outputs(
    ar: &mut LsaAllReduce<'_, bf16>,
    stream: &Arc<CudaStream>,
    b: &mut Buffers<'_>,
    seed: u64,
) -> Res<Vec<(Vec<bf16>, Vec<bf16>)>> {
    let (len, hidden) = (b.out.len(), b.weight.len());
    let rank = ar.comm().rank() as u64;
    let mut all = Vec::new();
    for (_, how) in PATHS {
        stream.memcpy_htod(&random(seed * 31 + rank, len), &mut b.x)?;
        stream.memcpy_htod(&random(seed * 37, len), &mut b.residual)?;
        stream.memcpy_htod(&random(seed * 41, hidden), &mut b.weight)?;
        issue(ar, b, how)?;
        all.push((stream.clone_dtoh(&b.residual)?, stream.clone_dtoh(&b.out)?));
    }
    ar.check()?;
    Ok(all)
}

/// Device time per call of `how`: `iters` calls captured in a graph, replayed `launches`
/// times between two events.
fn time(
    ar: &mut LsaAllReduce<'_, bf16>,
    stream: &Arc<CudaStream>,
    b: &mut Buffers<'_>,
    how: LsaEpilogue,
    o: &Options,
) -> Res<f64> {
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let issued = (0..o.iters).try_for_each(|_| issue(ar, b, how));
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    issued?;
    let graph = graph?.ok_or("the capture made no graph")?;
    graph.upload()?;
    graph.launch()?;
    stream.synchronize()?;
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags)?;
    for _ in 0..o.launches {
        graph.launch()?;
    }
    let end = stream.record_event(flags)?;
    end.synchronize()?;
    let ms = start.elapsed_ms(&end)? as f64;
    ar.check()?;
    Ok(ms * 1e3 / (o.iters * o.launches) as f64)
}

/// The slowest rank's value.
fn slowest(comm: &Comm, stream: &Arc<CudaStream>, value: f64) -> Res<f64> {
    let mut buf = stream.clone_htod(&[value])?;
    comm.all_reduce_in_place(&mut buf, ReduceOp::Max)?;
    Ok(stream.clone_dtoh(&buf)?[0])
}

fn run(o: &Options) -> Res<u32> {
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    let stream = CudaContext::new(job.device()?)?.new_stream()?;
    // Graph capture with no cross-stream events: all of this process's work is on `stream`.
    // SAFETY: every buffer below is made after this and used on `stream` only.
    unsafe { stream.context().disable_event_tracking() };
    let comm = job.init_comm_on(stream.clone())?;
    let (rank, n) = (comm.rank(), comm.size());
    let max = SHAPES.iter().map(|(r, h)| r * h).max().unwrap_or(1);
    let mut ar = LsaAllReduce::<bf16>::new(&comm, max)?;
    if rank == 0 {
        println!(
            "tp_epilogue: {n} ranks, NCCL {}, bf16, eps {EPS}; device time per call in CUDA \
             graphs ({} calls x {} replays), slowest rank",
            comm.library().version(),
            o.iters,
            o.launches
        );
        println!("| rows x hidden | KiB per rank | NCCL AR + norm (us) | flags AR + norm (us) | fused (us) | fused vs NCCL | max diff fused vs NCCL |");
        println!("|---|---|---|---|---|---|---|");
    }
    let mut failed = 0;
    for (seed, &(rows, hidden)) in SHAPES.iter().enumerate() {
        let len = rows * hidden;
        let x = comm
            .register_window(
                NcclBuffer::alloc_zeros(&stream, len)?,
                WindowFlags::COLL_SYMMETRIC,
            )
            .map_err(nccl::Error::from)?;
        let mut b = Buffers {
            x,
            residual: stream.alloc_zeros(len)?,
            weight: stream.alloc_zeros(hidden)?,
            out: stream.alloc_zeros(len)?,
        };
        let results = outputs(&mut ar, &stream, &mut b, seed as u64 + 1)?;
        // Every path rounds where the separate sequence rounds; with two ranks NCCL's bf16 sum
        // rounds once too, so all three agree bit for bit; with more, NCCL's summation order
        // may differ in the last bit of a sum.
        let diff = |a: &[bf16], b: &[bf16]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x.to_f32() - y.to_f32()).abs())
                .fold(0f32, f32::max)
        };
        let (nccl_res, nccl_out) = &results[0];
        let mut worst = 0f32;
        for (res, out) in &results[1..] {
            worst = worst.max(diff(nccl_res, res)).max(diff(nccl_out, out));
        }
        let scale = nccl_out
            .iter()
            .map(|v| v.to_f32().abs())
            .fold(1f32, f32::max);
        let tolerance = if n == 2 { 0.0 } else { 0.02 * scale };
        let worst = slowest(&comm, &stream, worst as f64)?;
        let bad = worst > tolerance as f64 || !worst.is_finite();
        let mut times = Vec::new();
        for (_, how) in PATHS {
            let us = time(&mut ar, &stream, &mut b, how, o)?;
            times.push(slowest(&comm, &stream, us)?);
        }
        if rank == 0 {
            println!(
                "| {rows} x {hidden} | {} | {:.2} | {:.2} | {:.2} | {:.2}x | {worst:.3e}{} |",
                len * 2 / 1024,
                times[0],
                times[1],
                times[2],
                times[0] / times[2],
                if bad { " FAIL" } else { "" }
            );
        }
        failed += u32::from(bad);
    }
    drop(ar);
    drop(comm);
    job.wait()?;
    Ok(failed)
}

fn main() -> ExitCode {
    let options = match parse() {
        Ok(o) => o,
        Err(message) => {
            eprintln!("tp_epilogue: {message}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(bad) => {
            eprintln!("tp_epilogue: {bad} shape(s) disagreed between the paths");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("tp_epilogue: {err}");
            ExitCode::FAILURE
        }
    }
}
