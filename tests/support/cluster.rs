//! A cluster of fake GPU nodes as API objects, for `gpu-dra explain`'s tests, its benchmark and the
//! demo: the ResourceSlices gpu-dra publishes for a fake profile (fake backend → device model → slice
//! planner, as `gpu-dra devices` prints them), Nodes, ResourceClaims that hold devices, and dumps in the
//! form `kubectl get ... -A -o yaml` prints (a `v1` `List`).

use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceSlice};
use serde_json::{json, Value};

use crate::devices::{node_devices, MigMode};
use crate::gpu::{FakeProfile, GpuBackend};
use crate::slices::{desired_slices, ServerVersion};

pub const DRIVER: &str = "gpu.dra.dev";

/// The slices a node with `profile` publishes (Kubernetes 1.35 layout), named `<node>-gpu.dra.dev-<i>`
/// as the API server would name them from their `generateName`.
pub fn node_slices(node: &str, profile: &FakeProfile, mig: MigMode) -> Vec<ResourceSlice> {
    node_slices_as(DRIVER, node, profile, mig)
}

/// [`node_slices`] of a plugin started with `--driver-name driver`.
pub fn node_slices_as(
    driver: &str,
    node: &str,
    profile: &FakeProfile,
    mig: MigMode,
) -> Vec<ResourceSlice> {
    published_slices(driver, node, profile, mig, 0)
}

/// The slices of a node on an NVLink fabric (a GB200 tray, `crate::gpu::gb200_tray`): its GPUs and
/// `channels` IMEX channel devices, as a plugin started with `--imex-channels <channels>` publishes.
pub fn fabric_node_slices(
    driver: &str,
    node: &str,
    profile: &FakeProfile,
    channels: u32,
) -> Vec<ResourceSlice> {
    published_slices(driver, node, profile, MigMode::None, channels)
}

fn published_slices(
    driver: &str,
    node: &str,
    profile: &FakeProfile,
    mig: MigMode,
    channels: u32,
) -> Vec<ResourceSlice> {
    // The fake backend reads a profile from a built-in name or a file; a custom one goes to a file.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("profile.yaml");
    std::fs::write(&path, serde_yaml::to_string(profile).expect("profile YAML"))
        .expect("profile file");
    let backend = crate::gpu::FakeBackend::new(node, &path.display().to_string())
        .expect("fake profile loads");
    let inventory = backend.inventory().expect("fake inventory");
    let mut devices = node_devices(&inventory, mig);
    devices.channels = crate::domains::channels::channel_devices(&inventory, channels);
    let mut slices = desired_slices(driver, node, "", &devices, ServerVersion { minor: 35 });
    for (i, slice) in slices.iter_mut().enumerate() {
        slice.metadata.name = Some(format!("{node}-{driver}-{i}"));
        slice.metadata.generate_name = None;
    }
    slices
}

/// `name`'s built-in profile with MIG mode on and these MIG devices made on each of `gpus` (static
/// MIG, as an admin makes them with `nvidia-smi mig -cgi`).
pub fn static_mig(name: &str, gpus: &[usize], instances: &[(&str, u32)]) -> FakeProfile {
    let mut profile = crate::gpu::builtin_profile(name).expect("built-in profile");
    for &gpu in gpus {
        profile.gpus[gpu].mig_enabled = true;
        let made: Vec<Value> = instances
            .iter()
            .map(|(profile, start)| json!({"profile": profile, "start": start}))
            .collect();
        profile.gpus[gpu].mig_instances =
            serde_json::from_value(Value::Array(made)).expect("MIG instances");
    }
    profile
}

/// The same slices for another node: node name, pool name and slice names changed (the devices and
/// their attributes stay, which is what a cluster of identical machines publishes).
pub fn renamed(slices: &[ResourceSlice], from: &str, to: &str) -> Vec<ResourceSlice> {
    slices
        .iter()
        .map(|slice| {
            let mut slice = slice.clone();
            slice.metadata.name = slice.metadata.name.map(|n| n.replacen(from, to, 1));
            slice.spec.node_name = Some(to.to_string());
            slice.spec.pool.name = to.to_string();
            slice
        })
        .collect()
}

