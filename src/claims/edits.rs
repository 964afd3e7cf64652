//! What goes into a claim's CDI spec: for each prepared GPU or MIG device, its device files (the GPU's,
//! the MIG device's capability files, the driver's control files) and an environment variable that
//! names the device by UUID.

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
        .map(|device| (device.device.clone(), container_edits(inventory, device)))
        .collect();
    cdi.write_claim_spec(uid, &edits).map(|_| ())
}

/// What a container that gets `device` needs: its device files and the driver's control files, and an
/// environment variable naming the GPU or MIG device, so the workload (and a person) can see what it
/// was given.
pub fn container_edits(inventory: &Inventory, device: &PreparedDevice) -> ContainerEdits {
    let mut edits = ContainerEdits::default();
    let Some(gpu) = find_gpu(inventory, &device.device) else {
        return edits;
    };
    let (own_files, uuid) = match &device.mig {
        Some(mig) => (mig.device_files.clone(), mig.uuid.clone()),
        None => (Vec::new(), gpu.uuid.clone()),
    };
    let files = std::iter::once(gpu.device_file())
        .chain(own_files)
        .chain(inventory.control_device_files.iter().cloned());
    edits.device_nodes = files
        .map(|path| DeviceNode {
            path,
            host_path: inventory.stand_in_device_file.clone(),
            ..Default::default()
        })
        .collect();
    edits.env = vec![format!("{}={uuid}", device_variable(&device.device))];
    edits
}

/// `GPU_DRA_DEVICE_<NAME>`: the device name in upper case with `-` and `.` as `_`.
pub fn device_variable(device: &str) -> String {
    format!(
        "GPU_DRA_DEVICE_{}",
        device.to_ascii_uppercase().replace(['-', '.'], "_")
    )
}

/// The GPU a device name is on (the parent GPU of a MIG device).
pub(super) fn find_gpu<'a>(inventory: &'a Inventory, device: &str) -> Option<&'a Gpu> {
    let minor = DeviceName::parse(device)?.minor();
    inventory.gpus.iter().find(|gpu| gpu.minor == minor)
}
