#!/usr/bin/env bash
# Benchmark (not a test): fault-to-decision latency over N injected faults on SIMULATED GPUs, and agent
# RSS/CPU while idle with 8 sim GPUs x 48 idle clients. Prints numbers; asserts nothing.
# decide_us is measured inside the agent from the first signal of a fault to its decision.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-1000}
cargo build --release -q -p mpsr-agent
B=$PWD/target/release
T=$(mktemp -d /tmp/mpsr-bench.XXXXXX)
CL=()
# Removing the run dir also ends the simulated GPU daemon and the keepers (they exit when it goes).
cleanup() { kill "${CL[@]}" 2>/dev/null || true; kill "$AGENT" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$T"; }
trap cleanup EXIT
cat > "$T/agent.toml" <<EOF2
backend = "sim"
socket = "$T/run/agent.sock"
state_dir = "$T/state"
run_dir = "$T/run"
node_name = "bench"
[log]
target = "stderr"
level = "warn"
[slurm]
scontrol = "/bin/true"
[mps]
quit_on_shutdown = true
[faults]
kmsg = false
correlation_window_ms = 1
history = $((N + 10))
[sim]
gpus = 8
EOF2
"$B/mpsr-agent" --config "$T/agent.toml" 2> "$T/agent.log" &
AGENT=$!
export MPSR_SOCKET=$T/run/agent.sock
for _ in $(seq 100); do "$B/mpsrctl" status >/dev/null 2>&1 && break; sleep 0.05; done
for g in $(seq 0 7); do for _ in $(seq 48); do
  CUDA_MPS_PIPE_DIRECTORY=$T/run/gpu$g/pipe "$B/mpsr-simclient" --idle --seconds 3600 >/dev/null 2>&1 &
  CL+=($!)
done; done
sleep 3
ticks() { awk '{print $14+$15}' /proc/$AGENT/stat; }
t0=$(ticks); sleep 5; t1=$(ticks)
rss=$(awk '/VmRSS/{print $2}' /proc/$AGENT/status)
hz=$(getconf CLK_TCK)
echo "idle with 8 sim GPUs x 48 clients: RSS ${rss} KiB, CPU $(python3 -c "print(f'{($t1-$t0)/$hz/5*100:.2f}')") % of one core"
for i in $(seq 1 "$N"); do "$B/mpsrctl" sim inject --gpu $((i % 8)) --xid 63 >/dev/null; done
sleep 1
# The full history is in the agent's state dir (mpsrctl events returns what fits in one frame).
python3 - "$T/state/history.json" <<'PY'
import json, sys
ev = json.load(open(sys.argv[1]))
us = sorted(e["decide_us"] for e in ev)
p = lambda q: us[min(len(us) - 1, int(q * len(us)))]
print(f"fault-to-decision over {len(us)} simulated faults: p50 {p(0.5)} us, p99 {p(0.99)} us, max {us[-1]} us")
PY
