//! NCCL's RAS from Rust: a client for the plain-text socket every NCCL 2.24+ process opens,
//! returning NCCL's own verdict on each communicator of the job.
//!
//! # What RAS is, as NCCL's source has it (2.24 to 2.30.7, `src/ras/`)
//!
//! Every process that creates a communicator starts a RAS thread (unless `NCCL_RAS_ENABLE=0`).
//! The threads of a job connect to each other and keep each other alive; each also listens
//! for clients on `NCCL_RAS_ADDR` (default `localhost:28028`). Every process of a host binds
//! that same address, with `SO_REUSEADDR` and `SO_REUSEPORT`, so all of them listen there and
//! the kernel hands each client connection to one of them; any one answers for the whole job,
//! since a status query is a collective of the RAS threads. Two jobs on one host with the
//! default address therefore share the port, and a query may reach the other job: give each
//! job its own address. [`spawn_local`](crate::bootstrap::spawn_local) does so for the ranks
//! it starts (see [`default_addr`]).
//!
//! The protocol (client protocol 2): the client sends `CLIENT PROTOCOL 2`, the server answers
//! `SERVER PROTOCOL 2`; `TIMEOUT <seconds>` sets how long the server's collective waits for
//! each leg (`OK`), `SET FORMAT json` (2.28.7+; `OK`, older servers answer `ERROR: ...`)
//! switches to JSON, and `STATUS` or `VERBOSE STATUS` returns the report, after which the
//! server closes the connection. The JSON report lists, per communicator, its `hash`, `size`,
//! `ranks` (with `status` flags and `collective_counts` per operation kind) and
//! `missing_ranks` (with `unresponsive` and `considered_dead`); its verdicts (`MISMATCH` of
//! operation counts, `INCOMPLETE` data, `ERROR`) are what this client derives from those
//! fields, as NCCL's text report does. NCCL 2.28.7 to 2.28.9 leave out a comma in each
//! missing rank's entry, which this client repairs before parsing; a report that still does
//! not parse is asked for again in the text format, whose `#group-index (hash) VERDICT`
//! sections are read instead (the text report names only communicators with a problem).
//!
//! # Bounds
//!
//! A query never blocks past its timeout ([`DEFAULT_RAS_TIMEOUT`], 2 s): connecting, every
//! read and every write are bounded by what is left of it, and the report is cut at
//! [`MAX_REPORT_BYTES`]. Nothing listening is [`Error::RasUnavailable`]; no answer in time
//! [`Error::RasTimeout`]; an answer that is not the protocol [`Error::RasProtocol`].

mod parse;
#[cfg(test)]
mod tests;

use std::fmt;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Where NCCL's RAS listens unless `NCCL_RAS_ADDR` says otherwise.
pub const DEFAULT_RAS_ADDR: &str = "localhost:28028";
/// NCCL's variable for the RAS client address.
pub const RAS_ADDR_VAR: &str = "NCCL_RAS_ADDR";
/// How long a query may take unless told otherwise.
pub const DEFAULT_RAS_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest report read; a longer one is an [`Error::RasProtocol`].
pub const MAX_REPORT_BYTES: usize = 16 << 20;
/// The client protocol this client speaks.
const PROTOCOL: u32 = 2;
/// The longest protocol line read (the greeting, `OK`, `ERROR: ...`).
const MAX_LINE: u64 = 4096;

/// The job's RAS address chosen by [`spawn_local`](crate::bootstrap::spawn_local) for the
/// ranks it started, for this process too (whose own NCCL it cannot tell).
static JOB_ADDR: OnceLock<String> = OnceLock::new();

/// Records the job's RAS address (see [`default_addr`]); the first one stays.
pub(crate) fn set_job_addr(addr: String) {
    let _ = JOB_ADDR.set(addr);
}

