//! A joining rank: connects to rank 0, asks for the id and acknowledges it, retrying while
//! rank 0 is not listening yet or is busy; in clear text (version 1) or, with a key, through
//! rank 0's challenge and the Noise handshake of version 3 (whose messages are in
//! [`keyed`](super::keyed)).

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use super::key::{job_digest, RendezvousKey};
use super::keyed::{self, KeyedRequest, CHALLENGE_LEN};
use super::socket::{read_full, write_full, Short};
use super::wire::{
    ids_announced, wire_u32, Ack, Place, ReplyHeader, Request, Status, DUPLICATE_IN_FLIGHT,
    EARLIER_KEYED_VERSION, KEYED_VERSION, KIND_CHALLENGE, KIND_REPLY, KIND_SEALED_REPLY, MAGIC,
    REPLY_HEADER_LEN, VERSION,
};
use super::TcpRendezvous;
use crate::bootstrap::bytes::job_key_hash;
use crate::bootstrap::ids::{self, IdCount, MAX_EXCHANGED_IDS};
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

/// Fetches the ids from rank 0 (as many as `wanted` allows), retrying until the rendezvous's
/// timeout.
pub(super) fn fetch(rendezvous: &TcpRendezvous, wanted: IdCount) -> Result<Vec<UniqueId>> {
    let job_hash = job_key_hash(rendezvous.job_key());
    let rank = rendezvous.rank();
    let round = rendezvous.history.round(job_hash, rank);
    let place = Place {
        world_size: wire_u32(rendezvous.world_size(), "world size")?,
        rank: wire_u32(rank, "rank")?,
        round,
        ids_wanted: wanted.wire(),
    };
    let request = Request { job_hash, place };
    let keyed = match &rendezvous.transport.secret {
        Some(key) => Some(KeyedClient {
            key,
            request: KeyedRequest {
                job_digest: job_digest(rendezvous.job_key())?,
                place,
            },
        }),
        None => None,
    };
    let client = Client {
        rendezvous,
        request,
        wanted,
        keyed,
    };
    let started = Instant::now();
    let deadline = deadline_after(started, rendezvous.timeout());
    let mut pause = FIRST_RETRY_PAUSE;
    loop {
        let outcome = match &client.keyed {
            None => client.attempt(deadline),
            Some(keyed) => client.attempt_keyed(keyed, deadline),
        };
        let last_failure = match outcome {
            Ok(ids) => {
                rendezvous.history.finish_round(job_hash, rank, round);
                return Ok(ids);
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
    /// How many ids this rank accepts.
    wanted: IdCount,
    /// Set when the rank has a key: then only version 3 is spoken.
    keyed: Option<KeyedClient<'a>>,
}

/// What a joining rank with a key sends.
struct KeyedClient<'a> {
    key: &'a RendezvousKey,
    request: KeyedRequest,
}

impl Client<'_> {
    fn addr(&self) -> &str {
        self.rendezvous.addr()
    }

    /// One connection: request, reply, ids, ack.
    fn attempt(&self, deadline: Instant) -> Result<Vec<UniqueId>, Attempt> {
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
        let count = self.count_of(header.detail)?;
        let ids = self.read_ids(&stream, count, reply_deadline)?;
        let ack = Ack {
            rank: self.request.place.rank,
            fingerprint: ids::fingerprint(&ids),
        };
        // Without the ack rank 0 does not count this rank and frees the slot, so trying again
        // is both safe and necessary.
        write_full(&stream, &ack.encode(), deadline)
            .map_err(|e| Attempt::Retry(format!("sending the acknowledgement: {e}")))?;
        Ok(ids)
    }

    /// The number of ids an ok reply announces, if this rank takes that many. A rank 0 that
    /// predates several ids announces 0 and sends one; one that ignores the count this rank
    /// asked for (also an earlier version) is caught here, before anything is acknowledged.
    fn count_of(&self, detail: u32) -> Result<usize, Attempt> {
        let count = ids_announced(detail);
        if count > MAX_EXCHANGED_IDS {
            return Err(self.protocol(format!(
                "announced {count} unique ids, more than the {MAX_EXCHANGED_IDS} a rendezvous \
                 hands out"
            )));
        }
        self.wanted.accepts(count).map_err(Attempt::Fatal)?;
        Ok(count)
    }

    /// One connection in version 3: opening, rank 0's challenge, hello bound to it, sealed
    /// reply with the id, encrypted ack.
    fn attempt_keyed(
        &self,
        keyed: &KeyedClient<'_>,
        deadline: Instant,
    ) -> Result<Vec<UniqueId>, Attempt> {
        let stream = self.connect(deadline)?;
        let _ = stream.set_nodelay(true);
        write_full(&stream, &keyed::opening(), deadline)
            .map_err(|e| Attempt::Retry(format!("sending the opening: {e}")))?;
        let connection_timeout = self.rendezvous.transport.connection_timeout;
        let reply_deadline = deadline.min(deadline_after(Instant::now(), connection_timeout));
        let challenge = self.read_challenge(&stream, reply_deadline)?;
        let mut handshake = keyed::initiator(keyed.key, &challenge).map_err(Attempt::Fatal)?;
        let hello = keyed::hello(&mut handshake, &keyed.request).map_err(Attempt::Fatal)?;
        write_full(&stream, &hello, deadline)
            .map_err(|e| Attempt::Retry(format!("sending the hello: {e}")))?;
        let reply_deadline = deadline.min(deadline_after(Instant::now(), connection_timeout));
        let header = self.read_raw_header(&stream, reply_deadline)?;
        if header.version != KEYED_VERSION || header.kind != KIND_SEALED_REPLY {
            return Err(self.clear_refusal(header));
        }
        let len = header.detail as usize;
        if !keyed::sealed_len_is_valid(len) {
            return Err(self.protocol(format!("announced a sealed reply of {len} bytes")));
        }
        let mut sealed = vec![0u8; len];
        read_full(&stream, &mut sealed, reply_deadline).map_err(|short| match short {
            Short::Io(e) => Attempt::Retry(format!("reading the sealed reply: {e}")),
            Short::Eof { got } | Short::TimedOut { got } => {
                self.protocol(format!("truncated sealed reply: {got} of {len} bytes"))
            }
        })?;
        let (inner, ids) = keyed::open_reply(&mut handshake, &sealed).map_err(Attempt::Fatal)?;
        self.judge(inner)?;
        if ids.is_empty() {
            return Err(self.protocol("sealed an ok reply without the ids".to_owned()));
        }
        self.count_of(inner.detail)?;
        let mut transport = handshake.into_transport_mode().map_err(|e| {
            Attempt::Fatal(BootstrapError::Protocol(format!(
                "finishing the handshake: {e}"
            )))
        })?;
        let ack = Ack {
            rank: self.request.place.rank,
            fingerprint: ids::fingerprint(&ids),
        };
        let frame = keyed::ack_frame(&mut transport, &ack).map_err(Attempt::Fatal)?;
        write_full(&stream, &frame, deadline)
            .map_err(|e| Attempt::Retry(format!("sending the acknowledgement: {e}")))?;
        Ok(ids)
    }

    /// Reads rank 0's challenge; anything else in its place is a clear refusal.
    fn read_challenge(
        &self,
        stream: &TcpStream,
        deadline: Instant,
    ) -> Result<[u8; CHALLENGE_LEN], Attempt> {
        let header = self.read_raw_header(stream, deadline)?;
        if header.version != KEYED_VERSION || header.kind != KIND_CHALLENGE {
            return Err(self.clear_refusal(header));
        }
        if header.status != Status::Ok as u16 || header.detail as usize != CHALLENGE_LEN {
            return Err(self.protocol(format!(
                "announced a challenge with status {} and {} bytes",
                header.status, header.detail
            )));
        }
        let mut challenge = [0u8; CHALLENGE_LEN];
        read_full(stream, &mut challenge, deadline).map_err(|short| match short {
            Short::Io(e) => Attempt::Retry(format!("reading the challenge: {e}")),
            Short::Eof { got } | Short::TimedOut { got } => self.protocol(format!(
                "truncated challenge: {got} of {CHALLENGE_LEN} bytes"
            )),
        })?;
        Ok(challenge)
    }

    /// What a reply in clear text means to a rank with a key: rank 0 turned it away before
    /// (or without) a handshake. Anyone on the network could have sent it, so only what a
    /// retry or a fix of the keys answers is believed.
    fn clear_refusal(&self, header: ReplyHeader) -> Attempt {
        let addr = self.addr();
        if header.kind != KIND_REPLY {
            return self.protocol(format!(
                "sent message kind {} where a reply was expected",
                header.kind
            ));
        }
        let status = Status::from_code(header.status);
        match (header.version, status) {
            (_, Some(Status::Busy)) => Attempt::Retry("rank 0 was busy".to_owned()),
            (_, Some(Status::TimedOut)) => {
                Attempt::Retry("rank 0 timed the connection out".to_owned())
            }
            (VERSION, Some(Status::UnsupportedVersion)) => {
                Attempt::Fatal(BootstrapError::Authentication {
                    detail: format!(
                        "rank 0 at {addr} speaks only the unencrypted protocol (version 1): it \
                         has no rendezvous key, and this rank has one"
                    ),
                })
            }
            (KEYED_VERSION, Some(Status::AuthFailed)) => {
                Attempt::Fatal(BootstrapError::Authentication {
                    detail: format!(
                        "rank 0 at {addr} could not decrypt this rank's hello: the two \
                         rendezvous keys differ"
                    ),
                })
            }
            // Every version keeps this header, so rank 0's own version is what it announced
            // (an earlier build's rank 0 speaks the encrypted protocol as version 2).
            (version, Some(Status::UnsupportedVersion)) => {
                Attempt::Fatal(BootstrapError::VersionMismatch {
                    local: KEYED_VERSION,
                    peer: version,
                })
            }
            (version, _) => self.protocol(format!(
                "turned the hello away in clear text (version {version}, status {})",
                header.status
            )),
        }
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
        let header = self.read_raw_header(stream, deadline)?;
        if header.version == KEYED_VERSION || header.version == EARLIER_KEYED_VERSION {
            // A rank 0 with a key answers a version 1 request in its own version.
            return Err(Attempt::Fatal(BootstrapError::Authentication {
                detail: format!(
                    "rank 0 at {} requires a rendezvous key (it speaks the encrypted protocol, \
                     version {}), and this rank has none",
                    self.addr(),
                    header.version
                ),
            }));
        }
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

    /// Reads a reply header of any version, checking only the magic.
    fn read_raw_header(
        &self,
        stream: &TcpStream,
        deadline: Instant,
    ) -> Result<ReplyHeader, Attempt> {
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
        Ok(ReplyHeader::decode(&bytes))
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
        let round = self.request.place.round;
        Some(match status {
            Status::Busy => "rank 0 was busy".to_owned(),
            Status::TimedOut => "rank 0 timed the connection out".to_owned(),
            // Another connection is between fetching and acking this rank: most likely this
            // process's own earlier attempt, whose failure rank 0 has not noticed yet.
            Status::DuplicateRank if detail == DUPLICATE_IN_FLIGHT => format!(
                "rank {} is being fetched by another connection",
                self.request.place.rank
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
            Status::IdCountMismatch => BootstrapError::IdCountMismatch {
                handed_out: detail as usize,
                expected: match self.wanted {
                    IdCount::Exactly(n) => n,
                    IdCount::Auto => 1,
                },
            },
            Status::Late => BootstrapError::Protocol(format!(
                "this rank is on exchange {} under this job key, but rank 0 is already on \
                 exchange {detail}: a previous exchange of this rank failed or was skipped",
                self.request.place.round
            )),
            _ => BootstrapError::Protocol(format!(
                "rank 0 at {addr} rejected the request as malformed (status {})",
                status as u16
            )),
        }
    }

    fn read_ids(
        &self,
        stream: &TcpStream,
        count: usize,
        deadline: Instant,
    ) -> Result<Vec<UniqueId>, Attempt> {
        let len = count * UNIQUE_ID_BYTES;
        let mut bytes = vec![0u8; len];
        match read_full(stream, &mut bytes, deadline) {
            Ok(()) => Ok(ids::decode_ids(&bytes)),
            Err(Short::Eof { got }) | Err(Short::TimedOut { got }) => {
                Err(self.protocol(format!("truncated unique ids: {got} of {len} bytes")))
            }
            Err(Short::Io(e)) => Err(Attempt::Retry(format!("reading the ids: {e}"))),
        }
    }

    /// A final protocol error about what rank 0's address sent.
    fn protocol(&self, what: String) -> Attempt {
        Attempt::Fatal(BootstrapError::Protocol(format!("{}: {what}", self.addr())))
    }
}
