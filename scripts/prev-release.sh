#!/usr/bin/env bash
# Builds the previous release (0.1.0, the commit below) next to this one, for the rolling-upgrade
# test: its agent, keeper, simulator, mpsrctl, mpsr-run, state library and SPANK plugin (built
# against this host's spank.h). Prints the directory holding them; fails (exit 1, why on stderr)
# when the commit is not in this clone (a shallow clone) or does not build.
#   bash scripts/prev-release.sh            -> target/prev-0.1.0/debug
set -euo pipefail
cd "$(dirname "$0")/.."
PREV_VERSION=0.1.0
PREV_COMMIT=07d95108622ccdda1c82bcc3006c900c7bf4a697
src=target/prev-$PREV_VERSION-src
out=target/prev-$PREV_VERSION
if ! git cat-file -e "$PREV_COMMIT^{commit}" 2>/dev/null; then
  echo "prev-release: commit $PREV_COMMIT ($PREV_VERSION) is not in this clone" >&2
  exit 1
fi
if [ ! -f "$src/.commit" ] || [ "$(cat "$src/.commit")" != "$PREV_COMMIT" ]; then
  rm -rf "$src"
  mkdir -p "$src"
  git archive "$PREV_COMMIT" | tar -x -C "$src"
  echo "$PREV_COMMIT" > "$src/.commit"
fi
(cd "$src" && CARGO_TARGET_DIR="$PWD/../prev-$PREV_VERSION" cargo build --locked -q \
  -p mpsr-agent -p mpsr-spank -p mpsr-run -p mpsr-state -p mpsr-keeper -p mpsr-simgpu) >&2
echo "$PWD/$out/debug"
