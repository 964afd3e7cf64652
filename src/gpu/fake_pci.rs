//! The fake backend's `/sys`: its GPUs (and the functions that share their IOMMU groups) on a fake
//! PCI bus, bound to drivers, and a kernel double that acts on writes to the tree as Linux does
//! (`drivers/base/bus.c`, `drivers/pci/pci-driver.c`, `drivers/pci/pci-sysfs.c`):
//!
//! - `driver_override`: the text names the only driver that may bind the function; an empty text or
//!   a newline clears it; a text of a page or more is `EINVAL`.
//! - `drivers/<d>/unbind`: `ENODEV` unless the function is bound to `d`. The kernel's remove cannot
//!   fail: NVIDIA's driver (and vfio-pci) wait in it until every user has closed the device. The
//!   double refuses such an unbind with `EBUSY` instead of hanging, so a caller that skips the "in
//!   use" check fails here, as it would hang on a node.
//! - `drivers/<d>/bind`: `ENODEV` unless `d` matches the function (its override, or else its id
//!   table: `nvidia` takes NVIDIA display controllers, `snd_hda_intel` audio functions, `vfio-pci`
//!   nothing without an override); `EBUSY` when the function has a driver (`__driver_probe_device`;
//!   kernels before 5.13 answered `ENODEV` there).
//! - `drivers_probe`: binds an unbound function to the driver that matches, if any (success without
//!   a match, as in the kernel: the caller checks the `driver` link).
//! - any other attribute: `EACCES` (read-only), a path that does not exist: `ENOENT`.
//!
//! Kept beside the state file (`<state>.sys/`) so that bindings outlive plugin restarts as on a node;
//! without one, in a temporary directory the backend owns.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::errno::Errno;

use super::pci::{PciSysfs, SysfsWriter, VFIO_PCI};
use super::profiles::FakeProfile;
use super::GpuError;

/// The drivers of the fake node, each with `bind` and `unbind`.
const DRIVERS: [&str; 3] = ["nvidia", VFIO_PCI, "snd_hda_intel"];
/// A GPU's HDMI audio function (class 0x0403), function 1 of the GPU's slot.
const AUDIO_CLASS: &str = "0x040300";
const GPU_CLASS: &str = "0x030200";

/// The fake `/sys` and its kernel.
#[derive(Debug)]
pub(super) struct FakeSys {
    root: PathBuf,
    /// Keeps a temporary root alive as long as the backend.
    _temp: Option<tempfile::TempDir>,
    kernel: Arc<FakeKernel>,
}

impl FakeSys {
    pub(super) fn beside(state_file: Option<&Path>) -> Result<Self, GpuError> {
        let failed = |source| GpuError::Unavailable {
            backend: "fake".into(),
            reason: format!("its fake /sys: {source}"),
        };
        let (root, temp) = match state_file {
            Some(state) => (state.with_extension("sys"), None),
            None => {
                let temp = tempfile::Builder::new()
                    .prefix("gpu-dra-fake-sys")
                    .tempdir()
                    .map_err(failed)?;
                (temp.path().to_path_buf(), Some(temp))
            }
        };
        Ok(FakeSys {
            kernel: Arc::new(FakeKernel {
                root: root.clone(),
                lock: Mutex::new(BTreeSet::new()),
            }),
            root,
            _temp: temp,
        })
    }

