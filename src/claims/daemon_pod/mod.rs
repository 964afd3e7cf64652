//! The Pods of the daemons the plugin runs beside itself: a claim's MPS control daemon
//! (`claims::mps`) and the node's IMEX daemon (`domains::imex`). Each runs this binary (`gpu-dra
//! mps-daemon`, `gpu-dra imex-daemon`) from the plugin's image as PID 1 of a Pod of its own, bound to
//! the node, restarted by the kubelet, Ready once its supervisor wrote a ready file. What the daemons
//! share lives here:
//! - the Pod skeleton ([`DaemonPod`]): binding, priority, tolerations, privileges, labels, the
//!   readiness probe, resources, and the driver root mounted first under the daemon's own volumes;
//! - how the driver's programs run ([`DriverProgram`]): inside the driver root (chroot), directly with
//!   the root's libraries where the root cannot run its own binaries (GKE's), or the fake backend's
//!   stand-ins;
//! - reading a Pod's status (`status.rs`) and the calls on the API server (`api.rs`);
//! - the supervisor's common steps (`supervisor.rs`).
//!
//! Each daemon keeps only what differs: its arguments, volumes and environment, host networking
//! for IMEX, and its programs.

use std::fmt::Debug;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

pub mod api;
pub mod status;
pub mod supervisor;

pub use api::DaemonPodApi;
pub use status::{is_ready, not_ready_reason};
pub use supervisor::STAND_IN_PROGRAM;

/// Labels every daemon Pod carries; the plugin lists its own node's Pods by them.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
pub const DRIVER_LABEL: &str = "gpu-dra.dev/driver";
/// Where the daemon container sees the driver root.
pub const POD_DRIVER_ROOT: &str = "/driver-root";
/// Quit is answered within seconds; the supervisor then ends the daemon itself.
pub const TERMINATION_GRACE_SECONDS: i64 = 15;
pub const MIB: u64 = 1024 * 1024;

/// The driver's programs one daemon runs, each named to the supervisor by a flag that takes its path.
pub trait DriverPrograms: Debug + Clone + PartialEq + Eq {
    /// The programs' file names, as the driver installs them.
    const NAMES: &'static [&'static str];
    /// The supervisor's flag for each program, in the order of [`NAMES`](Self::NAMES).
    const FLAGS: &'static [&'static str];
    /// Directories the daemon's Pod mounts its own directories on inside the driver root, so that a
    /// chroot is possible only where the root has them.
    const MOUNT_POINTS: &'static [&'static str];

    /// The programs' paths inside the driver root, in the order of [`NAMES`](Self::NAMES).
    fn paths(&self) -> Vec<&Path>;
    /// The programs from their paths, in the order of [`NAMES`](Self::NAMES).
    fn from_paths(paths: Vec<PathBuf>) -> Self;
}

/// How a daemon Pod runs the driver's programs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverProgram<P> {
    /// Inside the driver root (chroot), so that the driver's binaries load the root's own libc; the
    /// paths are the programs' there.
    Chroot(P),
    /// The driver root cannot run its binaries itself (no loader of its own): `<root>/<program>`
    /// with the root's library directory `<root>/<library_dir>`.
    Direct {
        programs: P,
        library_dir: Option<PathBuf>,
    },
    /// The fake backend's stand-ins, this binary's `fake` commands.
    StandIn,
}

impl<P: DriverPrograms> DriverProgram<P> {
    /// How the daemon runs the programs of the driver root that this process sees at
    /// `container_root`: inside it (chroot) where the root can run its own binaries (their ELF
    /// interpreter is in the root) and has the directories the Pod mounts on; directly with the root's
    /// libraries otherwise. A root without the programs gets their usual paths in a chroot, so that
    /// the supervisor names the program it could not start.
    pub fn for_root(container_root: &Path) -> Self {
        use crate::gpu::driver_exec::locate;
        let located: Result<Vec<_>, _> = P::NAMES
            .iter()
            .map(|name| locate(container_root, name))
            .collect();
        let Ok(located) = located else {
            let usual = P::NAMES.iter().map(|name| Path::new("/usr/bin").join(name));
            return DriverProgram::Chroot(P::from_paths(usual.collect()));
        };
        let inside = |path: &Path| {
            path.strip_prefix(container_root)
                .map(|rest| Path::new("/").join(rest))
                .unwrap_or_else(|_| path.to_path_buf())
        };
        let has_mount_points = P::MOUNT_POINTS
            .iter()
            .all(|dir| container_root.join(dir).is_dir());
        // The first program's libraries: the driver installs its programs' libraries together.
        let library_dir = located
            .first()
            .and_then(|l| l.library_dir.as_deref())
            .map(inside);
        let runs_inside = located.iter().all(|l| l.runs_inside_root);
        let programs = P::from_paths(located.into_iter().map(|l| l.in_root).collect());
        if runs_inside && has_mount_points {
            DriverProgram::Chroot(programs)
        } else {
            DriverProgram::Direct {
                programs,
                library_dir,
            }
        }
    }

