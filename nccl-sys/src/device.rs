//! The host side of NCCL's device API that a host program needs, written by hand.
//!
//! These items are declared in `nccl_device/host.h` (2.32.3; `nccl_device/core.h` before
//! 2.31), not in `nccl.h`, so the generator does not reach them. They follow the generated
//! code's conventions: C names, `#[repr(C)]` structs deriving `Debug, Copy, Clone`, C enums as
//! `#[repr(transparent)]` newtypes, layout assertions, and functions called through
//! [`NcclLib`](crate::NcclLib) that report a library lacking them as
//! [`MissingSymbol`](crate::MissingSymbol).
//!
//! Bound: [`ncclCommQueryProperties`](crate::NcclLib::ncclCommQueryProperties), device
//! communicators (`ncclDevCommCreate`/`Destroy` with [`ncclDevCommRequirements_t`] and its
//! initializer [`nccl_dev_comm_requirements_initializer`]), teams and rank translation, the
//! window pointer queries, and the resource-requirement helpers (barriers, LL all-to-all).
//! The rest of the device API is inline device code for CUDA kernels.
//!
//! `ncclCftBarrierCreateRequirement` is declared by the 2.32.3 header but not exported by the
//! 2.32.3 library: like every function here it is looked up when the library is opened, and a
//! call reports [`MissingSymbol`](crate::MissingSymbol) where it is absent.
//!
//! # Versions of `ncclDevCommRequirements_t` and `ncclDevComm`
//!
//! The requirements struct carries `size`, `magic` and `version` since 2.29.2 (2.28's had
//! none, and its layout changed between 2.28.3 and 2.28.9). NCCL reads them as follows
//! (`ncclDevCommCreate` in `src/dev_runtime.cc`): a wrong `magic` is `ncclInvalidUsage`; a
//! `version` newer than the library is `ncclInvalidUsage` (unless `NCCL_ENABLE_VERSION_CHECK=0`);
//! from 2.30 the struct is copied with `memcpy(dst, src, src->size)` into the library's own
//! struct, so `size` must never exceed the library's `sizeof` (2.29 copies its whole `sizeof`
//! from the caller's struct, which this full 2.32.3 struct always covers). Fields are only
//! ever appended (checked against the tags 2.29.2 to 2.31.0a7 and the 2.32.3 header):
//!
//! | `version` | `sizeof(ncclDevCommRequirements_t)` | fields added |
//! |---|---|---|
//! | 2.29.2 | 72 | up to `ginCounterCount` |
//! | 2.29.7 | 88 | `ginConnectionType`, `ginExclusiveContexts`, `ginQueueDepth` |
//! | 2.30.3 | 96 | `ginTrafficClass`, `worldGinBarrierCount` |
//! | 2.30.7 | 96 | `ginStrongSignalsRequired`, `ginVaSignalsRequired` (in former padding) |
//! | 2.32.3 | 120 | `ginCustomStride`, `ginType`, `useRuntimeVersion`, `cftCaps`, `cftBarrierCount` |
//!
//! The `version` also picks the layout of the [`ncclDevComm_t`] NCCL writes: a library given an
//! older version writes that version's layout (2.29.2/2.29.3 and 2.29.5 to 2.29.7 had no
//! `magic`/`version` at its start; 224 bytes in 2.29.7), so the version must be the one the
//! kernels reading it were compiled with. [`ncclDevComm_v23200`] is the 2.32.3 layout.
//!
//! # Versions of `ncclCommProperties_t`
//!
//! The struct is append-only from NCCL 2.29.7 on, and NCCL fills in what the `version` field
//! names (`ncclCommQueryProperties` in `src/dev_runtime.cc`, 2.29.7 and 2.30.7):
//!
//! | fields | written since |
//! |---|---|
//! | `rank`, `nRanks`, `cudaDev`, `nvmlDev`, `deviceApiSupport`, `multimemSupport` | 2.29.2 |
//! | `ginType`, `nLsaTeams`, `hostRmaSupport`, `railedGinType` | 2.29.4 (`version > 2.29.3`) |
//! | `commHash`, `ginMinStride`, `ginConnectionType`, `ginSupport`, `devCommRuntimeVersionSize` | 2.31 |
//! | `cftSupport`, `cftMulticastSupport`, `cftCountedSupport` | 2.32 |
//!
//! 2.29.2 and 2.29.3 declared `ncclGinType_t` as a one-byte enum right after
//! `multimemSupport`, where this layout has padding; later libraries asked with a 2.29.2 or
//! 2.29.3 `version` report no GIN there. NCCL refuses a `version` newer than itself
//! (`ncclInvalidUsage`), so pass the older of the library's version and
//! [`NCCL_VERSION_CODE`].

