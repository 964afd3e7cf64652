#!/usr/bin/env bash
# The plugin with --backend nvml, installed from deploy/ (the nvml overlay, through e2e/real-node-nvml) as a
# Pod on the real node of ../shared/realk8s/node, against NVIDIA's mock NVML in a driver root on the host: as
# NVIDIA's DRA driver runs its CI on CPU-only hosts. What it shows that the fake backend cannot:
#   - the NVML backend loads the driver root's library in the plugin's container and publishes its GPUs;
#   - the driver's nvidia-smi runs inside the driver root (chroot), with the root's own shell: the stand-in
#     nvidia-smi fails as the real one does when it is started outside the root (GLIBC_PRIVATE), so a
#     time-sliced claim is prepared only if it ran inside;
#   - a container gets /dev/nvidia<N> and /dev/nvidiactl from the spec's numbers (195), though neither the
#     host nor the driver root has them; /dev/nvidia-uvm, whose module this host lacks, from the root's file.
# Run after up.sh and up-node.sh, as root from the project root, with NVIDIA's mock NVML library (as built
# from NVIDIA/k8s-test-infra pkg/gpu/mocknvml) and its profiles by path, as e2e/mock-nvml/run.sh takes them:
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig MOCK_NVML_LIB=/path/to/libnvidia-ml.so.<version> e2e/real-node-nvml.sh
# MOCK_NVML_CONFIGS names the profiles' directory (default: configs/ beside the library).
# GPU_DRA_BINARY names the binary for the image (default target/release/gpu-dra). Each check prints PASS or
# FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
: "${MOCK_NVML_LIB:?set MOCK_NVML_LIB to the built mock NVML library, libnvidia-ml.so.<version>}"
export KUBECONFIG
BIN_DIR=${KUBE_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-realk8s/bin}
ROOT=/opt/gpu-dra-mock-driver-root
CONFIGS=${MOCK_NVML_CONFIGS:-$(dirname "$MOCK_NVML_LIB")/configs}
N=gpu-dra-nvml-e2e
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
h() { echo "----- $*"; }
plugin_pod() { kubectl get pod -n gpu-dra -l app.kubernetes.io/component=kubelet-plugin -o jsonpath='{.items[0].metadata.name}' 2>/dev/null; }

h "driver root $ROOT with the mock NVML (H100 profile)"
LIB=$MOCK_NVML_LIB
[ -f "$LIB" ] || { echo "FAIL MOCK_NVML_LIB=$LIB is not a file"; exit 1; }
[ -f "$CONFIGS/mock-nvml-config-h100.yaml" ] || { echo "FAIL no mock-nvml-config-h100.yaml in $CONFIGS: set MOCK_NVML_CONFIGS"; exit 1; }
VERSION=$(python3 -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["system"]["driver_version"])' "$CONFIGS/mock-nvml-config-h100.yaml")
mountpoint -q "$ROOT" && umount -l "$ROOT"
rm -rf "$ROOT" && mkdir -p "$ROOT"
# The DaemonSet mounts the driver root with HostToContainer propagation, which the runtime refuses on a
# private mount ("is mounted on / but it is not a shared or slave mount"); systemd makes / shared, this
# node's / is private, so the root gets a shared mount of its own.
mount --bind "$ROOT" "$ROOT" && mount --make-shared "$ROOT"
mkdir -p "$ROOT"/{usr/lib64,usr/bin,bin,config,tmp,dev,proc/driver/nvidia}
cp "$LIB" "$ROOT/usr/lib64/libnvidia-ml.so.$VERSION"
ln -s "libnvidia-ml.so.$VERSION" "$ROOT/usr/lib64/libnvidia-ml.so.1"
cp "$CONFIGS/mock-nvml-config-h100.yaml" "$ROOT/config/config.yaml"
echo "NVRM version: NVIDIA UNIX x86_64 Kernel Module  $VERSION  (mock)" >"$ROOT/proc/driver/nvidia/version"
# Like a host's root: its own libc in the library directory, and a shell (static busybox) for the stand-in.
cp -L /lib/x86_64-linux-gnu/libc.so.6 "$ROOT/usr/lib64/libc.so.6"
cp /bin/busybox "$ROOT/bin/sh"
touch "$ROOT/.gpu-dra-mock-driver-root"
cat >"$ROOT/usr/bin/nvidia-smi" <<'EOS'
#!/bin/sh
# nvidia-smi stand-in: the real one runs only with the root's loader and libc, that is inside the root.
if [ ! -e /.gpu-dra-mock-driver-root ]; then
  echo "nvidia-smi: libc.so.6: version \`GLIBC_PRIVATE' not found (started outside the driver root)" >&2
  exit 127
fi
case "$*" in
  *compute-policy*--set-timeslice*) echo "Set timeslice for GPU ($*)"; exit 0 ;;
  *) echo "nvidia-smi stand-in: $*"; exit 0 ;;
