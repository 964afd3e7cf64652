//! `gpu-dra selectors check`: which devices each DeviceClass and each claim request selects, which it
//! does not and the first selector that said no, and CEL errors, which block scheduling as in the
//! scheduler; also malformed `GpuConfig` / `MigConfig` configs of this driver, which fail prepare.
//! The report it fills in and its table live in `report`; the allocation simulator (`selectors
//! allocate`) lives in [`simulate`].

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, DeviceClass, DeviceSelector, ResourceSlice};

use super::allocator::{first_mismatch, Candidate, CompiledSelector, SelectorOrigin};
use super::device::split_name;
use super::input::NamedClaim;
use super::{CelError, DeviceView};
use crate::claims::configs::{check_claim_spec, check_device_class, ConfigProblem};
use hints::PublishedNames;

mod hints;
mod report;
pub mod simulate;

pub use report::{CheckError, CheckReport, NoMatch, SelectorRef, Subject};

/// A device to check, with the driver and pool of its slice, and the names it publishes.
#[derive(Debug, Clone)]
pub struct SliceDevice {
    pub id: Candidate,
    pub view: DeviceView,
    /// Attribute names as (domain, id); a bare name has the driver's domain.
    pub attributes: Vec<(String, String)>,
    /// Capacity names as (domain, id).
    pub capacity: Vec<(String, String)>,
}

/// Every device of `slices`, in slice order (pools and generations are not considered: a check looks
/// at what is published, not at what is allocatable).
pub fn slice_devices(slices: &[ResourceSlice]) -> Vec<SliceDevice> {
    slices
        .iter()
        .flat_map(|slice| {
            slice.spec.devices.iter().flatten().map(|device: &Device| {
                let id = Candidate {
                    driver: slice.spec.driver.clone(),
                    pool: slice.spec.pool.name.clone(),
                    device: device.name.clone(),
                };
                let qualified = |name: &String| {
                    let (domain, id) = split_name(name, &id.driver);
                    (domain.to_owned(), id.to_owned())
                };
                SliceDevice {
                    view: DeviceView::new(&id.driver, device),
                    attributes: device
                        .attributes
                        .iter()
                        .flatten()
                        .map(|(n, _)| qualified(n))
                        .collect(),
                    capacity: device
                        .capacity
                        .iter()
                        .flatten()
                        .map(|(n, _)| qualified(n))
                        .collect(),
                    id,
                }
            })
        })
        .collect()
}

