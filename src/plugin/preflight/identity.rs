//! Who the API server takes the plugin for (a SelfSubjectReview), judged against `--node-name` as the
//! admission policies judge its writes.

use k8s_openapi::api::authentication::v1::{SelfSubjectReview, UserInfo};
use kube::api::{Api, PostParams};

use super::{PreflightError, NODE_NAME_CLAIM};

/// What the API server says of the plugin's identity, for [`judge_identity`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// A service account whose token is bound to a Pod on this node.
    BoundToThisNode { user: String },
    /// Not a service account (a user's kubeconfig): the admission policies do not apply to it.
    NotServiceAccount { user: String },
}

/// Judges a SelfSubjectReview's user against `--node-name`: a service account must carry the node claim
/// of `node`, as the admission policies require of the plugin's writes.
pub fn judge_identity(user: &UserInfo, node: &str) -> Result<Identity, PreflightError> {
    let name = user.username.clone().unwrap_or_default();
    if !name.starts_with("system:serviceaccount:") {
        return Ok(Identity::NotServiceAccount { user: name });
    }
    let claim = user
        .extra
        .as_ref()
        .and_then(|extra| extra.get(NODE_NAME_CLAIM))
        .and_then(|values| values.first())
        .filter(|value| !value.is_empty());
    match claim {
        None => Err(PreflightError::TokenWithoutNodeClaim { user: name }),
        Some(token_node) if token_node != node => Err(PreflightError::NodeNameMismatch {
            user: name,
            token_node: token_node.clone(),
            node: node.to_string(),
        }),
        Some(_) => Ok(Identity::BoundToThisNode { user: name }),
    }
}

/// Asks the API server who the client is (`POST authentication.k8s.io/v1 selfsubjectreviews`, which
/// every authenticated user may do).
pub async fn who_am_i(client: &kube::Client) -> Result<UserInfo, String> {
    let reviews: Api<SelfSubjectReview> = Api::all(client.clone());
    let review = reviews
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .map_err(|e| e.to_string())?;
    review
        .status
        .and_then(|status| status.user_info)
        .ok_or_else(|| "the SelfSubjectReview came back without status.userInfo".to_string())
}
