//! What tests reach around HTTP for: injected faults and latency that the client sees, the
//! kubeconfig that points at the server, the insert/remove/wait_for hooks, and the tokens its
//! SelfSubjectReview answers for.

use std::time::{Duration, Instant};

use gpu_dra::support::apiserver::{ApiServer, FaultSpec, Verb};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use super::{slice, start, status, DRIVER};

#[tokio::test]
async fn injected_faults_reach_the_client() {
    let (server, api) = start().await;
    server.fail_next(FaultSpec {
        verb: Some(Verb::Create),
        resource: Some("resourceslices".into()),
        code: 500,
        count: 1,
    });
    let err = status(
        api.create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (500, "InternalError"));
    assert!(
        server.list("resourceslices").is_empty(),
        "a failed request is not applied"
    );

    server.fail_next(FaultSpec {
        verb: Some(Verb::Get),
        resource: None,
        code: 409,
        count: 2,
    });
    api.create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
        .await
        .unwrap();
    assert_eq!(status(api.get("s").await).code, 409);
    assert_eq!(status(api.get("s").await).code, 409);
    api.get("s").await.unwrap();

    let no_retries: Api<ResourceSlice> = Api::all(server.client_without_retries());
    server.fail_next(FaultSpec {
        verb: None,
        resource: Some("resourceslices".into()),
        code: 503,
        count: 1,
    });
    let err = status(no_retries.get("s").await);
    assert_eq!((err.code, err.reason.as_str()), (503, "ServiceUnavailable"));

    // kube's default client retries 429 after Retry-After and succeeds.
    server.clear_requests();
    server.fail_next(FaultSpec {
        verb: Some(Verb::List),
        resource: None,
        code: 429,
        count: 1,
    });
    api.list(&ListParams::default()).await.unwrap();
    let codes: Vec<u16> = server.requests().iter().map(|r| r.code).collect();
    assert_eq!(codes, [429, 200]);
    server.fail_next(FaultSpec {
        verb: Some(Verb::Delete),
        resource: None,
        code: 500,
        count: 1,
    });
    server.clear_faults();
    api.delete("s", &DeleteParams::default()).await.unwrap();
}

#[tokio::test]
async fn latency_delays_requests() {
    let (server, api) = start().await;
    server.set_latency(Duration::from_millis(300));
    let started = Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    server.clear_faults();
    let started = Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(300));
}

#[tokio::test]
async fn kubeconfig_points_at_the_server() {
    let (server, _) = start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    server.write_kubeconfig(&path).unwrap();
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    // `Client::try_from(config)` is what a plugin process does with this; it is not called here because
    // kube's rustls setup panics in test builds that link both ring and aws-lc-rs.
    assert_eq!(
        config.cluster_url.to_string().trim_end_matches('/'),
        server.url()
    );
    assert!(config.auth_info.token.is_none() && config.root_cert.is_none());
}

#[tokio::test]
async fn hooks_and_wait_for() {
    let (server, api) = start().await;
    let waiter = {
        let api = api.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            api.create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
                .await
                .unwrap();
        })
    };
    let found = server
        .wait_for("resourceslices", |s| s.len() == 1, Duration::from_secs(5))
        .await;
    assert_eq!(found.unwrap()[0]["metadata"]["name"], "s");
    waiter.await.unwrap();
    assert!(server
        .wait_for(
            "resourceslices",
            |s| s.is_empty(),
            Duration::from_millis(50)
        )
        .await
        .is_none());
    let version = server.resource_version();
    assert!(server.remove("resourceslices", None, "s").is_some());
    assert_eq!(server.resource_version(), version + 1);
    server.shutdown().await;
    assert!(api.list(&ListParams::default()).await.is_err());
}

/// `kubectl auth whoami` as kube-apiserver v1.34 answers it (realk8s): `201` with `status.userInfo`; a
/// token bound to a Pod carries the Pod's and its node's claims in `extra`, one bound to nothing only
/// its credential id; a token the server did not issue is `401`.
#[tokio::test]
async fn self_subject_reviews_answer_who_the_token_is() {
    use gpu_dra::support::apiserver::NODE_NAME_CLAIM;
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let api = ApiServer::start().await.expect("API server double");
    let who = |client: kube::Client| async move {
        Api::<SelfSubjectReview>::all(client)
            .create(&PostParams::default(), &SelfSubjectReview::default())
            .await
            .map(|review| review.status.and_then(|s| s.user_info).expect("userInfo"))
    };

    let bound = api.pod_bound_token("gpu-dra", "gpu-dra-plugin", "plugin-x", "node-1");
    let user = who(api.client_with_token(&bound)).await.unwrap();
    assert_eq!(
        user.username.as_deref(),
        Some("system:serviceaccount:gpu-dra:gpu-dra-plugin")
    );
    assert_eq!(
        user.groups.unwrap_or_default(),
        [
            "system:serviceaccounts",
            "system:serviceaccounts:gpu-dra",
            "system:authenticated"
        ]
    );
    assert!(user.uid.is_some_and(|uid| !uid.is_empty()));
    let extra = user.extra.unwrap_or_default();
    let keys: Vec<&str> = extra.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "authentication.kubernetes.io/credential-id",
            NODE_NAME_CLAIM,
            "authentication.kubernetes.io/node-uid",
            "authentication.kubernetes.io/pod-name",
            "authentication.kubernetes.io/pod-uid",
        ]
    );
    assert_eq!(extra[NODE_NAME_CLAIM], ["node-1"]);
    assert_eq!(extra["authentication.kubernetes.io/pod-name"], ["plugin-x"]);

    let unbound = api.unbound_token("gpu-dra", "gpu-dra-plugin");
    let user = who(api.client_with_token(&unbound)).await.unwrap();
    let extra = user.extra.unwrap_or_default();
    assert_eq!(
        extra.keys().collect::<Vec<_>>(),
        ["authentication.kubernetes.io/credential-id"]
    );

    // No token: the admin of the double's kubeconfig.
    let user = who(api.client()).await.unwrap();
    assert_eq!(user.username.as_deref(), Some("admin"));
    assert!(user.extra.is_none());

    let refused = status(who(api.client_with_token("not-issued")).await);
    assert_eq!(
        (refused.code, refused.reason.as_str()),
        (401, "Unauthorized")
    );
    let codes: Vec<u16> = api
        .requests()
        .iter()
        .filter(|r| r.resource == "selfsubjectreviews" && r.verb == Verb::Create)
        .map(|r| r.code)
        .collect();
    assert_eq!(codes, [201, 201, 201, 401]);
}
