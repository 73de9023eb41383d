//! Finding, loading and versioning the NCCL shared library.
//!
//! Nothing links against NCCL at build time: `libnccl.so.2` is opened the first time any NCCL
//! function is needed. Once a library has loaded it is the process's NCCL for good (every
//! communicator refers to it); a failed attempt is not remembered, so the next call searches
//! again and an explicit [`load_from`] after a failure can still succeed.
//!
//! # Search order
//!
//! 1. `NCCL_LIBRARY`: the path of the library file itself. When it is set, it is the only
//!    candidate: a library the user named explicitly that fails to load is an error, never
//!    silently replaced by another one.
//! 2. `NCCL_HOME`: `$NCCL_HOME/lib/libnccl.so.2`, then `lib/libnccl.so`, `lib64/libnccl.so.2`.
//! 3. The path recorded at build time by this crate's build script from `NCCL_HOME` or
//!    `CUDA_HOME`, if such a library existed then (the build never fails when none does).
//! 4. The dynamic linker's own lookup (`LD_LIBRARY_PATH`, `ldconfig` cache, ...): `libnccl.so.2`,
//!    then `libnccl.so`.
//! 5. Python environments: `site-packages/nvidia/nccl/lib/libnccl.so.2` (where
//!    `pip install nvidia-nccl-cu13` or `-cu12` puts it) under `VIRTUAL_ENV` and
//!    `CONDA_PREFIX`, and `$CONDA_PREFIX/lib/libnccl.so.2`.
//! 6. A system Python, no environment active: the same file under each `PYTHONPATH` entry,
//!    the user's `site-packages` (`$PYTHONUSERBASE`, else `~/.local`), then
//!    `/usr/local/lib/python3.*/dist-packages` and `site-packages`,
//!    `/usr/lib/python3/dist-packages`, `/usr/lib/python3.*/site-packages`,
//!    `/usr/lib64/python3.*/site-packages`, `/opt/conda/lib/python3.*/site-packages`, and
//!    finally `/opt/conda/lib/libnccl.so.2`. Newer Pythons come first; only directories that
//!    exist are tried.
//!
//! When nothing loads, [`Error::LibraryNotFound`] lists every place tried and why each failed,
//! in the dynamic loader's words (a file that is not a library, a missing dependency, ...).
//! A program can also choose the library itself with [`load_from`] before its first NCCL call.
//!
//! # Versions
//!
//! [`version`] reports the version of the library that was loaded, which may differ from the
//! header the bindings were generated from (2.32.3). Every API newer than NCCL 2.18 checks it
//! first and returns [`Error::Unsupported`] on an older library, instead of failing inside
//! NCCL or calling a symbol that is not there.

mod search;

use std::ffi::CStr;
use std::fmt;
use std::path::Path;
use std::sync::{Mutex, OnceLock, PoisonError};

use nccl_sys::{ncclResult_t, MissingSymbol, NcclLib};

use self::search::{candidates, env_var, search, Candidate};
use crate::calls::Call;
use crate::error::{Error, LibraryNotFound, Result, ResultCode};
pub use crate::release::Version;

/// The loaded NCCL library: its function table, where it came from, and its version.
pub struct Library {
    api: NcclLib,
    version: Version,
    source: &'static str,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library")
            .field("path", &self.api.path())
            .field("version", &self.version)
            .field("source", &self.source)
            .finish()
    }
}

impl Library {
    /// Opens the library at `path` and checks that it is NCCL.
    fn open(path: &Path, source: &'static str) -> std::result::Result<Self, String> {
        // SAFETY: loading a shared library runs its initialisers; NCCL's are benign, and a
        // candidate is only ever a file named like NCCL or chosen explicitly by the user.
        let api = unsafe { NcclLib::open(path) }.map_err(|e| with_sources(&e))?;
        let mut code = 0;
        // SAFETY: `code` is a valid writable int for the duration of the call.
        let status = unsafe { api.ncclGetVersion(&mut code) }
            .map_err(|_| "not an NCCL library: it does not export ncclGetVersion".to_string())?;
        if status != ncclResult_t::ncclSuccess || code <= 0 {
            return Err(format!(
                "ncclGetVersion failed ({}, version code {code})",
                ResultCode::from_raw(status)
            ));
        }
        let version = Version::from_code(code as u32);
        // `require` relies on this: every 2.0 requirement holds for a loaded library.
        if version < Version::new(2, 0, 0) {
            return Err(format!("NCCL {version} is too old: nccl-rs needs NCCL 2"));
        }
        Ok(Self {
            api,
            version,
            source,
        })
    }

    /// The version reported by the library's `ncclGetVersion`.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The path or soname the library was loaded from.
    pub fn path(&self) -> &Path {
        self.api.path()
    }

