//! The rules that compare the ranks' numbered operations of any one sequence
//! ([`compare_sequence`], reached through [`compare_numbered`]): NCCL's collectives
//! (`compare.rs`), one shipped instance's calls (`compare_shipped.rs`) or one CUDA graph's
//! replays (`compare_graph.rs`); see the [module docs](super#comparing-ranks).

use std::collections::BTreeMap;

use super::finding::Finding;
use super::record::{FlightEntry, FlightRecord, OpState};

/// How far a skip or an extra collective is looked for.
const MAX_SHIFT: u64 = 8;
/// How many collectives after the divergence must follow a shift for it to count.
const CONFIRM: u64 = 8;

/// One rank's operations of one sequence (collectives, one instance's calls, one graph's
/// replays), by number.
struct RankOps<'r> {
    rank: usize,
    ops: BTreeMap<u64, &'r FlightEntry>,
    /// Its last operation issued (0: none).
    last: u64,
    /// Its last operation seen complete (0: none).
    last_completed: u64,
}

impl<'r> RankOps<'r> {
    /// Rank `rank`'s operations `ops`, numbered, of which it issued `last` (more than the
    /// ring may still hold).
    fn new(rank: usize, ops: impl IntoIterator<Item = (u64, &'r FlightEntry)>, last: u64) -> Self {
        let ops: BTreeMap<u64, &FlightEntry> = ops.into_iter().collect();
        let last_completed = ops
            .iter()
            .filter(|(_, e)| e.state == OpState::Completed)
            .map(|(seq, _)| *seq)
            .max()
            .unwrap_or(0);
        RankOps {
            rank,
            ops,
            last,
            last_completed,
        }
    }

    fn at(&self, seq: u64) -> Option<&'r FlightEntry> {
        self.ops.get(&seq).copied()
    }

    /// The first collective the ring still holds (past `last` when it holds none).
    fn first_kept(&self) -> u64 {
        self.ops
            .keys()
            .next()
            .copied()
            .unwrap_or(self.last.saturating_add(1))
    }
}

/// What comparing one sequence found (see [`FlightComparison`](super::FlightComparison)'s fields of the same names).
pub(super) struct Verdict {
    pub(super) compared_from: u64,
    pub(super) agreed_through: u64,
    pub(super) diverged_at: Option<u64>,
    pub(super) findings: Vec<Finding>,
}

/// Compares one numbered sequence of `records` (ascending by rank): `number` is an entry's
/// number in the sequence (`None`: not in it, or it took no number), `counted` a record's
/// counter of the sequence (its last number given), where the record keeps one; without one,
/// the largest number its ring holds.
pub(super) fn compare_numbered(
    records: &[&FlightRecord],
    number: impl Fn(&FlightEntry) -> Option<u64>,
    counted: impl Fn(&FlightRecord) -> Option<u64>,
) -> Verdict {
    let ranks: Vec<RankOps<'_>> = records
        .iter()
        .map(|record| {
            let ops: Vec<(u64, &FlightEntry)> = record
                .entries
                .iter()
                .filter_map(|e| number(e).map(|seq| (seq, e)))
                .collect();
            let last = counted(record)
                .unwrap_or_else(|| ops.iter().map(|(seq, _)| *seq).max().unwrap_or(0));
            RankOps::new(record.rank, ops, last)
        })
        .collect();
    compare_sequence(&ranks)
}

