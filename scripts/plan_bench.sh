#!/usr/bin/env bash
# How fast `sim plan` searches: 1,000 configurations (batch size x chunk size x prefix
# caching x KV blocks) of each seed workload, without and with the capacity search, on this
# machine's cores (a capacity search only where the arrivals have a rate). Prints the wall
# time and peak memory of each plan.
#
#   bash scripts/plan_bench.sh      (about half a minute on 2 cores, after the build)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p infer-sim --bin sim
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
vary=(--vary server.max_batch_size=4,8,12,16,20,24,28,32,40,48
      --vary server.prefill_chunk_size=128,256,384,512,768,1024,1536,2048,3072,4096
      --vary server.prefix_caching=false,true
      --vary server.num_gpu_blocks=1024,1280,1536,1792,2048)
printf '%-20s %-9s %8s %10s %9s  %s\n' workload search configs wall_s peak_MiB best
for w in baseline continuous_batching paged_attention chunked_prefill prefix_caching; do
  for capacity in "" --capacity; do
    # A capacity search varies the arrival rate: not for sequential or burst arrivals.
    if [ -n "$capacity" ] && grep -Eq '^kind = "(sequential|burst|concurrency)"' "scenarios/$w.toml"; then
      printf '%-20s %-9s %s\n' "$w" "$capacity" "(its arrivals have no rate)"
      continue
    fi
    /usr/bin/time -f '%e %M' -o "$out/time" ./target/release/sim plan "scenarios/$w.toml" \
      --slo ttft:2000 tpot:60 "${vary[@]}" $capacity --out "$out/$w$capacity" --quiet > "$out/log"
    read -r wall kib < "$out/time"
    configs=$(($(wc -l < "$out/$w$capacity/plan.csv") - 1))
    best=$(sed -n 's/^best: //p' "$out/log")
    printf '%-20s %-9s %8d %10.2f %9.1f  %s\n' "$w" "${capacity:-rate}" "$configs" "$wall" \
      "$(awk "BEGIN{print $kib/1024}")" "${best:-none holds the SLO}"
  done
done
nproc | xargs printf 'cores: %s\n'
