//! Offline checks of the deployment manifests in `deploy/`, the e2e workloads in `e2e/workloads/` and the examples in `examples/`:
//! every object must survive a round trip through its `k8s-openapi` type without losing a key (so a
//! misspelled or misplaced field fails), and the plugin's DaemonSet must mount and know what it needs.
//! `rbac` checks the plugin's grants against the calls in `src/`, `admission` the policies that narrow
//! its writes, `config_admission` the policy that refuses malformed device configs in users' claims,
//! `helm_chart` that the Helm chart in `deploy/helm/` renders what kustomize renders.

mod admission;
mod cel_env;
mod config_admission;
mod extended_resource;
mod helm_chart;
mod mps_pod_admission;
mod node_admission;
mod rbac;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimTemplate};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One YAML document of a manifest file.
struct Doc {
    /// `file#index`, for messages.
    origin: String,
    value: Value,
}

impl Doc {
    fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or("")
    }

    fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or("")
    }

    fn namespace(&self) -> &str {
        self.value["metadata"]["namespace"].as_str().unwrap_or("")
    }

    fn typed<T: DeserializeOwned>(&self) -> T {
        serde_json::from_value(self.value.clone())
            .unwrap_or_else(|e| panic!("{}: not a valid {}: {e}", self.origin, self.kind()))
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
            .path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(path);
        }
    }
}

fn parse_docs(origin: &str, text: &str) -> Vec<Doc> {
    let mut docs = Vec::new();
    for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(de)
            .unwrap_or_else(|e| panic!("{origin}: document {i} is not valid YAML: {e}"));
        // `---` at the end of a file, or a document of comments only.
        if value.is_null() {
            continue;
        }
        docs.push(Doc {
            origin: format!("{origin}#{i}"),
            value,
        });
    }
    docs
}

fn read_docs(path: &Path) -> Vec<Doc> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let origin = path
        .strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string();
    parse_docs(&origin, &text)
}

fn is_kustomization(path: &Path) -> bool {
    matches!(
        path.file_name().and_then(|n| n.to_str()),
        Some("kustomization.yaml" | "kustomization.yml" | "Kustomization")
    )
}

/// The patch files the kustomizations under `dir` name; they are partial objects.
fn patch_files(files: &[PathBuf]) -> BTreeSet<PathBuf> {
    let mut patches = BTreeSet::new();
    for file in files.iter().filter(|f| is_kustomization(f)) {
        let dir = file.parent().unwrap_or(Path::new("."));
        for doc in read_docs(file) {
            let from_patches = doc.value["patches"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["path"].as_str());
            let from_smp = doc.value["patchesStrategicMerge"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p.as_str());
            for rel in from_patches.chain(from_smp) {
                patches.insert(dir.join(rel));
            }
        }
    }
    patches
}

/// The transformer configurations (`configurations:`) the kustomizations name; they hold no objects.
fn configuration_files(files: &[PathBuf]) -> BTreeSet<PathBuf> {
    let mut configurations = BTreeSet::new();
    for file in files.iter().filter(|f| is_kustomization(f)) {
        let dir = file.parent().unwrap_or(Path::new("."));
        for doc in read_docs(file) {
            for rel in doc.value["configurations"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p.as_str())
            {
                configurations.insert(dir.join(rel));
            }
        }
    }
    configurations
}

/// Keys of `original` that are missing or changed in `round_tripped`, as JSON paths.
fn lost_keys(original: &Value, round_tripped: &Value, path: &str, lost: &mut Vec<String>) {
    match (original, round_tripped) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                let child = format!("{path}.{key}");
                match b.get(key) {
                    Some(other) => lost_keys(value, other, &child, lost),
                    None => lost.push(child),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                lost_keys(x, y, &format!("{path}[{i}]"), lost);
            }
        }
        (a, b) if a == b => {}
        (a, b) => lost.push(format!("{path} ({a} became {b})")),
    }
}

