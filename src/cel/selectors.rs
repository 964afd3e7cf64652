//! `gpu-dra selectors check`: which devices each DeviceClass and each claim request selects, which it
//! does not and the first selector that said no, and CEL errors, which block scheduling as in the
//! scheduler; also malformed `GpuConfig` / `MigConfig` configs of this driver, which fail prepare.
//! The allocation simulator (`selectors allocate`) lives in [`simulate`].

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::resource::v1::{Device, DeviceClass, DeviceSelector, ResourceSlice};
use serde::Serialize;

use super::allocator::{first_mismatch, Candidate, CompiledSelector, SelectorOrigin};
use super::device::split_name;
use super::input::NamedClaim;
use super::{CelError, DeviceView};
use crate::claims::configs::{check_claim_spec, check_device_class, ConfigProblem};
use hints::PublishedNames;

mod hints;
pub mod simulate;

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
///                              "index": 0, "expression": "...",
///                              "hints": ["..."]}}],  // only when it names something no device has
///    "errors": [{"device": "driver/pool/device" | null,   // the first of "devices"; null: compile
///                                                         // error, config or invalid input
///                "devices": ["driver/pool/device", ...],  // every device with this error
///                "evaluated": 8 | null,    // devices the selector ran on (runtime errors)
///                "selector": {...} | null,
///                "config": 0 | null,       // the index of a malformed config in spec.config /
///                                          // spec.devices.config (blocking false: it fails prepare)
///                "message": "...", "blocking": true}]}]}
/// ```
///
/// One selector failing with the same error on several devices is one entry of `errors`.
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
    /// Domains and names the expression looks up that no checked device publishes, each with the
    /// nearest published one where there is one.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hints: Vec<String>,
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
    /// The first of `devices`; none for an error that is no device's (compile, config, input).
    pub device: Option<String>,
    /// The devices on which the selector failed with this error, in device order.
    pub devices: Vec<String>,
    /// How many devices the selector was evaluated on, for a runtime error.
    pub evaluated: Option<usize>,
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
            // A selector's hints follow the first line that names it.
            let mut hinted: Vec<SelectorRef> = Vec::new();
            let mut hints = |out: &mut String, selector: Option<&SelectorRef>| {
                let Some(selector) = selector.filter(|s| !hinted.contains(s)) else {
                    return;
                };
                for hint in &selector.hints {
                    let _ = writeln!(out, "    hint: {hint}");
                }
                hinted.push(selector.clone());
            };
            for (selector, devices) in by_selector {
                let _ = writeln!(
                    out,
                    "  no match ({} selector #{}: {}): {}",
                    selector.origin,
                    selector.index,
                    selector.expression,
                    shorten(&devices)
                );
                hints(&mut out, Some(selector));
            }
            for error in subject.errors.iter().take(TABLE_LIST) {
                let label = if error.blocking {
                    "BLOCKING error"
                } else {
                    "config error"
                };
                let _ = writeln!(out, "  {label}: {}", error.message);
                hints(&mut out, error.selector.as_ref());
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
