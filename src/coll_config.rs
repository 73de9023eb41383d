//! Per-collective configuration (`ncclCollConfig_t`, NCCL 2.31): algorithm selection, CTA
//! limits, CTA policy, a profiler tag and (NCCL 2.32) a kernel-started event
//! (`launchCompletionEvent`), for one call of `ncclAllReduceConfig` ... `ncclScatterConfig`.
//!
//! Rules (`nccl.h` 2.32.3 and the `ncclCollConfig_t` docs of 2.32):
//!
//! * Every rank must pass the same configuration; NCCL checks it only locally.
//! * Unset fields inherit the communicator's [`CommConfig`](crate::CommConfig); NCCL's
//!   environment variables override both.
//! * `cgaClusterSize` must be the same for every collective of one group (NCCL leaves
//!   anything else undefined; [`Group`](crate::Group) refuses two configurations that differ).
//! * With an algorithm selection, a selection NCCL cannot honour is an error unless
//!   [`CollConfig::allow_algorithm_fallback`] is set. All-to-all, gather and scatter have no
//!   selectable algorithms. Send and receive take no configuration at all.
//! * The kernel-started event (NCCL's `launchCompletionEvent`) is recorded when every block
//!   of the collective's kernel has started (before the kernel is queued on CUDA < 12.3). It must be created with timing disabled (cudarc's
//!   `CudaContext::new_event(None)` does) on the communicator's device, not be an
//!   interprocess event, and stay alive as long as any wait on it or any graph that captured
//!   it: the configuration borrows it. Either every rank passes an event or none does, and a
//!   group may carry at most one per communicator.
//!
//! A configuration reaches NCCL through [`Operation::with_config`](crate::Operation::with_config):
//! `comm.enqueue(Operation::all_reduce(&send, &mut recv, ReduceOp::Sum).with_config(&config))`,
//! or the same operation in a [`Group`](crate::Group). It is checked with everything else
//! when the operation is enqueued, and refused on send and receive.
//!
//! [`CollConfig::to_raw`] checks everything that can be checked on this rank and builds the
//! struct for the loaded library: a 2.31 library gets the 2.31 layout and version, newer ones
//! the 2.32.3 header's, exactly as a program built against that library's header would pass.

use std::ffi::{CString, NulError};
use std::marker::PhantomData;
use std::mem::offset_of;
use std::os::raw::c_int;

use cudarc::driver::CudaEvent;
use nccl_sys::ncclCollConfig_t;

use crate::calls;
use crate::comm::Comm;
use crate::config::ranges::{self, Range};
use crate::config::{CtaPolicy, IntSetting};
use crate::error::{Error, Result};
use crate::release::Version;

/// First NCCL with `ncclCollConfig_t` and the `nccl*Config` collectives.
pub const COLL_CONFIG_SINCE: Version = calls::ncclAllReduceConfig.since;
/// First NCCL with `launchCompletionEvent` ([`CollConfig::kernel_started_event`]).
pub const KERNEL_STARTED_EVENT_SINCE: Version = Version::new(2, 32, 0);

/// The former name of [`KERNEL_STARTED_EVENT_SINCE`].
#[deprecated(note = "renamed KERNEL_STARTED_EVENT_SINCE (\"launch\" is left to job launchers)")]
pub const LAUNCH_EVENT_SINCE: Version = KERNEL_STARTED_EVENT_SINCE;

/// `sizeof(ncclCollConfig_v23100)`: the 2.32 struct without `launchCompletionEvent`.
const SIZE_2_31: usize = offset_of!(ncclCollConfig_t, launchCompletionEvent);

/// Profiler tags with the most significant bit set are reserved by NCCL.
const RESERVED_TAG_BIT: u64 = 1 << 63;

