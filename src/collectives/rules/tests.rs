//! NCCL's count and buffer rules, one by one, with the messages a broken rule gives.

use super::*;

fn ok(kind: Kind, rank: usize, size: usize, s: Option<usize>, r: Option<usize>, ip: bool) -> Plan {
    check_plan(kind, rank, size, s, r, ip, false).unwrap()
}

fn err(
    kind: Kind,
    rank: usize,
    size: usize,
    s: Option<usize>,
    r: Option<usize>,
    ip: bool,
) -> String {
    match check_plan(kind, rank, size, s, r, ip, false).map_err(|b| b.to_error(kind, rank, size)) {
        Err(Error::InvalidArgument(msg)) => msg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn all_reduce_rules() {
    assert_eq!(
        ok(Kind::AllReduce, 0, 4, Some(8), Some(8), false),
        Plan {
            count: 8,
            send: Ptr::Send(0),
            recv: Ptr::Recv(0)
        }
    );
    assert!(err(Kind::AllReduce, 0, 4, Some(8), Some(7), false)
        .contains("send has 8 elements but receive has 7"));
    assert!(err(Kind::AllReduce, 2, 4, None, Some(7), false).contains("rank 2 needs a send buffer"));
    assert_eq!(
        ok(Kind::AllReduce, 1, 4, None, Some(5), true),
        Plan {
            count: 5,
            send: Ptr::Recv(0),
            recv: Ptr::Recv(0)
        }
    );
}

#[test]
fn broadcast_rules() {
    let root = Kind::Broadcast { root: 1 };
    assert_eq!(ok(root, 1, 2, Some(6), Some(6), false).send, Ptr::Send(0));
    assert!(err(root, 1, 2, None, Some(6), false).contains("needs a send (root) buffer"));
    assert!(
        err(root, 1, 2, Some(5), Some(6), false).contains("root sends 5 elements but receives 6")
    );
    // Off the root the send buffer is not needed, and not used even when given.
    assert_eq!(
        ok(root, 0, 2, None, Some(6), false),
        Plan {
            count: 6,
            send: Ptr::Recv(0),
            recv: Ptr::Recv(0)
        }
    );
    assert_eq!(ok(root, 0, 2, Some(1), Some(6), false).send, Ptr::Recv(0));
    assert!(err(Kind::Broadcast { root: 2 }, 0, 2, None, Some(6), false)
        .contains("root 2 is out of range"));
    assert_eq!(ok(root, 0, 2, None, Some(3), true).count, 3);
}

#[test]
fn reduce_rules() {
    let kind = Kind::Reduce { root: 0 };
    assert_eq!(
        ok(kind, 0, 3, Some(4), Some(4), false),
        Plan {
            count: 4,
            send: Ptr::Send(0),
            recv: Ptr::Recv(0)
        }
    );
    assert!(err(kind, 0, 3, Some(4), None, false).contains("needs a receive (root) buffer"));
    assert!(err(kind, 0, 3, Some(4), Some(3), false).contains("the root receives 3"));
    assert_eq!(
        ok(kind, 2, 3, Some(4), None, false),
        Plan {
            count: 4,
            send: Ptr::Send(0),
            recv: Ptr::Null
        }
    );
    assert!(err(Kind::Reduce { root: 3 }, 0, 3, Some(4), Some(4), false).contains("out of range"));
}

#[test]
fn all_gather_rules() {
    assert_eq!(
        ok(Kind::AllGather, 2, 4, Some(3), Some(12), false),
        Plan {
            count: 3,
            send: Ptr::Send(0),
            recv: Ptr::Recv(0)
        }
    );
    assert!(err(Kind::AllGather, 2, 4, Some(3), Some(11), false)
        .contains("must hold 4 x 3 elements, it has 11"));
    assert!(err(Kind::AllGather, 2, 4, Some(usize::MAX), Some(11), false).contains("must hold"));
    assert_eq!(
        ok(Kind::AllGather, 2, 4, None, Some(12), true),
        Plan {
            count: 3,
            send: Ptr::Recv(6),
            recv: Ptr::Recv(0)
        }
    );
    assert!(
        err(Kind::AllGather, 2, 4, None, Some(10), true).contains("not a multiple of the 4 ranks")
    );
}

#[test]
fn reduce_scatter_rules() {
    assert_eq!(
        ok(Kind::ReduceScatter, 1, 4, Some(8), Some(2), false),
        Plan {
            count: 2,
            send: Ptr::Send(0),
            recv: Ptr::Recv(0)
        }
    );
    assert!(err(Kind::ReduceScatter, 1, 4, Some(7), Some(2), false)
        .contains("send buffer must hold 4 x 2"));
    assert_eq!(
        ok(Kind::ReduceScatter, 3, 4, None, Some(8), true),
        Plan {
            count: 2,
            send: Ptr::Recv(0),
            recv: Ptr::Recv(6)
        }
    );
}

#[test]
fn all_to_all_rules() {
    assert_eq!(ok(Kind::AllToAll, 0, 4, Some(8), Some(8), false).count, 2);
    assert!(err(Kind::AllToAll, 0, 4, Some(8), Some(12), false)
        .contains("send has 8 elements but receive has 12"));
    assert!(err(Kind::AllToAll, 0, 4, Some(6), Some(6), false).contains("not a multiple"));
    assert!(err(Kind::AllToAll, 0, 4, None, Some(8), true).contains("no in-place all-to-all"));
}

/// M2: off the root, a copy-engine gather writes `count` elements at its receive
/// offset plus `rank` × `count` in the root's window, so its receive buffer must be as
/// long as the root's; an in-place gather (one block) is refused on every rank. Before
/// the fix a receive buffer of any length passed.
#[test]
fn m2_copy_engine_gather_off_root_needs_the_roots_receive_length() {
    let gather = Kind::Gather { root: 0 };
    let off_root = |rank, recv| check_plan(gather, rank, 4, Some(3), Some(recv), false, true);
    for rank in 1..4 {
        assert_eq!(
            off_root(rank, 3),
            Err(Broken::CopyEngineGatherShortReceive { send: 3, recv: 3 })
        );
        assert_eq!(
            off_root(rank, 11),
            Err(Broken::CopyEngineGatherShortReceive { send: 3, recv: 11 })
        );
        assert_eq!(
            off_root(rank, 12).map(|p| (p.count, p.recv)),
            Ok((3, Ptr::Recv(0)))
        );
    }
    let text = Broken::CopyEngineGatherShortReceive { send: 3, recv: 3 }
        .to_error(gather, 2, 4)
        .to_string();
    assert!(
        text.contains("must hold 4 x 3") && text.contains("it has 3"),
        "{text}"
    );
    // Without copy engines the off-root receive buffer is never written.
    assert!(check_plan(gather, 1, 4, Some(3), Some(1), false, false).is_ok());
    // A count too large to multiply is refused, not wrapped.
    assert!(check_plan(gather, 1, 4, Some(usize::MAX), Some(1), false, true).is_err());
    // In place: refused on every rank, root included, so no rank waits for another.
    for rank in 0..4 {
        assert_eq!(
            check_plan(gather, rank, 4, None, Some(12), true, true),
            Err(Broken::CopyEngineInPlaceGather)
        );
        assert!(check_plan(gather, rank, 4, None, Some(12), true, false).is_ok());
    }
    let text = Broken::CopyEngineInPlaceGather
        .to_error(gather, 1, 4)
        .to_string();
    assert!(text.contains("out-of-place gather"), "{text}");
}

#[test]
fn gather_and_scatter_rules() {
    let gather = Kind::Gather { root: 1 };
    assert_eq!(
        ok(gather, 1, 3, Some(2), Some(6), false),
        Plan {
            count: 2,
            send: Ptr::Send(0),
            recv: Ptr::Recv(0)
        }
    );
    assert!(err(gather, 1, 3, Some(2), Some(5), false)
        .contains("root's receive buffer must hold 3 x 2"));
    assert!(err(gather, 1, 3, Some(2), None, false).contains("needs a receive (root) buffer"));
    assert_eq!(ok(gather, 0, 3, Some(2), None, false).recv, Ptr::Null);
    // Off the root, a given receive buffer goes to NCCL (copy engines address the root's
    // window through it); on a copy-engine communicator it must be given.
    assert_eq!(ok(gather, 0, 3, Some(2), Some(1), false).recv, Ptr::Recv(0));
    let copy_engine = |r| check_plan(gather, 0, 3, Some(2), r, false, true);
    assert_eq!(
        copy_engine(None),
        Err(Broken::CopyEngineGatherWithoutReceive)
    );
    assert_eq!(copy_engine(Some(6)).map(|p| p.recv), Ok(Ptr::Recv(0)));
    assert!(Broken::CopyEngineGatherWithoutReceive
        .to_error(gather, 0, 3)
        .to_string()
        .contains("pass the receive buffer on every rank"));
    let scatter = Kind::Scatter { root: 1 };
    for rank in 0..3 {
        assert_eq!(
            check_plan(scatter, rank, 3, None, Some(3), true, true),
            Err(Broken::CopyEngineInPlaceScatter)
        );
        assert!(check_plan(scatter, rank, 3, Some(9), Some(3), false, true).is_ok());
    }
    // The root's own rules do not change.
    assert_eq!(
        check_plan(gather, 1, 3, Some(2), Some(6), false, true).map(|p| p.count),
        Ok(2)
    );
    assert_eq!(
        ok(gather, 1, 3, None, Some(6), true),
        Plan {
            count: 2,
            send: Ptr::Recv(2),
            recv: Ptr::Recv(0)
        }
    );
    assert_eq!(
        ok(gather, 2, 3, None, Some(2), true),
        Plan {
            count: 2,
            send: Ptr::Recv(0),
            recv: Ptr::Recv(0)
        }
    );

    let scatter = Kind::Scatter { root: 2 };
    assert_eq!(
        ok(scatter, 2, 3, Some(9), Some(3), false),
        Plan {
            count: 3,
            send: Ptr::Send(0),
            recv: Ptr::Recv(0)
        }
    );
    assert!(
        err(scatter, 2, 3, Some(8), Some(3), false).contains("root's send buffer must hold 3 x 3")
    );
    assert!(err(scatter, 2, 3, None, Some(3), false).contains("needs a send (root) buffer"));
    // Off the root NCCL never reads the send buffer: the receive buffer stands in, so
    // every rank's copy-engine decision follows its receive buffer.
    assert_eq!(ok(scatter, 0, 3, None, Some(3), false).send, Ptr::Recv(0));
    assert_eq!(
        ok(scatter, 0, 3, Some(7), Some(3), false).send,
        Ptr::Recv(0)
    );
    assert_eq!(
        ok(scatter, 1, 3, None, Some(3), true),
        Plan {
            count: 3,
            send: Ptr::Recv(0),
            recv: Ptr::Recv(0)
        }
    );
    assert_eq!(
        ok(scatter, 2, 3, None, Some(9), true),
        Plan {
            count: 3,
            send: Ptr::Recv(0),
            recv: Ptr::Recv(6)
        }
    );
    assert!(err(scatter, 2, 3, None, Some(8), true).contains("not a multiple"));
    assert!(err(Kind::Scatter { root: 5 }, 0, 3, None, Some(3), false)
        .contains("root 5 is out of range"));
}

#[test]
fn point_to_point_rules() {
    assert_eq!(
        ok(Kind::Send { peer: 1 }, 0, 2, Some(4), None, false),
        Plan {
            count: 4,
            send: Ptr::Send(0),
            recv: Ptr::Null
        }
    );
    assert_eq!(
        ok(Kind::Recv { peer: 0 }, 1, 2, None, Some(4), false),
        Plan {
            count: 4,
            send: Ptr::Null,
            recv: Ptr::Recv(0)
        }
    );
    assert!(
        err(Kind::Send { peer: 2 }, 0, 2, Some(4), None, false).contains("peer 2 is out of range")
    );
    // Sending to oneself is allowed by NCCL (inside a group).
    assert_eq!(
        ok(Kind::Recv { peer: 1 }, 1, 2, None, Some(1), false).count,
        1
    );
    assert_eq!(check_self_p2p(Kind::Send { peer: 1 }, 1, true), Ok(()));
    assert_eq!(check_self_p2p(Kind::Recv { peer: 0 }, 1, false), Ok(()));
    // ... but alone it would wait for itself forever.
    for kind in [Kind::Send { peer: 1 }, Kind::Recv { peer: 1 }] {
        let broken = check_self_p2p(kind, 1, false).unwrap_err();
        assert_eq!(broken, Broken::SelfOutsideGroup);
        let text = broken.to_error(kind, 1, 2).to_string();
        assert!(text.contains("to its own rank"), "{text}");
        assert!(text.contains("one Group"), "{text}");
    }
    assert_eq!(check_self_p2p(Kind::AllGather, 0, false), Ok(()));
}

#[test]
fn configs_only_on_collectives() {
    let collectives = [
        (Kind::AllReduce, "ncclAllReduceConfig"),
        (Kind::Broadcast { root: 0 }, "ncclBroadcastConfig"),
        (Kind::Reduce { root: 1 }, "ncclReduceConfig"),
        (Kind::AllGather, "ncclAllGatherConfig"),
        (Kind::ReduceScatter, "ncclReduceScatterConfig"),
        (Kind::AllToAll, "ncclAlltoAllConfig"),
        (Kind::Gather { root: 0 }, "ncclGatherConfig"),
        (Kind::Scatter { root: 1 }, "ncclScatterConfig"),
    ];
    for (kind, name) in collectives {
        assert_eq!(check_config_kind(kind).map(|call| call.name), Ok(name));
        // Every configured name is the plain one with "Config" appended, and exported
        // by the 2.32.3 header.
        assert_eq!(name, format!("{}Config", kind.name()));
        assert!(nccl_sys::FUNCTION_NAMES.contains(&name), "{name}");
    }
    for kind in [Kind::Send { peer: 1 }, Kind::Recv { peer: 0 }] {
        let broken = check_config_kind(kind).unwrap_err();
        assert_eq!(broken, Broken::ConfigOnPointToPoint);
        match broken.to_error(kind, 0, 2) {
            Error::InvalidArgument(text) => {
                assert!(text.contains(kind.name()), "{text}");
                assert!(text.contains("takes no CollConfig"), "{text}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn offsets_never_leave_the_buffer() {
    // Exhaustive over small sizes: every pointer + count stays inside its buffer.
    for size in 1..=5 {
        for rank in 0..size {
            for len in 0..=12 {
                let kinds = [
                    Kind::AllGather,
                    Kind::ReduceScatter,
                    Kind::Gather { root: size - 1 },
                    Kind::Scatter { root: 0 },
                ];
                for kind in kinds {
                    let Ok(p) = check_plan(kind, rank, size, None, Some(len), true, false) else {
                        continue;
                    };
                    for ptr in [p.send, p.recv] {
                        if let Ptr::Recv(offset) = ptr {
                            assert!(
                                offset + p.count <= len,
                                "{kind:?} {rank}/{size} len {len}: {p:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
