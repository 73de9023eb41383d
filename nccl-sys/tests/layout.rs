//! Sizes, alignments and field offsets of the generated types (as on every 64-bit Linux target
//! NCCL supports), the hand-written constants and the initializers.

use std::mem::{align_of, offset_of, size_of};

use nccl_sys::*;

#[test]
fn struct_sizes_and_alignments() {
    assert_eq!(size_of::<ncclUniqueId>(), 128);
    assert_eq!(align_of::<ncclUniqueId>(), 1);
    assert_eq!(size_of::<ncclUniqueId>(), NCCL_UNIQUE_ID_BYTES);
    assert_eq!(size_of::<ncclConfig_t>(), 120);
    assert_eq!(align_of::<ncclConfig_t>(), 8);
    assert_eq!(size_of::<ncclCollConfig_t>(), 72);
    assert_eq!(align_of::<ncclCollConfig_t>(), 8);
    assert_eq!(size_of::<ncclSimInfo_t>(), 24);
    assert_eq!(align_of::<ncclSimInfo_t>(), 8);
    assert_eq!(size_of::<ncclEncryptionConfig_t>(), 32);
    assert_eq!(align_of::<ncclEncryptionConfig_t>(), 8);
    assert_eq!(size_of::<ncclWaitSignalDesc_t>(), 16);
    assert_eq!(align_of::<ncclWaitSignalDesc_t>(), 4);
    assert_eq!(size_of::<ncclConfigExt_t>(), 24);
}

#[test]
fn handles_are_pointers() {
    assert_eq!(size_of::<ncclComm_t>(), size_of::<*mut u8>());
    assert_eq!(size_of::<ncclWindow_t>(), size_of::<*mut u8>());
    assert_eq!(size_of::<ncclParamHandle_t>(), size_of::<*mut u8>());
    // cudaStream_t / cudaEvent_t are pointers to opaque CUDA structs, as in CUDA's headers.
    let stream: cudaStream_t = std::ptr::null_mut::<CUstream_st>();
    let event: cudaEvent_t = std::ptr::null_mut::<CUevent_st>();
    assert!(stream.is_null() && event.is_null());
    assert_eq!(size_of::<CUstream_st>(), 0);
}

#[test]
fn enum_newtypes_are_four_bytes() {
    macro_rules! four {
        ($($t:ty),*) => {$(
            assert_eq!(size_of::<$t>(), 4, stringify!($t));
            assert_eq!(align_of::<$t>(), 4, stringify!($t));
        )*};
    }
    four!(
        ncclResult_t,
        ncclRedOp_t,
        ncclDataType_t,
        ncclScalarResidence_t,
        ncclCommMemStat_t,
        ncclHostCftMode_t,
        ncclNvlsHostMode_t,
        ncclEncryptionMode_t
    );
}

#[test]
fn config_field_offsets() {
    assert_eq!(offset_of!(ncclConfig_t, size), 0);
    assert_eq!(offset_of!(ncclConfig_t, magic), 8);
    assert_eq!(offset_of!(ncclConfig_t, version), 12);
    assert_eq!(offset_of!(ncclConfig_t, blocking), 16);
    assert_eq!(offset_of!(ncclConfig_t, netName), 32);
    assert_eq!(offset_of!(ncclConfig_t, commName), 48);
    assert_eq!(offset_of!(ncclConfig_t, CTAPolicy), 60);
    assert_eq!(offset_of!(ncclConfig_t, hostCftMode), 108);
    assert_eq!(offset_of!(ncclConfig_t, nvlsHostMode), 112);

    assert_eq!(offset_of!(ncclCollConfig_t, ext), 16);
    assert_eq!(offset_of!(ncclCollConfig_t, algSelection), 40);
    assert_eq!(offset_of!(ncclCollConfig_t, forceAlgSelection), 48);
    assert_eq!(offset_of!(ncclCollConfig_t, userProfilerTag), 56);
    assert_eq!(offset_of!(ncclCollConfig_t, launchCompletionEvent), 64);

    assert_eq!(offset_of!(ncclSimInfo_t, estimatedTime), 16);
    assert_eq!(offset_of!(ncclEncryptionConfig_t, mode), 16);
    assert_eq!(offset_of!(ncclEncryptionConfig_t, psk), 24);
    assert_eq!(offset_of!(ncclConfigExt_t, key), 8);
    assert_eq!(offset_of!(ncclConfigExt_t, val), 16);
}

