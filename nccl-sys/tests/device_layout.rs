//! Layout of the hand-written device-API types against `nccl_device/host.h` 2.32.3 (LP64), and
//! the initializer.

use std::mem::{align_of, offset_of, size_of};

use nccl_sys::*;

#[test]
fn comm_properties_layout_matches_the_header() {
    assert_eq!(size_of::<ncclCommProperties_t>(), 152);
    assert_eq!(align_of::<ncclCommProperties_t>(), 8);
    let offsets = [
        (offset_of!(ncclCommProperties_t, size), 0),
        (offset_of!(ncclCommProperties_t, magic), 8),
        (offset_of!(ncclCommProperties_t, version), 12),
        (offset_of!(ncclCommProperties_t, rank), 16),
        (offset_of!(ncclCommProperties_t, nRanks), 20),
        (offset_of!(ncclCommProperties_t, cudaDev), 24),
        (offset_of!(ncclCommProperties_t, nvmlDev), 28),
        (offset_of!(ncclCommProperties_t, deviceApiSupport), 32),
        (offset_of!(ncclCommProperties_t, multimemSupport), 33),
        (offset_of!(ncclCommProperties_t, ginType), 36),
        (offset_of!(ncclCommProperties_t, nLsaTeams), 40),
        (offset_of!(ncclCommProperties_t, hostRmaSupport), 44),
        (offset_of!(ncclCommProperties_t, railedGinType), 48),
        (offset_of!(ncclCommProperties_t, commHash), 56),
        (offset_of!(ncclCommProperties_t, ginMinStride), 64),
        (offset_of!(ncclCommProperties_t, ginConnectionType), 68),
        (offset_of!(ncclCommProperties_t, ginSupport), 72),
        (
            offset_of!(ncclCommProperties_t, devCommRuntimeVersionSize),
            136,
        ),
        (offset_of!(ncclCommProperties_t, cftSupport), 144),
        (offset_of!(ncclCommProperties_t, cftMulticastSupport), 145),
        (offset_of!(ncclCommProperties_t, cftCountedSupport), 146),
    ];
    for (i, (got, want)) in offsets.into_iter().enumerate() {
        assert_eq!(got, want, "field {i}");
    }
    assert_eq!(size_of::<ncclGinType_t>(), 4);
    assert_eq!(size_of::<ncclGinConnectionType_t>(), 4);
}

#[test]
fn comm_properties_initializer_sets_only_the_header() {
    let props = nccl_comm_properties_initializer();
    assert_eq!(props.size, 152);
    assert_eq!(props.magic, 0xcafe_beef);
    assert_eq!(props.version, 23203);
    assert_eq!(props.rank, 0);
    assert!(!props.hostRmaSupport && !props.deviceApiSupport);
    assert_eq!(props.ginType, ncclGinType_t::NCCL_GIN_TYPE_NONE);
    assert!(props.ginSupport.iter().all(|&b| !b));
    let default = ncclCommProperties_t::default();
    assert_eq!(default.size, props.size);
    assert_eq!(default.version, props.version);
}

/// Offsets from a C11 compile of the 2.32.3 headers (gcc, x86-64, CUDA types stubbed).
#[test]
fn dev_comm_requirements_layout_matches_the_header() {
    type R = ncclDevCommRequirements_t;
    assert_eq!(size_of::<R>(), 120);
    assert_eq!(align_of::<R>(), 8);
    let offsets = [
        (offset_of!(R, size), 0),
        (offset_of!(R, magic), 8),
        (offset_of!(R, version), 12),
        (offset_of!(R, resourceRequirementsList), 16),
        (offset_of!(R, teamRequirementsList), 24),
        (offset_of!(R, lsaMultimem), 32),
        (offset_of!(R, barrierCount), 36),
        (offset_of!(R, lsaBarrierCount), 40),
        (offset_of!(R, railGinBarrierCount), 44),
        (offset_of!(R, lsaLLA2ABlockCount), 48),
        (offset_of!(R, lsaLLA2ASlotCount), 52),
        (offset_of!(R, ginForceEnable), 56),
        (offset_of!(R, ginContextCount), 60),
        (offset_of!(R, ginSignalCount), 64),
        (offset_of!(R, ginCounterCount), 68),
        (offset_of!(R, ginConnectionType), 72),
        (offset_of!(R, ginExclusiveContexts), 76),
        (offset_of!(R, ginQueueDepth), 80),
        (offset_of!(R, ginTrafficClass), 84),
        (offset_of!(R, worldGinBarrierCount), 88),
        (offset_of!(R, ginStrongSignalsRequired), 92),
        (offset_of!(R, ginVaSignalsRequired), 93),
        (offset_of!(R, ginCustomStride), 96),
        (offset_of!(R, ginType), 100),
        (offset_of!(R, useRuntimeVersion), 104),
        (offset_of!(R, cftCaps), 108),
        (offset_of!(R, cftBarrierCount), 112),
    ];
    for (i, (got, want)) in offsets.into_iter().enumerate() {
        assert_eq!(got, want, "field {i}");
    }
}

#[test]
fn dev_comm_requirements_initializer_is_the_headers() {
    let r = nccl_dev_comm_requirements_initializer();
    assert_eq!((r.size, r.magic, r.version), (120, 0xcafe_beef, 23203));
    assert!(r.resourceRequirementsList.is_null() && r.teamRequirementsList.is_null());
    assert!(!r.lsaMultimem && !r.ginForceEnable && !r.useRuntimeVersion);
    assert_eq!(
        (r.barrierCount, r.lsaBarrierCount, r.railGinBarrierCount),
        (0, 0, 0)
    );
    assert_eq!(
        (r.ginContextCount, r.ginSignalCount, r.ginCounterCount),
        (4, 0, 0)
    );
    assert_eq!(
        r.ginConnectionType,
        ncclGinConnectionType_t::NCCL_GIN_CONNECTION_NONE
    );
    assert_eq!(r.ginTrafficClass, i32::MIN);
    assert!(r.ginStrongSignalsRequired && r.ginVaSignalsRequired);
    assert_eq!(r.ginCustomStride, 1);
    assert_eq!(r.ginType, ncclGinType_t::NCCL_GIN_TYPE_NONE);
    assert_eq!((r.cftCaps, r.cftBarrierCount), (NCCL_CFT_NONE, 0));
}

