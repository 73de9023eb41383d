//! One connection on rank 0: read and check the request, claim the rank, send the id, wait
//! for the ack; or tell the peer why it is turned away.

use std::fmt;
use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::socket::{read_full, write_full, Short};
use super::wire::{
    kind_of, version_of, Ack, ReplyHeader, Request, Status, ACK_LEN, DUPLICATE_DONE,
    DUPLICATE_IN_FLIGHT, KIND_REQUEST, MAGIC, PREFIX_LEN, REPLY_HEADER_LEN, REQUEST_LEN, VERSION,
};
use crate::bootstrap::util::{deadline_after, io_error, lock, time_left};
use crate::bootstrap::BootstrapError;
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

/// Grace period for sending an error reply and letting the peer read it.
const ERROR_REPLY_GRACE: Duration = Duration::from_millis(200);

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

/// What the accept loop and the connection threads of one serve share.
pub(super) struct Shared {
    state: Mutex<ServeState>,
    /// Which exchange under this job key this is, counted per process from 0.
    round: u32,
    id: UniqueId,
    world_size: usize,
    job_hash: u64,
    pub(super) serve_deadline: Instant,
    connection_timeout: Duration,
}

impl Shared {
    /// The state of one serve; `round` is taken from the job's history as serving starts.
    pub(super) fn new(
        id: UniqueId,
        world_size: usize,
        job_hash: u64,
        round: u32,
        serve_deadline: Instant,
        connection_timeout: Duration,
    ) -> Self {
        let mut slots = vec![Slot::Waiting; world_size];
        slots[0] = Slot::Done;
        Shared {
            state: Mutex::new(ServeState {
                slots,
                done: 0,
                rejected: Vec::new(),
                open: Vec::new(),
                active: 0,
                finished: false,
            }),
            round,
            id,
            world_size,
            job_hash,
            serve_deadline,
            connection_timeout,
        }
    }

