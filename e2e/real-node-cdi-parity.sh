#!/usr/bin/env bash
# What a container gets from gpu-dra's claim specs beside what NVIDIA's CDI specs give it, on the real node of
# ../shared/realk8s/node: the plugin with --backend nvml (the nvml overlay of deploy/, through e2e/real-node-nvml)
# against NVIDIA's mock NVML in a driver root on the host that also holds the Container Toolkit's hook binary
# and a /dev/nvidia-modeset. The container runtime (containerd) runs the toolkit's real hooks from the spec:
#   spec   the claim spec's hooks are the toolkit's, in its order (create-symlinks, enable-cuda-compat
#          --host-driver-version=<the mock's version>, update-ldcache, disable-device-node-modification), run
#          from the driver root's nvidia-cdi-hook
#   newer  an image with /usr/local/cuda/compat/libcuda.so.<host major + 10>.x.y (CUDA forward compatibility):
#          its /etc/ld.so.conf.d starts with 00-compat-<uuid>.conf naming /usr/local/cuda/compat, and its
#          ld.so.cache has the compat directory's libcuda.so.1
#   older  the same with libcuda.so.<host major - 10>.x.y: no 00-compat drop-in, no compat entry in the cache
#   same   libcuda.so.<host major>.<higher minor>: none either (without the library's CUDA ELF note the toolkit
#          compares major versions only; the stand-in library here has no such note)
#   modeset  /dev/nvidia-modeset in the container, c 195, 254
#   params   where the host has /proc/driver/nvidia/params with ModifyDeviceFiles: 1 (an NVIDIA kernel module),
#          the container's says ModifyDeviceFiles: 0; on a host without one the hook has nothing to do (SKIP)
#
# Run after up.sh and up-node.sh, as root from the project root, with no plugin installed, with NVIDIA's mock
# NVML (as e2e/real-node-nvml.sh takes it) and the toolkit's nvidia-cdi-hook, v1.18.0 or later:
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig MOCK_NVML_LIB=/path/to/libnvidia-ml.so.<version> \
#     NVIDIA_CDI_HOOK=/path/to/nvidia-cdi-hook e2e/real-node-cdi-parity.sh
# nvidia-cdi-hook comes with the toolkit's package (nvidia-container-toolkit-base), or is built from its Go
# module: `GOTOOLCHAIN=local GOBIN=/tmp/hook go install github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook@v1.18.0`
# (Go 1.24 or later, Debian's golang-go). The stand-in compat libraries are built with `cc -shared`.
# MOCK_NVML_CONFIGS names the profiles' directory (default: configs/ beside the library); GPU_DRA_BINARY the
# binary for the image (default target/release/gpu-dra). Each check prints PASS, FAIL or SKIP; the exit status
# is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
: "${MOCK_NVML_LIB:?set MOCK_NVML_LIB to the built mock NVML library, libnvidia-ml.so.<version>}"
: "${NVIDIA_CDI_HOOK:?set NVIDIA_CDI_HOOK to nvidia-cdi-hook of the Container Toolkit (v1.18.0 or later)}"
export KUBECONFIG
cd "$(dirname "$0")/.."
REALK8S=${REALK8S:-../shared/realk8s}
BIN_DIR=${KUBE_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/bin}
ROOT=/opt/gpu-dra-mock-driver-root
CONFIGS=${MOCK_NVML_CONFIGS:-$(dirname "$MOCK_NVML_LIB")/configs}
CDI=${CDI_ROOT:-/var/run/cdi}
N=gpu-dra-cdi-parity
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
skip() { echo "SKIP $*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
h() { echo "----- $*"; }
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT

h "driver root $ROOT: the mock NVML (H100 profile), the toolkit's nvidia-cdi-hook, /dev/nvidia-modeset"
[ -f "$MOCK_NVML_LIB" ] || { echo "FAIL MOCK_NVML_LIB=$MOCK_NVML_LIB is not a file"; exit 1; }
[ -x "$NVIDIA_CDI_HOOK" ] || { echo "FAIL NVIDIA_CDI_HOOK=$NVIDIA_CDI_HOOK is not an executable"; exit 1; }
for name in enable-cuda-compat disable-device-node-modification; do
  grep -qa "$name" "$NVIDIA_CDI_HOOK" || { echo "FAIL $NVIDIA_CDI_HOOK knows no $name: it is older than v1.18.0"; exit 1; }
done
[ -f "$CONFIGS/mock-nvml-config-h100.yaml" ] || { echo "FAIL no mock-nvml-config-h100.yaml in $CONFIGS: set MOCK_NVML_CONFIGS"; exit 1; }
command -v cc >/dev/null || { echo "FAIL no cc to build the stand-in compat libraries"; exit 1; }
VERSION=$(python3 -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["system"]["driver_version"])' "$CONFIGS/mock-nvml-config-h100.yaml")
MAJOR=${VERSION%%.*}
mountpoint -q "$ROOT" && umount -l "$ROOT"
rm -rf "$ROOT" && mkdir -p "$ROOT"
# A shared mount of its own, for the DaemonSet's HostToContainer propagation (as in e2e/real-node-nvml.sh).
mount --bind "$ROOT" "$ROOT" && mount --make-shared "$ROOT"
mkdir -p "$ROOT"/{usr/lib64,usr/bin,bin,config,tmp,dev,proc/driver/nvidia}
cp "$MOCK_NVML_LIB" "$ROOT/usr/lib64/libnvidia-ml.so.$VERSION"
ln -s "libnvidia-ml.so.$VERSION" "$ROOT/usr/lib64/libnvidia-ml.so.1"
cp "$CONFIGS/mock-nvml-config-h100.yaml" "$ROOT/config/config.yaml"
echo "NVRM version: NVIDIA UNIX x86_64 Kernel Module  $VERSION  (mock)" >"$ROOT/proc/driver/nvidia/version"
cp "$NVIDIA_CDI_HOOK" "$ROOT/usr/bin/nvidia-cdi-hook" && chmod 755 "$ROOT/usr/bin/nvidia-cdi-hook"
mknod -m 666 "$ROOT/dev/nvidia-uvm" c 510 0
mknod -m 666 "$ROOT/dev/nvidia-uvm-tools" c 510 1
mknod -m 666 "$ROOT/dev/nvidia-modeset" c 195 254

h "images: busybox with a stand-in CUDA compat libcuda newer, older and of the same major as the host's $VERSION"
BUSYBOX=${BUSYBOX:-/bin/busybox}
echo 'int cuInit(unsigned int flags) { return flags ? 1 : 0; }' >"$WORK/cuda.c"
compat_image() { # name, compat library version
  local R=$WORK/$1
  mkdir -p "$R"/{bin,sbin,usr/bin,usr/sbin,etc,dev,proc,sys,tmp,usr/local/cuda/compat}
  chmod 1777 "$R/tmp"
  cp "$BUSYBOX" "$R/bin/busybox"
  for p in $("$BUSYBOX" --list-full); do
    [ "$p" = bin/busybox ] && continue
    mkdir -p "$R/$(dirname "$p")"; ln -sf /bin/busybox "$R/$p"
  done
  echo 'root:x:0:0:root:/root:/bin/sh' >"$R/etc/passwd"
  echo 'root:x:0:' >"$R/etc/group"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$R/usr/local/cuda/compat/libcuda.so.$2" "$WORK/cuda.c" || return 1
  python3 "$REALK8S/node/images/mkimage.py" "localhost/cuda-compat-$1:local" "$R" "$WORK/$1.tar" null '["sh"]' >/dev/null &&
    "$BIN_DIR/ctr" -n k8s.io images import --local "$WORK/$1.tar" >/dev/null 2>&1
}
NEWER=$((MAJOR + 10)).35.03
OLDER=$((MAJOR - 10)).104.05
SAME=$MAJOR.999.99
for image in "newer $NEWER" "older $OLDER" "same $SAME"; do
  set -- $image
  check "image localhost/cuda-compat-$1:local (libcuda.so.$2)" compat_image "$1" "$2"
done

h "install from deploy/ (nvml overlay)"
e2e/image.sh "${GPU_DRA_BINARY:-target/release/gpu-dra}" gpu-dra:dev target/gpu-dra-image.tar || exit 1
"$BIN_DIR/ctr" -n k8s.io images import target/gpu-dra-image.tar >/dev/null
kubectl apply -f crd/ >/dev/null
kubectl label node node-1 feature.node.kubernetes.io/pci-10de.present=true --overwrite >/dev/null
kubectl apply -k e2e/real-node-nvml >/dev/null
check "plugin Pod Ready" kubectl wait -n gpu-dra --for=condition=Ready pod -l app.kubernetes.io/component=kubelet-plugin --timeout=120s
for _ in $(seq 30); do
  [ -n "$(kubectl get resourceslices -o name 2>/dev/null)" ] && break; sleep 1
done

kubectl create namespace $N >/dev/null 2>&1
pod() { # name: a pod of image cuda-compat-<name> with one GPU
  kubectl apply -n $N -f - >/dev/null <<EOY
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: $1
spec:
  devices:
    requests:
      - name: gpu
        exactly: {deviceClassName: gpu.dra.dev}
---
apiVersion: v1
kind: Pod
metadata:
  name: $1
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: c
      image: localhost/cuda-compat-$1:local
      imagePullPolicy: Never
      command: ["sleep", "3600"]
      resources: {claims: [{name: gpu}]}
  resourceClaims:
    - name: gpu
      resourceClaimName: $1
EOY
}
in_pod() { kubectl exec -n $N "$1" -- sh -c "$2" 2>/dev/null; }
for name in newer older same; do pod $name; done
for name in newer older same; do
  kubectl wait -n $N --for=condition=Ready pod/$name --timeout=90s >/dev/null 2>&1
  check "pod $name Running" test "$(kubectl get pod -n $N $name -o jsonpath='{.status.phase}')" = Running
done
kubectl get events -n $N -o custom-columns=R:.reason,M:.message 2>/dev/null | grep -iv "scheduled\|pulled\|created\|started" | tail -5 | cut -c1-300

h "spec: the toolkit's hooks in its order"
UID_NEWER=$(kubectl get resourceclaim -n $N newer -o jsonpath='{.metadata.uid}')
SPEC=$(ls "$CDI"/*"$UID_NEWER"* 2>/dev/null | head -1)
hooks=$(python3 -c '
import json, sys
spec = json.load(open(sys.argv[1]))
for h in spec.get("containerEdits", {}).get("hooks", []):
    print(h["hookName"], h["path"], " ".join(h["args"][1:2] + [a for a in h["args"][2:] if a.startswith("--host-driver-version")]))
' "$SPEC" 2>/dev/null)
echo "$hooks" | sed 's/^/      /'
# create-symlinks for libnvidia-ml.so.1 (the mock root has no libcuda).
expected="createContainer $ROOT/usr/bin/nvidia-cdi-hook create-symlinks
createContainer $ROOT/usr/bin/nvidia-cdi-hook enable-cuda-compat --host-driver-version=$VERSION
createContainer $ROOT/usr/bin/nvidia-cdi-hook update-ldcache
createContainer $ROOT/usr/bin/nvidia-cdi-hook disable-device-node-modification"
check "spec $SPEC: create-symlinks, enable-cuda-compat, update-ldcache, disable-device-node-modification from the driver root" \
  test "$hooks" = "$expected"

h "newer: the compat directory first"
in_pod newer 'ls /etc/ld.so.conf.d; cat /etc/ld.so.conf.d/00-compat-*.conf' | sed 's/^/      /'
check "newer: /etc/ld.so.conf.d starts with 00-compat-<uuid>.conf" \
  bash -c "kubectl exec -n $N newer -- ls /etc/ld.so.conf.d | head -1 | grep -qE '^00-compat-[0-9a-f-]{36}\.conf\$'"
check "newer: it names /usr/local/cuda/compat" \
  test "$(in_pod newer 'cat /etc/ld.so.conf.d/00-compat-*.conf')" = /usr/local/cuda/compat
check "newer: ld.so.cache has /usr/local/cuda/compat/libcuda.so.1" \
  bash -c "kubectl exec -n $N newer -- strings /etc/ld.so.cache | grep -qx /usr/local/cuda/compat/libcuda.so.1"
for name in older same; do
  check "$name: no 00-compat drop-in" bash -c "! kubectl exec -n $N $name -- sh -c 'ls /etc/ld.so.conf.d/00-compat-* 2>/dev/null' | grep -q ."
  check "$name: no compat entry in ld.so.cache" \
    bash -c "! kubectl exec -n $N $name -- sh -c 'strings /etc/ld.so.cache 2>/dev/null' | grep -q /usr/local/cuda/compat"
done

h "modeset and params"
in_pod newer 'ls -l /dev/nvidia-modeset' | sed 's/^/      /'
check "/dev/nvidia-modeset in the container is c 195, 254" \
  bash -c "kubectl exec -n $N newer -- ls -l /dev/nvidia-modeset | grep -qE '^c.* 195, +254 '"
if grep -q '^ModifyDeviceFiles: 1$' /proc/driver/nvidia/params 2>/dev/null; then
  check "the container's /proc/driver/nvidia/params says ModifyDeviceFiles: 0" \
    bash -c "kubectl exec -n $N newer -- grep -qx 'ModifyDeviceFiles: 0' /proc/driver/nvidia/params"
else
  skip "params: this host has no /proc/driver/nvidia/params with ModifyDeviceFiles: 1 (no NVIDIA kernel module): the hook leaves the container's alone"
fi

h "clean up"
kubectl delete namespace $N --wait=true --timeout=90s >/dev/null
check "no claim spec of the pods left" bash -c "! ls '$CDI'/*'$UID_NEWER'* >/dev/null 2>&1"
kubectl delete -k e2e/real-node-nvml --wait=false >/dev/null
kubectl label node node-1 feature.node.kubernetes.io/pci-10de.present- >/dev/null
for name in newer older same; do "$BIN_DIR/ctr" -n k8s.io images rm "localhost/cuda-compat-$name:local" >/dev/null 2>&1; done
echo "failures: $failures"
exit $failures
