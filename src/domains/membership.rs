//! The kubelet plugin's side of ComputeDomains: this node joining a domain when the first claim for
//! one of the domain's channels is prepared here, and leaving when the last is unprepared.
//!
//! Joining writes this node's entry into the domain's `status.nodes` (address, clique, index,
//! readiness), starts the domain's IMEX daemon here with the addresses of every node that joined as
//! its peers, and waits (bounded) until it is ready: a prepare that finds it not ready fails for that
//! claim with the daemon's reason, and the kubelet retries. While members are here, a loop keeps the
//! peers in step with the domain's status and reports what goes wrong (a daemon that stops being
//! ready, a node that leaves the domain's clique) as a taint on the domain's channel device, an Event
//! on the domain and this node's entry in its status.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, DynamicObject, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tracing::{info, warn};

use super::api::{
    ComputeDomainNode, ComputeDomainPlacement, DomainGroup, DomainObject, NOT_READY, READY,
};
pub use super::imex::config::Peer;

/// How long a prepare waits for the domain's daemon on this node: inside the kubelet's 45 s.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
const POLL: Duration = Duration::from_millis(250);
/// How often the members' daemons and peers are looked at.
pub const SYNC_PERIOD: Duration = Duration::from_secs(2);
/// Conflicting writers of one domain's status (every member node and the controller: 18 trays of a
/// clique joining at once) retry after a delay that doubles from the first to the longest, each drawn
/// at random from its upper half so that the writers spread out, for at most this long in all: well
/// inside the kubelet's 45 s for a prepare.
const CONFLICT_FIRST_DELAY: Duration = Duration::from_millis(20);
const CONFLICT_LONGEST_DELAY: Duration = Duration::from_secs(1);
const CONFLICT_RETRY_FOR: Duration = Duration::from_secs(15);

/// How a write of this node's status entry treats an entry that is not there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EntryWrite {
    /// Join: add it when missing.
    Upsert,
    /// Report health: change it only if it is there, so a node that left while a sync ran is not
    /// added back.
    UpdateOnly,
    /// Leave: remove it.
    Remove,
}

/// Who runs the node's IMEX daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ImexMode {
    /// The plugin, in a Pod of its own (NVIDIA's `driverManaged`).
    #[default]
    Plugin,
    /// The host, as `nvidia-imex.service`; the plugin asks it and starts nothing (NVIDIA's
    /// `hostManaged`).
    Host,
}

/// The plugin's settings for ComputeDomains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainsConfig {
    /// How many IMEX channel devices a node of an NVLink clique publishes (1, or 0 for none).
    pub imex_channels: u32,
    /// The address other nodes' IMEX daemons reach this node's at (the Pod's `status.hostIP`).
    pub node_ip: Option<String>,
    pub imex_mode: ImexMode,
    /// With [`ImexMode::Host`]: the host daemon's command socket (its path on the host).
    pub host_socket: std::path::PathBuf,
    /// With [`ImexMode::Host`]: a program to ask instead of the driver root's `nvidia-imex-ctl`.
    pub host_ctl: Option<std::path::PathBuf>,
}

impl Default for DomainsConfig {
    fn default() -> Self {
        DomainsConfig {
            imex_channels: super::channels::DEFAULT_CHANNELS,
            node_ip: None,
            imex_mode: ImexMode::Plugin,
            host_socket: super::imex::host_managed::DEFAULT_SOCKET.into(),
            host_ctl: None,
        }
    }
}

/// A prepared claim's channel, as the checkpoint keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChannelMembership {
    pub domain_uid: String,
    pub namespace: String,
    /// The domain's name, found by its UID when the claim was prepared.
    pub domain: String,
    /// `nvidia` for NVIDIA's group, absent for ours.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nvidia_group: bool,
    pub channel: u32,
    /// The clique the channel was published in.
    pub clique: String,
}

impl ChannelMembership {
    fn group(&self) -> DomainGroup {
        if self.nvidia_group {
            DomainGroup::Nvidia
        } else {
            DomainGroup::Ours
        }
    }

    fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.domain)
    }
}

/// What the daemon of one domain on this node is started with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonSpec {
    pub domain_uid: String,
    /// `namespace/name`, for messages.
    pub domain: String,
    /// Every joined node of the clique, this node included: its index and address.
    pub peers: Vec<Peer>,
}

