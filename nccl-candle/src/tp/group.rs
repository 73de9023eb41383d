//! The ranks a tensor-parallel layer is split over, and the collectives that join its parts.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use nccl::diagnostics::flight::{GraphCaptureMark, RecordedGraph};
use nccl::{Comm, ReduceOp};

use super::epilogue;
use super::expert_exchange::{ExpertSet, ExpertsKey};
use crate::agree::{judge, Verdict};
use crate::gather::gather_along;
use crate::{Error, Result};

/// The collectives tensor parallelism needs, over the ranks of a group. Implemented for
/// [`Comm`] (NCCL, CUDA tensors) and [`ThreadedCollectives`](super::ThreadedCollectives)
/// (ranks on threads of one process, any device).
///
/// As with NCCL, every rank must call the same collectives in the same order with tensors
/// of the same shape and type.
pub trait Collectives {
    /// This rank, in `0..size()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// The reduction of every rank's `tensor` (contiguous), as a new tensor of its shape.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// Every rank's `tensor` (contiguous), concatenated along the first dimension in rank
    /// order.
    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor>;

    /// The epilogue of a row-parallel layer: `partial` (this rank's partial output,
    /// `[.., hidden]`) summed over the ranks and added to `residual` (its shape, the same on
    /// every rank), then RMSNorm of that with `weight` (`[hidden]`) and `eps`. Returns
    /// `(new residual, normed)`, both of `partial`'s shape; `partial` and `residual` are left
    /// as they were.
    ///
    /// Provided as the unfused sequence: [`all_reduce`](Self::all_reduce) (sum), candle's
    /// add and `candle_nn::ops::rms_norm` (`x · rsqrt(mean(x²) + eps) · weight`).
    /// [`LsaCollectives`](super::LsaCollectives) overrides it with one fused kernel where the
    /// tensors fit. Refused before any collective, with [`Error::Shape`] or
    /// [`Error::Argument`], when `partial` and `residual` differ in shape, `weight` is not
    /// `[hidden]`, or the three differ in element type.
    fn all_reduce_add_rms_norm(
        &self,
        partial: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        epilogue::check("all_reduce_add_rms_norm", partial, residual, weight)?;
        epilogue::unfused(self, partial, residual, weight, eps)
    }

    /// Marks one end of a CUDA stream capture in the flight recorder of the communicator
    /// these collectives run on ([`Comm::graph_capture_mark`]); `None` where there is none
    /// (the provided method: collectives without a communicator).
    fn graph_capture_mark(&self) -> Option<GraphCaptureMark> {
        None
    }

    /// Records a CUDA graph captured on `stream` between `began` and `ended` in that flight
    /// recorder ([`Comm::record_graph`]), so that its replays are recorded and compared
    /// across ranks; `None` where there is none.
    fn record_graph(
        &self,
        began: GraphCaptureMark,
        ended: GraphCaptureMark,
        stream: u64,
    ) -> Option<RecordedGraph> {
        let _ = (began, ended, stream);
        None
    }

    /// Gives back what a capture on `stream` between `began` and `ended` numbered in that
    /// flight recorder, for a capture the ranks refused ([`Comm::discard_capture`]).
    fn discard_capture(&self, began: GraphCaptureMark, ended: GraphCaptureMark, stream: u64) {
        let _ = (began, ended, stream);
    }

    /// The communicator these collectives run on, for nccl-rs's kernels that take one (the
    /// mixture-of-experts exchange); `None` where there is none (the provided method).
    fn comm(&self) -> Option<&Comm> {
        None
    }

    /// How long nccl-rs's kernels made for these collectives wait for their peers before
    /// giving up, where the collectives set one
    /// ([`LsaCollectives::kernel_timeout`](super::LsaCollectives::kernel_timeout)); the
    /// group's expert exchanges take it too. `None`: the kernels' default (the provided
    /// method).
    fn kernel_timeout(&self) -> Option<Duration> {
        None
    }
}

impl Collectives for Comm {
    fn rank(&self) -> usize {
        Comm::rank(self)
    }

    fn size(&self) -> usize {
        Comm::size(self)
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        crate::all_reduce(self, tensor, op)
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        crate::all_gather(self, tensor)
    }

    fn graph_capture_mark(&self) -> Option<GraphCaptureMark> {
        Some(Comm::graph_capture_mark(self))
    }

