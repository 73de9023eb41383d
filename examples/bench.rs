//! An nccl-tests compatible benchmark of nccl-rs: same flags, same columns, same formulas, one
//! process per GPU, and the same operations issued through raw nccl-sys calls for a baseline
//! measured in the same process.
//!
//! Past 600 lines: about a third is this manual; the rest is the run's orchestration (job,
//! registrations, --versus, types, cells), one flow read top to bottom. The pieces live in
//! `bench/`.
//!
//! ```text
//! cargo run --release --example bench -- all_reduce -b 8 -e 1G -f 2       # every local GPU
//! cargo run --release --example bench -- all_reduce -b 8 -e 1G -f 2 --compare --rounds 3
//! cargo run --release --example bench -- all_gather -b 1M -e 512M -f 4 --ranks 2
//! cargo run --release --example bench -- all_reduce -b 8 -e 8 -n 1000 -G 10 --compare
//! cargo run --release --example bench -- all_reduce -b 8 -e 1M -f 4 -n 1000 --latency
//! cargo run --release --example bench -- all_reduce -b 8 -e 64M -f 2 -R 2 --compare
//! cargo run --release --example bench -- alltoall -b 8 -e 64M -f 2 --registration-compare
//! cargo run --release --example bench -- --rma -b 8 -e 64M -f 2 --compare
//! cargo run --release --example bench -- all_to_all_v -b 8 -e 512M -f 2 --splits zipf:1.1 --compare
//! cargo run --release --example bench -- all_to_all_v -b 8 -e 512M -f 2 --splits even --versus alltoall
//! cargo run --release --example bench -- all_gather_v -b 1M -e 512M -f 4 --splits zipf:1.1 --construction p2p --compare
//! mpirun -np 4 target/release/examples/bench all_reduce -b 8 -e 1G -f 2
//! ```
//!
//! # Placement
//!
//! Under a launcher (`mpirun`, `srun`, torchrun-style variables) every process is one rank;
//! without one, the program starts one process per visible GPU itself (or `--ranks N`) with
//! [`nccl::bootstrap::spawn_local`]. The unique id travels through the bootstrap's rendezvous
//! (TCP, or a file on one machine), never through MPI. Only rank 0 prints.
//!
//! # What is measured
//!
//! For every element type (`-d`) and reduction (`-o`), nccl-tests' sequence: warm-up at the
//! largest and at the smallest size (`-w` operations each), then for every size, out of place
//! and then in place: one operation and a wait, a barrier, then `-n` operations issued back to
//! back, timed on the host from the first issue until the stream is idle (polled with
//! `cuStreamQuery`, as nccl-tests does). The time per operation is that time over `-n`; the
//! reported time is the mean over ranks (nccl-tests' default `-a 1`; `-a 0/2/3`: rank 0's,
//! the smallest, the largest). As in nccl-tests, successive iterations use buffers shifted
//! through the whole allocation (`size * (iter % (maxbytes / size))`), and buffers come from
//! `ncclMemAlloc` (`--alloc cuda` for cudarc's allocator).
//!
//! * `-G N` (graph mode): the `-n` operations are captured into a CUDA graph (thread-local
//!   capture mode, as nccl-tests), instantiated and uploaded, then replayed `N` times back to
//!   back; time per operation = elapsed / (`n` * `N`). This mode runs on a stream of its own
//!   (the legacy default stream cannot be captured) with cudarc's event tracking turned off:
//!   its waits on events recorded outside the capture would invalidate it.
//!
//! Every rank runs on its GPU's default stream, as [`nccl::bootstrap::LocalJob::init_comm`]
//! sets up programs; cudarc then keeps no per-buffer events. `--stream own` runs on a stream
//! of its own instead, which switches cudarc's event tracking on (`--event-tracking 0` turns
//! it off again): the cost a program with several streams pays.
//! * `--latency`: each of the `-n` operations is bracketed by CUDA events; the columns show the
//!   median and the 99th percentile of the per-call device times, and the bandwidths follow
//!   the median.
//! * `-C 1`: the time column shows the host time spent issuing instead (the bandwidths still
//!   follow the completion time), as nccl-tests does.
//!
//! `--raw` issues every operation as `comm.library().api().ncclAllReduce(...)` on
//! `Comm::as_raw()` and raw device pointers of the same buffers, which is what nccl-tests'
//! `all_reduce_perf` does; `--compare` runs both, alternately, and prints them side by side
//! with the difference in percent, the safe/raw ratio of times below 1 MiB and of bus
//! bandwidths from 1 MiB (`--rounds N` repeats each measurement and reports the median).
//! `--control` makes both columns issue raw calls: what that comparison reports is the
//! measurement's own spread, the yardstick for the safe/raw differences.
//!
//! `--simulate` adds, after each row, a comment line (`#`, so parsers of nccl-tests' output
//! skip it) with NCCL's own estimate of the operation's time: every rank simulates the
//! same operation in a [`nccl::Group::simulate`] (`ncclGroupSimulateEnd`, NCCL 2.22;
//! nothing is launched) and rank 0 prints the estimate beside the measured time (the first
//! API's column) and their ratio, out of place and in place. Point-to-point operations and
//! those built from it, the v-collectives and the put_signal ring have no estimate.
//!
//! # Registered buffers (`-R`) and one-sided RMA (`--rma`)
//!
//! `-R 1` registers both buffers with `Comm::register` (`ncclCommRegister`) and passes the
//! registrations where the buffers would go; `-R 2` registers each as a symmetric window
//! (`Comm::register_window` with `WindowFlags::COLL_SYMMETRIC`, as nccl-tests' `-R 2` calls
//! `ncclCommWindowRegister` on its send and receive buffers) and issues every operation on
//! window views at the shifted offsets, which are the same on every rank. The raw path
//! issues its calls on the same registered memory, with the same pointers. `-R 2` needs
//! NCCL `nccl::window::SYMMETRIC_SINCE` (2.28.7): on older libraries the run says so and
//! exits 0. `--registration-compare` measures the whole sweep with `-R 0` and then with
//! `-R 2` and prints the speedup of `-R 2` (time(-R 0) / time(-R 2)) for every row.
//!
//! `--rma` (the collective `put_signal`) times a one-sided ring on symmetric windows
//! (NCCL 2.29): each operation is one `Window::put_signal` of `size` bytes from the send
//! window into the next rank's receive window, at the same offset, followed by a
//! `Window::wait_signal` for the previous rank's signal; busbw = algbw = size / time. The
//! raw path calls `ncclPutSignal` and `ncclWaitSignal` on the same windows.
//!
//! # Sizes and bandwidths (nccl-tests' conventions)
//!
//! The size is the bytes of the whole buffer: for all_reduce, broadcast, reduce and sendrecv
//! the buffer each rank sends and receives; for all_gather the receive buffer (each rank sends
//! size/n); for reduce_scatter the send buffer (each rank receives size/n); for alltoall either
//! buffer (size/n per peer). It is rounded down to whole elements, and to multiples of n
//! elements where it is split. "count" is NCCL's count argument (per rank for all_gather,
//! reduce_scatter, alltoall). algbw = size / time; busbw = algbw × 2(n−1)/n for all_reduce,
//! × (n−1)/n for all_gather, reduce_scatter and alltoall, × 1 for broadcast, reduce, sendrecv
//! and put_signal.
//! alltoall is NCCL's own `ncclAlltoAll` (NCCL 2.28) rather than nccl-tests' send/receive
//! loop; alltoall, sendrecv and put_signal have no in-place columns (NCCL has no in-place
//! all-to-all, and the safe API cannot send from and receive into one buffer at once).
//!
//! # Variable-size collectives
//!
//! `all_to_all_v`, `all_gather_v` and `reduce_scatter_v` take the sizes of alltoall,
//! all_gather and reduce_scatter; `--splits even|zipf:S` and `--seed` give the split matrix
//! (`bench/splits.rs`, the same on every rank and in `benches/torch_all_to_all_single.py`).
//! busbw = B / time, B the bytes the busiest rank sends to or receives from the other ranks
//! (with even splits: size × (n−1)/n, the fixed-size collective's busbw). The raw path
//! builds the same NCCL calls in one group (`bench/vops.rs`); `--versus alltoall` measures
//! alltoall first on the same sizes and prints time(alltoall) / time(all_to_all_v).
//!
//! # Check
//!
//! With `-c N` (default 1), after the timing of every cell the operation runs once more on
//! known inputs: rank r's element i is a small integer drawn from (r, i) (ones and twos for
//! products), so every result is exact; outputs are zeroed first and no correct value is 0.
//! Every rank compares its output with the expected values computed on the host (integers
//! exactly, floating-point types within a few rounding steps) and "#wrong" is the number of
//! wrong elements over all ranks. Any wrong element makes the program exit with status 1.

