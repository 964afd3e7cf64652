//! Checks that run before the plugin serves anything, for the DaemonSet mistakes that otherwise show only
//! as a plugin that crash-loops or runs without effect: a driver root that is not one, a kubelet
//! directory that is not a hostPath volume, a service account token without the node claim that the
//! admission policies key on. A failed check is told where an operator looks: one error line in the
//! log, the container's termination message, and a Warning Event on the plugin's Pod (its Node when
//! the plugin runs outside a Pod). Then the plugin exits. The hostPath check reads the mount table
//! (`mounts`), the token check asks the API server who the plugin is (`identity`).
//!
//! ```no_run
//! # async fn f(config: gpu_dra::plugin::PluginConfig, client: kube::Client) {
//! use gpu_dra::plugin::preflight::{DriverRootSetting, Environment, Preflight};
//! let roots = DriverRootSetting { host: "/".into(), container: Some("/driver-root".into()) };
//! let preflight = Preflight::new(&config, roots, Environment::detect("/dev/termination-log"));
//! if preflight.run(Some(&client)).await.is_err() {
//!     std::process::exit(1); // reported already: log, termination message, Event
//! }
//! # }
//! ```

mod identity;
mod mounts;

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder};
use thiserror::Error;
use tracing::{error, info, warn};

use super::node_events::{plugin_reporter, truncate_note, NodeEvents};
use super::{BackendChoice, PluginConfig};
use crate::cdi::{find_nvml_library, DriverRoot};
pub use identity::{judge_identity, who_am_i, Identity};
pub use mounts::{check_host_paths, KubeletDir, NotMounted};

/// The Event reason of a driver root that is missing or is no NVIDIA driver's root.
pub const REASON_DRIVER_ROOT_INVALID: &str = "DriverRootInvalid";
/// The Event reason of a kubelet or CDI directory that is not a hostPath volume.
pub const REASON_HOST_PATH_NOT_MOUNTED: &str = "HostPathNotMounted";
/// The Event reason of a service account token that names no node.
pub const REASON_TOKEN_WITHOUT_NODE_CLAIM: &str = "TokenWithoutNodeClaim";
/// The Event reason of a token bound to a Pod on another node than `--node-name`.
pub const REASON_NODE_NAME_MISMATCH: &str = "NodeNameMismatch";

/// The `extra` key the API server gives a pod-bound service account token (1.32 and later), and that
/// the admission policies in `deploy/base/admission-policy.yaml` take the plugin's node from.
pub const NODE_NAME_CLAIM: &str = "authentication.kubernetes.io/node-name";
/// Where the kubelet mounts a Pod's service account token.
pub const SERVICE_ACCOUNT_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
/// The kubelet's default `terminationMessagePath`.
pub const TERMINATION_LOG: &str = "/dev/termination-log";
/// The exit code of a plugin that refused to start.
pub const EXIT_CODE: i32 = 1;

/// How long the Events of a refusal may take: the API server may be what is unreachable.
const EVENT_TIMEOUT: Duration = Duration::from_secs(3);
/// The kubelet reads at most this much of a termination message.
const MAX_TERMINATION_MESSAGE: usize = 4096;
/// The driver roots an operator chooses between, for the messages.
const ROOTS_HINT: &str =
    "/ for a driver installed on the host, /run/nvidia/driver under the GPU Operator's driver container";

/// `--driver-root` and `--container-driver-root` as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverRootSetting {
    /// The driver root on the host (`NVIDIA_DRIVER_ROOT`).
    pub host: PathBuf,
    /// Where this process sees it (`CONTAINER_DRIVER_ROOT`); the host path itself when `None`.
    pub container: Option<PathBuf>,
}

impl DriverRootSetting {
    /// Where this process reads the driver root.
    fn seen_at(&self) -> &Path {
        self.container.as_deref().unwrap_or(&self.host)
    }

    /// The flag and path this process reads the driver root at, for messages.
    fn named(&self) -> String {
        match &self.container {
            Some(path) => format!(
                "--container-driver-root (CONTAINER_DRIVER_ROOT) {}",
                path.display()
            ),
            None => format!("--driver-root (NVIDIA_DRIVER_ROOT) {}", self.host.display()),
        }
    }

    /// What to change, for a root that is not the driver's.
    fn fix(&self) -> String {
        match &self.container {
            Some(container) => format!(
                "it must be the host's --driver-root (NVIDIA_DRIVER_ROOT) {host} mounted there: in the \
                 DaemonSet, the hostPath volume mounted at CONTAINER_DRIVER_ROOT {container} must have \
                 NVIDIA_DRIVER_ROOT as its path, and NVIDIA_DRIVER_ROOT must be the driver's root on the \
                 host ({ROOTS_HINT})",
                host = self.host.display(),
                container = container.display(),
            ),
            None => format!("set it to the driver's root on the host ({ROOTS_HINT})"),
        }
    }
}

