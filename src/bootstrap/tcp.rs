//! TCP rendezvous: rank 0 serves the unique id, every other rank fetches it.
//!
//! The wire format is described in the [module documentation](super#tcp-protocol-version-1).

use std::fmt;
use std::io::{self, Read, Write};
use std::net::ToSocketAddrs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::util::{
    deadline_after, io_error, job_key_hash, process_var, read_full, time_left, write_full,
    Interrupt, ReadShort,
};
use super::{
    address_from, check_rank, job_key_from, timeout_from, BootstrapError, Launch, Result,
    DEFAULT_JOB_KEY, DEFAULT_TIMEOUT,
};
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

const MAGIC: [u8; 4] = *b"NRSB";
/// The protocol version this build speaks.
const VERSION: u16 = 1;
const KIND_REQUEST: u16 = 1;
const KIND_REPLY: u16 = 2;
const KIND_ACK: u16 = 3;
const REQUEST_LEN: usize = 32;
const REPLY_HEADER_LEN: usize = 16;
const ACK_LEN: usize = 24;

/// Detail of a "rank already taken" reply: another connection holds the rank but has not
/// acked yet (worth retrying), or the rank has acked (final).
const DUPLICATE_IN_FLIGHT: u32 = 1;
const DUPLICATE_DONE: u32 = 2;

/// How long one connection may take from accept to ack, unless set otherwise. A well-behaved
/// rank needs a round trip or two; this only bounds misbehaving peers.
const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// Grace period for sending an error reply and letting the peer read it.
const ERROR_REPLY_GRACE: Duration = Duration::from_millis(200);
/// Longest pause between connection attempts of a joining rank.
const MAX_RETRY_PAUSE: Duration = Duration::from_millis(250);
/// Longest a single connect() may take before the next address or attempt is tried.
const MAX_CONNECT_WAIT: Duration = Duration::from_secs(2);

/// Reply status codes. Numbers are part of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Ok = 0,
    BadMagic = 1,
    UnsupportedVersion = 2,
    Malformed = 3,
    WrongJob = 4,
    WorldSizeMismatch = 5,
    RankOutOfRange = 6,
    DuplicateRank = 7,
    TimedOut = 8,
    Busy = 9,
    Early = 10,
    Late = 11,
}

impl Status {
    fn from_code(code: u16) -> Option<Self> {
        Some(match code {
            0 => Status::Ok,
            1 => Status::BadMagic,
            2 => Status::UnsupportedVersion,
            3 => Status::Malformed,
            4 => Status::WrongJob,
            5 => Status::WorldSizeMismatch,
            6 => Status::RankOutOfRange,
            7 => Status::DuplicateRank,
            8 => Status::TimedOut,
            9 => Status::Busy,
            10 => Status::Early,
            11 => Status::Late,
            _ => return None,
        })
    }
}

fn reply_header(status: Status, detail: u32) -> [u8; REPLY_HEADER_LEN] {
    let mut header = [0u8; REPLY_HEADER_LEN];
    header[0..4].copy_from_slice(&MAGIC);
    header[4..6].copy_from_slice(&VERSION.to_be_bytes());
    header[6..8].copy_from_slice(&KIND_REPLY.to_be_bytes());
    header[8..10].copy_from_slice(&(status as u16).to_be_bytes());
    header[12..16].copy_from_slice(&detail.to_be_bytes());
    header
}

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([bytes[at], bytes[at + 1]])
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_be_bytes(word)
}

/// Converts a count that travels as `u32`.
fn wire_u32(value: usize, what: &str) -> Result<u32> {
    u32::try_from(value).map_err(|_| {
        BootstrapError::Config(format!(
            "{what} {value} does not fit the protocol's 32 bits"
        ))
    })
}

/// Per-process exchange counters, so that a program exchanging several ids under one job key
/// keeps its exchanges apart: a rank that finished exchange `n` and starts `n + 1` while rank
/// 0 still serves `n` to slower ranks is told to come back, instead of being taken for a
/// duplicate of itself. Every process runs the same sequence of exchanges, so the counts agree.
mod rounds {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock, PoisonError};

    /// Next exchange per (job-key hash, rank); rank 0's entry counts the serves.
    fn table() -> &'static Mutex<HashMap<(u64, usize), u32>> {
        static TABLE: OnceLock<Mutex<HashMap<(u64, usize), u32>>> = OnceLock::new();
        TABLE.get_or_init(|| Mutex::new(HashMap::new()))
    }

    fn with<T>(f: impl FnOnce(&mut HashMap<(u64, usize), u32>) -> T) -> T {
        f(&mut table().lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The exchange a fetching rank is on.
    pub(super) fn current(job_hash: u64, rank: usize) -> u32 {
        with(|table| table.get(&(job_hash, rank)).copied().unwrap_or(0))
    }

    /// Records that `rank` completed exchange `round`.
    pub(super) fn finished(job_hash: u64, rank: usize, round: u32) {
        with(|table| {
            table.insert((job_hash, rank), round.saturating_add(1));
        });
    }

    /// Rank 0: the exchange this serve is, counting it as started.
    pub(super) fn start_serving(job_hash: u64) -> u32 {
        with(|table| {
            let next = table.entry((job_hash, 0)).or_insert(0);
            let round = *next;
            *next = next.saturating_add(1);
            round
        })
    }
}

/// A TCP rendezvous for one rank: rank 0 serves the id at `addr`, the others fetch it.
///
/// ```no_run
/// use nccl::bootstrap::TcpRendezvous;
/// use std::time::Duration;
///
/// # fn main() -> nccl::Result<()> {
/// # let (rank, world_size) = (1, 4);
/// let rendezvous = TcpRendezvous::new("node0:29500", rank, world_size)
///     .with_job_key("training-run-17")
///     .with_timeout(Duration::from_secs(60));
/// let id = rendezvous.exchange_with(nccl::UniqueId::new)?;
/// # let _ = id;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct TcpRendezvous {
    addr: String,
    rank: usize,
    world_size: usize,
    job_key: String,
    timeout: Duration,
    connection_timeout: Duration,
    /// A listener rank 0 bound ahead of time ([`spawn_local`](super::spawn_local) binds before
    /// telling the children the port, so no other process can take it in between).
    prebound: Option<Arc<TcpListener>>,
    /// Ends rank 0's serving early (a [`spawn_local`](super::spawn_local) rank died).
    interrupt: Option<Interrupt>,
}

