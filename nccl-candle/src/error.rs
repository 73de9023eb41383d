//! The crate's error, and its conversions to and from candle's.

use candle_core::DType;

/// What goes wrong in a collective on tensors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tensor is not on a CUDA device.
    #[error("{op}: the tensor is on {device}, not on a CUDA device")]
    NotCuda {
        /// The collective.
        op: &'static str,
        /// The tensor's device, as candle names it.
        device: String,
    },
    /// The tensor's elements are not one contiguous run (call `.contiguous()` first).
    #[error("{op}: the tensor is not contiguous (call .contiguous() first)")]
    NotContiguous {
        /// The collective.
        op: &'static str,
    },
    /// NCCL has no type for the tensor's elements.
    #[error("{op}: NCCL has no element type for {dtype:?}")]
    UnsupportedDType {
        /// The collective.
        op: &'static str,
        /// The tensor's element type.
        dtype: DType,
    },
    /// The tensor's shape does not suit the collective.
    #[error("{op}: {why}")]
    Shape {
        /// The collective.
        op: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// An argument is outside what the call accepts (a root past the ranks, a rank past
    /// the world size, a global batch that does not split, a group's rank past its size).
    #[error("{op}: {why}")]
    Argument {
        /// The call.
        op: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A variable cannot take part in a data-parallel call on this rank (on the CPU or on
    /// another GPU than the communicator's, not contiguous, an element type NCCL lacks, a
    /// name given twice, a gradient of another shape or type than its variable).
    #[error("{op}: variable {name:?}: {why}")]
    Variable {
        /// The call.
        op: &'static str,
        /// The variable's name.
        name: String,
        /// What is wrong with it.
        why: String,
    },
    /// The ranks disagree on what must be the same on all of them (the variables' names,
    /// shapes and element types, a bucket size, a root). Every rank returns this error, found
    /// by an exchange of fingerprints before any collective that depends on it.
    #[error("{what} differ between the ranks: rank(s) {ranks:?} disagree with rank 0")]
    Mismatch {
        /// What was compared.
        what: &'static str,
        /// The ranks whose fingerprint differs from rank 0's.
        ranks: Vec<usize>,
    },
    /// Other ranks failed their own checks before a data-parallel call (their error says
    /// why), so this rank refused it too rather than wait for them.
    #[error("{op}: rank(s) {ranks:?} refused the call (their error says why)")]
    PeerRefused {
        /// The call.
        op: &'static str,
        /// The ranks that refused.
        ranks: Vec<usize>,
    },
    /// A dimension of a tensor to shard over a tensor-parallel group does not split evenly
    /// over its ranks (found from the layer's arguments, or in the weights file).
    #[error("{name}: dimension {dim} of {shape:?} does not split over {world_size} ranks")]
    NotDivisible {
        /// The tensor's name (the full path in the weights file).
        name: String,
        /// Its whole shape.
        shape: Vec<usize>,
        /// The dimension sharded.
        dim: usize,
        /// The number of ranks.
        world_size: usize,
    },
    /// A tensor loaded from the weights (a rank's shard, or a whole replicated tensor) does
    /// not have the shape the layer expects.
    #[error("{name}: loaded a tensor of shape {got:?}, expected {expected:?}")]
    ShardShape {
        /// The tensor's name (the full path in the weights file).
        name: String,
        /// The shape the layer expects.
        expected: Vec<usize>,
        /// The shape loaded.
        got: Vec<usize>,
    },
    /// A Hugging Face checkpoint (its `config.json`, weights, index or `tokenizer.json`)
    /// cannot be used; `path` names the file, `why` what is wrong (the field, the tensor).
    #[error("{}: {why}", path.display())]
    Checkpoint {
        /// The file at fault (the checkpoint's directory when a file is missing from it).
        path: std::path::PathBuf,
        /// What kind of fault.
        fault: CheckpointFault,
        /// What is wrong, naming the field or tensor.
        why: String,
    },
    /// A CUDA graph of a decode step ([`decode::DecodeGraph`](crate::decode::DecodeGraph))
    /// could not be captured, instantiated or launched: `op` names the step that failed
    /// (candle's own message names the operation that cannot be captured), `why` what failed.
    #[error("CUDA graph, {op}: {why}")]
    Graph {
        /// The graph's step: `check` (before anything), `warm-up`, `capture`,
        /// `instantiate`, `launch`, or `nodes`.
        op: &'static str,
        /// What failed.
        why: String,
    },
    /// Ranks simulated on threads ([`tp::ThreadedCollectives`](crate::tp::ThreadedCollectives)) could not exchange tensors:
    /// another rank's thread panicked during an exchange.
    #[error("threaded collectives: {0}")]
    Threaded(String),
    /// NCCL or nccl-rs refused or failed the collective.
    #[error(transparent)]
    Nccl(#[from] nccl::Error),
    /// candle failed (allocation, storage access).
    #[error(transparent)]
    Candle(candle_core::Error),
}

/// What is wrong with a Hugging Face checkpoint ([`Error::Checkpoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CheckpointFault {
    /// A file the checkpoint needs is not there or cannot be read.
    Missing,
    /// A file cannot be parsed, or a required field is missing or of the wrong type.
    Malformed,
    /// Valid, but not something these models run (an architecture, an activation, a rope
    /// scaling or a sliding-window arrangement they do not implement).
    Unsupported,
    /// A tensor is missing, or has another shape or element type than the configuration
    /// implies.
    Tensor,
}

/// candle's error as this crate's: [`Error::Candle`], unless it carries one of this crate's
/// errors (made by the conversion the other way, with or without candle's backtrace), which
/// comes back as it was. A `?` on a candle call inside a function returning this crate's
/// [`Result`] goes through here.
impl From<candle_core::Error> for Error {
    fn from(err: candle_core::Error) -> Self {
        match err {
            candle_core::Error::Cuda(boxed) => match boxed.downcast::<Error>() {
                Ok(ours) => *ours,
                Err(other) => Error::Candle(candle_core::Error::Cuda(other)),
            },
            candle_core::Error::WithBacktrace { inner, .. } if matches!(*inner, candle_core::Error::Cuda(ref boxed) if boxed.is::<Error>()) => {
                Error::from(*inner)
            }
            other => Error::Candle(other),
        }
    }
}

/// This crate's error as candle's, so that `?` on this crate's calls works inside candle code
/// (a [`Module`](candle_core::Module), a function returning [`candle_core::Result`]).
///
/// [`Error::Candle`] gives back candle's own error. Any other goes in whole, with candle's
/// backtrace when `RUST_BACKTRACE` asks for one (as [`candle_core::Error::wrap`] does): its
/// text is this error's text, and the typed error stays reachable through
/// [`Error::find_in`] (or a `downcast_ref::<nccl_candle::Error>()` of the boxed error). It
/// rides in `candle_core::Error::Cuda`, the one variant of candle's error that holds a
/// foreign error as a `std::error::Error` (which can be downcast) and shows its text as it
/// is; `Wrapped`, which [`candle_core::Error::wrap`] makes, keeps only its text.
impl From<Error> for candle_core::Error {
    fn from(err: Error) -> Self {
        match err {
            Error::Candle(err) => err,
            err => candle_core::Error::Cuda(Box::new(err)).bt(),
        }
    }
}

impl Error {
    /// The error of this crate inside candle's `err`, if it holds one: put there by the
    /// conversion into [`candle_core::Error`], looked for under candle's backtrace, context
    /// and path wrappers.
    ///
    /// ```
    /// let err: candle_core::Error = nccl_candle::Error::Threaded("a peer panicked".into()).into();
    /// let err = err.context("in the model");
    /// assert!(matches!(
    ///     nccl_candle::Error::find_in(&err),
    ///     Some(nccl_candle::Error::Threaded(_))
    /// ));
    /// ```
    pub fn find_in(err: &candle_core::Error) -> Option<&Error> {
        match err {
            candle_core::Error::Cuda(boxed) => boxed.downcast_ref::<Error>(),
            candle_core::Error::WrappedContext { wrapped, .. } => wrapped.downcast_ref::<Error>(),
            candle_core::Error::WithBacktrace { inner, .. }
            | candle_core::Error::Context { inner, .. }
            | candle_core::Error::WithPath { inner, .. } => Error::find_in(inner),
            _ => None,
        }
    }
}

/// The result of this crate's functions.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> Error {
        Error::Shape {
            op: "all_gather",
            why: "too long".into(),
        }
    }

    #[test]
    fn into_candle_keeps_the_text_and_the_type() {
        let err = candle_core::Error::from(refused());
        assert!(err.to_string().contains("all_gather: too long"), "{err}");
        assert!(matches!(
            Error::find_in(&err),
            Some(Error::Shape {
                op: "all_gather",
                ..
            })
        ));
        // Under candle's own wrappers too.
        let wrapped = err.context("layer 3").with_path("model.safetensors");
        assert!(matches!(
            Error::find_in(&wrapped),
            Some(Error::Shape { .. })
        ));
        // And back, as it was.
        let back = Error::from(candle_core::Error::from(refused()));
        assert!(
            matches!(
                back,
                Error::Shape {
                    op: "all_gather",
                    ..
                }
            ),
            "{back:?}"
        );
    }

    #[test]
    fn candle_errors_stay_candle_errors() {
        let own = candle_core::Error::Msg("candle's own".into());
        let ours = Error::from(own);
        assert!(matches!(ours, Error::Candle(candle_core::Error::Msg(_))));
        let again = candle_core::Error::from(ours);
        assert!(matches!(again, candle_core::Error::Msg(ref text) if text == "candle's own"));
        assert!(Error::find_in(&again).is_none());
    }

    #[test]
    fn question_mark_converts_in_candle_code() {
        fn candle_code() -> candle_core::Result<()> {
            Err(Error::Threaded("a peer panicked".into()))?;
            Ok(())
        }
        let err = candle_code().unwrap_err();
        assert!(
            matches!(Error::find_in(&err), Some(Error::Threaded(_))),
            "{err}"
        );
    }

    #[test]
    fn the_error_travels_between_threads() {
        fn send_sync<T: Send + Sync + 'static>() {}
        send_sync::<Error>();
    }
}
