//! GFD's label values on the built-in fake profiles, mixed and MIG nodes, value sanitizing, and the
//! changes that bring a Node's labels to them.

use super::*;
use crate::gpu::{builtin_profile_names, FakeBackend, GpuBackend, UnreadableGpu};

fn inventory(profile: &str) -> Inventory {
    match FakeBackend::new("node-a", profile).and_then(|b| b.inventory()) {
        Ok(inventory) => inventory,
        Err(err) => panic!("fake profile {profile}: {err}"),
    }
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The API server's rule for a label value.
fn is_label_value(value: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    value.is_empty()
        || (value.len() <= 63
            && value.starts_with(alnum)
            && value.ends_with(alnum)
            && value.chars().all(|c| alnum(c) || "-_.".contains(c)))
}

#[test]
fn each_built_in_profile_is_labelled_as_gfd_labels_it() {
    let cases = [
        ("dgx-h100", "NVIDIA-H100-80GB-HBM3", "8", "81559", "true"),
        ("dgx-a100", "NVIDIA-A100-SXM4-40GB", "8", "40960", "true"),
        ("dgx-h200", "NVIDIA-H200", "8", "143771", "true"),
        ("a100-pcie-4", "NVIDIA-A100-PCIE-40GB", "4", "40960", "true"),
        ("l40s-4", "NVIDIA-L40S", "4", "46068", "false"),
        ("gb200-nvl72", "NVIDIA-GB200", "4", "196608", "false"),
    ];
    for (profile, product, count, memory, mig) in cases {
        let labelled = classic_labels(&inventory(profile));
        assert!(labelled.values().all(|v| is_label_value(v)), "{labelled:?}");
        assert_eq!(
            labelled,
            labels(&[
                (PRESENT, "true"),
                (PRODUCT, product),
                (COUNT, count),
                (MEMORY, memory),
                (MIG_CAPABLE, mig),
            ]),
            "{profile}"
        );
    }
    // Every built-in profile is covered above, and every value is one the API server takes.
    assert_eq!(builtin_profile_names().len(), cases.len());
}

#[test]
fn gpus_in_mig_mode_keep_the_unsuffixed_product_and_count_as_gpus() {
    let mut node = inventory("dgx-h100");
    for gpu in node.gpus.iter_mut().take(3) {
        gpu.mig.as_mut().expect("H100 is MIG capable").enabled = true;
    }
    let labelled = classic_labels(&node);
    assert_eq!(labelled[PRODUCT], "NVIDIA-H100-80GB-HBM3");
    assert_eq!(labelled[COUNT], "8");
    assert_eq!(labelled[MIG_CAPABLE], "true");
}

#[test]
fn a_mixed_node_is_labelled_for_its_most_numerous_model_then_the_first_name() {
    let h100 = inventory("dgx-h100");
    let l40s = inventory("l40s-4");
    let mut mixed = h100.clone();
    mixed.gpus.truncate(5);
    mixed.gpus.extend(l40s.gpus.iter().take(3).cloned());
    let labelled = classic_labels(&mixed);
    assert_eq!(labelled[PRODUCT], "NVIDIA-H100-80GB-HBM3");
    assert_eq!(labelled[COUNT], "5");
    assert_eq!(labelled[MEMORY], "81559");
    // Any MIG-capable GPU makes the node MIG capable, as in GFD.
    assert_eq!(labelled[MIG_CAPABLE], "true");

    // Three and three: the name that sorts first, whatever the order of the GPUs.
    mixed.gpus.remove(0);
    mixed.gpus.remove(0);
    for order in [false, true] {
        if order {
            mixed.gpus.reverse();
        }
        let labelled = classic_labels(&mixed);
        assert_eq!(
            labelled[PRODUCT], "NVIDIA-H100-80GB-HBM3",
            "reversed: {order}"
        );
        assert_eq!(labelled[COUNT], "3");
    }
}

#[test]
fn lost_gpus_are_not_counted_and_a_node_without_readable_gpus_gets_no_label() {
    let mut node = inventory("l40s-4");
    let lost = node.gpus.remove(1);
    node.unreadable.push(UnreadableGpu {
        index: 1,
        minor: Some(lost.minor),
        uuid: Some(lost.uuid),
        pci_bus_id: Some(lost.pci_bus_id),
        reason: "GPU is lost".into(),
    });
    assert_eq!(classic_labels(&node)[COUNT], "3");
    node.gpus.clear();
    assert_eq!(classic_labels(&node), Labels::new());
}

#[test]
fn unknown_memory_is_left_out() {
    let mut node = inventory("l40s-4");
    for gpu in &mut node.gpus {
        gpu.memory_bytes = 1024;
    }
    assert!(!classic_labels(&node).contains_key(MEMORY));
}

#[test]
fn product_names_become_valid_label_values() {
    let cases = [
        ("NVIDIA H100 80GB HBM3", Some("NVIDIA-H100-80GB-HBM3")),
        ("Tesla V100-SXM2-16GB", Some("Tesla-V100-SXM2-16GB")),
        (
            "Quadro RTX 6000/8000 (rev. a)",
            Some("Quadro-RTX-6000-8000--rev.-a"),
        ),
        (" -NVIDIA Ä100- ", Some("NVIDIA--100")),
        ("(((", None),
        ("", None),
    ];
    for (name, expected) in cases {
        assert_eq!(
            label_value(&name.replace(' ', "-")).as_deref(),
            expected,
            "{name:?}"
        );
    }
    // Cut to 63 characters, and what ends the cut value is alphanumeric again.
    let long = format!("{}-{}", "A".repeat(62), "B".repeat(10));
    let cut = label_value(&long).expect("a value");
    assert_eq!(cut, "A".repeat(62));
    for text in [long.as_str(), "x".repeat(200).as_str(), "é-1", "1_.-é"] {
        let value = label_value(text).unwrap_or_default();
        assert!(is_label_value(&value), "{text:?} -> {value:?}");
    }
    let mut node = inventory("l40s-4");
    for gpu in &mut node.gpus {
        gpu.product_name = "?!".into();
    }
    let labelled = classic_labels(&node);
    assert!(!labelled.contains_key(PRODUCT), "{labelled:?}");
    assert!(labelled.values().all(|v| is_label_value(v)));
}

#[test]
fn changes_set_what_differs_and_remove_only_what_still_holds_the_written_value() {
    let want = labels(&[(PRESENT, "true"), (PRODUCT, "NVIDIA-L40S"), (COUNT, "4")]);
    let none = Labels::new();
    let set = |pairs: &[(&str, &str)]| -> LabelChanges {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), Some(v.to_string())))
            .collect()
    };
    // A bare Node gets every label; a Node that has them gets nothing.
    assert_eq!(
        changes(Some(&want), &none, &none),
        set(&[(PRESENT, "true"), (PRODUCT, "NVIDIA-L40S"), (COUNT, "4")])
    );
    let mut current = want.clone();
    current.insert("kubernetes.io/hostname".into(), "node-a".into());
    assert_eq!(changes(Some(&want), &want, &current), LabelChanges::new());
    // Someone changed one: only that one is written back.
    current.insert(COUNT.into(), "2".into());
    assert_eq!(changes(Some(&want), &want, &current), set(&[(COUNT, "4")]));

    // A GPU model that no longer has a memory label: the old value goes, the rest stays.
    let mut before = want.clone();
    before.insert(MEMORY.into(), "46068".into());
    let mut on_node = before.clone();
    let expected: LabelChanges = [(MEMORY.to_string(), None)].into();
    assert_eq!(changes(Some(&want), &before, &on_node), expected);

    // Turned off: what it wrote goes, except a value someone else has set since, and other labels.
    on_node.insert(PRODUCT.into(), "pinned-by-admin".into());
    let removed: LabelChanges = [
        (PRESENT.to_string(), None),
        (COUNT.to_string(), None),
        (MEMORY.to_string(), None),
    ]
    .into();
    assert_eq!(changes(None, &before, &on_node), removed);
    // Off and nothing written: nothing changes, even where a Node has GFD's values.
    assert_eq!(changes(None, &none, &want), LabelChanges::new());
    // A record naming other keys (a hand-edited file) never makes the plugin touch them.
    let foreign = labels(&[("team", "ml")]);
    assert_eq!(changes(None, &foreign, &foreign), LabelChanges::new());
    assert_eq!(changes(Some(&foreign), &none, &none), LabelChanges::new());
}
