//! The kubelet gRPC APIs, generated at build time from our own `.proto` files in `proto/`.
//! Each upstream package gets its own module because the bare package names (`v1`, `v1alpha1`) collide.

/// Plugin registration (`pluginregistration`), served on the registration socket.
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// DRA kubelet plugin API v1 (`k8s.io.kubelet.pkg.apis.dra.v1`).
pub mod dra_v1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// DRA kubelet plugin API v1beta1 (`k8s.io.kubelet.pkg.apis.dra.v1beta1`).
pub mod dra_v1beta1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
}

/// DRA resource health API v1alpha1 (`v1alpha1`).
pub mod health_v1alpha1 {
    tonic::include_proto!("v1alpha1");
}

/// DRA resource health API v1 (`v1`, Kubernetes 1.37+); same messages as v1alpha1. The kubelet's
/// PodResources API has the same bare package name, so its types are generated here too; use them
/// through [`podresources_v1`].
pub mod health_v1 {
    tonic::include_proto!("v1");
}

/// The kubelet's PodResources API v1 (`v1.PodResourcesLister`), as monitoring agents read it.
pub mod podresources_v1 {
    pub use super::health_v1::{
        pod_resources_lister_client, pod_resources_lister_server, CdiDevice, ClaimResource,
        ContainerDevices, ContainerResources, DynamicResource, GetPodResourcesRequest,
        GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
    };
}

/// The registration strings a DRA plugin advertises in `PluginInfo.supported_versions`.
pub const DRA_V1_SERVICE: &str = "v1.DRAPlugin";
pub const DRA_V1BETA1_SERVICE: &str = "v1beta1.DRAPlugin";
pub const HEALTH_V1ALPHA1_SERVICE: &str = "v1alpha1.DRAResourceHealth";
pub const HEALTH_V1_SERVICE: &str = "v1.DRAResourceHealth";
/// `PluginInfo.type` of a DRA plugin.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