use core::ffi::{c_int, c_uint, c_void};
use core::mem::size_of;

use crate::bindings::{ncclComm_t, ncclResult_t, ncclWindow_t, NCCL_API_MAGIC, NCCL_VERSION_CODE};
use crate::consts::NCCL_CONFIG_UNDEF_INT;

/// `ncclGinType_t`: a GPU-initiated networking backend.
#[repr(transparent)]
#[derive(Debug, Copy, Clone, Hash, PartialEq, Eq)]
pub struct ncclGinType_t(pub c_uint);

impl ncclGinType_t {
    /// `NCCL_GIN_TYPE_NONE` (0): no GIN backend.
    pub const NCCL_GIN_TYPE_NONE: ncclGinType_t = ncclGinType_t(0);
    /// `NCCL_GIN_TYPE_PROXY` (2): GIN through a CPU proxy.
    pub const NCCL_GIN_TYPE_PROXY: ncclGinType_t = ncclGinType_t(2);
    /// `NCCL_GIN_TYPE_GDAKI` (3): GPUDirect Async kernel-initiated.
    pub const NCCL_GIN_TYPE_GDAKI: ncclGinType_t = ncclGinType_t(3);
    /// `NCCL_GIN_TYPE_GPI` (4, 2.30.7).
    pub const NCCL_GIN_TYPE_GPI: ncclGinType_t = ncclGinType_t(4);
    /// `NCCL_GIN_TYPE_EFA_GDA` (5, 2.31).
    pub const NCCL_GIN_TYPE_EFA_GDA: ncclGinType_t = ncclGinType_t(5);
    /// `NCCL_GIN_MAX_TYPES` (6): the number of slots of `ginSupport` in use.
    pub const NCCL_GIN_MAX_TYPES: ncclGinType_t = ncclGinType_t(6);
}

/// `ncclGinConnectionType_t` (2.29.7): which ranks a GIN context connects.
#[repr(transparent)]
#[derive(Debug, Copy, Clone, Hash, PartialEq, Eq)]
pub struct ncclGinConnectionType_t(pub c_uint);

impl ncclGinConnectionType_t {
    /// `NCCL_GIN_CONNECTION_NONE` (0).
    pub const NCCL_GIN_CONNECTION_NONE: ncclGinConnectionType_t = ncclGinConnectionType_t(0);
    /// `NCCL_GIN_CONNECTION_FULL` (1): every rank.
    pub const NCCL_GIN_CONNECTION_FULL: ncclGinConnectionType_t = ncclGinConnectionType_t(1);
    /// `NCCL_GIN_CONNECTION_RAIL` (2): the ranks of the same rail.
    pub const NCCL_GIN_CONNECTION_RAIL: ncclGinConnectionType_t = ncclGinConnectionType_t(2);
    /// `NCCL_GIN_CONNECTION_CUSTOM_STRIDE` (3, 2.32).
    pub const NCCL_GIN_CONNECTION_CUSTOM_STRIDE: ncclGinConnectionType_t =
        ncclGinConnectionType_t(3);
}

/// `struct ncclCommProperties` of `nccl_device/host.h` 2.32.3; see the [module docs](self)
/// for which fields each library version fills in.
#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct ncclCommProperties_v23200 {
    /// Internal: `sizeof(ncclCommProperties_t)`.
    pub size: usize,
    /// Internal: `NCCL_API_MAGIC`.
    pub magic: c_uint,
    /// Internal: the NCCL version the caller was built for.
    pub version: c_uint,
    /// The rank in the communicator.
    pub rank: c_int,
    /// The number of ranks.
    pub nRanks: c_int,
    /// The CUDA device ordinal.
    pub cudaDev: c_int,
    /// The NVML device index.
    pub nvmlDev: c_int,
    /// Whether device communicators (`ncclDevCommCreate`) can be made: symmetric memory works.
    pub deviceApiSupport: bool,
    /// Whether NVLink SHARP multicast memory is available to the device API.
    pub multimemSupport: bool,
    /// The GIN backend (2.29.4).
    pub ginType: ncclGinType_t,
    /// The number of load/store-accessible (NVLink) teams (2.29.4).
    pub nLsaTeams: c_int,
    /// Whether host-initiated one-sided RMA (`ncclPutSignal`...) works (2.29.4).
    pub hostRmaSupport: bool,
    /// The GIN backend between rails (2.29.4).
    pub railedGinType: ncclGinType_t,
    /// The communicator's hash, as in NCCL's logs (2.31).
    pub commHash: u64,
    /// The smallest rank stride GIN can connect (2.31).
    pub ginMinStride: c_int,
    /// The GIN connection type (2.31).
    pub ginConnectionType: ncclGinConnectionType_t,
    /// `ginSupport[i]`: whether GIN type `i` is supported (2.31).
    pub ginSupport: [bool; 64usize],
    /// The size of `ncclDevComm` for device code JIT-compiled against this library (2.31).
    pub devCommRuntimeVersionSize: usize,
    /// Whether copy-engine fabric transfers (CFT) work (2.32).
    pub cftSupport: bool,
    /// Whether CFT multicast works (2.32).
    pub cftMulticastSupport: bool,
    /// Whether CFT counted endpoints work (2.32).
    pub cftCountedSupport: bool,
}

