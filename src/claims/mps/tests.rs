use super::*;

fn spec(devices: &[(&str, &str, Option<u64>)], percentage: Option<u8>) -> MpsDaemonSpec {
    MpsDaemonSpec {
        claim_uid: "6c3e0f0a-3d4b-4a8e-9f00-1d2c3b4a5e6f".into(),
        devices: devices
            .iter()
            .map(|(device, uuid, limit)| MpsDevice {
                device: device.to_string(),
                uuid: uuid.to_string(),
                pinned_memory_limit_bytes: *limit,
            })
            .collect(),
        active_thread_percentage: percentage,
        multi_user: false,
        shm_size_bytes: None,
    }
}

#[test]
fn limits_become_commands_per_device_ordinal_in_whole_mib() {
    let three = spec(
        &[
            ("gpu-0", "GPU-a", Some(4 << 30)),
            ("gpu-1", "GPU-b", None),
            // 1.5 GiB and one byte: rounded down, never above the share.
            ("gpu-2-mig-1g10gb-0", "MIG-c", Some((3 << 29) + 1)),
        ],
        Some(50),
    );
    assert_eq!(
        limit_commands(&three).unwrap(),
        [
            "set_default_active_thread_percentage 50",
            "set_default_device_pinned_mem_limit 0 4096M",
            "set_default_device_pinned_mem_limit 2 1536M",
        ]
    );
    let unlimited = spec(&[("gpu-0", "GPU-a", None)], None);
    assert!(limit_commands(&unlimited).unwrap().is_empty());
}

#[test]
fn limits_the_daemon_cannot_take_are_refused_before_anything_starts() {
    let cases = [
        (
            spec(&[("gpu-0", "GPU-a", Some(MIB - 1))], None),
            "under the 1 MiB",
        ),
        (
            spec(&[("gpu-0", "GPU-a", None)], Some(0)),
            "not between 1 and 100",
        ),
        (
            spec(&[("gpu-0", "GPU-a", None)], Some(101)),
            "not between 1 and 100",
        ),
        (spec(&[("gpu-0", "GPU-a,GPU-b", None)], None), "bad UUID"),
        (spec(&[], None), "no devices"),
    ];
    for (spec, expected) in cases {
        let error = limit_commands(&spec).unwrap_err().to_string();
        assert!(error.contains(expected), "{error}");
        assert!(error.contains(&spec.claim_uid), "{error}");
    }
}

#[test]
fn claim_uids_must_be_plain_names() {
    for good in ["6c3e0f0a-3d4b-4a8e-9f00-1d2c3b4a5e6f", "a", "a.b_c-1"] {
        assert!(is_plain_name(good), "{good}");
    }
    for bad in [
        "", ".", "..", "../x", "a/b", "/abs", ".hidden", "a b", "a\0b",
    ] {
        assert!(!is_plain_name(bad), "{bad:?}");
    }
    assert!(!is_plain_name(&"a".repeat(129)));
}

#[test]
fn container_edits_mount_the_claim_directories_at_the_host_paths() {
    let daemons = MpsDaemons::new("/plugin/mps".into(), 1 << 26)
        .with_host_root("/var/lib/kubelet/plugins/gpu.dra.dev/mps".into());
    let record = MpsDaemonRecord {
        pod: "gpu-dra-mps-uid-1".into(),
        pod_uid: "pod-uid".into(),
        dir: "/plugin/mps/uid-1".into(),
        devices: vec![],
        active_thread_percentage: None,
        multi_user: false,
    };
    let edits = daemons.container_edits(&record).unwrap();
    assert_eq!(
        edits.env,
        [
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
            "CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log"
        ]
    );
    let mounts: Vec<(&str, &str, bool)> = edits
        .mounts
        .iter()
        .map(|m| {
            (
                m.host_path.as_str(),
                m.container_path.as_str(),
                m.options.iter().any(|o| o == "ro"),
            )
        })
        .collect();
    let host = "/var/lib/kubelet/plugins/gpu.dra.dev/mps/uid-1";
    assert_eq!(
        mounts,
        [
            (&*format!("{host}/pipe"), "/tmp/nvidia-mps", false),
            (&*format!("{host}/log"), "/tmp/nvidia-mps-log", true),
            (&*format!("{host}/shm"), "/dev/shm", false),
        ]
    );
    crate::cdi::validate(&crate::cdi::Spec {
        cdi_version: "0.6.0".into(),
        kind: "gpu.dra.dev/claim".into(),
        devices: vec![crate::cdi::Device {
            name: "uid-1-gpu-0".into(),
            container_edits: edits,
            ..Default::default()
        }],
        ..Default::default()
    })
    .unwrap();
}