/// The IMEX daemons of this node, one per domain (`imex::ImexDaemons` on a node; a stand-in in unit
/// tests). Errors are sentences for people.
pub trait DomainDaemons: Send + Sync {
    /// Writes the daemon's configuration and starts it where it does not run; does not wait.
    fn ensure<'a>(&'a self, spec: &'a DaemonSpec) -> BoxFuture<'a, Result<(), String>>;
    /// Gives a running daemon new peers; whether they changed.
    fn set_peers(&self, domain_uid: &str, peers: &[Peer]) -> Result<bool, String>;
    /// `Ok` when the daemon is ready, else why not.
    fn state<'a>(&'a self, domain_uid: &'a str) -> BoxFuture<'a, Result<(), String>>;
    /// Stops the daemon and removes what it had on the node; succeeds when there was none.
    fn stop<'a>(&'a self, domain_uid: &'a str) -> BoxFuture<'a, Result<(), String>>;
    /// Domains whose daemons run on this node.
    fn running(&self) -> BoxFuture<'_, Vec<String>>;
}

/// What went wrong with one domain on this node, as last reported.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Health {
    Ready,
    /// The daemon is not ready; why.
    NotReady(String),
    /// The node's GPUs are no longer in the domain's clique; how.
    LeftClique(String),
}

/// The values of the taint a channel gets when its domain is not ready on this node.
pub const TAINT_NOT_READY: &str = "NotReady";
pub const TAINT_LEFT_CLIQUE: &str = "LeftClique";

pub struct Membership {
    client: kube::Client,
    node: String,
    /// This node's address for its domains' peers: given (`--node-ip`), else the Node's InternalIP,
    /// read at the first join (never at start, where the API server may be slow).
    node_ip: Mutex<Option<String>>,
    daemons: Arc<dyn DomainDaemons>,
    ready_timeout: Duration,
    reporter: Reporter,
    /// Channel device → the value of its taint ([`TAINT_NOT_READY`], [`TAINT_LEFT_CLIQUE`]), for the
    /// slices; the reason is in the domain's status and Event.
    taints: watch::Sender<BTreeMap<String, &'static str>>,
    /// Per domain UID, what was last reported, so Events go out on changes only.
    reported: Mutex<BTreeMap<String, Health>>,
    /// Per domain UID, when a prepare last tried to join it: a daemon still starting for a claim the
    /// kubelet retries is not swept.
    attempts: Mutex<BTreeMap<String, Instant>>,
    /// Per domain UID, when its daemon was first seen not ready since it was last ready.
    not_ready_since: Mutex<BTreeMap<String, Instant>>,
}

impl Membership {
    pub fn new(
        client: kube::Client,
        driver: &str,
        node: &str,
        node_ip: Option<&str>,
        daemons: Arc<dyn DomainDaemons>,
    ) -> Self {
        Membership {
            client,
            node: node.to_string(),
            node_ip: Mutex::new(node_ip.map(str::to_string)),
            daemons,
            ready_timeout: READY_TIMEOUT,
            reporter: Reporter {
                controller: driver.to_string(),
                instance: Some(node.to_string()),
            },
            taints: watch::channel(BTreeMap::new()).0,
            reported: Mutex::new(BTreeMap::new()),
            attempts: Mutex::new(BTreeMap::new()),
            not_ready_since: Mutex::new(BTreeMap::new()),
        }
    }

    /// Whether the daemon of `domain_uid` has been not ready for less than a sync period (and notes
    /// when it was first seen so).
    fn first_not_ready(&self, domain_uid: &str) -> bool {
        let mut since = lock(&self.not_ready_since);
        let first = since
            .entry(domain_uid.to_string())
            .or_insert_with(Instant::now);
        first.elapsed() < SYNC_PERIOD
    }

    /// Whether a prepare tried to join a domain that no prepared claim holds: then a sweep may have a
    /// daemon to stop (an idle node sends the API server nothing).
    pub fn has_unheld_attempts(&self, held: &BTreeSet<String>) -> bool {
        lock(&self.attempts).keys().any(|uid| !held.contains(uid))
    }

    /// A prepare is about to join this domain.
    pub fn note_attempt(&self, domain_uid: &str) {
        lock(&self.attempts).insert(domain_uid.to_string(), Instant::now());
    }

