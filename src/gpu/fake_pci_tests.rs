//! The fake `/sys` against the kernel's rules, and the bind mechanics of `pci.rs` through it.

use super::*;
use crate::gpu::builtin_profile;

fn l40s() -> (FakeSys, PciSysfs) {
    let sys = FakeSys::beside(None).unwrap();
    let pci = sys.sync(&builtin_profile("l40s-4").unwrap()).unwrap();
    (sys, pci)
}

fn os_error(error: &crate::gpu::pci::PciError) -> Option<i32> {
    match error {
        crate::gpu::pci::PciError::Io { source, .. } => source.raw_os_error(),
        _ => None,
    }
}

#[test]
fn gpus_audio_functions_and_a_shared_group_are_on_the_bus() {
    let (_sys, pci) = l40s();
    let gpus = pci.nvidia_gpus().unwrap();
    let seen: Vec<_> = gpus
        .iter()
        .map(|g| (g.address.as_str(), g.driver.as_deref(), g.iommu_group))
        .collect();
    // Audio functions (class 0x0403) are not GPUs.
    assert_eq!(
        seen,
        [
            ("0000:01:00.0", Some("nvidia"), Some(10)),
            ("0000:41:00.0", Some("nvidia"), Some(11)),
            ("0000:81:00.0", Some("nvidia"), Some(12)),
            ("0000:c1:00.0", Some("nvidia"), Some(12)),
        ]
    );
    let group = pci.group_functions(12).unwrap();
    let addresses: Vec<_> = group.iter().map(|f| f.address.as_str()).collect();
    assert_eq!(
        addresses,
        [
            "0000:81:00.0",
            "0000:81:00.1",
            "0000:c1:00.0",
            "0000:c1:00.1"
        ]
    );
    assert_eq!(group[1].driver.as_deref(), Some("snd_hda_intel"));
}

#[test]
fn bind_to_vfio_pci_and_restore_move_the_driver_link() {
    let (_sys, pci) = l40s();
    pci.bind("0000:41:00.1", VFIO_PCI).unwrap();
    pci.bind("0000:41:00.0", VFIO_PCI).unwrap();
    assert_eq!(
        pci.driver("0000:41:00.0").unwrap().as_deref(),
        Some(VFIO_PCI)
    );
    assert_eq!(
        pci.driver("0000:41:00.1").unwrap().as_deref(),
        Some(VFIO_PCI)
    );
    // Again: nothing to do.
    pci.bind("0000:41:00.0", VFIO_PCI).unwrap();

    pci.restore("0000:41:00.0", Some("nvidia")).unwrap();
    pci.restore("0000:41:00.1", Some("snd_hda_intel")).unwrap();
    assert_eq!(
        pci.driver("0000:41:00.0").unwrap().as_deref(),
        Some("nvidia")
    );
    assert_eq!(
        pci.driver("0000:41:00.1").unwrap().as_deref(),
        Some("snd_hda_intel")
    );
    let override_text = std::fs::read_to_string(
        pci.root()
            .join("bus/pci/devices/0000:41:00.0/driver_override"),
    )
    .unwrap();
    assert_eq!(override_text, "(null)\n");
}

