//! Validation messages and selection by labels, priority, age and name.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::*;

fn policy(name: &str, created: &str, spec: Value) -> GpuNodePolicy {
    let object = json!({
        "apiVersion": "gpu.dra.dev/v1alpha1",
        "kind": "GpuNodePolicy",
        "metadata": { "name": name, "creationTimestamp": created, "generation": 1 },
        "spec": spec,
    });
    match serde_json::from_value(object) {
        Ok(policy) => policy,
        Err(err) => panic!("test policy {name} does not decode: {err}"),
    }
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn selected(policies: &[GpuNodePolicy], node: &[(&str, &str)]) -> Option<String> {
    select(policies, &labels(node)).map(|p| p.name_any())
}

const T0: &str = "2025-01-01T00:00:00Z";
const T1: &str = "2025-06-01T00:00:00Z";

#[test]
fn a_complete_valid_spec_and_an_empty_spec_pass() {
    let full = policy(
        "full",
        T0,
        json!({
            "nodeSelector": {
                "matchLabels": { "nvidia.com/gpu.product": "H100" },
                "matchExpressions": [
                    { "key": "zone", "operator": "In", "values": ["a", "b"] },
                    { "key": "drain", "operator": "DoesNotExist" },
                ],
            },
            "health": {
                "ignoredXids": [13, 31], "fatalXids": [79],
                "informationalEffect": "None", "resetRequiredEffect": "NoSchedule",
                "fatalEffect": "NoExecute", "clearOnRecovery": true,
            },
            "migMode": "dynamic",
            "priority": 10,
        }),
    );
    assert_eq!(full.spec.validate(), Ok(()));
    assert_eq!(full.spec.mig_mode, Some(MigModeSpec::Dynamic));
    assert_eq!(
        full.spec
            .health
            .as_ref()
            .and_then(|h| h.fatal_effect.clone()),
        Some(TaintEffect::NoExecute)
    );
    assert_eq!(policy("empty", T0, json!({})).spec.validate(), Ok(()));
}

#[test]
fn classic_node_labels_are_off_unless_a_policy_turns_them_on() {
    let empty = policy("empty", T0, json!({}));
    assert!(!empty.spec.classic_node_labels);
    let on = policy("on", T0, json!({ "classicNodeLabels": true }));
    assert!(on.spec.classic_node_labels);
    assert_eq!(on.spec.validate(), Ok(()));
    let written = serde_json::to_value(&on.spec).expect("spec serializes");
    assert_eq!(written["classicNodeLabels"], json!(true));
    // The CRD declares it a boolean, so the API server refuses "yes" before any node reads it.
    let crd = serde_json::to_value(<GpuNodePolicy as kube::CustomResourceExt>::crd())
        .expect("CRD serializes");
    let field = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]["classicNodeLabels"];
    assert_eq!(field["type"], json!("boolean"), "{field}");
}

#[test]
fn every_problem_is_named_by_its_field_path() {
    // Unknown strings must still decode, so that validation (not decoding) reports them.
    let bad = policy(
        "bad",
        T0,
        json!({
            "nodeSelector": {
                "matchExpressions": [
                    { "key": "zone", "operator": "Near", "values": ["a"] },
                    { "key": "zone", "operator": "In" },
                    { "key": "", "operator": "Exists", "values": ["x"] },
                ],
            },
            "health": {
                "ignoredXids": [13, -1, 13],
                "fatalXids": [79, 5_000_000_000_i64, 13],
                "fatalEffect": "Explode",
                "informationalEffect": "NoSchedule",
            },
            "migMode": "automatic",
        }),
    );
    let expected = [
        "spec.nodeSelector.matchExpressions[0].operator: unknown operator \"Near\"; expected one of In, NotIn, Exists, DoesNotExist",
        "spec.nodeSelector.matchExpressions[1].values: must not be empty for operator In",
        "spec.nodeSelector.matchExpressions[2].key: must not be empty",
        "spec.nodeSelector.matchExpressions[2].values: must be empty for operator Exists",
        "spec.health.ignoredXids[1]: XID -1 must not be negative",
        "spec.health.ignoredXids[2]: XID 13 is listed twice",
        "spec.health.fatalXids[1]: XID 5000000000 is larger than 4294967295",
        "spec.health.fatalXids[2]: XID 13 is also in ignoredXids",
        "spec.health.fatalEffect: unknown effect \"Explode\"; expected one of None, NoSchedule, NoExecute",
        "spec.migMode: unknown MIG mode \"automatic\"; expected one of none, static, dynamic",
    ];
    assert_eq!(
        bad.spec.validate(),
        Err(expected.map(String::from).to_vec())
    );
}

#[test]
fn unknown_values_survive_a_round_trip() {
    let bad = policy("bad", T0, json!({ "migMode": "automatic" }));
    let text = serde_json::to_value(&bad.spec).map(|v| v["migMode"].clone());
    assert_eq!(text.ok(), Some(json!("automatic")));
}

