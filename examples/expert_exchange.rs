//! Mixture-of-experts dispatch and combine with `nccl::device::ExpertExchange`, timed in
//! CUDA graphs beside NCCL's `all_to_all_v` moving the same rows, in the same run.
//!
//! Every rank routes `--tokens` bf16 tokens of `--hidden` to `--top-k` of `--experts`
//! experts (uniformly, distinct per token), checks one dispatch and combine against the
//! host (the experts are the identity: each token must come back as the sum of its weights
//! times itself), then times, in CUDA graphs of `--iters` calls replayed back to back (the
//! ranks starting together): dispatches alone (back to back, a rank's next dispatch may
//! overlap its peers' copying out of the last: a floor for the dispatch), dispatch + combine
//! pairs (what a layer runs; combine = pair less dispatch), and `all_to_all_v` of the
//! dispatch's rows (tokens × top-k rows sent by destination, counts known on the host: the
//! payload NCCL moves for a dispatch, with none of the routing work). Times are device
//! times per call, the slowest rank's.
//!
//! Runs under `mpirun -np N` or alone (one process per visible GPU):
//!
//! ```text
//! cargo run --release --example expert_exchange                  # DeepEP's decode shape
//! cargo run --release --example expert_exchange -- --tokens 32 --hidden 4096 --experts 64
//! ```
//!
//! Ranks sharing a GPU time-slice it: such timings prove the harness, never speed.

use std::process::ExitCode;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use nccl::bootstrap::spawn_local;
use nccl::device::{ExchangePath, ExpertExchange, ExpertShape};
use nccl::{Comm, Error, Layout, ReduceOp};

struct Options {
    tokens: usize,
    hidden: usize,
    experts: usize,
    top_k: usize,
    iters: usize,
    path: ExchangePath,
}

