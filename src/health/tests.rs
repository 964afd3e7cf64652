//! Scenario tests of the health core on the fake backend's DGX H100 (eight H100s, dynamic MIG).

use k8s_openapi::api::resource::v1::DeviceTaint;

use super::*;
use crate::devices::{node_devices, MigMode, NodeDevices};
use crate::gpu::{FakeBackend, GpuBackend, MigInstance, MigRequest};

const DRIVER: &str = "gpu.dra.dev";

fn h100() -> (FakeBackend, Inventory) {
    let backend = FakeBackend::new("n", "dgx-h100").unwrap();
    let inventory = backend.inventory().unwrap();
    (backend, inventory)
}

fn event(uuid: &str, gi: Option<u32>, kind: GpuEventKind) -> GpuEvent {
    GpuEvent {
        gpu_uuid: uuid.to_string(),
        gpu_instance_id: gi,
        compute_instance_id: gi.map(|_| 0),
        kind,
    }
}

/// Creates a 3g.40gb MIG device at memory slice 4 of GPU `minor` (device `gpu-<minor>-mig-3g40gb-4`).
fn create_3g(backend: &FakeBackend, inventory: &Inventory, minor: usize) -> MigInstance {
    let gpu = &inventory.gpus[minor];
    let profile = gpu
        .mig
        .as_ref()
        .unwrap()
        .profile_by_dns_name("3g40gb")
        .unwrap()
        .clone();
    let placement = *profile.placements.iter().find(|p| p.start == 4).unwrap();
    backend
        .create_mig(&MigRequest {
            parent_uuid: gpu.uuid.clone(),
            profile_id: profile.id,
            placement,
        })
        .unwrap()
}

/// `(key, value, effect)` of a device's taints.
fn taints(node: &NodeDevices, device: &str) -> Vec<(String, Option<String>, String)> {
    let device = node.devices().find(|d| d.name == device).unwrap();
    device
        .taints
        .iter()
        .flatten()
        .map(|t| (t.key.clone(), t.value.clone(), t.effect.clone()))
        .collect()
}

fn taint(key: &str, value: Option<&str>, effect: &str) -> (String, Option<String>, String) {
    (
        key.to_string(),
        value.map(str::to_string),
        effect.to_string(),
    )
}

fn tainted_devices(node: &NodeDevices) -> Vec<String> {
    node.devices()
        .filter(|d| d.taints.is_some())
        .map(|d| d.name.clone())
        .collect()
}

fn tainted(
    state: &HealthState,
    inventory: &Inventory,
    policy: &HealthPolicy,
    minor: u32,
) -> NodeDevices {
    let mut node = node_devices(inventory, MigMode::Dynamic);
    state.taint(&mut node, inventory, DRIVER, policy, minor);
    node
}

#[test]
fn whole_gpu_fault_taints_every_device_of_that_gpu_and_no_other() {
    let (_, inventory) = h100();
    let mut state = HealthState::new();
    assert!(state.apply(&event(&inventory.gpus[2].uuid, None, GpuEventKind::Xid(79))));
    let policy = HealthPolicy::default();
    let node = tainted(&state, &inventory, &policy, 35);

    let expected: Vec<String> = node.gpus[2]
        .devices
        .iter()
        .map(|d| d.name.clone())
        .collect();
    assert_eq!(expected.len(), 26, "the whole GPU and every MIG placement");
    assert_eq!(tainted_devices(&node), expected);
    for name in &expected {
        assert_eq!(
            taints(&node, name),
            vec![taint("gpu.dra.dev/xid", Some("79"), "NoExecute")],
            "{name}"
        );
    }
    assert!(node
        .devices()
        .all(|d| d.taints.iter().flatten().all(|t| t.time_added.is_none())));

    let reports = state.device_health(&node, &inventory, &policy);
    assert_eq!(reports.len(), node.device_count());
    for report in &reports {
        if expected.contains(&report.device) {
            assert!(!report.healthy, "{}", report.device);
            assert_eq!(report.message, "XID 79: GPU has fallen off the bus");
        } else {
            assert!(report.healthy, "{}", report.device);
            assert_eq!(report.message, "");
        }
    }
}

