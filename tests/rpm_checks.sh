#!/usr/bin/env bash
# The RPMs as an EL admin would look at them before installing: built from the same description
# as the .debs, inspected (rpm -qip, -qlp, requires, scripts), installed with rpm --root into an
# empty root (no EL userland there: scriptlets and dependencies are not run/resolved), and
# rpmlint-clean (scripts/pkg/rpmlintrc filters openSUSE-only policy, each with why).
#   bash tests/rpm_checks.sh RPM_DIR
set -euo pipefail
dir=$1
fail() { echo "rpm_checks: FAILED: $*" >&2; exit 1; }
v=$(sed -n 's/^version = "\(.*\)"/\1/p' "$(dirname "$0")/../Cargo.toml" | head -1)
main=("$dir/mps-resilient-$v-1."*.rpm "$dir/mps-resilient-spank-$v-1."*.rpm "$dir/libmpsr-state-$v-1."*.rpm)
for r in "${main[@]}"; do
  [ -f "$r" ] || fail "$r not built"
  rpm -qip "$r" >/dev/null 2>&1 || fail "rpm -qip $r"
done
rpm -qlp "$dir/mps-resilient-spank-$v-1."*.rpm 2>/dev/null | grep -qx /usr/lib64/slurm/mps_resilient.so ||
  fail "the plugin is not in /usr/lib64/slurm"
rpm -qpR "$dir/mps-resilient-spank-$v-1."*.rpm 2>/dev/null | grep -q '^slurm >= ' || fail "the plugin does not require its Slurm release"
rpm -qpR "$dir/mps-resilient-$v-1."*.rpm 2>/dev/null | grep -q '^glibc >= 2\.' || fail "no versioned glibc requirement"
rpm -qpc "$dir/mps-resilient-$v-1."*.rpm 2>/dev/null | grep -qx /etc/mps-resilient/agent.toml || fail "agent.toml is not %config"
rpm -qp --scripts "$dir/mps-resilient-$v-1."*.rpm 2>/dev/null | grep -q 'try-restart mps-resilient-agent' ||
  fail "no restart on upgrade"
grep -q '/usr/lib64/slurm/mps_resilient.so' <(rpm2cpio "$dir/mps-resilient-spank-$v-1."*.rpm | cpio -i --to-stdout ./etc/slurm/plugstack.conf.d/mps-resilient.conf 2>/dev/null) ||
  fail "the plugstack line does not name the EL plugin path"
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
rpm --root "$root" --initdb
rpm --root "$root" -i --nodeps --noscripts "$dir"/*.rpm 2>/dev/null || fail "rpm --root install"
[ "$(rpm --root "$root" -qa 2>/dev/null | wc -l)" -eq 6 ] || fail "not every package installed"
[ -x "$root/usr/bin/mpsr-agent" ] && [ -f "$root/usr/lib/systemd/system/mps-resilient-agent.service" ] ||
  fail "installed files missing"
readelf -d "$root/usr/lib64/libmpsr_state.so.0" | grep -q 'SONAME.*libmpsr_state\.so\.0' || fail "SONAME"
if command -v rpmlint >/dev/null; then
  lint=$(rpmlint -r "$(dirname "$0")/../scripts/pkg/rpmlintrc" "${main[@]}" 2>&1 || true)
  echo "$lint" | tail -1
  echo "$lint" | grep -q ': E: ' && { echo "$lint" >&2; fail "rpmlint errors"; }
fi
echo "rpm_checks: built, inspected, installed into an empty root with rpm --root, rpmlint: ok"
