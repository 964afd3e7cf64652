//! The kubelet's part for the Pods the plugin makes itself (its MPS daemons): a loop that finds the
//! Pods bound to its node in the API server, runs each Pod's container as a local process and reports
//! its status as the kubelet does (phase, container state, restart count, the Ready condition from
//! the exec readiness probe). A container that exits is started again after a back-off
//! (`CrashLoopBackOff`); a Pod with a deletionTimestamp gets SIGTERM, SIGKILL after its grace period,
//! and is then deleted with a grace period of 0, as the kubelet's status manager does.
//!
//! Without a container runtime there are no mount namespaces: a hostPath volume is modelled by
//! rewriting every argument, environment value and probe argument that starts with the volume's
//! mountPath to the host path (the longest mountPath wins). A `hostPath` of type `Directory` that is
//! not a directory keeps the Pod in `ContainerCreating`, as the kubelet's type check does. The
//! container's command must be `gpu-dra` (the plugin's image), run from the binary given.
//!
//! A start delay (`set_start_delay`) keeps new Pods in ContainerCreating for a while, as an image pull
//! or a slow runtime does, each Pod on its own clock.
//!
//! Not modelled: images (every image has the gpu-dra binary), mount propagation, resources and
//! cgroups, privileges, probes other than exec readiness, init containers, more than one container.

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use super::apiserver::ApiHandle;

const SYNC: Duration = Duration::from_millis(50);
const IDLE_SYNC: Duration = Duration::from_millis(250);
const PROBE_PERIOD: Duration = Duration::from_millis(200);
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Runs this node's Pods until dropped (which ends their processes, as a node that goes away).
pub struct PodRunner {
    task: JoinHandle<()>,
    /// How long a new Pod stays in ContainerCreating before its container starts, in milliseconds.
    start_delay_ms: Arc<AtomicU64>,
}

impl Drop for PodRunner {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Running {
    name: String,
    child: Option<Child>,
    restarts: i32,
    restart_at: Option<Instant>,
    backoff: Duration,
    last_exit: Option<i32>,
    ready: bool,
    next_probe: Instant,
    killing_since: Option<Instant>,
    waiting: Option<(String, String)>,
    reported: Value,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            kill_group(child, nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait();
        }
    }
}

/// Where the runner finds its Pods and reports their status: the API server double's store, or a real
/// API server (for checks against a real control plane, where these nodes have no kubelet).
#[derive(Clone)]
enum PodStore {
    Double(ApiHandle),
    Live {
        client: kube::Client,
        /// Only Pods of this namespace are run (the plugin's daemons); workloads bound to the node
        /// are the test's to prepare, not to run.
        namespace: String,
    },
}

impl PodStore {
    async fn pods_on(&self, node: &str) -> Vec<Pod> {
        match self {
            PodStore::Double(api) => api
                .list("pods")
                .into_iter()
                .filter(|p| p.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node))
                .filter_map(|p| serde_json::from_value(p).ok())
                .collect(),
            PodStore::Live { client, namespace } => {
                let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), namespace);
                let on_node =
                    kube::api::ListParams::default().fields(&format!("spec.nodeName={node}"));
                pods.list(&on_node)
                    .await
                    .map(|l| l.items)
                    .unwrap_or_default()
            }
        }
    }

    /// The kubelet's final delete, with a grace period of 0.
    fn remove(&self, namespace: &str, name: &str) {
        match self {
            PodStore::Double(api) => {
                api.remove("pods", Some(namespace), name);
            }
            PodStore::Live { client, .. } => {
                let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), namespace);
                let now = kube::api::DeleteParams {
                    grace_period_seconds: Some(0),
                    ..Default::default()
                };
                let _ = tokio::runtime::Handle::current().block_on(pods.delete(name, &now));
            }
        }
    }

    /// Writes the Pod's status; whether it was written.
    fn set_status(&self, namespace: &str, name: &str, status: &Value) -> bool {
        match self {
            PodStore::Double(api) => match api.get("pods", Some(namespace), name) {
                Some(mut stored) => {
                    stored["status"] = status.clone();
                    api.insert("pods", stored);
                    true
                }
                None => false,
            },
            PodStore::Live { client, .. } => {
                let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), namespace);
                let patch = serde_json::json!({"status": status});
                tokio::runtime::Handle::current()
                    .block_on(pods.patch_status(
                        name,
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(&patch),
                    ))
                    .is_ok()
            }
        }
    }
}

