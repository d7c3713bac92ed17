#!/usr/bin/env bash
# Benchmark (not a test): fault-to-decision latency over N injected faults on SIMULATED GPUs, and agent
# RSS/CPU while idle with 8 sim GPUs x 48 idle clients. Prints numbers; asserts nothing.
# decide_us is measured inside the agent from the first signal of a fault to its decision.
#
#   bash scripts/bench-agent.sh                       this build
#   OLD=/path/to/other/target/release bash scripts/bench-agent.sh
#                                                     that build and this one, alternating ROUNDS
#                                                     times (default 2) in one run, and the ratio
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/sim-agent.sh
N=${N:-1000}
ROUNDS=${ROUNDS:-2}
cargo build --release -q -p mpsr-agent -p mpsr-simgpu -p mpsr-keeper
NEW=$PWD/target/release

# One agent of the build in $2 (labelled $1): idle cost, then N faults; prints a line per number
# and appends "label p50 p99" to $RESULTS.
run_one() {
  local label=$1 B=$2 T AGENT CL=()
  T=$(mktemp -d /tmp/mpsr-bench.XXXXXX)
  { sim_agent_toml "$T" bench; printf 'correlation_window_ms = 1\nhistory = %d\n[sim]\ngpus = 8\n' $((N + 10)); } > "$T/agent.toml"
  start_sim_agent "$B" "$T"
  for g in $(seq 0 7); do for _ in $(seq 48); do
    CUDA_MPS_PIPE_DIRECTORY=$T/run/gpu$g/pipe "$B/mpsr-simclient" --idle --seconds 3600 >/dev/null 2>&1 &
    CL+=($!)
  done; done
  sleep 3
  local t0 t1 rss hz
  t0=$(awk '{print $14+$15}' /proc/$AGENT/stat); sleep 5; t1=$(awk '{print $14+$15}' /proc/$AGENT/stat)
  rss=$(awk '/VmRSS/{print $2}' /proc/$AGENT/status)
  hz=$(getconf CLK_TCK)
  echo "$label: idle with 8 sim GPUs x 48 clients: RSS ${rss} KiB, CPU $(python3 -c "print(f'{($t1-$t0)/$hz/5*100:.2f}')") % of one core"
  for i in $(seq 1 "$N"); do MPSR_SOCKET=$T/run/agent.sock "$B/mpsrctl" sim inject --gpu $((i % 8)) --xid 63 >/dev/null; done
  sleep 1
  # The full history is in the agent's state dir (mpsrctl events returns what fits in one frame).
  python3 - "$T/state/history.json" "$label" "$RESULTS" <<'PY'
import json, sys
ev = json.load(open(sys.argv[1]))
us = sorted(e["decide_us"] for e in ev)
p = lambda q: us[min(len(us) - 1, int(q * len(us)))]
print(f"{sys.argv[2]}: fault-to-decision over {len(us)} simulated faults: p50 {p(0.5)} us, p99 {p(0.99)} us, max {us[-1]} us")
open(sys.argv[3], "a").write(f"{sys.argv[2]} {p(0.5)} {p(0.99)}\n")
PY
  # Removing the run dir also ends the simulated GPU daemon and the keepers (they exit when it goes).
  kill "${CL[@]}" 2>/dev/null || true; kill "$AGENT" 2>/dev/null || true; wait "$AGENT" 2>/dev/null || true
  rm -rf "$T"
}

RESULTS=$(mktemp /tmp/mpsr-bench-results.XXXXXX)
trap 'rm -f "$RESULTS"' EXIT
if [ -z "${OLD:-}" ]; then
  run_one this "$NEW"
  exit 0
fi
for r in $(seq "$ROUNDS"); do
  run_one "old(round $r)" "$OLD"
  run_one "new(round $r)" "$NEW"
done
python3 - "$RESULTS" <<'PY'
import sys, statistics
rows = [l.split() for l in open(sys.argv[1])]
def med(kind, col):
    return statistics.median(float(r[col + 1]) for r in rows if r[0].startswith(kind))
for col, name in ((1, "p50"), (2, "p99")):
    o, n = med("old", col), med("new", col)
    print(f"decision latency {name}: old {o:.0f} us, new {n:.0f} us, new/old {n / o:.2f}")
PY
