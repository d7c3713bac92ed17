#!/usr/bin/env python3
"""GPU proof of the agent's telemetry (issue 13): the agent (real nvml backend, telemetry every
second, /metrics on localhost) with PyTorch clients registered as jobs in GPU 0's shared server.

Cases: idle (no findings; CPU cost of the telemetry thread); a small client alone, then beside a
bf16 GEMM hog without and with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (what NVML reports per MPS client,
whether mps_hog names the hog and the starved job, the small client's rate); a heavy GEMM alone
(clock-event bits, power); a near-OOM allocation (near_oom attributed to its job); host<->device
copies (PCIe throughput). Rule windows are shortened in the agent config so each case fits in
seconds; the thresholds are the table's.

    MPSR_BIN=<dir with mpsr-agent, mpsrctl> python3 tests/gpu/telemetry_proof.py

Writes telemetry_proof.log / telemetry_proof.json (+ /metrics samples) to $OUT; exit 0 only if every
check passed. Never changes clocks, power limits, ECC, MIG or compute mode; stops only its daemons.
"""

import json
import sys
import time
import urllib.request

import gpucommon as g
from gpucommon import Task, check, ctl_json, say, sh, start_agent

RESULTS = g.RESULTS
PORT = 9419

SMALL = r"""
import sys, time, torch
x = torch.ones(1 << 16, device='cuda'); torch.cuda.synchronize()
print('READY', flush=True)
end = time.time() + float(sys.argv[1]); n = 0; t0 = time.time(); lat = []
while time.time() < end:
    s = time.perf_counter(); x.add_(1); torch.cuda.synchronize(); lat.append(time.perf_counter() - s); n += 1
lat.sort()
print('RESULT rate %.0f p50_us %.1f p99_us %.1f' % (n / (time.time() - t0), lat[len(lat)//2] * 1e6, lat[int(len(lat)*0.99)] * 1e6), flush=True)
"""

HOG = r"""
import sys, time, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a); torch.cuda.synchronize()
print('READY', flush=True)
end = time.time() + float(sys.argv[1]); n = 0; t0 = time.time()
while time.time() < end:
    for _ in range(8): c = a @ b
    torch.cuda.synchronize(); n += 8
print('RESULT tflops %.1f' % (n * 2 * 8192**3 / (time.time() - t0) / 1e12), flush=True)
"""

OOM = r"""
import sys, time, torch
free, total = torch.cuda.mem_get_info()
x = torch.empty(int(free * 0.97) // 4, dtype=torch.float32, device='cuda'); x.fill_(1); torch.cuda.synchronize()
print('READY free_mib %d total_mib %d' % (free >> 20, total >> 20), flush=True)
time.sleep(float(sys.argv[1]))
"""

COPY = r"""
import sys, time, torch
h = torch.empty(1 << 28, dtype=torch.float32).pin_memory(); d = torch.empty_like(h, device='cuda')
print('READY', flush=True)
end = time.time() + float(sys.argv[1]); n = 0; t0 = time.time()
while time.time() < end:
    d.copy_(h, non_blocking=True); h.copy_(d, non_blocking=True); torch.cuda.synchronize(); n += 2
print('RESULT GBps %.1f' % (n * (1 << 30) / (time.time() - t0) / 1e9), flush=True)
"""


def py(code, secs):
    return [sys.executable, "-c", code, secs]


def top():
    r = ctl_json("top", "--once")
    return r.get("snapshot", {}) if isinstance(r, dict) else {}


def metrics():
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=5).read().decode()
    except OSError as e:
        return f"error {e}"


def watch(secs, rows):
    """Samples `mpsrctl top` once a second."""
    end = time.time() + secs
    while time.time() < end:
        s = top()
        rows.append({"t": time.time(), "gpu": (s.get("tick", {}).get("gpus") or [{}])[0],
                     "clients": s.get("tick", {}).get("clients", []), "findings": s.get("findings", []),
                     "cpu": s.get("cpu_seconds"), "rounds": s.get("rounds")})
        time.sleep(1)
    return rows


def result(task):
    hit = task.wait_line("RESULT", timeout=120)
    return hit[1] if hit else None


def client_utils(rows, pid):
    return [c.get("sm_util") for r in rows for c in r["clients"] if c["pid"] == pid]


def found(rows, rule):
    return [f for r in rows for f in r["findings"] if f["rule"] == rule]


