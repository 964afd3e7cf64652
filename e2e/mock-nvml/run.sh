#!/usr/bin/env bash
# The NVML backend against NVIDIA's mock NVML (NVIDIA/k8s-test-infra, pkg/gpu/mocknvml): a libnvidia-ml.so
# written in Go that answers from a GPU profile in YAML. A development check for every change to
# src/gpu/nvml*.rs, kept out of CI (it needs the mock's library, which this repository does not ship). It
# takes the built library and the mock's profiles by path, as a user has them. For each profile it lays out
# a driver root in a temp dir (the mock library as libnvidia-ml.so.<driver version>, the profile as
# config/config.yaml where the mock looks for it), runs `gpu-dra nvml probe` and
# `gpu-dra devices --backend nvml` (static and dynamic MIG) against it, and checks what they report against
# the profile: GPU count, UUIDs, names, memory, PCI bus ids, NUMA nodes, architecture, compute capability,
# versions, NVLink domains, MIG capability. Where gpu-dra has a fake profile of the same model (H100,
# A100, L40S) it also prints where the mock and the fake backend disagree (DIFF lines).
#
#   MOCK_NVML_LIB=/path/to/libnvidia-ml.so.<version> e2e/mock-nvml/run.sh [PROFILE|all]  (from the project root)
#
#   MOCK_NVML_LIB      the mock's built libnvidia-ml.so (required)
#   MOCK_NVML_CONFIGS  the mock's profiles, mock-nvml-config-<profile>.yaml (default: configs/ beside the
#                      library, where the mock's source tree keeps them)
#   PROFILE   h100 (default), a100, b200, gb200, gb300, l40s, t4: whatever MOCK_NVML_CONFIGS holds
#   GPU_DRA   the binary to test (default: target/release/gpu-dra, under $CARGO_TARGET_DIR if set)
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
: "${MOCK_NVML_LIB:?set MOCK_NVML_LIB to the built mock NVML library (libnvidia-ml.so.<version> of NVIDIA/k8s-test-infra pkg/gpu/mocknvml)}"
[ -f "$MOCK_NVML_LIB" ] || { echo "FAIL MOCK_NVML_LIB=$MOCK_NVML_LIB is not a file"; exit 1; }
LIB=$(cd "$(dirname "$MOCK_NVML_LIB")" && pwd)/$(basename "$MOCK_NVML_LIB")
CONFIGS=${MOCK_NVML_CONFIGS:-$(dirname "$LIB")/configs}
[ -d "$CONFIGS" ] || { echo "FAIL $CONFIGS not found: set MOCK_NVML_CONFIGS to the mock's profile directory"; exit 1; }
export MOCK_NVML_LIB=$LIB MOCK_NVML_CONFIGS=$CONFIGS
GPU_DRA=${GPU_DRA:-${CARGO_TARGET_DIR:-$REPO/target}/release/gpu-dra}
[ -x "$GPU_DRA" ] || { echo "FAIL $GPU_DRA not found: cargo build --release first, or set GPU_DRA"; exit 1; }
command -v python3 >/dev/null || { echo "FAIL python3 is needed for the checks"; exit 1; }

profiles() { ls "$CONFIGS" | sed -n 's/^mock-nvml-config-\(.*\)\.yaml$/\1/p'; }

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
CONFIG=$CONFIGS/mock-nvml-config-$PROFILE.yaml
[ -f "$CONFIG" ] || { echo "FAIL no mock profile $PROFILE (the mock has: $(profiles | tr '\n' ' '))"; exit 1; }

WORK=$(mktemp -d /tmp/gpu-dra-mock-nvml.XXXXXX)
if [ "${KEEP:-}" = 1 ]; then echo "work dir: $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi

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
