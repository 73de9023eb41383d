//! CPU tests of `nccl::bootstrap`: launcher detection, the TCP and file rendezvous (threads and
//! real processes), misbehaving peers, and `spawn_local`.
//!
//! Process tests re-execute this test binary with `NCCL_RS_TEST_ROLE` set, filtered to the
//! single test `child_role`, which plays the role and exits. Every wait is bounded and every
//! address is on 127.0.0.1.
//!
//! One file past 600 lines on purpose: every section's process tests go through that one role
//! dispatcher and its helpers, and an integration test file is its own binary, so a split
//! would build and re-execute several binaries sharing copies of them. The protocol-level
//! attacks on the TCP rendezvous live beside the code (`src/bootstrap/tcp/*tests.rs`).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nccl::bootstrap::{
    exchange_id_with, spawn_local, BootstrapError, Exchange, FileRendezvous, Launcher, Placement,
    TcpRendezvous,
};
use nccl::UniqueId;

// ---------------------------------------------------------------------------------------------
// Helpers

/// Variables given as name/value pairs.
type Vars<'a> = &'a [(&'a str, &'a str)];

fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    let map: HashMap<&str, &str> = pairs.iter().copied().collect();
    move |name| map.get(name).map(|value| (*value).to_owned())
}

fn placement(pairs: &[(&str, &str)]) -> Result<Placement, BootstrapError> {
    Placement::from_vars(vars(pairs))
}

fn sample_id(seed: u8) -> UniqueId {
    let mut bytes = [0u8; 128];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(13).wrapping_add(seed);
    }
    UniqueId::from_bytes(bytes)
}

