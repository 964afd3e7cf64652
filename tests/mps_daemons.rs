//! The MPS daemon lifecycle against real processes: the gpu-dra binary's stand-in daemon
//! (`gpu-dra fake mps-control-daemon`) started, limited, stopped, taken over by a new manager (as
//! after a plugin restart), restarted after it died, and swept when its claim is gone.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpu_dra::claims::mps::{
    MpsDaemonRecord, MpsDaemonSpec, MpsDaemons, MpsDevice, MpsError, MpsProgram, TakeOver, PID_FILE,
};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const UID_A: &str = "0b7c4f1e-1111-4a8e-9f00-1d2c3b4a5e6f";
const UID_B: &str = "0b7c4f1e-2222-4a8e-9f00-1d2c3b4a5e6f";

fn daemons(root: &Path) -> MpsDaemons {
    MpsDaemons::new(
        root.join("mps"),
        MpsProgram::StandIn {
            exe: env!("CARGO_BIN_EXE_gpu-dra").into(),
        },
    )
}

fn spec(claim_uid: &str) -> MpsDaemonSpec {
    let device = |device: &str, uuid: &str, limit: Option<u64>| MpsDevice {
        device: device.into(),
        uuid: uuid.into(),
        pinned_memory_limit_bytes: limit,
    };
    MpsDaemonSpec {
        claim_uid: claim_uid.into(),
        devices: vec![
            device(
                "gpu-0",
                "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c",
                Some(4 << 30),
            ),
            device("gpu-1", "GPU-9a2e51f0-6b1d-4c3e-8f7a-0d2c4b6e8a10", None),
            device(
                "gpu-2-mig-1g10gb-0",
                "MIG-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718",
                Some(3 << 29),
            ),
        ],
        active_thread_percentage: Some(50),
    }
}

/// Stops every daemon a test started, whatever the test's outcome, so none outlives it.
struct Guard<'a> {
    daemons: &'a MpsDaemons,
    records: Vec<MpsDaemonRecord>,
}

impl<'a> Guard<'a> {
    fn new(daemons: &'a MpsDaemons) -> Self {
        Self {
            daemons,
            records: Vec::new(),
        }
    }

    fn start(&mut self, spec: &MpsDaemonSpec) -> MpsDaemonRecord {
        let record = self.daemons.start(spec).expect("daemon starts");
        self.records.push(record.clone());
        record
    }

    /// A restarted daemon replaces the record of the dead one (stopping that would remove the
    /// directory the new one runs in).
    fn track(&mut self, record: &MpsDaemonRecord) {
        self.records.retain(|r| r.dir != record.dir);
        self.records.push(record.clone());
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        for record in &self.records {
            if self.daemons.stop(record).is_err() && self.daemons.is_running(record) {
                let _ = kill(Pid::from_raw(record.pid as i32), Signal::SIGKILL);
            }
        }
    }
}

fn control_log(record: &MpsDaemonRecord) -> String {
    std::fs::read_to_string(record.dir.join("log/control.log")).unwrap_or_default()
}

/// Whether a process is gone or a zombie (its parent, not the test, reaps it).
fn process_ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

fn wait_until(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn start_runs_a_daemon_with_the_claims_devices_and_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let daemons = daemons(tmp.path());
    let mut guard = Guard::new(&daemons);
    let record = guard.start(&spec(UID_A));

    assert_eq!(record.dir, tmp.path().join("mps").join(UID_A));
    let pid_file = std::fs::read_to_string(record.dir.join("pipe").join(PID_FILE)).unwrap();
    assert_eq!(pid_file.trim(), record.pid.to_string());
    assert!(record.dir.join("pipe/control").exists());
    assert!(record.dir.join("shm").is_dir());
    assert!(daemons.is_running(&record));

    let log = control_log(&record);
    for expected in [
        "CUDA_VISIBLE_DEVICES=GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c,GPU-9a2e51f0-6b1d-4c3e-8f7a-0d2c4b6e8a10,MIG-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718",
        "Cmd:set_default_active_thread_percentage 50",
        "Cmd:set_default_device_pinned_mem_limit 0 4096M",
        "Cmd:set_default_device_pinned_mem_limit 2 1536M",
    ] {
        assert!(log.contains(expected), "{expected} missing from:\n{log}");
    }
    assert!(
        !log.contains("set_default_device_pinned_mem_limit 1 "),
        "{log}"
    );

    // What the daemon holds, asked through the same control path.
    let ask = |command: &str| daemons.control(&record, command).unwrap();
    assert_eq!(ask("get_default_active_thread_percentage"), "50.0");
    assert_eq!(ask("get_default_device_pinned_mem_limit 0"), "4096M");
    assert_eq!(ask("get_default_device_pinned_mem_limit 1"), "0M");
    assert_eq!(
        ask("get_default_device_pinned_mem_limit MIG-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718"),
        "1536M"
    );
    // A command the daemon refuses is an error that says what it answered.
    let refused = daemons
        .control(&record, "set_default_device_pinned_mem_limit 3 1G")
        .unwrap_err();
    assert!(refused.to_string().contains("no device 3"), "{refused}");
    assert!(refused.to_string().contains(UID_A), "{refused}");
    for malformed in [
        "set_default_active_thread_percentage lots",
        "set_default_device_pinned_mem_limit 0 1.5G",
        "set_default_device_pinned_mem_limit 0",
        "start_the_world",
    ] {
        assert!(daemons.control(&record, malformed).is_err(), "{malformed}");
    }
    // Refused commands change nothing.
    assert_eq!(ask("get_default_device_pinned_mem_limit 0"), "4096M");
    assert_eq!(ask("get_default_active_thread_percentage"), "50.0");
}

