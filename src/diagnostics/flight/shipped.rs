//! The flight record of the kernels this crate ships ([`LsaAllReduce`](crate::device::LsaAllReduce)):
//! which kernel a recorded call launched ([`ShippedKernel`]), where it stands among its
//! instance's calls ([`ShippedCall`]), and each instance's counters and end ([`ShippedInstance`],
//! [`ShippedEnd`]). The rules are in the [flight module docs](super#shipped-kernels).

use std::fmt;

use super::op_kind::OpKind;
use super::ring::{InstanceRow, RawEnd, RawShipped};
use crate::dtype::DataType;

/// The kernel a shipped call launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ShippedKernel {
    /// The one-shot all-reduce without a barrier
    /// ([`LsaAlgorithm::OneShotFlags`](crate::device::LsaAlgorithm::OneShotFlags)).
    OneShotFlags,
    /// The one-shot all-reduce with a barrier
    /// ([`LsaAlgorithm::OneShotBarrier`](crate::device::LsaAlgorithm::OneShotBarrier)).
    OneShotBarrier,
    /// The two-shot all-reduce
    /// ([`LsaAlgorithm::TwoShotFlags`](crate::device::LsaAlgorithm::TwoShotFlags)).
    TwoShotFlags,
    /// The all-gather ([`LsaAllReduce::all_gather`](crate::device::LsaAllReduce::all_gather)).
    AllGather,
    /// The epilogue's all-reduce, residual add and RMSNorm in one kernel
    /// ([`LsaEpilogue::Fused`](crate::device::LsaEpilogue::Fused)).
    FusedAddRmsNorm,
    /// The epilogue's residual add and RMSNorm alone, after its all-reduce (which is recorded
    /// on its own): a kernel of this rank only, waiting for no peer.
    AddRmsNorm,
    /// [`ExpertExchange::dispatch`](crate::device::ExpertExchange::dispatch)'s kernel.
    ExpertDispatch,
    /// [`ExpertExchange::combine`](crate::device::ExpertExchange::combine)'s kernel.
    ExpertCombine,
}

impl ShippedKernel {
    const ALL: [ShippedKernel; 8] = [
        ShippedKernel::OneShotFlags,
        ShippedKernel::OneShotBarrier,
        ShippedKernel::TwoShotFlags,
        ShippedKernel::AllGather,
        ShippedKernel::FusedAddRmsNorm,
        ShippedKernel::AddRmsNorm,
        ShippedKernel::ExpertDispatch,
        ShippedKernel::ExpertCombine,
    ];

    /// The name in records and dumps (`one-shot-flags`, `one-shot-barrier`,
    /// `two-shot-flags`, `all-gather`, `fused-add-rms-norm`, `add-rms-norm`,
    /// `expert-dispatch`, `expert-combine`).
    pub fn name(self) -> &'static str {
        match self {
            ShippedKernel::OneShotFlags => "one-shot-flags",
            ShippedKernel::OneShotBarrier => "one-shot-barrier",
            ShippedKernel::TwoShotFlags => "two-shot-flags",
            ShippedKernel::AllGather => "all-gather",
            ShippedKernel::FusedAddRmsNorm => "fused-add-rms-norm",
            ShippedKernel::AddRmsNorm => "add-rms-norm",
            ShippedKernel::ExpertDispatch => "expert-dispatch",
            ShippedKernel::ExpertCombine => "expert-combine",
        }
    }

    /// The kernel named `name` (as [`ShippedKernel::name`] writes it).
    pub fn from_name(name: &str) -> Option<ShippedKernel> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The call that launches it: [`OpKind::LsaAllReduce`], [`OpKind::LsaAllGather`] or
    /// [`OpKind::LsaAddRmsNorm`] of [`LsaAllReduce`](crate::device::LsaAllReduce),
    /// [`OpKind::LsaExpertDispatch`] or [`OpKind::LsaExpertCombine`] of
    /// [`ExpertExchange`](crate::device::ExpertExchange).
    pub fn kind(self) -> OpKind {
        match self {
            ShippedKernel::OneShotFlags
            | ShippedKernel::OneShotBarrier
            | ShippedKernel::TwoShotFlags => OpKind::LsaAllReduce,
            ShippedKernel::AllGather => OpKind::LsaAllGather,
            ShippedKernel::FusedAddRmsNorm | ShippedKernel::AddRmsNorm => OpKind::LsaAddRmsNorm,
            ShippedKernel::ExpertDispatch => OpKind::LsaExpertDispatch,
            ShippedKernel::ExpertCombine => OpKind::LsaExpertCombine,
        }
    }

    pub(crate) fn tag(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_raw(raw: u8) -> Option<ShippedKernel> {
        Self::ALL.get(usize::from(raw)).copied()
    }
}

