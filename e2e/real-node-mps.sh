#!/usr/bin/env bash
# What a real node does to MPS that the doubles cannot show, with the plugin installed from deploy/ as a
# Pod (e2e/real-node: the fake overlay on the host network), on the node of ../shared/realk8s/node
# (up.sh, then up-node.sh; no start-plugin.sh). Builds the image (e2e/image.sh) from
# target/release/gpu-dra, imports it twice (gpu-dra:dev and gpu-dra:dev2, the "upgrade"), installs, and
# checks with an MPS claim used by a busybox pod:
#   - the daemon runs in a Pod of its own, not in the plugin's container (its cgroup is not the plugin's);
#   - the client's /dev/shm is a tmpfs of the configured size that holds the daemon server's segment;
#   - a plugin crash (its container killed) and an upgrade (a new image) leave the daemon Pod and the
#     client running, with the same Pod UID and no restart;
#   - a dynamic MIG device from the fake overlay gets its /dev/nvidia-caps node in the container, and
#     /dev/nvidia-uvm, though the host has neither: containerd makes them from the spec's numbers;
#   - deleting the client unprepares: the daemon Pod goes, the tmpfs is unmounted, the directory removed.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/real-node-mps.sh     (as root, from the project root)
#
# Each check prints PASS or FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
BIN_DIR=${KUBE_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/bin}
PLUGINS=${KUBELET_PLUGINS_DIR:-/var/lib/kubelet/plugins}
MPS=$PLUGINS/gpu.dra.dev/mps
N=gpu-dra-mps-e2e
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
h() { echo "----- $*"; }
plugin_pod() { kubectl get pod -n gpu-dra -l app.kubernetes.io/component=kubelet-plugin -o jsonpath='{.items[0].metadata.name}' 2>/dev/null; }
plugin_ready() { kubectl wait -n gpu-dra --for=condition=Ready pod -l app.kubernetes.io/component=kubelet-plugin --timeout=90s >/dev/null 2>&1; }

h "image"
# The fake overlay's MPS claims (here and in e2e/day-two.sh) run the fake backend's MPS stand-in, which
# only a build with the test doubles has: cargo build --release --features doubles.
grep -q "(stand-in)" <<<"$("${GPU_DRA_BINARY:-target/release/gpu-dra}" fake mps-control-daemon --help 2>&1)" ||
  { echo "${0##*/}: ${GPU_DRA_BINARY:-target/release/gpu-dra} has no MPS stand-in; build it with --features doubles" >&2; exit 1; }
e2e/image.sh "${GPU_DRA_BINARY:-target/release/gpu-dra}" gpu-dra:dev target/gpu-dra-image.tar || exit 1
"$BIN_DIR/ctr" -n k8s.io images import target/gpu-dra-image.tar >/dev/null
"$BIN_DIR/ctr" -n k8s.io images tag --force docker.io/library/gpu-dra:dev docker.io/library/gpu-dra:dev2 >/dev/null
check "image imported as gpu-dra:dev and gpu-dra:dev2" \
  bash -c "'$BIN_DIR/ctr' -n k8s.io images ls -q | grep -q 'gpu-dra:dev2'"

h "install from deploy/ (fake overlay on the host network)"
kubectl apply -f crd/ >/dev/null
kubectl label node node-1 gpu-dra.dev/fake=true --overwrite >/dev/null
# e2e/real-node reads the node's boot id from a file beside the fake GPUs' state (e2e/day-two.sh changes it).
mkdir -p /var/lib/gpu-dra && [ -s /var/lib/gpu-dra/boot_id ] || cat /proc/sys/kernel/random/boot_id > /var/lib/gpu-dra/boot_id
kubectl apply -k e2e/real-node >/dev/null
check "plugin Pod Ready" plugin_ready
# PID 1 of the plugin's container is the reaper (src/plugin/reaper.rs), the plugin its only child, which
# must not inherit the reaper's blocked SIGTERM (bit 15 of SigBlk) or the kubelet could never stop it.
reaper_and_child() {
  local pid reaper="" child=""
  for pid in $(pgrep -f '^gpu-dra plugin'); do
    [ "$(awk '/^NSpid:/ {print $NF}' /proc/$pid/status)" = 1 ] && reaper=$pid
  done
  [ -n "$reaper" ] || return 1
  child=$(pgrep -P "$reaper" -f '^gpu-dra plugin' | head -1)
  [ -n "$child" ] || return 1
  local blocked=$(awk '/^SigBlk:/ {print $2}' /proc/$child/status)
  (( (0x$blocked & 0x4000) == 0 ))
}
check "the plugin container's PID 1 is the reaper; the plugin is its child, SIGTERM not blocked" reaper_and_child
kubectl get pods -n gpu-dra -o wide

