//! The re-exec harness of the multi-process GPU tests: a parent test starts its own binary once
//! per rank, running one `child_*` test (which does nothing unless its marker variable is set),
//! forwards and keeps what the children print, and never waits on them without a bound.
//!
//! Also the environments of the launch shapes users have: ranks started by a multi-node
//! launcher on machines of their own (simulated on one host), and one GPU visible per task.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Variables of every launcher and rendezvous the crate reads (see `nccl::bootstrap`). A
/// child starts without the parent's: its launch is exactly what its test sets, even when
/// the tests themselves run under `srun` or `mpirun`.
pub const LAUNCHER_VARS: &[&str] = &[
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_NODE_RANK",
    "OMPI_MCA_ess_base_jobid",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "PMIX_RANK",
    "PMIX_NAMESPACE",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_NODEID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_JOB_ID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "NCCL_RS_LAUNCHER",
    "NCCL_RS_ADDR",
    "NCCL_RS_JOB_KEY",
    "NCCL_RS_RENDEZVOUS_DIR",
    "NCCL_RS_BOOTSTRAP_TIMEOUT",
    "NCCL_RS_LOCAL_RANKS",
];

/// After one child failed, how long the others may still run: they are usually stuck waiting
/// for it, but may be about to report something useful.
const GRACE_AFTER_FAILURE: Duration = Duration::from_secs(30);

/// The number of visible CUDA GPUs when there are at least `min`; otherwise says why the
/// test is skipped (see [`super::shape::skip`]) and returns `None` (the test then returns).
pub fn gpus_or_skip(test: &str, min: usize) -> Option<usize> {
    super::shape::gpus(test, min)
}

/// A `(name, value)` pair of a child's environment.
pub fn var(name: &str, value: impl ToString) -> (String, String) {
    (name.to_owned(), value.to_string())
}

/// Milliseconds since the Unix epoch: a clock the parent and its children share.
pub fn epoch_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// A fresh scratch directory for files the processes of one test coordinate through.
pub fn scratch_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nccl-rs-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A loopback TCP port that was free a moment ago (the system picked it), for a rendezvous.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
        .port()
}

/// What `CUDA_VISIBLE_DEVICES` must say for a child to see exactly this process's GPU
/// `ordinal`: the parent's own entry when the parent's view is narrowed already, else the
/// ordinal. (`CUDA_DEVICE_ORDER` is inherited, so both number the GPUs alike.)
pub fn visible_gpu(ordinal: usize) -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .nth(ordinal)
            .map(|entry| entry.trim().to_owned())
            .unwrap_or_else(|| panic!("CUDA_VISIBLE_DEVICES={list:?} has no entry {ordinal}")),
        _ => ordinal.to_string(),
    }
}

/// The UUID of this process's GPU `ordinal`, in hex: the same physical GPU has the same UUID
/// in every process, whatever `CUDA_VISIBLE_DEVICES` numbers it.
pub fn gpu_uuid(ordinal: usize) -> String {
    use cudarc::driver::result;
    result::init().expect("cuInit");
    let ordinal_c = i32::try_from(ordinal).expect("ordinal");
    let device =
        result::device::get(ordinal_c).unwrap_or_else(|e| panic!("cuDeviceGet({ordinal}): {e}"));
    let uuid = result::device::get_uuid(device)
        .unwrap_or_else(|e| panic!("cuDeviceGetUuid({ordinal}): {e}"));
    uuid.bytes
        .iter()
        .map(|b| format!("{:02x}", b.to_ne_bytes()[0]))
        .collect()
}

/// The environment that a torchrun-style multi-node launcher gives rank `rank` of `size` when
/// every rank runs alone on a machine of its own, with NCCL made to treat the ranks of this
/// one host as separate machines: a host id of its own (`NCCL_HOSTID`), no peer-to-peer or
/// shared-memory transport, only the socket network over loopback, no NVLink multicast nor
/// multi-node NVLink; one GPU visible (this process's `gpu`, which several simulated nodes
/// may share), and the launcher's variables (`LOCAL_RANK=0` of
/// `LOCAL_WORLD_SIZE=1`, the TCP rendezvous at `MASTER_ADDR=127.0.0.1:master_port`).
pub fn simulated_node_env(
    rank: usize,
    size: usize,
    gpu: usize,
    master_port: u16,
    run_id: &str,
) -> Vec<(String, String)> {
    simulated_node_env_showing(rank, size, visible_gpu(gpu), master_port, run_id)
}

