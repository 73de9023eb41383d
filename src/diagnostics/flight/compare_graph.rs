//! The CUDA graphs' replays compared across ranks, one graph at a time, by the rules NCCL's
//! collectives are compared by (`compare_sequence`, through [`compare_numbered`]); see the
//! [module docs](super#cuda-graphs).

use std::collections::BTreeSet;
use std::fmt;

use super::finding::{write_sequence, Finding, Words};
use super::record::FlightRecord;
use super::sequence::compare_numbered;

/// What [`compare`](super::compare()) found about one CUDA graph: its replays compared across
/// ranks by their own numbers ([`GraphReplay::seq`](super::GraphReplay::seq)), as NCCL's
/// collectives are by theirs. `Display` writes it for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphComparison {
    /// The graph's number on the communicator.
    pub graph: u32,
    /// The first of its replays every record still holds.
    pub compared_from: u64,
    /// The last replay on which every compared rank agrees (launched, same graph with as
    /// many captured operations).
    pub agreed_through: u64,
    /// The first replay on which they do not, if any.
    pub diverged_at: Option<u64>,
    /// What was found, per rank, in the graph's replay numbers, as for collectives: a rank
    /// that replayed the graph fewer times is [`Finding::Stalled`] (every replay of a graph
    /// is the same operation, so one that skipped a replay looks like one that stalled
    /// before the last), one whose graph captured other operations a
    /// [`Finding::Mismatch`], a last replay not seen complete [`Finding::NotCompleted`].
    pub findings: Vec<Finding>,
    /// Ranks whose records keep nothing of the graph's replays though they recorded it
    /// ([`FlightRecord::forgot_graph`]): not compared, ascending.
    pub left_out: Vec<usize>,
}

/// Compares every graph that some rank replayed across `records` (ascending by rank), by
/// ascending graph number.
pub(super) fn compare_graphs(records: &[&FlightRecord]) -> Vec<GraphComparison> {
    let graphs: BTreeSet<u32> = records
        .iter()
        .flat_map(|r| {
            let counted = r.graphs.iter().filter(|g| g.replays > 0).map(|g| g.graph);
            let entries = r.entries.iter().filter_map(|e| e.replay.map(|p| p.graph));
            counted.chain(entries)
        })
        .collect();
    graphs
        .into_iter()
        .map(|graph| {
            // A rank that keeps nothing of the graph's replays though it recorded it cannot be
            // told from one that never replayed it: left out (and said so), never blamed.
            let (left, records): (Vec<&FlightRecord>, Vec<&FlightRecord>) =
                records.iter().copied().partition(|r| r.forgot_graph(graph));
            let verdict = compare_numbered(
                &records,
                |e| e.replay.filter(|p| p.graph == graph).and_then(|p| p.seq),
                |r| r.captured_graph(graph).map(|g| g.replays),
            );
            GraphComparison {
                graph,
                compared_from: verdict.compared_from,
                agreed_through: verdict.agreed_through,
                diverged_at: verdict.diverged_at,
                findings: verdict.findings,
                left_out: left.iter().map(|r| r.rank).collect(),
            }
        })
        .collect()
}

