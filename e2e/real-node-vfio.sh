#!/usr/bin/env bash
# VFIO passthrough on the real node of ../shared/realk8s/node, with the fake backend (its GPUs on a fake PCI
# bus: /var/lib/gpu-dra/fake-state.sys, beside the fake state). A GpuNodePolicy (e2e/passthrough/policy.yaml)
# chooses the first two GPUs for passthrough; then:
#   A under gpu-dra's own name (kubectl apply -k e2e/real-node): e2e/passthrough/vm.yaml, a pod asking the
#     class vfio.gpu.dra.dev for a passthrough GPU;
#   B in NVIDIA compatibility mode (kubectl apply -k e2e/real-node-nvidia-compat): NVIDIA's two examples,
#     demo/specs/quickstart/v1/gpu-test-vfiopci.yaml and gpu-test-vfio-config.yaml, read from NVIDIA's
#     repository ($NVIDIA_REPO, a git dir) and applied with the smallest changes that let them run here:
#       - image ubuntu:22.04 -> the node's local busybox (the node has no registry), so `bash -c` -> `sh -c`;
#       - gpu-test-vfio-config.yaml: its Pod is in namespace gpu-test-vfiopci, which the file does not create
#         and where its ResourceClaimTemplate (namespace gpu-test-vfio) is not found: as written, the Pod is
#         refused (namespace not found). The Pod is moved to gpu-test-vfio.
# Each pod is checked for: its GPU not published as a GPU while the policy chooses it (only gpu-vfio-<n>);
# /dev/vfio/<group> a character device in the container, and /dev/vfio/vfio where it should be (ours: always;
# NVIDIA's: only with VfioDeviceConfig enableAPIDevice: true); the fake sysfs shows the GPU bound to vfio-pci
# while the pod runs and to nvidia after it is deleted; the KEP-5304 metadata file in the container names the
# GPU's PCI address.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig GPU_DRA_BIN=target/release/gpu-dra e2e/real-node-vfio.sh
#   (as root, from the project root, with no plugin running or installed)
#
# Each check prints PASS or FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
cd "$(dirname "$0")/.."
BIN=${GPU_DRA_BIN:-target/release/gpu-dra}
BIN_DIR=${KUBE_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/bin}
NVIDIA_REPO=${NVIDIA_REPO:-/work/.mirror/kubernetes-sigs+dra-driver-nvidia-gpu/repo}
NODE=${NODE_NAME:-node-1}
CDI=${CDI_ROOT:-/var/run/cdi}
SYS=/var/lib/gpu-dra/fake-state.sys
SEL=app.kubernetes.io/component=kubelet-plugin
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
wait_until() { local t=$1; shift; local end=$((SECONDS + t)); until "$@"; do [ $SECONDS -lt $end ] || return 1; sleep 1; done; }

slice_devices() { # driver -> device names, one per line
  kubectl get resourceslices --field-selector "spec.driver=$1" -o jsonpath='{.items[*].spec.devices[*].name}' |
    tr ' ' '\n' | sort
}
attribute() { # driver, device, attribute -> value
  kubectl get resourceslices --field-selector "spec.driver=$1" -o json | python3 -c "
import json, sys
for s in json.load(sys.stdin)['items']:
    for d in s['spec'].get('devices', []):
        if d['name'] == sys.argv[1]:
            print(next(iter(d['attributes'][sys.argv[2]].values())))" "$2" "$3"
}
device_of() { # namespace, pod -> the device its claim was allocated
  local claim
  claim=$(kubectl get pod -n "$1" "$2" -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}')
  kubectl get resourceclaim -n "$1" "$claim" -o jsonpath='{.status.allocation.devices.results[0].device}'
}
driver_on_host() { basename "$(readlink "$SYS/bus/pci/devices/$1/driver" 2>/dev/null)" 2>/dev/null; }
in_pod() { kubectl exec -n "$1" "$2" -- sh -c "$3" 2>/dev/null; }

