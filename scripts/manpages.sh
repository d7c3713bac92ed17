#!/usr/bin/env bash
# Renders the man page of every mps-resilient binary from its own clap definition
# (MPSR_MANPAGE=1 makes a binary print its page) into target/man/ (or $1).
#   scripts/manpages.sh [OUT_DIR]     after cargo build [--release]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/man}
bin=${MPSR_BIN_DIR:-target/release}
[ -x "$bin/mpsr-agent" ] || bin=target/debug
mkdir -p "$out"
for b in mpsr-agent mpsrctl mpsr-run mpsr-keeper mpsr-statetool mpsr-simgpu mpsr-simclient; do
  MPSR_MANPAGE=1 "$bin/$b" > "$out/$b.1"
  # A page that man cannot format is a failure, not a page.
  if command -v man >/dev/null; then
    man -l "$out/$b.1" >/dev/null 2>&1 || { echo "manpages: $b.1 does not format" >&2; exit 1; }
  fi
  echo "manpages: $out/$b.1"
done
