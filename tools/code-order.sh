#!/bin/sh
# Writes tools/code-order.txt: the functions the plugin runs in `cargo bench --bench prepare` (start-up,
# slice publication, prepares and unprepares one at a time and in a burst, shutdown), which
# tools/link-ordered.sh lays out side by side. Needs valgrind; takes about three minutes.
# Run it again when the benchmark's "laid out first" count falls well below the list's length.
set -eu
cd "$(dirname "$0")/.."

cargo bench --bench prepare --no-run
binary="$PWD/target/release/gpu-dra"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

cat >"$scratch/under-callgrind" <<WRAPPER
#!/bin/sh
exec valgrind --quiet --tool=callgrind --demangle=no --callgrind-out-file=$scratch/callgrind.%p "$binary" "\$@"
WRAPPER
chmod +x "$scratch/under-callgrind"
GPU_DRA_BENCH_PLUGIN="$scratch/under-callgrind" cargo bench --bench prepare >"$scratch/bench.txt"

# Every function callgrind saw run (it names each once, as fn= or cfn=, with its id).
cat "$scratch"/callgrind.* |
    sed -n 's/^c\{0,1\}fn=([0-9]*) //p' | sort -u >"$scratch/ran"
[ -s "$scratch/ran" ] || { echo "callgrind recorded nothing (see $scratch/bench.txt)" >&2; exit 1; }
# The binary's functions by address: address, mangled and demangled name.
nm --defined-only --no-sort "$binary" | awk '$2 ~ /^[tTwW]$/ { print $1 "\t" $3 }' >"$scratch/mangled"
nm --defined-only --no-sort --demangle "$binary" |
    awk '$2 ~ /^[tTwW]$/ { sub(/^[^ ]+ [^ ]+ /, ""); print }' >"$scratch/demangled"
paste "$scratch/mangled" "$scratch/demangled" >"$scratch/names"
# The demangled names of the functions that ran, in address order, each once.
awk -F '\t' 'NR == FNR { ran[$0] = 1; next } ($2 in ran) { print $1 "\t" $3 }' \
    "$scratch/ran" "$scratch/names" |
    sort -s -k1,1 | cut -f2 | awk '!seen[$0]++' >tools/code-order.txt
echo "tools/code-order.txt: $(wc -l <tools/code-order.txt) functions"
