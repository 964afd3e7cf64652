//! `deploy/components/nvidia-compat`: the plugin runs as `gpu.nvidia.com`, NVIDIA's DeviceClasses replace
//! ours, and the admission policies guard NVIDIA's driver name. A claim written for NVIDIA's driver is
//! allocated from the slices such a plugin publishes, through the rendered classes, as the scheduler would.

use std::collections::BTreeSet;

use gpu_dra::api::{
    decode_config_value, DeviceConfig, GpuNodePolicy, SharingSettings, NVIDIA_DRIVER_NAME,
};
use gpu_dra::cel::allocator::in_use;
use gpu_dra::cel::extended_resources::{class_mapping, node_requests, NodeNeed};
use gpu_dra::cel::input::NamedClaim;
use gpu_dra::cel::selectors::simulate::{simulate, Decision, Simulation};
use gpu_dra::devices::{node_devices, share_for_mps, MemoryShares, MigMode};
use gpu_dra::gpu::{FakeBackend, GpuBackend};
use gpu_dra::slices::{desired_slices, ServerVersion};
use gpu_dra::support::cluster::node_slices_as;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use k8s_openapi::api::resource::v1::{
    DeviceClaim, DeviceClass, DeviceRequest, DeviceRequestAllocationResult, ResourceClaim,
    ResourceClaimSpec, ResourceClaimTemplate, ResourceSlice,
};
use serde_json::{json, Value};

use super::{device_classes, kustomize_dir, one, render_with, Doc};

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
        // The IMEX channel class keeps its name (the controller's templates name it) and selects
        // gpu.nvidia.com's channels.
        assert_eq!(
            names,
            [
                "gpu.nvidia.com",
                "imex-channel.gpu.dra.dev",
                "mig.nvidia.com",
                "vfio.gpu.nvidia.com"
            ],
            "{overlay}"
        );
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

// ---------------------------------------------------------------------------------------------------------
// e2e/nvidia-compat/: our examples of what NVIDIA's quickstart asks of its driver, which
// e2e/real-node-nvidia-compat.sh runs on the real node. Offline: they parse, name only NVIDIA's classes,
// attributes and configs, and each claim is allocated from what the installed plugin publishes (the fake
// overlay's dgx-h100 profile, dynamic MIG, driver gpu.nvidia.com), with what the script checks.

const EXAMPLES: &str = "e2e/nvidia-compat";
const NVIDIA_CLASSES: [&str; 2] = ["gpu.nvidia.com", "mig.nvidia.com"];

/// The examples, by file name, in order.
fn examples() -> Vec<(String, Vec<Doc>)> {
    let mut files = Vec::new();
    super::yaml_files(&super::root().join(EXAMPLES), &mut files);
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            (name, super::read_docs(&f))
        })
        .collect()
}

fn example(prefix: &str) -> Vec<Doc> {
    let found: Vec<_> = examples()
        .into_iter()
        .filter(|(name, _)| name.starts_with(prefix))
        .collect();
    assert!(!found.is_empty(), "no {EXAMPLES}/{prefix}*.yaml");
    found.into_iter().flat_map(|(_, docs)| docs).collect()
}

/// The pod specs of a file: Pods', and the templates of Deployments.
fn pod_specs(docs: &[Doc]) -> Vec<(String, PodSpec)> {
    let mut specs = Vec::new();
    for doc in docs {
        match doc.kind() {
            "Pod" => specs.push((doc.origin.clone(), doc.typed::<Pod>().spec.unwrap())),
            "Deployment" => specs.push((
                doc.origin.clone(),
                doc.typed::<Deployment>().spec.template.spec.unwrap(),
            )),
            _ => {}
        }
    }
    specs
}

/// The device claim of each ResourceClaim and ResourceClaimTemplate, by name.
fn claim_specs(docs: &[Doc]) -> Vec<(String, ResourceClaimSpec)> {
    docs.iter()
        .filter_map(|d| match d.kind() {
            "ResourceClaim" => Some((
                d.name().to_string(),
                d.typed::<ResourceClaim>().spec.unwrap_or_default(),
            )),
            "ResourceClaimTemplate" => Some((
                d.name().to_string(),
                d.typed::<ResourceClaimTemplate>()
                    .spec
                    .and_then(|s| s.spec)
                    .unwrap_or_default(),
            )),
            _ => None,
        })
        .collect()
}

fn requests(spec: &ResourceClaimSpec) -> Vec<DeviceRequest> {
    spec.devices
        .as_ref()
        .and_then(|d| d.requests.clone())
        .unwrap_or_default()
}