/// Deserializes into `T` and back; an error names every key that did not survive.
fn round_trip<T: DeserializeOwned + Serialize>(value: &Value) -> Result<(), String> {
    let typed: T = serde_json::from_value(value.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut lost = Vec::new();
    lost_keys(value, &back, "", &mut lost);
    if lost.is_empty() {
        Ok(())
    } else {
        Err(format!("unknown or misspelled fields: {}", lost.join(", ")))
    }
}

fn check_strict(doc: &Doc) -> Result<(), String> {
    let api_version = doc.value["apiVersion"].as_str().unwrap_or("");
    let v = &doc.value;
    match (api_version, doc.kind()) {
        ("v1", "Namespace") => round_trip::<Namespace>(v),
        ("v1", "ServiceAccount") => round_trip::<ServiceAccount>(v),
        ("v1", "ConfigMap") => round_trip::<ConfigMap>(v),
        ("v1", "Pod") => round_trip::<Pod>(v),
        ("apps/v1", "DaemonSet") => round_trip::<DaemonSet>(v),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => round_trip::<ClusterRole>(v),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            round_trip::<ClusterRoleBinding>(v)
        }
        ("rbac.authorization.k8s.io/v1", "Role") => round_trip::<Role>(v),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => round_trip::<RoleBinding>(v),
        ("resource.k8s.io/v1", "DeviceClass") => round_trip::<DeviceClass>(v),
        ("resource.k8s.io/v1", "ResourceClaimTemplate") => round_trip::<ResourceClaimTemplate>(v),
        ("resource.k8s.io/v1", "ResourceClaim") => round_trip::<ResourceClaim>(v),
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            round_trip::<ValidatingAdmissionPolicy>(v)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            round_trip::<ValidatingAdmissionPolicyBinding>(v)
        }
        (api_version, kind) => Err(format!(
            "no check for apiVersion {api_version:?} kind {kind:?}; add the type to check_strict"
        )),
    }
}

/// Full objects and patch files under `deploy/`, `e2e/workloads/` and `examples/`, kustomizations left out.
fn manifests() -> (Vec<Doc>, Vec<Doc>) {
    let mut files = Vec::new();
    yaml_files(&root().join("deploy"), &mut files);
    yaml_files(&root().join("e2e/workloads"), &mut files);
    yaml_files(&root().join("examples"), &mut files);
    // The Helm chart's templates are YAML only once Helm has rendered them: helm_chart checks what they
    // render against kustomize's render of the files here.
    files.retain(|f| !f.starts_with(root().join("deploy/helm")));
    files.sort();
    let patches = patch_files(&files);
    let configurations = configuration_files(&files);
    let (mut objects, mut partial) = (Vec::new(), Vec::new());
    for file in files
        .iter()
        .filter(|f| !is_kustomization(f) && !configurations.contains(*f))
    {
        if patches.contains(file) {
            partial.extend(read_docs(file));
        } else {
            objects.extend(read_docs(file));
        }
    }
    (objects, partial)
}

fn one<'a>(docs: &'a [Doc], kind: &str, name: &str) -> &'a Doc {
    let found: Vec<&Doc> = docs
        .iter()
        .filter(|d| d.kind() == kind && d.name() == name)
        .collect();
    match found.as_slice() {
        [doc] => doc,
        _ => panic!("expected one {kind} {name:?}, found {}", found.len()),
    }
}

/// The README and deploy/ say `kubectl apply -f crd/`: kubectl applies every .yaml, .yml and .json file of
/// the directory, so anything but CustomResourceDefinitions there (a JSON schema) makes the command fail.
#[test]
fn crd_holds_only_what_kubectl_apply_can_apply() {
    let dir = root().join("crd");
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot list crd/: {e}"));
    let mut crds = 0;
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        assert!(
            matches!(extension, "yaml" | "yml"),
            "crd/{name}: `kubectl apply -f crd/` reads it (or a reader expects only CRDs there); keep other files elsewhere"
        );
        for doc in read_docs(&path) {
            assert_eq!(
                (doc.value["apiVersion"].as_str(), doc.kind()),
                (Some("apiextensions.k8s.io/v1"), "CustomResourceDefinition"),
                "{}: not a CustomResourceDefinition",
                doc.origin
            );
            crds += 1;
        }
    }
    assert!(crds >= 1, "crd/ holds no CustomResourceDefinition");
}

