//! Timing helpers shared by the benchmarks: percentiles, units, CPU time from `getrusage`, and
//! pinning to one CPU so that CPU time and wall-clock time describe the same core.

use std::time::{Duration, Instant};

/// The `q` quantile (0.0 to 1.0) of durations sorted ascending.
pub fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Runs `f`; returns its value with the wall-clock and CPU time (of this whole process) it took.
pub fn measure<T>(f: impl FnOnce() -> T) -> (T, (Duration, Duration)) {
    let cpu = own_cpu();
    let started = Instant::now();
    let value = f();
    (value, (started.elapsed(), own_cpu().saturating_sub(cpu)))
}

/// (best, median, CPU of the best) of (wall, CPU) runs.
pub fn summary(mut runs: Vec<(Duration, Duration)>) -> (Duration, Duration, Duration) {
    runs.sort();
    (runs[0].0, runs[runs.len() / 2].0, runs[0].1)
}

/// User and system CPU time of this process so far, all threads.
pub fn own_cpu() -> Duration {
    rusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
}

/// User and system CPU time of the child processes waited for so far.
pub fn children_cpu() -> Duration {
    rusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
}

/// User and system CPU time of the calling thread so far.
pub fn thread_cpu() -> Duration {
    rusage(nix::sys::resource::UsageWho::RUSAGE_THREAD)
}

fn rusage(who: nix::sys::resource::UsageWho) -> Duration {
    let usage = nix::sys::resource::getrusage(who).expect("getrusage");
    let time = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    time(usage.user_time()) + time(usage.system_time())
}

/// Pins this process (and what it starts) to the first CPU it may run on; returns that CPU.
pub fn pin_to_one_cpu() -> usize {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let allowed = sched_getaffinity(Pid::from_raw(0)).expect("affinity");
    let cpu = (0..CpuSet::count())
        .find(|c| allowed.is_set(*c).unwrap_or(false))
        .expect("a CPU");
    let mut one = CpuSet::new();
    one.set(cpu).expect("CPU index");
    sched_setaffinity(Pid::from_raw(0), &one).expect("pinning to one CPU");
    cpu
}
