//! NCCL 2.22 to 2.32 features nccl4py has, on real GPUs: suspend and resume of a
//! communicator's memory with NCCL's memory figures (2.29.7), `Comm`'s description,
//! simulated groups (2.22) and NCCL's parameters (2.30.3).
//!
//! Multi-rank tests run one process per rank in the one-GPU shapes of `common::shape`
//! (`NCCL_RS_GPU_SHAPE=shared|hosts` picks one; by default two ranks share GPU 0 on NCCL
//! 2.30+, else simulated hosts). On a library without a feature each test asserts the typed
//! `Unsupported` error instead, and says so.
//!
//! Run on a GPU host with `cargo test --test gpu_parity -- --include-ignored --test-threads=1`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use nccl::{
    Comm, CommStatus, Error, Group, MemStats, Operation, ParamValue, ReduceOp, UniqueId, Version,
    WindowFlags,
};

use common::procs::{fields, var, Children};
use common::shape::{child_device, gpus, processes, ran, skip, Shape};
use common::Rng;

const CHILD_ENV: &str = "NCCL_RS_PARITY_CHILD";
/// First NCCL with `ncclCommSuspend`, `ncclCommResume` and `ncclCommMemStats`.
const SUSPEND_SINCE: Version = Version::new(2, 29, 7);
/// First NCCL that exports `ncclParam*`.
const PARAMS_SINCE: Version = Version::new(2, 30, 3);
/// First NCCL with `ncclGroupSimulateEnd`.
const SIMULATE_SINCE: Version = Version::new(2, 22, 0);

fn version() -> Version {
    nccl::version().expect("NCCL loads")
}

fn stream(device: usize) -> Arc<CudaStream> {
    CudaContext::new(device)
        .and_then(|ctx| ctx.new_stream())
        .unwrap_or_else(|e| panic!("a stream on GPU {device}: {e}"))
}

/// Free memory on the communicator's GPU, as the CUDA driver counts it (`cuMemGetInfo`).
fn free_bytes(comm: &Comm) -> usize {
    comm.context().bind_to_thread().expect("bind context");
    cudarc::driver::result::mem_get_info()
        .expect("cuMemGetInfo")
        .0
}

/// Asserts that `result` is the typed refusal of a library older than `needs`.
fn assert_unsupported<T: std::fmt::Debug>(what: &str, result: nccl::Result<T>, needs: Version) {
    match result {
        Err(Error::Unsupported {
            needs: n, found, ..
        }) => {
            assert_eq!(n, needs, "{what}");
            assert_eq!(found, version(), "{what}");
            println!("{what}: Unsupported (needs {n}, found {found}), as expected");
        }
        other => panic!(
            "{what} on NCCL {}: expected Unsupported, got {other:?}",
            version()
        ),
    }
}

fn assert_suspended<T: std::fmt::Debug>(what: &str, result: nccl::Result<T>, rank: usize) {
    match result {
        Err(Error::Suspended { rank: r, call }) => {
            assert_eq!(r, rank, "{what}");
            println!("rank {rank}: {what} refused while suspended ({call})");
        }
        other => panic!("rank {rank}: {what} while suspended: expected Suspended, got {other:?}"),
    }
}

fn assert_usage<T: std::fmt::Debug>(what: &str, result: nccl::Result<T>) {
    match result {
        Err(Error::InvalidUsage(text)) => println!("{what}: refused ({text})"),
        other => panic!("{what}: expected InvalidUsage, got {other:?}"),
    }
}

/// Random small integers as f32 (exact in every sum), the same for a given (seed, rank).
fn data(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed.wrapping_mul(1000).wrapping_add(rank as u64));
    (0..len).map(|_| rng.range(-8, 8) as f32).collect()
}

