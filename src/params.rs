//! NCCL's effective parameters (`ncclParam*`, exported from NCCL 2.30.3, declared in
//! `nccl.h` from 2.30.4): what the loaded library actually runs with, read from NCCL itself
//! rather than guessed from the environment, so a program can log it and a user can paste it
//! into a bug report ([`Params`]'s `Display` names the library, its path and version too).
//!
//! ```no_run
//! # fn main() -> nccl::Result<()> {
//! eprintln!("{}", nccl::params::all()?); // every parameter NCCL lists, one per line
//! if let Some(subsys) = nccl::params::get("NCCL_DEBUG_SUBSYS")? {
//!     // NCCL keeps this one as a 64-bit mask, and prints it as names.
//!     println!("{} = {:?} ({})", subsys.key, subsys.value.as_u64(), subsys.text);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! What NCCL offers (`src/param/c_api.cc`, 2.30.3 to 2.30.7) and how it is read here:
//!
//! * The keys NCCL lists are the ones of its new parameter registry that its documentation
//!   publishes (seven in 2.32.3, e.g. `NCCL_DEBUG`, `NCCL_DEBUG_SUBSYS`, `NCCL_DEBUG_FILE`);
//!   `NCCL_PARAM_DUMP_ALL=true` in the environment lists the private ones too. NCCL 2.30.3
//!   and 2.30.4 publish none (nothing in their source sets `NCCL_PARAM_FLAG_PUBLISHED`;
//!   2.30.7 does), so [`all`] lists nothing there without that variable (measured on
//!   2.30.3), while [`get`] reads any registered key on every version. Parameters
//!   NCCL still reads the older way (`NCCL_PROTO`, `NCCL_ALGO`, ...) are not in the
//!   registry: [`get`] returns `None` for them, as for any key NCCL does not know.
//! * Every value has NCCL's own text (`ncclParamGetParameter`), e.g. `INIT,ENV,BOOTSTRAP`.
//!   Where NCCL stores the value as an integer, the matching typed getter
//!   (`ncclParamGet{I,U}{8,16,32,64}`) reads it as one ([`ParamValue::U64`], ...); booleans,
//!   enumerations and strings are [`ParamValue::Text`]. NCCL tells the type only by refusing
//!   the wrong getter, so the width is taken from the raw value's size (`ncclParamGet`) and
//!   at most the two getters of that width are tried; with `NCCL_DEBUG=INFO` NCCL logs a
//!   "type mismatch" line for a refused one.
//! * The strings NCCL returns live in thread-local storage that its next call of the same
//!   function on the same thread overwrites. Each is copied into a Rust `String` before any
//!   further NCCL call on the thread, which is why reading them is sound.
//! * Reading has no side effect beyond NCCL loading the value from the environment the
//!   first time (as it would when it first uses it); there is no setter.
//! * NCCL's parameter calls are not safe from two threads at once: `ncclParamBind` and
//!   `ncclParamGetParameter` record each key in a function-static `std::unordered_set`
//!   with no lock (`ncclParamCheckFlag` in `src/param/c_api.cc`, the same in 2.30.3, 2.30.4
//!   and 2.30.7; 2.32's source is not public, the API is unchanged). Every `ncclParam*` call
//!   of this crate is made under one process-wide lock, so [`all`] and [`get`] may be called
//!   from any thread; other code in the process that calls NCCL's parameter API directly is
//!   outside that lock.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use nccl_sys::{ncclParamHandle_t, ncclResult_t};

use crate::calls::{self, Call};
use crate::error::{Error, Result};
use crate::library::{self, Library};
use crate::release::Version;

/// One parameter's value, typed where NCCL keeps it as an integer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ParamValue {
    /// An `int8_t` (`ncclParamGetI8`).
    I8(i8),
    /// An `int16_t` (`ncclParamGetI16`).
    I16(i16),
    /// An `int32_t` (`ncclParamGetI32`).
    I32(i32),
    /// An `int64_t` (`ncclParamGetI64`).
    I64(i64),
    /// A `uint8_t` (`ncclParamGetU8`).
    U8(u8),
    /// A `uint16_t` (`ncclParamGetU16`).
    U16(u16),
    /// A `uint32_t` (`ncclParamGetU32`).
    U32(u32),
    /// A `uint64_t` (`ncclParamGetU64`): e.g. `NCCL_DEBUG_SUBSYS`'s mask.
    U64(u64),
    /// Anything else (strings, booleans, enumerations): NCCL's text for it.
    Text(String),
}

