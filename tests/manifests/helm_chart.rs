//! The Helm chart in `deploy/helm/gpu-dra` is kustomize's `deploy/` in another form: for the same settings
//! both must render the same objects (kind, namespace, name and every field), so that neither drifts from
//! the other. The chart is rendered by Helm's own engine (Helm v4's Go SDK through the Python package
//! helm-python-sdk, `helm_render.py`), kustomize by `kubectl kustomize`, whose renders are kept in
//! `kustomize-renders/` for machines without kubectl (CI's). The engine is installed under target/ by the
//! first test that needs it (pip, once per build directory); an engine that cannot be installed, or a kept
//! render older than `deploy/` where kubectl is missing, fails the test with how to fix it. Every rendered
//! object also goes through `check_strict`.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use k8s_openapi::api::apps::v1::DaemonSet;
use serde_json::{json, Value};

use sha2::{Digest, Sha256};

use super::{check_strict, kustomize_dir_text, lost_keys, parse_docs, read_docs, root, Doc};

const CHART: &str = "deploy/helm/gpu-dra";
const FAKE_VALUES: &str = "deploy/helm/fake-values.yaml";
const RENDER: &str = "tests/manifests/helm_render.py";
const NVML: &str = "resources: [../../deploy/overlays/nvml]\n";
const FAKE: &str = "resources: [../../deploy/overlays/fake]\n";
/// Kinds without a namespace. kustomize's `namespace:` sets one on those whose schema it lacks
/// (ValidatingAdmissionPolicy, its binding, DeviceClass); the API server has none for them.
const CLUSTER_SCOPED: [&str; 6] = [
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "DeviceClass",
];

/// Where `cargo test` keeps Helm's engine: installed once per build directory by `helm_render.py install`
/// (pip into a directory of target/, nothing outside it), so the README's test command needs nothing
/// installed beforehand but Python 3 with pip. Err says why it could not be installed.
fn engine_dir() -> Result<&'static Path, &'static str> {
    static ENGINE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let engine = ENGINE.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("helm-engine");
        let output = python3(None, &[], &["install".as_ref(), dir.as_os_str()])?;
        if output.status.success() {
            Ok(dir)
        } else {
            Err(String::from_utf8_lossy(&output.stderr).into_owned())
        }
    });
    engine
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(String::as_str)
}

/// Runs `python3 [python_flags] helm_render.py args` with `engine` on PYTHONPATH; Err when python3 cannot
/// be started, saying what to install.
fn python3(
    engine: Option<&Path>,
    python_flags: &[&str],
    args: &[&OsStr],
) -> Result<Output, String> {
    let mut command = Command::new("python3");
    command
        .args(python_flags)
        .arg(root().join(RENDER))
        .args(args)
        .current_dir(root());
    if let Some(engine) = engine {
        let mut path = vec![engine.to_path_buf()];
        path.extend(std::env::split_paths(
            &std::env::var_os("PYTHONPATH").unwrap_or_default(),
        ));
        command.env(
            "PYTHONPATH",
            std::env::join_paths(path).expect("no ':' in a path under target/"),
        );
    }
    command.output().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!(
            "python3 is not installed: the Helm chart is rendered by Helm's engine through Python \
             ({RENDER}). Install Python 3.10 or later with pip; `cargo test` then installs the engine \
             under target/ by itself"
        ),
        _ => format!("cannot run python3 {RENDER}: {e}"),
    })
}

/// Runs `helm_render.py` with `args` and the engine of `engine_dir`; panics, saying why, when python3 or
/// the engine cannot be had.
fn helm_render(args: &[&str]) -> Output {
    let engine = engine_dir().unwrap_or_else(|why| panic!("Helm's engine: {why}"));
    let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    python3(Some(engine), &[], &args).unwrap_or_else(|why| panic!("{why}"))
}

fn helm_ok(args: &[&str]) -> String {
    let output = helm_render(args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "python3 {RENDER} {}: {stderr}",
        args.join(" ")
    );
    String::from_utf8(output.stdout).unwrap_or_else(|e| panic!("{RENDER} printed no UTF-8: {e}"))
}

