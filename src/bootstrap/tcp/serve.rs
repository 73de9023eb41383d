//! One serve of the ids on rank 0: what its accept loop and connection threads share
//! ([`Serve`]: the ranks' slots, the peers turned away, the open connections), and what both
//! protocol versions' conversations are made of: the refusal and its reply, the checks of a
//! request's place (world size, round, rank) and of the ids it wants, the claim of a rank, and
//! reading a message's first bytes.

use std::fmt;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use snow::HandshakeState;

use super::keyed::{self, Keyed};
use super::socket::{read_full, Short};
use super::wire::{
    version_of, Place, Status, DUPLICATE_DONE, DUPLICATE_IN_FLIGHT, EARLIER_KEYED_VERSION,
    KEYED_VERSION, MAGIC, PREFIX_LEN, VERSION,
};
use super::REQUEST_TIMEOUT;
use crate::bootstrap::ids::ANY_IDS;
use crate::bootstrap::util::{io_error, lock, time_left};
use crate::bootstrap::BootstrapError;
use crate::UniqueId;

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
pub(super) struct Serve {
    state: Mutex<ServeState>,
    /// Which exchange under this job key this is, counted per process from 0.
    round: u32,
    /// What this serve hands out: one id, or several for `ncclCommInitRankScalable`.
    pub(super) ids: Vec<UniqueId>,
    world_size: usize,
    pub(super) job_hash: u64,
    /// Set when the ranks share a key: then only version 3 is spoken.
    pub(super) keyed: Option<Keyed>,
    pub(super) serve_deadline: Instant,
    pub(super) connection_timeout: Duration,
}

impl Serve {
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
        Serve {
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

    /// How long a connection has, from its accept, to deliver its whole request (version 3:
    /// the opening and the hello): [`REQUEST_TIMEOUT`], or the connection timeout if shorter.
    /// A peer that says nothing gives its handler back this soon.
    pub(super) fn request_timeout(&self) -> Duration {
        self.connection_timeout.min(REQUEST_TIMEOUT)
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

    /// Waits until no connection holds a rank between reply and ack. Each such conversation
    /// ends by its own deadline (at once when its peer is gone), with the ack counted or the
    /// rank released.
    pub(super) fn see_out_claims(&self) {
        let mut pause = Duration::from_millis(1);
        while self.lock().slots.contains(&Slot::Claimed) && time_left(self.serve_deadline).is_some()
        {
            thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(16));
        }
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
    pub(super) fn record(
        &self,
        peer: SocketAddr,
        outcome: Result<usize, Refusal>,
    ) -> Option<Reply> {
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
    /// A clear reply header (every refusal of version 1, and version 3's before the hello
    /// decrypted).
    Plain(Status, u32),
    /// Version 3's refusals once the hello decrypted: the sealed reply, ready to send.
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

    /// A request of another job: its job key differs, as `detail` says.
    pub(super) fn wrong_job(detail: String, place: Place) -> Self {
        let error = BootstrapError::WrongJob { detail };
        Refusal::new(error, Status::WrongJob, 0).for_rank(place.rank as usize)
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

/// The rank that received and acknowledged the id, or the refusal; a claimed rank is released
/// again when delivery failed.
pub(super) fn released_on_failure(
    serve: &Serve,
    rank: usize,
    result: Result<(), Refusal>,
) -> Result<usize, Refusal> {
    if result.is_err() {
        let mut state = serve.lock();
        if state.slots[rank] == Slot::Claimed {
            state.slots[rank] = Slot::Waiting;
        }
    }
    result
        .map(|()| rank)
        .map_err(|refusal| refusal.for_rank(rank))
}

/// Checks the number of ids a request asks for against what this serve hands out: 0 (a rank
/// of a version that predates several ids) asks for one, `ANY_IDS` takes any number.
fn check_ids_wanted(serve: &Serve, wanted: u32, rank: usize) -> Result<(), Refusal> {
    let handed_out = serve.ids.len();
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

/// Checks the place of a request whose job matched (world size, round, rank, then the ids it
/// wants), the same in both versions; returns the rank.
pub(super) fn check_place(serve: &Serve, place: Place) -> Result<usize, Refusal> {
    let Place {
        world_size,
        rank: claimed_rank,
        round,
        ids_wanted,
    } = place;
    let rank = claimed_rank as usize;
    let world_detail = u32::try_from(serve.world_size).unwrap_or(u32::MAX);
    let (error, status, detail) = if world_size as usize != serve.world_size {
        let error = BootstrapError::WorldSizeMismatch {
            expected: serve.world_size,
            got: world_size as usize,
        };
        (error, Status::WorldSizeMismatch, world_detail)
    } else if round != serve.round {
        return Err(round_refusal(serve, round, claimed_rank));
    } else if rank >= serve.world_size {
        let error = BootstrapError::RankOutOfRange {
            rank,
            world_size: serve.world_size,
        };
        (error, Status::RankOutOfRange, world_detail)
    } else {
        check_ids_wanted(serve, ids_wanted, rank)?;
        return Ok(rank);
    };
    Err(Refusal::new(error, status, detail).for_rank(rank))
}

/// A request from another round under the same job key.
pub(super) fn round_refusal(serve: &Serve, round: u32, rank: u32) -> Refusal {
    let rank = rank as usize;
    if round > serve.round {
        // This rank already finished this exchange and runs the next one under the same key;
        // rank 0 will serve it once this one is over. Normal: not listed in the report.
        let error = BootstrapError::Protocol(format!(
            "the peer is on exchange {round}, rank 0 on exchange {}",
            serve.round
        ));
        let mut early = Refusal::new(error, Status::Early, serve.round).for_rank(rank);
        early.record = false;
        return early;
    }
    let error = BootstrapError::Protocol(format!(
        "the peer is on exchange {round} under this job key, rank 0 already on exchange {}",
        serve.round
    ));
    Refusal::new(error, Status::Late, serve.round).for_rank(rank)
}

/// Claims `rank` for this connection, unless another holds it or it is served.
pub(super) fn claim(serve: &Serve, rank: usize) -> Result<(), Refusal> {
    let mut state = serve.lock();
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

/// The error of an acknowledgement (`len` bytes) that did not arrive whole.
pub(super) fn ack_short(short: Short, serve: &Serve, rank: usize, len: usize) -> BootstrapError {
    match short {
        Short::Eof { got } => BootstrapError::Protocol(format!(
            "the rank closed the connection after {got} of {len} acknowledgement bytes"
        )),
        Short::TimedOut { got } => BootstrapError::Timeout {
            stage: format!("waiting for the acknowledgement ({got} of {len} bytes)"),
            after: serve.connection_timeout,
            missing_ranks: vec![rank],
        },
        Short::Io(e) => io_error("reading the acknowledgement", e),
    }
}

/// The rank as the request carried it (it fitted 32 bits on the way in).
pub(super) fn request_rank(rank: usize) -> u32 {
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
        (VERSION, KEYED_VERSION | EARLIER_KEYED_VERSION) => BootstrapError::Authentication {
            detail: format!(
                "the peer speaks the encrypted protocol (version {version}): it has a \
                 rendezvous key, and this rank 0 has none"
            ),
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
