//! The collectives: nccl-tests' size conventions and bandwidth formulas, and the data check
//! (input pattern, expected output).

use std::rc::Rc;

use nccl::ReduceOp;

use crate::elem::Elem;
use crate::splits::{Splits, VKind, VShape};

/// The operations the benchmark runs (one of nccl-tests' `*_perf` programs each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coll {
    /// `all_reduce_perf`
    AllReduce,
    /// `all_gather_perf`
    AllGather,
    /// `reduce_scatter_perf`
    ReduceScatter,
    /// `broadcast_perf`
    Broadcast,
    /// `reduce_perf`
    Reduce,
    /// `alltoall_perf` (NCCL's own `ncclAlltoAll`, 2.28)
    AllToAll,
    /// `sendrecv_perf`: every rank sends to the next and receives from the previous one
    SendRecv,
    /// The one-sided ring (`--rma`, NCCL 2.29): every rank puts into the next rank's window
    /// (`ncclPutSignal`) and waits for the previous rank's signal (`ncclWaitSignal`)
    PutSignal,
    /// Variable counts per peer (`Comm::all_to_all_v`): grouped send/receive, as the split
    /// matrix (`--splits`) says
    AllToAllV,
    /// Variable counts per rank (`Comm::all_gather_v`)
    AllGatherV,
    /// Variable counts per rank (`Comm::reduce_scatter_v`)
    ReduceScatterV,
}

impl Coll {
    /// Every collective.
    pub const ALL: [Coll; 11] = [
        Coll::AllReduce,
        Coll::AllGather,
        Coll::ReduceScatter,
        Coll::Broadcast,
        Coll::Reduce,
        Coll::AllToAll,
        Coll::SendRecv,
        Coll::PutSignal,
        Coll::AllToAllV,
        Coll::AllGatherV,
        Coll::ReduceScatterV,
    ];

    /// The name used on the command line and in the output.
    pub fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::AllGather => "all_gather",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::AllToAll => "alltoall",
            Coll::SendRecv => "sendrecv",
            Coll::PutSignal => "put_signal",
            Coll::AllToAllV => "all_to_all_v",
            Coll::AllGatherV => "all_gather_v",
            Coll::ReduceScatterV => "reduce_scatter_v",
        }
    }

    /// Parses a name: `all_reduce`, `allreduce`, `all_reduce_perf`, `all-reduce`, ...
    pub fn parse(text: &str) -> Option<Coll> {
        let key: String = text
            .to_ascii_lowercase()
            .trim_end_matches("_perf")
            .chars()
            .filter(|c| *c != '_' && *c != '-')
            .collect();
        Some(match key.as_str() {
            "allreduce" => Coll::AllReduce,
            "allgather" => Coll::AllGather,
            "reducescatter" => Coll::ReduceScatter,
            "broadcast" | "bcast" => Coll::Broadcast,
            "reduce" => Coll::Reduce,
            "alltoall" | "a2a" => Coll::AllToAll,
            "sendrecv" | "p2p" => Coll::SendRecv,
            "putsignal" | "rma" => Coll::PutSignal,
            "alltoallv" | "a2av" => Coll::AllToAllV,
            "allgatherv" => Coll::AllGatherV,
            "reducescatterv" => Coll::ReduceScatterV,
            _ => return None,
        })
    }

    /// Whether the operation takes a reduction operator.
    pub fn has_redop(self) -> bool {
        matches!(
            self,
            Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce | Coll::ReduceScatterV
        )
    }

    /// Whether the operation has a root.
    pub fn has_root(self) -> bool {
        matches!(self, Coll::Broadcast | Coll::Reduce)
    }

    /// Whether an in-place form exists (NCCL has none for all-to-all; a send/receive between
    /// one buffer and itself cannot be expressed with the safe API's borrows, nor a put from
    /// a window into itself while it waits).
    pub fn has_in_place(self) -> bool {
        !matches!(
            self,
            Coll::AllToAll | Coll::SendRecv | Coll::PutSignal | Coll::AllToAllV
        )
    }

    /// Whether it is a v-collective (counts from `--splits`).
    pub fn is_v(self) -> bool {
        matches!(
            self,
            Coll::AllToAllV | Coll::AllGatherV | Coll::ReduceScatterV
        )
    }

    /// nccl-tests' bus bandwidth factor for `n` ranks (doc/PERFORMANCE.md). The
    /// v-collectives' own factor follows their split matrix ([`VShape::new`]); this is its
    /// value for even splits.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather
            | Coll::ReduceScatter
            | Coll::AllToAll
            | Coll::AllToAllV
            | Coll::AllGatherV
            | Coll::ReduceScatterV => (n - 1.0) / n,
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv | Coll::PutSignal => 1.0,
        }
    }

    /// Buffer lengths for a size of `bytes`, nccl-tests' way: the size is the whole buffer
    /// (the receive buffer of all-gather, the send buffer of reduce-scatter, either buffer of
    /// all-to-all), rounded down to whole elements and, where it is split over the ranks, to
    /// a multiple of `n` elements.
    ///
    /// The v-collectives take the size of their fixed-size counterpart (all_to_all_v: each
    /// rank's send buffer, as alltoall; all_gather_v: the receive buffer; reduce_scatter_v:
    /// the send buffer), rounded the same way, so `alltoall` and `all_to_all_v --splits even`
    /// move the same bytes in rows of the same size; `split` says how that total is split
    /// (`rank` is this rank, whose own buffers the layout describes).
    pub fn layout(
        self,
        bytes: usize,
        elem_size: usize,
        n: usize,
        rank: usize,
        split: SplitSpec,
    ) -> Layout {
        let elements = bytes / elem_size;
        let per_rank = elements / n;
        let (count, send_len, recv_len) = match self {
            Coll::AllReduce | Coll::Broadcast | Coll::Reduce | Coll::SendRecv | Coll::PutSignal => {
                (elements, elements, elements)
            }
            Coll::AllGather => (per_rank, per_rank, per_rank * n),
            Coll::ReduceScatter => (per_rank, per_rank * n, per_rank),
            Coll::AllToAll => (per_rank, per_rank * n, per_rank * n),
            Coll::AllToAllV => return v_layout(VKind::AllToAll, per_rank, n, rank, split),
            Coll::AllGatherV => return v_layout(VKind::AllGather, per_rank, n, rank, split),
            Coll::ReduceScatterV => {
                return v_layout(VKind::ReduceScatter, per_rank, n, rank, split)
            }
        };
        Layout {
            count,
            send_len,
            recv_len,
            total: send_len.max(recv_len),
            span: send_len.max(recv_len),
            bus_factor: self.bus_factor(n),
            v: None,
        }
    }
}

