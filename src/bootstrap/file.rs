//! File rendezvous for ranks on one machine: rank 0 publishes the id in a file, the others
//! read it and leave an ack file each.
//!
//! The format is described in the [module documentation](super#file-protocol-version-1).

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::util::{
    deadline_after, fnv1a, io_error, job_key_hash, lookup, process_var, random_u64, time_left,
};
use super::{
    check_rank, job_key_from, timeout_from, vars, BootstrapError, Launch, Result, DEFAULT_JOB_KEY,
    DEFAULT_TIMEOUT,
};
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

const ID_MAGIC: [u8; 4] = *b"NRSF";
const ACK_MAGIC: [u8; 4] = *b"NRSA";
const VERSION: u16 = 1;
const ID_FILE_LEN: usize = 192;
const ID_OFFSET: usize = 56;
const ID_CHECKSUM_OFFSET: usize = ID_OFFSET + UNIQUE_ID_BYTES;
const ACK_FILE_LEN: usize = 48;

/// Default longest pause between two looks at the directory.
const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// First pause between looks; doubles up to the poll interval.
const FIRST_POLL_PAUSE: Duration = Duration::from_millis(2);

/// A file rendezvous for one rank: every rank must see the same directory on the same machine.
///
/// ```no_run
/// use nccl::bootstrap::FileRendezvous;
///
/// # fn main() -> nccl::Result<()> {
/// # let (rank, world_size) = (1, 4);
/// let rendezvous = FileRendezvous::new(std::env::temp_dir(), rank, world_size)
///     .with_job_key("my-job");
/// let id = rendezvous.exchange_with(nccl::UniqueId::new)?;
/// # let _ = id;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct FileRendezvous {
    dir: PathBuf,
    rank: usize,
    world_size: usize,
    job_key: String,
    timeout: Duration,
    poll_interval: Duration,
}

/// What rank 0's file says, once validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct IdRecord {
    job_hash: u64,
    world_size: u32,
    nonce: u64,
    pid: u32,
    start_ticks: u64,
    pid_namespace: u64,
    id: [u8; UNIQUE_ID_BYTES],
}

impl IdRecord {
    fn encode(&self) -> [u8; ID_FILE_LEN] {
        let mut bytes = [0u8; ID_FILE_LEN];
        bytes[0..4].copy_from_slice(&ID_MAGIC);
        bytes[4..6].copy_from_slice(&VERSION.to_be_bytes());
        bytes[8..16].copy_from_slice(&self.job_hash.to_be_bytes());
        bytes[16..20].copy_from_slice(&self.world_size.to_be_bytes());
        bytes[24..32].copy_from_slice(&self.nonce.to_be_bytes());
        bytes[32..36].copy_from_slice(&self.pid.to_be_bytes());
        bytes[40..48].copy_from_slice(&self.start_ticks.to_be_bytes());
        bytes[48..56].copy_from_slice(&self.pid_namespace.to_be_bytes());
        bytes[ID_OFFSET..ID_CHECKSUM_OFFSET].copy_from_slice(&self.id);
        let checksum = fnv1a(&bytes[..ID_CHECKSUM_OFFSET]);
        bytes[ID_CHECKSUM_OFFSET..].copy_from_slice(&checksum.to_be_bytes());
        bytes
    }

    /// Validates and decodes an id file; `path` is for messages only.
    fn decode(bytes: &[u8], path: &Path) -> Result<Self> {
        let shown = path.display();
        if bytes.len() < 6 {
            return Err(BootstrapError::Protocol(format!(
                "{shown} is truncated ({} bytes)",
                bytes.len()
            )));
        }
        if bytes[0..4] != ID_MAGIC {
            return Err(BootstrapError::Protocol(format!(
                "{shown} is not an nccl-rs rendezvous file (bad magic)"
            )));
        }
        let version = be_u16(bytes, 4);
        if version != VERSION {
            return Err(BootstrapError::VersionMismatch {
                local: VERSION,
                peer: version,
            });
        }
        if bytes.len() != ID_FILE_LEN {
            return Err(BootstrapError::Protocol(format!(
                "{shown} has {} bytes, a version {VERSION} rendezvous file has {ID_FILE_LEN}",
                bytes.len()
            )));
        }
        if be_u64(bytes, ID_CHECKSUM_OFFSET) != fnv1a(&bytes[..ID_CHECKSUM_OFFSET]) {
            return Err(BootstrapError::Protocol(format!(
                "{shown} is corrupt (checksum mismatch)"
            )));
        }
        let mut id = [0u8; UNIQUE_ID_BYTES];
        id.copy_from_slice(&bytes[ID_OFFSET..ID_CHECKSUM_OFFSET]);
        Ok(IdRecord {
            job_hash: be_u64(bytes, 8),
            world_size: be_u32(bytes, 16),
            nonce: be_u64(bytes, 24),
            pid: be_u32(bytes, 32),
            start_ticks: be_u64(bytes, 40),
            pid_namespace: be_u64(bytes, 48),
            id,
        })
    }
}

