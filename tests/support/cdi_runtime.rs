//! The container runtime's part of CDI, as containerd (v2.2.7) and CRI-O do it with
//! `tags.cncf.io/container-device-interface` (`Cache.InjectDevices`, `fillMissingInfo`): a container's
//! qualified device names are looked up in the spec directories, and each device node takes the type
//! and numbers it lacks from its host path (`lstat`). A node that gives neither and whose host path
//! does not exist on this machine fails the container with "failed to stat CDI host device": the
//! runtime never sees the plugin's `/dev`. Tests that check a spec run it through [`inject`].
//!
//! Not modelled: priorities and conflicts between spec directories (a spec that does not load only
//! makes its devices unresolvable); mounts, hooks and the OCI spec; the device cgroup; containers in
//! a user namespace, where runc bind-mounts each device node from the host instead of making it.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use crate::cdi::{validate, DeviceNode, Spec};

/// Why the runtime refuses to create the container, in containerd's words.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// `spec_errors` says why specs in the directories did not load, which the runtime only logs.
    #[error("unresolvable CDI devices {devices}{spec_errors}")]
    Unresolvable {
        devices: String,
        spec_errors: String,
    },
    #[error("failed to stat CDI host device {host_path:?}: {reason}")]
    Stat { host_path: String, reason: String },
    #[error("CDI device ({path:?}, {host_path:?}), host type mismatch ({spec}, {host})")]
    TypeMismatch {
        path: String,
        host_path: String,
        spec: String,
        host: String,
    },
}

/// A device node as the container gets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerDevice {
    /// Where the container sees it.
    pub path: String,
    /// `c`, `b`, `u` or `p`.
    pub device_type: String,
    pub major: i64,
    pub minor: i64,
}

/// What a container gets from its CDI devices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Injected {
    /// In the order the edits list them; a later node at the same path replaces an earlier one.
    pub devices: Vec<ContainerDevice>,
    pub env: Vec<String>,
}

impl Injected {
    pub fn device(&self, path: &str) -> Option<&ContainerDevice> {
        self.devices.iter().find(|d| d.path == path)
    }
}

/// Creates a container with the CDI devices `ids` from the specs (`*.json`, `*.yaml`) in `spec_dirs`:
/// each spec's own edits once, before its first device's, then each device's.
pub fn inject(spec_dirs: &[&Path], ids: &[String]) -> Result<Injected, RuntimeError> {
    let mut specs = Vec::new();
    let mut spec_errors = Vec::new();
    for dir in spec_dirs {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let loadable = matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("json" | "yaml")
            );
            if !loadable || !path.is_file() {
                continue;
            }
            match load(&path) {
                Ok(spec) => specs.push(spec),
                Err(reason) => spec_errors.push(format!("{}: {reason}", path.display())),
            }
        }
    }
    let mut injected = Injected::default();
    let mut unresolved = Vec::new();
    let mut applied_specs = Vec::new();
    for id in ids {
        let found = id.split_once('=').and_then(|(kind, name)| {
            specs.iter().enumerate().find_map(|(i, spec)| {
                let device = spec.devices.iter().find(|d| d.name == name)?;
                (spec.kind == kind).then_some((i, device))
            })
        });
        let Some((spec_index, device)) = found else {
            unresolved.push(id.clone());
            continue;
        };
        if !applied_specs.contains(&spec_index) {
            applied_specs.push(spec_index);
            apply(&mut injected, &specs[spec_index].container_edits)?;
        }
        apply(&mut injected, &device.container_edits)?;
    }
    if !unresolved.is_empty() {
        return Err(RuntimeError::Unresolvable {
            devices: unresolved.join(", "),
            spec_errors: if spec_errors.is_empty() {
                String::new()
            } else {
                format!(" (specs that did not load: {})", spec_errors.join("; "))
            },
        });
    }
    Ok(injected)
}

fn load(path: &Path) -> Result<Spec, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let spec: Spec = serde_yaml::from_str(&text).map_err(|e| e.to_string())?;
    validate(&spec).map_err(|e| e.to_string())?;
    Ok(spec)
}

fn apply(injected: &mut Injected, edits: &crate::cdi::ContainerEdits) -> Result<(), RuntimeError> {
    injected.env.extend(edits.env.iter().cloned());
    for node in &edits.device_nodes {
        let device = device_node(node)?;
        injected.devices.retain(|d| d.path != device.path);
        injected.devices.push(device);
    }
    Ok(())
}

/// One device node as `fillMissingInfo` completes it: a node that names its type and a major (or is
/// a fifo) is taken as it is; any other gets what it lacks from its host path, which must exist.
pub fn device_node(node: &DeviceNode) -> Result<ContainerDevice, RuntimeError> {
    let host_path = node
        .host_path
        .clone()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| node.path.clone());
    let spec_type = node.device_type.clone().unwrap_or_default();
    let (major, minor) = (node.major.unwrap_or(0), node.minor.unwrap_or(0));
    let minimal = !spec_type.is_empty() && (major != 0 || spec_type == "p");
    let completed = |device_type: String, major, minor| ContainerDevice {
        path: node.path.clone(),
        device_type,
        major,
        minor,
    };
    if minimal {
        return Ok(completed(spec_type, major, minor));
    }
    let (host_type, host_major, host_minor) =
        host_device(&host_path).map_err(|reason| RuntimeError::Stat {
            host_path: host_path.clone(),
            reason,
        })?;
    let device_type = if spec_type.is_empty() {
        host_type.clone()
    } else {
        spec_type
    };
    if device_type != host_type {
        return Err(RuntimeError::TypeMismatch {
            path: node.path.clone(),
            host_path,
            spec: device_type,
            host: host_type,
        });
    }
    if device_type == "p" {
        return Ok(completed(device_type, major, minor));
    }
    let (major, minor) = if major == 0 {
        (host_major, host_minor)
    } else {
        (major, minor)
    };
    Ok(completed(device_type, major, minor))
}

/// Type and numbers of the device node at `path`, not following a link, as the runtime reads them.
fn host_device(path: &str) -> Result<(String, i64, i64), String> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| {
        // Go's words for the common case, so messages read as containerd's.
        if e.kind() == std::io::ErrorKind::NotFound {
            format!("lstat {path}: no such file or directory")
        } else {
            format!("lstat {path}: {e}")
        }
    })?;
    let file_type = meta.file_type();
    let device_type = if file_type.is_block_device() {
        "b"
    } else if file_type.is_char_device() {
        "c"
    } else if file_type.is_fifo() {
        "p"
    } else {
        return Err("not a device node".into());
    };
    let rdev = meta.rdev();
    Ok((
        device_type.to_string(),
        nix::sys::stat::major(rdev) as i64,
        nix::sys::stat::minor(rdev) as i64,
    ))
}
