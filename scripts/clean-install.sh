#!/usr/bin/env bash
# Installs the built packages into a clean Debian root the way a site does (mmdebstrap; apt
# resolves their Depends, e.g. slurm-client, from the mirror; maintainer scripts run) and
# smoke-tests the installed files there: every binary runs, the plugin and the state library link,
# and the installed agent (SIMULATED GPUs) starts and answers the installed mpsrctl. Never touches
# the host's packages.
#   scripts/clean-install.sh [SUITE] [DEB_DIR]     (default: bookworm target/debian; needs root)
set -euo pipefail
suite=${1:-bookworm}
debs=$(cd "${2:-target/debian}" && pwd)
[ "$(id -u)" -eq 0 ] || { echo "clean-install: needs root (mmdebstrap, chroot)" >&2; exit 2; }
command -v mmdebstrap >/dev/null ||
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
root=$(mktemp -d /tmp/mpsr-clean-XXXXXX)
cleanup() {
  [ -n "${agent:-}" ] && kill "$agent" 2>/dev/null
  pkill -f "^/usr/bin/mpsr-simgpu --run-dir /run/mpsr-smoke" 2>/dev/null || true
  mountpoint -q "$root/proc" && umount -l "$root/proc"
  rm -rf "$root"
}
trap cleanup EXIT
inc=()
for f in "$debs"/*.deb; do inc+=(--include="$f"); done
start=$(date +%s)
mmdebstrap --quiet --variant=apt --hook-dir=/usr/share/mmdebstrap/hooks/file-mirror-automount \
  "${inc[@]}" "$suite" "$root" http://deb.debian.org/debian >/dev/null
echo "clean-install: $(ls "$debs"/*.deb | wc -l) packages installed into a clean $suite root with their dependencies in $(( $(date +%s) - start )) s:"
chroot "$root" dpkg-query -W -f '  ${Package} ${Version} ${db:Status-Abbrev}\n' mps-resilient mps-resilient-spank libmpsr-state slurm-client
fail=0
check() { if eval "$2"; then echo "clean-install: ok    $1"; else echo "clean-install: FAIL  $1" >&2; fail=1; fi; }
for b in mpsr-agent mpsrctl mpsr-run mpsr-keeper mpsr-statetool mpsr-simgpu mpsr-simclient; do
  check "$b runs" "chroot '$root' $b --help >/dev/null 2>&1"
done
check "maintainer scripts ran (every package configured, the report directory made)" \
  "[ -d '$root/var/log/mps-resilient/jobs' ] && ! chroot '$root' dpkg-query -W -f '\${db:Status-Abbrev}\n' mps-resilient mps-resilient-spank libmpsr-state | grep -v '^ii'"
check "plugin and state library link" \
  "! chroot '$root' sh -c 'ldd /usr/lib/*/slurm-wlm/mps_resilient.so /usr/lib/*/libmpsr_state.so*' | grep 'not found'"
mount -t proc proc "$root/proc"
mkdir -p "$root/etc/mpsr-smoke"
cat > "$root/etc/mpsr-smoke/agent.toml" <<TOML
backend = "sim"
socket = "/run/mpsr-smoke/agent.sock"
state_dir = "/var/lib/mpsr-smoke"
run_dir = "/run/mpsr-smoke"
node_name = "smoke"
[log]
target = "stderr"
[slurm]
scontrol = "/bin/true"
[mps]
quit_on_shutdown = true
[faults]
kmsg = false
TOML
chroot "$root" /usr/bin/mpsr-agent --config /etc/mpsr-smoke/agent.toml 2>"$root/agent.log" &
agent=$!
status=""
for _ in $(seq 100); do
  status=$(chroot "$root" mpsrctl --socket /run/mpsr-smoke/agent.sock status 2>/dev/null) && break
  sleep 0.1
done
check "the installed agent starts and answers the installed mpsrctl" "[ -n \"\$status\" ]"
check "it says its GPUs are SIMULATED" "chroot '$root' mpsrctl --socket /run/mpsr-smoke/agent.sock --json status | grep '\"simulated\": true' >/dev/null"
[ $fail -eq 0 ] || { echo "clean-install: agent log:" >&2; cat "$root/agent.log" >&2; }
exit $fail