/// What is wrong with the driver root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverRootProblem {
    Missing,
    NotADirectory,
    Unreadable(String),
    /// No `libnvidia-ml.so.*` where the driver installs it; `searched` lists the directories.
    NoNvmlLibrary {
        searched: String,
    },
    /// A path that cannot be used: relative, or a host path with `..` (CDI specs name it).
    Invalid(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PreflightError {
    #[error("{}", driver_root_text(.setting, .problem))]
    DriverRoot {
        setting: DriverRootSetting,
        problem: DriverRootProblem,
    },
    #[error("{}", host_paths_text(.dirs))]
    HostPathNotMounted { dirs: Vec<NotMounted> },
    #[error(
        "the plugin's service account token names no node: the API server says this is {user} \
         (SelfSubjectReview) with no extra[{NODE_NAME_CLAIM}], so the admission policies of \
         deploy/base/admission-policy.yaml will refuse its ResourceSlice writes; run the plugin with \
         its Pod's own projected service account token (automountServiceAccountToken, not a Secret's \
         long-lived token) on Kubernetes 1.32 or later"
    )]
    TokenWithoutNodeClaim { user: String },
    #[error(
        "--node-name (NODE_NAME) is {node}, but the plugin's service account token ({user}) is bound \
         to a Pod on node {token_node} (SelfSubjectReview, extra[{NODE_NAME_CLAIM}]), so the admission \
         policies of deploy/base/admission-policy.yaml will refuse its writes for {node}; set NODE_NAME \
         from the Pod's spec.nodeName (env valueFrom fieldRef)"
    )]
    NodeNameMismatch {
        user: String,
        token_node: String,
        node: String,
    },
}

impl PreflightError {
    /// The Event reason, also the first word of the termination message.
    pub fn reason(&self) -> &'static str {
        match self {
            PreflightError::DriverRoot { .. } => REASON_DRIVER_ROOT_INVALID,
            PreflightError::HostPathNotMounted { .. } => REASON_HOST_PATH_NOT_MOUNTED,
            PreflightError::TokenWithoutNodeClaim { .. } => REASON_TOKEN_WITHOUT_NODE_CLAIM,
            PreflightError::NodeNameMismatch { .. } => REASON_NODE_NAME_MISMATCH,
        }
    }
}

fn driver_root_text(setting: &DriverRootSetting, problem: &DriverRootProblem) -> String {
    let named = setting.named();
    let fix = setting.fix();
    match problem {
        DriverRootProblem::Missing => {
            format!("the NVIDIA driver root is not there: {named} does not exist in this container; {fix}")
        }
        DriverRootProblem::NotADirectory => {
            format!("the NVIDIA driver root is not there: {named} is not a directory; {fix}")
        }
        DriverRootProblem::Unreadable(reason) => {
            format!("the NVIDIA driver root cannot be read: {named}: {reason}; {fix}")
        }
        DriverRootProblem::NoNvmlLibrary { searched } => format!(
            "{named} is not an NVIDIA driver root: it holds no libnvidia-ml.so (searched {searched}); \
             {fix}; under the GPU Operator, the driver container may also still be installing the \
             driver, and the plugin starts once it is there"
        ),
        DriverRootProblem::Invalid(reason) => format!(
            "the NVIDIA driver root cannot be used: {reason}; --driver-root (NVIDIA_DRIVER_ROOT) must be \
             the absolute path of the driver's root on the host ({ROOTS_HINT}), and \
             --container-driver-root (CONTAINER_DRIVER_ROOT) the absolute path this container sees it at"
        ),
    }
}

fn host_paths_text(dirs: &[NotMounted]) -> String {
    let each: Vec<String> = dirs
        .iter()
        .map(|d| {
            format!(
                "{} {} {} ({})",
                d.dir.flag,
                d.dir.path.display(),
                d.found,
                d.dir.seen_by
            )
        })
        .collect();
    format!(
        "the host never sees what the plugin puts in these directories, as they are not hostPath \
         volumes: {}; mount each as a hostPath volume of the same host directory at the same path \
         (deploy/base/daemonset.yaml: volumes plugins-registry, plugins, cdi)",
        each.join("; ")
    )
}