/// The address queries go to by default: `NCCL_RAS_ADDR` where set, else the address
/// [`spawn_local`](crate::bootstrap::spawn_local) gave the ranks of this job, else
/// [`DEFAULT_RAS_ADDR`].
pub fn default_addr() -> String {
    std::env::var(RAS_ADDR_VAR)
        .ok()
        .filter(|addr| !addr.trim().is_empty())
        .or_else(|| JOB_ADDR.get().cloned())
        .unwrap_or_else(|| DEFAULT_RAS_ADDR.to_owned())
}

/// Queries NCCL's RAS at [`default_addr`] within [`DEFAULT_RAS_TIMEOUT`].
pub fn query() -> Result<RasStatus> {
    RasQuery::new().run()
}

/// How a RAS query is made: where, how long it may take, how detailed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RasQuery {
    addr: String,
    timeout: Duration,
    verbose: bool,
    json: bool,
}

impl Default for RasQuery {
    fn default() -> Self {
        Self::new()
    }
}

impl RasQuery {
    /// A query of [`default_addr`] within [`DEFAULT_RAS_TIMEOUT`], in JSON where the server
    /// has it, not verbose.
    pub fn new() -> Self {
        Self {
            addr: default_addr(),
            timeout: DEFAULT_RAS_TIMEOUT,
            verbose: false,
            json: true,
        }
    }

    /// Asks `addr` (`host:port`).
    #[must_use]
    pub fn addr(mut self, addr: impl Into<String>) -> Self {
        self.addr = addr.into();
        self
    }

    /// The most the whole query may take (connecting included).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// `VERBOSE STATUS` instead of `STATUS` (the text report lists more ranks).
    #[must_use]
    pub fn verbose(mut self, verbose: bool) -> Self {
        self.verbose = verbose;
        self
    }

    /// Whether to ask for JSON first (default); `false` asks for the text report only.
    #[must_use]
    pub fn json(mut self, json: bool) -> Self {
        self.json = json;
        self
    }

    /// Runs the query; see the [module docs](self) for what may go wrong.
    pub fn run(&self) -> Result<RasStatus> {
        let deadline = deadline_after(self.timeout);
        let (format, report) = self.ask(deadline, self.json)?;
        if format == RasFormat::Json {
            match parse::json_report(&report) {
                Ok(communicators) => return Ok(self.status(format, report, communicators)),
                Err(why) if Instant::now() >= deadline => {
                    return Err(self.protocol(format!(
                        "the JSON report does not parse ({why}) and no time is left to ask \
                         for the text one"
                    )))
                }
                // Ask again, in text.
                Err(_) => {}
            }
            let (format, report) = self.ask(deadline, false)?;
            let communicators = parse::text_report(&report);
            return Ok(self.status(format, report, communicators));
        }
        let communicators = parse::text_report(&report);
        Ok(self.status(format, report, communicators))
    }

    fn status(&self, format: RasFormat, report: String, communicators: parse::Parsed) -> RasStatus {
        RasStatus {
            addr: self.addr.clone(),
            format,
            nccl_version: communicators.nccl_version,
            communicators: communicators.communicators,
            dead_processes: communicators.dead_processes,
            report,
        }
    }

    fn protocol(&self, reason: impl Into<String>) -> Error {
        Error::RasProtocol {
            addr: self.addr.clone(),
            reason: reason.into(),
        }
    }