#[tokio::test]
async fn records_outside_the_root_are_refused() {
    let daemons = MpsDaemons::new("/plugin/mps".into(), 1 << 26);
    for dir in [
        "/etc",
        "/plugin/mps",
        "/plugin/mps/a/b",
        "/plugin/other/uid-1",
        "/plugin/mps/..",
    ] {
        let record = MpsDaemonRecord {
            pod: "gpu-dra-mps-uid-1".into(),
            pod_uid: "pod-uid".into(),
            dir: dir.into(),
            devices: vec![],
            active_thread_percentage: None,
            multi_user: false,
        };
        assert!(
            matches!(
                daemons.stop(&record).await,
                Err(MpsError::ForeignDir { .. })
            ),
            "{dir}"
        );
        assert!(daemons.container_edits(&record).is_err(), "{dir}");
    }
}

#[test]
fn records_are_camel_case_and_omit_absent_limits() {
    let record = MpsDaemonRecord {
        pod: "gpu-dra-mps-uid-1".into(),
        pod_uid: "pod-uid".into(),
        dir: "/plugin/mps/uid-1".into(),
        devices: vec![MpsDevice {
            device: "gpu-0".into(),
            uuid: "GPU-a".into(),
            pinned_memory_limit_bytes: None,
        }],
        active_thread_percentage: Some(30),
        multi_user: false,
    };
    let json = serde_json::to_value(&record).unwrap();
    assert_eq!(
        json,
        serde_json::json!({
            "pod": "gpu-dra-mps-uid-1", "podUid": "pod-uid", "dir": "/plugin/mps/uid-1",
            "devices": [{"device": "gpu-0", "uuid": "GPU-a"}],
            "activeThreadPercentage": 30
        })
    );
    assert_eq!(
        serde_json::from_value::<MpsDaemonRecord>(json).unwrap(),
        record
    );
}

#[test]
fn error_answers_are_recognised() {
    assert!(reports_error("Error: no device 3"));
    assert!(reports_error("50.0\nerror while applying"));
    assert!(reports_error("Invalid argument"));
    assert!(!reports_error("50.0"));
    assert!(!reports_error(""));
}

#[test]
fn records_of_daemons_that_ran_in_the_plugin_load_without_a_pod() {
    // What releases before daemon Pods wrote: recovery then starts a Pod for the claim.
    let old = serde_json::json!({
        "pid": 10, "startTime": 20, "dir": "/plugin/mps/uid-1",
        "devices": [{"device": "gpu-0", "uuid": "GPU-a"}]
    });
    let record: MpsDaemonRecord = serde_json::from_value(old).unwrap();
    assert_eq!(record.pod, "");
    assert_eq!(record.claim_uid(), Some("uid-1"));
}

#[tokio::test]
async fn without_daemon_pods_a_start_says_what_is_missing() {
    let root = tempfile::tempdir().unwrap();
    let daemons = MpsDaemons::new(root.path().join("mps"), 1 << 26);
    let error = daemons
        .start(&spec(&[("gpu-0", "GPU-a", None)], None))
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("--mps-daemon-image"), "{error}");
    assert!(!root.path().join("mps").exists(), "nothing is made");
}

#[test]
fn a_claims_tmpfs_is_its_configs_size_within_the_nodes_memory_else_the_nodes_default() {
    let daemons = MpsDaemons::new("/plugin/mps".into(), 64 * MIB).with_node_memory(1 << 30);
    let mut asked = spec(&[("gpu-0", "GPU-a", None)], None);
    assert_eq!(
        daemons.shm_size_for(&asked).unwrap(),
        64 * MIB,
        "the node's default"
    );
    asked.shm_size_bytes = Some(512 * MIB);
    assert_eq!(daemons.shm_size_for(&asked).unwrap(), 512 * MIB);
    asked.shm_size_bytes = Some(1 << 30);
    assert_eq!(daemons.shm_size_for(&asked).unwrap(), 1 << 30, "all of it");
    asked.shm_size_bytes = Some((1 << 30) + 1);
    let error = daemons.shm_size_for(&asked).unwrap_err().to_string();
    assert!(
        error.contains("shmSize") && error.contains("more than this node's memory (1024 MiB)"),
        "{error}"
    );
    assert!(error.contains(&asked.claim_uid), "{error}");
    asked.shm_size_bytes = Some(0);
    let error = daemons.shm_size_for(&asked).unwrap_err().to_string();
    assert!(error.contains("shmSize is 0"), "{error}");
}

#[test]
fn the_stand_in_takes_the_options_nvidia_documents_and_refuses_others() {
    use super::stand_in::Mode;
    let args = |list: &[&str]| list.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    assert_eq!(
        Mode::from_args(&args(&["-f", "-multiuser-server"])),
        Ok(Mode::Foreground { multi_user: true })
    );
    assert_eq!(
        Mode::from_args(&args(&["-d"])),
        Ok(Mode::Background { multi_user: false })
    );
    assert_eq!(Mode::from_args(&args(&[])), Ok(Mode::Client));
    for refused in [
        &["-f", "-M"][..],
        &["-f", "--multiuser-server"],
        &["-d", "-f"],
        &["-multiuser-server"],
    ] {
        assert!(Mode::from_args(&args(refused)).is_err(), "{refused:?}");
    }
}
