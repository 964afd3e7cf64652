#!/usr/bin/env python3
"""What our slices cost the real kube-scheduler (issue 28): N nodes with the slices `gpu-dra devices`
publishes for them, then M pods with claims from a template, created at once, measured until all are
bound. Against the control plane of ../shared/realk8s (up.sh), kept out of CI.

    benches/realk8s/scale.py --bin target/release/gpu-dra --nodes 10 --pods 50 --mig-mode dynamic \
        --claim whole [--run-dir /tmp/k8s] [--qps 1000]

It restarts kube-scheduler and kube-controller-manager with --kube-api-qps/--kube-api-burst raised (their
client rate limits would otherwise bound throughput before the DRA search does), makes the nodes Ready
(Node objects; no kubelet), writes each node's slices, then the template and the pods. Reported, one
JSON line: wall time to all bound and pods/s; the scheduler's own metrics as deltas over the run (its
pod_scheduling_sli_duration p50/p99, the DynamicResources plugin's Filter/PreFilter/Reserve/PreBind time
per pod, scheduling attempts by result); bytes of slices per node as the API server returns them.
Claims: whole (one GPU), mig-1g (one 1g MIG device), mig-mixed (1g + 2g + 3g), nvlink-pair (two GPUs with
matchAttribute nvlinkDomain), unfit (more GPUs than a node has: how long failing takes).
"""
import argparse
import json
import os
import re
import ssl
import subprocess
import sys
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
    cmd = [c.decode() for c in cmd if not c.startswith((b"--kube-api-qps", b"--kube-api-burst"))]
    cmd += [f"--kube-api-qps={qps}", f"--kube-api-burst={2 * qps}"]
    os.kill(pid, 15)
    for _ in range(100):
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.1)
    log = open(os.path.join(run_dir, "logs", f"{name}.log"), "a")
    child = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    open(pid_file, "w").write(f"{child.pid}\n")
    return child.pid


def metrics(run_dir, port):
    token = open(os.path.join(run_dir, "pki", "tokens.csv")).read().split(",")[0]
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    for _ in range(100):
        try:
            req = urllib.request.Request(f"https://127.0.0.1:{port}/metrics",
                                         headers={"Authorization": f"Bearer {token}"})
            return urllib.request.urlopen(req, context=ctx, timeout=10).read().decode()
        except Exception:  # the component is still starting
            time.sleep(0.2)
    sys.exit(f"no metrics on port {port}")


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


def clean_up(ns):
    """Deletes a run's pods at once (no kubelet confirms their end, so a graceful delete never ends and
    their claims would keep the devices), then its namespace."""
    kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=0", "--force", "--wait=true", check=False)
    kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", check=False)


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
    args = ap.parse_args()
    os.environ.setdefault("KUBECONFIG", os.path.join(args.run_dir, "admin.kubeconfig"))

    restart_with_qps(args.run_dir, "kube-scheduler", args.qps)
    restart_with_qps(args.run_dir, "kube-controller-manager", args.qps)
    kubectl("apply", "-f", "deploy/base/deviceclasses.yaml")
    # Pods of an earlier run (one interrupted) would hold devices: their namespaces go first.
    for old in kubectl("get", "namespace", "-l", "gpu-dra-scale=run", "-o", "name").split():
        clean_up(old.split("/")[1])
    ns = f"scale-{int(time.time())}"
    kubectl("create", "namespace", ns)
    kubectl("label", "namespace", ns, "gpu-dra-scale=run")

    # Nodes, Ready, with room for the pods (no kubelet: the status is written once).
    nodes = [f"scale-{args.mig_mode}-{i:04d}" for i in range(args.nodes)]
    existing = set(kubectl("get", "nodes", "-o", "name").split())
    items = []
    for name in nodes:
        if f"node/{name}" in existing:
            continue
        items.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "scale": ns}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}],
                       "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "250"},
                       "capacity": {"cpu": "64", "memory": "512Gi", "pods": "250"}}})
    if items:
        kubectl("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        for item in items:  # the status subresource is ignored on create
            kubectl("patch", "node", item["metadata"]["name"], "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": item["status"]}))

    # Each node's slices, as the plugin would publish them to this server (1.34 keeps counter sets
    # beside the devices, 1.35 in slices of their own).
    minor = re.sub(r"\D", "", json.loads(kubectl("version", "-o", "json"))["serverVersion"]["minor"])
    slice_bytes = []
    for name in nodes:
        out = subprocess.run([args.bin, "devices", "--backend", "fake", "--fake-profile", args.profile,
                              "--node-name", name, "--mig-mode", args.mig_mode, "--kubernetes-minor", minor,
                              "-o", "json"],
                             capture_output=True, text=True, check=True).stdout
        slices = json.loads(out)
        slices = slices.get("items", slices) if isinstance(slices, dict) else slices
        for i, s in enumerate(slices):
            s.setdefault("apiVersion", "resource.k8s.io/v1")
            s.setdefault("kind", "ResourceSlice")
            s["metadata"] = {"name": f"{name}-{DRIVER}-{i}"}
        text = json.dumps({"apiVersion": "v1", "kind": "List", "items": slices})
        kubectl("apply", "--server-side", "-f", "-", stdin=text)
        slice_bytes.append(len(text))

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
    after = parse(metrics(args.run_dir, args.sched_port))
    d = delta(after, before)
    dra = {"plugin": "DynamicResources"}
    report = {
        "nodes": args.nodes, "pods": args.pods, "mig_mode": args.mig_mode, "claim": args.claim,
        # wall_s: until the last pod was bound.
        "bound": bound, "wall_s": round(wall, 2), "pods_per_s": round(bound / wall, 1) if wall else None,
        "sli_p50_ms": (lambda v: v and round(v * 1000, 1))(quantile(d, "scheduler_pod_scheduling_sli_duration_seconds", 0.5)),
        "sli_p99_ms": (lambda v: v and round(v * 1000, 1))(quantile(d, "scheduler_pod_scheduling_sli_duration_seconds", 0.99)),
        # The scheduler samples plugin timings (a tenth of the cycles), so these are means per call.
        "dra_plugin_ms_per_call": {
            ep: mean_ms(d, "scheduler_plugin_execution_duration_seconds", {**dra, "extension_point": ep})
            for ep in ["PreFilter", "Filter", "Reserve", "PreBind"]},
        "attempts": {r: summed(d, "scheduler_schedule_attempts_total", {"result": r})
                     for r in ["scheduled", "unschedulable", "error"]},
        "slice_json_bytes_per_node": round(sum(slice_bytes) / len(slice_bytes)),
    }
    print(json.dumps(report))
    clean_up(ns)


if __name__ == "__main__":
    main()
