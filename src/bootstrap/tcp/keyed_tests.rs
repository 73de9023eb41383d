//! Unit tests of the encrypted rendezvous (protocol version 3): the attacks a peer on the
//! network can try, each answered with a typed error while good ranks still get the id.
//! Past 600 lines: every test drives raw protocol bytes through the same few helpers (the
//! opening, a recorded session, fake rank 0s), which would be repeated if split.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::key::{job_digest, RendezvousKey};
use super::keyed::{
    self, KeyedRequest, ACK_FRAME_LEN, CHALLENGE_FRAME_LEN, CHALLENGE_LEN, CLEAR_PREFIX_LEN,
    HELLO_LEN,
};
use super::wire::{
    Ack, Place, ReplyHeader, Status, EARLIER_KEYED_VERSION, KEYED_VERSION, KIND_CHALLENGE,
    KIND_REPLY, KIND_SEALED_REPLY, MAGIC, REPLY_HEADER_LEN, VERSION,
};
use super::{ServeReport, TcpRendezvous};
use crate::bootstrap::bytes::get_u16;
use crate::bootstrap::history::History;
use crate::bootstrap::{BootstrapError, Result};
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

const HEX_A: &str = "6b1f0c2e9a8d7c6b5a4f3e2d1c0b0a09f8e7d6c5b4a392817161514131211100";
const HEX_B: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

fn key(hex: &str) -> RendezvousKey {
    RendezvousKey::from_hex(hex).expect("key")
}

fn sample_id(seed: u8) -> UniqueId {
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(29).wrapping_add(seed);
    }
    UniqueId::from_bytes(bytes)
}

/// Rank 0 of `world` with `secret` (or none), serving `id` on a thread, with its own history.
fn serve(
    world: usize,
    job: &str,
    secret: Option<&str>,
    id: UniqueId,
) -> (SocketAddr, JoinHandle<Result<ServeReport>>) {
    serve_for(world, job, secret, id, Duration::from_millis(500))
}

/// [`serve`] with the connection timeout given.
fn serve_for(
    world: usize,
    job: &str,
    secret: Option<&str>,
    id: UniqueId,
    connection_timeout: Duration,
) -> (SocketAddr, JoinHandle<Result<ServeReport>>) {
    let mut rendezvous = TcpRendezvous::new("127.0.0.1:0", 0, world)
        .with_job_key(job)
        .with_timeout(Duration::from_secs(10))
        .with_connection_timeout(connection_timeout)
        .with_history(Arc::default());
    if let Some(hex) = secret {
        rendezvous = rendezvous.with_secret(key(hex));
    }
    let server = rendezvous.bind().expect("bind");
    let addr = server.local_addr();
    (addr, thread::spawn(move || server.serve(id)))
}

/// A joining rank of `world` at `addr`, with `secret` (or none), with its own history.
fn client(
    addr: SocketAddr,
    rank: usize,
    world: usize,
    job: &str,
    secret: Option<&str>,
) -> TcpRendezvous {
    let rendezvous = TcpRendezvous::new(addr.to_string(), rank, world)
        .with_job_key(job)
        .with_timeout(Duration::from_secs(3))
        .with_connection_timeout(Duration::from_millis(500))
        .with_history(Arc::new(History::default()));
    match secret {
        Some(hex) => rendezvous.with_secret(key(hex)),
        None => rendezvous,
    }
}

fn count(report: &ServeReport, pred: impl Fn(&BootstrapError) -> bool) -> usize {
    report.rejected.iter().filter(|r| pred(&r.error)).count()
}

fn is_auth(error: &BootstrapError) -> bool {
    matches!(error, BootstrapError::Authentication { .. })
}

fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    stream
}

/// Reads one reply header and what it announces: the sealed Noise message, if any.
fn read_reply(stream: &mut TcpStream) -> Option<(ReplyHeader, Vec<u8>)> {
    let mut header = [0u8; REPLY_HEADER_LEN];
    stream.read_exact(&mut header).ok()?;
    assert_eq!(header[0..4], MAGIC);
    let header = ReplyHeader::decode(&header);
    let mut sealed = vec![0u8; 0];
    if header.kind == KIND_SEALED_REPLY {
        sealed.resize(header.detail as usize, 0);
        stream.read_exact(&mut sealed).ok()?;
    }
    Some((header, sealed))
}

