//! Unit tests of the NVML backend's pure helpers, kept apart so that the helpers read in one sitting;
//! they run without a GPU or an NVML library.

use super::*;

#[test]
fn bus_ids_take_sysfs_form() {
    assert_eq!(sysfs_bus_id(0, 0x18, 0), "0000:18:00.0");
    assert_eq!(sysfs_bus_id(0, 0x3B, 0x1f), "0000:3b:1f.0");
    // VMD domains are wider than 16 bits and keep all their digits, as in sysfs.
    assert_eq!(sysfs_bus_id(0x10000, 1, 0), "10000:01:00.0");
}

#[test]
fn pcie_root_is_the_root_complex_directory() {
    let p = Path::new("/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0");
    assert_eq!(pcie_root_of(p).as_deref(), Some("pci0000:17"));
    let vmd = Path::new("/sys/devices/pci0000:00/0000:00:0e.0/pci10000:e0/10000:e1:00.0");
    assert_eq!(pcie_root_of(vmd).as_deref(), Some("pci0000:00"));
    assert_eq!(pcie_root_of(Path::new("/sys/devices/platform/x")), None);
}

#[test]
fn numa_nodes_drop_the_no_affinity_value() {
    assert_eq!(parse_numa_node("1\n"), Some(1));
    assert_eq!(parse_numa_node("-1\n"), None);
    assert_eq!(parse_numa_node(""), None);
    assert_eq!(numa_from_nvml(0), Some(0));
    assert_eq!(numa_from_nvml(u32::MAX), None);
}

#[test]
fn fabric_info_needs_completed_success_and_a_cluster() {
    let uuid = [
        0x0b, 0x5c, 0x7f, 0x1e, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0x01,
    ];
    let info = fabric_info(3, 0, uuid, 7).unwrap();
    assert_eq!(info.cluster_uuid, "0b5c7f1e-0000-4000-8000-000000000001");
    assert_eq!(info.domain(), "0b5c7f1e-0000-4000-8000-000000000001.7");
    assert_eq!(fabric_info(2, 0, uuid, 7), None, "in progress");
    assert_eq!(fabric_info(3, 10, uuid, 7), None, "completed with an error");
    assert_eq!(fabric_info(3, 0, [0; 16], 7), None, "no cluster");
    assert_eq!(fabric_state_name(1), "NOT_STARTED");
}

#[test]
fn events_map_to_health_kinds() {
    assert_eq!(
        event_kind(event_bits::XID_CRITICAL, 79),
        GpuEventKind::Xid(79)
    );
    assert_eq!(
        event_kind(event_bits::SINGLE_BIT_ECC, 0),
        GpuEventKind::SingleBitEcc
    );
    assert_eq!(
        event_kind(event_bits::DOUBLE_BIT_ECC, 0),
        GpuEventKind::DoubleBitEcc
    );
    assert_eq!(
        event_kind(event_bits::MIG_CONFIG_CHANGE, 0),
        GpuEventKind::MigConfigChange
    );
    assert_eq!(event_kind(event_bits::PSTATE, 0), GpuEventKind::Other(4));
    assert_eq!(instance_id(0xFFFF_FFFF), None);
    assert_eq!(instance_id(3), Some(3));
    assert_eq!(
        event_type_names(event_bits::HEALTH | 0x4000),
        [
            "SINGLE_BIT_ECC_ERROR",
            "DOUBLE_BIT_ECC_ERROR",
            "CRITICAL_XID_ERROR",
            "MIG_CONFIG_CHANGE",
            "0x4000"
        ]
    );
}

#[test]
fn architectures_and_reset_free_mig() {
    assert_eq!(architecture_name(7), "Ampere");
    assert_eq!(architecture_name(8), "Ada Lovelace");
    assert_eq!(architecture_name(9), "Hopper");
    assert_eq!(architecture_name(10), "Blackwell");
    assert!(!toggles_without_reset(7), "Ampere needs a reset");
    assert!(toggles_without_reset(9));
    assert!(toggles_without_reset(11), "newer than these bindings");
    assert!(!toggles_without_reset(0xFFFF_FFFF), "unknown architecture");
    assert_eq!(brand_name(&Brand::Nvidia), "Nvidia");
    assert_eq!(cuda_version(12040), "12.4");
    assert_eq!(cuda_version(13000), "13.0");
}

// Memory sizes (MiB) and totals as nvidia-smi reports them; names from `nvidia-smi mig -lgip`.
const H100_TOTAL: u64 = 81559 << 20;
const H200_TOTAL: u64 = 143771 << 20;
const A100_40_TOTAL: u64 = 40960 << 20;

