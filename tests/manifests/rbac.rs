//! The plugin's RBAC against the API calls its code makes. The calls are read from `src/` (every call on a
//! kube `Api`, every watcher, kube's event `Recorder`), so a grant that no call uses fails, and so does a
//! call that no grant allows; `deploy/README.md`'s permission table must list the same grants. The
//! ClusterRole `gpu-dra-explain`, for users of `gpu-dra explain`, must allow every call in
//! `src/explain/` and grant nothing but reads.
//! The call scanner that reads the calls from `src/` is in `calls`.

mod calls;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};

use super::{manifests, one, root, Doc};
use calls::grants_used_by;

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

/// Source files that never run in the plugin: `gpu-dra demo` talks to its own in-process API server;
/// `gpu-dra explain` runs with its user's credentials (the `gpu-dra-explain` ClusterRole). The calls
/// of taking over NVIDIA's claims are granted by `deploy/components/nvidia-migration` instead, in
/// NVIDIA's namespace.
/// The ComputeDomain controller runs as its own service account (`deploy/base/controller.yaml`).
const NOT_THE_PLUGIN: &[&str] = &["src/demo/", EXPLAIN, NVIDIA_MIGRATION, CONTROLLER];

/// The source of `gpu-dra controller`, whose calls the ClusterRole `gpu-dra-controller` and the Role of the
/// same name in its namespace (the leader election's Lease) must allow exactly.
const CONTROLLER: &str = "src/domains/controller/";

/// What unprepares the claims taken over from NVIDIA's plugin (`deploy/components/nvidia-migration`).
const NVIDIA_MIGRATION: &str = "src/claims/nvidia_adoption.rs";

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

