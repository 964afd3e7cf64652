//! The slice planner: splits a node's devices into ResourceSlices that stay within the API limits.
//! Pure; the publisher turns the plan into API objects.

use k8s_openapi::api::resource::v1::Device;

/// `ResourceSliceMaxDevices`.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// `ResourceSliceMaxDevicesWithTaintsOrConsumesCounters` (1.35+): the lower limit that applies as soon as
/// any device of the slice has taints or consumes counters.
pub const MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS: usize = 64;

/// The devices of each slice of the pool, in publishing order. A pool always has at least one slice,
/// empty if the node has no devices, so that consumers see the pool exists and is empty.
pub fn plan(devices: &[Device]) -> Vec<Vec<Device>> {
    if devices.is_empty() {
        return vec![Vec::new()];
    }
    let advanced = devices.iter().any(|d| {
        d.taints.as_ref().is_some_and(|t| !t.is_empty())
            || d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
    });
    let limit = if advanced {
        MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
    } else {
        MAX_DEVICES_PER_SLICE
    };
    devices.chunks(limit).map(<[Device]>::to_vec).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::DeviceTaint;

    fn named(n: usize) -> Vec<Device> {
        (0..n)
            .map(|i| Device {
                name: format!("gpu-{i}"),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn small_pools_fit_one_slice_and_empty_pools_publish_one_empty_slice() {
        assert_eq!(plan(&named(8)).len(), 1);
        assert_eq!(plan(&[]), vec![Vec::<Device>::new()]);
    }

    #[test]
    fn large_pools_split_at_the_device_limit_keeping_order() {
        let slices = plan(&named(300));
        assert_eq!(
            slices.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![128, 128, 44]
        );
        let names: Vec<_> = slices.iter().flatten().map(|d| d.name.clone()).collect();
        assert_eq!(
            names,
            named(300).into_iter().map(|d| d.name).collect::<Vec<_>>()
        );
    }

    #[test]
    fn tainted_devices_lower_the_limit_to_64() {
        let mut devices = named(100);
        devices[5].taints = Some(vec![DeviceTaint {
            key: "gpu.dra.dev/xid".into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        }]);
        assert_eq!(
            plan(&devices).iter().map(Vec::len).collect::<Vec<_>>(),
            vec![64, 36]
        );
    }
}