    fn record_graph(
        &self,
        began: GraphCaptureMark,
        ended: GraphCaptureMark,
        stream: u64,
    ) -> Option<RecordedGraph> {
        Some(Comm::record_graph(self, began, ended, stream))
    }

    fn discard_capture(&self, began: GraphCaptureMark, ended: GraphCaptureMark, stream: u64) {
        Comm::discard_capture(self, began, ended, stream);
    }

    fn comm(&self) -> Option<&Comm> {
        Some(self)
    }
}

/// The exchanges of the mixtures of experts loaded on a group, borrowing its communicator.
type ExpertSets<'a> = RefCell<Vec<ExpertSet<'a>>>;

self_cell::self_cell!(
    /// A group's collectives (`None` for a one-rank world) and the expert exchanges made on
    /// their communicator, owned together (the exchanges are dropped first).
    struct Ranks {
        owner: Option<Box<dyn Collectives>>,
        #[not_covariant]
        dependent: ExpertSets,
    }
);

struct Shared {
    /// The collectives (`None` for a one-rank world) and the exchanges on them.
    ranks: Ranks,
    rank: usize,
    size: usize,
    /// Whether the layers leave their collectives out (timing only).
    skip: Cell<bool>,
}

/// The ranks of a tensor-parallel group, shared by its layers (cloning is cheap and shares
/// the group, skip mode included).
///
/// Not `Send`: a group and its layers belong to the thread that drives its rank, as a
/// [`Comm`] is used from one thread at a time.
#[derive(Clone)]
pub struct TpGroup {
    shared: Rc<Shared>,
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpGroup")
            .field("rank", &self.shared.rank)
            .field("size", &self.shared.size)
            .field("skip_collectives", &self.shared.skip.get())
            .finish()
    }
}

impl TpGroup {
    /// The group of `collectives`' ranks (a [`Comm`], or a
    /// [`ThreadedCollectives`](super::ThreadedCollectives)). Refused when its rank is not
    /// below its size.
    pub fn new(collectives: impl Collectives + 'static) -> Result<Self> {
        let (rank, size) = (collectives.rank(), collectives.size());
        if rank >= size {
            return Err(Error::Argument {
                op: "TpGroup::new",
                why: format!("rank {rank} of a group of {size}"),
            });
        }
        Ok(Self::with(Some(Box::new(collectives)), rank, size))
    }

    /// A one-rank world: layers hold whole tensors and no collective runs (the unsharded
    /// model, e.g. a single-GPU reference).
    pub fn single() -> Self {
        Self::with(None, 0, 1)
    }

