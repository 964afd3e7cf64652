//! Passthrough claims: a claim of `gpu-vfio-<n>` devices binds each GPU's whole IOMMU group to
//! vfio-pci at prepare and gives every function back to the driver it had at unprepare. Before the
//! first bind the claim's record names every function of the group with its driver then (phase
//! `vfioBinding`), so that an unprepare, a roll-back and a restart restore them from the record
//! alone; restoring is idempotent, so a crash at any point converges.
//!
//! A group holding a device another claim has (as a GPU, a MIG device or another passthrough
//! device), or one a process has open, is refused with the reason; the kernel would otherwise wait
//! in the unbind until the process lets go. The container gets `/dev/vfio/<group>` for each device
//! and, where asked, `/dev/vfio/vfio` (`VfioDeviceConfig`'s `iommu.enableAPIDevice`; under this
//! driver's own name it is on unless a config says otherwise, since KubeVirt's virt-launcher opens
//! it), and nothing of the NVIDIA driver.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::info;

use super::allocation::FetchedClaim;
use super::lifecycle::{reached, Phase, Step};
use super::{configs, ClaimError, ClaimRecord, ClaimRef, PreparedDevice, Preparer};
use crate::cdi::{ContainerEdits, DeviceNode};
use crate::devices::passthrough;
use crate::gpu::pci::VFIO_PCI;
use crate::gpu::{Inventory, PciFunction, PciSysfs};

/// What a passthrough claim made on the node, in its record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VfioRecord {
    /// The container gets `/dev/vfio/vfio` too.
    pub api_device: bool,
    /// Each IOMMU group the claim binds, every function with its driver before the bind.
    pub groups: Vec<VfioGroup>,
    /// The claim's KEP-5304 device metadata files, bind-mounted into its containers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metadata: Vec<super::device_metadata::MetadataFile>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VfioGroup {
    /// The passthrough device (`gpu-vfio-<n>`) and its GPU's PCI address.
    pub device: String,
    pub address: String,
    pub iommu_group: u32,
    pub functions: Vec<PciFunction>,
}

/// Which GPUs the claims in `records` hold as GPUs and which as passthrough devices.
pub(super) fn held_ways<'a>(
    inventory: &Inventory,
    devices: impl Iterator<Item = &'a str>,
) -> passthrough::HeldWays {
    let mut held = passthrough::HeldWays::default();
    for device in devices {
        if let Some(pci) = passthrough::find(inventory, device) {
            held.as_vfio.insert(pci.address.to_ascii_lowercase());
        } else if let Some(gpu) = super::edits::find_gpu(inventory, device) {
            held.as_gpu.insert(gpu.pci_bus_id.to_ascii_lowercase());
        }
    }
    held
}

/// Whether `device` is a passthrough device name.
pub(super) fn is_vfio(device: &str) -> bool {
    passthrough::parse_device_name(device).is_some()
}

/// The IOMMU group a device of this node sits in: a passthrough device's own, or that of the GPU
/// under a GPU or MIG device.
fn group_of(inventory: &Inventory, device: &str) -> Option<u32> {
    if let Some(pci) = passthrough::find(inventory, device) {
        return pci.iommu_group;
    }
    let gpu = super::edits::find_gpu(inventory, device)?;
    inventory
        .pci_gpus
        .iter()
        .find(|p| p.address.eq_ignore_ascii_case(&gpu.pci_bus_id))?
        .iommu_group
}

/// `Some(overlap)` where `a` or `b` is a passthrough device: they overlap when both sit in one IOMMU
/// group (binding the group takes every device in it away from its user). `None`: neither is one.
pub(super) fn conflict(inventory: &Inventory, a: &str, b: &str) -> Option<bool> {
    if !is_vfio(a) && !is_vfio(b) {
        return None;
    }
    if a == b {
        return Some(true);
    }
    Some(match (group_of(inventory, a), group_of(inventory, b)) {
        (Some(x), Some(y)) => x == y,
        _ => false,
    })
}

/// The container edits of a passthrough device: its group's device file. The fake backend's get
/// the stand-in numbers, so that the runtime makes them without a host file; on a node the runtime
/// takes the numbers from the host's `/dev/vfio/<group>`.
pub(super) fn container_edits(
    inventory: &Inventory,
    device: &PreparedDevice,
) -> Option<ContainerEdits> {
    let pci = passthrough::find(inventory, &device.device)?;
    let mut edits = ContainerEdits::default();
    if let Some(group) = pci.iommu_group {
        edits
            .device_nodes
            .push(vfio_node(inventory, format!("/dev/vfio/{group}")));
    }
    edits.env.push(format!(
        "GPU_DRA_DEVICE_{}={}",
        device.device.to_ascii_uppercase().replace('-', "_"),
        pci.address
    ));
    Some(edits)
}

