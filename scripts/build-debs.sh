#!/usr/bin/env bash
# The Debian packages (see scripts/build-packages.sh, which builds .deb and .rpm from one
# description):   scripts/build-debs.sh [OUT_DIR]     (default target/debian)
exec bash "$(dirname "$0")/build-packages.sh" deb "$@"