impl PodRunner {
    /// Starts running the Pods bound to `node`, with `binary` as the image's `gpu-dra`. It reads and
    /// writes the API server's store directly (see [`ApiHandle`]), so a test of the plugin's own
    /// requests does not see the kubelet's.
    pub fn start(api: ApiHandle, node: &str, binary: PathBuf) -> PodRunner {
        Self::start_with(PodStore::Double(api), node, binary)
    }

    /// [`PodRunner::start`] against a real API server: the Pods of `namespace` bound to `node`.
    pub fn start_live(
        client: kube::Client,
        namespace: &str,
        node: &str,
        binary: PathBuf,
    ) -> PodRunner {
        let store = PodStore::Live {
            client,
            namespace: namespace.to_string(),
        };
        Self::start_with(store, node, binary)
    }

    /// How long each new Pod's container takes to start from now on (an image pull, a slow
    /// runtime): the Pod waits in ContainerCreating meanwhile. Pods start side by side, as the
    /// kubelet's pod workers do.
    pub fn set_start_delay(&self, delay: Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.start_delay_ms.store(millis, Ordering::Relaxed);
    }

    fn start_with(store: PodStore, node: &str, binary: PathBuf) -> PodRunner {
        let node = node.to_string();
        let start_delay_ms = Arc::new(AtomicU64::new(0));
        let delay = start_delay_ms.clone();
        let task = tokio::spawn(async move {
            let mut running: HashMap<String, Running> = HashMap::new();
            loop {
                let pods = store.pods_on(&node).await;
                if pods.is_empty() && running.is_empty() {
                    // Nothing to run: no thread hop, so an idle runner costs the tests nothing.
                    tokio::time::sleep(IDLE_SYNC).await;
                    continue;
                }
                // Blocking (process starts, probes run to completion): off the runtime's workers.
                let binary = binary.clone();
                let store = store.clone();
                let mut state = std::mem::take(&mut running);
                let start_delay = Duration::from_millis(delay.load(Ordering::Relaxed));
                running = tokio::task::spawn_blocking(move || {
                    sync(&store, &binary, pods, &mut state, start_delay);
                    state
                })
                .await
                .unwrap_or_default();
                tokio::time::sleep(SYNC).await;
            }
        });
        PodRunner {
            task,
            start_delay_ms,
        }
    }

    /// The path of the `gpu-dra` binary beside the running test binary (cargo builds it for
    /// integration tests), or this binary itself when it is `gpu-dra` (the demo).
    pub fn binary() -> PathBuf {
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("gpu-dra"));
        if exe.file_name().is_some_and(|name| name == "gpu-dra") {
            return exe;
        }
        exe.parent()
            .and_then(Path::parent)
            .map(|dir| dir.join("gpu-dra"))
            .filter(|path| path.exists())
            .unwrap_or(exe)
    }
}

fn sync(
    store: &PodStore,
    binary: &Path,
    pods: Vec<Pod>,
    running: &mut HashMap<String, Running>,
    start_delay: Duration,
) {
    let seen: Vec<String> = pods.iter().filter_map(|p| p.metadata.uid.clone()).collect();
    // A Pod removed from the API (deleted with grace 0) ends at once.
    running.retain(|uid, _| seen.contains(uid));
    for pod in pods {
        let Some(uid) = pod.metadata.uid.clone() else {
            continue;
        };
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let entry = running.entry(uid.clone()).or_insert_with(|| Running {
            name: pod.metadata.name.clone().unwrap_or_default(),
            child: None,
            restarts: 0,
            restart_at: Some(Instant::now() + start_delay),
            backoff: FIRST_BACKOFF,
            last_exit: None,
            ready: false,
            next_probe: Instant::now(),
            killing_since: None,
            waiting: None,
            reported: Value::Null,
        });
        if pod.metadata.deletion_timestamp.is_some() {
            if terminate(entry, &pod) {
                store.remove(&namespace, &entry.name);
            }
            continue;
        }
        step(entry, &pod, binary);
        let status = status_of(entry);
        if status != entry.reported && store.set_status(&namespace, &entry.name, &status) {
            entry.reported = status;
        }
    }
}

