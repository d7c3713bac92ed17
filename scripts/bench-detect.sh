#!/usr/bin/env bash
# The labelled detection benchmark (detect-bench/, SIMULATED 8-GPU nodes), old rules vs new in one
# run: the same cases through the telemetry crate of an older commit (default 3270ff1, v0.2.0:
# 5 s rounds, streak windows) and through this tree's (1 s rounds, windowed evidence). The bench
# hands each round to the detector as JSON, so one bench drives either crate.
#
# Usage: scripts/bench-detect.sh [--hours H] [--seeds N] [--old COMMIT]   (defaults 72, 3, 3270ff1)
# Prints both tables and the per-rule goals met (recall >= 0.95 for conditions >= 30 s at >= 50 %
# duty, precision >= 0.95, <= 1 false alarm per node-day).
set -euo pipefail
hours=72 seeds=3 old=3270ff1
while [ $# -gt 0 ]; do
  case "$1" in
    --hours) hours=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --old) old=$2; shift 2 ;;
    *) echo "usage: $0 [--hours H] [--seeds N] [--old COMMIT]" >&2; exit 2 ;;
  esac
done
here=$(cd "$(dirname "$0")/.." && pwd)
w=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$w/old" >/dev/null 2>&1 || true; rm -rf "$w"' EXIT

echo "building the bench against this tree's rules and against $old's" >&2
cargo build --release -q -p mpsr-detect-bench --manifest-path "$here/Cargo.toml"
new_bin="$here/target/release/mpsr-detect-bench"

git -C "$here" worktree add --detach -q "$w/old" "$old"
cp -r "$here/detect-bench" "$w/old/"
# The old workspace gets the bench as a member; its lock file gains nothing new (serde_json and
# the telemetry crate are there already).
sed -i 's/^members = \[/members = ["detect-bench", /' "$w/old/Cargo.toml"
CARGO_TARGET_DIR="$here/target/bench-detect-old" \
  cargo build --release -q -p mpsr-detect-bench --bin mpsr-detect-bench --manifest-path "$w/old/Cargo.toml"
old_bin="$here/target/bench-detect-old/release/mpsr-detect-bench"

echo
echo "== rules of $old (v0.2 sampling: 5 s rounds, slow counters every 60 s) =="
"$old_bin" --hours "$hours" --seeds "$seeds" --sampling v0.2
echo
echo "== rules of this tree (agent defaults: 1 s rounds, slow counters every 60 s) =="
"$new_bin" --hours "$hours" --seeds "$seeds" --sampling fast --misses | tee "$w/new.txt"
echo
awk '
  $1 ~ /^[a-z_]+$/ && NF == 8 && $2 ~ /^[0-9]+$/ {
    ok = ($4 == "-" || $4 + 0 >= 0.95) && ($5 == "-" || $5 + 0 >= 0.95) && ($8 + 0 <= 1.0)
    printf "%-20s %s\n", $1, ok ? "goals met" : "GOALS MISSED"
  }' "$w/new.txt"
