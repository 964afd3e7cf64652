//! Where the plugin adopts orphans (PID 1 of its container, or a child subreaper), orphaned processes
//! are reaped instead of piling up as zombies, and the plugin's own children still report their exit
//! status to the plugin. The tests make a child test process a subreaper (`PR_SET_CHILD_SUBREAPER`),
//! which is what PID 1 of a container is for the processes under it.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpu_dra::support::harness::{Harness, DRIVER};
use gpu_dra::support::kubelet::KubeletDouble;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Which part a re-run of this test binary plays.
const ROLE: &str = "GPU_DRA_REAPER_TEST_ROLE";
/// The command line (JSON list) the `shim` role runs as a subreaper.
const SHIM_COMMAND: &str = "GPU_DRA_REAPER_TEST_COMMAND";

fn rerun(test: &str, role: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role);
    command
}

/// State, parent pid and start time from `/proc/<pid>/stat`; `None` once the pid is gone.
fn stat(pid: u32) -> Option<(char, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = text[text.rfind(')')? + 2..].split(' ').collect();
    Some((fields[0].chars().next()?, fields[1].parse().ok()?))
}

#[test]
fn orphans_are_reaped_while_the_plugins_own_children_keep_their_exit_status() {
    const TEST: &str = "orphans_are_reaped_while_the_plugins_own_children_keep_their_exit_status";
    match std::env::var(ROLE).as_deref() {
        Ok("reaper") => {
            nix::sys::prctl::set_child_subreaper(true).unwrap();
            let code = gpu_dra::plugin::reaper::supervise(rerun(TEST, "plugin")).unwrap();
            std::process::exit(code);
        }
        Ok("plugin") => return plugin_with_orphans(),
        _ => {}
    }
    let out = rerun(TEST, "reaper")
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}: {stdout}", out.status);
    assert!(stdout.contains("plugin: ok"), "{stdout}");
}

/// The plugin's part: its own children exit with status 7 over and over on four threads while the
/// shells it starts leave orphans behind, which go to the reaper (its parent) and exit there.
fn plugin_with_orphans() {
    let reaper = std::os::unix::process::parent_id();
    let until = Instant::now() + Duration::from_millis(1500);
    let own: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let mut runs = 0;
                while Instant::now() < until {
                    let status = Command::new("sh").args(["-c", "exit 7"]).status();
                    let code = status
                        .expect("the plugin's wait got its child's status")
                        .code();
                    assert_eq!(code, Some(7), "the plugin's child reported {code:?}");
                    runs += 1;
                }
                runs
            })
        })
        .collect();
    let mut orphans = Vec::new();
    while Instant::now() + Duration::from_millis(300) < until {
        let out = Command::new("sh")
            .args(["-c", "sleep 0.2 >/dev/null 2>&1 & echo $!"])
            .output()
            .unwrap();
        assert!(out.status.success());
        let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        if let Some((state, parent)) = stat(pid) {
            assert!(
                parent == reaper || state == 'Z',
                "orphan {pid} went to {parent}, not to the reaper {reaper}"
            );
        }
        orphans.push(pid);
        std::thread::sleep(Duration::from_millis(50));
    }
    let runs: usize = own.into_iter().map(|t| t.join().unwrap()).sum();
    std::thread::sleep(Duration::from_millis(500));
    let zombies: Vec<u32> = orphans
        .iter()
        .copied()
        .filter(|pid| stat(*pid).is_some_and(|(state, parent)| state == 'Z' && parent == reaper))
        .collect();
    assert!(zombies.is_empty(), "orphans left as zombies: {zombies:?}");
    assert!(
        runs > 20 && orphans.len() > 10,
        "{runs} runs, {} orphans",
        orphans.len()
    );
    println!(
        "plugin: ok, {runs} children waited for, {} orphans reaped",
        orphans.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_binary_runs_under_its_reaper_and_stops_cleanly_on_sigterm() {
    const TEST: &str = "the_plugin_binary_runs_under_its_reaper_and_stops_cleanly_on_sigterm";
    if std::env::var(ROLE).as_deref() == Ok("shim") {
        // What a container runtime does for PID 1, in the small: this process adopts orphans and
        // then becomes the plugin binary.
        let command: Vec<String> =
            serde_json::from_str(&std::env::var(SHIM_COMMAND).unwrap()).unwrap();
        nix::sys::prctl::set_child_subreaper(true).unwrap();
        let error = Command::new(&command[0]).args(&command[1..]).exec();
        panic!("exec {command:?}: {error}");
    }
    let node = Harness::new("dgx-h100").await;
    let profile = node.write_h100_profile(1);
    let kubeconfig = node.dir.path().join("kubeconfig");
    node.api.write_kubeconfig(&kubeconfig).unwrap();
    let plugin = node.plugin_command(
        std::path::Path::new(env!("CARGO_BIN_EXE_gpu-dra")),
        &profile,
        &kubeconfig,
    );
    let command: Vec<String> = std::iter::once(plugin.get_program())
        .chain(plugin.get_args())
        .map(|arg| arg.to_string_lossy().into_owned())
        .collect();
    let mut shim = rerun(TEST, "shim")
        .env(SHIM_COMMAND, serde_json::to_string(&command).unwrap())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let kubelet =
        KubeletDouble::register(&node.config.registry_dir, DRIVER, Duration::from_secs(30))
            .await
            .expect("the plugin under the reaper registers");
    node.wait_for_slices().await;

    // The shim became the reaper; the plugin that serves the kubelet is its child.
    let children: Vec<u32> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid| stat(*pid).is_some_and(|(_, parent)| parent == shim.id()))
        .collect();
    assert_eq!(children.len(), 1, "the reaper's children: {children:?}");
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", children[0])).unwrap();
    assert!(
        String::from_utf8_lossy(&cmdline).contains("plugin\0--node-name"),
        "{}",
        String::from_utf8_lossy(&cmdline)
    );
    let claim = node.allocated_claim("under-reaper", 1).await;
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert!(answer[&claim.uid].is_ok(), "{answer:?}");

    // The kubelet stops the container with SIGTERM to PID 1: the plugin gets it and stops cleanly.
    kill(Pid::from_raw(shim.id() as i32), Signal::SIGTERM).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = shim.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the reaper did not end after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status}");
    assert!(!node.config.registration_socket().exists());
    assert!(stat(children[0]).is_none(), "the plugin is gone");
}
