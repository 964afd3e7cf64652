//! The objects the scheduler's decision depends on: Pods, ResourceClaims, ResourceClaimTemplates,
//! DeviceClasses, ResourceSlices and Nodes. They come from the API server, found through the kubeconfig
//! as kubectl finds it, or from a dump of
//! `kubectl get pods,resourceclaims,resourceclaimtemplates,deviceclasses,resourceslices,nodes -A -o yaml`
//! (a `List` of mixed kinds; several YAML documents and JSON are read too), for support cases.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{Api, ListParams};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use super::subject::Target;
use super::ExplainError;
use crate::apiclient::ApiTimeouts;

const RESOURCE_API: &str = "resource.k8s.io/v1";

/// What `explain` reads. Objects keep the order they came in.
#[derive(Debug, Clone, Default)]
pub struct Cluster {
    pub pods: Vec<Pod>,
    pub claims: Vec<ResourceClaim>,
    pub templates: Vec<ResourceClaimTemplate>,
    pub classes: Vec<DeviceClass>,
    pub slices: Vec<ResourceSlice>,
    pub nodes: Vec<Node>,
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
        for (at, value) in parse_objects(origin, text)? {
            self.add(value).map_err(|message| ExplainError::Input {
                origin: format!("{origin}: {at}"),
                message,
            })?;
        }
        Ok(())
    }

    /// Adds one object by its kind; kinds `explain` does not use are counted in `ignored`.
    pub fn add(&mut self, value: Value) -> Result<(), String> {
        let kind = value
            .get("kind")
            .and_then(Value::as_str)
            .ok_or("kind missing: expected a Kubernetes object")?
            .to_string();
        let api_version = value
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let core = |expected: &str| {
            if api_version == expected {
                Ok(())
            } else {
                Err(format!(
                    "{kind} apiVersion {api_version:?}: expected {expected}"
                ))
            }
        };
        match kind.as_str() {
            "Pod" => {
                core("v1")?;
                self.pods.push(typed(&kind, value)?);
            }
            "Node" => {
                core("v1")?;
                self.nodes.push(typed(&kind, value)?);
            }
            "ResourceClaim" | "ResourceClaimTemplate" | "DeviceClass" | "ResourceSlice" => {
                if api_version != RESOURCE_API {
                    return Err(format!(
                        "{kind} apiVersion {api_version:?}: only {RESOURCE_API} is supported \
                         (Kubernetes 1.34 and later serve it)"
                    ));
                }
                match kind.as_str() {
                    "ResourceClaim" => self.claims.push(typed(&kind, value)?),
                    "ResourceClaimTemplate" => self.templates.push(typed(&kind, value)?),
                    "DeviceClass" => self.classes.push(typed(&kind, value)?),
                    _ => {
                        let slice: ResourceSlice = typed(&kind, value)?;
                        // k8s-openapi fills missing required fields with defaults; these would mislead.
                        if slice.spec.driver.is_empty() || slice.spec.pool.name.is_empty() {
                            return Err(
                                "ResourceSlice without spec.driver or spec.pool.name".into()
                            );
                        }
                        self.slices.push(slice);
                    }
                }
            }
            _ => *self.ignored.entry(kind).or_default() += 1,
        }
        Ok(())
    }

    /// Reads what `target` needs from the API server: the pod (if any) and the templates its claims
    /// name, every ResourceClaim (for the devices they hold), DeviceClass, ResourceSlice and Node.
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
            cluster.pods.push(pod);
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
        Ok(cluster)
    }
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

fn typed<T: DeserializeOwned>(kind: &str, value: Value) -> Result<T, String> {
    serde_json::from_value(value).map_err(|e| format!("invalid {kind}: {e}"))
}

/// Every object in `text`, with where it sits (`document 2, item 5`); Lists and arrays are flattened,
/// empty documents skipped. JSON is parsed as JSON (much faster than as YAML).
pub(super) fn parse_objects(
    origin: &str,
    text: &str,
) -> Result<Vec<(String, Value)>, ExplainError> {
    let invalid = |at: String, message: String| ExplainError::Input {
        origin: format!("{origin}: {at}"),
        message,
    };
    let documents: Vec<Value> = if text.trim_start().starts_with(['{', '[']) {
        let value = serde_json::from_str(text)
            .map_err(|e| invalid("document 1".into(), format!("not valid JSON: {e}")))?;
        vec![value]
    } else {
        let mut documents = Vec::new();
        for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let value = Value::deserialize(document).map_err(|e| {
                invalid(
                    format!("document {}", index + 1),
                    format!("not valid YAML: {e}"),
                )
            })?;
            documents.push(value);
        }
        documents
    };
    let mut objects = Vec::new();
    for (index, value) in documents.into_iter().enumerate() {
        let document = index + 1;
        let items = match value {
            Value::Null => continue,
            Value::Array(items) => items,
            Value::Object(mut map)
                if map
                    .get("kind")
                    .and_then(Value::as_str)
                    .is_some_and(|kind| kind.ends_with("List")) =>
            {
                match map.remove("items") {
                    Some(Value::Array(items)) => items,
                    Some(Value::Null) | None => Vec::new(),
                    Some(_) => {
                        return Err(invalid(
                            format!("document {document}"),
                            "items of the List is not an array".into(),
                        ))
                    }
                }
            }
            other => {
                objects.push((format!("document {document}"), other));
                continue;
            }
        };
        for (item, value) in items.into_iter().enumerate() {
            objects.push((format!("document {document}, item {}", item + 1), value));
        }
    }
    Ok(objects)
}
