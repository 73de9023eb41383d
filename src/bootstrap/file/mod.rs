//! File rendezvous for ranks on one machine: rank 0 publishes the id in a file, the others
//! read it and leave an ack file each.
//!
//! Rooms: [`wire`] (the records), [`fs`] (atomic writes and small reads), [`procfs`] (is
//! rank 0 still alive?); the exchange itself is here.

mod fs;
mod procfs;
#[cfg(test)]
mod tests;
mod wire;

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use self::fs::{owner, read_small, read_small_file, remove_quietly, write_atomically};
use self::wire::{encode_ack, IdRecord, ACK_FILE_LEN, MAX_ID_FILE_LEN};
use super::bytes::job_key_hash;
use super::env::{lookup, process_var, vars, Vars};
use super::ids::{self, IdCount};
use super::rendezvous::{sealed, Rendezvous, Transport};
use super::util::{deadline_after, io_error, random_u64, time_left};
use super::{BootstrapError, Placement, Result};
use crate::UniqueId;

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
pub type FileRendezvous = Rendezvous<FileTransport>;

/// The file transport of a [`FileRendezvous`]: the shared directory and how often to look.
///
/// # Protocol, version 1
///
/// Rank 0 writes `nccl-rs-<uid>-<job-key hash>.id` in the rendezvous directory: a 192-byte
/// record (magic `NRSF`, version, job-key hash, world size, a random nonce, rank 0's pid, its
/// start time and pid namespace, the id, and a checksum), written to a unique temporary name,
/// synced and renamed into place so readers never see a partial file. Each rank validates the
/// record, writes `<name>.ack.<rank>` the same way (naming the nonce it read), and returns;
/// rank 0 removes the id file and the acks once all ranks acked, or at its deadline.
///
/// Several ids ([`IdCount`]) are written as version 2 of the record: the same first 56 bytes
/// (with version 2), the id count `u32`, a reserved `u32`, the ids, and the checksum. One id is
/// always written as version 1, so such a job's files are what earlier versions wrote; an
/// earlier reader refuses a version 2 file ([`BootstrapError::VersionMismatch`], reported at
/// its deadline). A rank that expects another count than the file holds fails with
/// [`BootstrapError::IdCountMismatch`] without acking (rank 0 then times out naming it). The ack
/// names the ids by a fingerprint of all of them.
///
/// A file left by a job that crashed is recognised as stale when its writer process is gone
/// (or its pid now belongs to a newer process), and ignored; the new rank 0 replaces it. Ack
/// files carry the nonce, so leftovers of an old job are never counted. Files are created
/// readable by their owner only, and a file owned by another user is never trusted. A rank that
/// exchanges twice under one key skips the publication it already used.
#[derive(Debug, Clone)]
pub struct FileTransport {
    dir: PathBuf,
    poll_interval: Duration,
}

impl Transport for FileTransport {}

impl sealed::Halves for FileTransport {
    fn host<E: From<BootstrapError>>(
        rendezvous: &FileRendezvous,
        count: usize,
        make_ids: impl FnOnce(usize) -> Result<Vec<UniqueId>, E>,
    ) -> Result<Vec<UniqueId>, E> {
        let ids = make_ids(count)?;
        rendezvous.publish_ids(&ids)?;
        Ok(ids)
    }

