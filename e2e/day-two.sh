#!/usr/bin/env bash
# Day two on the real node of ../shared/realk8s/node, with gpu-dra installed by e2e/real-node-install.sh
# (the DaemonSet of deploy/overlays/fake from an image, on the host network). One step per argument, in
# this order when none is given:
#   upgrade          a new image while pods hold a whole GPU, a dynamic MIG device, a time-sliced GPU and
#                    an MPS claim: they keep running, nothing is lost or leaked, no slice is rewritten,
#                    and each unprepares after it
#   burst            20 pods at once, the plugin's container killed while they prepare: all end Running
#                    with their device; deleting them leaves nothing behind
#   burst-mps        4 MPS and 4 MIG pods at once, the plugin's container killed (SIGKILL) while they
#                    prepare: all end Running with their device, one daemon Pod and one tmpfs per MPS
#                    claim; deleting them leaves no Pod, mount, directory, spec, MIG device or entry
#   mig-stuck        a MIG create that never returns on one GPU (the fake profile's migHangs): its claim
#                    fails within the bound (before the kubelet's 45 s), naming the GPU and the create;
#                    a MIG claim on another GPU is prepared meanwhile; once the create returns the stuck
#                    claim is prepared on the kubelet's retry; nothing is left after
#   kubelet-restart  the plugin is registered again without a restart of its own; pods keep their
#                    devices; a new pod gets one
#   probes           a registration socket removed under the plugin: /healthz fails, the kubelet's
#                    liveness probe restarts it; with slice creates refused by a policy, /readyz and the
#                    Pod stay not ready until it can publish
#   reboot           kubelet, containerd and the plugin stopped, /var/run/cdi emptied, the MPS tmpfs gone,
#                    a new boot id (the BOOT_ID_FILE of e2e/real-node), all started again: the pods the
#                    kubelet restarts get their devices (their MIG device made again), nothing stale left
#   reboot-mps       the same reboot with eight MPS claims held: the plugin recovers them (eight daemon
#                    Pods started again) and its container is never restarted for being slow (no probe
#                    kills it); every pod gets its device again
#   uninstall        kubectl delete -k: the kubelet wipes the slices 30 s later, running pods keep their
#                    devices and CDI specs; a reinstall unprepares them when they go; then a full uninstall
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/day-two.sh [STEP...]      (as root, from the project root)
#
# Each check prints PASS or FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
cd "$(dirname "$0")/.."
REALK8S=${REALK8S:-../shared/realk8s}
STATE=${NODE_STATE_DIR:-/tmp/gpu-dra-node}
NODE=${NODE_NAME:-node-1}
N=gpu-dra-day-two
PLUGIN_DIR=/var/lib/kubelet/plugins/gpu.dra.dev
REG_SOCKET=/var/lib/kubelet/plugins_registry/gpu.dra.dev-reg.sock
CHECKPOINT=$PLUGIN_DIR/checkpoint.json
FAKE_STATE=/var/lib/gpu-dra/fake-state.json
BOOT_ID=/var/lib/gpu-dra/boot_id
CDI=/var/run/cdi
HTTP=http://127.0.0.1:8080
SEL=app.kubernetes.io/component=kubelet-plugin
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
h() { echo "----- $*"; }
waitfor() { local deadline=$((SECONDS + $1)); shift; until "$@"; do [ $SECONDS -lt $deadline ] || return 1; sleep 1; done; }

