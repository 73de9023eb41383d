//! Regenerates `nccl-sys/src/bindings.rs` and `nccl-sys/src/functions.rs` from an `nccl.h`.
//!
//! ```text
//! cargo run --manifest-path nccl-sys/generator/Cargo.toml -- \
//!     --nccl-home <dir with include/nccl.h> [--cuda-home <CUDA toolkit dir>] [--out-dir <dir>]
//! ```
//!
//! `NCCL_HOME` / `CUDA_HOME` are read when the flags are absent. Without a CUDA toolkit the
//! stub headers in `cuda-stubs/` stand in for `cuda_runtime.h` and friends; nccl.h only needs
//! `cudaStream_t`, `cudaEvent_t` and `CUDART_VERSION` from them, and the stubs declare the two
//! handles exactly as CUDA does, so the output is the same either way.
//!
//! Two bindgen passes run over the header:
//! 1. types, enums and `NCCL_*` macros, written to `bindings.rs` (no `extern` blocks, so nothing
//!    in the crate needs libnccl at link time);
//! 2. the `nccl*` host function prototypes, which are parsed back with `syn` and rewritten as the
//!    input of the `nccl_functions!` macro defined in `nccl-sys/src/lib.rs` (`functions.rs`).
//!
//! Both files are passed through `rustfmt` and contain nothing that depends on the machine that
//! produced them (no paths, no dates), so regenerating from the same header is a no-op.

use std::collections::BTreeSet;
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use bindgen::callbacks::{IntKind, ParseCallbacks};
use bindgen::{CodegenConfig, EnumVariation, Formatter, RustEdition, RustTarget};

/// The command printed in the generated files' headers.
const REGEN_COMMAND: &str = "cargo run --manifest-path nccl-sys/generator/Cargo.toml -- --nccl-home <DIR with include/nccl.h> [--cuda-home <CUDA toolkit DIR>]";

/// Macros that bindgen cannot turn into constants faithfully (they expand to `INT_MIN`, `NULL`
/// or a float); `nccl-sys/src/consts.rs` defines them by hand.
const HAND_WRITTEN_MACROS: &[&str] = &[
    "NCCL_CONFIG_UNDEF_INT",
    "NCCL_CONFIG_UNDEF_PTR",
    "NCCL_UNDEF_FLOAT",
    "NCCL_COMM_NULL",
];

/// Macros that are byte counts in Rust terms and therefore come out as `usize`.
const USIZE_MACROS: &[&str] = &["NCCL_UNIQUE_ID_BYTES", "NCCL_WIN_REQUIRED_ALIGNMENT"];

/// Macros compared against `unsigned int` struct fields (`magic`) and so typed `c_uint`.
const UINT_MACROS: &[&str] = &["NCCL_API_MAGIC"];

struct Args {
    nccl_home: PathBuf,
    cuda_home: Option<PathBuf>,
    out_dir: PathBuf,
}

fn usage() -> String {
    format!(
        "usage: {REGEN_COMMAND} [--out-dir <DIR>]\n\
         NCCL_HOME and CUDA_HOME are used when the flags are absent; without a CUDA toolkit the \
         stub headers in nccl-sys/generator/cuda-stubs are used. --out-dir defaults to nccl-sys/src."
    )
}

