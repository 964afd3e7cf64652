//! How the kubelet names the sockets it dials (`:authority`): the registration socket by raw path,
//! percent-encoded as grpc-go encodes it, which a strict HTTP/2 server refuses, and the DRA socket by
//! the `unix:` scheme, or by raw path as older kubelets did, which needs the driver's repair.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::TryStreamExt;
use gpu_dra::kubelet::authority::{lenient_policy, AuthorityPolicy};
use gpu_dra::kubelet::LenientAuthority;
use gpu_dra::proto::pluginregistration::registration_server::RegistrationServer;
use gpu_dra::proto::{dra_v1, dra_v1beta1};
use gpu_dra::support::grpc_dial::encode_authority;
use gpu_dra::support::kubelet::{Dial, KubeletDouble, KubeletError};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

use super::{
    claims, info, node, plugin, registration_socket, serve_dra, Behaviour, FakePlugin, Node,
    DRIVER, SHORT_WAIT,
};

type Authorities = Arc<Mutex<Vec<String>>>;

/// Accepts like the driver does, and records every `:authority` the server was sent.
fn recording_incoming(
    socket: &Path,
    seen: Authorities,
    lenient: bool,
) -> impl futures::Stream<Item = std::io::Result<LenientAuthority<tokio::net::UnixStream>>> {
    let repair = lenient_policy();
    let policy: AuthorityPolicy = Arc::new(move |authority: &[u8]| {
        seen.lock()
            .unwrap()
            .push(String::from_utf8_lossy(authority).into_owned());
        if lenient {
            repair(authority)
        } else {
            None
        }
    });
    UnixListenerStream::new(UnixListener::bind(socket).unwrap())
        .map_ok(move |stream| LenientAuthority::with_policy(stream, policy.clone()))
}

/// Serves the fake plugin on both sockets, recording authorities; `lenient_dra: false` leaves the DRA socket
/// as strict as plain tonic.
fn serve_recording(
    node: &Node,
    plugin: &FakePlugin,
    lenient_dra: bool,
) -> (Authorities, Authorities) {
    let registration = Authorities::default();
    let dra = Authorities::default();
    let router = tonic::transport::Server::builder()
        .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(
            plugin.clone(),
        ))
        .add_service(dra_v1beta1::dra_plugin_server::DraPluginServer::new(
            plugin.clone(),
        ));
    tokio::spawn(router.serve_with_incoming(recording_incoming(
        &node.dra_socket,
        dra.clone(),
        lenient_dra,
    )));
    let router =
        tonic::transport::Server::builder().add_service(RegistrationServer::new(plugin.clone()));
    let socket = registration_socket(node);
    tokio::spawn(router.serve_with_incoming(recording_incoming(
        &socket,
        registration.clone(),
        true,
    )));
    (registration, dra)
}

#[test]
fn the_authority_is_encoded_as_grpc_go_encodes_it() {
    assert_eq!(
        encode_authority("/var/lib/kubelet/plugins_registry/gpu.dra.dev-reg.sock"),
        "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.dra.dev-reg.sock"
    );
    assert_eq!(
        encode_authority("/a b/c%d:[x]@y!~"),
        "%2Fa%20b%2Fc%25d:[x]@y!~"
    );
}

#[tokio::test]
async fn registration_is_dialled_by_raw_path_and_dra_by_unix_scheme() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    let (registration, dra) = serve_recording(&node, &plugin, true);

    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    kubelet.prepare(&claims(1)).await.unwrap();

    let encoded_path = encode_authority(&registration_socket(&node).display().to_string());
    assert!(encoded_path.starts_with("%2F"), "{encoded_path}");
    // GetInfo and NotifyRegistrationStatus.
    assert_eq!(*registration.lock().unwrap(), vec![encoded_path; 2]);
    assert_eq!(*dra.lock().unwrap(), vec!["localhost".to_string()]);
}

#[tokio::test]
async fn a_strict_http2_server_refuses_the_kubelets_registration() {
    // What the real kubelet saw from gpu-dra before the repair: tonic alone resets the stream.
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    serve_dra(&node.dra_socket, &plugin);
    let incoming = UnixListenerStream::new(UnixListener::bind(registration_socket(&node)).unwrap());
    let router =
        tonic::transport::Server::builder().add_service(RegistrationServer::new(plugin.clone()));
    tokio::spawn(router.serve_with_incoming(incoming));

    let error = KubeletDouble::register(&node.registry_dir, DRIVER, Duration::from_millis(1200))
        .await
        .unwrap_err();
    let KubeletError::GetInfo(status) = &error else {
        panic!("expected GetInfo to fail, got {error:?}");
    };
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    assert!(
        format!("{status:?}")
            .to_lowercase()
            .contains("protocol error"),
        "{status:?}"
    );
    // h2 reset every stream before tonic saw a request, so GetInfo never ran.
    assert_eq!(plugin.seen.lock().unwrap().get_infos, 0);
    assert!(plugin.statuses().is_empty());
}

#[tokio::test]
async fn the_dra_socket_dialled_by_raw_path_needs_the_repair() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    let (_, dra) = serve_recording(&node, &plugin, false);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    // `localhost` is fine for plain tonic; the raw path is not.
    kubelet.prepare(&claims(1)).await.unwrap();
    let error = kubelet
        .redial(Dial::RawPath)
        .prepare(&claims(1))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, KubeletError::Status(s) if s.code() == tonic::Code::Internal),
        "{error:?}"
    );
    let encoded_path = encode_authority(&node.dra_socket.display().to_string());
    assert_eq!(
        *dra.lock().unwrap(),
        vec!["localhost".to_string(), encoded_path]
    );

    // With the repair in front, the same dial works.
    let repaired = self::node();
    let plugin = self::plugin(info(&repaired, &["v1.DRAPlugin"]), Behaviour::Answer);
    let (_, dra) = serve_recording(&repaired, &plugin, true);
    let kubelet = KubeletDouble::register(&repaired.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap()
        .redial(Dial::RawPath);
    kubelet.prepare(&claims(2)).await.unwrap();
    kubelet.unprepare(&claims(2)).await.unwrap();
    assert_eq!(dra.lock().unwrap().len(), 2);
}
