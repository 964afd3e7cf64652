#!/usr/bin/env bash
# ComputeDomains in NVIDIA compatibility mode on the real node of ../shared/realk8s/node (kubelet +
# containerd), with NVIDIA's own ComputeDomain CRD and NVIDIA's own IMEX demo manifests, taken by path at run
# time (nothing of NVIDIA's is kept in this repository):
#   install: NVIDIA's CRD for computedomains.resource.nvidia.com (not ours; crd/ has none of that group), our
#      crd/ (the placements CRD among them), NVIDIA's DeviceClasses and the channel class as the nvidia-compat
#      component renders them (`kubectl kustomize e2e/real-node-nvidia-compat`, its DeviceClasses only), the
#      image gpu-dra:dev (e2e/image.sh) for the IMEX daemon's Pod; then, as processes, the plugin
#      (start-plugin.sh with DRIVER_NAME=gpu.nvidia.com, --fake-profile gb200-nvl72, --node-ip <node's
#      InternalIP>) and the controller (`gpu-dra controller --driver-name gpu.nvidia.com --leader-elect=false`,
#      admin kubeconfig, log STATE/logs/gpu-dra-controller.log). Both are stopped at the end by their pids.
#   02 NVIDIA's channel-injection.yaml: the pod Running, its log lists channel0 (a character device), the
#      ComputeDomain Ready with node-1's entry, the channel claim allocated imex-channel-0 of gpu.nvidia.com on
#      node-1, node-1's IMEX daemon Pod Running; the pod deleted: the daemon Pod goes and node-1's entry is
#      removed; the domain deleted: its template and placement go
#   03 NVIDIA's channel-injection-all.yaml (allocationMode All): the same, and the log lists channel0,
#      channel222 and channel2047 (what NVIDIA's own test asserts), 2048 channels in all
#   04 a worker shaped like NVIDIA's nvbandwidth job's worker (e2e/real-node-compute-domain-nvidia/): a
#      ComputeDomain of numNodes 1 and a Pod with `nvidia.com/gpu: 2` plus the domain's channel claim: the
#      scheduler's claim has two GPUs of node-1, the container sees those two (GPU_DRA_DEVICE_* names them
#      and imex-channel-0; two /dev/nvidiaN) and channel0; the domain Ready, the daemon Pod gone after the pod
#   after: no CDI spec of gpu.nvidia.com and no IMEX daemon Pod left
# NVIDIA's two demo files are applied unchanged except what a node without a registry needs: every `image:`
# becomes TEST_IMAGE, by default busybox with Debian's static bash as /bin/bash (built and imported here from
# BASH_STATIC), so NVIDIA's `bash -c` runs as written; only with an image without bash does `command: ["bash",
# "-c"]` become `["sh", "-c"]`. The script prints the diff of each file it applied.
#
# Settings (env): KUBECONFIG (required), NVIDIA_CD_CRD (required: NVIDIA's
#   deployments/helm/*/crds/resource.nvidia.com_computedomains.yaml), NVIDIA_IMEX_DEMO_DIR (required: a folder
#   holding NVIDIA's demo/specs/imex/channel-injection.yaml and channel-injection-all.yaml),
#   GPU_DRA_BIN [target/release/gpu-dra, of a --features doubles build: the IMEX stand-in],
#   TEST_IMAGE [localhost/busybox-bash:local, built from BUSYBOX [/bin/busybox] and BASH_STATIC [/bin/bash-static]], NODE_NAME [node-1], NODE_STATE_DIR [/tmp/gpu-dra-node],
#   KUBE_BIN_DIR, REALK8S [../shared/realk8s], KUBELET_PLUGINS_DIR, CDI_ROOT.
# 04 needs DRAExtendedResource=true in the API server, scheduler and controller manager and in the kubelet:
#
#   G=DynamicResourceAllocation=true,DRADeviceTaints=true,DRAPartitionableDevices=true,DRAAdminAccess=true,DRAPrioritizedList=true
#   FEATURE_GATES=$G,DRAExtendedResource=true ../shared/realk8s/up.sh /tmp/k8s
#   KUBELET_FEATURE_GATES=DRAExtendedResource=true ../shared/realk8s/node/up-node.sh /tmp/k8s/admin.kubeconfig
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig NVIDIA_CD_CRD=/tmp/nvidia/resource.nvidia.com_computedomains.yaml \
#     NVIDIA_IMEX_DEMO_DIR=/tmp/nvidia/imex e2e/real-node-compute-domain-nvidia.sh
#   (as root, from the project root, with no plugin running or installed on the node)
#
# Each check prints `ok` or `FAIL`; a pod that does not run prints what the cluster said (describe, events,
# the plugin's and controller's logs); the exit status is 1 on any failure. It stops at once where node-1
# reports DiskPressure (or another pressure): that kubelet evicts every pod it is given (its default
# imagefs.available<15% is met on a host disk that is more than 85% full).
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
: "${NVIDIA_CD_CRD:?set NVIDIA_CD_CRD to NVIDIA's resource.nvidia.com_computedomains.yaml}"
: "${NVIDIA_IMEX_DEMO_DIR:?set NVIDIA_IMEX_DEMO_DIR to the folder of NVIDIA's channel-injection*.yaml}"
export KUBECONFIG
KUBECONFIG=$(readlink -f "$KUBECONFIG")
cd "$(dirname "$0")/.."
REALK8S=${REALK8S:-../shared/realk8s}
BIN=${GPU_DRA_BIN:-target/release/gpu-dra}
BIN_DIR=${KUBE_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/bin}
STATE=${NODE_STATE_DIR:-/tmp/gpu-dra-node}
NODE=${NODE_NAME:-node-1}
BASH_STATIC=${BASH_STATIC:-/bin/bash-static}
TEST_IMAGE=${TEST_IMAGE:-localhost/busybox-bash:local}
DRIVER=gpu.nvidia.com
NS=cd-nvidia
DAEMONS=gpu-dra
PLUGINS=${KUBELET_PLUGINS_DIR:-/var/lib/kubelet/plugins}
CDI=${CDI_ROOT:-/var/run/cdi}
HERE=e2e/real-node-compute-domain-nvidia
failures=0
ok() { echo "ok    $*"; }
bad() { echo "FAIL  $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
wait_until() { local t=$1; shift; local end=$((SECONDS + t)); until "$@"; do [ $SECONDS -lt $end ] || return 1; sleep 1; done; }
indent() { sed 's/^/      /'; }
quiet() { "$@" >/dev/null 2>&1; }

for f in "$NVIDIA_CD_CRD" "$NVIDIA_IMEX_DEMO_DIR/channel-injection.yaml" "$NVIDIA_IMEX_DEMO_DIR/channel-injection-all.yaml"; do
  [ -f "$f" ] || { echo "${0##*/}: no $f" >&2; exit 1; }
done
"$BIN" fake imex-ctl --help >/dev/null 2>&1 ||
  { echo "${0##*/}: $BIN has no IMEX stand-in (the fake backend's daemon needs it); build it with --features doubles" >&2; exit 1; }
if [ -e "$STATE/pids/gpu-dra.pid" ] && kill -0 "$(cat "$STATE/pids/gpu-dra.pid")" 2>/dev/null; then
  echo "${0##*/}: a plugin runs already (pid $(cat "$STATE/pids/gpu-dra.pid")): stop it first" >&2; exit 1
fi
if kubectl get daemonset -n gpu-dra gpu-dra-plugin >/dev/null 2>&1; then
  echo "${0##*/}: gpu-dra is installed already: kubectl delete -k it first" >&2; exit 1
fi
WORK=$(mktemp -d)
controller_pid=
stop_all() {
  [ -n "$controller_pid" ] && kill "$controller_pid" 2>/dev/null
  local pid; pid=$(cat "$STATE/pids/gpu-dra.pid" 2>/dev/null) && [ -n "$pid" ] && kill "$pid" 2>/dev/null
  rm -f "$STATE/pids/gpu-dra-controller.pid"
  rm -rf "$WORK"
}
trap stop_all EXIT

# What the cluster says about a pod that did not run, and the plugin's last words.
diagnose() { # pod
  echo "      --- kubectl describe pod -n $NS $1 (tail)"
  kubectl describe pod -n $NS "$1" 2>&1 | tail -25 | indent
  echo "      --- events in $NS"
  kubectl get events -n $NS --sort-by=.lastTimestamp 2>&1 | tail -15 | indent
  echo "      --- pods in $DAEMONS"
  kubectl get pods -n $DAEMONS -o wide 2>&1 | indent
  echo "      --- plugin log (errors and warnings, last 20)"
  grep -E 'ERROR|WARN' "$STATE/logs/gpu-dra.log" 2>/dev/null | tail -20 | indent
  echo "      --- controller log (last 10)"
  tail -10 "$STATE/logs/gpu-dra-controller.log" 2>/dev/null | indent
}
pod_running() { [ "$(kubectl get pod -n $NS "$1" -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ]; }
run_pod() { # pod: Running within 120 s, else diagnose
  if wait_until 120 pod_running "$1"; then return 0; fi
  diagnose "$1"; return 1
}
logs_of() { kubectl logs -n $NS "$1" 2>/dev/null; }
cd_jp() { kubectl get computedomains.resource.nvidia.com -n $NS "$1" -o jsonpath="$2" 2>/dev/null; }
node_entry() { cd_jp "$1" "{range .status.nodes[?(@.name==\"$NODE\")]}{.name} {.ipAddress} {.cliqueID} {.index} {.status}{end}"; }
domain_ready() { [ "$(cd_jp "$1" '{.status.status}')" = Ready ] && [ -n "$(node_entry "$1")" ]; }
no_entry() { [ -z "$(node_entry "$1")" ]; }
daemon_pods() { kubectl get pods -n $DAEMONS -l app.kubernetes.io/component=imex-daemon --field-selector "spec.nodeName=$NODE" -o name 2>/dev/null; }
daemon_running() { # domain uid
  [ "$(kubectl get pod -n $DAEMONS "gpu-dra-imex-$1-$NODE" -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ]
}
no_daemon() { [ -z "$(daemon_pods)" ]; }
claim_of() { # pod, claim name in the pod -> the ResourceClaim's name
  kubectl get pod -n $NS "$1" -o jsonpath="{.status.resourceClaimStatuses[?(@.name==\"$2\")].resourceClaimName}" 2>/dev/null
}
results_of() { # claim -> driver pool device, one line per device
  kubectl get resourceclaim -n $NS "$1" -o jsonpath='{range .status.allocation.devices.results[*]}{.driver} {.pool} {.device}{"\n"}{end}' 2>/dev/null
}
template_gone() { ! kubectl get resourceclaimtemplate -n $NS "$1" >/dev/null 2>&1; }
placement_gone() { ! kubectl get computedomainplacements.gpu.dra.dev "$1" >/dev/null 2>&1; }
pod_gone() { ! kubectl get pod -n $NS "$1" >/dev/null 2>&1; }

# NVIDIA's file as applied here: every image TEST_IMAGE; bash -> sh where TEST_IMAGE has no bash.
transform() { # in out
  local e=(-e "s#^\([[:space:]]*image:[[:space:]]*\).*#\1$TEST_IMAGE#")
  [ "$HAS_BASH" = 1 ] || e+=(-e 's#^\([[:space:]]*command:[[:space:]]*\[\)"bash",#\1"sh",#')
  sed "${e[@]}" "$1" > "$2"
  echo "      applied with these run-time substitutions (diff -u NVIDIA's file, what was applied):"
  diff -u "$1" "$2" | tail -n +3 | grep '^[-+]' | indent
}
# The ComputeDomain of one of NVIDIA's demo files, with the checks 02 and 03 share.
# args: case file domain pod claim-name template channels...
channel_case() {
  local file=$1 domain=$2 pod=$3 claim_name=$4 template=$5; shift 5
  transform "$NVIDIA_IMEX_DEMO_DIR/$file" "$WORK/$file"
  check "no other line of $file changed than its image and shell" \
    test "$(diff "$NVIDIA_IMEX_DEMO_DIR/$file" "$WORK/$file" | grep -c '^>')" -le 2
  kubectl apply -n $NS -f "$WORK/$file" >/dev/null || { bad "kubectl apply -f $file"; return; }
  check "$pod Running" run_pod "$pod"
  local log; log=$(logs_of "$pod")
  if [ "$(echo "$log" | wc -l)" -le 8 ]; then
    echo "      $pod's log:"; echo "$log" | indent
  else
    echo "      $pod's log: $(echo "$log" | wc -l) lines; the first five and the last two (ls sorts by name):"
    { echo "$log" | head -5; echo "..."; echo "$log" | tail -2; } | indent
  fi
  for c in "$@"; do
    check "its log lists $c as a character device" \
      bash -c "grep -qE '^c.* $c\$' <<<'$(echo "$log" | grep -E " $c\$")'"
  done
  local count; count=$(echo "$log" | grep -cE ' channel[0-9]+$')
  local expect=1; [ "$#" -gt 1 ] && expect=2048
  check "$count channel device(s) listed ($expect: $( [ $expect = 1 ] && echo 'one channel' || echo 'allocationMode All, channel0 … channel2047'))" test "$count" = $expect
  local uid; uid=$(cd_jp "$domain" '{.metadata.uid}')
  check "the ComputeDomain $domain Ready with $NODE's entry" wait_until 60 domain_ready "$domain"
  echo "      status.status=$(cd_jp "$domain" '{.status.status}'); $NODE's entry (name ipAddress cliqueID index status): $(node_entry "$domain")"
  echo "      placement: $(kubectl get computedomainplacements.gpu.dra.dev "$uid" --no-headers 2>&1)"
  echo "      template $template: $(kubectl get resourceclaimtemplate -n $NS "$template" -o jsonpath='{.spec.spec.devices.requests[0].exactly.deviceClassName} {.spec.spec.devices.requests[0].exactly.allocationMode} {.spec.spec.devices.requests[0].exactly.selectors[0].cel.expression}' 2>&1)"
  local claim; claim=$(claim_of "$pod" "$claim_name")
  local got; got=$(results_of "$claim")
  echo "      claim $claim allocated: $got"
  check "the channel claim has imex-channel-0 of $DRIVER on $NODE" test "$got" = "$DRIVER $NODE imex-channel-0"
  check "$NODE's IMEX daemon Pod (gpu-dra-imex-$uid-$NODE) Running" daemon_running "$uid"
  kubectl get pods -n $DAEMONS -l app.kubernetes.io/component=imex-daemon -o wide 2>&1 | indent
  kubectl delete pod -n $NS "$pod" --wait=true --timeout=90s >/dev/null 2>&1
  check "the pod deleted" pod_gone "$pod"
  check "then $NODE's IMEX daemon Pod goes" wait_until 90 no_daemon
  check "and $NODE's entry is removed from the domain's status.nodes" wait_until 60 no_entry "$domain"
  echo "      status.nodes now: $(cd_jp "$domain" '{.status.nodes}')"
  kubectl delete -n $NS -f "$WORK/$file" --wait=true --timeout=60s >/dev/null 2>&1
  check "the domain deleted: its template $template goes" wait_until 60 template_gone "$template"
  check "and its placement" wait_until 60 placement_gone "$uid"
}

echo "----- install (plugin and controller as processes)"
# A node under DiskPressure evicts every pod it is given (the kubelet's default imagefs.available<15%).
pressure=$(kubectl get node "$NODE" -o jsonpath='{range .status.conditions[?(@.status=="True")]}{.type} {end}')
if [ "$pressure" != "Ready " ]; then
  bad "$NODE Ready, without DiskPressure, MemoryPressure or PIDPressure (true: $pressure): its kubelet would evict every pod"
  exit 1
fi
ok "$NODE Ready, without DiskPressure, MemoryPressure or PIDPressure"
rm -rf /var/lib/gpu-dra "${PLUGINS:?}/$DRIVER"
rm -f "$CDI"/k8s.$DRIVER-*.json
e2e/image.sh "$BIN" gpu-dra:dev "$WORK/gpu-dra-image.tar" >/dev/null || { bad "image built from $BIN"; exit 1; }
"$BIN_DIR/ctr" -n k8s.io images import "$WORK/gpu-dra-image.tar" >/dev/null 2>&1
"$BIN_DIR/ctr" -n k8s.io images ls -q 2>/dev/null | grep -qx localhost/busybox:local ||
  "$BIN_DIR/ctr" -n k8s.io images import --local "${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/images/busybox.tar" >/dev/null 2>&1
check "image gpu-dra:dev imported into containerd (the IMEX daemon Pod's)" \
  bash -c "'$BIN_DIR/ctr' -n k8s.io images ls -q 2>/dev/null | grep -qx 'docker.io/library/gpu-dra:dev'"
# NVIDIA's demo pods run `bash -c`, and the node's busybox has no bash: the default TEST_IMAGE is that busybox
# with Debian's statically linked bash (BASH_STATIC, package bash-static) as /bin/bash, built here, so that
# only the image of NVIDIA's files changes. Without BASH_STATIC, busybox and `sh -c` instead (said below).
if [ "$TEST_IMAGE" = localhost/busybox-bash:local ] &&
  ! "$BIN_DIR/ctr" -n k8s.io images ls -q 2>/dev/null | grep -qx "$TEST_IMAGE"; then
  busybox=${BUSYBOX:-/bin/busybox}
  if [ -x "$BASH_STATIC" ] && [ -x "$busybox" ]; then
    R=$WORK/busybox-bash
    mkdir -p "$R"/{bin,sbin,usr/bin,usr/sbin,etc,dev,proc,sys,tmp}
    chmod 1777 "$R/tmp"
    cp "$busybox" "$R/bin/busybox"
    for p in $("$busybox" --list-full); do
      [ "$p" = bin/busybox ] && continue
      mkdir -p "$R/$(dirname "$p")"; ln -sf /bin/busybox "$R/$p"
    done
    cp "$BASH_STATIC" "$R/bin/bash"
    echo 'root:x:0:0:root:/root:/bin/sh' > "$R/etc/passwd"
    echo 'root:x:0:' > "$R/etc/group"
    python3 "$REALK8S/node/images/mkimage.py" "$TEST_IMAGE" "$R" "$WORK/busybox-bash.tar" null '["sh"]' >/dev/null &&
      "$BIN_DIR/ctr" -n k8s.io images import --local "$WORK/busybox-bash.tar" >/dev/null 2>&1
    check "image $TEST_IMAGE (busybox and $BASH_STATIC as /bin/bash) imported" \
      bash -c "'$BIN_DIR/ctr' -n k8s.io images ls -q 2>/dev/null | grep -qx '$TEST_IMAGE'"
  else
    echo "      no $BASH_STATIC (apt-get install bash-static) or $busybox: TEST_IMAGE is localhost/busybox:local"
    TEST_IMAGE=localhost/busybox:local
  fi
fi
# Whether TEST_IMAGE has bash: its root file system mounted read-only through containerd.
mnt=$WORK/rootfs; mkdir -p "$mnt"; HAS_BASH=
if "$BIN_DIR/ctr" -n k8s.io images mount "$TEST_IMAGE" "$mnt" >/dev/null 2>&1; then
  { [ -e "$mnt/bin/bash" ] || [ -L "$mnt/bin/bash" ] || [ -e "$mnt/usr/bin/bash" ] || [ -L "$mnt/usr/bin/bash" ]; } &&
    HAS_BASH=1 || HAS_BASH=0
  "$BIN_DIR/ctr" -n k8s.io images unmount --rm "$mnt" >/dev/null 2>&1
fi
case $HAS_BASH in
  1) echo "      $TEST_IMAGE has bash: NVIDIA's command stays bash -c" ;;
  0) echo "      $TEST_IMAGE has no bash (no /bin/bash, /usr/bin/bash): NVIDIA's command bash -c runs as sh -c" ;;
  *) HAS_BASH=0; echo "      could not look into $TEST_IMAGE; assuming no bash: NVIDIA's command bash -c runs as sh -c" ;;
esac
check "NVIDIA's CRD applied: $(sha256sum "$NVIDIA_CD_CRD" | cut -c1-16)… $(basename "$NVIDIA_CD_CRD")" \
  quiet kubectl apply -f "$NVIDIA_CD_CRD"
check "computedomains.resource.nvidia.com Established" \
  quiet kubectl wait --for=condition=Established crd/computedomains.resource.nvidia.com --timeout=30s
check "crd/ (ours) has no resource.nvidia.com CRD" bash -c "! grep -qE '^  group: resource.nvidia.com' crd/*.yaml"
check "crd/ applied (placements, ComputeDomains of gpu.dra.dev, GpuNodePolicies)" quiet kubectl apply -f crd/
kubectl wait --for=condition=Established crd/computedomainplacements.gpu.dra.dev --timeout=30s >/dev/null 2>&1
kubectl kustomize e2e/real-node-nvidia-compat > "$WORK/compat.yaml" 2>/dev/null
python3 - "$WORK/compat.yaml" > "$WORK/classes.yaml" <<'EOF'
import sys, yaml
print(yaml.safe_dump_all([d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get("kind") == "DeviceClass"]))
EOF
check "the nvidia-compat component's DeviceClasses applied" quiet kubectl apply -f "$WORK/classes.yaml"
kubectl get deviceclasses -o custom-columns='NAME:.metadata.name,SELECTOR:.spec.selectors[0].cel.expression,EXTENDED:.spec.extendedResourceName' | indent
check "the channel class imex-channel.gpu.dra.dev selects $DRIVER's channels" bash -c \
  "kubectl get deviceclass imex-channel.gpu.dra.dev -o jsonpath='{.spec.selectors[0].cel.expression}' | grep -q 'device.driver == \"$DRIVER\"'"
for ns in $NS $DAEMONS; do kubectl get namespace "$ns" >/dev/null 2>&1 || kubectl create namespace "$ns" >/dev/null; done
ip=$(kubectl get node "$NODE" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')
DRIVER_NAME=$DRIVER GPU_DRA_BIN=$BIN NODE_NAME=$NODE "$REALK8S/node/start-plugin.sh" "$KUBECONFIG" "$STATE" \
  --fake-profile gb200-nvl72 --mps-daemon-image gpu-dra:dev --node-ip "$ip" >/dev/null ||
  { bad "plugin started as $DRIVER"; exit 1; }
ok "plugin started as $DRIVER (pid $(cat "$STATE/pids/gpu-dra.pid"); --fake-profile gb200-nvl72 --mps-daemon-image gpu-dra:dev --node-ip $ip)"
nohup "$BIN" controller --driver-name $DRIVER --kubeconfig "$KUBECONFIG" --leader-elect=false \
  > "$STATE/logs/gpu-dra-controller.log" 2>&1 < /dev/null &
controller_pid=$!; echo $controller_pid > "$STATE/pids/gpu-dra-controller.pid"
sleep 2
check "controller runs as a process: gpu-dra controller --driver-name $DRIVER (pid $controller_pid)" kill -0 $controller_pid
channel_published() {
  kubectl get resourceslices --field-selector "spec.driver=$DRIVER,spec.nodeName=$NODE" \
    -o jsonpath='{range .items[*].spec.devices[*]}{.name}={.attributes.type.string}{"\n"}{end}' 2>/dev/null |
    grep -qx 'imex-channel-0=imex-channel'
}
check "$NODE publishes imex-channel-0 (type imex-channel) as $DRIVER" wait_until 60 channel_published
devs=$(kubectl get resourceslices --field-selector "spec.driver=$DRIVER,spec.nodeName=$NODE" \
  -o jsonpath='{range .items[*].spec.devices[*]}{.name} type={.attributes.type.string} nvlinkDomain={.attributes.nvlinkDomain.string}{"\n"}{end}')
echo "$devs" | indent
check "and none of gpu.dra.dev" test -z "$(kubectl get resourceslices --field-selector spec.driver=gpu.dra.dev,spec.nodeName=$NODE -o name)"

echo "----- 02 NVIDIA's channel-injection.yaml"
channel_case channel-injection.yaml imex-channel-injection imex-channel-injection imex-channel-0 imex-channel-0 channel0

echo "----- 03 NVIDIA's channel-injection-all.yaml (allocationMode All)"
channel_case channel-injection-all.yaml imex-channel-injection-all imex-channel-injection-all imex-channels \
  tpl-imex-channels channel0 channel222 channel2047

echo "----- 04 a worker shaped like NVIDIA's nvbandwidth worker: nvidia.com/gpu: 2 and the domain's channel"
w=nvbandwidth-worker-0; domain=nvbandwidth-worker-domain
kubectl apply -n $NS -f $HERE/nvbandwidth-worker.yaml >/dev/null || bad "kubectl apply -f $HERE/nvbandwidth-worker.yaml"
check "$w Running" run_pod $w
log=$(logs_of $w)
echo "      $w's log:"; echo "$log" | indent
check "its log lists channel0 as a character device" bash -c "grep -qE '^c.* channel0\$' <<<'$log'"
ext=$(kubectl get pod -n $NS $w -o jsonpath='{.status.extendedResourceClaimStatus.resourceClaimName}' 2>/dev/null)
gpus=$(results_of "$ext")
echo "      the scheduler's claim for nvidia.com/gpu: ${ext:-none}; allocated:"; echo "$gpus" | indent
check "it holds two whole GPUs of $DRIVER on $NODE" \
  test "$(echo "$gpus" | grep -cE "^$DRIVER $NODE gpu-[0-9]+\$")" = 2 -a "$(echo "$gpus" | grep -c .)" = 2
# GPU_DRA_DEVICE_<device> of every device the container got: its two GPUs and its channel.
seen=$(echo "$log" | sed -n 's/^GPU_DRA_DEVICE_\([^=]*\)=.*/\1/p' | tr 'A-Z_' 'a-z-' | sort)
want=$(echo "$gpus" | cut -d' ' -f3 | sort | tr '\n' ' ')
check "the container sees those two GPUs, and no other GPU (GPU_DRA_DEVICE_*: $(echo $seen))" \
  test -n "$want" -a "$(echo "$seen" | grep -E '^gpu-[0-9]+$' | tr '\n' ' ')" = "$want"
check "and the channel device imex-channel-0 (GPU_DRA_DEVICE_IMEX_CHANNEL_0)" test "$(echo "$seen" | grep -c '^imex-channel-0$')" = 1
check "and two GPU device nodes /dev/nvidiaN ($(echo "$log" | grep -E '^nvidia[0-9]+$' | tr '\n' ' '))" \
  test "$(echo "$log" | grep -cE '^nvidia[0-9]+$')" = 2
channel=$(claim_of $w compute-domain-channel)
check "its channel claim has imex-channel-0 of $DRIVER on $NODE" test "$(results_of "$channel")" = "$DRIVER $NODE imex-channel-0"
uid=$(cd_jp $domain '{.metadata.uid}')
check "the ComputeDomain $domain Ready with $NODE's entry ($(node_entry $domain))" wait_until 60 domain_ready $domain
check "$NODE's IMEX daemon Pod Running" daemon_running "$uid"
kubectl delete pod -n $NS $w --wait=true --timeout=90s >/dev/null 2>&1
check "the worker deleted: $NODE's IMEX daemon Pod goes" wait_until 90 no_daemon
check "and $NODE's entry is removed" wait_until 60 no_entry $domain
ext_gone() { ! kubectl get resourceclaim -n $NS "$ext" >/dev/null 2>&1; }
check "and the scheduler's GPU claim is deleted" wait_until 60 ext_gone
kubectl delete -n $NS -f $HERE/nvbandwidth-worker.yaml --wait=true --timeout=60s >/dev/null 2>&1
check "the domain deleted: its template goes" wait_until 60 template_gone nvbandwidth-worker-domain-channel

echo "----- after"
unprepared() { [ "$(ls "$CDI" 2>/dev/null | grep -c "^k8s.$DRIVER-")" = 0 ]; }
check "every claim unprepared: no CDI spec of $DRIVER left" wait_until 30 unprepared
check "no IMEX daemon Pod left" no_daemon
kubectl delete namespace $NS --wait=true --timeout=60s >/dev/null 2>&1
echo "      plugin log: $STATE/logs/gpu-dra.log; controller log: $STATE/logs/gpu-dra-controller.log (stopped now)"
echo "failures: $failures"
[ "$failures" = 0 ]
