//! A pod's claims that still need devices are allocated together on a node, as the scheduler does:
//! its allocator searches all claims of the pod in one go and backtracks into an earlier claim's picks
//! when a later claim does not fit. The allocator here decides one claim at a time, so the pending
//! claims are merged into one claim: request `gpu` of claim 1 becomes `c1.gpu` (request names are DNS
//! labels, so the dot cannot clash), each claim's constraints keep to its own requests, and the results
//! are split back. Where the merged claim would break the per-claim limit of 32 devices (or asks for
//! "all" devices, whose number is known only on the node), the claims go one after another instead:
//! each later claim sees the earlier claims' picks as in use.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    DeviceClaim, DeviceConstraint, DeviceRequest, DeviceRequestAllocationResult, ResourceClaimSpec,
};
use regex::Regex;

use crate::cel::allocator::{self, AllocationError, Candidate, InUse, Pools, MAX_RESULTS};

use super::subject::SubjectClaim;

/// The pending claims (by index into the subject's claims) and how they are handed to the allocator.
pub(super) struct Joint {
    /// Indexes of the claims without an allocation, in the pod's order.
    pub(super) pending: Vec<usize>,
    /// The names the claims are shown by, by index.
    names: Vec<String>,
    mode: Mode,
    renamed: Regex,
}

enum Mode {
    /// One spec holding every pending claim's requests.
    Merged(ResourceClaimSpec),
    /// Each pending claim's own spec, allocated in turn.
    OneByOne(Vec<ResourceClaimSpec>),
}

/// The allocator's answer for one node.
pub(super) enum Outcome {
    /// Results of each pending claim, request names as the claim has them.
    Allocated(Vec<(usize, DeviceRequestAllocationResult)>),
    Failed(Failure),
}

pub(super) struct Failure {
    pub(super) error: AllocationError,
    /// The allocator's message, with merged request names written back as `claim:request`.
    pub(super) message: String,
    /// The claims the failure concerns: the one that did not fit when claims go one by one, else all.
    pub(super) claims: Vec<usize>,
    /// Devices earlier claims of the pod took before a later claim failed (one by one only).
    pub(super) picks: Vec<(usize, Candidate)>,
}

impl Joint {
    pub(super) fn new(claims: &[SubjectClaim]) -> Joint {
        let pending: Vec<usize> = (0..claims.len())
            .filter(|i| claims[*i].allocation.is_none())
            .collect();
        let names = claims.iter().map(|c| c.name.clone()).collect();
        let one_by_one = pending.len() < 2
            || pending.iter().any(|i| has_all_mode(&claims[*i].spec))
            || pending
                .iter()
                .map(|i| minimum_devices(&claims[*i].spec))
                .sum::<usize>()
                > MAX_RESULTS;
        let mode = if one_by_one {
            Mode::OneByOne(pending.iter().map(|i| claims[*i].spec.clone()).collect())
        } else {
            Mode::Merged(merge(claims, &pending))
        };
        Joint {
            pending,
            names,
            mode,
            // The pattern is a literal that compiles.
            renamed: Regex::new(r"\bc(\d+)\.").expect("literal regex"),
        }
    }

