//! The kubelet-facing gRPC servers: plugin registration on `<registry-dir>/<driver>-reg.sock`, and the
//! DRA service (v1 and v1beta1) and the resource-health service (v1alpha1 and v1) on
//! `<plugins-dir>/<driver>/dra.sock`.

pub mod accept;
pub mod authority;
pub mod dra;
pub mod health;
pub mod hpack;
pub mod pod_resources;
pub mod registration;
pub mod socket;

pub use authority::LenientAuthority;
pub use dra::{DraV1, DraV1beta1};
pub use health::{DeviceHealthReport, HealthService};
pub use registration::RegistrationService;
pub use socket::{
    bind_private_socket, lenient_incoming, socket_lost, SocketError, SocketFile,
    SOCKET_CHECK_INTERVAL,
};
