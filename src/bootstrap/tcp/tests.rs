//! Unit tests of the TCP rendezvous: raw bytes against rank 0, rounds, floods.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use super::wire::Status;
use super::wire::{
    Ack, ACK_LEN, KIND_ACK, KIND_REQUEST, MAGIC, REPLY_HEADER_LEN, REQUEST_LEN, VERSION,
};
use super::{TcpRendezvous, TcpServer};
use crate::bootstrap::bytes::{get_u16, job_key_hash};
use crate::bootstrap::history::History;
use crate::bootstrap::ids::fingerprint;
use crate::bootstrap::util::Interrupt;
use crate::bootstrap::BootstrapError;
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

fn sample_id(seed: u8) -> UniqueId {
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    UniqueId::from_bytes(bytes)
}

/// A rank 0 bound to a free port, with its own history: each test's exchange count starts
/// at 0 whatever other tests run in this process.
fn server(world_size: usize, timeout: Duration, key: &str) -> TcpServer {
    server_with(world_size, timeout, key, Arc::default())
}

fn server_with(
    world_size: usize,
    timeout: Duration,
    key: &str,
    history: Arc<History>,
) -> TcpServer {
    TcpRendezvous::new("127.0.0.1:0", 0, world_size)
        .with_job_key(key)
        .with_timeout(timeout)
        .with_connection_timeout(Duration::from_millis(500))
        .with_history(history)
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
    Some(get_u16(&header, 8))
}

/// Takes the id as `rank` over raw bytes, stopping before the ack.
fn take_id(addr: SocketAddr, job: &str, world: u32, rank: u32) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .write_all(&request(job, world, rank, VERSION))
        .expect("write");
    let mut reply = [0u8; REPLY_HEADER_LEN + UNIQUE_ID_BYTES];
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    stream.read_exact(&mut reply).expect("reply");
    assert_eq!(get_u16(&reply, 8), Status::Ok as u16);
    stream
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
    // Rank 0 and rank 1 each keep their own history, as two processes would.
    let key = "rounds";
    let (rank0, rank1) = (Arc::new(History::default()), Arc::new(History::default()));
    let first = server_with(2, Duration::from_secs(10), key, Arc::clone(&rank0));
    let addr = first.local_addr();
    let serving = thread::spawn(move || first.serve(sample_id(1)));
    let client = TcpRendezvous::new(addr.to_string(), 1, 2)
        .with_job_key(key)
        .with_timeout(Duration::from_secs(5))
        .with_history(Arc::clone(&rank1));
    assert_eq!(client.fetch().expect("round 0"), sample_id(1));
    serving.join().expect("join").expect("serve");

    let second = server_with(2, Duration::from_secs(10), key, rank0);
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
        .with_timeout(Duration::from_secs(5))
        .with_history(rank1);
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
    let mut stream = take_id(addr, "bad-ack", 2, 1);
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
    let client = TcpRendezvous::new(addr.to_string(), 1, 2).with_timeout(Duration::from_secs(3));
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
    assert_eq!(get_u16(&header, 8), Status::Busy as u16);
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

/// A job failure that the test raises by hand: the returned flags are "raise it" and "rank 0's
/// accept loop has seen it".
fn interruptible(server: &mut TcpServer) -> (Arc<AtomicBool>, Arc<AtomicBool>) {
    let raised = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(AtomicBool::new(false));
    let (raise, see) = (Arc::clone(&raised), Arc::clone(&seen));
    server.interrupt = Some(Interrupt::new(move || {
        if !raise.load(Ordering::SeqCst) {
            return None;
        }
        see.store(true, Ordering::SeqCst);
        Some(BootstrapError::Config("a rank died".to_owned()))
    }));
    (raised, seen)
}

/// Raises the failure and waits until rank 0's accept loop has seen it.
fn raise_and_wait(raised: &AtomicBool, seen: &AtomicBool) {
    raised.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !seen.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the accept loop never asked");
        thread::sleep(Duration::from_millis(1));
    }
}

/// The interleaving a loaded machine makes: the last rank acknowledges and dies, and the
/// supervisor reports its death before rank 0's connection thread has counted the ack. Here
/// the ack is sent only once the accept loop has seen the failure, which forces that order:
/// the rank held the id when the failure came, so its conversation is seen out, and the serve
/// that every rank completed succeeds.
#[test]
fn an_interrupt_sees_out_a_rank_between_reply_and_ack() {
    let mut server = server(2, Duration::from_secs(10), "interrupted-ack");
    let (raised, seen) = interruptible(&mut server);
    let addr = server.local_addr();
    let id = sample_id(21);
    let serving = thread::spawn(move || server.serve(id));
    let mut stream = take_id(addr, "interrupted-ack", 2, 1);
    raise_and_wait(&raised, &seen);
    let ack = Ack {
        rank: 1,
        fingerprint: fingerprint(&[id]),
    };
    let _ = stream.write_all(&ack.encode());
    let report = serving.join().expect("join");
    assert!(report.is_ok(), "{report:?}");
}

/// A rank that held the id but died before acknowledging, and a rank that never came: the
/// serve ends with the interrupt's error as soon as the first one's connection closes, not at
/// the timeout.
#[test]
fn an_interrupt_ends_the_serve_when_a_rank_cannot_come() {
    let mut server = server(3, Duration::from_secs(30), "interrupted");
    let (raised, seen) = interruptible(&mut server);
    let addr = server.local_addr();
    let started = Instant::now();
    let serving = thread::spawn(move || server.serve(sample_id(22)));
    let stream = take_id(addr, "interrupted", 3, 1);
    raise_and_wait(&raised, &seen);
    drop(stream);
    let error = serving.join().expect("join").unwrap_err();
    assert!(
        matches!(&error, BootstrapError::Config(text) if text == "a rank died"),
        "{error}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}