fn unique_name(tag: &str) -> String {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{tag}-{}-{}-{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// A fresh directory under the system temp dir, removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("nccl-rs-bootstrap-{}", unique_name(tag)));
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        ScratchDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn entries(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .expect("read dir")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A TCP port that was free a moment ago (for tests where clients must know the port before
/// rank 0 binds it).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

fn tcp(addr: &str, rank: usize, world: usize, key: &str) -> TcpRendezvous {
    TcpRendezvous::new(addr, rank, world)
        .with_job_key(key)
        .with_timeout(Duration::from_secs(10))
        .with_connection_timeout(Duration::from_secs(2))
}

/// Launcher variables that must not leak from the environment running the tests into the
/// processes they start.
const LAUNCH_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "SLURM_PROCID",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "NCCL_RS_LAUNCHER",
    "NCCL_RS_LOCAL_RANKS",
    "NCCL_RS_ADDR",
    "NCCL_RS_JOB_KEY",
    "NCCL_RS_RENDEZVOUS_KEY",
    "NCCL_RS_RENDEZVOUS_DIR",
    "NCCL_RS_BOOTSTRAP_TIMEOUT",
    "NCCL_RS_UNIQUE_IDS",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// This test binary, set up to run only `child_role` with `role`.
fn role_command(role: &str) -> Command {
    let exe = std::env::current_exe().expect("current exe");
    let mut command = Command::new(exe);
    command
        .args(["--exact", "child_role", "--nocapture", "--test-threads=1"])
        .env("NCCL_RS_TEST_ROLE", role)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for var in LAUNCH_VARS {
        command.env_remove(var);
    }
    command
}

/// The `rank=...` reports in a child's output. libtest prints `test child_role ... ` without
/// a newline before the role runs, so a report may follow it on the same line.
fn rank_lines(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter_map(|line| line.find("rank=").map(|at| &line[at..]))
        .collect()
}

struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Runs `command` to its end (at most `limit`) and fails the test, showing its status and
/// both outputs, unless it succeeded.
fn succeed(command: &mut Command, limit: Duration) -> Finished {
    let done = finish(command.spawn().expect("spawn"), limit);
    assert!(
        done.status.success(),
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        done.status,
        done.stdout,
        done.stderr
    );
    done
}

/// Waits for `child` at most `limit`, killing it (and failing the test) past that.
fn finish(mut child: Child, limit: Duration) -> Finished {
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let out = thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err = thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "child did not finish within {limit:?}; stderr:\n{}",
                err.join().unwrap_or_default()
            );
        }
        thread::sleep(Duration::from_millis(10));
    };
    Finished {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

// ---------------------------------------------------------------------------------------------
// Child roles

/// Entry point of the child processes; does nothing in a normal test run.
#[test]
fn child_role() {
    let Ok(role) = std::env::var("NCCL_RS_TEST_ROLE") else {
        return;
    };
    let code = match play(&role) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("role {role} failed: {message}");
            1
        }
    };
    std::process::exit(code);
}

fn env_usize(name: &str) -> Result<usize, String> {
    std::env::var(name)
        .map_err(|_| format!("{name} is not set"))?
        .parse()
        .map_err(|_| format!("{name} is not a number"))
}

fn play(role: &str) -> Result<i32, String> {
    let seconds = Duration::from_secs(10);
    match role {
        // Fetch over TCP and print the id's fingerprint.
        "tcp-fetch" => {
            let addr = std::env::var("TEST_ADDR").map_err(|e| e.to_string())?;
            let rank = env_usize("TEST_RANK")?;
            let world = env_usize("TEST_WORLD")?;
            let key = std::env::var("TEST_KEY").map_err(|e| e.to_string())?;
            let id = tcp(&addr, rank, world, &key)
                .with_timeout(seconds)
                .fetch()
                .map_err(|e| e.to_string())?;
            println!("rank {rank} got {:016x}", id.fingerprint());
            Ok(0)
        }
        // Fetch through a file and print the id's fingerprint.
        "file-fetch" => {
            let dir = std::env::var("TEST_DIR").map_err(|e| e.to_string())?;
            let rank = env_usize("TEST_RANK")?;
            let world = env_usize("TEST_WORLD")?;
            let id = FileRendezvous::new(dir, rank, world)
                .with_job_key("file-procs")
                .with_timeout(seconds)
                .fetch()
                .map_err(|e| e.to_string())?;
            println!("rank {rank} got {:016x}", id.fingerprint());
            Ok(0)
        }
        // Publish as rank 0 of 2 and wait (the test kills this process, leaving a stale file).
        "file-publish-and-hang" => {
            let dir = std::env::var("TEST_DIR").map_err(|e| e.to_string())?;
            let result = FileRendezvous::new(dir, 0, 2)
                .with_job_key("stale")
                .with_timeout(Duration::from_secs(30))
                .publish(sample_id(66));
            Err(format!(
                "publish returned {result:?} instead of being killed"
            ))
        }
        // A spawn_local job handing out NCCL_RS_UNIQUE_IDS ids: every rank prints them.
        "spawn-ids" => {
            let job = spawn_local(3).map_err(|e| e.to_string())?;
            let rank = job.placement().rank;
            let mut seed = 70;
            let ids = job
                .exchange_ids_with(|| {
                    seed += 1;
                    Ok(sample_id(seed))
                })
                .map_err(|e| e.to_string())?;
            let prints: Vec<String> = ids
                .iter()
                .map(|id| format!("{:016x}", id.fingerprint()))
                .collect();
            println!("rank={rank} ids={}", prints.join(","));
            job.wait().map_err(|e| e.to_string())?;
            Ok(0)
        }
        // A spawn_local job whose every rank prints itself and the exchanged id.
        "spawn-ok" => {
            let job = spawn_local(env_usize("TEST_WORLD")?).map_err(|e| e.to_string())?;
            let placement = job.placement().clone();
            let id = job
                .exchange_id_with(|| Ok(sample_id(42)))
                .map_err(|e| e.to_string())?;
            // Every rank of a spawned job fetches the id through the encrypted rendezvous.
            let exchange = match job.exchange() {
                Exchange::Auto => Exchange::from_env(&placement).map_err(|e| e.to_string())?,
                chosen => chosen,
            };
            let encrypted = matches!(&exchange, Exchange::Tcp(tcp) if tcp.is_encrypted());
            println!(
                "rank={} world={} local={} launcher={:?} spawned={} id={:016x} encrypted={}",
                placement.rank,
                placement.world_size,
                placement.local_rank,
                placement.launcher,
                job.spawned(),
                id.fingerprint(),
                encrypted
            );
            job.wait().map_err(|e| e.to_string())?;
            Ok(0)
        }
        // Rank 2 dies while the others are busy (rank 0 in the exchange waiting for it, rank 1
        // in what stands for a collective that waits for rank 2): the supervisor must stop rank
        // 1, and rank 0's exchange must fail with the failure instead of waiting, leaving rank
        // 0 to decide what to do (here: exit with rank 2's code).
        "spawn-fail-while-busy" => {
            let job = spawn_local(3).map_err(|e| e.to_string())?;
            if job.placement().rank == 2 {
                return Ok(7);
            }
            let result = job.exchange_id_with(|| Ok(sample_id(1)));
            if job.placement().rank == 0 {
                let Some(BootstrapError::ChildFailed { rank: 2, .. }) =
                    result.as_ref().err().and_then(nccl::Error::bootstrap)
                else {
                    return Err(format!("rank 0's exchange returned {result:?}"));
                };
                eprintln!("rank 0 handles: {}", result.unwrap_err());
                return match job.wait() {
                    Err(BootstrapError::ChildFailed { exit_code, .. }) => Ok(exit_code),
                    other => Err(format!("wait returned {other:?}")),
                };
            }
            thread::sleep(Duration::from_secs(60));
            Err(format!(
                "rank {} was not stopped after rank 2 died (exchange: {result:?})",
                job.placement().rank
            ))
        }
        // Rank 2 dies after the exchange while rank 0 works: rank 0 notices through the hook
        // and `failure`, and `wait` reports it; rank 0 stays alive throughout.
        "spawn-fail-while-working" => {
            let job = spawn_local(3).map_err(|e| e.to_string())?;
            job.exchange_id_with(|| Ok(sample_id(2)))
                .map_err(|e| e.to_string())?;
            // Rank 0 tells rank 2 with this file when the exchange is over for every rank:
            // rank 2 has its own id before rank 1 may have, and dying then would make the
            // supervisor stop rank 1 mid-exchange, failing rank 0's exchange (rightly).
            let exchanged = PathBuf::from(
                std::env::var_os(EXCHANGED_FILE).ok_or(format!("{EXCHANGED_FILE} is not set"))?,
            );
            match job.placement().rank {
                0 => rank0_notices_the_failure(job, &exchanged),
                1 => {
                    thread::sleep(Duration::from_secs(60));
                    Err("rank 1 was not stopped after rank 2 died".to_owned())
                }
                _ => {
                    let deadline = Instant::now() + Duration::from_secs(20);
                    while !exchanged.exists() {
                        if Instant::now() > deadline {
                            return Err("rank 0 did not finish the exchange within 20 s".into());
                        }
                        thread::sleep(Duration::from_millis(10));
                    }
                    Ok(7)
                }
            }
        }
        // Rank 0 drops the job while the others run: they are stopped and reaped at once.
        "spawn-drop" => {
            let job = spawn_local(3).map_err(|e| e.to_string())?;
            job.exchange_id_with(|| Ok(sample_id(3)))
                .map_err(|e| e.to_string())?;
            if job.placement().rank != 0 {
                thread::sleep(Duration::from_secs(60));
                return Err("a spawned rank was not stopped by the drop".to_owned());
            }
            let started = Instant::now();
            drop(job);
            println!("dropped in {:?}", started.elapsed());
            Ok(0)
        }
        // Rank 2 fails while rank 0 sits in `wait`: `wait` reports it.
        "spawn-fail-in-wait" => {
            let job = spawn_local(3).map_err(|e| e.to_string())?;
            match job.placement().rank {
                0 => match job.wait() {
                    Err(BootstrapError::ChildFailed {
                        rank, exit_code, ..
                    }) => {
                        eprintln!("wait reported: local rank {rank} failed with code {exit_code}");
                        Ok(exit_code)
                    }
                    other => Err(format!("wait returned {other:?}")),
                },
                1 => Ok(0),
                _ => Ok(7),
            }
        }
        other => Err(format!("unknown role {other}")),
    }
}

/// The variable naming the file with which rank 0 of "spawn-fail-while-working" tells rank 2
/// that every rank has the id.
const EXCHANGED_FILE: &str = "NCCL_RS_TEST_EXCHANGED_FILE";

/// Rank 0 of "spawn-fail-while-working": adds a hook, lets rank 2 fail (writes `exchanged`),
/// waits (at most 20 s) for the failure to show through the hook and `failure`, then checks
/// what `wait` says.
fn rank0_notices_the_failure(
    job: nccl::bootstrap::LocalJob,
    exchanged: &Path,
) -> Result<i32, String> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let hooked = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&hooked);
    job.on_failure(move |error| {
        eprintln!("hook: {error}");
        flag.store(true, Ordering::SeqCst);
    });
    std::fs::write(exchanged, b"").map_err(|e| format!("writing {exchanged:?}: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let failure = loop {
        if let Some(failure) = job.failure() {
            break failure;
        }
        if Instant::now() > deadline {
            return Err("no failure seen within 20 s".to_owned());
        }
        thread::sleep(Duration::from_millis(10));
    };
    if !matches!(
        failure,
        BootstrapError::ChildFailed {
            rank: 2,
            exit_code: 7,
            ..
        }
    ) {
        return Err(format!("failure() returned {failure:?}"));
    }
    // The hook runs before or right after `failure` shows it (same thread, same record).
    thread::sleep(Duration::from_millis(200));
    if !hooked.load(Ordering::SeqCst) {
        return Err("the failure hook did not run".to_owned());
    }
    let late = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&late);
    job.on_failure(move |_| flag.store(true, Ordering::SeqCst));
    if !late.load(Ordering::SeqCst) {
        return Err("a hook added after the failure did not run at once".to_owned());
    }
    match job.wait() {
        Err(BootstrapError::ChildFailed {
            rank: 2,
            exit_code: 7,
            also_failed,
            ..
        }) if also_failed.is_empty() => {
            eprintln!("rank 0 handled the failure and lives on");
            Ok(0)
        }
        other => Err(format!("wait returned {other:?}")),
    }
}

// ---------------------------------------------------------------------------------------------
// Launcher detection