/// Checks every class of `classes` on its own, then every request of every claim with its class; and
/// the opaque configs of `driver` in both.
pub fn check(
    driver: &str,
    classes: &[DeviceClass],
    claims: &[NamedClaim],
    devices: &[SliceDevice],
) -> CheckReport {
    let by_name: BTreeMap<&str, &DeviceClass> = classes
        .iter()
        .filter_map(|c| Some((c.metadata.name.as_deref()?, c)))
        .collect();
    let published = PublishedNames::of(devices);
    let mut subjects = Vec::new();
    for class in classes {
        let name = class.metadata.name.clone().unwrap_or_default();
        let mut subject = Subject {
            class: name.clone(),
            ..Subject::default()
        };
        let problems = check_device_class(driver, class);
        subject
            .errors
            .extend(config_errors(&format!("DeviceClass {name}"), problems));
        evaluate(
            &mut subject,
            &class_selectors(&name, class),
            devices,
            &published,
        );
        subjects.push(subject);
    }
    for claim in claims {
        let first_subject = subjects.len();
        for request in claim_requests(claim) {
            let mut subject = Subject {
                class: request.class.clone(),
                claim: Some(claim.name.clone()),
                request: Some(request.label.clone()),
                ..Subject::default()
            };
            let Some(class) = by_name.get(request.class.as_str()) else {
                subject.errors.push(input_error(format!(
                    "DeviceClass {} does not exist (pass its file with --class)",
                    request.class
                )));
                subjects.push(subject);
                continue;
            };
            let mut groups = class_selectors(&request.class, class);
            let origin = SelectorOrigin::Request(request.label.clone());
            match request_selectors(request.selectors) {
                Ok(selectors) => groups.push((origin, selectors)),
                Err(index) => {
                    subject.errors.push(input_error(format!(
                        "request {}: selector #{index}: CEL expression empty (unsupported selector type?)",
                        request.label
                    )));
                    subjects.push(subject);
                    continue;
                }
            }
            evaluate(&mut subject, &groups, devices, &published);
            subjects.push(subject);
        }
        let problems = check_claim_spec(driver, &claim.spec);
        if !problems.is_empty() {
            if subjects.len() == first_subject {
                subjects.push(Subject {
                    claim: Some(claim.name.clone()),
                    ..Subject::default()
                });
            }
            let errors = config_errors(&format!("claim {}", claim.name), problems);
            subjects[first_subject].errors.splice(0..0, errors);
        }
    }
    // IMEX channels are published only by nodes of an NVLink clique: where the slices hold none, the
    // channel class matching nothing is expected (as the plugin's own class self-test treats it).
    let any_channel = devices
        .iter()
        .any(|d| crate::domains::channels::parse_device_name(&d.id.device).is_some());
    // So are passthrough devices, by nodes where a GpuNodePolicy chose GPUs for passthrough.
    let any_passthrough = devices
        .iter()
        .any(|d| crate::devices::passthrough::parse_device_name(&d.id.device).is_some());
    let expected_empty = |subject: &Subject| {
        let Some(class) = by_name.get(subject.class.as_str()) else {
            return false;
        };
        let expressions = || {
            class
                .spec
                .iter()
                .flat_map(|spec| spec.selectors.iter().flatten())
                .filter_map(|s| s.cel.as_ref().map(|c| c.expression.as_str()))
        };
        subject.claim.is_none()
            && ((!any_channel && crate::domains::channels::is_channel_class(expressions()))
                || (!any_passthrough
                    && crate::devices::passthrough::is_passthrough_class(expressions())))
    };
    let exit_code = if subjects.iter().any(|s| !s.errors.is_empty()) {
        2
    } else if subjects
        .iter()
        .any(|s| s.matching == 0 && !expected_empty(s))
    {
        1
    } else {
        0
    };
    CheckReport {
        exit_code,
        subjects,
    }
}

type Groups = Vec<(SelectorOrigin, Vec<CompiledSelector>)>;

fn class_selectors(name: &str, class: &DeviceClass) -> Groups {
    let selectors = class
        .spec
        .iter()
        .flat_map(|spec| spec.selectors.iter().flatten())
        .map(|s| CompiledSelector::new(s.cel.as_ref().map_or("", |c| c.expression.as_str())))
        .collect();
    vec![(SelectorOrigin::Class(name.to_string()), selectors)]
}

/// The request's selectors, or the index of one without a CEL expression.
fn request_selectors(selectors: &[DeviceSelector]) -> Result<Vec<CompiledSelector>, usize> {
    selectors
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.cel
                .as_ref()
                .map(|c| CompiledSelector::new(&c.expression))
                .ok_or(i)
        })
        .collect()
}

struct RequestToCheck<'a> {
    label: String,
    class: String,
    selectors: &'a [DeviceSelector],
}

/// `exactly` requests as they are, `firstAvailable` ones as each of their subrequests (`req/sub`).
fn claim_requests(claim: &NamedClaim) -> Vec<RequestToCheck<'_>> {
    let mut result = Vec::new();
    for request in claim
        .spec
        .devices
        .iter()
        .flat_map(|d| d.requests.iter().flatten())
    {
        if let Some(exactly) = &request.exactly {
            result.push(RequestToCheck {
                label: request.name.clone(),
                class: exactly.device_class_name.clone(),
                selectors: exactly.selectors.as_deref().unwrap_or_default(),
            });
        }
        for sub in request.first_available.iter().flatten() {
            result.push(RequestToCheck {
                label: format!("{}/{}", request.name, sub.name),
                class: sub.device_class_name.clone(),
                selectors: sub.selectors.as_deref().unwrap_or_default(),
            });
        }
    }
    result
}

fn input_error(message: String) -> CheckError {
    CheckError {
        device: None,
        devices: Vec::new(),
        evaluated: None,
        selector: None,
        config: None,
        message,
        blocking: true,
    }
}

/// `<object>: config[<i>] (<Kind>): <path>: <reason>` for each problem.
fn config_errors(object: &str, problems: Vec<ConfigProblem>) -> Vec<CheckError> {
    problems
        .into_iter()
        .map(|problem| CheckError {
            device: None,
            devices: Vec::new(),
            evaluated: None,
            selector: None,
            config: Some(problem.index),
            message: format!("{object}: {problem}"),
            blocking: false,
        })
        .collect()
}

