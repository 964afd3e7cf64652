#!/usr/bin/env bash
# Tries the plugin's RBAC and admission policies against a real API server, with the plugin's own token
# bound to a pod on node-1, as a compromised plugin would use it. No kubelet is needed: a control plane
# from ../shared/realk8s/up.sh (or any cluster where you may create Nodes) is enough.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/least-privilege.sh [OVERLAY_DIR]
#
# OVERLAY_DIR (default deploy/overlays/nvml) is applied first; an overlay that renames the namespace or
# the service account works too: the script finds the plugin's account through its DaemonSet. Each case
# prints `ok` or `FAIL` with the server's answer; the exit status is the number of failures.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OVERLAY="${1:-$ROOT/deploy/overlays/nvml}"
DRIVER=gpu.dra.dev
CLAIM_NS=default
failures=0

kubectl apply --validate=false -f "$ROOT/crd/" >/dev/null || exit 1
kubectl apply --validate=false -k "$OVERLAY" >/dev/null || exit 1

# The plugin's namespace and account, as the overlay named them.
read -r NS SA < <(kubectl kustomize "$OVERLAY" | kubectl create --dry-run=client -o json -f - |
  jq -r 'select(.kind == "DaemonSet" and .metadata.labels["app.kubernetes.io/component"] == "kubelet-plugin")
         | "\(.metadata.namespace) \(.spec.template.spec.serviceAccountName)"')
[ -n "$NS" ] && [ -n "$SA" ] || { echo "no DaemonSet labelled kubelet-plugin in $OVERLAY" >&2; exit 1; }
echo "plugin account: system:serviceaccount:$NS:$SA"

for node in node-1 node-2; do
  kubectl get node "$node" >/dev/null 2>&1 ||
    kubectl create -f - >/dev/null <<EOF
{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "$node"}}
EOF
done

# A pod of the plugin's account on node-1; it never runs, it only anchors the token.
# No kubelet confirms the deletion, hence --force.
kubectl -n "$NS" delete pod least-privilege-probe --ignore-not-found --force --grace-period=0 >/dev/null 2>&1
kubectl create -f - >/dev/null <<EOF
{"apiVersion": "v1", "kind": "Pod",
 "metadata": {"name": "least-privilege-probe", "namespace": "$NS"},
 "spec": {"nodeName": "node-1", "serviceAccountName": "$SA",
          "containers": [{"name": "c", "image": "gpu-dra:dev"}]}}
EOF
POD_UID=$(kubectl -n "$NS" get pod least-privilege-probe -o jsonpath='{.metadata.uid}')
TOKEN=$(kubectl -n "$NS" create token "$SA" --bound-object-kind Pod \
  --bound-object-name least-privilege-probe --bound-object-uid "$POD_UID")
[ -n "$TOKEN" ] || { echo "no token for $NS/$SA" >&2; exit 1; }
plugin() { kubectl --token "$TOKEN" "$@"; }
# kubectl patch and label GET the object first, which the plugin may not always do; the plugin itself
# replaces whole objects. edit KIND NAME NAMESPACE JQ [kubectl replace flags]: the object as it is stored,
# changed by the jq filter JQ, written back with the plugin's token.
edit() {
  local kind=$1 name=$2 ns=$3 filter=$4
  shift 4
  kubectl ${ns:+-n "$ns"} get "$kind" "$name" -o json | jq "$filter" | plugin replace "$@" -f -
}
# raw_patch PATH JSON: a JSON merge patch sent as is, without kubectl's GET before it.
SERVER=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')
CA=$(mktemp)
trap 'rm -f "$CA"' EXIT
kubectl config view --minify --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}' | base64 -d >"$CA"
raw_patch() { raw_patch_as "$TOKEN" "$@"; }
raw_patch_as() { # TOKEN PATH JSON
  local token=$1 out code
  shift
  out=$(curl -sS --cacert "$CA" -H "Authorization: Bearer $token" -H 'Content-Type: application/merge-patch+json' \
    -X PATCH --data "$2" -w '\n%{http_code}' "$SERVER$1")
  code=$(tail -n1 <<<"$out")
  sed '$d' <<<"$out" | jq -r '.message // .metadata.name' 2>/dev/null
  [ "${code:0:1}" = 2 ]
}
echo "token bound to node: $(plugin auth whoami -o jsonpath='{.status.userInfo.extra.authentication\.kubernetes\.io/node-name[0]}')"

