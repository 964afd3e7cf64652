//! GPU feature discovery's classic node labels, computed from the inventory: what device-plugin users
//! select models with (`nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}`), and which label
//! changes bring a Node to them. Pure functions; the plugin's `node_labels` writer does the I/O.
//!
//! The values are GFD's (`internal/lm` of NVIDIA/k8s-device-plugin, MIG strategy `none` or `mixed`):
//! - `nvidia.com/gpu.present`: `true`;
//! - `nvidia.com/gpu.product`: the product name with spaces replaced by `-` (`NVIDIA-H100-80GB-HBM3`),
//!   never suffixed with `-MIG-...`: a GPU with MIG mode on still counts as its model, as GFD labels it
//!   under the `none` and `mixed` strategies;
//! - `nvidia.com/gpu.count`: the GPUs of that model, MIG mode on or off;
//! - `nvidia.com/gpu.memory`: the total memory of one GPU of that model in MiB (left out when unknown, as
//!   GFD does);
//! - `nvidia.com/mig.capable`: `true` when any GPU of the node is MIG capable, else `false`.
//!
//! On a node with several models GFD labels one of them, whichever its map iteration happens to end on,
//! with that model's count. Here the choice is stable: the model with the most GPUs, on a tie the product
//! name that sorts first. A node without a readable GPU gets none of the labels (GFD writes none either).
//! GPUs that cannot be read (lost, in a MIG mode change) are not counted until they can be read again.

use std::collections::BTreeMap;

use crate::gpu::Inventory;

pub const PRESENT: &str = "nvidia.com/gpu.present";
pub const PRODUCT: &str = "nvidia.com/gpu.product";
pub const COUNT: &str = "nvidia.com/gpu.count";
pub const MEMORY: &str = "nvidia.com/gpu.memory";
pub const MIG_CAPABLE: &str = "nvidia.com/mig.capable";
/// Every key this module may set; the plugin writes no other label (the admission policy enforces it).
pub const KEYS: [&str; 5] = [PRESENT, PRODUCT, COUNT, MEMORY, MIG_CAPABLE];

/// The API's limit on a label value.
const MAX_VALUE: usize = 63;

/// Node labels by key.
pub type Labels = BTreeMap<String, String>;

/// Label changes for a JSON merge patch of `metadata.labels`: `Some` sets a value, `None` removes the key.
pub type LabelChanges = BTreeMap<String, Option<String>>;

/// The labels GFD would write for `inventory` (see the module comment); empty without a readable GPU.
pub fn classic_labels(inventory: &Inventory) -> Labels {
    let mut models: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for gpu in &inventory.gpus {
        let (count, memory) = models
            .entry(gpu.product_name.as_str())
            .or_insert((0, u64::MAX));
        *count += 1;
        // One model, one size; the smallest is what every GPU of it offers at least.
        *memory = (*memory).min(gpu.memory_bytes);
    }
    // The most GPUs, then the name that sorts first.
    let Some((product, (count, memory_bytes))) = models
        .into_iter()
        .max_by_key(|(name, (count, _))| (*count, std::cmp::Reverse(*name)))
    else {
        return Labels::new();
    };
    let mut labels = Labels::new();
    labels.insert(PRESENT.into(), "true".into());
    if let Some(product) = label_value(&product.replace(' ', "-")) {
        labels.insert(PRODUCT.into(), product);
    }
    labels.insert(COUNT.into(), count.to_string());
    let memory_mib = memory_bytes / (1024 * 1024);
    if memory_mib > 0 {
        labels.insert(MEMORY.into(), memory_mib.to_string());
    }
    let mig_capable = inventory.gpus.iter().any(|gpu| gpu.mig.is_some());
    labels.insert(MIG_CAPABLE.into(), mig_capable.to_string());
    labels
}

/// `text` as a valid label value: characters other than ASCII letters, digits, `-`, `_` and `.` become
/// `-`, at most 63 characters, starting and ending with a letter or digit; `None` when nothing is left.
/// Product names NVML reports are valid once spaces are dashes, so this changes none GFD writes.
pub fn label_value(text: &str) -> Option<String> {
    let replaced: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    // Every character is ASCII now, so byte offsets are character boundaries.
    let trimmed = replaced.trim_start_matches(|c: char| !c.is_ascii_alphanumeric());
    let cut = &trimmed[..trimmed.len().min(MAX_VALUE)];
    let value = cut.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    (!value.is_empty()).then(|| value.to_string())
}

/// What to change on a Node labelled `current` so that it carries `desired` (`None`: the setting is off),
/// given the labels this plugin wrote before (`written`). A key it wrote that is no longer desired is
/// removed only while the Node still holds the value it wrote: a value someone else set is theirs. Keys
/// outside [`KEYS`] are never touched.
pub fn changes(desired: Option<&Labels>, written: &Labels, current: &Labels) -> LabelChanges {
    let empty = Labels::new();
    let desired = desired.unwrap_or(&empty);
    let mut changes = LabelChanges::new();
    for (key, value) in desired.iter().filter(|(k, _)| KEYS.contains(&k.as_str())) {
        if current.get(key) != Some(value) {
            changes.insert(key.clone(), Some(value.clone()));
        }
    }
    for (key, value) in written.iter().filter(|(k, _)| KEYS.contains(&k.as_str())) {
        if !desired.contains_key(key) && current.get(key) == Some(value) {
            changes.insert(key.clone(), None);
        }
    }
    changes
}

#[cfg(test)]
#[path = "node_labels_tests.rs"]
mod tests;
