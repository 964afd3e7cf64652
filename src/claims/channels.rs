//! Claims for IMEX channels, the workload side of a ComputeDomain: the claim holds the node's channel
//! device (`imex-channel-0`) and the channel config that names its domain. Preparing it joins this
//! node to the domain (`domains::membership`): the node's IMEX daemon runs for the domain and is ready
//! before the claim's CDI spec gives the container `channel0`, or with `allocationMode: All` every
//! channel. A node serves one domain at a time. The last claim of a domain on this node to be
//! unprepared makes the node leave it.

use std::collections::BTreeSet;

use super::allocation::FetchedClaim;
use super::state::lock;
use super::{configs, ClaimError, ClaimRecord, ClaimRef, PreparedDevice, Preparer};
use crate::domains::{channels, membership::ChannelMembership};
use crate::gpu::Inventory;

/// The channel a claim holds and the domain its config names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ChannelRequest {
    pub channel: u32,
    pub domain_uid: String,
    pub clique: String,
    /// `allocationMode: All`: the container gets every channel of the node.
    pub all_channels: bool,
}

impl Preparer {
    /// The claim's IMEX channel, when it holds one. A channel comes in a claim of its own, with a
    /// ComputeDomain channel config for its request (what the controller's template writes).
    pub(super) fn channel_request(
        &self,
        claim: &ClaimRef,
        fetched: &FetchedClaim,
        devices: &[PreparedDevice],
        inventory: &Inventory,
    ) -> Result<Option<ChannelRequest>, ClaimError> {
        let invalid = |reason: String| ClaimError::Config {
            claim: claim.to_string(),
            reason,
        };
        let channels: Vec<(&PreparedDevice, u32)> = devices
            .iter()
            .filter_map(|d| channels::parse_device_name(&d.device).map(|n| (d, n)))
            .collect();
        let [(device, channel)] = channels.as_slice() else {
            if channels.is_empty() {
                return Ok(None);
            }
            return Err(invalid(format!(
                "{} IMEX channels allocated; a claim holds one (one per ComputeDomain)",
                channels.len()
            )));
        };
        if devices.len() > 1 {
            return Err(invalid(format!(
                "IMEX channel {} comes in a claim of its own (a ComputeDomain's template), but this claim also holds {}",
                device.device,
                devices
                    .iter()
                    .filter(|d| d.device != device.device)
                    .map(|d| d.device.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let entries = configs::allocation_config_entries(&fetched.claim, &fetched.raw_configs);
        let mut domains = BTreeSet::new();
        let mut all_channels = false;
        for entry in &entries {
            let applies = entry.requests.is_empty()
                || device
                    .request_names
                    .iter()
                    .any(|r| entry.requests.contains(r));
            if !applies {
                continue;
            }
            match configs::channel_config(&self.driver, entry) {
                Some(Ok(config)) => {
                    all_channels |= config.all_channels();
                    domains.insert(config.domain_id);
                }
                Some(Err(reason)) => {
                    return Err(invalid(format!("config[{}]: {reason}", entry.index)))
                }
                None => {}
            }
        }
        let domain_uid = match domains.len() {
            1 => domains.into_iter().next().unwrap_or_default(),
            0 => {
                return Err(invalid(format!(
                    "IMEX channel {} was allocated without a ComputeDomainChannelConfig naming its domain; channel claims come from a ComputeDomain's ResourceClaimTemplate",
                    device.device
                )))
            }
            _ => {
                return Err(invalid(format!(
                    "IMEX channel {}: the configs name several ComputeDomains ({})",
                    device.device,
                    domains.into_iter().collect::<Vec<_>>().join(", ")
                )))
            }
        };
        let clique =
            channels::node_clique(inventory).map_err(|reason| ClaimError::UnknownDevice {
                claim: claim.to_string(),
                device: device.device.clone(),
                reason: format!("the node is in no NVLink clique now: {reason}"),
            })?;
        Ok(Some(ChannelRequest {
            channel: *channel,
            domain_uid,
            clique,
            all_channels,
        }))
    }

    /// Notes on the channel device how many channel files its container gets: one, or with
    /// `allocationMode: All` every channel the driver has, as NVIDIA's driver gives them.
    pub(super) fn apply_allocation_mode(request: &ChannelRequest, devices: &mut [PreparedDevice]) {
        for device in devices {
            if channels::parse_device_name(&device.device).is_some() {
                device.imex_channels = request.all_channels.then_some(channels::MAX_CHANNELS);
            }
        }
    }

    /// The domain the claim's channel is for, checked against the domain this node serves: a claim
    /// of another domain is refused. Nothing is made on the node here.
    pub(super) async fn resolve_domain(
        &self,
        claim: &ClaimRef,
        request: &ChannelRequest,
    ) -> Result<ChannelMembership, ClaimError> {
        let failed = |reason: String| ClaimError::Domain {
            claim: claim.to_string(),
            reason,
        };
        let Some(membership) = &self.domains else {
            return Err(failed(
                "ComputeDomains are not served by this plugin".into(),
            ));
        };
        // The scheduler gives the node's one channel device to one claim at a time; this holds even
        // when a claim of another domain was prepared before an upgrade that changed that.
        let serving = lock(&self.state)
            .data
            .claims
            .iter()
            .filter(|(uid, _)| **uid != claim.uid)
            .find_map(|(_, record)| {
                record
                    .domain
                    .as_ref()
                    .filter(|d| d.domain_uid != request.domain_uid)
                    .cloned()
            });
        if let Some(other) = serving {
            return Err(failed(format!(
                "this node serves ComputeDomain {}/{} (UID {}) now: a node runs one IMEX daemon, for one ComputeDomain at a time, until that domain's pods leave it",
                other.namespace, other.domain, other.domain_uid
            )));
        }
        membership
            .resolve(
                &self.domain_groups,
                &claim.namespace,
                &request.domain_uid,
                request.channel,
                &request.clique,
            )
            .await
            .map_err(failed)
    }

    /// Joins the claim's (recorded) domain on this node; the error is the claim's, and the kubelet
    /// retries it.
    pub(super) async fn join_domain(
        &self,
        claim: &ClaimRef,
        member: &ChannelMembership,
    ) -> Result<(), ClaimError> {
        let failed = |reason: String| ClaimError::Domain {
            claim: claim.to_string(),
            reason,
        };
        let Some(membership) = &self.domains else {
            return Err(failed(
                "ComputeDomains are not served by this plugin".into(),
            ));
        };
        membership.note_attempt(&member.domain_uid);
        membership.join(member).await.map_err(failed)
    }

    /// Leaves the claim's domain on this node when no other claim here holds it.
    pub(super) async fn leave_domain(
        &self,
        claim: &ClaimRef,
        record: &ClaimRecord,
    ) -> Result<(), ClaimError> {
        let (Some(member), Some(membership)) = (&record.domain, &self.domains) else {
            return Ok(());
        };
        let others = lock(&self.state).data.claims.iter().any(|(uid, other)| {
            *uid != claim.uid
                && other
                    .domain
                    .as_ref()
                    .is_some_and(|d| d.domain_uid == member.domain_uid)
        });
        if others {
            return Ok(());
        }
        membership
            .leave(member)
            .await
            .map_err(|reason| ClaimError::Domain {
                claim: claim.to_string(),
                reason: format!(
                    "leaving ComputeDomain {}/{}: {reason}",
                    member.namespace, member.domain
                ),
            })
    }

    /// The domains this node's prepared claims hold.
    pub fn domain_members(&self) -> Vec<ChannelMembership> {
        lock(&self.state)
            .data
            .claims
            .values()
            .filter_map(|record| record.domain.clone())
            .collect()
    }
}
