//! The result of `selectors check` and how it is shown: the report's types (their JSON field names are
//! a stable contract) and the table for people. Kept apart from the check itself, which only fills a
//! report in.

use std::fmt::Write as _;

use serde::Serialize;

use crate::cel::allocator::SelectorOrigin;

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

pub(super) fn shorten(devices: &[&str]) -> String {
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