impl ParamValue {
    /// The value as an `i64`, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            ParamValue::I8(v) => Some(v.into()),
            ParamValue::I16(v) => Some(v.into()),
            ParamValue::I32(v) => Some(v.into()),
            ParamValue::I64(v) => Some(v),
            ParamValue::U8(v) => Some(v.into()),
            ParamValue::U16(v) => Some(v.into()),
            ParamValue::U32(v) => Some(v.into()),
            ParamValue::U64(v) => i64::try_from(v).ok(),
            ParamValue::Text(_) => None,
        }
    }

    /// The value as a `u64`, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            ParamValue::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// The text, if NCCL keeps the value as something other than an integer.
    pub fn as_text(&self) -> Option<&str> {
        match self {
            ParamValue::Text(text) => Some(text),
            _ => None,
        }
    }

    /// Whether NCCL keeps the value as an integer.
    pub fn is_integer(&self) -> bool {
        !matches!(self, ParamValue::Text(_))
    }
}

/// One of NCCL's parameters: its key, NCCL's text for its value, and the value typed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Param {
    /// The key, e.g. `"NCCL_DEBUG_SUBSYS"` (the environment variable that sets it).
    pub key: String,
    /// NCCL's own text for the value (`ncclParamGetParameter`), e.g. `"INIT,ENV,BOOTSTRAP"`;
    /// empty where the parameter is unset and has no default.
    pub text: String,
    /// The value, as an integer where NCCL keeps it as one.
    pub value: ParamValue,
}

/// `KEY=text`, with the integer beside the text where they differ (`NCCL_DEBUG_SUBSYS=INIT,
/// ENV,BOOTSTRAP (4225)`), and `<unset>` for an empty text.
impl fmt::Display for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}=", self.key)?;
        if self.text.is_empty() {
            f.write_str("<unset>")?;
        } else {
            f.write_str(&self.text)?;
        }
        let number = match &self.value {
            ParamValue::Text(_) => None,
            value => value
                .as_i64()
                .map(|v| v.to_string())
                .or_else(|| value.as_u64().map(|v| v.to_string())),
        };
        match number {
            Some(number) if number != self.text => write!(f, " ({number})"),
            _ => Ok(()),
        }
    }
}

/// Every parameter NCCL lists, with the library they were read from ([`all`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    /// The loaded library's version.
    pub version: Version,
    /// Where the library was loaded from.
    pub library: PathBuf,
    /// Which step of the library search found it (e.g. `"NCCL_LIBRARY"`).
    pub found_by: &'static str,
    /// The parameters, in NCCL's order.
    pub params: Vec<Param>,
}

impl Params {
    /// The parameter named `key`, if NCCL listed it.
    pub fn get(&self, key: &str) -> Option<&Param> {
        self.params.iter().find(|param| param.key == key)
    }
}

/// A block to paste into a bug report: nccl-rs, the NCCL library (version, path, how it was
/// found), then one parameter per line.
impl fmt::Display for Params {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "nccl-rs {} (bindings for nccl.h {}), NCCL {} loaded from {} (found by {})",
            env!("CARGO_PKG_VERSION"),
            Version::HEADER,
            self.version,
            self.library.display(),
            self.found_by
        )?;
        write!(f, "NCCL parameters ({}):", self.params.len())?;
        for param in &self.params {
            write!(f, "\n  {param}")?;
        }
        Ok(())
    }
}

/// Held around every `ncclParam*` call: NCCL's parameter API mutates unguarded state (see
/// the module's documentation).
static NCCL_PARAM_CALLS: Mutex<()> = Mutex::new(());

/// Takes [`NCCL_PARAM_CALLS`]; the guarded data is `()`, so a panic while it was held leaves
/// nothing inconsistent and poisoning is ignored.
fn param_calls() -> MutexGuard<'static, ()> {
    NCCL_PARAM_CALLS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Every parameter NCCL lists (`ncclParamGetAllParameterKeys`, then each value), with the
/// library's version and path. [`Error::Unsupported`] before NCCL 2.30.3. Safe from any
/// thread: NCCL is called under this crate's one parameter lock.
pub fn all() -> Result<Params> {
    let lib = library::get()?;
    lib.require_call(&calls::ncclParamGetAllParameterKeys)?;
    require_readers(lib)?;
    // One hold for the whole listing, so it is also one consistent read.
    let _calls = param_calls();
    let mut params = Vec::new();
    for key in keys(lib)? {
        // A key NCCL listed but then does not find is left out rather than made up.
        if let Some(param) = read(lib, &key)? {
            params.push(param);
        }
    }
    Ok(Params {
        version: lib.version(),
        library: lib.path().to_path_buf(),
        found_by: lib.source(),
        params,
    })
}

/// The parameter `key` (e.g. `"NCCL_DEBUG_SUBSYS"`), or `None` where NCCL's registry does
/// not know it (a typo, or a parameter NCCL reads the older way, such as `NCCL_PROTO`).
/// [`Error::Unsupported`] before NCCL 2.30.3; [`Error::InvalidArgument`] for a key with a
/// NUL byte. Safe from any thread: NCCL is called under this crate's one parameter lock.
pub fn get(key: &str) -> Result<Option<Param>> {
    let lib = library::get()?;
    require_readers(lib)?;
    let _calls = param_calls();
    read(lib, key)
}