impl fmt::Display for GraphComparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "graph #{} (replays of a CUDA graph, by their own numbers, from replay #{}):",
            self.graph, self.compared_from
        )?;
        write_sequence(
            f,
            &Words::REPLAYS,
            "this graph",
            &self.left_out,
            self.agreed_through,
            self.diverged_at,
            &self.findings,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::compare;
    use super::super::synthetic::{record, with_graph};
    use super::*;

    /// Five all-reduces of NCCL, all completed, on every rank.
    fn nccl(rank: usize, size: usize) -> FlightRecord {
        let ops: Vec<(u64, u64)> = (1..=5).map(|i| (i, 256 * i)).collect();
        record(rank, size, &ops, 5)
    }

    /// Replays 1 to `n`.
    fn replays(n: u64) -> Vec<u64> {
        (1..=n).collect()
    }

    /// Rank `rank` of `size`: graph 1 (14 captured operations) replayed `n` times, those up
    /// to `completed` seen complete.
    fn decode(rank: usize, size: usize, n: u64, completed: u64) -> FlightRecord {
        with_graph(nccl(rank, size), 1, 14, &replays(n), completed)
    }

    /// Rank 0 dropped graph 1 and recorded seventy graphs since, so its record forgot the
    /// graph's counters. Where its ring holds none of the replays either, it is left out of
    /// graph 1's comparison (and said so), not named stalled; where the ring still holds
    /// replays #1 to #99 against its peer's 100, it is compared by them and named; a rank
    /// that never recorded graph 1, or whose record predates the count, is named too.
    #[test]
    fn a_rank_that_forgot_a_graph_is_left_out_only_when_it_keeps_nothing_of_it() {
        let kept = decode(1, 2, 100, 100);
        let mut forgot = nccl(0, 2);
        forgot.graphs_recorded = Some(71);
        let cmp = compare(&[forgot.clone(), kept.clone()]).unwrap();
        assert!(cmp.is_consistent(), "{cmp}");
        assert_eq!(cmp.graphs[0].left_out, vec![0], "{cmp}");
        assert!(cmp.to_string().contains("ranks [0] left out"), "{cmp}");
        // Every rank forgot it (one ring holds only an unnumbered, refused launch of it):
        // nothing compared, and no agreement claimed.
        let mut other = nccl(1, 2);
        other.graphs_recorded = Some(71);
        let mut stray = forgot.clone();
        stray
            .entries
            .extend(decode(0, 2, 1, 1).graph_replays(1).cloned().map(|mut e| {
                if let Some(r) = e.replay.as_mut() {
                    r.seq = None;
                }
                e
            }));
        let cmp = compare(&[stray, other]).unwrap();
        assert_eq!(cmp.graphs[0].left_out, vec![0, 1], "{cmp}");
        assert!(!cmp.graphs[0].to_string().contains("agree"), "{cmp}");
        // Its ring still holds replays #1 to #99: compared by them, named stalled.
        let mut evidence = decode(0, 2, 99, 99);
        evidence.graphs.clear();
        evidence.graphs_recorded = Some(71);
        let cmp = compare(&[evidence, kept.clone()]).unwrap();
        assert!(cmp.graphs[0].left_out.is_empty(), "{cmp}");
        assert_eq!(cmp.culprits(), vec![0], "{cmp}");
        // Never recorded graph 1, or a record from before the count was kept: behind.
        for recorded in [None, Some(0)] {
            forgot.graphs_recorded = recorded;
            let cmp = compare(&[forgot.clone(), kept.clone()]).unwrap();
            assert_eq!(cmp.culprits(), vec![0], "{cmp}");
        }
    }

    /// The hang a decode job meets, as `gpu_decode`'s lone-replay test makes it on two ranks:
    /// rank 0 launched a replay its peer never launched, and nothing was seen complete (no
    /// probe, no synchronize): the peer is named stalled before it. (With more ranks the
    /// many that never launched it are not blamed on the records alone: see
    /// `one_rank_of_four_ahead_by_a_replay_or_a_last_replay_not_complete`.)
    #[test]
    fn a_lone_replay_names_the_peer_that_never_launched_it() {
        let records = vec![decode(0, 2, 2, 0), decode(1, 2, 1, 0)];
        let cmp = compare(&records).unwrap();
        let graph = &cmp.graphs[0];
        assert_eq!((graph.graph, graph.diverged_at), (1, Some(2)), "{cmp}");
        assert!(
            matches!(
                graph.findings.as_slice(),
                [Finding::Stalled {
                    rank: 1,
                    seq: 2,
                    last_enqueued: 1,
                    last_completed: 0,
                    ..
                }]
            ),
            "{cmp}"
        );
        assert_eq!(cmp.culprits(), vec![1], "{cmp}");
    }

    #[test]
    fn a_rank_that_replayed_one_fewer_time_is_stalled() {
        for size in [2, 3, 4] {
            for culprit in 0..size {
                let records: Vec<FlightRecord> = (0..size)
                    .map(|rank| {
                        let n = if rank == culprit { 9 } else { 10 };
                        decode(rank, size, n, n)
                    })
                    .collect();
                let cmp = compare(&records).unwrap();
                // NCCL's collectives are compared apart, and agree.
                assert!(cmp.findings.is_empty(), "{cmp}");
                assert_eq!(cmp.graphs.len(), 1, "{cmp}");
                let graph = &cmp.graphs[0];
                assert_eq!((graph.graph, graph.diverged_at), (1, Some(10)));
                assert_eq!(graph.agreed_through, 9);
                let others: Vec<usize> = (0..size).filter(|&r| r != culprit).collect();
                assert_eq!(
                    graph.findings,
                    vec![Finding::Stalled {
                        rank: culprit,
                        seq: 10,
                        last_enqueued: 9,
                        last_completed: 9,
                        ahead: others.clone(),
                    }],
                    "{cmp}"
                );
                assert_eq!(cmp.culprits(), vec![culprit]);
                assert!(!cmp.is_consistent());
                let text = cmp.to_string();
                assert!(
                    text.contains(&format!(
                        "rank {culprit} STALLED before replay #10: it issued up to #9 \
                         (completed through #9; everything it issued completed: it is stuck \
                         outside the graph) while ranks {others:?} issued #10"
                    )),
                    "{text}"
                );
            }
        }
        // Its last replay not seen complete: stuck inside it, not before the next.
        let records = vec![decode(0, 2, 10, 10), decode(1, 2, 9, 8)];
        let cmp = compare(&records).unwrap();
        assert!(
            matches!(
                &cmp.graphs[0].findings[..],
                [Finding::Stalled {
                    rank: 1,
                    seq: 10,
                    last_enqueued: 9,
                    last_completed: 8,
                    ..
                }]
            ),
            "{cmp}"
        );
        assert!(
            cmp.to_string().contains("its last replay did not complete"),
            "{cmp}"
        );
    }

    #[test]
    fn one_rank_of_four_ahead_by_a_replay_or_a_last_replay_not_complete() {
        // Rank 3 launched an 11th replay the others never launched; theirs all completed.
        let records: Vec<FlightRecord> = (0..4)
            .map(|rank| {
                let n = if rank == 3 { 11 } else { 10 };
                decode(rank, 4, n, 10)
            })
            .collect();
        let cmp = compare(&records).unwrap();
        assert!(
            matches!(
                &cmp.graphs[0].findings[..],
                [Finding::Ahead {
                    rank: 3,
                    seq: 11,
                    count: 1,
                    behind_idle: true,
                    ..
                }]
            ),
            "{cmp}"
        );
        assert!(cmp.to_string().contains("rank 3 AHEAD"), "{cmp}");
        // Every rank launched ten, rank 2's tenth not seen complete: nobody is blamed.
        let records: Vec<FlightRecord> = (0..4)
            .map(|rank| decode(rank, 4, 10, if rank == 2 { 9 } else { 10 }))
            .collect();
        let cmp = compare(&records).unwrap();
        assert_eq!(cmp.graphs[0].diverged_at, None);
        assert_eq!(
            cmp.graphs[0].findings,
            vec![Finding::NotCompleted {
                seq: 10,
                ranks: vec![2]
            }]
        );
        assert!(cmp.culprits().is_empty());
        assert!(!cmp.is_consistent());
        assert!(
            cmp.to_string().contains(
                "all ranks issued the same replays; #10 was not seen complete on ranks [2]"
            ),
            "{cmp}"
        );
    }

    #[test]
    fn ranks_that_agree_on_their_replays_are_consistent_and_graphs_are_compared_apart() {
        let records: Vec<FlightRecord> = (0..3)
            .map(|rank| {
                let rec = decode(rank, 3, 10, 10);
                // Graph 2: rank 1 replayed it 4 times, the others 5; graph 3 never replayed.
                let n = if rank == 1 { 4 } else { 5 };
                let rec = with_graph(rec, 2, 3, &replays(n), n);
                with_graph(rec, 3, 1, &[], 0)
            })
            .collect();
        let cmp = compare(&records).unwrap();
        let graphs: Vec<u32> = cmp.graphs.iter().map(|g| g.graph).collect();
        assert_eq!(graphs, vec![1, 2], "{cmp}");
        assert!(cmp.graphs[0].findings.is_empty(), "{cmp}");
        assert_eq!(cmp.graphs[0].agreed_through, 10);
        assert!(
            matches!(
                &cmp.graphs[1].findings[..],
                [Finding::Stalled {
                    rank: 1,
                    seq: 5,
                    ..
                }]
            ),
            "{cmp}"
        );
        assert_eq!(cmp.culprits(), vec![1]);
        let text = cmp.to_string();
        assert!(
            text.contains(
                "graph #1 (replays of a CUDA graph, by their own numbers, from replay #1):\n  \
                 the ranks agree on every replay (through #10)\n    nothing amiss: every \
                 replay was seen complete\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "graph #2 (replays of a CUDA graph, by their own numbers, from replay #1):\n  \
                 the ranks agree through replay #4; they diverge at replay #5:"
            ),
            "{text}"
        );
        // Everything replayed alike and complete: consistent.
        let done: Vec<FlightRecord> = (0..3).map(|rank| decode(rank, 3, 10, 10)).collect();
        let cmp = compare(&done).unwrap();
        assert!(cmp.is_consistent(), "{cmp}");
        assert!(cmp.culprits().is_empty());
    }

    #[test]
    fn a_graph_that_captured_other_operations_is_a_mismatch() {
        let records = vec![
            decode(0, 2, 10, 10),
            with_graph(nccl(1, 2), 1, 13, &replays(10), 10),
        ];
        let cmp = compare(&records).unwrap();
        let graph = &cmp.graphs[0];
        assert_eq!((graph.diverged_at, graph.agreed_through), (Some(1), 0));
        match &graph.findings[..] {
            // Two ranks, one each: the tie goes to the lower rank.
            [Finding::Mismatch {
                rank: 1,
                seq: 1,
                expected,
                found,
            }] => assert_eq!((expected.count, found.count), (14, 13)),
            other => panic!("{other:?}\n{cmp}"),
        }
        let text = cmp.to_string();
        assert!(
            text.contains(
                "rank 1 MISMATCH at replay #1: it issued GraphReplay graph #1 (13 captured \
                 operations) replay #1, the others GraphReplay graph #1 (14 captured \
                 operations) replay #1"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_rank_behind_the_others_rings_is_named_by_its_graphs_counters() {
        // Rank 0 replayed 5000 times and its ring keeps the last 8; rank 1 stopped at 100.
        let mut ahead = decode(0, 2, 5000, 5000);
        ahead
            .entries
            .retain(|e| e.replay.is_none_or(|r| r.seq > Some(4992)));
        let mut behind = decode(1, 2, 100, 100);
        behind
            .entries
            .retain(|e| e.replay.is_none_or(|r| r.seq > Some(92)));
        let cmp = compare(&[ahead, behind]).unwrap();
        assert_eq!(cmp.graphs[0].compared_from, 4993);
        assert_eq!(
            cmp.graphs[0].findings,
            vec![Finding::Stalled {
                rank: 1,
                seq: 101,
                last_enqueued: 100,
                last_completed: 100,
                ahead: vec![0],
            }],
            "{cmp}"
        );
    }

    /// What a README could show: a decode job of four ranks replaying one captured step, rank
    /// 2 having launched it once fewer than the others.
    #[test]
    fn readme_example_output() {
        let records: Vec<FlightRecord> = (0..4)
            .map(|rank| {
                // The others' last replay waits inside for rank 2's all-reduces.
                let n = if rank == 2 { 116 } else { 117 };
                decode(rank, 4, n, 116)
            })
            .collect();
        let cmp = compare(&records).unwrap();
        let text = cmp.to_string();
        println!("{text}");
        assert!(
            text.contains("the ranks agree on every collective (through #5)"),
            "{text}"
        );
        assert!(
            text.contains(
                "graph #1 (replays of a CUDA graph, by their own numbers, from replay #1):\n  \
                 the ranks agree through replay #116; they diverge at replay #117:\n    rank 2 \
                 STALLED before replay #117"
            ),
            "{text}"
        );
        assert_eq!(cmp.culprits(), vec![2]);
        // One rank's record, with its graph's counters and a replay.
        let record = records[2].to_string();
        assert!(
            record.contains(
                "CUDA graph #1: 14 captured operations (0 collective(s); from #6 to #19 on \
                 stream 0x5002), 116 replay(s)"
            ),
            "{record}"
        );
        assert!(
            record.contains("GraphReplay graph #1 (14 captured operations) replay #116"),
            "{record}"
        );
    }
}
