# syntax=docker/dockerfile:1
# The gpu-dra image: the kubelet plugin and its CLI in /usr/local/bin/gpu-dra, for linux/amd64 and
# linux/arm64 (Grace hosts). Build with the target/ folder left out of the context (e2e/run.sh streams a tar
# without it):
#   tar --exclude=./target --exclude=./.git -cf - . | docker build -t gpu-dra:dev -f Dockerfile -
# One multi-arch image (buildx; the builder runs on the build machine's platform and cross-compiles, so no
# emulation is needed):
#   tar --exclude=./target --exclude=./.git -cf - . |
#     docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/gpu-dra:TAG --push -f Dockerfile -

FROM --platform=$BUILDPLATFORM rust:1-bookworm AS builder
ARG TARGETARCH
WORKDIR /src
# The Rust target and, when it is not the builder's own, Debian's cross compiler and libc for it (ring
# builds C and assembly): /rust-target names the target, /cross-cc the compiler (empty when native).
RUN set -eu; \
    case "$TARGETARCH" in \
      amd64) triple=x86_64-unknown-linux-gnu cc=x86_64-linux-gnu-gcc package=gcc-x86-64-linux-gnu ;; \
      arm64) triple=aarch64-unknown-linux-gnu cc=aarch64-linux-gnu-gcc package=gcc-aarch64-linux-gnu ;; \
      *) echo "unsupported TARGETARCH $TARGETARCH (amd64, arm64)" >&2; exit 1 ;; \
    esac; \
    echo "$triple" > /rust-target; \
    if [ "$(rustc -vV | sed -n 's/^host: //p')" = "$triple" ]; then \
      : > /cross-cc; \
    else \
      apt-get update \
      && apt-get install -y --no-install-recommends "$package" "libc6-dev-$TARGETARCH-cross" \
      && rm -rf /var/lib/apt/lists/* \
      && rustup target add "$triple" \
      && echo "$cc" > /cross-cc; \
    fi
# Only what the node binary is built from; benches/ is there because Cargo.toml names its targets.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
COPY src ./src
COPY benches ./benches
# Compiled only with FEATURES=doubles (e2e/run.sh: MPS on the fake backend needs the stand-in).
COPY tests/support ./tests/support
ARG FEATURES=
# Cache mounts keep the registry and the build between image builds; the binary is copied out of
# the cached target folder in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    set -eu; \
    triple=$(cat /rust-target); cc=$(cat /cross-cc); \
    if [ -n "$cc" ]; then \
      export "CC_$(echo "$triple" | tr - _)=$cc" \
        "CARGO_TARGET_$(echo "$triple" | tr '[:lower:]-' '[:upper:]_')_LINKER=$cc"; \
    fi; \
    cargo build --release --locked --target "$triple" ${FEATURES:+--features "$FEATURES"} \
    && install -m 0755 "target/$triple/release/gpu-dra" /usr/local/bin/gpu-dra

FROM debian:bookworm-slim
# libnvidia-ml comes from the host's driver at run time (NVIDIA_DRIVER_ROOT), not from the image. The CA
# certificates come from the builder (they are the same on every architecture), so that no step runs in the
# target's architecture and a multi-arch build needs no emulation.
COPY --from=builder /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=builder /usr/local/bin/gpu-dra /usr/local/bin/gpu-dra
ENTRYPOINT ["/usr/local/bin/gpu-dra"]
CMD ["plugin"]