#[test]
fn every_manifest_round_trips_through_its_kubernetes_type() {
    let (objects, _) = manifests();
    assert!(
        objects.iter().any(|d| d.kind() == "DaemonSet")
            && objects.iter().any(|d| d.kind() == "Pod"),
        "deploy/ and e2e/workloads/ should hold the DaemonSet and the workload pods"
    );
    let failures: Vec<String> = objects
        .iter()
        .filter_map(|doc| {
            check_strict(doc)
                .err()
                .map(|e| format!("{} ({} {}): {e}", doc.origin, doc.kind(), doc.name()))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_strict_check_catches_a_misspelled_field() {
    let doc = &parse_docs(
        "inline",
        r#"
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: x}
spec:
  selectors:
    - cel: {expresion: "true"}
"#,
    )[0];
    let err = check_strict(doc).expect_err("a misspelled cel.expression must fail");
    assert!(err.contains(".spec.selectors[0].cel.expresion"), "{err}");
    let unknown = &parse_docs(
        "inline",
        "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\n",
    )[0];
    assert!(
        check_strict(unknown).is_err(),
        "a kind without a check must fail"
    );
}

#[test]
fn patches_name_an_object_of_the_base() {
    let (objects, partial) = manifests();
    for patch in &partial {
        assert!(
            !patch.kind().is_empty() && !patch.name().is_empty(),
            "{}: a patch needs kind and metadata.name to find its target",
            patch.origin
        );
        let target = one(&objects, patch.kind(), patch.name());
        assert_eq!(
            target.namespace(),
            patch.namespace(),
            "{}: the patch and its target are in different namespaces",
            patch.origin
        );
    }
}

#[test]
fn plugin_daemonset_mounts_kubelet_and_cdi_dirs_and_knows_its_node() {
    let (objects, _) = manifests();
    let ds: DaemonSet = one(&objects, "DaemonSet", "gpu-dra-plugin").typed();
    let pod = ds
        .spec
        .template
        .spec
        .as_ref()
        .unwrap_or_else(|| panic!("DaemonSet gpu-dra-plugin has no pod spec"));
    let container = pod
        .containers
        .iter()
        .find(|c| c.name == "plugin")
        .unwrap_or_else(|| panic!("DaemonSet gpu-dra-plugin has no container `plugin`"));

    // Volume name → host path.
    let host_paths: BTreeMap<&str, &str> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| Some((v.name.as_str(), v.host_path.as_ref()?.path.as_str())))
        .collect();
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    for dir in [
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/run/cdi",
    ] {
        let mount = mounts
            .iter()
            .find(|m| host_paths.get(m.name.as_str()) == Some(&dir))
            .unwrap_or_else(|| panic!("host path {dir} is not mounted into the plugin"));
        assert_eq!(
            mount.mount_path, dir,
            "{dir} must be mounted at the same path in the container"
        );
    }
    let plugins = mounts
        .iter()
        .find(|m| m.mount_path == "/var/lib/kubelet/plugins")
        .and_then(|m| m.mount_propagation.as_deref());
    assert_eq!(plugins, Some("Bidirectional"));
    let privileged = container
        .security_context
        .as_ref()
        .and_then(|s| s.privileged);
    assert_eq!(
        privileged,
        Some(true),
        "Bidirectional propagation and MIG need a privileged container"
    );

    let node_name = container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(node_name, Some("spec.nodeName"));
}

#[test]
fn workloads_reference_existing_templates_and_device_classes() {
    let (objects, partial) = manifests();
    let classes: BTreeSet<&str> = objects
        .iter()
        .filter(|d| d.kind() == "DeviceClass")
        .map(Doc::name)
        .collect();
    // Extended resources that a class answers to, in deploy/ or in a component's patch of a class there.
    let extended_resources: BTreeSet<&str> = objects
        .iter()
        .chain(&partial)
        .filter(|d| d.kind() == "DeviceClass" && classes.contains(d.name()))
        .filter_map(|d| d.value["spec"]["extendedResourceName"].as_str())
        .collect();
    let templates: BTreeSet<(&str, &str)> = objects
        .iter()
        .filter(|d| d.kind() == "ResourceClaimTemplate")
        .map(|d| (d.namespace(), d.name()))
        .collect();
    for doc in objects
        .iter()
        .filter(|d| d.kind() == "ResourceClaimTemplate")
    {
        let template: ResourceClaimTemplate = doc.typed();
        let requests = template
            .spec
            .and_then(|s| s.spec?.devices?.requests)
            .unwrap_or_default();
        assert!(
            !requests.is_empty(),
            "{}: the template requests no device",
            doc.origin
        );
        for request in &requests {
            let class = request
                .exactly
                .as_ref()
                .map(|e| e.device_class_name.as_str())
                .unwrap_or_else(|| {
                    panic!("{}: request {} has no `exactly`", doc.origin, request.name)
                });
            assert!(
                classes.contains(class),
                "{}: DeviceClass {class} is not in deploy/",
                doc.origin
            );
        }
    }
    for doc in objects.iter().filter(|d| d.kind() == "Pod") {
        let pod: Pod = doc.typed();
        let spec = pod.spec.unwrap_or_default();
        let claims = spec.resource_claims.unwrap_or_default();
        let asks_for_extended_resource = spec.containers.iter().any(|c| {
            c.resources
                .iter()
                .flat_map(|r| r.limits.iter().chain(r.requests.iter()).flatten())
                .any(|(name, _)| extended_resources.contains(name.as_str()))
        });
        assert!(
            !claims.is_empty() || asks_for_extended_resource,
            "{}: the workload claims no device and asks for no extended resource a class answers to ({extended_resources:?})",
            doc.origin
        );
        for claim in &claims {
            if let Some(template) = &claim.resource_claim_template_name {
                assert!(
                    templates.contains(&(doc.namespace(), template.as_str())),
                    "{}: ResourceClaimTemplate {template} is not in its namespace",
                    doc.origin
                );
            }
            let used = spec.containers.iter().any(|c| {
                c.resources
                    .as_ref()
                    .and_then(|r| r.claims.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.name == claim.name))
            });
            assert!(
                used,
                "{}: no container uses claim {}",
                doc.origin, claim.name
            );
        }
    }
}