/// [`simulated_node_env`] with `CUDA_VISIBLE_DEVICES=visible` as given (the tests of the
/// environments themselves, which must not depend on the GPUs this process sees).
pub fn simulated_node_env_showing(
    rank: usize,
    size: usize,
    visible: String,
    master_port: u16,
    run_id: &str,
) -> Vec<(String, String)> {
    vec![
        var("NCCL_HOSTID", format!("{run_id}-node{rank}")),
        var("NCCL_P2P_DISABLE", 1),
        var("NCCL_SHM_DISABLE", 1),
        var("NCCL_NET", "Socket"),
        var("NCCL_SOCKET_IFNAME", "lo"),
        var("NCCL_NVLS_ENABLE", 0),
        var("NCCL_MNNVL_ENABLE", 0),
        var("CUDA_VISIBLE_DEVICES", visible),
        var("RANK", rank),
        var("WORLD_SIZE", size),
        var("GROUP_RANK", rank),
        var("LOCAL_RANK", 0),
        var("LOCAL_WORLD_SIZE", 1),
        var("MASTER_ADDR", "127.0.0.1"),
        var("MASTER_PORT", master_port),
        var("TORCHELASTIC_RUN_ID", run_id),
        var("NCCL_RS_BOOTSTRAP_TIMEOUT", 90),
    ]
}

/// The environment `mpirun -np size` (Open MPI, one node) gives rank `rank` when a wrapper
/// script narrows `CUDA_VISIBLE_DEVICES` to the rank's GPU `gpu`, as
/// `srun --gpus-per-task=1` or a one-GPU container does: the rank sees one GPU while its
/// local rank runs up to `size - 1`.
pub fn one_gpu_per_task_env(
    rank: usize,
    size: usize,
    gpu: usize,
    job_id: &str,
) -> Vec<(String, String)> {
    one_gpu_per_task_env_showing(rank, size, visible_gpu(gpu), job_id)
}

/// [`one_gpu_per_task_env`] with `CUDA_VISIBLE_DEVICES=visible` as given (the tests of the
/// environments themselves, which must not depend on the GPUs this process sees).
pub fn one_gpu_per_task_env_showing(
    rank: usize,
    size: usize,
    visible: String,
    job_id: &str,
) -> Vec<(String, String)> {
    vec![
        var("OMPI_COMM_WORLD_RANK", rank),
        var("OMPI_COMM_WORLD_SIZE", size),
        var("OMPI_COMM_WORLD_LOCAL_RANK", rank),
        var("OMPI_COMM_WORLD_LOCAL_SIZE", size),
        var("OMPI_COMM_WORLD_NODE_RANK", rank),
        var("OMPI_MCA_ess_base_jobid", job_id),
        var("PMIX_RANK", rank),
        var("PMIX_NAMESPACE", format!("prterun-{job_id}@1")),
        var("CUDA_VISIBLE_DEVICES", visible),
        var("NCCL_RS_BOOTSTRAP_TIMEOUT", 90),
    ]
}

/// Child processes of one test, with their output forwarded (prefixed with test and rank) and
/// their standard output kept for the parent's checks.
pub struct Children {
    test: String,
    procs: Vec<(usize, Child)>,
    lines: Arc<Mutex<Vec<(usize, String)>>>,
    readers: Vec<JoinHandle<()>>,
}