    fn fetch(rendezvous: &FileRendezvous, wanted: IdCount) -> Result<Vec<UniqueId>> {
        rendezvous.read_and_ack(wanted)
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

impl Sighting {
    /// The error to report when the wait ends on this sighting.
    fn into_error(self, path: &Path, started: Instant) -> BootstrapError {
        let ignored = match self {
            Sighting::Unusable(error) => return error,
            Sighting::Ignored(why) => format!(" (the file there was ignored: {why})"),
            Sighting::Missing | Sighting::Current(_) => String::new(),
        };
        BootstrapError::Timeout {
            stage: format!(
                "waiting for rank 0 to publish the unique id in {}{ignored}",
                path.display()
            ),
            after: started.elapsed(),
            missing_ranks: Vec::new(),
        }
    }
}

impl Rendezvous<FileTransport> {
    /// A rendezvous in `dir` for `rank` of `world_size`, with the default job key and timeout.
    pub fn new(dir: impl Into<PathBuf>, rank: usize, world_size: usize) -> Self {
        let transport = FileTransport {
            dir: dir.into(),
            poll_interval: DEFAULT_POLL_INTERVAL,
        };
        Rendezvous::over(transport, rank, world_size)
    }

    /// A file rendezvous for `placement` from this process's environment: directory
    /// `NCCL_RS_RENDEZVOUS_DIR` (else the system temporary directory), the job key and the
    /// timeout as described in the [module documentation](super#environment-variables).
    pub fn from_env(placement: &Placement) -> Result<Self> {
        Self::from_vars(placement, process_var)
    }

    /// Like [`from_env`](Self::from_env), reading variables through `vars`.
    pub fn from_vars(placement: &Placement, vars: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let vars: Vars<'_> = &vars;
        let dir = lookup(vars, vars::RENDEZVOUS_DIR)
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        FileRendezvous::new(dir, placement.rank, placement.world_size).configured_by(vars)
    }

    /// Sets the longest pause between two looks at the directory (default 50 ms).
    pub fn with_poll_interval(mut self, interval: Duration) -> Self {
        self.transport.poll_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.transport.dir
    }

    fn job_hash(&self) -> u64 {
        job_key_hash(self.job_key())
    }

    /// The id file: `nccl-rs-<uid>-<job-key hash>.id` in the directory. The user id keeps two
    /// users' jobs with the same key apart in a shared directory like `/tmp`.
    pub fn id_path(&self) -> PathBuf {
        let name = match procfs::own_uid() {
            Some(uid) => format!("nccl-rs-{uid}-{:016x}.id", self.job_hash()),
            None => format!("nccl-rs-{:016x}.id", self.job_hash()),
        };
        self.dir().join(name)
    }

    /// The ack file of `rank`: the id file's name followed by `.ack.<rank>`.
    pub fn ack_path(&self, rank: usize) -> PathBuf {
        let mut name = self.id_path().into_os_string();
        name.push(format!(".ack.{rank}"));
        PathBuf::from(name)
    }

    /// Rank 0: publishes `id` and waits until every other rank has acked it (or the timeout,
    /// [`BootstrapError::Timeout`] listing the missing ranks). The files are removed either way.
    pub fn publish(&self, id: UniqueId) -> Result<()> {
        self.publish_ids(&[id])
    }

    /// Like [`publish`](Self::publish), for several ids (in this order): 1 to the world size,
    /// at most [`MAX_EXCHANGED_IDS`](crate::bootstrap::MAX_EXCHANGED_IDS). Several ids are
    /// written as version 2 of the record.
    pub fn publish_ids(&self, ids: &[UniqueId]) -> Result<()> {
        self.require_rank0("publishes the unique id")?;
        IdCount::Exactly(ids.len()).check(self.world_size())?;
        if self.world_size() == 1 {
            return Ok(());
        }
        let world_size = u32::try_from(self.world_size()).map_err(|_| {
            BootstrapError::Config(format!("world size {} is too large", self.world_size()))
        })?;
        let started = Instant::now();
        std::fs::create_dir_all(self.dir()).map_err(|e| {
            io_error(
                format!("creating the rendezvous directory {}", self.dir().display()),
                e,
            )
        })?;
        // Acks left by a crashed job would be ignored anyway (they name another nonce), but
        // clearing them keeps the directory from accumulating files.
        self.remove_acks();
        let record = IdRecord {
            job_hash: self.job_hash(),
            world_size,
            nonce: random_u64(),
            pid: std::process::id(),
            start_ticks: procfs::own_start_ticks(),
            pid_namespace: procfs::own_pid_namespace(),
            ids: ids.to_vec(),
        };
        let path = self.id_path();
        // The rename replaces a stale file of a crashed job in one step.
        write_atomically(&path, &record.encode())
            .map_err(|e| io_error(format!("publishing the unique id in {}", path.display()), e))?;
        let outcome = self.await_acks(&record, started);
        self.remove_if_published_by(&path, record.nonce);
        self.remove_acks();
        outcome
    }

    /// Rank 0: polls until every rank's ack of `record` is there, or the deadline.
    fn await_acks(&self, record: &IdRecord, started: Instant) -> Result<()> {
        let deadline = deadline_after(started, self.timeout());
        let mut pending: Vec<usize> = (1..self.world_size()).collect();
        let mut pause = FIRST_POLL_PAUSE;
        loop {
            pending.retain(|&rank| !self.has_valid_ack(rank, record));
            if pending.is_empty() {
                return Ok(());
            }
            let Some(left) = time_left(deadline) else {
                return Err(BootstrapError::Timeout {
                    stage: format!(
                        "waiting for {} of {} ranks to acknowledge the unique id in {}: missing \
                         {pending:?}",
                        pending.len(),
                        self.world_size(),
                        self.id_path().display(),
                    ),
                    after: started.elapsed(),
                    missing_ranks: pending,
                });
            };
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(self.transport.poll_interval);
        }
    }

    fn has_valid_ack(&self, rank: usize, record: &IdRecord) -> bool {
        let Ok(bytes) = read_small_file(&self.ack_path(rank), ACK_FILE_LEN) else {
            return false;
        };
        let Ok(rank) = u32::try_from(rank) else {
            return false;
        };
        // Anything but the exact expected bytes is an old or foreign ack; a real one replaces
        // it by rename.
        let fingerprint = ids::fingerprint(&record.ids);
        bytes[..] == encode_ack(record.job_hash, record.nonce, rank, fingerprint)[..]
    }

    fn remove_acks(&self) {
        for rank in 1..self.world_size() {
            remove_quietly(&self.ack_path(rank));
        }
    }

    /// Removes the id file if it is still the publication `nonce` (not a newer job's file).
    fn remove_if_published_by(&self, path: &Path, nonce: u64) {
        let Ok(bytes) = read_small_file(path, MAX_ID_FILE_LEN) else {
            return;
        };
        if matches!(IdRecord::decode(&bytes, path), Ok(record) if record.nonce == nonce) {
            remove_quietly(path);
        }
    }

    /// Ranks other than 0: waits for rank 0's file, validates it, acks it and returns the id.
    ///
    /// A stale file (its writer is gone) is ignored until rank 0 replaces it. A corrupt or
    /// foreign file is waited out too, since rank 0 may still replace it, and reported as such
    /// when the timeout passes. A live file for another world size fails at once.
    fn read_and_ack(&self, wanted: IdCount) -> Result<Vec<UniqueId>> {
        let ack_rank = u32::try_from(self.rank())
            .map_err(|_| BootstrapError::Config(format!("rank {} is too large", self.rank())))?;
        let record = self.await_publication()?;
        if record.world_size as usize != self.world_size() {
            return Err(BootstrapError::WorldSizeMismatch {
                expected: record.world_size as usize,
                got: self.world_size(),
            });
        }
        wanted.accepts(record.ids.len())?;
        let ack = encode_ack(
            record.job_hash,
            record.nonce,
            ack_rank,
            ids::fingerprint(&record.ids),
        );
        let ack_path = self.ack_path(self.rank());
        write_atomically(&ack_path, &ack)
            .map_err(|e| io_error(format!("writing the ack {}", ack_path.display()), e))?;
        self.history
            .mark_used(record.job_hash, self.rank(), record.nonce);
        Ok(record.ids)
    }

    /// Polls the id file until it holds a current publication, or the deadline.
    fn await_publication(&self) -> Result<IdRecord> {
        let path = self.id_path();
        let started = Instant::now();
        let deadline = deadline_after(started, self.timeout());
        let mut pause = FIRST_POLL_PAUSE;
        loop {
            let sighting = self.look(&path);
            if let Sighting::Current(record) = sighting {
                return Ok(record);
            }
            let Some(left) = time_left(deadline) else {
                return Err(sighting.into_error(&path, started));
            };
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(self.transport.poll_interval);
        }
    }

    /// Reads and classifies the id file.
    fn look(&self, path: &Path) -> Sighting {
        match self.read_record(path) {
            Ok(Some(record)) => self.judge(record),
            Ok(None) => Sighting::Missing,
            Err(error) => Sighting::Unusable(error),
        }
    }

    /// Reads the id file, if there is one, and checks that it is this user's, intact, and of
    /// this job.
    fn read_record(&self, path: &Path) -> Result<Option<IdRecord>> {
        let file = match File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error(format!("opening {}", path.display()), e)),
        };
        if let (Some(own), Some(owner)) = (procfs::own_uid(), owner(&file)) {
            if own != owner {
                return Err(BootstrapError::WrongJob {
                    detail: format!(
                        "{} belongs to user {owner}, not to this user ({own})",
                        path.display()
                    ),
                });
            }
        }
        let bytes = read_small(&file, MAX_ID_FILE_LEN)
            .map_err(|e| io_error(format!("reading {}", path.display()), e))?;
        let record = IdRecord::decode(&bytes, path)?;
        if record.job_hash != self.job_hash() {
            return Err(BootstrapError::WrongJob {
                detail: format!(
                    "{} was written for job key hash {:016x}, this rank's is {:016x}",
                    path.display(),
                    record.job_hash,
                    self.job_hash()
                ),
            });
        }
        Ok(Some(record))
    }

    /// Whether a valid record is rank 0's current publication, or one to ignore.
    fn judge(&self, record: IdRecord) -> Sighting {
        // Pids can only be checked from the writer's pid namespace; elsewhere trust the file.
        let same_namespace =
            record.pid_namespace != 0 && record.pid_namespace == procfs::own_pid_namespace();
        if same_namespace
            && record.start_ticks != 0
            && procfs::is_running(record.pid, record.start_ticks) == Some(false)
        {
            return Sighting::Ignored(format!(
                "stale file of an earlier job: its rank 0 (pid {}) has exited",
                record.pid
            ));
        }
        if self
            .history
            .used(record.job_hash, self.rank(), record.nonce)
        {
            return Sighting::Ignored(
                "this rank already used that publication in an earlier exchange".to_owned(),
            );
        }
        Sighting::Current(record)
    }
}
