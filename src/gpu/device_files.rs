//! The NVIDIA driver's device files as containers get them, with their numbers. A CDI device node
//! without type and major/minor makes the runtime stat its host path, and the container fails ("failed
//! to stat CDI host device") where the host has no such file: a MIG capability file, which the driver
//! never makes, or `/dev/nvidia-uvm` before anything made it. So the numbers go into every spec: the
//! majors from `/proc/devices`, read through the driver root where it has one, else this container's.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::caps::{CapsError, MigMinors, CAPS_DEVICE_DIR, MIG_MINORS};

/// The major the NVIDIA kernel module always registers (`NV_MAJOR_DEVICE_NUMBER`) for
/// `/dev/nvidia<N>` (minor N) and `/dev/nvidiactl` (minor 255).
pub const NVIDIA_MAJOR: u32 = 195;
const CONTROL_MINOR: u32 = 255;
/// `/dev/nvidia-modeset`'s minor under [`NVIDIA_MAJOR`], as the driver and the Container Toolkit make it.
const MODESET_MINOR: u32 = 254;

pub const CONTROL: &str = "/dev/nvidiactl";
/// CUDA cannot initialise without it (unified memory); `-tools` is for profilers.
pub const UVM: &str = "/dev/nvidia-uvm";
pub const UVM_TOOLS: &str = "/dev/nvidia-uvm-tools";
/// The `nvidia-modeset` module's file (display and graphics: Vulkan, EGL); only where the host has it.
pub const MODESET: &str = "/dev/nvidia-modeset";
/// Where the IMEX channels' device files live (`channel<N>`, minor N).
pub const IMEX_CHANNEL_DIR: &str = "/dev/nvidia-caps-imex-channels";

/// `/proc/devices` below a `/proc`.
const DEVICES: &str = "devices";

#[derive(Debug, thiserror::Error)]
pub enum DeviceFileError {
    #[error("{}: {reason}", path.display())]
    NotACharacterDevice { path: PathBuf, reason: String },
}

/// The device files every GPU container needs besides its GPUs' own, whatever the plugin's own
/// `/dev` holds: that is a snapshot of when its container started, and not the host's. With
/// `modeset`, also `/dev/nvidia-modeset`, which the Container Toolkit adds only where the host has it
/// (the `nvidia-modeset` module loaded): a spec naming a file the host lacks would give containers a
/// device no driver answers.
pub fn control_device_files(modeset: bool) -> Vec<String> {
    let mut files = vec![CONTROL, UVM, UVM_TOOLS];
    if modeset {
        files.push(MODESET);
    }
    files.into_iter().map(str::to_string).collect()
}

/// Whether the host has `/dev/nvidia-modeset`, seen through the driver root's `dev` at `dev_dir` (the
/// host's `/dev` where the driver root is `/`): a character device there, not just a name.
pub fn has_modeset(dev_dir: &Path) -> bool {
    let path = dev_dir.join(MODESET.trim_start_matches("/dev/"));
    DeviceNumber::of_character_device(&path).is_ok()
}

/// The major and minor number of a character device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceNumber {
    pub major: u32,
    pub minor: u32,
}

impl DeviceNumber {
    /// The numbers of the character device at `path` on this machine.
    pub fn of_character_device(path: &Path) -> Result<Self, DeviceFileError> {
        let failed = |reason: String| DeviceFileError::NotACharacterDevice {
            path: path.to_path_buf(),
            reason,
        };
        let meta = std::fs::metadata(path).map_err(|e| failed(e.to_string()))?;
        if !meta.file_type().is_char_device() {
            return Err(failed("not a character device".into()));
        }
        let rdev = meta.rdev();
        Ok(DeviceNumber {
            major: nix::sys::stat::major(rdev) as u32,
            minor: nix::sys::stat::minor(rdev) as u32,
        })
    }
}

/// The majors the driver's modules registered, from `/proc/devices`: `None` for a module that is not
/// loaded (or a list that could not be read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMajors {
    /// `nvidia-caps`: the MIG capability files.
    pub caps: Option<u32>,
    /// `nvidia-uvm`: `/dev/nvidia-uvm` (minor 0) and `/dev/nvidia-uvm-tools` (minor 1).
    pub uvm: Option<u32>,
    /// `nvidia-caps-imex-channels`: `/dev/nvidia-caps-imex-channels/channel<N>` (minor N).
    pub imex_channels: Option<u32>,
    /// The file they were read from, for messages.
    pub source: PathBuf,
    /// Why that file could not be read, if it could not.
    pub unreadable: Option<String>,
}

