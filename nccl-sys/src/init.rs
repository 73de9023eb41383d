//! The `NCCL_*_INITIALIZER` macros of nccl.h as `const fn`s, and `Default` for their structs.
//!
//! NCCL rejects these structs unless `size`, `magic` and `version` hold exactly what the
//! initializers put there, so always start from one of these functions (or `Default`) and then
//! change the fields you need. The struct literals name every field: regenerating the bindings
//! from a header that adds fields makes this file fail to compile until it is updated.

use core::ffi::{c_int, c_uint};
use core::mem::size_of;
use core::ptr;

use crate::bindings::{
    ncclCollConfig_t, ncclConfig_t, ncclEncryptionConfig_t, ncclEncryptionMode_t, ncclSimInfo_t,
    NCCL_API_MAGIC, NCCL_VERSION_CODE,
};
use crate::consts::{NCCL_CONFIG_UNDEF_INT, NCCL_UNDEF_FLOAT};

/// The `magic` value `NCCL_SIM_INFO_INITIALIZER` uses (it differs from `NCCL_API_MAGIC`).
const SIM_INFO_MAGIC: c_uint = 0x7468_5283;

/// `NCCL_VERSION_CODE` as stored in the structs' `unsigned int version` fields.
const VERSION: c_uint = NCCL_VERSION_CODE as c_uint;

/// `NCCL_CONFIG_INITIALIZER`: `size`, `magic` and `version` set, every other `int` field
/// [`NCCL_CONFIG_UNDEF_INT`] and both string pointers null, i.e. "let NCCL decide".
#[must_use]
pub const fn nccl_config_initializer() -> ncclConfig_t {
    ncclConfig_t {
        size: size_of::<ncclConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: VERSION,
        blocking: NCCL_CONFIG_UNDEF_INT,
        cgaClusterSize: NCCL_CONFIG_UNDEF_INT,
        minCTAs: NCCL_CONFIG_UNDEF_INT,
        maxCTAs: NCCL_CONFIG_UNDEF_INT,
        netName: ptr::null(),
        splitShare: NCCL_CONFIG_UNDEF_INT,
        trafficClass: NCCL_CONFIG_UNDEF_INT,
        commName: ptr::null(),
        collnetEnable: NCCL_CONFIG_UNDEF_INT,
        CTAPolicy: NCCL_CONFIG_UNDEF_INT,
        shrinkShare: NCCL_CONFIG_UNDEF_INT,
        nvlsCTAs: NCCL_CONFIG_UNDEF_INT,
        nChannelsPerNetPeer: NCCL_CONFIG_UNDEF_INT,
        nvlinkCentricSched: NCCL_CONFIG_UNDEF_INT,
        graphUsageMode: NCCL_CONFIG_UNDEF_INT,
        numRmaCtx: NCCL_CONFIG_UNDEF_INT,
        maxP2pPeers: NCCL_CONFIG_UNDEF_INT,
        graphStreamOrdering: NCCL_CONFIG_UNDEF_INT,
        launchOrderImplicit: NCCL_CONFIG_UNDEF_INT,
        numRmaSig: NCCL_CONFIG_UNDEF_INT,
        rmaEagerInit: NCCL_CONFIG_UNDEF_INT,
        hostCftMode: NCCL_CONFIG_UNDEF_INT,
        nvlsHostMode: NCCL_CONFIG_UNDEF_INT,
    }
}

/// `NCCL_COLLCONFIG_INITIALIZER`: `size`, `magic` and `version` set, no extensions, the CTA
/// limits, `cgaClusterSize` and `CTAPolicy` [`NCCL_CONFIG_UNDEF_INT`], no algorithm selection
/// string, `forceAlgSelection = 1`, `userProfilerTag = 0` and no launch-completion event.
#[must_use]
pub const fn nccl_coll_config_initializer() -> ncclCollConfig_t {
    ncclCollConfig_t {
        size: size_of::<ncclCollConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: VERSION,
        ext: ptr::null_mut(),
        minCTAs: NCCL_CONFIG_UNDEF_INT,
        maxCTAs: NCCL_CONFIG_UNDEF_INT,
        nvlsCTAs: NCCL_CONFIG_UNDEF_INT,
        cgaClusterSize: NCCL_CONFIG_UNDEF_INT,
        algSelection: ptr::null(),
        forceAlgSelection: 1,
        CTAPolicy: NCCL_CONFIG_UNDEF_INT,
        userProfilerTag: 0,
        launchCompletionEvent: ptr::null_mut(),
    }
}

/// `NCCL_SIM_INFO_INITIALIZER`: `size`, `magic` (`0x74685283`) and `version` set and
/// `estimatedTime` [`NCCL_UNDEF_FLOAT`] (`-1.0`).
#[must_use]
pub const fn nccl_sim_info_initializer() -> ncclSimInfo_t {
    ncclSimInfo_t {
        size: size_of::<ncclSimInfo_t>(),
        magic: SIM_INFO_MAGIC,
        version: VERSION,
        estimatedTime: NCCL_UNDEF_FLOAT,
    }
}

/// `NCCL_ENCRYPTION_CONFIG_INITIALIZER`: `size`, `magic` and `version` set, `mode`
/// `NCCL_ENCRYPTION_MODE_NONE` (plaintext) and no pre-shared key.
#[must_use]
pub const fn nccl_encryption_config_initializer() -> ncclEncryptionConfig_t {
    ncclEncryptionConfig_t {
        size: size_of::<ncclEncryptionConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: VERSION,
        // The enum's values are small; the field is a plain `int`.
        #[allow(clippy::cast_possible_wrap)]
        mode: ncclEncryptionMode_t::NCCL_ENCRYPTION_MODE_NONE.0 as c_int,
        psk: ptr::null(),
    }
}

/// Same as [`nccl_config_initializer`].
impl Default for ncclConfig_t {
    fn default() -> Self {
        nccl_config_initializer()
    }
}

/// Same as [`nccl_coll_config_initializer`].
impl Default for ncclCollConfig_t {
    fn default() -> Self {
        nccl_coll_config_initializer()
    }
}

/// Same as [`nccl_sim_info_initializer`].
impl Default for ncclSimInfo_t {
    fn default() -> Self {
        nccl_sim_info_initializer()
    }
}

/// Same as [`nccl_encryption_config_initializer`].
impl Default for ncclEncryptionConfig_t {
    fn default() -> Self {
        nccl_encryption_config_initializer()
    }
}