h "an MPS claim and a client pod"
kubectl create namespace $N >/dev/null 2>&1
kubectl apply -n $N -f - >/dev/null <<'EOF'
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: mps-gpu
spec:
  devices:
    requests:
      - name: gpu
        exactly: {deviceClassName: gpu.dra.dev}
    config:
      - opaque:
          driver: gpu.dra.dev
          parameters:
            apiVersion: gpu.dra.dev/v1alpha1
            kind: GpuConfig
            sharing:
              strategy: MPS
              mpsConfig: {defaultActiveThreadPercentage: 40}
---
apiVersion: v1
kind: Pod
metadata:
  name: mps-client
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: c
      image: localhost/busybox:local
      imagePullPolicy: Never
      command: ["sh", "-c", "sleep 3600"]
      resources: {claims: [{name: gpu}]}
  resourceClaims:
    - name: gpu
      resourceClaimName: mps-gpu
EOF
kubectl wait -n $N --for=condition=Ready pod/mps-client --timeout=120s >/dev/null 2>&1
check "client pod Running" test "$(kubectl get pod -n $N mps-client -o jsonpath='{.status.phase}')" = Running
uid=$(kubectl get resourceclaim -n $N mps-gpu -o jsonpath='{.metadata.uid}')
daemon=gpu-dra-mps-$uid
kubectl get pods -n gpu-dra -o wide
check "daemon Pod $daemon Ready in gpu-dra" kubectl wait -n gpu-dra --for=condition=Ready pod/$daemon --timeout=10s
in_client() { kubectl exec -n $N mps-client -- sh -c "$1" 2>&1; }
echo "client: $(in_client 'stat -f -c %T /dev/shm; df -k /dev/shm | tail -1; ls -a /dev/shm /tmp/nvidia-mps')"
check "client /dev/shm is a tmpfs" test "$(in_client 'stat -f -c %T /dev/shm')" = tmpfs
check "client /dev/shm holds the daemon server's segment" bash -c "kubectl exec -n $N mps-client -- cat /dev/shm/cuda.shm.mps-stand-in | grep -q GPU-"
check "client sees the daemon's control socket" bash -c "kubectl exec -n $N mps-client -- ls /tmp/nvidia-mps | grep -qx control"
check "client writes to /dev/shm are seen on the claim's tmpfs" bash -c \
  "kubectl exec -n $N mps-client -- sh -c 'echo hi > /dev/shm/from-client' && test -f $MPS/$uid/shm/from-client"
check "the claim's shm is a tmpfs mount on the host" mountpoint -q "$MPS/$uid/shm"
daemon_uid() { kubectl get pod -n gpu-dra $daemon -o jsonpath='{.metadata.uid}/{.status.containerStatuses[0].restartCount}'; }
before=$(daemon_uid)
stand_in=$(pgrep -f "fake mps-control-daemon -f" | head -1)
plugin=$(pgrep -f "gpu-dra plugin" | head -1)
check "the daemon is not in the plugin container's cgroup" \
  test "$(cat /proc/$stand_in/cgroup 2>/dev/null)" != "$(cat /proc/$plugin/cgroup 2>/dev/null)"
echo "daemon cgroup: $(cat /proc/$stand_in/cgroup)  plugin cgroup: $(cat /proc/$plugin/cgroup)"
grep -q "set_default_active_thread_percentage 40" "$MPS/$uid/log/control.log" && ok "limit applied" || bad "limit applied"

