#!/usr/bin/env bash
# Runs several GPU proofs in one device call (the device is scarce: one call, few starts), each
# into its own folder of $OUT (their agent and MPS logs have fixed names) and within its own bound,
# one after the other; a proof that fails or runs over does not stop the next. Prints each one's
# status and how long it took.
#
#   OUT=<dir> bash tests/gpu/batch.sh 'NAME SECONDS COMMAND...' ...
#   e.g. 'gpu 200 python3 tests/gpu/gpu_proof.py' 'old_restart 120 env MPSR_BIN=$PWD/gpu-bin-old ...'
set -u
cd "$(dirname "$0")/../.."
: "${OUT:?OUT: where the results go}"
for spec in "$@"; do
  read -r name secs cmd <<<"$spec"
  mkdir -p "$OUT/$name"
  t0=$(date +%s)
  OUT="$OUT/$name" timeout -k 10 "$secs" bash -c "$cmd" > "$OUT/$name/console.log" 2>&1
  rc=$?
  echo "batch: $name rc=$rc in $(( $(date +%s) - t0 )) s: $(grep -h 'RESULT:' "$OUT/$name"/*.log 2>/dev/null | tail -1)"
done
