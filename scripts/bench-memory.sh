#!/usr/bin/env bash
# Benchmark (not a test): the agent's anonymous memory under compressed job churn in ONE process
# (no restarts), SIMULATED GPUs: job start, register, a fault every 5th job while it runs,
# deregister, job end, with three clients reading events/status all the time (so that request
# threads, and malloc arenas, take part). Prints the anonymous RSS every 500 jobs; asserts nothing.
#
#   bash scripts/bench-memory.sh                     this build
#   OLD=/path/to/other/target/release bash scripts/bench-memory.sh
#                                                    that build and this one side by side, and the ratio
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/sim-agent.sh
N=${N:-3000}
cargo build --release -q -p mpsr-agent -p mpsr-simgpu -p mpsr-keeper
NEW=$PWD/target/release

# Churn against one agent of the build in $2 (labelled $1); the last line is "label final <KiB>".
churn() {
  local label=$1 B=$2 T AGENT HOLD READERS=()
  T=$(mktemp -d /tmp/mpsr-benchmem.XXXXXX)
  { sim_agent_toml "$T" benchmem; printf '[sim]\ngpus = 2\ntiming = "instant"\n'; } > "$T/agent.toml"
  start_sim_agent "$B" "$T"
  local ctl=("$B/mpsrctl" --socket "$T/run/agent.sock")
  sleep 100000 & HOLD=$!
  for c in events "--json status" "--json events"; do
    # shellcheck disable=SC2086
    ( while kill -0 $AGENT 2>/dev/null; do "${ctl[@]}" $c >/dev/null 2>&1; done ) & READERS+=($!)
  done
  local anon=0
  for j in $(seq 1 "$N"); do
    "${ctl[@]}" job-start "$j" --uid 0 >/dev/null
    "${ctl[@]}" register --job "$j" --step 4294967291 --pid $HOLD --gpus $((j % 2)) --batch >/dev/null
    if [ $((j % 5)) -eq 0 ]; then "${ctl[@]}" sim inject --gpu $((j % 2)) --xid 43 >/dev/null; sleep 0.3; fi
    "${ctl[@]}" deregister --job "$j" --step 4294967291 --pid $HOLD --exit-status 0 >/dev/null
    "${ctl[@]}" job-end "$j" >/dev/null 2>&1 || true
    if [ $((j % 500)) -eq 0 ] || [ "$j" -eq "$N" ]; then
      anon=$(awk '/RssAnon/{print $2}' "/proc/$AGENT/status")
      echo "$label jobs=$j anon_kib=$anon state_bytes=$(stat -c %s "$T/state/state.json")" \
        "threads=$(awk '/Threads/{print $2}' "/proc/$AGENT/status")"
    fi
  done
  kill "${READERS[@]}" $HOLD $AGENT 2>/dev/null || true
  wait $AGENT 2>/dev/null || true
  rm -rf "$T"
  echo "$label final $anon"
}

echo "=== bench-memory: $N jobs, a fault every 5th, 3 readers; SIMULATED GPUs ==="
if [ -n "${OLD:-}" ]; then
  churn old "$OLD" > /tmp/mpsr-benchmem.old.$$ &
  churn new "$NEW" > /tmp/mpsr-benchmem.new.$$
  wait
  paste -d'\n' /tmp/mpsr-benchmem.old.$$ /tmp/mpsr-benchmem.new.$$
  o=$(awk '/ final /{print $3}' /tmp/mpsr-benchmem.old.$$)
  n=$(awk '/ final /{print $3}' /tmp/mpsr-benchmem.new.$$)
  rm -f /tmp/mpsr-benchmem.old.$$ /tmp/mpsr-benchmem.new.$$
  awk -v o="$o" -v n="$n" 'BEGIN{ if (o > 0) printf "anonymous RSS after the churn: new/old = %.2fx (%d vs %d KiB)\n", n / o, n, o }'
else
  churn this "$NEW"
fi
