//! Fault tolerance on real GPUs: a rank killed with SIGKILL mid-loop (over NVLink/P2P, over
//! the socket transport, and between simulated machines), a rank that never joins init, the
//! watchdog, abort handles, revoke, shrink and grow, and nonblocking communicators against
//! blocking ones.
//!
//! Like `gpu_multi_process`, the parent test re-executes its own binary once per rank (the
//! `child_*` tests, which do nothing unless started that way) and passes the rank, size and
//! unique id in the environment; it kills children with SIGKILL when a test asks for it, and
//! on its own deadline. Every test uses all N GPUs present (N >= 2); on a one-GPU host the
//! network tests run three simulated hosts on GPU 0 and the same-host ones two ranks sharing
//! it (NCCL 2.30+; see `common::shape`). A killed rank leaves N - 1 survivors, one of them
//! alone of 2, which is a valid communicator.
//!
//! ```text
//! cargo test --release --test gpu_fault_tolerance -- --include-ignored --test-threads=1 --nocapture
//! ```
//!
//! Past 600 lines on purpose: each scenario is a parent test and the `child_*` test it
//! re-executes this binary for, and the children share their setup (`join`, `check_sum`); the
//! process harness itself is in `common::procs`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use nccl::bootstrap::{exchange_id, Exchange, FileRendezvous, Placement, TcpRendezvous};
use nccl::{
    AbortOutcome, Comm, CommConfig, Error, Group, Operation, ReduceOp, ResultCode, ShrinkMode,
    UniqueId, Version, WatchdogAction, WatchdogOptions,
};

use common::procs::{
    epoch_ms, fields, free_port, gpus_or_skip, scratch_dir, simulated_node_env, var, Children,
};
use common::shape::{child_device, processes, Layout, Shape};
use common::{run_all_types, Ranks, Rng};

const CHILD_ENV: &str = "NCCL_RS_FT_CHILD";
const DIR_ENV: &str = "NCCL_RS_FT_DIR";
const DEAD_ENV: &str = "NCCL_RS_FT_DEAD";
const MODE_ENV: &str = "NCCL_RS_FT_MODE";
const ID2_ENV: &str = "NCCL_RS_FT_ID2";
/// `host:port` of the survivors' TCP rendezvous, when they must rebuild between machines.
const SURVIVORS_ADDR_ENV: &str = "NCCL_RS_FT_SURVIVORS_ADDR";

/// The failure-detection timeout of the kill tests.
const DETECT: Duration = Duration::from_secs(5);
/// Elements per all-reduce in the kill tests (4 MiB of f32).
const LEN: usize = 1 << 20;

// -------------------------------------------------------------------------------------------
// Parent side
// -------------------------------------------------------------------------------------------

/// Waits (bounded) for `path` to exist.
fn wait_for_file(path: &Path, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// Starts `test` as ranks `ranks` of `size` sharing `id` (created here, as a launcher-less
/// job would), placed as `layout` says, with `env` added for every rank.
fn spawn(
    test: &str,
    layout: &Layout,
    ranks: &[usize],
    size: usize,
    id: &UniqueId,
    env: &[(String, String)],
) -> Children {
    Children::spawn(test, ranks, |rank| {
        let mut vars = layout.env(rank);
        vars.push(var(CHILD_ENV, format!("{rank},{size},{id}")));
        vars.extend_from_slice(env);
        vars
    })
}

/// The shapes of the tests about what a failure does to the network path: real GPUs, else
/// simulated hosts (three, so that survivors are more than one).
const NETWORK: &[Shape] = &[Shape::Gpus, Shape::Hosts];

/// How the ranks of a kill test reach each other.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Transport {
    /// One host, every GPU visible to every rank, NCCL's choice (NVLink/P2P on the lent hosts;
    /// P2P between two ranks sharing GPU 0 on a one-GPU host).
    NvLink,
    /// Only the network: no P2P, no shared memory, the socket transport (one host with a GPU
    /// per rank, or simulated hosts).
    Socket,
    /// Each rank a machine of its own, as far as NCCL can tell (`simulated_node_env`: own
    /// host id, one GPU, sockets over loopback), started like a multi-node torchrun job.
    SimulatedNodes,
}

