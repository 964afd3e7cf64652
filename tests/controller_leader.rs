//! Leader election of the ComputeDomain controller's replicas against the API server double: two
//! candidates for one Lease, with short timings (lease 1 s, renew deadline 0.6 s, retry 0.2 s). One
//! leads and the other waits while it renews; a leader killed without releasing is replaced once the
//! Lease expires on the other's clock; a graceful stop releases and the other takes over at its next
//! try; a leader that cannot renew stops its work before anyone could take the Lease. Then two real
//! controllers: the leader dies while it writes a domain's template, and the other finishes the job
//! from what the API server holds. Last, `gpu-dra controller` as a process: it exits non-zero when it
//! loses the Lease and releases it on SIGTERM.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_dra::domains::controller::leader::{
    Ended, LeaderElectionConfig, LeaderElector, LeaderError, StopRequest,
};
use gpu_dra::domains::controller::{Controller, ControllerConfig};
use gpu_dra::support::apiserver::{ApiServer, FaultSpec, HangSpec, Verb};
use serde_json::{json, Value};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

const NAMESPACE: &str = "gpu-dra";
const LEASE: &str = "gpu-dra-controller";
const LEASE_DURATION: Duration = Duration::from_millis(1_000);
const RENEW_DEADLINE: Duration = Duration::from_millis(600);
const RETRY_PERIOD: Duration = Duration::from_millis(200);
/// What a busy test machine may add to a bound: HTTP round trips and scheduling.
const SLACK: Duration = Duration::from_millis(300);
const WAIT: Duration = Duration::from_secs(10);

/// One replica: an elector running `work` while it leads, and when that work started and ended.
struct Candidate {
    identity: String,
    started: watch::Receiver<Option<Instant>>,
    /// When the work returned or was dropped.
    ended: Arc<Mutex<Option<Instant>>>,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<Ended, LeaderError>>,
}

/// Records when the work ends, however it ends.
struct EndGuard(Arc<Mutex<Option<Instant>>>);

impl Drop for EndGuard {
    fn drop(&mut self) {
        *self.0.lock().unwrap() = Some(Instant::now());
    }
}

fn candidate_with<W, F>(api: &ApiServer, name: &str, work: W) -> Candidate
where
    W: FnOnce(StopRequest) -> F + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let identity = format!("{name}_{}", uuid::Uuid::new_v4());
    let config = LeaderElectionConfig {
        lease_duration: LEASE_DURATION,
        renew_deadline: RENEW_DEADLINE,
        retry_period: RETRY_PERIOD,
        ..LeaderElectionConfig::new(NAMESPACE, LEASE, &identity)
    };
    // Without retries: an injected fault reaches the elector as it is.
    let elector = LeaderElector::new(api.client_without_retries(), config).expect("valid timings");
    let (started_tx, started) = watch::channel(None);
    let ended = Arc::new(Mutex::new(None));
    let guard = EndGuard(ended.clone());
    let (shutdown, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(elector.run(
        move |stop| async move {
            let _guard = guard;
            let _ = started_tx.send(Some(Instant::now()));
            work(stop).await;
        },
        async move {
            let _ = stopped.await;
        },
    ));
    Candidate {
        identity,
        started,
        ended,
        shutdown: Some(shutdown),
        task,
    }
}

/// A candidate whose work does nothing until asked to stop.
fn candidate(api: &ApiServer, name: &str) -> Candidate {
    candidate_with(api, name, |stop| stop.requested())
}

impl Candidate {
    fn started_at(&self) -> Option<Instant> {
        *self.started.borrow()
    }

    fn ended_at(&self) -> Option<Instant> {
        *self.ended.lock().unwrap()
    }

    async fn wait_leading(&mut self, within: Duration) -> Instant {
        match tokio::time::timeout(within, self.started.wait_for(Option::is_some)).await {
            Ok(Ok(started)) => started.unwrap(),
            _ => panic!("{} did not start leading within {within:?}", self.identity),
        }
    }

    /// Asks for a graceful stop and waits for the elector to return.
    async fn stop(&mut self) -> Result<Ended, LeaderError> {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        tokio::time::timeout(WAIT, &mut self.task)
            .await
            .expect("the elector returns after a stop")
            .expect("the elector task did not panic")
    }
}

fn lease(api: &ApiServer) -> Value {
    api.get("leases", Some(NAMESPACE), LEASE)
        .expect("the Lease exists")
}

