//! What goes into a claim's CDI spec: for each prepared GPU or MIG device, its device files (the GPU's,
//! the MIG device's capability files, the driver's control files) and an environment variable that
//! names the device by UUID; on real GPUs also the host driver's libraries and binaries, unless the
//! NVIDIA Container Toolkit's own CDI spec describes the device, which the claim then references.
//! Host paths (mounts, hooks, device nodes) come from the driver root on the host.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tracing::{info, warn};

use super::PreparedDevice;
use crate::cdi::{
    device_host_path, CdiRegistry, ContainerEdits, DeviceNode, DiscoveryOptions, DriverRoot,
    HostDriver, HostDriverError, ToolkitSpec,
};
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
    /// The host directory whose `dev/` holds the GPU device nodes, where that is not `/` (the GPU
    /// Operator's driver container: `/run/nvidia/driver`); device nodes then get a `hostPath` there.
    pub dev_root: Option<PathBuf>,
}

impl DriverEdits {
    /// What containers get from the driver at `root` on a real GPU node: its files, found where the
    /// plugin sees them and mounted from where the host has them; device nodes from the root's dev
    /// root; and the Toolkit's CDI spec where the node has one (claims then reference its devices).
    /// Neither files nor a Toolkit spec is an error: CUDA could not run in the containers.
    pub fn discover(
        root: &DriverRoot,
        driver_version: &str,
        cdi_root: &Path,
    ) -> Result<Self, HostDriverError> {
        // Only directories the host's runtime reads: `<root>/etc/cdi` is the host's /etc/cdi only when
        // the driver root is the host's root. A driver container's /etc/cdi is read by no runtime, and a
        // claim naming a device from it would fail container creation.
        let mut dirs = Vec::new();
        if root.is_host_root() {
            dirs.push(root.container().join("etc/cdi"));
        }
        dirs.push(cdi_root.to_path_buf());
        let search = ToolkitSpec::find(&dirs);
        for warning in &search.warnings {
            warn!(path = %warning.path.display(), reason = %warning.reason, "skipping a CDI spec");
        }
        let toolkit = search.spec.map(Arc::new);
        if let Some(spec) = &toolkit {
            info!(path = %spec.path().display(), "claims reference the NVIDIA Container Toolkit's CDI devices where it names them");
        }
        let dev_root =
            (root.host_dev_root() != Path::new("/")).then(|| root.host_dev_root().to_path_buf());
        let options = DiscoveryOptions {
            host_driver_root: Some(root.host().to_path_buf()),
            ..Default::default()
        };
        match HostDriver::discover_with(root.container(), driver_version, &options) {
            Ok(host) => {
                for warning in host.warnings() {
                    warn!(%warning, "host driver discovery");
                }
                info!(
                    files = host.files().len(),
                    hook = host.cdi_hook().is_some(),
                    driver_root = %root.host().display(),
                    dev_root = %root.host_dev_root().display(),
                    "host driver files found"
                );
                Ok(DriverEdits {
                    host: Some(host.container_edits()),
                    toolkit,
                    dev_root,
                })
            }
            Err(error) if toolkit.is_some() => {
                warn!(%error, "host driver files not found; devices the toolkit's spec does not name get device nodes only");
                Ok(DriverEdits {
                    host: None,
                    toolkit,
                    dev_root,
                })
            }
            Err(error) => Err(error),
        }
    }

    /// Writes the CDI spec of claim `uid` for its prepared devices: our device for each (its nodes,
    /// unless the Toolkit's device it references brings them), and the host driver's files once for the
    /// spec when any device is not the Toolkit's.
    pub fn write_claim_spec(
        &self,
        cdi: &CdiRegistry,
        uid: &str,
        devices: &[PreparedDevice],
        inventory: &Inventory,
    ) -> Result<(), crate::cdi::CdiError> {
        write_spec_with(cdi, uid, devices, inventory, self, None)
    }

