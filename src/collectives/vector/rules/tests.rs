//! The rules, one by one, and the expansion checked end to end: every rank's steps are run
//! by a host model of NCCL's calls (sends matched to receives, broadcasts and reduces per
//! root) and the buffers compared with what the v-collective means.
//!
//! Past 600 lines on purpose: each collective's reference sits next to the case that runs
//! its plan, which is what a reader checks, and the model serves all of them.

// The model indexes ranks as NCCL does.
#![allow(clippy::needless_range_loop)]

use std::collections::{HashMap, VecDeque};

use super::*;
use crate::collectives::vector::plan::plan;

fn args<'l>(
    rank: usize,
    size: usize,
    send: (Option<usize>, Option<&'l Layout>),
    recv: (Option<usize>, Option<&'l Layout>),
    in_place: bool,
) -> Args<'l> {
    Args {
        rank,
        size,
        send_len: send.0,
        send_layout: send.1,
        recv_len: recv.0,
        recv_layout: recv.1,
        in_place,
    }
}

fn broken(kind: VKind, built: Built, a: &Args<'_>) -> (Broken, String) {
    let broken = plan(kind, built, a).unwrap_err();
    let text = broken.to_error(kind, a.rank, a.size).to_string();
    assert!(text.starts_with("invalid argument: "), "{text}");
    (broken, text)
}

const P2P: Built = Built::PointToPoint;
const COLL: Built = Built::Collective;

#[test]
fn layouts_need_one_entry_per_rank() {
    let short = Layout::packed([1, 2]);
    let a = args(
        0,
        3,
        (Some(3), Some(&short)),
        (Some(3), Some(&short)),
        false,
    );
    let (b, text) = broken(VKind::AllToAll, P2P, &a);
    assert_eq!(
        b,
        Broken::Entries {
            layout: "send",
            what: "counts",
            len: 2
        }
    );
    assert!(
        text.contains("all_to_all_v on rank 0: the send layout has 2 counts"),
        "{text}"
    );
    assert!(text.contains("3 ranks"), "{text}");

    let displs = Layout::with_displacements([1, 1, 1], [0, 1]);
    let good = Layout::packed([1, 1, 1]);
    let a = args(
        1,
        3,
        (Some(3), Some(&good)),
        (Some(3), Some(&displs)),
        false,
    );
    let (b, text) = broken(VKind::AllToAll, P2P, &a);
    assert!(matches!(
        b,
        Broken::Entries {
            layout: "receive",
            what: "displacements",
            len: 2
        }
    ));
    assert!(
        text.contains("receive layout has 2 displacements"),
        "{text}"
    );
}

#[test]
fn every_segment_lies_inside_its_buffer() {
    let layout = Layout::packed([2, 3]);
    let fine = Layout::packed([1, 1]);
    // The receive buffer holds 4 elements, the layout needs 5.
    let a = args(
        0,
        2,
        (Some(2), Some(&fine)),
        (Some(4), Some(&layout)),
        false,
    );
    let (b, text) = broken(VKind::AllToAll, P2P, &a);
    assert_eq!(
        b,
        Broken::Outside {
            layout: "receive",
            peer: 1,
            displ: 2,
            count: 3,
            len: 4
        }
    );
    assert!(
        text.contains("the receive segment for rank 1 (3 elements at element 2) does not lie inside the receive buffer of 4"),
        "{text}"
    );
    // An end past usize::MAX is outside too, not a wrap-around.
    let huge = Layout::with_displacements([usize::MAX, 1], [1, 0]);
    assert!(matches!(
        check_layout(&huge, "send", 2, usize::MAX),
        Err(Broken::Outside { peer: 0, .. })
    ));
    // A zero-count segment may sit at the very end, not past it.
    assert!(check_layout(&Layout::with_displacements([0, 2], [2, 0]), "send", 2, 2).is_ok());
    assert!(matches!(
        check_layout(&Layout::with_displacements([0, 2], [3, 0]), "send", 2, 2),
        Err(Broken::Outside {
            peer: 0,
            count: 0,
            displ: 3,
            ..
        })
    ));
}

