//! Fake GPU profiles: the YAML shape a `--fake-profile` file has, and the built-in profiles modelled
//! on real nodes (same product names, memory sizes, PCI layout and NUMA split as the real machines).

use serde::{Deserialize, Serialize};

/// A fake node: what `--fake-profile` names (built-in) or holds (YAML file).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeProfile {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub driver_version: String,
    pub cuda_driver_version: String,
    pub gpus: Vec<FakeGpuSpec>,
    /// How long each MIG create and destroy takes, in milliseconds (real ones take from a fraction of
    /// a second to several seconds); split between the operation's steps, as the hardware's are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_operation_delay_ms: Option<u64>,
    /// The PCI side of the node, for VFIO passthrough (`fake_pci.rs`).
    #[serde(default, skip_serializing_if = "FakePci::is_default")]
    pub pci: FakePci,
}

/// The fake node's PCI bus beyond its GPUs: each GPU has an IOMMU group of its own unless listed here.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakePci {
    /// Each GPU has an HDMI audio function (`<slot>.1`, driver `snd_hda_intel`) in its IOMMU group.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub audio_functions: bool,
    /// PCI addresses that share one IOMMU group each (functions behind a PCIe switch without ACS).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared_iommu_groups: Vec<Vec<String>>,
    /// PCI addresses of functions a process holds open: the kernel cannot unbind their driver.
    /// Editable at run time, like faults.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_use: Vec<String>,
}

impl FakePci {
    fn is_default(&self) -> bool {
        *self == FakePci::default()
    }
}

/// One GPU of a fake profile. Values a real node derives from its hardware (UUID, minor) are filled in
/// by the fake backend when absent, stable for a node name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeGpuSpec {
    pub product_name: String,
    #[serde(default = "default_brand")]
    pub brand: String,
    pub architecture: String,
    pub cuda_compute_capability: String,
    pub memory_bytes: u64,
    #[serde(rename = "pciBusID")]
    pub pci_bus_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_root: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// NVML's index of the GPU; by default its rank in PCI bus id order among the profile's GPUs,
    /// as NVML numbers them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    /// The memory addressing mode NVML reports on coherent-memory systems (`HMM`, `ATS`, `None`);
    /// unset where the platform does not support it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addressing_mode: Option<String>,
    /// The GPU's module id on its baseboard, as `nvmlDeviceGetModuleId` reports it (HGX boards).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module_id: Option<u32>,
    /// GPUs that set this share one NVLink domain with every other GPU that sets it (an NVSwitch node).
    #[serde(default)]
    pub nvlink: bool,
    /// GPUs with the same group name are linked to each other by NVLink (bridged pairs, islands).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_group: Option<String>,
    /// The NVLink fabric the GPU joined (multi-node NVLink): its domain then comes from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<FakeFabric>,
    /// MIG-capable GPUs use NVIDIA's profile table for their model (A100 40GB, H100 80GB, H200).
    #[serde(default)]
    pub mig_capable: bool,
    /// MIG mode is on at start (an admin enabled it).
    #[serde(default)]
    pub mig_enabled: bool,
    /// MIG devices an admin created before the plugin started (static MIG); needs `migEnabled`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_instances: Vec<FakeMigInstance>,
    /// Faults the GPU has now. Adding one to the file injects it; removing it clears it (the GPU
    /// reports itself healthy again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<FakeFault>,
    /// The GPU cannot be read (`"GPU is lost"`, `"in a MIG mode change"`): the backend reports it
    /// unreadable with this reason instead of listing it. Editable at run time, like faults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreadable: Option<String>,
    /// Memory slices at which the MIG device is held by a process: destroying it is refused as
    /// NVML_ERROR_IN_USE until the slice is removed from this list.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_in_use: Vec<u32>,
    /// Switching MIG mode off fails with this reason (a process holds the GPU, or the driver wants a
    /// reset), so the GPU stays in MIG mode after its last MIG device is destroyed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_disable_fails: Option<String>,
    /// Switching MIG mode on fails with this reason (NVML's answer to `nvmlDeviceSetMigMode`: a
    /// process holds the GPU, no permission, or, as under NVIDIA's mock NVML, not supported), so a
    /// dynamic MIG device cannot be made while the GPU is out of MIG mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_enable_fails: Option<String>,
    /// Setting the GPU's sharing mode (compute mode, time-slice interval) fails with this reason, as
    /// it does without root or with a process holding the GPU. Reading the mode still works.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing_fails: Option<String>,
    /// Setting the GPU's sharing mode takes effect but does not return while this is set, as with
    /// an `nvidia-smi` stuck in the kernel (uninterruptible sleep) on its way out: the call returns
    /// once this is removed from the file. Reading the mode still works.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sharing_hangs: bool,
    /// A MIG create or destroy on the GPU takes effect (or fails) but does not return while this is
    /// set, as an NVML call stuck in the driver: the call returns once this is removed from the file.
    /// Other MIG operations on the GPU wait behind it, as they wait for the GPU's MIG lock.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mig_hangs: bool,
}

