#!/usr/bin/env bash
# Builds and checks the mps-resilient driver patch without a GPU: runs the C unit test of its pure
# logic, fetches NVIDIA's open kernel module source (Debian's nvidia-open-kernel-source, component
# contrib, through a private apt directory: the host's apt sources are not touched), applies the
# series (dry run first, with a clear error when a patch does not apply), builds nvidia.ko and
# nvidia-uvm.ko against the installed kernel headers, and checks the built module carries the
# parameter and the line format the node agent parses. Never loads a module.
#
#   bash driver-patch/build.sh                 # Debian's source, newest /lib/modules/*/build
#   bash driver-patch/build.sh --src DIR       # a tree holding nvidia-uvm/ (e.g. kernel-open/)
#   bash driver-patch/build.sh --upstream CHECKOUT --series series-580
#                                    # an open-gpu-kernel-modules checkout (580: its kernel-open/
#                                    # needs the RM core nv-kernel.o built from src/nvidia first)
#   KERNEL=6.1.0-57-amd64 bash driver-patch/build.sh
#
# Output in target/driver-patch/ (the built .ko files under build/). Needs root for apt (sudo).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out="$root/target/driver-patch"
src=""
upstream=""
series=series
modules="nvidia nvidia-uvm"
while [ $# -gt 0 ]; do
  case "$1" in
    --src) src=$2; shift 2 ;;
    --upstream) upstream=$2; shift 2 ;;
    --series) series=$2; shift 2 ;;
    --modules) modules=$2; shift 2 ;;
    *) echo "driver-patch: unknown argument $1 (expected --src DIR, --upstream CHECKOUT, --series FILE, --modules LIST)" >&2; exit 2 ;;
  esac
done
[ -f "$here/$series" ] || { echo "driver-patch: no series file $here/$series" >&2; exit 2; }
SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
mkdir -p "$out"
for tool in gcc make patch modinfo strings nm xz; do
  command -v "$tool" >/dev/null || need_tools=1
done
if [ -n "${need_tools:-}" ]; then
  echo "driver-patch: installing build tools"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc make patch kmod binutils xz-utils >/dev/null
fi

echo "driver-patch: unit tests of the pure logic (src/mpsr_isolate.c, src/mpsr_contain.c)"
# Under ASan and UBSan: the same code runs in the kernel, where an overflow is no test failure.
san=(-fsanitize=address,undefined -fno-sanitize-recover=all)
for t in isolate contain; do
  gcc -Wall -Wextra -Werror -std=gnu11 "${san[@]}" -o "$out/test_mpsr_$t" \
    "$here/test/test_mpsr_$t.c" "$here/src/mpsr_$t.c"
  "$out/test_mpsr_$t"
done

# Kernel headers (Debian main) and the open module source (Debian contrib).
kernel=${KERNEL:-}
if [ -z "$kernel" ]; then
  if ! ls -d /lib/modules/*/build >/dev/null 2>&1; then
    echo "driver-patch: installing linux-headers-amd64"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-headers-amd64 >/dev/null
  fi
  kernel=$(for d in /lib/modules/*/build; do basename "$(dirname "$d")"; done | sort -V | tail -1)
fi
[ -d "/lib/modules/$kernel/build" ] || { echo "driver-patch: no headers for kernel $kernel in /lib/modules/$kernel/build" >&2; exit 1; }

if [ -n "$upstream" ]; then
  [ -d "$upstream/kernel-open/nvidia-uvm" ] && [ -d "$upstream/src/nvidia" ] ||
    { echo "driver-patch: $upstream is no open-gpu-kernel-modules checkout (kernel-open/, src/nvidia/)" >&2; exit 1; }
