//! MIG devices of claims: which physical MIG device a MIG device name means; creating it at the
//! allocated placement (dynamic MIG; a retry after a cancelled prepare adopts the device the first try
//! made) or finding the one an admin made (static MIG, down to the compute instance); destroying what
//! a claim created, never a device that has since become someone else's; reporting the created
//! device's UUID in the claim's status. Which created devices are the plugin's, and the start-up
//! sweep: `mig_records.rs`.

use std::sync::Arc;

use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kube::api::{Api, PostParams};
use tracing::{debug, info, warn};

use super::checkpoint::PreparedMig;
use super::gpu_modes::{GpuOp, GpuOpError, GpuOps};
use super::{ClaimRef, PreparedDevice, Preparer};
use crate::devices::{DeviceName, MigMode};
use crate::gpu::{
    Gpu, GpuBackend, Inventory, MigDestroyed, MigInstance, MigPlacement, MigProfile, MigRequest,
};

/// What a MIG device name means on this node now.
#[derive(Debug, Clone)]
pub(super) struct MigTarget {
    pub gpu: Gpu,
    pub profile: MigProfile,
    pub placement: MigPlacement,
    /// The MIG device that exists at that placement with that profile (and, for one of several
    /// compute instances, that compute instance), if any.
    pub existing: Option<MigInstance>,
    /// Set when the name means one of several compute instances of the GPU instance.
    pub compute_instance: Option<u32>,
}

/// Resolves a device name against the inventory: `Ok(None)` for a whole GPU that exists, the MIG
/// target for a MIG device, or why the node has no such device.
pub(super) fn resolve(inventory: &Inventory, device: &str) -> Result<Option<MigTarget>, String> {
    if crate::domains::channels::parse_device_name(device).is_some() {
        // An IMEX channel: published only where the node is in an NVLink clique.
        return crate::domains::channels::node_clique(inventory).map(|_| None);
    }
    if super::vfio::is_vfio(device) {
        return crate::devices::passthrough::find(inventory, device)
            .map(|_| None)
            .ok_or_else(|| "the node has no such passthrough GPU on its PCI bus".to_string());
    }
    let name = DeviceName::parse(device).ok_or("not a device name this driver publishes")?;
    let gpu = inventory
        .gpus
        .iter()
        .find(|gpu| gpu.minor == name.minor())
        .ok_or_else(|| format!("the node has no GPU with minor number {}", name.minor()))?;
    let DeviceName::Mig {
        profile,
        start,
        compute_instance,
        ..
    } = &name
    else {
        return Ok(None);
    };
    let mig = gpu.mig.as_ref().ok_or("the GPU does not support MIG")?;
    let profile = mig
        .profile_by_dns_name(profile)
        .ok_or_else(|| format!("the GPU has no MIG profile {profile}"))?;
    let placement = *profile
        .placements
        .iter()
        .find(|p| p.start == *start)
        .ok_or_else(|| format!("profile {} has no placement at {start}", profile.name))?;
    let existing = mig
        .instances
        .iter()
        .filter(|i| i.profile_id == profile.id && i.placement == placement)
        .filter(|i| i.has_compute_instance())
        .find(|i| match compute_instance {
            Some(ci) => i.compute.is_some() && i.compute_instance_id == *ci,
            None => i.compute.is_none(),
        })
        .cloned();
    Ok(Some(MigTarget {
        gpu: gpu.clone(),
        profile: profile.clone(),
        placement,
        existing,
        compute_instance: *compute_instance,
    }))
}

/// Whether two devices cannot be used at the same time: the same device, a whole GPU and a MIG device
/// on it, or two MIG devices of one GPU whose memory slices overlap, unless they are different compute
/// instances of one GPU instance (made to be shared that way).
pub(super) fn conflict(inventory: &Inventory, a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    if let Some(overlap) = super::vfio::conflict(inventory, a, b) {
        return overlap;
    }
    type Footprint = (u32, Option<(MigPlacement, Option<u32>)>);
    let footprint = |device: &str| -> Option<Footprint> {
        let name = DeviceName::parse(device)?;
        let placement = match resolve(inventory, device) {
            Ok(target) => target.map(|t| (t.placement, t.compute_instance)),
            Err(_) => return Some((name.minor(), None)),
        };
        Some((name.minor(), placement))
    };
    match (footprint(a), footprint(b)) {
        (Some((gpu_a, place_a)), Some((gpu_b, place_b))) if gpu_a == gpu_b => {
            match (place_a, place_b) {
                (Some((x, Some(ci_x))), Some((y, Some(ci_y)))) if x == y => ci_x == ci_y,
                (Some((x, _)), Some((y, _))) => x.overlaps(&y),
                _ => true,
            }
        }
        _ => false,
    }
}