    /// One connection: the handshake, the format, the status report.
    fn ask(&self, deadline: Instant, json: bool) -> Result<(RasFormat, String)> {
        let mut conn = Connection::open(self, deadline)?;
        conn.send(&format!("CLIENT PROTOCOL {PROTOCOL}\n"))?;
        let greeting = conn.line()?;
        let version = greeting
            .trim()
            .get(..16)
            .filter(|head| head.eq_ignore_ascii_case("SERVER PROTOCOL "))
            .and_then(|_| greeting.trim()[16..].trim().parse::<u32>().ok())
            .ok_or_else(|| self.protocol(format!("greeted with {:?}", clip(&greeting))))?;
        if version < PROTOCOL {
            return Err(self.protocol(format!(
                "server protocol {version}, this client needs {PROTOCOL}"
            )));
        }
        // The server's collective waits this long per leg: well inside our own budget.
        let left = deadline.saturating_duration_since(Instant::now());
        let leg = (left.as_secs() / 2).max(1);
        conn.send(&format!("TIMEOUT {leg}\n"))?;
        let _ = conn.line()?; // `OK`, or an error about the value: the default applies then.
        let mut format = RasFormat::Text;
        if json {
            conn.send("SET FORMAT json\n")?;
            if conn.line()?.trim().eq_ignore_ascii_case("OK") {
                format = RasFormat::Json;
            }
        }
        conn.send(if self.verbose {
            "VERBOSE STATUS\n"
        } else {
            "STATUS\n"
        })?;
        let report = conn.rest()?;
        if report.trim().is_empty() {
            return Err(self.protocol("closed the connection without a report"));
        }
        Ok((format, report))
    }
}

/// The first 80 characters of `text`, for error messages.
fn clip(text: &str) -> String {
    text.chars().take(80).collect()
}

/// `addr`'s socket addresses, `None` past `deadline`: an IP literal at once, a name on a
/// thread of its own (the system resolver has no timeout; one that overruns is left behind to
/// finish alone).
fn resolve(addr: &str, deadline: Instant) -> Option<std::io::Result<Vec<SocketAddr>>> {
    if let Ok(addr) = addr.parse::<SocketAddr>() {
        return Some(Ok(vec![addr]));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let name = addr.to_owned();
    let spawned = std::thread::Builder::new()
        .name("nccl-rs-ras-resolve".into())
        .spawn(move || {
            let _ = tx.send(name.to_socket_addrs().map(Iterator::collect));
        });
    if let Err(e) = spawned {
        return Some(Err(e));
    }
    rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .ok()
}

/// One connection to the RAS server, every step bounded by the query's deadline.
struct Connection<'q> {
    query: &'q RasQuery,
    deadline: Instant,
    reader: BufReader<TcpStream>,
}

