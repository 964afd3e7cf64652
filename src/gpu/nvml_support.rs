//! Pure helpers of the NVML backend: turning NVML's numbers, codes and C strings into the driver's
//! vocabulary (bus ids, architecture and brand words, MIG profile names, fabric domains, events).
//! Nothing here calls NVML or touches memory it does not own, so all of it is unit-tested.

use std::path::{Path, PathBuf};

use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProfileInfo;

use super::mig::{builtin_profiles_for, MigInfo, MigInstance, MigPlacement, MigProfile};
use super::nvlink::FabricInfo;
use super::{GpuError, GpuEventKind, HostArch};

/// NVML's `nvmlGpuFabricState_t` value for a GPU whose fabric registration finished.
pub const FABRIC_STATE_COMPLETED: u8 = 3;
/// What NVML puts in an event's GPU / compute instance id when the event concerns the whole GPU.
pub const NO_INSTANCE: u32 = 0xFFFF_FFFF;
/// NVML's versioned-struct tag: the struct size in the low bits, the version in the top byte.
/// NVIDIA's name for a memory addressing mode (`NVML_DEVICE_ADDRESSING_MODE_*`), as its DRA driver
/// publishes it; `None` for a value this table does not know.
pub fn addressing_mode_name(raw: u32) -> Option<&'static str> {
    match raw {
        0 => Some("None"),
        1 => Some("HMM"),
        2 => Some("ATS"),
        _ => None,
    }
}

pub const fn struct_version(size: usize, version: u32) -> u32 {
    size as u32 | (version << 24)
}

/// NVML event type bits (`nvmlEventType*`), as `nvml.h` defines them.
pub mod event_bits {
    pub const SINGLE_BIT_ECC: u64 = 0x1;
    pub const DOUBLE_BIT_ECC: u64 = 0x2;
    pub const PSTATE: u64 = 0x4;
    pub const XID_CRITICAL: u64 = 0x8;
    pub const CLOCK: u64 = 0x10;
    pub const POWER_SOURCE: u64 = 0x80;
    pub const MIG_CONFIG_CHANGE: u64 = 0x100;
    /// The events the health monitor listens to, where the GPU supports them.
    pub const HEALTH: u64 = XID_CRITICAL | DOUBLE_BIT_ECC | SINGLE_BIT_ECC | MIG_CONFIG_CHANGE;
}

/// A PCI address in sysfs form (`0000:18:00.0`): lowercase, at least four domain digits (more for
/// the 32-bit domains of VMD controllers, as sysfs writes them). NVML always reports function 0.
pub fn sysfs_bus_id(domain: u32, bus: u32, device: u32) -> String {
    format!("{domain:04x}:{bus:02x}:{device:02x}.0")
}

/// The PCIe root complex (`pci0000:17`) from a resolved sysfs device path such as
/// `/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0`.
pub fn pcie_root_of(resolved: &Path) -> Option<String> {
    resolved
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|name| name.starts_with("pci") && name.contains(':'))
        .map(str::to_string)
}

/// A NUMA node from sysfs `numa_node` text; `-1` (no NUMA affinity) and garbage give `None`.
pub fn parse_numa_node(text: &str) -> Option<i64> {
    text.trim().parse::<i64>().ok().filter(|n| *n >= 0)
}

/// NVML's NUMA node id; the C `int` -1 arrives as `u32::MAX`.
pub fn numa_from_nvml(value: u32) -> Option<i64> {
    i32::try_from(value).ok().map(i64::from)
}

/// A 16-byte cluster UUID in the lowercase 8-4-4-4-12 form.
pub fn format_cluster_uuid(bytes: [u8; 16]) -> String {
    uuid::Uuid::from_bytes(bytes).hyphenated().to_string()
}