/// Sends `bytes` (then closes the sending half when asked) and returns the clear reply
/// status, if a whole header came back.
fn raw_status(addr: SocketAddr, bytes: &[u8], close_write: bool) -> Option<u16> {
    let mut stream = connect(addr);
    stream.write_all(bytes).expect("write");
    if close_write {
        stream.shutdown(Shutdown::Write).expect("shutdown");
    }
    read_reply(&mut stream).map(|(header, _)| header.status)
}

/// Opens a connection as a version 3 rank does: the opening, then rank 0's challenge.
fn open(addr: SocketAddr) -> (TcpStream, [u8; CHALLENGE_LEN]) {
    let mut stream = connect(addr);
    stream.write_all(&keyed::opening()).expect("opening");
    let mut frame = [0u8; CHALLENGE_FRAME_LEN];
    stream.read_exact(&mut frame).expect("challenge");
    let header = ReplyHeader::decode(frame[..REPLY_HEADER_LEN].try_into().expect("header"));
    assert_eq!(
        (header.version, header.kind),
        (KEYED_VERSION, KIND_CHALLENGE)
    );
    let mut challenge = [0u8; CHALLENGE_LEN];
    challenge.copy_from_slice(&frame[REPLY_HEADER_LEN..]);
    (stream, challenge)
}

/// Like [`raw_status`], after the opening and the challenge: `bytes` is made for the
/// challenge rank 0 sent.
fn status_after_challenge(
    addr: SocketAddr,
    bytes: impl FnOnce(&[u8; CHALLENGE_LEN]) -> Vec<u8>,
    close_write: bool,
) -> Option<u16> {
    let (mut stream, challenge) = open(addr);
    stream.write_all(&bytes(&challenge)).expect("write");
    if close_write {
        stream.shutdown(Shutdown::Write).expect("shutdown");
    }
    read_reply(&mut stream).map(|(header, _)| header.status)
}

/// A version 3 request for `rank` of `world` in `job`, round 0, one id.
fn request(job: &str, world: u32, rank: u32) -> KeyedRequest {
    KeyedRequest {
        job_digest: job_digest(job).expect("digest"),
        place: Place {
            world_size: world,
            rank,
            round: 0,
            ids_wanted: 0,
        },
    }
}

/// A hello for `request` with `hex`'s key, bound to `challenge`.
fn hello_for(
    hex: &str,
    challenge: &[u8; CHALLENGE_LEN],
    request: &KeyedRequest,
) -> [u8; HELLO_LEN] {
    let mut handshake = keyed::initiator(&key(hex), challenge).expect("initiator");
    keyed::hello(&mut handshake, request).expect("hello")
}

/// A fake rank 0's side of the opening: reads it and answers with a challenge of its own.
fn fake_challenge(stream: &mut TcpStream) -> [u8; CHALLENGE_LEN] {
    let mut opening = [0u8; CLEAR_PREFIX_LEN];
    stream.read_exact(&mut opening).expect("opening");
    assert_eq!(opening, keyed::opening());
    let challenge = keyed::new_challenge().expect("challenge");
    stream
        .write_all(&keyed::challenge_frame(&challenge))
        .expect("challenge");
    challenge
}

/// What a network recorder sees of one rank's session: the hello, rank 0's reply (header and
/// sealed message), and the ack.
struct Recorded {
    hello: [u8; HELLO_LEN],
    reply: Vec<u8>,
    ack: [u8; ACK_FRAME_LEN],
}

