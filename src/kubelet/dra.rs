//! NodePrepareResources / NodeUnprepareResources for DRA v1 and v1beta1: one service, [`Dra`], that
//! translates between the wire messages and `claims::Preparer`, which does the work. Each version says
//! how its messages map to and from [`ClaimRef`] and [`PreparedDevice`] ([`DraVersion`]); everything
//! else is the same code. Every claim of a request gets an entry in the answer; a claim's failure is
//! its own `error` string, never the whole call's.
//!
//! ```ignore
//! Server::builder()
//!     .add_service(DraPluginServer::new(DraV1::new(preparer.clone())))
//!     .add_service(DraV1beta1Server::new(DraV1beta1::new(preparer)));
//! ```

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::claims::{ClaimRef, PreparedDevice, Preparer};
use crate::proto::{dra_v1 as v1, dra_v1beta1 as v1beta1};

/// One version of the kubelet's DRA service: its wire messages in the claims' terms.
pub trait DraVersion: Send + Sync + 'static {
    type Claim;
    type Device;
    type PrepareAnswer;
    type UnprepareAnswer;

    /// A claim of a request: UID, namespace, name.
    fn claim(claim: &Self::Claim) -> (&str, &str, &str);
    /// A prepared device as this version sends it.
    fn device(device: PreparedDevice) -> Self::Device;
    /// One claim's answer to NodePrepareResources: its devices, or why not.
    fn prepare_answer(devices: Vec<Self::Device>, error: String) -> Self::PrepareAnswer;
    /// One claim's answer to NodeUnprepareResources: empty, or why not.
    fn unprepare_answer(error: String) -> Self::UnprepareAnswer;
}

/// DRA v1.
#[derive(Debug)]
pub enum V1 {}

/// DRA v1beta1 (kubelets that predate v1): the same, without `share_id`.
#[derive(Debug)]
pub enum V1beta1 {}

impl DraVersion for V1 {
    type Claim = v1::Claim;
    type Device = v1::Device;
    type PrepareAnswer = v1::NodePrepareResourceResponse;
    type UnprepareAnswer = v1::NodeUnprepareResourceResponse;

    fn claim(claim: &v1::Claim) -> (&str, &str, &str) {
        (&claim.uid, &claim.namespace, &claim.name)
    }

    fn device(d: PreparedDevice) -> v1::Device {
        v1::Device {
            request_names: d.request_names,
            pool_name: d.pool,
            device_name: d.device,
            cdi_device_ids: d.cdi_device_ids,
            share_id: d.share_id,
        }
    }

    fn prepare_answer(devices: Vec<v1::Device>, error: String) -> Self::PrepareAnswer {
        v1::NodePrepareResourceResponse { devices, error }
    }

    fn unprepare_answer(error: String) -> Self::UnprepareAnswer {
        v1::NodeUnprepareResourceResponse { error }
    }
}

impl DraVersion for V1beta1 {
    type Claim = v1beta1::Claim;
    type Device = v1beta1::Device;
    type PrepareAnswer = v1beta1::NodePrepareResourceResponse;
    type UnprepareAnswer = v1beta1::NodeUnprepareResourceResponse;

    fn claim(claim: &v1beta1::Claim) -> (&str, &str, &str) {
        (&claim.uid, &claim.namespace, &claim.name)
    }

    fn device(d: PreparedDevice) -> v1beta1::Device {
        // v1beta1 has no share_id: a kubelet that speaks it does not know consumable capacity.
        v1beta1::Device {
            request_names: d.request_names,
            pool_name: d.pool,
            device_name: d.device,
            cdi_device_ids: d.cdi_device_ids,
        }
    }

    fn prepare_answer(devices: Vec<v1beta1::Device>, error: String) -> Self::PrepareAnswer {
        v1beta1::NodePrepareResourceResponse { devices, error }
    }

    fn unprepare_answer(error: String) -> Self::UnprepareAnswer {
        v1beta1::NodeUnprepareResourceResponse { error }
    }
}

/// The DRA service of one version, over the plugin's [`Preparer`].
pub struct Dra<V> {
    preparer: Arc<Preparer>,
    version: PhantomData<fn() -> V>,
}

/// DRA v1 service.
pub type DraV1 = Dra<V1>;
/// DRA v1beta1 service.
pub type DraV1beta1 = Dra<V1beta1>;

impl<V: DraVersion> Dra<V> {
    pub fn new(preparer: Arc<Preparer>) -> Self {
        Dra {
            preparer,
            version: PhantomData,
        }
    }

    /// Prepares the request's claims; each claim's answer by UID.
    pub async fn prepare(&self, claims: &[V::Claim]) -> HashMap<String, V::PrepareAnswer> {
        self.preparer
            .prepare(claim_refs::<V>(claims))
            .await
            .into_iter()
            .map(|(claim, result)| {
                let answer = match result {
                    Ok(devices) => V::prepare_answer(
                        devices.into_iter().map(V::device).collect(),
                        String::new(),
                    ),
                    Err(error) => V::prepare_answer(Vec::new(), error.to_string()),
                };
                (claim.uid, answer)
            })
            .collect()
    }

    /// Unprepares the request's claims; each claim's answer by UID.
    pub async fn unprepare(&self, claims: &[V::Claim]) -> HashMap<String, V::UnprepareAnswer> {
        self.preparer
            .unprepare(claim_refs::<V>(claims))
            .await
            .into_iter()
            .map(|(claim, result)| {
                let error = result.err().map(|e| e.to_string()).unwrap_or_default();
                (claim.uid, V::unprepare_answer(error))
            })
            .collect()
    }
}

/// Turns the wire claims into claim references, keeping duplicates out: the answer is a map by UID.
fn claim_refs<V: DraVersion>(claims: &[V::Claim]) -> Vec<ClaimRef> {
    let mut refs: Vec<ClaimRef> = Vec::new();
    for (uid, namespace, name) in claims.iter().map(V::claim) {
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

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for DraV1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let claims = self.prepare(&request.into_inner().claims).await;
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let claims = self.unprepare(&request.into_inner().claims).await;
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for DraV1beta1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let claims = self.prepare(&request.into_inner().claims).await;
        Ok(Response::new(v1beta1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let claims = self.unprepare(&request.into_inner().claims).await;
        Ok(Response::new(v1beta1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}
