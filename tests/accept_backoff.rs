//! A kubelet socket whose accept fails for want of file descriptors (EMFILE) does not spin a core:
//! the server retries after growing pauses and serves the waiting connection once a descriptor is
//! free again. The server runs in a child process with a lowered RLIMIT_NOFILE (a process-wide
//! limit, which would starve the other tests of this binary).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_dra::kubelet::{bind_private_socket, lenient_incoming, RegistrationService};
use gpu_dra::observability::Readiness;
use gpu_dra::proto::pluginregistration::registration_client::RegistrationClient;
use gpu_dra::proto::pluginregistration::registration_server::RegistrationServer;
use gpu_dra::proto::pluginregistration::InfoRequest;
use gpu_dra::support::grpc_dial::{unix_connector, Dial, UNIX_TARGET_URI};
use nix::sys::resource::{getrlimit, getrusage, setrlimit, Resource, UsageWho};

/// Set (to the socket path) in the child process that runs the server.
const SERVER_ENV: &str = "GPU_DRA_ACCEPT_BACKOFF_SERVER";
const TEST_NAME: &str = "a_socket_out_of_file_descriptors_backs_off_and_serves_once_one_is_free";
/// How long the server stays out of descriptors with a client waiting.
const STARVED: Duration = Duration::from_millis(1500);

#[test]
fn a_socket_out_of_file_descriptors_backs_off_and_serves_once_one_is_free() {
    if let Some(socket) = std::env::var_os(SERVER_ENV) {
        return serve_starved(socket.into());
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("reg.sock");
    let mut server = Command::new(std::env::current_exe().unwrap())
        .args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env(SERVER_ENV, &socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_server = server.stdin.take().unwrap();
    let mut from_server = BufReader::new(server.stdout.take().unwrap());
    let mut read_line = |wanted: &str| -> String {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                from_server.read_line(&mut line).unwrap() > 0,
                "the server ended"
            );
            // libtest writes "test <name> ... " before the child's first line, on the same line.
            if let Some((_, rest)) = line.trim().split_once(wanted) {
                return rest.trim().to_string();
            }
        }
    };
    read_line("starved");

    // The kubelet dials while the server has no descriptor to accept with.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let call = runtime.spawn(async move {
        let channel = tonic::transport::Endpoint::from_static(UNIX_TARGET_URI)
            .connect_with_connector(unix_connector(&socket, Dial::RawPath))
            .await?;
        let started = Instant::now();
        let info = tokio::time::timeout(
            Duration::from_secs(20),
            RegistrationClient::new(channel).get_info(InfoRequest {}),
        )
        .await??;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((info.into_inner(), started.elapsed()))
    });
    std::thread::sleep(STARVED);
    writeln!(to_server, "free").unwrap();
    let cpu_ms: u64 = read_line("cpu_ms").parse().unwrap();
    let (info, waited) = runtime.block_on(call).unwrap().expect("GetInfo answered");
    assert_eq!(info.name, "backoff.test");
    assert!(
        waited >= STARVED / 2,
        "answered after {waited:?}, while starved"
    );
    // A retry at once keeps a core busy the whole time; pauses of up to 1 s cost next to nothing.
    assert!(
        cpu_ms < STARVED.as_millis() as u64 / 10,
        "the server used {cpu_ms} ms of CPU in {STARVED:?} without descriptors"
    );
    drop(to_server);
    assert!(server.wait().unwrap().success());
}

/// The child: serves registration on `socket`, uses up its descriptors, says `starved`, and on a
/// line on stdin frees them and reports the CPU time it used meanwhile as `cpu_ms <n>`.
fn serve_starved(socket: std::path::PathBuf) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let listener = bind_private_socket(&socket).unwrap();
        let service = RegistrationService::new(
            "backoff.test",
            std::path::Path::new("/nonexistent/dra.sock"),
            Arc::new(Readiness::default()),
        );
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(service))
                .serve_with_incoming(lenient_incoming(listener)),
        );
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        setrlimit(Resource::RLIMIT_NOFILE, open + 8, hard).unwrap();
        let mut held = Vec::new();
        while let Ok(file) = std::fs::File::open("/dev/null") {
            held.push(file);
        }
        println!("starved");
        let before = cpu_time();
        let line = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map(|_| line)
        })
        .await
        .unwrap();
        let used = cpu_time() - before;
        drop(held);
        line.unwrap();
        println!("cpu_ms {}", used.as_millis());
        // Serves until the test closes stdin.
        let _ =
            tokio::task::spawn_blocking(|| std::io::stdin().read_line(&mut String::new())).await;
    });
}

fn cpu_time() -> Duration {
    let usage = getrusage(UsageWho::RUSAGE_SELF).unwrap();
    let micros = |t: nix::sys::time::TimeVal| t.tv_sec() as u64 * 1_000_000 + t.tv_usec() as u64;
    Duration::from_micros(micros(usage.user_time()) + micros(usage.system_time()))
}