# What the node holds for the driver.
specs() { (cd $CDI && ls k8s.gpu.dra.dev-gpu_*.json 2>/dev/null | sed 's/^k8s.gpu.dra.dev-gpu_//; s/\.json$//' | sort); }
spec_sums() { (cd $CDI && md5sum k8s.gpu.dra.dev-gpu_*.json 2>/dev/null | sort); }
checkpointed() { jq -r '.data.claims // {} | keys[]' $CHECKPOINT 2>/dev/null | sort; }
fake_migs() { jq -r '[.created // {} | .[][] | .uuid] | .[]' $FAKE_STATE 2>/dev/null | sort; }
# The MPS claims' tmpfs mounts and directories under the plugin's directory.
mps_mounts() { awk '$5 ~ "^/var/lib/kubelet/plugins/gpu.dra.dev/mps/" {print $5}' /proc/self/mountinfo | sort -u; }
mps_dirs() { ls -A $PLUGIN_DIR/mps 2>/dev/null | sort; }
mps_pods() { kubectl get pods -n gpu-dra -o name 2>/dev/null | grep 'gpu-dra-mps-' | sort; }
mps_pod_uids() { kubectl get pods -n gpu-dra -o jsonpath='{range .items[*]}{.metadata.name}/{.metadata.uid}{"\n"}{end}' | grep '^gpu-dra-mps-' | sort; }
slice_versions() { kubectl get resourceslices --field-selector "spec.driver=gpu.dra.dev,spec.nodeName=$NODE" -o jsonpath='{range .items[*]}{.metadata.name}={.metadata.resourceVersion}{"\n"}{end}' | sort; }
slice_count() { slice_versions | grep -c .; }
nothing_for_the_driver() { [ -z "$(specs)" ] && [ -z "$(checkpointed)" ] && [ -z "$(fake_migs)" ] && [ -z "$(mps_pods)" ] && [ -z "$(mps_mounts)" ] && [ -z "$(mps_dirs)" ]; }
leftovers() { echo "specs: $(specs | wc -l), checkpointed: $(checkpointed | wc -l), fake MIG devices: $(fake_migs | wc -l), MPS daemon Pods: $(mps_pods | wc -l), MPS mounts: $(mps_mounts | wc -l), MPS directories: $(mps_dirs | wc -l)"; }
# The plugin.
plugin_pod() { kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].metadata.name}' 2>/dev/null; }
plugin_identity() { kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].metadata.uid}/{.items[0].status.containerStatuses[0].restartCount}' 2>/dev/null; }
plugin_restarts() { kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].status.containerStatuses[0].restartCount}' 2>/dev/null; }
plugin_ready() { kubectl wait -n gpu-dra --for=condition=Ready pod -l $SEL --timeout="${1:-120}s" >/dev/null 2>&1; }
registrations() { grep -c "\"Registered DRA plugin\".*driverName=\"gpu.dra.dev\"" "$STATE/logs/kubelet.log"; }
# The container's PID 1 (the reaper of src/plugin/reaper.rs) seen from the host.
plugin_pid1() {
  local pid
  for pid in $(pgrep -f '^gpu-dra plugin'); do
    [ "$(awk '/^NSpid:/ {print $NF}' /proc/$pid/status 2>/dev/null)" = 1 ] && { echo "$pid"; return; }
  done
}
# Workloads.
phase() { kubectl get pod -n $N "$1" -o jsonpath='{.status.phase}' 2>/dev/null; }
restarts() { kubectl get pod -n $N "$1" -o jsonpath='{.status.containerStatuses[0].restartCount}' 2>/dev/null; }
claim_uid() { kubectl get resourceclaim -n $N "$1" -o jsonpath='{.metadata.uid}' 2>/dev/null; }
pod_claim_uid() { claim_uid "$(kubectl get pod -n $N "$1" -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}' 2>/dev/null)"; }
has_device() { kubectl logs -n $N "$1" 2>/dev/null | grep -q '^GPU_DRA_DEVICE_'; }
busybox_pod() { # name, claim source (resourceClaimName: x | resourceClaimTemplateName: x)
  cat <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $1
  namespace: $N
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: c
      image: localhost/busybox:local
      imagePullPolicy: Never
      command: ["sh", "-c", "env | grep ^GPU_DRA_ | sort; sleep 3600"]
      resources: {claims: [{name: gpu}]}
  resourceClaims:
    - name: gpu
      $2
---
EOF
}
claim() { # name, class, extra spec lines under the request / config (already indented)
  cat <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: $1
  namespace: $N
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: $2
$3
---
EOF
}
MIG_SELECTOR="          selectors: [{cel: {expression: \"device.attributes['gpu.dra.dev'].profile == '1g.10gb'\"}}]"
sharing() { # strategy, its config
  printf '    config:\n      - opaque:\n          driver: gpu.dra.dev\n          parameters:\n            apiVersion: gpu.dra.dev/v1alpha1\n            kind: GpuConfig\n            sharing:\n              strategy: %s\n              %s\n' "$1" "$2"
}
one_mig_template() {
  cat <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: one-mig
  namespace: $N
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: mig.gpu.dra.dev
            selectors: [{cel: {expression: "device.attributes['gpu.dra.dev'].profile == '1g.10gb'"}}]
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: one-gpu
  namespace: $N
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly: {deviceClassName: gpu.dra.dev}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: one-mps
  namespace: $N
spec:
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
              sharing: {strategy: MPS, mpsConfig: {defaultActiveThreadPercentage: 50}}
---
EOF
}
fresh_namespace() {
  kubectl delete namespace $N --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1
  kubectl create namespace $N >/dev/null
  one_mig_template | kubectl apply -f - >/dev/null
}
delete_all_and_check_clean() { # what
  kubectl delete pods -n $N --all --wait=true --timeout=120s >/dev/null 2>&1
  kubectl delete resourceclaims -n $N --all --wait=true --timeout=60s >/dev/null 2>&1
  waitfor 90 nothing_for_the_driver
  check "$1: after deleting them nothing is left ($(leftovers))" nothing_for_the_driver
}

