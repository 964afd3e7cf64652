#!/usr/bin/env python3
"""What our slices cost the real kube-scheduler: N nodes with the slices `gpu-dra devices`
publishes for them, then M pods with claims from a template, created at once, measured until all are
bound. Against the control plane of ../shared/realk8s (up.sh), kept out of CI.

    benches/realk8s/scale.py --bin target/release/gpu-dra --nodes 10 --pods 50 --mig-mode dynamic \
        --claim whole [--run-dir /tmp/k8s] [--qps 1000]

It restarts kube-scheduler and kube-controller-manager with --kube-api-qps/--kube-api-burst raised (their
client rate limits would otherwise bound throughput before the DRA search does), makes the nodes Ready
(Node objects; no kubelet), writes each node's slices, then the template and the pods. Reported, one
JSON line: wall time to all bound and pods/s; the scheduler's own metrics as deltas over the run (its
pod_scheduling_sli_duration and scheduling_algorithm_duration p50/p99, the DynamicResources plugin's
Filter/PreFilter/Reserve/PreBind time per call, scheduling attempts by result) and its CPU time per pod;
slices, devices and JSON bytes per node; the API server's side, measured before the pods: etcd bytes per
node, what a watcher of all slices receives for one GPU tainted and for a pool republished, the request
rate at rest, the components' RssAnon. --cpu-profile F takes the scheduler's pprof profile; --bare is a
floor (the same devices with their type only); --mig-mode static uses MIG devices an admin made.
Claims: whole (one GPU), mig-1g (one 1g MIG device), mig-mixed (1g + 2g + 3g), nvlink-pair (two GPUs with
matchAttribute nvlinkDomain), unfit (more GPUs than a node has: how long failing takes).
"""
import argparse
import base64
import hashlib
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.request

DRIVER = "gpu.dra.dev"


def kubectl(*args, stdin=None, check=True):
    result = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
    if check and result.returncode != 0:
        sys.exit(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def restart_with_qps(run_dir, name, qps):
    """Restarts an up.sh component with its client rate limits raised, keeping its pid file current."""
    pid_file = os.path.join(run_dir, "pids", f"{name}.pid")
    pid = int(open(pid_file).read().strip())
    cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1]
    cmd = [c.decode() for c in cmd if not c.startswith((b"--kube-api-qps", b"--kube-api-burst", b"--profiling"))]
    # Profiling on, so that a run can take the scheduler's own CPU profile (--cpu-profile).
    cmd += [f"--kube-api-qps={qps}", f"--kube-api-burst={2 * qps}", "--profiling=true"]
    os.kill(pid, 15)
    for _ in range(100):
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.1)
    log = open(os.path.join(run_dir, "logs", f"{name}.log"), "a")
    child = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    open(pid_file, "w").write(f"{child.pid}\n")
    return child.pid


def component_get(run_dir, port, path, timeout=10):
    token = open(os.path.join(run_dir, "pki", "tokens.csv")).read().split(",")[0]
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    for _ in range(100):
        try:
            req = urllib.request.Request(f"https://127.0.0.1:{port}{path}",
                                         headers={"Authorization": f"Bearer {token}"})
            return urllib.request.urlopen(req, context=ctx, timeout=timeout).read()
        except Exception:  # the component is still starting
            time.sleep(0.2)
    sys.exit(f"nothing from port {port}{path}")


def metrics(run_dir, port):
    return component_get(run_dir, port, "/metrics").decode()


def rss_mib(run_dir, name):
    """A component's resident memory: anonymous (its heap) and in all, from /proc."""
    pid = int(open(os.path.join(run_dir, "pids", f"{name}.pid")).read().strip())
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    kib = lambda key: int(status[key].split()[0])  # noqa: E731
    return {"rss_anon": round(kib("RssAnon") / 1024), "rss": round(kib("VmRSS") / 1024)}


def cpu_seconds(pid):
    """User plus system CPU time a process has used, from /proc (clock ticks of 1/100 s)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SAMPLE = re.compile(r'^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf)$')


def parse(text):
    samples = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            samples[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return samples


def delta(after, before):
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def labels_of(text):
    return dict(re.findall(r'(\w+)="([^"]*)"', text))


def quantile(samples, name, q, match=None):
    """A quantile from a histogram's bucket deltas, linear within the bucket, as histogram_quantile."""
    buckets = []
    for (n, lab), v in samples.items():
        if n != name + "_bucket":
            continue
        labels = labels_of(lab)
        if match and any(labels.get(k) != val for k, val in match.items()):
            continue
        le = labels["le"]
        buckets.append((float("inf") if le == "+Inf" else float(le), v))
    merged = {}
    for le, v in buckets:
        merged[le] = merged.get(le, 0.0) + v
    ordered = sorted(merged.items())
    if not ordered or ordered[-1][1] == 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            span = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / span if span else 0)
        prev_le, prev_count = le, count
    return prev_le


