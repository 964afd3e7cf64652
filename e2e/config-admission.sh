#!/usr/bin/env bash
# Tries the admission policy on device configs (deploy/base/config-admission-policy.yaml) against a real API
# server: every case of tests/manifests/device-config-cases.json as a claim and as a claim template (server-
# side dry runs), admitted or refused with exactly the plugin's message; the same configs under another
# driver, all admitted; a claim in v1beta2 and v1beta1; and updates of a claim and a template made before the
# policy with a malformed config, which must still go through. A control plane from ../shared/realk8s/up.sh
# is enough (no node, no kubelet).
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/config-admission.sh
#
# Each check prints `ok` or `FAIL` (with the server's answer when it differs); the exit status is the
# number of failures.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
POLICY=gpu-dra-device-configs
CASES="$ROOT/tests/manifests/device-config-cases.json"
NS=default
failures=0
checks=0

# object KIND DRIVER PARAMETERS [APIVERSION]: a claim or template named cfg-adm whose config 0 is another
# driver's (malformed for ours) and config 1 is DRIVER's with PARAMETERS.
object() {
  jq -nc --arg kind "$1" --arg driver "$2" --argjson parameters "$3" --arg version "${4:-v1}" '
    {requests: [{name: "gpu"} + (if $version == "v1beta1" then {deviceClassName: "gpu.dra.dev"}
                                 else {exactly: {deviceClassName: "gpu.dra.dev"}} end)],
     config: [{opaque: {driver: "other.example.com", parameters: {apiVersion: 1, stray: true}}},
              {requests: ["gpu"], opaque: {driver: $driver, parameters: $parameters}}]} as $devices
    | {apiVersion: ("resource.k8s.io/" + $version), kind: $kind, metadata: {name: "cfg-adm", namespace: "default"},
       spec: (if $kind == "ResourceClaim" then {devices: $devices} else {spec: {devices: $devices}} end)}'
}

# expect WHAT WANT COMMAND...: WANT is `admitted` or the message the policy must refuse with.
expect() {
  local what=$1 want=$2 out rc got
  shift 2
  out=$("$@" 2>&1)
  rc=$?
  checks=$((checks + 1))
  if [ $rc -eq 0 ]; then
    got=admitted
  elif grep -q "denied request: " <<<"$out"; then
    got=$(sed -n 's/.*ValidatingAdmissionPolicy .* denied request: //p' <<<"$out" | head -n1)
  else
    got="refused otherwise: $(tr '\n' ' ' <<<"$out" | cut -c1-300)"
  fi
  if [ "$got" = "$want" ]; then
    printf 'ok    %s\n' "$what"
  else
    printf 'FAIL  %s\n        want: %s\n        got:  %s\n' "$what" "$want" "$got"
    failures=$((failures + 1))
  fi
}

dry_run() { kubectl create --dry-run=server -o name -f - <<<"$1"; }

# A claim and a template with a malformed config, made before the policy exists (and left over from an
# earlier run whose policy refused to release them).
kubectl delete validatingadmissionpolicybinding $POLICY --ignore-not-found >/dev/null
kubectl delete validatingadmissionpolicy $POLICY --ignore-not-found >/dev/null
malformed='{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": {}}'
# The API server needs a few seconds to load or drop a policy.
for _ in $(seq 60); do
  dry_run "$(object ResourceClaim gpu.dra.dev "$malformed")" >/dev/null 2>&1 && break
  sleep 0.5
done
release() { # the objects made before the policy, gone; no wait if a finalizer stays
  for kind in resourceclaim resourceclaimtemplate; do
    kubectl -n $NS patch $kind cfg-adm-old --type=merge -p '{"metadata": {"finalizers": null}}' >/dev/null 2>&1
    kubectl -n $NS delete $kind cfg-adm-old --ignore-not-found --wait=false >/dev/null
  done
}
release
for _ in $(seq 20); do
  kubectl -n $NS get resourceclaim cfg-adm-old >/dev/null 2>&1 ||
    kubectl -n $NS get resourceclaimtemplate cfg-adm-old >/dev/null 2>&1 || break
  sleep 0.5
done
for kind in ResourceClaim ResourceClaimTemplate; do
  object $kind gpu.dra.dev "$malformed" |
    jq '.metadata.name = "cfg-adm-old" | .metadata.finalizers = ["gpu-dra.dev/e2e"]' |
    kubectl create -f - >/dev/null || exit 1
