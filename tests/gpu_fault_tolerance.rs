//! Fault tolerance on real GPUs: a rank killed with SIGKILL mid-loop (over NVLink/P2P and over
//! the socket transport), a rank that never joins init, the watchdog, abort handles, revoke,
//! shrink and grow, and nonblocking communicators against blocking ones.
//!
//! Like `gpu_multi_process`, the parent test re-executes its own binary once per rank (the
//! `child_*` tests, which do nothing unless started that way) and passes the rank, size and
//! unique id in the environment; it kills children with SIGKILL when a test asks for it, and
//! on its own deadline. Run on a host with 4 GPUs:
//!
//! ```text
//! cargo test --release --test gpu_fault_tolerance -- --include-ignored --test-threads=1 --nocapture
//! ```

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use nccl::{
    AbortOutcome, Collective, Comm, CommConfig, Error, Group, ReduceOp, ShrinkMode, UniqueId,
    Version, WatchdogAction, WatchdogOptions,
};

use common::{run_all_types, wait_children, Ranks, Rng};

const CHILD_ENV: &str = "NCCL_RS_FT_CHILD";
const DIR_ENV: &str = "NCCL_RS_FT_DIR";
const DEAD_ENV: &str = "NCCL_RS_FT_DEAD";
const MODE_ENV: &str = "NCCL_RS_FT_MODE";
const ID2_ENV: &str = "NCCL_RS_FT_ID2";

/// The failure-detection timeout of the kill tests.
const DETECT: Duration = Duration::from_secs(5);
/// Elements per all-reduce in the kill tests (4 MiB of f32).
const LEN: usize = 1 << 20;

// -------------------------------------------------------------------------------------------
// Parent side
// -------------------------------------------------------------------------------------------

fn gpu_count(min: usize) -> usize {
    let count = CudaContext::device_count().expect("CUDA driver") as usize;
    assert!(
        count >= min,
        "this test needs {min} CUDA GPUs, found {count}"
    );
    count
}

fn epoch_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// A scratch directory for files the processes coordinate through.
fn scratch_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nccl-rs-ft-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

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

/// Child processes of one test, with their stdout forwarded and kept.
struct Children {
    test: &'static str,
    procs: Vec<(usize, Child)>,
    lines: Arc<Mutex<Vec<(usize, String)>>>,
    readers: Vec<JoinHandle<()>>,
}

