//! The objects the scheduler's decision depends on: Pods, ResourceClaims, ResourceClaimTemplates,
//! DeviceClasses, ResourceSlices and Nodes, and the ComputeDomains whose controller writes the
//! templates of their pods. They come from the API server, found through the kubeconfig as kubectl
//! finds it, or from a dump of
//! `kubectl get pods,resourceclaims,resourceclaimtemplates,deviceclasses,resourceslices,nodes -A -o yaml`
//! (a `List` of mixed kinds; several YAML documents and JSON are read too), for support cases, with
//! `kubectl get computedomains.gpu.dra.dev,computedomains.resource.nvidia.com,computedomainplacements -A -o yaml`
//! where pods of ComputeDomains are Pending.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{Api, DynamicObject, ListParams};
use serde::de::DeserializeSeed;
use serde::Deserialize;
use serde_json::Value;

use super::dump::{self, Document, Items, Object};
use super::subject::Target;
use super::ExplainError;
use crate::apiclient::ApiTimeouts;
use crate::domains::api::{ComputeDomainPlacement, DomainGroup, DomainObject};

/// What `explain` reads. Objects keep the order they came in.
#[derive(Debug, Clone, Default)]
pub struct Cluster {
    pub pods: Vec<Pod>,
    pub claims: Vec<ResourceClaim>,
    pub templates: Vec<ResourceClaimTemplate>,
    pub classes: Vec<DeviceClass>,
    pub slices: Vec<ResourceSlice>,
    pub nodes: Vec<Node>,
    /// ComputeDomains of both groups (ours and NVIDIA's).
    pub domains: Vec<DomainObject>,
    /// Where the controller placed them.
    pub placements: Vec<ComputeDomainPlacement>,
    /// Objects of other kinds in a dump, counted by kind and otherwise ignored.
    pub ignored: BTreeMap<String, usize>,
}

impl Cluster {
    /// Reads dumps; the objects of all files together are the cluster.
    pub fn from_dump_files(paths: &[PathBuf]) -> Result<Cluster, ExplainError> {
        let mut cluster = Cluster::default();
        for path in paths {
            let text = std::fs::read_to_string(path).map_err(|error| ExplainError::Read {
                file: path.clone(),
                error,
            })?;
            cluster.add_text(&path.display().to_string(), &text)?;
        }
        Ok(cluster)
    }

