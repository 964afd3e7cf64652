//! What the operator hears about GPUs the plugin leaves out: a GPU the backend cannot read, a static
//! GPU instance without compute instance, a GPU whose MIG mode could not be switched off, a GPU that
//! offers no dynamic MIG device until an admin enables MIG mode and resets it (A100); and about
//! device files containers cannot get right: the `nvidia-uvm` module not loaded, MIG capabilities
//! without a registered major. Each is a
//! Warning Event on the Node and a log line when it appears (once per GPU and reason), a log line and a
//! Normal Event when it is over, and the `gpu_dra_unreadable_gpus` gauge. Unreadable GPUs are also
//! UNHEALTHY on the kubelet's health stream ([`unreadable_health`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::runtime::events::EventType;
use tokio::sync::watch;
use tracing::{info, warn};

use super::node_events::NodeEvents;
use crate::devices::{DeviceName, MigMode};
use crate::gpu::Inventory;
use crate::kubelet::DeviceHealthReport;
use crate::observability::Metrics;

/// The Event reason for a GPU the backend cannot read.
pub const GPU_UNREADABLE: &str = "GpuUnreadable";
/// The Event reason for a static GPU instance without compute instance.
pub const MIG_WITHOUT_COMPUTE: &str = "MigInstanceWithoutComputeInstance";
/// The Event reason for a GPU left in MIG mode because switching it off failed.
pub const MIG_MODE_STUCK: &str = "MigModeNotSwitchedOff";
/// The Event reason for a GPU that offers no MIG device under `--mig-mode dynamic`: its MIG mode is
/// off and switching it on takes a GPU reset (A100), which the plugin does not do.
pub const MIG_MODE_NEEDS_RESET: &str = "MigModeOffNeedsGpuReset";

/// The Event reason for a node whose `nvidia-uvm` module is not loaded (CUDA cannot initialise).
pub const UVM_NOT_LOADED: &str = "NvidiaUvmNotLoaded";
/// The Event reason for MIG mode on a node whose `/proc/devices` has no `nvidia-caps` major.
pub const CAPS_MAJOR_UNKNOWN: &str = "NvidiaCapsMajorUnknown";

