//! The admission policy on users' device configs (`deploy/base/config-admission-policy.yaml`): for each case
//! of `device-config-cases.json`, a claim and a claim template that carry the config are admitted, or refused
//! with the plugin's message; other drivers' configs pass whatever they hold; no value anywhere in a config
//! makes an expression fail; and the policy is bound to deny creates and updates of both kinds.
//! `e2e/config-admission.sh` runs the same cases against a real API server.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use serde::Deserialize;
use serde_json::{json, Value as Json};

use super::admission::{admit, check_expressions, Request};
use super::manifests;

pub(super) const POLICY: &str = "gpu-dra-device-configs";
const DRIVER: &str = "gpu.dra.dev";
const OTHER_DRIVER: &str = "other.example.com";

/// The plugin's messages that CEL can check: the plan's table less `duplicate key` (CEL gets the object
/// already parsed) and the root's `must be an object` (the API server refuses parameters that are not an
/// object before admission). Each must be the expected error of some case.
const MESSAGES: &[&str] = &[
    "apiVersion: must be gpu.dra.dev/v1alpha1 or resource.nvidia.com/v1beta1",
    "kind: must be GpuConfig or MigConfig",
    "shareing: unknown field",
    "sharing.mps: unknown field",
    "sharing.timeSlicingConfig.intervall: unknown field",
    "sharing.mpsConfig.foo: unknown field",
    "sharing: must be an object",
    "sharing.strategy: must be a string",
    "sharing.timeSlicingConfig: must be an object",
    "sharing.timeSlicingConfig.interval: must be a string",
    "sharing.mpsConfig: must be an object",
    "sharing.mpsConfig.defaultActiveThreadPercentage: must be an integer",
    "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: must be a string",
    "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: must be an object",
    "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[gpu-0]: must be a string",
    "sharing.strategy: must be one of Exclusive, TimeSlicing, MPS",
    "sharing.strategy: required",
    "sharing.timeSlicingConfig.interval: must be one of Default, Short, Medium, Long",
    "sharing.timeSlicingConfig: only allowed with strategy TimeSlicing",
    "sharing.timeSlicingConfig: not allowed in MigConfig (MIG devices have no time-slice interval)",
    "sharing.mpsConfig: only allowed with strategy MPS",
    "sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100",
    "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: must be a positive quantity of bytes such as 10Gi",
    "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[gpu-0]: must be a positive quantity of bytes such as 10Gi",
    "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[gpu-x]: not a device name of this driver (gpu-<minor> or gpu-<minor>-mig-...)",
    "sharing.mpsConfig.shmSize: must be a string",
    "sharing.mpsConfig.shmSize: must be a positive quantity of bytes such as 10Gi",
];

#[derive(Deserialize)]
struct Case {
    what: String,
    parameters: Json,
    /// `<path>: <reason>`, as the plugin says it; none when the config is valid.
    error: Option<String>,
}

fn cases() -> Vec<Case> {
    let path = super::root().join("tests/manifests/device-config-cases.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn opaque(driver: &str, parameters: &Json) -> Json {
    json!({"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}})
}

/// A kind of object that holds configs.
struct Kind {
    resource: &'static str,
    /// Where the configs are, as messages name it.
    field: &'static str,
    /// An object of this kind with these configs.
    object: fn(Vec<Json>) -> Json,
}

/// Claims and claim templates.
fn kinds() -> [Kind; 2] {
    fn claim(configs: Vec<Json>) -> Json {
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "default"},
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
                "config": configs}}
        })
    }
    fn template(configs: Vec<Json>) -> Json {
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t", "namespace": "default"},
            "spec": {"spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
                "config": configs}}}
        })
    }
    [
        Kind {
            resource: "resourceclaims",
            field: "spec.devices.config",
            object: claim,
        },
        Kind {
            resource: "resourceclaimtemplates",
            field: "spec.spec.devices.config",
            object: template,
        },
    ]
}

