#!/usr/bin/env bash
# Runs every test: unit tests, and integration tests that start the agent as a real process with
# simulated GPUs and real client processes. Needs only a Rust toolchain (cargo).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  echo "test: cargo is needed (https://rustup.rs)"; exit 1
fi
cargo test --workspace --locked
