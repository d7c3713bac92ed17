#!/usr/bin/env bash
# Fetches another Debian suite's Slurm development headers (libslurm-dev) without touching the
# host's packages: a private apt directory downloads the package, dpkg-deb extracts it. Prints the
# include directory (for SLURM_INCLUDE_DIR); cached under target/slurm-headers/<suite>.
#   scripts/slurm-headers.sh trixie        # Slurm 24.11
set -euo pipefail
cd "$(dirname "$0")/.."
suite=${1:?usage: slurm-headers.sh SUITE}
base="$PWD/target/slurm-headers/$suite"
if [ ! -f "$base/root/usr/include/slurm/spank.h" ]; then
  rm -rf "$base"
  mkdir -p "$base/apt/state/lists/partial" "$base/apt/cache/archives/partial" "$base/apt/prefs" "$base/root"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" \
    >"$base/apt/sources.list"
  opts=(-o "Dir::Etc::sourcelist=$base/apt/sources.list" -o Dir::Etc::sourceparts=- -o Acquire::Check-Valid-Until=false
        -o "Dir::Etc::preferencesparts=$base/apt/prefs" -o "Dir::State=$base/apt/state"
        -o "Dir::Cache=$base/apt/cache" -o "APT::Architecture=$(dpkg --print-architecture)")
  apt-get "${opts[@]}" -qq update >&2
  (cd "$base" && apt-get "${opts[@]}" -qq download libslurm-dev >&2)
  dpkg-deb -x "$base"/libslurm-dev_*.deb "$base/root"
fi
echo "$base/root/usr/include"
