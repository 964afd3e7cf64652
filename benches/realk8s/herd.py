#!/usr/bin/env python3
"""Thundering herd: N real plugin processes (fake backend, one per Node) against the real
kube-apiserver of ../shared/realk8s; the API server is restarted in place, and the plugins' way back is
measured. Kept out of CI; Python 3 standard library only.

    cargo build --release --bin gpu-dra
    benches/realk8s/herd.py --up --down --run-dir /tmp/k8s-herd --nodes 50

--up starts a control plane in --run-dir with up.sh first (on the ports of $ETCD_PORT, $ETCD_PEER_PORT,
$API_PORT, $KCM_PORT, $SCHED_PORT, by default 22379 22380 26443 30257 30259, so as not to meet one on up.sh's
own defaults); --down stops it and removes --run-dir at the end. Without them, a control plane must run in
--run-dir already.

What it does: N Ready Node objects (as node.sh makes them); N `gpu-dra plugin --backend fake` processes, each
with its own kubelet, CDI and state directories under a temporary directory, the admin kubeconfig and its own
/metrics port; waits until every plugin has confirmed its slices (gpu_dra_slices_confirmed_timestamp_seconds
above 0) and the server holds the slices of all N nodes; lets start-up settle; counts the API server's
requests at rest (apiserver_request_total deltas by verb and resource over --idle-seconds); then stops
kube-apiserver (its pid in RUN_DIR/pids) and starts the same command line again, with the same log file.
From the restart until every plugin has confirmed its slices again, it measures:
  - requests to the new API server by verb and resource (its counters start at 0 with the process), the
    plugins' resources apart; WATCH counts a watch when it ends (a resumed watch that got 410 Gone ends at
    once), so the watches open at the end are given too (apiserver_longrunning_requests);
  - the LISTs and ended WATCHes of the plugins' resources between reads of the API server's counters
    (every half second; a read takes longer while the server starts on a busy machine), and the highest
    rate over one interval: the re-lists of a herd show as one tall interval; they include the re-lists
    of kube-scheduler and kube-controller-manager (a few: nodes, slices, device classes);
  - each plugin's confirmation time (its own gauge) after the API server was ready again (/readyz ok):
    p50, p99, max, and a per-second histogram with the most confirmations in any one second. A negative
    time is a confirmation after the server answered but before /readyz said ok.
Also per plugin: memory (RssAnon; Pss from /proc/PID/smaps_rollup) and CPU (at rest, in the recovery).
One JSON line on stdout, then the histograms for a reader. Plugins, Nodes and slices are removed at the end,
also after Ctrl-C.
"""
import argparse
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

DRIVER = "gpu.dra.dev"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# What the plugin reads and watches; the rest of the API server's requests come from itself and from the
# controller manager and scheduler.
PLUGIN_RESOURCES = {"resourceslices", "nodes", "gpunodepolicies", "deviceclasses", "events"}
PORTS = {"ETCD_PORT": "22379", "ETCD_PEER_PORT": "22380", "API_PORT": "26443", "KCM_PORT": "30257",
         "SCHED_PORT": "30259"}


def log(message):
    print(f"[herd {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Api:
    """The admin's REST access to the API server (the token of up.sh's admin kubeconfig)."""

    def __init__(self, run_dir):
        kubeconfig = open(os.path.join(run_dir, "admin.kubeconfig")).read()
        self.server = re.search(r"server:\s*(\S+)", kubeconfig).group(1)
        self.token = open(os.path.join(run_dir, "pki", "tokens.csv")).read().split(",")[0]
        self.ctx = ssl.create_default_context()
        self.ctx.check_hostname = False
        self.ctx.verify_mode = ssl.CERT_NONE

    def call(self, method, path, body=None, content_type="application/json", timeout=10):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": content_type})
        with urllib.request.urlopen(req, context=self.ctx, timeout=timeout) as response:
            return response.read()

    def ready(self):
        try:
            return self.call("GET", "/readyz", timeout=1) == b"ok"
        except Exception:  # down, starting, or not ready (500)
            return False

    def metrics(self):
        return self.call("GET", "/metrics", timeout=30).decode()


def kubectl(*args):
    result = subprocess.run(["kubectl", *args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"kubectl {' '.join(args)}: {result.stderr.strip()}")


def make_ready_node(api, name):
    """A Node the scheduler treats as Ready, as ../shared/realk8s/node.sh makes it (no kubelet runs)."""
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "gpu-dra-herd": "run"}}}
    try:
        api.call("POST", "/api/v1/nodes", node)
    except urllib.error.HTTPError as e:
        if e.code != 409:  # left by an interrupted run: its status is written again below
            raise
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    status = {"status": {"capacity": resources, "allocatable": resources, "conditions": [{
        "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "no kubelet",
        "lastHeartbeatTime": now, "lastTransitionTime": now}]}}
    api.call("PATCH", f"/api/v1/nodes/{name}/status", status, "application/merge-patch+json")


