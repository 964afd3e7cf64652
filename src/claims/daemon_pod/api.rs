//! The daemons' Pods through the API server: created, read, deleted and waited on until gone, and
//! this node's listed. Every call on `Api<Pod>` for the daemons stays in this file, beside the field
//! that types it: tests/manifests/rbac.rs tells a call's kind by the binding in its own file.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use super::{COMPONENT_LABEL, DRIVER_LABEL};

/// How often a wait asks the API server again.
pub const POLL: Duration = Duration::from_millis(200);
/// How long a stop waits for a daemon's Pod to be gone: its grace period is 15 s.
pub const GONE_TIMEOUT: Duration = Duration::from_secs(25);

/// The daemons' Pods in the plugin's namespace.
#[derive(Clone)]
pub struct DaemonPodApi {
    api: Api<Pod>,
    namespace: String,
}

impl std::fmt::Debug for DaemonPodApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonPodApi")
            .field("namespace", &self.namespace)
            .finish()
    }
}

/// Whether a Pod went within the wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// Gone (or never there).
    Yes,
    /// Still there at the deadline, most likely still terminating.
    StillThere,
}

impl DaemonPodApi {
    pub fn new(client: kube::Client, namespace: &str) -> Self {
        DaemonPodApi {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub async fn get(&self, name: &str) -> Result<Option<Pod>, kube::Error> {
        self.api.get_opt(name).await
    }

    pub async fn create(&self, pod: &Pod) -> Result<Pod, kube::Error> {
        self.api.create(&PostParams::default(), pod).await
    }

    /// Deletes the Pod (gracefully: the kubelet ends it); `false` when there was none.
    pub async fn delete(&self, name: &str) -> Result<bool, kube::Error> {
        match self.api.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Waits until the Pod is gone, or `deadline`. A failed read counts as still there.
    pub async fn wait_gone(&self, name: &str, deadline: Instant) -> Gone {
        loop {
            if let Ok(None) = self.api.get_opt(name).await {
                return Gone::Yes;
            }
            if Instant::now() >= deadline {
                return Gone::StillThere;
            }
            tokio::time::sleep(POLL.min(deadline.saturating_duration_since(Instant::now()))).await;
        }
    }

    /// The daemon Pods of `component` that the plugin of `driver` made on `node`.
    pub async fn on_node(
        &self,
        component: &str,
        driver: &str,
        node: &str,
    ) -> Result<Vec<Pod>, kube::Error> {
        let params = ListParams::default()
            .labels(&format!(
                "{COMPONENT_LABEL}={component},{DRIVER_LABEL}={driver}"
            ))
            .fields(&format!("spec.nodeName={node}"));
        Ok(self.api.list(&params).await?.items)
    }
}
