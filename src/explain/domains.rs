//! What a pod's ComputeDomain says about it. The controller writes a domain's channel
//! ResourceClaimTemplate only once it placed the domain on an NVLink clique, so the
//! pod of a domain that is not placed has no claim yet and waits for the domain; the pod of a placed
//! domain may find every node of the clique taken, or wait in ContainerCreating for the domain's IMEX
//! daemons. This step adds that to the per-node verdicts of [`super::decide`]: why the domain is not
//! placed (the controller's `gpu.dra.dev/placement` annotation, else what [`crate::domains::placement`] decides from
//! the slices and claims), why its clique has no room, and which of its nodes are not Ready.

use std::collections::BTreeSet;

use crate::api::{DRIVER_NAME, NVIDIA_DRIVER_NAME};
use crate::domains::api::{DomainGroup, DomainObject, NOT_READY, PLACEMENT_ANNOTATION, READY};
use crate::domains::channels::CHANNEL_TYPE;
use crate::domains::placement::{
    nodes_needed, place_all, why_pending, Decision, Fabric, PendingReason, Placed,
};

use super::cluster::Cluster;
use super::report::{Reason, ReasonKind, Report};
use super::subject::{ClaimSource, Subject};

/// The ComputeDomain in `namespace` whose channel template is `template`.
pub(super) fn channel_domain<'a>(
    cluster: &'a Cluster,
    namespace: &str,
    template: &str,
) -> Option<&'a DomainObject> {
    cluster.domains.iter().find(|domain| {
        domain.namespace == namespace
            && domain
                .spec
                .channel
                .as_ref()
                .is_some_and(|channel| channel.resource_claim_template.name == template)
    })
}

/// Adds what the subject's ComputeDomains say to `report`.
pub(super) fn apply(cluster: &Cluster, subject: &Subject, mut report: Report) -> Report {
    if !subject.domain_waits.is_empty() {
        return waiting(cluster, subject, report);
    }
    for domain in placed_domains(cluster, subject) {
        // A full clique is why the pod fits nowhere; where it fits, the clique has room for it.
        if !report.fits {
            report.notes.extend(clique_full(cluster, domain));
        }
        report.notes.extend(not_ready(domain));
    }
    report
}

/// The domains whose channel template a claim of the subject comes from.
fn placed_domains<'a>(cluster: &'a Cluster, subject: &Subject) -> Vec<&'a DomainObject> {
    let mut seen = BTreeSet::new();
    subject
        .claims
        .iter()
        .filter_map(|claim| {
            let ClaimSource::Template { template, .. } = &claim.source else {
                return None;
            };
            let (namespace, _) = claim.name.split_once('/')?;
            channel_domain(cluster, namespace, template)
        })
        .filter(|domain| seen.insert(domain.key()))
        .collect()
}

/// A pod waiting for domains that are not placed: no node takes it until their templates exist.
fn waiting(cluster: &Cluster, subject: &Subject, report: Report) -> Report {
    let mut notes = report.notes;
    let mut states = Vec::new();
    let mut waits = Vec::new();
    for wait in &subject.domain_waits {
        let Some(domain) = cluster.domains.iter().find(|d| d.key() == wait.domain) else {
            continue;
        };
        notes.push(format!(
            "pod claim {}: ResourceClaimTemplate {} does not exist yet: the ComputeDomain controller \
             writes it once it has placed ComputeDomain {} on an NVLink clique",
            wait.pod_claim, wait.template, wait.domain
        ));
        states.push(format!(
            "ComputeDomain {}: {}",
            wait.domain,
            not_placed(cluster, domain)
        ));
        waits.push(format!(
            "pod claim {} waits for ComputeDomain {} (ResourceClaimTemplate {} does not exist yet)",
            wait.pod_claim, wait.domain, wait.template
        ));
    }
    let reason = waits.join("; ");
    let nodes = report
        .nodes
        .into_iter()
        .map(|mut node| {
            // Nodes that fail for another reason keep it; the others would take the pod but for
            // the claim that does not exist.
            if node.fits && node.error.is_none() {
                node.fits = false;
                node.devices.clear();
                node.reasons = vec![Reason::new(ReasonKind::DomainNotPlaced, reason.clone())];
            }
            node
        })
        .collect();
    let mut report = Report::new(report.subject, report.claims, nodes, notes);
    report.summary = format!("waits for {}", states.join("; "));
    // The scheduler does not try a pod whose claim does not exist: there is no "0/N nodes" event.
    report.scheduler = None;
    report
}