#[test]
fn config_initializer() {
    let c = nccl_config_initializer();
    assert_eq!(c.size, 120);
    assert_eq!(c.magic, 0xcafe_beef);
    assert_eq!(c.version, 23203);
    for v in [
        c.blocking,
        c.cgaClusterSize,
        c.minCTAs,
        c.maxCTAs,
        c.splitShare,
        c.trafficClass,
        c.collnetEnable,
        c.CTAPolicy,
        c.shrinkShare,
        c.nvlsCTAs,
        c.nChannelsPerNetPeer,
        c.nvlinkCentricSched,
        c.graphUsageMode,
        c.numRmaCtx,
        c.maxP2pPeers,
        c.graphStreamOrdering,
        c.launchOrderImplicit,
        c.numRmaSig,
        c.rmaEagerInit,
        c.hostCftMode,
        c.nvlsHostMode,
    ] {
        assert_eq!(v, NCCL_CONFIG_UNDEF_INT);
        assert_eq!(v, i32::MIN);
    }
    assert!(c.netName.is_null() && c.commName.is_null());
    // The hostCftMode / nvlsHostMode defaults are the UNDEF value too.
    assert_eq!(ncclHostCftMode_t::ncclHostCftDefault.0, c.hostCftMode);
    assert_eq!(
        ncclNvlsHostMode_t::ncclNvlsHostModeDefault.0,
        c.nvlsHostMode
    );

    let d = ncclConfig_t::default();
    assert_eq!(
        (d.size, d.magic, d.version, d.blocking),
        (c.size, c.magic, c.version, c.blocking)
    );
}

#[test]
fn coll_config_initializer() {
    let c = nccl_coll_config_initializer();
    assert_eq!(c.size, 72);
    assert_eq!(c.magic, NCCL_API_MAGIC);
    assert_eq!(c.version, 23203);
    assert!(c.ext.is_null());
    for v in [
        c.minCTAs,
        c.maxCTAs,
        c.nvlsCTAs,
        c.cgaClusterSize,
        c.CTAPolicy,
    ] {
        assert_eq!(v, NCCL_CONFIG_UNDEF_INT);
    }
    assert!(c.algSelection.is_null());
    assert_eq!(c.forceAlgSelection, 1);
    assert_eq!(c.userProfilerTag, 0);
    assert!(c.launchCompletionEvent.is_null());
    assert_eq!(ncclCollConfig_t::default().forceAlgSelection, 1);
}

#[test]
fn sim_info_initializer() {
    let s = nccl_sim_info_initializer();
    assert_eq!(s.size, 24);
    assert_eq!(s.magic, 0x7468_5283);
    assert_eq!(s.version, 23203);
    assert_eq!(s.estimatedTime, -1.0);
    assert_eq!(s.estimatedTime, NCCL_UNDEF_FLOAT);
    assert_eq!(ncclSimInfo_t::default().magic, 0x7468_5283);
}

#[test]
fn encryption_config_initializer() {
    let e = nccl_encryption_config_initializer();
    assert_eq!(e.size, 32);
    assert_eq!(e.magic, NCCL_API_MAGIC);
    assert_eq!(e.version, 23203);
    assert_eq!(e.mode, 0);
    assert!(e.psk.is_null());
    assert_eq!(ncclEncryptionConfig_t::default().size, 32);
}

