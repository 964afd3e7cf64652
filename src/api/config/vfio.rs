//! NVIDIA's `VfioDeviceConfig` (`resource.nvidia.com/v1beta1`): how a passthrough GPU's claim reaches
//! the IOMMU. Read beside the sharing configs (like ComputeDomain channel configs), since it applies
//! to passthrough devices only:
//!
//! ```yaml
//! apiVersion: resource.nvidia.com/v1beta1
//! kind: VfioDeviceConfig
//! iommu:
//!   backendPolicy: LegacyOnly      # or PreferIommuFD; absent: LegacyOnly (NVIDIA's Normalize)
//!   enableAPIDevice: true          # the container gets /dev/vfio/vfio too; absent: false
//! ```
//!
//! gpu-dra passes GPUs through by IOMMU group only: `PreferIommuFD` is accepted and behaves as on a
//! node without iommufd in NVIDIA's driver (the legacy group device).

use serde_json::Value;

use super::nvidia::NVIDIA_CONFIG_API_VERSION;
use super::ConfigError;

/// NVIDIA's kind for passthrough devices.
pub const VFIO_CONFIG_KIND: &str = "VfioDeviceConfig";

/// A decoded `VfioDeviceConfig`, normalised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VfioSettings {
    /// `iommu.backendPolicy: PreferIommuFD`.
    pub prefer_iommufd: bool,
    /// `iommu.enableAPIDevice`: the container gets `/dev/vfio/vfio`.
    pub api_device: bool,
}

/// `None` unless the parameters declare NVIDIA's `VfioDeviceConfig`; then the settings, or the first
/// problem as `<path>: <reason>` (NVIDIA's reason where it has one).
pub fn parse(parameters: &Value) -> Option<Result<VfioSettings, ConfigError>> {
    let object = parameters.as_object()?;
    if object.get("apiVersion")?.as_str()? != NVIDIA_CONFIG_API_VERSION
        || object.get("kind")?.as_str()? != VFIO_CONFIG_KIND
    {
        return None;
    }
    Some(decode(object))
}

fn problem(path: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.to_string(),
        reason: reason.into(),
    }
}

fn decode(object: &serde_json::Map<String, Value>) -> Result<VfioSettings, ConfigError> {
    let mut settings = VfioSettings {
        prefer_iommufd: false,
        api_device: false,
    };
    for (key, value) in object {
        match key.as_str() {
            "apiVersion" | "kind" => {}
            "iommu" if value.is_null() => {}
            "iommu" => {
                let iommu = value
                    .as_object()
                    .ok_or_else(|| problem("iommu", "must be an object"))?;
                for (key, value) in iommu {
                    let path = format!("iommu.{key}");
                    match key.as_str() {
                        "backendPolicy" => match value.as_str() {
                            // NVIDIA's Normalize: empty is LegacyOnly.
                            Some("" | "LegacyOnly") => settings.prefer_iommufd = false,
                            Some("PreferIommuFD") => settings.prefer_iommufd = true,
                            Some(other) => {
                                return Err(problem(&path, format!(
                                    "unknown IOMMU backend policy: {other}, supported IOMMU backend policies: LegacyOnly, PreferIommuFD"
                                )))
                            }
                            None => return Err(problem(&path, "must be a string")),
                        },
                        "enableAPIDevice" => match value {
                            Value::Bool(enabled) => settings.api_device = *enabled,
                            Value::Null => {}
                            _ => return Err(problem(&path, "must be a boolean")),
                        },
                        _ => return Err(problem(&path, "unknown field")),
                    }
                }
            }
            other => return Err(problem(other, "unknown field")),
        }
    }
    Ok(settings)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parsed(value: Value) -> Option<Result<VfioSettings, String>> {
        parse(&value).map(|r| r.map_err(|e| format!("{}: {}", e.path, e.reason)))
    }

    #[test]
    fn nvidias_examples_decode_with_nvidias_defaults() {
        let base = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig"});
        assert_eq!(
            parsed(base),
            Some(Ok(VfioSettings {
                prefer_iommufd: false,
                api_device: false
            }))
        );
        let full = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig",
            "iommu": {"backendPolicy": "LegacyOnly", "enableAPIDevice": true}});
        assert_eq!(
            parsed(full),
            Some(Ok(VfioSettings {
                prefer_iommufd: false,
                api_device: true
            }))
        );
        let prefer = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig",
            "iommu": {"backendPolicy": "PreferIommuFD"}});
        assert_eq!(
            parsed(prefer),
            Some(Ok(VfioSettings {
                prefer_iommufd: true,
                api_device: false
            }))
        );
        // Other kinds are not this one's.
        assert_eq!(
            parsed(json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"})),
            None
        );
        assert_eq!(
            parsed(json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "VfioDeviceConfig"})),
            None
        );
    }

    #[test]
    fn problems_name_the_field_with_nvidias_reason() {
        let with = |iommu: Value| {
            parsed(json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig", "iommu": iommu}))
                .unwrap()
                .unwrap_err()
        };
        assert_eq!(
            with(json!({"backendPolicy": "IommuFDOnly"})),
            "iommu.backendPolicy: unknown IOMMU backend policy: IommuFDOnly, supported IOMMU backend policies: LegacyOnly, PreferIommuFD"
        );
        assert_eq!(
            with(json!({"enableAPIDevice": "yes"})),
            "iommu.enableAPIDevice: must be a boolean"
        );
        assert_eq!(
            with(json!({"enableApiDevice": true})),
            "iommu.enableApiDevice: unknown field"
        );
        assert_eq!(with(json!(7)), "iommu: must be an object");
        let extra = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig", "sharing": {}});
        assert_eq!(
            parsed(extra).unwrap().unwrap_err(),
            "sharing: unknown field"
        );
    }
}
