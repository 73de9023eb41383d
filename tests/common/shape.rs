//! Where the ranks of a multi-rank GPU test run, on whatever GPUs the host has.
//!
//! * [`Shape::Gpus`]: one GPU per rank (at least 2 GPUs).
//! * [`Shape::Hosts`]: simulated hosts: every rank a process of its own with its own
//!   `NCCL_HOSTID`, so NCCL treats it as a machine and connects the ranks over NET/Socket on
//!   loopback; the ranks are spread over the GPUs present (all on GPU 0 on a one-GPU host).
//!   Any NCCL version, any rank count. The network path.
//! * [`Shape::Shared`]: two ranks on GPU 0 as one LSA team (`NCCL_MULTI_RANK_GPU_ENABLE=1`,
//!   NCCL 2.30+): windows, symmetric kernels, RMA, copy-engine collectives, and one process
//!   driving both ranks (`init_all` with GPU 0 twice).
//!
//! A test says which shapes it can run in, in the order it prefers them; the first one this
//! host can give wins (`Gpus` only with 2+ GPUs, `Shared` only with NCCL 2.30+).
//! `NCCL_RS_GPU_SHAPE=gpus|hosts|shared` forces one, on a multi-GPU host too. A test that
//! cannot run says why through [`skip`], which the suite's summary lists: every test records
//! what it did in the ledger of the run ([`LEDGER_VAR`], named by the runner), whose summary
//! ([`summary`]) the runner prints after its last binary (`tests/gpu_suite_summary.rs`).

use std::io::Write;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaStream};
use nccl::Version;

use super::procs::{var, visible_gpu};

/// Forces a shape: `gpus`, `hosts` or `shared`.
pub const SHAPE_VAR: &str = "NCCL_RS_GPU_SHAPE";
/// The ledger of one run of the suite: a file named by whoever starts the run (`.gpu/run
/// tests`, `tests/gpu/candle.sh`: a new one each run, removed by it at the end), where every
/// GPU test, and every process a test starts (it inherits the variable), records what it did
/// ([`ran`], [`skip`]). Unset (`cargo test`, a binary run alone), nothing is recorded: what a
/// test did is said on stderr only.
pub const LEDGER_VAR: &str = "NCCL_RS_SUITE_LEDGER";
/// The summary binary's explicit mode (`tests/gpu_suite_summary.rs`): names the ledger whose
/// summary it prints ([`print_summary`]). The runner sets it for that binary alone, after
/// every other binary ran, so no binary's order matters.
pub const SUMMARY_VAR: &str = "NCCL_RS_SUITE_SUMMARY";
/// Tells a child process the CUDA ordinal of its rank's GPU.
pub const DEVICE_VAR: &str = "NCCL_RS_TEST_DEVICE";
/// NCCL's switch for several ranks on one GPU.
const MULTI_RANK_GPU_VAR: &str = "NCCL_MULTI_RANK_GPU_ENABLE";
/// NCCL's lazy connection setup (on by default since 2.22).
const RUNTIME_CONNECT_VAR: &str = "NCCL_RUNTIME_CONNECT";
/// The first NCCL that lets two ranks share a GPU.
pub const SHARED_SINCE: Version = Version::new(2, 30, 0);

/// How the ranks of a test are laid on the GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Gpus,
    Hosts,
    Shared,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Gpus => "gpus",
            Shape::Hosts => "hosts",
            Shape::Shared => "shared",
        }
    }

    fn parse(text: &str) -> Shape {
        match text.trim() {
            "gpus" => Shape::Gpus,
            "hosts" => Shape::Hosts,
            "shared" => Shape::Shared,
            other => panic!("{SHAPE_VAR}={other:?}: expected gpus, hosts or shared"),
        }
    }
}

/// What this host offers: the GPUs it has, the NCCL loaded, the shape forced.
struct Host {
    gpus: Result<usize, String>,
    version: Result<Version, String>,
    forced: Option<Shape>,
}