/// An ack file: which rank read which publication.
fn encode_ack(job_hash: u64, nonce: u64, rank: u32, fingerprint: u64) -> [u8; ACK_FILE_LEN] {
    let mut bytes = [0u8; ACK_FILE_LEN];
    bytes[0..4].copy_from_slice(&ACK_MAGIC);
    bytes[4..6].copy_from_slice(&VERSION.to_be_bytes());
    bytes[8..16].copy_from_slice(&job_hash.to_be_bytes());
    bytes[16..24].copy_from_slice(&nonce.to_be_bytes());
    bytes[24..28].copy_from_slice(&rank.to_be_bytes());
    bytes[32..40].copy_from_slice(&fingerprint.to_be_bytes());
    let checksum = fnv1a(&bytes[..40]);
    bytes[40..48].copy_from_slice(&checksum.to_be_bytes());
    bytes
}

fn be_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([bytes[at], bytes[at + 1]])
}

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn be_u64(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_be_bytes(word)
}

/// Publications (nonce, rank) this process already acked. A rank that runs a second exchange
/// under the same key must not pick up the first one's file while rank 0 is still waiting for
/// slower ranks to ack it.
fn used_publications() -> &'static Mutex<HashSet<(u64, usize)>> {
    static USED: OnceLock<Mutex<HashSet<(u64, usize)>>> = OnceLock::new();
    USED.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Facts about a process from `/proc`, used to tell a live rank 0 from a dead one.
mod procfs {
    use std::path::Path;

    use super::fnv1a;

    /// The state letter and start time (clock ticks after boot) from a `/proc/<pid>/stat` line.
    pub(super) fn parse_stat(text: &str) -> Option<(char, u64)> {
        // The command name (field 2) may hold spaces and parentheses: fields after it start
        // after the last ')'.
        let rest = &text[text.rfind(')')? + 1..];
        let mut fields = rest.split_whitespace();
        let state = fields.next()?.chars().next()?;
        // Field 3 is the state; the start time is field 22, i.e. 19 fields further.
        let start = fields.nth(18)?.parse().ok()?;
        Some((state, start))
    }

    /// This process's start time, or 0 when `/proc` cannot tell.
    pub(super) fn own_start_ticks() -> u64 {
        std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|text| parse_stat(&text))
            .map_or(0, |(_, start)| start)
    }

    /// A hash of this process's pid namespace, or 0 when unknown. Pids are only comparable
    /// within one namespace (containers sharing a directory have separate ones).
    pub(super) fn own_pid_namespace() -> u64 {
        std::fs::read_link("/proc/self/ns/pid")
            .ok()
            .map_or(0, |link| fnv1a(link.as_os_str().as_encoded_bytes()) | 1)
    }

    /// This process's user id, from the owner of `/proc/self`.
    #[cfg(unix)]
    pub(super) fn own_uid() -> Option<u32> {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self").ok().map(|meta| meta.uid())
    }

    #[cfg(not(unix))]
    pub(super) fn own_uid() -> Option<u32> {
        None
    }

    /// Whether `pid` still runs the process that started at `start_ticks`: `Some(true)` yes,
    /// `Some(false)` no (gone, a zombie, or the pid reused), `None` cannot tell.
    pub(super) fn is_running(pid: u32, start_ticks: u64) -> Option<bool> {
        match std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat")) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(false),
            Err(_) => None,
            Ok(text) => {
                let (state, start) = parse_stat(&text)?;
                Some(start == start_ticks && !matches!(state, 'Z' | 'X' | 'x'))
            }
        }
    }
}

/// What a look at the id file found.
enum Sighting {
    /// No file yet.
    Missing,
    /// A file rank 0 must replace before it is usable; kept as the error to report if it is
    /// never replaced.
    Unusable(BootstrapError),
    /// A valid file whose writer is gone, or one this rank already used: ignored.
    Ignored(String),
    /// rank 0's current publication.
    Current(IdRecord),
}

