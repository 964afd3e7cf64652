//! Tests of the fake backend's newer models: unreadable GPUs, several compute instances per GPU
//! instance, and the MIG safety rules (adoption, destroy checked by UUID, a device in use, MIG mode
//! that cannot be switched off, slow operations serialised per GPU).

mod unreadable_tests {
    use std::collections::BTreeSet;

    use crate::gpu::fake::FakeBackend;
    use crate::gpu::{builtin_profile, ComputeShare, GpuBackend, MigInstance};

    #[test]
    fn an_unreadable_gpu_is_reported_apart_and_comes_back_when_the_profile_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.yaml");
        let mut profile = builtin_profile("dgx-h100").unwrap();
        profile.gpus.truncate(3);
        profile.gpus[1].unreadable = Some("GPU is lost".into());
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let backend = FakeBackend::new("n", path.to_str().unwrap()).unwrap();
        let inventory = backend.inventory().unwrap();
        let minors: Vec<u32> = inventory.gpus.iter().map(|g| g.minor).collect();
        assert_eq!(minors, vec![0, 2]);
        assert_eq!(inventory.unreadable.len(), 1);
        let bad = &inventory.unreadable[0];
        assert_eq!((bad.index, bad.minor), (1, Some(1)));
        assert_eq!(bad.pci_bus_id.as_deref(), Some("0000:2a:00.0"));
        assert_eq!(bad.reason, "GPU is lost");
        // NVLink peers are computed among the readable GPUs only.
        assert!(inventory.gpus[0].nvlink_domain.is_some());

        profile.gpus[1].unreadable = None;
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let inventory = backend.inventory().unwrap();
        assert_eq!(inventory.gpus.len(), 3);
        assert!(inventory.unreadable.is_empty());

        profile.gpus[1].unreadable = Some("  ".into());
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let err = backend.inventory().unwrap_err().to_string();
        assert!(err.contains("gpus[1].unreadable"), "{err}");
    }

    /// NVIDIA's mock NVML, like the HGX and GB200 baseboards it models, reports the remote end of a link
    /// to an NVSwitch as the all-ones "invalid PCI" sentinel, not as another GPU: the fake does the same,
    /// so the inventory's switch path is what every fake node exercises; bridged pairs still name
    /// their peer GPU, and the domains come out as before.
    #[test]
    fn switch_links_name_the_sentinel_peer_as_nvml_does_and_bridges_the_peer_gpu() {
        let switched = FakeBackend::new("n", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        for gpu in &switched.gpus {
            assert_eq!(gpu.nvlink_peers, ["ffffffff:ff:ff.0"], "gpu-{}", gpu.minor);
        }
        let domains: BTreeSet<_> = switched.gpus.iter().map(|g| &g.nvlink_domain).collect();
        assert_eq!(domains.len(), 1, "{domains:?}");
        assert!(domains.iter().all(|d| d.is_some()));

        let bridged = FakeBackend::new("n", "a100-pcie-4")
            .unwrap()
            .inventory()
            .unwrap();
        assert_eq!(
            bridged.gpus[0].nvlink_peers,
            [bridged.gpus[1].pci_bus_id.clone()]
        );
        assert_eq!(bridged.gpus[0].nvlink_domain, bridged.gpus[1].nvlink_domain);
        assert_ne!(bridged.gpus[0].nvlink_domain, bridged.gpus[2].nvlink_domain);
    }

    #[test]
    fn several_compute_instances_are_one_mig_device_each_and_none_is_one_without() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.yaml");
        let mut profile = builtin_profile("dgx-h100").unwrap();
        profile.gpus.truncate(1);
        profile.gpus[0].mig_enabled = true;
        profile.gpus[0].mig_instances = serde_yaml::from_str(
            "[{profile: 3g.40gb, start: 0, computeInstances: [1, 1, 1]}, \
              {profile: 2g.20gb, start: 4, computeInstances: []}, \
              {profile: 1g.10gb, start: 6, computeInstances: [1]}]",
        )
        .unwrap();
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let backend = FakeBackend::new("n", path.to_str().unwrap()).unwrap();
        let mig = backend.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert_eq!(mig.instances.len(), 5, "{:#?}", mig.instances);
        let split: Vec<&MigInstance> = mig
            .instances
            .iter()
            .filter(|i| i.placement.start == 0)
            .collect();
        assert_eq!(split.len(), 3);
        let uuids: BTreeSet<&str> = split.iter().map(|i| i.uuid.as_str()).collect();
        assert_eq!(uuids.len(), 3, "each compute instance has its own UUID");
        assert!(split.iter().all(|i| i.gpu_instance_id == 1));
        assert_eq!(
            split
                .iter()
                .map(|i| i.compute_instance_id)
                .collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(
            split[1].compute,
            Some(ComputeShare {
                slices: 1,
                multiprocessors: 20
            })
        );
        assert_ne!(split[0].device_files, split[1].device_files);
        let empty = mig
            .instances
            .iter()
            .find(|i| i.placement.start == 4)
            .unwrap();
        assert!(!empty.has_compute_instance());
        assert!(empty.uuid.is_empty() && empty.device_files.is_empty());
        // One compute instance spanning the GPU instance is an ordinary MIG device.
        let whole = mig
            .instances
            .iter()
            .find(|i| i.placement.start == 6)
            .unwrap();
        assert_eq!(whole.compute, None);

        profile.gpus[0].mig_instances[0].compute_instances = Some(vec![2, 2]);
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let err = backend.inventory().unwrap_err().to_string();
        assert!(
            err.contains("migInstances[0].computeInstances") && err.contains("4 compute slices"),
            "{err}"
        );
    }
}

