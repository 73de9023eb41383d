//! A joining rank: connects to rank 0, asks for the id and acknowledges it, retrying while
//! rank 0 is not listening yet or is busy.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use super::socket::{read_full, write_full, Short};
use super::wire::{
    wire_u32, Ack, ReplyHeader, Request, Status, DUPLICATE_IN_FLIGHT, KIND_REPLY, MAGIC,
    REPLY_HEADER_LEN, VERSION,
};
use super::TcpRendezvous;
use crate::bootstrap::bytes::job_key_hash;
use crate::bootstrap::util::{deadline_after, time_left};
use crate::bootstrap::{BootstrapError, Result};
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

/// First pause between connection attempts; doubles up to [`MAX_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(5);
/// Longest pause between connection attempts of a joining rank.
const MAX_RETRY_PAUSE: Duration = Duration::from_millis(250);
/// Longest a single connect() may take before the next address or attempt is tried.
const MAX_CONNECT_WAIT: Duration = Duration::from_secs(2);

/// Fetches the id from rank 0, retrying until the rendezvous's timeout.
pub(super) fn fetch(rendezvous: &TcpRendezvous) -> Result<UniqueId> {
    let job_hash = job_key_hash(rendezvous.job_key());
    let rank = rendezvous.rank();
    let round = rendezvous.history.round(job_hash, rank);
    let client = Client {
        rendezvous,
        request: Request {
            job_hash,
            world_size: wire_u32(rendezvous.world_size(), "world size")?,
            rank: wire_u32(rank, "rank")?,
            round,
        },
    };
    let started = Instant::now();
    let deadline = deadline_after(started, rendezvous.timeout());
    let mut pause = FIRST_RETRY_PAUSE;
    loop {
        let last_failure = match client.attempt(deadline) {
            Ok(id) => {
                rendezvous.history.finish_round(job_hash, rank, round);
                return Ok(id);
            }
            Err(Attempt::Fatal(error)) => return Err(error),
            Err(Attempt::Retry(why)) => why,
        };
        let Some(left) = time_left(deadline) else {
            return Err(BootstrapError::Timeout {
                stage: format!(
                    "waiting for rank 0 at {} to hand out the unique id (last attempt: \
                     {last_failure})",
                    client.addr()
                ),
                after: started.elapsed(),
                missing_ranks: Vec::new(),
            });
        };
        thread::sleep(pause.min(left));
        pause = (pause * 2).min(MAX_RETRY_PAUSE);
    }
}

/// The outcome of one connection attempt of a joining rank.
enum Attempt {
    /// Worth another try before the deadline (refused, reset, busy, timed out).
    Retry(String),
    /// Rank 0 gave a definite answer, or the reply was not of this protocol.
    Fatal(BootstrapError),
}

/// One joining rank and the request it sends.
struct Client<'a> {
    rendezvous: &'a TcpRendezvous,
    request: Request,
}

