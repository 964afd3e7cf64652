//! The plugin's handle on this node's IMEX daemon: the directory of the domain it serves
//! (`<plugin-dir>/imex/<domainUID>/`) with the daemon's config, node config and peers, and its Pod,
//! created (one domain's at a time, and none beside the host's own IMEX service), asked whether it is
//! Ready (with the kubelet's and the daemon's reason when not) and deleted, through the daemon Pods'
//! API (`claims::daemon_pod`).

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::config::{
    render_config, render_nodes_config, render_peers, Peer, CONFIG_FILE, NODES_CONFIG_FILE,
    PEERS_FILE,
};
use super::host_service::host_imex_service;
use super::pod::COMPONENT;
use super::{
    check_domain_uid, DaemonState, ImexDaemonSpec, ImexError, ImexPodTemplate, ImexProgram,
    NOT_READY_FILE, READY_FILE,
};
use crate::claims::daemon_pod::api::{Gone, GONE_TIMEOUT, POLL};
use crate::claims::daemon_pod::{is_ready, not_ready_reason, DaemonPodApi};
use crate::domains::api::DOMAIN_LABEL;
use crate::fsutil::write_for_this_boot;

/// This node's IMEX daemon, of the one domain with channels prepared here.
#[derive(Debug, Clone)]
pub struct ImexDaemons {
    pods: DaemonPodApi,
    /// `<plugin-dir>/imex` as this process sees it.
    root: PathBuf,
    /// The same directory as the host (and so the daemon's Pod) sees it.
    host_root: PathBuf,
    /// Where this process sees the host's `/`, to tell whether the host runs NVIDIA's IMEX service;
    /// `None`: not looked at.
    host_system_root: Option<PathBuf>,
    template: ImexPodTemplate,
}

impl ImexDaemons {
    /// `root` is `<plugin-dir>/imex` as this process sees it; the host sees it at the same path unless
    /// [`with_host_root`](Self::with_host_root) says otherwise. The Pods go into the template's
    /// namespace.
    pub fn new(client: kube::Client, root: PathBuf, template: ImexPodTemplate) -> Self {
        Self {
            pods: DaemonPodApi::new(client, &template.pod.namespace),
            host_root: root.clone(),
            root,
            host_system_root: None,
            template,
        }
    }

    /// Where the host sees `root` (the hostPath of the daemons' Pods).
    pub fn with_host_root(mut self, host_root: PathBuf) -> Self {
        self.host_root = host_root;
        self
    }

