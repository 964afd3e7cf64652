//! One node's worth of doubles for tests and the benchmark: an API server with a Node, a scratch
//! directory laid out like a node's (registry, plugins, CDI root), plugin configs pointing into it, and
//! helpers to create and allocate claims.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, PostParams};

use super::apiserver::{ApiServer, FeatureGates, ServerVersion};
use super::kubelet::{ClaimRef, KubeletDouble};
use super::scheduler;
use crate::plugin::PluginConfig;

pub const DRIVER: &str = "gpu.dra.dev";
pub const NODE: &str = "node-a";
/// The DeviceClass for MIG devices, as `deploy/` ships it.
pub const MIG_CLASS: &str = "mig.gpu.dra.dev";

/// The DeviceClasses `deploy/` ships, so tests allocate with the selectors users get.
const DEVICE_CLASSES: &str = include_str!("../../deploy/base/deviceclasses.yaml");

/// Stores the DeviceClasses `deploy/` ships in the API server double.
pub fn install_device_classes(api: &ApiServer) {
    install_device_classes_from(api, DEVICE_CLASSES);
}

/// Stores the DeviceClasses of a YAML file of this repository (parsed by a test of its own).
fn install_device_classes_from(api: &ApiServer, yaml: &str) {
    for document in serde_yaml::Deserializer::from_str(yaml) {
        let class = serde_json::Value::deserialize(document).expect("DeviceClass YAML");
        api.insert("deviceclasses", class);
    }
}

/// NVIDIA's DeviceClasses as `deploy/components/nvidia-compat` ships them.
const NVIDIA_DEVICE_CLASSES: &str =
    include_str!("../../deploy/components/nvidia-compat/deviceclasses.yaml");

/// `deploy/components/extended-resource`'s patch: the whole-GPU class answers to `nvidia.com/gpu`.
const EXTENDED_RESOURCE_PATCH: &str =
    include_str!("../../deploy/components/extended-resource/deviceclass-patch.yaml");

pub struct Harness {
    pub api: ApiServer,
    pub dir: tempfile::TempDir,
    pub config: PluginConfig,
    /// The kubelet's part for the Pods the plugin makes (MPS daemons); runs while the harness lives,
    /// across plugin restarts.
    pub pods: super::pod_runner::PodRunner,
}

/// A test that ends without unpreparing its MPS claims leaves their tmpfs mounted under the harness's
/// directory, which the temp dir cannot remove: unmounted here, before the directory goes.
impl Drop for Harness {
    fn drop(&mut self) {
        let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
            return;
        };
        let root = self.dir.path();
        for point in mounts.lines().filter_map(|line| line.split(' ').nth(1)) {
            let point = std::path::Path::new(point);
            if point.starts_with(root) {
                let _ = crate::claims::mps::shm::unmount(point);
            }
        }
    }
}

impl Harness {
    /// An API server with Node `node-a` and a plugin config for the given fake profile.
    pub async fn new(profile: &str) -> Harness {
        Self::with_version(profile, ServerVersion::default()).await
    }

    /// [`Harness::new`] with an API server of the given Kubernetes version.
    pub async fn with_version(profile: &str, version: ServerVersion) -> Harness {
        Self::with_gates(profile, version, FeatureGates::all_enabled()).await
    }