/// Runs one genuine version 3 session for `rank` by hand, recording its bytes.
fn genuine_session(addr: SocketAddr, hex: &str, job: &str, world: u32, rank: u32) -> Recorded {
    let key = key(hex);
    let (mut stream, challenge) = open(addr);
    let mut handshake = keyed::initiator(&key, &challenge).expect("initiator");
    let request = request(job, world, rank);
    let hello = keyed::hello(&mut handshake, &request).expect("hello");
    stream.write_all(&hello).expect("hello");
    let (header, sealed) = read_reply(&mut stream).expect("reply");
    assert_eq!(header.kind, KIND_SEALED_REPLY);
    let (inner, id) = keyed::open_reply(&mut handshake, &sealed).expect("open");
    assert_eq!(inner.status, Status::Ok as u16);
    assert_eq!(id.len(), 1, "one id, as version 1 of the id count");
    let id = id[0];
    let mut transport = handshake.into_transport_mode().expect("transport");
    let ack = Ack {
        rank,
        fingerprint: id.fingerprint(),
    };
    let ack = keyed::ack_frame(&mut transport, &ack).expect("ack");
    stream.write_all(&ack).expect("ack");
    let mut reply =
        ReplyHeader::encode_as(KEYED_VERSION, KIND_SEALED_REPLY, Status::Ok, 0).to_vec();
    reply.extend_from_slice(&sealed);
    // Rank 0 closes once it has counted the ack.
    let _ = stream.read_to_end(&mut Vec::new());
    Recorded { hello, reply, ack }
}

#[test]
fn keyed_ranks_fetch_the_id_and_it_never_travels_in_clear() {
    let id = sample_id(1);
    let (addr, serving) = serve(4, "job", Some(HEX_A), id);
    let fetched: Vec<UniqueId> = (1..4)
        .map(|rank| thread::spawn(move || client(addr, rank, 4, "job", Some(HEX_A)).fetch()))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().expect("join").expect("fetch"))
        .collect();
    assert_eq!(fetched, vec![id; 3]);
    let report = serving.join().expect("join").expect("serve");
    assert!(report.rejected.is_empty(), "{:?}", report.rejected);

    // What a recorder sees of a session holds no run of the id's bytes.
    let (addr, serving) = serve(2, "job", Some(HEX_A), id);
    let recorded = genuine_session(addr, HEX_A, "job", 2, 1);
    serving.join().expect("join").expect("serve");
    let wire = [&recorded.hello[..], &recorded.reply, &recorded.ack].concat();
    assert!(!wire
        .windows(8)
        .any(|w| id.as_bytes().windows(8).any(|i| i == w)));
}

#[test]
fn keyed_wrong_key_is_refused_on_both_sides() {
    let id = sample_id(2);
    let (addr, serving) = serve(2, "job", Some(HEX_A), id);
    let err = client(addr, 1, 2, "job", Some(HEX_B)).fetch().unwrap_err();
    assert!(is_auth(&err), "{err}");
    assert!(err.to_string().contains("keys differ"), "{err}");
    assert_eq!(
        client(addr, 1, 2, "job", Some(HEX_A))
            .fetch()
            .expect("fetch"),
        id
    );
    let report = serving.join().expect("join").expect("serve");
    assert_eq!(report.rejected.len(), 1, "{:?}", report.rejected);
    assert_eq!(count(&report, is_auth), 1);

    // A rank 0 with another key cannot hand a keyed rank an id either: its reply would not
    // decrypt, and the rank refuses it (here rank 0 is faked with the wrong key by hand).
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let fake_addr = listener.local_addr().expect("addr");
    let fake = thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let challenge = fake_challenge(&mut stream);
        let mut hello = [0u8; HELLO_LEN];
        stream.read_exact(&mut hello).expect("hello");
        // Answer as a rank 0 holding key B: its handshake cannot read A's hello, so it
        // starts its own and sends a reply sealed under B.
        let wrong = key(HEX_B);
        let mut other = keyed::initiator(&wrong, &challenge).expect("initiator");
        let forged_hello = keyed::hello(&mut other, &request("x", 2, 1)).expect("hello");
        let mut responder_side = keyed::responder(&wrong, &challenge).expect("responder");
        let mut payload = [0u8; 64];
        responder_side
            .read_message(&forged_hello[8..], &mut payload)
            .expect("read");
        let reply =
            keyed::seal_reply(&mut responder_side, Status::Ok, 0, &[sample_id(99)]).expect("seal");
        let _ = stream.write_all(&reply);
        let _ = stream.read_to_end(&mut Vec::new());
    });
    let err = client(fake_addr, 1, 2, "job", Some(HEX_A))
        .fetch()
        .unwrap_err();
    assert!(is_auth(&err), "{err}");
    fake.join().expect("join");
}

