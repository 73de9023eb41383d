//! Finding the NCCL headers that suit the loaded library, and reading their version from
//! `nccl.h` (`NCCL_MAJOR`, `NCCL_MINOR`, `NCCL_PATCH`).

use std::path::{Path, PathBuf};

use super::KernelError;
use crate::device::DEV_COMM_SINCE;
use crate::library::Library;
use crate::release::Version;

/// An include directory holding `nccl.h` and the device API (`nccl_device.h`), and their
/// version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclHeaders {
    dir: PathBuf,
    version: Version,
    source: &'static str,
}

/// One place headers were looked for, and what was found there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderAttempt {
    /// Where the candidate came from (`"NCCL_HOME"`, `"beside the library"`, ...).
    pub source: &'static str,
    /// The include directory.
    pub dir: PathBuf,
    /// What was found.
    pub found: String,
}

pub(super) fn list(attempts: &[HeaderAttempt]) -> String {
    attempts
        .iter()
        .map(|a| format!("  - {} [{}]: {}\n", a.dir.display(), a.source, a.found))
        .collect()
}

/// The version `nccl.h`'s text declares.
fn read_version(text: &str) -> Option<Version> {
    let define = |name: &str| {
        text.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name))
                .then(|| words.next()?.parse::<u32>().ok())
                .flatten()
        })
    };
    Some(Version::new(
        define("NCCL_MAJOR")?,
        define("NCCL_MINOR")?,
        define("NCCL_PATCH")?,
    ))
}

/// What `dir` holds: headers of a version, or why not.
fn probe(dir: &Path) -> Result<Version, String> {
    let text =
        std::fs::read_to_string(dir.join("nccl.h")).map_err(|e| format!("no nccl.h ({e})"))?;
    let version = read_version(&text).ok_or("nccl.h declares no NCCL_MAJOR/MINOR/PATCH")?;
    if !dir.join("nccl_device.h").is_file() {
        return Err(format!(
            "NCCL {version} headers without the device API (no nccl_device.h)"
        ));
    }
    Ok(version)
}

/// The directory of the `libnccl.so` mapped into this process (for a library loaded by
/// soname), from `/proc/self/maps`.
fn mapped_library_dir() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| {
            Path::new(path)
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnccl.so"))
        })
        .and_then(|path| Path::new(path).parent().map(Path::to_path_buf))
}

/// The include directories to try for the library at `library_path`, in order.
fn candidates(
    var: impl Fn(&str) -> Option<String>,
    library_path: &Path,
    mapped: Option<PathBuf>,
) -> Vec<(&'static str, PathBuf)> {
    let mut out = Vec::new();
    if let Some(dir) = var("NCCL_INCLUDE_DIR").filter(|v| !v.is_empty()) {
        out.push(("NCCL_INCLUDE_DIR", PathBuf::from(dir)));
    }
    if let Some(home) = var("NCCL_HOME").filter(|v| !v.is_empty()) {
        out.push(("NCCL_HOME", Path::new(&home).join("include")));
    }
    let lib_dir = library_path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .or(mapped);
    if let Some(lib_dir) = lib_dir {
        // A pip wheel: nvidia/nccl/lib/libnccl.so.2 beside nvidia/nccl/include.
        out.push(("beside the library", lib_dir.join("..").join("include")));
    }
    out.push(("system", PathBuf::from("/usr/include")));
    out.push(("system", PathBuf::from("/usr/local/include")));
    out
}

