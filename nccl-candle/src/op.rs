//! What every collective run as a candle op shares: the checks made before NCCL sees a
//! tensor, the extent of a contiguous layout, and the typed error carried through candle's
//! op machinery.

use candle_core::{DType, Layout, Tensor};

use crate::{Error, Result};

/// Checks what this crate checks of a tensor before NCCL sees it.
pub(crate) fn check(op: &'static str, tensor: &Tensor) -> Result<()> {
    if !tensor.device().is_cuda() {
        return Err(Error::NotCuda {
            op,
            device: format!("{:?}", tensor.device().location()),
        });
    }
    if !tensor.is_contiguous() {
        return Err(Error::NotContiguous { op });
    }
    match tensor.dtype() {
        DType::I16 => Err(Error::UnsupportedDType {
            op,
            dtype: tensor.dtype(),
        }),
        _ => Ok(()),
    }
}

/// The typed error of a collective run inside candle's op machinery, whose own error type
/// keeps only text (`candle_core::Error::Wrapped` cannot be downcast): the op records it
/// here and hands candle its text; the caller takes it back.
#[derive(Default)]
pub(crate) struct Failure(std::cell::RefCell<Option<Error>>);

impl Failure {
    /// Records `err` and gives candle its text.
    pub(crate) fn record(&self, err: Error) -> candle_core::Error {
        let text = err.to_string();
        *self.0.borrow_mut() = Some(err);
        candle_core::Error::Msg(text)
    }

    /// The error to report for candle's `err`: the typed one recorded, else candle's own.
    pub(crate) fn take(&self, err: candle_core::Error) -> Error {
        self.0.borrow_mut().take().unwrap_or(Error::Candle(err))
    }
}

/// The first and one-past-last element of a contiguous layout.
pub(crate) fn extent(
    op: &'static str,
    layout: &Layout,
    failure: &Failure,
) -> candle_core::Result<(usize, usize)> {
    layout
        .contiguous_offsets()
        .ok_or_else(|| failure.record(Error::NotContiguous { op }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_errors_come_back_through_candle() {
        let failure = Failure::default();
        let through = failure.record(Error::Nccl(nccl::Error::InvalidArgument("a size".into())));
        assert!(through.to_string().contains("a size"), "{through}");
        match failure.take(through) {
            Error::Nccl(nccl::Error::InvalidArgument(text)) => assert_eq!(text, "a size"),
            other => panic!("{other:?}"),
        }
        // Nothing recorded: candle's own error.
        let own = candle_core::Error::Msg("candle's own".into());
        assert!(matches!(failure.take(own), Error::Candle(_)));
    }
}