/// The chart's objects for the values of `values_file` (as `helm -f`) with `set` over them (as
/// `--set-json`); each passes `check_strict`.
fn helm(values_file: Option<&str>, set: &Value) -> Vec<Doc> {
    let set = set.to_string();
    let mut args = vec!["render", CHART, "--set-json", set.as_str()];
    if let Some(file) = values_file {
        args.extend(["--values", file]);
    }
    let rendered: BTreeMap<String, String> = serde_json::from_str(&helm_ok(&args))
        .unwrap_or_else(|e| panic!("{RENDER} render printed no JSON map: {e}"));
    let docs: Vec<Doc> = rendered
        .iter()
        .flat_map(|(template, text)| parse_docs(&format!("helm {template}"), text))
        .collect();
    let failures: Vec<String> = docs
        .iter()
        .filter_map(|d| {
            check_strict(d)
                .err()
                .map(|e| format!("{} ({} {}): {e}", d.origin, d.kind(), d.name()))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "the chart ({set}) renders invalid objects:\n{}",
        failures.join("\n")
    );
    docs
}

/// Where kustomize's renders of the chart's counterparts are kept, for machines without kubectl (CI's).
const RENDERS: &str = "tests/manifests/kustomize-renders";

/// What a render depends on: the kustomization and every YAML file it can reach (`deploy/` but the
/// chart, `e2e/deploy/`), hashed.
fn render_inputs(kustomization: &str) -> String {
    fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.ends_with("deploy/helm") {
                continue;
            }
            if path.is_dir() {
                files(&path, out);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                out.push(path);
            }
        }
    }
    let mut all = Vec::new();
    files(&root().join("deploy"), &mut all);
    files(&root().join("e2e/deploy"), &mut all);
    all.sort();
    let mut hash = Sha256::new();
    hash.update(kustomization.as_bytes());
    for path in all {
        hash.update(
            path.strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .as_bytes(),
        );
        hash.update(std::fs::read(&path).unwrap());
    }
    hex::encode(hash.finalize())
}

/// kustomize's render of an inline kustomization (see `kustomize_dir`). Each render is also kept in
/// `RENDERS`, under a hash of its kustomization, with a hash of its inputs: where kubectl is installed
/// the kept render must equal today's (`UPDATE_KUSTOMIZE_RENDERS=1` rewrites it); where it is not (CI),
/// the kept render is used, and only while its inputs are unchanged.
fn kustomize(kustomization: &str) -> Vec<Doc> {
    let name = hex::encode(&Sha256::digest(kustomization.as_bytes())[..8]);
    let kept = root().join(RENDERS).join(format!("{name}.yaml"));
    let inputs = render_inputs(kustomization);
    let header = format!(
        "# kubectl kustomize of:\n# {}\n# inputs: {inputs}\n",
        kustomization.trim_end().replace('\n', "\n# ")
    );
    let stored = std::fs::read_to_string(&kept).ok();
    let text = match kustomize_dir_text(kustomization) {
        Some(rendered) => {
            let fresh = format!("{header}{rendered}");
            if stored.as_deref() != Some(fresh.as_str()) {
                if std::env::var_os("UPDATE_KUSTOMIZE_RENDERS").is_some() {
                    std::fs::create_dir_all(kept.parent().unwrap()).unwrap();
                    std::fs::write(&kept, &fresh).unwrap();
                } else {
                    panic!(
                        "{} is not kustomize's render of today's deploy/ (missing or stale): run \
                         `UPDATE_KUSTOMIZE_RENDERS=1 cargo test --test manifests helm_chart` and commit it",
                        kept.display()
                    );
                }
            }
            rendered
        }
        None => {
            let stored = stored.unwrap_or_else(|| {
                panic!(
                    "kubectl is not installed and {} is missing: install kubectl (it includes kustomize) and \
                     run `UPDATE_KUSTOMIZE_RENDERS=1 cargo test --test manifests helm_chart`",
                    kept.display()
                )
            });
            assert!(
                stored.starts_with(&header),
                "{} was rendered from another deploy/ than today's, and kubectl is not installed to render it \
                 again: install kubectl and run `UPDATE_KUSTOMIZE_RENDERS=1 cargo test --test manifests helm_chart`",
                kept.display()
            );
            stored[header.len()..].to_string()
        }
    };
    parse_docs(&format!("kustomize ({name})"), &text)
}