/// Picks from `found` (each candidate's probe): the library's own version first, else the
/// first between 2.29.2 and the library.
fn pick(
    library: Version,
    found: Vec<(&'static str, PathBuf, Result<Version, String>)>,
) -> Result<NcclHeaders, KernelError> {
    let usable = |v: Version| v >= DEV_COMM_SINCE && v <= library;
    let exact = found
        .iter()
        .position(|(_, _, v)| v.as_ref().is_ok_and(|&v| v == library && usable(v)));
    let compatible = found
        .iter()
        .position(|(_, _, v)| v.as_ref().is_ok_and(|&v| usable(v)));
    if let Some(i) = exact.or(compatible) {
        let (source, dir, version) = found.into_iter().nth(i).expect("index from the same list");
        return Ok(NcclHeaders {
            dir,
            version: version.expect("a usable version"),
            source,
        });
    }
    let attempts = found
        .into_iter()
        .map(|(source, dir, probed)| HeaderAttempt {
            source,
            found: match probed {
                Ok(v) if v > library => format!("NCCL {v}, newer than the library"),
                Ok(v) => format!("NCCL {v}, older than {DEV_COMM_SINCE}"),
                Err(why) => why,
            },
            dir,
        })
        .collect();
    Err(KernelError::HeadersNotFound { library, attempts })
}

impl NcclHeaders {
    /// Finds headers for `library` (see the [module docs](super#which-headers)).
    pub fn find(library: &Library) -> Result<Self, KernelError> {
        let candidates = candidates(
            |name| std::env::var(name).ok(),
            library.path(),
            mapped_library_dir(),
        );
        let found = candidates
            .into_iter()
            .map(|(source, dir)| {
                let probed = probe(&dir);
                (source, dir, probed)
            })
            .collect();
        pick(library.version(), found)
    }

    /// The headers in `dir` (checked: `nccl.h` with a version, `nccl_device.h`, 2.29.2+).
    pub fn at(dir: impl Into<PathBuf>) -> Result<Self, KernelError> {
        let dir = dir.into();
        let version = probe(&dir).map_err(|found| KernelError::HeadersTooOld {
            dir: dir.clone(),
            found,
        })?;
        if version < DEV_COMM_SINCE {
            return Err(KernelError::HeadersTooOld {
                dir,
                found: format!("NCCL {version}"),
            });
        }
        Ok(Self {
            dir,
            version,
            source: "given",
        })
    }

    /// Fails unless device code built with these headers may run on `library`.
    pub(crate) fn check_for(&self, library: Version) -> Result<(), KernelError> {
        if self.version > library {
            return Err(KernelError::HeadersTooNew {
                dir: self.dir.clone(),
                headers: self.version,
                library,
            });
        }
        Ok(())
    }

    /// The include directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Their version (`NCCL_MAJOR.NCCL_MINOR.NCCL_PATCH` of `nccl.h`).
    pub fn version(&self) -> Version {
        self.version
    }

    /// Where they were found.
    pub fn source(&self) -> &'static str {
        self.source
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NCCL_H: &str = "#ifndef NCCL_H_\n#define NCCL_MAJOR 2\n#define NCCL_MINOR 32\n\
                          #define NCCL_PATCH 3\n#define NCCL_SUFFIX \"\"\n";

    fn v(a: u32, b: u32, c: u32) -> Version {
        Version::new(a, b, c)
    }

    #[test]
    fn the_version_is_read_from_nccl_h() {
        assert_eq!(read_version(NCCL_H), Some(v(2, 32, 3)));
        assert_eq!(read_version("#define NCCL_MAJOR 2\n"), None);
    }

    #[test]
    fn headers_are_probed_for_the_device_api() {
        let dir = std::env::temp_dir().join(format!("nccl-rs-headers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(probe(&dir).unwrap_err().contains("no nccl.h"));
        std::fs::write(dir.join("nccl.h"), NCCL_H).unwrap();
        assert!(probe(&dir).unwrap_err().contains("no nccl_device.h"));
        std::fs::write(dir.join("nccl_device.h"), "").unwrap();
        assert_eq!(probe(&dir), Ok(v(2, 32, 3)));
        let headers = NcclHeaders::at(&dir).unwrap();
        assert_eq!(headers.version(), v(2, 32, 3));
        assert!(headers.check_for(v(2, 32, 3)).is_ok());
        let err = headers.check_for(v(2, 30, 7)).unwrap_err();
        assert!(matches!(err, KernelError::HeadersTooNew { .. }), "{err}");
        std::fs::write(dir.join("nccl.h"), NCCL_H.replace("32", "28")).unwrap();
        let err = NcclHeaders::at(&dir).unwrap_err();
        assert!(err.to_string().contains("NCCL 2.28.3"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn candidates_start_with_the_variables_then_the_library() {
        let vars = |name: &str| match name {
            "NCCL_HOME" => Some("/tmp/nccl-2.32.3".to_string()),
            _ => None,
        };
        let got = candidates(vars, Path::new("/w/nvidia/nccl/lib/libnccl.so.2"), None);
        assert_eq!(
            got[0],
            ("NCCL_HOME", PathBuf::from("/tmp/nccl-2.32.3/include"))
        );
        assert_eq!(
            got[1],
            (
                "beside the library",
                PathBuf::from("/w/nvidia/nccl/lib/../include")
            )
        );
        assert_eq!(got[2], ("system", PathBuf::from("/usr/include")));
        // A library loaded by soname: the directory it was mapped from.
        let got = candidates(
            |_| None,
            Path::new("libnccl.so.2"),
            Some("/usr/lib64".into()),
        );
        assert_eq!(got[0].1, PathBuf::from("/usr/lib64/../include"));
    }

    #[test]
    fn the_librarys_own_version_wins_then_a_compatible_one() {
        let found = |list: &[(&'static str, Result<Version, String>)]| {
            list.iter()
                .map(|(s, v)| (*s, PathBuf::from(format!("/{s}")), v.clone()))
                .collect::<Vec<_>>()
        };
        let list = [
            ("a", Ok(v(2, 30, 7))),
            ("b", Ok(v(2, 32, 3))),
            ("c", Err("no nccl.h".to_string())),
        ];
        assert_eq!(pick(v(2, 32, 3), found(&list)).unwrap().source(), "b");
        assert_eq!(pick(v(2, 31, 2), found(&list)).unwrap().source(), "a");
        // The system 2.28.3 with 2.32.3 headers in NCCL_HOME: nothing fits, each says why.
        let err = pick(v(2, 28, 3), found(&list)).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("NCCL 2.32.3, newer than the library"),
            "{text}"
        );
        assert!(
            text.contains("NCCL 2.30.7, newer than the library"),
            "{text}"
        );
        assert!(text.contains("/c [c]: no nccl.h"), "{text}");
        assert!(matches!(err, KernelError::HeadersNotFound { .. }));
        // The system 2.28.3 with its own headers: the same version, but before versioned
        // device communicators, so refused too (found on the H100 host's /usr/include).
        let own = [("system", Ok(v(2, 28, 3)))];
        let err = pick(v(2, 28, 3), found(&own)).unwrap_err();
        assert!(
            err.to_string().contains("NCCL 2.28.3, older than 2.29.2"),
            "{err}"
        );
    }
}
