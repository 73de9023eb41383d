//! What a communicator supports: [`Comm::properties`] over `ncclCommQueryProperties`
//! (NCCL 2.29, declared in NCCL's device-API headers).
//!
//! NCCL fills in the fields the version it is told about has, and refuses a version newer
//! than itself (`ncclCommQueryProperties` in `src/dev_runtime.cc`, 2.29.7 to 2.30.7). So the
//! query names the older of the loaded library and the 2.32.3 header, with that version's
//! struct size, as a program built against that library's headers would; every field the
//! library does not report is `None` here (the table is in [`nccl_sys::device`]).

use nccl_sys::{ncclCommProperties_t, ncclGinConnectionType_t, ncclGinType_t};

use crate::calls::{self, Call};
use crate::comm::comm_call;
use crate::comm::Comm;
use crate::error::{Error, Result, ResultCode};
use crate::release::Version;

/// First NCCL with `ncclCommQueryProperties`.
pub const PROPERTIES_SINCE: Version = calls::ncclCommQueryProperties.since;
/// First NCCL that reports LSA teams and host RMA support, and the GIN type as a 4-byte enum.
const HOST_RMA_SINCE: Version = Version::new(2, 29, 4);
/// First NCCL that reports the communicator hash, GIN stride, connection and support table.
const GIN_DETAILS_SINCE: Version = Version::new(2, 31, 0);
/// First NCCL that reports copy-engine fabric transfer (CFT) support.
const CFT_SINCE: Version = Version::new(2, 32, 0);

/// A GPU-initiated networking (GIN) backend (`ncclGinType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GinType {
    /// `NCCL_GIN_TYPE_NONE`: no GIN.
    None,
    /// `NCCL_GIN_TYPE_PROXY`: through a CPU proxy.
    Proxy,
    /// `NCCL_GIN_TYPE_GDAKI`: GPUDirect Async kernel-initiated.
    Gdaki,
    /// `NCCL_GIN_TYPE_GPI` (2.30.7).
    Gpi,
    /// `NCCL_GIN_TYPE_EFA_GDA` (2.31).
    EfaGda,
    /// A value this crate does not know (a newer library).
    Other(u32),
}

impl GinType {
    fn from_raw(raw: ncclGinType_t) -> Self {
        match raw {
            ncclGinType_t::NCCL_GIN_TYPE_NONE => GinType::None,
            ncclGinType_t::NCCL_GIN_TYPE_PROXY => GinType::Proxy,
            ncclGinType_t::NCCL_GIN_TYPE_GDAKI => GinType::Gdaki,
            ncclGinType_t::NCCL_GIN_TYPE_GPI => GinType::Gpi,
            ncclGinType_t::NCCL_GIN_TYPE_EFA_GDA => GinType::EfaGda,
            other => GinType::Other(other.0),
        }
    }
}

/// Which ranks a GIN context connects (`ncclGinConnectionType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GinConnection {
    /// `NCCL_GIN_CONNECTION_NONE`
    None,
    /// `NCCL_GIN_CONNECTION_FULL`: every rank.
    Full,
    /// `NCCL_GIN_CONNECTION_RAIL`: the ranks of the same rail.
    Rail,
    /// `NCCL_GIN_CONNECTION_CUSTOM_STRIDE` (2.32).
    CustomStride,
    /// A value this crate does not know (a newer library).
    Other(u32),
}

impl GinConnection {
    fn from_raw(raw: ncclGinConnectionType_t) -> Self {
        match raw {
            ncclGinConnectionType_t::NCCL_GIN_CONNECTION_NONE => GinConnection::None,
            ncclGinConnectionType_t::NCCL_GIN_CONNECTION_FULL => GinConnection::Full,
            ncclGinConnectionType_t::NCCL_GIN_CONNECTION_RAIL => GinConnection::Rail,
            ncclGinConnectionType_t::NCCL_GIN_CONNECTION_CUSTOM_STRIDE => {
                GinConnection::CustomStride
            }
            other => GinConnection::Other(other.0),
        }
    }
}

