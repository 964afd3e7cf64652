//! The daemons' Pods through the API server (`claims::daemon_pod::api`): created for a claim and
//! waited on until Ready (with the kubelet's reason when they are not), deleted and waited on until
//! gone, and this node's Pods listed for claims that are no longer prepared.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::dirs::ClaimDirs;
use super::{
    is_plain_name, pod, shm, DaemonPodTemplate, MpsDaemonRecord, MpsDaemonSpec, MpsDaemons,
    MpsError, READY_TIMEOUT, SHM_MARKER,
};
use crate::claims::daemon_pod::api::{Gone, GONE_TIMEOUT, POLL};
use crate::claims::daemon_pod::{is_ready, not_ready_reason, DaemonPodApi};

/// Runs the daemons' Pods: the API and what every Pod of this plugin shares.
#[derive(Debug, Clone)]
pub struct DaemonPods {
    pub(super) api: DaemonPodApi,
    pub(super) template: DaemonPodTemplate,
}

impl DaemonPods {
    pub fn new(client: kube::Client, template: DaemonPodTemplate) -> Self {
        Self {
            api: DaemonPodApi::new(client, &template.namespace),
            template,
        }
    }
}

impl MpsDaemons {
    pub(super) async fn launch(
        &self,
        pods: &DaemonPods,
        dirs: &ClaimDirs,
        spec: &MpsDaemonSpec,
    ) -> Result<MpsDaemonRecord, MpsError> {
        self.prepare_dirs(dirs)?;
        shm::mount_tmpfs(&dirs.shm, self.shm_size).map_err(|source| MpsError::Shm {
            claim: dirs.claim.clone(),
            path: dirs.shm.clone(),
            source,
        })?;
        let pod = pods.template.pod(spec, &self.host_root.join(&dirs.claim))?;
        let name = DaemonPodTemplate::pod_name(&dirs.claim);
        // A Pod of an earlier attempt (or an earlier boot) may hold other devices or a dead mount.
        self.delete_pod(pods, &dirs.claim, Some(GONE_TIMEOUT))
            .await?;
        let created = pods
            .api
            .create(&pod)
            .await
            .map_err(|e| self.api_error(&dirs.claim, &name, "creating", e))?;
        let uid = created.metadata.uid.clone().unwrap_or_default();
        self.wait_ready(pods, dirs, &name, &uid).await?;
        Ok(MpsDaemonRecord {
            pod: name,
            pod_uid: uid,
            dir: dirs.dir.clone(),
            devices: spec.devices.clone(),
            active_thread_percentage: spec.active_thread_percentage,
            multi_user: spec.multi_user,
        })
    }

    /// Waits until the Pod (this UID) is Ready and its daemon wrote the marker into the claim's tmpfs.
    async fn wait_ready(
        &self,
        pods: &DaemonPods,
        dirs: &ClaimDirs,
        name: &str,
        uid: &str,
    ) -> Result<(), MpsError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let detail = match pods.api.get(name).await {
                Ok(Some(pod)) if pod.metadata.uid.as_deref() != Some(uid) => {
                    "replaced by another Pod of the same name".to_string()
                }
                Ok(Some(pod)) if is_ready(&pod) => {
                    if dirs.shm.join(SHM_MARKER).is_file() {
                        return Ok(());
                    }
                    format!(
                        "Ready, but the daemon's /dev/shm is not the claim's tmpfs {} (no {SHM_MARKER} there)",
                        dirs.shm.display()
                    )
                }
                Ok(Some(pod)) => not_ready_reason(&pod),
                Ok(None) => "the Pod is gone".to_string(),
                Err(e) => format!("reading the Pod: {e}"),
            };
            if Instant::now() >= deadline {
                return Err(MpsError::NotReady {
                    claim: dirs.claim.clone(),
                    namespace: pods.api.namespace().to_string(),
                    pod: name.to_string(),
                    waited: READY_TIMEOUT,
                    detail: format!(
                        "{detail}; `kubectl logs -n {} {name}` says why",
                        pods.api.namespace()
                    ),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Whether the recorded daemon's Pod still runs and is Ready.
    pub async fn is_running(&self, record: &MpsDaemonRecord) -> bool {
        let Some(pods) = &self.pods else {
            return false;
        };
        matches!(pods.api.get(&record.pod).await,
            Ok(Some(pod)) if pod.metadata.uid.as_deref() == Some(record.pod_uid.as_str()) && is_ready(&pod))
    }

    /// Deletes this node's daemon Pods whose claims are not in `keep` and have no directory (a plugin
    /// that died between removing the two, or ran with another plugin directory). A Pod whose claim has
    /// a directory is left alone: that claim is kept or is being prepared.
    pub async fn sweep_pods(&self, keep: &BTreeSet<String>) -> Vec<String> {
        let Some(pods) = &self.pods else {
            return Vec::new();
        };
        let template = &pods.template;
        let list = match pods
            .api
            .on_node(pod::COMPONENT, &template.driver, &template.node)
            .await
        {
            Ok(list) => list,
            Err(e) => {
                warn!(error = %e, "listing this node's MPS daemon Pods failed; none deleted");
                return Vec::new();
            }
        };
        let mut cleaned = Vec::new();
        for pod in list {
            let Some(uid) = pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(pod::CLAIM_LABEL))
                .cloned()
            else {
                continue;
            };
            // A directory means the claim is kept, or being prepared now (this runs beside prepares).
            if keep.contains(&uid) || !is_plain_name(&uid) || self.root.join(&uid).exists() {
                continue;
            }
            match self.delete_pod(pods, &uid, None).await {
                Ok(()) => {
                    info!(claim = %uid, "MPS daemon Pod of a claim no longer prepared deleted");
                    cleaned.push(uid);
                }
                Err(e) => {
                    warn!(claim = %uid, error = %e, "MPS daemon Pod of a claim no longer prepared left in place")
                }
            }
        }
        cleaned
    }

    /// Deletes the claim's daemon Pod; with `wait`, until it is gone (the kubelet ended it).
    pub(super) async fn delete_pod(
        &self,
        pods: &DaemonPods,
        claim: &str,
        wait: Option<Duration>,
    ) -> Result<(), MpsError> {
        let name = DaemonPodTemplate::pod_name(claim);
        let begun = Instant::now();
        let deleted = pods
            .api
            .delete(&name)
            .await
            .map_err(|e| self.api_error(claim, &name, "deleting", e))?;
        match wait {
            Some(waited) if deleted => match pods.api.wait_gone(&name, begun + waited).await {
                Gone::Yes => Ok(()),
                Gone::StillThere => Err(MpsError::StillRunning {
                    claim: claim.to_string(),
                    namespace: pods.api.namespace().to_string(),
                    pod: name,
                    waited,
                }),
            },
            _ => Ok(()),
        }
    }

    fn api_error(&self, claim: &str, pod: &str, action: &'static str, e: kube::Error) -> MpsError {
        MpsError::Api {
            claim: claim.to_string(),
            namespace: self
                .pods
                .as_ref()
                .map(|p| p.api.namespace().to_string())
                .unwrap_or_default(),
            pod: pod.to_string(),
            action,
            source: Box::new(e),
        }
    }
}
