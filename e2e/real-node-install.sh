#!/usr/bin/env bash
# Installs gpu-dra on the real node of ../shared/realk8s/node the way docs/install.md tells
# a user, and proves it works through the plugin's Pod: the image built without Docker (e2e/image.sh) and
# imported into containerd, `kubectl apply -f crd/`, `kubectl apply -k` of the fake overlay (through
# e2e/real-node, which only puts the Pod on the host network: that node has no kube-proxy), then the
# node's own proof (realk8s/node/proof.sh: a pod gets a GPU, unprepare on delete) with nothing granted by
# hand: the plugin runs with its pod-bound token, under the RBAC and the admission policies of deploy/.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/real-node-install.sh     (as root, from the project root,
#   after realk8s/up.sh and realk8s/node/up-node.sh; GPU_DRA_BINARY defaults to target/release/gpu-dra)
#
# Leaves the plugin installed for e2e/day-two.sh. Each check prints PASS or FAIL; the exit status is the
# number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
cd "$(dirname "$0")/.."
REALK8S=${REALK8S:-../shared/realk8s}
BIN_DIR=${KUBE_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/bin}
NODE=${NODE_NAME:-node-1}
STATE=${NODE_STATE_DIR:-/tmp/gpu-dra-node}
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
h() { echo "----- $*"; }
SEL=app.kubernetes.io/component=kubelet-plugin
slice_count() { kubectl get resourceslices --field-selector "spec.driver=gpu.dra.dev,spec.nodeName=$NODE" -o name 2>/dev/null | wc -l; }
pod_ready() { kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].status.conditions[?(@.type=="Ready")].status}' 2>/dev/null; }

h "a fresh node"
if kubectl get daemonset -n gpu-dra gpu-dra-plugin >/dev/null 2>&1; then
  echo "gpu-dra is installed already: kubectl delete -k e2e/real-node first" >&2; exit 1
fi
# What an earlier run left on this host (a fresh node has none of it): the fake GPUs' state, the
# plugin's checkpoint, CDI specs.
rm -rf /var/lib/gpu-dra /var/lib/kubelet/plugins/gpu.dra.dev
rm -f /var/run/cdi/k8s.gpu.dra.dev-*.json
mkdir -p /var/lib/gpu-dra && cat /proc/sys/kernel/random/boot_id > /var/lib/gpu-dra/boot_id

h "1. the image, built without Docker or a registry"
# The fake overlay's MPS claims (here and in e2e/day-two.sh) run the fake backend's MPS stand-in, which
# only a build with the test doubles has: cargo build --release --features doubles.
grep -q "(stand-in)" <<<"$("${GPU_DRA_BINARY:-target/release/gpu-dra}" fake mps-control-daemon --help 2>&1)" ||
  { echo "${0##*/}: ${GPU_DRA_BINARY:-target/release/gpu-dra} has no MPS stand-in; build it with --features doubles" >&2; exit 1; }
e2e/image.sh "${GPU_DRA_BINARY:-target/release/gpu-dra}" gpu-dra:dev target/gpu-dra-image.tar || exit 1
"$BIN_DIR/ctr" -n k8s.io images import target/gpu-dra-image.tar >/dev/null
# The upgrade of e2e/day-two.sh: a second tag of the same build.
"$BIN_DIR/ctr" -n k8s.io images tag --force docker.io/library/gpu-dra:dev docker.io/library/gpu-dra:dev2 >/dev/null
# The workloads' busybox, imported by up-node.sh; the kubelet's image GC removes it under disk pressure.
"$BIN_DIR/ctr" -n k8s.io images ls -q 2>/dev/null | grep -qx localhost/busybox:local ||
  "$BIN_DIR/ctr" -n k8s.io images import --local "${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/images/busybox.tar" >/dev/null
check "image imported into containerd as gpu-dra:dev (and :dev2)" \
  bash -c "'$BIN_DIR/ctr' -n k8s.io images ls -q | grep -qx 'docker.io/library/gpu-dra:dev2'"

h "2. install: kubectl apply -f crd/; kubectl label node; kubectl apply -k"
kubectl apply -f crd/
kubectl label node "$NODE" gpu-dra.dev/fake=true --overwrite
kubectl apply -k e2e/real-node
# Readiness is false until the slices are published: sample both until the Pod is Ready.
samples=$(mktemp)
deadline=$((SECONDS + 120))
while [ $SECONDS -lt $deadline ]; do
  r=$(pod_ready); s=$(slice_count)
  echo "${r:-none} $s" >> "$samples"
  [ "$r" = True ] && break
  sleep 0.3
done
echo "readiness samples (count, Ready, slices): $(sort "$samples" | uniq -c | tr -s ' \n' ' ')"
check "plugin Pod Ready" test "$(pod_ready)" = True
check "it was not Ready before its slices were published (no sample Ready with 0 slices)" \
  bash -c "! grep -qx 'True 0' '$samples' && grep -qvE '^True' '$samples'"
rm -f "$samples"
kubectl get pods -n gpu-dra -o wide

h "nothing granted by hand: the pod-bound token, the RBAC and admission policies of deploy/"
pod=$(kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].metadata.name}')
uid=$(kubectl get pod -n gpu-dra "$pod" -o jsonpath='{.metadata.uid}')
token=$(cat /var/lib/kubelet/pods/"$uid"/volumes/kubernetes.io~projected/*/token 2>/dev/null | head -1)
check "the plugin's projected token is on the node" test -n "$token"
whoami=$(kubectl auth whoami --token="$token" -o json 2>&1)
echo "$whoami" | jq -c '.status.userInfo | {username, extra}' 2>/dev/null || echo "$whoami"
check "the API server sees the token as the plugin's service account" \
  test "$(jq -r .status.userInfo.username <<<"$whoami" 2>/dev/null)" = system:serviceaccount:gpu-dra:gpu-dra-plugin
check "and bound to this node (authentication.kubernetes.io/node-name=$NODE, what the admission policies read)" \
  test "$(jq -r '.status.userInfo.extra["authentication.kubernetes.io/node-name"][0]' <<<"$whoami" 2>/dev/null)" = "$NODE"
bindings() {
  kubectl get clusterrolebindings,rolebindings -A -o json |
    jq -r '.items[] | select(any(.subjects[]?; .kind=="ServiceAccount" and .name=="gpu-dra-plugin" and .namespace=="gpu-dra"))
           | "\(.kind)/\(.metadata.name) \(.metadata.labels["app.kubernetes.io/name"] // "-")"'
}
found=$(bindings)
echo "bindings of the plugin's service account: $(tr '\n' ' ' <<<"$found")"
from_deploy() { [ -n "$found" ] && ! grep -qv ' gpu-dra$' <<<"$found"; }
check "every binding of the plugin's account comes from deploy/ (labelled app.kubernetes.io/name=gpu-dra)" from_deploy
vaps=$(kubectl get validatingadmissionpolicybindings -o jsonpath='{.items[*].metadata.name}')
echo "admission policy bindings: $vaps"
check "the admission policies of deploy/ are bound" bash -c "grep -q gpu-dra <<<'$vaps'"
check "the plugin published its slices through them" test "$(slice_count)" -gt 0

h "3. the node's proof, through the plugin Pod"
DEVICECLASSES=deploy/base/deviceclasses.yaml "$REALK8S/node/proof.sh" "$KUBECONFIG" "$STATE"
proof=$?
check "realk8s/node/proof.sh passed through the plugin Pod" test $proof = 0

echo "failures: $failures"
exit $failures
