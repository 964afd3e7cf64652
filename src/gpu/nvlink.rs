//! NVLink domains: which GPUs share NVLink, so that multi-GPU claims can ask for GPUs on one domain with
//! `matchAttribute: gpu.dra.dev/nvlinkDomain`. Where the GPU joined an NVLink fabric (NVSwitch
//! systems with Fabric Manager), the domain is the fabric's cluster UUID and clique id, equal across
//! nodes of one NVLink domain; otherwise it is the set of GPUs connected by NVLink on this node.

use std::collections::{BTreeMap, BTreeSet};

use super::Gpu;

/// Names the GPUs of one node-local NVLink island; hashed from their UUIDs so the value is stable and
/// fits the 64-character attribute limit however many GPUs there are.
const NVLINK_DOMAIN_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x3f0e_77a2_5b1c_4d8e_a6f9_0c2d_4e6b_8a10);

/// What NVML's fabric info says about a GPU whose fabric registration completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricInfo {
    /// The NVLink domain's cluster UUID, e.g. `0b5c7f1e-...`.
    pub cluster_uuid: String,
    /// The clique within the cluster.
    pub clique_id: u32,
}

impl FabricInfo {
    /// `<clusterUuid>.<cliqueId>`, the same form NVIDIA's tools print.
    pub fn domain(&self) -> String {
        format!("{}.{}", self.cluster_uuid, self.clique_id)
    }
}

/// Sets `nvlink_domain` on every GPU: the fabric domain where there is one, else the connected
/// component of the NVLink graph on this node, in which GPUs are linked directly or through a shared
/// NVSwitch (a peer that is not one of the node's GPUs). GPUs with no active link get `None`.
pub fn assign_domains(gpus: &mut [Gpu]) {
    // Union-find over the GPUs and every other device their links reach.
    let mut index: BTreeMap<String, usize> = BTreeMap::new();
    for gpu in gpus.iter() {
        let next = index.len();
        index
            .entry(normalize_bus_id(&gpu.pci_bus_id))
            .or_insert(next);
    }
    let mut links: Vec<(usize, usize)> = Vec::new();
    for gpu in gpus.iter() {
        let own = index[&normalize_bus_id(&gpu.pci_bus_id)];
        for peer in &gpu.nvlink_peers {
            let next = index.len();
            let other = *index.entry(normalize_bus_id(peer)).or_insert(next);
            links.push((own, other));
        }
    }
    let mut parent: Vec<usize> = (0..index.len()).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    for (a, b) in links {
        let (a, b) = (root(&mut parent, a), root(&mut parent, b));
        parent[a.max(b)] = a.min(b);
    }
    let roots: Vec<usize> = gpus
        .iter()
        .map(|gpu| root(&mut parent, index[&normalize_bus_id(&gpu.pci_bus_id)]))
        .collect();
    let mut members: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for (gpu, r) in gpus.iter().zip(&roots) {
        members.entry(*r).or_default().insert(gpu.uuid.clone());
    }
    for (gpu, r) in gpus.iter_mut().zip(&roots) {
        gpu.nvlink_domain = if let Some(fabric) = &gpu.fabric {
            Some(fabric.domain())
        } else if gpu.nvlink_peers.is_empty() {
            None
        } else {
            let uuids: Vec<String> = members[r].iter().cloned().collect();
            Some(
                uuid::Uuid::new_v5(&NVLINK_DOMAIN_NAMESPACE, uuids.join(",").as_bytes())
                    .to_string(),
            )
        };
    }
}

/// PCI bus ids come as `00000000:18:00.0` from NVML and `0000:18:00.0` from sysfs; compare them in the
/// sysfs form: lowercase, the domain without the extra leading zeros (VMD domains keep five digits).
pub fn normalize_bus_id(bus_id: &str) -> String {
    let lower = bus_id.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            let significant = domain.trim_start_matches('0');
            format!("{significant:0>4}:{rest}")
        }
        _ => lower,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(bus: &str, peers: &[&str]) -> Gpu {
        Gpu {
            minor: 0,
            index: 0,
            uuid: format!("GPU-{bus}"),
            product_name: "x".into(),
            brand: "Nvidia".into(),
            architecture: "Hopper".into(),
            cuda_compute_capability: "9.0".into(),
            memory_bytes: 1,
            pci_bus_id: bus.into(),
            pcie_root: None,
            numa_node: None,
            nvlink_domain: None,
            fabric: None,
            nvlink_peers: peers.iter().map(|p| p.to_string()).collect(),
            mig: None,
            addressing_mode: None,
            module_id: None,
        }
    }

    #[test]
    fn connected_gpus_share_a_domain_and_islands_differ() {
        let mut gpus = vec![
            gpu("0000:01:00.0", &["00000000:02:00.0"]),
            gpu("0000:02:00.0", &["0000:01:00.0"]),
            gpu("0000:03:00.0", &["0000:04:00.0"]),
            gpu("0000:04:00.0", &["0000:03:00.0"]),
            gpu("0000:05:00.0", &[]),
        ];
        assign_domains(&mut gpus);
        let d: Vec<_> = gpus.iter().map(|g| g.nvlink_domain.clone()).collect();
        assert!(d[0].is_some());
        assert_eq!(d[0], d[1]);
        assert_eq!(d[2], d[3]);
        assert_ne!(d[0], d[2]);
        assert_eq!(d[4], None);
        assert!(d[0].as_ref().unwrap().len() <= 64);
    }

    #[test]
    fn gpus_on_one_nvswitch_share_a_domain() {
        // NVSwitch systems: every GPU's links end on the switches, never on another GPU.
        let mut gpus = vec![
            gpu("0000:01:00.0", &["0000:99:00.0", "0000:9a:00.0"]),
            gpu("0000:02:00.0", &["0000:9a:00.0"]),
            gpu("0000:03:00.0", &["0000:77:00.0"]),
        ];
        assign_domains(&mut gpus);
        assert!(gpus[0].nvlink_domain.is_some());
        assert_eq!(gpus[0].nvlink_domain, gpus[1].nvlink_domain);
        assert_ne!(gpus[0].nvlink_domain, gpus[2].nvlink_domain);
    }

    #[test]
    fn fabric_info_wins_over_local_links() {
        let mut gpus = vec![
            gpu("0000:01:00.0", &["0000:02:00.0"]),
            gpu("0000:02:00.0", &["0000:01:00.0"]),
        ];
        gpus[0].fabric = Some(FabricInfo {
            cluster_uuid: "0b5c7f1e-0000-4000-8000-000000000001".into(),
            clique_id: 7,
        });
        assign_domains(&mut gpus);
        assert_eq!(
            gpus[0].nvlink_domain.as_deref(),
            Some("0b5c7f1e-0000-4000-8000-000000000001.7")
        );
        assert_ne!(gpus[1].nvlink_domain, gpus[0].nvlink_domain);
    }

    #[test]
    fn bus_ids_normalize() {
        assert_eq!(normalize_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bus_id("0000:3b:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bus_id("00010000:01:00.0"), "10000:01:00.0");
    }
}
