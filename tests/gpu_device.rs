//! The device API on real GPUs: an LSA all-reduce kernel written in CUDA C++, built at run
//! time by nvcc against the loaded NCCL's headers (`examples/device_allreduce/kernel.cu`),
//! launched from Rust on symmetric windows and checked exactly against a host reference on
//! random data, with one rank and with the threaded shape (one GPU per rank, or two ranks
//! sharing GPU 0 with NCCL 2.30+); the typed refusals made before NCCL is asked; the
//! typed refusal of NCCL before 2.29.2; the ranks' agreement before `ncclDevCommCreate`
//! (issue 30's J1: one rank refused alone, requirements or ABIs that differ, a rank that
//! cannot take part), each rank creating from its own thread; and the kernel arguments of a
//! window (issue 30's m5: launches on another stream are waited for, peers' window sizes).
//!
//! Longer than 600 lines because every device-API scenario on GPUs lives in this one binary
//! (one build of its kernels' toolchain checks, one line in the suite's summary).
//!
//! Run on a GPU host with `cargo test --test gpu_device -- --include-ignored --test-threads=1`
//! (or `.gpu/run tests gpu_device`), with NCCL 2.32.3 (`NCCL_HOME` holding its include/) and
//! again with the system NCCL 2.28.3. Every test runs under a deadline that aborts the
//! process with a message instead of hanging.

mod common;
// The example's harness; its timing half is the example's alone.
#[allow(dead_code)]
#[path = "../examples/device_allreduce/lsa.rs"]
mod lsa;

use std::time::{Duration, Instant};

use common::shape::{gpus, skip};
use common::threaded::{per_rank, Deadline};
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use nccl::device::kernel::Toolchain;
use nccl::device::{DevComm, DevCommRequirements, DeviceAbi, DEV_COMM_SINCE};
use nccl::{Comm, Error, NcclBuffer, Refusal, Version, WindowFlags};

const LIMIT: Duration = Duration::from_secs(300);

fn library() -> &'static nccl::library::Library {
    nccl::library::get().expect("NCCL loads")
}

/// The toolchain, where the library has the device API; else `None`, said through `skip`.
fn toolchain(test: &str) -> Option<Toolchain> {
    let lib = library();
    if lib.version() < DEV_COMM_SINCE {
        skip(
            test,
            &format!(
                "device communicators need NCCL {DEV_COMM_SINCE}+, loaded {} (see \
                 device_comm_before_2_29_2_is_unsupported)",
                lib.version()
            ),
        );
        return None;
    }
    match Toolchain::find(lib) {
        Ok(toolchain) => Some(toolchain),
        Err(err) => {
            skip(test, &format!("no kernel toolchain here: {err}"));
            None
        }
    }
}

/// One communicator on GPU 0.
fn one_rank() -> Vec<Comm> {
    let stream = CudaContext::new(0)
        .and_then(|ctx| ctx.new_stream())
        .expect("a stream on GPU 0");
    Comm::init_all(&[stream]).expect("ncclCommInitAll(1)")
}