/// Compares the ranks' operations of one sequence (collectives, one instance's calls, one
/// graph's replays) by the rules of the [module docs](super#comparing-ranks); `ranks`
/// ascending.
fn compare_sequence(ranks: &[RankOps<'_>]) -> Verdict {
    let compared_from = ranks.iter().map(RankOps::first_kept).max().unwrap_or(1);
    let max_last = ranks.iter().map(|r| r.last).max().unwrap_or(0);
    let min_last = ranks.iter().map(|r| r.last).min().unwrap_or(0);
    if min_last.saturating_add(1) < compared_from {
        // A rank stopped before the first collective every ring still holds: nothing of it
        // can be compared, and it is behind the others by more than their rings keep.
        let seq = min_last.saturating_add(1);
        let ahead: Vec<usize> = ranks
            .iter()
            .filter(|r| r.last >= seq)
            .map(|r| r.rank)
            .collect();
        let findings = ranks
            .iter()
            .filter(|r| r.last == min_last)
            .map(|r| Finding::Stalled {
                rank: r.rank,
                seq,
                last_enqueued: r.last,
                last_completed: r.last_completed,
                ahead: ahead.clone(),
            })
            .collect();
        return Verdict {
            compared_from,
            agreed_through: min_last,
            diverged_at: Some(seq),
            findings,
        };
    }

    let mut agreed_through = compared_from.saturating_sub(1);
    let mut diverged_at = None;
    for seq in compared_from..=max_last {
        let first = ranks.first().and_then(|r| r.at(seq));
        let agree = first.is_some_and(|first| {
            ranks
                .iter()
                .all(|r| r.at(seq).is_some_and(|op| op.same_operation(first)))
        });
        if !agree {
            diverged_at = Some(seq);
            break;
        }
        agreed_through = seq;
    }
    let findings = match diverged_at {
        Some(seq) => diverging(ranks, seq),
        None => not_completed(ranks, compared_from, max_last)
            .into_iter()
            .collect(),
    };
    Verdict {
        compared_from,
        agreed_through,
        diverged_at,
        findings,
    }
}

/// The first collective (from `from` to `to`) not seen complete on every rank.
fn not_completed(ranks: &[RankOps<'_>], from: u64, to: u64) -> Option<Finding> {
    (from..=to).find_map(|seq| {
        let incomplete: Vec<usize> = ranks
            .iter()
            .filter(|r| r.at(seq).is_some_and(|op| op.state != OpState::Completed))
            .map(|r| r.rank)
            .collect();
        (!incomplete.is_empty()).then_some(Finding::NotCompleted {
            seq,
            ranks: incomplete,
        })
    })
}

/// Whether `a` from `a_at` and `b` from `b_at` hold the same operations for as far as both
/// have them (at most [`CONFIRM`] more after the first), the first included.
fn follows(a: &RankOps<'_>, a_at: u64, b: &RankOps<'_>, b_at: u64) -> bool {
    let same = |i: u64| match (a.at(a_at.saturating_add(i)), b.at(b_at.saturating_add(i))) {
        (Some(x), Some(y)) => Some(x.same_operation(y)),
        _ => None,
    };
    match same(0) {
        Some(true) => (1..=CONFIRM).map_while(same).all(|s| s),
        _ => false,
    }
}

/// The findings at collective `seq`, where the ranks first disagree.
fn diverging(ranks: &[RankOps<'_>], seq: u64) -> Vec<Finding> {
    // The ranks holding an operation at `seq`, grouped by it (each group by its first rank).
    let mut groups: Vec<Vec<&RankOps<'_>>> = Vec::new();
    for rank in ranks.iter().filter(|r| r.at(seq).is_some()) {
        let op = rank.at(seq);
        match groups.iter_mut().find(|g| {
            g[0].at(seq)
                .zip(op)
                .is_some_and(|(a, b)| a.same_operation(b))
        }) {
            Some(group) => group.push(rank),
            None => groups.push(vec![rank]),
        }
    }
    // The reference: the largest group; on a tie, one whose later collectives another
    // group's collective `seq` matches (that one skipped); then the lowest rank.
    let explains = |g: &[&RankOps<'_>], others: &[Vec<&RankOps<'_>>]| {
        others
            .iter()
            .any(|o| (1..=MAX_SHIFT).any(|k| follows(o[0], seq, g[0], seq.saturating_add(k))))
    };
    let reference = groups
        .iter()
        .enumerate()
        .max_by_key(|(i, g)| {
            (
                g.len(),
                explains(g, &groups),
                std::cmp::Reverse(g[0].rank),
                std::cmp::Reverse(*i),
            )
        })
        .map(|(_, g)| g.clone());
    let Some(reference) = reference else {
        return Vec::new();
    };
    let model = reference[0];
    let ahead: Vec<usize> = ranks
        .iter()
        .filter(|r| r.at(seq).is_some())
        .map(|r| r.rank)
        .collect();
    let behind: Vec<&RankOps<'_>> = ranks.iter().filter(|r| r.at(seq).is_none()).collect();
    // Most ranks never issued `seq` and the few that did agree on it: by majority, those few
    // issued extra collectives at the end (the others' records end where theirs agree).
    if behind.len() > ahead.len() && groups.len() == 1 {
        let behind_idle = behind.iter().all(|r| r.last_completed == r.last);
        if !behind_idle {
            // Everyone is still inside an earlier collective and a faster host merely queued
            // the next one: blame nobody, name the first collective not seen complete.
            let from = ranks.iter().map(RankOps::first_kept).max().unwrap_or(1);
            if let Some(finding) = not_completed(ranks, from, seq.saturating_sub(1)) {
                return vec![finding];
            }
        }
        let behind: Vec<usize> = behind.iter().map(|r| r.rank).collect();
        return reference
            .iter()
            .filter_map(|r| {
                r.at(seq).map(|first| Finding::Ahead {
                    rank: r.rank,
                    seq,
                    count: r.last.saturating_add(1).saturating_sub(seq).max(1),
                    first: first.clone(),
                    behind: behind.clone(),
                    behind_idle,
                })
            })
            .collect();
    }
    let mut findings = Vec::new();
    for rank in ranks {
        if reference.iter().any(|r| r.rank == rank.rank) {
            continue;
        }
        let Some(found) = rank.at(seq) else {
            findings.push(Finding::Stalled {
                rank: rank.rank,
                seq,
                last_enqueued: rank.last,
                last_completed: rank.last_completed,
                ahead: ahead.clone(),
            });
            continue;
        };
        let Some(expected) = model.at(seq) else {
            continue;
        };
        let finding = if let Some(k) =
            (1..=MAX_SHIFT).find(|&k| follows(rank, seq, model, seq.saturating_add(k)))
        {
            Finding::Skipped {
                rank: rank.rank,
                seq,
                count: k,
                skipped: expected.clone(),
            }
        } else if let Some(k) =
            (1..=MAX_SHIFT).find(|&k| follows(rank, seq.saturating_add(k), model, seq))
        {
            Finding::Extra {
                rank: rank.rank,
                seq,
                count: k,
                extra: found.clone(),
            }
        } else {
            Finding::Mismatch {
                rank: rank.rank,
                seq,
                expected: expected.clone(),
                found: found.clone(),
            }
        };
        findings.push(finding);
    }
    findings
}
