//! The fake node's GPUs as the backend reports them: the profile's GPUs with the fake hardware state
//! applied (MIG mode, MIG devices made or destroyed at run time), their NVLink peers, and the UUIDs and
//! capability files of their MIG devices, derived the same way on every read so that they stay stable.

use std::cell::OnceCell;

use super::caps::{CapsError, MigMinors};
use super::fake::{FakeBackend, FakeHardware};
use super::mig::{
    builtin_profiles_for, ComputeShare, MigInfo, MigInstance, MigPlacement, MigProfile,
    NO_COMPUTE_INSTANCE,
};
use super::profiles::{FakeGpuSpec, FakeProfile};
use super::{nvlink, Gpu, UnreadableGpu};

impl FakeBackend {
    /// The readable GPUs of the profile with the hardware state applied (MIG devices, MIG mode), and
    /// the ones marked unreadable.
    pub(super) fn gpus(
        &self,
        profile: &FakeProfile,
        hardware: &FakeHardware,
    ) -> (Vec<Gpu>, Vec<UnreadableGpu>) {
        let groups = nvlink_groups(profile);
        // Read once, and only for a GPU with MIG devices of its profile.
        let minors = OnceCell::new();
        let bus_ids: Vec<String> = profile.gpus.iter().map(|g| g.pci_bus_id.clone()).collect();
        let indices = nvml_indices(profile);
        let mut gpus = Vec::new();
        let mut unreadable = Vec::new();
        for (index, spec) in profile.gpus.iter().enumerate() {
            let minor = spec.minor.unwrap_or(index as u32);
            let uuid = self.gpu_uuid(spec, minor);
            if let Some(reason) = &spec.unreadable {
                // What NVML still tells of a GPU it cannot read: its handle's index, and often the
                // minor number, UUID and PCI address.
                unreadable.push(UnreadableGpu {
                    index: indices[index],
                    minor: Some(minor),
                    uuid: Some(uuid),
                    pci_bus_id: Some(spec.pci_bus_id.clone()),
                    reason: reason.clone(),
                });
                continue;
            }
            let nvlink_peers = match &groups[index] {
                // Links to the node's NVSwitches: NVML names no switch, only the "invalid PCI"
                // sentinel, which all switched GPUs share.
                Some(_) if spec.nvlink_group.is_none() => vec![NVSWITCH_PEER.to_string()],
                // Direct links (bridges): the peer GPUs' bus ids.
                Some(group) => (0..profile.gpus.len())
                    .filter(|&j| j != index && groups[j].as_ref() == Some(group))
                    .map(|j| bus_ids[j].clone())
                    .collect(),
                None => Vec::new(),
            };
            let mig = spec
                .mig_capable
                .then(|| builtin_profiles_for(&spec.product_name))
                .flatten()
                .map(|profiles| self.mig_info(spec, minor, &uuid, profiles, hardware, &minors))
                .transpose();
            // As on the NVML backend: a GPU whose MIG devices' files cannot be found is not read.
            let mig = match mig {
                Ok(mig) => mig,
                Err(reason) => {
                    unreadable.push(UnreadableGpu {
                        index: indices[index],
                        minor: Some(minor),
                        uuid: Some(uuid),
                        pci_bus_id: Some(spec.pci_bus_id.clone()),
                        reason,
                    });
                    continue;
                }
            };
            gpus.push(Gpu {
                minor,
                index: indices[index],
                uuid,
                product_name: spec.product_name.clone(),
                brand: spec.brand.clone(),
                architecture: spec.architecture.clone(),
                cuda_compute_capability: spec.cuda_compute_capability.clone(),
                memory_bytes: spec.memory_bytes,
                pci_bus_id: spec.pci_bus_id.clone(),
                pcie_root: spec.pcie_root.clone(),
                numa_node: spec.numa_node,
                nvlink_domain: None,
                fabric: spec.fabric.as_ref().map(|f| nvlink::FabricInfo {
                    cluster_uuid: f.cluster_uuid.clone(),
                    clique_id: f.clique_id,
                }),
                nvlink_peers,
                mig,
                addressing_mode: spec.addressing_mode.clone(),
                module_id: spec.module_id,
            });
        }
        nvlink::assign_domains(&mut gpus);
        (gpus, unreadable)
    }

    fn mig_info(
        &self,
        spec: &FakeGpuSpec,
        minor: u32,
        uuid: &str,
        profiles: Vec<MigProfile>,
        hardware: &FakeHardware,
        minors: &OnceCell<Result<MigMinors, CapsError>>,
    ) -> Result<MigInfo, String> {
        let mut instances: Vec<MigInstance> = Vec::new();
        for wanted in &spec.mig_instances {
            let Some(profile) = profiles.iter().find(|p| p.name == wanted.profile) else {
                continue;
            };
            let Some(placement) = profile.placements.iter().find(|p| p.start == wanted.start)
            else {
                continue;
            };
            let gpu_instance_id = gpu_instance_id(*placement);
            if hardware
                .destroyed
                .contains(&(uuid.to_string(), gpu_instance_id))
            {
                continue;
            }
            instances.extend(self.profile_instances(
                minor,
                profile,
                *placement,
                wanted.compute_instances.as_deref(),
                minors,
            )?);
        }
        instances.extend(hardware.created.get(uuid).cloned().unwrap_or_default());
        instances.sort_by_key(|i| (i.placement, i.compute_instance_id));
        number_mig_devices(&mut instances);
        Ok(MigInfo {
            enabled: spec.mig_enabled || hardware.mig_enabled.contains(uuid),
            toggles_without_reset: toggles_without_reset(&spec.architecture),
            memory_slices: 8,
            compute_slices: 7,
            profiles,
            instances,
            disable_failed: hardware.disable_failed.get(uuid).cloned(),
        })
    }