/// The claim-wide edits of a passthrough claim: `/dev/vfio/vfio` where the record asks for it.
pub(super) fn common_edits(inventory: &Inventory, record: &ClaimRecord) -> Option<ContainerEdits> {
    let vfio = record.vfio.as_ref()?;
    let mut edits = ContainerEdits::default();
    if vfio.api_device {
        edits
            .device_nodes
            .push(vfio_node(inventory, "/dev/vfio/vfio".into()));
    }
    edits.mounts = vfio
        .metadata
        .iter()
        .map(super::device_metadata::mount)
        .collect();
    Some(edits)
}

/// `extra` with the passthrough claim's common edits added.
pub(super) fn with_common_edits(
    extra: Option<ContainerEdits>,
    inventory: &Inventory,
    record: &ClaimRecord,
) -> Option<ContainerEdits> {
    let Some(vfio) = common_edits(inventory, record) else {
        return extra;
    };
    let mut edits = extra.unwrap_or_default();
    edits.device_nodes.extend(vfio.device_nodes);
    edits.mounts.extend(vfio.mounts);
    Some(edits)
}

fn vfio_node(inventory: &Inventory, path: String) -> DeviceNode {
    let number = inventory.stand_in_device;
    DeviceNode {
        device_type: number.map(|_| "c".to_string()),
        major: number.map(|n| i64::from(n.major)),
        minor: number.map(|n| i64::from(n.minor)),
        path,
        ..Default::default()
    }
}

impl Preparer {
    /// For a claim of passthrough devices: whether its containers get `/dev/vfio/vfio`, from its
    /// `VfioDeviceConfig` (NVIDIA's precedence: class configs, then claim configs, the last that
    /// names the request or names none). `None` for a claim without passthrough devices; a claim
    /// that mixes them with GPUs, or a GPU config aimed at one, is refused.
    pub(super) fn vfio_request(
        &self,
        claim: &ClaimRef,
        fetched: &FetchedClaim,
        devices: &[PreparedDevice],
    ) -> Result<Option<bool>, ClaimError> {
        let invalid = |reason: String| ClaimError::Config {
            claim: claim.to_string(),
            reason,
        };
        let vfio: Vec<&PreparedDevice> = devices.iter().filter(|d| is_vfio(&d.device)).collect();
        if vfio.is_empty() {
            return Ok(None);
        }
        if vfio.len() != devices.len() {
            return Err(invalid(format!(
                "passthrough devices ({}) and GPUs ({}) cannot be in one claim: a passthrough GPU is a virtual machine's, not the container's",
                vfio.iter().map(|d| d.device.as_str()).collect::<Vec<_>>().join(", "),
                devices.iter().filter(|d| !is_vfio(&d.device)).map(|d| d.device.as_str()).collect::<Vec<_>>().join(", ")
            )));
        }
        let mut entries = configs::allocation_config_entries(&fetched.claim, &fetched.raw_configs);
        entries.retain(|e| e.driver == self.driver);
        entries.sort_by_key(|e| !e.from_class);
        let mut api_device = None;
        for device in &vfio {
            let requests = &device.request_names;
            let names =
                |e: &configs::ConfigEntry<'_>| e.requests.iter().any(|r| requests.contains(r));
            for entry in entries.iter().rev() {
                let vfio_config = configs::vfio_config(entry);
                match vfio_config {
                    Some(Err(error)) if names(entry) || entry.requests.is_empty() => {
                        return Err(invalid(format!(
                            "config[{}] (VfioDeviceConfig): {error}",
                            entry.index
                        )));
                    }
                    Some(Ok(settings)) if names(entry) || entry.requests.is_empty() => {
                        api_device = Some(settings.api_device);
                        break;
                    }
                    None if names(entry) => {
                        return Err(invalid(format!(
                            "config[{}]: only VfioDeviceConfig applies to device {} (a passthrough GPU)",
                            entry.index, device.device
                        )));
                    }
                    _ => {}
                }
            }
        }
        // NVIDIA's default is without the API device; ours gives it, as KubeVirt needs it.
        let default = self.driver != crate::api::NVIDIA_DRIVER_NAME;
        Ok(Some(api_device.unwrap_or(default)))
    }