#[allow(clippy::unnecessary_operation, clippy::identity_op)]
const _: () = {
    ["Size of ncclCommProperties_v23200"][size_of::<ncclCommProperties_v23200>() - 152usize];
    ["Alignment of ncclCommProperties_v23200"]
        [::core::mem::align_of::<ncclCommProperties_v23200>() - 8usize];
    ["Offset of field: ncclCommProperties_v23200::version"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, version) - 12usize];
    ["Offset of field: ncclCommProperties_v23200::rank"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, rank) - 16usize];
    ["Offset of field: ncclCommProperties_v23200::deviceApiSupport"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, deviceApiSupport) - 32usize];
    ["Offset of field: ncclCommProperties_v23200::multimemSupport"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, multimemSupport) - 33usize];
    ["Offset of field: ncclCommProperties_v23200::ginType"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, ginType) - 36usize];
    ["Offset of field: ncclCommProperties_v23200::nLsaTeams"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, nLsaTeams) - 40usize];
    ["Offset of field: ncclCommProperties_v23200::hostRmaSupport"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, hostRmaSupport) - 44usize];
    ["Offset of field: ncclCommProperties_v23200::railedGinType"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, railedGinType) - 48usize];
    ["Offset of field: ncclCommProperties_v23200::commHash"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, commHash) - 56usize];
    ["Offset of field: ncclCommProperties_v23200::ginMinStride"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, ginMinStride) - 64usize];
    ["Offset of field: ncclCommProperties_v23200::ginConnectionType"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, ginConnectionType) - 68usize];
    ["Offset of field: ncclCommProperties_v23200::ginSupport"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, ginSupport) - 72usize];
    ["Offset of field: ncclCommProperties_v23200::devCommRuntimeVersionSize"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, devCommRuntimeVersionSize) - 136usize];
    ["Offset of field: ncclCommProperties_v23200::cftSupport"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, cftSupport) - 144usize];
    ["Offset of field: ncclCommProperties_v23200::cftCountedSupport"]
        [::core::mem::offset_of!(ncclCommProperties_v23200, cftCountedSupport) - 146usize];
};

/// `ncclCommProperties_t` as declared by the 2.32.3 headers.
pub type ncclCommProperties_t = ncclCommProperties_v23200;

/// `NCCL_COMM_PROPERTIES_INITIALIZER`: `size`, `magic` and `version` set as the 2.32.3 header
/// sets them, every other field zero (false, 0, `NCCL_GIN_TYPE_NONE`).
#[must_use]
pub const fn nccl_comm_properties_initializer() -> ncclCommProperties_t {
    ncclCommProperties_t {
        size: size_of::<ncclCommProperties_t>(),
        magic: NCCL_API_MAGIC,
        version: NCCL_VERSION_CODE as c_uint,
        rank: 0,
        nRanks: 0,
        cudaDev: 0,
        nvmlDev: 0,
        deviceApiSupport: false,
        multimemSupport: false,
        ginType: ncclGinType_t::NCCL_GIN_TYPE_NONE,
        nLsaTeams: 0,
        hostRmaSupport: false,
        railedGinType: ncclGinType_t::NCCL_GIN_TYPE_NONE,
        commHash: 0,
        ginMinStride: 0,
        ginConnectionType: ncclGinConnectionType_t::NCCL_GIN_CONNECTION_NONE,
        ginSupport: [false; 64],
        devCommRuntimeVersionSize: 0,
        cftSupport: false,
        cftMulticastSupport: false,
        cftCountedSupport: false,
    }
}

/// Same as [`nccl_comm_properties_initializer`].
impl Default for ncclCommProperties_t {
    fn default() -> Self {
        nccl_comm_properties_initializer()
    }
}

/// `ncclTeam_t`: a set of ranks, `nRanks` of them `stride` apart, this rank being `rank`.
#[repr(C)]
#[derive(Debug, Copy, Clone, Default, Hash, PartialEq, Eq)]
pub struct ncclTeam_t {
    /// The number of ranks in the team.
    pub nRanks: c_int,
    /// This rank's index in the team.
    pub rank: c_int,
    /// The distance, in world ranks, between consecutive team members.
    pub stride: c_int,
}

