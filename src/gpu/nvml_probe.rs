//! `gpu-dra nvml probe`: a read-only, field-by-field report of what NVML says about the node's GPUs,
//! including the raw values the inventory filters (fabric state, MIG placements, link states).
//! It only reads; it never changes MIG mode, instances or event registrations.

use std::fmt::{Display, Write as _};
use std::path::Path;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Device;
use nvml_wrapper_sys::bindings::{NVML_DEVICE_MIG_ENABLE, NVML_NVLINK_MAX_LINKS};

use super::nvml::{self, NvmlBackend, NvmlOptions, SYSFS_PCI_DEVICES};
use super::nvml_mig;
use super::nvml_support as support;
use super::{GpuBackend, GpuError};

/// Opens NVML and describes every GPU as NVML sees it; fails only when NVML cannot be opened.
pub fn probe(options: NvmlOptions) -> Result<String, GpuError> {
    let backend = NvmlBackend::open(options)?;
    let nvml = backend.nvml;
    let mut out = String::from("NVML probe (read-only)\n");
    line(&mut out, 0, "driver version", nvml.sys_driver_version());
    line(&mut out, 0, "NVML version", nvml.sys_nvml_version());
    let cuda = nvml.sys_cuda_driver_version().map(support::cuda_version);
    line(&mut out, 0, "CUDA driver version", cuda);
    let count = match nvml.device_count() {
        Ok(count) => {
            let _ = writeln!(out, "GPUs: {count}");
            count
        }
        Err(e) => {
            line::<u32>(&mut out, 0, "GPUs", Err(e));
            0
        }
    };
    for index in 0..count {
        let _ = writeln!(out, "\nGPU index {index}");
        match nvml.device_by_index(index) {
            Ok(device) => probe_gpu(&backend, &device, &mut out),
            Err(e) => line::<u32>(&mut out, 1, "handle", Err(e)),
        }
    }
    let _ = writeln!(
        out,
        "\nNVLink domains (as the inventory derives them), and GPUs it leaves out"
    );
    match backend.inventory() {
        Ok(inventory) => {
            for gpu in &inventory.gpus {
                let domain = gpu.nvlink_domain.as_deref().unwrap_or("none");
                let _ = writeln!(out, "  gpu-{} {}: {domain}", gpu.minor, gpu.uuid);
            }
            device_files(&inventory, &mut out);
            // What the plugin would leave out and report (a GpuUnreadable Event), and why.
            for bad in inventory.unreadable {
                let uuid = bad.uuid.unwrap_or_else(|| "(UUID unknown)".into());
                let _ = writeln!(
                    out,
                    "  GPU index {} {uuid}: unreadable, left out: {}",
                    bad.index, bad.reason
                );
            }
        }
        Err(e) => {
            let _ = writeln!(out, "  inventory failed: {e}");
        }
    }
    Ok(out)
}

/// The control files every GPU container gets, with the numbers claim specs give them.
fn device_files(inventory: &super::Inventory, out: &mut String) {
    let majors = &inventory.device_majors;
    let _ = writeln!(
        out,
        "\nDevice files for containers (majors from {}{})",
        majors.source.display(),
        majors
            .unreadable
            .as_ref()
            .map(|e| format!(": unreadable, {e}"))
            .unwrap_or_default()
    );
    for path in &inventory.control_device_files {
        let numbers = match inventory.device_number(path) {
            Some(n) => format!("c {}:{}", n.major, n.minor),
            None => "no numbers (module not loaded?): the runtime needs the host's file".into(),
        };
        let _ = writeln!(out, "  {path}: {numbers}");
    }
    let caps = majors
        .caps
        .map_or("unknown".to_string(), |major| major.to_string());
    let _ = writeln!(out, "  nvidia-caps major (MIG capability files): {caps}");
}

fn line<T: Display>(out: &mut String, indent: usize, label: &str, value: Result<T, NvmlError>) {
    let value = match value {
        Ok(v) => v.to_string(),
        Err(e) => format!("error: {}", support::describe_nvml_error(&e)),
    };
    let _ = writeln!(out, "{:width$}{label}: {value}", "", width = indent * 2);
}

