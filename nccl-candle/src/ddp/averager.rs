//! Averaging gradients over the ranks, in buckets.

use std::cell::Cell;
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;
use nccl::{Comm, ReduceOp};

use super::bucket::{pack, plan_buckets, unpack, Bucket};
use super::vars::{check_names, check_var, fingerprint_of, sort_by_name, sorted_vars};
use crate::agree::agree;
use crate::{all_reduce_in_place, Error, Result};

/// The default largest bucket: 25 MiB, PyTorch DDP's `bucket_cap_mb`.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Time spent in [`GradientAverager::average`] while timing is on
/// ([`GradientAverager::set_timing`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AverageTiming {
    /// The number of timed calls.
    pub calls: u64,
    /// Their total time.
    pub total: Duration,
    /// The last call's time.
    pub last: Duration,
}

impl AverageTiming {
    /// The mean time of a call (zero before the first).
    pub fn mean(&self) -> Duration {
        match u32::try_from(self.calls) {
            Ok(0) => Duration::ZERO,
            Ok(calls) => self.total / calls,
            Err(_) => Duration::from_secs_f64(self.total.as_secs_f64() / self.calls as f64),
        }
    }
}

/// Averages the gradients of a fixed list of variables over every rank, in a few large
/// all-reduces: the gradients are packed by element type into buckets of at most
/// `bucket_bytes` ([`plan_buckets`]), each bucket is reduced in place with
/// [`ReduceOp::Avg`], and every gradient becomes a view of its bucket. A variable that got no
/// gradient on any rank gets none (see [`GradientAverager::average`]).
///
/// The ranks agree on the variables (names, shapes, element types, in name order) and on
/// `bucket_bytes` when the averager is made, so every rank plans the same buckets. Variables
/// whose element type is not a float are left out (candle computes no gradients for them).
/// All variables must be on one candle device, on the communicator's GPU.
///
/// Every rank must call [`GradientAverager::average`] the same number of times (the same
/// number of steps: see [`DistributedSampler`](super::DistributedSampler) for equal shards).
pub struct GradientAverager<'c> {
    comm: &'c Comm,
    /// The variables in the agreed order (name order), floats only.
    vars: Vec<(String, Var)>,
    buckets: Vec<Bucket>,
    /// The device of the variables (`None` when there are none to average).
    device: Option<Device>,
    bucket_bytes: usize,
    timing: Cell<Option<AverageTiming>>,
}

impl std::fmt::Debug for GradientAverager<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradientAverager")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("vars", &self.vars.len())
            .field("buckets", &self.buckets.len())
            .field("bucket_bytes", &self.bucket_bytes)
            .field("timing", &self.timing.get())
            .finish()
    }
}

impl<'c> GradientAverager<'c> {
    /// An averager for the variables of `vars`, in buckets of at most `bucket_bytes`
    /// ([`DEFAULT_BUCKET_BYTES`] is PyTorch's default; 0 gives one bucket per variable).
    ///
    /// Every rank calls this together: it exchanges fingerprints of the variables and
    /// `bucket_bytes` and fails on every rank with [`Error::Mismatch`] where they differ, or
    /// with this rank's own error and [`Error::PeerRefused`] elsewhere where a rank cannot
    /// take part (a variable on the CPU or on another device, an element type NCCL lacks).
    pub fn new(comm: &'c Comm, vars: &VarMap, bucket_bytes: usize) -> Result<Self> {
        Self::from_sorted(comm, sorted_vars(vars), bucket_bytes)
    }

    /// [`GradientAverager::new`] for a list of named variables (put in name order here;
    /// names must be unique).
    pub fn from_vars(comm: &'c Comm, vars: &[(String, Var)], bucket_bytes: usize) -> Result<Self> {
        Self::from_sorted(comm, sort_by_name(vars), bucket_bytes)
    }

    fn from_sorted(comm: &'c Comm, all: Vec<(String, Var)>, bucket_bytes: usize) -> Result<Self> {
        const OP: &str = "GradientAverager";
        let vars: Vec<(String, Var)> = all
            .iter()
            .filter(|(_, var)| var.dtype().is_float())
            .cloned()
            .collect();
        let device = vars.first().map(|(_, var)| var.device().clone());
        let local = (|| {
            check_names(OP, &all)?;
            for (name, var) in &vars {
                check_var(OP, comm, name, var)?;
                if let Some(device) = &device {
                    if !var.device().same_device(device) {
                        return Err(Error::Variable {
                            op: OP,
                            name: name.clone(),
                            why: "it is on another candle device (stream) than the first \
                                  variable"
                                .into(),
                        });
                    }
                }
            }
            Ok(())
        })();
        // The whole list is fingerprinted, not only the floats, so differing models are
        // refused even where they differ only in integer variables.
        agree(
            comm,
            OP,
            "the variables (names, shapes, element types) or bucket_bytes",
            fingerprint_of(OP, &(bucket_bytes as u64), &all),
            local,
        )?;
        let sizes: Vec<_> = vars
            .iter()
            .map(|(_, var)| (var.dtype(), var.elem_count()))
            .collect();
        Ok(Self {
            comm,
            buckets: plan_buckets(&sizes, bucket_bytes),
            vars,
            device,
            bucket_bytes,
            timing: Cell::new(None),
        })
    }

