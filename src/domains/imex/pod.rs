//! The Pod that runs this node's IMEX daemon for the domain it serves: bound to the node (`nodeName`),
//! in the plugin's namespace, on the host's network (the other nodes' daemons reach it at the node's
//! address, port 50000), restarted by the kubelet when it dies, Ready while `nvidia-imex-ctl -q` says
//! READY. It runs this binary as `gpu-dra imex-daemon` (the plugin's own image), which sees the
//! domain's directory (`config.cfg`, `nodes_config.cfg`, `peers`, `ready`):
//! - chroot: at `<root>/tmp`, so `/tmp` once it entered the driver root, where `nvidia-imex` runs with
//!   the root's own libc;
//! - direct (a root that cannot run its own binaries, GKE's) and stand-in: at the host's path itself,
//!   so the paths in `config.cfg` hold inside the Pod and out.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use super::config::NODES_CONFIG_FILE;
use super::{ImexDaemonSpec, ImexError, READY_FILE};
use crate::claims::daemon_pod::{
    in_pod_driver_root, DaemonPod, DriverProgram, DriverPrograms, HostDir, PodTemplate, MIB,
};
use crate::domains::api::DOMAIN_LABEL;

/// The component label of every IMEX daemon Pod; the plugin lists its node's daemons by it.
pub const COMPONENT: &str = "imex-daemon";
/// The variable that gives the daemon this node's address (the stand-in needs it; NVIDIA's daemon
/// finds its own among the peers).
pub const NODE_IP_ENV: &str = "NODE_IP";
/// Where a chrooted daemon sees the domain's directory: a directory every root has.
const CHROOT_DOMAIN_DIR: &str = "/tmp";
/// The memory the daemon's processes may use: the supervisor (this binary, a few MiB), `nvidia-imex`
/// (a network daemon that brokers memory handles between the nodes' drivers; it makes no CUDA
/// context and keeps no shared memory of its clients) and the `nvidia-imex-ctl -q` the supervisor
/// runs each second. NVIDIA publishes no figure for it and its own ComputeDomain daemon has no limit;
/// 512 MiB is far above a network daemon's size, so the limit only stops one that leaks.
pub const DAEMON_MEMORY: u64 = 512 * MIB;
/// The daemon's resting size, which the scheduler counts.
const MEMORY_REQUEST: &str = "32Mi";

/// The driver's programs an IMEX daemon runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImexPrograms {
    /// `nvidia-imex`'s path in the driver root.
    pub daemon: PathBuf,
    /// `nvidia-imex-ctl`'s path in the driver root.
    pub ctl: PathBuf,
}

impl DriverPrograms for ImexPrograms {
    const NAMES: &'static [&'static str] = &["nvidia-imex", "nvidia-imex-ctl"];
    const FLAGS: &'static [&'static str] = &["--program", "--ctl-program"];
    const MOUNT_POINTS: &'static [&'static str] = &["tmp"];

    fn paths(&self) -> Vec<&Path> {
        vec![&self.daemon, &self.ctl]
    }

    fn from_paths(paths: Vec<PathBuf>) -> Self {
        let mut paths = paths.into_iter();
        ImexPrograms {
            daemon: paths.next().unwrap_or_default(),
            ctl: paths.next().unwrap_or_default(),
        }
    }
}

/// How the daemon Pod runs `nvidia-imex` and `nvidia-imex-ctl`.
pub type ImexProgram = DriverProgram<ImexPrograms>;

/// What every IMEX daemon Pod of this plugin shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImexPodTemplate {
    /// As for every daemon of the plugin.
    pub pod: PodTemplate<ImexPrograms>,
    /// This node's address as its domains' peers files list it. Given to the daemon as it is, so the
    /// daemon and its peers agree on one address; `None`: the kubelet's `status.hostIP`.
    pub node_ip: Option<String>,
}

