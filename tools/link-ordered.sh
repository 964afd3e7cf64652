#!/bin/sh
# The linker for x86_64 Linux builds (.cargo/config.toml). For an optimised gpu-dra binary it lays out
# the functions the plugin runs (tools/code-order.txt) side by side at the start of .text; everything
# else passes straight to cc.
#
# Why: the kernel maps a binary's code in 64 KiB windows around each page the process touches, and the
# functions a plugin runs are spread over all 19 MB of .text, so nearly all of it was resident (14 of
# 18 MiB). Laid out together, only what runs is mapped (BENCHMARKS.md, "Memory").
#
# The list holds demangled names, which stay the same from build to build; the mangled names lld's
# --symbol-ordering-file wants carry per-build crate hashes. So the binary is linked once, its symbol
# table maps the names, and it is linked again in that order. Functions missing from a build (renamed,
# inlined) are skipped: the layout degrades, the binary stays correct.
set -eu

out=""
previous=""
for arg in "$@"; do
    if [ "$previous" = "-o" ]; then out="$arg"; fi
    previous="$arg"
done
order="$(dirname "$0")/code-order.txt"

case "$out" in
*/debug/*) exec cc "$@" ;;            # tests and debug builds: layout does not matter
*/deps/gpu_dra-*.*) exec cc "$@" ;;   # the library's own artefacts
*/deps/gpu_dra-*) ;;                  # the gpu-dra binary (and the library's test harness)
*) exec cc "$@" ;;
esac
case " $* " in
*" -fuse-ld=lld "*) ;;
*) exec cc "$@" ;;                    # --symbol-ordering-file is lld's
esac
[ -f "$order" ] || exec cc "$@"

cc "$@"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
# One line per defined function, in the same order both times: mangled, then demangled.
nm --defined-only --no-sort "$out" | awk '$2 ~ /^[tTwW]$/ { print $3 }' >"$scratch/mangled"
nm --defined-only --no-sort --demangle "$out" |
    awk '$2 ~ /^[tTwW]$/ { sub(/^[^ ]+ [^ ]+ /, ""); print }' >"$scratch/demangled"
paste "$scratch/demangled" "$scratch/mangled" >"$scratch/names"
# Mangled names in the list's order; a demangled name shared by several functions orders them all.
awk -F '\t' 'NR == FNR { if (!($0 in rank)) rank[$0] = FNR; next }
    ($1 in rank) { print rank[$1] "\t" $2 }' "$order" "$scratch/names" |
    sort -n -s -k1,1 | cut -f2 >"$scratch/symbols"
cc "$@" -Wl,--symbol-ordering-file="$scratch/symbols" -Wl,--no-warn-symbol-ordering
