//! The admission policies that narrow the plugin's writes: they exist, are bound to deny, cover every
//! write the plugin's RBAC grants on `resource.k8s.io`, apply to the plugin's service account after an
//! overlay renames it, and their CEL decides the requests a plugin (or a compromised one) makes as the
//! API server does. The CEL runs on the `cel` crate with the admission variables (`request`, `object`,
//! `oldObject`, `params`, `variables`); e2e/least-privilege.sh checks the same against a real API server.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use regex::Regex;
use serde_json::{json, Value as Json};

use super::cel_env::{compile, Bindings};
use super::rbac::{plugin_account, plugin_grants};
use super::{kustomize_dir, manifests, Doc};

const DRIVER: &str = "gpu.dra.dev";
const NODE_NAME_KEY: &str = "authentication.kubernetes.io/node-name";

/// The variables an admission expression may use (`authorizer` and `namespaceObject` are not used here).
const ADMISSION_VARIABLES: &[&str] = &["request", "object", "oldObject", "params", "variables"];

/// Type names an expression may compare with `type(x)`.
const TYPE_NAMES: &[&str] = &[
    "bool",
    "int",
    "uint",
    "double",
    "string",
    "bytes",
    "list",
    "map",
    "null_type",
];

/// One write as the API server's admission sees it.
pub(super) struct Request {
    pub(super) operation: &'static str,
    /// `resourceslices`, `resourceclaims/status`, ...
    pub(super) resource: &'static str,
    pub(super) username: String,
    /// The node a pod-bound token names.
    pub(super) node: Option<&'static str>,
    pub(super) object: Json,
    pub(super) old_object: Json,
}

/// The API group and plural of a request's resource: Nodes and Pods are core, ComputeDomains ours
/// (`computedomains`) or another group's when it is named (`computedomains.resource.nvidia.com`), the
/// rest `resource.k8s.io`.
fn group_of(resource: &str) -> (&str, &str) {
    let resource = resource.split_once('/').map_or(resource, |(r, _)| r);
    match resource.split_once('.') {
        Some((plural, group)) => (group, plural),
        None if resource == "nodes" || resource == "pods" => ("", resource),
        None if resource == "computedomains" => ("gpu.dra.dev", resource),
        None => ("resource.k8s.io", resource),
    }
}

impl Request {
    fn json(&self) -> Json {
        let sub_resource = self.resource.split_once('/').map_or("", |(_, s)| s);
        let (group, resource) = group_of(self.resource);
        let extra = match self.node {
            Some(node) => json!({ NODE_NAME_KEY: [node] }),
            None => json!({}),
        };
        json!({
            "operation": self.operation,
            "resource": {"group": group, "version": "v1", "resource": resource},
            "subResource": sub_resource,
            "userInfo": {"username": self.username, "extra": extra},
        })
    }
}

