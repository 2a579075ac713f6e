#!/usr/bin/env bash
# The simulator's outputs on every shipped scenario, as one SHA-256 per file: run it before
# and after a refactor that must not change behaviour, and diff the two listings.
#
#   scripts/sim_digest.sh > /tmp/before.txt   # … change …   scripts/sim_digest.sh | diff /tmp/before.txt -
#
# Builds `sim` in release mode; writes run directories under a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p infer-sim --bin sim
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for scenario in scenarios/*.toml; do
    name=$(basename "$scenario" .toml)
    ./target/release/sim run "$scenario" --out "$out/$name" --quiet > /dev/null
    for file in "$out/$name"/*; do
        [ -f "$file" ] || continue
        echo "$(sha256sum < "$file" | cut -c1-16)  $name/$(basename "$file")"
    done
done