/// `ncclDevResourceHandle_t`: a buffer in a device communicator's resource window.
pub type ncclDevResourceHandle_t = u32;
/// `ncclGinSignal_t`: the index of a GIN signal.
pub type ncclGinSignal_t = u32;
/// `ncclGinCounter_t`: the index of a GIN counter.
pub type ncclGinCounter_t = u32;
/// `ncclCftLeId`: a copy-engine fabric logical endpoint id.
pub type ncclCftLeId = u32;

/// `ncclLsaBarrierHandle_t`: a set of barriers over an LSA team.
#[repr(C)]
#[derive(Debug, Copy, Clone, Default, PartialEq, Eq)]
pub struct ncclLsaBarrierHandle_t {
    /// The barriers' buffer, assigned by `ncclDevCommCreate`.
    pub bufHandle: ncclDevResourceHandle_t,
    /// How many barriers.
    pub nBarriers: c_int,
}

/// `ncclGinBarrierHandle_t`: a set of GIN barriers.
#[repr(C)]
#[derive(Debug, Copy, Clone, Default, PartialEq, Eq)]
pub struct ncclGinBarrierHandle_t {
    /// The first of the barriers' signals.
    pub signal0: ncclGinSignal_t,
    /// Unused by NCCL 2.32.3.
    pub unused: ncclDevResourceHandle_t,
}

/// `ncclCftBarrierHandle_t`: a set of copy-engine fabric barriers.
#[repr(C)]
#[derive(Debug, Copy, Clone, Default, PartialEq, Eq)]
pub struct ncclCftBarrierHandle_t {
    /// The barriers' buffer, assigned by `ncclDevCommCreate`.
    pub bufHandle: ncclDevResourceHandle_t,
    /// How many barriers.
    pub nBarriers: c_int,
}

/// `ncclLLA2AHandle_t`: low-latency all-to-all slots.
#[repr(C)]
#[derive(Debug, Copy, Clone, Default, PartialEq, Eq)]
pub struct ncclLLA2AHandle_t {
    /// The slots' buffer, assigned by `ncclDevCommCreate`.
    pub bufHandle: ncclDevResourceHandle_t,
    /// Slots per block.
    pub nSlots: u32,
}

/// `ncclMultimemHandle_t`: the base of a team's multicast mapping.
#[repr(C)]
#[derive(Debug, Copy, Clone, PartialEq, Eq)]
pub struct ncclMultimemHandle_t {
    /// The multicast base address (device), NULL without multicast.
    pub mcBasePtr: *mut c_void,
}

/// `ncclCftTeamMode_t`: how `ncclTeamCft` groups ranks.
#[repr(transparent)]
#[derive(Debug, Copy, Clone, Hash, PartialEq, Eq)]
pub struct ncclCftTeamMode_t(pub c_uint);

impl ncclCftTeamMode_t {
    /// `NCCL_CFT_TEAM_FLAT` (0).
    pub const NCCL_CFT_TEAM_FLAT: ncclCftTeamMode_t = ncclCftTeamMode_t(0);
    /// `NCCL_CFT_TEAM_HIER_MULTIMEM` (1).
    pub const NCCL_CFT_TEAM_HIER_MULTIMEM: ncclCftTeamMode_t = ncclCftTeamMode_t(1);
    /// `NCCL_CFT_TEAM_HIER_LSA` (2).
    pub const NCCL_CFT_TEAM_HIER_LSA: ncclCftTeamMode_t = ncclCftTeamMode_t(2);
}

/// `NCCL_CFT_NONE`: no copy-engine fabric capability (`ncclCftCap_t`, a bit mask in
/// [`ncclDevCommRequirements_t::cftCaps`]).
pub const NCCL_CFT_NONE: c_int = 0x0;
/// `NCCL_CFT`: copy-engine fabric transfers.
pub const NCCL_CFT: c_int = 0x1;
/// `NCCL_CFT_MULTIMEM`: copy-engine fabric multicast.
pub const NCCL_CFT_MULTIMEM: c_int = 0x2;

/// `ncclDevResourceRequirements_t`: one extra buffer (and GIN signals/counters) a device
/// communicator must provide, in a singly linked list. The `out*` pointers are written by
/// `ncclDevCommCreate` (when its group ends), so they must stay valid until then.
#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct ncclDevResourceRequirements_t {
    /// The next requirement, or NULL.
    pub next: *mut ncclDevResourceRequirements_t,
    /// Buffer size in bytes.
    pub bufferSize: usize,
    /// Buffer alignment in bytes.
    pub bufferAlign: usize,
    /// If non-null, receives the buffer's handle.
    pub outBufferHandle: *mut ncclDevResourceHandle_t,
    /// GIN signals wanted.
    pub ginSignalCount: c_int,
    /// GIN counters wanted.
    pub ginCounterCount: c_int,
    /// If non-null, receives the first signal.
    pub outGinSignalStart: *mut ncclGinSignal_t,
    /// If non-null, receives the first counter.
    pub outGinCounterStart: *mut ncclGinCounter_t,
}

