//! What the plugin runs with: the backend, the kubelet's and CDI's directories, the API server's
//! timeouts and the MPS daemons' Pods, as `gpu-dra plugin`'s flags (or a test) set them, and the
//! socket and directory paths that follow from them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::startup;
use crate::apiclient::ApiTimeouts;
use crate::claims;
use crate::devices::MigMode;

/// Which GPU backend to read the node from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendChoice {
    Nvml {
        /// Where this process sees the NVIDIA driver's root (a hostPath mount of it); `/` on a bare host.
        driver_root: PathBuf,
        /// The same driver root on the host, which claim CDI specs name: `/` for a driver installed on
        /// the host, `/run/nvidia/driver` under the GPU Operator's driver container.
        host_driver_root: PathBuf,
    },
    /// A built-in fake profile name or a YAML profile path.
    Fake {
        profile: String,
        /// Where the fake GPUs keep their MIG state across plugin restarts; in memory when `None`.
        state_file: Option<PathBuf>,
    },
}

#[derive(Debug, Clone)]
pub struct PluginConfig {
    pub driver_name: String,
    pub node_name: String,
    pub registry_dir: PathBuf,
    pub plugins_dir: PathBuf,
    pub cdi_root: PathBuf,
    pub backend: BackendChoice,
    /// `None` disables the HTTP endpoints.
    pub http_addr: Option<SocketAddr>,
    /// How often the backend is asked whether the GPUs changed.
    pub rescan_interval: Duration,
    /// `--mig-mode`; a GpuNodePolicy that sets one takes precedence, from the start.
    pub mig_mode: MigMode,
    /// NVIDIA's `--consumable-shares` (only under NVIDIA's driver name): what the node shares where
    /// no GpuNodePolicy in force sets `spec.sharing`.
    pub consumable_shares: Option<crate::devices::Shares>,
    /// How long start-up waits for the API server (the GpuNodePolicy, a checkpoint rebuild).
    pub startup_api_timeout: Duration,
    /// Timeouts towards the API server: the client's, the watches', and the per-claim budget of a
    /// prepare. The client built by [`kube_client`](super::kube_client) must be made with the same
    /// values.
    pub api: ApiTimeouts,
    /// How MPS control daemons are run: each in a Pod of its own.
    pub mps: MpsConfig,
    /// How long one change of a GPU's sharing mode may take before the GPU counts as stuck.
    pub sharing_timeout: Duration,
    /// How long a kubelet call waits for its claims' work before it answers
    /// ([`CALL_BUDGET`](crate::claims::CALL_BUDGET)); the work goes on after that.
    pub call_budget: Duration,
    /// How long one MIG create or destroy may take before the GPU counts as stuck.
    pub mig_timeout: Duration,
    /// IMEX channels and ComputeDomains.
    pub domains: crate::domains::membership::DomainsConfig,
    /// How long each part of the start may take before `/healthz` fails naming it; `None`: from
    /// the timeouts above ([`PartBounds::for_timeouts`](super::PartBounds::for_timeouts)).
    pub start_bounds: Option<super::PartBounds>,
}

/// Where and how the Pods of MPS control daemons run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsConfig {
    /// The plugin's namespace; the daemons' Pods are made there.
    pub namespace: String,
    /// The plugin's own Pod (`POD_NAME`), whose image the daemons run unless `image` is set.
    pub own_pod: Option<String>,
    pub image: Option<String>,
    /// The size limit of each claim's shared-memory tmpfs, in bytes, unless the claim's MPS config
    /// says otherwise (`shmSize`).
    pub shm_size: u64,
    /// Under NVIDIA's driver name: the namespace of NVIDIA's plugin, whose MPS daemons' Deployments
    /// are deleted with the claims taken over from it.
    pub nvidia_namespace: String,
}

impl Default for MpsConfig {
    fn default() -> Self {
        MpsConfig {
            namespace: "gpu-dra".to_string(),
            own_pod: None,
            image: None,
            shm_size: crate::claims::mps::shm::DEFAULT_SIZE,
            nvidia_namespace: crate::claims::DEFAULT_NVIDIA_NAMESPACE.to_string(),
        }
    }
}

impl PluginConfig {
    /// A node laid out under one directory (`plugins_registry/`, `plugins/`, `cdi/`, the fake GPU
    /// state `fake-gpu-state.json`) with the fake backend, static MIG, HTTP off and a 5 s rescan:
    /// what the demo, the tests and the benchmark run.
    pub fn fake_node_under(
        root: &std::path::Path,
        driver: &str,
        node: &str,
        profile: &str,
    ) -> Self {
        PluginConfig {
            driver_name: driver.to_string(),
            node_name: node.to_string(),
            registry_dir: root.join("plugins_registry"),
            plugins_dir: root.join("plugins"),
            cdi_root: root.join("cdi"),
            backend: BackendChoice::Fake {
                profile: profile.to_string(),
                state_file: Some(root.join("fake-gpu-state.json")),
            },
            http_addr: None,
            rescan_interval: Duration::from_secs(5),
            mig_mode: MigMode::Static,
            consumable_shares: None,
            startup_api_timeout: startup::DEFAULT_STARTUP_API_TIMEOUT,
            api: ApiTimeouts::default(),
            mps: MpsConfig::default(),
            sharing_timeout: claims::SHARING_TIMEOUT,
            call_budget: claims::CALL_BUDGET,
            mig_timeout: claims::MIG_TIMEOUT,
            domains: Default::default(),
            start_bounds: None,
        }
    }

    /// The DRA socket: `<plugins-dir>/<driver>/dra.sock`.
    pub fn dra_socket(&self) -> PathBuf {
        self.plugin_dir().join("dra.sock")
    }

    /// The registration socket: `<registry-dir>/<driver>-reg.sock`.
    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir
            .join(format!("{}-reg.sock", self.driver_name))
    }

    /// The plugin's own directory: the DRA socket and the checkpoint live here.
    pub fn plugin_dir(&self) -> PathBuf {
        self.plugins_dir.join(&self.driver_name)
    }
}
