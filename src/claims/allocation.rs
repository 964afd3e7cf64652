//! Reading a claim's allocation from the API server at prepare: the GET within the claim's budget
//! (a hung or erroring server costs that claim an error, never the kubelet's whole call), the checks that
//! it is the claim the kubelet means and that it is allocated, and this driver's devices in it.

use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::core::{params::GetParams, Request};
use kube::Resource;

use super::{mig, ClaimError, ClaimRef, PreparedDevice, Preparer};
use crate::gpu::Inventory;

/// How often a failed GET of a ResourceClaim is tried within one call, and the pause before each retry.
const CLAIM_GET_ATTEMPTS: u32 = 3;
const CLAIM_GET_RETRY_PAUSE: Duration = Duration::from_millis(100);

impl Preparer {
    /// [`Preparer::fetch`] within the per-claim budget. A server that hangs, or that keeps answering
    /// with errors kube's client retries on its own (429, 503, 504: up to minutes), must cost this claim
    /// a per-claim error, never the whole NodePrepareResources call the kubelet's deadline.
    pub(super) async fn fetch_within_budget(
        &self,
        claim: &ClaimRef,
    ) -> Result<FetchedClaim, ClaimError> {
        match tokio::time::timeout(self.claim_read_budget, self.fetch(claim)).await {
            Ok(result) => result,
            Err(_elapsed) => {
                self.metrics.api_timeout("get_claim");
                Err(ClaimError::ApiTimeout {
                    claim: claim.to_string(),
                    waited: self.claim_read_budget,
                })
            }
        }
    }

    /// GETs the ResourceClaim, retrying briefly on errors that may pass (server errors, throttling,
    /// transport), and checks that it is the claim the kubelet means and that it is allocated. The
    /// body is read as text so that opaque configs are decoded from what the server sent: a config
    /// with a duplicate key must be refused, not read with one of its values.
    async fn fetch(&self, claim: &ClaimRef) -> Result<FetchedClaim, ClaimError> {
        let started = Instant::now();
        let mut attempt = 1;
        let (found, raw_configs) = loop {
            match self.get_claim_text(claim).await {
                Ok(text) => match parse_claim(&text) {
                    Ok(parsed) => break parsed,
                    Err(reason) => {
                        return Err(ClaimError::Invalid {
                            claim: claim.to_string(),
                            reason: format!("the API server's answer cannot be read: {reason}"),
                        })
                    }
                },
                Err(kube::Error::Api(status)) if status.is_not_found() => {
                    return Err(ClaimError::NotFound {
                        claim: claim.to_string(),
                    })
                }
                Err(error) if crate::apiclient::is_timeout(&error) => {
                    // The client's own connect or read timeout: the server is not answering, and a
                    // retry would only run into the budget.
                    self.metrics.api_timeout("get_claim");
                    return Err(ClaimError::ApiTimeout {
                        claim: claim.to_string(),
                        waited: started.elapsed(),
                    });
                }
                Err(error) => {
                    self.metrics.api_error("get_claim");
                    if attempt >= CLAIM_GET_ATTEMPTS || !is_transient(&error) {
                        return Err(ClaimError::Fetch {
                            claim: claim.to_string(),
                            source: error,
                        });
                    }
                    attempt += 1;
                    tokio::time::sleep(CLAIM_GET_RETRY_PAUSE * attempt).await;
                }
            }
        };
        let found_uid = found.metadata.uid.clone().unwrap_or_default();
        if found_uid != claim.uid {
            return Err(ClaimError::Replaced {
                claim: claim.to_string(),
                found: found_uid,
            });
        }
        if found
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .is_none()
        {
            return Err(ClaimError::NotAllocated {
                claim: claim.to_string(),
            });
        }
        Ok(FetchedClaim {
            claim: found,
            raw_configs,
        })
    }

    async fn get_claim_text(&self, claim: &ClaimRef) -> Result<String, kube::Error> {
        let request = Request::new(ResourceClaim::url_path(&(), Some(&claim.namespace)))
            .get(&claim.name, &GetParams::default())
            .map_err(kube::Error::BuildRequest)?;
        self.client.request_text(request).await
    }

    /// This driver's devices in this node's pool from the claim's allocation, grouped by device, each
    /// checked against what the node publishes.
    pub(super) fn allocated_devices(
        &self,
        claim: &ClaimRef,
        resource_claim: &ResourceClaim,
        inventory: &Inventory,
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        let results = allocation_results(resource_claim);
        let mut devices: Vec<PreparedDevice> = Vec::new();
        for result in results
            .iter()
            .filter(|r| r.driver == self.driver && r.pool == self.pool)
        {
            if let Err(reason) = mig::resolve(inventory, &result.device) {
                return Err(ClaimError::UnknownDevice {
                    claim: claim.to_string(),
                    device: result.device.clone(),
                    reason,
                });
            }
            // The kubelet matches containers to requests by the request's own name, not `request/subrequest`.
            let request = result
                .request
                .split('/')
                .next()
                .unwrap_or_default()
                .to_string();
            match devices.iter_mut().find(|d| d.device == result.device) {
                Some(existing) if !existing.request_names.contains(&request) => {
                    existing.request_names.push(request)
                }
                Some(_) => {}
                None => devices.push(PreparedDevice {
                    request_names: vec![request],
                    pool: self.pool.clone(),
                    device: result.device.clone(),
                    cdi_device_ids: vec![self.cdi.qualified_device_id(&claim.uid, &result.device)],
                    share_id: result.share_id.clone(),
                    admin_access: result.admin_access == Some(true),
                    mig: None,
                    sharing: Default::default(),
                    imex_channels: None,
                }),
            }
        }
        if devices.is_empty() {
            return Err(ClaimError::NoDevicesHere {
                claim: claim.to_string(),
                driver: self.driver.clone(),
                pool: self.pool.clone(),
            });
        }
        Ok(devices)
    }
}

/// A ResourceClaim as the API server sent it, with the raw JSON text of each opaque config's
/// parameters in `status.allocation.devices.config` (same order; `None` where an entry has none).
pub(super) struct FetchedClaim {
    pub claim: ResourceClaim,
    pub raw_configs: Vec<Option<String>>,
}

fn parse_claim(text: &str) -> Result<(ResourceClaim, Vec<Option<String>>), serde_json::Error> {
    let claim: ResourceClaim = serde_json::from_str(text)?;
    Ok((claim, super::configs::raw_allocation_parameters(text)))
}

/// The device results of a claim's allocation (all drivers, all pools); empty when not allocated.
pub fn allocation_results(
    claim: &ResourceClaim,
) -> &[k8s_openapi::api::resource::v1::DeviceRequestAllocationResult] {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default()
}

fn is_transient(error: &kube::Error) -> bool {
    match error {
        kube::Error::Api(status) => status.code >= 500 || status.code == 429,
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}