    /// Replaces the gradient of every variable in `grads` with its mean over the ranks. A
    /// variable without a gradient on this rank but with one on another counts as zeros
    /// here, and has the mean afterwards (as PyTorch DDP); a variable that no rank has a
    /// gradient for gets none (an optimizer leaves it as it is, no weight decay or momentum
    /// applied, as on one GPU). Every rank then holds the same gradients, so every rank's
    /// optimizer makes the same step. The gradients become views of the reduced buckets.
    ///
    /// Which variables have gradients anywhere is one small all-reduce of a flag per variable
    /// before the buckets', read back on the host: each call waits there for the backward
    /// pass to end. A bucket without any gradient on any rank is not reduced.
    ///
    /// The gradients are checked before the first collective (each of its variable's shape,
    /// element type and device: what candle's `backward` always gives). A rank that fails
    /// this check returns its error without reducing, while the others wait in the
    /// all-reduce: that check is the caller's to keep, unlike those of [`Self::new`].
    ///
    /// With one rank there is nothing to average and `grads` is left as it is.
    pub fn average(&self, grads: &mut GradStore) -> Result<()> {
        self.check_grads(grads)?;
        let device = match &self.device {
            Some(device) if self.comm.size() > 1 => device,
            _ => return Ok(()),
        };
        let timing = self.timing.get();
        if timing.is_some() {
            // The backward pass ends before the clock starts.
            device.synchronize()?;
        }
        let start = Instant::now();
        let used = self.used_anywhere(grads, device)?;
        for bucket in &self.buckets {
            // Every rank skips the same buckets: `used` is the same on all of them.
            if bucket.slots.iter().all(|slot| !used[slot.tensor]) {
                continue;
            }
            let flat = pack(bucket, &self.vars, grads, device)?;
            all_reduce_in_place(self.comm, &flat, ReduceOp::Avg)?;
            unpack(bucket, &flat, &self.vars, grads, &used)?;
        }
        if let Some(mut timing) = timing {
            device.synchronize()?;
            let took = start.elapsed();
            timing.calls += 1;
            timing.total += took;
            timing.last = took;
            self.timing.set(Some(timing));
        }
        Ok(())
    }

    /// Which of the variables have a gradient on at least one rank: a flag per variable,
    /// the ranks' maximum by one small all-reduce, read back once the device is done (a
    /// read behind a collective that waits for a peer could hold the copy engine's staging
    /// memory that a peer sharing the GPU needs first). The same list on every rank.
    fn used_anywhere(&self, grads: &GradStore, device: &Device) -> Result<Vec<bool>> {
        let mine: Vec<u8> = self
            .vars
            .iter()
            .map(|(_, var)| u8::from(grads.get(var.as_tensor()).is_some()))
            .collect();
        let flags = Tensor::from_vec(mine, self.vars.len(), device)?;
        all_reduce_in_place(self.comm, &flags, ReduceOp::Max)?;
        // The communicator's wait, not candle's: it ends on NCCL's asynchronous error (a peer
        // that died) instead of waiting for ever.
        self.comm.synchronize()?;
        Ok(flags.to_vec1::<u8>()?.into_iter().map(|u| u != 0).collect())
    }

    fn check_grads(&self, grads: &GradStore) -> Result<()> {
        for (name, var) in &self.vars {
            let Some(grad) = grads.get(var.as_tensor()) else {
                continue;
            };
            let why = if grad.dims() != var.dims() {
                format!("its gradient has shape {:?}", grad.dims())
            } else if grad.dtype() != var.dtype() {
                format!("its gradient has element type {:?}", grad.dtype())
            } else if !grad.device().same_device(var.device()) {
                "its gradient is on another device".into()
            } else {
                continue;
            };
            return Err(Error::Variable {
                op: "GradientAverager::average",
                name: name.clone(),
                why,
            });
        }
        Ok(())
    }

    /// Switches the timing of [`Self::average`] on (from zero) or off. While on, each call
    /// synchronises the device before and after its collectives (the first waits for the
    /// backward pass, the second for the all-reduces), which stalls the pipeline of
    /// launches: time a subset of the steps, not all of them.
    pub fn set_timing(&mut self, on: bool) {
        self.timing.set(on.then_some(AverageTiming::default()));
    }

    /// The timing since it was switched on, or `None` while it is off.
    pub fn timing(&self) -> Option<AverageTiming> {
        self.timing.get()
    }

    /// The communicator.
    pub fn comm(&self) -> &'c Comm {
        self.comm
    }

    /// The variables averaged, in the agreed order (floats, by name).
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// The buckets, in the order they are reduced; slots index [`Self::vars`].
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The largest bucket the averager was made with.
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }
}