/// The all-reduce check on `comms` for a few sizes (both kernel paths: 2 and 3 floats use
/// scalar loads, the rest float4), asserting exact results on every rank.
fn check_all_reduce(comms: &[Comm], toolchain: &Toolchain) {
    let mut ranks =
        lsa::Ranks::new(comms, toolchain).expect("windows, device communicators, kernel");
    let lsa_size = ranks.check_one_lsa_team().expect("one LSA team");
    assert_eq!(lsa_size, comms.len());
    for (i, bytes) in [8, 12, 64, 4096, 65536, 1 << 20].into_iter().enumerate() {
        ranks
            .check(bytes, 0xd1ce + i as u64)
            .unwrap_or_else(|e| panic!("{bytes} bytes on {} ranks: {e}", comms.len()));
    }
    // Repeated launches reuse the barriers (their epochs advance): still exact.
    for round in 0..3 {
        ranks.check(1 << 16, 77 + round).expect("repeated launches");
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn lsa_allreduce_kernel_one_rank() {
    const TEST: &str = "lsa_allreduce_kernel_one_rank";
    common::shape::setup();
    let Some(toolchain) = toolchain(TEST) else {
        return;
    };
    if gpus(TEST, 1).is_none() {
        return;
    }
    let _deadline = Deadline::new(TEST, LIMIT);
    let comms = one_rank();
    check_all_reduce(&comms, &toolchain);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn lsa_allreduce_kernel_threaded_ranks() {
    const TEST: &str = "lsa_allreduce_kernel_threaded_ranks";
    common::shape::setup();
    let Some(toolchain) = toolchain(TEST) else {
        return;
    };
    let Some(layout) = common::shape::threaded(TEST) else {
        return;
    };
    let _deadline = Deadline::new(TEST, LIMIT);
    let comms = Comm::init_all(&layout.streams()).expect("ncclCommInitAll");
    check_all_reduce(&comms, &toolchain);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn multimem_and_gin_are_refused_before_nccl() {
    const TEST: &str = "multimem_and_gin_are_refused_before_nccl";
    common::shape::setup();
    if library().version() < DEV_COMM_SINCE {
        skip(TEST, "needs NCCL 2.29.2+");
        return;
    }
    if gpus(TEST, 1).is_none() {
        return;
    }
    let _deadline = Deadline::new(TEST, LIMIT);
    let comms = one_rank();
    let props = comms[0].properties().expect("properties");
    assert!(
        props.device_api_support,
        "a one-rank communicator has the device API"
    );
    assert!(
        !props.multimem_support,
        "NVLS must be off here (NCCL_NVLS_ENABLE=0); this test never asks for multicast \
         where it exists"
    );
    // Each is a typed Unavailable from this crate: NCCL's own refusal would be an
    // Error::Nccl (ncclInvalidUsage/ncclInvalidArgument), which these would not match.
    let refusals = lsa::refusals(&comms).expect("typed refusals");
    assert!(
        refusals
            .iter()
            .any(|l| l.starts_with("lsaMultimem refused")),
        "{refusals:?}"
    );
    if matches!(props.gin_type, None | Some(nccl::properties::GinType::None)) {
        assert!(
            refusals.iter().any(|l| l.starts_with("GIN refused")),
            "{refusals:?}"
        );
    }
    let buffer = NcclBuffer::<f32>::alloc_zeros(comms[0].stream(), 1024).expect("ncclMemAlloc");
    let window = comms[0]
        .register_window(buffer, WindowFlags::COLL_SYMMETRIC)
        .expect("a symmetric window");
    match window.lsa_multimem_ptr(0) {
        Err(Error::Unavailable { .. }) => {}
        other => panic!("a multicast pointer without multicast: {other:?}"),
    }
    let ptr = window.lsa_ptr(0, 16).expect("this rank's own LSA pointer");
    assert_eq!(ptr.len(), 1024 - 16);
    assert!(window.lsa_ptr(1, 0).is_err(), "LSA rank 1 of a team of 1");
    // The communicator is untouched: a real device communicator still comes.
    let dev_comm = DevComm::create(
        &comms[0],
        &DevCommRequirements::new().lsa_barriers(1),
        DeviceAbi::new(library().version()),
    )
    .expect("a device communicator after the refusals");
    assert_eq!((dev_comm.rank(), dev_comm.size()), (0, 1));
    assert_eq!(dev_comm.lsa_team().size, 1);
    assert_eq!(comms[0].lsa_team().expect("ncclTeamLsa").size, 1);
    // Device code newer than the library is refused before NCCL too.
    let newer = DeviceAbi::new(nccl::Version::new(2, 99, 0));
    match DevComm::create(&comms[0], &DevCommRequirements::new(), newer) {
        Err(Error::Unsupported { .. }) => {}
        other => panic!("newer device code: {other:?}"),
    }
    dev_comm
        .close()
        .map_err(|(_, e)| e)
        .expect("ncclDevCommDestroy");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn device_comm_before_2_29_2_is_unsupported() {
    const TEST: &str = "device_comm_before_2_29_2_is_unsupported";
    common::shape::setup();
    let lib = library();
    if lib.version() >= DEV_COMM_SINCE {
        skip(
            TEST,
            "runs with an NCCL before 2.29.2 (the system NCCL 2.28.3)",
        );
        return;
    }
    if gpus(TEST, 1).is_none() {
        return;
    }
    let _deadline = Deadline::new(TEST, LIMIT);
    let comms = one_rank();
    let reqs = DevCommRequirements::new().lsa_barriers(1);
    match DevComm::create(&comms[0], &reqs, DeviceAbi::new(lib.version())) {
        Err(Error::Unsupported { needs, found, .. }) => {
            assert_eq!((needs, found), (DEV_COMM_SINCE, lib.version()));
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    // Headers for it are refused as well (too old, or newer than the library).
    assert!(Toolchain::find(lib).is_err());
}

/// Whether the library has device communicators; else says so through `skip`.
fn has_dev_comm(test: &str) -> bool {
    let version = library().version();
    if version < DEV_COMM_SINCE {
        skip(
            test,
            &format!("device communicators need NCCL {DEV_COMM_SINCE}+, loaded {version}"),
        );
        return false;
    }
    true
}

/// Whether every rank of `comms` reports device-API support (one LSA team); else says so
/// through `skip` (every rank would refuse alike, which is not what these tests look at).
fn device_api_on_every_rank(test: &str, comms: &[Comm]) -> bool {
    for comm in comms {
        let props = comm.properties().expect("ncclCommQueryProperties");
        if !props.device_api_support {
            skip(
                test,
                &format!(
                    "rank {} reports no device-API support here (GPUs not in one LSA team)",
                    comm.rank()
                ),
            );
            return false;
        }
    }
    true
}

/// Fast enough for an agreement that is one small all-gather (the J1 hang lasted until the
/// process was killed, 90 s in the report), slack included for the first connection.
const PROMPT: Duration = Duration::from_secs(30);

/// The right device code on every rank creates a device communicator, each from its own
/// thread, after whatever was refused before: nothing of the refused creation stayed queued.
fn create_and_close(comm: &Comm, reqs: &DevCommRequirements) -> (usize, usize) {
    let dev_comm = DevComm::create(comm, reqs, DeviceAbi::new(library().version()))
        .unwrap_or_else(|e| panic!("rank {}: the agreed creation: {e}", comm.rank()));
    let shape = (dev_comm.rank(), dev_comm.size());
    dev_comm
        .close()
        .map_err(|(_, e)| e)
        .unwrap_or_else(|e| panic!("rank {}: ncclDevCommDestroy: {e}", comm.rank()));
    shape
}

/// J1: rank 1's device code is compiled against headers newer than the library (refused
/// before NCCL), rank 0's is right, and each rank calls `DevComm::create` from its own
/// thread. Before the agreement rank 0 entered NCCL's collective creation alone and waited
/// there until killed; now every rank returns at once: rank 1 its own `Unsupported`, rank 0
/// (and any further rank) `RankRefused` naming rank 1 and why. The communicators are
/// untouched.
#[test]
#[ignore = "needs CUDA GPUs"]
fn j1_too_new_abi_on_one_rank_refuses_every_rank_promptly() {
    const TEST: &str = "j1_too_new_abi_on_one_rank_refuses_every_rank_promptly";
    common::shape::setup();
    if !has_dev_comm(TEST) {
        return;
    }
    let Some(layout) = common::shape::threaded(TEST) else {
        return;
    };
    let _deadline = Deadline::new(TEST, LIMIT);
    let comms = Comm::init_all(&layout.streams()).expect("ncclCommInitAll");
    if !device_api_on_every_rank(TEST, &comms) {
        return;
    }
    let library = library().version();
    let newer = Version::new(2, 99, 0);
    let reqs = DevCommRequirements::new().lsa_barriers(2);
    let outcomes = per_rank(comms, |comm, barrier| {
        let abi = DeviceAbi::new(if comm.rank() == 1 { newer } else { library });
        barrier.wait();
        let start = Instant::now();
        let refused = DevComm::create(&comm, &reqs, abi).map(|d| d.rank());
        let took = start.elapsed();
        barrier.wait();
        let made = create_and_close(&comm, &reqs);
        (comm.rank(), comm.size(), refused, took, made)
    });
    for (rank, size, refused, took, made) in outcomes {
        match (rank, refused) {
            (1, Err(Error::Unsupported { needs, found, .. })) => {
                assert_eq!((needs, found), (newer, library));
            }
            (
                _,
                Err(Error::RankRefused {
                    call,
                    rank: refuser,
                    reason,
                }),
            ) if rank != 1 => {
                assert_eq!(
                    (call, refuser, reason),
                    ("ncclDevCommCreate", 1, Refusal::DeviceAbi)
                );
            }
            (rank, other) => panic!("rank {rank}: {other:?}"),
        }
        assert!(took < PROMPT, "rank {rank} took {took:?} to be refused");
        assert_eq!(made, (rank, size), "rank {rank}");
    }
}

/// J1: requirements, and device ABIs, that differ across ranks (each valid on its own rank,
/// so nothing refused them before; NCCL compares nothing and lays each rank's barriers out
/// from its own counts) give every rank the same `RankMismatch`, naming the field and the
/// ranks, before NCCL is asked.
#[test]
#[ignore = "needs CUDA GPUs"]
fn j1_requirements_that_differ_across_ranks_are_refused_on_every_rank() {
    const TEST: &str = "j1_requirements_that_differ_across_ranks_are_refused_on_every_rank";
    common::shape::setup();
    if !has_dev_comm(TEST) {
        return;
    }
    let Some(layout) = common::shape::threaded(TEST) else {
        return;
    };
    let _deadline = Deadline::new(TEST, LIMIT);
    let comms = Comm::init_all(&layout.streams()).expect("ncclCommInitAll");
    if !device_api_on_every_rank(TEST, &comms) {
        return;
    }
    let library = library().version();
    let same = DevCommRequirements::new().lsa_barriers(1);
    let outcomes = per_rank(comms, |comm, barrier| {
        let rank = comm.rank();
        let counts = DevCommRequirements::new().lsa_barriers(1 + rank as u32);
        barrier.wait();
        let start = Instant::now();
        let by_count = DevComm::create(&comm, &counts, DeviceAbi::new(library)).map(|d| d.rank());
        let took = start.elapsed();
        // Rank 1's code built against the oldest headers the library serves: valid alone.
        let abi = DeviceAbi::new(if rank == 1 { DEV_COMM_SINCE } else { library });
        barrier.wait();
        let by_abi = DevComm::create(&comm, &same, abi).map(|d| d.rank());
        barrier.wait();
        let made = create_and_close(&comm, &same);
        (rank, comm.size(), by_count, took, by_abi, made)
    });
    for (rank, size, by_count, took, by_abi, made) in outcomes {
        match by_count {
            Err(Error::RankMismatch {
                call,
                field,
                first,
                expected,
                rank: differs,
                value,
            }) => {
                assert_eq!(call, "ncclDevCommCreate");
                assert_eq!(
                    (field, first, expected, differs, value),
                    ("lsaBarrierCount", 0, 1, 1, 2),
                    "rank {rank}"
                );
            }
            other => panic!("rank {rank}, different barrier counts: {other:?}"),
        }
        assert!(took < PROMPT, "rank {rank} took {took:?}");
        if library == DEV_COMM_SINCE {
            // Both ranks' ABI is the library's: nothing differs.
            assert!(by_abi.is_ok(), "rank {rank}: {by_abi:?}");
        } else {
            match by_abi {
                Err(Error::RankMismatch {
                    field,
                    expected,
                    rank: differs,
                    value,
                    ..
                }) => {
                    assert_eq!(field, "the device code's NCCL header version");
                    assert_eq!(
                        (expected, differs, value),
                        (
                            u64::from(library.code()),
                            1,
                            u64::from(DEV_COMM_SINCE.code())
                        ),
                        "rank {rank}"
                    );
                }
                other => panic!("rank {rank}, different ABIs: {other:?}"),
            }
        }
        assert_eq!(made, (rank, size), "rank {rank}");
    }
}

/// A rank that cannot take part in the agreement at all (here: a `Group` open on its
/// thread, refused at once) leaves its peer in the agreement's exchange, which is bounded
/// by the peer's `ready_timeout` (a blocking communicator too): the peer gets a `Timeout`
/// and its communicator is aborted (the exchange stays queued there), instead of waiting in
/// NCCL for ever.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_rank_that_cannot_take_part_costs_its_peer_only_its_ready_timeout() {
    const TEST: &str = "a_rank_that_cannot_take_part_costs_its_peer_only_its_ready_timeout";
    const READY: Duration = Duration::from_secs(5);
    common::shape::setup();
    if !has_dev_comm(TEST) {
        return;
    }
    let Some(layout) = common::shape::threaded(TEST) else {
        return;
    };
    let _deadline = Deadline::new(TEST, LIMIT);
    let comms = Comm::init_all(&layout.streams()).expect("ncclCommInitAll");
    if !device_api_on_every_rank(TEST, &comms) {
        return;
    }
    let abi = DeviceAbi::new(library().version());
    let reqs = DevCommRequirements::new().lsa_barriers(1);
    let outcomes = per_rank(comms, |mut comm, barrier| {
        // NCCL connects lazily, inside the group end of a blocking communicator's first
        // all-gather of a kind, where no timeout reaches: all-gathers like the agreement's
        // (a few dozen 64-bit words per rank) connect first, on both ranks.
        for words in [14usize, 64, 1024] {
            let stream = comm.stream().clone();
            let send = stream.alloc_zeros::<u64>(words).expect("alloc");
            let mut recv = stream
                .alloc_zeros::<u64>(words * comm.size())
                .expect("alloc");
            comm.all_gather(&send, &mut recv)
                .expect("warm-up all-gather");
            comm.synchronize().expect("warm-up");
        }
        comm.set_ready_timeout(READY);
        comm.set_drop_timeout(READY);
        barrier.wait();
        let start = Instant::now();
        let outcome = if comm.rank() == 1 {
            let group = nccl::Group::start().expect("ncclGroupStart");
            let refused = DevComm::create(&comm, &reqs, abi).map(|d| d.rank());
            group.finish().expect("an empty group ends");
            refused
        } else {
            DevComm::create(&comm, &reqs, abi).map(|d| d.rank())
        };
        let took = start.elapsed();
        // Rank 1 ends its communicator only once its peers have given up.
        barrier.wait();
        (comm.rank(), outcome, took)
    });
    for (rank, outcome, took) in outcomes {
        match (rank, outcome) {
            (1, Err(Error::InvalidUsage(text))) => {
                assert!(text.contains("Group is open"), "{text}");
                assert!(took < PROMPT, "rank 1 took {took:?} to refuse");
            }
            (_, Err(err @ Error::Timeout { .. })) if rank != 1 => {
                let text = err.to_string();
                assert!(text.contains("agreement"), "{text}");
                assert!(text.contains("aborted"), "{text}");
                assert!(
                    took >= READY && took < READY + PROMPT,
                    "rank {rank} gave up after {took:?}, its ready timeout being {READY:?}"
                );
            }
            (rank, other) => panic!("rank {rank}: {other:?}"),
        }
    }
}

/// The kernels of the window-argument test: each waits about `cycles` GPU clocks, then
/// writes `base + i` to element `i` of a window, through its handle or through a pointer.
const SPIN_SOURCE: &str = r#"
#include <nccl_device.h>
__device__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {}
}
extern "C" __global__ void spin_fill_window(ncclWindow_t win, size_t n, float base,
                                            long long cycles) {
  spin(cycles);
  float* out = (float*)ncclGetLocalPointer(win, 0);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = base + (float)i;
}
extern "C" __global__ void spin_fill_ptr(float* out, size_t n, float base, long long cycles) {
  spin(cycles);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = base + (float)i;
}
"#;

/// m5: a kernel that takes a window's handle (`device_window`) or a pointer into it
/// (`lsa_ptr`), launched on a stream other than the window's, is waited for by the window's
/// close and by the next read of its buffer. Before, `DeviceWindow` recorded the kernel on
/// the stream it was made for and `PeerPtr` recorded nothing, so the close deregistered
/// under the still-spinning kernel and the read saw zeros.
#[test]
#[ignore = "needs CUDA GPUs"]
fn m5_window_kernel_arguments_are_waited_for_on_the_stream_they_run_on() {
    const TEST: &str = "m5_window_kernel_arguments_are_waited_for_on_the_stream_they_run_on";
    // About half a second on any current GPU (1 to 2 GHz): far longer than the close and
    // the read take when they do not wait.
    const CYCLES: i64 = 1_000_000_000;
    common::shape::setup();
    let Some(toolchain) = toolchain(TEST) else {
        return;
    };
    if gpus(TEST, 1).is_none() {
        return;
    }
    let _deadline = Deadline::new(TEST, LIMIT);
    let comms = one_rank();
    let comm = &comms[0];
    let ctx = comm.context().clone();
    if !ctx.is_event_tracking() {
        skip(TEST, "cudarc's event tracking is off in this context");
        return;
    }
    let other = ctx.new_stream().expect("a second stream");
    let module = toolchain
        .build(&ctx, SPIN_SOURCE)
        .expect("nvcc builds the kernels");
    let n = 4096usize;
    let cfg = LaunchConfig {
        grid_dim: (4, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let expect = |base: f32| (0..n).map(|i| base + i as f32).collect::<Vec<f32>>();

    // Through the handle.
    let kernel = module
        .function("spin_fill_window")
        .expect("spin_fill_window");
    let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), n).expect("ncclMemAlloc");
    let mut window = comm
        .register_window(buffer, WindowFlags::COLL_SYMMETRIC)
        .expect("a symmetric window");
    let base = 1000.0f32;
    {
        let mut handle = window.device_window().expect("the window as an argument");
        // SAFETY: (ncclWindow_t, size_t, float, long long) as declared; the kernel writes n
        // floats of this rank's window of n.
        unsafe {
            other
                .launch_builder(&kernel)
                .arg(&mut handle)
                .arg(&n)
                .arg(&base)
                .arg(&CYCLES)
                .launch(cfg)
                .expect("launch on the other stream");
        }
    }
    let start = Instant::now();
    let buffer = window.close().map_err(|(_, e)| e).expect("deregistered");
    let closed_after = start.elapsed();
    let got = comm.stream().clone_dtoh(&buffer).expect("read back");
    assert!(
        got == expect(base),
        "the window's buffer was read before the kernel on the other stream wrote it \
         (close took {closed_after:?})"
    );

    // Through a pointer into it (this rank's own LSA pointer).
    let kernel = module.function("spin_fill_ptr").expect("spin_fill_ptr");
    let window = comm
        .register_window(buffer, WindowFlags::COLL_SYMMETRIC)
        .expect("the window again");
    let base = -7.0f32;
    {
        let mut ptr = window.lsa_ptr(0, 0).expect("this rank's LSA pointer");
        assert_eq!(ptr.len(), n);
        // SAFETY: (float*, size_t, float, long long) as declared; `ptr` covers n floats.
        unsafe {
            other
                .launch_builder(&kernel)
                .arg(&mut ptr)
                .arg(&n)
                .arg(&base)
                .arg(&CYCLES)
                .launch(cfg)
                .expect("launch on the other stream");
        }
    }
    let buffer = window.close().map_err(|(_, e)| e).expect("deregistered");
    let got = comm.stream().clone_dtoh(&buffer).expect("read back");
    assert!(
        got == expect(base),
        "the window's buffer was read before the kernel writing through its LSA pointer \
         finished"
    );
}

/// Review: a `DeviceWindow` forgotten (`mem::forget`, safe) after a launch on another
/// stream never joins that kernel into the buffer's events; the window's close must still
/// wait for it (through the handle's own events), not deregister under the running kernel.
#[test]
#[ignore = "needs CUDA GPUs"]
fn m5_a_forgotten_window_handle_is_still_waited_for_by_the_close() {
    const TEST: &str = "m5_a_forgotten_window_handle_is_still_waited_for_by_the_close";
    const CYCLES: i64 = 1_000_000_000;
    common::shape::setup();
    let Some(toolchain) = toolchain(TEST) else {
        return;
    };
    if gpus(TEST, 1).is_none() {
        return;
    }
    let _deadline = Deadline::new(TEST, LIMIT);
    let comms = one_rank();
    let comm = &comms[0];
    let ctx = comm.context().clone();
    if !ctx.is_event_tracking() {
        skip(TEST, "cudarc's event tracking is off in this context");
        return;
    }
    let other = ctx.new_stream().expect("a second stream");
    let module = toolchain
        .build(&ctx, SPIN_SOURCE)
        .expect("nvcc builds the kernels");
    let kernel = module
        .function("spin_fill_window")
        .expect("spin_fill_window");
    let n = 4096usize;
    let cfg = LaunchConfig {
        grid_dim: (4, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), n).expect("ncclMemAlloc");
    let mut window = comm
        .register_window(buffer, WindowFlags::COLL_SYMMETRIC)
        .expect("a symmetric window");
    let base = 31.0f32;
    let mut handle = window.device_window().expect("the window as an argument");
    // SAFETY: (ncclWindow_t, size_t, float, long long) as declared; the kernel writes n
    // floats of this rank's window of n.
    unsafe {
        other
            .launch_builder(&kernel)
            .arg(&mut handle)
            .arg(&n)
            .arg(&base)
            .arg(&CYCLES)
            .launch(cfg)
            .expect("launch on the other stream");
    }
    std::mem::forget(handle);
    let buffer = window.close().map_err(|(_, e)| e).expect("deregistered");
    let got = comm.stream().clone_dtoh(&buffer).expect("read back");
    let expect: Vec<f32> = (0..n).map(|i| base + i as f32).collect();
    assert!(
        got == expect,
        "the close of a window whose kernel handle was forgotten did not wait for the kernel"
    );
}

/// m5: windows of different sizes (NCCL 2.30.7+): a peer's LSA or world pointer covers that
/// peer's window, not this rank's, and an offset past it is refused.
#[test]
#[ignore = "needs CUDA GPUs"]
fn m5_peer_pointers_cover_the_peers_window() {
    const TEST: &str = "m5_peer_pointers_cover_the_peers_window";
    common::shape::setup();
    let version = library().version();
    if version < Version::new(2, 30, 7) {
        skip(
            TEST,
            &format!("windows of different sizes need NCCL 2.30.7+, loaded {version}"),
        );
        return;
    }
    let Some(layout) = common::shape::threaded(TEST) else {
        return;
    };
    let _deadline = Deadline::new(TEST, LIMIT);
    let comms = Comm::init_all(&layout.streams()).expect("ncclCommInitAll");
    let sizes: Vec<usize> = (0..comms.len()).map(|r| 4096 * (r + 1)).collect();
    let buffers = comms
        .iter()
        .zip(&sizes)
        .map(|(c, &n)| NcclBuffer::<f32>::alloc_zeros(c.stream(), n).expect("ncclMemAlloc"))
        .collect();
    let windows = Comm::register_windows(&comms, buffers, WindowFlags::COLL_SYMMETRIC)
        .expect("windows of different sizes");
    let mut checked = 0;
    for (comm, window) in comms.iter().zip(&windows) {
        let lsa = comm.lsa_team().expect("ncclTeamLsa");
        for lsa_rank in 0..lsa.size {
            let world = comm
                .team_rank_to_world(lsa, lsa_rank)
                .expect("ncclTeamRankToWorld");
            let peer = sizes[world];
            let ptr = window.lsa_ptr(lsa_rank, 10).expect("an LSA pointer");
            assert_eq!(
                ptr.len(),
                peer - 10,
                "rank {} -> LSA {lsa_rank}",
                comm.rank()
            );
            let ptr = window.peer_ptr(world, 0).expect("a peer pointer");
            assert_eq!(ptr.len(), peer, "rank {} -> {world}", comm.rank());
            // Offsets must lie inside this rank's window (NCCL's rule) and the target's.
            let own = sizes[comm.rank()];
            for offset in [own, peer, peer + 1] {
                if offset < own && offset < peer {
                    continue;
                }
                let err = window.lsa_ptr(lsa_rank, offset).unwrap_err();
                assert!(matches!(err, Error::InvalidArgument(_)), "{offset}: {err}");
            }
            checked += usize::from(world != comm.rank());
        }
    }
    if checked == 0 {
        skip(TEST, "no rank has a peer in its LSA team here");
    }
}
