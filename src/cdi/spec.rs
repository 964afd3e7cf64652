//! CDI spec types as the JSON of CDI's Go structs (`specs-go/config.go`), the minimum `cdiVersion` a spec
//! needs, and the checks container runtimes apply when they load a spec, so that a bad spec fails here with a
//! clear error instead of as an "unresolvable CDI device" at container start.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use super::CdiError;

/// Every `cdiVersion` the CDI library knows; a runtime rejects any other.
const KNOWN_VERSIONS: [&str; 10] = [
    "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
];

const HOOK_NAMES: [&str; 6] = [
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

/// A CDI spec file: one `kind` (`vendor/class`) and its devices.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub devices: Vec<Device>,
    /// Edits applied once when any device of the spec is requested.
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Device {
    pub name: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    // Absent on read becomes empty so that validation, not the parser, reports it with the device name.
    #[serde(default)]
    pub container_edits: ContainerEdits,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    /// `NAME=value` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_gids: Vec<u32>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.mounts.is_empty()
            && self.hooks.is_empty()
            && self.additional_gids.is_empty()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    /// Path inside the container.
    pub path: String,
    /// Path on the host; the runtime uses `path` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `""`, `b`, `c`, `u` or `p`; the runtime fills it from the host node when absent.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub device_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
    /// cgroup permissions, a subset of `rwm` (empty means `rwm`, `none` means no access).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub mount_type: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hook {
    pub hook_name: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
}

impl Spec {
    /// All container edits of the spec: the spec-wide ones and each device's.
    fn all_edits(&self) -> impl Iterator<Item = &ContainerEdits> {
        std::iter::once(&self.container_edits)
            .chain(self.devices.iter().map(|d| &d.container_edits))
    }
}

/// The lowest `cdiVersion` that has every feature `spec` uses. Writing it, rather than the newest version,
/// lets older runtimes, which reject versions they do not know, load the spec.
pub fn minimum_version(spec: &Spec) -> &'static str {
    if spec.all_edits().any(|e| !e.additional_gids.is_empty()) {
        return "0.7.0";
    }
    let dotted_class = matches!(split_kind(&spec.kind), Some((_, class)) if class.contains('.'));
    if dotted_class
        || !spec.annotations.is_empty()
        || spec.devices.iter().any(|d| !d.annotations.is_empty())
    {
        return "0.6.0";
    }
    let digit_start = spec.devices.iter().any(|d| {
        d.name
            .chars()
            .next()
            .is_some_and(|c| !c.is_ascii_alphabetic())
    });
    let host_path = spec
        .all_edits()
        .flat_map(|e| &e.device_nodes)
        .any(|n| n.host_path.as_deref().is_some_and(|p| !p.is_empty()));
    if digit_start || host_path {
        return "0.5.0";
    }
    let typed_mount = spec
        .all_edits()
        .flat_map(|e| &e.mounts)
        .any(|m| m.mount_type.as_deref().is_some_and(|t| !t.is_empty()));
    if typed_mount {
        return "0.4.0";
    }
    "0.3.0"
}

/// Checks `spec` as a runtime loading it would; the error names the device and the field at fault.
pub fn validate(spec: &Spec) -> Result<(), CdiError> {
    let invalid = |msg: String| Err(CdiError::InvalidSpec(msg));

    let Some(declared) = parse_version(&spec.cdi_version) else {
        return invalid(format!("unknown cdiVersion {:?}", spec.cdi_version));
    };
    let minimum = minimum_version(spec);
    if parse_version(minimum).is_some_and(|min| declared < min) {
        return invalid(format!(
            "cdiVersion {} is lower than {minimum}, the minimum for the fields used",
            spec.cdi_version
        ));
    }

    let Some((vendor, class)) = split_kind(&spec.kind) else {
        return invalid(format!(
            "kind {:?} is not of the form vendor/class",
            spec.kind
        ));
    };
    check_qualifier(vendor)
        .map_err(|e| CdiError::InvalidSpec(format!("kind vendor {vendor:?}: {e}")))?;
    check_qualifier(class)
        .map_err(|e| CdiError::InvalidSpec(format!("kind class {class:?}: {e}")))?;

    if spec.devices.is_empty() {
        return invalid("the spec has no devices".into());
    }
    check_edits(&spec.container_edits)
        .map_err(|e| CdiError::InvalidSpec(format!("spec containerEdits.{e}")))?;

    let mut names = HashSet::new();
    for device in &spec.devices {
        let name = &device.name;
        check_device_name(name)
            .map_err(|e| CdiError::InvalidSpec(format!("device name {name:?}: {e}")))?;
        if !names.insert(name.as_str()) {
            return invalid(format!("device {name:?}: name used twice in the spec"));
        }
        if device.container_edits.is_empty() {
            return invalid(format!("device {name:?}: containerEdits is empty"));
        }
        check_edits(&device.container_edits)
            .map_err(|e| CdiError::InvalidSpec(format!("device {name:?}: containerEdits.{e}")))?;
    }
    Ok(())
}

