#!/usr/bin/env bash
# NVIDIA compatibility mode on the real node of ../shared/realk8s/node: the plugin runs as gpu.nvidia.com
# with NVIDIA's DeviceClasses (deploy/components/nvidia-compat), and our own examples of what NVIDIA's public
# quickstart asks of its driver (e2e/nvidia-compat/*.yaml, written for NVIDIA's classes, attributes and
# configs) run unchanged. Each check reads what the containers got (GPU_DRA_DEVICE_<device>, GPU_DRA_SHARING)
# and the slices:
#   install: the image (e2e/image.sh) imported; by default installed as users do, `kubectl apply -k` of
#      e2e/real-node-nvidia-compat (the fake overlay of deploy/ with the nvidia-compat component, on the host
#      network): the plugin's DaemonSet Pod Ready with DRIVER_NAME=gpu.nvidia.com, slices of gpu.nvidia.com
#      only, NVIDIA's classes only. INSTALL=process runs the plugin as a process instead (start-plugin.sh
#      with --mig-mode dynamic and --mps-daemon-image).
#   01 two pods with a GPU each: two different GPUs
#   02 two containers of one pod, and two pods naming one ResourceClaim: one GPU each time
#   03 four MIG devices of three profiles (1g.10gb x2, 2g.20gb, 3g.40gb) with matchAttribute parentUUID: one parent
#   04 a selector on NVIDIA's `index` and NVIDIA's GpuConfig TimeSlicing Long: an even index, sharing applied
#   05 NVIDIA's GpuConfig MPS (defaultActiveThreadPercentage 50, defaultPinnedDeviceMemoryLimit 10Gi) on one
#      claim used by two pods: one GPU for both, GPU_DRA_SHARING=MPS, one daemon Pod for the claim, started
#      with both limits (its arguments and control.log: 50, 10240M), both pods see its control socket and its
#      /dev/shm segment naming the GPU's UUID; deleting the pods stops the daemon
#   06 memory shares: a GpuNodePolicy with mpsMemoryShares, then two replicas whose claims ask gpu.nvidia.com
#      for 4Gi: slices with allowMultipleAllocations, both claims on one GPU with consumedCapacity 4Gi and
#      their own shareID, MPS in both pods, one daemon per claim limited to its 4Gi (4096M); after the policy
#      is deleted the GPUs are published whole again
#   07 `nvidia.com/gpu: 1` and no resourceClaims: the class keeps extendedResourceName, the scheduler's claim
#      (annotated, owned by the pod) is allocated one whole gpu.nvidia.com GPU, the container sees that GPU,
#      Exclusive; deleting the pod deletes the claim
#   after: no CDI spec, MPS directory or daemon Pod of gpu.nvidia.com left
# 05 needs a binary with the fake MPS stand-in (cargo build --features doubles). 06 needs DRAConsumableCapacity=true
# and 07 DRAExtendedResource=true, in the API server, scheduler and controller manager (FEATURE_GATES of up.sh)
# and in the kubelet (KUBELET_FEATURE_GATES of up-node.sh):
#
#   G=DynamicResourceAllocation=true,DRADeviceTaints=true,DRAPartitionableDevices=true,DRAAdminAccess=true,DRAPrioritizedList=true
#   FEATURE_GATES=$G,DRAConsumableCapacity=true,DRAExtendedResource=true ../shared/realk8s/up.sh /tmp/k8s
#   KUBELET_FEATURE_GATES=DRAConsumableCapacity=true,DRAExtendedResource=true ../shared/realk8s/node/up-node.sh /tmp/k8s/admin.kubeconfig
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig GPU_DRA_BIN=target/debug/gpu-dra e2e/real-node-nvidia-compat.sh
#   (as root, from the project root, with no plugin running or installed; INSTALL=process for the process)
#
# Each check prints PASS or FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
cd "$(dirname "$0")/.."
REALK8S=${REALK8S:-../shared/realk8s}
BIN=${GPU_DRA_BIN:-target/release/gpu-dra}
BIN_DIR=${KUBE_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/bin}
STATE=${NODE_STATE_DIR:-/tmp/gpu-dra-node}
INSTALL=${INSTALL:-daemonset}
NODE=${NODE_NAME:-node-1}
NS=nvidia-compat
DRIVER=gpu.nvidia.com
PLUGINS=${KUBELET_PLUGINS_DIR:-/var/lib/kubelet/plugins}
MPS=$PLUGINS/$DRIVER/mps
CDI=${CDI_ROOT:-/var/run/cdi}
SEL=app.kubernetes.io/component=kubelet-plugin
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
wait_until() { local t=$1; shift; local end=$((SECONDS + t)); until "$@"; do [ $SECONDS -lt $end ] || return 1; sleep 1; done; }