/// The functions that read one parameter.
const READERS: [&Call; 11] = [
    &calls::ncclParamGetParameter,
    &calls::ncclParamBind,
    &calls::ncclParamGet,
    &calls::ncclParamGetI8,
    &calls::ncclParamGetI16,
    &calls::ncclParamGetI32,
    &calls::ncclParamGetI64,
    &calls::ncclParamGetU8,
    &calls::ncclParamGetU16,
    &calls::ncclParamGetU32,
    &calls::ncclParamGetU64,
];

/// Fails with [`Error::Unsupported`] unless the library has every reader.
fn require_readers(lib: &Library) -> Result<()> {
    READERS.iter().try_for_each(|call| lib.require_call(call))
}

/// The keys NCCL lists, copied. Called under [`param_calls`].
fn keys(lib: &Library) -> Result<Vec<String>> {
    let mut table: *mut *const c_char = std::ptr::null_mut();
    let mut len: c_int = 0;
    // SAFETY: both out-pointers are valid for the call.
    let status = unsafe { lib.api().ncclParamGetAllParameterKeys(&mut table, &mut len) };
    lib.check(calls::ncclParamGetAllParameterKeys.name, status)?;
    let len = usize::try_from(len).unwrap_or(0);
    if table.is_null() || len == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: NCCL returned a table of `len` pointers to NUL-terminated strings, valid until
    // its next ncclParamGetAllParameterKeys on this thread; all are copied before any other
    // NCCL call.
    let pointers = unsafe { std::slice::from_raw_parts(table, len) };
    Ok(pointers
        .iter()
        .filter(|ptr| !ptr.is_null())
        // SAFETY: as above; each non-null entry is a NUL-terminated string.
        .map(|&ptr| {
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        })
        .collect())
}

/// One parameter: NCCL's text, then the integer where a typed getter reads it. Called under
/// [`param_calls`].
fn read(lib: &Library, key: &str) -> Result<Option<Param>> {
    let c_key = CString::new(key)
        .map_err(|_| Error::invalid(format!("the parameter key {key:?} contains a NUL byte")))?;
    let Some(text) = text_of(lib, &c_key)? else {
        return Ok(None);
    };
    let value = integer_of(lib, &c_key)?.unwrap_or_else(|| ParamValue::Text(text.clone()));
    Ok(Some(Param {
        key: key.to_owned(),
        text,
        value,
    }))
}

/// NCCL's text for `key` (`ncclParamGetParameter`), copied; `None` for a key it does not
/// know.
fn text_of(lib: &Library, key: &CStr) -> Result<Option<String>> {
    let mut value: *const c_char = std::ptr::null();
    let mut len: c_int = 0;
    // SAFETY: `key` is NUL-terminated; both out-pointers are valid for the call.
    let status = unsafe {
        lib.api()
            .ncclParamGetParameter(key.as_ptr(), &mut value, &mut len)
    };
    // An unknown key: NCCL says invalid argument and returns no string.
    if status == Ok(ncclResult_t::ncclInvalidArgument) && value.is_null() {
        return Ok(None);
    }
    lib.check(calls::ncclParamGetParameter.name, status)?;
    if value.is_null() {
        return Ok(Some(String::new()));
    }
    let text = match usize::try_from(len) {
        // SAFETY: NCCL returned `len` bytes at `value` (its thread-local copy of the
        // string, valid until its next ncclParamGetParameter on this thread), copied now.
        Ok(len) => {
            String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(value.cast::<u8>(), len) })
                .into_owned()
        }
        // SAFETY: as above; the string is NUL-terminated.
        Err(_) => unsafe { CStr::from_ptr(value) }
            .to_string_lossy()
            .into_owned(),
    };
    Ok(Some(text))
}