def main():
    g.setup("telemetry_proof.log", "/tmp/mpsr-gpu-tel")
    RESULTS["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    RESULTS["gpu"] = sh("nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader").stdout.strip()
    say(f"GPU: {RESULTS['gpu']}")
    tuning = "".join(f"[telemetry.rules.{r}]\nwindow_s = {w}\nclear_s = {c}\n" for r, w, c in
                     (("mps_hog", 4.0, 4.0), ("mps_contention", 4.0, 4.0), ("near_oom", 2.0, 3.0), ("straggler", 4.0, 4.0),
                      ("idle_allocation", 8.0, 4.0)))
    cfg = g.write_agent_config("[keeper]\nenabled = false\n[telemetry]\ninterval_ms = 1000\nslow_every = 5\n"
                               f"listen = \"127.0.0.1:{PORT}\"\n" + tuning)
    agent_log = open(g.OUT / "agent.log", "a")
    agent = start_agent(cfg, agent_log)
    if agent is None or agent.poll() is not None:
        say("agent did not start; see agent.log")
        return g.finish_common("telemetry_proof.json")
    # --- idle: no findings, CPU of the telemetry thread and of the whole agent ------------------------
    case = "idle"
    time.sleep(3)
    s0, a0, t0 = top(), g.proc_cpu(agent.pid), time.time()
    rows = watch(20, [])
    s1, a1, t1 = top(), g.proc_cpu(agent.pid), time.time()
    rounds = (s1.get("rounds", 0) - s0.get("rounds", 0)) or 1
    thr = (s1.get("cpu_seconds", 0) - s0.get("cpu_seconds", 0))
    RESULTS["cases"].setdefault(case, {"checks": []})["cost"] = {
        "wall_s": t1 - t0, "rounds": rounds, "telemetry_cpu_s": thr, "agent_cpu_s": a1 - a0,
        "telemetry_ms_per_round_per_gpu": thr / rounds * 1000,
        "telemetry_pct_of_core_at_1s": thr / (t1 - t0) * 100, "agent_pct_of_core": (a1 - a0) / (t1 - t0) * 100}
    say(f"  cost: {RESULTS['cases'][case]['cost']}")
    check(case, not any(r["findings"] for r in rows), "no findings on an idle GPU")
    check(case, rows and rows[-1]["gpu"].get("kind") == "sample", f"GPU 0 read: {rows[-1]['gpu'] if rows else None}")
    (g.OUT / "metrics_idle.txt").write_text(metrics())
    # --- small client alone, then beside a hog -------------------------------------------------------
    job = 500
    case = "small_alone"
    small = Task(job, None, py(SMALL, 8))
    small.wait_line("READY")
    rows = watch(6, [])
    RESULTS["cases"].setdefault(case, {"checks": []})["small"] = result(small)
    RESULTS["cases"][case]["client_sm_util"] = client_utils(rows, small.pid)
    say(f"  small alone: {RESULTS['cases'][case]['small']}; NVML per-client sm_util {client_utils(rows, small.pid)}")
    small.done(0)
    for case, env in (("hog_unlimited", None), ("hog_thread_pct_25", "25")):
        job += 2
        hog_argv = py(HOG, 16)
        if env:
            hog_argv = ["env", f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={env}"] + hog_argv
        hog = Task(job, None, hog_argv)
        hog.wait_line("READY")
        small = Task(job + 1, None, py(SMALL, 12))
        small.wait_line("READY")
        rows = watch(11, [])
        c = RESULTS["cases"].setdefault(case, {"checks": []})
        c["small"], c["hog"] = result(small), result(hog)
        c["hog_sm_util"], c["small_sm_util"] = client_utils(rows, hog.pid), client_utils(rows, small.pid)
        c["gpu_util"] = [r["gpu"].get("util") for r in rows]
        hogs = found(rows, "mps_hog")
        c["mps_hog"] = hogs[:1]
        cont = found(rows, "mps_contention")
        c["mps_contention"] = cont[:1]
        jobs_named = {o["job"] for f in cont for o in f["others"]}
        check(case, {job, job + 1} <= jobs_named, f"mps_contention names both jobs of the saturated server: {jobs_named}")
        check(case, not hogs, f"no mps_hog from the MPS server's own utilization: {hogs[:1]}")
        say(f"  {case}: small {c['small']} hog {c['hog']}; NVML per-client sm_util hog {c['hog_sm_util']} "
            f"small {c['small_sm_util']}; gpu util {c['gpu_util']}; mps_contention {cont[:1]}")
        if any(u for u in c["hog_sm_util"] if u):
            check(case, any(f["owner"] and f["owner"]["job"] == job and any(o["job"] == job + 1 for o in f["others"])
                            for f in hogs), f"mps_hog names the hog (job {job}) and the starved job {job + 1}")
        hog.done(0)
        small.done(0)
    # --- heavy GEMM alone: clock events, power --------------------------------------------------------
    case = "gemm"
    job += 2
    hog = Task(job, None, py(HOG, 14))
    hog.wait_line("READY")
    rows = watch(12, [])
    c = RESULTS["cases"].setdefault(case, {"checks": []})
    c["hog"] = result(hog)
    ev = sorted({n for r in rows for n in clock_names(r["gpu"].get("clock_events"))})
    c["clock_events_seen"], c["power_w"] = ev, [r["gpu"].get("power_w") for r in rows]
    c["sm_clock_mhz"], c["sm_active"] = [r["gpu"].get("sm_clock_mhz") for r in rows], [r["gpu"].get("sm_active") for r in rows]
    c["tensor_active"] = [r["gpu"].get("tensor_active") for r in rows]
    say(f"  gemm {c['hog']}: clock events {ev}; power {c['power_w']}; SM MHz {c['sm_clock_mhz']}; "
        f"sm_active {c['sm_active']}; tensor {c['tensor_active']}")
    check(case, max((p or 0) for p in c["power_w"]) > 200, f"power under load seen (max {max((p or 0) for p in c['power_w'])} W)")
    check(case, any(t for t in c["tensor_active"] if t) or c["tensor_active"] == [None] * len(rows),
          "GPM tensor activity seen (or GPM not supported)")
    hw = [f for f in found(rows, "hw_slowdown")]
    c["hw_findings"] = hw
    say(f"  hardware findings under a heavy GEMM: {[f['rule'] for f in hw]}")
    hog.done(0)
    # --- near OOM -----------------------------------------------------------------------------------------
    case = "near_oom"
    job += 2
    oom = Task(job, None, py(OOM, 10))
    ready = oom.wait_line("READY")
    rows = watch(8, [])
    c = RESULTS["cases"].setdefault(case, {"checks": []})
    c["ready"] = ready[1] if ready else oom.text()
    f = found(rows, "near_oom")
    c["finding"] = f[:1]
    check(case, any(x["owner"] and x["owner"]["job"] == job for x in f), f"near_oom raised and attributed to job {job}: {f[:1]}")
    mem = [cl.get("mem_used_bytes") for r in rows for cl in r["clients"] if cl["pid"] == oom.pid]
    c["client_mem_bytes"] = mem[-3:]
    check(case, any(m for m in mem if m and m > 100 << 30), f"the client's own memory seen per process ({mem[-1:] if mem else None})")
    oom.wait(30)
    oom.done(0)
    # --- copies: PCIe ----------------------------------------------------------------------------------------
    case = "copies"
    job += 2
    cp = Task(job, None, py(COPY, 14))
    cp.wait_line("READY")
    rows = watch(12, [])
    c = RESULTS["cases"].setdefault(case, {"checks": []})
    c["copy"] = result(cp)
    tx = [r["gpu"].get("pcie_tx_bytes_per_s") for r in rows]
    rx = [r["gpu"].get("pcie_rx_bytes_per_s") for r in rows]
    c["pcie_tx"], c["pcie_rx"] = tx, rx
    c["pcie_gen"] = [(r["gpu"].get("pcie_gen"), r["gpu"].get("pcie_gen_max")) for r in rows][-1:]
    say(f"  copies {c['copy']}: PCIe tx {tx} rx {rx} gen {c['pcie_gen']}")
    check(case, max((x or 0) for x in tx + rx) > 1e9, "PCIe throughput above 1 GB/s seen while copying")
    (g.OUT / "metrics_copies.txt").write_text(metrics())
    cp.done(0)
    # --- whole run: cost ------------------------------------------------------------------------------------
    s2 = top()
    RESULTS["telemetry_total"] = {"rounds": s2.get("rounds"), "cpu_seconds": s2.get("cpu_seconds")}
    agent.terminate()
    agent.wait(30)
    return g.finish_common("telemetry_proof.json")


def clock_names(bits):
    names = ["gpu_idle", "applications_clocks", "sw_power_cap", "hw_slowdown", "sync_boost", "sw_thermal",
             "hw_thermal", "hw_power_brake", "display_clock"]
    return [n for i, n in enumerate(names) if bits and bits & (1 << i)]


if __name__ == "__main__":
    sys.exit(main())
