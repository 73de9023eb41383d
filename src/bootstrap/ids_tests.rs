//! Handing out several unique ids: every rank gets the same ids in the same order over TCP
//! (clear and keyed) and the file rendezvous; a rank that expects another count gets
//! [`BootstrapError::IdCountMismatch`]; peers of versions that hand out one id are told apart.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use super::tcp::RendezvousKey;
use super::util::random_u64;
use super::{BootstrapError, FileRendezvous, IdCount, Rendezvous, TcpRendezvous, Transport};
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

const KEY_HEX: &str = "8a1f0c2e9a8d7c6b5a4f3e2d1c0b0a09f8e7d6c5b4a392817161514131211177";

/// What an [`BootstrapError::IdCountMismatch`] says: (handed out, expected).
fn mismatched_counts(error: &BootstrapError) -> Option<(usize, usize)> {
    match *error {
        BootstrapError::IdCountMismatch {
            handed_out,
            expected,
        } => Some((handed_out, expected)),
        _ => None,
    }
}

#[test]
fn joining_ranks_accept_what_they_expect() {
    assert!(IdCount::Auto.accepts(5).is_ok());
    assert!(IdCount::Exactly(2).accepts(2).is_ok());
    let err = IdCount::Exactly(2).accepts(1).unwrap_err();
    assert_eq!(mismatched_counts(&err), Some((1, 2)), "{err}");
}

fn sample_ids(count: usize, seed: u8) -> Vec<UniqueId> {
    (0..count)
        .map(|n| {
            let mut bytes = [0u8; UNIQUE_ID_BYTES];
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(13) ^ seed ^ (n as u8).wrapping_mul(101);
            }
            UniqueId::from_bytes(bytes)
        })
        .collect()
}

/// A TCP rendezvous for `rank` of `world` at a free port (rank 0 binds it, and tells the
/// others through `addr`), clear or keyed.
fn tcp(addr: &str, rank: usize, world: usize, job: &str, keyed: bool) -> TcpRendezvous {
    let rendezvous = TcpRendezvous::new(addr, rank, world)
        .with_job_key(job)
        .with_timeout(Duration::from_secs(10))
        .with_connection_timeout(Duration::from_millis(500))
        .with_history(Arc::default());
    match keyed {
        true => rendezvous.with_secret(RendezvousKey::from_hex(KEY_HEX).expect("key")),
        false => rendezvous,
    }
}

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "nccl-rs-ids-{name}-{}-{:x}",
        std::process::id(),
        random_u64()
    ));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn file(dir: &std::path::Path, rank: usize, world: usize) -> FileRendezvous {
    FileRendezvous::new(dir, rank, world)
        .with_job_key("ids")
        .with_timeout(Duration::from_secs(10))
        .with_poll_interval(Duration::from_millis(5))
        .with_history(Arc::default())
}

/// Runs rank 0 handing out `ids` and ranks `1..world` fetching with `counts[rank - 1]`, each
/// on its own thread; returns every joining rank's result.
fn run<T: Transport>(
    host: Rendezvous<T>,
    joiners: Vec<Rendezvous<T>>,
    ids: Vec<UniqueId>,
) -> (
    super::Result<Vec<UniqueId>>,
    Vec<super::Result<Vec<UniqueId>>>,
) {
    let fetching: Vec<_> = joiners
        .into_iter()
        .map(|rendezvous| thread::spawn(move || rendezvous.fetch_ids()))
        .collect();
    let hosted = host.exchange_ids(Some(ids));
    let fetched = fetching
        .into_iter()
        .map(|handle| handle.join().expect("joining rank panicked"))
        .collect();
    (hosted, fetched)
}

