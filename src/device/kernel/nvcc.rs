//! Finding `nvcc` and running it: one source file in, one cubin out, in a directory of its
//! own that is removed afterwards (kept, and named in the error, when nvcc fails).
//!
//! The build directory is private: a fresh, randomly named directory under the temporary
//! directory, created with mode 0700 by a `mkdir` that fails if the name exists (the
//! `tempfile` crate, which retries with another name). A predictable name made with
//! `create_dir_all` would let another local user create it first and swap `kernel.cu` or
//! `kernel.cubin` (their device code would then run in this process's context), or plant
//! symlinks the build writes through.

use std::fs::{OpenOptions, Permissions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

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

/// A directory of its own per build, inside `parent`: a new random name, mode 0700, created
/// by a `mkdir` that fails (and is retried under another name) if anything is already there.
fn build_dir(parent: &Path) -> std::io::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("nccl-rs-kernel-")
        .permissions(Permissions::from_mode(0o700))
        .tempdir_in(parent)
}

/// Writes `bytes` to `path`, which must not exist (`O_EXCL`: no file or symlink planted there
/// is opened), readable by this user only.
fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)
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

/// Compiles `source` to a cubin for `arch` with the NCCL headers in `include`, in a private
/// directory under the temporary directory.
pub(super) fn compile(
    nvcc: &Path,
    include: &Path,
    source: &str,
    arch: (i32, i32),
    extra: &[String],
) -> Result<Vec<u8>, KernelError> {
    compile_in(&std::env::temp_dir(), nvcc, include, source, arch, extra)
}

/// [`compile`] with the private build directory made inside `parent`.
fn compile_in(
    parent: &Path,
    nvcc: &Path,
    include: &Path,
    source: &str,
    arch: (i32, i32),
    extra: &[String],
) -> Result<Vec<u8>, KernelError> {
    let io = |what: String| move |source| KernelError::Io { what, source };
    // Removed when dropped, on every path but a failed compile (kept for its source).
    let dir = build_dir(parent).map_err(io(format!(
        "creating a private build directory in {}",
        parent.display()
    )))?;
    let src = dir.path().join("kernel.cu");
    let out = dir.path().join("kernel.cubin");
    write_new(&src, source.as_bytes()).map_err(io(format!("writing {}", src.display())))?;
    let args = args(include, arch, extra, &src, &out);
    // nvcc's own intermediate files go to $TMPDIR (else /tmp) under names of its choosing:
    // keep them in the private directory too.
    let output = Command::new(nvcc)
        .args(&args)
        .env("TMPDIR", dir.path())
        .output()
        .map_err(io(format!("running {}", nvcc.display())))?;
    if !output.status.success() {
        let dir = dir.keep();
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
    // Read back from the directory this process created and only it can write to.
    let cubin = std::fs::read(&out).map_err(io(format!("reading {}", out.display())))?;
    // Dropping `dir` removes it, best effort: a leftover private directory is harmless.
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

    /// A fake nvcc that records where it was asked to work and writes `GOOD` as the cubin.
    fn recording_nvcc(dir: &Path) -> (PathBuf, PathBuf) {
        let fake = dir.join("nvcc");
        let log = dir.join("nvcc.log");
        std::fs::write(
            &fake,
            format!(
                "#!/bin/sh\n\
                 while [ $# -gt 1 ]; do [ \"$1\" = -o ] && out=$2; shift; done\n\
                 src=$1\n\
                 build=$(dirname \"$out\")\n\
                 {{ echo \"$build\"; stat -c %a \"$build\"; stat -c %a \"$src\"; \
                 echo \"$TMPDIR\"; cat \"$src\"; echo; }} > {log}\n\
                 printf GOOD > \"$out\"\n",
                log = log.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        (fake, log)
    }

    #[test]
    fn the_build_runs_in_a_private_directory_of_its_own() {
        let root = tempfile::tempdir().unwrap();
        let parent = root.path().join("tmp");
        std::fs::create_dir(&parent).unwrap();
        // What another local user could plant under the names this module once used
        // (`nccl-rs-kernel-<pid>-<n>`): a directory of theirs with their own cubin, and a
        // symlink pointing where a build would write through it.
        let pid = std::process::id();
        let planted = parent.join(format!("nccl-rs-kernel-{pid}-0"));
        std::fs::create_dir(&planted).unwrap();
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::write(planted.join("kernel.cubin"), "EVIL").unwrap();
        let victim = root.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        let link = parent.join(format!("nccl-rs-kernel-{pid}-1"));
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let (fake, log) = recording_nvcc(root.path());

        let cubin = compile_in(&parent, &fake, Path::new("/inc"), "int x;", (9, 0), &[]).unwrap();
        assert_eq!(cubin, b"GOOD");

        let log = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = log.lines().collect();
        let build = Path::new(lines[0]);
        assert_eq!(build.parent(), Some(parent.as_path()), "{log}");
        assert!(build != planted && build != link, "{log}");
        assert_eq!(lines[1], "700", "the build directory's mode: {log}");
        assert_eq!(lines[2], "600", "kernel.cu's mode: {log}");
        assert_eq!(Path::new(lines[3]), build, "nvcc's TMPDIR: {log}");
        assert_eq!(lines[4], "int x;", "{log}");
        // Removed afterwards; what was planted is untouched and nothing went through the link.
        assert!(!build.exists());
        assert_eq!(
            std::fs::read(planted.join("kernel.cubin")).unwrap(),
            b"EVIL"
        );
        assert_eq!(std::fs::read_dir(&planted).unwrap().count(), 1);
        assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 0);
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