    /// Where this process sees the host's whole filesystem (`/`): [`ensure`](Self::ensure) then
    /// refuses while the host runs NVIDIA's `nvidia-imex.service` (`host_service.rs`). Not the same as
    /// [`with_host_root`](Self::with_host_root), the host's path of `root`.
    pub fn with_host_system_root(mut self, host_system_root: PathBuf) -> Self {
        self.host_system_root = Some(host_system_root);
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The domain's directory as this process sees it.
    pub fn domain_dir(&self, domain_uid: &str) -> Result<PathBuf, ImexError> {
        check_domain_uid(domain_uid)?;
        Ok(self.root.join(domain_uid))
    }

    /// Writes the config, node config and peers files and creates the daemon's Pod when it is absent
    /// (after a Pod of the same domain still being deleted is gone); does not wait for it to be
    /// Ready. Refuses, creating nothing, while the host runs NVIDIA's IMEX service or a daemon of
    /// another domain (its Pod, even one being deleted) is on this node: a node runs one.
    pub async fn ensure(&self, spec: &ImexDaemonSpec) -> Result<(), ImexError> {
        let dir = self.domain_dir(&spec.domain_uid)?;
        if self.template.pod.program == ImexProgram::StandIn && !cfg!(feature = "doubles") {
            return Err(ImexError::NoStandIn {
                domain: spec.domain.clone(),
            });
        }
        if let Some(reason) = self.host_system_root.as_deref().and_then(host_imex_service) {
            return Err(ImexError::HostService {
                domain: spec.domain.clone(),
                reason,
            });
        }
        let host_dir = self.host_root.join(&spec.domain_uid);
        let peers = render_peers(&spec.peers).map_err(|source| ImexError::Config {
            domain: spec.domain.clone(),
            source,
        })?;
        let config = render_config(&spec.domain, &self.template.nodes_config_path(&host_dir));
        self.refuse_other_domain(spec).await?;
        let io = |action, path: &Path| {
            let (domain, path) = (spec.domain.clone(), path.to_path_buf());
            move |source| ImexError::Io {
                domain,
                action,
                path,
                source,
            }
        };
        for dir in [&self.root, &dir] {
            fs::create_dir_all(dir).map_err(io("creating", dir))?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o755))
                .map_err(io("setting the mode of", dir))?;
        }
        let files = [
            (NODES_CONFIG_FILE, &render_nodes_config()),
            (PEERS_FILE, &peers),
            (CONFIG_FILE, &config),
        ];
        for (name, text) in files {
            let path = dir.join(name);
            write_if_changed(&path, text).map_err(io("writing", &path))?;
        }
        let name = self.template.pod_name(&spec.domain_uid);
        match self.pods.get(&name).await {
            Ok(Some(pod)) if pod.metadata.deletion_timestamp.is_none() => return Ok(()),
            // A Pod of a stop that has not finished: its successor takes its name once it is gone.
            Ok(Some(_)) => self.wait_gone(&spec.domain, &name).await?,
            Ok(None) => {}
            Err(e) => return Err(self.api_error(&spec.domain, &name, "reading", e)),
        }
        let pod = self.template.pod(spec, &host_dir)?;
        match self.pods.create(&pod).await {
            Ok(_) => {
                info!(domain = %spec.domain, domain_uid = %spec.domain_uid, pod = %name, "IMEX daemon Pod created");
                Ok(())
            }
            // Another ensure of the same domain created it first.
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
            Err(e) => Err(self.api_error(&spec.domain, &name, "creating", e)),
        }
    }

    /// Rewrites the domain's peers file when the peers changed (atomically: a temporary file, then
    /// a rename); the daemon's supervisor puts them into the daemon's hosts file and sends it
    /// SIGUSR1. Returns whether they changed.
    pub fn set_peers(&self, domain_uid: &str, peers: &[Peer]) -> Result<bool, ImexError> {
        let dir = self.domain_dir(domain_uid)?;
        let text = render_peers(peers).map_err(|source| ImexError::Config {
            domain: domain_uid.to_string(),
            source,
        })?;
        let path = dir.join(PEERS_FILE);
        let io = |action| {
            let path = path.clone();
            move |source| ImexError::Io {
                domain: domain_uid.to_string(),
                action,
                path,
                source,
            }
        };
        if !dir.is_dir() {
            return Err(io("writing")(io::Error::new(
                io::ErrorKind::NotFound,
                "the domain has no daemon on this node (ensure it first)",
            )));
        }
        let changed = write_if_changed(&path, &text).map_err(io("writing"))?;
        if changed {
            info!(domain_uid, peers = %text.trim().replace('\n', ", "), "IMEX daemon peers changed");
        }
        Ok(changed)
    }

    /// Ready when the daemon's Pod is Ready and its supervisor's ready file exists; otherwise why
    /// not, in the kubelet's words (waiting reason, last exit) and the supervisor's.
    pub async fn state(&self, domain_uid: &str) -> DaemonState {
        let dir = match self.domain_dir(domain_uid) {
            Ok(dir) => dir,
            Err(e) => {
                return DaemonState::NotReady {
                    reason: e.to_string(),
                }
            }
        };
        let name = self.template.pod_name(domain_uid);
        let pod_name = format!("Pod {}/{name}", self.pods.namespace());
        let pod_reason = match self.pods.get(&name).await {
            Ok(Some(pod)) if pod.metadata.deletion_timestamp.is_some() => {
                format!("{pod_name} is being deleted")
            }
            Ok(Some(pod)) if is_ready(&pod) && dir.join(READY_FILE).is_file() => {
                return DaemonState::Ready
            }
            Ok(Some(pod)) if is_ready(&pod) => format!(
                "{pod_name} is Ready, its daemon no longer (the readiness probe has yet to see it)"
            ),
            Ok(Some(pod)) => format!("{pod_name}: {}", not_ready_reason(&pod)),
            Ok(None) => format!("no daemon Pod {}/{name}", self.pods.namespace()),
            Err(e) => format!("reading {pod_name}: {e}"),
        };
        let daemon_reason = fs::read_to_string(dir.join(NOT_READY_FILE))
            .map(|text| text.trim().to_string())
            .unwrap_or_default();
        let reason = if daemon_reason.is_empty() {
            pod_reason
        } else {
            format!("{pod_reason}; daemon: {daemon_reason}")
        };
        DaemonState::NotReady { reason }
    }

    /// Waits up to `timeout` for the daemon to be Ready; returns the last state seen.
    pub async fn wait_ready(&self, domain_uid: &str, timeout: Duration) -> DaemonState {
        let deadline = Instant::now() + timeout;
        loop {
            let state = self.state(domain_uid).await;
            if state == DaemonState::Ready || Instant::now() >= deadline {
                return state;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Deletes the daemon's Pod, waits until it is gone (bounded), then removes the domain's
    /// directory. A Pod or directory already gone is fine; so is a repeat.
    pub async fn stop(&self, domain_uid: &str) -> Result<(), ImexError> {
        let dir = self.domain_dir(domain_uid)?;
        let name = self.template.pod_name(domain_uid);
        match self.pods.delete(&name).await {
            Ok(true) => self.wait_gone(domain_uid, &name).await?,
            Ok(false) => {}
            Err(e) => return Err(self.api_error(domain_uid, &name, "deleting", e)),
        }
        match fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(ImexError::Io {
                domain: domain_uid.to_string(),
                action: "removing",
                path: dir,
                source: e,
            }),
            _ => {
                info!(domain_uid, pod = %name, "IMEX daemon stopped");
                Ok(())
            }
        }
    }

    /// The domain UIDs whose daemon Pods this plugin runs on this node (for the sweep at start).
    /// A failed list is logged and reads as none.
    pub async fn on_this_node(&self) -> Vec<String> {
        let pods = match self.on_this_node_pods().await {
            Ok(pods) => pods,
            Err(e) => {
                warn!(error = %e, "listing this node's IMEX daemon Pods failed");
                return Vec::new();
            }
        };
        let mut uids: Vec<String> = pods
            .iter()
            .filter_map(|pod| pod.metadata.labels.as_ref()?.get(DOMAIN_LABEL).cloned())
            .filter(|uid| check_domain_uid(uid).is_ok())
            .collect();
        uids.sort();
        uids.dedup();
        uids
    }

    /// Fails when a daemon Pod of another domain than `spec`'s is on this node, being deleted or not.
    async fn refuse_other_domain(&self, spec: &ImexDaemonSpec) -> Result<(), ImexError> {
        let pods = self.on_this_node_pods().await.map_err(|e| {
            self.api_error(
                &spec.domain,
                &self.template.pod_name(&spec.domain_uid),
                "listing this node's IMEX daemon Pods before creating it",
                e,
            )
        })?;
        let other = pods.iter().find_map(|pod| {
            let uid = pod.metadata.labels.as_ref()?.get(DOMAIN_LABEL)?;
            (*uid != spec.domain_uid).then(|| (uid.clone(), pod))
        });
        match other {
            None => Ok(()),
            Some((other_uid, pod)) => Err(ImexError::OtherDomainRunning {
                domain: spec.domain.clone(),
                other_uid: crate::claims::names::truncated(&other_uid),
                namespace: self.pods.namespace().to_string(),
                pod: pod.metadata.name.clone().unwrap_or_default(),
                terminating: pod.metadata.deletion_timestamp.is_some(),
            }),
        }
    }

    /// This node's IMEX daemon Pods of this driver, being deleted or not.
    async fn on_this_node_pods(&self) -> Result<Vec<k8s_openapi::api::core::v1::Pod>, kube::Error> {
        self.pods
            .on_node(
                COMPONENT,
                &self.template.pod.driver,
                &self.template.pod.node,
            )
            .await
    }

    async fn wait_gone(&self, domain: &str, name: &str) -> Result<(), ImexError> {
        match self
            .pods
            .wait_gone(name, Instant::now() + GONE_TIMEOUT)
            .await
        {
            Gone::Yes => Ok(()),
            Gone::StillThere => Err(ImexError::StillRunning {
                domain: domain.to_string(),
                namespace: self.pods.namespace().to_string(),
                pod: name.to_string(),
                waited: GONE_TIMEOUT,
            }),
        }
    }

    fn api_error(
        &self,
        domain: &str,
        pod: &str,
        action: &'static str,
        e: kube::Error,
    ) -> ImexError {
        ImexError::Api {
            domain: domain.to_string(),
            namespace: self.pods.namespace().to_string(),
            pod: pod.to_string(),
            action,
            source: Box::new(e),
        }
    }
}

/// Replaces `path` with `text` unless it holds it already; whether it wrote.
fn write_if_changed(path: &Path, text: &str) -> io::Result<bool> {
    if fs::read_to_string(path).ok().as_deref() == Some(text) {
        return Ok(false);
    }
    write_for_this_boot(path, text.as_bytes(), 0o644)?;
    Ok(true)
}

/// The plugin's membership code drives the daemons through this trait (a stand-in in its unit tests).
impl crate::domains::membership::DomainDaemons for ImexDaemons {
    fn ensure<'a>(
        &'a self,
        spec: &'a crate::domains::membership::DaemonSpec,
    ) -> futures::future::BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let spec = ImexDaemonSpec {
                domain_uid: spec.domain_uid.clone(),
                domain: spec.domain.clone(),
                peers: spec.peers.clone(),
            };
            ImexDaemons::ensure(self, &spec)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn set_peers(&self, domain_uid: &str, peers: &[Peer]) -> Result<bool, String> {
        ImexDaemons::set_peers(self, domain_uid, peers).map_err(|e| e.to_string())
    }

    fn state<'a>(
        &'a self,
        domain_uid: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            match ImexDaemons::state(self, domain_uid).await {
                DaemonState::Ready => Ok(()),
                DaemonState::NotReady { reason } => Err(reason),
            }
        })
    }

    fn stop<'a>(
        &'a self,
        domain_uid: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            ImexDaemons::stop(self, domain_uid)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn running(&self) -> futures::future::BoxFuture<'_, Vec<String>> {
        Box::pin(self.on_this_node())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_rewritten_only_when_their_content_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(PEERS_FILE);
        let one = "10.0.0.1\tcompute-domain-daemon-0000\n";
        let two = format!("{one}10.0.0.2\tcompute-domain-daemon-0001\n");
        assert!(write_if_changed(&path, one).unwrap());
        assert!(!write_if_changed(&path, one).unwrap());
        assert!(write_if_changed(&path, &two).unwrap());
        assert_eq!(fs::read_to_string(&path).unwrap(), two);
    }
}