h "plugin crash: its container is killed"
kill -9 "$plugin"
sleep 3; check "plugin Ready again" plugin_ready
check "daemon Pod unchanged after the crash ($before)" test "$(daemon_uid)" = "$before"
check "client still Running" test "$(kubectl get pod -n $N mps-client -o jsonpath='{.status.phase}')" = Running
check "client still sees the segment" bash -c "kubectl exec -n $N mps-client -- cat /dev/shm/cuda.shm.mps-stand-in | grep -q GPU-"

h "upgrade: a new image"
old=$(plugin_pod)
kubectl set image -n gpu-dra daemonset/gpu-dra-plugin plugin=gpu-dra:dev2 >/dev/null
kubectl rollout status -n gpu-dra daemonset/gpu-dra-plugin --timeout=120s >/dev/null
check "plugin replaced ($old -> $(plugin_pod)) and Ready" bash -c "[ '$(plugin_pod)' != '$old' ]" && plugin_ready
check "daemon Pod unchanged after the upgrade" test "$(daemon_uid)" = "$before"
check "client still Running" test "$(kubectl get pod -n $N mps-client -o jsonpath='{.status.phase}')" = Running

h "a dynamic MIG device (the fake overlay's dynamic MIG)"
kubectl apply -n $N -f - >/dev/null <<'EOF'
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: mig
spec:
  devices:
    requests:
      - name: mig
        exactly:
          deviceClassName: mig.gpu.dra.dev
          selectors: [{cel: {expression: "device.attributes['gpu.dra.dev'].profile == '1g.10gb'"}}]
---
apiVersion: v1
kind: Pod
metadata:
  name: mig-client
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: c
      image: localhost/busybox:local
      imagePullPolicy: Never
      command: ["sh", "-c", "ls -l /dev/nvidia-caps/ /dev/nvidia-uvm; sleep 3600"]
      resources: {claims: [{name: mig}]}
  resourceClaims:
    - name: mig
      resourceClaimName: mig
EOF
kubectl wait -n $N --for=condition=Ready pod/mig-client --timeout=90s >/dev/null 2>&1
kubectl get events -n $N --field-selector involvedObject.name=mig-client -o custom-columns=R:.reason,M:.message 2>/dev/null | tail -3 | cut -c1-300
check "MIG client Running" test "$(kubectl get pod -n $N mig-client -o jsonpath='{.status.phase}')" = Running
echo "$(kubectl logs -n $N mig-client 2>&1 | head -5)"
check "MIG client has its /dev/nvidia-caps node" bash -c "kubectl logs -n $N mig-client | grep -q 'nvidia-cap[0-9]'"
# The host has neither file (no NVIDIA driver here, and the driver never makes MIG capability files in
# /dev): containerd made them from the spec's type and numbers (the fake's are /dev/null's, 1, 3).
cap=$(kubectl logs -n $N mig-client 2>/dev/null | grep -oE 'nvidia-cap[0-9]+' | head -1)
check "the host has no /dev/nvidia-caps/$cap and no /dev/nvidia-uvm" \
  bash -c "[ -n '$cap' ] && [ ! -e /dev/nvidia-caps/$cap ] && [ ! -e /dev/nvidia-uvm ]"
check "the container's $cap is a character device 1, 3 (the CDI spec's numbers)" \
  bash -c "kubectl logs -n $N mig-client | grep -E '^c.* 1, +3 .*$cap\$' >/dev/null"
check "the container has /dev/nvidia-uvm (every spec names it)" \
  bash -c "kubectl logs -n $N mig-client | grep -qE '^c.* /dev/nvidia-uvm\$'"
kubectl delete -n $N pod/mig-client --wait=true >/dev/null

h "unprepare"
kubectl delete -n $N pod/mps-client --wait=true >/dev/null
gone() { ! kubectl get pod -n gpu-dra $daemon >/dev/null 2>&1; }
for _ in $(seq 30); do gone && break; sleep 1; done
check "daemon Pod deleted" gone
check "tmpfs unmounted and directory removed" bash -c "! mountpoint -q '$MPS/$uid/shm' && [ ! -e '$MPS/$uid' ]"

h "clean up"
kubectl delete namespace $N --wait=false >/dev/null
echo "failures: $failures"
exit $failures