/// Checks the driver root: for `--backend nvml` the directory this process reads it at must hold the
/// driver's libnvidia-ml (unless it is `/`, where the loader finds the library its own way); for
/// `--backend fake` only a `--container-driver-root` that is given must exist.
pub fn check_driver_root(
    backend: &BackendChoice,
    setting: &DriverRootSetting,
) -> Result<(), PreflightError> {
    let problem = |problem| PreflightError::DriverRoot {
        setting: setting.clone(),
        problem,
    };
    let nvml = matches!(backend, BackendChoice::Nvml { .. });
    if !nvml && setting.container.is_none() {
        return Ok(());
    }
    let seen_at = setting.seen_at();
    if nvml {
        DriverRoot::new(&setting.host, seen_at)
            .map_err(|e| problem(DriverRootProblem::Invalid(e.to_string())))?;
    }
    match std::fs::metadata(seen_at) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Err(problem(DriverRootProblem::NotADirectory)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(problem(DriverRootProblem::Missing))
        }
        Err(e) => return Err(problem(DriverRootProblem::Unreadable(e.to_string()))),
    }
    if nvml && seen_at != Path::new("/") {
        find_nvml_library(seen_at)
            .map_err(|searched| problem(DriverRootProblem::NoNvmlLibrary { searched }))?;
    }
    Ok(())
}

/// Where the plugin runs, as far as the checks care.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Environment {
    /// In a Kubernetes Pod: `KUBERNETES_SERVICE_HOST` is set and a service account token is mounted.
    /// Outside one (the plugin started on the host) the hostPath and token checks do not apply.
    pub in_pod: bool,
    /// This process's mount table (`/proc/self/mountinfo`).
    pub mountinfo: PathBuf,
    /// The container's termination message file; written only when it exists.
    pub termination_log: PathBuf,
}

impl Environment {
    pub fn detect(termination_log: impl Into<PathBuf>) -> Self {
        let service = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some_and(|h| !h.is_empty());
        Environment {
            in_pod: service && Path::new(SERVICE_ACCOUNT_TOKEN).is_file(),
            mountinfo: PathBuf::from("/proc/self/mountinfo"),
            termination_log: termination_log.into(),
        }
    }
}

/// The plugin's own Pod, where the Events of a refusal go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnPod {
    pub namespace: String,
    pub name: String,
}

/// The checks of one plugin start.
#[derive(Debug, Clone)]
pub struct Preflight {
    pub driver_name: String,
    pub node_name: String,
    pub backend: BackendChoice,
    pub driver_root: DriverRootSetting,
    pub kubelet_dirs: Vec<KubeletDir>,
    /// `POD_NAME` in `POD_NAMESPACE`; the Node gets the Events without it.
    pub pod: Option<OwnPod>,
    pub environment: Environment,
    /// How long the SelfSubjectReview may take before the plugin goes on without it.
    pub identity_timeout: Duration,
}

impl Preflight {
    pub fn new(
        config: &PluginConfig,
        driver_root: DriverRootSetting,
        environment: Environment,
    ) -> Self {
        let dir = |flag, path: &PathBuf, seen_by| KubeletDir {
            flag,
            path: path.clone(),
            seen_by,
        };
        Preflight {
            driver_name: config.driver_name.clone(),
            node_name: config.node_name.clone(),
            backend: config.backend.clone(),
            driver_root,
            kubelet_dirs: vec![
                dir(
                    "--kubelet-registry-dir (KUBELET_REGISTRY_DIR)",
                    &config.registry_dir,
                    "the kubelet finds the plugin's registration socket there",
                ),
                dir(
                    "--kubelet-plugins-dir (KUBELET_PLUGINS_DIR)",
                    &config.plugins_dir,
                    "the kubelet dials the plugin's DRA socket there",
                ),
                dir(
                    "--cdi-root (CDI_ROOT)",
                    &config.cdi_root,
                    "the container runtime reads the claims' CDI specs there",
                ),
            ],
            pod: config.mps.own_pod.as_ref().map(|name| OwnPod {
                namespace: config.mps.namespace.clone(),
                name: name.clone(),
            }),
            environment,
            identity_timeout: config.startup_api_timeout,
        }
    }

    /// The checks that need no API server: the driver root, and in a Pod the hostPath volumes.
    pub fn check_local(&self) -> Vec<PreflightError> {
        let mut failed = Vec::new();
        if let Err(e) = check_driver_root(&self.backend, &self.driver_root) {
            failed.push(e);
        }
        if self.environment.in_pod {
            match std::fs::read_to_string(&self.environment.mountinfo) {
                Ok(mountinfo) => {
                    if let Err(e) = check_host_paths(&self.kubelet_dirs, &mountinfo) {
                        failed.push(e);
                    }
                }
                Err(error) => warn!(
                    %error,
                    mountinfo = %self.environment.mountinfo.display(),
                    "cannot read the mount table; not checking that the kubelet directories are hostPath volumes"
                ),
            }
        }
        failed
    }

