//! Output: nccl-tests' table, the closing lines, and the optional JSON and CSV files.
//!
//! Just past 600 lines with its tests: every output format reads the same measurement rows,
//! and keeping them together keeps the columns of the table, JSON and CSV in step.

use std::fmt::Write as _;
use std::path::Path;

use crate::args::{Apis, Mode, RegisterMode};
use crate::coll::Coll;
use crate::ops::Api;
use crate::BenchResult;

/// One API's figures for one placement of one row (combined over ranks).
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// The API that issued the operations.
    pub api: Api,
    /// µs per operation (median in latency mode).
    pub time_us: f64,
    /// 99th percentile in µs (latency mode).
    pub p99_us: Option<f64>,
    /// Host time spent issuing, µs per operation.
    pub cpu_us: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// Wrong elements over all ranks (`None` when not checked).
    pub wrong: Option<u64>,
    /// With `--compare` and several rounds, on the first API's measurement: the median over
    /// rounds of its shown time divided by the second API's in the same round.
    pub paired: Option<f64>,
}

/// One line of the table: a size, type and reduction, out of place and in place.
#[derive(Debug, Clone)]
pub struct Row {
    /// Bytes (nccl-tests' "size").
    pub size: usize,
    /// NCCL's count argument.
    pub count: usize,
    /// Element type name.
    pub dtype: &'static str,
    /// Reduction name (`none` without one).
    pub redop: &'static str,
    /// Root (-1 without one).
    pub root: i64,
    /// Out-of-place figures, one per API.
    pub out_of_place: Vec<Measured>,
    /// In-place figures, one per API (empty where no in-place form exists).
    pub in_place: Vec<Measured>,
}

/// Everything measured, with what is needed to present it.
#[derive(Debug)]
pub struct Report {
    /// The operation.
    pub coll: Coll,
    /// How the buffers were registered (`-R`).
    pub register: RegisterMode,
    /// The timing mode.
    pub mode: Mode,
    /// Which APIs were measured.
    pub apis: Apis,
    /// Number of ranks.
    pub ranks: usize,
    /// Report host issue time in the time column (`-C 1`).
    pub cputime: bool,
    /// The rows so far.
    pub rows: Vec<Row>,
}

/// The speedup of `other` over `base`, row by row: time(base) / time(other) for every API
/// and placement (above 1: `other` is faster). Both reports must come from the same sweep
/// (same sizes, types and reductions in the same order); `base_label` and `other_label`
/// name them (`-R 0` and `-R 2`, or two collectives).
pub fn speedup(base: &Report, other: &Report, base_label: &str, other_label: &str) -> String {
    let mut out = format!(
        "#\n# Speedup of {other_label} over {base_label}: time({base_label}) / \
         time({other_label}), above 1 is faster\n"
    );
    let ratio = |a: &Measured, b: &Measured| {
        if b.time_us > 0.0 {
            format!("{:.3}", a.time_us / b.time_us)
        } else {
            "N/A".to_string()
        }
    };
    let mut names = String::new();
    for placement in ["out-of-place", "in-place"] {
        for m in base
            .rows
            .first()
            .map_or(&[][..], |row| &row.out_of_place[..])
        {
            let _ = write!(names, "  {:>18}", format!("{} {placement}", m.api.name()));
        }
    }
    let _ = writeln!(
        out,
        "# {:>10}  {:>8}  {:>6}{names}",
        "size", "type", "redop"
    );
    for (b, w) in base.rows.iter().zip(&other.rows) {
        let _ = write!(out, "  {:>10}  {:>8}  {:>6}", b.size, b.dtype, b.redop);
        for (bs, ws) in [
            (&b.out_of_place, &w.out_of_place),
            (&b.in_place, &w.in_place),
        ] {
            for i in 0..b.out_of_place.len() {
                let cell = match (bs.get(i), ws.get(i)) {
                    (Some(a), Some(c)) => ratio(a, c),
                    _ => "N/A".to_string(),
                };
                let _ = write!(out, "  {cell:>18}");
            }
        }
        out.push('\n');
    }
    out
}

