#!/usr/bin/env bash
# Runs every test: unit tests, the agent's integration tests (agent process + simulated GPUs + real
# client processes), and the end-to-end tests on a real Slurm on localhost (munge, slurmctld, two
# slurmd, the SPANK plugin, prolog/epilog/health check, agents with simulated GPUs).
# Installs Slurm/munge/clang when missing. The Slurm tests start daemons and run jobs as other
# users, so the tests run as root (via sudo when started as another user).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
bash scripts/install-deps.sh
# Style and lints first: a formatting slip or a new warning fails here, before the long tests.
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -q -- -D warnings
cargo build --workspace --locked
# Every binary renders its man page from its clap definition; a page that does not format fails.
MPSR_BIN_DIR=target/debug bash scripts/manpages.sh target/man
# Tests that cannot run here say why in this file; they are listed at the end, not counted as passed.
export MPSR_SKIP_LOG="$PWD/target/skipped-tests.txt"
rm -f "$MPSR_SKIP_LOG"
# The plugin built and unit-tested against newer Slurm releases' own spank.h (Debian trixie's
# libslurm-dev: 24.11; forky's: 26.05; fetched into target/ without touching the host's
# packages); their Slurm >= 23.11 code path (mpsr-run inserted with spank_prepend_task_argv).
# Without the network, only type-checked against this host's header plus the 23.11 addition, and
# that is listed as skipped.
newer=()   # "suite:release" of each newer Slurm the plugin was built for
for sr in trixie:24.11 forky:26.05; do
  suite=${sr%%:*} rel=${sr#*:}
  if inc=$(bash scripts/slurm-headers.sh "$suite" 2>/dev/null); then
    CARGO_TARGET_DIR=target/slurm-$rel SLURM_INCLUDE_DIR="$inc" cargo build --locked -q -p mpsr-spank
    CARGO_TARGET_DIR=target/slurm-$rel SLURM_INCLUDE_DIR="$inc" cargo test --locked -q -p mpsr-spank
    newer+=("$sr")
  else
    echo "spank-plugin vs Slurm $rel: $suite's libslurm-dev unreachable (network?); not built" >> "$MPSR_SKIP_LOG"
  fi
done
if [ ${#newer[@]} -eq 0 ]; then
  CARGO_TARGET_DIR=target/compat-23.11 SLURM_INCLUDE_DIR="$PWD/spank-plugin/compat/slurm-23.11" \
    cargo check --locked -q -p mpsr-spank
fi
# A Slurm upgrade must rebuild the plugin with the new plugin_version (bindgen's rerun triggers).
bash tests/plugin_rebuild.sh
# The Debian packages: built (from the debug build: only their contents are checked here) and
# unpacked with dpkg into an empty root (no Slurm there: dependencies are not resolved; the
# maintainer scripts run in the clean-root install below, which has a shell); the
# real-Slurm e2e tests then run the installed files, not the build.
MPSR_DEB_PROFILE=debug bash scripts/build-debs.sh target/debian
deb_root="$PWD/target/deb-root"
rm -rf "$deb_root"
mkdir -p "$deb_root/var/lib/dpkg/info" "$deb_root/var/lib/dpkg/updates"
touch "$deb_root/var/lib/dpkg/status"
dpkg --root="$deb_root" --force-depends --unpack target/debian/*.deb >/dev/null 2>&1 ||
  { echo "test: installing the packages into $deb_root failed" >&2; exit 1; }
export MPSR_INSTALLED_ROOT="$deb_root"
# What an admin trusts in a package: stripped binaries whose debug info the -dbgsym package holds
# (by build id), a versioned libc6 dependency, the state library under its SONAME, the report
# directory's tmpfiles.d rule (applied into the root as systemd-tmpfiles would at boot).
bash tests/package_checks.sh target/debian "$deb_root"
# lintian: no error (its two warnings are about libmpsr-state's name, see the closing notes).
if ! lint=$(lintian --fail-on error --tag-display-limit 0 target/debian/*.deb 2>&1); then
  echo "$lint" >&2; echo "test: lintian found errors in the .debs" >&2; exit 1
fi
echo "test: lintian: no errors; $(grep -c '^W: ' <<<"$lint" || true) warning(s)"
# The RPMs, from the same package description (EL paths: /usr/lib64/slurm, /usr/lib/systemd).
MPSR_PKG_PROFILE=debug bash scripts/build-packages.sh rpm target/rpm
bash tests/rpm_checks.sh target/rpm
# The packages as a site installs them: into a clean Debian root by apt, dependencies resolved.
if [ "$(id -u)" -eq 0 ]; then
  bash scripts/clean-install.sh bookworm target/debian
else
  sudo bash scripts/clean-install.sh bookworm target/debian
fi
# The packaged systemd unit, as systemd reads it (unknown keys, bad values, a missing ExecStart
# binary): it is not started here (no systemd as PID 1), so this is its check.
unit="$deb_root/lib/systemd/system/mps-resilient-agent.service"
if command -v systemd-analyze >/dev/null; then
  mkdir -p target/unit-check
  sed "s#/usr/bin/#$deb_root/usr/bin/#g" "$unit" > target/unit-check/mps-resilient-agent.service
  verdict=$(systemd-analyze verify target/unit-check/mps-resilient-agent.service 2>&1)
  if [ -n "$verdict" ]; then
    echo "test: systemd-analyze verify of the packaged unit:" >&2; echo "$verdict" >&2; exit 1
  fi
  echo "test: packaged systemd unit verified (systemd-analyze verify)"
else
  echo "systemd unit: systemd-analyze not installed (unit not verified)" >> "$MPSR_SKIP_LOG"
fi
# The previous release (0.1.0), for the rolling-upgrade test: built from its commit in this clone.
if prev=$(bash scripts/prev-release.sh); then
  export MPSR_PREV_BUILD_DIR="$prev"
else
  echo "previous release not built (scripts/prev-release.sh failed: shallow clone?); the upgrade test skips" >> "$MPSR_SKIP_LOG"
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "test: the real-Slurm tests need root; running cargo test under sudo"
  sudo -E env "PATH=$PATH" "MPSR_SKIP_LOG=$MPSR_SKIP_LOG" "MPSR_INSTALLED_ROOT=$MPSR_INSTALLED_ROOT" "MPSR_PREV_BUILD_DIR=${MPSR_PREV_BUILD_DIR:-}" cargo test --workspace --locked
else
  cargo test --workspace --locked
fi
# The real-Slurm e2e suite again on each newer Slurm: its slurmctld, slurmd, munged and commands
# run in a Debian root of that suite (scripts/slurm-root.sh: made once with mmdebstrap, kept in
# /var/cache/mps-resilient) and load the plugin built against that release's spank.h; agents on
# the host. Each release's skips are its own: what 22.05 skipped because it cannot (no
# spank_prepend_task_argv) a newer release ran; the upgrade test (the previous plugin is built for
# 22.05) only 22.05 runs.
if [ "$(id -u)" -ne 0 ]; then
  echo "e2e on Slurm ${newer[*]:-24.11 and 26.05}: not run (needs root: it mounts into and chroots to a Debian root)" >> "$MPSR_SKIP_LOG"
else
  cp "$MPSR_SKIP_LOG" "$MPSR_SKIP_LOG.host" 2>/dev/null || : > "$MPSR_SKIP_LOG.host"
  if [ ${#newer[@]} -gt 0 ]; then
    grep -v "^resume_needs_no_typed_supervisor_where_slurm_can_insert_it:" "$MPSR_SKIP_LOG.host" > "$MPSR_SKIP_LOG.all" || true
  else
    cp "$MPSR_SKIP_LOG.host" "$MPSR_SKIP_LOG.all"
  fi
  for sr in "${newer[@]}"; do
    suite=${sr%%:*} rel=${sr#*:}
    if root=$(bash scripts/slurm-root.sh up "$suite"); then
      trap "bash scripts/slurm-root.sh down $suite" EXIT
      echo "test: the e2e suite on Slurm $(chroot "$root" slurmd -V)"
      env -u MPSR_INSTALLED_ROOT MPSR_SLURM_ROOT="$root" \
        MPSR_PLUGIN_SO="$PWD/target/slurm-$rel/debug/libmpsr_spank.so" \
        MPSR_SKIP_LOG="$MPSR_SKIP_LOG.$rel" cargo test --locked -p mpsr-e2e --test slurm
      grep -v "^a_rolling_upgrade_and_a_downgrade_keep_running_jobs_protected:" "$MPSR_SKIP_LOG.$rel" 2>/dev/null |
        sed "s/^/[Slurm $rel] /" >> "$MPSR_SKIP_LOG.all" || true
      bash scripts/slurm-root.sh down "$suite"
      trap - EXIT
    else
      echo "e2e on Slurm $rel: not run (no $suite root: network?)" >> "$MPSR_SKIP_LOG.all"
    fi
  done
  for sr in trixie:24.11 forky:26.05; do
    [[ " ${newer[*]} " == *" $sr "* ]] || echo "e2e on Slurm ${sr#*:}: not run (no ${sr%%:*} headers: network?)" >> "$MPSR_SKIP_LOG.all"
  done
  mv -f "$MPSR_SKIP_LOG.all" "$MPSR_SKIP_LOG"
fi
# The driver patch: C unit test, apply + build nvidia.ko/nvidia-uvm.ko against Debian's open source
# and kernel headers, check the built module (driver-patch/README.md). Never loads a module.
if [ "${MPSR_SKIP_DRIVER_PATCH:-0}" = 1 ]; then
  echo "driver-patch/build.sh: MPSR_SKIP_DRIVER_PATCH=1 (series not built)" >> "$MPSR_SKIP_LOG"
else
  bash driver-patch/build.sh
fi
if [ -s "$MPSR_SKIP_LOG" ]; then
  echo "test: $(wc -l < "$MPSR_SKIP_LOG") test(s) SKIPPED (not run, not passed):"
  sed 's/^/  /' "$MPSR_SKIP_LOG"
fi
