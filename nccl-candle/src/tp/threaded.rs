//! Ranks simulated on threads of one process, exchanging candle tensors through shared
//! memory: tensor-parallel code runs and is tested with CPU tensors, without GPUs or NCCL.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use candle_core::Tensor;
use nccl::ReduceOp;

use super::Collectives;
use crate::{Error, Result};

/// What the ranks of one simulated group share, under one lock.
struct State {
    /// Each rank's tensor of the exchange in progress.
    slots: Vec<Option<Tensor>>,
    /// Ranks at the current meeting point.
    arrived: usize,
    /// Meeting points passed so far.
    generation: u64,
    /// A rank's handle was dropped (its thread ended or panicked): no meeting can complete.
    departed: bool,
}

/// What the ranks of one simulated group share.
struct Hub {
    size: usize,
    state: Mutex<State>,
    met: Condvar,
}

/// One rank of a group simulated on threads ([`ThreadedCollectives::group`]), one thread per
/// rank. Tensors may be on any device (the CPU for tests); results are on the calling
/// rank's tensor's device. Reductions go in rank order in the tensors' type, rounding after
/// each step as NCCL does, so low-precision results resemble NCCL's without matching them
/// bit for bit (NCCL's order depends on its algorithm).
///
/// As with NCCL, every rank must make the same calls in the same order; ranks that pass
/// tensors of different shapes or types all get the same error. Unlike NCCL, a rank whose
/// handle is dropped (its thread ended, or panicked while unwinding) makes every later
/// exchange fail with [`Error::Threaded`] on the others instead of leaving them waiting.
pub struct ThreadedCollectives {
    hub: Arc<Hub>,
    rank: usize,
}

fn broken(why: &str) -> Error {
    Error::Threaded(why.to_string())
}

impl ThreadedCollectives {
    /// The `size` ranks of a new group, rank `r` at index `r`; move each to its own thread.
    /// Refused for no rank at all.
    pub fn group(size: usize) -> Result<Vec<ThreadedCollectives>> {
        if size == 0 {
            return Err(Error::Argument {
                op: "ThreadedCollectives::group",
                why: "a group needs at least one rank".into(),
            });
        }
        let hub = Arc::new(Hub {
            size,
            state: Mutex::new(State {
                slots: vec![None; size],
                arrived: 0,
                generation: 0,
                departed: false,
            }),
            met: Condvar::new(),
        });
        Ok((0..size)
            .map(|rank| ThreadedCollectives {
                hub: hub.clone(),
                rank,
            })
            .collect())
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.hub
            .state
            .lock()
            .map_err(|_| broken("a rank's thread panicked during an exchange"))
    }

    /// Waits until every rank has reached this meeting point, holding `state`.
    fn meet<'h>(&'h self, mut state: MutexGuard<'h, State>) -> Result<MutexGuard<'h, State>> {
        if state.departed {
            return Err(broken("a rank of the group has left"));
        }
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived == self.hub.size {
            state.arrived = 0;
            state.generation += 1;
            self.hub.met.notify_all();
            return Ok(state);
        }
        loop {
            state = self
                .hub
                .met
                .wait(state)
                .map_err(|_| broken("a rank's thread panicked during an exchange"))?;
            // Passed (checked first: a rank may leave right after the last meeting).
            if state.generation != generation {
                return Ok(state);
            }
            if state.departed {
                return Err(broken("a rank of the group left during an exchange"));
            }
        }
    }

    /// Every rank's `tensor`, in rank order, on this rank's tensor's device; refused alike on
    /// every rank when their shapes or types differ.
    fn exchange(&self, op: &'static str, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let mut state = self.lock()?;
        state.slots[self.rank] = Some(tensor.clone());
        let state = self.meet(state)?;
        let all: Vec<Option<Tensor>> = state.slots.clone();
        // No rank writes the next exchange's tensor before every rank has read this one's.
        let mut state = self.meet(state)?;
        state.slots[self.rank] = None;
        drop(state);
        let all: Vec<Tensor> = all
            .into_iter()
            .enumerate()
            .map(|(rank, slot)| slot.ok_or_else(|| broken(&format!("rank {rank} left no tensor"))))
            .collect::<Result<_>>()?;
        if let Some(first) = all.first() {
            if all
                .iter()
                .any(|t| t.dims() != first.dims() || t.dtype() != first.dtype())
            {
                let shapes: Vec<_> = all.iter().map(|t| (t.dims().to_vec(), t.dtype())).collect();
                return Err(Error::Shape {
                    op,
                    why: format!("the ranks passed different tensors: {shapes:?}"),
                });
            }
        }
        all.into_iter()
            .map(|t| Ok(t.to_device(tensor.device())?))
            .collect()
    }
}

