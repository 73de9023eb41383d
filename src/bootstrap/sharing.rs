//! Several ranks on one GPU: how a job with more ranks on a node than GPUs can still run, for
//! developing and testing a multi-GPU program on a workstation or a one-GPU CI host. The
//! shapes and what each exercises are on [`GpuSharing`].

use super::env::{lookup, vars, Vars};
use super::{BootstrapError, Result};
use crate::comm::{
    MULTI_RANK_GPU_MAX as SHARED_GPU_MAX_RANKS, MULTI_RANK_GPU_SINCE as SHARED_GPU_SINCE,
    MULTI_RANK_GPU_VAR,
};

/// The variable that makes NCCL see a process as a host of its own.
pub(crate) const HOST_ID_VAR: &str = "NCCL_HOSTID";
/// NCCL's network interface selection; the simulated hosts talk over loopback.
const SOCKET_IFNAME_VAR: &str = "NCCL_SOCKET_IFNAME";

/// How the ranks of one node share its GPUs when there are more ranks than GPUs
/// (`NCCL_RS_GPU_SHARING`).
///
/// NCCL refuses two ranks of one host on one GPU ("duplicate GPU"). Two shapes get past that,
/// and each exercises a different part of NCCL:
///
/// | shape | how | NCCL | ranks | what it exercises | what it does not |
/// |---|---|---|---|---|---|
/// | [`GpuSharing::SimulatedHosts`] | each rank its own `NCCL_HOSTID`, so NCCL treats it as a machine of its own and connects the ranks over its network transport (sockets on loopback) | any 2.x | any | the multi-node path: NET/Socket, proxies, remote errors, what a rank's death does to its peers | windows are NULL (no peer shares memory), no P2P/NVLink, no device API |
/// | [`GpuSharing::SharedGpu`] | `NCCL_MULTI_RANK_GPU_ENABLE=1` (experimental in NCCL) | 2.30+ | up to 2 per GPU | one host, one LSA team over P2P: symmetric windows, RMA, copy-engine collectives, the device API | the network path; NVLink multicast (NCCL turns it off) |
///
/// Either way the ranks time-slice the GPU: results are real, speed is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GpuSharing {
    /// Refuse: every rank needs a GPU of its own ([`BootstrapError::NoDevice`]).
    Off,
    /// Every rank looks like a machine of its own to NCCL (its own `NCCL_HOSTID`), and the
    /// ranks talk over NCCL's socket transport on loopback. Any NCCL version, any rank count.
    SimulatedHosts,
    /// Up to two ranks per GPU in one LSA team (`NCCL_MULTI_RANK_GPU_ENABLE=1`, NCCL 2.30+,
    /// experimental in NCCL). The variable must be set for the whole job, rank 0 included,
    /// before the program starts. Where one process drives both ranks
    /// ([`Comm::init_all`](crate::Comm::init_all) with one GPU twice, or a thread per rank),
    /// set `NCCL_RUNTIME_CONNECT=0` too: connections NCCL makes lazily, from the thread that
    /// enqueues, can wait for the other rank's kernel, which waits for this rank (seen hanging
    /// on NCCL 2.32.3 when a collective's configuration asked for more CTAs than connected).
    /// For the same reason, allocate a rank's buffers (and make its events and streams)
    /// before the collectives that use them: an allocation can wait for the GPU while the
    /// other rank's kernel spins there waiting for this rank (seen on NCCL 2.32.3 with two
    /// threads, one allocating after the other had launched a grouped all-reduce).
    SharedGpu,
}