#[test]
fn requirement_lists_and_teams_match_the_header() {
    type D = ncclDevResourceRequirements_t;
    assert_eq!(size_of::<D>(), 56);
    assert_eq!(
        [
            offset_of!(D, next),
            offset_of!(D, bufferSize),
            offset_of!(D, bufferAlign),
            offset_of!(D, outBufferHandle),
            offset_of!(D, ginSignalCount),
            offset_of!(D, ginCounterCount),
            offset_of!(D, outGinSignalStart),
            offset_of!(D, outGinCounterStart),
        ],
        [0, 8, 16, 24, 32, 36, 40, 48]
    );
    type T = ncclTeamRequirements_t;
    assert_eq!(size_of::<T>(), 32);
    assert_eq!(
        [
            offset_of!(T, next),
            offset_of!(T, team),
            offset_of!(T, multimem),
            offset_of!(T, outMultimemHandle),
        ],
        [0, 8, 20, 24]
    );
    assert_eq!((size_of::<ncclTeam_t>(), align_of::<ncclTeam_t>()), (12, 4));
    for size in [
        size_of::<ncclLsaBarrierHandle_t>(),
        size_of::<ncclGinBarrierHandle_t>(),
        size_of::<ncclCftBarrierHandle_t>(),
        size_of::<ncclLLA2AHandle_t>(),
        size_of::<ncclMultimemHandle_t>(),
    ] {
        assert_eq!(size, 8);
    }
    assert_eq!(size_of::<ncclResourceWindow_vidmem_t>(), 16);
}

#[test]
fn dev_comm_layout_matches_the_header() {
    type C = ncclDevComm_t;
    assert_eq!((size_of::<C>(), align_of::<C>()), (248, 8));
    let offsets = [
        (offset_of!(C, magic), 0),
        (offset_of!(C, version), 4),
        (offset_of!(C, rank), 8),
        (offset_of!(C, nRanks), 12),
        (offset_of!(C, nRanks_rcp32), 16),
        (offset_of!(C, lsaRank), 20),
        (offset_of!(C, lsaSize), 24),
        (offset_of!(C, lsaSize_rcp32), 28),
        (offset_of!(C, windowTable), 32),
        (offset_of!(C, resourceWindow), 40),
        (offset_of!(C, resourceWindow_inlined), 48),
        (offset_of!(C, hybridDenseGinBarrier), 64),
        (offset_of!(C, lsaMultimem), 72),
        (offset_of!(C, lsaBarrier), 80),
        (offset_of!(C, railGinBarrier), 88),
        (offset_of!(C, ginConnectionCount), 96),
        (offset_of!(C, backendIndex), 97),
        (offset_of!(C, ginNetDeviceTypes), 98),
        (offset_of!(C, ginHandles), 104),
        (offset_of!(C, ginSignalCount), 136),
        (offset_of!(C, ginCounterCount), 140),
        (offset_of!(C, ginSignalShadows), 144),
        (offset_of!(C, ginContextCount), 152),
        (offset_of!(C, ginConnectionStride), 156),
        (offset_of!(C, ginContextStride), 160),
        (offset_of!(C, ginStrongLegacySignals), 164),
        (offset_of!(C, abortFlag), 168),
        (offset_of!(C, hybridLsaBarrier), 176),
        (offset_of!(C, hybridRailGinBarrier), 184),
        (offset_of!(C, worldGinBarrier), 192),
        (offset_of!(C, ginConnectionStride_rcp32), 200),
        (offset_of!(C, cftRank), 204),
        (offset_of!(C, cftSize), 208),
        (offset_of!(C, cftMultimemRank), 212),
        (offset_of!(C, cftMultimemSize), 216),
        (offset_of!(C, cftMultimemSize_rcp32), 220),
        (offset_of!(C, ucLeId), 224),
        (offset_of!(C, mcLeId), 228),
        (offset_of!(C, cftBarrier), 232),
        (offset_of!(C, cftMultimemBarrier), 240),
    ];
    for (i, (got, want)) in offsets.into_iter().enumerate() {
        assert_eq!(got, want, "field {i}");
    }
}

#[test]
fn device_host_functions_are_listed_once() {
    let names = DEVICE_HOST_FUNCTION_NAMES;
    for (i, name) in names.iter().enumerate() {
        assert!(!names[..i].contains(name), "{name} twice");
    }
    for name in [
        "ncclDevCommCreate",
        "ncclDevCommDestroy",
        "ncclGetLsaDevicePointer",
        "ncclGetPeerDevicePointer",
        "ncclGetLsaMultimemDevicePointer",
        "ncclGetMultimemDevicePointer",
        "ncclTeamWorld",
        "ncclTeamLsa",
        "ncclTeamRail",
        "ncclTeamRankToWorld",
        "ncclTeamRankToLsa",
        "ncclLsaBarrierCreateRequirement",
        "ncclGinBarrierCreateRequirement",
        "ncclCftBarrierCreateRequirement",
        "ncclLLA2ACalcSlots",
        "ncclLLA2ACreateRequirement",
    ] {
        assert!(names.contains(&name), "{name}");
    }
}
