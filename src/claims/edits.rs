//! What goes into a claim's CDI spec: for each prepared GPU or MIG device, its device files (the GPU's,
//! the MIG device's capability files, the driver's control files) and an environment variable that
//! names the device by UUID; on real GPUs also the host driver's libraries and binaries, unless the
//! NVIDIA Container Toolkit's own CDI spec describes the device, which the claim then references.

use std::sync::Arc;

use super::PreparedDevice;
use crate::cdi::{CdiRegistry, ContainerEdits, DeviceNode, ToolkitSpec};
use crate::devices::DeviceName;
use crate::gpu::{Gpu, Inventory};

/// What containers need from the host's NVIDIA driver besides device nodes.
#[derive(Debug, Clone, Default)]
pub struct DriverEdits {
    /// Mounts and hooks for the driver's libraries and binaries; `None` for fake GPUs, whose
    /// containers need nothing from a driver.
    pub host: Option<ContainerEdits>,
    /// The NVIDIA Container Toolkit's spec for `nvidia.com/gpu`, if the node has one.
    pub toolkit: Option<Arc<ToolkitSpec>>,
}

impl DriverEdits {
    /// Adds the toolkit's CDI id for the device to its ids when the toolkit's spec names it (by GPU
    /// or MIG UUID), so the runtime takes the device nodes, libraries and hooks from there.
    pub(super) fn reference_toolkit(&self, inventory: &Inventory, device: &mut PreparedDevice) {
        let Some(toolkit) = &self.toolkit else { return };
        let uuid = match (&device.mig, find_gpu(inventory, &device.device)) {
            (Some(mig), _) => mig.uuid.clone(),
            (None, Some(gpu)) => gpu.uuid.clone(),
            (None, None) => return,
        };
        if let Some(id) = toolkit.device_for(&uuid, None) {
            if !device.cdi_device_ids.contains(&id) {
                device.cdi_device_ids.push(id);
            }
        }
    }
}

pub(super) fn write_spec_with(
    cdi: &CdiRegistry,
    uid: &str,
    devices: &[PreparedDevice],
    inventory: &Inventory,
    driver: &DriverEdits,
) -> Result<(), crate::cdi::CdiError> {
    let our_kind = format!("{}=", cdi.kind());
    let uses_toolkit = |device: &PreparedDevice| {
        device
            .cdi_device_ids
            .iter()
            .any(|id| !id.starts_with(&our_kind))
    };
    let edits: Vec<(String, ContainerEdits)> = devices
        .iter()
        .map(|device| {
            let mut edits = container_edits(inventory, device);
            if uses_toolkit(device) {
                // The toolkit's device brings the nodes; ours only names the device.
                edits.device_nodes.clear();
            }
            (device.device.clone(), edits)
        })
        .collect();
    let common = match &driver.host {
        Some(host) if !devices.iter().all(uses_toolkit) => host.clone(),
        _ => ContainerEdits::default(),
    };
    cdi.write_claim_spec_with(uid, &common, &edits).map(|_| ())
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
fn device_variable(device: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdi::Mount;
    use crate::gpu::{FakeBackend, GpuBackend};

    fn device(cdi: &CdiRegistry, uid: &str, name: &str) -> PreparedDevice {
        PreparedDevice {
            request_names: vec!["gpu".into()],
            pool: "node-a".into(),
            device: name.into(),
            cdi_device_ids: vec![cdi.qualified_device_id(uid, name)],
            share_id: None,
            admin_access: false,
            mig: None,
        }
    }

    #[test]
    fn toolkit_devices_are_referenced_and_other_devices_get_the_host_driver_files() {
        let root = tempfile::tempdir().unwrap();
        let cdi = CdiRegistry::new(root.path().join("cdi"), "gpu.dra.dev");
        let toolkit_dir = root.path().join("etc-cdi");
        std::fs::create_dir_all(&toolkit_dir).unwrap();
        std::fs::copy(
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/toolkit/nvidia.yaml"
            ),
            toolkit_dir.join("nvidia.yaml"),
        )
        .unwrap();
        let toolkit = ToolkitSpec::find(&[toolkit_dir])
            .spec
            .expect("toolkit spec");

        let mut inventory = FakeBackend::new("node-a", "l40s-4")
            .unwrap()
            .inventory()
            .unwrap();
        // GPU 0 is one the toolkit's spec names by UUID; GPU 1 is not.
        inventory.gpus[0].uuid = "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c".into();
        inventory.stand_in_device_file = None;
        let libcuda = Mount {
            host_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07".into(),
            container_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07".into(),
            options: vec!["ro".into(), "nosuid".into(), "nodev".into(), "bind".into()],
            mount_type: None,
        };
        let driver = DriverEdits {
            host: Some(ContainerEdits {
                mounts: vec![libcuda.clone()],
                ..Default::default()
            }),
            toolkit: Some(Arc::new(toolkit)),
        };
        let uid = "6c3e0f0a-3d4b-4a8e-9f00-1d2c3b4a5e6f";
        let mut devices = vec![device(&cdi, uid, "gpu-0"), device(&cdi, uid, "gpu-1")];
        for d in devices.iter_mut() {
            driver.reference_toolkit(&inventory, d);
        }
        assert_eq!(
            devices[0].cdi_device_ids[1],
            "nvidia.com/gpu=GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"
        );
        assert_eq!(devices[1].cdi_device_ids.len(), 1);

        write_spec_with(&cdi, uid, &devices, &inventory, &driver).unwrap();
        let spec = cdi.read_claim_spec(uid).unwrap().unwrap();
        // The toolkit's device brings its own nodes; ours only names the GPU.
        let first = &spec.devices[0].container_edits;
        assert!(first.device_nodes.is_empty());
        assert!(first.env[0].ends_with("GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"));
        let second = &spec.devices[1].container_edits;
        assert!(second.device_nodes.iter().any(|n| n.path == "/dev/nvidia1"));
        assert_eq!(spec.container_edits.mounts, vec![libcuda]);

        // When the toolkit names every device, the driver files come from it alone.
        write_spec_with(&cdi, uid, &devices[..1], &inventory, &driver).unwrap();
        let spec = cdi.read_claim_spec(uid).unwrap().unwrap();
        assert!(spec.container_edits.mounts.is_empty());
    }
}
