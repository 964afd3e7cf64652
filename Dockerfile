# syntax=docker/dockerfile:1
# The gpu-dra image: the kubelet plugin and its CLI in /usr/local/bin/gpu-dra.
# Build with the target/ folder left out of the context (e2e/run.sh streams a tar without it):
#   tar --exclude=./target --exclude=./.git -cf - . | docker build -t gpu-dra:dev -f Dockerfile -

FROM rust:1-bookworm AS builder
WORKDIR /src
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
    cargo build --release --locked ${FEATURES:+--features "$FEATURES"} \
    && install -m 0755 target/release/gpu-dra /usr/local/bin/gpu-dra

FROM debian:bookworm-slim
# libnvidia-ml comes from the host's driver at run time (NVIDIA_DRIVER_ROOT), not from the image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /usr/local/bin/gpu-dra /usr/local/bin/gpu-dra
ENTRYPOINT ["/usr/local/bin/gpu-dra"]
CMD ["plugin"]
