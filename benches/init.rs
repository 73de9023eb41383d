//! The cost of creating a communicator: `Comm::init_rank` against the raw
//! `ncclCommInitRank` (what cudarc's `Comm::from_rank` calls, after binding the context), one
//! process per GPU, in the same processes, alternating which goes first in each round.
//!
//! ```text
//! cargo bench --bench init            # or, from a GPU bundle: .gpu/run benches/init
//! ```
//!
//! | variable | meaning |
//! | --- | --- |
//! | `NCCL_RS_INIT_ROUNDS` | rounds, each one raw and one safe creation (default 10) |
//! | `NCCL_RS_INIT_RANKS` | ranks (default: one per visible GPU; more than the GPUs needs a sharing shape's variables, e.g. `NCCL_HOSTID` per rank, which this bench does not set) |
//!
//! A creation is collective, so each round's time is the slowest rank's (its end waits for
//! every rank). Destroying is not timed. The process prints the median of each and the
//! ratio safe/raw.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use nccl::sys;
use nccl::{Comm, UniqueId};

const CHILD_ENV: &str = "NCCL_RS_INIT_BENCH_CHILD";
const IDS_ENV: &str = "NCCL_RS_INIT_BENCH_IDS";

fn main() {
    match std::env::var(CHILD_ENV) {
        Ok(spec) => child(&spec),
        Err(_) => parent(),
    }
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn parent() {
    let gpus = match CudaContext::device_count() {
        Ok(n) if n > 0 => n as usize,
        Ok(_) => return eprintln!("init: skipped, no GPU visible"),
        Err(e) => return eprintln!("init: skipped, no CUDA driver: {e}"),
    };
    let lib = match nccl::library::get() {
        Ok(lib) => lib,
        Err(e) => return eprintln!("init: skipped, NCCL does not load: {e}"),
    };
    let ranks = env_usize("NCCL_RS_INIT_RANKS").unwrap_or(gpus);
    let rounds = env_usize("NCCL_RS_INIT_ROUNDS").unwrap_or(10);
    println!(
        "init: {ranks} processes on {gpus} GPU(s), NCCL {} ({}), {rounds} rounds",
        lib.version(),
        lib.path().display()
    );
    // Two ids per round, made here so that no rank must wait for another's.
    let ids: Vec<String> = (0..2 * rounds)
        .map(|_| UniqueId::new().expect("ncclGetUniqueId").to_string())
        .collect();
    let exe = std::env::current_exe().expect("the bench's own path");
    let children: Vec<_> = (0..ranks)
        .map(|rank| {
            Command::new(&exe)
                .env(
                    CHILD_ENV,
                    format!("{rank},{ranks},{rounds},{}", rank % gpus),
                )
                .env(IDS_ENV, ids.join(","))
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    // times[variant][round]: the slowest rank's creation.
    let mut times = [vec![Duration::ZERO; rounds], vec![Duration::ZERO; rounds]];
    for mut child in children {
        let out = child.stdout.take().expect("piped");
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let mut fields = line.split_whitespace();
            if fields.next() != Some("INIT") {
                println!("{line}");
                continue;
            }
            let variant = usize::from(field(fields.next()) == "safe");
            let round: usize = field(fields.next()).parse().expect("round");
            let ns: u64 = field(fields.next()).parse().expect("ns");
            let time = &mut times[variant][round];
            *time = (*time).max(Duration::from_nanos(ns));
        }
        let status = child.wait().expect("wait for a rank");
        assert!(status.success(), "a rank failed: {status}");
    }
    let median = |v: &[Duration]| {
        let mut v = v.to_vec();
        v.sort_unstable();
        v[v.len() / 2]
    };
    let (raw, safe) = (median(&times[0]), median(&times[1]));
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "init: median of {rounds} rounds, slowest rank: raw ncclCommInitRank {:.2} ms, \
         Comm::init_rank {:.2} ms, safe/raw {:.3}",
        ms(raw),
        ms(safe),
        safe.as_secs_f64() / raw.as_secs_f64()
    );
    println!(
        "init: every round (raw, safe) ms: {}",
        times[0]
            .iter()
            .zip(&times[1])
            .map(|(r, s)| format!("({:.1}, {:.1})", ms(*r), ms(*s)))
            .collect::<Vec<_>>()
            .join(" ")
    );
}

/// The value of a `key=value` field.
fn field(f: Option<&str>) -> &str {
    f.and_then(|f| f.split('=').nth(1)).unwrap_or("")
}

fn child(spec: &str) {
    let parts: Vec<usize> = spec.split(',').map(|p| p.parse().expect("spec")).collect();
    let [rank, ranks, rounds, device] = parts[..] else {
        panic!("bad child spec {spec}")
    };
    let ids: Vec<UniqueId> = std::env::var(IDS_ENV)
        .expect("ids")
        .split(',')
        .map(|id| id.parse().expect("id"))
        .collect();
    let stream: Arc<CudaStream> = CudaContext::new(device)
        .and_then(|ctx| ctx.new_stream())
        .expect("a stream");
    let lib = nccl::library::get().expect("NCCL loads");
    for round in 0..rounds {
        // Alternate which variant goes first.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for variant in order {
            let id = ids[2 * round + variant];
            let start = Instant::now();
            let end: Box<dyn FnOnce()> = if variant == 0 {
                stream.context().bind_to_thread().expect("bind");
                let mut raw: sys::ncclComm_t = std::ptr::null_mut();
                let raw_id = sys::ncclUniqueId {
                    internal: id.into_bytes().map(|b| b as _),
                };
                // SAFETY: `raw` is a valid out-pointer; the id is passed by value.
                let status = unsafe {
                    lib.api()
                        .ncclCommInitRank(&mut raw, ranks as i32, raw_id, rank as i32)
                };
                assert_eq!(
                    status.expect("ncclCommInitRank"),
                    sys::ncclResult_t::ncclSuccess
                );
                Box::new(move || {
                    // SAFETY: the handle just made, used by nothing else.
                    let _ = unsafe { lib.api().ncclCommDestroy(raw) };
                })
            } else {
                let comm = Comm::init_rank(stream.clone(), &id, rank, ranks).expect("init_rank");
                Box::new(move || drop(comm))
            };
            let took = start.elapsed();
            end();
            println!(
                "INIT variant={} round={round} ns={}",
                ["raw", "safe"][variant],
                took.as_nanos()
            );
        }
    }
}
