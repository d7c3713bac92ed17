#!/usr/bin/env bash
# Plots the soak's samples (mpsr-soak's CSV) into a PNG with gnuplot: the agent's resources, its
# files, what it holds, and the load over time.
#   bash scripts/soak-plot.sh target/soak/soak.csv target/soak/soak.png
set -euo pipefail
csv=${1:?CSV}
png=${2:?PNG}
command -v gnuplot >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gnuplot-nox >/dev/null
# The anonymous part of the RSS (what the agent allocates; the rest is its mapped binary), where
# the CSV has it (mpsr-soak of 0.2.0 and later).
anon=""
kept=""
if head -1 "$csv" | grep -q rss_anon_kib; then
  anon=', "" using 1:($15/1024) skip 1 with lines title "RSS anon MiB"'
  kept=', "" using 1:16 skip 1 with lines title "decisions in history.json"'
fi
gnuplot <<GP
set datafile separator ","
set terminal png size 1200,800
set output "$png"
set multiplot layout 2,2 title "mpsr-soak: the agent over time (SIMULATED GPUs, real Slurm)"
set xlabel "minutes"
set key left top
plot "$csv" using 1:(\$2/1024) skip 1 with lines title "RSS MiB", "" using 1:3 skip 1 with lines title "open fds", "" using 1:4 skip 1 with lines title "threads"${anon}
plot "$csv" using 1:(\$5/1024) skip 1 with lines title "state.json KiB", "" using 1:(\$6/1024) skip 1 with lines title "journal KiB", "" using 1:(\$7/1024) skip 1 with lines title "history.json KiB"
plot "$csv" using 1:9 skip 1 with lines title "decisions in one events answer", "" using 1:10 skip 1 with lines title "tasks", "" using 1:11 skip 1 with lines title "domains", "" using 1:12 skip 1 with lines title "pending actions"${kept}
plot "$csv" using 1:13 skip 1 with lines title "jobs submitted", "" using 1:14 skip 1 with lines title "faults injected"
unset multiplot
GP
echo "soak: plot $png"
