//! What a share of a device gets from the node's enforcement and the claim's config, and when two
//! claims on one device disagree.

use super::*;
use crate::gpu::TimeSliceInterval;

fn mps(limit: Option<u64>) -> SharingSettings {
    SharingSettings::Mps(MpsSettings {
        pinned_memory_limit_bytes: limit,
        ..MpsSettings::default()
    })
}

fn sliced(interval: TimeSliceInterval) -> SharingSettings {
    SharingSettings::TimeSlicing { interval }
}

#[test]
fn a_share_without_config_gets_the_nodes_enforcement() {
    let exclusive = SharingSettings::Exclusive;
    assert_eq!(
        share_settings(&exclusive, None, Enforcement::Mps, false),
        Ok(mps(None))
    );
    assert_eq!(
        share_settings(
            &exclusive,
            None,
            Enforcement::TimeSlicing(TimeSliceInterval::Long),
            false
        ),
        Ok(sliced(TimeSliceInterval::Long))
    );
    assert_eq!(
        share_settings(&exclusive, None, Enforcement::None, true),
        Ok(SharingSettings::Exclusive)
    );
}

#[test]
fn a_config_chooses_its_own_sharing_but_never_exclusive_nor_another_interval() {
    let long = Enforcement::TimeSlicing(TimeSliceInterval::Long);
    assert_eq!(
        share_settings(&mps(Some(1 << 30)), Some(0), Enforcement::Mps, false),
        Ok(mps(Some(1 << 30)))
    );
    assert_eq!(
        share_settings(
            &sliced(TimeSliceInterval::Long),
            Some(1),
            Enforcement::Mps,
            false
        ),
        Ok(sliced(TimeSliceInterval::Long))
    );
    let other =
        share_settings(&sliced(TimeSliceInterval::Short), Some(0), long, false).unwrap_err();
    assert!(
        other.contains("interval Short, but this node time-slices shared GPUs with interval Long"),
        "{other}"
    );
    assert_eq!(
        share_settings(&mps(None), Some(0), long, false),
        Ok(mps(None))
    );
    let exclusive = share_settings(
        &SharingSettings::Exclusive,
        Some(2),
        Enforcement::Mps,
        false,
    )
    .unwrap_err();
    assert_eq!(
        exclusive,
        "config[2] asks for it Exclusive, which a share cannot be"
    );
}

#[test]
fn nvidias_consumable_shares_refuse_mps_and_take_time_slicing() {
    let refused = share_settings(&mps(None), Some(0), Enforcement::None, true).unwrap_err();
    assert!(
        refused.starts_with("MPS sharing is not supported when consumable shares is enabled"),
        "{refused}"
    );
    assert_eq!(
        share_settings(
            &sliced(TimeSliceInterval::Medium),
            Some(0),
            Enforcement::None,
            true
        ),
        Ok(sliced(TimeSliceInterval::Medium))
    );
    // NVIDIA's configs leave a device Exclusive unless they say otherwise: no enforcement then.
    assert_eq!(
        share_settings(
            &SharingSettings::Exclusive,
            Some(0),
            Enforcement::None,
            true
        ),
        Ok(SharingSettings::Exclusive)
    );
    // Under our own name with enforcement None, a claim may still run its own MPS daemon.
    assert_eq!(
        share_settings(&mps(None), Some(0), Enforcement::None, false),
        Ok(mps(None))
    );
}

#[test]
fn claims_on_one_device_must_agree_except_for_their_own_mps_limits() {
    assert_eq!(
        share_conflict(&mps(Some(1 << 30)), &mps(Some(4 << 30))),
        None
    );
    assert_eq!(
        share_conflict(
            &sliced(TimeSliceInterval::Long),
            &sliced(TimeSliceInterval::Long)
        ),
        None
    );
    let why = share_conflict(
        &sliced(TimeSliceInterval::Long),
        &SharingSettings::Exclusive,
    )
    .expect("a conflict");
    assert_eq!(
        why,
        "it is shared with sharing TimeSlicing/Long, and this claim asks for Exclusive: the claims on \
         one device must have the same configuration"
    );
    assert!(share_conflict(&mps(None), &sliced(TimeSliceInterval::Default)).is_some());
}
