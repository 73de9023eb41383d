//! The summary of nccl-candle's GPU tests: which multi-rank GPU tests ran (in which shape)
//! and which were skipped (and why), per test binary; nccl-rs's own
//! `../tests/zz_gpu_suite_summary.rs`, over the same ledger (`common::shape`, reused from
//! nccl-rs's harness).
//!
//! A skipped GPU test returns early and the test harness counts it as passed, with its reason
//! swallowed by output capture. So every GPU test records what it did in a ledger named after
//! the process that runs the test binaries one after another (`cargo test`, or
//! `../tests/gpu/candle.sh`), and this binary, whose name sorts last so that it runs last,
//! prints the ledger and removes it.

mod common;

use std::collections::BTreeMap;
use std::io::Write;

#[derive(Default)]
struct Binary {
    ran: Vec<(String, String)>,
    skipped: Vec<(String, String)>,
    versions: Vec<String>,
}

#[test]
fn summary_of_the_gpu_tests_that_ran_and_were_skipped() {
    let path = common::shape::ledger_path(std::os::unix::process::parent_id());
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let _ = std::fs::remove_file(&path);
    let mut binaries: BTreeMap<String, Binary> = BTreeMap::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.splitn(5, '\t').collect();
        let [binary, test, outcome, version, detail] = fields[..] else {
            continue;
        };
        let entry = binaries.entry(binary.to_owned()).or_default();
        let row = (test.to_owned(), detail.to_owned());
        // A test that started, then found it could not go on, counts as skipped, once.
        match outcome {
            "ran"
                if !entry
                    .ran
                    .iter()
                    .chain(&entry.skipped)
                    .any(|(t, _)| t == test) =>
            {
                entry.ran.push(row)
            }
            "ran" => {}
            _ => {
                entry.ran.retain(|(t, _)| t != test);
                if !entry.skipped.iter().any(|(t, _)| t == test) {
                    entry.skipped.push(row);
                }
            }
        }
        if !entry.versions.iter().any(|v| v == version) {
            entry.versions.push(version.to_owned());
        }
    }
    let mut out =
        String::from("\n=== nccl-candle GPU suite summary (multi-rank GPU tests, per binary)\n");
    if binaries.is_empty() {
        out.push_str(
            "no GPU test recorded anything in this run (GPU tests are #[ignore]d: run them with \
             --include-ignored, e.g. `tests/gpu/candle.sh`)\n",
        );
    }
    let (mut ran, mut skipped) = (0, 0);
    for (name, binary) in &binaries {
        ran += binary.ran.len();
        skipped += binary.skipped.len();
        out.push_str(&format!(
            "{name}: {} ran, {} skipped (NCCL {})\n",
            binary.ran.len(),
            binary.skipped.len(),
            binary.versions.join(", ")
        ));
        for (test, why) in &binary.skipped {
            out.push_str(&format!("    skipped {test}: {why}\n"));
        }
    }
    if !binaries.is_empty() {
        out.push_str(&format!("total: {ran} ran, {skipped} skipped\n"));
    }
    // Past the harness's output capture: the summary is for whoever runs the suite.
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
}
