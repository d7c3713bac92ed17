#!/usr/bin/env bash
# A root with another Debian suite's Slurm (default trixie: Slurm 24.11) for the e2e tests:
# made with mmdebstrap once and kept in /var/cache/mps-resilient/<suite>-root (rebuilt when absent),
# never installed on the host. `up` binds /proc, /sys, /dev and /tmp into it (the test clusters
# live in /tmp) and prints its path; `down` unbinds them.
#   scripts/slurm-root.sh up [SUITE] | down [SUITE]
set -euo pipefail
cmd=${1:?usage: slurm-root.sh up|down [SUITE]}
suite=${2:-trixie}
root=${MPSR_SLURM_ROOT_CACHE:-/var/cache/mps-resilient}/$suite-root
case "$cmd" in
up)
  if [ ! -x "$root/usr/sbin/slurmd" ]; then
    command -v mmdebstrap >/dev/null ||
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
    rm -rf "$root"
    mkdir -p "$(dirname "$root")"
    # A testing suite's Release file expires within days; a mirror (or its cache) older than
    # that is still what this root is made from.
    mmdebstrap --quiet --variant=minbase --include=slurmd,slurmctld,slurm-client,munge \
      --aptopt='Acquire::Check-Valid-Until "false"' \
      "$suite" "$root" http://deb.debian.org/debian >&2
  fi
  cp /etc/hosts "$root/etc/hosts"
  for d in proc sys dev tmp; do
    mountpoint -q "$root/$d" || mount --rbind "/$d" "$root/$d"
    mount --make-rslave "$root/$d"
  done
  echo "$root"
  ;;
down)
  for d in tmp dev sys proc; do
    mountpoint -q "$root/$d" && umount -R -l "$root/$d"
  done
  true
  ;;
esac