impl<'q> Connection<'q> {
    fn open(query: &'q RasQuery, deadline: Instant) -> Result<Self> {
        let unavailable = |reason: String| Error::RasUnavailable {
            addr: query.addr.clone(),
            reason,
        };
        let addrs = match resolve(&query.addr, deadline) {
            Some(Ok(addrs)) => addrs,
            Some(Err(e)) => return Err(unavailable(format!("the address does not resolve: {e}"))),
            None => return Err(Connection::timeout(query, deadline)),
        };
        let mut last = None;
        for addr in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Connection::timeout(query, deadline));
            }
            match TcpStream::connect_timeout(&addr, left) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(Connection {
                        query,
                        deadline,
                        reader: BufReader::new(stream),
                    });
                }
                Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) => {
                    return Err(Connection::timeout(query, deadline));
                }
                Err(e) => last = Some(format!("{addr}: {e}")),
            }
        }
        Err(unavailable(last.unwrap_or_else(|| {
            "the address resolves to nothing".to_owned()
        })))
    }

    fn timeout(query: &RasQuery, deadline: Instant) -> Error {
        Error::RasTimeout {
            addr: query.addr.clone(),
            waited: query
                .timeout
                .saturating_sub(deadline.saturating_duration_since(Instant::now())),
        }
    }

    /// What is left of the deadline, set as the socket's timeouts; a timeout error if none.
    fn arm(&mut self) -> Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Connection::timeout(self.query, self.deadline));
        }
        let stream = self.reader.get_ref();
        stream
            .set_read_timeout(Some(left))
            .and_then(|()| stream.set_write_timeout(Some(left)))
            .map_err(|e| self.io(e))
    }

    fn io(&self, e: std::io::Error) -> Error {
        match e.kind() {
            ErrorKind::TimedOut | ErrorKind::WouldBlock => {
                Connection::timeout(self.query, self.deadline)
            }
            _ => Error::RasProtocol {
                addr: self.query.addr.clone(),
                reason: format!("connection failed: {e}"),
            },
        }
    }

    fn send(&mut self, line: &str) -> Result<()> {
        self.arm()?;
        self.reader
            .get_mut()
            .write_all(line.as_bytes())
            .map_err(|e| self.io(e))
    }

    /// One line of the server's (without checking what it says).
    fn line(&mut self) -> Result<String> {
        let mut bytes = Vec::new();
        loop {
            self.arm()?;
            let mut limited = (&mut self.reader).take(MAX_LINE);
            match limited.read_until(b'\n', &mut bytes) {
                Ok(0) => {
                    return Err(self
                        .query
                        .protocol("closed the connection in the middle of the conversation"))
                }
                Ok(_) if bytes.ends_with(b"\n") => break,
                Ok(_) if bytes.len() as u64 >= MAX_LINE => {
                    return Err(self.query.protocol("sent a line longer than 4096 bytes"))
                }
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.io(e)),
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Everything until the server closes the connection.
    fn rest(&mut self) -> Result<String> {
        let mut bytes = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            self.arm()?;
            match self.reader.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    if bytes.len() + n > MAX_REPORT_BYTES {
                        return Err(self.query.protocol(format!(
                            "sent a report of more than {MAX_REPORT_BYTES} bytes"
                        )));
                    }
                    bytes.extend_from_slice(&chunk[..n]);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.io(e)),
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// The format a report came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RasFormat {
    /// JSON (NCCL 2.28.7+).
    Json,
    /// NCCL's text report.
    Text,
}

/// What NCCL found wrong with a communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RasIssue {
    /// `MISMATCH`: its ranks have launched different numbers of operations (or are in
    /// different states): some rank is behind, or skipped one.
    Mismatch,
    /// `INCOMPLETE`: some ranks sent no data about it (their process is unresponsive or
    /// dead, or no longer has the communicator).
    Incomplete,
    /// `ERROR`: an initialisation or asynchronous error on some rank.
    Error,
    /// A process holding some of its ranks is considered dead by RAS.
    Dead,
}

impl RasIssue {
    /// NCCL's word for it.
    pub fn name(self) -> &'static str {
        match self {
            RasIssue::Mismatch => "MISMATCH",
            RasIssue::Incomplete => "INCOMPLETE",
            RasIssue::Error => "ERROR",
            RasIssue::Dead => "DEAD",
        }
    }
}

/// One rank of a communicator as RAS reports it (JSON reports only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RasRank {
    /// The rank in the communicator.
    pub rank: usize,
    /// The host, as NCCL prints its address.
    pub host: String,
    /// The process id (-1: unknown).
    pub pid: i64,
    /// Its CUDA device.
    pub cuda_dev: i64,
    /// NCCL's result code of its initialisation (0: success, 7: in progress).
    pub init_state: i64,
    /// Its asynchronous error code (0: none, 7: in progress).
    pub async_error: i64,
    /// Whether it was aborted.
    pub abort_flag: bool,
    /// Operations launched so far, per NCCL function name (`AllReduce`, `Broadcast`...).
    pub collective_counts: Vec<(String, u64)>,
}

/// A rank of a communicator from which RAS got no data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RasMissingRank {
    /// The rank in the communicator.
    pub rank: usize,
    /// Its process did not answer the query (JSON reports only; `false` in text ones).
    pub unresponsive: bool,
    /// RAS considers its process dead (JSON reports only).
    pub considered_dead: bool,
}

/// NCCL's view of one communicator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RasComm {
    /// NCCL's hash of the communicator (`commHash`), as in its logs.
    pub hash: u64,
    /// Its number of ranks, where the report says.
    pub size: Option<usize>,
    /// What is wrong with it (empty: `OK`).
    pub issues: Vec<RasIssue>,
    /// Its ranks that reported (JSON reports only).
    pub ranks: Vec<RasRank>,
    /// Its ranks that did not.
    pub missing_ranks: Vec<RasMissingRank>,
    /// `(rank, count)` where the report says how many operations a rank launched: in JSON
    /// reports the sum over kinds of each rank, in text ones the counts of a `MISMATCH`.
    pub operation_counts: Vec<(usize, u64)>,
}

