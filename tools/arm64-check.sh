#!/usr/bin/env bash
# The binary for linux/arm64 (the Grace hosts of GH200 and GB200), tested, not only built: cross-compiled
# here with the test doubles and run under qemu-user as `gpu-dra demo`, which drives against the doubles
# the plugin's registration with the kubelet, its ResourceSlices, a whole-GPU and a MIG prepare, a fault's
# taint, and a ComputeDomain job whose IMEX channel claims are prepared on a rack of plugins (their IMEX
# daemon stand-ins are the same arm64 binary, started by the pod runner double). .ci/run runs it.
#
#   tools/arm64-check.sh        (as root on Debian, from anywhere in the repository)
#
# Lints the crate for that target first. Installs what is missing: the Rust target aarch64-unknown-linux-gnu, Debian's gcc-aarch64-linux-gnu with
# the arm64 libc, qemu-user-static and binfmt-support. binfmt_misc must run arm64 executables through qemu,
# since the plugin starts its daemons' stand-ins from its own executable.
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu

missing=()
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
[ -x /usr/bin/qemu-aarch64-static ] || missing+=(qemu-user-static)
command -v update-binfmts >/dev/null || missing+=(binfmt-support)
if [ ${#missing[@]} -gt 0 ]; then
  echo "arm64-check: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 ||
  { echo "arm64-check: binfmt_misc does not run arm64 executables through qemu here" >&2; exit 1; }

export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
# Code under cfg!(target_arch) and C types that differ (c_char is u8 there) lint differently on arm64.
cargo clippy --locked --target "$target" --all-targets -- -D warnings
cargo build --locked --target "$target" --features doubles --bin gpu-dra
binary=${CARGO_TARGET_DIR:-target}/$target/debug/gpu-dra
aarch64-linux-gnu-readelf -h "$binary" | grep -q 'Machine:.*AArch64' ||
  { echo "arm64-check: $binary is not an AArch64 executable" >&2; exit 1; }

# qemu finds the arm64 loader and libc in Debian's cross sysroot.
export QEMU_LD_PREFIX=$sysroot
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! timeout 600 "$binary" demo >"$log" 2>&1; then
  tail -40 "$log"
  echo "FAIL gpu-dra demo on arm64 (qemu) exited non-zero"
  exit 1
fi
failed=0
for step in \
  'registered the plugin' \
  'The plugin published [0-9]+ ResourceSlice' \
  'NodePrepareResources answered' \
  'MIG device: the scheduler picked' \
  'Injected XID 79' \
  'placed on the first node that fits' \
  'started the domain.s IMEX daemon .* the domain is Ready' \
  '^Demo complete\.$'; do
  if grep -Eq "$step" "$log"; then
    echo "PASS arm64: $step"
  else
    echo "FAIL arm64: no line matching '$step'"
    failed=1
  fi
done
[ "$failed" = 0 ] || { tail -40 "$log"; exit 1; }
