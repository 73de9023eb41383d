//! Window registration's outcomes and its handle's slot (no GPU needed).

use super::*;

#[test]
fn a_null_window_is_unavailable_not_a_window() {
    let err = no_window();
    assert!(err.is_unsupported() && !err.is_fatal());
    assert!(
        matches!(err, Error::Unavailable { api: CALL, .. }),
        "{err:?}"
    );
}

#[test]
fn unsettled_registrations_say_the_buffer_was_leaked() {
    let waited = std::time::Duration::from_secs(1);
    let err = not_settled(
        3,
        Error::Timeout {
            what: "x".into(),
            waited,
        },
    );
    match err {
        Error::Timeout { what, waited: w } => {
            assert_eq!(w, waited);
            assert!(what.contains("rank 3") && what.contains("leaked"), "{what}");
            assert!(what.contains("every rank must register"), "{what}");
        }
        other => panic!("{other:?}"),
    }
    let other = not_settled(0, Error::invalid("y"));
    assert!(matches!(other, Error::InvalidArgument(_)));
}

#[test]
fn slots_start_null_and_free_themselves() {
    let slot = new_slot();
    // SAFETY: nothing has been given the slot yet.
    assert!(unsafe { slot.read() }.is_null());
    // SAFETY: the test plays NCCL, writing the slot before it is read.
    unsafe { *slot.as_ptr() = 0x40 as ncclWindow_t };
    // SAFETY: the write above is over.
    assert_eq!(unsafe { slot.read() } as usize, 0x40);
}