fn parse_args() -> Result<Args, String> {
    let mut nccl_home = env::var_os("NCCL_HOME").map(PathBuf::from);
    let mut cuda_home = env::var_os("CUDA_HOME").map(PathBuf::from);
    let mut out_dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("generator lives in nccl-sys/")
        .join("src");
    let mut it = env::args_os().skip(1);
    while let Some(flag) = it.next() {
        let flag = flag.to_string_lossy().into_owned();
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n.to_owned(), Some(PathBuf::from(v))),
            None => (flag.clone(), None),
        };
        let mut value = || -> Result<PathBuf, String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it
                    .next()
                    .map(PathBuf::from)
                    .ok_or_else(|| format!("{name} needs a value\n{}", usage())),
            }
        };
        match name.as_str() {
            "--nccl-home" => nccl_home = Some(value()?),
            "--cuda-home" => cuda_home = Some(value()?),
            "--out-dir" => out_dir = value()?,
            "-h" | "--help" => return Err(usage()),
            other => return Err(format!("unknown argument `{other}`\n{}", usage())),
        }
    }
    let nccl_home =
        nccl_home.ok_or_else(|| format!("--nccl-home (or NCCL_HOME) is required\n{}", usage()))?;
    Ok(Args {
        nccl_home,
        cuda_home,
        out_dir,
    })
}

/// `MAJOR.MINOR.PATCH` and `NCCL_VERSION_CODE`, read from the header's `#define`s.
struct HeaderVersion {
    dotted: String,
    code: String,
}

fn header_version(header: &str) -> Result<HeaderVersion, String> {
    let define = |name: &str| -> Result<String, String> {
        header
            .lines()
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                match (words.next(), words.next(), words.next()) {
                    (Some("#define"), Some(n), Some(v)) if n == name => Some(v.to_owned()),
                    _ => None,
                }
            })
            .next()
            .ok_or_else(|| format!("nccl.h has no `#define {name}`"))
    };
    Ok(HeaderVersion {
        dotted: format!(
            "{}.{}.{}",
            define("NCCL_MAJOR")?,
            define("NCCL_MINOR")?,
            define("NCCL_PATCH")?
        ),
        code: define("NCCL_VERSION_CODE")?,
    })
}

/// Chooses the Rust type of each `NCCL_*` integer macro.
///
/// The enum newtypes need no callback: bindgen already derives
/// `Debug, Copy, Clone, Hash, PartialEq, Eq` for them, while structs get `Debug, Copy, Clone`
/// from the builder settings below.
#[derive(Debug)]
struct Callbacks;

impl ParseCallbacks for Callbacks {
    fn int_macro(&self, name: &str, value: i64) -> Option<IntKind> {
        if !name.starts_with("NCCL_") {
            return None;
        }
        if USIZE_MACROS.contains(&name) && value >= 0 {
            Some(IntKind::Custom {
                name: "usize",
                is_signed: false,
            })
        } else if UINT_MACROS.contains(&name) && u32::try_from(value).is_ok() {
            Some(IntKind::UInt)
        } else if i32::try_from(value).is_ok() {
            // Versions, flags and modes are all `int` parameters / fields on the C side.
            Some(IntKind::Int)
        } else {
            None
        }
    }
}

fn base_builder(args: &Args, header: &Path) -> bindgen::Builder {
    let stubs = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda-stubs");
    let cuda_include = match &args.cuda_home {
        Some(cuda) => cuda.join("include"),
        None => stubs,
    };
    bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_arg("-xc")
        .clang_arg("-DNCCL_OS_LINUX")
        .clang_arg(format!("-I{}", cuda_include.display()))
        .clang_arg(format!("-I{}", header.parent().unwrap().display()))
        .rust_target(RustTarget::stable(80, 0).expect("valid Rust target"))
        .rust_edition(RustEdition::Edition2021)
        .use_core()
        .ctypes_prefix("::core::ffi")
        .size_t_is_usize(true)
        .generate_comments(false)
        .disable_header_comment()
        .formatter(Formatter::None)
}