impl Preparer {
    /// Makes the MIG devices of `devices` exist and records them: found (static) or created
    /// (dynamic, recorded in the checkpoint first: `mig_records.rs`). On failure, whatever this call
    /// created is destroyed again before the error is returned.
    pub(super) async fn prepare_mig_devices(
        &self,
        claim: &ClaimRef,
        inventory: &Inventory,
        mig_mode: MigMode,
        devices: &mut [PreparedDevice],
    ) -> Result<(), (String, String)> {
        for index in 0..devices.len() {
            let device = devices[index].device.clone();
            let target = match resolve(inventory, &device) {
                Ok(Some(target)) => target,
                Ok(None) => continue,
                Err(reason) => return self.fail(claim, devices, device, reason).await,
            };
            let shared_with = devices[index]
                .share_id
                .as_ref()
                .and_then(|_| self.share_holder(&claim.uid, &device));
            let prepared = match (mig_mode, &target.existing) {
                // A share of a MIG device another claim made and holds: the same device, which
                // the last claim holding it destroys.
                (MigMode::Dynamic, Some(existing)) if shared_with.is_some() => {
                    info!(uuid = %existing.uuid, device = %device, "MIG device shared with a claim that made it");
                    Ok(prepared_mig(&target.gpu, existing, true))
                }
                (MigMode::Static, Some(existing)) => Ok(prepared_mig(&target.gpu, existing, false)),
                (MigMode::Static, None) => Err(format!(
                    "no MIG device {} exists at memory slice {} (static MIG publishes only existing ones)",
                    target.profile.name, target.placement.start
                )),
                (MigMode::Dynamic, _) => self.create_recorded(claim, &target).await,
                // None is also the fallback while the API server drops shared counters; the Event says which.
                (MigMode::None, _) => Err("MIG devices are not published in MIG mode none (set by --mig-mode \
                     or a GpuNodePolicy, or because the API server drops shared counters: see a \
                     FeatureGateDisabled Event on the Node)"
                    .into()),
            };
            match prepared {
                Ok(mig) => devices[index].mig = Some(mig),
                Err(reason) => return self.fail(claim, devices, device, reason).await,
            }
        }
        Ok(())
    }

    async fn fail(
        &self,
        claim: &ClaimRef,
        devices: &mut [PreparedDevice],
        device: String,
        reason: String,
    ) -> Result<(), (String, String)> {
        self.destroy_created(&claim.uid, devices).await;
        for device in devices.iter_mut() {
            device.mig = None;
        }
        Err((device, reason))
    }
}

/// Creates the MIG device; with `adopt`, one of the requested profile found at exactly the requested
/// placement is taken as it is (see [`GpuBackend::create_or_adopt_mig`]). Runs as an operation on
/// the GPU (`gpu_modes.rs`): bounded in time, and refused at once while an earlier one is stuck.
pub(super) async fn create(
    ops: &GpuOps,
    backend: &Arc<dyn GpuBackend>,
    target: &MigTarget,
    adopt: bool,
) -> Result<PreparedMig, GpuOpError> {
    let request = MigRequest {
        parent_uuid: target.gpu.uuid.clone(),
        profile_id: target.profile.id,
        placement: target.placement,
    };
    let op = GpuOp::CreateMig {
        profile: target.profile.name.clone(),
        start: target.placement.start,
    };
    // The create runs on a thread of its own, so a prepare the kubelet cancels (its deadline) leaves
    // it to finish; the kubelet's retry then adopts what it made (it was recorded before the create),
    // and reserve() guarantees that no other claim holds the placement, so what is there is this claim's.
    let worker = backend.clone();
    let (instance, adopted) = ops
        .mig(&target.gpu.uuid, &gpu_name(&target.gpu), op, move || {
            if adopt {
                worker.create_or_adopt_mig(&request)
            } else {
                worker
                    .create_mig(&request)
                    .map(|instance| (instance, false))
            }
        })
        .await?;
    if adopted {
        info!(uuid = %instance.uuid, profile = %target.profile.name, start = target.placement.start, "MIG device adopted (made by an earlier, interrupted prepare)");
    } else {
        info!(uuid = %instance.uuid, profile = %target.profile.name, start = target.placement.start, "MIG device created");
    }
    Ok(prepared_mig(&target.gpu, &instance, true))
}

/// The GPU's name in messages: `gpu-<minor>`, as its device is named.
pub(super) fn gpu_name(gpu: &Gpu) -> String {
    format!("gpu-{}", gpu.minor)
}

fn prepared_mig(gpu: &Gpu, instance: &MigInstance, created: bool) -> PreparedMig {
    PreparedMig {
        parent_uuid: gpu.uuid.clone(),
        uuid: instance.uuid.clone(),
        gpu_instance_id: instance.gpu_instance_id,
        compute_instance_id: instance.compute_instance_id,
        device_files: instance.device_files.clone(),
        created,
    }
}

