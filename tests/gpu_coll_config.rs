//! Per-collective configuration (`Operation::with_config`, NCCL 2.31; kernel-started
//! event 2.32) on real GPUs: every visible GPU is a rank (at least 2), each driven by its own
//! thread; every collective runs with configurations (algorithm selection, CTA limits, CTA
//! policy, profiler tag) on random data and is checked against a host reference. Older
//! libraries must refuse every configured call with `Error::Unsupported`, enqueue nothing,
//! and leave the communicator usable.
//!
//! Run on a GPU host with
//! `cargo test --test gpu_coll_config -- --include-ignored --test-threads=1`, once per NCCL
//! (2.28.3 and 2.32.3: `tests/gpu/nccl 2.32.3`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::threaded::{gpu_test, init_threaded, per_rank};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use nccl::config::CtaPolicy;
use nccl::{CollConfig, Comm, CommConfig, Error, Group, Operation, ReduceOp, Version};

const V2_31: Version = nccl::coll_config::COLL_CONFIG_SINCE;
const V2_32: Version = nccl::coll_config::KERNEL_STARTED_EVENT_SINCE;

fn version() -> Version {
    nccl::version().expect("NCCL loads")
}

/// One communicator per rank (see `common::shape`), each created by its own thread on a stream
/// of its own.
fn comms() -> Vec<Comm> {
    let streams = common::threaded::devices()
        .into_iter()
        .map(|device| {
            CudaContext::new(device)
                .and_then(|ctx| ctx.new_stream())
                .expect("stream")
        })
        .collect();
    init_threaded(streams, &CommConfig::new())
}

/// Random small integers in [-8, 8], the same on every thread for a (seed, rank, len).
fn data(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut x = seed ^ ((rank as u64) << 32) ^ 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % 17) as f32 - 8.0
        })
        .collect()
}

/// The collectives, each with what it needs from the test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coll {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Gather,
    Scatter,
}

const COLLS: [Coll; 8] = [
    Coll::AllReduce,
    Coll::Broadcast,
    Coll::Reduce,
    Coll::AllGather,
    Coll::ReduceScatter,
    Coll::AllToAll,
    Coll::Gather,
    Coll::Scatter,
];

impl Coll {
    /// Whether NCCL has selectable algorithms for it (all-to-all, gather and scatter have
    /// none, per the `ncclCollConfig_t` docs).
    fn selectable(self) -> bool {
        !matches!(self, Coll::AllToAll | Coll::Gather | Coll::Scatter)
    }

    /// Send and receive lengths on rank `r` for `c` elements per block.
    fn lens(self, r: usize, root: usize, n: usize, c: usize) -> (usize, usize) {
        match self {
            Coll::AllReduce | Coll::Broadcast | Coll::Reduce => (c, c),
            Coll::AllGather => (c, n * c),
            Coll::ReduceScatter => (n * c, c),
            Coll::AllToAll => (n * c, n * c),
            Coll::Gather => (c, if r == root { n * c } else { 1 }),
            Coll::Scatter => (if r == root { n * c } else { 1 }, c),
        }
    }

    /// Rank `r`'s expected receive buffer (`None` where NCCL defines none), from every
    /// rank's input.
    fn expected(
        self,
        r: usize,
        root: usize,
        n: usize,
        c: usize,
        inputs: &[Vec<f32>],
    ) -> Option<Vec<f32>> {
        let sum = |i: usize| inputs.iter().map(|x| x[i]).sum::<f32>();
        Some(match self {
            Coll::AllReduce => (0..c).map(sum).collect(),
            Coll::Broadcast => inputs[root].clone(),
            Coll::Reduce if r == root => (0..c).map(sum).collect(),
            Coll::AllGather => (0..n * c).map(|k| inputs[k / c][k % c]).collect(),
            Coll::ReduceScatter => (0..c).map(|i| sum(r * c + i)).collect(),
            Coll::AllToAll => (0..n * c).map(|k| inputs[k / c][r * c + k % c]).collect(),
            Coll::Gather if r == root => (0..n * c).map(|k| inputs[k / c][k % c]).collect(),
            Coll::Scatter => inputs[root][r * c..(r + 1) * c].to_vec(),
            Coll::Reduce | Coll::Gather => return None,
        })
    }