    /// Adds what the profile has and the tree lacks (a new GPU, a new driver), and takes the
    /// profile's `inUse` list; functions already there keep their binding. Returns the PCI view.
    pub(super) fn sync(&self, profile: &FakeProfile) -> Result<PciSysfs, GpuError> {
        let failed = |source: io::Error| GpuError::Unavailable {
            backend: "fake".into(),
            reason: format!("writing its fake /sys at {}: {source}", self.root.display()),
        };
        let pci = self.root.join("bus/pci");
        for driver in DRIVERS {
            let dir = pci.join("drivers").join(driver);
            std::fs::create_dir_all(&dir).map_err(failed)?;
            for file in ["bind", "unbind"] {
                touch(&dir.join(file)).map_err(failed)?;
            }
        }
        touch(&pci.join("drivers_probe")).map_err(failed)?;
        for function in layout(profile) {
            let dir = pci.join("devices").join(&function.address);
            if dir.exists() {
                continue;
            }
            std::fs::create_dir_all(&dir).map_err(failed)?;
            for (name, text) in [
                ("vendor", function.vendor),
                ("device", function.device),
                ("class", function.class),
                ("driver_override", "(null)"),
            ] {
                std::fs::write(dir.join(name), format!("{text}\n")).map_err(failed)?;
            }
            let group = self
                .root
                .join("kernel/iommu_groups")
                .join(function.group.to_string())
                .join("devices");
            std::fs::create_dir_all(&group).map_err(failed)?;
            symlink(
                &format!("../../../../bus/pci/devices/{}", function.address),
                &group.join(&function.address),
            )
            .map_err(failed)?;
            symlink(
                &format!("../../../../kernel/iommu_groups/{}", function.group),
                &dir.join("iommu_group"),
            )
            .map_err(failed)?;
            symlink(
                &format!("../../drivers/{}", function.driver),
                &dir.join("driver"),
            )
            .map_err(failed)?;
        }
        *super::fake::lock(&self.kernel.lock) = profile.pci.in_use.iter().cloned().collect();
        Ok(PciSysfs::with_writer(&self.root, self.kernel.clone()))
    }
}

/// One function of the fake bus as first made.
struct Function {
    address: String,
    vendor: &'static str,
    device: &'static str,
    class: &'static str,
    driver: &'static str,
    group: u32,
}

/// The profile's GPUs (and audio functions) with their IOMMU groups: one group per GPU, numbered
/// in address order from 10, its audio function in it; the profile's `sharedIommuGroups` merge
/// the groups of the functions each lists (with their audio functions) into the first one's.
fn layout(profile: &FakeProfile) -> Vec<Function> {
    let mut addresses: Vec<&str> = profile.gpus.iter().map(|g| g.pci_bus_id.as_str()).collect();
    addresses.sort();
    let mut group_of: BTreeMap<String, u32> = BTreeMap::new();
    let mut functions = Vec::new();
    for (rank, address) in addresses.into_iter().enumerate() {
        let group = 10 + rank as u32;
        group_of.insert(address.to_string(), group);
        functions.push(Function {
            address: address.to_string(),
            vendor: "0x10de",
            device: "0x26b9",
            class: GPU_CLASS,
            driver: "nvidia",
            group,
        });
        if profile.pci.audio_functions {
            if let Some(slot) = address.strip_suffix(".0") {
                let audio = format!("{slot}.1");
                group_of.insert(audio.clone(), group);
                functions.push(Function {
                    address: audio,
                    vendor: "0x10de",
                    device: "0x22ba",
                    class: AUDIO_CLASS,
                    driver: "snd_hda_intel",
                    group,
                });
            }
        }
    }
    for shared in &profile.pci.shared_iommu_groups {
        let Some(first) = shared.first().and_then(|a| group_of.get(a)).copied() else {
            continue;
        };
        let merged: BTreeSet<u32> = shared
            .iter()
            .filter_map(|a| group_of.get(a))
            .copied()
            .collect();
        for function in functions.iter_mut() {
            if merged.contains(&function.group) {
                function.group = first;
            }
        }
    }
    functions
}

/// The kernel double: acts on writes to the fake tree. One write at a time (the device lock).
#[derive(Debug)]
struct FakeKernel {
    root: PathBuf,
    /// Functions a process holds open (the profile's `pci.inUse`), under the lock writes take.
    lock: Mutex<BTreeSet<String>>,
}

fn errno(errno: Errno) -> io::Error {
    io::Error::from_raw_os_error(errno as i32)
}