/// Generates [`CollConfig`] from one row per `int` field of `ncclCollConfig_t`:
///
/// ```text
/// /// doc
/// rust_name: StoredType [[RANGE]] => cField;
/// ```
///
/// Each row becomes an unset-by-default field, its setter, its range check (`RANGE`, one of
/// [`ranges`], shared with [`CommConfig`](crate::CommConfig)'s table; a row without one is
/// checked by a rule of [`CollConfig::check_rules`]) and its member of the raw struct. The
/// fields NCCL does not store as an `int` (the selection string, the fallback switch, the
/// profiler tag, the event) are written out by hand around the rows.
macro_rules! coll_fields {
    ($(
        $(#[doc = $doc:expr])*
        $name:ident: $ty:ty $([$range:expr])? => $c:ident;
    )*) => {
        /// A configuration for one collective call; see the [module docs](self). Every field
        /// starts unset (NCCL decides, or inherits the communicator's setting).
        #[derive(Clone, Default)]
        pub struct CollConfig<'e> {
            /// Kept as the C string NCCL gets: NCCL stores only the pointer (its config copy is
            /// shallow) and may parse it again when a group ends, so it must live as long as the
            /// operations borrowing this configuration. A selection with a NUL is refused at use.
            algorithm: Option<std::result::Result<CString, NulError>>,
            allow_fallback: bool,
            $( $name: Option<$ty>, )*
            profiler_tag: u64,
            kernel_started_event: Option<&'e CudaEvent>,
        }

        impl std::fmt::Debug for CollConfig<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct("CollConfig")
                    .field("algorithm", &self.algorithm)
                    .field("allow_fallback", &self.allow_fallback)
                    $( .field(stringify!($name), &self.$name) )*
                    .field("profiler_tag", &self.profiler_tag)
                    .field("kernel_started_event", &self.kernel_started_event.is_some())
                    .finish()
            }
        }

        impl CollConfig<'_> {
            $(
                $(#[doc = $doc])*
                pub fn $name(mut self, value: $ty) -> Self {
                    self.$name = Some(value);
                    self
                }
            )*

            /// Every set field against its range, in table order.
            fn check_ranges(&self) -> Result<()> {
                $($(
                    if let Some(value) = self.$name {
                        let range: Range = $range;
                        let value = value.value();
                        if !range.contains(value) {
                            return Err(Error::invalid(format!(
                                "{} must be between {} and {}, got {value}",
                                stringify!($c),
                                range.min,
                                range.max
                            )));
                        }
                    }
                )?)*
                Ok(())
            }

            /// Writes every set field into `config`; the values were checked to fit a C `int`
            /// (by their range, or a rule of [`CollConfig::check_rules`]).
            fn fill_fields(&self, config: &mut ncclCollConfig_t) {
                $(
                    if let Some(value) = self.$name {
                        config.$c = value.value() as c_int;
                    }
                )*
            }
        }
    };
}

coll_fields! {
    /// `minCTAs`: the fewest CTAs (channels) to use, at least 1.
    min_ctas: u32 [ranges::AT_LEAST_ONE] => minCTAs;
    /// `maxCTAs`: the most CTAs to use, at least 1 and at most the communicator's maximum.
    max_ctas: u32 [ranges::AT_LEAST_ONE] => maxCTAs;
    /// `nvlsCTAs`: the CTA cap for NVLink SHARP algorithms, at least 1.
    nvls_ctas: u32 [ranges::AT_LEAST_ONE] => nvlsCTAs;
    /// `cgaClusterSize`: the thread-block cluster size (Hopper and newer), 0 to 8; the same
    /// for every collective of a group.
    cga_cluster_size: u32 [ranges::CGA_CLUSTER_SIZE] => cgaClusterSize;
    /// `CTAPolicy`: e.g. [`CtaPolicy::ZERO`] for copy-engine collectives on symmetric
    /// windows.
    cta_policy: CtaPolicy => CTAPolicy;
}

impl<'e> CollConfig<'e> {
    /// A configuration with nothing set.
    pub fn new() -> Self {
        Self::default()
    }

