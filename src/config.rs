//! Communicator configuration (`ncclConfig_t`).
//!
//! Every field starts unset, meaning "NCCL decides" (`NCCL_CONFIG_UNDEF_INT`). Setting a field
//! the loaded library does not know is an [`Error::Unsupported`] when the configuration is
//! used: NCCL copies only the part of the struct it knows, so an older library would silently
//! drop the setting. The struct's `size`, `magic` and `version` are filled exactly as
//! `NCCL_CONFIG_INITIALIZER` does for the 2.32.3 header.
//!
//! NCCL's environment variables take precedence over these fields where both exist (for
//! example `NCCL_COMM_BLOCKING` over [`CommConfig::blocking`]).

use std::ffi::CString;
use std::os::raw::c_int;
use std::time::Duration;

use nccl_sys::ncclConfig_t;

use crate::error::{Error, Result};
use crate::library::{Library, Version};

/// Default for [`CommConfig::ready_timeout`].
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(600);

/// CTA policy flags (`NCCL_CTA_POLICY_*`), combinable with `|`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CtaPolicy(pub u32);

impl CtaPolicy {
    /// `NCCL_CTA_POLICY_DEFAULT`: NCCL's default trade-off (2.27).
    pub const DEFAULT: CtaPolicy = CtaPolicy(0x00);
    /// `NCCL_CTA_POLICY_EFFICIENCY`: fewer CTAs, leaving SMs to computation (2.27).
    pub const EFFICIENCY: CtaPolicy = CtaPolicy(0x01);
    /// `NCCL_CTA_POLICY_ZERO`: zero-CTA copy-engine paths where possible (2.28; needs
    /// symmetric windows and a CUDA 12.5 driver).
    pub const ZERO: CtaPolicy = CtaPolicy(0x02);
}

impl std::ops::BitOr for CtaPolicy {
    type Output = CtaPolicy;
    fn bitor(self, rhs: CtaPolicy) -> CtaPolicy {
        CtaPolicy(self.0 | rhs.0)
    }
}

/// How the communicator will be used with CUDA graphs (`graphUsageMode`, NCCL 2.29).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GraphUsageMode {
    /// No CUDA graph captures NCCL work (0).
    NoGraphs,
    /// One graph at a time (1).
    SingleGraph,
    /// Several graphs, or graphs mixed with eager launches (2, NCCL's default).
    MultipleGraphs,
}

/// Host copy-engine collective mode (`ncclHostCftMode_t`, NCCL 2.31).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostCftMode {
    /// `ncclHostCftEnable`
    Enable,
    /// `ncclHostCftDisable`
    Disable,
    /// `ncclHostCftFallback`
    Fallback,
}

/// Host NVLS component switches (`ncclNvlsHostMode_t`, NCCL 2.31), combinable with `|`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NvlsHostMode(pub i32);

impl NvlsHostMode {
    /// Every host NVLS component enabled.
    pub const ENABLE: NvlsHostMode = NvlsHostMode(0);
    /// Disable the NVLS transport and registered-buffer optimisation.
    pub const DISABLE_TRANSPORT: NvlsHostMode = NvlsHostMode(1);
    /// Disable multimem in internal symmetric kernels and copy engines.
    pub const DISABLE_SYMMETRIC_MULTIMEM: NvlsHostMode = NvlsHostMode(2);
    /// Disable every present and future host NVLS component.
    pub const DISABLE: NvlsHostMode = NvlsHostMode(i32::MAX);
}

impl std::ops::BitOr for NvlsHostMode {
    type Output = NvlsHostMode;
    fn bitor(self, rhs: NvlsHostMode) -> NvlsHostMode {
        NvlsHostMode(self.0 | rhs.0)
    }
}