impl Children {
    /// Starts `test` as ranks `ranks` of `size`, with `env` added to the environment (which
    /// is otherwise inherited, `NCCL_NVLS_ENABLE` included).
    fn spawn(
        test: &'static str,
        ranks: &[usize],
        size: usize,
        id: &UniqueId,
        env: &[(&str, String)],
    ) -> Children {
        let exe = std::env::current_exe().expect("current_exe");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let mut procs = Vec::new();
        let mut readers = Vec::new();
        for &rank in ranks {
            let mut child = Command::new(&exe)
                .args([
                    test,
                    "--exact",
                    "--include-ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_ENV, format!("{rank},{size},{id}"))
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn child");
            let stdout = child.stdout.take().expect("piped stdout");
            let sink = lines.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    println!("[{test} rank {rank}] {line}");
                    sink.lock().unwrap().push((rank, line));
                }
            }));
            procs.push((rank, child));
        }
        Children {
            test,
            procs,
            lines,
            readers,
        }
    }

    /// Whether any child has exited already (with the statuses of those that have).
    fn exited(&mut self) -> Vec<(usize, String)> {
        self.procs
            .iter_mut()
            .filter_map(|(rank, child)| match child.try_wait() {
                Ok(Some(status)) => Some((*rank, status.to_string())),
                _ => None,
            })
            .collect()
    }

    /// Kills `rank` with SIGKILL and reaps it; returns the kill time (ms since the epoch).
    fn kill(&mut self, rank: usize) -> u128 {
        let pos = self
            .procs
            .iter()
            .position(|(r, _)| *r == rank)
            .expect("rank to kill");
        let (_, mut child) = self.procs.remove(pos);
        child.kill().expect("SIGKILL");
        let at = epoch_ms();
        let _ = child.wait();
        at
    }

    /// Waits for every remaining child (killing all on the deadline) and fails the test if
    /// one did not succeed. Returns the lines they printed.
    fn finish(mut self, limit: Duration) -> Vec<(usize, String)> {
        let failed = wait_children(&mut self.procs, limit);
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        assert!(failed.is_empty(), "{}: {failed:?}", self.test);
        let lines = self.lines.lock().unwrap().clone();
        lines
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        // A panicking parent must not leave processes behind.
        for (_, child) in &mut self.procs {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Values of a `KEY=value` field in a child's `TAG ...` lines.
fn fields(lines: &[(usize, String)], tag: &str, key: &str) -> Vec<(usize, u128)> {
    lines
        .iter()
        // libtest may print "test name ... " before a child's first line.
        .filter_map(|(rank, line)| line.find(tag).map(|at| (rank, &line[at..])))
        .filter_map(|(rank, line)| {
            line.split_whitespace()
                .find_map(|word| word.strip_prefix(&format!("{key}=")))
                .and_then(|v| v.parse().ok())
                .map(|v| (*rank, v))
        })
        .collect()
}

/// 4 ranks all-reduce in a loop; rank 2 is killed with SIGKILL mid-loop; the 3 survivors must
/// detect it within `DETECT` + 1 s, shrink to 3 ranks and all-reduce correctly.
fn kill_and_shrink(test: &'static str, mode: &str, socket: bool) {
    gpu_count(4);
    let dead = 2;
    let dir = scratch_dir(test);
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let mut env = vec![
        (DIR_ENV, dir.display().to_string()),
        (DEAD_ENV, dead.to_string()),
        (MODE_ENV, mode.to_string()),
    ];
    if socket {
        // As between machines: no P2P, no shared memory, only the network (sockets).
        env.push(("NCCL_P2P_DISABLE", "1".into()));
        env.push(("NCCL_SHM_DISABLE", "1".into()));
        env.push(("NCCL_NET", "Socket".into()));
    }
    let mut children = Children::spawn(test, &[0, 1, 2, 3], 4, &id, &env);
    // Rank 2 says when it has finished a few iterations; kill it while it keeps going.
    let ready = dir.join(format!("ready-{dead}"));
    let start = Instant::now();
    while !ready.exists() {
        let exited = children.exited();
        assert!(
            exited.is_empty(),
            "{test}: children exited early: {exited:?}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{test}: rank {dead} never got going"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    let killed_at = children.kill(dead);
    println!("[{test}] killed rank {dead} with SIGKILL at {killed_at} ms");
    let _ = std::fs::write(dir.join("killed"), killed_at.to_string());
    let lines = children.finish(Duration::from_secs(240));
    let _ = std::fs::remove_dir_all(&dir);

    let detected = fields(&lines, "DETECTED", "at_ms");
    let survived = fields(&lines, "SURVIVED", "size");
    let mut ranks: Vec<usize> = detected.iter().map(|(r, _)| *r).collect();
    ranks.sort_unstable();
    assert_eq!(
        ranks,
        vec![0, 1, 3],
        "{test}: every survivor detects the failure"
    );
    let limit = DETECT.as_millis() + 1000;
    for (rank, at) in &detected {
        assert!(
            *at + 10 >= killed_at,
            "{test}: rank {rank} reported a failure before rank {dead} was killed"
        );
        let latency = at.saturating_sub(killed_at);
        println!(
            "[{test}] rank {rank}: failure detected {latency} ms after the kill (timeout {} ms, limit {limit} ms)",
            DETECT.as_millis()
        );
        assert!(
            latency <= limit,
            "{test}: rank {rank} detected the failure after {latency} ms, more than {limit} ms"
        );
    }
    assert_eq!(survived.len(), 3, "{test}: every survivor finishes");
    assert!(survived.iter().all(|(_, size)| *size == 3));
    let count = |tag: &str| lines.iter().filter(|(_, l)| l.contains(tag)).count();
    let (shrunk, rebuilt) = (count("RECOVERY_SHRUNK "), count("RECOVERY_REBUILT "));
    println!("[{test}] survivors that shrank: {shrunk}, that rebuilt: {rebuilt}");
    assert!(
        (shrunk, rebuilt) == (3, 0) || (shrunk, rebuilt) == (0, 3),
        "{test}: the survivors took different ways"
    );
    if !socket {
        assert_eq!(shrunk, 3, "{test}: over NVLink NCCL shrinks");
    }
}

#[test]
#[ignore = "needs 4 CUDA GPUs"]
fn killed_rank_is_detected_and_survivors_shrink_nvlink() {
    kill_and_shrink("child_kill_and_shrink", "synchronize", false);
}

#[test]
#[ignore = "needs 4 CUDA GPUs"]
fn killed_rank_is_detected_and_survivors_shrink_socket_transport() {
    kill_and_shrink("child_kill_and_shrink", "synchronize", true);
}

#[test]
#[ignore = "needs 4 CUDA GPUs"]
fn killed_rank_is_detected_by_the_watchdog_and_survivors_shrink() {
    kill_and_shrink("child_kill_and_shrink", "watchdog", false);
}

#[test]
#[ignore = "needs 4 CUDA GPUs"]
fn rank_that_never_joins_init_times_out_cleanly() {
    gpu_count(4);
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let id2 = UniqueId::new().expect("ncclGetUniqueId");
    // Ranks 0, 1 and 2 of 4 start; rank 3 never calls init.
    let children = Children::spawn(
        "child_never_joins",
        &[0, 1, 2],
        4,
        &id,
        &[(ID2_ENV, id2.to_string())],
    );
    let lines = children.finish(Duration::from_secs(180));
    let timed_out = fields(&lines, "TIMED_OUT", "after_ms");
    assert_eq!(
        timed_out.len(),
        3,
        "every started rank times out: {timed_out:?}"
    );
    let recovered = fields(&lines, "RECOVERED", "size");
    assert_eq!(
        recovered.len(),
        3,
        "every rank then works in a new communicator"
    );
}

#[test]
#[ignore = "needs 2 CUDA GPUs (uses up to 4)"]
fn nonblocking_communicators_match_blocking_ones() {
    let n = gpu_count(2).min(4);
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let id2 = UniqueId::new().expect("ncclGetUniqueId");
    let ranks: Vec<usize> = (0..n).collect();
    let children = Children::spawn(
        "child_nonblocking_vs_blocking",
        &ranks,
        n,
        &id,
        &[(ID2_ENV, id2.to_string())],
    );
    let lines = children.finish(Duration::from_secs(600));
    assert_eq!(fields(&lines, "MATCHED", "checked").len(), n);
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn watchdog_and_abort_handle_end_a_stuck_collective() {
    gpu_count(2);
    let dir = scratch_dir("watchdog");
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let children = Children::spawn(
        "child_watchdog",
        &[0, 1],
        2,
        &id,
        &[(DIR_ENV, dir.display().to_string())],
    );
    let lines = children.finish(Duration::from_secs(180));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(fields(&lines, "WATCHDOG_OK", "waited_ms").len(), 1);
    assert_eq!(fields(&lines, "HANDLE_OK", "rank").len(), 1);
}

#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn revoke_quiesces_a_stuck_communicator_or_is_unsupported() {
    gpu_count(2);
    let dir = scratch_dir("revoke");
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let children = Children::spawn(
        "child_revoke",
        &[0, 1],
        2,
        &id,
        &[(DIR_ENV, dir.display().to_string())],
    );
    let lines = children.finish(Duration::from_secs(180));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(fields(&lines, "REVOKE_DONE", "rank").len(), 2);
}

#[test]
#[ignore = "needs 3 CUDA GPUs"]
fn grow_adds_a_rank_or_is_unsupported() {
    gpu_count(3);
    let dir = scratch_dir("grow");
    let id = UniqueId::new().expect("ncclGetUniqueId");
    // Ranks 0 and 1 form the communicator; rank 2 joins it by growing.
    let children = Children::spawn(
        "child_grow",
        &[0, 1, 2],
        2,
        &id,
        &[(DIR_ENV, dir.display().to_string())],
    );
    let lines = children.finish(Duration::from_secs(180));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(fields(&lines, "GROW_DONE", "rank").len(), 3);
}

#[test]
#[ignore = "needs 1 CUDA GPU"]
fn abort_from_another_thread_waits_for_an_open_group() {
    gpu_count(1);
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
            Collective::all_reduce_in_place(&mut buf, ReduceOp::Sum),
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
    id: UniqueId,
}

fn child_spec() -> Option<Spec> {
    let spec = std::env::var(CHILD_ENV).ok()?;
    let mut parts = spec.splitn(3, ',');
    let rank = parts.next()?.parse().ok()?;
    let size = parts.next()?.parse().ok()?;
    let id = parts.next()?.parse().expect("id hex");
    Some(Spec { rank, size, id })
}

fn env_path(name: &str) -> PathBuf {
    PathBuf::from(std::env::var(name).unwrap_or_else(|_| panic!("{name} not set")))
}

fn stream_for(rank: usize) -> Arc<CudaStream> {
    let count = CudaContext::device_count().expect("CUDA driver") as usize;
    CudaContext::new(rank % count)
        .and_then(|ctx| ctx.new_stream())
        .expect("stream")
}

fn nonblocking(ready: Duration) -> CommConfig {
    CommConfig::new().blocking(false).ready_timeout(ready)
}

/// Integer-valued random floats (sums of a few stay exact).
fn input(rank: usize, iter: u64, len: usize) -> Vec<f32> {
    let mut rng = Rng::new(iter * 1000 + rank as u64 + 17);
    (0..len).map(|_| rng.range(-8, 8) as f32).collect()
}

fn check_sum(what: &str, got: &[f32], ranks: &[usize], iter: u64) {
    let inputs: Vec<Vec<f32>> = ranks.iter().map(|&r| input(r, iter, got.len())).collect();
    let bad = got
        .iter()
        .enumerate()
        .filter(|(i, v)| **v != inputs.iter().map(|x| x[*i]).sum::<f32>())
        .count();
    assert_eq!(bad, 0, "{what}: {bad} of {} elements wrong", got.len());
}

#[test]
#[ignore = "child process of the kill tests"]
fn child_kill_and_shrink() {
    let Some(Spec { rank, size, id }) = child_spec() else {
        return;
    };
    let dir = env_path(DIR_ENV);
    let dead: usize = std::env::var(DEAD_ENV).unwrap().parse().unwrap();
    let watchdog_mode = std::env::var(MODE_ENV).as_deref() == Ok("watchdog");
    let stream = stream_for(rank);
    let config = nonblocking(Duration::from_secs(120));
    let mut comm = Comm::init_rank_with_config(stream.clone(), &id, rank, size, &config)
        .expect("nonblocking init");
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
    assert!(error.is_fatal() || wrong_result, "{error}");
    assert!(
        waited <= DETECT + Duration::from_secs(1),
        "rank {rank}: the failing wait took {waited:?}"
    );
    if let Some(watchdog) = &watchdog {
        let trip = watchdog.trip().expect("the watchdog tripped");
        println!("watchdog trip: {} ({:?})", trip.reason, trip.action);
        assert!(error.to_string().contains("watchdog"), "{error}");
    }

    // Continue with the survivors. The watchdog variant calls NCCL's shrink itself (aborting
    // what is stuck on the parent) and later drops the dead parent without aborting it; the
    // others use `recover`: shrink where NCCL allows it, otherwise a rebuild from a fresh id
    // shared through the file rendezvous.
    let start = Instant::now();
    let config = nonblocking(Duration::from_secs(60));
    let socket = std::env::var("NCCL_P2P_DISABLE").as_deref() == Ok("1");
    let (survivors, shrink_error) = if watchdog_mode && !socket {
        let shrunk = comm
            .shrink(&[dead], ShrinkMode::Abort, Some(&config))
            .unwrap_or_else(|e| panic!("rank {rank}: shrink failed: {e}"));
        (shrunk, None)
    } else {
        let recovered = comm
            .recover(&[dead], Some(&config), |survivor, id| {
                let rendezvous =
                    nccl::bootstrap::FileRendezvous::new(&dir, survivor.rank, survivor.size)
                        .with_job_key("survivors")
                        .with_timeout(Duration::from_secs(90));
                Ok(rendezvous.exchange(id)?)
            })
            .unwrap_or_else(|e| panic!("rank {rank}: recovery failed: {e}"));
        (recovered.comm, recovered.shrink_error)
    };
    match &shrink_error {
        None => println!("RECOVERY_SHRUNK rank={rank} in {:?}", start.elapsed()),
        Some(err) => println!(
            "RECOVERY_REBUILT rank={rank} in {:?}; NCCL could not shrink: {err}",
            start.elapsed()
        ),
    }
    if !socket {
        // Over NVLink the dead peer only stalls its neighbours, and NCCL shrinks.
        assert!(shrink_error.is_none(), "rank {rank}: {shrink_error:?}");
    }
    assert_eq!(survivors.size(), size - 1);
    assert_eq!(survivors.rank(), if rank < dead { rank } else { rank - 1 });
    drop(watchdog);
    // After `shrink` the dead parent is still live: dropping it must abort it without
    // hanging on the dead peer. After `recover` it is already aborted and drop does nothing.
    let start = Instant::now();
    drop(comm);
    let dropped = start.elapsed();
    println!("rank {rank}: dropping the parent took {dropped:?}");
    assert!(dropped < Duration::from_secs(20), "{dropped:?}");

    // Several all-reduces on 3 ranks, random data each time, checked against the host.
    let alive: Vec<usize> = (0..size).filter(|&r| r != dead).collect();
    for iter in 1..=8u64 {
        let send = stream.clone_htod(&input(rank, iter, LEN)).unwrap();
        let mut recv: CudaSlice<f32> = stream.alloc_zeros(LEN).unwrap();
        survivors
            .all_reduce(&send, &mut recv, ReduceOp::Sum)
            .unwrap();
        survivors
            .synchronize_timeout(Duration::from_secs(30))
            .unwrap();
        let got = stream.clone_dtoh(&recv).unwrap();
        check_sum(
            &format!("rank {rank} after shrink, {iter}"),
            &got,
            &alive,
            iter,
        );
    }
    survivors.finalize().unwrap();
    survivors.destroy().unwrap();
    println!("SURVIVED rank={rank} size=3");
}

#[test]
#[ignore = "child process of rank_that_never_joins_init_times_out_cleanly"]
fn child_never_joins() {
    let Some(Spec { rank, size, id }) = child_spec() else {
        return;
    };
    let stream = stream_for(rank);
    let timeout = Duration::from_secs(5);
    let start = Instant::now();
    let result =
        Comm::init_rank_with_config(stream.clone(), &id, rank, size, &nonblocking(timeout));
    let took = start.elapsed();
    let err = match result {
        Ok(_) => panic!("rank {rank}: init completed without rank 3"),
        Err(err) => err,
    };
    println!(
        "TIMED_OUT rank={rank} after_ms={} error={err}",
        took.as_millis()
    );
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains(&format!("rank {rank} of {size}")), "{text}");
    assert!(text.contains("every rank must join"), "{text}");
    // The timeout, plus the abort of the half-made communicator: no hang.
    assert!(took <= timeout + Duration::from_secs(3), "{took:?}");

    // The process is still fine: the three ranks build a communicator of their own.
    let id2: UniqueId = std::env::var(ID2_ENV).unwrap().parse().unwrap();
    let comm = Comm::init_rank_with_config(
        stream.clone(),
        &id2,
        rank,
        3,
        &nonblocking(Duration::from_secs(60)),
    )
    .expect("a new communicator");
    let mut buf = stream.clone_htod(&input(rank, 3, 4096)).unwrap();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    comm.synchronize_timeout(Duration::from_secs(30)).unwrap();
    check_sum(
        "recovered",
        &stream.clone_dtoh(&buf).unwrap(),
        &[0, 1, 2],
        3,
    );
    println!("RECOVERED rank={rank} size=3");
}

#[test]
#[ignore = "child process of nonblocking_communicators_match_blocking_ones"]
fn child_nonblocking_vs_blocking() {
    let Some(Spec { rank, size, id }) = child_spec() else {
        return;
    };
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
        .enqueue(&nb, Collective::all_reduce_in_place(&mut a, ReduceOp::Sum))
        .unwrap();
    group
        .enqueue(&nb, Collective::all_reduce_in_place(&mut b, ReduceOp::Sum))
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
    let Some(Spec { rank, size, id }) = child_spec() else {
        return;
    };
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
        // Rank 1 never joins this all-reduce: it hangs until the watchdog aborts it.
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
        assert!(start.elapsed() < Duration::from_secs(1));
        println!("HANDLE_OK rank=1");
    }
}

#[test]
#[ignore = "child process of revoke_quiesces_a_stuck_communicator_or_is_unsupported"]
fn child_revoke() {
    let Some(Spec { rank, size, id }) = child_spec() else {
        return;
    };
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
        // Rank 1 skips this all-reduce: it hangs until revoked.
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
        let alone = comm
            .shrink(&[1], ShrinkMode::Default, Some(&config))
            .unwrap();
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
    let Some(Spec { rank, size, id }) = child_spec() else {
        return;
    };
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