#[path = "bench/args.rs"]
mod args;
#[path = "bench/coll.rs"]
mod coll;
#[path = "bench/elem.rs"]
mod elem;
#[path = "bench/lsa.rs"]
mod lsa;
#[path = "bench/measure.rs"]
mod measure;
#[path = "bench/ops.rs"]
mod ops;
#[path = "bench/plot.rs"]
mod plot;
#[path = "bench/rank.rs"]
mod rank;
#[path = "bench/report.rs"]
mod report;
#[path = "bench/splits.rs"]
mod splits;
#[path = "bench/vops.rs"]
mod vops;

use std::process::ExitCode;
use std::sync::OnceLock;

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::CudaContext;
use nccl::bootstrap::{spawn_local, BootstrapError};
use nccl::{DataType, NcclBuffer, ReduceOp, Version};

use args::{Alloc, Apis, Average, Mode, Options, Parsed, RegisterMode};
use coll::{Coll, Pattern};
use elem::{dispatch, Elem, TypeVisitor};
use measure::{Op, Timing};
use ops::{Api, Buffers, Issuer};
use rank::Rank;
use report::{Measured, Report, Row};

/// The error type of the whole benchmark.
pub type BenchResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// This process's rank, once known (for error messages).
static RANK: OnceLock<usize> = OnceLock::new();