esac
EOS
chmod 755 "$ROOT/usr/bin/nvidia-smi"
# The UVM module is not loaded here, so its major is unknown and the runtime takes the root's files.
mknod -m 666 "$ROOT/dev/nvidia-uvm" c 510 0
mknod -m 666 "$ROOT/dev/nvidia-uvm-tools" c 510 1
check "the host has no /dev/nvidia0 and no /dev/nvidiactl" bash -c "[ ! -e /dev/nvidia0 ] && [ ! -e /dev/nvidiactl ]"

h "image and install from deploy/ (nvml overlay)"
e2e/image.sh "${GPU_DRA_BINARY:-target/release/gpu-dra}" gpu-dra:dev target/gpu-dra-image.tar || exit 1
"$BIN_DIR/ctr" -n k8s.io images import target/gpu-dra-image.tar >/dev/null
kubectl apply -f crd/ >/dev/null
kubectl label node node-1 feature.node.kubernetes.io/pci-10de.present=true --overwrite >/dev/null
kubectl apply -k e2e/real-node-nvml >/dev/null
check "plugin Pod Ready" kubectl wait -n gpu-dra --for=condition=Ready pod -l app.kubernetes.io/component=kubelet-plugin --timeout=120s
P=$(plugin_pod)
devices=""
for _ in $(seq 30); do
  devices=$(kubectl get resourceslices -o jsonpath='{range .items[*]}{range .spec.devices[*]}{.name}{" "}{end}{end}' 2>/dev/null)
  [ -n "$devices" ] && break; sleep 1
done
check "8 GPUs of the mock published ($devices)" bash -c "[ \$(echo '$devices' | wc -w) = 8 ]"

h "a time-sliced GPU: nvidia-smi inside the driver root"
kubectl create namespace $N >/dev/null 2>&1
kubectl apply -n $N -f - >/dev/null <<'EOY'
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: sliced
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
              strategy: TimeSlicing
              timeSlicingConfig: {interval: Long}
---
apiVersion: v1
kind: Pod
metadata:
  name: sliced
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: c
      image: localhost/busybox:local
      imagePullPolicy: Never
      command: ["sh", "-c", "ls -l /dev/nvidia*; env | grep GPU_DRA; sleep 3600"]
      resources: {claims: [{name: gpu}]}
  resourceClaims:
    - name: gpu
      resourceClaimName: sliced
EOY
kubectl wait -n $N --for=condition=Ready pod/sliced --timeout=90s >/dev/null 2>&1
kubectl get events -n $N --field-selector involvedObject.name=sliced -o custom-columns=R:.reason,M:.message 2>/dev/null | tail -3 | cut -c1-300
check "time-sliced pod Running" test "$(kubectl get pod -n $N sliced -o jsonpath='{.status.phase}')" = Running
kubectl logs -n $N sliced 2>&1 | head -8
check "its container has GPU_DRA_SHARING=TimeSlicing/Long" bash -c "kubectl logs -n $N sliced | grep -q 'GPU_DRA_SHARING=TimeSlicing/Long'"
check "the plugin set the interval through nvidia-smi (log: GPU sharing mode set)" \
  bash -c "kubectl logs -n gpu-dra $P | grep 'GPU sharing mode set' | grep -qi 'slice'"
check "the same nvidia-smi refuses to run outside the driver root" \
  bash -c "! chroot / $ROOT/usr/bin/nvidia-smi compute-policy --set-timeslice 2 >/dev/null 2>&1 && ! kubectl exec -n gpu-dra $P -- /driver-root/usr/bin/nvidia-smi -L >/dev/null 2>&1"
check "/dev/nvidia<N> in the container is c 195 from the spec's numbers" \
  bash -c "kubectl logs -n $N sliced | grep -qE '^c.* 195, +[0-7] .*/dev/nvidia[0-7]\$'"
check "/dev/nvidiactl in the container is c 195, 255" bash -c "kubectl logs -n $N sliced | grep -qE '^c.* 195, +255 .*/dev/nvidiactl\$'"
check "/dev/nvidia-uvm in the container (from the root's file)" bash -c "kubectl logs -n $N sliced | grep -qE '^c.* 510, +0 .*/dev/nvidia-uvm\$'"

h "unprepare"
kubectl delete -n $N pod/sliced --wait=true --timeout=60s >/dev/null
sleep 2
check "the interval was reset (log)" bash -c "kubectl logs -n gpu-dra $P | grep 'GPU sharing mode set' | tail -1 | grep -q 'the default'"

h "clean up"
kubectl delete namespace $N --wait=false >/dev/null
kubectl delete -k e2e/real-node-nvml --wait=false >/dev/null
kubectl label node node-1 feature.node.kubernetes.io/pci-10de.present- >/dev/null
echo "failures: $failures"
exit $failures