    /// Which step of the search order found the library (e.g. `"NCCL_HOME"`).
    pub fn source(&self) -> &'static str {
        self.source
    }

    /// The raw function table, for calls this crate does not wrap.
    pub fn api(&self) -> &NcclLib {
        &self.api
    }

    /// Fails with [`Error::Unsupported`] unless the library is at least `needs`.
    #[inline(always)]
    pub fn require(&self, api: &'static str, needs: Version) -> Result<()> {
        // Every loadable library is 2.x, so a 2.0 requirement (most collectives, types and
        // operators) is met without reading the version: inlined where `needs` is a
        // constant, the check then disappears from the call's path.
        if needs <= Version::new(2, 0, 0) || self.version >= needs {
            Ok(())
        } else {
            Err(self.too_old(api, needs))
        }
    }

    /// Fails with [`Error::Unsupported`] unless the library has `call` (its row's first
    /// version).
    #[inline(always)]
    pub(crate) fn require_call(&self, call: &'static Call) -> Result<()> {
        self.require(call.name, call.since)
    }

    #[cold]
    #[inline(never)]
    fn too_old(&self, api: &'static str, needs: Version) -> Error {
        Error::Unsupported {
            api,
            needs,
            found: self.version,
        }
    }

    /// Turns the outcome of an NCCL call into a `Result`. `ncclInProgress` is an error here:
    /// calls that may legitimately return it use [`Library::check_pending`].
    pub(crate) fn check(
        &self,
        call: &'static str,
        status: std::result::Result<ncclResult_t, MissingSymbol>,
    ) -> Result<()> {
        match self.check_pending(call, status)? {
            false => Ok(()),
            true => Err(self.error(call, ResultCode::InProgress)),
        }
    }

    /// Like [`Library::check`], but `ncclInProgress` is success that still has to complete:
    /// returns whether the operation is pending.
    pub(crate) fn check_pending(
        &self,
        call: &'static str,
        status: std::result::Result<ncclResult_t, MissingSymbol>,
    ) -> Result<bool> {
        let status = status.map_err(|missing| self.missing(missing))?;
        match ResultCode::from_raw(status) {
            ResultCode::Success => Ok(false),
            ResultCode::InProgress => Ok(true),
            code => Err(self.error(call, code)),
        }
    }

    pub(crate) fn missing(&self, missing: MissingSymbol) -> Error {
        Error::MissingSymbol {
            symbol: missing.name,
            path: self.path().to_path_buf(),
            version: self.version,
        }
    }

    /// Builds the error for a failed call, with NCCL's texts.
    pub(crate) fn error(&self, call: &'static str, code: ResultCode) -> Error {
        let raw = ncclResult_t(code.code() as _);
        // SAFETY: ncclGetErrorString returns a pointer to a static string (or null when the
        // symbol is missing, handled by the Result); it is copied out immediately.
        let description = unsafe { self.api.ncclGetErrorString(raw) }
            .ok()
            .and_then(copy_c_str)
            .unwrap_or_else(|| code.name().to_string());
        // SAFETY: ncclGetLastError ignores its argument (null is documented as allowed) and
        // returns a pointer to a process-global buffer, copied out immediately.
        let last_error = unsafe { self.api.ncclGetLastError(std::ptr::null_mut()) }
            .ok()
            .and_then(copy_c_str)
            .filter(|text| !text.trim().is_empty());
        Error::Nccl {
            call,
            code,
            description,
            last_error,
        }
    }
}

/// An error's text followed by its sources': libloading's own text is only "dlopen failed",
/// the reason (`dlerror`, e.g. "invalid ELF header") is its source.
fn with_sources(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn copy_c_str(ptr: *const std::os::raw::c_char) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: NCCL returns NUL-terminated strings that stay valid at least until the next
    // call on this thread; the text is copied before any further NCCL call.
    Some(
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// The process's NCCL once one has loaded. It is never replaced or unloaded: communicators
/// hold `&'static Library`. Failures are not stored, so a later attempt can still succeed.
static LIBRARY: OnceLock<Library> = OnceLock::new();

/// Held while a library is being opened, so that concurrent first uses open one library and
/// all get it. Only the loading paths take it; [`get`] after a load is a single atomic read.
static LOADING: Mutex<()> = Mutex::new(());

/// The loaded library, loading it on first use by the documented search order.
///
/// A failed search is not remembered: the next call searches again, so a library installed or
/// pointed at in the meantime (or chosen with [`load_from`]) is picked up.
#[inline]
pub fn get() -> Result<&'static Library> {
    match LIBRARY.get() {
        Some(lib) => Ok(lib),
        None => search_and_load(),
    }
}

#[cold]
#[inline(never)]
fn search_and_load() -> Result<&'static Library> {
    load_once(None, || {
        search(&candidates(
            &env_var,
            option_env!("NCCL_RS_BUILD_HINT"),
            Path::new("/"),
        ))
    })
}

