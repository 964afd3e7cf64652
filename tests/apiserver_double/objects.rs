//! Objects through the `kube` client: create, read, update, patch and delete, name conflicts and
//! generated names, resourceVersion and uid preconditions, field and label selectors, the claim
//! status subresource, deletion held by finalizers, and Leases (every update guarded).

use gpu_dra::support::apiserver::Verb;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use serde_json::{json, Value};

use super::{slice, start, status, DRIVER};

#[tokio::test]
async fn crud_round_trip() {
    let (server, api) = start().await;
    let created = api
        .create(
            &PostParams::default(),
            &slice("node-a-gpu", "node-a", DRIVER, 2),
        )
        .await
        .unwrap();
    let meta = &created.metadata;
    assert!(meta.uid.is_some() && meta.creation_timestamp.is_some());
    assert_eq!(meta.generation, Some(1));
    assert_eq!(meta.resource_version.as_deref(), Some("1"));

    let fetched = api.get("node-a-gpu").await.unwrap();
    assert_eq!(fetched.spec, created.spec);
    let listed = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.metadata.resource_version.as_deref(), Some("1"));

    let mut changed = fetched.clone();
    changed.spec.pool.generation = 1;
    let replaced = api
        .replace("node-a-gpu", &PostParams::default(), &changed)
        .await
        .unwrap();
    assert_eq!(replaced.metadata.generation, Some(2));
    assert_eq!(replaced.metadata.resource_version.as_deref(), Some("2"));
    assert_eq!(replaced.metadata.uid, created.metadata.uid);

    let deleted = api
        .delete("node-a-gpu", &DeleteParams::default())
        .await
        .unwrap();
    assert!(
        deleted.is_right(),
        "an immediate delete answers with a Success status"
    );
    assert_eq!(status(api.get("node-a-gpu").await).code, 404);
    assert_eq!(
        status(api.delete("node-a-gpu", &DeleteParams::default()).await).code,
        404
    );
    assert_eq!(server.writes("resourceslices"), 3);
    assert_eq!(
        status(
            api.replace("node-a-gpu", &PostParams::default(), &changed)
                .await
        )
        .code,
        404
    );
}

#[tokio::test]
async fn create_conflicts_and_generate_name() {
    let (_server, api) = start().await;
    let mut template = slice("", "node-a", DRIVER, 1);
    template.metadata.name = None;
    template.metadata.generate_name = Some("node-a-gpu.dra.dev-".into());
    let first = api.create(&PostParams::default(), &template).await.unwrap();
    let second = api.create(&PostParams::default(), &template).await.unwrap();
    let name = first.metadata.name.clone().unwrap();
    assert!(
        name.starts_with("node-a-gpu.dra.dev-") && name.len() == "node-a-gpu.dra.dev-".len() + 5,
        "{name}"
    );
    assert_ne!(first.metadata.name, second.metadata.name);

    let existing = slice(&name, "node-a", DRIVER, 1);
    let err = status(api.create(&PostParams::default(), &existing).await);
    assert_eq!((err.code, err.reason.as_str()), (409, "AlreadyExists"));
}

#[tokio::test]
async fn stale_resource_version_conflicts() {
    let (_server, api) = start().await;
    let created = api
        .create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
        .await
        .unwrap();
    let mut newer = created.clone();
    newer.spec.pool.generation = 1;
    api.replace("s", &PostParams::default(), &newer)
        .await
        .unwrap();
    let mut stale = created;
    stale.spec.pool.generation = 2;
    let err = status(api.replace("s", &PostParams::default(), &stale).await);
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    assert!(
        err.message.contains("the object has been modified"),
        "{}",
        err.message
    );
}

