//! The `ComputeDomain` CustomResourceDefinition of our group, generated from the type and checked in as
//! `crd/gpu.dra.dev_computedomains.yaml` (a test fails when they differ). NVIDIA's CRD comes with
//! NVIDIA's chart; this crate never writes it.

use crate::domains::api::ComputeDomain;

/// Where the generated CRD manifest lives, relative to the crate root.
pub const CRD_PATH: &str = "crd/gpu.dra.dev_computedomains.yaml";

/// The `ComputeDomain` CustomResourceDefinition as YAML, with a header that says how it is made.
pub fn crd_yaml() -> String {
    crate::api::generated_crd_yaml::<ComputeDomain>(
        "src/domains/api.rs",
        "computedomain_crd_file_is_current",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fails when the checked-in manifest differs from the type; `UPDATE_CRD=1` rewrites it.
    #[test]
    fn computedomain_crd_file_is_current() {
        crate::api::check_generated_file(
            CRD_PATH,
            &crd_yaml(),
            "src/domains/api.rs",
            "computedomain_crd_file_is_current",
        );
    }
}