/// Pass 1: types, enums and macro constants.
fn generate_types(args: &Args, header: &Path) -> Result<String, String> {
    let mut builder = base_builder(args, header)
        .with_codegen_config(CodegenConfig::TYPES | CodegenConfig::VARS)
        .allowlist_type("nccl.*")
        .allowlist_type("cudaStream_t")
        .allowlist_type("cudaEvent_t")
        .allowlist_var("nccl.*")
        .allowlist_var("NCCL_.*")
        .default_enum_style(EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .derive_debug(true)
        .derive_copy(true)
        .derive_default(false)
        .derive_hash(false)
        .derive_partialeq(false)
        .derive_eq(false)
        .layout_tests(true)
        .generate_cstr(true)
        .parse_callbacks(Box::new(Callbacks));
    for m in HAND_WRITTEN_MACROS {
        builder = builder.blocklist_item(*m);
    }
    let bindings = builder
        .generate()
        .map_err(|e| format!("bindgen (types) failed: {e}"))?;
    Ok(bindings.to_string())
}

/// One host function, as the `nccl_functions!` macro takes it.
struct Function {
    name: String,
    params: Vec<(String, String)>,
    ret: Option<String>,
}

/// Pass 2: function prototypes, parsed back from bindgen's `extern "C"` block.
fn generate_functions(args: &Args, header: &Path) -> Result<Vec<Function>, String> {
    let bindings = base_builder(args, header)
        .with_codegen_config(CodegenConfig::FUNCTIONS)
        .allowlist_function("nccl.*")
        .merge_extern_blocks(true)
        .generate()
        .map_err(|e| format!("bindgen (functions) failed: {e}"))?
        .to_string();
    let file = syn::parse_file(&bindings)
        .map_err(|e| format!("cannot parse bindgen's function output: {e}"))?;
    let mut functions = Vec::new();
    for item in file.items {
        let syn::Item::ForeignMod(block) = item else {
            return Err("unexpected non-extern item in bindgen's function output".into());
        };
        for item in block.items {
            let syn::ForeignItem::Fn(f) = item else {
                return Err("unexpected non-function item in an extern block".into());
            };
            let name = f.sig.ident.to_string();
            if f.sig.variadic.is_some() {
                return Err(format!(
                    "{name} is variadic; the loader cannot express that"
                ));
            }
            let mut params = Vec::new();
            for input in &f.sig.inputs {
                let syn::FnArg::Typed(pt) = input else {
                    return Err(format!("{name}: unexpected receiver"));
                };
                let syn::Pat::Ident(ident) = &*pt.pat else {
                    return Err(format!("{name}: parameter without a plain name"));
                };
                params.push((ident.ident.to_string(), type_to_string(&pt.ty)?));
            }
            let ret = match &f.sig.output {
                syn::ReturnType::Default => None,
                syn::ReturnType::Type(_, ty) => Some(type_to_string(ty)?),
            };
            functions.push(Function { name, params, ret });
        }
    }
    Ok(functions)
}

/// Renders the small subset of Rust types bindgen uses for nccl.h prototypes, dropping the
/// `::core::ffi::` prefix (functions.rs imports the C types it uses).
fn type_to_string(ty: &syn::Type) -> Result<String, String> {
    match ty {
        syn::Type::Ptr(p) => {
            let m = if p.mutability.is_some() {
                "mut"
            } else {
                "const"
            };
            Ok(format!("*{m} {}", type_to_string(&p.elem)?))
        }
        syn::Type::Paren(p) => type_to_string(&p.elem),
        syn::Type::Path(p) if p.qself.is_none() => {
            let segs: Vec<String> = p
                .path
                .segments
                .iter()
                .map(|s| match s.arguments {
                    syn::PathArguments::None => Ok(s.ident.to_string()),
                    _ => Err(format!("generic type in a prototype: {}", s.ident)),
                })
                .collect::<Result<_, _>>()?;
            match segs.as_slice() {
                [only] => Ok(only.clone()),
                [core, ffi, c] if core == "core" && ffi == "ffi" => Ok(c.clone()),
                _ => Err(format!("unexpected type path `{}`", segs.join("::"))),
            }
        }
        syn::Type::Tuple(t) if t.elems.is_empty() => Ok("()".into()),
        _ => Err("unexpected type shape in a prototype".into()),
    }
}

fn header_comment(version: &HeaderVersion, what: &str) -> String {
    format!(
        "// @generated by nccl-sys/generator from nccl.h {} (NCCL_VERSION_CODE {}): {what}.\n\
         // Do not edit by hand. Regenerate with:\n\
         //     {REGEN_COMMAND}\n\n",
        version.dotted, version.code
    )
}

fn render_functions(version: &HeaderVersion, functions: &[Function]) -> String {
    let ffi_types = [
        "c_char",
        "c_int",
        "c_uint",
        "c_void",
        "c_long",
        "c_ulong",
        "c_short",
        "c_ushort",
        "c_schar",
        "c_uchar",
        "c_float",
        "c_double",
        "c_longlong",
        "c_ulonglong",
    ];
    let mut used = BTreeSet::new();
    for f in functions {
        for ty in f.params.iter().map(|(_, t)| t).chain(f.ret.iter()) {
            for word in ty.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
                if ffi_types.contains(&word) {
                    used.insert(word);
                }
            }
        }
    }
    let mut out = header_comment(version, "the host functions, as `nccl_functions!` input");
    if !used.is_empty() {
        let list: Vec<&str> = used.into_iter().collect();
        writeln!(out, "use core::ffi::{{{}}};\n", list.join(", ")).unwrap();
    }
    out.push_str("use crate::bindings::*;\n\n");
    out.push_str("nccl_functions! {\n");
    writeln!(out, "    header_version: \"{}\";\n", version.dotted).unwrap();
    for f in functions {
        let ret = f
            .ret
            .as_ref()
            .map(|r| format!(" -> {r}"))
            .unwrap_or_default();
        let params: Vec<String> = f.params.iter().map(|(n, t)| format!("{n}: {t}")).collect();
        let one_line = format!("    fn {}({}){ret};", f.name, params.join(", "));
        if one_line.len() <= 100 {
            out.push_str(&one_line);
            out.push('\n');
        } else {
            writeln!(out, "    fn {}(", f.name).unwrap();
            for p in &params {
                writeln!(out, "        {p},").unwrap();
            }
            writeln!(out, "    ){ret};").unwrap();
        }
    }
    out.push_str("}\n");
    out
}

