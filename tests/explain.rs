//! `gpu-dra explain` as a user runs it: the built binary against the API server double (through a
//! kubeconfig, as kubectl reads one) and against a dump of the same cluster, and through the kubectl
//! plugin name. The cluster: eight nodes and several hundred devices, whole H100s, dynamic and static
//! MIG, L40S without NVLink, A100 pairs, a node without GPUs, a tainted and a cordoned node; other
//! claims holding GPUs and MIG devices, an XID taint on a GPU.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::{builtin_profile, gb200_tray, GB200_CLUSTER_UUID};
use gpu_dra::support::apiserver::{ApiServer, Verb};
use gpu_dra::support::cluster::{self as fixture, DRIVER};

const NS: &str = "ml";

/// Pods that ask for `nvidia.com/gpu: N`.
#[path = "explain/extended.rs"]
mod extended;

struct Cluster {
    api: ApiServer,
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
    /// Devices the slices publish.
    devices: usize,
}

async fn cluster() -> Cluster {
    let api = ApiServer::start().await.expect("API server double");
    let h100 = builtin_profile("dgx-h100").unwrap();
    let mut slices = Vec::new();
    let mut a = fixture::node_slices("h100-a", &h100, MigMode::None);
    fixture::taint(&mut a, &["gpu-7"], "gpu.dra.dev/xid", "79", "NoExecute");
    slices.extend(a);
    let b = fixture::node_slices("h100-b", &h100, MigMode::Dynamic);
    // One MIG device held on each of gpu-0 and gpu-1.
    let mig_b: Vec<String> = ["gpu-0-mig-1g10gb", "gpu-1-mig-2g20gb"]
        .iter()
        .filter_map(|prefix| {
            b.iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .map(|d| d.name.clone())
                .find(|n| n.starts_with(prefix))
        })
        .collect();
    slices.extend(b);
    let cut = [
        ("3g.40gb", 4),
        ("2g.20gb", 0),
        ("1g.10gb", 2),
        ("1g.10gb", 3),
    ];
    let static_mig = fixture::static_mig("dgx-h100", &[0, 1, 2, 3], &cut);
    slices.extend(fixture::node_slices("h100-c", &static_mig, MigMode::Static));
    let l40s = builtin_profile("l40s-4").unwrap();
    slices.extend(fixture::node_slices("l40s-d", &l40s, MigMode::None));
    let a100 = builtin_profile("a100-pcie-4").unwrap();
    slices.extend(fixture::node_slices("a100-e", &a100, MigMode::None));
    slices.extend(fixture::node_slices("h100-g", &h100, MigMode::None));
    slices.extend(fixture::node_slices("h100-h", &h100, MigMode::None));
    let devices = slices
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    for slice in &slices {
        api.insert("resourceslices", serde_json::to_value(slice).unwrap());
    }
    for class in fixture::device_classes() {
        api.insert("deviceclasses", class);
    }
    let nodes = [
        fixture::node("h100-a", &[("gpu", "h100"), ("zone", "a")], &[], false),
        fixture::node("h100-b", &[("gpu", "h100"), ("zone", "a")], &[], false),
        fixture::node("h100-c", &[("gpu", "h100"), ("zone", "a")], &[], false),
        fixture::node("l40s-d", &[("gpu", "l40s"), ("zone", "a")], &[], false),
        fixture::node("a100-e", &[("gpu", "a100"), ("zone", "b")], &[], false),
        fixture::node("cpu-f", &[("zone", "a")], &[], false),
        fixture::node(
            "h100-g",
            &[("gpu", "h100")],
            &["dedicated=ml:NoSchedule"],
            false,
        ),
        fixture::node("h100-h", &[("gpu", "h100")], &[], true),
    ];
    for node in nodes {
        api.insert("nodes", node);
    }
    let held = ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4"];
    api.insert(
        "resourceclaims",
        fixture::allocated_claim("team", "train", "h100-a", &held),
    );
    let mig: Vec<&str> = mig_b.iter().map(String::as_str).collect();
    api.insert(
        "resourceclaims",
        fixture::allocated_claim("team", "infer", "h100-b", &mig),
    );
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    Cluster {
        api,
        dir,
        kubeconfig,
        devices,
    }
}

