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
command -v gnuplot >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gnuplot-nox >/dev/null
cargo build --locked -q --workspace
mkdir -p target/soak
target/debug/mpsr-soak --minutes "$minutes" --out target/soak | tee target/soak/soak.log
gnuplot <<'GP'
set datafile separator ","
set terminal png size 1200,800
set output "target/soak/soak.png"
set multiplot layout 2,2 title "mpsr-soak: the agent over time (SIMULATED GPUs, real Slurm)"
set xlabel "minutes"
set key left top
plot "target/soak/soak.csv" using 1:($2/1024) skip 1 with lines title "RSS MiB", "" using 1:3 skip 1 with lines title "open fds", "" using 1:4 skip 1 with lines title "threads"
plot "target/soak/soak.csv" using 1:($5/1024) skip 1 with lines title "state.json KiB", "" using 1:($6/1024) skip 1 with lines title "journal KiB", "" using 1:($7/1024) skip 1 with lines title "history.json KiB"
plot "target/soak/soak.csv" using 1:9 skip 1 with lines title "decisions kept", "" using 1:10 skip 1 with lines title "tasks", "" using 1:11 skip 1 with lines title "domains", "" using 1:12 skip 1 with lines title "pending actions"
plot "target/soak/soak.csv" using 1:13 skip 1 with lines title "jobs submitted", "" using 1:14 skip 1 with lines title "faults injected"
unset multiplot
GP
echo "soak: plot target/soak/soak.png"
