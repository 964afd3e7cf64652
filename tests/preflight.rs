//! A DaemonSet set up wrong stops the plugin before it serves anything, and says why where an operator
//! looks: an error line in the log, the container's termination message and a Warning Event on the
//! plugin's Pod (its Node outside a Pod). The binary is run with a driver root that is not there; the
//! token's node claim is checked against the API server double's SelfSubjectReview, with the tokens it
//! issues (the binary cannot be made to believe it runs in a Pod here).

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use gpu_dra::plugin::preflight::{
    DriverRootSetting, Environment, Preflight, PreflightError, REASON_DRIVER_ROOT_INVALID,
    REASON_NODE_NAME_MISMATCH, REASON_TOKEN_WITHOUT_NODE_CLAIM,
};
use gpu_dra::plugin::PluginConfig;
use gpu_dra::support::apiserver::{ApiServer, FaultSpec, Verb};
use serde_json::{json, Value};

const NODE: &str = "node-1";
const NAMESPACE: &str = "gpu-dra";
const POD: &str = "gpu-dra-plugin-x7k2p";
const POD_UID: &str = "6f1d8a2e-0c55-4d8e-9a49-3b1f2e7c9d10";

/// The plugin binary on the fake backend with a `--container-driver-root` that does not exist.
fn plugin_with_missing_driver_root(dir: &Path, kubeconfig: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpu-dra"));
    command
        .arg("plugin")
        .args(["--node-name", NODE, "--backend", "fake", "--http-addr", ""])
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--kubelet-registry-dir")
        .arg(dir.join("registry"))
        .arg("--kubelet-plugins-dir")
        .arg(dir.join("plugins"))
        .arg("--cdi-root")
        .arg(dir.join("cdi"))
        .args(["--driver-root", "/run/nvidia/driver"])
        .args(["--container-driver-root", "/nonexistent/driver-root"])
        .arg("--termination-message-path")
        .arg(dir.join("termination-log"))
        .args(["--log-format", "json"])
        // Not in a Pod, whatever machine runs the tests.
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("POD_NAME")
        .env("POD_NAMESPACE", NAMESPACE)
        .env("RUST_LOG", "info");
    command
}

/// Runs `command` off the async runtime (the API server double runs on it) and times it.
async fn run(mut command: Command) -> (Output, Duration) {
    let started = Instant::now();
    let output = tokio::task::spawn_blocking(move || command.output().expect("gpu-dra runs"))
        .await
        .expect("the run's task");
    (output, started.elapsed())
}

/// The log's ERROR lines (JSON).
fn error_lines(stderr: &str) -> Vec<Value> {
    stderr
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .filter(|entry: &Value| entry["level"] == "ERROR")
        .collect()
}

fn insert_own_pod(api: &ApiServer) {
    api.insert(
        "pods",
        json!({
            "metadata": {"name": POD, "namespace": NAMESPACE, "uid": POD_UID},
            "spec": {"nodeName": NODE, "containers": [{"name": "plugin", "image": "gpu-dra:dev"}]},
        }),
    );
}