    /// `algSelection`: which algorithms the call may use, in NCCL's selection syntax, e.g.
    /// `"ring"`, `"tree,ring"`, `"^symk"` (see NCCL's `ncclCollConfig_t` docs). An empty
    /// string means automatic selection.
    pub fn algorithm(mut self, selection: impl Into<String>) -> Self {
        self.algorithm = Some(CString::new(selection.into()));
        self
    }

    /// `forceAlgSelection = 0`: fall back to automatic selection where the algorithm
    /// selection cannot be honoured, instead of failing (NCCL's default).
    pub fn allow_algorithm_fallback(mut self, allow: bool) -> Self {
        self.allow_fallback = allow;
        self
    }

    /// `userProfilerTag`: a value handed verbatim to profiler plugins with this call's
    /// events; values with the most significant bit set are reserved by NCCL.
    pub fn profiler_tag(mut self, tag: u64) -> Self {
        self.profiler_tag = tag;
        self
    }

    /// `launchCompletionEvent` (NCCL 2.32): recorded when the collective's kernel has
    /// started; see the [module docs](self) for its rules.
    #[doc(alias = "launchCompletionEvent")]
    pub fn kernel_started_event(mut self, event: &'e CudaEvent) -> Self {
        self.kernel_started_event = Some(event);
        self
    }

    /// The kernel-started event, if one is set (a group may carry one per communicator).
    pub fn started_event(&self) -> Option<&'e CudaEvent> {
        self.kernel_started_event
    }

    /// The former name of [`CollConfig::kernel_started_event`].
    #[deprecated(note = "renamed kernel_started_event (\"launch\" is left to job launchers)")]
    pub fn launch_completion_event(self, event: &'e CudaEvent) -> Self {
        self.kernel_started_event(event)
    }

    /// The former name of [`CollConfig::started_event`].
    #[deprecated(note = "renamed started_event (\"launch\" is left to job launchers)")]
    pub fn launch_event(&self) -> Option<&'e CudaEvent> {
        self.started_event()
    }

    /// Whether NCCL may run a call with this configuration on `comm` on copy engines: the
    /// rules that depend on that (see `check_plan`) must follow the per-call policy too.
    pub(crate) fn copy_engine(&self, comm: &Comm) -> bool {
        effective_copy_engine(
            comm.library().version(),
            crate::config::env_cta_policy(),
            self.cta_policy,
            comm.copy_engine(),
        )
    }

    /// The `cgaClusterSize` set, if any (a group needs the same one for every collective).
    pub(crate) fn cga(&self) -> Option<u32> {
        self.cga_cluster_size
    }

    /// Builds the raw struct for a call on `comm`, checking every field against the loaded
    /// library's version and the event against the communicator's device. A configuration
    /// with nothing set still needs NCCL 2.31: the `nccl*Config` collectives are that new.
    pub fn to_raw(&self, comm: &Comm) -> Result<RawCollConfig<'_>> {
        if let Some(event) = self.kernel_started_event {
            let ctx = event.context();
            if ctx.cu_ctx() != comm.context().cu_ctx() {
                return Err(Error::invalid(format!(
                    "the kernel-started event (launchCompletionEvent) belongs to device {} (context {:p}), not to \
                     the communicator's context on device {}",
                    ctx.ordinal(),
                    ctx.cu_ctx(),
                    comm.device()
                )));
            }
        }
        self.build(comm.library().version())
    }

    fn validate(&self) -> Result<()> {
        self.check_ranges()?;
        self.check_rules()
    }

    /// Rules the table's per-field ranges cannot say: between fields, on bits, on the
    /// fields outside the table.
    fn check_rules(&self) -> Result<()> {
        if let (Some(min), Some(max)) = (self.min_ctas, self.max_ctas) {
            if min > max {
                return Err(Error::invalid(format!(
                    "minCTAs ({min}) is larger than maxCTAs ({max})"
                )));
            }
        }
        if let Some(policy) = self.cta_policy {
            let known = CtaPolicy::EFFICIENCY.0 | CtaPolicy::ZERO.0;
            if policy.0 & !known != 0 {
                return Err(Error::invalid(format!(
                    "CTAPolicy {:#x} has bits NCCL does not define (known: {known:#x})",
                    policy.0
                )));
            }
        }
        if self.profiler_tag & RESERVED_TAG_BIT != 0 {
            return Err(Error::invalid(format!(
                "profiler tag {:#x} has the most significant bit set, which NCCL reserves",
                self.profiler_tag
            )));
        }
        if let Some(Err(_)) = &self.algorithm {
            return Err(Error::invalid(
                "the algorithm selection contains a NUL byte",
            ));
        }
        Ok(())
    }

    /// The raw struct for NCCL `version`.
    fn build(&self, version: Version) -> Result<RawCollConfig<'_>> {
        gate(self.kernel_started_event.is_some(), version)?;
        self.validate()?;
        let mut config = nccl_sys::nccl_coll_config_initializer();
        if version < KERNEL_STARTED_EVENT_SINCE {
            // What a program built against the 2.31 header passes.
            config.size = SIZE_2_31;
            config.version = version.code();
        } else {
            config.version = version.min(Version::HEADER).code();
        }
        self.fill_fields(&mut config);
        config.forceAlgSelection = c_int::from(!self.allow_fallback);
        config.userProfilerTag = self.profiler_tag;
        // Points into this configuration, which outlives the raw struct and every
        // operation that borrows it (see the field).
        if let Some(Ok(selection)) = &self.algorithm {
            config.algSelection = selection.as_ptr();
        }
        if let Some(event) = self.kernel_started_event {
            config.launchCompletionEvent = event.cu_event() as nccl_sys::cudaEvent_t;
        }
        Ok(RawCollConfig {
            config,
            _borrows: PhantomData,
        })
    }
}