# The devices a container got, one per line, from its GPU_DRA_DEVICE_* variables (gpu-3, gpu-5-mig-1g10gb-6).
devices_of() { # pod [container]
  kubectl exec -n $NS "$1" ${2:+-c "$2"} -- env 2>/dev/null | sed -n 's/^GPU_DRA_DEVICE_\([^=]*\)=.*/\1/p' |
    tr 'A-Z_' 'a-z-' | sort
}
sharing_of() { kubectl exec -n $NS "$1" -- env 2>/dev/null | sed -n 's/^GPU_DRA_SHARING=//p' | sort -u; }
in_pod() { kubectl exec -n $NS "$1" -- sh -c "$2" 2>/dev/null; }
attribute() { # device name, attribute -> its value
  kubectl get resourceslices --field-selector "spec.driver=$DRIVER" -o json | python3 -c "
import json, sys
for s in json.load(sys.stdin)['items']:
    for d in s['spec'].get('devices', []):
        if d['name'] == sys.argv[1]:
            a = d['attributes'][sys.argv[2]]
            print(next(iter(a.values())))" "$1" "$2"
}
pods_made() { [ "$(kubectl get pods -n $NS -o name 2>/dev/null | wc -l)" -ge "$1" ]; }
claim_jp() { kubectl get resourceclaim -n $NS "$1" -o jsonpath="$2" 2>/dev/null; }
run() { # file: apply, wait for its pods
  kubectl apply -n $NS -f "e2e/nvidia-compat/$1" >/dev/null || return 1
  wait_until 30 pods_made "${2:-1}" || return 1
  kubectl wait -n $NS --for=condition=Ready pod --all --timeout=120s >/dev/null
}
# Background deletion, kubectl's default: with --cascade=foreground the scheduler's claim of 07 (owned by its
# pod, blockOwnerDeletion) is deleted while the pod runs, and the resourceclaim controller of 1.34 never
# releases it (its enqueuePod skips pods without spec.resourceClaims; fixed upstream by kubernetes/kubernetes#134312).
finish() {
  kubectl delete -n $NS -f "e2e/nvidia-compat/$1" --wait=true --timeout=120s >/dev/null 2>&1
  kubectl wait -n $NS --for=delete pod --all --timeout=120s >/dev/null 2>&1
}
daemon_pods() { kubectl get pods -n gpu-dra -o name 2>/dev/null | grep -c '/gpu-dra-mps-'; }
shared_gpus() { kubectl get resourceslices --field-selector "spec.driver=$DRIVER" -o json | grep -q '"allowMultipleAllocations": true'; }

echo "----- install ($INSTALL)"
grep -q "(stand-in)" <<<"$("$BIN" fake mps-control-daemon --help 2>&1)" ||
  { echo "${0##*/}: $BIN has no MPS stand-in (05 needs it); build it with --features doubles" >&2; exit 1; }
