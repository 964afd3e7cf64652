//! Claim CDI specs on a real GPU node name host paths from the NVIDIA driver's root on the host, which the
//! plugin reads at a path of its own: under the GPU Operator's driver container (`/run/nvidia/driver`) and
//! with the driver installed on the host (`/`). Checked through the spec written to disk, as the container
//! runtime reads it, and loaded with the `container-device-interface` crate.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use container_device_interface::spec::read_spec;
use container_device_interface::version::minimum_required_version;
use gpu_dra::cdi::{CdiRegistry, DriverRoot, Spec};
use gpu_dra::claims::{DriverEdits, PreparedDevice, PreparedMig};
use gpu_dra::gpu::{DeviceMajors, FakeBackend, GpuBackend, Inventory};
use gpu_dra::support::cdi_runtime;

const DRIVER: &str = "gpu.dra.dev";
const CLAIM: &str = "3f2c1a9e-8b7d-4c6e-9a01-23456789abcd";

/// The spec's `cdiVersion` and the minimum the CDI crate computes for it, after loading it there.
fn versions(path: &Path) -> (String, String) {
    let spec = read_spec(&PathBuf::from(path), 0).unwrap_or_else(|e| panic!("{e:#}"));
    let minimum = minimum_required_version(&spec.cdi_spec).unwrap_or_else(|e| panic!("{e:#}"));
    let json: serde_json::Value = serde_json::from_slice(&fs::read(path).unwrap()).unwrap();
    (
        json["cdiVersion"].as_str().unwrap().to_owned(),
        minimum.to_string(),
    )
}

/// A driver root laid out like the GPU Operator's driver container (`/run/nvidia/driver` on the host):
/// the driver's libraries and tools, the Toolkit's hook binary, its own `/dev` with the device nodes
/// (plain files stand in for them), and its own `/etc/cdi` with a Toolkit spec that no runtime reads.
fn driver_container_root(version: &str) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let file = |path: &str, mode: u32| {
        let full = root.path().join(path);
        fs::create_dir_all(full.parent().unwrap()).unwrap();
        fs::write(&full, b"\x7fELF").unwrap();
        fs::set_permissions(&full, fs::Permissions::from_mode(mode)).unwrap();
    };
    file(&format!("usr/lib64/libcuda.so.{version}"), 0o644);
    file(&format!("usr/lib64/libnvidia-ml.so.{version}"), 0o644);
    file("usr/bin/nvidia-smi", 0o755);
    file("usr/bin/nvidia-cdi-hook", 0o755);
    for node in [
        "nvidia0",
        "nvidia1",
        "nvidiactl",
        "nvidia-caps/nvidia-cap30",
    ] {
        file(&format!("dev/{node}"), 0o666);
    }
    fs::create_dir_all(root.path().join("etc/cdi")).unwrap();
    fs::copy(
        toolkit_fixture("nvidia.yaml"),
        root.path().join("etc/cdi/nvidia.yaml"),
    )
    .unwrap();
    root
}

fn toolkit_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/toolkit")
        .join(name)
}

/// A claim with a whole GPU no Toolkit spec names, a MIG device the Toolkit's spec names, and a MIG
/// device created after the Toolkit wrote its spec (so not in it), on a node whose GPUs are
/// `GPU-4cf8db2d-…` (minor 0, in both fixtures) and `GPU-9a1e4f3b-…` (minor 1, only in `nvidia.yaml`).
fn claim_on_real_gpus(
    registry: &CdiRegistry,
    driver: &DriverEdits,
    inventory: &Inventory,
) -> Vec<PreparedDevice> {
    let mig = |uuid: &str, caps: &[&str]| PreparedMig {
        parent_uuid: inventory.gpus[0].uuid.clone(),
        uuid: uuid.into(),
        gpu_instance_id: 1,
        compute_instance_id: 0,
        device_files: caps.iter().map(|c| c.to_string()).collect(),
        created: true,
    };
    let device = |name: &str, mig: Option<PreparedMig>| PreparedDevice {
        request_names: vec!["gpus".into()],
        pool: "node-a".into(),
        device: name.into(),
        cdi_device_ids: vec![registry.qualified_device_id(CLAIM, name)],
        share_id: None,
        admin_access: false,
        mig,
        sharing: Default::default(),
        imex_channels: None,
    };
    let mut devices = vec![
        device("gpu-1", None),
        device(
            "gpu-0-mig-1g10gb-0",
            Some(mig(
                "MIG-0a3fd2c9-56a0-5b8e-9f3c-6d2e1b0a9f8e",
                &[
                    "/dev/nvidia-caps/nvidia-cap21",
                    "/dev/nvidia-caps/nvidia-cap22",
                ],
            )),
        ),
        device(
            "gpu-0-mig-3g40gb-4",
            Some(mig(
                "MIG-77f0c2a1-0d3e-5b4f-8a6c-1e2d3c4b5a69",
                &[
                    "/dev/nvidia-caps/nvidia-cap30",
                    "/dev/nvidia-caps/nvidia-cap31",
                ],
            )),
        ),
    ];
    for d in devices.iter_mut() {
        driver.reference_toolkit(inventory, d);
    }
    devices
}