def summed(samples, name, match=None):
    total = 0.0
    for (n, lab), v in samples.items():
        if n != name:
            continue
        labels = labels_of(lab)
        if match and any(labels.get(k) != val for k, val in match.items()):
            continue
        total += v
    return total


def mean_ms(samples, name, match):
    count = summed(samples, name + "_count", match)
    return round(1000 * summed(samples, name + "_sum", match) / count, 3) if count else None


def etcd_bytes(etcd_port, prefix):
    """Bytes of the values stored in etcd under `prefix` (the API server's protobuf encoding)."""
    def b64(text):
        return base64.b64encode(text.encode()).decode()
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = json.dumps({"key": b64(prefix), "range_end": b64(end)}).encode()
    answer = json.load(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{etcd_port}/v3/kv/range", data=body), timeout=60))
    return sum(len(base64.b64decode(kv.get("value", ""))) for kv in answer.get("kvs", []))


def api_request(run_dir, method, path, body=None, accept="application/json", timeout=30,
                content_type="application/json"):
    token = open(os.path.join(run_dir, "pki", "tokens.csv")).read().split(",")[0]
    server = re.search(r"server: (\S+)", open(os.path.join(run_dir, "admin.kubeconfig")).read()).group(1)
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(server + path, method=method, data=body,
                                 headers={"Authorization": f"Bearer {token}", "Accept": accept,
                                          "Content-Type": content_type})
    return urllib.request.urlopen(req, context=ctx, timeout=timeout)


class SliceWatcher:
    """A watcher of all ResourceSlices as the scheduler's informer is one: protobuf, from now on.
    Counts the events and the bytes the API server sends it."""

    def __init__(self, run_dir):
        listed = json.load(api_request(run_dir, "GET", "/apis/resource.k8s.io/v1/resourceslices?limit=1"))
        version = listed["metadata"]["resourceVersion"]
        self.stream = api_request(
            run_dir, "GET",
            f"/apis/resource.k8s.io/v1/resourceslices?watch=true&resourceVersion={version}"
            "&allowWatchBookmarks=false",
            accept="application/vnd.kubernetes.protobuf;stream=watch", timeout=3600)
        self.events, self.bytes = 0, 0
        self.taken = (0, 0)
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self):
        # Protobuf watch streams frame each event with a 4-byte big-endian length.
        while True:
            head = self.stream.read(4)
            if len(head) < 4:
                return
            size = int.from_bytes(head, "big")
            self.stream.read(size)
            self.events += 1
            self.bytes += 4 + size

    def take(self, settle=3.0):
        """The events and bytes since the last take, once nothing has come for `settle` seconds."""
        last = (-1, -1)
        while last != (self.events, self.bytes):
            last = (self.events, self.bytes)
            time.sleep(settle)
        events, size = self.events - self.taken[0], self.bytes - self.taken[1]
        self.taken = (self.events, self.bytes)
        return events, size


def node_updates(run_dir, node, watcher):
    """What one node's update costs a slice watcher: a taint on one GPU (the plugin rewrites that
    GPU's slice and keeps the generation) and a republished pool (a new generation: every slice)."""
    base = "/apis/resource.k8s.io/v1/resourceslices"
    watcher.take(settle=1.0)
    mine = [s for s in json.load(api_request(run_dir, "GET", f"{base}?fieldSelector=spec.nodeName={node}"))["items"]]
    mine.sort(key=lambda s: s["metadata"]["name"])
    # One GPU's device gets a taint: the slice that holds it is updated in place.
    target = next(s for s in mine if s["spec"].get("devices"))
    target["spec"]["devices"][0]["taints"] = [{"key": "gpu.dra.dev/xid", "value": "79", "effect": "NoSchedule"}]
    api_request(run_dir, "PUT", f"{base}/{target['metadata']['name']}", json.dumps(target).encode()).read()
    taint = watcher.take()
    # The pool at a new generation, without the taint: every slice is written again.
    mine = [s for s in json.load(api_request(run_dir, "GET", f"{base}?fieldSelector=spec.nodeName={node}"))["items"]]
    for s in mine:
        s["spec"]["pool"]["generation"] += 1
        for device in s["spec"].get("devices") or []:
            device.pop("taints", None)
        api_request(run_dir, "PUT", f"{base}/{s['metadata']['name']}", json.dumps(s).encode()).read()
    republish = watcher.take()
    return {"taint_one_gpu": {"events": taint[0], "bytes": taint[1]},
            "republish_pool": {"events": republish[0], "bytes": republish[1]}}