/// Why `domain` is not placed (or, placed, has no template yet), in a few words after "ComputeDomain
/// NS/NAME: ".
fn not_placed(cluster: &Cluster, domain: &DomainObject) -> String {
    if domain.deleting {
        return "being deleted".into();
    }
    if let Some(clique) = cluster.placement_of(domain) {
        return format!(
            "placed on NVLink clique {clique}, but its ResourceClaimTemplate is not written yet (is \
             `gpu-dra controller` running?)"
        );
    }
    if let Some(reason) = domain
        .annotations
        .get(PLACEMENT_ANNOTATION)
        .filter(|r| !r.is_empty())
    {
        return format!("not placed: {reason}");
    }
    // The controller has not said why (yet): decide as it would, from what the cluster holds.
    let fabric = fabric_for(cluster, domain);
    match place_all(&cluster.domains, &cluster.placements_by_uid(), &fabric).get(&domain.uid) {
        Some(Decision::Refused(reason) | Decision::Waiting(reason)) => format!(
            "not placed: {reason} (explain's own placement from the ResourceSlices and claims: the \
             domain has no {PLACEMENT_ANNOTATION} annotation)"
        ),
        Some(Decision::New(placed) | Decision::Kept(placed)) => format!(
            "not placed yet, though NVLink clique {} has room for it (is `gpu-dra controller` \
             running?)",
            placed.clique
        ),
        None => "not placed".into(),
    }
}

/// "ComputeDomain NS/NAME: 0 of the 4 nodes of NVLink clique ... are free for the ComputeDomain's
/// pods: ...", when no node of the placed domain's clique can take another of its pods.
fn clique_full(cluster: &Cluster, domain: &DomainObject) -> Option<String> {
    let clique = cluster.placement_of(domain)?;
    let decision = Decision::Kept(Placed { clique });
    match why_pending(domain, &decision, &fabric_for(cluster, domain))? {
        full @ PendingReason::CliqueFull { .. } => {
            Some(format!("ComputeDomain {}: {full}", domain.key()))
        }
        PendingReason::NotPlaced(_) | PendingReason::NotReady { .. } => None,
    }
}

/// "ComputeDomain NS/NAME is NotReady: k of n nodes ready (node: reason; ...)", from its status.
fn not_ready(domain: &DomainObject) -> Option<String> {
    let status = &domain.status;
    if status.status == READY {
        return None;
    }
    let needed = nodes_needed(domain);
    let ready = status.nodes.iter().filter(|n| n.status == READY).count();
    let waiting: Vec<String> = status
        .nodes
        .iter()
        .filter(|n| n.status != READY)
        .map(|n| {
            let why = n
                .reason
                .as_deref()
                .filter(|r| !r.is_empty())
                .unwrap_or(NOT_READY);
            format!("{}: {why}", n.name)
        })
        .collect();
    let detail = if waiting.is_empty() {
        String::new()
    } else {
        format!(" ({})", waiting.join("; "))
    };
    Some(format!(
        "ComputeDomain {} is NotReady: {ready} of {needed} nodes ready{detail}; a node joins when the \
         plugin prepares one of the domain's channels there, and the pod stays in ContainerCreating \
         until the IMEX daemon of its node is ready",
        domain.key()
    ))
}

/// The fabric as the driver that serves `domain` publishes it.
fn fabric_for(cluster: &Cluster, domain: &DomainObject) -> Fabric {
    Fabric::from_cluster(
        channel_driver(cluster, domain),
        &cluster.slices,
        &cluster.claims,
    )
}

/// The driver whose channel devices the pods of `domain` claim: NVIDIA's group is served under
/// NVIDIA's driver name only, ours under both, so the one whose slices publish channels.
fn channel_driver(cluster: &Cluster, domain: &DomainObject) -> &'static str {
    let serving: Vec<&'static str> = [DRIVER_NAME, NVIDIA_DRIVER_NAME]
        .into_iter()
        .filter(|driver| DomainGroup::served_by(driver).contains(&domain.group))
        .collect();
    let publishes_channels = |driver: &str| {
        cluster
            .slices
            .iter()
            .filter(|slice| slice.spec.driver == driver)
            .flat_map(|slice| slice.spec.devices.iter().flatten())
            .any(|device| {
                device
                    .attributes
                    .as_ref()
                    .and_then(|a| a.get("type"))
                    .and_then(|a| a.string.as_deref())
                    == Some(CHANNEL_TYPE)
            })
    };
    serving
        .iter()
        .copied()
        .find(|driver| publishes_channels(driver))
        .or_else(|| serving.first().copied())
        .unwrap_or(DRIVER_NAME)
}