impl Drop for ThreadedCollectives {
    fn drop(&mut self) {
        // Poisoned or not, the flag must reach the ranks still waiting.
        let mut state = match self.hub.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        state.departed = true;
        self.hub.met.notify_all();
    }
}

impl Collectives for ThreadedCollectives {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.hub.size
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if op == ReduceOp::Avg && !tensor.dtype().is_float() {
            // candle's integer scaling by 1/size would give zeros, not NCCL's quotient.
            return Err(Error::UnsupportedDType {
                op: "ThreadedCollectives::all_reduce (Avg on integers is not simulated)",
                dtype: tensor.dtype(),
            });
        }
        let mut all = self.exchange("all_reduce", tensor)?.into_iter();
        let Some(mut acc) = all.next() else {
            return Err(Error::Threaded("a group without ranks".into()));
        };
        for t in all {
            acc = match op {
                ReduceOp::Sum | ReduceOp::Avg => (&acc + &t)?,
                ReduceOp::Prod => (&acc * &t)?,
                ReduceOp::Max => acc.maximum(&t)?,
                ReduceOp::Min => acc.minimum(&t)?,
            };
        }
        if op == ReduceOp::Avg {
            acc = (acc / self.hub.size as f64)?;
        }
        Ok(acc)
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        let all = self.exchange("all_gather", tensor)?;
        Ok(Tensor::cat(&all, 0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn ranks_on_threads_reduce_and_gather() {
        let ranks = ThreadedCollectives::group(3).unwrap();
        std::thread::scope(|scope| {
            for rank in ranks {
                scope.spawn(move || {
                    let r = rank.rank() as f32;
                    let t = Tensor::new(&[r, 10.0 * r], &Device::Cpu).unwrap();
                    let sum = rank.all_reduce(&t, ReduceOp::Sum).unwrap();
                    assert_eq!(sum.to_vec1::<f32>().unwrap(), [3.0, 30.0]);
                    let max = rank.all_reduce(&t, ReduceOp::Max).unwrap();
                    assert_eq!(max.to_vec1::<f32>().unwrap(), [2.0, 20.0]);
                    let avg = rank.all_reduce(&t, ReduceOp::Avg).unwrap();
                    assert_eq!(avg.to_vec1::<f32>().unwrap(), [1.0, 10.0]);
                    let all = rank.all_gather(&t).unwrap();
                    assert_eq!(
                        all.to_vec1::<f32>().unwrap(),
                        [0.0, 0.0, 1.0, 10.0, 2.0, 20.0]
                    );
                });
            }
        });
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_instead_of_stranding_them() {
        let mut ranks = ThreadedCollectives::group(3).unwrap();
        let gone = ranks.pop().unwrap();
        drop(gone);
        std::thread::scope(|scope| {
            for rank in ranks {
                scope.spawn(move || {
                    let t = Tensor::new(&[1f32], &Device::Cpu).unwrap();
                    let err = rank.all_reduce(&t, ReduceOp::Sum).unwrap_err();
                    assert!(matches!(err, Error::Threaded(_)), "{err}");
                });
            }
        });
    }

    #[test]
    fn tensors_that_differ_are_refused_on_every_rank() {
        let ranks = ThreadedCollectives::group(2).unwrap();
        std::thread::scope(|scope| {
            for rank in ranks {
                scope.spawn(move || {
                    let t = Tensor::zeros(1 + rank.rank(), candle_core::DType::F32, &Device::Cpu)
                        .unwrap();
                    let err = rank.all_gather(&t).unwrap_err();
                    assert!(matches!(err, Error::Shape { .. }), "{err}");
                    // The group stays usable.
                    let one = Tensor::new(&[1u32], &Device::Cpu).unwrap();
                    let sum = rank.all_reduce(&one, ReduceOp::Sum).unwrap();
                    assert_eq!(sum.to_vec1::<u32>().unwrap(), [2]);
                });
            }
        });
    }

    #[test]
    fn no_rank_is_refused() {
        assert!(matches!(
            ThreadedCollectives::group(0),
            Err(Error::Argument { .. })
        ));
    }
}
