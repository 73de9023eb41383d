//! Communicator configuration (`ncclConfig_t`).
//!
//! Every field starts unset, meaning "NCCL decides" (`NCCL_CONFIG_UNDEF_INT`). Setting a field
//! the loaded library does not know is an [`Error::Unsupported`] when the configuration is
//! used: NCCL copies only the part of the struct it knows, so an older library would silently
//! drop the setting. A value NCCL cannot take (beyond a C `int`, or outside the field's
//! documented range) is an [`Error::InvalidArgument`] naming the field, the value and the
//! range, never clamped. The struct's `size`, `magic` and `version` are filled exactly as
//! `NCCL_CONFIG_INITIALIZER` does for the 2.32.3 header.
//!
//! Setters are builder methods named after the field (`CommConfig::new().blocking(false)
//! .max_ctas(16).comm_name("trainer")`); strings are taken as `&str` or `String`.
//!
//! NCCL's environment variables take precedence over these fields where both exist (for
//! example `NCCL_COMM_BLOCKING` over [`CommConfig::blocking`]).

use std::ffi::CString;
use std::os::raw::{c_char, c_int};
use std::time::Duration;

use nccl_sys::ncclConfig_t;

use crate::error::{Error, Result};
use crate::library::Library;
use crate::release::Version;

pub(crate) mod ranges;
use ranges::Range;

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

/// `NCCL_CTA_POLICY` as NCCL reads it: a single digit 0, 1 or 2 (the older form), or
/// `DEFAULT|EFFICIENCY|ZERO` names joined by `|`, any case; `None` where NCCL would ignore it.
fn parse_cta_policy(text: &str) -> Option<u32> {
    let text = text.trim();
    if text.starts_with(|c: char| c.is_ascii_digit()) {
        return match text.as_bytes()[0] {
            b'0' => Some(CtaPolicy::DEFAULT.0),
            b'1' => Some(CtaPolicy::EFFICIENCY.0),
            b'2' => Some(CtaPolicy::ZERO.0),
            _ => None,
        };
    }
    let mut policy = None;
    for token in text.split('|') {
        let bits = match token.trim().to_ascii_uppercase().as_str() {
            "DEFAULT" => CtaPolicy::DEFAULT.0,
            "EFFICIENCY" => CtaPolicy::EFFICIENCY.0,
            "ZERO" => CtaPolicy::ZERO.0,
            _ => continue,
        };
        policy = Some(policy.unwrap_or(0) | bits);
    }
    policy
}