/// nccl-tests' time format: fewer decimals for longer times.
fn time_str(us: f64) -> String {
    if us >= 10000.0 {
        format!("{us:7.0}")
    } else if us >= 100.0 {
        format!("{us:7.1}")
    } else {
        format!("{us:7.2}")
    }
}

/// Like C's `%g`: six significant digits, trailing zeros dropped.
pub fn g(value: f64) -> String {
    if value == 0.0 || !value.is_finite() {
        return format!("{value}");
    }
    let exponent = value.abs().log10().floor() as i32;
    if !(-5..6).contains(&exponent) {
        return format!("{value:.5e}");
    }
    let decimals = (5 - exponent).max(0) as usize;
    let text = format!("{value:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

fn wrong_str(wrong: Option<u64>) -> String {
    wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string())
}

/// One column of a placement (out of place or in place): header name and unit, width.
type Column = (&'static str, &'static str, usize);

/// The columns of each table layout. "time" in a name becomes "cputime" with `-C 1`.
const COMPARE_LATENCY: &[Column] = &[
    ("safe p50", "(us)", 8),
    ("raw p50", "(us)", 8),
    ("diff", "(%)", 7),
    ("safe p99", "(us)", 8),
    ("raw p99", "(us)", 8),
    ("busbw", "(GB/s)", 6),
    ("#wrong", "", 6),
];
const COMPARE: &[Column] = &[
    ("safe time", "(us)", 8),
    ("raw time", "(us)", 8),
    ("diff", "(%)", 7),
    ("busbw", "safe", 6),
    ("busbw", "raw", 6),
    ("#wrong", "", 6),
];
const LSA: &[Column] = &[
    ("nccl time", "(us)", 9),
    ("kernel time", "(us)", 11),
    ("diff", "(%)", 7),
    ("busbw", "nccl", 6),
    ("busbw", "kernel", 6),
    ("#wrong", "", 6),
];
const LSA_LATENCY: &[Column] = &[
    ("nccl p50", "(us)", 8),
    ("kernel p50", "(us)", 10),
    ("diff", "(%)", 7),
    ("nccl p99", "(us)", 8),
    ("kernel p99", "(us)", 10),
    ("busbw", "(GB/s)", 6),
    ("#wrong", "", 6),
];
const LATENCY: &[Column] = &[
    ("p50", "(us)", 7),
    ("p99", "(us)", 7),
    ("algbw", "(GB/s)", 6),
    ("busbw", "(GB/s)", 6),
    ("#wrong", "", 5),
];
const TIMED: &[Column] = &[
    ("time", "(us)", 7),
    ("algbw", "(GB/s)", 6),
    ("busbw", "(GB/s)", 6),
    ("#wrong", "", 5),
];

/// Values right-aligned in their columns, each after two spaces: nccl-tests' layout.
fn cells<S: AsRef<str>>(columns: &[Column], values: &[S]) -> String {
    let mut out = String::new();
    for ((_, _, width), value) in columns.iter().zip(values) {
        let _ = write!(out, "  {:>width$}", value.as_ref());
    }
    out
}

impl Report {
    /// The time the time columns show: the host time spent issuing with `-C 1`, except in
    /// latency mode, whose columns are the device times' percentiles.
    fn shown_time(&self, m: &Measured) -> f64 {
        if self.cputime && self.mode != Mode::Latency {
            m.cpu_us
        } else {
            m.time_us
        }
    }

    fn time_label(&self) -> &'static str {
        if self.cputime {
            "cputime"
        } else {
            "time"
        }
    }

    /// The columns of each placement in this report's layout.
    fn columns(&self) -> &'static [Column] {
        match (self.apis, self.mode) {
            (Apis::Compare, Mode::Latency) => COMPARE_LATENCY,
            (Apis::Compare, _) => COMPARE,
            (Apis::Lsa(_), Mode::Latency) => LSA_LATENCY,
            (Apis::Lsa(_), _) => LSA,
            (_, Mode::Latency) => LATENCY,
            _ => TIMED,
        }
    }

    /// The three header lines of the table.
    pub fn header(&self) -> String {
        let lead = |a: &str, b: &str, c: &str, d: &str, e: &str| {
            format!("# {a:>10}  {b:>12}  {c:>8}  {d:>6}  {e:>6}")
        };
        let columns = self.columns();
        let title = match (self.apis, self.mode) {
            (Apis::Compare | Apis::Lsa(_), _) => {
                let width: usize = columns.iter().map(|(_, _, width)| width + 2).sum();
                format!("{:^width$}{:^width$}", "out-of-place", "in-place")
            }
            // nccl-tests' lines, as it prints them.
            (_, Mode::Latency) => {
                "             out-of-place                                in-place".to_string()
            }
            _ => "           out-of-place                       in-place          ".to_string(),
        };
        // Names right-aligned with their two spaces of separation, of which a name one wider
        // than its column takes one, as nccl-tests' `#wrong` does.
        let mut names = String::new();
        for (name, _, width) in columns {
            let name = name.replace("time", self.time_label());
            let _ = write!(names, " {name:>0$}", width + 1);
        }
        let units: Vec<&str> = columns.iter().map(|(_, unit, _)| *unit).collect();
        let units = cells(columns, &units);
        format!(
            "{}{title}\n{}{names}{names}\n{}{units}{units}\n",
            lead("", "", "", "", ""),
            lead("size", "count", "type", "redop", "root"),
            lead("(B)", "(elements)", "", "", "")
        )
    }

    /// One table line.
    pub fn line(&self, row: &Row) -> String {
        let mut out = format!(
            "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}",
            row.size, row.count, row.dtype, row.redop, row.root
        );
        for cell in [&row.out_of_place, &row.in_place] {
            out.push_str(&self.cell(cell));
        }
        out
    }

    /// One placement's columns of a table line; N/A where nothing was measured.
    fn cell(&self, cell: &[Measured]) -> String {
        let columns = self.columns();
        let find = |api| cell.iter().find(|m| m.api == api);
        let latency = self.mode == Mode::Latency;
        let p99 = |m: &Measured| time_str(m.p99_us.unwrap_or(f64::NAN));
        let (first, second) = self.apis.pair().unwrap_or((Api::Safe, Api::Raw));
        let paired = self.apis.pair().is_some();
        let values: Vec<String> = match (paired, find(first), find(second)) {
            (true, Some(safe), Some(raw)) => {
                let (ts, tr) = (self.shown_time(safe), self.shown_time(raw));
                let mut values = vec![
                    time_str(ts),
                    time_str(tr),
                    format!("{:+.1}", (ts / tr - 1.0) * 100.0),
                ];
                if latency {
                    values.extend([p99(safe), p99(raw), format!("{:.2}", safe.busbw)]);
                } else {
                    values.extend([format!("{:.2}", safe.busbw), format!("{:.2}", raw.busbw)]);
                }
                let checked: Vec<u64> = cell.iter().filter_map(|m| m.wrong).collect();
                values.push(if checked.is_empty() {
                    "N/A".to_string()
                } else {
                    checked.iter().sum::<u64>().to_string()
                });
                values
            }
            // The difference column stays empty.
            (true, ..) => (0..columns.len())
                .map(|i| if i == 2 { "" } else { "N/A" }.to_string())
                .collect(),
            _ => match cell.first() {
                Some(m) => {
                    let mut values = vec![time_str(self.shown_time(m))];
                    if latency {
                        values.push(p99(m));
                    }
                    values.extend([
                        format!("{:.2}", m.algbw),
                        format!("{:.2}", m.busbw),
                        wrong_str(m.wrong),
                    ]);
                    values
                }
                None => vec!["N/A".to_string(); columns.len()],
            },
        };
        cells(columns, &values)
    }

    /// Every measurement with its row and placement (in place or not).
    pub fn all(&self) -> impl Iterator<Item = (&Row, bool, &Measured)> {
        self.rows.iter().flat_map(|row| {
            row.out_of_place
                .iter()
                .map(move |m| (row, false, m))
                .chain(row.in_place.iter().map(move |m| (row, true, m)))
        })
    }

    /// Measurements (out of place and in place) with wrong elements.
    pub fn failures(&self) -> usize {
        self.all()
            .filter(|(_, _, m)| m.wrong.unwrap_or(0) > 0)
            .count()
    }

    /// The closing lines: errors and average bus bandwidth (and, comparing, the ratios).
    pub fn footer(&self) -> String {
        let mut out = String::new();
        let failures = self.failures();
        let _ = writeln!(
            out,
            "# Out of bounds values : {failures} {}",
            if failures > 0 { "FAILED" } else { "OK" }
        );
        let avg = |api: Api| {
            let values: Vec<f64> = self
                .all()
                .filter(|(_, _, m)| m.api == api)
                .map(|(_, _, m)| m.busbw)
                .collect();
            values.iter().sum::<f64>() / values.len().max(1) as f64
        };
        match *self.apis.list() {
            [api] => {
                let _ = writeln!(out, "# Avg bus bandwidth    : {} ", g(avg(api)));
            }
            _ => {
                let (safe, raw) = (avg(Api::Safe), avg(Api::Raw));
                let _ = writeln!(
                    out,
                    "# Avg bus bandwidth    : safe {}  raw {}  (safe/raw {:.4})",
                    g(safe),
                    g(raw),
                    safe / raw
                );
                out.push_str(&self.ratios());
            }
        }
        out.push_str("#\n");
        out
    }

    /// Safe-to-raw ratios: time below 1 MiB, bus bandwidth from 1 MiB.
    fn ratios(&self) -> String {
        let mut small = Vec::new();
        let mut paired = Vec::new();
        let mut large = Vec::new();
        for row in &self.rows {
            for cell in [&row.out_of_place, &row.in_place] {
                let safe = cell.iter().find(|m| m.api == Api::Safe);
                let raw = cell.iter().find(|m| m.api == Api::Raw);
                if let (Some(safe), Some(raw)) = (safe, raw) {
                    if row.size < 1 << 20 {
                        small.push(self.shown_time(safe) / self.shown_time(raw));
                        paired.extend(safe.paired);
                    } else if raw.busbw > 0.0 {
                        large.push(safe.busbw / raw.busbw);
                    }
                }
            }
        }
        let summary = |values: &[f64]| {
            let finite: Vec<f64> = values
                .iter()
                .copied()
                .filter(|v| v.is_finite() && *v > 0.0)
                .collect();
            if finite.is_empty() {
                return "none".to_string();
            }
            let geomean = (finite.iter().map(|v| v.ln()).sum::<f64>() / finite.len() as f64).exp();
            let min = finite.iter().copied().fold(f64::MAX, f64::min);
            let max = finite.iter().copied().fold(f64::MIN, f64::max);
            format!(
                "geomean {geomean:.4}, min {min:.4}, max {max:.4} ({} measurements)",
                finite.len()
            )
        };
        let mut out = format!("# safe/raw time  (< 1 MiB)  : {}\n", summary(&small));
        if !paired.is_empty() {
            // The ratio of two medians keeps a drift of the machine between rounds; the
            // per-round ratio (both APIs measured back to back) cancels it.
            out.push_str(&format!(
                "# safe/raw time  (< 1 MiB), median of per-round ratios : {}\n",
                summary(&paired)
            ));
        }
        out.push_str(&format!(
            "# safe/raw busbw (>= 1 MiB) : {}\n",
            summary(&large)
        ));
        out
    }

    /// Every measurement as one JSON document.
    pub fn json(&self, meta: serde_json::Value) -> String {
        let results: Vec<serde_json::Value> = self
            .all()
            .map(|(row, in_place, m)| {
                serde_json::json!({
                    "collective": self.coll.name(),
                    "api": m.api.name(),
                    "mode": mode_name(self.mode),
                    "ranks": self.ranks,
                    "size_bytes": row.size,
                    "count": row.count,
                    "type": row.dtype,
                    "redop": row.redop,
                    "root": row.root,
                    "in_place": in_place,
                    "time_us": m.time_us,
                    "p99_us": m.p99_us,
                    "cputime_us": m.cpu_us,
                    "algbw_gbps": m.algbw,
                    "busbw_gbps": m.busbw,
                    "wrong": m.wrong,
                    "paired_ratio": m.paired,
                })
            })
            .collect();
        let doc = serde_json::json!({ "benchmark": meta, "results": results });
        serde_json::to_string_pretty(&doc).unwrap_or_default()
    }

    /// Every measurement as CSV, one line each.
    pub fn csv(&self) -> String {
        let mut out = String::from(
            "collective,api,mode,ranks,size_bytes,count,type,redop,root,in_place,time_us,p99_us,cputime_us,algbw_gbps,busbw_gbps,wrong\n",
        );
        for (row, in_place, m) in self.all() {
            let _ = writeln!(
                out,
                "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
                self.coll.name(),
                m.api.name(),
                mode_name(self.mode),
                self.ranks,
                row.size,
                row.count,
                row.dtype,
                row.redop,
                row.root,
                in_place,
                m.time_us,
                m.p99_us.map_or_else(String::new, |v| v.to_string()),
                m.cpu_us,
                m.algbw,
                m.busbw,
                m.wrong.map_or_else(String::new, |v| v.to_string()),
            );
        }
        out
    }
}

