//! The claim specs of a real GPU node against what NVIDIA's CDI specs give a container (the Container
//! Toolkit's CDI library, as NVIDIA's DRA plugin uses it): the toolkit's hooks in its order with its
//! arguments where its hook binary is on the node and knows them, none where it is not, and
//! `/dev/nvidia-modeset` only where the host has it. Checked through the spec written to disk, loaded
//! with the `container-device-interface` crate and injected by the runtime double.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use container_device_interface::spec::read_spec;
use container_device_interface::version::minimum_required_version;
use gpu_dra::cdi::{CdiRegistry, DriverRoot, Hook, Spec};
use gpu_dra::claims::{DriverEdits, PreparedDevice};
use gpu_dra::gpu::device_files::{control_device_files, has_modeset};
use gpu_dra::gpu::{DeviceMajors, FakeBackend, GpuBackend, Inventory};
use gpu_dra::support::cdi_runtime;

const DRIVER: &str = "gpu.dra.dev";
const CLAIM: &str = "5b1d7e3a-2c4f-4d6e-8a9b-0c1d2e3f4a5b";
const HOOK: &str = "/usr/bin/nvidia-cdi-hook";

/// Which Container Toolkit release's hook binary the node has, by the hook names compiled into it.
#[derive(Clone, Copy)]
enum Toolkit {
    /// None on the node.
    Absent,
    /// v1.16.0 to v1.17.4: create-symlinks and update-ldcache only.
    V1_17_4,
    /// v1.18.0 and later: enable-cuda-compat and disable-device-node-modification too.
    V1_18,
}

/// What the host's `/dev/nvidia-modeset` is.
#[derive(Clone, Copy)]
enum Modeset {
    /// A character device (`/dev/null` stands in: tests cannot mknod).
    Device,
    /// A plain file of that name.
    PlainFile,
    Absent,
}

/// A host whose driver is installed at `/`: its libraries, nvidia-smi, the toolkit's hook binary of
/// `toolkit`'s release, and `/dev` with or without nvidia-modeset.
fn host_root(version: &str, toolkit: Toolkit, modeset: Modeset) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let file = |path: &str, content: &[u8], mode: u32| {
        let full = root.path().join(path);
        fs::create_dir_all(full.parent().unwrap()).unwrap();
        fs::write(&full, content).unwrap();
        fs::set_permissions(&full, fs::Permissions::from_mode(mode)).unwrap();
    };
    file(
        &format!("usr/lib64/libcuda.so.{version}"),
        b"\x7fELF",
        0o644,
    );
    file(
        &format!("usr/lib64/libnvidia-ml.so.{version}"),
        b"\x7fELF",
        0o644,
    );
    file("usr/bin/nvidia-smi", b"\x7fELF", 0o755);
    let base = b"\x7fELF\0create-symlinks\0update-ldcache\0".to_vec();
    match toolkit {
        Toolkit::Absent => {}
        Toolkit::V1_17_4 => file(&HOOK[1..], &base, 0o755),
        Toolkit::V1_18 => {
            let full = [
                &base[..],
                b"enable-cuda-compat\0disable-device-node-modification\0",
            ]
            .concat();
            file(&HOOK[1..], &full, 0o755)
        }
    }
    fs::create_dir_all(root.path().join("dev")).unwrap();
    let modeset_path = root.path().join("dev/nvidia-modeset");
    match modeset {
        Modeset::Device => std::os::unix::fs::symlink("/dev/null", &modeset_path).unwrap(),
        Modeset::PlainFile => fs::write(&modeset_path, b"").unwrap(),
        Modeset::Absent => {}
    }
    root
}

/// The inventory NVML gives on that host: real device nodes with the node's majors, and the control
/// files as the NVML backend lists them, with nvidia-modeset where the root's `/dev` has it.
fn inventory_of(root: &Path) -> Inventory {
    let mut inventory = FakeBackend::new("node-a", "l40s-4")
        .unwrap()
        .inventory()
        .unwrap();
    inventory.stand_in_device = None;
    inventory.device_majors = DeviceMajors::parse(
        Path::new("/proc/devices"),
        "Character devices:\n195 nvidia-frontend\n237 nvidia-caps\n510 nvidia-uvm\n",
    );
    inventory.control_device_files = control_device_files(has_modeset(&root.join("dev")));
    inventory
}

/// The spec of a claim of gpu-1 on that host, as written to disk, and its path.
fn claim_spec(toolkit: Toolkit, modeset: Modeset) -> (Spec, PathBuf, tempfile::TempDir) {
    let probe = FakeBackend::new("node-a", "l40s-4").unwrap();
    let version = probe.inventory().unwrap().driver_version;
    let root = host_root(&version, toolkit, modeset);
    let inventory = inventory_of(root.path());
    let cdi = tempfile::tempdir().unwrap();
    let registry = CdiRegistry::new(cdi.path(), DRIVER);
    let driver_root = DriverRoot::new("/", root.path()).unwrap();
    let driver = DriverEdits::discover(&driver_root, &version, cdi.path()).unwrap();
    let device = PreparedDevice {
        request_names: vec!["gpu".into()],
        pool: "node-a".into(),
        device: "gpu-1".into(),
        cdi_device_ids: vec![registry.qualified_device_id(CLAIM, "gpu-1")],
        share_id: None,
        admin_access: false,
        mig: None,
        sharing: Default::default(),
        imex_channels: None,
    };
    driver
        .write_claim_spec(&registry, CLAIM, &[device], &inventory)
        .unwrap();
    let spec = registry.read_claim_spec(CLAIM).unwrap().unwrap();
    let path = registry.spec_path(CLAIM);
    // The runtime's CDI library loads it at the version written, and a runtime makes the container.
    let loaded = read_spec(&path, 0).unwrap_or_else(|e| panic!("{e:#}"));
    let minimum = minimum_required_version(&loaded.cdi_spec).unwrap();
    assert_eq!(spec.cdi_version, minimum.to_string());
    let id = registry.qualified_device_id(CLAIM, "gpu-1");
    cdi_runtime::inject(&[cdi.path()], &[id]).unwrap_or_else(|e| panic!("{e}"));
    (spec, path, cdi)
}