/// One all-reduce on random data, checked against the host's sum.
fn checked_all_reduce(comm: &Comm, seed: u64, len: usize) {
    let (rank, size) = (comm.rank(), comm.size());
    let stream = comm.stream();
    let send = stream.clone_htod(&data(seed, rank, len)).expect("htod");
    let mut recv = stream.alloc_zeros::<f32>(len).expect("alloc");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("rank {rank}: all_reduce: {e}"));
    comm.synchronize_timeout(Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("rank {rank}: synchronize: {e}"));
    let got = stream.clone_dtoh(&recv).expect("dtoh");
    let mut want = vec![0f32; len];
    for r in 0..size {
        for (w, x) in want.iter_mut().zip(data(seed, r, len)) {
            *w += x;
        }
    }
    assert_eq!(got, want, "rank {rank}: all-reduce result");
}

// ---------------------------------------------------------------------------------------
// One rank, in this process
// ---------------------------------------------------------------------------------------

/// What a one-rank communicator reports (NCCL issue 2363 says it holds a 512 MB buffer),
/// its description in every state, suspend and resume on it, and simulation refused.
#[test]
#[ignore = "needs CUDA GPUs"]
fn one_rank_mem_stats_description_and_refusals() {
    const TEST: &str = "one_rank_mem_stats_description_and_refusals";
    if gpus(TEST, 1).is_none() {
        return;
    }
    common::shape::setup();
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let comm = Comm::init_rank(stream(0), &id, 0, 1).expect("1-rank init");
    checked_all_reduce(&comm, 1, 1 << 16);
    let text = comm.to_string();
    println!("Display: {text}");
    println!("Debug: {comm:?}");
    assert!(
        text.starts_with(&format!(
            "rank 0 of 1 on CUDA device 0, NCCL {}, blocking, ok",
            version()
        )),
        "{text}"
    );
    assert_eq!(comm.status(), CommStatus::Ok);

    // A one-rank collective runs at once as a copy: a simulation refuses it.
    let send = comm.stream().alloc_zeros::<f32>(16).unwrap();
    let mut recv = comm.stream().alloc_zeros::<f32>(16).unwrap();
    if version() >= SIMULATE_SINCE {
        let mut simulation = Group::simulate().expect("simulate");
        match simulation.enqueue(
            &comm,
            Operation::all_reduce(&send, &mut recv, ReduceOp::Sum),
        ) {
            Err(Error::InvalidArgument(text)) => assert!(text.contains("one-rank"), "{text}"),
            other => panic!("a one-rank collective in a simulation: {other:?}"),
        }
        drop(simulation);
    }

    if version() < SUSPEND_SINCE {
        assert_unsupported("mem_stats", comm.mem_stats(), SUSPEND_SINCE);
        assert_unsupported("suspend", comm.suspend(), SUSPEND_SINCE);
        assert_unsupported("resume", comm.resume(), SUSPEND_SINCE);
        assert!(!text.contains("memory:"), "{text}");
        skip(
            TEST,
            &format!(
                "NCCL {} has no ncclCommSuspend/ncclCommMemStats ({SUSPEND_SINCE}): \
                 Unsupported asserted",
                version()
            ),
        );
        return;
    }
    let before = comm.mem_stats().expect("mem_stats");
    println!(
        "MEMSTATS one rank, NCCL {}: {before} ({before:?}); cuMemGetInfo free {} MiB",
        version(),
        free_bytes(&comm) >> 20
    );
    assert!(!before.suspended);
    assert!(before.total >= before.suspendable, "{before:?}");
    assert!(text.contains(&format!(", memory: {before}")), "{text}");

    comm.suspend().expect("suspend a 1-rank communicator");
    assert_eq!(comm.status(), CommStatus::Suspended);
    let during = comm.mem_stats().expect("mem_stats while suspended");
    println!("MEMSTATS one rank, suspended: {during}");
    assert!(during.suspended, "{during:?}");
    assert!(comm.to_string().contains(", suspended, memory:"), "{comm}");
    assert_suspended(
        "all_reduce",
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum),
        0,
    );
    assert_usage("a second suspend", comm.suspend());
    comm.resume().expect("resume");
    assert_usage("a second resume", comm.resume());
    assert!(!comm.mem_stats().unwrap().suspended);
    checked_all_reduce(&comm, 2, 1 << 16);

    // Dropping a suspended communicator stays bounded.
    comm.suspend().expect("suspend again");
    let start = Instant::now();
    drop(comm);
    let took = start.elapsed();
    println!("dropping a suspended 1-rank communicator took {took:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");

    // A nonblocking communicator aborted through a handle still describes itself.
    let config = nccl::CommConfig::default().blocking(false);
    let id = UniqueId::new().unwrap();
    let comm = Comm::init_rank_with_config(stream(0), &id, 0, 1, &config).expect("init");
    comm.abort_handle().unwrap().abort().expect("abort");
    let text = comm.to_string();
    println!("Display after abort: {text}");
    assert!(text.ends_with("nonblocking, aborted"), "{text}");
    assert!(format!("{comm:?}").contains("Aborted"));
    ran(TEST, &format!("NCCL {}: {before}", version()));
}