fn rustfmt(code: &str) -> Result<String, String> {
    let rustfmt = env::var_os("RUSTFMT").unwrap_or_else(|| "rustfmt".into());
    let mut child = Command::new(&rustfmt)
        .args(["--edition", "2021", "--emit", "stdout"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run rustfmt: {e}"))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let input = code.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let output = child
        .wait_with_output()
        .map_err(|e| format!("rustfmt failed: {e}"))?;
    writer
        .join()
        .expect("rustfmt writer thread")
        .map_err(|e| format!("cannot feed rustfmt: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "rustfmt failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    String::from_utf8(output.stdout).map_err(|e| format!("rustfmt output is not UTF-8: {e}"))
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let header = args.nccl_home.join("include").join("nccl.h");
    let text = fs::read_to_string(&header)
        .map_err(|e| format!("cannot read {}: {e}", header.display()))?;
    let version = header_version(&text)?;

    let types = generate_types(&args, &header)?;
    let bindings = rustfmt(&format!(
        "{}{types}",
        header_comment(&version, "types, enums and constants")
    ))?;

    let functions = generate_functions(&args, &header)?;
    if functions.is_empty() {
        return Err("bindgen found no nccl* functions".into());
    }
    let functions_rs = rustfmt(&render_functions(&version, &functions))?;

    fs::create_dir_all(&args.out_dir)
        .map_err(|e| format!("cannot create {}: {e}", args.out_dir.display()))?;
    for (name, code) in [("bindings.rs", &bindings), ("functions.rs", &functions_rs)] {
        let path = args.out_dir.join(name);
        fs::write(&path, code).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    eprintln!(
        "nccl.h {}: {} host functions ({} CUDA headers)",
        version.dotted,
        functions.len(),
        if args.cuda_home.is_some() {
            "real"
        } else {
            "stub"
        }
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
