use std::path::{Path, PathBuf};

use k8s_openapi::api::authentication::v1::{SelfSubjectReview, UserInfo};

use super::mounts::unescape_mountinfo;
use super::*;
use crate::cdi::fake_root::{native_dir, FakeRoot, VERSION};

fn nvml() -> BackendChoice {
    BackendChoice::Nvml {
        driver_root: PathBuf::from("/driver-root"),
        host_driver_root: PathBuf::from("/"),
    }
}

fn fake() -> BackendChoice {
    BackendChoice::Fake {
        profile: "dgx-h100".to_string(),
        state_file: None,
    }
}

fn setting(host: &str, container: Option<&Path>) -> DriverRootSetting {
    DriverRootSetting {
        host: PathBuf::from(host),
        container: container.map(Path::to_path_buf),
    }
}

fn driver_root_error(backend: &BackendChoice, setting: &DriverRootSetting) -> String {
    let error = check_driver_root(backend, setting).expect_err("the driver root is refused");
    assert_eq!(error.reason(), REASON_DRIVER_ROOT_INVALID);
    error.to_string()
}

fn assert_says(text: &str, expected: &[&str]) {
    for piece in expected {
        assert!(text.contains(piece), "{piece:?} missing in:\n{text}");
    }
}

#[test]
fn a_missing_container_driver_root_names_both_paths_and_the_volume_to_fix() {
    let gone = Path::new("/nonexistent/driver-root");
    let text = driver_root_error(&nvml(), &setting("/run/nvidia/driver", Some(gone)));
    assert_says(
        &text,
        &[
            "--container-driver-root (CONTAINER_DRIVER_ROOT) /nonexistent/driver-root does not exist",
            "--driver-root (NVIDIA_DRIVER_ROOT) /run/nvidia/driver",
            "must have NVIDIA_DRIVER_ROOT as its path",
        ],
    );
    // On the host, without a container path, only the host path is named.
    let text = driver_root_error(&nvml(), &setting("/nonexistent/driver", None));
    assert_says(
        &text,
        &[
            "--driver-root (NVIDIA_DRIVER_ROOT) /nonexistent/driver does not exist",
            "/run/nvidia/driver under the GPU Operator",
        ],
    );
    assert!(!text.contains("CONTAINER_DRIVER_ROOT"), "{text}");
}

#[test]
fn a_driver_root_without_libnvidia_ml_is_not_a_driver_root() {
    let empty = tempfile::tempdir().unwrap();
    let text = driver_root_error(&nvml(), &setting("/", Some(empty.path())));
    assert_says(
        &text,
        &[
            "is not an NVIDIA driver root: it holds no libnvidia-ml.so",
            "/usr/lib64",
            "NVIDIA_DRIVER_ROOT",
        ],
    );
    // Another of the driver's libraries does not make it one.
    let root = FakeRoot::new();
    root.lib(&format!("{}/libcuda.so.{VERSION}", native_dir()));
    driver_root_error(&nvml(), &setting("/", Some(root.path())));

    let file = tempfile::NamedTempFile::new().unwrap();
    let text = driver_root_error(&nvml(), &setting("/", Some(file.path())));
    assert!(text.contains("is not a directory"), "{text}");
}

#[test]
fn driver_roots_with_libnvidia_ml_pass_wherever_the_driver_keeps_it() {
    check_driver_root(
        &nvml(),
        &setting("/", Some(FakeRoot::debian_driver().path())),
    )
    .unwrap();
    // Only the soname link, into a directory that is a link itself with an absolute target, which
    // points inside the root (as on the host), not into this container.
    let root = FakeRoot::new();
    root.lib(&format!("/usr/lib64/libnvidia-ml.so.{VERSION}"))
        .symlink(
            "/usr/lib64/libnvidia-ml.so.1",
            &format!("libnvidia-ml.so.{VERSION}"),
        )
        .symlink("/lib64", "/usr/lib64");
    check_driver_root(&nvml(), &setting("/run/nvidia/driver", Some(root.path()))).unwrap();
    // A directory the root's ld.so.cache does not name and discovery does not search is not found.
    let odd = FakeRoot::new();
    odd.lib("/opt/odd/libnvidia-ml.so.1");
    driver_root_error(&nvml(), &setting("/", Some(odd.path())));
}

#[test]
fn the_hosts_own_root_is_left_to_the_loader() {
    // On the host the driver's library is wherever the loader's configuration says.
    check_driver_root(&nvml(), &setting("/", None)).unwrap();
    check_driver_root(&nvml(), &setting("/", Some(Path::new("/")))).unwrap();
}