fn main() -> ExitCode {
    let options = match args::parse(std::env::args().skip(1)) {
        Ok(Parsed::Run(options)) => options,
        Ok(Parsed::Help) => {
            println!("{}", args::usage());
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("bench: {message}\n\n{}", args::usage());
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(true) => ExitCode::SUCCESS,
        // Wrong results: rank 0 has reported them and fails; the others end normally, so a
        // local job's supervisor does not cut rank 0's report short.
        Ok(false) if RANK.get().copied().unwrap_or(0) == 0 => ExitCode::FAILURE,
        Ok(false) => ExitCode::SUCCESS,
        Err(err) => {
            match RANK.get() {
                Some(rank) => eprintln!("bench (rank {rank}): {err}"),
                None => eprintln!("bench: {err}"),
            }
            ExitCode::FAILURE
        }
    }
}

/// Starts or joins the job, runs the benchmark, and returns whether every result was right.
fn run(options: &Options) -> BenchResult<bool> {
    // Both fail with a clear message on a machine without GPUs or without NCCL, before any
    // process is started.
    let gpus = nccl::library::cuda_device_count()?;
    nccl::library::get()?;

    let job = spawn_local(options.ranks.unwrap_or(gpus))?;
    let _ = RANK.set(job.placement().rank);
    // GPU of the local rank, a stream on it, the unique id through the bootstrap's
    // rendezvous, and the communicator.
    // The GPU's default stream, as `init_comm` gives every program, unless a stream of its
    // own was asked for; graph capture needs one (the legacy default stream cannot be
    // captured).
    let own_stream = options.own_stream || options.mode() == Mode::Graph;
    let (comm, stream) = if own_stream {
        let stream = CudaContext::new(job.device()?)?.new_stream()?;
        (job.init_comm_on(stream.clone())?, stream)
    } else {
        job.init_comm()?
    };
    if !options.event_tracking || options.mode() == Mode::Graph {
        // SAFETY: this process runs all its device work on this one stream, so there is no
        // cross-stream order for the events to enforce; buffers (all allocated after this
        // point, so without events) are released in stream order or after a stream
        // synchronisation, once their last use is enqueued.
        unsafe { stream.context().disable_event_tracking() };
    }
    // cudarc waits on and records a buffer's events only when its context has streams of
    // its own and tracking is on.
    let tracking = stream.context().is_managing_stream_synchronization();
    let device = stream.context().ordinal();
    let rank = Rank::new(comm, stream, device)?;

    let outcome = benchmark(&rank, options, tracking, job.spawned());
    drop(rank);
    match outcome {
        Ok(all_right) => match job.wait() {
            Ok(()) => Ok(all_right),
            Err(BootstrapError::ChildFailed {
                rank, exit_code, ..
            }) => Err(format!("local rank {rank} failed (exit code {exit_code})").into()),
            Err(err) => Err(err.into()),
        },
        // Dropping the job stops the ranks it started, which may wait for this one forever.
        Err(err) => {
            drop(job);
            Err(err)
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".to_string())
}

/// Why this library cannot run `register` (or the put ring), if it cannot: the run then
/// says so and ends successfully, as nccl-tests does for what a library lacks.
fn unsupported(rank: &Rank, coll: Coll, register: RegisterMode) -> Option<String> {
    let found = rank.comm.library().version();
    let needs = |api: &str, needs: Version| {
        (found < needs).then(|| format!("{api} needs NCCL {needs}; this is NCCL {found}"))
    };
    let mut why = match register {
        RegisterMode::None => None,
        RegisterMode::Local => needs("-R 1 (ncclCommRegister)", Version::new(2, 19, 0)),
        RegisterMode::Window => needs(
            "-R 2 (symmetric windows, nccl::window::SYMMETRIC_SINCE)",
            nccl::window::SYMMETRIC_SINCE,
        ),
    };
    if why.is_none() && coll == Coll::PutSignal {
        why = needs("--rma (ncclPutSignal)", nccl::window::rma::RMA_SINCE);
        // Libraries without the query (before 2.29.4) leave it to the first put to say.
        let host_rma = rank.comm.properties().ok().and_then(|p| p.host_rma_support);
        if why.is_none() && host_rma == Some(false) {
            why = Some(
                "--rma: this communicator has no host RMA support (hostRmaSupport = 0)".to_string(),
            );
        }
    }
    why
}

/// `path` with `-<suffix>` before its extension, for the files of a run that measures two
/// sweeps (`--registration-compare`: `R0`, `R2`; `--versus`: the collective's name).
fn suffixed(path: &std::path::Path, suffix: Option<&str>) -> std::path::PathBuf {
    let Some(suffix) = suffix else {
        return path.to_path_buf();
    };
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}-{suffix}.{}", ext.to_string_lossy()),
        None => format!("{stem}-{suffix}"),
    };
    path.with_file_name(name)
}

/// Runs every registration (`-R`, or both of `--registration-compare`), type and
/// reduction; prints and writes the results on rank 0.
fn benchmark(rank: &Rank, options: &Options, tracking: bool, spawned: usize) -> BenchResult<bool> {
    if let Some(versus) = options.versus {
        return benchmark_versus(rank, options, versus, tracking, spawned);
    }
    let mut reports = Vec::new();
    for register in options.registrations() {
        if let Some(why) = unsupported(rank, options.coll, register) {
            if rank.rank() == 0 {
                println!("# {why}: not measured");
            }
            continue;
        }
        let suffix = options
            .registration_compare
            .then(|| format!("R{}", register.flag()));
        reports.push(benchmark_registered(
            rank,
            options,
            tracking,
            spawned,
            register,
            suffix.as_deref(),
        )?);
    }
    if let [base, windows] = &reports[..] {
        if rank.rank() == 0 {
            print!(
                "{}",
                report::speedup(
                    base,
                    windows,
                    "-R 0",
                    &format!("-R {}", windows.register.flag())
                )
            );
        }
    }
    Ok(reports.iter().all(|report| report.failures() == 0))
}

/// `--versus`: the fixed-size collective `versus` and then the one asked for, on the same
/// sizes, types and buffers' registration, and the ratio of their times row by row (for
/// `all_to_all_v --splits even --versus alltoall`: what the variable-size path costs at
/// equal bytes).
fn benchmark_versus(
    rank: &Rank,
    options: &Options,
    versus: Coll,
    tracking: bool,
    spawned: usize,
) -> BenchResult<bool> {
    let reference = Options {
        coll: versus,
        versus: None,
        construction: nccl::Construction::Auto,
        ..options.clone()
    };
    let register = options.register.unwrap_or(RegisterMode::None);
    let mut reports = Vec::new();
    for options in [&reference, options] {
        if let Some(why) = unsupported(rank, options.coll, register) {
            if rank.rank() == 0 {
                println!("# {why}: not measured");
            }
            return Ok(true);
        }
        let name = options.coll.name();
        reports.push(benchmark_registered(
            rank,
            options,
            tracking,
            spawned,
            register,
            Some(name),
        )?);
    }
    if let [base, it] = &reports[..] {
        if rank.rank() == 0 {
            print!(
                "{}",
                report::speedup(base, it, versus.name(), options.coll.name())
            );
        }
    }
    Ok(reports.iter().all(|report| report.failures() == 0))
}

/// Runs every type and reduction on buffers registered as `register` says; prints and
/// writes the results on rank 0.
fn benchmark_registered(
    rank: &Rank,
    options: &Options,
    tracking: bool,
    spawned: usize,
    register: RegisterMode,
    file_suffix: Option<&str>,
) -> BenchResult<Report> {
    let (me, n) = (rank.rank(), rank.size());
    let own_stream = options.own_stream || options.mode() == Mode::Graph;
    if options.coll.has_root() && options.root >= n {
        return Err(format!("root {} is out of range for {n} ranks (-r)", options.root).into());
    }
    let ctx = rank.context().clone();
    let line = format!(
        "#  Rank {me:>2} Group  0 Pid {:>6} on {:>10} device {:>2} [0x{:02x}] {}",
        std::process::id(),
        hostname(),
        rank.device,
        ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
        ctx.name()?
    );
    let devices = rank.gather_lines(&line)?;

    // Send and receive buffers of maxBytes each, plus room for everything else (as
    // nccl-tests limits it; the check runs on the host and needs no third buffer).
    let memory = rank.combine(ctx.total_mem()? as f64, Average::Min)?;
    let limit = ((memory - (1u64 << 30) as f64) / 2.0).max(0.0) as usize;
    let max_bytes = options.max_bytes.min(limit);

    let lib = rank.comm.library();
    let mode = options.mode();
    // ncclMemAlloc arrived in NCCL 2.19; older libraries get cudarc's memory, as nccl-tests
    // falls back to cudaMalloc.
    let alloc = if lib.version() >= nccl::Version::new(2, 19, 0) {
        options.alloc
    } else {
        Alloc::Cuda
    };
    let apis_name = match options.apis {
        Apis::Safe => "the safe API",
        Apis::Raw => "raw nccl-sys calls",
        Apis::Compare => "the safe API and raw nccl-sys calls",
        Apis::Lsa(algorithm) => match lsa::name(algorithm) {
            "flags" if options.coll == Coll::AllGather => {
                "NCCL (safe API) and nccl-rs's LL all-gather kernel"
            }
            "flags" => "NCCL (safe API) and nccl-rs's one-shot flags kernel",
            "barrier" => "NCCL (safe API) and nccl-rs's one-shot LSA-barrier kernel",
            "twoshot" => "NCCL (safe API) and nccl-rs's two-shot flags kernel",
            _ => "NCCL (safe API) and nccl-rs's kernels chosen by size",
        },
    };
    if me == 0 {
        println!(
            "# nccl-rs {} bench: {} through {apis_name}, {} mode, one process per GPU",
            env!("CARGO_PKG_VERSION"),
            options.coll.name(),
            report::mode_name(mode),
        );
        println!(
            "# NCCL {} ({}); buffers from {}; cudarc event tracking {}; {}",
            lib.version(),
            lib.path().display(),
            match alloc {
                Alloc::Nccl => "ncclMemAlloc",
                Alloc::Cuda => "cudarc",
            },
            match (tracking, own_stream) {
                (true, _) => "on",
                (false, true) => "off",
                (false, false) => "inactive (default stream only)",
            },
            if spawned > 0 {
                format!("started {spawned} local ranks")
            } else {
                "ranks from the launcher".to_string()
            }
        );
        println!("# buffers {}", register.describe());
        if register == RegisterMode::Window && (!own_stream || tracking) {
            // Measured on H200 (README): each of these doubled small symmetric all-reduces.
            println!(
                "# note: NCCL's symmetric kernels lose programmatic dependent launch on the legacy \
                 default stream, and cudarc's event tracking adds a record and a wait per buffer \
                 per call; --stream own --event-tracking 0 is how nccl-tests -R 2 runs"
            );
        }
        if options.coll.is_v() {
            println!(
                "# splits {} seed {} construction {:?}; busbw = bytes the busiest rank sends \
                 to or receives from the others / time",
                options.splits, options.seed, options.construction
            );
        }
        if options.control {
            println!(
                "# control run (--control): the \"safe\" column issues raw calls too; the \
                 difference between the columns is the comparison's own"
            );
        }
        let step = if options.step_factor > 1 {
            format!("{}(factor)", options.step_factor)
        } else {
            format!("{}(bytes)", options.step_bytes)
        };
        println!(
            "# nRanks {n} minBytes {} maxBytes {} step: {step} warmup iters: {} iters: {} agg iters: 1 validation: {} graph: {}",
            options.min_bytes, options.max_bytes, options.warmup, options.iters, options.check, options.graph_launches
        );
        println!("#\n# Using devices");
        for device in &devices {
            println!("{device}");
        }
        if max_bytes < options.max_bytes {
            println!("#\n# Reducing maxBytes to {max_bytes} due to memory limitation");
        }
        println!("#");
    }

    let mut report = Report {
        coll: options.coll,
        register,
        mode,
        apis: options.apis,
        ranks: n,
        cputime: options.cputime,
        rows: Vec::new(),
    };
    if me == 0 {
        print!("{}", report.header());
    }
    for &dtype in &options.dtypes {
        dispatch(
            dtype,
            TypeRun {
                rank,
                options,
                report: &mut report,
                max_bytes,
                alloc,
                register,
                dtype,
            },
        )
        .ok_or_else(|| format!("no element type for {dtype:?}"))??;
    }

    if me == 0 {
        print!("{}", report.footer());
        let meta = serde_json::json!({
            "collective": options.coll.name(),
            "mode": report::mode_name(mode),
            "apis": format!("{:?}", options.apis).to_lowercase(),
            "ranks": n,
            "nccl_version": lib.version().to_string(),
            "nccl_library": lib.path().display().to_string(),
            "nccl_rs_version": env!("CARGO_PKG_VERSION"),
            "alloc": format!("{alloc:?}").to_lowercase(),
            "registration": register.flag(),
            "splits": options.coll.is_v().then(|| options.splits.to_string()),
            "seed": options.coll.is_v().then_some(options.seed),
            "construction": options
                .coll
                .is_v()
                .then(|| format!("{:?}", options.construction).to_lowercase()),
            "event_tracking": tracking,
            "own_stream": own_stream,
            "min_bytes": options.min_bytes,
            "max_bytes": max_bytes,
            "step_factor": options.step_factor,
            "step_bytes": options.step_bytes,
            "iters": options.iters,
            "warmup_iters": options.warmup,
            "graph_launches": options.graph_launches,
            "rounds": options.rounds,
            "average": format!("{:?}", options.average).to_lowercase(),
            "devices": devices,
        });
        if let Some(path) = &options.json {
            report::write_file(&suffixed(path, file_suffix), &report.json(meta))?;
        }
        if let Some(path) = &options.csv {
            report::write_file(&suffixed(path, file_suffix), &report.csv())?;
        }
        if let Some(path) = &options.plot {
            let title = format!(
                "{} bus bandwidth, {n} ranks, {} mode, -R {}, NCCL {}",
                options.coll.name(),
                report::mode_name(mode),
                register.flag(),
                lib.version()
            );
            report::write_file(&suffixed(path, file_suffix), &plot::svg(&report, &title)?)?;
        }
    }
    Ok(report)
}

/// The benchmark for one element type.
struct TypeRun<'a> {
    rank: &'a Rank,
    options: &'a Options,
    report: &'a mut Report,
    max_bytes: usize,
    alloc: Alloc,
    register: RegisterMode,
    dtype: DataType,
}