fn real_gpu_inventory() -> Inventory {
    let mut inventory = FakeBackend::new("node-a", "l40s-4")
        .unwrap()
        .inventory()
        .unwrap();
    inventory.gpus[0].uuid = "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c".into();
    inventory.gpus[1].uuid = "GPU-9a1e4f3b-7c2d-4e8f-b5a6-0d1c2e3f4a5b".into();
    // As NVML reports it: real device nodes, no stand-in, the majors of the node's /proc/devices.
    inventory.stand_in_device = None;
    // A host without the nvidia-modeset module (its /dev has no nvidia-modeset), where the NVML
    // backend lists the control files without it; tests/cdi_parity.rs has the host with it.
    inventory
        .control_device_files
        .retain(|f| f != "/dev/nvidia-modeset");
    inventory.device_majors = DeviceMajors::parse(
        Path::new("/proc/devices"),
        "Character devices:\n  1 mem\n195 nvidia-frontend\n237 nvidia-caps\n510 nvidia-uvm\n",
    );
    inventory
}

/// The device nodes of one of the claim's devices: container path and host path.
fn nodes_of(spec: &Spec, device: &str) -> Vec<(String, Option<String>)> {
    let name = format!("{CLAIM}-{device}");
    let device = spec
        .devices
        .iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("{name} is not in the spec"));
    device
        .container_edits
        .device_nodes
        .iter()
        .map(|n| (n.path.clone(), n.host_path.clone()))
        .collect()
}

#[test]
fn under_the_gpu_operators_driver_root_claim_specs_name_host_paths_under_it() {
    let inventory = real_gpu_inventory();
    let version = inventory.driver_version.clone();
    let driver_root = driver_container_root(&version);
    let dir = tempfile::tempdir().unwrap();
    // The runtime's /var/run/cdi, where the Toolkit (under the GPU Operator) writes its spec.
    let cdi_root = dir.path().join("run-cdi");
    fs::create_dir_all(&cdi_root).unwrap();
    fs::copy(
        toolkit_fixture("nvidia-mig.yaml"),
        cdi_root.join("nvidia.yaml"),
    )
    .unwrap();
    let registry = CdiRegistry::new(&cdi_root, DRIVER);

    // The plugin sees the host's /run/nvidia/driver at a path of its own (here the temp dir).
    let root = DriverRoot::new("/run/nvidia/driver", driver_root.path()).unwrap();
    let driver = DriverEdits::discover(&root, &version, &cdi_root).unwrap();
    let devices = claim_on_real_gpus(&registry, &driver, &inventory);
    // Only the MIG device the runtime's Toolkit spec names is referenced: not gpu-1, which only the
    // driver container's own /etc/cdi names, nor the MIG device made after the Toolkit's spec.
    let referenced: Vec<_> = devices.iter().map(|d| d.cdi_device_ids.len()).collect();
    assert_eq!(referenced, [1, 2, 1]);
    assert_eq!(
        devices[1].cdi_device_ids[1],
        "nvidia.com/gpu=MIG-0a3fd2c9-56a0-5b8e-9f3c-6d2e1b0a9f8e"
    );

    driver
        .write_claim_spec(&registry, CLAIM, &devices, &inventory)
        .unwrap();
    let spec = registry.read_claim_spec(CLAIM).unwrap().unwrap();

    // Libraries and tools: mounted from the host's driver root, at the standard path.
    let mounts: Vec<(&str, &str)> = spec
        .container_edits
        .mounts
        .iter()
        .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
        .collect();
    let libcuda = format!("/usr/lib64/libcuda.so.{version}");
    assert!(
        mounts.contains(&(&format!("/run/nvidia/driver{libcuda}"), &libcuda)),
        "{mounts:?}"
    );
    assert!(mounts.contains(&(
        "/run/nvidia/driver/usr/bin/nvidia-smi",
        "/usr/bin/nvidia-smi"
    )));
    for (host, container) in &mounts {
        assert_eq!(*host, format!("/run/nvidia/driver{container}"));
    }
    // The hook runs on the host, from the driver root.
    assert!(!spec.container_edits.hooks.is_empty());
    for hook in &spec.container_edits.hooks {
        assert_eq!(hook.path, "/run/nvidia/driver/usr/bin/nvidia-cdi-hook");
    }

    // Device nodes come from the driver root's /dev, for the whole GPU and for the MIG device the
    // Toolkit's spec does not list; the listed one brings its own nodes.
    let under_root = |paths: &[&str]| -> Vec<(String, Option<String>)> {
        paths
            .iter()
            .map(|p| (p.to_string(), Some(format!("/run/nvidia/driver{p}"))))
            .collect()
    };
    let control = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];
    assert_eq!(
        nodes_of(&spec, "gpu-1"),
        under_root(&[&["/dev/nvidia1"][..], &control].concat())
    );
    assert_eq!(
        nodes_of(&spec, "gpu-0-mig-3g40gb-4"),
        under_root(
            &[
                &[
                    "/dev/nvidia0",
                    "/dev/nvidia-caps/nvidia-cap30",
                    "/dev/nvidia-caps/nvidia-cap31",
                ][..],
                &control,
            ]
            .concat()
        )
    );
    assert!(nodes_of(&spec, "gpu-0-mig-1g10gb-0").is_empty());

    // And the runtime's CDI library loads it, at the version hostPath needs.
    let (written, minimum) = versions(&registry.spec_path(CLAIM));
    assert_eq!(written, minimum);
    assert_eq!(minimum, "0.5.0");

    // The runtime creates the container from the spec's numbers: none of these files is on this host.
    let container =
        cdi_runtime::inject(&[&cdi_root], &our_ids(&devices)).unwrap_or_else(|e| panic!("{e}"));
    let numbers: Vec<(&str, &str, i64, i64)> = container
        .devices
        .iter()
        .map(|d| (d.path.as_str(), d.device_type.as_str(), d.major, d.minor))
        .collect();
    assert_eq!(
        numbers,
        [
            ("/dev/nvidia1", "c", 195, 1),
            ("/dev/nvidia0", "c", 195, 0),
            ("/dev/nvidia-caps/nvidia-cap30", "c", 237, 30),
            ("/dev/nvidia-caps/nvidia-cap31", "c", 237, 31),
            ("/dev/nvidiactl", "c", 195, 255),
            ("/dev/nvidia-uvm", "c", 510, 0),
            ("/dev/nvidia-uvm-tools", "c", 510, 1),
        ]
    );
}

