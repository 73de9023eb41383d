//! The kernel toolchain: CUDA C++ that includes `<nccl_device.h>`, compiled at run time by
//! `nvcc` against the headers of the NCCL this process loaded, and loaded with cudarc as a
//! [`DeviceModule`] that knows its [`DeviceAbi`]. A cubin or PTX built elsewhere loads with
//! [`DeviceModule::from_cubin`] / [`DeviceModule::from_ptx`].
//!
//! The rooms: `nvcc.rs` finds the compiler and runs it; `headers.rs` finds the NCCL headers
//! and reads their version.
//!
//! # Why `nvcc` at run time
//!
//! * NVRTC cannot compile `nccl_device.h` as shipped: it includes `<stdint.h>`,
//!   `<stdbool.h>`, `<stdio.h>`, `<type_traits>`, `<cstring>`, `<cassert>`, `<errno.h>`,
//!   `<linux/types.h>`, `<cuda.h>`, `<math.h>` and `nccl.h` `<cuda_runtime.h>`, which NVRTC
//!   does not provide (CUDA 13.0: "cannot open source file stdint.h"; adding `/usr/include`
//!   then fails on `gnu/stubs-32.h`). Stub headers for all of them would be a second copy of
//!   libc and libstdc++ declarations to keep in step with every NCCL release.
//! * LTO IR linked by nvJitLink against NCCL's `libnccl_device.ltoir` needs the IR (only
//!   the pip wheel ships it) and an nvJitLink binding, which cudarc 0.19 does not have.
//! * `nvcc` compiles the headers exactly as NVIDIA's own examples and nccl-tests do, and
//!   NVIDIA's nccl_ep JIT does the same at run time. It needs a CUDA toolkit where the
//!   kernels are built, which any machine that builds CUDA kernels has; for machines without
//!   one, build the cubin elsewhere and load it with [`DeviceModule::from_cubin`].
//!
//! # Which headers
//!
//! The device communicator's layout follows the headers' version, and NCCL refuses device
//! code newer than itself, so headers are looked for beside the loaded library
//! ([`NcclHeaders::find`]): `NCCL_INCLUDE_DIR`, `$NCCL_HOME/include`, the `include/`
//! beside the loaded `libnccl.so` (a pip wheel), `/usr/include`, `/usr/local/include`. The
//! first whose version equals the library's wins; else the first between 2.29.2 and the
//! library (LSA kernels run on later libraries). GIN kernels take only the library's own
//! version ([`BuildOptions::gin`]).

mod headers;
mod nvcc;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, DriverError};
use cudarc::nvrtc::Ptx;
use parking_lot::Mutex;

pub use headers::{HeaderAttempt, NcclHeaders};
pub use nvcc::{find_nvcc, NvccAttempt};

use super::DeviceAbi;
use crate::error::{BoxedError, Error};
use crate::library::Library;
use crate::release::Version;