#[test]
fn written_segments_must_not_overlap() {
    let overlap = Layout::with_displacements([2, 2, 1], [0, 5, 1]);
    assert_eq!(
        check_disjoint(&overlap, "receive"),
        Err(Broken::Overlap {
            layout: "receive",
            first: 0,
            second: 2
        })
    );
    // Empty segments overlap nothing; touching segments do not overlap.
    assert!(check_disjoint(&Layout::with_displacements([2, 0, 2], [0, 1, 2]), "r").is_ok());
    assert!(check_disjoint(&Layout::with_displacements([2, 2], [2, 0]), "r").is_ok());
    // A long segment reaching over a later one is caught even when a short one sits between.
    let reach = Layout::with_displacements([10, 1, 1], [0, 12, 5]);
    assert_eq!(
        check_disjoint(&reach, "r"),
        Err(Broken::Overlap {
            layout: "r",
            first: 0,
            second: 2
        })
    );

    let send = Layout::packed([1, 1]);
    let overlapping = Layout::with_displacements([2, 2], [0, 1]);
    let a = args(
        0,
        2,
        (Some(2), Some(&send)),
        (Some(4), Some(&overlapping)),
        false,
    );
    let (_, text) = broken(VKind::AllToAll, P2P, &a);
    assert!(
        text.contains("segments for ranks 0 and 1 overlap"),
        "{text}"
    );
    // Send segments may overlap: they are only read.
    let shared = Layout::with_displacements([2, 2], [0, 0]);
    let recv = Layout::packed([2, 2]);
    let a = args(
        0,
        2,
        (Some(2), Some(&shared)),
        (Some(4), Some(&recv)),
        false,
    );
    assert!(plan(VKind::AllToAll, P2P, &a).is_ok());
    // ... also the root's send segments of a scatter.
    let a = args(0, 2, (Some(2), Some(&shared)), (Some(2), None), false);
    assert!(plan(VKind::Scatter { root: 0 }, P2P, &a).is_ok());
    // In place, the reduce-scatter segments are written: no overlap.
    let a = args(0, 2, (None, Some(&shared)), (Some(2), None), true);
    assert!(matches!(
        broken(VKind::ReduceScatter, COLL, &a).0,
        Broken::Overlap {
            layout: "in-place",
            ..
        }
    ));
}

#[test]
fn own_contribution_matches_own_segment() {
    let layout = Layout::packed([2, 3]);
    let a = args(1, 2, (Some(2), None), (Some(5), Some(&layout)), false);
    let (b, text) = broken(VKind::AllGather, COLL, &a);
    assert_eq!(
        b,
        Broken::OwnCount {
            buffer: "send",
            len: 2,
            count: 3
        }
    );
    assert!(
        text.contains("all_gather_v on rank 1: the send buffer has 2 elements, but the layout gives rank 1's own segment 3"),
        "{text}"
    );
    let a = args(0, 2, (Some(5), Some(&layout)), (Some(3), None), false);
    assert!(matches!(
        broken(VKind::ReduceScatter, COLL, &a).0,
        Broken::OwnCount {
            buffer: "receive",
            len: 3,
            count: 2
        }
    ));
    let a = args(1, 2, (Some(2), None), (Some(5), Some(&layout)), false);
    assert!(matches!(
        broken(VKind::Gather { root: 1 }, P2P, &a).0,
        Broken::OwnCount { .. }
    ));
    let a = args(0, 2, (Some(5), Some(&layout)), (Some(3), None), false);
    assert!(matches!(
        broken(VKind::Scatter { root: 0 }, P2P, &a).0,
        Broken::OwnCount { .. }
    ));
}

