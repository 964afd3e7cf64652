//! What goes into a claim's CDI spec: for each prepared GPU, its device files, the driver's control
//! files and an environment variable that names the GPU.

use super::PreparedDevice;
use crate::cdi::{CdiRegistry, ContainerEdits, DeviceNode};
use crate::devices::DeviceName;
use crate::gpu::{Gpu, Inventory};

pub(super) fn write_spec_with(
    cdi: &CdiRegistry,
    uid: &str,
    devices: &[PreparedDevice],
    inventory: &Inventory,
) -> Result<(), crate::cdi::CdiError> {
    let edits: Vec<(String, ContainerEdits)> = devices
        .iter()
        .map(|device| {
            (
                device.device.clone(),
                container_edits(inventory, &device.device),
            )
        })
        .collect();
    cdi.write_claim_spec(uid, &edits).map(|_| ())
}

/// What a container that gets `device` needs: its device file and the driver's control files, and an
/// environment variable naming the GPU, so the workload (and a person) can see what it was given.
pub fn container_edits(inventory: &Inventory, device: &str) -> ContainerEdits {
    let mut edits = ContainerEdits::default();
    let Some(gpu) = find_gpu(inventory, device) else {
        return edits;
    };
    let files =
        std::iter::once(gpu.device_file()).chain(inventory.control_device_files.iter().cloned());
    edits.device_nodes = files
        .map(|path| DeviceNode {
            path,
            host_path: inventory.stand_in_device_file.clone(),
            ..Default::default()
        })
        .collect();
    let variable = format!(
        "GPU_DRA_DEVICE_{}",
        device.to_ascii_uppercase().replace(['-', '.'], "_")
    );
    edits.env = vec![format!("{variable}={}", gpu.uuid)];
    edits
}

pub(super) fn find_gpu<'a>(inventory: &'a Inventory, device: &str) -> Option<&'a Gpu> {
    match DeviceName::parse(device)? {
        DeviceName::Gpu { minor } => inventory.gpus.iter().find(|gpu| gpu.minor == minor),
    }
}
