//! Reading the environment: variable names, lookups that treat blank values as unset, and
//! the rendezvous settings (address, job key, timeout) every method shares.

use std::time::Duration;

use super::{BootstrapError, Result};

/// The variables read by the rendezvous and [`spawn_local`](super::spawn_local) (the
/// launchers' own are in [`launch`](super::launch)).
pub(crate) mod vars {
    pub const ADDR: &str = "NCCL_RS_ADDR";
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    pub const MASTER_PORT: &str = "MASTER_PORT";
    pub const JOB_KEY: &str = "NCCL_RS_JOB_KEY";
    /// The pre-shared key of the encrypted TCP rendezvous, in hex.
    pub const RENDEZVOUS_KEY: &str = "NCCL_RS_RENDEZVOUS_KEY";
    pub const RENDEZVOUS_DIR: &str = "NCCL_RS_RENDEZVOUS_DIR";
    pub const TIMEOUT: &str = "NCCL_RS_BOOTSTRAP_TIMEOUT";
    pub const UNIQUE_IDS: &str = "NCCL_RS_UNIQUE_IDS";
    pub const LOCAL_RANKS: &str = "NCCL_RS_LOCAL_RANKS";
    /// How ranks share GPUs when a node has more ranks than GPUs (`off`, `hosts`, `shared`).
    pub const GPU_SHARING: &str = "NCCL_RS_GPU_SHARING";
    /// Overrides launcher detection: only the named launcher's variables are read.
    pub const LAUNCHER: &str = "NCCL_RS_LAUNCHER";
}

/// The rank-wide deadline used when `NCCL_RS_BOOTSTRAP_TIMEOUT` is unset. Generous, because
/// ranks of a large job can start minutes apart.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The job key used when neither `NCCL_RS_JOB_KEY` nor a launcher's job id is set.
pub const DEFAULT_JOB_KEY: &str = "nccl-rs-default";

/// A source of variables: the process environment, or a map in tests.
pub(crate) type Vars<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The job key: `NCCL_RS_JOB_KEY`, else a launcher's job id, else [`DEFAULT_JOB_KEY`].
pub(crate) fn job_key_from(vars: Vars<'_>) -> String {
    if let Some(key) = lookup(vars, vars::JOB_KEY) {
        return key;
    }
    if let Some(job) = lookup(vars, "SLURM_JOB_ID") {
        return match lookup(vars, "SLURM_STEP_ID") {
            Some(step) => format!("slurm-{}.{}", job.trim(), step.trim()),
            None => format!("slurm-{}", job.trim()),
        };
    }
    for (var, prefix) in [
        ("OMPI_MCA_ess_base_jobid", "ompi"),
        ("PMIX_NAMESPACE", "pmix"),
        ("TORCHELASTIC_RUN_ID", "torchelastic"),
    ] {
        if let Some(id) = lookup(vars, var) {
            return format!("{prefix}-{}", id.trim());
        }
    }
    DEFAULT_JOB_KEY.to_owned()
}

/// The rank-wide timeout: `NCCL_RS_BOOTSTRAP_TIMEOUT` seconds, else [`DEFAULT_TIMEOUT`].
pub(crate) fn timeout_from(vars: Vars<'_>) -> Result<Duration> {
    match lookup(vars, vars::TIMEOUT) {
        Some(text) => parse_seconds(vars::TIMEOUT, &text),
        None => Ok(DEFAULT_TIMEOUT),
    }
}

/// Checks a `host:port` value from variable `var`.
fn parse_address(var: &str, value: &str) -> Result<String> {
    let value = value.trim();
    let invalid = |reason: &str| BootstrapError::Env {
        var: var.to_owned(),
        value: value.to_owned(),
        reason: reason.to_owned(),
    };
    let (host, port) = value
        .rsplit_once(':')
        .ok_or_else(|| invalid("expected host:port, e.g. node0:29500 or [::1]:29500"))?;
    if host.is_empty() || host == "[]" {
        return Err(invalid("the host is empty"));
    }
    match port.parse::<u16>() {
        Ok(0) => Err(invalid("port 0 cannot be shared with the other ranks")),
        Ok(_) => Ok(value.to_owned()),
        Err(_) => Err(invalid("the port is not a number from 1 to 65535")),
    }
}

/// The TCP rendezvous address from `NCCL_RS_ADDR`, else `MASTER_ADDR` and `MASTER_PORT`.
pub(crate) fn address_from(vars: Vars<'_>) -> Result<Option<String>> {
    if let Some(addr) = lookup(vars, vars::ADDR) {
        return parse_address(vars::ADDR, &addr).map(Some);
    }
    let host = lookup(vars, vars::MASTER_ADDR);
    let port = lookup(vars, vars::MASTER_PORT);
    let missing = |set: &str, unset: &str| {
        Err(BootstrapError::Config(format!(
            "{set} is set but {unset} is not"
        )))
    };
    match (host, port) {
        (None, None) => Ok(None),
        (Some(_), None) => missing(vars::MASTER_ADDR, vars::MASTER_PORT),
        (None, Some(_)) => missing(vars::MASTER_PORT, vars::MASTER_ADDR),
        (Some(host), Some(port)) => master_address(vars, &host, &port).map(Some),
    }
}