#[test]
fn the_kernel_double_refuses_what_linux_refuses() {
    let (sys, pci) = l40s();
    let root = pci.root().to_path_buf();
    let kernel = &sys.kernel;
    let write = |path: &str, value: &str| {
        kernel
            .write(&root.join(path), value)
            .map_err(|e| e.raw_os_error())
    };
    let enodev = Some(Errno::ENODEV as i32);
    let ebusy = Some(Errno::EBUSY as i32);
    // vfio-pci has no id table: it binds only a function whose override names it.
    write("bus/pci/drivers/nvidia/unbind", "0000:01:00.0").unwrap();
    assert_eq!(
        write("bus/pci/drivers/vfio-pci/bind", "0000:01:00.0"),
        Err(enodev)
    );
    // Unbinding from a driver the function is not bound to.
    assert_eq!(
        write("bus/pci/drivers/nvidia/unbind", "0000:01:00.0"),
        Err(enodev)
    );
    // An override makes every other driver miss, its own id table included.
    write("bus/pci/devices/0000:01:00.0/driver_override", "vfio-pci").unwrap();
    assert_eq!(
        write("bus/pci/drivers/nvidia/bind", "0000:01:00.0"),
        Err(enodev)
    );
    write("bus/pci/drivers/vfio-pci/bind", "0000:01:00.0").unwrap();
    // Binding a function that has a driver.
    assert_eq!(
        write("bus/pci/drivers/vfio-pci/bind", "0000:01:00.0"),
        Err(ebusy)
    );
    // An unknown function, a read-only attribute, a page-long override.
    assert_eq!(write("bus/pci/drivers_probe", "0000:ff:00.0"), Err(enodev));
    assert_eq!(
        write("bus/pci/devices/0000:01:00.0/vendor", "0x1234"),
        Err(Some(Errno::EACCES as i32))
    );
    assert_eq!(
        write(
            "bus/pci/devices/0000:41:00.0/driver_override",
            &"x".repeat(4096)
        ),
        Err(Some(Errno::EINVAL as i32))
    );
    // A probe of an unbound function without a matching driver succeeds and binds nothing.
    write(
        "bus/pci/devices/0000:41:00.1/driver_override",
        "no-such-driver",
    )
    .unwrap();
    write("bus/pci/drivers/snd_hda_intel/unbind", "0000:41:00.1").unwrap();
    write("bus/pci/drivers_probe", "0000:41:00.1").unwrap();
    assert_eq!(pci.driver("0000:41:00.1").unwrap(), None);
}

#[test]
fn a_function_in_use_cannot_be_unbound_and_stays_with_its_driver() {
    let sys = FakeSys::beside(None).unwrap();
    let mut profile = builtin_profile("l40s-4").unwrap();
    profile.pci.in_use = vec!["0000:c1:00.0".into()];
    let pci = sys.sync(&profile).unwrap();
    let error = pci.bind("0000:c1:00.0", VFIO_PCI).unwrap_err();
    assert_eq!(os_error(&error), Some(Errno::EBUSY as i32), "{error}");
    assert!(
        error.to_string().contains("unbinding it from nvidia"),
        "{error}"
    );
    assert_eq!(
        pci.driver("0000:c1:00.0").unwrap().as_deref(),
        Some("nvidia")
    );
    // Released by the process: it moves.
    profile.pci.in_use.clear();
    let pci = sys.sync(&profile).unwrap();
    pci.bind("0000:c1:00.0", VFIO_PCI).unwrap();
}

#[test]
fn a_bind_whose_probe_finds_no_driver_says_so() {
    let (sys, pci) = l40s();
    std::fs::remove_dir_all(pci.root().join("bus/pci/drivers/vfio-pci")).unwrap();
    let error = pci.bind("0000:01:00.0", VFIO_PCI).unwrap_err();
    assert!(
        error.to_string().contains("is the vfio-pci module loaded?"),
        "{error}"
    );
    drop(sys);
}

#[test]
fn bindings_outlive_a_restart_beside_the_state_file() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("fake-gpu-state.json");
    let profile = builtin_profile("l40s-4").unwrap();
    let pci = FakeSys::beside(Some(&state))
        .unwrap()
        .sync(&profile)
        .unwrap();
    pci.bind("0000:01:00.0", VFIO_PCI).unwrap();
    let again = FakeSys::beside(Some(&state))
        .unwrap()
        .sync(&profile)
        .unwrap();
    assert_eq!(
        again.driver("0000:01:00.0").unwrap().as_deref(),
        Some(VFIO_PCI)
    );
    assert!(dir
        .path()
        .join("fake-gpu-state.sys/bus/pci/drivers_probe")
        .exists());
}
