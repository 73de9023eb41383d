//! NCCL's functions, one row each: the facts every call site needs about the function it
//! calls, kept in one table instead of beside each site.
//!
//! A row is a constant named exactly after the C function (`calls::ncclCommSplit`), so a
//! misspelt name does not compile and the name a call reports cannot drift from the
//! function it calls. Adding an NCCL function is one row here plus its method.
//!
//! How a call's result completes follows from where it is made, which the types enforce:
//! a call on a communicator goes through `Comm::with_raw` and `Comm::complete` (NCCL's
//! `ncclInProgress` is waited out; for operations, success means enqueued on the stream),
//! a call without one through `Library::check`.

// The rows are named after the C functions on purpose (see above).
#![allow(non_upper_case_globals)]

use crate::release::Version;

/// One NCCL function's facts.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Call {
    /// The C name, e.g. `"ncclCommSplit"`: what errors report.
    pub(crate) name: &'static str,
    /// The first NCCL release that has it.
    pub(crate) since: Version,
    /// Whether it may be called on a communicator that failed but was not released:
    /// queries, tear-down, and the calls that build a replacement from it.
    pub(crate) after_failure: bool,
    /// Whether it may be called on a suspended communicator (`ncclCommSuspend`): queries,
    /// resume and tear-down. NCCL allows no other use until `ncclCommResume`.
    pub(crate) while_suspended: bool,
}

/// Writes one `Call` constant per row, its name taken from the row's identifier, and the
/// list of them all (for the table's own tests). A row's markers (`after_failure`,
/// `while_suspended`) follow its version.
macro_rules! calls {
    ($($name:ident: ($major:literal, $minor:literal, $patch:literal) $(, $marker:ident)*;)*) => {
        $(
            pub(crate) const $name: Call = Call {
                name: stringify!($name),
                since: Version::new($major, $minor, $patch),
                after_failure: calls!(@after_failure $($marker)*),
                while_suspended: calls!(@while_suspended $($marker)*),
            };
        )*
        /// Every row, in the table's order.
        #[cfg(test)]
        pub(crate) const ALL: &[&Call] = &[$(&$name),*];
    };
    // Whether a row's markers include `after_failure` / `while_suspended`; an unknown
    // marker is a compile error.
    (@after_failure) => { false };
    (@after_failure after_failure $($rest:ident)*) => { true };
    (@after_failure while_suspended $($rest:ident)*) => { calls!(@after_failure $($rest)*) };
    (@while_suspended) => { false };
    (@while_suspended while_suspended $($rest:ident)*) => { true };
    (@while_suspended after_failure $($rest:ident)*) => { calls!(@while_suspended $($rest)*) };
}

