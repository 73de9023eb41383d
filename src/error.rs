//! Error type shared by the whole crate.
//!
//! NCCL failures keep the raw code, its name, NCCL's own description and, when the library
//! offers it, the text of `ncclGetLastError`. Whether an error leaves the communicator usable
//! follows NCCL's documentation: see [`Error::is_fatal`].

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::release::Version;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A result code returned by NCCL (`ncclResult_t`).
///
/// Codes the crate does not know (a newer library) are kept as [`ResultCode::Unknown`]
/// instead of being misread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ResultCode {
    /// `ncclSuccess` (0).
    Success,
    /// `ncclUnhandledCudaError` (1): a CUDA call made by NCCL failed.
    UnhandledCudaError,
    /// `ncclSystemError` (2): a system call failed.
    SystemError,
    /// `ncclInternalError` (3): an internal check failed (NCCL bug or memory corruption).
    InternalError,
    /// `ncclInvalidArgument` (4): the call had no effect.
    InvalidArgument,
    /// `ncclInvalidUsage` (5): the call is incorrect, usually a programming error.
    InvalidUsage,
    /// `ncclRemoteError` (6, NCCL 2.13): a peer failed or the network broke.
    RemoteError,
    /// `ncclInProgress` (7, NCCL 2.14): a nonblocking operation is still being enqueued.
    InProgress,
    /// `ncclTimeout` (8, NCCL 2.30.3).
    Timeout,
    /// A code this crate does not know.
    Unknown(u32),
}

impl ResultCode {
    /// Decodes a raw `ncclResult_t`.
    pub fn from_raw(raw: nccl_sys::ncclResult_t) -> Self {
        match raw.0 {
            0 => Self::Success,
            1 => Self::UnhandledCudaError,
            2 => Self::SystemError,
            3 => Self::InternalError,
            4 => Self::InvalidArgument,
            5 => Self::InvalidUsage,
            6 => Self::RemoteError,
            7 => Self::InProgress,
            8 => Self::Timeout,
            other => Self::Unknown(other),
        }
    }

    /// The raw numeric value.
    pub fn code(self) -> u32 {
        match self {
            Self::Success => 0,
            Self::UnhandledCudaError => 1,
            Self::SystemError => 2,
            Self::InternalError => 3,
            Self::InvalidArgument => 4,
            Self::InvalidUsage => 5,
            Self::RemoteError => 6,
            Self::InProgress => 7,
            Self::Timeout => 8,
            Self::Unknown(code) => code,
        }
    }

    /// The C name of the code, e.g. `"ncclInvalidUsage"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Success => "ncclSuccess",
            Self::UnhandledCudaError => "ncclUnhandledCudaError",
            Self::SystemError => "ncclSystemError",
            Self::InternalError => "ncclInternalError",
            Self::InvalidArgument => "ncclInvalidArgument",
            Self::InvalidUsage => "ncclInvalidUsage",
            Self::RemoteError => "ncclRemoteError",
            Self::InProgress => "ncclInProgress",
            Self::Timeout => "ncclTimeout",
            Self::Unknown(_) => "unknown ncclResult_t",
        }
    }

    /// Whether NCCL documents this code as fatal for the communicator: the application must
    /// abort the communicator and create a new one. `InvalidArgument` is not fatal: the call
    /// had no effect.
    pub fn is_fatal(self) -> bool {
        !matches!(
            self,
            Self::Success | Self::InvalidArgument | Self::InProgress
        )
    }
}