/// [`Coll::layout`] of a v-collective: `per_rank * n` elements split as `split` says.
fn v_layout(kind: VKind, per_rank: usize, n: usize, rank: usize, split: SplitSpec) -> Layout {
    let total = per_rank * n;
    let shape = VShape::new(kind, split.splits, total, n, rank, split.seed);
    let (send_len, recv_len) = match kind {
        VKind::AllToAll => (total, shape.recv.total()),
        VKind::AllGather => (shape.recv.counts()[rank], total),
        VKind::ReduceScatter => (total, shape.send.counts()[rank]),
    };
    let bus_factor = if total > 0 {
        shape.bus_elems as f64 / total as f64
    } else {
        (n as f64 - 1.0) / n as f64
    };
    Layout {
        count: per_rank,
        send_len,
        recv_len,
        total,
        span: send_len.max(recv_len),
        bus_factor,
        v: Some(Rc::new(shape)),
    }
}

/// How the v-collectives split their totals (`--splits`, `--seed`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitSpec {
    /// Even or Zipf.
    pub splits: Splits,
    /// The seed of the split matrix (the same on every rank).
    pub seed: u64,
}

/// The buffers of one operation, in elements.
#[derive(Debug, Clone)]
pub struct Layout {
    /// NCCL's `count` argument (per rank for all-gather, reduce-scatter and all-to-all), the
    /// "count" column.
    pub count: usize,
    /// Elements sent by each rank.
    pub send_len: usize,
    /// Elements received by each rank.
    pub recv_len: usize,
    /// The "size" column and the bytes of algbw: the larger of the two, or for a
    /// v-collective the total its fixed-size counterpart would have.
    pub total: usize,
    /// Elements of either buffer one operation touches from its offset: the larger of
    /// `send_len` and `recv_len` (a rank may receive more than it sends under Zipf splits).
    pub span: usize,
    /// busbw / algbw: nccl-tests' factor, or for a v-collective the bytes its busiest rank
    /// moves over the total ([`VShape::new`]).
    pub bus_factor: f64,
    /// The split matrix and this rank's layouts, for a v-collective.
    pub v: Option<Rc<VShape>>,
}

/// Positions after which the input pattern repeats (a prime, so that no power-of-two block
/// boundary lines up with it).
const PERIOD: usize = 4099;

/// The check's data: a deterministic, rank-dependent input for every rank, chosen so every
/// reduction result is exactly representable (small integers; products of ones and twos).
#[derive(Debug, Clone)]
pub struct Pattern {
    inputs: Vec<Vec<f64>>,
    reduced: Vec<f64>,
}