#[test]
fn derived_profile_names_match_nvidia() {
    assert_eq!(profile_name(None, 0, 1, 9984, H100_TOTAL), "1g.10gb");
    assert_eq!(profile_name(None, 7, 1, 9984, H100_TOTAL), "1g.10gb+me");
    assert_eq!(profile_name(None, 9, 1, 20096, H100_TOTAL), "1g.20gb");
    assert_eq!(profile_name(None, 2, 3, 40448, H100_TOTAL), "3g.40gb");
    assert_eq!(profile_name(None, 4, 7, 81152, H100_TOTAL), "7g.80gb");
    assert_eq!(profile_name(None, 0, 1, 16384, H200_TOTAL), "1g.18gb");
    assert_eq!(profile_name(None, 2, 3, 68096, H200_TOTAL), "3g.71gb");
    assert_eq!(profile_name(None, 4, 7, 133632, H200_TOTAL), "7g.141gb");
    assert_eq!(profile_name(None, 0, 1, 4864, A100_40_TOTAL), "1g.5gb");
    assert_eq!(profile_name(None, 13, 1, 4864, A100_40_TOTAL), "1g.5gb-me");
    assert_eq!(
        profile_name(None, 15, 1, 4864, A100_40_TOTAL),
        "1g.5gb+me.all"
    );
    assert_eq!(profile_name(None, 10, 1, 4864, A100_40_TOTAL), "1g.5gb+gfx");
}

#[test]
fn nvml_profile_names_win_without_their_prefix() {
    assert_eq!(
        profile_name(Some("MIG 1g.12gb"), 0, 1, 9984, H100_TOTAL),
        "1g.12gb"
    );
    assert_eq!(
        profile_name(Some("1g.10gb+me"), 7, 1, 9984, H100_TOTAL),
        "1g.10gb+me"
    );
    assert_eq!(profile_name(Some(""), 0, 1, 9984, H100_TOTAL), "1g.10gb");
    let chars: Vec<std::ffi::c_char> = b"MIG 2g.20gb\0junk"
        .iter()
        .map(|b| *b as std::ffi::c_char)
        .collect();
    assert_eq!(c_chars_to_string(&chars), "MIG 2g.20gb");
}

fn raw(
    index: u32,
    id: u32,
    slices: u32,
    mib: u64,
    placements: Result<Vec<MigPlacement>, NvmlError>,
) -> RawProfile {
    RawProfile {
        index,
        info: ProfileInfo {
            copy_engine_count: slices,
            decoder_count: 1,
            encoder_count: 0,
            id,
            instance_count: 7 / slices,
            is_p2p_supported: false,
            jpeg_count: 1,
            memory_size_mb: mib,
            multiprocessor_count: 16 * slices,
            ofa_count: 0,
            slice_count: slices,
        },
        nvml_name: None,
        placements,
    }
}

#[test]
fn mig_geometry_follows_the_profiles() {
    let ps = |starts: &[u32], size| {
        Ok(starts
            .iter()
            .map(|&start| MigPlacement { start, size })
            .collect())
    };
    let profiles = [
        raw(0, 19, 1, 9984, ps(&[0, 1, 2, 3, 4, 5, 6], 1)),
        raw(4, 0, 7, 81152, ps(&[0], 8)),
        raw(4, 0, 7, 81152, ps(&[0], 8)),
    ];
    let info = mig_info(
        true,
        true,
        &profiles,
        H100_TOTAL,
        "NVIDIA H100 80GB HBM3",
        vec![],
    )
    .unwrap();
    assert_eq!((info.memory_slices, info.compute_slices), (8, 7));
    assert_eq!(info.profiles.len(), 2, "duplicate ids collapse");
    assert_eq!(info.profile(0).unwrap().name, "7g.80gb");
    assert_eq!(info.profile(19).unwrap().placements.len(), 7);
}