/// Every CEL expression under `value`.
fn cel_expressions(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expression", Value::String(s)) => out.push(s.clone()),
                    _ => cel_expressions(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| cel_expressions(v, out)),
        _ => {}
    }
}

/// The opaque configs of a claim spec, decoded as the plugin decodes them.
fn opaque_configs(origin: &str, spec: &ResourceClaimSpec) -> Vec<DeviceConfig> {
    let configs = spec
        .devices
        .as_ref()
        .and_then(|d| d.config.clone())
        .unwrap_or_default();
    configs
        .iter()
        .map(|c| {
            let opaque = c
                .opaque
                .as_ref()
                .unwrap_or_else(|| panic!("{origin}: a config without opaque"));
            assert_eq!(
                opaque.driver, NVIDIA_DRIVER_NAME,
                "{origin}: the config's driver"
            );
            let parameters = &opaque.parameters.0;
            assert_eq!(
                parameters["apiVersion"], "resource.nvidia.com/v1beta1",
                "{origin}: NVIDIA's configs"
            );
            let config = decode_config_value(parameters)
                .unwrap_or_else(|e| panic!("{origin}: the plugin refuses the config: {e}"));
            assert!(
                matches!(config, DeviceConfig::Nvidia(_)),
                "{origin}: {config:?}"
            );
            config
        })
        .collect()
}

#[test]
fn the_nvidia_compat_examples_parse_and_name_only_nvidias_classes_attributes_and_configs() {
    let all = examples();
    for n in 1..=7 {
        assert!(
            all.iter()
                .any(|(name, _)| name.starts_with(&format!("{n:02}-"))),
            "{EXAMPLES}/{n:02}-*.yaml is missing"
        );
    }
    let script =
        std::fs::read_to_string(super::root().join("e2e/real-node-nvidia-compat.sh")).unwrap();
    for (name, docs) in &all {
        assert!(!docs.is_empty(), "{name}: no object");
        assert!(
            script.contains(name.as_str()),
            "e2e/real-node-nvidia-compat.sh does not run {name}"
        );
        let names: BTreeSet<String> = claim_specs(docs).into_iter().map(|(n, _)| n).collect();
        for doc in docs {
            // Strictly typed: a misspelled field fails.
            let strict = match doc.kind() {
                "Deployment" => super::round_trip::<Deployment>(&doc.value),
                "GpuNodePolicy" => {
                    let policy: GpuNodePolicy = doc.typed();
                    policy
                        .spec
                        .validate()
                        .unwrap_or_else(|e| panic!("{}: an invalid policy: {e:?}", doc.origin));
                    super::round_trip::<GpuNodePolicy>(&doc.value)
                }
                _ => super::check_strict(doc),
            };
            strict.unwrap_or_else(|e| panic!("{}: {e}", doc.origin));
            assert!(
                doc.namespace().is_empty(),
                "{}: the script applies every example in its own namespace",
                doc.origin
            );
            // Nothing of gpu-dra's own names, but the GpuNodePolicy (which has no NVIDIA counterpart).
            if doc.kind() != "GpuNodePolicy" {
                let text = doc.value.to_string();
                assert!(
                    !text.contains("gpu.dra.dev"),
                    "{}: names gpu.dra.dev: {text}",
                    doc.origin
                );
            }
            let mut expressions = Vec::new();
            cel_expressions(&doc.value, &mut expressions);
            for expression in &expressions {
                assert!(
                    expression.contains("device.attributes['gpu.nvidia.com']"),
                    "{}: a selector not on NVIDIA's attributes: {expression}",
                    doc.origin
                );
            }
        }
        for (claim, spec) in claim_specs(docs) {
            let origin = format!("{name}: {claim}");
            let requests = requests(&spec);
            assert!(!requests.is_empty(), "{origin}: no request");
            for request in &requests {
                let class = &request.exactly.as_ref().expect("exactly").device_class_name;
                assert!(
                    NVIDIA_CLASSES.contains(&class.as_str()),
                    "{origin}: class {class}"
                );
            }
            opaque_configs(&origin, &spec);
        }
        // Every pod runs the node's busybox (the real node has no registry), claims a device from a claim
        // or template of its own file that a container uses, or asks for nvidia.com/gpu.
        for (origin, spec) in pod_specs(docs) {
            for c in &spec.containers {
                assert_eq!(
                    c.image.as_deref(),
                    Some("localhost/busybox:local"),
                    "{origin}"
                );
                assert_eq!(c.image_pull_policy.as_deref(), Some("Never"), "{origin}");
            }
            let claims = spec.resource_claims.clone().unwrap_or_default();
            let asks_for_gpus = spec.containers.iter().any(|c| {
                c.resources
                    .as_ref()
                    .and_then(|r| r.limits.as_ref())
                    .is_some_and(|l| l.contains_key("nvidia.com/gpu"))
            });
            assert!(
                !claims.is_empty() || asks_for_gpus,
                "{origin}: asks for no GPU"
            );
            for claim in &claims {
                let from = claim
                    .resource_claim_name
                    .clone()
                    .or(claim.resource_claim_template_name.clone())
                    .unwrap();
                assert!(names.contains(&from), "{origin}: {from} is not in its file");
                assert!(
                    spec.containers.iter().any(|c| c
                        .resources
                        .as_ref()
                        .and_then(|r| r.claims.as_ref())
                        .is_some_and(|cs| cs.iter().any(|u| u.name == claim.name))),
                    "{origin}: no container uses claim {}",
                    claim.name
                );
            }
        }
    }
}

