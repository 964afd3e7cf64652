//! The allocator's own tests, on gpu-dra's shapes of devices (whole GPUs with an NVLink domain, MIG
//! partitions that share counters): the fixtures here, the cases by what they exercise in the modules
//! below. Upstream's cases are in `upstream_cases`.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    DeviceRequestAllocationResult, ResourceClaimSpec, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{json, Value};

use super::{allocate, AllocationError, Candidate, InUse, Node, Pools};

mod constraints;
mod counters;
mod pools;
mod requests;
mod selection;

const DRIVER: &str = "gpu.dra.dev";
const NODE: &str = "node-a";

fn slice(name: &str, pool: &str, generation: i64, count: i64, spec: Value) -> ResourceSlice {
    let mut spec = spec;
    spec["driver"] = json!(DRIVER);
    spec["pool"] = json!({"name": pool, "generation": generation, "resourceSliceCount": count});
    if spec.get("nodeName").is_none() {
        spec["nodeName"] = json!(NODE);
    }
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        spec: serde_json::from_value(spec).expect("valid ResourceSliceSpec"),
    }
}

/// A whole GPU with an index and an NVLink domain.
fn gpu(index: i64, domain: &str) -> Value {
    json!({
        "name": format!("gpu-{index}"),
        "attributes": {
            "type": {"string": "gpu"},
            "index": {"int": index},
            "nvlinkDomain": {"string": domain},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    })
}

fn gpus(domains: &[&str]) -> Vec<Value> {
    domains
        .iter()
        .enumerate()
        .map(|(i, domain)| gpu(i as i64, domain))
        .collect()
}

fn classes() -> BTreeMap<String, Vec<String>> {
    BTreeMap::from([
        (
            "gpu.dra.dev".to_string(),
            vec![format!(r#"device.driver == "{DRIVER}""#)],
        ),
        (
            "gpu".to_string(),
            vec![
                format!(r#"device.driver == "{DRIVER}""#),
                r#"device.attributes["gpu.dra.dev"].type == "gpu""#.to_string(),
            ],
        ),
        (
            "mig".to_string(),
            vec![
                format!(r#"device.driver == "{DRIVER}""#),
                r#"device.attributes["gpu.dra.dev"].type == "mig""#.to_string(),
            ],
        ),
    ])
}

fn claim(devices: Value) -> ResourceClaimSpec {
    serde_json::from_value(json!({ "devices": devices })).expect("valid ResourceClaimSpec")
}

/// A claim with one `exactly` request.
fn exactly(name: &str, class: &str, more: Value) -> Value {
    let mut exactly = json!({ "deviceClassName": class });
    if let (Some(target), Value::Object(fields)) = (exactly.as_object_mut(), more) {
        target.extend(fields);
    }
    json!({ "name": name, "exactly": exactly })
}

fn used(names: &[&str]) -> InUse {
    let devices: BTreeSet<Candidate> = names
        .iter()
        .map(|name| Candidate {
            driver: DRIVER.into(),
            pool: NODE.into(),
            device: name.to_string(),
        })
        .collect();
    InUse::from(devices)
}

/// (request, device) of each result.
fn picks(results: &[DeviceRequestAllocationResult]) -> Vec<(String, String)> {
    results
        .iter()
        .map(|r| (r.request.clone(), r.device.clone()))
        .collect()
}

fn devices_of(results: &[DeviceRequestAllocationResult]) -> Vec<String> {
    results.iter().map(|r| r.device.clone()).collect()
}

fn run(
    slices: &[ResourceSlice],
    in_use: &InUse,
    devices: Value,
) -> Result<Vec<DeviceRequestAllocationResult>, AllocationError> {
    let pools = Pools::from_slices(slices, Some(&Node::named(NODE)));
    allocate(&pools, &classes(), in_use, &claim(devices))
}

fn one_slice(devices: Vec<Value>) -> Vec<ResourceSlice> {
    vec![slice(
        "node-a-gpu",
        NODE,
        1,
        1,
        json!({ "devices": devices }),
    )]
}

/// GPU 0 partitionable into MIG devices: the whole GPU takes all 8 memory slices, each 1g device one,
/// the 2g device slices 0 and 1. `split` puts the counter set into a slice of its own (1.35+);
/// otherwise it sits beside the devices (1.34).
fn partitioned(split: bool) -> Vec<ResourceSlice> {
    let all_slices: BTreeMap<String, Value> = (0..8)
        .map(|i| (format!("memory-slice-{i}"), json!({"value": "1"})))
        .collect();
    let mig = |name: &str, profile: &str, memory: &[u32]| {
        let counters: BTreeMap<String, Value> = memory
            .iter()
            .map(|i| (format!("memory-slice-{i}"), json!({"value": "1"})))
            .collect();
        json!({
            "name": name,
            "attributes": {"type": {"string": "mig"}, "profile": {"string": profile}},
            "consumesCounters": [{"counterSet": "gpu-0-counters", "counters": counters}],
        })
    };
    let mut whole = gpu(0, "A");
    whole["consumesCounters"] =
        json!([{"counterSet": "gpu-0-counters", "counters": all_slices.clone()}]);
    let devices = json!([
        whole,
        mig("gpu-0-mig-1g-0", "1g.10gb", &[0]),
        mig("gpu-0-mig-1g-1", "1g.10gb", &[1]),
        mig("gpu-0-mig-2g-0", "2g.20gb", &[0, 1]),
    ]);
    let counters = json!([{"name": "gpu-0-counters", "counters": all_slices}]);
    if split {
        vec![
            slice(
                "node-a-counters",
                NODE,
                1,
                2,
                json!({"sharedCounters": counters}),
            ),
            slice("node-a-devices", NODE, 1, 2, json!({"devices": devices})),
        ]
    } else {
        vec![slice(
            "node-a-gpu",
            NODE,
            1,
            1,
            json!({"devices": devices, "sharedCounters": counters}),
        )]
    }
}

fn mig_request(name: &str, profile: &str) -> Value {
    exactly(
        name,
        "mig",
        json!({"selectors": [{"cel": {"expression": format!(r#"device.attributes["gpu.dra.dev"].profile == "{profile}""#)}}]}),
    )
}
