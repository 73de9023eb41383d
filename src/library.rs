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

use std::ffi::{CStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

use nccl_sys::{ncclResult_t, MissingSymbol, NcclLib};

use crate::error::{Error, LibraryNotFound, LoadAttempt, Result, ResultCode};

/// An NCCL release version, e.g. 2.28.3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major version (2 for every NCCL 2.x).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl Version {
    /// A version from its parts.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }

    /// Decodes an `NCCL_VERSION_CODE` as returned by `ncclGetVersion`.
    ///
    /// NCCL changed the encoding at 2.9: before, `X*1000 + Y*100 + Z` (2.8.4 is 2804); since,
    /// `X*10000 + Y*100 + Z` (2.28.3 is 22803). Codes of the new form are all at least 20900,
    /// old ones at most 2899, so the magnitude tells them apart.
    pub const fn from_code(code: u32) -> Self {
        if code >= 10_000 {
            Self::new(code / 10_000, (code % 10_000) / 100, code % 100)
        } else {
            Self::new(code / 1_000, (code % 1_000) / 100, code % 100)
        }
    }

    /// Encodes the version the way NCCL's `NCCL_VERSION(X, Y, Z)` macro does.
    pub const fn code(self) -> u32 {
        if self.major <= 2 && self.minor <= 8 {
            self.major * 1_000 + self.minor * 100 + self.patch
        } else {
            self.major * 10_000 + self.minor * 100 + self.patch
        }
    }

    /// The version of the header the bindings were generated from.
    pub const HEADER: Version = Version::new(
        nccl_sys::NCCL_MAJOR as u32,
        nccl_sys::NCCL_MINOR as u32,
        nccl_sys::NCCL_PATCH as u32,
    );
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

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
    pub fn require(&self, api: &'static str, needs: Version) -> Result<()> {
        // Every loadable library is 2.x, so a 2.0 requirement (most collectives, types and
        // operators) is met without reading the version: one memory access less on every
        // call's path.
        if needs <= Version::new(2, 0, 0) || self.version >= needs {
            Ok(())
        } else {
            Err(Error::Unsupported {
                api,
                needs,
                found: self.version,
            })
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
    // SAFETY: only tries to dlopen the driver library under its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
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

fn env_var(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|value| !value.is_empty())
}

/// One place the search will try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) source: &'static str,
    pub(crate) path: PathBuf,
    /// Named by the user: if it fails, the search stops there.
    pub(crate) explicit: bool,
}

/// Where a pip-installed NCCL lies inside a `site-packages` or `dist-packages` directory
/// (`nvidia-nccl-cu12` and `nvidia-nccl-cu13` alike).
const PIP_NCCL: &str = "nvidia/nccl/lib/libnccl.so.2";

/// Every candidate, in search order, given the environment, the build-time hint and the root
/// of the file system that holds the system-wide Python installations (`/` outside tests).
pub(crate) fn candidates(
    env: &dyn Fn(&str) -> Option<OsString>,
    build_hint: Option<&str>,
    root: &Path,
) -> Vec<Candidate> {
    let candidate = |source, path: PathBuf| Candidate {
        source,
        path,
        explicit: false,
    };
    if let Some(file) = env("NCCL_LIBRARY") {
        return vec![Candidate {
            source: "NCCL_LIBRARY",
            path: file.into(),
            explicit: true,
        }];
    }
    let mut list = Vec::new();
    if let Some(home) = env("NCCL_HOME") {
        let home = PathBuf::from(home);
        for rel in ["lib/libnccl.so.2", "lib/libnccl.so", "lib64/libnccl.so.2"] {
            list.push(candidate("NCCL_HOME", home.join(rel)));
        }
    }
    if let Some(hint) = build_hint.filter(|hint| !hint.is_empty()) {
        list.push(candidate("build-time NCCL_HOME/CUDA_HOME", hint.into()));
    }
    for soname in ["libnccl.so.2", "libnccl.so"] {
        list.push(candidate("dynamic linker", soname.into()));
    }
    for (var, source) in [
        ("VIRTUAL_ENV", "VIRTUAL_ENV site-packages"),
        ("CONDA_PREFIX", "CONDA_PREFIX site-packages"),
    ] {
        if let Some(prefix) = env(var) {
            for site in python_dirs(&Path::new(&prefix).join("lib"), "site-packages") {
                list.push(candidate(source, site.join(PIP_NCCL)));
            }
        }
    }
    if let Some(prefix) = env("CONDA_PREFIX") {
        list.push(candidate(
            "CONDA_PREFIX",
            PathBuf::from(prefix).join("lib/libnccl.so.2"),
        ));
    }
    for (source, site) in system_python_sites(env, root) {
        list.push(candidate(source, site.join(PIP_NCCL)));
    }
    let conda_base = root.join("opt/conda/lib");
    if conda_base.is_dir() {
        list.push(candidate("/opt/conda", conda_base.join("libnccl.so.2")));
    }
    // A path reached two ways (CONDA_PREFIX=/opt/conda, say) is tried once, where first listed.
    let mut seen = std::collections::HashSet::new();
    list.retain(|c| seen.insert(c.path.clone()));
    list
}

/// The package directories of Python installations outside any virtual or conda environment,
/// where `pip install nvidia-nccl-cu13` puts NCCL in a system Python, in the order Python
/// itself prefers them: `PYTHONPATH`, the user's site-packages, then the system-wide ones
/// (Debian's `dist-packages`, other distributions' and source builds' `site-packages`, the
/// base environment of a conda image). Only directories that exist are listed; newer Python
/// versions come first. A few directory reads, no recursion.
fn system_python_sites(
    env: &dyn Fn(&str) -> Option<OsString>,
    root: &Path,
) -> Vec<(&'static str, PathBuf)> {
    let mut sites = Vec::new();
    if let Some(paths) = env("PYTHONPATH") {
        for dir in std::env::split_paths(&paths).filter(|dir| dir.is_dir()) {
            sites.push(("PYTHONPATH", dir));
        }
    }
    let user_base = env("PYTHONUSERBASE")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|home| Path::new(&home).join(".local")));
    if let Some(base) = user_base {
        for site in python_dirs(&base.join("lib"), "site-packages") {
            sites.push(("Python user site-packages", site));
        }
    }
    let system = |rel: &str, leaf: &str| python_dirs(&root.join(rel), leaf);
    let debian_shared = root.join("usr/lib/python3/dist-packages");
    let system_sites = [
        system("usr/local/lib", "dist-packages"),
        system("usr/local/lib", "site-packages"),
        vec![debian_shared]
            .into_iter()
            .filter(|d| d.is_dir())
            .collect(),
        system("usr/lib", "site-packages"),
        system("usr/lib64", "site-packages"),
        system("opt/conda/lib", "site-packages"),
    ];
    for site in system_sites.into_iter().flatten() {
        sites.push(("system Python", site));
    }
    sites
}