/// N ranks all-reduce in a loop; one is killed with SIGKILL mid-loop; the N - 1 survivors must
/// detect it within `DETECT` + 1 s, shrink (or rebuild, where NCCL refuses to shrink) to N - 1
/// ranks and all-reduce correctly.
fn kill_and_recover(mode: &str, transport: Transport) {
    let test = "child_kill_and_shrink";
    let label = format!("kill test ({transport:?}, {mode})");
    let shapes = match transport {
        Transport::NvLink => &[Shape::Gpus, Shape::Shared][..],
        Transport::Socket => NETWORK,
        Transport::SimulatedNodes => &[Shape::Hosts][..],
    };
    let Some(layout) = processes(&label, shapes, 3) else {
        return;
    };
    let n = layout.size();
    // A rank in the middle where there is one, so survivors on both sides are renumbered; of
    // two, rank 0, so the survivor becomes rank 0.
    let dead = (n - 1) / 2;
    let alive: Vec<usize> = (0..n).filter(|&r| r != dead).collect();
    let dir = scratch_dir("ft-kill");
    let all: Vec<usize> = (0..n).collect();
    let mut env = vec![
        var(DIR_ENV, dir.display()),
        var(DEAD_ENV, dead),
        var(MODE_ENV, mode),
    ];
    let mut children = match transport {
        Transport::NvLink | Transport::Socket => {
            if transport == Transport::Socket {
                // As between machines: no P2P, no shared memory, only the network (sockets).
                env.push(var("NCCL_P2P_DISABLE", 1));
                env.push(var("NCCL_SHM_DISABLE", 1));
                env.push(var("NCCL_NET", "Socket"));
            }
            let id = UniqueId::new().expect("ncclGetUniqueId");
            spawn(test, &layout, &all, n, &id, &env)
        }
        Transport::SimulatedNodes => {
            let port = free_port();
            let survivors_port = std::iter::repeat_with(free_port)
                .find(|&p| p != port)
                .expect("a second port");
            let run_id = format!("ft-kill-{}-{}", std::process::id(), epoch_ms());
            println!(
                "[{label}] {n} simulated nodes, rendezvous at 127.0.0.1:{port}, survivors' at \
                 127.0.0.1:{survivors_port}"
            );
            Children::spawn(test, &all, |rank| {
                // No id from here: rank 0 makes it and serves it over TCP, as in a real job.
                let mut vars = simulated_node_env(rank, n, layout.devices[rank], port, &run_id);
                vars.push(var(CHILD_ENV, format!("{rank},{n}")));
                vars.push(var(
                    SURVIVORS_ADDR_ENV,
                    format!("127.0.0.1:{survivors_port}"),
                ));
                vars.extend_from_slice(&env);
                vars
            })
        }
    };
    // The rank to kill says when it has finished a few iterations; kill it while it goes on.
    let ready = dir.join(format!("ready-{dead}"));
    let start = Instant::now();
    while !ready.exists() {
        let exited = children.exited();
        assert!(
            exited.is_empty(),
            "{label}: children exited early: {exited:?}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{label}: rank {dead} never got going"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    let killed_at = children.kill(dead);
    println!("[{label}] killed rank {dead} of {n} with SIGKILL at {killed_at} ms");
    let _ = std::fs::write(dir.join("killed"), killed_at.to_string());
    let lines = children.finish(Duration::from_secs(240));
    let _ = std::fs::remove_dir_all(&dir);

    let detected = fields(&lines, "DETECTED", "at_ms");
    let survived = fields(&lines, "SURVIVED", "size");
    let mut ranks: Vec<usize> = detected.iter().map(|(r, _)| *r).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, alive, "{label}: every survivor detects the failure");
    let limit = DETECT.as_millis() + 1000;
    for (rank, at) in &detected {
        assert!(
            *at + 10 >= killed_at,
            "{label}: rank {rank} reported a failure at {at} ms, before rank {dead} was killed \
             at {killed_at} ms"
        );
        let latency = at.saturating_sub(killed_at);
        println!(
            "[{label}] rank {rank}: failure detected {latency} ms after the kill (timeout {} ms, limit {limit} ms)",
            DETECT.as_millis()
        );
        assert!(
            latency <= limit,
            "{label}: rank {rank} detected the failure after {latency} ms, more than {limit} ms"
        );
    }
    let mut finished: Vec<usize> = survived.iter().map(|(r, _)| *r).collect();
    finished.sort_unstable();
    assert_eq!(finished, alive, "{label}: every survivor finishes");
    assert!(
        survived.iter().all(|(_, size)| *size == (n - 1) as u128),
        "{label}: survivors' sizes {survived:?}, want {}",
        n - 1
    );
    let count = |tag: &str| lines.iter().filter(|(_, l)| l.contains(tag)).count();
    let (shrunk, rebuilt) = (count("RECOVERY_SHRUNK "), count("RECOVERY_REBUILT "));
    println!("[{label}] survivors that shrank: {shrunk}, that rebuilt: {rebuilt}");
    assert!(
        (shrunk, rebuilt) == (n - 1, 0) || (shrunk, rebuilt) == (0, n - 1),
        "{label}: the survivors took different ways: {shrunk} shrank, {rebuilt} rebuilt"
    );
    if transport == Transport::NvLink && n > 2 {
        // (A lone survivor may rebuild instead: see `child_kill_and_shrink`.)
        assert_eq!(shrunk, n - 1, "{label}: over NVLink NCCL shrinks");
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn killed_rank_is_detected_and_survivors_shrink_nvlink() {
    kill_and_recover("synchronize", Transport::NvLink);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn killed_rank_is_detected_and_survivors_shrink_socket_transport() {
    kill_and_recover("synchronize", Transport::Socket);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn killed_rank_is_detected_and_survivors_recover_between_simulated_nodes() {
    kill_and_recover("synchronize", Transport::SimulatedNodes);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn killed_rank_is_detected_by_the_watchdog_and_survivors_shrink() {
    kill_and_recover("watchdog", Transport::NvLink);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn rank_that_never_joins_init_times_out_cleanly() {
    let Some(layout) = processes("rank_that_never_joins_init_times_out_cleanly", NETWORK, 3) else {
        return;
    };
    let n = layout.size();
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let id2 = UniqueId::new().expect("ncclGetUniqueId");
    // Ranks 0..n-1 of n start; rank n - 1 never calls init.
    let started: Vec<usize> = (0..n - 1).collect();
    let children = spawn(
        "child_never_joins",
        &layout,
        &started,
        n,
        &id,
        &[var(ID2_ENV, id2)],
    );
    let lines = children.finish(Duration::from_secs(180));
    // Each started rank either timed out or saw a peer that timed out first give up; the
    // first to give up timed out.
    let timed_out = fields(&lines, "TIMED_OUT", "after_ms");
    let gave_up = fields(&lines, "PEER_GAVE_UP", "after_ms");
    println!("timed out: {timed_out:?}; saw a peer give up: {gave_up:?}");
    assert_eq!(
        timed_out.len() + gave_up.len(),
        n - 1,
        "every started rank fails the creation: {timed_out:?} {gave_up:?}"
    );
    assert!(!timed_out.is_empty(), "some rank's own timeout ends it");
    let recovered = fields(&lines, "RECOVERED", "size");
    assert_eq!(
        recovered.len(),
        n - 1,
        "every rank then works in a new communicator: {recovered:?}"
    );
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn nonblocking_communicators_match_blocking_ones() {
    let Some(layout) = processes(
        "nonblocking_communicators_match_blocking_ones",
        &[Shape::Gpus, Shape::Hosts, Shape::Shared],
        3,
    ) else {
        return;
    };
    let n = layout.size();
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let id2 = UniqueId::new().expect("ncclGetUniqueId");
    let ranks: Vec<usize> = (0..n).collect();
    let children = spawn(
        "child_nonblocking_vs_blocking",
        &layout,
        &ranks,
        n,
        &id,
        &[var(ID2_ENV, id2)],
    );
    let lines = children.finish(Duration::from_secs(600));
    let matched = fields(&lines, "MATCHED", "checked");
    assert_eq!(matched.len(), n, "every rank matches: {matched:?}");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn watchdog_and_abort_handle_end_a_stuck_collective() {
    let Some(layout) = processes(
        "watchdog_and_abort_handle_end_a_stuck_collective",
        NETWORK,
        3,
    ) else {
        return;
    };
    let n = layout.size();
    let dir = scratch_dir("ft-watchdog");
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let ranks: Vec<usize> = (0..n).collect();
    let children = spawn(
        "child_watchdog",
        &layout,
        &ranks,
        n,
        &id,
        &[var(DIR_ENV, dir.display())],
    );
    let lines = children.finish(Duration::from_secs(180));
    let _ = std::fs::remove_dir_all(&dir);
    let watchdog = fields(&lines, "WATCHDOG_OK", "waited_ms");
    assert_eq!(watchdog.len(), 1, "rank 0's watchdog: {watchdog:?}");
    let handles = fields(&lines, "HANDLE_OK", "rank");
    assert_eq!(handles.len(), n - 1, "the others' handles: {handles:?}");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn revoke_quiesces_a_stuck_communicator_or_is_unsupported() {
    let Some(layout) = processes(
        "revoke_quiesces_a_stuck_communicator_or_is_unsupported",
        NETWORK,
        3,
    ) else {
        return;
    };
    let n = layout.size();
    let dir = scratch_dir("ft-revoke");
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let ranks: Vec<usize> = (0..n).collect();
    let children = spawn(
        "child_revoke",
        &layout,
        &ranks,
        n,
        &id,
        &[var(DIR_ENV, dir.display())],
    );
    let lines = children.finish(Duration::from_secs(180));
    let _ = std::fs::remove_dir_all(&dir);
    let done = fields(&lines, "REVOKE_DONE", "rank");
    assert_eq!(done.len(), n, "every rank: {done:?}");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn grow_adds_a_rank_or_is_unsupported() {
    let Some(layout) = processes("grow_adds_a_rank_or_is_unsupported", NETWORK, 3) else {
        return;
    };
    let n = layout.size();
    let dir = scratch_dir("ft-grow");
    let id = UniqueId::new().expect("ncclGetUniqueId");
    // Ranks 0..n-1 form the communicator; rank n - 1 joins it by growing it to n ranks.
    let ranks: Vec<usize> = (0..n).collect();
    let children = spawn(
        "child_grow",
        &layout,
        &ranks,
        n - 1,
        &id,
        &[var(DIR_ENV, dir.display())],
    );
    let lines = children.finish(Duration::from_secs(180));
    let _ = std::fs::remove_dir_all(&dir);
    let done = fields(&lines, "GROW_DONE", "rank");
    assert_eq!(done.len(), n, "every rank, the new one included: {done:?}");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn abort_from_another_thread_waits_for_an_open_group() {
    // One rank on GPU 0: the point is the group and the thread, not the peers.
    if gpus_or_skip("abort_from_another_thread_waits_for_an_open_group", 1).is_none() {
        return;
    }
    let stream = CudaContext::new(0).unwrap().new_stream().unwrap();
    let id = UniqueId::new().unwrap();
    let config = CommConfig::new()
        .blocking(false)
        .ready_timeout(Duration::from_secs(60));
    let comm = Comm::init_rank_with_config(stream.clone(), &id, 0, 1, &config).unwrap();
    let handle = comm.abort_handle().unwrap();
    let mut buf: CudaSlice<f32> = stream.clone_htod(&[1.0f32; 256]).unwrap();

    let mut group = Group::start().unwrap();
    group
        .enqueue(
            &comm,
            Operation::all_reduce_in_place(&mut buf, ReduceOp::Sum),
        )
        .unwrap();
    // Abort from another thread while the group is open: deferred to its end.
    let from_thread = {
        let handle = handle.clone();
        std::thread::spawn(move || handle.abort()).join().unwrap()
    };
    assert_eq!(from_thread.unwrap(), AbortOutcome::Deferred);
    assert!(
        !handle.is_released(),
        "NCCL must not free it inside the group"
    );
    let err = group.finish().unwrap_err();
    println!("group after a deferred abort: {err}");
    assert!(err.to_string().contains("AbortHandle"), "{err}");
    assert!(handle.is_released());
    assert_eq!(handle.abort().unwrap(), AbortOutcome::AlreadyReleased);
    let err = comm
        .all_reduce_in_place(&mut buf, ReduceOp::Sum)
        .unwrap_err();
    assert!(
        err.to_string().contains("aborted through an AbortHandle"),
        "{err}"
    );
    assert!(comm.failure().is_some());
    comm.abort().unwrap(); // no-op

    // Blocking communicators refuse abort handles and watchdogs.
    let blocking = Comm::init_rank(stream.clone(), &UniqueId::new().unwrap(), 0, 1).unwrap();
    assert!(matches!(
        blocking.abort_handle(),
        Err(Error::InvalidUsage(_))
    ));
    assert!(matches!(
        blocking.watchdog(Duration::from_secs(1)),
        Err(Error::InvalidUsage(_))
    ));

    // A healthy nonblocking communicator under a watchdog works and is not tripped.
    let comm =
        Comm::init_rank_with_config(stream.clone(), &UniqueId::new().unwrap(), 0, 1, &config)
            .unwrap();
    let watchdog = comm.watchdog(Duration::from_secs(2)).unwrap();
    for _ in 0..50 {
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
        comm.synchronize_timeout(Duration::from_secs(10)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(watchdog.trip().is_none(), "{:?}", watchdog.trip());
    assert!(watchdog.is_watching());
    drop(watchdog);
    comm.finalize().unwrap();
    comm.destroy().unwrap();
}

// -------------------------------------------------------------------------------------------
// Child side
// -------------------------------------------------------------------------------------------

struct Spec {
    rank: usize,
    size: usize,
    /// The id the parent made; `None` when the ranks exchange one themselves, as the ranks of
    /// a multi-node job do (see `join_as_a_node`).
    id: Option<UniqueId>,
}

fn child_spec() -> Option<Spec> {
    let spec = std::env::var(CHILD_ENV).ok()?;
    let mut parts = spec.splitn(3, ',');
    let rank = parts.next()?.parse().expect("rank");
    let size = parts.next()?.parse().expect("size");
    let id = parts.next().map(|hex| hex.parse().expect("id hex"));
    Some(Spec { rank, size, id })
}

impl Spec {
    /// The parent's id, for the tests that always pass one.
    fn id(&self) -> UniqueId {
        self.id
            .unwrap_or_else(|| panic!("rank {}: the parent passed no unique id", self.rank))
    }
}

fn env_path(name: &str) -> PathBuf {
    PathBuf::from(std::env::var(name).unwrap_or_else(|_| panic!("{name} not set")))
}

/// A stream on the GPU of `rank` (the parent's layout says which: see `common::shape`).
fn stream_for(rank: usize) -> Arc<CudaStream> {
    let device = child_device(rank);
    CudaContext::new(device)
        .and_then(|ctx| ctx.new_stream())
        .unwrap_or_else(|e| panic!("rank {rank}: a stream on GPU {device}: {e}"))
}

/// This rank's communicator under `config`, and its stream: on GPU `rank` from the parent's
/// id, or without one as a rank of a multi-node job joins (`join_as_a_node`).
fn join(spec: &Spec, config: &CommConfig) -> (Comm, Arc<CudaStream>) {
    let Some(id) = &spec.id else {
        return join_as_a_node(spec, config);
    };
    let stream = stream_for(spec.rank);
    let comm = Comm::init_rank_with_config(stream.clone(), id, spec.rank, spec.size, config)
        .unwrap_or_else(|e| panic!("rank {}: init: {e}", spec.rank));
    (comm, stream)
}

/// Joins as a rank alone on its machine joins a multi-node job: rank and size from the
/// launcher's variables, the one GPU it sees, the id from rank 0 over the TCP rendezvous at
/// `MASTER_ADDR`. (`Comm::from_env` does the same with a blocking communicator; detecting a
/// dead peer needs a nonblocking one.)
fn join_as_a_node(spec: &Spec, config: &CommConfig) -> (Comm, Arc<CudaStream>) {
    let rank = spec.rank;
    let launch =
        Placement::from_env().unwrap_or_else(|e| panic!("rank {rank}: Placement::from_env: {e}"));
    assert_eq!(
        (launch.rank, launch.world_size, launch.local_rank),
        (rank, spec.size, 0),
        "rank {rank}: {launch:?}"
    );
    let exchange = Exchange::from_env(&launch)
        .unwrap_or_else(|e| panic!("rank {rank}: Exchange::from_env: {e}"));
    assert!(
        matches!(exchange, Exchange::Tcp(_)),
        "rank {rank}: ranks on several machines exchange the id over TCP, not {exchange:?}"
    );
    let visible =
        nccl::library::cuda_device_count().unwrap_or_else(|e| panic!("rank {rank}: no GPU: {e}"));
    assert_eq!(visible, 1, "rank {rank}: one GPU per simulated node");
    let stream = CudaContext::new(0)
        .and_then(|ctx| ctx.new_stream())
        .unwrap_or_else(|e| panic!("rank {rank}: a stream on its GPU: {e}"));
    let id = exchange_id(&launch, exchange)
        .unwrap_or_else(|e| panic!("rank {rank}: the id exchange over TCP: {e}"));
    let comm = Comm::init_rank_with_config(stream.clone(), &id, rank, spec.size, config)
        .unwrap_or_else(|e| panic!("rank {rank}: init: {e}"));
    (comm, stream)
}

fn nonblocking(ready: Duration) -> CommConfig {
    CommConfig::new().blocking(false).ready_timeout(ready)
}

/// Integer-valued random floats (sums of a few stay exact).
fn input(rank: usize, iter: u64, len: usize) -> Vec<f32> {
    let mut rng = Rng::new(iter * 1000 + rank as u64 + 17);
    (0..len).map(|_| rng.range(-8, 8) as f32).collect()
}

/// Checks `got` against the sum of `ranks`' inputs of iteration `iter`, naming the first
/// wrong elements.
fn check_sum(what: &str, got: &[f32], ranks: &[usize], iter: u64) {
    let inputs: Vec<Vec<f32>> = ranks.iter().map(|&r| input(r, iter, got.len())).collect();
    let bad: Vec<(usize, f32, f32)> = got
        .iter()
        .enumerate()
        .map(|(i, v)| (i, *v, inputs.iter().map(|x| x[i]).sum::<f32>()))
        .filter(|(_, v, want)| v != want)
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} elements wrong (sum over ranks {ranks:?}); first (index, got, want): {:?}",
        bad.len(),
        got.len(),
        &bad[..bad.len().min(5)]
    );
}

#[test]
#[ignore = "child process of the kill tests"]
fn child_kill_and_shrink() {
    let Some(spec) = child_spec() else {
        return;
    };
    let (rank, size) = (spec.rank, spec.size);
    let dir = env_path(DIR_ENV);
    let dead: usize = std::env::var(DEAD_ENV).unwrap().parse().unwrap();
    let watchdog_mode = std::env::var(MODE_ENV).as_deref() == Ok("watchdog");
    let (mut comm, stream) = join(&spec, &nonblocking(Duration::from_secs(120)));
    // Creation may take long; from now on a call stuck in progress is a failure.
    comm.set_ready_timeout(DETECT);
    let watchdog = watchdog_mode.then(|| {
        comm.watchdog_with(WatchdogOptions::new(DETECT).action(WatchdogAction::Report))
            .expect("watchdog")
    });

    let send = stream.clone_htod(&input(rank, 0, LEN)).unwrap();
    let mut recv: CudaSlice<f32> = stream.alloc_zeros(LEN).unwrap();
    let all: Vec<usize> = (0..size).collect();
    let expected: Vec<f32> = {
        let inputs: Vec<Vec<f32>> = all.iter().map(|&r| input(r, 0, LEN)).collect();
        (0..LEN)
            .map(|i| inputs.iter().map(|x| x[i]).sum())
            .collect()
    };
    let loop_start = Instant::now();
    let mut iter = 0u64;
    let mut wrong_result = false;
    let (error, waited) = loop {
        assert!(
            loop_start.elapsed() < Duration::from_secs(150),
            "rank {rank}: no failure seen after {iter} iterations"
        );
        let wait_start = Instant::now();
        let result = comm
            .all_reduce(&send, &mut recv, ReduceOp::Sum)
            .and_then(|()| {
                if watchdog_mode {
                    // No timeout of our own: the watchdog ends the wait.
                    comm.synchronize()
                } else {
                    comm.synchronize_timeout(DETECT)
                }
            });
        match result {
            Ok(()) => {}
            Err(err) => break (err, wait_start.elapsed()),
        }
        // Every result is checked: when the other survivors abort, NCCL may release a rank
        // stuck in the same collective with a partial result instead of an error.
        let got = stream.clone_dtoh(&recv).unwrap();
        let wrong = got.iter().zip(&expected).filter(|(g, w)| g != w).count();
        if wrong > 0 {
            wrong_result = true;
            let err = nccl::Error::InvalidUsage(format!(
                "rank {rank}: iteration {iter} finished with {wrong} wrong elements; a peer failed"
            ));
            break (err, wait_start.elapsed());
        }
        iter += 1;
        if rank == dead && iter == 5 {
            std::fs::write(dir.join(format!("ready-{rank}")), b"").unwrap();
        }
    };
    assert_ne!(rank, dead, "the killed rank cannot get here");
    let detected_at = epoch_ms();
    println!(
        "DETECTED rank={rank} at_ms={detected_at} waited_ms={} iterations={iter} fatal={} error={error}",
        waited.as_millis(),
        error.is_fatal()
    );
    assert!(
        error.is_fatal() || wrong_result,
        "rank {rank}: not fatal: {error}"
    );
    assert!(
        waited <= DETECT + Duration::from_secs(1),
        "rank {rank}: the failing wait took {waited:?}"
    );
    if let Some(watchdog) = &watchdog {
        let trip = watchdog.trip().expect("the watchdog tripped");
        println!("watchdog trip: {} ({:?})", trip.reason, trip.action);
        assert!(
            error.to_string().contains("watchdog"),
            "rank {rank}: {error}"
        );
    }

    // Continue with the survivors. The watchdog variant calls NCCL's shrink itself (aborting
    // what is stuck on the parent) and later drops the dead parent without aborting it; the
    // others use `recover`: shrink where NCCL allows it, otherwise a rebuild from a fresh id
    // shared through a rendezvous: over TCP between (simulated) machines, else a file.
    let start = Instant::now();
    let config = nonblocking(Duration::from_secs(60));
    let socket = std::env::var("NCCL_P2P_DISABLE").as_deref() == Ok("1");
    let recover = |comm: &Comm| {
        comm.recover(&[dead], Some(&config), |survivor, id| {
            let wait = Duration::from_secs(90);
            let id = match std::env::var(SURVIVORS_ADDR_ENV) {
                Ok(addr) => TcpRendezvous::new(addr, survivor.rank, survivor.size)
                    .with_job_key("survivors")
                    .with_timeout(wait)
                    .exchange(id)?,
                Err(_) => FileRendezvous::new(&dir, survivor.rank, survivor.size)
                    .with_job_key("survivors")
                    .with_timeout(wait)
                    .exchange(id)?,
            };
            Ok(id)
        })
        .unwrap_or_else(|e| panic!("rank {rank}: recovery failed: {e}"))
    };
    // NCCL's source (2.28 to 2.32) sets no lower bound on a shrunk communicator's size, so a
    // lone survivor shrinks like several do; should a version refuse, it rebuilds instead.
    let lone = size == 2;
    let (survivors, shrink_error) = if watchdog_mode && !socket {
        match comm.shrink(&[dead], ShrinkMode::Abort, Some(&config)) {
            Ok(shrunk) => (shrunk, None),
            Err(err) if lone => {
                println!("rank {rank}: NCCL would not shrink to one rank: {err}");
                (recover(&comm).comm, Some(err))
            }
            Err(err) => panic!("rank {rank}: shrink failed: {err}"),
        }
    } else {
        let recovered = recover(&comm);
        (recovered.comm, recovered.shrink_error)
    };
    match &shrink_error {
        None => println!("RECOVERY_SHRUNK rank={rank} in {:?}", start.elapsed()),
        Some(err) => println!(
            "RECOVERY_REBUILT rank={rank} in {:?}; NCCL could not shrink: {err}",
            start.elapsed()
        ),
    }
    if !socket && !lone {
        // Over NVLink the dead peer only stalls its neighbours, and NCCL shrinks.
        assert!(shrink_error.is_none(), "rank {rank}: {shrink_error:?}");
    }
    assert_eq!(survivors.size(), size - 1, "rank {rank}: survivors' size");
    assert_eq!(
        survivors.rank(),
        if rank < dead { rank } else { rank - 1 },
        "rank {rank}: rank among the survivors (rank {dead} died)"
    );
    drop(watchdog);
    // After `shrink` the dead parent is still live: dropping it must abort it without
    // hanging on the dead peer. After `recover` it is already aborted and drop does nothing.
    let start = Instant::now();
    drop(comm);
    let dropped = start.elapsed();
    println!("rank {rank}: dropping the parent took {dropped:?}");
    assert!(dropped < Duration::from_secs(20), "{dropped:?}");

    // Several all-reduces on the survivors (one rank alone on 2 GPUs), random data each time,
    // checked against the host.
    let alive: Vec<usize> = (0..size).filter(|&r| r != dead).collect();
    for iter in 1..=8u64 {
        let send = stream.clone_htod(&input(rank, iter, LEN)).unwrap();
        let mut recv: CudaSlice<f32> = stream.alloc_zeros(LEN).unwrap();
        survivors
            .all_reduce(&send, &mut recv, ReduceOp::Sum)
            .and_then(|()| survivors.synchronize_timeout(Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("rank {rank}: all-reduce {iter} of the survivors: {e}"));
        let got = stream.clone_dtoh(&recv).unwrap();
        check_sum(
            &format!("rank {rank}: all-reduce {iter} of the survivors"),
            &got,
            &alive,
            iter,
        );
    }
    survivors.finalize().unwrap();
    survivors.destroy().unwrap();
    println!("SURVIVED rank={rank} size={}", size - 1);
}

#[test]
#[ignore = "child process of rank_that_never_joins_init_times_out_cleanly"]
fn child_never_joins() {
    let Some(spec) = child_spec() else {
        return;
    };
    let (rank, size, id) = (spec.rank, spec.size, spec.id());
    let stream = stream_for(rank);
    let timeout = Duration::from_secs(5);
    let start = Instant::now();
    let result =
        Comm::init_rank_with_config(stream.clone(), &id, rank, size, &nonblocking(timeout));
    let took = start.elapsed();
    // Judged after the recovery below, so that a wrong outcome here never strands the other
    // ranks waiting for this one in the new communicator.
    let verdict = judge_never_joined(rank, size, timeout, took, result.map(drop));

    // The process is still fine: the ranks that started build a communicator of their own
    // (of one rank on 2 GPUs).
    let started: Vec<usize> = (0..size - 1).collect();
    let id2: UniqueId = std::env::var(ID2_ENV).unwrap().parse().unwrap();
    let comm = Comm::init_rank_with_config(
        stream.clone(),
        &id2,
        rank,
        started.len(),
        &nonblocking(Duration::from_secs(60)),
    )
    .unwrap_or_else(|e| panic!("rank {rank}: a new communicator: {e}"));
    let mut buf = stream.clone_htod(&input(rank, 3, 4096)).unwrap();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)
        .and_then(|()| comm.synchronize_timeout(Duration::from_secs(30)))
        .unwrap_or_else(|e| panic!("rank {rank}: all-reduce in the new communicator: {e}"));
    check_sum(
        &format!("rank {rank}: all-reduce in the new communicator"),
        &stream.clone_dtoh(&buf).unwrap(),
        &started,
        3,
    );
    println!("RECOVERED rank={rank} size={}", started.len());
    if let Err(why) = verdict {
        panic!("{why}");
    }
}

/// What a rank that joined a creation another rank never joins must see (see
/// `CommConfig::ready_timeout`): within the timeout and the abort that follows it, either its
/// own `Timeout` or the remote error of a peer that gave up a moment earlier, saying so.
/// Prints `TIMED_OUT` or `PEER_GAVE_UP` for the parent.
fn judge_never_joined(
    rank: usize,
    size: usize,
    timeout: Duration,
    took: Duration,
    result: nccl::Result<()>,
) -> Result<(), String> {
    let err = match result {
        Ok(()) => {
            return Err(format!(
                "rank {rank}: init completed without rank {}",
                size - 1
            ))
        }
        Err(err) => err,
    };
    let text = err.to_string();
    match &err {
        Error::Timeout { .. } => {
            println!(
                "TIMED_OUT rank={rank} after_ms={} error={text}",
                took.as_millis()
            );
            if !(text.contains(&format!("rank {rank} of {size}"))
                && text.contains("every rank must join"))
            {
                return Err(format!("rank {rank}: the timeout does not say why: {text}"));
            }
        }
        Error::Nccl {
            code: ResultCode::RemoteError | ResultCode::SystemError,
            ..
        } => {
            println!(
                "PEER_GAVE_UP rank={rank} after_ms={} error={text}",
                took.as_millis()
            );
            if !text.contains("another rank gave up first") {
                return Err(format!(
                    "rank {rank}: the remote error does not say why: {text}"
                ));
            }
        }
        _ => {
            return Err(format!(
                "rank {rank}: expected a timeout or a remote error: {err:?}"
            ))
        }
    }
    // The timeout, plus the abort of the half-made communicator: no hang.
    if took > timeout + Duration::from_secs(3) {
        return Err(format!("rank {rank}: the failed init took {took:?}"));
    }
    Ok(())
}

#[test]
#[ignore = "child process of nonblocking_communicators_match_blocking_ones"]
fn child_nonblocking_vs_blocking() {
    let Some(spec) = child_spec() else {
        return;
    };
    let (rank, size, id) = (spec.rank, spec.size, spec.id());
    let id2: UniqueId = std::env::var(ID2_ENV).unwrap().parse().unwrap();
    let stream = stream_for(rank);
    let blocking = Comm::init_rank(stream.clone(), &id, rank, size).expect("blocking init");
    let nb = Comm::init_rank_with_config(
        stream.clone(),
        &id2,
        rank,
        size,
        &nonblocking(Duration::from_secs(120)),
    )
    .expect("nonblocking init");
    assert!(blocking.is_blocking() && !nb.is_blocking());
    assert_eq!((nb.rank(), nb.size()), (rank, size));

    // Same inputs through both: identical outputs (integer-valued floats, so exact).
    let all: Vec<usize> = (0..size).collect();
    for iter in 0..4u64 {
        let data = input(rank, iter, 1 << 16);
        let mut outs = Vec::new();
        for comm in [&blocking, &nb] {
            let send = stream.clone_htod(&data).unwrap();
            let mut recv: CudaSlice<f32> = stream.alloc_zeros(data.len()).unwrap();
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
            let mut gathered: CudaSlice<f32> = stream.alloc_zeros(data.len() * size).unwrap();
            comm.all_gather(&send, &mut gathered).unwrap();
            comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
            outs.push((
                stream.clone_dtoh(&recv).unwrap(),
                stream.clone_dtoh(&gathered).unwrap(),
            ));
        }
        assert!(
            outs[0] == outs[1],
            "iteration {iter}: blocking and nonblocking differ"
        );
        check_sum("nonblocking all-reduce", &outs[1].0, &all, iter);
    }

    // A group on the nonblocking communicator (ncclGroupEnd may return in progress).
    let mut a = stream.clone_htod(&input(rank, 10, 1000)).unwrap();
    let mut b = stream.clone_htod(&input(rank, 11, 1000)).unwrap();
    let mut group = Group::start().unwrap();
    group
        .enqueue(&nb, Operation::all_reduce_in_place(&mut a, ReduceOp::Sum))
        .unwrap();
    group
        .enqueue(&nb, Operation::all_reduce_in_place(&mut b, ReduceOp::Sum))
        .unwrap();
    group.finish().unwrap();
    nb.synchronize_timeout(Duration::from_secs(60)).unwrap();
    check_sum("group a", &stream.clone_dtoh(&a).unwrap(), &all, 10);
    check_sum("group b", &stream.clone_dtoh(&b).unwrap(), &all, 11);

    // A nonblocking split, then the parent is used right away (it must be ready again).
    let half = nb
        .split(Some((rank % 2) as u32), rank as i32)
        .unwrap()
        .unwrap();
    assert!(!half.is_blocking());
    let mut c = stream.clone_htod(&input(rank, 12, 1000)).unwrap();
    nb.all_reduce_in_place(&mut c, ReduceOp::Sum).unwrap();
    let mut d = stream.clone_htod(&input(rank, 13, 1000)).unwrap();
    half.all_reduce_in_place(&mut d, ReduceOp::Sum).unwrap();
    nb.synchronize_timeout(Duration::from_secs(60)).unwrap();
    half.synchronize_timeout(Duration::from_secs(60)).unwrap();
    check_sum(
        "parent after split",
        &stream.clone_dtoh(&c).unwrap(),
        &all,
        12,
    );
    let mine: Vec<usize> = (0..size).filter(|q| q % 2 == rank % 2).collect();
    check_sum("half", &stream.clone_dtoh(&d).unwrap(), &mine, 13);
    half.finalize().unwrap();
    half.destroy().unwrap();

    // Every collective, element type and reduction through the nonblocking communicator,
    // checked against the host (the blocking ones are checked by `gpu_multi_process`).
    blocking.finalize().unwrap();
    blocking.destroy().unwrap();
    let ranks = Ranks {
        comms: vec![nb],
        size,
    };
    let checked = run_all_types(&ranks, 65);
    assert!(checked > 200, "{checked}");
    for comm in ranks.comms {
        comm.finalize().unwrap();
        comm.destroy().unwrap();
    }
    println!("MATCHED rank={rank} checked={checked}");
}

#[test]
#[ignore = "child process of watchdog_and_abort_handle_end_a_stuck_collective"]
fn child_watchdog() {
    let Some(spec) = child_spec() else {
        return;
    };
    let (rank, size, id) = (spec.rank, spec.size, spec.id());
    let dir = env_path(DIR_ENV);
    let stream = stream_for(rank);
    let comm = Comm::init_rank_with_config(
        stream.clone(),
        &id,
        rank,
        size,
        &nonblocking(Duration::from_secs(120)),
    )
    .expect("init");
    let mut buf = stream.clone_htod(&input(rank, 0, 1 << 16)).unwrap();
    // One all-reduce together, so connections are up.
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    comm.synchronize_timeout(Duration::from_secs(60)).unwrap();

    if rank == 0 {
        // The other ranks never join this all-reduce: it hangs until the watchdog aborts it.
        let timeout = Duration::from_secs(3);
        let watchdog = comm.watchdog(timeout).unwrap();
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
        let start = Instant::now();
        let err = comm.synchronize().unwrap_err();
        let waited = start.elapsed();
        println!("rank 0: synchronize ended after {waited:?}: {err}");
        assert!(waited <= timeout + Duration::from_secs(1), "{waited:?}");
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("aborted by its watchdog"), "{err}");
        let trip = watchdog.trip().expect("tripped");
        assert_eq!(trip.action, WatchdogAction::Abort);
        assert!(trip.action_error.is_none(), "{:?}", trip.action_error);
        let err = comm
            .all_reduce_in_place(&mut buf, ReduceOp::Sum)
            .unwrap_err();
        assert!(err.to_string().contains("watchdog"), "{err}");
        drop(watchdog);
        comm.abort().unwrap(); // already aborted: a no-op
        std::fs::write(dir.join("rank0-done"), b"").unwrap();
        println!("WATCHDOG_OK rank=0 waited_ms={}", waited.as_millis());
    } else {
        // Wait until rank 0 is done, then abort from another thread through a handle.
        assert!(wait_for_file(
            &dir.join("rank0-done"),
            Duration::from_secs(60)
        ));
        let handle = comm.abort_handle().unwrap();
        let outcome = std::thread::spawn(move || handle.abort()).join().unwrap();
        assert_eq!(outcome.unwrap(), AbortOutcome::Aborted);
        let err = comm
            .all_reduce_in_place(&mut buf, ReduceOp::Sum)
            .unwrap_err();
        assert!(err.to_string().contains("AbortHandle"), "{err}");
        let err = comm.synchronize().unwrap_err();
        assert!(err.to_string().contains("AbortHandle"), "{err}");
        let start = Instant::now();
        drop(comm); // nothing left to do, and no hang
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "rank {rank}: drop took {:?}",
            start.elapsed()
        );
        println!("HANDLE_OK rank={rank}");
    }
}

#[test]
#[ignore = "child process of revoke_quiesces_a_stuck_communicator_or_is_unsupported"]
fn child_revoke() {
    let Some(spec) = child_spec() else {
        return;
    };
    let (rank, size, id) = (spec.rank, spec.size, spec.id());
    let dir = env_path(DIR_ENV);
    let stream = stream_for(rank);
    let config = nonblocking(Duration::from_secs(120));
    let comm = Comm::init_rank_with_config(stream.clone(), &id, rank, size, &config).unwrap();
    let version = nccl::version().unwrap();
    if version < Version::new(2, 28, 7) {
        match comm.revoke() {
            Err(Error::Unsupported { api, needs, found }) => {
                assert_eq!(api, "ncclCommRevoke");
                assert_eq!(needs, Version::new(2, 28, 7));
                assert_eq!(found, version);
            }
            other => panic!("revoke on NCCL {version}: {other:?}"),
        }
        assert!(
            comm.failure().is_none(),
            "an unsupported call changes nothing"
        );
        println!("REVOKE_DONE rank={rank} unsupported=1 version={version}");
        return;
    }
    let mut buf = stream.clone_htod(&input(rank, 0, 1 << 16)).unwrap();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
    if rank == 0 {
        // The other ranks skip this all-reduce: it hangs until revoked.
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
        let err = comm
            .synchronize_timeout(Duration::from_secs(3))
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        let start = Instant::now();
        comm.revoke().unwrap();
        println!("rank 0: revoke took {:?}", start.elapsed());
        comm.revoke().unwrap(); // again: a no-op
        let err = comm
            .all_reduce_in_place(&mut buf, ReduceOp::Sum)
            .unwrap_err();
        assert!(err.to_string().contains("revoked"), "{err}");
        assert!(comm.failure().is_some());
        // A revoked communicator still shrinks: rank 0 goes on alone.
        let others: Vec<usize> = (1..size).collect();
        let alone = comm
            .shrink(&others, ShrinkMode::Default, Some(&config))
            .unwrap_or_else(|e| panic!("rank 0: shrink of the revoked communicator: {e}"));
        assert_eq!((alone.rank(), alone.size()), (0, 1));
        let mut one = stream.clone_htod(&input(0, 5, 1000)).unwrap();
        alone.all_reduce_in_place(&mut one, ReduceOp::Sum).unwrap();
        alone.synchronize_timeout(Duration::from_secs(30)).unwrap();
        check_sum("alone", &stream.clone_dtoh(&one).unwrap(), &[0], 5);
        comm.abort().unwrap();
        std::fs::write(dir.join("rank0-done"), b"").unwrap();
    } else {
        assert!(wait_for_file(
            &dir.join("rank0-done"),
            Duration::from_secs(90)
        ));
        comm.abort().unwrap();
    }
    println!("REVOKE_DONE rank={rank} unsupported=0 version={version}");
}

#[test]
#[ignore = "child process of grow_adds_a_rank_or_is_unsupported"]
fn child_grow() {
    let Some(spec) = child_spec() else {
        return;
    };
    let (rank, size, id) = (spec.rank, spec.size, spec.id());
    let dir = env_path(DIR_ENV);
    let stream = stream_for(rank);
    let config = nonblocking(Duration::from_secs(120));
    let version = nccl::version().unwrap();
    let supported = version >= Version::new(2, 29, 0);
    let unsupported = |result: nccl::Result<()>, what: &str| match result {
        Err(Error::Unsupported { needs, found, .. }) => {
            assert_eq!(needs, Version::new(2, 29, 0), "{what}");
            assert_eq!(found, version, "{what}");
        }
        other => panic!("{what} on NCCL {version}: {other:?}"),
    };
    let new_size = size + 1;
    if rank >= size {
        // The new rank.
        if !supported {
            let fake = UniqueId::from_bytes([0; 128]);
            unsupported(
                Comm::join_grow(stream.clone(), &fake, rank, new_size, Some(&config)).map(drop),
                "join_grow",
            );
            println!("GROW_DONE rank={rank} unsupported=1 version={version}");
            return;
        }
        let id_file = dir.join("grow-id");
        assert!(wait_for_file(&id_file, Duration::from_secs(90)));
        let text = std::fs::read_to_string(&id_file).unwrap();
        let grow_id: UniqueId = text.trim().parse().unwrap();
        let grown = Comm::join_grow(stream.clone(), &grow_id, rank, new_size, Some(&config))
            .expect("join_grow");
        grown_all_reduce(&grown, &stream, rank, new_size);
        grown.finalize().unwrap();
        grown.destroy().unwrap();
        println!("GROW_DONE rank={rank} unsupported=0 version={version}");
        return;
    }
    let comm = Comm::init_rank_with_config(stream.clone(), &id, rank, size, &config).unwrap();
    if !supported {
        unsupported(
            comm.get_unique_id_for_grow().map(drop),
            "get_unique_id_for_grow",
        );
        unsupported(comm.grow(new_size, None, None).map(drop), "grow");
        assert!(comm.failure().is_none());
        comm.finalize().unwrap();
        comm.destroy().unwrap();
        println!("GROW_DONE rank={rank} unsupported=1 version={version}");
        return;
    }
    let grow_id = if rank == 0 {
        let grow_id = comm.get_unique_id_for_grow().unwrap();
        let tmp = dir.join("grow-id.tmp");
        std::fs::write(&tmp, grow_id.to_string()).unwrap();
        std::fs::rename(&tmp, dir.join("grow-id")).unwrap();
        Some(grow_id)
    } else {
        None
    };
    let grown = comm
        .grow(new_size, grow_id.as_ref(), Some(&config))
        .expect("grow");
    assert_eq!((grown.rank(), grown.size()), (rank, new_size));
    comm.destroy().unwrap();
    grown_all_reduce(&grown, &stream, rank, new_size);
    grown.finalize().unwrap();
    grown.destroy().unwrap();
    println!("GROW_DONE rank={rank} unsupported=0 version={version}");
}

fn grown_all_reduce(comm: &Comm, stream: &Arc<CudaStream>, rank: usize, size: usize) {
    let mut buf = stream.clone_htod(&input(rank, 7, 4096)).unwrap();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    comm.synchronize_timeout(Duration::from_secs(30)).unwrap();
    let all: Vec<usize> = (0..size).collect();
    check_sum("grown", &stream.clone_dtoh(&buf).unwrap(), &all, 7);
}