impl fmt::Display for ResultCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.code())
    }
}

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An NCCL function returned an error code.
    #[error("{call} failed: {code}: {description}{}", last_error_suffix(.last_error))]
    Nccl {
        /// The NCCL function that failed, e.g. `"ncclAllReduce"`.
        call: &'static str,
        /// The result code.
        code: ResultCode,
        /// NCCL's text for the code (`ncclGetErrorString`).
        description: String,
        /// NCCL's last error message (`ncclGetLastError`), when it had one.
        last_error: Option<String>,
    },

    /// The loaded NCCL library is too old for the requested API.
    #[error("{api} needs NCCL {needs} or newer, but the loaded library is NCCL {found}")]
    Unsupported {
        /// The API or feature asked for.
        api: &'static str,
        /// The first NCCL version that has it.
        needs: Version,
        /// The version of the loaded library.
        found: Version,
    },

    /// The loaded library has the API, but NCCL cannot use it on this system or communicator:
    /// for example it registered no window (NCCL 2.29.2+ reports that as success with a NULL
    /// window), or one-sided RMA needs a newer CUDA driver. Nothing was changed.
    #[error("{api} is not available here: {reason}")]
    Unavailable {
        /// The API or feature asked for.
        api: &'static str,
        /// Why NCCL cannot provide it, and what would.
        reason: String,
    },

    /// An argument was rejected before anything was handed to NCCL; nothing was enqueued.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The ranks of a v-collective disagree on a count (found by its checked mode,
    /// [`VOperation::checked`](crate::VOperation::checked)): rank `sender` sends `sent`
    /// elements to rank `receiver`, which expects `expected`. Every rank gets the same error,
    /// and nothing was enqueued on any of them.
    #[error(
        "{call}: rank {sender} sends {sent} elements to rank {receiver}, which expects \
         {expected}; nothing was enqueued on any rank"
    )]
    CountMismatch {
        /// The v-collective, e.g. `"all_to_all_v"`.
        call: &'static str,
        /// The rank whose send count disagrees (the first such pair in rank order).
        sender: usize,
        /// The rank whose receive count disagrees.
        receiver: usize,
        /// What `sender` sends to `receiver`, in elements.
        sent: u64,
        /// What `receiver` expects from `sender`, in elements.
        expected: u64,
    },

    /// A call every rank makes together, and agrees on before NCCL is asked (such as
    /// `ncclDevCommCreate`), was refused on every rank because rank `rank` refused it on its
    /// own, for `reason`. That rank returns its own, fuller error; every other rank returns
    /// this one. No rank called NCCL, and nothing changed on any rank.
    #[error(
        "{call}: rank {rank} refused it on its own ({reason}; that rank's error says more), \
         so no rank called NCCL"
    )]
    RankRefused {
        /// The NCCL call refused, e.g. `"ncclDevCommCreate"`.
        call: &'static str,
        /// The first rank (in rank order) that refused.
        rank: usize,
        /// Why, as far as the agreement carries it.
        reason: Refusal,
    },

    /// The ranks of a call every rank makes together, and agrees on before NCCL is asked,
    /// gave different values for something NCCL needs the same on every rank: rank `rank`
    /// gave `value` for `field` where rank `first` gave `expected`. Every rank returns this
    /// same error; no rank called NCCL, and nothing changed on any rank.
    #[error(
        "{call}: rank {rank} gives {field} = {value} where rank {first} gives {expected}; \
         every rank must give the same, so no rank called NCCL"
    )]
    RankMismatch {
        /// The NCCL call refused, e.g. `"ncclDevCommCreate"`.
        call: &'static str,
        /// What differs (NCCL's name for it where it has one, e.g. `"lsaBarrierCount"`).
        field: &'static str,
        /// The rank whose value the others are compared with (rank 0).
        first: usize,
        /// Its value.
        expected: u64,
        /// The first rank (in rank order) whose value differs.
        rank: usize,
        /// That rank's value.
        value: u64,
    },

    /// The call is not allowed in the current state (e.g. a collective on a communicator that
    /// was aborted, or a plain call while a [`Group`](crate::Group) is open on this thread).
    #[error("invalid usage: {0}")]
    InvalidUsage(String),

    /// The call was refused before reaching NCCL because this rank's communicator is
    /// suspended ([`Comm::suspend`](crate::Comm::suspend)): NCCL allows only queries,
    /// [`Comm::resume`](crate::Comm::resume), abort and destroy until it is resumed. The
    /// check is per rank: each rank refuses the calls made on its own communicator. Not
    /// fatal: nothing was changed, and the communicator works again once resumed.
    #[error(
        "{call} on rank {rank}: the communicator is suspended; resume it first \
         (Comm::resume, on every rank)"
    )]
    Suspended {
        /// The refused call, e.g. `"ncclAllReduce"`.
        call: &'static str,
        /// The rank whose communicator is suspended.
        rank: usize,
    },

    /// No CUDA driver or no GPU: this machine cannot run NCCL work.
    #[error("no CUDA GPU available: {0}")]
    NoGpu(String),

    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Cuda(#[from] cudarc::driver::DriverError),

    /// No NCCL library could be loaded.
    #[error(transparent)]
    LibraryNotFound(#[from] LibraryNotFound),

    /// The loaded library does not export a function this call needs.
    #[error("the NCCL library at {path} does not export `{symbol}` (library version {version})")]
    MissingSymbol {
        /// The missing function.
        symbol: &'static str,
        /// The library that was loaded.
        path: PathBuf,
        /// Its version.
        version: Version,
    },

    /// Waiting for an operation took longer than allowed. Where several ranks wait for one
    /// that never comes (a creation a rank never joins), a rank may instead see the remote
    /// error of a peer that timed out first: see
    /// [`CommConfig::ready_timeout`](crate::CommConfig::ready_timeout).
    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// How long the wait lasted.
        waited: Duration,
    },

    /// Bootstrapping (launcher detection or unique-id exchange) failed. The bootstrap
    /// module's own error is inside, carried as a [`BoxedError`] so that this ground-floor
    /// type does not name a layer above it; `Error::bootstrap()` hands it back typed.
    #[error(transparent)]
    Bootstrap(BoxedError),

    /// Building or loading device code failed (`device::kernel`: no nvcc, a compile error
    /// with nvcc's output, NCCL headers missing or newer than the library). Its own error,
    /// `device::kernel::KernelError`, is inside, carried as a [`BoxedError`] so that this
    /// ground-floor type does not name a layer above it.
    #[error(transparent)]
    Kernel(BoxedError),

    /// A flight record could not be read (not JSON, a field missing or of the wrong type),
    /// or records given to the analyser do not belong together; see
    /// [`crate::diagnostics::flight`].
    #[error("flight record: {0}")]
    FlightRecordFormat(String),

    /// Reading or writing a file failed (a flight record's, for example).
    #[error("{what}: {source}")]
    Io {
        /// What was being done, with the path.
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// Nothing answers NCCL's RAS queries at `addr`: nothing listens there (an NCCL older
    /// than 2.24, `NCCL_RAS_ENABLE=0`, no communicator created yet in any process of the
    /// job on this host, or another `NCCL_RAS_ADDR`), or the address does not resolve. See
    /// [`crate::diagnostics::ras`].
    #[error("NCCL RAS is not available at {addr}: {reason}")]
    RasUnavailable {
        /// The address asked.
        addr: String,
        /// Why not.
        reason: String,
    },

    /// NCCL's RAS server at `addr` answered something this client does not understand, or
    /// closed the connection early.
    #[error("NCCL RAS at {addr}: {reason}")]
    RasProtocol {
        /// The address asked.
        addr: String,
        /// What went wrong.
        reason: String,
    },

    /// NCCL's RAS server at `addr` did not answer within `waited` (its status query gathers
    /// data from every process of the job, which takes longer when some are unresponsive).
    #[error("NCCL RAS at {addr} did not answer within {waited:?}")]
    RasTimeout {
        /// The address asked.
        addr: String,
        /// How long this client waited.
        waited: Duration,
    },
}

fn last_error_suffix(last: &Option<String>) -> String {
    match last {
        Some(text) if !text.trim().is_empty() => format!(" (last NCCL error: {})", text.trim()),
        _ => String::new(),
    }
}

impl Error {
    /// The NCCL result code, if this is an NCCL failure.
    pub fn nccl_code(&self) -> Option<ResultCode> {
        match self {
            Error::Nccl { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the feature asked for cannot be had here: the library is too old for it
    /// ([`Error::Unsupported`]) or it does not work on this system ([`Error::Unavailable`]).
    ///
    /// A peer's refusal for the same kind of reason ([`Error::RankRefused`] with
    /// [`Refusal::DeviceAbi`], [`Refusal::Unsupported`] or [`Refusal::Unavailable`]) counts
    /// too, so every rank of a call that one rank cannot make takes the same branch.
    pub fn is_unsupported(&self) -> bool {
        matches!(
            self,
            Error::Unsupported { .. }
                | Error::Unavailable { .. }
                | Error::RankRefused {
                    reason: Refusal::DeviceAbi | Refusal::Unsupported | Refusal::Unavailable,
                    ..
                }
        )
    }

    /// Whether the communicator involved can no longer be used and must be aborted, per
    /// NCCL's error table. Argument errors caught by this crate, unsupported APIs and
    /// invalid-argument results from NCCL leave the communicator as it was.
    pub fn is_fatal(&self) -> bool {
        match self {
            Error::Nccl { code, .. } => code.is_fatal(),
            Error::Timeout { .. } | Error::Cuda(_) => true,
            _ => false,
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    pub(crate) fn usage(msg: impl Into<String>) -> Self {
        Error::InvalidUsage(msg.into())
    }
}

/// Why a rank refused, on its own, a call that every rank makes together, as the other
/// ranks learn it from the call's agreement ([`Error::RankRefused`]). The refusing rank
/// returns its own, fuller error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Refusal {
    /// Its device code was compiled against NCCL headers the loaded library cannot lay a
    /// device communicator out for: newer than the library, older than 2.29.2, or (GIN)
    /// another version than the library's.
    DeviceAbi,
    /// The loaded library is too old for something it asked for.
    Unsupported,
    /// Its communicator lacks something it asked for (device-API support, multicast, GIN).
    Unavailable,
    /// Its arguments were invalid.
    InvalidArgument,
    /// A query it needed failed (an NCCL or CUDA error), or a refusal this crate's version
    /// on that rank names differently.
    Failed,
}

impl Refusal {
    /// The refusal's number in an agreement's exchange (0 means none).
    pub(crate) fn code(self) -> u64 {
        match self {
            Refusal::DeviceAbi => 1,
            Refusal::Unsupported => 2,
            Refusal::Unavailable => 3,
            Refusal::InvalidArgument => 4,
            Refusal::Failed => 5,
        }
    }

    /// The refusal numbered `code` (`None` for 0, no refusal).
    pub(crate) fn from_code(code: u64) -> Option<Refusal> {
        Some(match code {
            0 => return None,
            1 => Refusal::DeviceAbi,
            2 => Refusal::Unsupported,
            3 => Refusal::Unavailable,
            4 => Refusal::InvalidArgument,
            _ => Refusal::Failed,
        })
    }

    /// The refusal a rank's own error stands for.
    pub(crate) fn of(err: &Error) -> Refusal {
        match err {
            Error::Unsupported { .. } | Error::MissingSymbol { .. } => Refusal::Unsupported,
            Error::Unavailable { .. } => Refusal::Unavailable,
            Error::InvalidArgument(_) => Refusal::InvalidArgument,
            _ => Refusal::Failed,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refusal::DeviceAbi => {
                "its device code was compiled against NCCL headers the library cannot serve"
            }
            Refusal::Unsupported => "its NCCL library is too old for what it asked",
            Refusal::Unavailable => "its communicator lacks what it asked for",
            Refusal::InvalidArgument => "its arguments were invalid",
            Refusal::Failed => "a query it needed failed",
        })
    }
}

/// An error of a layer built on the core (the `bootstrap` module), carried by [`Error`]
/// without the core naming its type. Display, `Debug` and `source` are the inner error's.
pub struct BoxedError(Box<dyn std::error::Error + Send + Sync + 'static>);

impl BoxedError {
    /// Wraps `error`.
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Box::new(error))
    }

    /// The inner error, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.downcast_ref()
    }

    /// The inner error by value, if it is an `E`; otherwise `self` back.
    pub fn downcast<E: std::error::Error + 'static>(self) -> std::result::Result<E, Self> {
        self.0.downcast().map(|boxed| *boxed).map_err(Self)
    }
}

impl fmt::Debug for BoxedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for BoxedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for BoxedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// The NCCL library could not be loaded from any of the places searched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryNotFound {
    /// Every place tried, in order, with why it failed.
    pub attempts: Vec<LoadAttempt>,
}