#[test]
fn selectors_follow_kubernetes_label_selector_rules() {
    let selector = |spec: Value| policy("p", T0, json!({ "nodeSelector": spec }));
    let cases = [
        (json!({}), vec![], true),
        (
            json!({ "matchLabels": { "gpu": "h100" } }),
            vec![("gpu", "h100")],
            true,
        ),
        (
            json!({ "matchLabels": { "gpu": "h100" } }),
            vec![("gpu", "a100")],
            false,
        ),
        (
            json!({ "matchExpressions": [{ "key": "gpu", "operator": "In", "values": ["a100", "h100"] }] }),
            vec![("gpu", "h100")],
            true,
        ),
        (
            json!({ "matchExpressions": [{ "key": "gpu", "operator": "In", "values": ["a100"] }] }),
            vec![],
            false,
        ),
        (
            json!({ "matchExpressions": [{ "key": "gpu", "operator": "NotIn", "values": ["a100"] }] }),
            vec![],
            true,
        ),
        (
            json!({ "matchExpressions": [{ "key": "gpu", "operator": "NotIn", "values": ["a100"] }] }),
            vec![("gpu", "a100")],
            false,
        ),
        (
            json!({ "matchExpressions": [{ "key": "gpu", "operator": "Exists" }] }),
            vec![("gpu", "")],
            true,
        ),
        (
            json!({ "matchExpressions": [{ "key": "gpu", "operator": "DoesNotExist" }] }),
            vec![("gpu", "")],
            false,
        ),
        (
            json!({ "matchLabels": { "zone": "a" }, "matchExpressions": [{ "key": "gpu", "operator": "Exists" }] }),
            vec![("gpu", "h100")],
            false,
        ),
    ];
    for (spec, node, expected) in cases {
        let p = selector(spec.clone());
        assert_eq!(
            p.spec.node_selector.matches(&labels(&node)),
            expected,
            "selector {spec} on labels {node:?}"
        );
    }
}

#[test]
fn highest_priority_wins_then_oldest_then_name() {
    let all = json!({});
    let policies = [
        policy("b-new", T1, json!({ "priority": 5 })),
        policy("a-new", T1, json!({ "priority": 5 })),
        policy("old", T0, json!({ "priority": 5, "nodeSelector": all })),
        policy("low", T0, json!({ "priority": 1 })),
    ];
    assert_eq!(selected(&policies, &[]).as_deref(), Some("old"));
    assert_eq!(selected(&policies[..2], &[]).as_deref(), Some("a-new"));
    assert_eq!(selected(&policies[3..], &[]).as_deref(), Some("low"));
    let top = policy("top", T1, json!({ "priority": 9 }));
    let mut with_top = policies.to_vec();
    with_top.push(top);
    assert_eq!(selected(&with_top, &[]).as_deref(), Some("top"));
}

#[test]
fn only_valid_policies_that_select_the_node_are_candidates() {
    let policies = [
        policy(
            "broken",
            T0,
            json!({ "priority": 100, "migMode": "sometimes" }),
        ),
        policy(
            "h100",
            T0,
            json!({ "priority": 10, "nodeSelector": { "matchLabels": { "gpu": "h100" } } }),
        ),
        policy("default", T0, json!({})),
    ];
    assert_eq!(
        selected(&policies, &[("gpu", "h100")]).as_deref(),
        Some("h100")
    );
    assert_eq!(
        selected(&policies, &[("gpu", "a100")]).as_deref(),
        Some("default")
    );
    assert_eq!(selected(&policies[..2], &[("gpu", "a100")]), None);
}

#[test]
fn superseded_message_says_why_the_winner_won() {
    let winner = policy("winner", T0, json!({ "priority": 5 }));
    let lower = policy("lower", T0, json!({ "priority": 1 }));
    let newer = policy("newer", T1, json!({ "priority": 5 }));
    let twin = policy("zz-twin", T0, json!({ "priority": 5 }));
    assert_eq!(
        superseded_message(&lower, &winner),
        "superseded by GpuNodePolicy \"winner\", which has priority 5 (this policy has 1)"
    );
    assert!(superseded_message(&newer, &winner).ends_with("\"winner\" wins because it is older"));
    assert!(superseded_message(&twin, &winner).ends_with("because its name sorts first"));
}