#[test]
fn root_only_arguments_are_needed_on_the_root_only() {
    let layout = Layout::packed([1, 1]);
    // Gather: the root needs the receive buffer and layout.
    let a = args(1, 2, (Some(1), None), (None, Some(&layout)), false);
    let (_, text) = broken(VKind::Gather { root: 1 }, P2P, &a);
    assert!(
        text.contains("gather_v on rank 1 needs a receive buffer (root)"),
        "{text}"
    );
    let a = args(1, 2, (Some(1), None), (Some(2), None), false);
    let (_, text) = broken(VKind::Gather { root: 1 }, P2P, &a);
    assert!(text.contains("needs a receive layout (root)"), "{text}");
    let a = args(0, 2, (Some(1), None), (None, None), false);
    assert!(plan(VKind::Gather { root: 1 }, P2P, &a).is_ok());
    // Scatter: the root needs the send buffer and layout.
    let a = args(0, 2, (None, Some(&layout)), (Some(1), None), false);
    let (_, text) = broken(VKind::Scatter { root: 0 }, P2P, &a);
    assert!(
        text.contains("scatter_v on rank 0 needs a send buffer (root)"),
        "{text}"
    );
    let a = args(0, 2, (Some(2), None), (Some(1), None), false);
    assert!(broken(VKind::Scatter { root: 0 }, P2P, &a)
        .1
        .contains("send layout (root)"));
    let a = args(1, 2, (None, None), (Some(1), None), false);
    assert!(plan(VKind::Scatter { root: 0 }, P2P, &a).is_ok());
    // In place on the root, the layout is needed.
    let a = args(0, 2, (None, None), (Some(2), None), true);
    assert!(broken(VKind::Scatter { root: 0 }, P2P, &a)
        .1
        .contains("in-place layout (root)"));
    let a = args(0, 2, (None, None), (Some(2), None), true);
    assert!(broken(VKind::Gather { root: 0 }, P2P, &a)
        .1
        .contains("in-place layout (root)"));
    // And the root must be a rank.
    let a = args(0, 2, (Some(1), None), (Some(2), Some(&layout)), false);
    let (b, text) = broken(VKind::Gather { root: 2 }, P2P, &a);
    assert_eq!(b, Broken::RootOutOfRange(2));
    assert!(
        text.contains("root 2 is out of range for a communicator of 2 ranks"),
        "{text}"
    );
}

#[test]
fn missing_buffers_and_layouts_are_named() {
    let layout = Layout::packed([1, 1]);
    let a = args(0, 2, (None, Some(&layout)), (Some(2), Some(&layout)), false);
    assert!(broken(VKind::AllToAll, P2P, &a)
        .1
        .contains("needs a send buffer"));
    let a = args(0, 2, (Some(2), Some(&layout)), (Some(2), None), false);
    assert!(broken(VKind::AllToAll, P2P, &a)
        .1
        .contains("needs a receive layout"));
    let a = args(0, 2, (None, None), (Some(2), Some(&layout)), false);
    assert!(broken(VKind::AllGather, COLL, &a)
        .1
        .contains("needs a send buffer"));
    let a = args(0, 2, (Some(2), None), (Some(1), None), false);
    assert!(broken(VKind::ReduceScatter, COLL, &a)
        .1
        .contains("needs a send layout"));
}

#[test]
fn constructions_each_collective_has() {
    use Construction::*;
    assert_eq!(built(VKind::AllGather, Auto), Ok(Built::PointToPoint));
    assert_eq!(built(VKind::AllGather, Collective), Ok(Built::Collective));
    assert_eq!(
        built(VKind::AllGather, PointToPoint),
        Ok(Built::PointToPoint)
    );
    assert_eq!(built(VKind::ReduceScatter, Auto), Ok(Built::Collective));
    assert_eq!(
        built(VKind::ReduceScatter, PointToPoint),
        Err(Broken::NoConstruction(PointToPoint))
    );
    for kind in [
        VKind::AllToAll,
        VKind::Gather { root: 0 },
        VKind::Scatter { root: 0 },
    ] {
        assert_eq!(built(kind, Auto), Ok(Built::PointToPoint));
        assert_eq!(
            built(kind, Collective),
            Err(Broken::NoConstruction(Collective))
        );
    }
    let text = Broken::NoConstruction(Collective)
        .to_error(VKind::AllToAll, 0, 2)
        .to_string();
    assert!(
        text.contains("all_to_all_v has no Collective construction"),
        "{text}"
    );
    let layout = Layout::packed([1, 1]);
    let a = args(
        0,
        2,
        (Some(2), Some(&layout)),
        (Some(2), Some(&layout)),
        true,
    );
    assert_eq!(broken(VKind::AllToAll, P2P, &a).0, Broken::InPlaceAllToAll);
}