calls! {
    // Calls on no communicator: ids, groups, creation.
    ncclGetUniqueId: (2, 0, 0);
    ncclGroupStart: (2, 0, 0);
    ncclGroupEnd: (2, 0, 0);
    ncclGroupSimulateEnd: (2, 22, 0);
    ncclCommInitAll: (2, 0, 0);
    ncclCommInitRank: (2, 0, 0);
    ncclCommInitRankConfig: (2, 14, 0);
    ncclCommInitRankScalable: (2, 23, 0);
    ncclSetEncryption: (2, 32, 0);

    // Operations: collectives and point-to-point.
    ncclAllReduce: (2, 0, 0);
    ncclBroadcast: (2, 2, 0);
    ncclReduce: (2, 0, 0);
    ncclAllGather: (2, 0, 0);
    ncclReduceScatter: (2, 0, 0);
    ncclAlltoAll: (2, 28, 0);
    ncclGather: (2, 28, 0);
    ncclScatter: (2, 28, 0);
    ncclSend: (2, 7, 0);
    ncclRecv: (2, 7, 0);
    // Their `*Config` variants, which take an `ncclCollConfig_t`.
    ncclAllReduceConfig: (2, 31, 0);
    ncclBroadcastConfig: (2, 31, 0);
    ncclReduceConfig: (2, 31, 0);
    ncclAllGatherConfig: (2, 31, 0);
    ncclReduceScatterConfig: (2, 31, 0);
    ncclAlltoAllConfig: (2, 31, 0);
    ncclGatherConfig: (2, 31, 0);
    ncclScatterConfig: (2, 31, 0);

    // Queries.
    ncclCommGetAsyncError: (2, 4, 0), after_failure, while_suspended;
    ncclCommCount: (2, 0, 0), after_failure, while_suspended;
    ncclCommUserRank: (2, 0, 0), after_failure, while_suspended;
    ncclCommCuDevice: (2, 0, 0), after_failure, while_suspended;
    ncclCommQueryProperties: (2, 29, 0), while_suspended;
    ncclCommMemStats: (2, 29, 7), after_failure, while_suspended;

    // Creating, tearing down and rebuilding communicators.
    ncclCommSplit: (2, 18, 0), after_failure;
    ncclCommShrink: (2, 27, 0), after_failure;
    ncclCommRevoke: (2, 28, 7), after_failure;
    ncclCommGrow: (2, 29, 0);
    ncclCommGetUniqueId: (2, 29, 0);
    ncclCommFinalize: (2, 14, 0);
    ncclCommAbort: (2, 4, 0), after_failure, while_suspended;
    ncclCommDestroy: (2, 0, 0), after_failure, while_suspended;

    // Releasing and restoring a communicator's dynamic GPU memory.
    ncclCommSuspend: (2, 29, 7);
    ncclCommResume: (2, 29, 7), while_suspended;

    // Reduction operators.
    ncclRedOpCreatePreMulSum: (2, 11, 0);
    ncclRedOpDestroy: (2, 11, 0), after_failure, while_suspended;

    // Memory, registration, windows and one-sided RMA.
    ncclMemAlloc: (2, 19, 0);
    ncclCommRegister: (2, 19, 0);
    ncclCommDeregister: (2, 19, 0), after_failure;
    ncclCommWindowRegister: (2, 27, 0);
    ncclCommWindowDeregister: (2, 27, 0), after_failure;
    ncclWinGetUserPtr: (2, 29, 0);
    ncclPutSignal: (2, 29, 0);
    ncclSignal: (2, 29, 0);
    ncclWaitSignal: (2, 29, 0);

    // NCCL's effective parameters (exported from 2.30.3, declared in nccl.h from 2.30.4).
    ncclParamGetAllParameterKeys: (2, 30, 3);
    ncclParamGetParameter: (2, 30, 3);
    ncclParamBind: (2, 30, 3);
    ncclParamGet: (2, 30, 3);
    ncclParamGetI8: (2, 30, 3);
    ncclParamGetI16: (2, 30, 3);
    ncclParamGetI32: (2, 30, 3);
    ncclParamGetI64: (2, 30, 3);
    ncclParamGetU8: (2, 30, 3);
    ncclParamGetU16: (2, 30, 3);
    ncclParamGetU32: (2, 30, 3);
    ncclParamGetU64: (2, 30, 3);

    // The device API (nccl_device/host.h): device communicators, teams, window pointers.
    ncclDevCommCreate: (2, 28, 0);
    // Not while suspended: it deregisters the barriers' resource window through
    // ncclCommWindowDeregister (`ncclDevCommDestroy`, src/dev_runtime.cc, 2.30.7), which is
    // refused then, and nccl.h: "The communicator cannot be used while suspended".
    ncclDevCommDestroy: (2, 28, 0), after_failure;
    ncclTeamWorld: (2, 28, 0), after_failure, while_suspended;
    ncclTeamLsa: (2, 28, 0), after_failure, while_suspended;
    ncclTeamRail: (2, 28, 0), after_failure, while_suspended;
    ncclTeamRankToWorld: (2, 28, 0), after_failure, while_suspended;
    ncclTeamRankToLsa: (2, 28, 0), after_failure, while_suspended;
    ncclGetLsaDevicePointer: (2, 29, 2), after_failure;
    ncclGetPeerDevicePointer: (2, 29, 2), after_failure;
    ncclGetLsaMultimemDevicePointer: (2, 29, 2), after_failure;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_is_an_nccl_function_listed_once() {
        for (i, call) in ALL.iter().enumerate() {
            assert!(call.name.starts_with("nccl"), "{}", call.name);
            assert!(call.since >= Version::new(2, 0, 0), "{}", call.name);
            assert!(
                ALL[..i].iter().all(|earlier| earlier.name != call.name),
                "{} twice",
                call.name
            );
        }
    }

    #[test]
    fn only_queries_tear_down_and_rebuilding_are_allowed_after_a_failure() {
        let allowed: Vec<&str> = ALL
            .iter()
            .filter(|call| call.after_failure)
            .map(|call| call.name)
            .collect();
        assert_eq!(
            allowed,
            [
                "ncclCommGetAsyncError",
                "ncclCommCount",
                "ncclCommUserRank",
                "ncclCommCuDevice",
                "ncclCommMemStats",
                "ncclCommSplit",
                "ncclCommShrink",
                "ncclCommRevoke",
                "ncclCommAbort",
                "ncclCommDestroy",
                "ncclRedOpDestroy",
                "ncclCommDeregister",
                "ncclCommWindowDeregister",
                "ncclDevCommDestroy",
                "ncclTeamWorld",
                "ncclTeamLsa",
                "ncclTeamRail",
                "ncclTeamRankToWorld",
                "ncclTeamRankToLsa",
                "ncclGetLsaDevicePointer",
                "ncclGetPeerDevicePointer",
                "ncclGetLsaMultimemDevicePointer",
            ]
        );
    }

    #[test]
    fn only_queries_resume_and_tear_down_are_allowed_while_suspended() {
        let allowed: Vec<&str> = ALL
            .iter()
            .filter(|call| call.while_suspended)
            .map(|call| call.name)
            .collect();
        assert_eq!(
            allowed,
            [
                "ncclCommGetAsyncError",
                "ncclCommCount",
                "ncclCommUserRank",
                "ncclCommCuDevice",
                "ncclCommQueryProperties",
                "ncclCommMemStats",
                "ncclCommAbort",
                "ncclCommDestroy",
                "ncclCommResume",
                "ncclRedOpDestroy",
                "ncclTeamWorld",
                "ncclTeamLsa",
                "ncclTeamRail",
                "ncclTeamRankToWorld",
                "ncclTeamRankToLsa",
            ]
        );
    }
}
