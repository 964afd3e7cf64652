//! NodePrepareResources / NodeUnprepareResources for DRA v1 and v1beta1: translate between the wire
//! messages and `claims::Preparer`, which does the work. Every claim of a request gets an entry in the
//! answer; a claim's failure is its own `error` string, never the whole call's.

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::claims::{ClaimRef, PreparedDevice, Preparer};
use crate::proto::{dra_v1 as v1, dra_v1beta1 as v1beta1};

/// DRA v1 service.
pub struct DraV1 {
    preparer: Arc<Preparer>,
}

/// DRA v1beta1 service (kubelets that predate v1); same behaviour, no `share_id`.
pub struct DraV1beta1 {
    preparer: Arc<Preparer>,
}

impl DraV1 {
    pub fn new(preparer: Arc<Preparer>) -> Self {
        DraV1 { preparer }
    }
}

impl DraV1beta1 {
    pub fn new(preparer: Arc<Preparer>) -> Self {
        DraV1beta1 { preparer }
    }
}

/// Turns the wire claims into claim references, keeping duplicates out: the answer is a map by UID.
fn claim_refs<'a>(claims: impl Iterator<Item = (&'a str, &'a str, &'a str)>) -> Vec<ClaimRef> {
    let mut refs: Vec<ClaimRef> = Vec::new();
    for (uid, namespace, name) in claims {
        if !refs.iter().any(|r| r.uid == uid) {
            refs.push(ClaimRef {
                uid: uid.to_string(),
                namespace: namespace.to_string(),
                name: name.to_string(),
            });
        }
    }
    refs
}

async fn prepare_all(
    preparer: &Arc<Preparer>,
    claims: Vec<ClaimRef>,
) -> HashMap<String, Result<Vec<PreparedDevice>, String>> {
    preparer
        .prepare(claims)
        .await
        .into_iter()
        .map(|(claim, result)| (claim.uid, result.map_err(|e| e.to_string())))
        .collect()
}

async fn unprepare_all(preparer: &Arc<Preparer>, claims: Vec<ClaimRef>) -> HashMap<String, String> {
    preparer
        .unprepare(claims)
        .await
        .into_iter()
        .map(|(claim, result)| {
            (
                claim.uid,
                result.err().map(|e| e.to_string()).unwrap_or_default(),
            )
        })
        .collect()
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for DraV1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let request = request.into_inner();
        let refs = claim_refs(
            request
                .claims
                .iter()
                .map(|c| (c.uid.as_str(), c.namespace.as_str(), c.name.as_str())),
        );
        let claims = prepare_all(&self.preparer, refs)
            .await
            .into_iter()
            .map(|(uid, result)| {
                let answer = match result {
                    Ok(devices) => v1::NodePrepareResourceResponse {
                        devices: devices
                            .into_iter()
                            .map(|d| v1::Device {
                                request_names: d.request_names,
                                pool_name: d.pool,
                                device_name: d.device,
                                cdi_device_ids: d.cdi_device_ids,
                                share_id: d.share_id,
                            })
                            .collect(),
                        error: String::new(),
                    },
                    Err(error) => v1::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    },
                };
                (uid, answer)
            })
            .collect();
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let request = request.into_inner();
        let refs = claim_refs(
            request
                .claims
                .iter()
                .map(|c| (c.uid.as_str(), c.namespace.as_str(), c.name.as_str())),
        );
        let claims = unprepare_all(&self.preparer, refs)
            .await
            .into_iter()
            .map(|(uid, error)| (uid, v1::NodeUnprepareResourceResponse { error }))
            .collect();
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for DraV1beta1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let request = request.into_inner();
        let refs = claim_refs(
            request
                .claims
                .iter()
                .map(|c| (c.uid.as_str(), c.namespace.as_str(), c.name.as_str())),
        );
        let claims = prepare_all(&self.preparer, refs)
            .await
            .into_iter()
            .map(|(uid, result)| {
                let answer = match result {
                    Ok(devices) => v1beta1::NodePrepareResourceResponse {
                        devices: devices
                            .into_iter()
                            .map(|d| v1beta1::Device {
                                request_names: d.request_names,
                                pool_name: d.pool,
                                device_name: d.device,
                                cdi_device_ids: d.cdi_device_ids,
                            })
                            .collect(),
                        error: String::new(),
                    },
                    Err(error) => v1beta1::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    },
                };
                (uid, answer)
            })
            .collect();
        Ok(Response::new(v1beta1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let request = request.into_inner();
        let refs = claim_refs(
            request
                .claims
                .iter()
                .map(|c| (c.uid.as_str(), c.namespace.as_str(), c.name.as_str())),
        );
        let claims = unprepare_all(&self.preparer, refs)
            .await
            .into_iter()
            .map(|(uid, error)| (uid, v1beta1::NodeUnprepareResourceResponse { error }))
            .collect();
        Ok(Response::new(v1beta1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}
