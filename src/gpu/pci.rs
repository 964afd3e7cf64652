//! The PCI side of a GPU in sysfs, for VFIO passthrough: which NVIDIA GPUs sit on the bus, which
//! driver each function is bound to, which IOMMU group it is in, and how a function moves between
//! drivers. The moves are the kernel's own interface (`driver_override`, the driver's `unbind`, the
//! bus's `drivers_probe`, the driver's `bind`), written through a [`SysfsWriter`]: on a node the
//! writes go to `/sys` and the kernel acts on them; the fake backend's writer acts on a fake tree as
//! the kernel would (`fake_pci.rs`). Reads are plain file reads in both.
//!
//! ```text
//! <root>/bus/pci/devices/<address>/{vendor,device,class,driver_override}
//! <root>/bus/pci/devices/<address>/driver      -> .../bus/pci/drivers/<name>
//! <root>/bus/pci/devices/<address>/iommu_group -> .../kernel/iommu_groups/<n>
//! <root>/bus/pci/drivers/<name>/{bind,unbind}, <root>/bus/pci/drivers_probe
//! <root>/kernel/iommu_groups/<n>/devices/<address>
//! ```

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;

/// The kernel driver VFIO passthrough binds a GPU to.
pub const VFIO_PCI: &str = "vfio-pci";
/// NVIDIA's PCI vendor id.
const NVIDIA_VENDOR: &str = "0x10de";

/// One NVIDIA GPU function on the PCI bus, as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciGpu {
    /// `0000:18:00.0`.
    pub address: String,
    /// `0x10de`.
    pub vendor_id: String,
    /// `0x2330`.
    pub device_id: String,
    /// The driver it is bound to now (`nvidia`, `vfio-pci`), if any.
    pub driver: Option<String>,
    /// Its IOMMU group; `None` where the node has no IOMMU (passthrough impossible).
    pub iommu_group: Option<u32>,
}

/// One function of an IOMMU group and the driver it is bound to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PciFunction {
    pub address: String,
    /// The driver it was bound to; `None`: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
}

#[derive(Debug, Error)]
pub enum PciError {
    #[error("PCI device {address}: {what}: {source}")]
    Io {
        address: String,
        what: String,
        source: io::Error,
    },
    #[error("PCI device {address}: {reason}")]
    Refused { address: String, reason: String },
}

/// How writes to sysfs attributes reach the kernel.
pub trait SysfsWriter: Send + Sync + fmt::Debug {
    /// Writes `value` to the attribute at `path`, as one `write(2)`; the error is the kernel's.
    fn write(&self, path: &Path, value: &str) -> io::Result<()>;
    /// Whether a process has the function open, so that its driver cannot let it go now.
    fn in_use(&self, root: &Path, address: &str) -> io::Result<bool>;
}

/// The node's own kernel: the attribute is opened for writing (never created) and written.
#[derive(Debug)]
pub struct KernelWrites;

impl SysfsWriter for KernelWrites {
    fn write(&self, path: &Path, value: &str) -> io::Result<()> {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new().write(true).open(path)?;
        file.write_all(value.as_bytes())
    }