impl TcpRendezvous {
    /// A rendezvous at `addr` (`host:port`) for `rank` of `world_size`, with the default job
    /// key and timeouts.
    pub fn new(addr: impl Into<String>, rank: usize, world_size: usize) -> Self {
        TcpRendezvous {
            addr: addr.into(),
            rank,
            world_size,
            job_key: DEFAULT_JOB_KEY.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            prebound: None,
            interrupt: None,
        }
    }

    /// A TCP rendezvous for `launch` from this process's environment: the address from
    /// `NCCL_RS_ADDR` or `MASTER_ADDR`/`MASTER_PORT`, the job key and the timeout as described
    /// in the [module documentation](super#environment-variables). Fails when no address is
    /// set.
    pub fn from_env(launch: &Launch) -> Result<Self> {
        Self::from_vars(launch, process_var)
    }

    /// Like [`from_env`](Self::from_env), reading variables through `vars`.
    pub fn from_vars(launch: &Launch, vars: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let vars: super::Vars<'_> = &vars;
        let addr = address_from(vars)?.ok_or_else(|| {
            BootstrapError::Config(
                "no TCP rendezvous address: set NCCL_RS_ADDR, or MASTER_ADDR and MASTER_PORT"
                    .to_owned(),
            )
        })?;
        Ok(TcpRendezvous::new(addr, launch.rank, launch.world_size)
            .with_job_key(job_key_from(vars))
            .with_timeout(timeout_from(vars)?))
    }

    /// Sets the job key; every rank must use the same one.
    pub fn with_job_key(mut self, key: impl Into<String>) -> Self {
        self.job_key = key.into();
        self
    }

    /// Sets how long the whole exchange may take on this rank: rank 0 waits this long for all
    /// ranks, the others this long for rank 0 to answer.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets how long rank 0 gives one connection from accept to ack (default 10 s). Bounds
    /// how long a silent or slow peer keeps a server thread.
    pub fn with_connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    pub(crate) fn with_prebound(mut self, listener: TcpListener) -> Self {
        self.prebound = Some(Arc::new(listener));
        self
    }

    pub(crate) fn with_interrupt(mut self, interrupt: Interrupt) -> Self {
        self.interrupt = Some(interrupt);
        self
    }