#[test]
fn no_launcher_is_a_single_process() {
    let found = placement(&[]).unwrap();
    assert_eq!(found, Placement::single_process());
    assert_eq!(found.launcher, Launcher::None);
    assert_eq!((found.rank, found.world_size, found.local_rank), (0, 1, 0));
    // Empty values count as unset.
    assert_eq!(
        placement(&[("RANK", ""), ("WORLD_SIZE", " ")]).unwrap(),
        Placement::single_process()
    );
}

#[test]
fn each_launcher_is_detected() {
    let ompi = placement(&[
        ("OMPI_COMM_WORLD_RANK", "5"),
        ("OMPI_COMM_WORLD_SIZE", "8"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
    ])
    .unwrap();
    assert_eq!(
        ompi,
        Placement {
            rank: 5,
            world_size: 8,
            local_rank: 1,
            local_world_size: Some(4),
            launcher: Launcher::OpenMpi
        }
    );

    let hydra = placement(&[
        ("PMI_RANK", "3"),
        ("PMI_SIZE", "4"),
        ("MPI_LOCALRANKID", "3"),
        ("MPI_LOCALNRANKS", "4"),
    ])
    .unwrap();
    assert_eq!(hydra.launcher, Launcher::MpichOrPmi);
    assert_eq!((hydra.rank, hydra.world_size, hydra.local_rank), (3, 4, 3));
    assert!(hydra.is_single_node());

    let pmix = placement(&[
        ("PMIX_RANK", "2"),
        ("PMI_SIZE", "4"),
        ("MPI_LOCALRANKID", "2"),
    ])
    .unwrap();
    assert_eq!(pmix.launcher, Launcher::Pmix);
    assert_eq!((pmix.rank, pmix.world_size), (2, 4));

    let slurm = placement(&[
        ("SLURM_PROCID", "6"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_STEP_NUM_TASKS", "8"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_NTASKS_PER_NODE", "4"),
    ])
    .unwrap();
    assert_eq!(
        slurm,
        Placement {
            rank: 6,
            world_size: 8,
            local_rank: 2,
            local_world_size: Some(4),
            launcher: Launcher::Slurm
        }
    );

    let torchrun = placement(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
    ])
    .unwrap();
    assert_eq!(torchrun.launcher, Launcher::Torchrun);
    assert_eq!(
        (torchrun.rank, torchrun.world_size, torchrun.local_rank),
        (1, 2, 1)
    );
}

#[test]
fn pmix_borrows_size_and_local_rank_from_its_companions() {
    // Open MPI 5 exports PMIx and OMPI variables; srun --mpi=pmix exports PMIx and Slurm ones.
    let ompi = placement(&[
        ("PMIX_RANK", "1"),
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
    ])
    .unwrap();
    assert_eq!(
        (ompi.launcher, ompi.world_size, ompi.local_rank),
        (Launcher::OpenMpi, 2, 1)
    );

    let slurm = placement(&[
        ("PMIX_RANK", "3"),
        ("SLURM_PROCID", "3"),
        ("SLURM_STEP_NUM_TASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
        ("SLURM_NODEID", "1"),
    ])
    .unwrap();
    assert_eq!(
        slurm,
        Placement {
            rank: 3,
            world_size: 4,
            local_rank: 1,
            local_world_size: Some(2),
            launcher: Launcher::Pmix
        }
    );

    let err = placement(&[("PMIX_RANK", "0")]).unwrap_err();
    assert!(
        matches!(
            err,
            BootstrapError::Incomplete {
                launcher: Launcher::Pmix,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn slurm_outside_a_step_is_not_a_launch() {
    // An sbatch script (or salloc shell) running the program directly: not one of srun's tasks.
    let batch = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_JOB_ID", "99"),
    ];
    assert_eq!(placement(&batch).unwrap(), Placement::single_process());
    // Unless asked for explicitly.
    let mut forced = batch.to_vec();
    forced.push(("NCCL_RS_LAUNCHER", "slurm"));
    let found = placement(&forced).unwrap();
    assert_eq!(
        (found.launcher, found.rank, found.world_size),
        (Launcher::Slurm, 0, 8)
    );
    // The step's own layout gives this node's rank count, even when uneven.
    let uneven = placement(&[
        ("SLURM_PROCID", "8"),
        ("SLURM_STEP_NUM_TASKS", "9"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_STEP_TASKS_PER_NODE", "4(x2),1"),
        ("SLURM_NODEID", "2"),
    ])
    .unwrap();
    assert_eq!(uneven.local_world_size, Some(1));
}

#[test]
fn malformed_values_name_the_variable() {
    let cases: &[(Vars, &str)] = &[
        (&[("RANK", "one"), ("WORLD_SIZE", "2")], "RANK"),
        (&[("RANK", "-1"), ("WORLD_SIZE", "2")], "RANK"),
        (&[("RANK", "2"), ("WORLD_SIZE", "2")], "RANK"),
        (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "x")],
            "LOCAL_RANK",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
            ],
            "LOCAL_RANK",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "0"),
                ("LOCAL_WORLD_SIZE", "3"),
            ],
            "LOCAL_WORLD_SIZE",
        ),
        (
            &[("OMPI_COMM_WORLD_RANK", "4"), ("OMPI_COMM_WORLD_SIZE", "4")],
            "OMPI_COMM_WORLD_RANK",
        ),
        (&[("PMI_RANK", "0"), ("PMI_SIZE", "2.5")], "PMI_SIZE"),
        (&[("NCCL_RS_LAUNCHER", "mpiexec")], "NCCL_RS_LAUNCHER"),
        (&[("NCCL_RS_LAUNCHER", "slurm")], "NCCL_RS_LAUNCHER"),
    ];
    for (pairs, var) in cases {
        match placement(pairs) {
            Err(BootstrapError::Env { var: found, .. }) => {
                assert_eq!(found, *var, "{pairs:?}");
            }
            other => panic!("{pairs:?}: expected an Env error for {var}, got {other:?}"),
        }
    }
    let text = placement(&[("RANK", "3"), ("WORLD_SIZE", "2")])
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("RANK=\"3\"") && text.contains("WORLD_SIZE"),
        "{text}"
    );
}

