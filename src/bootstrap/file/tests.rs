//! Unit tests of the file rendezvous: stale files, repeated exchanges.

use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use super::fs::write_atomically;
use super::procfs;
use super::wire::IdRecord;
use super::FileRendezvous;
use crate::bootstrap::util::random_u64;
use crate::bootstrap::BootstrapError;
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "nccl-rs-file-unit-{name}-{}-{:x}",
        std::process::id(),
        random_u64()
    ));
    fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

fn sample_id(seed: u8) -> UniqueId {
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u8) ^ seed;
    }
    UniqueId::from_bytes(bytes)
}

#[test]
fn stat_lines_parse_even_with_odd_command_names() {
    let line = "1234 (we ird) name)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20";
    assert_eq!(procfs::parse_stat(line), Some(('S', 987654)));
    assert_eq!(procfs::parse_stat("garbage"), None);
    assert!(procfs::own_start_ticks() > 0 || !Path::new("/proc/self/stat").exists());
}

#[test]
fn file_of_a_dead_writer_is_ignored() {
    let dir = scratch_dir("dead");
    // A process that has exited and been reaped: its pid is free.
    let mut child = std::process::Command::new(std::env::current_exe().expect("exe"))
        .arg("--list")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let dead_pid = child.id();
    child.wait().expect("wait");
    let client = FileRendezvous::new(&dir, 1, 2)
        .with_job_key("dead")
        .with_timeout(Duration::from_millis(200));
    let record = IdRecord {
        job_hash: client.job_hash(),
        world_size: 2,
        nonce: 1,
        pid: dead_pid,
        start_ticks: 1,
        pid_namespace: procfs::own_pid_namespace(),
        ids: vec![sample_id(1)],
    };
    write_atomically(&client.id_path(), &record.encode()).expect("write");
    if procfs::own_pid_namespace() != 0 {
        let err = client.fetch().unwrap_err();
        assert!(
            matches!(err, BootstrapError::Timeout { ref stage, .. } if stage.contains("stale")),
            "{err}"
        );
    }
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn second_exchange_with_same_key_skips_the_first_publication() {
    let dir = scratch_dir("twice");
    let rank = |r| {
        FileRendezvous::new(&dir, r, 3)
            .with_job_key("twice")
            .with_timeout(Duration::from_secs(5))
            .with_poll_interval(Duration::from_millis(5))
    };
    let root = rank(0);
    let publisher = thread::spawn(move || {
        root.publish(sample_id(1))?;
        root.publish(sample_id(2))
    });
    let fast = rank(1);
    let fast_rank = thread::spawn(move || (fast.fetch(), fast.fetch()));
    // Rank 2 holds the first exchange open, so rank 1 starts its second one while the
    // first file is still in place; it must wait for the second publication.
    thread::sleep(Duration::from_millis(200));
    let slow = rank(2);
    assert_eq!(slow.fetch().expect("first"), sample_id(1));
    assert_eq!(slow.fetch().expect("second"), sample_id(2));
    let (first, second) = fast_rank.join().expect("join");
    assert_eq!(first.expect("first"), sample_id(1));
    assert_eq!(second.expect("second"), sample_id(2));
    publisher.join().expect("join").expect("publish");
    let _ = fs::remove_dir_all(&dir);
}