fn parse_options() -> Result<Options, String> {
    let mut o = Options {
        tokens: 128,
        hidden: 7168,
        experts: 256,
        top_k: 8,
        iters: 20,
        path: ExchangePath::Auto,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<String, String> {
            args.next().ok_or_else(|| format!("{name} needs a value"))
        };
        let mut number = |name: &str| -> Result<usize, String> {
            value(name)?.parse().map_err(|e| format!("{name}: {e}"))
        };
        match arg.as_str() {
            "--tokens" => o.tokens = number("--tokens")?,
            "--hidden" => o.hidden = number("--hidden")?,
            "--experts" => o.experts = number("--experts")?,
            "--top-k" => o.top_k = number("--top-k")?,
            "--iters" => o.iters = number("--iters")?.max(1),
            "--path" => {
                o.path = match value("--path")?.as_str() {
                    "auto" => ExchangePath::Auto,
                    "lsa" => ExchangePath::Lsa,
                    "alltoallv" => ExchangePath::AllToAllV,
                    other => return Err(format!("--path {other:?}: auto, lsa or alltoallv")),
                }
            }
            "-h" | "--help" => {
                return Err(
                    "usage: expert_exchange [--tokens N] [--hidden N] [--experts N] \
                            [--top-k N] [--iters N] [--path auto|lsa|alltoallv]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(o)
}

/// SplitMix64: the routing's and the data's deterministic randomness.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `top_k` distinct experts for every token of `rank`.
fn routing(rank: usize, tokens: usize, experts: usize, top_k: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(tokens * top_k);
    for t in 0..tokens {
        let mut seed = mix(((rank as u64) << 32) | t as u64);
        let mut chosen: Vec<i32> = Vec::with_capacity(top_k);
        while chosen.len() < top_k {
            seed = mix(seed);
            let e = (seed % experts as u64) as i32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        out.extend(chosen);
    }
    out
}

/// Device time per call of `iters` calls captured by `issue` into a graph, replayed `launches`
/// times, in µs.
fn graph_time(
    comm: &Comm,
    stream: &std::sync::Arc<CudaStream>,
    iters: usize,
    launches: usize,
    mut issue: impl FnMut() -> nccl::Result<()>,
) -> nccl::Result<f64> {
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let issued = (0..iters).try_for_each(|_| issue());
    let captured = stream.end_capture(CUgraphInstantiate_flags(0));
    issued?;
    let graph = captured?.ok_or_else(|| Error::InvalidUsage("the capture made no graph".into()))?;
    graph.upload()?;
    graph.launch()?; // warm
    stream.synchronize()?;
    // The ranks start the timed launches together (a tiny all-reduce, waited for).
    let mut token: CudaSlice<f32> = stream.alloc_zeros(1)?;
    comm.all_reduce_in_place(&mut token, ReduceOp::Sum)?;
    stream.synchronize()?;
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (before, after) = (
        stream.context().new_event(flags)?,
        stream.context().new_event(flags)?,
    );
    before.record(stream)?;
    for _ in 0..launches {
        graph.launch()?;
    }
    after.record(stream)?;
    stream.synchronize()?;
    let ms = before.elapsed_ms(&after)?;
    Ok(f64::from(ms) * 1e3 / (iters * launches) as f64)
}

/// The slowest rank's value.
fn slowest(comm: &Comm, stream: &std::sync::Arc<CudaStream>, us: f64) -> nccl::Result<f64> {
    let mut v: CudaSlice<f32> = stream.clone_htod(&[us as f32])?;
    comm.all_reduce_in_place(&mut v, ReduceOp::Max)?;
    Ok(f64::from(stream.clone_dtoh(&v)?[0]))
}

fn run(o: &Options) -> nccl::Result<()> {
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    // A stream of its own: the default stream (`init_comm`'s) cannot be captured.
    let stream = cudarc::driver::CudaContext::new(job.device()?)?.new_stream()?;
    let comm = job.init_comm_on(stream.clone())?;
    let (rank, n) = (comm.rank(), comm.size());
    // Graph capture needs no cross-stream events: everything here runs on this stream.
    // SAFETY: every buffer below is used on `stream` only.
    unsafe { stream.context().disable_event_tracking() };
    let shape = ExpertShape::new(o.experts, o.top_k, o.hidden, o.tokens);
    let mut ex = ExpertExchange::<bf16>::new(&comm, shape, o.path)?;
    let (h, k, t) = (o.hidden, o.top_k, o.tokens);
    let route = routing(rank, t, o.experts, k);
    let x_host: Vec<bf16> = (0..t * h)
        .map(|i| bf16::from_f32((mix(i as u64 ^ rank as u64) % 17) as f32 - 8.0))
        .collect();
    let weights_host: Vec<f32> = (0..t * k).map(|i| [0.25, 0.5, 1.0, 2.0][i % 4]).collect();
    let x = stream.clone_htod(&x_host)?;
    let idx = stream.clone_htod(&route)?;
    let weights = stream.clone_htod(&weights_host)?;
    let rows = shape.received_rows(n) * h;
    let mut recv = stream.alloc_zeros::<bf16>(rows)?;
    let mut counts = stream.alloc_zeros::<i32>(ex.local_experts())?;
    let mut out = stream.alloc_zeros::<bf16>(t * h)?;

    // One checked round: identity experts, so out[t] = (sum of the weights) × x[t].
    let d = ex.dispatch(&x, &idx, &mut recv, &mut counts)?;
    ex.combine(d, &recv, &weights, &mut out)?;
    ex.check()?;
    let got = stream.clone_dtoh(&out)?;
    let wrong = (0..t * h)
        .filter(|&i| {
            let token = i / h;
            let mut acc = 0f32;
            for c in 0..k {
                acc = weights_host[token * k + c].mul_add(x_host[i].to_f32(), acc);
            }
            got[i] != bf16::from_f32(acc)
        })
        .count();
    if wrong > 0 {
        return Err(Error::InvalidUsage(format!(
            "rank {rank}: {wrong} combined values wrong"
        )));
    }

    let launches = 5;
    let path = ex.path();
    let (dispatch_us, pair_us) = if path == ExchangePath::Lsa {
        let d = graph_time(&comm, &stream, o.iters, launches, || {
            let handle = ex.dispatch(&x, &idx, &mut recv, &mut counts)?;
            drop(handle);
            Ok(())
        })?;
        let pair = graph_time(&comm, &stream, o.iters, launches, || {
            let handle = ex.dispatch(&x, &idx, &mut recv, &mut counts)?;
            ex.combine(handle, &recv, &weights, &mut out)
        })?;
        (Some(d), Some(pair))
    } else {
        (None, None)
    };
    ex.check()?;

    // all_to_all_v of the dispatch's rows: tokens × top-k rows by destination rank.
    let local = o.experts / n;
    let mut to = vec![0usize; n];
    for &e in &route {
        to[e as usize / local] += 1;
    }
    let from = comm.exchange_counts(&to)?.counts().to_vec();
    let send = stream.alloc_zeros::<bf16>(t * k * h)?;
    let mut back = stream.alloc_zeros::<bf16>(from.iter().sum::<usize>() * h + 1)?;
    let elements = |c: &[usize]| c.iter().map(|r| r * h).collect::<Vec<_>>();
    let a2a = graph_time(&comm, &stream, o.iters, launches, || {
        comm.all_to_all_v(
            &send,
            elements(&to),
            &mut back,
            Layout::packed(elements(&from)),
        )
    })?;

    let dispatch_us = dispatch_us
        .map(|v| slowest(&comm, &stream, v))
        .transpose()?;
    let pair_us = pair_us.map(|v| slowest(&comm, &stream, v)).transpose()?;
    let a2a = slowest(&comm, &stream, a2a)?;
    if rank == 0 {
        println!(
            "expert_exchange: {n} ranks, bf16, NCCL {}, {t} tokens/rank, hidden {h}, {} experts, \
             top-{k}, path {path:?}; device time per call in CUDA graphs ({} calls), slowest rank",
            nccl::version()?,
            o.experts,
            o.iters
        );
        println!(
            "{:>7} {:>7} {:>8} {:>6} {:>13} {:>18} {:>13} {:>18}",
            "tokens",
            "hidden",
            "experts",
            "top_k",
            "dispatch(us)",
            "disp+combine(us)",
            "combine(us)",
            "all_to_all_v(us)"
        );
        let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
        let combine = dispatch_us.zip(pair_us).map(|(d, p)| p - d);
        println!(
            "{t:>7} {h:>7} {:>8} {k:>6} {:>13} {:>18} {:>13} {:>18.1}",
            o.experts,
            show(dispatch_us),
            show(pair_us),
            show(combine),
            a2a
        );
    }
    drop(ex);
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
            eprintln!("expert_exchange: {err}");
            ExitCode::FAILURE
        }
    }
}
