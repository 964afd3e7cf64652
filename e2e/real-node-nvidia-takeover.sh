#!/usr/bin/env bash
# A node handed over from NVIDIA's DRA driver while pods it prepared still run, on the real node of
# ../shared/realk8s/node: gpu-dra installed as users do (e2e/nvidia-takeover: the fake overlay with
# deploy/components/nvidia-compat and nvidia-migration, as a DaemonSet) finds what NVIDIA's plugin left
# (planted here in NVIDIA's formats: its checkpoint, claim specs, an MPS daemon's Deployment in
# nvidia-dra-driver-gpu with its directory and tmpfs) and takes the claims over. The kubelet unprepares a claim
# only when a pod it knows goes, and this kubelet never ran NVIDIA's plugin, so e2e/nvidia-takeover/unprepare.py
# makes its NodeUnprepareResources call on the plugin's socket. Checks:
#   - the plugin's first start, before NVIDIA's checkpoint is there, leaves NVIDIA's MPS directories and
#     their tmpfs alone (its own MPS sweep shares <plugins>/gpu.nvidia.com/mps with them)
#   - a restart with the checkpoint: the Warning Event NvidiaPreparedClaims says 2 claims were taken over and
#     the one whose prepare had not completed was not
#   - the Role of nvidia-migration: the plugin may delete Deployments in nvidia-dra-driver-gpu, and nowhere else
#   - NodeUnprepareResources of both: NVIDIA's MPS Deployment deleted (its Pod gone), its tmpfs unmounted and
#     its directory removed, another daemon's directory left, both claim specs removed, gpu-0 (time-sliced by
#     NVIDIA) set back to the default, NVIDIA's checkpoint byte for byte as before; a repeat is fine
#   - after another restart the Event says NVIDIA's file still lists 2 claims gpu-dra has unprepared
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig GPU_DRA_BIN=target/debug/gpu-dra e2e/real-node-nvidia-takeover.sh
#   (as root, from the project root, after realk8s/up.sh and realk8s/node/up-node.sh, with no plugin running or
#   installed; pip install grpcio grpcio-tools for unprepare.py)
#
# Each check prints PASS or FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
cd "$(dirname "$0")/.."
BIN=${GPU_DRA_BIN:-target/release/gpu-dra}
BIN_DIR=${KUBE_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/bin}
NODE=${NODE_NAME:-node-1}
DRIVER=gpu.nvidia.com
NVIDIA_NS=nvidia-dra-driver-gpu
PLUGINS=${KUBELET_PLUGINS_DIR:-/var/lib/kubelet/plugins}
DIR=$PLUGINS/$DRIVER
CDI=${CDI_ROOT:-/var/run/cdi}
SEL=app.kubernetes.io/component=kubelet-plugin
# Claim UIDs as NVIDIA's plugin recorded them; the claims need not exist in the API server for an unprepare.
TS=7d1e0c52-8a3f-4b6e-9c21-5f0a1b2c3d01
MPS_CLAIM=7d1e0c52-8a3f-4b6e-9c21-5f0a1b2c3d02
HALF=7d1e0c52-8a3f-4b6e-9c21-5f0a1b2c3d03
MPS_ID=$MPS_CLAIM-3fa9c
STRANGER=$DIR/mps/7d1e0c52-8a3f-4b6e-9c21-5f0a1b2c3d99-00b1e
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
wait_until() { local t=$1; shift; local end=$((SECONDS + t)); until "$@"; do [ $SECONDS -lt $end ] || return 1; sleep 1; done; }
mounted() { grep -q " $1 tmpfs " /proc/mounts; }
plugin_ready() { kubectl wait -n gpu-dra --for=condition=Ready pod -l $SEL --timeout=120s >/dev/null; }
restart_plugin() {
  kubectl delete pod -n gpu-dra -l $SEL --wait=true >/dev/null
  has_pod() { [ -n "$(kubectl get pod -n gpu-dra -l $SEL -o name 2>/dev/null)" ]; }
  wait_until 60 has_pod && sleep 2 && plugin_ready
}
event_notes() {
  kubectl get events -A --field-selector reason=NvidiaPreparedClaims -o jsonpath='{range .items[*]}{.message}{.note}{"\n"}{end}' 2>/dev/null
}
uuid_of() {
  kubectl get resourceslices --field-selector "spec.driver=$DRIVER" -o json | python3 -c "
import json, sys
for s in json.load(sys.stdin)['items']:
    for d in s['spec'].get('devices', []):
        if d['name'] == sys.argv[1]:
            print(d['attributes']['uuid']['string'])" "$1"
}
spec_file() { echo "$CDI/k8s.$DRIVER-claim_$1.yaml"; }

