//! The host side of NCCL's device API that a host program needs, written by hand.
//!
//! These items are declared in `nccl_device/host.h` (2.32.3; `nccl_device/core.h` before
//! 2.31), not in `nccl.h`, so the generator does not reach them. They follow the generated
//! code's conventions: C names, `#[repr(C)]` structs deriving `Debug, Copy, Clone`, C enums as
//! `#[repr(transparent)]` newtypes, layout assertions, and functions called through
//! [`NcclLib`](crate::NcclLib) that report a library lacking them as
//! [`MissingSymbol`](crate::MissingSymbol).
//!
//! Only [`ncclCommQueryProperties`](crate::NcclLib::ncclCommQueryProperties) is bound: the
//! rest of the device API (device communicators, teams, LSA pointers) serves CUDA kernels.
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

use core::ffi::{c_int, c_uint};
use core::mem::size_of;

use crate::bindings::{ncclComm_t, ncclResult_t, NCCL_API_MAGIC, NCCL_VERSION_CODE};

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
}