// ---------------------------------------------------------------------------------------
// Several ranks, one process each
// ---------------------------------------------------------------------------------------

/// Starts one child per rank running `test` (2 ranks; simulated hosts: 2), waits, and
/// checks that every rank printed `DONE rank=...`. Returns the children's lines.
fn run_children(parent: &str, test: &str) -> Option<Vec<(usize, String)>> {
    let layout = processes(parent, &[Shape::Gpus, Shape::Shared, Shape::Hosts], 2)?;
    let size = layout.size();
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let ranks: Vec<usize> = (0..size).collect();
    let children = Children::spawn(test, &ranks, |rank| {
        let mut vars = layout.env(rank);
        vars.push(var(CHILD_ENV, format!("{rank},{size},{id}")));
        vars
    });
    let lines = children.finish(Duration::from_secs(600));
    let mut done: Vec<usize> = fields(&lines, "DONE", "rank")
        .into_iter()
        .map(|(_, rank)| rank as usize)
        .collect();
    done.sort_unstable();
    assert_eq!(done, ranks, "{test}: ranks that finished");
    Some(lines)
}

/// In a child: this rank's communicator; `None` when not started as a child.
fn child_comm() -> Option<Comm> {
    let spec = std::env::var(CHILD_ENV).ok()?;
    let mut parts = spec.splitn(3, ',');
    let rank: usize = parts.next()?.parse().ok()?;
    let size: usize = parts.next()?.parse().ok()?;
    let id: UniqueId = parts.next()?.parse().expect("id hex");
    let comm = Comm::init_rank(stream(child_device(rank)), &id, rank, size)
        .unwrap_or_else(|e| panic!("rank {rank}: ncclCommInitRank: {e}"));
    Some(comm)
}

/// Waits up to 10 s for `done` (another rank's release can land after this rank's).
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn suspend_releases_memory_and_every_collective_works_after_resume() {
    const TEST: &str = "suspend_releases_memory_and_every_collective_works_after_resume";
    let Some(lines) = run_children(TEST, "child_suspend_resume") else {
        return;
    };
    if version() < SUSPEND_SINCE {
        skip(
            TEST,
            &format!(
                "NCCL {} has no ncclCommSuspend ({SUSPEND_SINCE}): Unsupported asserted on \
                 every rank",
                version()
            ),
        );
    }
    for (rank, line) in &lines {
        if line.contains("MEMSTATS") {
            println!("rank {rank}: {line}");
        }
    }
}

