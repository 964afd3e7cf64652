//! `gpu-dra controller`: places ComputeDomains on NVLink cliques, writes their channel
//! ResourceClaimTemplates, keeps their status and deletes what a deleted domain leaves behind.
//!
//! It converges in rounds: each round lists the domains of every group the driver serves, the
//! ResourceSlices, ResourceClaims, Nodes and the templates it made, decides with [`placement`], and
//! writes only what differs. A round runs every `resync`, and sooner when a watch sees a change. Errors
//! are logged and retried by the next round; a domain that does not parse gets its own status and
//! Event and never stops the others.
//!
//! It keeps nothing between rounds that the API server does not hold, so it can run as several
//! replicas of which one, elected with a Lease ([`leader`]), runs rounds: a new leader starts from
//! what the objects say.
//!
//! [`placement`]: crate::domains::placement

pub mod crd;
pub mod leader;
pub mod status;
pub mod template;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate, ResourceSlice};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use serde_json::json;
use thiserror::Error;
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::apiclient::ApiTimeouts;
use crate::domains::api::{
    ComputeDomainPlacement, DomainGroup, DomainObject, CHANNEL_DEVICE_CLASS, DOMAIN_LABEL,
    PLACEMENT_ANNOTATION,
};
use crate::domains::placement::{place_all, Decision, Fabric, Placed};
use status::{invalid_status, next_status, node_health, NodeHealth};

/// How long the controller waits after a watch event before it runs a round, so that a burst of
/// changes (a node's slices, many claims) makes one round.
const DEBOUNCE: Duration = Duration::from_millis(200);

#[derive(Debug, Error)]
pub enum ControllerError {
    #[error("listing {what}: {source}")]
    List {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
}

/// What the controller needs to know.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// `gpu.dra.dev`, or `gpu.nvidia.com` in NVIDIA compatibility mode (then NVIDIA's ComputeDomains
    /// are served too).
    pub driver_name: String,
    /// The DeviceClass of the channel requests in the templates.
    pub device_class: String,
    /// How often a round runs without any watch event.
    pub resync: Duration,
    pub api: ApiTimeouts,
}

impl ControllerConfig {
    pub fn new(driver_name: &str) -> Self {
        ControllerConfig {
            driver_name: driver_name.to_string(),
            device_class: CHANNEL_DEVICE_CLASS.to_string(),
            resync: Duration::from_secs(10),
            api: ApiTimeouts::default(),
        }
    }
}

/// The controller: a client, its configuration and what it remembers between rounds.
pub struct Controller {
    client: kube::Client,
    config: ControllerConfig,
    groups: Vec<DomainGroup>,
    recorder: Recorder,
    /// (domain UID, reason, note) of the Events recorded, so a condition that lasts is told once.
    reported: BTreeSet<(String, String, String)>,
}

/// One domain as listed: the object (for writes) and what it says, or why it does not parse.
struct Listed {
    group: DomainGroup,
    object: DynamicObject,
    parsed: Result<DomainObject, String>,
}

impl Controller {
    pub fn new(client: kube::Client, config: ControllerConfig) -> Self {
        let reporter = Reporter {
            controller: format!("{}/compute-domain-controller", config.driver_name),
            instance: std::env::var("POD_NAME").ok(),
        };
        Controller {
            groups: DomainGroup::served_by(&config.driver_name),
            recorder: Recorder::new(client.clone(), reporter),
            client,
            config,
            reported: BTreeSet::new(),
        }
    }

    /// The ComputeDomain groups this controller serves.
    pub fn groups(&self) -> &[DomainGroup] {
        &self.groups
    }

