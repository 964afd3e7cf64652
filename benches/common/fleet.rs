//! A cluster of 8-GPU H100 nodes as API objects, built from the slices gpu-dra publishes for the fake
//! `dgx-h100` profile, renamed per node: nodes of whole GPUs, nodes with static MIG (4 GPUs each cut
//! into 3g.40gb + 2g.20gb + 2× 1g.10gb, 4 whole GPUs left) and nodes with dynamic MIG (every profile at
//! every placement: 26 devices per GPU). About half the whole GPUs and some MIG devices are held by
//! claims; every 50th node has a GPU with an XID 79 taint, every 100th a node taint, every 200th is
//! cordoned. Used by the explain and scale benchmarks.

use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::Value;

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::builtin_profile;
use gpu_dra::support::cluster as fixture;

/// How many nodes of each kind.
#[derive(Clone, Copy)]
pub struct Shape {
    pub whole: usize,
    pub static_mig: usize,
    pub dynamic_mig: usize,
}

impl Shape {
    pub fn nodes(&self) -> usize {
        self.whole + self.static_mig + self.dynamic_mig
    }
}

/// One node of the fleet.
pub struct FleetNode {
    /// `whole-0000`, `static-mig-0700`, `dynamic-mig-0950`: the kind, then the node's index.
    pub name: String,
    /// The devices its pool publishes.
    pub devices: usize,
    /// The devices a claim holds.
    pub held: Vec<String>,
}

pub struct Fleet {
    /// DeviceClasses, then per node its slices, the claim holding its devices (if any) and the Node.
    pub items: Vec<Value>,
    pub nodes: Vec<FleetNode>,
    pub gpus: usize,
    pub devices: usize,
}

impl Fleet {
    pub fn node(&self, name: &str) -> &FleetNode {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .expect("a node of the fleet")
    }

    /// Only the ResourceSlices, as `kubectl get resourceslices -o yaml` would list them.
    pub fn slices(&self) -> Vec<Value> {
        self.items
            .iter()
            .filter(|item| item["kind"] == "ResourceSlice")
            .cloned()
            .collect()
    }
}

pub fn fleet(shape: Shape) -> Fleet {
    let h100 = builtin_profile("dgx-h100").expect("built-in profile");
    let cut = [
        ("3g.40gb", 4),
        ("2g.20gb", 0),
        ("1g.10gb", 2),
        ("1g.10gb", 3),
    ];
    let kinds: [(&str, Vec<ResourceSlice>, usize); 3] = [
        (
            "whole",
            fixture::node_slices("t", &h100, MigMode::None),
            shape.whole,
        ),
        (
            "static-mig",
            fixture::node_slices(
                "t",
                &fixture::static_mig("dgx-h100", &[0, 1, 2, 3], &cut),
                MigMode::Static,
            ),
            shape.static_mig,
        ),
        (
            "dynamic-mig",
            fixture::node_slices("t", &h100, MigMode::Dynamic),
            shape.dynamic_mig,
        ),
    ];
    let mut fleet = Fleet {
        items: fixture::device_classes(),
        nodes: Vec::new(),
        gpus: 0,
        devices: 0,
    };
    let mut index = 0;
    for (kind, template, count) in &kinds {
        let names: Vec<String> = template
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| d.name.clone())
            .collect();
        for _ in 0..*count {
            let node = format!("{kind}-{index:04}");
            let mut slices = fixture::renamed(template, "t", &node);
            if index % 50 == 7 {
                fixture::taint(
                    &mut slices,
                    &["gpu-7"],
                    "gpu.dra.dev/xid",
                    "79",
                    "NoExecute",
                );
            }
            fleet.devices += names.len();
            fleet.gpus += 8;
            fleet.items.extend(
                slices
                    .iter()
                    .map(|s| serde_json::to_value(s).expect("slice")),
            );
            let held: Vec<&str> = match *kind {
                // 0 to 8 whole GPUs held: about half of them.
                "whole" => names.iter().take(index % 9).map(String::as_str).collect(),
                // The 3g.40gb devices of the cut GPUs, on every other node.
                "static-mig" if index % 2 == 0 => names
                    .iter()
                    .filter(|n| n.contains("-mig-3g40gb"))
                    .map(String::as_str)
                    .collect(),
                "dynamic-mig" => names
                    .iter()
                    .filter(|n| n.ends_with("-mig-1g10gb-0"))
                    .take(index % 4)
                    .map(String::as_str)
                    .collect(),
                _ => Vec::new(),
            };
            if !held.is_empty() {
                fleet.items.push(fixture::allocated_claim(
                    "team",
                    &format!("job-{index}"),
                    &node,
                    &held,
                ));
            }
            let taints: &[&str] = if index % 100 == 3 {
                &["dedicated=inference:NoSchedule"]
            } else {
                &[]
            };
            let zone = format!("zone-{}", index % 4);
            fleet.items.push(fixture::node(
                &node,
                &[("gpu", "h100"), ("zone", &zone), ("mig", kind)],
                taints,
                index % 200 == 5,
            ));
            fleet.nodes.push(FleetNode {
                name: node,
                devices: names.len(),
                held: held.iter().map(|d| d.to_string()).collect(),
            });
            index += 1;
        }
    }
    fleet
}
