//! `gpu-dra selectors check`: which devices each DeviceClass and each claim request selects, which it
//! does not and the first selector that said no, and CEL errors, which block scheduling as in the
//! scheduler; also malformed `GpuConfig` / `MigConfig` configs of this driver, which fail prepare.
//! The allocation simulator (`selectors allocate`) lives in [`simulate`].

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::resource::v1::{Device, DeviceClass, DeviceSelector, ResourceSlice};
use serde::Serialize;

use super::allocator::{first_mismatch, Candidate, CompiledSelector, SelectorOrigin};
use super::input::NamedClaim;
use super::{CelError, DeviceView};
use crate::claims::configs::{check_claim_spec, check_device_class, ConfigProblem};

pub mod simulate;

/// A device to check, with the driver and pool of its slice.
#[derive(Debug, Clone)]
pub struct SliceDevice {
    pub id: Candidate,
    pub view: DeviceView,
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
                SliceDevice {
                    view: DeviceView::new(&id.driver, device),
                    id,
                }
            })
        })
        .collect()
}

/// What `selectors check` found. JSON shape (`to_json`), field names stable:
///
/// ```text
/// {"exitCode": 0|1|2,
///  "subjects": [{
///    "class": "gpu.dra.dev",                  // the DeviceClass evaluated
///    "claim": "ns/name" | null,               // null for a class on its own
///    "request": "req" | "req/sub" | null,
///    "devices": 8, "matching": 8,             // devices checked, devices that match
///    "matches": ["driver/pool/device", ...],
///    "noMatch": [{"device": "driver/pool/device",
///                 "selector": {"origin": {"kind": "class"|"request", "name": "..."},
///                              "index": 0, "expression": "..."}}],
///    "errors": [{"device": "driver/pool/device" | null,   // null: compile error or invalid input
///                "selector": {...} | null,
///                "config": 0 | null,       // the index of a malformed config in spec.config /
///                                          // spec.devices.config (blocking false: it fails prepare)
///                "message": "...", "blocking": true}]}]}
/// ```
///
/// A claim's config errors go to its first request's subject, or to a subject of their own (no class,
/// no request) when the claim has no request.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckReport {
    pub exit_code: i32,
    pub subjects: Vec<Subject>,
}

/// One DeviceClass, or one request (or subrequest) of a claim with its class.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Subject {
    pub class: String,
    pub claim: Option<String>,
    pub request: Option<String>,
    pub devices: usize,
    pub matching: usize,
    pub matches: Vec<String>,
    pub no_match: Vec<NoMatch>,
    pub errors: Vec<CheckError>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SelectorRef {
    pub origin: SelectorOrigin,
    pub index: usize,
    pub expression: String,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NoMatch {
    pub device: String,
    pub selector: SelectorRef,
}

/// A CEL or input error is blocking: in the scheduler it aborts allocation of every claim that
/// reaches it. A malformed config is not: the claim is allocated, and then the kubelet plugin refuses
/// to prepare it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckError {
    pub device: Option<String>,
    pub selector: Option<SelectorRef>,
    /// The index of the malformed config, for a config error.
    pub config: Option<usize>,
    pub message: String,
    pub blocking: bool,
}

impl Subject {
    /// `class X`, `claim ns/name request R (class X)`, or `claim ns/name` (config errors of a claim
    /// without requests).
    pub fn title(&self) -> String {
        match (&self.claim, &self.request) {
            (Some(claim), Some(request)) => {
                format!("claim {claim} request {request} (class {})", self.class)
            }
            (Some(claim), None) => format!("claim {claim}"),
            _ => format!("class {}", self.class),
        }
    }
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
        evaluate(&mut subject, &class_selectors(&name, class), devices);
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
            evaluate(&mut subject, &groups, devices);
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
    let exit_code = if subjects.iter().any(|s| !s.errors.is_empty()) {
        2
    } else if subjects.iter().any(|s| s.matching == 0) {
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
            selector: None,
            config: Some(problem.index),
            message: format!("{object}: {problem}"),
            blocking: false,
        })
        .collect()
}

