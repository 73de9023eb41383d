//! Joining with several unique ids (`ncclCommInitRankScalable`, NCCL 2.23), the encrypted
//! rendezvous end to end, and NCCL's own TLS (`ncclSetEncryption`, NCCL 2.32), on simulated
//! hosts: every rank a process of its own with its own `NCCL_HOSTID`, connected over
//! NET/Socket on loopback (all on GPU 0 of a one-GPU host; see `common::shape`).
//!
//! * `scalable_init_with_two_ids_*`: rank 0 creates two ids and hands them out over the keyed
//!   TCP rendezvous (`TcpRendezvous::with_secret`, `IdCount::Exactly(2)`); every rank checks
//!   it got the same two, joins with `Comm::init_rank_scalable` (the 3-rank case nonblocking,
//!   through `init_rank_scalable_with_config`) and checks every collective on random data
//!   against a host reference.
//! * `from_env_hands_out_two_ids_over_the_keyed_rendezvous`: `Comm::from_env` with
//!   `NCCL_RS_RENDEZVOUS_KEY` and `NCCL_RS_UNIQUE_IDS=2`, as a launched job would.
//! * `encryption_over_simulated_hosts`: `set_encryption` (key derived from the rendezvous key)
//!   then `Comm::from_env` and an all-reduce; on NCCL before 2.32 `Unsupported`, on an NCCL
//!   built without TLS `Unavailable` (said as SKIPPED, since nothing was encrypted).
//!
//! ```text
//! cargo test --release --test gpu_scalable_init -- --include-ignored --test-threads=1 --nocapture
//! ```

mod common;

use std::time::Duration;

use cudarc::driver::CudaContext;
use nccl::bootstrap::{IdCount, RendezvousKey, TcpRendezvous};
use nccl::{Comm, CommConfig, Error, ReduceOp, UniqueId, Version};

use common::procs::{epoch_ms, fields, free_port, simulated_node_env, var, Children};
use common::shape::{child_device, processes, skip, Layout, Shape};
use common::{run_case, run_type, Coll, Op, Ranks, Rng};

/// Marks a child: `rank,size`.
const CHILD_ENV: &str = "NCCL_RS_SCALABLE_CHILD";
/// The rendezvous address of the `scalable_init_*` children.
const ADDR_ENV: &str = "NCCL_RS_SCALABLE_ADDR";
/// Makes the 3-rank children join nonblocking.
const NONBLOCKING_ENV: &str = "NCCL_RS_SCALABLE_NONBLOCKING";
const SCALABLE_SINCE: Version = Version::new(2, 23, 0);
const ENCRYPTION_SINCE: Version = Version::new(2, 32, 0);

/// A rendezvous key for one run: 64 hex digits, fresh per run.
fn run_key() -> String {
    let seed = epoch_ms() ^ (u128::from(std::process::id()) << 64);
    let mut rng = Rng::new(seed as u64 ^ (seed >> 64) as u64);
    (0..4).map(|_| format!("{:016x}", rng.next_u64())).collect()
}

fn child_spec() -> Option<(usize, usize)> {
    let spec = std::env::var(CHILD_ENV).ok()?;
    let (rank, size) = spec.split_once(',').expect("rank,size");
    Some((rank.parse().expect("rank"), size.parse().expect("size")))
}