    /// Adds the toolkit's CDI id for the device to its ids when the toolkit's spec names it (by GPU
    /// or MIG UUID), so the runtime takes the device nodes, libraries and hooks from there.
    pub fn reference_toolkit(&self, inventory: &Inventory, device: &mut PreparedDevice) {
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

/// Keeps the NVIDIA container runtime's legacy mode from adding GPUs of its own to a claim's containers.
pub const VISIBLE_DEVICES_VOID: &str = "NVIDIA_VISIBLE_DEVICES=void";

pub(super) fn write_spec_with(
    cdi: &CdiRegistry,
    uid: &str,
    devices: &[PreparedDevice],
    inventory: &Inventory,
    driver: &DriverEdits,
    mps: Option<&ContainerEdits>,
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
            if let Some(dev_root) = &driver.dev_root {
                // /dev/vfio is the host's own, never the driver container's.
                for node in edits
                    .device_nodes
                    .iter_mut()
                    .filter(|n| !n.path.starts_with("/dev/vfio/"))
                {
                    node.host_path = device_host_path(dev_root, &node.path);
                }
            }
            (device.device.clone(), edits)
        })
        .collect();
    let is_channel = |device: &PreparedDevice| {
        crate::domains::channels::parse_device_name(&device.device).is_some()
    };
    let mut common = match &driver.host {
        // A claim of IMEX channels alone needs none of the driver's files.
        // Nor does a passthrough claim: its GPUs are the virtual machine's.
        Some(host)
            if !devices
                .iter()
                .all(|d| uses_toolkit(d) || is_channel(d) || super::vfio::is_vfio(&d.device)) =>
        {
            host.clone()
        }
        _ => ContainerEdits::default(),
    };
    // CUDA images set NVIDIA_VISIBLE_DEVICES=all; where the NVIDIA container runtime is the node's
    // default in its legacy mode, it would then hand the container every GPU of the node. The CDI spec
    // has the last word on the variable, as in NVIDIA's own CDI specs (the toolkit's common edits).
    common.env.push(VISIBLE_DEVICES_VOID.to_string());
    // The claim's MPS daemon (its pipe and shm directories and the client environment) goes to every
    // container that gets any of the claim's devices.
    if let Some(mps) = mps {
        common.env.extend(mps.env.iter().cloned());
        common.mounts.extend(mps.mounts.iter().cloned());
        common.device_nodes.extend(mps.device_nodes.iter().cloned());
    }
    cdi.write_claim_spec_with(uid, &common, &edits).map(|_| ())
}

/// What a container that gets `device` needs: its device files and the driver's control files, and
/// environment variables naming the GPU or MIG device and how it is shared (`GPU_DRA_SHARING`:
/// `Exclusive`, `TimeSlicing/<interval>` or `MPS`), so the workload (and a person) can see what it was
/// given. Each device file carries its type and numbers where they are known, so the runtime makes it
/// without looking on the host, which has no file for a MIG capability or the fake backend's devices.
pub fn container_edits(inventory: &Inventory, device: &PreparedDevice) -> ContainerEdits {
    if let Some(edits) = super::vfio::container_edits(inventory, device) {
        return edits;
    }
    let mut edits = ContainerEdits::default();
    if let Some(channel) = crate::domains::channels::parse_device_name(&device.device) {
        // An IMEX channel: its device file only (or with `allocationMode: All` every channel's), with
        // the `nvidia-caps-imex-channels` major; the runtime makes them, the host need not have them.
        let channels = match device.imex_channels {
            Some(count) => (0..count).collect(),
            None => vec![channel],
        };
        edits.device_nodes = channels
            .into_iter()
            .map(|n| device_node(inventory, crate::domains::channels::device_file(n)))
            .collect();
        edits.env = vec![format!("{}={channel}", device_variable(&device.device))];
        return edits;
    }
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
    edits.device_nodes = files.map(|path| device_node(inventory, path)).collect();
    edits.env = vec![
        format!("{}={uuid}", device_variable(&device.device)),
        format!("GPU_DRA_SHARING={}", device.sharing.env_value()),
    ];
    edits
}

