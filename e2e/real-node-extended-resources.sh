#!/usr/bin/env bash
# Pods written for NVIDIA's device plugin (`nvidia.com/gpu: N`) on a real scheduler, kubelet and containerd:
# the node from ../shared/realk8s/node (up-node.sh, then start-plugin.sh with this tree's target/release/gpu-dra,
# fake GPUs). The DRAExtendedResource gate must be on in the API server, scheduler and controller manager
# (FEATURE_GATES of up.sh) and in the kubelet (featureGates of its config). Checks:
# - deploy/components/extended-resource's class keeps extendedResourceName;
# - a pod with nvidia.com/gpu: 2 next to a cpu request: the scheduler's claim (name, annotation, owner, request
#   container-0-request-1) is allocated two of our devices, the kubelet prepares it and the container sees both;
# - a pod mixing nvidia.com/gpu: 1 (one container) with a claim from a template (another container): each
#   container gets its own GPU;
# - a pod asking for more GPUs than are free stays Pending, and `gpu-dra explain` says why in the scheduler's words;
# - a node that lists nvidia.com/gpu in its capacity (what a device plugin leaves behind, at 0) is served by the
#   device plugin path: the pod stays Pending (explain names the device plugin) until the entry is removed, then
#   runs on DRA;
# - deleting the pods deletes the scheduler's claims and unprepares them;
# - and it notes (NOTE, no check) what becomes of a pod with a claim and nvidia.com/gpu on a node that
#   advertises nvidia.com/gpu, and of a pod asking for a class's implicit name.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/real-node-extended-resources.sh     (as root, from the project root)
#
# Each check prints PASS or FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
NODE=${NODE_NAME:-node-1}
GPU_DRA=${GPU_DRA_BIN:-target/release/gpu-dra}   # for gpu-dra explain
CDI=${CDI_ROOT:-/var/run/cdi}
N=gpu-dra-extres
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
jp() { kubectl get -n "$N" "$1" -o jsonpath="$2" 2>/dev/null; }
wait_until() { local t=$1; shift; local end=$((SECONDS + t)); until "$@"; do [ $SECONDS -lt $end ] || return 1; sleep 1; done; }

pod() { # name, then container lines (YAML, already indented), then optional pod-level extra lines
  cat <<YAML
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $N}
spec:
  terminationGracePeriodSeconds: 1
  containers:
$2
${3:-}
YAML
}
ctr() { # name, resources (flow YAML)
  cat <<YAML
  - name: $1
    image: localhost/busybox:local
    imagePullPolicy: Never
    command: ["sh", "-c", "env | grep ^GPU_DRA_DEVICE_ | sort; sleep 3600"]
    resources: $2
YAML
}

kubectl apply -f deploy/base/deviceclasses.yaml >/dev/null
kubectl patch deviceclass gpu.dra.dev --type=merge \
  --patch-file deploy/components/extended-resource/deviceclass-patch.yaml >/dev/null
check "DeviceClass gpu.dra.dev keeps extendedResourceName (gate on in the API server)" \
  test "$(kubectl get deviceclass gpu.dra.dev -o jsonpath='{.spec.extendedResourceName}')" = nvidia.com/gpu
kubectl create namespace "$N" >/dev/null 2>&1 || true

# 1. nvidia.com/gpu: 2, beside a cpu request: the GPU is the container's second request by name.
pod two-gpus "$(ctr main '{requests: {cpu: 10m}, limits: {nvidia.com/gpu: "2"}}')" | kubectl apply -f - >/dev/null
kubectl wait -n "$N" --for=condition=Ready pod/two-gpus --timeout=120s >/dev/null ||
  kubectl describe -n "$N" pod/two-gpus | tail -15
claim=$(jp pod/two-gpus '{.status.extendedResourceClaimStatus.resourceClaimName}')
echo "two-gpus: claim $claim, mappings $(jp pod/two-gpus '{.status.extendedResourceClaimStatus.requestMappings}')"
check "the pod's claim is named <pod>-extended-resources-<random>" test "${claim#two-gpus-extended-resources-}" != "$claim"
check "the request mapping names container main, nvidia.com/gpu, container-0-request-1" \
  test "$(jp pod/two-gpus '{.status.extendedResourceClaimStatus.requestMappings[0].containerName} {.status.extendedResourceClaimStatus.requestMappings[0].resourceName} {.status.extendedResourceClaimStatus.requestMappings[0].requestName}')" = "main nvidia.com/gpu container-0-request-1"
check "the claim is annotated resource.kubernetes.io/extended-resource-claim=true" \
  test "$(jp "resourceclaim/$claim" '{.metadata.annotations.resource\.kubernetes\.io/extended-resource-claim}')" = true