#[test]
fn partial_sets_say_what_is_missing() {
    let cases: &[(Vars, &str, &str)] = &[
        (&[("RANK", "0")], "RANK", "WORLD_SIZE"),
        (&[("WORLD_SIZE", "4")], "WORLD_SIZE", "RANK"),
        (
            &[("OMPI_COMM_WORLD_RANK", "0")],
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
        ),
        (&[("PMI_SIZE", "2")], "PMI_SIZE", "PMI_RANK"),
        (
            &[("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "1")],
            "SLURM_PROCID",
            "SLURM_STEP_NUM_TASKS",
        ),
        // A world of several ranks needs a local rank to pick a GPU.
        (
            &[("PMI_RANK", "0"), ("PMI_SIZE", "2")],
            "PMI_RANK",
            "MPI_LOCALRANKID",
        ),
    ];
    for (pairs, present, missing) in cases {
        match placement(pairs) {
            Err(BootstrapError::Incomplete {
                present: p,
                missing: m,
                ..
            }) => {
                assert_eq!(p, *present, "{pairs:?}");
                assert!(m.contains(missing), "{pairs:?}: {m}");
            }
            other => panic!("{pairs:?}: expected Incomplete, got {other:?}"),
        }
    }
}

#[test]
fn agreeing_launchers_are_fine_and_fill_each_other_in() {
    // srun --mpi=pmi2: PMI variables and the Slurm step agree; the local rank comes from Slurm.
    let found = placement(&[
        ("PMI_RANK", "3"),
        ("PMI_SIZE", "4"),
        ("SLURM_PROCID", "3"),
        ("SLURM_STEP_NUM_TASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS_PER_NODE", "2"),
    ])
    .unwrap();
    assert_eq!(
        found,
        Placement {
            rank: 3,
            world_size: 4,
            local_rank: 1,
            local_world_size: Some(2),
            launcher: Launcher::MpichOrPmi
        }
    );
}

#[test]
fn nested_launchers_believe_the_innermost() {
    // srun starts one torchrun agent per node (2 tasks), each starting 4 ranks.
    let found = placement(&[
        ("SLURM_PROCID", "1"),
        ("SLURM_STEP_NUM_TASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("RANK", "6"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "2"),
        ("LOCAL_WORLD_SIZE", "4"),
    ])
    .unwrap();
    assert_eq!(
        (
            found.launcher,
            found.rank,
            found.world_size,
            found.local_rank
        ),
        (Launcher::Torchrun, 6, 8, 2)
    );
}

#[test]
fn conflicting_launchers_are_errors() {
    let cases: &[Vars] = &[
        // Same size, different rank.
        &[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("SLURM_PROCID", "2"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_LOCALID", "2"),
        ],
        // The outer launcher claims more processes than the inner one.
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ],
        // Same rank and size, different local rank.
        &[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_LOCALID", "0"),
        ],
    ];
    for pairs in cases {
        match placement(pairs) {
            Err(err @ BootstrapError::Conflict { .. }) => {
                let text = err.to_string();
                assert!(text.contains("NCCL_RS_LAUNCHER"), "{text}");
            }
            other => panic!("{pairs:?}: expected Conflict, got {other:?}"),
        }
    }
    let text = placement(cases[0]).unwrap_err().to_string();
    assert!(
        text.contains("OMPI_COMM_WORLD_RANK=1") && text.contains("SLURM_PROCID=2"),
        "{text}"
    );

    // NCCL_RS_LAUNCHER settles a conflict.
    let mut settled = cases[0].to_vec();
    settled.push(("NCCL_RS_LAUNCHER", "openmpi"));
    assert_eq!(placement(&settled).unwrap().rank, 1);
    settled.push(("NCCL_RS_LAUNCHER", "none"));
    let none = placement(&[
        ("NCCL_RS_LAUNCHER", "none"),
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
    ])
    .unwrap();
    assert_eq!(none, Placement::single_process());
}

/// A placement of local rank `local_rank` with `local_ranks` ranks on the node (when known).
fn local(local_rank: usize, local_ranks: Option<usize>) -> Placement {
    Placement {
        rank: local_rank,
        world_size: 16,
        local_rank,
        local_world_size: local_ranks,
        launcher: Launcher::Torchrun,
    }
}

#[test]
fn one_visible_gpu_is_every_rank_s_device() {
    // srun --gpus-per-task=1, one-GPU containers, CUDA_VISIBLE_DEVICES set per rank.
    for (local_rank, local_ranks) in [(0, Some(1)), (1, Some(2)), (7, Some(8)), (3, None)] {
        assert_eq!(local(local_rank, local_ranks).device_ordinal(1).unwrap(), 0);
    }
    let found = placement(&[("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")]).unwrap();
    assert_eq!(found.device_ordinal(1).unwrap(), 0);
}

#[test]
fn shared_gpus_go_by_local_rank() {
    // As many GPUs as local ranks.
    assert_eq!(local(1, Some(2)).device_ordinal(2).unwrap(), 1);
    assert_eq!(local(7, Some(8)).device_ordinal(8).unwrap(), 7);
    // More GPUs than local ranks: the local rank still, the extra GPUs stay idle.
    assert_eq!(local(1, Some(2)).device_ordinal(8).unwrap(), 1);
    // The launcher does not say how many ranks share the node: the local rank if it exists.
    assert_eq!(local(1, None).device_ordinal(2).unwrap(), 1);
    assert_eq!(local(0, None).device_ordinal(4).unwrap(), 0);
    let found = placement(&[("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")]).unwrap();
    assert_eq!(found.device_ordinal(2).unwrap(), 1);
}

#[test]
fn ranks_share_gpus_in_turn_only_when_sharing_is_on() {
    use nccl::bootstrap::GpuSharing;
    // 4 ranks on 2 GPUs: refused without sharing, in turn with it.
    for local_rank in 0..4 {
        let p = local(local_rank, Some(4));
        assert!(p.device_ordinal_sharing(2, GpuSharing::Off).is_err());
        for sharing in [GpuSharing::SimulatedHosts, GpuSharing::SharedGpu] {
            assert_eq!(
                p.device_ordinal_sharing(2, sharing).unwrap(),
                local_rank % 2
            );
        }
    }
    // Enough GPUs: sharing changes nothing; no GPU: nothing to share.
    assert_eq!(
        local(1, Some(2))
            .device_ordinal_sharing(2, GpuSharing::SimulatedHosts)
            .unwrap(),
        1
    );
    assert!(local(1, Some(2))
        .device_ordinal_sharing(0, GpuSharing::SimulatedHosts)
        .is_err());
}

#[test]
fn fewer_gpus_than_local_ranks_is_an_error_naming_both_counts_and_the_fix() {
    // Several GPUs, but fewer than the ranks on the node: every rank fails, rank 0 too.
    for local_rank in [0, 3] {
        let err = local(local_rank, Some(4)).device_ordinal(2).unwrap_err();
        assert!(
            matches!(
                err,
                BootstrapError::NoDevice { local_rank: r, local_ranks: Some(4), visible: 2 }
                    if r == local_rank
            ),
            "{err:?}"
        );
        let text = err.to_string();
        for needle in [
            "sees 2 GPUs",
            "4 ranks run on this node",
            "CUDA_VISIBLE_DEVICES",
            "--gpus-per-task=1",
            "one rank per",
        ] {
            assert!(text.contains(needle), "{needle:?} missing in {text}");
        }
    }
    // Local size unknown and the local rank past the GPUs.
    let err = local(2, None).device_ordinal(2).unwrap_err();
    assert!(
        matches!(
            err,
            BootstrapError::NoDevice {
                local_rank: 2,
                local_ranks: None,
                visible: 2
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("does not say"), "{err}");
    // No GPU at all.
    let err = Placement::single_process().device_ordinal(0).unwrap_err();
    assert!(
        matches!(err, BootstrapError::NoDevice { visible: 0, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("sees no GPU"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Choosing the exchange from the environment

#[test]
fn exchange_is_chosen_from_the_environment() {
    let rank1 = placement(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
    ])
    .unwrap();
    match Exchange::from_vars(
        &rank1,
        vars(&[
            ("NCCL_RS_ADDR", "127.0.0.1:29500"),
            ("MASTER_ADDR", "elsewhere"),
            ("MASTER_PORT", "1"),
        ]),
    )
    .unwrap()
    {
        Exchange::Tcp(tcp) => {
            assert_eq!(tcp.addr(), "127.0.0.1:29500");
            assert_eq!((tcp.rank(), tcp.world_size()), (1, 2));
            assert_eq!(tcp.job_key(), nccl::bootstrap::DEFAULT_JOB_KEY);
        }
        other => panic!("expected TCP, got {other:?}"),
    }
    match Exchange::from_vars(
        &rank1,
        vars(&[
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("SLURM_JOB_ID", "1234"),
            ("NCCL_RS_BOOTSTRAP_TIMEOUT", "2.5"),
        ]),
    )
    .unwrap()
    {
        Exchange::Tcp(tcp) => {
            assert_eq!(tcp.addr(), "node0:29500");
            assert_eq!(tcp.job_key(), "slurm-1234");
            assert_eq!(tcp.timeout(), Duration::from_millis(2500));
        }
        other => panic!("expected TCP, got {other:?}"),
    }
    match Exchange::from_vars(
        &rank1,
        vars(&[
            ("NCCL_RS_RENDEZVOUS_DIR", "/some/dir"),
            ("NCCL_RS_JOB_KEY", "k"),
        ]),
    )
    .unwrap()
    {
        Exchange::File(file) => {
            assert_eq!(file.dir(), Path::new("/some/dir"));
            assert_eq!(file.job_key(), "k");
        }
        other => panic!("expected a file rendezvous, got {other:?}"),
    }
    match Exchange::from_vars(&rank1, vars(&[])).unwrap() {
        Exchange::File(file) => assert_eq!(file.dir(), std::env::temp_dir()),
        other => panic!("expected a file rendezvous, got {other:?}"),
    }

    // Several nodes and no address: nothing can work, say so.
    let multi_node = placement(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "16"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "8"),
    ])
    .unwrap();
    let err = Exchange::from_vars(&multi_node, vars(&[])).unwrap_err();
    assert!(matches!(err, BootstrapError::Config(_)), "{err}");
    assert!(err.to_string().contains("NCCL_RS_ADDR"), "{err}");

    for bad in [
        &[("NCCL_RS_ADDR", "no-port")][..],
        &[("NCCL_RS_BOOTSTRAP_TIMEOUT", "soon")][..],
    ] {
        let err = Exchange::from_vars(&rank1, vars(bad)).unwrap_err();
        assert!(matches!(err, BootstrapError::Env { .. }), "{bad:?}: {err}");
    }
}

#[test]
fn rendezvous_key_is_read_from_the_environment_and_never_shown() {
    let rank1 = placement(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
    ])
    .unwrap();
    let key = "6b1f0c2e9a8d7c6b5a4f3e2d1c0b0a09f8e7d6c5b4a392817161514131211100";
    let tcp = |pairs: Vars<'_>| match Exchange::from_vars(&rank1, vars(pairs)) {
        Ok(Exchange::Tcp(tcp)) => Ok(tcp),
        Ok(other) => panic!("expected TCP, got {other:?}"),
        Err(err) => Err(err),
    };
    let addr = ("NCCL_RS_ADDR", "127.0.0.1:29500");
    assert!(!tcp(&[addr]).unwrap().is_encrypted());
    assert!(!tcp(&[addr, ("NCCL_RS_RENDEZVOUS_KEY", " ")])
        .unwrap()
        .is_encrypted());
    let keyed = tcp(&[addr, ("NCCL_RS_RENDEZVOUS_KEY", key)]).unwrap();
    assert!(keyed.is_encrypted());
    assert!(!format!("{keyed:?}").contains(&key[..16]), "{keyed:?}");
    // Too short, not hex, one repeated byte: named, never quoted, also where the file method
    // would be chosen (which does not use the key).
    let short = &key[..40];
    let repeated = "ab".repeat(32);
    for bad in [
        short,
        "not-hex-at-all-but-long-enough-to-be-a-key-0123456789abcdef0123",
        &repeated,
    ] {
        for pairs in [
            &[addr, ("NCCL_RS_RENDEZVOUS_KEY", bad)][..],
            &[("NCCL_RS_RENDEZVOUS_KEY", bad)],
        ] {
            let err = Exchange::from_vars(&rank1, vars(pairs)).unwrap_err();
            let text = err.to_string();
            assert!(
                matches!(&err, BootstrapError::Env { var, .. } if var == "NCCL_RS_RENDEZVOUS_KEY"),
                "{text}"
            );
            assert!(!text.contains(bad), "{text}");
        }
    }
}

#[test]
fn tcp_keyed_exchange_through_the_public_api() {
    use nccl::bootstrap::RendezvousKey;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let key = RendezvousKey::generate().unwrap();
    let id = sample_id(77);
    let rank0 = tcp(&addr, 0, 3, "keyed-public").with_secret(key.clone());
    let serving = thread::spawn(move || rank0.exchange(Some(id)));
    let fetched: Vec<UniqueId> = (1..3)
        .map(|rank| {
            let rendezvous = tcp(&addr, rank, 3, "keyed-public").with_secret(key.clone());
            thread::spawn(move || rendezvous.fetch())
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap().unwrap())
        .collect();
    assert_eq!(fetched, vec![id; 2]);
    assert_eq!(serving.join().unwrap().unwrap(), id);
}

// ---------------------------------------------------------------------------------------------
// TCP rendezvous with threads

/// Serves `id` on a fresh port and fetches it from ranks 1..world on threads.
fn tcp_round(world: usize, key: &str) -> Vec<UniqueId> {
    let id = sample_id(world as u8);
    let server = tcp("127.0.0.1:0", 0, world, key).bind().expect("bind");
    let addr = server.local_addr().to_string();
    let serving = thread::spawn(move || server.serve(id));
    let clients: Vec<_> = (1..world)
        .map(|rank| {
            let rendezvous = tcp(&addr, rank, world, key);
            thread::spawn(move || rendezvous.exchange(None))
        })
        .collect();
    let mut ids = vec![id];
    for client in clients {
        ids.push(client.join().expect("join").expect("fetch"));
    }
    let report = serving.join().expect("join").expect("serve");
    assert!(report.rejected.is_empty(), "{:?}", report.rejected);
    ids
}

#[test]
fn tcp_threads_world_sizes_1_2_4_8() {
    for world in [1, 2, 4, 8] {
        let ids = tcp_round(world, &unique_name("sizes"));
        assert_eq!(ids.len(), world);
        assert!(ids.iter().all(|id| *id == ids[0]), "world {world}");
    }
}

#[test]
fn tcp_exchange_id_with_through_the_public_entry_point() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let world = 3;
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let addr = addr.clone();
            thread::spawn(move || {
                let placement = Placement {
                    rank,
                    world_size: world,
                    local_rank: rank,
                    local_world_size: Some(world),
                    launcher: Launcher::Torchrun,
                };
                let method = Exchange::Tcp(tcp(&addr, rank, world, "entry"));
                exchange_id_with(&placement, method, || Ok(sample_id(77)))
            })
        })
        .collect();
    for rank in ranks {
        assert_eq!(rank.join().expect("join").expect("exchange"), sample_id(77));
    }

    // A single rank needs no rendezvous at all.
    let id = exchange_id_with(&Placement::single_process(), Exchange::Auto, || {
        Ok(sample_id(5))
    })
    .expect("single");
    assert_eq!(id, sample_id(5));

    // A rendezvous set up for another rank than the placement is refused.
    let placement = Placement {
        rank: 1,
        world_size: 2,
        local_rank: 1,
        local_world_size: Some(2),
        launcher: Launcher::Torchrun,
    };
    let err = exchange_id_with(&placement, Exchange::Tcp(tcp(&addr, 0, 2, "x")), || {
        Ok(sample_id(1))
    })
    .unwrap_err();
    assert!(err.to_string().contains("rank 0 of 2"), "{err}");
}

#[test]
fn tcp_sequential_exchanges_under_one_key_stay_apart() {
    let key = unique_name("rounds");
    let world = 3;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let (first, second) = (sample_id(101), sample_id(102));
    let root = tcp(&addr, 0, world, &key);
    let serving = thread::spawn(move || {
        root.exchange(Some(first))?;
        root.exchange(Some(second))
    });
    let fast = tcp(&addr, 1, world, &key);
    let fast_rank = thread::spawn(move || (fast.fetch(), fast.fetch()));
    // Rank 2 holds the first exchange open, so rank 1 asks for the second one while rank 0
    // still serves the first: it must wait, not be taken for a duplicate.
    thread::sleep(Duration::from_millis(300));
    let slow = tcp(&addr, 2, world, &key);
    assert_eq!(slow.fetch().expect("first"), first);
    assert_eq!(slow.fetch().expect("second"), second);
    let (a, b) = fast_rank.join().expect("join");
    assert_eq!(a.expect("first"), first);
    assert_eq!(b.expect("second"), second);
    assert_eq!(serving.join().expect("join").expect("serve"), second);
}

#[test]
fn tcp_clients_wait_for_a_late_rank_0() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let clients: Vec<_> = (1..4)
        .map(|rank| {
            let rendezvous = tcp(&addr, rank, 4, "late");
            thread::spawn(move || rendezvous.fetch())
        })
        .collect();
    // Connections are refused until rank 0 shows up.
    thread::sleep(Duration::from_millis(300));
    let id = sample_id(9);
    tcp(&addr, 0, 4, "late").exchange(Some(id)).expect("serve");
    for client in clients {
        assert_eq!(client.join().expect("join").expect("fetch"), id);
    }
}

#[test]
fn tcp_bad_peers_get_typed_errors_while_good_ranks_succeed() {
    let world = 3;
    let id = sample_id(31);
    // Connections may take 10 s, longer than this test: the silent peers below stay open the
    // whole time, so the good ranks can only succeed if connections are served concurrently.
    let server = tcp("127.0.0.1:0", 0, world, "good")
        .with_connection_timeout(Duration::from_secs(10))
        .bind()
        .expect("bind");
    let addr = server.local_addr();
    let serving = thread::spawn(move || server.serve(id));
    let addr_text = addr.to_string();

    // A silent peer (slowloris) and one that trickles half a request: neither may block the
    // well-behaved ranks below.
    let silent = TcpStream::connect(addr).expect("connect");
    let mut trickle = TcpStream::connect(addr).expect("connect");
    trickle.write_all(b"NRSB").expect("write");

    // Garbage and a truncated message.
    let mut garbage = TcpStream::connect(addr).expect("connect");
    garbage
        .write_all(b"\x00\xffhello, is this HTTP?\r\n\r\n")
        .expect("write");
    let mut truncated = TcpStream::connect(addr).expect("connect");
    truncated
        .write_all(b"NRSB\x00\x01\x00\x01abc")
        .expect("write");
    truncated.shutdown(Shutdown::Write).expect("shutdown");

    let wrong_job = tcp(&addr_text, 1, world, "another-job")
        .fetch()
        .unwrap_err();
    assert!(
        matches!(wrong_job, BootstrapError::WrongJob { .. }),
        "{wrong_job}"
    );

    let wrong_size = tcp(&addr_text, 1, world + 1, "good").fetch().unwrap_err();
    assert!(
        matches!(
            wrong_size,
            BootstrapError::WorldSizeMismatch {
                expected: 3,
                got: 4
            }
        ),
        "{wrong_size}"
    );

    let out_of_range = tcp(&addr_text, 5, world, "good").fetch().unwrap_err();
    assert!(
        matches!(
            out_of_range,
            BootstrapError::RankOutOfRange {
                rank: 5,
                world_size: 3
            }
        ),
        "{out_of_range}"
    );

    // The good ranks, while the silent peers are still connected.
    let started = Instant::now();
    assert_eq!(
        tcp(&addr_text, 1, world, "good").fetch().expect("rank 1"),
        id
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // Another process claiming rank 1 again is turned away. (A second fetch from this
    // process would count as this rank's next exchange under the key, not as a duplicate.)
    let duplicate = finish(
        role_command("tcp-fetch")
            .env("TEST_KEY", "good")
            .env("TEST_ADDR", &addr_text)
            .env("TEST_RANK", "1")
            .env("TEST_WORLD", world.to_string())
            .spawn()
            .expect("spawn"),
        Duration::from_secs(20),
    );
    assert!(!duplicate.status.success());
    assert!(
        duplicate.stderr.contains("rank 1 joined twice"),
        "{}",
        duplicate.stderr
    );
    let started = Instant::now();
    assert_eq!(
        tcp(&addr_text, 2, world, "good").fetch().expect("rank 2"),
        id
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );

    let report = serving.join().expect("join").expect("serve");
    let errors: Vec<String> = report.rejected.iter().map(|r| r.to_string()).collect();
    let count = |pred: fn(&BootstrapError) -> bool| {
        report.rejected.iter().filter(|r| pred(&r.error)).count()
    };
    assert!(
        count(|e| matches!(e, BootstrapError::WrongJob { .. })) >= 1,
        "{errors:?}"
    );
    assert!(
        count(|e| matches!(e, BootstrapError::WorldSizeMismatch { .. })) >= 1,
        "{errors:?}"
    );
    assert!(
        count(|e| matches!(e, BootstrapError::DuplicateRank(1))) >= 1,
        "{errors:?}"
    );
    // Garbage and truncation are protocol errors.
    assert!(
        count(|e| matches!(e, BootstrapError::Protocol(_))) >= 2,
        "{errors:?}"
    );

    // The misbehaving connections were answered and closed (or closed when serving ended),
    // not left hanging.
    for mut stream in [silent, trickle, garbage, truncated] {
        stream
            .set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        let mut reply = Vec::new();
        if let Err(e) = stream.read_to_end(&mut reply) {
            assert!(
                !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "connection left open: {e}"
            );
        }
        assert!(reply.len() <= 16, "{reply:?}");
    }
}

#[test]
fn tcp_slow_peers_are_timed_out_per_connection() {
    let id = sample_id(4);
    let server = tcp("127.0.0.1:0", 0, 2, "slow")
        .with_connection_timeout(Duration::from_millis(200))
        .bind()
        .expect("bind");
    let addr = server.local_addr();
    let serving = thread::spawn(move || server.serve(id));
    let mut silent = TcpStream::connect(addr).expect("connect");
    silent
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    // Rank 0 answers the silent peer with a timeout status (16-byte header) and closes.
    let started = Instant::now();
    let mut reply = Vec::new();
    silent.read_to_end(&mut reply).expect("read");
    assert_eq!(reply.len(), 16, "{reply:?}");
    assert_eq!(&reply[..4], b"NRSB");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(
        tcp(&addr.to_string(), 1, 2, "slow").fetch().expect("fetch"),
        id
    );
    let report = serving.join().expect("join").expect("serve");
    assert!(
        report
            .rejected
            .iter()
            .any(|r| matches!(r.error, BootstrapError::Timeout { .. })),
        "{:?}",
        report.rejected
    );
}

#[test]
fn tcp_server_times_out_listing_missing_ranks() {
    let id = sample_id(2);
    let server = tcp("127.0.0.1:0", 0, 4, "missing")
        .with_timeout(Duration::from_millis(600))
        .bind()
        .expect("bind");
    let addr = server.local_addr().to_string();
    let serving = thread::spawn(move || server.serve(id));
    assert_eq!(tcp(&addr, 2, 4, "missing").fetch().expect("rank 2"), id);
    let started = Instant::now();
    let err = serving.join().expect("join").unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3));
    match &err {
        BootstrapError::Timeout { missing_ranks, .. } => assert_eq!(missing_ranks, &[1, 3]),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(err.to_string().contains("[1, 3]"), "{err}");
}

#[test]
fn tcp_client_times_out_without_rank_0() {
    let addr = format!("127.0.0.1:{}", free_port());
    let started = Instant::now();
    let err = tcp(&addr, 1, 2, "nobody")
        .with_timeout(Duration::from_millis(300))
        .fetch()
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(err, BootstrapError::Timeout { .. }), "{err}");
    assert!(err.to_string().contains(&addr), "{err}");
}

#[test]
fn tcp_misuse_is_reported() {
    let rank0 = tcp("127.0.0.1:1", 0, 2, "x");
    assert!(matches!(
        rank0.exchange(None),
        Err(BootstrapError::Config(_))
    ));
    assert!(matches!(rank0.fetch(), Err(BootstrapError::Config(_))));
    let rank1 = tcp("127.0.0.1:1", 1, 2, "x");
    assert!(matches!(
        rank1.exchange(Some(sample_id(1))),
        Err(BootstrapError::Config(_))
    ));
    assert!(matches!(rank1.bind(), Err(BootstrapError::Config(_))));
    assert!(matches!(
        tcp("127.0.0.1:1", 2, 2, "x").fetch(),
        Err(BootstrapError::RankOutOfRange {
            rank: 2,
            world_size: 2
        })
    ));
    assert!(matches!(
        tcp("127.0.0.1:1", 0, 0, "x").bind(),
        Err(BootstrapError::Config(_))
    ));
}

// ---------------------------------------------------------------------------------------------
// TCP rendezvous with processes

#[test]
fn tcp_processes_fetch_from_rank_0() {
    let world = 4;
    let id = sample_id(123);
    let server = tcp("127.0.0.1:0", 0, world, "procs").bind().expect("bind");
    let addr = server.local_addr().to_string();
    let children: Vec<Child> = (1..world)
        .map(|rank| {
            role_command("tcp-fetch")
                .env("TEST_KEY", "procs")
                .env("TEST_ADDR", &addr)
                .env("TEST_RANK", rank.to_string())
                .env("TEST_WORLD", world.to_string())
                .spawn()
                .expect("spawn")
        })
        .collect();
    let report = server.serve(id).expect("serve");
    assert!(report.rejected.is_empty(), "{:?}", report.rejected);
    for (rank, child) in (1..world).zip(children) {
        let done = finish(child, Duration::from_secs(20));
        assert!(done.status.success(), "rank {rank}: {}", done.stderr);
        let expected = format!("rank {rank} got {:016x}", id.fingerprint());
        assert!(done.stdout.contains(&expected), "{}", done.stdout);
    }
}

// ---------------------------------------------------------------------------------------------
// File rendezvous

fn file(dir: &Path, rank: usize, world: usize, key: &str) -> FileRendezvous {
    FileRendezvous::new(dir, rank, world)
        .with_job_key(key)
        .with_timeout(Duration::from_secs(10))
        .with_poll_interval(Duration::from_millis(10))
}

#[test]
fn file_threads_exchange_and_clean_up() {
    let dir = ScratchDir::new("threads");
    for world in [1, 2, 4] {
        let id = sample_id(world as u8);
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let rendezvous = file(dir.path(), rank, world, "threads");
                thread::spawn(move || rendezvous.exchange((rank == 0).then_some(id)))
            })
            .collect();
        for rank in ranks {
            assert_eq!(rank.join().expect("join").expect("exchange"), id);
        }
        assert!(dir.entries().is_empty(), "left behind: {:?}", dir.entries());
    }
}