/// Configuration for creating a communicator; see the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommConfig {
    blocking: Option<bool>,
    cga_cluster_size: Option<u32>,
    min_ctas: Option<u32>,
    max_ctas: Option<u32>,
    net_name: Option<String>,
    split_share: Option<bool>,
    traffic_class: Option<u32>,
    comm_name: Option<String>,
    collnet_enable: Option<bool>,
    cta_policy: Option<CtaPolicy>,
    shrink_share: Option<bool>,
    nvls_ctas: Option<u32>,
    n_channels_per_net_peer: Option<u32>,
    nvlink_centric_sched: Option<bool>,
    graph_usage_mode: Option<GraphUsageMode>,
    num_rma_ctx: Option<u32>,
    max_p2p_peers: Option<u32>,
    graph_stream_ordering: Option<bool>,
    launch_order_implicit: Option<bool>,
    num_rma_sig: Option<u32>,
    rma_eager_init: Option<bool>,
    host_cft_mode: Option<HostCftMode>,
    nvls_host_mode: Option<NvlsHostMode>,
    ready_timeout: Duration,
}

impl Default for CommConfig {
    fn default() -> Self {
        Self {
            blocking: None,
            cga_cluster_size: None,
            min_ctas: None,
            max_ctas: None,
            net_name: None,
            split_share: None,
            traffic_class: None,
            comm_name: None,
            collnet_enable: None,
            cta_policy: None,
            shrink_share: None,
            nvls_ctas: None,
            n_channels_per_net_peer: None,
            nvlink_centric_sched: None,
            graph_usage_mode: None,
            num_rma_ctx: None,
            max_p2p_peers: None,
            graph_stream_ordering: None,
            launch_order_implicit: None,
            num_rma_sig: None,
            rma_eager_init: None,
            host_cft_mode: None,
            nvls_host_mode: None,
            ready_timeout: DEFAULT_READY_TIMEOUT,
        }
    }
}