check "the claim is controlled by the pod" \
  test "$(jp "resourceclaim/$claim" '{.metadata.ownerReferences[0].kind}/{.metadata.ownerReferences[0].name}/{.metadata.ownerReferences[0].controller}')" = Pod/two-gpus/true
results=$(jp "resourceclaim/$claim" '{range .status.allocation.devices.results[*]}{.request} {.driver} {.pool} {.device}{"\n"}{end}')
echo "$results" | sed 's/^/  allocated: /'
check "the claim is allocated two gpu.dra.dev devices of $NODE for container-0-request-1" \
  test "$(echo "$results" | grep -c "^container-0-request-1 gpu.dra.dev $NODE gpu-")" -eq 2
check "a CDI spec was written for the claim" test -e "$CDI/k8s.gpu.dra.dev-gpu_$(jp "resourceclaim/$claim" '{.metadata.uid}').json"
env_two=$(kubectl logs -n "$N" two-gpus 2>&1)
echo "$env_two" | sed 's/^/  two-gpus: /'
check "the container sees both GPUs" test "$(echo "$env_two" | grep -c '^GPU_DRA_DEVICE_')" -eq 2

# 2. One container asks for nvidia.com/gpu: 1, another uses a claim from a template.
kubectl apply -f - >/dev/null <<YAML
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: $N}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly: {deviceClassName: gpu.dra.dev}
YAML
pod mixed "$(ctr plugin-style '{limits: {nvidia.com/gpu: "1"}}')
$(ctr dra-style '{claims: [{name: gpu}]}')" "  resourceClaims:
  - {name: gpu, resourceClaimTemplateName: one-gpu}" | kubectl apply -f - >/dev/null
kubectl wait -n "$N" --for=condition=Ready pod/mixed --timeout=120s >/dev/null ||
  kubectl describe -n "$N" pod/mixed | tail -15
a=$(kubectl logs -n "$N" mixed -c plugin-style | grep '^GPU_DRA_DEVICE_')
b=$(kubectl logs -n "$N" mixed -c dra-style | grep '^GPU_DRA_DEVICE_')
echo "  mixed/plugin-style: $a"; echo "  mixed/dra-style: $b"
check "mixed: each container has one GPU, not the same" \
  test -n "$a" -a -n "$b" -a "$a" != "$b" -a "$(echo "$a" | wc -l)" -eq 1 -a "$(echo "$b" | wc -l)" -eq 1
check "mixed: the request mapping sends nvidia.com/gpu to container plugin-style" \
  test "$(jp pod/mixed '{.status.extendedResourceClaimStatus.requestMappings[0].containerName}')" = plugin-style

# 3. More GPUs than are free.
pod too-many "$(ctr main '{limits: {nvidia.com/gpu: "9"}}')" | kubectl apply -f - >/dev/null
scheduled_event() { kubectl get events -n "$N" --field-selector involvedObject.name=too-many,reason=FailedScheduling -o jsonpath='{.items[*].message}' 2>/dev/null | grep -q .; }
wait_until 30 scheduled_event
echo "  too-many: $(kubectl get events -n "$N" --field-selector involvedObject.name=too-many,reason=FailedScheduling -o jsonpath='{.items[*].message}')"
check "a pod asking for 9 GPUs (4 free) stays Pending" test "$(jp pod/too-many '{.status.phase}')/$(jp pod/too-many '{.spec.nodeName}')" = "Pending/"
explained=$("$GPU_DRA" explain pod "$N/too-many" --kubeconfig "$KUBECONFIG" 2>&1); code=$?
echo "$explained" | sed 's/^/  explain: /'
check "gpu-dra explain: fits nowhere (exit 1), 9 wanted, in the scheduler's words" \
  test "$code" = 1 -a -n "$(echo "$explained" | grep 'cannot allocate all claims')" -a -n "$(echo "$explained" | grep '9 wanted')"
kubectl delete -n "$N" pod/too-many pod/two-gpus pod/mixed --wait --timeout=60s >/dev/null