if kubectl get daemonset -n gpu-dra gpu-dra-plugin >/dev/null 2>&1; then
  echo "${0##*/}: gpu-dra is installed already: kubectl delete -k e2e/real-node (or e2e/real-node-nvidia-compat) first" >&2
  exit 1
fi
# What an earlier run left on this host (a fresh node has none of it): the fake GPUs' state, the plugin's
# checkpoint, CDI specs.
rm -rf /var/lib/gpu-dra "$PLUGINS/$DRIVER"
rm -f "$CDI"/k8s.$DRIVER-*.json
mkdir -p /var/lib/gpu-dra && cat /proc/sys/kernel/random/boot_id > /var/lib/gpu-dra/boot_id
# The image: the plugin's in a DaemonSet install, and the MPS daemon Pods' in both.
IMG=$(mktemp -d); trap 'rm -rf "$IMG"' EXIT
e2e/image.sh "$BIN" gpu-dra:dev "$IMG/gpu-dra-image.tar" >/dev/null || { bad "image built from $BIN"; exit "$failures"; }
"$BIN_DIR/ctr" -n k8s.io images import "$IMG/gpu-dra-image.tar" >/dev/null
"$BIN_DIR/ctr" -n k8s.io images ls -q 2>/dev/null | grep -qx localhost/busybox:local ||
  "$BIN_DIR/ctr" -n k8s.io images import --local "${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/images/busybox.tar" >/dev/null
check "image gpu-dra:dev imported into containerd" \
  bash -c "'$BIN_DIR/ctr' -n k8s.io images ls -q | grep -qx 'docker.io/library/gpu-dra:dev'"
kubectl apply -f crd/ >/dev/null
if [ "$INSTALL" = daemonset ]; then
  kubectl label node "$NODE" gpu-dra.dev/fake=true --overwrite >/dev/null
  kubectl apply -k e2e/real-node-nvidia-compat >/dev/null
  sleep 2
  check "plugin DaemonSet Pod Ready" \
    kubectl wait -n gpu-dra --for=condition=Ready pod -l $SEL --timeout=120s
  kubectl get pods -n gpu-dra -o wide
  check "the plugin's container runs with DRIVER_NAME=$DRIVER" test "$(kubectl get daemonset -n gpu-dra gpu-dra-plugin \
    -o jsonpath='{.spec.template.spec.containers[0].env[?(@.name=="DRIVER_NAME")].value}')" = $DRIVER
else
  kubectl apply -f deploy/components/nvidia-compat/deviceclasses.yaml >/dev/null
  # Where the MPS daemon Pods run (POD_NAMESPACE's default); removed at the end if made here.
  kubectl create namespace gpu-dra >/dev/null 2>&1 && made_gpu_dra_namespace=1
  DRIVER_NAME=$DRIVER GPU_DRA_BIN=$BIN "$REALK8S/node/start-plugin.sh" "$KUBECONFIG" "$STATE" --mig-mode dynamic \
    --mps-daemon-image gpu-dra:dev >/dev/null || { bad "plugin started as $DRIVER"; exit "$failures"; }
  ok "plugin started as $DRIVER (--mig-mode dynamic --mps-daemon-image gpu-dra:dev)"
fi
published() { [ "$(kubectl get resourceslices --field-selector "spec.driver=$DRIVER" -o name | wc -l)" -gt 0 ]; }
check "slices of $DRIVER published" wait_until 60 published
check "and none of gpu.dra.dev" test -z "$(kubectl get resourceslices --field-selector spec.driver=gpu.dra.dev -o name)"
check "NVIDIA's DeviceClasses only (gpu.nvidia.com, mig.nvidia.com, vfio.gpu.nvidia.com)" \
  test "$(kubectl get deviceclasses -o jsonpath='{.items[*].metadata.name}' | tr ' ' '\n' | grep -v '^imex-channel\.' | tr '\n' ' ')" = "gpu.nvidia.com mig.nvidia.com vfio.gpu.nvidia.com "
kubectl create namespace $NS >/dev/null 2>&1

