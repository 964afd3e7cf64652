//! `deploy/components/nvidia-compat`: the plugin runs as `gpu.nvidia.com`, NVIDIA's DeviceClasses replace
//! ours, and the admission policies guard NVIDIA's driver name. A claim written for NVIDIA's driver is
//! allocated from the slices such a plugin publishes, through the rendered classes, as the scheduler would.

use gpu_dra::api::NVIDIA_DRIVER_NAME;
use gpu_dra::cel::extended_resources::class_mapping;
use gpu_dra::cel::input::NamedClaim;
use gpu_dra::cel::selectors::simulate::{simulate, Decision, Simulation};
use gpu_dra::devices::MigMode;
use gpu_dra::support::cluster::node_slices_as;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::resource::v1::ResourceClaimSpec;
use serde_json::json;

use super::{device_classes, one, render_with, Doc};

const COMPONENT: &str = "../../deploy/components/nvidia-compat";

fn driver_env(docs: &[Doc]) -> Option<String> {
    let ds: DaemonSet = one(docs, "DaemonSet", "gpu-dra-plugin").typed();
    let spec = ds.spec.template.spec.unwrap();
    spec.containers[0]
        .env
        .clone()
        .unwrap_or_default()
        .into_iter()
        .find(|e| e.name == "DRIVER_NAME")
        .and_then(|e| e.value)
}

/// The driver each admission policy guards (its `driver` variable), by policy name.
fn policy_drivers(docs: &[Doc]) -> Vec<(String, String)> {
    docs.iter()
        .filter(|d| d.kind() == "ValidatingAdmissionPolicy")
        .filter_map(|d| {
            let variables = d.value["spec"]["variables"].as_array()?;
            let driver = variables.iter().find(|v| v["name"] == "driver")?;
            let expression = driver["expression"]
                .as_str()?
                .trim_matches('\'')
                .to_string();
            Some((d.name().to_string(), expression))
        })
        .collect()
}

#[test]
fn the_component_runs_the_plugin_as_gpu_nvidia_com_with_nvidias_classes() {
    for overlay in ["fake", "nvml"] {
        let (Some(plain), Some(with)) = (
            render_with(overlay, &[]),
            render_with(overlay, &[COMPONENT]),
        ) else {
            return; // no kubectl
        };
        assert_eq!(driver_env(&plain), None, "{overlay}: the default is ours");
        assert_eq!(
            driver_env(&with).as_deref(),
            Some(NVIDIA_DRIVER_NAME),
            "{overlay}"
        );

        let mut names: Vec<String> = device_classes(&with)
            .iter()
            .map(|c| c.metadata.name.clone().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["gpu.nvidia.com", "mig.nvidia.com"], "{overlay}");
        // As NVIDIA's chart renders them for resource.k8s.io/v1.
        let gpu = device_classes(&with)
            .into_iter()
            .find(|c| c.metadata.name.as_deref() == Some("gpu.nvidia.com"))
            .unwrap();
        let spec = gpu.spec.clone().unwrap();
        assert_eq!(
            spec.selectors.unwrap()[0].cel.as_ref().unwrap().expression,
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
        );
        assert_eq!(
            class_mapping(&device_classes(&with))
                .get("nvidia.com/gpu")
                .map(String::as_str),
            Some("gpu.nvidia.com")
        );

        let plain_policies = policy_drivers(&plain);
        let policies = policy_drivers(&with);
        assert_eq!(
            plain_policies.len(),
            4,
            "{overlay}: the policies that name the driver: {plain_policies:?}"
        );
        assert!(plain_policies.iter().all(|(_, d)| d == "gpu.dra.dev"));
        assert_eq!(policies.len(), plain_policies.len());
        assert!(
            policies.iter().all(|(_, d)| d == NVIDIA_DRIVER_NAME),
            "{overlay}: {policies:?}"
        );

        // Nothing else: the same objects but the classes, the same DaemonSet but its env.
        let others = |docs: &[Doc]| -> Vec<(String, String)> {
            docs.iter()
                .filter(|d| d.kind() != "DeviceClass")
                .map(|d| (d.kind().to_string(), d.name().to_string()))
                .collect()
        };
        assert_eq!(others(&plain), others(&with), "{overlay}");
    }
}

/// A claim as NVIDIA's quickstart writes it (two GPUs of class gpu.nvidia.com, and a MIG device of class
/// mig.nvidia.com with a selector on its profile) is allocated from what a plugin started as
/// gpu.nvidia.com publishes on a node of fake H100s.
#[test]
fn claims_written_for_nvidias_driver_are_allocated_from_our_slices() {
    let Some(rendered) = render_with("fake", &[COMPONENT]) else {
        return;
    };
    let profile = gpu_dra::gpu::builtin_profile("dgx-h100").expect("built-in profile");
    let slices = node_slices_as(NVIDIA_DRIVER_NAME, "node-1", &profile, MigMode::Dynamic);
    let claim: ResourceClaimSpec = serde_json::from_value(json!({"devices": {"requests": [
        {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}},
        {"name": "mig", "exactly": {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression":
            "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}]}}
    ]}}))
    .unwrap();
    let decision = simulate(&Simulation {
        claim: NamedClaim {
            name: "gpu-test/claim".into(),
            spec: claim,
        },
        classes: device_classes(&rendered),
        slices,
        node: Some("node-1".into()),
        node_labels: Default::default(),
        in_use: Default::default(),
    })
    .expect("the claim can be decided");
    let Decision::Allocated { results, .. } = decision else {
        panic!("not allocated: {decision:?}");
    };
    assert_eq!(results.len(), 3);
    assert!(results.iter().all(|r| r.driver == NVIDIA_DRIVER_NAME));
    let whole = results.iter().filter(|r| r.request == "gpus").count();
    assert_eq!(whole, 2);
    let mig = results.iter().find(|r| r.request == "mig").unwrap();
    assert!(mig.device.contains("-mig-1g"), "{}", mig.device);
}
