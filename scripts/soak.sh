#!/usr/bin/env bash
# The soak (issue 24; a benchmark, not in the test command): hours of a busy node on real Slurm
# and SIMULATED GPUs; prints the agent's resources over time and checks that no Slurm action was
# lost or doubled; plots the samples (target/soak/soak.png, with gnuplot).
#   bash scripts/soak.sh [MINUTES]        (default 120; needs root like the tests)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
minutes=${1:-120}
bash scripts/install-deps.sh
cargo build --locked -q --workspace
mkdir -p target/soak
target/debug/mpsr-soak --minutes "$minutes" --out target/soak | tee target/soak/soak.log
bash scripts/soak-plot.sh target/soak/soak.csv target/soak/soak.png