#[test]
fn stop_ends_the_daemon_and_removes_the_directory_and_may_be_repeated() {
    let tmp = tempfile::tempdir().unwrap();
    let daemons = daemons(tmp.path());
    let mut guard = Guard::new(&daemons);
    let record = guard.start(&spec(UID_A));

    daemons.stop(&record).unwrap();
    assert!(process_ended(record.pid));
    assert!(!daemons.is_running(&record));
    assert!(!record.dir.exists());
    daemons.stop(&record).unwrap();
}

#[test]
fn the_stand_in_leaves_when_its_directory_is_removed() {
    // A test that drops its temporary directory without unpreparing must not leave a daemon running.
    let tmp = tempfile::tempdir().unwrap();
    let daemons = daemons(tmp.path());
    let mut guard = Guard::new(&daemons);
    let record = guard.start(&spec(UID_A));
    std::fs::remove_dir_all(&record.dir).unwrap();
    wait_until("the stand-in to exit", || process_ended(record.pid));
}

#[test]
fn stop_signals_a_daemon_that_no_longer_takes_commands() {
    let tmp = tempfile::tempdir().unwrap();
    let daemons = daemons(tmp.path());
    let mut guard = Guard::new(&daemons);
    let record = guard.start(&spec(UID_A));
    // Without its socket, quit cannot reach the daemon: SIGTERM must.
    std::fs::remove_file(record.dir.join("pipe/control")).unwrap();

    let started = Instant::now();
    daemons.stop(&record).unwrap();
    assert!(process_ended(record.pid));
    assert!(!record.dir.exists());
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_new_manager_takes_over_a_running_daemon_from_its_checkpointed_record() {
    let tmp = tempfile::tempdir().unwrap();
    let first = daemons(tmp.path());
    let mut guard = Guard::new(&first);
    let record = guard.start(&spec(UID_A));
    // The record goes through the checkpoint's JSON.
    let json = serde_json::to_string(&record).unwrap();
    let restored: MpsDaemonRecord = serde_json::from_str(&json).unwrap();

    let second = daemons(tmp.path());
    assert_eq!(second.take_over(&restored).unwrap(), TakeOver::TakenOver);
    assert!(second.is_running(&restored));
    assert_eq!(
        second
            .control(&restored, "get_default_active_thread_percentage")
            .unwrap(),
        "50.0"
    );
    assert_eq!(
        control_log(&record)
            .matches("Starting control daemon")
            .count(),
        1
    );
    second.stop(&restored).unwrap();
    assert!(process_ended(record.pid));
}

#[test]
fn a_daemon_that_died_is_restarted_in_the_same_directories() {
    let tmp = tempfile::tempdir().unwrap();
    let daemons = daemons(tmp.path());
    let mut guard = Guard::new(&daemons);
    let record = guard.start(&spec(UID_A));
    let pipe_inode = std::fs::metadata(record.dir.join("pipe")).unwrap().ino();
    let shm_inode = std::fs::metadata(record.dir.join("shm")).unwrap().ino();

    kill(Pid::from_raw(record.pid as i32), Signal::SIGKILL).unwrap();
    wait_until("the killed daemon to end", || !daemons.is_running(&record));

    let TakeOver::Restarted(restarted) = daemons.take_over(&record).unwrap() else {
        panic!("a dead daemon was reported as taken over");
    };
    guard.track(&restarted);
    assert_ne!(restarted.pid, record.pid);
    assert_eq!(restarted.dir, record.dir);
    assert_eq!(restarted.devices, record.devices);
    assert!(daemons.is_running(&restarted));
    // Containers that mounted the directories keep seeing them: same directories, not new ones.
    assert_eq!(
        std::fs::metadata(record.dir.join("pipe")).unwrap().ino(),
        pipe_inode
    );
    assert_eq!(
        std::fs::metadata(record.dir.join("shm")).unwrap().ino(),
        shm_inode
    );
    let pid_file = std::fs::read_to_string(record.dir.join("pipe").join(PID_FILE)).unwrap();
    assert_eq!(pid_file.trim(), restarted.pid.to_string());
    let log = control_log(&restarted);
    assert_eq!(log.matches("Starting control daemon").count(), 2, "{log}");
    assert_eq!(
        log.matches("Cmd:set_default_device_pinned_mem_limit 2 1536M")
            .count(),
        2,
        "{log}"
    );
    assert_eq!(
        daemons
            .control(&restarted, "get_default_device_pinned_mem_limit 0")
            .unwrap(),
        "4096M"
    );
}

#[test]
fn sweep_stops_daemons_of_claims_no_longer_prepared_and_keeps_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let daemons = daemons(tmp.path());
    let mut guard = Guard::new(&daemons);
    let orphan = guard.start(&spec(UID_A));
    let kept = guard.start(&spec(UID_B));

    let cleaned = daemons.sweep(&BTreeSet::from([UID_B.to_string()]));
    assert_eq!(cleaned, [UID_A]);
    assert!(process_ended(orphan.pid));
    assert!(!orphan.dir.exists());
    assert!(daemons.is_running(&kept));
    assert!(kept.dir.join("pipe/control").exists());
    // Nothing left to sweep.
    assert!(daemons
        .sweep(&BTreeSet::from([UID_B.to_string()]))
        .is_empty());
}