impl RasComm {
    /// Whether NCCL found nothing wrong.
    pub fn is_ok(&self) -> bool {
        self.issues.is_empty()
    }

    /// The ranks RAS shows behind: those that launched fewer operations than the most any
    /// rank launched, and those it got no data from; ascending, each once.
    pub fn behind(&self) -> Vec<usize> {
        let most = self.operation_counts.iter().map(|(_, c)| *c).max();
        let mut ranks: Vec<usize> = self
            .operation_counts
            .iter()
            .filter(|(_, count)| Some(*count) < most)
            .map(|(rank, _)| *rank)
            .chain(self.missing_ranks.iter().map(|m| m.rank))
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }
}

/// NCCL's RAS report, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RasStatus {
    /// The address that answered.
    pub addr: String,
    /// The format it answered in.
    pub format: RasFormat,
    /// The NCCL version of the process that answered, where the report says.
    pub nccl_version: Option<String>,
    /// The communicators: all of them in a JSON report; in a text report only those NCCL
    /// found something wrong with.
    pub communicators: Vec<RasComm>,
    /// Whether RAS considers some process of the job dead.
    pub dead_processes: bool,
    /// The report as the server sent it.
    pub report: String,
}

impl RasStatus {
    /// The communicators NCCL found something wrong with.
    pub fn troubled(&self) -> impl Iterator<Item = &RasComm> {
        self.communicators.iter().filter(|c| !c.is_ok())
    }

    /// Whether NCCL found nothing wrong anywhere.
    pub fn is_ok(&self) -> bool {
        self.troubled().next().is_none() && !self.dead_processes
    }
}

impl fmt::Display for RasStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let version = self.nccl_version.as_deref().unwrap_or("unknown");
        writeln!(
            f,
            "NCCL RAS at {} (NCCL {version}, {:?} report): {} communicator(s) listed{}",
            self.addr,
            self.format,
            self.communicators.len(),
            if self.dead_processes {
                "; some process is considered dead"
            } else {
                ""
            }
        )?;
        for comm in &self.communicators {
            let issues: Vec<&str> = comm.issues.iter().map(|i| i.name()).collect();
            let verdict = if issues.is_empty() {
                "OK".to_owned()
            } else {
                issues.join(",")
            };
            write!(f, "  comm {:016x}", comm.hash)?;
            if let Some(size) = comm.size {
                write!(f, " ({size} ranks)")?;
            }
            write!(f, ": {verdict}")?;
            let behind = comm.behind();
            if !behind.is_empty() {
                write!(f, "; behind or missing: ranks {behind:?}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// What a watchdog learned from RAS when it tripped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RasOutcome {
    /// RAS answered.
    Answered(RasStatus),
    /// RAS was asked and did not answer: the error says why (nothing listening: an NCCL
    /// older than 2.24 or `NCCL_RAS_ENABLE=0`; no answer in time; not the protocol).
    NotAnswered(String),
    /// RAS was not asked, for the reason given.
    NotAsked(String),
    /// Being asked now (the watchdog asks after it acted; see
    /// [`Watchdog::trip_report`](crate::Watchdog::trip_report)).
    Pending,
}

impl fmt::Display for RasOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RasOutcome::Answered(status) => write!(f, "{status}"),
            RasOutcome::NotAnswered(why) => writeln!(f, "NCCL RAS did not answer: {why}"),
            RasOutcome::NotAsked(why) => writeln!(f, "NCCL RAS not asked: {why}"),
            RasOutcome::Pending => writeln!(f, "NCCL RAS: being asked"),
        }
    }
}

/// `now + wait`, or a year from now where that does not fit in an `Instant`
/// (`Duration::MAX` means "no deadline" to a caller, not a panic).
pub(crate) fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}
