//! Unit tests of the configuration table: round trips, version gates, ranges.

use super::*;
use std::ffi::CStr;

const NEW: Version = Version::new(2, 32, 3);

/// The newest version older than `v`.
fn just_before(v: Version) -> Version {
    if v.patch > 0 {
        Version::new(v.major, v.minor, v.patch - 1)
    } else {
        Version::new(v.major, v.minor - 1, 99)
    }
}

type Expect = fn(&mut ncclConfig_t);

/// One config per NCCL field, with that field set, the first NCCL version that has the
/// field (nccl.h's history), and what the config must write into a struct that starts as
/// `NCCL_CONFIG_INITIALIZER`. Written out by hand, independent of the table.
fn one_field_each() -> Vec<(&'static str, Version, CommConfig, Expect)> {
    let c = CommConfig::new;
    let v = Version::new;
    vec![
        ("blocking", v(2, 14, 0), c().blocking(false), |r| {
            r.blocking = 0
        }),
        (
            "cgaClusterSize",
            v(2, 17, 0),
            c().cga_cluster_size(4),
            |r| r.cgaClusterSize = 4,
        ),
        ("minCTAs", v(2, 17, 0), c().min_ctas(2), |r| r.minCTAs = 2),
        ("maxCTAs", v(2, 17, 0), c().max_ctas(16), |r| r.maxCTAs = 16),
        ("netName", v(2, 17, 0), c().net_name("Socket"), |_| {}),
        ("splitShare", v(2, 18, 0), c().split_share(true), |r| {
            r.splitShare = 1
        }),
        ("trafficClass", v(2, 26, 0), c().traffic_class(3), |r| {
            r.trafficClass = 3
        }),
        (
            "commName",
            v(2, 27, 0),
            c().comm_name(String::from("trainer")),
            |_| {},
        ),
        (
            "collnetEnable",
            v(2, 27, 0),
            c().collnet_enable(true),
            |r| r.collnetEnable = 1,
        ),
        (
            "CTAPolicy",
            v(2, 27, 0),
            c().cta_policy(CtaPolicy::EFFICIENCY | CtaPolicy::ZERO),
            |r| r.CTAPolicy = 3,
        ),
        ("shrinkShare", v(2, 27, 0), c().shrink_share(false), |r| {
            r.shrinkShare = 0
        }),
        ("nvlsCTAs", v(2, 27, 0), c().nvls_ctas(5), |r| {
            r.nvlsCTAs = 5
        }),
        (
            "nChannelsPerNetPeer",
            v(2, 28, 0),
            c().n_channels_per_net_peer(8),
            |r| r.nChannelsPerNetPeer = 8,
        ),
        (
            "nvlinkCentricSched",
            v(2, 28, 0),
            c().nvlink_centric_sched(true),
            |r| r.nvlinkCentricSched = 1,
        ),
        (
            "graphUsageMode",
            v(2, 29, 0),
            c().graph_usage_mode(GraphUsageMode::SingleGraph),
            |r| r.graphUsageMode = 1,
        ),
        ("numRmaCtx", v(2, 29, 0), c().num_rma_ctx(0), |r| {
            r.numRmaCtx = 0
        }),
        ("maxP2pPeers", v(2, 30, 3), c().max_p2p_peers(7), |r| {
            r.maxP2pPeers = 7
        }),
        (
            "graphStreamOrdering",
            v(2, 30, 7),
            c().graph_stream_ordering(true),
            |r| r.graphStreamOrdering = 1,
        ),
        (
            "launchOrderImplicit",
            v(2, 31, 0),
            c().launch_order_implicit(true),
            |r| r.launchOrderImplicit = 1,
        ),
        ("numRmaSig", v(2, 31, 0), c().num_rma_sig(9), |r| {
            r.numRmaSig = 9
        }),
        ("rmaEagerInit", v(2, 31, 0), c().rma_eager_init(true), |r| {
            r.rmaEagerInit = 1
        }),
        (
            "hostCftMode",
            v(2, 31, 0),
            c().host_cft_mode(HostCftMode::Fallback),
            |r| r.hostCftMode = 3,
        ),
        (
            "nvlsHostMode",
            v(2, 31, 0),
            c().nvls_host_mode(NvlsHostMode::DISABLE),
            |r| r.nvlsHostMode = i32::MAX,
        ),
    ]
}