/// One failed attempt to load the NCCL library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadAttempt {
    /// Where the candidate came from (e.g. `"NCCL_HOME"`).
    pub source: &'static str,
    /// The path or soname handed to the dynamic loader.
    pub candidate: PathBuf,
    /// Why it failed.
    pub reason: String,
}

impl fmt::Display for LibraryNotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "could not load the NCCL library (libnccl.so.2); tried:")?;
        for attempt in &self.attempts {
            writeln!(
                f,
                "  - {} [{}]: {}",
                attempt.candidate.display(),
                attempt.source,
                attempt.reason
            )?;
        }
        write!(
            f,
            "fix: install NCCL (e.g. the libnccl2 package or `pip install nvidia-nccl-cu13`), \
             then set NCCL_LIBRARY=/path/to/libnccl.so.2 (for a pip install: \
             NCCL_LIBRARY=\"$(python3 -c 'import nvidia.nccl; print(nvidia.nccl.__path__[0])')\
             /lib/libnccl.so.2\"), or NCCL_HOME to the directory holding lib/libnccl.so.2, or \
             add that lib directory to LD_LIBRARY_PATH, or call nccl::library::load_from(path)"
        )
    }
}

impl std::error::Error for LibraryNotFound {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_codes_round_trip_and_unknown_is_kept() {
        for raw in 0..=12u32 {
            let code = ResultCode::from_raw(nccl_sys::ncclResult_t(raw as _));
            assert_eq!(code.code(), raw);
        }
        assert_eq!(
            ResultCode::from_raw(nccl_sys::ncclResult_t(8)),
            ResultCode::Timeout
        );
        assert_eq!(
            ResultCode::from_raw(nccl_sys::ncclResult_t(42)),
            ResultCode::Unknown(42)
        );
        assert_eq!(
            ResultCode::from_raw(nccl_sys::ncclResult_t(6)).name(),
            "ncclRemoteError"
        );
    }

