//! The fake GPU backend: a node described by a built-in profile or a YAML file. The file is read again
//! on every inventory call, so editing it changes what the plugin publishes without a restart.

use std::path::PathBuf;

use super::profiles::{builtin_profile, builtin_profile_names, FakeProfile};
use super::{Gpu, GpuBackend, GpuError, Inventory};

/// The namespace of the name-based UUIDs the fake backend derives, so they are stable per node.
const FAKE_UUID_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6a1d_5f0e_8f4c_4b7e_9d7e_2f1a_0c3b_5e41);

#[derive(Debug, Clone)]
enum ProfileSource {
    Builtin(FakeProfile),
    File(PathBuf),
}

#[derive(Debug, Clone)]
pub struct FakeBackend {
    node_name: String,
    source: ProfileSource,
}

impl FakeBackend {
    /// `profile` is a built-in profile name or the path of a YAML profile file. A file is checked now,
    /// so a typo fails at start rather than at the first rescan.
    pub fn new(node_name: &str, profile: &str) -> Result<Self, GpuError> {
        let source = match builtin_profile(profile) {
            Some(builtin) => ProfileSource::Builtin(builtin),
            None if looks_like_path(profile) => ProfileSource::File(PathBuf::from(profile)),
            None => {
                return Err(GpuError::UnknownProfile(
                    profile.to_string(),
                    builtin_profile_names().join(", "),
                ))
            }
        };
        let backend = FakeBackend {
            node_name: node_name.to_string(),
            source,
        };
        backend.inventory()?;
        Ok(backend)
    }

    fn profile(&self) -> Result<FakeProfile, GpuError> {
        match &self.source {
            ProfileSource::Builtin(profile) => Ok(profile.clone()),
            ProfileSource::File(path) => {
                let shown = path.display().to_string();
                let text =
                    std::fs::read_to_string(path).map_err(|source| GpuError::ReadProfile {
                        path: shown.clone(),
                        source,
                    })?;
                let profile: FakeProfile =
                    serde_yaml::from_str(&text).map_err(|e| GpuError::MalformedProfile {
                        path: shown.clone(),
                        message: e.to_string(),
                    })?;
                check_profile(&profile).map_err(|message| GpuError::MalformedProfile {
                    path: shown,
                    message,
                })?;
                Ok(profile)
            }
        }
    }

    fn derived_uuid(&self, what: &str) -> uuid::Uuid {
        uuid::Uuid::new_v5(
            &FAKE_UUID_NAMESPACE,
            format!("{}/{what}", self.node_name).as_bytes(),
        )
    }
}

impl GpuBackend for FakeBackend {
    fn name(&self) -> &str {
        "fake"
    }

    fn inventory(&self) -> Result<Inventory, GpuError> {
        let profile = self.profile()?;
        let nvlink_domain = self.derived_uuid("nvlink-domain").to_string();
        let gpus = profile
            .gpus
            .iter()
            .enumerate()
            .map(|(index, spec)| {
                let minor = spec.minor.unwrap_or(index as u32);
                Gpu {
                    minor,
                    uuid: spec.uuid.clone().unwrap_or_else(|| {
                        format!("GPU-{}", self.derived_uuid(&format!("gpu/{minor}")))
                    }),
                    product_name: spec.product_name.clone(),
                    brand: spec.brand.clone(),
                    architecture: spec.architecture.clone(),
                    cuda_compute_capability: spec.cuda_compute_capability.clone(),
                    memory_bytes: spec.memory_bytes,
                    pci_bus_id: spec.pci_bus_id.clone(),
                    pcie_root: spec.pcie_root.clone(),
                    numa_node: spec.numa_node,
                    nvlink_domain: spec.nvlink.then(|| nvlink_domain.clone()),
                    mig_capable: spec.mig_capable,
                }
            })
            .collect();
        Ok(Inventory {
            driver_version: profile.driver_version,
            cuda_driver_version: profile.cuda_driver_version,
            gpus,
            control_device_files: vec![
                "/dev/nvidiactl".to_string(),
                "/dev/nvidia-uvm".to_string(),
                "/dev/nvidia-uvm-tools".to_string(),
            ],
            stand_in_device_file: Some("/dev/null".to_string()),
        })
    }
}