/// NVIDIA's configs, as the plugin applies them: 04 time-slices Long, 05 runs MPS with half of the
/// threads and 10Gi of pinned memory (what the script reads in GPU_DRA_SHARING and the daemon's log).
#[test]
fn the_examples_configs_mean_what_the_script_checks() {
    let sharing = |prefix: &str| -> Vec<SharingSettings> {
        claim_specs(&example(prefix))
            .iter()
            .flat_map(|(n, s)| opaque_configs(n, s))
            .map(|c| c.effective())
            .collect()
    };
    let time_sliced = sharing("04-");
    assert_eq!(time_sliced.len(), 1);
    assert_eq!(time_sliced[0].env_value(), "TimeSlicing/Long");
    let mps = sharing("05-");
    assert_eq!(mps.len(), 1);
    assert_eq!(mps[0].env_value(), "MPS");
    let SharingSettings::Mps(limits) = &mps[0] else {
        panic!("not MPS: {:?}", mps[0]);
    };
    assert_eq!(limits.active_thread_percentage, Some(50));
    assert_eq!(limits.pinned_memory_limit_bytes, Some(10 << 30)); // 10240M in the daemon's command
    for prefix in ["01-", "02-", "03-", "06-", "07-"] {
        assert!(sharing(prefix).is_empty(), "{prefix}: exclusive, no config");
    }
}

/// The slices of node-1 as the script's install publishes them: the fake overlay's dgx-h100, dynamic MIG,
/// driver gpu.nvidia.com; or, under a GpuNodePolicy with mpsMemoryShares, whole GPUs shared by memory.
fn compat_slices(shares: Option<MemoryShares>) -> Vec<ResourceSlice> {
    let profile = gpu_dra::gpu::builtin_profile("dgx-h100").expect("built-in profile");
    let Some(shares) = shares else {
        return node_slices_as(NVIDIA_DRIVER_NAME, "node-1", &profile, MigMode::Dynamic);
    };
    let backend = FakeBackend::new("node-1", "dgx-h100").expect("the built-in profile");
    let inventory = backend.inventory().expect("fake inventory");
    let mut devices = node_devices(&inventory, MigMode::None);
    let too_small = share_for_mps(&mut devices, shares);
    assert!(too_small.is_empty(), "{too_small:?}");
    let mut slices = desired_slices(
        NVIDIA_DRIVER_NAME,
        "node-1",
        "",
        &devices,
        ServerVersion { minor: 35 },
    );
    for (i, slice) in slices.iter_mut().enumerate() {
        slice.metadata.name = Some(format!("node-1-{NVIDIA_DRIVER_NAME}-{i}"));
        slice.metadata.generate_name = None;
    }
    slices
}

/// Allocates `spec` on node-1 beside what `held` holds, as the scheduler would.
fn allocate(
    name: &str,
    spec: ResourceClaimSpec,
    classes: &[DeviceClass],
    slices: &[ResourceSlice],
    held: &[DeviceRequestAllocationResult],
) -> Vec<DeviceRequestAllocationResult> {
    let decision = simulate(&Simulation {
        claim: NamedClaim {
            name: format!("nvidia-compat/{name}"),
            spec,
        },
        classes: classes.to_vec(),
        slices: slices.to_vec(),
        node: Some("node-1".into()),
        node_labels: Default::default(),
        in_use: in_use(held),
    })
    .unwrap_or_else(|e| panic!("{name}: cannot be decided: {e}"));
    match decision {
        Decision::Allocated { results, .. } => results,
        other => panic!("{name}: not allocated: {other:?}"),
    }
}