    /// The `host:port` address.
    pub fn addr(&self) -> &str {
        &self.addr
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

    /// The exchange timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs this rank's side: rank 0 must pass `Some(id)` and returns once every rank holds it;
    /// the others pass `None` and return the fetched id.
    pub fn exchange(&self, id_if_rank0: Option<UniqueId>) -> Result<UniqueId> {
        check_rank(self.rank, self.world_size)?;
        match (self.rank, id_if_rank0) {
            (0, Some(id)) => {
                if self.world_size > 1 {
                    self.bind()?.serve(id)?;
                }
                Ok(id)
            }
            (0, None) => Err(BootstrapError::Config(
                "rank 0 must provide the unique id to serve".to_owned(),
            )),
            (_, None) => self.fetch(),
            (rank, Some(_)) => Err(BootstrapError::Config(format!(
                "only rank 0 provides the unique id, but rank {rank} was given one"
            ))),
        }
    }

    /// Like [`exchange`](Self::exchange), with rank 0 creating the id by calling `make_id`
    /// after its listener is bound (so a busy port fails before NCCL state is created).
    pub fn exchange_with(
        &self,
        make_id: impl FnOnce() -> crate::Result<UniqueId>,
    ) -> crate::Result<UniqueId> {
        check_rank(self.rank, self.world_size)?;
        if self.rank != 0 {
            return Ok(self.fetch()?);
        }
        if self.world_size == 1 {
            return make_id();
        }
        let server = self.bind()?;
        let id = make_id()?;
        server.serve(id)?;
        Ok(id)
    }

    /// Rank 0: binds the listener, without serving yet. With port 0 the system picks a free
    /// port: see [`TcpServer::local_addr`].
    pub fn bind(&self) -> Result<TcpServer> {
        check_rank(self.rank, self.world_size)?;
        if self.rank != 0 {
            return Err(BootstrapError::Config(format!(
                "only rank 0 listens, this is rank {}",
                self.rank
            )));
        }
        wire_u32(self.world_size, "world size")?;
        let listener = match &self.prebound {
            Some(listener) => listener
                .try_clone()
                .map_err(|e| io_error("duplicating the pre-bound rendezvous listener", e))?,
            None => bind_listener(&self.addr)?,
        };
        let local_addr = listener
            .local_addr()
            .map_err(|e| io_error("reading the rendezvous listener's address", e))?;
        Ok(TcpServer {
            listener,
            local_addr,
            world_size: self.world_size,
            job_hash: job_key_hash(&self.job_key),
            timeout: self.timeout,
            connection_timeout: self.connection_timeout,
            interrupt: self.interrupt.clone(),
        })
    }

    /// Ranks other than 0: fetches the id from rank 0, retrying until the timeout while rank 0
    /// is not listening yet or is busy.
    pub fn fetch(&self) -> Result<UniqueId> {
        check_rank(self.rank, self.world_size)?;
        if self.rank == 0 {
            return Err(BootstrapError::Config(
                "rank 0 serves the unique id; it does not fetch it".to_owned(),
            ));
        }
        let job_hash = job_key_hash(&self.job_key);
        let round = rounds::current(job_hash, self.rank);
        let request = self.request_bytes(round)?;
        let started = Instant::now();
        let deadline = deadline_after(started, self.timeout);
        let mut pause = Duration::from_millis(5);
        loop {
            let last_failure = match self.attempt(&request, deadline) {
                Ok(id) => {
                    rounds::finished(job_hash, self.rank, round);
                    return Ok(id);
                }
                Err(Attempt::Fatal(error)) => return Err(error),
                Err(Attempt::Retry(why)) => why,
            };
            let Some(left) = time_left(deadline) else {
                return Err(BootstrapError::Timeout {
                    stage: format!(
                        "waiting for rank 0 at {} to hand out the unique id (last attempt: {})",
                        self.addr, last_failure
                    ),
                    after: started.elapsed(),
                    missing_ranks: Vec::new(),
                });
            };
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(MAX_RETRY_PAUSE);
        }
    }

    fn request_bytes(&self, round: u32) -> Result<[u8; REQUEST_LEN]> {
        let mut request = [0u8; REQUEST_LEN];
        request[0..4].copy_from_slice(&MAGIC);
        request[4..6].copy_from_slice(&VERSION.to_be_bytes());
        request[6..8].copy_from_slice(&KIND_REQUEST.to_be_bytes());
        request[8..16].copy_from_slice(&job_key_hash(&self.job_key).to_be_bytes());
        request[16..20].copy_from_slice(&wire_u32(self.world_size, "world size")?.to_be_bytes());
        request[20..24].copy_from_slice(&wire_u32(self.rank, "rank")?.to_be_bytes());
        request[24..28].copy_from_slice(&round.to_be_bytes());
        Ok(request)
    }

    /// One connection attempt.
    fn attempt(&self, request: &[u8; REQUEST_LEN], deadline: Instant) -> Result<UniqueId, Attempt> {
        let stream = self.connect(deadline)?;
        // Small messages in both directions: send them at once.
        let _ = stream.set_nodelay(true);
        write_full(&stream, request, deadline)
            .map_err(|e| Attempt::Retry(format!("sending the request: {e}")))?;

        // Rank 0 answers right after reading the request; a peer that stays silent longer than
        // a connection timeout is busy or not a rendezvous, and is tried again.
        let reply_deadline = deadline.min(deadline_after(Instant::now(), self.connection_timeout));
        let mut header = [0u8; REPLY_HEADER_LEN];
        match read_full(&stream, &mut header, reply_deadline) {
            Ok(()) => {}
            Err(ReadShort::Eof { got: 0 }) => {
                return Err(Attempt::Retry(
                    "rank 0 closed the connection without replying".to_owned(),
                ))
            }
            Err(ReadShort::Eof { got }) => {
                return Err(Attempt::Fatal(BootstrapError::Protocol(format!(
                    "truncated reply from {}: {got} of {REPLY_HEADER_LEN} header bytes",
                    self.addr
                ))))
            }
            Err(ReadShort::TimedOut { got }) => {
                return Err(Attempt::Retry(format!(
                    "no complete reply within {:?} ({got} of {REPLY_HEADER_LEN} header bytes)",
                    self.connection_timeout
                )))
            }
            Err(ReadShort::Io(e)) => return Err(Attempt::Retry(format!("reading the reply: {e}"))),
        }
        if header[0..4] != MAGIC {
            return Err(Attempt::Fatal(BootstrapError::Protocol(format!(
                "{} replied with {:02x?}, not an nccl-rs rendezvous reply",
                self.addr,
                &header[0..4]
            ))));
        }
        let version = u16_at(&header, 4);
        let kind = u16_at(&header, 6);
        let status_code = u16_at(&header, 8);
        let detail = u32_at(&header, 12);
        let status = Status::from_code(status_code);
        if version != VERSION {
            // Every version keeps this header, so rank 0's own version is what it announced.
            return Err(Attempt::Fatal(BootstrapError::VersionMismatch {
                local: VERSION,
                peer: version,
            }));
        }
        if kind != KIND_REPLY {
            return Err(Attempt::Fatal(BootstrapError::Protocol(format!(
                "{} sent message kind {kind} where a reply was expected",
                self.addr
            ))));
        }
        let fatal = |error| Err(Attempt::Fatal(error));
        match status {
            Some(Status::Ok) => {}
            Some(Status::Busy) => return Err(Attempt::Retry("rank 0 was busy".to_owned())),
            Some(Status::TimedOut) => {
                return Err(Attempt::Retry("rank 0 timed the connection out".to_owned()))
            }
            Some(Status::BadMagic) | Some(Status::Malformed) => {
                return fatal(BootstrapError::Protocol(format!(
                    "rank 0 at {} rejected the request as malformed (status {status_code})",
                    self.addr
                )))
            }
            Some(Status::UnsupportedVersion) => {
                return fatal(BootstrapError::VersionMismatch {
                    local: VERSION,
                    peer: u16::try_from(detail).unwrap_or(u16::MAX),
                })
            }
            Some(Status::WrongJob) => {
                return fatal(BootstrapError::WrongJob {
                    detail: format!(
                        "rank 0 at {} serves a job key other than {:?}",
                        self.addr, self.job_key
                    ),
                })
            }
            Some(Status::WorldSizeMismatch) => {
                return fatal(BootstrapError::WorldSizeMismatch {
                    expected: detail as usize,
                    got: self.world_size,
                })
            }
            Some(Status::RankOutOfRange) => {
                return fatal(BootstrapError::RankOutOfRange {
                    rank: self.rank,
                    world_size: detail as usize,
                })
            }
            // Another connection is between fetching and acking this rank: most likely this
            // process's own earlier attempt, whose failure rank 0 has not noticed yet.
            Some(Status::DuplicateRank) if detail == DUPLICATE_IN_FLIGHT => {
                return Err(Attempt::Retry(format!(
                    "rank {} is being fetched by another connection",
                    self.rank
                )))
            }
            Some(Status::DuplicateRank) => return fatal(BootstrapError::DuplicateRank(self.rank)),
            Some(Status::Early) => {
                return Err(Attempt::Retry(format!(
                    "rank 0 still serves exchange {detail} under this job key, this rank is on \
                     exchange {}",
                    u32_at(request, 24)
                )))
            }
            Some(Status::Late) => {
                return fatal(BootstrapError::Protocol(format!(
                    "this rank is on exchange {} under this job key, but rank 0 is already on \
                     exchange {detail}: a previous exchange of this rank failed or was skipped",
                    u32_at(request, 24)
                )))
            }
            None => {
                return fatal(BootstrapError::Protocol(format!(
                    "rank 0 at {} replied with unknown status {status_code}",
                    self.addr
                )))
            }
        }

        let mut id_bytes = [0u8; UNIQUE_ID_BYTES];
        match read_full(&stream, &mut id_bytes, reply_deadline) {
            Ok(()) => {}
            Err(ReadShort::Eof { got }) | Err(ReadShort::TimedOut { got }) => {
                return fatal(BootstrapError::Protocol(format!(
                    "truncated unique id from {}: {got} of {UNIQUE_ID_BYTES} bytes",
                    self.addr
                )))
            }
            Err(ReadShort::Io(e)) => return Err(Attempt::Retry(format!("reading the id: {e}"))),
        }
        let id = UniqueId::from_bytes(id_bytes);

        let mut ack = [0u8; ACK_LEN];
        ack[0..4].copy_from_slice(&MAGIC);
        ack[4..6].copy_from_slice(&VERSION.to_be_bytes());
        ack[6..8].copy_from_slice(&KIND_ACK.to_be_bytes());
        ack[8..12].copy_from_slice(&request[20..24]);
        ack[16..24].copy_from_slice(&id.fingerprint().to_be_bytes());
        // Without the ack rank 0 does not count this rank and frees the slot, so trying again
        // is both safe and necessary.
        write_full(&stream, &ack, deadline)
            .map_err(|e| Attempt::Retry(format!("sending the acknowledgement: {e}")))?;
        Ok(id)
    }

    fn connect(&self, deadline: Instant) -> Result<TcpStream, Attempt> {
        let addrs: Vec<SocketAddr> = match self.addr.to_socket_addrs() {
            Ok(addrs) => addrs.collect(),
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                return Err(Attempt::Fatal(BootstrapError::Config(format!(
                    "invalid rendezvous address {:?}: {e}",
                    self.addr
                ))))
            }
            // Name resolution can fail while a cluster's DNS catches up: keep trying.
            Err(e) => return Err(Attempt::Retry(format!("resolving {}: {e}", self.addr))),
        };
        let mut failure = format!("{} resolves to no address", self.addr);
        for addr in addrs {
            let Some(left) = time_left(deadline) else {
                break;
            };
            match TcpStream::connect_timeout(&addr, left.min(MAX_CONNECT_WAIT)) {
                Ok(stream) => return Ok(stream),
                Err(e) => failure = format!("connecting to {addr}: {e}"),
            }
        }
        Err(Attempt::Retry(failure))
    }
}

