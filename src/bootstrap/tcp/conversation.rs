//! One connection on rank 0, in either protocol version: read and check the request (version
//! 3: send a challenge, then decrypt the hello bound to it), claim the rank, send the ids
//! (sealed), wait for the ack; or tell the peer why it is turned away. Everything up to the
//! claim must be done within the request deadline, so that silent peers give their handler
//! back quickly; the rest within the connection's own deadline. The steps of one conversation read in their order here; the
//! state of the serve and the checks both versions share are in [`serve`](super::serve), the
//! Noise handshake and messages in [`keyed`](super::keyed).

use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use snow::HandshakeState;

use super::keyed::{
    challenge_frame, new_challenge, noise_error, responder, seal_reply, Keyed, KeyedRequest,
    ACK_FRAME_LEN, CHALLENGE_LEN, CLEAR_PREFIX_LEN, HELLO_LEN, REQUEST_PAYLOAD_LEN,
};
use super::serve::{
    ack_short, check_place, claim, read_part, read_prefix, released_on_failure, request_rank,
    Refusal, Reply, Serve,
};
use super::socket::{read_full, write_full};
use super::wire::{
    kind_of, version_of, wire_u32, Ack, ReplyHeader, Request, Status, ACK_LEN, KEYED_VERSION,
    KIND_ACK, KIND_HELLO, KIND_OPEN, KIND_REPLY, KIND_REQUEST, MAGIC, PREFIX_LEN, REPLY_HEADER_LEN,
    REQUEST_LEN, VERSION,
};
use crate::bootstrap::bytes::get_u16;
use crate::bootstrap::ids;
use crate::bootstrap::util::{deadline_after, io_error, time_left};
use crate::bootstrap::BootstrapError;
use crate::id::UNIQUE_ID_BYTES;

/// Grace period for sending an error reply and letting the peer read it.
const ERROR_REPLY_GRACE: Duration = Duration::from_millis(200);

/// A connection's thread: converses, records the outcome, answers a refused peer.
pub(super) fn handle_connection(
    serve: &Serve,
    stream: TcpStream,
    peer: SocketAddr,
    connection: u64,
) {
    let accepted = Instant::now();
    let deadlines = Deadlines {
        request: serve
            .serve_deadline
            .min(deadline_after(accepted, serve.request_timeout())),
        connection: serve
            .serve_deadline
            .min(deadline_after(accepted, serve.connection_timeout)),
    };
    let _ = stream.set_nodelay(true);
    let outcome = match &serve.keyed {
        None => converse(serve, &stream, deadlines),
        Some(keyed) => converse_keyed(serve, keyed, &stream, deadlines),
    };
    // Record the outcome before answering a refused peer: the answer may take a grace period,
    // and serving may end meanwhile.
    if let Some(reply) = serve.record(peer, outcome) {
        let bytes = match reply {
            Reply::Plain(status, detail) => {
                ReplyHeader::encode_as(serve.version(), KIND_REPLY, status, detail).to_vec()
            }
            Reply::Sealed(bytes) => bytes,
        };
        send_refusal(&stream, &bytes);
    }
    serve.unregister(connection);
}

/// The two deadlines of one connection, both counted from its accept (and neither past the
/// serve's own).
#[derive(Clone, Copy)]
struct Deadlines {
    /// For the request (version 3: the opening, the challenge and the hello): what a peer must
    /// do before it may claim a rank.
    request: Instant,
    /// For the whole conversation, the reply and the ack included.
    connection: Instant,
}

/// The server side of one connection: returns the rank that received and acknowledged the id.
/// A rank claimed here is released again if anything fails after the claim.
fn converse(serve: &Serve, stream: &TcpStream, deadlines: Deadlines) -> Result<usize, Refusal> {
    let request = read_request(serve, stream, deadlines.request)?;
    let rank = check_request(serve, &request)?;
    claim(serve, rank)?;
    let result = deliver(serve, stream, deadlines.connection, rank);
    released_on_failure(serve, rank, result)
}