type Key = (String, String, String);

fn by_key<'a>(label: &str, docs: &'a [Doc]) -> BTreeMap<Key, &'a Value> {
    let mut map = BTreeMap::new();
    for doc in docs {
        let key = (
            doc.kind().to_string(),
            doc.namespace().to_string(),
            doc.name().to_string(),
        );
        assert!(
            map.insert(key.clone(), &doc.value).is_none(),
            "{label}: {key:?} twice"
        );
    }
    map
}

/// Both sides hold the same objects with the same fields and values.
fn assert_same(label: &str, chart: &[Doc], kustomized: &[Doc]) {
    let chart = by_key(&format!("{label}, chart"), chart);
    let kustomized = by_key(&format!("{label}, kustomize"), kustomized);
    let mut problems = Vec::new();
    for key in chart.keys().filter(|k| !kustomized.contains_key(*k)) {
        problems.push(format!("{key:?}: only the chart renders it"));
    }
    for key in kustomized.keys().filter(|k| !chart.contains_key(*k)) {
        problems.push(format!("{key:?}: only kustomize renders it"));
    }
    for (key, a) in &chart {
        let Some(b) = kustomized.get(key) else {
            continue;
        };
        let (mut differ, mut only_kustomize) = (Vec::new(), Vec::new());
        lost_keys(a, b, "", &mut differ);
        lost_keys(b, a, "", &mut only_kustomize);
        // A changed value is in `differ` already, as `path (chart's became kustomize's)`.
        only_kustomize.retain(|path| !path.contains(" became "));
        if !differ.is_empty() || !only_kustomize.is_empty() {
            problems.push(format!(
                "{key:?}: chart's fields that differ from kustomize's: {differ:?}; fields only kustomize has: {only_kustomize:?}"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{label}: the chart and kustomize render different objects (a value differing by a blank line inside \
         an expression: kustomize's YAML parser adds one in folded `>` scalars with more-indented lines; \
         write those as literal `|` scalars):\n{}",
        problems.join("\n")
    );
}

/// kustomize's render with the namespace it gives cluster-scoped objects removed (`CLUSTER_SCOPED`).
fn without_cluster_scoped_namespaces(mut docs: Vec<Doc>) -> Vec<Doc> {
    for doc in docs
        .iter_mut()
        .filter(|d| CLUSTER_SCOPED.contains(&d.kind()))
    {
        if let Some(metadata) = doc.value["metadata"].as_object_mut() {
            metadata.remove("namespace");
        }
    }
    docs
}

/// A kustomize patch that deletes the objects of `kind` named one of `names`.
fn delete_patch(kind: &str, api_version: &str, names: &[&str]) -> String {
    format!(
        "  - target:\n      kind: {kind}\n      name: ^({})$\n    patch: |-\n      $patch: delete\n      apiVersion: {api_version}\n      kind: {kind}\n      metadata:\n        name: any\n",
        names.join("|")
    )
}

/// A kustomization of the nvml overlay without the objects of `files` (under deploy/base).
fn nvml_without(files: &[&str]) -> String {
    let docs: Vec<Doc> = files
        .iter()
        .flat_map(|f| read_docs(&root().join("deploy/base").join(f)))
        .collect();
    let mut patches = String::new();
    let mut kinds: Vec<(&str, &str)> = docs
        .iter()
        .map(|d| (d.kind(), d.value["apiVersion"].as_str().unwrap_or("")))
        .collect();
    kinds.sort();
    kinds.dedup();
    for (kind, api_version) in kinds {
        let names: Vec<&str> = docs
            .iter()
            .filter(|d| d.kind() == kind)
            .map(Doc::name)
            .collect();
        patches.push_str(&delete_patch(kind, api_version, &names));
    }
    format!("{NVML}patches:\n{patches}")
}

#[test]
fn the_defaults_render_the_nvml_overlay() {
    assert_same("defaults", &helm(None, &json!({})), &kustomize(NVML));
}

#[test]
fn the_fake_values_render_the_fake_overlay() {
    assert_same(
        FAKE_VALUES,
        &helm(Some(FAKE_VALUES), &json!({})),
        &kustomize(FAKE),
    );
}

#[test]
fn a_fake_profile_of_ones_own_renders_like_a_patched_configmap() {
    let profile =
        "name: one-a100\ngpus:\n  - productName: NVIDIA A100-SXM4-40GB\n    migCapable: true\n";
    let quoted = Value::from(profile).to_string();
    assert_same(
        "fake.profile",
        &helm(Some(FAKE_VALUES), &json!({"fake": {"profile": profile}})),
        &kustomize(&format!(
            "{FAKE}patches:
  - target: {{kind: ConfigMap, name: gpu-dra-fake-profile}}
    patch: |-
      - {{op: replace, path: /data/profile.yaml, value: {quoted}}}
"
        )),
    );
}

#[test]
fn the_extended_resource_renders_the_component() {
    let on = json!({"extendedResource": {"enabled": true}});
    assert_same(
        "extendedResource.enabled",
        &helm(None, &on),
        &kustomize(&format!(
            "{NVML}components: [../../deploy/components/extended-resource]\n"
        )),
    );
    // What e2e/run.sh deploys on kind: the fake overlay with the component.
    assert_same(
        "fake values, extendedResource.enabled",
        &helm(Some(FAKE_VALUES), &on),
        &kustomize("resources: [../../e2e/deploy]\n"),
    );
}

#[test]
fn nvidia_compatibility_renders_the_component() {
    let on = json!({"nvidiaCompatibility": {"enabled": true}});
    assert_same(
        "nvidiaCompatibility.enabled",
        &helm(None, &on),
        &kustomize(&format!(
            "{NVML}components: [../../deploy/components/nvidia-compat]\n"
        )),
    );
    assert_same(
        "fake values, nvidiaCompatibility.enabled",
        &helm(Some(FAKE_VALUES), &on),
        &kustomize(&format!(
            "{FAKE}components: [../../deploy/components/nvidia-compat]\n"
        )),
    );
    assert_same(
        "nvidiaCompatibility.nvidiaNamespace",
        &helm(
            None,
            &json!({"nvidiaCompatibility": {"enabled": true, "nvidiaNamespace": "nvidia-dra-driver-gpu"}}),
        ),
        &kustomize(&format!(
            "{NVML}components: [../../deploy/components/nvidia-compat, ../../deploy/components/nvidia-migration]\n"
        )),
    );
}

#[test]
fn a_node_selector_renders_the_node_by_node_component() {
    assert_same(
        "nodeSelector gpu-dra.dev/kubelet-plugin",
        &helm(
            None,
            &json!({"nodeSelector": {"gpu-dra.dev/kubelet-plugin": "true"}}),
        ),
        &kustomize(&format!(
            "{NVML}components: [../../deploy/components/node-by-node]\n"
        )),
    );
}

#[test]
fn admission_policies_off_render_the_base_without_them() {
    for (values, files) in [
        (
            json!({"pluginWrites": false}),
            &["admission-policy.yaml"][..],
        ),
        (
            json!({"deviceConfigs": false}),
            &["config-admission-policy.yaml"][..],
        ),
        (
            json!({"pluginWrites": false, "deviceConfigs": false}),
            &["admission-policy.yaml", "config-admission-policy.yaml"][..],
        ),
    ] {
        let chart = helm(None, &json!({ "admissionPolicies": values }));
        assert_same(
            &format!("admissionPolicies {values}"),
            &chart,
            &kustomize(&nvml_without(files)),
        );
    }
}

#[test]
fn the_namespace_renders_as_kustomize_namespace_or_is_left_out() {
    let chart = helm(None, &json!({"namespace": {"name": "gpus"}}));
    for doc in chart.iter().filter(|d| CLUSTER_SCOPED.contains(&d.kind())) {
        assert_eq!(doc.namespace(), "", "{}: cluster-scoped", doc.origin);
    }
    assert_same(
        "namespace.name gpus",
        &chart,
        &without_cluster_scoped_namespaces(kustomize(&format!("{NVML}namespace: gpus\n"))),
    );
    assert_same(
        "namespace.create false",
        &helm(None, &json!({"namespace": {"create": false}})),
        &kustomize(&nvml_without(&["namespace.yaml"])),
    );
}

/// JSON patch operations on the plugin container that replace `field` of the entry named `name` of the
/// list at `list` (`env`, `volumeMounts`, or the pod's `volumes`), found by name in deploy/base and
/// tested by name, so that a reordered base fails here instead of patching another entry.
fn replace_in_list(list: &str, name: &str, field: &str, value: &str) -> String {
    let ds = read_docs(&root().join("deploy/base/daemonset.yaml"))
        .into_iter()
        .find(|d| d.kind() == "DaemonSet")
        .unwrap_or_else(|| panic!("deploy/base/daemonset.yaml has no DaemonSet"));
    let ds: DaemonSet = ds.typed();
    let pod = ds.spec.template.spec.unwrap_or_default();
    let names: Vec<String> = match list {
        "env" => pod.containers[0]
            .env
            .iter()
            .flatten()
            .map(|e| e.name.clone())
            .collect(),
        "volumes" => pod
            .volumes
            .iter()
            .flatten()
            .map(|v| v.name.clone())
            .collect(),
        other => panic!("no list {other}"),
    };
    let index = names
        .iter()
        .position(|n| n == name)
        .unwrap_or_else(|| panic!("deploy/base's plugin has no {list} entry {name}"));
    let path = match list {
        "env" => format!("/spec/template/spec/containers/0/env/{index}"),
        _ => format!("/spec/template/spec/volumes/{index}"),
    };
    format!(
        "      - {{op: test, path: {path}/name, value: {name}}}\n      - {{op: replace, path: {path}/{field}, value: {value}}}\n"
    )
}

#[test]
fn other_settings_render_like_a_kustomize_overlay_that_patches_them() {
    let values = json!({
        "image": {"repository": "registry.example.com/gpu/gpu-dra", "tag": "v0.1.0", "pullPolicy": "Always"},
        "driverRoot": "/run/nvidia/driver",
        "migMode": "dynamic",
        "tolerations": [{"operator": "Exists"}],
        "nodeSelector": {"node-pool": "gpus"},
        "affinity": null,
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}},
        "extraEnv": [{"name": "RESCAN_SECONDS", "value": "30"}],
    });
    let ds = "/spec/template/spec";
    let mut patch = String::new();
    patch.push_str(&replace_in_list("env", "MIG_MODE", "value", "dynamic"));
    patch.push_str(&replace_in_list(
        "env",
        "NVIDIA_DRIVER_ROOT",
        "value",
        "/run/nvidia/driver",
    ));
    patch.push_str(&replace_in_list(
        "volumes",
        "driver-root",
        "hostPath/path",
        "/run/nvidia/driver",
    ));
    patch.push_str(&format!(
        "      - {{op: replace, path: {ds}/containers/0/imagePullPolicy, value: Always}}
      - {{op: replace, path: {ds}/tolerations, value: [{{operator: Exists}}]}}
      - {{op: add, path: {ds}/nodeSelector, value: {{node-pool: gpus}}}}
      - {{op: remove, path: {ds}/affinity}}
      - {{op: replace, path: {ds}/containers/0/resources, value: {{requests: {{cpu: 100m, memory: 128Mi}}, limits: {{memory: 1Gi}}}}}}
      - {{op: add, path: {ds}/containers/0/env/-, value: {{name: RESCAN_SECONDS, value: \"30\"}}}}
"
    ));
    let kustomization = format!(
        "{NVML}images:
  - name: gpu-dra
    newName: registry.example.com/gpu/gpu-dra
    newTag: v0.1.0
patches:
  - target: {{kind: DaemonSet, name: gpu-dra-plugin}}
    patch: |-
{patch}  # The controller runs the same image with the same pull policy.
  - target: {{kind: Deployment, name: gpu-dra-controller}}
    patch: |-
      - {{op: replace, path: /spec/template/spec/containers/0/imagePullPolicy, value: Always}}
"
    );
    assert_same(
        &format!("{values}"),
        &helm(None, &values),
        &kustomize(&kustomization),
    );
}

/// JSON patch operations on the controller container that replace the value of its env entry `name`,
/// found by name in deploy/base (see `replace_in_list`).
fn replace_controller_env(name: &str, value: &str) -> String {
    let deployment = read_docs(&root().join("deploy/base/controller.yaml"))
        .into_iter()
        .find(|d| d.kind() == "Deployment")
        .unwrap_or_else(|| panic!("deploy/base/controller.yaml has no Deployment"));
    let deployment: k8s_openapi::api::apps::v1::Deployment = deployment.typed();
    let pod = deployment.spec.template.spec.unwrap_or_default();
    let index = pod.containers[0]
        .env
        .iter()
        .flatten()
        .position(|e| e.name == name)
        .unwrap_or_else(|| panic!("deploy/base's controller has no env entry {name}"));
    let path = format!("/spec/template/spec/containers/0/env/{index}");
    format!(
        "      - {{op: test, path: {path}/name, value: {name}}}\n      - {{op: replace, path: {path}/value, value: {value}}}\n"
    )
}

/// `controller.replicas` and `controller.leaderElection` render like a kustomize patch of the controller's
/// Deployment; one replica without leader election also leaves out the Lease's Role and binding and the
/// PodDisruptionBudget (which would block every drain); more replicas without it are refused, and so is
/// a timing that is not a duration.
#[test]
fn the_controller_values_render_like_a_patched_deployment() {
    let timings = json!({"controller": {"replicas": 3, "leaderElection": {
        "leaseDuration": "30s", "renewDeadline": "20s", "retryPeriod": "4s"}}});
    let patch = [
        replace_controller_env("LEADER_ELECT_LEASE_DURATION", "30s"),
        replace_controller_env("LEADER_ELECT_RENEW_DEADLINE", "20s"),
        replace_controller_env("LEADER_ELECT_RETRY_PERIOD", "4s"),
    ]
    .concat();
    assert_same(
        &timings.to_string(),
        &helm(None, &timings),
        &kustomize(&format!(
            "{NVML}patches:
  - target: {{kind: Deployment, name: gpu-dra-controller}}
    patch: |-
      - {{op: replace, path: /spec/replicas, value: 3}}
{patch}"
        )),
    );

    let single = json!({"controller": {"replicas": 1, "leaderElection": {"enabled": false}}});
    assert_same(
        &single.to_string(),
        &helm(None, &single),
        &kustomize(&format!(
            "{NVML}patches:
  - target: {{kind: Deployment, name: gpu-dra-controller}}
    patch: |-
      - {{op: replace, path: /spec/replicas, value: 1}}
{}{}{}{}",
            replace_controller_env("LEADER_ELECT", "\"false\""),
            delete_patch(
                "Role",
                "rbac.authorization.k8s.io/v1",
                &["gpu-dra-controller"]
            ),
            delete_patch(
                "RoleBinding",
                "rbac.authorization.k8s.io/v1",
                &["gpu-dra-controller"]
            ),
            delete_patch("PodDisruptionBudget", "policy/v1", &["gpu-dra-controller"]),
        )),
    );

    for (set, says) in [
        (
            r#"{"controller": {"leaderElection": {"enabled": false}}}"#,
            "controller.replicas above 1 needs controller.leaderElection.enabled",
        ),
        (
            r#"{"controller": {"leaderElection": {"leaseDuration": "15"}}}"#,
            "/controller/leaderElection/leaseDuration",
        ),
    ] {
        let output = helm_render(&["render", CHART, "--set-json", set]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(1),
            "render {set} must be refused: {stderr}"
        );
        assert!(stderr.contains(says), "render {set}: {stderr}");
    }
}

/// `crds/` of the chart is `crd/` byte for byte (Helm applies it at install, `kubectl apply -f crd/` the
/// other); Helm reads it as the chart's CRDs.
#[test]
fn the_charts_crds_are_crd_byte_for_byte() {
    let files = |dir: &Path| -> BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
            .map(|entry| {
                let path = entry
                    .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
                    .path();
                let name = path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let bytes = std::fs::read(&path)
                    .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
                (name, bytes)
            })
            .collect()
    };
    let crd = files(&root().join("crd"));
    let chart = files(&root().join(CHART).join("crds"));
    assert_eq!(
        crd.keys().collect::<Vec<_>>(),
        chart.keys().collect::<Vec<_>>(),
        "{CHART}/crds must hold the files of crd/"
    );
    for (name, bytes) in &crd {
        assert!(
            chart[name] == *bytes,
            "{CHART}/crds/{name} differs from crd/{name}: copy it (cp crd/{name} {CHART}/crds/)"
        );
    }
    let rendered: BTreeMap<String, String> =
        serde_json::from_str(&helm_ok(&["render", CHART, "--include-crds"]))
            .unwrap_or_else(|e| panic!("{RENDER} render printed no JSON map: {e}"));
    for (name, bytes) in &crd {
        let seen = rendered
            .get(&format!("crds/{name}"))
            .unwrap_or_else(|| panic!("Helm does not see {CHART}/crds/{name}"));
        assert_eq!(
            seen.as_bytes(),
            bytes.as_slice(),
            "crds/{name} as Helm reads it"
        );
    }
}

/// `helm lint --strict` finds nothing above info in the chart, with its defaults and the fake values, and
/// the schema refuses values the chart does not know.
#[test]
fn helm_lint_passes_and_the_schema_refuses_unknown_values() {
    let lint = |extra: &[&str]| -> Value {
        let mut args = vec!["lint", CHART];
        args.extend(extra);
        serde_json::from_str(&helm_ok(&args))
            .unwrap_or_else(|e| panic!("{RENDER} lint printed no JSON: {e}"))
    };
    let findings = |report: &Value| -> Vec<String> {
        report["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["severity"].as_u64().unwrap_or(3) >= 2)
            .map(|m| format!("{}: {}", m["path"], m["error"]))
            .collect()
    };
    for extra in [&[][..], &["--values", FAKE_VALUES][..]] {
        let report = lint(extra);
        assert_eq!(
            report["total_charts_linted"], 1,
            "{extra:?}: nothing linted: {report}"
        );
        let found = findings(&report);
        assert!(
            found.is_empty(),
            "helm lint {extra:?}:\n{}",
            found.join("\n")
        );
    }
    let bad = lint(&["--set-json", r#"{"backend": "nvlm"}"#]);
    let found = findings(&bad).join("\n");
    assert!(
        found.contains("/backend") && found.contains("'nvml', 'fake'"),
        "lint must refuse backend nvlm: {bad}"
    );

    for (set, says) in [
        (r#"{"migmode": "dynamic"}"#, "'migmode' not allowed"),
        (r#"{"migMode": "on"}"#, "/migMode"),
        (r#"{"driverRoot": "run/nvidia/driver"}"#, "/driverRoot"),
    ] {
        let output = helm_render(&["render", CHART, "--set-json", set]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(1),
            "render {set} must be refused: {stderr}"
        );
        assert!(stderr.contains(says), "render {set}: {stderr}");
    }
}

/// Without the engine the render fails (exit 3) and says how to install it, instead of rendering
/// nothing. `-I -S`: Python without its site-packages nor PYTHONPATH, where the engine is found.
#[test]
fn without_the_engine_the_render_fails_with_how_to_install_it() {
    let args = ["render".as_ref(), CHART.as_ref()];
    let output = python3(None, &["-I", "-S"], &args).unwrap_or_else(|why| panic!("{why}"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("python3 -m pip install helm-python-sdk=="),
        "{stderr}"
    );
}