/// Where a recorded launch of a shipped kernel stands among its instance's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShippedCall {
    /// The instance's number on the communicator, from 1 in creation order: instances are
    /// created collectively, in the same order on every rank, so the same number is the same
    /// instance on every rank.
    pub instance: u32,
    /// Its number among the instance's calls, from 1 (ranks are compared by it); `None` where
    /// the launch failed (it never ran, so it takes no number) or the instance's counters
    /// were forgotten.
    pub seq: Option<u64>,
    /// The kernel it launched.
    pub kernel: ShippedKernel,
}

/// How an instance's kernels ended without doing their work. The kernel that did cannot be
/// named from the host: it returns either way, so the stream's completion covers it (an
/// entry seen [`Completed`](super::OpState::Completed) may be this one). From then on the
/// instance refuses every call, so its calls end at `after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShippedEnd {
    /// A kernel of one of calls #1 to #`after` gave up waiting for its peers (after the
    /// instance's timeout): its output, and that of every later call, is wrong.
    GaveUp {
        /// The instance's calls when its owner saw the give-up.
        after: u64,
    },
    /// An abort, revoke or shrink of the communicator, or the owner's drop, stopped its
    /// kernels when it had issued `after` calls: those not yet run return without their work.
    Stopped {
        /// The instance's calls when its kernels were stopped.
        after: u64,
    },
}

impl ShippedEnd {
    /// The instance's calls when the end was marked.
    pub fn after(self) -> u64 {
        match self {
            ShippedEnd::GaveUp { after } | ShippedEnd::Stopped { after } => after,
        }
    }

    /// The name in records and dumps (`gave up`, `stopped`).
    pub fn name(self) -> &'static str {
        match self {
            ShippedEnd::GaveUp { .. } => "gave up",
            ShippedEnd::Stopped { .. } => "stopped",
        }
    }

    /// The end named `name` (as [`ShippedEnd::name`] writes it) after `after` calls.
    pub fn from_name(name: &str, after: u64) -> Option<ShippedEnd> {
        match name {
            "gave up" => Some(ShippedEnd::GaveUp { after }),
            "stopped" => Some(ShippedEnd::Stopped { after }),
            _ => None,
        }
    }
}

impl fmt::Display for ShippedEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ShippedEnd::GaveUp { after } => write!(
                f,
                "a kernel of its calls #1 to #{after} GAVE UP waiting for its peers (its \
                 output and every later one wrong; the instance refuses calls since)"
            ),
            ShippedEnd::Stopped { after } => write!(
                f,
                "its kernels were STOPPED (abort, revoke or drop) after call #{after}"
            ),
        }
    }
}

/// One instance of shipped kernels on the communicator: its counters, which outlive what the
/// ring keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShippedInstance {
    /// Its number on the communicator (see [`ShippedCall::instance`]).
    pub instance: u32,
    /// Its calls recorded so far (its last call number).
    pub calls: u64,
    /// How its kernels ended, if they did without doing their work.
    pub ended: Option<ShippedEnd>,
    /// Whether its owner was dropped.
    pub dropped: bool,
}

impl ShippedInstance {
    pub(crate) fn from_row(row: &InstanceRow) -> ShippedInstance {
        ShippedInstance {
            instance: row.instance,
            calls: row.calls,
            ended: row.ended.map(|(how, after)| match how {
                RawEnd::GaveUp => ShippedEnd::GaveUp { after },
                RawEnd::Stopped => ShippedEnd::Stopped { after },
            }),
            dropped: row.dropped,
        }
    }
}

impl fmt::Display for ShippedInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LSA instance {}: {} call(s){}",
            self.instance,
            self.calls,
            if self.dropped { ", dropped" } else { "" }
        )?;
        if let Some(end) = self.ended {
            write!(f, "; {end}")?;
        }
        Ok(())
    }
}