    #[test]
    fn fatality_follows_nccl_table() {
        assert!(!ResultCode::InvalidArgument.is_fatal());
        assert!(!ResultCode::InProgress.is_fatal());
        for fatal in [
            ResultCode::UnhandledCudaError,
            ResultCode::SystemError,
            ResultCode::InternalError,
            ResultCode::InvalidUsage,
            ResultCode::RemoteError,
            ResultCode::Timeout,
            ResultCode::Unknown(99),
        ] {
            assert!(fatal.is_fatal(), "{fatal}");
        }
        assert!(!Error::invalid("x").is_fatal());
        let unavailable = Error::Unavailable {
            api: "ncclCommWindowRegister",
            reason: "no symmetric memory".into(),
        };
        assert!(!unavailable.is_fatal());
        assert!(unavailable.is_unsupported());
        assert_eq!(
            unavailable.to_string(),
            "ncclCommWindowRegister is not available here: no symmetric memory"
        );
        assert!(!Error::invalid("x").is_unsupported());
        let suspended = Error::Suspended {
            call: "ncclAllReduce",
            rank: 2,
        };
        assert!(!suspended.is_fatal());
        assert_eq!(
            suspended.to_string(),
            "ncclAllReduce on rank 2: the communicator is suspended; resume it first \
             (Comm::resume, on every rank)"
        );
    }

