//! MIG vocabulary: GPU-instance profiles, their placements on a GPU's memory slices, and existing MIG
//! devices. The built-in tables follow NVIDIA's published profiles (`nvidia-smi mig -lgip` / `-lgipp`)
//! for the models the fake backend offers, so the device model is tested against real geometry.

use serde::{Deserialize, Serialize};

/// Where a GPU instance sits: `size` memory slices starting at slice `start` (NVML's
/// `nvmlGpuInstancePlacement_t`). Two instances of one GPU may not share a memory slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MigPlacement {
    pub start: u32,
    pub size: u32,
}

impl MigPlacement {
    /// The memory slices the placement occupies.
    pub fn slices(&self) -> std::ops::Range<u32> {
        self.start..self.start + self.size
    }

    pub fn overlaps(&self, other: &MigPlacement) -> bool {
        self.start < other.start + other.size && other.start < self.start + self.size
    }
}

/// One GPU-instance profile of a GPU model: what one MIG device of that profile gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigProfile {
    /// NVML's profile id (`nvmlGpuInstanceProfileInfo_t.id`, the "ID" column of `nvidia-smi mig -lgip`).
    pub id: u32,
    /// NVIDIA's name, e.g. `1g.10gb` or `1g.10gb+me`.
    pub name: String,
    /// Compute slices (the `Ng` of the name) out of the GPU's seven.
    pub compute_slices: u32,
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg_engines: u32,
    pub ofa_engines: u32,
    /// Every placement NVML allows for this profile, by start slice.
    pub placements: Vec<MigPlacement>,
}

impl MigProfile {
    /// The profile name in DNS-label form for device names: `1g.10gb` → `1g10gb`, `1g.10gb+me` →
    /// `1g10gb-me` (as NVIDIA's driver names them).
    pub fn dns_name(&self) -> String {
        profile_dns_name(&self.name)
    }

    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * 1024 * 1024
    }
}

pub fn profile_dns_name(name: &str) -> String {
    name.to_ascii_lowercase().replace('.', "").replace('+', "-")
}

/// `compute_instance_id` of a GPU instance that has no compute instance (left over by an interrupted
/// create, or made so by an admin); such an instance has an empty `uuid`, no device files, and CUDA
/// cannot use it.
pub const NO_COMPUTE_INSTANCE: u32 = u32::MAX;

/// A MIG device that exists on a GPU: one compute instance of a GPU instance. A GPU instance with
/// several compute instances (an admin's `nvidia-smi mig -cci 1c.3g.40gb,...`) appears once per
/// compute instance; one without any appears once, with [`NO_COMPUTE_INSTANCE`].
#[derive(Debug, Clone, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigInstance {
    /// `MIG-xxxxxxxx-...`, what CUDA and NVML name the device by.
    pub uuid: String,
    pub profile_id: u32,
    pub placement: MigPlacement,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    /// The capability device files that grant access to this GPU and compute instance
    /// (`/dev/nvidia-caps/nvidia-cap<N>`), besides the parent GPU's own device file.
    pub device_files: Vec<String>,
    /// Set when the compute instance takes only part of its GPU instance's compute slices (several
    /// compute instances share the GPU instance's memory); `None` when it spans the whole GPU instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<ComputeShare>,
    /// NVML's index of the MIG device on its GPU (`nvmlDeviceGetMigDeviceHandleByIndex`), as read
    /// with the inventory; `None` for a GPU instance without compute instance, and where it is not
    /// known (a device just made, before the next inventory). Informational only: never compared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
}

/// Equal when the same MIG device: NVML's `index` is left out, as a device keeps its identity when
/// NVML renumbers its handles.
impl PartialEq for MigInstance {
    fn eq(&self, other: &Self) -> bool {
        self.uuid == other.uuid
            && self.profile_id == other.profile_id
            && self.placement == other.placement
            && self.gpu_instance_id == other.gpu_instance_id
            && self.compute_instance_id == other.compute_instance_id
            && self.device_files == other.device_files
            && self.compute == other.compute
    }
}

impl MigInstance {
    /// Whether the GPU instance has a compute instance, i.e. CUDA can use this MIG device.
    pub fn has_compute_instance(&self) -> bool {
        self.compute_instance_id != NO_COMPUTE_INSTANCE
    }
}

/// The part of a GPU instance one of several compute instances takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComputeShare {
    /// Compute slices of the compute instance (the `1c` of `1c.3g.40gb`).
    pub slices: u32,
    pub multiprocessors: u32,
}