impl DeviceMajors {
    /// Parses `/proc/devices`: only its character devices count.
    pub fn parse(source: &Path, text: &str) -> Self {
        let mut majors = DeviceMajors {
            caps: None,
            uvm: None,
            imex_channels: None,
            source: source.to_path_buf(),
            unreadable: None,
        };
        let characters = text
            .lines()
            .skip_while(|line| line.trim() != "Character devices:")
            .skip(1)
            .take_while(|line| line.trim() != "Block devices:");
        for line in characters {
            let mut fields = line.split_whitespace();
            let (Some(major), Some(name), None) = (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            let Ok(major) = major.parse::<u32>() else {
                continue;
            };
            let slot = match name {
                "nvidia-caps" => &mut majors.caps,
                "nvidia-uvm" => &mut majors.uvm,
                "nvidia-caps-imex-channels" => &mut majors.imex_channels,
                _ => continue,
            };
            slot.get_or_insert(major);
        }
        majors
    }

    /// The numbers of a driver device file a container sees at `path`, where they are known.
    pub fn number_of(&self, path: &str) -> Option<DeviceNumber> {
        let number = |major, minor| Some(DeviceNumber { major, minor });
        match path {
            CONTROL => number(NVIDIA_MAJOR, CONTROL_MINOR),
            MODESET => number(NVIDIA_MAJOR, MODESET_MINOR),
            UVM => number(self.uvm?, 0),
            UVM_TOOLS => number(self.uvm?, 1),
            _ => {
                if let Some(minor) = path.strip_prefix("/dev/nvidia").and_then(decimal) {
                    return number(NVIDIA_MAJOR, minor);
                }
                if let Some(channel) = path
                    .strip_prefix(IMEX_CHANNEL_DIR)
                    .and_then(|rest| rest.strip_prefix("/channel"))
                    .and_then(decimal)
                {
                    return number(self.imex_channels?, channel);
                }
                let minor = path
                    .strip_prefix(CAPS_DEVICE_DIR)?
                    .strip_prefix("/nvidia-cap")
                    .and_then(decimal)?;
                number(self.caps?, minor)
            }
        }
    }
}

/// A device minor as the driver's tools write it in a file name: decimal digits, no leading zero.
fn decimal(text: &str) -> Option<u32> {
    let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    (digits && (text == "0" || !text.starts_with('0')))
        .then(|| text.parse().ok())
        .flatten()
}

/// The `/proc` files the NVIDIA driver writes, read at the first of its roots that has them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverProc {
    roots: Vec<PathBuf>,
}

impl DriverProc {
    /// The driver root's `/proc` where it has the file (a driver container's, or a test's stand-in),
    /// then this container's: the kernel's `/proc` is the same for all.
    pub fn new(driver_root: &Path) -> Self {
        let mut roots = vec![driver_root.join("proc")];
        if roots[0] != Path::new("/proc") {
            roots.push(PathBuf::from("/proc"));
        }
        DriverProc { roots }
    }

    /// Only `proc_root`: the fake backend's, which must never fall back to the host's.
    pub fn at(proc_root: &Path) -> Self {
        DriverProc {
            roots: vec![proc_root.to_path_buf()],
        }
    }

    /// Where `relative` is read: the first root that has it, else the last root's path.
    fn locate(&self, relative: &str) -> PathBuf {
        let mut candidates = self.roots.iter().map(|root| root.join(relative));
        let last = candidates.next_back().unwrap_or_else(|| relative.into());
        candidates.find(|p| p.exists()).unwrap_or(last)
    }

    /// The driver's majors; an unreadable list leaves them unknown, with the reason.
    pub fn device_majors(&self) -> DeviceMajors {
        let path = self.locate(DEVICES);
        match std::fs::read_to_string(&path) {
            Ok(text) => DeviceMajors::parse(&path, &text),
            Err(e) => DeviceMajors {
                unreadable: Some(e.to_string()),
                ..DeviceMajors::parse(&path, "")
            },
        }
    }