/// Whether a configured call takes NCCL's copy-engine path decision (`CTAPolicy` has
/// `ZERO`), in NCCL's order: 2.28 to 2.30 look only at the communicator's policy
/// (`comm->config.CTAPolicy`, v2.30.7 `src/enqueue.cc:3054`; no per-call configuration
/// exists there); from 2.31 `NCCL_CTA_POLICY` wins where set, then a per-call policy that
/// is set, then the communicator's (`comm`: its own decision, made at creation).
fn effective_copy_engine(
    version: Version,
    env: Option<u32>,
    call: Option<CtaPolicy>,
    comm: bool,
) -> bool {
    if version < COLL_CONFIG_SINCE {
        return comm;
    }
    match (env, call) {
        (Some(bits), _) => bits & CtaPolicy::ZERO.0 != 0,
        (None, Some(policy)) => policy.0 & CtaPolicy::ZERO.0 != 0,
        (None, None) => comm,
    }
}

/// Fails unless NCCL `version` has per-collective configuration, and the kernel-started
/// event if one is set.
fn gate(has_event: bool, version: Version) -> Result<()> {
    if version < COLL_CONFIG_SINCE {
        return Err(Error::Unsupported {
            api: "ncclCollConfig_t",
            needs: COLL_CONFIG_SINCE,
            found: version,
        });
    }
    if has_event && version < KERNEL_STARTED_EVENT_SINCE {
        return Err(Error::Unsupported {
            api: "launchCompletionEvent",
            needs: KERNEL_STARTED_EVENT_SINCE,
            found: version,
        });
    }
    Ok(())
}

/// An `ncclCollConfig_t` ready for NCCL. The string and the event its pointers refer to
/// belong to the [`CollConfig`] it was built from, which it borrows.
pub struct RawCollConfig<'a> {
    config: ncclCollConfig_t,
    _borrows: PhantomData<&'a CollConfig<'a>>,
}

impl std::fmt::Debug for RawCollConfig<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawCollConfig")
            .field("config", &self.config)
            .finish()
    }
}

