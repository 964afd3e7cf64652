//! The kubelet's checks on prepare and unprepare answers: a claim left out or one nobody asked about
//! fails the call, a gRPC error fails it whole, a per-claim error fails only that claim; and the call
//! deadline, a missing DRA socket and many concurrent calls over one connection.

use std::time::Duration;

use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble, KubeletError};

use super::{
    claims, info, node, plugin, registration_socket, serve, serve_registration, Behaviour, DRIVER,
    SHORT_WAIT,
};

#[tokio::test]
async fn answer_missing_a_claim_fails_the_call() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::SkipFirstClaim);
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();

    let error = kubelet.prepare(&claims(3)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::MissingClaims(uids) if uids == &["uid-0"]),
        "{error:?}"
    );
    let error = kubelet.unprepare(&claims(3)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::MissingClaims(uids) if uids == &["uid-0"]),
        "{error:?}"
    );
}

#[tokio::test]
async fn answer_with_an_unknown_claim_fails_the_call() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::AddUnknownClaim);
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();

    let error = kubelet.prepare(&claims(2)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::UnknownClaims(uids) if uids == &["uid-nobody-asked-for"]),
        "{error:?}"
    );
    let error = kubelet.unprepare(&claims(2)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::UnknownClaims(_)),
        "{error:?}"
    );
}

#[tokio::test]
async fn grpc_error_is_a_whole_call_failure() {
    for versions in [["v1.DRAPlugin"], ["v1beta1.DRAPlugin"]] {
        let node = node();
        let plugin = plugin(info(&node, &versions), Behaviour::FailCall);
        serve(&node, &plugin);
        let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
            .await
            .unwrap();

        let error = kubelet.prepare(&claims(1)).await.unwrap_err();
        let KubeletError::Status(status) = error else {
            panic!("expected a gRPC status, got {error:?}");
        };
        assert_eq!(status.code(), tonic::Code::Internal);
        assert!(status.message().contains("GPU driver unreachable"));
        let error = kubelet.unprepare(&claims(1)).await.unwrap_err();
        assert!(
            matches!(&error, KubeletError::Status(s) if s.code() == tonic::Code::Unavailable),
            "{error:?}"
        );
    }
}

#[tokio::test]
async fn per_claim_error_fails_only_that_claim() {
    let node = node();
    let plugin = plugin(
        info(&node, &["v1.DRAPlugin"]),
        Behaviour::FailClaim("uid-1".to_string()),
    );
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();

    let prepared = kubelet.prepare(&claims(2)).await.unwrap();
    assert!(prepared["uid-0"].is_ok());
    assert_eq!(
        prepared["uid-1"],
        Err("claim default/claim-1: device gpu-0 is in use".to_string())
    );
    let unprepared = kubelet.unprepare(&claims(2)).await.unwrap();
    assert_eq!(unprepared["uid-0"], Ok(()));
    assert_eq!(
        unprepared["uid-1"],
        Err("CDI spec could not be removed".to_string())
    );
}

#[tokio::test]
async fn slow_plugin_hits_the_call_deadline() {
    let node = node();
    let plugin = plugin(
        info(&node, &["v1.DRAPlugin"]),
        Behaviour::Stall(Duration::from_secs(5)),
    );
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap()
        .with_call_timeout(Duration::from_millis(200));

    let error = kubelet.prepare(&claims(1)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::Status(s) if s.code() == tonic::Code::DeadlineExceeded),
        "{error:?}"
    );
}

#[tokio::test]
async fn missing_dra_socket_fails_calls_not_registration() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    serve_registration(&registration_socket(&node), &plugin);

    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    let error = kubelet.prepare(&claims(1)).await.unwrap_err();
    assert!(matches!(error, KubeletError::Status(_)), "{error:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_prepares_share_one_kubelet() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();

    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let kubelet = kubelet.clone();
            tokio::spawn(async move {
                let claim =
                    ClaimRef::new("default", format!("pod-{i}-claim"), format!("uid-pod-{i}"));
                kubelet.prepare(std::slice::from_ref(&claim)).await
            })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let prepared = task.await.unwrap().unwrap();
        assert_eq!(
            prepared[&format!("uid-pod-{i}")].as_ref().unwrap()[0].device_name,
            format!("gpu-pod-{i}-claim")
        );
    }
    assert_eq!(plugin.calls().len(), 16);
}
