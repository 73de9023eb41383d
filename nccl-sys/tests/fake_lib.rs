//! Calls through `NcclLib` into a stand-in libnccl (`tests/fake_nccl.c`), built with the C
//! compiler at test time (`$CC`, else `cc`). Checks argument passing, return values, by-value
//! structs and the initializers' layout as seen from C. Skipped when no C compiler works.
#![cfg(target_os = "linux")]

use std::ffi::CStr;
use std::path::PathBuf;
use std::process::Command;

use nccl_sys::*;

fn build_fake_nccl() -> Option<PathBuf> {
    // The source is embedded and written out at run time: the test binary may run on
    // another machine, from another directory, than the one it was built in.
    let dir = std::env::temp_dir().join(format!("nccl-sys-fake-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let src = dir.join("fake_nccl.c");
    std::fs::write(&src, include_str!("fake_nccl.c")).ok()?;
    let out = dir.join("libfakenccl.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(&src)
        .status();
    match status {
        Ok(s) if s.success() => Some(out),
        other => {
            eprintln!("skipping: cannot build the fake libnccl with `{cc}`: {other:?}");
            None
        }
    }
}

#[test]
fn calls_reach_c_with_the_right_abi() {
    let Some(path) = build_fake_nccl() else {
        return;
    };
    // SAFETY: the fake library has no initialisers and implements the nccl.h prototypes.
    let lib = unsafe { NcclLib::open(&path) }.expect("fake libnccl loads");
    assert_eq!(lib.path(), path);
    let implemented = [
        "ncclGetVersion",
        "ncclGetErrorString",
        "ncclResetDebugInit",
        "ncclGetLastError",
        "ncclCommInitRank",
        "ncclCommInitRankConfig",
        "ncclAllReduce",
        "ncclAllReduceConfig",
        "ncclPutSignal",
    ];
    for name in implemented {
        assert!(lib.has_symbol(name), "{name}");
    }
    assert_eq!(
        lib.missing_symbols().len(),
        FUNCTION_NAMES.len() - implemented.len()
    );
    assert!(!lib.has_symbol("ncclCommShrink"));
    // SAFETY: missing, nothing is called.
    let missing = unsafe { lib.ncclCommDestroy(std::ptr::null_mut()) };
    assert_eq!(
        missing,
        Err(MissingSymbol {
            name: "ncclCommDestroy"
        })
    );

    // SAFETY (all calls below): the fake functions only read their scalar arguments, read the
    // structs passed by pointer and write through the out-pointers, which are all valid.
    unsafe {
        let mut version = 0;
        assert_eq!(
            lib.ncclGetVersion(&mut version),
            Ok(ncclResult_t::ncclSuccess)
        );
        assert_eq!(version, NCCL_VERSION_CODE);

        let msg = lib.ncclGetErrorString(ncclResult_t::ncclTimeout).unwrap();
        assert_eq!(CStr::from_ptr(msg).to_str(), Ok("fake: timeout"));

        assert_eq!(lib.ncclResetDebugInit(), Ok(()));
        assert_eq!(lib.ncclResetDebugInit(), Ok(()));
        let msg = lib.ncclGetLastError(NCCL_COMM_NULL).unwrap();
        assert_eq!(CStr::from_ptr(msg).to_str(), Ok("reset 2"));

        // ncclUniqueId (128 bytes) is passed by value.
        let mut id = ncclUniqueId { internal: [0; 128] };
        id.internal[0] = 1;
        id.internal[127] = 2;
        let mut comm: ncclComm_t = NCCL_COMM_NULL;
        assert_eq!(
            lib.ncclCommInitRank(&mut comm, 4, id, 3),
            Ok(ncclResult_t::ncclSuccess)
        );
        assert_eq!(comm as usize, (1 + 2 * 128) * 1000 + 4 * 10 + 3);

        let mut config = nccl_config_initializer();
        config.blocking = 0;
        assert_eq!(
            lib.ncclCommInitRankConfig(&mut comm, 2, id, 1, &mut config),
            Ok(ncclResult_t::ncclSuccess)
        );
        assert_eq!(comm as usize, 21);
        let mut untouched = ncclConfig_t::default();
        assert_eq!(
            lib.ncclCommInitRankConfig(&mut comm, 2, id, 1, &mut untouched),
            Ok(ncclResult_t::ncclInvalidArgument)
        );

        let args = (0x1000 as *const _, 0x2000 as *mut _, (1usize << 40) + 3);
        let (comm, stream) = (0x3000 as ncclComm_t, 0x4000 as cudaStream_t);
        let (f8, avg) = (ncclDataType_t::ncclFloat8e5m2, ncclRedOp_t::ncclAvg);
        assert_eq!(
            lib.ncclAllReduce(args.0, args.1, args.2, f8, avg, comm, stream),
            Ok(ncclResult_t::ncclSuccess)
        );
        assert_eq!(
            lib.ncclAllReduce(
                args.0,
                args.1,
                args.2,
                f8,
                ncclRedOp_t::ncclSum,
                comm,
                stream
            ),
            Ok(ncclResult_t::ncclInvalidArgument)
        );
        let coll = nccl_coll_config_initializer();
        assert_eq!(
            lib.ncclAllReduceConfig(args.0, args.1, args.2, f8, avg, comm, stream, &coll),
            Ok(ncclResult_t::ncclSuccess)
        );

        let rc = lib.ncclPutSignal(
            0x10 as *const _,
            20,
            ncclDataType_t::ncclFloat32,
            -3,
            0x50 as ncclWindow_t,
            1 << 33,
            70,
            80,
            0xffff_fff0,
            0xa0 as ncclComm_t,
            0xb0 as cudaStream_t,
        );
        assert_eq!(rc, Ok(ncclResult_t::ncclSuccess));
    }
    comm_properties_reach_c_with_the_header_layout(&lib);
}

/// `ncclCommQueryProperties` (a device-API host function) with the header's struct layout.
/// Called from the test above, which built the fake library (one build per process).
fn comm_properties_reach_c_with_the_header_layout(lib: &NcclLib) {
    assert!(lib.has_symbol("ncclCommQueryProperties"));
    assert_eq!(DEVICE_HOST_FUNCTION_NAMES[0], "ncclCommQueryProperties");
    assert!(DEVICE_HOST_FUNCTION_NAMES.contains(&"ncclDevCommCreate"));
    let mut props = nccl_comm_properties_initializer();
    // SAFETY: the fake reads the header fields and writes every field of the struct.
    let rc = unsafe { lib.ncclCommQueryProperties(7 as ncclComm_t, &mut props) };
    assert_eq!(rc, Ok(ncclResult_t::ncclSuccess));
    assert_eq!(props.rank, 7);
    assert_eq!(props.nRanks, 20);
    assert_eq!(props.cudaDev, 24);
    assert_eq!(props.nvmlDev, 28);
    assert!(props.deviceApiSupport && !props.multimemSupport);
    assert_eq!(props.ginType, ncclGinType_t::NCCL_GIN_TYPE_GDAKI);
    assert_eq!(props.nLsaTeams, 40);
    assert!(props.hostRmaSupport);
    assert_eq!(props.railedGinType, ncclGinType_t::NCCL_GIN_TYPE_PROXY);
    assert_eq!(props.commHash, 0x0123_4567_89ab_cdef);
    assert_eq!(props.ginMinStride, 64);
    assert_eq!(
        props.ginConnectionType,
        ncclGinConnectionType_t::NCCL_GIN_CONNECTION_FULL
    );
    let supported: Vec<usize> = (0..64).filter(|&i| props.ginSupport[i]).collect();
    assert_eq!(supported, [2, 3]);
    assert_eq!(props.devCommRuntimeVersionSize, 136);
    assert!(props.cftSupport && !props.cftMulticastSupport && props.cftCountedSupport);

    // A struct not made by the initializer is refused, as NCCL refuses it.
    let mut wrong = nccl_comm_properties_initializer();
    wrong.magic = 0;
    // SAFETY: as above.
    let rc = unsafe { lib.ncclCommQueryProperties(NCCL_COMM_NULL, &mut wrong) };
    assert_eq!(rc, Ok(ncclResult_t::ncclInvalidArgument));
    device_functions_reach_c(lib);
}

/// Teams by value, rank translation, a requirement helper; and functions the library lacks
/// (as 2.32.3 lacks `ncclCftBarrierCreateRequirement`) are `MissingSymbol`, not a crash.
fn device_functions_reach_c(lib: &NcclLib) {
    // SAFETY: the fake only reads the handle's value.
    let team = unsafe { lib.ncclTeamLsa(5 as ncclComm_t) }.unwrap();
    assert_eq!(
        team,
        ncclTeam_t {
            nRanks: 5,
            rank: 3,
            stride: 1
        }
    );
    // SAFETY: as above; the team is passed by value.
    let world = unsafe { lib.ncclTeamRankToWorld(100 as ncclComm_t, team, 4) }.unwrap();
    assert_eq!(world, 101);
    let mut handle = ncclLsaBarrierHandle_t::default();
    let mut req = ncclDevResourceRequirements_t::default();
    // SAFETY: both out-pointers are valid for writes.
    let rc = unsafe { lib.ncclLsaBarrierCreateRequirement(team, 2, &mut handle, &mut req) };
    assert_eq!(rc, Ok(ncclResult_t::ncclSuccess));
    assert_eq!(handle.nBarriers, 2);
    assert_eq!(req.bufferSize, (3 * 2 + 2 * 5) * 4);
    assert_eq!(req.bufferAlign, 4);
    assert_eq!(req.outBufferHandle, &raw mut handle.bufHandle);
    let mut cft = ncclCftBarrierHandle_t::default();
    // SAFETY: the function is missing, so nothing is called.
    let missing = unsafe { lib.ncclCftBarrierCreateRequirement(team, 1, &mut cft, &mut req) };
    assert_eq!(
        missing,
        Err(MissingSymbol {
            name: "ncclCftBarrierCreateRequirement"
        })
    );
    assert!(!lib.has_symbol("ncclDevCommCreate"));
}
