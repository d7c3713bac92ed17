#!/usr/bin/env bash
# The demo: a real Slurm on localhost (slurmctld + slurmd + the mps-resilient SPANK plugin, prolog,
# epilog) and the node agent with two SIMULATED GPUs. Six jobs share the GPUs through MPS, an Xid 31
# hits GPU 0, and the timeline shows fault -> hit jobs -> actions -> outcome; GPU 1's jobs run on
# untouched. Installs Slurm/munge/clang when missing; needs root for the Slurm daemons (sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
bash scripts/install-deps.sh
cargo build --workspace --locked -q
if [ "$(id -u)" -ne 0 ]; then
  exec sudo target/debug/mpsr-demo
fi
exec target/debug/mpsr-demo