install() { # kustomization dir, driver
  rm -rf /var/lib/gpu-dra "/var/lib/kubelet/plugins/$2"
  rm -f "$CDI"/k8s.*-*.json
  mkdir -p /var/lib/gpu-dra && cat /proc/sys/kernel/random/boot_id > /var/lib/gpu-dra/boot_id
  kubectl label node "$NODE" gpu-dra.dev/fake=true --overwrite >/dev/null
  kubectl apply -f crd/ >/dev/null
  kubectl apply -f e2e/passthrough/policy.yaml >/dev/null
  kubectl apply -k "$1" >/dev/null
  sleep 2
  check "plugin DaemonSet Pod Ready ($2)" kubectl wait -n gpu-dra --for=condition=Ready pod -l $SEL --timeout=120s
  chosen() { slice_devices "$1" | grep -qx gpu-vfio-0 && slice_devices "$1" | grep -qx gpu-vfio-1; }
  check "slices of $2 publish gpu-vfio-0 and gpu-vfio-1" wait_until 60 chosen "$2"
  local devices; devices=$(slice_devices "$2" | tr '\n' ' ')
  check "the chosen GPUs are not published as GPUs or MIG devices (gpu-0, gpu-1 and theirs)" \
    bash -c "! grep -qE '(^| )gpu-[01](-mig-[^ ]*)?( |$)' <<<'$devices'"
  check "the other GPUs stay GPUs (gpu-2 .. gpu-7)" bash -c "grep -q 'gpu-7 ' <<<'$devices'"
}
uninstall() { # kustomization dir
  kubectl delete -k "$1" --wait=true --timeout=120s >/dev/null 2>&1
  kubectl delete -f e2e/passthrough/policy.yaml >/dev/null 2>&1
  kubectl wait -n gpu-dra --for=delete pod -l $SEL --timeout=120s >/dev/null 2>&1
}
# Checks one running pod of driver $3: its device, group device, API device ($4: yes/no), sysfs, metadata.
check_pod() { # namespace, pod, driver, api device expected (yes|no), metadata path in the container
  local ns=$1 pod=$2 driver=$3 api=$4 metadata=$5 device address group
  device=$(device_of "$ns" "$pod")
  address=$(attribute "$driver" "$device" resource.kubernetes.io/pciBusID)
  group=$(attribute "$driver" "$device" iommuGroup)
  echo "  $ns/$pod: $device, PCI $address, IOMMU group $group"
  check "$pod got a passthrough device ($device)" bash -c "[[ '$device' == gpu-vfio-* ]]"
  check "$pod sees /dev/vfio/$group as a character device" in_pod "$ns" "$pod" "test -c /dev/vfio/$group"
  if [ "$api" = yes ]; then
    check "$pod sees /dev/vfio/vfio as a character device" in_pod "$ns" "$pod" "test -c /dev/vfio/vfio"
  else
    check "$pod has no /dev/vfio/vfio (NVIDIA's default)" bash -c "! kubectl exec -n $ns $pod -- test -e /dev/vfio/vfio"
  fi
  check "$pod has no NVIDIA device files" bash -c "! kubectl exec -n $ns $pod -- sh -c 'ls /dev/nvidia*' >/dev/null 2>&1"
  check "the fake sysfs shows $address bound to vfio-pci ($(driver_on_host "$address"))" \
    test "$(driver_on_host "$address")" = vfio-pci
  check "$pod reads its GPU's PCI address in the device metadata file (KEP-5304)" \
    bash -c "kubectl exec -n $ns $pod -- cat '$metadata' 2>/dev/null | grep -q '$address'"
  echo "$address"
}

echo "----- install the image"
IMG=$(mktemp -d); W=$(mktemp -d); trap 'rm -rf "$IMG" "$W"' EXIT
e2e/image.sh "$BIN" gpu-dra:dev "$IMG/gpu-dra-image.tar" >/dev/null || { bad "image built from $BIN"; exit "$failures"; }
"$BIN_DIR/ctr" -n k8s.io images import "$IMG/gpu-dra-image.tar" >/dev/null
"$BIN_DIR/ctr" -n k8s.io images ls -q 2>/dev/null | grep -qx localhost/busybox:local ||
  "$BIN_DIR/ctr" -n k8s.io images import --local "${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/images/busybox.tar" >/dev/null