impl Pattern {
    /// The inputs of `n` ranks for the reduction `op` (`None`: no reduction), and their
    /// reduction.
    pub fn new(n: usize, op: Option<ReduceOp>, seed: u64) -> Self {
        let prod = op == Some(ReduceOp::Prod);
        let inputs: Vec<Vec<f64>> = (0..n)
            .map(|rank| {
                (0..PERIOD)
                    .map(|p| {
                        let h = mix(seed ^ ((rank as u64) << 40) ^ p as u64);
                        if prod {
                            // Mostly ones, sometimes a two: products stay small powers of two.
                            if h.is_multiple_of(8) {
                                2.0
                            } else {
                                1.0
                            }
                        } else {
                            // 1..=3: never 0, so a zeroed output never passes for a result.
                            1.0 + (h % 3) as f64
                        }
                    })
                    .collect()
            })
            .collect();
        let reduced = (0..PERIOD)
            .map(|p| {
                let values = inputs.iter().map(|input| input[p]);
                match op.unwrap_or(ReduceOp::Sum) {
                    ReduceOp::Sum | ReduceOp::Avg => values.sum(),
                    ReduceOp::Prod => values.product(),
                    ReduceOp::Max => values.fold(f64::MIN, f64::max),
                    ReduceOp::Min => values.fold(f64::MAX, f64::min),
                }
            })
            .collect();
        Pattern { inputs, reduced }
    }

    /// Rank `rank`'s input at element `index` of its send buffer.
    pub fn input(&self, rank: usize, index: usize) -> f64 {
        self.inputs[rank][index % PERIOD]
    }

    /// The reduction over all ranks at element `index`.
    pub fn reduced(&self, index: usize) -> f64 {
        self.reduced[index % PERIOD]
    }

    /// Rank `rank`'s first `len` input elements.
    pub fn host_input<T: Elem>(&self, rank: usize, len: usize) -> Vec<T> {
        let period: Vec<T> = self.inputs[rank].iter().map(|&v| T::from_f64(v)).collect();
        period.iter().copied().cycle().take(len).collect()
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What one rank must find in its output after one operation.
#[derive(Debug, Clone, Copy)]
pub struct Expect<'p> {
    /// The pattern the inputs came from.
    pub pattern: &'p Pattern,
    /// The operation.
    pub coll: Coll,
    /// The reduction (ignored without one).
    pub op: ReduceOp,
    /// The root of broadcast and reduce.
    pub root: usize,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub n: usize,
    /// The layout.
    pub layout: &'p Layout,
}

impl Expect<'_> {
    /// The expected value of output element `i` (the output being the receive buffer, or the
    /// rank's result block of an in-place reduce-scatter), before conversion to the element
    /// type.
    pub fn value(&self, i: usize) -> f64 {
        let count = self.layout.count.max(1);
        let reduce = |index: usize| {
            let v = self.pattern.reduced(index);
            if self.op == ReduceOp::Avg {
                v / self.n as f64
            } else {
                v
            }
        };
        match self.coll {
            Coll::AllReduce | Coll::Reduce => reduce(i),
            Coll::ReduceScatter => reduce(self.rank * self.layout.count + i),
            Coll::AllGather => self.pattern.input(i / count, i % count),
            Coll::AllToAll => self
                .pattern
                .input(i / count, self.rank * self.layout.count + i % count),
            Coll::Broadcast => self.pattern.input(self.root, i),
            Coll::SendRecv | Coll::PutSignal => {
                self.pattern.input((self.rank + self.n - 1) % self.n, i)
            }
            Coll::AllToAllV | Coll::AllGatherV | Coll::ReduceScatterV => self.v_value(i),
        }
    }

    /// [`Expect::value`] of a v-collective: the receive buffer's segment `p` holds what rank
    /// `p` sent this rank (all-to-all: from its segment for this rank; all-gather: its whole
    /// send buffer); reduce-scatter's result is this rank's segment of the reduction. NaN
    /// (never right) where nothing is expected.
    fn v_value(&self, i: usize) -> f64 {
        let Some(v) = self.layout.v.as_deref() else {
            return f64::NAN;
        };
        match v.kind {
            VKind::AllToAll => v.source(&v.recv, i).map_or(f64::NAN, |(from, k)| {
                self.pattern.input(from, v.send_displ(from, self.rank) + k)
            }),
            VKind::AllGather => v
                .source(&v.recv, i)
                .map_or(f64::NAN, |(from, k)| self.pattern.input(from, k)),
            VKind::ReduceScatter => {
                let v = self.pattern.reduced(v.send.displs()[self.rank] + i);
                if self.op == ReduceOp::Avg {
                    v / self.n as f64
                } else {
                    v
                }
            }
        }
    }

