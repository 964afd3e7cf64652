#!/usr/bin/env bash
# Builds the gpu-dra image without Docker or a registry: the binary at /usr/local/bin/gpu-dra (as the
# Dockerfile lays it out), chroot(1), the shared libraries they load (from ldd) and the CA certificates, in one layer
# with no base image, written as a docker-archive tarball that `ctr -n k8s.io images import` loads.
# usage: e2e/image.sh [BINARY] [NAME:TAG] [OUT.tar]
#   defaults: target/release/gpu-dra  gpu-dra:dev  target/gpu-dra-image.tar
#   needs: umoci and skopeo (apt-get install umoci skopeo), ldd
set -euo pipefail
cd "$(dirname "$0")/.."
BINARY=${1:-target/release/gpu-dra}
NAME=${2:-gpu-dra:dev}
OUT=${3:-target/gpu-dra-image.tar}
for tool in umoci skopeo ldd; do
  command -v "$tool" >/dev/null || { echo "image.sh: $tool is missing (apt-get install umoci skopeo)" >&2; exit 1; }
done
[ -x "$BINARY" ] || { echo "image.sh: no binary at $BINARY (cargo build --release)" >&2; exit 1; }

WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
umoci init --layout "$WORK/oci" >/dev/null
umoci new --image "$WORK/oci:img"
umoci unpack --image "$WORK/oci:img" "$WORK/bundle" >/dev/null
ROOT=$WORK/bundle/rootfs
install -D -m 0755 "$BINARY" "$ROOT/usr/local/bin/gpu-dra"
# chroot(1), as in the Dockerfile's Debian base: the plugin runs the driver's nvidia-smi inside the driver
# root with it (src/gpu/driver_exec.rs).
CHROOT=$(command -v chroot || echo /usr/sbin/chroot)
install -D -m 0755 "$CHROOT" "$ROOT/usr/sbin/chroot"
# The loader and every library ldd resolves (the binary's and chroot's), at the same paths.
for lib in $( (ldd "$BINARY"; ldd "$CHROOT") | grep -o '/[^ ]*' | sort -u); do
  mkdir -p "$ROOT$(dirname "$lib")"
  cp -L "$lib" "$ROOT$lib"
done
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
fi
mkdir -p "$ROOT/tmp" && chmod 1777 "$ROOT/tmp"
umoci repack --image "$WORK/oci:img" "$WORK/bundle" >/dev/null
umoci config --image "$WORK/oci:img" \
  --config.entrypoint /usr/local/bin/gpu-dra --config.cmd plugin \
  --config.env PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin >/dev/null
mkdir -p "$(dirname "$OUT")"
rm -f "$OUT"
skopeo copy --quiet "oci:$WORK/oci:img" "docker-archive:$OUT:$NAME"
echo "$OUT: $NAME, $(du -h "$OUT" | cut -f1) ($(du -sh "$ROOT" | cut -f1) unpacked)"
