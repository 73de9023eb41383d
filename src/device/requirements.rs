//! What a device communicator must provide: [`DevCommRequirements`], checked against the
//! communicator's properties before NCCL is asked (a refused `ncclDevCommCreate` is
//! `ncclInvalidUsage`, which NCCL counts as fatal to the communicator), and written into
//! the `ncclDevCommRequirements_t` of the kernels' header version.

use std::ffi::c_int;
use std::mem::size_of;

use nccl_sys::{ncclDevCommRequirements_t, ncclGinConnectionType_t};

use super::{DeviceAbi, DEV_COMM_SINCE};
use crate::error::{Error, Result};
use crate::properties::{CommProperties, GinConnection, GinType};
use crate::release::Version;

/// The first NCCL whose requirements name a GIN connection (`ginConnectionType`).
pub const GIN_CONNECTION_SINCE: Version = Version::new(2, 29, 7);
/// The first NCCL with world GIN barriers (`worldGinBarrierCount`).
const WORLD_GIN_BARRIERS_SINCE: Version = Version::new(2, 30, 3);
/// The first header version whose struct layout past `ginVaSignalsRequired` is known here.
const LAYOUT_2_32_3: Version = Version::new(2, 32, 3);
/// How many fields of the requirements the ranks compare ([`DevCommRequirements::agreed`]).
pub(crate) const AGREED_FIELDS: usize = 11;

/// `sizeof(ncclDevCommRequirements_t)` in the headers of `version` (LP64), per the table in
/// [`nccl_sys::device`]. Between 2.31.0 and 2.32.2 only the 2.30.7 prefix is known to be
/// there, so that is what is handed over (NCCL fills the rest with its defaults).
pub(crate) fn struct_size(version: Version) -> usize {
    if version < GIN_CONNECTION_SINCE {
        72
    } else if version < WORLD_GIN_BARRIERS_SINCE {
        88
    } else if version < LAYOUT_2_32_3 {
        96
    } else {
        size_of::<ncclDevCommRequirements_t>()
    }
}

/// What a [`DevComm`](super::DevComm) must provide. Every rank asks for the same (NCCL's
/// rule, checked by [`DevComm::create`](super::DevComm::create)'s agreement before NCCL is
/// asked). Built with the methods below, from nothing requested.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DevCommRequirements {
    lsa_barriers: u32,
    lsa_multimem: bool,
    lsa_ll_a2a: (u32, u32),
    gin: Option<GinConnection>,
    barriers: u32,
    rail_gin_barriers: u32,
    world_gin_barriers: u32,
    gin_signals: u32,
    gin_counters: u32,
    gin_contexts: Option<u32>,
}

impl DevCommRequirements {
    /// Nothing requested (`NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER`).
    pub fn new() -> Self {
        Self::default()
    }

    /// `lsaBarrierCount`: barriers over the LSA team (`comm.lsaBarrier`, index `0..n`), e.g.
    /// one per CTA that synchronises.
    pub fn lsa_barriers(mut self, n: u32) -> Self {
        self.lsa_barriers = n;
        self
    }

    /// `lsaMultimem`: multicast memory on the LSA team (NVLink SHARP). Refused with
    /// [`Error::Unavailable`] where the communicator reports no multicast support.
    pub fn lsa_multimem(mut self, on: bool) -> Self {
        self.lsa_multimem = on;
        self
    }

    /// `lsaLLA2ABlockCount`/`lsaLLA2ASlotCount`: low-latency all-to-all slots over the LSA
    /// team (see [`DevComm::ll_a2a_slots`](super::DevComm::ll_a2a_slots) for the count).
    pub fn lsa_ll_a2a(mut self, blocks: u32, slots: u32) -> Self {
        self.lsa_ll_a2a = (blocks, slots);
        self
    }

    /// Turns GPU-initiated networking on, connecting `connection`
    /// ([`GinConnection::Full`] or [`GinConnection::Rail`]; NCCL 2.29.7+). GIN kernels must
    /// be compiled against the loaded library's own headers.
    pub fn gin(mut self, connection: GinConnection) -> Self {
        self.gin = Some(connection);
        self
    }

    /// `barrierCount`: hybrid barriers (LSA, then GIN over the rail team); needs GIN.
    pub fn barriers(mut self, n: u32) -> Self {
        self.barriers = n;
        self
    }