/// The outcome of one connection attempt of a joining rank.
enum Attempt {
    /// Worth another try before the deadline (refused, reset, busy, timed out).
    Retry(String),
    /// Rank 0 gave a definite answer, or the reply was not of this protocol.
    Fatal(BootstrapError),
}

impl From<BootstrapError> for Attempt {
    fn from(error: BootstrapError) -> Self {
        Attempt::Fatal(error)
    }
}

/// Binds rank 0's listener for `addr`: on the address itself when it is a loopback literal or
/// `localhost`, else on every interface at its port. A name other nodes use for rank 0 may
/// resolve to a different address on rank 0 itself (e.g. `127.0.1.1` from `/etc/hosts`), so
/// binding the resolved address would refuse exactly the ranks that need it.
fn bind_listener(addr: &str) -> Result<TcpListener> {
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| {
        BootstrapError::Config(format!("rendezvous address {addr:?} has no port"))
    })?;
    let port: u16 = port.parse().map_err(|_| {
        BootstrapError::Config(format!("rendezvous address {addr:?} has an invalid port"))
    })?;
    let bare_host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = bare_host.eq_ignore_ascii_case("localhost")
        || bare_host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    let resolved: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| io_error(format!("resolving rendezvous address {addr}"), e))?
        .collect();
    let candidates: Vec<SocketAddr> = if loopback {
        resolved
    } else {
        let unspecified = match resolved.first() {
            Some(SocketAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        };
        vec![SocketAddr::new(unspecified, port)]
    };
    // std sets SO_REUSEADDR on Unix, so a port left in TIME_WAIT by a previous job is reusable.
    TcpListener::bind(&candidates[..]).map_err(|e| {
        let hint = if e.kind() == io::ErrorKind::AddrInUse {
            "; another program holds the port: pick a free one with NCCL_RS_ADDR"
        } else {
            ""
        };
        io_error(
            format!("rank 0 cannot listen on {addr} ({candidates:?}){hint}"),
            e,
        )
    })
}

/// Rank 0's bound listener, ready to [`serve`](TcpServer::serve).
#[derive(Debug)]
pub struct TcpServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    world_size: usize,
    job_hash: u64,
    timeout: Duration,
    connection_timeout: Duration,
    interrupt: Option<Interrupt>,
}

/// A peer rank 0 turned away while serving.
#[derive(Debug)]
#[non_exhaustive]
pub struct RejectedPeer {
    /// The peer's address.
    pub peer: SocketAddr,
    /// The rank it claimed, when it got that far.
    pub rank: Option<usize>,
    /// Why it was turned away (the same error its side sees, from rank 0's point of view).
    pub error: BootstrapError,
}

impl fmt::Display for RejectedPeer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rank {
            Some(rank) => write!(f, "{} (rank {rank}): {}", self.peer, self.error),
            None => write!(f, "{}: {}", self.peer, self.error),
        }
    }
}

/// What happened during a successful [`TcpServer::serve`].
#[derive(Debug)]
#[non_exhaustive]
pub struct ServeReport {
    /// How long serving took.
    pub elapsed: Duration,
    /// Peers that were turned away (garbage, wrong job, duplicates...), in order.
    pub rejected: Vec<RejectedPeer>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Waiting,
    /// A connection holds this rank and is between reply and ack.
    Claimed,
    Done,
}

struct ServeState {
    slots: Vec<Slot>,
    done: usize,
    rejected: Vec<RejectedPeer>,
    /// Clones of the open connections, shut down when serving ends so their threads return.
    open: Vec<(u64, TcpStream)>,
    active: usize,
    finished: bool,
}