fn events_with_reason(api: &ApiServer, reason: &str) -> Vec<Value> {
    api.list("events")
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_root_that_is_not_there_stops_the_plugin_with_a_log_line_an_event_and_a_termination_message(
) {
    let api = ApiServer::start().await.expect("API server double");
    insert_own_pod(&api);
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    // The kubelet makes the file before the container starts.
    std::fs::write(dir.path().join("termination-log"), "").unwrap();

    let mut command = plugin_with_missing_driver_root(dir.path(), &kubeconfig);
    command.env("POD_NAME", POD);
    let (output, took) = run(command).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}:\n{stderr}");

    let errors = error_lines(&stderr);
    assert_eq!(errors.len(), 1, "{stderr}");
    assert_eq!(errors[0]["fields"]["reason"], REASON_DRIVER_ROOT_INVALID);
    let line = errors[0]["fields"]["message"].as_str().unwrap_or_default();
    for piece in [
        "refusing to start: ",
        "--container-driver-root (CONTAINER_DRIVER_ROOT) /nonexistent/driver-root does not exist",
        "--driver-root (NVIDIA_DRIVER_ROOT) /run/nvidia/driver",
        "must have NVIDIA_DRIVER_ROOT as its path",
    ] {
        assert!(line.contains(piece), "{piece:?} missing in {line}");
    }

    let message = std::fs::read_to_string(dir.path().join("termination-log")).unwrap();
    assert!(
        message.starts_with("DriverRootInvalid: the NVIDIA driver root is not there")
            && message.contains("/nonexistent/driver-root"),
        "{message}"
    );

    let events = events_with_reason(&api, REASON_DRIVER_ROOT_INVALID);
    assert_eq!(events.len(), 1, "{:#?}", api.list("events"));
    let event = &events[0];
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["metadata"]["namespace"], NAMESPACE);
    assert_eq!(
        event["regarding"],
        json!({"apiVersion": "v1", "kind": "Pod", "namespace": NAMESPACE, "name": POD, "uid": POD_UID})
    );
    assert!(
        event["note"]
            .as_str()
            .is_some_and(|n| n.contains("/nonexistent/driver-root")),
        "{event:#}"
    );
    // Nothing was served or published.
    assert!(!dir.path().join("registry/gpu.dra.dev-reg.sock").exists());
    assert_eq!(api.writes("resourceslices"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_a_pod_the_event_goes_on_the_node() {
    let api = ApiServer::start().await.expect("API server double");
    api.insert(
        "nodes",
        json!({"metadata": {"name": NODE, "uid": "node-1-uid"}}),
    );
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();

    let (output, _) = run(plugin_with_missing_driver_root(dir.path(), &kubeconfig)).await;
    assert_eq!(output.status.code(), Some(1));
    // No termination message file, none written.
    assert!(!dir.path().join("termination-log").exists());
    let events = events_with_reason(&api, REASON_DRIVER_ROOT_INVALID);
    assert_eq!(events.len(), 1, "{:#?}", api.list("events"));
    assert_eq!(events[0]["regarding"]["kind"], "Node");
    assert_eq!(events[0]["regarding"]["uid"], "node-1-uid");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_that_does_not_answer_does_not_hold_up_the_exit() {
    // Connections are taken into the backlog and never answered.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: \"http://{}\"}}}}]\n\
             users: [{{name: u, user: {{}}}}]\ncontexts: [{{name: x, context: {{cluster: c, user: u}}}}]\n\
             current-context: x\n",
            silent.local_addr().unwrap()
        ),
    )
    .unwrap();
    let mut command = plugin_with_missing_driver_root(dir.path(), &kubeconfig);
    command.env("POD_NAME", POD);
    let (output, took) = run(command).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    // The Event gets 3 s.
    assert!(took < Duration::from_secs(8), "took {took:?}:\n{stderr}");
    assert_eq!(error_lines(&stderr).len(), 1, "{stderr}");
    assert!(
        stderr.contains("did not take the Event of the refusal in time"),
        "{stderr}"
    );
    drop(silent);
}

/// A plugin that believes it runs in a Pod whose volumes are all there, on the fake backend.
fn preflight_in_pod(dir: &Path, node: &str) -> Preflight {
    let mut config = PluginConfig::fake_node_under(dir, "gpu.dra.dev", node, "dgx-h100");
    config.mps.namespace = NAMESPACE.to_string();
    config.mps.own_pod = Some(POD.to_string());
    config.startup_api_timeout = Duration::from_secs(2);
    let mut mountinfo =
        String::from("1 0 0:50 / / rw - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w\n");
    for (id, path) in [&config.registry_dir, &config.plugins_dir, &config.cdi_root]
        .into_iter()
        .enumerate()
    {
        std::fs::create_dir_all(path).unwrap();
        let path = path.canonicalize().unwrap();
        mountinfo.push_str(&format!(
            "{} 1 254:0 {} {} rw - ext4 /dev/vda rw\n",
            id + 2,
            path.display(),
            path.display()
        ));
    }
    std::fs::write(dir.join("mountinfo"), mountinfo).unwrap();
    Preflight::new(
        &config,
        DriverRootSetting {
            host: "/".into(),
            container: None,
        },
        Environment {
            in_pod: true,
            mountinfo: dir.join("mountinfo"),
            termination_log: dir.join("termination-log"),
        },
    )
}

fn reasons(failed: &[PreflightError]) -> Vec<&'static str> {
    failed.iter().map(PreflightError::reason).collect()
}