/// Reads a string member and nulls it, so the rest of the struct can be compared.
fn take_string(ptr: &mut *const c_char) -> Option<String> {
    let text = (!ptr.is_null()).then(|| {
        // SAFETY: a non-null pointer refers to a CString owned by the RawConfig, alive.
        unsafe { CStr::from_ptr(*ptr) }
            .to_str()
            .unwrap()
            .to_string()
    });
    *ptr = std::ptr::null();
    text
}

#[test]
fn default_config_needs_no_struct() {
    let mut raw = CommConfig::default()
        .to_raw_for(Version::new(2, 4, 0))
        .unwrap();
    assert!(raw.as_mut().is_none());
    assert!(raw.as_mut_ptr().is_null());
    assert!(CommConfig::default().is_blocking());
    assert_eq!(CommConfig::new().ready_timeout, DEFAULT_READY_TIMEOUT);
}

#[test]
fn every_field_round_trips_to_the_raw_struct() {
    let rows = one_field_each();
    let names: Vec<(&str, Version)> = rows.iter().map(|(name, v, ..)| (*name, *v)).collect();
    assert_eq!(
        names,
        CommConfig::FIELDS,
        "one row per table entry, in table order"
    );
    for (field, _, config, expect) in rows {
        let mut raw = config.to_raw_for(NEW).unwrap();
        let got = raw.as_mut().unwrap();
        assert_eq!(got.size, 120);
        assert_eq!(got.magic, 0xcafe_beef);
        assert_eq!(got.version, 23203);
        let net = take_string(&mut got.netName);
        let name = take_string(&mut got.commName);
        assert_eq!(net.as_deref(), (field == "netName").then_some("Socket"));
        assert_eq!(name.as_deref(), (field == "commName").then_some("trainer"));
        let mut want = nccl_sys::nccl_config_initializer();
        expect(&mut want);
        // Debug lists every member: the set one has its value, all others stay UNDEF.
        assert_eq!(format!("{got:?}"), format!("{want:?}"), "{field}");
    }
}

#[test]
fn the_table_covers_every_member_of_ncclconfig() {
    let debug = format!("{:?}", nccl_sys::nccl_config_initializer());
    let inner = &debug[debug.find('{').unwrap() + 1..debug.rfind('}').unwrap()];
    let members: Vec<&str> = inner
        .split(", ")
        .map(|member| member.split(':').next().unwrap().trim())
        .filter(|name| !["size", "magic", "version"].contains(name))
        .collect();
    let table: Vec<&str> = CommConfig::FIELDS.iter().map(|(name, _)| *name).collect();
    assert_eq!(members, table);
}

#[test]
fn fields_newer_than_the_library_are_unsupported() {
    for (field, since, config, _) in one_field_each() {
        let older = just_before(since);
        match config.to_raw_for(older) {
            Err(Error::Unsupported { api, needs, found }) => {
                assert_eq!((api, needs, found), (field, since, older));
            }
            Err(other) => panic!("{field}: unexpected error {other}"),
            Ok(_) => panic!("{field} accepted by NCCL {older}"),
        }
        assert!(
            config.to_raw_for(since).is_ok(),
            "{field} rejected by {since}"
        );
    }
    // The first field too new, in table order, is named.
    let both = CommConfig::new()
        .host_cft_mode(HostCftMode::Enable)
        .traffic_class(1);
    match both.to_raw_for(Version::new(2, 20, 0)) {
        Err(Error::Unsupported { api, .. }) => assert_eq!(api, "trafficClass"),
        other => panic!("{:?}", other.err()),
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
            let debug = format!("{:?}", raw.as_mut().unwrap());
            assert!(debug.contains(&format!("{field}: {good},")), "{debug}");
        }
    }
    let err = CommConfig::new()
        .nvls_host_mode(NvlsHostMode(-1))
        .to_raw_for(NEW)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("nvlsHostMode = -1 is out of range: NCCL takes 0 to 2147483647"),
        "{err}"
    );
    // A bad value is reported before a too-old library: nothing about it can work.
    match CommConfig::new()
        .max_ctas(0)
        .to_raw_for(Version::new(2, 4, 0))
    {
        Err(Error::InvalidArgument(text)) => assert!(text.contains("maxCTAs = 0")),
        other => panic!("{:?}", other.err()),
    }
}