    /// `railGinBarrierCount`: GIN barriers over the rail team; needs GIN.
    pub fn rail_gin_barriers(mut self, n: u32) -> Self {
        self.rail_gin_barriers = n;
        self
    }

    /// `worldGinBarrierCount`: GIN barriers over all ranks (2.30.3); needs GIN, not with a
    /// rail connection.
    pub fn world_gin_barriers(mut self, n: u32) -> Self {
        self.world_gin_barriers = n;
        self
    }

    /// `ginSignalCount`: GIN signals, numbered from 0; needs GIN.
    pub fn gin_signals(mut self, n: u32) -> Self {
        self.gin_signals = n;
        self
    }

    /// `ginCounterCount`: GIN counters, numbered from 0; needs GIN.
    pub fn gin_counters(mut self, n: u32) -> Self {
        self.gin_counters = n;
        self
    }

    /// `ginContextCount`: how many GIN contexts to aim for (a hint; NCCL's default is 4).
    pub fn gin_contexts(mut self, n: u32) -> Self {
        self.gin_contexts = Some(n);
        self
    }

    /// Whether GIN is asked for: a connection, or anything only GIN provides.
    pub fn uses_gin(&self) -> bool {
        self.gin.is_some() || self.asks_gin_resources()
    }

    fn asks_gin_resources(&self) -> bool {
        self.barriers > 0
            || self.rail_gin_barriers > 0
            || self.world_gin_barriers > 0
            || self.gin_signals > 0
            || self.gin_counters > 0
    }

    /// Everything that can be known before NCCL is asked: the library and the device code's
    /// ABI, the communicator's support for the device API, multicast and GIN, and the
    /// counts. Nothing here calls NCCL.
    pub(crate) fn check(
        &self,
        props: &CommProperties,
        library: Version,
        abi: DeviceAbi,
    ) -> Result<()> {
        if library < DEV_COMM_SINCE {
            return Err(Error::Unsupported {
                api: "ncclDevCommCreate (versioned device communicators)",
                needs: DEV_COMM_SINCE,
                found: library,
            });
        }
        abi.check(library, self.uses_gin())?;
        if !props.device_api_support {
            return Err(Error::Unavailable {
                api: "ncclDevCommCreate",
                reason: "this communicator has no device-API support (deviceApiSupport is \
                         false: its ranks are not all in one LSA team and it has no GIN, or \
                         CUDA VMM / symmetric memory is off; NCCL_DEBUG=INFO says which)"
                    .into(),
            });
        }
        if self.lsa_multimem && !props.multimem_support {
            return Err(Error::Unavailable {
                api: "lsaMultimem (NVLink SHARP multicast memory)",
                reason: "the communicator reports no multicast support (multimemSupport is \
                         false: no NVSwitch multicast between these GPUs, or NVLS is disabled, \
                         e.g. NCCL_NVLS_ENABLE=0)"
                    .into(),
            });
        }
        self.check_gin(props, library)?;
        if (self.lsa_ll_a2a.0 == 0) != (self.lsa_ll_a2a.1 == 0) {
            return Err(Error::invalid(format!(
                "LL all-to-all needs both blocks and slots, got {} blocks and {} slots",
                self.lsa_ll_a2a.0, self.lsa_ll_a2a.1
            )));
        }
        for (what, n) in self.counts() {
            if c_int::try_from(n).is_err() {
                return Err(Error::invalid(format!("{what} = {n} does not fit a C int")));
            }
        }
        Ok(())
    }

