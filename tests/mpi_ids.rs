//! `exchange_ids_mpi_with` under a real `mpirun` (feature `mpi`, CPU only: the ids are made
//! up by the closure, NCCL is never loaded; skipped, saying so, without `mpirun`). The test
//! re-executes itself as three MPI ranks: each uses rank 0's number of ids whatever its own
//! setting would resolve to, and a rank set up for another number makes every rank fail
//! instead of leaving the others waiting in a broadcast.
#![cfg(all(feature = "mpi", target_os = "linux"))]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mpi::traits::Communicator;
use nccl::bootstrap::mpi::exchange_ids_mpi_with;
use nccl::bootstrap::IdCount;
use nccl::UniqueId;

/// Set in the ranks: which case they run.
const CASE_ENV: &str = "NCCL_RS_MPI_IDS_CASE";
const RANKS: usize = 3;
/// A hang in a collective shows as this, not as a stuck test run.
const PATIENCE: Duration = Duration::from_secs(60);

/// Each rank's own setting in `case`.
fn own_count(case: &str, rank: usize) -> IdCount {
    match (case, rank) {
        // Rank 0 settles 2; rank 1 on `Auto` would resolve 1 for itself (3 ranks).
        ("agree", 1) => IdCount::Auto,
        ("agree", _) => IdCount::Exactly(2),
        // Rank 2 insists on 1.
        ("mismatch", 2) => IdCount::Exactly(1),
        ("mismatch", _) => IdCount::Exactly(2),
        _ => panic!("unknown case {case}"),
    }
}

/// In a rank: run the exchange and print one line saying how it ended.
fn rank(case: &str) {
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let me = world.rank() as usize;
    let mut made = 0u8;
    let result = exchange_ids_mpi_with(&world, own_count(case, me), || {
        made += 1;
        let mut bytes = [0u8; 128];
        bytes[0] = me as u8;
        bytes[1] = made;
        Ok(UniqueId::from_bytes(bytes))
    });
    match result {
        Ok(ids) => {
            let ids: Vec<String> = ids
                .iter()
                .map(|id| format!("{}.{}", id.as_bytes()[0], id.as_bytes()[1]))
                .collect();
            println!("RANK {me} OK {}", ids.join(","));
        }
        Err(error) => println!("RANK {me} ERR {error}"),
    }
}

/// Runs `case` on [`RANKS`] ranks and returns their result lines, sorted by rank.
fn run(case: &str) -> Option<Vec<String>> {
    let exe = std::env::current_exe().expect("current_exe");
    let spawned = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(RANKS.to_string())
        .arg(exe)
        .args(["mpi_ranks_use_rank_0s_id_count", "--exact", "--nocapture"])
        .env(CASE_ENV, case)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(error) => {
            eprintln!("SKIPPED mpi_ids: cannot start mpirun: {error}");
            return None;
        }
    };
    let started = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > PATIENCE {
            let _ = child.kill();
            let output = child.wait_with_output().expect("output");
            panic!(
                "case {case}: the ranks hung for {PATIENCE:?}\n{}\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut lines: Vec<String> = stdout
        .lines()
        .filter(|line| line.starts_with("RANK "))
        .map(str::to_owned)
        .collect();
    lines.sort();
    assert!(
        output.status.success() && lines.len() == RANKS,
        "case {case}: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Some(lines)
}

#[test]
fn mpi_ranks_use_rank_0s_id_count() {
    if let Ok(case) = std::env::var(CASE_ENV) {
        rank(&case);
        return;
    }
    let Some(agree) = run("agree") else { return };
    // Two ids, made by ranks 0 and 2 (the first rank of each of two groups of 3), on every
    // rank, the one on `Auto` included.
    for (me, line) in agree.iter().enumerate() {
        assert_eq!(line, &format!("RANK {me} OK 0.1,2.1"), "{agree:?}");
    }
    let Some(mismatch) = run("mismatch") else {
        return;
    };
    assert!(
        mismatch[2].starts_with("RANK 2 ERR ") && mismatch[2].contains("hands out 2 unique id(s)"),
        "{mismatch:?}"
    );
    for line in &mismatch[..2] {
        assert!(
            line.contains(" ERR ") && line.contains("another number of NCCL unique ids"),
            "{mismatch:?}"
        );
    }
}