#[test]
fn mig_fault_taints_only_that_mig_device() {
    let (backend, inventory) = h100();
    let made = create_3g(&backend, &inventory, 1);
    let inventory = backend.inventory().unwrap();
    let uuid = inventory.gpus[1].uuid.clone();
    let mut state = HealthState::new();
    state.apply(&event(
        &uuid,
        Some(made.gpu_instance_id),
        GpuEventKind::Xid(94),
    ));
    // A MIG device the inventory does not know taints nothing but is still a current fault.
    state.apply(&event(
        &uuid,
        Some(made.gpu_instance_id + 40),
        GpuEventKind::Xid(74),
    ));
    let policy = HealthPolicy::default();

    let node = tainted(&state, &inventory, &policy, 35);
    assert_eq!(tainted_devices(&node), vec!["gpu-1-mig-3g40gb-4"]);
    assert_eq!(
        taints(&node, "gpu-1-mig-3g40gb-4"),
        vec![taint("gpu.dra.dev/xid", Some("94"), "NoSchedule")]
    );
    let faults = state.current_faults(&policy);
    assert_eq!(faults.len(), 2);
    assert!(faults.contains(&(
        FaultTarget {
            gpu_uuid: uuid.clone(),
            gpu_instance_id: Some(made.gpu_instance_id + 40)
        },
        Fault::Xid(74)
    )));

    // Static MIG publishes the existing MIG device under the same name.
    let mut node = node_devices(&inventory, MigMode::Static);
    state.taint(&mut node, &inventory, DRIVER, &policy, 34);
    assert_eq!(tainted_devices(&node), vec!["gpu-1-mig-3g40gb-4"]);

    let reports = state.device_health(&node, &inventory, &policy);
    let unhealthy: Vec<_> = reports.iter().filter(|r| !r.healthy).collect();
    assert_eq!(unhealthy.len(), 1);
    assert_eq!(unhealthy[0].device, "gpu-1-mig-3g40gb-4");
    assert_eq!(unhealthy[0].message, "XID 94: contained ECC error");
}

#[test]
fn informational_xids_get_effect_none_from_1_35_and_no_taint_before() {
    let (_, inventory) = h100();
    let mut state = HealthState::new();
    state.apply(&event(&inventory.gpus[0].uuid, None, GpuEventKind::Xid(13)));
    let policy = HealthPolicy::default();

    assert!(tainted_devices(&tainted(&state, &inventory, &policy, 34)).is_empty());
    let node = tainted(&state, &inventory, &policy, 35);
    assert_eq!(
        taints(&node, "gpu-0"),
        vec![taint("gpu.dra.dev/xid", Some("13"), "None")]
    );
    let report = &state.device_health(&node, &inventory, &policy)[0];
    assert_eq!(report.device, "gpu-0");
    assert!(report.healthy);
    assert_eq!(
        report.message,
        "XID 13: graphics engine exception (informational)"
    );

    // An admin who wants application errors to keep work away gets a taint on 1.34 too.
    let strict = HealthPolicy {
        informational_effect: TaintEffect::NoSchedule,
        ..Default::default()
    };
    let node = tainted(&state, &inventory, &strict, 34);
    assert_eq!(
        taints(&node, "gpu-0"),
        vec![taint("gpu.dra.dev/xid", Some("13"), "NoSchedule")]
    );
}

#[test]
fn one_taint_per_key_with_the_most_severe_fault_and_the_latest_of_its_severity() {
    let (_, inventory) = h100();
    let uuid = inventory.gpus[0].uuid.clone();
    let mut state = HealthState::new();
    for kind in [
        GpuEventKind::Xid(74),
        GpuEventKind::Xid(79),
        GpuEventKind::Xid(119),
        GpuEventKind::Xid(13),
        GpuEventKind::RowRemapFailure,
        GpuEventKind::RetirementPending,
        GpuEventKind::DoubleBitEcc,
        GpuEventKind::Lost,
    ] {
        state.apply(&event(&uuid, None, kind));
    }
    let policy = HealthPolicy::default();
    let node = tainted(&state, &inventory, &policy, 35);
    let mut got = taints(&node, "gpu-0");
    got.sort();
    assert_eq!(
        got,
        vec![
            taint("gpu.dra.dev/ecc", Some("double-bit"), "NoExecute"),
            taint("gpu.dra.dev/gpu-lost", None, "NoExecute"),
            taint("gpu.dra.dev/memory", Some("row-remap-failure"), "NoExecute"),
            taint("gpu.dra.dev/xid", Some("79"), "NoExecute"),
        ]
    );

    // With 119 made fatal, it is the latest fatal XID.
    let policy = HealthPolicy {
        extra_fatal_xids: [119].into(),
        ..Default::default()
    };
    let node = tainted(&state, &inventory, &policy, 35);
    assert!(taints(&node, "gpu-0").contains(&taint("gpu.dra.dev/xid", Some("119"), "NoExecute")));

    // Retirement pending alone needs a reset: the reset-required effect.
    let mut state = HealthState::new();
    state.apply(&event(&uuid, None, GpuEventKind::RetirementPending));
    let node = tainted(&state, &inventory, &HealthPolicy::default(), 35);
    assert_eq!(
        taints(&node, "gpu-0"),
        vec![taint(
            "gpu.dra.dev/memory",
            Some("retirement-pending"),
            "NoSchedule"
        )]
    );
}