    /// Counts the elements of `got` that differ from the expected output. Integers must
    /// match exactly (integer averages truncate, as the conversion does); floating-point
    /// results may differ by a few rounding steps, as NCCL may reduce in any order and
    /// averages through a scaling.
    pub fn count_wrong<T: Elem>(&self, got: &[T]) -> u64 {
        // Each of the n - 1 additions rounds by at most EPS/2 of the partial sum (inputs are
        // positive), and so does the conversion of the expected value: (n + 1) * EPS/2 of the
        // result covers both with room to spare. Products, maxima and minima are exact.
        let tolerance = T::EPS * (self.n as f64 + 1.0) / 2.0;
        got.iter()
            .enumerate()
            .filter(|&(i, &v)| {
                let want = T::from_f64(self.value(i)).to_f64();
                let err = (v.to_f64() - want).abs();
                let right = err <= tolerance * want.abs().max(1.0);
                // NaN fails the comparison, so it counts as wrong.
                !right
            })
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::splits::Splits;

    fn spec(splits: Splits) -> SplitSpec {
        SplitSpec { splits, seed: 3 }
    }

    #[test]
    fn even_all_to_all_v_is_alltoall_at_equal_bytes() {
        for (bytes, n) in [(1 << 20, 2), (1000, 3), (8, 8)] {
            let fixed = Coll::AllToAll.layout(bytes, 4, n, 0, spec(Splits::Even));
            for rank in 0..n {
                let v = Coll::AllToAllV.layout(bytes, 4, n, rank, spec(Splits::Even));
                assert_eq!(
                    (v.count, v.send_len, v.recv_len, v.total, v.span),
                    (
                        fixed.count,
                        fixed.send_len,
                        fixed.recv_len,
                        fixed.total,
                        fixed.span
                    )
                );
                assert!((v.bus_factor - fixed.bus_factor).abs() < 1e-12 || v.total == 0);
            }
        }
    }

    /// What every rank receives, computed by moving the inputs as the matrix says (not with
    /// `Expect`'s formulas), must pass `Expect`'s check; one wrong element must not.
    #[test]
    fn the_check_expects_what_the_matrix_moves() {
        let n = 3;
        let pattern = Pattern::new(n, None, 11);
        let layouts: Vec<Layout> = (0..n)
            .map(|r| Coll::AllToAllV.layout(4000, 4, n, r, spec(Splits::Zipf(1.2))))
            .collect();
        let matrix = layouts[0].v.as_ref().unwrap().matrix.clone();
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| pattern.host_input(r, layouts[r].send_len))
            .collect();
        for (me, layout) in layouts.iter().enumerate() {
            let mut got = Vec::new();
            for (from, input) in inputs.iter().enumerate() {
                let start: usize = matrix[from][..me].iter().sum();
                got.extend_from_slice(&input[start..start + matrix[from][me]]);
            }
            assert_eq!(got.len(), layout.recv_len);
            let expect = Expect {
                pattern: &pattern,
                coll: Coll::AllToAllV,
                op: ReduceOp::Sum,
                root: 0,
                rank: me,
                n,
                layout,
            };
            assert_eq!(expect.count_wrong(&got), 0, "rank {me}");
            got[layout.recv_len / 2] += 1.0;
            assert_eq!(expect.count_wrong(&got), 1, "rank {me}");
        }

        // all_gather_v: every rank's whole input, in rank order.
        let gather = Coll::AllGatherV.layout(4000, 4, n, 1, spec(Splits::Zipf(1.2)));
        let counts = gather.v.as_ref().unwrap().matrix[0].clone();
        let got: Vec<f32> = (0..n)
            .flat_map(|r| pattern.host_input::<f32>(r, counts[r]))
            .collect();
        let expect = Expect {
            pattern: &pattern,
            coll: Coll::AllGatherV,
            op: ReduceOp::Sum,
            root: 0,
            rank: 1,
            n,
            layout: &gather,
        };
        assert_eq!(gather.send_len, counts[1]);
        assert_eq!(expect.count_wrong(&got), 0);

        // reduce_scatter_v: this rank's segment of the reduction.
        let scatter = Coll::ReduceScatterV.layout(4000, 4, n, 2, spec(Splits::Zipf(1.2)));
        let start: usize = counts[..2].iter().sum();
        let got: Vec<f32> = (start..start + counts[2])
            .map(|i| pattern.reduced(i) as f32)
            .collect();
        let expect = Expect {
            coll: Coll::ReduceScatterV,
            rank: 2,
            layout: &scatter,
            ..expect
        };
        assert_eq!(scatter.recv_len, counts[2]);
        assert_eq!(expect.count_wrong(&got), 0);
        assert!(expect.count_wrong(&got[1..]) > 0 || counts[2] < 2);
    }
}