fn host() -> &'static Host {
    static HOST: OnceLock<Host> = OnceLock::new();
    HOST.get_or_init(|| {
        // Before this process first uses CUDA (the driver reads it then): lazily loaded
        // kernels can wait for the whole context, where a rank sharing the GPU spins in a
        // collective until this rank joins it (`Comm::init_all` refuses shared ranks without
        // it). Every test process, as any may put two ranks on one GPU.
        if std::env::var_os("CUDA_MODULE_LOADING").is_none() {
            std::env::set_var("CUDA_MODULE_LOADING", "EAGER");
        }
        let forced = std::env::var(SHAPE_VAR)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .map(|v| Shape::parse(&v));
        let host = Host {
            gpus: nccl::library::cuda_device_count().map_err(|e| e.to_string()),
            version: nccl::version().map_err(|e| e.to_string()),
            forced,
        };
        // Before any communicator of this process exists (NCCL reads its parameters once):
        // multicast off always, and ranks sharing GPU 0 allowed where the threaded tests
        // will put two there.
        if std::env::var("NCCL_NVLS_ENABLE").as_deref() != Ok("0") {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        if host.pick(THREADED) == Ok(Shape::Shared) {
            std::env::set_var(MULTI_RANK_GPU_VAR, "1");
            // Two ranks of one process on one GPU: connections made lazily, by the thread
            // that enqueues, can wait on the other rank's kernel, which waits for this rank
            // (seen: a reduce whose configuration asked for more CTAs, hence channels, than
            // connected so far hung on NCCL 2.32.3). Connecting everything at creation
            // avoids it. A test that wants lazy connections says so in its own process.
            if std::env::var_os(RUNTIME_CONNECT_VAR).is_none() {
                std::env::set_var(RUNTIME_CONNECT_VAR, "0");
            }
        }
        host
    })
}

impl Host {
    fn gpus(&self) -> Result<usize, String> {
        self.gpus.clone().map_err(|e| format!("no CUDA GPU: {e}"))
    }

    /// Whether this host can give `shape`, else why not.
    fn available(&self, shape: Shape) -> Result<(), String> {
        let gpus = self.gpus()?;
        match shape {
            Shape::Gpus if gpus < 2 => {
                Err(format!("one GPU per rank needs 2 GPUs, {gpus} visible"))
            }
            Shape::Shared => match &self.version {
                Ok(v) if *v >= SHARED_SINCE => Ok(()),
                Ok(v) => Err(format!(
                    "two ranks on one GPU need NCCL {SHARED_SINCE}+ ({MULTI_RANK_GPU_VAR}); \
                     the loaded NCCL is {v}"
                )),
                Err(e) => Err(format!("NCCL does not load: {e}")),
            },
            _ => Ok(()),
        }
    }

    /// The first of `accepts` this host can give (the forced shape, if one is).
    fn pick(&self, accepts: &[Shape]) -> Result<Shape, String> {
        let names: Vec<&str> = accepts.iter().map(|s| s.name()).collect();
        if let Some(forced) = self.forced {
            if !accepts.contains(&forced) {
                return Err(format!(
                    "{SHAPE_VAR}={}, but this test runs only as {}",
                    forced.name(),
                    names.join(" or ")
                ));
            }
            return self.available(forced).map(|()| forced);
        }
        let mut why = Vec::new();
        for &shape in accepts {
            match self.available(shape) {
                Ok(()) => return Ok(shape),
                Err(e) => why.push(e),
            }
        }
        Err(why.join("; "))
    }
}

/// The ranks of one test: their shape and each rank's GPU.
#[derive(Debug, Clone)]
pub struct Layout {
    pub shape: Shape,
    /// The CUDA ordinal (as this process numbers GPUs) of each rank's GPU.
    pub devices: Vec<usize>,
    /// Names this run's simulated hosts.
    run_id: String,
}

impl Layout {
    fn new(shape: Shape, hosts_ranks: usize) -> Result<Layout, String> {
        let gpus = host().gpus()?;
        let devices = match shape {
            Shape::Gpus => (0..gpus).collect(),
            Shape::Hosts => {
                let ranks = if gpus >= 2 {
                    hosts_ranks.max(gpus)
                } else {
                    hosts_ranks
                };
                (0..ranks).map(|r| r % gpus).collect()
            }
            Shape::Shared => vec![0, 0],
        };
        Ok(Layout {
            shape,
            devices,
            run_id: format!("{}-{}", std::process::id(), super::procs::epoch_ms()),
        })
    }

    pub fn size(&self) -> usize {
        self.devices.len()
    }

    /// A new stream per rank on its GPU, in that GPU's primary context.
    pub fn streams(&self) -> Vec<Arc<CudaStream>> {
        self.devices
            .iter()
            .map(|&d| {
                CudaContext::new(d)
                    .and_then(|ctx| ctx.new_stream())
                    .unwrap_or_else(|e| panic!("a stream on GPU {d}: {e}"))
            })
            .collect()
    }

    /// The variables of rank `rank`'s process: its GPU ([`DEVICE_VAR`], and for a simulated
    /// host only that GPU visible) and what makes NCCL see the shape ([`Layout::nccl_env`]).
    pub fn env(&self, rank: usize) -> Vec<(String, String)> {
        let device = self.devices[rank];
        let mut vars = match self.shape {
            Shape::Hosts => vec![
                var(DEVICE_VAR, 0),
                var("CUDA_VISIBLE_DEVICES", visible_gpu(device)),
            ],
            Shape::Gpus | Shape::Shared => vec![var(DEVICE_VAR, device)],
        };
        vars.extend(self.nccl_env(rank));
        vars
    }