#[test]
fn driver_roots_that_are_no_absolute_paths_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = driver_root_error(&nvml(), &setting("/run/../etc", Some(dir.path())));
    assert_says(&text, &["contains `..`", "must be the absolute path"]);
    let text = driver_root_error(&nvml(), &setting("/", Some(Path::new("driver-root"))));
    assert_says(&text, &["container driver root driver-root"]);
}

#[test]
fn the_fake_backend_checks_only_a_container_driver_root_it_is_given() {
    check_driver_root(&fake(), &setting("/nonexistent", None)).unwrap();
    let empty = tempfile::tempdir().unwrap();
    check_driver_root(&fake(), &setting("/", Some(empty.path()))).unwrap();
    let text = driver_root_error(&fake(), &setting("/", Some(Path::new("/nonexistent/root"))));
    assert_says(
        &text,
        &["--container-driver-root (CONTAINER_DRIVER_ROOT) /nonexistent/root does not exist"],
    );
}

/// The three directories of the DaemonSet, under `base`.
fn kubelet_dirs(base: &Path) -> Vec<KubeletDir> {
    ["registry", "plugins", "cdi"]
        .iter()
        .zip([
            "--kubelet-registry-dir (KUBELET_REGISTRY_DIR)",
            "--kubelet-plugins-dir (KUBELET_PLUGINS_DIR)",
            "--cdi-root (CDI_ROOT)",
        ])
        .map(|(name, flag)| {
            let path = base.join(name);
            std::fs::create_dir_all(&path).unwrap();
            KubeletDir {
                flag,
                path,
                seen_by: "someone on the host",
            }
        })
        .collect()
}

/// A mountinfo line as the kernel writes it, for a hostPath-like bind mount of `root` at `at`.
fn mount_line(id: u32, root: &str, at: &Path) -> String {
    let at = at.display().to_string().replace(' ', "\\040");
    format!("{id} 1 254:0 {root} {at} rw,relatime shared:1 - ext4 /dev/vda rw")
}

const CONTAINER_ROOT: &str =
    "1 0 0:50 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w\n\
     2 1 0:51 / /proc rw - proc proc rw\n";

fn host_path_error(dirs: &[KubeletDir], mountinfo: &str) -> String {
    let error = check_host_paths(dirs, mountinfo).expect_err("refused");
    assert_eq!(error.reason(), REASON_HOST_PATH_NOT_MOUNTED);
    error.to_string()
}

#[test]
fn kubelet_directories_must_each_be_a_mount_from_the_host() {
    let base = tempfile::tempdir().unwrap();
    let base = base.path().canonicalize().unwrap();
    let dirs = kubelet_dirs(&base);
    let all = format!(
        "{CONTAINER_ROOT}{}\n{}\n{}\n",
        mount_line(3, "/var/lib/kubelet/plugins_registry", &dirs[0].path),
        mount_line(4, "/var/lib/kubelet/plugins", &dirs[1].path),
        mount_line(5, "/cdi", &dirs[2].path),
    );
    check_host_paths(&dirs, &all).unwrap();

    // The CDI volume forgotten: its directory is the container's own.
    let without_cdi = all.replace(&mount_line(5, "/cdi", &dirs[2].path), "");
    let text = host_path_error(&dirs, &without_cdi);
    assert_says(
        &text,
        &[
            &format!(
                "--cdi-root (CDI_ROOT) {} is on the container's own root filesystem",
                dirs[2].path.display()
            ),
            "mount each as a hostPath volume of the same host directory at the same path",
        ],
    );
    assert!(!text.contains("KUBELET_REGISTRY_DIR"), "{text}");

    // All three missing: one error that names each.
    let text = host_path_error(&dirs, CONTAINER_ROOT);
    assert_says(
        &text,
        &["KUBELET_REGISTRY_DIR", "KUBELET_PLUGINS_DIR", "CDI_ROOT"],
    );
}

#[test]
fn a_mount_above_the_directory_counts_and_an_empty_dir_does_not() {
    let base = tempfile::tempdir().unwrap();
    let base = base.path().canonicalize().unwrap();
    let dirs = kubelet_dirs(&base);
    // A hostPath of the whole parent (as of /var/lib/kubelet) holds all three.
    let parent = format!(
        "{CONTAINER_ROOT}{}\n",
        mount_line(3, "/var/lib/kubelet", &base)
    );
    check_host_paths(&dirs, &parent).unwrap();

    // An emptyDir on top of the parent's mount at the registry's path.
    let empty_dir = format!(
        "{parent}{}\n",
        mount_line(
            4,
            "/var/lib/kubelet/pods/0c4e/volumes/kubernetes.io~empty-dir/registry",
            &dirs[0].path
        )
    );
    let text = host_path_error(&dirs, &empty_dir);
    assert_says(&text, &["KUBELET_REGISTRY_DIR", "is an emptyDir volume"]);

    // The later of two mounts at one point is the one on top.
    let covered_again = format!(
        "{empty_dir}{}\n",
        mount_line(5, "/var/lib/kubelet/plugins_registry", &dirs[0].path)
    );
    check_host_paths(&dirs, &covered_again).unwrap();
}

