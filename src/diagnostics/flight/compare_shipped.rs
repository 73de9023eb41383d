//! The shipped kernels' calls compared across ranks, one instance at a time, by the rules
//! NCCL's collectives are compared by (`compare_sequence`, through [`compare_numbered`]),
//! with the instances' ends (see the [module docs](super#shipped-kernels)).

use std::collections::BTreeSet;
use std::fmt;

use super::finding::{write_sequence, Finding, Words};
use super::record::FlightRecord;
use super::sequence::compare_numbered;
use super::shipped::ShippedEnd;

/// What [`compare`](super::compare) found about one instance of shipped kernels: its calls
/// compared across ranks by their own numbers ([`ShippedCall::seq`](super::ShippedCall::seq)),
/// as NCCL's collectives are by theirs. `Display` writes it for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShippedComparison {
    /// The instance's number on the communicator.
    pub instance: u32,
    /// The first of its calls every record still holds.
    pub compared_from: u64,
    /// The last call on which every compared rank agrees (issued, same operation).
    pub agreed_through: u64,
    /// The first call on which they do not, if any.
    pub diverged_at: Option<u64>,
    /// What was found, per rank, in the instance's call numbers: as for collectives
    /// ([`Finding::Skipped`], [`Finding::Stalled`]...), then a [`Finding::GaveUp`] for every
    /// rank whose instance ended without doing its work. A rank that stopped issuing calls
    /// because its kernel gave up (the instance refuses every call since) is reported by the
    /// give-up alone, not as stalled.
    pub findings: Vec<Finding>,
    /// Ranks whose records keep nothing of the instance's calls though they numbered it
    /// ([`FlightRecord::forgot_shipped_instance`]): not compared, ascending.
    pub left_out: Vec<usize>,
}

/// Compares every instance of shipped kernels that some rank called, or whose kernels ended,
/// across `records` (ascending by rank), by ascending instance number.
pub(super) fn compare_shipped(records: &[&FlightRecord]) -> Vec<ShippedComparison> {
    let instances: BTreeSet<u32> = records
        .iter()
        .flat_map(|r| {
            let counted = r
                .shipped
                .iter()
                .filter(|i| i.calls > 0 || i.ended.is_some())
                .map(|i| i.instance);
            let entries = r
                .entries
                .iter()
                .filter_map(|e| e.shipped.map(|s| s.instance));
            counted.chain(entries)
        })
        .collect();
    instances
        .into_iter()
        .map(|instance| compare_instance(records, instance))
        .collect()
}

fn compare_instance(records: &[&FlightRecord], instance: u32) -> ShippedComparison {
    // A rank that keeps nothing of the instance's calls though it numbered it cannot be
    // told from one that never called it: left out (and said so), never blamed.
    let (left, records): (Vec<&FlightRecord>, Vec<&FlightRecord>) = records
        .iter()
        .copied()
        .partition(|r| r.forgot_shipped_instance(instance));
    let records = records.as_slice();
    let verdict = compare_numbered(
        records,
        |e| {
            e.shipped
                .filter(|s| s.instance == instance)
                .and_then(|s| s.seq)
        },
        |r| r.shipped_instance(instance).map(|i| i.calls),
    );
    let ends: Vec<(usize, ShippedEnd)> = records
        .iter()
        .filter_map(|r| {
            r.shipped_instance(instance)
                .and_then(|i| i.ended)
                .map(|end| (r.rank, end))
        })
        .collect();
    // A rank whose kernel gave up refuses every later call of the instance: the calls it
    // never issued are that, not a stall of its own. (A stop is an abort's doing, which
    // comes after a hang: a rank behind is still named.)
    let gave_up_before = |rank: usize, seq: u64| {
        ends.iter().any(|(r, end)| {
            *r == rank && matches!(end, ShippedEnd::GaveUp { after } if after + 1 >= seq)
        })
    };
    let mut findings: Vec<Finding> = verdict
        .findings
        .into_iter()
        .filter(|f| !matches!(f, Finding::Stalled { rank, seq, .. } if gave_up_before(*rank, *seq)))
        .collect();
    findings.extend(
        ends.into_iter()
            .map(|(rank, end)| Finding::GaveUp { rank, end }),
    );
    ShippedComparison {
        instance,
        compared_from: verdict.compared_from,
        agreed_through: verdict.agreed_through,
        diverged_at: verdict.diverged_at,
        findings,
        left_out: left.iter().map(|r| r.rank).collect(),
    }
}