/// What became of a MIG device a caller asked to destroy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigDestroyed {
    /// It existed and is gone now.
    Destroyed,
    /// It did not exist (any more): a retry, or someone else removed it.
    Gone,
    /// The GPU instance id now belongs to another MIG device (ours was removed and the id reused), which
    /// was left alone.
    Replaced { found: String },
}

/// A GPU's MIG side: its geometry, whether MIG mode is on, and the MIG devices that exist now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigInfo {
    /// MIG mode as it is now (NVML's current mode).
    pub enabled: bool,
    /// Whether MIG mode can be switched without a GPU reset (Hopper and later).
    pub toggles_without_reset: bool,
    /// Memory slices of the GPU (eight on A100 / H100 / H200).
    pub memory_slices: u32,
    /// Compute slices of the GPU (seven on A100 / H100 / H200).
    pub compute_slices: u32,
    pub profiles: Vec<MigProfile>,
    pub instances: Vec<MigInstance>,
    /// Why MIG mode could not be switched off after the last MIG device was destroyed; `None` when it
    /// could (or never had to be). Such a GPU stays in MIG mode, so CUDA cannot use it whole.
    pub disable_failed: Option<String>,
}

impl MigInfo {
    pub fn profile(&self, id: u32) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    pub fn profile_by_dns_name(&self, dns_name: &str) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.dns_name() == dns_name)
    }
}

/// A request to create a MIG device: which GPU, which profile, where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigRequest {
    pub parent_uuid: String,
    pub profile_id: u32,
    pub placement: MigPlacement,
}

/// Why a dynamic MIG device could not be made: switching the GPU's MIG mode on failed, for `why` (NVML's
/// answer, with the call it came from). The fake backend words it the same way, so tests see what users
/// see; the device model offers MIG devices of a GPU with MIG mode off only where it can be switched on
/// without a reset, so this is where such a GPU says it cannot.
pub fn mig_enable_failed(gpu: &str, why: &str) -> String {
    format!(
        "switching MIG mode on failed: {why}; dynamic MIG switches it on for the GPU's first MIG \
         device: switch it on beforehand (`nvidia-smi -i {gpu} -mig 1`), or publish only the MIG \
         devices an admin made (--mig-mode static)"
    )
}

/// One row of a model table: (id, name, compute slices, memory MiB, SMs, CE, DEC, ENC, JPEG, OFA,
/// placement starts, placement size).
type Row = (
    u32,
    &'static str,
    u32,
    u64,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    &'static [u32],
    u32,
);

fn table(rows: &[Row]) -> Vec<MigProfile> {
    rows.iter()
        .map(
            |&(id, name, compute, memory, sm, ce, dec, enc, jpeg, ofa, starts, size)| MigProfile {
                id,
                name: name.to_string(),
                compute_slices: compute,
                memory_mib: memory,
                multiprocessors: sm,
                copy_engines: ce,
                decoders: dec,
                encoders: enc,
                jpeg_engines: jpeg,
                ofa_engines: ofa,
                placements: starts
                    .iter()
                    .map(|&start| MigPlacement { start, size })
                    .collect(),
            },
        )
        .collect()
}

const ONE_SLICE: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const TWO_SLICES: &[u32] = &[0, 2, 4, 6];
const TWO_COMPUTE: &[u32] = &[0, 2, 4];
const HALF: &[u32] = &[0, 4];
const FIRST: &[u32] = &[0];

/// A100-SXM4-40GB.
pub fn a100_40gb_profiles() -> Vec<MigProfile> {
    table(&[
        (19, "1g.5gb", 1, 4864, 14, 1, 0, 0, 0, 0, ONE_SLICE, 1),
        (20, "1g.5gb+me", 1, 4864, 14, 1, 1, 0, 1, 1, ONE_SLICE, 1),
        (15, "1g.10gb", 1, 9856, 14, 1, 1, 0, 0, 0, TWO_SLICES, 2),
        (14, "2g.10gb", 2, 9856, 28, 2, 1, 0, 0, 0, TWO_COMPUTE, 2),
        (9, "3g.20gb", 3, 19968, 42, 3, 2, 0, 0, 0, HALF, 4),
        (5, "4g.20gb", 4, 19968, 56, 4, 2, 0, 0, 0, FIRST, 4),
        (0, "7g.40gb", 7, 40192, 98, 7, 5, 0, 1, 1, FIRST, 8),
    ])
}

