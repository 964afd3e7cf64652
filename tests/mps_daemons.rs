//! The MPS daemon lifecycle as a node runs it: each claim's daemon in a Pod of its own, which the
//! plugin creates through the API server (double) and the kubelet (the pod runner double) runs as a
//! process, with the claim's shared memory on a tmpfs the plugin mounts. Started, limited, surviving
//! the plugin, restarted by the kubelet after it died, made again for new devices, stopped, swept.
//!
//! Mounting a tmpfs needs root (CAP_SYS_ADMIN), as the plugin's privileged container has; CI runs as
//! root. Without it these tests say so and return.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpu_dra::claims::mps::shm::{is_mount_point, is_tmpfs, tmpfs_size};
use gpu_dra::claims::mps::stand_in::SHM_SEGMENT;
use gpu_dra::claims::mps::{
    DaemonPodTemplate, DaemonPods, DaemonProgram, MpsDaemonRecord, MpsDaemonSpec, MpsDaemons,
    MpsDevice, MpsError, MpsPrograms, TakeOver, SHM_MARKER,
};
use gpu_dra::support::apiserver::ApiServer;
use gpu_dra::support::pod_runner::PodRunner;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

const UID_A: &str = "0b7c4f1e-1111-4a8e-9f00-1d2c3b4a5e6f";
const UID_B: &str = "0b7c4f1e-2222-4a8e-9f00-1d2c3b4a5e6f";
const NODE: &str = "node-a";
const SHM_SIZE: u64 = 32 * 1024 * 1024;

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective user.
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    if !root {
        eprintln!("skipped: mounting a claim's shared-memory tmpfs needs root");
    }
    root
}

/// An API server, a kubelet that runs this node's Pods, and a scratch plugin directory.
struct Node {
    api: ApiServer,
    _runner: PodRunner,
    dir: tempfile::TempDir,
}

impl Node {
    async fn new() -> Node {
        let api = ApiServer::start().await.expect("API server double");
        let runner = PodRunner::start(api.handle(), NODE, env!("CARGO_BIN_EXE_gpu-dra").into());
        // Short: the daemon's socket paths must fit the 107 bytes of a unix socket address.
        let dir = tempfile::Builder::new()
            .prefix("mps")
            .tempdir_in("/tmp")
            .unwrap();
        Node {
            api,
            _runner: runner,
            dir,
        }
    }

    /// The plugin's view: what a (re)started plugin makes from its config.
    fn daemons(&self) -> MpsDaemons {
        MpsDaemons::new(self.dir.path().join("mps"), SHM_SIZE).with_pods(DaemonPods::new(
            self.api.client(),
            DaemonPodTemplate {
                namespace: "gpu-dra".into(),
                node: NODE.into(),
                driver: "gpu.dra.dev".into(),
                image: "gpu-dra:test".into(),
                host_driver_root: "/".into(),
                program: DaemonProgram::StandIn,
            },
        ))
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.api.client(), "gpu-dra")
    }

    async fn pod(&self, claim: &str) -> Option<Pod> {
        self.pods()
            .get_opt(&DaemonPodTemplate::pod_name(claim))
            .await
            .unwrap()
    }
}