step_upgrade() {
  h "upgrade: a new image while pods hold a whole GPU, a dynamic MIG device, a time-sliced GPU and an MPS claim"
  fresh_namespace
  {
    claim whole gpu.dra.dev ""
    claim mig mig.gpu.dra.dev "$MIG_SELECTOR"
    claim time-sliced gpu.dra.dev "$(sharing TimeSlicing 'timeSlicingConfig: {interval: Long}')"
    claim mps gpu.dra.dev "$(sharing MPS 'mpsConfig: {defaultActiveThreadPercentage: 40}')"
    for c in whole mig time-sliced mps; do busybox_pod "$c" "resourceClaimName: $c"; done
  } | kubectl apply -f - >/dev/null
  kubectl wait -n $N --for=condition=Ready pod --all --timeout=120s >/dev/null 2>&1
  kubectl get pods -n $N -o wide
  for c in whole mig time-sliced mps; do
    check "$c: Running with its device" bash -c "[ '$(phase $c)' = Running ] && kubectl logs -n $N $c | grep -q ^GPU_DRA_DEVICE_"
  done
  local before_specs before_ckpt before_migs before_mps before_slices before_pods
  before_specs=$(spec_sums); before_ckpt=$(checkpointed); before_migs=$(fake_migs); before_mps=$(mps_pod_uids)
  before_slices=$(slice_versions)
  before_pods=$(kubectl get pods -n $N -o jsonpath='{range .items[*]}{.metadata.name}/{.metadata.uid}/{.status.containerStatuses[0].restartCount}{"\n"}{end}')
  echo "before: $(leftovers), slices: $(slice_count)"
  local old; old=$(plugin_pod)
  kubectl set image -n gpu-dra daemonset/gpu-dra-plugin plugin=gpu-dra:dev2 >/dev/null
  kubectl rollout status -n gpu-dra daemonset/gpu-dra-plugin --timeout=180s >/dev/null
  plugin_ready
  check "plugin Pod replaced ($old -> $(plugin_pod)), image gpu-dra:dev2, Ready" bash -c \
    "[ '$(plugin_pod)' != '$old' ] && kubectl get pod -n gpu-dra $(plugin_pod) -o jsonpath='{.spec.containers[0].image}' | grep -q ':dev2$'"
  sleep 15 # three rescans of the new plugin
  echo "after:  $(leftovers), slices: $(slice_count)"
  check "the pods kept running, no container restarted" test "$(kubectl get pods -n $N -o jsonpath='{range .items[*]}{.metadata.name}/{.metadata.uid}/{.status.containerStatuses[0].restartCount}{"\n"}{end}')" = "$before_pods"
  check "every CDI spec is there, unchanged" test "$(spec_sums)" = "$before_specs"
  check "every checkpoint entry is there" test "$(checkpointed)" = "$before_ckpt"
  check "the MIG device is there, the only one" test "$(fake_migs)" = "$before_migs"
  check "the MPS daemon Pod is the same Pod" test "$(mps_pod_uids)" = "$before_mps"
  check "no slice rewritten (resourceVersions unchanged)" test "$(slice_versions)" = "$before_slices"
  check "pods still use their devices" bash -c "kubectl exec -n $N mps -- ls /dev/shm/cuda.shm.mps-stand-in >/dev/null && kubectl exec -n $N mig -- sh -c 'ls /dev/nvidia-caps/' | grep -q nvidia-cap"
  local c uid
  for c in whole mig time-sliced mps; do
    uid=$(claim_uid $c)
    kubectl delete pod -n $N $c --wait=true --timeout=60s >/dev/null
    waitfor 30 bash -c "! ls $CDI/k8s.gpu.dra.dev-gpu_$uid.json >/dev/null 2>&1"
    check "$c: unprepared after the upgrade (CDI spec removed, kubelet: NodeUnprepareResources ok)" bash -c \
      "! ls $CDI/k8s.gpu.dra.dev-gpu_$uid.json >/dev/null 2>&1 && grep -qE 'Done calling NodeUnprepareResources rpc.*$uid.*err=null' $STATE/logs/kubelet.log"
  done
  delete_all_and_check_clean "upgrade"
}

step_burst() {
  h "crash mid-burst: 20 pods at once, the plugin's container killed while they prepare"
  fresh_namespace
  local before; before=$(plugin_restarts)
  for i in $(seq -w 1 20); do busybox_pod "burst-$i" "resourceClaimTemplateName: one-mig"; done | kubectl apply -f - >/dev/null
  local deadline=$((SECONDS + 60)) prepared=0
  while [ $SECONDS -lt $deadline ]; do
    prepared=$(specs | wc -l)
    [ "$prepared" -ge 1 ] && break
    sleep 0.1
  done
  local pid; pid=$(plugin_pid1)
  kill -9 "$pid"
  echo "killed the plugin's container (PID 1 on the host: $pid) with $prepared of 20 claims prepared"
  check "the kill landed mid-burst ($prepared of 20 prepared)" test "$prepared" -ge 1 -a "$prepared" -lt 20
  waitfor 60 bash -c "[ \"\$(kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].status.containerStatuses[0].restartCount}')\" -gt $before ]"
  check "the kubelet restarted the plugin's container" test "$(plugin_restarts)" -gt "$before"
  kubectl wait -n $N --for=condition=Ready pod --all --timeout=300s >/dev/null 2>&1
  local running with_device
  running=$(kubectl get pods -n $N --field-selector=status.phase=Running -o name | wc -l)
  with_device=0
  for i in $(seq -w 1 20); do
    if waitfor 10 has_device "burst-$i"; then with_device=$((with_device + 1)); else
      echo "burst-$i has no device: $(kubectl logs -n $N "burst-$i" 2>&1 | head -3 | tr '\n' ' ')"
    fi
  done
  check "all 20 pods Running ($running)" test "$running" = 20
  check "all 20 with their device ($with_device)" test "$with_device" = 20
  echo "$(leftovers)"
  check "20 MIG devices made, one per claim, none leaked ($(fake_migs | wc -l))" test "$(fake_migs | wc -l)" = 20
  check "20 claims prepared and checkpointed" bash -c "[ $(specs | wc -l) = 20 ] && [ $(checkpointed | wc -l) = 20 ]"
  delete_all_and_check_clean "burst"
}