#[test]
fn keyed_and_unkeyed_sides_name_the_mismatch() {
    // A rank without a key against a rank 0 with one.
    let id = sample_id(3);
    let (addr, serving) = serve(2, "job", Some(HEX_A), id);
    let err = client(addr, 1, 2, "job", None).fetch().unwrap_err();
    assert!(is_auth(&err), "{err}");
    assert!(err.to_string().contains("has none"), "{err}");
    assert_eq!(
        client(addr, 1, 2, "job", Some(HEX_A))
            .fetch()
            .expect("fetch"),
        id
    );
    let report = serving.join().expect("join").expect("serve");
    assert_eq!(count(&report, is_auth), 1, "{:?}", report.rejected);
    assert!(report.rejected[0].error.to_string().contains("unencrypted"));

    // A rank with a key against a rank 0 without one: the version 1 reply is unchanged, and
    // both sides say which side lacks the key.
    let (addr, serving) = serve(2, "job", None, id);
    let err = client(addr, 1, 2, "job", Some(HEX_A)).fetch().unwrap_err();
    assert!(is_auth(&err), "{err}");
    assert!(err.to_string().contains("unencrypted"), "{err}");
    assert_eq!(client(addr, 1, 2, "job", None).fetch().expect("fetch"), id);
    let report = serving.join().expect("join").expect("serve");
    assert_eq!(count(&report, is_auth), 1, "{:?}", report.rejected);
    assert!(report.rejected[0]
        .error
        .to_string()
        .contains("this rank 0 has none"));
}

#[test]
fn keyed_replayed_sessions_are_refused_and_hold_no_rank() {
    let (job, id) = ("replay", sample_id(4));
    // Connections get 5 s here: a replay that held rank 1 until its connection timed out (as
    // version 2's did) would keep the real rank 1 waiting that long.
    let patience = Duration::from_secs(5);
    // Record a genuine session of rank 1 against a world of 3 (rank 0 keeps serving rank 2).
    let (addr, serving) = serve_for(3, job, Some(HEX_A), id, patience);
    let recorded = genuine_session(addr, HEX_A, job, 3, 1);
    assert!(recorded.reply.len() > REPLY_HEADER_LEN);

    // Replayed to the same rank 0 on a new connection: the hello was bound to the recorded
    // connection's challenge, so it does not decrypt under this one's, and is refused in
    // clear before any check of the rank.
    let replay = |addr| status_after_challenge(addr, |_| recorded.hello.to_vec(), false);
    assert_eq!(replay(addr), Some(Status::AuthFailed as u16));
    assert_eq!(
        client(addr, 2, 3, job, Some(HEX_A)).fetch().expect("fetch"),
        id
    );
    let report = serving.join().expect("join").expect("serve");
    assert_eq!(report.rejected.len(), 1, "{:?}", report.rejected);
    assert!(is_auth(&report.rejected[0].error), "{:?}", report.rejected);
    assert_eq!(report.rejected[0].rank, None, "no rank was claimed");

    // Replayed whole (hello and ack) to a new rank 0 with the same key and job, before the
    // real rank 1 comes, and the connection kept open: refused at the hello, it claims
    // nothing, and the real rank 1 is served at once, not after a connection timeout.
    let (addr, serving) = serve_for(3, job, Some(HEX_A), id, patience);
    let (mut held, _) = open(addr);
    held.write_all(&recorded.hello).expect("hello");
    let _ = held.write_all(&recorded.ack);
    let (header, sealed) = read_reply(&mut held).expect("reply");
    assert_eq!(
        (header.kind, header.status, sealed.len()),
        (KIND_REPLY, Status::AuthFailed as u16, 0)
    );
    let started = Instant::now();
    for rank in [1, 2] {
        let fetched = client(addr, rank, 3, job, Some(HEX_A)).fetch();
        assert_eq!(fetched.expect("fetch"), id);
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the real ranks waited {:?}",
        started.elapsed()
    );
    let report = serving.join().expect("join").expect("serve");
    assert_eq!(report.rejected.len(), 1, "{:?}", report.rejected);
    assert!(is_auth(&report.rejected[0].error), "{:?}", report.rejected);
    assert!(
        report.rejected[0].error.to_string().contains("replayed"),
        "{}",
        report.rejected[0].error
    );
    drop(held);
}

