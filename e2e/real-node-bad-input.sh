#!/usr/bin/env bash
# What a misconfigured DaemonSet gets on the real node of ../shared/realk8s/node: the plugin must refuse to
# start at once, with a log line, a termination message (the container's last state) and a Warning Event on
# its Pod that name the problem, instead of crash-looping silently or running where the kubelet cannot see
# it. Three DaemonSets, each one mistake away from deploy/ (rendered as kustomize overlays in target/):
#   - the nvml overlay on a host without the NVIDIA driver: the driver root holds no libnvidia-ml;
#   - the fake overlay without the /var/run/cdi hostPath mount: the runtime would never see the CDI specs;
#   - the fake overlay with a long-lived Secret token instead of the pod-bound one: no node claim, so the
#     admission policies would refuse every slice write.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/real-node-bad-input.sh     (as root, from the project root,
#   with gpu-dra not installed and the gpu-dra:dev image imported, as e2e/real-node-install.sh leaves it)
#
# Each check prints PASS or FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
cd "$(dirname "$0")/.."
NODE=${NODE_NAME:-node-1}
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
h() { echo "----- $*"; }
SEL=app.kubernetes.io/component=kubelet-plugin
if kubectl get daemonset -n gpu-dra gpu-dra-plugin >/dev/null 2>&1; then
  echo "gpu-dra is installed: kubectl delete -k e2e/real-node first" >&2; exit 1
fi
WORK=$(mktemp -d target/bad-input-XXXX); trap 'rm -rf "$WORK"' EXIT
ON_THIS_NODE='
  - target: {kind: DaemonSet, name: gpu-dra-plugin}
    patch: |-
      - {op: add, path: /spec/template/spec/hostNetwork, value: true}
      - {op: add, path: /spec/template/spec/containers/0/imagePullPolicy, value: Never}
      - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: KUBERNETES_SERVICE_HOST, value: "127.0.0.1"}}
      - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: KUBERNETES_SERVICE_PORT, value: "16443"}}'

# case NAME REASON WHAT: applies $WORK/NAME, waits for the plugin's container to end, checks what it said.
case_of() {
  local name=$1 reason=$2 what=$3
  h "$name: $what"
  kubectl apply -k "$WORK/$name" >/dev/null || { bad "$name: kubectl apply -k"; return; }
  local pod="" deadline=$((SECONDS + 90)) term=""
  while [ $SECONDS -lt $deadline ]; do
    pod=$(kubectl get pod -n gpu-dra -l $SEL -o jsonpath='{.items[0].metadata.name}' 2>/dev/null)
    term=$(kubectl get pod -n gpu-dra "$pod" -o jsonpath='{.status.containerStatuses[0].lastState.terminated.exitCode}{.status.containerStatuses[0].state.terminated.exitCode}' 2>/dev/null)
    [ -n "$term" ] && break
    sleep 1
  done
  local status; status=$(kubectl get pod -n gpu-dra "$pod" -o json 2>/dev/null | jq -c '.status.containerStatuses[0] | (.lastState.terminated // .state.terminated) | {exitCode, reason, startedAt, finishedAt, message}')
  echo "$pod: $status" | cut -c1-600
  check "$name: the plugin exited 1" test "$(jq -r .exitCode <<<"$status")" = 1
  local secs; secs=$(( $(date -d "$(jq -r .finishedAt <<<"$status")" +%s) - $(date -d "$(jq -r .startedAt <<<"$status")" +%s) ))
  check "$name: within 10 s of starting ($secs s)" test "$secs" -le 10
  check "$name: the termination message names $reason" grep -q "^$reason: " <<<"$(jq -r .message <<<"$status")"
  local log; log=$(kubectl logs -n gpu-dra "$pod" --previous 2>/dev/null; kubectl logs -n gpu-dra "$pod" 2>/dev/null)
  grep 'refusing to start' <<<"$log" | head -2 | cut -c1-400
  check "$name: a log line says so" grep -q "refusing to start.*$reason" <<<"$log"
  local events; events=$(kubectl get events -n gpu-dra --field-selector "involvedObject.name=$pod,reason=$reason" -o jsonpath='{range .items[*]}{.type} {.reason}: {.note}{.message}{"\n"}{end}' 2>/dev/null)
  echo "event: $(head -1 <<<"$events" | cut -c1-400)"
  check "$name: a Warning Event $reason on the Pod" grep -q "^Warning $reason" <<<"$events"
  check "$name: no slice published" test -z "$(kubectl get resourceslices --field-selector spec.driver=gpu.dra.dev -o name)"
  kubectl delete -k "$WORK/$name" --wait=true --timeout=60s >/dev/null 2>&1
}