/// `<lib>/python3.N/<leaf>` directories that exist, newest Python first (3.12 before 3.9).
fn python_dirs(lib: &Path, leaf: &str) -> Vec<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(lib)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let minor = name.to_str()?.strip_prefix("python3.")?;
            let digits = minor
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(minor.len());
            let minor = minor[..digits].parse().ok()?;
            Some((minor, entry.path().join(leaf)))
        })
        .filter(|(_, dir)| dir.is_dir())
        .collect();
    // Newest first; the path breaks ties (3.13 and free-threaded 3.13t) for a fixed order.
    found.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    found.into_iter().map(|(_, dir)| dir).collect()
}

/// Tries the candidates in order; the first that is a working NCCL wins.
fn search(candidates: &[Candidate]) -> std::result::Result<Library, LibraryNotFound> {
    let mut attempts = Vec::new();
    for candidate in candidates {
        // A bare soname goes to the dynamic linker; anything with a slash must exist.
        let is_path = candidate.path.components().count() > 1;
        let outcome = if is_path && !candidate.path.exists() {
            Err("no such file".to_string())
        } else {
            Library::open(&candidate.path, candidate.source)
        };
        match outcome {
            Ok(lib) => return Ok(lib),
            Err(reason) => {
                attempts.push(LoadAttempt {
                    source: candidate.source,
                    candidate: candidate.path.clone(),
                    reason,
                });
                if candidate.explicit {
                    break;
                }
            }
        }
    }
    Err(LibraryNotFound { attempts })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |name| map.get(name).cloned()
    }

    /// A file-system root without any Python installation.
    fn no_root() -> &'static Path {
        Path::new("/nonexistent/nccl-rs-test-root")
    }

    #[test]
    fn version_codes_decode_both_encodings() {
        assert_eq!(Version::from_code(2804), Version::new(2, 8, 4));
        assert_eq!(Version::from_code(2708), Version::new(2, 7, 8));
        assert_eq!(Version::from_code(20903), Version::new(2, 9, 3));
        assert_eq!(Version::from_code(22803), Version::new(2, 28, 3));
        assert_eq!(Version::from_code(23203), Version::new(2, 32, 3));
        for v in [
            Version::new(2, 4, 8),
            Version::new(2, 8, 4),
            Version::new(2, 9, 6),
            Version::new(2, 28, 9),
            Version::new(2, 32, 3),
        ] {
            assert_eq!(Version::from_code(v.code()), v);
        }
        assert_eq!(Version::new(2, 28, 3).to_string(), "2.28.3");
        assert!(Version::new(2, 28, 9) > Version::new(2, 28, 3));
        assert!(Version::new(2, 9, 0) > Version::new(2, 8, 4));
        assert_eq!(Version::HEADER, Version::new(2, 32, 3));
        assert_eq!(Version::HEADER.code(), 23203);
    }

    #[test]
    fn nccl_library_is_the_only_candidate_when_set() {
        let list = candidates(
            &env_of(&[("NCCL_LIBRARY", "/x/libnccl.so.2"), ("NCCL_HOME", "/h")]),
            Some("/hint/libnccl.so.2"),
            no_root(),
        );
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].path, PathBuf::from("/x/libnccl.so.2"));
        assert!(list[0].explicit);
    }

    #[test]
    fn search_order_is_home_hint_linker_then_python() {
        let venv = std::env::temp_dir().join(format!("nccl-rs-venv-{}", std::process::id()));
        let site = venv.join("lib/python3.12/site-packages");
        std::fs::create_dir_all(&site).unwrap();
        let list = candidates(
            &env_of(&[
                ("NCCL_HOME", "/h"),
                ("VIRTUAL_ENV", venv.to_str().unwrap()),
                ("CONDA_PREFIX", "/conda"),
            ]),
            Some("/hint/libnccl.so.2"),
            no_root(),
        );
        let got: Vec<(String, &str)> = list
            .iter()
            .map(|c| (c.path.display().to_string(), c.source))
            .collect();
        let want = vec![
            ("/h/lib/libnccl.so.2".to_string(), "NCCL_HOME"),
            ("/h/lib/libnccl.so".to_string(), "NCCL_HOME"),
            ("/h/lib64/libnccl.so.2".to_string(), "NCCL_HOME"),
            (
                "/hint/libnccl.so.2".to_string(),
                "build-time NCCL_HOME/CUDA_HOME",
            ),
            ("libnccl.so.2".to_string(), "dynamic linker"),
            ("libnccl.so".to_string(), "dynamic linker"),
            (
                site.join("nvidia/nccl/lib/libnccl.so.2")
                    .display()
                    .to_string(),
                "VIRTUAL_ENV site-packages",
            ),
            ("/conda/lib/libnccl.so.2".to_string(), "CONDA_PREFIX"),
        ];
        assert_eq!(got, want);
        assert!(list.iter().all(|c| !c.explicit));
        std::fs::remove_dir_all(&venv).unwrap();
    }

    /// A scratch directory for one test, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("nccl-rs-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn mkdirs(&self, rels: &[&str]) {
            for rel in rels {
                std::fs::create_dir_all(self.0.join(rel)).unwrap();
            }
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn system_python_sites_are_searched_in_pythons_order() {
        let root = Scratch::new("system-python");
        root.mkdirs(&[
            "pp/a",
            "home/u/.local/lib/python3.11/site-packages",
            "usr/local/lib/python3.9/dist-packages",
            "usr/local/lib/python3.12/dist-packages",
            "usr/local/lib/python3.10/dist-packages",
            "usr/local/lib/python3.13t/dist-packages",
            "usr/local/lib/python3.13/dist-packages",
            "usr/local/lib/python3.12/site-packages",
            "usr/local/lib/python3.11/lib-dynload", // a Python without dist-packages
            "usr/local/lib/pythonista/dist-packages", // not a Python 3 directory
            "usr/lib/python3/dist-packages",
            "usr/lib/python3.12/site-packages",
            "usr/lib64/python3.12/site-packages",
            "opt/conda/lib/python3.11/site-packages",
        ]);
        let r = |rel: &str| root.0.join(rel).display().to_string();
        let pythonpath = format!("{}:{}", r("pp/a"), r("pp/missing"));
        let home = r("home/u");
        let list = candidates(
            &env_of(&[("PYTHONPATH", &pythonpath), ("HOME", &home)]),
            None,
            &root.0,
        );
        let got: Vec<(String, &str)> = list
            .iter()
            .skip(2) // the dynamic linker's two
            .map(|c| (c.path.display().to_string(), c.source))
            .collect();
        let pip = |rel: &str| r(&format!("{rel}/nvidia/nccl/lib/libnccl.so.2"));
        let want = vec![
            (pip("pp/a"), "PYTHONPATH"),
            (
                pip("home/u/.local/lib/python3.11/site-packages"),
                "Python user site-packages",
            ),
            (
                pip("usr/local/lib/python3.13/dist-packages"),
                "system Python",
            ),
            (
                pip("usr/local/lib/python3.13t/dist-packages"),
                "system Python",
            ),
            (
                pip("usr/local/lib/python3.12/dist-packages"),
                "system Python",
            ),
            (
                pip("usr/local/lib/python3.10/dist-packages"),
                "system Python",
            ),
            (
                pip("usr/local/lib/python3.9/dist-packages"),
                "system Python",
            ),
            (
                pip("usr/local/lib/python3.12/site-packages"),
                "system Python",
            ),
            (pip("usr/lib/python3/dist-packages"), "system Python"),
            (pip("usr/lib/python3.12/site-packages"), "system Python"),
            (pip("usr/lib64/python3.12/site-packages"), "system Python"),
            (
                pip("opt/conda/lib/python3.11/site-packages"),
                "system Python",
            ),
            (r("opt/conda/lib/libnccl.so.2"), "/opt/conda"),
        ];
        assert_eq!(got, want);

        // PYTHONUSERBASE replaces ~/.local; CONDA_PREFIX=/opt/conda lists each path once.
        root.mkdirs(&["base/lib/python3.12/site-packages"]);
        let conda = r("opt/conda");
        let list = candidates(
            &env_of(&[
                ("PYTHONUSERBASE", &r("base")),
                ("HOME", &home),
                ("CONDA_PREFIX", &conda),
            ]),
            None,
            &root.0,
        );
        let paths: Vec<String> = list.iter().map(|c| c.path.display().to_string()).collect();
        assert!(paths.contains(&pip("base/lib/python3.12/site-packages")));
        assert!(!paths.iter().any(|p| p.contains(".local")), "{paths:#?}");
        let unique: std::collections::HashSet<_> = paths.iter().collect();
        assert_eq!(unique.len(), paths.len(), "{paths:#?}");
        let conda_lib = list
            .iter()
            .find(|c| c.path == Path::new(&r("opt/conda/lib/libnccl.so.2")))
            .unwrap();
        assert_eq!(conda_lib.source, "CONDA_PREFIX", "first listing wins");
    }

    #[test]
    fn a_pip_installed_nccl_in_a_system_python_is_found() {
        let root = Scratch::new("pip-found");
        let lib_dir = "usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib";
        root.mkdirs(&[lib_dir]);
        // Not a working library: the search must reach it and report the loader's reason.
        std::fs::write(root.0.join(lib_dir).join("libnccl.so.2"), [0u8; 256]).unwrap();
        let list: Vec<Candidate> = candidates(&env_of(&[]), None, &root.0)
            .into_iter()
            .filter(|c| c.source != "dynamic linker") // this machine's own NCCL, if any
            .collect();
        let err = search(&list).unwrap_err();
        assert_eq!(err.attempts.len(), 1, "{err}");
        assert_eq!(err.attempts[0].source, "system Python");
        assert!(
            err.attempts[0].reason.contains("invalid ELF header"),
            "{err}"
        );
    }

    #[test]
    fn empty_environment_still_asks_the_dynamic_linker() {
        let list = candidates(&env_of(&[]), None, no_root());
        let paths: Vec<_> = list.iter().map(|c| c.path.clone()).collect();
        assert_eq!(
            paths,
            vec![PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")]
        );
    }

    #[test]
    fn not_found_lists_every_attempt_with_reasons() {
        let list = vec![
            Candidate {
                source: "NCCL_HOME",
                path: "/definitely/not/here/libnccl.so.2".into(),
                explicit: false,
            },
            Candidate {
                source: "dynamic linker",
                path: "libnccl-does-not-exist.so.2".into(),
                explicit: false,
            },
        ];
        let err = search(&list).unwrap_err();
        assert_eq!(err.attempts.len(), 2);
        assert_eq!(err.attempts[0].reason, "no such file");
        assert!(!err.attempts[1].reason.is_empty());
        let text = Error::LibraryNotFound(err).to_string();
        assert!(text.contains("/definitely/not/here/libnccl.so.2 [NCCL_HOME]: no such file"));
        assert!(text.contains("libnccl-does-not-exist.so.2 [dynamic linker]"));
    }

    #[test]
    fn a_library_without_nccl_symbols_is_rejected_and_explicit_stops_search() {
        let list = vec![
            Candidate {
                source: "NCCL_LIBRARY",
                path: "libc.so.6".into(),
                explicit: true,
            },
            Candidate {
                source: "dynamic linker",
                path: "libnccl.so.2".into(),
                explicit: false,
            },
        ];
        let err = search(&list).unwrap_err();
        assert_eq!(
            err.attempts.len(),
            1,
            "explicit candidate must end the search"
        );
        assert!(
            err.attempts[0]
                .reason
                .contains("does not export ncclGetVersion"),
            "{:?}",
            err.attempts
        );
    }

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
