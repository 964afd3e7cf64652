#!/usr/bin/env bash
# End-to-end run of gpu-dra on a kind cluster with fake GPUs: build and load the image, deploy the fake
# overlay with nvidia.com/gpu served by DRA (e2e/deploy), run the workloads in e2e/workloads/ (whole GPUs,
# NVLink, MIG, a pod asking for nvidia.com/gpu: 1, a time-sliced GPU, an MPS GPU
# shared by two pods, one claim shared by two pods), then inject an XID fault through the fake profile and
# watch the device taint come and go. e2e/down.sh deletes the cluster.
#
# Environment: CLUSTER_NAME (gpu-dra-e2e), KIND_NODE_IMAGE (the images in e2e/kind.yaml),
# IMAGE (gpu-dra:dev; the DaemonSet names gpu-dra:dev), FAULT_TAINT_KEY (gpu.dra.dev/xid),
# KEEP_CLUSTER=1 to reuse a running cluster of that name.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER_NAME="${CLUSTER_NAME:-gpu-dra-e2e}"
IMAGE="${IMAGE:-gpu-dra:dev}"
FAULT_TAINT_KEY="${FAULT_TAINT_KEY:-gpu.dra.dev/xid}"
DRIVER=gpu.dra.dev
NS=gpu-dra
WORKLOAD_NS=gpu-dra-e2e

