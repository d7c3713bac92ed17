#!/usr/bin/env bash
# CPU cost of the agent's telemetry with 8 SIMULATED GPUs: the same agent, idle, with telemetry at
# its defaults and with telemetry off, measured in one run (user+system CPU from /proc, not wall).
# The simulated source costs nothing like NVML does; NVML's per-call costs are measured on the H200
# (BENCHMARKS.md). Usage: scripts/bench-telemetry.sh [seconds per run, default 60]
set -euo pipefail
secs=${1:-60}
here=$(cd "$(dirname "$0")/.." && pwd)
cargo build --release -q -p mpsr-agent -p mpsr-simgpu --manifest-path "$here/Cargo.toml"
bin="$here/target/release"
w=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$w"' EXIT
tck=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
run() {
  local name=$1 tel=$2
  rm -rf "$w/$name"; mkdir -p "$w/$name"
  cat > "$w/$name/agent.toml" <<TOML
backend = "sim"
socket = "$w/$name/run/agent.sock"
state_dir = "$w/$name/state"
run_dir = "$w/$name/run"
node_name = "bench"
[log]
target = "stderr"
level = "warn"
[mps]
quit_on_shutdown = true
[faults]
kmsg = false
[sim]
gpus = 8
[keeper]
enabled = false
[telemetry]
enabled = $tel
TOML
  "$bin/mpsr-agent" --config "$w/$name/agent.toml" 2>"$w/$name/agent.log" &
  local pid=$!
  sleep 5
  local c0; c0=$(cpu $pid)
  sleep "$secs"
  local c1; c1=$(cpu $pid)
  kill $pid; wait $pid 2>/dev/null || true
  awk -v a="$c0" -v b="$c1" -v t="$tck" -v s="$secs" -v n="$name" \
    'BEGIN { printf "%-14s agent CPU %.3f s in %d s = %.3f %% of one core\n", n, (b-a)/t, s, (b-a)/t/s*100 }'
}
echo "8 SIMULATED GPUs, idle, ${secs} s each"
run telemetry-on true
run telemetry-off false