fn whole_gpu(device: &str) -> bool {
    device
        .strip_prefix("gpu-")
        .is_some_and(|n| n.parse::<u32>().is_ok())
}

/// A device's attribute in the slices (NVIDIA's names, in the driver's domain).
fn attribute(slices: &[ResourceSlice], device: &str, name: &str) -> Value {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device)
        .and_then(|d| d.attributes.as_ref()?.get(name))
        .map(|a| serde_json::to_value(a).unwrap())
        .unwrap_or(Value::Null)
}

#[test]
fn the_nvidia_compat_examples_are_allocated_as_the_script_expects() {
    let Some(installed) = kustomize_dir("resources:\n  - ../../e2e/real-node-nvidia-compat\n")
    else {
        return; // no kubectl
    };
    let classes = device_classes(&installed);
    let slices = compat_slices(None);
    let claims = |prefix: &str| claim_specs(&example(prefix));

    // 01: a template, one pod each: two whole GPUs, not the same.
    let [(name, spec)] = claims("01-").try_into().unwrap();
    let first = allocate(&name, spec.clone(), &classes, &slices, &[]);
    let second = allocate(&name, spec, &classes, &slices, &first);
    assert!(first.len() == 1 && second.len() == 1);
    assert!(whole_gpu(&first[0].device) && whole_gpu(&second[0].device));
    assert_ne!(first[0].device, second[0].device);

    // 02 and 05: one whole GPU per claim, used by two containers or two pods.
    for prefix in ["02-", "05-"] {
        let specs = claims(prefix);
        assert!(!specs.is_empty());
        for (name, spec) in specs {
            let results = allocate(&name, spec, &classes, &slices, &[]);
            assert!(
                results.len() == 1 && whole_gpu(&results[0].device),
                "{name}: {results:?}"
            );
        }
    }
    for (prefix, pods) in [("02-", 3), ("05-", 2)] {
        assert_eq!(pod_specs(&example(prefix)).len(), pods, "{prefix}");
    }

    // 03: four MIG devices of three profiles on one parent.
    let [(name, spec)] = claims("03-").try_into().unwrap();
    let results = allocate(&name, spec, &classes, &slices, &[]);
    let mut profiles: Vec<&str> = results
        .iter()
        .map(|r| {
            r.device
                .split("-mig-")
                .nth(1)
                .unwrap_or("")
                .split('-')
                .next()
                .unwrap()
        })
        .collect();
    profiles.sort();
    assert_eq!(
        profiles,
        ["1g10gb", "1g10gb", "2g20gb", "3g40gb"],
        "{results:?}"
    );
    let parents: BTreeSet<&str> = results
        .iter()
        .map(|r| r.device.split("-mig-").next().unwrap())
        .collect();
    assert_eq!(parents.len(), 1, "{results:?}");

    // 04: a whole GPU with an even `index`.
    let [(name, spec)] = claims("04-").try_into().unwrap();
    let results = allocate(&name, spec, &classes, &slices, &[]);
    assert!(results.len() == 1 && whole_gpu(&results[0].device));
    let index = attribute(&slices, &results[0].device, "index")["int"]
        .as_i64()
        .expect("an index");
    assert_eq!(index % 2, 0, "{results:?}");

    // 06: under the policy, both replicas' 4Gi claims land on one GPU, each with its share.
    let docs = example("06-");
    let policy: GpuNodePolicy = docs
        .iter()
        .find(|d| d.kind() == "GpuNodePolicy")
        .expect("the policy")
        .typed();
    assert_eq!(
        docs.iter()
            .find(|d| d.kind() == "GpuNodePolicy")
            .unwrap()
            .value["spec"]["migMode"],
        "none"
    );
    let sizes = policy
        .spec
        .sharing
        .as_ref()
        .and_then(|s| s.mps_memory_shares.as_ref())
        .expect("mpsMemoryShares")
        .sizes("spec.sharing.mpsMemoryShares")
        .expect("valid sizes");
    let shared = compat_slices(Some(MemoryShares {
        minimum_bytes: sizes.minimum_bytes,
        step_bytes: sizes.step_bytes,
    }));
    let deployment: Deployment = docs
        .iter()
        .find(|d| d.kind() == "Deployment")
        .expect("the replicas")
        .typed();
    assert_eq!(deployment.spec.replicas, Some(2));
    let [(name, spec)] = claim_specs(&docs).try_into().unwrap();
    let first = allocate(&name, spec.clone(), &classes, &shared, &[]);
    let second = allocate(&name, spec, &classes, &shared, &first);
    for results in [&first, &second] {
        assert!(
            results.len() == 1 && whole_gpu(&results[0].device),
            "{results:?}"
        );
        let consumed = results[0]
            .consumed_capacity
            .as_ref()
            .and_then(|c| c.get("memory"))
            .map(|q| q.0.as_str());
        assert_eq!(consumed, Some("4Gi"), "{results:?}");
        assert!(results[0].share_id.is_some(), "{results:?}");
    }
    assert_eq!(first[0].device, second[0].device, "packed onto one GPU");
    assert_ne!(first[0].share_id, second[0].share_id);
    // Without the policy the GPUs are whole: the same claims take two GPUs.
    let first = allocate(
        &name,
        claim_specs(&docs)[0].1.clone(),
        &classes,
        &slices,
        &[],
    );
    let second = allocate(
        &name,
        claim_specs(&docs)[0].1.clone(),
        &classes,
        &slices,
        &first,
    );
    assert_ne!(first[0].device, second[0].device);

    // 07: nvidia.com/gpu: 1 through the class's extendedResourceName: one whole GPU.
    let docs = example("07-");
    let pod: Pod = docs
        .iter()
        .find(|d| d.kind() == "Pod")
        .expect("the pod")
        .typed();
    assert!(
        pod.spec.as_ref().unwrap().resource_claims.is_none(),
        "no resourceClaims of its own"
    );
    let need = node_requests(&pod, &class_mapping(&classes), &BTreeSet::new())
        .expect("nvidia.com/gpu is mapped");
    let NodeNeed::Devices(requests) = need else {
        panic!("nvidia.com/gpu is served from DRA on a node without the device plugin: {need:?}");
    };
    assert_eq!(requests.len(), 1);
    assert_eq!(
        requests[0].exactly.as_ref().unwrap().device_class_name,
        "gpu.nvidia.com"
    );
    let spec = ResourceClaimSpec {
        devices: Some(DeviceClaim {
            requests: Some(requests),
            ..Default::default()
        }),
    };
    let results = allocate(
        "plugin-style-extended-resources-x",
        spec,
        &classes,
        &slices,
        &[],
    );
    assert!(
        results.len() == 1 && whole_gpu(&results[0].device),
        "{results:?}"
    );
    assert_eq!(results[0].driver, NVIDIA_DRIVER_NAME);
    assert_eq!(
        attribute(&slices, &results[0].device, "type")["string"],
        "gpu"
    );
}

