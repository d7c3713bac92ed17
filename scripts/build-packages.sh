#!/usr/bin/env bash
# Builds the packages, .deb or .rpm, from one description (the package list below: names,
# files, dependencies, conffiles, maintainer scripts), the paths of each distribution family:
#   mps-resilient        agent, mpsrctl, mpsr-run, mpsr-keeper, simulator, systemd unit, agent.toml,
#                        prolog/epilog/health check, NHC check, tmpfiles.d rule, job_submit.lua,
#                        man pages
#   mps-resilient-spank  the SPANK plugin, built against this host's Slurm headers and depending on
#                        that Slurm release (srun, sbatch and slurmstepd of that release load it)
#   libmpsr-state        the state library (SONAME libmpsr_state.so.0), its C header, Python module
#                        and mpsr-statetool
#   *-dbgsym (deb) / *-debuginfo (rpm)   debug info of each package's binaries (they ship
#                        stripped), under /usr/lib/debug/.build-id where gdb looks for it
#
#   scripts/build-packages.sh deb|rpm [OUT_DIR]    (default target/debian or target/rpm)
# MPSR_PKG_PROFILE=debug packs a debug build (the test command does, to save time). For rpm, the
# Slurm release is that of the headers the plugin is built against (SLURM_INCLUDE_DIR, else
# /usr/include); MPSR_RPM_PYTHON_SITELIB sets the Python directory (default EL9's).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
fmt=${1:?usage: build-packages.sh deb|rpm [OUT_DIR]}
case $fmt in
  deb) out=${2:-target/debian} ;;
  rpm) out=${2:-target/rpm} ;;
  *) echo "build-packages: format must be deb or rpm, not '$fmt'" >&2; exit 2 ;;
esac
profile=${MPSR_PKG_PROFILE:-${MPSR_DEB_PROFILE:-release}}
if [ "$profile" = release ]; then
  cargo build --release --workspace --locked
  bin=target/release
else
  cargo build --workspace --locked
  bin=target/debug
fi
MPSR_BIN_DIR=$bin bash scripts/manpages.sh "$bin/man" >/dev/null
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
maintainer="mps-resilient developers <mps-resilient-dev@lists.mps-resilient.org>"
# The Slurm release the plugin is built against: from the header's SLURM_VERSION_NUMBER.
hdr=${SLURM_INCLUDE_DIR:-/usr/include}/slurm/slurm_version.h
[ -f "$hdr" ] || { echo "build-packages: no $hdr (install Slurm's headers: libslurm-dev / slurm-devel)" >&2; exit 1; }
svn=$(awk '/#define SLURM_VERSION_NUMBER/ { print $3 }' "$hdr")
slurm_rel=$(printf '%d.%02d' $(( (svn >> 16) & 0xff )) $(( (svn >> 8) & 0xff )))
slurm_next=$(printf '%d.%02d' $(( (svn >> 16) & 0xff )) $(( ((svn >> 8) & 0xff) + 1 )))

# Where each family puts things.
if [ "$fmt" = deb ]; then
  arch=$(dpkg --print-architecture)
  multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
  libdir=usr/lib/$multiarch
  plugindir=$libdir/slurm-wlm
  unitdir=lib/systemd/system
  pydir=usr/lib/python3/dist-packages
  shlib_mode=644