    /// Records every function of each device's IOMMU group with its driver, then binds them all to
    /// vfio-pci, then writes the CDI spec.
    pub(super) async fn make_vfio(
        &self,
        claim: &ClaimRef,
        inventory: &Arc<Inventory>,
        api_device: bool,
        devices: &[PreparedDevice],
        resource_claim: &k8s_openapi::api::resource::v1::ResourceClaim,
    ) -> Result<(), ClaimError> {
        let failed = |device: &str, reason: String| ClaimError::Vfio {
            claim: claim.to_string(),
            device: device.to_string(),
            reason,
        };
        let pci = self
            .pci()
            .map_err(|reason| failed(&devices[0].device, reason))?;
        let mut groups = Vec::new();
        for device in devices {
            let gpu = passthrough::find(inventory, &device.device).ok_or_else(|| {
                failed(
                    &device.device,
                    "the node has no such passthrough GPU".into(),
                )
            })?;
            let group = gpu.iommu_group.ok_or_else(|| {
                failed(
                    &device.device,
                    "the GPU has no IOMMU group (is the IOMMU on?)".into(),
                )
            })?;
            let reading = pci.clone();
            let functions =
                blocking(move || reading.group_functions(group).map_err(|e| e.to_string()))
                    .await
                    .map_err(|reason| failed(&device.device, reason))?;
            for function in &functions {
                let (reading, address) = (pci.clone(), function.address.clone());
                let busy = blocking(move || reading.in_use(&address).map_err(|e| e.to_string()))
                    .await
                    .map_err(|reason| failed(&device.device, reason))?;
                if busy && function.driver.as_deref() != Some(VFIO_PCI) {
                    return Err(failed(
                        &device.device,
                        format!(
                            "IOMMU group {group} holds {}, which a process has open (driver {}); it can be passed through once that process has ended",
                            function.address,
                            function.driver.as_deref().unwrap_or("none")
                        ),
                    ));
                }
            }
            groups.push(VfioGroup {
                device: device.device.clone(),
                address: gpu.address.clone(),
                iommu_group: group,
                functions,
            });
        }
        let published: Vec<(String, k8s_openapi::api::resource::v1::Device)> = devices
            .iter()
            .flat_map(|d| {
                let device = passthrough::device(inventory, &d.device);
                d.request_names
                    .iter()
                    .filter_map(move |r| device.clone().map(|device| (r.clone(), device)))
            })
            .collect();
        let metadata = super::device_metadata::files(
            &self.plugin_dir(),
            &self.driver,
            &self.pool,
            resource_claim,
            &published,
        );
        self.update_record(claim, |record| {
            record.vfio = Some(VfioRecord {
                api_device,
                groups: groups.clone(),
                metadata: metadata.iter().map(|(file, _)| file.clone()).collect(),
            });
            record.phase = Phase::VfioBinding;
        });
        // On file before the first bind, so a crash leaves a record that says what to give back.
        self.persist(claim).await?;
        for group in &groups {
            for function in &group.functions {
                let (binding, address) = (pci.clone(), function.address.clone());
                blocking(move || binding.bind(&address, VFIO_PCI).map_err(|e| e.to_string()))
                    .await
                    .map_err(|reason| failed(&group.device, reason))?;
            }
            info!(device = %group.device, group = group.iommu_group, functions = group.functions.len(), "IOMMU group bound to vfio-pci");
        }
        reached(&claim.uid, Step::VfioBind).await;
        super::device_metadata::write(&metadata).map_err(|e| {
            failed(
                &devices[0].device,
                format!("writing its device metadata file: {e}"),
            )
        })?;
        let record = super::state::lock(&self.state)
            .data
            .claims
            .get(&claim.uid)
            .cloned();
        let common = record.as_ref().and_then(|r| common_edits(inventory, r));
        self.write_spec(claim, devices, inventory, common.as_ref())
            .await
    }