/// Empty: no buffer, no signals, every pointer NULL (what the `Create*Requirement` helpers
/// overwrite).
impl Default for ncclDevResourceRequirements_t {
    fn default() -> Self {
        Self {
            next: core::ptr::null_mut(),
            bufferSize: 0,
            bufferAlign: 0,
            outBufferHandle: core::ptr::null_mut(),
            ginSignalCount: 0,
            ginCounterCount: 0,
            outGinSignalStart: core::ptr::null_mut(),
            outGinCounterStart: core::ptr::null_mut(),
        }
    }
}

/// `ncclTeamRequirements_t`: a team a device communicator must provide (with multicast), in a
/// singly linked list.
#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct ncclTeamRequirements_t {
    /// The next requirement, or NULL.
    pub next: *mut ncclTeamRequirements_t,
    /// The team.
    pub team: ncclTeam_t,
    /// Whether the team needs multicast memory.
    pub multimem: bool,
    /// If non-null, receives the team's multicast handle.
    pub outMultimemHandle: *mut ncclMultimemHandle_t,
}

/// `struct ncclDevCommRequirements` of `nccl_device/host.h` 2.32.3; see the
/// [module docs](self) for the older layouts (prefixes of this one).
#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct ncclDevCommRequirements_v23200 {
    /// Internal: the size of the struct as the caller's headers declare it.
    pub size: usize,
    /// Internal: `NCCL_API_MAGIC`.
    pub magic: c_uint,
    /// Internal: the NCCL version the device code was compiled with.
    pub version: c_uint,
    /// Extra buffers, or NULL.
    pub resourceRequirementsList: *mut ncclDevResourceRequirements_t,
    /// Extra teams, or NULL.
    pub teamRequirementsList: *mut ncclTeamRequirements_t,
    /// Multicast memory on the LSA team (needs NVLink SHARP).
    pub lsaMultimem: bool,
    /// Hybrid (LSA + rail GIN) barriers.
    pub barrierCount: c_int,
    /// Barriers over the LSA team.
    pub lsaBarrierCount: c_int,
    /// GIN barriers over the rail team.
    pub railGinBarrierCount: c_int,
    /// LL all-to-all blocks over the LSA team.
    pub lsaLLA2ABlockCount: c_int,
    /// LL all-to-all slots per block.
    pub lsaLLA2ASlotCount: c_int,
    /// Deprecated: turns GIN on with a full connection.
    pub ginForceEnable: bool,
    /// GIN contexts wanted (a hint).
    pub ginContextCount: c_int,
    /// GIN signals, numbered from 0.
    pub ginSignalCount: c_int,
    /// GIN counters, numbered from 0.
    pub ginCounterCount: c_int,
    /// Which ranks GIN connects (2.29.7).
    pub ginConnectionType: ncclGinConnectionType_t,
    /// Exclusive GIN contexts (2.29.7).
    pub ginExclusiveContexts: bool,
    /// GIN queue depth (2.29.7).
    pub ginQueueDepth: c_int,
    /// GIN traffic class (2.30.3).
    pub ginTrafficClass: c_int,
    /// GIN barriers over the world team (2.30.3).
    pub worldGinBarrierCount: c_int,
    /// Whether kernels use GIN strong signals (2.30.7).
    pub ginStrongSignalsRequired: bool,
    /// Whether kernels use GIN VA signals (2.30.7).
    pub ginVaSignalsRequired: bool,
    /// The rank stride for `NCCL_GIN_CONNECTION_CUSTOM_STRIDE` (2.32).
    pub ginCustomStride: c_int,
    /// The GIN backend wanted, `NCCL_GIN_TYPE_NONE` for any (2.32).
    pub ginType: ncclGinType_t,
    /// Lay the device communicator out as the library's own version (JIT-compiled device
    /// code; 2.32.3).
    pub useRuntimeVersion: bool,
    /// Copy-engine fabric capabilities, a mask of `NCCL_CFT*` (2.32).
    pub cftCaps: c_int,
    /// Copy-engine fabric barriers (2.32).
    pub cftBarrierCount: c_int,
}

/// `ncclDevCommRequirements_t` as declared by the 2.32.3 headers.
pub type ncclDevCommRequirements_t = ncclDevCommRequirements_v23200;

