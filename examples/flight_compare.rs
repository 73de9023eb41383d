//! Compares the flight records of the ranks of one communicator and says where they diverge
//! (see `nccl::diagnostics::flight`): which collective, and which rank skipped it, stalled
//! before it, or issued something else.
//!
//! ```text
//! NCCL_RS_FLIGHT_RECORDER_DIR=/tmp/fr ./my_job        # watchdog trips write the records
//! cargo run --example flight_compare -- /tmp/fr/flight-rank*-of4-*.json
//! cargo run --example flight_compare -- --print /tmp/fr/flight-rank1-of4-*.json
//! ```
//!
//! `--print` also prints every record. Needs no GPU and no NCCL.

use nccl::diagnostics::flight::{compare, read_flight_records};

fn main() {
    let mut print = false;
    let mut paths = Vec::new();
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--print" => print = true,
            "-h" | "--help" => {
                println!("usage: flight_compare [--print] RECORD.json...");
                return;
            }
            _ => paths.push(arg),
        }
    }
    if paths.is_empty() {
        eprintln!("usage: flight_compare [--print] RECORD.json...");
        std::process::exit(2);
    }
    let records = match read_flight_records(&paths) {
        Ok(records) => records,
        Err(err) => {
            eprintln!("flight_compare: {err}");
            std::process::exit(1);
        }
    };
    if print {
        for record in &records {
            println!("{record}");
        }
    }
    match compare(&records) {
        Ok(comparison) => {
            print!("{comparison}");
            if !comparison.is_consistent() {
                std::process::exit(3);
            }
        }
        Err(err) => {
            eprintln!("flight_compare: {err}");
            std::process::exit(1);
        }
    }
}
