//! `gpu-dra controller`: the ComputeDomain controller (a Deployment of two replicas, one leading through
//! a Lease): flags and environment → [`ControllerConfig`] and [`LeaderElectionConfig`], the client,
//! signals.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{ArgAction, Args};

use super::runtime;
use crate::domains::controller::leader::{LeaderElectionConfig, LeaderElector, DEFAULT_LEASE_NAME};
use crate::domains::controller::{Controller, ControllerConfig};
use crate::observability::{init_logging, LogFormat};

/// Where a Pod finds its namespace when the downward API does not say.
const NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";
/// The Lease's namespace outside a cluster, and where `deploy/` installs.
const DEFAULT_NAMESPACE: &str = "gpu-dra";

#[derive(Args)]
pub struct ControllerArgs {
    /// `gpu.nvidia.com` serves NVIDIA's ComputeDomains (resource.nvidia.com) too.
    #[arg(long, env = "DRIVER_NAME", default_value = crate::api::DRIVER_NAME)]
    driver_name: String,
    /// Kubeconfig file; in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The DeviceClass of the channel requests in the templates the controller writes.
    #[arg(long, env = "CHANNEL_DEVICE_CLASS", default_value = crate::domains::api::CHANNEL_DEVICE_CLASS)]
    channel_device_class: String,
    /// Seconds between rounds when no watch sees a change.
    #[arg(long, env = "RESYNC_SECONDS", default_value_t = 10)]
    resync_seconds: u64,
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Run only while holding the Lease, so that one of several replicas works; `false` for a single
    /// replica.
    #[arg(long, env = "LEADER_ELECT", default_value_t = true, action = ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    leader_elect: bool,
    /// How long the other replicas wait, after they last saw the Lease renewed, before they take it
    /// (`15s`, `1m`, `500ms`; written to the Lease in whole seconds).
    #[arg(long, env = "LEADER_ELECT_LEASE_DURATION", default_value = "15s", value_parser = parse_duration)]
    leader_elect_lease_duration: Duration,
    /// How long the leader keeps working without renewing the Lease; then it stops and exits.
    #[arg(long, env = "LEADER_ELECT_RENEW_DEADLINE", default_value = "10s", value_parser = parse_duration)]
    leader_elect_renew_deadline: Duration,
    /// How often the leader renews and the others try to take the Lease.
    #[arg(long, env = "LEADER_ELECT_RETRY_PERIOD", default_value = "2s", value_parser = parse_duration)]
    leader_elect_retry_period: Duration,
    /// The Lease the replicas elect their leader with.
    #[arg(long, env = "LEADER_ELECT_LEASE_NAME", default_value = DEFAULT_LEASE_NAME)]
    leader_elect_lease_name: String,
    /// Default: the Pod's namespace (`POD_NAMESPACE`, else the service account's namespace file), else
    /// `gpu-dra`.
    #[arg(long, env = "LEADER_ELECT_LEASE_NAMESPACE")]
    leader_elect_lease_namespace: Option<String>,
}

/// `gpu-dra controller`: runs until SIGTERM or SIGINT; with leader election, only while it holds the
/// Lease, and exits non-zero when it loses it (the kubelet restarts it as a candidate).
pub fn run_controller(args: ControllerArgs) -> Result<()> {
    init_logging(args.log_format, "info");
    let mut config = ControllerConfig::new(&args.driver_name);
    config.device_class = args.channel_device_class.clone();
    config.resync = Duration::from_secs(args.resync_seconds.max(1));
    let election = args.leader_elect.then(|| election_config(&args));
    if let Some(election) = &election {
        election.check()?;
    }
    runtime()?.block_on(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
                _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
            }
        };
        let client = crate::apiclient::kube_client(args.kubeconfig.as_deref(), &config.api).await?;
        tracing::info!(driver = %config.driver_name, "ComputeDomain controller starting");
        let controller = Controller::new(client.clone(), config);
        let Some(election) = election else {
            controller.run(shutdown).await;
            return Ok(());
        };
        LeaderElector::new(client, election)?
            .run(|stop| controller.run(stop.requested()), shutdown)
            .await?;
        Ok(())
    })
}

fn election_config(args: &ControllerArgs) -> LeaderElectionConfig {
    let namespace = lease_namespace(
        args.leader_elect_lease_namespace.as_deref(),
        std::env::var("POD_NAMESPACE").ok().as_deref(),
        Path::new(NAMESPACE_FILE),
    );
    let pod = std::env::var("POD_NAME")
        .ok()
        .filter(|name| !name.is_empty())
        .or_else(hostname)
        .unwrap_or_else(|| "gpu-dra-controller".to_string());
    // Unique per process: a restarted container is a new candidate, not the old holder.
    let identity = format!("{pod}_{}", uuid::Uuid::new_v4());
    LeaderElectionConfig {
        lease_duration: args.leader_elect_lease_duration,
        renew_deadline: args.leader_elect_renew_deadline,
        retry_period: args.leader_elect_retry_period,
        ..LeaderElectionConfig::new(&namespace, &args.leader_elect_lease_name, &identity)
    }
}

/// The flag, else the Pod's namespace from the downward API, else the service account's namespace
/// file, else `gpu-dra`.
fn lease_namespace(flag: Option<&str>, pod_namespace: Option<&str>, file: &Path) -> String {
    let given = |value: Option<&str>| {
        value
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(String::from)
    };
    given(flag)
        .or_else(|| given(pod_namespace))
        .or_else(|| given(std::fs::read_to_string(file).ok().as_deref()))
        .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string())
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
}

/// A duration as Go and client-go's flags write one: numbers with units `h`, `m`, `s`, `ms`, one after
/// the other (`15s`, `1m30s`, `1.5s`, `500ms`).
fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || format!("invalid duration {text:?}: expected e.g. 15s, 1m30s, 500ms");
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(invalid());
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(invalid)?;
        let number: f64 = rest[..number_len].parse().map_err(|_| invalid())?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            _ => return Err(invalid()),
        };
        rest = &rest[unit_len..];
        total += Duration::try_from_secs_f64(number * seconds).map_err(|_| invalid())?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_go_writes_them() {
        let ms = Duration::from_millis;
        for (text, expected) in [
            ("15s", ms(15_000)),
            ("2s", ms(2_000)),
            ("500ms", ms(500)),
            ("1.5s", ms(1_500)),
            ("1m30s", ms(90_000)),
            ("1h", ms(3_600_000)),
        ] {
            assert_eq!(parse_duration(text), Ok(expected), "{text}");
        }
        for bad in ["", "15", "s", "15x", "-1s", "1..5s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_lease_namespace_is_the_flag_else_the_pods_else_the_files_else_gpu_dra() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("namespace");
        let missing = dir.path().join("missing");
        std::fs::write(&file, "from-file\n").unwrap();
        assert_eq!(lease_namespace(Some("flag"), Some("pod"), &file), "flag");
        assert_eq!(lease_namespace(None, Some("pod"), &file), "pod");
        assert_eq!(lease_namespace(None, Some(""), &file), "from-file");
        assert_eq!(lease_namespace(None, None, &missing), "gpu-dra");
    }
}
