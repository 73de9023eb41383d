//! The nccl.h macros that bindgen cannot turn into constants, written out by hand.
//!
//! bindgen evaluates plain integer macros (see the generated `NCCL_*` constants), but not
//! macros that expand to `INT_MIN`, `NULL` or a `float`, nor function-like macros.

use core::ffi::{c_int, c_void};
use core::ptr;

use crate::bindings::{ncclComm_t, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, NCCL_VERSION_CODE};

/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`): an `int` field of a config struct left for NCCL to
/// choose.
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// `NCCL_CONFIG_UNDEF_PTR` (`NULL`): a pointer field of a config struct left unset.
pub const NCCL_CONFIG_UNDEF_PTR: *const c_void = ptr::null();

/// `NCCL_UNDEF_FLOAT` (`-1.0f`): a `float` field not filled in (e.g.
/// [`ncclSimInfo_t::estimatedTime`](crate::ncclSimInfo_t) before a simulation).
pub const NCCL_UNDEF_FLOAT: f32 = -1.0;

/// `NCCL_COMM_NULL` (`NULL`): no communicator, e.g. what `ncclCommSplit` yields for a rank that
/// passed [`NCCL_SPLIT_NOCOLOR`](crate::NCCL_SPLIT_NOCOLOR).
pub const NCCL_COMM_NULL: ncclComm_t = ptr::null_mut();

/// The `NCCL_VERSION(X, Y, Z)` macro: the version code of NCCL `X.Y.Z`, in the form
/// [`NCCL_VERSION_CODE`](crate::NCCL_VERSION_CODE) and `ncclGetVersion` use.
///
/// Versions up to 2.8 are coded as `X*1000 + Y*100 + Z` (2.8.4 is 2804), later ones as
/// `X*10000 + Y*100 + Z` (2.32.3 is 23203).
#[must_use]
pub const fn nccl_version_code(x: c_int, y: c_int, z: c_int) -> c_int {
    if x <= 2 && y <= 8 {
        x * 1000 + y * 100 + z
    } else {
        x * 10000 + y * 100 + z
    }
}

// The generated version constants must agree with each other.
const _: () = assert!(nccl_version_code(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH) == NCCL_VERSION_CODE);
