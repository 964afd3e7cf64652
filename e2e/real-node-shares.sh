#!/usr/bin/env bash
# Consumable shares on the real node of ../shared/realk8s/node (kubelet + containerd + the real scheduler),
# with NVIDIA's own examples demo/specs/consumable-shares/{memory,integer,unlimited}-sharing.yaml, taken by
# path at run time (nothing of NVIDIA's is kept in this repository), on a fake node of one H100 (81559Mi):
#   install: TEST_IMAGE (busybox, Debian's static bash as /bin/bash, and a stand-in `nvidia-smi -L` that lists
#      the devices the container was given, from GPU_DRA_DEVICE_*), the image gpu-dra:dev (MPS daemon Pods),
#      crd/, NVIDIA's DeviceClasses (the nvidia-compat component's) and ours (deploy/base).
#   compat-memory, compat-unlimited, compat-4: the plugin as gpu.nvidia.com with --consumable-shares memory,
#      unlimited and 4, as the examples' comments say. Each: gpu-0 published with allowMultipleAllocations and
#      NVIDIA's capacity shapes; NVIDIA's file applied with only its image changed (the diff is printed); all
#      replicas Running, every claim allocated gpu-0 with a shareID of its own and the consumedCapacity the
#      mode gives (memory 4Gi; memory 0 and shares 1; memory 0); each pod's log lists gpu-0's UUID (the
#      stand-in nvidia-smi) and NVIDIA's echo line. Then one share too many stays Pending with the scheduler's
#      reason: a claim of 76Gi beside the two 4Gi shares (memory), a fifth replica (4).
#   own-memory, own-count, own-unlimited: the same claims written for our class gpu.dra.dev (NVIDIA's files
#      with gpu.nvidia.com -> gpu.dra.dev), under a GpuNodePolicy with spec.sharing.shares: Memory (enforcement
#      MPS: GPU_DRA_SHARING=MPS, one daemon Pod per claim), Count 4 (enforcement TimeSlicing Long:
#      GPU_DRA_SHARING=TimeSlicing/Long; the fifth replica Pending), Unlimited (enforcement None).
#   own-mig: migMode dynamic, shares Count 2 on MigDevices: two pods with a claim for the 7g.80gb MIG device
#      Running on the one MIG device, a third Pending; one pod deleted: the device stays (plugin log: no
#      destroy); both deleted: the device is destroyed once.
#   after each case: no CDI spec, MPS directory or daemon Pod left.
# Needs DRAConsumableCapacity=true (and for own-mig DRAPartitionableDevices=true) in the API server,
# scheduler and controller manager (FEATURE_GATES of up.sh) and in the kubelet (KUBELET_FEATURE_GATES of
# up-node.sh), and a binary with the fake MPS stand-in (cargo build --features doubles):
#
#   G=DynamicResourceAllocation=true,DRADeviceTaints=true,DRAPartitionableDevices=true,DRAAdminAccess=true,DRAPrioritizedList=true
#   FEATURE_GATES=$G,DRAConsumableCapacity=true ../shared/realk8s/up.sh /tmp/k8s
#   KUBELET_FEATURE_GATES=DRAConsumableCapacity=true ../shared/realk8s/node/up-node.sh /tmp/k8s/admin.kubeconfig
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig NVIDIA_SHARES_DIR=/tmp/nvidia/consumable-shares \
#     GPU_DRA_BIN=target/debug/gpu-dra e2e/real-node-shares.sh
#   (as root, from the project root, with no plugin running or installed on the node; NVIDIA_SHARES_DIR holds
#   NVIDIA's memory-sharing.yaml, integer-sharing.yaml and unlimited-sharing.yaml)
#
# Settings (env): TEST_IMAGE [localhost/busybox-bash-smi:local, built from BUSYBOX [/bin/busybox] and
#   BASH_STATIC [/bin/bash-static]], NODE_NAME [node-1], NODE_STATE_DIR [/tmp/gpu-dra-node], KUBE_BIN_DIR,
#   REALK8S [../shared/realk8s], KUBELET_PLUGINS_DIR, CDI_ROOT, CASES [all: the cases to run, by name].
# Each check prints `ok` or `FAIL`; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
: "${NVIDIA_SHARES_DIR:?set NVIDIA_SHARES_DIR to the folder of the NVIDIA examples *-sharing.yaml}"
export KUBECONFIG
KUBECONFIG=$(readlink -f "$KUBECONFIG")
cd "$(dirname "$0")/.."
REALK8S=${REALK8S:-../shared/realk8s}
BIN=${GPU_DRA_BIN:-target/release/gpu-dra}
BIN_DIR=${KUBE_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/bin}
STATE=${NODE_STATE_DIR:-/tmp/gpu-dra-node}
NODE=${NODE_NAME:-node-1}
BASH_STATIC=${BASH_STATIC:-/bin/bash-static}
TEST_IMAGE=${TEST_IMAGE:-localhost/busybox-bash-smi:local}
PLUGINS=${KUBELET_PLUGINS_DIR:-/var/lib/kubelet/plugins}
CDI=${CDI_ROOT:-/var/run/cdi}
CASES=${CASES:-compat-memory compat-unlimited compat-4 own-memory own-count own-unlimited own-mig}
failures=0
ok() { echo "ok    $*"; }
bad() { echo "FAIL  $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
wait_until() { local t=$1; shift; local end=$((SECONDS + t)); until "$@"; do [ $SECONDS -lt $end ] || return 1; sleep 1; done; }
indent() { sed 's/^/      /'; }
quiet() { "$@" >/dev/null 2>&1; }

for f in memory integer unlimited; do
  [ -f "$NVIDIA_SHARES_DIR/$f-sharing.yaml" ] || { echo "${0##*/}: no $NVIDIA_SHARES_DIR/$f-sharing.yaml" >&2; exit 1; }
done
grep -q "(stand-in)" <<<"$("$BIN" fake mps-control-daemon --help 2>&1)" ||
  { echo "${0##*/}: $BIN has no MPS stand-in (own-memory needs it); build it with --features doubles" >&2; exit 1; }
if [ -e "$STATE/pids/gpu-dra.pid" ] && kill -0 "$(cat "$STATE/pids/gpu-dra.pid")" 2>/dev/null; then
  echo "${0##*/}: a plugin runs already (pid $(cat "$STATE/pids/gpu-dra.pid")): stop it first" >&2; exit 1
fi
if kubectl get daemonset -n gpu-dra gpu-dra-plugin >/dev/null 2>&1; then
  echo "${0##*/}: gpu-dra is installed already: kubectl delete -k it first" >&2; exit 1
fi
WORK=$(mktemp -d)
stop_plugin() {
  local pid; pid=$(cat "$STATE/pids/gpu-dra.pid" 2>/dev/null) || return 0
  [ -n "$pid" ] && kill "$pid" 2>/dev/null
  wait_until 30 bash -c "! kill -0 $pid 2>/dev/null"
  rm -f "$STATE/pids/gpu-dra.pid"
}
# The DeviceClasses it applies go with it, so that a later script finds the classes its own install makes.
remove_classes() {
  [ -f "$WORK/classes.yaml" ] && kubectl delete --ignore-not-found -f "$WORK/classes.yaml" >/dev/null 2>&1
  kubectl delete --ignore-not-found -f deploy/base/deviceclasses.yaml >/dev/null 2>&1
}
trap 'stop_plugin; remove_classes; rm -rf "$WORK"' EXIT

DRIVER=
NS=
slices_json() { kubectl get resourceslices --field-selector "spec.driver=$DRIVER" -o json 2>/dev/null; }
# A device of the slices, as JSON: its capacities and allowMultipleAllocations (and its UUID, which a
# dynamic MIG device has only once made).
device_json() { # name
  slices_json | python3 -c "
import json, sys
for s in json.load(sys.stdin)['items']:
    for d in s['spec'].get('devices') or []:
        if d['name'] == sys.argv[1]:
            print(json.dumps({'multiple': d.get('allowMultipleAllocations', False), 'capacity': d.get('capacity', {}),
                              'uuid': next(iter(d['attributes'].get('uuid', {}).values()), None)}, sort_keys=True))" "$1"
}
field() { python3 -c "import json, sys; v = json.loads(sys.argv[1]); print(eval(sys.argv[2], {}, {'d': v}))" "$1" "$2" 2>/dev/null; }
shared_published() { [ "$(field "$(device_json "$1")" "d['multiple']")" = True ]; }
pod_names() { kubectl get pods -n $NS -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' 2>/dev/null; }
running() { [ "$(kubectl get pods -n $NS --field-selector status.phase=Running -o name 2>/dev/null | wc -l)" -ge "$1" ]; }
# A claim made from a template is named in the pod's status, one named by the pod in its spec.
claims_of_pods() {
  kubectl get pods -n $NS -o jsonpath='{range .items[*]}{.status.resourceClaimStatuses[0].resourceClaimName}{.spec.resourceClaims[0].resourceClaimName}{"\n"}{end}' 2>/dev/null | grep .
}
# One line per claim: device, consumedCapacity (JSON), shareID.
results() {
  for c in $(claims_of_pods); do
    kubectl get resourceclaim -n $NS "$c" -o jsonpath='{range .status.allocation.devices.results[*]}{.device} {.consumedCapacity} {.shareID}{"\n"}{end}' 2>/dev/null
  done
}
diagnose() {
  echo "      --- pods in $NS"; kubectl get pods -n $NS -o wide 2>&1 | indent
  echo "      --- events in $NS (last 10)"; kubectl get events -n $NS --sort-by=.lastTimestamp 2>&1 | tail -10 | indent
  echo "      --- plugin log (errors and warnings, last 10)"
  grep -E 'ERROR|WARN' "$STATE/logs/gpu-dra.log" 2>/dev/null | tail -10 | indent
}
# NVIDIA's file as applied here: the image TEST_IMAGE; for our own name the class gpu.dra.dev and the
# namespace with an `own-` prefix.
transform() { # in out own(0|1)
  local e=(-e "s#^\([[:space:]]*image:[[:space:]]*\).*#\1$TEST_IMAGE#")
  [ "$3" = 1 ] && e+=(-e 's#deviceClassName: gpu.nvidia.com#deviceClassName: gpu.dra.dev#' -e 's#\(namespace: \|name: \)gpu-share-#\1own-gpu-share-#')
  sed "${e[@]}" "$1" > "$2"
  echo "      applied with these run-time substitutions (diff -u NVIDIA's file, what was applied):"
  diff -u "$1" "$2" | tail -n +3 | grep '^[-+]' | indent
}
# The pod that stays Pending, and the scheduler's reason for it.
pending_with_reason() { # pod
  local cond; cond=$(kubectl get pod -n $NS "$1" -o jsonpath='{.status.conditions[?(@.type=="PodScheduled")].reason}: {.status.conditions[?(@.type=="PodScheduled")].message}' 2>/dev/null)
  [ "$(kubectl get pod -n $NS "$1" -o jsonpath='{.status.phase}' 2>/dev/null)" = Pending ] &&
    grep -q '^Unschedulable: .*claim' <<<"$cond" && echo "      $1: $cond"
}
start_plugin() { # driver, extra flags...
  local driver=$1; shift
  rm -rf "${PLUGINS:?}/$driver" /var/lib/gpu-dra
  rm -f "$CDI"/k8s."$driver"-*.json
  mkdir -p /var/lib/gpu-dra && cat /proc/sys/kernel/random/boot_id > /var/lib/gpu-dra/boot_id
  DRIVER_NAME=$driver GPU_DRA_BIN=$BIN NODE_NAME=$NODE "$REALK8S/node/start-plugin.sh" "$KUBECONFIG" "$STATE" \
    --fake-profile "$WORK/one-h100.yaml" --mps-daemon-image gpu-dra:dev "$@" >/dev/null
}
clean_namespace() {
  kubectl delete namespace $NS --wait=true --timeout=120s >/dev/null 2>&1
  # The next case starts from no claim at all: its replicas must not meet this case's terminating ones.
  gone() { ! kubectl get namespace $NS >/dev/null 2>&1 && [ -z "$(kubectl get resourceclaims -A -o name 2>/dev/null)" ]; }
  check "namespace $NS and every claim gone" wait_until 300 gone
  unprepared() { [ "$(ls "$CDI" 2>/dev/null | grep -c "^k8s.$DRIVER-")" = 0 ]; }
  check "every claim unprepared: no CDI spec of $DRIVER left" wait_until 60 unprepared
  no_daemons() { [ "$(kubectl get pods -n gpu-dra -o name 2>/dev/null | grep -c /gpu-dra-mps-)" = 0 ] &&
    [ "$(ls -A "$PLUGINS/$DRIVER/mps" 2>/dev/null | wc -l)" = 0 ]; }
  check "no MPS daemon Pod or directory left" wait_until 60 no_daemons
}

# The checks every example shares: file, expected consumedCapacity of each share, GPU_DRA_SHARING (or -).
example() { # file replicas consumed sharing own
  local file=$1 replicas=$2 consumed=$3 sharing=$4 own=$5
  transform "$NVIDIA_SHARES_DIR/$file" "$WORK/$file" "$own"
  check "no other line of $file changed than its image$([ "$own" = 1 ] && echo ', class and namespace')" \
    test "$(diff "$NVIDIA_SHARES_DIR/$file" "$WORK/$file" | grep -c '^>')" -le "$([ "$own" = 1 ] && echo 6 || echo 1)"
  NS=$(sed -n 's/^  name: \(.*gpu-share-.*\)/\1/p' "$WORK/$file" | head -1)
  kubectl apply -f "$WORK/$file" >/dev/null || { bad "kubectl apply -f $file"; return 1; }
  if ! check "$replicas replicas Running" wait_until 180 running "$replicas"; then diagnose; return 1; fi
  local got; got=$(results)
  echo "$got" | sed 's/^/      allocated (device, consumedCapacity, shareID): /'
  check "$replicas claims, all on gpu-0" test "$(echo "$got" | grep -c '^gpu-0 ')" = "$replicas"
  check "each with a shareID of its own" test "$(echo "$got" | awk '{print $3}' | sort -u | grep -c .)" = "$replicas"
  check "each consuming $consumed" test "$(echo "$got" | awk -v c="$consumed" '$2 == c' | wc -l)" = "$replicas"
  local uuid; uuid=$(field "$(device_json gpu-0)" "d['uuid']")
  local listed=0 echoed=0 shared=0
  for p in $(pod_names); do
    local log; log=$(kubectl logs -n $NS "$p" 2>/dev/null)
    grep -q "^GPU 0: .*(UUID: $uuid)" <<<"$log" && listed=$((listed + 1))
    grep -q "^running with" <<<"$log" && echoed=$((echoed + 1))
    if [ "$sharing" != - ]; then
      [ "$(kubectl exec -n $NS "$p" -- env 2>/dev/null | sed -n 's/^GPU_DRA_SHARING=//p')" = "$sharing" ] && shared=$((shared + 1))
    fi
  done
  echo "      one pod's log:"; kubectl logs -n $NS "$(pod_names | head -1)" 2>/dev/null | head -3 | indent
  check "every pod's nvidia-smi -L lists gpu-0 ($uuid)" test "$listed" = "$replicas"
  check "every pod printed NVIDIA's echo line" test "$echoed" = "$replicas"
  [ "$sharing" = - ] || check "every pod has GPU_DRA_SHARING=$sharing" test "$shared" = "$replicas"
}
shape() { # what, python expression over d (the device JSON) that must print True
  check "$1" test "$(field "$(device_json gpu-0)" "$2")" = True
}

echo "----- install"
pressure=$(kubectl get node "$NODE" -o jsonpath='{range .status.conditions[?(@.status=="True")]}{.type} {end}')
[ "$pressure" = "Ready " ] || { bad "$NODE Ready without pressure (true: $pressure)"; exit 1; }
"$BIN" fake show dgx-h100 > "$WORK/h100.yaml" || exit 1
python3 - "$WORK/h100.yaml" > "$WORK/one-h100.yaml" <<'PY'
import sys, yaml
profile = yaml.safe_load(open(sys.argv[1]))
profile["name"] = "one-h100"
profile["gpus"] = profile["gpus"][:1]
print(yaml.safe_dump(profile))
PY
check "a fake profile of one H100" test "$(grep -c 'productName' "$WORK/one-h100.yaml")" = 1
e2e/image.sh "$BIN" gpu-dra:dev "$WORK/gpu-dra-image.tar" >/dev/null || { bad "image built from $BIN"; exit 1; }
"$BIN_DIR/ctr" -n k8s.io images import "$WORK/gpu-dra-image.tar" >/dev/null 2>&1
check "image gpu-dra:dev imported (the MPS daemon Pods')" \
  bash -c "'$BIN_DIR/ctr' -n k8s.io images ls -q 2>/dev/null | grep -qx 'docker.io/library/gpu-dra:dev'"
# NVIDIA's pods run `bash -c "nvidia-smi -L; ..."` in ubuntu:22.04; a node without a registry gets busybox
# with Debian's static bash and a stand-in nvidia-smi that lists what the container was given.
if ! "$BIN_DIR/ctr" -n k8s.io images ls -q 2>/dev/null | grep -qx "$TEST_IMAGE"; then
  busybox=${BUSYBOX:-/bin/busybox}
  [ -x "$BASH_STATIC" ] && [ -x "$busybox" ] ||
    { bad "$BASH_STATIC (apt-get install bash-static) and $busybox to build $TEST_IMAGE"; exit 1; }
  R=$WORK/image
  mkdir -p "$R"/{bin,sbin,usr/bin,usr/sbin,etc,dev,proc,sys,tmp}
  chmod 1777 "$R/tmp"
  cp "$busybox" "$R/bin/busybox"
  for p in $("$busybox" --list-full); do
    [ "$p" = bin/busybox ] && continue
    mkdir -p "$R/$(dirname "$p")"; ln -sf /bin/busybox "$R/$p"
  done
  cp "$BASH_STATIC" "$R/bin/bash"
  cat > "$R/usr/bin/nvidia-smi" <<'SMI'
#!/bin/sh
# nvidia-smi stand-in: `-L` lists the devices this container was given (GPU_DRA_DEVICE_<name>=<UUID>) in
# nvidia-smi's form; anything else is refused.
[ "$1" = -L ] || { echo "nvidia-smi stand-in: only -L" >&2; exit 2; }
env | sort | sed -n 's/^GPU_DRA_DEVICE_\([^=]*\)=\(.*\)$/\1 \2/p' | {
  i=0
  while read -r name uuid; do echo "GPU $i: $name (UUID: $uuid)"; i=$((i + 1)); done
}
SMI
  chmod 755 "$R/usr/bin/nvidia-smi"
  echo 'root:x:0:0:root:/root:/bin/sh' > "$R/etc/passwd"
  echo 'root:x:0:' > "$R/etc/group"
  python3 "$REALK8S/node/images/mkimage.py" "$TEST_IMAGE" "$R" "$WORK/test-image.tar" null '["sh"]' >/dev/null &&
    "$BIN_DIR/ctr" -n k8s.io images import --local "$WORK/test-image.tar" >/dev/null 2>&1
fi
check "image $TEST_IMAGE imported" bash -c "'$BIN_DIR/ctr' -n k8s.io images ls -q 2>/dev/null | grep -qx '$TEST_IMAGE'"
check "crd/ applied" quiet kubectl apply -f crd/
kubectl kustomize e2e/real-node-nvidia-compat > "$WORK/compat.yaml" 2>/dev/null
python3 - "$WORK/compat.yaml" > "$WORK/classes.yaml" <<'PY'
import sys, yaml
print(yaml.safe_dump_all([d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get("kind") == "DeviceClass"]))
PY
check "NVIDIA's DeviceClasses (nvidia-compat) and ours (deploy/base) applied" \
  bash -c "kubectl apply -f '$WORK/classes.yaml' >/dev/null && kubectl apply -f deploy/base/deviceclasses.yaml >/dev/null"
kubectl get namespace gpu-dra >/dev/null 2>&1 || kubectl create namespace gpu-dra >/dev/null

compat_case() { # flag file replicas consumed
  local flag=$1
  DRIVER=gpu.nvidia.com
  echo "----- compat-$flag: NVIDIA's $2 under --driver-name gpu.nvidia.com --consumable-shares $flag"
  start_plugin gpu.nvidia.com --consumable-shares "$flag" || { bad "plugin started"; return; }
  check "gpu-0 published with allowMultipleAllocations" wait_until 60 shared_published gpu-0
  device_json gpu-0 | python3 -c "import json,sys; print(json.dumps(json.load(sys.stdin)['capacity']))" | indent
  case $flag in
    memory) shape "memory: default and max 81559Mi, min and step 1Mi (NVIDIA's shape)" \
      "d['capacity']['memory']['requestPolicy'] == {'default': '81559Mi', 'validRange': {'min': '1Mi', 'max': '81559Mi', 'step': '1Mi'}}" ;;
    unlimited) shape "memory: default 0, min 0, step 1Mi, max 81559Mi; no shares (NVIDIA's shape)" \
      "d['capacity']['memory']['requestPolicy'] == {'default': '0', 'validRange': {'min': '0', 'max': '81559Mi', 'step': '1Mi'}} and 'shares' not in d['capacity']" ;;
    *) shape "shares: $flag, default, min and step 1, max $flag (NVIDIA's shape)" \
      "d['capacity']['shares'] == {'value': '$flag', 'requestPolicy': {'default': '1', 'validRange': {'min': '1', 'max': '$flag', 'step': '1'}}}" ;;
  esac
  example "$2" "$3" "$4" - 0
}

