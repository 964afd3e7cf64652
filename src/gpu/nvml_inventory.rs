//! The inventory side of the NVML backend: every GPU NVML enumerates, read one by one. A GPU that
//! cannot be read (lost, in a MIG mode change, any per-GPU error) is reported as unreadable with what
//! is known of it, and the others are listed; only a failure to talk to NVML at all fails the whole
//! inventory. Safe code only; the raw calls live in `nvml.rs`.

use std::collections::BTreeSet;
use std::path::Path;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Device;
use nvml_wrapper_sys::bindings::NVML_NVLINK_MAX_LINKS;

use super::device_files::{control_device_files, has_modeset};
use super::nvml::{
    addressing_mode_raw, fabric_raw, module_id_raw, Named, NvmlBackend, SYSFS_PCI_DEVICES,
};
use super::nvml_support as support;
use super::{nvlink, DriverProc, Gpu, GpuError, Inventory, UnreadableGpu};

impl NvmlBackend {
    /// `GpuBackend::inventory`.
    pub(super) fn read_inventory(&self) -> Result<Inventory, GpuError> {
        let driver_version = self
            .nvml
            .sys_driver_version()
            .named("nvmlSystemGetDriverVersion")?;
        let cuda = self
            .nvml
            .sys_cuda_driver_version()
            .named("nvmlSystemGetCudaDriverVersion_v2")?;
        let count = self.nvml.device_count().named("nvmlDeviceGetCount_v2")?;
        let mut gpus = Vec::new();
        let mut unreadable = Vec::new();
        for index in 0..count {
            match self.read_gpu(index) {
                Ok(gpu) => gpus.push(gpu),
                Err(bad) => unreadable.push(bad),
            }
        }
        gpus.sort_by_key(|gpu| gpu.minor);
        nvlink::assign_domains(&mut gpus);
        let pci_gpus = super::PciSysfs::host(Path::new("/sys"))
            .nvidia_gpus()
            .unwrap_or_else(|error| {
                tracing::warn!(%error, "reading the PCI bus in /sys: no GPU can be passed through");
                Vec::new()
            });
        Ok(Inventory {
            driver_version,
            cuda_driver_version: support::cuda_version(cuda),
            gpus,
            // The driver root's `dev` is the host's /dev (or the driver container's) as the Container
            // Toolkit's dev root: /dev/nvidia-modeset only where it is there.
            control_device_files: control_device_files(has_modeset(&self.driver_root.join("dev"))),
            device_majors: DriverProc::new(&self.driver_root).device_majors(),
            stand_in_device: None,
            unreadable,
            pci_gpus,
        })
    }

    /// One GPU, or what is known of it and why it could not be read.
    fn read_gpu(&self, index: u32) -> Result<Gpu, UnreadableGpu> {
        let mut known = UnreadableGpu {
            index,
            minor: None,
            uuid: None,
            pci_bus_id: None,
            reason: String::new(),
        };
        let device = match self
            .nvml
            .device_by_index(index)
            .named("nvmlDeviceGetHandleByIndex_v2")
        {
            Ok(device) => device,
            Err(failed) => {
                known.reason = GpuError::from(failed).to_string();
                return Err(known);
            }
        };
        // Each of these may answer while the rest of the GPU does not; they name it in the report.
        known.uuid = device.uuid().ok();
        known.minor = device.minor_number().ok();
        known.pci_bus_id = device
            .pci_info()
            .ok()
            .map(|pci| support::sysfs_bus_id(pci.domain, pci.bus, pci.device));
        self.read_device(&device).map_err(|error| UnreadableGpu {
            reason: error.to_string(),
            ..known
        })
    }