/// The mode's name in the files.
/// The `--simulate` line after a row: NCCL's estimate beside the measured time (both in
/// microseconds) and their ratio, for each placement that has one.
pub fn simulated_line(estimates: &[(bool, std::time::Duration, f64)]) -> String {
    if estimates.is_empty() {
        return "#  simulate: no estimate (NCCL simulates only collectives, on 2+ ranks)".into();
    }
    let parts: Vec<String> = estimates
        .iter()
        .map(|&(in_place, estimate, measured_us)| {
            let estimate_us = estimate.as_secs_f64() * 1e6;
            format!(
                "{} estimate {} us, measured {} us (estimate/measured {})",
                if in_place { "in-place" } else { "out-of-place" },
                g(estimate_us),
                g(measured_us),
                if measured_us > 0.0 {
                    format!("{:.2}", estimate_us / measured_us)
                } else {
                    "n/a".into()
                }
            )
        })
        .collect();
    format!("#  simulate: {}", parts.join("; "))
}

pub fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Host => "host",
        Mode::Graph => "graph",
        Mode::Latency => "latency",
        Mode::Cold => "cold",
    }
}

/// A byte count the short way: 8B, 64KiB, 1GiB.
pub fn human_bytes(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{}{}", g((value * 100.0).round() / 100.0), units[unit])
}