/// One injected fault: an XID error, a double-bit ECC error, pending retirement, a failed row remap,
/// or the GPU lost from the bus; on the whole GPU, or on the MIG device that starts at `migStart`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeFault {
    pub kind: FakeFaultKind,
    /// The XID number, for `kind: xid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid: Option<u64>,
    /// The memory slice the faulty MIG device starts at; the whole GPU when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_start: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FakeFaultKind {
    Xid,
    DoubleBitEcc,
    RetirementPending,
    RowRemapFailure,
    Lost,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeFabric {
    pub cluster_uuid: String,
    pub clique_id: u32,
}

/// A pre-created MIG device: its profile by name (`3g.40gb`) and the memory slice it starts at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeMigInstance {
    pub profile: String,
    pub start: u32,
    /// The compute instances of the GPU instance, by their compute slices (`[1, 1, 1]` for three
    /// `1c.3g.40gb` on a 3g GPU instance; `[]` for a GPU instance without compute instance). Absent:
    /// one compute instance spanning the GPU instance, as `nvidia-smi mig -cgi ... -C` makes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_instances: Option<Vec<u32>>,
}

fn default_brand() -> String {
    "Nvidia".to_string()
}

struct Model {
    product_name: &'static str,
    architecture: &'static str,
    compute_capability: &'static str,
    memory_bytes: u64,
    nvlink: bool,
    mig_capable: bool,
}

const H100_SXM: Model = Model {
    product_name: "NVIDIA H100 80GB HBM3",
    architecture: "Hopper",
    compute_capability: "9.0",
    // 81559 MiB, what NVML reports as total memory on an H100 SXM5 80GB.
    memory_bytes: 81559 * 1024 * 1024,
    nvlink: true,
    mig_capable: true,
};

const A100_SXM4_40GB: Model = Model {
    product_name: "NVIDIA A100-SXM4-40GB",
    architecture: "Ampere",
    compute_capability: "8.0",
    memory_bytes: 40960 * 1024 * 1024,
    nvlink: true,
    mig_capable: true,
};

const H200_SXM: Model = Model {
    product_name: "NVIDIA H200",
    architecture: "Hopper",
    compute_capability: "9.0",
    // 143771 MiB, what NVML reports as total memory on an H200 SXM 141GB.
    memory_bytes: 143771 * 1024 * 1024,
    nvlink: true,
    mig_capable: true,
};

/// As NVIDIA's mock NVML describes a GB200 (192 GiB HBM3e). Its MIG profile table is not modelled.
const GB200: Model = Model {
    product_name: "NVIDIA GB200",
    architecture: "Blackwell",
    compute_capability: "10.0",
    memory_bytes: 206_158_430_208,
    nvlink: false,
    mig_capable: false,
};

/// The NVLink fabric cluster of the built-in `gb200-nvl72` profile (the mock NVML's GB200 one).
pub const GB200_CLUSTER_UUID: &str = "00000000-0000-0000-0000-000000000001";

const A100_PCIE_40GB: Model = Model {
    product_name: "NVIDIA A100-PCIE-40GB",
    architecture: "Ampere",
    compute_capability: "8.0",
    memory_bytes: 40960 * 1024 * 1024,
    // Bridged in pairs, not on a switch: see `a100-pcie-4`.
    nvlink: false,
    mig_capable: true,
};

const L40S: Model = Model {
    product_name: "NVIDIA L40S",
    architecture: "Ada Lovelace",
    compute_capability: "8.9",
    memory_bytes: 46068 * 1024 * 1024,
    nvlink: false,
    mig_capable: false,
};

