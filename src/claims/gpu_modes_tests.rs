use super::*;
use crate::gpu::TimeSliceInterval;
use std::sync::mpsc;

const LONG: GpuSharingMode = GpuSharingMode::TimeSlice(TimeSliceInterval::Long);

fn ops(timeout: Duration) -> GpuOps {
    GpuOps::new(timeout, timeout, Metrics::new())
}

/// Waits until GPU `uuid` takes operations again.
async fn hold_once_returned(ops: &GpuOps, uuid: &str, gpu: &str) -> HeldGpu {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match ops.hold(uuid, gpu).await {
            Ok(held) => return held,
            Err(GpuOpError::Stuck { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(other) => panic!("{other}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_that_does_not_return_fails_in_time_and_blocks_only_its_gpu() {
    let ops = ops(Duration::from_millis(200));
    let (release, released) = mpsc::channel::<()>();
    let mut held = ops.hold("GPU-a", "gpu-0").await.unwrap();
    let started = Instant::now();
    let err = held
        .change(LONG, move || {
            let _ = released.recv();
            Ok(true)
        })
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(
        err.to_string(),
        "gpu-0: setting compute mode DEFAULT with time-slice interval Long did not return \
         within 0.2s; the GPU driver may be stuck (check `nvidia-smi -q -i GPU-a` and the \
         kernel log for XID errors)"
    );
    drop(held);

    // The next change to that GPU fails at once, naming what is stuck; another GPU changes.
    let started = Instant::now();
    let err = ops.hold("GPU-a", "gpu-0").await.err().unwrap();
    assert!(started.elapsed() < Duration::from_millis(100));
    assert!(matches!(err, GpuOpError::Stuck { .. }), "{err}");
    assert!(
        err.to_string().starts_with(
            "gpu-0: an earlier change to compute mode DEFAULT with time-slice interval Long has not returned for"
        ),
        "{err}"
    );
    assert_eq!(ops.stuck().len(), 1);
    assert_eq!(ops.stuck()[0].0, "GPU-a");
    assert!(
        ops.stuck()[0].1.starts_with(
            "gpu-0: setting compute mode DEFAULT with time-slice interval Long has not returned for"
        ),
        "{:?}",
        ops.stuck()
    );
    let mut other = ops.hold("GPU-b", "gpu-1").await.unwrap();
    assert!(other.change(LONG, || Ok(true)).await.unwrap());
    assert_eq!(other.applied(), Some(LONG));

    // Once it returns, the GPU takes changes again, starting from what that change set.
    release.send(()).unwrap();
    let held = hold_once_returned(&ops, "GPU-a", "gpu-0").await;
    assert_eq!(held.applied(), Some(LONG));
    assert!(ops.stuck().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_operation_that_does_not_return_blocks_its_gpus_sharing_changes_too() {
    let metrics = Metrics::new();
    let ops = GpuOps::new(
        Duration::from_secs(5),
        Duration::from_millis(200),
        metrics.clone(),
    );
    let (release, released) = mpsc::channel::<()>();
    let create = GpuOp::CreateMig {
        profile: "1g.10gb".into(),
        start: 3,
    };
    let err = ops
        .mig("GPU-a", "gpu-0", create, move || {
            let _ = released.recv();
            Ok("MIG-late")
        })
        .await
        .unwrap_err();
    assert!(err.may_still_take_effect());
    assert!(
        err.to_string().starts_with(
            "gpu-0: creating MIG device 1g.10gb at memory slice 3 did not return within 0.2s"
        ),
        "{err}"
    );
    assert!(
        metrics
            .encode()
            .contains("gpu_dra_gpu_operation_stuck{gpu=\"gpu-0\"} 1"),
        "{}",
        metrics.encode()
    );

    // A destroy and a sharing change on that GPU fail at once, naming the create.
    for err in [
        ops.mig(
            "GPU-a",
            "gpu-0",
            GpuOp::DestroyMig {
                uuid: "MIG-x".into(),
            },
            || Ok(()),
        )
        .await
        .unwrap_err(),
        ops.hold("GPU-a", "gpu-0").await.err().unwrap(),
    ] {
        assert!(err.not_started(), "{err}");
        assert!(
            err.to_string().starts_with(
                "gpu-0: an earlier create of MIG device 1g.10gb at memory slice 3 has not returned for"
            ),
            "{err}"
        );
    }
    // Another GPU's MIG operations go on.
    assert_eq!(
        ops.mig(
            "GPU-b",
            "gpu-1",
            GpuOp::CreateMig {
                profile: "1g.10gb".into(),
                start: 0
            },
            || Ok(7)
        )
        .await
        .unwrap(),
        7
    );

    release.send(()).unwrap();
    let held = hold_once_returned(&ops, "GPU-a", "gpu-0").await;
    drop(held);
    assert!(
        metrics
            .encode()
            .contains("gpu_dra_gpu_operation_stuck{gpu=\"gpu-0\"} 0"),
        "{}",
        metrics.encode()
    );
    let destroyed = ops
        .mig(
            "GPU-a",
            "gpu-0",
            GpuOp::DestroyMig {
                uuid: "MIG-late".into(),
            },
            || Ok(true),
        )
        .await;
    assert!(destroyed.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_whose_caller_was_cancelled_is_waited_for_by_the_next_caller() {
    let ops = Arc::new(ops(Duration::from_secs(5)));
    let (release, released) = mpsc::channel::<()>();
    let create = GpuOp::CreateMig {
        profile: "1g.10gb".into(),
        start: 0,
    };
    let cancelled = tokio::time::timeout(
        Duration::from_millis(100),
        ops.mig("GPU-a", "gpu-0", create, move || {
            let _ = released.recv();
            Ok(())
        }),
    )
    .await;
    assert!(cancelled.is_err(), "the caller gave up");
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let _ = release.send(());
    });
    // The next caller waits for the running create to return, then goes on.
    let started = Instant::now();
    ops.mig(
        "GPU-a",
        "gpu-0",
        GpuOp::DestroyMig {
            uuid: "MIG-a".into(),
        },
        || Ok(()),
    )
    .await
    .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_change_leaves_the_mode_unknown() {
    let ops = ops(Duration::from_secs(5));
    let mut held = ops.hold("GPU-a", "gpu-0").await.unwrap();
    held.change(LONG, || Ok(true)).await.unwrap();
    let err = held
        .change(GpuSharingMode::ExclusiveProcess, || {
            Err(GpuError::Sharing {
                gpu: "GPU-a".into(),
                reason: "Insufficient Permissions".into(),
            })
        })
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "setting gpu-0 to compute mode EXCLUSIVE_PROCESS: GPU GPU-a: Insufficient Permissions"
    );
    assert_eq!(held.applied(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_gpus_lock_is_bounded() {
    let ops = ops(Duration::from_millis(100));
    let _first = ops.hold("GPU-a", "gpu-0").await.unwrap();
    let err = ops.hold("GPU-a", "gpu-0").await.err().unwrap();
    assert_eq!(
        err.to_string(),
        "gpu-0: another operation on the GPU is still running after 0.1s"
    );
    ops.hold("GPU-b", "gpu-1").await.unwrap();
}