    /// This node's address: the one given, else its Node's InternalIP (remembered once read).
    async fn address(&self) -> Result<String, String> {
        if let Some(ip) = lock(&self.node_ip).clone() {
            return Ok(ip);
        }
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.client.clone());
        let node = nodes
            .get(&self.node)
            .await
            .map_err(|e| format!("reading Node {} for its address: {e}", self.node))?;
        let ip = node
            .status
            .and_then(|s| s.addresses)
            .into_iter()
            .flatten()
            .find(|a| a.type_ == "InternalIP")
            .map(|a| a.address)
            .ok_or_else(|| {
                format!(
                    "this node's address is not known: Node {} has no InternalIP and --node-ip (NODE_IP; the DaemonSet sets status.hostIP) is not set",
                    self.node
                )
            })?;
        *lock(&self.node_ip) = Some(ip.clone());
        Ok(ip)
    }

    /// For tests: a shorter wait for the daemon.
    pub fn with_ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// The channel devices to taint and why; the monitor puts them into the slices.
    pub fn taints(&self) -> watch::Receiver<BTreeMap<String, &'static str>> {
        self.taints.subscribe()
    }

    /// Finds the domain a channel config names (by UID, in the claim's namespace: a claim joins only a
    /// domain of its own namespace), and checks that this node is in the clique the controller placed
    /// the domain on.
    pub async fn resolve(
        &self,
        groups: &[DomainGroup],
        namespace: &str,
        domain_uid: &str,
        channel: u32,
        clique: &str,
    ) -> Result<ChannelMembership, String> {
        let mut found = None;
        for &group in groups {
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), namespace, &group.api_resource());
            let list = match api.list(&Default::default()).await {
                Ok(list) => list,
                // NVIDIA's CRD may not be installed.
                Err(kube::Error::Api(e)) if e.code == 404 => continue,
                Err(e) => return Err(format!("listing ComputeDomains in {namespace}: {e}")),
            };
            if let Some(object) = list
                .items
                .iter()
                .find(|o| o.metadata.uid.as_deref() == Some(domain_uid))
            {
                found = Some(DomainObject::from_dynamic(group, object)?);
                break;
            }
        }
        let domain = found.ok_or_else(|| {
            format!("no ComputeDomain with UID {domain_uid} in namespace {namespace} (deleted?)")
        })?;
        if domain.deleting {
            return Err(format!("ComputeDomain {} is being deleted", domain.key()));
        }
        // Where the domain may run is what the controller wrote, in an object only it writes; nothing in
        // the domain itself (its namespace's users write that) is trusted for it.
        let placements: Api<ComputeDomainPlacement> = Api::all(self.client.clone());
        let placement = placements
            .get_opt(&domain.uid)
            .await
            .map_err(|e| format!("reading the placement of ComputeDomain {}: {e}", domain.key()))?
            .filter(|p| p.is_for(&domain))
            .ok_or_else(|| {
                format!(
                    "ComputeDomain {} is not placed on an NVLink clique yet (no ComputeDomainPlacement {} written by the controller)",
                    domain.key(),
                    domain.uid
                )
            })?;
        if placement.spec.clique != clique {
            return Err(format!(
                "ComputeDomain {} is placed on NVLink clique {}, but this node's channel is in clique {clique}",
                domain.key(),
                placement.spec.clique
            ));
        }
        Ok(ChannelMembership {
            domain_uid: domain.uid,
            namespace: domain.namespace,
            domain: domain.name,
            nvidia_group: domain.group == DomainGroup::Nvidia,
            channel,
            clique: clique.to_string(),
        })
    }

    /// Joins the domain on this node: status entry, daemon, and a bounded wait until it is ready.
    /// An error is the reason the claim cannot be prepared yet.
    pub async fn join(&self, member: &ChannelMembership) -> Result<(), String> {
        let ip = self.address().await?;
        let entry = |status: &str, reason: Option<String>| ComputeDomainNode {
            name: self.node.clone(),
            ip_address: ip.clone(),
            clique_id: member.clique.clone(),
            index: 0,
            status: status.to_string(),
            reason,
        };
        let nodes = self
            .set_entry(
                member,
                EntryWrite::Upsert,
                Some(entry(NOT_READY, Some("IMEX daemon starting".into()))),
            )
            .await?;
        let spec = DaemonSpec {
            domain_uid: member.domain_uid.clone(),
            domain: member.key(),
            peers: peers_of(&nodes, &member.clique),
        };
        self.daemons.ensure(&spec).await?;
        let deadline = Instant::now() + self.ready_timeout;
        let state = loop {
            let state = self.daemons.state(&member.domain_uid).await;
            if state.is_ok() || Instant::now() >= deadline {
                break state;
            }
            tokio::time::sleep(POLL).await;
        };
        match state {
            Ok(()) => {
                self.set_entry(member, EntryWrite::Upsert, Some(entry(READY, None)))
                    .await?;
                self.note(member, Health::Ready).await;
                info!(domain = %member.key(), channel = member.channel, "joined ComputeDomain");
                Ok(())
            }
            Err(reason) => {
                self.set_entry(
                    member,
                    EntryWrite::Upsert,
                    Some(entry(NOT_READY, Some(reason.clone()))),
                )
                .await?;
                Err(format!(
                    "the IMEX daemon of ComputeDomain {} on node {} is not ready after {:?}: {reason}",
                    member.key(),
                    self.node,
                    self.ready_timeout
                ))
            }
        }
    }

    /// Leaves the domain on this node (its last claim here was unprepared): stops the daemon, then
    /// removes this node's entry. Succeeds when the domain is gone.
    pub async fn leave(&self, member: &ChannelMembership) -> Result<(), String> {
        self.daemons.stop(&member.domain_uid).await?;
        self.set_entry(member, EntryWrite::Remove, None).await?;
        self.taints.send_modify(|taints| {
            taints.remove(&super::channels::device_name(member.channel));
        });
        lock(&self.reported).remove(&member.domain_uid);
        lock(&self.attempts).remove(&member.domain_uid);
        info!(domain = %member.key(), "left ComputeDomain");
        Ok(())
    }

    /// One look at every domain with members here: peers in step with the status, the daemon's
    /// readiness and this node's clique reported. `clique` is the node's clique now (`Err`: none).
    pub async fn sync(&self, members: &[ChannelMembership], clique: &Result<String, String>) {
        let mut seen = BTreeSet::new();
        for member in members {
            if !seen.insert(member.domain_uid.clone()) {
                continue;
            }
            let nodes = match self.domain_status(member).await {
                Ok(Some(nodes)) => nodes,
                // Gone: its claims are unprepared next.
                Ok(None) => continue,
                Err(error) => {
                    warn!(domain = %member.key(), %error, "reading ComputeDomain status");
                    continue;
                }
            };
            match self
                .daemons
                .set_peers(&member.domain_uid, &peers_of(&nodes, &member.clique))
            {
                Ok(true) => info!(domain = %member.key(), "IMEX daemon peers changed"),
                Ok(false) => {}
                Err(error) => warn!(domain = %member.key(), %error, "updating IMEX daemon peers"),
            }
            let health = match clique {
                Ok(now) if *now == member.clique => {
                    match self.daemons.state(&member.domain_uid).await {
                        Ok(()) => {
                            lock(&self.not_ready_since).remove(&member.domain_uid);
                            Health::Ready
                        }
                        // A blip (the daemon reconnecting to its peers) is not reported: only a
                        // state that outlasts one sync period is.
                        Err(_) if self.first_not_ready(&member.domain_uid) => continue,
                        Err(reason) => Health::NotReady(format!("IMEX daemon not ready: {reason}")),
                    }
                }
                Ok(now) => Health::LeftClique(format!(
                    "node {} left NVLink clique {} (now in {now})",
                    self.node, member.clique
                )),
                Err(why) => Health::LeftClique(format!(
                    "node {} left NVLink clique {}: {why}",
                    self.node, member.clique
                )),
            };
            self.note(member, health).await;
        }
    }

    /// Records a change of one domain's health on this node: taint, status entry and Event.
    async fn note(&self, member: &ChannelMembership, health: Health) {
        let changed = {
            let mut reported = lock(&self.reported);
            reported.insert(member.domain_uid.clone(), health.clone()) != Some(health.clone())
        };
        if !changed {
            return;
        }
        let device = super::channels::device_name(member.channel);
        let (status, reason, taint, event_type, event_reason) = match &health {
            Health::Ready => (READY, None, None, EventType::Normal, "IMEXDaemonReady"),
            Health::NotReady(reason) => (
                NOT_READY,
                Some(reason.clone()),
                Some(TAINT_NOT_READY),
                EventType::Warning,
                "IMEXDaemonNotReady",
            ),
            Health::LeftClique(reason) => (
                NOT_READY,
                Some(reason.clone()),
                Some(TAINT_LEFT_CLIQUE),
                EventType::Warning,
                "IMEXDaemonNotReady",
            ),
        };
        self.taints.send_modify(|taints| match taint {
            Some(value) => {
                taints.insert(device.clone(), value);
            }
            None => {
                taints.remove(&device);
            }
        });
        let entry = ComputeDomainNode {
            name: self.node.clone(),
            ip_address: lock(&self.node_ip).clone().unwrap_or_default(),
            clique_id: member.clique.clone(),
            index: 0,
            status: status.to_string(),
            reason: reason.clone(),
        };
        if let Err(error) = self
            .set_entry(member, EntryWrite::UpdateOnly, Some(entry))
            .await
        {
            warn!(domain = %member.key(), %error, "writing this node's ComputeDomain status");
        }
        let note = match &reason {
            Some(reason) => format!("node {}: {reason}", self.node),
            None => format!("node {}: IMEX daemon ready", self.node),
        };
        self.event(member, event_type, event_reason, &note).await;
        match reason {
            Some(reason) => {
                warn!(domain = %member.key(), %reason, "ComputeDomain not ready on this node")
            }
            None => info!(domain = %member.key(), "ComputeDomain ready on this node"),
        }
    }

    async fn event(&self, member: &ChannelMembership, type_: EventType, reason: &str, note: &str) {
        let resource = member.group().api_resource();
        let reference = ObjectReference {
            api_version: Some(resource.api_version),
            kind: Some(resource.kind),
            name: Some(member.domain.clone()),
            namespace: Some(member.namespace.clone()),
            uid: Some(member.domain_uid.clone()),
            ..Default::default()
        };
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        let event = Event {
            type_,
            reason: reason.to_string(),
            note: Some(note.chars().take(1024).collect()),
            action: "IMEXDaemon".into(),
            secondary: None,
        };
        let publish = recorder.publish(&event, &reference);
        match tokio::time::timeout(Duration::from_secs(5), publish).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => warn!(%error, "recording a ComputeDomain Event"),
            Err(_) => warn!("recording a ComputeDomain Event timed out"),
        }
    }

    /// The domain's `status.nodes`; `None` when the domain is gone.
    async fn domain_status(
        &self,
        member: &ChannelMembership,
    ) -> Result<Option<Vec<ComputeDomainNode>>, String> {
        let api = self.api(member);
        match api.get_opt(&member.domain).await {
            Ok(Some(object)) if object.metadata.uid.as_deref() == Some(&member.domain_uid) => {
                Ok(Some(
                    DomainObject::from_dynamic(member.group(), &object)?
                        .status
                        .nodes,
                ))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    fn api(&self, member: &ChannelMembership) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            &member.namespace,
            &member.group().api_resource(),
        )
    }

    /// Sets (or with `None` removes) this node's entry in the domain's status, keeping its index;
    /// retried on conflicts with the other writers, with backoff and jitter. Returns the entries after
    /// the write (empty when the domain is gone).
    async fn set_entry(
        &self,
        member: &ChannelMembership,
        write: EntryWrite,
        entry: Option<ComputeDomainNode>,
    ) -> Result<Vec<ComputeDomainNode>, String> {
        let api = self.api(member);
        let started = Instant::now();
        let mut delay = CONFLICT_FIRST_DELAY;
        let mut conflicts = 0;
        loop {
            let object = match api.get_opt(&member.domain).await {
                Ok(Some(object)) if object.metadata.uid.as_deref() == Some(&member.domain_uid) => {
                    object
                }
                Ok(_) => return Ok(Vec::new()),
                Err(e) => return Err(format!("reading ComputeDomain {}: {e}", member.key())),
            };
            let domain = DomainObject::from_dynamic(member.group(), &object)?;
            let mut status = domain.status.clone();
            let before = status.nodes.clone();
            let present = before.iter().any(|n| n.name == self.node);
            if write == EntryWrite::UpdateOnly && !present {
                return Ok(before);
            }
            upsert(&mut status.nodes, &self.node, entry.clone());
            if status.nodes == before {
                return Ok(status.nodes);
            }
            let mut updated = object.clone();
            updated.data["status"] = serde_json::to_value(&status).map_err(|e| e.to_string())?;
            match api
                .replace_status(&member.domain, &PostParams::default(), &updated)
                .await
            {
                Ok(_) => return Ok(status.nodes),
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    conflicts += 1;
                    if started.elapsed() + delay > CONFLICT_RETRY_FOR {
                        return Err(format!(
                            "writing the status of ComputeDomain {}: still conflicting with other writers after {conflicts} attempts in {:?}",
                            member.key(),
                            started.elapsed()
                        ));
                    }
                    tokio::time::sleep(crate::apiclient::jittered_cap(delay)).await;
                    delay = (delay * 2).min(CONFLICT_LONGEST_DELAY);
                }
                Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Vec::new()),
                Err(e) => {
                    return Err(format!(
                        "writing the status of ComputeDomain {}: {e}",
                        member.key()
                    ))
                }
            }
        }
    }

    /// Stops the daemons of domains no prepared claim here holds and no prepare tried to join within
    /// `grace` (a claim whose prepare failed and that the kubelet gave up on, or a restart that lost
    /// them).
    pub async fn sweep(&self, held: &BTreeSet<String>, grace: Duration) -> Vec<String> {
        // Attempts past their grace are forgotten whether or not a daemon is found for them.
        lock(&self.attempts).retain(|uid, at| held.contains(uid) || at.elapsed() < grace);
        let mut stopped = Vec::new();
        for uid in self.daemons.running().await {
            let recent = lock(&self.attempts)
                .get(&uid)
                .is_some_and(|at| at.elapsed() < grace);
            if held.contains(&uid) || recent {
                continue;
            }
            match self.daemons.stop(&uid).await {
                Ok(()) => stopped.push(uid),
                Err(error) => {
                    warn!(domain_uid = %uid, %error, "stopping an IMEX daemon no claim holds")
                }
            }
        }
        stopped
    }
}

