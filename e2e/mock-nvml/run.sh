#!/usr/bin/env bash
# The NVML backend against NVIDIA's mock NVML (NVIDIA/k8s-test-infra, pkg/gpu/mocknvml): a libnvidia-ml.so
# written in Go that answers from a GPU profile in YAML. A development check for every change to
# src/gpu/nvml*.rs, kept out of CI (it needs Go, gcc and a k8s-test-infra checkout). For each profile it
# builds the mock once, lays out a driver root in a temp dir (the mock library as libnvidia-ml.so.<driver
# version>, the profile as config/config.yaml where the mock looks for it), runs `gpu-dra nvml probe` and
# `gpu-dra devices --backend nvml` (static and dynamic MIG) against it, and checks what they report against
# the profile: GPU count, UUIDs, names, memory, PCI bus ids, NUMA nodes, architecture, compute capability,
# versions, NVLink domains, MIG capability. Where gpu-dra has a fake profile of the same model (H100,
# A100, L40S) it also prints where the mock and the fake backend disagree (DIFF lines).
#
#   MOCKNVML_SRC=/opt/k8s-test-infra e2e/mock-nvml/run.sh [PROFILE|all]    (from the project root)
#
#   PROFILE   h100 (default), a100, b200, gb200, gb300, l40s, t4: whatever configs/ of the mock holds
#   GPU_DRA   the binary to test (default: target/release/gpu-dra, under $CARGO_TARGET_DIR if set)
#   GO        the go binary (default: `go` on PATH); GOROOT is derived from it when unset
#   MIG_ON=1  lay the profile out with MIG mode on (for GPUs the profile gives MIG instances): the mock
#             then lists no MIG profile, and the GPU must be reported unreadable, not silently dropped
#   FABRIC_STATE=in_progress|not_started|not_supported  the GPUs' NVLink fabric registration state
#             (profiles with a fabric, GB200 / GB300): no fabric domain, and no IMEX channel, unless completed
#   KEEP=1    keep the temp dirs (driver root, outputs) and print where they are
#   PREPARE=1 also run tests/mock_nvml.rs: the plugin with --backend nvml against the API server and
#             kubelet doubles, preparing a whole GPU and a dynamic MIG device (cargo test)
#
# Prints PASS / FAIL / KNOWN (a limit of the mock) / DIFF (mock and fake disagree) lines; exits 1 when a
# check failed.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$REPO/e2e/mock-nvml
: "${MOCKNVML_SRC:?set MOCKNVML_SRC to a checkout of github.com/NVIDIA/k8s-test-infra}"
MOCK=$MOCKNVML_SRC/pkg/gpu/mocknvml
[ -d "$MOCK/configs" ] || { echo "FAIL $MOCK/configs not found: is MOCKNVML_SRC a k8s-test-infra checkout?"; exit 1; }
GPU_DRA=${GPU_DRA:-${CARGO_TARGET_DIR:-$REPO/target}/release/gpu-dra}
[ -x "$GPU_DRA" ] || { echo "FAIL $GPU_DRA not found: cargo build --release first, or set GPU_DRA"; exit 1; }
command -v python3 >/dev/null || { echo "FAIL python3 is needed for the checks"; exit 1; }

profiles() { ls "$MOCK/configs" | sed -n 's/^mock-nvml-config-\(.*\)\.yaml$/\1/p'; }

PROFILE=$(echo "${1:-h100}" | tr 'A-Z' 'a-z')
if [ "$PROFILE" = all ]; then
  failed=""
  for p in $(profiles); do
    echo "=== $p"
    "$0" "$p" || failed="$failed $p"
  done
  [ -z "$failed" ] && { echo "=== all profiles passed"; exit 0; }
  echo "=== failed:$failed"; exit 1
fi
CONFIG=$MOCK/configs/mock-nvml-config-$PROFILE.yaml
[ -f "$CONFIG" ] || { echo "FAIL no mock profile $PROFILE (the mock has: $(profiles | tr '\n' ' '))"; exit 1; }

# Build the mock library once (about 20 s to 2 min); vendor/ makes it work offline.
build_mock() {
  local go=${GO:-$(command -v go || true)}
  [ -n "$go" ] || { echo "FAIL no Go toolchain: put go on PATH or set GO"; return 1; }
  export GOROOT=${GOROOT:-$(cd "$(dirname "$go")/.." && pwd)}
  export PATH=$(dirname "$go"):$PATH GOFLAGS=${GOFLAGS:--mod=vendor} GOPROXY=${GOPROXY:-off}
  export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
  echo "building the mock NVML library in $MOCK"
  make -C "$MOCK" NO_PADDING=1 >"$WORK/mock-build.log" 2>&1 || {
    tail -20 "$WORK/mock-build.log"; echo "FAIL building the mock (log: $WORK/mock-build.log)"; return 1; }
}

WORK=$(mktemp -d /tmp/gpu-dra-mock-nvml.XXXXXX)
if [ "${KEEP:-}" = 1 ]; then echo "work dir: $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
LIB=$(ls "$MOCK"/libnvidia-ml.so.*.*.* 2>/dev/null | grep -v '\.h$' | head -1)
if [ -z "$LIB" ]; then build_mock || exit 1; LIB=$(ls "$MOCK"/libnvidia-ml.so.*.*.* | grep -v '\.h$' | head -1); fi