    fn lock(&self) -> MutexGuard<'_, ServeState> {
        lock(&self.state)
    }

    /// Whether every rank but 0 has acked.
    pub(super) fn all_served(&self) -> bool {
        self.lock().done == self.world_size - 1
    }

    /// Takes a connection in, unless `max_active` are in flight already.
    pub(super) fn register(&self, connection: u64, stream: &TcpStream, max_active: usize) -> bool {
        let mut state = self.lock();
        if state.active >= max_active {
            return false;
        }
        state.active += 1;
        if let Ok(clone) = stream.try_clone() {
            state.open.push((connection, clone));
        }
        true
    }

    pub(super) fn unregister(&self, connection: u64) {
        let mut state = self.lock();
        state.active -= 1;
        state.open.retain(|(id, _)| *id != connection);
    }

    /// Ends serving: closes the open connections and returns the peers turned away and the
    /// ranks that never acked.
    pub(super) fn finish(&self) -> (Vec<RejectedPeer>, Vec<usize>) {
        let mut state = self.lock();
        state.finished = true;
        for (_, stream) in state.open.drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        let missing = (state.slots.iter().enumerate())
            .filter(|(_, slot)| **slot != Slot::Done)
            .map(|(rank, _)| rank)
            .collect();
        (std::mem::take(&mut state.rejected), missing)
    }

    /// Records how a conversation ended; returns the reply owed to a refused peer.
    fn record(&self, peer: SocketAddr, outcome: Result<usize, Refusal>) -> Option<(Status, u32)> {
        let mut state = self.lock();
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

/// A connection's thread: converses, records the outcome, answers a refused peer.
pub(super) fn handle_connection(
    shared: &Shared,
    stream: TcpStream,
    peer: SocketAddr,
    connection: u64,
) {
    let deadline = shared
        .serve_deadline
        .min(deadline_after(Instant::now(), shared.connection_timeout));
    let _ = stream.set_nodelay(true);
    let outcome = converse(shared, &stream, deadline);
    // Record the outcome before answering a refused peer: the answer may take a grace period,
    // and serving may end meanwhile.
    if let Some((status, detail)) = shared.record(peer, outcome) {
        send_refusal(&stream, status, detail);
    }
    shared.unregister(connection);
}

/// The server side of one connection: returns the rank that received and acknowledged the id.
/// A rank claimed here is released again if anything fails after the claim.
fn converse(shared: &Shared, stream: &TcpStream, deadline: Instant) -> Result<usize, Refusal> {
    let request = read_request(shared, stream, deadline)?;
    let rank = check_request(shared, &request)?;
    claim(shared, rank)?;
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

/// Reads the request in stages: magic and version first, so that garbage or another version
/// is answered at once instead of after waiting for bytes that will never come.
fn read_request(
    shared: &Shared,
    stream: &TcpStream,
    deadline: Instant,
) -> Result<Request, Refusal> {
    let timeout = shared.connection_timeout;
    let mut bytes = [0u8; REQUEST_LEN];
    read_part(stream, &mut bytes, 0..4, deadline, timeout)?;
    if bytes[0..4] != MAGIC {
        return Err(Refusal::new(
            BootstrapError::Protocol(format!(
                "request starts with {:02x?}, not the rendezvous magic",
                &bytes[0..4]
            )),
            Status::BadMagic,
            0,
        ));
    }
    read_part(stream, &mut bytes, 4..PREFIX_LEN, deadline, timeout)?;
    let version = version_of(&bytes);
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
        &mut bytes,
        PREFIX_LEN..REQUEST_LEN,
        deadline,
        timeout,
    )?;
    let kind = kind_of(&bytes);
    if kind != KIND_REQUEST {
        return Err(Refusal::new(
            BootstrapError::Protocol(format!("expected a request, got message kind {kind}")),
            Status::Malformed,
            0,
        ));
    }
    Ok(Request::decode(&bytes))
}

/// Checks a request against this serve: job, world size, round and rank.
fn check_request(shared: &Shared, request: &Request) -> Result<usize, Refusal> {
    let rank = request.rank as usize;
    let world_detail = u32::try_from(shared.world_size).unwrap_or(u32::MAX);
    let (error, status, detail) = if request.job_hash != shared.job_hash {
        let detail = format!(
            "the peer's job key hash {:016x} differs from rank 0's {:016x}",
            request.job_hash, shared.job_hash
        );
        (BootstrapError::WrongJob { detail }, Status::WrongJob, 0)
    } else if request.world_size as usize != shared.world_size {
        let error = BootstrapError::WorldSizeMismatch {
            expected: shared.world_size,
            got: request.world_size as usize,
        };
        (error, Status::WorldSizeMismatch, world_detail)
    } else if request.round != shared.round {
        return Err(round_refusal(shared, request));
    } else if rank >= shared.world_size {
        let error = BootstrapError::RankOutOfRange {
            rank,
            world_size: shared.world_size,
        };
        (error, Status::RankOutOfRange, world_detail)
    } else {
        return Ok(rank);
    };
    Err(Refusal::new(error, status, detail).for_rank(rank))
}

/// A request from another round under the same job key.
fn round_refusal(shared: &Shared, request: &Request) -> Refusal {
    let (round, rank) = (request.round, request.rank as usize);
    if round > shared.round {
        // This rank already finished this exchange and runs the next one under the same key;
        // rank 0 will serve it once this one is over. Normal: not listed in the report.
        let error = BootstrapError::Protocol(format!(
            "the peer is on exchange {round}, rank 0 on exchange {}",
            shared.round
        ));
        let mut early = Refusal::new(error, Status::Early, shared.round).for_rank(rank);
        early.record = false;
        return early;
    }
    let error = BootstrapError::Protocol(format!(
        "the peer is on exchange {round} under this job key, rank 0 already on exchange {}",
        shared.round
    ));
    Refusal::new(error, Status::Late, shared.round).for_rank(rank)
}

/// Claims `rank` for this connection, unless another holds it or it is served.
fn claim(shared: &Shared, rank: usize) -> Result<(), Refusal> {
    let mut state = shared.lock();
    let taken = match state.slots[rank] {
        Slot::Waiting => None,
        Slot::Claimed => Some(DUPLICATE_IN_FLIGHT),
        // Includes rank 0, which is this process.
        Slot::Done => Some(DUPLICATE_DONE),
    };
    if let Some(detail) = taken {
        let error = BootstrapError::DuplicateRank(rank);
        return Err(Refusal::new(error, Status::DuplicateRank, detail).for_rank(rank));
    }
    state.slots[rank] = Slot::Claimed;
    Ok(())
}

/// Sends the id to the rank that claimed `rank` and waits for its ack.
fn deliver(
    shared: &Shared,
    stream: &TcpStream,
    deadline: Instant,
    rank: usize,
) -> Result<(), Refusal> {
    let mut reply = [0u8; REPLY_HEADER_LEN + UNIQUE_ID_BYTES];
    reply[..REPLY_HEADER_LEN].copy_from_slice(&ReplyHeader::encode(Status::Ok, 0));
    reply[REPLY_HEADER_LEN..].copy_from_slice(shared.id.as_bytes());
    write_full(stream, &reply, deadline)
        .map_err(|e| Refusal::silent(io_error("sending the unique id", e)))?;
    let mut ack = [0u8; ACK_LEN];
    read_full(stream, &mut ack, deadline).map_err(|short| {
        Refusal::silent(match short {
            Short::Eof { got } => BootstrapError::Protocol(format!(
                "the rank closed the connection after {got} of {ACK_LEN} acknowledgement bytes"
            )),
            Short::TimedOut { got } => BootstrapError::Timeout {
                stage: format!("waiting for the acknowledgement ({got} of {ACK_LEN} bytes)"),
                after: shared.connection_timeout,
                missing_ranks: vec![rank],
            },
            Short::Io(e) => io_error("reading the acknowledgement", e),
        })
    })?;
    let expected = Ack {
        rank: request_rank(rank),
        fingerprint: shared.id.fingerprint(),
    };
    if Ack::decode(&ack) != Some(expected) {
        return Err(Refusal::silent(BootstrapError::Protocol(
            "invalid acknowledgement (wrong magic, kind, rank or id fingerprint)".to_owned(),
        )));
    }
    Ok(())
}

/// The rank as the request carried it (it fitted 32 bits on the way in).
fn request_rank(rank: usize) -> u32 {
    u32::try_from(rank).unwrap_or(u32::MAX)
}

/// Reads `range` of the request, turning a short read into a refusal.
fn read_part(
    stream: &TcpStream,
    request: &mut [u8; REQUEST_LEN],
    range: std::ops::Range<usize>,
    deadline: Instant,
    connection_timeout: Duration,
) -> Result<(), Refusal> {
    let offset = range.start;
    match read_full(stream, &mut request[range], deadline) {
        Ok(()) => Ok(()),
        Err(Short::Eof { got }) => Err(Refusal::new(
            BootstrapError::Protocol(format!(
                "truncated request: the peer closed the connection after {} of {REQUEST_LEN} \
                 bytes",
                offset + got
            )),
            Status::Malformed,
            0,
        )),
        Err(Short::TimedOut { got }) => Err(Refusal::new(
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
        Err(Short::Io(e)) => Err(Refusal::silent(io_error("reading the request", e))),
    }
}

/// Best effort: tells the peer why it is turned away, then lets it read that before the
/// socket closes. Closing with unread input would reset the connection and could discard the
/// reply, so the input is drained briefly after shutting down our side.
fn send_refusal(stream: &TcpStream, status: Status, detail: u32) {
    let grace = Instant::now() + ERROR_REPLY_GRACE;
    if write_full(stream, &ReplyHeader::encode(status, detail), grace).is_err() {
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
