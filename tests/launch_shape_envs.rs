//! The environments that the GPU launch-shape tests give their children (`common::procs`)
//! describe the launches they stand for, as the crate reads them; and the harness never waits
//! on a child without a bound. No GPU needed: a wrong variable here would otherwise show only
//! as a failed (or hung) run on a GPU host.

mod common;

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant};

use nccl::bootstrap::{Exchange, Launcher, Placement};

use common::procs::{one_gpu_per_task_env_showing, simulated_node_env_showing, var, wait_children};

/// Looks variables up in `env` only, as a child started with it would see them (the harness
/// removes the parent's launcher variables).
fn lookup(env: &[(String, String)]) -> impl Fn(&str) -> Option<String> + '_ {
    move |name| {
        env.iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
    }
}

fn get(env: &[(String, String)], name: &str) -> String {
    lookup(env)(name).unwrap_or_else(|| panic!("{name} is not set in {env:?}"))
}

#[test]
fn simulated_nodes_are_one_rank_per_machine_with_a_tcp_rendezvous() {
    for size in [2, 4] {
        let mut host_ids = HashSet::new();
        let mut gpus = HashSet::new();
        for rank in 0..size {
            let env = simulated_node_env_showing(rank, size, rank.to_string(), 29512, "run-7");
            let launch = Placement::from_vars(lookup(&env)).unwrap();
            assert_eq!(
                (launch.rank, launch.world_size, launch.local_rank),
                (rank, size, 0)
            );
            assert_eq!(launch.local_world_size, Some(1));
            assert_eq!(launch.launcher, Launcher::Torchrun);
            assert!(!launch.is_single_node(), "{launch:?}");
            match Exchange::from_vars(&launch, lookup(&env)).unwrap() {
                Exchange::Tcp(tcp) => {
                    assert_eq!(tcp.addr(), "127.0.0.1:29512");
                    assert_eq!((tcp.rank(), tcp.world_size()), (rank, size));
                    assert_eq!(tcp.job_key(), "torchelastic-run-7");
                }
                other => panic!("rank {rank}: {other:?}, want the TCP rendezvous"),
            }
            // NCCL must see a machine of its own: its own host id, no transport within a host.
            for (name, value) in [
                ("NCCL_P2P_DISABLE", "1"),
                ("NCCL_SHM_DISABLE", "1"),
                ("NCCL_NET", "Socket"),
                ("NCCL_SOCKET_IFNAME", "lo"),
                ("NCCL_NVLS_ENABLE", "0"),
                ("NCCL_MNNVL_ENABLE", "0"),
            ] {
                assert_eq!(get(&env, name), value, "rank {rank}: {name}");
            }
            host_ids.insert(get(&env, "NCCL_HOSTID"));
            gpus.insert(get(&env, "CUDA_VISIBLE_DEVICES"));
        }
        assert_eq!(host_ids.len(), size, "a host id per rank: {host_ids:?}");
        assert_eq!(gpus.len(), size, "a GPU per rank: {gpus:?}");
    }
}

#[test]
fn one_gpu_per_task_is_open_mpi_on_one_node_with_one_gpu_visible() {
    let size = 2;
    let mut gpus = HashSet::new();
    for rank in 0..size {
        let env = one_gpu_per_task_env_showing(rank, size, rank.to_string(), "4242");
        let launch = Placement::from_vars(lookup(&env)).unwrap();
        // Open MPI and PMIx agree; the innermost (Open MPI) is believed.
        assert_eq!(launch.launcher, Launcher::OpenMpi);
        assert_eq!(
            (launch.rank, launch.world_size, launch.local_rank),
            (rank, size, rank)
        );
        assert!(launch.is_single_node(), "{launch:?}");
        // Without an address the ranks of one node share a file; with one, TCP.
        let mut with_dir = env.clone();
        with_dir.push(var("NCCL_RS_RENDEZVOUS_DIR", "/tmp/shapes"));
        match Exchange::from_vars(&launch, lookup(&with_dir)).unwrap() {
            Exchange::File(file) => {
                assert_eq!(file.dir(), std::path::Path::new("/tmp/shapes"));
                assert_eq!(file.job_key(), "ompi-4242");
            }
            other => panic!("rank {rank}: {other:?}, want the file rendezvous"),
        }
        let mut with_addr = env.clone();
        with_addr.push(var("NCCL_RS_ADDR", "127.0.0.1:29513"));
        match Exchange::from_vars(&launch, lookup(&with_addr)).unwrap() {
            Exchange::Tcp(tcp) => assert_eq!(tcp.addr(), "127.0.0.1:29513"),
            other => panic!("rank {rank}: {other:?}, want the TCP rendezvous"),
        }
        gpus.insert(get(&env, "CUDA_VISIBLE_DEVICES"));
    }
    assert_eq!(gpus.len(), size, "a GPU per rank: {gpus:?}");
}

#[test]
fn wait_children_reports_failures_and_kills_what_outlives_the_limit() {
    let start = Instant::now();
    let mut children: Vec<_> = ["exit 0", "exit 3", "sleep 60"]
        .iter()
        .enumerate()
        .map(|(rank, script)| {
            let child = Command::new("sh").args(["-c", script]).spawn().unwrap();
            (rank, child)
        })
        .collect();
    let failed = wait_children(&mut children, Duration::from_secs(2));
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    assert!(children.is_empty());
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(
        failed[0].starts_with("rank 1:") && failed[0].contains('3'),
        "{failed:?}"
    );
    assert!(
        failed[1] == "rank 2: killed, still running after 2s",
        "{failed:?}"
    );
}
