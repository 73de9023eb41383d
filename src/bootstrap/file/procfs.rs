//! Facts about a process from `/proc`, used to tell a live rank 0 from a dead one.

use std::path::Path;

use crate::bootstrap::bytes::fnv1a;

/// The state letter and start time (clock ticks after boot) from a `/proc/<pid>/stat` line.
pub(super) fn parse_stat(text: &str) -> Option<(char, u64)> {
    // The command name (field 2) may hold spaces and parentheses: fields after it start
    // after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 is the state; the start time is field 22, i.e. 19 fields further.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// This process's start time, or 0 when `/proc` cannot tell.
pub(super) fn own_start_ticks() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|text| parse_stat(&text))
        .map_or(0, |(_, start)| start)
}

/// A hash of this process's pid namespace, or 0 when unknown. Pids are only comparable
/// within one namespace (containers sharing a directory have separate ones).
pub(super) fn own_pid_namespace() -> u64 {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .map_or(0, |link| fnv1a(link.as_os_str().as_encoded_bytes()) | 1)
}

/// This process's user id, from the owner of `/proc/self`.
#[cfg(unix)]
pub(super) fn own_uid() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").ok().map(|meta| meta.uid())
}

#[cfg(not(unix))]
pub(super) fn own_uid() -> Option<u32> {
    None
}

/// Whether `pid` still runs the process that started at `start_ticks`: `Some(true)` yes,
/// `Some(false)` no (gone, a zombie, or the pid reused), `None` cannot tell.
pub(super) fn is_running(pid: u32, start_ticks: u64) -> Option<bool> {
    match std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat")) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(false),
        Err(_) => None,
        Ok(text) => {
            let (state, start) = parse_stat(&text)?;
            Some(start == start_ticks && !matches!(state, 'Z' | 'X' | 'x'))
        }
    }
}