/// What can go wrong building or loading device code. Converts into [`Error::Kernel`]
/// (`?` works in functions returning [`crate::Result`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// No `nvcc` was found.
    #[error("no nvcc found; tried:\n{}fix: install the CUDA toolkit, or set NVCC=/path/to/nvcc \
             or CUDA_HOME (or build a cubin elsewhere and load it with DeviceModule::from_cubin)",
             nvcc::list(.attempts))]
    NvccNotFound {
        /// Every place tried, with why it failed.
        attempts: Vec<NvccAttempt>,
    },

    /// No NCCL headers with the device API that suit the loaded library were found.
    #[error("no NCCL device-API headers for the loaded NCCL {library}; tried:\n{}fix: set \
             NCCL_INCLUDE_DIR (or NCCL_HOME) to the include/ of the NCCL release that is loaded",
             headers::list(.attempts))]
    HeadersNotFound {
        /// The loaded library's version.
        library: Version,
        /// Every place tried, with what was found there.
        attempts: Vec<HeaderAttempt>,
    },

    /// The headers are newer than the loaded library: NCCL would refuse their device code.
    #[error("the NCCL headers in {} are NCCL {headers}, newer than the loaded library NCCL \
             {library}; NCCL refuses device code newer than itself", .dir.display())]
    HeadersTooNew {
        /// The include directory.
        dir: PathBuf,
        /// Their version.
        headers: Version,
        /// The library's.
        library: Version,
    },

    /// The headers predate versioned device communicators (2.29.2), or have no device API.
    #[error("the NCCL headers in {} ({}) cannot build device code for this crate: it needs NCCL \
             {} or newer headers with nccl_device.h", .dir.display(), .found, super::DEV_COMM_SINCE)]
    HeadersTooOld {
        /// The include directory.
        dir: PathBuf,
        /// What was found (a version, or what was missing).
        found: String,
    },

    /// GIN device code asked for with headers of another version than the library.
    #[error(
        "GIN device code must be compiled against the loaded NCCL's own headers: the \
             headers are NCCL {headers}, the library NCCL {library}"
    )]
    GinNeedsExactHeaders {
        /// The headers' version.
        headers: Version,
        /// The library's.
        library: Version,
    },

    /// `nvcc` failed; its output is kept.
    #[error("nvcc failed ({status}): {} {}\n{stderr}", .nvcc.display(), .args.join(" "))]
    Compile {
        /// The compiler run.
        nvcc: PathBuf,
        /// Its arguments.
        args: Vec<String>,
        /// How it ended.
        status: String,
        /// What it printed (stderr, then stdout).
        stderr: String,
    },

    /// A file operation of the build failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },

    /// Loading the module or finding a function failed.
    #[error("loading device code: {0}")]
    Load(#[from] DriverError),
}

impl From<KernelError> for Error {
    fn from(err: KernelError) -> Error {
        Error::Kernel(BoxedError::new(err))
    }
}

/// How to build one module.
#[derive(Debug, Clone, Default)]
pub struct BuildOptions {
    gin: bool,
    extra: Vec<String>,
}

impl BuildOptions {
    /// Defaults: LSA device code, `-O3`, the device's own architecture.
    pub fn new() -> Self {
        Self::default()
    }

    /// The code uses GIN: the headers must be the library's own version.
    pub fn gin(mut self, on: bool) -> Self {
        self.gin = on;
        self
    }

    /// Appends an `nvcc` argument (e.g. `-DBLOCK=256`, `-lineinfo`).
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra.push(arg.into());
        self
    }
}

/// One compile's inputs: the same ones give the same cubin, so a process compiles each once.
#[derive(PartialEq, Eq, Hash)]
struct CacheKey {
    nvcc: PathBuf,
    include: PathBuf,
    source: String,
    arch: (i32, i32),
    extra: Vec<String>,
}

/// The cubins this process compiled (a few, each some hundred KiB at most).
fn cache() -> &'static Mutex<HashMap<CacheKey, Vec<u8>>> {
    static CACHE: OnceLock<Mutex<HashMap<CacheKey, Vec<u8>>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

/// `nvcc` and the NCCL headers that suit the loaded library.
#[derive(Debug, Clone)]
pub struct Toolchain {
    nvcc: PathBuf,
    headers: NcclHeaders,
    library: Version,
}

impl Toolchain {
    /// Finds `nvcc` ([`find_nvcc`]) and the headers for `library` ([`NcclHeaders::find`]).
    pub fn find(library: &Library) -> Result<Self, KernelError> {
        let headers = NcclHeaders::find(library)?;
        Ok(Self {
            nvcc: find_nvcc()?,
            headers,
            library: library.version(),
        })
    }

    /// A toolchain from parts, checked: headers no newer than `library`, 2.29.2 or newer.
    pub fn new(nvcc: PathBuf, headers: NcclHeaders, library: Version) -> Result<Self, KernelError> {
        headers.check_for(library)?;
        Ok(Self {
            nvcc,
            headers,
            library,
        })
    }