    /// Adds the objects of one dump (`origin` names it in errors).
    pub fn add_text(&mut self, origin: &str, text: &str) -> Result<(), ExplainError> {
        let invalid = |document: usize, message: String| ExplainError::Input {
            origin: format!("{origin}: document {document}"),
            message,
        };
        if text.trim_start().starts_with(['{', '[']) {
            let mut json = serde_json::Deserializer::from_str(text);
            let Document(objects) = Document::deserialize(&mut json)
                .and_then(|d| json.end().map(|()| d))
                .map_err(|e| invalid(1, format!("not valid JSON: {e}")))?;
            objects.into_iter().for_each(|o| self.push(o));
        } else if let Some(items) = dump::list_items(text) {
            for (line, item) in items {
                let parsed = serde_yaml::Deserializer::from_str(item)
                    .next()
                    .map(|document| Items.deserialize(document))
                    .unwrap_or(Ok(Vec::new()));
                let objects = parsed.map_err(|e| ExplainError::Input {
                    origin: format!("{origin}: the item at line {line}"),
                    message: without_path(&e.to_string()),
                })?;
                objects.into_iter().for_each(|o| self.push(o));
            }
        } else {
            for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
                let Document(objects) = Document::deserialize(document)
                    .map_err(|e| invalid(index + 1, e.to_string()))?;
                objects.into_iter().for_each(|o| self.push(o));
            }
        }
        self.sort_slices();
        Ok(())
    }

    /// Adds one object given as a generic value; kinds `explain` does not use are counted in
    /// `ignored`.
    pub fn add(&mut self, value: Value) -> Result<(), String> {
        self.push(dump::from_value(value)?);
        Ok(())
    }

    fn push(&mut self, object: Object) {
        match object {
            Object::Pod(pod) => self.pods.push(*pod),
            Object::Node(node) => self.nodes.push(*node),
            Object::Claim(claim) => self.claims.push(*claim),
            Object::Template(template) => self.templates.push(*template),
            Object::Class(class) => self.classes.push(*class),
            Object::Slice(slice) => self.slices.push(*slice),
            Object::Domain(domain) => self.domains.push(*domain),
            Object::Placement(placement) => self.placements.push(*placement),
            Object::Other(kind) => *self.ignored.entry(kind).or_default() += 1,
        }
    }

    /// Puts the slices of one node's pools next to each other (the allocator orders pools and slices
    /// itself), so that each node's slices can be handed to it without copies.
    pub fn sort_slices(&mut self) {
        self.slices.sort_by_cached_key(|s| {
            (
                s.spec.node_name.clone(),
                s.spec.driver.clone(),
                s.spec.pool.name.clone(),
            )
        });
    }

    /// Reads what `target` needs from the API server: the pod (if any) and the templates its claims
    /// name, every ResourceClaim (for the devices they hold), DeviceClass, ResourceSlice and Node; and
    /// every Pod when the pod requests extended resources (for what device plugins have left); and for a
    /// pod, the ComputeDomains of both groups (a pod of one waits for it).
    pub async fn fetch(client: &kube::Client, target: &Target) -> Result<Cluster, ExplainError> {
        let api_error = |what: String| {
            move |error| ExplainError::Api {
                what,
                error: Box::new(error),
            }
        };
        let mut cluster = Cluster::default();
        if let Target::Pod { namespace, name } = target {
            let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
            let pod = pods
                .get_opt(name)
                .await
                .map_err(api_error(format!("reading Pod {namespace}/{name}")))?
                .ok_or_else(|| ExplainError::NotFound {
                    kind: "Pod",
                    name: format!("{namespace}/{name}"),
                })?;
            let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), namespace);
            for template in super::subject::templates_to_read(&pod) {
                let what = format!("reading ResourceClaimTemplate {namespace}/{template}");
                if let Some(found) = templates
                    .get_opt(&template)
                    .await
                    .map_err(api_error(what))?
                {
                    cluster.templates.push(found);
                }
            }
            if super::extended::requests_extended(&pod) {
                // What device plugins have left on a node follows from the pods bound to it.
                let all: Api<Pod> = Api::all(client.clone());
                cluster.pods = all
                    .list(&ListParams::default())
                    .await
                    .map_err(api_error("listing Pods".into()))?
                    .items;
                let same = |p: &Pod| {
                    p.metadata.namespace == pod.metadata.namespace
                        && p.metadata.name == pod.metadata.name
                };
                cluster.pods.retain(|p| !same(p));
            }
            cluster.pods.push(pod);
            cluster.domains = fetch_domains(client).await?;
            cluster.placements = fetch_placements(client).await?;
        }
        let all = ListParams::default();
        let claims: Api<ResourceClaim> = Api::all(client.clone());
        cluster.claims = claims
            .list(&all)
            .await
            .map_err(api_error("listing ResourceClaims".into()))?
            .items;
        let classes: Api<DeviceClass> = Api::all(client.clone());
        cluster.classes = classes
            .list(&all)
            .await
            .map_err(api_error("listing DeviceClasses".into()))?
            .items;
        let slices: Api<ResourceSlice> = Api::all(client.clone());
        cluster.slices = slices
            .list(&all)
            .await
            .map_err(api_error("listing ResourceSlices".into()))?
            .items;
        let nodes: Api<Node> = Api::all(client.clone());
        cluster.nodes = nodes
            .list(&all)
            .await
            .map_err(api_error("listing Nodes".into()))?
            .items;
        cluster.sort_slices();
        Ok(cluster)
    }
}