impl TypeVisitor for TypeRun<'_> {
    type Output = BenchResult<()>;

    fn visit<T: Elem>(self) -> BenchResult<()> {
        let TypeRun {
            rank,
            options,
            report,
            max_bytes,
            alloc,
            register,
            dtype,
        } = self;
        let coll = options.coll;
        let (me, n) = (rank.rank(), rank.size());
        let elem_size = std::mem::size_of::<T>();
        debug_assert_eq!(elem_size, dtype.size());
        let sizes: Vec<usize> = options
            .sizes()
            .into_iter()
            .filter(|&size| size <= max_bytes)
            .collect();
        let (Some(&smallest), Some(&largest)) = (sizes.first(), sizes.last()) else {
            return Ok(());
        };
        let split = options.split_spec();
        let layout = |size: usize| coll.layout(size, elem_size, n, me, split);
        // Under Zipf splits a rank may receive more than a size's total.
        let buffer_len = sizes
            .iter()
            .map(|&size| layout(size).span)
            .fold(max_bytes / elem_size, usize::max)
            .max(1);
        // A local registration borrows its buffer: the buffers live outside `bufs`, and
        // longer (dropped after it, so deregistered before they are freed).
        let mut backing = match register {
            RegisterMode::Local => Some((
                NcclBuffer::<T>::alloc_zeros(&rank.stream, buffer_len)?,
                NcclBuffer::<T>::alloc_zeros(&rank.stream, buffer_len)?,
            )),
            _ => None,
        };
        let mut bufs = match (register, backing.as_mut()) {
            (RegisterMode::Local, Some((send, recv))) => {
                Buffers::registered(&rank.comm, send, recv)?
            }
            (RegisterMode::Window, _) => Buffers::windows(&rank.comm, buffer_len)?,
            _ => Buffers::<T>::alloc(&rank.stream, buffer_len, alloc)?,
        };
        if let Apis::Lsa(_) = options.apis {
            // The all-gather takes max_count / 2 elements a rank (its LL lines).
            let max_count = if coll == Coll::AllGather {
                (2 * buffer_len).div_ceil(n)
            } else {
                buffer_len
            };
            bufs.lsa = Some(T::lsa_all_reduce(&rank.comm, max_count)?);
        }
        measure::fill(rank, &mut bufs, &Pattern::new(n, None, 0))?;

        let apis = options.apis.list();
        let ops: Vec<Option<ReduceOp>> = if coll.has_redop() {
            options.ops.iter().copied().map(Some).collect()
        } else {
            vec![None]
        };
        for op in ops {
            let redop = op.unwrap_or(ReduceOp::Sum);
            let root = if coll.has_root() { options.root } else { 0 };
            // nccl-tests warms up at the largest size, then at the smallest.
            for size in [largest, smallest] {
                let mut issuer = Issuer::new(&rank.comm, coll, layout(size), redop, root);
                issuer.control = options.control;
                issuer.construction = options.construction;
                for &api in apis {
                    let mut op = Op {
                        rank,
                        issuer: &issuer,
                        api,
                        bufs: &mut bufs,
                        in_place: false,
                    };
                    op.warm_up(options.warmup)?;
                }
            }
            let pattern = (options.check > 0).then(|| Pattern::new(n, op, 0x5eed));
            for &size in &sizes {
                let layout = layout(size);
                let mut row = Row {
                    size: layout.total * elem_size,
                    count: layout.count,
                    dtype: elem::name(dtype),
                    redop: op.map_or("none", ReduceOp::name),
                    root: if coll.has_root() { root as i64 } else { -1 },
                    out_of_place: Vec::new(),
                    in_place: Vec::new(),
                };
                let mut issuer = Issuer::new(&rank.comm, coll, layout, redop, root);
                issuer.control = options.control;
                issuer.construction = options.construction;
                // The shipped all-gather has no in-place form.
                let lsa_gather = matches!(options.apis, Apis::Lsa(_)) && coll == Coll::AllGather;
                for in_place in [false, true] {
                    if in_place && (!coll.has_in_place() || lsa_gather) {
                        continue;
                    }
                    let cell = Cell {
                        rank,
                        options,
                        issuer: &issuer,
                        in_place,
                        pattern: pattern.as_ref(),
                    }
                    .measure(apis, &mut bufs)?;
                    if in_place {
                        row.in_place = cell;
                    } else {
                        row.out_of_place = cell;
                    }
                }
                if me == 0 {
                    println!("{}", report.line(&row));
                }
                if options.simulate {
                    // Every rank simulates, as every rank runs the operation.
                    let mut estimates = Vec::new();
                    for (in_place, cell) in [(false, &row.out_of_place), (true, &row.in_place)] {
                        let Some(measured) = cell.first() else {
                            continue;
                        };
                        if let Some(estimate) = issuer.simulate(&rank.comm, &mut bufs, in_place)? {
                            estimates.push((in_place, estimate, measured.time_us));
                        }
                    }
                    if me == 0 {
                        println!("{}", report::simulated_line(&estimates));
                    }
                }
                report.rows.push(row);
            }
        }
        Ok(())
    }
}

