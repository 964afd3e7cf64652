//! Prepare + unprepare round trips through gRPC on a unix socket, against the in-process API server
//! double, with the plugin as a separate (release) process so its resident memory can be read.
//!
//! Run: `cargo bench --bench prepare` (the README and BENCHMARKS.md quote its output).
//! `GPU_DRA_BENCH_PLUGIN=<program>` runs another plugin binary (or a program that runs one) with the
//! same arguments: `cargo bench` builds this package with its test doubles, so BENCHMARKS.md measures the
//! node binary of `cargo build --release` that way, and an older build beside it.

use std::time::{Duration, Instant};

use gpu_dra::support::harness::{Harness, DRIVER, NODE};

#[path = "common/mod.rs"]
mod common;

use common::measure::{ms, percentile, thread_cpu};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};

const GPUS: usize = 16;
const CALLERS: usize = 16;
const BURST_CLAIMS: usize = 1000;
const SINGLE_ROUNDS: usize = 300;

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    // On a node the CDI root (/var/run/cdi) is tmpfs and the checkpoint (/var/lib/kubelet) is on disk;
    // the first run puts both on disk, the worst case.
    run("CDI root and checkpoint on disk", None).await;
    let tmpfs = std::path::Path::new("/dev/shm");
    if tmpfs.is_dir() {
        let cdi = tempfile::tempdir_in(tmpfs).expect("tmpfs scratch dir");
        run(
            "CDI root on tmpfs, checkpoint on disk (as on a node)",
            Some(cdi.path()),
        )
        .await;
    }
    write_costs();
    authority_adapter_cost();
    hpack_decoders();
}

/// What one write of a small state file costs on the disk that holds the checkpoint, step by step,
/// in wall and CPU time (this thread's user and system time): a new file renamed over the old one
/// (how a CDI spec is replaced); the old file renamed aside first, so that ext4 does not write the
/// new one out at the rename (how the checkpoint is written now); then with the file's fsync, then
/// with the directory's fsync too (how every checkpoint and spec write was made while the prepare path
/// still synced).
fn write_costs() {
    use std::io::Write;
    const WRITES: usize = 300;
    let dir = tempfile::tempdir().expect("scratch dir on disk");
    let path = dir.path().join("checkpoint.json");
    let aside = dir.path().join("checkpoint.json.old");
    let contents = vec![b'x'; 700]; // about one claim's checkpoint
    std::fs::write(&path, &contents).expect("first version");
    println!("== one write of a 700-byte file on the checkpoint's disk ({WRITES} writes each)");
    for (label, set_aside, file_sync, dir_sync) in [
        ("temp file, write, rename over the old", false, false, false),
        (
            "old renamed aside, temp renamed in, old removed (the checkpoint now)",
            true,
            false,
            false,
        ),
        (
            "rename over the old + fsync of the file",
            false,
            true,
            false,
        ),
        (
            "+ fsync of the directory (every write while the prepare path still synced)",
            false,
            true,
            true,
        ),
    ] {
        let cpu_before = thread_cpu();
        let mut took: Vec<Duration> = (0..WRITES)
            .map(|_| {
                let started = Instant::now();
                let tmp = dir.path().join(".checkpoint.json.tmp");
                let mut file = std::fs::File::create(&tmp).expect("temp file");
                file.write_all(&contents).expect("write");
                if file_sync {
                    file.sync_all().expect("fsync");
                }
                drop(file);
                if set_aside {
                    std::fs::rename(&path, &aside).expect("rename aside");
                }
                std::fs::rename(&tmp, &path).expect("rename");
                if set_aside {
                    std::fs::remove_file(&aside).expect("remove the old");
                }
                if dir_sync {
                    std::fs::File::open(dir.path())
                        .and_then(|d| d.sync_all())
                        .expect("directory fsync");
                }
                started.elapsed()
            })
            .collect();
        let cpu = thread_cpu() - cpu_before;
        took.sort();
        println!(
            "  {label}: p50 {:.3} ms, p99 {:.3} ms, CPU {:.1} µs per write",
            ms(percentile(&took, 0.50)),
            ms(percentile(&took, 0.99)),
            cpu.as_secs_f64() * 1e6 / WRITES as f64
        );
    }
    println!();
}