/// The value of `key` through NCCL's typed getter, where NCCL keeps it as an integer.
fn integer_of(lib: &Library, key: &CStr) -> Result<Option<ParamValue>> {
    let mut handle: ncclParamHandle_t = std::ptr::null_mut();
    // SAFETY: `key` is NUL-terminated and `handle` a valid out-pointer; NCCL owns the
    // handle it returns (never freed by the caller).
    let status = unsafe { lib.api().ncclParamBind(&mut handle, key.as_ptr()) };
    if status != Ok(ncclResult_t::ncclSuccess) || handle.is_null() {
        return Ok(None);
    }
    // The raw value's size gives the width; strings longer than 8 bytes do not fit and are
    // refused, which also says they are not integers.
    let mut raw = [0u8; 8];
    let mut len: c_int = 0;
    // SAFETY: `handle` came from ncclParamBind; `raw` has room for the 8 bytes allowed, and
    // `len` is a valid out-pointer.
    let status = unsafe {
        lib.api().ncclParamGet(
            handle,
            raw.as_mut_ptr().cast::<c_void>(),
            raw.len() as c_int,
            &mut len,
        )
    };
    if status != Ok(ncclResult_t::ncclSuccess) {
        return Ok(None);
    }
    macro_rules! typed {
        ($getter:ident, $t:ty, $variant:ident) => {{
            let mut out: $t = 0;
            // SAFETY: `handle` came from ncclParamBind and `out` is a valid out-pointer of
            // the getter's type; NCCL refuses (writing nothing) if the type is not its own.
            let status = unsafe { lib.api().$getter(handle, &mut out) };
            if status == Ok(ncclResult_t::ncclSuccess) {
                return Ok(Some(ParamValue::$variant(out)));
            }
        }};
    }
    match len {
        1 => {
            typed!(ncclParamGetI8, i8, I8);
            typed!(ncclParamGetU8, u8, U8);
        }
        2 => {
            typed!(ncclParamGetI16, i16, I16);
            typed!(ncclParamGetU16, u16, U16);
        }
        4 => {
            typed!(ncclParamGetI32, i32, I32);
            typed!(ncclParamGetU32, u32, U32);
        }
        8 => {
            typed!(ncclParamGetI64, i64, I64);
            typed!(ncclParamGetU64, u64, U64);
        }
        _ => {}
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(key: &str, text: &str, value: ParamValue) -> Param {
        Param {
            key: key.into(),
            text: text.into(),
            value,
        }
    }

    #[test]
    fn values_convert_only_where_they_fit() {
        assert_eq!(ParamValue::U64(4225).as_i64(), Some(4225));
        assert_eq!(ParamValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(ParamValue::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(ParamValue::I8(-3).as_i64(), Some(-3));
        assert_eq!(ParamValue::I8(-3).as_u64(), None);
        assert_eq!(ParamValue::U32(68).as_u64(), Some(68));
        assert_eq!(ParamValue::I16(7).as_u64(), Some(7));
        let text = ParamValue::Text("[%F %T] ".into());
        assert_eq!(text.as_i64(), None);
        assert_eq!(text.as_text(), Some("[%F %T] "));
        assert!(!text.is_integer());
        assert!(ParamValue::I64(0).is_integer());
        assert_eq!(ParamValue::I64(0).as_text(), None);
    }

    #[test]
    fn a_param_shows_text_and_the_integer_where_they_differ() {
        let subsys = param(
            "NCCL_DEBUG_SUBSYS",
            "INIT,ENV,BOOTSTRAP",
            ParamValue::U64(4225),
        );
        assert_eq!(
            subsys.to_string(),
            "NCCL_DEBUG_SUBSYS=INIT,ENV,BOOTSTRAP (4225)"
        );
        let plain = param("NCCL_X", "12", ParamValue::I32(12));
        assert_eq!(plain.to_string(), "NCCL_X=12");
        let huge = param("NCCL_Y", "ALL", ParamValue::U64(u64::MAX));
        assert_eq!(huge.to_string(), format!("NCCL_Y=ALL ({})", u64::MAX));
        let unset = param("NCCL_DEBUG_FILE", "", ParamValue::Text(String::new()));
        assert_eq!(unset.to_string(), "NCCL_DEBUG_FILE=<unset>");
        let flag = param(
            "NCCL_SET_THREAD_NAME",
            "FALSE",
            ParamValue::Text("FALSE".into()),
        );
        assert_eq!(flag.to_string(), "NCCL_SET_THREAD_NAME=FALSE");
    }

    #[test]
    fn the_report_names_library_version_and_every_param() {
        let params = Params {
            version: Version::new(2, 32, 3),
            library: "/opt/nccl/lib/libnccl.so.2".into(),
            found_by: "NCCL_LIBRARY",
            params: vec![
                param("NCCL_DEBUG", "WARN", ParamValue::Text("WARN".into())),
                param("NCCL_DEBUG_SUBSYS", "INIT", ParamValue::U64(1)),
            ],
        };
        let text = params.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("nccl-rs "), "{text}");
        assert!(
            lines[0].contains(
                "NCCL 2.32.3 loaded from /opt/nccl/lib/libnccl.so.2 (found by NCCL_LIBRARY)"
            ),
            "{text}"
        );
        assert_eq!(lines[1], "NCCL parameters (2):");
        assert_eq!(lines[2], "  NCCL_DEBUG=WARN");
        assert_eq!(lines[3], "  NCCL_DEBUG_SUBSYS=INIT (1)");
        assert_eq!(
            params.get("NCCL_DEBUG_SUBSYS").unwrap().value.as_u64(),
            Some(1)
        );
        assert!(params.get("NCCL_PROTO").is_none());
    }
}