impl fmt::Display for ShippedComparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "LSA instance {} (shipped kernels, by its own call numbers, from call #{}):",
            self.instance, self.compared_from
        )?;
        write_sequence(
            f,
            &Words::SHIPPED,
            "this instance",
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
    use super::super::shipped::ShippedKernel;
    use super::super::synthetic::{record, with_shipped};
    use super::*;

    /// Five all-reduces of NCCL, all completed, on every rank.
    fn nccl(rank: usize, size: usize) -> FlightRecord {
        let ops: Vec<(u64, u64)> = (1..=5).map(|i| (i, 256 * i)).collect();
        record(rank, size, &ops, 5)
    }

    /// Five shipped calls of distinct sizes.
    fn five() -> Vec<(u64, u64)> {
        (1..=5).map(|i| (i, 100 * i)).collect()
    }

    fn skipping(calls: &[(u64, u64)], skip: u64) -> Vec<(u64, u64)> {
        calls
            .iter()
            .filter(|(seq, _)| *seq != skip)
            .enumerate()
            .map(|(i, (_, count))| (i as u64 + 1, *count))
            .collect()
    }

    #[test]
    fn a_rank_that_skipped_a_shipped_call_is_named_while_nccls_collectives_agree() {
        for size in [2, 3, 4] {
            for culprit in 0..size {
                let records: Vec<FlightRecord> = (0..size)
                    .map(|rank| {
                        let calls = if rank == culprit {
                            skipping(&five(), 3)
                        } else {
                            five()
                        };
                        with_shipped(nccl(rank, size), 1, &calls, 4, None)
                    })
                    .collect();
                let cmp = compare(&records).unwrap();
                // NCCL's collectives are compared apart, and agree.
                assert!(cmp.findings.is_empty(), "{cmp}");
                assert_eq!(cmp.diverged_at, None);
                assert_eq!(cmp.shipped.len(), 1, "{cmp}");
                let shipped = &cmp.shipped[0];
                assert_eq!((shipped.instance, shipped.diverged_at), (1, Some(3)));
                assert_eq!(shipped.agreed_through, 2);
                match &shipped.findings[..] {
                    [Finding::Skipped {
                        rank,
                        seq: 3,
                        count: 1,
                        skipped,
                    }] => {
                        assert_eq!(*rank, culprit);
                        assert_eq!(skipped.count, 300);
                        assert_eq!(skipped.shipped.and_then(|s| s.seq), Some(3));
                    }
                    other => panic!("size {size}, culprit {culprit}: {other:?}\n{cmp}"),
                }
                assert_eq!(cmp.culprits(), vec![culprit]);
                assert!(!cmp.is_consistent());
                let text = cmp.to_string();
                assert!(
                    text.contains(&format!(
                        "rank {culprit} SKIPPED call #3 (LsaAllReduce ncclFloat32 x 300 \
                         one-shot-flags): its call #3 is the others' #4"
                    )),
                    "{text}"
                );
                assert!(text.contains("LSA instance 1 (shipped kernels"), "{text}");
            }
        }
    }

    #[test]
    fn a_rank_that_never_issued_a_call_is_stalled_and_the_peer_that_waited_gave_up() {
        // Rank 1 stopped after call 2 of the instance; rank 0 issued call 3, whose kernel
        // gave up waiting for rank 1 (seen at its next call, which the instance refused).
        let records = vec![
            with_shipped(
                nccl(0, 2),
                1,
                &five()[..3],
                3,
                Some(ShippedEnd::GaveUp { after: 3 }),
            ),
            with_shipped(nccl(1, 2), 1, &five()[..2], 2, None),
        ];
        let cmp = compare(&records).unwrap();
        assert!(cmp.findings.is_empty(), "{cmp}");
        assert_eq!(
            cmp.shipped[0].findings,
            vec![
                Finding::Stalled {
                    rank: 1,
                    seq: 3,
                    last_enqueued: 2,
                    last_completed: 2,
                    ahead: vec![0],
                },
                Finding::GaveUp {
                    rank: 0,
                    end: ShippedEnd::GaveUp { after: 3 },
                },
            ],
            "{cmp}"
        );
        // The rank that waited is not blamed.
        assert_eq!(cmp.culprits(), vec![1]);
        let text = cmp.to_string();
        for needle in [
            "rank 1 STALLED before call #3: it issued up to #2 (completed through #2; \
             everything it issued completed: it is stuck outside the instance's kernels)",
            "rank 0: a kernel of its calls #1 to #3 GAVE UP waiting for its peers",
            "nothing amiss: every collective was seen complete",
        ] {
            assert!(text.contains(needle), "{needle:?} in\n{text}");
        }
    }

    #[test]
    fn a_rank_whose_kernel_gave_up_is_not_named_stalled_for_the_calls_it_then_refused() {
        // Rank 0's call 3 gave up (rank 1 came late); rank 1 went on to call 4, which rank 0's
        // instance refused.
        let records = vec![
            with_shipped(
                nccl(0, 2),
                1,
                &five()[..3],
                3,
                Some(ShippedEnd::GaveUp { after: 3 }),
            ),
            with_shipped(nccl(1, 2), 1, &five()[..4], 3, None),
        ];
        let cmp = compare(&records).unwrap();
        assert_eq!(cmp.shipped[0].diverged_at, Some(4));
        assert_eq!(
            cmp.shipped[0].findings,
            vec![Finding::GaveUp {
                rank: 0,
                end: ShippedEnd::GaveUp { after: 3 },
            }],
            "{cmp}"
        );
        assert!(cmp.culprits().is_empty());
        assert!(!cmp.is_consistent());
        // A stop (an abort's doing) excuses nothing: the rank behind is still named.
        let records = vec![
            with_shipped(nccl(0, 2), 1, &five()[..3], 2, None),
            with_shipped(
                nccl(1, 2),
                1,
                &five()[..2],
                2,
                Some(ShippedEnd::Stopped { after: 2 }),
            ),
        ];
        let cmp = compare(&records).unwrap();
        assert!(
            matches!(
                &cmp.shipped[0].findings[..],
                [
                    Finding::Stalled {
                        rank: 1,
                        seq: 3,
                        ..
                    },
                    Finding::GaveUp {
                        rank: 1,
                        end: ShippedEnd::Stopped { after: 2 }
                    }
                ]
            ),
            "{cmp}"
        );
        assert!(cmp.to_string().contains("STOPPED"), "{cmp}");
    }

    #[test]
    fn instances_are_compared_apart_and_an_unfinished_call_is_named() {
        // Instance 1 agrees and completed; instance 2's call 4 was not seen complete on
        // rank 1; instance 3 was created but never called (not listed).
        let records: Vec<FlightRecord> = (0..2)
            .map(|rank| {
                let rec = with_shipped(nccl(rank, 2), 1, &five(), 5, None);
                let rec = with_shipped(rec, 2, &five()[..4], if rank == 1 { 3 } else { 4 }, None);
                with_shipped(rec, 3, &[], 0, None)
            })
            .collect();
        let cmp = compare(&records).unwrap();
        let instances: Vec<u32> = cmp.shipped.iter().map(|s| s.instance).collect();
        assert_eq!(instances, vec![1, 2], "{cmp}");
        assert!(cmp.shipped[0].findings.is_empty());
        assert_eq!(
            cmp.shipped[1].findings,
            vec![Finding::NotCompleted {
                seq: 4,
                ranks: vec![1]
            }]
        );
        let text = cmp.to_string();
        assert!(
            text.contains("all ranks issued the same calls; #4 was not seen complete on ranks [1]"),
            "{text}"
        );
        assert!(
            text.contains("nothing amiss: every call was seen complete"),
            "{text}"
        );
        // Everything complete everywhere: consistent.
        let done: Vec<FlightRecord> = (0..2)
            .map(|rank| with_shipped(nccl(rank, 2), 1, &five(), 5, None))
            .collect();
        assert!(compare(&done).unwrap().is_consistent());
    }

    #[test]
    fn a_rank_behind_the_others_rings_is_named_by_its_instances_counters() {
        // Rank 0 made 40 calls and its ring keeps the last 8; rank 1 stopped after 10, and
        // keeps its last 8 too.
        let calls: Vec<(u64, u64)> = (1..=40).map(|i| (i, 10 + i)).collect();
        let mut ahead = with_shipped(nccl(0, 2), 1, &calls, 40, None);
        ahead
            .entries
            .retain(|e| e.shipped.is_none_or(|s| s.seq > Some(32)));
        let mut behind = with_shipped(nccl(1, 2), 1, &calls[..10], 10, None);
        behind
            .entries
            .retain(|e| e.shipped.is_none_or(|s| s.seq > Some(2)));
        let cmp = compare(&[ahead, behind]).unwrap();
        assert_eq!(cmp.shipped[0].compared_from, 33);
        assert_eq!(
            cmp.shipped[0].findings,
            vec![Finding::Stalled {
                rank: 1,
                seq: 11,
                last_enqueued: 10,
                last_completed: 10,
                ahead: vec![0],
            }],
            "{cmp}"
        );
    }

    /// A rank whose record numbered instance 1 but keeps nothing of its calls (counters
    /// forgotten, none in the ring) is left out of its comparison, not named stalled; a
    /// record from before the count was kept still is.
    #[test]
    fn a_rank_that_forgot_an_instance_is_left_out() {
        let kept = with_shipped(nccl(1, 2), 1, &five(), 5, None);
        let mut forgot = nccl(0, 2);
        forgot.shipped_created = Some(3);
        let cmp = compare(&[forgot.clone(), kept.clone()]).unwrap();
        assert_eq!(cmp.shipped[0].left_out, vec![0], "{cmp}");
        assert!(cmp.is_consistent(), "{cmp}");
        forgot.shipped_created = None;
        let cmp = compare(&[forgot, kept]).unwrap();
        assert_eq!(cmp.culprits(), vec![0], "{cmp}");
    }

    #[test]
    fn a_different_kernel_is_a_mismatch() {
        let records = vec![with_shipped(nccl(0, 2), 1, &five(), 5, None), {
            let mut rec = with_shipped(nccl(1, 2), 1, &five(), 5, None);
            for e in &mut rec.entries {
                if let Some(call) = e.shipped.as_mut().filter(|c| c.seq == Some(2)) {
                    call.kernel = ShippedKernel::TwoShotFlags;
                }
            }
            rec
        }];
        let cmp = compare(&records).unwrap();
        assert!(
            matches!(
                &cmp.shipped[0].findings[..],
                [Finding::Mismatch {
                    rank: 1,
                    seq: 2,
                    ..
                }]
            ),
            "{cmp}"
        );
        assert!(cmp.to_string().contains("two-shot-flags"), "{cmp}");
    }
}