impl Cluster {
    /// The clique the controller placed `domain` on, if it did.
    pub fn placement_of(&self, domain: &DomainObject) -> Option<String> {
        self.placements
            .iter()
            .find(|p| p.is_for(domain))
            .map(|p| p.spec.clique.clone())
    }

    /// Every domain's placement: domain UID → clique.
    pub fn placements_by_uid(&self) -> BTreeMap<String, String> {
        self.domains
            .iter()
            .filter_map(|d| Some((d.uid.clone(), self.placement_of(d)?)))
            .collect()
    }
}

/// The controller's placements; none where their CRD is not installed.
async fn fetch_placements(
    client: &kube::Client,
) -> Result<Vec<ComputeDomainPlacement>, ExplainError> {
    let placements: Api<ComputeDomainPlacement> = Api::all(client.clone());
    match placements.list(&ListParams::default()).await {
        Ok(list) => Ok(list.items),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(Vec::new()),
        Err(error) => Err(ExplainError::Api {
            what: "listing ComputeDomainPlacements".into(),
            error: Box::new(error),
        }),
    }
}

/// The ComputeDomains of both groups. A group whose CRD is not installed answers 404: it has none.
async fn fetch_domains(client: &kube::Client) -> Result<Vec<DomainObject>, ExplainError> {
    let mut found = Vec::new();
    for group in [DomainGroup::Ours, DomainGroup::Nvidia] {
        let resource = group.api_resource();
        let domains: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        let listed = match domains.list(&ListParams::default()).await {
            Ok(list) => list.items,
            Err(kube::Error::Api(status)) if status.code == 404 => continue,
            Err(error) => {
                return Err(ExplainError::Api {
                    what: format!("listing ComputeDomains ({})", resource.api_version),
                    error: Box::new(error),
                })
            }
        };
        for object in &listed {
            let domain = DomainObject::from_dynamic(group, object).map_err(|message| {
                ExplainError::Input {
                    origin: "API server".into(),
                    message,
                }
            })?;
            found.push(domain);
        }
    }
    Ok(found)
}

/// A client as kubectl would build one: `kubeconfig` if given, else `$KUBECONFIG` (a list of files
/// is merged) or `~/.kube/config`, else the in-cluster configuration; `context` picks a context.
pub async fn client(
    kubeconfig: Option<&Path>,
    context: Option<&str>,
) -> Result<kube::Client, ExplainError> {
    let timeouts = ApiTimeouts::default();
    if context.is_none() {
        return crate::apiclient::kube_client(kubeconfig, &timeouts)
            .await
            .map_err(ExplainError::Client);
    }
    // rustls needs one process-wide crypto provider (as in `apiclient::kube_client`).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let options = kube::config::KubeConfigOptions {
        context: context.map(str::to_string),
        ..Default::default()
    };
    let error = |e: &dyn std::fmt::Display| ExplainError::Kubeconfig(e.to_string());
    let mut config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| error(&format!("{}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(file, &options)
                .await
                .map_err(|e| error(&e))?
        }
        None => kube::Config::from_kubeconfig(&options)
            .await
            .map_err(|e| error(&e))?,
    };
    timeouts.apply(&mut config);
    kube::Client::try_from(config).map_err(|e| error(&e))
}

/// serde_yaml's message without the path it puts first (`.[0]:`, the entry of the one-entry
/// sequence the item was parsed as), which says nothing about an item parsed on its own.
fn without_path(message: &str) -> String {
    let Some((path, rest)) = message.split_once(": ") else {
        return message.to_string();
    };
    match path.trim_start_matches('.').strip_prefix("[0]") {
        Some("") => rest.to_string(),
        Some(inner) => format!("{}: {rest}", inner.trim_start_matches('.')),
        None => message.to_string(),
    }
}
