//! Who a client is: bearer tokens the double issues, and its answer to `POST
//! authentication.k8s.io/v1 selfsubjectreviews` (`kubectl auth whoami`), shaped as kube-apiserver
//! v1.34 answers it (checked on realk8s): `201` with `status.userInfo` (username, uid, groups, extra).
//!
//! What it does not model: the double authenticates nothing else. Every other request is served
//! whatever its token, as for the admin of the kubeconfig it writes. A SelfSubjectReview without a
//! token answers as that admin (the real server would answer an anonymous request with 403); one with a
//! token the double did not issue gets `401 Unauthorized`, as from the real server.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::{lock, now_timestamp, ApiServer};

/// The pod-bound token claims the API server puts in `extra` (ServiceAccountTokenPodNodeInfo, 1.32+).
pub const NODE_NAME_CLAIM: &str = "authentication.kubernetes.io/node-name";

/// The tokens the double issued, and the user of each.
#[derive(Default)]
pub(super) struct Tokens(BTreeMap<String, Value>);

/// The user of a request without a token: the admin of the double's kubeconfig, as realk8s's
/// `admin.kubeconfig` is answered.
fn admin() -> Value {
    json!({
        "username": "admin",
        "uid": "admin-uid",
        "groups": ["system:masters", "system:authenticated"],
    })
}

fn service_account_user(namespace: &str, account: &str, extra: Value) -> Value {
    json!({
        "username": format!("system:serviceaccount:{namespace}:{account}"),
        "uid": uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, format!("{namespace}/{account}").as_bytes()).to_string(),
        "groups": [
            "system:serviceaccounts",
            format!("system:serviceaccounts:{namespace}"),
            "system:authenticated",
        ],
        "extra": extra,
    })
}

impl ApiServer {
    /// A token of service account `namespace/account` bound to Pod `pod` on `node`, as the kubelet
    /// mounts one in a Pod: its user carries the Pod's and the node's claims in `extra`.
    pub fn pod_bound_token(&self, namespace: &str, account: &str, pod: &str, node: &str) -> String {
        let credential = uuid::Uuid::new_v4();
        let uid = |name: &str| uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, name.as_bytes());
        let extra = json!({
            "authentication.kubernetes.io/credential-id": [format!("JTI={credential}")],
            NODE_NAME_CLAIM: [node],
            "authentication.kubernetes.io/node-uid": [uid(node).to_string()],
            "authentication.kubernetes.io/pod-name": [pod],
            "authentication.kubernetes.io/pod-uid": [uid(&format!("{namespace}/{pod}")).to_string()],
        });
        self.issue(service_account_user(namespace, account, extra))
    }

    /// A token of service account `namespace/account` bound to no Pod (`kubectl create token` without
    /// `--bound-object-kind`, or a Secret's long-lived token): no node claim.
    pub fn unbound_token(&self, namespace: &str, account: &str) -> String {
        let credential = uuid::Uuid::new_v4();
        let extra =
            json!({"authentication.kubernetes.io/credential-id": [format!("JTI={credential}")]});
        self.issue(service_account_user(namespace, account, extra))
    }

    fn issue(&self, user: Value) -> String {
        let token = format!("double-{}", uuid::Uuid::new_v4().simple());
        lock(&self.shared.tokens).0.insert(token.clone(), user);
        token
    }

    /// A client (without retries) that sends `token` as its bearer token.
    pub fn client_with_token(&self, token: &str) -> kube::Client {
        use kube::client::ConfigExt;
        let mut config = kube::Config::new(self.url().parse().expect("the double's URL"));
        config.auth_info.token = Some(token.to_string().into());
        let auth = config
            .auth_layer()
            .expect("a token is a valid credential")
            .expect("a token makes an auth layer");
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build::<_, kube::client::Body>(
                hyper_util::client::legacy::connect::HttpConnector::new(),
            );
        let service = tower::ServiceBuilder::new()
            .layer(config.base_uri_layer())
            .layer(auth)
            .map_err(tower::BoxError::from)
            .service(http);
        kube::Client::new(service, config.default_namespace)
    }
}

/// The answer to a SelfSubjectReview with the `Authorization` header `authorization`: the code and body.
pub(super) fn self_subject_review(tokens: &Tokens, authorization: Option<&str>) -> (u16, Value) {
    let user = match authorization.map(|h| h.strip_prefix("Bearer ").unwrap_or(h).trim()) {
        None => admin(),
        Some(token) => match tokens.0.get(token) {
            Some(user) => user.clone(),
            None => {
                return (
                    401,
                    json!({
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": "Unauthorized",
                        "reason": "Unauthorized",
                        "code": 401,
                    }),
                )
            }
        },
    };
    (
        201,
        json!({
            "kind": "SelfSubjectReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": now_timestamp()},
            "status": {"userInfo": user},
        }),
    )
}
