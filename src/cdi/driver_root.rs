//! Where the NVIDIA driver is, seen from both sides: the host path that the container runtime resolves a
//! claim spec's `hostPath`s against (`/`, or `/run/nvidia/driver` under the GPU Operator's driver
//! container) and the path the plugin reads the same directory at inside its own container.

use std::fs;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DriverRootError {
    /// `which` says which of the two roots: "driver root" (on the host) or "container driver root".
    #[error("{which} {}: {reason}", path.display())]
    Invalid {
        which: &'static str,
        path: PathBuf,
        reason: String,
    },
}

/// The driver root on the host and in the plugin's container, and the host directory whose `dev/` holds
/// the GPU device nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverRoot {
    host: PathBuf,
    container: PathBuf,
    host_dev_root: PathBuf,
}

impl DriverRoot {
    /// `host` is the driver root as the host's container runtime sees it; `container` is where this process
    /// sees that directory (a hostPath mount in the plugin's pod), or the same path when it runs on the host.
    ///
    /// The device nodes are taken from the driver root's own `dev/` when it has one, as it does when it is
    /// the GPU Operator's driver container (whose `nvidia-modprobe` creates `/dev/nvidia*` there, not in the
    /// host's `/dev`), and from the host's `/dev` otherwise: the rule of NVIDIA's DRA driver, so that claim
    /// specs agree with the Toolkit's spec for the same root.
    pub fn new(
        host: impl Into<PathBuf>,
        container: impl Into<PathBuf>,
    ) -> Result<Self, DriverRootError> {
        let (host, container) = (host.into(), container.into());
        let invalid = |which, path: &Path, reason: &str| DriverRootError::Invalid {
            which,
            path: path.into(),
            reason: reason.into(),
        };
        // The host path is written into JSON and never opened here, so it needs to be clean text.
        if !host.is_absolute() || host.to_str().is_none() {
            return Err(invalid(
                "driver root",
                &host,
                "not an absolute UTF-8 path on the host",
            ));
        }
        if host
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(invalid("driver root", &host, "contains `..`"));
        }
        if !container.is_absolute() {
            return Err(invalid(
                "container driver root",
                &container,
                "not an absolute path",
            ));
        }
        let has_dev = fs::metadata(container.join("dev")).is_ok_and(|m| m.is_dir());
        let host_dev_root = if has_dev {
            host.clone()
        } else {
            PathBuf::from("/")
        };
        Ok(Self {
            host,
            container,
            host_dev_root,
        })
    }

    /// The driver root on the host.
    pub fn host(&self) -> &Path {
        &self.host
    }

    /// Where this process reads the driver root.
    pub fn container(&self) -> &Path {
        &self.container
    }

    /// The host directory whose `dev/` holds the device nodes: the driver root or `/`.
    pub fn host_dev_root(&self) -> &Path {
        &self.host_dev_root
    }

    /// Whether the runtime can find the driver's files at the paths a container sees them at.
    pub fn is_host_root(&self) -> bool {
        self.host == Path::new("/")
    }
}

/// The host path of a device node that containers see at `path` (`/dev/nvidia0`) when the device nodes
/// live under `dev_root` on the host; `None` when that is `path` itself, so that specs for a driver
/// installed on the host stay as they were (no `hostPath`, and the lower `cdiVersion` that allows).
pub fn device_host_path(dev_root: &Path, path: &str) -> Option<String> {
    if dev_root == Path::new("/") {
        return None;
    }
    let relative = path.trim_start_matches('/');
    Some(dev_root.join(relative).to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dev_root_is_the_driver_root_when_it_has_a_dev_directory() {
        let with_dev = tempfile::tempdir().unwrap();
        fs::create_dir(with_dev.path().join("dev")).unwrap();
        let root = DriverRoot::new("/run/nvidia/driver", with_dev.path()).unwrap();
        assert_eq!(root.host_dev_root(), Path::new("/run/nvidia/driver"));
        assert_eq!(root.container(), with_dev.path());
        assert!(!root.is_host_root());

        // A driver root of libraries only (a plain install directory): device nodes in the host's /dev.
        let without_dev = tempfile::tempdir().unwrap();
        let root = DriverRoot::new("/opt/nvidia", without_dev.path()).unwrap();
        assert_eq!(root.host_dev_root(), Path::new("/"));

        let root = DriverRoot::new("/", with_dev.path()).unwrap();
        assert_eq!(root.host_dev_root(), Path::new("/"));
        assert!(root.is_host_root());
    }

    #[test]
    fn device_nodes_keep_their_path_under_the_host_dev_root() {
        assert_eq!(device_host_path(Path::new("/"), "/dev/nvidia0"), None);
        assert_eq!(
            device_host_path(
                Path::new("/run/nvidia/driver"),
                "/dev/nvidia-caps/nvidia-cap12"
            )
            .as_deref(),
            Some("/run/nvidia/driver/dev/nvidia-caps/nvidia-cap12")
        );
    }

    #[test]
    fn relative_or_escaping_roots_are_refused_naming_the_root() {
        let dir = tempfile::tempdir().unwrap();
        for (host, container, says) in [
            (
                "run/nvidia/driver",
                dir.path(),
                "driver root run/nvidia/driver",
            ),
            ("/run/../etc", dir.path(), "contains `..`"),
            (
                "/",
                Path::new("driver-root"),
                "container driver root driver-root",
            ),
        ] {
            let err = DriverRoot::new(host, container).unwrap_err().to_string();
            assert!(err.contains(says), "{err:?} lacks {says:?}");
        }
    }
}