/// `NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER` of the 2.32.3 header, field by field.
#[must_use]
pub const fn nccl_dev_comm_requirements_initializer() -> ncclDevCommRequirements_t {
    ncclDevCommRequirements_t {
        size: size_of::<ncclDevCommRequirements_t>(),
        magic: NCCL_API_MAGIC,
        version: NCCL_VERSION_CODE as c_uint,
        resourceRequirementsList: core::ptr::null_mut(),
        teamRequirementsList: core::ptr::null_mut(),
        lsaMultimem: false,
        barrierCount: 0,
        lsaBarrierCount: 0,
        railGinBarrierCount: 0,
        lsaLLA2ABlockCount: 0,
        lsaLLA2ASlotCount: 0,
        ginForceEnable: false,
        ginContextCount: 4,
        ginSignalCount: 0,
        ginCounterCount: 0,
        ginConnectionType: ncclGinConnectionType_t::NCCL_GIN_CONNECTION_NONE,
        ginExclusiveContexts: false,
        ginQueueDepth: 0,
        ginTrafficClass: NCCL_CONFIG_UNDEF_INT,
        worldGinBarrierCount: 0,
        ginStrongSignalsRequired: true,
        ginVaSignalsRequired: true,
        ginCustomStride: 1,
        ginType: ncclGinType_t::NCCL_GIN_TYPE_NONE,
        useRuntimeVersion: false,
        cftCaps: NCCL_CFT_NONE,
        cftBarrierCount: 0,
    }
}

/// Same as [`nccl_dev_comm_requirements_initializer`].
impl Default for ncclDevCommRequirements_t {
    fn default() -> Self {
        nccl_dev_comm_requirements_initializer()
    }
}

/// `ncclResourceWindow_vidmem_t`: the part of a window a device communicator inlines.
#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct ncclResourceWindow_vidmem_t {
    /// The first byte of LSA rank 0's mapping.
    pub lsaFlatBase: *mut core::ffi::c_char,
    /// The distance between LSA ranks' mappings, in 4 GiB units.
    pub stride4G: u32,
    /// The multicast offset, in 4 KiB units.
    pub mcOffset4K: u32,
}

/// The number of GIN connections a device communicator holds (`NCCL_GIN_MAX_CONNECTIONS`).
pub const NCCL_GIN_MAX_CONNECTIONS: usize = 4;

/// `struct ncclDevComm` of `nccl_device/impl/comm__types.h` 2.32.3: what device code reads.
/// Host code treats it as opaque: its layout follows the `version` of the requirements it
/// was created with (see the [module docs](self)).
#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct ncclDevComm_v23200 {
    /// Internal: `NCCL_API_MAGIC`.
    pub magic: c_uint,
    /// Internal: the version of the layout.
    pub version: c_uint,
    /// The rank in the communicator.
    pub rank: c_int,
    /// The number of ranks.
    pub nRanks: c_int,
    /// Reciprocal of `nRanks` for fast division.
    pub nRanks_rcp32: u32,
    /// The rank in the LSA team.
    pub lsaRank: c_int,
    /// The size of the LSA team.
    pub lsaSize: c_int,
    /// Reciprocal of `lsaSize`.
    pub lsaSize_rcp32: u32,
    /// Internal (`ncclDevCommWindowTable_t`).
    pub windowTable: *mut c_void,
    /// The window holding the requested resources.
    pub resourceWindow: ncclWindow_t,
    /// Its addressing fields, inlined.
    pub resourceWindow_inlined: ncclResourceWindow_vidmem_t,
    /// Internal.
    pub hybridDenseGinBarrier: ncclGinBarrierHandle_t,
    /// The LSA team's multicast handle.
    pub lsaMultimem: ncclMultimemHandle_t,
    /// The LSA barriers asked for with `lsaBarrierCount`.
    pub lsaBarrier: ncclLsaBarrierHandle_t,
    /// The rail GIN barriers.
    pub railGinBarrier: ncclGinBarrierHandle_t,
    /// Internal.
    pub ginConnectionCount: u8,
    /// Internal.
    pub backendIndex: u8,
    /// Internal.
    pub ginNetDeviceTypes: [u8; NCCL_GIN_MAX_CONNECTIONS],
    /// Internal.
    pub ginHandles: [*mut c_void; NCCL_GIN_MAX_CONNECTIONS],
    /// GIN signals.
    pub ginSignalCount: c_int,
    /// GIN counters.
    pub ginCounterCount: c_int,
    /// Internal.
    pub ginSignalShadows: *mut u64,
    /// GIN contexts.
    pub ginContextCount: u32,
    /// Internal.
    pub ginConnectionStride: c_int,
    /// Internal.
    pub ginContextStride: c_int,
    /// Internal.
    pub ginStrongLegacySignals: bool,
    /// Internal: the communicator's abort flag (device).
    pub abortFlag: *mut u32,
    /// Internal.
    pub hybridLsaBarrier: ncclLsaBarrierHandle_t,
    /// Internal.
    pub hybridRailGinBarrier: ncclGinBarrierHandle_t,
    /// The world GIN barriers.
    pub worldGinBarrier: ncclGinBarrierHandle_t,
    /// Internal.
    pub ginConnectionStride_rcp32: u32,
    /// The rank in the CFT team.
    pub cftRank: c_int,
    /// The size of the CFT team.
    pub cftSize: c_int,
    /// The rank in the CFT multicast team.
    pub cftMultimemRank: c_int,
    /// The size of the CFT multicast team.
    pub cftMultimemSize: c_int,
    /// Internal.
    pub cftMultimemSize_rcp32: u32,
    /// Internal.
    pub ucLeId: ncclCftLeId,
    /// Internal.
    pub mcLeId: ncclCftLeId,
    /// The CFT barriers.
    pub cftBarrier: ncclCftBarrierHandle_t,
    /// The CFT multicast barriers.
    pub cftMultimemBarrier: ncclCftBarrierHandle_t,
}