/// Peers that connect and say nothing, as many as rank 0 has handlers (some after the opening):
/// they are dropped at the request deadline, 2 s, so a real rank, turned away as busy
/// meanwhile, gets the id soon after, long before the connection timeout.
#[test]
fn keyed_silent_connections_are_dropped_at_the_request_deadline() {
    let (job, id) = ("silent", sample_id(8));
    let (addr, serving) = serve_for(2, job, Some(HEX_A), id, Duration::from_secs(30));
    // A world of 2 gets 16 handlers.
    let mut silent: Vec<TcpStream> = (0..12).map(|_| connect(addr)).collect();
    silent.extend((0..4).map(|_| open(addr).0));
    thread::sleep(Duration::from_millis(100));
    let mut extra = connect(addr);
    let mut header = [0u8; REPLY_HEADER_LEN];
    extra.read_exact(&mut header).expect("busy reply");
    assert_eq!(get_u16(&header, 8), Status::Busy as u16);
    let started = Instant::now();
    assert_eq!(
        client(addr, 1, 2, job, Some(HEX_A))
            .with_timeout(Duration::from_secs(20))
            .fetch()
            .expect("fetch"),
        id
    );
    let waited = started.elapsed();
    assert!(
        waited < super::REQUEST_TIMEOUT + Duration::from_secs(2),
        "the real rank waited {waited:?}"
    );
    let report = serving.join().expect("join").expect("serve");
    let timeouts = count(&report, |e| matches!(e, BootstrapError::Timeout { .. }));
    assert_eq!(timeouts, 16, "{:?}", report.rejected);
    for mut stream in silent {
        let mut reply = Vec::new();
        let _ = stream.read_to_end(&mut reply);
        assert!(reply.ends_with(&ReplyHeader::encode_as(
            KEYED_VERSION,
            KIND_REPLY,
            Status::TimedOut,
            0
        )));
    }
}

