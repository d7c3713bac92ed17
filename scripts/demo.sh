#!/usr/bin/env bash
# Local demo with SIMULATED GPUs: agent + several jobs sharing two GPUs, an Xid 31 on GPU 0, and the
# timeline fault -> hit jobs -> actions -> outcome. Jobs on GPU 1 are untouched.
# Not yet through Slurm (the SPANK plugin is a separate issue): jobs are registered with mpsrctl the
# way the plugin will, and scontrol is a recording stand-in that prints what would be sent to Slurm.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  echo "demo: cargo is needed (https://rustup.rs)"; exit 1
fi
cargo build --release -q -p mpsr-agent
B=$PWD/target/release
T=$(mktemp -d /tmp/mpsr-demo.XXXXXX)
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; kill "$AGENT" 2>/dev/null || true; wait 2>/dev/null || true; }
PIDS=()
trap cleanup EXIT
cat > "$T/scontrol" <<EOS
#!/bin/sh
echo "\$(date +%T.%3N) scontrol \$*" >> $T/slurm-actions.log
case "\$1" in show) echo 'NodeName=demo State=MIXED ThreadsPerCore=1';; esac
EOS
chmod +x "$T/scontrol"
cat > "$T/agent.toml" <<EOF2
backend = "sim"
socket = "$T/run/agent.sock"
state_dir = "$T/state"
run_dir = "$T/run"
node_name = "demo"
[log]
target = "stderr"
[slurm]
scontrol = "$T/scontrol"
[faults]
kmsg = false
[sim]
gpus = 2
EOF2
"$B/mpsr-agent" --config "$T/agent.toml" 2> "$T/agent.log" &
AGENT=$!
export MPSR_SOCKET=$T/run/agent.sock
for _ in $(seq 100); do "$B/mpsrctl" status >/dev/null 2>&1 && break; sleep 0.05; done
echo "=== mps-resilient demo — SIMULATED GPUs (no real GPU is used) ==="
start_job() { # job gpu mode batch
  CUDA_MPS_PIPE_DIRECTORY=$T/run/gpu$2/pipe "$B/mpsr-simclient" --seconds 30 >"$T/job$1.out" 2>&1 &
  local pid=$!; PIDS+=("$pid"); sleep 0.1
  local extra=(); [ "$4" = batch ] && extra=(--batch --step 4294967291)
  "$B/mpsrctl" register --job "$1" --pid "$pid" --gpus "$2" --mode "$3" "${extra[@]}" >/dev/null
  echo "job $1: $4 job, mode $3, simulated MPS client pid $pid on gpu$2"
  eval "PID$1=$pid"
}
start_job 101 0 requeue batch
start_job 102 0 requeue batch
start_job 103 0 resume  srun
start_job 201 1 requeue batch
start_job 202 1 resume  srun
echo; "$B/mpsrctl" status; echo
echo ">>> injecting Xid 31 (illegal address) on gpu0, culprit = job 102's client (simulated)"
"$B/mpsrctl" sim inject --gpu 0 --xid 31 --culprit "$PID102"
sleep 1.5
echo; echo "=== timeline (mpsrctl events) ==="
"$B/mpsrctl" events
echo; echo "=== Slurm actions sent (scontrol stand-in) ==="
cat "$T/slurm-actions.log" 2>/dev/null | grep -v " show " || echo "(none)"
echo; echo "=== outcome per job ==="
for j in 101 102 103 201 202; do
  pid=$(eval echo "\$PID$j")
  if kill -0 "$pid" 2>/dev/null; then st="still running"; else st="died: $(tail -1 "$T/job$j.out")"; fi
  echo "job $j (pid $pid): $st"
done
echo
echo "gpu1 jobs 201/202 must be 'still running'; gpu0 jobs hit (stock MPS kills every client there)."
ok=1
for j in 201 202; do kill -0 "$(eval echo "\$PID$j")" 2>/dev/null || ok=0; done
for j in 101 102 103; do kill -0 "$(eval echo "\$PID$j")" 2>/dev/null && ok=0; done
grep -q "requeue 101" "$T/slurm-actions.log" && grep -q "requeue 102" "$T/slurm-actions.log" || ok=0
[ $ok = 1 ] && echo "DEMO OK" || { echo "DEMO FAILED (agent log: $T/agent.log)"; exit 1; }
