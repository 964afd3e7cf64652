//! A daemon Pod's status as the plugin reads it: Ready or not, and why not in the kubelet's words.

use k8s_openapi::api::core::v1::Pod;

/// Whether the Pod is Ready and not being deleted.
pub fn is_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Why a Pod is not Ready, in the kubelet's words: the container's waiting reason, then its last
/// exit (code, reason, termination message); its phase where the kubelet said neither.
pub fn not_ready_reason(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let container = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first());
    let mut parts = Vec::new();
    if let Some(waiting) = container
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.waiting.as_ref())
    {
        parts.push(
            format!(
                "container waiting: {} {}",
                waiting.reason.as_deref().unwrap_or_default(),
                waiting.message.as_deref().unwrap_or_default()
            )
            .trim()
            .to_string(),
        );
    }
    if let Some(terminated) = container
        .and_then(|c| c.last_state.as_ref())
        .and_then(|s| s.terminated.as_ref())
    {
        let mut exit = format!(
            "last exit code {} ({})",
            terminated.exit_code,
            terminated.reason.as_deref().unwrap_or("no reason")
        );
        if let Some(message) = terminated.message.as_deref().map(str::trim) {
            if !message.is_empty() {
                exit.push_str(&format!(": {message}"));
            }
        }
        parts.push(exit);
    }
    if parts.is_empty() {
        let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
        parts.push(format!("phase {phase}, not Ready yet"));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"}, "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn a_crash_looping_daemon_says_the_kubelets_reason_and_its_last_exit() {
        let pod = pod(serde_json::json!({
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{
                "name": "imex-daemon", "ready": false, "restartCount": 3, "image": "", "imageID": "",
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                             "message": "IMEX: fabric manager not running\n"}},
            }],
        }));
        assert!(!is_ready(&pod));
        assert_eq!(
            not_ready_reason(&pod),
            "container waiting: CrashLoopBackOff back-off 40s, last exit code 1 (Error): IMEX: fabric manager not running"
        );
    }

    #[test]
    fn a_pod_not_started_yet_says_its_phase() {
        let pod = pod(serde_json::json!({"phase": "Pending"}));
        assert_eq!(not_ready_reason(&pod), "phase Pending, not Ready yet");
    }

    #[test]
    fn a_ready_pod_being_deleted_is_not_ready() {
        let mut ready = pod(serde_json::json!({
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
        }));
        assert!(is_ready(&ready));
        ready.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert!(!is_ready(&ready));
    }
}
