#!/usr/bin/env bash
# The Helm chart's output applied to a real API server (../shared/realk8s/up.sh is enough, no kubelet):
# the chart rendered by Helm's own engine (tests/manifests/helm_render.py, helm-python-sdk) with its
# defaults, with deploy/helm/fake-values.yaml and with a driver root of the GPU Operator; each render is
# applied server-side (the API server validates every object, the CRD first), read back, then deleted.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/helm-real-cluster.sh     (from the project root, gpu-dra not installed)
#
# Each check prints PASS or FAIL; the exit status is the number of failures.
set -uo pipefail
: "${KUBECONFIG:?set KUBECONFIG to the admin kubeconfig of the real cluster}"
export KUBECONFIG
cd "$(dirname "$0")/.."
failures=0
ok() { echo "PASS $*"; }
bad() { echo "FAIL $*"; failures=$((failures + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
if kubectl get namespace gpu-dra >/dev/null 2>&1; then
  echo "helm-real-cluster.sh: namespace gpu-dra exists; uninstall gpu-dra first" >&2; exit 1
fi
# The chart's objects, the CRD and the Namespace first, as `helm install` orders them (the render keeps
# the templates' order, and a namespaced object cannot be applied before its Namespace).
render() {
  python3 tests/manifests/helm_render.py render deploy/helm/gpu-dra --yaml --include-crds "$@" | python3 -c '
import re, sys
docs = [d for d in re.split(r"^---\s*$", sys.stdin.read(), flags=re.M) if d.strip()]
first = lambda d: 0 if re.search(r"^kind: (CustomResourceDefinition|Namespace)$", d, re.M) else 1
print("\n---\n".join(sorted(docs, key=first)))'
}
# case NAME [render flags...]
case_of() {
  local name=$1; shift
  local out; out=$(mktemp)
  echo "----- $name"
  render "$@" > "$out" || { bad "$name: the chart renders"; rm -f "$out"; return; }
  local objects; objects=$(kubectl apply --server-side --force-conflicts -f "$out" -o name 2>&1)
  echo "$objects" | tr '\n' ' '; echo
  check "$name: the API server took all $(grep -c '^kind:' "$out") objects" \
    test "$(grep -c '/' <<<"$objects")" = "$(grep -c '^kind:' "$out")"
  check "$name: every object reads back" kubectl get -f "$out" -o name
  local ds; ds=$(kubectl get daemonset -n gpu-dra gpu-dra-plugin -o json)
  echo "$ds" | jq -c '{image: .spec.template.spec.containers[0].image, env: [.spec.template.spec.containers[0].env[] | select(.value) | "\(.name)=\(.value)"], volumes: [.spec.template.spec.volumes[] | "\(.name)=\(.hostPath.path // .configMap.name)"]}'
  CHECKS_OF_CASE "$ds"
  kubectl delete -f "$out" --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1
  rm -f "$out"
}

CHECKS_OF_CASE() { check "defaults: GPU_BACKEND=nvml, driver root / on both sides" \
  bash -c "jq -e '.spec.template.spec | (.containers[0].env[] | select(.name==\"GPU_BACKEND\").value == \"nvml\") and (.volumes[] | select(.name==\"driver-root\").hostPath.path == \"/\")' <<<'$1' >/dev/null"; }
case_of defaults

CHECKS_OF_CASE() { check "fake values: GPU_BACKEND=fake, MIG_MODE=dynamic, the profile ConfigMap, no driver root" \
  bash -c "jq -e '.spec.template.spec | (.containers[0].env[] | select(.name==\"GPU_BACKEND\").value == \"fake\") and (.containers[0].env[] | select(.name==\"MIG_MODE\").value == \"dynamic\") and any(.volumes[]; .configMap.name == \"gpu-dra-fake-profile\") and all(.volumes[]; .name != \"driver-root\")' <<<'$1' >/dev/null"; }
case_of fake --values deploy/helm/fake-values.yaml

CHECKS_OF_CASE() { check "driverRoot=/run/nvidia/driver: NVIDIA_DRIVER_ROOT and the driver-root volume together" \
  bash -c "jq -e '.spec.template.spec | (.containers[0].env[] | select(.name==\"NVIDIA_DRIVER_ROOT\").value == \"/run/nvidia/driver\") and (.volumes[] | select(.name==\"driver-root\").hostPath.path == \"/run/nvidia/driver\")' <<<'$1' >/dev/null"; }
case_of gpu-operator --set-json '{"driverRoot": "/run/nvidia/driver", "image": {"repository": "registry.example.com/gpu-dra", "tag": "v0.1.0"}}'

echo "failures: $failures"
exit $failures