struct Shared {
    state: Mutex<ServeState>,
    /// Which exchange under this job key this is, counted per process from 0.
    round: u32,
    id: UniqueId,
    world_size: usize,
    job_hash: u64,
    serve_deadline: Instant,
    connection_timeout: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ServeState> {
        // Handlers never panic while holding the lock; should one, the counters are still
        // consistent enough to finish serving.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A handshake that went wrong: the error to record and the status to send back, if any.
struct Refusal {
    error: BootstrapError,
    reply: Option<(Status, u32)>,
    rank: Option<usize>,
    /// Whether to list the peer in the report (not for the normal "come back later").
    record: bool,
}

impl Refusal {
    fn new(error: BootstrapError, status: Status, detail: u32) -> Self {
        Refusal {
            error,
            reply: Some((status, detail)),
            rank: None,
            record: true,
        }
    }

    fn silent(error: BootstrapError) -> Self {
        Refusal {
            error,
            reply: None,
            rank: None,
            record: true,
        }
    }

    fn for_rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }
}

impl TcpServer {
    /// The address the listener is bound to (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves `id` until every rank `1..world_size` has fetched and acknowledged it, or the
    /// timeout passes ([`BootstrapError::Timeout`] listing the missing ranks).
    ///
    /// Each connection is handled on its own thread under its own deadline; peers that
    /// misbehave are answered with an error status, closed, and listed in the report.
    pub fn serve(self, id: UniqueId) -> Result<ServeReport> {
        let started = Instant::now();
        let others = self.world_size.saturating_sub(1);
        if others == 0 {
            return Ok(ServeReport {
                elapsed: started.elapsed(),
                rejected: Vec::new(),
            });
        }
        self.listener
            .set_nonblocking(true)
            .map_err(|e| io_error("making the rendezvous listener non-blocking", e))?;
        let mut slots = vec![Slot::Waiting; self.world_size];
        slots[0] = Slot::Done;
        let shared = Arc::new(Shared {
            state: Mutex::new(ServeState {
                slots,
                done: 0,
                rejected: Vec::new(),
                open: Vec::new(),
                active: 0,
                finished: false,
            }),
            id,
            round: rounds::start_serving(self.job_hash),
            world_size: self.world_size,
            job_hash: self.job_hash,
            serve_deadline: deadline_after(started, self.timeout),
            connection_timeout: self.connection_timeout,
        });
        // Enough handlers for every rank to connect at once, bounded against connection floods.
        let max_active = self.world_size.saturating_mul(2).clamp(16, 512);
        let mut next_connection = 0u64;
        let mut idle_pause = Duration::from_millis(1);

        let outcome = loop {
            if shared.lock().done == others {
                break Ok(());
            }
            if let Some(error) = self.interrupt.as_ref().and_then(Interrupt::reason) {
                break Err(Some(error));
            }
            if time_left(shared.serve_deadline).is_none() {
                break Err(None);
            }
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    idle_pause = Duration::from_millis(1);
                    next_connection += 1;
                    self.admit(&shared, stream, peer, next_connection, max_active);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    thread::sleep(idle_pause);
                    idle_pause = (idle_pause * 2).min(Duration::from_millis(16));
                }
                // Aborted handshakes, interrupted calls, or running out of descriptors for a
                // moment: none of them is a reason to abandon the ranks still to come.
                Err(_) => thread::sleep(Duration::from_millis(5)),
            }
        };

        let mut state = shared.lock();
        state.finished = true;
        for (_, stream) in state.open.drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        let rejected = std::mem::take(&mut state.rejected);
        match outcome {
            Ok(()) => Ok(ServeReport {
                elapsed: started.elapsed(),
                rejected,
            }),
            Err(Some(interrupted)) => Err(interrupted),
            Err(None) => {
                let missing: Vec<usize> = state
                    .slots
                    .iter()
                    .enumerate()
                    .filter(|(_, slot)| **slot != Slot::Done)
                    .map(|(rank, _)| rank)
                    .collect();
                let mut stage = format!(
                    "waiting for {} of {} ranks to fetch the unique id from rank 0 on {}: missing \
                     {}",
                    missing.len(),
                    self.world_size,
                    self.local_addr,
                    list_ranks(&missing)
                );
                if !rejected.is_empty() {
                    stage.push_str("; turned away: ");
                    let shown: Vec<String> =
                        rejected.iter().take(8).map(|r| r.to_string()).collect();
                    stage.push_str(&shown.join("; "));
                    if rejected.len() > shown.len() {
                        stage.push_str(&format!("; and {} more", rejected.len() - shown.len()));
                    }
                }
                Err(BootstrapError::Timeout {
                    stage,
                    after: started.elapsed(),
                    missing_ranks: missing,
                })
            }
        }
    }

    /// Hands an accepted connection to a handler thread, or turns it away when too many are
    /// in flight.
    fn admit(
        &self,
        shared: &Arc<Shared>,
        stream: TcpStream,
        peer: SocketAddr,
        connection: u64,
        max_active: usize,
    ) {
        // Accepted sockets must block (with timeouts); do not rely on inheritance rules.
        if stream.set_nonblocking(false).is_err() {
            return;
        }
        let registered = {
            let mut state = shared.lock();
            if state.active >= max_active {
                None
            } else {
                let clone = stream.try_clone().ok();
                state.active += 1;
                if let Some(clone) = clone {
                    state.open.push((connection, clone));
                }
                Some(())
            }
        };
        if registered.is_none() {
            // Answer without lingering: this runs on the accept loop, which must keep going.
            // If the reply is lost, the peer sees a reset and retries all the same.
            if stream.set_nonblocking(true).is_ok() {
                let _ = (&stream).write(&reply_header(Status::Busy, 0));
            }
            return;
        }
        let worker = Arc::clone(shared);
        let spawned = thread::Builder::new()
            .name(format!("nccl-rs-rendezvous-{connection}"))
            .spawn(move || handle_connection(&worker, stream, peer, connection));
        if spawned.is_err() {
            // The stream went down with the closure; undo the bookkeeping.
            let mut state = shared.lock();
            state.active -= 1;
            state.open.retain(|(id, _)| *id != connection);
        }
    }
}

/// Formats a rank list, eliding the middle of very long ones.
fn list_ranks(ranks: &[usize]) -> String {
    const SHOWN: usize = 32;
    if ranks.len() <= SHOWN {
        return format!("{ranks:?}");
    }
    let head: Vec<String> = ranks[..SHOWN].iter().map(|r| r.to_string()).collect();
    format!("[{}, ... ({} more)]", head.join(", "), ranks.len() - SHOWN)
}

fn handle_connection(shared: &Shared, stream: TcpStream, peer: SocketAddr, connection: u64) {
    let deadline = shared
        .serve_deadline
        .min(deadline_after(Instant::now(), shared.connection_timeout));
    let _ = stream.set_nodelay(true);
    let outcome = converse(shared, &stream, deadline);
    // Record the outcome before answering a refused peer: the answer may take a grace period,
    // and serving may end meanwhile.
    let reply = {
        let mut state = shared.lock();
        match outcome {
            Ok(rank) => {
                state.slots[rank] = Slot::Done;
                state.done += 1;
                None
            }
            Err(refusal) => {
                if refusal.record && !state.finished {
                    state.rejected.push(RejectedPeer {
                        peer,
                        rank: refusal.rank,
                        error: refusal.error,
                    });
                }
                refusal.reply
            }
        }
    };
    if let Some((status, detail)) = reply {
        send_refusal(&stream, status, detail);
    }
    let mut state = shared.lock();
    state.active -= 1;
    state.open.retain(|(id, _)| *id != connection);
}

