//! The CustomResourceDefinitions of our ComputeDomain types, generated from the types and checked in
//! under `crd/` (a test fails when they differ): `ComputeDomain` and the controller's
//! `ComputeDomainPlacement`. NVIDIA's ComputeDomain CRD comes with NVIDIA's chart; this crate never
//! writes it.

use crate::domains::api::{ComputeDomain, ComputeDomainPlacement};

/// Where the generated CRD manifests live, relative to the crate root.
pub const CRD_PATH: &str = "crd/gpu.dra.dev_computedomains.yaml";
pub const PLACEMENT_CRD_PATH: &str = "crd/gpu.dra.dev_computedomainplacements.yaml";

/// The `ComputeDomain` CustomResourceDefinition as YAML, with a header that says how it is made.
pub fn crd_yaml() -> String {
    crate::api::generated_crd_yaml::<ComputeDomain>(
        "src/domains/api.rs",
        "computedomain_crd_file_is_current",
    )
}

/// The `ComputeDomainPlacement` CustomResourceDefinition as YAML.
pub fn placement_crd_yaml() -> String {
    crate::api::generated_crd_yaml::<ComputeDomainPlacement>(
        "src/domains/api.rs",
        "computedomain_crd_file_is_current",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fails when the checked-in manifests differ from the types; `UPDATE_CRD=1` rewrites them.
    #[test]
    fn computedomain_crd_file_is_current() {
        for (path, yaml) in [
            (CRD_PATH, crd_yaml()),
            (PLACEMENT_CRD_PATH, placement_crd_yaml()),
        ] {
            crate::api::check_generated_file(
                path,
                &yaml,
                "src/domains/api.rs",
                "computedomain_crd_file_is_current",
            );
        }
    }
}