/// A rack of fake GB200 trays: NVLink clique 0 of four nodes (gb-a0..gb-a3), clique 1 of two
/// (gb-b0, gb-b1), each publishing four IMEX channels.
async fn fabric_cluster() -> Cluster {
    let api = ApiServer::start().await.expect("API server double");
    let mut devices = 0;
    for (node, clique) in [
        ("gb-a0", 0),
        ("gb-a1", 0),
        ("gb-a2", 0),
        ("gb-a3", 0),
        ("gb-b0", 1),
        ("gb-b1", 1),
    ] {
        let profile = gb200_tray(GB200_CLUSTER_UUID, clique);
        for slice in fixture::fabric_node_slices(DRIVER, node, &profile, 1) {
            devices += slice.spec.devices.as_ref().map_or(0, Vec::len);
            api.insert("resourceslices", serde_json::to_value(&slice).unwrap());
        }
        api.insert("nodes", fixture::node(node, &[], &[], false));
    }
    for class in fixture::device_classes() {
        api.insert("deviceclasses", class);
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    Cluster {
        api,
        dir,
        kubeconfig,
        devices,
    }
}

fn gpus(count: usize, selectors: &[&str], nvlink: bool) -> Value {
    let selectors: Vec<Value> = selectors
        .iter()
        .map(|e| json!({"cel": {"expression": e}}))
        .collect();
    let mut devices = json!({"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": DRIVER, "count": count, "selectors": selectors}}]});
    if nvlink {
        devices["constraints"] = json!([{"matchAttribute": "gpu.dra.dev/nvlinkDomain"}]);
    }
    devices
}

impl Cluster {
    /// A pod whose one claim comes from a template of its own (not created yet).
    fn pod_with_template(&self, name: &str, devices: Value, spec: Value) {
        self.api.insert(
            "resourceclaimtemplates",
            fixture::claim(NS, name, devices, true),
        );
        self.api.insert(
            "pods",
            fixture::pod(
                NS,
                name,
                json!([{"name": "gpu", "resourceClaimTemplateName": name}]),
                spec,
            ),
        );
    }

    /// Every object, as `kubectl get pods,resourceclaims,... -A -o yaml` prints them.
    fn dump(&self) -> PathBuf {
        let mut items = Vec::new();
        for resource in [
            "pods",
            "resourceclaims",
            "resourceclaimtemplates",
            "deviceclasses",
            "resourceslices",
            "nodes",
            "computedomains",
            "computedomains.resource.nvidia.com",
        ] {
            items.extend(self.api.list(resource));
        }
        let path = self.dir.path().join("cluster.yaml");
        std::fs::write(&path, serde_yaml::to_string(&fixture::list(items)).unwrap()).unwrap();
        path
    }

    async fn live(&self, args: &[&str]) -> Run {
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        args.extend(["--kubeconfig".into(), self.kubeconfig.display().to_string()]);
        run(env!("CARGO_BIN_EXE_gpu-dra").into(), args, None).await
    }
}

#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The node's line: its devices, or why not (after the NODE and FITS columns).
    fn line(&self, node: &str) -> String {
        let line = self
            .stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(node))
            .unwrap_or_else(|| panic!("no line for {node} in\n{}", self.stdout));
        let after_node = line[node.len()..].trim_start();
        let after_fits = after_node.split_once(' ').map_or("", |(_, text)| text);
        after_fits.trim().to_string()
    }
}