impl FileRendezvous {
    /// A rendezvous in `dir` for `rank` of `world_size`, with the default job key and timeout.
    pub fn new(dir: impl Into<PathBuf>, rank: usize, world_size: usize) -> Self {
        FileRendezvous {
            dir: dir.into(),
            rank,
            world_size,
            job_key: DEFAULT_JOB_KEY.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            poll_interval: DEFAULT_POLL_INTERVAL,
        }
    }

    /// A file rendezvous for `launch` from this process's environment: directory
    /// `NCCL_RS_RENDEZVOUS_DIR` (else the system temporary directory), the job key and the
    /// timeout as described in the [module documentation](super#environment-variables).
    pub fn from_env(launch: &Launch) -> Result<Self> {
        Self::from_vars(launch, process_var)
    }

    /// Like [`from_env`](Self::from_env), reading variables through `vars`.
    pub fn from_vars(launch: &Launch, vars: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let vars: super::Vars<'_> = &vars;
        let dir = lookup(vars, vars::RENDEZVOUS_DIR)
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        Ok(FileRendezvous::new(dir, launch.rank, launch.world_size)
            .with_job_key(job_key_from(vars))
            .with_timeout(timeout_from(vars)?))
    }

    /// Sets the job key; every rank must use the same one.
    pub fn with_job_key(mut self, key: impl Into<String>) -> Self {
        self.job_key = key.into();
        self
    }

    /// Sets how long this rank waits: rank 0 for all acks, the others for the id file.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the longest pause between two looks at the directory (default 50 ms).
    pub fn with_poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The job key.
    pub fn job_key(&self) -> &str {
        &self.job_key
    }