echo "----- 01 two pods with a GPU each"
check "both pods Running" run 01-two-pods-a-gpu-each.yaml
a=$(devices_of own-gpu-0); b=$(devices_of own-gpu-1)
check "each got one whole GPU ($a, $b), not the same" \
  test -n "$a" -a -n "$b" -a "$a" != "$b" -a "$(echo "$a" | wc -l)" = 1 -a "$(echo "$b" | wc -l)" = 1
finish 01-two-pods-a-gpu-each.yaml

echo "----- 02 one GPU shared by two containers, and by two pods"
check "pods Running" run 02-shared-claim.yaml
c0=$(devices_of two-containers ctr0); c1=$(devices_of two-containers ctr1)
check "both containers of one pod see the one GPU ($c0)" test -n "$c0" -a "$c0" = "$c1" -a "$(echo "$c0" | wc -l)" = 1
s0=$(devices_of sharer-0); s1=$(devices_of sharer-1)
check "both pods of one claim see the one GPU ($s0)" test -n "$s0" -a "$s0" = "$s1" -a "$(echo "$s0" | wc -l)" = 1
finish 02-shared-claim.yaml

echo "----- 03 four MIG devices of three profiles on one parent"
check "pod Running" run 03-mig-three-profiles.yaml
migs=$(devices_of migs)
echo "$migs" | sed 's/^/  /'
parents=$(echo "$migs" | sed 's/-mig-.*//' | sort -u)
profiles=$(echo "$migs" | sed 's/.*-mig-\([0-9]*g[0-9]*gb\).*/\1/' | sort | tr '\n' ' ')
check "four MIG devices" test "$(echo "$migs" | grep -c -- -mig-)" = 4
check "on one parent ($parents)" test "$(echo "$parents" | wc -l)" = 1
check "of the profiles asked for ($profiles)" test "$profiles" = "1g10gb 1g10gb 2g20gb 3g40gb "
finish 03-mig-three-profiles.yaml

echo "----- 04 a selector on index, NVIDIA's GpuConfig TimeSlicing Long"
check "pod Running" run 04-index-and-time-slicing.yaml
gpu=$(devices_of even-sliced); index=$(attribute "$gpu" index)
check "the GPU ($gpu) has an even index ($index)" test -n "$index" -a $((index % 2)) = 0 2>/dev/null
check "its sharing is TimeSlicing/Long ($(sharing_of even-sliced))" test "$(sharing_of even-sliced)" = TimeSlicing/Long
finish 04-index-and-time-slicing.yaml

echo "----- 05 NVIDIA's GpuConfig MPS on one claim used by two pods"
check "pods Running" run 05-mps-shared-claim.yaml
m0=$(devices_of mps-0); m1=$(devices_of mps-1)
check "both pods see the one GPU ($m0)" test -n "$m0" -a "$m0" = "$m1" -a "$(echo "$m0" | wc -l)" = 1
for p in mps-0 mps-1; do
  check "$p has GPU_DRA_SHARING=MPS ($(sharing_of $p))" test "$(sharing_of $p)" = MPS
  check "$p sees the daemon's control socket in \$CUDA_MPS_PIPE_DIRECTORY" \
    test "$(in_pod $p 'ls $CUDA_MPS_PIPE_DIRECTORY' | grep -cx control)" = 1
done
uid=$(claim_jp mps-gpu '{.metadata.uid}')
uuid=$(attribute "$m0" uuid)
segments=$(for p in mps-0 mps-1; do in_pod $p 'cat /dev/shm/cuda.shm.mps-stand-in'; done | sort -u)
check "both pods' /dev/shm hold the daemon server's segment, naming the GPU's UUID ($segments)" \
  test -n "$uuid" -a "$segments" = "$uuid"