/// A character device node with the driver's numbers; without them (a module that is not loaded) the
/// runtime takes them from the host's file, and the container fails to start if the host has none.
fn device_node(inventory: &Inventory, path: String) -> DeviceNode {
    let number = inventory.device_number(&path);
    DeviceNode {
        device_type: number.map(|_| "c".to_string()),
        major: number.map(|n| i64::from(n.major)),
        minor: number.map(|n| i64::from(n.minor)),
        path,
        ..Default::default()
    }
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
            sharing: Default::default(),
            imex_channels: None,
        }
    }

    #[test]
    fn a_channel_claim_gets_channel0_or_with_allocation_mode_all_every_channel() {
        let cdi = CdiRegistry::new("/tmp/unused", "gpu.dra.dev");
        let mut inventory = FakeBackend::new("node-a", "gb200-nvl72")
            .unwrap()
            .inventory()
            .unwrap();
        inventory.stand_in_device = None;
        inventory.device_majors = crate::gpu::DeviceMajors::parse(
            Path::new("/proc/devices"),
            "Character devices:\n234 nvidia-caps-imex-channels\n",
        );
        let single = device(&cdi, "u", "imex-channel-0");
        let edits = container_edits(&inventory, &single);
        let paths: Vec<&str> = edits.device_nodes.iter().map(|n| n.path.as_str()).collect();
        assert_eq!(paths, ["/dev/nvidia-caps-imex-channels/channel0"]);

        let all = PreparedDevice {
            imex_channels: Some(crate::domains::channels::MAX_CHANNELS),
            ..single
        };
        let edits = container_edits(&inventory, &all);
        assert_eq!(edits.device_nodes.len(), 2048);
        for (n, node) in [0u32, 222, 2047]
            .iter()
            .map(|n| (*n, &edits.device_nodes[*n as usize]))
        {
            assert_eq!(
                node.path,
                format!("/dev/nvidia-caps-imex-channels/channel{n}")
            );
            assert_eq!((node.major, node.minor), (Some(234), Some(i64::from(n))));
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
        inventory.stand_in_device = None;
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
            dev_root: None,
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

        write_spec_with(&cdi, uid, &devices, &inventory, &driver, None).unwrap();
        let spec = cdi.read_claim_spec(uid).unwrap().unwrap();
        // The toolkit's device brings its own nodes; ours only names the GPU.
        let first = &spec.devices[0].container_edits;
        assert!(first.device_nodes.is_empty());
        assert!(first.env[0].ends_with("GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"));
        let second = &spec.devices[1].container_edits;
        assert!(second.device_nodes.iter().any(|n| n.path == "/dev/nvidia1"));
        assert_eq!(spec.container_edits.mounts, vec![libcuda]);

        // When the toolkit names every device, the driver files come from it alone.
        write_spec_with(&cdi, uid, &devices[..1], &inventory, &driver, None).unwrap();
        let spec = cdi.read_claim_spec(uid).unwrap().unwrap();
        assert!(spec.container_edits.mounts.is_empty());
    }

    /// (path, hostPath, type, major, minor) of a device node.
    type NodeFields = (
        String,
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<i64>,
    );

    /// [`NodeFields`] of each node of the spec's first device.
    fn nodes(cdi: &CdiRegistry, inventory: &Inventory, driver: &DriverEdits) -> Vec<NodeFields> {
        let uid = "6c3e0f0a-3d4b-4a8e-9f00-1d2c3b4a5e6f";
        let devices = vec![device(cdi, uid, "gpu-1")];
        write_spec_with(cdi, uid, &devices, inventory, driver, None).unwrap();
        let spec = cdi.read_claim_spec(uid).unwrap().unwrap();
        spec.devices[0]
            .container_edits
            .device_nodes
            .iter()
            .map(|n| {
                let n = n.clone();
                (n.path, n.host_path, n.device_type, n.major, n.minor)
            })
            .collect()
    }

    #[test]
    fn device_nodes_carry_the_drivers_numbers_and_move_under_the_dev_root() {
        let root = tempfile::tempdir().unwrap();
        let cdi = CdiRegistry::new(root.path(), "gpu.dra.dev");
        let mut inventory = FakeBackend::new("node-a", "l40s-4")
            .unwrap()
            .inventory()
            .unwrap();
        // The fake backend's files exist on no host: no host path, /dev/null's numbers.
        let null = Some("c".to_string());
        let fake = nodes(&cdi, &inventory, &DriverEdits::default());
        let paths: Vec<&str> = fake.iter().map(|n| n.0.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/dev/nvidia1",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia-modeset"
            ]
        );
        assert!(fake
            .iter()
            .all(|n| (&n.1, &n.2, n.3, n.4) == (&None, &null, Some(1), Some(3))));

        // A real node's: the driver's numbers, and under the driver container's dev root.
        inventory.stand_in_device = None;
        inventory.device_majors = crate::gpu::DeviceMajors::parse(
            Path::new("/proc/devices"),
            "Character devices:\n195 nvidia-frontend\n237 nvidia-caps\n510 nvidia-uvm\n",
        );
        let driver = DriverEdits {
            dev_root: Some("/run/nvidia/driver".into()),
            ..Default::default()
        };
        let c = |path: &str, major, minor| {
            (
                path.to_string(),
                Some(format!("/run/nvidia/driver{path}")),
                Some("c".to_string()),
                Some(major),
                Some(minor),
            )
        };
        assert_eq!(
            nodes(&cdi, &inventory, &driver),
            [
                c("/dev/nvidia1", 195, 1),
                c("/dev/nvidiactl", 195, 255),
                c("/dev/nvidia-uvm", 510, 0),
                c("/dev/nvidia-uvm-tools", 510, 1),
                c("/dev/nvidia-modeset", 195, 254),
            ]
        );

        // Without the UVM module its files are still given, without numbers: the runtime takes them
        // from the host's files, or fails the container naming the missing one.
        inventory.device_majors.uvm = None;
        let real = nodes(&cdi, &inventory, &DriverEdits::default());
        assert_eq!(
            real[2],
            ("/dev/nvidia-uvm".to_string(), None, None, None, None)
        );
        assert_eq!(real[0].3, Some(195));
    }
}