def idle_requests(run_dir, seconds):
    """Requests per second the API server serves with nothing happening, from its own counter."""
    def total():
        text = api_request(run_dir, "GET", "/metrics", accept="text/plain").read().decode()
        return summed(parse(text), "apiserver_request_total")
    before = total()
    time.sleep(seconds)
    return round((total() - before - 1) / seconds, 2)  # less the /metrics request itself


def ms(seconds):
    return None if seconds is None else round(seconds * 1000, 1)


def clean_up(ns):
    """Deletes a run's pods at once (no kubelet confirms their end, so a graceful delete never ends and
    their claims would keep the devices), then its namespace."""
    kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=0", "--force", "--wait=true", check=False)
    kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", check=False)


# Static MIG: the layouts an admin made beforehand, half the GPUs as seven 1g devices, half as
# 3g + 2g + 1g; every profile the MIG claims ask for exists.
STATIC_LAYOUTS = [
    "[" + ", ".join(f"{{profile: 1g.10gb, start: {i}}}" for i in range(7)) + "]",
    "[{profile: 3g.40gb, start: 0}, {profile: 2g.20gb, start: 4}, {profile: 1g.10gb, start: 6}]",
]


def static_mig_profile(bin_path, profile, path):
    """The built-in profile with MIG mode on and STATIC_LAYOUTS' devices made, as a profile file."""
    text = subprocess.run([bin_path, "fake", "show", profile], capture_output=True, text=True,
                          check=True).stdout
    parts = text.split("migEnabled: false")
    out = parts[0]
    for index, rest in enumerate(parts[1:]):
        layout = STATIC_LAYOUTS[0] if index < (len(parts) - 1) // 2 else STATIC_LAYOUTS[1]
        out += f"migEnabled: true\n  migInstances: {layout}" + rest
    open(path, "w").write(out)
    return path


