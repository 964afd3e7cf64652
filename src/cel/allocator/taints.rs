//! Device taints and request tolerations (`DRADeviceTaints`), as the scheduler checks them: a
//! `NoSchedule` or `NoExecute` taint blocks allocation unless the request tolerates it; other effects
//! (`None` from 1.35) never do.

use k8s_openapi::api::resource::v1::{Device, DeviceTaint, DeviceToleration};

/// The first NoSchedule / NoExecute taint that no toleration tolerates (`None` effects never block).
pub(super) fn untolerated_taint<'a>(
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

/// `resourceclaim.ToleratesTaint`: empty effect matches every effect, empty key every key.
fn tolerates(toleration: &DeviceToleration, taint: &DeviceTaint) -> bool {
    let effect = toleration.effect.as_deref().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or_default() {
        "" | "Equal" => {
            toleration.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
        "Exists" => true,
        _ => false,
    }
}
