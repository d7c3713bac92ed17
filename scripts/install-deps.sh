#!/usr/bin/env bash
# Installs what building and testing mps-resilient needs on Debian/Ubuntu: Slurm (slurmctld, slurmd,
# client tools, headers for the SPANK plugin), munge, clang/libclang for bindgen, libfaketime (the
# clock-jump test) and promtool. Needs root (uses sudo when not root). A Rust toolchain (cargo) must already be installed (https://rustup.rs).
set -euo pipefail
PKGS=(slurmctld slurmd slurm-client munge libslurm-dev clang libclang-dev faketime)
# Packaging checks: lintian for the .debs; rpm (rpmbuild, rpm2cpio), cpio and rpmlint for the RPMs.
PKGS+=(lintian rpm rpmlint cpio)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  echo "install-deps: installing ${missing[*]}"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# promtool (package prometheus) lints the agent's /metrics in the tests; only the tool is wanted.
if ! command -v promtool >/dev/null; then
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  echo "install-deps: installing prometheus (for promtool)"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
if ! command -v cargo >/dev/null; then
  echo "install-deps: cargo not found; install Rust with rustup (https://rustup.rs) and run again" >&2
  exit 1
fi