#[test]
#[ignore = "child process of suspend_releases_memory_and_every_collective_works_after_resume"]
fn child_suspend_resume() {
    let Some(comm) = child_comm() else { return };
    let (rank, size) = (comm.rank(), comm.size());
    println!("rank {rank}: {comm}");
    if version() < SUSPEND_SINCE {
        assert_unsupported("suspend", comm.suspend(), SUSPEND_SINCE);
        assert_unsupported("resume", comm.resume(), SUSPEND_SINCE);
        assert_unsupported("mem_stats", comm.mem_stats(), SUSPEND_SINCE);
        println!("DONE rank={rank}");
        return;
    }
    // NCCL allocates its buffers by the first collectives.
    checked_all_reduce(&comm, 10, 1 << 20);
    let active: MemStats = comm.mem_stats().expect("mem_stats");
    let free_active = free_bytes(&comm);
    println!(
        "MEMSTATS rank={rank} active: {active}; free {} MiB",
        free_active >> 20
    );
    assert!(!active.suspended);
    // NCCL 2.29.7 counts these buffers as persistent (measured on one H100: 0 B suspendable,
    // 16 MiB persistent after a collective over simulated hosts); 2.32.3 counts them as
    // suspendable. Suspend and resume must work either way; memory must come back where
    // NCCL says some can.
    let expects_release = version() >= Version::new(2, 32, 0);
    if expects_release {
        assert!(
            active.suspendable > 0,
            "rank {rank}: NCCL reports nothing to suspend after a collective: {active:?}"
        );
    } else if active.suspendable == 0 {
        println!(
            "MEMSTATS rank={rank}: NCCL {} reports nothing suspendable; suspend and resume \
             are checked, the release of memory is not",
            version()
        );
    }

    comm.suspend()
        .unwrap_or_else(|e| panic!("rank {rank}: suspend: {e}"));
    let suspended = comm.mem_stats().expect("mem_stats while suspended");
    assert!(suspended.suspended, "{suspended:?}");
    assert_eq!(suspended.suspendable, active.suspendable);
    let mut free_suspended = free_bytes(&comm);
    let released = active.suspendable > 0
        && eventually(|| {
            free_suspended = free_bytes(&comm);
            free_suspended > free_active
        });
    println!(
        "MEMSTATS rank={rank} suspended: {suspended}; free {} MiB (+{} MiB)",
        free_suspended >> 20,
        (free_suspended.saturating_sub(free_active)) >> 20
    );
    assert!(
        released || active.suspendable == 0,
        "rank {rank}: free GPU memory did not rise after suspend ({free_active} -> \
         {free_suspended} bytes; NCCL says {suspended})"
    );

    // Misuse is refused, typed, before NCCL: operations, groups, windows, split.
    let stream = comm.stream().clone();
    let send = stream.alloc_zeros::<f32>(1024).unwrap();
    let mut recv = stream.alloc_zeros::<f32>(1024).unwrap();
    assert_suspended(
        "all_reduce",
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum),
        rank,
    );
    assert_suspended("broadcast", comm.broadcast_in_place(&mut recv, 0), rank);
    {
        let mut group = Group::start().unwrap();
        assert_suspended(
            "a grouped all-reduce",
            group.enqueue(
                &comm,
                Operation::all_reduce(&send, &mut recv, ReduceOp::Sum),
            ),
            rank,
        );
        group.finish().expect("the empty group ends");
    }
    assert_suspended("split", comm.split(Some(0), rank as i32), rank);
    let buffer = nccl::NcclBuffer::<f32>::alloc_zeros(&stream, 1024).expect("ncclMemAlloc");
    assert_suspended(
        "register_window",
        comm.register_window(buffer, WindowFlags::default())
            .map_err(Error::from),
        rank,
    );
    assert_usage("a second suspend", comm.suspend());
    assert_eq!(comm.status(), CommStatus::Suspended);
    println!("rank {rank}: {comm}");

    comm.resume()
        .unwrap_or_else(|e| panic!("rank {rank}: resume: {e}"));
    let resumed = comm.mem_stats().expect("mem_stats after resume");
    let free_resumed = free_bytes(&comm);
    println!(
        "MEMSTATS rank={rank} resumed: {resumed}; free {} MiB",
        free_resumed >> 20
    );
    assert!(!resumed.suspended);
    assert!(
        free_resumed < free_suspended || active.suspendable == 0,
        "rank {rank}: free GPU memory did not fall after resume ({free_suspended} -> \
         {free_resumed} bytes)"
    );
    assert_usage("resume when not suspended", comm.resume());

    // Every collective, element type and reduction after resume, against the host.
    let ranks = common::Ranks {
        comms: vec![comm],
        size,
    };
    let checked = common::run_all_types(&ranks, 65);
    assert!(checked > 200, "rank {rank}: only {checked} buffers checked");
    println!("DONE rank={rank} checked={checked}");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn simulate_estimates_an_all_reduce_without_launching_it() {
    const TEST: &str = "simulate_estimates_an_all_reduce_without_launching_it";
    let Some(lines) = run_children(TEST, "child_simulate") else {
        return;
    };
    if version() < SIMULATE_SINCE {
        skip(
            TEST,
            &format!(
                "NCCL {} has no ncclGroupSimulateEnd ({SIMULATE_SINCE}): Unsupported asserted",
                version()
            ),
        );
        return;
    }
    // Two sizes per rank, each printed with NCCL's estimate beside the measured time.
    let estimates = fields(&lines, "ESTIMATE", "ns");
    let done = fields(&lines, "DONE", "rank");
    assert_eq!(estimates.len(), 2 * done.len(), "{estimates:?}");
}

