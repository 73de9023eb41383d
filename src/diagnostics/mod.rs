//! Finding the rank that hangs a job: a flight recorder per communicator ([`flight`]),
//! NCCL's RAS queried from Rust ([`ras`]), and NCCL's preflight diagnostics (below).
//!
//! A hang in a collective job is rarely a crash: one rank skipped or reordered a collective,
//! or stalled, and every other rank waits for it. A [`Watchdog`](crate::Watchdog) notices
//! that the communicator stopped making progress; these tools say where the ranks diverged
//! and which rank is behind:
//!
//! * every communicator records its last operations
//!   ([`Comm::flight_record`](crate::Comm::flight_record)); the records
//!   of all ranks, compared ([`flight::compare`]), name the first collective where they
//!   differ and the rank that skipped it, stalled before it, or issued something else;
//! * NCCL's RAS (2.24+) keeps a mesh of all the job's processes and answers status queries
//!   on a local TCP port ([`ras::query`]): its verdict per communicator (`MISMATCH` of
//!   operation counts, `INCOMPLETE` data, `ERROR`, dead processes) comes from NCCL itself;
//! * a watchdog that trips puts both in its report ([`WatchdogTrip`](crate::WatchdogTrip)):
//!   the flight record, and RAS's verdict or why RAS did not answer.
//!
//! # NCCL's preflight diagnostics (NCCL 2.31+)
//!
//! Two switches of NCCL itself, read from the environment when a communicator is created
//! (this crate passes them through untouched; set them for every process of the job):
//!
//! * `NCCL_RUN_DIAGNOSTICS=1`: **active** checks at every communicator creation (init,
//!   init-all, split): NCCL exchanges data over the peer-to-peer paths it means to use
//!   between the GPUs of a node, reads it back and prints a report (`NCCL DIAG` lines on
//!   standard output), and on communicators that span nodes runs a network bandwidth check
//!   too. Failures are reported, not fatal: creation goes on. The cost is paid at every
//!   creation, in data actually moved over every checked path, so it belongs in a job's
//!   first run on new machines, not in every start.
//! * `NCCL_RUN_RAS_DIAGNOSTICS=1`: **passive** checks through RAS: the ranks' GPU, CUDA
//!   driver and NCCL configuration are gathered and compared across the job without
//!   touching NCCL's data paths, so a rank configured unlike the others is named before
//!   its collectives would hang. Needs RAS (on by default).
//!
//! Neither changes the crate's behaviour; `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=DIAG` shows
//! their details.

pub mod flight;
pub mod ras;
