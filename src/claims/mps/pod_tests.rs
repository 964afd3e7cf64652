use super::*;
use crate::claims::mps::MpsDevice;

fn chroot() -> DaemonProgram {
    DaemonProgram::Chroot(MpsPrograms {
        control: "/usr/bin/nvidia-cuda-mps-control".into(),
    })
}

fn spec() -> MpsDaemonSpec {
    MpsDaemonSpec {
        claim_uid: "0f6a3b2c-1d2e-4f50-8a9b-0c1d2e3f4a5b".to_string(),
        devices: vec![
            MpsDevice {
                device: "gpu-0".into(),
                uuid: "GPU-aaa".into(),
                pinned_memory_limit_bytes: Some(2 << 30),
            },
            MpsDevice {
                device: "gpu-1".into(),
                uuid: "GPU-bbb".into(),
                pinned_memory_limit_bytes: None,
            },
        ],
        active_thread_percentage: Some(25),
        multi_user: false,
        shm_size_bytes: None,
    }
}

fn template(program: DaemonProgram) -> DaemonPodTemplate {
    DaemonPodTemplate {
        namespace: "gpu-dra".into(),
        node: "node-a".into(),
        driver: "gpu.dra.dev".into(),
        image: "gpu-dra:v1".into(),
        host_driver_root: PathBuf::from("/run/nvidia/driver"),
        program,
    }
}

fn json(pod: &Pod) -> serde_json::Value {
    serde_json::to_value(pod).unwrap()
}

const HOST_DIR: &str =
    "/var/lib/kubelet/plugins/gpu.dra.dev/mps/0f6a3b2c-1d2e-4f50-8a9b-0c1d2e3f4a5b";