/// Leases, as leader election writes them: namespaced, no status subresource, and an update must name
/// the resourceVersion it read (the lease strategy allows no unconditional update), so of two replicas
/// that read the same record only the first write lands.
#[tokio::test]
async fn lease_updates_are_guarded_by_the_resource_version() {
    let (server, _) = start().await;
    let leases: Api<Lease> = Api::namespaced(server.client(), "gpu-dra");
    let lease = |holder: &str, seconds: i32| Lease {
        metadata: kube::api::ObjectMeta {
            name: Some("gpu-dra-controller".into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(seconds),
            lease_transitions: Some(0),
            ..Default::default()
        }),
    };
    let created = leases
        .create(&PostParams::default(), &lease("a", 15))
        .await
        .unwrap();
    assert_eq!(created.metadata.namespace.as_deref(), Some("gpu-dra"));

    let mut first = created.clone();
    first.spec = lease("b", 15).spec;
    leases
        .replace("gpu-dra-controller", &PostParams::default(), &first)
        .await
        .unwrap();
    let mut second = created.clone();
    second.spec = lease("c", 15).spec;
    let err = status(
        leases
            .replace("gpu-dra-controller", &PostParams::default(), &second)
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));

    let mut unguarded = lease("c", 15);
    unguarded.metadata.namespace = Some("gpu-dra".into());
    let err = status(
        leases
            .replace("gpu-dra-controller", &PostParams::default(), &unguarded)
            .await,
    );
    assert_eq!(err.code, 422);
    assert!(
        err.message.contains(
            "metadata.resourceVersion: Invalid value: 0: must be specified for an update"
        ),
        "{}",
        err.message
    );

    let mut invalid = leases.get("gpu-dra-controller").await.unwrap();
    invalid.spec = lease("c", 0).spec;
    let err = status(
        leases
            .replace("gpu-dra-controller", &PostParams::default(), &invalid)
            .await,
    );
    assert_eq!(err.code, 422);
    assert!(
        err.message
            .contains("spec.leaseDurationSeconds: Invalid value: 0: must be greater than 0"),
        "{}",
        err.message
    );
    assert_eq!(
        server
            .get("leases", Some("gpu-dra"), "gpu-dra-controller")
            .unwrap()["spec"]["holderIdentity"],
        "b"
    );
}

#[tokio::test]
async fn delete_preconditions() {
    let (server, api) = start().await;
    let created = api
        .create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
        .await
        .unwrap();
    let with = |uid: Option<&str>, rv: Option<&str>| DeleteParams {
        preconditions: Some(Preconditions {
            uid: uid.map(Into::into),
            resource_version: rv.map(Into::into),
        }),
        ..Default::default()
    };
    let err = status(
        api.delete(
            "s",
            &with(Some("00000000-0000-0000-0000-000000000000"), None),
        )
        .await,
    );
    assert_eq!(err.code, 409);
    assert!(
        err.message.contains("Precondition failed: UID"),
        "{}",
        err.message
    );
    assert_eq!(
        status(api.delete("s", &with(None, Some("999"))).await).code,
        409
    );
    assert!(server.get("resourceslices", None, "s").is_some());
    let uid = created.metadata.uid.as_deref();
    api.delete(
        "s",
        &with(uid, created.metadata.resource_version.as_deref()),
    )
    .await
    .unwrap();
    assert!(server.get("resourceslices", None, "s").is_none());
}

#[tokio::test]
async fn field_and_label_selectors() {
    let (server, api) = start().await;
    for (name, node, driver) in [
        ("a1", "node-a", DRIVER),
        ("a2", "node-a", "other.example.com"),
        ("b1", "node-b", DRIVER),
    ] {
        let mut s = slice(name, node, driver, 1);
        s.metadata.labels = Some([("node".to_string(), node.to_string())].into());
        api.create(&PostParams::default(), &s).await.unwrap();
    }
    let names = |list: kube::core::ObjectList<ResourceSlice>| -> Vec<String> {
        list.items
            .into_iter()
            .filter_map(|s| s.metadata.name)
            .collect()
    };
    let both = ListParams::default().fields(&format!("spec.nodeName=node-a,spec.driver=={DRIVER}"));
    assert_eq!(names(api.list(&both).await.unwrap()), ["a1"]);
    let not_b = ListParams::default().fields("spec.nodeName!=node-b");
    assert_eq!(names(api.list(&not_b).await.unwrap()), ["a1", "a2"]);
    let pool = ListParams::default().fields("spec.pool.name=node-b,metadata.name=b1");
    assert_eq!(names(api.list(&pool).await.unwrap()), ["b1"]);
    let labels = ListParams::default().labels("node in (node-b,node-c)");
    assert_eq!(names(api.list(&labels).await.unwrap()), ["b1"]);
    let err = status(
        api.list(&ListParams::default().fields("spec.devices=x"))
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (400, "BadRequest"));
    assert!(
        err.message
            .contains("field label not supported: spec.devices"),
        "{}",
        err.message
    );
    assert_eq!(
        server
            .requests()
            .iter()
            .filter(|r| r.verb == Verb::List)
            .count(),
        5
    );
}

