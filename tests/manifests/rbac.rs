//! The plugin's RBAC against the API calls its code makes. The calls are read from `src/` (every call on a
//! kube `Api`, every watcher, kube's event `Recorder`), so a grant that no call uses fails, and so does a
//! call that no grant allows; `deploy/README.md`'s permission table must list the same grants. The
//! ClusterRole `gpu-dra-explain`, for users of `gpu-dra explain`, must allow every call in
//! `src/explain/` and grant nothing but reads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use regex::Regex;

use super::{manifests, one, read_docs, root, Doc};

/// One permission: API group ("" for core), resource (`resource/subresource`), verb.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Grant {
    pub group: String,
    pub resource: String,
    pub verb: String,
}

impl std::fmt::Display for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        write!(f, "{} {} ({group})", self.verb, self.resource)
    }
}

/// A call found in the source, with where it was found.
#[derive(Debug)]
struct Call {
    kind: String,
    /// Subresource, e.g. `status`.
    subresource: Option<&'static str>,
    verbs: &'static [&'static str],
    origin: String,
}

/// Source files that never run in the plugin: `gpu-dra demo` talks to its own in-process API server;
/// `gpu-dra explain` runs with its user's credentials (the `gpu-dra-explain` ClusterRole).
const NOT_THE_PLUGIN: &[&str] = &["src/demo/", EXPLAIN];

/// The source of `gpu-dra explain`, whose calls `gpu-dra-explain` must allow.
const EXPLAIN: &str = "src/explain/";

/// Calls every authenticated user may make through the default ClusterRole `system:basic-user` (bound
/// to the group `system:authenticated`), so the plugin's roles need not grant them: the preflight's
/// SelfSubjectReview (`kubectl auth whoami`). Checked on realk8s: a service account with no binding
/// gets `201`.
const GRANTED_TO_EVERY_USER: &[(&str, &str, &str)] =
    &[("authentication.k8s.io", "selfsubjectreviews", "create")];

