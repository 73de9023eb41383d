//! One connection on rank 0: read and check the request, claim the rank, send the id, wait
//! for the ack; or tell the peer why it is turned away. Version 2's reading, sealing and
//! delivering are in [`keyed`](super::keyed); the bookkeeping here serves both versions.
//!
//! Past 600 lines on purpose: the steps of one conversation (read, check, claim, deliver,
//! release) read in their order here, and every check of a request sits beside the refusal it
//! sends; split, one conversation would be spread over several files.

use std::fmt;
use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use snow::HandshakeState;

use super::keyed::{self, Keyed};
use super::socket::{read_full, write_full, Short};
use super::wire::{
    kind_of, version_of, wire_u32, Ack, ReplyHeader, Request, Status, ACK_LEN, DUPLICATE_DONE,
    DUPLICATE_IN_FLIGHT, KEYED_VERSION, KIND_REPLY, KIND_REQUEST, MAGIC, PREFIX_LEN,
    REPLY_HEADER_LEN, REQUEST_LEN, VERSION,
};
use crate::bootstrap::ids::{self, ANY_IDS};
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
    /// What this serve hands out: one id, or several for `ncclCommInitRankScalable`.
    pub(super) ids: Vec<UniqueId>,
    world_size: usize,
    job_hash: u64,
    /// Set when the ranks share a key: then only version 2 is spoken.
    keyed: Option<Keyed>,
    pub(super) serve_deadline: Instant,
    pub(super) connection_timeout: Duration,
}

