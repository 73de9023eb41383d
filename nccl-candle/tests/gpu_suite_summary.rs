//! The summary of nccl-candle's GPU tests: which multi-rank GPU tests ran (in which shape)
//! and which were skipped (and why), per test binary; nccl-rs's own
//! `../tests/gpu_suite_summary.rs`, over the same kind of ledger, with the same code
//! (`common::shape`, reused from nccl-rs's harness, where its tests are).
//!
//! A skipped GPU test returns early and the test harness counts it as passed, with its reason
//! swallowed by output capture. So every GPU test records what it did in the ledger of the run
//! it is part of, a file that whoever starts the run makes and names (`NCCL_RS_SUITE_LEDGER`:
//! `../tests/gpu/candle.sh`). After its last test binary, the runner runs this one in its
//! explicit mode, `NCCL_RS_SUITE_SUMMARY` naming that ledger: it prints the summary, leaves the
//! ledger to the runner (which removes it), and is run by name, so it depends on no order of
//! the binaries. Without that variable (`cargo test`) it prints nothing.

mod common;

#[test]
#[ignore = "prints the summary of the run NCCL_RS_SUITE_SUMMARY names: `../tests/gpu/candle.sh` \
            runs it after every GPU test binary"]
fn summary_of_the_gpu_tests_that_ran_and_were_skipped() {
    common::shape::print_summary("nccl-candle GPU suite summary");
}