#[test]
fn profiles_without_placements_fall_back_to_the_model_table_or_are_dropped() {
    let profiles = [
        raw(0, 19, 1, 9984, Err(NvmlError::NotSupported)),
        raw(1, 99, 2, 20096, Ok(vec![])),
    ];
    let info = mig_info(
        false,
        true,
        &profiles,
        H100_TOTAL,
        "NVIDIA H100 80GB HBM3",
        vec![],
    )
    .unwrap();
    assert_eq!(info.profiles.len(), 1);
    assert_eq!(info.profiles[0].placements.len(), 7, "from the H100 table");
    let unknown = mig_info(false, true, &profiles, H100_TOTAL, "NVIDIA B200", vec![]).unwrap();
    assert!(unknown.profiles.is_empty());
    assert_eq!((unknown.memory_slices, unknown.compute_slices), (8, 7));
    // A driver that lists nothing while MIG mode is off: the whole model table.
    let h200 = mig_info(false, true, &[], H200_TOTAL, "NVIDIA H200", vec![]).unwrap();
    assert_eq!(h200.profile(0).map(|p| p.name.as_str()), Some("7g.141gb"));
    // With MIG mode on, NVML is the truth: no invented profiles, and none at all is an error
    // (NVIDIA's mock NVML: MIG mode on, every profile NOT_SUPPORTED) rather than a GPU that
    // silently publishes nothing.
    let err = mig_info(true, true, &[], H200_TOTAL, "NVIDIA H200", vec![]).unwrap_err();
    assert!(
        err.contains("MIG mode is on") && err.contains("lists no GPU-instance profile"),
        "{err}"
    );
    let err = mig_info(
        true,
        true,
        &profiles[1..],
        H100_TOTAL,
        "NVIDIA B200",
        vec![],
    )
    .unwrap_err();
    assert!(
        err.contains("no placements for any of its 1") && err.contains("NVIDIA B200"),
        "{err}"
    );
}

#[test]
fn nvml_failures_of_an_operation_on_a_gpu_name_the_gpu_and_the_call() {
    let failed = GpuError::Nvml {
        call: "nvmlDeviceCreateGpuInstanceWithPlacement".into(),
        reason: return_code_text(3),
    };
    let text = on_gpu("GPU-01000100-0000", failed).to_string();
    assert!(
        text.starts_with(
            "GPU GPU-01000100-0000: NVML nvmlDeviceCreateGpuInstanceWithPlacement failed"
        ) && text.contains("NVML_ERROR_NOT_SUPPORTED"),
        "{text}"
    );
    // Errors that name their GPU already are left as they are.
    let in_use = GpuError::MigInUse {
        gpu: "GPU-1".into(),
        uuid: "MIG-2".into(),
    };
    assert_eq!(
        on_gpu("GPU-1", in_use).to_string(),
        GpuError::MigInUse {
            gpu: "GPU-1".into(),
            uuid: "MIG-2".into()
        }
        .to_string()
    );
}

#[test]
fn errors_read_plainly() {
    assert!(return_code_text(23).contains("INSUFFICIENT_RESOURCES"));
    assert!(describe_nvml_error(&NvmlError::UnexpectedVariant(29)).contains("INVALID_STATE"));
    let reason = unavailable_reason(&NvmlError::DriverNotLoaded, "libnvidia-ml.so.1");
    assert!(
        reason.contains("--backend fake") && reason.contains("NVIDIA driver is not loaded"),
        "{reason}"
    );
    assert_eq!(struct_version(40, 3), 0x0300_0028);
}

#[test]
fn addressing_modes_take_nvidias_names() {
    assert_eq!(addressing_mode_name(0), Some("None"));
    assert_eq!(addressing_mode_name(1), Some("HMM"));
    assert_eq!(addressing_mode_name(2), Some("ATS"));
    assert_eq!(addressing_mode_name(3), None);
}

/// The NVML library of a containerized driver on a Grace host (GH200, GB200) is found under
/// `/usr/lib/aarch64-linux-gnu` (or `/lib/aarch64-linux-gnu`), never another architecture's, which could
/// not be loaded; on an x86-64 host the reverse.
#[test]
fn nvml_is_looked_for_in_the_hosts_own_multiarch_directories() {
    let root = Path::new("/run/nvidia/driver");
    let of = |arch| -> Vec<String> {
        library_candidates_of(root, Some(arch))
            .iter()
            .map(|p| p.strip_prefix(root).unwrap().display().to_string())
            .collect()
    };
    assert_eq!(
        of(HostArch::AARCH64),
        [
            "usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
            "usr/lib64/libnvidia-ml.so.1",
            "usr/lib/libnvidia-ml.so.1",
            "lib/aarch64-linux-gnu/libnvidia-ml.so.1",
            "lib64/libnvidia-ml.so.1",
        ]
    );
    assert_eq!(
        of(HostArch::X86_64)[0],
        "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    );
    assert!(!of(HostArch::X86_64).iter().any(|p| p.contains("aarch64")));
    assert_eq!(
        library_candidates(root),
        library_candidates_of(root, HostArch::NATIVE)
    );
}