/// Builds a profile of identical GPUs at the given PCI buses; the first half sits on NUMA node 0,
/// the second on NUMA node 1, as on two-socket servers.
fn uniform(
    name: &str,
    description: &str,
    model: &Model,
    buses: &[u8],
    driver: &str,
    cuda: &str,
) -> FakeProfile {
    let half = buses.len().div_ceil(2);
    let gpus = buses
        .iter()
        .enumerate()
        .map(|(i, bus)| FakeGpuSpec {
            product_name: model.product_name.to_string(),
            brand: default_brand(),
            architecture: model.architecture.to_string(),
            cuda_compute_capability: model.compute_capability.to_string(),
            memory_bytes: model.memory_bytes,
            pci_bus_id: format!("0000:{bus:02x}:00.0"),
            // Each GPU sits behind its own PCIe switch under a root one bus number below it.
            pcie_root: Some(format!("pci0000:{:02x}", bus.saturating_sub(1))),
            numa_node: Some(if i < half { 0 } else { 1 }),
            minor: None,
            uuid: None,
            index: None,
            addressing_mode: None,
            module_id: None,
            nvlink: model.nvlink,
            nvlink_group: None,
            fabric: None,
            mig_capable: model.mig_capable,
            mig_enabled: false,
            mig_instances: Vec::new(),
            faults: Vec::new(),
            unreadable: None,
            mig_in_use: Vec::new(),
            mig_disable_fails: None,
            mig_enable_fails: None,
            sharing_fails: None,
            sharing_hangs: false,
            mig_hangs: false,
        })
        .collect();
    FakeProfile {
        name: name.to_string(),
        description: description.to_string(),
        driver_version: driver.to_string(),
        cuda_driver_version: cuda.to_string(),
        gpus,
        mig_operation_delay_ms: None,
        pci: FakePci::default(),
    }
}

/// The names of the built-in profiles, the default first.
pub fn builtin_profile_names() -> Vec<&'static str> {
    vec![
        "dgx-h100",
        "dgx-a100",
        "dgx-h200",
        "a100-pcie-4",
        "l40s-4",
        "gb200-nvl72",
    ]
}

/// One compute tray of a GB200 NVL72 rack: two Grace-Blackwell superchips, 4 GPUs, all joined to the
/// rack's NVLink fabric in clique `clique` of cluster `cluster_uuid`. Several nodes with different
/// cliques make a multi-rack cluster for ComputeDomains (tests and the demo write them as files).
pub fn gb200_tray(cluster_uuid: &str, clique: u32) -> FakeProfile {
    let mut profile = uniform(
        "gb200-nvl72",
        "GB200 NVL72 compute tray: 4x GB200 on a multi-node NVLink fabric (one clique), no MIG",
        &GB200,
        &[0x0a, 0x0b, 0x4a, 0x4b],
        "580.65.06",
        "13.0",
    );
    for gpu in &mut profile.gpus {
        gpu.fabric = Some(FakeFabric {
            cluster_uuid: cluster_uuid.to_string(),
            clique_id: clique,
        });
        gpu.addressing_mode = Some("ATS".to_string());
    }
    profile
}

/// A built-in profile by name.
pub fn builtin_profile(name: &str) -> Option<FakeProfile> {
    match name {
        "dgx-h100" => Some(uniform(
            "dgx-h100",
            "DGX H100: 8x H100 80GB HBM3 on one NVSwitch NVLink domain, MIG capable",
            &H100_SXM,
            &[0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb],
            "550.90.07",
            "12.4",
        )),
        "dgx-a100" => Some(uniform(
            "dgx-a100",
            "DGX A100: 8x A100-SXM4-40GB on one NVSwitch NVLink domain, MIG capable",
            &A100_SXM4_40GB,
            &[0x07, 0x0f, 0x47, 0x4e, 0x87, 0x90, 0xb7, 0xbd],
            "535.183.01",
            "12.2",
        )),
        "dgx-h200" => Some(uniform(
            "dgx-h200",
            "DGX H200: 8x H200 141GB on one NVSwitch NVLink domain, MIG capable",
            &H200_SXM,
            &[0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb],
            "570.133.20",
            "12.8",
        )),
        "a100-pcie-4" => {
            let mut profile = uniform(
                "a100-pcie-4",
                "4x A100-PCIE-40GB in two NVLink-bridged pairs (two NVLink domains), MIG capable",
                &A100_PCIE_40GB,
                &[0x17, 0x31, 0xb1, 0xca],
                "550.90.07",
                "12.4",
            );
            for (i, gpu) in profile.gpus.iter_mut().enumerate() {
                gpu.nvlink_group = Some(format!("bridge-{}", i / 2));
            }
            Some(profile)
        }
        "l40s-4" => {
            let mut profile = uniform(
                "l40s-4",
                "4x L40S PCIe, no MIG, no NVLink; each with an audio function, the last two in one IOMMU group",
                &L40S,
                &[0x01, 0x41, 0x81, 0xc1],
                "550.90.07",
                "12.4",
            );
            profile.pci = FakePci {
                audio_functions: true,
                shared_iommu_groups: vec![vec!["0000:81:00.0".into(), "0000:c1:00.0".into()]],
                in_use: Vec::new(),
            };
            Some(profile)
        }
        "gb200-nvl72" => Some(gb200_tray(GB200_CLUSTER_UUID, 0)),
        _ => None,
    }
}
