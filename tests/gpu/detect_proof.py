#!/usr/bin/env python3
"""GPU proof of detection (issue 32): the agent (real nvml backend, telemetry at its defaults: 1 s
rounds, slow counters every 60th) with PyTorch/CuPy clients registered as jobs in GPU 0's shared
MPS server.

Cases:
  idle_cost   the telemetry thread's CPU per round and the whole agent's, idle, at the defaults;
  activity    GPM under MPS: a bf16 GEMM client, then a client that spin-waits on a flag in GPU
              memory as NCCL's kernels do while a peer computes, then both: what utilization, SM
              activity and tensor activity say of each (the straggler rule's activity pace rests
              on a spinning rank reading busy with idle tensor cores);
  steps       two ranks of one job in a PyTorch loop calling mpsr_state.step(), one doing 1.6x the
              work: step_skew names it; then the other stalls 6 s once (host side): step_spike
              names it; mpsr_rank_step_seconds in /metrics with the job's labels.

    MPSR_BIN=<dir with mpsr-agent, mpsrctl, libmpsr_state.so> python3 tests/gpu/detect_proof.py

Writes detect_proof.log / detect_proof.json (+ /metrics) to $OUT; exit 0 only if every check passed.
Never changes clocks, power limits, ECC, MIG or compute mode; stops only its daemons.
"""

import json
import sys
import time
import urllib.request

import gpucommon as g
from gpucommon import Task, check, ctl_json, say, sh, start_agent

RESULTS = g.RESULTS
PORT = 9421
STATE_PY = g.ROOT / "state-lib/python"

GEMM = r"""
import sys, time, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a); torch.cuda.synchronize()
print('READY', flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(8): c = a @ b
    torch.cuda.synchronize()
print('RESULT done', flush=True)
"""

# Spins on a flag in GPU memory (volatile loads, as NCCL's primitives wait for a peer), 64 blocks.
SPIN = r"""
import sys, time, cupy as cp
k = cp.RawKernel(r'''
extern "C" __global__ void spin(const volatile int *flag, long long cycles) {
    long long t0 = clock64();
    while (*flag == 0 && clock64() - t0 < cycles) { }
}''', 'spin')
flag = cp.zeros(1, dtype=cp.int32)
k((64,), (128,), (flag, cp.int64(1 << 30))); cp.cuda.Device().synchronize()
print('READY', flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    k((64,), (128,), (flag, cp.int64(1 << 30))); cp.cuda.Device().synchronize()
print('RESULT done', flush=True)
"""

# A rank's loop: `work` GEMMs per step, mpsr_state.step() after each; a stall of 6 s once when the
# file argv[3] appears (host side: no GPU work, no step ends).
STEPS = r"""
import os, sys, time, torch, mpsr_state
work, secs, stall = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
a = torch.randn(4096, 4096, device='cuda', dtype=torch.float16); b = torch.randn_like(a); torch.cuda.synchronize()
print('READY', flush=True)
end = time.time() + secs; n = 0; stalled = False
while time.time() < end:
    for _ in range(work): c = a @ b
    torch.cuda.synchronize()
    if not stalled and os.path.exists(stall):
        time.sleep(6); stalled = True
    mpsr_state.step(); n += 1
mpsr_state.step_finish()
print('RESULT steps %d' % n, flush=True)
"""


def py(code, *args):
    return ["env", f"PYTHONPATH={STATE_PY}", f"MPSR_STATE_LIB={g.BIN / 'libmpsr_state.so'}",
            sys.executable, "-c", code, *map(str, args)]


def top():
    r = ctl_json("top", "--once")
    return r.get("snapshot", {}) if isinstance(r, dict) else {}


def metrics():
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=5).read().decode()
    except OSError as e:
        return f"error {e}"


def watch(secs, rows):
    end = time.time() + secs
    while time.time() < end:
        s = top()
        rows.append({"t": time.time(), "gpu": (s.get("tick", {}).get("gpus") or [{}])[0],
                     "clients": s.get("tick", {}).get("clients", []), "findings": s.get("findings", []),
                     "cpu": s.get("cpu_seconds"), "rounds": s.get("rounds")})
        time.sleep(1)
    return rows


def gpu_series(rows, key):
    return [r["gpu"].get(key) for r in rows]


def found(rows, rule):
    return [f for r in rows for f in r["findings"] if f["rule"] == rule]


def mean(v):
    v = [x for x in v if x is not None]
    return sum(v) / len(v) if v else None