async fn run(program: PathBuf, args: Vec<String>, path: Option<String>) -> Run {
    tokio::task::spawn_blocking(move || {
        let mut command = Command::new(program);
        command.args(&args).env_remove("KUBECONFIG");
        if let Some(path) = path {
            command.env("PATH", path);
        }
        let output = command.output().expect("runs");
        Run {
            code: output.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_that_fits_on_two_nodes_with_a_reason_for_every_other_node() {
    let cluster = cluster().await;
    assert!(cluster.devices > 250, "{} devices", cluster.devices);
    cluster.pod_with_template("four-linked", gpus(4, &[], true), json!({}));
    let out = cluster.live(&["explain", "pod", "ml/four-linked"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    let first = out.stdout.lines().next().unwrap();
    assert_eq!(
        first,
        "Pod ml/four-linked: would fit on 2 of 8 nodes; the scheduler picks among them"
    );
    assert_eq!(out.line("h100-b"), "gpu-2, gpu-3, gpu-4, gpu-5");
    assert_eq!(out.line("h100-c"), "gpu-4, gpu-5, gpu-6, gpu-7");
    assert_eq!(
        out.line("h100-a"),
        "request gpu (4 wanted): 8 GPUs: 2 free, 5 allocated to other claims, 1 tainted gpu.dra.dev/xid=79:NoExecute"
    );
    assert_eq!(
        out.line("l40s-d"),
        "no four free GPUs share nvlinkDomain (none has nvlinkDomain)"
    );
    assert_eq!(
        out.line("a100-e"),
        "no four free GPUs share nvlinkDomain (at most 2 do)"
    );
    assert_eq!(out.line("cpu-f"), "no devices published for this node");
    assert_eq!(
        out.line("h100-g"),
        "node taint dedicated=ml:NoSchedule not tolerated by the pod"
    );
    assert_eq!(out.line("h100-h"), "node is unschedulable (cordoned)");
    // Read-only: the command made get and list requests and nothing else.
    let verbs: Vec<Verb> = cluster.api.requests().iter().map(|r| r.verb).collect();
    assert!(
        verbs.iter().all(|v| matches!(v, Verb::Get | Verb::List)),
        "{verbs:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_that_fits_nowhere_exits_1_and_says_what_the_scheduler_says() {
    let cluster = cluster().await;
    let memory = r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("100Gi")) >= 0"#;
    cluster.api.insert(
        "resourceclaims",
        fixture::claim(NS, "big", gpus(1, &[memory], false), false),
    );
    cluster.api.insert(
        "pods",
        fixture::pod(
            NS,
            "big",
            json!([{"name": "gpu", "resourceClaimName": "big"}]),
            json!({}),
        ),
    );
    let out = cluster.live(&["explain", "pod", "big", "-n", "ml"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines[0],
        "Pod ml/big: fits on no node (8 nodes: 1 unschedulable, 1 untolerated node taint, 1 no devices, 5 no matching devices)"
    );
    assert_eq!(
        lines[1],
        "scheduler: 0/8 nodes are available: 1 node(s) had untolerated taint(s), 1 node(s) were unschedulable, 6 cannot allocate all claims."
    );
    assert_eq!(
        out.line("h100-a"),
        format!("request gpu: selector `{memory}` matches 0 of 8 GPUs of class gpu.dra.dev")
    );
    assert_eq!(
        out.line("h100-c"),
        format!("request gpu: selector `{memory}` matches 0 of 4 GPUs of class gpu.dra.dev")
    );

    // The same as JSON, for tools.
    let out = cluster
        .live(&["explain", "pod", "ml/big", "-o", "json"])
        .await;
    assert_eq!(out.code, 1);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(report["fits"], false);
    assert_eq!(report["nodeCount"], 8);
    let b = report["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "h100-b")
        .unwrap();
    assert_eq!(b["reasons"][0]["kind"], "noMatch");
    assert_eq!(b["reasons"][0]["devices"]["onNode"], 208);
    assert_eq!(b["schedulerReason"], "cannot allocate all claims");
}

#[tokio::test(flavor = "multi_thread")]
async fn claims_made_from_templates_and_allocated_claims_are_followed() {
    let cluster = cluster().await;
    // The controller made claim ml/mig-xyz from the template and named it in the pod's status.
    let mig = json!({"requests": [{"name": "mig", "exactly": {"deviceClassName": "mig.gpu.dra.dev",
        "selectors": [{"cel": {"expression": "device.attributes[\"gpu.dra.dev\"].profile == \"3g.40gb\""}}]}}]});
    cluster.api.insert(
        "resourceclaimtemplates",
        fixture::claim(NS, "mig", mig.clone(), true),
    );
    cluster
        .api
        .insert("resourceclaims", fixture::claim(NS, "mig-xyz", mig, false));
    let mut pod = fixture::pod(
        NS,
        "mig",
        json!([{"name": "mig", "resourceClaimTemplateName": "mig"}]),
        json!({"nodeSelector": {"gpu": "h100"}}),
    );
    pod["status"]["resourceClaimStatuses"] =
        json!([{"name": "mig", "resourceClaimName": "mig-xyz"}]);
    cluster.api.insert("pods", pod);
    let out = cluster.live(&["explain", "pod", "ml/mig"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stdout
            .contains("claim ml/mig-xyz (pod claim mig, from template mig): mig: 1 of class mig.gpu.dra.dev with 1 selector"),
        "{}",
        out.stdout
    );
    assert_eq!(out.line("h100-b"), "gpu-0-mig-3g40gb-0");
    assert_eq!(out.line("h100-c"), "gpu-0-mig-3g40gb-4");
    assert_eq!(out.line("h100-a"), "request mig: class mig.gpu.dra.dev: selector `device.driver == \"gpu.dra.dev\" && device.attributes[\"gpu.dra.dev\"].type == \"mig\"` matches 0 of 8 GPUs");
    assert_eq!(
        out.line("a100-e"),
        "node affinity excludes it (nodeSelector gpu=h100)"
    );

    // An allocated claim pins its pod; `explain claim` shows where it is.
    cluster.api.insert(
        "resourceclaims",
        fixture::allocated_claim(NS, "held", "h100-c", &["gpu-5"]),
    );
    cluster.api.insert(
        "pods",
        fixture::pod(
            NS,
            "held",
            json!([{"name": "gpu", "resourceClaimName": "held"}]),
            json!({}),
        ),
    );
    let out = cluster.live(&["explain", "pod", "ml/held"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.line("h100-c"), "gpu-5 (allocated)");
    assert_eq!(out.line("h100-a"), "claim ml/held is allocated on h100-c");
    let out = cluster.live(&["explain", "claim", "ml/held"]).await;
    assert!(
        out.stdout
            .starts_with("ResourceClaim ml/held: would fit on 1 of 8 nodes: h100-c"),
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dump_gives_the_same_answer_as_the_cluster() {
    let cluster = cluster().await;
    cluster.pod_with_template("four-linked", gpus(4, &[], true), json!({}));
    cluster.pod_with_template(
        "eight",
        gpus(8, &[], false),
        json!({"tolerations": [{"operator": "Exists"}]}),
    );
    cluster.pod_with_template("eight-linked", gpus(8, &[], true), json!({}));
    let dump = cluster.dump();
    // The example output of docs/explain.md comes from this dump: EXPLAIN_DUMP_TO=cluster.yaml keeps a copy.
    if let Ok(keep) = std::env::var("EXPLAIN_DUMP_TO") {
        std::fs::copy(&dump, keep).expect("copying the dump");
    }
    for pod in ["ml/four-linked", "ml/eight", "ml/eight-linked"] {
        let live = cluster.live(&["explain", "pod", pod]).await;
        let offline = run(
            env!("CARGO_BIN_EXE_gpu-dra").into(),
            vec![
                "explain".into(),
                "pod".into(),
                pod.into(),
                "--from".into(),
                dump.display().to_string(),
            ],
            None,
        )
        .await;
        assert_eq!(live.stdout, offline.stdout);
        assert_eq!(live.code, offline.code);
    }
    let offline = offline_run(&dump, &["explain", "pod", "ml/eight"]).await;
    assert_eq!(offline.code, 0);
    assert_eq!(
        offline.line("h100-g"),
        "gpu-0, gpu-1, gpu-2, gpu-3, gpu-4, gpu-5, gpu-6, gpu-7",
        "the pod tolerates every taint"
    );
    assert_eq!(
        offline.line("h100-b"),
        "request gpu (8 wanted): 8 GPUs: 6 free, 2 overlap allocated devices (shared counters used up)"
    );

    // A claim file against the dump: no pod, so only the devices decide.
    let file = cluster.dir.path().join("claim.yaml");
    std::fs::write(
        &file,
        serde_yaml::to_string(&fixture::claim(NS, "new", gpus(3, &[], false), false)).unwrap(),
    )
    .unwrap();
    let out = offline_run(
        &dump,
        &[
            "explain",
            "--claim",
            &file.display().to_string(),
            "-o",
            "yaml",
        ],
    )
    .await;
    assert_eq!(out.code, 0, "{out:?}");
    let report: Value = serde_yaml::from_str(&out.stdout).unwrap();
    assert_eq!(report["subject"]["kind"], "file");
    assert_eq!(report["fittingNodes"], 6, "{}", out.stdout);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_of_a_compute_domain_that_is_not_placed_waits_for_it_live_and_from_a_dump() {
    let cluster = fabric_cluster().await;
    assert_eq!(cluster.devices, 6 * (4 + 1));
    // Five nodes: more than either clique has. A domain of NVIDIA's group elsewhere is listed too.
    cluster.api.insert(
        "computedomains",
        fixture::compute_domain("gpu.dra.dev/v1alpha1", NS, "imex", 5),
    );
    cluster.api.insert(
        "computedomains.resource.nvidia.com",
        fixture::compute_domain("resource.nvidia.com/v1beta1", "other", "theirs", 1),
    );
    cluster.api.insert(
        "pods",
        fixture::pod(
            NS,
            "worker-0",
            json!([{"name": "channel", "resourceClaimTemplateName": "imex-channel"}]),
            json!({}),
        ),
    );
    let live = cluster.live(&["explain", "pod", "ml/worker-0"]).await;
    assert_eq!(live.code, 1, "{live:?}");
    let first = live.stdout.lines().next().unwrap();
    assert_eq!(
        first,
        format!(
            "Pod ml/worker-0: waits for ComputeDomain ml/imex: not placed: no NVLink clique has 5 free \
             nodes: {GB200_CLUSTER_UUID}.0 has 4 (of 4), {GB200_CLUSTER_UUID}.1 has 2 (of 2); nodes \
             without an NVLink fabric are never used (explain's own placement from the ResourceSlices \
             and claims: the domain has no gpu.dra.dev/placement annotation)"
        )
    );
    assert_eq!(
        live.line("gb-b1"),
        "pod claim channel waits for ComputeDomain ml/imex (ResourceClaimTemplate ml/imex-channel does not exist yet)"
    );

    // A dump with the ComputeDomains (`kubectl get ...,computedomains.gpu.dra.dev,... -A -o yaml`)
    // gives the same answer. docs/explain.md's example comes from this dump: EXPLAIN_DOMAIN_DUMP_TO keeps it.
    let dump = cluster.dump();
    if let Ok(keep) = std::env::var("EXPLAIN_DOMAIN_DUMP_TO") {
        std::fs::copy(&dump, keep).expect("copying the dump");
    }
    let offline = offline_run(&dump, &["explain", "pod", "ml/worker-0"]).await;
    assert_eq!((offline.code, &offline.stdout), (1, &live.stdout));
    assert!(
        !offline.stdout.contains("ignored"),
        "ComputeDomains are read, not ignored: {}",
        offline.stdout
    );
}

async fn offline_run(dump: &Path, args: &[&str]) -> Run {
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.extend(["--from".into(), dump.display().to_string()]);
    run(env!("CARGO_BIN_EXE_gpu-dra").into(), args, None).await
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_exit_2_with_the_reason_on_stderr() {
    let cluster = cluster().await;
    let out = cluster.live(&["explain", "pod", "ml/absent"]).await;
    assert_eq!(out.code, 2);
    assert_eq!(out.stderr.trim(), "error: Pod ml/absent not found");
    cluster.pod_with_template(
        "typo",
        json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev.typo"}}]}),
        json!({}),
    );
    let out = cluster.live(&["explain", "pod", "ml/typo"]).await;
    assert_eq!(out.code, 2);
    assert_eq!(
        out.stderr.trim(),
        "error: claim ml/typo: request gpu: device class gpu.dra.dev.typo does not exist"
    );
    let runtime = r#"device.attributes["gpu.dra.dev"].nosuch == "x""#;
    cluster.pod_with_template("runtime", gpus(1, &[runtime], false), json!({}));
    let out = cluster.live(&["explain", "pod", "ml/runtime"]).await;
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr
            .contains("CEL runtime error: no such key: nosuch"),
        "{}",
        out.stderr
    );
    let bad = cluster.dir.path().join("bad.yaml");
    std::fs::write(&bad, "items: [").unwrap();
    let out = offline_run(&bad, &["explain", "pod", "ml/x"]).await;
    assert_eq!(out.code, 2);
    assert!(
        out.stderr
            .contains("bad.yaml: document 1: did not find expected node content"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_binary_is_the_kubectl_plugin_under_the_name_kubectl_gpu_dra() {
    let cluster = cluster().await;
    cluster.pod_with_template("four-linked", gpus(4, &[], true), json!({}));
    let dump = cluster.dump();
    let bin = cluster.dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let plugin = bin.join("kubectl-gpu_dra");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_gpu-dra"), &plugin).unwrap();
    let args: Vec<String> = ["explain", "pod", "ml/four-linked", "--from"]
        .iter()
        .map(|a| a.to_string())
        .chain([dump.display().to_string()])
        .collect();
    let direct = offline_run(&dump, &["explain", "pod", "ml/four-linked"]).await;
    let out = run(plugin.clone(), args.clone(), None).await;
    assert_eq!((out.code, &out.stdout), (0, &direct.stdout));
    let help = run(plugin, vec!["explain".into(), "--help".into()], None).await;
    assert!(
        help.stdout.contains("Usage: kubectl gpu-dra explain"),
        "{}",
        help.stdout
    );
    // Through kubectl itself, where it is installed: it finds `kubectl-gpu_dra` on PATH.
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let probe = Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output();
    if probe.is_err() {
        eprintln!("kubectl is not installed: the plugin was run by its name only");
        return;
    }
    let mut kubectl_args = vec!["gpu-dra".to_string()];
    kubectl_args.extend(args);
    let out = run("kubectl".into(), kubectl_args, Some(path)).await;
    assert_eq!(
        (out.code, &out.stdout),
        (0, &direct.stdout),
        "{}",
        out.stderr
    );
}