fn holder(api: &ApiServer) -> String {
    lease(api)["spec"]["holderIdentity"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_leads_and_the_other_waits_while_it_renews() {
    let api = ApiServer::start().await.expect("API server double");
    let mut a = candidate(&api, "a");
    let mut b = candidate(&api, "b");
    let first = tokio::select! {
        _ = a.wait_leading(WAIT) => "a",
        _ = b.wait_leading(WAIT) => "b",
    };
    let (leader, other) = if first == "a" { (&a, &b) } else { (&b, &a) };
    let renewed = lease(&api)["spec"]["renewTime"].clone();

    // Three lease durations: the leader renews all along, so the other never starts.
    tokio::time::sleep(3 * LEASE_DURATION).await;
    assert!(
        other.started_at().is_none(),
        "both led: {} and {}",
        leader.identity,
        other.identity
    );
    let now = lease(&api);
    assert_eq!(now["spec"]["holderIdentity"], leader.identity.as_str());
    assert_eq!(now["spec"]["leaseDurationSeconds"], 1);
    assert_eq!(now["spec"]["leaseTransitions"], 0);
    assert_ne!(now["spec"]["renewTime"], renewed, "the leader renews");
    // Three durations at one renewal per retry period: about 15 updates, every one the leader's.
    let updates = api
        .requests()
        .iter()
        .filter(|r| r.verb == Verb::Update && r.resource == "leases" && r.code == 200)
        .count();
    assert!(updates >= 10, "{updates} renewals in 3 s");

    assert_eq!(a.stop().await.unwrap(), Ended::Shutdown);
    assert_eq!(b.stop().await.unwrap(), Ended::Shutdown);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_once_the_lease_expires_on_the_others_clock() {
    let api = ApiServer::start().await.expect("API server double");
    let mut a = candidate(&api, "a");
    a.wait_leading(WAIT).await;
    let mut b = candidate(&api, "b");
    tokio::time::sleep(LEASE_DURATION / 2).await;
    assert!(b.started_at().is_none());
    let acquired_by_a = lease(&api)["spec"]["acquireTime"].clone();

    // Killed without a word: nothing releases the Lease.
    a.task.abort();
    let killed = Instant::now();
    assert_eq!(holder(&api), a.identity);

    let took_over = b.wait_leading(WAIT).await;
    let after = took_over - killed;
    // A's last renewal was at most a retry period before the kill, and B waits a lease duration from
    // when it saw it; it looks again at the moment the Lease expires.
    assert!(
        after >= LEASE_DURATION - RETRY_PERIOD - Duration::from_millis(100),
        "B took over {after:?} after the kill, before the Lease could expire"
    );
    assert!(
        after <= LEASE_DURATION + RETRY_PERIOD + SLACK,
        "B took over only {after:?} after the kill"
    );
    let now = lease(&api);
    assert_eq!(now["spec"]["holderIdentity"], b.identity.as_str());
    assert_eq!(now["spec"]["leaseTransitions"], 1);
    assert_ne!(now["spec"]["acquireTime"], acquired_by_a);
    assert_eq!(b.stop().await.unwrap(), Ended::Shutdown);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_releases_the_lease_and_the_other_takes_over_at_its_next_try() {
    let api = ApiServer::start().await.expect("API server double");
    let mut a = candidate(&api, "a");
    a.wait_leading(WAIT).await;
    let mut b = candidate(&api, "b");
    tokio::time::sleep(LEASE_DURATION / 2).await;

    let stopping = Instant::now();
    assert_eq!(a.stop().await.unwrap(), Ended::Shutdown);
    let returned = Instant::now();
    let a_ended = a.ended_at().expect("A's work ended");
    assert!(a_ended <= returned, "A's work ended before it released");
    let holder_now = holder(&api);
    assert!(
        holder_now.is_empty() || holder_now == b.identity,
        "A still holds the Lease after its stop: {holder_now}"
    );

    let took_over = b.wait_leading(WAIT).await;
    assert!(took_over >= a_ended, "B started before A's work ended");
    assert!(
        took_over - stopping <= RETRY_PERIOD + SLACK,
        "B took over {:?} after A's stop: released Leases are taken at the next try",
        took_over - stopping
    );
    assert_eq!(lease(&api)["spec"]["leaseTransitions"], 1);

    // The last one out releases too: holder cleared, valid for 1 s, as client-go's ReleaseOnCancel.
    assert_eq!(b.stop().await.unwrap(), Ended::Shutdown);
    let released = lease(&api);
    assert_eq!(released["spec"].get("holderIdentity"), None, "{released:#}");
    assert_eq!(released["spec"]["leaseDurationSeconds"], 1);
    assert_eq!(released["spec"]["leaseTransitions"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_cannot_renew_stops_its_work_before_the_lease_can_be_taken() {
    let api = ApiServer::start().await.expect("API server double");
    let mut a = candidate(&api, "a");
    a.wait_leading(WAIT).await;
    let mut b = candidate(&api, "b");
    tokio::time::sleep(LEASE_DURATION / 2).await;

    // The API server refuses every write to Leases from now on: A's renewals and B's takeover alike.
    api.fail_next(FaultSpec {
        verb: Some(Verb::Update),
        resource: Some("leases".into()),
        code: 500,
        count: usize::MAX,
    });
    let refused_from = Instant::now();
    let lost = tokio::time::timeout(WAIT, &mut a.task)
        .await
        .expect("A stops leading")
        .expect("A's task did not panic");
    match lost {
        Err(LeaderError::NotRenewed { last_error, .. }) => {
            assert!(last_error.contains("injected fault"), "{last_error}")
        }
        other => panic!("A should have lost the Lease, got {other:?}"),
    }
    let a_ended = a.ended_at().expect("A's work was stopped");
    // A's last successful renewal was before the refusals; nobody may take the Lease before a lease
    // duration after it, and A's work had ended by the renew deadline.
    assert!(
        a_ended - refused_from <= RENEW_DEADLINE + SLACK / 2,
        "A worked on {:?} without renewing",
        a_ended - refused_from
    );
    assert!(a_ended - refused_from < LEASE_DURATION);
    assert!(
        b.started_at().is_none(),
        "B started while the writes were refused"
    );
    assert_eq!(holder(&api), a.identity);

    api.clear_faults();
    let took_over = b.wait_leading(WAIT).await;
    assert!(took_over > a_ended);
    assert_eq!(holder(&api), b.identity);
    assert_eq!(b.stop().await.unwrap(), Ended::Shutdown);
}

// Two controllers behind electors.

const BIG: &str = "cluster-1.0";

fn node(name: &str) -> Value {
    json!({
        "metadata": {"name": name},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]},
    })
}

/// A node's slice: two GPUs and its IMEX channel device on clique `BIG`.
fn slice(node: &str) -> Value {
    let mut devices: Vec<Value> = (0..2)
        .map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"type": {"string": "gpu"}}}))
        .collect();
    devices.push(json!({"name": "imex-channel-0", "attributes": {
        "type": {"string": "imex-channel"},
        "channel": {"int": 0},
        "nvlinkDomain": {"string": BIG},
    }}));
    json!({
        "metadata": {"name": format!("{node}-gpu.dra.dev")},
        "spec": {"driver": "gpu.dra.dev", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": devices},
    })
}

fn controller_candidate(api: &ApiServer, name: &str) -> Candidate {
    let mut config = ControllerConfig::new("gpu.dra.dev");
    config.resync = Duration::from_millis(300);
    let controller = Controller::new(api.client(), config);
    candidate_with(api, name, move |stop| controller.run(stop.requested()))
}

async fn until(what: &str, check: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_other_controller_finishes_the_job_of_a_leader_that_died_mid_way() {
    let api = ApiServer::start().await.expect("API server double");
    for name in ["a0", "a1", "a2", "a3"] {
        api.insert("nodes", node(name));
        api.insert("resourceslices", slice(name));
    }
    let mut a = controller_candidate(&api, "a");
    a.wait_leading(WAIT).await;
    let mut b = controller_candidate(&api, "b");

    // A places the domain, then dies while its template's create is in flight.
    api.hang_next(HangSpec {
        verb: Some(Verb::Create),
        resource: Some("resourceclaimtemplates".into()),
        name: None,
        count: Some(1),
    });
    api.insert(
        "computedomains",
        json!({
            "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "ComputeDomain",
            "metadata": {"name": "job", "namespace": "team"},
            "spec": {"numNodes": 4, "channel": {"resourceClaimTemplate": {"name": "job-channel"}}},
        }),
    );
    until("A's template create is held", || api.hanging() == 1).await;
    let uid = api.get("computedomains", Some("team"), "job").unwrap()["metadata"]["uid"].clone();
    let placement = api
        .get("computedomainplacements", None, uid.as_str().unwrap())
        .expect("A placed the domain");
    assert_eq!(placement["spec"]["clique"], BIG);
    assert!(b.started_at().is_none());
    a.task.abort();

    // B takes over once the Lease expires and writes what A did not, from what the objects say.
    b.wait_leading(LEASE_DURATION + RETRY_PERIOD + SLACK + Duration::from_secs(1))
        .await;
    let done = api
        .wait_for(
            "computedomains",
            |d| {
                d.iter().any(|d| {
                    d["status"]["conditions"][0]["type"] == "Placed"
                        && d["status"]["conditions"][0]["status"] == "True"
                })
            },
            WAIT,
        )
        .await
        .expect("B writes the domain's status");
    let domain = &done[0];
    assert_eq!(
        domain["status"]["conditions"][0]["message"],
        "NVLink clique cluster-1.0"
    );
    assert_eq!(domain["status"]["status"], "NotReady");
    assert_eq!(api.list("computedomainplacements"), vec![placement]);
    let template = api
        .get("resourceclaimtemplates", Some("team"), "job-channel")
        .expect("B created the template");
    assert_eq!(
        template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]
            ["expression"],
        "device.attributes[\"gpu.dra.dev\"].nvlinkDomain == \"cluster-1.0\" && \
         device.attributes[\"gpu.dra.dev\"].channel == 0"
    );
    assert_eq!(
        template["metadata"]["labels"]["gpu.dra.dev/compute-domain"],
        uid
    );

    // A few rounds later: nothing written twice. One placement, one template, one status, one Event.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(api.writes("computedomainplacements"), 1);
    assert_eq!(api.writes("resourceclaimtemplates"), 1);
    assert_eq!(api.writes("computedomains/status"), 1);
    assert_eq!(api.writes("computedomains"), 1, "the status only");
    let placed_events = api
        .list("events")
        .into_iter()
        .filter(|e| e["reason"] == "Placed")
        .count();
    assert_eq!(placed_events, 1);
    assert_eq!(holder(&api), b.identity);
    assert_eq!(b.stop().await.unwrap(), Ended::Shutdown);
}

/// `gpu-dra controller` as a process: its identity is its Pod's name and a random suffix, the Lease is
/// in its Pod's namespace; a lost Lease exits non-zero (so the kubelet restarts it as a candidate) and
/// SIGTERM releases the Lease and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_exits_non_zero_when_it_loses_the_lease_and_releases_it_on_sigterm() {
    let api = ApiServer::start().await.expect("API server double");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let spawn = |pod: &str| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
            .arg("controller")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--leader-elect-lease-duration", "2s"])
            .args(["--leader-elect-renew-deadline", "1s"])
            .args(["--leader-elect-retry-period", "200ms"])
            .env("POD_NAME", pod)
            .env("POD_NAMESPACE", "controllers")
            .env_remove("LEADER_ELECT")
            .env_remove("LEADER_ELECT_LEASE_NAMESPACE")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("gpu-dra runs")
    };
    let lease_holder = |api: &ApiServer| {
        api.get("leases", Some("controllers"), LEASE)
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(String::from))
            .unwrap_or_default()
    };

    let mut first = spawn("gpu-dra-controller-abc");
    until("the first process leads", || {
        lease_holder(&api).starts_with("gpu-dra-controller-abc_")
    })
    .await;
    api.fail_next(FaultSpec {
        verb: Some(Verb::Update),
        resource: Some("leases".into()),
        code: 500,
        count: usize::MAX,
    });
    let status = tokio::time::timeout(WAIT, first.wait())
        .await
        .expect("a leader that cannot renew exits")
        .unwrap();
    assert!(!status.success(), "{status}");
    api.clear_faults();

    let mut second = spawn("gpu-dra-controller-def");
    until("the second process leads", || {
        lease_holder(&api).starts_with("gpu-dra-controller-def_")
    })
    .await;
    let pid = nix::unistd::Pid::from_raw(second.id().expect("running") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(WAIT, second.wait())
        .await
        .expect("SIGTERM ends the controller")
        .unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(lease_holder(&api), "", "released on SIGTERM");
}