#[test]
fn a_chroot_daemon_sees_the_claims_directories_inside_the_driver_root() {
    let pod = template(chroot())
        .pod(&spec(), Path::new(HOST_DIR))
        .unwrap();
    let pod = json(&pod);
    assert_eq!(
        pod["metadata"]["name"],
        "gpu-dra-mps-0f6a3b2c-1d2e-4f50-8a9b-0c1d2e3f4a5b"
    );
    assert_eq!(pod["spec"]["nodeName"], "node-a");
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["image"], "gpu-dra:v1");
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(args.contains(&"--driver-root=/driver-root"), "{args:?}");
    assert!(args.contains(&"--pipe-dir=/tmp/pipe"), "{args:?}");
    assert!(args.contains(&"--shm-dir=/driver-root/dev/shm"), "{args:?}");
    assert!(
        args.contains(&"--program=/usr/bin/nvidia-cuda-mps-control"),
        "{args:?}"
    );
    assert!(
        args.contains(&"--command=set_default_active_thread_percentage 25"),
        "{args:?}"
    );
    assert!(!args.contains(&"--multi-user"), "{args:?}");
    assert!(
        args.contains(&"--command=set_default_device_pinned_mem_limit 0 2048M"),
        "{args:?}"
    );
    assert_eq!(container["env"][0]["value"], "GPU-aaa,GPU-bbb");
    let mounts: Vec<(&str, &str)> = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap(),
                m["mountPath"].as_str().unwrap(),
            )
        })
        .collect();
    // The driver root first, the claim's directories on top of it.
    assert_eq!(
        mounts,
        [
            ("driver-root", "/driver-root"),
            ("claim", "/driver-root/tmp"),
            ("shm", "/driver-root/dev/shm")
        ]
    );
    let volumes = pod["spec"]["volumes"].as_array().unwrap();
    let host = |name: &str| {
        volumes.iter().find(|v| v["name"] == name).unwrap()["hostPath"]["path"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(host("driver-root"), "/run/nvidia/driver");
    assert_eq!(host("shm"), format!("{HOST_DIR}/shm"));
    assert_eq!(host("claim"), HOST_DIR);
}

#[test]
fn a_stand_in_daemon_gets_no_driver_root() {
    let pod = json(
        &template(DaemonProgram::StandIn)
            .pod(&spec(), Path::new(HOST_DIR))
            .unwrap(),
    );
    let container = &pod["spec"]["containers"][0];
    let args = container["args"].to_string();
    assert!(args.contains("--program=stand-in"), "{args}");
    assert!(args.contains("--shm-dir=/dev/shm"), "{args}");
    assert!(!args.contains("driver-root"), "{args}");
    assert!(!pod["spec"]["volumes"].to_string().contains("driver-root"));
    assert_eq!(
        container["readinessProbe"]["exec"]["command"][3],
        "/mps/log/ready"
    );
}

#[test]
fn a_spec_with_a_bad_limit_makes_no_pod() {
    let mut bad = spec();
    bad.active_thread_percentage = Some(0);
    assert!(template(DaemonProgram::StandIn)
        .pod(&bad, Path::new(HOST_DIR))
        .is_err());
}

#[test]
fn a_root_without_a_loader_runs_the_daemon_directly() {
    let root = tempfile::tempdir().unwrap();
    let bin = root.path().join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    // The host's own binary: its interpreter is not in this root.
    std::fs::copy(
        std::env::current_exe().unwrap(),
        bin.join("nvidia-cuda-mps-control"),
    )
    .unwrap();
    for dir in ["tmp", "dev/shm"] {
        std::fs::create_dir_all(root.path().join(dir)).unwrap();
    }
    match program_for_root(root.path()) {
        DaemonProgram::Direct { programs, .. } => {
            assert_eq!(
                programs.control,
                Path::new("/usr/bin/nvidia-cuda-mps-control")
            )
        }
        other => panic!("{other:?}"),
    }
    // With the loader in the root, the daemon runs inside it.
    let interp = crate::gpu::driver_exec::interpreter_of(&bin.join("nvidia-cuda-mps-control"))
        .unwrap()
        .expect("a dynamically linked test binary");
    let loader = root.path().join(interp.strip_prefix("/").unwrap());
    std::fs::create_dir_all(loader.parent().unwrap()).unwrap();
    std::fs::write(&loader, b"").unwrap();
    assert_eq!(program_for_root(root.path()), chroot());
}

#[test]
fn a_multi_user_daemon_is_told_so() {
    let mut multi = spec();
    multi.multi_user = true;
    let pod = template(chroot()).pod(&multi, Path::new(HOST_DIR)).unwrap();
    let args = json(&pod)["spec"]["containers"][0]["args"].clone();
    assert!(
        args.as_array().unwrap().iter().any(|a| a == "--multi-user"),
        "{args}"
    );
}

#[test]
fn a_direct_daemon_runs_the_roots_control_program_with_its_libraries() {
    let direct = DaemonProgram::Direct {
        programs: MpsPrograms {
            control: "/usr/bin/nvidia-cuda-mps-control".into(),
        },
        library_dir: Some("/usr/lib64".into()),
    };
    let pod = json(&template(direct).pod(&spec(), Path::new(HOST_DIR)).unwrap());
    let args = pod["spec"]["containers"][0]["args"].to_string();
    for expected in [
        "--program=/driver-root/usr/bin/nvidia-cuda-mps-control",
        "--library-path=/driver-root/usr/lib64",
        "--pipe-dir=/mps/pipe",
        "--shm-dir=/dev/shm",
    ] {
        assert!(args.contains(expected), "{expected} in {args}");
    }
    assert!(!args.contains("--driver-root"), "{args}");
}

#[test]
fn the_daemon_pod_has_a_memory_limit_for_the_daemon_and_the_claims_tmpfs() {
    let container = |spec: &MpsDaemonSpec| {
        json(&template(chroot()).pod(spec, Path::new(HOST_DIR)).unwrap())["spec"]["containers"][0]
            .clone()
    };
    let resources = &container(&spec())["resources"];
    // The daemon's own 1 GiB and the default 64 MiB tmpfs it may write.
    assert_eq!(resources["limits"]["memory"], "1088Mi");
    assert_eq!(resources["requests"]["memory"], "16Mi");
    assert_eq!(DAEMON_MEMORY, 1 << 30);
    let mut large = spec();
    large.shm_size_bytes = Some(8 << 30);
    assert_eq!(
        container(&large)["resources"]["limits"]["memory"],
        "9216Mi",
        "an 8 GiB tmpfs and the daemon's own"
    );
}

#[test]
fn a_daemon_that_dies_leaves_its_last_lines_for_kubectl_describe() {
    let pod = json(
        &template(chroot())
            .pod(&spec(), Path::new(HOST_DIR))
            .unwrap(),
    );
    let container = &pod["spec"]["containers"][0];
    assert_eq!(
        container["terminationMessagePolicy"],
        "FallbackToLogsOnError"
    );
    assert_eq!(container["name"], "mps-control-daemon");
    assert_eq!(pod["spec"]["priorityClassName"], "system-node-critical");
    assert_eq!(pod["spec"]["tolerations"][0]["operator"], "Exists");
    assert!(pod["spec"].get("hostNetwork").is_none());
    assert_eq!(
        pod["metadata"]["labels"]["gpu-dra.dev/claim-uid"],
        "0f6a3b2c-1d2e-4f50-8a9b-0c1d2e3f4a5b"
    );
}