/// `NCCL_CTA_POLICY` from the environment, where set to something NCCL reads.
pub(crate) fn env_cta_policy() -> Option<u32> {
    std::env::var("NCCL_CTA_POLICY")
        .ok()
        .as_deref()
        .and_then(parse_cta_policy)
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

/// How a field's Rust value becomes its `ncclConfig_t` member.
trait Setting {
    /// The member's C type.
    type C;
    /// Checks the value against `range` and converts it; strings are kept alive in `strings`.
    fn to_c(&self, field: &str, range: Range, strings: &mut Vec<CString>) -> Result<Self::C>;
}

/// A setting NCCL stores as an `int`; the table's range applies to [`IntSetting::value`].
/// [`CollConfig`](crate::CollConfig)'s table reads its fields through it too.
pub(crate) trait IntSetting {
    /// The value NCCL gets, before it is narrowed to a C `int`.
    fn value(&self) -> i64;
}

impl<T: IntSetting> Setting for T {
    type C = c_int;
    fn to_c(&self, field: &str, range: Range, _: &mut Vec<CString>) -> Result<c_int> {
        match c_int::try_from(self.value()) {
            Ok(value) if range.contains(i64::from(value)) => Ok(value),
            _ => Err(Error::invalid(format!(
                "{field} = {} is out of range: NCCL takes {} to {}",
                self.value(),
                range.min,
                range.max
            ))),
        }
    }
}

impl Setting for String {
    type C = *const c_char;
    fn to_c(&self, field: &str, _: Range, strings: &mut Vec<CString>) -> Result<Self::C> {
        let owned = CString::new(self.as_str())
            .map_err(|_| Error::invalid(format!("{field} {self:?} contains a NUL byte")))?;
        // The bytes stay where they are when the CString moves into `strings`.
        let ptr = owned.as_ptr();
        strings.push(owned);
        Ok(ptr)
    }
}

impl IntSetting for bool {
    fn value(&self) -> i64 {
        i64::from(*self)
    }
}

impl IntSetting for u32 {
    fn value(&self) -> i64 {
        i64::from(*self)
    }
}

impl IntSetting for CtaPolicy {
    fn value(&self) -> i64 {
        i64::from(self.0)
    }
}

impl IntSetting for NvlsHostMode {
    fn value(&self) -> i64 {
        i64::from(self.0)
    }
}

impl IntSetting for GraphUsageMode {
    fn value(&self) -> i64 {
        match self {
            GraphUsageMode::NoGraphs => 0,
            GraphUsageMode::SingleGraph => 1,
            GraphUsageMode::MultipleGraphs => 2,
        }
    }
}

impl IntSetting for HostCftMode {
    fn value(&self) -> i64 {
        match self {
            HostCftMode::Enable => 1,
            HostCftMode::Disable => 2,
            HostCftMode::Fallback => 3,
        }
    }
}

/// Generates [`CommConfig`] from one row per `ncclConfig_t` field:
///
/// ```text
/// /// doc
/// rust_name: StoredType [as SetterArgument] [[RANGE]] => cField since (major, minor, patch);
/// ```
///
/// The setter takes `SetterArgument` (default: the stored type) and converts it with `Into`.
/// `[RANGE]`, one of [`ranges`], narrows the accepted values of an `int` field (default:
/// [`ranges::NON_NEGATIVE`]).
macro_rules! config_fields {
    (@arg $ty:ty) => { $ty };
    (@arg $ty:ty, $arg:ty) => { $arg };
    (@range) => { ranges::NON_NEGATIVE };
    (@range $range:expr) => { $range };
    ($(
        $(#[doc = $doc:expr])*
        $name:ident: $ty:ty $(as $arg:ty)? $([$range:expr])?
            => $c:ident since ($major:literal, $minor:literal, $patch:literal);
    )*) => {
        /// Configuration for creating a communicator; see the [module docs](self).
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct CommConfig {
            $( $name: Option<$ty>, )*
            /// See [`CommConfig::ready_timeout`].
            pub(crate) ready_timeout: Duration,
            /// See [`CommConfig::flight_recorder`]; `None`: the default.
            pub(crate) flight_recorder: Option<usize>,
        }

        impl Default for CommConfig {
            fn default() -> Self {
                Self {
                    $( $name: None, )*
                    ready_timeout: DEFAULT_READY_TIMEOUT,
                    flight_recorder: None,
                }
            }
        }

        impl CommConfig {
            $(
                #[doc = concat!(
                    "Sets `", stringify!($c), "` (NCCL ", $major, ".", $minor, ".", $patch,
                    " or newer).\n\n"
                )]
                $(#[doc = $doc])*
                #[must_use]
                pub fn $name(mut self, value: config_fields!(@arg $ty $(, $arg)?)) -> Self {
                    self.$name = Some(value.into());
                    self
                }
            )*

            /// Every NCCL field: its C name and the first NCCL version that has it.
            #[cfg(test)]
            const FIELDS: &'static [(&'static str, Version)] =
                &[$( (stringify!($c), Version::new($major, $minor, $patch)) ),*];

            /// The raw struct with every set field, or `None` when none is set; range errors
            /// first, then the first field (in table order) newer than `version`.
            fn fill(&self, version: Version) -> Result<Option<(ncclConfig_t, Vec<CString>)>> {
                let mut cfg = nccl_sys::nccl_config_initializer();
                let mut strings = Vec::new();
                let mut any = false;
                let mut too_new = None;
                $(
                    if let Some(value) = &self.$name {
                        let range = config_fields!(@range $($range)?);
                        cfg.$c = value.to_c(stringify!($c), range, &mut strings)?;
                        let since = Version::new($major, $minor, $patch);
                        any = true;
                        if version < since && too_new.is_none() {
                            too_new = Some((stringify!($c), since));
                        }
                    }
                )*
                self.check_combinations()?;
                // Every field is at least as new as ncclCommInitRankConfig (2.14), so this also
                // refuses any configuration on a library without the config API.
                if let Some((api, needs)) = too_new {
                    return Err(Error::Unsupported { api, needs, found: version });
                }
                Ok(any.then_some((cfg, strings)))
            }
        }
    };
}

