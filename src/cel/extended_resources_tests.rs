use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::DeviceClass;

use super::*;

fn class(name: &str, extended_resource_name: Option<&str>) -> DeviceClass {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {"extendedResourceName": extended_resource_name},
    }))
    .unwrap()
}

fn pod(value: serde_json::Value) -> Pod {
    serde_json::from_value(value).unwrap()
}

/// A pod with a sidecar init container and two containers, the second asking for GPUs next to cpu and
/// memory, the limit only (the API server copies it into the requests).
fn training_pod() -> Pod {
    pod(serde_json::json!({
        "metadata": {"name": "train", "namespace": "ml", "uid": "pod-uid"},
        "spec": {
            "initContainers": [{"name": "fetch", "resources": {"requests": {"cpu": "1"}}}],
            "containers": [
                {"name": "log", "resources": {}},
                {"name": "main", "resources": {
                    "requests": {"cpu": "4", "memory": "8Gi"},
                    "limits": {"nvidia.com/gpu": "2", "memory": "8Gi"},
                }},
            ],
        },
    }))
}

fn mapping() -> BTreeMap<String, String> {
    class_mapping(&[
        class("gpu.dra.dev", Some("nvidia.com/gpu")),
        class("mig.gpu.dra.dev", None),
    ])
}

#[test]
fn a_class_maps_its_extended_resource_name_or_else_the_implicit_one() {
    let mapping = mapping();
    assert_eq!(mapping["nvidia.com/gpu"], "gpu.dra.dev");
    assert_eq!(
        mapping["deviceclass.resource.kubernetes.io/mig.gpu.dra.dev"],
        "mig.gpu.dra.dev"
    );
    // Not both: upstream 1.34 maps a class with an explicit name only under that name.
    assert!(!mapping.contains_key("deviceclass.resource.kubernetes.io/gpu.dra.dev"));
    assert_eq!(mapping.len(), 2);
}

#[test]
fn extended_resource_names_follow_the_api_helper() {
    for name in ["nvidia.com/gpu", "example.com/foo_bar", "a/b"] {
        assert!(is_extended_resource_name(name), "{name}");
    }
    for name in [
        "cpu",
        "memory",
        "hugepages-2Mi",
        "kubernetes.io/gpu",
        "deviceclass.resource.kubernetes.io/gpu.dra.dev",
        "requests.nvidia.com/gpu",
        "nvidia.com/-gpu",
        "Nvidia.com/gpu",
    ] {
        assert!(!is_extended_resource_name(name), "{name}");
    }
}

#[test]
fn one_request_per_container_and_resource_named_by_the_sorted_requests() {
    let pod = training_pod();
    let need = node_requests(&pod, &mapping(), &BTreeSet::new()).unwrap();
    let NodeNeed::Devices(requests) = need else {
        panic!("expected device requests, got {need:?}");
    };
    assert_eq!(requests.len(), 1);
    // Container 2 of init + containers; cpu, memory, nvidia.com/gpu sorted: the GPU is request 2.
    assert_eq!(requests[0].name, "container-2-request-2");
    let exactly = requests[0].exactly.as_ref().unwrap();
    assert_eq!(exactly.device_class_name, "gpu.dra.dev");
    assert_eq!(exactly.allocation_mode.as_deref(), Some("ExactCount"));
    assert_eq!(exactly.count, Some(2));

    let mappings = request_mappings(&pod, &["container-2-request-2".to_string()]);
    assert_eq!(mappings.len(), 1);
    assert_eq!(mappings[0].container_name, "main");
    assert_eq!(mappings[0].resource_name, "nvidia.com/gpu");
    assert_eq!(mappings[0].request_name, "container-2-request-2");
}

#[test]
fn a_node_whose_device_plugin_advertises_the_resource_needs_nothing_from_dra() {
    let advertised = BTreeSet::from(["nvidia.com/gpu".to_string()]);
    assert_eq!(
        node_requests(&training_pod(), &mapping(), &advertised),
        Ok(NodeNeed::Nothing)
    );
}