impl RawCollConfig<'_> {
    /// The struct, for the `config` argument of `ncclAllReduceConfig` ... `ncclScatterConfig`.
    /// Valid while `self` lives; the strings and events it points to, while the
    /// [`CollConfig`] does.
    pub fn as_ptr(&self) -> *const ncclCollConfig_t {
        &self.config
    }

    /// The struct itself (its pointers are valid while the [`CollConfig`] lives).
    pub fn get(&self) -> &ncclCollConfig_t {
        &self.config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V2_28: Version = Version::new(2, 28, 3);
    const V2_31: Version = Version::new(2, 31, 2);
    const V2_32: Version = Version::new(2, 32, 3);

    fn err(config: CollConfig<'_>, version: Version) -> String {
        config.build(version).unwrap_err().to_string()
    }

    #[test]
    fn empty_config_is_the_initializer_for_the_library() {
        let empty = CollConfig::new();
        let raw = empty.build(V2_32).unwrap();
        let init = nccl_sys::nccl_coll_config_initializer();
        let c = raw.get();
        assert_eq!((c.size, c.magic, c.version), (72, init.magic, 23203));
        assert_eq!(
            (
                c.minCTAs,
                c.maxCTAs,
                c.nvlsCTAs,
                c.cgaClusterSize,
                c.CTAPolicy
            ),
            (
                init.minCTAs,
                init.maxCTAs,
                init.nvlsCTAs,
                init.cgaClusterSize,
                init.CTAPolicy
            )
        );
        assert!(c.algSelection.is_null() && c.launchCompletionEvent.is_null() && c.ext.is_null());
        assert_eq!((c.forceAlgSelection, c.userProfilerTag), (1, 0));
        assert_eq!(raw.as_ptr(), c as *const _);

        // A 2.31 library gets the 2.31 struct.
        let raw = empty.build(V2_31).unwrap();
        assert_eq!((raw.get().size, raw.get().version), (64, 23102));
        // A library newer than the header gets the header's version.
        let raw = empty.build(Version::new(2, 33, 1)).unwrap();
        assert_eq!(raw.get().version, Version::HEADER.code());
    }

    #[test]
    fn per_collective_config_needs_2_31() {
        match CollConfig::new().build(V2_28) {
            Err(Error::Unsupported { api, needs, found }) => {
                assert_eq!(
                    (api, needs, found),
                    ("ncclCollConfig_t", COLL_CONFIG_SINCE, V2_28)
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn kernel_started_events_need_2_32() {
        assert!(gate(true, V2_32).is_ok());
        assert!(gate(false, V2_31).is_ok());
        match gate(true, V2_31) {
            Err(Error::Unsupported { api, needs, .. }) => {
                assert_eq!(
                    (api, needs),
                    ("launchCompletionEvent", KERNEL_STARTED_EVENT_SINCE)
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn fields_reach_the_struct() {
        let config = CollConfig::new()
            .algorithm("ring,tree")
            .allow_algorithm_fallback(true)
            .min_ctas(2)
            .max_ctas(16)
            .nvls_ctas(4)
            .cga_cluster_size(0)
            .cta_policy(CtaPolicy::ZERO)
            .profiler_tag(0x7fff_0000_0000_0001);
        let raw = config.build(V2_32).unwrap();
        let c = raw.get();
        assert_eq!(
            (c.minCTAs, c.maxCTAs, c.nvlsCTAs, c.cgaClusterSize),
            (2, 16, 4, 0)
        );
        assert_eq!(c.CTAPolicy, nccl_sys::NCCL_CTA_POLICY_ZERO);
        assert_eq!(c.forceAlgSelection, 0);
        assert_eq!(c.userProfilerTag, 0x7fff_0000_0000_0001);
        // SAFETY: the pointer refers to the CString `raw` owns.
        let selection = unsafe { std::ffi::CStr::from_ptr(c.algSelection) };
        assert_eq!(selection.to_str(), Ok("ring,tree"));
        assert!(format!("{config:?}").contains("ring,tree"));
    }

    /// C1: a per-call policy decides the copy-engine path from 2.31, unless
    /// `NCCL_CTA_POLICY` is set; before the fix only the communicator's decision counted.
    #[test]
    fn c1_per_call_cta_policy_decides_copy_engines() {
        let zero = Some(CtaPolicy::ZERO);
        let default = Some(CtaPolicy::DEFAULT);
        let both = Some(CtaPolicy::EFFICIENCY | CtaPolicy::ZERO);
        // Per call wins over the communicator, both ways.
        assert!(effective_copy_engine(V2_31, None, zero, false));
        assert!(effective_copy_engine(V2_32, None, both, false));
        assert!(!effective_copy_engine(V2_32, None, default, true));
        // Unset per call: the communicator's.
        assert!(effective_copy_engine(V2_32, None, None, true));
        assert!(!effective_copy_engine(V2_32, None, None, false));
        // The environment wins over both.
        assert!(!effective_copy_engine(V2_32, Some(0), zero, true));
        assert!(effective_copy_engine(V2_32, Some(2), default, false));
        // Before 2.31 no per-call policy reaches NCCL.
        assert!(!effective_copy_engine(V2_28, None, zero, false));
        assert!(effective_copy_engine(V2_28, None, default, true));
    }

    /// M1: NCCL keeps the `algSelection` pointer (a shallow copy) and may parse it again at
    /// `ncclGroupEnd`, so it must point into the configuration (borrowed by the operation
    /// until the group ends), not into a string that dies with the raw struct. Before the
    /// fix every build made its own CString, so two live builds had different pointers.
    #[test]
    fn m1_algorithm_selection_lives_in_the_configuration() {
        let config = CollConfig::new().algorithm("ring");
        let ptr = {
            let a = config.build(V2_32).unwrap();
            let b = config.build(V2_32).unwrap();
            assert!(!a.get().algSelection.is_null());
            assert_eq!(a.get().algSelection, b.get().algSelection);
            a.get().algSelection
        };
        // SAFETY: the pointer refers to the CString owned by `config`, still alive.
        let selection = unsafe { std::ffi::CStr::from_ptr(ptr) };
        assert_eq!(selection.to_str(), Ok("ring"));
        // A clone owns its own copy.
        let clone = config.clone();
        let ptr = clone.build(V2_32).unwrap().get().algSelection;
        drop(config);
        // SAFETY: as above, for `clone`.
        let selection = unsafe { std::ffi::CStr::from_ptr(ptr) };
        assert_eq!(selection.to_str(), Ok("ring"));
    }

    #[test]
    fn bad_fields_are_refused() {
        assert!(err(CollConfig::new().min_ctas(0), V2_32).contains("minCTAs must be between 1"));
        assert!(err(CollConfig::new().max_ctas(0), V2_32).contains("maxCTAs"));
        assert!(err(CollConfig::new().nvls_ctas(0), V2_32).contains("nvlsCTAs"));
        assert!(err(CollConfig::new().max_ctas(1 << 31), V2_32).contains("maxCTAs"));
        assert!(err(CollConfig::new().cga_cluster_size(9), V2_32).contains("between 0 and 8"));
        assert!(err(CollConfig::new().min_ctas(8).max_ctas(4), V2_32).contains("larger than"));
        assert!(err(CollConfig::new().cta_policy(CtaPolicy(0x4)), V2_32).contains("0x4"));
        assert!(err(CollConfig::new().profiler_tag(1 << 63), V2_32).contains("reserves"));
        assert!(err(CollConfig::new().algorithm("ri\0ng"), V2_32).contains("NUL"));
        assert!(CollConfig::new()
            .cta_policy(CtaPolicy::EFFICIENCY | CtaPolicy::ZERO)
            .build(V2_32)
            .is_ok());
    }
}
