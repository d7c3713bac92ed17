#!/usr/bin/env python3
"""Detection latency from the logs of a gpu_proof.py run: the MPS server's own log line for each
fatal GPU error ("Server is handling a fatal GPU error", wall clock, ms) -> the agent's decision
line for that fault (wall clock, us). Both clocks are the same machine's, so no calibration is
needed (unlike the kernel log's monotonic timestamps inside a VM).

    python3 tests/gpu/latency_from_logs.py tests/gpu/results/<run>
"""

import datetime
import re
import sys


def main(run):
    srv = []
    for line in open(f"{run}/mps-gpu0-server.log"):
        if "handling a fatal GPU error" in line:
            ts = re.match(r"\[(\S+ \S+)", line).group(1)
            srv.append(datetime.datetime.strptime(ts, "%Y-%m-%d %H:%M:%S.%f").replace(
                tzinfo=datetime.timezone.utc).timestamp())
    first = {}
    for line in open(f"{run}/agent.log"):
        m = re.search(r"fault_id=(\d+)", line)
        if "mpsr_decision" in line and m:
            t = datetime.datetime.strptime(line.split()[0][:26], "%Y-%m-%dT%H:%M:%S.%f").replace(
                tzinfo=datetime.timezone.utc).timestamp()
            first.setdefault(int(m.group(1)), t)
    decisions = sorted(first.values())
    lat = sorted((next(d for d in decisions if d >= s - 0.5) - s) * 1000 for s in srv
                 if any(d >= s - 0.5 for d in decisions))
    if not lat:
        print("no matched faults")
        return 1
    print(f"MPS server fatal error -> agent decision, {len(lat)} faults: p50 {lat[len(lat) // 2]:.1f} ms, "
          f"p99 {lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.1f} ms, max {lat[-1]:.1f} ms "
          f"(server log has 1 ms resolution)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