#[test]
fn zero_counts_issue_no_calls() {
    let zeros = Layout::packed([0, 0, 0]);
    let a = args(
        1,
        3,
        (Some(0), Some(&zeros)),
        (Some(0), Some(&zeros)),
        false,
    );
    assert_eq!(plan(VKind::AllToAll, P2P, &a), Ok(vec![]));
    let a = args(1, 3, (Some(0), None), (Some(0), Some(&zeros)), false);
    assert_eq!(plan(VKind::AllGather, COLL, &a), Ok(vec![]));
    assert_eq!(plan(VKind::AllGather, P2P, &a), Ok(vec![]));
    // Only the non-empty pairs are planned.
    let some = Layout::packed([0, 4, 0]);
    let a = args(0, 3, (Some(4), Some(&some)), (Some(4), Some(&some)), false);
    let seg = |buf| Seg {
        buf,
        offset: 0,
        count: 4,
    };
    assert_eq!(
        plan(VKind::AllToAll, P2P, &a),
        Ok(vec![
            Step::Send {
                peer: 1,
                from: seg(Buf::Send)
            },
            Step::Recv {
                peer: 1,
                into: seg(Buf::Recv)
            }
        ])
    );
}

#[test]
fn pair_counts_are_what_each_rank_moves() {
    let l = Layout::packed([1, 2, 3]);
    let a = args(1, 3, (Some(6), Some(&l)), (Some(6), Some(&l)), false);
    assert_eq!(
        pair_counts(VKind::AllToAll, &a),
        (vec![1, 2, 3], vec![1, 2, 3])
    );
    let a = args(1, 3, (Some(2), None), (Some(6), Some(&l)), false);
    assert_eq!(
        pair_counts(VKind::AllGather, &a),
        (vec![2, 2, 2], vec![1, 2, 3])
    );
    let a = args(1, 3, (Some(6), Some(&l)), (Some(2), None), false);
    assert_eq!(
        pair_counts(VKind::ReduceScatter, &a),
        (vec![1, 2, 3], vec![2, 2, 2])
    );
    let a = args(0, 3, (Some(5), None), (None, None), false);
    assert_eq!(
        pair_counts(VKind::Gather { root: 2 }, &a),
        (vec![0, 0, 5], vec![0, 0, 0])
    );
    let a = args(2, 3, (None, None), (Some(6), Some(&l)), true);
    assert_eq!(
        pair_counts(VKind::Gather { root: 2 }, &a),
        (vec![0, 0, 3], vec![1, 2, 3])
    );
    let a = args(0, 3, (None, None), (Some(4), None), false);
    assert_eq!(
        pair_counts(VKind::Scatter { root: 1 }, &a),
        (vec![0, 0, 0], vec![0, 4, 0])
    );
    let a = args(1, 3, (Some(6), Some(&l)), (Some(2), None), false);
    assert_eq!(
        pair_counts(VKind::Scatter { root: 1 }, &a),
        (vec![1, 2, 3], vec![0, 2, 0])
    );
}

