//! A domain's status as the controller computes it (pure): the node entries the kubelet plugins wrote,
//! with those on Nodes that went NotReady or were deleted marked NotReady; `status.status` (Ready when
//! enough entries are); the `Placed` and `Ready` conditions.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;

use crate::domains::api::{ComputeDomainStatus, DomainCondition, DomainObject, NOT_READY, READY};
use crate::domains::placement::{nodes_needed, Decision};

pub const PLACED_CONDITION: &str = "Placed";
pub const READY_CONDITION: &str = "Ready";

/// Node name → why it is not Ready (`None`: Ready). A node that is not listed was deleted.
pub type NodeHealth = BTreeMap<String, Option<String>>;

/// The health of every listed Node, from its `Ready` condition.
pub fn node_health(nodes: &[Node]) -> NodeHealth {
    nodes
        .iter()
        .filter_map(|node| {
            let name = node.metadata.name.clone()?;
            let ready = node
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
            let problem = match ready {
                Some(c) if c.status == "True" => None,
                Some(c) => Some(format!(
                    "node {name} is NotReady (Ready={}{}{})",
                    c.status,
                    c.reason
                        .as_deref()
                        .map(|r| format!(", {r}"))
                        .unwrap_or_default(),
                    c.message
                        .as_deref()
                        .map(|m| format!(": {m}"))
                        .unwrap_or_default()
                )),
                None => Some(format!("node {name} has no Ready condition")),
            };
            Some((name, problem))
        })
        .collect()
}

/// A node entry this round turned NotReady, for the Warning Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLost {
    pub node: String,
    pub reason: String,
}

/// What the status should become, and which node entries turned NotReady.
#[derive(Debug, Clone, PartialEq)]
pub struct NextStatus {
    pub status: ComputeDomainStatus,
    pub lost: Vec<NodeLost>,
}

/// The status `domain` should have: `decision` is its placement, `template_problem` why its template
/// could not be written (it then counts as not placed).
pub fn next_status(
    domain: &DomainObject,
    decision: &Decision,
    template_problem: Option<&str>,
    health: &NodeHealth,
) -> NextStatus {
    let mut nodes = domain.status.nodes.clone();
    let mut lost = Vec::new();
    for entry in nodes.iter_mut().filter(|e| e.status == READY) {
        let problem = match health.get(&entry.name) {
            None => Some(format!("node {} was deleted", entry.name)),
            Some(problem) => problem.clone(),
        };
        if let Some(reason) = problem {
            entry.status = NOT_READY.into();
            entry.reason = Some(reason.clone());
            lost.push(NodeLost {
                node: entry.name.clone(),
                reason,
            });
        }
    }
    let ready = nodes.iter().filter(|e| e.status == READY).count();
    let needed = nodes_needed(domain);
    let placed = match (decision, template_problem) {
        (_, Some(problem)) => condition(PLACED_CONDITION, false, "TemplateNotWritten", problem),
        (Decision::Kept(p) | Decision::New(p), None) => condition(
            PLACED_CONDITION,
            true,
            "Placed",
            &format!("NVLink clique {}", p.clique),
        ),
        (Decision::Refused(reason), None) => {
            condition(PLACED_CONDITION, false, "SpecNotSupported", reason)
        }
        (Decision::Waiting(reason), None) => {
            condition(PLACED_CONDITION, false, "NoCliqueFits", reason)
        }
    };
    let is_ready = ready >= needed;
    let ready_condition = condition(
        READY_CONDITION,
        is_ready,
        if is_ready {
            "NodesReady"
        } else {
            "NodesNotReady"
        },
        &format!("{ready} of {needed} node(s) Ready"),
    );
    NextStatus {
        status: ComputeDomainStatus {
            status: if is_ready { READY } else { NOT_READY }.into(),
            nodes,
            conditions: vec![placed, ready_condition],
        },
        lost,
    }
}

/// The status of a domain whose spec does not parse: NotReady, not placed, with the parse error.
pub fn invalid_status(error: &str) -> ComputeDomainStatus {
    ComputeDomainStatus {
        status: NOT_READY.into(),
        nodes: Vec::new(),
        conditions: vec![condition(PLACED_CONDITION, false, "InvalidSpec", error)],
    }
}

fn condition(type_: &str, status: bool, reason: &str, message: &str) -> DomainCondition {
    DomainCondition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domains::api::{ComputeDomainNode, DomainGroup};
    use crate::domains::placement::Placed;

    fn domain(num_nodes: u32, entries: &[(&str, &str)]) -> DomainObject {
        let mut domain = DomainObject {
            group: DomainGroup::Ours,
            namespace: "team".into(),
            name: "d".into(),
            uid: "u".into(),
            resource_version: None,
            deleting: false,
            annotations: Default::default(),
            spec: Default::default(),
            status: Default::default(),
        };
        domain.spec.num_nodes = num_nodes;
        domain.status.nodes = entries
            .iter()
            .map(|(name, status)| ComputeDomainNode {
                name: name.to_string(),
                status: status.to_string(),
                ..Default::default()
            })
            .collect();
        domain
    }

    fn placed() -> Decision {
        Decision::Kept(Placed {
            clique: "c.0".into(),
        })
    }

    fn health(entries: &[(&str, Option<&str>)]) -> NodeHealth {
        entries
            .iter()
            .map(|(n, p)| (n.to_string(), p.map(String::from)))
            .collect()
    }

    #[test]
    fn ready_when_enough_entries_are() {
        let all = health(&[("n0", None), ("n1", None)]);
        let next = next_status(
            &domain(2, &[("n0", READY), ("n1", READY)]),
            &placed(),
            None,
            &all,
        );
        assert_eq!(next.status.status, READY);
        assert!(next.lost.is_empty());
        assert_eq!(next.status.conditions[0].message, "NVLink clique c.0");
        let next = next_status(
            &domain(2, &[("n0", READY), ("n1", NOT_READY)]),
            &placed(),
            None,
            &all,
        );
        assert_eq!(next.status.status, NOT_READY);
        assert_eq!(next.status.conditions[1].message, "1 of 2 node(s) Ready");
        // numNodes 0: one node is enough.
        let next = next_status(&domain(0, &[("n0", READY)]), &placed(), None, &all);
        assert_eq!(next.status.status, READY);
    }

    #[test]
    fn entries_on_lost_nodes_turn_not_ready_once() {
        let sick = health(&[("n0", Some("node n0 is NotReady (Ready=Unknown)"))]);
        let before = domain(2, &[("n0", READY), ("gone", READY)]);
        let next = next_status(&before, &placed(), None, &sick);
        assert_eq!(next.lost.len(), 2);
        assert_eq!(next.lost[1].reason, "node gone was deleted");
        assert!(next.status.nodes.iter().all(|n| n.status == NOT_READY));
        let mut after = before.clone();
        after.status = next.status;
        assert!(next_status(&after, &placed(), None, &sick).lost.is_empty());
    }

    #[test]
    fn not_placed_and_template_problems_show_in_the_placed_condition() {
        let none = health(&[]);
        let waiting = Decision::Waiting("no room".into());
        let next = next_status(&domain(1, &[]), &waiting, None, &none);
        assert_eq!(next.status.conditions[0].status, "False");
        assert_eq!(next.status.conditions[0].reason, "NoCliqueFits");
        let next = next_status(&domain(1, &[]), &placed(), Some("taken"), &none);
        assert_eq!(next.status.conditions[0].reason, "TemplateNotWritten");
    }
}
