//! Loading NCCL after failed attempts, against stand-in libraries built with the C compiler at
//! test time (`$CC`, else `cc`; skipped when none works). One test function: the loaded library
//! is process-global, so the steps must run in this order, in this process.
#![cfg(target_os = "linux")]

use std::path::{Path, PathBuf};
use std::process::Command;

use nccl::library::{self, Version};
use nccl::Error;

/// A scratch directory for this process, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("nccl-rs-loading-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Compiles `source` into the shared library `out`, with extra linker arguments.
fn compile(dir: &Path, source: &str, out: &str, link: &[&str]) -> Option<PathBuf> {
    let src = dir.join(format!("{out}.c"));
    std::fs::write(&src, source).unwrap();
    let out = dir.join(out);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&out)
        .arg(&src)
        .args(link)
        .status();
    match status {
        Ok(s) if s.success() => Some(out),
        other => {
            eprintln!("skipping: cannot build a stand-in library with `{cc}`: {other:?}");
            None
        }
    }
}

/// The one NCCL function the loader calls: reports 2.28.3.
const FAKE_NCCL: &str = "int ncclGetVersion(int* v) { *v = 22803; return 0; }\n";

fn error_text(result: nccl::Result<&'static library::Library>) -> String {
    match result {
        Ok(lib) => panic!("expected a load failure, loaded {lib:?}"),
        Err(err @ Error::LibraryNotFound(_)) => err.to_string(),
        Err(other) => panic!("expected LibraryNotFound, got {other}"),
    }
}

#[test]
fn a_failed_load_does_not_stick_and_keeps_the_loaders_reason() {
    let scratch = Scratch::new();
    let dir = &scratch.0;
    let junk = dir.join("libjunk.so.2");
    // Longer than an ELF header, so the loader reads it and finds no ELF magic.
    std::fs::write(&junk, b"not an ELF file ".repeat(64)).unwrap();
    // Implicit loading must fail here whatever this machine has installed.
    std::env::set_var("NCCL_LIBRARY", &junk);

    // The implicit search fails and says why, in the dynamic loader's words.
    let err = nccl::version().unwrap_err().to_string();
    assert!(err.contains("invalid ELF header"), "{err}");
    assert!(err.contains("[NCCL_LIBRARY]"), "{err}");
    // An explicit load of the same junk fails the same way.
    let err = error_text(library::load_from(&junk));
    assert!(err.contains("invalid ELF header"), "{err}");
    assert!(err.contains("[load_from]"), "{err}");

    let Some(good) = compile(dir, FAKE_NCCL, "libnccl.so.2", &[]) else {
        return;
    };
    // A library whose dependency is missing: linked against libgone.so, which is then removed.
    let Some(gone) = compile(dir, "int gone(void) { return 0; }\n", "libgone.so", &[]) else {
        return;
    };
    let needs = "int gone(void);\nint ncclGetVersion(int* v) { *v = gone(); return 0; }\n";
    let dir_arg = format!("-L{}", dir.display());
    let Some(orphan) = compile(dir, needs, "liborphan.so", &[&dir_arg, "-lgone"]) else {
        return;
    };
    std::fs::remove_file(&gone).unwrap();
    let err = error_text(library::load_from(&orphan));
    assert!(
        err.contains("libgone.so: cannot open shared object file"),
        "{err}"
    );

    // After all these failures, an explicit load of a working library succeeds, also when
    // several threads ask at once: one library is opened and everybody gets it.
    let loaded: Vec<&'static library::Library> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..8)
            .map(|_| s.spawn(|| library::load_from(&good)))
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap().expect("the working library loads"))
            .collect()
    });
    let lib = loaded[0];
    assert!(loaded.iter().all(|other| std::ptr::eq(*other, lib)));
    assert_eq!(lib.version(), Version::new(2, 28, 3));
    assert_eq!(lib.path(), good);
    assert_eq!(lib.source(), "load_from");

    // The explicit load wins over the implicit search, which would still fail.
    assert_eq!(nccl::version().unwrap(), Version::new(2, 28, 3));
    assert!(std::ptr::eq(library::get().unwrap(), lib));
    // It stays the process's NCCL: the same path again is fine, another one is refused.
    assert!(std::ptr::eq(library::load_from(&good).unwrap(), lib));
    match library::load_from(&orphan) {
        Err(Error::InvalidUsage(text)) => assert!(text.contains("already loaded"), "{text}"),
        other => panic!("a second library must be refused, got {other:?}"),
    }
}