    /// The timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn job_hash(&self) -> u64 {
        job_key_hash(&self.job_key)
    }

    /// The id file: `nccl-rs-<uid>-<job-key hash>.id` in the directory. The user id keeps two
    /// users' jobs with the same key apart in a shared directory like `/tmp`.
    pub fn id_path(&self) -> PathBuf {
        let name = match procfs::own_uid() {
            Some(uid) => format!("nccl-rs-{uid}-{:016x}.id", self.job_hash()),
            None => format!("nccl-rs-{:016x}.id", self.job_hash()),
        };
        self.dir.join(name)
    }

    /// The ack file of `rank`: the id file's name followed by `.ack.<rank>`.
    pub fn ack_path(&self, rank: usize) -> PathBuf {
        let mut name = self.id_path().into_os_string();
        name.push(format!(".ack.{rank}"));
        PathBuf::from(name)
    }

    /// Runs this rank's side: rank 0 must pass `Some(id)` and returns once every rank has
    /// acked it; the others pass `None` and return the id read.
    pub fn exchange(&self, id_if_rank0: Option<UniqueId>) -> Result<UniqueId> {
        check_rank(self.rank, self.world_size)?;
        match (self.rank, id_if_rank0) {
            (0, Some(id)) => self.publish(id).map(|()| id),
            (0, None) => Err(BootstrapError::Config(
                "rank 0 must provide the unique id to publish".to_owned(),
            )),
            (_, None) => self.fetch(),
            (rank, Some(_)) => Err(BootstrapError::Config(format!(
                "only rank 0 provides the unique id, but rank {rank} was given one"
            ))),
        }
    }

    /// Like [`exchange`](Self::exchange), with rank 0 creating the id by calling `make_id`.
    pub fn exchange_with(
        &self,
        make_id: impl FnOnce() -> crate::Result<UniqueId>,
    ) -> crate::Result<UniqueId> {
        check_rank(self.rank, self.world_size)?;
        if self.rank != 0 {
            return Ok(self.fetch()?);
        }
        let id = make_id()?;
        self.publish(id)?;
        Ok(id)
    }

    /// Rank 0: publishes `id` and waits until every other rank has acked it (or the timeout,
    /// [`BootstrapError::Timeout`] listing the missing ranks). The files are removed either way.
    pub fn publish(&self, id: UniqueId) -> Result<()> {
        check_rank(self.rank, self.world_size)?;
        if self.rank != 0 {
            return Err(BootstrapError::Config(format!(
                "only rank 0 publishes the unique id, this is rank {}",
                self.rank
            )));
        }
        if self.world_size == 1 {
            return Ok(());
        }
        let world_size = u32::try_from(self.world_size).map_err(|_| {
            BootstrapError::Config(format!("world size {} is too large", self.world_size))
        })?;
        let started = Instant::now();
        let deadline = deadline_after(started, self.timeout);
        fs::create_dir_all(&self.dir).map_err(|e| {
            io_error(
                format!("creating the rendezvous directory {}", self.dir.display()),
                e,
            )
        })?;
        // Acks left by a crashed job would be ignored anyway (they name another nonce), but
        // clearing them keeps the directory from accumulating files.
        for rank in 1..self.world_size {
            remove_quietly(&self.ack_path(rank));
        }
        let record = IdRecord {
            job_hash: self.job_hash(),
            world_size,
            nonce: random_u64(),
            pid: std::process::id(),
            start_ticks: procfs::own_start_ticks(),
            pid_namespace: procfs::own_pid_namespace(),
            id: id.into_bytes(),
        };
        let path = self.id_path();
        // The rename replaces a stale file of a crashed job in one step.
        write_atomically(&path, &record.encode())
            .map_err(|e| io_error(format!("publishing the unique id in {}", path.display()), e))?;

        let mut pending: Vec<usize> = (1..self.world_size).collect();
        let mut pause = FIRST_POLL_PAUSE;
        let outcome = loop {
            pending.retain(|&rank| !self.has_valid_ack(rank, &record, &id));
            if pending.is_empty() {
                break Ok(());
            }
            let Some(left) = time_left(deadline) else {
                break Err(BootstrapError::Timeout {
                    stage: format!(
                        "waiting for {} of {} ranks to acknowledge the unique id in {}: missing \
                         {:?}",
                        pending.len(),
                        self.world_size,
                        path.display(),
                        pending
                    ),
                    after: started.elapsed(),
                    missing_ranks: pending.clone(),
                });
            };
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(self.poll_interval);
        };
        remove_if_published_by(&path, record.nonce);
        for rank in 1..self.world_size {
            remove_quietly(&self.ack_path(rank));
        }
        outcome
    }

    fn has_valid_ack(&self, rank: usize, record: &IdRecord, id: &UniqueId) -> bool {
        let Ok(bytes) = read_small(&self.ack_path(rank), ACK_FILE_LEN) else {
            return false;
        };
        let Ok(rank) = u32::try_from(rank) else {
            return false;
        };
        // Anything but the exact expected bytes is an old or foreign ack; a real one replaces
        // it by rename.
        bytes[..] == encode_ack(record.job_hash, record.nonce, rank, id.fingerprint())[..]
    }

    /// Ranks other than 0: waits for rank 0's file, validates it, acks it and returns the id.
    ///
    /// A stale file (its writer is gone) is ignored until rank 0 replaces it. A corrupt or
    /// foreign file is waited out too, since rank 0 may still replace it, and reported as such
    /// when the timeout passes. A live file for another world size fails at once.
    pub fn fetch(&self) -> Result<UniqueId> {
        check_rank(self.rank, self.world_size)?;
        if self.rank == 0 {
            return Err(BootstrapError::Config(
                "rank 0 publishes the unique id; it does not fetch it".to_owned(),
            ));
        }
        let ack_rank = u32::try_from(self.rank)
            .map_err(|_| BootstrapError::Config(format!("rank {} is too large", self.rank)))?;
        let path = self.id_path();
        let started = Instant::now();
        let deadline = deadline_after(started, self.timeout);
        let mut pause = FIRST_POLL_PAUSE;
        loop {
            let sighting = self.look(&path);
            let record = match sighting {
                Sighting::Current(record) => record,
                Sighting::Missing | Sighting::Ignored(_) | Sighting::Unusable(_) => {
                    let Some(left) = time_left(deadline) else {
                        return Err(match sighting {
                            Sighting::Unusable(error) => error,
                            Sighting::Ignored(why) => BootstrapError::Timeout {
                                stage: format!(
                                    "waiting for rank 0 to publish the unique id in {} (the file \
                                     there was ignored: {why})",
                                    path.display()
                                ),
                                after: started.elapsed(),
                                missing_ranks: Vec::new(),
                            },
                            _ => BootstrapError::Timeout {
                                stage: format!(
                                    "waiting for rank 0 to publish the unique id in {}",
                                    path.display()
                                ),
                                after: started.elapsed(),
                                missing_ranks: Vec::new(),
                            },
                        });
                    };
                    thread::sleep(pause.min(left));
                    pause = (pause * 2).min(self.poll_interval);
                    continue;
                }
            };
            if record.world_size as usize != self.world_size {
                return Err(BootstrapError::WorldSizeMismatch {
                    expected: record.world_size as usize,
                    got: self.world_size,
                });
            }
            let id = UniqueId::from_bytes(record.id);
            let ack = encode_ack(record.job_hash, record.nonce, ack_rank, id.fingerprint());
            let ack_path = self.ack_path(self.rank);
            write_atomically(&ack_path, &ack)
                .map_err(|e| io_error(format!("writing the ack {}", ack_path.display()), e))?;
            used_publications()
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert((record.nonce, self.rank));
            return Ok(id);
        }
    }

    /// Reads and classifies the id file.
    fn look(&self, path: &Path) -> Sighting {
        let mut file = match File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Sighting::Missing,
            Err(e) => {
                return Sighting::Unusable(io_error(format!("opening {}", path.display()), e))
            }
        };
        if let (Some(own), Some(owner)) = (procfs::own_uid(), file_owner(&file)) {
            if own != owner {
                return Sighting::Unusable(BootstrapError::WrongJob {
                    detail: format!(
                        "{} belongs to user {owner}, not to this user ({own})",
                        path.display()
                    ),
                });
            }
        }
        let mut bytes = Vec::with_capacity(ID_FILE_LEN + 1);
        // One byte more than a valid file, to notice overlong ones without reading them whole.
        if let Err(e) = (&mut file)
            .take(ID_FILE_LEN as u64 + 1)
            .read_to_end(&mut bytes)
        {
            return Sighting::Unusable(io_error(format!("reading {}", path.display()), e));
        }
        let record = match IdRecord::decode(&bytes, path) {
            Ok(record) => record,
            Err(error) => return Sighting::Unusable(error),
        };
        if record.job_hash != self.job_hash() {
            return Sighting::Unusable(BootstrapError::WrongJob {
                detail: format!(
                    "{} was written for job key hash {:016x}, this rank's is {:016x}",
                    path.display(),
                    record.job_hash,
                    self.job_hash()
                ),
            });
        }
        // Pids can only be checked from the writer's pid namespace; elsewhere trust the file.
        let same_namespace =
            record.pid_namespace != 0 && record.pid_namespace == procfs::own_pid_namespace();
        if same_namespace && record.start_ticks != 0 {
            if let Some(false) = procfs::is_running(record.pid, record.start_ticks) {
                return Sighting::Ignored(format!(
                    "stale file of an earlier job: its rank 0 (pid {}) has exited",
                    record.pid
                ));
            }
        }
        let used = used_publications()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&(record.nonce, self.rank));
        if used {
            return Sighting::Ignored(
                "this rank already used that publication in an earlier exchange".to_owned(),
            );
        }
        Sighting::Current(record)
    }
}