def main():
    g.setup("detect_proof.log", "/tmp/mpsr-gpu-detect")
    RESULTS["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    RESULTS["gpu"] = sh("nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader").stdout.strip()
    say(f"GPU: {RESULTS['gpu']}")
    cfg = g.write_agent_config(f"[keeper]\nenabled = false\n[telemetry]\nlisten = \"127.0.0.1:{PORT}\"\n")
    agent_log = open(g.OUT / "agent.log", "a")
    agent = start_agent(cfg, agent_log)
    if agent is None or agent.poll() is not None:
        say("agent did not start; see agent.log")
        return g.finish_common("detect_proof.json")

    case = "idle_cost"
    time.sleep(3)
    s0, a0, t0 = top(), g.proc_cpu(agent.pid), time.time()
    rows = watch(30, [])
    s1, a1, t1 = top(), g.proc_cpu(agent.pid), time.time()
    rounds = (s1.get("rounds", 0) - s0.get("rounds", 0)) or 1
    thr = s1.get("cpu_seconds", 0) - s0.get("cpu_seconds", 0)
    c = RESULTS["cases"].setdefault(case, {"checks": []})
    c["cost"] = {"wall_s": t1 - t0, "rounds": rounds, "telemetry_cpu_s": thr, "agent_cpu_s": a1 - a0,
                 "telemetry_ms_per_round": thr / rounds * 1000,
                 "telemetry_pct_of_core": thr / (t1 - t0) * 100, "agent_pct_of_core": (a1 - a0) / (t1 - t0) * 100}
    say(f"  cost (1 GPU, defaults): {c['cost']}")
    check(case, not any(r["findings"] for r in rows), "no findings on an idle GPU")
    check(case, rounds >= 25, f"1 s rounds at the defaults ({rounds} in {t1 - t0:.0f} s)")

    job = 800
    for case, code in (("activity_gemm", GEMM), ("activity_spin", SPIN)):
        job += 1
        t = Task(job, None, py(code, 14))
        ready = t.wait_line("READY", timeout=120)
        rows = watch(10, [])
        c = RESULTS["cases"].setdefault(case, {"checks": []})
        c["ready"] = bool(ready)
        for k in ("util", "sm_active", "sm_occupancy", "tensor_active", "dram_active"):
            c[k] = gpu_series(rows, k)
        say(f"  {case}: util {c['util']}\n    sm_active {c['sm_active']}\n    tensor {c['tensor_active']}")
        check(case, bool(ready), "client started")
        check(case, mean(c["util"]) and mean(c["util"]) > 0.8, f"GPU reads busy ({mean(c['util'])})")
        check(case, any(v is not None for v in c["tensor_active"]), "GPM readings under MPS")
        t.wait(60)
        t.done(0)
    ga = RESULTS["cases"]["activity_gemm"]
    sp = RESULTS["cases"]["activity_spin"]
    if mean(ga["tensor_active"]) is not None and mean(sp["tensor_active"]) is not None:
        check("activity_spin", mean(sp["tensor_active"]) < 0.05 < mean(ga["tensor_active"]),
              f"spinning reads busy with idle tensor cores (tensor {mean(sp['tensor_active']):.3f} "
              f"vs GEMM {mean(ga['tensor_active']):.3f})")

    case = "steps"
    job += 1
    stall = g.W / "stall-now"
    stall.unlink(missing_ok=True)
    fast = Task(job, None, py(STEPS, 10, 150, stall))
    slow = Task(job, None, py(STEPS, 16, 150, str(stall) + ".never"))
    c = RESULTS["cases"].setdefault(case, {"checks": []})
    t_start = time.time()
    for t in (fast, slow):
        check(case, bool(t.wait_line("READY", timeout=120)), "rank started")
    rows = watch(60, [])
    skew = [f for f in found(rows, "step_skew") if f["state"] == "raised"]
    c["step_skew"] = skew[:2]
    steps = {cl["pid"]: cl.get("steps") for r in rows[-1:] for cl in r["clients"]}
    c["steps_last"] = steps
    say(f"  step_skew: {skew[:1]}\n  steps: {steps}")
    check(case, any(f["subject"].get("pid") == slow.pid for f in skew),
          f"step_skew names the slow rank (pid {slow.pid})")
    check(case, not any(f["subject"].get("pid") == fast.pid for f in skew),
          "and not the fast one")
    m = metrics()
    (g.OUT / "metrics_steps.txt").write_text(m)
    check(case, f'hpc_job="{job}"' in m and "mpsr_rank_step_seconds{" in m, "mpsr_rank_step_seconds with the job's labels")
    t_stall = time.time()
    stall.write_text("")
    rows = watch(25, rows)
    spikes = [f for f in found(rows, "step_spike") if f["state"] == "raised"
              and f["subject"].get("pid") == fast.pid]
    c["step_spike"] = spikes[:1]
    say(f"  step_spike of the stalled rank: {spikes[:1]}")
    check(case, bool(spikes), f"step_spike names the rank that stalled (pid {fast.pid})")
    c["t"] = {"start": t_start, "stall": t_stall}
    for t in (fast, slow):
        t.p.kill()
        t.done(0)
    r = ctl_json("report", job)
    c["report"] = r
    check(case, "step_skew" in json.dumps(r), "the job's report has the step finding")
    agent.terminate()
    agent.wait(30)
    return g.finish_common("detect_proof.json")


if __name__ == "__main__":
    sys.exit(main())