def claim_spec(kind):
    gpu = {"deviceClassName": "gpu.dra.dev"}
    mig = {"deviceClassName": "mig.gpu.dra.dev"}

    def profile(p):
        return {**mig, "selectors": [{"cel": {"expression":
                f'device.attributes["{DRIVER}"].profile == "{p}"'}}]}
    if kind == "whole":
        return {"requests": [{"name": "gpu", "exactly": gpu}]}
    if kind == "mig-1g":
        return {"requests": [{"name": "mig", "exactly": profile("1g.10gb")}]}
    if kind == "mig-mixed":
        return {"requests": [{"name": "a", "exactly": profile("1g.10gb")},
                             {"name": "b", "exactly": profile("2g.20gb")},
                             {"name": "c", "exactly": profile("3g.40gb")}]}
    if kind == "nvlink-pair":
        return {"requests": [{"name": "gpus", "exactly": {**gpu, "count": 2}}],
                "constraints": [{"matchAttribute": f"{DRIVER}/nvlinkDomain"}]}
    if kind == "unfit":
        return {"requests": [{"name": "gpus", "exactly": {**gpu, "count": 9}}]}
    sys.exit(f"unknown claim kind {kind}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/gpu-dra")
    ap.add_argument("--run-dir", default="/tmp/k8s")
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--pods", type=int, default=50)
    ap.add_argument("--mig-mode", default="none", choices=["none", "static", "dynamic"])
    ap.add_argument("--profile", default="dgx-h100")
    ap.add_argument("--claim", default="whole")
    ap.add_argument("--qps", type=int, default=1000)
    ap.add_argument("--sched-port", type=int, default=20259)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--cpu-profile", help="write the scheduler's pprof CPU profile of the run's first "
                    "--profile-seconds here (read it with: go tool pprof -top FILE)")
    ap.add_argument("--profile-seconds", type=int, default=20)
    ap.add_argument("--bare", action="store_true",
                    help="a floor, not a layout to publish: the same devices with their type attribute only, "
                    "no capacity, no counters (what the scheduler spends on the number of devices alone)")
    ap.add_argument("--etcd-port", type=int, default=12379)
    ap.add_argument("--idle-seconds", type=int, default=20)
    args = ap.parse_args()
    os.environ.setdefault("KUBECONFIG", os.path.join(args.run_dir, "admin.kubeconfig"))

    sched_pid = restart_with_qps(args.run_dir, "kube-scheduler", args.qps)
    restart_with_qps(args.run_dir, "kube-controller-manager", args.qps)
    kubectl("apply", "-f", "deploy/base/deviceclasses.yaml")
    # Pods of an earlier run (one interrupted) would hold devices: their namespaces go first.
    for old in kubectl("get", "namespace", "-l", "gpu-dra-scale=run", "-o", "name").split():
        clean_up(old.split("/")[1])
    ns = f"scale-{int(time.time())}"
    kubectl("create", "namespace", ns)
    kubectl("label", "namespace", ns, "gpu-dra-scale=run")

    # Nodes, Ready, with room for the pods (no kubelet: the status is written once). Nodes of other
    # runs go, with every benchmark slice: each run's cluster holds only its own nodes and slices.
    nodes = [f"scale-{args.mig_mode}-{i:04d}" for i in range(args.nodes)]
    existing = set(kubectl("get", "nodes", "-l", "gpu-dra-scale=node", "-o", "name").split())
    stale = sorted(existing - {f"node/{n}" for n in nodes})
    for chunk in range(0, len(stale), 200):
        kubectl("delete", "--wait=false", *stale[chunk:chunk + 200])
    items = []
    for name in nodes:
        if f"node/{name}" in existing:
            continue
        items.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "gpu-dra-scale": "node"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}],
                       "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "250"},
                       "capacity": {"cpu": "64", "memory": "512Gi", "pods": "250"}}})
    for chunk in range(0, len(items), 200):
        batch = items[chunk:chunk + 200]
        kubectl("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": batch}))
    for item in items:  # the status subresource is ignored on create
        api_request(args.run_dir, "PATCH", f"/api/v1/nodes/{item['metadata']['name']}/status",
                    json.dumps({"status": item["status"]}).encode(),
                    content_type="application/merge-patch+json").read()

    # Each node's slices, as the plugin would publish them to this server (1.34 keeps counter sets
    # beside the devices, 1.35 in slices of their own).
    minor = re.sub(r"\D", "", json.loads(kubectl("version", "-o", "json"))["serverVersion"]["minor"])
    fake_profile = args.profile
    if args.mig_mode == "static":
        fake_profile = static_mig_profile(args.bin, args.profile, f"/tmp/gpu-dra-scale-{args.profile}-static.yaml")
    def node_slices(name):
        out = subprocess.run([args.bin, "devices", "--backend", "fake", "--fake-profile", fake_profile,
                              "--node-name", name, "--mig-mode", args.mig_mode, "--kubernetes-minor", minor,
                              "-o", "json"],
                             capture_output=True, text=True, check=True).stdout
        slices = json.loads(out)
        slices = slices.get("items", slices) if isinstance(slices, dict) else slices
        for i, s in enumerate(slices):
            if args.bare:
                s["spec"].pop("sharedCounters", None)
                for device in s["spec"].get("devices") or []:
                    device["attributes"] = {"type": device["attributes"]["type"]}
                    for field in ("capacity", "consumesCounters"):
                        device.pop(field, None)
            s.setdefault("apiVersion", "resource.k8s.io/v1")
            s.setdefault("kind", "ResourceSlice")
            s["metadata"] = {"name": f"{name}-{DRIVER}-{i}", "labels": {"gpu-dra-scale": "slice"}}
        return slices

    # The slices of a run with the same layout (what the binary prints for the first node, less its
    # name) are kept: writing 1,000 nodes' slices again takes minutes.
    first = node_slices(nodes[0])
    layout = hashlib.sha1(json.dumps(first).replace(nodes[0], "NODE").encode()).hexdigest()[:16]
    per_node = {"slice_json_bytes_per_node": len(json.dumps(first)), "slices_per_node": len(first),
                "devices_per_node": sum(len(s["spec"].get("devices") or []) for s in first)}
    kept = kubectl("get", "resourceslices", "-l", f"gpu-dra-scale-layout={layout}", "-o", "name").split()
    if len(kept) != len(first) * len(nodes):
        kubectl("delete", "resourceslices", "-l", "gpu-dra-scale=slice", "--wait=true")
        pending = []
        for name in nodes:
            slices = first if name == nodes[0] else node_slices(name)
            for s in slices:
                s["metadata"]["labels"]["gpu-dra-scale-layout"] = layout
            pending.extend(slices)
            if len(pending) >= 100 or name == nodes[-1]:
                kubectl("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": pending}))
                pending = []

    # The API server's side, before any pod: etcd bytes per node (three nodes' slices, as stored),
    # what a watcher of all slices receives for one node's updates, the request rate at rest.
    apiserver = {
        "etcd_bytes_per_node": round(sum(etcd_bytes(args.etcd_port, f"/registry/resourceslices/{n}-")
                                         for n in nodes[:3]) / len(nodes[:3])),
    }
    watcher = SliceWatcher(args.run_dir)
    apiserver["watch_per_node_update"] = node_updates(args.run_dir, nodes[-1], watcher)
    apiserver["idle_requests_per_s"] = idle_requests(args.run_dir, args.idle_seconds)
    apiserver["apiserver_rss_mib"] = rss_mib(args.run_dir, "kube-apiserver")
    apiserver["scheduler_rss_mib"] = rss_mib(args.run_dir, "kube-scheduler")

    before = parse(metrics(args.run_dir, args.sched_port))
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "claim", "namespace": ns}, "spec": {"spec": {"devices": claim_spec(args.claim)}}}
    kubectl("apply", "-f", "-", stdin=json.dumps(template))
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p-{i:05d}", "namespace": ns},
             "spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                          "nodeSelectorTerms": [{"matchExpressions": [
                              {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}]}}},
                      "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "claim"}],
                      "containers": [{"name": "c", "image": "busybox",
                                      "resources": {"claims": [{"name": "gpu"}]}}]}}
            for i in range(args.pods)]
    profiler = None
    if args.cpu_profile:
        def take_profile():
            data = component_get(args.run_dir, args.sched_port,
                                 f"/debug/pprof/profile?seconds={args.profile_seconds}",
                                 timeout=args.profile_seconds + 30)
            open(args.cpu_profile, "wb").write(data)
        profiler = threading.Thread(target=take_profile)
        profiler.start()
    cpu_before = cpu_seconds(sched_pid)
    start = time.monotonic()
    kubectl("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}))
    bound, last_change, wall = 0, start, 0.0
    while time.monotonic() - start < args.timeout:
        listed = json.loads(kubectl("get", "pods", "-n", ns, "-o", "json"))["items"]
        now_bound = sum(1 for p in listed if p["spec"].get("nodeName"))
        if now_bound != bound:
            bound, last_change = now_bound, time.monotonic()
        wall = last_change - start
        # All bound, or nothing bound for 15 s (the rest does not fit: unfit claims, a full cluster).
        if bound == args.pods or time.monotonic() - last_change > 15:
            break
        time.sleep(0.5)
    sched_cpu = cpu_seconds(sched_pid) - cpu_before
    after = parse(metrics(args.run_dir, args.sched_port))
    if profiler:
        profiler.join()
    d = delta(after, before)
    dra = {"plugin": "DynamicResources"}
    report = {
        "nodes": args.nodes, "pods": args.pods, "mig_mode": args.mig_mode + (" (bare)" if args.bare else ""),
        "claim": args.claim,
        # wall_s: until the last pod was bound.
        "bound": bound, "wall_s": round(wall, 2), "pods_per_s": round(bound / wall, 1) if wall else None,
        "sli_p50_ms": ms(quantile(d, "scheduler_pod_scheduling_sli_duration_seconds", 0.5)),
        "sli_p99_ms": ms(quantile(d, "scheduler_pod_scheduling_sli_duration_seconds", 0.99)),
        # The scheduling cycle's algorithm (PreFilter, Filter over all nodes, Score), every pod, every try.
        "algorithm_p50_ms": ms(quantile(d, "scheduler_scheduling_algorithm_duration_seconds", 0.5)),
        "algorithm_p99_ms": ms(quantile(d, "scheduler_scheduling_algorithm_duration_seconds", 0.99)),
        # The scheduler's CPU time (all its threads: informers, queue, binding too) per pod bound.
        "scheduler_cpu_ms_per_pod": round(1000 * sched_cpu / bound, 2) if bound else None,
        # Per scheduling attempt, failed ones too (unfit claims are never bound).
        "scheduler_cpu_ms_per_attempt": (lambda n: round(1000 * sched_cpu / n, 2) if n else None)(
            summed(d, "scheduler_schedule_attempts_total")),
        # The scheduler samples plugin timings (a tenth of the cycles), so these are means per call.
        "dra_plugin_ms_per_call": {
            ep: mean_ms(d, "scheduler_plugin_execution_duration_seconds", {**dra, "extension_point": ep})
            for ep in ["PreFilter", "Filter", "Reserve", "PreBind"]},
        "attempts": {r: summed(d, "scheduler_schedule_attempts_total", {"result": r})
                     for r in ["scheduled", "unschedulable", "error"]},
        **per_node,
        "apiserver": apiserver,
    }
    print(json.dumps(report))
    clean_up(ns)


if __name__ == "__main__":
    main()