# 4. What a device plugin leaves behind: nvidia.com/gpu: 0 in the node's capacity (the kubelet copies it into
#    allocatable). The scheduler then serves nvidia.com/gpu on this node from the device plugin: Pending.
kubectl patch node "$NODE" --subresource=status --type=merge -p '{"status":{"capacity":{"nvidia.com/gpu":"0"}}}' >/dev/null
allocatable_lists() { [ -n "$(kubectl get node "$NODE" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" ]; }
check "the kubelet copies nvidia.com/gpu: 0 into allocatable" wait_until 60 allocatable_lists
pod after-plugin "$(ctr main '{limits: {nvidia.com/gpu: "1"}}')" | kubectl apply -f - >/dev/null
failed() { kubectl get events -n "$N" --field-selector involvedObject.name=after-plugin,reason=FailedScheduling -o jsonpath='{.items[*].message}' 2>/dev/null | grep -q .; }
wait_until 30 failed
echo "  after-plugin: $(kubectl get events -n "$N" --field-selector involvedObject.name=after-plugin,reason=FailedScheduling -o jsonpath='{.items[*].message}')"
check "with nvidia.com/gpu: 0 in allocatable the pod is not scheduled" test -z "$(jp pod/after-plugin '{.spec.nodeName}')"
explained=$("$GPU_DRA" explain pod "$N/after-plugin" --kubeconfig "$KUBECONFIG" 2>&1); code=$?
echo "$explained" | sed 's/^/  explain: /'
check "gpu-dra explain: the device plugin's Insufficient nvidia.com/gpu on $NODE (exit 1)" \
  test "$code" = 1 -a -n "$(echo "$explained" | grep "^$NODE .*device plugin: Insufficient nvidia.com/gpu")"
kubectl patch node "$NODE" --subresource=status --type=json -p '[{"op":"remove","path":"/status/capacity/nvidia.com~1gpu"}]' >/dev/null
allocatable_clear() { ! allocatable_lists; }
check "after the capacity entry is removed the kubelet drops it from allocatable" wait_until 60 allocatable_clear
check "then the pod runs with a GPU of gpu-dra" kubectl wait -n "$N" --for=condition=Ready pod/after-plugin --timeout=120s
claim=$(jp pod/after-plugin '{.status.extendedResourceClaimStatus.resourceClaimName}')
uid=$(jp "resourceclaim/$claim" '{.metadata.uid}')

# 5. Deleting the pod deletes its claim (garbage collection of the owner) and unprepares it.
kubectl delete -n "$N" pod/after-plugin --wait --timeout=60s >/dev/null
gone() { [ -n "$claim" ] && ! kubectl get -n "$N" "resourceclaim/$claim" >/dev/null 2>&1; }
check "the scheduler's claim is deleted with its pod" wait_until 60 gone
unprepared() { [ -n "$uid" ] && [ ! -e "$CDI/k8s.gpu.dra.dev-gpu_$uid.json" ]; }
check "its CDI spec is removed (unprepared)" wait_until 30 unprepared

# 6. Notes, not checks, for deploy/README.md: a pod with a claim of its own on a node that advertises
#    nvidia.com/gpu, and the implicit name of a class without extendedResourceName.
kubectl patch node "$NODE" --subresource=status --type=merge -p '{"status":{"capacity":{"nvidia.com/gpu":"4"}}}' >/dev/null
wait_until 60 allocatable_lists
kubectl apply -f - >/dev/null <<YAML
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: own, namespace: $N}
spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.dra.dev}}]}}
YAML
pod both "$(ctr main '{limits: {nvidia.com/gpu: "1"}, claims: [{name: gpu}]}')" "  resourceClaims:
  - {name: gpu, resourceClaimName: own}" | kubectl apply -f - >/dev/null
sleep 10
claim=$(jp pod/both '{.status.extendedResourceClaimStatus.resourceClaimName}')
echo "NOTE both (a claim and nvidia.com/gpu: 1, node advertising nvidia.com/gpu: 4): node '$(jp pod/both '{.spec.nodeName}')'," \
  "extended-resource claim '$claim' with devices: $( [ -n "$claim" ] && jp "resourceclaim/$claim" '{.status.allocation.devices.results[*].device}')"
kubectl delete -n "$N" pod/both --wait --timeout=60s >/dev/null
kubectl patch node "$NODE" --subresource=status --type=json -p '[{"op":"remove","path":"/status/capacity/nvidia.com~1gpu"}]' >/dev/null
wait_until 60 allocatable_clear

pod implicit-name "$(ctr main '{limits: {deviceclass.resource.kubernetes.io/mig.gpu.dra.dev: "1"}}')" |
  kubectl apply -f - >/dev/null
sleep 10
echo "NOTE implicit-name (deviceclass.resource.kubernetes.io/mig.gpu.dra.dev: 1): node '$(jp pod/implicit-name '{.spec.nodeName}')'," \
  "phase $(jp pod/implicit-name '{.status.phase}'), claim '$(jp pod/implicit-name '{.status.extendedResourceClaimStatus.resourceClaimName}')'," \
  "GPU variables: $(kubectl logs -n "$N" implicit-name 2>/dev/null | grep -c '^GPU_DRA_DEVICE_')"

kubectl delete namespace "$N" --wait=false >/dev/null
echo "failures: $failures"
exit "$failures"