    /// Gives every function the record names back to its driver; what is given back leaves the
    /// record, the first failure stops (the rest stays recorded for the next try).
    pub(super) async fn unbind_vfio(
        &self,
        claim: &ClaimRef,
        record: &ClaimRecord,
    ) -> Result<(), ClaimError> {
        let Some(vfio) = &record.vfio else {
            return Ok(());
        };
        let pci = self.pci().map_err(|reason| ClaimError::Vfio {
            claim: claim.to_string(),
            device: vfio
                .groups
                .first()
                .map(|g| g.device.clone())
                .unwrap_or_default(),
            reason,
        })?;
        for group in &vfio.groups {
            for function in &group.functions {
                let (restoring, function_now) = (pci.clone(), function.clone());
                blocking(move || {
                    restoring
                        .restore(&function_now.address, function_now.driver.as_deref())
                        .map_err(|e| e.to_string())
                })
                .await
                .map_err(|reason| ClaimError::Vfio {
                    claim: claim.to_string(),
                    device: group.device.clone(),
                    reason: format!("giving {} back: {reason}", function.address),
                })?;
            }
            info!(device = %group.device, group = group.iommu_group, "IOMMU group given back to its drivers");
        }
        super::device_metadata::remove(&self.plugin_dir(), &record.namespace, &record.name)
            .map_err(|e| ClaimError::Vfio {
                claim: claim.to_string(),
                device: vfio
                    .groups
                    .first()
                    .map(|g| g.device.clone())
                    .unwrap_or_default(),
                reason: format!("removing its device metadata files: {e}"),
            })?;
        self.update_record(claim, |held| held.vfio = None);
        Ok(())
    }

    /// At start, for a claim rolled back: every function its record names given back, on this
    /// thread (recovery runs before any call). An error leaves the claim recorded, for the kubelet's
    /// unprepare to finish.
    pub(super) fn give_back_at_start(&self, record: &ClaimRecord) -> Result<(), String> {
        let Some(vfio) = &record.vfio else {
            return Ok(());
        };
        let pci = self.pci()?;
        for group in &vfio.groups {
            for function in &group.functions {
                pci.restore(&function.address, function.driver.as_deref())
                    .map_err(|e| format!("giving {} back: {e}", function.address))?;
            }
        }
        super::device_metadata::remove(&self.plugin_dir(), &record.namespace, &record.name)
            .map_err(|e| format!("removing its device metadata files: {e}"))
    }

    /// At start, for a claim kept: every function its record names bound to vfio-pci again where it
    /// is not (after a reboot the kernel gave each GPU back to its default driver, and the kubelet's
    /// next prepare finds the claim completed). Already bound: nothing to do.
    pub(super) fn rebind_at_start(&self, record: &ClaimRecord) -> Result<(), String> {
        let Some(vfio) = &record.vfio else {
            return Ok(());
        };
        let pci = self.pci()?;
        for group in &vfio.groups {
            for function in &group.functions {
                pci.bind(&function.address, VFIO_PCI)
                    .map_err(|e| format!("binding {} to vfio-pci again: {e}", function.address))?;
            }
        }
        Ok(())
    }

    /// The GPUs prepared claims hold, each way, for the slices (see [`passthrough::HeldWays`]).
    pub fn held_ways(&self) -> tokio::sync::watch::Receiver<passthrough::HeldWays> {
        self.held_ways.subscribe()
    }

    /// Sends the GPUs held each way now, if that changed.
    pub(super) fn note_held_ways(&self) {
        let inventory = self.inventory.borrow().clone();
        let held = {
            let state = super::state::lock(&self.state);
            let ours = state.data.claims.values().flat_map(|r| r.devices.iter());
            let theirs = state
                .data
                .nvidia_claims
                .values()
                .flat_map(|c| c.devices.iter());
            held_ways(
                &inventory,
                ours.map(|d| d.device.as_str())
                    .chain(theirs.map(|d| d.device.as_str())),
            )
        };
        self.held_ways.send_if_modified(|now| {
            let changed = *now != held;
            *now = held;
            changed
        });
    }

    /// The plugin's own directory (the checkpoint's).
    fn plugin_dir(&self) -> std::path::PathBuf {
        self.checkpoint
            .path()
            .parent()
            .map(std::path::Path::to_path_buf)
            .unwrap_or_default()
    }

    fn pci(&self) -> Result<PciSysfs, String> {
        match self.backend.pci() {
            Ok(Some(pci)) => Ok(pci),
            Ok(None) => Err(format!(
                "the {} GPU backend cannot pass GPUs through",
                self.backend.name()
            )),
            Err(error) => Err(error.to_string()),
        }
    }
}

/// Runs sysfs work off the async workers (a write to sysfs can block in the kernel).
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| format!("sysfs task failed: {e}"))?
}