/// One placement (out of place or in place) of one size, for every API.
struct Cell<'a> {
    rank: &'a Rank,
    options: &'a Options,
    issuer: &'a Issuer,
    in_place: bool,
    pattern: Option<&'a Pattern>,
}

impl Cell<'_> {
    fn measure<T: Elem>(
        self,
        apis: &[Api],
        bufs: &mut Buffers<'_, T>,
    ) -> BenchResult<Vec<Measured>> {
        let Cell {
            rank,
            options,
            issuer,
            in_place,
            pattern,
        } = self;
        let average = options.average;
        let mut timings: Vec<Vec<Timing>> = vec![Vec::new(); apis.len()];
        for round in 0..options.rounds {
            // Alternate the order, so neither API always runs on a warmer machine.
            let mut order: Vec<usize> = (0..apis.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for i in order {
                let mut op = Op {
                    rank,
                    issuer,
                    api: apis[i],
                    bufs: &mut *bufs,
                    in_place,
                };
                let local = match options.mode() {
                    Mode::Host => op.host(options.iters)?,
                    Mode::Graph => op.graph(options.iters, options.graph_launches)?,
                    Mode::Latency => op.latency(options.iters)?,
                    Mode::Cold => op.cold(options.iters, options.cold_bytes)?,
                };
                let p99_us = match local.p99_us {
                    Some(p99) => Some(rank.combine(p99, average)?),
                    None => None,
                };
                timings[i].push(Timing {
                    time_us: rank.combine(local.time_us, average)?,
                    p99_us,
                    cpu_us: rank.combine(local.cpu_us, average)?,
                });
            }
        }

        // The first API against the second, round by round: both ran back to back, so a
        // drift of the machine between rounds (the 7.5 and 11 µs regimes of small
        // operations) cancels in each ratio.
        let shown = |t: &Timing| {
            if options.cputime && options.mode() != Mode::Latency {
                t.cpu_us
            } else {
                t.time_us
            }
        };
        let paired = match timings.as_slice() {
            [first, second] if options.rounds > 1 => {
                let mut ratios: Vec<f64> = first
                    .iter()
                    .zip(second)
                    .map(|(a, b)| shown(a) / shown(b))
                    .filter(|r| r.is_finite())
                    .collect();
                ratios.sort_by(f64::total_cmp);
                (!ratios.is_empty()).then(|| measure::median(&ratios))
            }
            _ => None,
        };
        let bytes = (issuer.layout.total * std::mem::size_of::<T>()) as f64;
        let factor = issuer.layout.bus_factor;
        let mut out = Vec::with_capacity(apis.len());
        for (i, &api) in apis.iter().enumerate() {
            let middle = |f: fn(&Timing) -> f64| {
                let mut values: Vec<f64> = timings[i].iter().map(f).collect();
                values.sort_by(f64::total_cmp);
                measure::median(&values)
            };
            let time_us = middle(|t| t.time_us);
            let p99_us = timings[i]
                .first()
                .and_then(|t| t.p99_us)
                .map(|_| middle(|t| t.p99_us.unwrap_or(f64::NAN)));
            let cpu_us = middle(|t| t.cpu_us);
            let algbw = if time_us > 0.0 {
                bytes / (time_us * 1e-6) / 1e9
            } else {
                0.0
            };
            let wrong = match pattern {
                Some(pattern) => {
                    let mut wrong = 0;
                    for _ in 0..options.check {
                        let mut op = Op {
                            rank,
                            issuer,
                            api,
                            bufs: &mut *bufs,
                            in_place,
                        };
                        let local = op.check(pattern)?;
                        wrong = rank.sum(local as f64)?.round() as u64;
                        if wrong > 0 {
                            break;
                        }
                    }
                    Some(wrong)
                }
                None => None,
            };
            out.push(Measured {
                api,
                time_us,
                p99_us,
                cpu_us,
                algbw,
                busbw: algbw * factor,
                wrong,
                paired: if i == 0 { paired } else { None },
            });
        }
        Ok(out)
    }
}