/// What the `:authority` adapter in front of the sockets costs per request, measured alone: a client
/// stream of NodePrepareResources requests as grpc-go writes them (HPACK with incremental indexing, a
/// small DATA frame each), fed through the rewriter in 16 KiB reads. `localhost` is what the kubelet
/// sends on the DRA socket (blocks pass through); the percent-encoded path is what it sends on the
/// registration socket (blocks are re-encoded).
fn authority_adapter_cost() {
    use gpu_dra::kubelet::authority::{lenient_policy, AuthorityRewriter};
    const REQUESTS: usize = 20_000;
    println!("== :authority adapter alone ({REQUESTS} requests, one thread)");
    for (label, authority) in [
        ("localhost (DRA socket)", &b"localhost"[..]),
        (
            "percent-encoded path (registration socket)",
            &b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.dra.dev-reg.sock"[..],
        ),
    ] {
        let stream = grpc_go_requests(authority, REQUESTS);
        let started = Instant::now();
        let mut rewriter = AuthorityRewriter::new(lenient_policy());
        let mut out = Vec::with_capacity(stream.len() + 1024);
        for read in stream.chunks(16 * 1024) {
            rewriter.feed(read, &mut out);
            out.clear();
        }
        let elapsed = started.elapsed();
        println!(
            "  {label}: {:.2} µs per request ({:.1} MiB/s)",
            elapsed.as_secs_f64() * 1e6 / REQUESTS as f64,
            stream.len() as f64 / elapsed.as_secs_f64() / (1024.0 * 1024.0)
        );
    }
    println!();
}

/// The adapter's HPACK decoder (`src/kubelet/hpack.rs`) against the `loona-hpack` crate's, on the
/// header blocks of the stream above: why the adapter keeps its own (the crate's decoder builds a
/// Huffman table for every string it decodes).
fn hpack_decoders() {
    const REQUESTS: usize = 20_000;
    let mut encoder = loona_hpack::Encoder::new();
    let blocks: Vec<Vec<u8>> = (0..REQUESTS)
        .map(|i| {
            encoder.encode(
                grpc_go_headers(b"localhost", i)
                    .iter()
                    .map(|(n, v)| (*n, v.as_slice())),
            )
        })
        .collect();
    println!(
        "== HPACK decoding alone ({REQUESTS} header blocks as grpc-go writes them, one thread)"
    );
    let mut fields = 0usize;
    let cpu_before = thread_cpu();
    let mut ours = gpu_dra::kubelet::hpack::Decoder::new(4096);
    for block in &blocks {
        ours.decode(block, |name, value| fields += name.len() + value.len())
            .expect("our decoder reads the block");
    }
    let ours_cpu = thread_cpu() - cpu_before;
    let cpu_before = thread_cpu();
    let mut crate_decoder = loona_hpack::Decoder::new();
    for block in &blocks {
        crate_decoder
            .decode_with_cb(block, |name, value| fields += name.len() + value.len())
            .expect("loona-hpack reads the block");
    }
    let crate_cpu = thread_cpu() - cpu_before;
    let per_block = |cpu: Duration| cpu.as_secs_f64() * 1e6 / REQUESTS as f64;
    println!(
        "  src/kubelet/hpack.rs: {:.2} µs of CPU per block; loona-hpack: {:.2} µs ({:.1} times as much) [{fields} bytes of fields]",
        per_block(ours_cpu),
        per_block(crate_cpu),
        crate_cpu.as_secs_f64() / ours_cpu.as_secs_f64()
    );
    println!();
}