    fn with(collectives: Option<Box<dyn Collectives>>, rank: usize, size: usize) -> Self {
        Self {
            shared: Rc::new(Shared {
                ranks: Ranks::new(collectives, |_| RefCell::new(Vec::new())),
                rank,
                size,
                skip: Cell::new(false),
            }),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// Makes the layers of this group leave out their collectives (`true`) or run them
    /// again (`false`). Skipping gives **WRONG results** (each rank's partial sums, its own
    /// embedding rows, its block of an all-gather repeated in place of the others'); it
    /// exists to time a model with and without its collectives, e.g. the share of decode
    /// latency they take as `(with - without) / with`. Shapes stay as with the
    /// collectives. [`TpGroup::all_reduce_add_rms_norm`] is a layer's: skipped, it adds and
    /// normalises this rank's partial output. The group's own [`TpGroup::all_reduce`],
    /// [`TpGroup::all_gather_dim`] and [`TpGroup::agree`] always run. Every rank should
    /// switch together, or the ranks that still run collectives wait for the others.
    pub fn set_skip_collectives(&self, skip: bool) {
        self.shared.skip.set(skip);
    }

    /// Whether the layers leave out their collectives (see
    /// [`TpGroup::set_skip_collectives`]).
    pub fn skips_collectives(&self) -> bool {
        self.shared.skip.get()
    }

    /// The collectives, when there is more than one rank.
    fn ranks(&self) -> Option<&dyn Collectives> {
        match self.collectives() {
            Some(collectives) if self.shared.size > 1 => Some(collectives),
            _ => None,
        }
    }

    /// The collectives, whatever the number of ranks.
    fn collectives(&self) -> Option<&dyn Collectives> {
        self.shared.ranks.borrow_owner().as_deref()
    }

    /// Marks one end of a CUDA stream capture in the flight recorder of the group's
    /// communicator ([`Collectives::graph_capture_mark`]); `None` without one.
    pub(crate) fn graph_capture_mark(&self) -> Option<GraphCaptureMark> {
        self.collectives()?.graph_capture_mark()
    }

    /// Records a graph captured on `stream` between `began` and `ended` in that flight
    /// recorder ([`Collectives::record_graph`]); `None` without one or without both marks.
    pub(crate) fn record_graph(
        &self,
        began: Option<GraphCaptureMark>,
        ended: Option<GraphCaptureMark>,
        stream: u64,
    ) -> Option<RecordedGraph> {
        self.collectives()?.record_graph(began?, ended?, stream)
    }

    /// Gives back what a refused capture numbered in that flight recorder
    /// ([`Collectives::discard_capture`]); nothing without a communicator or both marks.
    pub(crate) fn discard_capture(
        &self,
        began: Option<GraphCaptureMark>,
        ended: Option<GraphCaptureMark>,
        stream: u64,
    ) {
        if let (Some(collectives), Some(began), Some(ended)) = (self.collectives(), began, ended) {
            collectives.discard_capture(began, ended, stream);
        }
    }

    /// Makes the exchanges of a mixture of experts of `key` on the group's communicator, once
    /// for each key (collective: every rank with the same key, after an agreement that all
    /// of them got here). Nothing without a communicator whose rank and size are the
    /// group's (one rank, collectives without one), or for a shape the exchange does not
    /// take (`ExpertsKey::exchangeable`); where the exchanges cannot be made on every rank
    /// (a GPU before sm_80, memory, ...), the ranks agree on that (on `device`) and none
    /// keeps them. Without them the layers run their experts on every token and sum over
    /// the ranks.
    pub(crate) fn prepare_experts(&self, key: ExpertsKey, device: &Device) -> Result<()> {
        let (rank, size) = (self.rank(), self.size());
        if size == 1 || !key.exchangeable(size) {
            return Ok(());
        }
        let made = self.shared.ranks.with_dependent(|owner, sets| {
            let comm = owner.as_deref().and_then(|c| c.comm())?;
            if comm.rank() != rank || comm.size() != size {
                return None;
            }
            // The cell is borrowed only inside these methods, never across a call back.
            let Ok(mut sets) = sets.try_borrow_mut() else {
                return Some(Err(Error::Argument {
                    op: "expert exchange",
                    why: "made from inside an exchange's experts".into(),
                }));
            };
            if sets.iter().any(|set| set.key() == key) {
                return Some(Ok(false));
            }
            let timeout = owner.as_deref().and_then(|c| c.kernel_timeout());
            Some(ExpertSet::new(comm, key, timeout).map(|set| {
                sets.push(set);
                true
            }))
        });
        // What every rank decided from the same facts: nothing made, or already made.
        let made = match made {
            None | Some(Ok(false)) => return Ok(()),
            Some(result) => result.map(|_| ()),
        };
        let agreed = self.agree_checked(
            "expert exchanges",
            crate::fingerprint(&format!("{key:?}")),
            made,
            device,
        );
        if agreed.is_err() {
            // Not made on every rank: none keeps them (dropped on the ranks that made them).
            self.shared.ranks.with_dependent(|_, sets| {
                if let Ok(mut sets) = sets.try_borrow_mut() {
                    sets.retain(|set| set.key() != key);
                }
            });
        }
        Ok(())
    }

    /// How long the kernels of the group's expert exchanges wait for their peers before
    /// giving up: one entry per size class of each mixture's shape, in the order made
    /// ([`LsaCollectives::kernel_timeout`](super::LsaCollectives::kernel_timeout) where the
    /// group runs on those collectives, nccl-rs's default otherwise); empty where it made
    /// none (see [`CausalLm::exchanges_experts`](crate::models::CausalLm::exchanges_experts)).
    pub fn expert_exchange_timeouts(&self) -> Vec<Duration> {
        self.shared.ranks.with_dependent(|_, sets| {
            sets.try_borrow()
                .map(|sets| sets.iter().flat_map(ExpertSet::timeouts).collect())
                .unwrap_or_default()
        })
    }

    /// Whether a CUDA graph can capture every expert exchange the group made (true where it
    /// made none): see `ExpertSet::capturable`. The same answer on every rank.
    pub(crate) fn expert_exchanges_capturable(&self) -> bool {
        self.shared.ranks.with_dependent(|_, sets| {
            sets.try_borrow()
                .map(|sets| sets.iter().all(ExpertSet::capturable))
                .unwrap_or(false)
        })
    }

    /// The most tokens a rank sends in one exchange of `key`; `None` when the group has no
    /// exchange for it (see [`prepare_experts`](Self::prepare_experts)) or leaves its
    /// collectives out (skip mode): the layer then runs its experts on every token.
    pub(crate) fn expert_exchange_tokens(&self, key: ExpertsKey) -> Option<usize> {
        if self.skips_collectives() {
            return None;
        }
        self.shared.ranks.with_dependent(|_, sets| {
            let sets = sets.try_borrow().ok()?;
            let set = sets.iter().find(|set| set.key() == key)?;
            Some(set.max_tokens())
        })
    }

    /// One exchange of `key` (prepared): this rank's tokens `x` dispatched by `routing`,
    /// `experts` run on the rows this rank's experts received, and the outputs combined with
    /// `weights` (see `ExpertSet::run`); `most` is the most tokens a rank sends in this call.
    pub(crate) fn exchange_experts(
        &self,
        key: ExpertsKey,
        x: &Tensor,
        routing: &Tensor,
        weights: &Tensor,
        most: usize,
        experts: &mut dyn FnMut(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.shared.ranks.with_dependent(|_, sets| {
            let mut sets = sets.try_borrow_mut().map_err(|_| Error::Argument {
                op: "expert exchange",
                why: "called again from inside an exchange's experts".into(),
            })?;
            let set = sets
                .iter_mut()
                .find(|set| set.key() == key)
                .ok_or_else(|| Error::Argument {
                    op: "expert exchange",
                    why: format!("no exchange made for {key:?}"),
                })?;
            set.run(x, routing, weights, most, experts)
        })
    }

    /// The reduction of every rank's `tensor` (`tensor` itself on one rank), always run,
    /// skip mode or not: for the caller's own exchanges (flags, timings).
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        match self.ranks() {
            Some(ranks) => ranks.all_reduce(&tensor.contiguous()?, op),
            None => Ok(tensor.clone()),
        }
    }

    /// Every rank's `tensor` concatenated along `dim` in rank order (`tensor` itself on one
    /// rank), always run, skip mode or not.
    pub fn all_gather_dim(&self, tensor: &Tensor, dim: usize) -> Result<Tensor> {
        match self.ranks() {
            Some(ranks) => gather_along(tensor, dim, self.size(), |t| ranks.all_gather(t)),
            None => {
                // The same refusal as with several ranks, so a bad `dim` fails alike.
                gather_along(tensor, dim, 1, |t| Ok(t.clone()))
            }
        }
    }

    /// The epilogue of a row-parallel layer (see
    /// [`Collectives::all_reduce_add_rms_norm`]): `partial` summed over the ranks, added to
    /// `residual`, then RMSNorm with `weight` and `eps`; returns `(new residual, normed)`.
    /// Runs the group's collectives' version of it (one fused kernel for
    /// [`LsaCollectives`](super::LsaCollectives) where the tensors fit, the unfused sequence
    /// otherwise).
    ///
    /// A layer's collective, unlike [`TpGroup::all_reduce`]: in skip mode
    /// ([`TpGroup::set_skip_collectives`]) the sum is left out (`partial` stands for it: the
    /// add and the norm only), and on one rank there is no sum to make. The shape refusals of
    /// [`Collectives::all_reduce_add_rms_norm`] hold in every case.
    pub fn all_reduce_add_rms_norm(
        &self,
        partial: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        epilogue::check(
            "TpGroup::all_reduce_add_rms_norm",
            partial,
            residual,
            weight,
        )?;
        match self.ranks() {
            Some(ranks) if !self.skips_collectives() => {
                ranks.all_reduce_add_rms_norm(partial, residual, weight, eps)
            }
            _ => epilogue::add_rms_norm(partial, residual, weight, eps),
        }
    }

    /// Checks that every rank passed the same `fingerprint` (see
    /// [`fingerprint`](crate::fingerprint)) of `what`, e.g. a model's configuration and its
    /// weights file's header, before work whose collectives depend on it: fails with
    /// [`Error::Mismatch`] on every rank when any differs from rank 0's. A collective itself
    /// (an all-gather of one row of `i64` on `device`, which must suit the collectives: the
    /// rank's GPU for a [`Comm`]); every rank must call it. Nothing to compare on one rank.
    ///
    /// A `device` that does not suit fails on that rank alone, and the wait for the result is
    /// candle's stream synchronisation, which does not watch for NCCL's asynchronous errors:
    /// both are the caller's (pass the device the layers use).
    pub fn agree(&self, what: &'static str, fingerprint: u64, device: &Device) -> Result<()> {
        self.agree_checked(what, fingerprint, Ok(()), device)
    }

    /// [`agree`](Self::agree) with this rank's own verdict: every rank exchanges its
    /// fingerprint and whether `local` failed, then returns its own error if it had one,
    /// else [`Error::PeerRefused`] when another rank's checks failed, else the comparison's
    /// verdict. Every rank calls it whatever its checks found, so no rank is left waiting
    /// (short of this rank failing to put its 16-byte row on `device`, which `agree`'s
    /// caveats cover).
    pub fn agree_checked(
        &self,
        what: &'static str,
        fingerprint: u64,
        local: Result<()>,
        device: &Device,
    ) -> Result<()> {
        let Some(ranks) = self.ranks() else {
            return local;
        };
        // The crate's agreement row, [fingerprint, refused], bit for bit as i64: NCCL and
        // candle both have it, unlike u64.
        let row = [
            i64::from_ne_bytes(fingerprint.to_ne_bytes()),
            i64::from(local.is_err()),
        ];
        // The stream first, then the upload, as for the copy back below: a pageable copy
        // queued behind a collective that waits for a peer holds the context's staging
        // buffer, which a peer sharing the context needs for its own upload before it can
        // join (the prefill's all-reduce before a capture's agreement, hung on one H200).
        let exchanged = device
            .synchronize()
            .and_then(|()| Tensor::new(&row, device))
            .map_err(Error::from)
            .and_then(|row| ranks.all_gather(&row));
        // This rank's own error says more than the exchange's or the peers'.
        local?;
        let exchanged = exchanged?;
        // The stream first, then the copy: a copy that waits for the collective holds the
        // context's staging buffer, which a peer sharing the context (ranks on one GPU in
        // one process) needs for its own upload before it can join (hung on one H200).
        device.synchronize()?;
        let table: Vec<u64> = exchanged
            .to_vec1::<i64>()?
            .into_iter()
            .map(|v| u64::from_ne_bytes(v.to_ne_bytes()))
            .collect();
        match judge(&table) {
            Verdict::Agreed => Ok(()),
            Verdict::Mismatch(ranks) => Err(Error::Mismatch { what, ranks }),
            Verdict::Refused(ranks) => Err(Error::PeerRefused { op: what, ranks }),
        }
    }

    /// The layers' all-reduce (sum) of their partial results, left out in skip mode.
    pub(crate) fn layer_sum(&self, partial: Tensor) -> Result<Tensor> {
        match self.ranks() {
            Some(ranks) if !self.skips_collectives() => {
                ranks.all_reduce(&partial.contiguous()?, ReduceOp::Sum)
            }
            _ => Ok(partial),
        }
    }

    /// The layers' all-gather of their blocks along `dim`; in skip mode this rank's block
    /// stands in for every rank's (a local copy, for the shape).
    pub(crate) fn layer_gather(&self, block: &Tensor, dim: usize) -> Result<Tensor> {
        if self.skips_collectives() && self.size() > 1 {
            let copies = vec![block.clone(); self.size()];
            return Ok(Tensor::cat(&copies, dim)?);
        }
        self.all_gather_dim(block, dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rank_runs_no_collective() {
        let group = TpGroup::single();
        assert_eq!((group.rank(), group.size()), (0, 1));
        let t = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let sum = group.layer_sum(t.clone()).unwrap();
        assert_eq!(sum.to_vec1::<f32>().unwrap(), [1.0, 2.0]);
        let gathered = group.layer_gather(&t, 0).unwrap();
        assert_eq!(gathered.to_vec1::<f32>().unwrap(), [1.0, 2.0]);
        group.agree("anything", 7, &Device::Cpu).unwrap();
    }
}
