//! The RMA calls' checks and descriptors, one by one (no GPU needed).

use super::*;

const V2_29: Version = Version::new(2, 29, 7);
const V2_32: Version = Version::new(2, 32, 3);

#[test]
fn signals_other_than_zero_need_2_31() {
    assert_eq!(Signal::default().to_raw(V2_29).unwrap(), (0, 0));
    for signal in [Signal::new(1, 0), Signal::new(0, 1)] {
        match signal.to_raw(V2_29) {
            Err(Error::Unsupported { needs, found, .. }) => {
                assert_eq!((needs, found), (RMA_SIGNALS_SINCE, V2_29));
            }
            other => panic!("{signal:?}: {other:?}"),
        }
    }
    assert_eq!(Signal::new(3, 2).to_raw(V2_32).unwrap(), (3, 2));
    assert!(Signal::new(u32::MAX, 0).to_raw(V2_32).is_err());
    assert!(Signal::new(0, 1 << 31).to_raw(V2_32).is_err());
}

#[test]
fn peers_and_put_extents_are_checked() {
    assert_eq!(check_peer(3, 4, "x").unwrap(), 3);
    let err = check_peer(4, 4, "ncclSignal").unwrap_err().to_string();
    assert!(err.contains("peer 4 is out of range"), "{err}");
    assert_eq!(put_extent(0, 8, 8, 4).unwrap(), 0);
    assert_eq!(put_extent(6, 2, 8, 4).unwrap(), 24);
    assert_eq!(put_extent(8, 0, 8, 2).unwrap(), 16);
    let err = put_extent(7, 2, 8, 4).unwrap_err().to_string();
    assert!(err.contains("2 elements at offset 7"), "{err}");
    assert!(put_extent(usize::MAX, 2, 8, 4).is_err());
}

/// M5: a put is bounded by the target's window, which may be smaller than this rank's
/// from NCCL 2.30.7 (before the fix only this rank's length counted).
#[test]
fn m5_puts_fit_the_targets_window() {
    assert_eq!(put_bound(0, 1, 1024, Some(256)).unwrap(), 256);
    assert_eq!(put_bound(0, 1, 1024, Some(4096)).unwrap(), 1024);
    assert_eq!(put_bound(0, 1, 1024, None).unwrap(), 1024);
    let bound = put_bound(1, 0, 1024, Some(256)).unwrap();
    let err = put_extent(200, 100, bound, 4).unwrap_err().to_string();
    assert!(err.contains("window of 256 elements"), "{err}");
}

/// Minor: a put to one's own rank is refused before NCCL (before, it went through).
#[test]
fn minor_put_to_self_is_refused() {
    let err = put_bound(2, 2, 1024, Some(1024)).unwrap_err().to_string();
    assert!(err.contains("is this rank"), "{err}");
}

#[test]
fn sources_must_be_symmetric_windows_of_the_same_communicator() {
    assert!(check_source(true, WindowFlags::COLL_SYMMETRIC).is_ok());
    assert!(check_source(
        true,
        WindowFlags::COLL_SYMMETRIC | WindowFlags::STRICT_ORDERING
    )
    .is_ok());
    let err = check_source(true, WindowFlags::DEFAULT)
        .unwrap_err()
        .to_string();
    assert!(err.contains("COLL_SYMMETRIC"), "{err}");
    let err = check_source(false, WindowFlags::COLL_SYMMETRIC)
        .unwrap_err()
        .to_string();
    assert!(err.contains("another communicator"), "{err}");
}

#[test]
fn wait_descriptors_follow_ncclwaitsignal_rules() {
    let descs = wait_descriptors(
        &[
            SignalWait::new(1, 2),
            SignalWait::new(0, 1).on(Signal::new(1, 1)),
        ],
        2,
        V2_32,
    )
    .unwrap();
    assert_eq!(
        descs
            .iter()
            .map(|d| (d.opCnt, d.peer, d.sigIdx, d.ctx))
            .collect::<Vec<_>>(),
        [(2, 1, 0, 0), (1, 0, 1, 1)]
    );
    let err = wait_descriptors(&[], 2, V2_32).unwrap_err().to_string();
    assert!(err.contains("at least one wait"), "{err}");
    let err = wait_descriptors(&[SignalWait::new(1, 0)], 2, V2_32)
        .unwrap_err()
        .to_string();
    assert!(err.contains("must be between 1"), "{err}");
    assert!(wait_descriptors(&[SignalWait::new(1, u32::MAX)], 2, V2_32).is_err());
    assert!(wait_descriptors(&[SignalWait::new(2, 1)], 2, V2_32).is_err());
    assert!(matches!(
        wait_descriptors(&[SignalWait::new(1, 1).on(Signal::new(1, 0))], 2, V2_29),
        Err(Error::Unsupported { .. })
    ));
}

/// C2: NCCL 2.29 and 2.30 set RMA up at the first RMA call (a step of every rank), so
/// the crate takes it at registration there; 2.28 has no RMA, 2.31 sets up at
/// registration itself. Before the fix no version was treated specially.
#[test]
fn c2_rma_set_up_is_taken_at_registration_on_2_29_and_2_30() {
    assert!(lazy_setup(Version::new(2, 29, 0)));
    assert!(lazy_setup(Version::new(2, 29, 7)));
    assert!(lazy_setup(Version::new(2, 30, 7)));
    assert!(!lazy_setup(Version::new(2, 28, 9)));
    assert!(!lazy_setup(Version::new(2, 31, 0)));
    assert!(!lazy_setup(Version::new(2, 32, 3)));
}

/// m2: the set-up is only taken where NCCL's rank-local checks of its first RMA call are
/// known to pass on this rank: from 2.29.4 what `hostRmaSupport` says; on 2.29.2/2.29.3
/// (no such report) only without GIN, since with GIN the communicator may span nodes and
/// NCCL's RMA proxy check there depends on each process's plugin. Before, an unreported host
/// RMA support counted as yes, and a set-up NCCL refused failed the registration.
#[test]
fn m2_rma_is_set_up_only_where_nccls_own_checks_will_pass() {
    // 2.29.4 and later: the report, whatever the GIN type.
    assert!(local_checks_pass(Some(true), Some(GinType::Proxy)));
    assert!(local_checks_pass(Some(true), Some(GinType::None)));
    assert!(!local_checks_pass(Some(false), Some(GinType::None)));
    // 2.29.2/2.29.3: no GIN (so, with a registered window, one node) only.
    assert!(local_checks_pass(None, Some(GinType::None)));
    assert!(!local_checks_pass(None, Some(GinType::Proxy)));
    assert!(!local_checks_pass(None, Some(GinType::Gdaki)));
    assert!(!local_checks_pass(None, Some(GinType::Other(7))));
    // Nothing reported at all (a failed or unsupported query): not known to pass.
    assert!(!local_checks_pass(None, None));
}

#[test]
fn old_drivers_are_unavailable() {
    assert!(check_driver(12050).is_ok());
    assert!(check_driver(13000).is_ok());
    let err = check_driver(12040).unwrap_err();
    assert!(err.is_unsupported() && !err.is_fatal());
    assert!(err.to_string().contains("this one is 12.4"), "{err}");
}
