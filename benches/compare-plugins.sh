#!/usr/bin/env bash
# Compares this checkout's plugin with an earlier commit's on the prepare benchmark, fairly: the earlier
# commit's own benchmark client drives both plugin binaries, one run each in turn, ROUNDS times, and the
# medians are printed. Interleaving matters on a shared machine, where speed drifts over minutes.
# usage: benches/compare-plugins.sh BASE_COMMIT [ROUNDS]      (ROUNDS default 5; run from the project root)
# CLIENT=head drives both with this checkout's client instead, for figures the base's client does not
# print (prepare and unprepare apart, the plugin's CPU time); the plugins' command line must match.
# The base is built in a git worktree under ${TMPDIR:-/tmp} with this checkout's target directory, so only
# the gpu-dra crate is compiled twice (a base with another .cargo/config.toml compiles everything again).
# BASE_PLUGIN=<binary> runs that binary as the base's plugin instead of building one (with CLIENT=head; the
# base commit then only names it); HEAD_PLUGIN=<binary> does the same for this checkout's plugin. Needs a base whose kubelet double this checkout's plugin accepts
# (every commit does: the plugin accepts any :authority). Where the checkout has the `doubles` feature,
# its plugin is the node binary of `cargo build --release`, not the benchmark's own build (which has the doubles).
set -euo pipefail
BASE=${1:?usage: benches/compare-plugins.sh BASE_COMMIT [ROUNDS]}
ROUNDS=${2:-5}
CLIENT=${CLIENT:-base}
ROOT=$(git rev-parse --show-toplevel)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-dra-compare.XXXXXX")
cleanup() { git -C "$ROOT" worktree remove --force "$WORK/base" >/dev/null 2>&1 || true; rm -rf "$WORK"; }
trap cleanup EXIT

build() { # dir, name: builds the prepare benchmark there and keeps its plugin binary and client as name
  local exe
  exe=$(cd "$1" && CARGO_TARGET_DIR=$TARGET cargo bench --bench prepare --no-run 2>&1 |
    sed -n 's/.*Executable benches\/prepare.rs (\(.*\))/\1/p')
  [ -n "$exe" ] || { echo "compare-plugins.sh: building the benchmark in $1 failed" >&2; exit 1; }
  case $exe in /*) ;; *) exe=$1/$exe ;; esac
  if [ "$2" = head ] && [ -n "${HEAD_PLUGIN:-}" ]; then
    cp "$exe" "$WORK/client-$2"
    cp "$HEAD_PLUGIN" "$WORK/gpu-dra-$2"
    return
  fi
  if grep -q '^doubles = ' "$1/Cargo.toml"; then
    (cd "$1" && CARGO_TARGET_DIR=$TARGET cargo build --release --bin gpu-dra 2>/dev/null)
  fi
  cp "$TARGET/release/gpu-dra" "$WORK/gpu-dra-$2"
  cp "$exe" "$WORK/client-$2"
}

build "$ROOT" head
if [ -n "${BASE_PLUGIN:-}" ]; then
  [ "$CLIENT" = head ] || { echo "compare-plugins.sh: BASE_PLUGIN needs CLIENT=head" >&2; exit 1; }
  cp "$BASE_PLUGIN" "$WORK/gpu-dra-base"
else
  git -C "$ROOT" worktree add --detach "$WORK/base" "$BASE" >/dev/null
  echo "building $(git -C "$ROOT" rev-parse --short HEAD) and $BASE ..." >&2
  build "$WORK/base" base
fi

# The client runs the plugin at target/release/gpu-dra; each run puts the plugin under test there.
for round in $(seq "$ROUNDS"); do
  for plugin in base head; do
    cp "$WORK/gpu-dra-$plugin" "$TARGET/release/gpu-dra"
    echo "##### $plugin round $round"
    "$WORK/client-$CLIENT"
  done
done > "$WORK/runs.log" 2>&1
cp "$WORK/gpu-dra-head" "$TARGET/release/gpu-dra"

python3 - "$WORK/runs.log" "$BASE" "$CLIENT" <<'EOF'
import re, statistics, sys
text, base, client = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3]
runs = re.split(r"##### (\w+) round \d+\n", text)[1:]
rows = {}
for plugin, body in zip(runs[::2], runs[1::2]):
    for section in re.split(r"\n== ", "\n" + body)[1:]:
        layout = section.splitlines()[0]
        if "claims/s" not in section:
            continue
        def num(pattern):
            found = re.search(pattern, section)
            return float(found.group(1)) if found else float("nan")
        rows.setdefault(layout, {}).setdefault(plugin, []).append(
            (num(r"p50 ([\d.]+) ms"), num(r"p99 ([\d.]+) ms"),
             num(r"prepare alone: p50 ([\d.]+) ms"), num(r"prepare alone: p50 [\d.]+ ms, p99 ([\d.]+) ms"),
             num(r"unprepare alone: p50 ([\d.]+) ms"),
             num(r"CPU time ([\d.]+) ms per round trip"),
             num(r"(\d+) claims/s"), num(r"burst: ([\d.]+) MiB"),
             num(r"RssAnon ([\d.]+) MiB"), num(r"PSS ([\d.]+) MiB"), num(r"RSS ([\d.]+) MiB"),
             num(r"CPU time ([\d.]+) ms per claim")))
for layout, plugins in rows.items():
    print(f"== {layout}: medians of {len(plugins['head'])} interleaved runs, {base if client == 'base' else 'this checkout'}'s client")
    for plugin in ("base", "head"):
        p50, p99, prep50, prep99, unprep50, cpu, rate, rss, anon, pss, rss_new, burst_cpu = (statistics.median(c) for c in zip(*plugins[plugin]))
        apart = "" if prep50 != prep50 else f" (prepare p50 {prep50:.2f} ms, p99 {prep99:.2f} ms; unprepare p50 {unprep50:.2f} ms)"
        cost = "" if cpu != cpu else f", plugin CPU {cpu:.2f} ms per round trip"
        cost += "" if burst_cpu != burst_cpu else f", burst CPU {burst_cpu:.2f} ms per claim"
        memory = f"resident {rss:.1f} MiB" if anon != anon else f"RssAnon {anon:.1f} MiB, PSS {pss:.1f} MiB, RSS {rss_new:.1f} MiB"
        print(f"  {plugin:4} plugin: round trip p50 {p50:.2f} ms, p99 {p99:.2f} ms{apart}{cost}, burst {rate:.0f} claims/s, {memory}")
EOF