else
  arch=$(uname -m)
  libdir=usr/lib64
  plugindir=usr/lib64/slurm
  unitdir=usr/lib/systemd/system
  shlib_mode=755
  pydir=${MPSR_RPM_PYTHON_SITELIB:-usr/lib/python3.9/site-packages}
  pydir=${pydir#/}
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$out"
out=$(cd "$out" && pwd)

put() { # put MODE SRC DEST_IN_PACKAGE
  install -D -m "$1" "$2" "$root/$3"
}
# A man page, compressed as both families ship them.
put_man() { # put_man SRC NAME
  install -d "$root/usr/share/man/man1"
  gzip -9n -c "$1" >"$root/usr/share/man/man1/$2.gz"
  chmod 644 "$root/usr/share/man/man1/$2.gz"
}
# An ELF file is shipped stripped; its debug info goes to the package's debug twin under
# /usr/lib/debug/.build-id/xx/yyyy.debug (where gdb looks for it by the file's build id).
put_elf() { # put_elf MODE SRC DEST_IN_PACKAGE
  put "$@"
  local f=$root/$3 id dbg
  id=$(readelf -n "$f" | sed -n 's/.*Build ID: \([0-9a-f]*\).*/\1/p')
  [ -n "$id" ] || { echo "build-packages: $2 has no build id" >&2; exit 1; }
  dbg=$root.debug/usr/lib/debug/.build-id/${id:0:2}/${id:2}.debug
  mkdir -p "$(dirname "$dbg")"
  objcopy --only-keep-debug --compress-debug-sections "$f" "$dbg"
  chmod 644 "$dbg"
  objcopy --strip-unneeded --remove-section=.comment "$f"
  objcopy --add-gnu-debuglink="$dbg" "$f"
  elves+=("$f")
}
# The newest glibc symbol version the package's binaries need.
glibc_min() {
  objdump -T "${elves[@]}" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1
}
# Copyright (machine-readable) and changelog in the package's doc directory.
docs() { # docs NAME
  local d=$root/usr/share/doc/$1
  install -d "$d"
  {
    echo "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/"
    echo "Upstream-Name: mps-resilient"
    echo
    echo "Files: *"
    echo "Copyright: 2026 mps-resilient developers"
    echo "License: Apache-2.0"
    echo " On Debian systems the full text is in /usr/share/common-licenses/Apache-2.0."
  } >"$d/copyright"
  if [ "$fmt" = deb ]; then
    printf '%s (%s) unstable; urgency=medium\n\n  * Release %s (see README.md and BENCHMARKS.md).\n\n -- %s  %s\n' \
      "$1" "$version" "$version" "$maintainer" "$(date -R -d @"${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}")" |
      gzip -9n >"$d/changelog.gz"
  fi
  chmod 644 "$d"/*
}

# One package: NAME, dependencies in a neutral form (libc, slurm-client, python3), summary and
# description lines (each under 80 characters), conffiles, maintainer scripts from
# scripts/pkg/NAME.{postinst,prerm,postrm} when present.
emit() { # emit NAME "DEPS" "SUMMARY" DESCRIPTION_LINE... ; uses $conffiles
  local name=$1 deps=$2 summary=$3
  shift 3
  docs "$name"
  if [ "$fmt" = deb ]; then emit_deb "$name" "$deps" "$summary" "$@"; else emit_rpm "$name" "$deps" "$summary" "$@"; fi
}

dep_deb() { # neutral dependency -> Debian relation
  case $1 in
    libc) echo "libc6 (>= $(glibc_min))" ;;
    slurm-client) echo "slurm-client (>= $slurm_rel), slurm-client (<< $slurm_next)" ;;
    slurm-tools) echo "slurm-client" ;;
    python3) echo "python3" ;;
  esac
}
dep_rpm() { # neutral dependency -> RPM Requires (SchedMD's and EPEL's Slurm both name it slurm)
  case $1 in
    libc) echo "glibc >= $(glibc_min)" ;;
    slurm-client) echo "slurm >= $slurm_rel, slurm < $slurm_next" ;;
    slurm-tools) echo "slurm" ;;
    python3) echo "python3" ;;
  esac
}

emit_deb() {
  local name=$1 deps=$2 summary=$3 d rel=""
  shift 3
  for d in $deps; do rel="${rel:+$rel, }$(dep_deb "$d")"; done
  mkdir -p "$root/DEBIAN"
  for s in postinst prerm postrm; do
    [ -f "scripts/pkg/$name.$s" ] && install -m 755 "scripts/pkg/$name.$s" "$root/DEBIAN/$s"
  done
  [ -n "$conffiles" ] && printf '%s\n' $conffiles >"$root/DEBIAN/conffiles"
  if [ "$name" = libmpsr-state ]; then
    echo "libmpsr_state 0 libmpsr-state (>= $version)" >"$root/DEBIAN/shlibs"
    echo "activate-noawait ldconfig" >"$root/DEBIAN/triggers"
  fi
  {
    echo "Package: $name"
    echo "Version: $version"
    echo "Architecture: $arch"
    echo "Maintainer: $maintainer"
    echo "Section: admin"
    echo "Priority: optional"
    [ -n "$rel" ] && echo "Depends: $rel"
    echo "Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)"
    echo "Homepage: https://github.com/mps-resilient/mps-resilient"
    echo "Description: $summary"
    for l in "$@"; do echo " $l"; done
  } >"$root/DEBIAN/control"
  dpkg-deb --build --root-owner-group "${zdeb[@]}" "$root" "$out/${name}_${version}_${arch}.deb" >/dev/null
  echo "build-packages: $out/${name}_${version}_${arch}.deb"
  # Its debug twin.
  local main=$root
  root=$main.debug
  mkdir -p "$root/DEBIAN"
  {
    echo "Package: $name-dbgsym"
    echo "Version: $version"
    echo "Architecture: $arch"
    echo "Maintainer: $maintainer"
    echo "Section: debug"
    echo "Priority: optional"
    echo "Depends: $name (= $version)"
    echo "Auto-Built-Package: debug-symbols"
    echo "Description: debug symbols for $name"
    echo " Debug info of the binaries of $name (they are shipped stripped)."
  } >"$root/DEBIAN/control"
  install -d "$root/usr/share/doc"
  ln -sfn "$name" "$root/usr/share/doc/$name-dbgsym"
  dpkg-deb --build --root-owner-group "${zdeb[@]}" "$root" "$out/${name}-dbgsym_${version}_${arch}.deb" >/dev/null
  echo "build-packages: $out/${name}-dbgsym_${version}_${arch}.deb"
  root=$main
}

emit_rpm() {
  local name=$1 deps=$2 summary=$3 d req="" top=$stage/rpmbuild spec
  shift 3
  for d in $deps; do req="${req:+$req, }$(dep_rpm "$d")"; done
  mkdir -p "$top"
  spec=$top/$name.spec
  {
    echo "Name: $name"
    echo "Version: $version"
    echo "Release: 1"
    echo "Summary: $summary"
    echo "License: Apache-2.0"
    echo "Group: System Environment/Daemons"
    echo "URL: https://github.com/mps-resilient/mps-resilient"
    echo "Packager: $maintainer"
    [ -n "$req" ] && echo "Requires: $req"
    # Built from staged files: no rebuild, no strip or debuginfo extraction by rpm (done above,
    # the same way as for the .deb), dependencies stated, not generated.
    echo "AutoReqProv: no"
    echo "%define debug_package %{nil}"
    echo "%define __os_install_post %{nil}"
    echo "%define _build_id_links none"
    echo "%description"
    printf '%s\n' "$@"
    echo "%install"
    echo "cp -a '$root/.' '$root.debug/.' %{buildroot}/"
    echo "%files"
    echo "%defattr(-,root,root,-)"
    (cd "$root" && find . -mindepth 1 \( -type f -o -type l \) | sed 's#^\.##' | sort) | while read -r f; do
      case " $conffiles " in *" $f "*) echo "%config(noreplace) $f" ;; *) echo "$f" ;; esac
    done
    for s in post preun postun; do
      [ -f "scripts/pkg/$name.rpm-$s" ] || continue
      # A scriptlet that only runs ldconfig is run as the interpreter itself (no shell).
      if [ "$(cat "scripts/pkg/$name.rpm-$s")" = /sbin/ldconfig ]; then
        echo "%$s -p /sbin/ldconfig"
      else
        echo "%$s"
        cat "scripts/pkg/$name.rpm-$s"
      fi
    done
    echo "%changelog"
    echo "* $(LC_ALL=C date -u -d @"${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}" '+%a %b %d %Y') $maintainer - $version-1"
    echo "- Release $version (see README.md and BENCHMARKS.md)."
    # Its debug twin.
    echo "%package debuginfo"
    echo "Summary: debug symbols for $name"
    echo "Group: Development/Debug"
    echo "Requires: $name = %{version}-%{release}"
    echo "%description debuginfo"
    echo "Debug info of the binaries of $name (they are shipped stripped)."
    echo "%files debuginfo"
    echo "%defattr(-,root,root,-)"
    (cd "$root.debug" && find . -type f | sed 's#^\.##' | sort)
  } >"$spec"
  rpmbuild -bb --quiet --define "_topdir $top" --define "_rpmdir $out" \
    --define "_build_name_fmt %%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm" \
    --define "_binary_payload $zrpm" --target "$arch" "$spec" >/dev/null
  echo "build-packages: $out/$name-$version-1.$arch.rpm"
  echo "build-packages: $out/$name-debuginfo-$version-1.$arch.rpm"
}

# Compression: xz for a release; gzip -1 for the debug build the tests pack (fast).
if [ "$profile" = release ]; then zdeb=(); zrpm=w6.xzdio; else zdeb=(-Zgzip -z1); zrpm=w1.gzdio; fi

root=$stage/mps-resilient
elves=()
for b in mpsr-agent mpsrctl mpsr-run mpsr-keeper mpsr-simgpu mpsr-simclient; do
  put_elf 755 "$bin/$b" "usr/bin/$b"
  put_man "$bin/man/$b.1" "$b.1"
done
for s in mpsr-prolog mpsr-epilog mpsr-healthcheck; do
  put 755 "scripts/slurm/$s" "usr/libexec/mps-resilient/$s"
done
put 644 etc/agent.toml etc/mps-resilient/agent.toml
put 644 etc/scripts.conf etc/mps-resilient/scripts.conf
put 644 etc/systemd/mps-resilient-agent.service "$unitdir/mps-resilient-agent.service"
put 644 etc/tmpfiles.d/mps-resilient.conf usr/lib/tmpfiles.d/mps-resilient.conf
put 644 etc/nhc/mpsr.nhc etc/nhc/scripts/mpsr.nhc
put 644 etc/job_submit.lua usr/share/mps-resilient/job_submit.lua
put 644 etc/slurm.conf.snippet usr/share/mps-resilient/slurm.conf.snippet
put 644 etc/prometheus/mps-resilient.rules.yml usr/share/mps-resilient/prometheus/mps-resilient.rules.yml
put 644 README.md usr/share/doc/mps-resilient/README.md
conffiles="/etc/mps-resilient/agent.toml /etc/mps-resilient/scripts.conf /etc/nhc/scripts/mpsr.nhc"
emit mps-resilient "libc slurm-tools" \
  "fault-resilient GPU sharing for Slurm: node agent" \
  "The per-node agent runs the MPS daemons (one per fault domain), watches GPU" \
  "faults and acts only on the jobs a fault hit (requeue, resume in place, drain" \
  "for hardware). Also: mpsrctl, the resume supervisor mpsr-run, the state keeper," \
  "the prolog/epilog/health check, an NHC check, the submission check" \
  "(job_submit.lua) and a SIMULATED GPU backend."

root=$stage/mps-resilient-spank
elves=()
put_elf "$shlib_mode" "$bin/libmpsr_spank.so" "$plugindir/mps_resilient.so"
put 644 etc/plugstack.conf.d/mps-resilient.conf etc/slurm/plugstack.conf.d/mps-resilient.conf
sed -i "s#/usr/lib/x86_64-linux-gnu/slurm-wlm/mps_resilient.so#/$plugindir/mps_resilient.so#" \
  "$root/etc/slurm/plugstack.conf.d/mps-resilient.conf"
conffiles="/etc/slurm/plugstack.conf.d/mps-resilient.conf"
# srun/sbatch (on login and compute nodes) and slurmstepd load it: the same release.
emit mps-resilient-spank "libc slurm-client" \
  "fault-resilient GPU sharing for Slurm: SPANK plugin (Slurm $slurm_rel)" \
  "Adds srun/sbatch --mps-resilient[=MODE]; gives each job its MPS context and" \
  "registers its tasks with the node agent. Built against Slurm $slurm_rel's spank.h."

root=$stage/libmpsr-state
elves=()
# The library under its SONAME, and the name programs link (-lmpsr_state) and Python loads.
put_elf "$shlib_mode" "$bin/libmpsr_state.so" "$libdir/libmpsr_state.so.0"
ln -s libmpsr_state.so.0 "$root/$libdir/libmpsr_state.so"
put 644 state-lib/include/mpsr_state.h usr/include/mpsr_state.h
put 644 state-lib/python/mpsr_state.py "$pydir/mpsr_state.py"
put_elf 755 "$bin/mpsr-statetool" usr/bin/mpsr-statetool
put_man "$bin/man/mpsr-statetool.1" mpsr-statetool.1
conffiles=""
emit libmpsr-state "libc python3" \
  "fault-resilient GPU sharing for Slurm: GPU state kept across faults" \
  "C ABI library, header and Python module with which an application keeps named" \
  "GPU allocations in the mps-resilient keeper, so they survive a fault or a" \
  "requeue."