# expect allow|deny WHAT [--says TEXT] COMMAND...: runs COMMAND as given and checks the server's verdict
# (and that its answer contains TEXT).
expect() {
  local want=$1 what=$2 says='' out rc
  shift 2
  if [ "$1" = --says ]; then says=$2; shift 2; fi
  out=$("$@" 2>&1)
  rc=$?
  if { [ "$want" = allow ] && [ $rc -eq 0 ]; } ||
     { [ "$want" = deny ] && [ $rc -ne 0 ] && grep -qiE 'denied|forbidden' <<<"$out" && grep -qF -- "$says" <<<"$out"; }; then
    printf 'ok    %-5s %s\n' "$want" "$what"
  else
    printf 'FAIL  %-5s %s\n' "$want" "$what"
    failures=$((failures + 1))
  fi
  printf '        %s\n' "$(tr '\n' ' ' <<<"$out" | cut -c1-300)"
}

slice() { # name driver nodeName pool
  cat <<EOF
{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "$1"},
 "spec": {"driver": "$2", "nodeName": "$3", "pool": {"name": "$4", "generation": 1, "resourceSliceCount": 1},
          "devices": [{"name": "gpu-0"}]}}
EOF
}

echo "== ResourceSlices"
kubectl delete resourceslices lp-own lp-other-driver lp-other-node lp-other-pool lp-node-2 --ignore-not-found >/dev/null
expect allow "create a slice of node-1, pool node-1" plugin create -f <(slice lp-own $DRIVER node-1 node-1)
expect allow "update that slice" edit resourceslice lp-own "" '.spec.devices += [{"name": "gpu-1"}]'
expect deny "create a slice of another driver" plugin create -f <(slice lp-other-driver other.example.com node-1 node-1)
expect deny "create a slice of node-2" plugin create -f <(slice lp-other-node $DRIVER node-2 node-2)
expect deny "create a slice of node-1 in pool node-2" plugin create -f <(slice lp-other-pool $DRIVER node-1 node-2)
expect allow "create a slice of node-1 as a server-side dry run" plugin create --dry-run=server -f <(slice lp-dry $DRIVER node-1 node-1)
expect deny "create a slice of node-2 as a server-side dry run" plugin create --dry-run=server -f <(slice lp-dry $DRIVER node-2 node-2)
expect allow "list its node's slices" plugin get resourceslices --field-selector "spec.driver=$DRIVER,spec.nodeName=node-1"
expect deny "get one slice (RBAC: the publisher lists)" plugin get resourceslice lp-own
kubectl create -f <(slice lp-node-2 $DRIVER node-2 node-2) >/dev/null
expect deny "update node-2's slice" edit resourceslice lp-node-2 "" '.spec.devices += [{"name": "gpu-1"}]'
expect deny "delete node-2's slice" plugin delete resourceslice lp-node-2
expect allow "delete its own slice" plugin delete resourceslice lp-own

echo "== ResourceClaims"
remove_claim() {
  kubectl -n $CLAIM_NS patch resourceclaim "$1" --type=merge -p '{"metadata": {"finalizers": null}}' >/dev/null 2>&1
  kubectl -n $CLAIM_NS delete resourceclaim "$1" --ignore-not-found >/dev/null
}
# claim NAME NODE: a claim allocated on NODE and reserved for a pod there, written as the scheduler would
# (the resourceclaim controller deallocates a claim that no existing pod uses, so the pod must exist).
claim() {
  remove_claim "$1"
  kubectl -n $CLAIM_NS delete pod "$1" --ignore-not-found --force --grace-period=0 >/dev/null 2>&1
  kubectl -n $CLAIM_NS create -f - >/dev/null <<EOF
{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "$1"},
 "spec": {"nodeName": "$2", "resourceClaims": [{"name": "gpu", "resourceClaimName": "$1"}],
          "containers": [{"name": "c", "image": "workload", "resources": {"claims": [{"name": "gpu"}]}}]}}
