#!/usr/bin/env bash
# Coverage-guided fuzzing (afl.rs) of what reads untrusted input: the kernel log parser, the
# protocol frames and requests, the agent's TOML and the plugin's plugstack arguments.
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 600 s, every target)
# Needs cargo-afl (`cargo install cargo-afl`; it builds AFL++ on first use). Not part of CI: it
# runs for as long as it is told. Prints executions and findings per target; a crash input is
# left under fuzz/out/<target>/default/crashes/ and becomes a regression test.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
export PATH="$HOME/.cargo/bin:$PATH"
secs=${1:-600}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(kmsg frame agent_config plugstack)
command -v cargo-afl >/dev/null || { echo "fuzz: cargo-afl missing: cargo install cargo-afl" >&2; exit 1; }
cargo afl build --release -q
export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_QUIET=1
mkdir -p out
for t in "${targets[@]}"; do
  out="out/$t"
  # Resume a corpus left by an earlier run instead of starting over.
  in=seeds/$t; [ -d "$out/default/queue" ] && in=-
  echo "fuzz: $t for ${secs}s"
  nice cargo afl fuzz -i "$in" -o "$out" -V "$secs" -- "target/release/$t" >"out/$t.log" 2>&1 || true
  stats="$out/default/fuzzer_stats"
  if [ ! -f "$stats" ]; then
    echo "fuzz: $t did not start; see fuzz/out/$t.log" >&2
    tail -5 "out/$t.log" >&2
    exit 1
  fi
  get() { awk -F' *: *' -v k="$1" '$1 == k { print $2 }' "$stats"; }
  printf 'fuzz: %-13s execs %12s  execs/s %8s  corpus %5s  crashes %s  hangs %s\n' \
    "$t" "$(get execs_done)" "$(get execs_per_sec)" "$(get corpus_count)" \
    "$(get saved_crashes)" "$(get saved_hangs)"
done
