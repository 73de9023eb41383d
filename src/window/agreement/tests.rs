//! The registration's agreement, one rule at a time (no GPU needed).

use super::*;

fn entry(bytes: u64, flags: u32, elem: u64) -> Entry {
    Entry {
        refused: false,
        bytes,
        flags,
        elem,
        rma: true,
    }
}

const V2_29: Version = Version::new(2, 29, 7);
const V2_32: Version = Version::new(2, 32, 3);

/// M5: windows whose size (before 2.30.7), flags or element type differ across ranks are
/// refused on every rank; before the fix nothing compared them.
#[test]
fn m5_mismatched_windows_are_refused_on_every_rank() {
    let same = [entry(4096, 1, 4), entry(4096, 1, 4)];
    assert!(judge(V2_29, &same).is_ok());
    let sizes = [entry(4096, 1, 4), entry(8192, 1, 4)];
    let err = judge(V2_29, &sizes).unwrap_err().to_string();
    assert!(err.contains("rank 1 registers 8192 bytes"), "{err}");
    assert!(err.contains("same size"), "{err}");
    // From 2.30.7 sizes may differ (puts are then checked against the peer's size).
    assert!(judge(SIZES_MAY_DIFFER_SINCE, &sizes).is_ok());
    let flags = [entry(4096, 1, 4), entry(4096, 0, 4)];
    let err = judge(V2_32, &flags).unwrap_err().to_string();
    assert!(err.contains("rank 1 registers flags 0"), "{err}");
    let types = [entry(4096, 1, 4), entry(4096, 1, 4), entry(4096, 1, 8)];
    let err = judge(V2_32, &types).unwrap_err().to_string();
    assert!(err.contains("rank 2 registers element size 8"), "{err}");
    // The entries survive the exchange's encoding.
    let e = Entry {
        refused: true,
        ..entry(1 << 40, 9, 2)
    };
    assert_eq!(Entry::from_row(&e.to_row()), e);
}

/// M4: a rank refusing its own window (empty, misaligned, wrong context, flags the
/// library lacks) is reported to every rank through the exchange, so none is left in
/// NCCL's bootstrap all-gather; before the fix the refusing rank returned alone.
#[test]
fn m4_a_rank_refusing_its_window_is_reported_to_all() {
    let mut all = [entry(4096, 1, 4), entry(4096, 1, 4), entry(4096, 1, 4)];
    all[2].refused = true;
    let err = judge(V2_32, &all).unwrap_err().to_string();
    assert!(err.contains("rank 2 refused its own window"), "{err}");
    assert!(err.contains("no rank registered"), "{err}");
}

#[test]
fn extents_are_checked() {
    assert!(check_extent(0x10_0000, 1, 4).is_ok());
    assert!(check_extent(0x10_1000, 1 << 20, 8).is_ok());
    let err = check_extent(0x10_0000, 0, 4).unwrap_err().to_string();
    assert!(err.contains("at least one element"), "{err}");
    let err = check_extent(0x10_0800, 4, 4).unwrap_err().to_string();
    assert!(err.contains("4096-byte aligned"), "{err}");
    let err = check_extent(0x10_0000, usize::MAX, 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("overflow"), "{err}");
}