#[test]
fn file_exchange_through_the_public_entry_point() {
    let dir = ScratchDir::new("entry");
    let world = 3;
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let dir = dir.path().to_owned();
            thread::spawn(move || {
                let placement = Placement {
                    rank,
                    world_size: world,
                    local_rank: rank,
                    local_world_size: Some(world),
                    launcher: Launcher::OpenMpi,
                };
                let method = Exchange::File(file(&dir, rank, world, "entry"));
                exchange_id_with(&placement, method, || Ok(sample_id(8)))
            })
        })
        .collect();
    for rank in ranks {
        assert_eq!(rank.join().expect("join").expect("exchange"), sample_id(8));
    }
}

#[test]
fn file_processes_fetch_from_rank_0() {
    let dir = ScratchDir::new("procs");
    let world = 3;
    let id = sample_id(200);
    let children: Vec<Child> = (1..world)
        .map(|rank| {
            role_command("file-fetch")
                .env("TEST_DIR", dir.path())
                .env("TEST_RANK", rank.to_string())
                .env("TEST_WORLD", world.to_string())
                .spawn()
                .expect("spawn")
        })
        .collect();
    file(dir.path(), 0, world, "file-procs")
        .publish(id)
        .expect("publish");
    for (rank, child) in (1..world).zip(children) {
        let done = finish(child, Duration::from_secs(20));
        assert!(done.status.success(), "rank {rank}: {}", done.stderr);
        let expected = format!("rank {rank} got {:016x}", id.fingerprint());
        assert!(done.stdout.contains(&expected), "{}", done.stdout);
    }
    assert!(dir.entries().is_empty(), "left behind: {:?}", dir.entries());
}