mod safety_tests {
    use crate::gpu::fake::FakeBackend;
    use crate::gpu::fake_mig::mig_tests::request;
    use crate::gpu::{
        builtin_profile, FakeProfile, GpuBackend, GpuError, MigDestroyed, MigInstance,
    };

    fn node(
        edit: impl FnOnce(&mut FakeProfile),
    ) -> (tempfile::TempDir, std::path::PathBuf, FakeBackend) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.yaml");
        let mut profile = builtin_profile("dgx-h100").unwrap();
        profile.gpus.truncate(1);
        edit(&mut profile);
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let backend = FakeBackend::new("n", path.to_str().unwrap()).unwrap();
        (dir, path, backend)
    }

    fn instances(backend: &FakeBackend) -> Vec<MigInstance> {
        backend.inventory().unwrap().gpus[0]
            .mig
            .clone()
            .unwrap()
            .instances
    }

    #[test]
    fn a_retry_adopts_the_device_at_its_placement_instead_of_making_a_second() {
        let (_dir, _path, backend) = node(|_| {});
        let wanted = request(&backend, "2g.20gb", 4);
        let made = backend.create_mig(&wanted).unwrap();
        let (again, adopted) = backend.create_or_adopt_mig(&wanted).unwrap();
        assert!(adopted);
        assert_eq!(again, made);
        assert_eq!(instances(&backend), vec![made.clone()]);
        // A plain create still refuses the overlap; another profile there is not adopted.
        assert!(backend.create_mig(&wanted).is_err());
        let other = request(&backend, "1g.10gb", 4);
        let err = backend.create_or_adopt_mig(&other).unwrap_err().to_string();
        assert!(err.contains("overlap"), "{err}");
        // Nothing there: created, not adopted.
        let (fresh, adopted) = backend
            .create_or_adopt_mig(&request(&backend, "1g.10gb", 0))
            .unwrap();
        assert!(!adopted);
        assert_ne!(fresh.uuid, made.uuid);
    }

    #[test]
    fn destroy_leaves_a_gpu_instance_that_now_holds_another_device_alone() {
        let (_dir, _path, backend) = node(|_| {});
        let wanted = request(&backend, "3g.40gb", 0);
        let first = backend.create_mig(&wanted).unwrap();
        let gpu = wanted.parent_uuid.clone();
        backend
            .destroy_mig(&gpu, first.gpu_instance_id, &first.uuid)
            .unwrap();
        let second = backend.create_mig(&wanted).unwrap();
        assert_eq!(
            second.gpu_instance_id, first.gpu_instance_id,
            "ids are reused"
        );
        let outcome = backend
            .destroy_mig(&gpu, first.gpu_instance_id, &first.uuid)
            .unwrap();
        assert_eq!(
            outcome,
            MigDestroyed::Replaced {
                found: second.uuid.clone()
            }
        );
        assert_eq!(instances(&backend), vec![second]);
    }

    #[test]
    fn a_device_in_use_is_not_destroyed_until_its_process_ends() {
        let (_dir, path, backend) = node(|_| {});
        let wanted = request(&backend, "1g.10gb", 6);
        let made = backend.create_mig(&wanted).unwrap();
        let mut profile: FakeProfile =
            serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        profile.gpus[0].mig_in_use = vec![6];
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let err = backend
            .destroy_mig(&wanted.parent_uuid, made.gpu_instance_id, &made.uuid)
            .unwrap_err();
        assert!(matches!(err, GpuError::MigInUse { .. }), "{err}");
        assert!(err.to_string().contains("NVML_ERROR_IN_USE"));
        assert_eq!(instances(&backend), vec![made.clone()]);
        profile.gpus[0].mig_in_use.clear();
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        assert_eq!(
            backend
                .destroy_mig(&wanted.parent_uuid, made.gpu_instance_id, &made.uuid)
                .unwrap(),
            MigDestroyed::Destroyed
        );
    }

    #[test]
    fn mig_mode_that_cannot_be_switched_off_is_reported_and_cleared_by_a_later_success() {
        let (_dir, path, backend) =
            node(|p| p.gpus[0].mig_disable_fails = Some("In use by another client".into()));
        let wanted = request(&backend, "1g.10gb", 6);
        let made = backend.create_mig(&wanted).unwrap();
        backend
            .destroy_mig(&wanted.parent_uuid, made.gpu_instance_id, &made.uuid)
            .unwrap();
        let mig = backend.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert!(mig.enabled && mig.instances.is_empty());
        assert_eq!(
            mig.disable_failed.as_deref(),
            Some("In use by another client")
        );

        let mut profile: FakeProfile =
            serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        profile.gpus[0].mig_disable_fails = None;
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let made = backend.create_mig(&wanted).unwrap();
        backend
            .destroy_mig(&wanted.parent_uuid, made.gpu_instance_id, &made.uuid)
            .unwrap();
        let mig = backend.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert!(!mig.enabled);
        assert_eq!(mig.disable_failed, None);
    }

    /// As NVML answers `nvmlDeviceSetMigMode` (NVIDIA's mock NVML: not supported; a real GPU: in use,
    /// no permission): the create fails naming the GPU, the call and NVML's answer, and leaves the GPU
    /// out of MIG mode with nothing made.
    #[test]
    fn mig_mode_that_cannot_be_switched_on_fails_the_create_naming_the_gpu_and_the_call() {
        let (_dir, path, backend) =
            node(|p| p.gpus[0].mig_enable_fails = Some("Not Supported".into()));
        let wanted = request(&backend, "1g.10gb", 6);
        let err = backend.create_or_adopt_mig(&wanted).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, GpuError::Mig { .. }), "{text}");
        for part in [
            wanted.parent_uuid.as_str(),
            "switching MIG mode on failed",
            "nvmlDeviceSetMigMode",
            "Not Supported",
            "--mig-mode static",
        ] {
            assert!(text.contains(part), "{text:?} lacks {part:?}");
        }
        let mig = backend.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert!(!mig.enabled && mig.instances.is_empty(), "{mig:?}");

        // With MIG mode already on (an admin switched it on), there is nothing to switch.
        let mut profile: FakeProfile =
            serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        profile.gpus[0].mig_enabled = true;
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        backend.create_mig(&wanted).unwrap();
    }

    /// With slow steps, a destroy of a GPU's last MIG device and creates on that GPU interleave unless
    /// the GPU's MIG lock serialises them: the destroy would switch MIG mode off under the creates.
    #[test]
    fn slow_creates_and_a_destroy_on_one_gpu_do_not_trip_over_each_other() {
        let (_dir, _path, backend) = node(|p| p.mig_operation_delay_ms = Some(60));
        let backend = std::sync::Arc::new(backend);
        let last = backend
            .create_mig(&request(&backend, "1g.10gb", 0))
            .unwrap();
        let gpu = request(&backend, "1g.10gb", 0).parent_uuid;
        let mut threads = Vec::new();
        {
            let (backend, gpu, last) = (backend.clone(), gpu.clone(), last.clone());
            threads.push(std::thread::spawn(move || {
                backend
                    .destroy_mig(&gpu, last.gpu_instance_id, &last.uuid)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }));
        }
        for start in [4, 5, 6] {
            let backend = backend.clone();
            let wanted = request(&backend, "1g.10gb", start);
            threads.push(std::thread::spawn(move || {
                backend
                    .create_mig(&wanted)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }));
        }
        for thread in threads {
            thread.join().unwrap().unwrap();
        }
        let left = instances(&backend);
        let starts: Vec<u32> = left.iter().map(|i| i.placement.start).collect();
        assert_eq!(starts, vec![4, 5, 6]);
        assert!(
            backend.inventory().unwrap().gpus[0]
                .mig
                .clone()
                .unwrap()
                .enabled
        );
    }

    /// `migHangs` makes a create and a destroy take effect and then not return until it is removed;
    /// other MIG operations on that GPU wait behind it, and the GPU can be read meanwhile.
    #[test]
    fn the_mig_hangs_knob_holds_creates_and_destroys_until_it_is_removed() {
        let (_dir, path, backend) = node(|p| p.gpus[0].mig_hangs = true);
        let backend = std::sync::Arc::new(backend);
        let set_hangs = |hangs: bool| {
            let mut profile: FakeProfile =
                serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            profile.gpus[0].mig_hangs = hangs;
            std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        };
        let hung = {
            let (backend, wanted) = (backend.clone(), request(&backend, "1g.10gb", 0));
            std::thread::spawn(move || backend.create_mig(&wanted))
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while instances(&backend).is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "the create took no effect"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!hung.is_finished(), "the create hangs");
        let waiting = {
            let (backend, wanted) = (backend.clone(), request(&backend, "1g.10gb", 1));
            std::thread::spawn(move || backend.create_mig(&wanted).map(|_| ()))
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!waiting.is_finished(), "the next create waits for the GPU");

        set_hangs(false);
        let made = hung.join().unwrap().unwrap();
        waiting.join().unwrap().unwrap();
        assert_eq!(instances(&backend).len(), 2);

        set_hangs(true);
        let gpu = request(&backend, "1g.10gb", 0).parent_uuid;
        let destroying = {
            let (backend, made) = (backend.clone(), made.clone());
            std::thread::spawn(move || {
                backend
                    .destroy_mig(&gpu, made.gpu_instance_id, &made.uuid)
                    .map_err(|e| e.to_string())
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!destroying.is_finished(), "the destroy hangs");
        assert_eq!(instances(&backend).len(), 1, "it took effect");
        set_hangs(false);
        assert_eq!(destroying.join().unwrap(), Ok(MigDestroyed::Destroyed));
    }
}

mod device_file_tests {
    use std::path::Path;

    use crate::gpu::fake::FakeBackend;
    use crate::gpu::fake_mig::mig_tests::request;
    use crate::gpu::GpuBackend;

    /// A fake MIG device's capability files are where a real node's are: numbered from the driver's
    /// MIG table (135 minors per GPU, 9 per GPU instance), at paths that exist on no host, so a runtime
    /// that looked for them there would fail as on a real node.
    #[test]
    fn mig_capability_files_are_numbered_as_the_driver_numbers_them_and_exist_on_no_host() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("fake-gpu-state.json");
        let backend = FakeBackend::with_state_file("n", "dgx-h100", Some(state)).unwrap();
        let mut on_gpu_1 = request(&backend, "1g.10gb", 6);
        on_gpu_1.parent_uuid = backend.inventory().unwrap().gpus[1].uuid.clone();
        let made = backend.create_mig(&on_gpu_1).unwrap();
        // GPU instance 7 of GPU 1: `gpu1/gi7/access 201`, `gpu1/gi7/ci0/access 202`.
        assert_eq!(made.gpu_instance_id, 7);
        assert_eq!(
            made.device_files,
            [
                "/dev/nvidia-caps/nvidia-cap201",
                "/dev/nvidia-caps/nvidia-cap202"
            ]
        );
        assert!(made.device_files.iter().all(|f| !Path::new(f).exists()));
    }
}