too_many_replicas() { # deployment, replicas
  kubectl scale -n $NS deployment "$1" --replicas "$2" >/dev/null
  local pending
  find_pending() {
    pending=$(kubectl get pods -n $NS --field-selector status.phase=Pending -o jsonpath='{.items[0].metadata.name}' 2>/dev/null)
    [ -n "$pending" ] && pending_with_reason "$pending"
  }
  check "replica $2 stays Pending with the scheduler's reason" wait_until 60 find_pending
  check "while $(($2 - 1)) run" running $(($2 - 1))
}

a_big_claim() { # class, memory: a pod whose claim asks for that much
  cat <<EOF | kubectl apply -f - >/dev/null
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {namespace: $NS, name: too-big}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {deviceClassName: $1, capacity: {requests: {memory: $2}}}
---
apiVersion: v1
kind: Pod
metadata: {namespace: $NS, name: too-big}
spec:
  resourceClaims: [{name: gpu, resourceClaimName: too-big}]
  containers:
  - {name: ctr, image: $TEST_IMAGE, command: ["sleep", "3600"], resources: {claims: [{name: gpu}]}}
EOF
  check "a claim of $2 beside them stays Pending with the scheduler's reason" wait_until 60 pending_with_reason too-big
}

for c in $CASES; do
  case $c in
    compat-memory)
      compat_case memory memory-sharing.yaml 2 '{"memory":"4Gi"}'
      a_big_claim gpu.nvidia.com 76Gi
      clean_namespace; stop_plugin ;;
    compat-unlimited)
      compat_case unlimited unlimited-sharing.yaml 2 '{"memory":"0"}'
      kubectl scale -n $NS deployment unlimited-sharing --replicas 8 >/dev/null
      check "8 replicas Running on gpu-0" wait_until 120 running 8
      clean_namespace; stop_plugin ;;
    compat-4)
      compat_case 4 integer-sharing.yaml 4 '{"memory":"0","shares":"1"}'
      too_many_replicas integer-sharing 5
      clean_namespace; stop_plugin ;;
    own-memory|own-count|own-unlimited|own-mig)
      DRIVER=gpu.dra.dev
      case $c in
        own-memory) shares='{mode: Memory, memory: {minimum: 1Gi}, enforcement: MPS}'; mig=none ;;
        own-count) shares='{mode: Count, count: 4, enforcement: TimeSlicing, interval: Long}'; mig=none ;;
        own-unlimited) shares='{mode: Unlimited, enforcement: None}'; mig=none ;;
        own-mig) shares='{mode: Count, count: 2, devices: [MigDevices], enforcement: None}'; mig=dynamic ;;
      esac
      echo "----- $c: GpuNodePolicy spec.sharing.shares $shares (migMode $mig)"
      cat <<EOF | kubectl apply -f - >/dev/null
