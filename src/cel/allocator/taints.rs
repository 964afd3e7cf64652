//! Device taints and request tolerations (`DRADeviceTaints`), as the scheduler checks them: a
//! `NoSchedule` or `NoExecute` taint blocks allocation unless the request tolerates it; other effects
//! (`None` from 1.35) never do.

use k8s_openapi::api::resource::v1::{Device, DeviceTaint, DeviceToleration};

/// The first NoSchedule / NoExecute taint that no toleration tolerates (`None` effects never block).
pub fn untolerated_taint<'a>(
    device: &'a Device,
    tolerations: &[DeviceToleration],
) -> Option<&'a DeviceTaint> {
    device.taints.iter().flatten().find(|taint| {
        matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
            && !tolerations
                .iter()
                .any(|toleration| tolerates(toleration, taint))
    })
}

/// `resourceclaim.ToleratesTaint`.
fn tolerates(toleration: &DeviceToleration, taint: &DeviceTaint) -> bool {
    toleration_matches(
        [
            &toleration.key,
            &toleration.operator,
            &toleration.value,
            &toleration.effect,
        ],
        [
            &taint.key,
            taint.value.as_deref().unwrap_or_default(),
            &taint.effect,
        ],
    )
}

/// The rule devices and nodes share (`resourceclaim.ToleratesTaint`, `v1helper.ToleratesTaint`): a
/// toleration's (key, operator, value, effect) against a taint's (key, value, effect). An empty effect
/// matches every effect, an empty key every key; `Equal` (or no operator) compares values, `Exists`
/// ignores them, any other operator matches nothing.
pub fn toleration_matches(toleration: [&Option<String>; 4], taint: [&str; 3]) -> bool {
    let [key, operator, value, effect] = toleration.map(|s| s.as_deref().unwrap_or_default());
    let [taint_key, taint_value, taint_effect] = taint;
    if !effect.is_empty() && effect != taint_effect {
        return false;
    }
    if !key.is_empty() && key != taint_key {
        return false;
    }
    match operator {
        "" | "Equal" => value == taint_value,
        "Exists" => true,
        _ => false,
    }
}