/// The fabric a GPU joined, only when registration completed successfully with a real cluster UUID:
/// an all-zero UUID would put unrelated nodes' GPUs on one "domain".
pub fn fabric_info(
    state: u8,
    status: u32,
    cluster_uuid: [u8; 16],
    clique_id: u32,
) -> Option<FabricInfo> {
    (state == FABRIC_STATE_COMPLETED && status == 0 && cluster_uuid != [0; 16]).then(|| {
        FabricInfo {
            cluster_uuid: format_cluster_uuid(cluster_uuid),
            clique_id,
        }
    })
}

pub fn fabric_state_name(state: u8) -> &'static str {
    match state {
        0 => "NOT_SUPPORTED",
        1 => "NOT_STARTED",
        2 => "IN_PROGRESS",
        3 => "COMPLETED",
        _ => "UNKNOWN",
    }
}

/// One NVML event as the health monitor sees it. NVML sets exactly one type bit per event.
pub fn event_kind(event_type: u64, event_data: u64) -> GpuEventKind {
    match event_type {
        event_bits::XID_CRITICAL => GpuEventKind::Xid(event_data),
        event_bits::SINGLE_BIT_ECC => GpuEventKind::SingleBitEcc,
        event_bits::DOUBLE_BIT_ECC => GpuEventKind::DoubleBitEcc,
        event_bits::MIG_CONFIG_CHANGE => GpuEventKind::MigConfigChange,
        other => GpuEventKind::Other(other),
    }
}

/// An event's GPU or compute instance id; `None` when it concerns the whole GPU.
pub fn instance_id(raw: u32) -> Option<u32> {
    (raw != NO_INSTANCE).then_some(raw)
}

/// Names of the event type bits set in `bits`, for the probe report.
pub fn event_type_names(bits: u64) -> Vec<String> {
    use event_bits::*;
    let known = [
        (SINGLE_BIT_ECC, "SINGLE_BIT_ECC_ERROR"),
        (DOUBLE_BIT_ECC, "DOUBLE_BIT_ECC_ERROR"),
        (PSTATE, "PSTATE_CHANGE"),
        (XID_CRITICAL, "CRITICAL_XID_ERROR"),
        (CLOCK, "CLOCK_CHANGE"),
        (POWER_SOURCE, "POWER_SOURCE_CHANGE"),
        (MIG_CONFIG_CHANGE, "MIG_CONFIG_CHANGE"),
    ];
    (0..64)
        .map(|bit| 1u64 << bit)
        .filter(|flag| bits & flag != 0)
        .map(|flag| match known.iter().find(|(k, _)| *k == flag) {
            Some((_, name)) => name.to_string(),
            None => format!("0x{flag:x}"),
        })
        .collect()
}

/// The architecture word for NVML's `nvmlDeviceArchitecture_t`.
pub fn architecture_name(code: u32) -> &'static str {
    match code {
        2 => "Kepler",
        3 => "Maxwell",
        4 => "Pascal",
        5 => "Volta",
        6 => "Turing",
        7 => "Ampere",
        8 => "Ada Lovelace",
        9 => "Hopper",
        10 => "Blackwell",
        _ => "Unknown",
    }
}

/// Whether MIG mode switches without a GPU reset: Hopper (9) and every later architecture, including
/// ones newer than these bindings; never for NVML's "unknown" (0xFFFFFFFF).
pub fn toggles_without_reset(code: u32) -> bool {
    (9..NO_INSTANCE).contains(&code)
}

pub fn brand_name(brand: &Brand) -> &'static str {
    match brand {
        Brand::Unknown => "Unknown",
        Brand::Quadro => "Quadro",
        Brand::Tesla => "Tesla",
        Brand::NVS => "NVS",
        Brand::GRID => "GRID",
        Brand::GeForce => "GeForce",
        Brand::Titan => "Titan",
        Brand::VApps => "NvidiaVApps",
        Brand::VPC => "NvidiaVPC",
        Brand::VCS => "NvidiaVCS",
        Brand::VWS => "NvidiaVWS",
        Brand::CloudGaming => "NvidiaCloudGaming",
        Brand::VGaming => "NvidiaVGaming",
        Brand::QuadroRTX => "QuadroRTX",
        Brand::NvidiaRTX => "NvidiaRTX",
        Brand::Nvidia => "Nvidia",
        Brand::GeForceRTX => "GeForceRTX",
        Brand::TitanRTX => "TitanRTX",
    }
}