    /// The compiler.
    pub fn nvcc(&self) -> &std::path::Path {
        &self.nvcc
    }

    /// The headers.
    pub fn headers(&self) -> &NcclHeaders {
        &self.headers
    }

    /// The ABI of what this toolchain builds: the headers' version.
    pub fn abi(&self) -> DeviceAbi {
        DeviceAbi::new(self.headers.version())
    }

    /// Compiles `source` to a cubin for compute capability `arch` (`(9, 0)` for H100), once
    /// per process for the same source, architecture, options, compiler and headers.
    ///
    /// `nvcc` runs in a private directory: a new randomly named one under the temporary
    /// directory, mode 0700, that no other local user can have created or entered first (also
    /// nvcc's `TMPDIR`). It is removed afterwards, or kept and named in
    /// [`KernelError::Compile`] when nvcc fails.
    pub fn compile(
        &self,
        source: &str,
        arch: (i32, i32),
        options: &BuildOptions,
    ) -> Result<Vec<u8>, KernelError> {
        if options.gin && self.headers.version() != self.library {
            return Err(KernelError::GinNeedsExactHeaders {
                headers: self.headers.version(),
                library: self.library,
            });
        }
        let key = CacheKey {
            nvcc: self.nvcc.clone(),
            include: self.headers.dir().to_path_buf(),
            source: source.to_string(),
            arch,
            extra: options.extra.clone(),
        };
        if let Some(cubin) = cache().lock().get(&key) {
            return Ok(cubin.clone());
        }
        let cubin = nvcc::compile(&self.nvcc, self.headers.dir(), source, arch, &options.extra)?;
        cache().lock().insert(key, cubin.clone());
        Ok(cubin)
    }

    /// Compiles `source` for the device of `ctx` and loads it there.
    pub fn build(&self, ctx: &Arc<CudaContext>, source: &str) -> Result<DeviceModule, KernelError> {
        self.build_with(ctx, source, &BuildOptions::default())
    }

    /// [`Toolchain::build`] with options.
    pub fn build_with(
        &self,
        ctx: &Arc<CudaContext>,
        source: &str,
        options: &BuildOptions,
    ) -> Result<DeviceModule, KernelError> {
        let cubin = self.compile(source, ctx.compute_capability()?, options)?;
        DeviceModule::from_cubin(ctx, cubin, self.abi())
    }
}

/// Device code loaded into a CUDA context, with the ABI it was compiled for (what
/// [`DevComm::create`](super::DevComm::create) needs).
#[derive(Debug, Clone)]
pub struct DeviceModule {
    module: Arc<CudaModule>,
    abi: DeviceAbi,
}

impl DeviceModule {
    /// Loads a cubin compiled against the NCCL headers of `abi`.
    pub fn from_cubin(
        ctx: &Arc<CudaContext>,
        cubin: Vec<u8>,
        abi: DeviceAbi,
    ) -> Result<Self, KernelError> {
        let module = ctx.load_module(Ptx::from_binary(cubin))?;
        Ok(Self { module, abi })
    }

    /// Loads PTX compiled against the NCCL headers of `abi` (the driver JIT-compiles it).
    pub fn from_ptx(
        ctx: &Arc<CudaContext>,
        ptx: &str,
        abi: DeviceAbi,
    ) -> Result<Self, KernelError> {
        let module = ctx.load_module(Ptx::from_src(ptx))?;
        Ok(Self { module, abi })
    }

    /// The kernel `name` (an `extern "C" __global__` function).
    pub fn function(&self, name: &str) -> Result<CudaFunction, KernelError> {
        Ok(self.module.load_function(name)?)
    }

    /// The ABI it was compiled for.
    pub fn abi(&self) -> DeviceAbi {
        self.abi
    }

    /// The cudarc module.
    pub fn module(&self) -> &Arc<CudaModule> {
        &self.module
    }
}