    /// The supervisor's arguments that say how to run the programs: the root to enter, the
    /// programs' paths as the supervisor sees them, the root's library directory.
    pub fn args(&self) -> Vec<String> {
        match self {
            DriverProgram::Chroot(programs) => {
                let mut args = vec![format!("--driver-root={POD_DRIVER_ROOT}")];
                args.extend(flagged(P::FLAGS, programs.paths()));
                args
            }
            DriverProgram::Direct {
                programs,
                library_dir,
            } => {
                let in_root: Vec<PathBuf> = programs
                    .paths()
                    .into_iter()
                    .map(in_pod_driver_root)
                    .collect();
                let mut args: Vec<String> =
                    flagged(P::FLAGS, in_root.iter().map(PathBuf::as_path).collect());
                if let Some(dir) = library_dir {
                    args.push(format!(
                        "--library-path={}",
                        in_pod_driver_root(dir).display()
                    ));
                }
                args
            }
            DriverProgram::StandIn => P::FLAGS
                .iter()
                .map(|flag| format!("{flag}={STAND_IN_PROGRAM}"))
                .collect(),
        }
    }
}

fn flagged(flags: &[&str], paths: Vec<&Path>) -> Vec<String> {
    flags
        .iter()
        .zip(paths)
        .map(|(flag, path)| format!("{flag}={}", path.display()))
        .collect()
}

/// Where the daemon container sees `path` of the driver root.
pub fn in_pod_driver_root(path: &Path) -> PathBuf {
    Path::new(POD_DRIVER_ROOT).join(path.strip_prefix("/").unwrap_or(path))
}

/// A directory of the host the daemon's container sees at `mount_path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostDir {
    pub name: &'static str,
    pub host_path: PathBuf,
    pub mount_path: String,
}

/// Where and as what one plugin runs one kind of daemon's Pods: the same for all of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodTemplate<P> {
    /// The plugin's namespace.
    pub namespace: String,
    /// The node the Pods are bound to: the plugin's.
    pub node: String,
    pub driver: String,
    /// The plugin's own image: the daemon runs `gpu-dra <subcommand>` from it.
    pub image: String,
    /// The driver root on the host.
    pub host_driver_root: PathBuf,
    pub program: DriverProgram<P>,
}