fn create(resource: &'static str, object: Json) -> Request {
    update(resource, object, Json::Null)
}

fn update(resource: &'static str, object: Json, old_object: Json) -> Request {
    Request {
        operation: if old_object.is_null() {
            "CREATE"
        } else {
            "UPDATE"
        },
        resource,
        username: "alice".to_string(),
        node: None,
        object,
        old_object,
    }
}

/// A config of another driver that this driver's rules would all refuse.
fn others_malformed() -> Json {
    opaque(
        OTHER_DRIVER,
        &json!({"apiVersion": 1, "stray": true, "sharing": "MPS"}),
    )
}

#[test]
fn each_config_is_admitted_or_refused_with_the_plugins_message() {
    let (docs, _) = manifests();
    let mut wrong = Vec::new();
    for case in cases() {
        for Kind {
            resource,
            field,
            object,
        } in kinds()
        {
            // Index 0 is another driver's, so the index in the message must be 1.
            let configs = vec![others_malformed(), opaque(DRIVER, &case.parameters)];
            let expected = case
                .error
                .as_ref()
                .map(|e| format!("{field}[1].opaque.parameters: {e}"));
            let verdict = admit(&docs, &create(resource, object(configs)));
            if verdict.as_ref().err() != expected.as_ref() {
                wrong.push(format!(
                    "{} ({resource}): expected {}, got {verdict:?}",
                    case.what,
                    expected.as_deref().unwrap_or("admitted")
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_cases_cover_every_message_cel_can_check() {
    let errors: Vec<String> = cases().into_iter().filter_map(|c| c.error).collect();
    for message in MESSAGES {
        assert!(
            errors.iter().any(|e| e == message),
            "no case in device-config-cases.json expects {message:?}"
        );
    }
    let reasons: Vec<&str> = MESSAGES
        .iter()
        .filter_map(|m| m.split_once(": ").map(|(_, reason)| reason))
        .collect();
    for error in &errors {
        let reason = error.split_once(": ").map(|(_, reason)| reason);
        assert!(
            reason.is_some_and(|r| reasons.contains(&r)),
            "a case expects {error:?}, which is none of the plugin's messages"
        );
    }
    for valid in [
        "TimeSlicing with interval Long",
        "MPS with every limit",
        "a MigConfig with MPS and a MIG device's limit",
        "a GpuConfig without sharing",
    ] {
        assert!(
            cases().iter().any(|c| c.what == valid && c.error.is_none()),
            "no valid case {valid:?}"
        );
    }
}

/// NVIDIA's configs are left to the plugin, which checks them at prepare with NVIDIA's rules: the
/// policy must never refuse one NVIDIA's driver accepts, and it does not check NVIDIA's rules itself.
#[test]
fn nvidias_configs_pass_the_policy_and_are_checked_by_the_plugin() {
    let (docs, _) = manifests();
    let refused_by_the_plugin = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "Exclusive"}});
    for Kind {
        resource, object, ..
    } in kinds()
    {
        let configs = vec![opaque(DRIVER, &refused_by_the_plugin)];
        assert_eq!(
            admit(&docs, &create(resource, object(configs))),
            Ok(()),
            "{resource}"
        );
    }
    let error = gpu_dra::api::config::decode_config_value(&refused_by_the_plugin)
        .expect_err("NVIDIA has no Exclusive strategy");
    assert_eq!(
        error.to_string(),
        "sharing.strategy: unknown GPU sharing strategy: Exclusive, supported GPU sharing strategies: TimeSlicing, MPS"
    );
    // Our own kinds are still checked.
    let ours_malformed =
        json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "stray": 1});
    for Kind {
        resource, object, ..
    } in kinds()
    {
        let configs = vec![opaque(DRIVER, &ours_malformed)];
        assert!(
            admit(&docs, &create(resource, object(configs))).is_err(),
            "{resource}"
        );
    }
}

#[test]
fn other_drivers_configs_pass_whatever_they_hold() {
    let (docs, _) = manifests();
    // A driver name that only starts with ours is another driver too.
    let drivers = [OTHER_DRIVER, "gpu.dra.dev.example.com"];
    for (i, case) in cases().iter().enumerate() {
        for Kind {
            resource, object, ..
        } in kinds()
        {
            let driver = drivers[i % drivers.len()];
            let configs = vec![opaque(driver, &case.parameters), others_malformed()];
            let verdict = admit(&docs, &create(resource, object(configs)));
            assert_eq!(verdict, Ok(()), "{} under {driver} ({resource})", case.what);
        }
    }
}

#[test]
fn the_most_basic_rule_is_reported_first_then_the_first_config_that_breaks_it() {
    let (docs, _) = manifests();
    let valid = json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig"});
    let threads = |n: i64| {
        json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig",
               "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": n}}})
    };
    let no_kind = json!({"apiVersion": "gpu.dra.dev/v1alpha1"});
    for Kind {
        resource,
        field,
        object,
    } in kinds()
    {
        let configs = [&valid, &threads(0), &threads(200), &no_kind]
            .into_iter()
            .map(|p| opaque(DRIVER, p))
            .collect();
        assert_eq!(
            admit(&docs, &create(resource, object(configs))),
            Err(format!(
                "{field}[3].opaque.parameters: kind: must be GpuConfig or MigConfig"
            )),
            "{resource}"
        );
        let configs = [&valid, &threads(0), &threads(200)]
            .into_iter()
            .map(|p| opaque(DRIVER, p))
            .collect();
        assert_eq!(
            admit(&docs, &create(resource, object(configs))),
            Err(format!(
                "{field}[1].opaque.parameters: sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100"
            )),
            "{resource}"
        );
    }
}

