//! The GPU suite's summary: which multi-rank GPU tests ran (in which shape) and which were
//! skipped (and why), per test binary.
//!
//! A skipped GPU test returns early and the test harness counts it as passed, with its reason
//! swallowed by output capture. So every GPU test records what it did (`common::shape`) in the
//! ledger of the run it is part of, a file that whoever starts the run makes and names
//! (`NCCL_RS_SUITE_LEDGER`: the `.gpu/run tests` loop). After its last binary, the runner runs
//! this one in its explicit mode, `NCCL_RS_SUITE_SUMMARY` naming that ledger: it prints the
//! summary, leaves the ledger to the runner (which removes it), and is run by name, so it
//! depends on no order of the binaries. Without that variable (`cargo test`) it prints
//! nothing: only its tests of the summary itself run.

mod common;

use common::shape::{ledger_line, print_summary, summary};

#[test]
#[ignore = "prints the summary of the run NCCL_RS_SUITE_SUMMARY names: `.gpu/run tests` runs it \
            after every other test binary"]
fn summary_of_the_gpu_tests_that_ran_and_were_skipped() {
    print_summary("GPU suite summary");
}

#[test]
fn a_ledger_is_summed_up_per_binary_each_test_once() {
    let records = [
        ("gpu_b", "t1", "ran", "2.32.3", "2 ranks, one GPU each"),
        // Its other rank.
        ("gpu_b", "t1", "ran", "2.32.3", "2 ranks, one GPU each"),
        // Started, then found it could not go on: skipped, once.
        ("gpu_b", "t2", "ran", "2.32.3", "2 ranks, one GPU each"),
        ("gpu_b", "t2", "skipped", "2.32.3", "NCCL\ttoo old"),
        ("gpu_b", "t2", "skipped", "2.32.3", "NCCL too old"),
        ("gpu_a", "t3", "skipped", "2.28.3", "1 GPU,\nneeds 2"),
        // A rank that got further than the one that skipped: still skipped.
        ("gpu_a", "t3", "ran", "2.28.3", "shared"),
        ("gpu_a", "t4", "ran", "2.32.3", "shared"),
    ];
    let mut ledger: Vec<String> = records
        .iter()
        .map(|&(binary, test, outcome, version, detail)| {
            ledger_line(binary, test, outcome, version, detail)
        })
        .collect();
    ledger.insert(3, "not a record\n".to_owned());
    let ledger = ledger.concat();
    assert_eq!(
        summary("GPU suite summary", &ledger),
        "\n=== GPU suite summary (multi-rank GPU tests, per binary)\n\
         gpu_a: 1 ran, 1 skipped (NCCL 2.28.3, 2.32.3)\n\
         \x20   skipped t3: 1 GPU, needs 2\n\
         gpu_b: 1 ran, 1 skipped (NCCL 2.32.3)\n\
         \x20   skipped t2: NCCL too old\n\
         total: 2 ran, 2 skipped\n"
    );
}

#[test]
fn an_empty_ledger_says_nothing_was_recorded() {
    assert_eq!(
        summary("GPU suite summary", "\n"),
        "\n=== GPU suite summary (multi-rank GPU tests, per binary)\n\
         no GPU test recorded anything in this run\n"
    );
}
