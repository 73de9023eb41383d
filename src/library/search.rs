//! Where NCCL is looked for: the search order of the [module docs](super), as a list of
//! candidates built from the environment, tried one by one.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::Library;
use crate::error::{LibraryNotFound, LoadAttempt};

pub(super) fn env_var(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|value| !value.is_empty())
}

/// One place the search will try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Candidate {
    pub(super) source: &'static str,
    pub(super) path: PathBuf,
    /// Named by the user: if it fails, the search stops there.
    pub(super) explicit: bool,
}

/// Where a pip-installed NCCL lies inside a `site-packages` or `dist-packages` directory
/// (`nvidia-nccl-cu12` and `nvidia-nccl-cu13` alike).
const PIP_NCCL: &str = "nvidia/nccl/lib/libnccl.so.2";

/// Every candidate, in search order, given the environment, the build-time hint and the root
/// of the file system that holds the system-wide Python installations (`/` outside tests).
pub(super) fn candidates(
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
pub(super) fn search(candidates: &[Candidate]) -> std::result::Result<Library, LibraryNotFound> {
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
    use crate::error::Error;
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
}