#[test]
#[ignore = "child process of simulate_estimates_an_all_reduce_without_launching_it"]
fn child_simulate() {
    let Some(comm) = child_comm() else { return };
    let (rank, size) = (comm.rank(), comm.size());
    if version() < SIMULATE_SINCE {
        assert_unsupported(
            "Group::simulate",
            Group::simulate().map(drop),
            SIMULATE_SINCE,
        );
        println!("DONE rank={rank}");
        return;
    }
    let stream = comm.stream().clone();
    for len in [1usize << 12, 1 << 24] {
        let send = stream.clone_htod(&data(20, rank, len)).unwrap();
        let sentinel = vec![7.5f32; len];
        let mut recv = stream.clone_htod(&sentinel).unwrap();

        let mut simulation = Group::simulate().expect("Group::simulate");
        simulation
            .enqueue(
                &comm,
                Operation::all_reduce(&send, &mut recv, ReduceOp::Sum),
            )
            .expect("a simulated all-reduce");
        assert_eq!(simulation.buffer_count(), 2);
        let estimate = simulation.estimate().expect("estimate");
        comm.synchronize().unwrap();
        assert_eq!(
            stream.clone_dtoh(&recv).unwrap(),
            sentinel,
            "rank {rank}: a simulated all-reduce wrote its output"
        );
        assert!(estimate > Duration::ZERO, "{estimate:?}");

        // The same all-reduce run for real, timed, and right: nothing simulated before
        // lingers in NCCL.
        let runs = 20u32;
        checked_all_reduce(&comm, 21, len);
        let start = Instant::now();
        for _ in 0..runs {
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
        }
        comm.synchronize().unwrap();
        let measured = start.elapsed() / runs;
        println!(
            "ESTIMATE rank={rank} size={size} bytes={} ns={} measured_ns={}",
            len * 4,
            estimate.as_nanos(),
            measured.as_nanos()
        );
    }

    // What a simulation cannot take is refused, and an empty one has no estimate.
    let send = stream.alloc_zeros::<f32>(64).unwrap();
    let mut simulation = Group::simulate().unwrap();
    let peer = (rank + 1) % size;
    match simulation.enqueue(&comm, Operation::send(&send, peer)) {
        Err(Error::InvalidArgument(text)) => assert!(text.contains("point-to-point"), "{text}"),
        other => panic!("a simulated send: {other:?}"),
    }
    match simulation.estimate() {
        Err(Error::Unavailable { api, .. }) => assert_eq!(api, "ncclGroupSimulateEnd"),
        other => panic!("an empty simulation: {other:?}"),
    }
    checked_all_reduce(&comm, 22, 4096);
    println!("DONE rank={rank}");
}