/// The claim's devices of this driver (not the Toolkit's ones they may reference too).
fn our_ids(devices: &[PreparedDevice]) -> Vec<String> {
    devices
        .iter()
        .map(|d| d.cdi_device_ids[0].clone())
        .collect()
}

#[test]
fn with_the_driver_on_the_host_claim_specs_name_the_standard_paths_as_before() {
    let inventory = real_gpu_inventory();
    let version = inventory.driver_version.clone();
    // The host's root, mounted in the plugin's pod (here the temp dir): its /etc/cdi is the host's.
    let host_root = driver_container_root(&version);
    let dir = tempfile::tempdir().unwrap();
    let registry = CdiRegistry::new(dir.path(), DRIVER);

    let root = DriverRoot::new("/", host_root.path()).unwrap();
    let driver = DriverEdits::discover(&root, &version, dir.path()).unwrap();
    let devices = claim_on_real_gpus(&registry, &driver, &inventory);
    // The host's /etc/cdi/nvidia.yaml names both GPUs but no MIG device.
    let referenced: Vec<_> = devices.iter().map(|d| d.cdi_device_ids.len()).collect();
    assert_eq!(referenced, [2, 1, 1]);

    driver
        .write_claim_spec(&registry, CLAIM, &devices, &inventory)
        .unwrap();
    let spec = registry.read_claim_spec(CLAIM).unwrap().unwrap();
    let libcuda = format!("/usr/lib64/libcuda.so.{version}");
    assert!(spec
        .container_edits
        .mounts
        .iter()
        .any(|m| m.host_path == libcuda && m.container_path == libcuda));
    for mount in &spec.container_edits.mounts {
        assert_eq!(mount.host_path, mount.container_path);
    }
    assert_eq!(
        spec.container_edits.hooks[0].path,
        "/usr/bin/nvidia-cdi-hook"
    );
    // Device nodes at their own path on the host: no hostPath, as before.
    for device in ["gpu-0-mig-1g10gb-0", "gpu-0-mig-3g40gb-4"] {
        let nodes = nodes_of(&spec, device);
        assert!(!nodes.is_empty());
        assert!(nodes.iter().all(|(_, host)| host.is_none()), "{nodes:?}");
    }
    assert!(nodes_of(&spec, "gpu-1").is_empty());
    let (written, minimum) = versions(&registry.spec_path(CLAIM));
    assert_eq!(written, minimum);

    // The runtime creates the container from the spec's numbers: none of these files is on this host.
    let container =
        cdi_runtime::inject(&[dir.path()], &our_ids(&devices)).unwrap_or_else(|e| panic!("{e}"));
    assert!(!container.devices.is_empty());
}

/// The DaemonSet in `deploy/` must name, as the driver root on the host, the directory it mounts at
/// the container driver root, or every claim spec would point the runtime at the wrong files.
#[test]
fn the_daemonset_mounts_the_driver_root_it_names() {
    let text = fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/base/daemonset.yaml"),
    )
    .unwrap();
    let ds: serde_json::Value = serde_yaml::from_str(&text).unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let env = |name: &str| -> Option<String> {
        container["env"]
            .as_array()?
            .iter()
            .find(|e| e["name"] == name)?["value"]
            .as_str()
            .map(str::to_string)
    };
    let host_root = env("NVIDIA_DRIVER_ROOT").unwrap_or_else(|| "/".into());
    let container_root = env("CONTAINER_DRIVER_ROOT").unwrap_or_else(|| host_root.clone());
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == container_root.as_str())
        .unwrap_or_else(|| {
            panic!("nothing is mounted at the container driver root {container_root}")
        });
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(volume["hostPath"]["path"], host_root.as_str());
}