done

kubectl apply --validate=false -f "$ROOT/deploy/base/config-admission-policy.yaml" >/dev/null || exit 1
for _ in $(seq 60); do
  dry_run "$(object ResourceClaim gpu.dra.dev "$malformed")" >/dev/null 2>&1 || break
  sleep 0.5
done
warnings=$(kubectl get validatingadmissionpolicy $POLICY -o jsonpath='{.status.typeChecking.expressionWarnings}')
checks=$((checks + 1))
if [ -z "$warnings" ]; then
  echo "ok    the API server's type check has no warning on the policy"
else
  echo "FAIL  type-check warnings: $warnings"
  failures=$((failures + 1))
fi

echo "== each case, as a claim and as a template"
count=$(jq length "$CASES")
for i in $(seq 0 $((count - 1))); do
  what=$(jq -r ".[$i].what" "$CASES")
  parameters=$(jq -c ".[$i].parameters" "$CASES")
  error=$(jq -r ".[$i].error // empty" "$CASES")
  for kind in ResourceClaim ResourceClaimTemplate; do
    field=spec.devices.config
    [ $kind = ResourceClaimTemplate ] && field=spec.spec.devices.config
    want=admitted
    [ -n "$error" ] && want="$field[1].opaque.parameters: $error"
    expect "$kind: $what" "$want" dry_run "$(object $kind gpu.dra.dev "$parameters")"
  done
  # A driver whose name starts with ours is another driver.
  other=other.example.com
  [ $((i % 2)) = 1 ] && other=gpu.dra.dev.example.com
  expect "ResourceClaim: $what, under driver $other" admitted dry_run "$(object ResourceClaim $other "$parameters")"
done

echo "== other API versions (converted to v1 before the policy)"
bad='{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}}'
for version in v1beta2 v1beta1; do
  if kubectl api-versions | grep -x "resource.k8s.io/$version" >/dev/null; then
    expect "ResourceClaim in $version" \
      "spec.devices.config[1].opaque.parameters: sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100" \
      dry_run "$(object ResourceClaim gpu.dra.dev "$bad" $version)"
  else
    echo "skip  resource.k8s.io/$version is not served"
  fi
done

echo "== the CEL cost budget"
# 32 configs (the most the API server allows) of about 8 KiB each (it allows 10 KiB), each with 400
# per-device limits: the policy must decide, not run out of budget.
big() { # KEY_PREFIX: the per-device keys' prefix
  jq -nc --arg prefix "$1" '
    {apiVersion: "gpu.dra.dev/v1alpha1", kind: "GpuConfig", sharing: {strategy: "MPS", mpsConfig: {
      defaultActiveThreadPercentage: 50, defaultPinnedDeviceMemoryLimit: "10Gi",
      defaultPerDevicePinnedMemoryLimit: ([range(400) | {key: "\($prefix)\(.)", value: "\(. + 1)Gi"}] | from_entries)}}}
    | {opaque: {driver: "gpu.dra.dev", parameters: .}} as $config
    | {apiVersion: "resource.k8s.io/v1", kind: "ResourceClaim", metadata: {name: "cfg-adm-big", namespace: "default"},
       spec: {devices: {requests: [{name: "gpu", exactly: {deviceClassName: "gpu.dra.dev"}}],
                        config: [range(32) | $config]}}}'
}
expect "32 configs of 400 per-device limits each" admitted dry_run "$(big gpu-)"
expect "32 configs of 400 per-device limits each, all under names that are not devices" \
  "spec.devices.config[0].opaque.parameters: sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[device-0]: not a device name of this driver (gpu-<minor> or gpu-<minor>-mig-...)" \
  dry_run "$(big device-)"

echo "== objects made before the policy"
expect "a template's labels change (configs unchanged)" admitted \
  kubectl -n $NS label resourceclaimtemplate cfg-adm-old e2e=relabelled
expect "a claim's finalizer is removed (configs unchanged)" admitted \
  kubectl -n $NS patch resourceclaim cfg-adm-old --type=merge -p '{"metadata": {"finalizers": null}}'
release

echo "checks: $checks, failures: $failures"
exit "$failures"