/// `[v]major.minor.patch` of a known version, as a comparable tuple.
fn parse_version(version: &str) -> Option<(u32, u32, u32)> {
    let v = version.strip_prefix('v').unwrap_or(version);
    if !KNOWN_VERSIONS.contains(&v) {
        return None;
    }
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??, parts.next()??))
}

fn split_kind(kind: &str) -> Option<(&str, &str)> {
    let (vendor, class) = kind.split_once('/')?;
    (!vendor.is_empty() && !class.is_empty() && !class.contains('/')).then_some((vendor, class))
}

/// Vendor and class: ASCII letters, digits, `_`, `-`, `.`; a letter first, a letter or digit last.
pub(super) fn check_qualifier(name: &str) -> Result<(), String> {
    check_name(
        name,
        |c| c.is_ascii_alphabetic(),
        "a letter",
        |c| matches!(c, '_' | '-' | '.'),
    )
}

/// Device name: ASCII letters, digits, `_`, `-`, `.`, `:`; a letter or digit first and last.
pub(super) fn check_device_name(name: &str) -> Result<(), String> {
    check_name(
        name,
        |c| c.is_ascii_alphanumeric(),
        "a letter or digit",
        |c| matches!(c, '_' | '-' | '.' | ':'),
    )
}

fn check_name(
    name: &str,
    first_ok: fn(char) -> bool,
    first_what: &str,
    extra_ok: fn(char) -> bool,
) -> Result<(), String> {
    let (Some(first), Some(last)) = (name.chars().next(), name.chars().last()) else {
        return Err("empty name".into());
    };
    if !first_ok(first) {
        return Err(format!("must start with {first_what}"));
    }
    if !last.is_ascii_alphanumeric() {
        return Err("must end with a letter or digit".into());
    }
    match name
        .chars()
        .find(|&c| !c.is_ascii_alphanumeric() && !extra_ok(c))
    {
        Some(c) => Err(format!("invalid character {c:?}")),
        None => Ok(()),
    }
}

/// The error is the field path inside the edits and what is wrong with it.
fn check_edits(edits: &ContainerEdits) -> Result<(), String> {
    check_env(&edits.env).map_err(|e| format!("env{e}"))?;
    for (i, node) in edits.device_nodes.iter().enumerate() {
        let field = format!("deviceNodes[{i}]");
        if !node.path.starts_with('/') {
            return Err(format!(
                "{field}.path {:?} is not an absolute path",
                node.path
            ));
        }
        if let Some(host) = node.host_path.as_deref().filter(|p| !p.is_empty()) {
            if !host.starts_with('/') {
                return Err(format!("{field}.hostPath {host:?} is not an absolute path"));
            }
        }
        if let Some(t) = &node.device_type {
            if !matches!(t.as_str(), "" | "b" | "c" | "u" | "p") {
                return Err(format!("{field}.type {t:?} is not one of b, c, u, p"));
            }
        }
        if let Some(p) = &node.permissions {
            if p != "none" && !p.chars().all(|c| matches!(c, 'r' | 'w' | 'm')) {
                return Err(format!(
                    "{field}.permissions {p:?} is not a subset of \"rwm\""
                ));
            }
        }
    }
    for (i, mount) in edits.mounts.iter().enumerate() {
        if mount.host_path.is_empty() {
            return Err(format!("mounts[{i}].hostPath is empty"));
        }
        if mount.container_path.is_empty() {
            return Err(format!("mounts[{i}].containerPath is empty"));
        }
    }
    for (i, hook) in edits.hooks.iter().enumerate() {
        if !HOOK_NAMES.contains(&hook.hook_name.as_str()) {
            return Err(format!(
                "hooks[{i}].hookName {:?} is not a known hook",
                hook.hook_name
            ));
        }
        if !hook.path.starts_with('/') {
            return Err(format!(
                "hooks[{i}].path {:?} is not an absolute path",
                hook.path
            ));
        }
        check_env(&hook.env).map_err(|e| format!("hooks[{i}].env{e}"))?;
        if hook.timeout.is_some_and(|t| t <= 0) {
            return Err(format!("hooks[{i}].timeout must be positive"));
        }
    }
    Ok(())
}

fn check_env(env: &[String]) -> Result<(), String> {
    match env
        .iter()
        .enumerate()
        .find(|(_, e)| e.find('=').is_none_or(|pos| pos == 0))
    {
        Some((i, e)) => Err(format!("[{i}] {e:?} is not NAME=value")),
        None => Ok(()),
    }
}

#[cfg(test)]
#[path = "spec_tests.rs"]
mod tests;