config_fields! {
    /// `false` makes creation and operations return while NCCL still works in the
    /// background; this crate then polls until the communicator is ready (see
    /// [`CommConfig::ready_timeout`]). Needed for aborting from another thread.
    blocking: bool => blocking since (2, 14, 0);
    /// CUDA thread-block cluster size, 0 to 8.
    cga_cluster_size: u32 [ranges::CGA_CLUSTER_SIZE] => cgaClusterSize since (2, 17, 0);
    /// Lower bound on the CTAs (channels) NCCL uses, at least 1.
    min_ctas: u32 [ranges::AT_LEAST_ONE] => minCTAs since (2, 17, 0);
    /// Upper bound on the CTAs NCCL uses, at least 1.
    max_ctas: u32 [ranges::AT_LEAST_ONE] => maxCTAs since (2, 17, 0);
    /// The network module to use, e.g. `"IB"` or `"Socket"`.
    net_name: String as impl Into<String> => netName since (2, 17, 0);
    /// Children created by split share resources with this communicator (cheaper, but
    /// aborting one may make the others unusable).
    split_share: bool => splitShare since (2, 18, 0);
    /// Network traffic class for this communicator.
    traffic_class: u32 => trafficClass since (2, 26, 0);
    /// A name used in NCCL's logs and profiler events.
    comm_name: String as impl Into<String> => commName since (2, 27, 0);
    /// Allow CollNet (e.g. IB SHARP) algorithms.
    collnet_enable: bool => collnetEnable since (2, 27, 0);
    /// See [`CtaPolicy`].
    cta_policy: CtaPolicy => CTAPolicy since (2, 27, 0);
    /// Communicators created by shrink share resources.
    shrink_share: bool => shrinkShare since (2, 27, 0);
    /// CTAs used by NVLS algorithms, at least 1.
    nvls_ctas: u32 [ranges::AT_LEAST_ONE] => nvlsCTAs since (2, 27, 0);
    /// Channels per network peer, 1 to 64 (NCCL rounds up to a power of two).
    n_channels_per_net_peer: u32 [ranges::CHANNELS_PER_NET_PEER] => nChannelsPerNetPeer since (2, 28, 0);
    /// NVLink-centric scheduling.
    nvlink_centric_sched: bool => nvlinkCentricSched since (2, 28, 0);
    /// See [`GraphUsageMode`].
    graph_usage_mode: GraphUsageMode => graphUsageMode since (2, 29, 0);
    /// Number of one-sided (RMA) contexts.
    num_rma_ctx: u32 => numRmaCtx since (2, 29, 0);
    /// Upper bound on point-to-point peers per rank, at least 1.
    max_p2p_peers: u32 [ranges::AT_LEAST_ONE] => maxP2pPeers since (2, 30, 3);
    /// Keep stream ordering inside captured graphs (`false` needs a graph usage mode of no
    /// or single graph).
    graph_stream_ordering: bool => graphStreamOrdering since (2, 30, 7);
    /// Order launches of several communicators on one device by host issue order
    /// (`NCCL_LAUNCH_ORDER_IMPLICIT`).
    launch_order_implicit: bool => launchOrderImplicit since (2, 31, 0);
    /// Number of RMA signal slots.
    num_rma_sig: u32 => numRmaSig since (2, 31, 0);
    /// Set up one-sided signalling at creation instead of at the first window
    /// registration.
    rma_eager_init: bool => rmaEagerInit since (2, 31, 0);
    /// See [`HostCftMode`].
    host_cft_mode: HostCftMode => hostCftMode since (2, 31, 0);
    /// See [`NvlsHostMode`] (any combination of its flags, not negative).
    nvls_host_mode: NvlsHostMode => nvlsHostMode since (2, 31, 0);
}