    fn read_device(&self, device: &Device<'static>) -> Result<Gpu, GpuError> {
        let uuid = device.uuid().named("nvmlDeviceGetUUID")?;
        let minor = device.minor_number().named("nvmlDeviceGetMinorNumber")?;
        let index = device.index().named("nvmlDeviceGetIndex")?;
        let product_name = device.name().named("nvmlDeviceGetName")?;
        let memory_bytes = device
            .memory_info()
            .named("nvmlDeviceGetMemoryInfo_v2")?
            .total;
        let pci = device.pci_info().named("nvmlDeviceGetPciInfo_v3")?;
        let pci_bus_id = support::sysfs_bus_id(pci.domain, pci.bus, pci.device);
        let cc = device
            .cuda_compute_capability()
            .named("nvmlDeviceGetCudaComputeCapability")?;
        let arch = architecture_code(device);
        let brand = device
            .brand()
            .map(|b| support::brand_name(&b))
            .unwrap_or("Unknown");
        let fabric = fabric_raw(device).ok().flatten();
        // A GPU whose addressing mode cannot be read is still usable: the attribute is left out.
        let addressing_mode = addressing_mode_raw(device)
            .ok()
            .flatten()
            .and_then(support::addressing_mode_name)
            .map(str::to_string);
        Ok(Gpu {
            index,
            addressing_mode,
            module_id: module_id_raw(device),
            mig: self.read_mig(device, minor, &product_name, memory_bytes, arch)?,
            minor,
            uuid,
            brand: brand.to_string(),
            architecture: support::architecture_name(arch.unwrap_or(u32::MAX)).to_string(),
            cuda_compute_capability: format!("{}.{}", cc.major, cc.minor),
            memory_bytes,
            pcie_root: pcie_root(&pci_bus_id),
            numa_node: numa_node(device, &pci_bus_id),
            nvlink_domain: None,
            fabric: fabric
                .and_then(|f| support::fabric_info(f.state, f.status, f.clusterUuid, f.cliqueId)),
            nvlink_peers: nvlink_peers(device),
            pci_bus_id,
            product_name,
        })
    }
}

pub(super) fn architecture_code(device: &Device) -> Option<u32> {
    match device.architecture() {
        Ok(arch) => Some(arch.as_c()),
        Err(NvmlError::UnexpectedVariant(code)) => Some(code),
        Err(_) => None,
    }
}

pub(super) fn pcie_root(bus_id: &str) -> Option<String> {
    let resolved = std::fs::canonicalize(Path::new(SYSFS_PCI_DEVICES).join(bus_id)).ok()?;
    support::pcie_root_of(&resolved)
}

fn numa_node(device: &Device, bus_id: &str) -> Option<i64> {
    if let Ok(node) = device.numa_node_id() {
        return support::numa_from_nvml(node);
    }
    let path = Path::new(SYSFS_PCI_DEVICES).join(bus_id).join("numa_node");
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| support::parse_numa_node(&text))
}

/// Remote PCI bus ids of the active links (GPUs, or NVSwitches on switched systems).
fn nvlink_peers(device: &Device) -> Vec<String> {
    let mut peers = BTreeSet::new();
    for link in 0..NVML_NVLINK_MAX_LINKS {
        let nvlink = device.link_wrapper_for(link);
        match nvlink.is_active() {
            Ok(true) => {
                if let Ok(r) = nvlink.remote_pci_info() {
                    peers.insert(support::sysfs_bus_id(r.domain, r.bus, r.device));
                }
            }
            // No NVLink at all, or past the GPU's last link.
            Err(NvmlError::InvalidArg | NvmlError::NotSupported) => break,
            Ok(false) | Err(_) => {}
        }
    }
    peers.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plugin's `/dev` is a snapshot of when its container started (here: a machine without the
    /// NVIDIA driver, so without `/dev/nvidia-uvm`); without the UVM files CUDA cannot initialise, so
    /// every GPU container gets them regardless.
    #[test]
    fn every_container_gets_the_uvm_files_whatever_the_plugins_dev_holds() {
        let files = control_device_files(false);
        for path in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] {
            assert!(files.iter().any(|f| f == path), "{path} missing: {files:?}");
        }
    }
}
