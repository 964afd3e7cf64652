#!/usr/bin/env bash
# The chain dcgm-exporter follows to attribute GPU metrics to pods, on the real node of
# ../shared/realk8s/node: the kubelet's PodResources List reports a pod's claim devices as
# (driver, pool, device), and the node's ResourceSlices resolve each to a GPU UUID (type, uuid, parentUUID,
# profile). For our own driver name and for NVIDIA's (compatibility mode), a pod with two whole GPUs and a
# dynamic MIG device runs; `gpu-dra pod-devices` (over the kubelet's real socket) must name, for each device,
# the UUID the plugin injected into the container (GPU_DRA_DEVICE_<name>), and for the MIG device its parent.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig GPU_DRA_BIN=target/debug/gpu-dra e2e/real-node-pod-devices.sh
#   (as root, from the project root, after realk8s/up.sh and realk8s/node/up-node.sh, with no plugin running)
#
# Each check prints PASS or FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
cd "$(dirname "$0")/.."
REALK8S=${REALK8S:-../shared/realk8s}
BIN=${GPU_DRA_BIN:-target/release/gpu-dra}
STATE=${NODE_STATE_DIR:-/tmp/gpu-dra-node}
SOCKET=${POD_RESOURCES_SOCKET:-/var/lib/kubelet/pod-resources/kubelet.sock}
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }

stop_plugin() {
  local pid
  pid=$(cat "$STATE/pids/gpu-dra.pid" 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null
}

for driver in gpu.dra.dev gpu.nvidia.com; do
  echo "----- driver name $driver"
  if [ "$driver" = gpu.nvidia.com ]; then
    kubectl apply -f deploy/components/nvidia-compat/deviceclasses.yaml >/dev/null
    gpu_class=gpu.nvidia.com mig_class=mig.nvidia.com
  else
    kubectl apply -f deploy/base/deviceclasses.yaml >/dev/null
    gpu_class=gpu.dra.dev mig_class=mig.gpu.dra.dev
  fi
  DRIVER_NAME=$driver GPU_DRA_BIN=$BIN "$REALK8S/node/start-plugin.sh" "$KUBECONFIG" "$STATE" --mig-mode dynamic >/dev/null ||
    { bad "$driver: plugin started"; continue; }
  ns=pod-devices-${driver//./-}
  kubectl create namespace "$ns" >/dev/null
  kubectl apply -n "$ns" -f - >/dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: gpus}
spec:
  spec:
    devices:
      requests:
      - {name: whole, exactly: {deviceClassName: $gpu_class, count: 2}}
      - name: mig
        exactly:
          deviceClassName: $mig_class
          selectors: [{cel: {expression: "device.attributes['$driver'].profile == '1g.10gb'"}}]
---
apiVersion: v1
kind: Pod
metadata: {name: trainer}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: localhost/busybox:local
    imagePullPolicy: Never
    command: ["sh", "-c", "sleep 600"]
    resources: {claims: [{name: gpus}]}
  resourceClaims: [{name: gpus, resourceClaimTemplateName: gpus}]
EOF
  if kubectl wait -n "$ns" --for=condition=Ready pod/trainer --timeout=90s >/dev/null; then
    ok "$driver: pod Running with two GPUs and a MIG device"
  else
    bad "$driver: pod Running"; kubectl describe -n "$ns" pod/trainer | tail -15
  fi
  env_text=$(kubectl exec -n "$ns" trainer -- env 2>/dev/null | grep '^GPU_DRA_DEVICE_')
  rows=$("$BIN" pod-devices --pod-resources-socket "$SOCKET" --kubeconfig "$KUBECONFIG" --driver-name "$driver" -o json)
  echo "$rows" | python3 -c '
import json, sys
rows = [r for r in json.load(sys.stdin) if r["pod"] == "trainer"]
for r in rows:
    i = r.get("identity") or {}
    print(r["device"], i.get("type", "-"), i.get("uuid") or "-", i.get("parentUUID") or "-", i.get("profile") or "-", len(r["cdiDevices"]))
' > "$STATE/pod-devices.txt"
  cat "$STATE/pod-devices.txt"
  [ "$(wc -l < "$STATE/pod-devices.txt")" = 3 ] && ok "$driver: PodResources List reports the pod's 3 devices" ||
    bad "$driver: PodResources List reports 3 devices"
  while read -r device type uuid parent profile cdi; do
    var=GPU_DRA_DEVICE_$(echo "$device" | tr 'a-z.-' 'A-Z__')
    injected=$(echo "$env_text" | sed -n "s/^$var=//p")
    if [ "$type" = gpu ]; then
      if [ -n "$injected" ] && [ "$injected" = "$uuid" ] && [ "$cdi" -ge 1 ]; then
        ok "$driver: $device resolves to GPU $uuid, the GPU the container got"
      else
        bad "$driver: $device resolves to $uuid; the container got '$injected'"
      fi
    elif [ "$type" = mig ]; then
      # A dynamic MIG device has no UUID until prepare makes it: dcgm-exporter keys it by its parent.
      [ -n "$injected" ] && ok "$driver: the container got MIG device $injected" || bad "$driver: no $var in the container"
      parent_minor=${device#gpu-}; parent_minor=${parent_minor%%-*}
      want=$(kubectl get resourceslices --field-selector "spec.driver=$driver" -o json | python3 -c "
import json, sys
for s in json.load(sys.stdin)['items']:
    for d in s['spec'].get('devices', []):
        if d['name'] == 'gpu-$parent_minor':
            print(d['attributes']['uuid']['string'])")
      [ "$parent" = "$want" ] && [ "$profile" = 1g.10gb ] && ok "$driver: the MIG device's parent is gpu-$parent_minor ($parent), profile $profile" ||
        bad "$driver: MIG parent $parent (want $want), profile $profile"
    else
      bad "$driver: $device has type '$type' in the slices"
    fi
  done < "$STATE/pod-devices.txt"
  kubectl delete namespace "$ns" --wait=true --timeout=90s >/dev/null
  stop_plugin
done
echo "failures: $failures"
exit "$failures"