/// [`converse`] in version 3: a challenge first, then the same checks and claim on the
/// decrypted request, refusals sealed.
fn converse_keyed(
    serve: &Serve,
    keyed: &Keyed,
    stream: &TcpStream,
    deadlines: Deadlines,
) -> Result<usize, Refusal> {
    let challenge = challenge(serve, stream, deadlines.request)?;
    let (request, mut handshake) = read_hello(serve, keyed, &challenge, stream, deadlines.request)?;
    let claimed = check_keyed_request(serve, keyed, &request)
        .and_then(|rank| claim(serve, rank).map(|()| rank));
    let rank = claimed.map_err(|refusal| refusal.sealed(&mut handshake))?;
    let result = deliver_keyed(serve, stream, deadlines.connection, rank, handshake);
    released_on_failure(serve, rank, result)
}

/// Reads the request in stages: magic and version first, so that garbage or another version
/// is answered at once instead of after waiting for bytes that will never come.
fn read_request(serve: &Serve, stream: &TcpStream, deadline: Instant) -> Result<Request, Refusal> {
    let timeout = serve.request_timeout();
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

/// Checks a request against this serve: its job hash, then its place.
fn check_request(serve: &Serve, request: &Request) -> Result<usize, Refusal> {
    if request.job_hash != serve.job_hash {
        let detail = format!(
            "the peer's job key hash {:016x} differs from rank 0's {:016x}",
            request.job_hash, serve.job_hash
        );
        return Err(Refusal::wrong_job(detail, request.place));
    }
    check_place(serve, request.place)
}

/// Sends the id to the rank that claimed `rank` and waits for its ack.
fn deliver(
    serve: &Serve,
    stream: &TcpStream,
    deadline: Instant,
    rank: usize,
) -> Result<(), Refusal> {
    // An ok reply's detail is the number of ids that follow (earlier versions sent 0 and one
    // id, which a rank reads alike).
    let count = wire_u32(serve.ids.len(), "id count").map_err(Refusal::silent)?;
    let mut reply = Vec::with_capacity(REPLY_HEADER_LEN + serve.ids.len() * UNIQUE_ID_BYTES);
    reply.extend_from_slice(&ReplyHeader::encode(Status::Ok, count));
    for id in &serve.ids {
        reply.extend_from_slice(id.as_bytes());
    }
    write_full(stream, &reply, deadline)
        .map_err(|e| Refusal::silent(io_error("sending the unique ids", e)))?;
    let mut ack = [0u8; ACK_LEN];
    read_full(stream, &mut ack, deadline)
        .map_err(|short| Refusal::silent(ack_short(short, serve, rank, ACK_LEN)))?;
    let expected = Ack {
        rank: request_rank(rank),
        fingerprint: ids::fingerprint(&serve.ids),
    };
    if Ack::decode(&ack) != Some(expected) {
        return Err(Refusal::silent(BootstrapError::Protocol(
            "invalid acknowledgement (wrong magic, kind, rank or id fingerprint)".to_owned(),
        )));
    }
    Ok(())
}

// Version 3's steps.

/// Reads the opening (in stages like version 1's request, so that garbage, another version or
/// a peer without the key is answered at once) and answers it with a fresh challenge.
fn challenge(
    serve: &Serve,
    stream: &TcpStream,
    deadline: Instant,
) -> Result<[u8; CHALLENGE_LEN], Refusal> {
    let timeout = serve.request_timeout();
    let mut bytes = [0u8; CLEAR_PREFIX_LEN];
    let what = "opening";
    read_prefix(stream, &mut bytes, deadline, timeout, what, KEYED_VERSION)?;
    read_part(
        stream,
        &mut bytes,
        PREFIX_LEN..CLEAR_PREFIX_LEN,
        deadline,
        timeout,
        what,
    )?;
    let kind = kind_of(&bytes);
    if kind != KIND_OPEN {
        return Err(Refusal::new(
            BootstrapError::Protocol(format!(
                "expected an opening (kind {KIND_OPEN}), got message kind {kind}"
            )),
            Status::Malformed,
            0,
        ));
    }
    let challenge = new_challenge().map_err(Refusal::silent)?;
    write_full(stream, &challenge_frame(&challenge), deadline)
        .map_err(|e| Refusal::silent(io_error("sending the challenge", e)))?;
    Ok(challenge)
}

/// Reads and decrypts the hello bound to `challenge`, in stages like the opening.
fn read_hello(
    serve: &Serve,
    keyed: &Keyed,
    challenge: &[u8; CHALLENGE_LEN],
    stream: &TcpStream,
    deadline: Instant,
) -> Result<(KeyedRequest, HandshakeState), Refusal> {
    let timeout = serve.request_timeout();
    let mut bytes = [0u8; HELLO_LEN];
    let read = |bytes: &mut [u8; HELLO_LEN], range| {
        read_part(stream, bytes, range, deadline, timeout, "hello")
    };
    read_prefix(
        stream,
        &mut bytes,
        deadline,
        timeout,
        "hello",
        KEYED_VERSION,
    )?;
    read(&mut bytes, PREFIX_LEN..HELLO_LEN)?;
    let kind = get_u16(&bytes, 6);
    if kind != KIND_HELLO {
        return Err(Refusal::new(
            BootstrapError::Protocol(format!("expected a hello, got message kind {kind}")),
            Status::Malformed,
            0,
        ));
    }
    let mut handshake = responder(&keyed.key, challenge).map_err(Refusal::silent)?;
    let mut payload = [0u8; REQUEST_PAYLOAD_LEN];
    let opened = handshake.read_message(&bytes[CLEAR_PREFIX_LEN..], &mut payload);
    if opened.is_err() {
        let error = BootstrapError::Authentication {
            detail: "the peer's hello did not decrypt under rank 0's key and this connection's \
                     challenge: its rendezvous key differs, or the hello was replayed from \
                     another connection or altered"
                .to_owned(),
        };
        return Err(Refusal::new(error, Status::AuthFailed, 0));
    }
    let Some(request) = KeyedRequest::decode(&payload) else {
        let error = BootstrapError::Protocol(
            "the peer's hello decrypted but holds no version 3 request".to_owned(),
        );
        return Err(Refusal::new(error, Status::Malformed, 0).sealed(&mut handshake));
    };
    Ok((request, handshake))
}

/// Checks a decrypted request: the exact job key first, then its place as version 1 does.
fn check_keyed_request(
    serve: &Serve,
    keyed: &Keyed,
    request: &KeyedRequest,
) -> Result<usize, Refusal> {
    if request.job_digest != keyed.job_digest {
        let detail = "the peer's job key differs from rank 0's (their digests differ)";
        return Err(Refusal::wrong_job(detail.to_owned(), request.place));
    }
    check_place(serve, request.place)
}

/// Sends the id sealed to the rank that claimed `rank` and waits for its encrypted ack.
fn deliver_keyed(
    serve: &Serve,
    stream: &TcpStream,
    deadline: Instant,
    rank: usize,
    mut handshake: HandshakeState,
) -> Result<(), Refusal> {
    let count = wire_u32(serve.ids.len(), "id count").map_err(Refusal::silent)?;
    let reply =
        seal_reply(&mut handshake, Status::Ok, count, &serve.ids).map_err(Refusal::silent)?;
    write_full(stream, &reply, deadline)
        .map_err(|e| Refusal::silent(io_error("sending the sealed unique id", e)))?;
    let mut transport = handshake
        .into_transport_mode()
        .map_err(|e| Refusal::silent(noise_error("finishing the handshake", e)))?;
    let mut frame = [0u8; ACK_FRAME_LEN];
    read_full(stream, &mut frame, deadline)
        .map_err(|short| Refusal::silent(ack_short(short, serve, rank, ACK_FRAME_LEN)))?;
    let prefix_ok = frame[0..4] == MAGIC
        && version_of(&frame) == KEYED_VERSION
        && get_u16(&frame, 6) == KIND_ACK;
    let mut ack = [0u8; ACK_LEN];
    let opened = transport.read_message(&frame[CLEAR_PREFIX_LEN..], &mut ack);
    if !prefix_ok || opened.is_err() {
        return Err(Refusal::silent(BootstrapError::Authentication {
            detail: "the acknowledgement did not decrypt under this session's keys: it was \
                     taken from another session, forged or altered"
                .to_owned(),
        }));
    }
    let expected = Ack {
        rank: u32::try_from(rank).unwrap_or(u32::MAX),
        fingerprint: ids::fingerprint(&serve.ids),
    };
    if Ack::decode_as(&ack, KEYED_VERSION) != Some(expected) {
        return Err(Refusal::silent(BootstrapError::Protocol(
            "invalid acknowledgement (wrong kind, rank or id fingerprint)".to_owned(),
        )));
    }
    Ok(())
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