/// Runs the groups in order on every device, stopping at the first selector that does not say true.
fn evaluate(subject: &mut Subject, groups: &Groups, devices: &[SliceDevice]) {
    subject.devices = devices.len();
    let mut compile_errors_seen = Vec::new();
    for device in devices {
        let name = device.id.to_string();
        let mut outcome = None;
        for (origin, selectors) in groups {
            match first_mismatch(selectors, &device.view) {
                Ok(None) => continue,
                Ok(Some(index)) => outcome = Some(Ok((origin, index))),
                Err((index, error)) => outcome = Some(Err((origin, index, error))),
            }
            break;
        }
        let reference = |origin: &SelectorOrigin, index: usize| SelectorRef {
            origin: origin.clone(),
            index,
            expression: groups
                .iter()
                .find(|(o, _)| o == origin)
                .and_then(|(_, s)| s.get(index))
                .map(|s| s.expression.clone())
                .unwrap_or_default(),
        };
        match outcome {
            None => {
                subject.matching += 1;
                subject.matches.push(name);
            }
            Some(Ok((origin, index))) => subject.no_match.push(NoMatch {
                device: name,
                selector: reference(origin, index),
            }),
            Some(Err((origin, index, error))) => {
                let selector = reference(origin, index);
                // A compile error is the selector's, not the device's: reported once.
                let device = match error {
                    CelError::Compile(_) => {
                        if compile_errors_seen.contains(&selector) {
                            continue;
                        }
                        compile_errors_seen.push(selector.clone());
                        None
                    }
                    CelError::Runtime(_) => Some(name.clone()),
                };
                let message = match &device {
                    Some(device) => {
                        format!("{origin}: selector #{index} on device {device}: CEL {error}")
                    }
                    None => format!("{origin}: selector #{index}: CEL {error}"),
                };
                subject.errors.push(CheckError {
                    device,
                    selector: Some(selector),
                    config: None,
                    message,
                    blocking: true,
                });
            }
        }
    }
}

impl CheckReport {
    pub fn to_json(&self) -> String {
        // Plain data of strings and numbers: serializing cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }

    /// One block per subject: counts, matching devices, non-matching devices grouped by the selector
    /// that said no, and errors marked BLOCKING.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        for subject in &self.subjects {
            if subject.request.is_none() && subject.claim.is_some() {
                let _ = writeln!(out, "{}: no requests", subject.title());
            } else {
                let _ = writeln!(
                    out,
                    "{}: {} of {} devices match",
                    subject.title(),
                    subject.matching,
                    subject.devices
                );
            }
            if !subject.matches.is_empty() {
                let names: Vec<&str> = subject.matches.iter().map(String::as_str).collect();
                let _ = writeln!(out, "  match: {}", shorten(&names));
            }
            let mut by_selector: Vec<(&SelectorRef, Vec<&str>)> = Vec::new();
            for miss in &subject.no_match {
                match by_selector.iter_mut().find(|(s, _)| **s == miss.selector) {
                    Some((_, devices)) => devices.push(&miss.device),
                    None => by_selector.push((&miss.selector, vec![&miss.device])),
                }
            }
            for (selector, devices) in by_selector {
                let _ = writeln!(
                    out,
                    "  no match ({} selector #{}: {}): {}",
                    selector.origin,
                    selector.index,
                    selector.expression,
                    shorten(&devices)
                );
            }
            for error in subject.errors.iter().take(TABLE_LIST) {
                let label = if error.blocking {
                    "BLOCKING error"
                } else {
                    "config error"
                };
                let _ = writeln!(out, "  {label}: {}", error.message);
            }
            if subject.errors.len() > TABLE_LIST {
                let _ = writeln!(
                    out,
                    "  ... and {} more errors (-o json lists them all)",
                    subject.errors.len() - TABLE_LIST
                );
            }
            let has_requests = subject.claim.is_none() || subject.request.is_some();
            if has_requests && subject.errors.is_empty() && subject.matching == 0 {
                let _ = writeln!(out, "  NOTHING MATCHES");
            }
            out.push('\n');
        }
        let errors = || self.subjects.iter().flat_map(|s| &s.errors);
        if errors().any(|e| e.blocking) {
            out.push_str(
                "BLOCKING: CEL or input errors; the scheduler aborts allocation on them\n",
            );
        }
        if errors().any(|e| !e.blocking) {
            out.push_str(
                "CONFIG errors: claims that carry these configs (theirs or their class's) fail to prepare\n",
            );
        }
        match self.exit_code {
            0 => out.push_str("ok: every class and request matches a device\n"),
            1 => out.push_str("problem: a class or request matches no device\n"),
            _ => {}
        }
        out
    }

    /// 0 all good, 1 a class or request matches nothing, 2 an error.
    pub fn exit_code(&self) -> i32 {
        self.exit_code
    }
}

/// Devices or errors a table lists before it counts the rest: a node has hundreds of MIG devices.
const TABLE_LIST: usize = 8;

fn shorten(devices: &[&str]) -> String {
    let mut text = devices
        .iter()
        .take(TABLE_LIST)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if devices.len() > TABLE_LIST {
        text.push_str(&format!(
            " ... and {} more (-o json lists them all)",
            devices.len() - TABLE_LIST
        ));
    }
    text
}

#[cfg(test)]
mod tests;
