//! GPU sharing on real GPUs: the compute mode through NVML (DEFAULT, or EXCLUSIVE_PROCESS for MPS),
//! and the time-slice interval through the driver's `nvidia-smi`, since NVML has no public call for
//! it. Nothing here is `unsafe`: nvml-wrapper wraps both compute-mode calls.

use nvml_wrapper::enum_wrappers::device::ComputeMode;
use nvml_wrapper::error::NvmlError;

use super::nvidia_smi::NvidiaSmi;
use super::nvml::NvmlBackend;
use super::nvml_support::describe_nvml_error;
use super::{GpuError, GpuSharingMode, TimeSliceInterval};

impl NvmlBackend {
    /// Sets the compute mode (only when it differs: setting it needs root even when nothing changes),
    /// then the time-slice interval for `Default` and `TimeSlice`, which is always run because it
    /// cannot be read back. The caller holds the GPU's sharing lock.
    pub(super) fn apply_sharing(
        &self,
        gpu_uuid: &str,
        mode: GpuSharingMode,
    ) -> Result<(), GpuError> {
        let failed = |reason: String| GpuError::Sharing {
            gpu: gpu_uuid.to_string(),
            reason,
        };
        let (wanted, interval) = match mode {
            GpuSharingMode::Default => (ComputeMode::Default, Some(TimeSliceInterval::Default)),
            GpuSharingMode::TimeSlice(interval) => (ComputeMode::Default, Some(interval)),
            GpuSharingMode::ExclusiveProcess => (ComputeMode::ExclusiveProcess, None),
        };
        let mut device = self.sharing_device(gpu_uuid)?;
        let current = device.compute_mode().map_err(|e| {
            failed(format!(
                "reading the compute mode: {}",
                nvml_failure("nvmlDeviceGetComputeMode", &e)
            ))
        })?;
        if current != wanted {
            device.set_compute_mode(wanted).map_err(|e| {
                failed(format!(
                    "setting compute mode {}: {}",
                    compute_mode_name(wanted),
                    nvml_failure("nvmlDeviceSetComputeMode", &e)
                ))
            })?;
        }
        if let Some(interval) = interval {
            NvidiaSmi::find(&self.driver_root)
                .and_then(|smi| smi.set_timeslice(gpu_uuid, interval))
                .map_err(|e| failed(format!("setting time-slice interval {interval}: {e}")))?;
        }
        Ok(())
    }

    /// The compute mode as a sharing mode; the interval cannot be read, so DEFAULT reads as `Default`.
    pub(super) fn read_sharing(&self, gpu_uuid: &str) -> Result<GpuSharingMode, GpuError> {
        let failed = |reason: String| GpuError::Sharing {
            gpu: gpu_uuid.to_string(),
            reason,
        };
        let device = self.sharing_device(gpu_uuid)?;
        match device.compute_mode() {
            Ok(ComputeMode::Default) => Ok(GpuSharingMode::Default),
            Ok(ComputeMode::ExclusiveProcess) => Ok(GpuSharingMode::ExclusiveProcess),
            Ok(other) => Err(failed(format!(
                "compute mode is {}, which this driver never sets; set it back with nvidia-smi -i {gpu_uuid} -c DEFAULT",
                compute_mode_name(other)
            ))),
            Err(e) => Err(failed(format!(
                "reading the compute mode: {}",
                nvml_failure("nvmlDeviceGetComputeMode", &e)
            ))),
        }
    }

    fn sharing_device(&self, gpu_uuid: &str) -> Result<nvml_wrapper::Device<'static>, GpuError> {
        self.device_by_uuid(gpu_uuid).map_err(|e| match e {
            GpuError::Mig { gpu, reason } => GpuError::Sharing { gpu, reason },
            other => GpuError::Sharing {
                gpu: gpu_uuid.to_string(),
                reason: other.to_string(),
            },
        })
    }
}

fn nvml_failure(call: &str, error: &NvmlError) -> String {
    format!("NVML {call} failed: {}", describe_nvml_error(error))
}

/// A compute mode by its NVML name (`NVML_COMPUTEMODE_<name>`).
fn compute_mode_name(mode: ComputeMode) -> &'static str {
    match mode {
        ComputeMode::Default => "DEFAULT",
        ComputeMode::ExclusiveThread => "EXCLUSIVE_THREAD",
        ComputeMode::Prohibited => "PROHIBITED",
        ComputeMode::ExclusiveProcess => "EXCLUSIVE_PROCESS",
    }
}