#[test]
fn mountinfo_paths_with_escaped_characters_and_missing_directories() {
    let base = tempfile::tempdir().unwrap();
    let base = base.path().canonicalize().unwrap().join("with space");
    let dirs = kubelet_dirs(&base);
    let spaced = format!("{CONTAINER_ROOT}{}\n", mount_line(3, "/x", &base));
    assert!(spaced.contains("with\\040space"), "{spaced}");
    check_host_paths(&dirs, &spaced).unwrap();

    let missing = KubeletDir {
        flag: "--cdi-root (CDI_ROOT)",
        path: base.join("not-there"),
        seen_by: "the runtime",
    };
    let text = host_path_error(&[missing], &spaced);
    assert!(
        text.contains("not-there does not exist in this container"),
        "{text}"
    );
    assert_eq!(unescape_mountinfo(r"a\011b\134c\\d"), "a\tb\\c\\\\d");
}

/// A SelfSubjectReview as kube-apiserver v1.34 answered it for a token of
/// `kubectl create token gpu-dra-plugin --bound-object-kind Pod` (realk8s), and for one without a
/// bound object.
const BOUND_TOKEN_REVIEW: &str = r#"{
  "kind": "SelfSubjectReview",
  "apiVersion": "authentication.k8s.io/v1",
  "metadata": {"creationTimestamp": "2026-12-05T18:55:58Z"},
  "status": {"userInfo": {
    "username": "system:serviceaccount:gpu-dra:gpu-dra-plugin",
    "uid": "8d77068a-b28c-4db5-87b7-72cbaa3eda54",
    "groups": ["system:serviceaccounts", "system:serviceaccounts:gpu-dra", "system:authenticated"],
    "extra": {
      "authentication.kubernetes.io/credential-id": ["JTI=480d17fc-1831-41be-a861-657f78a79313"],
      "authentication.kubernetes.io/node-name": ["node-1"],
      "authentication.kubernetes.io/node-uid": ["be802495-ff62-4b9c-9f13-9c272bd3292b"],
      "authentication.kubernetes.io/pod-name": ["plugin-x"],
      "authentication.kubernetes.io/pod-uid": ["7e36e17d-7631-47d3-b051-8c391d53b25b"]
    }
  }}
}"#;

const UNBOUND_TOKEN_REVIEW: &str = r#"{
  "kind": "SelfSubjectReview",
  "apiVersion": "authentication.k8s.io/v1",
  "metadata": {"creationTimestamp": "2026-12-05T18:55:58Z"},
  "status": {"userInfo": {
    "username": "system:serviceaccount:gpu-dra:gpu-dra-plugin",
    "uid": "8d77068a-b28c-4db5-87b7-72cbaa3eda54",
    "groups": ["system:serviceaccounts", "system:serviceaccounts:gpu-dra", "system:authenticated"],
    "extra": {"authentication.kubernetes.io/credential-id": ["JTI=a6781cab-9aeb-4763-8160-766c136c606b"]}
  }}
}"#;

const ADMIN_REVIEW: &str = r#"{
  "kind": "SelfSubjectReview",
  "apiVersion": "authentication.k8s.io/v1",
  "metadata": {"creationTimestamp": "2026-12-05T18:55:59Z"},
  "status": {"userInfo": {"username": "admin", "uid": "admin-uid",
    "groups": ["system:masters", "system:authenticated"]}}
}"#;

fn user_of(review: &str) -> UserInfo {
    let review: SelfSubjectReview = serde_json::from_str(review).unwrap();
    review.status.unwrap().user_info.unwrap()
}

#[test]
fn a_token_bound_to_a_pod_on_this_node_passes() {
    let user = user_of(BOUND_TOKEN_REVIEW);
    assert_eq!(
        judge_identity(&user, "node-1").unwrap(),
        Identity::BoundToThisNode {
            user: "system:serviceaccount:gpu-dra:gpu-dra-plugin".to_string()
        }
    );
}