/// The headers grpc-go sends with the `i`th NodePrepareResources request.
fn grpc_go_headers(authority: &[u8], i: usize) -> [(&'static [u8], Vec<u8>); 8] {
    [
        (b":method", b"POST".to_vec()),
        (b":scheme", b"http".to_vec()),
        (
            b":path",
            b"/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources".to_vec(),
        ),
        (b":authority", authority.to_vec()),
        (b"content-type", b"application/grpc".to_vec()),
        (b"user-agent", b"grpc-go/1.72.2".to_vec()),
        (b"te", b"trailers".to_vec()),
        (
            b"grpc-timeout",
            format!("{}m", 44_999 - i % 1000).into_bytes(),
        ),
    ]
}

fn grpc_go_requests(authority: &[u8], count: usize) -> Vec<u8> {
    let mut encoder = loona_hpack::Encoder::new();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    let frame = |kind: u8, flags: u8, stream: u32, payload: &[u8], out: &mut Vec<u8>| {
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
        out.push(kind);
        out.push(flags);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
    };
    frame(0x4, 0, 0, &[], &mut out);
    // A NodePrepareResourcesRequest for one claim is about 90 bytes.
    let message = [0u8; 95];
    for i in 0..count {
        let stream = 1 + 2 * i as u32;
        let headers = grpc_go_headers(authority, i);
        let block = encoder.encode(headers.iter().map(|(n, v)| (*n, v.as_slice())));
        frame(0x1, 0x4, stream, &block, &mut out);
        frame(0x0, 0x1, stream, &message, &mut out);
    }
    out
}

async fn run(title: &str, cdi_root: Option<&std::path::Path>) {
    let mut node = Harness::new("dgx-h100").await;
    if let Some(root) = cdi_root {
        node.config.cdi_root = root.to_path_buf();
    }
    let (plugin, kubelet) = node.spawn_plugin_process(&plugin_program(), GPUS).await;

    // Single claim, one caller: latency of a prepare + unprepare round trip.
    let claim = insert_claim(&node, "single", 0);
    let single_cpu_before = cpu_time(plugin.id());
    let mut prepares = Vec::with_capacity(SINGLE_ROUNDS);
    let mut unprepares = Vec::with_capacity(SINGLE_ROUNDS);
    let mut latencies = Vec::with_capacity(SINGLE_ROUNDS);
    for _ in 0..SINGLE_ROUNDS {
        let (prepare, unprepare) = round_trip(&kubelet, &claim).await;
        prepares.push(prepare);
        unprepares.push(unprepare);
        latencies.push(prepare + unprepare);
    }
    for sample in [&mut prepares, &mut unprepares, &mut latencies] {
        sample.sort();
    }
    let single_cpu = cpu_since(plugin.id(), single_cpu_before);

    // Burst: 1000 claims from 16 concurrent callers, each caller on its own GPU.
    let claims: Vec<ClaimRef> = (0..BURST_CLAIMS)
        .map(|i| insert_claim(&node, &format!("burst-{i}"), i % GPUS))
        .collect();
    let burst_cpu_before = cpu_time(plugin.id());
    let started = Instant::now();
    let callers: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let kubelet = kubelet.clone();
            let mine: Vec<ClaimRef> = claims
                .iter()
                .skip(caller)
                .step_by(CALLERS)
                .cloned()
                .collect();
            tokio::spawn(async move {
                for claim in mine {
                    round_trip(&kubelet, &claim).await;
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.expect("caller finished");
    }
    let burst = started.elapsed();
    let burst_cpu = cpu_since(plugin.id(), burst_cpu_before);
    let rss = resident_kib(plugin.id());

    let p50_p99 = |sorted: &[Duration]| {
        format!(
            "p50 {:.2} ms, p99 {:.2} ms",
            ms(percentile(sorted, 0.50)),
            ms(percentile(sorted, 0.99))
        )
    };
    println!("== {title}");
    println!("prepare+unprepare round trip, single claim ({SINGLE_ROUNDS} rounds):");
    println!("  {}", p50_p99(&latencies));
    println!("  prepare alone: {}", p50_p99(&prepares));
    println!("  unprepare alone: {}", p50_p99(&unprepares));
    if let Some(cpu) = single_cpu {
        println!(
            "  plugin CPU time {:.2} ms per round trip",
            ms(cpu) / SINGLE_ROUNDS as f64
        );
    }
    println!("burst of {BURST_CLAIMS} claims from {CALLERS} concurrent callers:");
    println!(
        "  {:.0} claims/s ({:.2} s in all)",
        BURST_CLAIMS as f64 / burst.as_secs_f64(),
        burst.as_secs_f64()
    );
    if let Some(cpu) = burst_cpu {
        println!(
            "  plugin CPU time {:.2} ms per claim ({:.0}% of one core)",
            ms(cpu) / BURST_CLAIMS as f64,
            100.0 * cpu.as_secs_f64() / burst.as_secs_f64()
        );
    }
    match rss {
        Some(rss) => println!(
            "plugin memory after the burst: RssAnon {:.1} MiB, PSS {:.1} MiB, RSS {:.1} MiB \
             (peak RSS {:.1} MiB; {:.1} MiB of RSS mapped code and files)",
            mib(rss.anonymous),
            mib(rss.proportional),
            mib(rss.total),
            mib(rss.peak),
            mib(rss.file)
        ),
        None => println!("plugin memory: unavailable (no /proc)"),
    }
    stop(plugin);
    println!();
}

/// The binary cargo built, or the program `GPU_DRA_BENCH_PLUGIN` names.
fn plugin_program() -> std::path::PathBuf {
    std::env::var_os("GPU_DRA_BENCH_PLUGIN")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_gpu-dra").into())
}

/// Stops the plugin as the kubelet's pod would: SIGTERM, so it (and a profiler around it) exits
/// normally; SIGKILL if it has not within 60 seconds.
fn stop(mut plugin: std::process::Child) {
    let pid = nix::unistd::Pid::from_raw(plugin.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = plugin.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = plugin.kill();
    let _ = plugin.wait();
}

/// One prepare and one unprepare of `claim`; how long each call took.
async fn round_trip(kubelet: &KubeletDouble, claim: &ClaimRef) -> (Duration, Duration) {
    let started = Instant::now();
    let prepared = kubelet
        .prepare(std::slice::from_ref(claim))
        .await
        .expect("prepare call");
    assert!(
        prepared[&claim.uid].is_ok(),
        "prepare {}: {:?}",
        claim.name,
        prepared[&claim.uid]
    );
    let prepare = started.elapsed();
    let started = Instant::now();
    let unprepared = kubelet
        .unprepare(std::slice::from_ref(claim))
        .await
        .expect("unprepare call");
    let unprepare = started.elapsed();
    assert!(unprepared[&claim.uid].is_ok(), "unprepare {}", claim.name);
    (prepare, unprepare)
}

/// Stores an allocated claim for `gpu-<gpu>` directly in the API double (what the scheduler would
/// have written), so the benchmark measures the plugin and not the allocation.
fn insert_claim(node: &Harness, name: &str, gpu: usize) -> ClaimRef {
    let stored = node.api.insert(
        "resourceclaims",
        serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": format!("gpu-{gpu}")}
            ]}}}
        }),
    );
    let uid = stored["metadata"]["uid"].as_str().expect("uid").to_string();
    ClaimRef::new("default", name, uid)
}

/// Memory in KiB, from /proc/PID/status and /proc/PID/smaps_rollup.
struct Resident {
    total: u64,
    peak: u64,
    /// Heap and stacks: what the plugin allocates, and what a node pays for it.
    anonymous: u64,
    /// Proportional set size: resident pages, each divided among the processes that map it.
    proportional: u64,
    /// Mapped files, mostly the plugin's own machine code: clean pages the kernel shares and can drop.
    file: u64,
}

fn resident_kib(pid: u32) -> Option<Resident> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let proportional = rollup
        .lines()
        .find(|l| l.starts_with("Pss:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(Resident {
        proportional,
        total: field("VmRSS:")?,
        peak: field("VmHWM:")?,
        anonymous: field("RssAnon:")?,
        file: field("RssFile:")?,
    })
}

/// User plus system CPU time of a process, from /proc/PID/stat (fields 14 and 15, in clock ticks).
fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; the fields after it start past its closing parenthesis.
    let after_name = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??;
    Some(Duration::from_secs_f64(ticks as f64 / per_second as f64))
}

fn cpu_since(pid: u32, before: Option<Duration>) -> Option<Duration> {
    Some(cpu_time(pid)?.saturating_sub(before?))
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}
