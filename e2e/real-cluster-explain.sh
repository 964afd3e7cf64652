#!/usr/bin/env bash
# Checks `gpu-dra explain` against a real kube-apiserver and kube-scheduler: what explain says about a
# pod must be what the scheduler does with it. No kubelet is needed (pods stay Pending once bound): a
# control plane from ../shared/realk8s/up.sh is enough.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/real-cluster-explain.sh [BINARY]   (default target/release/gpu-dra)
#
# Four nodes, two of them with a fake plugin publishing slices:
#   node-a  dgx-h100 (8 GPUs, one NVLink domain); a pod holding 6 GPUs lands here
#   node-b  a100-pcie-4 (4 GPUs, NVLink-bridged in pairs)
#   node-c  l40s-4 (no plugin: no slices), cordoned
#   node-d  dgx-h100 (no plugin), tainted dedicated=ml:NoSchedule
# Cases (each prints ok or FAIL; the exit status is the number of failures):
#   - a pod wanting 4 GPUs on one NVLink domain fits nowhere: explain exits 1, and its scheduler line is
#     the scheduler's own FailedScheduling message;
#   - a claim wanting 2 GPUs on one NVLink domain: explain says which nodes and which devices; the
#     scheduler then puts a pod with that claim on one of those nodes, with the devices explain named there;
#   - the same answer from a dump (kubectl get ... -o yaml) as from the live cluster;
#   - a user holding only the ClusterRole gpu-dra-explain (deploy/base/explain-role.yaml) can run it.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${1:-$ROOT/target/release/gpu-dra}"
REALK8S="${REALK8S:-$ROOT/../shared/realk8s}"
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT
failures=0
check() { # description, command...: ok when the command succeeds
  local what=$1; shift
  if "$@"; then echo "ok    $what"; else echo "FAIL  $what"; failures=$((failures + 1)); fi
}

kubectl apply --validate=false -f "$ROOT/crd/" >/dev/null || exit 1
kubectl apply -f "$ROOT/deploy/base/deviceclasses.yaml" -f "$ROOT/deploy/base/explain-role.yaml" >/dev/null || exit 1
for node in node-a node-b node-c node-d; do
  kubectl get node "$node" >/dev/null 2>&1 || "$REALK8S/node.sh" "$node" >/dev/null || exit 1
done
kubectl cordon node-c >/dev/null
kubectl taint node node-d dedicated=ml:NoSchedule --overwrite >/dev/null

"$BIN" fake show dgx-h100 > "$WORK/h100.yaml"
"$BIN" fake show a100-pcie-4 > "$WORK/a100.yaml"
for pair in node-a:h100 node-b:a100; do
  node=${pair%%:*}
  mkdir -p "$WORK/$node"
  "$BIN" plugin --backend fake --fake-profile "$WORK/${pair#*:}.yaml" --node-name "$node" \
    --kubelet-registry-dir "$WORK/$node/reg" --kubelet-plugins-dir "$WORK/$node/plugins" \
    --cdi-root "$WORK/$node/cdi" --http-addr "" > "$WORK/$node/plugin.log" 2>&1 &
done
for _ in $(seq 30); do
  [ "$(kubectl get resourceslices -o name | wc -l)" -ge 2 ] && break
  sleep 1
done

template() { # name, count, linked (true/false)
  local constraint=""
  [ "$3" = true ] && constraint=', "constraints": [{"matchAttribute": "gpu.dra.dev/nvlinkDomain"}]'
  cat <<EOF
{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "$1", "namespace": "default"},
 "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev", "count": $2}}]$constraint}}}}
EOF
}
pod() { # name, template
  cat <<EOF
{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "$1", "namespace": "default"},
 "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
   "resources": {"claims": [{"name": "gpu"}]}}],
  "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "$2"}]}}
EOF
}
node_of() { kubectl get pod "$1" -o jsonpath='{.spec.nodeName}'; }
wait_bound() {
  for _ in $(seq 30); do [ -n "$(node_of "$1")" ] && return 0; sleep 1; done
  return 1
}

# 6 of node-a's 8 GPUs: the only node with 6 free that the pod may use.
template six 6 false | kubectl create -f - >/dev/null
pod holder six | kubectl create -f - >/dev/null
check "the holder pod is bound to node-a" wait_bound holder
[ "$(node_of holder)" = node-a ] || echo "      holder went to '$(node_of holder)'"