/// Adds a taint to the named devices of `slices`.
pub fn taint(slices: &mut [ResourceSlice], devices: &[&str], key: &str, value: &str, effect: &str) {
    for device in slices
        .iter_mut()
        .flat_map(|s| s.spec.devices.iter_mut().flatten())
        .filter(|d| devices.contains(&d.name.as_str()))
    {
        device
            .taints
            .get_or_insert_with(Vec::new)
            .push(DeviceTaint {
                key: key.to_string(),
                value: (!value.is_empty()).then(|| value.to_string()),
                effect: effect.to_string(),
                time_added: None,
            });
    }
}

/// A Node with labels, taints (`key=value:Effect` or `key:Effect`) and `spec.unschedulable`.
pub fn node(name: &str, labels: &[(&str, &str)], taints: &[&str], unschedulable: bool) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .chain([("kubernetes.io/hostname".to_string(), json!(name))])
        .collect();
    let taints: Vec<Value> = taints
        .iter()
        .map(|t| {
            let (kv, effect) = t.rsplit_once(':').expect("taint key[=value]:Effect");
            match kv.split_once('=') {
                Some((key, value)) => json!({"key": key, "value": value, "effect": effect}),
                None => json!({"key": kv, "effect": effect}),
            }
        })
        .collect();
    let mut spec = json!({});
    if !taints.is_empty() {
        spec["taints"] = json!(taints);
    }
    if unschedulable {
        spec["unschedulable"] = json!(true);
    }
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": spec})
}

/// A ResourceClaim allocated on `node`: one result per device of the node's pool, for request `gpu`.
pub fn allocated_claim(namespace: &str, name: &str, node: &str, devices: &[&str]) -> Value {
    let results: Vec<Value> = devices
        .iter()
        .map(|d| json!({"request": "gpu", "driver": DRIVER, "pool": node, "device": d}))
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": format!("uid-{namespace}-{name}")},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER, "count": devices.len()}}]}},
        "status": {"allocation": {
            "devices": {"results": results},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}
        }}
    })
}

/// A ResourceClaimTemplate (or, with `template: false`, a ResourceClaim) with these `spec.devices`.
pub fn claim(namespace: &str, name: &str, devices: Value, template: bool) -> Value {
    if template {
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
               "metadata": {"namespace": namespace, "name": name},
               "spec": {"spec": {"devices": devices}}})
    } else {
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
               "metadata": {"namespace": namespace, "name": name, "uid": format!("uid-{namespace}-{name}")},
               "spec": {"devices": devices}})
    }
}

/// A Pending pod with these `spec.resourceClaims` (`{"name", "resourceClaimName" |
/// "resourceClaimTemplateName"}`) and extra `spec` fields (nodeSelector, tolerations, affinity).
pub fn pod(namespace: &str, name: &str, claims: Value, spec: Value) -> Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": namespace, "name": name, "uid": format!("uid-{namespace}-{name}")},
        "spec": {"containers": [{"name": "main", "image": "busybox"}], "resourceClaims": claims},
        "status": {"phase": "Pending"}
    });
    if let (Some(target), Some(extra)) = (pod["spec"].as_object_mut(), spec.as_object()) {
        target.extend(extra.clone());
    }
    pod
}

/// Objects as `kubectl get ... -o yaml` prints them: one `v1` `List`.
pub fn list(items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}, "items": items})
}

/// The DeviceClasses `deploy/` ships, as objects.
pub fn device_classes() -> Vec<Value> {
    use serde::Deserialize;
    let text = include_str!("../../deploy/base/deviceclasses.yaml");
    serde_yaml::Deserializer::from_str(text)
        .map(|document| Value::deserialize(document).expect("DeviceClass YAML"))
        .collect()
}