#[test]
fn version_macro_mirror() {
    assert_eq!(nccl_version_code(2, 8, 4), 2804);
    assert_eq!(nccl_version_code(2, 9, 6), 20906);
    assert_eq!(nccl_version_code(2, 32, 3), 23203);
    assert_eq!(
        nccl_version_code(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH),
        NCCL_VERSION_CODE
    );
    assert_eq!((NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH), (2, 32, 3));
    assert_eq!(NCCL_VERSION_CODE, 23203);
    assert!(NCCL_SUFFIX.is_empty());
}

#[test]
fn macro_constants() {
    assert_eq!(NCCL_SPLIT_NOCOLOR, -1);
    assert_eq!(NCCL_API_MAGIC, 0xcafe_beef);
    assert_eq!(NCCL_UNIQUE_ID_BYTES, 128);
    assert_eq!(NCCL_CONFIG_UNDEF_INT, i32::MIN);
    assert!(NCCL_CONFIG_UNDEF_PTR.is_null());
    assert!(NCCL_COMM_NULL.is_null());
    assert_eq!(
        [
            NCCL_WIN_DEFAULT,
            NCCL_WIN_COLL_SYMMETRIC,
            NCCL_WIN_STRICT_ORDERING,
            NCCL_WIN_GIN_ONLY,
            NCCL_WIN_CFT_COUNTED
        ],
        [0, 1, 2, 4, 8]
    );
    assert_eq!(NCCL_WIN_REQUIRED_ALIGNMENT, 4096);
    assert_eq!(
        [
            NCCL_CTA_POLICY_DEFAULT,
            NCCL_CTA_POLICY_EFFICIENCY,
            NCCL_CTA_POLICY_ZERO
        ],
        [0, 1, 2]
    );
    assert_eq!([NCCL_SHRINK_DEFAULT, NCCL_SHRINK_ABORT], [0, 1]);
    assert_eq!(NCCL_REVOKE_DEFAULT, 0);
    assert_eq!(NCCL_SUSPEND_MEM, 1);
}

#[test]
fn enum_values() {
    assert_eq!(ncclResult_t::ncclSuccess.0, 0);
    assert_eq!(ncclResult_t::ncclInProgress.0, 7);
    assert_eq!(ncclResult_t::ncclTimeout.0, 8);
    assert_eq!(ncclResult_t::ncclNumResults.0, 9);
    assert_eq!(ncclRedOp_t::ncclSum.0, 0);
    assert_eq!(ncclRedOp_t::ncclAvg.0, 4);
    assert_eq!(ncclRedOp_t::ncclNumOps.0, 5);
    assert_eq!(ncclRedOp_t::ncclMaxRedOp.0, 0x7fff_ffff);
    assert_eq!(ncclDataType_t::ncclInt8, ncclDataType_t::ncclChar);
    assert_eq!(ncclDataType_t::ncclBfloat16.0, 9);
    assert_eq!(ncclDataType_t::ncclFloat8e4m3.0, 10);
    assert_eq!(ncclDataType_t::ncclFloat8e5m2.0, 11);
    assert_eq!(ncclDataType_t::ncclNumTypes.0, 12);
    assert_eq!(ncclScalarResidence_t::ncclScalarHostImmediate.0, 1);
    assert_eq!(ncclCommMemStat_t::ncclStatGpuMemTotal.0, 3);
    assert_eq!(ncclHostCftMode_t::ncclHostCftDefault.0, i32::MIN);
    assert_eq!(ncclNvlsHostMode_t::ncclNvlsHostModeDisable.0, i32::MAX);
    assert_eq!(ncclEncryptionMode_t::NCCL_ENCRYPTION_MODE_PSK.0, 1);
    // Values the header does not list are representable (and hashable / comparable).
    let future = ncclResult_t(42);
    assert_ne!(future, ncclResult_t::ncclSuccess);
    let user_op = ncclRedOp_t(ncclRedOp_t::ncclNumOps.0 + 3);
    assert_eq!(format!("{user_op:?}"), "ncclRedOp_t(8)");
    let set: std::collections::HashSet<_> =
        [ncclDataType_t::ncclInt, ncclDataType_t::ncclInt32].into();
    assert_eq!(set.len(), 1);
}