impl GpuSharing {
    /// The value of `NCCL_RS_GPU_SHARING` that selects this shape.
    pub fn setting(self) -> &'static str {
        match self {
            GpuSharing::Off => "off",
            GpuSharing::SimulatedHosts => "hosts",
            GpuSharing::SharedGpu => "shared",
        }
    }

    /// What the shape is, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            GpuSharing::Off => "one GPU per rank",
            GpuSharing::SimulatedHosts => {
                "simulated hosts (each rank its own NCCL_HOSTID, NCCL's socket transport on \
                 loopback)"
            }
            GpuSharing::SharedGpu => {
                "a shared GPU (NCCL_MULTI_RANK_GPU_ENABLE=1, one LSA team, NCCL 2.30+)"
            }
        }
    }

    /// `NCCL_RS_GPU_SHARING` as set (`off`, `hosts` or `shared`), or `None` when unset.
    pub fn from_vars(vars: Vars<'_>) -> Result<Option<GpuSharing>> {
        let Some(text) = lookup(vars, vars::GPU_SHARING) else {
            return Ok(None);
        };
        match text.trim().to_ascii_lowercase().as_str() {
            "off" | "0" | "none" => Ok(Some(GpuSharing::Off)),
            "hosts" | "simulated-hosts" => Ok(Some(GpuSharing::SimulatedHosts)),
            "shared" | "shared-gpu" => Ok(Some(GpuSharing::SharedGpu)),
            _ => Err(BootstrapError::Env {
                var: vars::GPU_SHARING.to_owned(),
                value: text,
                reason: "expected off, hosts or shared".to_owned(),
            }),
        }
    }

    /// The shape a job started by [`spawn_local`](super::spawn_local) takes when it has more
    /// ranks than GPUs: `NCCL_RS_GPU_SHARING` when set; else [`GpuSharing::SharedGpu`] when
    /// `NCCL_MULTI_RANK_GPU_ENABLE=1` is set (the user asked NCCL for it); else
    /// [`GpuSharing::SimulatedHosts`], which works with every NCCL.
    pub(crate) fn for_spawn(vars: Vars<'_>) -> Result<GpuSharing> {
        if let Some(sharing) = GpuSharing::from_vars(vars)? {
            return Ok(sharing);
        }
        Ok(if multi_rank_gpu_enabled(vars) {
            GpuSharing::SharedGpu
        } else {
            GpuSharing::SimulatedHosts
        })
    }

    /// Checks that `ranks` ranks on `visible` GPUs can run in this shape, with the NCCL
    /// `version` when it is known; the error says what to change.
    pub(crate) fn check(
        self,
        ranks: usize,
        visible: usize,
        version: Option<crate::Version>,
        vars: Vars<'_>,
    ) -> Result<()> {
        let config = |text: String| Err(BootstrapError::Config(text));
        match self {
            GpuSharing::Off => config(format!(
                "{ranks} ranks but {visible} GPU(s) visible, and {}=off: give each rank a GPU, or \
                 set {}=hosts (any NCCL) or =shared (NCCL 2.30+, up to 2 ranks per GPU)",
                vars::GPU_SHARING,
                vars::GPU_SHARING
            )),
            GpuSharing::SimulatedHosts => Ok(()),
            GpuSharing::SharedGpu => {
                let per_gpu = ranks.div_ceil(visible.max(1));
                if per_gpu > SHARED_GPU_MAX_RANKS {
                    return config(format!(
                        "{ranks} ranks on {visible} GPU(s) is {per_gpu} per GPU, but NCCL shares a \
                         GPU among at most {SHARED_GPU_MAX_RANKS} ranks; use {}=hosts for more",
                        vars::GPU_SHARING
                    ));
                }
                if let Some(found) = version.filter(|&v| v < SHARED_GPU_SINCE) {
                    return config(format!(
                        "ranks sharing a GPU need NCCL {SHARED_GPU_SINCE} or newer \
                         ({MULTI_RANK_GPU_VAR}); the loaded NCCL is {found}: use {}=hosts",
                        vars::GPU_SHARING
                    ));
                }
                if !multi_rank_gpu_enabled(vars) {
                    return config(format!(
                        "ranks sharing a GPU need {MULTI_RANK_GPU_VAR}=1 in the environment of \
                         every rank before it starts (rank 0 included), e.g. \
                         `{MULTI_RANK_GPU_VAR}=1 {}=2 cargo run ...`",
                        vars::LOCAL_RANKS
                    ));
                }
                Ok(())
            }
        }
    }

    /// The variables a rank started by [`spawn_local`](super::spawn_local) gets for this
    /// shape, besides the launch variables. Rank 0 is the spawning process itself and is left
    /// as it is: under simulated hosts it keeps NCCL's own host id (hostname and boot id),
    /// which no spawned rank has.
    pub(crate) fn child_vars(
        self,
        rank: usize,
        job_key: &str,
        vars: Vars<'_>,
    ) -> Vec<(&'static str, String)> {
        let mut out = vec![(super::env::vars::GPU_SHARING, self.setting().to_owned())];
        if self == GpuSharing::SimulatedHosts {
            out.push((HOST_ID_VAR, format!("{job_key}-rank{rank}")));
            if lookup(vars, SOCKET_IFNAME_VAR).is_none() {
                out.push((SOCKET_IFNAME_VAR, "lo".to_owned()));
            }
        }
        out
    }
}