impl Client<'_> {
    fn addr(&self) -> &str {
        self.rendezvous.addr()
    }

    /// One connection: request, reply, id, ack.
    fn attempt(&self, deadline: Instant) -> Result<UniqueId, Attempt> {
        let stream = self.connect(deadline)?;
        // Small messages in both directions: send them at once.
        let _ = stream.set_nodelay(true);
        write_full(&stream, &self.request.encode(), deadline)
            .map_err(|e| Attempt::Retry(format!("sending the request: {e}")))?;
        // Rank 0 answers right after reading the request; a peer that stays silent longer
        // than a connection timeout is busy or not a rendezvous, and is tried again.
        let connection_timeout = self.rendezvous.transport.connection_timeout;
        let reply_deadline = deadline.min(deadline_after(Instant::now(), connection_timeout));
        let header = self.read_header(&stream, reply_deadline)?;
        self.judge(header)?;
        let id = self.read_id(&stream, reply_deadline)?;
        let ack = Ack {
            rank: self.request.rank,
            fingerprint: id.fingerprint(),
        };
        // Without the ack rank 0 does not count this rank and frees the slot, so trying again
        // is both safe and necessary.
        write_full(&stream, &ack.encode(), deadline)
            .map_err(|e| Attempt::Retry(format!("sending the acknowledgement: {e}")))?;
        Ok(id)
    }

    fn connect(&self, deadline: Instant) -> Result<TcpStream, Attempt> {
        let addrs: Vec<SocketAddr> = match self.addr().to_socket_addrs() {
            Ok(addrs) => addrs.collect(),
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                return Err(Attempt::Fatal(BootstrapError::Config(format!(
                    "invalid rendezvous address {:?}: {e}",
                    self.addr()
                ))))
            }
            // Name resolution can fail while a cluster's DNS catches up: keep trying.
            Err(e) => return Err(Attempt::Retry(format!("resolving {}: {e}", self.addr()))),
        };
        let mut failure = format!("{} resolves to no address", self.addr());
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

    /// Reads the reply header and checks that it is a version 1 reply.
    fn read_header(&self, stream: &TcpStream, deadline: Instant) -> Result<ReplyHeader, Attempt> {
        let mut bytes = [0u8; REPLY_HEADER_LEN];
        match read_full(stream, &mut bytes, deadline) {
            Ok(()) => {}
            Err(Short::Eof { got: 0 }) => {
                return Err(Attempt::Retry(
                    "rank 0 closed the connection without replying".to_owned(),
                ))
            }
            Err(Short::Eof { got }) => {
                return Err(self.protocol(format!(
                    "truncated reply: {got} of {REPLY_HEADER_LEN} header bytes"
                )))
            }
            Err(Short::TimedOut { got }) => {
                return Err(Attempt::Retry(format!(
                    "no complete reply within {:?} ({got} of {REPLY_HEADER_LEN} header bytes)",
                    self.rendezvous.transport.connection_timeout
                )))
            }
            Err(Short::Io(e)) => return Err(Attempt::Retry(format!("reading the reply: {e}"))),
        }
        if bytes[0..4] != MAGIC {
            return Err(self.protocol(format!(
                "replied with {:02x?}, not an nccl-rs rendezvous reply",
                &bytes[0..4]
            )));
        }
        let header = ReplyHeader::decode(&bytes);
        if header.version != VERSION {
            // Every version keeps this header, so rank 0's own version is what it announced.
            return Err(Attempt::Fatal(BootstrapError::VersionMismatch {
                local: VERSION,
                peer: header.version,
            }));
        }
        if header.kind != KIND_REPLY {
            return Err(self.protocol(format!(
                "sent message kind {} where a reply was expected",
                header.kind
            )));
        }
        Ok(header)
    }

    /// Turns a reply's status into going on, trying again, or giving up.
    fn judge(&self, header: ReplyHeader) -> Result<(), Attempt> {
        let Some(status) = Status::from_code(header.status) else {
            return Err(self.protocol(format!("replied with unknown status {}", header.status)));
        };
        if status == Status::Ok {
            return Ok(());
        }
        match self.retry_reason(status, header.detail) {
            Some(why) => Err(Attempt::Retry(why)),
            None => Err(Attempt::Fatal(self.refusal(status, header.detail))),
        }
    }

    /// Why a refusal is worth another try, or `None` when it is final.
    fn retry_reason(&self, status: Status, detail: u32) -> Option<String> {
        let round = self.request.round;
        Some(match status {
            Status::Busy => "rank 0 was busy".to_owned(),
            Status::TimedOut => "rank 0 timed the connection out".to_owned(),
            // Another connection is between fetching and acking this rank: most likely this
            // process's own earlier attempt, whose failure rank 0 has not noticed yet.
            Status::DuplicateRank if detail == DUPLICATE_IN_FLIGHT => format!(
                "rank {} is being fetched by another connection",
                self.request.rank
            ),
            Status::Early => format!(
                "rank 0 still serves exchange {detail} under this job key, this rank is on \
                 exchange {round}"
            ),
            _ => return None,
        })
    }

    /// The error a final refusal stands for.
    fn refusal(&self, status: Status, detail: u32) -> BootstrapError {
        let (rank, addr) = (self.rendezvous.rank(), self.addr());
        match status {
            Status::UnsupportedVersion => BootstrapError::VersionMismatch {
                local: VERSION,
                peer: u16::try_from(detail).unwrap_or(u16::MAX),
            },
            Status::WrongJob => BootstrapError::WrongJob {
                detail: format!(
                    "rank 0 at {addr} serves a job key other than {:?}",
                    self.rendezvous.job_key()
                ),
            },
            Status::WorldSizeMismatch => BootstrapError::WorldSizeMismatch {
                expected: detail as usize,
                got: self.rendezvous.world_size(),
            },
            Status::RankOutOfRange => BootstrapError::RankOutOfRange {
                rank,
                world_size: detail as usize,
            },
            Status::DuplicateRank => BootstrapError::DuplicateRank(rank),
            Status::Late => BootstrapError::Protocol(format!(
                "this rank is on exchange {} under this job key, but rank 0 is already on \
                 exchange {detail}: a previous exchange of this rank failed or was skipped",
                self.request.round
            )),
            _ => BootstrapError::Protocol(format!(
                "rank 0 at {addr} rejected the request as malformed (status {})",
                status as u16
            )),
        }
    }

    fn read_id(&self, stream: &TcpStream, deadline: Instant) -> Result<UniqueId, Attempt> {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        match read_full(stream, &mut bytes, deadline) {
            Ok(()) => Ok(UniqueId::from_bytes(bytes)),
            Err(Short::Eof { got }) | Err(Short::TimedOut { got }) => Err(self.protocol(format!(
                "truncated unique id: {got} of {UNIQUE_ID_BYTES} bytes"
            ))),
            Err(Short::Io(e)) => Err(Attempt::Retry(format!("reading the id: {e}"))),
        }
    }

    /// A final protocol error about what rank 0's address sent.
    fn protocol(&self, what: String) -> Attempt {
        Attempt::Fatal(BootstrapError::Protocol(format!("{}: {what}", self.addr())))
    }
}
