//! Reading RAS reports: the JSON one (repaired where NCCL 2.28.7 to 2.28.9 leave a comma
//! out), and the text one, from which the communicators NCCL found wrong are picked.

use serde_json::Value;

use super::{RasComm, RasIssue, RasMissingRank, RasRank};

/// NCCL's "success" and "in progress" result codes: not errors in a rank's status.
const NOT_AN_ERROR: [i64; 2] = [0, 7];

/// What a report says.
#[derive(Debug, Default)]
pub(super) struct Parsed {
    pub(super) nccl_version: Option<String>,
    pub(super) communicators: Vec<RasComm>,
    pub(super) dead_processes: bool,
}

/// Inserts the commas a JSON document lacks between a value and the next key or value (what
/// NCCL 2.28.7 to 2.28.9 leave out after a missing rank's `nvml_dev`), and drops commas
/// before a closing bracket. Strings are copied untouched.
pub(super) fn repair_json(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 16);
    let mut in_string = false;
    let mut escaped = false;
    // The last significant character outside strings, and whether whitespace followed it.
    let mut last: Option<char> = None;
    let mut gap = false;
    for c in text.chars() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
                last = Some('"');
                gap = false;
            }
            continue;
        }
        if c.is_whitespace() {
            gap = true;
            out.push(c);
            continue;
        }
        let starts_value = matches!(c, '"' | '{' | '[' | '-' | '0'..='9' | 't' | 'f' | 'n');
        let ended_value = match last {
            Some('"' | '}' | ']') => true,
            Some(l) => gap && (l.is_ascii_alphanumeric()),
            None => false,
        };
        if starts_value && ended_value {
            out.push(',');
        }
        if matches!(c, '}' | ']') && last == Some(',') {
            // A trailing comma: drop it (it is the last non-space character written).
            if let Some(at) = out.rfind(',') {
                out.remove(at);
            }
        }
        out.push(c);
        if c == '"' {
            in_string = true;
        }
        last = Some(c);
        gap = false;
    }
    out
}

/// The communicators of a JSON report (repaired first, see [`repair_json`]).
pub(super) fn json_report(text: &str) -> Result<Parsed, String> {
    let value: Value = match serde_json::from_str(text) {
        Ok(value) => value,
        Err(_) => serde_json::from_str(&repair_json(text)).map_err(|e| e.to_string())?,
    };
    let comms = value
        .get("communicators")
        .and_then(Value::as_array)
        .ok_or("no \"communicators\" array")?;
    let mut parsed = Parsed {
        nccl_version: value
            .get("nccl_version")
            .and_then(Value::as_str)
            .map(str::to_owned),
        ..Parsed::default()
    };
    for comm in comms {
        let comm = json_comm(comm)?;
        parsed.dead_processes |= comm.issues.contains(&RasIssue::Dead);
        parsed.communicators.push(comm);
    }
    Ok(parsed)
}

fn int(value: &Value, key: &str) -> Option<i64> {
    value.get(key).and_then(Value::as_i64)
}

fn flag(value: &Value, key: &str) -> bool {
    value.get(key).and_then(Value::as_bool).unwrap_or(false)
}

fn rank_of(value: &Value) -> Result<usize, String> {
    int(value, "rank")
        .and_then(|r| usize::try_from(r).ok())
        .ok_or_else(|| "a rank without a valid \"rank\"".to_owned())
}

/// `"0x1a2b"` (or plain hex) as a number.
fn hash_of(text: &str) -> Option<u64> {
    let digits = text.trim();
    let digits = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
        .unwrap_or(digits);
    u64::from_str_radix(digits, 16).ok()
}

fn json_comm(comm: &Value) -> Result<RasComm, String> {
    let hash = comm
        .get("hash")
        .and_then(Value::as_str)
        .and_then(hash_of)
        .ok_or("a communicator without a valid \"hash\"")?;
    let empty = Vec::new();
    let mut ranks = Vec::new();
    for rank in comm
        .get("ranks")
        .and_then(Value::as_array)
        .unwrap_or(&empty)
    {
        let status = rank.get("status").unwrap_or(&Value::Null);
        let counts = rank
            .get("collective_counts")
            .and_then(Value::as_object)
            .map(|counts| {
                counts
                    .iter()
                    .filter_map(|(name, n)| n.as_u64().map(|n| (name.clone(), n)))
                    .collect()
            })
            .unwrap_or_default();
        ranks.push(RasRank {
            rank: rank_of(rank)?,
            host: rank
                .get("host")
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_owned(),
            pid: int(rank, "pid").unwrap_or(-1),
            cuda_dev: int(rank, "cuda_dev").unwrap_or(-1),
            init_state: int(status, "init_state").unwrap_or(0),
            async_error: int(status, "async_error").unwrap_or(0),
            abort_flag: flag(status, "abort_flag"),
            collective_counts: counts,
        });
    }
    let mut missing_ranks = Vec::new();
    let listed = comm
        .get("missing_ranks")
        .and_then(Value::as_array)
        .unwrap_or(&empty);
    for missing in listed {
        let status = missing.get("status").unwrap_or(&Value::Null);
        missing_ranks.push(RasMissingRank {
            rank: rank_of(missing)?,
            unresponsive: flag(status, "unresponsive"),
            considered_dead: flag(status, "considered_dead"),
        });
    }
    let mut issues = Vec::new();
    let counts_differ = ranks.windows(2).any(|pair| {
        let (a, b) = (&pair[0], &pair[1]);
        let mut a_counts = a.collective_counts.clone();
        let mut b_counts = b.collective_counts.clone();
        a_counts.sort();
        b_counts.sort();
        a_counts != b_counts || a.abort_flag != b.abort_flag
    });
    if counts_differ {
        issues.push(RasIssue::Mismatch);
    }
    let missing_count = int(comm, "missing_ranks_count").unwrap_or(0);
    if missing_count > 0 || !missing_ranks.is_empty() {
        issues.push(RasIssue::Incomplete);
    }
    if ranks
        .iter()
        .any(|r| !NOT_AN_ERROR.contains(&r.init_state) || !NOT_AN_ERROR.contains(&r.async_error))
    {
        issues.push(RasIssue::Error);
    }
    if missing_ranks.iter().any(|m| m.considered_dead) {
        issues.push(RasIssue::Dead);
    }
    let operation_counts = ranks
        .iter()
        .map(|r| {
            // Saturating: a malformed report must not overflow (a panic in debug builds).
            let total = r
                .collective_counts
                .iter()
                .fold(0u64, |sum, (_, n)| sum.saturating_add(*n));
            (r.rank, total)
        })
        .collect();
    Ok(RasComm {
        hash,
        size: int(comm, "size").and_then(|s| usize::try_from(s).ok()),
        issues,
        ranks,
        missing_ranks,
        operation_counts,
    })
}

