//! Applies `GpuNodePolicy` objects on one node: watches the Node's labels and every policy, re-selects on
//! each change, publishes the policy in force through a `watch` channel, and reports each policy's
//! `Accepted` condition in its status without nodes fighting over it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::{stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::{reflector, watcher};
use kube::ResourceExt;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::apiclient::{is_not_served, retried, NOT_SERVED_RETRY_MAX};

use super::policy::{
    select, superseded_message, GpuNodePolicy, HealthSpec, MigModeSpec, PolicyCondition,
    SharingSpec, CONDITION_ACCEPTED, REASON_INVALID, REASON_SUPERSEDED, REASON_VALID,
};

/// First and longest wait before retrying failed status writes.
const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// The policy in force on this node: the last valid generation of the winning policy.
#[derive(Clone, Debug, PartialEq)]
pub struct EffectivePolicy {
    pub name: String,
    /// The `metadata.generation` whose spec is in force (older than the current one when the current
    /// spec is invalid).
    pub generation: i64,
    pub health: Option<HealthSpec>,
    pub mig_mode: Option<MigModeSpec>,
    pub sharing: Option<SharingSpec>,
    /// Whether the plugin writes GPU feature discovery's labels on its Node.
    pub classic_node_labels: bool,
    /// GPUs published for VFIO passthrough only.
    pub passthrough: Option<super::policy::PassthroughSpec>,
}

impl EffectivePolicy {
    fn of(policy: &GpuNodePolicy) -> EffectivePolicy {
        EffectivePolicy {
            name: policy.name_any(),
            generation: policy.metadata.generation.unwrap_or(0),
            health: policy.spec.health.clone(),
            mig_mode: policy.spec.mig_mode.clone(),
            sharing: policy.spec.sharing.clone(),
            classic_node_labels: policy.spec.classic_node_labels,
            passthrough: policy.spec.passthrough.clone(),
        }
    }
}

/// The part of an `Accepted` condition that decides whether it needs writing (no timestamp).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Verdict {
    accepted: bool,
    reason: &'static str,
    message: String,
    generation: Option<i64>,
}

impl Verdict {
    fn status(&self) -> &'static str {
        if self.accepted {
            "True"
        } else {
            "False"
        }
    }

    fn is_written_in(&self, condition: &PolicyCondition) -> bool {
        condition.type_ == CONDITION_ACCEPTED
            && condition.status == self.status()
            && condition.reason == self.reason
            && condition.message == self.message
            && condition.observed_generation == self.generation
    }
}

/// What one evaluation decided: the policy in force and the verdict for each policy that has one.
#[derive(Debug, Default)]
struct Decision {
    effective: Option<EffectivePolicy>,
    verdicts: Vec<(Arc<GpuNodePolicy>, Verdict)>,
}

/// Watches policies for one node; see [`PolicyWatcher::run`].
pub struct PolicyWatcher {
    policies: Api<GpuNodePolicy>,
    /// The last valid version of each policy, by name, so that breaking a policy keeps its last good
    /// spec in force.
    last_valid: HashMap<String, GpuNodePolicy>,
    /// The verdict this node last saw in (or wrote to) each policy's status. A node writes only when its
    /// own verdict changes, so nodes that see a policy differently do not overwrite each other forever.
    reported: HashMap<String, Verdict>,
}

impl PolicyWatcher {
    /// The policy in force on `node_name` now, read once (a GET of the Node, a LIST of the policies)
    /// and selected as [`PolicyWatcher::run`] would, without writing any status: what the plugin
    /// needs before its first publish, while the watcher is not running yet. A Node that does not
    /// exist has no policy. The caller bounds the time.
    pub async fn policy_in_force(
        client: kube::Client,
        node_name: &str,
    ) -> Result<Option<EffectivePolicy>, kube::Error> {
        let Some(node) = Api::<Node>::all(client.clone()).get_opt(node_name).await? else {
            return Ok(None);
        };
        let policies = Api::<GpuNodePolicy>::all(client.clone());
        let listed: Vec<Arc<GpuNodePolicy>> = policies
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .map(Arc::new)
            .collect();
        let mut this = PolicyWatcher {
            policies,
            last_valid: HashMap::new(),
            reported: HashMap::new(),
        };
        Ok(this.evaluate(node.labels(), &listed).effective)
    }

    /// Runs until `shutdown` becomes true (or its sender is dropped). Sends the policy in force on
    /// `node_name` (or `None`) to `out` whenever it changes, and writes the `Accepted` condition of the
    /// policies this node evaluates. API errors are logged and retried with backoff.
    pub async fn run(
        client: kube::Client,
        node_name: String,
        out: watch::Sender<Option<EffectivePolicy>>,
        shutdown: watch::Receiver<bool>,
    ) {
        Self::run_with(client, node_name, out, shutdown, watcher::Config::default()).await
    }