/// One problem: (Event reason, the GPU or GPU instance it is about) → the note.
type Problems = BTreeMap<(&'static str, String), String>;

/// The problems an inventory shows under a MIG mode.
pub fn problems(inventory: &Inventory, mig_mode: MigMode) -> Problems {
    let mut found = device_file_problems(inventory);
    for gpu in &inventory.unreadable {
        found.insert(
            (GPU_UNREADABLE, format!("{}: {}", gpu.describe(), gpu.reason)),
            format!(
                "{} cannot be read: {}. It is left out of the ResourceSlices and read again at every rescan.",
                gpu.describe(),
                gpu.reason
            ),
        );
    }
    for gpu in &inventory.gpus {
        let Some(mig) = &gpu.mig else { continue };
        if mig_mode == MigMode::Dynamic && !mig.enabled && !mig.toggles_without_reset {
            let index = gpu.index;
            found.insert(
                (MIG_MODE_NEEDS_RESET, gpu.uuid.clone()),
                format!(
                    "gpu-{} (index {index}, {}, {}) publishes no MIG device under --mig-mode dynamic: \
                     its MIG mode is off, and this GPU switches MIG mode only with a GPU reset, which \
                     the plugin does not do. It is offered as a whole GPU. To offer its MIG devices, \
                     run `nvidia-smi -i {index} -mig 1`, then reset the GPU with nothing using it \
                     (`nvidia-smi --gpu-reset -i {index}`) or reboot the node.",
                    gpu.minor, gpu.uuid, gpu.product_name
                ),
            );
        }
        if mig_mode == MigMode::Static && mig.enabled {
            for instance in mig.instances.iter().filter(|i| !i.has_compute_instance()) {
                let profile = mig
                    .profile(instance.profile_id)
                    .map_or("unknown profile", |p| p.name.as_str());
                found.insert(
                    (
                        MIG_WITHOUT_COMPUTE,
                        format!("{} {}", gpu.uuid, instance.gpu_instance_id),
                    ),
                    format!(
                        "gpu-{} ({}): GPU instance {} ({profile} at memory slice {}) has no compute instance, so CUDA cannot use it and it is not published. Create one (nvidia-smi mig -i {} -gi {} -cci) or destroy the GPU instance.",
                        gpu.minor, gpu.uuid, instance.gpu_instance_id, instance.placement.start,
                        gpu.uuid, instance.gpu_instance_id
                    ),
                );
            }
        }
        if let (true, Some(reason)) = (mig.enabled, &mig.disable_failed) {
            found.insert(
                (MIG_MODE_STUCK, gpu.uuid.clone()),
                format!(
                    "gpu-{} ({}): switching MIG mode off after its last MIG device failed: {reason}. The whole GPU is not offered until MIG mode is off (nvidia-smi -i {} -mig 0).",
                    gpu.minor, gpu.uuid, gpu.uuid
                ),
            );
        }
    }
    found
}

/// Device files whose numbers are unknown: claim specs then list them without, the runtime looks for
/// them on the host, and containers fail to start where the host has none.
fn device_file_problems(inventory: &Inventory) -> Problems {
    let mut found = Problems::new();
    let majors = &inventory.device_majors;
    let source = majors.source.display().to_string();
    let why = match &majors.unreadable {
        Some(reason) => format!("{source} cannot be read: {reason}"),
        None => format!("{source} lists no"),
    };
    if majors.uvm.is_none() {
        found.insert(
            (UVM_NOT_LOADED, source.clone()),
            format!(
                "the nvidia-uvm kernel module is not loaded ({why} nvidia-uvm major), and CUDA cannot initialise without /dev/nvidia-uvm. Claim specs still list /dev/nvidia-uvm and /dev/nvidia-uvm-tools, without device numbers: containers start where the host has those files and otherwise fail with \"failed to stat CDI host device\". Load it on the node (nvidia-modprobe -u -c=0, or modprobe nvidia-uvm); the next rescan picks it up."
            ),
        );
    }
    let mig_enabled = inventory
        .gpus
        .iter()
        .any(|gpu| gpu.mig.as_ref().is_some_and(|mig| mig.enabled));
    if majors.caps.is_none() && mig_enabled {
        found.insert(
            (CAPS_MAJOR_UNKNOWN, source.clone()),
            format!(
                "MIG mode is on but the nvidia-caps major is unknown ({why} nvidia-caps major): claim specs list MIG capability files without device numbers, and containers with MIG devices fail to start where the host has no such file."
            ),
        );
    }
    found
}

/// UNHEALTHY health reports for unreadable GPUs whose minor number is known (`gpu-<minor>`), so that
/// pods already using one hear of it.
pub fn unreadable_health(inventory: &Inventory, pool: &str) -> Vec<DeviceHealthReport> {
    inventory
        .unreadable
        .iter()
        .filter_map(|gpu| {
            Some(DeviceHealthReport {
                pool: pool.to_string(),
                device: DeviceName::Gpu { minor: gpu.minor? }.to_string(),
                healthy: false,
                message: format!("the GPU cannot be read: {}", gpu.reason),
            })
        })
        .collect()
}

/// Reports problems as they appear and end, until `shutdown`.
pub async fn run(
    mut inventory: watch::Receiver<Arc<Inventory>>,
    mut mig_mode: watch::Receiver<MigMode>,
    events: Arc<NodeEvents>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut reported = Problems::new();
    loop {
        let now = {
            let current = inventory.borrow_and_update().clone();
            metrics.set_unreadable_gpus(current.unreadable.len());
            problems(&current, *mig_mode.borrow_and_update())
        };
        for ((reason, what), note) in &now {
            if !reported.contains_key(&(*reason, what.clone())) {
                warn!(reason, gpu = %what, "{note}");
                events.warn(reason, "ReadGpu", note).await;
            }
        }
        for ((reason, what), note) in &reported {
            if !now.contains_key(&(*reason, what.clone())) {
                info!(reason, gpu = %what, "over: {note}");
                let over = format!("Resolved: {note}");
                events
                    .publish(EventType::Normal, reason, "ReadGpu", &over, None)
                    .await;
            }
        }
        reported = now;
        tokio::select! {
            changed = inventory.changed() => if changed.is_err() { return },
            changed = mig_mode.changed() => if changed.is_err() { return },
            _ = shutdown.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{FakeBackend, GpuBackend, UnreadableGpu};

    #[test]
    fn unreadable_gpus_are_unhealthy_by_minor_and_named_in_the_note() {
        let mut inventory = FakeBackend::new("n", "l40s-4")
            .unwrap()
            .inventory()
            .unwrap();
        inventory.unreadable = vec![
            UnreadableGpu {
                index: 2,
                minor: Some(2),
                uuid: Some("GPU-2".into()),
                pci_bus_id: Some("0000:81:00.0".into()),
                reason: "GPU is lost".into(),
            },
            UnreadableGpu {
                index: 3,
                minor: None,
                uuid: None,
                pci_bus_id: None,
                reason: "NVML nvmlDeviceGetHandleByIndex_v2 failed: Unknown Error".into(),
            },
        ];
        let health = unreadable_health(&inventory, "node-a");
        assert_eq!(
            health.len(),
            1,
            "only a GPU with a known minor has a device name"
        );
        assert_eq!(health[0].device, "gpu-2");
        assert!(!health[0].healthy);
        assert!(health[0].message.contains("GPU is lost"));
        let found = problems(&inventory, MigMode::Static);
        let notes: Vec<&String> = found.values().collect();
        // The fake node has its UVM module loaded: no other problem.
        assert_eq!(notes.len(), 2);
        assert!(notes
            .iter()
            .any(|n| n.contains("gpu-2 GPU-2 PCI 0000:81:00.0 cannot be read: GPU is lost")));
        assert!(notes
            .iter()
            .any(|n| n.contains("GPU index 3 cannot be read")));
    }

    #[test]
    fn an_ampere_gpu_with_mig_mode_off_under_dynamic_mig_says_how_to_enable_it() {
        let mut inventory = FakeBackend::new("n", "dgx-a100")
            .unwrap()
            .inventory()
            .unwrap();
        assert!(problems(&inventory, MigMode::Static).is_empty());
        let found = problems(&inventory, MigMode::Dynamic);
        assert_eq!(found.len(), inventory.gpus.len(), "one per GPU: {found:?}");
        let gpu = &inventory.gpus[3];
        let note = &found[&(MIG_MODE_NEEDS_RESET, gpu.uuid.clone())];
        for part in [
            format!(
                "gpu-3 (index {}, {}, {})",
                gpu.index, gpu.uuid, gpu.product_name
            ),
            format!("`nvidia-smi -i {} -mig 1`", gpu.index),
            format!("`nvidia-smi --gpu-reset -i {}`", gpu.index),
            "reboot the node".to_string(),
        ] {
            assert!(note.contains(&part), "{note:?} lacks {part:?}");
        }
        for gpu in inventory.gpus.iter_mut() {
            gpu.mig.as_mut().unwrap().enabled = true;
        }
        assert!(problems(&inventory, MigMode::Dynamic).is_empty());
        // Hopper switches MIG mode on by itself when a MIG device is prepared.
        let h100 = FakeBackend::new("n", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        assert!(problems(&h100, MigMode::Dynamic).is_empty());
    }

    #[test]
    fn a_node_without_the_uvm_module_is_told_once_what_its_containers_lack() {
        let mut inventory = FakeBackend::new("n", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        assert!(problems(&inventory, MigMode::Dynamic).is_empty());
        inventory.device_majors = crate::gpu::DeviceMajors::parse(
            std::path::Path::new("/driver/proc/devices"),
            "Character devices:\n  1 mem\n195 nvidia-frontend\nBlock devices:\n510 nvidia-uvm\n",
        );
        let found = problems(&inventory, MigMode::Dynamic);
        let notes: Vec<(&str, &String)> = found.iter().map(|((r, _), n)| (*r, n)).collect();
        assert_eq!(notes.len(), 1, "{notes:?}");
        let (reason, note) = notes[0];
        assert_eq!(reason, UVM_NOT_LOADED);
        for part in [
            "nvidia-uvm kernel module is not loaded",
            "/driver/proc/devices lists no nvidia-uvm major",
            "CUDA cannot initialise",
            "failed to stat CDI host device",
            "nvidia-modprobe -u -c=0",
        ] {
            assert!(note.contains(part), "{note:?} lacks {part:?}");
        }

        // MIG mode on without a caps major: MIG devices cannot be given either.
        inventory.gpus[0].mig.as_mut().unwrap().enabled = true;
        let found = problems(&inventory, MigMode::Dynamic);
        assert!(found
            .keys()
            .any(|(reason, _)| *reason == CAPS_MAJOR_UNKNOWN));
        inventory.device_majors.unreadable = Some("permission denied".into());
        let found = problems(&inventory, MigMode::Dynamic);
        assert!(found
            .values()
            .all(|n| n.contains("/driver/proc/devices cannot be read: permission denied")));
    }
}