/// One daemon's Pod: what differs between the daemons. [`DaemonPod::pod`] adds what they share.
#[derive(Debug, Clone)]
pub struct DaemonPod<'a, P> {
    pub template: &'a PodTemplate<P>,
    pub name: String,
    /// The component label and the container's name.
    pub component: &'static str,
    /// Labels beside the name, component and driver.
    pub labels: Vec<(&'static str, String)>,
    pub annotations: Vec<(&'static str, String)>,
    /// `mps-daemon`, `imex-daemon`.
    pub subcommand: &'static str,
    /// The daemon's arguments before those of [`DriverProgram::args`], and after them.
    pub args: Vec<String>,
    pub trailing_args: Vec<String>,
    pub env: Vec<Value>,
    /// The daemon's own directories; the driver root goes under them.
    pub volumes: Vec<HostDir>,
    /// The supervisor's ready file, as the container sees it.
    pub ready_file: String,
    /// On the host's network (the IMEX daemon's peers reach it at the node's address).
    pub host_network: bool,
    pub memory_request: &'static str,
    /// The container's memory limit in bytes: what the daemon needs (see each daemon's constant).
    pub memory_limit: u64,
}

impl<P: DriverPrograms> DaemonPod<'_, P> {
    pub fn pod(&self) -> Result<Pod, serde_json::Error> {
        let mut labels = serde_json::Map::new();
        labels.insert("app.kubernetes.io/name".into(), "gpu-dra".into());
        labels.insert(COMPONENT_LABEL.into(), self.component.into());
        labels.insert(DRIVER_LABEL.into(), self.template.driver.clone().into());
        for (key, value) in &self.labels {
            labels.insert((*key).into(), value.clone().into());
        }
        let template = self.template;
        let mut metadata = json!({
            "name": self.name,
            "namespace": template.namespace,
            "labels": labels,
        });
        if !self.annotations.is_empty() {
            let annotations: serde_json::Map<String, Value> = self
                .annotations
                .iter()
                .map(|(key, value)| ((*key).to_string(), value.clone().into()))
                .collect();
            metadata["annotations"] = annotations.into();
        }
        let mut args = vec![self.subcommand.to_string()];
        args.extend(self.args.iter().cloned());
        args.extend(template.program.args());
        args.extend(self.trailing_args.iter().cloned());
        let mut mounts: Vec<Value> = self
            .volumes
            .iter()
            .map(|v| json!({"name": v.name, "mountPath": v.mount_path}))
            .collect();
        let mut volumes: Vec<Value> = self
            .volumes
            .iter()
            .map(|v| host_path_volume(v.name, &v.host_path))
            .collect();
        if template.program != DriverProgram::StandIn {
            // Mounted first (shorter path), so the daemon's own directories go on top of it.
            mounts.insert(
                0,
                json!({"name": "driver-root", "mountPath": POD_DRIVER_ROOT, "readOnly": true,
                       "mountPropagation": "HostToContainer"}),
            );
            volumes.push(host_path_volume("driver-root", &template.host_driver_root));
        }
        let mut spec = json!({
            // Bound by the plugin, never scheduled: the daemon belongs to this node's claims.
            "nodeName": template.node,
            "restartPolicy": "Always",
            "priorityClassName": "system-node-critical",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
            // Whatever taints the node carries, the pods the daemon serves already run there.
            "tolerations": [{"operator": "Exists"}],
            "containers": [{
                "name": self.component,
                "image": template.image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["gpu-dra"],
                "args": args,
                "env": self.env,
                "readinessProbe": {
                    "exec": {"command": ["gpu-dra", self.subcommand, "--check-ready", self.ready_file]},
                    "periodSeconds": 2,
                    "failureThreshold": 1,
                },
                // A daemon that dies says why in its last lines: `kubectl describe` shows them.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                // The daemons open the GPUs' (and IMEX channels') device nodes, and chroot needs
                // CAP_SYS_CHROOT; the IMEX supervisor's private mount namespace CAP_SYS_ADMIN.
                "securityContext": {"privileged": true},
                "resources": {
                    "requests": {"cpu": "10m", "memory": self.memory_request},
                    "limits": {"memory": quantity(self.memory_limit)},
                },
                "volumeMounts": mounts,
            }],
            "volumes": volumes,
        });
        if self.host_network {
            spec["hostNetwork"] = true.into();
            spec["dnsPolicy"] = "ClusterFirstWithHostNet".into();
        }
        serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": spec,
        }))
    }
}

fn host_path_volume(name: &str, path: &Path) -> Value {
    json!({"name": name, "hostPath": {"path": path.display().to_string(), "type": "Directory"}})
}

/// Bytes as a Kubernetes quantity: whole MiB where they are, else bytes.
pub fn quantity(bytes: u64) -> String {
    if bytes.is_multiple_of(MIB) {
        format!("{}Mi", bytes / MIB)
    } else {
        bytes.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Two(PathBuf, PathBuf);

    impl DriverPrograms for Two {
        const NAMES: &'static [&'static str] = &["one", "two"];
        const FLAGS: &'static [&'static str] = &["--one", "--two"];
        const MOUNT_POINTS: &'static [&'static str] = &["tmp"];
        fn paths(&self) -> Vec<&Path> {
            vec![&self.0, &self.1]
        }
        fn from_paths(mut paths: Vec<PathBuf>) -> Self {
            let second = paths.pop().unwrap_or_default();
            Two(paths.pop().unwrap_or_default(), second)
        }
    }

    fn two() -> Two {
        Two("/usr/bin/one".into(), "/usr/bin/two".into())
    }

    #[test]
    fn the_supervisor_is_told_how_to_run_the_programs() {
        assert_eq!(
            DriverProgram::Chroot(two()).args(),
            [
                "--driver-root=/driver-root",
                "--one=/usr/bin/one",
                "--two=/usr/bin/two"
            ]
        );
        let direct = DriverProgram::Direct {
            programs: two(),
            library_dir: Some("/usr/lib64".into()),
        };
        assert_eq!(
            direct.args(),
            [
                "--one=/driver-root/usr/bin/one",
                "--two=/driver-root/usr/bin/two",
                "--library-path=/driver-root/usr/lib64"
            ]
        );
        assert_eq!(
            DriverProgram::<Two>::StandIn.args(),
            ["--one=stand-in", "--two=stand-in"]
        );
    }

    #[test]
    fn a_root_without_the_programs_gets_their_usual_paths() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(
            DriverProgram::<Two>::for_root(root.path()),
            DriverProgram::Chroot(two())
        );
    }

    #[test]
    fn quantities_are_whole_mib_where_they_can_be() {
        assert_eq!(quantity(512 * MIB), "512Mi");
        assert_eq!(quantity(MIB + 1), "1048577");
    }
}