/// Rank 0 of a TCP rendezvous on a free port: the listener is bound first so that the
/// joining ranks know the address.
fn tcp_job(
    world: usize,
    keyed: bool,
    counts: &[IdCount],
    job: &str,
) -> (TcpRendezvous, Vec<TcpRendezvous>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let host = tcp(&addr, 0, world, job, keyed).with_prebound(listener);
    let joiners = (1..world)
        .map(|rank| tcp(&addr, rank, world, job, keyed).with_id_count(counts[rank - 1]))
        .collect();
    (host, joiners)
}

#[test]
fn every_rank_gets_the_same_ids_in_order_over_tcp_clear_and_keyed() {
    for keyed in [false, true] {
        for (world, count) in [(2, 2), (3, 2), (4, 3)] {
            let ids = sample_ids(count, world as u8);
            // One rank takes whatever rank 0 hands out, the others ask for the exact count.
            let mut counts = vec![IdCount::Exactly(count); world - 1];
            counts[0] = IdCount::Auto;
            let (host, joiners) = tcp_job(world, keyed, &counts, &format!("ids-{keyed}-{world}"));
            let (hosted, fetched) = run(host, joiners, ids.clone());
            assert_eq!(hosted.expect("rank 0"), ids);
            for (rank, got) in fetched.into_iter().enumerate() {
                let got = got.unwrap_or_else(|e| panic!("rank {}: {e}", rank + 1));
                assert_eq!(got, ids, "keyed {keyed}, rank {} of {world}", rank + 1);
            }
        }
    }
}

