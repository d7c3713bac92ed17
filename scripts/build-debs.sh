#!/usr/bin/env bash
# Builds the Debian packages from the workspace with dpkg-deb:
#   mps-resilient        agent, mpsrctl, mpsr-run, mpsr-keeper, simulator, systemd unit, agent.toml,
#                        prolog/epilog/health check, job_submit.lua, man pages
#   mps-resilient-spank  the SPANK plugin, built against this host's libslurm-dev and depending on
#                        that Slurm release (srun, sbatch and slurmstepd of that release load it)
#   libmpsr-state        the state library, its C header, Python module and mpsr-statetool
#   *-dbgsym             the debug info of each package's binaries (they ship stripped), found by
#                        gdb through /usr/lib/debug/.build-id
#   scripts/build-debs.sh [OUT_DIR]       (default target/debian; MPSR_DEB_PROFILE=debug packs a
#                                         debug build, as the test command does to save time)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
out=${1:-target/debian}
profile=${MPSR_DEB_PROFILE:-release}
if [ "$profile" = release ]; then
  cargo build --release --workspace --locked
  bin=target/release
  compress=()
else
  cargo build --workspace --locked
  bin=target/debug
  # Debug binaries are large and only checked here: xz would take minutes.
  compress=(-Znone)
fi
MPSR_BIN_DIR=$bin bash scripts/manpages.sh "$bin/man" >/dev/null
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
slurm=$(dpkg-query -W -f='${Version}' libslurm-dev 2>/dev/null) || {
  echo "build-debs: libslurm-dev is not installed (the plugin is built against it)" >&2; exit 1; }
# 22.05.8-4+deb12u3 -> 22.05: the plugin goes with that release's slurmd only.
slurm_rel=$(sed 's/^\([0-9]*\)\.\([0-9]*\).*/\1.\2/' <<<"$slurm")
slurm_next="${slurm_rel%.*}.$(printf '%02d' $((10#${slurm_rel#*.} + 1)))"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$out"

put() { # put MODE SRC DEST_IN_PACKAGE
  install -D -m "$1" "$2" "$root/$3"
}
# An ELF file is shipped stripped; its debug info goes to the package's -dbgsym twin under
# /usr/lib/debug/.build-id/xx/yyyy.debug (where gdb looks for it by the file's build id).
put_elf() { # put_elf MODE SRC DEST_IN_PACKAGE
  put "$@"
  local f=$root/$3 id dbg
  id=$(readelf -n "$f" | sed -n 's/.*Build ID: \([0-9a-f]*\).*/\1/p')
  [ -n "$id" ] || { echo "build-debs: $2 has no build id" >&2; exit 1; }
  dbg=$root-dbgsym/usr/lib/debug/.build-id/${id:0:2}/${id:2}.debug
  mkdir -p "$(dirname "$dbg")"
  objcopy --only-keep-debug --compress-debug-sections "$f" "$dbg"
  chmod 644 "$dbg"
  objcopy --strip-unneeded --remove-section=.comment --remove-section=.note "$f" 2>/dev/null ||
    objcopy --strip-unneeded "$f"
  objcopy --add-gnu-debuglink="$dbg" "$f"
  elves+=("$f")
}
# The newest glibc symbol version the package's binaries need: its libc6 dependency.
libc_dep() {
  local v
  v=$(objdump -T "${elves[@]}" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1)
  echo "libc6 (>= ${v:-2.17})"
}
# The -dbgsym package of the package just staged.
build_dbgsym() { # build_dbgsym NAME
  local main=$root
  root=$main-dbgsym
  control "$1-dbgsym" "$1 (= $version)" "debug symbols for $1" \
    "Debug info of the binaries of $1 (they are shipped stripped)."
  sed -i 's/^Section: admin/Section: debug/' "$root/DEBIAN/control"
  build "$1-dbgsym"
  root=$main
}
control() { # control NAME DEPENDS DESCRIPTION...
  local name=$1 depends=$2
  shift 2
  mkdir -p "$root/DEBIAN"
  {
    echo "Package: $name"
    echo "Version: $version"
    echo "Architecture: $arch"
    echo "Maintainer: mps-resilient developers <mps-resilient@localhost>"
    echo "Section: admin"
    echo "Priority: optional"
    [ -n "$depends" ] && echo "Depends: $depends"
    echo "Installed-Size: $(du -sk "$root" | cut -f1)"
    echo "Description: $1"
    shift
    for l in "$@"; do echo " $l"; done
  } >"$root/DEBIAN/control"
}
build() {
  dpkg-deb --build --root-owner-group "${compress[@]}" "$root" "$out/${1}_${version}_${arch}.deb" >/dev/null
  echo "build-debs: $out/${1}_${version}_${arch}.deb"
}