    /// What makes NCCL see rank `rank` in this shape, for a process whose GPU is set by other
    /// means: a host id of its own and only the socket network (simulated hosts), or
    /// permission to share a GPU (shared).
    pub fn nccl_env(&self, rank: usize) -> Vec<(String, String)> {
        match self.shape {
            Shape::Gpus => Vec::new(),
            Shape::Hosts => vec![
                var("NCCL_HOSTID", format!("sim-{}-node{rank}", self.run_id)),
                var("NCCL_P2P_DISABLE", 1),
                var("NCCL_SHM_DISABLE", 1),
                var("NCCL_NET", "Socket"),
                var("NCCL_SOCKET_IFNAME", "lo"),
                var("NCCL_MNNVL_ENABLE", 0),
            ],
            Shape::Shared => vec![var(MULTI_RANK_GPU_VAR, 1)],
        }
    }

    pub fn describe(&self) -> String {
        let what = match self.shape {
            Shape::Gpus => "one GPU each",
            Shape::Hosts => "simulated hosts over NET/Socket",
            Shape::Shared => "sharing one GPU as one LSA team",
        };
        format!(
            "{} ranks, {what} (shape {}, GPUs {:?})",
            self.size(),
            self.shape.name(),
            self.devices
        )
    }
}

/// The layout of a test whose ranks are threads of this process: one GPU each where there
/// are 2+, else two ranks sharing GPU 0 (NCCL 2.30+); `None`, said through [`skip`], where
/// neither is possible.
pub fn threaded(test: &str) -> Option<Layout> {
    // `host` sets eager loading unless the environment said otherwise; the driver read it
    // when this process first used CUDA, and `Comm::init_all` refuses shared ranks that load
    // lazily.
    if host().pick(THREADED) == Ok(Shape::Shared)
        && nccl::library::lazy_module_loading().unwrap_or(false)
    {
        skip(
            test,
            "two ranks of one process on GPU 0 need CUDA_MODULE_LOADING=EAGER from the \
             process's start (this one loads lazily)",
        );
        return None;
    }
    layout(test, THREADED, 2)
}

/// The shapes a test whose ranks are threads of one process can take: simulated hosts need a
/// process per rank.
const THREADED: &[Shape] = &[Shape::Gpus, Shape::Shared];

/// The GPU of each rank of this process's threaded tests (see [`threaded`]), for a test that
/// [`threaded`] let run, or a child process it started.
pub fn threaded_devices() -> Vec<usize> {
    host()
        .pick(THREADED)
        .and_then(|shape| Layout::new(shape, 2))
        .unwrap_or_else(|why| panic!("no threaded layout on this host: {why}"))
        .devices
}

/// Makes sure this process's NCCL settings are in place before its first communicator
/// (multicast off; GPU 0 shareable where threaded tests share it).
pub fn setup() {
    host();
}

/// The layout of a test whose ranks are processes, from the shapes it `accepts` (in order of
/// preference); under simulated hosts it runs `hosts_ranks` ranks (or one per GPU, where
/// there are more). `None`, said through [`skip`], where none is possible.
pub fn processes(test: &str, accepts: &[Shape], hosts_ranks: usize) -> Option<Layout> {
    layout(test, accepts, hosts_ranks)
}

fn layout(test: &str, accepts: &[Shape], hosts_ranks: usize) -> Option<Layout> {
    match host()
        .pick(accepts)
        .and_then(|shape| Layout::new(shape, hosts_ranks))
    {
        Ok(layout) => {
            ran(test, &layout.describe());
            Some(layout)
        }
        Err(why) => {
            skip(test, &why);
            None
        }
    }
}

/// The GPU count, when the test needs at least `min` GPUs of its own (1 for the one-rank
/// tests); else `None`, said through [`skip`].
pub fn gpus(test: &str, min: usize) -> Option<usize> {
    match host().gpus() {
        Ok(count) if count >= min => {
            ran(test, &format!("{count} GPU(s)"));
            Some(count)
        }
        Ok(count) => {
            skip(test, &format!("needs {min} GPUs, {count} visible"));
            None
        }
        Err(why) => {
            skip(test, &why);
            None
        }
    }
}