/// NVML's CUDA driver version integer (`12040`) as `major.minor` (`12.4`).
pub fn cuda_version(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// A NUL-terminated C char array as a Rust string (lossy; stops at the first NUL).
pub fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|c| **c != 0)
        // c_char is i8 on x86-64 and u8 on AArch64: the byte either way, with no cast that lints on one.
        .map(|c| c.to_ne_bytes()[0])
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The GB number of a MIG profile name. NVIDIA rounds the profile's share of the GPU up to whole
/// eighths and scales the GPU's memory in whole GiB by it, so the H200's 16 GiB slice is `18gb`.
pub fn mig_memory_gb(total_memory_bytes: u64, profile_memory_mib: u64) -> u64 {
    const GIB: u64 = 1 << 30;
    if total_memory_bytes == 0 {
        return profile_memory_mib.div_ceil(1024);
    }
    let share = (profile_memory_mib as f64 * (1u64 << 20) as f64) / total_memory_bytes as f64;
    let eighths = (share * 8.0).ceil() / 8.0;
    let total_gib = total_memory_bytes.div_ceil(GIB) as f64;
    (eighths * total_gib).round() as u64
}

/// The name suffix NVIDIA gives the media-engine variants of a GPU-instance profile, by NVML profile
/// index (`NVML_GPU_INSTANCE_PROFILE_*`).
pub fn profile_suffix(profile_index: u32) -> &'static str {
    match profile_index {
        7 | 8 => "+me",       // 1_SLICE_REV1, 2_SLICE_REV1
        10..=12 => "+gfx",    // 1/2/4_SLICE_GFX
        13 | 14 => "-me",     // 1/2_SLICE_NO_ME
        15 | 16 => "+me.all", // 1/2_SLICE_ALL_ME
        _ => "",
    }
}

/// The profile name: NVML's own (`MIG 1g.10gb` → `1g.10gb`) where the driver reports one, else
/// derived as `<slices>g.<GB>gb` plus the media-engine suffix.
pub fn profile_name(
    nvml_name: Option<&str>,
    profile_index: u32,
    slices: u32,
    memory_mib: u64,
    total_memory_bytes: u64,
) -> String {
    let reported = nvml_name
        .map(|n| n.trim())
        .map(|n| n.strip_prefix("MIG ").unwrap_or(n).trim())
        .filter(|n| !n.is_empty());
    match reported {
        Some(name) => name.to_string(),
        None => format!(
            "{slices}g.{}gb{}",
            mig_memory_gb(total_memory_bytes, memory_mib),
            profile_suffix(profile_index)
        ),
    }
}

/// One GPU-instance profile as read from NVML, before it becomes a [`MigProfile`].
#[derive(Debug)]
pub struct RawProfile {
    /// NVML's profile index (`NVML_GPU_INSTANCE_PROFILE_*`), not the profile id.
    pub index: u32,
    pub info: ProfileInfo,
    /// The name from `nvmlDeviceGetGpuInstanceProfileInfoV`, where the driver has it.
    pub nvml_name: Option<String>,
    pub placements: Result<Vec<MigPlacement>, NvmlError>,
}