    fn check_gin(&self, props: &CommProperties, library: Version) -> Result<()> {
        if !self.uses_gin() {
            return Ok(());
        }
        let Some(connection) = self.gin else {
            return Err(Error::invalid(
                "GIN signals, counters and GIN or hybrid barriers need GIN turned on: add \
                 .gin(GinConnection::Full) (or Rail)",
            ));
        };
        if !matches!(connection, GinConnection::Full | GinConnection::Rail) {
            return Err(Error::invalid(format!(
                "GIN connection {connection:?}: only Full and Rail are supported here"
            )));
        }
        if library < GIN_CONNECTION_SINCE {
            return Err(Error::Unsupported {
                api: "GIN in ncclDevCommRequirements (ginConnectionType)",
                needs: GIN_CONNECTION_SINCE,
                found: library,
            });
        }
        if self.world_gin_barriers > 0 {
            if library < WORLD_GIN_BARRIERS_SINCE {
                return Err(Error::Unsupported {
                    api: "worldGinBarrierCount",
                    needs: WORLD_GIN_BARRIERS_SINCE,
                    found: library,
                });
            }
            if connection == GinConnection::Rail {
                return Err(Error::invalid(
                    "world GIN barriers need a full GIN connection, not a rail one",
                ));
            }
        }
        match props.gin_type {
            Some(GinType::None) | None => Err(Error::Unavailable {
                api: "GIN (GPU-initiated networking)",
                reason: match props.gin_type {
                    None => "the library does not report GIN support (ginType needs NCCL \
                             2.29.4+)"
                        .into(),
                    _ => "no GIN backend on every rank of this communicator (ginType NONE): GIN \
                          needs a GIN plugin (GDAKI or proxy over RDMA; socket GIN from NCCL \
                          2.32.3 needs GDRCopy), GPUDirect RDMA with CUDA VMM, and compute \
                          capability 7.0+"
                        .into(),
                },
            }),
            Some(_)
                if connection == GinConnection::Full
                    && props.gin_connection == Some(GinConnection::Rail) =>
            {
                Err(Error::Unavailable {
                    api: "GIN (GPU-initiated networking)",
                    reason: "the communicator connects GIN along rails only; ask for \
                             GinConnection::Rail"
                        .into(),
                })
            }
            Some(_) => Ok(()),
        }
    }