/// Whether `NCCL_MULTI_RANK_GPU_ENABLE` is set to a non-zero number, as NCCL reads it.
pub(crate) fn multi_rank_gpu_enabled(vars: Vars<'_>) -> bool {
    lookup(vars, MULTI_RANK_GPU_VAR)
        .and_then(|text| text.trim().parse::<i64>().ok())
        .is_some_and(|value| value != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::env::vars_from;

    #[test]
    fn the_setting_is_parsed_and_bad_values_name_the_variable() {
        assert_eq!(GpuSharing::from_vars(&vars_from(&[])).unwrap(), None);
        for (text, want) in [
            ("off", GpuSharing::Off),
            ("hosts", GpuSharing::SimulatedHosts),
            (" Shared ", GpuSharing::SharedGpu),
        ] {
            let got = GpuSharing::from_vars(&vars_from(&[("NCCL_RS_GPU_SHARING", text)])).unwrap();
            assert_eq!(got, Some(want), "{text:?}");
            assert_eq!(
                GpuSharing::from_vars(&vars_from(&[("NCCL_RS_GPU_SHARING", want.setting())]))
                    .unwrap(),
                Some(want)
            );
        }
        let err = GpuSharing::from_vars(&vars_from(&[("NCCL_RS_GPU_SHARING", "mps")])).unwrap_err();
        assert!(err.to_string().contains("NCCL_RS_GPU_SHARING"), "{err}");
    }

    #[test]
    fn spawning_prefers_what_the_user_asked_nccl_for() {
        assert_eq!(
            GpuSharing::for_spawn(&vars_from(&[])).unwrap(),
            GpuSharing::SimulatedHosts
        );
        assert_eq!(
            GpuSharing::for_spawn(&vars_from(&[("NCCL_MULTI_RANK_GPU_ENABLE", "1")])).unwrap(),
            GpuSharing::SharedGpu
        );
        assert_eq!(
            GpuSharing::for_spawn(&vars_from(&[("NCCL_MULTI_RANK_GPU_ENABLE", "0")])).unwrap(),
            GpuSharing::SimulatedHosts
        );
        assert_eq!(
            GpuSharing::for_spawn(&vars_from(&[
                ("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
                ("NCCL_RS_GPU_SHARING", "hosts")
            ]))
            .unwrap(),
            GpuSharing::SimulatedHosts
        );
    }

    #[test]
    fn shared_gpu_is_checked_for_count_version_and_nccl_s_switch() {
        let on = [("NCCL_MULTI_RANK_GPU_ENABLE", "1")];
        let v2_32 = Some(crate::Version::new(2, 32, 3));
        let shared = GpuSharing::SharedGpu;
        assert!(shared.check(2, 1, v2_32, &vars_from(&on)).is_ok());
        assert!(shared.check(4, 2, v2_32, &vars_from(&on)).is_ok());
        let three = shared.check(3, 1, v2_32, &vars_from(&on)).unwrap_err();
        assert!(three.to_string().contains("at most 2"), "{three}");
        let old = shared
            .check(2, 1, Some(crate::Version::new(2, 28, 3)), &vars_from(&on))
            .unwrap_err();
        assert!(old.to_string().contains("2.28.3"), "{old}");
        let unset = shared.check(2, 1, v2_32, &vars_from(&[])).unwrap_err();
        assert!(
            unset.to_string().contains("NCCL_MULTI_RANK_GPU_ENABLE=1"),
            "{unset}"
        );
        assert!(GpuSharing::SimulatedHosts
            .check(7, 1, None, &vars_from(&[]))
            .is_ok());
        assert!(GpuSharing::Off.check(2, 1, v2_32, &vars_from(&[])).is_err());
    }

    #[test]
    fn simulated_hosts_give_each_spawned_rank_a_host_id_and_loopback() {
        let got = GpuSharing::SimulatedHosts.child_vars(3, "local-1-ab", &vars_from(&[]));
        assert!(got.contains(&("NCCL_HOSTID", "local-1-ab-rank3".to_owned())));
        assert!(got.contains(&("NCCL_SOCKET_IFNAME", "lo".to_owned())));
        assert!(got.contains(&("NCCL_RS_GPU_SHARING", "hosts".to_owned())));
        // A user's interface choice stands.
        let own = GpuSharing::SimulatedHosts.child_vars(
            1,
            "k",
            &vars_from(&[("NCCL_SOCKET_IFNAME", "eth0")]),
        );
        assert!(!own.iter().any(|(k, _)| *k == "NCCL_SOCKET_IFNAME"));
        let shared = GpuSharing::SharedGpu.child_vars(1, "k", &vars_from(&[]));
        assert_eq!(shared, vec![("NCCL_RS_GPU_SHARING", "shared".to_owned())]);
    }
}