/// What `ncclCommQueryProperties` reports about a communicator. Fields the loaded library
/// does not report are `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommProperties {
    /// The rank in the communicator.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The CUDA device ordinal.
    pub cuda_device: usize,
    /// The NVML device index.
    pub nvml_device: usize,
    /// Whether the device API (device communicators, symmetric memory) works.
    pub device_api_support: bool,
    /// Whether NVLink SHARP multicast memory is available to the device API.
    pub multimem_support: bool,
    /// The GIN backend (2.29.4).
    pub gin_type: Option<GinType>,
    /// The number of load/store-accessible (NVLink) teams (2.29.4).
    pub lsa_teams: Option<usize>,
    /// Whether host-initiated one-sided RMA ([`Window::put_signal`](crate::Window::put_signal))
    /// works (2.29.4).
    pub host_rma_support: Option<bool>,
    /// The GIN backend between rails (2.29.4).
    pub railed_gin_type: Option<GinType>,
    /// The communicator's hash, as NCCL's logs print it (2.31).
    pub comm_hash: Option<u64>,
    /// The smallest rank stride GIN can connect (2.31).
    pub gin_min_stride: Option<i32>,
    /// The GIN connection type (2.31).
    pub gin_connection: Option<GinConnection>,
    /// The GIN backends supported (2.31).
    pub gin_supported: Option<Vec<GinType>>,
    /// The size of `ncclDevComm` for device code compiled against this very library (2.31).
    pub dev_comm_runtime_size: Option<usize>,
    /// Whether copy-engine fabric transfers (CFT) work (2.32).
    pub cft_support: Option<bool>,
    /// Whether CFT multicast works (2.32).
    pub cft_multicast_support: Option<bool>,
    /// Whether CFT counted endpoints work (2.32).
    pub cft_counted_support: Option<bool>,
}

/// The struct NCCL writes, with room behind it: a library newer than the header that
/// ignored the `version` field and wrote fields of its own would still stay inside.
#[repr(C)]
struct Slot {
    props: ncclCommProperties_t,
    _room: [u8; 256],
}

/// The `version` to ask NCCL `found` for: its own, capped at the header's.
fn query_version(found: Version) -> Version {
    found.min(Version::HEADER)
}

/// `sizeof(ncclCommProperties_t)` in the headers of `version` (LP64), so the struct handed
/// over is exactly what a program built against that library's headers passes.
fn struct_size(version: Version) -> usize {
    use std::mem::offset_of;
    if version < HOST_RMA_SINCE {
        // 2.29.2/2.29.3: a one-byte `ginType` after `multimemSupport`, padded to 8.
        40
    } else if version < GIN_DETAILS_SINCE {
        offset_of!(ncclCommProperties_t, commHash)
    } else if version < CFT_SINCE {
        offset_of!(ncclCommProperties_t, cftSupport)
    } else {
        std::mem::size_of::<ncclCommProperties_t>()
    }
}

fn count(call: &'static str, value: i32) -> Result<usize> {
    usize::try_from(value).map_err(|_| Error::Nccl {
        call,
        code: ResultCode::InternalError,
        description: format!("NCCL reported the negative value {value}"),
        last_error: None,
    })
}

/// Decodes what NCCL wrote for a query with `version`.
fn decode(raw: &ncclCommProperties_t, version: Version) -> Result<CommProperties> {
    const CALL: &str = calls::ncclCommQueryProperties.name;
    let since = |needed: Version| version >= needed;
    let rma = since(HOST_RMA_SINCE);
    let gin = since(GIN_DETAILS_SINCE);
    let cft = since(CFT_SINCE);
    Ok(CommProperties {
        rank: count(CALL, raw.rank)?,
        size: count(CALL, raw.nRanks)?,
        cuda_device: count(CALL, raw.cudaDev)?,
        nvml_device: count(CALL, raw.nvmlDev)?,
        device_api_support: raw.deviceApiSupport,
        multimem_support: raw.multimemSupport,
        gin_type: rma.then(|| GinType::from_raw(raw.ginType)),
        lsa_teams: if rma {
            Some(count(CALL, raw.nLsaTeams)?)
        } else {
            None
        },
        host_rma_support: rma.then_some(raw.hostRmaSupport),
        railed_gin_type: rma.then(|| GinType::from_raw(raw.railedGinType)),
        comm_hash: gin.then_some(raw.commHash),
        gin_min_stride: gin.then_some(raw.ginMinStride),
        gin_connection: gin.then(|| GinConnection::from_raw(raw.ginConnectionType)),
        gin_supported: gin.then(|| {
            (0u32..)
                .zip(raw.ginSupport)
                .filter(|&(_, supported)| supported)
                .map(|(i, _)| GinType::from_raw(ncclGinType_t(i)))
                .collect()
        }),
        dev_comm_runtime_size: gin.then_some(raw.devCommRuntimeVersionSize),
        cft_support: cft.then_some(raw.cftSupport),
        cft_multicast_support: cft.then_some(raw.cftMulticastSupport),
        cft_counted_support: cft.then_some(raw.cftCountedSupport),
    })
}

