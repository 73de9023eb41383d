//! The analyser: given the flight records of the ranks of one communicator, where do they
//! diverge, and which rank is to blame
//! (the rules are in the [flight module docs](super#comparing-ranks)).
//!
//! The rules compare numbered operations of any one sequence (`compare_sequence`, in
//! `sequence.rs`, through [`compare_numbered`]): NCCL's collectives here, each shipped
//! instance's calls in `compare_shipped.rs`, each CUDA graph's replays in `compare_graph.rs`.

use std::fmt;
use std::path::Path;

use super::compare_graph::{compare_graphs, GraphComparison};
use super::compare_shipped::{compare_shipped, ShippedComparison};
use super::finding::Finding;
use super::record::FlightRecord;
use super::sequence::compare_numbered;
use crate::error::{Error, Result};

/// What [`compare`] found; `Display` writes it for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlightComparison {
    /// The communicator's size.
    pub size: usize,
    /// The ranks whose records were compared, ascending.
    pub ranks: Vec<usize>,
    /// The first collective every record still holds (rings keep only the last entries).
    pub compared_from: u64,
    /// The last collective on which every compared rank agrees (issued, same operation).
    pub agreed_through: u64,
    /// The first collective on which they do not, if any.
    pub diverged_at: Option<u64>,
    /// What was found, per rank, about NCCL's collectives.
    pub findings: Vec<Finding>,
    /// The shipped kernels' calls, compared per instance (see the
    /// [module docs](super#shipped-kernels)), by ascending instance number.
    pub shipped: Vec<ShippedComparison>,
    /// The CUDA graphs' replays, compared per graph (see the
    /// [module docs](super#cuda-graphs)), by ascending graph number.
    pub graphs: Vec<GraphComparison>,
}

impl FlightComparison {
    /// The ranks the findings blame (about NCCL's collectives, the shipped calls and the
    /// graphs' replays), ascending, each once.
    pub fn culprits(&self) -> Vec<usize> {
        let mut ranks: Vec<usize> = self.all_findings().filter_map(Finding::rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }

    /// Whether nothing is amiss: the ranks agree, every collective, shipped call and graph
    /// replay was seen complete, and no shipped kernel gave up.
    pub fn is_consistent(&self) -> bool {
        self.all_findings().next().is_none()
    }

    /// Every finding: NCCL's collectives', then each shipped instance's, then each graph's.
    fn all_findings(&self) -> impl Iterator<Item = &Finding> {
        let shipped = self.shipped.iter().flat_map(|s| &s.findings);
        let graphs = self.graphs.iter().flat_map(|g| &g.findings);
        self.findings.iter().chain(shipped).chain(graphs)
    }
}

/// Compares the flight records of the ranks of one communicator (one record per rank, in any
/// order; ranks without a record are reported as such) and says where they diverge; see the
/// [flight module docs](super#comparing-ranks). [`Error::FlightRecordFormat`] when there is no record, or the records
/// disagree on the communicator's size or name ([`CommConfig::comm_name`](crate::CommConfig::comm_name),
/// where both have one), or two are of the same rank. Records carry no other identity of their
/// communicator: records of two unnamed communicators of one size are compared as one.
pub fn compare(records: &[FlightRecord]) -> Result<FlightComparison> {
    let size = records
        .first()
        .map(|r| r.size)
        .ok_or_else(|| Error::FlightRecordFormat("no flight record to compare".into()))?;
    let mut sorted: Vec<&FlightRecord> = Vec::with_capacity(records.len());
    for record in records {
        if record.size != size {
            return Err(Error::FlightRecordFormat(format!(
                "the records are of communicators of different sizes ({size} and {}): compare \
                 the records of one communicator",
                record.size
            )));
        }
        if record.rank >= size {
            return Err(Error::FlightRecordFormat(format!(
                "a record of rank {} in a communicator of {size} ranks",
                record.rank
            )));
        }
        if let Some(other) = sorted.iter().find_map(|r| {
            r.name
                .as_ref()
                .zip(record.name.as_ref())
                .filter(|(a, b)| a != b)
        }) {
            return Err(Error::FlightRecordFormat(format!(
                "the records are of communicators named {:?} and {:?}: compare the records of \
                 one communicator",
                other.0, other.1
            )));
        }
        if sorted.iter().any(|r| r.rank == record.rank) {
            return Err(Error::FlightRecordFormat(format!(
                "two records of rank {}",
                record.rank
            )));
        }
        sorted.push(record);
    }
    sorted.sort_by_key(|r| r.rank);
    let mut findings: Vec<Finding> = (0..size)
        .filter(|rank| !sorted.iter().any(|r| r.rank == *rank))
        .map(|rank| Finding::NoRecord { rank })
        .collect();
    let verdict = compare_numbered(&sorted, |e| e.collective_seq, |r| Some(r.collectives));
    findings.extend(verdict.findings);
    Ok(FlightComparison {
        size,
        ranks: sorted.iter().map(|r| r.rank).collect(),
        compared_from: verdict.compared_from,
        agreed_through: verdict.agreed_through,
        diverged_at: verdict.diverged_at,
        findings,
        shipped: compare_shipped(&sorted),
        graphs: compare_graphs(&sorted),
    })
}

/// Reads flight records from JSON files (as [`FlightRecord::write_to`] writes them).
pub fn read_flight_records(
    paths: impl IntoIterator<Item = impl AsRef<Path>>,
) -> Result<Vec<FlightRecord>> {
    paths
        .into_iter()
        .map(|path| {
            let path = path.as_ref();
            let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
                what: format!("reading the flight record {}", path.display()),
                source,
            })?;
            FlightRecord::from_json(&text).map_err(|err| match err {
                Error::FlightRecordFormat(why) => {
                    Error::FlightRecordFormat(format!("{}: {why}", path.display()))
                }
                other => other,
            })
        })
        .collect()
}

