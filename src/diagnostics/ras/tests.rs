//! The RAS client against fake servers on local ports, each a thread speaking (or
//! mis-speaking) NCCL's protocol as its source has it.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::parse::{repair_json, text_report};
use super::*;

/// How a fake server answers.
#[derive(Clone)]
struct Script {
    /// The greeting line.
    greeting: &'static str,
    /// Whether it knows `SET FORMAT json`.
    json: bool,
    /// The JSON report.
    json_report: String,
    /// The text report.
    text_report: String,
}

impl Script {
    fn new(json_report: &str, text_report: &str) -> Self {
        Script {
            greeting: "SERVER PROTOCOL 2\n",
            json: true,
            json_report: json_report.to_owned(),
            text_report: text_report.to_owned(),
        }
    }
}

/// Serves `connections` clients by `script`, one at a time; returns the address.
fn serve(script: Script, connections: usize) -> (String, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let thread = std::thread::spawn(move || {
        for _ in 0..connections {
            let Ok((stream, _)) = listener.accept() else {
                return;
            };
            let _ = converse(stream, &script);
        }
    });
    (addr, thread)
}

fn converse(stream: TcpStream, script: &Script) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut out = stream;
    let mut json = false;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let cmd = line.trim().to_ascii_lowercase();
        if cmd.starts_with("client protocol ") {
            out.write_all(script.greeting.as_bytes())?;
        } else if cmd.starts_with("timeout ") {
            out.write_all(b"OK\n")?;
        } else if cmd == "set format json" && script.json {
            json = true;
            out.write_all(b"OK\n")?;
        } else if cmd == "status" || cmd == "verbose status" {
            let report = if json {
                &script.json_report
            } else {
                &script.text_report
            };
            out.write_all(report.as_bytes())?;
            return Ok(()); // closes
        } else {
            out.write_all(format!("ERROR: Unknown command {}\n", line.trim()).as_bytes())?;
        }
    }
}

/// A JSON report as NCCL 2.30 writes it: a 4-rank communicator whose rank 2 launched one
/// all-reduce fewer, and a healthy 2-rank one.
const JSON_MISMATCH: &str = r#"{
  "nccl_version": "2.30.7",
  "cuda_runtime_version": 13000,
  "cuda_driver_version": 13000,
  "timestamp": "2026-01-01 00:00:00",
  "communicators_count": 2,
  "communicators": [
    {
      "hash": "0xabc123",
      "secondary_hash": "0x1:0x2",
      "size": 4,
      "ranks_count": 4,
      "missing_ranks_count": 0,
      "ranks": [
RANKS
      ],
      "missing_ranks": [
      ]
    },
    {
      "hash": "0xfeed",
      "secondary_hash": "0x1:0x3",
      "size": 2,
      "ranks_count": 2,
      "missing_ranks_count": 0,
      "ranks": [
RANKS2
      ],
      "missing_ranks": [
      ]
    }
  ],
  "ras": {
    "collection_time_sec": 0.012,
    "timeouts_count": 0
  }
}
"#;

fn rank_json(rank: usize, all_reduces: u64) -> String {
    format!(
        r#"        {{
          "rank": {rank},
          "host": "10.0.0.1",
          "pid": {pid},
          "cuda_dev": {rank},
          "nvml_dev": {rank},
          "status": {{
            "init_state": 0,
            "async_error": 0,
            "finalize_called": false,
            "destroy_flag": false,
            "abort_flag": false
          }},
          "collective_counts": {{
            "Broadcast": 1,
            "AllReduce": {all_reduces}
          }}
        }}"#,
        pid = 100 + rank
    )
}

fn json_mismatch() -> String {
    let ranks: Vec<String> = (0..4)
        .map(|r| rank_json(r, if r == 2 { 4 } else { 5 }))
        .collect();
    let ranks2: Vec<String> = (0..2).map(|r| rank_json(r, 9)).collect();
    JSON_MISMATCH
        .replace("RANKS2", &ranks2.join(",\n"))
        .replace("RANKS", &ranks.join(",\n"))
}

/// NCCL 2.28.9's JSON with a missing rank: no comma after `nvml_dev`.
fn json_missing_2_28_9() -> String {
    let ranks: Vec<String> = (0..3).map(|r| rank_json(r, 5)).collect();
    format!(
        r#"{{
  "nccl_version": "2.28.9",
  "communicators_count": 1,
  "communicators": [
    {{
      "hash": "0x77",
      "secondary_hash": "0x1:0x2",
      "size": 4,
      "ranks_count": 3,
      "missing_ranks_count": 1,
      "ranks": [
{}
      ],
      "missing_ranks": [
        {{
          "rank": 3,
          "host": "10.0.0.2",
          "pid": 4242,
          "cuda_dev": 3,
          "nvml_dev": 3
          "status": {{
            "unresponsive": true,
            "considered_dead": true
          }}
        }}
      ]
    }}
  ],
  "ras": {{
    "collection_time_sec": 5.001,
    "timeouts_count": 1
  }}
}}
"#,
        ranks.join(",\n")
    )
}

