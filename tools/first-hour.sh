#!/usr/bin/env bash
# A newcomer's first hour, as the README promises it: a fresh clone of this repository's HEAD in a new
# directory, an empty CARGO_HOME (every crate downloaded), no pip cache, then the two commands of the README's
# first code block, in order, each timed (wall, CPU, peak RSS). Prints one line per command and the test
# totals; exits non-zero when a command fails. Uses only the Rust toolchain, Python 3 with pip and git.
#
#   tools/first-hour.sh [DIR]     DIR: where to clone (default: a new temp dir; kept, with both logs)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$(mktemp -d /tmp/gpu-dra-first-hour.XXXXXX)}
[ ! -e "$dir/gpu-dra" ] || { echo "first-hour.sh: $dir/gpu-dra exists; name a new directory" >&2; exit 2; }
mkdir -p "$dir/cargo-home"
git clone --quiet "$repo" "$dir/gpu-dra"
cd "$dir/gpu-dra"

# The README's two commands: the first ```sh block, comments dropped.
mapfile -t commands < <(awk '/^```sh$/ {inside=1; next} inside && /^```$/ {exit} inside' README.md |
  sed 's/[[:space:]]*#.*$//' | sed '/^[[:space:]]*$/d')
[ "${#commands[@]}" = 2 ] || { echo "first-hour.sh: README's first block has ${#commands[@]} commands, not 2" >&2; exit 2; }

# rustup's proxies stay on PATH; the toolchain itself lives in RUSTUP_HOME, not in CARGO_HOME.
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
export CARGO_HOME=$dir/cargo-home PIP_NO_CACHE_DIR=1
unset CARGO_TARGET_DIR
echo "clone: $dir/gpu-dra at $(git rev-parse --short HEAD); $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"

# GNU time adds the peak RSS; bash's own `time` (CPU of the children included) where it is missing.
timed() { # timed LOG COMMAND: runs COMMAND with its output to LOG; its times to $dir/time
  if [ -x /usr/bin/time ]; then
    /usr/bin/time -f "wall %e s, CPU %U s user + %S s system, peak RSS %M KiB" -o "$dir/time" \
      bash -c "$2" >"$1" 2>&1
  else
    local TIMEFORMAT="wall %R s, CPU %U s user + %S s system"
    { time bash -c "$2" >"$1" 2>&1; } 2>"$dir/time"
  fi
}
status=0
for i in 0 1; do
  log=$dir/command-$((i + 1)).log
  timed "$log" "${commands[$i]}" || status=1
  echo "${commands[$i]}: $(tail -1 "$dir/time") (log: $log)"
done
grep -h '^test result:' "$dir/command-2.log" |
  awk '{p += $4; f += $6; i += $8; n++} END {printf "tests: %d passed, %d failed, %d ignored, in %d test binaries\n", p, f, i, n}'
grep -q '^Demo complete\.' "$dir/command-1.log" || { echo "the demo did not say \"Demo complete.\""; status=1; }
exit $status