# Fits nowhere: node-a has 2 GPUs left, node-b's 4 are in two NVLink pairs, node-c is cordoned, node-d tainted.
template four-linked 4 true | kubectl create -f - >/dev/null
pod four-linked four-linked | kubectl create -f - >/dev/null
for _ in $(seq 30); do
  message=$(kubectl get events --field-selector involvedObject.name=four-linked,reason=FailedScheduling \
    -o jsonpath='{.items[-1:].message}' 2>/dev/null)
  [ -n "$message" ] && break
  sleep 1
done
echo "      scheduler: $message"
"$BIN" explain pod default/four-linked > "$WORK/four.txt"
code=$?
sed 's/^/      /' "$WORK/four.txt"
check "explain exits 1 for a pod that fits nowhere" test "$code" = 1
said=$(sed -n 's/^scheduler: //p' "$WORK/four.txt")
# The scheduler adds its preemption verdict after the filters' summary ("still not schedulable,
# preemption: ..." in v1.34, "preemption: ..." before).
summary=${message%% preemption:*}
summary=${summary%% still not schedulable,}
check "explain's scheduler line is the scheduler's message" test -n "$said" -a "$summary" = "$said"

# Fits on node-a (its 2 free GPUs) and node-b (either NVLink pair).
template two-linked 2 true > "$WORK/two.json"
"$BIN" explain --claim "$WORK/two.json" -o json > "$WORK/two-explain.json"
check "explain exits 0 for a claim that fits" test $? = 0
python3 - "$WORK/two-explain.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for node in report["nodes"]:
    print("      %-7s %-4s %s" % (node["node"], "yes" if node["fits"] else "no",
        ", ".join(d["device"] for d in node.get("devices", [])) or "; ".join(r["message"] for r in node.get("reasons", []))))
PY
kubectl create -f "$WORK/two.json" >/dev/null
pod two-linked two-linked | kubectl create -f - >/dev/null
check "the two-linked pod is bound" wait_bound two-linked
bound=$(node_of two-linked)
claim=$(kubectl get pod two-linked -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}')
allocated=$(kubectl get resourceclaim "$claim" -o jsonpath='{.status.allocation.devices.results[*].device}')
echo "      the scheduler put it on $bound with $allocated"
predicted=$(python3 - "$WORK/two-explain.json" "$bound" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
node = [n for n in report["nodes"] if n["node"] == sys.argv[2]]
print(" ".join(d["device"] for d in node[0]["devices"]) if node and node[0]["fits"] else "(explain said no)")
PY
)
check "explain said the pod fits on the scheduler's node, with the same devices ($predicted)" \
  test "$predicted" = "$allocated"

# A dump gives the live answer.
kubectl get pods,resourceclaims,resourceclaimtemplates,deviceclasses,resourceslices,nodes -A -o yaml > "$WORK/dump.yaml"
"$BIN" explain pod default/four-linked --from "$WORK/dump.yaml" > "$WORK/four-dump.txt"
"$BIN" explain pod default/four-linked > "$WORK/four-live.txt"
check "explain --from a dump answers as the live cluster does" diff "$WORK/four-live.txt" "$WORK/four-dump.txt"

# Someone with only the gpu-dra-explain ClusterRole. (kubectl's -n goes first in commands that take no
# --validate, for wrappers that add that flag to create and apply.)
kubectl -n default create serviceaccount explainer >/dev/null 2>&1
kubectl -n default create clusterrolebinding explainer-explain --clusterrole=gpu-dra-explain \
  --serviceaccount=default:explainer >/dev/null 2>&1
token=$(kubectl -n default create token explainer)
server=$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.server}')
ca=$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
cat > "$WORK/explainer.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "$server", certificate-authority-data: "$ca"}}]
users: [{name: explainer, user: {token: "$token"}}]
contexts: [{name: c, context: {cluster: c, user: explainer}}]
current-context: c
EOF
"$BIN" explain pod default/four-linked --kubeconfig "$WORK/explainer.kubeconfig" > "$WORK/four-rbac.txt" 2>&1
check "a user with only gpu-dra-explain gets the same answer" diff "$WORK/four-live.txt" "$WORK/four-rbac.txt"
check "that user may not create claims" \
  test "$(KUBECONFIG="$WORK/explainer.kubeconfig" kubectl auth can-i create resourceclaims -n default)" = no

kubectl delete pod holder four-linked two-linked --force --grace-period=0 >/dev/null 2>&1
kubectl delete resourceclaimtemplate six four-linked two-linked >/dev/null 2>&1
kubectl delete clusterrolebinding explainer-explain >/dev/null 2>&1
echo "$failures failure(s)"
exit "$failures"
