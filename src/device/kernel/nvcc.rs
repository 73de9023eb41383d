//! Finding `nvcc` and running it: one source file in, one cubin out, in a directory of its
//! own that is removed afterwards (kept, and named in the error, when nvcc fails).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use super::KernelError;

/// One place `nvcc` was looked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvccAttempt {
    /// Where the candidate came from (`"NVCC"`, `"CUDA_HOME"`, `"PATH"`, ...).
    pub source: &'static str,
    /// The path tried.
    pub path: PathBuf,
    /// Why it was not taken.
    pub reason: String,
}

pub(super) fn list(attempts: &[NvccAttempt]) -> String {
    attempts
        .iter()
        .map(|a| format!("  - {} [{}]: {}\n", a.path.display(), a.source, a.reason))
        .collect()
}

/// The candidates, in order: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`,
/// `/usr/local/cuda/bin/nvcc`, then every directory of `$PATH`.
fn candidates(var: impl Fn(&str) -> Option<String>) -> Vec<(&'static str, PathBuf)> {
    let mut out = Vec::new();
    if let Some(nvcc) = var("NVCC").filter(|v| !v.is_empty()) {
        out.push(("NVCC", PathBuf::from(nvcc)));
    }
    for home in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(dir) = var(home).filter(|v| !v.is_empty()) {
            out.push((home, Path::new(&dir).join("bin").join("nvcc")));
        }
    }
    out.push(("default", PathBuf::from("/usr/local/cuda/bin/nvcc")));
    if let Some(path) = var("PATH") {
        for dir in std::env::split_paths(&path) {
            out.push(("PATH", dir.join("nvcc")));
        }
    }
    out
}

fn is_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_file() && meta.permissions().mode() & 0o111 != 0 => Ok(()),
        Ok(_) => Err("not an executable file".into()),
        Err(err) => Err(err.to_string()),
    }
}

/// Finds `nvcc` as NVIDIA's nccl_ep does: `$NVCC`, `$CUDA_HOME/bin/nvcc`,
/// `$CUDA_PATH/bin/nvcc`, `/usr/local/cuda/bin/nvcc`, then every directory of `$PATH`.
pub fn find_nvcc() -> Result<PathBuf, KernelError> {
    find_in(|name| std::env::var(name).ok())
}

fn find_in(var: impl Fn(&str) -> Option<String>) -> Result<PathBuf, KernelError> {
    let mut attempts = Vec::new();
    for (source, path) in candidates(var) {
        match is_executable(&path) {
            Ok(()) => return Ok(path),
            Err(reason) => attempts.push(NvccAttempt {
                source,
                path,
                reason,
            }),
        }
    }
    Err(KernelError::NvccNotFound { attempts })
}

/// A directory of its own per build.
fn build_dir() -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "nccl-rs-kernel-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// The arguments for one compile.
fn args(include: &Path, arch: (i32, i32), extra: &[String], src: &Path, out: &Path) -> Vec<String> {
    let mut args = vec![
        "-cubin".to_string(),
        format!("-arch=sm_{}{}", arch.0, arch.1),
        "-std=c++17".into(),
        "-O3".into(),
        format!("-I{}", include.display()),
    ];
    args.extend(extra.iter().cloned());
    args.push("-o".into());
    args.push(out.display().to_string());
    args.push(src.display().to_string());
    args
}

/// Compiles `source` to a cubin for `arch` with the NCCL headers in `include`.
pub(super) fn compile(
    nvcc: &Path,
    include: &Path,
    source: &str,
    arch: (i32, i32),
    extra: &[String],
) -> Result<Vec<u8>, KernelError> {
    let io = |what: String| move |source| KernelError::Io { what, source };
    let dir = build_dir();
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let src = dir.join("kernel.cu");
    let out = dir.join("kernel.cubin");
    std::fs::write(&src, source).map_err(io(format!("writing {}", src.display())))?;
    let args = args(include, arch, extra, &src, &out);
    let output = Command::new(nvcc)
        .args(&args)
        .output()
        .map_err(io(format!("running {}", nvcc.display())))?;
    if !output.status.success() {
        let mut text = String::from_utf8_lossy(&output.stderr).into_owned();
        text.push_str(&String::from_utf8_lossy(&output.stdout));
        return Err(KernelError::Compile {
            nvcc: nvcc.to_path_buf(),
            args,
            status: format!(
                "{} (the source is kept in {})",
                output.status,
                dir.display()
            ),
            stderr: text,
        });
    }
    let cubin = std::fs::read(&out).map_err(io(format!("reading {}", out.display())))?;
    // Best effort: a leftover temporary directory is harmless.
    let _ = std::fs::remove_dir_all(&dir);
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_follow_nccl_eps_order() {
        let vars = |name: &str| match name {
            "NVCC" => Some("/opt/my/nvcc".to_string()),
            "CUDA_HOME" => Some("/opt/cuda".to_string()),
            "PATH" => Some("/a:/b".to_string()),
            _ => None,
        };
        let got: Vec<(&str, PathBuf)> = candidates(vars);
        let want = [
            ("NVCC", "/opt/my/nvcc"),
            ("CUDA_HOME", "/opt/cuda/bin/nvcc"),
            ("default", "/usr/local/cuda/bin/nvcc"),
            ("PATH", "/a/nvcc"),
            ("PATH", "/b/nvcc"),
        ];
        assert_eq!(got.len(), want.len());
        for ((source, path), (ws, wp)) in got.iter().zip(want) {
            assert_eq!((*source, path.as_path()), (ws, Path::new(wp)));
        }
    }

    #[test]
    fn no_nvcc_is_a_typed_error_listing_every_place() {
        let dir = std::env::temp_dir().join(format!("nccl-rs-no-nvcc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.display().to_string();
        let vars = |name: &str| match name {
            "PATH" => Some(path.clone()),
            "CUDA_HOME" => Some("/nonexistent/cuda".to_string()),
            _ => None,
        };
        // Only meaningful where /usr/local/cuda has no nvcc (CI, this crate's build host).
        if is_executable(Path::new("/usr/local/cuda/bin/nvcc")).is_ok() {
            return;
        }
        let err = find_in(vars).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, KernelError::NvccNotFound { ref attempts } if attempts.len() == 3));
        assert!(
            text.contains("/nonexistent/cuda/bin/nvcc [CUDA_HOME]"),
            "{text}"
        );
        assert!(text.contains("set NVCC="), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failing_compiler_is_a_compile_error_with_its_output() {
        let dir = std::env::temp_dir().join(format!("nccl-rs-fake-nvcc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("nvcc");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho \"kernel.cu(3): error: oops\" >&2\nexit 2\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = compile(
            &fake,
            Path::new("/inc"),
            "int x;",
            (9, 0),
            &["-lineinfo".into()],
        )
        .unwrap_err();
        match &err {
            KernelError::Compile { args, stderr, .. } => {
                assert!(stderr.contains("error: oops"), "{stderr}");
                assert!(args.contains(&"-arch=sm_90".to_string()), "{args:?}");
                assert!(args.contains(&"-I/inc".to_string()), "{args:?}");
                assert!(args.contains(&"-lineinfo".to_string()), "{args:?}");
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("nvcc failed"), "{err}");
        if let KernelError::Compile { status, .. } = &err {
            let kept = status
                .split("kept in ")
                .nth(1)
                .unwrap()
                .trim_end_matches(')');
            std::fs::remove_dir_all(kept).unwrap();
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