#[test]
fn keyed_truncated_or_altered_messages_are_refused() {
    let (job, id) = ("cut", sample_id(5));
    let (addr, serving) = serve(2, job, Some(HEX_A), id);
    let request = request(job, 2, 1);

    // Half an opening, then the peer stops sending.
    assert_eq!(
        raw_status(addr, &keyed::opening()[..5], true),
        Some(Status::Malformed as u16)
    );
    // Half a hello, then the peer stops sending.
    let half = |challenge: &_| hello_for(HEX_A, challenge, &request)[..HELLO_LEN / 2].to_vec();
    assert_eq!(
        status_after_challenge(addr, half, true),
        Some(Status::Malformed as u16)
    );
    // One bit flipped in the encrypted request (say, to change the rank).
    let altered = |challenge: &_| {
        let mut hello = hello_for(HEX_A, challenge, &request);
        hello[HELLO_LEN - 30] ^= 1;
        hello.to_vec()
    };
    assert_eq!(
        status_after_challenge(addr, altered, false),
        Some(Status::AuthFailed as u16)
    );
    // A whole hello, then half an ack: the rank is released again.
    let (mut stream, challenge) = open(addr);
    let mut handshake = keyed::initiator(&key(HEX_A), &challenge).expect("init");
    let hello = keyed::hello(&mut handshake, &request).expect("hello");
    stream.write_all(&hello).expect("hello");
    let (_, sealed) = read_reply(&mut stream).expect("reply");
    let (_, got) = keyed::open_reply(&mut handshake, &sealed).expect("open");
    assert_eq!(got, [id]);
    let mut transport = handshake.into_transport_mode().expect("transport");
    let ack = Ack {
        rank: 1,
        fingerprint: id.fingerprint(),
    };
    let frame = keyed::ack_frame(&mut transport, &ack).expect("ack");
    stream.write_all(&frame[..ACK_FRAME_LEN - 5]).expect("ack");
    stream.shutdown(Shutdown::Write).expect("shutdown");
    let _ = stream.read_to_end(&mut Vec::new());

    assert_eq!(
        client(addr, 1, 2, job, Some(HEX_A)).fetch().expect("fetch"),
        id
    );
    let report = serving.join().expect("join").expect("serve");
    assert_eq!(report.rejected.len(), 4, "{:?}", report.rejected);
    let texts: Vec<String> = report
        .rejected
        .iter()
        .map(|r| r.error.to_string())
        .collect();
    for what in [
        "truncated opening",
        "truncated hello",
        "acknowledgement bytes",
    ] {
        assert!(texts.iter().any(|t| t.contains(what)), "{what}: {texts:?}");
    }
    assert_eq!(count(&report, is_auth), 1, "{texts:?}");

    // A rank 0 (fake) whose sealed reply is cut short: the rank fails with a protocol error.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let fake_addr = listener.local_addr().expect("addr");
    let fake = thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        fake_challenge(&mut stream);
        let mut hello = [0u8; HELLO_LEN];
        stream.read_exact(&mut hello).expect("hello");
        let header = ReplyHeader::encode_as(
            KEYED_VERSION,
            KIND_SEALED_REPLY,
            Status::Ok,
            keyed::SEALED_ID_LEN as u32,
        );
        let _ = stream.write_all(&header);
        let _ = stream.write_all(&[7u8; 40]);
    });
    let err = client(fake_addr, 1, 2, job, Some(HEX_A))
        .fetch()
        .unwrap_err();
    assert!(matches!(err, BootstrapError::Protocol(_)), "{err}");
    assert!(err.to_string().contains("truncated sealed reply"), "{err}");
    fake.join().expect("join");
}