#[test]
fn an_update_that_keeps_the_configs_passes_even_if_they_are_malformed() {
    let (docs, _) = manifests();
    let bad = json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": {}});
    let worse = json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "Gpu"});
    for Kind {
        resource,
        field,
        object,
    } in kinds()
    {
        // Made before the policy existed, with a finalizer that its controller now removes.
        let mut stored = object(vec![opaque(DRIVER, &bad)]);
        stored["metadata"]["finalizers"] = json!(["resource.kubernetes.io/delete-protection"]);
        let released = object(vec![opaque(DRIVER, &bad)]);
        assert_eq!(
            admit(&docs, &update(resource, released, stored.clone())),
            Ok(()),
            "{resource}"
        );
        let changed = object(vec![opaque(DRIVER, &worse)]);
        assert_eq!(
            admit(&docs, &update(resource, changed, stored)),
            Err(format!(
                "{field}[0].opaque.parameters: kind: must be GpuConfig or MigConfig"
            )),
            "{resource}"
        );
    }
}

/// Every JSON type at every place of a config: the policy admits or refuses with a message, and never
/// fails (an error would deny every such claim with a CEL error instead of the reason).
#[test]
fn no_value_anywhere_makes_an_expression_fail() {
    let (docs, _) = manifests();
    let bases = [
        json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig",
               "sharing": {"strategy": "MPS", "mpsConfig": {
                   "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "1Gi",
                   "defaultPerDevicePinnedMemoryLimit": {"gpu-0": "1Gi"}}}}),
        json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "MigConfig",
               "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}),
    ];
    let places = [
        "/apiVersion",
        "/kind",
        "/sharing",
        "/sharing/strategy",
        "/sharing/timeSlicingConfig",
        "/sharing/timeSlicingConfig/interval",
        "/sharing/mpsConfig",
        "/sharing/mpsConfig/defaultActiveThreadPercentage",
        "/sharing/mpsConfig/defaultPinnedDeviceMemoryLimit",
        "/sharing/mpsConfig/defaultPerDevicePinnedMemoryLimit",
        "/sharing/mpsConfig/defaultPerDevicePinnedMemoryLimit/gpu-0",
    ];
    let values = [
        json!(null),
        json!(true),
        json!(0),
        json!(-1),
        json!(1.5),
        json!(1e300),
        json!(""),
        json!("1e400"),
        json!("16Ei"),
        json!([]),
        json!(["MPS"]),
        json!({}),
        json!({"": null, "gpu-0": []}),
    ];
    let mut failed = Vec::new();
    for base in &bases {
        for place in places {
            for value in &values {
                let Some(parameters) = placed(base, place, value) else {
                    continue;
                };
                // Claims only: templates differ in where the configs are, not in what is done with them.
                let [Kind {
                    resource,
                    field,
                    object,
                }, _] = kinds();
                let configs = vec![opaque(DRIVER, &parameters)];
                let verdict = admit(&docs, &create(resource, object(configs)));
                let prefix = format!("{field}[0].opaque.parameters: ");
                if let Err(message) = &verdict {
                    if !message.starts_with(&prefix) || message.contains("error:") {
                        failed.push(format!("{parameters}: {message}"));
                    }
                }
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// `base` with `value` at `place`, where its parent object exists.
fn placed(base: &Json, place: &str, value: &Json) -> Option<Json> {
    let mut parameters = base.clone();
    let (parent, key) = place.rsplit_once('/')?;
    parameters
        .pointer_mut(parent)?
        .as_object_mut()?
        .insert(key.to_string(), value.clone());
    Some(parameters)
}

#[test]
fn the_policy_is_bound_to_deny_creates_and_updates_of_claims_and_templates() {
    let (docs, _) = manifests();
    let binding: ValidatingAdmissionPolicyBinding =
        super::one(&docs, "ValidatingAdmissionPolicyBinding", POLICY).typed();
    assert_eq!(binding.spec.policy_name, POLICY);
    assert_eq!(binding.spec.validation_actions, vec!["Deny".to_string()]);
    assert!(
        binding.spec.param_ref.is_none() && binding.spec.match_resources.is_none(),
        "the policy applies to every user in every namespace"
    );
    let policy: ValidatingAdmissionPolicy =
        super::one(&docs, "ValidatingAdmissionPolicy", POLICY).typed();
    let spec = policy.spec.expect("a spec");
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    assert!(spec.param_kind.is_none());
    let constraints = spec.match_constraints.as_ref().expect("matchConstraints");
    // v1beta1 and v1beta2 requests are converted to v1, whose field paths the expressions use.
    assert_eq!(constraints.match_policy.as_deref(), Some("Equivalent"));
    let rules = constraints.resource_rules.as_ref().expect("resourceRules");
    let covered = |resource: &str, operation: &str| {
        rules.iter().any(|r| {
            let has = |list: &Option<Vec<String>>, x: &str| list.iter().flatten().any(|y| y == x);
            has(&r.api_groups, "resource.k8s.io")
                && has(&r.api_versions, "v1")
                && has(&r.resources, resource)
                && has(&r.operations, operation)
        })
    };
    for resource in ["resourceclaims", "resourceclaimtemplates"] {
        for operation in ["CREATE", "UPDATE"] {
            assert!(
                covered(resource, operation),
                "{operation} of {resource} is not checked"
            );
        }
    }
    check_expressions(POLICY, &spec);
}

/// The policy and the plugin say the same thing: every case's config, checked as the plugin checks
/// an opaque config of its driver, gives the message the policy gives (or none).
#[test]
fn the_plugin_decoder_agrees_with_the_policy_on_every_case() {
    let mut disagreements = Vec::new();
    for case in cases() {
        let plugin = gpu_dra::claims::configs::check_opaque_parameters(DRIVER, &case.parameters)
            .map(|error| error.to_string());
        if plugin != case.error {
            disagreements.push(format!(
                "{}: policy {:?}, plugin {:?}",
                case.what, case.error, plugin
            ));
        }
    }
    assert!(disagreements.is_empty(), "{disagreements:#?}");
}
