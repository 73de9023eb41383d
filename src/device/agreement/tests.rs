//! The device communicator's agreement, one rule at a time (no GPU needed).

use super::*;
use crate::properties::GinConnection;
use crate::release::Version;

const LIB: u32 = 23203;

fn abi(version: Version) -> DeviceAbi {
    DeviceAbi::new(version)
}

fn entry(reqs: &DevCommRequirements) -> Entry {
    Entry::of(reqs, LIB, abi(Version::new(2, 32, 3)), None)
}

fn lsa(n: u32) -> DevCommRequirements {
    DevCommRequirements::new().lsa_barriers(n)
}

/// J1: a rank whose own checks refused (here its device code is newer than the library) is
/// reported on every rank, naming it and why, instead of its peers entering NCCL's
/// collective creation alone; before the fix rank 0 blocked in NCCL until killed.
#[test]
fn j1_a_rank_refusing_on_its_own_is_reported_to_all() {
    let mut all = [entry(&lsa(1)), entry(&lsa(1)), entry(&lsa(1))];
    assert!(judge(&all).is_ok());
    all[1].refusal = Some(Refusal::DeviceAbi);
    all[1].abi = Version::new(2, 99, 0).code();
    match judge(&all) {
        Err(Error::RankRefused { call, rank, reason }) => {
            assert_eq!((call, rank, reason), (CALL, 1, Refusal::DeviceAbi));
        }
        other => panic!("{other:?}"),
    }
    // The first refusing rank is named, whatever the others refused for.
    all[2].refusal = Some(Refusal::Unavailable);
    all[0].refusal = Some(Refusal::InvalidArgument);
    let err = judge(&all).unwrap_err();
    assert!(matches!(err, Error::RankRefused { rank: 0, .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("rank 0 refused it on its own"), "{text}");
    assert!(text.contains("no rank called NCCL"), "{text}");
    // A peer's refusal for want of support reads as unsupported on every rank.
    assert!(!err.is_unsupported() && !err.is_fatal());
    let unavailable = Error::RankRefused {
        call: CALL,
        rank: 2,
        reason: Refusal::Unavailable,
    };
    assert!(unavailable.is_unsupported());
}

/// J1: requirements that differ across ranks (nothing compared them; NCCL lays each rank's
/// barriers out from its own counts) give every rank the same error naming the field and
/// both ranks.
#[test]
fn j1_requirements_that_differ_are_refused_on_every_rank() {
    let all = [entry(&lsa(2)), entry(&lsa(2)), entry(&lsa(4))];
    match judge(&all) {
        Err(Error::RankMismatch {
            field,
            first,
            expected,
            rank,
            value,
            ..
        }) => {
            assert_eq!(
                (field, first, expected, rank, value),
                ("lsaBarrierCount", 0, 2, 2, 4)
            );
        }
        other => panic!("{other:?}"),
    }
    let multimem = [entry(&lsa(1)), entry(&lsa(1).lsa_multimem(true))];
    let err = judge(&multimem).unwrap_err().to_string();
    assert!(
        err.contains("rank 1 gives lsaMultimem = 1 where rank 0 gives 0"),
        "{err}"
    );
    let gin = [
        entry(&lsa(1).gin(GinConnection::Full)),
        entry(&lsa(1).gin(GinConnection::Rail)),
    ];
    let err = judge(&gin).unwrap_err().to_string();
    assert!(err.contains("ginConnectionType = 2"), "{err}");
    // Every field NCCL reads is compared, by its C name.
    let variants = [
        lsa(1).lsa_ll_a2a(1, 8),
        lsa(1).barriers(1),
        lsa(1).rail_gin_barriers(1),
        lsa(1).world_gin_barriers(1),
        lsa(1).gin_signals(1),
        lsa(1).gin_counters(1),
        lsa(1).gin_contexts(2),
    ];
    let mut named = Vec::new();
    for other in variants {
        match judge(&[entry(&lsa(1)), entry(&other)]) {
            Err(Error::RankMismatch { field, .. }) => named.push(field),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        named,
        [
            "lsaLLA2ABlockCount",
            "barrierCount",
            "railGinBarrierCount",
            "worldGinBarrierCount",
            "ginSignalCount",
            "ginCounterCount",
            "ginContextCount",
        ]
    );
    // NCCL's default context count is the same as asking for it.
    assert!(judge(&[entry(&lsa(1)), entry(&lsa(1).gin_contexts(4))]).is_ok());
}

/// The device ABI must match too: NCCL adapts the requirements to each rank's header
/// version (2.29.2's filter turns barrierCount into lsaBarrierCount), and the barriers'
/// device code comes from those headers.
#[test]
fn device_abis_and_libraries_must_match() {
    let newer = Entry::of(&lsa(1), LIB, abi(Version::new(2, 32, 3)), None);
    let older = Entry::of(&lsa(1), LIB, abi(Version::new(2, 30, 7)), None);
    match judge(&[newer, older]) {
        Err(Error::RankMismatch {
            field,
            expected,
            value,
            ..
        }) => {
            assert_eq!(field, "the device code's NCCL header version");
            assert_eq!((expected, value), (23203, 23007));
        }
        other => panic!("{other:?}"),
    }
    let other_library = Entry::of(&lsa(1), 23007, abi(Version::new(2, 30, 7)), None);
    let err = judge(&[older, other_library]).unwrap_err().to_string();
    assert!(err.contains("the NCCL library version"), "{err}");
    // A refusal outranks any difference.
    let refused = Entry {
        refusal: Some(Refusal::Failed),
        ..older
    };
    assert!(matches!(
        judge(&[newer, refused]),
        Err(Error::RankRefused { rank: 1, .. })
    ));
}

#[test]
fn entries_survive_the_exchange_encoding() {
    let reqs = lsa(3)
        .lsa_ll_a2a(2, 16)
        .gin(GinConnection::Rail)
        .gin_signals(7)
        .gin_contexts(u32::MAX);
    for refusal in [
        None,
        Some(Refusal::DeviceAbi),
        Some(Refusal::Unsupported),
        Some(Refusal::Unavailable),
        Some(Refusal::InvalidArgument),
        Some(Refusal::Failed),
    ] {
        let e = Entry::of(&reqs, LIB, abi(Version::new(2, 99, 9)), refusal);
        assert_eq!(Entry::from_row(&e.to_row()), e);
    }
    // A code this rank does not know (a newer crate on the peer) is still a refusal.
    let mut row = entry(&lsa(1)).to_row();
    row[0] = 99;
    assert_eq!(Entry::from_row(&row).refusal, Some(Refusal::Failed));
    assert_eq!(judge(&[]).map_err(|e| e.to_string()), Ok(()));
}

#[test]
fn refusals_follow_the_error_they_stand_for() {
    let v = Version::new;
    let cases = [
        (
            Error::Unsupported {
                api: "x",
                needs: v(2, 30, 0),
                found: v(2, 29, 7),
            },
            Refusal::Unsupported,
        ),
        (
            Error::Unavailable {
                api: "x",
                reason: "y".into(),
            },
            Refusal::Unavailable,
        ),
        (Error::invalid("x"), Refusal::InvalidArgument),
        (Error::usage("x"), Refusal::Failed),
    ];
    for (err, refusal) in cases {
        assert_eq!(Refusal::of(&err), refusal, "{err}");
    }
}