/// A text report as NCCL writes it (2.24 to 2.30): a mismatch and an incomplete
/// communicator.
const TEXT_REPORT: &str = "NCCL version 2.24.3 compiled with CUDA 12.8
CUDA runtime version 12080, driver version 12080

Job summary
===========

  Nodes  Processes         GPUs  Processes     GPUs
(total)   per node  per process    (total)  (total)
      1          4            1          4        4

Communicators... (0.010s)
=============

Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors
    #  in group  per comm  per node  per comm  in group
    0         1         1         4         4         4   RUNNING  MISMATCH
    1         1         1         2         2         2   RUNNING  INCOMPLETE

Errors
======

INCOMPLETE
  Missing communicator data from 1 job process
  Process 4243 on node 10.0.0.1 managing GPU 3

#1-0 (0000000000000077) INCOMPLETE
  Missing communicator data from 1 rank
  Rank 1 -- GPU 3 managed by process 4243 on node 10.0.0.1

Warnings
========

#0-0 (0000000000abc123) MISMATCH
  Communicator ranks have different AllReduce operation counts
  3 ranks have launched up to operation 5
  Rank 2 has launched up to operation 4 -- GPU 2 managed by process 102 on node 10.0.0.1

";

#[test]
fn a_json_server_gives_typed_verdicts_per_communicator() {
    let (addr, server) = serve(Script::new(&json_mismatch(), TEXT_REPORT), 1);
    let status = RasQuery::new().addr(&addr).run().unwrap();
    server.join().unwrap();
    assert_eq!(status.format, RasFormat::Json);
    assert_eq!(status.nccl_version.as_deref(), Some("2.30.7"));
    assert_eq!(status.communicators.len(), 2);
    let bad = &status.communicators[0];
    assert_eq!((bad.hash, bad.size), (0xabc123, Some(4)));
    assert_eq!(bad.issues, vec![RasIssue::Mismatch]);
    assert_eq!(bad.behind(), vec![2]);
    assert_eq!(bad.ranks[2].pid, 102);
    assert!(status.communicators[1].is_ok());
    assert!(!status.is_ok());
    let text = status.to_string();
    assert!(text.contains("0000000000abc123 (4 ranks): MISMATCH; behind or missing: ranks [2]"));
}

#[test]
fn nccl_2_28_9s_malformed_json_is_repaired() {
    let broken = json_missing_2_28_9();
    assert!(serde_json::from_str::<serde_json::Value>(&broken).is_err());
    assert!(serde_json::from_str::<serde_json::Value>(&repair_json(&broken)).is_ok());
    let (addr, server) = serve(Script::new(&broken, TEXT_REPORT), 1);
    let status = RasQuery::new().addr(&addr).run().unwrap();
    server.join().unwrap();
    assert_eq!(status.format, RasFormat::Json);
    let comm = &status.communicators[0];
    assert_eq!(
        comm.issues,
        vec![RasIssue::Incomplete, RasIssue::Dead],
        "{status}"
    );
    assert_eq!(comm.behind(), vec![3]);
    assert!(comm.missing_ranks[0].considered_dead && comm.missing_ranks[0].unresponsive);
    assert!(status.dead_processes);
    // Repairing leaves valid JSON (and strings) as they were.
    let valid = r#"{"a": [1, 2, {"b": "x\" y"}], "c": true}"#;
    assert_eq!(repair_json(valid), valid);
    assert_eq!(repair_json("[1, 2,]"), "[1, 2]");
}

#[test]
fn a_text_only_server_is_read_from_its_text_report() {
    let mut script = Script::new("", TEXT_REPORT);
    script.json = false;
    let (addr, server) = serve(script, 1);
    let status = RasQuery::new().addr(&addr).verbose(true).run().unwrap();
    server.join().unwrap();
    assert_eq!(status.format, RasFormat::Text);
    assert_eq!(status.nccl_version.as_deref(), Some("2.24.3"));
    let by_hash = |hash| {
        status
            .communicators
            .iter()
            .find(|c| c.hash == hash)
            .unwrap()
    };
    let mismatch = by_hash(0xabc123);
    assert_eq!(mismatch.issues, vec![RasIssue::Mismatch]);
    assert_eq!(mismatch.operation_counts, vec![(2, 4)]);
    let incomplete = by_hash(0x77);
    assert_eq!(incomplete.issues, vec![RasIssue::Incomplete]);
    assert_eq!(incomplete.behind(), vec![1]);
}