#[test]
fn file_stale_publication_of_a_killed_job_is_ignored() {
    let dir = ScratchDir::new("stale");
    let mut old_rank0 = role_command("file-publish-and-hang")
        .env("TEST_DIR", dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let id_path = file(dir.path(), 1, 2, "stale").id_path();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !id_path.exists() {
        assert!(Instant::now() < deadline, "the old rank 0 never published");
        thread::sleep(Duration::from_millis(10));
    }
    // The old job dies without cleaning up.
    old_rank0.kill().expect("kill");
    old_rank0.wait().expect("wait");
    assert!(id_path.exists());

    // The new job's rank 1 starts before its rank 0 and must not take the stale id.
    let rank1 = file(dir.path(), 1, 2, "stale");
    let fetching = thread::spawn(move || rank1.fetch());
    thread::sleep(Duration::from_millis(200));
    let fresh = sample_id(67);
    file(dir.path(), 0, 2, "stale")
        .publish(fresh)
        .expect("publish");
    assert_eq!(fetching.join().expect("join").expect("fetch"), fresh);
    assert!(dir.entries().is_empty(), "left behind: {:?}", dir.entries());
}

#[test]
fn file_timeouts_name_what_was_missing() {
    let dir = ScratchDir::new("timeouts");
    let started = Instant::now();
    let err = file(dir.path(), 1, 2, "nobody")
        .with_timeout(Duration::from_millis(200))
        .fetch()
        .unwrap_err();
    assert!(matches!(err, BootstrapError::Timeout { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(3));

    // Rank 0 alone: times out listing the ranks that never acked, and removes its file.
    let err = file(dir.path(), 0, 3, "alone")
        .with_timeout(Duration::from_millis(200))
        .publish(sample_id(1))
        .unwrap_err();
    match err {
        BootstrapError::Timeout { missing_ranks, .. } => assert_eq!(missing_ranks, vec![1, 2]),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(dir.entries().is_empty(), "left behind: {:?}", dir.entries());
}

#[test]
fn file_corrupt_content_is_reported_or_replaced() {
    let dir = ScratchDir::new("corrupt");
    let rank1 = file(dir.path(), 1, 2, "corrupt").with_timeout(Duration::from_millis(300));
    let id_path = rank1.id_path();

    for garbage in [&b"not a rendezvous file"[..], &[0u8; 192][..], b"NRSF"] {
        std::fs::write(&id_path, garbage).expect("write");
        let err = rank1.fetch().unwrap_err();
        assert!(matches!(err, BootstrapError::Protocol(_)), "{err}");
    }
    // A valid-looking file of another protocol version (this side reads 1 and 2, the record
    // with several ids).
    let mut future = vec![0u8; 192];
    future[..4].copy_from_slice(b"NRSF");
    future[5] = 9;
    std::fs::write(&id_path, &future).expect("write");
    let err = rank1.fetch().unwrap_err();
    assert!(
        matches!(err, BootstrapError::VersionMismatch { local: 2, peer: 9 }),
        "{err}"
    );

    // Rank 0 replaces a corrupt file, and the waiting rank takes the new one.
    std::fs::write(&id_path, b"garbage").expect("write");
    let waiting = file(dir.path(), 1, 2, "corrupt");
    let fetching = thread::spawn(move || waiting.fetch());
    thread::sleep(Duration::from_millis(100));
    let id = sample_id(55);
    file(dir.path(), 0, 2, "corrupt")
        .publish(id)
        .expect("publish");
    assert_eq!(fetching.join().expect("join").expect("fetch"), id);
}

#[test]
fn file_world_size_mismatch_fails_fast() {
    let dir = ScratchDir::new("mismatch");
    let root = file(dir.path(), 0, 3, "mismatch").with_timeout(Duration::from_millis(800));
    let publishing = thread::spawn(move || root.publish(sample_id(3)));
    let rank1 = file(dir.path(), 1, 2, "mismatch");
    let err = rank1.fetch().unwrap_err();
    assert!(
        matches!(
            err,
            BootstrapError::WorldSizeMismatch {
                expected: 3,
                got: 2
            }
        ),
        "{err}"
    );
    assert!(publishing.join().expect("join").is_err());
}

// ---------------------------------------------------------------------------------------------
// spawn_local

#[test]
fn spawn_local_runs_every_rank_and_waits() {
    let done = succeed(
        role_command("spawn-ok").env("TEST_WORLD", "3"),
        Duration::from_secs(30),
    );
    let fingerprint = format!("id={:016x}", sample_id(42).fingerprint());
    let lines = rank_lines(&done.stdout);
    assert_eq!(lines.len(), 3, "{}", done.stdout);
    for rank in 0..3 {
        let launcher = if rank == 0 { "None" } else { "Torchrun" };
        let spawned = if rank == 0 { 2 } else { 0 };
        let expected = format!(
            "rank={rank} world=3 local={rank} launcher={launcher} spawned={spawned} {fingerprint} \
             encrypted=true"
        );
        assert!(
            lines.contains(&expected.as_str()),
            "missing {expected:?} in {lines:?}"
        );
    }
}

#[test]
fn spawn_local_hands_every_rank_the_same_ids() {
    let done = succeed(
        role_command("spawn-ids").env("NCCL_RS_UNIQUE_IDS", "2"),
        Duration::from_secs(30),
    );
    let ids = format!(
        "ids={:016x},{:016x}",
        sample_id(71).fingerprint(),
        sample_id(72).fingerprint()
    );
    let lines = rank_lines(&done.stdout);
    assert_eq!(lines.len(), 3, "{}", done.stdout);
    for rank in 0..3 {
        let expected = format!("rank={rank} {ids}");
        assert!(
            lines.contains(&expected.as_str()),
            "missing {expected:?} in {lines:?}"
        );
    }
}

#[test]
fn spawn_local_rank_count_can_be_overridden() {
    let done = succeed(
        role_command("spawn-ok")
            .env("TEST_WORLD", "3")
            .env("NCCL_RS_LOCAL_RANKS", "2"),
        Duration::from_secs(30),
    );
    let lines = rank_lines(&done.stdout).len();
    assert_eq!(lines, 2, "{}", done.stdout);
}

#[test]
fn spawn_local_failure_while_busy_stops_the_job() {
    let started = Instant::now();
    let done = finish(
        role_command("spawn-fail-while-busy")
            .spawn()
            .expect("spawn"),
        Duration::from_secs(30),
    );
    assert_eq!(done.status.code(), Some(7), "stderr:\n{}", done.stderr);
    // Rank 0 was told, through its exchange, and chose the exit code itself.
    assert!(
        done.stderr.contains("rank 0 handles: local rank 2"),
        "{}",
        done.stderr
    );
    assert!(!done.stderr.contains("was not stopped"), "{}", done.stderr);
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[test]
fn spawn_local_failure_while_working_is_reported_not_fatal() {
    let dir = ScratchDir::new("fail-while-working");
    let started = Instant::now();
    let done = succeed(
        role_command("spawn-fail-while-working").env(EXCHANGED_FILE, dir.path().join("exchanged")),
        Duration::from_secs(40),
    );
    assert!(
        done.stderr.contains("hook: local rank 2"),
        "{}",
        done.stderr
    );
    assert!(
        done.stderr
            .contains("rank 0 handled the failure and lives on"),
        "{}",
        done.stderr
    );
    // Rank 1 was stopped, not left to sleep: the pipes it shared closed well before 60 s.
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn spawn_local_drop_stops_and_reaps_the_ranks() {
    let started = Instant::now();
    let done = succeed(&mut role_command("spawn-drop"), Duration::from_secs(30));
    assert!(done.stdout.contains("dropped in"), "{}", done.stdout);
    assert!(!done.stderr.contains("not stopped"), "{}", done.stderr);
    // `finish` read the output to its end: no spawned rank outlived rank 0 holding it open.
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn spawn_local_failure_is_reported_by_wait() {
    let done = finish(
        role_command("spawn-fail-in-wait").spawn().expect("spawn"),
        Duration::from_secs(30),
    );
    assert_eq!(done.status.code(), Some(7), "stderr:\n{}", done.stderr);
    // Whether `wait` or the supervisor noticed first, the message names the failed rank.
    assert!(done.stderr.contains("local rank 2"), "{}", done.stderr);
}
