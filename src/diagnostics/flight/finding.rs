//! What [`compare`](super::compare) finds about a rank ([`Finding`]), and how a finding is
//! written, in the words of NCCL's collectives, of a shipped instance's calls or of a CUDA
//! graph's replays, with the verdict on one sequence that holds them ([`write_sequence`]).

use std::fmt;

use super::record::FlightEntry;
use super::shipped::ShippedEnd;

/// What the analyser found about one rank (or, for [`Finding::NotCompleted`], a set of ranks).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finding {
    /// `rank` skipped `count` collectives starting at collective `seq`: its collective `seq`
    /// is the others' `seq + count`. `skipped` is the first one it skipped.
    Skipped {
        /// The rank that skipped.
        rank: usize,
        /// The first collective it skipped.
        seq: u64,
        /// How many it skipped.
        count: u64,
        /// The others' collective `seq`.
        skipped: FlightEntry,
    },
    /// `rank` issued `count` collectives the others did not, starting at collective `seq`.
    Extra {
        /// The rank that issued them.
        rank: usize,
        /// Its first extra collective.
        seq: u64,
        /// How many.
        count: u64,
        /// Its collective `seq`.
        extra: FlightEntry,
    },
    /// `rank`'s collective `seq` differs from the others' with no shift explaining it.
    Mismatch {
        /// The rank out of step.
        rank: usize,
        /// The collective number.
        seq: u64,
        /// The others' collective `seq`.
        expected: FlightEntry,
        /// This rank's.
        found: FlightEntry,
    },
    /// `rank` never issued collective `seq`, which `ahead` did: it stopped issuing (a host-side
    /// stall when `last_completed == last_enqueued`, else stuck in its last collective).
    Stalled {
        /// The rank behind.
        rank: usize,
        /// The first collective it never issued.
        seq: u64,
        /// Its last collective issued (0: none).
        last_enqueued: u64,
        /// Its last collective seen complete (0: none).
        last_completed: u64,
        /// The ranks that issued collective `seq`.
        ahead: Vec<usize>,
    },
    /// `rank` issued collectives from `seq` on (`count` of them) that most of the compared
    /// ranks, `behind`, never issued, though everything they issued completed: by majority,
    /// this rank issued extra collectives at the end, which the records cannot tell apart from
    /// the others stalling outside NCCL (the finding says so).
    Ahead {
        /// The rank ahead.
        rank: usize,
        /// The first collective only the ranks ahead issued.
        seq: u64,
        /// How many collectives it issued from `seq` on.
        count: u64,
        /// Its collective `seq`.
        first: FlightEntry,
        /// The ranks that never issued collective `seq`.
        behind: Vec<usize>,
        /// Whether everything the ranks behind issued was seen complete (always, today: where
        /// it was not, the first collective not seen complete is reported instead).
        behind_idle: bool,
    },
    /// Every rank issued the same collectives, but collective `seq` was not seen complete on
    /// `ranks` (it may have completed unseen where no watchdog or synchronize looked).
    NotCompleted {
        /// The first collective not seen complete everywhere.
        seq: u64,
        /// The ranks where it was not.
        ranks: Vec<usize>,
    },
    /// On `rank`, an instance of shipped kernels ended without doing its work (only in a
    /// [`ShippedComparison`](super::ShippedComparison)): a kernel gave up waiting for its
    /// peers, or an abort stopped them. Blames no one: the rank waited for a peer that the
    /// other findings name, or that died or was descheduled past the instance's timeout.
    GaveUp {
        /// The rank whose instance ended.
        rank: usize,
        /// How, and after how many of its calls.
        end: ShippedEnd,
    },
    /// No record of `rank` was given.
    NoRecord {
        /// The rank.
        rank: usize,
    },
}

impl Finding {
    /// The rank the finding blames, if it blames one.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Finding::Skipped { rank, .. }
            | Finding::Extra { rank, .. }
            | Finding::Mismatch { rank, .. }
            | Finding::Stalled { rank, .. }
            | Finding::Ahead { rank, .. }
            | Finding::NoRecord { rank } => Some(*rank),
            Finding::NotCompleted { .. } | Finding::GaveUp { .. } => None,
        }
    }
}

impl fmt::Display for Finding {
    /// In the words of NCCL's collectives; a [`ShippedComparison`](super::ShippedComparison)
    /// writes its findings in its instance's calls, a
    /// [`GraphComparison`](super::GraphComparison) in its graph's replays.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, &Words::COLLECTIVES)
    }
}

/// The words a finding is written in: NCCL's collectives, a shipped instance's calls, or a
/// CUDA graph's replays.
pub(super) struct Words {
    /// One of the compared operations: `collective`, `call`.
    pub(super) one: &'static str,
    /// Several.
    pub(super) many: &'static str,
    /// What a rank stuck between them is outside of.
    pub(super) outside: &'static str,
}