// ---- the end-to-end model ----

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Counts placed in a random order with random gaps (or packed), and the buffer length.
fn place(rng: &mut Rng, counts: &[usize]) -> (Layout, usize) {
    if rng.below(3) == 0 {
        let layout = Layout::packed(counts.to_vec());
        let len = layout.total() + rng.below(2);
        return (layout, len);
    }
    let mut order: Vec<usize> = (0..counts.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut displs = vec![0; counts.len()];
    let mut at = 0;
    for i in order {
        at += rng.below(3);
        displs[i] = at;
        at += counts[i];
    }
    (
        Layout::with_displacements(counts.to_vec(), displs),
        at + rng.below(2),
    )
}

/// One rank's buffers in the model; `None` where the rank passes no such buffer.
#[derive(Clone, Debug, PartialEq)]
struct Bufs {
    send: Option<Vec<i64>>,
    recv: Option<Vec<i64>>,
}

fn fill(rank: usize, tag: i64, len: usize) -> Vec<i64> {
    (0..len)
        .map(|i| tag * (1_000_000 * (rank as i64 + 1) + i as i64 + 1))
        .collect()
}

impl Bufs {
    fn get(&self, buf: Buf) -> &Vec<i64> {
        match buf {
            Buf::Send => self
                .send
                .as_ref()
                .expect("a step reads a send buffer that is absent"),
            Buf::Recv => self
                .recv
                .as_ref()
                .expect("a step uses a receive buffer that is absent"),
        }
    }
    fn read(&self, seg: Seg) -> Vec<i64> {
        self.get(seg.buf)[seg.offset..seg.offset + seg.count].to_vec()
    }
}

/// Runs every rank's steps as NCCL would, reading inputs as they were before the call.
fn run(plans: &[Vec<Step>], state: &mut [Bufs]) {
    let before = state.to_vec();
    let mut writes: Vec<(usize, Seg, Vec<i64>)> = Vec::new();
    let mut sends: HashMap<(usize, usize), VecDeque<Seg>> = HashMap::new();
    let mut recvs: HashMap<(usize, usize), VecDeque<Seg>> = HashMap::new();
    let mut broadcasts: HashMap<usize, Vec<(usize, Option<Seg>, Seg)>> = HashMap::new();
    let mut reduces: HashMap<usize, Vec<(usize, Seg, Option<Seg>)>> = HashMap::new();
    for (rank, steps) in plans.iter().enumerate() {
        for step in steps {
            match *step {
                Step::Send { peer, from } => sends.entry((rank, peer)).or_default().push_back(from),
                Step::Recv { peer, into } => recvs.entry((peer, rank)).or_default().push_back(into),
                Step::Broadcast { root, send, recv } => {
                    broadcasts.entry(root).or_default().push((rank, send, recv))
                }
                Step::Reduce { root, send, recv } => {
                    reduces.entry(root).or_default().push((rank, send, recv))
                }
            }
        }
    }
    for ((from, to), mut queue) in sends {
        let mut matching = recvs.remove(&(from, to)).unwrap_or_default();
        while let Some(seg) = queue.pop_front() {
            let into = matching
                .pop_front()
                .expect("a send without a matching receive");
            assert_eq!(seg.count, into.count, "send {from} -> {to}: counts differ");
            writes.push((to, into, before[from].read(seg)));
        }
        assert!(
            matching.is_empty(),
            "a receive {from} -> {to} without a send"
        );
    }
    assert!(
        recvs.values().all(VecDeque::is_empty),
        "receives without sends: {recvs:?}"
    );
    for (root, calls) in broadcasts {
        assert_eq!(
            calls.len(),
            plans.len(),
            "broadcast from {root} not on every rank"
        );
        let source = calls
            .iter()
            .find(|c| c.0 == root)
            .and_then(|c| c.1)
            .expect("root source");
        for (rank, send, recv) in calls {
            assert_eq!(send.is_some(), rank == root);
            assert_eq!(recv.count, source.count);
            writes.push((rank, recv, before[root].read(source)));
        }
    }
    for (root, calls) in reduces {
        assert_eq!(
            calls.len(),
            plans.len(),
            "reduce to {root} not on every rank"
        );
        let mut sum = vec![0; calls[0].1.count];
        let mut into = None;
        for (rank, send, recv) in calls {
            assert_eq!(send.count, sum.len());
            assert_eq!(recv.is_some(), rank == root);
            into = into.or(recv);
            for (s, v) in sum.iter_mut().zip(before[rank].read(send)) {
                *s += v;
            }
        }
        writes.push((root, into.expect("root destination"), sum));
    }
    for (rank, seg, data) in writes {
        assert_eq!(seg.buf, Buf::Recv, "a write into a send buffer");
        let buf = state[rank].recv.as_mut().unwrap();
        buf[seg.offset..seg.offset + seg.count].copy_from_slice(&data);
    }
}

fn counts(rng: &mut Rng, n: usize, shape: usize) -> Vec<usize> {
    (0..n)
        .map(|_| match shape {
            0 => 3,            // even
            1 => rng.below(6), // skewed, some zero
            _ => 0,            // all zero
        })
        .collect()
}

fn segment(layout: &Layout, i: usize) -> std::ops::Range<usize> {
    layout.segment(i).unwrap()
}

/// Every collective, construction, placement and in/out of place, for 1 to 4 ranks: the
/// planned steps, run by the model, produce exactly what the collective means, and touch
/// nothing else.
#[test]
fn plans_carry_out_every_v_collective() {
    let mut rng = Rng(7);
    let mut cases = 0;
    for size in 1..=4 {
        for shape in 0..3 {
            for _ in 0..6 {
                cases += all_to_all_case(&mut rng, size, shape);
                for built in [COLL, P2P] {
                    for in_place in [false, true] {
                        cases += all_gather_case(&mut rng, size, shape, built, in_place);
                    }
                }
                for in_place in [false, true] {
                    cases += reduce_scatter_case(&mut rng, size, shape, in_place);
                    for root in 0..size {
                        cases += gather_case(&mut rng, size, shape, root, in_place);
                        cases += scatter_case(&mut rng, size, shape, root, in_place);
                    }
                }
            }
        }
    }
    assert!(cases > 1000, "{cases}");
}

fn plans(kind: VKind, built: Built, all: &[Args<'_>]) -> Vec<Vec<Step>> {
    all.iter()
        .map(|a| plan(kind, built, a).unwrap_or_else(|b| panic!("{kind:?} rank {}: {b:?}", a.rank)))
        .collect()
}

fn all_to_all_case(rng: &mut Rng, n: usize, shape: usize) -> usize {
    let matrix: Vec<Vec<usize>> = (0..n).map(|_| counts(rng, n, shape)).collect();
    let sends: Vec<_> = (0..n).map(|i| place(rng, &matrix[i])).collect();
    let recvs: Vec<_> = (0..n)
        .map(|j| place(rng, &(0..n).map(|i| matrix[i][j]).collect::<Vec<_>>()))
        .collect();
    let mut state: Vec<Bufs> = (0..n)
        .map(|r| Bufs {
            send: Some(fill(r, 1, sends[r].1)),
            recv: Some(fill(r, -1, recvs[r].1)),
        })
        .collect();
    let all: Vec<_> = (0..n)
        .map(|r| {
            args(
                r,
                n,
                (Some(sends[r].1), Some(&sends[r].0)),
                (Some(recvs[r].1), Some(&recvs[r].0)),
                false,
            )
        })
        .collect();
    let mut want = state.clone();
    for j in 0..n {
        for i in 0..n {
            let data = state[i].send.as_ref().unwrap()[segment(&sends[i].0, j)].to_vec();
            want[j].recv.as_mut().unwrap()[segment(&recvs[j].0, i)].copy_from_slice(&data);
        }
    }
    run(&plans(VKind::AllToAll, P2P, &all), &mut state);
    assert_eq!(state, want, "all_to_all_v n={n} shape={shape}");
    1
}

fn all_gather_case(rng: &mut Rng, n: usize, shape: usize, built: Built, in_place: bool) -> usize {
    let c = counts(rng, n, shape);
    let layouts: Vec<_> = (0..n).map(|_| place(rng, &c)).collect();
    let mut state: Vec<Bufs> = (0..n)
        .map(|r| Bufs {
            send: (!in_place).then(|| fill(r, 1, c[r])),
            recv: Some(fill(r, -1, layouts[r].1)),
        })
        .collect();
    let all: Vec<_> = (0..n)
        .map(|r| {
            let send_len = (!in_place).then_some(c[r]);
            args(
                r,
                n,
                (send_len, None),
                (Some(layouts[r].1), Some(&layouts[r].0)),
                in_place,
            )
        })
        .collect();
    let mut want = state.clone();
    for i in 0..n {
        for j in 0..n {
            let data = if in_place {
                state[j].recv.as_ref().unwrap()[segment(&layouts[j].0, j)].to_vec()
            } else {
                state[j].send.clone().unwrap()
            };
            want[i].recv.as_mut().unwrap()[segment(&layouts[i].0, j)].copy_from_slice(&data);
        }
    }
    run(&plans(VKind::AllGather, built, &all), &mut state);
    assert_eq!(
        state, want,
        "all_gather_v n={n} {built:?} in_place={in_place}"
    );
    1
}

fn reduce_scatter_case(rng: &mut Rng, n: usize, shape: usize, in_place: bool) -> usize {
    let c = counts(rng, n, shape);
    let layouts: Vec<_> = (0..n).map(|_| place(rng, &c)).collect();
    let mut state: Vec<Bufs> = (0..n)
        .map(|r| {
            if in_place {
                Bufs {
                    send: None,
                    recv: Some(fill(r, 1, layouts[r].1)),
                }
            } else {
                Bufs {
                    send: Some(fill(r, 1, layouts[r].1)),
                    recv: Some(fill(r, -1, c[r])),
                }
            }
        })
        .collect();
    let all: Vec<_> = (0..n)
        .map(|r| {
            let len = layouts[r].1;
            if in_place {
                args(r, n, (None, Some(&layouts[r].0)), (Some(len), None), true)
            } else {
                args(
                    r,
                    n,
                    (Some(len), Some(&layouts[r].0)),
                    (Some(c[r]), None),
                    false,
                )
            }
        })
        .collect();
    let mut want = state.clone();
    for i in 0..n {
        let input = |j: usize| {
            let buf = if in_place {
                &state[j].recv
            } else {
                &state[j].send
            };
            buf.as_ref().unwrap()[segment(&layouts[j].0, i)].to_vec()
        };
        let sum: Vec<i64> = (0..c[i])
            .map(|k| (0..n).map(|j| input(j)[k]).sum())
            .collect();
        let out = want[i].recv.as_mut().unwrap();
        let range = if in_place {
            segment(&layouts[i].0, i)
        } else {
            0..c[i]
        };
        out[range].copy_from_slice(&sum);
    }
    run(&plans(VKind::ReduceScatter, COLL, &all), &mut state);
    assert_eq!(state, want, "reduce_scatter_v n={n} in_place={in_place}");
    1
}

fn gather_case(rng: &mut Rng, n: usize, shape: usize, root: usize, in_place: bool) -> usize {
    let c = counts(rng, n, shape);
    let (layout, len) = place(rng, &c);
    let mut state: Vec<Bufs> = (0..n)
        .map(|r| match (r == root, in_place) {
            (true, true) => Bufs {
                send: None,
                recv: Some(fill(r, 1, len)),
            },
            (true, false) => Bufs {
                send: Some(fill(r, 1, c[r])),
                recv: Some(fill(r, -1, len)),
            },
            (false, true) => Bufs {
                send: None,
                recv: Some(fill(r, 1, c[r])),
            },
            (false, false) => Bufs {
                send: Some(fill(r, 1, c[r])),
                recv: None,
            },
        })
        .collect();
    let all: Vec<_> = (0..n)
        .map(|r| {
            let mine = (r == root).then_some(&layout);
            match (r == root, in_place) {
                (true, true) => args(r, n, (None, None), (Some(len), mine), true),
                (true, false) => args(r, n, (Some(c[r]), None), (Some(len), mine), false),
                (false, true) => args(r, n, (None, None), (Some(c[r]), None), true),
                (false, false) => args(r, n, (Some(c[r]), None), (None, None), false),
            }
        })
        .collect();
    let mut want = state.clone();
    for j in 0..n {
        let data = match (j == root, in_place) {
            (true, true) => continue,
            (_, false) => state[j].send.clone().unwrap(),
            (false, true) => state[j].recv.clone().unwrap(),
        };
        want[root].recv.as_mut().unwrap()[segment(&layout, j)].copy_from_slice(&data);
    }
    run(&plans(VKind::Gather { root }, P2P, &all), &mut state);
    assert_eq!(
        state, want,
        "gather_v n={n} root={root} in_place={in_place}"
    );
    1
}

fn scatter_case(rng: &mut Rng, n: usize, shape: usize, root: usize, in_place: bool) -> usize {
    let c = counts(rng, n, shape);
    let (layout, len) = place(rng, &c);
    let mut state: Vec<Bufs> = (0..n)
        .map(|r| match (r == root, in_place) {
            (true, true) => Bufs {
                send: None,
                recv: Some(fill(r, 1, len)),
            },
            (true, false) => Bufs {
                send: Some(fill(r, 1, len)),
                recv: Some(fill(r, -1, c[r])),
            },
            (false, _) => Bufs {
                send: None,
                recv: Some(fill(r, -1, c[r])),
            },
        })
        .collect();
    let all: Vec<_> = (0..n)
        .map(|r| {
            let mine = (r == root).then_some(&layout);
            match (r == root, in_place) {
                (true, true) => args(r, n, (None, mine), (Some(len), None), true),
                (true, false) => args(r, n, (Some(len), mine), (Some(c[r]), None), false),
                (false, ip) => args(r, n, (None, None), (Some(c[r]), None), ip),
            }
        })
        .collect();
    let mut want = state.clone();
    let source = if in_place {
        &state[root].recv
    } else {
        &state[root].send
    };
    for j in 0..n {
        if j == root && in_place {
            continue;
        }
        let data = source.as_ref().unwrap()[segment(&layout, j)].to_vec();
        want[j].recv.as_mut().unwrap().copy_from_slice(&data);
    }
    run(&plans(VKind::Scatter { root }, P2P, &all), &mut state);
    assert_eq!(
        state, want,
        "scatter_v n={n} root={root} in_place={in_place}"
    );
    1
}