echo "----- what NVIDIA's plugin left on the node"
grep -q "(stand-in)" <<<"$("$BIN" fake mps-control-daemon --help 2>&1)" ||
  { echo "${0##*/}: $BIN has no MPS stand-in; build it with --features doubles" >&2; exit 1; }
python3 -c "import grpc, grpc_tools" 2>/dev/null ||
  { echo "${0##*/}: unprepare.py needs: pip install grpcio grpcio-tools" >&2; exit 1; }
if kubectl get daemonset -n gpu-dra gpu-dra-plugin >/dev/null 2>&1; then
  echo "${0##*/}: gpu-dra is installed already: kubectl delete -k it first" >&2
  exit 1
fi
rm -rf /var/lib/gpu-dra "$DIR"
rm -f "$CDI"/k8s.$DRIVER-*
mkdir -p /var/lib/gpu-dra && cat /proc/sys/kernel/random/boot_id > /var/lib/gpu-dra/boot_id
kubectl create namespace $NVIDIA_NS >/dev/null 2>&1
"$BIN_DIR/ctr" -n k8s.io images ls -q 2>/dev/null | grep -qx localhost/busybox:local ||
  "$BIN_DIR/ctr" -n k8s.io images import --local "${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/images/busybox.tar" >/dev/null
# NVIDIA's MPS daemon runs as a Deployment of its own (a stand-in that sleeps), with its tmpfs on the host.
kubectl apply -f - >/dev/null <<YAML
apiVersion: apps/v1
kind: Deployment
metadata: {name: mps-control-daemon-$MPS_ID, namespace: $NVIDIA_NS}
spec:
  selector: {matchLabels: {app: mps-$MPS_ID}}
  template:
    metadata: {labels: {app: mps-$MPS_ID}}
    spec:
      nodeName: $NODE
      terminationGracePeriodSeconds: 1
      containers:
        - {name: mps-control-daemon, image: localhost/busybox:local, imagePullPolicy: Never, command: [sleep, "3600"]}
YAML
check "NVIDIA's MPS Deployment Available" \
  kubectl wait -n $NVIDIA_NS --for=condition=Available deployment/mps-control-daemon-$MPS_ID --timeout=120s
for d in "$DIR/mps/$MPS_ID" "$STRANGER"; do mkdir -p "$d/pipe" "$d/log" "$d/shm"; done
mount -t tmpfs -o size=16m shm "$DIR/mps/$MPS_ID/shm" && echo segment > "$DIR/mps/$MPS_ID/shm/cuda.shm.0"
for claim in $TS $MPS_CLAIM; do
  cat > "$(spec_file $claim)" <<YAML
cdiVersion: 0.5.0
kind: k8s.$DRIVER/claim
devices:
  - name: $claim-gpu-0
    containerEdits:
      env: [NVIDIA_VISIBLE_DEVICES=void]
YAML
done

echo "----- gpu-dra installed (nvidia-compat, nvidia-migration)"
IMG=$(mktemp -d); trap 'rm -rf "$IMG"' EXIT
e2e/image.sh "$BIN" gpu-dra:dev "$IMG/gpu-dra-image.tar" >/dev/null || { bad "image built from $BIN"; exit "$failures"; }
"$BIN_DIR/ctr" -n k8s.io images import "$IMG/gpu-dra-image.tar" >/dev/null
kubectl apply -f crd/ >/dev/null
kubectl label node "$NODE" gpu-dra.dev/fake=true --overwrite >/dev/null
kubectl apply -k e2e/nvidia-takeover >/dev/null
sleep 2
check "plugin DaemonSet Pod Ready" plugin_ready
published() { [ -n "$(uuid_of gpu-1)" ]; }
check "slices of $DRIVER published" wait_until 60 published
check "its first start left NVIDIA's MPS directory and tmpfs alone" \
  bash -c "[ -f '$DIR/mps/$MPS_ID/shm/cuda.shm.0' ] && grep -q ' $DIR/mps/$MPS_ID/shm tmpfs ' /proc/mounts"
check "and another daemon's directory" test -d "$STRANGER"
GPU0=$(uuid_of gpu-0); GPU1=$(uuid_of gpu-1)

echo "----- NVIDIA's checkpoint appears; the plugin restarts"
python3 - "$DIR/checkpoint.json" "$(cat /proc/sys/kernel/random/boot_id)" "$GPU0" "$GPU1" $TS $MPS_CLAIM $HALF $MPS_ID <<'PY'
import json, sys
path, boot, gpu0, gpu1, ts, mps, half, mps_id = sys.argv[1:]
def group(uid, device, uuid, daemon=""):
    return {"devices": [{"gpu": {"info": {"uuid": uuid}, "device": {
        "Requests": ["gpu"], "PoolName": "node-1", "DeviceName": device,
        "CDIDeviceIDs": [f"k8s.gpu.nvidia.com/claim={uid}-{device}"]}}, "mig": None}],
        "configState": {"mpsControlDaemonID": daemon, "containerEdits": None}}