macro_rules! setters {
    ($( $(#[$doc:meta])* $name:ident: $ty:ty; )*) => {$(
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Self {
            self.$name = Some(value.into());
            self
        }
    )*};
}

impl CommConfig {
    /// A configuration with every field left to NCCL.
    pub fn new() -> Self {
        Self::default()
    }

    setters! {
        /// `blocking` (2.14): `false` makes creation and operations return while NCCL still
        /// works in the background; this crate then polls until the communicator is ready
        /// (see [`CommConfig::ready_timeout`]). Needed for aborting from another thread.
        blocking: bool;
        /// `cgaClusterSize` (2.17): CUDA thread-block cluster size, 0 to 8.
        cga_cluster_size: u32;
        /// `minCTAs` (2.17): lower bound on the CTAs (channels) NCCL uses, at least 1.
        min_ctas: u32;
        /// `maxCTAs` (2.17): upper bound on the CTAs NCCL uses, at least 1.
        max_ctas: u32;
        /// `netName` (2.17): the network module to use, e.g. `"IB"` or `"Socket"`.
        net_name: String;
        /// `splitShare` (2.18): children created by split share resources with this
        /// communicator (cheaper, but aborting one may make the others unusable).
        split_share: bool;
        /// `trafficClass` (2.26): network traffic class for this communicator.
        traffic_class: u32;
        /// `commName` (2.27): a name used in NCCL's logs and profiler events.
        comm_name: String;
        /// `collnetEnable` (2.27): allow CollNet (e.g. IB SHARP) algorithms.
        collnet_enable: bool;
        /// `CTAPolicy` (2.27): see [`CtaPolicy`].
        cta_policy: CtaPolicy;
        /// `shrinkShare` (2.27): communicators created by shrink share resources.
        shrink_share: bool;
        /// `nvlsCTAs` (2.27): CTAs used by NVLS algorithms, at least 1.
        nvls_ctas: u32;
        /// `nChannelsPerNetPeer` (2.28): channels per network peer, 1 to 64 (NCCL rounds up
        /// to a power of two).
        n_channels_per_net_peer: u32;
        /// `nvlinkCentricSched` (2.28): NVLink-centric scheduling.
        nvlink_centric_sched: bool;
        /// `graphUsageMode` (2.29): see [`GraphUsageMode`].
        graph_usage_mode: GraphUsageMode;
        /// `numRmaCtx` (2.29): number of one-sided (RMA) contexts.
        num_rma_ctx: u32;
        /// `maxP2pPeers` (2.30.3): upper bound on point-to-point peers per rank, at least 1.
        max_p2p_peers: u32;
        /// `graphStreamOrdering` (2.30.7): keep stream ordering inside captured graphs
        /// (`false` needs a graph usage mode of no or single graph).
        graph_stream_ordering: bool;
        /// `launchOrderImplicit` (2.31): order launches of several communicators on one
        /// device by host issue order (`NCCL_LAUNCH_ORDER_IMPLICIT`).
        launch_order_implicit: bool;
        /// `numRmaSig` (2.31): number of RMA signal slots.
        num_rma_sig: u32;
        /// `rmaEagerInit` (2.31): set up one-sided signalling at creation instead of at the
        /// first window registration.
        rma_eager_init: bool;
        /// `hostCftMode` (2.31): see [`HostCftMode`].
        host_cft_mode: HostCftMode;
        /// `nvlsHostMode` (2.31): see [`NvlsHostMode`].
        nvls_host_mode: NvlsHostMode;
    }

    /// How long a nonblocking communicator may stay in progress (creation, split, enqueue)
    /// before the call fails with [`Error::Timeout`]. Not an NCCL field. Default 10 minutes.
    pub fn ready_timeout(&self) -> Duration {
        self.ready_timeout
    }

    /// Sets [`CommConfig::ready_timeout`].
    pub fn with_ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// Whether the communicator will be blocking (unset means blocking, NCCL's default).
    pub fn is_blocking(&self) -> bool {
        self.blocking.unwrap_or(true)
    }

    /// The configuration a child inherits when none is given: this one's blocking mode.
    pub(crate) fn inherit_blocking(mut self, parent_blocking: bool) -> Self {
        self.blocking.get_or_insert(parent_blocking);
        self
    }

    /// Every NCCL field that is set, with the first NCCL version that knows it.
    fn fields_set(&self) -> Vec<(&'static str, Version)> {
        let v = Version::new;
        let mut set = Vec::new();
        let mut add = |present: bool, name: &'static str, since: Version| {
            if present {
                set.push((name, since));
            }
        };
        add(self.blocking.is_some(), "blocking", v(2, 14, 0));
        add(
            self.cga_cluster_size.is_some(),
            "cgaClusterSize",
            v(2, 17, 0),
        );
        add(self.min_ctas.is_some(), "minCTAs", v(2, 17, 0));
        add(self.max_ctas.is_some(), "maxCTAs", v(2, 17, 0));
        add(self.net_name.is_some(), "netName", v(2, 17, 0));
        add(self.split_share.is_some(), "splitShare", v(2, 18, 0));
        add(self.traffic_class.is_some(), "trafficClass", v(2, 26, 0));
        add(self.comm_name.is_some(), "commName", v(2, 27, 0));
        add(self.collnet_enable.is_some(), "collnetEnable", v(2, 27, 0));
        add(self.cta_policy.is_some(), "CTAPolicy", v(2, 27, 0));
        add(self.shrink_share.is_some(), "shrinkShare", v(2, 27, 0));
        add(self.nvls_ctas.is_some(), "nvlsCTAs", v(2, 27, 0));
        add(
            self.n_channels_per_net_peer.is_some(),
            "nChannelsPerNetPeer",
            v(2, 28, 0),
        );
        add(
            self.nvlink_centric_sched.is_some(),
            "nvlinkCentricSched",
            v(2, 28, 0),
        );
        add(
            self.graph_usage_mode.is_some(),
            "graphUsageMode",
            v(2, 29, 0),
        );
        add(self.num_rma_ctx.is_some(), "numRmaCtx", v(2, 29, 0));
        add(self.max_p2p_peers.is_some(), "maxP2pPeers", v(2, 30, 3));
        add(
            self.graph_stream_ordering.is_some(),
            "graphStreamOrdering",
            v(2, 30, 7),
        );
        add(
            self.launch_order_implicit.is_some(),
            "launchOrderImplicit",
            v(2, 31, 0),
        );
        add(self.num_rma_sig.is_some(), "numRmaSig", v(2, 31, 0));
        add(self.rma_eager_init.is_some(), "rmaEagerInit", v(2, 31, 0));
        add(self.host_cft_mode.is_some(), "hostCftMode", v(2, 31, 0));
        add(self.nvls_host_mode.is_some(), "nvlsHostMode", v(2, 31, 0));
        set
    }

    fn validate(&self) -> Result<()> {
        // NCCL stores every field in a C `int`; larger values are refused, never clamped.
        const INT: u32 = c_int::MAX as u32;
        let ranges = [
            ("cgaClusterSize", self.cga_cluster_size, 0, 8),
            ("minCTAs", self.min_ctas, 1, INT),
            ("maxCTAs", self.max_ctas, 1, INT),
            ("trafficClass", self.traffic_class, 0, INT),
            ("CTAPolicy", self.cta_policy.map(|p| p.0), 0, INT),
            ("nvlsCTAs", self.nvls_ctas, 1, INT),
            ("nChannelsPerNetPeer", self.n_channels_per_net_peer, 1, 64),
            ("numRmaCtx", self.num_rma_ctx, 0, INT),
            ("maxP2pPeers", self.max_p2p_peers, 1, INT),
            ("numRmaSig", self.num_rma_sig, 0, INT),
        ];
        for (name, value, min, max) in ranges {
            if let Some(value) = value.filter(|v| !(min..=max).contains(v)) {
                return Err(out_of_range(name, value.into(), min.into(), max.into()));
            }
        }
        if let Some(NvlsHostMode(mode)) = self.nvls_host_mode.filter(|m| m.0 < 0) {
            return Err(out_of_range("nvlsHostMode", mode.into(), 0, INT.into()));
        }
        if let (Some(min), Some(max)) = (self.min_ctas, self.max_ctas) {
            if min > max {
                return Err(Error::invalid(format!(
                    "minCTAs ({min}) is larger than maxCTAs ({max})"
                )));
            }
        }
        if self.graph_stream_ordering == Some(false)
            && self.graph_usage_mode == Some(GraphUsageMode::MultipleGraphs)
        {
            return Err(Error::invalid(
                "graphStreamOrdering = false needs graphUsageMode NoGraphs or SingleGraph",
            ));
        }
        for (name, value) in [("netName", &self.net_name), ("commName", &self.comm_name)] {
            if value.as_deref().is_some_and(|s| s.contains('\0')) {
                return Err(Error::invalid(format!("{name} contains a NUL byte")));
            }
        }
        Ok(())
    }

    /// Builds the raw struct for `lib`, checking every set field against its version.
    pub(crate) fn to_raw(&self, lib: &Library) -> Result<RawConfig> {
        self.to_raw_for(lib.version())
    }

    pub(crate) fn to_raw_for(&self, version: Version) -> Result<RawConfig> {
        self.validate()?;
        let fields = self.fields_set();
        if fields.is_empty() {
            return Ok(RawConfig {
                config: None,
                _strings: Vec::new(),
            });
        }
        // Every field is at least as new as ncclCommInitRankConfig (2.14), so this also
        // refuses any configuration on a library without the config API.
        for (name, since) in &fields {
            if version < *since {
                return Err(Error::Unsupported {
                    api: name,
                    needs: *since,
                    found: version,
                });
            }
        }
        let mut cfg = nccl_sys::nccl_config_initializer();
        // In range: `validate` refused anything above `c_int::MAX`.
        let int = |value: u32| value as c_int;
        let flag = |value: bool| c_int::from(value);
        let mut strings = Vec::new();
        let mut c_string = |value: &str| -> Result<*const std::os::raw::c_char> {
            let owned = CString::new(value)
                .map_err(|_| Error::invalid(format!("{value:?} contains a NUL byte")))?;
            let ptr = owned.as_ptr();
            strings.push(owned);
            Ok(ptr)
        };
        if let Some(v) = self.blocking {
            cfg.blocking = flag(v);
        }
        if let Some(v) = self.cga_cluster_size {
            cfg.cgaClusterSize = int(v);
        }
        if let Some(v) = self.min_ctas {
            cfg.minCTAs = int(v);
        }
        if let Some(v) = self.max_ctas {
            cfg.maxCTAs = int(v);
        }
        if let Some(v) = &self.net_name {
            cfg.netName = c_string(v)?;
        }
        if let Some(v) = self.split_share {
            cfg.splitShare = flag(v);
        }
        if let Some(v) = self.traffic_class {
            cfg.trafficClass = int(v);
        }
        if let Some(v) = &self.comm_name {
            cfg.commName = c_string(v)?;
        }
        if let Some(v) = self.collnet_enable {
            cfg.collnetEnable = flag(v);
        }
        if let Some(v) = self.cta_policy {
            cfg.CTAPolicy = int(v.0);
        }
        if let Some(v) = self.shrink_share {
            cfg.shrinkShare = flag(v);
        }
        if let Some(v) = self.nvls_ctas {
            cfg.nvlsCTAs = int(v);
        }
        if let Some(v) = self.n_channels_per_net_peer {
            cfg.nChannelsPerNetPeer = int(v);
        }
        if let Some(v) = self.nvlink_centric_sched {
            cfg.nvlinkCentricSched = flag(v);
        }
        if let Some(v) = self.graph_usage_mode {
            cfg.graphUsageMode = match v {
                GraphUsageMode::NoGraphs => 0,
                GraphUsageMode::SingleGraph => 1,
                GraphUsageMode::MultipleGraphs => 2,
            };
        }
        if let Some(v) = self.num_rma_ctx {
            cfg.numRmaCtx = int(v);
        }
        if let Some(v) = self.max_p2p_peers {
            cfg.maxP2pPeers = int(v);
        }
        if let Some(v) = self.graph_stream_ordering {
            cfg.graphStreamOrdering = flag(v);
        }
        if let Some(v) = self.launch_order_implicit {
            cfg.launchOrderImplicit = flag(v);
        }
        if let Some(v) = self.num_rma_sig {
            cfg.numRmaSig = int(v);
        }
        if let Some(v) = self.rma_eager_init {
            cfg.rmaEagerInit = flag(v);
        }
        if let Some(v) = self.host_cft_mode {
            cfg.hostCftMode = match v {
                HostCftMode::Enable => 1,
                HostCftMode::Disable => 2,
                HostCftMode::Fallback => 3,
            };
        }
        if let Some(v) = self.nvls_host_mode {
            cfg.nvlsHostMode = v.0;
        }
        Ok(RawConfig {
            config: Some(cfg),
            _strings: strings,
        })
    }
}