impl Children {
    /// Starts `test` of this binary once per rank in `ranks`, without the parent's launcher
    /// variables ([`LAUNCHER_VARS`]), with `NCCL_NVLS_ENABLE=0` and with `env(rank)` added.
    pub fn spawn(
        test: &str,
        ranks: &[usize],
        env: impl Fn(usize) -> Vec<(String, String)>,
    ) -> Children {
        // The children inherit this process's NCCL settings and its suite ledger.
        super::shape::setup();
        let exe = std::env::current_exe().expect("current_exe");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let mut children = Children {
            test: test.to_owned(),
            procs: Vec::new(),
            lines: lines.clone(),
            readers: Vec::new(),
        };
        for &rank in ranks {
            let mut command = Command::new(&exe);
            command.args([
                test,
                "--exact",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ]);
            for name in LAUNCHER_VARS {
                command.env_remove(name);
            }
            let mut child = command
                .env("NCCL_NVLS_ENABLE", "0")
                .envs(env(rank))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("{test}: spawning rank {rank}: {e}"));
            let tag = format!("[{test} rank {rank}]");
            let stdout = child.stdout.take().expect("piped stdout");
            let stderr = child.stderr.take().expect("piped stderr");
            let sink = lines.clone();
            let out_tag = tag.clone();
            children.readers.push(forward(stdout, move |line| {
                println!("{out_tag} {line}");
                sink.lock().unwrap().push((rank, line));
            }));
            children
                .readers
                .push(forward(stderr, move |line| eprintln!("{tag} {line}")));
            children.procs.push((rank, child));
        }
        children
    }

    /// The children that have exited already, with their statuses.
    pub fn exited(&mut self) -> Vec<(usize, String)> {
        self.procs
            .iter_mut()
            .filter_map(|(rank, child)| match child.try_wait() {
                Ok(Some(status)) => Some((*rank, status.to_string())),
                _ => None,
            })
            .collect()
    }

    /// Kills `rank` with SIGKILL and reaps it; returns the kill time ([`epoch_ms`]).
    pub fn kill(&mut self, rank: usize) -> u128 {
        let pos = self
            .procs
            .iter()
            .position(|(r, _)| *r == rank)
            .unwrap_or_else(|| panic!("{}: no running rank {rank} to kill", self.test));
        let (_, mut child) = self.procs.remove(pos);
        child.kill().expect("SIGKILL");
        let at = epoch_ms();
        let _ = child.wait();
        at
    }

    /// Waits for every remaining child (see [`wait_children`]) and fails the test if one did
    /// not succeed. Returns the lines they printed on standard output.
    pub fn finish(mut self, limit: Duration) -> Vec<(usize, String)> {
        let failed = wait_children(&mut self.procs, limit);
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        assert!(
            failed.is_empty(),
            "{}: children failed (their output is above): {failed:?}",
            self.test
        );
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

/// Calls `each` with every line `from` produces, on a thread of its own.
fn forward(
    from: impl Read + Send + 'static,
    each: impl Fn(String) + Send + 'static,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            each(line);
        }
    })
}

/// Waits for every child process; kills those still running after `limit`, or
/// [`GRACE_AFTER_FAILURE`] after another child failed (its peers usually wait for it).
/// Returns one line per child that did not exit successfully (empty when all did).
pub fn wait_children(children: &mut Vec<(usize, Child)>, limit: Duration) -> Vec<String> {
    let limit_at = Instant::now() + limit;
    let mut grace_at: Option<Instant> = None;
    let mut failed = Vec::new();
    while !children.is_empty() {
        let before = failed.len();
        children.retain_mut(|(rank, child)| match child.try_wait() {
            Ok(Some(status)) => {
                if !status.success() {
                    failed.push(format!("rank {rank}: {status}"));
                }
                false
            }
            Ok(None) => true,
            Err(e) => {
                failed.push(format!("rank {rank}: {e}"));
                false
            }
        });
        let now = Instant::now();
        if failed.len() > before && grace_at.is_none() {
            grace_at = Some(now + GRACE_AFTER_FAILURE);
        }
        let why = if now > limit_at {
            Some(format!("still running after {limit:?}"))
        } else if grace_at.is_some_and(|at| now > at) {
            Some(format!(
                "still running {GRACE_AFTER_FAILURE:?} after another rank failed"
            ))
        } else {
            None
        };
        if let Some(why) = why {
            for (rank, child) in children.iter_mut() {
                let _ = child.kill();
                let _ = child.wait();
                failed.push(format!("rank {rank}: killed, {why}"));
            }
            children.clear();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    failed
}

/// Values of a `KEY=value` field in the children's `TAG ...` lines, with the rank that
/// printed each.
pub fn fields(lines: &[(usize, String)], tag: &str, key: &str) -> Vec<(usize, u128)> {
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