/// What the API server answers: `Err` with the denying policies' messages (each policy's first failing
/// validation, as the API server shows it).
pub(super) fn admit(docs: &[Doc], request: &Request) -> Result<(), String> {
    let mut denials = Vec::new();
    for binding in docs
        .iter()
        .filter(|d| d.kind() == "ValidatingAdmissionPolicyBinding")
        .map(|d| d.typed::<ValidatingAdmissionPolicyBinding>())
    {
        let policy: ValidatingAdmissionPolicy =
            super::one(docs, "ValidatingAdmissionPolicy", &binding.spec.policy_name).typed();
        let spec = policy.spec.unwrap_or_default();
        if !matches(&spec, request) {
            continue;
        }
        let params = match &binding.spec.param_ref {
            None => Json::Null,
            Some(reference) => {
                let found = docs.iter().find(|d| {
                    spec.param_kind.as_ref().and_then(|k| k.kind.as_deref()) == Some(d.kind())
                        && Some(d.name()) == reference.name.as_deref()
                        && Some(d.namespace()) == reference.namespace.as_deref()
                });
                match (found, reference.parameter_not_found_action.as_deref()) {
                    (Some(doc), _) => doc.value.clone(),
                    (None, Some("Allow")) => continue,
                    (None, _) => {
                        denials.push(format!("{}: parameter not found", binding.spec.policy_name));
                        continue;
                    }
                }
            }
        };
        let mut bindings = Bindings::new([
            ("request", request.json()),
            ("object", request.object.clone()),
            ("oldObject", request.old_object.clone()),
            ("params", params),
        ]);
        let is_true = |value: cel::Value| value == cel::Value::Bool(true);
        // failurePolicy Fail: an error denies.
        let verdict = (|| -> Result<Option<String>, String> {
            for condition in spec.match_conditions.iter().flatten() {
                if !is_true(bindings.evaluate(&condition.expression)?) {
                    return Ok(None);
                }
            }
            for variable in spec.variables.iter().flatten() {
                let value = bindings.evaluate(&variable.expression)?;
                bindings.set_variable(&variable.name, value);
            }
            for validation in spec.validations.iter().flatten() {
                if !is_true(bindings.evaluate(&validation.expression)?) {
                    let message = match &validation.message_expression {
                        Some(e) => match bindings.evaluate(e)? {
                            cel::Value::String(message) => message.to_string(),
                            other => return Err(format!("{e}: not a string: {other:?}")),
                        },
                        None => validation.message.clone().unwrap_or_default(),
                    };
                    return Ok(Some(message));
                }
            }
            Ok(None)
        })();
        match verdict {
            Ok(None) => {}
            Ok(Some(message)) => denials.push(message),
            Err(error) => denials.push(format!("{}: error: {error}", binding.spec.policy_name)),
        }
    }
    if denials.is_empty() {
        Ok(())
    } else {
        Err(denials.join("; "))
    }
}

pub(super) fn matches(
    spec: &k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicySpec,
    request: &Request,
) -> bool {
    let any = |list: &Option<Vec<String>>, value: &str| {
        list.iter().flatten().any(|x| x == "*" || x == value)
    };
    spec.match_constraints
        .as_ref()
        .and_then(|m| m.resource_rules.as_ref())
        .into_iter()
        .flatten()
        .any(|rule| {
            let (group, plural) = group_of(request.resource);
            let resource = match request.resource.split_once('/') {
                Some((_, sub)) => format!("{plural}/{sub}"),
                None => plural.to_string(),
            };
            any(&rule.api_groups, group)
                && any(&rule.resources, &resource)
                && any(&rule.operations, request.operation)
        })
}

fn slice(driver: &str, node: &str, pool: &str) -> Json {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-{driver}-x")},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-0"}]}
    })
}

/// A claim allocated on `node` with a device of this driver and one of another, reserved for a pod.
fn claim(node: &str) -> Json {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default",
                     "finalizers": ["resource.kubernetes.io/delete-protection"]},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev"}}]}},
        "status": {
            "allocation": {
                "devices": {"results": [
                    {"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"},
                    {"request": "nic", "driver": "other.example.com", "pool": node, "device": "nic-0"}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}},
            "reservedFor": [{"resource": "pods", "name": "w", "uid": "u-1"}],
            "devices": [{"driver": "other.example.com", "pool": node, "device": "nic-0"}]
        }
    })
}

/// `value` with `new` at `pointer` (the parent must exist).
fn with(mut value: Json, pointer: &str, new: Json) -> Json {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    match value.pointer_mut(parent) {
        Some(Json::Object(map)) => {
            map.insert(key.to_string(), new);
        }
        Some(Json::Array(items)) => items[key.parse::<usize>().unwrap()] = new,
        _ => panic!("no {parent}"),
    }
    value
}

fn without(mut value: Json, pointer: &str) -> Json {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    value
        .pointer_mut(parent)
        .unwrap()
        .as_object_mut()
        .unwrap()
        .remove(key);
    value
}

fn own_entry(pool: &str) -> Json {
    json!({"driver": DRIVER, "pool": pool, "device": "gpu-0", "data": {"uuid": "MIG-1"}})
}

