//! `gpu-dra controller`: the ComputeDomain controller (one replica per cluster, a Deployment): flags
//! and environment → [`ControllerConfig`], the client, signals.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use super::runtime;
use crate::domains::controller::{Controller, ControllerConfig};
use crate::observability::{init_logging, LogFormat};

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
}

/// `gpu-dra controller`: runs until SIGTERM or SIGINT.
pub fn run_controller(args: ControllerArgs) -> Result<()> {
    init_logging(args.log_format, "info");
    let mut config = ControllerConfig::new(&args.driver_name);
    config.device_class = args.channel_device_class;
    config.resync = Duration::from_secs(args.resync_seconds.max(1));
    runtime()?.block_on(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
        let client = crate::apiclient::kube_client(args.kubeconfig.as_deref(), &config.api).await?;
        tracing::info!(driver = %config.driver_name, "ComputeDomain controller starting");
        Controller::new(client, config)
            .run(async move {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
                    _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
                }
            })
            .await;
        Ok(())
    })
}