/// In a child process: its rank's GPU, as the parent's layout says (the rank itself when
/// started by an older parent).
pub fn child_device(rank: usize) -> usize {
    std::env::var(DEVICE_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(rank)
}

/// Says, where a reader sees it (not through the test harness's captured output), that
/// `test` did not run and why, and records it for the suite's summary.
pub fn skip(test: &str, why: &str) {
    say(&format!("SKIPPED {test}: {why}"));
    record("skipped", test, why);
}

/// Says how `test` runs, and records it for the suite's summary.
pub fn ran(test: &str, how: &str) {
    say(&format!("RUNS {test}: {how}"));
    record("ran", test, how);
}

fn say(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Appends to the run's ledger ([`LEDGER_VAR`]), if there is one, what `test` did.
fn record(outcome: &str, test: &str, detail: &str) {
    let Some(path) = std::env::var_os(LEDGER_VAR).filter(|p| !p.is_empty()) else {
        return;
    };
    let version = host()
        .version
        .as_ref()
        .map(|v| v.to_string())
        .unwrap_or_else(|_| "none".to_owned());
    let line = ledger_line(env!("CARGO_CRATE_NAME"), test, outcome, &version, detail);
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        // One write per line, appended: the ranks of a test may record at once.
        let _ = file.write_all(line.as_bytes());
    }
}

/// One line of a ledger: the test binary, the test, `ran` or `skipped`, the NCCL version the
/// test saw, and how it ran or why not (tabs and newlines made spaces), tab-separated.
pub fn ledger_line(binary: &str, test: &str, outcome: &str, version: &str, detail: &str) -> String {
    let clean = |field: &str| field.replace(['\t', '\n'], " ");
    format!(
        "{}\t{}\t{}\t{}\t{}\n",
        clean(binary),
        clean(test),
        clean(outcome),
        clean(version),
        clean(detail)
    )
}

/// What a ledger says of one test binary.
#[derive(Default)]
struct BinarySummary {
    ran: Vec<(String, String)>,
    skipped: Vec<(String, String)>,
    versions: Vec<String>,
}

/// The summary of a ledger (`text`, lines of [`ledger_line`]) under `title`: per test binary
/// (by name), how many multi-rank GPU tests ran and how many were skipped, with the NCCL
/// versions they saw and why each skipped one was; then the totals. A test that started, then
/// found it could not go on, counts once, as skipped; a test recorded twice (by its ranks)
/// once. A line that is not a record is passed over.
pub fn summary(title: &str, text: &str) -> String {
    let mut binaries: std::collections::BTreeMap<&str, BinarySummary> = Default::default();
    for line in text.lines() {
        let fields: Vec<&str> = line.splitn(5, '\t').collect();
        let [binary, test, outcome, version, detail] = fields[..] else {
            continue;
        };
        let entry = binaries.entry(binary).or_default();
        let row = (test.to_owned(), detail.to_owned());
        match outcome {
            "ran" => {
                if !entry
                    .ran
                    .iter()
                    .chain(&entry.skipped)
                    .any(|(t, _)| t == test)
                {
                    entry.ran.push(row);
                }
            }
            _ => {
                entry.ran.retain(|(t, _)| t != test);
                if !entry.skipped.iter().any(|(t, _)| t == test) {
                    entry.skipped.push(row);
                }
            }
        }
        if !entry.versions.iter().any(|v| v == version) {
            entry.versions.push(version.to_owned());
        }
    }
    let mut out = format!("\n=== {title} (multi-rank GPU tests, per binary)\n");
    if binaries.is_empty() {
        out.push_str("no GPU test recorded anything in this run\n");
        return out;
    }
    let (mut ran, mut skipped) = (0, 0);
    for (name, binary) in &binaries {
        ran += binary.ran.len();
        skipped += binary.skipped.len();
        out.push_str(&format!(
            "{name}: {} ran, {} skipped (NCCL {})\n",
            binary.ran.len(),
            binary.skipped.len(),
            binary.versions.join(", ")
        ));
        for (test, why) in &binary.skipped {
            out.push_str(&format!("    skipped {test}: {why}\n"));
        }
    }
    out.push_str(&format!("total: {ran} ran, {skipped} skipped\n"));
    out
}

/// The summary binary's explicit mode: where [`SUMMARY_VAR`] names a ledger, prints its
/// [`summary`] under `title` past the harness's output capture (it is for whoever runs the
/// suite) and returns true; a ledger no test wrote to reads as empty. Without it (`cargo
/// test`), prints nothing and returns false. Never removes the ledger: whoever made it does.
pub fn print_summary(title: &str) -> bool {
    let Some(path) = std::env::var_os(SUMMARY_VAR).filter(|p| !p.is_empty()) else {
        return false;
    };
    let path = std::path::PathBuf::from(path);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => panic!("{SUMMARY_VAR}={}: {e}", path.display()),
    };
    let _ = std::io::stdout()
        .lock()
        .write_all(summary(title, &text).as_bytes());
    true
}
