//! The `ComputeDomain` CustomResourceDefinition of our group, generated from the type and checked in as
//! `crd/gpu.dra.dev_computedomains.yaml` (a test fails when they differ). NVIDIA's CRD comes with
//! NVIDIA's chart; this crate never writes it.

use kube::CustomResourceExt;

use crate::domains::api::ComputeDomain;

/// Where the generated CRD manifest lives, relative to the crate root.
pub const CRD_PATH: &str = "crd/gpu.dra.dev_computedomains.yaml";

/// The `ComputeDomain` CustomResourceDefinition as YAML, with a header that says how it is made.
pub fn crd_yaml() -> String {
    // Serializing a CRD built from our own types cannot fail: it holds only strings, maps and JSON values.
    let body = serde_yaml::to_string(&ComputeDomain::crd())
        .expect("a CustomResourceDefinition always serializes to YAML");
    format!(
        "# Generated from src/domains/api.rs; do not edit.\n\
         # Regenerate: UPDATE_CRD=1 cargo test computedomain_crd_file_is_current\n{body}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fails when the checked-in manifest differs from the type; `UPDATE_CRD=1` rewrites it.
    #[test]
    fn computedomain_crd_file_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(CRD_PATH);
        let expected = crd_yaml();
        if std::env::var_os("UPDATE_CRD").is_some() {
            std::fs::write(&path, &expected)
                .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            return;
        }
        let actual = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            actual == expected,
            "{} is out of date with src/domains/api.rs; regenerate it with \
             `UPDATE_CRD=1 cargo test computedomain_crd_file_is_current` and commit the result",
            path.display()
        );
    }
}