/// A poisoned lock still holds consistent data here: every write is one insert or remove.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Sets this node's entry, keeping its index, or giving a new one the lowest index its clique does
/// not use (NVIDIA's DNS-name index is unique per clique).
fn upsert(nodes: &mut Vec<ComputeDomainNode>, node: &str, entry: Option<ComputeDomainNode>) {
    let existing = nodes.iter().position(|n| n.name == node);
    match (existing, entry) {
        (Some(at), None) => {
            nodes.remove(at);
        }
        (Some(at), Some(mut entry)) => {
            entry.index = nodes[at].index;
            nodes[at] = entry;
        }
        (None, Some(mut entry)) => {
            let used: BTreeSet<u32> = nodes
                .iter()
                .filter(|n| n.clique_id == entry.clique_id)
                .map(|n| n.index)
                .collect();
            entry.index = (0..).find(|i| !used.contains(i)).unwrap_or_default();
            nodes.push(entry);
            nodes.sort_by(|a, b| a.name.cmp(&b.name));
        }
        (None, None) => {}
    }
}

/// The joined nodes of one clique, by index: a daemon's peers.
fn peers_of(nodes: &[ComputeDomainNode], clique: &str) -> Vec<Peer> {
    let mut peers: Vec<Peer> = nodes
        .iter()
        .filter(|n| n.clique_id == clique && !n.ip_address.is_empty())
        .map(|n| Peer {
            index: n.index,
            address: n.ip_address.clone(),
        })
        .collect();
    peers.sort();
    peers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, clique: &str, ip: &str) -> ComputeDomainNode {
        ComputeDomainNode {
            name: name.into(),
            ip_address: ip.into(),
            clique_id: clique.into(),
            index: 0,
            status: NOT_READY.into(),
            reason: None,
        }
    }

    #[test]
    fn entries_keep_their_index_and_new_ones_take_the_lowest_free_one() {
        let mut nodes = Vec::new();
        upsert(&mut nodes, "a", Some(node("a", "c.1", "10.0.0.1")));
        upsert(&mut nodes, "b", Some(node("b", "c.1", "10.0.0.2")));
        upsert(&mut nodes, "c", Some(node("c", "c.2", "10.0.0.3")));
        let index = |nodes: &[ComputeDomainNode], name: &str| {
            nodes.iter().find(|n| n.name == name).map(|n| n.index)
        };
        assert_eq!(
            (index(&nodes, "a"), index(&nodes, "b"), index(&nodes, "c")),
            (Some(0), Some(1), Some(0))
        );
        upsert(&mut nodes, "a", None);
        upsert(&mut nodes, "d", Some(node("d", "c.1", "10.0.0.4")));
        assert_eq!(index(&nodes, "d"), Some(0));
        let mut ready = node("b", "c.1", "10.0.0.2");
        ready.status = READY.into();
        upsert(&mut nodes, "b", Some(ready));
        assert_eq!(index(&nodes, "b"), Some(1));
        let peer = |index, address: &str| Peer {
            index,
            address: address.into(),
        };
        assert_eq!(
            peers_of(&nodes, "c.1"),
            vec![peer(0, "10.0.0.4"), peer(1, "10.0.0.2")]
        );
    }
}