/// First NCCL that queues broadcasts per root (as one all-gather-v when there are several).
const BROADCASTS_PER_ROOT_SINCE: Version = Version::new(2, 29, 0);

/// A simulation with broadcasts from two roots (the second refused from NCCL 2.29, where it
/// would stay queued), then real broadcasts from each root: right on every rank, and nothing
/// written into the simulation's receive buffers, which stay alive to be watched.
#[test]
#[ignore = "needs CUDA GPUs"]
fn simulated_broadcasts_leave_nothing_queued() {
    const TEST: &str = "simulated_broadcasts_leave_nothing_queued";
    if run_children(TEST, "child_simulated_broadcasts").is_none() {
        return;
    }
    if version() < SIMULATE_SINCE {
        skip(
            TEST,
            &format!("NCCL {} has no ncclGroupSimulateEnd", version()),
        );
    }
}

#[test]
#[ignore = "child process of simulated_broadcasts_leave_nothing_queued"]
fn child_simulated_broadcasts() {
    let Some(comm) = child_comm() else { return };
    let rank = comm.rank();
    if version() < SIMULATE_SINCE {
        println!("DONE rank={rank}");
        return;
    }
    let stream = comm.stream().clone();
    let len = 1 << 16;
    let sentinel = vec![7.5f32; len];
    let sim_send = stream.clone_htod(&data(30, rank, len)).unwrap();
    let mut sim_recv = [
        stream.clone_htod(&sentinel).unwrap(),
        stream.clone_htod(&sentinel).unwrap(),
    ];
    {
        let [recv0, recv1] = &mut sim_recv;
        let mut simulation = Group::simulate().expect("Group::simulate");
        let send = |root: usize| (rank == root).then_some(&sim_send as _);
        simulation
            .enqueue(&comm, Operation::broadcast(send(0), recv0, 0))
            .expect("a simulated broadcast from root 0");
        let second = simulation.enqueue(&comm, Operation::broadcast(send(1), recv1, 1));
        if version() >= BROADCASTS_PER_ROOT_SINCE {
            match second {
                Err(Error::InvalidArgument(text)) => {
                    assert!(text.contains("root 1") && text.contains("root 0"), "{text}");
                    println!("rank {rank}: second root refused: {text}");
                }
                other => panic!(
                    "rank {rank}: a second root on NCCL {}: {other:?}",
                    version()
                ),
            }
        } else {
            second.expect("a second root before NCCL 2.29");
        }
        match simulation.estimate() {
            Ok(estimate) => println!("ESTIMATE rank={rank} ns={}", estimate.as_nanos()),
            Err(e) => println!("rank {rank}: no estimate: {e}"),
        }
    }
    comm.synchronize().unwrap();
    for root in [0usize, 1] {
        let want = data(31 + root as u64, root, len);
        let send = stream.clone_htod(&want).unwrap();
        let mut recv = stream.alloc_zeros::<f32>(len).unwrap();
        let send = (rank == root).then_some(&send as _);
        comm.broadcast(send, &mut recv, root)
            .unwrap_or_else(|e| panic!("rank {rank}: broadcast from {root}: {e}"));
        comm.synchronize_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("rank {rank}: synchronize: {e}"));
        assert_eq!(
            stream.clone_dtoh(&recv).unwrap(),
            want,
            "rank {rank}: the broadcast from root {root} after a simulation"
        );
        for (i, buf) in sim_recv.iter().enumerate() {
            assert_eq!(
                stream.clone_dtoh(buf).unwrap(),
                sentinel,
                "rank {rank}: simulated broadcast {i}'s receive buffer was written by a real group"
            );
        }
    }
    checked_all_reduce(&comm, 32, 4096);
    println!("DONE rank={rank}");
}

// ---------------------------------------------------------------------------------------
// Parameters (no GPU needed, only NCCL)
// ---------------------------------------------------------------------------------------