/// The MIG side of a GPU from its raw profiles. A profile whose placements NVML would not give
/// (older drivers answer NOT_SUPPORTED while MIG mode is off) takes them from the built-in table of
/// its model, matched by id and size; with no such table it is left out, since a profile without
/// placements cannot be offered. With MIG mode off and no profile at all, the model table stands in.
/// With MIG mode on and no usable profile, the GPU's MIG devices can be neither read nor made (the
/// whole GPU is unusable in MIG mode): an error, so that the GPU is reported unreadable instead of
/// silently publishing nothing (NVIDIA's mock NVML lists no profile at all).
pub fn mig_info(
    enabled: bool,
    toggles_without_reset: bool,
    raw: &[RawProfile],
    total_memory_bytes: u64,
    product_name: &str,
    instances: Vec<MigInstance>,
) -> Result<MigInfo, String> {
    let builtin = builtin_profiles_for(product_name).unwrap_or_default();
    let mut profiles: Vec<MigProfile> = Vec::new();
    for p in raw {
        if profiles.iter().any(|known| known.id == p.info.id) {
            continue;
        }
        let placements = match &p.placements {
            Ok(list) if !list.is_empty() => list.clone(),
            _ => match builtin
                .iter()
                .find(|b| b.id == p.info.id && b.compute_slices == p.info.slice_count)
            {
                Some(b) => b.placements.clone(),
                None => continue,
            },
        };
        profiles.push(MigProfile {
            id: p.info.id,
            name: profile_name(
                p.nvml_name.as_deref(),
                p.index,
                p.info.slice_count,
                p.info.memory_size_mb,
                total_memory_bytes,
            ),
            compute_slices: p.info.slice_count,
            memory_mib: p.info.memory_size_mb,
            multiprocessors: p.info.multiprocessor_count,
            copy_engines: p.info.copy_engine_count,
            decoders: p.info.decoder_count,
            encoders: p.info.encoder_count,
            jpeg_engines: p.info.jpeg_count,
            ofa_engines: p.info.ofa_count,
            placements,
        });
    }
    // Older drivers list no profile at all while MIG mode is off.
    if profiles.is_empty() && !enabled {
        profiles = builtin;
    }
    if profiles.is_empty() && enabled {
        let listed = if raw.is_empty() {
            "lists no GPU-instance profile (every profile index answered not supported)".to_string()
        } else {
            format!(
                "gives no placements for any of its {} GPU-instance profiles and {product_name:?} has \
                 no built-in MIG table",
                raw.len()
            )
        };
        return Err(format!(
            "MIG mode is on, but NVML {listed}: the GPU's MIG devices can be neither read nor made, \
             and in MIG mode the whole GPU is unusable; check the driver with `nvidia-smi mig -lgip`"
        ));
    }
    let memory_slices = profiles
        .iter()
        .flat_map(|p| p.placements.iter().map(|pl| pl.start + pl.size))
        .max()
        .unwrap_or(8);
    let compute_slices = profiles.iter().map(|p| p.compute_slices).max().unwrap_or(7);
    Ok(MigInfo {
        enabled,
        toggles_without_reset,
        memory_slices,
        compute_slices,
        profiles,
        instances,
        disable_failed: None,
    })
}

/// The name and meaning of an `nvmlReturn_t`, including codes newer than nvml-wrapper knows.
pub fn return_code_text(code: u32) -> String {
    let (name, text) = match code {
        0 => ("SUCCESS", "success"),
        1 => ("UNINITIALIZED", "NVML was not initialized"),
        2 => ("INVALID_ARGUMENT", "an argument is invalid"),
        3 => ("NOT_SUPPORTED", "not supported on this device"),
        4 => (
            "NO_PERMISSION",
            "no permission (needs root or CAP_SYS_ADMIN)",
        ),
        6 => ("NOT_FOUND", "not found"),
        7 => ("INSUFFICIENT_SIZE", "a buffer is too small"),
        8 => (
            "INSUFFICIENT_POWER",
            "external power cables are not attached",
        ),
        9 => (
            "DRIVER_NOT_LOADED",
            "the NVIDIA kernel driver is not loaded",
        ),
        10 => ("TIMEOUT", "timed out"),
        11 => ("IRQ_ISSUE", "the kernel detected an interrupt issue"),
        12 => ("LIBRARY_NOT_FOUND", "a shared library could not be found"),
        13 => ("FUNCTION_NOT_FOUND", "this libnvidia-ml lacks the function"),
        14 => ("CORRUPTED_INFOROM", "the infoROM is corrupted"),
        15 => ("GPU_IS_LOST", "the GPU fell off the bus"),
        16 => ("RESET_REQUIRED", "the GPU needs a reset"),
        17 => (
            "OPERATING_SYSTEM",
            "blocked by the operating system or cgroups",
        ),
        18 => (
            "LIB_RM_VERSION_MISMATCH",
            "libnvidia-ml and the kernel driver versions differ",
        ),
        19 => ("IN_USE", "the GPU or instance is in use"),
        20 => ("MEMORY", "out of memory"),
        21 => ("NO_DATA", "no data"),
        23 => (
            "INSUFFICIENT_RESOURCES",
            "not enough free resources (slices or engines are taken)",
        ),
        25 => (
            "ARGUMENT_VERSION_MISMATCH",
            "the struct version is not supported by this driver",
        ),
        26 => ("DEPRECATED", "deprecated"),
        27 => ("NOT_READY", "the system is not ready"),
        28 => ("GPU_NOT_FOUND", "no GPU found"),
        29 => ("INVALID_STATE", "not in the right state for this operation"),
        999 => ("UNKNOWN", "an internal driver error occurred"),
        _ => ("?", "unknown NVML return code"),
    };
    format!("{text} (NVML_ERROR_{name}, {code})")
}