    /// As NVIDIA's driver checks before it unbinds a GPU (`fuser` on its device file): a GPU the
    /// NVIDIA driver holds is in use while a process has `/dev/nvidia<minor>` open, its minor read
    /// from `/proc/driver/nvidia/gpus/<address>/information`. Other functions are not checked.
    fn in_use(&self, root: &Path, address: &str) -> io::Result<bool> {
        let driver = link_target_name(&root.join("bus/pci/devices").join(address).join("driver"))?;
        if driver.as_deref() != Some("nvidia") {
            return Ok(false);
        }
        let info = format!("/proc/driver/nvidia/gpus/{address}/information");
        let Some(minor) = std::fs::read_to_string(info)?.lines().find_map(|l| {
            l.strip_prefix("Device Minor:")
                .map(|m| m.trim().to_string())
        }) else {
            return Ok(false);
        };
        let device_file = PathBuf::from(format!("/dev/nvidia{minor}"));
        for process in std::fs::read_dir("/proc")?.flatten() {
            let Ok(fds) = std::fs::read_dir(process.path().join("fd")) else {
                continue;
            };
            if fds
                .flatten()
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == device_file))
            {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// The PCI part of a sysfs tree at `root` (`/sys` on a node).
#[derive(Debug, Clone)]
pub struct PciSysfs {
    root: PathBuf,
    writer: Arc<dyn SysfsWriter>,
}

impl PciSysfs {
    /// The node's sysfs at `root` (`/sys`), written through the kernel.
    pub fn host(root: &Path) -> Self {
        Self::with_writer(root, Arc::new(KernelWrites))
    }

    pub fn with_writer(root: &Path, writer: Arc<dyn SysfsWriter>) -> Self {
        PciSysfs {
            root: root.to_path_buf(),
            writer,
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn device_dir(&self, address: &str) -> PathBuf {
        self.root.join("bus/pci/devices").join(address)
    }

    fn io(address: &str, what: impl Into<String>) -> impl FnOnce(io::Error) -> PciError {
        let (address, what) = (address.to_string(), what.into());
        move |source| PciError::Io {
            address,
            what,
            source,
        }
    }

    /// Every NVIDIA display or 3D controller function on the bus, in address order. A node without
    /// a PCI bus in sysfs has none.
    pub fn nvidia_gpus(&self) -> Result<Vec<PciGpu>, PciError> {
        let dir = self.root.join("bus/pci/devices");
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Self::io("*", "listing the PCI bus")(e)),
        };
        let mut gpus = Vec::new();
        for entry in entries.flatten() {
            let address = entry.file_name().to_string_lossy().into_owned();
            let read = |name: &str| read_trimmed(&dir.join(&address).join(name));
            let (Some(vendor), Some(class)) = (read("vendor"), read("class")) else {
                continue;
            };
            // Class 0x03xxxx: display controllers (VGA 0x0300, 3D 0x0302).
            if vendor != NVIDIA_VENDOR || !class.starts_with("0x03") {
                continue;
            }
            gpus.push(PciGpu {
                vendor_id: vendor,
                device_id: read("device").unwrap_or_default(),
                driver: self.driver(&address)?,
                iommu_group: self.iommu_group(&address)?,
                address,
            });
        }
        gpus.sort_by(|a, b| a.address.cmp(&b.address));
        Ok(gpus)
    }

    /// The driver `address` is bound to: the last part of its `driver` link.
    pub fn driver(&self, address: &str) -> Result<Option<String>, PciError> {
        link_target_name(&self.device_dir(address).join("driver"))
            .map_err(Self::io(address, "reading its driver link"))
    }

    /// The IOMMU group of `address`: the last part of its `iommu_group` link.
    pub fn iommu_group(&self, address: &str) -> Result<Option<u32>, PciError> {
        let name = link_target_name(&self.device_dir(address).join("iommu_group"))
            .map_err(Self::io(address, "reading its iommu_group link"))?;
        match name {
            None => Ok(None),
            Some(name) => name.parse().map(Some).map_err(|_| PciError::Refused {
                address: address.to_string(),
                reason: format!("its iommu_group link names {name:?}, not a group number"),
            }),
        }
    }

    /// Every function of IOMMU group `group`, with its driver now, in address order.
    pub fn group_functions(&self, group: u32) -> Result<Vec<PciFunction>, PciError> {
        let dir = self
            .root
            .join("kernel/iommu_groups")
            .join(group.to_string())
            .join("devices");
        let what = format!("IOMMU group {group}");
        let mut addresses: Vec<String> = std::fs::read_dir(&dir)
            .map_err(Self::io(&what, "listing its devices"))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        addresses.sort();
        addresses
            .into_iter()
            .map(|address| {
                Ok(PciFunction {
                    driver: self.driver(&address)?,
                    address,
                })
            })
            .collect()
    }

    /// Binds `address` to `driver` as NVIDIA's driver does: `driver_override` names the driver (so
    /// that no other driver takes the function in between), the current driver lets it go, and the
    /// bus probes it again. Already bound to `driver`: nothing to do. Checked afterwards: a probe
    /// that found no driver (the module is not loaded) is an error naming it.
    pub fn bind(&self, address: &str, driver: &str) -> Result<(), PciError> {
        if self.driver(address)?.as_deref() == Some(driver) {
            return Ok(());
        }
        let dir = self.device_dir(address);
        self.writer
            .write(&dir.join("driver_override"), driver)
            .map_err(Self::io(
                address,
                format!("writing driver_override {driver:?}"),
            ))?;
        self.unbind(address)?;
        self.writer
            .write(&self.root.join("bus/pci/drivers_probe"), address)
            .map_err(Self::io(address, "writing drivers_probe"))?;
        match self.driver(address)? {
            Some(bound) if bound == driver => Ok(()),
            other => Err(PciError::Refused {
                address: address.to_string(),
                reason: format!(
                    "probing it found {} instead of {driver} (is the {driver} module loaded?)",
                    other.map_or("no driver".to_string(), |d| format!("driver {d}"))
                ),
            }),
        }
    }

    /// Gives `address` back to `original` (or to no driver): `driver_override` cleared, the current
    /// driver lets it go, and `original` binds it by its own id table. Already there: nothing to do.
    pub fn restore(&self, address: &str, original: Option<&str>) -> Result<(), PciError> {
        let now = self.driver(address)?;
        let dir = self.device_dir(address);
        // Cleared first, so that the driver's own id table decides again (the kernel takes "\n").
        self.writer
            .write(&dir.join("driver_override"), "\n")
            .map_err(Self::io(address, "clearing driver_override"))?;
        if now.as_deref() == original {
            return Ok(());
        }
        self.unbind(address)?;
        let Some(original) = original else {
            return Ok(());
        };
        self.writer
            .write(
                &self
                    .root
                    .join("bus/pci/drivers")
                    .join(original)
                    .join("bind"),
                address,
            )
            .map_err(Self::io(address, format!("binding it to {original}")))?;
        Ok(())
    }

    /// Whether a process has `address` open (see [`SysfsWriter::in_use`]).
    pub fn in_use(&self, address: &str) -> Result<bool, PciError> {
        self.writer
            .in_use(&self.root, address)
            .map_err(Self::io(address, "checking whether it is in use"))
    }

    /// Lets the function's driver go, if it has one.
    fn unbind(&self, address: &str) -> Result<(), PciError> {
        let Some(current) = self.driver(address)? else {
            return Ok(());
        };
        self.writer
            .write(
                &self
                    .root
                    .join("bus/pci/drivers")
                    .join(&current)
                    .join("unbind"),
                address,
            )
            .map_err(Self::io(address, format!("unbinding it from {current}")))
    }
}

/// The file name a symlink points at (`../../bus/pci/drivers/nvidia` → `nvidia`); `None` where
/// there is no link.
fn link_target_name(path: &Path) -> io::Result<Option<String>> {
    match std::fs::read_link(path) {
        Ok(target) => Ok(target
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|text| text.trim().to_string())
}
