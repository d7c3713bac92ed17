#!/usr/bin/env bash
# A Slurm upgrade must not leave a stale plugin: the plugin rebuilt in the same tree after Slurm's
# headers changed (libslurm-dev upgraded) carries the new plugin_version. Slurm refuses a plugin
# whose major.minor differs, and with the plugstack line `required` every srun/sbatch then fails.
# Builds the plugin against a copy of Slurm's headers, changes SLURM_VERSION_NUMBER in the copy,
# builds again (same tree, same environment) and reads plugin_version from each .so.
#   bash tests/plugin_rebuild.sh          (SLURM_INCLUDE_DIR: where slurm/ is; default /usr/include)
set -euo pipefail
cd "$(dirname "$0")/.."
src=${SLURM_INCLUDE_DIR:-/usr/include}
w=$PWD/target/plugin-rebuild
rm -rf "$w/include"
mkdir -p "$w/include"
cp -r "$src/slurm" "$w/include/"
so=$w/target/debug/libmpsr_spank.so
build() { CARGO_TARGET_DIR=$w/target SLURM_INCLUDE_DIR=$w/include cargo build --locked -q -p mpsr-spank; }
# plugin_version as the .so holds it (a little-endian u32 at the symbol's address).
version() {
  local addr bytes
  addr=$(nm -D --defined-only "$so" | awk '$3 == "plugin_version" { print $1 }')
  [ -n "$addr" ] || { echo "plugin_rebuild: no plugin_version in $so" >&2; exit 1; }
  bytes=$(objdump -s -j .rodata --start-address="0x$addr" --stop-address="$((0x$addr + 4))" "$so" |
    awk '$1 ~ /^[0-9a-f]+$/ && length($2) == 8 { print $2; exit }')
  printf '0x%s%s%s%s\n' "${bytes:6:2}" "${bytes:4:2}" "${bytes:2:2}" "${bytes:0:2}"
}
header() { awk '/#define SLURM_VERSION_NUMBER/ { print $3 }' "$w/include/slurm/slurm_version.h"; }
ver_h=$(printf '0x%08x' "$(header)")
build
v1=$(version)
[ "$v1" = "$ver_h" ] || { echo "plugin_rebuild: built plugin_version $v1, header says $ver_h" >&2; exit 1; }
# As an upgrade to the next major release would: the header's version moves on.
new=$(printf '0x%08x' $(( $(header) + 0x010000 )))
sed -i "s/#define SLURM_VERSION_NUMBER .*/#define SLURM_VERSION_NUMBER $new/" "$w/include/slurm/slurm_version.h"
build
v2=$(version)
if [ "$v2" != "$new" ]; then
  echo "plugin_rebuild: FAILED: after the header changed to $new the rebuilt plugin still says $v2 (stale bindings)" >&2
  exit 1
fi
echo "plugin_rebuild: plugin_version $v1 -> $v2 after the header changed (rebuilt in the same tree)"
