//! The test hooks on [`ApiServer`]: reach around HTTP to read and write the store as a controller or
//! the kubelet would, inject faults and latency, change the version and feature gates, stop serving a
//! resource, and observe the requests the driver made.

use std::time::Duration;

use serde_json::Value;
use tokio::sync::broadcast;

use super::{
    hook_resource, lock, resource_matches, ApiHandle, ApiServer, EventType, FaultSpec, Faults,
    FeatureGates, RequestRecord, ServerVersion,
};

impl ApiServer {
    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store().revision
    }

    /// A handle on the stored objects, for the doubles of other components (the pod runner plays the
    /// kubelet) that write as a controller or the kubelet would, without HTTP: their traffic is not among
    /// [`ApiServer::requests`], so tests of what the plugin sends see only the plugin.
    pub fn handle(&self) -> ApiHandle {
        ApiHandle {
            shared: self.shared.clone(),
        }
    }

    /// Creates or replaces an object without validation, as a controller or the kubelet would have written
    /// it; see [`ApiHandle::insert`].
    pub fn insert(&self, resource: &str, obj: Value) -> Value {
        self.handle().insert(resource, obj)
    }

    /// One stored object.
    pub fn get(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        self.handle().get(resource, namespace, name)
    }

    /// All stored objects of a resource, in namespace/name order.
    pub fn list(&self, resource: &str) -> Vec<Value> {
        self.handle().list(resource)
    }

    /// Deletes an object at once (finalizers ignored), notifying watches. Returns what was stored.
    pub fn remove(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        self.handle().remove(resource, namespace, name)
    }

    /// Deletes every object of `resource` for which `pred` holds, as the kubelet wipes a node's slices.
    /// Returns the removed objects.
    pub fn remove_where(&self, resource: &str, pred: impl Fn(&Value) -> bool) -> Vec<Value> {
        let def = hook_resource(resource);
        let mut store = self.shared.store();
        let doomed: Vec<Value> = store
            .objects
            .iter()
            .filter(|(key, obj)| key.resource == def.plural && pred(obj))
            .map(|(_, obj)| obj.clone())
            .collect();
        doomed
            .into_iter()
            .map(|obj| self.shared.commit(&mut store, def, EventType::Deleted, obj))
            .collect()
    }

    /// Forgets the watch history, so that resuming a watch from any earlier resourceVersion gets
    /// `410 Gone` and the watcher must list again.
    pub fn compact(&self) {
        let mut store = self.shared.store();
        store.history.clear();
        store.compacted_through = store.revision;
    }

    /// Waits until `pred` holds for the objects of `resource` (in namespace/name order) and returns them,
    /// or `None` after `timeout`.
    pub async fn wait_for(
        &self,
        resource: &str,
        pred: impl Fn(&[Value]) -> bool,
        timeout: Duration,
    ) -> Option<Vec<Value>> {
        let mut events = self.shared.events.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let objects = self.list(resource);
            if pred(&objects) {
                return Some(objects);
            }
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Err(_elapsed) => return None,
                // A lag only means we missed events; the next round looks at the store anyway.
                Ok(Ok(_) | Err(broadcast::error::RecvError::Lagged(_))) => {}
                Ok(Err(broadcast::error::RecvError::Closed)) => return None,
            }
        }
    }

    /// Makes the next matching requests fail; see [`FaultSpec`].
    pub fn fail_next(&self, fault: FaultSpec) {
        lock(&self.shared.faults).pending.push(fault);
    }

    /// Delays every request by `latency` before it is handled (a watch only before its response starts).
    pub fn set_latency(&self, latency: Duration) {
        lock(&self.shared.faults).latency = latency;
    }

    /// Changes the feature gates from the next request on, as restarting kube-apiserver with other
    /// `--feature-gates` would; the stored objects stay as they are.
    pub fn set_feature_gates(&self, gates: FeatureGates) {
        *lock(&self.shared.gates) = gates;
    }

    /// Upgrades (or downgrades) the server in place: `/version`, validation and the feature gates
    /// change from the next request on; the stored objects stay, as etcd's do.
    pub fn upgrade(&self, version: ServerVersion, gates: FeatureGates) {
        *lock(&self.shared.version) = version;
        self.set_feature_gates(gates);
    }

    /// Drops pending faults and latency.
    pub fn clear_faults(&self) {
        *lock(&self.shared.faults) = Faults::default();
    }

    /// Every request answered so far, in order (a watch is recorded when its response starts).
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.requests).clone()
    }

    pub fn clear_requests(&self) {
        lock(&self.shared.requests).clear();
    }

    /// Answers every request on `resource` (a plural) with a plain-text `404 page not found`, as a real
    /// kube-apiserver does for an API group it does not serve (a CRD alone in its group, not applied).
    /// Watches already open are not cut (a real server ends them when the CRD is deleted).
    /// [`ApiServer::serve`] undoes it.
    pub fn stop_serving(&self, resource: &str) {
        lock(&self.shared.unserved).insert(hook_resource(resource).plural);
    }

    /// Serves `resource` again (its CRD applied), with the objects it held.
    pub fn serve(&self, resource: &str) {
        lock(&self.shared.unserved).remove(hook_resource(resource).plural);
    }

    /// How many create, update, patch and delete requests on `resource` succeeded and were stored
    /// (dry runs store nothing and are not counted; see [`FaultSpec`] for how subresources match).
    pub fn writes(&self, resource: &str) -> usize {
        lock(&self.shared.requests)
            .iter()
            .filter(|r| {
                r.verb.is_write()
                    && !r.dry_run
                    && r.code < 300
                    && resource_matches(resource, &r.resource)
            })
            .count()
    }

    /// How many `dryRun=All` write requests on `resource` were answered, successful or not.
    pub fn dry_runs(&self, resource: &str) -> usize {
        lock(&self.shared.requests)
            .iter()
            .filter(|r| r.verb.is_write() && r.dry_run && resource_matches(resource, &r.resource))
            .count()
    }
}
