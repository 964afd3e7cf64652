//! `spec.passthrough`: what it selects, and every problem named by its field path.

use serde_json::json;

use super::*;

fn spec(passthrough: serde_json::Value) -> GpuNodePolicySpec {
    serde_json::from_value(json!({ "passthrough": passthrough })).expect("decodes")
}

#[test]
fn passthrough_selects_all_or_by_address_or_by_name() {
    let all = spec(json!({ "gpus": ["all"] }));
    assert_eq!(all.validate(), Ok(()));
    let chosen = all.passthrough.as_ref().unwrap();
    assert!(chosen.selects(None, "0000:81:00.0"));

    let some = spec(json!({ "gpus": ["0000:81:00.0", "gpu-1"] }));
    assert_eq!(some.validate(), Ok(()));
    let chosen = some.passthrough.as_ref().unwrap();
    assert!(chosen.selects(Some(2), "0000:81:00.0"));
    assert!(chosen.selects(Some(1), "0000:41:00.0"));
    assert!(!chosen.selects(Some(0), "0000:01:00.0"));
    // By name only while the NVIDIA driver holds the GPU (its minor is known).
    assert!(!chosen.selects(None, "0000:41:00.0"));
}

#[test]
fn passthrough_problems_name_the_entry() {
    let bad = spec(json!({ "gpus": ["all", "gpu-01", "0000:81:00.0", "0000:81:00.0", "81:00.0"] }));
    assert_eq!(
        bad.validate(),
        Err(vec![
            "spec.passthrough.gpus[0]: `all` must be the only entry".to_string(),
            "spec.passthrough.gpus[1]: \"gpu-01\" is neither `all`, a PCI address (0000:41:00.0) nor a GPU device name (gpu-<minor>)".to_string(),
            "spec.passthrough.gpus[3]: \"0000:81:00.0\" is listed twice".to_string(),
            "spec.passthrough.gpus[4]: \"81:00.0\" is neither `all`, a PCI address (0000:41:00.0) nor a GPU device name (gpu-<minor>)".to_string(),
        ])
    );
    assert_eq!(
        spec(json!({ "gpus": [] })).validate(),
        Err(vec![
            "spec.passthrough.gpus: must not be empty (`all`, PCI addresses or gpu-<minor> names)"
                .to_string()
        ])
    );
}