echo "----- A: gpu-dra's own name, class vfio.gpu.dra.dev"
install e2e/real-node gpu.dra.dev
sed 's#image: busybox:1.36#image: localhost/busybox:local\n    imagePullPolicy: Never#' e2e/passthrough/vm.yaml > "$W/vm.yaml"
kubectl apply -f "$W/vm.yaml" >/dev/null
check "the VM pod is Running" kubectl wait -n gpu-dra-vfio --for=condition=Ready pod/vm --timeout=120s
out=$(check_pod gpu-dra-vfio vm gpu.dra.dev yes \
  /var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/gpu.dra.dev-metadata.json)
echo "$out" | sed '$d'; address=$(echo "$out" | tail -1)
failures=$((failures + $(grep -c '^FAIL' <<<"$out")))
kubectl delete -f "$W/vm.yaml" --wait=true --timeout=120s >/dev/null 2>&1
back() { [ "$(driver_on_host "$1")" = nvidia ]; }
check "after the pod, $address is the nvidia driver's again" wait_until 60 back "$address"
check "and no CDI spec of gpu.dra.dev is left" bash -c "! ls $CDI/k8s.gpu.dra.dev-* >/dev/null 2>&1"
uninstall e2e/real-node

echo "----- B: NVIDIA compatibility mode, NVIDIA's two VFIO examples"
install e2e/real-node-nvidia-compat gpu.nvidia.com
check "NVIDIA's class vfio.gpu.nvidia.com is installed" kubectl get deviceclass vfio.gpu.nvidia.com
for f in gpu-test-vfiopci gpu-test-vfio-config; do
  git -C "$NVIDIA_REPO" show "HEAD:demo/specs/quickstart/v1/$f.yaml" > "$W/$f.yaml" ||
    { bad "NVIDIA's $f.yaml read from $NVIDIA_REPO"; continue; }
  sed -i -e 's#image: ubuntu:22.04#image: localhost/busybox:local\n    imagePullPolicy: Never#' \
    -e 's#command: \["bash", "-c"\]#command: ["sh", "-c"]#' "$W/$f.yaml"
done
check "as written, NVIDIA's config example puts its Pod in namespace gpu-test-vfiopci" \
  grep -q 'namespace: gpu-test-vfiopci' "$W/gpu-test-vfio-config.yaml"
sed -i 's#namespace: gpu-test-vfiopci#namespace: gpu-test-vfio#' "$W/gpu-test-vfio-config.yaml"
kubectl apply -f "$W/gpu-test-vfiopci.yaml" >/dev/null && kubectl apply -f "$W/gpu-test-vfio-config.yaml" >/dev/null
check "both pods Running" kubectl wait -n gpu-test-vfio --for=condition=Ready pod/pod1 pod/pod1-full-vfioconfig --timeout=120s
addresses=()
for spec in "pod1 no" "pod1-full-vfioconfig yes"; do
  set -- $spec
  out=$(check_pod gpu-test-vfio "$1" gpu.nvidia.com "$2" \
    /var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/gpu.nvidia.com-metadata.json)
  echo "$out" | sed '$d'; addresses+=("$(echo "$out" | tail -1)")
  failures=$((failures + $(grep -c '^FAIL' <<<"$out")))
done
kubectl delete -f "$W/gpu-test-vfio-config.yaml" -f "$W/gpu-test-vfiopci.yaml" --wait=true --timeout=120s >/dev/null 2>&1
for a in "${addresses[@]}"; do
  check "after the pods, $a is the nvidia driver's again" wait_until 60 back "$a"
done
check "and no CDI spec of gpu.nvidia.com is left" bash -c "! ls $CDI/k8s.gpu.nvidia.com-* >/dev/null 2>&1"
uninstall e2e/real-node-nvidia-compat

echo "----- $failures failure(s)"
exit "$failures"