/// A selector's error and the devices it occurred on.
struct Failure {
    group: usize,
    index: usize,
    error: CelError,
    devices: Vec<String>,
}

/// Runs the groups in order on every device, stopping at the first selector that does not say true.
/// A selector that fails with the same error on several devices gives one error; a compile error is the
/// selector's, not a device's, and names none.
fn evaluate(
    subject: &mut Subject,
    groups: &Groups,
    devices: &[SliceDevice],
    published: &PublishedNames,
) {
    subject.devices = devices.len();
    let references: Vec<Vec<SelectorRef>> = groups
        .iter()
        .map(|(origin, selectors)| {
            selectors
                .iter()
                .enumerate()
                .map(|(index, selector)| SelectorRef {
                    origin: origin.clone(),
                    index,
                    expression: selector.expression.clone(),
                    hints: selector
                        .compiled
                        .as_ref()
                        .map(|s| published.hints(s.references()))
                        .unwrap_or_default(),
                })
                .collect()
        })
        .collect();
    // How many devices each selector (group, index) ran on.
    let mut evaluated: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    let mut failures: Vec<Failure> = Vec::new();
    for device in devices {
        let name = device.id.to_string();
        let mut outcome = None;
        for (group, (_, selectors)) in groups.iter().enumerate() {
            let result = first_mismatch(selectors, &device.view);
            let ran = match &result {
                Ok(None) => selectors.len(),
                Ok(Some(index)) => index + 1,
                Err((index, CelError::Compile(_))) => *index,
                Err((index, CelError::Runtime(_))) => index + 1,
            };
            for index in 0..ran {
                *evaluated.entry((group, index)).or_default() += 1;
            }
            match result {
                Ok(None) => continue,
                Ok(Some(index)) => outcome = Some(Ok((group, index))),
                Err((index, error)) => outcome = Some(Err((group, index, error))),
            }
            break;
        }
        match outcome {
            None => {
                subject.matching += 1;
                subject.matches.push(name);
            }
            Some(Ok((group, index))) => subject.no_match.push(NoMatch {
                device: name,
                selector: references[group][index].clone(),
            }),
            Some(Err((group, index, error))) => {
                // The error text names no device (CEL's and a device's conversion errors do not), so
                // equal texts are one error.
                let seen = failures
                    .iter()
                    .position(|f| (f.group, f.index, &f.error) == (group, index, &error));
                let at = seen.unwrap_or_else(|| {
                    failures.push(Failure {
                        group,
                        index,
                        error,
                        devices: Vec::new(),
                    });
                    failures.len() - 1
                });
                if matches!(failures[at].error, CelError::Runtime(_)) {
                    failures[at].devices.push(name);
                }
            }
        }
    }
    for Failure {
        group,
        index,
        error,
        devices,
    } in failures
    {
        let origin = &groups[group].0;
        let (on, evaluated) = match error {
            CelError::Compile(_) => (String::new(), None),
            CelError::Runtime(_) => {
                let evaluated = evaluated.get(&(group, index)).copied().unwrap_or_default();
                (
                    format!(" {}", on_devices(&devices, evaluated)),
                    Some(evaluated),
                )
            }
        };
        subject.errors.push(CheckError {
            device: devices.first().cloned(),
            devices,
            evaluated,
            selector: Some(references[group][index].clone()),
            config: None,
            message: format!("{origin}: selector #{index}{on}: CEL {error}"),
            blocking: true,
        });
    }
}

/// Names a table line lists before "...".
const NAMES_IN_LINE: usize = 3;

/// `on device D` (the only device the selector ran on), `on all N devices`, or `on K of N devices
/// (D1, D2, D3, ...)`.
fn on_devices(devices: &[String], evaluated: usize) -> String {
    match devices {
        [device] if evaluated == 1 => format!("on device {device}"),
        _ if devices.len() == evaluated => format!("on all {evaluated} devices"),
        _ => {
            let mut names = devices
                .iter()
                .take(NAMES_IN_LINE)
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ");
            if devices.len() > NAMES_IN_LINE {
                names.push_str(", ...");
            }
            format!("on {} of {evaluated} devices ({names})", devices.len())
        }
    }
}

#[cfg(test)]
mod tests;