fn out_of_range(field: &str, value: i64, min: i64, max: i64) -> Error {
    Error::invalid(format!(
        "{field} = {value} is out of range: NCCL takes {min} to {max}"
    ))
}

/// An `ncclConfig_t` ready for NCCL, with the strings its pointers refer to.
pub(crate) struct RawConfig {
    /// `None` when nothing was set, so calls without a config (or a null one) can be used.
    config: Option<ncclConfig_t>,
    // Owns the storage behind `netName`/`commName`; moving a CString does not move its bytes.
    _strings: Vec<CString>,
}

impl RawConfig {
    /// For calls where a null config means "inherit the parent's" (split, shrink, grow):
    /// `None` gives a null pointer from [`RawConfig::as_mut_ptr`].
    pub(crate) fn inherit_or(config: Option<&CommConfig>, lib: &Library) -> Result<Self> {
        match config {
            Some(config) => config.to_raw(lib),
            None => Ok(RawConfig {
                config: None,
                _strings: Vec::new(),
            }),
        }
    }

    /// The struct's address, or null when nothing was set.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut ncclConfig_t {
        self.config
            .as_mut()
            .map_or(std::ptr::null_mut(), |cfg| cfg as *mut _)
    }

    /// The struct to pass to NCCL, if any field was set.
    pub(crate) fn as_mut(&mut self) -> Option<&mut ncclConfig_t> {
        self.config.as_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    const NEW: Version = Version::new(2, 32, 3);

    #[test]
    fn default_config_needs_no_struct() {
        let mut raw = CommConfig::default()
            .to_raw_for(Version::new(2, 4, 0))
            .unwrap();
        assert!(raw.as_mut().is_none());
        assert!(CommConfig::default().is_blocking());
    }

    #[test]
    fn struct_is_filled_like_the_initializer() {
        let mut raw = CommConfig::new()
            .blocking(false)
            .max_ctas(16)
            .net_name("Socket".to_string())
            .comm_name("trainer".to_string())
            .cta_policy(CtaPolicy::EFFICIENCY | CtaPolicy::ZERO)
            .graph_usage_mode(GraphUsageMode::SingleGraph)
            .nvls_host_mode(NvlsHostMode::DISABLE)
            .to_raw_for(NEW)
            .unwrap();
        let cfg = raw.as_mut().unwrap();
        assert_eq!(cfg.size, std::mem::size_of::<ncclConfig_t>());
        assert_eq!(cfg.size, 120);
        assert_eq!(cfg.magic, 0xcafe_beef);
        assert_eq!(cfg.version, 23203);
        assert_eq!(cfg.blocking, 0);
        assert_eq!(cfg.maxCTAs, 16);
        assert_eq!(
            cfg.minCTAs,
            c_int::MIN,
            "unset fields stay NCCL_CONFIG_UNDEF_INT"
        );
        assert_eq!(cfg.CTAPolicy, 3);
        assert_eq!(cfg.graphUsageMode, 1);
        assert_eq!(cfg.nvlsHostMode, i32::MAX);
        assert_eq!(cfg.splitShare, c_int::MIN);
        // SAFETY: the pointers refer to CStrings owned by `raw`, alive here.
        let net = unsafe { CStr::from_ptr(cfg.netName) };
        assert_eq!(net.to_str().unwrap(), "Socket");
        // SAFETY: as above.
        let name = unsafe { CStr::from_ptr(cfg.commName) };
        assert_eq!(name.to_str().unwrap(), "trainer");
    }

    #[test]
    fn fields_newer_than_the_library_are_unsupported() {
        let cases: Vec<(CommConfig, &str, Version)> = vec![
            (
                CommConfig::new().blocking(false),
                "blocking",
                Version::new(2, 14, 0),
            ),
            (
                CommConfig::new().split_share(true),
                "splitShare",
                Version::new(2, 18, 0),
            ),
            (
                CommConfig::new().traffic_class(3),
                "trafficClass",
                Version::new(2, 26, 0),
            ),
            (
                CommConfig::new().shrink_share(true),
                "shrinkShare",
                Version::new(2, 27, 0),
            ),
            (
                CommConfig::new().nvlink_centric_sched(true),
                "nvlinkCentricSched",
                Version::new(2, 28, 0),
            ),
            (
                CommConfig::new().num_rma_ctx(2),
                "numRmaCtx",
                Version::new(2, 29, 0),
            ),
            (
                CommConfig::new().max_p2p_peers(4),
                "maxP2pPeers",
                Version::new(2, 30, 3),
            ),
            (
                CommConfig::new().graph_stream_ordering(true),
                "graphStreamOrdering",
                Version::new(2, 30, 7),
            ),
            (
                CommConfig::new().rma_eager_init(true),
                "rmaEagerInit",
                Version::new(2, 31, 0),
            ),
            (
                CommConfig::new().host_cft_mode(HostCftMode::Disable),
                "hostCftMode",
                Version::new(2, 31, 0),
            ),
        ];
        for (config, field, since) in cases {
            let older = Version::new(since.major, since.minor, since.patch.saturating_sub(1));
            let older = if older == since {
                Version::new(since.major, since.minor - 1, 99)
            } else {
                older
            };
            match config.to_raw_for(older) {
                Err(Error::Unsupported { api, needs, found }) => {
                    assert_eq!(api, field);
                    assert_eq!(needs, since);
                    assert_eq!(found, older);
                }
                Err(other) => panic!("{field}: unexpected error {other}"),
                Ok(_) => panic!("{field} accepted by NCCL {older}"),
            }
            assert!(
                config.to_raw_for(since).is_ok(),
                "{field} rejected by {since}"
            );
        }
        // The 2.28 libraries on the test machines.
        let nccl_2_28_3 = Version::new(2, 28, 3);
        assert!(CommConfig::new()
            .nvlink_centric_sched(true)
            .to_raw_for(nccl_2_28_3)
            .is_ok());
        assert!(CommConfig::new()
            .graph_usage_mode(GraphUsageMode::NoGraphs)
            .to_raw_for(nccl_2_28_3)
            .is_err());
    }

    #[test]
    fn bad_values_are_rejected() {
        let err = |c: CommConfig| {
            c.to_raw_for(NEW)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert!(err(CommConfig::new().min_ctas(8).max_ctas(4)).contains("minCTAs (8) is larger"));
        assert!(err(CommConfig::new().max_ctas(0)).contains("maxCTAs = 0 is out of range"));
        assert!(err(CommConfig::new().cga_cluster_size(9)).contains("NCCL takes 0 to 8"));
        assert!(err(CommConfig::new().n_channels_per_net_peer(65)).contains("NCCL takes 1 to 64"));
        assert!(err(CommConfig::new().net_name("I\0B".into())).contains("NUL"));
        assert!(err(CommConfig::new()
            .graph_stream_ordering(false)
            .graph_usage_mode(GraphUsageMode::MultipleGraphs))
        .contains("graphStreamOrdering"));
    }

    #[test]
    fn every_numeric_field_is_range_checked_never_clamped() {
        type Set = fn(CommConfig, u32) -> CommConfig;
        let int = i32::MAX as u32;
        let fields: [(&str, Set, u32, u32); 10] = [
            ("cgaClusterSize", |c, v| c.cga_cluster_size(v), 0, 8),
            ("minCTAs", |c, v| c.min_ctas(v), 1, int),
            ("maxCTAs", |c, v| c.max_ctas(v), 1, int),
            ("trafficClass", |c, v| c.traffic_class(v), 0, int),
            ("CTAPolicy", |c, v| c.cta_policy(CtaPolicy(v)), 0, int),
            ("nvlsCTAs", |c, v| c.nvls_ctas(v), 1, int),
            (
                "nChannelsPerNetPeer",
                |c, v| c.n_channels_per_net_peer(v),
                1,
                64,
            ),
            ("numRmaCtx", |c, v| c.num_rma_ctx(v), 0, int),
            ("maxP2pPeers", |c, v| c.max_p2p_peers(v), 1, int),
            ("numRmaSig", |c, v| c.num_rma_sig(v), 0, int),
        ];
        for (field, set, min, max) in fields {
            for bad in [max + 1, u32::MAX].into_iter().chain(min.checked_sub(1)) {
                match set(CommConfig::new(), bad).to_raw_for(NEW) {
                    Err(Error::InvalidArgument(text)) => assert_eq!(
                        text,
                        format!("{field} = {bad} is out of range: NCCL takes {min} to {max}")
                    ),
                    Err(other) => panic!("{field} = {bad}: unexpected error {other}"),
                    Ok(_) => panic!("{field} = {bad} accepted"),
                }
            }
            for good in [min, max] {
                let mut raw = set(CommConfig::new(), good).to_raw_for(NEW).unwrap();
                let cfg = raw.as_mut().unwrap();
                let stored = [
                    cfg.cgaClusterSize,
                    cfg.minCTAs,
                    cfg.maxCTAs,
                    cfg.trafficClass,
                    cfg.CTAPolicy,
                    cfg.nvlsCTAs,
                    cfg.nChannelsPerNetPeer,
                    cfg.numRmaCtx,
                    cfg.maxP2pPeers,
                    cfg.numRmaSig,
                ];
                assert!(stored.contains(&(good as c_int)), "{field} = {good}");
            }
        }
        let err = CommConfig::new()
            .nvls_host_mode(NvlsHostMode(i32::MIN))
            .to_raw_for(NEW)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("nvlsHostMode = -2147483648 is out of range: NCCL takes 0 to 2147483647"),
            "{err}"
        );
    }

    #[test]
    fn children_inherit_blocking_unless_set() {
        assert!(!CommConfig::new().inherit_blocking(false).is_blocking());
        assert!(CommConfig::new()
            .blocking(true)
            .inherit_blocking(false)
            .is_blocking());
    }
}