#[tokio::test]
async fn claim_status_is_a_subresource() {
    let (server, _) = start().await;
    let claims: Api<ResourceClaim> = Api::namespaced(server.client(), "team-a");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "claim-1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev"}}]}},
        "status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]},
    }))
    .unwrap();
    let created = claims.create(&PostParams::default(), &claim).await.unwrap();
    assert!(created.status.is_none(), "status is dropped on create");

    let device_status = json!({"status": {"devices": [{"driver": DRIVER, "pool": "node-a", "device": "gpu-0", "data": {"k": "v"}}]}});
    let patched = claims
        .patch_status(
            "claim-1",
            &PatchParams::default(),
            &Patch::Merge(&device_status),
        )
        .await
        .unwrap();
    let devices = patched
        .status
        .as_ref()
        .and_then(|s| s.devices.clone())
        .unwrap();
    assert_eq!(devices[0].device, "gpu-0");
    assert_eq!(
        patched.metadata.generation,
        Some(1),
        "a status change keeps the generation"
    );

    let mut replaced = patched.clone();
    replaced.status = None;
    replaced.metadata.labels = Some([("a".to_string(), "b".to_string())].into());
    let updated = claims
        .replace("claim-1", &PostParams::default(), &replaced)
        .await
        .unwrap();
    assert!(
        updated.status.is_some(),
        "the main resource ignores status changes"
    );
    assert!(updated.metadata.labels.is_some());

    let stored = server
        .get("resourceclaims", Some("team-a"), "claim-1")
        .unwrap();
    assert_eq!(stored["status"]["devices"][0]["data"]["k"], "v");
    assert_eq!(server.writes("resourceclaims/status"), 1);
    assert_eq!(server.writes("resourceclaims"), 3);

    let json_patch = json!([{"op": "remove", "path": "/status/devices"}]);
    let patch = Patch::<Value>::Json(serde_json::from_value(json_patch).unwrap());
    let cleared = claims
        .patch_status("claim-1", &PatchParams::default(), &patch)
        .await
        .unwrap();
    assert!(cleared.status.and_then(|s| s.devices).is_none());
    let everywhere: Api<ResourceClaim> = Api::all(server.client());
    assert_eq!(
        everywhere
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );
}

#[tokio::test]
async fn finalizers_delay_deletion() {
    let (server, _) = start().await;
    let nodes: Api<Node> = Api::all(server.client());
    let node: Node = serde_json::from_value(
        json!({"metadata": {"name": "node-a", "finalizers": ["example.com/keep"]}}),
    )
    .unwrap();
    nodes.create(&PostParams::default(), &node).await.unwrap();
    let pending = nodes
        .delete("node-a", &DeleteParams::default())
        .await
        .unwrap();
    let pending = pending
        .left()
        .expect("a pending delete answers with the object");
    assert!(pending.metadata.deletion_timestamp.is_some());
    assert!(server.get("nodes", None, "node-a").is_some());
    let release = json!({"metadata": {"finalizers": null}});
    nodes
        .patch("node-a", &PatchParams::default(), &Patch::Merge(&release))
        .await
        .unwrap();
    assert!(server.get("nodes", None, "node-a").is_none());
}