#[test]
fn mps_memory_shares_name_their_field_and_allow_dynamic_mig() {
    let valid = policy(
        "mps",
        T0,
        json!({
            "migMode": "static",
            "sharing": { "mpsMemoryShares": { "minimum": "2Gi", "step": 1073741824 } },
        }),
    );
    assert_eq!(valid.spec.validate(), Ok(()));
    let shares = valid
        .spec
        .sharing
        .as_ref()
        .and_then(|s| s.mps_memory_shares.as_ref())
        .map(|m| m.sizes("spec.sharing.mpsMemoryShares"));
    assert_eq!(
        shares,
        Some(Ok(ShareSizes {
            minimum_bytes: 2 << 30,
            step_bytes: 1 << 30
        }))
    );
    let defaults = policy("d", T0, json!({ "sharing": { "mpsMemoryShares": {} } }));
    assert_eq!(defaults.spec.validate(), Ok(()));

    let bad = policy(
        "bad",
        T0,
        json!({
            "migMode": "dynamic",
            "sharing": { "mpsMemoryShares": { "minimum": "1Gb", "step": "0.5" } },
        }),
    );
    let problems = bad.spec.validate().expect_err("invalid");
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(problems[0].starts_with(
        "spec.sharing.mpsMemoryShares.minimum: \"1Gb\" is not a quantity such as 10Gi"
    ));
    assert_eq!(
        problems[1],
        "spec.sharing.mpsMemoryShares.step: \"0.5\" must be a whole number of bytes"
    );
    let dynamic = policy(
        "dyn",
        T0,
        json!({ "migMode": "dynamic", "sharing": { "mpsMemoryShares": {} } }),
    );
    assert_eq!(dynamic.spec.validate(), Ok(()));
    // Sharing nothing is no problem with any MIG mode.
    let empty = policy("e", T0, json!({ "migMode": "dynamic", "sharing": {} }));
    assert_eq!(empty.spec.validate(), Ok(()));
}

#[test]
fn shares_in_each_mode_resolve_to_what_the_devices_publish() {
    use crate::devices::{Enforcement, MemoryShares, ShareCapacity, Shares};
    use crate::gpu::TimeSliceInterval;
    let resolved = |sharing: serde_json::Value| {
        let p = policy("s", T0, json!({ "migMode": "dynamic", "sharing": sharing }));
        assert_eq!(p.spec.validate(), Ok(()), "{sharing}");
        p.spec.sharing.as_ref().and_then(|s| s.resolved())
    };
    assert_eq!(
        resolved(json!({ "shares": { "mode": "Count", "count": 4,
            "devices": ["Gpus", "MigDevices"], "enforcement": "TimeSlicing", "interval": "Long" } })),
        Some(Shares {
            capacity: ShareCapacity::Count(4),
            gpus: true,
            mig_devices: true,
            enforcement: Enforcement::TimeSlicing(TimeSliceInterval::Long),
            nvidia: false,
        })
    );
    assert_eq!(
        resolved(
            json!({ "shares": { "mode": "Unlimited", "devices": ["MigDevices"], "enforcement": "None" } })
        ),
        Some(Shares {
            capacity: ShareCapacity::Unlimited,
            gpus: false,
            mig_devices: true,
            enforcement: Enforcement::None,
            nvidia: false,
        })
    );
    let sizes = MemoryShares {
        minimum_bytes: 4 << 30,
        step_bytes: 4 << 30,
    };
    // The old spelling and the general form say the same.
    assert_eq!(
        resolved(json!({ "shares": { "mode": "Memory", "memory": { "minimum": "4Gi" } } })),
        Some(Shares::mps_memory(sizes))
    );
    assert_eq!(
        resolved(json!({ "mpsMemoryShares": { "minimum": "4Gi" } })),
        Some(Shares::mps_memory(sizes))
    );
}

#[test]
fn shares_name_every_problem_by_field() {
    let problems = |sharing: serde_json::Value| {
        policy("s", T0, json!({ "sharing": sharing }))
            .spec
            .validate()
            .expect_err("invalid")
    };
    assert_eq!(
        problems(json!({ "shares": { "mode": "Count", "count": 1, "memory": {},
            "devices": ["Gpus", "Gpus", "Vgpus"], "interval": "Short" } })),
        [
            "spec.sharing.shares.count: 1 must be between 2 and 1048576 (one claim per device is not sharing)",
            "spec.sharing.shares.memory: only with mode Memory",
            "spec.sharing.shares.devices[1]: Gpus is listed twice",
            "spec.sharing.shares.devices[2]: unknown device kind \"Vgpus\"; expected one of Gpus, MigDevices",
            "spec.sharing.shares.interval: only with enforcement TimeSlicing",
        ]
    );
    assert_eq!(
        problems(json!({ "shares": { "mode": "Count" } })),
        ["spec.sharing.shares.count: required with mode Count"]
    );
    assert_eq!(
        problems(json!({ "shares": { "mode": "ByVolume", "devices": [], "enforcement": "vGPU" } })),
        [
            "spec.sharing.shares.mode: unknown share mode \"ByVolume\"; expected one of Memory, Count, Unlimited",
            "spec.sharing.shares.devices: must name Gpus, MigDevices or both (leave it out for Gpus)",
            "spec.sharing.shares.enforcement: unknown enforcement \"vGPU\"; expected one of MPS, TimeSlicing, None",
        ]
    );
    let both = problems(json!({ "mpsMemoryShares": {}, "shares": { "mode": "Unlimited" } }));
    assert_eq!(both.len(), 1);
    assert!(
        both[0].starts_with("spec.sharing.mpsMemoryShares: not together with spec.sharing.shares"),
        "{both:?}"
    );
}