#[tokio::test]
async fn the_token_of_a_pod_on_this_node_passes_and_others_are_refused_with_an_event() {
    let api = ApiServer::start().await.expect("API server double");
    insert_own_pod(&api);
    let dir = tempfile::tempdir().unwrap();
    let preflight = preflight_in_pod(dir.path(), NODE);

    let bound = api.pod_bound_token(NAMESPACE, "gpu-dra-plugin", POD, NODE);
    preflight
        .run(Some(&api.client_with_token(&bound)))
        .await
        .expect("a token bound to a Pod on this node passes");
    assert!(api.list("events").is_empty());

    // A Secret's long-lived token, or one requested without a bound object.
    let unbound = api.unbound_token(NAMESPACE, "gpu-dra-plugin");
    let failed = preflight
        .run(Some(&api.client_with_token(&unbound)))
        .await
        .unwrap_err();
    assert_eq!(reasons(&failed), [REASON_TOKEN_WITHOUT_NODE_CLAIM]);
    assert!(
        failed[0]
            .to_string()
            .contains("system:serviceaccount:gpu-dra:gpu-dra-plugin"),
        "{}",
        failed[0]
    );
    let events = events_with_reason(&api, REASON_TOKEN_WITHOUT_NODE_CLAIM);
    assert_eq!(events.len(), 1, "{:#?}", api.list("events"));
    assert_eq!(events[0]["regarding"]["name"], POD);
    assert_eq!(events[0]["regarding"]["uid"], POD_UID);

    // NODE_NAME set by hand to another name than the Pod's node.
    let elsewhere = preflight_in_pod(dir.path(), "node-2");
    let failed = elsewhere
        .run(Some(&api.client_with_token(&bound)))
        .await
        .unwrap_err();
    assert_eq!(reasons(&failed), [REASON_NODE_NAME_MISMATCH]);
    let text = failed[0].to_string();
    assert!(
        text.contains("is node-2") && text.contains("on node node-1"),
        "{text}"
    );
    assert_eq!(events_with_reason(&api, REASON_NODE_NAME_MISMATCH).len(), 1);

    // A user's kubeconfig, not a service account: the admission policies do not apply to it.
    preflight.run(Some(&api.client())).await.unwrap();
}

#[tokio::test]
async fn when_the_api_server_cannot_say_who_the_plugin_is_the_plugin_goes_on() {
    let api = ApiServer::start().await.expect("API server double");
    let dir = tempfile::tempdir().unwrap();
    let preflight = preflight_in_pod(dir.path(), NODE);
    let client = api.client_with_token(&api.unbound_token(NAMESPACE, "gpu-dra-plugin"));
    // An API server without the API (before 1.28), one that forbids it, a token it does not know.
    for code in [404, 403] {
        api.fail_next(FaultSpec {
            verb: Some(Verb::Create),
            resource: Some("selfsubjectreviews".to_string()),
            code,
            count: 1,
        });
        preflight.run(Some(&client)).await.unwrap();
    }
    preflight
        .run(Some(&api.client_with_token("not-a-token")))
        .await
        .unwrap();
    let answered: Vec<u16> = api
        .requests()
        .iter()
        .filter(|r| r.resource == "selfsubjectreviews")
        .map(|r| r.code)
        .collect();
    assert_eq!(answered, [404, 403, 401]);

    // One that does not answer in time (2 s here).
    api.set_latency(Duration::from_secs(5));
    let started = Instant::now();
    preflight.run(Some(&client)).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(4));
    assert!(api.list("events").is_empty());
}