elif [ -z "$src" ]; then
  apt_dir="$out/apt"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/deb"
  echo "deb http://deb.debian.org/debian bookworm contrib" > "$apt_dir/sources.list"
  opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o APT::Sandbox::User=root)
  if ! ls "$apt_dir"/deb/nvidia-open-kernel-source_*.deb >/dev/null 2>&1; then
    echo "driver-patch: fetching nvidia-open-kernel-source (bookworm contrib)"
    apt-get -qq "${opts[@]}" update
    (cd "$apt_dir/deb" && apt-get -qq "${opts[@]}" download nvidia-open-kernel-source)
  fi
  deb=$(ls "$apt_dir"/deb/nvidia-open-kernel-source_*.deb | tail -1)
  rm -rf "$out/src" && mkdir -p "$out/src"
  dpkg-deb -x "$deb" "$out/src/pkg"
  tar -C "$out/src" -xf "$out/src/pkg/usr/src/nvidia-open-kernel.tar.xz"
  src="$out/src/modules/nvidia-open-kernel"
  echo "driver-patch: source $(basename "$deb")"
fi
if [ -n "$upstream" ]; then
  # The whole checkout is built (RM core, then kernel-open); the series applies to kernel-open/.
  top="$out/upstream"
  rm -rf "$top" && cp -a "$upstream" "$top"
  build="$top/kernel-open"
else
  [ -d "$src/nvidia-uvm" ] || { echo "driver-patch: $src holds no nvidia-uvm/" >&2; exit 1; }
  build="$out/build"
  rm -rf "$build" && cp -a "$src" "$build"
  top="$build"
fi
grep -v '^#' "$here/$series" | while read -r p; do
  [ -n "$p" ] || continue
  if ! patch --dry-run -s -p1 -d "$build" < "$here/$p" >/dev/null; then
    echo "driver-patch: $p does not apply to $src" >&2
    patch --dry-run -p1 -d "$build" < "$here/$p" >&2 || true
    exit 1
  fi
  patch -s -p1 -d "$build" < "$here/$p"
  echo "driver-patch: applied $p"
done
cp "$here"/src/*.c "$here"/src/*.h "$build/nvidia-uvm/"

echo "driver-patch: building $modules for $kernel"
start=$(date +%s)
make -C "$top" -j"$(nproc)" KERNEL_UNAME="$kernel" NV_KERNEL_MODULES="$modules" modules \
  > "$out/build.log" 2>&1 || { tail -40 "$out/build.log" >&2; echo "driver-patch: build failed (log: $out/build.log)" >&2; exit 1; }
echo "driver-patch: built in $(( $(date +%s) - start )) s"

uvm="$build/nvidia-uvm.ko"
for m in $modules; do
  [ -f "$build/$m.ko" ] || { echo "driver-patch: $m.ko missing after the build" >&2; exit 1; }
done
fail=0
check() { if eval "$2"; then echo "driver-patch: ok    $1"; else echo "driver-patch: FAIL  $1" >&2; fail=1; fi; }
# (grep without -q: under pipefail an early exit would fail the producer with SIGPIPE)
check "nvidia-uvm.ko has the parameter uvm_mpsr_attribution" \
  "modinfo -F parm '$uvm' | grep '^uvm_mpsr_attribution:' >/dev/null"
if grep -q 'mpsr-containment' "$here/$series"; then
  for p in uvm_mpsr_containment uvm_mpsr_contain_budget; do
    check "nvidia-uvm.ko has the parameter $p" "modinfo -F parm '$uvm' | grep '^$p:' >/dev/null"
  done
  # The fault path calls it (not just: the file was compiled).
  check "the replayable fault path calls the containment (defer + apply)" \
    "nm '$build/nvidia-uvm/uvm_gpu_replayable_faults.o' | grep -E ' U (uvm_mpsr_contain_defer|uvm_mpsr_contain_apply)\$' | wc -l | grep -x 2 >/dev/null"
fi
check "nvidia-uvm.ko prints the line the agent parses" \
  "strings '$uvm' | grep -F 'mpsr-isolate (PCI:%04x:%02x:%02x): xid=%u culprit_pid=%d contained=%d' >/dev/null"
check "built for $kernel" "modinfo -F vermagic '$uvm' | grep '^$kernel ' >/dev/null"
echo "driver-patch: nvidia-uvm.ko version $(modinfo -F version "$uvm"), vermagic $(modinfo -F vermagic "$uvm")"
exit $fail