REQUEST = re.compile(r'^apiserver_request_total\{([^}]*)\} ([0-9.eE+-]+)$')
LONGRUNNING = re.compile(r'^apiserver_longrunning_requests\{([^}]*)\} ([0-9.eE+-]+)$')


def by_verb_resource(text, pattern):
    """Sums of a metric by "VERB resource[/subresource]" ("GET -" for paths that are no resource)."""
    sums = {}
    for line in text.splitlines():
        m = pattern.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        resource = labels.get("resource") or "-"
        if labels.get("subresource"):
            resource += "/" + labels["subresource"]
        key = f"{labels.get('verb', '?')} {resource}"
        sums[key] = sums.get(key, 0.0) + float(m.group(2))
    return sums


def delta(after, before):
    d = {k: round(v - before.get(k, 0.0)) for k, v in after.items()}
    return {k: v for k, v in sorted(d.items()) if v}


def of_plugins(requests):
    return {k: v for k, v in requests.items() if k.split(" ")[1].split("/")[0] in PLUGIN_RESOURCES}


def quantile(values, q):
    """The nearest-rank quantile."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))]


class Plugin:
    def __init__(self, binary, kubeconfig, work, node, port, profile):
        self.node, self.port = node, port
        home = os.path.join(work, node)
        for d in ["registry", "plugins", "cdi"]:
            os.makedirs(os.path.join(home, d), exist_ok=True)
        self.log = open(os.path.join(home, "plugin.log"), "w")
        self.process = subprocess.Popen(
            [binary, "plugin", "--backend", "fake", "--fake-profile", profile,
             "--fake-state", os.path.join(home, "gpu-state.json"), "--node-name", node,
             "--kubeconfig", kubeconfig, "--kubelet-registry-dir", os.path.join(home, "registry"),
             "--kubelet-plugins-dir", os.path.join(home, "plugins"), "--cdi-root", os.path.join(home, "cdi"),
             "--http-addr", f"127.0.0.1:{port}"],
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL, start_new_session=True)

    def metrics(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
            return response.read().decode()

    def sample(self, name):
        """One unlabelled sample, or the sum of a labelled family by its labels."""
        try:
            text = self.metrics()
        except Exception:
            return None
        values = {}
        for line in text.splitlines():
            if line.startswith(name):
                rest = line[len(name):]
                labels, _, value = rest.rpartition(" ")
                values[labels] = float(value)
        return values

    def confirmed_at(self):
        values = self.sample("gpu_dra_slices_confirmed_timestamp_seconds")
        return values.get("") if values else None

    def syncs(self):
        values = self.sample("gpu_dra_slice_syncs_total") or {}
        return {re.sub(r'.*outcome="([^"]*)".*', r"\1", k): v for k, v in values.items()}

    def cpu_seconds(self):
        fields = open(f"/proc/{self.process.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_kib(self):
        """RssAnon (from status) and Pss (from smaps_rollup), in KiB."""
        rss_anon = pss = None
        for line in open(f"/proc/{self.process.pid}/status"):
            if line.startswith("RssAnon:"):
                rss_anon = int(line.split()[1])
        for line in open(f"/proc/{self.process.pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
        return rss_anon, pss

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()


class Scraper(threading.Thread):
    """Reads the API server's request counters of the plugins' resources every half second, while it
    answers: the deltas between two reads, by the time of the later one, give requests per second."""

    def __init__(self, api):
        super().__init__(daemon=True)
        self.api, self.samples, self.stopping = api, [], threading.Event()

    def run(self):
        while not self.stopping.is_set():
            tick = time.time()
            try:
                counts = of_plugins(by_verb_resource(self.api.metrics(), REQUEST))
                self.samples.append((time.time(), counts))
            except Exception:  # down or starting
                pass
            self.stopping.wait(max(0.0, 0.5 - (time.time() - tick)))

    def intervals(self, since):
        """(from, to, LISTs, WATCH ends) of the plugins' resources between consecutive reads, in seconds
        after `since`. A read can take seconds while the server starts on a busy machine, so the
        intervals, not whole seconds, are what the counters can tell apart."""
        rows, prev, prev_at = [], None, None
        for at, counts in self.samples:
            if prev is not None:
                d = {verb: sum(v - prev.get(k, 0.0) for k, v in counts.items() if k.startswith(verb + " "))
                     for verb in ("LIST", "WATCH")}
                rows.append((round(prev_at - since, 1), round(at - since, 1), round(d["LIST"]), round(d["WATCH"])))
            else:  # everything since the server started serving, before its first answer here
                rows.append((None, round(at - since, 1),
                             round(sum(v for k, v in counts.items() if k.startswith("LIST "))),
                             round(sum(v for k, v in counts.items() if k.startswith("WATCH ")))))
            prev, prev_at = counts, at
        return rows


def restart_api_server(run_dir, sig):
    """Stops kube-apiserver and starts its exact command line again (same log, pid file kept current);
    returns the times of the signal, of its exit and of the new start."""
    pid_file = os.path.join(run_dir, "pids", "kube-apiserver.pid")
    pid = int(open(pid_file).read().strip())
    cmd = [c.decode() for c in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1]]
    cwd = os.readlink(f"/proc/{pid}/cwd")
    signalled = time.time()
    os.kill(pid, sig)
    for _ in range(600):
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    exited = time.time()
    out = open(os.path.join(run_dir, "logs", "kube-apiserver.log"), "a")
    child = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    open(pid_file, "w").write(f"{child.pid}\n")
    return signalled, exited, time.time()


def histogram(title, counts, unit="s"):
    """A per-second histogram for a reader: one line per second, a bar of #."""
    lines = [title]
    if not counts:
        return lines + ["  (none)"]
    top = max(counts.values())
    scale = max(1, -(-top // 60))
    for second in range(min(counts), max(counts) + 1):
        n = counts.get(second, 0)
        lines.append(f"  {second:+5d}{unit} {n:4d} {'#' * -(-n // scale) if n else ''}")
    if scale > 1:
        lines.append(f"  (one # for {scale})")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(REPO, "target/release/gpu-dra"))
    ap.add_argument("--run-dir", default="/tmp/k8s-herd")
    ap.add_argument("--realk8s", default=os.path.join(REPO, "..", "shared", "realk8s"),
                    help="the folder of up.sh, down.sh")
    ap.add_argument("--up", action="store_true", help="start the control plane in --run-dir first")
    ap.add_argument("--down", action="store_true", help="stop it and remove --run-dir at the end")
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--profile", default="dgx-h100", help="the fake GPU profile of every node")
    ap.add_argument("--port-base", type=int, default=29100, help="plugin i serves /metrics on this + i")
    ap.add_argument("--settle-seconds", type=int, default=20, help="after all slices are published")
    ap.add_argument("--idle-seconds", type=int, default=60,
                    help="the window for the rate at rest (watches are renewed once a minute)")
    ap.add_argument("--signal", default="TERM", choices=["TERM", "KILL"], help="how kube-apiserver is stopped")
    ap.add_argument("--timeout", type=int, default=600, help="for publishing, and for the recovery")
    ap.add_argument("--keep-dir", action="store_true", help="keep the plugins' directories and logs")
    args = ap.parse_args()

    binary = os.path.abspath(args.bin)
    if not os.access(binary, os.X_OK):
        sys.exit(f"no binary {binary}: cargo build --release --bin gpu-dra")
    run_dir = os.path.abspath(args.run_dir)
    if args.up:
        env = {**os.environ, **{k: os.environ.get(k, v) for k, v in PORTS.items()}}
        log(f"starting a control plane in {run_dir}")
        subprocess.run([os.path.join(args.realk8s, "up.sh"), run_dir], env=env, check=True,
                       stdout=sys.stderr)
    kubeconfig = os.path.join(run_dir, "admin.kubeconfig")
    os.environ["KUBECONFIG"] = kubeconfig
    api = Api(run_dir)
    work = tempfile.mkdtemp(prefix="gpu-dra-herd-")
    plugins = []
    nodes = [f"herd-{i:04d}" for i in range(args.nodes)]

    # Ctrl-C and SIGTERM end the run through the clean-up below.
    def interrupted(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)
    try:
        kubectl("apply", "--validate=false", "-f", os.path.join(REPO, "crd"))
        kubectl("apply", "-f", os.path.join(REPO, "deploy", "base", "deviceclasses.yaml"))
        for name in nodes:
            make_ready_node(api, name)
        log(f"{len(nodes)} Ready nodes; starting {len(nodes)} plugins")
        started = time.time()
        for i, node in enumerate(nodes):
            plugins.append(Plugin(binary, kubeconfig, work, node, args.port_base + i, args.profile))

        # Published: every plugin confirmed its slices, and the server holds slices of every node.
        deadline = time.time() + args.timeout
        while True:
            dead = [p.node for p in plugins if p.process.poll() is not None]
            if dead:
                sys.exit(f"plugins exited: {dead[:5]}; logs in {work}")
            confirmed = sum(1 for p in plugins if (p.confirmed_at() or 0) > 0)
            listed = json.loads(api.call("GET", "/apis/resource.k8s.io/v1/resourceslices?fieldSelector="
                                         f"spec.driver%3D{DRIVER}"))["items"]
            with_slices = len({s["spec"]["nodeName"] for s in listed} & set(nodes))
            if confirmed == len(plugins) and with_slices == len(nodes):
                break
            if time.time() > deadline:
                sys.exit(f"after {args.timeout} s: {confirmed} plugins confirmed, {with_slices} nodes with slices")
            time.sleep(1)
        published_s = time.time() - started
        log(f"all {len(nodes)} nodes published in {published_s:.1f} s; settling {args.settle_seconds} s")
        time.sleep(args.settle_seconds)

        # At rest.
        cpu_rest_before = [p.cpu_seconds() for p in plugins]
        before = by_verb_resource(api.metrics(), REQUEST)
        time.sleep(args.idle_seconds)
        idle = delta(by_verb_resource(api.metrics(), REQUEST), before)
        cpu_rest = [p.cpu_seconds() - c for p, c in zip(plugins, cpu_rest_before)]
        idle_plugins = of_plugins(idle)
        log(f"at rest, {args.idle_seconds} s: {idle_plugins}")
        memory = [p.memory_kib() for p in plugins]
        syncs_before = [p.syncs() for p in plugins]

        # The restart.
        cpu_recovery_before = [p.cpu_seconds() for p in plugins]
        load_at_restart = os.getloadavg()[0]
        log(f"restarting kube-apiserver (SIG{args.signal})")
        signalled, exited, relaunched = restart_api_server(run_dir, getattr(signal, f"SIG{args.signal}"))
        scraper = Scraper(api)
        scraper.start()
        ready_at, confirmations = None, {}
        deadline = time.time() + args.timeout
        while time.time() < deadline:
            tick = time.time()
            if ready_at is None and api.ready():
                ready_at = time.time()
                log(f"kube-apiserver ready {ready_at - relaunched:.1f} s after the start")
            for p in plugins:
                if p.node not in confirmations:
                    at = p.confirmed_at()
                    if at is not None and at > signalled:
                        confirmations[p.node] = at
            if ready_at is not None and len(confirmations) == len(plugins):
                break
            # Poll fast until ready, then about twice a second (the gauges carry the exact times).
            time.sleep(max(0.0, (0.1 if ready_at is None else 0.5) - (time.time() - tick)))
        scraper.stopping.set()
        scraper.join()
        text = api.metrics()
        last_counts = by_verb_resource(text, REQUEST)
        last_open = by_verb_resource(text, LONGRUNNING)
        all_confirmed = time.time()
        cpu_recovery = [p.cpu_seconds() - c for p, c in zip(plugins, cpu_recovery_before)]
        syncs = {}
        for p, b in zip(plugins, syncs_before):
            for outcome, v in p.syncs().items():
                syncs[outcome] = syncs.get(outcome, 0) + round(v - b.get(outcome, 0))
        missing = [p.node for p in plugins if p.node not in confirmations]
        if ready_at is None:
            sys.exit("kube-apiserver did not become ready again")

        after_ready = [at - ready_at for at in confirmations.values()]
        confirm_hist = {}
        for s in after_ready:
            confirm_hist[int(s // 1)] = confirm_hist.get(int(s // 1), 0) + 1
        # The LISTs and WATCH ends of the plugins' resources between reads of the new server's counters;
        # the highest rate over a read interval (at least half a second; a longer interval averages).
        reads = scraper.intervals(ready_at)
        rate = lambda i: max(r[i] / max(r[1] - r[0], 0.5) for r in reads if r[0] is not None)  # noqa: E731
        timed = [r for r in reads if r[0] is not None]
        requests = {k: round(v) for k, v in sorted(last_counts.items()) if v}
        mib = lambda kib: round(kib / 1024, 1)  # noqa: E731
        rss = [m[0] for m in memory]
        pss = [m[1] for m in memory]
        report = {
            "nodes": args.nodes, "profile": args.profile, "signal": args.signal,
            # The plugins share the machine with the control plane and whatever else runs there.
            "machine": {"cpus": os.cpu_count(), "load_1m_at_restart": round(load_at_restart, 1)},
            "published_s": round(published_s, 1),
            "idle": {"seconds": args.idle_seconds, "plugin_requests": idle_plugins,
                     "plugin_requests_per_node_per_min":
                         round(sum(idle_plugins.values()) * 60 / args.idle_seconds / args.nodes, 2),
                     "all_requests": sum(idle.values())},
            "restart": {"stop_s": round(exited - signalled, 2), "start_to_ready_s": round(ready_at - relaunched, 2),
                        "down_s": round(ready_at - signalled, 2),
                        "ready_to_all_confirmed_s": round(max(after_ready), 2) if after_ready else None},
            "confirmed_after_ready_s": {
                "min": round(min(after_ready), 2) if after_ready else None,
                "p50": round(quantile(after_ready, 0.5), 2) if after_ready else None,
                "p99": round(quantile(after_ready, 0.99), 2) if after_ready else None,
                "max": round(max(after_ready), 2) if after_ready else None},
            "confirmations_per_second": {str(k): v for k, v in sorted(confirm_hist.items())},
            "max_confirmations_in_one_second": max(confirm_hist.values()) if confirm_hist else 0,
            "not_confirmed": missing,
            # From the new server's start until all confirmed (its own requests and the controllers' too).
            "requests_until_confirmed": {"plugin_resources": of_plugins(requests),
                                         "all": sum(requests.values())},
            "plugin_watches_open": of_plugins({k: round(v) for k, v in last_open.items() if v}),
            "plugin_lists_peak_per_s": round(rate(2), 1) if timed else None,
            "plugin_watch_ends_peak_per_s": round(rate(3), 1) if timed else None,
            "plugin_syncs_in_recovery": syncs,
            "plugin_memory_mib": {"rss_anon_p50": mib(quantile(rss, 0.5)), "rss_anon_max": mib(max(rss)),
                                  "pss_p50": mib(quantile(pss, 0.5)), "pss_max": mib(max(pss))},
            "plugin_cpu": {"at_rest_ms_per_min_p50": round(quantile(cpu_rest, 0.5) * 1000 * 60 / args.idle_seconds),
                           "recovery_ms_p50": round(quantile(cpu_recovery, 0.5) * 1000),
                           "recovery_ms_max": round(max(cpu_recovery) * 1000),
                           "total_s_since_start_p50": round(quantile([p.cpu_seconds() for p in plugins], 0.5), 2)},
        }
        print(json.dumps(report), flush=True)
        lines = histogram("plugins confirming their slices, by second after kube-apiserver was ready:",
                          confirm_hist)
        lines.append("LISTs and ended WATCHes of the plugins' resources between reads of the new server's "
                     "counters (seconds after ready):")
        for start, end, lists, watches in reads:
            span = "  server start" if start is None else f"{start:+6.1f}"
            bar = "#" * -(-lists // 4)
            lines.append(f"  {span} .. {end:+6.1f}  LIST {lists:4d} {bar:<30} WATCH {watches:4d}")
        lines.append("  (one # for 4 LISTs)")
        print("\n".join(lines), flush=True)
        log(f"all confirmed {all_confirmed - ready_at:.1f} s after ready")
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
    finally:
        for p in plugins:
            p.stop()
        for p in plugins:
            try:
                p.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.process.kill()
        if plugins:
            log(f"stopped {len(plugins)} plugins")
        for name in nodes:
            try:
                api.call("DELETE", f"/api/v1/nodes/{name}")
            except Exception:  # not created, or the server is down
                pass
        try:
            api.call("DELETE", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.driver%3D{DRIVER}")
        except Exception:
            pass
        if args.keep_dir:
            log(f"plugin logs kept in {work}")
        else:
            subprocess.run(["rm", "-rf", work])
        if args.down:
            subprocess.run([os.path.join(args.realk8s, "down.sh"), run_dir, "--purge"], stdout=sys.stderr)


if __name__ == "__main__":
    main()