/// What the script installs: the fake overlay on the real node's host network, with the component.
#[test]
fn the_script_installs_the_component_as_a_user_does() {
    let Some(installed) = kustomize_dir("resources:\n  - ../../e2e/real-node-nvidia-compat\n")
    else {
        return;
    };
    assert_eq!(driver_env(&installed).as_deref(), Some(NVIDIA_DRIVER_NAME));
    let mut names: Vec<String> = device_classes(&installed)
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();
    names.sort();
    // NVIDIA's classes, and the IMEX channel class of the ComputeDomain controller's templates.
    assert_eq!(
        names,
        [
            "gpu.nvidia.com",
            "imex-channel.gpu.dra.dev",
            "mig.nvidia.com",
            "vfio.gpu.nvidia.com"
        ]
    );
    let ds: DaemonSet = one(&installed, "DaemonSet", "gpu-dra-plugin").typed();
    let spec = ds.spec.template.spec.unwrap();
    assert_eq!(
        spec.host_network,
        Some(true),
        "the real node has no kube-proxy"
    );
    let env = spec.containers[0].env.clone().unwrap_or_default();
    let value = |name: &str| {
        env.iter()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(value("GPU_BACKEND").as_deref(), Some("fake"));
    assert_eq!(value("MIG_MODE").as_deref(), Some("dynamic"));
    assert!(policy_drivers(&installed)
        .iter()
        .all(|(_, d)| d == NVIDIA_DRIVER_NAME));
    let script =
        std::fs::read_to_string(super::root().join("e2e/real-node-nvidia-compat.sh")).unwrap();
    assert!(script.contains("kubectl apply -k e2e/real-node-nvidia-compat"));
}
