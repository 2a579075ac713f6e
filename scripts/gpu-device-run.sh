#!/usr/bin/env bash
# One call of the device tool, time-boxed: scripts/gpu-check.sh in up to three rounds of
# steps (the correctness check first, then the benchmarks), all within BUDGET seconds, with
# the logs and reports packed into $OUT/gc.tgz (scratch logits, models and per-case JSON left
# out: the device returns few files) and a summary printed last. Copied into gpu-pack/ by
# scripts/gpu-pack.sh; run there as
#   bash gpu-pack/gpu-device-run.sh [BUDGET]         # default 560 s: under a 600 s call
# STEPS1 / STEPS2 / STEPS3 name each round's steps (gpu-check.sh's ONLY); a round that finds
# the budget spent still gets 5 s, so it prints what it skipped rather than nothing.
set -u
start=$(date +%s)
budget=${1:-560}
left() {
    local l=$((budget - ($(date +%s) - start)))
    [ "$l" -lt 5 ] && l=5
    echo "$l"
}
final=${OUT:?OUT must name the folder whose files come back}
export OUT=/tmp/gc
mkdir -p "$OUT"
here="$(cd "$(dirname "$0")" && pwd)"
pack() {
    tar czf "$final/gc.tgz" --exclude='*.f32' --exclude='cache' --exclude='L*_B*.json' -C /tmp gc
    cp "$OUT/check.log" "$final/" 2>/dev/null
    echo "=== summary ($(($(date +%s) - start)) s)"
    grep -E "^=== |test result|FAILED|panicked|ERROR SUMMARY|no exit .* after SIGINT|engine stopped|engine (eager|graphs)|oracle L" \
        "$OUT/check.log" | head -80
    for f in "$OUT"/oracle/*.md; do
        [ -f "$f" ] && grep -E "^###|^\| (L|[0-9])" "$f" | awk -F'|' '{print $2,$3,$4,$5,$6,$7}'
    done | head -80
}
trap pack EXIT
ONLY="${STEPS1:-nvrtc_compile gpu_kernels gpu_parity}" timeout "$(left)" bash "$here/gpu-check.sh"
ONLY="${STEPS2:-oracle served_oracle memcheck oracle_fp8}" timeout "$(left)" bash "$here/gpu-check.sh"
ONLY="${STEPS3:-gpu_bench kernel_bench peers}" timeout "$(left)" bash "$here/gpu-check.sh"