#[test]
fn bad_combinations_and_strings_are_rejected() {
    let err = |c: CommConfig| {
        c.to_raw_for(NEW)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(err(CommConfig::new().min_ctas(8).max_ctas(4)).contains("minCTAs (8) is larger"));
    assert!(err(CommConfig::new().min_ctas(4).max_ctas(4)).is_empty());
    assert!(err(CommConfig::new().net_name("I\0B")).contains("netName \"I\\0B\" contains a NUL"));
    assert!(err(CommConfig::new().comm_name("a\0")).contains("commName"));
    assert!(err(CommConfig::new()
        .graph_stream_ordering(false)
        .graph_usage_mode(GraphUsageMode::MultipleGraphs))
    .contains("graphStreamOrdering"));
    assert!(err(CommConfig::new()
        .graph_stream_ordering(false)
        .graph_usage_mode(GraphUsageMode::SingleGraph))
    .is_empty());
}

#[test]
fn setters_take_str_or_string_and_the_timeout() {
    let from_str = CommConfig::new().net_name("IB").comm_name("job");
    let from_string = CommConfig::new()
        .net_name(String::from("IB"))
        .comm_name(String::from("job"));
    assert_eq!(from_str, from_string);
    let timeout = Duration::from_millis(1500);
    assert_eq!(
        CommConfig::new().ready_timeout(timeout).ready_timeout,
        timeout
    );
    assert_eq!(
        CommConfig::new().ready_timeout(timeout),
        CommConfig::default().ready_timeout(timeout)
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

#[test]
fn cta_policy_from_the_environment_reads_as_nccl_reads_it() {
    use super::parse_cta_policy;
    assert_eq!(parse_cta_policy("2"), Some(CtaPolicy::ZERO.0));
    assert_eq!(parse_cta_policy("1"), Some(CtaPolicy::EFFICIENCY.0));
    assert_eq!(parse_cta_policy("0"), Some(0));
    assert_eq!(parse_cta_policy("7"), None);
    assert_eq!(parse_cta_policy("zero"), Some(CtaPolicy::ZERO.0));
    assert_eq!(parse_cta_policy("Efficiency|ZERO"), Some(3));
    assert_eq!(parse_cta_policy("DEFAULT"), Some(0));
    assert_eq!(parse_cta_policy("bogus"), None);
}

#[test]
fn copy_engine_follows_the_zero_policy_from_nccl_2_28() {
    if std::env::var_os("NCCL_CTA_POLICY").is_some() {
        return; // the environment decides, as it does for NCCL
    }
    let zero = CommConfig::new().cta_policy(CtaPolicy::ZERO | CtaPolicy::EFFICIENCY);
    assert!(zero.copy_engine(Version::new(2, 28, 0)));
    assert!(!zero.copy_engine(Version::new(2, 27, 7)));
    assert!(!CommConfig::new().copy_engine(Version::new(2, 32, 3)));
    assert!(!CommConfig::new()
        .cta_policy(CtaPolicy::EFFICIENCY)
        .copy_engine(Version::new(2, 32, 3)));
}