/// The server side of one connection: returns the rank that received and acknowledged the id.
/// A rank claimed here is released again if anything fails after the claim.
fn converse(shared: &Shared, stream: &TcpStream, deadline: Instant) -> Result<usize, Refusal> {
    let mut request = [0u8; REQUEST_LEN];
    // Read the magic and version first, so that garbage or another version is answered at
    // once instead of after waiting for bytes that will never come.
    read_part(
        stream,
        &mut request[0..4],
        0,
        deadline,
        shared.connection_timeout,
    )?;
    if request[0..4] != MAGIC {
        return Err(Refusal::new(
            BootstrapError::Protocol(format!(
                "request starts with {:02x?}, not the rendezvous magic",
                &request[0..4]
            )),
            Status::BadMagic,
            0,
        ));
    }
    read_part(
        stream,
        &mut request[4..6],
        4,
        deadline,
        shared.connection_timeout,
    )?;
    let version = u16_at(&request, 4);
    if version != VERSION {
        return Err(Refusal::new(
            BootstrapError::VersionMismatch {
                local: VERSION,
                peer: version,
            },
            Status::UnsupportedVersion,
            u32::from(VERSION),
        ));
    }
    read_part(
        stream,
        &mut request[6..],
        6,
        deadline,
        shared.connection_timeout,
    )?;
    let kind = u16_at(&request, 6);
    if kind != KIND_REQUEST {
        return Err(Refusal::new(
            BootstrapError::Protocol(format!("expected a request, got message kind {kind}")),
            Status::Malformed,
            0,
        ));
    }
    let job_hash = u64_at(&request, 8);
    let world_size = u32_at(&request, 16) as usize;
    let rank = u32_at(&request, 20) as usize;
    let round = u32_at(&request, 24);
    let world_detail = u32::try_from(shared.world_size).unwrap_or(u32::MAX);
    if job_hash != shared.job_hash {
        return Err(Refusal::new(
            BootstrapError::WrongJob {
                detail: format!(
                    "the peer's job key hash {job_hash:016x} differs from rank 0's {:016x}",
                    shared.job_hash
                ),
            },
            Status::WrongJob,
            0,
        )
        .for_rank(rank));
    }
    if world_size != shared.world_size {
        return Err(Refusal::new(
            BootstrapError::WorldSizeMismatch {
                expected: shared.world_size,
                got: world_size,
            },
            Status::WorldSizeMismatch,
            world_detail,
        )
        .for_rank(rank));
    }
    if round > shared.round {
        // This rank already finished this exchange and runs the next one under the same key;
        // rank 0 will serve it once this one is over.
        let mut early = Refusal::new(
            BootstrapError::Protocol(format!(
                "the peer is on exchange {round}, rank 0 on exchange {}",
                shared.round
            )),
            Status::Early,
            shared.round,
        )
        .for_rank(rank);
        early.record = false;
        return Err(early);
    }
    if round < shared.round {
        return Err(Refusal::new(
            BootstrapError::Protocol(format!(
                "the peer is on exchange {round} under this job key, rank 0 already on exchange \
                 {}",
                shared.round
            )),
            Status::Late,
            shared.round,
        )
        .for_rank(rank));
    }
    if rank >= shared.world_size {
        return Err(Refusal::new(
            BootstrapError::RankOutOfRange {
                rank,
                world_size: shared.world_size,
            },
            Status::RankOutOfRange,
            world_detail,
        )
        .for_rank(rank));
    }
    {
        let mut state = shared.lock();
        let taken = match state.slots[rank] {
            Slot::Waiting => None,
            Slot::Claimed => Some(DUPLICATE_IN_FLIGHT),
            // Includes rank 0, which is this process.
            Slot::Done => Some(DUPLICATE_DONE),
        };
        if let Some(detail) = taken {
            return Err(Refusal::new(
                BootstrapError::DuplicateRank(rank),
                Status::DuplicateRank,
                detail,
            )
            .for_rank(rank));
        }
        state.slots[rank] = Slot::Claimed;
    }
    let result = deliver(shared, stream, deadline, rank);
    if result.is_err() {
        let mut state = shared.lock();
        if state.slots[rank] == Slot::Claimed {
            state.slots[rank] = Slot::Waiting;
        }
    }
    result
        .map(|()| rank)
        .map_err(|refusal| refusal.for_rank(rank))
}

/// Sends the id to the rank that claimed `rank` and waits for its ack.
fn deliver(
    shared: &Shared,
    stream: &TcpStream,
    deadline: Instant,
    rank: usize,
) -> Result<(), Refusal> {
    let mut reply = [0u8; REPLY_HEADER_LEN + UNIQUE_ID_BYTES];
    reply[..REPLY_HEADER_LEN].copy_from_slice(&reply_header(Status::Ok, 0));
    reply[REPLY_HEADER_LEN..].copy_from_slice(shared.id.as_bytes());
    write_full(stream, &reply, deadline)
        .map_err(|e| Refusal::silent(io_error("sending the unique id", e)))?;
    let mut ack = [0u8; ACK_LEN];
    match read_full(stream, &mut ack, deadline) {
        Ok(()) => {}
        Err(ReadShort::Eof { got }) => {
            return Err(Refusal::silent(BootstrapError::Protocol(format!(
                "the rank closed the connection after {got} of {ACK_LEN} acknowledgement bytes"
            ))))
        }
        Err(ReadShort::TimedOut { got }) => {
            return Err(Refusal::silent(BootstrapError::Timeout {
                stage: format!("waiting for the acknowledgement ({got} of {ACK_LEN} bytes)"),
                after: shared.connection_timeout,
                missing_ranks: vec![rank],
            }))
        }
        Err(ReadShort::Io(e)) => {
            return Err(Refusal::silent(io_error("reading the acknowledgement", e)))
        }
    }
    let valid = ack[0..4] == MAGIC
        && u16_at(&ack, 4) == VERSION
        && u16_at(&ack, 6) == KIND_ACK
        && u32_at(&ack, 8) as usize == rank
        && u64_at(&ack, 16) == shared.id.fingerprint();
    if !valid {
        return Err(Refusal::silent(BootstrapError::Protocol(
            "invalid acknowledgement (wrong magic, kind, rank or id fingerprint)".to_owned(),
        )));
    }
    Ok(())
}