    /// The driver's MIG capability table.
    pub fn mig_minors(&self) -> Result<MigMinors, CapsError> {
        MigMinors::read(&self.locate(MIG_MINORS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/proc/devices` of a node with the driver and its MIG and UVM modules loaded.
    const PROC_DEVICES: &str = "Character devices:\n  1 mem\n  5 /dev/tty\n195 nvidia-frontend\n\
        234 nvidia-caps-imex-channels\n237 nvidia-caps\n510 nvidia-uvm\n\nBlock devices:\n  7 loop\n\
        511 nvidia-uvm\n";

    #[test]
    fn majors_come_from_the_character_devices_only() {
        let majors = DeviceMajors::parse(Path::new("/proc/devices"), PROC_DEVICES);
        assert_eq!((majors.caps, majors.uvm), (Some(237), Some(510)));
        assert_eq!(majors.imex_channels, Some(234));
        // Not a prefix match: the IMEX channels are another device.
        let imex_only = "Character devices:\n234 nvidia-caps-imex-channels\nBlock devices:\n";
        let majors = DeviceMajors::parse(Path::new("p"), imex_only);
        assert_eq!((majors.caps, majors.uvm), (None, None));
        assert_eq!(majors.imex_channels, Some(234));
        // A block device of that name is not the UVM module.
        let block_only = "Character devices:\n  1 mem\nBlock devices:\n510 nvidia-uvm\n";
        assert_eq!(DeviceMajors::parse(Path::new("p"), block_only).uvm, None);
    }

    #[test]
    fn device_files_get_the_drivers_numbers_where_known() {
        let majors = DeviceMajors::parse(Path::new("/proc/devices"), PROC_DEVICES);
        let n = |major, minor| Some(DeviceNumber { major, minor });
        for (path, expected) in [
            ("/dev/nvidia0", n(195, 0)),
            ("/dev/nvidia7", n(195, 7)),
            ("/dev/nvidiactl", n(195, 255)),
            ("/dev/nvidia-uvm", n(510, 0)),
            ("/dev/nvidia-uvm-tools", n(510, 1)),
            ("/dev/nvidia-caps/nvidia-cap12", n(237, 12)),
            ("/dev/nvidia-modeset", n(195, 254)),
            ("/dev/nvidia01", None),
            ("/dev/nvidia-caps/nvidia-cap", None),
            ("/dev/nvidia-caps/nvidia-cap1x", None),
            ("/dev/nvidia-caps-imex-channels/channel1", n(234, 1)),
            ("/dev/nvidia-caps-imex-channels/channel2047", n(234, 2047)),
            ("/dev/nvidia-caps-imex-channels/channel01", None),
            ("/dev/nvidia-caps-imex-channels/chan1", None),
        ] {
            assert_eq!(majors.number_of(path), expected, "{path}");
        }
        // Without the UVM and caps modules their files have no numbers; the GPUs' still do.
        let bare = DeviceMajors::parse(Path::new("p"), "Character devices:\n195 nvidia\n");
        assert_eq!(bare.number_of("/dev/nvidia-uvm"), None);
        assert_eq!(bare.number_of("/dev/nvidia-caps/nvidia-cap12"), None);
        assert_eq!(
            bare.number_of("/dev/nvidia-caps-imex-channels/channel0"),
            None
        );
        assert_eq!(bare.number_of("/dev/nvidia1"), n(195, 1));
    }

    #[test]
    fn proc_files_are_read_through_the_driver_root_where_it_has_them() {
        let root = tempfile::tempdir().unwrap();
        let proc = DriverProc::new(root.path());
        // Not in the driver root: this container's /proc.
        assert_eq!(proc.device_majors().source, Path::new("/proc/devices"));

        std::fs::create_dir_all(root.path().join("proc/driver/nvidia-caps")).unwrap();
        std::fs::write(root.path().join("proc/devices"), PROC_DEVICES).unwrap();
        std::fs::write(
            root.path().join("proc/driver/nvidia-caps/mig-minors"),
            "gpu1/gi2/access 156\ngpu1/gi2/ci0/access 157\n",
        )
        .unwrap();
        let majors = proc.device_majors();
        assert_eq!(majors.source, root.path().join("proc/devices"));
        assert_eq!(majors.uvm, Some(510));
        assert_eq!(
            proc.mig_minors().unwrap().device_files(1, 2, 0).unwrap(),
            [
                "/dev/nvidia-caps/nvidia-cap156",
                "/dev/nvidia-caps/nvidia-cap157"
            ]
        );
    }

    #[test]
    fn a_proc_root_of_its_own_never_falls_back_and_says_why() {
        let root = tempfile::tempdir().unwrap();
        let majors = DriverProc::at(root.path()).device_majors();
        assert_eq!(majors.source, root.path().join("devices"));
        assert!(majors.unreadable.is_some());
        assert_eq!((majors.caps, majors.uvm), (None, None));
    }

    #[test]
    fn modeset_is_given_only_where_the_host_has_its_character_device() {
        assert_eq!(
            control_device_files(false),
            ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        );
        assert_eq!(control_device_files(true)[3], "/dev/nvidia-modeset");
        let dev = tempfile::tempdir().unwrap();
        assert!(!has_modeset(dev.path()));
        // A plain file of that name is no device node.
        std::fs::write(dev.path().join("nvidia-modeset"), b"").unwrap();
        assert!(!has_modeset(dev.path()));
        // /dev/null stands in for a character device here: tests cannot mknod.
        std::fs::remove_file(dev.path().join("nvidia-modeset")).unwrap();
        std::os::unix::fs::symlink("/dev/null", dev.path().join("nvidia-modeset")).unwrap();
        assert!(has_modeset(dev.path()));
    }

    #[test]
    fn dev_null_is_a_character_device_and_a_directory_is_not() {
        let null = DeviceNumber::of_character_device(Path::new("/dev/null")).unwrap();
        assert_eq!((null.major, null.minor), (1, 3));
        let err = DeviceNumber::of_character_device(Path::new("/dev"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/dev: not a character device"), "{err}");
    }
}