/// Queries `comm` (the body of [`Comm::properties`], also used by windows).
pub(crate) fn query(comm: &Comm) -> Result<CommProperties> {
    query_with_gin(comm).map(|(props, _)| props)
}

/// [`query`], with the GIN type also where NCCL 2.29.2 and 2.29.3 report it in their own
/// layout (which [`CommProperties::gin_type`] leaves out, as it does their other early
/// fields): what one-sided RMA's set-up needs to know on those versions
/// ([`crate::window::rma`]).
pub(crate) fn query_with_gin(comm: &Comm) -> Result<(CommProperties, Option<GinType>)> {
    const ROW: &Call = &calls::ncclCommQueryProperties;
    let lib = comm.library();
    lib.require_call(ROW)?;
    let version = query_version(lib.version());
    let mut slot = Slot {
        props: nccl_sys::nccl_comm_properties_initializer(),
        _room: [0; 256],
    };
    slot.props.version = version.code();
    slot.props.size = struct_size(version);
    let props: *mut ncclCommProperties_t = &mut slot.props;
    // SAFETY: live communicator under its lock; `props` is an initialised
    // ncclCommProperties_t (size, magic, and a version the library accepts) followed by spare
    // room, valid for writes until the call returns.
    unsafe { comm_call!(comm, |raw| ncclCommQueryProperties(raw, props)) }?;
    let decoded = decode(&slot.props, version)?;
    let gin = if version < HOST_RMA_SINCE {
        // SAFETY: `props` points to the struct NCCL has just filled, still in place; a
        // 2.29.2/2.29.3 library writes its one-byte `ginType` inside the 40 bytes it was told
        // about.
        Some(unsafe { early_gin_type(props) })
    } else {
        decoded.gin_type
    };
    Ok((decoded, gin))
}

/// Where NCCL 2.29.2 and 2.29.3 put their `ginType`: one byte (`enum : uint8_t`) right after
/// `multimemSupport`, where later layouts have padding before a 4-byte enum.
const EARLY_GIN_TYPE_AT: usize = std::mem::offset_of!(ncclCommProperties_t, multimemSupport) + 1;

/// The GIN type a 2.29.2/2.29.3 library wrote into `props`.
///
/// # Safety
///
/// `props` must point to a properties struct such a library has filled in.
unsafe fn early_gin_type(props: *const ncclCommProperties_t) -> GinType {
    // SAFETY: the caller's promise; the byte lies within the struct.
    let raw = unsafe { props.cast::<u8>().add(EARLY_GIN_TYPE_AT).read() };
    GinType::from_raw(ncclGinType_t(u32::from(raw)))
}