/// H100 80GB HBM3 (SXM5).
pub fn h100_80gb_profiles() -> Vec<MigProfile> {
    table(&[
        (19, "1g.10gb", 1, 9984, 16, 1, 1, 0, 1, 0, ONE_SLICE, 1),
        (20, "1g.10gb+me", 1, 9984, 16, 1, 1, 0, 1, 1, ONE_SLICE, 1),
        (15, "1g.20gb", 1, 20096, 26, 1, 1, 0, 1, 0, TWO_SLICES, 2),
        (14, "2g.20gb", 2, 20096, 32, 2, 2, 0, 2, 0, TWO_COMPUTE, 2),
        (9, "3g.40gb", 3, 40448, 60, 3, 3, 0, 3, 0, HALF, 4),
        (5, "4g.40gb", 4, 40448, 64, 4, 4, 0, 4, 0, FIRST, 4),
        (0, "7g.80gb", 7, 81152, 132, 8, 7, 0, 7, 1, FIRST, 8),
    ])
}

/// H200 141GB HBM3e (SXM).
pub fn h200_141gb_profiles() -> Vec<MigProfile> {
    table(&[
        (19, "1g.18gb", 1, 16384, 16, 1, 1, 0, 1, 0, ONE_SLICE, 1),
        (20, "1g.18gb+me", 1, 16384, 16, 1, 1, 0, 1, 1, ONE_SLICE, 1),
        (15, "1g.35gb", 1, 33280, 26, 1, 1, 0, 1, 0, TWO_SLICES, 2),
        (14, "2g.35gb", 2, 33280, 32, 2, 2, 0, 2, 0, TWO_COMPUTE, 2),
        (9, "3g.71gb", 3, 68096, 60, 3, 3, 0, 3, 0, HALF, 4),
        (5, "4g.71gb", 4, 68096, 64, 4, 4, 0, 4, 0, FIRST, 4),
        (0, "7g.141gb", 7, 133632, 132, 8, 7, 0, 7, 1, FIRST, 8),
    ])
}

/// The built-in MIG table for a product name, if the fake backend knows the model.
pub fn builtin_profiles_for(product_name: &str) -> Option<Vec<MigProfile>> {
    let name = product_name.to_ascii_uppercase();
    if name.contains("A100") && name.contains("40GB") {
        Some(a100_40gb_profiles())
    } else if name.contains("H100") && name.contains("80GB") {
        Some(h100_80gb_profiles())
    } else if name.contains("H200") {
        Some(h200_141gb_profiles())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_fit_the_gpu_and_name_their_slices() {
        for profiles in [
            a100_40gb_profiles(),
            h100_80gb_profiles(),
            h200_141gb_profiles(),
        ] {
            for profile in &profiles {
                assert!(profile
                    .name
                    .starts_with(&format!("{}g.", profile.compute_slices)));
                for placement in &profile.placements {
                    assert!(placement.start + placement.size <= 8, "{}", profile.name);
                    assert_eq!(placement.start % placement.size.min(4), 0);
                }
            }
            let full = profiles.iter().find(|p| p.compute_slices == 7).unwrap();
            // No profile needs more of any engine than the whole GPU has.
            for profile in &profiles {
                assert!(profile.multiprocessors <= full.multiprocessors);
                assert!(profile.copy_engines <= full.copy_engines);
                assert!(profile.decoders <= full.decoders);
                assert!(profile.jpeg_engines <= full.jpeg_engines);
                assert!(profile.ofa_engines <= full.ofa_engines);
            }
        }
    }

    #[test]
    fn dns_names_follow_the_driver_convention() {
        assert_eq!(profile_dns_name("1g.10gb"), "1g10gb");
        assert_eq!(profile_dns_name("1g.10gb+me"), "1g10gb-me");
        assert_eq!(profile_dns_name("7g.141gb"), "7g141gb");
    }

    #[test]
    fn placements_overlap_by_memory_slice() {
        let a = MigPlacement { start: 0, size: 4 };
        assert!(a.overlaps(&MigPlacement { start: 3, size: 1 }));
        assert!(!a.overlaps(&MigPlacement { start: 4, size: 4 }));
        assert_eq!(a.slices().count(), 4);
    }

    #[test]
    fn models_are_found_by_product_name() {
        assert_eq!(
            builtin_profiles_for("NVIDIA H100 80GB HBM3").unwrap()[0].name,
            "1g.10gb"
        );
        assert_eq!(
            builtin_profiles_for("NVIDIA A100-SXM4-40GB").unwrap()[0].name,
            "1g.5gb"
        );
        assert_eq!(
            builtin_profiles_for("NVIDIA H200").unwrap()[0].name,
            "1g.18gb"
        );
        assert!(builtin_profiles_for("NVIDIA L40S").is_none());
    }
}
