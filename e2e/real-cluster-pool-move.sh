#!/usr/bin/env bash
# A pool that moves between nodes, on the real kube-scheduler (../shared/realk8s/up.sh; no kubelet): the
# pool's generation 1 is node-1's and complete, its generation 2 went to node-2. The scheduler gathers node-1's
# own slices first and, finding them complete, still allocates from generation 1 there; `gpu-dra selectors
# allocate` (the allocator behind `explain`) must say the same for node-1, and for node-2 give generation 2.
# (Kubernetes 1.34 does not sort slices by name, so which of generation 1's two devices it picks varies.)
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/real-cluster-pool-move.sh [BINARY]   (default target/release/gpu-dra)
#
# Each check prints ok or FAIL; the exit status is the number of failures.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${1:-$ROOT/target/release/gpu-dra}"
REALK8S="${REALK8S:-$ROOT/../shared/realk8s}"
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
failures=0
check() { local what=$1; shift; if "$@"; then echo "ok    $what"; else echo "FAIL  $what"; failures=$((failures + 1)); fi; }

for n in node-1 node-2; do kubectl get node $n >/dev/null 2>&1 || "$REALK8S/node.sh" $n >/dev/null; done
kubectl apply -f "$ROOT/deploy/base/deviceclasses.yaml" >/dev/null
slice() { # name node generation device...
  local name=$1 node=$2 gen=$3; shift 3
  local devices=""
  for d in "$@"; do devices="$devices{\"name\":\"$d\",\"attributes\":{\"type\":{\"string\":\"gpu\"},\"uuid\":{\"string\":\"$name-$d\"}}},"; done
  echo "{\"apiVersion\":\"resource.k8s.io/v1\",\"kind\":\"ResourceSlice\",\"metadata\":{\"name\":\"$name\"},
    \"spec\":{\"driver\":\"gpu.dra.dev\",\"nodeName\":\"$node\",\"pool\":{\"name\":\"moved\",\"generation\":$gen,
    \"resourceSliceCount\":2},\"devices\":[${devices%,}]}}"
}
echo "{\"apiVersion\":\"v1\",\"kind\":\"List\",\"items\":[$(slice moved-n1-a node-1 1 gpu-0),
  $(slice moved-n1-b node-1 1 gpu-1), $(slice moved-n2-a node-2 2 gpu-2), $(slice moved-n2-b node-2 2 gpu-3)]}" \
  > "$WORK/slices-in.json"
kubectl apply -f "$WORK/slices-in.json" >/dev/null
kubectl get resourceslices -o yaml > "$WORK/slices.yaml"
cat > "$WORK/claim.yaml" <<'YAML'
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: pool-move, namespace: default}
spec:
  devices:
    requests:
      - {name: gpu, exactly: {deviceClassName: gpu.dra.dev}}
YAML
check "4 slices of pool moved" test "$(kubectl get resourceslices -o name | wc -l)" = 4
kubectl apply -f "$WORK/claim.yaml" >/dev/null
kubectl apply -f - >/dev/null <<'YAML'
apiVersion: v1
kind: Pod
metadata: {name: pool-move, namespace: default}
spec:
  nodeSelector: {kubernetes.io/hostname: node-1}
  containers: [{name: c, image: busybox, resources: {claims: [{name: gpu}]}}]
  resourceClaims: [{name: gpu, resourceClaimName: pool-move}]
YAML
bound() { [ "$(kubectl get pod -n default pool-move -o jsonpath='{.spec.nodeName}')" = node-1 ]; }
check "the scheduler binds the pod to node-1" bash -c "for i in \$(seq 30); do [ \"\$(kubectl get pod -n default pool-move -o jsonpath='{.spec.nodeName}')\" = node-1 ] && exit 0; sleep 1; done; exit 1"
result=$(kubectl get resourceclaim -n default pool-move -o jsonpath='{.status.allocation.devices.results[0].pool}/{.status.allocation.devices.results[0].device}')
echo "      scheduler: $result"
gen1() { case "$1" in moved/gpu-0 | moved/gpu-1) return 0 ;; *) return 1 ;; esac; }
check "from node-1's own complete generation 1 (gpu-0 or gpu-1; generation 2 on node-2 has gpu-2 and gpu-3)" gen1 "$result"
ours=$("$BIN" selectors allocate --claim "$WORK/claim.yaml" --class "$ROOT/deploy/base/deviceclasses.yaml" \
  --slices "$WORK/slices.yaml" --node node-1 -o json 2>&1)
echo "      gpu-dra on node-1: $(tr -d '\n ' <<<"$ours" | head -c 300)"
device_of() { python3 -c 'import json, sys; d = json.loads(sys.argv[1])["results"][0]; print(d["pool"] + "/" + d["device"])' "$1" 2>/dev/null; }
check "gpu-dra selectors allocate also gives node-1 a device of generation 1" gen1 "$(device_of "$ours")"
theirs=$("$BIN" selectors allocate --claim "$WORK/claim.yaml" --class "$ROOT/deploy/base/deviceclasses.yaml" \
  --slices "$WORK/slices.yaml" --node node-2 -o json 2>&1)
check "and node-2 a device of generation 2" bash -c "[ '$(device_of "$theirs")' = moved/gpu-2 ]"

kubectl delete pod -n default pool-move --grace-period=0 --force >/dev/null 2>&1
kubectl delete resourceclaim -n default pool-move >/dev/null 2>&1
kubectl delete -f "$WORK/slices-in.json" >/dev/null 2>&1
echo "failures: $failures"
exit "$failures"