impl Shared {
    /// The state of one serve; `round` is taken from the job's history as serving starts.
    pub(super) fn new(
        ids: Vec<UniqueId>,
        world_size: usize,
        job_hash: u64,
        round: u32,
        keyed: Option<Keyed>,
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
            ids,
            world_size,
            job_hash,
            keyed,
            serve_deadline,
            connection_timeout,
        }
    }

    /// The protocol version this serve speaks, and writes in its clear replies.
    pub(super) fn version(&self) -> u16 {
        match self.keyed {
            Some(_) => KEYED_VERSION,
            None => VERSION,
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
    fn record(&self, peer: SocketAddr, outcome: Result<usize, Refusal>) -> Option<Reply> {
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

/// What a refused peer is told.
pub(super) enum Reply {
    /// A clear reply header (every refusal of version 1, and version 2's before the hello
    /// decrypted).
    Plain(Status, u32),
    /// Version 2's refusals once the hello decrypted: the sealed reply, ready to send.
    Sealed(Vec<u8>),
}

/// A handshake that went wrong: the error to record and the reply to send back, if any.
pub(super) struct Refusal {
    error: BootstrapError,
    reply: Option<Reply>,
    rank: Option<usize>,
    /// Whether to list the peer in the report (not for the normal "come back later").
    record: bool,
}

impl Refusal {
    pub(super) fn new(error: BootstrapError, status: Status, detail: u32) -> Self {
        Refusal {
            error,
            reply: Some(Reply::Plain(status, detail)),
            rank: None,
            record: true,
        }
    }

    pub(super) fn silent(error: BootstrapError) -> Self {
        Refusal {
            error,
            reply: None,
            rank: None,
            record: true,
        }
    }

    /// A peer whose first bytes are not the magic: garbage, or another protocol.
    pub(super) fn bad_magic(first: &[u8]) -> Self {
        Refusal::new(
            BootstrapError::Protocol(format!(
                "request starts with {first:02x?}, not the rendezvous magic"
            )),
            Status::BadMagic,
            0,
        )
    }

    pub(super) fn for_rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }

    /// Seals a clear reply with the peer's handshake, so that a peer holding the key can trust
    /// it; without a way to seal it the peer is closed without a reply.
    pub(super) fn sealed(mut self, handshake: &mut HandshakeState) -> Self {
        if let Some(Reply::Plain(status, detail)) = self.reply {
            self.reply = keyed::seal_reply(handshake, status, detail, &[])
                .ok()
                .map(Reply::Sealed);
        }
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
    let outcome = match &shared.keyed {
        None => converse(shared, &stream, deadline),
        Some(keyed) => converse_keyed(shared, keyed, &stream, deadline),
    };
    // Record the outcome before answering a refused peer: the answer may take a grace period,
    // and serving may end meanwhile.
    if let Some(reply) = shared.record(peer, outcome) {
        let bytes = match reply {
            Reply::Plain(status, detail) => {
                ReplyHeader::encode_as(shared.version(), KIND_REPLY, status, detail).to_vec()
            }
            Reply::Sealed(bytes) => bytes,
        };
        send_refusal(&stream, &bytes);
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
    released_on_failure(shared, rank, result)
}

/// [`converse`] in version 2: the same checks and claim on the decrypted request, refusals
/// sealed.
fn converse_keyed(
    shared: &Shared,
    keyed: &Keyed,
    stream: &TcpStream,
    deadline: Instant,
) -> Result<usize, Refusal> {
    let (request, mut handshake) = keyed::read_hello(shared, keyed, stream, deadline)?;
    let claimed =
        keyed::check(shared, keyed, &request).and_then(|rank| claim(shared, rank).map(|()| rank));
    let rank = claimed.map_err(|refusal| refusal.sealed(&mut handshake))?;
    let result = keyed::deliver(shared, stream, deadline, rank, handshake);
    released_on_failure(shared, rank, result)
}

/// The rank that received and acknowledged the id, or the refusal; a claimed rank is released
/// again when delivery failed.
fn released_on_failure(
    shared: &Shared,
    rank: usize,
    result: Result<(), Refusal>,
) -> Result<usize, Refusal> {
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
    let what = "request";
    read_prefix(stream, &mut bytes, deadline, timeout, what, VERSION)?;
    let rest = PREFIX_LEN..REQUEST_LEN;
    read_part(stream, &mut bytes, rest, deadline, timeout, what)?;
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
    if request.job_hash != shared.job_hash {
        let detail = format!(
            "the peer's job key hash {:016x} differs from rank 0's {:016x}",
            request.job_hash, shared.job_hash
        );
        let refusal = Refusal::new(BootstrapError::WrongJob { detail }, Status::WrongJob, 0);
        return Err(refusal.for_rank(request.rank as usize));
    }
    let rank = check_place(shared, request.world_size, request.rank, request.round)?;
    check_ids_wanted(shared, request.ids_wanted, rank)?;
    Ok(rank)
}

/// Checks the number of ids a request asks for against what this serve hands out: 0 (a rank
/// of a version that predates several ids) asks for one, `ANY_IDS` takes any number.
pub(super) fn check_ids_wanted(shared: &Shared, wanted: u32, rank: usize) -> Result<(), Refusal> {
    let handed_out = shared.ids.len();
    let expected = match wanted {
        ANY_IDS => return Ok(()),
        0 => 1,
        n => n as usize,
    };
    if expected == handed_out {
        return Ok(());
    }
    let error = BootstrapError::IdCountMismatch {
        handed_out,
        expected,
    };
    let detail = u32::try_from(handed_out).unwrap_or(u32::MAX);
    Err(Refusal::new(error, Status::IdCountMismatch, detail).for_rank(rank))
}

/// Checks the rest of a request whose job matched: world size, round and rank.
pub(super) fn check_place(
    shared: &Shared,
    world_size: u32,
    rank: u32,
    round: u32,
) -> Result<usize, Refusal> {
    let (rank, claimed_rank) = (rank as usize, rank);
    let world_detail = u32::try_from(shared.world_size).unwrap_or(u32::MAX);
    let (error, status, detail) = if world_size as usize != shared.world_size {
        let error = BootstrapError::WorldSizeMismatch {
            expected: shared.world_size,
            got: world_size as usize,
        };
        (error, Status::WorldSizeMismatch, world_detail)
    } else if round != shared.round {
        return Err(round_refusal(shared, round, claimed_rank));
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
fn round_refusal(shared: &Shared, round: u32, rank: u32) -> Refusal {
    let rank = rank as usize;
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
    // An ok reply's detail is the number of ids that follow (earlier versions sent 0 and one
    // id, which a rank reads alike).
    let count = wire_u32(shared.ids.len(), "id count").map_err(Refusal::silent)?;
    let mut reply = Vec::with_capacity(REPLY_HEADER_LEN + shared.ids.len() * UNIQUE_ID_BYTES);
    reply.extend_from_slice(&ReplyHeader::encode(Status::Ok, count));
    for id in &shared.ids {
        reply.extend_from_slice(id.as_bytes());
    }
    write_full(stream, &reply, deadline)
        .map_err(|e| Refusal::silent(io_error("sending the unique ids", e)))?;
    let mut ack = [0u8; ACK_LEN];
    read_full(stream, &mut ack, deadline)
        .map_err(|short| Refusal::silent(ack_short(short, shared, rank, ACK_LEN)))?;
    let expected = Ack {
        rank: request_rank(rank),
        fingerprint: ids::fingerprint(&shared.ids),
    };
    if Ack::decode(&ack) != Some(expected) {
        return Err(Refusal::silent(BootstrapError::Protocol(
            "invalid acknowledgement (wrong magic, kind, rank or id fingerprint)".to_owned(),
        )));
    }
    Ok(())
}

/// The error of an acknowledgement (`len` bytes) that did not arrive whole.
pub(super) fn ack_short(short: Short, shared: &Shared, rank: usize, len: usize) -> BootstrapError {
    match short {
        Short::Eof { got } => BootstrapError::Protocol(format!(
            "the rank closed the connection after {got} of {len} acknowledgement bytes"
        )),
        Short::TimedOut { got } => BootstrapError::Timeout {
            stage: format!("waiting for the acknowledgement ({got} of {len} bytes)"),
            after: shared.connection_timeout,
            missing_ranks: vec![rank],
        },
        Short::Io(e) => io_error("reading the acknowledgement", e),
    }
}

/// The rank as the request carried it (it fitted 32 bits on the way in).
fn request_rank(rank: usize) -> u32 {
    u32::try_from(rank).unwrap_or(u32::MAX)
}

/// Reads the magic and the version every message starts with, in stages, so that garbage or
/// another version is answered at once, and refuses any version but `expected`. The reply is
/// the same for every other version; what rank 0 records names the likely cause when the peer
/// speaks this build's other version (one side has a rendezvous key, the other has none).
pub(super) fn read_prefix(
    stream: &TcpStream,
    message: &mut [u8],
    deadline: Instant,
    connection_timeout: Duration,
    what: &str,
    expected: u16,
) -> Result<(), Refusal> {
    read_part(stream, message, 0..4, deadline, connection_timeout, what)?;
    if message[0..4] != MAGIC {
        return Err(Refusal::bad_magic(&message[0..4]));
    }
    read_part(
        stream,
        message,
        4..PREFIX_LEN,
        deadline,
        connection_timeout,
        what,
    )?;
    let version = version_of(message);
    if version == expected {
        return Ok(());
    }
    let error = match (expected, version) {
        (VERSION, KEYED_VERSION) => BootstrapError::Authentication {
            detail: "the peer speaks the encrypted protocol (version 2): it has a rendezvous \
                     key, and this rank 0 has none"
                .to_owned(),
        },
        (KEYED_VERSION, VERSION) => BootstrapError::Authentication {
            detail: "the peer speaks the unencrypted protocol (version 1): it has no \
                     rendezvous key, and this rank 0 requires one"
                .to_owned(),
        },
        (local, peer) => BootstrapError::VersionMismatch { local, peer },
    };
    Err(Refusal::new(
        error,
        Status::UnsupportedVersion,
        u32::from(expected),
    ))
}

/// Reads `range` of the first message (`what`, as long as `message`), turning a short read
/// into a refusal.
pub(super) fn read_part(
    stream: &TcpStream,
    message: &mut [u8],
    range: std::ops::Range<usize>,
    deadline: Instant,
    connection_timeout: Duration,
    what: &str,
) -> Result<(), Refusal> {
    let (offset, len) = (range.start, message.len());
    match read_full(stream, &mut message[range], deadline) {
        Ok(()) => Ok(()),
        Err(Short::Eof { got }) => Err(Refusal::new(
            BootstrapError::Protocol(format!(
                "truncated {what}: the peer closed the connection after {} of {len} bytes",
                offset + got
            )),
            Status::Malformed,
            0,
        )),
        Err(Short::TimedOut { got }) => Err(Refusal::new(
            BootstrapError::Timeout {
                stage: format!(
                    "waiting for the peer's {what} ({} of {len} bytes arrived)",
                    offset + got
                ),
                after: connection_timeout,
                missing_ranks: Vec::new(),
            },
            Status::TimedOut,
            0,
        )),
        Err(Short::Io(e)) => Err(Refusal::silent(io_error(format!("reading the {what}"), e))),
    }
}

/// Best effort: tells the peer why it is turned away (`reply`), then lets it read that before
/// the socket closes. Closing with unread input would reset the connection and could discard
/// the reply, so the input is drained briefly after shutting down our side.
fn send_refusal(stream: &TcpStream, reply: &[u8]) {
    let grace = Instant::now() + ERROR_REPLY_GRACE;
    if write_full(stream, reply, grace).is_err() {
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