impl SysfsWriter for FakeKernel {
    fn write(&self, path: &Path, value: &str) -> io::Result<()> {
        let in_use = super::fake::lock(&self.lock);
        let relative = path
            .strip_prefix(&self.root)
            .map_err(|_| errno(Errno::ENOENT))?;
        let parts: Vec<&str> = relative.iter().filter_map(|p| p.to_str()).collect();
        let devices = self.root.join("bus/pci/devices");
        let text = value.trim_end_matches('\n');
        // A driver that is not loaded has no directory: its attributes do not exist.
        if !path.exists() {
            return Err(errno(Errno::ENOENT));
        }
        match parts.as_slice() {
            ["bus", "pci", "devices", address, "driver_override"] => {
                let file = devices.join(address).join("driver_override");
                if !file.exists() {
                    return Err(errno(Errno::ENOENT));
                }
                if value.len() >= 4096 {
                    return Err(errno(Errno::EINVAL));
                }
                let stored = if text.is_empty() { "(null)" } else { text };
                std::fs::write(file, format!("{stored}\n"))
            }
            ["bus", "pci", "drivers", driver, "unbind"] => {
                let device = self.device(text)?;
                if bound_to(&device)?.as_deref() != Some(*driver) {
                    return Err(errno(Errno::ENODEV));
                }
                if in_use.contains(text) {
                    return Err(errno(Errno::EBUSY));
                }
                std::fs::remove_file(device.join("driver"))
            }
            ["bus", "pci", "drivers", driver, "bind"] => {
                let device = self.device(text)?;
                if !matches(driver, &device) {
                    return Err(errno(Errno::ENODEV));
                }
                if bound_to(&device)?.is_some() {
                    return Err(errno(Errno::EBUSY));
                }
                symlink(&format!("../../drivers/{driver}"), &device.join("driver"))
            }
            ["bus", "pci", "drivers_probe"] => {
                let device = self.device(text)?;
                if bound_to(&device)?.is_some() {
                    return Ok(());
                }
                let loaded =
                    |driver: &&str| self.root.join("bus/pci/drivers").join(driver).is_dir();
                match DRIVERS
                    .into_iter()
                    .find(|driver| loaded(driver) && matches(driver, &device))
                {
                    Some(driver) => {
                        symlink(&format!("../../drivers/{driver}"), &device.join("driver"))
                    }
                    None => Ok(()),
                }
            }
            _ => Err(errno(Errno::EACCES)),
        }
    }

    fn in_use(&self, _root: &Path, address: &str) -> io::Result<bool> {
        Ok(self.in_use_now(address))
    }
}

impl FakeKernel {
    fn in_use_now(&self, address: &str) -> bool {
        super::fake::lock(&self.lock).contains(address)
    }

    fn device(&self, address: &str) -> io::Result<PathBuf> {
        let dir = self.root.join("bus/pci/devices").join(address);
        if address.is_empty() || address.contains('/') || !dir.is_dir() {
            return Err(errno(Errno::ENODEV));
        }
        Ok(dir)
    }
}

/// Whether `driver` may bind the function at `device`: only its override where one is set
/// (`pci_match_device`), else the driver's id table.
fn matches(driver: &str, device: &Path) -> bool {
    let read = |name: &str| {
        std::fs::read_to_string(device.join(name))
            .map(|t| t.trim().to_string())
            .unwrap_or_default()
    };
    let over = read("driver_override");
    if over != "(null)" && !over.is_empty() {
        return over == driver;
    }
    let (vendor, class) = (read("vendor"), read("class"));
    match driver {
        "nvidia" => vendor == "0x10de" && class.starts_with("0x03"),
        "snd_hda_intel" => class.starts_with("0x0403"),
        _ => false,
    }
}

fn bound_to(device: &Path) -> io::Result<Option<String>> {
    match std::fs::read_link(device.join("driver")) {
        Ok(target) => Ok(target.file_name().map(|n| n.to_string_lossy().into_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn touch(path: &Path) -> io::Result<()> {
    if !path.exists() {
        std::fs::write(path, "")?;
    }
    Ok(())
}

fn symlink(target: &str, link: &Path) -> io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(test)]
#[path = "fake_pci_tests.rs"]
mod tests;