    /// [`PolicyWatcher::run`] with both watches (the node, the policies) started from `watch`, whose
    /// timeout decides how soon a half-open watch is noticed.
    pub async fn run_with(
        client: kube::Client,
        node_name: String,
        out: watch::Sender<Option<EffectivePolicy>>,
        mut shutdown: watch::Receiver<bool>,
        watch: watcher::Config,
    ) {
        let mut this = PolicyWatcher {
            policies: Api::all(client.clone()),
            last_valid: HashMap::new(),
            reported: HashMap::new(),
        };
        let (node_store, node_writer) = reflector::store::<Node>();
        let (policy_store, policy_writer) = reflector::store::<GpuNodePolicy>();
        let node_config = watch.clone().fields(&format!("metadata.name={node_name}"));
        let nodes = retried(reflector(
            node_writer,
            watcher(Api::<Node>::all(client), node_config),
        ))
        .map(|event| {
            event
                .map(|e| Source::Node(Change::of(&e)))
                .map_err(WatchError::Node)
        });
        let policies = retried(reflector(
            policy_writer,
            watcher(this.policies.clone(), watch),
        ))
        .map(|event| {
            event
                .map(|e| Source::Policy(Change::of(&e)))
                .map_err(WatchError::Policy)
        });
        let mut events = std::pin::pin!(stream::select(nodes, policies));

        let (mut node_ready, mut policies_ready) = (false, false);
        // Whether the last policy error was a 404 (the CRD is not installed), said once until it is.
        let mut crd_missing = false;
        let mut retry_at: Option<Instant> = None;
        let mut retry_delay = RETRY_MIN;
        loop {
            let retry = sleep_until_retry(retry_at);
            tokio::select! {
                biased;
                _ = shutdown.wait_for(|stop| *stop) => break,
                () = retry => retry_at = None,
                event = events.next() => match event {
                    None => break,
                    Some(Err(WatchError::Node(err))) => {
                        tracing::warn!(node = %node_name, error = %err, "watching the node failed; retrying");
                        continue;
                    }
                    Some(Err(WatchError::Policy(err))) => {
                        if is_not_served(&err) {
                            if !crd_missing {
                                tracing::warn!(node = %node_name, retry_max_s = NOT_SERVED_RETRY_MAX.as_secs(), "the GpuNodePolicy API is not served (is crd/gpu.dra.dev_gpunodepolicies.yaml applied?); no policy applies to this node; looking again with backoff up to 5 minutes, without saying so again");
                                crd_missing = true;
                            }
                        } else {
                            tracing::warn!(node = %node_name, error = %err, "watching GpuNodePolicies failed; retrying with backoff");
                        }
                        continue;
                    }
                    Some(Ok(source)) => {
                        match source {
                            Source::Node(Change::Listed) => node_ready = true,
                            Source::Policy(Change::Listed) => {
                                if crd_missing {
                                    tracing::info!(node = %node_name, "the GpuNodePolicy API is served now");
                                    crd_missing = false;
                                }
                                policies_ready = true;
                            }
                            Source::Node(Change::Listing) | Source::Policy(Change::Listing) => continue,
                            Source::Node(Change::Changed) | Source::Policy(Change::Changed) => {}
                        }
                    }
                },
            }
            if !(node_ready && policies_ready) {
                continue;
            }
            let Some(node) = node_store.state().into_iter().next() else {
                tracing::warn!(node = %node_name, "node not found; GpuNodePolicies wait until it exists");
                continue;
            };
            let decision = this.evaluate(node.labels(), &policy_store.state());
            let published = decision.effective.clone();
            let changed = out.send_if_modified(|current| {
                let changed = *current != published;
                if changed {
                    current.clone_from(&published);
                }
                changed
            });
            if changed {
                match &published {
                    Some(p) => {
                        tracing::info!(node = %node_name, policy = %p.name, generation = p.generation, "GpuNodePolicy in force")
                    }
                    None => tracing::info!(node = %node_name, "no GpuNodePolicy selects this node"),
                }
            }
            if this.report(&decision.verdicts).await {
                retry_at = None;
                retry_delay = RETRY_MIN;
            } else {
                retry_at = Some(Instant::now() + retry_delay);
                retry_delay = (retry_delay * 2).min(RETRY_MAX);
            }
        }
    }