#[test]
fn a_resource_neither_advertised_nor_mapped_does_not_fit() {
    let pod = pod(serde_json::json!({
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {
            "nvidia.com/gpu": "1", "example.com/fpga": "1",
        }}}]},
    }));
    assert_eq!(
        node_requests(&pod, &mapping(), &BTreeSet::new()),
        Err("example.com/fpga".to_string())
    );
    let fpga = BTreeSet::from(["example.com/fpga".to_string()]);
    let Ok(NodeNeed::Devices(requests)) = node_requests(&pod, &mapping(), &fpga) else {
        panic!("the fpga is the device plugin's, the GPU DRA's");
    };
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].name, "container-0-request-1");
}

#[test]
fn zero_and_fractional_requests_ask_for_no_device() {
    let pod = pod(serde_json::json!({
        "metadata": {"name": "p"},
        "spec": {"containers": [
            {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "0"}}},
            {"name": "b", "resources": {"limits": {"nvidia.com/gpu": "500m"}}},
            {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
        ]},
    }));
    assert_eq!(
        mapped_resources(&pod, &mapping()),
        BTreeSet::from(["nvidia.com/gpu".to_string()])
    );
    let Ok(NodeNeed::Devices(requests)) = node_requests(&pod, &mapping(), &BTreeSet::new()) else {
        panic!("container c asks for a GPU");
    };
    let names: Vec<_> = requests.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["container-2-request-0"]);
}

#[test]
fn the_special_claim_is_annotated_and_controlled_by_the_pod() {
    let pod = training_pod();
    let claim = |annotation: Option<&str>, uid: &str, controller: bool| -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "train-extended-resources-x7k2p",
                "annotations": annotation.map(|v| serde_json::json!({CLAIM_ANNOTATION: v})),
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "train", "uid": uid,
                    "controller": controller}],
            },
            "spec": {},
        }))
        .unwrap()
    };
    assert!(is_claim_of(&claim(Some("true"), "pod-uid", true), &pod));
    assert!(!is_claim_of(&claim(None, "pod-uid", true), &pod));
    assert!(!is_claim_of(&claim(Some("false"), "pod-uid", true), &pod));
    assert!(!is_claim_of(&claim(Some("true"), "other-uid", true), &pod));
    assert!(!is_claim_of(&claim(Some("true"), "pod-uid", false), &pod));
}

#[test]
fn with_claims_of_its_own_the_pod_gets_devices_from_dra_even_where_the_device_plugin_advertises() {
    // 1.34's createDeviceRequests iterates over every mapped resource, the advertised ones included.
    let advertised = BTreeSet::from(["nvidia.com/gpu".to_string()]);
    let mut with_claim = training_pod();
    with_claim.spec.as_mut().unwrap().resource_claims = Some(vec![serde_json::from_value(
        serde_json::json!({"name": "scratch", "resourceClaimName": "scratch"}),
    )
    .unwrap()]);
    let need = node_requests(&with_claim, &mapping(), &advertised).unwrap();
    let NodeNeed::Devices(requests) = need else {
        panic!("expected device requests, got {need:?}");
    };
    let names: Vec<_> = requests.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["container-2-request-2"]);
    assert_eq!(requests[0].exactly.as_ref().unwrap().count, Some(2));
    // Without claims of its own, the device plugin's node needs nothing from DRA.
    assert_eq!(
        node_requests(&training_pod(), &mapping(), &advertised),
        Ok(NodeNeed::Nothing)
    );
}

#[test]
fn pod_requests_sum_containers_and_take_the_largest_init_container() {
    let pod = pod(serde_json::json!({
        "metadata": {"name": "p"},
        "spec": {
            "initContainers": [
                {"name": "sidecar", "restartPolicy": "Always",
                 "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                {"name": "warmup", "resources": {"limits": {"nvidia.com/gpu": "4"}}},
            ],
            "containers": [
                {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "1", "example.com/nic": "500m"}}},
                {"name": "b", "resources": {"limits": {"nvidia.com/gpu": "2"}}},
            ],
            "overhead": {"example.com/nic": "1"},
        },
    }));
    let requests = pod_requests(&pod);
    // Containers 1 + 2, plus the sidecar 1 = 4; warmup runs beside the sidecar: 4 + 1 = 5.
    assert_eq!(requests["nvidia.com/gpu"], 5);
    // 500m rounds up to 1, plus the overhead.
    assert_eq!(requests["example.com/nic"], 2);
}