root=$stage/mps-resilient
elves=()
for b in mpsr-agent mpsrctl mpsr-run mpsr-keeper mpsr-simgpu mpsr-simclient; do
  put_elf 755 "$bin/$b" "usr/bin/$b"
  put 644 "$bin/man/$b.1" "usr/share/man/man1/$b.1"
done
for s in mpsr-prolog mpsr-epilog mpsr-healthcheck; do
  put 755 "scripts/slurm/$s" "usr/libexec/mps-resilient/$s"
done
put 644 etc/agent.toml etc/mps-resilient/agent.toml
put 644 etc/scripts.conf etc/mps-resilient/scripts.conf
put 644 etc/systemd/mps-resilient-agent.service lib/systemd/system/mps-resilient-agent.service
put 644 etc/tmpfiles.d/mps-resilient.conf usr/lib/tmpfiles.d/mps-resilient.conf
put 644 etc/nhc/mpsr.nhc etc/nhc/scripts/mpsr.nhc
put 644 etc/job_submit.lua usr/share/mps-resilient/job_submit.lua
put 644 etc/slurm.conf.snippet usr/share/mps-resilient/slurm.conf.snippet
put 644 etc/prometheus/mps-resilient.rules.yml usr/share/mps-resilient/prometheus/mps-resilient.rules.yml
put 644 README.md usr/share/doc/mps-resilient/README.md
# Maintainer scripts: the agent enabled on first install and restarted on upgrade (its MPS daemons
# and the running jobs' servers keep running: KillMode=process), stopped on removal.
mkdir -p "$root/DEBIAN"
install -m 755 scripts/deb/postinst "$root/DEBIAN/postinst"
install -m 755 scripts/deb/prerm "$root/DEBIAN/prerm"
install -m 755 scripts/deb/postrm "$root/DEBIAN/postrm"
control mps-resilient "$(libc_dep), slurm-client" \
  "fault-resilient GPU sharing for Slurm: node agent" \
  "The per-node agent runs the MPS daemons (one per fault domain), watches GPU faults" \
  "and acts only on the jobs a fault hit (requeue, resume in place, drain for hardware)." \
  "Also: mpsrctl, the resume supervisor mpsr-run, the state keeper, the prolog/epilog/" \
  "health check, the submission check (job_submit.lua) and a SIMULATED GPU backend."
printf '/etc/mps-resilient/agent.toml\n/etc/mps-resilient/scripts.conf\n/etc/nhc/scripts/mpsr.nhc\n' >"$root/DEBIAN/conffiles"
build mps-resilient
build_dbgsym mps-resilient

root=$stage/mps-resilient-spank
elves=()
put_elf 644 "$bin/libmpsr_spank.so" "usr/lib/$multiarch/slurm-wlm/mps_resilient.so"
put 644 etc/plugstack.conf.d/mps-resilient.conf etc/slurm/plugstack.conf.d/mps-resilient.conf
# srun/sbatch (slurm-client, on login and compute nodes) and slurmstepd load it: the same release.
control mps-resilient-spank "$(libc_dep), slurm-client (>= $slurm_rel), slurm-client (<< $slurm_next)" \
  "fault-resilient GPU sharing for Slurm: SPANK plugin (Slurm $slurm_rel)" \
  "Adds srun/sbatch --mps-resilient[=MODE]; gives each job its MPS context and registers" \
  "its tasks with the node agent. Built against Slurm $slurm's spank.h."
printf '/etc/slurm/plugstack.conf.d/mps-resilient.conf\n' >"$root/DEBIAN/conffiles"
build mps-resilient-spank
build_dbgsym mps-resilient-spank

root=$stage/libmpsr-state
elves=()
# The library under its SONAME, and the name programs link (-lmpsr_state) and Python loads.
put_elf 644 "$bin/libmpsr_state.so" "usr/lib/$multiarch/libmpsr_state.so.0"
ln -s libmpsr_state.so.0 "$root/usr/lib/$multiarch/libmpsr_state.so"
put 644 state-lib/include/mpsr_state.h usr/include/mpsr_state.h
put 644 state-lib/python/mpsr_state.py usr/lib/python3/dist-packages/mpsr_state.py
put_elf 755 "$bin/mpsr-statetool" usr/bin/mpsr-statetool
put 644 "$bin/man/mpsr-statetool.1" usr/share/man/man1/mpsr-statetool.1
control libmpsr-state "$(libc_dep)" \
  "fault-resilient GPU sharing for Slurm: GPU state kept across faults" \
  "C ABI library, header and Python module with which an application keeps named GPU" \
  "allocations in the mps-resilient keeper, so they survive a fault or a requeue."
build libmpsr-state
build_dbgsym libmpsr-state
