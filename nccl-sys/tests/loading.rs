//! Loading behaviour without NCCL: a real shared library that exports no NCCL symbol, and a
//! path that does not exist.

use std::collections::HashSet;

use nccl_sys::{ncclResult_t, MissingSymbol, NcclLib, FUNCTION_NAMES};

#[test]
fn function_names() {
    assert_eq!(FUNCTION_NAMES.len(), 73);
    let unique: HashSet<&str> = FUNCTION_NAMES.iter().copied().collect();
    assert_eq!(unique.len(), 73);
    assert!(FUNCTION_NAMES.iter().all(|n| n.starts_with("nccl")));
    for name in [
        "ncclAllReduce",
        "ncclCommShrink",
        "ncclResetDebugInit",
        "ncclParamDumpAll",
        "ncclGetVersion",
    ] {
        assert!(unique.contains(name), "{name}");
    }
    assert!(!unique.iter().any(|n| n.starts_with("pnccl")));
}

#[test]
fn nonexistent_path_is_an_error() {
    // SAFETY: nothing is loaded.
    let result = unsafe { NcclLib::open("/nonexistent/dir/libnccl.so.2") };
    assert!(result.is_err());
    // SAFETY: nothing is loaded.
    assert!(unsafe { NcclLib::open("libnccl-that-does-not-exist.so.99") }.is_err());
}

/// libloading's own text is only "dlopen failed"; the dynamic loader's reason is the error's
/// `source()`. nccl-rs walks that chain to tell users why a library did not load.
#[cfg(target_os = "linux")]
#[test]
fn the_loaders_reason_is_the_errors_source() {
    use std::error::Error as _;
    let junk = std::env::temp_dir().join(format!("nccl-sys-junk-{}.so", std::process::id()));
    std::fs::write(&junk, b"not an ELF file ".repeat(64)).unwrap();
    // SAFETY: the file is not a library, so nothing is loaded or run.
    let result = unsafe { NcclLib::open(&junk) };
    std::fs::remove_file(&junk).unwrap();
    let err = result.unwrap_err();
    let reason = err.source().expect("dlopen's reason").to_string();
    assert!(reason.contains("invalid ELF header"), "{err}: {reason}");
    assert!(reason.contains(junk.to_str().unwrap()), "{reason}");

    // SAFETY: nothing is loaded.
    let err = unsafe { NcclLib::open("libnccl-that-does-not-exist.so.99") }.unwrap_err();
    let reason = err.source().expect("dlopen's reason").to_string();
    assert!(
        reason.contains("libnccl-that-does-not-exist.so.99: cannot open shared object file"),
        "{reason}"
    );
}

#[cfg(target_os = "linux")]
#[test]
fn libc_loads_but_exports_no_nccl_symbol() {
    // SAFETY: libc is already loaded into this process; opening it again runs nothing new.
    let lib = unsafe { NcclLib::open("libc.so.6") }.expect("libc.so.6 should load");
    assert_eq!(lib.path(), std::path::Path::new("libc.so.6"));
    assert_eq!(lib.missing_symbols().len(), 73);
    assert_eq!(lib.missing_symbols(), FUNCTION_NAMES.to_vec());
    assert!(!lib.has_symbol("ncclCommShrink"));
    assert!(!lib.has_symbol("ncclGetVersion"));
    assert!(!lib.has_symbol("pncclAllReduce"));
    // Names outside nccl.h are looked up in the library itself.
    assert!(lib.has_symbol("malloc"));
    assert!(!lib.has_symbol("no_such_symbol_anywhere"));
    assert!(!lib.has_symbol("mal\0loc"));

    let mut version = 0;
    // SAFETY: the function is missing, so nothing is called.
    let err = unsafe { lib.ncclGetVersion(&mut version) }.unwrap_err();
    assert_eq!(
        err,
        MissingSymbol {
            name: "ncclGetVersion"
        }
    );
    assert_eq!(
        err.to_string(),
        "symbol `ncclGetVersion` is not exported by the loaded NCCL library"
    );
    assert_eq!(version, 0);
    // SAFETY: as above.
    assert_eq!(
        unsafe { lib.ncclGetErrorString(ncclResult_t::ncclTimeout) },
        Err(MissingSymbol {
            name: "ncclGetErrorString"
        })
    );
    // SAFETY: as above.
    assert_eq!(
        unsafe { lib.ncclResetDebugInit() },
        Err(MissingSymbol {
            name: "ncclResetDebugInit"
        })
    );

    let debug = format!("{lib:?}");
    assert!(
        debug.starts_with("NcclLib { path: \"libc.so.6\""),
        "{debug}"
    );

    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(err);
    assert!(boxed.to_string().contains("ncclGetVersion"));
}

#[test]
fn nccl_lib_is_send_and_sync() {
    fn check<T: Send + Sync + 'static>() {}
    check::<NcclLib>();
    check::<MissingSymbol>();
}