fn granted_to_every_user(grant: &Grant) -> bool {
    GRANTED_TO_EVERY_USER.iter().any(|(group, resource, verb)| {
        grant.group == *group && grant.resource == *resource && grant.verb == *verb
    })
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
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
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
    super::yaml_files(&root().join("crd"), &mut files);
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

/// Every permission the plugin's code needs, with the calls that need it.
fn used_grants() -> BTreeMap<Grant, Vec<String>> {
    grants_used_by(|origin| !NOT_THE_PLUGIN.iter().any(|p| origin.starts_with(p)))
}

/// Every permission the code of the source files `origin` selects needs, with the calls that need it.
fn grants_used_by(selected: impl Fn(&str) -> bool) -> BTreeMap<Grant, Vec<String>> {
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
                    let Some((group, resource)) = resource_of(&call.kind) else {
                        errors.push(format!(
                            "{}: API group and resource of kind {} unknown; add it to resource_of",
                            call.origin, call.kind
                        ));
                        continue;
                    };
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
            Err(e) => errors.push(e),
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    used
}

/// The grants of the ClusterRoles bound to the service account that `daemonset` runs as, in `docs`.
pub fn plugin_grants(docs: &[Doc]) -> BTreeSet<Grant> {
    let (namespace, account) = plugin_account(docs);
    let mut grants = BTreeSet::new();
    for binding in docs
        .iter()
        .filter(|d| d.kind() == "ClusterRoleBinding")
        .map(|d| d.typed::<ClusterRoleBinding>())
        .filter(|b| {
            b.subjects.iter().flatten().any(|s| {
                s.kind == "ServiceAccount"
                    && s.name == account
                    && s.namespace.as_deref() == Some(&namespace)
            })
        })
    {
        assert_eq!(binding.role_ref.kind, "ClusterRole");
        grants.extend(role_grants(docs, &binding.role_ref.name));
    }
    assert!(
        !grants.is_empty(),
        "no ClusterRole is bound to {namespace}/{account}"
    );
    // Namespaced grants (the Pods of MPS daemons) come from Roles in the plugin's own namespace; the
    // plugin makes those calls only there.
    for binding in docs
        .iter()
        .filter(|d| d.kind() == "RoleBinding")
        .map(|d| d.typed::<RoleBinding>())
        .filter(|b| b.metadata.namespace.as_deref() == Some(&namespace))
        .filter(|b| {
            b.subjects.iter().flatten().any(|s| {
                s.kind == "ServiceAccount"
                    && s.name == account
                    && s.namespace.as_deref() == Some(&namespace)
            })
        })
    {
        assert_eq!(
            binding.role_ref.kind, "Role",
            "a RoleBinding of the plugin names a Role"
        );
        let role: Role = docs
            .iter()
            .find(|d| {
                d.kind() == "Role"
                    && d.value["metadata"]["name"] == binding.role_ref.name.as_str()
                    && d.value["metadata"]["namespace"] == namespace.as_str()
            })
            .unwrap_or_else(|| panic!("no Role {} in {namespace}", binding.role_ref.name))
            .typed();
        grants.extend(rule_grants(
            &format!("Role {namespace}/{}", binding.role_ref.name),
            role.rules.iter().flatten(),
        ));
    }
    grants
}

/// The grants of ClusterRole `name` in `docs`; no wildcards, resourceNames or nonResourceURLs.
fn role_grants(docs: &[Doc], name: &str) -> BTreeSet<Grant> {
    let role: ClusterRole = one(docs, "ClusterRole", name).typed();
    rule_grants(&format!("ClusterRole {name}"), role.rules.iter().flatten())
}

fn rule_grants<'a>(
    name: &str,
    rules: impl Iterator<Item = &'a k8s_openapi::api::rbac::v1::PolicyRule>,
) -> BTreeSet<Grant> {
    let mut grants = BTreeSet::new();
    for rule in rules {
        assert!(
            rule.resource_names.is_none() && rule.non_resource_urls.is_none(),
            "{name}: resourceNames and nonResourceURLs are not checked here"
        );
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    assert!(
                        group != "*" && resource != "*" && verb != "*",
                        "{name}: no wildcards"
                    );
                    grants.insert(Grant {
                        group: group.clone(),
                        resource: resource.clone(),
                        verb: verb.clone(),
                    });
                }
            }
        }
    }
    grants
}

/// The DaemonSet of the plugin, whatever an overlay renamed it to.
pub fn plugin_daemonset(docs: &[Doc]) -> &Doc {
    let found: Vec<&Doc> = docs
        .iter()
        .filter(|d| {
            d.kind() == "DaemonSet"
                && d.value["metadata"]["labels"]["app.kubernetes.io/component"] == "kubelet-plugin"
        })
        .collect();
    match found.as_slice() {
        [doc] => doc,
        _ => panic!(
            "expected one DaemonSet labelled kubelet-plugin, found {}",
            found.len()
        ),
    }
}

/// Namespace and name of the service account the plugin runs as.
pub fn plugin_account(docs: &[Doc]) -> (String, String) {
    let ds: DaemonSet = plugin_daemonset(docs).typed();
    let namespace = ds.metadata.namespace.clone().unwrap_or_default();
    let account = ds
        .spec
        .template
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| panic!("the plugin's DaemonSet names no service account"));
    (namespace, account)
}

/// The grants in `deploy/README.md`'s permission table (`| group | resource | verbs | why |`).
fn readme_grants() -> BTreeSet<Grant> {
    let text = std::fs::read_to_string(root().join("deploy/README.md")).unwrap();
    let mut grants = BTreeSet::new();
    let mut in_table = false;
    for line in text.lines() {
        let cells: Vec<&str> = line
            .trim()
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        if cells.len() >= 4 && cells[0] == "group" && cells[1] == "resource" && cells[2] == "verbs"
        {
            in_table = true;
            continue;
        }
        if !in_table || cells[0].starts_with("---") {
            continue;
        }
        if !line.trim_start().starts_with('|') {
            break;
        }
        let group = cells[0].trim_matches('`');
        let group = if group == "core" { "" } else { group };
        for verb in cells[2].split(',') {
            grants.insert(Grant {
                group: group.to_string(),
                resource: cells[1].trim_matches('`').to_string(),
                verb: verb.trim().to_string(),
            });
        }
    }
    assert!(
        in_table,
        "deploy/README.md has no `| group | resource | verbs | why |` table"
    );
    grants
}