fn probe_gpu(backend: &NvmlBackend, device: &Device, out: &mut String) {
    line(out, 1, "uuid", device.uuid());
    line(out, 1, "minor", device.minor_number());
    line(out, 1, "index", device.index());
    line(out, 1, "name", device.name());
    line(
        out,
        1,
        "brand",
        device.brand().map(|b| support::brand_name(&b)),
    );
    let arch = super::nvml_inventory::architecture_code(device).map(|code| {
        let reset = if support::toggles_without_reset(code) {
            "without"
        } else {
            "needs"
        };
        let name = support::architecture_name(code);
        format!("{name} (NVML code {code}; switching MIG mode {reset} a GPU reset)")
    });
    line(out, 1, "architecture", arch.ok_or(NvmlError::NotSupported));
    let cc = device
        .cuda_compute_capability()
        .map(|c| format!("{}.{}", c.major, c.minor));
    line(out, 1, "compute capability", cc);
    line(
        out,
        1,
        "memory bytes",
        device.memory_info().map(|m| m.total),
    );
    match device.pci_info() {
        Ok(pci) => {
            let bus = support::sysfs_bus_id(pci.domain, pci.bus, pci.device);
            let _ = writeln!(out, "  PCI bus id: {bus} (NVML {})", pci.bus_id);
            let root = super::nvml_inventory::pcie_root(&bus).unwrap_or_else(|| "unknown".into());
            let _ = writeln!(out, "  PCIe root: {root}");
            let numa =
                std::fs::read_to_string(Path::new(SYSFS_PCI_DEVICES).join(&bus).join("numa_node"));
            let numa = numa
                .map(|t| t.trim().to_string())
                .unwrap_or_else(|e| format!("error: {e}"));
            let _ = writeln!(out, "  NUMA node (sysfs): {numa}");
        }
        Err(e) => line::<u32>(out, 1, "PCI bus id", Err(e)),
    }
    line(
        out,
        1,
        "NUMA node (NVML)",
        device.numa_node_id().map(|n| n as i32),
    );
    match nvml::fabric_raw(device) {
        Ok(Some(f)) => {
            let _ = writeln!(
                out,
                "  fabric: state {} ({}), status {}, cluster {}, clique {}, health mask {:#x}",
                support::fabric_state_name(f.state),
                f.state,
                support::return_code_text(f.status),
                support::format_cluster_uuid(f.clusterUuid),
                f.cliqueId,
                f.healthMask
            );
        }
        Ok(None) => {
            let _ = writeln!(
                out,
                "  fabric: not supported (or no nvmlDeviceGetGpuFabricInfoV)"
            );
        }
        Err(f) => line::<u32>(out, 1, "fabric", Err(f.error)),
    }
    for link in 0..NVML_NVLINK_MAX_LINKS {
        let nvlink = device.link_wrapper_for(link);
        match nvlink.is_active() {
            Ok(active) => {
                let remote = match nvlink.remote_pci_info() {
                    Ok(r) => support::sysfs_bus_id(r.domain, r.bus, r.device),
                    Err(e) => format!("error: {}", support::describe_nvml_error(&e)),
                };
                let state = if active { "active" } else { "inactive" };
                let _ = writeln!(out, "  NVLink {link}: {state}, remote {remote}");
            }
            Err(NvmlError::InvalidArg) => break,
            Err(e) => {
                line::<u32>(out, 1, &format!("NVLink {link}"), Err(e));
                break;
            }
        }
    }
    let events = device.supported_event_types();
    line(
        out,
        1,
        "supported events",
        events.map(|t| support::event_type_names(t.bits()).join(", ")),
    );
    match device.mig_mode() {
        Ok(mode) => {
            let _ = writeln!(
                out,
                "  MIG mode: current {}, pending {}",
                mode.current, mode.pending
            );
            probe_mig(backend, device, mode.current == NVML_DEVICE_MIG_ENABLE, out);
        }
        Err(e) => line::<u32>(out, 1, "MIG mode", Err(e)),
    }
}

fn probe_mig(backend: &NvmlBackend, device: &Device, enabled: bool, out: &mut String) {
    let total = device.memory_info().map(|m| m.total).unwrap_or(0);
    let profiles = match nvml_mig::read_profiles(device) {
        Ok(profiles) => profiles,
        Err(f) => return line::<u32>(out, 1, "MIG profiles", Err(f.error)),
    };
    let _ = writeln!(out, "  MIG profiles:");
    for p in &profiles {
        let i = &p.info;
        let name = support::profile_name(
            p.nvml_name.as_deref(),
            p.index,
            i.slice_count,
            i.memory_size_mb,
            total,
        );
        let placements = match &p.placements {
            Ok(list) => list
                .iter()
                .map(|pl| format!("{}+{}", pl.start, pl.size))
                .collect::<Vec<_>>()
                .join(" "),
            Err(e) => format!("error: {}", support::describe_nvml_error(e)),
        };
        let _ = writeln!(
            out,
            "    index {} id {} {name} (NVML name {:?}): {} slices, {} MiB, {} SMs, CE {} DEC {} \
             ENC {} JPEG {} OFA {}, up to {} instances, placements {placements}",
            p.index,
            i.id,
            p.nvml_name.as_deref().unwrap_or("-"),
            i.slice_count,
            i.memory_size_mb,
            i.multiprocessor_count,
            i.copy_engine_count,
            i.decoder_count,
            i.encoder_count,
            i.jpeg_count,
            i.ofa_count,
            i.instance_count
        );
    }
    if !enabled {
        return;
    }
    let minor = device.minor_number().unwrap_or(u32::MAX);
    match backend.read_instances(device, minor, &profiles) {
        Ok(instances) if instances.is_empty() => {
            let _ = writeln!(out, "  MIG instances: none");
        }
        Ok(instances) => {
            let _ = writeln!(out, "  MIG instances:");
            for m in instances {
                let _ = writeln!(
                    out,
                    "    GI {} CI {} profile {} at {}+{}: {} {}",
                    m.gpu_instance_id,
                    m.compute_instance_id,
                    m.profile_id,
                    m.placement.start,
                    m.placement.size,
                    m.uuid,
                    m.device_files.join(" ")
                );
            }
        }
        Err(e) => {
            let _ = writeln!(out, "  MIG instances: error: {e}");
        }
    }
}