#[cfg(unix)]
fn file_owner(file: &File) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    file.metadata().ok().map(|meta| meta.uid())
}

#[cfg(not(unix))]
fn file_owner(_file: &File) -> Option<u32> {
    None
}

/// Reads a file expected to be exactly `len` bytes.
fn read_small(path: &Path, len: usize) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::with_capacity(len + 1);
    File::open(path)?
        .take(len as u64 + 1)
        .read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Writes `bytes` to `path` so that readers see either the old file or the complete new one:
/// a unique temporary file in the same directory, synced, then renamed over `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut temp_name = path.as_os_str().to_owned();
    temp_name.push(format!(".tmp.{}.{:016x}", std::process::id(), random_u64()));
    let temp = PathBuf::from(temp_name);
    let written = (|| {
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            // The id lets a process join the communicator: keep it to this user.
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&temp, path)
    })();
    if written.is_err() {
        remove_quietly(&temp);
        return written;
    }
    // Persist the rename itself; not every platform can sync a directory, which is harmless
    // for a rendezvous that lives as long as the job.
    if let Some(dir) = path.parent() {
        if let Ok(dir) = File::open(dir) {
            let _ = dir.sync_all();
        }
    }
    Ok(())
}

/// Removes a file, ignoring failures: cleanup must not turn a finished exchange into an error.
fn remove_quietly(path: &Path) {
    let _ = fs::remove_file(path);
}

