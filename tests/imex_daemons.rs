//! A node's IMEX daemon as the node runs it: a Pod of its own, which the plugin creates through the
//! API server (double) and the kubelet (the pod runner double) runs as a process, with the fake
//! backend's stand-in for `nvidia-imex`. Ready on NVIDIA's ports, given new peers by SIGUSR1 (the same
//! process), crashed, refused (bad peers, another domain's daemon still on the node, the host's own
//! IMEX service), stopped; two nodes of one domain on one machine.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpu_dra::claims::daemon_pod::PodTemplate;
use gpu_dra::domains::imex::stand_in::{StandInState, FAIL_FILE};
use gpu_dra::domains::imex::{
    DaemonState, ImexDaemonSpec, ImexDaemons, ImexError, ImexPodTemplate, ImexProgram, Peer,
};
use gpu_dra::support::apiserver::ApiServer;
use gpu_dra::support::pod_runner::PodRunner;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams};

const DOMAIN_UID: &str = "7a1e5c3d-1111-4b2c-9d8e-0f1a2b3c4d5e";
const NAMESPACE: &str = "gpu-dra";
/// Generous: the kubelet double's back-off and the supervisor's 1 s checks, on a busy machine.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// A node: its kubelet (running the Pods bound to it) and its plugin directory.
struct Node {
    name: &'static str,
    ip: &'static str,
    _runner: PodRunner,
    root: PathBuf,
}

/// An API server and a scratch directory that the nodes share, as fake nodes on one machine do.
struct Cluster {
    api: ApiServer,
    dir: tempfile::TempDir,
}

impl Cluster {
    async fn new() -> Cluster {
        let api = ApiServer::start().await.expect("API server double");
        // Short: the stand-in's command socket path must fit a unix socket address.
        let dir = tempfile::Builder::new()
            .prefix("imex")
            .tempdir_in("/tmp")
            .unwrap();
        Cluster { api, dir }
    }

    fn node(&self, name: &'static str, ip: &'static str) -> Node {
        Node {
            name,
            ip,
            _runner: PodRunner::start(
                self.api.handle(),
                name,
                env!("CARGO_BIN_EXE_gpu-dra").into(),
            ),
            root: self.dir.path().join(name).join("imex"),
        }
    }

    /// The plugin's view on `node`.
    fn daemons(&self, node: &Node) -> ImexDaemons {
        ImexDaemons::new(
            self.api.client(),
            node.root.clone(),
            ImexPodTemplate {
                pod: PodTemplate {
                    namespace: NAMESPACE.into(),
                    node: node.name.into(),
                    driver: "gpu.dra.dev".into(),
                    image: "gpu-dra:test".into(),
                    host_driver_root: "/".into(),
                    program: ImexProgram::StandIn,
                },
                node_ip: Some(node.ip.into()),
            },
        )
    }

    async fn pod(&self, node: &Node) -> Option<Pod> {
        Api::<Pod>::namespaced(self.api.client(), NAMESPACE)
            .get_opt(&format!("gpu-dra-imex-{DOMAIN_UID}-{}", node.name))
            .await
            .unwrap()
    }
}

fn peers(list: &[(u32, &str)]) -> Vec<Peer> {
    list.iter()
        .map(|(index, address)| Peer {
            index: *index,
            address: address.to_string(),
        })
        .collect()
}

fn spec(list: &[(u32, &str)]) -> ImexDaemonSpec {
    ImexDaemonSpec {
        domain_uid: DOMAIN_UID.into(),
        domain: "team/training".into(),
        peers: peers(list),
    }
}