fn looks_like_path(profile: &str) -> bool {
    profile.contains('/') || profile.ends_with(".yaml") || profile.ends_with(".yml")
}

/// Rejects profiles that would make devices the API server refuses or that collide on the node.
fn check_profile(profile: &FakeProfile) -> Result<(), String> {
    let mut minors = std::collections::BTreeSet::new();
    for (index, gpu) in profile.gpus.iter().enumerate() {
        let minor = gpu.minor.unwrap_or(index as u32);
        if !minors.insert(minor) {
            return Err(format!("gpus[{index}]: minor {minor} is used twice"));
        }
        if gpu.product_name.is_empty() || gpu.product_name.len() > 64 {
            return Err(format!(
                "gpus[{index}].productName must be 1 to 64 characters"
            ));
        }
        if gpu.memory_bytes == 0 {
            return Err(format!("gpus[{index}].memoryBytes must be positive"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profiles_look_like_real_nodes() {
        let node = FakeBackend::new("node-a", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        assert_eq!(node.gpus.len(), 8);
        assert!(node
            .gpus
            .iter()
            .all(|g| g.product_name == "NVIDIA H100 80GB HBM3"));
        assert!(node.gpus.iter().all(|g| g.mig_capable));
        let domains: std::collections::BTreeSet<_> =
            node.gpus.iter().map(|g| g.nvlink_domain.clone()).collect();
        assert_eq!(domains.len(), 1, "one NVLink domain on a DGX");
        assert!(domains.iter().all(Option::is_some));
        let l40s = FakeBackend::new("node-a", "l40s-4")
            .unwrap()
            .inventory()
            .unwrap();
        assert_eq!(l40s.gpus.len(), 4);
        assert!(l40s
            .gpus
            .iter()
            .all(|g| g.nvlink_domain.is_none() && !g.mig_capable));
        assert_eq!(
            FakeBackend::new("n", "dgx-a100")
                .unwrap()
                .inventory()
                .unwrap()
                .gpus
                .len(),
            8
        );
    }

    #[test]
    fn uuids_are_stable_per_node_and_differ_between_nodes() {
        let a1 = FakeBackend::new("node-a", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        let a2 = FakeBackend::new("node-a", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        let b = FakeBackend::new("node-b", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        assert_eq!(a1, a2);
        assert_ne!(a1.gpus[0].uuid, b.gpus[0].uuid);
        let uuids: std::collections::BTreeSet<_> = a1.gpus.iter().map(|g| &g.uuid).collect();
        assert_eq!(uuids.len(), 8);
        assert!(a1.gpus[0].uuid.starts_with("GPU-"));
    }

    #[test]
    fn unknown_profile_names_the_builtins() {
        let err = FakeBackend::new("n", "dgx-h200").unwrap_err().to_string();
        assert!(
            err.contains("dgx-h200") && err.contains("dgx-h100"),
            "{err}"
        );
    }

    #[test]
    fn yaml_profile_is_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.yaml");
        let mut profile = builtin_profile("l40s-4").unwrap();
        profile.gpus.truncate(2);
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let backend = FakeBackend::new("n", path.to_str().unwrap()).unwrap();
        assert_eq!(backend.inventory().unwrap().gpus.len(), 2);

        // Edits are picked up by the next inventory call.
        profile.gpus.truncate(1);
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        assert_eq!(backend.inventory().unwrap().gpus.len(), 1);

        std::fs::write(&path, "name: x\ngpus: [{productName: 1}]\n").unwrap();
        let err = backend.inventory().unwrap_err().to_string();
        assert!(
            err.contains("malformed") && err.contains("node.yaml"),
            "{err}"
        );

        profile.gpus.push(profile.gpus[0].clone());
        profile.gpus[1].minor = Some(0);
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let err = backend.inventory().unwrap_err().to_string();
        assert!(err.contains("minor 0 is used twice"), "{err}");
    }
}