def claim(state, name, g):
    return {"checkpointState": state, "name": name, "namespace": "gpu-test", "status": {}, "preparedDevices": [g]}
doc = {"checksum": 1, "v2": {"checksum": 2, "nodeBootID": boot, "preparedClaims": {
    ts: claim("PrepareCompleted", "time-sliced", group(ts, "gpu-0", gpu0)),
    mps: claim("PrepareCompleted", "mps", group(mps, "gpu-1", gpu1, mps_id)),
    half: claim("PrepareStarted", "half", group(half, "gpu-2", gpu1))}}}
json.dump(doc, open(path, "w"))
PY
BEFORE=$(sha256sum "$DIR/checkpoint.json")
check "plugin Ready again" restart_plugin
taken() { event_notes | grep -q "Took over 2 claim(s)"; }
check "Event NvidiaPreparedClaims: 2 claims taken over" wait_until 30 taken
half() { event_notes | grep -q "gpu-test/half ($HALF).*did not complete"; }
check "and the half-prepared one not (the kubelet prepares it again)" half
SA=system:serviceaccount:gpu-dra:gpu-dra-plugin
check "the plugin may delete Deployments in $NVIDIA_NS" \
  test "$(kubectl auth can-i delete deployments -n $NVIDIA_NS --as=$SA)" = yes
check "but not in default" test "$(kubectl auth can-i delete deployments -n default --as=$SA)" = no

echo "----- the pods go: NodeUnprepareResources"
out=$(e2e/nvidia-takeover/unprepare.py "$DIR/dra.sock" gpu-test/time-sliced/$TS gpu-test/mps/$MPS_CLAIM 2>&1)
echo "$out"
check "both unprepared" bash -c "[ \$(grep -c ' ok\$' <<<'$out') = 2 ]"
gone() { ! kubectl get deployment -n $NVIDIA_NS mps-control-daemon-$MPS_ID >/dev/null 2>&1; }
check "NVIDIA's MPS Deployment deleted" gone
no_pods() { [ -z "$(kubectl get pods -n $NVIDIA_NS -l app=mps-$MPS_ID -o name 2>/dev/null)" ]; }
check "its Pod gone" wait_until 60 no_pods
check "its tmpfs unmounted" bash -c "! grep -q ' $DIR/mps/$MPS_ID/shm ' /proc/mounts"
check "its directory removed" test ! -e "$DIR/mps/$MPS_ID"
check "another daemon's directory left" test -d "$STRANGER"
check "NVIDIA's claim specs removed" bash -c "[ ! -e '$(spec_file $TS)' ] && [ ! -e '$(spec_file $MPS_CLAIM)' ]"
reset() { kubectl logs -n gpu-dra -l $SEL --tail=-1 2>/dev/null | grep 'GPU sharing mode set' | grep -q 'gpu-0'; }
check "gpu-0 set back to the default sharing mode" reset
check "NVIDIA's checkpoint unchanged" test "$(sha256sum "$DIR/checkpoint.json")" = "$BEFORE"
again=$(e2e/nvidia-takeover/unprepare.py "$DIR/dra.sock" gpu-test/time-sliced/$TS 2>&1)
check "a repeated unprepare succeeds" grep -q ' ok$' <<<"$again"

echo "----- another restart"
check "plugin Ready again" restart_plugin
listed() { event_notes | grep -q "still lists 2 claim(s) that gpu-dra has unprepared since"; }
check "Event: NVIDIA's checkpoint still lists the 2 unprepared claims (move it aside)" wait_until 30 listed
check "nothing taken over twice" bash -c "! kubectl logs -n gpu-dra -l $SEL --tail=-1 | grep -q 'prepared by NVIDIA.s plugin taken over'"

echo "----- clean up"
kubectl delete -k e2e/nvidia-takeover --wait=true >/dev/null 2>&1
kubectl delete namespace $NVIDIA_NS --wait=false >/dev/null 2>&1
kubectl label node "$NODE" gpu-dra.dev/fake- >/dev/null 2>&1
mounted "$DIR/mps/$MPS_ID/shm" && umount "$DIR/mps/$MPS_ID/shm"
rm -rf "$DIR" /var/lib/gpu-dra; rm -f "$CDI"/k8s.$DRIVER-*
echo "failures: $failures"
exit "$failures"
