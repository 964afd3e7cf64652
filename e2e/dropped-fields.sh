#!/usr/bin/env bash
# Runs the plugin (fake dgx-h100) against a real API server and counts its ResourceSlice writes, to see
# whether it loops when the server drops gated fields. Start the server as a default 1.34 cluster
# (`FEATURE_GATES=DynamicResourceAllocation=true ../shared/realk8s/up.sh DIR`, DRAPartitionableDevices and
# DRADeviceTaints off) or with every DRA gate on (up.sh's default), then:
#
#   KUBECONFIG=DIR/admin.kubeconfig e2e/dropped-fields.sh [BINARY]      (default target/release/gpu-dra)
#
# Two runs on node-1, each printing the slice changes seen in a 10 s window, the devices stored and the
# Node's Events: dynamic MIG once settled; static MIG in the 10 s after an XID 79 on gpu-1. Fixed builds
# show 0 and 1 changes; before the plugin learned which fields the server drops (a dry-run write at start,
# each write's answer compared with what it sent) a default 1.34 server saw about 110 and 9.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${1:-$ROOT/target/release/gpu-dra}"
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT

kubectl apply --validate=false -f "$ROOT/crd/" >/dev/null || exit 1
kubectl get node node-1 >/dev/null 2>&1 || kubectl create -f - >/dev/null <<'NODE' || exit 1
{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}}
NODE
"$BIN" fake show dgx-h100 > "$WORK/profile.yaml" || exit 1

stored() {
  kubectl get resourceslices -o json | python3 -c '
import json, sys
items = json.load(sys.stdin)["items"]
devices = [d for s in items for d in (s["spec"].get("devices") or [])]
print("slices:", len(items), "devices:", len(devices),
      "counter sets:", sum(len(s["spec"].get("sharedCounters") or []) for s in items),
      "taints:", sum(len(d.get("taints") or []) for d in devices),
      "missing GPUs:", sorted({"gpu-%d" % i for i in range(8)} - {d["name"] for d in devices}))'
  kubectl get events -n default --field-selector involvedObject.kind=Node,involvedObject.name=node-1 \
    -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message --no-headers | cut -c1-160
}

run() { # name, mig mode: starts the plugin in the background
  kubectl delete resourceslices --all >/dev/null 2>&1
  kubectl delete events -n default --all >/dev/null 2>&1
  mkdir -p "$WORK/$1"
  "$BIN" plugin --backend fake --fake-profile "$WORK/profile.yaml" --node-name node-1 \
    --kubelet-registry-dir "$WORK/$1/reg" --kubelet-plugins-dir "$WORK/$1/plugins" --cdi-root "$WORK/$1/cdi" \
    --http-addr "" --rescan-seconds 1 --mig-mode "$2" > "$WORK/$1/plugin.log" 2>&1 &
  PLUGIN=$!
}

changes_in_10s() {
  timeout 10 kubectl get resourceslices --watch-only -o name 2>/dev/null | wc -l
}

run dynamic dynamic
sleep 10
echo "dynamic MIG, settled: $(changes_in_10s) slice changes in 10 s"
stored
kill "$PLUGIN"; wait "$PLUGIN" 2>/dev/null

run static static
sleep 8
python3 - "$WORK/profile.yaml" <<'PY'
import sys, yaml
path = sys.argv[1]
profile = yaml.safe_load(open(path))
profile["gpus"][1]["faults"] = [{"kind": "xid", "xid": 79}]
yaml.safe_dump(profile, open(path, "w"))
PY
echo "static MIG, XID 79 on gpu-1: $(changes_in_10s) slice changes in the 10 s after it"
stored
kill "$PLUGIN"; wait "$PLUGIN" 2>/dev/null