impl CommConfig {
    /// A configuration with every field left to NCCL.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a nonblocking communicator may stay in progress (creation, split, enqueue)
    /// before the call fails with [`Error::Timeout`]. Not an NCCL field. Default 10 minutes
    /// ([`DEFAULT_READY_TIMEOUT`]).
    ///
    /// When a rank never joins a creation, each rank that did join fails within about this
    /// timeout, in one of two ways: [`Error::Timeout`] when its own timer runs out first, or
    /// an [`Error::Nccl`] with `ncclRemoteError` (sometimes `ncclSystemError`, "Connection
    /// closed by remote peer") when a peer's timer ran out a moment earlier and that peer
    /// aborted, closing its connections. Which one a rank sees is a race of milliseconds;
    /// the first rank to give up always sees the timeout. Both errors are fatal (the
    /// half-made communicator is aborted), and the remote error's text says what it
    /// usually means.
    #[must_use]
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// How many of its last operations the communicator's flight recorder keeps (see
    /// [`crate::diagnostics::flight`]); 0 turns the recorder off. Not an NCCL field. Default
    /// [`DEFAULT_FLIGHT_ENTRIES`](crate::diagnostics::flight::DEFAULT_FLIGHT_ENTRIES); at
    /// most [`MAX_FLIGHT_ENTRIES`](crate::diagnostics::flight::MAX_FLIGHT_ENTRIES) (larger
    /// values are cut to it). `NCCL_RS_FLIGHT_RECORDER=<entries>` in the environment
    /// overrides it. Communicators split or shrunk from this one without a configuration of
    /// their own get the default, not this value.
    #[must_use]
    pub fn flight_recorder(mut self, entries: usize) -> Self {
        self.flight_recorder = Some(entries);
        self
    }

    /// The communicator's name ([`CommConfig::comm_name`]), if set.
    pub(crate) fn name(&self) -> Option<String> {
        self.comm_name.clone()
    }

    /// Whether the communicator will be blocking (unset means blocking, NCCL's default).
    pub fn is_blocking(&self) -> bool {
        self.blocking.unwrap_or(true)
    }

    /// Whether NCCL (from 2.28) may run this communicator's all-gather, all-to-all, gather
    /// and scatter on copy engines: its CTA policy includes `ZERO`. `NCCL_CTA_POLICY`, when
    /// set, replaces the config's policy (NCCL's init.cc), so it is read the same way.
    pub(crate) fn copy_engine(&self, version: Version) -> bool {
        if version < Version::new(2, 28, 0) {
            return false;
        }
        let policy = env_cta_policy().or(self.cta_policy.map(|policy| policy.0));
        policy.is_some_and(|bits| bits & CtaPolicy::ZERO.0 != 0)
    }

    /// The configuration a child inherits when none is given: this one's blocking mode.
    pub(crate) fn inherit_blocking(mut self, parent_blocking: bool) -> Self {
        self.blocking.get_or_insert(parent_blocking);
        self
    }

    /// Rules between fields, which the table's per-field ranges cannot say.
    fn check_combinations(&self) -> Result<()> {
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
        Ok(())
    }

    /// Builds the raw struct for `lib`, checking every set field against its version.
    pub(crate) fn to_raw(&self, lib: &Library) -> Result<RawConfig> {
        self.to_raw_for(lib.version())
    }

    pub(crate) fn to_raw_for(&self, version: Version) -> Result<RawConfig> {
        Ok(match self.fill(version)? {
            Some((config, strings)) => RawConfig {
                config: Some(config),
                _strings: strings,
            },
            None => RawConfig::unset(),
        })
    }
}

/// An `ncclConfig_t` ready for NCCL, with the strings its pointers refer to.
pub(crate) struct RawConfig {
    /// `None` when nothing was set, so calls without a config (or a null one) can be used.
    config: Option<ncclConfig_t>,
    // Owns the storage behind `netName`/`commName`; moving a CString does not move its bytes.
    _strings: Vec<CString>,
}

impl RawConfig {
    fn unset() -> Self {
        RawConfig {
            config: None,
            _strings: Vec::new(),
        }
    }

    /// For calls where a null config means "inherit the parent's" (split, shrink, grow):
    /// `None` gives a null pointer from [`RawConfig::as_mut_ptr`].
    pub(crate) fn inherit_or(config: Option<&CommConfig>, lib: &Library) -> Result<Self> {
        match config {
            Some(config) => config.to_raw(lib),
            None => Ok(RawConfig::unset()),
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
mod tests;
