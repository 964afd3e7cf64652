//! The API calls in the plugin's source, as the RBAC check reads them from `src/`: every call on a kube
//! `Api` (bound to a field, a parameter or a `let`), every watcher and kube's event `Recorder`, each
//! with the group, resource and verbs the API server authorizes it as.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use regex::Regex;

use super::Grant;
use crate::{read_docs, root, Doc};

/// A call found in the source, with where it was found.
#[derive(Debug)]
struct Call {
    kind: String,
    /// Subresource, e.g. `status`.
    subresource: Option<&'static str>,
    verbs: &'static [&'static str],
    origin: String,
}

/// kube `Api` methods and what the API server authorizes them as.
fn api_method(method: &str) -> Option<(Option<&'static str>, &'static [&'static str])> {
    Some(match method {
        "get" | "get_opt" | "get_metadata" | "get_metadata_opt" => (None, &["get"]),
        "get_status" => (Some("status"), &["get"]),
        "list" | "list_metadata" => (None, &["list"]),
        "watch" | "watch_metadata" => (None, &["watch"]),
        "create" => (None, &["create"]),
        "replace" => (None, &["update"]),
        "replace_status" => (Some("status"), &["update"]),
        "patch" | "patch_metadata" => (None, &["patch"]),
        "patch_status" => (Some("status"), &["patch"]),
        "delete" => (None, &["delete"]),
        "delete_collection" => (None, &["deletecollection"]),
        // `entry` GETs, then creates or replaces.
        "entry" => (None, &["get", "create", "update"]),
        _ => return None,
    })
}

const METHODS: &str = "get|get_opt|get_metadata|get_metadata_opt|get_status|list|list_metadata|watch|\
watch_metadata|create|replace|replace_status|patch|patch_metadata|patch_status|delete|delete_collection|entry";

/// The part of a file that is compiled into the plugin: without comments and without the items marked
/// `#[cfg(test)]` (a `mod tests;` declaration, or an item up to its closing brace), wherever they stand.
fn plugin_code(text: &str) -> String {
    let comment = Regex::new(r"(?m)//.*$").unwrap();
    let mut code = comment.replace_all(text, "").into_owned();
    while let Some(start) = code.find("#[cfg(test)]") {
        let end = test_item_end(&code, start + "#[cfg(test)]".len());
        code.replace_range(start..end, "");
    }
    code
}

/// Where the item after a `#[cfg(test)]` ends: after its `;` when that comes before any `{`, else after
/// the brace that closes its first `{`.
fn test_item_end(code: &str, from: usize) -> usize {
    let mut depth = 0usize;
    for (offset, c) in code[from..].char_indices() {
        match c {
            ';' if depth == 0 => return from + offset + 1,
            '{' => depth += 1,
            '}' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    return from + offset + 1;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// The API calls in one file's code.
fn calls_in(origin: &str, text: &str) -> Result<Vec<Call>, String> {
    let code = plugin_code(text);
    // Names bound to an `Api<Kind>`: struct fields, parameters and typed `let`s, and untyped `let`s.
    let mut bindings: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let typed = Regex::new(r"\b(\w+)\s*:\s*&?\s*(?:mut\s+)?Api\s*<\s*(\w+)\s*>").unwrap();
    let untyped = Regex::new(r"\blet\s+(?:mut\s+)?(\w+)\s*=\s*Api\s*::\s*<\s*(\w+)\s*>").unwrap();
    for c in typed
        .captures_iter(&code)
        .chain(untyped.captures_iter(&code))
    {
        bindings
            .entry(c[1].to_string())
            .or_default()
            .insert(c[2].to_string());
    }
    let kind_of = |name: &str| -> Result<Option<String>, String> {
        match bindings.get(name).map(|k| k.iter().collect::<Vec<_>>()) {
            None => Ok(None),
            Some(kinds) if kinds.len() == 1 => Ok(Some(kinds[0].clone())),
            Some(kinds) => Err(format!(
                "{origin}: `{name}` is bound to Api<{kinds:?}>: rename one so calls can be told apart"
            )),
        }
    };
    let line_of = |at: usize| code[..at].lines().count().max(1);
    let mut calls = Vec::new();

    let on_binding = Regex::new(&format!(r"\b(\w+)\s*\.\s*({METHODS})\s*\(")).unwrap();
    for c in on_binding.captures_iter(&code) {
        let Some(kind) = kind_of(&c[1])? else {
            continue;
        };
        let (subresource, verbs) = api_method(&c[2]).unwrap();
        calls.push(Call {
            kind,
            subresource,
            verbs,
            origin: format!(
                "{origin}:{} {}.{}",
                line_of(c.get(0).unwrap().start()),
                &c[1],
                &c[2]
            ),
        });
    }
    let chained = Regex::new(&format!(
        r"Api\s*::\s*<\s*(\w+)\s*>\s*::\s*\w+\s*\((?:[^()]|\([^()]*\))*\)\s*\.\s*({METHODS})\s*\("
    ))
    .unwrap();
    for c in chained.captures_iter(&code) {
        let (subresource, verbs) = api_method(&c[2]).unwrap();
        calls.push(Call {
            kind: c[1].to_string(),
            subresource,
            verbs,
            origin: format!(
                "{origin}:{} Api::<{}>.{}",
                line_of(c.get(0).unwrap().start()),
                &c[1],
                &c[2]
            ),
        });
    }
    // A watcher lists, then watches. Its first argument is an Api built in place or a bound one.
    let watcher = Regex::new(
        r"\b(?:metadata_)?watcher\s*\(\s*(?:Api\s*::\s*<\s*(\w+)\s*>|(?:\w+\s*\.\s*)*(\w+)\s*(?:\.\s*clone\s*\(\s*\))?\s*,)",
    )
    .unwrap();
    for c in watcher.captures_iter(&code) {
        let at = line_of(c.get(0).unwrap().start());
        let kind = match (c.get(1), c.get(2)) {
            (Some(kind), _) => kind.as_str().to_string(),
            (None, Some(name)) => kind_of(name.as_str())?.ok_or_else(|| {
                format!(
                    "{origin}:{at}: watcher over `{}`, which is bound to no Api<Kind> in this file",
                    name.as_str()
                )
            })?,
            (None, None) => {
                return Err(format!(
                    "{origin}:{at}: a watcher whose Api is not recognised"
                ))
            }
        };
        calls.push(Call {
            kind,
            subresource: None,
            verbs: &["list", "watch"],
            origin: format!("{origin}:{at} watcher"),
        });
    }
    // kube-runtime 5's Recorder::publish creates an events.k8s.io Event and patches it to count a repeat
    // (`series`).
    for m in Regex::new(r"\bRecorder\s*::\s*new\s*\(")
        .unwrap()
        .find_iter(&code)
    {
        calls.push(Call {
            kind: "events.k8s.io/Event".to_string(),
            subresource: None,
            verbs: &["create", "patch"],
            origin: format!("{origin}:{} Recorder", line_of(m.start())),
        });
    }
    Ok(calls)
}

/// Group and resource of a kind: built-in kinds from `k8s-openapi`, custom ones from the CRDs in `crd/`.
fn resource_of(kind: &str) -> Option<(String, String)> {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret};
    use k8s_openapi::api::events::v1::Event;
    use k8s_openapi::api::resource::v1::{
        DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
    };
    fn of<K: k8s_openapi::Resource>() -> (String, String) {
        (K::GROUP.to_string(), K::URL_PATH_SEGMENT.to_string())
    }
    let builtin = match kind {
        "ResourceSlice" => Some(of::<ResourceSlice>()),
        "ResourceClaim" => Some(of::<ResourceClaim>()),
        "ResourceClaimTemplate" => Some(of::<ResourceClaimTemplate>()),
        "DeviceClass" => Some(of::<DeviceClass>()),
        "Node" => Some(of::<Node>()),
        "Pod" => Some(of::<Pod>()),
        "ConfigMap" => Some(of::<ConfigMap>()),
        "Secret" => Some(of::<Secret>()),
        "events.k8s.io/Event" => Some(of::<Event>()),
        "SelfSubjectReview" => Some(of::<SelfSubjectReview>()),
        "Deployment" => Some(of::<Deployment>()),
        "Lease" => Some(of::<Lease>()),
        _ => None,
    };
    builtin.or_else(|| {
        read_crds().into_iter().find_map(|crd| {
            let spec = &crd.value["spec"];
            (spec["names"]["kind"].as_str() == Some(kind)).then(|| {
                (
                    spec["group"].as_str().unwrap_or_default().to_string(),
                    spec["names"]["plural"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                )
            })
        })
    })
}

fn read_crds() -> Vec<Doc> {
    let mut files = Vec::new();
    crate::yaml_files(&root().join("crd"), &mut files);
    files.iter().flat_map(|f| read_docs(f)).collect()
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
    {
        let path = entry
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
            .path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every permission the code of the source files `origin` selects needs, with the calls that need it.
pub(super) fn grants_used_by(selected: impl Fn(&str) -> bool) -> BTreeMap<Grant, Vec<String>> {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    files.sort();
    let mut used: BTreeMap<Grant, Vec<String>> = BTreeMap::new();
    let mut errors = Vec::new();
    for file in &files {
        let origin = file
            .strip_prefix(root())
            .unwrap_or(file)
            .display()
            .to_string();
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        // Test modules in files of their own (`foo_tests.rs`, `tests.rs`, `tests_*.rs`).
        if !selected(&origin)
            || name == "tests.rs"
            || name.starts_with("tests_")
            || name.ends_with("_tests.rs")
        {
            continue;
        }
        let text =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("cannot read {origin}: {e}"));
        match calls_in(&origin, &text) {
            Ok(calls) => {
                for call in calls {
                    // The only dynamic Apis are over ComputeDomains of both groups: the controller's,
                    // the plugin's and `gpu-dra explain`'s.
                    let resources = if call.kind == "DynamicObject" {
                        if !["src/domains/", "src/explain/"]
                            .iter()
                            .any(|dir| call.origin.starts_with(dir))
                        {
                            errors.push(format!(
                                "{}: an Api<DynamicObject> outside src/domains/ and src/explain/: the scanner cannot tell its resource",
                                call.origin
                            ));
                            continue;
                        }
                        vec![
                            ("gpu.dra.dev".to_string(), "computedomains".to_string()),
                            (
                                "resource.nvidia.com".to_string(),
                                "computedomains".to_string(),
                            ),
                        ]
                    } else if let Some(resource) = resource_of(&call.kind) {
                        vec![resource]
                    } else {
                        errors.push(format!(
                            "{}: API group and resource of kind {} unknown; add it to resource_of",
                            call.origin, call.kind
                        ));
                        continue;
                    };
                    for (group, resource) in resources {
                        let resource = match call.subresource {
                            Some(sub) => format!("{resource}/{sub}"),
                            None => resource,
                        };
                        for verb in call.verbs {
                            used.entry(Grant {
                                group: group.clone(),
                                resource: resource.clone(),
                                verb: verb.to_string(),
                            })
                            .or_default()
                            .push(call.origin.clone());
                        }
                    }
                }
            }
            Err(e) => errors.push(e),
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    used
}

#[test]
fn the_call_scanner_finds_every_form_of_call() {
    let code = r#"
        struct Publisher { slices: Api<ResourceSlice>, nodes: Api<Node> }
        async fn f(&self, client: Client) {
            self.slices
                .replace(&name, &PostParams::default(), &slice).await;
            let node = self.nodes.get_opt(&name).await;
            let api: Api<ResourceClaim> = Api::namespaced(client, ns);
            api.replace_status(&n, &pp, &c).await;
            let policies = Api::<GpuNodePolicy>::all(client.clone());
            policies.patch_status("x", &pp, &patch).await;
            Api::<DeviceClass>::all(client.clone()).get("gpu").await;
            let w = watcher(Api::<Node>::all(client), config);
            let v = watcher(this.slices.clone(), config);
            // self.nodes.delete("commented out")
            let recorder = Recorder::new(client, reporter);
            map.get(&key); self.delete(x);
        }
        async fn g(claims: &Api<ResourceClaim>) {
            claims.get("c").await;
        }
        #[cfg(test)]
        mod tests { fn t() { api.delete("x") } }
        #[cfg(test)]
        #[path = "more_tests.rs"]
        mod more_tests;
        async fn after_the_tests(claims: &Api<ResourceClaim>) {
            claims.list(&params).await;
        }
    "#;
    let calls = calls_in("inline.rs", code).unwrap();
    let found: BTreeSet<String> = calls
        .iter()
        .flat_map(|c| {
            c.verbs.iter().map(move |v| {
                let sub = c.subresource.map(|s| format!("/{s}")).unwrap_or_default();
                format!("{} {}{sub}", v, c.kind)
            })
        })
        .collect();
    let expected: BTreeSet<String> = [
        "update ResourceSlice",
        "get Node",
        "update ResourceClaim/status",
        "patch GpuNodePolicy/status",
        "get DeviceClass",
        "get ResourceClaim",
        "list ResourceClaim",
        "list Node",
        "watch Node",
        "list ResourceSlice",
        "watch ResourceSlice",
        "create events.k8s.io/Event",
        "patch events.k8s.io/Event",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(found, expected);
    assert_eq!(
        resource_of("GpuNodePolicy"),
        Some(("gpu.dra.dev".to_string(), "gpunodepolicies".to_string()))
    );
    let err = calls_in("inline.rs", "fn f() { watcher(mystery, config) }").unwrap_err();
    assert!(err.contains("mystery"), "{err}");
}