/// Loads NCCL from `path` instead of searching.
///
/// Returns the library if it is now the process's NCCL (also when the same path was already
/// loaded). Fails if this library cannot be loaded, with the dynamic loader's reason, or if
/// another library is already the process's NCCL. A failed attempt, explicit or implicit,
/// leaves nothing behind: a later `load_from` of a working library succeeds, and from then on
/// every NCCL call uses it.
pub fn load_from(path: impl AsRef<Path>) -> Result<&'static Library> {
    let path = path.as_ref();
    load_once(Some(path), || {
        search(&[Candidate {
            source: "load_from",
            path: path.to_path_buf(),
            explicit: true,
        }])
    })
}

/// Runs `open` unless a library is already loaded, and keeps what it opens for the process.
/// With `wanted`, an already loaded library must have been loaded from that path.
fn load_once(
    wanted: Option<&Path>,
    open: impl FnOnce() -> std::result::Result<Library, LibraryNotFound>,
) -> Result<&'static Library> {
    // The lock guards no data, so a panic in another loader leaves nothing inconsistent.
    let _loading = LOADING.lock().unwrap_or_else(PoisonError::into_inner);
    let lib = match LIBRARY.get() {
        Some(lib) => lib,
        // Only the holder of `LOADING` initialises, so `open` runs at most once at a time and
        // its library is the one stored.
        None => {
            let opened = open()?;
            LIBRARY.get_or_init(|| opened)
        }
    };
    match wanted {
        Some(path) if lib.path() != path => Err(Error::usage(format!(
            "NCCL was already loaded from {} before load_from({})",
            lib.path().display(),
            path.display()
        ))),
        _ => Ok(lib),
    }
}

/// The version of the loaded NCCL library (loading it if needed).
pub fn version() -> Result<Version> {
    Ok(get()?.version())
}

/// The number of CUDA devices visible to this process (`CUDA_VISIBLE_DEVICES` applies).
///
/// Unlike cudarc's own calls, which panic when the CUDA driver library is missing, this returns
/// [`Error::NoGpu`] on a machine without an NVIDIA driver, and also when no device is visible.
pub fn cuda_device_count() -> Result<usize> {
    if !shared_library_present(&["libcuda.so.1", "libcuda.so"]) {
        return Err(Error::NoGpu(
            "the CUDA driver library (libcuda.so.1) was not found; is an NVIDIA driver installed?"
                .into(),
        ));
    }
    let count = cudarc::driver::CudaContext::device_count()?;
    match usize::try_from(count) {
        Ok(0) | Err(_) => Err(Error::NoGpu(format!(
            "the CUDA driver reports no usable device (CUDA_VISIBLE_DEVICES={:?})",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
        ))),
        Ok(count) => Ok(count),
    }
}

/// Whether the CUDA driver loads kernels lazily (`CUDA_MODULE_LOADING` unset or `LAZY`, the
/// default since CUDA 12.2; read by the driver once, when the process first uses CUDA).
/// Lazily, a kernel's first lookup or launch can wait for everything running in its context,
/// which ranks of one process sharing a GPU cannot allow ([`Comm::init_all`](crate::Comm::init_all)
/// refuses them). Asks the driver, so the process must have used CUDA already (a context or
/// [`cuda_device_count`]); else the driver's error.
pub fn lazy_module_loading() -> Result<bool> {
    use cudarc::driver::sys::{cuModuleGetLoadingMode, CUmoduleLoadingMode, CUresult};
    let mut mode = CUmoduleLoadingMode::CU_MODULE_EAGER_LOADING;
    // SAFETY: writes one enum through a valid pointer; callers hold a CUDA context, so the
    // driver is initialised.
    let rc = unsafe { cuModuleGetLoadingMode(&mut mode) };
    if rc != CUresult::CUDA_SUCCESS {
        return Err(cudarc::driver::DriverError(rc).into());
    }
    Ok(mode == CUmoduleLoadingMode::CU_MODULE_LAZY_LOADING)
}

/// Whether the dynamic loader finds a library under one of `names`. cudarc's own probe
/// (`is_culib_present`) exists only when cudarc loads its libraries at run time, and another
/// crate of the build may have chosen to link them instead.
pub(crate) fn shared_library_present(names: &[&str]) -> bool {
    names.iter().any(|name| {
        // SAFETY: opening the CUDA driver (or another CUDA library) runs only its own
        // initialisers, which expect to be loaded by any process; the handle is closed at once.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_count_is_an_error_not_a_panic_without_gpus() {
        // On machines with GPUs this is a count; elsewhere a typed error, never a panic.
        match cuda_device_count() {
            Ok(count) => assert!(count > 0),
            Err(Error::NoGpu(reason)) => assert!(!reason.is_empty()),
            Err(other) => panic!("unexpected error {other}"),
        }
    }

    #[test]
    fn require_reports_needed_and_found() {
        let err = Error::Unsupported {
            api: "ncclCommShrink",
            needs: Version::new(2, 27, 0),
            found: Version::new(2, 26, 2),
        };
        assert_eq!(
            err.to_string(),
            "ncclCommShrink needs NCCL 2.27.0 or newer, but the loaded library is NCCL 2.26.2"
        );
    }
}