    /// In a Pod: the token's node claim, from a SelfSubjectReview. When the API server cannot answer it
    /// (before 1.28, not allowed, unreachable) the plugin goes on: no refusal on uncertainty.
    pub async fn check_identity(&self, client: &kube::Client) -> Result<(), PreflightError> {
        if !self.environment.in_pod {
            return Ok(());
        }
        let user = match tokio::time::timeout(self.identity_timeout, who_am_i(client)).await {
            Ok(Ok(user)) => user,
            Ok(Err(error)) => {
                warn!(%error, "cannot ask the API server who this plugin is (SelfSubjectReview); not checking its token's node claim");
                return Ok(());
            }
            Err(_) => {
                warn!(
                    timeout_ms = self.identity_timeout.as_millis() as u64,
                    "the API server did not answer who this plugin is (SelfSubjectReview) in time; not checking its token's node claim"
                );
                return Ok(());
            }
        };
        match judge_identity(&user, &self.node_name)? {
            Identity::BoundToThisNode { user } => {
                info!(%user, node = %self.node_name, "the service account token is bound to a Pod on this node")
            }
            Identity::NotServiceAccount { user } => {
                info!(%user, "not a service account: the admission policies do not apply to this identity")
            }
        }
        Ok(())
    }

    /// Runs every check; on failures reports each ([`Preflight::report`]) and returns them. `client` is
    /// `None` when none could be made: the token is not checked then and no Event is posted.
    pub async fn run(&self, client: Option<&kube::Client>) -> Result<(), Vec<PreflightError>> {
        let mut failed = self.check_local();
        if let Some(client) = client {
            if let Err(e) = self.check_identity(client).await {
                failed.push(e);
            }
        }
        if failed.is_empty() {
            return Ok(());
        }
        self.report(&failed, client).await;
        Err(failed)
    }

    /// Tells the operator why the plugin refuses to start: an error line per failure, the termination
    /// message, and a Warning Event per failure, bounded in time so that an unreachable API server
    /// never holds up the exit.
    pub async fn report(&self, failed: &[PreflightError], client: Option<&kube::Client>) {
        for failure in failed {
            error!(reason = failure.reason(), "refusing to start: {failure}");
        }
        let message: Vec<String> = failed
            .iter()
            .map(|f| format!("{}: {f}", f.reason()))
            .collect();
        write_termination_message(&self.environment.termination_log, &message.join("\n"));
        let Some(client) = client else {
            warn!("no Kubernetes client: the refusal is not posted as an Event");
            return;
        };
        let posted = futures::future::join_all(failed.iter().map(|f| self.post_event(client, f)));
        if tokio::time::timeout(EVENT_TIMEOUT, posted).await.is_err() {
            warn!(
                timeout_ms = EVENT_TIMEOUT.as_millis() as u64,
                "the API server did not take the Event of the refusal in time; exiting without it"
            );
        }
    }

    async fn post_event(&self, client: &kube::Client, failure: &PreflightError) {
        let note = failure.to_string();
        let Some(pod) = &self.pod else {
            NodeEvents::new(client.clone(), &self.driver_name, &self.node_name)
                .warn(failure.reason(), "Start", &note)
                .await;
            return;
        };
        // The Pod's UID makes `kubectl describe pod` show the Event; without it the Event still lists.
        let pods: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
        let uid = pods
            .get_opt(&pod.name)
            .await
            .ok()
            .flatten()
            .and_then(|p| p.metadata.uid);
        let reference = ObjectReference {
            api_version: Some("v1".to_string()),
            kind: Some("Pod".to_string()),
            namespace: Some(pod.namespace.clone()),
            name: Some(pod.name.clone()),
            uid,
            ..Default::default()
        };
        let reporter = plugin_reporter(&self.driver_name, &self.node_name);
        let event = Event {
            type_: EventType::Warning,
            reason: failure.reason().to_string(),
            note: Some(truncate_note(&note)),
            action: "Start".to_string(),
            secondary: None,
        };
        let recorder = Recorder::new(client.clone(), reporter);
        if let Err(error) = recorder.publish(&event, &reference).await {
            warn!(%error, reason = failure.reason(), "could not record the refusal as an Event on the plugin's Pod");
        }
    }
}

/// Writes the container's termination message, which the kubelet shows as the container's last state,
/// when the file exists (the kubelet makes it in a container; elsewhere nothing is written).
fn write_termination_message(path: &Path, message: &str) {
    use std::io::Write;
    let mut end = message.len().min(MAX_TERMINATION_MESSAGE);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path);
    match file.and_then(|mut f| f.write_all(&message.as_bytes()[..end])) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            warn!(%error, path = %path.display(), "could not write the termination message")
        }
    }
}

#[cfg(test)]
mod tests;