mod reboot_tests {
    use crate::gpu::fake::FakeBackend;
    use crate::gpu::fake_mig::mig_tests::request;
    use crate::gpu::{GpuBackend, GpuSharingMode};

    /// A node reboot (the state file written in another boot) loses the MIG devices made at run time
    /// and the sharing modes, as real GPUs lose them, and keeps MIG mode; a restart in the same boot
    /// keeps them all.
    #[test]
    fn state_of_an_earlier_boot_loses_mig_devices_and_sharing_but_not_mig_mode() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("fake-gpu-state.json");
        let backend = FakeBackend::with_state_file("n", "dgx-h100", Some(state.clone())).unwrap();
        let gpus = backend.inventory().unwrap().gpus;
        let made = backend
            .create_mig(&request(&backend, "1g.10gb", 6))
            .unwrap();
        backend
            .set_sharing(&gpus[2].uuid, &GpuSharingMode::ExclusiveProcess)
            .unwrap();
        drop(backend);

        let restarted = FakeBackend::with_state_file("n", "dgx-h100", Some(state.clone())).unwrap();
        let mig_uuids = |b: &FakeBackend| -> Vec<String> {
            b.inventory().unwrap().gpus[0]
                .mig
                .as_ref()
                .unwrap()
                .instances
                .iter()
                .map(|i| i.uuid.clone())
                .collect()
        };
        assert!(mig_uuids(&restarted).contains(&made.uuid));
        assert_eq!(
            restarted.sharing(&gpus[2].uuid).unwrap(),
            GpuSharingMode::ExclusiveProcess
        );
        drop(restarted);

        let mut written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
        assert_eq!(written["bootId"], crate::boot::current_boot_id());
        written["bootId"] = "an-earlier-boot".into();
        std::fs::write(&state, serde_json::to_vec(&written).unwrap()).unwrap();

        let rebooted = FakeBackend::with_state_file("n", "dgx-h100", Some(state.clone())).unwrap();
        assert!(!mig_uuids(&rebooted).contains(&made.uuid));
        assert_eq!(
            rebooted.sharing(&gpus[2].uuid).unwrap(),
            GpuSharingMode::Default
        );
        let gpu0 = rebooted.inventory().unwrap().gpus[0].clone();
        assert!(gpu0.mig.unwrap().enabled, "MIG mode survives a reboot");
        let rewritten: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
        assert_eq!(rewritten["bootId"], crate::boot::current_boot_id());
    }
}