/// Waits until the stand-in in `dir` runs with a state that passes `check`; that state.
async fn wait_for_state(
    dir: &std::path::Path,
    what: &str,
    check: impl Fn(&StandInState) -> bool,
) -> StandInState {
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        let state = StandInState::read(dir);
        if let Some(state) = state.as_ref().filter(|s| check(s)) {
            return state.clone();
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for the daemon with {what}; its state: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_until(what: &str, condition: impl AsyncFn() -> bool) {
    let deadline = Instant::now() + READY_WITHIN;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the daemon is not Ready for a reason that says `expected`; the reason.
async fn wait_for_reason(daemons: &ImexDaemons, expected: &str) -> String {
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        let state = daemons.state(DOMAIN_UID).await;
        match &state {
            DaemonState::NotReady { reason } if reason.contains(expected) => return reason.clone(),
            _ => assert!(
                Instant::now() < deadline,
                "timed out waiting for a reason with {expected:?}; the last state: {state:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn not_ready_reason(state: DaemonState) -> String {
    match state {
        DaemonState::NotReady { reason } => reason,
        DaemonState::Ready => panic!("Ready, where not Ready was expected"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nodes_daemon_runs_in_a_pod_of_its_own_on_nvidias_ports_and_stops_with_nothing_left() {
    let cluster = Cluster::new().await;
    let node = cluster.node("node-a", "10.0.0.1");
    let daemons = cluster.daemons(&node);
    daemons
        .ensure(&spec(&[(1, "10.0.0.2"), (0, "10.0.0.1")]))
        .await
        .expect("ensure");
    assert_eq!(
        daemons.wait_ready(DOMAIN_UID, READY_WITHIN).await,
        DaemonState::Ready
    );

    // A Pod bound to this node on the node's network runs it, on NVIDIA's ports, with both peers
    // resolved from the names every node's node config lists.
    let pod = cluster.pod(&node).await.expect("the daemon's Pod");
    let pod_spec = pod.spec.as_ref().unwrap();
    assert_eq!(pod_spec.node_name.as_deref(), Some("node-a"));
    assert_eq!(pod_spec.host_network, Some(true));
    let dir = daemons.domain_dir(DOMAIN_UID).unwrap();
    let daemon = StandInState::read(&dir).expect("the stand-in's state");
    assert_eq!(daemon.address, "10.0.0.1");
    assert_eq!(daemon.peers, ["10.0.0.1", "10.0.0.2"]);
    assert_eq!((daemon.server_port, daemon.cmd_port), (50000, 50005));
    let config = std::fs::read_to_string(dir.join("config.cfg")).unwrap();
    assert!(
        config.contains("\nSERVER_PORT=50000\n") && config.contains("\nIMEX_CMD_PORT=50005\n"),
        "{config}"
    );
    let names = std::fs::read_to_string(dir.join("nodes_config.cfg")).unwrap();
    assert_eq!(names.lines().count(), 18);
    assert_eq!(names.lines().next(), Some("compute-domain-daemon-0000"));
    let hosts = std::fs::read_to_string(dir.join("hosts")).unwrap();
    assert!(
        hosts.contains(
            "10.0.0.1\tcompute-domain-daemon-0000\n10.0.0.2\tcompute-domain-daemon-0001\n"
        ),
        "{hosts}"
    );
    assert_eq!(daemons.on_this_node().await, [DOMAIN_UID]);

    // Ensuring again changes nothing: the same Pod runs on.
    daemons
        .ensure(&spec(&[(0, "10.0.0.1"), (1, "10.0.0.2")]))
        .await
        .unwrap();
    let again = cluster.pod(&node).await.unwrap();
    assert_eq!(again.metadata.uid, pod.metadata.uid);

    daemons.stop(DOMAIN_UID).await.expect("stop");
    assert!(cluster.pod(&node).await.is_none(), "the Pod is gone");
    assert!(!dir.exists(), "the domain's directory is removed");
    assert!(daemons.on_this_node().await.is_empty());
    daemons.stop(DOMAIN_UID).await.expect("stop again");
    let reason = not_ready_reason(daemons.state(DOMAIN_UID).await);
    assert!(reason.contains("no daemon Pod"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_peers_reach_the_running_daemon_by_sigusr1_once_per_window_never_by_a_restart() {
    let cluster = Cluster::new().await;
    let node = cluster.node("node-a", "10.0.0.1");
    let daemons = cluster.daemons(&node);
    daemons
        .ensure(&spec(&[(0, "10.0.0.1"), (1, "10.0.0.2")]))
        .await
        .unwrap();
    assert_eq!(
        daemons.wait_ready(DOMAIN_UID, READY_WITHIN).await,
        DaemonState::Ready
    );
    let dir = daemons.domain_dir(DOMAIN_UID).unwrap();
    let first = StandInState::read(&dir).unwrap();
    assert_eq!(first.peers, ["10.0.0.1", "10.0.0.2"]);

    // A third node joins: the same daemon resolves its name.
    let three = peers(&[(0, "10.0.0.1"), (1, "10.0.0.2"), (2, "10.0.0.3")]);
    assert!(daemons.set_peers(DOMAIN_UID, &three).unwrap(), "changed");
    assert!(!daemons.set_peers(DOMAIN_UID, &three).unwrap(), "unchanged");
    let after_third = wait_for_state(&dir, "three peers", |s| s.peers.len() == 3).await;
    let third_at = Instant::now();
    assert_eq!(after_third.peers, ["10.0.0.1", "10.0.0.2", "10.0.0.3"]);
    assert_eq!(after_third.pid, first.pid, "not restarted");
    assert_eq!((after_third.usr1_handled, after_third.usr1_ignored), (1, 0));

    // A fourth joins within IMEX's 5 s window: its SIGUSR1 waits for the window, then reaches the
    // daemon (none is sent to be ignored).
    let four = peers(&[
        (0, "10.0.0.1"),
        (1, "10.0.0.2"),
        (2, "10.0.0.3"),
        (3, "10.0.0.4"),
    ]);
    assert!(daemons.set_peers(DOMAIN_UID, &four).unwrap());
    let after_fourth = wait_for_state(&dir, "four peers", |s| s.peers.len() == 4).await;
    assert!(
        third_at.elapsed() >= Duration::from_secs(4),
        "after the window: {:?}",
        third_at.elapsed()
    );
    assert_eq!(after_fourth.peers[3], "10.0.0.4");
    assert_eq!(after_fourth.pid, first.pid, "not restarted");
    assert_eq!(
        (after_fourth.usr1_handled, after_fourth.usr1_ignored),
        (2, 0)
    );
    assert_eq!(
        daemons.wait_ready(DOMAIN_UID, READY_WITHIN).await,
        DaemonState::Ready
    );

    // The stand-in is as strict as IMEX: a signal within the window is ignored. (One at a time: the
    // kernel merges a signal into one still pending.)
    let pid = nix::unistd::Pid::from_raw(after_fourth.pid as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGUSR1).unwrap();
    let ignored = wait_for_state(&dir, "one ignored", |s| s.usr1_ignored == 1).await;
    assert_eq!(ignored.usr1_handled, 2);
    daemons.stop(DOMAIN_UID).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_dies_is_not_ready_with_its_reason_until_it_runs_again() {
    let cluster = Cluster::new().await;
    let node = cluster.node("node-a", "10.0.0.1");
    let daemons = cluster.daemons(&node);
    daemons
        .ensure(&spec(&[(0, "10.0.0.1"), (1, "10.0.0.2")]))
        .await
        .unwrap();
    assert_eq!(
        daemons.wait_ready(DOMAIN_UID, READY_WITHIN).await,
        DaemonState::Ready
    );
    let dir = daemons.domain_dir(DOMAIN_UID).unwrap();
    std::fs::write(dir.join(FAIL_FILE), "lost the NVLink fabric\n").unwrap();
    let last = wait_for_reason(&daemons, "lost the NVLink fabric").await;
    assert!(last.contains("exited with exit status: 1"), "{last}");

    // The kubelet starts it again; once it stays up, it is Ready.
    std::fs::remove_file(dir.join(FAIL_FILE)).unwrap();
    assert_eq!(
        daemons.wait_ready(DOMAIN_UID, READY_WITHIN).await,
        DaemonState::Ready
    );
    let restarts = cluster
        .pod(&node)
        .await
        .unwrap()
        .status
        .unwrap()
        .container_statuses
        .unwrap()[0]
        .restart_count;
    assert!(restarts >= 1, "restarted by the kubelet: {restarts}");
    daemons.stop(DOMAIN_UID).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_peer_list_or_domain_uid_is_refused_before_anything_starts() {
    let cluster = Cluster::new().await;
    let node = cluster.node("node-a", "10.0.0.1");
    let daemons = cluster.daemons(&node);

    let refused = [
        (
            spec(&[(0, "10.0.0.1"), (1, "node-b.example")]),
            "peer 1's address \"node-b.example\" is not an IP address",
        ),
        (
            spec(&[(0, "10.0.0.1"), (18, "10.0.0.2")]),
            "peer 10.0.0.2 has index 18, not below 18",
        ),
        (
            spec(&[(0, "10.0.0.1"), (0, "10.0.0.2")]),
            "index 0 is given to two peers, 10.0.0.1 and 10.0.0.2",
        ),
        (spec(&[]), "no peers"),
    ];
    for (spec, expected) in refused {
        let error = daemons.ensure(&spec).await.unwrap_err();
        assert!(matches!(error, ImexError::Config { .. }), "{error:?}");
        let message = error.to_string();
        assert!(
            message.contains("team/training") && message.contains(expected),
            "{expected:?} not in {message:?}"
        );
    }
    assert!(
        cluster.pod(&node).await.is_none(),
        "no Pod for a refused spec"
    );
    assert!(!node.root.join(DOMAIN_UID).exists(), "no directory either");

    let mut bad_uid = spec(&[(0, "10.0.0.1")]);
    bad_uid.domain_uid = "../../etc".into();
    let message = daemons.ensure(&bad_uid).await.unwrap_err().to_string();
    assert!(message.contains("not a lowercase UUID"), "{message}");
    assert!(daemons.stop("../../etc").await.is_err());

    // Peers for a domain without a daemon here: nothing to give them to.
    let message = daemons
        .set_peers(DOMAIN_UID, &peers(&[(0, "10.0.0.1")]))
        .unwrap_err()
        .to_string();
    assert!(message.contains("ensure it first"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_missing_from_its_peers_is_not_ready_and_says_so() {
    let cluster = Cluster::new().await;
    let node = cluster.node("node-a", "10.0.0.9");
    let daemons = cluster.daemons(&node);
    daemons
        .ensure(&spec(&[(0, "10.0.0.1"), (1, "10.0.0.2")]))
        .await
        .unwrap();
    wait_for_reason(
        &daemons,
        "this node's address 10.0.0.9 is not in the node config",
    )
    .await;
    daemons.stop(DOMAIN_UID).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_of_one_domain_on_one_machine_each_run_their_daemon() {
    let cluster = Cluster::new().await;
    let (a, b) = (
        cluster.node("node-a", "10.0.0.1"),
        cluster.node("node-b", "10.0.0.2"),
    );
    let both = spec(&[(0, "10.0.0.1"), (1, "10.0.0.2")]);
    let (on_a, on_b) = (cluster.daemons(&a), cluster.daemons(&b));
    on_a.ensure(&both).await.unwrap();
    on_b.ensure(&both).await.unwrap();
    for daemons in [&on_a, &on_b] {
        assert_eq!(
            daemons.wait_ready(DOMAIN_UID, READY_WITHIN).await,
            DaemonState::Ready
        );
    }
    let state = |daemons: &ImexDaemons| {
        StandInState::read(&daemons.domain_dir(DOMAIN_UID).unwrap()).unwrap()
    };
    assert_eq!(state(&on_a).address, "10.0.0.1");
    assert_eq!(state(&on_b).address, "10.0.0.2");
    for daemons in [&on_a, &on_b] {
        assert_eq!(state(daemons).peers, ["10.0.0.1", "10.0.0.2"]);
    }
    on_a.stop(DOMAIN_UID).await.unwrap();
    on_b.stop(DOMAIN_UID).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_domains_daemon_is_refused_while_the_first_ones_pod_exists_even_terminating() {
    const OTHER_UID: &str = "9c2f4e6a-2222-4d3e-8f90-1a2b3c4d5e6f";
    let cluster = Cluster::new().await;
    let node = cluster.node("node-a", "10.0.0.1");
    let daemons = cluster.daemons(&node);
    daemons
        .ensure(&spec(&[(0, "10.0.0.1"), (1, "10.0.0.2")]))
        .await
        .unwrap();
    assert_eq!(
        daemons.wait_ready(DOMAIN_UID, READY_WITHIN).await,
        DaemonState::Ready
    );
    let mut other = spec(&[(0, "10.0.0.1")]);
    other.domain_uid = OTHER_UID.into();
    other.domain = "team/inference".into();
    let other_pod = format!("gpu-dra-imex-{OTHER_UID}-node-a");
    let pods: Api<Pod> = Api::namespaced(cluster.api.client(), NAMESPACE);
    let refused = |error: ImexError, terminating: bool| {
        assert!(
            matches!(error, ImexError::OtherDomainRunning { .. }),
            "{error:?}"
        );
        let message = error.to_string();
        let expected = format!("the IMEX daemon of ComputeDomain {DOMAIN_UID} still runs on this node: a node runs one IMEX daemon, serving one ComputeDomain at a time");
        assert!(
            message.contains("team/inference") && message.contains(&expected),
            "{message}"
        );
        assert_eq!(
            message.contains("is being deleted"),
            terminating,
            "{message}"
        );
    };
    refused(daemons.ensure(&other).await.unwrap_err(), false);
    assert!(!node.root.join(OTHER_UID).exists(), "nothing created");
    assert!(pods.get_opt(&other_pod).await.unwrap().is_none());

    // The first Pod is being deleted (a finalizer holds it): still refused.
    let first_pod = format!("gpu-dra-imex-{DOMAIN_UID}-node-a");
    let hold = serde_json::json!({"metadata": {"finalizers": ["test.gpu.dra.dev/hold"]}});
    pods.patch(&first_pod, &PatchParams::default(), &Patch::Merge(&hold))
        .await
        .unwrap();
    pods.delete(&first_pod, &DeleteParams::default())
        .await
        .unwrap();
    refused(daemons.ensure(&other).await.unwrap_err(), true);
    assert!(!node.root.join(OTHER_UID).exists(), "nothing created");

    // Once it is gone, the second domain's daemon starts.
    let release = serde_json::json!({"metadata": {"finalizers": []}});
    pods.patch(&first_pod, &PatchParams::default(), &Patch::Merge(&release))
        .await
        .unwrap();
    wait_until("the first Pod to be gone", async || {
        pods.get_opt(&first_pod).await.unwrap().is_none()
    })
    .await;
    daemons
        .ensure(&other)
        .await
        .expect("the second domain's daemon");
    assert_eq!(
        daemons.wait_ready(OTHER_UID, READY_WITHIN).await,
        DaemonState::Ready
    );
    daemons.stop(OTHER_UID).await.unwrap();
    daemons.stop(DOMAIN_UID).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_running_nvidias_imex_service_gets_no_daemon_of_ours() {
    let cluster = Cluster::new().await;
    let node = cluster.node("node-a", "10.0.0.1");
    let host = tempfile::tempdir().unwrap();
    let units = host.path().join("run/systemd/units");
    std::fs::create_dir_all(&units).unwrap();
    // What systemd keeps while the unit is active: a link to its invocation ID.
    std::os::unix::fs::symlink(
        "0f9e8d7c6b5a49382716a5b4c3d2e1f0",
        units.join("invocation:nvidia-imex.service"),
    )
    .unwrap();
    let daemons = cluster
        .daemons(&node)
        .with_host_system_root(host.path().into());
    let error = daemons.ensure(&spec(&[(0, "10.0.0.1")])).await.unwrap_err();
    assert!(matches!(error, ImexError::HostService { .. }), "{error:?}");
    let message = error.to_string();
    for expected in [
        "team/training",
        "the host runs NVIDIA's IMEX service nvidia-imex.service",
        "systemctl disable --now nvidia-imex.service && systemctl mask nvidia-imex.service",
        "--imex-mode host",
    ] {
        assert!(
            message.contains(expected),
            "{expected:?} not in {message:?}"
        );
    }
    assert!(cluster.pod(&node).await.is_none(), "no Pod");
    assert!(!node.root.join(DOMAIN_UID).exists(), "no directory");

    // Disabled and stopped: systemd removed the link; the daemon starts.
    std::fs::remove_file(units.join("invocation:nvidia-imex.service")).unwrap();
    daemons.ensure(&spec(&[(0, "10.0.0.1")])).await.unwrap();
    assert_eq!(
        daemons.wait_ready(DOMAIN_UID, READY_WITHIN).await,
        DaemonState::Ready
    );
    daemons.stop(DOMAIN_UID).await.unwrap();
}