/// Destroys the MIG devices these devices created, each as an operation on its GPU (bounded in
/// time, refused at once while an earlier one on the GPU is stuck); failures are logged and left to
/// the kubelet's retry or the start-up sweep. Returns the first error for callers that must report
/// it, and the UUIDs of the devices that are gone now (destroyed, or gone already).
pub(super) async fn destroy_created(
    ops: &GpuOps,
    backend: &Arc<dyn GpuBackend>,
    devices: &[PreparedDevice],
) -> (Option<String>, Vec<String>) {
    let mut first_error = None;
    let mut gone = Vec::new();
    for (device, mig) in devices
        .iter()
        .filter_map(|d| Some((d, d.mig.as_ref().filter(|m| m.created)?)))
    {
        let worker = backend.clone();
        let (parent, gpu_instance, uuid) = (
            mig.parent_uuid.clone(),
            mig.gpu_instance_id,
            mig.uuid.clone(),
        );
        let gpu = DeviceName::parse(&device.device)
            .map(|name| format!("gpu-{}", name.minor()))
            .unwrap_or_else(|| mig.parent_uuid.clone());
        let op = GpuOp::DestroyMig {
            uuid: mig.uuid.clone(),
        };
        let result = ops
            .mig(&mig.parent_uuid, &gpu, op, move || {
                worker.destroy_mig(&parent, gpu_instance, &uuid)
            })
            .await
            .map_err(|e| e.to_string());
        if result.is_ok() {
            gone.push(mig.uuid.clone());
        }
        match result {
            Ok(MigDestroyed::Destroyed) => info!(uuid = %mig.uuid, "MIG device destroyed"),
            Ok(MigDestroyed::Gone) => info!(uuid = %mig.uuid, "MIG device was gone already"),
            // Ours is gone; the GPU instance id now belongs to someone else's device.
            Ok(MigDestroyed::Replaced { found }) => {
                warn!(uuid = %mig.uuid, gpu_instance = mig.gpu_instance_id, now_holds = %found, "MIG device was gone already; its GPU instance id now holds another MIG device, which is left alone")
            }
            Err(error) => {
                warn!(uuid = %mig.uuid, %error, "destroying MIG device failed");
                first_error.get_or_insert(error);
            }
        }
    }
    (first_error, gone)
}

/// Records the UUIDs of created MIG devices in the claim's `status.devices`, next to whatever other
/// drivers wrote there. Best effort, after the answer to the kubelet: the device works without it.
pub(super) async fn report_status(
    client: kube::Client,
    driver: String,
    claim: ClaimRef,
    devices: Vec<PreparedDevice>,
) {
    let entries: Vec<AllocatedDeviceStatus> = devices
        .iter()
        .filter_map(|device| {
            let mig = device.mig.as_ref().filter(|m| m.created)?;
            Some(AllocatedDeviceStatus {
                driver: driver.clone(),
                pool: device.pool.clone(),
                device: device.device.clone(),
                share_id: device.share_id.clone(),
                data: Some(RawExtension(serde_json::json!({
                    "uuid": mig.uuid,
                    "parentUUID": mig.parent_uuid,
                }))),
                ..Default::default()
            })
        })
        .collect();
    if entries.is_empty() {
        return;
    }
    let api: Api<ResourceClaim> = Api::namespaced(client, &claim.namespace);
    for attempt in 1..=3 {
        let result = async {
            let mut current = api.get(&claim.name).await?;
            if current.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
                return Ok(());
            }
            let status = current.status.get_or_insert_with(Default::default);
            let mut list: Vec<AllocatedDeviceStatus> = status
                .devices
                .take()
                .unwrap_or_default()
                .into_iter()
                .filter(|s| !entries.iter().any(|e| same_device(e, s)))
                .collect();
            list.extend(entries.iter().cloned());
            status.devices = Some(list);
            api.replace_status(&claim.name, &PostParams::default(), &current)
                .await
                .map(|_| ())
        }
        .await;
        match result {
            Ok(()) => {
                debug!(claim = %claim, "MIG device UUIDs reported in the claim status");
                return;
            }
            Err(kube::Error::Api(status)) if status.code == 409 && attempt < 3 => continue,
            Err(error) => {
                warn!(claim = %claim, %error, "reporting MIG device UUIDs in the claim status failed");
                return;
            }
        }
    }
}

fn same_device(a: &AllocatedDeviceStatus, b: &AllocatedDeviceStatus) -> bool {
    a.driver == b.driver && a.pool == b.pool && a.device == b.device && a.share_id == b.share_id
}