kubectl get pods -n gpu-dra -o wide | grep -e NAME -e gpu-dra-mps-
check "one daemon Pod, gpu-dra-mps-<claim uid>, Ready" \
  bash -c "[ $(daemon_pods) = 1 ] && kubectl wait -n gpu-dra --for=condition=Ready pod/gpu-dra-mps-$uid --timeout=30s >/dev/null"
args=$(kubectl get pod -n gpu-dra "gpu-dra-mps-$uid" -o jsonpath='{.spec.containers[0].args}' 2>/dev/null)
echo "  daemon args: $args"
check "the daemon is told 50% of the threads and 10Gi (10240M) pinned" \
  bash -c "grep -q 'set_default_active_thread_percentage 50' <<<'$args' && grep -q 'set_default_device_pinned_mem_limit 0 10240M' <<<'$args'"
log=$(cat "$MPS/$uid/log/control.log" 2>/dev/null)
echo "$log" | grep set_default | sed 's/^/  control.log: /'
check "the daemon applied both limits (its control.log)" \
  bash -c "grep -q 'set_default_active_thread_percentage 50' <<<'$log' && grep -q 'set_default_device_pinned_mem_limit 0 10240M' <<<'$log'"
finish 05-mps-shared-claim.yaml
no_daemon() { [ "$(daemon_pods)" = 0 ] && [ ! -e "$MPS/$uid" ]; }
check "the daemon Pod and the claim's MPS directory are gone after the pods" wait_until 60 no_daemon

echo "----- 06 two claims of 4Gi of gpu.nvidia.com, packed onto one GPU (GpuNodePolicy mpsMemoryShares)"
kubectl apply -f e2e/nvidia-compat/06-memory-shares-node-policy.yaml >/dev/null
check "the slices publish GPUs with allowMultipleAllocations (DRAConsumableCapacity)" wait_until 90 shared_gpus
check "both replicas Running" run 06-memory-shares.yaml 2
pods=$(kubectl get pods -n $NS -l test=memory-shares -o jsonpath='{.items[*].metadata.name}')
claims=$(kubectl get pods -n $NS -l test=memory-shares -o jsonpath='{range .items[*]}{.status.resourceClaimStatuses[0].resourceClaimName}{"\n"}{end}')
results=$(for c in $claims; do claim_jp "$c" '{range .status.allocation.devices.results[*]}{.device} {.consumedCapacity.memory} {.shareID}{"\n"}{end}'; done)
echo "$results" | sed 's/^/  allocated (device, consumedCapacity, shareID): /'
check "two claims, one device each" test "$(echo "$claims" | grep -c .)" = 2 -a "$(echo "$results" | grep -c .)" = 2
check "the scheduler packed both onto one GPU" test "$(echo "$results" | cut -d' ' -f1 | sort -u | grep -c '^gpu-[0-9]*$')" = 1
check "each claim consumes 4Gi of it, under a shareID of its own" \
  test "$(echo "$results" | awk '$2 == "4Gi" && $3 != ""' | wc -l)" = 2 -a "$(echo "$results" | cut -d' ' -f3 | sort -u | grep -c .)" = 2
d=""; for p in $pods; do d="$d$(devices_of $p)|"; done
check "both pods see that GPU ($d)" test "$d" = "$(echo "$results" | head -1 | cut -d' ' -f1)|$(echo "$results" | head -1 | cut -d' ' -f1)|"
for p in $pods; do check "$p has GPU_DRA_SHARING=MPS" test "$(sharing_of $p)" = MPS; done
check "one daemon Pod per claim" test "$(daemon_pods)" = 2
limited=0
for c in $claims; do
  u=$(claim_jp "$c" '{.metadata.uid}')
  grep -q 'set_default_device_pinned_mem_limit 0 4096M' "$MPS/$u/log/control.log" 2>/dev/null && limited=$((limited + 1))
