//! The device API on real GPUs: an LSA all-reduce kernel written in CUDA C++, built at run
//! time by nvcc against the loaded NCCL's headers (`examples/device_allreduce/kernel.cu`),
//! launched from Rust on symmetric windows and checked exactly against a host reference on
//! random data, with one rank and with the threaded shape (one GPU per rank, or two ranks
//! sharing GPU 0 with NCCL 2.30+); the typed refusals made before NCCL is asked; and the
//! typed refusal of NCCL before 2.29.2.
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

use std::time::Duration;

use common::shape::{gpus, skip};
use common::threaded::Deadline;
use cudarc::driver::CudaContext;
use nccl::device::kernel::Toolchain;
use nccl::device::{DevComm, DevCommRequirements, DeviceAbi, DEV_COMM_SINCE};
use nccl::{Comm, Error, NcclBuffer, WindowFlags};

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
