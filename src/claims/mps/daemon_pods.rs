//! The daemons' Pods through the API server (`claims::daemon_pod::api`): created for a claim and
//! waited on until Ready (with the kubelet's reason when they are not), all within one start budget;
//! deleted and waited on until gone; this node's Pods listed for claims that are no longer prepared.

use std::collections::BTreeSet;
use std::future::Future;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::dirs::ClaimDirs;
use super::{
    is_plain_name, pod, shm, DaemonPodTemplate, MpsDaemonRecord, MpsDaemonSpec, MpsDaemons,
    MpsError, SHM_MARKER,
};
use crate::claims::daemon_pod::api::{Gone, POLL};
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

/// `future`, unless `deadline` comes first.
async fn before<T>(deadline: Instant, future: impl Future<Output = T>) -> Option<T> {
    let left = deadline.saturating_duration_since(Instant::now());
    tokio::time::timeout(left, future).await.ok()
}

/// Where a start is: its deadline and budget, for the errors that say it ran out.
struct Start<'a> {
    pods: &'a DaemonPods,
    dirs: &'a ClaimDirs,
    name: String,
    begun: Instant,
    budget: Duration,
}

impl Start<'_> {
    fn deadline(&self) -> Instant {
        self.begun + self.budget
    }

    fn ran_out(&self, waiting_for: &str) -> MpsError {
        MpsError::StartTimedOut {
            claim: self.dirs.claim.clone(),
            namespace: self.pods.api.namespace().to_string(),
            pod: self.name.clone(),
            budget: self.budget,
            waiting_for: waiting_for.to_string(),
        }
    }
}

impl MpsDaemons {
    /// Makes the claim's tmpfs and Pod and waits until the daemon is Ready; a Pod of an earlier
    /// attempt goes first. All of it within `budget`.
    pub(super) async fn launch(
        &self,
        pods: &DaemonPods,
        dirs: &ClaimDirs,
        spec: &MpsDaemonSpec,
        budget: Duration,
    ) -> Result<MpsDaemonRecord, MpsError> {
        let start = Start {
            pods,
            dirs,
            name: DaemonPodTemplate::pod_name(&dirs.claim),
            begun: Instant::now(),
            budget,
        };
        let shm_size = self.shm_size_for(spec)?;
        self.prepare_dirs(dirs)?;
        shm::mount_tmpfs(&dirs.shm, shm_size).map_err(|source| MpsError::Shm {
            claim: dirs.claim.clone(),
            path: dirs.shm.clone(),
            source,
        })?;
        crate::claims::lifecycle::reached(&dirs.claim, crate::claims::Step::TmpfsMount).await;
        let spec = MpsDaemonSpec {
            shm_size_bytes: Some(shm_size),
            ..spec.clone()
        };
        let pod = pods
            .template
            .pod(&spec, &self.host_root.join(&dirs.claim))?;
        // A Pod of an earlier attempt (or an earlier boot) may hold other devices or a dead mount.
        let deleted = before(start.deadline(), pods.api.delete(&start.name))
            .await
            .ok_or_else(|| start.ran_out("the API server to delete the Pod of an earlier attempt"))?
            .map_err(|e| self.api_error(&dirs.claim, &start.name, "deleting", e))?;
        if deleted && pods.api.wait_gone(&start.name, start.deadline()).await == Gone::StillThere {
            return Err(start.ran_out(
                "the Pod of an earlier attempt to go (it was deleted, and is still there)",
            ));
        }
        let created = before(start.deadline(), pods.api.create(&pod))
            .await
            .ok_or_else(|| start.ran_out("the API server to create the Pod"))?
            .map_err(|e| self.api_error(&dirs.claim, &start.name, "creating", e))?;
        let uid = created.metadata.uid.clone().unwrap_or_default();
        crate::claims::lifecycle::reached(&dirs.claim, crate::claims::Step::DaemonPodStart).await;
        self.wait_ready(&start, &uid).await?;
        Ok(MpsDaemonRecord {
            pod_uid: uid,
            ..self.planned(&spec)?
        })
    }

    /// Waits until the Pod (this UID) is Ready and its daemon wrote the marker into the claim's
    /// tmpfs, or the start's deadline.
    async fn wait_ready(&self, start: &Start<'_>, uid: &str) -> Result<(), MpsError> {
        let (pods, dirs, name) = (start.pods, start.dirs, &start.name);
        // What the last answer said: a read cut short by the deadline says nothing new.
        let mut detail = "the API server did not answer".to_string();
        loop {
            detail = match before(start.deadline(), pods.api.get(name)).await {
                None => detail,
                Some(Ok(Some(pod))) if pod.metadata.uid.as_deref() != Some(uid) => {
                    "replaced by another Pod of the same name".to_string()
                }
                Some(Ok(Some(pod))) if is_ready(&pod) => {
                    if dirs.shm.join(SHM_MARKER).is_file() {
                        return Ok(());
                    }
                    format!(
                        "Ready, but the daemon's /dev/shm is not the claim's tmpfs {} (no {SHM_MARKER} there)",
                        dirs.shm.display()
                    )
                }
                Some(Ok(Some(pod))) => not_ready_reason(&pod),
                Some(Ok(None)) => "the Pod is gone".to_string(),
                Some(Err(e)) => format!("reading the Pod: {e}"),
            };
            if Instant::now() >= start.deadline() {
                return Err(MpsError::NotReady {
                    claim: dirs.claim.clone(),
                    namespace: pods.api.namespace().to_string(),
                    pod: name.clone(),
                    waited: start.budget,
                    detail: format!(
                        "{detail}; `kubectl logs -n {} {name}` says why",
                        pods.api.namespace()
                    ),
                });
            }
            tokio::time::sleep(
                POLL.min(start.deadline().saturating_duration_since(Instant::now())),
            )
            .await;
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