    /// Runs the allocator on one node's pools with what other claims hold there.
    pub(super) fn allocate(
        &self,
        pools: &Pools,
        classes: &BTreeMap<String, Vec<String>>,
        in_use: &InUse,
    ) -> Outcome {
        match &self.mode {
            Mode::Merged(spec) => match allocator::allocate(pools, classes, in_use, spec) {
                Ok(results) => Outcome::Allocated(
                    results
                        .into_iter()
                        .map(|mut result| {
                            let (claim, request) = self.split(&result.request);
                            result.request = request;
                            (claim, result)
                        })
                        .collect(),
                ),
                Err(error) => Outcome::Failed(Failure {
                    message: self.translate(&error.to_string()),
                    error,
                    claims: self.pending.clone(),
                    picks: Vec::new(),
                }),
            },
            Mode::OneByOne(specs) => {
                let mut taken: Option<InUse> = None;
                let mut placed = Vec::new();
                for (claim, spec) in self.pending.iter().zip(specs) {
                    let seen = taken.as_ref().unwrap_or(in_use);
                    match allocator::allocate(pools, classes, seen, spec) {
                        Ok(results) => {
                            if self.pending.len() > 1 {
                                let mut next = seen.clone();
                                let picked = allocator::in_use(&results);
                                next.devices.extend(picked.devices);
                                for (device, consumed) in picked.shares {
                                    next.add_share(device, consumed);
                                }
                                taken = Some(next);
                            }
                            placed.extend(results.into_iter().map(|r| (*claim, r)));
                        }
                        Err(error) => {
                            let prefix = if self.pending.len() > 1 {
                                format!("claim {}: ", self.names[*claim])
                            } else {
                                String::new()
                            };
                            return Outcome::Failed(Failure {
                                message: format!("{prefix}{error}"),
                                error,
                                claims: vec![*claim],
                                picks: placed
                                    .iter()
                                    .map(|(c, r)| (*c, Candidate::of_result(r)))
                                    .collect(),
                            });
                        }
                    }
                }
                Outcome::Allocated(placed)
            }
        }
    }

    /// `c1.gpu/small` → (1, `gpu/small`).
    fn split(&self, label: &str) -> (usize, String) {
        let parsed = label
            .strip_prefix('c')
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(index, request)| Some((index.parse().ok()?, request.to_string())));
        parsed.unwrap_or((
            self.pending.first().copied().unwrap_or(0),
            label.to_string(),
        ))
    }

    fn translate(&self, message: &str) -> String {
        self.renamed
            .replace_all(message, |caps: &regex::Captures<'_>| {
                let name = caps[1]
                    .parse::<usize>()
                    .ok()
                    .and_then(|i| self.names.get(i))
                    .cloned()
                    .unwrap_or_else(|| caps[0].to_string());
                format!("{name}:")
            })
            .into_owned()
    }
}

fn requests(spec: &ResourceClaimSpec) -> &[DeviceRequest] {
    spec.devices
        .as_ref()
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default()
}

fn has_all_mode(spec: &ResourceClaimSpec) -> bool {
    requests(spec).iter().any(|r| {
        r.exactly
            .iter()
            .map(|e| e.allocation_mode.as_deref())
            .chain(
                r.first_available
                    .iter()
                    .flatten()
                    .map(|s| s.allocation_mode.as_deref()),
            )
            .any(|mode| mode == Some("All"))
    })
}

/// The fewest devices the claim can be satisfied with (its cheapest subrequest per request).
fn minimum_devices(spec: &ResourceClaimSpec) -> usize {
    let count = |c: Option<i64>| usize::try_from(c.unwrap_or(1)).unwrap_or(usize::MAX);
    requests(spec)
        .iter()
        .map(|r| match (&r.exactly, &r.first_available) {
            (Some(exactly), _) => count(exactly.count),
            (None, Some(subs)) => subs.iter().map(|s| count(s.count)).min().unwrap_or(0),
            _ => 0,
        })
        .fold(0usize, usize::saturating_add)
}

fn merge(claims: &[SubjectClaim], pending: &[usize]) -> ResourceClaimSpec {
    let mut all_requests = Vec::new();
    let mut constraints = Vec::new();
    for &i in pending {
        let spec = &claims[i].spec;
        let rename = |name: &str| format!("c{i}.{name}");
        let own: Vec<String> = requests(spec).iter().map(|r| rename(&r.name)).collect();
        for request in requests(spec) {
            all_requests.push(DeviceRequest {
                name: rename(&request.name),
                ..request.clone()
            });
        }
        for constraint in spec
            .devices
            .as_ref()
            .and_then(|d| d.constraints.as_ref())
            .into_iter()
            .flatten()
        {
            let scope = match constraint.requests.as_deref() {
                None | Some([]) => own.clone(),
                Some(names) => names.iter().map(|n| rename(n)).collect(),
            };
            constraints.push(DeviceConstraint {
                requests: Some(scope),
                ..constraint.clone()
            });
        }
    }
    ResourceClaimSpec {
        devices: Some(DeviceClaim {
            requests: Some(all_requests),
            constraints: (!constraints.is_empty()).then_some(constraints),
            config: None,
        }),
    }
}