fn list(grants: &BTreeSet<&Grant>) -> String {
    grants
        .iter()
        .map(|g| format!("  {g}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_grant_is_a_call_the_plugin_makes_and_every_call_is_granted() {
    let (objects, _) = manifests();
    let granted = plugin_grants(&objects);
    let used = used_grants();
    let unused: BTreeSet<&Grant> = granted.iter().filter(|g| !used.contains_key(g)).collect();
    let missing: BTreeSet<&Grant> = used
        .keys()
        .filter(|g| !granted.contains(g) && !granted_to_every_user(g))
        .collect();
    let needed_by = missing
        .iter()
        .map(|g| format!("  {g}: {}", used[g].join(", ")))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        unused.is_empty() && missing.is_empty(),
        "deploy/base/rbac.yaml grants what no call in src/ uses:\n{}\nand does not grant what these calls need:\n{needed_by}",
        list(&unused)
    );
}

#[test]
fn the_readme_lists_every_grant() {
    let (objects, _) = manifests();
    let granted = plugin_grants(&objects);
    let listed = readme_grants();
    let unlisted: BTreeSet<&Grant> = granted.iter().filter(|g| !listed.contains(g)).collect();
    let extra: BTreeSet<&Grant> = listed.iter().filter(|g| !granted.contains(g)).collect();
    assert!(
        unlisted.is_empty() && extra.is_empty(),
        "deploy/README.md's permission table misses:\n{}\nand lists what is not granted:\n{}",
        list(&unlisted),
        list(&extra)
    );
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

#[test]
fn the_explain_role_allows_every_call_of_explain_and_only_reads() {
    let (objects, _) = manifests();
    let granted = role_grants(&objects, "gpu-dra-explain");
    let used = grants_used_by(|origin| origin.starts_with(EXPLAIN));
    assert!(!used.is_empty(), "no API call found in {EXPLAIN}");
    let missing: Vec<String> = used
        .iter()
        .filter(|(grant, _)| !granted.contains(grant))
        .map(|(grant, calls)| format!("  {grant}: {}", calls.join(", ")))
        .collect();
    assert!(
        missing.is_empty(),
        "deploy/base/explain-role.yaml does not grant what these calls of gpu-dra explain need:\n{}",
        missing.join("\n")
    );
    // Get and list on the six kinds of a dump (kubectl get ... -A needs list; get a single object),
    // and nothing else.
    let kinds = [
        ("", "pods"),
        ("", "nodes"),
        ("resource.k8s.io", "resourceclaims"),
        ("resource.k8s.io", "resourceclaimtemplates"),
        ("resource.k8s.io", "deviceclasses"),
        ("resource.k8s.io", "resourceslices"),
    ];
    let expected: BTreeSet<Grant> = kinds
        .iter()
        .flat_map(|(group, resource)| {
            ["get", "list"].map(|verb| Grant {
                group: group.to_string(),
                resource: resource.to_string(),
                verb: verb.to_string(),
            })
        })
        .collect();
    assert_eq!(granted, expected);
    // It is for people: nothing in deploy/ binds it (the plugin's service account must not get it).
    let bound: Vec<&str> = objects
        .iter()
        .filter(|d| matches!(d.kind(), "ClusterRoleBinding" | "RoleBinding"))
        .filter(|d| d.value["roleRef"]["name"] == "gpu-dra-explain")
        .map(|d| d.origin.as_str())
        .collect();
    assert!(bound.is_empty(), "gpu-dra-explain is bound in {bound:?}");
    let readme = std::fs::read_to_string(root().join("deploy/README.md")).unwrap();
    assert!(
        readme.contains("`gpu-dra-explain`"),
        "deploy/README.md does not document the gpu-dra-explain ClusterRole"
    );
}
