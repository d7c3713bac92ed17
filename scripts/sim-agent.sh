# Sourced by the benchmarks (bench-agent.sh, bench-memory.sh): one agent on SIMULATED GPUs with no
# Slurm and no kernel log, in a directory of its own.

# sim_agent_toml DIR NAME: the agent.toml they start from, ending inside [faults] so that a caller
# appends its own [faults] keys and then its [sim] section.
sim_agent_toml() {
  cat <<TOML
backend = "sim"
socket = "$1/run/agent.sock"
state_dir = "$1/state"
run_dir = "$1/run"
node_name = "$2"
[log]
target = "stderr"
level = "warn"
[slurm]
scontrol = "/bin/true"
[mps]
quit_on_shutdown = true
[faults]
kmsg = false
TOML
}

# start_sim_agent BUILD DIR: starts BUILD's agent on DIR/agent.toml (its log in DIR/agent.log),
# sets AGENT to its pid and returns once it answers (5 s at most).
start_sim_agent() {
  "$1/mpsr-agent" --config "$2/agent.toml" 2> "$2/agent.log" &
  AGENT=$!
  for _ in $(seq 100); do MPSR_SOCKET="$2/run/agent.sock" "$1/mpsrctl" status >/dev/null 2>&1 && return 0; sleep 0.05; done
  echo "agent of $1 did not answer; its log: $2/agent.log" >&2
  return 1
}