    /// [`Harness::with_version`] with the given API server feature gates.
    pub async fn with_gates(profile: &str, version: ServerVersion, gates: FeatureGates) -> Harness {
        let api = ApiServer::start_with_gates(version, gates)
            .await
            .expect("API server double starts");
        api.insert(
            "nodes",
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}),
        );
        install_device_classes(&api);
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let config = PluginConfig {
            rescan_interval: Duration::from_millis(100),
            mps: crate::plugin::MpsConfig {
                image: Some("gpu-dra:test".to_string()),
                ..Default::default()
            },
            ..PluginConfig::fake_node_under(root, DRIVER, NODE, profile)
        };
        let pods = super::pod_runner::PodRunner::start(
            api.handle(),
            NODE,
            super::pod_runner::PodRunner::binary(),
        );
        Harness {
            api,
            dir,
            config,
            pods,
        }
    }

    /// A node whose plugin runs as `gpu.nvidia.com` (NVIDIA compatibility mode), with NVIDIA's
    /// DeviceClasses as `deploy/components/nvidia-compat` ships them (`gpu.nvidia.com`,
    /// `mig.nvidia.com`) beside ours, which then match nothing.
    pub async fn nvidia_compat(profile: &str) -> Harness {
        let mut harness = Self::new(profile).await;
        harness.config.driver_name = crate::api::NVIDIA_DRIVER_NAME.to_string();
        install_device_classes_from(&harness.api, NVIDIA_DEVICE_CLASSES);
        harness
    }

    /// Applies `deploy/components/extended-resource` to the installed DeviceClasses (a merge patch, as
    /// `kubectl patch` would); returns the class as the API server stored it.
    pub async fn apply_extended_resource_component(&self) -> DeviceClass {
        // The file is part of this repository and rendered by tests/manifests.
        let patch: serde_json::Value =
            serde_yaml::from_str(EXTENDED_RESOURCE_PATCH).expect("component patch YAML");
        let name = patch["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Api::<DeviceClass>::all(self.api.client())
            .patch(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .expect("class patched")
    }

    pub async fn start_plugin(&self) -> crate::plugin::RunningPlugin {
        crate::plugin::start(self.config.clone(), self.api.client())
            .await
            .expect("plugin starts")
    }

    pub async fn kubelet(&self) -> KubeletDouble {
        KubeletDouble::register(
            &self.config.registry_dir,
            &self.config.driver_name,
            Duration::from_secs(10),
        )
        .await
        .expect("kubelet registers the plugin")
    }

    pub fn cdi_dir(&self) -> PathBuf {
        self.config.cdi_root.clone()
    }

    /// CDI spec files in the CDI root (names only).
    pub fn cdi_files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.config.cdi_root)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    /// The slices of this driver on this node, once at least one exists (10 s at most).
    pub async fn wait_for_slices(&self) -> Vec<ResourceSlice> {
        self.wait_for_slices_where(|slices| !slices.is_empty())
            .await
    }

    /// The slices once every slice of the pool is there (the scheduler allocates from complete pools
    /// only; 1.35 splits a pool into a counters slice and one per GPU).
    pub async fn wait_for_whole_pool(&self) -> Vec<ResourceSlice> {
        self.wait_for_slices_where(|slices| {
            !slices.is_empty()
                && slices
                    .iter()
                    .all(|s| s.spec.pool.resource_slice_count as usize == slices.len())
        })
        .await
    }

    pub async fn wait_for_slices_where(
        &self,
        done: impl Fn(&[ResourceSlice]) -> bool,
    ) -> Vec<ResourceSlice> {
        let api: Api<ResourceSlice> = Api::all(self.api.client());
        let params = ListParams::default().fields(&format!(
            "spec.driver={},spec.nodeName={NODE}",
            self.config.driver_name
        ));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(list) = api.list(&params).await {
                if done(&list.items) {
                    return list.items;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "slices did not reach the expected state in 10 s"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Creates a claim for `count` GPUs in `default` and allocates it on this node; returns its reference.
    pub async fn allocated_claim(&self, name: &str, count: i64) -> ClaimRef {
        self.allocated_claim_with(name, gpus_request(count))
            .await
            .expect("claim allocated")
    }

    /// Creates a claim in `default` with the given `spec.devices` and allocates it on this node.
    pub async fn allocated_claim_with(
        &self,
        name: &str,
        devices: serde_json::Value,
    ) -> Result<ClaimRef, scheduler::AllocationError> {
        let uid = self.create_claim_with(name, devices).await;
        scheduler::allocate(
            &self.api.client(),
            "default",
            name,
            NODE,
            ("pod", "pod-uid"),
        )
        .await?;
        Ok(ClaimRef::new("default", name, uid))
    }

    /// The UUID of the whole GPU `device` (`gpu-<minor>`) names, as the backend knows it.
    pub fn gpu_uuid(&self, device: &str) -> String {
        use crate::gpu::GpuBackend;
        let minor: u32 = device
            .strip_prefix("gpu-")
            .and_then(|m| m.parse().ok())
            .unwrap_or_else(|| panic!("not a whole GPU's name: {device}"));
        let inventory = self.fake_backend().inventory().expect("fake inventory");
        inventory
            .gpus
            .iter()
            .find(|g| g.minor == minor)
            .unwrap_or_else(|| panic!("no GPU with minor {minor}"))
            .uuid
            .clone()
    }

    /// The fake GPUs as the plugin's backend sees them (same profile and state file).
    pub fn fake_backend(&self) -> crate::gpu::FakeBackend {
        match &self.config.backend {
            crate::plugin::BackendChoice::Fake {
                profile,
                state_file,
            } => crate::gpu::FakeBackend::with_state_file(NODE, profile, state_file.clone())
                .expect("fake backend"),
            other => panic!("not a fake backend: {other:?}"),
        }
    }

    /// Every MIG device on the fake GPUs, as (parent minor, placement start, UUID).
    pub fn mig_devices(&self) -> Vec<(u32, u32, String)> {
        use crate::gpu::GpuBackend;
        let inventory = self.fake_backend().inventory().expect("fake inventory");
        inventory
            .gpus
            .iter()
            .flat_map(|gpu| {
                gpu.mig.iter().flat_map(move |mig| {
                    mig.instances
                        .iter()
                        .map(move |i| (gpu.minor, i.placement.start, i.uuid.clone()))
                })
            })
            .collect()
    }

    /// Creates an unallocated claim for `count` GPUs in `default`; returns its UID.
    pub async fn create_claim(&self, name: &str, count: i64) -> String {
        self.create_claim_with(name, gpus_request(count)).await
    }

    /// Creates an unallocated claim in `default` with the given `spec.devices`; returns its UID.
    pub async fn create_claim_with(&self, name: &str, devices: serde_json::Value) -> String {
        let claims: Api<ResourceClaim> = Api::namespaced(self.api.client(), "default");
        let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": devices}
        }))
        .expect("claim JSON");
        let created = claims
            .create(&PostParams::default(), &claim)
            .await
            .expect("claim created");
        created.metadata.uid.unwrap_or_default()
    }
}

