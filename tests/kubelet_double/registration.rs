//! Registration as the kubelet does it: service choice by the plugin's order among what the kubelet
//! supports, the rejections it notifies the plugin of, waiting for the socket, and GetInfo's deadline
//! with the retry after a failed attempt.

use std::collections::HashMap;
use std::time::Duration;

use gpu_dra::kubelet::lenient_incoming;
use gpu_dra::proto::dra_v1;
use gpu_dra::proto::pluginregistration::registration_server::RegistrationServer;
use gpu_dra::proto::pluginregistration::{PluginInfo, RegistrationStatus};
use gpu_dra::support::kubelet::{DraService, KubeletDouble, KubeletError, PreparedDevice};
use tokio::net::UnixListener;

use super::{
    claims, info, node, plugin, registration_socket, serve, serve_registration, Behaviour, DRIVER,
    SHORT_WAIT,
};

#[tokio::test]
async fn correct_plugin_registers_on_v1_and_round_trips() {
    let node = node();
    let plugin = plugin(
        info(
            &node,
            &[
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                "v1alpha1.DRAResourceHealth",
            ],
        ),
        Behaviour::Answer,
    );
    serve(&node, &plugin);

    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert_eq!(kubelet.service(), DraService::V1);
    assert_eq!(kubelet.plugin_info(), &plugin.info);
    assert_eq!(kubelet.endpoint(), node.dra_socket);
    assert_eq!(
        plugin.statuses(),
        vec![RegistrationStatus {
            plugin_registered: true,
            error: String::new()
        }]
    );

    let claims = claims(2);
    let prepared = kubelet.prepare(&claims).await.unwrap();
    assert_eq!(prepared.len(), 2);
    assert_eq!(
        prepared["uid-1"],
        Ok(vec![PreparedDevice {
            request_names: vec!["gpu".to_string()],
            pool_name: "node-a".to_string(),
            device_name: "gpu-claim-1".to_string(),
            cdi_device_ids: vec![format!("k8s.{DRIVER}/gpu=uid-1-gpu-0")],
            share_id: Some("share-uid-1".to_string()),
        }])
    );

    let unprepared = kubelet.unprepare(&claims).await.unwrap();
    assert_eq!(
        unprepared,
        HashMap::from([("uid-0".to_string(), Ok(())), ("uid-1".to_string(), Ok(()))])
    );
    assert_eq!(plugin.calls(), vec!["v1 prepare", "v1 unprepare"]);
}

#[tokio::test]
async fn registration_waits_for_the_socket_to_appear() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    let kubelet = tokio::spawn({
        let dir = node.registry_dir.clone();
        async move { KubeletDouble::register(&dir, DRIVER, SHORT_WAIT).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    serve(&node, &plugin);
    assert_eq!(kubelet.await.unwrap().unwrap().service(), DraService::V1);
}

#[tokio::test]
async fn plugin_advertising_only_v1beta1_is_called_over_v1beta1() {
    let node = node();
    let plugin = plugin(info(&node, &["v1beta1.DRAPlugin"]), Behaviour::Answer);
    serve(&node, &plugin);

    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert_eq!(kubelet.service(), DraService::V1beta1);

    let claims = claims(1);
    let prepared = kubelet.prepare(&claims).await.unwrap();
    let devices = prepared["uid-0"].as_ref().unwrap();
    assert_eq!(devices[0].device_name, "gpu-claim-0");
    assert_eq!(devices[0].share_id, None, "v1beta1 has no share_id");
    assert_eq!(kubelet.unprepare(&claims).await.unwrap()["uid-0"], Ok(()));
    assert_eq!(plugin.calls(), vec!["v1beta1 prepare", "v1beta1 unprepare"]);
}

#[tokio::test]
async fn plugin_order_decides_between_supported_services() {
    let node = node();
    let plugin = plugin(
        info(
            &node,
            &[
                "v1alpha1.DRAResourceHealth",
                "v1beta1.DRAPlugin",
                "v1.DRAPlugin",
            ],
        ),
        Behaviour::Answer,
    );
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert_eq!(kubelet.service(), DraService::V1beta1);
}

#[tokio::test]
async fn kubelet_knowing_only_v1beta1_uses_it() {
    let node = node();
    let plugin = plugin(
        info(&node, &["v1.DRAPlugin", "v1beta1.DRAPlugin"]),
        Behaviour::Answer,
    );
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register_with(
        &node.registry_dir,
        DRIVER,
        SHORT_WAIT,
        &["v1beta1.DRAPlugin"],
    )
    .await
    .unwrap();
    assert_eq!(kubelet.service(), DraService::V1beta1);
    kubelet.prepare(&claims(1)).await.unwrap();
    assert_eq!(plugin.calls(), vec!["v1beta1 prepare"]);
}

#[tokio::test]
async fn empty_endpoint_means_the_registration_socket() {
    let node = node();
    let mut info = info(&node, &["v1.DRAPlugin"]);
    info.endpoint = String::new();
    let plugin = plugin(info, Behaviour::Answer);
    // One server for everything, on the registration socket.
    let incoming = lenient_incoming(UnixListener::bind(registration_socket(&node)).unwrap());
    let router = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(plugin.clone()))
        .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(
            plugin.clone(),
        ));
    tokio::spawn(router.serve_with_incoming(incoming));

    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert_eq!(kubelet.endpoint(), registration_socket(&node));
    kubelet.prepare(&claims(1)).await.unwrap();
}