    /// Chooses the policy in force for `labels` and a verdict for every policy that is invalid or selects
    /// this node. Remembers valid specs and forgets policies that are gone.
    fn evaluate(
        &mut self,
        labels: &BTreeMap<String, String>,
        policies: &[Arc<GpuNodePolicy>],
    ) -> Decision {
        let present: HashMap<String, &Arc<GpuNodePolicy>> =
            policies.iter().map(|p| (p.name_any(), p)).collect();
        // A policy deleted and recreated under the same name has a new uid and starts afresh.
        self.last_valid.retain(|name, old| {
            present
                .get(name)
                .is_some_and(|p| p.metadata.uid == old.metadata.uid)
        });
        self.reported.retain(|name, _| present.contains_key(name));

        let mut problems = HashMap::new();
        let mut candidates = Vec::new();
        for policy in policies {
            match policy.spec.validate() {
                Ok(()) => {
                    self.last_valid
                        .insert(policy.name_any(), GpuNodePolicy::clone(policy));
                    candidates.push(GpuNodePolicy::clone(policy));
                }
                Err(messages) => {
                    problems.insert(policy.name_any(), messages);
                    if let Some(previous) = self.last_valid.get(&policy.name_any()) {
                        candidates.push(previous.clone());
                    }
                }
            }
        }
        let winner = select(&candidates, labels);

        let mut verdicts = Vec::new();
        for policy in policies {
            let generation = policy.metadata.generation;
            let verdict = if let Some(messages) = problems.get(&policy.name_any()) {
                Verdict {
                    accepted: false,
                    reason: REASON_INVALID,
                    message: messages.join("; "),
                    generation,
                }
            } else if !policy.spec.node_selector.matches(labels) {
                // Whether it is in force elsewhere is for the nodes it selects to say.
                continue;
            } else {
                match winner {
                    Some(w) if w.name_any() == policy.name_any() => Verdict {
                        accepted: true,
                        reason: REASON_VALID,
                        message: "the policy is valid and in force on the nodes it selects".into(),
                        generation,
                    },
                    Some(w) => Verdict {
                        accepted: false,
                        reason: REASON_SUPERSEDED,
                        message: superseded_message(policy, w),
                        generation,
                    },
                    // A valid policy that selects this node always has a winner; nothing to say otherwise.
                    None => continue,
                }
            };
            verdicts.push((policy.clone(), verdict));
        }
        Decision {
            effective: winner.map(EffectivePolicy::of),
            verdicts,
        }
    }

    /// Writes the verdicts that are neither in the status already nor already reported by this node.
    /// Returns false when a write failed and should be retried.
    async fn report(&mut self, verdicts: &[(Arc<GpuNodePolicy>, Verdict)]) -> bool {
        let mut all_written = true;
        for (policy, verdict) in verdicts {
            let name = policy.name_any();
            let conditions = policy
                .status
                .as_ref()
                .map(|s| s.conditions.as_slice())
                .unwrap_or_default();
            let current = conditions.iter().find(|c| c.type_ == CONDITION_ACCEPTED);
            if current.is_some_and(|c| verdict.is_written_in(c))
                || self.reported.get(&name) == Some(verdict)
            {
                self.reported.insert(name, verdict.clone());
                continue;
            }
            match self
                .write_condition(policy, conditions, current, verdict)
                .await
            {
                Ok(()) => {
                    self.reported.insert(name, verdict.clone());
                }
                // Someone else wrote in between; their change arrives as an event and we look again.
                Err(kube::Error::Api(status)) if status.code == 409 => {}
                Err(err) => {
                    tracing::warn!(policy = %name, error = %err, "writing the Accepted condition of GpuNodePolicy failed; retrying");
                    all_written = false;
                }
            }
        }
        all_written
    }

    async fn write_condition(
        &self,
        policy: &GpuNodePolicy,
        conditions: &[PolicyCondition],
        current: Option<&PolicyCondition>,
        verdict: &Verdict,
    ) -> Result<(), kube::Error> {
        // As in metav1.Condition, the transition time moves only when the status does.
        let last_transition_time = match current {
            Some(c) if c.status == verdict.status() => c.last_transition_time.clone(),
            _ => now_rfc3339(),
        };
        let condition = PolicyCondition {
            type_: CONDITION_ACCEPTED.to_string(),
            status: verdict.status().to_string(),
            reason: verdict.reason.to_string(),
            message: verdict.message.clone(),
            last_transition_time,
            observed_generation: verdict.generation,
        };
        let mut merged: Vec<PolicyCondition> = conditions
            .iter()
            .filter(|c| c.type_ != CONDITION_ACCEPTED)
            .cloned()
            .collect();
        merged.push(condition);
        // The resourceVersion makes the write fail rather than drop conditions someone added meanwhile.
        let patch = json!({
            "metadata": { "resourceVersion": policy.resource_version() },
            "status": { "conditions": merged },
        });
        self.policies
            .patch_status(
                &policy.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    }
}

/// What a watch event means for the evaluation.
enum Change {
    /// A (re)list is under way; the store still holds the previous state.
    Listing,
    /// A (re)list finished; the store is complete.
    Listed,
    /// An object was added, changed or deleted.
    Changed,
}

impl Change {
    fn of<K>(event: &watcher::Event<K>) -> Change {
        match event {
            watcher::Event::Init | watcher::Event::InitApply(_) => Change::Listing,
            watcher::Event::InitDone => Change::Listed,
            watcher::Event::Apply(_) | watcher::Event::Delete(_) => Change::Changed,
        }
    }
}

enum Source {
    Node(Change),
    Policy(Change),
}

/// Which of the two watches failed.
enum WatchError {
    Node(watcher::Error),
    Policy(watcher::Error),
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Sleeps until a retry is due, or forever when none is pending: one arm of a `select!` loop.
pub(crate) async fn sleep_until_retry(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
#[path = "watcher_tests.rs"]
mod tests;