/// Each case: what, the request, whether the server must allow it.
fn cases(plugin: &str) -> Vec<(&'static str, Request, bool)> {
    let as_plugin = |operation, resource, object: Json, old_object: Json| Request {
        operation,
        resource,
        username: plugin.to_string(),
        node: Some("node-1"),
        object,
        old_object,
    };
    let reported = |c: Json, pool: &str| {
        let mut devices = c["status"]["devices"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        devices.push(own_entry(pool));
        with(c, "/status/devices", Json::Array(devices))
    };
    let here = claim("node-1");
    let there = claim("node-2");
    let own_slice = slice(DRIVER, "node-1", "node-1");
    vec![
        ("create a slice of its node", as_plugin("CREATE", "resourceslices", own_slice.clone(), Json::Null), true),
        (
            "update a slice of its node",
            as_plugin("UPDATE", "resourceslices", with(own_slice.clone(), "/spec/devices", json!([])), own_slice.clone()),
            true,
        ),
        ("delete a slice of its node", as_plugin("DELETE", "resourceslices", Json::Null, own_slice.clone()), true),
        (
            "create a slice of another driver",
            as_plugin("CREATE", "resourceslices", slice("other.example.com", "node-1", "node-1"), Json::Null),
            false,
        ),
        (
            "create a slice of another node",
            as_plugin("CREATE", "resourceslices", slice(DRIVER, "node-2", "node-2"), Json::Null),
            false,
        ),
        (
            "create a slice in another node's pool",
            as_plugin("CREATE", "resourceslices", slice(DRIVER, "node-1", "node-2"), Json::Null),
            false,
        ),
        (
            "update another node's slice",
            as_plugin("UPDATE", "resourceslices", slice(DRIVER, "node-2", "node-2"), slice(DRIVER, "node-2", "node-2")),
            false,
        ),
        (
            "delete another node's slice",
            as_plugin("DELETE", "resourceslices", Json::Null, slice(DRIVER, "node-2", "node-2")),
            false,
        ),
        (
            "delete another driver's slice on its node",
            as_plugin("DELETE", "resourceslices", Json::Null, slice("other.example.com", "node-1", "node-1")),
            false,
        ),
        (
            "write a slice with a token bound to no pod",
            Request { node: None, ..as_plugin("CREATE", "resourceslices", own_slice.clone(), Json::Null) },
            false,
        ),
        (
            "another account writes another node's slice (not the plugin: not this policy's business)",
            Request {
                username: "system:serviceaccount:other:driver".to_string(),
                ..as_plugin("CREATE", "resourceslices", slice("other.example.com", "node-2", "node-2"), Json::Null)
            },
            true,
        ),
        (
            "report its device in a claim allocated on its node",
            as_plugin("UPDATE", "resourceclaims/status", reported(here.clone(), "node-1"), here.clone()),
            true,
        ),
        (
            "report a device in a claim allocated on another node",
            as_plugin("UPDATE", "resourceclaims/status", reported(there.clone(), "node-2"), there.clone()),
            false,
        ),
        (
            "report a device of its driver in another pool",
            as_plugin("UPDATE", "resourceclaims/status", reported(here.clone(), "node-2"), here.clone()),
            false,
        ),
        (
            "remove a claim's allocation",
            as_plugin("UPDATE", "resourceclaims/status", without(here.clone(), "/status/allocation"), here.clone()),
            false,
        ),
        (
            "remove a claim's allocation and reservation",
            as_plugin(
                "UPDATE",
                "resourceclaims/status",
                without(without(here.clone(), "/status/allocation"), "/status/reservedFor"),
                here.clone(),
            ),
            false,
        ),
        (
            "change a claim's reservedFor",
            as_plugin("UPDATE", "resourceclaims/status", with(here.clone(), "/status/reservedFor", json!([])), here.clone()),
            false,
        ),
        (
            "change another driver's entry in status.devices",
            as_plugin(
                "UPDATE",
                "resourceclaims/status",
                with(here.clone(), "/status/devices/0/data", json!({"x": 1})),
                here.clone(),
            ),
            false,
        ),
        (
            "remove another driver's entry from status.devices",
            as_plugin("UPDATE", "resourceclaims/status", with(here.clone(), "/status/devices", json!([])), here.clone()),
            false,
        ),
        (
            "write the status of a claim not allocated yet",
            as_plugin(
                "UPDATE",
                "resourceclaims/status",
                with(without(here.clone(), "/status/allocation"), "/status/devices", json!([own_entry("node-1")])),
                without(here.clone(), "/status/allocation"),
            ),
            false,
        ),
        (
            "the scheduler deallocates a claim (not the plugin)",
            Request {
                username: "system:kube-scheduler".to_string(),
                node: None,
                ..as_plugin("UPDATE", "resourceclaims/status", without(here.clone(), "/status/allocation"), here.clone())
            },
            true,
        ),
    ]
}

/// Runs each case the `cases` function makes for the plugin's user (named by the manifests' account)
/// through the policies in `docs`; fails naming every case decided otherwise.
pub(super) fn check_cases(
    docs: &[Doc],
    label: &str,
    cases: fn(&str) -> Vec<(&'static str, Request, bool)>,
) {
    let (namespace, account) = plugin_account(docs);
    let plugin = format!("system:serviceaccount:{namespace}:{account}");
    let mut wrong = Vec::new();
    for (what, request, allowed) in cases(&plugin) {
        let verdict = admit(docs, &request);
        if verdict.is_ok() != allowed {
            wrong.push(format!(
                "{what}: expected {}, got {verdict:?}",
                if allowed { "allowed" } else { "denied" }
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{label} ({plugin}):\n{}",
        wrong.join("\n")
    );
}

/// Runs the named cases of `cases` as the plugin of `docs` and checks that each is refused with a message
/// that contains the expected text.
pub(super) fn check_refusal_messages(
    docs: &[Doc],
    cases: fn(&str) -> Vec<(&'static str, Request, bool)>,
    expected: &[(&str, &str)],
) {
    let (namespace, account) = plugin_account(docs);
    let plugin = format!("system:serviceaccount:{namespace}:{account}");
    let all = cases(&plugin);
    for (case, message) in expected {
        let request = all
            .iter()
            .find(|(what, _, _)| what == case)
            .map(|(_, request, _)| request)
            .unwrap_or_else(|| panic!("no case {case}"));
        let verdict = admit(docs, request);
        assert!(
            verdict.as_ref().is_err_and(|m| m.contains(message)),
            "{case}: {verdict:?} does not say {message:?}"
        );
    }
}

#[test]
fn the_policies_decide_the_plugins_writes_as_intended() {
    let (objects, _) = manifests();
    check_cases(&objects, "deploy/base", cases);
}

#[test]
fn the_policies_still_apply_after_renaming_the_namespace_and_the_account() {
    let overlay = "resources: [../../deploy/overlays/nvml]\nnamePrefix: team-\nnamespace: gpus\n";
    let Some(docs) = kustomize_dir(overlay) else {
        return;
    };
    let (namespace, account) = plugin_account(&docs);
    assert_eq!(
        (namespace.as_str(), account.as_str()),
        ("gpus", "team-gpu-dra-plugin")
    );
    let (base, _) = manifests();
    assert_eq!(
        plugin_grants(&docs),
        plugin_grants(&base),
        "the renamed plugin lost grants"
    );
    check_cases(&docs, "renamed", cases);
}

#[test]
fn the_policies_are_bound_and_cover_every_write_the_plugin_may_make() {
    let (objects, _) = manifests();
    let (namespace, account) = plugin_account(&objects);
    // The policy on users' device configs has its own test (config_admission.rs).
    let bindings: Vec<ValidatingAdmissionPolicyBinding> = objects
        .iter()
        .filter(|d| d.kind() == "ValidatingAdmissionPolicyBinding")
        .map(|d| d.typed::<ValidatingAdmissionPolicyBinding>())
        .filter(|b| b.spec.policy_name != super::config_admission::POLICY)
        .collect();
    for binding in &bindings {
        assert_eq!(binding.spec.validation_actions, vec!["Deny".to_string()]);
        let reference = binding.spec.param_ref.as_ref().expect("a paramRef");
        assert_eq!(
            (reference.namespace.as_deref(), reference.name.as_deref()),
            (Some(namespace.as_str()), Some(account.as_str())),
            "binding {} must name the plugin's service account as its parameter",
            binding.metadata.name.as_deref().unwrap_or_default()
        );
    }
    let bound: Vec<ValidatingAdmissionPolicy> = bindings
        .iter()
        .map(|b| super::one(&objects, "ValidatingAdmissionPolicy", &b.spec.policy_name).typed())
        .collect();
    // Every write the plugin may make on resource.k8s.io objects and on Nodes is seen by a policy.
    for grant in plugin_grants(&objects).iter().filter(|g| {
        g.group == "resource.k8s.io"
            || (g.group.is_empty() && (g.resource == "nodes" || g.resource == "pods"))
    }) {
        let operation = match grant.verb.as_str() {
            "create" => "CREATE",
            "update" | "patch" => "UPDATE",
            "delete" | "deletecollection" => "DELETE",
            _ => continue,
        };
        let request = Request {
            operation,
            resource: Box::leak(grant.resource.clone().into_boxed_str()),
            username: String::new(),
            node: None,
            object: Json::Null,
            old_object: Json::Null,
        };
        assert!(
            bound
                .iter()
                .any(|p| p.spec.as_ref().is_some_and(|s| matches(s, &request))),
            "the plugin may {grant}, and no admission policy narrows it"
        );
    }
    for policy in &bound {
        let spec = policy.spec.as_ref().unwrap();
        let name = policy.metadata.name.as_deref().unwrap_or_default();
        assert_eq!(spec.failure_policy.as_deref(), Some("Fail"), "{name}");
        let kind = spec.param_kind.as_ref().expect("a paramKind");
        assert_eq!(
            (kind.api_version.as_deref(), kind.kind.as_deref()),
            (Some("v1"), Some("ServiceAccount"))
        );
        check_expressions(name, spec);
    }
}

/// Every expression parses, uses only admission variables, and names only variables defined before it.
pub(super) fn check_expressions(
    name: &str,
    spec: &k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicySpec,
) {
    let uses = Regex::new(r"\bvariables\.(\w+)").unwrap();
    let mut defined: Vec<&str> = Vec::new();
    let check = |what: &str, expression: &str, defined: &[&str]| {
        let program = compile(expression).unwrap_or_else(|e| panic!("{name} {what}: {e}"));
        for reference in program.references().variables() {
            // Comprehension variables (`d`, `t`, `f`) are one letter here.
            assert!(
                ADMISSION_VARIABLES.contains(&reference)
                    || TYPE_NAMES.contains(&reference)
                    || reference.len() == 1,
                "{name} {what}: unknown variable {reference}"
            );
        }
        for used in uses.captures_iter(expression) {
            assert!(
                defined.contains(&&used[1]),
                "{name} {what}: variables.{} is not defined before",
                &used[1]
            );
        }
    };
    for c in spec.match_conditions.iter().flatten() {
        check(&format!("matchCondition {}", c.name), &c.expression, &[]);
    }
    for v in spec.variables.iter().flatten() {
        check(&format!("variable {}", v.name), &v.expression, &defined);
        defined.push(&v.name);
    }
    for (i, v) in spec.validations.iter().flatten().enumerate() {
        check(&format!("validation {i}"), &v.expression, &defined);
        if let Some(m) = &v.message_expression {
            check(&format!("validation {i} message"), m, &defined);
        }
    }
    let driver = spec
        .variables
        .iter()
        .flatten()
        .find(|v| v.name == "driver")
        .map(|v| v.expression.trim_matches(['\'', '"']).to_string());
    // Policies on Nodes and on ComputeDomain status (whose entries are per node, not per driver) name
    // no driver; the others must name the plugin's.
    let on_nodes = spec
        .match_constraints
        .as_ref()
        .and_then(|m| m.resource_rules.as_ref())
        .is_some_and(|rules| {
            rules.iter().all(|r| {
                r.resources
                    .iter()
                    .flatten()
                    .all(|x| x == "nodes" || x == "computedomains/status")
            })
        });
    if !on_nodes {
        assert_eq!(
            driver.as_deref(),
            Some(DRIVER),
            "{name}: the driver name must be the plugin's default --driver-name"
        );
    }
}
