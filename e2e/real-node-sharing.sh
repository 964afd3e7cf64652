#!/usr/bin/env bash
# GPU sharing on a real kubelet and containerd: the node from ../shared/realk8s/node (up-node.sh, then
# start-plugin.sh with this tree's target/release/gpu-dra). Runs the workloads of e2e/workloads/ that share
# GPUs (a time-sliced GPU used by two containers, an MPS claim used by two pods, one exclusive claim used by two
# pods), then MPS memory shares: a GpuNodePolicy with mpsMemoryShares and two claims of 30Gi that the real
# scheduler packs onto one GPU, each with its own daemon limited to its share. The API server, scheduler and
# kubelet need DRAConsumableCapacity=true for the second part (FEATURE_GATES of up.sh, featureGates of the
# kubelet's config); without it that part reports FAIL.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/real-node-sharing.sh     (as root, from the project root)
#
# Each check prints PASS or FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
PLUGINS=${KUBELET_PLUGINS_DIR:-/var/lib/kubelet/plugins}
CDI=${CDI_ROOT:-/var/run/cdi}
MPS=$PLUGINS/gpu.dra.dev/mps
N=gpu-dra-e2e
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
daemons() { pgrep -f 'mps-control-daemon -f' | wc -l; }
logs() { kubectl logs -n "$N" "$@" 2>&1; }
devices_of() { logs "$@" | grep '^GPU_DRA_DEVICE_' | sort; }
same_devices() { local a; a=$(devices_of $1); [ -n "$a" ] && [ "$a" = "$(devices_of $2)" ]; }
same_devices_c() { local a; a=$(devices_of time-sliced-gpu -c first); [ -n "$a" ] && [ "$a" = "$(devices_of time-sliced-gpu -c second)" ]; }

kubectl apply -f deploy/base/deviceclasses.yaml -f crd/gpu.dra.dev_gpunodepolicies.yaml >/dev/null
# The node has no registry: the workloads' busybox comes from the image up-node.sh imported.
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
for f in 00-namespace time-sliced-gpu mps-gpu shared-claim; do
  sed 's#image: busybox:1.36#image: localhost/busybox:local\n      imagePullPolicy: Never#' "e2e/workloads/$f.yaml" > "$W/$f.yaml"
done
kubectl apply -f "$W/00-namespace.yaml" >/dev/null && kubectl apply -f "$W/" >/dev/null
kubectl wait -n "$N" --for=condition=Ready pod/time-sliced-gpu pod/mps-a pod/mps-b pod/shared-claim-a \
  pod/shared-claim-b --timeout=120s >/dev/null || kubectl get pods -n "$N" -o wide

for c in first second; do
  check "time-sliced-gpu/$c has GPU_DRA_SHARING=TimeSlicing/Long" grep -qx 'GPU_DRA_SHARING=TimeSlicing/Long' <<<"$(logs time-sliced-gpu -c $c)"
done
check "both containers of time-sliced-gpu got the same GPU" same_devices_c
for p in mps-a mps-b; do
  out=$(logs $p)
  check "$p has GPU_DRA_SHARING=MPS" grep -qx 'GPU_DRA_SHARING=MPS' <<<"$out"
  check "$p has CUDA_MPS_PIPE_DIRECTORY" grep -qx 'CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps' <<<"$out"
  check "$p sees the daemon's pipe directory" grep -qx 'nvidia-cuda-mps-control.pid' <<<"$out"
done
check "mps-a and mps-b got the same GPU" same_devices mps-a mps-b
check "one MPS daemon for the claim both pods use" test "$(daemons)" = 1
check "shared-claim-a and shared-claim-b got the same GPU" same_devices shared-claim-a shared-claim-b
kubectl delete -n "$N" pods,resourceclaims --all --wait=true --timeout=90s >/dev/null
sleep 3
check "the MPS daemon stopped when its claim was unprepared" test "$(daemons)" = 0

# MPS memory shares.
kubectl apply -f - >/dev/null <<'YAML'
apiVersion: gpu.dra.dev/v1alpha1
kind: GpuNodePolicy
metadata: {name: e2e-mps-shares}
spec:
  nodeSelector: {}
  migMode: none
  sharing: {mpsMemoryShares: {minimum: 2Gi, step: 1Gi}}
YAML
shared() { kubectl get resourceslices -o json | grep -q '"allowMultipleAllocations": true'; }
for _ in $(seq 60); do shared && break; sleep 1; done
check "the slices publish GPUs with allowMultipleAllocations" shared
for n in a b; do
  kubectl apply -f - >/dev/null <<YAML
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: share-$n, namespace: $N}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.dra.dev
          capacity: {requests: {memory: 30Gi}}
---
apiVersion: v1
kind: Pod
metadata: {name: share-$n, namespace: $N}
spec:
  terminationGracePeriodSeconds: 2
  containers:
    - name: ctr
      image: localhost/busybox:local
      imagePullPolicy: Never
      command: ["sh", "-c", "env | grep -E '^(GPU_DRA_|CUDA_MPS_)'; sleep 3600"]
      resources: {claims: [{name: gpu}]}
  resourceClaims: [{name: gpu, resourceClaimName: share-$n}]
YAML
done
kubectl wait -n "$N" --for=condition=Ready pod/share-a pod/share-b --timeout=90s >/dev/null
device() { kubectl get resourceclaim -n "$N" "share-$1" -o jsonpath='{.status.allocation.devices.results[0].device}'; }
da=$(device a); db=$(device b)
check "the scheduler packed both 30Gi claims onto one GPU ($da, $db)" test -n "$da" -a "$da" = "$db"
for n in a b; do check "share-$n has GPU_DRA_SHARING=MPS" grep -qx 'GPU_DRA_SHARING=MPS' <<<"$(logs share-$n)"; done
check "one daemon per claim" test "$(daemons)" = 2
limited=$(cat "$MPS"/*/log/control.log 2>/dev/null | grep -c 'set_default_device_pinned_mem_limit 0 30720M')
check "each daemon's pinned-memory limit is its 30Gi share" test "$limited" = 2
kubectl delete namespace "$N" --wait=true --timeout=90s >/dev/null
kubectl delete gpunodepolicy e2e-mps-shares >/dev/null
sleep 3
check "the daemons stopped" test "$(daemons)" = 0
check "no CDI spec of the driver is left" sh -c "! ls '$CDI' | grep -q gpu.dra.dev"
echo "real-node-sharing.sh: $failures failed"
exit "$failures"