impl Harness {
    /// `gpu-dra plugin` as a separate process (the binary at `binary`) for this node, with the fake
    /// profile at `profile` and the API server reached through the kubeconfig at `kubeconfig`.
    pub fn plugin_command(
        &self,
        binary: &std::path::Path,
        profile: &std::path::Path,
        kubeconfig: &std::path::Path,
    ) -> std::process::Command {
        let mut command = std::process::Command::new(binary);
        command
            .arg("plugin")
            .args(["--node-name", NODE, "--backend", "fake", "--http-addr", ""])
            .arg("--fake-profile")
            .arg(profile)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--kubelet-registry-dir")
            .arg(&self.config.registry_dir)
            .arg("--kubelet-plugins-dir")
            .arg(&self.config.plugins_dir)
            .arg("--cdi-root")
            .arg(&self.config.cdi_root)
            // Tests that run in a CI Pod must not make the plugin check this node's directories
            // as hostPath volumes (the preflight does that only in a Pod).
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("RUST_LOG", "warn");
        command
    }

    /// `gpu-dra plugin` as a process of its own for this node, with its fake backend's state file and
    /// `extra_args`, paused for ever at `pause` (writing the marker file when it gets there) when given.
    pub fn plugin_process(
        &self,
        binary: &std::path::Path,
        extra_args: &[&str],
        pause: Option<(crate::claims::lifecycle::Step, &std::path::Path)>,
    ) -> PluginProcess {
        let kubeconfig = self.dir.path().join("kubeconfig");
        self.api.write_kubeconfig(&kubeconfig).expect("kubeconfig");
        let crate::plugin::BackendChoice::Fake {
            profile,
            state_file,
        } = &self.config.backend
        else {
            panic!("a fake backend")
        };
        let mut command = self.plugin_command(binary, std::path::Path::new(profile), &kubeconfig);
        command
            .args(extra_args)
            .arg("--fake-state")
            .arg(state_file.as_ref().expect("a state file"))
            .stdout(std::process::Stdio::null());
        if let Some((step, marker)) = pause {
            command
                .env("GPU_DRA_PAUSE_AT", step.as_str())
                .env("GPU_DRA_PAUSE_MARKER", marker);
        }
        PluginProcess(command.spawn().expect("plugin binary starts"))
    }

