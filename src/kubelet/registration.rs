//! The plugin registration service the kubelet calls on `<driver>-reg.sock`: GetInfo tells it the driver
//! name, the DRA socket and the services we serve; NotifyRegistrationStatus tells us the verdict.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::observability::Readiness;
use crate::proto::pluginregistration::registration_server::Registration;
use crate::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use crate::proto::{
    DRA_PLUGIN_TYPE, DRA_V1BETA1_SERVICE, DRA_V1_SERVICE, HEALTH_V1ALPHA1_SERVICE,
    HEALTH_V1_SERVICE,
};

pub struct RegistrationService {
    driver_name: String,
    dra_endpoint: String,
    readiness: Arc<Readiness>,
}

impl RegistrationService {
    /// `dra_endpoint` must be the absolute path of the DRA socket (the kubelet adds `unix://`).
    pub fn new(
        driver_name: &str,
        dra_endpoint: &std::path::Path,
        readiness: Arc<Readiness>,
    ) -> Self {
        RegistrationService {
            driver_name: driver_name.to_string(),
            dra_endpoint: dra_endpoint.display().to_string(),
            readiness,
        }
    }

    pub fn plugin_info(&self) -> PluginInfo {
        PluginInfo {
            r#type: DRA_PLUGIN_TYPE.to_string(),
            name: self.driver_name.clone(),
            endpoint: self.dra_endpoint.clone(),
            // The kubelet takes the first DRA entry it supports: v1 first, v1beta1 for older kubelets.
            // It ignores the health entries for that choice; 1.37 opens the health stream only on
            // a health service listed here (v1 preferred), 1.34 – 1.36 always open v1alpha1.
            supported_versions: vec![
                DRA_V1_SERVICE.to_string(),
                DRA_V1BETA1_SERVICE.to_string(),
                HEALTH_V1_SERVICE.to_string(),
                HEALTH_V1ALPHA1_SERVICE.to_string(),
            ],
        }
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<InfoRequest>,
    ) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(self.plugin_info()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            info!(driver = %self.driver_name, "registered with the kubelet");
            self.readiness.set_registration(true, None);
        } else {
            warn!(driver = %self.driver_name, error = %status.error, "the kubelet rejected the registration");
            self.readiness.set_registration(false, Some(status.error));
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