/// The communicators of a text report: one per `#<group>-<index> (<hash>) <VERDICT>`
/// section, with the ranks its lines name. Never fails: what it does not recognise it skips.
pub(super) fn text_report(text: &str) -> Parsed {
    let mut parsed = Parsed::default();
    // The section being read: the communicator's position in `parsed`, and its verdict.
    let mut section: Option<(usize, RasIssue)> = None;
    // In a MISMATCH section, the count the lines after "N ranks have launched up to
    // operation M" give their ranks.
    let mut pending_count: Option<u64> = None;
    for line in text.lines() {
        if let Some(version) = line.strip_prefix("NCCL version ") {
            let version = version.split_whitespace().next().unwrap_or_default();
            parsed
                .nccl_version
                .get_or_insert_with(|| version.to_owned());
        }
        if line.trim() == "DEAD" {
            parsed.dead_processes = true;
        }
        if !line.starts_with(' ') {
            section = section_header(line).map(|(hash, issue)| {
                let at = match parsed.communicators.iter().position(|c| c.hash == hash) {
                    Some(at) => at,
                    None => {
                        parsed.communicators.push(RasComm {
                            hash,
                            size: None,
                            issues: Vec::new(),
                            ranks: Vec::new(),
                            missing_ranks: Vec::new(),
                            operation_counts: Vec::new(),
                        });
                        parsed.communicators.len() - 1
                    }
                };
                let comm = &mut parsed.communicators[at];
                if !comm.issues.contains(&issue) {
                    comm.issues.push(issue);
                }
                (at, issue)
            });
            pending_count = None;
            continue;
        }
        let Some((at, issue)) = section else {
            continue;
        };
        let comm = &mut parsed.communicators[at];
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            // "N ranks have launched up to operation M" / "N ranks have not launched any"
            [_, "ranks", "have", "launched", "up", "to", "operation", m, ..] => {
                pending_count = m.parse().ok();
            }
            [_, "ranks", "have", "not", "launched", ..] => pending_count = Some(0),
            ["Rank", r, "has", "launched", "up", "to", "operation", m, ..] => {
                if let (Ok(r), Ok(m)) = (r.parse(), m.parse()) {
                    comm.operation_counts.push((r, m));
                }
            }
            ["Rank", r, "has", "not", "launched", ..] => {
                if let Ok(r) = r.parse() {
                    comm.operation_counts.push((r, 0));
                }
            }
            ["Rank", r, "--", ..] => {
                let Ok(r) = r.parse::<usize>() else {
                    continue;
                };
                match issue {
                    RasIssue::Incomplete => comm.missing_ranks.push(RasMissingRank {
                        rank: r,
                        unresponsive: false,
                        considered_dead: false,
                    }),
                    _ => {
                        if let Some(m) = pending_count {
                            comm.operation_counts.push((r, m));
                        }
                    }
                }
            }
            _ => {}
        }
    }
    for comm in &mut parsed.communicators {
        comm.operation_counts.sort_unstable();
        comm.operation_counts.dedup();
        comm.issues.sort_unstable();
    }
    parsed
}

/// `#0-1 (00000000deadbeef) MISMATCH` as the communicator's hash and the verdict.
fn section_header(line: &str) -> Option<(u64, RasIssue)> {
    let rest = line.strip_prefix('#')?;
    let open = rest.find('(')?;
    let close = rest[open..].find(')')? + open;
    let hash = hash_of(&rest[open + 1..close])?;
    let issue = match rest[close + 1..].trim() {
        "MISMATCH" => RasIssue::Mismatch,
        "INCOMPLETE" => RasIssue::Incomplete,
        "ERROR" => RasIssue::Error,
        _ => return None,
    };
    Some((hash, issue))
}
