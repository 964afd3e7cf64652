#!/usr/bin/env bash
# NVIDIA compatibility mode on the real node of ../shared/realk8s/node: the plugin runs as gpu.nvidia.com
# with NVIDIA's DeviceClasses (deploy/components/nvidia-compat), and our own examples of what NVIDIA's public
# quickstart asks of its driver (e2e/nvidia-compat/*.yaml, written for NVIDIA's classes, attributes and
# configs) run unchanged. Each check reads what the containers got (GPU_DRA_DEVICE_<device>, GPU_DRA_SHARING)
# and the slices:
#   01 two pods with a GPU each: two different GPUs
#   02 two containers of one pod, and two pods naming one ResourceClaim: one GPU each time
#   03 four MIG devices of three profiles (1g.10gb x2, 2g.20gb, 3g.40gb) with matchAttribute parentUUID: one parent
#   04 a selector on NVIDIA's `index` and NVIDIA's GpuConfig TimeSlicing Long: an even index, sharing applied
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig GPU_DRA_BIN=target/debug/gpu-dra e2e/real-node-nvidia-compat.sh
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
NS=nvidia-compat
DRIVER=gpu.nvidia.com
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }

# The devices a container got, one per line, from its GPU_DRA_DEVICE_* variables (gpu-3, gpu-5-mig-1g10gb-6).
devices_of() { # pod [container]
  kubectl exec -n $NS "$1" ${2:+-c "$2"} -- env 2>/dev/null | sed -n 's/^GPU_DRA_DEVICE_\([^=]*\)=.*/\1/p' |
    tr 'A-Z_' 'a-z-' | sort
}
sharing_of() { kubectl exec -n $NS "$1" -- env 2>/dev/null | sed -n 's/^GPU_DRA_SHARING=//p' | sort -u; }
attribute() { # device name -> its `index`
  kubectl get resourceslices --field-selector "spec.driver=$DRIVER" -o json | python3 -c "
import json, sys
for s in json.load(sys.stdin)['items']:
    for d in s['spec'].get('devices', []):
        if d['name'] == sys.argv[1]:
            print(d['attributes'][sys.argv[2]]['int'])" "$1" "$2"
}
run() { # file: apply, wait for its pods
  kubectl apply -n $NS -f "e2e/nvidia-compat/$1" >/dev/null || return 1
  kubectl wait -n $NS --for=condition=Ready pod --all --timeout=120s >/dev/null
}
finish() { kubectl delete -n $NS -f "e2e/nvidia-compat/$1" --wait=true --timeout=120s >/dev/null 2>&1; }

kubectl apply -f deploy/components/nvidia-compat/deviceclasses.yaml >/dev/null
DRIVER_NAME=$DRIVER GPU_DRA_BIN=$BIN "$REALK8S/node/start-plugin.sh" "$KUBECONFIG" "$STATE" --mig-mode dynamic >/dev/null ||
  { bad "plugin started as $DRIVER"; exit "$failures"; }
ok "plugin started as $DRIVER (--mig-mode dynamic)"
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

echo "----- after"
left=$(ls /var/run/cdi 2>/dev/null | grep -c '^k8s.gpu.nvidia.com-')
check "every claim unprepared: no CDI spec of $DRIVER left ($left)" test "$left" = 0
kubectl delete namespace $NS --wait=true --timeout=60s >/dev/null 2>&1
pid=$(cat "$STATE/pids/gpu-dra.pid" 2>/dev/null) && kill "$pid" 2>/dev/null
echo "failures: $failures"
exit "$failures"