#[test]
fn events_that_are_not_faults_change_nothing() {
    let (_, inventory) = h100();
    let uuid = inventory.gpus[0].uuid.clone();
    let mut state = HealthState::new();
    for kind in [
        GpuEventKind::SingleBitEcc,
        GpuEventKind::MigConfigChange,
        GpuEventKind::Other(4),
        GpuEventKind::Recovered,
    ] {
        assert!(!state.apply(&event(&uuid, None, kind.clone())), "{kind:?}");
    }
    assert!(state.current_faults(&HealthPolicy::default()).is_empty());
    assert!(tainted_devices(&tainted(&state, &inventory, &HealthPolicy::default(), 35)).is_empty());

    assert!(state.apply(&event(&uuid, None, GpuEventKind::Xid(74))));
    assert!(
        !state.apply(&event(&uuid, None, GpuEventKind::Xid(74))),
        "a plain repeat"
    );
    assert!(state.apply(&event(&uuid, None, GpuEventKind::Xid(119))));
    assert!(
        state.apply(&event(&uuid, None, GpuEventKind::Xid(74))),
        "74 is the latest again"
    );
}

#[test]
fn recovery_clears_the_gpu_and_its_mig_devices() {
    let (backend, inventory) = h100();
    let made = create_3g(&backend, &inventory, 1);
    let inventory = backend.inventory().unwrap();
    let (gpu0, gpu1) = (
        inventory.gpus[0].uuid.clone(),
        inventory.gpus[1].uuid.clone(),
    );
    let mut state = HealthState::new();
    state.apply(&event(&gpu0, None, GpuEventKind::Xid(48)));
    state.apply(&event(&gpu0, None, GpuEventKind::DoubleBitEcc));
    state.apply(&event(
        &gpu1,
        Some(made.gpu_instance_id),
        GpuEventKind::Xid(94),
    ));
    state.apply(&event(&gpu1, None, GpuEventKind::Xid(74)));
    let policy = HealthPolicy::default();

    // A MIG device's recovery leaves the GPU's own faults.
    assert!(state.apply(&event(
        &gpu1,
        Some(made.gpu_instance_id),
        GpuEventKind::Recovered
    )));
    let node = tainted(&state, &inventory, &policy, 35);
    assert_eq!(
        taints(&node, "gpu-1-mig-3g40gb-4"),
        vec![taint("gpu.dra.dev/xid", Some("74"), "NoSchedule")]
    );

    assert!(state.apply(&event(&gpu0, None, GpuEventKind::Recovered)));
    assert!(
        !state.apply(&event(&gpu0, None, GpuEventKind::Recovered)),
        "already recovered"
    );
    let node = tainted(&state, &inventory, &policy, 35);
    assert!(node.gpus[0].devices.iter().all(|d| d.taints.is_none()));
    assert!(node.gpus[1].devices.iter().all(|d| d.taints.is_some()));

    // The whole GPU's recovery covers its MIG devices too.
    state.apply(&event(
        &gpu1,
        Some(made.gpu_instance_id),
        GpuEventKind::Xid(95),
    ));
    assert!(state.apply(&event(&gpu1, None, GpuEventKind::Recovered)));
    assert!(tainted_devices(&tainted(&state, &inventory, &policy, 35)).is_empty());
    assert!(state.current_faults(&policy).is_empty());
    assert!(state
        .device_health(&node, &inventory, &policy)
        .iter()
        .all(|r| r.healthy));

    // A fault that comes back after recovery taints again.
    assert!(state.apply(&event(&gpu0, None, GpuEventKind::DoubleBitEcc)));
    assert_eq!(
        tainted_devices(&tainted(&state, &inventory, &policy, 35)).len(),
        26
    );
}

#[test]
fn without_clear_on_recovery_only_informational_faults_clear() {
    let (_, inventory) = h100();
    let uuid = inventory.gpus[3].uuid.clone();
    let mut state = HealthState::new();
    state.apply(&event(&uuid, None, GpuEventKind::Xid(13)));
    state.apply(&event(&uuid, None, GpuEventKind::DoubleBitEcc));
    state.apply(&event(&uuid, None, GpuEventKind::Recovered));
    let keep = HealthPolicy {
        clear_on_recovery: false,
        ..Default::default()
    };
    let node = tainted(&state, &inventory, &keep, 35);
    assert_eq!(
        taints(&node, "gpu-3"),
        vec![taint("gpu.dra.dev/ecc", Some("double-bit"), "NoExecute")]
    );
    let target = FaultTarget {
        gpu_uuid: uuid,
        gpu_instance_id: None,
    };
    assert_eq!(
        state.current_faults(&keep),
        vec![(target, Fault::DoubleBitEcc)]
    );

    // The policy is read when taints are computed: switching it on clears what already recovered.
    let node = tainted(&state, &inventory, &HealthPolicy::default(), 35);
    assert!(tainted_devices(&node).is_empty());
}