/// Writes `text` to `path`, naming the file in the error.
pub fn write_file(path: &Path, text: &str) -> BenchResult<()> {
    std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()).into())
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A report of every layout's kind: four sizes, the third unchecked, the last without an
    /// in-place column.
    pub fn sample(apis: Apis, mode: Mode, cputime: bool) -> Report {
        let rows = [8usize, 4096, 1 << 20, 1 << 30]
            .into_iter()
            .enumerate()
            .map(|(k, size)| {
                let cell = |scale: f64| -> Vec<Measured> {
                    apis.list()
                        .iter()
                        .map(|&api| Measured {
                            api,
                            time_us: 3.7 * scale * (size as f64).sqrt(),
                            p99_us: (mode == Mode::Latency).then_some(5.1 * scale),
                            cpu_us: 1.3 * scale,
                            algbw: scale * size as f64 / 1e7,
                            busbw: 1.75 * scale * size as f64 / 1e7,
                            wrong: (k != 2).then_some(k as u64),
                            paired: (api == Api::Safe).then_some(1.0 + 0.01 * k as f64),
                        })
                        .collect()
                };
                Row {
                    size,
                    count: size / 4,
                    dtype: "float",
                    redop: "sum",
                    root: -1,
                    out_of_place: cell(1.0),
                    in_place: if k == 3 { Vec::new() } else { cell(1.1) },
                }
            })
            .collect();
        Report {
            register: RegisterMode::None,
            coll: Coll::AllReduce,
            mode,
            apis,
            ranks: 8,
            cputime,
            rows,
        }
    }

    #[test]
    fn the_simulate_line_is_a_comment_with_estimate_beside_measurement() {
        let line = simulated_line(&[
            (false, std::time::Duration::from_micros(50), 100.0),
            (true, std::time::Duration::from_nanos(12_500), 10.0),
        ]);
        assert!(line.starts_with("#  simulate: "), "{line}");
        assert!(
            line.contains("out-of-place estimate 50 us, measured 100 us (estimate/measured 0.50)"),
            "{line}"
        );
        assert!(
            line.contains("in-place estimate 12.5 us, measured 10 us (estimate/measured 1.25)"),
            "{line}"
        );
        assert!(simulated_line(&[]).starts_with("#  simulate: no estimate"));
    }

    #[test]
    fn the_header_is_nccl_tests_own() {
        let header = sample(Apis::Safe, Mode::Host, false).header();
        let expected = [
            "#                                                              out-of-place                       in-place          ",
            "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
            "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       ",
        ];
        assert_eq!(header.lines().collect::<Vec<_>>(), expected);
    }

    #[test]
    fn speedup_is_the_ratio_of_times_row_by_row() {
        let base = sample(Apis::Compare, Mode::Host, false);
        let mut windows = sample(Apis::Compare, Mode::Host, false);
        windows.register = RegisterMode::Window;
        for row in &mut windows.rows {
            for m in row.out_of_place.iter_mut().chain(&mut row.in_place) {
                m.time_us /= 2.0;
            }
        }
        let text = speedup(&base, &windows, "-R 0", "-R 2");
        assert!(text.contains("Speedup of -R 2 over -R 0"), "{text}");
        assert!(
            text.contains("safe out-of-place") && text.contains("raw in-place"),
            "{text}"
        );
        let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(lines.len(), base.rows.len());
        for line in &lines {
            // Every measured cell is twice as fast; a row without in-place has N/A there.
            let cells: Vec<&str> = line.split_whitespace().skip(3).collect();
            assert_eq!(cells.len(), 4, "{line}");
            assert!(cells.iter().all(|c| *c == "2.000" || *c == "N/A"), "{line}");
            assert!(cells[..2].iter().all(|c| *c == "2.000"), "{line}");
        }
    }

    #[test]
    fn the_footer_gives_the_per_round_ratios_beside_the_ratio_of_medians() {
        let footer = sample(Apis::Compare, Mode::Host, false).footer();
        // The sample's paired ratios below 1 MiB: 1.00 and 1.01 (out of and in place each).
        let line = footer
            .lines()
            .find(|l| l.contains("median of per-round ratios"))
            .unwrap_or_else(|| panic!("no per-round line in\n{footer}"));
        assert!(
            line.contains("min 1.0000, max 1.0100 (4 measurements)"),
            "{line}"
        );
        let footer = sample(Apis::Safe, Mode::Host, false).footer();
        assert!(!footer.contains("per-round"), "{footer}");
    }

    #[test]
    fn every_layout_lines_up() {
        for apis in [Apis::Safe, Apis::Raw, Apis::Compare] {
            for mode in [Mode::Host, Mode::Graph, Mode::Latency] {
                for cputime in [false, true] {
                    let report = sample(apis, mode, cputime);
                    let header = report.header();
                    let lines: Vec<&str> = header.lines().collect();
                    let width = lines[2].len();
                    let case = format!("{apis:?} {mode:?} cputime {cputime}");
                    if !cputime {
                        // "safe cputime" is wider than its column; every other name fits.
                        assert_eq!(lines[1].len(), width, "{case}: names\n{header}");
                    }
                    for row in &report.rows {
                        let line = report.line(row);
                        assert_eq!(line.len(), width, "{case}:\n{header}{line}");
                    }
                }
            }
        }
    }
}
