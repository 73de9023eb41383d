//! `nccl::params` (from one thread and from several at once) and `Group::simulate` against a
//! stand-in libnccl built with the C compiler at test time (`$CC`, else `cc`; skipped, saying
//! so, when none works). The stand-in fails every parameter call once two threads were inside
//! it together (NCCL's own race), and keeps its strings the way NCCL does, in buffers its next call overwrites (with garbage first, here), so a value not
//! copied at once would read wrong. Its version comes from `NCCL_RS_FAKE_VERSION`: the test
//! re-executes itself to load it as NCCL 2.21.5, 2.28.3 and 2.30.2 too (the loaded library is
//! process-global), where the API must be refused as unsupported, and on 2.21.5
//! `Group::simulate` too (NCCL 2.22), before any group is opened.
#![cfg(target_os = "linux")]

use std::path::{Path, PathBuf};
use std::process::Command;

use nccl::{Error, ParamValue, Version};

const CHILD_ENV: &str = "NCCL_RS_PARAMS_CHILD";

const FAKE_NCCL: &str = r#"
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int ncclResult_t;
enum { OK = 0, INTERNAL_ERROR = 3, INVALID_ARGUMENT = 4 };

/* NCCL 2.30.3 to 2.32 mutate an unguarded function-static set in ncclParamBind and
 * ncclParamGetParameter: two threads in parameter calls at once race inside NCCL. The
 * stand-in counts the threads inside, lingers to widen the window, and once two were
 * inside together fails every later parameter call with an internal error. */
static int inside, raced;
static void enter(void) {
  if (__atomic_fetch_add(&inside, 1, __ATOMIC_SEQ_CST) != 0)
    __atomic_store_n(&raced, 1, __ATOMIC_SEQ_CST);
  struct timespec linger = {0, 20000};
  nanosleep(&linger, 0);
}
static ncclResult_t leave(ncclResult_t result) {
  __atomic_fetch_sub(&inside, 1, __ATOMIC_SEQ_CST);
  return __atomic_load_n(&raced, __ATOMIC_SEQ_CST) ? INTERNAL_ERROR : result;
}
enum { I8 = 1, I16, I32, I64, U8, U16, U32, U64, BOOL, CSTR, RAW };

struct param { const char* key; int type; const char* text; int64_t value; };
static const struct param PARAMS[] = {
  {"NCCL_DEBUG", RAW, "WARN", 2},
  {"NCCL_DEBUG_SUBSYS", U64, "INIT,ENV,BOOTSTRAP", 4225},
  {"NCCL_DEBUG_TIMESTAMP_LEVELS", U32, "WARN,ATTN", 68},
  {"NCCL_DEBUG_TIMESTAMP_FORMAT", CSTR, "[%F %T] ", 0},
  {"NCCL_DEBUG_FILE", CSTR, "", 0},
  {"NCCL_SET_THREAD_NAME", BOOL, "FALSE", 0},
  {"NCCL_TEST_NEGATIVE", I16, "-7", -7},
  {"NCCL_TEST_BYTE", U8, "200", 200},
};
#define NPARAMS (sizeof PARAMS / sizeof PARAMS[0])

ncclResult_t ncclGetVersion(int* v) {
  const char* forced = getenv("NCCL_RS_FAKE_VERSION");
  *v = forced ? atoi(forced) : 23203;
  return OK;
}
const char* ncclGetErrorString(ncclResult_t r) { return r == INVALID_ARGUMENT ? "fake: invalid argument" : "fake: error"; }
const char* ncclGetLastError(void* comm) { (void)comm; return ""; }

/* Like NCCL's thread-local tables: refilled, after being scribbled over, on every call. */
static char keys[NPARAMS][64];
static const char* key_table[NPARAMS];
ncclResult_t ncclParamGetAllParameterKeys(const char*** table, int* len) {
  enter();
  for (size_t i = 0; i < NPARAMS; i++) {
    memset(keys[i], 'X', sizeof keys[i]);
    strcpy(keys[i], PARAMS[i].key);
    key_table[i] = keys[i];
  }
  *table = key_table;
  *len = (int)NPARAMS;
  return leave(OK);
}

static const struct param* find(const char* key) {
  for (size_t i = 0; i < NPARAMS; i++)
    if (strcmp(PARAMS[i].key, key) == 0) return &PARAMS[i];
  return 0;
}

static char text[256];
ncclResult_t ncclParamGetParameter(const char* key, const char** value, int* len) {
  enter();
  memset(text, 'X', sizeof text);
  const struct param* p = find(key);
  if (!p) { *value = 0; *len = 0; return leave(INVALID_ARGUMENT); }
  strcpy(text, p->text);
  *value = text;
  *len = (int)strlen(text);
  return leave(OK);
}

ncclResult_t ncclParamBind(const struct param** out, const char* key) {
  enter();
  const struct param* p = find(key);
  if (!p) return leave(INVALID_ARGUMENT);
  *out = p;
  return leave(OK);
}