/// Starts `test` once per rank of `layout` with the child marker and `env(rank)`; returns what
/// they printed (every child must succeed within `limit`).
fn run_children(
    test: &str,
    layout: &Layout,
    limit: Duration,
    env: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<(usize, String)> {
    let n = layout.size();
    let ranks: Vec<usize> = (0..n).collect();
    Children::spawn(test, &ranks, |rank| {
        let mut vars = env(rank);
        vars.push(var(CHILD_ENV, format!("{rank},{n}")));
        vars
    })
    .finish(limit)
}

/// Every collective in f32 and an i32 all-reduce for each reduction, random data checked
/// against the host; returns the buffers checked.
fn check_collectives(comm: Comm, size: usize) -> usize {
    let ranks = Ranks {
        comms: vec![comm],
        size,
    };
    let mut checked = run_type::<f32>(&ranks, 4099, 11);
    for (j, op) in Op::all::<i32>().into_iter().enumerate() {
        checked += run_case::<i32>(
            &ranks,
            Coll::AllReduce,
            Some(op),
            false,
            1031,
            50 + j as u64,
        );
    }
    for comm in ranks.comms {
        let rank = comm.rank();
        comm.finalize()
            .unwrap_or_else(|e| panic!("rank {rank}: finalize: {e}"));
        comm.destroy()
            .unwrap_or_else(|e| panic!("rank {rank}: destroy: {e:?}"));
    }
    checked
}

// -------------------------------------------------------------------------------------------
// init_rank_scalable with two ids, handed out over the keyed rendezvous
// -------------------------------------------------------------------------------------------

fn scalable_init_with_two_ids(test: &str, ranks: usize, nonblocking: bool) {
    let Some(layout) = processes(test, &[Shape::Hosts], ranks) else {
        return;
    };
    let n = layout.size();
    let version = nccl::version().expect("NCCL loads");
    let addr = format!("127.0.0.1:{}", free_port());
    let key = run_key();
    let lines = run_children(
        "child_scalable_init",
        &layout,
        Duration::from_secs(300),
        |rank| {
            let mut vars = layout.env(rank);
            vars.push(var(ADDR_ENV, &addr));
            vars.push(var("NCCL_RS_RENDEZVOUS_KEY", &key));
            vars.push(var(NONBLOCKING_ENV, u8::from(nonblocking)));
            vars
        },
    );
    if version < SCALABLE_SINCE {
        let refused = fields(&lines, "SCALABLE_UNSUPPORTED", "rank");
        assert_eq!(
            refused.len(),
            n,
            "NCCL {version}: every rank refused: {lines:?}"
        );
        skip(
            test,
            &format!("NCCL {version} has no ncclCommInitRankScalable (refused as Unsupported)"),
        );
        return;
    }
    let checked = fields(&lines, "SCALABLE_OK", "checked");
    assert_eq!(checked.len(), n, "every rank reports: {lines:?}");
    assert!(checked.iter().all(|&(_, c)| c >= 20), "{checked:?}");
    // Every rank joined with the same two ids, in the same order.
    let prints = fields(&lines, "SCALABLE_OK", "ids");
    assert_eq!(prints.len(), n);
    assert!(prints.iter().all(|&(_, p)| p == prints[0].1), "{prints:?}");
    let counts = fields(&lines, "SCALABLE_OK", "nids");
    assert!(counts.iter().all(|&(_, c)| c == 2), "{counts:?}");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn scalable_init_with_two_ids_on_2_simulated_hosts() {
    scalable_init_with_two_ids("scalable_init_with_two_ids_on_2_simulated_hosts", 2, false);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn scalable_init_with_two_ids_on_3_simulated_hosts_nonblocking() {
    scalable_init_with_two_ids(
        "scalable_init_with_two_ids_on_3_simulated_hosts_nonblocking",
        3,
        true,
    );
}

#[test]
#[ignore = "child process of scalable_init_with_two_ids_*"]
fn child_scalable_init() {
    let Some((rank, size)) = child_spec() else {
        return;
    };
    let addr = std::env::var(ADDR_ENV).expect("address");
    let key_hex = std::env::var("NCCL_RS_RENDEZVOUS_KEY").expect("key");
    let nonblocking = std::env::var(NONBLOCKING_ENV).as_deref() == Ok("1");
    let stream = CudaContext::new(child_device(rank))
        .expect("CUDA context")
        .default_stream();
    let rendezvous = TcpRendezvous::new(addr, rank, size)
        .with_job_key("scalable-init")
        .with_timeout(Duration::from_secs(90))
        .with_secret(RendezvousKey::from_hex(&key_hex).expect("key"))
        .with_id_count(IdCount::Exactly(2));
    assert!(rendezvous.is_encrypted());
    let ids = rendezvous
        .exchange_ids_with(UniqueId::new)
        .unwrap_or_else(|e| panic!("rank {rank}: exchange_ids: {e}"));
    assert_eq!(ids.len(), 2, "rank {rank}");
    assert_ne!(ids[0], ids[1], "rank {rank}: two distinct roots");
    let print = ids
        .iter()
        .fold(0u64, |acc, id| acc.rotate_left(7) ^ id.fingerprint());
    let joined = if nonblocking {
        let config = CommConfig::new().blocking(false);
        Comm::init_rank_scalable_with_config(stream, &ids, rank, size, &config)
    } else {
        Comm::init_rank_scalable(stream, &ids, rank, size)
    };
    let version = nccl::version().unwrap();
    let comm = match joined {
        Err(Error::Unsupported { needs, found, .. }) if version < SCALABLE_SINCE => {
            assert_eq!((needs, found), (SCALABLE_SINCE, version));
            println!("SCALABLE_UNSUPPORTED rank={rank}");
            return;
        }
        other => other.unwrap_or_else(|e| panic!("rank {rank}: init_rank_scalable: {e}")),
    };
    assert_eq!((comm.rank(), comm.size()), (rank, size));
    let checked = check_collectives(comm, size);
    println!("SCALABLE_OK rank={rank} checked={checked} nids=2 ids={print} nccl={version}");
}

// -------------------------------------------------------------------------------------------
// Comm::from_env with NCCL_RS_UNIQUE_IDS=2 over the keyed rendezvous
// -------------------------------------------------------------------------------------------

/// Simulated nodes started as a multi-node torchrun job, every rank given `extra` too.
fn simulated_nodes(
    test: &str,
    child: &str,
    ranks: usize,
    extra: Vec<(String, String)>,
) -> Option<(usize, Vec<(usize, String)>)> {
    let layout = processes(test, &[Shape::Hosts], ranks)?;
    let n = layout.size();
    let port = free_port();
    let run_id = format!("scalable-{}-{}", std::process::id(), epoch_ms());
    let lines = run_children(child, &layout, Duration::from_secs(300), |rank| {
        let mut vars = simulated_node_env(rank, n, layout.devices[rank], port, &run_id);
        vars.extend(extra.clone());
        vars
    });
    Some((n, lines))
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn from_env_hands_out_two_ids_over_the_keyed_rendezvous() {
    let test = "from_env_hands_out_two_ids_over_the_keyed_rendezvous";
    let version = nccl::version().expect("NCCL loads");
    let extra = vec![
        var("NCCL_RS_RENDEZVOUS_KEY", run_key()),
        var("NCCL_RS_UNIQUE_IDS", 2),
    ];
    let Some((n, lines)) = simulated_nodes(test, "child_from_env_two_ids", 3, extra) else {
        return;
    };
    if version < SCALABLE_SINCE {
        let refused = fields(&lines, "FROM_ENV_UNSUPPORTED", "rank");
        assert_eq!(refused.len(), n, "{lines:?}");
        skip(
            test,
            &format!("NCCL {version} has no ncclCommInitRankScalable (refused as Unsupported)"),
        );
        return;
    }
    let checked = fields(&lines, "FROM_ENV_OK", "checked");
    assert_eq!(checked.len(), n, "every rank reports: {lines:?}");
    assert!(checked.iter().all(|&(_, c)| c >= 20), "{checked:?}");
}

#[test]
#[ignore = "child process of from_env_hands_out_two_ids_over_the_keyed_rendezvous"]
fn child_from_env_two_ids() {
    let Some((rank, size)) = child_spec() else {
        return;
    };
    // The rendezvous Comm::from_env builds here is the keyed one.
    let placement = nccl::bootstrap::Placement::from_env().expect("placement");
    let exchange = nccl::bootstrap::Exchange::from_env(&placement).expect("exchange");
    match &exchange {
        nccl::bootstrap::Exchange::Tcp(tcp) => {
            assert!(tcp.is_encrypted(), "NCCL_RS_RENDEZVOUS_KEY makes it keyed");
            assert_eq!(tcp.id_count(), IdCount::Exactly(2));
        }
        other => panic!("rank {rank}: expected the TCP rendezvous, got {other:?}"),
    }
    let version = nccl::version().unwrap();
    let (comm, _stream) = match Comm::from_env() {
        Err(Error::Unsupported { needs, .. }) if version < SCALABLE_SINCE => {
            assert_eq!(needs, SCALABLE_SINCE);
            println!("FROM_ENV_UNSUPPORTED rank={rank}");
            return;
        }
        other => other.unwrap_or_else(|e| panic!("rank {rank}: Comm::from_env: {e}")),
    };
    assert_eq!((comm.rank(), comm.size()), (rank, size));
    let checked = check_collectives(comm, size);
    println!("FROM_ENV_OK rank={rank} checked={checked}");
}

// -------------------------------------------------------------------------------------------
// ncclSetEncryption
// -------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs CUDA GPUs"]
fn encryption_over_simulated_hosts() {
    let test = "encryption_over_simulated_hosts";
    let version = nccl::version().expect("NCCL loads");
    let extra = vec![var("NCCL_RS_RENDEZVOUS_KEY", run_key())];
    let Some((n, lines)) = simulated_nodes(test, "child_encryption", 2, extra) else {
        return;
    };
    if version < ENCRYPTION_SINCE {
        let refused = fields(&lines, "ENC_UNSUPPORTED", "rank");
        assert_eq!(
            refused.len(),
            n,
            "NCCL {version}: every rank refused: {lines:?}"
        );
        skip(
            test,
            &format!("NCCL {version} has no ncclSetEncryption (refused as Unsupported)"),
        );
        return;
    }
    let unavailable = fields(&lines, "ENC_UNAVAILABLE", "rank");
    if !unavailable.is_empty() {
        assert_eq!(unavailable.len(), n, "every rank says so alike: {lines:?}");
        skip(
            test,
            &format!(
                "NCCL {version} cannot encrypt (built without TLS_BACKEND=OPENSSL3, or no \
                 OpenSSL 3): every rank got Error::Unavailable at the join"
            ),
        );
        return;
    }
    let checked = fields(&lines, "ENC_OK", "checked");
    assert_eq!(checked.len(), n, "every rank reports: {lines:?}");
    assert!(checked.iter().all(|&(_, c)| c == 1), "{checked:?}");
}

#[test]
#[ignore = "child process of encryption_over_simulated_hosts"]
fn child_encryption() {
    let Some((rank, size)) = child_spec() else {
        return;
    };
    let version = nccl::version().unwrap();
    let rendezvous_key =
        RendezvousKey::from_hex(&std::env::var("NCCL_RS_RENDEZVOUS_KEY").unwrap()).unwrap();
    // One secret for both: NCCL's key derived from the rendezvous key, alike on every rank.
    let key = rendezvous_key.encryption_key().expect("derived key");
    assert!(!format!("{key:?}").contains(&std::env::var("NCCL_RS_RENDEZVOUS_KEY").unwrap()[..16]));
    match nccl::set_encryption(&key) {
        Err(Error::Unsupported { needs, found, .. }) if version < ENCRYPTION_SINCE => {
            assert_eq!((needs, found), (ENCRYPTION_SINCE, version));
            println!("ENC_UNSUPPORTED rank={rank}");
            return;
        }
        other => other.unwrap_or_else(|e| panic!("rank {rank}: set_encryption: {e}")),
    }
    assert!(nccl::encryption::encryption_is_set());
    let (comm, stream) = match Comm::from_env() {
        Err(Error::Unavailable { api, reason }) => {
            assert_eq!(api, "ncclSetEncryption");
            println!("ENC_UNAVAILABLE rank={rank} reason: {reason}");
            return;
        }
        other => other.unwrap_or_else(|e| panic!("rank {rank}: Comm::from_env: {e}")),
    };
    // Too late now: NCCL's sockets are open.
    let err = nccl::set_encryption(&key).unwrap_err();
    assert!(matches!(err, Error::InvalidUsage(_)), "{err}");
    // An all-reduce over the encrypted sockets, random data against the host.
    let count = (1 << 16) + 7;
    let input = |r: usize| -> Vec<f32> {
        let mut rng = Rng::new(0xE17C + r as u64);
        (0..count).map(|_| rng.range(-50, 50) as f32).collect()
    };
    let mut buf = stream.clone_htod(&input(rank)).unwrap();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    comm.synchronize_timeout(Duration::from_secs(120)).unwrap();
    let got = stream.clone_dtoh(&buf).unwrap();
    let mut want = vec![0f32; count];
    for r in 0..size {
        for (w, x) in want.iter_mut().zip(input(r)) {
            *w += x;
        }
    }
    assert_eq!(got, want, "rank {rank}");
    drop(comm);
    println!("ENC_OK rank={rank} checked=1 nccl={version}");
}