#[test]
fn json_that_cannot_be_repaired_falls_back_to_the_text_report() {
    let (addr, server) = serve(Script::new("{ \"communicators\": [ {{{ ", TEXT_REPORT), 2);
    let status = RasQuery::new().addr(&addr).run().unwrap();
    server.join().unwrap();
    assert_eq!(status.format, RasFormat::Text);
    assert_eq!(status.communicators.len(), 2);
}

#[test]
fn text_reports_name_the_ranks_of_a_mismatch_listed_by_count() {
    let report = "#0-0 (00000000000000aa) MISMATCH
  Communicator ranks have different AllReduce operation counts
  2 ranks have launched up to operation 7
  Rank 0 -- GPU 0 managed by process 1 on node h
  Rank 3 -- GPU 3 managed by process 4 on node h
  2 ranks have launched up to operation 6
  Rank 1 -- GPU 1 managed by process 2 on node h
  Rank 2 -- GPU 2 managed by process 3 on node h

DEAD
  1 job process is considered dead
";
    let parsed = text_report(report);
    assert!(parsed.dead_processes);
    let comm = &parsed.communicators[0];
    assert_eq!(comm.operation_counts, vec![(0, 7), (1, 6), (2, 6), (3, 7)]);
    assert_eq!(comm.behind(), vec![1, 2]);
    // Garbage is skipped, never a panic.
    for junk in [
        "#",
        "#(",
        "#0-0 (zz) MISMATCH",
        "  Rank x -- y",
        "\u{0}\u{ffff}",
    ] {
        let _ = text_report(junk);
        let _ = parse::json_report(junk);
    }
}

#[test]
fn nothing_listening_is_ras_unavailable() {
    let addr = {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    match RasQuery::new().addr(&addr).run() {
        Err(Error::RasUnavailable { addr: a, .. }) => assert_eq!(a, addr),
        other => panic!("{other:?}"),
    }
    // A name goes through the resolver's thread, then the same refusal.
    let named = addr.replace("127.0.0.1", "localhost");
    match RasQuery::new().addr(&named).run() {
        Err(Error::RasUnavailable { addr: a, reason }) => {
            assert_eq!(a, named);
            assert!(!reason.contains("resolve"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // A name that does not resolve: refused, or (a resolver slower than the bound) timed out.
    let started = std::time::Instant::now();
    match RasQuery::new().addr("no-such-host.invalid:28028").run() {
        Err(Error::RasUnavailable { reason, .. }) => {
            assert!(reason.contains("resolve"), "{reason}")
        }
        Err(Error::RasTimeout { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
}

#[test]
fn a_silent_or_trickling_server_times_out_within_the_bound() {
    // Accepts, then says nothing.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let silent = std::thread::spawn(move || {
        let conn = listener.accept();
        std::thread::sleep(Duration::from_millis(800));
        drop(conn);
    });
    let start = Instant::now();
    let err = RasQuery::new()
        .addr(&addr)
        .timeout(Duration::from_millis(300))
        .run()
        .unwrap_err();
    assert!(matches!(err, Error::RasTimeout { .. }), "{err}");
    assert!(
        start.elapsed() < Duration::from_millis(700),
        "{:?}",
        start.elapsed()
    );
    silent.join().unwrap();

    // Answers the handshake, then sends its report a byte every 50 ms, forever.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let trickle = std::thread::spawn(move || {
        let Ok((stream, _)) = listener.accept() else {
            return;
        };
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut out = stream;
        let mut line = String::new();
        for answer in ["SERVER PROTOCOL 2\n", "OK\n", "OK\n"] {
            line.clear();
            let _ = reader.read_line(&mut line);
            let _ = out.write_all(answer.as_bytes());
        }
        let _ = reader.read_line(&mut line);
        for _ in 0..40 {
            if out.write_all(b"x").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let start = Instant::now();
    let err = RasQuery::new()
        .addr(&addr)
        .timeout(Duration::from_millis(400))
        .run()
        .unwrap_err();
    assert!(matches!(err, Error::RasTimeout { .. }), "{err}");
    assert!(
        start.elapsed() < Duration::from_millis(900),
        "{:?}",
        start.elapsed()
    );
    trickle.join().unwrap();
}

#[test]
fn a_server_not_speaking_the_protocol_is_a_protocol_error() {
    for greeting in [
        "HTTP/1.1 400 Bad Request\n",
        "SERVER PROTOCOL 1\n",
        "SERVER PROTOCOL\n",
    ] {
        let mut script = Script::new("", "");
        script.greeting = greeting;
        let (addr, server) = serve(script, 1);
        let err = RasQuery::new().addr(&addr).run().unwrap_err();
        assert!(
            matches!(err, Error::RasProtocol { .. }),
            "{greeting}: {err}"
        );
        drop(server);
    }
    // A server that answers STATUS with nothing.
    let (addr, server) = serve(Script::new("", ""), 1);
    let err = RasQuery::new().addr(&addr).run().unwrap_err();
    assert!(err.to_string().contains("without a report"), "{err}");
    server.join().unwrap();
}