    /// Runs rounds until `shutdown` completes: one at once, then one after every change a watch sees
    /// (debounced) or every `resync`, whichever comes first.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) {
        let changed = Arc::new(Notify::new());
        // Aborted however the loop ends, also when this future is dropped (a lost Lease).
        let _watches = Watches(self.start_watches(changed.clone()));
        tokio::pin!(shutdown);
        loop {
            if let Err(error) = self.round().await {
                warn!(%error, "ComputeDomain round failed; retrying");
            }
            tokio::select! {
                () = &mut shutdown => break,
                () = changed.notified() => tokio::time::sleep(DEBOUNCE).await,
                () = tokio::time::sleep(self.config.resync) => {}
            }
        }
    }

    /// Watches what a round reads; each event wakes the loop. The watches only wake it: the round
    /// lists afresh, so a missed event costs at most one `resync`.
    fn start_watches(&self, changed: Arc<Notify>) -> Vec<tokio::task::JoinHandle<()>> {
        let config = self.config.api.watcher_config();
        let client = &self.client;
        let mut tasks = vec![
            wake_on(
                watcher(Api::<ResourceSlice>::all(client.clone()), config.clone()),
                changed.clone(),
            ),
            wake_on(
                watcher(Api::<ResourceClaim>::all(client.clone()), config.clone()),
                changed.clone(),
            ),
            wake_on(
                watcher(Api::<Node>::all(client.clone()), config.clone()),
                changed.clone(),
            ),
            wake_on(
                watcher(
                    Api::<ComputeDomainPlacement>::all(client.clone()),
                    config.clone(),
                ),
                changed.clone(),
            ),
        ];
        for group in &self.groups {
            let domains: Api<DynamicObject> = Api::all_with(client.clone(), &group.api_resource());
            tasks.push(wake_on(watcher(domains, config.clone()), changed.clone()));
        }
        tasks
    }

    /// One round: list, decide, write what differs.
    pub async fn round(&mut self) -> Result<(), ControllerError> {
        let driver = self.config.driver_name.clone();
        // Typed: the RBAC scanner reads `let x = Api::<K>` as a binding of x.
        let slices: Vec<ResourceSlice> = Api::<ResourceSlice>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|source| ControllerError::List {
                what: "ResourceSlices",
                source,
            })?
            .items;
        let claims: Vec<ResourceClaim> = Api::<ResourceClaim>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|source| ControllerError::List {
                what: "ResourceClaims",
                source,
            })?
            .items;
        let nodes: Vec<Node> = Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|source| ControllerError::List {
                what: "Nodes",
                source,
            })?
            .items;
        let templates: Vec<ResourceClaimTemplate> =
            Api::<ResourceClaimTemplate>::all(self.client.clone())
                .list(&ListParams::default().labels(DOMAIN_LABEL))
                .await
                .map_err(|source| ControllerError::List {
                    what: "ResourceClaimTemplates",
                    source,
                })?
                .items;

        let placements: Vec<ComputeDomainPlacement> =
            Api::<ComputeDomainPlacement>::all(self.client.clone())
                .list(&ListParams::default())
                .await
                .map_err(|source| ControllerError::List {
                    what: "ComputeDomainPlacements (is crd/gpu.dra.dev_computedomainplacements.yaml applied?)",
                    source,
                })?
                .items;

        let (listed, listed_groups) = self.list_domains().await;
        let mut domains: Vec<&Listed> = listed.iter().collect();
        // The oldest domain is placed first; the name breaks ties so the order is stable.
        domains.sort_by(|a, b| {
            let created = |l: &Listed| l.object.metadata.creation_timestamp.clone();
            created(a)
                .cmp(&created(b))
                .then_with(|| a.object.metadata.name.cmp(&b.object.metadata.name))
        });
        let parsed: Vec<DomainObject> = domains
            .iter()
            .filter_map(|l| l.parsed.as_ref().ok().cloned())
            .collect();
        // Only a placement made for the very domain counts (its name is a UID anyone could copy, but
        // no one else may write these objects).
        let placed: BTreeMap<String, String> = parsed
            .iter()
            .filter_map(|domain| {
                let placement = placements.iter().find(|p| p.is_for(domain))?;
                Some((domain.uid.clone(), placement.spec.clique.clone()))
            })
            .collect();
        let fabric = Fabric::from_cluster(&driver, &slices, &claims);
        let decisions = place_all(&parsed, &placed, &fabric);
        let health = node_health(&nodes);
        let templates_by_key: BTreeMap<(String, String), &ResourceClaimTemplate> = templates
            .iter()
            .map(|t| {
                (
                    (
                        t.metadata.namespace.clone().unwrap_or_default(),
                        t.metadata.name.clone().unwrap_or_default(),
                    ),
                    t,
                )
            })
            .collect();

        for listed in &domains {
            match &listed.parsed {
                Ok(domain) if domain.deleting => {}
                Ok(domain) => {
                    let Some(decision) = decisions.get(&domain.uid) else {
                        continue;
                    };
                    self.converge(listed, domain, decision, &templates_by_key, &health)
                        .await;
                }
                Err(error) => self.report_invalid(listed, error).await,
            }
        }
        self.delete_orphaned_templates(&templates, &listed, &listed_groups)
            .await;
        self.delete_orphaned_placements(&placements, &listed, &listed_groups)
            .await;
        Ok(())
    }

    /// The domains of every served group, and the groups whose list succeeded (a group whose CRD is
    /// not installed is skipped; its templates are then left alone).
    async fn list_domains(&self) -> (Vec<Listed>, BTreeSet<DomainGroup>) {
        let mut listed = Vec::new();
        let mut ok = BTreeSet::new();
        for group in &self.groups {
            let domains: Api<DynamicObject> =
                Api::all_with(self.client.clone(), &group.api_resource());
            match domains.list(&ListParams::default()).await {
                Ok(list) => {
                    ok.insert(*group);
                    listed.extend(list.items.into_iter().map(|object| Listed {
                        group: *group,
                        parsed: DomainObject::from_dynamic(*group, &object),
                        object,
                    }));
                }
                Err(kube::Error::Api(status)) if status.code == 404 => debug!(
                    group = ?group,
                    "ComputeDomains of this group are not served (CRD not installed)"
                ),
                Err(error) => warn!(%error, group = ?group, "listing ComputeDomains failed"),
            }
        }
        (listed, ok)
    }

    /// Brings one domain to what `decision` says: annotations, template, status, Events.
    async fn converge(
        &mut self,
        listed: &Listed,
        domain: &DomainObject,
        decision: &Decision,
        templates: &BTreeMap<(String, String), &ResourceClaimTemplate>,
        health: &NodeHealth,
    ) {
        let mut template_problem = None;
        let recorded = match decision {
            Decision::New(placed) => {
                let recorded = self.record_placement(domain, placed).await;
                if recorded {
                    info!(domain = %domain.key(), clique = %placed.clique, "placed");
                    let note = format!("placed on NVLink clique {}", placed.clique);
                    self.event(listed, EventType::Normal, "Placed", &note, None)
                        .await;
                }
                recorded
            }
            Decision::Kept(_) => {
                if domain.annotations.contains_key(PLACEMENT_ANNOTATION) {
                    self.patch_annotations(domain, json!({PLACEMENT_ANNOTATION: null}))
                        .await;
                }
                true
            }
            Decision::Refused(reason) | Decision::Waiting(reason) => {
                if domain.annotations.get(PLACEMENT_ANNOTATION) != Some(reason) {
                    self.patch_annotations(domain, json!({PLACEMENT_ANNOTATION: reason}))
                        .await;
                    self.event(listed, EventType::Warning, "NotPlaced", reason, None)
                        .await;
                }
                false
            }
        };
        if let (true, Some(placed)) = (recorded, decision.placed()) {
            template_problem = self.ensure_template(domain, placed, templates).await;
            if let Some(problem) = &template_problem {
                self.event(
                    listed,
                    EventType::Warning,
                    "TemplateNotWritten",
                    problem,
                    None,
                )
                .await;
            }
        }
        let next = next_status(domain, decision, template_problem.as_deref(), health);
        for lost in &next.lost {
            let note = format!("{}: its IMEX daemon no longer counts as Ready", lost.reason);
            self.event(
                listed,
                EventType::Warning,
                "NodeNotReady",
                &note,
                Some(&lost.node),
            )
            .await;
        }
        if next.status != domain.status {
            self.write_status(listed, serde_json::to_value(&next.status))
                .await;
        }
    }

    /// Creates the domain's ComputeDomainPlacement (and drops the reason it was not placed); whether it
    /// exists now. The template follows only once it does.
    async fn record_placement(&self, domain: &DomainObject, placed: &Placed) -> bool {
        let placements: Api<ComputeDomainPlacement> = Api::all(self.client.clone());
        let placement = ComputeDomainPlacement::of(domain, &placed.clique);
        match placements.create(&PostParams::default(), &placement).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {
                // Made by an earlier round whose list did not see it yet; the next round reads it.
                return false;
            }
            Err(error) => {
                warn!(%error, domain = %domain.key(), "writing the ComputeDomainPlacement failed; retrying");
                return false;
            }
        }
        if domain.annotations.contains_key(PLACEMENT_ANNOTATION) {
            self.patch_annotations(domain, json!({PLACEMENT_ANNOTATION: null}))
                .await;
        }
        true
    }

    async fn patch_annotations(
        &self,
        domain: &DomainObject,
        annotations: serde_json::Value,
    ) -> bool {
        let domains: Api<DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &domain.namespace,
            &domain.group.api_resource(),
        );
        let mut metadata = json!({"annotations": annotations});
        if let Some(version) = &domain.resource_version {
            // A reason decided on a stale view must not land: the next round decides again.
            metadata["resourceVersion"] = json!(version);
        }
        let patch = Patch::Merge(json!({"metadata": metadata}));
        match domains
            .patch(&domain.name, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => true,
            Err(error) => {
                warn!(%error, domain = %domain.key(), "writing the placement annotation failed; retrying");
                false
            }
        }
    }

    /// Creates the domain's template when it is missing; why it cannot, when another object has its
    /// name.
    async fn ensure_template(
        &self,
        domain: &DomainObject,
        placed: &Placed,
        templates: &BTreeMap<(String, String), &ResourceClaimTemplate>,
    ) -> Option<String> {
        let name = domain
            .spec
            .channel
            .as_ref()
            .map(|c| c.resource_claim_template.name.clone())
            .unwrap_or_default();
        let namespaced: Api<ResourceClaimTemplate> =
            Api::namespaced(self.client.clone(), &domain.namespace);
        if let Some(existing) = templates.get(&(domain.namespace.clone(), name.clone())) {
            let owner = existing
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(DOMAIN_LABEL));
            if owner == Some(&domain.uid) {
                return None;
            }
            return Some(format!(
                "ResourceClaimTemplate {}/{name} belongs to another ComputeDomain (UID {})",
                domain.namespace,
                owner.map(String::as_str).unwrap_or("unknown")
            ));
        }
        let template = match template::channel_template(
            &self.config.driver_name,
            &self.config.device_class,
            domain,
            &name,
            placed,
        ) {
            Ok(template) => template,
            Err(error) => {
                return Some(format!(
                    "ResourceClaimTemplate {}/{name} cannot be built: {error}",
                    domain.namespace
                ))
            }
        };
        match namespaced.create(&PostParams::default(), &template).await {
            Ok(_) => {
                info!(domain = %domain.key(), template = %name, "channel ResourceClaimTemplate created");
                None
            }
            Err(kube::Error::Api(status)) if status.code == 409 => Some(format!(
                "ResourceClaimTemplate {}/{name} already exists and was not made for this ComputeDomain",
                domain.namespace
            )),
            Err(kube::Error::Api(status)) if status.code == 422 || status.code == 400 => Some(format!(
                "ResourceClaimTemplate {}/{name} was refused: {}",
                domain.namespace, status.message
            )),
            Err(error) => {
                warn!(%error, domain = %domain.key(), "creating the channel ResourceClaimTemplate failed; retrying");
                None
            }
        }
    }

    /// Replaces the domain's status (guarded by its resourceVersion: a plugin's concurrent write of
    /// its node entry wins, and the next round starts from it).
    async fn write_status(
        &self,
        listed: &Listed,
        status: Result<serde_json::Value, serde_json::Error>,
    ) {
        let Ok(status) = status else {
            return;
        };
        let mut object = listed.object.clone();
        object.data["status"] = status;
        let group = listed.group;
        let namespace = object.metadata.namespace.clone().unwrap_or_default();
        let name = object.metadata.name.clone().unwrap_or_default();
        let domains: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &namespace, &group.api_resource());
        if let Err(error) = domains
            .replace_status(&name, &PostParams::default(), &object)
            .await
        {
            warn!(%error, domain = %format!("{namespace}/{name}"), "writing the status failed; retrying");
        }
    }

    /// A domain whose spec or status does not parse: NotReady with the error, an Event, the annotation.
    async fn report_invalid(&mut self, listed: &Listed, error: &str) {
        let invalid = invalid_status(error);
        let current = listed.object.data.get("status");
        if current != serde_json::to_value(&invalid).ok().as_ref() {
            self.write_status(listed, serde_json::to_value(&invalid))
                .await;
        }
        self.event(listed, EventType::Warning, "InvalidSpec", error, None)
            .await;
    }

    /// Deletes the templates of domains that are gone or being deleted (the API server's garbage
    /// collector would, through the ownerReference; not every cluster runs one in time, and a domain
    /// made again under the same name must not find the old template).
    async fn delete_orphaned_templates(
        &self,
        templates: &[ResourceClaimTemplate],
        listed: &[Listed],
        listed_groups: &BTreeSet<DomainGroup>,
    ) {
        let live: BTreeSet<&str> = listed
            .iter()
            .filter_map(|l| l.parsed.as_ref().ok())
            .filter(|d| !d.deleting)
            .map(|d| d.uid.as_str())
            .chain(
                // A domain that does not parse is not gone: keep its template.
                listed
                    .iter()
                    .filter(|l| l.parsed.is_err())
                    .filter_map(|l| l.object.metadata.uid.as_deref()),
            )
            .collect();
        for template in templates {
            let Some(uid) = template
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(DOMAIN_LABEL))
            else {
                continue;
            };
            let owner_group = template
                .metadata
                .owner_references
                .iter()
                .flatten()
                .find(|o| &o.uid == uid)
                .and_then(|o| {
                    DomainGroup::served_by(crate::api::NVIDIA_DRIVER_NAME)
                        .into_iter()
                        .find(|g| g.api_resource().api_version == o.api_version)
                });
            // Only when the owner's group was listed this round can "not listed" mean "gone".
            let Some(group) = owner_group.filter(|g| listed_groups.contains(g)) else {
                continue;
            };
            if live.contains(uid.as_str()) {
                continue;
            }
            let namespace = template.metadata.namespace.clone().unwrap_or_default();
            let name = template.metadata.name.clone().unwrap_or_default();
            let namespaced: Api<ResourceClaimTemplate> =
                Api::namespaced(self.client.clone(), &namespace);
            match namespaced.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {
                    info!(template = %format!("{namespace}/{name}"), group = ?group, "deleted the channel ResourceClaimTemplate of a deleted ComputeDomain")
                }
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => {
                    warn!(%error, template = %format!("{namespace}/{name}"), "deleting the template of a deleted ComputeDomain failed; retrying")
                }
            }
        }
    }

    /// Deletes the placements of domains that are gone or being deleted, and any that is not the very
    /// domain's its name says (it would keep that domain from being placed). A placement cannot be
    /// owned by its namespaced domain (the garbage collector does not follow a cluster-scoped object to
    /// a namespaced owner), so the controller deletes it.
    async fn delete_orphaned_placements(
        &self,
        placements: &[ComputeDomainPlacement],
        listed: &[Listed],
        listed_groups: &BTreeSet<DomainGroup>,
    ) {
        // A domain that does not parse is not gone: keep the placement named by its UID.
        let unparsed: BTreeSet<&str> = listed
            .iter()
            .filter(|l| l.parsed.is_err())
            .filter_map(|l| l.object.metadata.uid.as_deref())
            .collect();
        let live: Vec<&DomainObject> = listed
            .iter()
            .filter_map(|l| l.parsed.as_ref().ok())
            .filter(|d| !d.deleting)
            .collect();
        let api: Api<ComputeDomainPlacement> = Api::all(self.client.clone());
        for placement in placements {
            let group = DomainGroup::served_by(crate::api::NVIDIA_DRIVER_NAME)
                .into_iter()
                .find(|g| g.api_resource().api_version == placement.spec.domain.api_version);
            // Only when the domain's group was listed this round can "not listed" mean "gone".
            let listed_group = group.is_none_or(|g| listed_groups.contains(&g));
            let kept = live.iter().any(|d| placement.is_for(d))
                || placement
                    .metadata
                    .name
                    .as_deref()
                    .is_some_and(|name| unparsed.contains(name));
            if kept || !listed_group {
                continue;
            }
            let name = placement.metadata.name.clone().unwrap_or_default();
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {
                    info!(placement = %name, domain = %format!("{}/{}", placement.spec.domain.namespace, placement.spec.domain.name), "deleted the placement of a deleted ComputeDomain")
                }
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => {
                    warn!(%error, placement = %name, "deleting the placement of a deleted ComputeDomain failed; retrying")
                }
            }
        }
    }

    /// Records an Event on the domain, once per (domain, reason, note) while the controller runs;
    /// `node` becomes its related object, so Events about two nodes are two Events.
    async fn event(
        &mut self,
        listed: &Listed,
        type_: EventType,
        reason: &str,
        note: &str,
        node: Option<&str>,
    ) {
        let uid = listed.object.metadata.uid.clone().unwrap_or_default();
        let seen = (uid.clone(), reason.to_string(), note.to_string());
        if !self.reported.insert(seen) {
            return;
        }
        let api = listed.group.api_resource();
        let reference = ObjectReference {
            api_version: Some(api.api_version),
            kind: Some(api.kind),
            name: listed.object.metadata.name.clone(),
            namespace: listed.object.metadata.namespace.clone(),
            uid: Some(uid),
            ..Default::default()
        };
        let secondary = node.map(|node| ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.to_string()),
            ..Default::default()
        });
        let event = Event {
            type_,
            reason: reason.to_string(),
            // The API's limit on a note is 1024 bytes.
            note: Some(note.chars().take(1000).collect()),
            action: "Reconcile".to_string(),
            secondary,
        };
        let published = tokio::time::timeout(
            Duration::from_secs(5),
            self.recorder.publish(&event, &reference),
        )
        .await;
        match published {
            Ok(Ok(())) => {}
            Ok(Err(error)) => warn!(%error, reason, "could not record an Event on the ComputeDomain"),
            Err(_) => warn!(reason, "could not record an Event on the ComputeDomain: the API server did not answer in time"),
        }
    }
}

/// The watch tasks of a running controller, aborted when dropped.
struct Watches(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Watches {
    fn drop(&mut self) {
        for watch in &self.0 {
            watch.abort();
        }
    }
}

/// Wakes `changed` on every event of a watch (retried with the watches' usual backoff).
fn wake_on<K: Send + 'static>(
    stream: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    changed: Arc<Notify>,
) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    tokio::spawn(async move {
        let mut events = std::pin::pin!(crate::apiclient::retried(stream));
        while let Some(event) = events.next().await {
            match event {
                Ok(_) => changed.notify_one(),
                Err(error) => {
                    debug!(%error, "a watch of the ComputeDomain controller failed; retrying")
                }
            }
        }
    })
}