# The driver root: the library under the profile's driver version (the plugin looks for
# libnvidia-ml.so.<version>, as the Container Toolkit does), the profile where the mock finds it
# (<root>/config/config.yaml beside <root>/usr/lib64), and the driver's /proc version file.
VERSION=$(python3 -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["system"]["driver_version"])' "$CONFIG")
ROOT=$WORK/driver-root
mkdir -p "$ROOT/usr/lib64" "$ROOT/config" "$ROOT/proc/driver/nvidia"
cp "$LIB" "$ROOT/usr/lib64/libnvidia-ml.so.$VERSION"
ln -s "libnvidia-ml.so.$VERSION" "$ROOT/usr/lib64/libnvidia-ml.so.1"
cp "$CONFIG" "$ROOT/config/config.yaml"
if [ "${MIG_ON:-}" = 1 ]; then
  python3 - "$ROOT/config/config.yaml" <<'EOF_PY'
import sys, yaml
path = sys.argv[1]
profile = yaml.safe_load(open(path))
mig = (profile.get("device_defaults") or {}).get("mig") or {}
if mig.get("max_gpu_instances"):
    mig["mode_current"] = mig["mode_pending"] = "enabled"
yaml.safe_dump(profile, open(path, "w"), sort_keys=False)
EOF_PY
fi
if [ -n "${FABRIC_STATE:-}" ]; then
  python3 - "$ROOT/config/config.yaml" "$FABRIC_STATE" <<'EOF_PY'
import sys, yaml
path, state = sys.argv[1], sys.argv[2]
profile = yaml.safe_load(open(path))
fabric = (profile.get("device_defaults") or {}).get("fabric")
if fabric:
    fabric["state"] = state
yaml.safe_dump(profile, open(path, "w"), sort_keys=False)
EOF_PY
fi
echo "NVRM version: NVIDIA UNIX x86_64 Kernel Module  $VERSION  (mock)" >"$ROOT/proc/driver/nvidia/version"
export MOCK_NVML_CONFIG=$ROOT/config/config.yaml

failures=0
run() { # run NAME ARGS...: the command's stdout to $WORK/NAME, FAIL with its stderr when it fails
  local name=$1; shift
  "$@" >"$WORK/$name" 2>"$WORK/$name.err" && return 0
  local rc=$?
  echo "FAIL $name: \`$*\` exited $rc: $(tail -3 "$WORK/$name.err")"; failures=$((failures + 1)); return 1
}
echo "profile $PROFILE: driver $VERSION, driver root $ROOT"
run probe.txt "$GPU_DRA" nvml probe --driver-root "$ROOT" && echo "PASS gpu-dra nvml probe"
run static.json "$GPU_DRA" devices --backend nvml --driver-root "$ROOT" -o json && echo "PASS gpu-dra devices --backend nvml"
run dynamic.json "$GPU_DRA" devices --backend nvml --driver-root "$ROOT" --mig-mode dynamic -o json &&
  echo "PASS gpu-dra devices --backend nvml --mig-mode dynamic"
[ "$failures" = 0 ] || exit 1

# Our fake profile of the same model, if there is one.
case $PROFILE in
  h100) FAKE=dgx-h100 ;;
  a100) FAKE=dgx-a100 ;;
  l40s) FAKE=l40s-4 ;;
  gb200) FAKE=gb200-nvl72 ;;
  *) FAKE= ;;
esac
args=("$ROOT/config/config.yaml" "$WORK/probe.txt" "$WORK/static.json" "$WORK/dynamic.json")
if [ -n "$FAKE" ] && [ "${MIG_ON:-}" != 1 ]; then
  run fake-static.json "$GPU_DRA" devices --backend fake --fake-profile "$FAKE" -o json &&
    run fake-dynamic.json "$GPU_DRA" devices --backend fake --fake-profile "$FAKE" --mig-mode dynamic -o json &&
    args+=("$WORK/fake-static.json" "$WORK/fake-dynamic.json") && echo "INFO compared with fake profile $FAKE"
else
  echo "INFO gpu-dra has no fake profile of this model; no comparison"
fi
python3 "$HERE/check.py" "${args[@]}" || failures=$((failures + 1))

if [ "${PREPARE:-}" = 1 ]; then
  echo "running tests/mock_nvml.rs against $ROOT"
  if (cd "$REPO" && GPU_DRA_MOCK_NVML_ROOT=$ROOT cargo test --test mock_nvml -- --ignored --nocapture --test-threads 1) \
    >"$WORK/prepare.log" 2>&1; then
    grep -E '^(PASS|FAIL|KNOWN) ' "$WORK/prepare.log"; echo "PASS prepare against the mock"
  else
    grep -E '^(PASS|FAIL|KNOWN) |panicked|error' "$WORK/prepare.log" | head -20
    echo "FAIL prepare against the mock (log: $WORK/prepare.log)"; failures=$((failures + 1))
  fi
fi
[ "$failures" = 0 ]