impl ImexPodTemplate {
    /// One Pod per domain UID and node: every node of a domain runs one, and the plugins of all
    /// nodes share a namespace. The node's name where it fits the 253 characters of a Pod name (a
    /// UUID and a node name are DNS subdomains, so the name is one), a hash of it where not.
    pub fn pod_name(&self, domain_uid: &str) -> String {
        let name = format!("gpu-dra-imex-{domain_uid}-{}", self.pod.node);
        if name.len() <= 253 {
            return name;
        }
        // FNV-1a: stable across releases, unlike std's hasher.
        let hash = self.pod.node.bytes().fold(0xcbf29ce484222325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
        });
        // 12 hex digits keep the name one DNS label (63 characters).
        format!("gpu-dra-imex-{domain_uid}-{:012x}", hash >> 16)
    }

    /// Where the daemon sees the domain's directory whose host path is `host_dir`.
    pub fn daemon_dir(&self, host_dir: &Path) -> PathBuf {
        match self.pod.program {
            DriverProgram::Chroot(_) => PathBuf::from(CHROOT_DOMAIN_DIR),
            DriverProgram::Direct { .. } | DriverProgram::StandIn => host_dir.to_path_buf(),
        }
    }

    /// The peers file's path as the daemon sees it, for `config.cfg`.
    pub fn nodes_config_path(&self, host_dir: &Path) -> PathBuf {
        self.daemon_dir(host_dir).join(NODES_CONFIG_FILE)
    }

    /// The daemon Pod of one domain; `host_dir` is the domain's directory on the host.
    pub fn pod(&self, spec: &ImexDaemonSpec, host_dir: &Path) -> Result<Pod, ImexError> {
        let mount_path = match self.pod.program {
            DriverProgram::Chroot(_) => in_pod_driver_root(Path::new(CHROOT_DOMAIN_DIR)),
            DriverProgram::Direct { .. } | DriverProgram::StandIn => host_dir.to_path_buf(),
        };
        let node_ip = match &self.node_ip {
            Some(ip) => json!({"name": NODE_IP_ENV, "value": ip}),
            None => json!({"name": NODE_IP_ENV,
                           "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}),
        };
        DaemonPod {
            template: &self.pod,
            name: self.pod_name(&spec.domain_uid),
            component: COMPONENT,
            labels: vec![(DOMAIN_LABEL, spec.domain_uid.clone())],
            annotations: vec![("gpu.dra.dev/compute-domain-name", spec.domain.clone())],
            subcommand: "imex-daemon",
            args: vec![format!("--dir={}", self.daemon_dir(host_dir).display())],
            trailing_args: Vec::new(),
            env: vec![node_ip],
            volumes: vec![HostDir {
                name: "domain",
                host_path: host_dir.to_path_buf(),
                mount_path: mount_path.display().to_string(),
            }],
            ready_file: format!("{}/{READY_FILE}", mount_path.display()),
            // The peers reach the daemon at the node's address.
            host_network: true,
            memory_request: MEMORY_REQUEST,
            memory_limit: DAEMON_MEMORY,
        }
        .pod()
        .map_err(|e| ImexError::Io {
            domain: spec.domain.clone(),
            action: "making the daemon Pod for",
            path: host_dir.to_path_buf(),
            source: std::io::Error::other(e),
        })
    }
}

/// How the daemon runs `nvidia-imex` and `nvidia-imex-ctl` of the driver root that this process sees
/// at `container_root`: inside it (chroot) where the root can run its own binaries and has a `/tmp`
/// to mount the domain's directory on; directly with the root's libraries otherwise.
pub fn program_for_root(container_root: &Path) -> ImexProgram {
    DriverProgram::for_root(container_root)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "5d1f0c2a-3b4c-4d5e-8f60-718293a4b5c6";
    const HOST_DIR: &str =
        "/var/lib/kubelet/plugins/gpu.dra.dev/imex/5d1f0c2a-3b4c-4d5e-8f60-718293a4b5c6";

    fn usual() -> ImexPrograms {
        ImexPrograms {
            daemon: "/usr/bin/nvidia-imex".into(),
            ctl: "/usr/bin/nvidia-imex-ctl".into(),
        }
    }

    fn template(program: ImexProgram, node_ip: Option<&str>) -> ImexPodTemplate {
        ImexPodTemplate {
            pod: PodTemplate {
                namespace: "gpu-dra".into(),
                node: "node-a".into(),
                driver: "gpu.dra.dev".into(),
                image: "gpu-dra:v1".into(),
                host_driver_root: "/run/nvidia/driver".into(),
                program,
            },
            node_ip: node_ip.map(String::from),
        }
    }

    fn spec() -> ImexDaemonSpec {
        ImexDaemonSpec {
            domain_uid: UID.into(),
            domain: "team/training".into(),
            peers: vec![
                crate::domains::imex::Peer {
                    index: 0,
                    address: "10.0.0.1".into(),
                },
                crate::domains::imex::Peer {
                    index: 1,
                    address: "10.0.0.2".into(),
                },
            ],
        }
    }

    fn pod_json(template: &ImexPodTemplate) -> serde_json::Value {
        serde_json::to_value(template.pod(&spec(), Path::new(HOST_DIR)).unwrap()).unwrap()
    }

    fn strings(value: &serde_json::Value) -> Vec<String> {
        value
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn the_pod_is_bound_to_the_node_on_its_network_and_labelled_with_its_domain() {
        let pod = pod_json(&template(ImexProgram::StandIn, None));
        assert_eq!(
            pod["metadata"]["name"],
            format!("gpu-dra-imex-{UID}-node-a")
        );
        assert_eq!(pod["metadata"]["namespace"], "gpu-dra");
        let labels = &pod["metadata"]["labels"];
        assert_eq!(labels["app.kubernetes.io/component"], "imex-daemon");
        assert_eq!(labels["gpu.dra.dev/compute-domain"], UID);
        assert_eq!(labels["gpu-dra.dev/driver"], "gpu.dra.dev");
        let spec = &pod["spec"];
        assert_eq!(spec["nodeName"], "node-a");
        assert_eq!(spec["hostNetwork"], true);
        assert_eq!(spec["restartPolicy"], "Always");
        assert_eq!(spec["tolerations"][0]["operator"], "Exists");
        assert_eq!(spec["dnsPolicy"], "ClusterFirstWithHostNet");
        assert_eq!(
            pod["metadata"]["annotations"]["gpu.dra.dev/compute-domain-name"],
            "team/training"
        );
        let container = &spec["containers"][0];
        assert_eq!(container["securityContext"]["privileged"], true);
        assert_eq!(container["resources"]["limits"]["memory"], "512Mi");
        assert_eq!(container["resources"]["requests"]["memory"], "32Mi");
        assert_eq!(
            container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"],
            "status.hostIP"
        );
    }

    #[test]
    fn the_stand_in_sees_the_domain_directory_at_the_hosts_path_and_no_driver_root() {
        let template = template(ImexProgram::StandIn, Some("10.0.0.1"));
        let pod = pod_json(&template);
        let container = &pod["spec"]["containers"][0];
        assert_eq!(
            strings(&container["args"]),
            [
                "imex-daemon".to_string(),
                format!("--dir={HOST_DIR}"),
                "--program=stand-in".into(),
                "--ctl-program=stand-in".into(),
            ]
        );
        assert_eq!(container["env"][0]["value"], "10.0.0.1");
        assert_eq!(container["volumeMounts"].as_array().unwrap().len(), 1);
        assert_eq!(container["volumeMounts"][0]["mountPath"], HOST_DIR);
        assert_eq!(pod["spec"]["volumes"][0]["hostPath"]["path"], HOST_DIR);
        assert_eq!(
            strings(&container["readinessProbe"]["exec"]["command"]),
            [
                "gpu-dra".to_string(),
                "imex-daemon".into(),
                "--check-ready".into(),
                format!("{HOST_DIR}/ready"),
            ]
        );
        assert_eq!(
            template.nodes_config_path(Path::new(HOST_DIR)),
            Path::new(HOST_DIR).join("nodes_config.cfg")
        );
    }

    #[test]
    fn a_chrooted_daemon_sees_the_domain_directory_at_tmp_inside_the_driver_root() {
        let template = template(ImexProgram::Chroot(usual()), None);
        let pod = pod_json(&template);
        let container = &pod["spec"]["containers"][0];
        let args = strings(&container["args"]);
        for expected in [
            "--dir=/tmp",
            "--driver-root=/driver-root",
            "--program=/usr/bin/nvidia-imex",
            "--ctl-program=/usr/bin/nvidia-imex-ctl",
        ] {
            assert!(args.iter().any(|a| a == expected), "{expected} in {args:?}");
        }
        let mounts: Vec<(String, String)> = container["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["name"].as_str().unwrap().to_string(),
                    m["mountPath"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(
            mounts,
            [
                ("driver-root".to_string(), "/driver-root".to_string()),
                ("domain".into(), "/driver-root/tmp".into())
            ]
        );
        assert_eq!(
            container["readinessProbe"]["exec"]["command"][3],
            "/driver-root/tmp/ready"
        );
        assert_eq!(
            template.nodes_config_path(Path::new(HOST_DIR)),
            Path::new("/tmp/nodes_config.cfg")
        );
        let volumes = pod["spec"]["volumes"].as_array().unwrap();
        assert!(volumes
            .iter()
            .any(|v| v["hostPath"]["path"] == "/run/nvidia/driver"));
    }

    #[test]
    fn a_direct_daemon_runs_the_roots_binaries_with_its_libraries() {
        let pod = pod_json(&template(
            ImexProgram::Direct {
                programs: usual(),
                library_dir: Some("/usr/lib64".into()),
            },
            None,
        ));
        let args = strings(&pod["spec"]["containers"][0]["args"]);
        for expected in [
            format!("--dir={HOST_DIR}"),
            "--program=/driver-root/usr/bin/nvidia-imex".into(),
            "--ctl-program=/driver-root/usr/bin/nvidia-imex-ctl".into(),
            "--library-path=/driver-root/usr/lib64".into(),
        ] {
            assert!(args.contains(&expected), "{expected} in {args:?}");
        }
        assert!(!args.iter().any(|a| a.starts_with("--driver-root")));
    }

    #[test]
    fn the_pod_name_holds_the_node_or_a_hash_of_a_long_one() {
        let mut long = template(ImexProgram::StandIn, None);
        long.pod.node = format!("{}.example.com", "n".repeat(230));
        let name = long.pod_name(UID);
        assert_eq!(name.len(), "gpu-dra-imex-".len() + UID.len() + 13);
        assert!(crate::claims::names::is_dns_label(&name), "{name}");
        assert_eq!(name, long.pod_name(UID), "stable");
        long.pod.node.push('x');
        assert_ne!(name, long.pod_name(UID));
    }

    #[test]
    fn a_root_without_the_programs_gets_their_usual_paths_so_the_supervisor_names_them() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(program_for_root(root.path()), ImexProgram::Chroot(usual()));
    }
}
