//! The claims to place, checked and compiled once before any node: every request's DeviceClass exists
//! and every selector compiles (the scheduler checks these before it looks at nodes, so a failure is
//! an error for the whole pod), and the selectors are kept compiled for the per-node breakdown.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{CapacityRequirements, DeviceSelector, DeviceToleration};

use crate::cel::Selector;

use super::subject::SubjectClaim;
use super::ExplainError;

/// One selector, compiled once for all nodes.
pub(super) struct Compiled {
    /// `class gpu.dra.dev` or `request gpu`.
    pub(super) origin: String,
    pub(super) from_class: bool,
    pub(super) expression: String,
    pub(super) selector: Selector,
}

/// One way to satisfy a request: the request itself, or one subrequest of `firstAvailable`.
pub(super) struct Alternative {
    /// `gpu` or `gpu/small`.
    pub(super) label: String,
    pub(super) class: String,
    pub(super) selectors: Vec<Compiled>,
    /// `None` for allocation mode All.
    pub(super) wanted: Option<usize>,
    pub(super) admin: bool,
    pub(super) tolerations: Vec<DeviceToleration>,
    /// The request's `capacity` (what it consumes of a device's capacities).
    pub(super) capacity: Option<CapacityRequirements>,
}

pub(super) struct RequestPlan {
    pub(super) name: String,
    pub(super) alternatives: Vec<Alternative>,
}

/// A claim's requests with their selectors compiled, and its constraints.
pub(super) struct ClaimPlan {
    pub(super) name: String,
    pub(super) requests: Vec<RequestPlan>,
    /// (`matchAttribute` or not, attribute, the requests it covers; empty: all).
    pub(super) constraints: Vec<(bool, String, Vec<String>)>,
}

/// Checks what the scheduler checks before any node (the classes exist, the selectors compile) and
/// compiles the selectors for the per-node breakdown. A failure here fails on every node: an error.
pub(super) fn plan(
    claim: &SubjectClaim,
    classes: &BTreeMap<String, Vec<String>>,
) -> Result<ClaimPlan, ExplainError> {
    let error = |message: String| ExplainError::Claim {
        claim: claim.name.clone(),
        message,
    };
    let devices = claim.spec.devices.as_ref();
    let mut requests = Vec::new();
    for request in devices
        .and_then(|d| d.requests.as_ref())
        .into_iter()
        .flatten()
    {
        let mut alternatives = Vec::new();
        let mut add = |label: String,
                       class: &str,
                       selectors: &[DeviceSelector],
                       mode: Option<&str>,
                       count: Option<i64>,
                       admin: bool,
                       tolerations: &[DeviceToleration],
                       capacity: Option<&CapacityRequirements>|
         -> Result<(), ExplainError> {
            let expressions = classes.get(class).ok_or_else(|| {
                error(format!(
                    "request {label}: device class {class} does not exist"
                ))
            })?;
            let mut compiled = Vec::new();
            let own = selectors
                .iter()
                .map(|s| s.cel.as_ref().map(|c| c.expression.clone()));
            for (from_class, index, expression) in expressions
                .iter()
                .map(|e| Some(e.clone()))
                .enumerate()
                .map(|(i, e)| (true, i, e))
                .chain(own.enumerate().map(|(i, e)| (false, i, e)))
            {
                let origin = if from_class {
                    format!("class {class}")
                } else {
                    format!("request {label}")
                };
                let expression = expression.filter(|e| !e.is_empty()).ok_or_else(|| {
                    error(format!(
                        "{origin}: selector #{index}: CEL expression empty (unsupported selector type?)"
                    ))
                })?;
                let selector = Selector::compile(&expression)
                    .map_err(|e| error(format!("{origin}: selector #{index}: CEL {e}")))?;
                compiled.push(Compiled {
                    origin,
                    from_class,
                    expression,
                    selector,
                });
            }
            let wanted = match mode {
                Some("All") => None,
                None | Some("ExactCount") => Some(usize::try_from(count.unwrap_or(1)).unwrap_or(0)),
                Some(other) => {
                    return Err(error(format!(
                        "request {label}: unsupported allocationMode {other}"
                    )))
                }
            };
            alternatives.push(Alternative {
                label,
                class: class.to_string(),
                selectors: compiled,
                wanted,
                admin,
                tolerations: tolerations.to_vec(),
                capacity: capacity.cloned(),
            });
            Ok(())
        };
        match (&request.exactly, &request.first_available) {
            (Some(e), None) => add(
                request.name.clone(),
                &e.device_class_name,
                e.selectors.as_deref().unwrap_or_default(),
                e.allocation_mode.as_deref(),
                e.count,
                e.admin_access == Some(true),
                e.tolerations.as_deref().unwrap_or_default(),
                e.capacity.as_ref(),
            )?,
            (None, Some(subs)) if !subs.is_empty() => {
                for s in subs {
                    add(
                        format!("{}/{}", request.name, s.name),
                        &s.device_class_name,
                        s.selectors.as_deref().unwrap_or_default(),
                        s.allocation_mode.as_deref(),
                        s.count,
                        false,
                        s.tolerations.as_deref().unwrap_or_default(),
                        s.capacity.as_ref(),
                    )?
                }
            }
            _ => {
                return Err(error(format!(
                    "request {}: needs exactly one of exactly and a non-empty firstAvailable",
                    request.name
                )))
            }
        }
        requests.push(RequestPlan {
            name: request.name.clone(),
            alternatives,
        });
    }
    if requests.is_empty() {
        return Err(error("the claim has no requests".into()));
    }
    let constraints = devices
        .and_then(|d| d.constraints.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let scope = c.requests.clone().unwrap_or_default();
            match (&c.match_attribute, &c.distinct_attribute) {
                (Some(a), None) => Some((true, a.clone(), scope)),
                (None, Some(a)) => Some((false, a.clone(), scope)),
                _ => None,
            }
        })
        .collect();
    Ok(ClaimPlan {
        name: claim.name.clone(),
        requests,
        constraints,
    })
}
