//! Checks of a fake profile, so that a profile describes only what real hardware can be: unique
//! minors, MIG devices that fit the GPU's geometry, compute instances that fit their GPU instance,
//! faults that name what they need.

use super::fake_gpus::gpu_instance_id;
use super::fake_mig::physically_fits;
use super::fake_proc::TABLE_GPUS;
use super::mig::{builtin_profiles_for, MigInfo, MigInstance, MigProfile};
use super::profiles::{FakeFaultKind, FakeGpuSpec, FakeProfile};

/// Rejects profiles that would make devices the API server refuses or that collide on the node.
pub(super) fn check_profile(profile: &FakeProfile) -> Result<(), String> {
    let mut minors = std::collections::BTreeSet::new();
    for (index, gpu) in profile.gpus.iter().enumerate() {
        let minor = gpu.minor.unwrap_or(index as u32);
        if !minors.insert(minor) {
            return Err(format!("gpus[{index}]: minor {minor} is used twice"));
        }
        if gpu.mig_capable && minor >= TABLE_GPUS {
            return Err(format!(
                "gpus[{index}]: minor {minor}: the driver's MIG capability table covers GPU minors 0 to {}",
                TABLE_GPUS - 1
            ));
        }
        if gpu.product_name.is_empty() || gpu.product_name.len() > 64 {
            return Err(format!(
                "gpus[{index}].productName must be 1 to 64 characters"
            ));
        }
        if gpu.memory_bytes == 0 {
            return Err(format!("gpus[{index}].memoryBytes must be positive"));
        }
        if gpu
            .unreadable
            .as_deref()
            .is_some_and(|r| r.trim().is_empty())
        {
            return Err(format!(
                "gpus[{index}].unreadable: give the reason the GPU cannot be read"
            ));
        }
        if gpu
            .sharing_fails
            .as_deref()
            .is_some_and(|r| r.trim().is_empty())
        {
            return Err(format!(
                "gpus[{index}].sharingFails: give the reason setting the sharing mode fails"
            ));
        }
        check_mig(index, gpu)?;
        for (i, fault) in gpu.faults.iter().enumerate() {
            if (fault.kind == FakeFaultKind::Xid) != fault.xid.is_some() {
                return Err(format!(
                    "gpus[{index}].faults[{i}]: `xid` is required for kind xid and only for it"
                ));
            }
            if fault.mig_start.is_some() && !gpu.mig_capable {
                return Err(format!(
                    "gpus[{index}].faults[{i}]: migStart on a GPU without MIG"
                ));
            }
        }
    }
    Ok(())
}

fn check_mig(index: usize, gpu: &FakeGpuSpec) -> Result<(), String> {
    if !gpu.mig_capable {
        if gpu.mig_enabled
            || !gpu.mig_instances.is_empty()
            || !gpu.mig_in_use.is_empty()
            || gpu.mig_disable_fails.is_some()
            || gpu.mig_enable_fails.is_some()
        {
            return Err(format!(
                "gpus[{index}]: migEnabled, migInstances, migInUse, migDisableFails and migEnableFails \
                 need migCapable: true"
            ));
        }
        return Ok(());
    }
    let profiles = builtin_profiles_for(&gpu.product_name).ok_or_else(|| {
        format!(
            "gpus[{index}]: no MIG profile table for {:?} (known models: A100 40GB, H100 80GB, H200)",
            gpu.product_name
        )
    })?;
    if !gpu.mig_instances.is_empty() && !gpu.mig_enabled {
        return Err(format!("gpus[{index}]: migInstances need migEnabled: true"));
    }
    let mut mig = MigInfo {
        enabled: true,
        toggles_without_reset: true,
        memory_slices: 8,
        compute_slices: 7,
        profiles: profiles.clone(),
        instances: Vec::new(),
        disable_failed: None,
    };
    for (i, wanted) in gpu.mig_instances.iter().enumerate() {
        let field = format!("gpus[{index}].migInstances[{i}]");
        let profile = profiles
            .iter()
            .find(|p| p.name == wanted.profile)
            .ok_or_else(|| {
                let names: Vec<&str> = profiles.iter().map(|p| p.name.as_str()).collect();
                format!(
                    "{field}: unknown profile {:?} (this model has {})",
                    wanted.profile,
                    names.join(", ")
                )
            })?;
        let placement = *profile
            .placements
            .iter()
            .find(|p| p.start == wanted.start)
            .ok_or_else(|| {
                let starts: Vec<String> = profile
                    .placements
                    .iter()
                    .map(|p| p.start.to_string())
                    .collect();
                format!(
                    "{field}: {} cannot start at memory slice {} (possible: {})",
                    profile.name,
                    wanted.start,
                    starts.join(", ")
                )
            })?;
        physically_fits(&mig, profile, placement).map_err(|e| format!("{field}: {e}"))?;
        if let Some(list) = &wanted.compute_instances {
            check_compute_instances(&field, profile, list)?;
        }
        mig.instances.push(MigInstance {
            uuid: format!("#{i}"),
            profile_id: profile.id,
            placement,
            gpu_instance_id: gpu_instance_id(placement),
            compute_instance_id: 0,
            device_files: Vec::new(),
            compute: None,
            index: None,
        });
    }
    Ok(())
}

/// Compute instances share their GPU instance's compute slices: each takes 1 to all of them, and
/// together no more than the GPU instance has.
fn check_compute_instances(field: &str, profile: &MigProfile, list: &[u32]) -> Result<(), String> {
    if let Some(bad) = list
        .iter()
        .find(|&&slices| slices == 0 || slices > profile.compute_slices)
    {
        return Err(format!(
            "{field}.computeInstances: a compute instance of {bad} slices does not fit a {} GPU instance (1 to {})",
            profile.name, profile.compute_slices
        ));
    }
    let total: u32 = list.iter().sum();
    if total > profile.compute_slices {
        return Err(format!(
            "{field}.computeInstances: {total} compute slices in all, a {} GPU instance has {}",
            profile.name, profile.compute_slices
        ));
    }
    Ok(())
}