/// Starts, restarts and probes the container.
fn step(entry: &mut Running, pod: &Pod, binary: &Path) {
    if let Some(child) = &mut entry.child {
        if let Ok(Some(status)) = child.try_wait() {
            entry.child = None;
            entry.ready = false;
            entry.last_exit = Some(status.code().unwrap_or(137));
            entry.restarts += 1;
            entry.restart_at = Some(Instant::now() + entry.backoff);
            entry.waiting = Some((
                "CrashLoopBackOff".into(),
                format!("back-off {:?} restarting failed container", entry.backoff),
            ));
            entry.backoff = (entry.backoff * 2).min(MAX_BACKOFF);
        }
    }
    if entry.child.is_none() && entry.restart_at.is_some_and(|at| Instant::now() >= at) {
        match start_container(pod, binary) {
            Ok(child) => {
                entry.child = Some(child);
                entry.restart_at = None;
                entry.waiting = None;
                entry.next_probe = Instant::now();
            }
            Err((reason, message)) => {
                entry.waiting = Some((reason, message));
                entry.restart_at = Some(Instant::now() + FIRST_BACKOFF);
            }
        }
    }
    if entry.child.is_some() && Instant::now() >= entry.next_probe {
        entry.next_probe = Instant::now() + PROBE_PERIOD;
        entry.ready = probe(pod);
    }
}

/// SIGTERM once, SIGKILL after the grace period; true once the container has ended.
fn terminate(entry: &mut Running, pod: &Pod) -> bool {
    let Some(child) = &mut entry.child else {
        return true;
    };
    if let Ok(Some(_)) = child.try_wait() {
        entry.child = None;
        return true;
    }
    let grace = Duration::from_secs(
        pod.metadata
            .deletion_grace_period_seconds
            .and_then(|g| u64::try_from(g).ok())
            .unwrap_or(30),
    );
    match entry.killing_since {
        None => {
            entry.killing_since = Some(Instant::now());
            entry.ready = false;
            kill_group(child, nix::sys::signal::Signal::SIGTERM);
        }
        Some(since) if since.elapsed() >= grace => {
            kill_group(child, nix::sys::signal::Signal::SIGKILL);
        }
        Some(_) => {}
    }
    false
}

fn kill_group(child: &Child, signal: nix::sys::signal::Signal) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), signal);
    }
}

type Waiting = (String, String);