/// `ncclDevComm_t` as declared by the 2.32.3 headers.
pub type ncclDevComm_t = ncclDevComm_v23200;

#[allow(clippy::unnecessary_operation, clippy::identity_op)]
const _: () = {
    ["Size of ncclTeam_t"][size_of::<ncclTeam_t>() - 12usize];
    ["Size of ncclDevResourceRequirements_t"][size_of::<ncclDevResourceRequirements_t>() - 56usize];
    ["Size of ncclTeamRequirements_t"][size_of::<ncclTeamRequirements_t>() - 32usize];
    ["Size of ncclDevCommRequirements_v23200"]
        [size_of::<ncclDevCommRequirements_v23200>() - 120usize];
    ["Offset of field: ncclDevCommRequirements_v23200::cftBarrierCount"]
        [::core::mem::offset_of!(ncclDevCommRequirements_v23200, cftBarrierCount) - 112usize];
    ["Size of ncclDevComm_v23200"][size_of::<ncclDevComm_v23200>() - 248usize];
    ["Offset of field: ncclDevComm_v23200::lsaSize"]
        [::core::mem::offset_of!(ncclDevComm_v23200, lsaSize) - 24usize];
    ["Offset of field: ncclDevComm_v23200::ginContextCount"]
        [::core::mem::offset_of!(ncclDevComm_v23200, ginContextCount) - 152usize];
    ["Offset of field: ncclDevComm_v23200::cftMultimemBarrier"]
        [::core::mem::offset_of!(ncclDevComm_v23200, cftMultimemBarrier) - 240usize];
};

/// Expands the list of device-API host functions into [`DEVICE_HOST_FUNCTION_NAMES`], the
/// table [`NcclLib`](crate::NcclLib) resolves at load time, and one `NcclLib` method each,
/// with the contract of the `nccl.h` methods.
macro_rules! device_host_functions {
    ( $( fn $name:ident ( $( $arg:ident : $ty:ty ),* $(,)? ) -> $ret:ty ; )* ) => {
        /// The device-API host functions bound by hand (see the [module docs](self)).
        pub const DEVICE_HOST_FUNCTION_NAMES: [&str; [$( stringify!($name) ),*].len()] =
            [$( stringify!($name) ),*];

        /// The device-API host functions resolved from one loaded library.
        pub(crate) struct DeviceHostFunctions {
            $( $name: ::core::option::Option<unsafe extern "C" fn( $( $ty ),* ) -> $ret>, )*
        }

        impl DeviceHostFunctions {
            /// Resolves every function, recording the missing ones as `None`.
            ///
            /// # Safety
            ///
            /// `lib` must be a genuine NCCL library: the symbols are read with the prototypes
            /// of `nccl_device/host.h`.
            pub(crate) unsafe fn load(lib: &::libloading::Library) -> Self {
                Self {
                    $(
                        // SAFETY: read as the prototype host.h declares, which our caller
                        // guarantees; the `NcclLib` keeps `lib` loaded next to the pointer.
                        $name: unsafe {
                            lib.get::<unsafe extern "C" fn( $( $ty ),* ) -> $ret>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                        }
                        .ok()
                        .map(|symbol| *symbol),
                    )*
                }
            }
        }

        #[allow(non_snake_case)]
        impl $crate::NcclLib {
            $(
                #[doc = concat!(
                    "Calls `", stringify!($name), "` (declared in `nccl_device/host.h`) from ",
                    "the loaded library, or returns `Err(MissingSymbol { name: \"",
                    stringify!($name), "\" })` if the library does not export it.\n\n",
                    "# Errors\n\n",
                    "[`MissingSymbol`](crate::MissingSymbol) if the loaded library lacks the ",
                    "function; otherwise `Ok` holds its `ncclResult_t`.\n\n",
                    "# Safety\n\n",
                    "The requirements of the C function, as documented by NCCL: pointers must ",
                    "be valid for the accesses it makes and handles must be live and belong to ",
                    "this library.",
                )]
                #[inline]
                pub unsafe fn $name(
                    &self,
                    $( $arg: $ty ),*
                ) -> ::core::result::Result<$ret, $crate::MissingSymbol> {
                    match self.device_host_functions().$name {
                        // SAFETY: resolved from this library, which is still loaded; our
                        // caller upholds the function's contract.
                        Some(f) => Ok(unsafe { f( $( $arg ),* ) }),
                        None => Err($crate::MissingSymbol { name: stringify!($name) }),
                    }
                }
            )*
        }
    };
}

