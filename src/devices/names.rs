//! DRA device names and what they stand for. Names are stable across plugin restarts and parse back,
//! so a claim's allocated device finds its GPU, MIG profile and placement again:
//!
//! - `gpu-<minor>`: a whole GPU;
//! - `gpu-<minor>-mig-<profile>-<start>`: a MIG device whose compute instance spans its GPU instance
//!   (what dynamic MIG creates, and what `nvidia-smi mig -cgi <profile> -C` makes);
//! - `gpu-<minor>-mig-<profile>-<start>-ci<id>`: one of several compute instances of a GPU instance
//!   (static MIG as admins configure it with `-cci`). The suffix appears only when the compute
//!   instance does not span the whole GPU instance, so the names of existing devices did not change;
//!   `<id>` is NVML's compute instance id, unique in its GPU instance and kept until the admin
//!   changes the MIG layout.

/// What a DRA device name stands for; names are stable across restarts and parse back.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceName {
    /// A whole GPU, `gpu-<minor>`.
    Gpu { minor: u32 },
    /// A MIG device, `gpu-<minor>-mig-<profile>-<start>[-ci<id>]`: the parent's minor, the GPU
    /// instance profile in DNS-label form (`1g10gb`, `1g10gb-me`), the memory slice its placement
    /// starts at, and the compute instance id when it is one of several in the GPU instance.
    Mig {
        minor: u32,
        profile: String,
        start: u32,
        compute_instance: Option<u32>,
    },
}

impl DeviceName {
    pub fn parse(name: &str) -> Option<DeviceName> {
        let rest = name.strip_prefix("gpu-")?;
        let Some((minor, mig)) = rest.split_once("-mig-") else {
            return parse_number(rest).map(|minor| DeviceName::Gpu { minor });
        };
        let (mig, compute_instance) = match mig.rsplit_once("-ci") {
            Some((rest, id)) if !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()) => {
                (rest, Some(parse_number(id)?))
            }
            _ => (mig, None),
        };
        let (profile, start) = mig.rsplit_once('-')?;
        let profile_ok = !profile.is_empty()
            && profile
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !profile.starts_with('-')
            && !profile.ends_with('-');
        if !profile_ok {
            return None;
        }
        Some(DeviceName::Mig {
            minor: parse_number(minor)?,
            profile: profile.to_string(),
            start: parse_number(start)?,
            compute_instance,
        })
    }

    /// The minor number of the (parent) GPU.
    pub fn minor(&self) -> u32 {
        match self {
            DeviceName::Gpu { minor } | DeviceName::Mig { minor, .. } => *minor,
        }
    }
}

/// A decimal number that prints back the same (no `007`, no `+1`).
fn parse_number(text: &str) -> Option<u32> {
    if text.is_empty()
        || !text.bytes().all(|b| b.is_ascii_digit())
        || (text.len() > 1 && text.starts_with('0'))
    {
        return None;
    }
    text.parse().ok()
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceName::Gpu { minor } => write!(f, "gpu-{minor}"),
            DeviceName::Mig {
                minor,
                profile,
                start,
                compute_instance: None,
            } => write!(f, "gpu-{minor}-mig-{profile}-{start}"),
            DeviceName::Mig {
                minor,
                profile,
                start,
                compute_instance: Some(ci),
            } => write!(f, "gpu-{minor}-mig-{profile}-{start}-ci{ci}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_device_names_parse_back_and_reject_garbage() {
        let name = DeviceName::parse("gpu-3-mig-1g10gb-me-6").unwrap();
        assert_eq!(
            name,
            DeviceName::Mig {
                minor: 3,
                profile: "1g10gb-me".into(),
                start: 6,
                compute_instance: None,
            }
        );
        assert_eq!(name.to_string(), "gpu-3-mig-1g10gb-me-6");
        // One of several compute instances of a GPU instance.
        let split = DeviceName::parse("gpu-3-mig-3g40gb-4-ci2").unwrap();
        assert_eq!(
            split,
            DeviceName::Mig {
                minor: 3,
                profile: "3g40gb".into(),
                start: 4,
                compute_instance: Some(2),
            }
        );
        assert_eq!(split.to_string(), "gpu-3-mig-3g40gb-4-ci2");
        assert_eq!(
            DeviceName::parse("gpu-0-mig-1g10gb-me-6-ci0")
                .unwrap()
                .to_string(),
            "gpu-0-mig-1g10gb-me-6-ci0"
        );
        for bad in [
            "gpu-3-mig-1g10gb",
            "gpu-3-mig--6",
            "gpu-03-mig-1g10gb-6",
            "gpu-3-mig-1G10GB-6",
            "gpu-3-mig-1g10gb-06",
            "gpu-x-mig-1g10gb-6",
            "gpu-3-mig-3g40gb-4-ci",
            "gpu-3-mig-3g40gb-4-ci01",
            "gpu-3-mig-3g40gb-ci1",
            "gpu-3-mig-3g40gb-4-cix",
        ] {
            assert_eq!(DeviceName::parse(bad), None, "{bad}");
        }
    }
}
