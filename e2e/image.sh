#!/usr/bin/env bash
# Builds the gpu-dra image without Docker or a registry: the binary at /usr/local/bin/gpu-dra (as the
# Dockerfile lays it out), chroot(1), the shared libraries they load and the CA certificates, in one layer
# with no base image.
#
#   e2e/image.sh [BINARY] [NAME:TAG] [OUT.tar]
#       one image for this machine's architecture, as a docker-archive tarball that
#       `ctr -n k8s.io images import` loads; defaults: target/release/gpu-dra gpu-dra:dev target/gpu-dra-image.tar
#   e2e/image.sh --multi-arch AMD64_BINARY ARM64_BINARY [NAME:TAG] [OUT.tar]
#       one multi-arch image, linux/amd64 and linux/arm64 under one OCI index, as an oci-archive tarball
#       (`ctr -n k8s.io images import --all-platforms OUT.tar`, or `skopeo copy --all oci-archive:OUT.tar
#       docker://REGISTRY/gpu-dra:TAG`); default OUT: target/gpu-dra-image-multi-arch.tar
#
# Libraries: ldd's for this machine's architecture; for the other, the binary's DT_NEEDED resolved
# recursively in Debian's cross sysroot /usr/<triple> (gcc-aarch64-linux-gnu with libc6-dev-arm64-cross, or
# gcc-x86-64-linux-gnu with libc6-dev-amd64-cross), and <triple>-readelf. chroot(1) of the other architecture
# is taken by path: ARM64_CHROOT (or AMD64_CHROOT), e.g. usr/sbin/chroot of Debian's coreutils package for
# that architecture (`apt-get download coreutils:arm64`, then `dpkg-deb -x`).
#   needs: umoci and skopeo (apt-get install umoci skopeo), ldd
set -euo pipefail
cd "$(dirname "$0")/.."
MULTI=
if [ "${1:-}" = --multi-arch ]; then
  MULTI=1
  AMD64_BINARY=${2:?--multi-arch needs the amd64 and the arm64 binary}
  ARM64_BINARY=${3:?--multi-arch needs the amd64 and the arm64 binary}
  NAME=${4:-gpu-dra:dev}
  OUT=${5:-target/gpu-dra-image-multi-arch.tar}
else
  BINARY=${1:-target/release/gpu-dra}
  NAME=${2:-gpu-dra:dev}
  OUT=${3:-target/gpu-dra-image.tar}
fi
for tool in umoci skopeo ldd; do
  command -v "$tool" >/dev/null || { echo "image.sh: $tool is missing (apt-get install umoci skopeo)" >&2; exit 1; }
done

# The OCI architecture of this machine, and each architecture's GNU triple.
case $(uname -m) in
  x86_64) NATIVE=amd64 ;;
  aarch64) NATIVE=arm64 ;;
  *) NATIVE=$(uname -m) ;;
esac
triple() { case $1 in amd64) echo x86_64-linux-gnu ;; arm64) echo aarch64-linux-gnu ;; esac; }