#[test]
fn a_token_without_the_node_claim_or_of_another_node_is_refused_naming_what_it_found() {
    let error = judge_identity(&user_of(UNBOUND_TOKEN_REVIEW), "node-1").unwrap_err();
    assert_eq!(error.reason(), REASON_TOKEN_WITHOUT_NODE_CLAIM);
    assert_says(
        &error.to_string(),
        &[
            "system:serviceaccount:gpu-dra:gpu-dra-plugin",
            "no extra[authentication.kubernetes.io/node-name]",
            "projected service account token",
        ],
    );

    let error = judge_identity(&user_of(BOUND_TOKEN_REVIEW), "node-2").unwrap_err();
    assert_eq!(error.reason(), REASON_NODE_NAME_MISMATCH);
    assert_says(
        &error.to_string(),
        &[
            "--node-name (NODE_NAME) is node-2",
            "bound to a Pod on node node-1",
            "spec.nodeName",
        ],
    );

    // An empty claim is no claim, as the admission policies read it (`[0].orValue('')`).
    let mut user = user_of(BOUND_TOKEN_REVIEW);
    user.extra
        .as_mut()
        .unwrap()
        .insert(NODE_NAME_CLAIM.to_string(), vec![String::new()]);
    let error = judge_identity(&user, "node-1").unwrap_err();
    assert_eq!(error.reason(), REASON_TOKEN_WITHOUT_NODE_CLAIM);
}

#[test]
fn users_that_are_no_service_account_are_not_judged_by_the_node_claim() {
    assert_eq!(
        judge_identity(&user_of(ADMIN_REVIEW), "node-1").unwrap(),
        Identity::NotServiceAccount {
            user: "admin".to_string()
        }
    );
}

#[test]
fn the_termination_message_is_written_only_where_the_kubelet_made_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("termination-log");
    write_termination_message(&absent, "DriverRootInvalid: x");
    assert!(!absent.exists());

    std::fs::write(&absent, "an older message that is longer").unwrap();
    write_termination_message(&absent, "DriverRootInvalid: x");
    assert_eq!(
        std::fs::read_to_string(&absent).unwrap(),
        "DriverRootInvalid: x"
    );

    // Cut to what the kubelet reads, on a character boundary.
    write_termination_message(&absent, &"é".repeat(3000));
    let written = std::fs::read_to_string(&absent).unwrap();
    assert!(
        written.len() <= MAX_TERMINATION_MESSAGE && written.len() > 4000,
        "{}",
        written.len()
    );
}

fn preflight_under(base: &Path, in_pod: bool, mountinfo: &str) -> Preflight {
    let mut config = PluginConfig::fake_node_under(base, "gpu.dra.dev", "node-1", "dgx-h100");
    config.mps.own_pod = Some("gpu-dra-plugin-x".to_string());
    for dir in [&config.registry_dir, &config.plugins_dir, &config.cdi_root] {
        std::fs::create_dir_all(dir).unwrap();
    }
    let mountinfo_path = base.join("mountinfo");
    std::fs::write(&mountinfo_path, mountinfo).unwrap();
    Preflight::new(
        &config,
        setting("/", Some(&base.join("no-driver-root"))),
        Environment {
            in_pod,
            mountinfo: mountinfo_path,
            termination_log: base.join("termination-log"),
        },
    )
}

#[test]
fn the_host_path_check_applies_only_in_a_pod() {
    let base = tempfile::tempdir().unwrap();
    let outside = preflight_under(base.path(), false, CONTAINER_ROOT);
    let reasons: Vec<&str> = outside.check_local().iter().map(|e| e.reason()).collect();
    assert_eq!(reasons, [REASON_DRIVER_ROOT_INVALID]);

    let inside = preflight_under(base.path(), true, CONTAINER_ROOT);
    let reasons: Vec<&str> = inside.check_local().iter().map(|e| e.reason()).collect();
    assert_eq!(
        reasons,
        [REASON_DRIVER_ROOT_INVALID, REASON_HOST_PATH_NOT_MOUNTED]
    );
    assert_eq!(
        inside.pod,
        Some(OwnPod {
            namespace: "gpu-dra".to_string(),
            name: "gpu-dra-plugin-x".to_string()
        })
    );
}

#[tokio::test]
async fn a_refusal_without_an_api_client_still_leaves_its_termination_message() {
    let base = tempfile::tempdir().unwrap();
    let preflight = preflight_under(base.path(), true, CONTAINER_ROOT);
    std::fs::write(&preflight.environment.termination_log, "").unwrap();
    let failed = preflight.run(None).await.unwrap_err();
    assert_eq!(failed.len(), 2);
    let message = std::fs::read_to_string(&preflight.environment.termination_log).unwrap();
    let lines: Vec<&str> = message.lines().collect();
    assert_eq!(lines.len(), 2, "{message}");
    assert!(lines[0].starts_with("DriverRootInvalid: "), "{message}");
    assert!(lines[1].starts_with("HostPathNotMounted: "), "{message}");
}