# What a reboot does to the node, acted out: kubelet, containerd and every container stopped, the tmpfs
# gone (/var/run/cdi, the MPS claims' /dev/shm), a new boot id, the node started again. Returns once the
# kubelet reports the plugin's container of the new boot (until then the Pod's status, Ready included,
# is the old boot's); REBOOTED_AT is when the node was down.
reboot_node() { # name of the up-node log
  local old_boot; old_boot=$(cat $BOOT_ID)
  "$REALK8S/node/down-node.sh" "$STATE"
  rm -f $CDI/*
  for m in $(awk '$5 ~ "^/var/lib/kubelet/plugins/gpu.dra.dev/" {print $5}' /proc/self/mountinfo); do umount "$m"; done
  cat /proc/sys/kernel/random/uuid > $BOOT_ID
  REBOOTED_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  echo "stopped; /var/run/cdi emptied, the MPS tmpfs unmounted; boot id $old_boot -> $(cat $BOOT_ID); starting the node again"
  "$REALK8S/node/up-node.sh" "$KUBECONFIG" "$STATE" > "$STATE/logs/up-node-$1.log" 2>&1 || tail -5 "$STATE/logs/up-node-$1.log"
  waitfor 180 bash -c "[[ \"\$(kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].status.containerStatuses[0].state.running.startedAt}')\" > '$REBOOTED_AT' ]]"
}

step_burst_mps() {
  h "crash mid-burst of MPS and MIG claims: 4 MPS and 4 MIG pods at once, the plugin's container killed while they prepare"
  fresh_namespace
  local before; before=$(plugin_restarts)
  local i
  for i in 1 2 3 4; do
    busybox_pod "mps-$i" "resourceClaimTemplateName: one-mps"
    busybox_pod "mig-$i" "resourceClaimTemplateName: one-mig"
  done | kubectl apply -f - >/dev/null
  # Killed once the first MPS daemon Pod exists: its claim is between its tmpfs, its Pod and its spec.
  local deadline=$((SECONDS + 60))
  while [ $SECONDS -lt $deadline ] && [ -z "$(mps_pods)" ]; do sleep 0.1; done
  local prepared; prepared=$(specs | wc -l)
  local pid; pid=$(plugin_pid1)
  kill -9 "$pid"
  echo "killed the plugin's container (PID 1 on the host: $pid) with $prepared of 8 claims prepared, $(mps_pods | wc -l) MPS daemon Pods, $(mps_mounts | wc -l) MPS mounts"
  check "the kill landed mid-burst ($prepared of 8 prepared)" test "$prepared" -lt 8
  waitfor 60 bash -c "[ \"\$(kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].status.containerStatuses[0].restartCount}')\" -gt $before ]"
  check "the kubelet restarted the plugin's container" test "$(plugin_restarts)" -gt "$before"
  kubectl wait -n $N --for=condition=Ready pod --all --timeout=300s >/dev/null 2>&1
  local with_device=0 p
  for p in mps-1 mps-2 mps-3 mps-4 mig-1 mig-2 mig-3 mig-4; do
    if waitfor 10 has_device "$p"; then with_device=$((with_device + 1)); else
      echo "$p has no device: $(kubectl describe pod -n $N "$p" | tail -3 | tr '\n' ' ')"
    fi
  done
  check "all 8 pods Running with their device ($with_device)" test "$with_device" = 8
  echo "$(leftovers)"
  local mps_claims; mps_claims=$(for p in mps-1 mps-2 mps-3 mps-4; do pod_claim_uid $p; echo; done | sort)
  echo "MPS claims: $(echo $mps_claims); daemon Pods: $(mps_pods | tr '\n' ' '); mounts: $(mps_mounts | tr '\n' ' ')"
  check "one MPS daemon Pod per MPS claim, and no other" test "$(mps_pods)" = "$(for u in $mps_claims; do echo "pod/gpu-dra-mps-$u"; done | sort)"
  check "one tmpfs and one directory per MPS claim, and no other" bash -c \
    "[ '$(mps_mounts | xargs -rn1 dirname | xargs -rn1 basename | sort | tr '\n' ' ')' = '$(echo $mps_claims | tr ' ' '\n' | sort | tr '\n' ' ')' ] && [ '$(mps_dirs | tr '\n' ' ')' = '$(echo $mps_claims | tr ' ' '\n' | sort | tr '\n' ' ')' ]"
  check "4 MIG devices, one per MIG claim, none leaked ($(fake_migs | wc -l))" test "$(fake_migs | wc -l)" = 4
  check "8 claims prepared and checkpointed" bash -c "[ $(specs | wc -l) = 8 ] && [ $(checkpointed | wc -l) = 8 ]"
  delete_all_and_check_clean "burst of MPS and MIG claims"
}

# The fake profile's GPU 0 with or without `migHangs` (the ConfigMap of deploy/overlays/fake); returns
# once the kubelet refreshed the file mounted in the plugin's Pod.
set_mig_hangs() { # true|false
  local profile mounted
  profile=$(kubectl get configmap -n gpu-dra gpu-dra-fake-profile -o jsonpath='{.data.profile\.yaml}' |
    python3 -c 'import sys, yaml; p = yaml.safe_load(sys.stdin); p["gpus"][0]["migHangs"] = sys.argv[1] == "true"; print(yaml.safe_dump(p, sort_keys=False))' "$1")
  kubectl create configmap -n gpu-dra gpu-dra-fake-profile --from-literal=profile.yaml="$profile" --dry-run=client -o yaml |
    kubectl label --local -f - app.kubernetes.io/name=gpu-dra -o yaml | kubectl apply -f - >/dev/null
  mounted=/var/lib/kubelet/pods/$(kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].metadata.uid}')/volumes/kubernetes.io~configmap/fake-profile/profile.yaml
  waitfor 120 grep -q "migHangs: $1" "$mounted"
}
gpu_uuid() { # minor
  kubectl get resourceslices --field-selector "spec.driver=gpu.dra.dev,spec.nodeName=$NODE" -o json |
    jq -r --arg d "gpu-$1" '[.items[].spec.devices // [] | .[] | select(.name == $d) | .attributes.uuid.string] | first'
}
mig_on() { # claim name, parent GPU UUID
  claim "$1" mig.gpu.dra.dev "          selectors: [{cel: {expression: \"device.attributes['gpu.dra.dev'].profile == '1g.10gb' && device.attributes['gpu.dra.dev'].parentUUID == '$2'\"}}]"
}
stuck_gauge() { curl -s $HTTP/metrics | awk '$1 == "gpu_dra_gpu_operation_stuck{gpu=\"gpu-0\"}" {print $2}'; }

step_mig_stuck() {
  h "a MIG create that never returns on gpu-0"
  fresh_namespace
  local gpu0 gpu1; gpu0=$(gpu_uuid 0); gpu1=$(gpu_uuid 1)
  set_mig_hangs true || { bad "the kubelet never refreshed the fake profile"; return; }
  echo "gpu-0 ($gpu0) hangs on MIG operations now"
  local started=$SECONDS said="" took
  { mig_on stuck "$gpu0"; busybox_pod stuck "resourceClaimName: stuck"; } | kubectl apply -f - >/dev/null
  local deadline=$((SECONDS + 60))
  while [ $SECONDS -lt $deadline ]; do
    said=$(kubectl get events -n $N --field-selector involvedObject.name=stuck -o jsonpath='{range .items[*]}{.message}{"\n"}{end}' | grep 'did not return within' | head -1)
    [ -n "$said" ] && break
    sleep 1
  done
  took=$((SECONDS - started))
  echo "kubelet, $took s after the pod: $said"
  check "the stuck claim failed in time ($took s after the pod, under the kubelet's 45 s), naming the GPU and the create" \
    bash -c "[ $took -lt 45 ] && grep -q 'gpu-0: creating MIG device 1g.10gb' <<<'$said'"
  check "gpu_dra_gpu_operation_stuck{gpu=\"gpu-0\"} is 1" test "$(stuck_gauge)" = 1
  { mig_on other "$gpu1"; busybox_pod other "resourceClaimName: other"; } | kubectl apply -f - >/dev/null
  kubectl wait -n $N --for=condition=Ready pod/other --timeout=60s >/dev/null 2>&1
  check "a MIG claim on gpu-1 is prepared meanwhile" bash -c "[ '$(phase other)' = Running ] && kubectl logs -n $N other | grep -q ^GPU_DRA_DEVICE_"
  check "the stuck pod is not Running" test "$(phase stuck)" != Running
  set_mig_hangs false
  kubectl wait -n $N --for=condition=Ready pod/stuck --timeout=180s >/dev/null 2>&1
  check "once the create returned, the kubelet's retry prepared the stuck claim" bash -c "[ '$(phase stuck)' = Running ] && kubectl logs -n $N stuck | grep -q ^GPU_DRA_DEVICE_"
  check "gpu_dra_gpu_operation_stuck{gpu=\"gpu-0\"} is 0" test "$(stuck_gauge)" = 0
  check "two MIG devices, none leaked ($(fake_migs | wc -l))" test "$(fake_migs | wc -l)" = 2
  delete_all_and_check_clean "stuck MIG create"
}

step_reboot_mps() {
  h "node reboot with eight MPS claims held"
  fresh_namespace
  local i
  for i in 1 2 3 4 5 6 7 8; do busybox_pod "mps-$i" "resourceClaimTemplateName: one-mps"; done | kubectl apply -f - >/dev/null
  kubectl wait -n $N --for=condition=Ready pod --all --timeout=180s >/dev/null 2>&1
  check "eight MPS pods Running with their device" test "$(kubectl get pods -n $N --field-selector=status.phase=Running -o name | wc -l)" = 8
  local before_daemons; before_daemons=$(mps_pod_uids)
  echo "before: $(leftovers)"
  reboot_node reboot-mps
  # The kubelet re-created the Pod's sandbox in the new boot, which counts as a restart; what must
  # not follow is a restart by a probe.
  local first; first=$(plugin_restarts)
  local began=$SECONDS
  plugin_ready 300
  echo "plugin Ready $((SECONDS - began)) s after its container started (restart count $first)"
  kubectl wait -n $N --for=condition=Ready pod --all --timeout=300s >/dev/null 2>&1
  sleep 45 # past the liveness probe's window, with the daemons recovered
  kubectl get pods -n $N -o wide
  check "the plugin's container was not restarted during its recovery (restart count $first -> $(plugin_restarts))" test "$(plugin_restarts)" = "$first"
  local probes; probes=$(kubectl get events -n gpu-dra --field-selector "reason=Unhealthy,involvedObject.name=$(plugin_pod)" -o jsonpath='{range .items[*]}{.lastTimestamp} {.message}{"\n"}{end}' | awk -v t="$REBOOTED_AT" '$1 >= t')
  echo "the plugin's probe failures since the reboot (readiness is expected until it recovered):"; echo "${probes:-  none}"
  check "no liveness or startup probe of the plugin failed after the reboot" bash -c "! grep -qE 'Liveness probe|Startup probe' <<<'$probes'"
  local with_device=0
  for i in 1 2 3 4 5 6 7 8; do waitfor 10 has_device "mps-$i" && with_device=$((with_device + 1)); done
  check "all eight pods Running with their device again ($with_device)" test "$with_device" = 8
  local after_daemons; after_daemons=$(mps_pod_uids)
  check "eight MPS daemon Pods, each started again in this boot" bash -c \
    "[ $(mps_pods | wc -l) = 8 ] && [ -z \"\$(comm -12 <(echo '$before_daemons') <(echo '$after_daemons'))\" ]"
  check "eight tmpfs mounted again" test "$(mps_mounts | wc -l)" = 8
  delete_all_and_check_clean "reboot with MPS claims"
}

step_kubelet_restart() {
  h "kubelet restart"
  fresh_namespace
  busybox_pod before "resourceClaimTemplateName: one-gpu" | kubectl apply -f - >/dev/null
  kubectl wait -n $N --for=condition=Ready pod/before --timeout=90s >/dev/null 2>&1
  local plugin regs pid cmdline uid
  plugin=$(plugin_identity); regs=$(registrations); uid=$(pod_claim_uid before)
  pid=$(cat "$STATE/pids/kubelet.pid")
  mapfile -d '' cmdline < "/proc/$pid/cmdline"
  kill "$pid"; waitfor 30 bash -c "! kill -0 $pid 2>/dev/null"
  echo "kubelet (pid $pid) stopped; starting it again"
  nohup "${cmdline[@]}" >> "$STATE/logs/kubelet.log" 2>&1 < /dev/null &
  echo $! > "$STATE/pids/kubelet.pid"
  waitfor 60 bash -c "[ \$(grep -c '\"Registered DRA plugin\".*driverName=\"gpu.dra.dev\"' $STATE/logs/kubelet.log) -gt $regs ]"
  check "the kubelet registered the plugin again" test "$(registrations)" -gt "$regs"
  check "the plugin did not restart ($plugin)" test "$(plugin_identity)" = "$plugin"
  check "the running pod kept its device (Running, no restart, CDI spec there)" bash -c \
    "[ '$(phase before)' = Running ] && [ '$(restarts before)' = 0 ] && [ -e $CDI/k8s.gpu.dra.dev-gpu_$uid.json ]"
  busybox_pod after "resourceClaimTemplateName: one-gpu" | kubectl apply -f - >/dev/null
  kubectl wait -n $N --for=condition=Ready pod/after --timeout=90s >/dev/null 2>&1
  check "a new pod gets a GPU" bash -c "[ '$(phase after)' = Running ] && kubectl logs -n $N after | grep -q ^GPU_DRA_DEVICE_"
  delete_all_and_check_clean "kubelet restart"
}

step_probes() {
  h "probes: the registration socket removed under the plugin"
  plugin_ready
  local before; before=$(plugin_restarts)
  check "/healthz ok" bash -c "curl -sf $HTTP/healthz | grep -qx ok"
  check "/readyz ready" bash -c "curl -sf $HTTP/readyz | grep -qx ready"
  rm -f "$REG_SOCKET"
  waitfor 10 bash -c "[ \"\$(curl -s -o /dev/null -w '%{http_code}' $HTTP/healthz)\" = 503 ]"
  local said; said=$(curl -s $HTTP/healthz)
  echo "/healthz: $said"
  check "/healthz fails and names the socket" grep -q "registration-server stopped (socket $REG_SOCKET was removed)" <<<"$said"
  # The liveness probe (every 30 s, 3 failures) restarts the container; wait until it is Ready again.
  local deadline=$((SECONDS + 180)) pod_now
  while [ $SECONDS -lt $deadline ]; do
    pod_now=$(kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].status.containerStatuses[0].restartCount} {.items[0].status.conditions[?(@.type=="Ready")].status}')
    [ "$pod_now" = "$((before + 1)) True" ] && break
    sleep 0.5
  done
  check "the kubelet's liveness probe restarted the plugin (restarts $before -> $(plugin_restarts))" test "$(plugin_restarts)" -gt "$before"
  check "Event: Liveness probe failed" bash -c "kubectl get events -n gpu-dra --field-selector reason=Unhealthy -o jsonpath='{.items[*].message}' | grep -q 'Liveness probe failed'"
  check "registered again: the socket is back, the Pod Ready" bash -c "[ -S '$REG_SOCKET' ] && [ '$pod_now' = '$((before + 1)) True' ]"

  h "probes: readiness while the plugin cannot publish"
  # A policy that refuses the plugin's slice creates, the driver's slices deleted, the plugin restarted:
  # it serves and registers, but cannot publish, so it must stay not Ready until the policy goes. (Once
  # Ready, a plugin stays Ready through later publish failures: the running one here, whose slices are
  # deleted under it, does; a flip would change nothing for a DaemonSet Pod.)
  kubectl apply -f - >/dev/null <<EOF
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {name: day-two-no-slices}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
      - {apiGroups: [resource.k8s.io], apiVersions: ["*"], operations: [CREATE], resources: [resourceslices]}
  validations:
    - expression: "request.userInfo.username != 'system:serviceaccount:gpu-dra:gpu-dra-plugin'"
      message: "day-two.sh: slice creates refused for the readiness check"
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {name: day-two-no-slices}
spec:
  policyName: day-two-no-slices
  validationActions: [Deny]
EOF
  sleep 3 # the API server loads new policies within a second or so
  kubectl delete resourceslices --field-selector spec.driver=gpu.dra.dev >/dev/null
  sleep 10
  check "the policy holds: the running plugin could not create its slices again in 10 s" test "$(slice_count)" = 0
  kubectl delete pod -n gpu-dra -l $SEL --wait=true >/dev/null
  waitfor 60 bash -c "kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].status.phase}' | grep -q Running"
  sleep 20 # four readiness probes
  local said; said=$(curl -s -m 2 $HTTP/readyz)
  echo "/readyz: $said; Pod Ready: $(kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].status.conditions[?(@.type=="Ready")].status}'); slices: $(slice_count)"
  check "/readyz says the slices are not published (and nothing else is missing)" test "$said" = "not ready: ResourceSlices not published yet"
  check "the Pod is Running but not Ready" test "$(kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].status.conditions[?(@.type=="Ready")].status}')" = False
  kubectl delete validatingadmissionpolicybinding,validatingadmissionpolicy day-two-no-slices >/dev/null
  local samples; samples=$(mktemp); deadline=$((SECONDS + 120))
  while [ $SECONDS -lt $deadline ]; do
    local r; r=$(kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].status.conditions[?(@.type=="Ready")].status}')
    echo "$r $(slice_count)" >> "$samples"
    [ "$r" = True ] && break
    sleep 0.5
  done
  echo "after the policy went (count, Ready, slices): $(sort "$samples" | uniq -c | tr -s ' \n' ' ')"
  check "Ready once it published, never before (no sample Ready with 0 slices)" bash -c \
    "grep -q '^True [1-9]' '$samples' && ! grep -q '^True 0\$' '$samples'"
  rm -f "$samples"
}

step_reboot() {
  h "node reboot"
  fresh_namespace
  {
    busybox_pod whole "resourceClaimTemplateName: one-gpu"
    busybox_pod mig "resourceClaimTemplateName: one-mig"
  } | kubectl apply -f - >/dev/null
  kubectl wait -n $N --for=condition=Ready pod --all --timeout=90s >/dev/null 2>&1
  local whole mig old_mig
  whole=$(pod_claim_uid whole); mig=$(pod_claim_uid mig); old_mig=$(fake_migs)
  echo "before: $(leftovers); MIG device $old_mig"
  reboot_node reboot
  plugin_ready 180
  check "plugin Ready after the reboot" plugin_ready 5
  kubectl wait -n $N --for=condition=Ready pod --all --timeout=240s >/dev/null 2>&1
  kubectl get pods -n $N -o wide
  check "whole: Running with its device again" bash -c "[ '$(phase whole)' = Running ] && kubectl logs -n $N whole | grep -q ^GPU_DRA_DEVICE_"
  check "mig: Running with its device again" bash -c "[ '$(phase mig)' = Running ] && kubectl logs -n $N mig | grep -q ^GPU_DRA_DEVICE_"
  echo "after: $(leftovers); MIG device $(fake_migs)"
  check "their CDI specs written again, and no other" test "$(specs)" = "$(printf '%s\n' "$whole" "$mig" | sort)"
  check "the checkpoint holds these two claims, of this boot" bash -c \
    "[ \"\$(jq -r .data.bootId $CHECKPOINT)\" = '$(cat $BOOT_ID)' ] && [ '$(checkpointed | tr '\n' ' ')' = '$(printf '%s\n' "$whole" "$mig" | sort | tr '\n' ' ')' ]"
  check "one MIG device, made again in this boot (the old one went with the reboot)" bash -c \
    "[ $(fake_migs | wc -l) = 1 ] && [ '$(fake_migs)' != '$old_mig' ]"
  delete_all_and_check_clean "reboot"
}

step_uninstall() {
  h "uninstall: kubectl delete -k while a pod holds a GPU"
  fresh_namespace
  busybox_pod holder "resourceClaimTemplateName: one-gpu" | kubectl apply -f - >/dev/null
  kubectl wait -n $N --for=condition=Ready pod/holder --timeout=90s >/dev/null 2>&1
  local uid; uid=$(pod_claim_uid holder)
  kubectl delete -k e2e/real-node --wait=true --timeout=120s >/dev/null 2>&1
  check "the plugin is gone, its sockets removed" bash -c "[ -z '$(plugin_pod)' ] && [ ! -e $REG_SOCKET ] && [ ! -e $PLUGIN_DIR/dra.sock ]"
  local gone_at=$SECONDS
  check "slices still there right after (the kubelet waits 30 s: an upgrade must not lose them)" test "$(slice_count)" -gt 0
  waitfor 90 bash -c "[ -z \"\$(kubectl get resourceslices --field-selector spec.driver=gpu.dra.dev -o name)\" ]"
  check "no slice of the driver lingers: the kubelet wiped them ($((SECONDS - gone_at)) s after)" test "$(slice_count)" = 0
  check "the running pod keeps its GPU and its CDI spec" bash -c \
    "[ '$(phase holder)' = Running ] && [ '$(restarts holder)' = 0 ] && [ -e $CDI/k8s.gpu.dra.dev-gpu_$uid.json ]"
  check "the checkpoint keeps the prepared claim for a reinstall" grep -q "$uid" <<<"$(checkpointed)"
  h "reinstall, then the pod goes"
  kubectl apply -k e2e/real-node >/dev/null
  plugin_ready 120
  check "plugin Ready again, slices published" bash -c "[ $(slice_count) -gt 0 ]"
  delete_all_and_check_clean "reinstall"
  h "uninstall with nothing prepared"
  kubectl delete namespace $N --wait=true --timeout=120s >/dev/null 2>&1
  kubectl delete -k e2e/real-node --wait=true --timeout=120s >/dev/null 2>&1
  waitfor 90 bash -c "[ -z \"\$(kubectl get resourceslices --field-selector spec.driver=gpu.dra.dev -o name)\" ]"
  check "no slice, no DeviceClass, no namespace of the driver left" bash -c \
    "[ $(slice_count) = 0 ] && ! kubectl get deviceclass gpu.dra.dev >/dev/null 2>&1 && ! kubectl get namespace gpu-dra >/dev/null 2>&1"
  echo "left on the node: $(ls -A $PLUGIN_DIR 2>/dev/null | tr '\n' ' ')| CDI specs: $(specs | wc -l)"
  check "no CDI spec and no socket left; the plugin directory holds only its state files" bash -c \
    "[ -z \"\$(ls $CDI/k8s.gpu.dra.dev-* 2>/dev/null)\" ] && [ -z \"\$(find $PLUGIN_DIR /var/lib/kubelet/plugins_registry -type s 2>/dev/null)\" ]"
}

# The workloads' busybox, imported by up-node.sh; the kubelet's image GC removes it under disk pressure.
BIN_DIR=${KUBE_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/bin}
"$BIN_DIR/ctr" -n k8s.io images ls -q 2>/dev/null | grep -qx localhost/busybox:local 2>/dev/null ||
  "$BIN_DIR/ctr" -n k8s.io images import --local "${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/images/busybox.tar" >/dev/null
kubectl get daemonset -n gpu-dra gpu-dra-plugin >/dev/null 2>&1 || { echo "day-two.sh: gpu-dra is not installed (e2e/real-node-install.sh)" >&2; exit 1; }

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(upgrade burst burst-mps mig-stuck kubelet-restart probes reboot reboot-mps uninstall)
for s in "${steps[@]}"; do
  case $s in
    upgrade | burst | burst-mps | mig-stuck | kubelet-restart | probes | reboot | reboot-mps | uninstall) "step_${s//-/_}" ;;
    *) echo "day-two.sh: no step $s (upgrade burst burst-mps mig-stuck kubelet-restart probes reboot reboot-mps uninstall)" >&2; exit 64 ;;
  esac
done
kubectl delete namespace $N --ignore-not-found --wait=false >/dev/null 2>&1
echo "failures: $failures"
exit $failures