impl Words {
    pub(super) const COLLECTIVES: Words = Words {
        one: "collective",
        many: "collectives",
        outside: "NCCL",
    };
    pub(super) const SHIPPED: Words = Words {
        one: "call",
        many: "calls",
        outside: "the instance's kernels",
    };
    pub(super) const REPLAYS: Words = Words {
        one: "replay",
        many: "replays",
        outside: "the graph",
    };
}

/// A finding written in some words.
struct InWords<'f>(&'f Finding, &'f Words);

impl fmt::Display for InWords<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.write(f, self.1)
    }
}

/// Writes the verdict on one numbered sequence of `what` (a graph's replays, an instance's
/// calls): the ranks left out of it (their records keep nothing of it), then where the
/// compared ranks agree and diverge and what was found; nothing more where no rank was
/// compared.
pub(super) fn write_sequence(
    f: &mut fmt::Formatter<'_>,
    words: &Words,
    what: &str,
    left_out: &[usize],
    agreed_through: u64,
    diverged_at: Option<u64>,
    findings: &[Finding],
) -> fmt::Result {
    if !left_out.is_empty() {
        writeln!(
            f,
            "  ranks {left_out:?} left out: their records keep nothing of {what} (its counters \
             forgotten), so they cannot be compared"
        )?;
        if agreed_through == 0 && diverged_at.is_none() && findings.is_empty() {
            return Ok(());
        }
    }
    let one = words.one;
    match diverged_at {
        Some(seq) => writeln!(
            f,
            "  the ranks agree through {one} #{agreed_through}; they diverge at {one} #{seq}:"
        )?,
        None => writeln!(
            f,
            "  the ranks agree on every {one} (through #{agreed_through})"
        )?,
    }
    for finding in findings {
        writeln!(f, "    {}", InWords(finding, words))?;
    }
    if findings.is_empty() {
        writeln!(f, "    nothing amiss: every {one} was seen complete")?;
    }
    Ok(())
}

impl Finding {
    /// Writes the finding in `words`.
    pub(super) fn write(&self, f: &mut fmt::Formatter<'_>, words: &Words) -> fmt::Result {
        let Words { one, many, outside } = words;
        match self {
            Finding::Skipped {
                rank,
                seq,
                count,
                skipped,
            } => {
                let which = if *count == 1 {
                    format!("{one} #{seq}")
                } else {
                    format!("{many} #{seq} to #{}", seq + count - 1)
                };
                write!(
                    f,
                    "rank {rank} SKIPPED {which} ({}): its {one} #{seq} is the others' #{}",
                    skipped.describe(),
                    seq + count
                )
            }
            Finding::Extra {
                rank,
                seq,
                count,
                extra,
            } => write!(
                f,
                "rank {rank} issued {count} EXTRA {one}(s) from #{seq} ({}): its #{} is \
                 the others' #{seq}",
                extra.describe(),
                seq + count
            ),
            Finding::Mismatch {
                rank,
                seq,
                expected,
                found,
            } => write!(
                f,
                "rank {rank} MISMATCH at {one} #{seq}: it issued {}, the others {}",
                found.describe(),
                expected.describe()
            ),
            Finding::Stalled {
                rank,
                seq,
                last_enqueued,
                last_completed,
                ahead,
            } => {
                let where_ = if last_enqueued == last_completed {
                    format!("everything it issued completed: it is stuck outside {outside}")
                } else {
                    format!("its last {one} did not complete")
                };
                write!(
                    f,
                    "rank {rank} STALLED before {one} #{seq}: it issued up to #{last_enqueued} \
                     (completed through #{last_completed}; {where_}) while ranks {ahead:?} issued \
                     #{seq}"
                )
            }
            Finding::Ahead {
                rank,
                seq,
                count,
                first,
                behind,
                behind_idle,
            } => {
                let why = if *behind_idle {
                    format!(
                        "everything they issued completed: rank {rank} issued extra \
                         {one}(s), or ranks {behind:?} stalled outside {outside}"
                    )
                } else {
                    format!("their last {many} did not complete")
                };
                write!(
                    f,
                    "rank {rank} AHEAD: it issued {count} {one}(s) from #{seq} ({}) that \
                     ranks {behind:?}, most of the ranks compared, never issued; {why}",
                    first.describe()
                )
            }
            Finding::NotCompleted { seq, ranks } => write!(
                f,
                "all ranks issued the same {many}; #{seq} was not seen complete on ranks \
                 {ranks:?}"
            ),
            Finding::GaveUp { rank, end } => write!(f, "rank {rank}: {end}"),
            Finding::NoRecord { rank } => write!(f, "rank {rank}: no flight record"),
        }
    }
}