impl Comm {
    /// What the communicator supports (`ncclCommQueryProperties`, NCCL 2.29): symmetric
    /// memory and the device API, multicast, host RMA, GIN, CFT. Local; a library older than
    /// 2.29 gives [`Error::Unsupported`]. See the [module docs](crate::properties).
    pub fn properties(&self) -> Result<CommProperties> {
        query(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled() -> ncclCommProperties_t {
        let mut raw = nccl_sys::nccl_comm_properties_initializer();
        raw.rank = 1;
        raw.nRanks = 2;
        raw.cudaDev = 1;
        raw.nvmlDev = 3;
        raw.deviceApiSupport = true;
        raw.ginType = ncclGinType_t::NCCL_GIN_TYPE_PROXY;
        raw.nLsaTeams = 1;
        raw.hostRmaSupport = true;
        raw.railedGinType = ncclGinType_t(9);
        raw.commHash = 0xfeed;
        raw.ginMinStride = 2;
        raw.ginConnectionType = ncclGinConnectionType_t::NCCL_GIN_CONNECTION_RAIL;
        raw.ginSupport[2] = true;
        raw.ginSupport[3] = true;
        raw.devCommRuntimeVersionSize = 4096;
        raw.cftSupport = true;
        raw.cftCountedSupport = true;
        raw
    }

    #[test]
    fn fields_follow_the_version_asked_for() {
        let raw = filled();
        let old = decode(&raw, Version::new(2, 29, 3)).unwrap();
        assert_eq!(
            (old.rank, old.size, old.cuda_device, old.nvml_device),
            (1, 2, 1, 3)
        );
        assert!(old.device_api_support && !old.multimem_support);
        assert_eq!(old.gin_type, None);
        assert_eq!(old.host_rma_support, None);
        assert_eq!(old.comm_hash, None);

        // 2.29.2/2.29.3 write a one-byte GIN type where later layouts have padding.
        let mut slot = Slot {
            props: nccl_sys::nccl_comm_properties_initializer(),
            _room: [0; 256],
        };
        let at: *mut ncclCommProperties_t = &mut slot.props;
        // SAFETY: the byte lies inside the struct; the early layout is what is tested.
        unsafe { at.cast::<u8>().add(EARLY_GIN_TYPE_AT).write(3) };
        assert_eq!(EARLY_GIN_TYPE_AT, 34);
        // SAFETY: filled in as such a library would.
        assert_eq!(unsafe { early_gin_type(at) }, GinType::Gdaki);
        // SAFETY: as above.
        unsafe { at.cast::<u8>().add(EARLY_GIN_TYPE_AT).write(0) };
        // SAFETY: as above.
        assert_eq!(unsafe { early_gin_type(at) }, GinType::None);

        let v230 = decode(&raw, Version::new(2, 30, 7)).unwrap();
        assert_eq!(v230.gin_type, Some(GinType::Proxy));
        assert_eq!(v230.railed_gin_type, Some(GinType::Other(9)));
        assert_eq!(v230.lsa_teams, Some(1));
        assert_eq!(v230.host_rma_support, Some(true));
        assert_eq!(v230.gin_supported, None);
        assert_eq!(v230.cft_support, None);

        let v231 = decode(&raw, Version::new(2, 31, 2)).unwrap();
        assert_eq!(v231.comm_hash, Some(0xfeed));
        assert_eq!(v231.gin_min_stride, Some(2));
        assert_eq!(v231.gin_connection, Some(GinConnection::Rail));
        assert_eq!(
            v231.gin_supported,
            Some(vec![GinType::Proxy, GinType::Gdaki])
        );
        assert_eq!(v231.dev_comm_runtime_size, Some(4096));
        assert_eq!(v231.cft_support, None);

        let v232 = decode(&raw, Version::new(2, 32, 3)).unwrap();
        assert_eq!(v232.cft_support, Some(true));
        assert_eq!(v232.cft_multicast_support, Some(false));
        assert_eq!(v232.cft_counted_support, Some(true));
    }

    #[test]
    fn negative_counts_are_errors() {
        let mut raw = filled();
        raw.nRanks = -1;
        let err = decode(&raw, Version::new(2, 32, 3)).unwrap_err();
        assert!(err.to_string().contains("negative value -1"), "{err}");
    }

    #[test]
    fn the_version_asked_for_never_exceeds_the_library_or_the_header() {
        assert_eq!(
            query_version(Version::new(2, 29, 2)),
            Version::new(2, 29, 2)
        );
        assert_eq!(query_version(Version::new(2, 32, 3)), Version::HEADER);
        assert_eq!(query_version(Version::new(2, 40, 1)), Version::HEADER);
    }

    #[test]
    fn the_struct_size_is_the_one_of_each_header() {
        let v = Version::new;
        assert_eq!(struct_size(v(2, 29, 2)), 40);
        assert_eq!(struct_size(v(2, 29, 7)), 56);
        assert_eq!(struct_size(v(2, 30, 7)), 56);
        assert_eq!(struct_size(v(2, 31, 2)), 144);
        assert_eq!(struct_size(v(2, 32, 3)), 152);
        assert_eq!(struct_size(Version::HEADER), 152);
    }

    #[test]
    fn the_query_struct_has_room_behind_it() {
        assert!(std::mem::size_of::<Slot>() >= std::mem::size_of::<ncclCommProperties_t>() + 256);
        assert_eq!(std::mem::offset_of!(Slot, props), 0);
    }
}