/// NCCL's parameters listed, and one integer key read typed, as the environment set it (in
/// a child process, so that NCCL reads it fresh).
#[test]
#[ignore = "needs the NCCL library (no GPU needed)"]
fn params_listed_and_one_read_typed() {
    const TEST: &str = "params_listed_and_one_read_typed";
    if std::env::var_os(CHILD_ENV).is_some() {
        let subsys = nccl::params::get("NCCL_DEBUG_SUBSYS")
            .expect("params::get")
            .expect("NCCL knows NCCL_DEBUG_SUBSYS");
        println!("child: {subsys}");
        // INIT is bit 0, COLL bit 1 (NCCL's ncclDebugLogSubSys).
        assert_eq!(subsys.value, ParamValue::U64(0b11), "{subsys:?}");
        assert_eq!(subsys.text, "INIT,COLL");
        return;
    }
    let found = match nccl::version() {
        Ok(found) => found,
        Err(e) => {
            skip(TEST, &format!("NCCL does not load: {e}"));
            return;
        }
    };
    if found < PARAMS_SINCE {
        assert_unsupported("params::all", nccl::params::all(), PARAMS_SINCE);
        assert_unsupported("params::get", nccl::params::get("NCCL_DEBUG"), PARAMS_SINCE);
        skip(
            TEST,
            &format!("NCCL {found} has no ncclParam* ({PARAMS_SINCE}): Unsupported asserted"),
        );
        return;
    }
    // NCCL 2.30.3 and 2.30.4 mark no parameter as published (their source has no
    // NCCL_PARAM_FLAG_PUBLISHED user; 2.30.7's debug.cc marks NCCL_DEBUG and its kin), so
    // they list none unless NCCL_PARAM_DUMP_ALL=true (measured: 0 keys on 2.30.3), and
    // NCCL_DEBUG_SUBSYS is not in their registry yet.
    let published = found >= Version::new(2, 30, 7);
    let params = nccl::params::all().expect("params::all");
    println!("{params}");
    assert!(params
        .to_string()
        .contains(&params.library.display().to_string()));
    assert_eq!(nccl::params::get("NCCL_NO_SUCH_KEY").unwrap(), None);
    if !published {
        println!(
            "NCCL {found} publishes no parameter ({} listed); listing all with \
             NCCL_PARAM_DUMP_ALL=true",
            params.params.len()
        );
        // NCCL reads the variable on every listing (ncclParamDumpAllFlag).
        std::env::set_var("NCCL_PARAM_DUMP_ALL", "true");
        let every = nccl::params::all().expect("params::all with NCCL_PARAM_DUMP_ALL");
        println!("{every}");
        assert!(!every.params.is_empty(), "{every}");
        // Each listed key reads back by itself, with the same value.
        for param in &every.params {
            let one = nccl::params::get(&param.key)
                .expect("params::get")
                .unwrap_or_else(|| panic!("{} listed but not found", param.key));
            assert_eq!(one.text, param.text, "{}", param.key);
        }
        std::env::remove_var("NCCL_PARAM_DUMP_ALL");
        ran(
            TEST,
            &format!(
                "NCCL {found}: no published parameter, {} in all",
                every.params.len()
            ),
        );
        return;
    }
    assert!(!params.params.is_empty(), "{params}");
    let listed = params
        .get("NCCL_DEBUG_SUBSYS")
        .unwrap_or_else(|| panic!("NCCL_DEBUG_SUBSYS listed: {params}"));
    assert!(matches!(listed.value, ParamValue::U64(_)), "{listed:?}");

    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--include-ignored", "--nocapture"])
        .env(CHILD_ENV, "1")
        .env("NCCL_DEBUG_SUBSYS", "INIT,COLL")
        .status()
        .expect("spawn child");
    assert!(status.success(), "child: {status}");
    ran(
        TEST,
        &format!("NCCL {found}: {} parameters", params.params.len()),
    );
}