static int size_of(int type) {
  switch (type) {
    case I8: case U8: case BOOL: return 1;
    case I16: case U16: return 2;
    case I32: case U32: case RAW: return 4;
    case I64: case U64: return 8;
    default: return -1;
  }
}

ncclResult_t ncclParamGet(const struct param* h, void* out, int max, int* len) {
  enter();
  int size = size_of(h->type);
  if (size < 0) size = (int)strlen(h->text) + 1;
  if (size > max) { *len = 0; return leave(INVALID_ARGUMENT); }
  if (h->type == CSTR) memcpy(out, h->text, (size_t)size);
  else memcpy(out, &h->value, (size_t)size); /* little-endian: the low bytes */
  *len = size;
  return leave(OK);
}

/* Groups: ncclGroupSimulateEnd checks NCCL_SIM_INFO_INITIALIZER as NCCL does and, asked to
 * by NCCL_RS_FAKE_ESTIMATE_US, writes an estimate (an empty group leaves it at -1). */
static int depth;
ncclResult_t ncclGroupStart(void) { depth++; return OK; }
ncclResult_t ncclGroupEnd(void) { depth--; return OK; }
typedef struct { size_t size; unsigned int magic; unsigned int version; float estimatedTime; } simInfo;
ncclResult_t ncclGroupSimulateEnd(simInfo* info) {
  if (depth-- <= 0) return 5;
  if (info->size != sizeof(simInfo) || sizeof(simInfo) != 24 || info->magic != 0x74685283u ||
      info->version != 23203 || info->estimatedTime != -1.0f) return INVALID_ARGUMENT;
  const char* estimate = getenv("NCCL_RS_FAKE_ESTIMATE_US");
  if (estimate) info->estimatedTime = (float)atof(estimate);
  return OK;
}

#define GETTER(name, ctype, tid) \
  ncclResult_t name(const struct param* h, ctype* out) { \
    enter(); \
    if (h->type != tid) return leave(INVALID_ARGUMENT); \
    *out = (ctype)h->value; \
    return leave(OK); \
  }
GETTER(ncclParamGetI8, int8_t, I8)
GETTER(ncclParamGetI16, int16_t, I16)
GETTER(ncclParamGetI32, int32_t, I32)
GETTER(ncclParamGetI64, int64_t, I64)
GETTER(ncclParamGetU8, uint8_t, U8)
GETTER(ncclParamGetU16, uint16_t, U16)
GETTER(ncclParamGetU32, uint32_t, U32)
GETTER(ncclParamGetU64, uint64_t, U64)
"#;

/// Compiles the stand-in into `dir`, or says why not.
fn build(dir: &Path) -> Option<PathBuf> {
    std::fs::create_dir_all(dir).ok()?;
    let src = dir.join("fake_params.c");
    std::fs::write(&src, FAKE_NCCL).ok()?;
    let out = dir.join("libnccl.so.2");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(&src)
        .status();
    match status {
        Ok(s) if s.success() => Some(out),
        other => {
            eprintln!("SKIPPED params: cannot build the stand-in libnccl with `{cc}`: {other:?}");
            None
        }
    }
}