/// Reads one part of the request, turning a short read into a refusal. `offset` is where the
/// part starts in the request, for the error message.
fn read_part(
    stream: &TcpStream,
    part: &mut [u8],
    offset: usize,
    deadline: Instant,
    connection_timeout: Duration,
) -> Result<(), Refusal> {
    match read_full(stream, part, deadline) {
        Ok(()) => Ok(()),
        Err(ReadShort::Eof { got }) => Err(Refusal::new(
            BootstrapError::Protocol(format!(
                "truncated request: the peer closed the connection after {} of {REQUEST_LEN} \
                 bytes",
                offset + got
            )),
            Status::Malformed,
            0,
        )),
        Err(ReadShort::TimedOut { got }) => Err(Refusal::new(
            BootstrapError::Timeout {
                stage: format!(
                    "waiting for the peer's request ({} of {REQUEST_LEN} bytes arrived)",
                    offset + got
                ),
                after: connection_timeout,
                missing_ranks: Vec::new(),
            },
            Status::TimedOut,
            0,
        )),
        Err(ReadShort::Io(e)) => Err(Refusal::silent(io_error("reading the request", e))),
    }
}

/// Best effort: tells the peer why it is turned away, then lets it read that before the
/// socket closes. Closing with unread input would reset the connection and could discard the
/// reply, so the input is drained briefly after shutting down our side.
fn send_refusal(stream: &TcpStream, status: Status, detail: u32) {
    let grace = Instant::now() + ERROR_REPLY_GRACE;
    if write_full(stream, &reply_header(status, detail), grace).is_err() {
        return;
    }
    let _ = stream.shutdown(Shutdown::Write);
    let mut sink = [0u8; 512];
    let mut drained = 0usize;
    while drained < 64 * 1024 {
        let Some(left) = time_left(grace) else {
            break;
        };
        if stream.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match (&*stream).read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_id(seed: u8) -> UniqueId {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        UniqueId::from_bytes(bytes)
    }

    /// Each test uses its own job key: exchange rounds are counted per key and process, and
    /// the tests share a process.
    fn server(world_size: usize, timeout: Duration, key: &str) -> TcpServer {
        TcpRendezvous::new("127.0.0.1:0", 0, world_size)
            .with_job_key(key)
            .with_timeout(timeout)
            .with_connection_timeout(Duration::from_millis(500))
            .bind()
            .expect("bind")
    }

    /// Sends raw bytes and returns the status code of the reply (None if no full header).
    fn raw_exchange(addr: SocketAddr, bytes: &[u8], close_write: bool) -> Option<u16> {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream.write_all(bytes).expect("write");
        if close_write {
            stream.shutdown(Shutdown::Write).expect("shutdown");
        }
        let mut header = [0u8; REPLY_HEADER_LEN];
        stream
            .set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        let mut got = 0;
        while got < header.len() {
            match stream.read(&mut header[got..]) {
                Ok(0) | Err(_) => return None,
                Ok(n) => got += n,
            }
        }
        assert_eq!(header[0..4], MAGIC);
        Some(u16_at(&header, 8))
    }

    fn request(job: &str, world: u32, rank: u32, version: u16) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&MAGIC);
        bytes.extend_from_slice(&version.to_be_bytes());
        bytes.extend_from_slice(&KIND_REQUEST.to_be_bytes());
        bytes.extend_from_slice(&job_key_hash(job).to_be_bytes());
        bytes.extend_from_slice(&world.to_be_bytes());
        bytes.extend_from_slice(&rank.to_be_bytes());
        bytes.extend_from_slice(&[0u8; 8]);
        bytes
    }

    fn request_in_round(job: &str, world: u32, rank: u32, round: u32) -> Vec<u8> {
        let mut bytes = request(job, world, rank, VERSION);
        bytes[24..28].copy_from_slice(&round.to_be_bytes());
        bytes
    }

    #[test]
    fn requests_from_other_rounds_are_told_apart() {
        let key = "rounds";
        let first = server(2, Duration::from_secs(10), key);
        let addr = first.local_addr();
        let serving = thread::spawn(move || first.serve(sample_id(1)));
        let client = TcpRendezvous::new(addr.to_string(), 1, 2)
            .with_job_key(key)
            .with_timeout(Duration::from_secs(5));
        assert_eq!(client.fetch().expect("round 0"), sample_id(1));
        serving.join().expect("join").expect("serve");

        let second = server(2, Duration::from_secs(10), key);
        let addr = second.local_addr();
        let serving = thread::spawn(move || second.serve(sample_id(2)));
        assert_eq!(
            raw_exchange(addr, &request_in_round(key, 2, 1, 0), false),
            Some(Status::Late as u16)
        );
        assert_eq!(
            raw_exchange(addr, &request_in_round(key, 2, 1, 5), false),
            Some(Status::Early as u16)
        );
        let client = TcpRendezvous::new(addr.to_string(), 1, 2)
            .with_job_key(key)
            .with_timeout(Duration::from_secs(5));
        assert_eq!(client.fetch().expect("round 1"), sample_id(2));
        let report = serving.join().expect("join").expect("serve");
        // "Come back later" is normal and not listed; a rank from a past round is.
        assert_eq!(report.rejected.len(), 1, "{:?}", report.rejected);
    }

    #[test]
    fn raw_bad_requests_get_their_status_and_server_still_serves() {
        let server = server(2, Duration::from_secs(10), "raw");
        let addr = server.local_addr();
        let id = sample_id(3);
        let serving = thread::spawn(move || server.serve(id));

        assert_eq!(
            raw_exchange(addr, b"GET / HTTP/1.1\r\n\r\n", false),
            Some(Status::BadMagic as u16)
        );
        assert_eq!(
            raw_exchange(addr, &request("raw", 2, 1, 99), false),
            Some(Status::UnsupportedVersion as u16)
        );
        assert_eq!(
            raw_exchange(addr, &request("raw", 2, 1, VERSION)[..10], true),
            Some(Status::Malformed as u16)
        );
        assert_eq!(
            raw_exchange(addr, &request("other", 2, 1, VERSION), false),
            Some(Status::WrongJob as u16)
        );
        assert_eq!(
            raw_exchange(addr, &request("raw", 3, 1, VERSION), false),
            Some(Status::WorldSizeMismatch as u16)
        );
        assert_eq!(
            raw_exchange(addr, &request("raw", 2, 7, VERSION), false),
            Some(Status::RankOutOfRange as u16)
        );
        assert_eq!(
            raw_exchange(addr, &request("raw", 2, 0, VERSION), false),
            Some(Status::DuplicateRank as u16)
        );
        let mut kind = request("raw", 2, 1, VERSION);
        kind[7] = KIND_ACK as u8;
        assert_eq!(
            raw_exchange(addr, &kind, false),
            Some(Status::Malformed as u16)
        );

        let client = TcpRendezvous::new(addr.to_string(), 1, 2)
            .with_job_key("raw")
            .with_timeout(Duration::from_secs(5));
        assert_eq!(client.fetch().expect("fetch"), id);
        let report = serving.join().expect("join").expect("serve");
        // Handlers finish in any order: count each kind of refusal.
        let count = |pred: fn(&BootstrapError) -> bool| {
            report.rejected.iter().filter(|r| pred(&r.error)).count()
        };
        assert_eq!(report.rejected.len(), 8, "{:?}", report.rejected);
        assert_eq!(count(|e| matches!(e, BootstrapError::Protocol(_))), 3);
        assert_eq!(
            count(|e| matches!(e, BootstrapError::VersionMismatch { local: 1, peer: 99 })),
            1
        );
        assert_eq!(count(|e| matches!(e, BootstrapError::WrongJob { .. })), 1);
        assert_eq!(
            count(|e| matches!(
                e,
                BootstrapError::WorldSizeMismatch {
                    expected: 2,
                    got: 3
                }
            )),
            1
        );
        assert_eq!(
            count(|e| matches!(
                e,
                BootstrapError::RankOutOfRange {
                    rank: 7,
                    world_size: 2
                }
            )),
            1
        );
        assert_eq!(count(|e| matches!(e, BootstrapError::DuplicateRank(0))), 1);
    }

    #[test]
    fn bad_ack_releases_the_rank_for_a_retry() {
        let server = server(2, Duration::from_secs(10), "bad-ack");
        let addr = server.local_addr();
        let id = sample_id(9);
        let serving = thread::spawn(move || server.serve(id));

        // Take the id but acknowledge with a wrong fingerprint.
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream
            .write_all(&request("bad-ack", 2, 1, VERSION))
            .expect("write");
        let mut reply = [0u8; REPLY_HEADER_LEN + UNIQUE_ID_BYTES];
        stream
            .set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        stream.read_exact(&mut reply).expect("reply");
        assert_eq!(u16_at(&reply, 8), Status::Ok as u16);
        let mut ack = [0u8; ACK_LEN];
        ack[0..4].copy_from_slice(&MAGIC);
        ack[4..6].copy_from_slice(&VERSION.to_be_bytes());
        ack[6..8].copy_from_slice(&KIND_ACK.to_be_bytes());
        ack[8..12].copy_from_slice(&1u32.to_be_bytes());
        stream.write_all(&ack).expect("ack");
        // Rank 0 closes once it has judged the ack and released the rank.
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        drop(stream);

        let client = TcpRendezvous::new(addr.to_string(), 1, 2)
            .with_job_key("bad-ack")
            .with_timeout(Duration::from_secs(5));
        assert_eq!(client.fetch().expect("fetch"), id);
        let report = serving.join().expect("join").expect("serve");
        assert_eq!(report.rejected.len(), 1);
        assert_eq!(report.rejected[0].rank, Some(1));
    }

    #[test]
    fn client_reports_non_protocol_peer() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let fake = thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            let mut request = [0u8; REQUEST_LEN];
            let _ = stream.read_exact(&mut request);
            let _ = stream.write_all(b"SSH-2.0-OpenSSH_9.6\r\n");
        });
        let client =
            TcpRendezvous::new(addr.to_string(), 1, 2).with_timeout(Duration::from_secs(3));
        let err = client.fetch().unwrap_err();
        assert!(matches!(err, BootstrapError::Protocol(_)), "{err}");
        fake.join().expect("join");
    }

    #[test]
    fn connection_flood_gets_busy_and_a_good_rank_still_gets_through() {
        let server = TcpRendezvous::new("127.0.0.1:0", 0, 2)
            .with_job_key("flood")
            .with_timeout(Duration::from_secs(10))
            .with_connection_timeout(Duration::from_millis(300))
            .bind()
            .expect("bind");
        let addr = server.local_addr();
        let id = sample_id(17);
        let serving = thread::spawn(move || server.serve(id));
        // 16 silent peers fill every handler slot a world of 2 gets.
        let silent: Vec<TcpStream> = (0..16)
            .map(|_| TcpStream::connect(addr).expect("connect"))
            .collect();
        thread::sleep(Duration::from_millis(100));
        let mut extra = TcpStream::connect(addr).expect("connect");
        extra
            .set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        let mut header = [0u8; REPLY_HEADER_LEN];
        extra.read_exact(&mut header).expect("busy reply");
        assert_eq!(u16_at(&header, 8), Status::Busy as u16);
        // A real rank retries through the busy period and gets the id once the silent peers
        // have timed out.
        let client = TcpRendezvous::new(addr.to_string(), 1, 2)
            .with_job_key("flood")
            .with_timeout(Duration::from_secs(5));
        assert_eq!(client.fetch().expect("fetch"), id);
        let report = serving.join().expect("join").expect("serve");
        let timeouts = report
            .rejected
            .iter()
            .filter(|r| matches!(r.error, BootstrapError::Timeout { .. }))
            .count();
        assert_eq!(timeouts, 16, "{:?}", report.rejected);
        drop(silent);
    }

    #[test]
    fn long_rank_lists_are_elided() {
        let ranks: Vec<usize> = (0..40).collect();
        let text = list_ranks(&ranks);
        assert!(text.ends_with("... (8 more)]"), "{text}");
        assert_eq!(list_ranks(&[1, 2]), "[1, 2]");
    }
}
