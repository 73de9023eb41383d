//! Ranks simulated on threads of one process, exchanging candle tensors through shared
//! memory: tensor-parallel code runs and is tested with CPU tensors, without GPUs or NCCL.

use std::sync::{Arc, Barrier, Mutex};

use candle_core::Tensor;
use nccl::ReduceOp;

use super::Collectives;
use crate::{Error, Result};

/// What the ranks of one simulated group share.
struct Hub {
    size: usize,
    /// Each rank's tensor of the exchange in progress.
    slots: Mutex<Vec<Option<Tensor>>>,
    barrier: Barrier,
}

/// One rank of a group simulated on threads ([`ThreadedCollectives::group`]), one thread per
/// rank. Tensors may be on any device (the CPU for tests); results are on the calling
/// rank's tensor's device. Reductions go in rank order in the tensors' type, rounding after
/// each step as NCCL does, so low-precision results resemble NCCL's without matching them
/// bit for bit (NCCL's order depends on its algorithm).
///
/// As with NCCL, every rank must make the same calls in the same order: a rank that never
/// comes leaves the others waiting forever. Ranks that pass tensors of different shapes all
/// get the same error.
pub struct ThreadedCollectives {
    hub: Arc<Hub>,
    rank: usize,
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
            slots: Mutex::new(vec![None; size]),
            barrier: Barrier::new(size),
        });
        Ok((0..size)
            .map(|rank| ThreadedCollectives {
                hub: hub.clone(),
                rank,
            })
            .collect())
    }

    /// Every rank's `tensor`, in rank order, on this rank's tensor's device.
    fn exchange(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let poisoned = |_| Error::Threaded("a rank's thread panicked during an exchange".into());
        self.hub.slots.lock().map_err(poisoned)?[self.rank] = Some(tensor.clone());
        self.hub.barrier.wait();
        let all: Vec<Option<Tensor>> = self.hub.slots.lock().map_err(poisoned)?.clone();
        // No rank writes the next exchange's tensor before every rank has read this one's.
        self.hub.barrier.wait();
        all.into_iter()
            .enumerate()
            .map(|(rank, slot)| match slot {
                Some(t) => Ok(t.to_device(tensor.device())?),
                None => Err(Error::Threaded(format!("rank {rank} left no tensor"))),
            })
            .collect()
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
        let mut all = self.exchange(tensor)?.into_iter();
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
        let all = self.exchange(tensor)?;
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
    fn no_rank_is_refused() {
        assert!(matches!(
            ThreadedCollectives::group(0),
            Err(Error::Argument { .. })
        ));
    }
}