impl RawShipped {
    /// A launch of `kernel` by instance `instance`, on `count` elements per rank of `dtype`
    /// on the raw stream `stream`; `refused` where the launch failed.
    #[inline(always)]
    pub(crate) fn launch(
        instance: u32,
        kernel: ShippedKernel,
        dtype: DataType,
        count: usize,
        stream: u64,
        refused: bool,
    ) -> RawShipped {
        RawShipped {
            instance,
            tag: kernel.kind().tag(),
            kernel: kernel.tag(),
            // Data types number 0 to 11.
            dtype: dtype.raw().0.min(255) as u8,
            count,
            stream,
            refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Instant, SystemTime};

    use super::super::record::{FlightRecord, OpState, Who};
    use super::super::ring::FlightRing;
    use super::*;

    fn launch(instance: u32, kernel: ShippedKernel, count: usize, refused: bool) -> RawShipped {
        RawShipped::launch(instance, kernel, DataType::Bfloat16, count, 7, refused)
    }

    /// The whole path: the ring, its snapshot, the record, its text and its JSON.
    #[test]
    fn shipped_calls_get_their_instances_numbers_states_and_ends() {
        let mut ring = FlightRing::new(16, 7, Some("tp".into())).unwrap();
        let (a, b) = (ring.new_shipped_instance(), ring.new_shipped_instance());
        assert_eq!((a, b), (1, 2));
        let nccl = super::super::ring::RawOp {
            kind: super::super::ring::RawKind {
                tag: OpKind::AllReduce.tag(),
                rank: super::super::ring::NO_RANK,
            },
            collective: true,
            count: 1,
            dtype: 7,
            op: 0,
            stream: 7,
            in_group: false,
            refused: false,
        };
        ring.record(nccl); // #1, collective 1
        ring.record_shipped(launch(a, ShippedKernel::TwoShotFlags, 64, false)); // #2, L1.1
        ring.record_shipped(launch(b, ShippedKernel::AllGather, 32, false)); // #3, L2.1
        ring.record_shipped(launch(a, ShippedKernel::FusedAddRmsNorm, 64, true)); // #4, L1.-
        ring.record_shipped(launch(a, ShippedKernel::AddRmsNorm, 16, false)); // #5, L1.2
        ring.record(nccl); // #6, collective 2
        ring.shipped_gave_up(a);
        ring.shipped_stopped(a); // the first end is kept
        ring.shipped_stopped(b);
        ring.shipped_instance_dropped(b);
        ring.shipped_gave_up(9); // no such instance: nothing
        ring.completed_before(4);
        let snap = ring.snapshot();
        assert_eq!((snap.recorded, snap.collectives), (6, 2));
        let who = Who {
            rank: 1,
            size: 2,
            device: 0,
        };
        let now = (Instant::now(), SystemTime::now());
        let rec = FlightRecord::from_snapshot(snap, who, "test".into(), now.0, now.1);
        let seen: Vec<_> = rec
            .entries
            .iter()
            .map(|e| (e.kind, e.collective_seq, e.shipped, e.state))
            .collect();
        let call = |instance, seq, kernel| {
            Some(ShippedCall {
                instance,
                seq,
                kernel,
            })
        };
        use OpState::{Completed, Enqueued, Refused};
        assert_eq!(
            seen,
            vec![
                (OpKind::AllReduce, Some(1), None, Completed),
                (
                    OpKind::LsaAllReduce,
                    None,
                    call(1, Some(1), ShippedKernel::TwoShotFlags),
                    Completed
                ),
                (
                    OpKind::LsaAllGather,
                    None,
                    call(2, Some(1), ShippedKernel::AllGather),
                    Completed
                ),
                (
                    OpKind::LsaAddRmsNorm,
                    None,
                    call(1, None, ShippedKernel::FusedAddRmsNorm),
                    Refused
                ),
                (
                    OpKind::LsaAddRmsNorm,
                    None,
                    call(1, Some(2), ShippedKernel::AddRmsNorm),
                    Enqueued
                ),
                (OpKind::AllReduce, Some(2), None, Enqueued),
            ]
        );
        let shipped = &rec.entries[1];
        assert_eq!(shipped.dtype, Some(DataType::Bfloat16));
        assert_eq!(
            (shipped.root, shipped.peer, shipped.reduction),
            (None, None, None)
        );
        assert_eq!(
            shipped.describe(),
            "LsaAllReduce ncclBfloat16 x 64 two-shot-flags"
        );
        assert_eq!(
            rec.shipped,
            vec![
                ShippedInstance {
                    instance: 1,
                    calls: 2,
                    ended: Some(ShippedEnd::GaveUp { after: 2 }),
                    dropped: false,
                },
                ShippedInstance {
                    instance: 2,
                    calls: 1,
                    ended: Some(ShippedEnd::Stopped { after: 1 }),
                    dropped: true,
                },
            ]
        );
        assert_eq!(rec.shipped_calls(1).count(), 3);
        let text = rec.to_string();
        for needle in [
            "L1.1 ",
            "L1.- ",
            "L2.1 ",
            "c2 ",
            "LSA instance 1: 2 call(s); a kernel of its calls #1 to #2 GAVE UP",
            "LSA instance 2: 1 call(s), dropped; its kernels were STOPPED",
        ] {
            assert!(text.contains(needle), "{needle:?} in\n{text}");
        }
        assert_eq!(FlightRecord::from_json(&rec.to_json()).unwrap(), rec);
    }

    #[test]
    fn names_read_back() {
        for kernel in ShippedKernel::ALL {
            assert_eq!(ShippedKernel::from_name(kernel.name()), Some(kernel));
            assert_eq!(ShippedKernel::from_raw(kernel.tag()), Some(kernel));
            assert!(kernel.kind().is_shipped());
        }
        for end in [
            ShippedEnd::GaveUp { after: 3 },
            ShippedEnd::Stopped { after: 3 },
        ] {
            assert_eq!(ShippedEnd::from_name(end.name(), 3), Some(end));
        }
        assert_eq!(ShippedKernel::from_raw(200), None);
    }
}
