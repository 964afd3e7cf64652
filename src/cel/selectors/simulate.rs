//! `gpu-dra selectors allocate`: decides one ResourceClaim on one node the way the scheduler's
//! allocator would, from files, and says which devices it gets or why not (DESIGN.md's contract).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{DeviceClass, DeviceRequestAllocationResult, ResourceSlice};
use serde_json::json;
use thiserror::Error;

use crate::cel::allocator::{self, AllocationError, InUse, Node, Pools};
use crate::cel::input::NamedClaim;

/// What the simulation is given.
#[derive(Debug, Clone)]
pub struct Simulation {
    pub claim: NamedClaim,
    pub classes: Vec<DeviceClass>,
    pub slices: Vec<ResourceSlice>,
    /// The node's name; `None` takes the one node the slices name.
    pub node: Option<String>,
    pub node_labels: BTreeMap<String, String>,
    /// What other claims hold (`--in-use`).
    pub in_use: InUse,
}

/// The scheduler's answer for the node.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Devices in request order, as the scheduler records them in `status.allocation`.
    Allocated {
        node: String,
        results: Vec<DeviceRequestAllocationResult>,
    },
    /// Not on this node now; `reason` names the cause (devices, constraint, counters, taints).
    Unallocatable { node: String, reason: String },
}

/// No decision: the input is invalid, a selector failed, the node has invalid pools and nothing else
/// fits, or an `All` request cannot be decided; the scheduler reports these as errors.
#[derive(Debug, Error)]
pub enum SimulationError {
    // The cause is part of the message and deliberately not a `source`: printed with its chain
    // (`{:#}`), it would appear twice.
    #[error("claim {claim}: {error}")]
    Allocation {
        claim: String,
        error: Box<AllocationError>,
    },
    #[error("the slices are for several nodes ({}); choose one with --node", .nodes.join(", "))]
    SeveralNodes { nodes: Vec<String> },
}

impl SimulationError {
    /// Exit code of `selectors allocate` (2: an error).
    pub fn exit_code(&self) -> i32 {
        2
    }
}

/// Runs the allocator on the node's view of the slices.
pub fn simulate(input: &Simulation) -> Result<Decision, SimulationError> {
    let name = match &input.node {
        Some(name) => name.clone(),
        None => only_node(&input.slices)?,
    };
    let node = Node {
        name: name.clone(),
        labels: input.node_labels.clone(),
    };
    let pools = Pools::from_slices(&input.slices, Some(&node));
    let classes = allocator::class_selectors(&input.classes);
    match allocator::allocate(&pools, &classes, &input.in_use, &input.claim.spec) {
        Ok(results) => Ok(Decision::Allocated {
            node: name,
            results,
        }),
        // The claim cannot be satisfied here now; everything else is an error the scheduler reports
        // (invalid pools, an `All` request on an incomplete pool or against a constraint, CEL).
        Err(
            error @ (AllocationError::NotEnoughDevices { .. }
            | AllocationError::Unsatisfiable { .. }),
        ) => Ok(Decision::Unallocatable {
            node: name,
            reason: error.to_string(),
        }),
        Err(error) => Err(SimulationError::Allocation {
            claim: input.claim.name.clone(),
            error: Box::new(error),
        }),
    }
}

/// The node the slices are published for, when they name exactly one; none (slices for all nodes
/// or by selector only) gives an unnamed node.
fn only_node(slices: &[ResourceSlice]) -> Result<String, SimulationError> {
    let nodes: BTreeSet<&str> = slices
        .iter()
        .filter_map(|s| s.spec.node_name.as_deref())
        .chain(
            slices
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .filter_map(|d| d.node_name.as_deref()),
        )
        .collect();
    match nodes.len() {
        0 => Ok(String::new()),
        1 => Ok(nodes.into_iter().next().unwrap_or_default().to_string()),
        _ => Err(SimulationError::SeveralNodes {
            nodes: nodes.into_iter().map(str::to_string).collect(),
        }),
    }
}

impl Decision {
    /// 0 allocated, 1 not.
    pub fn exit_code(&self) -> i32 {
        match self {
            Decision::Allocated { .. } => 0,
            Decision::Unallocatable { .. } => 1,
        }
    }

    /// `{"allocated": true, "results": [{"request", "driver", "pool", "device"}]}` (plus `adminAccess`
    /// and `tolerations` on a result only where the request sets them, and `shareID` and
    /// `consumedCapacity` on a share of a device that allows multiple allocations, as in
    /// `status.allocation`), or `{"allocated": false, "reason": "..."}`.
    pub fn to_json(&self) -> String {
        let value = match self {
            Decision::Allocated { results, .. } => json!({"allocated": true, "results": results}),
            Decision::Unallocatable { reason, .. } => {
                json!({"allocated": false, "reason": reason})
            }
        };
        serde_json::to_string_pretty(&value).unwrap_or_default() + "\n"
    }

    /// The same for people.
    pub fn to_text(&self) -> String {
        match self {
            Decision::Allocated { node, results } => {
                let mut text = format!("allocated on node {}:\n", display_node(node));
                for r in results {
                    text += &format!("  {}: {}/{}/{}", r.request, r.driver, r.pool, r.device);
                    if r.admin_access == Some(true) {
                        text += " (admin access)";
                    }
                    if let Some(share) = &r.share_id {
                        let consumed: Vec<String> = r
                            .consumed_capacity
                            .iter()
                            .flatten()
                            .map(|(name, q)| format!("{name} {}", q.0))
                            .collect();
                        text += &format!(" (share {share}");
                        if !consumed.is_empty() {
                            text += &format!(": {}", consumed.join(", "));
                        }
                        text.push(')');
                    }
                    text.push('\n');
                }
                text
            }
            Decision::Unallocatable { node, reason } => {
                format!("not allocatable on node {}: {reason}\n", display_node(node))
            }
        }
    }
}

fn display_node(node: &str) -> &str {
    if node.is_empty() {
        "(unnamed)"
    } else {
        node
    }
}
