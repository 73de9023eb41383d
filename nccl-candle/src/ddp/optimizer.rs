//! An optimizer that averages the gradients over the ranks before each step.

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use candle_nn::{Optimizer, VarMap};
use nccl::Comm;

use super::averager::{GradientAverager, DEFAULT_BUCKET_BYTES};
use crate::Result;

/// Wraps a candle optimizer for data-parallel training: each step averages the gradients
/// over the ranks ([`GradientAverager`]) and then lets the inner optimizer step, so every
/// rank makes the same update and the replicas stay identical (start them equal with
/// [`broadcast_vars`](super::broadcast_vars)).
///
/// The inner optimizer must have been made from the same variables as the averager.
pub struct DistributedOptimizer<'c, O> {
    inner: O,
    averager: GradientAverager<'c>,
}

impl<O: std::fmt::Debug> std::fmt::Debug for DistributedOptimizer<'_, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("inner", &self.inner)
            .field("averager", &self.averager)
            .finish()
    }
}

impl<'c, O: Optimizer> DistributedOptimizer<'c, O> {
    /// Wraps `inner`, averaging the gradients of `vars` in buckets of
    /// [`DEFAULT_BUCKET_BYTES`]. Every rank calls this together ([`GradientAverager::new`]
    /// says what it agrees on and how it fails).
    pub fn new(comm: &'c Comm, inner: O, vars: &VarMap) -> Result<Self> {
        Self::with_bucket_bytes(comm, inner, vars, DEFAULT_BUCKET_BYTES)
    }

    /// [`DistributedOptimizer::new`] with buckets of at most `bucket_bytes`.
    pub fn with_bucket_bytes(
        comm: &'c Comm,
        inner: O,
        vars: &VarMap,
        bucket_bytes: usize,
    ) -> Result<Self> {
        Ok(Self::from_averager(
            GradientAverager::new(comm, vars, bucket_bytes)?,
            inner,
        ))
    }

    /// Wraps `inner` with an averager made beforehand.
    pub fn from_averager(averager: GradientAverager<'c>, inner: O) -> Self {
        Self { inner, averager }
    }

    /// Computes the gradients of `loss`, averages them over the ranks and steps.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let mut grads = loss.backward()?;
        self.step(&mut grads)
    }

    /// Averages `grads` over the ranks (in place) and steps with them.
    pub fn step(&mut self, grads: &mut GradStore) -> Result<()> {
        self.averager.average(grads)?;
        self.inner.step(grads)?;
        Ok(())
    }

    /// The inner optimizer's learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    /// Sets the inner optimizer's learning rate (every rank alike, or the replicas drift).
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr)
    }

    /// The inner optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The inner optimizer, to change (every rank alike).
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// The gradient averager (its buckets, its timing).
    pub fn averager(&self) -> &GradientAverager<'c> {
        &self.averager
    }

    /// The gradient averager, to switch its timing on or off.
    pub fn averager_mut(&mut self) -> &mut GradientAverager<'c> {
        &mut self.averager
    }

    /// The inner optimizer, unwrapped.
    pub fn into_inner(self) -> O {
        self.inner
    }
}