    /// The MIG devices of one GPU instance an admin made: one per compute instance, or one without
    /// compute instance (`[]`). A single compute instance spanning the GPU instance keeps the UUID
    /// derivation of earlier versions, so UUIDs stay the same across upgrades.
    fn profile_instances(
        &self,
        minor: u32,
        profile: &MigProfile,
        placement: MigPlacement,
        compute_instances: Option<&[u32]>,
        minors: &OnceCell<Result<MigMinors, CapsError>>,
    ) -> Result<Vec<MigInstance>, String> {
        let gpu_instance_id = gpu_instance_id(placement);
        let base = |uuid: String, ci: u32, files: Vec<String>, compute| MigInstance {
            uuid,
            profile_id: profile.id,
            placement,
            gpu_instance_id,
            compute_instance_id: ci,
            device_files: files,
            compute,
            index: None,
        };
        let files = |ci| {
            let table = minors.get_or_init(|| self.proc.mig_minors());
            device_files(table, minor, gpu_instance_id, ci)
        };
        let whole = format!("mig/{minor}/{}", placement.start);
        Ok(match compute_instances {
            None => vec![base(
                format!("MIG-{}", self.derived_uuid(&whole)),
                0,
                files(0)?,
                None,
            )],
            Some([]) => vec![base(String::new(), NO_COMPUTE_INSTANCE, Vec::new(), None)],
            Some([only]) if *only == profile.compute_slices => vec![base(
                format!("MIG-{}", self.derived_uuid(&whole)),
                0,
                files(0)?,
                None,
            )],
            Some(list) => list
                .iter()
                .enumerate()
                .map(|(ci, &slices)| {
                    let ci = ci as u32;
                    Ok(base(
                        format!("MIG-{}", self.derived_uuid(&format!("{whole}/ci{ci}"))),
                        ci,
                        files(ci)?,
                        Some(ComputeShare {
                            slices,
                            multiprocessors: profile.multiprocessors * slices
                                / profile.compute_slices.max(1),
                        }),
                    ))
                })
                .collect::<Result<_, String>>()?,
        })
    }
}

/// GPU instance ids as the fake hands them out: one per start slice, so they are unique on a GPU.
pub(super) fn gpu_instance_id(placement: MigPlacement) -> u32 {
    placement.start + 1
}

/// The capability files of a fake MIG device, from the fake node's MIG table as NVML's backend takes
/// them from the real one's.
pub(super) fn device_files(
    minors: &Result<MigMinors, CapsError>,
    gpu_minor: u32,
    gpu_instance: u32,
    compute_instance: u32,
) -> Result<Vec<String>, String> {
    let table = minors.as_ref().map_err(|e| e.to_string())?;
    table
        .device_files(gpu_minor, gpu_instance, compute_instance)
        .map_err(|e| e.to_string())
}

fn toggles_without_reset(architecture: &str) -> bool {
    !matches!(architecture, "Ampere")
}

/// What NVML reports as the remote end of a link to an NVSwitch: the switch is not PCI-enumerable from
/// the GPU, so `nvmlDeviceGetNvLinkRemotePciInfo` fills every field with ones (`FFFFFFFF:FF:FF.0`), as
/// NVIDIA's mock NVML models HGX and GB200 baseboards; in sysfs form, as the inventory keeps peers.
const NVSWITCH_PEER: &str = "ffffffff:ff:ff.0";

/// Each GPU's NVLink group: its own group name, `all` for `nvlink: true` (the NVSwitches), none
/// otherwise.
fn nvlink_groups(profile: &FakeProfile) -> Vec<Option<String>> {
    profile
        .gpus
        .iter()
        .map(|g| {
            g.nvlink_group
                .clone()
                .or_else(|| g.nvlink.then(|| "all".to_string()))
        })
        .collect()
}

/// NVML's index of each of the profile's GPUs: the one the profile sets, else the GPU's rank in PCI
/// bus id order (domain, bus, device, function), which is how NVML numbers GPUs.
fn nvml_indices(profile: &FakeProfile) -> Vec<u32> {
    let mut by_bus: Vec<usize> = (0..profile.gpus.len()).collect();
    by_bus.sort_by_key(|&i| profile.gpus[i].pci_bus_id.to_ascii_lowercase());
    let mut indices = vec![0; profile.gpus.len()];
    for (rank, i) in by_bus.into_iter().enumerate() {
        indices[i] = profile.gpus[i].index.unwrap_or(rank as u32);
    }
    indices
}

/// NVML's MIG device indices as the fake hands them out: the MIG devices (compute instances) of a GPU
/// in GPU instance id, then compute instance id order.
fn number_mig_devices(instances: &mut [MigInstance]) {
    let mut order: Vec<usize> = (0..instances.len())
        .filter(|&i| instances[i].has_compute_instance())
        .collect();
    order.sort_by_key(|&i| {
        (
            instances[i].gpu_instance_id,
            instances[i].compute_instance_id,
        )
    });
    for (index, i) in order.into_iter().enumerate() {
        instances[i].index = Some(index as u32);
    }
}
