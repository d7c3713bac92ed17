#!/usr/bin/env bash
# Checks the built .debs and their files installed (dpkg --root) into ROOT:
#   bash tests/package_checks.sh DEB_DIR ROOT
set -euo pipefail
debs=$1 root=$2
fail() { echo "package_checks: FAILED: $*" >&2; exit 1; }
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
for f in "$root"/usr/bin/mpsr-agent "$root"/usr/bin/mpsrctl "$root/usr/lib/$multiarch/libmpsr_state.so.0" \
         "$root"/usr/lib/"$multiarch"/slurm-wlm/mps_resilient.so; do
  [ -f "$f" ] || fail "$f not installed"
  readelf -S "$f" | grep -q '\.debug_info' && fail "$f is not stripped"
  id=$(readelf -n "$f" | sed -n 's/.*Build ID: \([0-9a-f]*\).*/\1/p')
  dbg=$root/usr/lib/debug/.build-id/${id:0:2}/${id:2}.debug
  [ -f "$dbg" ] || fail "no debug info for $f at $dbg (-dbgsym package)"
  readelf -S "$dbg" 2>/dev/null | grep -q '\.debug_info' || fail "$dbg holds no debug info"
done
readelf -d "$root/usr/lib/$multiarch/libmpsr_state.so.0" | grep -q 'SONAME.*\[libmpsr_state\.so\.0\]' ||
  fail "libmpsr_state.so.0 has no SONAME libmpsr_state.so.0"
[ "$(readlink "$root/usr/lib/$multiarch/libmpsr_state.so")" = libmpsr_state.so.0 ] ||
  fail "libmpsr_state.so is not a link to its SONAME"
for p in mps-resilient mps-resilient-spank libmpsr-state; do
  dpkg-deb -f "$debs/${p}_"*_*.deb Depends | grep -q 'libc6 (>= 2\.[0-9]*)' ||
    fail "$p has no versioned libc6 dependency"
done
for s in postinst prerm postrm; do
  dpkg-deb -I "$debs"/mps-resilient_*_*.deb "$s" >/dev/null 2>&1 || fail "mps-resilient has no $s"
done
if command -v systemd-tmpfiles >/dev/null; then
  systemd-tmpfiles --root="$root" --create "$root/usr/lib/tmpfiles.d/mps-resilient.conf"
  [ "$(stat -c %a "$root/var/log/mps-resilient/jobs")" = 711 ] || fail "tmpfiles.d rule did not make the report directory 0711"
fi
echo "package_checks: stripped binaries with -dbgsym debug info, versioned libc6, SONAME, maintainer scripts, tmpfiles.d: ok"
