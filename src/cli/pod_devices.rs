//! `gpu-dra pod-devices`: which GPU each container on this node has, from the kubelet's PodResources
//! API and the node's ResourceSlices, as dcgm-exporter attributes GPU metrics to pods.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams};

use super::{emit, runtime, Output};
use crate::kubelet::pod_resources;

#[derive(Args)]
pub struct PodDevicesArgs {
    /// The kubelet's PodResources socket.
    #[arg(long, default_value = pod_resources::DEFAULT_SOCKET)]
    pod_resources_socket: PathBuf,
    /// Only devices of this driver (e.g. gpu.nvidia.com in NVIDIA compatibility mode); all drivers' when
    /// not given.
    #[arg(long)]
    driver_name: Option<String>,
    /// Kubeconfig file, to read the ResourceSlices; else as kubectl finds one ($KUBECONFIG,
    /// ~/.kube/config, in-cluster).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: Output,
}

pub fn pod_devices(args: PodDevicesArgs) -> Result<()> {
    let rows = runtime()?.block_on(async {
        let response = pod_resources::list(&args.pod_resources_socket).await?;
        let devices = pod_resources::dra_devices(&response, args.driver_name.as_deref());
        let client = crate::apiclient::kube_client(
            args.kubeconfig.as_deref(),
            &crate::apiclient::ApiTimeouts::default(),
        )
        .await?;
        let mut params = ListParams::default();
        if let Some(driver) = &args.driver_name {
            params = params.fields(&format!("spec.driver={driver}"));
        }
        let slices = Api::<ResourceSlice>::all(client)
            .list(&params)
            .await
            .context("listing ResourceSlices")?
            .items;
        anyhow::Ok(pod_resources::resolve(devices, &slices))
    })?;
    emit(&match args.output {
        Output::Table => pod_resources::table(&rows),
        Output::Json => serde_json::to_string_pretty(&rows)? + "\n",
        Output::Yaml => serde_yaml::to_string(&rows)?,
    });
    Ok(())
}