EOF
  local pod_uid
  pod_uid=$(kubectl -n $CLAIM_NS get pod "$1" -o jsonpath='{.metadata.uid}')
  kubectl -n $CLAIM_NS create -f - >/dev/null <<EOF
{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
 "metadata": {"name": "$1", "finalizers": ["resource.kubernetes.io/delete-protection"]},
 "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev"}},
                                   {"name": "nic", "exactly": {"deviceClassName": "gpu.dra.dev"}}]}}}
EOF
  kubectl -n $CLAIM_NS patch resourceclaim "$1" --subresource=status --type=merge -p "{\"status\": {
    \"allocation\": {
      \"devices\": {\"results\": [
        {\"request\": \"gpu\", \"driver\": \"$DRIVER\", \"pool\": \"$2\", \"device\": \"gpu-0\"},
        {\"request\": \"nic\", \"driver\": \"other.example.com\", \"pool\": \"$2\", \"device\": \"nic-0\"}]},
      \"nodeSelector\": {\"nodeSelectorTerms\": [{\"matchFields\": [
        {\"key\": \"metadata.name\", \"operator\": \"In\", \"values\": [\"$2\"]}]}]}},
    \"reservedFor\": [{\"resource\": \"pods\", \"name\": \"$1\", \"uid\": \"$pod_uid\"}],
    \"devices\": [{\"driver\": \"other.example.com\", \"pool\": \"$2\", \"device\": \"nic-0\"}]}}" >/dev/null
}
own_status() { # pool
  echo "[{\"driver\": \"other.example.com\", \"pool\": \"$1\", \"device\": \"nic-0\"},
         {\"driver\": \"$DRIVER\", \"pool\": \"$1\", \"device\": \"gpu-0\", \"data\": {\"uuid\": \"MIG-1\"}}]"
}
claim lp-here node-1
claim lp-there node-2

expect allow "report its device's status in a claim on node-1" edit resourceclaim lp-here $CLAIM_NS \
  ".status.devices = $(own_status node-1 | tr -d '\n')" --subresource=status
expect deny "replace status.devices of a claim on node-2" edit resourceclaim lp-there $CLAIM_NS \
  ".status.devices = $(own_status node-2 | tr -d '\n')" --subresource=status
# The server itself refuses an allocation removed under a reservation; without one, only the policy does.
expect deny "remove a claim's allocation and reservation" edit resourceclaim lp-here $CLAIM_NS \
  'del(.status.allocation) | del(.status.reservedFor)' --subresource=status
expect deny "remove node-2's claim's allocation and reservation" edit resourceclaim lp-there $CLAIM_NS \
  'del(.status.allocation) | del(.status.reservedFor)' --subresource=status
expect deny "clear a claim's reservedFor" edit resourceclaim lp-here $CLAIM_NS \
  'del(.status.reservedFor)' --subresource=status
expect deny "change another driver's status.devices entry" edit resourceclaim lp-here $CLAIM_NS \
  '.status.devices[0].data = {"x": 1}' --subresource=status
# The status subresource drops metadata changes before admission, so the policy need not look at them.
edit resourceclaim lp-here $CLAIM_NS 'del(.metadata.finalizers)' --subresource=status >/dev/null 2>&1
expect allow "the status subresource keeps the finalizer a status update leaves out" \
  bash -c "kubectl -n $CLAIM_NS get resourceclaim lp-here -o jsonpath='{.metadata.finalizers}' | grep -q delete-protection"
expect deny "update a claim (RBAC)" edit resourceclaim lp-here $CLAIM_NS '.metadata.labels.owned = "yes"'
expect deny "delete a claim (RBAC)" plugin -n $CLAIM_NS delete resourceclaim lp-there

echo "== Node labels (GpuNodePolicy classicNodeLabels; merge patches as the plugin sends them)"
GFD='"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-L40S", "nvidia.com/gpu.count": "4",
     "nvidia.com/gpu.memory": "46068", "nvidia.com/mig.capable": "false"'
kubectl label node node-1 node-2 team=ml --overwrite >/dev/null
kubectl annotate node node-1 gpu-dra.dev/probe=1 --overwrite >/dev/null
expect allow "set GFD's five labels on node-1" raw_patch /api/v1/nodes/node-1 "{\"metadata\": {\"labels\": {$GFD}}}"
expect allow "change node-1's product label" raw_patch /api/v1/nodes/node-1 \
  '{"metadata": {"labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}}'
expect allow "remove node-1's count label" raw_patch /api/v1/nodes/node-1 '{"metadata": {"labels": {"nvidia.com/gpu.count": null}}}'
expect deny "set GFD's labels on node-2" raw_patch /api/v1/nodes/node-2 "{\"metadata\": {\"labels\": {$GFD}}}"
expect deny "add another label to node-1" raw_patch /api/v1/nodes/node-1 '{"metadata": {"labels": {"owned": "yes"}}}'
expect deny "add another nvidia.com label to node-1" raw_patch /api/v1/nodes/node-1 \
  '{"metadata": {"labels": {"nvidia.com/gpu.family": "ada"}}}'
expect deny "change node-1's team label" raw_patch /api/v1/nodes/node-1 '{"metadata": {"labels": {"team": "other"}}}'
expect deny "remove node-1's team label" raw_patch /api/v1/nodes/node-1 '{"metadata": {"labels": {"team": null}}}'
expect deny "taint node-1" raw_patch /api/v1/nodes/node-1 '{"spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]}}'
expect deny "cordon node-1" raw_patch /api/v1/nodes/node-1 '{"spec": {"unschedulable": true}}'
expect deny "change node-1's annotation" raw_patch /api/v1/nodes/node-1 '{"metadata": {"annotations": {"gpu-dra.dev/probe": "2"}}}'
expect deny "add a finalizer to node-1" raw_patch /api/v1/nodes/node-1 '{"metadata": {"finalizers": ["gpu-dra.dev/keep"]}}'
expect deny "write node-1's status (RBAC)" raw_patch /api/v1/nodes/node-1/status '{"status": {"capacity": {"example.com/x": "1"}}}'
UNBOUND=$(kubectl -n "$NS" create token "$SA")
expect deny "label node-1 with a token bound to no pod" raw_patch_as "$UNBOUND" /api/v1/nodes/node-1 \
  '{"metadata": {"labels": {"nvidia.com/gpu.count": "3"}}}'
expect allow "only the allowed changes reached node-1" bash -c "kubectl get node node-1 -o json | jq -e '
  .metadata.labels[\"nvidia.com/gpu.product\"] == \"NVIDIA-H100-80GB-HBM3\" and (.metadata.labels | has(\"nvidia.com/gpu.count\") | not)
  and .metadata.labels.team == \"ml\" and (.spec.taints // []) == [] and (.spec.unschedulable // false) == false'"

echo "== ComputeDomain status (its node's entry of status.nodes, the status replaced whole as the plugin does)"
CD=computedomains.gpu.dra.dev
NV=computedomains.resource.nvidia.com
cd_entry() { # node ipAddress index status
  echo "{\"name\": \"$1\", \"ipAddress\": \"$2\", \"cliqueID\": \"c.0\", \"index\": $3, \"status\": \"$4\"}"
}
# domain APIVERSION NAME: a domain node-2 joined, written by an admin as the controller and node-2 would.
domain() {
  local resource="computedomains.${1%/*}"
  kubectl -n $CLAIM_NS delete "$resource" "$2" --ignore-not-found >/dev/null
  kubectl -n $CLAIM_NS create -f - >/dev/null <<EOF
{"apiVersion": "$1", "kind": "ComputeDomain", "metadata": {"name": "$2"},
 "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "$2-channel"}}}}
EOF
  kubectl -n $CLAIM_NS patch "$resource" "$2" --subresource=status --type=merge -p "{\"status\": {
    \"status\": \"NotReady\", \"nodes\": [$(cd_entry node-2 10.0.0.2 0 Ready)],
    \"conditions\": [{\"type\": \"Placed\", \"status\": \"True\", \"reason\": \"Placed\", \"message\": \"c.0\"}]}}" >/dev/null
}
unbound() { local TOKEN=$UNBOUND; "$@"; } # COMMAND... with the token bound to no pod
ONLY_ITS_OWN='the gpu-dra plugin on node node-1 may only write the entry of that node'
MINE=$(cd_entry node-1 10.0.0.1 1 NotReady)
domain gpu.dra.dev/v1alpha1 lp-domain

expect allow "join: add its own entry to a domain's status.nodes" edit $CD lp-domain $CLAIM_NS \
  ".status.nodes += [$MINE]" --subresource=status
expect allow "turn its entry Ready" edit $CD lp-domain $CLAIM_NS \
  '(.status.nodes[] | select(.name == "node-1") | .status) = "Ready"' --subresource=status
expect deny "point node-2's entry at another address" --says "$ONLY_ITS_OWN" edit $CD lp-domain $CLAIM_NS \
  '(.status.nodes[] | select(.name == "node-2") | .ipAddress) = "192.0.2.66"' --subresource=status
expect deny "remove node-2's entry" --says "$ONLY_ITS_OWN" edit $CD lp-domain $CLAIM_NS \
  '.status.nodes |= map(select(.name != "node-2"))' --subresource=status
expect deny "add an entry for node-3" --says "$ONLY_ITS_OWN" edit $CD lp-domain $CLAIM_NS \
  ".status.nodes += [$(cd_entry node-3 192.0.2.66 2 Ready)]" --subresource=status
expect deny "add a second entry of its own" --says 'may write one entry of that node' edit $CD lp-domain $CLAIM_NS \
  ".status.nodes += [$(cd_entry node-1 192.0.2.66 2 Ready)]" --subresource=status
expect deny "mark the domain Ready (status.status)" --says 'status.status or status.conditions' \
  edit $CD lp-domain $CLAIM_NS '.status.status = "Ready"' --subresource=status
expect deny "change the domain's conditions" --says 'status.status or status.conditions' \
  edit $CD lp-domain $CLAIM_NS '.status.conditions[0].status = "False"' --subresource=status
expect deny "change its entry with a token bound to no pod" --says 'names no node' unbound edit $CD lp-domain $CLAIM_NS \
  '(.status.nodes[] | select(.name == "node-1") | .ipAddress) = "10.0.0.9"' --subresource=status
expect deny "update a domain (RBAC: only its status)" edit $CD lp-domain $CLAIM_NS '.metadata.labels.owned = "yes"'
expect deny "patch a domain's status (RBAC: it replaces the status)" raw_patch \
  /apis/gpu.dra.dev/v1alpha1/namespaces/$CLAIM_NS/computedomains/lp-domain/status '{"status": {}}'
expect allow "leave: remove its own entry" edit $CD lp-domain $CLAIM_NS \
  'del(.status.nodes[] | select(.name == "node-1"))' --subresource=status
expect allow "only the allowed changes reached the domain" bash -c "kubectl -n $CLAIM_NS get $CD lp-domain -o json | jq -e '
  .status.status == \"NotReady\" and .status.conditions[0].status == \"True\"
  and (.status.nodes | map([.name, .ipAddress])) == [[\"node-2\", \"10.0.0.2\"]]'"

# NVIDIA's group (compatibility mode): its CRD as installed, or else a minimal stand-in with a status
# subresource that keeps every field, removed afterwards.
NV_CRD_OURS=
if ! kubectl get crd $NV >/dev/null 2>&1 &&
  kubectl create -f - >/dev/null <<EOF; then
{"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": "$NV"},
 "spec": {"group": "resource.nvidia.com", "scope": "Namespaced",
          "names": {"kind": "ComputeDomain", "plural": "computedomains", "singular": "computedomain"},
          "versions": [{"name": "v1beta1", "served": true, "storage": true, "subresources": {"status": {}},
                        "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]}}
EOF
  NV_CRD_OURS=1
  kubectl wait --for condition=established --timeout=30s crd/$NV >/dev/null
fi
if kubectl get crd $NV >/dev/null 2>&1 && domain resource.nvidia.com/v1beta1 lp-domain; then
  expect allow "join a domain of NVIDIA's group" edit $NV lp-domain $CLAIM_NS \
    ".status.nodes += [$MINE]" --subresource=status
  expect deny "point node-2's entry at another address in NVIDIA's group" --says "$ONLY_ITS_OWN" \
    edit $NV lp-domain $CLAIM_NS '(.status.nodes[] | select(.name == "node-2") | .ipAddress) = "192.0.2.66"' \
    --subresource=status
else
  echo "skip  NVIDIA's group: no $NV and none could be installed"
fi

echo "== ComputeDomainPlacements (the controller's alone; the plugin gets one by name)"
DOMAIN_UID=$(kubectl -n $CLAIM_NS get $CD lp-domain -o jsonpath='{.metadata.uid}')
placement() { # name
  cat <<EOF
{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "ComputeDomainPlacement", "metadata": {"name": "$1"},
 "spec": {"clique": "c.0", "domain": {"apiVersion": "gpu.dra.dev/v1alpha1", "name": "lp-domain",
                                      "namespace": "$CLAIM_NS", "uid": "$DOMAIN_UID"}}}
EOF
}
kubectl delete computedomainplacements "$DOMAIN_UID" lp-forged --ignore-not-found >/dev/null
kubectl create -f <(placement "$DOMAIN_UID") >/dev/null
expect allow "get a domain's placement" plugin get computedomainplacement "$DOMAIN_UID"
expect deny "list placements (RBAC: it gets one by name)" plugin get computedomainplacements
expect deny "create a placement (RBAC)" plugin create -f <(placement lp-forged)
expect deny "move a domain to another clique (RBAC)" edit computedomainplacement "$DOMAIN_UID" "" '.spec.clique = "c.1"'
expect deny "delete a placement (RBAC)" plugin delete computedomainplacement "$DOMAIN_UID"

echo "== the rest of the grants"
expect allow "get its Node" plugin get node node-1
expect deny "update its Node (RBAC)" edit node node-1 "" '.metadata.labels.owned = "yes"'
expect allow "record an Event (events.k8s.io)" plugin -n default create -f - <<EOF
{"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "least-privilege-probe"},
 "eventTime": "2026-01-01T00:00:00.000000Z", "reportingController": "$DRIVER/kubelet-plugin",
 "reportingInstance": "$DRIVER/node-1", "action": "Probe", "reason": "Probe", "type": "Normal",
 "regarding": {"apiVersion": "v1", "kind": "Node", "name": "node-1"}, "note": "least-privilege.sh"}
EOF
expect allow "patch that Event (a series, as kube's Recorder does)" raw_patch \
  /apis/events.k8s.io/v1/namespaces/default/events/least-privilege-probe \
  '{"series": {"count": 2, "lastObservedTime": "2026-01-01T00:00:01.000000Z"}}'
expect deny "read Secrets (RBAC)" plugin -n "$NS" get secrets

kubectl delete resourceslices lp-node-2 --ignore-not-found >/dev/null
kubectl label node node-1 node-2 team- nvidia.com/gpu.present- nvidia.com/gpu.product- nvidia.com/gpu.count- \
  nvidia.com/gpu.memory- nvidia.com/mig.capable- >/dev/null 2>&1
kubectl annotate node node-1 gpu-dra.dev/probe- >/dev/null 2>&1
for c in lp-here lp-there; do
  remove_claim $c
  kubectl -n $CLAIM_NS delete pod $c --ignore-not-found --force --grace-period=0 >/dev/null 2>&1
done
kubectl -n default delete events.v1.events.k8s.io least-privilege-probe --ignore-not-found >/dev/null
kubectl delete computedomainplacements "$DOMAIN_UID" lp-forged --ignore-not-found >/dev/null
kubectl -n $CLAIM_NS delete $CD lp-domain --ignore-not-found >/dev/null
if [ -n "$NV_CRD_OURS" ]; then kubectl delete crd $NV >/dev/null; else
  kubectl -n $CLAIM_NS delete $NV lp-domain --ignore-not-found >/dev/null 2>&1; fi
kubectl -n "$NS" delete pod least-privilege-probe --force --grace-period=0 >/dev/null 2>&1
echo "failures: $failures"
exit "$failures"