    /// The operation on `send` and `recv`.
    fn operation<'a>(
        self,
        send: &'a CudaSlice<f32>,
        recv: &'a mut CudaSlice<f32>,
        r: usize,
        root: usize,
    ) -> Operation<'a, f32> {
        let on_root = r == root;
        match self {
            Coll::AllReduce => Operation::all_reduce(send, recv, ReduceOp::Sum),
            Coll::Broadcast => {
                Operation::broadcast(on_root.then_some(send as &dyn DevicePtr<f32>), recv, root)
            }
            Coll::Reduce => Operation::reduce(
                send,
                on_root.then_some(recv as &mut dyn DevicePtrMut<f32>),
                ReduceOp::Sum,
                root,
            ),
            Coll::AllGather => Operation::all_gather(send, recv),
            Coll::ReduceScatter => Operation::reduce_scatter(send, recv, ReduceOp::Sum),
            Coll::AllToAll => Operation::all_to_all(send, recv),
            Coll::Gather => Operation::gather(
                send,
                on_root.then_some(recv as &mut dyn DevicePtrMut<f32>),
                root,
            ),
            Coll::Scatter => {
                Operation::scatter(on_root.then_some(send as &dyn DevicePtr<f32>), recv, root)
            }
        }
    }
}

/// The configurations every collective runs with; the algorithm selections only where NCCL
/// has names for the collective. Ring implements every collective that has names.
fn configs(coll: Coll) -> Vec<(&'static str, CollConfig<'static>)> {
    let mut list = vec![
        ("empty", CollConfig::new()),
        ("ctas 1..2", CollConfig::new().min_ctas(1).max_ctas(2)),
        (
            "CtaPolicy::EFFICIENCY",
            CollConfig::new().cta_policy(CtaPolicy::EFFICIENCY),
        ),
        ("profiler tag", CollConfig::new().profiler_tag(0x1234_5678)),
    ];
    if coll.selectable() {
        list.push((
            "ring, ctas 2..4",
            CollConfig::new().algorithm("ring").min_ctas(2).max_ctas(4),
        ));
        list.push((
            "^ring with fallback",
            CollConfig::new()
                .algorithm("^ring")
                .allow_algorithm_fallback(true),
        ));
    }
    list
}

fn enqueue_checked(
    comm: &Comm,
    stream: &Arc<CudaStream>,
    coll: Coll,
    config: &CollConfig<'_>,
    seed: u64,
) {
    let (r, n) = (comm.rank(), comm.size());
    let (root, c) = (n - 1, 1031);
    let (send_len, recv_len) = coll.lens(r, root, n, c);
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|q| data(seed, q, coll.lens(q, root, n, c).0))
        .collect();
    let send = stream.clone_htod(&inputs[r]).unwrap();
    assert_eq!(send.len(), send_len);
    let mut recv = stream.alloc_zeros::<f32>(recv_len).unwrap();
    comm.enqueue(
        coll.operation(&send, &mut recv, r, root)
            .with_config(config),
    )
    .unwrap_or_else(|e| panic!("rank {r}: {coll:?} with {config:?}: {e}"));
    let got = stream.clone_dtoh(&recv).unwrap();
    if let Some(want) = coll.expected(r, root, n, c, &inputs) {
        assert_eq!(got, want, "rank {r}: {coll:?} with {config:?}");
    }
}