    #[test]
    fn nccl_error_message_names_call_code_and_last_error() {
        let err = Error::Nccl {
            call: "ncclAllReduce",
            code: ResultCode::InvalidUsage,
            description: "invalid usage".into(),
            last_error: Some("peer 3 unreachable\n".into()),
        };
        let text = err.to_string();
        assert!(text.contains("ncclAllReduce"), "{text}");
        assert!(text.contains("ncclInvalidUsage (5)"), "{text}");
        assert!(text.contains("peer 3 unreachable"), "{text}");
        assert!(err.is_fatal());
        assert_eq!(err.nccl_code(), Some(ResultCode::InvalidUsage));
    }

    #[test]
    fn not_found_lists_every_attempt_and_a_fix() {
        let err = LibraryNotFound {
            attempts: vec![
                LoadAttempt {
                    source: "NCCL_HOME",
                    candidate: "/opt/nccl/lib/libnccl.so.2".into(),
                    reason: "no such file".into(),
                },
                LoadAttempt {
                    source: "dynamic linker",
                    candidate: "libnccl.so.2".into(),
                    reason: "cannot open shared object file".into(),
                },
            ],
        };
        let text = err.to_string();
        assert!(text.contains("/opt/nccl/lib/libnccl.so.2 [NCCL_HOME]: no such file"));
        assert!(text.contains("libnccl.so.2 [dynamic linker]"));
        assert!(text.contains("NCCL_LIBRARY"));
        assert!(
            text.contains(
                "NCCL_LIBRARY=\"$(python3 -c 'import nvidia.nccl; print(nvidia.nccl.__path__[0])')\
             /lib/libnccl.so.2\""
            ),
            "{text}"
        );
    }
}