apiVersion: gpu.dra.dev/v1alpha1
kind: GpuNodePolicy
metadata: {name: e2e-shares}
spec: {migMode: $mig, sharing: {shares: $shares}}
EOF
      accepted() { [ "$(kubectl get gpunodepolicy e2e-shares -o jsonpath='{.status.conditions[?(@.type=="Accepted")].status}')" = True ]; }
      start_plugin gpu.dra.dev || { bad "plugin started"; continue; }
      check "the policy Accepted" wait_until 30 accepted
      case $c in
        own-memory)
          check "gpu-0 published with allowMultipleAllocations" wait_until 60 shared_published gpu-0
          shape "memory: default and min 1Gi, step 1Gi" \
            "d['capacity']['memory']['requestPolicy'] == {'default': '1Gi', 'validRange': {'min': '1Gi', 'step': '1Gi'}}"
          example memory-sharing.yaml 2 '{"memory":"4Gi"}' MPS 1
          daemons=$(kubectl get pods -n gpu-dra -o name | grep -c /gpu-dra-mps-)
          check "one MPS daemon Pod per claim ($daemons)" test "$daemons" = 2
          a_big_claim gpu.dra.dev 76Gi ;;
        own-count)
          check "gpu-0 published with allowMultipleAllocations" wait_until 60 shared_published gpu-0
          shape "shares: 4" "d['capacity']['shares']['value'] == '4'"
          example integer-sharing.yaml 4 '{"memory":"0","shares":"1"}' TimeSlicing/Long 1
          too_many_replicas integer-sharing 5 ;;
        own-unlimited)
          check "gpu-0 published with allowMultipleAllocations" wait_until 60 shared_published gpu-0
          example unlimited-sharing.yaml 2 '{"memory":"0"}' Exclusive 1 ;;
        own-mig)
          mig7_name() { slices_json | python3 -c "
import json, sys
print(next(d['name'] for s in json.load(sys.stdin)['items'] for d in s['spec'].get('devices') or [] if '-mig-7g80gb-' in d['name']))" 2>/dev/null; }
          # The plugin publishes the dynamic MIG devices once it has read the policy: wait for them.
          wait_until 60 eval '[ -n "$(mig7_name)" ]'
          mig7=$(slices_json | python3 -c "
import json, sys
print(next(d['name'] for s in json.load(sys.stdin)['items'] for d in s['spec'].get('devices') or [] if '-mig-7g80gb-' in d['name']))" 2>/dev/null)
          check "the 7g.80gb MIG device ($mig7) published with allowMultipleAllocations" wait_until 60 shared_published "$mig7"
          NS=own-mig-shares
          kubectl create namespace $NS >/dev/null 2>&1
          for i in 0 1 2; do
            cat <<EOF | kubectl apply -f - >/dev/null
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {namespace: $NS, name: mig-$i}
spec:
  devices:
    requests:
    - name: mig
      exactly:
        deviceClassName: mig.gpu.dra.dev
        selectors: [{cel: {expression: 'device.attributes["gpu.dra.dev"].profile == "7g.80gb"'}}]
---
apiVersion: v1
kind: Pod
metadata: {namespace: $NS, name: mig-$i}
spec:
  resourceClaims: [{name: mig, resourceClaimName: mig-$i}]
  containers:
  - {name: ctr, image: $TEST_IMAGE, command: ["bash", "-c", "nvidia-smi -L; sleep 3600"], resources: {claims: [{name: mig}]}}
EOF
            [ $i = 1 ] && { check "two pods Running" wait_until 120 running 2 || diagnose; }
          done
          got=$(results)
          echo "$got" | sed 's/^/      allocated (device, consumedCapacity, shareID): /'
          check "both Running pods' claims share $mig7" test "$(echo "$got" | grep -c "^$mig7 ")" = 2
          check "the third pod stays Pending with the scheduler's reason" wait_until 60 pending_with_reason mig-2
          made=$(grep -c 'MIG device created' "$STATE/logs/gpu-dra.log")
          check "the MIG device was made once ($made)" test "$made" = 1
          kubectl delete pod -n $NS mig-2 --wait=true >/dev/null 2>&1
          kubectl delete pod -n $NS mig-0 --wait=true --timeout=90s >/dev/null 2>&1
          sleep 5
          check "one pod deleted: the device stays (no destroy in the plugin's log)" \
            test "$(grep -c 'MIG device destroyed' "$STATE/logs/gpu-dra.log")" = 0
          kubectl delete pod -n $NS mig-1 --wait=true --timeout=90s >/dev/null 2>&1
          destroyed() { [ "$(grep -c 'MIG device destroyed' "$STATE/logs/gpu-dra.log")" = 1 ]; }
          check "both deleted: the device is destroyed once" wait_until 60 destroyed ;;
      esac
      clean_namespace
      kubectl delete gpunodepolicy e2e-shares --wait=true >/dev/null 2>&1
      stop_plugin ;;
    *) bad "unknown case $c" ;;
  esac
done
echo "failures: $failures"
exit "$failures"