/// Registers a plugin whose `GetInfo` answer was edited by `edit`; expects a rejection that the plugin also heard of.
async fn assert_rejected(edit: impl FnOnce(&mut PluginInfo), reason_part: &str) {
    let node = node();
    let mut info = info(&node, &["v1.DRAPlugin"]);
    edit(&mut info);
    let plugin = plugin(info, Behaviour::Answer);
    serve(&node, &plugin);

    let error = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap_err();
    let KubeletError::Rejected(reason) = error else {
        panic!("expected a rejection, got {error:?}");
    };
    assert!(
        reason.contains(reason_part),
        "{reason:?} should mention {reason_part:?}"
    );
    let statuses = plugin.statuses();
    assert_eq!(statuses.len(), 1);
    assert!(!statuses[0].plugin_registered);
    assert_eq!(statuses[0].error, reason);
}

#[tokio::test]
async fn wrong_plugin_type_is_rejected() {
    assert_rejected(
        |info| info.r#type = "DevicePlugin".to_string(),
        "RegisterPlugin error -- no handler registered for plugin type: DevicePlugin at socket ",
    )
    .await;
}

#[tokio::test]
async fn the_plugin_name_is_taken_as_advertised() {
    // Nothing ties the name in GetInfo to the socket's file name: the kubelet registers what it is told.
    let node = node();
    let mut info = info(&node, &["v1.DRAPlugin"]);
    info.name = "other.example.com".to_string();
    let plugin = plugin(info, Behaviour::Answer);
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert_eq!(kubelet.plugin_info().name, "other.example.com");
    assert!(plugin.statuses()[0].plugin_registered);
}

#[tokio::test]
async fn a_relative_endpoint_registers_and_then_fails_to_connect() {
    // The kubelet does not check the endpoint; `unix:` + a relative path resolves against its own working
    // directory, where no such socket exists.
    let node = node();
    let mut info = info(&node, &["v1.DRAPlugin"]);
    info.endpoint = "no-such-dir/dra.sock".to_string();
    let plugin = plugin(info, Behaviour::Answer);
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    let error = kubelet.prepare(&claims(1)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::Status(s) if s.code() == tonic::Code::Unavailable),
        "{error:?}"
    );
}

#[tokio::test]
async fn empty_supported_versions_are_rejected() {
    assert_rejected(
        |info| info.supported_versions.clear(),
        "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of DRA \
         driver plugin gpu.example.com at endpoint ",
    )
    .await;
    assert_rejected(
        |info| info.supported_versions.clear(),
        ": empty list of supported gRPC services (aka supported versions)",
    )
    .await;
}

#[tokio::test]
async fn only_unknown_services_are_rejected() {
    assert_rejected(
        |info| {
            info.supported_versions = vec![
                "v1alpha1.DRAResourceHealth".to_string(),
                "v2.DRAPlugin".to_string(),
            ]
        },
        "none of services supported by the plugin ([\"v1alpha1.DRAResourceHealth\" \"v2.DRAPlugin\"]) are \
         supported by the kubelet ([\"v1.DRAPlugin\" \"v1beta1.DRAPlugin\"])",
    )
    .await;
}

#[tokio::test]
async fn v1_only_plugin_is_rejected_by_a_v1beta1_kubelet() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    serve(&node, &plugin);
    let error = KubeletDouble::register_with(
        &node.registry_dir,
        DRIVER,
        SHORT_WAIT,
        &["v1beta1.DRAPlugin"],
    )
    .await
    .unwrap_err();
    assert!(matches!(error, KubeletError::Rejected(_)), "{error:?}");
    assert!(!plugin.statuses()[0].plugin_registered);
}

#[tokio::test]
async fn hidden_names_and_plain_files_are_not_registration_sockets() {
    let node = node();
    // A regular file with the right name (a leftover) and a socket with a hidden name are both ignored.
    std::fs::write(registration_socket(&node), b"not a socket").unwrap();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    serve_registration(
        &node.registry_dir.join(format!(".{DRIVER}-reg.sock")),
        &plugin,
    );

    let error = KubeletDouble::register(&node.registry_dir, DRIVER, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(error, KubeletError::Timeout { .. }), "{error:?}");
    assert!(plugin.statuses().is_empty());
}

#[tokio::test]
async fn get_info_has_one_second_and_a_failed_registration_is_retried() {
    let node = node();
    let mut slow = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    // The first GetInfo misses the kubelet's 1 s deadline; the retry 500 ms later is answered.
    slow.get_info_delays = vec![Duration::from_millis(1500)];
    serve(&node, &slow);
    let started = std::time::Instant::now();
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(kubelet.service(), DraService::V1);
    assert_eq!(slow.seen.lock().unwrap().get_infos, 2);
    let statuses = slow.statuses();
    assert_eq!(statuses.len(), 1);
    assert!(statuses[0].plugin_registered);

    // A plugin that is always too slow fails with the deadline once the caller's time is up.
    let other = self::node();
    let mut stuck = plugin(info(&other, &["v1.DRAPlugin"]), Behaviour::Answer);
    stuck.get_info_delays = vec![Duration::from_secs(3); 10];
    serve(&other, &stuck);
    let error = KubeletDouble::register(&other.registry_dir, DRIVER, Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, KubeletError::GetInfo(s) if s.code() == tonic::Code::DeadlineExceeded),
        "{error:?}"
    );
    assert_eq!(stuck.seen.lock().unwrap().get_infos, 2);
    assert!(stuck.statuses().is_empty());
}