/// [`enqueue_checked`] for every rank at once, from this thread, in one group: how one
/// process drives ranks that share a GPU. (A thread per rank there can hang: NCCL may set up
/// a connection for a configuration from one rank's thread, with a call that waits for the
/// GPU, while the other rank's kernel already waits on this GPU for it.)
fn enqueue_checked_together(comms: &[Comm], coll: Coll, config: &CollConfig<'_>, seed: u64) {
    let n = comms.len();
    let (root, c) = (n - 1, 1031);
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|q| data(seed, q, coll.lens(q, root, n, c).0))
        .collect();
    let sends: Vec<CudaSlice<f32>> = comms
        .iter()
        .map(|comm| comm.stream().clone_htod(&inputs[comm.rank()]).unwrap())
        .collect();
    let mut recvs: Vec<CudaSlice<f32>> = comms
        .iter()
        .map(|comm| {
            let recv_len = coll.lens(comm.rank(), root, n, c).1;
            comm.stream().alloc_zeros::<f32>(recv_len).unwrap()
        })
        .collect();
    {
        let mut group = Group::start().unwrap();
        for ((comm, send), recv) in comms.iter().zip(&sends).zip(recvs.iter_mut()) {
            let op = coll
                .operation(send, recv, comm.rank(), root)
                .with_config(config);
            group
                .enqueue(comm, op)
                .unwrap_or_else(|e| panic!("rank {}: {coll:?} with {config:?}: {e}", comm.rank()));
        }
        group.finish().unwrap();
    }
    for (comm, recv) in comms.iter().zip(&recvs) {
        let r = comm.rank();
        let got = comm.stream().clone_dtoh(recv).unwrap();
        if let Some(want) = coll.expected(r, root, n, c, &inputs) {
            assert_eq!(got, want, "rank {r}: {coll:?} with {config:?}");
        }
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn every_collective_with_a_config_matches_the_host_reference() {
    let Some(_deadline) = gpu_test(
        "every_collective_with_a_config_matches_the_host_reference",
        Duration::from_secs(300),
    ) else {
        return;
    };
    let v = version();
    let devices = common::threaded::devices();
    if v >= V2_31 && (1..devices.len()).any(|i| devices[..i].contains(&devices[i])) {
        // Ranks sharing a GPU: one thread drives them (see `enqueue_checked_together`).
        let streams: Vec<_> = devices
            .iter()
            .map(|&d| CudaContext::new(d).unwrap().new_stream().unwrap())
            .collect();
        let comms = Comm::init_all(&streams).unwrap();
        let mut checked = 0;
        for (seed, coll) in COLLS.into_iter().enumerate() {
            for (name, config) in configs(coll) {
                enqueue_checked_together(&comms, coll, &config, seed as u64 * 100 + checked);
                checked += 1;
                println!("NCCL {v}: {coll:?} with {name}: right on every rank");
            }
        }
        assert!(checked > 30, "{checked} cases");
        return;
    }
    let checked = per_rank(comms(), |comm, _| {
        let stream = comm.stream().clone();
        let r = comm.rank();
        let mut checked = 0;
        if v < V2_31 {
            // Refused before anything is enqueued, with the type that names the version.
            for coll in COLLS {
                let send = stream.alloc_zeros::<f32>(4 * comm.size()).unwrap();
                let mut recv = stream.alloc_zeros::<f32>(4 * comm.size()).unwrap();
                let config = CollConfig::new().max_ctas(2);
                let op = coll.operation(&send, &mut recv, r, 0).with_config(&config);
                match comm.enqueue(op) {
                    Err(Error::Unsupported { api, needs, found }) => {
                        assert_eq!((api, needs, found), ("ncclCollConfig_t", V2_31, v));
                    }
                    other => panic!("rank {r}: {coll:?} on NCCL {v}: {other:?}"),
                }
            }
            // The communicator is untouched: a plain collective still runs.
            enqueue_checked_plain(&comm, &stream);
            return 1;
        }
        for (seed, coll) in COLLS.into_iter().enumerate() {
            for (name, config) in configs(coll) {
                enqueue_checked(&comm, &stream, coll, &config, seed as u64 * 100 + checked);
                checked += 1;
                if r == 0 {
                    println!("NCCL {v}: {coll:?} with {name}: right");
                }
            }
        }
        // In place, through the same path.
        let c = 4099;
        let inputs: Vec<Vec<f32>> = (0..comm.size()).map(|q| data(77, q, c)).collect();
        let mut buf = stream.clone_htod(&inputs[r]).unwrap();
        let config = CollConfig::new().algorithm("ring").max_ctas(2);
        comm.enqueue(Operation::all_reduce_in_place(&mut buf, ReduceOp::Sum).with_config(&config))
            .unwrap();
        let want: Vec<f32> = (0..c).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
        assert_eq!(stream.clone_dtoh(&buf).unwrap(), want, "rank {r}: in place");
        checked + 1
    });
    assert!(checked.iter().all(|&k| k > 0), "{checked:?}");
}

fn enqueue_checked_plain(comm: &Comm, stream: &Arc<CudaStream>) {
    let n = comm.size();
    let inputs: Vec<Vec<f32>> = (0..n).map(|q| data(5, q, 513)).collect();
    let send = stream.clone_htod(&inputs[comm.rank()]).unwrap();
    let mut recv = stream.alloc_zeros::<f32>(513).unwrap();
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
    let want: Vec<f32> = (0..513)
        .map(|i| inputs.iter().map(|x| x[i]).sum())
        .collect();
    assert_eq!(stream.clone_dtoh(&recv).unwrap(), want);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn configs_are_refused_on_send_and_receive() {
    let Some(_deadline) = gpu_test(
        "configs_are_refused_on_send_and_receive",
        Duration::from_secs(120),
    ) else {
        return;
    };
    per_rank(comms(), |comm, _| {
        let stream = comm.stream().clone();
        let (r, n) = (comm.rank(), comm.size());
        let send = stream.alloc_zeros::<f32>(8).unwrap();
        let mut recv = stream.alloc_zeros::<f32>(8).unwrap();
        let config = CollConfig::new();
        let mut group = Group::start().unwrap();
        for op in [
            Operation::send(&send, (r + 1) % n).with_config(&config),
            Operation::recv(&mut recv, (r + n - 1) % n).with_config(&config),
        ] {
            match group.enqueue(&comm, op) {
                Err(Error::InvalidArgument(text)) => {
                    assert!(text.contains("takes no CollConfig"), "{text}")
                }
                other => panic!("rank {r}: {other:?}"),
            }
        }
        assert_eq!(group.buffer_count(), 0);
        group.finish().unwrap();
        enqueue_checked_plain(&comm, &stream);
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn kernel_started_event_is_recorded_and_waited() {
    let Some(_deadline) = gpu_test(
        "kernel_started_event_is_recorded_and_waited",
        Duration::from_secs(120),
    ) else {
        return;
    };
    let v = version();
    per_rank(comms(), |comm, barrier| {
        let stream = comm.stream().clone();
        let (r, n) = (comm.rank(), comm.size());
        let ctx = comm.context().clone();
        let event = ctx.new_event(None).unwrap();
        let c = 1 << 16;
        let inputs: Vec<Vec<f32>> = (0..n).map(|q| data(9, q, c)).collect();
        // Every buffer, event and stream is made before the first collective: where ranks
        // share a GPU (one process, a thread each), an allocation can wait for the GPU while
        // a peer's kernel spins there waiting for this rank, which then never launches.
        let send = stream.clone_htod(&inputs[r]).unwrap();
        let mut recv = stream.alloc_zeros::<f32>(c).unwrap();
        let mut again = stream.alloc_zeros::<f32>(c).unwrap();
        let mut more = stream.alloc_zeros::<f32>(c).unwrap();
        let second = ctx.new_event(None).unwrap();
        let other = ctx.new_stream().unwrap();
        stream.synchronize().unwrap();
        barrier.wait();
        let config = CollConfig::new().kernel_started_event(&event);
        let result = comm
            .enqueue(Operation::all_reduce(&send, &mut recv, ReduceOp::Sum).with_config(&config));
        if v < V2_32 {
            match result {
                Err(Error::Unsupported { needs, .. }) => assert!(needs == V2_31 || needs == V2_32),
                other => panic!("rank {r}: NCCL {v}: {other:?}"),
            }
            return;
        }
        result.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        // The event marks the kernel's start: another stream waits on it, and the host on it.
        other.wait(&event).unwrap();
        event.synchronize().unwrap();
        other.synchronize().unwrap();
        let want: Vec<f32> = (0..c).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
        assert_eq!(stream.clone_dtoh(&recv).unwrap(), want, "rank {r}");

        // In a group: one event per communicator; a second is refused and the group goes on.
        let with_second = CollConfig::new().kernel_started_event(&second);
        let mut group = Group::start().unwrap();
        group
            .enqueue(
                &comm,
                Operation::all_reduce(&send, &mut again, ReduceOp::Sum).with_config(&config),
            )
            .unwrap();
        match group.enqueue(
            &comm,
            Operation::all_reduce(&send, &mut more, ReduceOp::Sum).with_config(&with_second),
        ) {
            Err(Error::InvalidArgument(text)) => {
                assert!(text.contains("one per communicator"), "{text}")
            }
            other => panic!("rank {r}: {other:?}"),
        }
        group.finish().unwrap();
        event.synchronize().unwrap();
        assert_eq!(
            stream.clone_dtoh(&again).unwrap(),
            want,
            "rank {r}: grouped"
        );
        if r == 0 {
            println!("NCCL {v}: kernel-started events recorded and waited on {n} ranks");
        }
    });
}

const M1_CHILD: &str = "NCCL_RS_M1_CHILD";

/// M1: NCCL keeps only the `algSelection` pointer of a configuration, and on its
/// rearchitected enqueue path (`NCCL_ENQUEUE_REARCH_ENABLE=1`, 2.31) parses it again at
/// `ncclGroupEnd`. Grouped all-reduces with `algorithm("ring")` (forced: a selection NCCL
/// cannot read is an error), with the heap churned between enqueue and group end so a freed
/// string would be overwritten: before the fix the string died with the enqueue; now it
/// lives in the configuration the group borrows. Results are checked against the host sum.
/// Runs in a child process, so that NCCL reads the variable fresh.
#[test]
#[ignore = "needs CUDA GPUs"]
fn m1_algorithm_selection_lives_until_the_group_ends() {
    const TEST: &str = "m1_algorithm_selection_lives_until_the_group_ends";
    let v = version();
    if v < V2_31 {
        common::shape::skip(
            TEST,
            &format!("NCCL {v} has no per-collective config (2.31)"),
        );
        return;
    }
    if std::env::var_os(M1_CHILD).is_none() {
        // The child records in this binary's ledger.
        common::shape::setup();
        let exe = std::env::current_exe().unwrap();
        let status = std::process::Command::new(exe)
            .args([TEST, "--exact", "--include-ignored", "--nocapture"])
            .env(M1_CHILD, "1")
            .env("NCCL_ENQUEUE_REARCH_ENABLE", "1")
            .status()
            .expect("spawn the child");
        assert!(
            status.success(),
            "{TEST} (child, NCCL_ENQUEUE_REARCH_ENABLE=1): {status}"
        );
        return;
    }
    let Some(_deadline) = gpu_test(TEST, Duration::from_secs(240)) else {
        return;
    };
    let checked = per_rank(comms(), |comm, _| {
        let (r, n) = (comm.rank(), comm.size());
        let stream = comm.stream().clone();
        let c = 4099;
        let ops = 4;
        let configs: Vec<CollConfig> = (0..ops)
            .map(|_| CollConfig::new().algorithm("ring"))
            .collect();
        let inputs: Vec<Vec<Vec<f32>>> = (0..ops)
            .map(|k| (0..n).map(|q| data(300 + k as u64, q, c)).collect())
            .collect();
        let mut bufs: Vec<CudaSlice<f32>> = (0..ops)
            .map(|k| stream.clone_htod(&inputs[k][r]).unwrap())
            .collect();
        let mut churn = Vec::new();
        {
            let mut group = Group::start().unwrap();
            for (buf, config) in bufs.iter_mut().zip(&configs) {
                group
                    .enqueue(
                        &comm,
                        Operation::all_reduce_in_place(buf, ReduceOp::Sum).with_config(config),
                    )
                    .unwrap_or_else(|e| panic!("rank {r}: enqueue: {e}"));
                // Reuses any small allocation freed by the enqueue.
                churn.extend((0..64).map(|_| b"xxxx\0".to_vec()));
            }
            group
                .finish()
                .unwrap_or_else(|e| panic!("rank {r}: ncclGroupEnd: {e}"));
        }
        drop(churn);
        comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
        for (k, buf) in bufs.iter().enumerate() {
            let want: Vec<f32> = (0..c)
                .map(|i| inputs[k].iter().map(|x| x[i]).sum())
                .collect();
            assert_eq!(stream.clone_dtoh(buf).unwrap(), want, "rank {r}, op {k}");
        }
        ops
    });
    common::shape::ran(TEST, &format!("NCCL {v}, NCCL_ENQUEUE_REARCH_ENABLE=1"));
    assert!(checked.iter().all(|&k| k == 4), "{checked:?}");
}