/// Every permission the plugin's code needs, with the calls that need it.
fn used_grants() -> BTreeMap<Grant, Vec<String>> {
    grants_used_by(|origin| !NOT_THE_PLUGIN.iter().any(|p| origin.starts_with(p)))
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
    // Get and list on the six kinds of a dump and the ComputeDomains of both groups (kubectl get ...
    // -A needs list; get a single object), and nothing else.
    let kinds = [
        ("", "pods"),
        ("", "nodes"),
        ("resource.k8s.io", "resourceclaims"),
        ("resource.k8s.io", "resourceclaimtemplates"),
        ("resource.k8s.io", "deviceclasses"),
        ("resource.k8s.io", "resourceslices"),
        ("gpu.dra.dev", "computedomains"),
        ("resource.nvidia.com", "computedomains"),
    ];
    // Where the controller placed the domains: listed with them (`kubectl get computedomainplacements`).
    let listed_only = [("gpu.dra.dev", "computedomainplacements")];
    let expected: BTreeSet<Grant> = kinds
        .iter()
        .flat_map(|(group, resource)| {
            ["get", "list"].map(|verb| Grant {
                group: group.to_string(),
                resource: resource.to_string(),
                verb: verb.to_string(),
            })
        })
        .chain(listed_only.iter().map(|(group, resource)| Grant {
            group: group.to_string(),
            resource: resource.to_string(),
            verb: "list".to_string(),
        }))
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

#[test]
fn the_nvidia_migration_role_allows_exactly_the_calls_of_taking_over_nvidias_claims() {
    let text = std::fs::read_to_string(root().join("deploy/components/nvidia-migration/rbac.yaml"))
        .unwrap();
    let docs = super::parse_docs("nvidia-migration/rbac.yaml", &text);
    let role: Role = docs
        .iter()
        .find(|d| d.kind() == "Role")
        .expect("a Role")
        .typed();
    let binding: RoleBinding = docs
        .iter()
        .find(|d| d.kind() == "RoleBinding")
        .expect("a RoleBinding")
        .typed();
    // Where NVIDIA's chart installs, and the plugin's default for --nvidia-namespace.
    assert_eq!(
        role.metadata.namespace.as_deref(),
        Some(gpu_dra::claims::DEFAULT_NVIDIA_NAMESPACE)
    );
    assert_eq!(binding.metadata.namespace, role.metadata.namespace);
    assert_eq!(binding.role_ref.name, role.metadata.name.clone().unwrap());
    let (objects, _) = manifests();
    let (namespace, account) = plugin_account(&objects);
    assert!(
        binding
            .subjects
            .iter()
            .flatten()
            .any(|s| s.kind == "ServiceAccount"
                && s.name == account
                && s.namespace.as_deref() == Some(&namespace)),
        "the RoleBinding names the plugin's service account {namespace}/{account}"
    );
    let granted = rule_grants("Role nvidia-migration", role.rules.iter().flatten());
    let used: BTreeSet<Grant> = grants_used_by(|origin| origin == NVIDIA_MIGRATION)
        .into_keys()
        .collect();
    assert!(
        !used.is_empty(),
        "the scanner found no call in {NVIDIA_MIGRATION}"
    );
    assert_eq!(granted, used);
}

#[test]
fn the_controller_role_allows_exactly_the_calls_of_the_controller() {
    let (objects, _) = manifests();
    let cluster_wide = role_grants(&objects, "gpu-dra-controller");
    // The Lease, only in the controller's own namespace: a Role there, bound to its service account.
    let deployment = one(&objects, "Deployment", "gpu-dra-controller");
    let namespace = deployment.namespace();
    let role: Role = one(&objects, "Role", "gpu-dra-controller").typed();
    assert_eq!(role.metadata.namespace.as_deref(), Some(namespace));
    let role_binding: RoleBinding = one(&objects, "RoleBinding", "gpu-dra-controller").typed();
    assert_eq!(role_binding.metadata.namespace.as_deref(), Some(namespace));
    assert_eq!(
        (
            role_binding.role_ref.kind.as_str(),
            role_binding.role_ref.name.as_str()
        ),
        ("Role", "gpu-dra-controller")
    );
    assert!(role_binding
        .subjects
        .iter()
        .flatten()
        .any(|s| s.kind == "ServiceAccount"
            && s.name == "gpu-dra-controller"
            && s.namespace.as_deref() == Some(namespace)));
    let namespaced = rule_grants("Role gpu-dra-controller", role.rules.iter().flatten());
    let lease = |verb: &str| Grant {
        group: "coordination.k8s.io".into(),
        resource: "leases".into(),
        verb: verb.into(),
    };
    assert_eq!(
        namespaced,
        BTreeSet::from([lease("get"), lease("create"), lease("update")])
    );
    assert!(
        cluster_wide.iter().all(|g| g.resource != "leases"),
        "the ClusterRole grants Leases in every namespace"
    );
    let granted: BTreeSet<Grant> = cluster_wide.union(&namespaced).cloned().collect();
    let used: BTreeSet<Grant> = grants_used_by(|origin| origin.starts_with(CONTROLLER))
        .into_keys()
        .collect();
    assert!(
        !used.is_empty(),
        "the scanner found no call in {CONTROLLER}"
    );
    let unused: BTreeSet<&Grant> = granted.iter().filter(|g| !used.contains(g)).collect();
    let missing: BTreeSet<&Grant> = used.iter().filter(|g| !granted.contains(g)).collect();
    assert!(
        unused.is_empty() && missing.is_empty(),
        "deploy/base/controller.yaml grants what no call in {CONTROLLER} uses:\n{}\nand does not grant:\n{}",
        list(&unused),
        list(&missing)
    );
    let binding =
        one(&objects, "ClusterRoleBinding", "gpu-dra-controller").typed::<ClusterRoleBinding>();
    assert_eq!(binding.role_ref.name, "gpu-dra-controller");
    assert!(binding
        .subjects
        .iter()
        .flatten()
        .any(|s| s.kind == "ServiceAccount" && s.name == "gpu-dra-controller"));
}