/// Removes the id file if it is still the publication `nonce` (not a newer job's file).
fn remove_if_published_by(path: &Path, nonce: u64) {
    let Ok(bytes) = read_small(path, ID_FILE_LEN) else {
        return;
    };
    if matches!(IdRecord::decode(&bytes, path), Ok(record) if record.nonce == nonce) {
        remove_quietly(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "nccl-rs-file-unit-{name}-{}-{:x}",
            std::process::id(),
            random_u64()
        ));
        fs::create_dir_all(&dir).expect("create scratch dir");
        dir
    }

    fn sample_id(seed: u8) -> UniqueId {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8) ^ seed;
        }
        UniqueId::from_bytes(bytes)
    }

    #[test]
    fn stat_lines_parse_even_with_odd_command_names() {
        let line = "1234 (we ird) name)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20";
        assert_eq!(procfs::parse_stat(line), Some(('S', 987654)));
        assert_eq!(procfs::parse_stat("garbage"), None);
        assert!(procfs::own_start_ticks() > 0 || !Path::new("/proc/self/stat").exists());
    }

    #[test]
    fn record_round_trip_and_corruption() {
        let record = IdRecord {
            job_hash: 7,
            world_size: 4,
            nonce: 99,
            pid: 1,
            start_ticks: 2,
            pid_namespace: 3,
            id: sample_id(5).into_bytes(),
        };
        let path = Path::new("x.id");
        let bytes = record.encode();
        assert_eq!(IdRecord::decode(&bytes, path).unwrap(), record);
        let mut flipped = bytes;
        flipped[100] ^= 1;
        assert!(matches!(
            IdRecord::decode(&flipped, path),
            Err(BootstrapError::Protocol(ref m)) if m.contains("checksum")
        ));
        assert!(matches!(
            IdRecord::decode(&bytes[..100], path),
            Err(BootstrapError::Protocol(_))
        ));
        let mut newer = bytes;
        newer[5] = 2;
        assert!(matches!(
            IdRecord::decode(&newer, path),
            Err(BootstrapError::VersionMismatch { local: 1, peer: 2 })
        ));
    }

    #[test]
    fn file_of_a_dead_writer_is_ignored() {
        let dir = scratch_dir("dead");
        // A process that has exited and been reaped: its pid is free.
        let mut child = std::process::Command::new(std::env::current_exe().expect("exe"))
            .arg("--list")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn");
        let dead_pid = child.id();
        child.wait().expect("wait");
        let client = FileRendezvous::new(&dir, 1, 2)
            .with_job_key("dead")
            .with_timeout(Duration::from_millis(200));
        let record = IdRecord {
            job_hash: client.job_hash(),
            world_size: 2,
            nonce: 1,
            pid: dead_pid,
            start_ticks: 1,
            pid_namespace: procfs::own_pid_namespace(),
            id: sample_id(1).into_bytes(),
        };
        write_atomically(&client.id_path(), &record.encode()).expect("write");
        if procfs::own_pid_namespace() != 0 {
            let err = client.fetch().unwrap_err();
            assert!(
                matches!(err, BootstrapError::Timeout { ref stage, .. } if stage.contains("stale")),
                "{err}"
            );
        }
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn second_exchange_with_same_key_skips_the_first_publication() {
        let dir = scratch_dir("twice");
        let rank = |r| {
            FileRendezvous::new(&dir, r, 3)
                .with_job_key("twice")
                .with_timeout(Duration::from_secs(5))
                .with_poll_interval(Duration::from_millis(5))
        };
        let root = rank(0);
        let publisher = thread::spawn(move || {
            root.publish(sample_id(1))?;
            root.publish(sample_id(2))
        });
        let fast = rank(1);
        let fast_rank = thread::spawn(move || (fast.fetch(), fast.fetch()));
        // Rank 2 holds the first exchange open, so rank 1 starts its second one while the
        // first file is still in place; it must wait for the second publication.
        thread::sleep(Duration::from_millis(200));
        let slow = rank(2);
        assert_eq!(slow.fetch().expect("first"), sample_id(1));
        assert_eq!(slow.fetch().expect("second"), sample_id(2));
        let (first, second) = fast_rank.join().expect("join");
        assert_eq!(first.expect("first"), sample_id(1));
        assert_eq!(second.expect("second"), sample_id(2));
        publisher.join().expect("join").expect("publish");
        let _ = fs::remove_dir_all(&dir);
    }
}
