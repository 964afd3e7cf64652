//! The IMEX channel device a node publishes: `imex-channel-0`, on nodes whose GPUs joined one NVLink
//! fabric clique (and on no other node, so the scheduler never places a domain's pod on a node without
//! fabric). It carries the clique, so a domain's claim template selects only its clique's nodes.
//!
//! One device, allocated to one claim at a time, because a node serves one ComputeDomain at a time: the
//! IMEX service is one daemon per OS instance (`nvidia-imex.service`), whose peers are the domain's
//! nodes, and NVIDIA's driver admits one domain per node. The container gets `channel0`, or with
//! `allocationMode: All` every channel the driver has (`channel0` … `channel2047`), as NVIDIA's does.

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute};

use crate::gpu::Inventory;

pub const DEVICE_PREFIX: &str = "imex-channel-";
/// The `type` attribute of a channel device.
pub const CHANNEL_TYPE: &str = "imex-channel";
/// The attributes a channel device carries besides `type`.
pub const CHANNEL_ATTRIBUTE: &str = "channel";
pub const CLIQUE_ATTRIBUTE: &str = "nvlinkDomain";
/// Where a container finds channel N, and the `/proc/devices` name of its major.
pub use crate::gpu::device_files::IMEX_CHANNEL_DIR as CHANNEL_DIR;
pub const PROC_DEVICES_NAME: &str = "nvidia-caps-imex-channels";
/// How many channel devices a fabric node publishes: channel 0, or none (`--imex-channels 0`).
pub const DEFAULT_CHANNELS: u32 = 1;
/// The channels the driver has (`NVreg_ImexChannelCount`'s default, which NVIDIA's DRA driver also
/// assumes): what `allocationMode: All` gives a container.
pub const MAX_CHANNELS: u32 = 2048;

/// Whether a DeviceClass's selectors are for IMEX channels (they compare `type` with `imex-channel`):
/// such a class is meant to match nothing on nodes outside an NVLink clique, which is no problem
/// for the DeviceClass checks.
pub fn is_channel_class<'a>(expressions: impl IntoIterator<Item = &'a str>) -> bool {
    let literal = format!("\"{CHANNEL_TYPE}\"");
    expressions.into_iter().any(|e| e.contains(&literal))
}

/// `imex-channel-<N>`.
pub fn device_name(channel: u32) -> String {
    format!("{DEVICE_PREFIX}{channel}")
}

/// The channel number of a channel device's name; `None` for every other name.
pub fn parse_device_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(DEVICE_PREFIX)?;
    if digits.is_empty()
        || !digits.bytes().all(|b| b.is_ascii_digit())
        || (digits.len() > 1 && digits.starts_with('0'))
    {
        return None;
    }
    digits.parse().ok().filter(|n| *n < MAX_CHANNELS)
}

/// The device file of channel N inside a container.
pub fn device_file(channel: u32) -> String {
    format!("{CHANNEL_DIR}/channel{channel}")
}

/// The NVLink clique of this node: the fabric domain every GPU joined, when they all joined the same
/// one. `Err` says why the node has none (for logs and `gpu-dra devices`).
pub fn node_clique(inventory: &Inventory) -> Result<String, String> {
    if inventory.gpus.is_empty() {
        return Err("the node has no GPU".into());
    }
    let mut cliques = BTreeSet::new();
    for gpu in &inventory.gpus {
        match &gpu.fabric {
            Some(fabric) => {
                cliques.insert(fabric.domain());
            }
            None => {
                return Err(format!(
                    "GPU {} has not joined an NVLink fabric (no fabric info, or its registration did not complete)",
                    gpu.uuid
                ))
            }
        }
    }
    if cliques.len() > 1 {
        return Err(format!(
            "the GPUs are in different NVLink cliques ({})",
            cliques.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(cliques.into_iter().next().unwrap_or_default())
}

/// The channel device of a node that publishes `count` (0 or 1); none where the node has no clique.
pub fn channel_devices(inventory: &Inventory, count: u32) -> Vec<Device> {
    let Ok(clique) = node_clique(inventory) else {
        return Vec::new();
    };
    (0..count.min(DEFAULT_CHANNELS))
        .map(|channel| Device {
            name: device_name(channel),
            attributes: Some(
                [
                    ("type".to_string(), string(CHANNEL_TYPE)),
                    (CHANNEL_ATTRIBUTE.to_string(), int(i64::from(channel))),
                    (CLIQUE_ATTRIBUTE.to_string(), string(&clique)),
                ]
                .into(),
            ),
            ..Default::default()
        })
        .collect()
}

fn string(value: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(value.to_string()),
        ..Default::default()
    }
}

fn int(value: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(value),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_nothing_else_does() {
        assert_eq!(parse_device_name(&device_name(7)), Some(7));
        for name in [
            "imex-channel-",
            "imex-channel-07",
            "imex-channel-x",
            "gpu-0",
            "imex-channel-2048",
        ] {
            assert_eq!(parse_device_name(name), None, "{name}");
        }
        assert_eq!(device_file(3), "/dev/nvidia-caps-imex-channels/channel3");
    }
}