impl fmt::Display for FlightComparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "compared the flight records of ranks {:?} of {}, from collective #{}",
            self.ranks, self.size, self.compared_from
        )?;
        match self.diverged_at {
            Some(seq) => writeln!(
                f,
                "the ranks agree through collective #{}; they diverge at collective #{seq}:",
                self.agreed_through
            )?,
            None => writeln!(
                f,
                "the ranks agree on every collective (through #{})",
                self.agreed_through
            )?,
        }
        for finding in &self.findings {
            writeln!(f, "  {finding}")?;
        }
        if self.findings.is_empty() {
            writeln!(f, "  nothing amiss: every collective was seen complete")?;
        }
        for instance in &self.shipped {
            write!(f, "{instance}")?;
        }
        for graph in &self.graphs {
            write!(f, "{graph}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::synthetic::{record, record_with};
    use super::*;
    use crate::diagnostics::flight::OpKind;

    /// Five all-reduces of distinct sizes (1, 2, 3, 4, 5 KiB of f32).
    fn five() -> Vec<(u64, u64)> {
        (1..=5).map(|i| (i, 256 * i)).collect()
    }

    /// A rank's ops after skipping collective `skip` of `ops`: numbered again from 1.
    fn skipping(ops: &[(u64, u64)], skip: u64) -> Vec<(u64, u64)> {
        ops.iter()
            .filter(|(seq, _)| *seq != skip)
            .enumerate()
            .map(|(i, (_, count))| (i as u64 + 1, *count))
            .collect()
    }

    #[test]
    fn a_rank_that_skips_the_third_of_five_all_reduces_is_named() {
        let ops = five();
        for size in [2, 3, 4, 8] {
            for culprit in 0..size {
                let records: Vec<FlightRecord> = (0..size)
                    .map(|rank| {
                        if rank == culprit {
                            // Its later all-reduces met the others' earlier ones: all done.
                            record(rank, size, &skipping(&ops, 3), 4)
                        } else {
                            // The others: the fifth never completes (rank `culprit` has none).
                            record(rank, size, &ops, 4)
                        }
                    })
                    .collect();
                let cmp = compare(&records).unwrap();
                assert_eq!(cmp.diverged_at, Some(3), "{cmp}");
                assert_eq!(cmp.agreed_through, 2);
                assert_eq!(cmp.culprits(), vec![culprit], "{cmp}");
                match &cmp.findings[..] {
                    [Finding::Skipped {
                        rank,
                        seq: 3,
                        count: 1,
                        skipped,
                    }] => {
                        assert_eq!(*rank, culprit);
                        assert_eq!(skipped.count, 768);
                    }
                    other => panic!("size {size}, culprit {culprit}: {other:?}\n{cmp}"),
                }
                assert!(cmp.to_string().contains("SKIPPED collective #3"), "{cmp}");
            }
        }
    }

    #[test]
    fn a_rank_that_stalls_before_the_third_is_told_apart_from_one_that_skips() {
        let ops = five();
        for size in [2, 4] {
            let records: Vec<FlightRecord> = (0..size)
                .map(|rank| {
                    if rank == 1 {
                        record(rank, size, &ops[..2], 2)
                    } else {
                        record(rank, size, &ops, 2)
                    }
                })
                .collect();
            let cmp = compare(&records).unwrap();
            assert_eq!(cmp.diverged_at, Some(3));
            match &cmp.findings[..] {
                [Finding::Stalled {
                    rank: 1,
                    seq: 3,
                    last_enqueued: 2,
                    last_completed: 2,
                    ahead,
                }] => {
                    let others: Vec<usize> = (0..size).filter(|&r| r != 1).collect();
                    assert_eq!(ahead, &others);
                }
                other => panic!("{other:?}\n{cmp}"),
            }
            let text = cmp.to_string();
            assert!(
                text.contains("rank 1 STALLED before collective #3"),
                "{text}"
            );
            assert!(text.contains("stuck outside NCCL"), "{text}");
        }
        // Stuck inside its own last collective instead.
        let records = vec![record(0, 2, &ops, 1), record(1, 2, &ops[..2], 1)];
        let text = compare(&records).unwrap().to_string();
        assert!(text.contains("did not complete"), "{text}");
    }

    #[test]
    fn a_minority_that_issued_one_more_at_the_end_is_named_ahead() {
        let ops = five();
        let mut six = ops.clone();
        six.push((6, 999));
        // Rank 1 of 4 issued a sixth all-reduce the others never issue; theirs all completed.
        let records: Vec<FlightRecord> = (0..4)
            .map(|rank| {
                if rank == 1 {
                    record(rank, 4, &six, 5)
                } else {
                    record(rank, 4, &ops, 5)
                }
            })
            .collect();
        let cmp = compare(&records).unwrap();
        assert_eq!(cmp.diverged_at, Some(6), "{cmp}");
        assert_eq!(cmp.culprits(), vec![1], "{cmp}");
        match &cmp.findings[..] {
            [Finding::Ahead {
                rank: 1,
                seq: 6,
                count: 1,
                first,
                behind,
                behind_idle: true,
            }] => {
                assert_eq!(first.count, 999);
                assert_eq!(behind, &vec![0, 2, 3]);
            }
            other => panic!("{other:?}\n{cmp}"),
        }
        let text = cmp.to_string();
        assert!(text.contains("rank 1 AHEAD"), "{text}");
        assert!(
            text.contains("or ranks [0, 2, 3] stalled outside NCCL"),
            "{text}"
        );
        // The others still inside #5 (not seen complete): nobody is blamed, #5 is named.
        let records: Vec<FlightRecord> = (0..4)
            .map(|rank| {
                if rank == 1 {
                    record(rank, 4, &six, 4)
                } else {
                    record(rank, 4, &ops, 4)
                }
            })
            .collect();
        let cmp = compare(&records).unwrap();
        assert_eq!(
            cmp.findings,
            vec![Finding::NotCompleted {
                seq: 5,
                ranks: vec![0, 1, 2, 3]
            }],
            "{cmp}"
        );
        assert!(cmp.culprits().is_empty());
        // Two ranks: no majority, the one behind is named as before.
        let records = vec![record(0, 2, &ops, 5), record(1, 2, &six, 5)];
        let cmp = compare(&records).unwrap();
        assert!(
            matches!(
                cmp.findings[..],
                [Finding::Stalled {
                    rank: 0,
                    seq: 6,
                    ..
                }]
            ),
            "{cmp}"
        );
    }

    #[test]
    fn a_rank_behind_the_others_rings_is_named_stalled_not_agreeing() {
        // Ranks 0 and 2 issued 1..=1063 and keep the last 64; rank 1 stopped at 500.
        let far: Vec<(u64, u64)> = (1000..=1063).map(|i| (i, 256 + i)).collect();
        let near: Vec<(u64, u64)> = (437..=500).map(|i| (i, 256 + i)).collect();
        let records = vec![
            record(0, 3, &far, 1063),
            record(1, 3, &near, 500),
            record(2, 3, &far, 1063),
        ];
        let cmp = compare(&records).unwrap();
        assert_eq!(cmp.diverged_at, Some(501), "{cmp}");
        assert_eq!(cmp.agreed_through, 500, "{cmp}");
        match &cmp.findings[..] {
            [Finding::Stalled {
                rank: 1,
                seq: 501,
                last_enqueued: 500,
                last_completed: 500,
                ahead,
            }] => assert_eq!(ahead, &vec![0, 2]),
            other => panic!("{other:?}\n{cmp}"),
        }
    }

    #[test]
    fn records_of_differently_named_communicators_are_refused() {
        let ops = five();
        let mut a = record(0, 2, &ops, 5);
        let mut b = record(1, 2, &ops, 5);
        a.name = Some("tp".into());
        b.name = Some("dp".into());
        match compare(&[a.clone(), b.clone()]) {
            Err(Error::FlightRecordFormat(why)) => assert!(why.contains("\"dp\""), "{why}"),
            other => panic!("{other:?}"),
        }
        // One unnamed record is compared with a named one.
        b.name = None;
        assert!(compare(&[a, b]).unwrap().is_consistent());
    }

    #[test]
    fn identical_all_reduces_make_a_skip_look_like_a_stall_at_the_end() {
        let same: Vec<(u64, u64)> = (1..=5).map(|i| (i, 256)).collect();
        let records = vec![record(0, 2, &same, 4), record(1, 2, &skipping(&same, 3), 4)];
        let cmp = compare(&records).unwrap();
        assert_eq!(cmp.diverged_at, Some(5));
        assert!(matches!(
            cmp.findings[..],
            [Finding::Stalled {
                rank: 1,
                seq: 5,
                ..
            }]
        ));
    }

    #[test]
    fn extra_collectives_mismatches_and_missing_records() {
        let ops = five();
        // Rank 2 issued an extra all-reduce of 100 elements before the third.
        let mut extra = ops[..2].to_vec();
        extra.push((3, 100));
        extra.extend(ops[2..].iter().map(|(s, c)| (s + 1, *c)));
        let records = vec![
            record(0, 4, &ops, 2),
            record(1, 4, &ops, 2),
            record(2, 4, &extra, 2),
        ];
        let cmp = compare(&records).unwrap();
        assert_eq!(cmp.culprits(), vec![2, 3]);
        assert!(cmp.findings.contains(&Finding::NoRecord { rank: 3 }));
        assert!(cmp.findings.iter().any(|f| matches!(
            f,
            Finding::Extra {
                rank: 2,
                seq: 3,
                count: 1,
                ..
            }
        )));
        // A different count with nothing shifted: a mismatch.
        let mut odd = ops.clone();
        odd[2].1 = 7;
        let records = vec![record(0, 2, &ops, 2), record(1, 2, &odd, 2)];
        let cmp = compare(&records).unwrap();
        // Two ranks, one each: the tie goes to the lower rank.
        assert!(
            matches!(&cmp.findings[..], [Finding::Mismatch { rank: 1, seq: 3, found, expected }]
                if found.count == 7 && expected.count == 768),
            "{cmp}"
        );
        // A different kind counts too.
        let records = vec![
            record(0, 2, &ops, 5),
            record_with(1, 2, &ops, 5, |e| {
                if e.collective_seq == Some(4) {
                    e.kind = OpKind::ReduceScatter;
                }
            }),
        ];
        let cmp = compare(&records).unwrap();
        assert_eq!(cmp.diverged_at, Some(4));
    }

    #[test]
    fn agreeing_ranks_report_the_first_collective_not_seen_complete() {
        let ops = five();
        let records = vec![
            record(0, 3, &ops, 5),
            record(1, 3, &ops, 3),
            record(2, 3, &ops, 3),
        ];
        let cmp = compare(&records).unwrap();
        assert_eq!(cmp.diverged_at, None);
        assert_eq!(cmp.agreed_through, 5);
        assert_eq!(
            cmp.findings,
            vec![Finding::NotCompleted {
                seq: 4,
                ranks: vec![1, 2]
            }]
        );
        let done = vec![record(0, 2, &ops, 5), record(1, 2, &ops, 5)];
        let cmp = compare(&done).unwrap();
        assert!(cmp.is_consistent(), "{cmp}");
        assert!(cmp.to_string().contains("nothing amiss"));
    }

    #[test]
    fn rings_that_kept_different_spans_are_compared_where_they_overlap() {
        let ops: Vec<(u64, u64)> = (1..=20).map(|i| (i, 10 * i)).collect();
        let mut short = record(1, 2, &ops, 20);
        short.entries.drain(..12); // its ring kept only the last 8
        let cmp = compare(&[record(0, 2, &ops, 20), short]).unwrap();
        assert_eq!(cmp.compared_from, 13);
        assert!(cmp.is_consistent(), "{cmp}");
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let ops = five();
        for (records, needle) in [
            (vec![], "no flight record"),
            (
                vec![record(0, 2, &ops, 0), record(1, 3, &ops, 0)],
                "different sizes",
            ),
            (
                vec![record(0, 2, &ops, 0), record(0, 2, &ops, 0)],
                "two records of rank 0",
            ),
            (vec![record(5, 2, &ops, 0)], "rank 5"),
        ] {
            match compare(&records) {
                Err(Error::FlightRecordFormat(why)) => assert!(why.contains(needle), "{why}"),
                other => panic!("{needle}: {other:?}"),
            }
        }
        let err = read_flight_records(["/nonexistent/flight.json"]).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
    }

    #[test]
    fn sends_and_receives_are_not_compared() {
        let ops = five();
        let with_p2p = |rank: usize| {
            let mut rec = record(rank, 2, &ops, 5);
            let mut p2p = rec.entries[0].clone();
            p2p.collective_seq = None;
            p2p.kind = if rank == 0 {
                OpKind::Send
            } else {
                OpKind::Recv
            };
            p2p.peer = Some(1 - rank);
            p2p.reduction = None;
            rec.entries.insert(2, p2p);
            rec
        };
        let cmp = compare(&[with_p2p(0), with_p2p(1)]).unwrap();
        assert!(cmp.is_consistent(), "{cmp}");
    }

    /// What the README shows: the analyser's output on synthetic records of four ranks, rank
    /// 2 having skipped the third of five all-reduces (and, second, stalled before it).
    #[test]
    fn readme_example_output() {
        let ops = five();
        let skip: Vec<FlightRecord> = (0..4)
            .map(|rank| {
                if rank == 2 {
                    record(rank, 4, &skipping(&ops, 3), 4)
                } else {
                    record(rank, 4, &ops, 2)
                }
            })
            .collect();
        let stall: Vec<FlightRecord> = (0..4)
            .map(|rank| {
                let kept = if rank == 2 { &ops[..2] } else { &ops[..] };
                record(rank, 4, kept, 2)
            })
            .collect();
        let skip = compare(&skip).unwrap().to_string();
        let stall = compare(&stall).unwrap().to_string();
        println!("{skip}\n{stall}");
        assert!(skip.contains("rank 2 SKIPPED collective #3 (AllReduce ncclFloat32 x 768 sum)"));
        assert!(stall.contains("rank 2 STALLED before collective #3"));
    }
}