fn hook(args: &[&str]) -> Hook {
    Hook {
        hook_name: "createContainer".into(),
        path: HOOK.into(),
        args: args.iter().map(|a| a.to_string()).collect(),
        env: vec!["NVIDIA_CTK_DEBUG=false".into()],
        timeout: None,
    }
}

/// (path, type, major, minor) of gpu-1's device nodes.
fn nodes(spec: &Spec) -> Vec<(String, String, i64, i64)> {
    spec.devices[0]
        .container_edits
        .device_nodes
        .iter()
        .map(|n| {
            let n = n.clone();
            (
                n.path,
                n.device_type.unwrap_or_default(),
                n.major.unwrap_or(-1),
                n.minor.unwrap_or(-1),
            )
        })
        .collect()
}

fn node(path: &str, major: i64, minor: i64) -> (String, String, i64, i64) {
    (path.into(), "c".into(), major, minor)
}

#[test]
fn with_the_toolkits_hook_binary_the_spec_has_its_four_hooks_in_its_order_and_nvidia_modeset() {
    let (spec, _, _dir) = claim_spec(Toolkit::V1_18, Modeset::Device);
    let version = FakeBackend::new("node-a", "l40s-4")
        .unwrap()
        .inventory()
        .unwrap()
        .driver_version;
    let libcuda = format!("libcuda.so.{version}");
    let libnvml = format!("libnvidia-ml.so.{version}");
    let version_arg = format!("--host-driver-version={version}");
    assert_eq!(
        spec.container_edits.hooks,
        [
            hook(&[
                "nvidia-cdi-hook",
                "create-symlinks",
                "--link",
                &format!("{libcuda}::/usr/lib64/libcuda.so.1"),
                "--link",
                "libcuda.so.1::/usr/lib64/libcuda.so",
                "--link",
                &format!("{libnvml}::/usr/lib64/libnvidia-ml.so.1"),
            ]),
            hook(&["nvidia-cdi-hook", "enable-cuda-compat", &version_arg]),
            hook(&[
                "nvidia-cdi-hook",
                "update-ldcache",
                "--folder",
                "/usr/lib64"
            ]),
            hook(&["nvidia-cdi-hook", "disable-device-node-modification"]),
        ]
    );
    assert_eq!(
        spec.container_edits.env,
        [
            "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib64",
            "NVIDIA_VISIBLE_DEVICES=void"
        ]
    );
    let mounts: Vec<&str> = spec
        .container_edits
        .mounts
        .iter()
        .map(|m| m.container_path.as_str())
        .collect();
    assert_eq!(
        mounts,
        [
            format!("/usr/lib64/{libcuda}").as_str(),
            &format!("/usr/lib64/{libnvml}"),
            "/usr/bin/nvidia-smi"
        ]
    );
    assert_eq!(
        nodes(&spec),
        [
            node("/dev/nvidia1", 195, 1),
            node("/dev/nvidiactl", 195, 255),
            node("/dev/nvidia-uvm", 510, 0),
            node("/dev/nvidia-uvm-tools", 510, 1),
            node("/dev/nvidia-modeset", 195, 254),
        ]
    );
}

#[test]
fn an_older_toolkits_hook_binary_gets_only_the_hooks_it_knows() {
    let (spec, _, _dir) = claim_spec(Toolkit::V1_17_4, Modeset::Device);
    let names: Vec<&str> = spec
        .container_edits
        .hooks
        .iter()
        .map(|h| h.args[1].as_str())
        .collect();
    assert_eq!(names, ["create-symlinks", "update-ldcache"]);
}

#[test]
fn without_a_hook_binary_the_spec_has_no_hooks_but_the_same_files_and_nodes() {
    let (spec, path, _dir) = claim_spec(Toolkit::Absent, Modeset::Device);
    assert!(spec.container_edits.hooks.is_empty(), "{path:?}");
    assert_eq!(spec.container_edits.mounts.len(), 3);
    assert_eq!(
        spec.container_edits.env,
        [
            "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib64",
            "NVIDIA_VISIBLE_DEVICES=void"
        ]
    );
    assert_eq!(nodes(&spec)[4], node("/dev/nvidia-modeset", 195, 254));
}

#[test]
fn without_nvidia_modeset_on_the_host_the_spec_never_names_it() {
    for modeset in [Modeset::Absent, Modeset::PlainFile] {
        let (spec, _, _dir) = claim_spec(Toolkit::V1_18, modeset);
        assert_eq!(
            nodes(&spec),
            [
                node("/dev/nvidia1", 195, 1),
                node("/dev/nvidiactl", 195, 255),
                node("/dev/nvidia-uvm", 510, 0),
                node("/dev/nvidia-uvm-tools", 510, 1),
            ]
        );
        assert_eq!(spec.container_edits.hooks.len(), 4);
    }
}