#[test]
fn every_rank_gets_the_same_ids_in_order_through_a_file() {
    for (world, count) in [(2, 2), (3, 2), (3, 1)] {
        let dir = scratch_dir(&format!("ok-{world}-{count}"));
        let ids = sample_ids(count, 7);
        let joiners = (1..world)
            .map(|rank| file(&dir, rank, world).with_id_count(IdCount::Exactly(count)))
            .collect();
        let (hosted, fetched) = run(file(&dir, 0, world), joiners, ids.clone());
        assert_eq!(hosted.expect("rank 0"), ids);
        for got in fetched {
            assert_eq!(got.expect("joining rank"), ids);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_rank_expecting_another_count_gets_a_typed_error_over_tcp() {
    for keyed in [false, true] {
        // Rank 2 takes the two ids; rank 1 expects three.
        let counts = [IdCount::Exactly(3), IdCount::Auto];
        let (host, joiners) = tcp_job(3, keyed, &counts, &format!("wrong-{keyed}"));
        let host = host.with_timeout(Duration::from_millis(1500));
        let ids = sample_ids(2, 1);
        let (hosted, fetched) = run(host, joiners, ids.clone());
        let mut fetched = fetched.into_iter();
        let err = fetched.next().unwrap().unwrap_err();
        assert_eq!(
            mismatched_counts(&err),
            Some((2, 3)),
            "keyed {keyed}: {err}"
        );
        assert_eq!(fetched.next().unwrap().expect("rank 2"), ids);
        // Rank 0 waited for rank 1 in vain, and says so within its timeout.
        let err = hosted.unwrap_err();
        assert!(
            matches!(err, BootstrapError::Timeout { ref missing_ranks, .. } if missing_ranks == &[1]),
            "{err}"
        );
    }
}

#[test]
fn a_rank_expecting_another_count_gets_a_typed_error_from_a_file() {
    let dir = scratch_dir("wrong");
    let joiners = vec![file(&dir, 1, 2).with_id_count(IdCount::Exactly(1))];
    let host = file(&dir, 0, 2).with_timeout(Duration::from_millis(800));
    let (hosted, fetched) = run(host, joiners, sample_ids(2, 3));
    let err = fetched.into_iter().next().unwrap().unwrap_err();
    assert_eq!(mismatched_counts(&err), Some((2, 1)), "{err}");
    assert!(matches!(hosted, Err(BootstrapError::Timeout { .. })));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn single_id_calls_refuse_a_rank_0_with_several() {
    // `fetch` (one id) is what every earlier caller uses: it must not take two ids quietly.
    let (host, joiners) = tcp_job(2, false, &[IdCount::Auto], "single");
    let host = host.with_timeout(Duration::from_millis(1500));
    let joiner = joiners.into_iter().next().unwrap();
    let fetching = thread::spawn(move || joiner.fetch());
    let hosted = host.exchange_ids(Some(sample_ids(2, 9)));
    let err = fetching.join().unwrap().unwrap_err();
    assert_eq!(mismatched_counts(&err), Some((2, 1)), "{err}");
    assert!(hosted.is_err());
}

#[test]
fn a_request_of_an_earlier_version_asks_for_one_id_and_is_refused_with_a_status() {
    // The request layout of the versions before several ids: the last 8 bytes are zero.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let host = tcp(&addr.to_string(), 0, 2, "old", false)
        .with_prebound(listener)
        .with_timeout(Duration::from_millis(1500));
    let serving = thread::spawn(move || host.exchange_ids(Some(sample_ids(2, 4))));
    let mut request = Vec::new();
    request.extend_from_slice(b"NRSB");
    request.extend_from_slice(&1u16.to_be_bytes());
    request.extend_from_slice(&1u16.to_be_bytes());
    request.extend_from_slice(&super::bytes::job_key_hash("old").to_be_bytes());
    request.extend_from_slice(&2u32.to_be_bytes());
    request.extend_from_slice(&1u32.to_be_bytes());
    request.extend_from_slice(&[0u8; 8]);
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.write_all(&request).expect("request");
    let mut header = [0u8; 16];
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    stream.read_exact(&mut header).expect("reply header");
    // Status 13 (an earlier peer reports "unknown status 13", a protocol error), detail 2.
    assert_eq!(u16::from_be_bytes([header[8], header[9]]), 13);
    assert_eq!(
        u32::from_be_bytes([header[12], header[13], header[14], header[15]]),
        2
    );
    assert!(serving.join().unwrap().is_err());
}

#[test]
fn a_rank_0_of_an_earlier_version_is_caught_before_the_ack() {
    // Such a rank 0 ignores the count asked for and sends one id with detail 0.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let id = sample_ids(1, 5)[0];
    let old_rank0 = thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let mut request = [0u8; 32];
        stream.read_exact(&mut request).expect("request");
        let mut reply = Vec::new();
        reply.extend_from_slice(b"NRSB");
        reply.extend_from_slice(&1u16.to_be_bytes());
        reply.extend_from_slice(&2u16.to_be_bytes());
        reply.extend_from_slice(&[0u8; 8]);
        reply.extend_from_slice(id.as_bytes());
        stream.write_all(&reply).expect("reply");
        // No ack follows: the rank gave up.
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        rest.len()
    });
    let joiner = tcp(&addr, 1, 2, "older", false).with_id_count(IdCount::Exactly(2));
    let err = joiner.fetch_ids().unwrap_err();
    assert_eq!(mismatched_counts(&err), Some((1, 2)), "{err}");
    assert_eq!(old_rank0.join().unwrap(), 0, "nothing acknowledged");
    // On auto the same rank 0 is fine: one id.
}

#[test]
fn counts_are_checked_before_anything_is_sent() {
    let rendezvous = tcp("127.0.0.1:1", 1, 2, "x", false).with_id_count(IdCount::Exactly(3));
    let err = rendezvous.fetch_ids().unwrap_err().to_string();
    assert!(err.contains("3 unique ids for 2 ranks"), "{err}");
    let host = tcp("127.0.0.1:0", 0, 2, "x", false);
    let err = host.exchange_ids(Some(Vec::new())).unwrap_err().to_string();
    assert!(err.contains("0 unique ids"), "{err}");
    let host = host.with_id_count(IdCount::Exactly(2));
    let err = host
        .exchange_ids(Some(sample_ids(1, 0)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("given 1 unique ids"), "{err}");
}