/// `host:port` from torchrun's `MASTER_ADDR` and `MASTER_PORT`.
fn master_address(vars: Vars<'_>, host: &str, port_text: &str) -> Result<String> {
    let invalid = |reason: String| BootstrapError::Env {
        var: vars::MASTER_PORT.to_owned(),
        value: port_text.to_owned(),
        reason,
    };
    let port = match port_text.trim().parse::<u16>() {
        Ok(port) if port > 0 => port,
        _ => return Err(invalid("expected a port number from 1 to 65535".to_owned())),
    };
    // torchrun's agent hosts its own store on MASTER_PORT when it says so: rank 0 cannot
    // listen there, so every rank uses the next port instead.
    let agent_holds_port = lookup(vars, TORCHELASTIC_AGENT_STORE)
        .is_some_and(|v| matches!(v.trim(), "True" | "true" | "1"));
    let port = if agent_holds_port {
        port.checked_add(1).ok_or_else(|| {
            invalid(format!(
                "{TORCHELASTIC_AGENT_STORE} is set, so the rendezvous would use the next port, \
                 but there is none; set {} instead",
                vars::ADDR
            ))
        })?
    } else {
        port
    };
    let host = host.trim();
    // A bare IPv6 literal needs brackets before a port can follow it.
    let joined = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    parse_address(vars::MASTER_ADDR, &joined)
}

/// Set by torchrun in its workers' environment when its agent hosts the store on MASTER_PORT.
const TORCHELASTIC_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// Reads one variable from the process environment. A value that is not valid Unicode is
/// passed on (lossily converted) rather than treated as unset, so that it fails validation
/// with its name instead of silently disappearing.
pub(crate) fn process_var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
}

/// Looks `name` up through `vars`, treating an empty or all-blank value as unset (shells and
/// job scripts often export empty variables).
pub(crate) fn lookup(vars: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<String> {
    vars(name).filter(|value| !value.trim().is_empty())
}

/// Parses a duration given in seconds (`"30"`, `"2.5"`) from variable `var`.
pub(crate) fn parse_seconds(var: &str, value: &str) -> Result<Duration, BootstrapError> {
    let invalid = |reason: &str| BootstrapError::Env {
        var: var.to_owned(),
        value: value.to_owned(),
        reason: reason.to_owned(),
    };
    let seconds: f64 = value
        .trim()
        .parse()
        .map_err(|_| invalid("expected a number of seconds, e.g. 30 or 2.5"))?;
    if !seconds.is_finite() || seconds <= 0.0 {
        return Err(invalid("the timeout must be a positive number of seconds"));
    }
    Duration::try_from_secs_f64(seconds).map_err(|_| invalid("the timeout is too large"))
}

/// A variable lookup that reads `pairs` instead of the process environment, for the tests
/// of every reader of [`Vars`].
#[cfg(test)]
pub(crate) fn vars_from<'a>(
    pairs: &'a [(&'a str, &'a str)],
) -> impl Fn(&str) -> Option<String> + 'a {
    move |name| {
        pairs
            .iter()
            .find(|(key, _)| *key == name)
            .map(|(_, value)| (*value).to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_key_sources_in_order() {
        assert_eq!(job_key_from(&vars_from(&[])), DEFAULT_JOB_KEY);
        assert_eq!(
            job_key_from(&vars_from(&[
                ("SLURM_JOB_ID", "42"),
                ("OMPI_MCA_ess_base_jobid", "7")
            ])),
            "slurm-42"
        );
        assert_eq!(
            job_key_from(&vars_from(&[
                ("SLURM_JOB_ID", "42"),
                ("SLURM_STEP_ID", "3")
            ])),
            "slurm-42.3"
        );
        assert_eq!(
            job_key_from(&vars_from(&[("OMPI_MCA_ess_base_jobid", "7")])),
            "ompi-7"
        );
        assert_eq!(
            job_key_from(&vars_from(&[
                ("NCCL_RS_JOB_KEY", "mine"),
                ("SLURM_JOB_ID", "42")
            ])),
            "mine"
        );
    }

    #[test]
    fn addresses_parse() {
        assert_eq!(
            address_from(&vars_from(&[("NCCL_RS_ADDR", "node0:29500")])).unwrap(),
            Some("node0:29500".to_owned())
        );
        assert_eq!(
            address_from(&vars_from(&[
                ("MASTER_ADDR", "::1"),
                ("MASTER_PORT", "29500")
            ]))
            .unwrap(),
            Some("[::1]:29500".to_owned())
        );
        assert_eq!(address_from(&vars_from(&[])).unwrap(), None);
        for bad in ["node0", "node0:", "node0:0", "node0:70000", ":29500"] {
            let err = address_from(&vars_from(&[("NCCL_RS_ADDR", bad)])).unwrap_err();
            assert!(
                matches!(err, BootstrapError::Env { ref var, .. } if var == "NCCL_RS_ADDR"),
                "{bad}: {err}"
            );
        }
        let err = address_from(&vars_from(&[("MASTER_ADDR", "node0")])).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
        let err = address_from(&vars_from(&[
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "http"),
        ]))
        .unwrap_err();
        assert!(
            matches!(err, BootstrapError::Env { ref var, .. } if var == "MASTER_PORT"),
            "{err}"
        );
        // Under torchrun's agent store, MASTER_PORT is taken: the next port is used.
        assert_eq!(
            address_from(&vars_from(&[
                ("MASTER_ADDR", "node0"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ]))
            .unwrap(),
            Some("node0:29501".to_owned())
        );
    }

    #[test]
    fn seconds_parse_and_reject() {
        assert_eq!(
            parse_seconds("T", "2.5").unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(parse_seconds("T", " 30 ").unwrap(), Duration::from_secs(30));
        for bad in ["0", "-1", "abc", "inf", "NaN", "1e300"] {
            let err = parse_seconds("T", bad).unwrap_err();
            assert!(
                matches!(err, BootstrapError::Env { ref var, .. } if var == "T"),
                "{bad}: {err}"
            );
        }
    }
}