/// The DeviceClasses `deploy/` ships, with `spec.extendedResourceName: <resource>` on `gpu.dra.dev`
/// (as an admin sets it with the `DRAExtendedResource` gate on).
pub fn device_classes_serving(resource: &str) -> Vec<Value> {
    let mut classes = device_classes();
    for class in &mut classes {
        if class["metadata"]["name"] == DRIVER {
            class["spec"]["extendedResourceName"] = json!(resource);
        }
    }
    classes
}

/// `node` with `status.allocatable` (what its device plugins advertise, e.g. `nvidia.com/gpu: 8`).
pub fn with_allocatable(mut node: Value, resources: &[(&str, &str)]) -> Value {
    let allocatable: serde_json::Map<String, Value> = resources
        .iter()
        .map(|(name, value)| (name.to_string(), json!(value)))
        .collect();
    node["status"]["allocatable"] = Value::Object(allocatable);
    node
}

/// A pod without claims whose one container `main` has these limits (the API server copies them
/// into the requests), bound to `node` and Running when one is given, else Pending.
pub fn limits_pod(namespace: &str, name: &str, limits: Value, node: Option<&str>) -> Value {
    let mut pod = pod(
        namespace,
        name,
        json!([]),
        json!({"containers": [{"name": "main", "image": "busybox",
            "resources": {"requests": limits.clone(), "limits": limits}}]}),
    );
    if let Some(node) = node {
        pod["spec"]["nodeName"] = json!(node);
        pod["status"]["phase"] = json!("Running");
    }
    pod
}

/// The claim the scheduler made for the extended resources of pod `pod` (as `limits_pod` names its
/// UID), allocated on `node`: `(request, device)` per result, class `gpu.dra.dev`.
pub fn extended_resource_claim(
    namespace: &str,
    pod: &str,
    node: &str,
    results: &[(&str, &str)],
) -> Value {
    let mut claim = allocated_claim(
        namespace,
        &format!("{pod}-extended-resources-x7k2p"),
        node,
        &[],
    );
    let mut counts: Vec<(String, usize)> = Vec::new();
    for (request, _) in results {
        match counts.iter_mut().find(|(r, _)| r == request) {
            Some((_, n)) => *n += 1,
            None => counts.push((request.to_string(), 1)),
        }
    }
    let requests: Vec<Value> = counts
        .iter()
        .map(|(request, count)| {
            json!({"name": request, "exactly": {"deviceClassName": DRIVER,
            "allocationMode": "ExactCount", "count": count}})
        })
        .collect();
    claim["spec"]["devices"]["requests"] = json!(requests);
    claim["status"]["allocation"]["devices"]["results"] = json!(results
        .iter()
        .map(|(request, device)| json!({"request": request, "driver": DRIVER, "pool": node, "device": device}))
        .collect::<Vec<_>>());
    claim["metadata"]["annotations"] =
        json!({"resource.kubernetes.io/extended-resource-claim": "true"});
    claim["metadata"]["ownerReferences"] = json!([{"apiVersion": "v1", "kind": "Pod", "name": pod,
        "uid": format!("uid-{namespace}-{pod}"), "controller": true, "blockOwnerDeletion": true}]);
    claim
}

/// A ComputeDomain of `api_version` (`gpu.dra.dev/v1alpha1` or NVIDIA's `resource.nvidia.com/v1beta1`)
/// of `num_nodes` nodes, whose channel template is `<name>-channel`; not placed yet.
pub fn compute_domain(api_version: &str, namespace: &str, name: &str, num_nodes: u32) -> Value {
    json!({
        "apiVersion": api_version, "kind": "ComputeDomain",
        "metadata": {"namespace": namespace, "name": name, "uid": format!("uid-{namespace}-{name}")},
        "spec": {"numNodes": num_nodes,
                 "channel": {"resourceClaimTemplate": {"name": format!("{name}-channel")}}}
    })
}