/// Renders an overlay with `kubectl kustomize`; `None` when kubectl is not installed.
fn kustomize(overlay: &str) -> Option<Vec<Doc>> {
    let dir = root().join("deploy/overlays").join(overlay);
    let output = match Command::new("kubectl").arg("kustomize").arg(&dir).output() {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("cannot run kubectl: {e}"),
    };
    assert!(
        output.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    Some(parse_docs(&format!("kustomize {overlay}"), &text))
}

/// Renders a kustomization given as text, in a directory two levels below the repository (so that it
/// reaches `deploy/` as `../../deploy/...`); `None` when kubectl is not installed.
fn kustomize_dir(kustomization: &str) -> Option<Vec<Doc>> {
    kustomize_dir_text(kustomization).map(|text| parse_docs("kustomize (inline)", &text))
}

/// `kustomize_dir`, as the YAML text kustomize wrote.
fn kustomize_dir_text(kustomization: &str) -> Option<String> {
    let parent = root().join("target");
    std::fs::create_dir_all(&parent)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", parent.display()));
    let dir = tempfile::Builder::new()
        .prefix("manifests-overlay-")
        .tempdir_in(&parent)
        .unwrap_or_else(|e| panic!("cannot create a directory in {}: {e}", parent.display()));
    std::fs::write(dir.path().join("kustomization.yaml"), kustomization)
        .unwrap_or_else(|e| panic!("cannot write the kustomization: {e}"));
    let output = match Command::new("kubectl")
        .arg("kustomize")
        .arg(dir.path())
        .output()
    {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("cannot run kubectl: {e}"),
    };
    assert!(
        output.status.success(),
        "kubectl kustomize failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[test]
fn overlays_render_to_valid_objects() {
    for overlay in ["fake", "nvml"] {
        let Some(docs) = kustomize(overlay) else {
            return;
        };
        let failures: Vec<String> = docs
            .iter()
            .filter_map(|d| {
                check_strict(d)
                    .err()
                    .map(|e| format!("{} {}: {e}", d.kind(), d.name()))
            })
            .collect();
        assert!(
            failures.is_empty(),
            "overlay {overlay}: {}",
            failures.join("\n")
        );
        one(&docs, "DaemonSet", "gpu-dra-plugin");
        one(&docs, "DeviceClass", "gpu.dra.dev");
        one(&docs, "ClusterRole", "gpu-dra-explain");
    }
}

/// What the plugin's preflight checks at start (`src/plugin/preflight`), checked on the manifests: the
/// volume mounted at CONTAINER_DRIVER_ROOT is a hostPath of NVIDIA_DRIVER_ROOT.
fn assert_driver_root_volume_is_the_driver_root(ds: &DaemonSet, origin: &str) {
    let pod = ds.spec.template.spec.as_ref().expect("a pod spec");
    let container = pod
        .containers
        .iter()
        .find(|c| c.name == "plugin")
        .expect("the plugin container");
    let env = |name: &str| {
        container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
            .unwrap_or_else(|| panic!("{origin}: {name} is not set"))
    };
    let (host, seen_at) = (env("NVIDIA_DRIVER_ROOT"), env("CONTAINER_DRIVER_ROOT"));
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == seen_at)
        .unwrap_or_else(|| {
            panic!("{origin}: nothing is mounted at CONTAINER_DRIVER_ROOT {seen_at}")
        });
    let volume_path = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .and_then(|v| Some(v.host_path.as_ref()?.path.clone()));
    assert_eq!(
        volume_path.as_deref(),
        Some(host.as_str()),
        "{origin}: the hostPath volume at CONTAINER_DRIVER_ROOT must have NVIDIA_DRIVER_ROOT as its path"
    );
}

#[test]
fn the_driver_root_volume_is_the_driver_root_the_plugin_is_told() {
    let (objects, _) = manifests();
    let base: DaemonSet = one(&objects, "DaemonSet", "gpu-dra-plugin").typed();
    assert_driver_root_volume_is_the_driver_root(&base, "deploy/base");
    if let Some(docs) = kustomize("nvml") {
        let nvml: DaemonSet = one(&docs, "DaemonSet", "gpu-dra-plugin").typed();
        assert_driver_root_volume_is_the_driver_root(&nvml, "deploy/overlays/nvml");
    }
}

#[test]
fn fake_overlay_runs_the_fake_backend_without_the_driver_root() {
    let Some(docs) = kustomize("fake") else {
        return;
    };
    let ds: DaemonSet = one(&docs, "DaemonSet", "gpu-dra-plugin").typed();
    let pod = ds
        .spec
        .template
        .spec
        .unwrap_or_else(|| panic!("the fake DaemonSet has no pod spec"));
    let container = &pod.containers[0];
    let env: BTreeMap<&str, &str> = container
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.as_str(), e.value.as_deref()?)))
        .collect();
    assert_eq!(env.get("GPU_BACKEND"), Some(&"fake"));
    assert_eq!(env.get("MIG_MODE"), Some(&"dynamic"));
    assert!(!env.contains_key("NVIDIA_DRIVER_ROOT"));
    // The preflight refuses a CONTAINER_DRIVER_ROOT that is not there, with the fake backend too.
    assert!(!env.contains_key("CONTAINER_DRIVER_ROOT"));
    let profile = env
        .get("FAKE_GPU_PROFILE")
        .unwrap_or_else(|| panic!("FAKE_GPU_PROFILE is not set"));
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    assert!(
        mounts.iter().all(|m| m.mount_path != "/driver-root"),
        "the fake overlay still mounts the host root"
    );
    let profile_mount = mounts
        .iter()
        .find(|m| profile.starts_with(&format!("{}/", m.mount_path)))
        .unwrap_or_else(|| panic!("{profile} is on no volume"));
    let config_map = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == profile_mount.name)
        .and_then(|v| v.config_map.as_ref())
        .map(|c| c.name.as_str());
    assert_eq!(config_map, Some("gpu-dra-fake-profile"));
    let cm: ConfigMap = one(&docs, "ConfigMap", "gpu-dra-fake-profile").typed();
    let file = profile.rsplit('/').next().unwrap_or_default();
    assert!(
        cm.data.unwrap_or_default().contains_key(file),
        "ConfigMap gpu-dra-fake-profile has no key {file}"
    );
    assert_eq!(pod.affinity, None, "kind nodes have no NFD labels");
    let selector = pod.node_selector.unwrap_or_default();
    assert_eq!(
        selector.get("gpu-dra.dev/fake").map(String::as_str),
        Some("true")
    );
}
