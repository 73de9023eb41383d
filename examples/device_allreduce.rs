//! A communicating kernel from Rust: an all-reduce written in CUDA C++ against NCCL's device
//! API (`device_allreduce/kernel.cu`: LSA barrier, peers' inputs read through load/store
//! pointers, summed, written, barrier), compiled at run time by `nvcc` with the loaded NCCL's
//! headers, launched with cudarc on symmetric windows, checked against a host reference on
//! random data for every size from 8 B to 1 MiB, and timed beside `ncclAllReduce` on the same
//! windows.
//!
//! ```text
//! cargo run --release --example device_allreduce               # 1 rank; one rank per GPU too on 2+ GPUs
//! NCCL_MULTI_RANK_GPU_ENABLE=1 cargo run --release --example device_allreduce
//!                                                              # also 2 ranks sharing GPU 0 (NCCL 2.30+)
//! ```
//!
//! All ranks live in this process (`Comm::init_all`), one stream each, driven by one thread:
//! two processes sharing a GPU would only time-slice, and a spinning barrier could stall.
//! Needs NCCL 2.29.2+ with its headers (found beside the library, or `NCCL_HOME` /
//! `NCCL_INCLUDE_DIR`) and `nvcc` (`NVCC`, `CUDA_HOME`, `/usr/local/cuda`, `PATH`). On an
//! older NCCL it prints `SKIPPED` with the typed error and exits 0; any failure prints
//! `FAILED` with the error and exits 1. Success ends with `device_allreduce: PASSED`.

#[path = "device_allreduce/lsa.rs"]
mod lsa;

use std::process::ExitCode;

use cudarc::driver::CudaContext;
use nccl::device::kernel::Toolchain;
use nccl::device::DEV_COMM_SINCE;
use nccl::{Comm, Version};

use lsa::Res;

/// NCCL's switch for two ranks on one GPU, and the first NCCL with it.
const MULTI_RANK_GPU: &str = "NCCL_MULTI_RANK_GPU_ENABLE";
const MULTI_RANK_GPU_SINCE: Version = Version::new(2, 30, 0);
/// Timed calls per size and operation.
const ITERS: usize = 50;

fn set_default(name: &str, value: &str) {
    if std::env::var_os(name).is_none() {
        std::env::set_var(name, value);
    }
}

enum Outcome {
    Passed(Vec<String>),
    Skipped(String),
}

fn run_shape(name: &str, devices: &[usize], toolchain: &Toolchain) -> Res<()> {
    let streams = devices
        .iter()
        .map(|&d| CudaContext::new(d).and_then(|ctx| ctx.new_stream()))
        .collect::<Result<Vec<_>, _>>()?;
    let comms = Comm::init_all(&streams)?;
    let props = comms[0].properties()?;
    println!(
        "\n== {name}: {} ranks; deviceApiSupport {}, multimemSupport {}, LSA teams {:?}, GIN {:?}",
        comms.len(),
        props.device_api_support,
        props.multimem_support,
        props.lsa_teams,
        props.gin_type
    );
    for line in lsa::refusals(&comms)? {
        println!("  {line}");
    }
    {
        let mut ranks = lsa::Ranks::new(&comms, toolchain)?;
        let lsa_size = ranks.check_one_lsa_team()?;
        println!(
            "  device communicators created: LSA team of {lsa_size}, {} LSA barriers, built for \
             {}",
            lsa::MAX_CTAS,
            toolchain.abi()
        );
        let sizes = lsa::sizes();
        for (i, &bytes) in sizes.iter().enumerate() {
            ranks.check(bytes, 0x5eed + i as u64)?;
        }
        println!(
            "  checked {} sizes, 8 B to 1 MiB, random data: the device kernel and ncclAllReduce \
             equal the host reference exactly on every rank",
            sizes.len()
        );
        println!(
            "  {:>9} {:>9} {:>18} {:>18}",
            "bytes", "floats", "device kernel µs", "ncclAllReduce µs"
        );
        for &bytes in &sizes {
            let (kernel, nccl) = ranks.timings(bytes, ITERS)?;
            println!("  {bytes:>9} {:>9} {kernel:>18.2} {nccl:>18.2}", bytes / 4);
        }
    }
    // Every rank ends the communicator here, together (one thread drives them all).
    drop(comms);
    Ok(())
}

fn run(shared: bool) -> Res<Outcome> {
    let lib = nccl::library::get()?;
    let gpus = nccl::library::cuda_device_count()?;
    println!(
        "device_allreduce: NCCL {} from {}, {gpus} GPU(s)",
        lib.version(),
        lib.path().display()
    );
    if let Err(err) = lib.require("device communicators (ncclDevCommCreate)", DEV_COMM_SINCE) {
        return Ok(Outcome::Skipped(err.to_string()));
    }
    let toolchain = Toolchain::find(lib)?;
    println!(
        "toolchain: {} with the NCCL {} headers of {} [{}]",
        toolchain.nvcc().display(),
        toolchain.headers().version(),
        toolchain.headers().dir().display(),
        toolchain.headers().source()
    );
    let mut shapes: Vec<(String, Vec<usize>)> = vec![("1 rank on GPU 0".into(), vec![0])];
    if !shared {
        println!("(2 ranks sharing GPU 0: set {MULTI_RANK_GPU}=1, NCCL {MULTI_RANK_GPU_SINCE}+)");
    } else if lib.version() < MULTI_RANK_GPU_SINCE {
        println!(
            "SKIPPED 2 ranks sharing GPU 0: needs NCCL {MULTI_RANK_GPU_SINCE}+, loaded {}",
            lib.version()
        );
    } else {
        shapes.push(("2 ranks sharing GPU 0".into(), vec![0, 0]));
    }
    if gpus >= 2 {
        shapes.push((format!("{gpus} ranks, one per GPU"), (0..gpus).collect()));
    } else {
        println!("(one rank per GPU needs 2+ GPUs; {gpus} here)");
    }
    let mut passed = Vec::new();
    for (name, devices) in shapes {
        run_shape(&name, &devices, &toolchain).map_err(|err| format!("{name}: {err}"))?;
        passed.push(name);
    }
    Ok(Outcome::Passed(passed))
}

fn main() -> ExitCode {
    // Before any communicator exists (NCCL reads these once): multicast stays off, and ranks
    // sharing a GPU connect everything at creation (a lazy connection made while the other
    // rank's kernel spins could wait for it).
    set_default("NCCL_NVLS_ENABLE", "0");
    let shared = std::env::var(MULTI_RANK_GPU)
        .ok()
        .and_then(|v| v.trim().parse::<i64>().ok())
        .is_some_and(|v| v != 0);
    if shared {
        set_default("NCCL_RUNTIME_CONNECT", "0");
        // Read by the CUDA driver when this process first uses CUDA: lazily loaded kernels can
        // wait for the other rank's collective (init_all refuses shared ranks without it).
        set_default("CUDA_MODULE_LOADING", "EAGER");
    }
    match run(shared) {
        Ok(Outcome::Passed(shapes)) => {
            println!("\ndevice_allreduce: PASSED ({})", shapes.join("; "));
            ExitCode::SUCCESS
        }
        Ok(Outcome::Skipped(why)) => {
            println!("device_allreduce: SKIPPED: {why}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("device_allreduce: FAILED: {err}");
            ExitCode::FAILURE
        }
    }
}
