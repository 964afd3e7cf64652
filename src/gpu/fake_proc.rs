//! The fake backend's `/proc`: the `devices` list and MIG capability table (`driver/nvidia-caps/
//! mig-minors`) of a node with the NVIDIA driver, its MIG and its UVM module loaded. Written beside the
//! fake state file (`<state>.proc/`, only where missing, so an edit such as dropping the `nvidia-uvm`
//! line stays, as on a node where the module is not loaded) and read back with the readers the NVML
//! backend uses on a real node; kept in memory without a state file.

use std::path::Path;

use super::caps::{driver_table, CapsError, MigMinors, MIG_MINORS};
use super::device_files::{DeviceMajors, DriverProc};
use super::GpuError;

/// GPU minors the driver's MIG table covers (`NV_MAX_DEVICES`).
pub(super) const TABLE_GPUS: u32 = 32;

/// `/proc/devices` of such a node (the majors of `nvidia-caps` and `nvidia-uvm` vary between nodes).
const DEVICES: &str = "Character devices:\n  1 mem\n  4 /dev/vc/0\n  5 /dev/tty\n 10 misc\n\
    195 nvidia-frontend\n237 nvidia-caps\n238 nvidia-caps-imex-channels\n510 nvidia-uvm\n\n\
    Block devices:\n  7 loop\n  8 sd\n";

#[derive(Debug)]
pub(super) enum FakeProc {
    Dir(DriverProc),
    Memory {
        majors: DeviceMajors,
        minors: MigMinors,
    },
}

impl FakeProc {
    /// The fake `/proc` for a backend keeping its state in `state_file`: `<state_file>.proc`,
    /// written where missing; in memory without a state file.
    pub(super) fn beside(state_file: Option<&Path>) -> Result<Self, GpuError> {
        let Some(state_file) = state_file else {
            let shown = Path::new("/proc (fake, in memory)");
            return Ok(FakeProc::Memory {
                majors: DeviceMajors::parse(&shown.join("devices"), DEVICES),
                minors: MigMinors::parse(&shown.join(MIG_MINORS), &driver_table(TABLE_GPUS)),
            });
        };
        let root = state_file.with_extension("proc");
        write_missing(&root.join("devices"), DEVICES)?;
        write_missing(&root.join(MIG_MINORS), &driver_table(TABLE_GPUS))?;
        Ok(FakeProc::Dir(DriverProc::at(&root)))
    }

    pub(super) fn device_majors(&self) -> DeviceMajors {
        match self {
            FakeProc::Dir(proc) => proc.device_majors(),
            FakeProc::Memory { majors, .. } => majors.clone(),
        }
    }

    pub(super) fn mig_minors(&self) -> Result<MigMinors, CapsError> {
        match self {
            FakeProc::Dir(proc) => proc.mig_minors(),
            FakeProc::Memory { minors, .. } => Ok(minors.clone()),
        }
    }
}

fn write_missing(path: &Path, text: &str) -> Result<(), GpuError> {
    if path.exists() {
        return Ok(());
    }
    let failed = |source| GpuError::ReadProfile {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(failed)?;
    }
    crate::fsutil::write_atomically(path, text.as_bytes(), 0o644).map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fake_proc_is_written_beside_the_state_file_and_an_edit_stays() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("fake-gpu-state.json");
        let proc = FakeProc::beside(Some(&state)).unwrap();
        let root = dir.path().join("fake-gpu-state.proc");
        assert!(root.join("driver/nvidia-caps/mig-minors").is_file());
        let majors = proc.device_majors();
        assert_eq!((majors.caps, majors.uvm), (Some(237), Some(510)));
        assert_eq!(majors.source, root.join("devices"));
        assert_eq!(
            proc.mig_minors().unwrap().device_files(31, 14, 7).unwrap(),
            [
                "/dev/nvidia-caps/nvidia-cap4314",
                "/dev/nvidia-caps/nvidia-cap4322"
            ]
        );

        // The UVM module "unloaded": read at once, and kept when the backend starts again.
        std::fs::write(
            root.join("devices"),
            DEVICES.replace("510 nvidia-uvm\n", ""),
        )
        .unwrap();
        assert_eq!(proc.device_majors().uvm, None);
        let again = FakeProc::beside(Some(&state)).unwrap();
        assert_eq!(again.device_majors().uvm, None);

        let memory = FakeProc::beside(None).unwrap();
        assert_eq!(memory.device_majors().uvm, Some(510));
    }
}
