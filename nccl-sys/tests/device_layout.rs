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