# The files a foreign-architecture ELF loads: its interpreter and its DT_NEEDED, recursively, from the
# cross sysroot; printed as "SOURCE DESTINATION" (destination inside the image).
foreign_libs() { # ARCH FILE...
  local arch=$1 t readelf sysroot
  shift
  t=$(triple "$arch")
  readelf=$t-readelf
  sysroot=/usr/$t
  command -v "$readelf" >/dev/null && [ -d "$sysroot/lib" ] ||
    { echo "image.sh: $arch needs $readelf and the sysroot $sysroot (apt-get install gcc-${t//_/-} libc6-dev-$arch-cross)" >&2; return 1; }
  local -A seen=()
  local queue=("$@") file name interp
  for file in "$@"; do
    interp=$("$readelf" -l "$file" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')
    [ -z "$interp" ] || [ -n "${seen[$interp]:-}" ] || { seen[$interp]=1; echo "$sysroot/lib/$(basename "$interp") $interp"; }
  done
  while [ ${#queue[@]} -gt 0 ]; do
    file=${queue[0]}
    queue=("${queue[@]:1}")
    for name in $("$readelf" -d "$file" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
      [ -z "${seen[$name]:-}" ] || continue
      seen[$name]=1
      [ -e "$sysroot/lib/$name" ] || { echo "image.sh: $name (needed by $file) not in $sysroot/lib" >&2; return 1; }
      echo "$sysroot/lib/$name /lib/$t/$name"
      queue+=("$sysroot/lib/$name")
    done
  done
}

# Lays out one architecture's root filesystem in ROOT.
layout() { # ARCH BINARY ROOT
  local arch=$1 binary=$2 root=$3 chroot_program lib
  [ -x "$binary" ] || { echo "image.sh: no binary at $binary (cargo build --release)" >&2; return 1; }
  install -D -m 0755 "$binary" "$root/usr/local/bin/gpu-dra"
  # chroot(1), as in the Dockerfile's Debian base: the plugin runs the driver's nvidia-smi inside the
  # driver root with it (src/gpu/driver_exec.rs).
  if [ "$arch" = "$NATIVE" ]; then
    chroot_program=$(command -v chroot || echo /usr/sbin/chroot)
  else
    local var=${arch^^}_CHROOT
    chroot_program=${!var:-}
    [ -x "$chroot_program" ] || { echo "image.sh: set $var to a chroot(1) built for $arch" >&2; return 1; }
  fi
  install -D -m 0755 "$chroot_program" "$root/usr/sbin/chroot"
  # The loader and every library the binary and chroot load, at the paths their loader looks in.
  if [ "$arch" = "$NATIVE" ]; then
    for lib in $( (ldd "$binary"; ldd "$chroot_program") | grep -o '/[^ ]*' | sort -u); do
      mkdir -p "$root$(dirname "$lib")"
      cp -L "$lib" "$root$lib"
    done
  else
    local source destination
    while read -r source destination; do
      mkdir -p "$root$(dirname "$destination")"
      cp -L "$source" "$root$destination"
    done < <(foreign_libs "$arch" "$binary" "$chroot_program")
  fi
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  fi
  mkdir -p "$root/tmp" && chmod 1777 "$root/tmp"
}

WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
umoci init --layout "$WORK/oci" >/dev/null
# One image (manifest and config) per architecture in the layout, tagged by architecture.
image() { # ARCH BINARY
  local arch=$1
  umoci new --image "$WORK/oci:$arch"
  umoci unpack --image "$WORK/oci:$arch" "$WORK/bundle-$arch" >/dev/null
  layout "$arch" "$2" "$WORK/bundle-$arch/rootfs"
  umoci repack --image "$WORK/oci:$arch" "$WORK/bundle-$arch" >/dev/null
  umoci config --image "$WORK/oci:$arch" --os linux --architecture "$arch" \
    --config.entrypoint /usr/local/bin/gpu-dra --config.cmd plugin \
    --config.env PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin >/dev/null
  echo "linux/$arch: $(du -sh "$WORK/bundle-$arch/rootfs" | cut -f1) unpacked"
}
mkdir -p "$(dirname "$OUT")"
rm -f "$OUT"
if [ -z "$MULTI" ]; then
  image "$NATIVE" "$BINARY" >/dev/null
  skopeo copy --quiet "oci:$WORK/oci:$NATIVE" "docker-archive:$OUT:$NAME"
  echo "$OUT: $NAME, $(du -h "$OUT" | cut -f1) ($(du -sh "$WORK/bundle-$NATIVE/rootfs" | cut -f1) unpacked)"
  exit 0
fi
image amd64 "$AMD64_BINARY"
image arm64 "$ARM64_BINARY"
# The OCI index: both manifests under NAME's tag, each with its platform, as a registry serves a multi-arch
# image. umoci's own index.json lists the per-architecture tags; the image's is written beside it.
TAG=$(python3 - "$WORK/oci" "$NAME" <<'EOF_PY'
import hashlib, json, os, sys
layout, name = sys.argv[1], sys.argv[2]
blobs = os.path.join(layout, "blobs", "sha256")
def blob(digest):
    with open(os.path.join(blobs, digest.split(":", 1)[1]), "rb") as f:
        return json.load(f)
top = json.load(open(os.path.join(layout, "index.json")))
manifests = []
for arch in ("amd64", "arm64"):
    entry = next(m for m in top["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == arch)
    config = blob(blob(entry["digest"])["config"]["digest"])
    assert config["architecture"] == arch and config["os"] == "linux", config
    manifests.append({"mediaType": entry["mediaType"], "digest": entry["digest"], "size": entry["size"],
                      "platform": {"architecture": arch, "os": "linux"}})
index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                    "manifests": manifests}, indent=1).encode()
digest = hashlib.sha256(index).hexdigest()
with open(os.path.join(blobs, digest), "wb") as f:
    f.write(index)
tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
top["manifests"].append({"mediaType": "application/vnd.oci.image.index.v1+json", "digest": "sha256:" + digest,
                         "size": len(index), "annotations": {"org.opencontainers.image.ref.name": tag}})
json.dump(top, open(os.path.join(layout, "index.json"), "w"))
print(tag)
EOF_PY
)
skopeo copy --quiet --all "oci:$WORK/oci:$TAG" "oci-archive:$OUT:$NAME"
echo "$OUT: $NAME for linux/amd64 and linux/arm64 (one OCI index), $(du -h "$OUT" | cut -f1)"
