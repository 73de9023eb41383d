//! `--lsa KERNEL`: the all-reduce kernels nccl-rs ships (`nccl::device::LsaAllReduce`), timed
//! beside NCCL's own all-reduce in the same run (sums of f32, bf16 and f16); as `bench
//! all_gather --lsa flags`, its LL all-gather beside NCCL's all-gather (out of place: the
//! kernel has no in-place form).

use nccl::device::{LsaAlgorithm, LsaAllReduce, LsaElem};
use nccl::Comm;

use crate::elem::Elem;
use crate::ops::{Part, PartMut};
use crate::BenchResult;

/// An [`LsaAllReduce`] of any element type the benchmark runs (so `Buffers<T>` can hold one).
pub trait LsaIssue<T: Elem> {
    /// Issues one all-reduce with `algorithm`, out of place or (`send` `None`) in place.
    fn issue(
        &mut self,
        algorithm: LsaAlgorithm,
        send: Option<&Part<'_, T>>,
        recv: &mut PartMut<'_, '_, T>,
    ) -> BenchResult<()>;
    /// Issues one all-gather of `send` into `recv` (the LL kernel).
    fn gather(&mut self, send: &Part<'_, T>, recv: &mut PartMut<'_, '_, T>) -> BenchResult<()>;
}

impl<T: Elem + LsaElem> LsaIssue<T> for LsaAllReduce<'_, T> {
    fn issue(
        &mut self,
        algorithm: LsaAlgorithm,
        send: Option<&Part<'_, T>>,
        recv: &mut PartMut<'_, '_, T>,
    ) -> BenchResult<()> {
        match send {
            Some(send) => self.all_reduce(send, recv, algorithm)?,
            None => self.all_reduce_in_place(recv, algorithm)?,
        };
        Ok(())
    }

    fn gather(&mut self, send: &Part<'_, T>, recv: &mut PartMut<'_, '_, T>) -> BenchResult<()> {
        self.all_gather(send, recv)?;
        Ok(())
    }
}

/// The shipped all-reduce on `comm` for up to `max_count` elements, type-erased.
pub fn create<'c, T: Elem + LsaElem>(
    comm: &'c Comm,
    max_count: usize,
) -> BenchResult<Box<dyn LsaIssue<T> + 'c>> {
    Ok(Box::new(LsaAllReduce::<T>::new(comm, max_count)?))
}

/// `--lsa`'s values.
pub fn parse(text: &str) -> Option<LsaAlgorithm> {
    Some(match text {
        "flags" => LsaAlgorithm::OneShotFlags,
        "barrier" => LsaAlgorithm::OneShotBarrier,
        "twoshot" => LsaAlgorithm::TwoShotFlags,
        "auto" => LsaAlgorithm::Auto,
        _ => return None,
    })
}

/// The name of a kernel choice in the output.
pub fn name(algorithm: LsaAlgorithm) -> &'static str {
    match algorithm {
        LsaAlgorithm::OneShotFlags => "flags",
        LsaAlgorithm::OneShotBarrier => "barrier",
        LsaAlgorithm::TwoShotFlags => "twoshot",
        LsaAlgorithm::Auto => "auto",
        _ => "nccl",
    }
}