fn start_container(pod: &Pod, binary: &Path) -> Result<Child, Waiting> {
    let spec = pod.spec.as_ref().ok_or((
        "CreateContainerConfigError".to_string(),
        "no spec".to_string(),
    ))?;
    let container = spec.containers.first().ok_or((
        "CreateContainerConfigError".to_string(),
        "no container".to_string(),
    ))?;
    let mounts = host_mounts(pod)?;
    let rewrite = |value: &str| rewrite_path(&mounts, value);
    let command = container.command.clone().unwrap_or_default();
    match command.first().map(String::as_str) {
        Some("gpu-dra") => {}
        other => {
            return Err((
                "RunContainerError".into(),
                format!("exec: {other:?}: executable file not found in $PATH"),
            ))
        }
    }
    let mut process = Command::new(binary);
    process
        .args(command[1..].iter().map(|a| rewrite(a)))
        .args(container.args.iter().flatten().map(|a| rewrite(a)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own group, as a container's processes are killed together.
        .process_group(0);
    for var in container.env.iter().flatten() {
        process.env(&var.name, rewrite(var.value.as_deref().unwrap_or_default()));
    }
    process.spawn().map_err(|e| {
        (
            "RunContainerError".into(),
            format!("starting {}: {e}", binary.display()),
        )
    })
}

/// The exec readiness probe, run to completion (bounded by its timeout, 1 s).
fn probe(pod: &Pod) -> bool {
    let Some(container) = pod.spec.as_ref().and_then(|s| s.containers.first()) else {
        return false;
    };
    let Some(command) = container
        .readiness_probe
        .as_ref()
        .and_then(|p| p.exec.as_ref())
        .and_then(|e| e.command.clone())
    else {
        // No probe: ready once running.
        return true;
    };
    let Ok(mounts) = host_mounts(pod) else {
        return false;
    };
    if command.first().map(String::as_str) != Some("gpu-dra") {
        return false;
    }
    let mut child = match Command::new(PodRunner::binary())
        .args(command[1..].iter().map(|a| rewrite_path(&mounts, a)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(child) => child,
        Err(_) => return false,
    };
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status.success(),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
        }
    }
}

/// (mountPath, hostPath) of the container's hostPath volumes, longest mountPath first, after the
/// kubelet's hostPath type check.
fn host_mounts(pod: &Pod) -> Result<Vec<(String, String)>, Waiting> {
    let spec = pod.spec.as_ref().ok_or((
        "CreateContainerConfigError".to_string(),
        "no spec".to_string(),
    ))?;
    let volumes = spec.volumes.clone().unwrap_or_default();
    let mut mounts = Vec::new();
    for mount in spec
        .containers
        .first()
        .and_then(|c| c.volume_mounts.clone())
        .unwrap_or_default()
    {
        let Some(host) = volumes
            .iter()
            .find(|v| v.name == mount.name)
            .and_then(|v| v.host_path.as_ref())
        else {
            continue;
        };
        if host.type_.as_deref() == Some("Directory") && !Path::new(&host.path).is_dir() {
            return Err((
                "ContainerCreating".into(),
                format!(
                    "MountVolume.SetUp failed for volume {:?} : hostPath type check failed: {} is not a directory",
                    mount.name, host.path
                ),
            ));
        }
        mounts.push((mount.mount_path.clone(), host.path.clone()));
    }
    mounts.sort_by_key(|(container, _)| std::cmp::Reverse(container.len()));
    Ok(mounts)
}

/// `value` with its longest mountPath prefix replaced by that volume's host path; values that name
/// a path in a flag (`--pipe-dir=/mps/pipe`) are rewritten after the `=`.
fn rewrite_path(mounts: &[(String, String)], value: &str) -> String {
    let (flag, path) = match value.split_once('=') {
        Some((flag, path)) if flag.starts_with("--") => (format!("{flag}="), path),
        _ => (String::new(), value),
    };
    for (container, host) in mounts {
        if let Some(rest) = path.strip_prefix(container.as_str()) {
            if rest.is_empty() || rest.starts_with('/') {
                return format!("{flag}{host}{rest}");
            }
        }
    }
    value.to_string()
}

fn status_of(entry: &Running) -> Value {
    let running = entry.child.is_some();
    let state = match (&entry.waiting, running) {
        (_, true) => json!({"running": {}}),
        (Some((reason, message)), false) => {
            json!({"waiting": {"reason": reason, "message": message}})
        }
        (None, false) => json!({"waiting": {"reason": "ContainerCreating"}}),
    };
    let last_state = entry
        .last_exit
        .map_or(json!({}), |code| json!({"terminated": {"exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" }}}));
    let ready = if entry.ready && running {
        "True"
    } else {
        "False"
    };
    json!({
        "phase": if running || entry.restarts > 0 { "Running" } else { "Pending" },
        "conditions": [{"type": "Ready", "status": ready}],
        "containerStatuses": [{
            "name": "mps-control-daemon",
            "ready": entry.ready && running,
            "restartCount": entry.restarts,
            "state": state,
            "lastState": last_state,
            "image": "", "imageID": "",
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::rewrite_path;

    #[test]
    fn paths_under_a_mount_are_rewritten_to_the_host() {
        let mounts = vec![
            ("/driver-root/tmp".to_string(), "/host/claim".to_string()),
            ("/driver-root".to_string(), "/".to_string()),
            ("/dev/shm".to_string(), "/host/claim/shm".to_string()),
        ];
        assert_eq!(
            rewrite_path(&mounts, "--shm-dir=/dev/shm"),
            "--shm-dir=/host/claim/shm"
        );
        assert_eq!(
            rewrite_path(&mounts, "/driver-root/tmp/log/ready"),
            "/host/claim/log/ready"
        );
        assert_eq!(rewrite_path(&mounts, "/dev/shmx"), "/dev/shmx");
        assert_eq!(rewrite_path(&mounts, "--claim=abc"), "--claim=abc");
    }
}
