#!/usr/bin/env bash
# Deletes the kind cluster that e2e/run.sh created.
set -euo pipefail
CLUSTER_NAME="${CLUSTER_NAME:-gpu-dra-e2e}"
command -v kind >/dev/null || { echo "kind is not on PATH" >&2; exit 1; }
kind delete cluster --name "$CLUSTER_NAME"