    /// Every field handed to NCCL, by its C name, as a number: what the ranks compare before
    /// creating (see `agreement.rs`). All of them must match across ranks (NCCL
    /// `src/dev_runtime.cc`, `ncclDevrCommCreateInternal`, 2.30.7): the barrier counts and
    /// the GIN signals and counters are laid out one after another in every rank's resource
    /// window, so one rank's count moves every later offset its peers' kernels write to;
    /// `lsaMultimem` makes the LSA team bind multicast memory together; the GIN connection
    /// and context count set up GIN with the peers; the LL all-to-all slots are peer memory
    /// laid out the same way (2.30.7 reads them nowhere yet, so equal values cost nothing).
    /// The context count NCCL picks when none is given is what is compared for `None`.
    pub(crate) fn agreed(&self) -> [(&'static str, u64); AGREED_FIELDS] {
        let gin = match self.gin {
            None | Some(GinConnection::None) => 0,
            Some(GinConnection::Full) => 1,
            Some(GinConnection::Rail) => 2,
            Some(GinConnection::CustomStride) => 3,
            Some(GinConnection::Other(raw)) => 0x1_0000_0000 | u64::from(raw),
        };
        let default_contexts = nccl_sys::nccl_dev_comm_requirements_initializer().ginContextCount;
        let contexts = match self.gin_contexts {
            Some(n) => u64::from(n),
            None => u64::try_from(default_contexts).unwrap_or(0),
        };
        [
            ("lsaBarrierCount", u64::from(self.lsa_barriers)),
            ("lsaMultimem", u64::from(self.lsa_multimem)),
            ("lsaLLA2ABlockCount", u64::from(self.lsa_ll_a2a.0)),
            ("lsaLLA2ASlotCount", u64::from(self.lsa_ll_a2a.1)),
            ("ginConnectionType", gin),
            ("barrierCount", u64::from(self.barriers)),
            ("railGinBarrierCount", u64::from(self.rail_gin_barriers)),
            ("worldGinBarrierCount", u64::from(self.world_gin_barriers)),
            ("ginSignalCount", u64::from(self.gin_signals)),
            ("ginCounterCount", u64::from(self.gin_counters)),
            ("ginContextCount", contexts),
        ]
    }

    fn counts(&self) -> [(&'static str, u32); 9] {
        [
            ("lsaBarrierCount", self.lsa_barriers),
            ("lsaLLA2ABlockCount", self.lsa_ll_a2a.0),
            ("lsaLLA2ASlotCount", self.lsa_ll_a2a.1),
            ("barrierCount", self.barriers),
            ("railGinBarrierCount", self.rail_gin_barriers),
            ("worldGinBarrierCount", self.world_gin_barriers),
            ("ginSignalCount", self.gin_signals),
            ("ginCounterCount", self.gin_counters),
            ("ginContextCount", self.gin_contexts.unwrap_or(0)),
        ]
    }

    /// The C struct for device code of `abi`: the 2.32.3 initializer's defaults, `version`
    /// the ABI's and `size` that version's, so NCCL lays the device communicator out as the
    /// kernels read it and never copies more than its own struct holds. Call after
    /// [`check`](Self::check), which keeps every count within a C int.
    pub(crate) fn to_raw(&self, abi: DeviceAbi) -> ncclDevCommRequirements_t {
        let int = |n: u32| c_int::try_from(n).unwrap_or(c_int::MAX);
        let mut raw = nccl_sys::nccl_dev_comm_requirements_initializer();
        raw.size = struct_size(abi.version());
        raw.version = abi.version().code();
        raw.lsaMultimem = self.lsa_multimem;
        raw.lsaBarrierCount = int(self.lsa_barriers);
        raw.lsaLLA2ABlockCount = int(self.lsa_ll_a2a.0);
        raw.lsaLLA2ASlotCount = int(self.lsa_ll_a2a.1);
        raw.barrierCount = int(self.barriers);
        raw.railGinBarrierCount = int(self.rail_gin_barriers);
        raw.worldGinBarrierCount = int(self.world_gin_barriers);
        raw.ginSignalCount = int(self.gin_signals);
        raw.ginCounterCount = int(self.gin_counters);
        if let Some(n) = self.gin_contexts {
            raw.ginContextCount = int(n);
        }
        raw.ginConnectionType = match self.gin {
            Some(GinConnection::Full) => ncclGinConnectionType_t::NCCL_GIN_CONNECTION_FULL,
            Some(GinConnection::Rail) => ncclGinConnectionType_t::NCCL_GIN_CONNECTION_RAIL,
            _ => ncclGinConnectionType_t::NCCL_GIN_CONNECTION_NONE,
        };
        raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(major: u32, minor: u32, patch: u32) -> Version {
        Version::new(major, minor, patch)
    }

    /// A one-GPU communicator of NCCL 2.32.3 as our hosts report it: device API yes,
    /// multicast no (NVLS off), no GIN.
    fn one_gpu_host() -> CommProperties {
        CommProperties {
            rank: 0,
            size: 2,
            cuda_device: 0,
            nvml_device: 0,
            device_api_support: true,
            multimem_support: false,
            gin_type: Some(GinType::None),
            lsa_teams: Some(1),
            host_rma_support: Some(true),
            railed_gin_type: Some(GinType::None),
            comm_hash: Some(1),
            gin_min_stride: Some(0),
            gin_connection: Some(GinConnection::None),
            gin_supported: Some(Vec::new()),
            dev_comm_runtime_size: Some(248),
            cft_support: Some(false),
            cft_multicast_support: Some(false),
            cft_counted_support: Some(false),
        }
    }

    const LIB: Version = Version::new(2, 32, 3);
    const ABI: DeviceAbi = DeviceAbi::new(Version::new(2, 32, 3));

    #[test]
    fn lsa_barriers_pass_on_a_one_gpu_host() {
        let reqs = DevCommRequirements::new().lsa_barriers(4).lsa_ll_a2a(2, 8);
        reqs.check(&one_gpu_host(), LIB, ABI).unwrap();
        let raw = reqs.to_raw(ABI);
        assert_eq!((raw.size, raw.version), (120, 23203));
        assert_eq!(raw.lsaBarrierCount, 4);
        assert_eq!((raw.lsaLLA2ABlockCount, raw.lsaLLA2ASlotCount), (2, 8));
        assert!(!raw.lsaMultimem);
        assert_eq!(
            raw.ginConnectionType,
            ncclGinConnectionType_t::NCCL_GIN_CONNECTION_NONE
        );
        assert_eq!(raw.ginContextCount, 4);
    }

    #[test]
    fn multimem_without_multicast_is_unavailable_before_nccl() {
        let err = DevCommRequirements::new()
            .lsa_multimem(true)
            .check(&one_gpu_host(), LIB, ABI)
            .unwrap_err();
        assert!(
            matches!(err, Error::Unavailable { api, .. } if api.starts_with("lsaMultimem")),
            "{err}"
        );
        assert!(err.is_unsupported() && !err.is_fatal());
        let mut nvls = one_gpu_host();
        nvls.multimem_support = true;
        DevCommRequirements::new()
            .lsa_multimem(true)
            .check(&nvls, LIB, ABI)
            .unwrap();
    }

    #[test]
    fn gin_without_a_backend_is_unavailable_before_nccl() {
        let gin = DevCommRequirements::new()
            .gin(GinConnection::Full)
            .gin_signals(4);
        let err = gin.check(&one_gpu_host(), LIB, ABI).unwrap_err();
        assert!(
            matches!(&err, Error::Unavailable { api, reason } if api.starts_with("GIN")
                && reason.contains("ginType NONE")),
            "{err}"
        );
        let mut old = one_gpu_host();
        old.gin_type = None;
        let err = gin.check(&old, LIB, ABI).unwrap_err();
        assert!(matches!(err, Error::Unavailable { .. }), "{err}");
        // Resources that need GIN without turning it on: refused with the fix.
        let err = DevCommRequirements::new()
            .gin_counters(1)
            .check(&one_gpu_host(), LIB, ABI)
            .unwrap_err();
        assert!(
            err.to_string().contains(".gin(GinConnection::Full)"),
            "{err}"
        );
        let mut gdaki = one_gpu_host();
        gdaki.gin_type = Some(GinType::Gdaki);
        gin.check(&gdaki, LIB, ABI).unwrap();
        // GIN device code must match the library exactly.
        let err = gin
            .check(&gdaki, LIB, DeviceAbi::new(v(2, 30, 7)))
            .unwrap_err();
        assert!(err.to_string().contains("GIN device code"), "{err}");
        gdaki.gin_connection = Some(GinConnection::Rail);
        assert!(gin.check(&gdaki, LIB, ABI).is_err());
        DevCommRequirements::new()
            .gin(GinConnection::Rail)
            .check(&gdaki, LIB, ABI)
            .unwrap();
        let raw = gin.to_raw(ABI);
        assert_eq!(
            raw.ginConnectionType,
            ncclGinConnectionType_t::NCCL_GIN_CONNECTION_FULL
        );
        assert_eq!(raw.ginSignalCount, 4);
    }

    #[test]
    fn libraries_before_2_29_2_and_communicators_without_support_are_refused() {
        let reqs = DevCommRequirements::new().lsa_barriers(1);
        match reqs.check(&one_gpu_host(), v(2, 28, 3), DeviceAbi::new(v(2, 28, 3))) {
            Err(Error::Unsupported { needs, found, .. }) => {
                assert_eq!((needs, found), (DEV_COMM_SINCE, v(2, 28, 3)));
            }
            other => panic!("{other:?}"),
        }
        let mut none = one_gpu_host();
        none.device_api_support = false;
        let err = reqs.check(&none, LIB, ABI).unwrap_err();
        assert!(matches!(err, Error::Unavailable { .. }), "{err}");
        // Headers newer than the library.
        let err = reqs.check(&one_gpu_host(), v(2, 30, 7), ABI).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err}");
        let err = DevCommRequirements::new()
            .lsa_ll_a2a(1, 0)
            .check(&one_gpu_host(), LIB, ABI)
            .unwrap_err();
        assert!(err.to_string().contains("both blocks and slots"), "{err}");
        let err = DevCommRequirements::new()
            .lsa_barriers(u32::MAX)
            .check(&one_gpu_host(), LIB, ABI)
            .unwrap_err();
        assert!(err.to_string().contains("does not fit"), "{err}");
    }

    #[test]
    fn the_struct_handed_over_is_the_one_of_the_kernels_headers() {
        assert_eq!(struct_size(v(2, 29, 2)), 72);
        assert_eq!(struct_size(v(2, 29, 3)), 72);
        assert_eq!(struct_size(v(2, 29, 7)), 88);
        assert_eq!(struct_size(v(2, 30, 3)), 96);
        assert_eq!(struct_size(v(2, 30, 7)), 96);
        assert_eq!(struct_size(v(2, 31, 2)), 96);
        assert_eq!(struct_size(v(2, 32, 3)), 120);
        assert_eq!(struct_size(v(2, 33, 0)), 120);
        let raw = DevCommRequirements::new()
            .lsa_barriers(2)
            .to_raw(DeviceAbi::new(v(2, 30, 7)));
        assert_eq!((raw.size, raw.version), (96, 23007));
        assert_eq!(raw.magic, nccl_sys::NCCL_API_MAGIC);
        // The prefix of 2.29.2 ends with the GIN counters, the fields after stay defaults.
        assert_eq!(
            std::mem::offset_of!(ncclDevCommRequirements_t, ginCounterCount) + 4,
            72
        );
        assert_eq!(
            std::mem::offset_of!(ncclDevCommRequirements_t, ginQueueDepth) + 4,
            84
        );
        assert_eq!(
            std::mem::offset_of!(ncclDevCommRequirements_t, ginVaSignalsRequired) + 1,
            94
        );
    }
}