/// An NVML error as text, decoding return codes that nvml-wrapper reports as "unexpected variant".
pub fn describe_nvml_error(error: &NvmlError) -> String {
    match error {
        NvmlError::UnexpectedVariant(code) => return_code_text(*code),
        NvmlError::FailedToLoadSymbol(message) => {
            format!("the driver's libnvidia-ml lacks this function (driver too old?): {message}")
        }
        other => other.to_string(),
    }
}

/// An error of an operation on one GPU (a MIG create or destroy) as one that names the GPU:
/// `GpuError::Nvml` carries only the failed call, and a claim's error should say which GPU as well.
pub fn on_gpu(gpu: &str, error: GpuError) -> GpuError {
    match error {
        GpuError::Nvml { call, reason } => GpuError::Mig {
            gpu: gpu.to_string(),
            reason: format!("NVML {call} failed: {reason}"),
        },
        other => other,
    }
}

/// Why the backend cannot start, in words a node operator can act on.
pub fn unavailable_reason(error: &NvmlError, library: &str) -> String {
    const HINT: &str = "install the NVIDIA driver (in a container, mount the host's driver \
                        libraries), or run with `--backend fake`";
    match error {
        NvmlError::LibloadingError(e) => format!(
            "the NVIDIA driver's libnvidia-ml.so.1 could not be loaded from {library} ({e}); {HINT}"
        ),
        NvmlError::FailedToLoadSymbol(e) => {
            format!("{library} is not a usable libnvidia-ml.so.1 ({e}); {HINT}")
        }
        other => format!(
            "libnvidia-ml.so.1 ({library}) loaded but NVML did not start: {}; {HINT}",
            describe_nvml_error(other)
        ),
    }
}

/// Where a containerized driver (driver root other than `/`) keeps libnvidia-ml.so.1, most likely first.
pub fn library_candidates(driver_root: &Path) -> Vec<PathBuf> {
    library_candidates_of(driver_root, HostArch::NATIVE)
}

/// [`library_candidates`] on a host of `arch`: only its own multiarch directories, since another
/// architecture's library cannot be loaded (the first that exists is the one dlopened).
pub(crate) fn library_candidates_of(driver_root: &Path, arch: Option<HostArch>) -> Vec<PathBuf> {
    let multiarch = |prefix: &str| arch.map(|arch| format!("{prefix}/{}", arch.multiarch));
    let mut dirs: Vec<String> = multiarch("usr/lib").into_iter().collect();
    dirs.extend(["usr/lib64", "usr/lib"].map(String::from));
    dirs.extend(multiarch("lib"));
    dirs.push("lib64".into());
    dirs.iter()
        .map(|dir| driver_root.join(dir).join("libnvidia-ml.so.1"))
        .collect()
}

#[cfg(test)]
#[path = "nvml_support_tests.rs"]
mod tests;
