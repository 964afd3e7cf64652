//! A claim's requests as the search uses them: each `exactly` request, or each subrequest of a
//! `firstAvailable` one, becomes an alternative with its class, compiled selectors, mode and count.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequirements, DeviceRequest, DeviceSelector, DeviceToleration,
};

use super::capacity::{self, Requests};
use super::AllocationError;
use crate::cel::{CelError, DeviceView, Selector};

pub(super) struct PreparedRequest {
    /// One alternative for `exactly`, the subrequests in order for `firstAvailable`.
    pub(super) alternatives: Vec<Alternative>,
}

pub(super) struct Alternative {
    /// `req` or `req/sub`, as written into the result.
    pub(super) label: String,
    /// The request's name, which constraints may name instead of `label`.
    pub(super) base: String,
    pub(super) class: String,
    pub(super) class_selectors: Vec<CompiledSelector>,
    pub(super) selectors: Vec<CompiledSelector>,
    pub(super) mode: Mode,
    pub(super) admin: bool,
    pub(super) tolerations: Vec<DeviceToleration>,
    /// `capacity.requests`.
    pub(super) capacity: Requests,
    /// For `All`: every matching device, fixed before the search as the scheduler does.
    pub(super) all: Vec<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Count(usize),
    All,
}

impl PreparedRequest {
    /// The fewest devices any of its alternatives takes.
    pub(super) fn minimum(&self) -> usize {
        self.alternatives
            .iter()
            .map(Alternative::wanted)
            .min()
            .unwrap_or_default()
    }
}

impl Alternative {
    /// Devices it takes: its count, or for `All` every matching device.
    pub(super) fn wanted(&self) -> usize {
        match self.mode {
            Mode::Count(count) => count,
            Mode::All => self.all.len(),
        }
    }
}

/// A selector expression and what compiling it gave; a compile error surfaces when the selector is
/// first evaluated, as in the scheduler.
#[derive(Debug)]
pub(crate) struct CompiledSelector {
    pub(crate) expression: String,
    pub(crate) compiled: Result<Selector, CelError>,
}

impl CompiledSelector {
    pub(crate) fn new(expression: &str) -> CompiledSelector {
        CompiledSelector {
            expression: expression.to_string(),
            compiled: Selector::compile(expression),
        }
    }
}

/// Evaluates `selectors` in order on `device` and stops at the first that does not say true: `Ok(None)`
/// when all match, `Ok(Some(i))` when selector `i` said false, `Err((i, error))` on a CEL error.
pub(crate) fn first_mismatch(
    selectors: &[CompiledSelector],
    device: &DeviceView,
) -> Result<Option<usize>, (usize, CelError)> {
    for (index, selector) in selectors.iter().enumerate() {
        let compiled = selector
            .compiled
            .as_ref()
            .map_err(|error| (index, error.clone()))?;
        match compiled.matches(device) {
            Ok(true) => {}
            Ok(false) => return Ok(Some(index)),
            Err(error) => return Err((index, error)),
        }
    }
    Ok(None)
}

pub(super) fn prepare_request(
    request: &DeviceRequest,
    classes: &BTreeMap<String, Vec<String>>,
) -> Result<PreparedRequest, AllocationError> {
    let invalid = |reason: &str| AllocationError::InvalidRequest {
        request: request.name.clone(),
        reason: reason.to_string(),
    };
    let alternatives = match (&request.exactly, &request.first_available) {
        (Some(exactly), None) => vec![prepare_alternative(
            request.name.clone(),
            &request.name,
            AlternativeSpec {
                class: &exactly.device_class_name,
                selectors: exactly.selectors.as_deref().unwrap_or_default(),
                mode: exactly.allocation_mode.as_deref(),
                count: exactly.count,
                admin: exactly.admin_access == Some(true),
                tolerations: exactly.tolerations.as_deref().unwrap_or_default(),
                capacity: exactly.capacity.as_ref(),
            },
            classes,
        )?],
        (None, Some(subrequests)) if !subrequests.is_empty() => subrequests
            .iter()
            .map(|sub| {
                prepare_alternative(
                    format!("{}/{}", request.name, sub.name),
                    &request.name,
                    AlternativeSpec {
                        class: &sub.device_class_name,
                        selectors: sub.selectors.as_deref().unwrap_or_default(),
                        mode: sub.allocation_mode.as_deref(),
                        count: sub.count,
                        admin: false,
                        tolerations: sub.tolerations.as_deref().unwrap_or_default(),
                        capacity: sub.capacity.as_ref(),
                    },
                    classes,
                )
            })
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(invalid(
                "needs exactly one of exactly and a non-empty firstAvailable",
            ))
        }
    };
    Ok(PreparedRequest { alternatives })
}

struct AlternativeSpec<'a> {
    class: &'a str,
    selectors: &'a [DeviceSelector],
    mode: Option<&'a str>,
    count: Option<i64>,
    admin: bool,
    tolerations: &'a [DeviceToleration],
    capacity: Option<&'a CapacityRequirements>,
}

fn prepare_alternative(
    label: String,
    base: &str,
    spec: AlternativeSpec<'_>,
    classes: &BTreeMap<String, Vec<String>>,
) -> Result<Alternative, AllocationError> {
    let invalid = |reason: String| AllocationError::InvalidRequest {
        request: label.clone(),
        reason,
    };
    if spec.class.is_empty() {
        return Err(invalid("deviceClassName is empty".into()));
    }
    let class_expressions =
        classes
            .get(spec.class)
            .ok_or_else(|| AllocationError::UnknownDeviceClass {
                request: label.clone(),
                class: spec.class.to_string(),
            })?;
    let class_selectors = class_expressions
        .iter()
        .map(|expression| CompiledSelector::new(expression))
        .collect();
    let selectors = spec
        .selectors
        .iter()
        .enumerate()
        .map(|(index, selector)| match &selector.cel {
            Some(cel) => Ok(CompiledSelector::new(&cel.expression)),
            None => Err(invalid(format!(
                "selector #{index}: CEL expression empty (unsupported selector type?)"
            ))),
        })
        .collect::<Result<_, _>>()?;
    let mode = match spec.mode {
        None | Some("ExactCount") => {
            let count = spec.count.unwrap_or(1);
            if count < 1 {
                return Err(invalid(format!("count {count} is not positive")));
            }
            // More than an allocation holds is refused for the claim as a whole, where no other
            // subrequest takes fewer; a subrequest that asks for that many is passed over.
            let count = usize::try_from(count).unwrap_or(usize::MAX);
            Mode::Count(count)
        }
        Some("All") => Mode::All,
        Some(other) => return Err(invalid(format!("unsupported allocationMode {other}"))),
    };
    let capacity = capacity::requests(spec.capacity).map_err(invalid)?;
    Ok(Alternative {
        label,
        base: base.to_string(),
        class: spec.class.to_string(),
        class_selectors,
        selectors,
        mode,
        admin: spec.admin,
        tolerations: spec.tolerations.to_vec(),
        capacity,
        all: Vec::new(),
    })
}