/// Writes a claim directory whose pid file names `pid`, as a crashed plugin might leave it.
fn leftover_dir(daemons: &MpsDaemons, uid: &str, pid: u32) -> PathBuf {
    let dir = daemons.root().join(uid);
    std::fs::create_dir_all(dir.join("pipe")).unwrap();
    std::fs::write(dir.join("pipe").join(PID_FILE), format!("{pid}\n")).unwrap();
    dir
}

#[test]
fn sweep_signals_nothing_that_is_not_the_directorys_mps_daemon() {
    let tmp = tempfile::tempdir().unwrap();
    let daemons = daemons(tmp.path());
    let mut guard = Guard::new(&daemons);
    let kept = guard.start(&spec(UID_B));

    // A pid file naming a process that is no MPS daemon at all.
    let mut sleep = Command::new("sleep").arg("30").spawn().unwrap();
    let not_mps = leftover_dir(&daemons, "0b7c4f1e-3333-4a8e-9f00-1d2c3b4a5e6f", sleep.id());
    // A pid file naming another claim's daemon (a pid reused since).
    let other = leftover_dir(&daemons, "0b7c4f1e-4444-4a8e-9f00-1d2c3b4a5e6f", kept.pid);

    let cleaned = daemons.sweep(&BTreeSet::from([UID_B.to_string()]));
    let sleeping = sleep.try_wait().unwrap().is_none();
    let _ = sleep.kill();
    let _ = sleep.wait();
    assert!(
        sleeping,
        "sweep signalled a process that is not an MPS daemon"
    );
    assert!(
        daemons.is_running(&kept),
        "sweep stopped another claim's daemon"
    );
    // The stale directories go; nothing was running for them.
    assert_eq!(cleaned.len(), 2, "{cleaned:?}");
    assert!(!not_mps.exists() && !other.exists());
}

#[test]
fn start_refuses_claim_uids_that_are_not_plain_names() {
    let tmp = tempfile::tempdir().unwrap();
    let daemons = daemons(tmp.path());
    for uid in ["", "..", "../escape", "a/b", ".hidden"] {
        let error = daemons.start(&spec(uid)).unwrap_err();
        assert!(
            matches!(error, MpsError::InvalidClaimUid { .. }),
            "{uid:?}: {error}"
        );
    }
    assert!(!tmp.path().join("escape").exists());
    assert!(!tmp.path().join("mps").exists());
}

#[test]
fn a_control_program_that_cannot_run_fails_start_with_its_path() {
    let tmp = tempfile::tempdir().unwrap();
    let daemons = MpsDaemons::new(
        tmp.path().join("mps"),
        MpsProgram::Nvidia {
            control: tmp.path().join("driver/usr/bin/nvidia-cuda-mps-control"),
            library_path: None,
        },
    );
    let error = daemons.start(&spec(UID_A)).unwrap_err().to_string();
    assert!(
        error.contains("driver/usr/bin/nvidia-cuda-mps-control"),
        "{error}"
    );
    assert!(error.contains(UID_A), "{error}");
    assert!(!tmp.path().join("mps").join(UID_A).exists());
}
