#!/usr/bin/env bash
# The ComputeDomain job on the real control plane (../shared/realk8s/up.sh; no kubelet): seven Nodes made
# Ready by node.sh (one without an NVLink fabric, two of clique 1, four of clique 0), our CRDs and
# DeviceClasses applied, then tests/real_cluster_domains.rs runs the plugins, kubelet doubles, the IMEX
# daemons' pod runners and the controller in one process against that API server: the real scheduler must
# put the job's four workers on clique 0's four nodes, leave a fifth Pending (and `gpu-dra explain` say
# why), the API server must take the channel's taint when a daemon dies, and the garbage collector must
# take the domain's template with the domain.
#
#   KUBECONFIG=/tmp/k8s/admin.kubeconfig e2e/real-cluster-compute-domain.sh
#
# With REAL_NODE=1 it runs the job's second case instead, with the real node of ../shared/realk8s/node in the
# clique (up-node.sh, then, as root: the image of a --features doubles build imported as gpu-dra:dev with
# e2e/image.sh and `ctr -n k8s.io images import`, and GPU_DRA_BIN=<that binary> start-plugin.sh KUBECONFIG
# STATE --fake-profile gb200-nvl72 --mps-daemon-image gpu-dra:dev --node-ip <node-1's InternalIP>): the real
# kubelet prepares the worker placed there, runs the IMEX daemon's Pod, and containerd makes the channel's
# device node in the worker's container. With IN_CLUSTER_CONTROLLER=1 no controller runs in the test: install
# deploy/ (e2e/real-node, with the gb200-nvl72 profile in the fake profile's ConfigMap) so that the plugin runs as
# the DaemonSet's pod and the controller as its Deployment's (host network and pinned to node-1, as the plugin's
# pod is in e2e/real-node), under the real RBAC and admission policies.
#
# Prints ok lines; exits non-zero when the test fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REALK8S="${REALK8S:-$ROOT/../shared/realk8s}"
: "${KUBECONFIG:?point KUBECONFIG at the control plane from up.sh}"
for n in cd-a0 cd-a1 cd-a2 cd-n1 cd-n2 cd-n3 cd-n4; do
  kubectl get node "$n" >/dev/null 2>&1 || "$REALK8S/node.sh" "$n" >/dev/null
done
kubectl apply -f "$ROOT/crd/" >/dev/null
kubectl apply -f "$ROOT/deploy/base/deviceclasses.yaml" >/dev/null
for ns in team gpu-dra; do kubectl get namespace "$ns" >/dev/null 2>&1 || kubectl create namespace "$ns" >/dev/null; done
cd "$ROOT"
# The real node's plugin publishes clique-0 channels too, so the seven-node case runs without it.
filter=a_job_on_the_real_scheduler_stays_in_its_clique
[ "${REAL_NODE:-}" = 1 ] && filter=a_worker_on_the_real_node_runs_with_the_channel_in_its_container
cargo test --test real_cluster_domains -- --ignored --nocapture --test-threads 1 $filter 2>&1 | grep -E "^(ok|      |test |thread|  left|  right|FAIL)|panicked|test result"
