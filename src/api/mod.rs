//! gpu-dra's own API types: the cluster-scoped `GpuNodePolicy` CRD (`policy`, with its `spec.sharing`
//! in `mps_shares`), the watcher that applies it on one node (`watcher`), the CRD manifest generated
//! from the types (`crd_yaml`, checked against `crd/gpu.dra.dev_gpunodepolicies.yaml` by a test), and
//! the opaque device configs `GpuConfig` / `MigConfig` (`config`, with JSON schemas under `crd/`
//! checked the same way).

pub mod config;
pub mod mps_shares;
pub mod policy;
pub mod watcher;

use kube::CustomResourceExt;

pub use config::{
    decode_config, decode_config_value, ConfigError, DeviceConfig, GpuConfig, MigConfig, MpsConfig,
    MpsSettings, Sharing, SharingSettings, SharingStrategy, TimeSliceInterval, TimeSlicingConfig,
    CONFIG_API_VERSION,
};
pub use policy::{
    select, GpuNodePolicy, GpuNodePolicySpec, GpuNodePolicyStatus, HealthSpec, LabelSelector,
    LabelSelectorRequirement, MigModeSpec, MpsMemoryShares, PolicyCondition, SelectorOperator,
    ShareSizes, SharingSpec, TaintEffect,
};
pub use watcher::{EffectivePolicy, PolicyWatcher};

/// This driver's own name, the default of `--driver-name`.
pub const DRIVER_NAME: &str = "gpu.dra.dev";
/// The name of NVIDIA's DRA driver. A plugin started with it runs in NVIDIA compatibility mode: it
/// takes NVIDIA's opaque configs (`resource.nvidia.com/v1beta1`) with NVIDIA's precedence rules, so
/// claims, classes and tools written for NVIDIA's driver work unchanged (docs/nvidia-compatibility.md).
pub const NVIDIA_DRIVER_NAME: &str = "gpu.nvidia.com";

/// Where the generated CRD manifest lives, relative to the crate root.
pub const CRD_PATH: &str = "crd/gpu.dra.dev_gpunodepolicies.yaml";

/// The `GpuNodePolicy` CustomResourceDefinition as YAML, with a header that says how it is made.
pub fn crd_yaml() -> String {
    generated_crd_yaml::<GpuNodePolicy>("src/api/policy.rs", "crd_file_is_current")
}

/// A CustomResourceDefinition generated from our type `K` (defined in `source`) as YAML, with a header
/// that names the test that regenerates it.
pub fn generated_crd_yaml<K: CustomResourceExt>(source: &str, test: &str) -> String {
    // Serializing a CRD built from our own types cannot fail: it holds only strings, maps and JSON values.
    let body = serde_yaml::to_string(&K::crd())
        .expect("a CustomResourceDefinition always serializes to YAML");
    format!(
        "# Generated from {source}; do not edit.\n\
         # Regenerate: UPDATE_CRD=1 cargo test {test}\n{body}"
    )
}

/// For the tests that keep a checked-in CRD current: fails when `path` (relative to the crate root)
/// differs from `expected`; `UPDATE_CRD=1` rewrites it instead.
#[cfg(test)]
pub(crate) fn check_generated_file(path: &str, expected: &str, source: &str, test: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    if std::env::var_os("UPDATE_CRD").is_some() {
        std::fs::write(&path, expected)
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let actual = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        actual == expected,
        "{} is out of date with {source}; regenerate it with `UPDATE_CRD=1 cargo test {test}` and \
         commit the result",
        path.display()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fails when the checked-in manifest differs from the types; `UPDATE_CRD=1` rewrites it.
    #[test]
    fn crd_file_is_current() {
        check_generated_file(
            CRD_PATH,
            &crd_yaml(),
            "src/api/policy.rs",
            "crd_file_is_current",
        );
    }

    /// Fails when a checked-in config schema differs from the types; `UPDATE_CRD=1` rewrites them.
    #[test]
    fn config_schema_files_are_current() {
        for (kind, file) in [
            (config::GPU_CONFIG_KIND, config::GPU_CONFIG_SCHEMA_PATH),
            (config::MIG_CONFIG_KIND, config::MIG_CONFIG_SCHEMA_PATH),
        ] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
            let expected = config::config_schema_file(kind).expect("a kind of ours");
            if std::env::var_os("UPDATE_CRD").is_some() {
                std::fs::write(&path, &expected)
                    .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
                continue;
            }
            let actual = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                actual == expected,
                "{} is out of date with src/api/config.rs; regenerate it with \
                 `UPDATE_CRD=1 cargo test config_schema_files_are_current` and commit the result",
                path.display()
            );
        }
    }

    #[test]
    fn crd_names_the_resource_as_the_cluster_knows_it() {
        let crd = GpuNodePolicy::crd();
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some("gpunodepolicies.gpu.dra.dev")
        );
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(crd.spec.names.short_names, Some(vec!["gnp".to_string()]));
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert!(version
            .subresources
            .as_ref()
            .is_some_and(|s| s.status.is_some()));
        let columns: Vec<&str> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(columns, ["Priority", "MigMode", "Accepted", "Age"]);
    }
}
