//! Offline checks of the deployment manifests in `deploy/`, the e2e workloads in `e2e/workloads/` and the examples in `examples/`:
//! every object must survive a round trip through its `k8s-openapi` type without losing a key (so a
//! misspelled or misplaced field fails), and the plugin's DaemonSet must mount and know what it needs.
//! `rbac` checks the plugin's grants against the calls in `src/`, `admission` the policies that narrow
//! its writes, `config_admission` the policy that refuses malformed device configs in users' claims,
//! `helm_chart` that the Helm chart in `deploy/helm/` renders what kustomize renders.
//! Here the manifests are read, rendered and round-tripped; `daemonset` checks the plugin's DaemonSet,
//! `workloads` the e2e workloads and examples against the classes and templates they name.

mod admission;
mod cel_env;
mod config_admission;
mod daemonset;
mod domain_status_admission;
mod extended_resource;
mod helm_chart;
mod mps_pod_admission;
mod node_admission;
mod nvidia_compat;
mod rbac;
mod workloads;

use std::collections::BTreeSet;
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
        ("apps/v1", "Deployment") => round_trip::<k8s_openapi::api::apps::v1::Deployment>(v),
        ("policy/v1", "PodDisruptionBudget") => {
            round_trip::<k8s_openapi::api::policy::v1::PodDisruptionBudget>(v)
        }
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

/// docs/install.md and deploy/ say `kubectl apply -f crd/`: kubectl applies every .yaml, .yml and .json file of
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
/// `deploy/overlays/<overlay>` with these components (paths from a kustomization under
/// `tests/manifests/`), rendered; `None` without kubectl.
fn render_with(overlay: &str, components: &[&str]) -> Option<Vec<Doc>> {
    let components: Vec<String> = components.iter().map(|c| format!("  - {c}\n")).collect();
    let components = if components.is_empty() {
        String::new()
    } else {
        format!("components:\n{}", components.concat())
    };
    kustomize_dir(&format!(
        "resources:\n  - ../../deploy/overlays/{overlay}\n{components}"
    ))
}

/// The DeviceClasses among `docs`.
fn device_classes(docs: &[Doc]) -> Vec<k8s_openapi::api::resource::v1::DeviceClass> {
    docs.iter()
        .filter(|d| d.kind() == "DeviceClass")
        .map(Doc::typed)
        .collect()
}

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