#[test]
fn taints_stay_within_the_servers_limit_keeping_the_most_severe() {
    let (_, inventory) = h100();
    let mut state = HealthState::new();
    let uuid = inventory.gpus[0].uuid.clone();
    for kind in [
        GpuEventKind::DoubleBitEcc,
        GpuEventKind::RetirementPending,
        GpuEventKind::Xid(13),
    ] {
        state.apply(&event(&uuid, None, kind));
    }
    let foreign = |key: &str, effect: &str| DeviceTaint {
        key: key.to_string(),
        value: None,
        effect: effect.to_string(),
        time_added: None,
    };
    let node_with_foreign = || {
        let mut node = node_devices(&inventory, MigMode::Dynamic);
        node.gpus[0].devices[0].taints = Some(vec![
            foreign("example.com/a", "NoSchedule"),
            foreign("example.com/b", "None"),
            foreign("example.com/c", "NoExecute"),
        ]);
        node
    };
    let policy = HealthPolicy::default();

    let mut node = node_with_foreign();
    state.taint(&mut node, &inventory, DRIVER, &policy, 34);
    assert_eq!(
        taints(&node, "gpu-0"),
        vec![
            taint("example.com/c", None, "NoExecute"),
            taint("gpu.dra.dev/ecc", Some("double-bit"), "NoExecute"),
            taint("example.com/a", None, "NoSchedule"),
            taint(
                "gpu.dra.dev/memory",
                Some("retirement-pending"),
                "NoSchedule"
            ),
        ]
    );

    let mut node = node_with_foreign();
    state.taint(&mut node, &inventory, DRIVER, &policy, 35);
    assert_eq!(taints(&node, "gpu-0").len(), 6);
    // Tainting again replaces the driver's own taints instead of adding to them.
    state.taint(&mut node, &inventory, DRIVER, &policy, 35);
    assert_eq!(taints(&node, "gpu-0").len(), 6);
    state.apply(&event(&uuid, None, GpuEventKind::Recovered));
    state.taint(&mut node, &inventory, DRIVER, &policy, 35);
    let keys: Vec<String> = taints(&node, "gpu-0").into_iter().map(|t| t.0).collect();
    assert_eq!(
        keys,
        vec!["example.com/c", "example.com/a", "example.com/b"]
    );
}

#[test]
fn health_messages_stay_within_the_kubelet_limit() {
    let (_, inventory) = h100();
    let mut state = HealthState::new();
    for xid in 1000..1200 {
        state.apply(&event(
            &inventory.gpus[0].uuid,
            None,
            GpuEventKind::Xid(xid),
        ));
    }
    let node = node_devices(&inventory, MigMode::None);
    let reports = state.device_health(&node, &inventory, &HealthPolicy::default());
    assert_eq!(reports.len(), 8);
    assert!(!reports[0].healthy);
    assert!(reports[0].message.len() <= taints::MAX_MESSAGE_LEN);
    assert!(reports[0]
        .message
        .starts_with("XID 1199: unknown XID; XID 1198"));
    assert!(reports[0].message.ends_with("..."));
}

#[test]
fn faults_of_vanished_mig_devices_are_forgotten() {
    let (backend, inventory) = h100();
    let made = create_3g(&backend, &inventory, 5);
    let uuid = inventory.gpus[5].uuid.clone();
    let mut state = HealthState::new();
    state.apply(&event(
        &uuid,
        Some(made.gpu_instance_id),
        GpuEventKind::Xid(94),
    ));
    state.apply(&event(&uuid, None, GpuEventKind::Xid(74)));
    assert!(!state.forget_vanished_mig_devices(&backend.inventory().unwrap()));
    backend
        .destroy_mig(&uuid, made.gpu_instance_id, &made.uuid)
        .unwrap();
    assert!(state.forget_vanished_mig_devices(&backend.inventory().unwrap()));
    let target = FaultTarget {
        gpu_uuid: uuid,
        gpu_instance_id: None,
    };
    assert_eq!(
        state.current_faults(&HealthPolicy::default()),
        vec![(target, Fault::Xid(74))]
    );
}