    /// The plugin binary at `binary` started as a separate process (stdout dropped) on `gpus` fake
    /// H100s; returns once it has registered with a kubelet double and published its slices.
    pub async fn spawn_plugin_process(
        &self,
        binary: &std::path::Path,
        gpus: usize,
    ) -> (std::process::Child, KubeletDouble) {
        let profile = self.write_h100_profile(gpus);
        let kubeconfig = self.dir.path().join("kubeconfig");
        self.api.write_kubeconfig(&kubeconfig).expect("kubeconfig");
        let plugin = self
            .plugin_command(binary, &profile, &kubeconfig)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("plugin binary starts");
        let kubelet = KubeletDouble::register(
            &self.config.registry_dir,
            &self.config.driver_name,
            Duration::from_secs(30),
        )
        .await
        .expect("plugin registers");
        self.wait_for_slices().await;
        (plugin, kubelet)
    }

    /// Runs the plugin on the fake `profile`, written as `<name>.yaml` in the scratch directory, with
    /// its GPU state (MIG devices) in `<name>-state.json` there.
    pub fn use_profile(&mut self, name: &str, profile: &crate::gpu::FakeProfile) {
        let path = self.dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, serde_yaml::to_string(profile).expect("profile YAML"))
            .expect("profile written");
        self.config.backend = crate::plugin::BackendChoice::Fake {
            profile: path.display().to_string(),
            state_file: Some(self.dir.path().join(format!("{name}-state.json"))),
        };
    }

    /// Writes a fake profile of `count` H100 GPUs into the scratch directory; returns its path.
    pub fn write_h100_profile(&self, count: usize) -> PathBuf {
        let path = self.dir.path().join(format!("h100-x{count}.yaml"));
        std::fs::write(
            &path,
            serde_yaml::to_string(&h100_profile(count)).expect("profile YAML"),
        )
        .expect("profile written");
        path
    }

    /// `allocated_claim` with a generated name, `claim-<n>`, for one GPU.
    pub async fn allocated_claim_named(&self, n: usize) -> ClaimRef {
        self.allocated_claim(&format!("claim-{n}"), 1).await
    }
}

/// A fake profile of `count` H100 80GB GPUs on one NVLink domain (the `dgx-h100` GPU repeated with
/// its own PCI address), MIG capable with MIG mode off. Only the first 32 are MIG capable: the
/// driver's MIG capability table has no files for higher GPU minors.
pub fn h100_profile(count: usize) -> crate::gpu::FakeProfile {
    let mut profile = crate::gpu::builtin_profile("dgx-h100").expect("built-in profile");
    let template = profile.gpus[0].clone();
    profile.gpus = (0..count)
        .map(|i| crate::gpu::FakeGpuSpec {
            pci_bus_id: format!("0000:{:02x}:00.0", (i % 255) + 1),
            mig_capable: template.mig_capable && i < 32,
            ..template.clone()
        })
        .collect();
    profile
}

/// Two H100s; an admin split the second into three MIG devices (3g.40gb at 0, 2g.20gb at 4, 1g.10gb
/// at 6), as static MIG mode publishes them.
pub fn admin_split_h100_profile() -> crate::gpu::FakeProfile {
    let mut profile = crate::gpu::builtin_profile("dgx-h100").expect("built-in profile");
    profile.gpus.truncate(2);
    profile.gpus[1].mig_enabled = true;
    profile.gpus[1].mig_instances = serde_yaml::from_str(
        "[{profile: 3g.40gb, start: 0}, {profile: 2g.20gb, start: 4}, {profile: 1g.10gb, start: 6}]",
    )
    .expect("MIG instances");
    profile
}

/// `spec.devices` of a claim for `count` whole GPUs.
fn gpus_request(count: i64) -> serde_json::Value {
    serde_json::json!({"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": count}}]})
}

/// A plugin process, killed when the test ends however it ends.
pub struct PluginProcess(std::process::Child);

impl PluginProcess {
    /// SIGKILL, and wait until it is gone.
    pub fn kill(&mut self) {
        self.0.kill().expect("SIGKILL");
        self.0.wait().expect("reaped");
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