kubectl apply -f crd/ >/dev/null
kubectl label node "$NODE" gpu-dra.dev/fake=true feature.node.kubernetes.io/pci-10de.present=true --overwrite >/dev/null

# The GPU Operator's driver root before its driver container has installed the driver: the directory is
# there (so the kubelet mounts it) but holds no driver. Bind-mounted onto itself as shared, since the
# driver root's HostToContainer propagation needs a shared or slave mount and this host's / is private.
EMPTY_ROOT=/run/nvidia/driver
mkdir -p $EMPTY_ROOT
mountpoint -q $EMPTY_ROOT || mount --bind $EMPTY_ROOT $EMPTY_ROOT
mount --make-shared $EMPTY_ROOT
mkdir -p "$WORK/driver-root"
cat > "$WORK/driver-root/kustomization.yaml" <<EOF
resources: [../../../deploy/overlays/nvml]
patches:$ON_THIS_NODE
      - {op: test, path: /spec/template/spec/containers/0/env/5/name, value: NVIDIA_DRIVER_ROOT}
      - {op: replace, path: /spec/template/spec/containers/0/env/5/value, value: $EMPTY_ROOT}
      - {op: test, path: /spec/template/spec/volumes/3/name, value: driver-root}
      - {op: replace, path: /spec/template/spec/volumes/3/hostPath/path, value: $EMPTY_ROOT}
EOF
case_of driver-root DriverRootInvalid "the nvml overlay with the GPU Operator's driver root $EMPTY_ROOT, which holds no driver yet"
umount $EMPTY_ROOT

mkdir -p "$WORK/no-cdi-mount"
cat > "$WORK/no-cdi-mount/kustomization.yaml" <<EOF
resources: [../../../deploy/overlays/fake]
patches:$ON_THIS_NODE
  - target: {kind: DaemonSet, name: gpu-dra-plugin}
    patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata: {name: gpu-dra-plugin, namespace: gpu-dra}
      spec:
        template:
          spec:
            containers:
              - name: plugin
                volumeMounts:
                  - {mountPath: /var/run/cdi, \$patch: delete}
EOF
case_of no-cdi-mount HostPathNotMounted "the fake overlay without its /var/run/cdi hostPath mount"

mkdir -p "$WORK/secret-token"
cat > "$WORK/secret-token/kustomization.yaml" <<EOF
resources: [../../../deploy/overlays/fake, token.yaml]
patches:$ON_THIS_NODE
      - {op: add, path: /spec/template/spec/automountServiceAccountToken, value: false}
      - {op: add, path: /spec/template/spec/volumes/-, value: {name: legacy-token, secret: {secretName: gpu-dra-plugin-legacy-token}}}
      - {op: add, path: /spec/template/spec/containers/0/volumeMounts/-, value: {name: legacy-token, mountPath: /var/run/secrets/kubernetes.io/serviceaccount, readOnly: true}}
EOF
cat > "$WORK/secret-token/token.yaml" <<EOF
# A long-lived token of the plugin's account, as clusters made them before 1.24: bound to no Pod, no node.
apiVersion: v1
kind: Secret
metadata:
  name: gpu-dra-plugin-legacy-token
  namespace: gpu-dra
  annotations: {kubernetes.io/service-account.name: gpu-dra-plugin}
type: kubernetes.io/service-account-token
EOF
case_of secret-token TokenWithoutNodeClaim "the fake overlay with a long-lived Secret token of its account instead of the pod-bound one"

kubectl label node "$NODE" feature.node.kubernetes.io/pci-10de.present- >/dev/null
echo "failures: $failures"
exit $failures
