#!/usr/bin/env bash
# Checks that a gpu-dra binary is the node binary: built without the `doubles` feature, so it holds none
# of the test doubles (the API server, kubelet and scheduler doubles of tests/support), no `gpu-dra demo`
# and no MPS or IMEX stand-in. .ci/run runs it on `cargo build --bin gpu-dra`; run it on a release build with
#   cargo build --release && tools/check-node-binary.sh target/release/gpu-dra
# `--expect-doubles` inverts it, to show the check finds them where they are (a `--features doubles` build).
set -euo pipefail

expect_doubles=false
if [ "${1:-}" = "--expect-doubles" ]; then
  expect_doubles=true
  shift
fi
binary=${1:?usage: tools/check-node-binary.sh [--expect-doubles] BINARY}
[ -x "$binary" ] || { echo "check-node-binary: no executable at $binary" >&2; exit 2; }
command -v nm >/dev/null || { echo "check-node-binary: nm (binutils) is needed" >&2; exit 2; }

# The modules only `doubles` compiles, by their demangled paths.
modules='gpu_dra::support::|gpu_dra::demo::|gpu_dra::claims::lifecycle::holds::|gpu_dra::claims::mps::stand_in::|gpu_dra::domains::imex::stand_in::'
found=$(nm --demangle --defined-only "$binary" | grep -cE "$modules" || true)

# What a user would see: the subcommands are unknown to the node binary.
refused() {
  local out
  if out=$("$binary" "$@" --help 2>&1); then return 1; fi
  grep -q "unrecognized subcommand '${*: -1}'" <<<"$out"
}
demo_refused=false
refused demo && demo_refused=true
stand_in_refused=false
refused fake mps-control-daemon && stand_in_refused=true
imex_stand_in_refused=false
refused fake imex-daemon && imex_stand_in_refused=true
# An MPS daemon Pod of the fake backend: refused, with the reason.
mps_refused=false
if ! out=$("$binary" mps-daemon --claim check --pipe-dir /nonexistent --log-dir /nonexistent \
  --shm-dir /nonexistent --program stand-in 2>&1) && grep -q "which this build leaves out" <<<"$out"; then
  mps_refused=true
fi

echo "$binary: $found symbols of the test doubles, demo and MPS stand-in;" \
  "'gpu-dra demo' refused: $demo_refused; 'gpu-dra fake mps-control-daemon' refused: $stand_in_refused;" \
  "'gpu-dra fake imex-daemon' refused: $imex_stand_in_refused;" \
  "an MPS daemon with the stand-in refused: $mps_refused"
if $expect_doubles; then
  [ "$found" -gt 0 ] && ! $demo_refused && ! $stand_in_refused && ! $imex_stand_in_refused && ! $mps_refused && exit 0
  echo "check-node-binary: expected a build with the doubles" >&2
  exit 1
fi
[ "$found" -eq 0 ] && $demo_refused && $stand_in_refused && $imex_stand_in_refused && $mps_refused && exit 0
echo "check-node-binary: $binary is not the node binary: it carries the test doubles (build it without --features doubles)" >&2
exit 1