done
check "each daemon's pinned-memory limit is its claim's 4Gi share (4096M)" test "$limited" = 2
finish 06-memory-shares.yaml
kubectl delete -f e2e/nvidia-compat/06-memory-shares-node-policy.yaml --wait=true >/dev/null
whole_again() { ! shared_gpus && published; }
check "after the policy is deleted, the GPUs are published whole again" wait_until 90 whole_again
no_daemons() { [ "$(daemon_pods)" = 0 ]; }
check "and their daemons are gone" wait_until 60 no_daemons

echo "----- 07 nvidia.com/gpu: 1 and no resourceClaims"
check "DeviceClass gpu.nvidia.com keeps extendedResourceName nvidia.com/gpu (DRAExtendedResource)" \
  test "$(kubectl get deviceclass gpu.nvidia.com -o jsonpath='{.spec.extendedResourceName}')" = nvidia.com/gpu
check "pod Running" run 07-nvidia-com-gpu.yaml
claim=$(kubectl get pod -n $NS plugin-style -o jsonpath='{.status.extendedResourceClaimStatus.resourceClaimName}')
echo "  the scheduler's claim: $claim"
check "the scheduler made it a claim, annotated extended-resource-claim=true" test -n "$claim" -a \
  "$(claim_jp "$claim" '{.metadata.annotations.resource\.kubernetes\.io/extended-resource-claim}')" = true
check "owned by the pod" test "$(claim_jp "$claim" '{.metadata.ownerReferences[0].kind}/{.metadata.ownerReferences[0].name}')" = Pod/plugin-style
results=$(claim_jp "$claim" '{range .status.allocation.devices.results[*]}{.driver} {.pool} {.device}{"\n"}{end}')
echo "$results" | sed 's/^/  allocated: /'
check "allocated one whole GPU of $DRIVER on $NODE" \
  test "$(echo "$results" | grep -c .)" = 1 -a "$(echo "$results" | grep -cE "^$DRIVER $NODE gpu-[0-9]+\$")" = 1
gpu=$(echo "$results" | cut -d' ' -f3)
check "of type gpu (NVIDIA's attribute)" test "$(attribute "$gpu" type)" = gpu
check "the container sees that GPU, and only it ($(devices_of plugin-style))" test -n "$gpu" -a "$(devices_of plugin-style)" = "$gpu"
check "Exclusive ($(sharing_of plugin-style))" test "$(sharing_of plugin-style)" = Exclusive
uid=$(claim_jp "$claim" '{.metadata.uid}')
check "a CDI spec of $DRIVER was written for the claim" test -e "$CDI/k8s.$DRIVER-gpu_$uid.json"
finish 07-nvidia-com-gpu.yaml
claim_gone() { ! kubectl get resourceclaim -n $NS "$claim" >/dev/null 2>&1; }
check "deleting the pod deletes its claim" wait_until 60 claim_gone

echo "----- after"
unprepared() { [ "$(ls "$CDI" 2>/dev/null | grep -c "^k8s.$DRIVER-")" = 0 ]; }
wait_until 30 unprepared
check "every claim unprepared: no CDI spec of $DRIVER left ($(ls "$CDI" 2>/dev/null | grep -c "^k8s.$DRIVER-"))" unprepared
check "no MPS directory or daemon Pod left" test "$(ls -A "$MPS" 2>/dev/null | wc -l)" = 0 -a "$(daemon_pods)" = 0
kubectl delete namespace $NS --wait=true --timeout=60s >/dev/null 2>&1
if [ "$INSTALL" = daemonset ]; then
  kubectl delete -k e2e/real-node-nvidia-compat --wait=true --timeout=120s >/dev/null 2>&1
else
  pid=$(cat "$STATE/pids/gpu-dra.pid" 2>/dev/null) && kill "$pid" 2>/dev/null
  [ -n "${made_gpu_dra_namespace:-}" ] && kubectl delete namespace gpu-dra --wait=false >/dev/null 2>&1
fi
echo "failures: $failures"
exit "$failures"