impl Drop for Node {
    /// Unmounts what a failed test left, so the temporary directory can go.
    fn drop(&mut self) {
        for claim in [UID_A, UID_B] {
            let shm = self.dir.path().join("mps").join(claim).join("shm");
            let _ = nix::mount::umount2(&shm, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

fn spec(claim_uid: &str) -> MpsDaemonSpec {
    let device = |device: &str, uuid: &str, limit: Option<u64>| MpsDevice {
        device: device.into(),
        uuid: uuid.into(),
        pinned_memory_limit_bytes: limit,
    };
    MpsDaemonSpec {
        claim_uid: claim_uid.into(),
        devices: vec![
            device(
                "gpu-0",
                "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c",
                Some(4 << 30),
            ),
            device(
                "gpu-2-mig-1g10gb-0",
                "MIG-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718",
                Some(3 << 29),
            ),
        ],
        active_thread_percentage: Some(50),
        multi_user: false,
        shm_size_bytes: None,
    }
}

fn control_log(record: &MpsDaemonRecord) -> String {
    std::fs::read_to_string(record.dir.join("log/control.log")).unwrap_or_default()
}

async fn wait_until(what: &str, condition: impl AsyncFn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn restarts(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .map_or(0, |c| c.restart_count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claims_daemon_runs_in_its_own_pod_with_its_devices_limits_and_a_shared_tmpfs() {
    if !is_root() {
        return;
    }
    let node = Node::new().await;
    let daemons = node.daemons();
    let record = daemons.start(&spec(UID_A)).await.expect("daemon starts");

    // A Pod bound to this node runs it, with the claim's devices.
    let pod = node.pod(UID_A).await.expect("the daemon's Pod");
    assert_eq!(record.pod_uid, pod.metadata.uid.clone().unwrap());
    assert_eq!(pod.spec.as_ref().unwrap().node_name.as_deref(), Some(NODE));
    let env = &pod.spec.as_ref().unwrap().containers[0]
        .env
        .clone()
        .unwrap()[0];
    assert_eq!(
        env.value.as_deref(),
        Some("GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c,MIG-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718")
    );
    // The limits reached the daemon, per device ordinal, in whole MiB.
    let log = control_log(&record);
    for command in [
        "set_default_active_thread_percentage 50",
        "set_default_device_pinned_mem_limit 0 4096M",
        "set_default_device_pinned_mem_limit 1 1536M",
    ] {
        assert!(log.contains(command), "{command} missing from:\n{log}");
    }
    // The claim's /dev/shm is a tmpfs of the configured size, and what the daemon's server keeps in
    // its /dev/shm is what the claim's containers find in theirs (the CDI mount's host path).
    let shm = record.dir.join("shm");
    assert!(is_mount_point(&shm) && is_tmpfs(&shm));
    assert_eq!(tmpfs_size(&shm), Some(SHM_SIZE));
    assert!(shm.join(SHM_MARKER).is_file());
    let segment = std::fs::read_to_string(shm.join(SHM_SEGMENT)).expect("the server's segment");
    assert!(segment.contains("MIG-1f2e3d4c"), "{segment}");
    let edits = daemons.container_edits(&record).unwrap();
    let shm_mount = edits
        .mounts
        .iter()
        .find(|m| m.container_path == "/dev/shm")
        .unwrap();
    assert_eq!(Path::new(&shm_mount.host_path), shm);

    daemons.stop(&record).await.expect("stop");
    assert!(node.pod(UID_A).await.is_none(), "the Pod is gone");
    assert!(!record.dir.exists(), "the directory is removed");
    // Stopping again is fine.
    daemons.stop(&record).await.expect("stop again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_outlives_the_plugin_and_a_new_plugin_takes_it_over() {
    if !is_root() {
        return;
    }
    let node = Node::new().await;
    let record = node.daemons().start(&spec(UID_A)).await.unwrap();
    // The plugin goes (a crash, an upgrade): nothing of it stops the daemon's Pod.
    let before = node.pod(UID_A).await.unwrap();
    let restarted_plugin = node.daemons();
    assert_eq!(
        restarted_plugin
            .take_over(&record, &spec(UID_A))
            .await
            .unwrap(),
        TakeOver::TakenOver
    );
    let after = node.pod(UID_A).await.unwrap();
    assert_eq!(before.metadata.uid, after.metadata.uid);
    assert_eq!(restarts(&after), 0);
    restarted_plugin.stop(&record).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_dies_is_started_again_by_the_kubelet_with_its_limits() {
    if !is_root() {
        return;
    }
    let node = Node::new().await;
    let daemons = node.daemons();
    let record = daemons.start(&spec(UID_A)).await.unwrap();
    let pid: i32 = std::fs::read_to_string(record.dir.join("pipe/nvidia-cuda-mps-control.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_until("the container restarted and Ready", async || {
        node.pod(UID_A).await.is_some_and(|p| restarts(&p) >= 1)
            && daemons.is_running(&record).await
    })
    .await;
    let log = control_log(&record);
    assert_eq!(
        log.matches("set_default_active_thread_percentage 50")
            .count(),
        2,
        "limits applied again:\n{log}"
    );
    daemons.stop(&record).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_for_devices_that_changed_is_made_again_in_the_same_directories() {
    if !is_root() {
        return;
    }
    let node = Node::new().await;
    let daemons = node.daemons();
    let record = daemons.start(&spec(UID_A)).await.unwrap();
    // After a reboot a dynamic MIG device is made again with a new UUID.
    let mut now = spec(UID_A);
    now.devices[1].uuid = "MIG-99999999-5b6a-7980-a1b2-c3d4e5f60718".into();
    let TakeOver::Restarted(started) = daemons.take_over(&record, &now).await.unwrap() else {
        panic!("a daemon naming the old MIG device was kept");
    };
    assert_eq!(started.dir, record.dir);
    assert_ne!(started.pod_uid, record.pod_uid);
    let pod = node.pod(UID_A).await.unwrap();
    let visible = pod.spec.unwrap().containers[0].env.clone().unwrap()[0]
        .value
        .clone()
        .unwrap();
    assert!(
        visible.ends_with("MIG-99999999-5b6a-7980-a1b2-c3d4e5f60718"),
        "{visible}"
    );
    daemons.stop(&started).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_the_tmpfs_is_mounted_again_and_the_daemon_made_again() {
    if !is_root() {
        return;
    }
    let node = Node::new().await;
    let daemons = node.daemons();
    let record = daemons.start(&spec(UID_A)).await.unwrap();
    // A reboot: the tmpfs is gone (and the kubelet restarts the Pod's container on a plain directory).
    let shm = record.dir.join("shm");
    nix::mount::umount2(&shm, nix::mount::MntFlags::MNT_DETACH).unwrap();
    assert!(!is_mount_point(&shm));
    let TakeOver::Restarted(started) = daemons.take_over(&record, &spec(UID_A)).await.unwrap()
    else {
        panic!("a daemon without its tmpfs was kept");
    };
    assert!(is_mount_point(&shm) && is_tmpfs(&shm));
    assert!(shm.join(SHM_MARKER).is_file());
    daemons.stop(&started).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_removes_the_pods_and_directories_of_claims_no_longer_prepared() {
    if !is_root() {
        return;
    }
    let node = Node::new().await;
    let daemons = node.daemons();
    let a = daemons.start(&spec(UID_A)).await.unwrap();
    let b = daemons.start(&spec(UID_B)).await.unwrap();
    let keep: BTreeSet<String> = [UID_B.to_string()].into();
    let cleaned = node.daemons().sweep(&keep).await;
    assert_eq!(cleaned, [UID_A.to_string()]);
    wait_until("A's Pod is gone", async || node.pod(UID_A).await.is_none()).await;
    assert!(!a.dir.exists());
    assert!(node.pod(UID_B).await.is_some());
    assert!(b.dir.join("shm").join(SHM_MARKER).is_file());
    daemons.stop(&b).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_pod_that_never_gets_ready_fails_the_start_with_the_kubelets_reason_and_leaves_nothing(
) {
    if !is_root() {
        return;
    }
    let node = Node::new().await;
    // An image whose command the kubelet cannot run.
    let daemons =
        MpsDaemons::new(node.dir.path().join("mps"), SHM_SIZE).with_pods(DaemonPods::new(
            node.api.client(),
            DaemonPodTemplate {
                namespace: "gpu-dra".into(),
                node: NODE.into(),
                driver: "gpu.dra.dev".into(),
                image: "gpu-dra:test".into(),
                host_driver_root: "/nonexistent-driver-root".into(),
                program: DaemonProgram::Chroot(MpsPrograms {
                    control: "/usr/bin/nvidia-cuda-mps-control".into(),
                }),
            },
        ));
    let error = daemons.start(&spec(UID_A)).await.unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, MpsError::NotReady { .. }), "{text}");
    assert!(text.contains("hostPath type check failed"), "{text}");
    assert!(
        text.contains("kubectl logs -n gpu-dra gpu-dra-mps-"),
        "{text}"
    );
    wait_until("the Pod is gone", async || node.pod(UID_A).await.is_none()).await;
    assert!(!node.dir.path().join("mps").join(UID_A).exists());
}

#[test]
fn the_supervisor_refuses_a_dev_shm_that_is_no_tmpfs() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("shm");
    std::fs::create_dir(&plain).unwrap();
    if is_tmpfs(&plain) {
        eprintln!("skipped: the temporary directory is itself on a tmpfs");
        return;
    }
    let pipe: PathBuf = dir.path().join("pipe");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
        .args(["mps-daemon", "--claim", UID_A, "--program", "stand-in"])
        .arg("--pipe-dir")
        .arg(&pipe)
        .arg("--log-dir")
        .arg(dir.path())
        .arg("--shm-dir")
        .arg(&plain)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("is not a tmpfs"), "{stderr}");
    assert!(!plain.join(SHM_MARKER).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_user_daemon_is_started_with_nvidias_documented_multiuser_server_option() {
    if !is_root() {
        return;
    }
    let node = Node::new().await;
    let daemons = node.daemons();
    let mut multi = spec(UID_B);
    multi.multi_user = true;
    let record = daemons.start(&multi).await.expect("daemon starts");
    assert!(record.multi_user);
    // The stand-in, which takes only the options NVIDIA documents, took -multiuser-server: it says
    // so in its log and its state.
    let log = control_log(&record);
    assert!(log.contains("Multi-user mode"), "{log}");
    let segment =
        std::fs::read_to_string(record.dir.join("shm").join(SHM_SEGMENT)).expect("segment");
    assert!(segment.lines().any(|l| l == "multi-user"), "{segment}");
    // A plugin that restarts takes it over only as a multi-user daemon.
    assert_eq!(
        daemons.take_over(&record, &multi).await.unwrap(),
        gpu_dra::claims::mps::TakeOver::TakenOver
    );
    daemons.stop(&record).await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claims_mps_config_sets_the_size_of_its_tmpfs() {
    if !is_root() {
        return;
    }
    let node = Node::new().await;
    let daemons = node.daemons();
    let mut asked = spec(UID_A);
    asked.shm_size_bytes = Some(16 * 1024 * 1024);
    let record = daemons.start(&asked).await.expect("daemon starts");
    assert_eq!(tmpfs_size(&record.dir.join("shm")), Some(16 * 1024 * 1024));
    // The Pod may hold the daemon and all of its tmpfs.
    let pod = node.pod(UID_A).await.unwrap();
    let limits = pod.spec.unwrap().containers[0]
        .resources
        .clone()
        .unwrap()
        .limits
        .unwrap();
    assert_eq!(limits["memory"].0, "1040Mi");
    daemons.stop(&record).await.unwrap();
    // More than the node's memory is refused before anything is made.
    let small_node = node.daemons().with_node_memory(8 * 1024 * 1024);
    let error = small_node.start(&asked).await.unwrap_err().to_string();
    assert!(error.contains("shmSize"), "{error}");
    assert!(!node.dir.path().join("mps").join(UID_A).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leftover_pod_that_never_goes_fails_the_start_within_its_budget_and_says_so() {
    if !is_root() {
        return;
    }
    let node = Node::new().await;
    // A Pod of an earlier attempt, bound to a node whose kubelet is gone and held by a finalizer:
    // deleted, it stays.
    let leftover: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": DaemonPodTemplate::pod_name(UID_A), "namespace": "gpu-dra",
                     "finalizers": ["gpu-dra.dev/test-never-goes"]},
        "spec": {"nodeName": "gone-node", "containers": [{"name": "c", "image": "gpu-dra:test"}]},
    }))
    .unwrap();
    node.pods()
        .create(&kube::api::PostParams::default(), &leftover)
        .await
        .unwrap();
    let budget = Duration::from_secs(3);
    let begun = Instant::now();
    let error = node
        .daemons()
        .start_within(&spec(UID_A), budget)
        .await
        .unwrap_err();
    let took = begun.elapsed();
    assert!(
        took < budget + Duration::from_secs(2),
        "took {took:?} of a {budget:?} budget"
    );
    let text = error.to_string();
    assert!(matches!(error, MpsError::StartTimedOut { .. }), "{text}");
    assert!(
        text.contains("ran out waiting for the Pod of an earlier attempt to go"),
        "{text}"
    );
    assert!(text.contains("3s"), "{text}");
    // Nothing of the start is left: the claim's directory is gone.
    assert!(!node.dir.path().join("mps").join(UID_A).exists());
    assert_eq!(
        gpu_dra::claims::mps::START_BUDGET,
        Duration::from_secs(30),
        "within the kubelet's 45 s for a whole NodePrepareResources"
    );
}