device_host_functions! {
    fn ncclCommQueryProperties(comm: ncclComm_t, props: *mut ncclCommProperties_t) -> ncclResult_t;
    fn ncclDevCommCreate(
        comm: ncclComm_t,
        reqs: *const ncclDevCommRequirements_t,
        outDevComm: *mut ncclDevComm_t,
    ) -> ncclResult_t;
    fn ncclDevCommDestroy(comm: ncclComm_t, devComm: *const ncclDevComm_t) -> ncclResult_t;
    fn ncclGetLsaMultimemDevicePointer(
        window: ncclWindow_t,
        offset: usize,
        outPtr: *mut *mut c_void,
    ) -> ncclResult_t;
    fn ncclGetMultimemDevicePointer(
        window: ncclWindow_t,
        offset: usize,
        multimem: ncclMultimemHandle_t,
        outPtr: *mut *mut c_void,
    ) -> ncclResult_t;
    fn ncclGetLsaDevicePointer(
        window: ncclWindow_t,
        offset: usize,
        lsaRank: c_int,
        outPtr: *mut *mut c_void,
    ) -> ncclResult_t;
    fn ncclGetPeerDevicePointer(
        window: ncclWindow_t,
        offset: usize,
        peer: c_int,
        outPtr: *mut *mut c_void,
    ) -> ncclResult_t;
    fn ncclGetMultimemDeviceLeInfo(
        window: ncclWindow_t,
        offset: usize,
        leId: *mut ncclCftLeId,
        leOffset: *mut usize,
    ) -> ncclResult_t;
    fn ncclGetCftDeviceLeInfo(
        window: ncclWindow_t,
        offset: usize,
        peerCft: c_int,
        cftTeam: ncclTeam_t,
        leId: *mut ncclCftLeId,
        leOffset: *mut usize,
    ) -> ncclResult_t;
    fn ncclGetPeerDeviceLeInfo(
        window: ncclWindow_t,
        offset: usize,
        peerWorld: c_int,
        leId: *mut ncclCftLeId,
        leOffset: *mut usize,
    ) -> ncclResult_t;
    fn ncclTeamWorld(comm: ncclComm_t) -> ncclTeam_t;
    fn ncclTeamLsa(comm: ncclComm_t) -> ncclTeam_t;
    fn ncclTeamRail(comm: ncclComm_t) -> ncclTeam_t;
    fn ncclTeamCft(comm: ncclComm_t, mode: ncclCftTeamMode_t) -> ncclTeam_t;
    fn ncclTeamCftMultimem(comm: ncclComm_t) -> ncclTeam_t;
    fn ncclTeamRankToWorld(comm: ncclComm_t, team: ncclTeam_t, rank: c_int) -> c_int;
    fn ncclTeamRankToLsa(comm: ncclComm_t, team: ncclTeam_t, rank: c_int) -> c_int;
    fn ncclLsaBarrierCreateRequirement(
        team: ncclTeam_t,
        nBarriers: c_int,
        outHandle: *mut ncclLsaBarrierHandle_t,
        outReq: *mut ncclDevResourceRequirements_t,
    ) -> ncclResult_t;
    fn ncclGinBarrierCreateRequirement(
        comm: ncclComm_t,
        team: ncclTeam_t,
        nBarriers: c_int,
        outHandle: *mut ncclGinBarrierHandle_t,
        outReq: *mut ncclDevResourceRequirements_t,
    ) -> ncclResult_t;
    fn ncclCftBarrierCreateRequirement(
        team: ncclTeam_t,
        nBarriers: c_int,
        outHandle: *mut ncclCftBarrierHandle_t,
        outReq: *mut ncclDevResourceRequirements_t,
    ) -> ncclResult_t;
    fn ncclLLA2ACalcSlots(maxElts: c_int, maxEltSize: c_int) -> c_int;
    fn ncclLLA2ACreateRequirement(
        nBlocks: c_int,
        nSlots: c_int,
        outHandle: *mut ncclLLA2AHandle_t,
        outReq: *mut ncclDevResourceRequirements_t,
    ) -> ncclResult_t;
}