/// Reads every parameter, and one by one, from several threads at once, many times: each
/// result must be what one thread read alone.
fn from_many_threads_at_once(alone: &nccl::params::Params) {
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let alone = alone.clone();
            std::thread::spawn(move || {
                for _ in 0..25 {
                    assert_eq!(nccl::params::all().expect("all, threaded"), alone);
                    for param in &alone.params {
                        let one = nccl::params::get(&param.key).expect("get, threaded");
                        assert_eq!(one.as_ref(), Some(param));
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("a reading thread failed");
    }
}

/// Runs this test again in a child process that loads `lib` as NCCL `version` (a code).
fn child(lib: &Path, version: &str) {
    let status = Command::new(std::env::current_exe().expect("current_exe"))
        .args(["params_of_a_stand_in_library", "--exact", "--nocapture"])
        .env(CHILD_ENV, "1")
        .env("NCCL_LIBRARY", lib)
        .env("NCCL_RS_FAKE_VERSION", version)
        .status()
        .expect("spawn child");
    assert!(status.success(), "child as NCCL code {version}: {status}");
}

/// In the child: the API is refused, saying which version it needs.
fn refused_on_an_older_library() {
    let found = nccl::version().expect("the stand-in loads");
    assert!(found < Version::new(2, 30, 3), "{found}");
    for result in [
        nccl::params::all().map(drop),
        nccl::params::get("NCCL_DEBUG").map(drop),
    ] {
        match result {
            Err(Error::Unsupported {
                api,
                needs,
                found: f,
            }) => {
                assert!(api.starts_with("ncclParam"), "{api}");
                assert_eq!(needs, Version::new(2, 30, 3));
                assert_eq!(f, found);
            }
            other => panic!("expected Unsupported on NCCL {found}, got {other:?}"),
        }
    }
    if found < Version::new(2, 22, 0) {
        match nccl::Group::simulate() {
            Err(Error::Unsupported { api, needs, .. }) => {
                assert_eq!(api, "ncclGroupSimulateEnd");
                assert_eq!(needs, Version::new(2, 22, 0));
            }
            other => panic!("Group::simulate on NCCL {found}: {other:?}"),
        }
        assert!(
            !nccl::group::is_open(),
            "a refused simulation left a group open"
        );
    }
    println!("refused on NCCL {found}");
}

#[test]
fn params_of_a_stand_in_library() {
    if std::env::var_os(CHILD_ENV).is_some() {
        refused_on_an_older_library();
        return;
    }
    let dir = std::env::temp_dir().join(format!("nccl-rs-params-{}", std::process::id()));
    let Some(lib) = build(&dir) else { return };
    child(&lib, "22105");
    child(&lib, "22803");
    child(&lib, "23002");

    nccl::library::load_from(&lib).expect("the stand-in loads");
    let params = nccl::params::all().expect("params");
    assert_eq!(params.version, Version::new(2, 32, 3));
    assert_eq!(params.library, lib);
    let keys: Vec<&str> = params.params.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "NCCL_DEBUG",
            "NCCL_DEBUG_SUBSYS",
            "NCCL_DEBUG_TIMESTAMP_LEVELS",
            "NCCL_DEBUG_TIMESTAMP_FORMAT",
            "NCCL_DEBUG_FILE",
            "NCCL_SET_THREAD_NAME",
            "NCCL_TEST_NEGATIVE",
            "NCCL_TEST_BYTE",
        ]
    );
    let value = |key: &str| params.get(key).expect(key).value.clone();
    // Integers where NCCL's typed getters read them, text for the rest.
    assert_eq!(value("NCCL_DEBUG_SUBSYS"), ParamValue::U64(4225));
    assert_eq!(value("NCCL_DEBUG_TIMESTAMP_LEVELS"), ParamValue::U32(68));
    assert_eq!(value("NCCL_TEST_NEGATIVE"), ParamValue::I16(-7));
    assert_eq!(value("NCCL_TEST_BYTE"), ParamValue::U8(200));
    assert_eq!(value("NCCL_DEBUG"), ParamValue::Text("WARN".into()));
    assert_eq!(
        value("NCCL_SET_THREAD_NAME"),
        ParamValue::Text("FALSE".into())
    );
    assert_eq!(
        value("NCCL_DEBUG_TIMESTAMP_FORMAT"),
        ParamValue::Text("[%F %T] ".into())
    );
    // Every text was copied before the next call overwrote NCCL's buffer.
    assert_eq!(
        params.get("NCCL_DEBUG_SUBSYS").unwrap().text,
        "INIT,ENV,BOOTSTRAP"
    );
    assert_eq!(params.get("NCCL_DEBUG_FILE").unwrap().text, "");

    let report = params.to_string();
    println!("{report}");
    assert!(
        report.contains(&format!("NCCL 2.32.3 loaded from {}", lib.display())),
        "{report}"
    );
    assert!(report.contains("NCCL parameters (8):"), "{report}");
    assert!(
        report.contains("\n  NCCL_DEBUG_SUBSYS=INIT,ENV,BOOTSTRAP (4225)"),
        "{report}"
    );
    assert!(report.contains("\n  NCCL_DEBUG_FILE=<unset>"), "{report}");
    assert!(report.contains("\n  NCCL_TEST_NEGATIVE=-7\n"), "{report}");

    // One key; an unknown one (or one NCCL reads the older way) is None.
    let one = nccl::params::get("NCCL_DEBUG_TIMESTAMP_LEVELS")
        .expect("get")
        .expect("known key");
    assert_eq!(one.value.as_u64(), Some(68));
    assert_eq!(one.text, "WARN,ATTN");
    assert_eq!(nccl::params::get("NCCL_PROTO").expect("get"), None);
    match nccl::params::get("NCCL_\0DEBUG") {
        Err(Error::InvalidArgument(text)) => assert!(text.contains("NUL"), "{text}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }

    // Many threads at once: the stand-in fails every call from the first moment two threads
    // are inside it together, as NCCL's unguarded set would be corrupted.
    from_many_threads_at_once(&params);

    // A simulation hands NCCL an initialised ncclSimInfo_t and reads its estimate back; one
    // that planned nothing (NCCL leaves -1) has none. The group is closed either way.
    match nccl::Group::simulate().expect("simulate").estimate() {
        Err(Error::Unavailable { api, reason }) => {
            assert_eq!(api, "ncclGroupSimulateEnd");
            assert!(reason.contains("no estimate"), "{reason}");
        }
        other => panic!("an empty simulation: {other:?}"),
    }
    assert!(!nccl::group::is_open());
    std::env::set_var("NCCL_RS_FAKE_ESTIMATE_US", "250.5");
    let estimate = nccl::Group::simulate()
        .unwrap()
        .estimate()
        .expect("estimate");
    assert_eq!(estimate, std::time::Duration::from_nanos(250_500));
    // Dropped unfinished, a simulation is still only simulated, and closes its group.
    drop(nccl::Group::simulate().unwrap());
    assert!(!nccl::group::is_open());
    let group = nccl::Group::start().expect("a group opens after simulations");
    group.finish().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