#[test]
fn keyed_garbage_gets_clear_refusals_and_good_ranks_still_get_through() {
    let (job, id) = ("garbage", sample_id(6));
    let (addr, serving) = serve(2, job, Some(HEX_A), id);
    // Bytes from a small generator, an HTTP request, a version 1 request, an unknown
    // version, and a peer that never speaks.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let random: Vec<u8> = (0..HELLO_LEN)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    assert_eq!(
        raw_status(addr, &random, false),
        Some(Status::BadMagic as u16)
    );
    assert_eq!(
        raw_status(addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", false),
        Some(Status::BadMagic as u16)
    );
    let mut v1 = [0u8; 32];
    super::wire::put_prefix(&mut v1, VERSION, super::wire::KIND_REQUEST);
    assert_eq!(
        raw_status(addr, &v1, false),
        Some(Status::UnsupportedVersion as u16)
    );
    let mut v9 = [0u8; HELLO_LEN];
    super::wire::put_prefix(&mut v9, 9, super::wire::KIND_HELLO);
    assert_eq!(
        raw_status(addr, &v9, false),
        Some(Status::UnsupportedVersion as u16)
    );
    // A hello of an earlier build (version 2, no challenge), and a version 3 hello sent
    // without waiting for the challenge.
    let mut v2 = hello_for(HEX_A, &[0; CHALLENGE_LEN], &request(job, 2, 1));
    super::wire::put_prefix(&mut v2, EARLIER_KEYED_VERSION, super::wire::KIND_HELLO);
    assert_eq!(
        raw_status(addr, &v2, false),
        Some(Status::UnsupportedVersion as u16)
    );
    let unasked = hello_for(HEX_A, &[0; CHALLENGE_LEN], &request(job, 2, 1));
    assert_eq!(
        raw_status(addr, &unasked, false),
        Some(Status::Malformed as u16)
    );
    let silent = connect(addr);
    let mut header = [0u8; REPLY_HEADER_LEN];
    (&silent).read_exact(&mut header).expect("timed out reply");
    assert_eq!(get_u16(&header, 8), Status::TimedOut as u16);
    assert_eq!(get_u16(&header, 6), KIND_REPLY);

    assert_eq!(
        client(addr, 1, 2, job, Some(HEX_A)).fetch().expect("fetch"),
        id
    );
    let report = serving.join().expect("join").expect("serve");
    assert_eq!(report.rejected.len(), 7, "{:?}", report.rejected);
    assert_eq!(
        count(&report, |e| matches!(e, BootstrapError::Protocol(_))),
        3
    );
    assert_eq!(count(&report, is_auth), 1);
    for peer in [9, EARLIER_KEYED_VERSION] {
        let mismatch = |e: &BootstrapError| matches!(e, BootstrapError::VersionMismatch { local: 3, peer: p } if *p == peer);
        assert_eq!(count(&report, mismatch), 1, "{:?}", report.rejected);
    }
    assert_eq!(
        count(&report, |e| matches!(e, BootstrapError::Timeout { .. })),
        1
    );

    // And a rank with a key that reaches something else entirely.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let other = listener.local_addr().expect("addr");
    let fake = thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let _ = stream.read_exact(&mut [0u8; CLEAR_PREFIX_LEN]);
        let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
    });
    let err = client(other, 1, 2, job, Some(HEX_A)).fetch().unwrap_err();
    assert!(matches!(err, BootstrapError::Protocol(_)), "{err}");
    fake.join().expect("join");

    // And a rank 0 of an earlier build, which speaks the encrypted protocol as version 2: it
    // reads the prefix and answers with its unsupported-version reply.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let earlier = listener.local_addr().expect("addr");
    let fake = thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let _ = stream.read_exact(&mut [0u8; 6]);
        let version = u32::from(EARLIER_KEYED_VERSION);
        let reply = ReplyHeader::encode_as(
            EARLIER_KEYED_VERSION,
            KIND_REPLY,
            Status::UnsupportedVersion,
            version,
        );
        let _ = stream.write_all(&reply);
    });
    let err = client(earlier, 1, 2, job, Some(HEX_A)).fetch().unwrap_err();
    assert!(
        matches!(err, BootstrapError::VersionMismatch { local: 3, peer: 2 }),
        "{err}"
    );
    fake.join().expect("join");
}

#[test]
fn keyed_requests_are_bound_to_their_job_world_and_rank() {
    let id = sample_id(7);
    let (addr, serving) = serve(2, "job-a", Some(HEX_A), id);
    // Same key, another job or world size: the sealed refusal names it, on both sides.
    let err = client(addr, 1, 2, "job-b", Some(HEX_A))
        .fetch()
        .unwrap_err();
    assert!(matches!(err, BootstrapError::WrongJob { .. }), "{err}");
    let err = client(addr, 1, 3, "job-a", Some(HEX_A))
        .fetch()
        .unwrap_err();
    assert!(
        matches!(
            err,
            BootstrapError::WorldSizeMismatch {
                expected: 2,
                got: 3
            }
        ),
        "{err}"
    );
    let err = client(addr, 5, 6, "job-a", Some(HEX_A))
        .fetch()
        .unwrap_err();
    assert!(
        matches!(err, BootstrapError::WorldSizeMismatch { .. }),
        "{err}"
    );
    assert_eq!(
        client(addr, 1, 2, "job-a", Some(HEX_A))
            .fetch()
            .expect("fetch"),
        id
    );
    let report = serving.join().expect("join").expect("serve");
    assert_eq!(report.rejected.len(), 3, "{:?}", report.rejected);
    assert_eq!(
        count(&report, |e| matches!(e, BootstrapError::WrongJob { .. })),
        1
    );
}