log() { printf '\n==> %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

# On failure, show what a person would look at first.
dump() {
  local rc=$?
  [ "$rc" -eq 0 ] && return
  printf '\n==> failure (exit %s): cluster state\n' "$rc" >&2
  kubectl get nodes -o wide >&2 || true
  kubectl -n "$NS" get pods -o wide >&2 || true
  kubectl -n "$NS" logs -l app.kubernetes.io/name=gpu-dra --tail=50 --prefix >&2 || true
  kubectl get resourceslices -o wide >&2 || true
  kubectl -n "$WORKLOAD_NS" get pods,resourceclaims -o wide >&2 || true
  kubectl -n "$WORKLOAD_NS" describe pods >&2 || true
}
trap dump EXIT

# Polls "$@" every 5 s until it succeeds or $1 seconds have passed.
wait_for() {
  local timeout=$1 what=$2
  shift 2
  local deadline=$((SECONDS + timeout))
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || fail "timed out after ${timeout}s waiting for ${what}"
    sleep 5
  done
}

for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || fail "$tool is not on PATH"
done

cd "$ROOT"
[ -f crd/gpu.dra.dev_gpunodepolicies.yaml ] || fail "crd/gpu.dra.dev_gpunodepolicies.yaml is missing"

log "building $IMAGE"
# A tar stream without target/ and .git keeps the build context small.
tar --exclude=./target --exclude=./.git -cf - . | docker build --build-arg FEATURES=doubles -t "$IMAGE" -f Dockerfile -

if [ "${KEEP_CLUSTER:-0}" = 1 ] && kind get clusters | grep -qx "$CLUSTER_NAME"; then
  log "reusing cluster $CLUSTER_NAME"
else
  log "creating cluster $CLUSTER_NAME"
  image_args=()
  [ -n "${KIND_NODE_IMAGE:-}" ] && image_args=(--image "$KIND_NODE_IMAGE")
  kind create cluster --name "$CLUSTER_NAME" --config e2e/kind.yaml ${image_args[@]+"${image_args[@]}"} --wait 120s
fi
kubectl config use-context "kind-$CLUSTER_NAME" >/dev/null

log "loading $IMAGE into the nodes"
kind load docker-image "$IMAGE" --name "$CLUSTER_NAME"

log "deploying gpu-dra (fake overlay, nvidia.com/gpu served by DRA: e2e/deploy)"
kubectl apply -f crd/
kubectl wait --for=condition=Established crd --all --timeout=60s
kubectl apply -k e2e/deploy
kubectl -n "$NS" rollout status daemonset/gpu-dra-plugin --timeout=180s

workers=$(kubectl get nodes -l gpu-dra.dev/fake=true -o name | wc -l)
[ "$workers" -gt 0 ] || fail "no node is labelled gpu-dra.dev/fake=true"

log "waiting for ResourceSlices from $workers nodes"
slices_from_every_node() {
  local nodes
  nodes=$(kubectl get resourceslices --field-selector "spec.driver=$DRIVER" \
    -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' | sort -u | grep -c . || true)
  [ "$nodes" -ge "$workers" ]
}
wait_for 120 "ResourceSlices of driver $DRIVER on every worker" slices_from_every_node
kubectl get resourceslices --field-selector "spec.driver=$DRIVER"

log "running the workloads"
kubectl apply -f e2e/workloads/00-namespace.yaml
kubectl apply -f e2e/workloads/
pods=$(kubectl -n "$WORKLOAD_NS" get pods -l app.kubernetes.io/part-of=gpu-dra-e2e -o name)
[ -n "$pods" ] || fail "no workload pods in $WORKLOAD_NS"
kubectl -n "$WORKLOAD_NS" wait --for=condition=Ready $pods --timeout=180s

for pod in $pods; do
  # The container prints its env first thing; give the log a moment to arrive.
  has_device_env() {
    local out
    out=$(kubectl -n "$WORKLOAD_NS" logs "$pod" --all-containers)
    grep -q '^GPU_DRA_DEVICE_' <<<"$out"
  }
  wait_for 30 "GPU_DRA_DEVICE_ variables in the log of $pod" has_device_env
  out=$(kubectl -n "$WORKLOAD_NS" logs "$pod" --all-containers)
  printf '%s: %s\n' "$pod" "$(grep -E '^(GPU_DRA_DEVICE_|/dev/nvidia)' <<<"$out" | tr '\n' ' ')"
  # The fake backend backs the device nodes with a stand-in file; containerd must have applied the CDI spec.
  grep -q '^/dev/nvidia' <<<"$out" || fail "$pod has no /dev/nvidia* device node"
done

n=$(kubectl -n "$WORKLOAD_NS" logs pod/two-gpus-nvlink | grep -c '^GPU_DRA_DEVICE_' || true)
[ "$n" -eq 2 ] || fail "two-gpus-nvlink sees $n GPU_DRA_DEVICE_ variables, expected 2"

log "checking the pod that asks for nvidia.com/gpu: 1"
claim=$(kubectl -n "$WORKLOAD_NS" get pod extended-resource-gpu \
  -o jsonpath='{.status.extendedResourceClaimStatus.resourceClaimName}')
[ -n "$claim" ] || fail "extended-resource-gpu has no status.extendedResourceClaimStatus (is DRAExtendedResource on?)"
results=$(kubectl -n "$WORKLOAD_NS" get resourceclaim "$claim" \
  -o jsonpath='{range .status.allocation.devices.results[*]}{.request} {.driver}{"\n"}{end}')
[ "$results" = "container-0-request-0 $DRIVER" ] ||
  fail "claim $claim of extended-resource-gpu: expected one $DRIVER device for container-0-request-0, got: $results"
n=$(kubectl -n "$WORKLOAD_NS" logs pod/extended-resource-gpu | grep -c '^GPU_DRA_DEVICE_' || true)
[ "$n" -eq 1 ] || fail "extended-resource-gpu sees $n GPU_DRA_DEVICE_ variables, expected 1"
printf 'nvidia.com/gpu: 1 -> claim %s, one GPU: ok\n' "$claim"

log "checking the shared GPUs"
logs_of() { kubectl -n "$WORKLOAD_NS" logs "$@"; }
devices_of() { logs_of "$@" | grep '^GPU_DRA_DEVICE_' | sort; }
node_of() { kubectl -n "$WORKLOAD_NS" get pod "$1" -o jsonpath='{.spec.nodeName}'; }
# A time-sliced GPU: both containers of the pod get the one GPU, with the interval the claim asked for.
for ctr in first second; do
  logs_of time-sliced-gpu -c "$ctr" | grep -qx 'GPU_DRA_SHARING=TimeSlicing/Long' ||
    fail "container $ctr of time-sliced-gpu lacks GPU_DRA_SHARING=TimeSlicing/Long"
done
[ "$(devices_of time-sliced-gpu -c first)" = "$(devices_of time-sliced-gpu -c second)" ] ||
  fail "the containers of time-sliced-gpu got different GPUs"
# An MPS GPU shared by two pods through one claim: one daemon, whose pipe directory both pods see.
[ "$(node_of mps-a)" = "$(node_of mps-b)" ] || fail "mps-a and mps-b run on different nodes"
[ "$(devices_of mps-a)" = "$(devices_of mps-b)" ] || fail "mps-a and mps-b got different GPUs"
for pod in mps-a mps-b; do
  out=$(logs_of "$pod")
  grep -qx 'GPU_DRA_SHARING=MPS' <<<"$out" || fail "$pod lacks GPU_DRA_SHARING=MPS"
  grep -qx 'CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps' <<<"$out" || fail "$pod lacks CUDA_MPS_PIPE_DIRECTORY"
  grep -qx 'nvidia-cuda-mps-control.pid' <<<"$out" || fail "$pod does not see the MPS daemon's pipe directory"
done
# One exclusive claim used by two pods: prepared once, the same GPU in both.
[ "$(devices_of shared-claim-a)" = "$(devices_of shared-claim-b)" ] ||
  fail "shared-claim-a and shared-claim-b got different GPUs"
printf 'time-sliced, MPS and shared-claim workloads: ok\n'

log "checking that the MIG claim reports its MIG device UUID"
mig_uuid_reported() {
  local out
  out=$(kubectl -n "$WORKLOAD_NS" get resourceclaims -o jsonpath='{.items[*].status.devices[*].data.uuid}')
  [ -n "$out" ]
}
wait_for 60 "a MIG UUID in a claim's status.devices" mig_uuid_reported

log "removing the workloads"
kubectl delete -f e2e/workloads/ --ignore-not-found --wait --timeout=120s

log "injecting XID 79 on the first GPU of the fake profile"
# Output captured first: `grep -q` closing the pipe early would fail the pipeline under pipefail.
taints_present() {
  local keys
  keys=$(kubectl get resourceslices --field-selector "spec.driver=$DRIVER" \
    -o jsonpath='{range .items[*].spec.devices[*]}{range .taints[*]}{.key}{"\n"}{end}{end}')
  grep -qx "$FAULT_TAINT_KEY" <<<"$keys"
}
taints_absent() { ! taints_present; }

set_profile() {
  # Re-applies the ConfigMap with the profile in file $1, keeping its label.
  kubectl -n "$NS" create configmap gpu-dra-fake-profile --from-file=profile.yaml="$1" \
    --dry-run=client -o yaml |
    kubectl label --local -f - -o yaml app.kubernetes.io/name=gpu-dra |
    kubectl apply -f -
}

work=$(mktemp -d)
kubectl -n "$NS" get configmap gpu-dra-fake-profile -o jsonpath='{.data.profile\.yaml}' >"$work/profile.yaml"
taints_absent || fail "a device is tainted $FAULT_TAINT_KEY before any fault was injected"
# Mapping keys of a list item are indented two spaces, so the fault goes right after the first
# GPU's first line.
awk '!done && /^- / { print; print "  faults: [{kind: xid, xid: 79}]"; done = 1; next } { print }' \
  "$work/profile.yaml" >"$work/faulty.yaml"
grep -q 'faults:' "$work/faulty.yaml" || fail "could not add a fault to the profile"
set_profile "$work/faulty.yaml"
# The kubelet refreshes mounted ConfigMaps on its sync period (up to about a minute), then the plugin
# re-reads the file within a few seconds.
wait_for 180 "a device tainted $FAULT_TAINT_KEY" taints_present
kubectl get resourceslices --field-selector "spec.driver=$DRIVER" \
  -o jsonpath='{range .items[*]}{range .spec.devices[?(@.taints)]}{.name}{": "}{.taints}{"\n"}{end}{end}'

log "clearing the fault"
set_profile "$work/profile.yaml"
wait_for 180 "the $FAULT_TAINT_KEY taint to go" taints_absent
rm -rf "$work"

log "e2e passed"
