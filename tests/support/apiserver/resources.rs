//! The kinds of object the double serves: group, version, scope and how each treats `status`. A kind
//! listed here is routed, stored and watched; the rest of the server looks kinds up by plural.

/// A kind of object the server stores.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct ResourceDef {
    /// How the double's hooks and records name the resource, and its key in the store: the plural,
    /// or `plural.group` where two groups serve one plural (ComputeDomains).
    pub(super) plural: &'static str,
    /// The plural in request paths, where it differs from `plural`.
    pub(super) path_plural: Option<&'static str>,
    pub(super) kind: &'static str,
    pub(super) group: &'static str,
    pub(super) version: &'static str,
    pub(super) namespaced: bool,
    /// Whether `status` is a subresource: the main resource ignores status changes and `/status`
    /// changes nothing else.
    pub(super) status_subresource: bool,
    /// Whether a create keeps the status it is given (nodes) or starts with none (claims).
    pub(super) status_on_create: bool,
    /// Whether an update (PUT) may leave out `metadata.resourceVersion` and overwrite whatever is
    /// stored (the registry strategy's `AllowUnconditionalUpdate`); where not, the server refuses it.
    pub(super) unconditional_update: bool,
}

impl ResourceDef {
    pub(super) fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The plural as request paths and the real server name it.
    pub(super) fn path_plural(&self) -> &'static str {
        self.path_plural.unwrap_or(self.plural)
    }

    /// `resourceslices.resource.k8s.io`, as error messages name a resource.
    pub(super) fn qualified_plural(&self) -> String {
        if self.group.is_empty() {
            self.path_plural().to_string()
        } else {
            format!("{}.{}", self.path_plural(), self.group)
        }
    }

    /// `ResourceSlice.resource.k8s.io`, as validation errors name a kind.
    pub(super) fn qualified_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.to_string()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }
}

const RESOURCES: [ResourceDef; 13] = [
    ResourceDef {
        plural: "nodes",
        kind: "Node",
        group: "",
        version: "v1",
        namespaced: false,
        path_plural: None,
        status_subresource: true,
        status_on_create: true,
        unconditional_update: true,
    },
    ResourceDef {
        plural: "resourceslices",
        kind: "ResourceSlice",
        group: "resource.k8s.io",
        version: "v1",
        namespaced: false,
        path_plural: None,
        status_subresource: false,
        status_on_create: false,
        unconditional_update: true,
    },
    ResourceDef {
        plural: "resourceclaims",
        kind: "ResourceClaim",
        group: "resource.k8s.io",
        version: "v1",
        namespaced: true,
        path_plural: None,
        status_subresource: true,
        status_on_create: false,
        unconditional_update: true,
    },
    ResourceDef {
        plural: "resourceclaimtemplates",
        kind: "ResourceClaimTemplate",
        group: "resource.k8s.io",
        version: "v1",
        namespaced: true,
        path_plural: None,
        status_subresource: false,
        status_on_create: false,
        unconditional_update: true,
    },
    // What `gpu-dra explain` reads about a pod: its claims, node selector, affinity and tolerations. Its
    // status (the claims made from templates) is written with `insert`, as the controllers would.
    ResourceDef {
        plural: "pods",
        kind: "Pod",
        group: "",
        version: "v1",
        namespaced: true,
        path_plural: None,
        status_subresource: true,
        status_on_create: false,
        unconditional_update: true,
    },
    ResourceDef {
        plural: "deviceclasses",
        kind: "DeviceClass",
        group: "resource.k8s.io",
        version: "v1",
        namespaced: false,
        path_plural: None,
        status_subresource: false,
        status_on_create: false,
        unconditional_update: true,
    },
    // What the plugin reports about DeviceClasses, on its Node (as kube's Recorder writes them).
    ResourceDef {
        plural: "events",
        kind: "Event",
        group: "events.k8s.io",
        version: "v1",
        namespaced: true,
        path_plural: None,
        status_subresource: false,
        status_on_create: false,
        unconditional_update: true,
    },
    // NVIDIA's plugin runs each MPS control daemon as a Deployment; under NVIDIA's driver name the
    // plugin deletes those of the claims it took over from NVIDIA's checkpoint.
    ResourceDef {
        plural: "deployments",
        kind: "Deployment",
        group: "apps",
        version: "v1",
        namespaced: true,
        path_plural: None,
        status_subresource: true,
        status_on_create: false,
        unconditional_update: true,
    },
    // gpu-dra's own CRD (crd/), cluster-scoped with a status subresource.
    ResourceDef {
        plural: "gpunodepolicies",
        kind: "GpuNodePolicy",
        group: "gpu.dra.dev",
        version: "v1alpha1",
        namespaced: false,
        path_plural: None,
        status_subresource: true,
        status_on_create: false,
        unconditional_update: true,
    },
    // ComputeDomains: ours (crd/gpu.dra.dev_computedomains.yaml) and NVIDIA's, served in NVIDIA
    // compatibility mode; namespaced, with a status subresource, as both CRDs declare. Like the other
    // custom resources here, their schemas are not checked.
    ResourceDef {
        plural: "computedomains",
        kind: "ComputeDomain",
        group: "gpu.dra.dev",
        version: "v1alpha1",
        namespaced: true,
        path_plural: None,
        status_subresource: true,
        status_on_create: false,
        unconditional_update: true,
    },
    ResourceDef {
        plural: "computedomains.resource.nvidia.com",
        kind: "ComputeDomain",
        group: "resource.nvidia.com",
        version: "v1beta1",
        namespaced: true,
        path_plural: Some("computedomains"),
        status_subresource: true,
        status_on_create: false,
        unconditional_update: true,
    },
    // What the ComputeDomain controller's replicas elect their leader with. Its strategy allows no
    // unconditional update: every write of a Lease is guarded by the resourceVersion it read.
    ResourceDef {
        plural: "leases",
        kind: "Lease",
        group: "coordination.k8s.io",
        version: "v1",
        namespaced: true,
        path_plural: None,
        status_subresource: false,
        status_on_create: false,
        unconditional_update: false,
    },
    // Where the controller placed each ComputeDomain (crd/gpu.dra.dev_computedomainplacements.yaml):
    // cluster-scoped, no status.
    ResourceDef {
        plural: "computedomainplacements",
        kind: "ComputeDomainPlacement",
        group: "gpu.dra.dev",
        version: "v1alpha1",
        namespaced: false,
        path_plural: None,
        status_subresource: false,
        status_on_create: false,
        unconditional_update: true,
    },
];

/// The resource a hook names (its `plural`).
pub(super) fn resource_def(plural: &str) -> Option<&'static ResourceDef> {
    RESOURCES.iter().find(|def| def.plural == plural)
}

/// The resource a request path names.
pub(super) fn routed_def(group: &str, version: &str, plural: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|def| def.path_plural() == plural && def.group == group && def.version == version)
}

/// The resource a test hook names; naming one the server does not serve is a bug in the test.
pub(super) fn hook_resource(plural: &str) -> &'static ResourceDef {
    match resource_def(plural) {
        Some(def) => def,
        None => panic!("the API server double does not serve {plural:?}"),
    }
}
