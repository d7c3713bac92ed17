#!/usr/bin/env python3
"""GPU proof for mps-resilient: the agent with the real `nvml` backend and a real MPS control daemon
per GPU, real CUDA clients, real faults. For each case the agent's decision must match what really
happened (who died, that the server recovered, class and actions). Also: terminate_client of one
client, an agent crash mid-run, detection latency, and throughput overhead. Runs as root on a GPU
node; uses GPU 0 only; starts and stops only its own MPS daemon.

    MPSR_BIN=<dir with mpsr-agent, mpsrctl> python3 tests/gpu/gpu_proof.py

Writes gpu_proof.log and gpu_proof.json (and the agent/MPS logs) to $OUT (default
tests/gpu/results/latest). Exit status 0 only when every case matched.
"""

import os
import shutil
import signal
import sys
import time

import gpucommon as g
from gpucommon import (Kmsg, Proc, check, ctl, deregister, events, register, say, sh, start_agent, status,
                       wait_server_ready, gpu0)

RESULTS = g.RESULTS


def main():
    g.setup("gpu_proof.log", "/tmp/mpsr-gpu")
    RESULTS["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    smi = sh("nvidia-smi --query-gpu=name,driver_version,compute_mode,pci.bus_id --format=csv,noheader")
    RESULTS["gpu"] = smi.stdout.strip()
    RESULTS["kernel"] = sh("uname -r").stdout.strip()
    say(f"GPU: {RESULTS['gpu']}; kernel {RESULTS['kernel']}")
    say("MPS control help: " + sh("echo help | nvidia-cuda-mps-control 2>&1 | head -40").stdout.replace("\n", " / ")[:2000])
    mps_bin = shutil.which("nvidia-cuda-mps-control") or ""
    strings = sh(f"strings {mps_bin} 2>/dev/null | grep -iE 'server create|start_server|get_server_status|-p <|multiuser|named' | head -20").stdout
    RESULTS["mps_binary_strings"] = strings
    say("MPS control binary mentions: " + strings.replace("\n", " / "))

    nv = sh(f"nvcc -O2 -arch=sm_90 -o {g.W}/mpsr_probe {g.ROOT}/tests/gpu/cuda/mpsr_probe.cu", timeout=300)
    if nv.returncode != 0:
        say("nvcc failed: " + nv.stderr)
        return finish()
    cfg = g.write_agent_config("[keeper]\nenabled = false\n")
    sc = sh([str(g.BIN / "mpsr-agent"), "--config", str(cfg), "--self-check"])
    RESULTS["self_check"] = sc.stdout
    say("self-check:\n" + sc.stdout)
    agent_log = open(g.OUT / "agent.log", "a")
    agent = start_agent(cfg, agent_log)
    if agent is None or agent.poll() is not None:
        say("agent did not start; see agent.log")
        return finish()
    g0 = gpu0()
    say(f"agent up: gpu0 {g0}")
    st = status()
    RESULTS["status_at_start"] = st
    pipe = f"{g.W}/run/gpu0/pipe"
    logd = f"{g.W}/run/gpu0/log"
    kmsg = Kmsg()
    RESULTS["kmsg_readable"] = kmsg.ok

    # --- fault cases ---------------------------------------------------------------------------
    expect = {
        "illegal": ("app_memory", {31}, True),
        "trap": ("app_sm", {43}, True),
        "misaligned": ("app_sm", {13, 43}, True),
        "assert": (None, set(), False),
    }
    for i, (mode, (cls, xids, victim_dies)) in enumerate(expect.items()):
        case = f"fault_{mode}"
        say(f"=== case {case}")
        vj, fj = 100 + i, 200 + i
        known = {e["fault_id"] for e in events()}
        v = Proc("victim", 12, pipe, logd)
        if not v.wait_line("READY", 60):
            check(case, False, f"victim attached ({v.text()})")
            continue
        check(case, register(vj, v.pid), f"victim pid {v.pid} registered as job {vj}")
        t_fault = time.time()
        f = Proc(mode, 1.5, pipe, logd)
        if f.wait_line("ATTACHED", 30):
            check(case, register(fj, f.pid), f"faulter pid {f.pid} registered as job {fj}")
        fcode = f.wait(30)
        vcode = v.wait(20 if victim_dies else 15)
        deregister(vj, v.pid, vcode if vcode is not None else 0)
        deregister(fj, f.pid, fcode if fcode is not None else 0)
        say(f"  faulter exit {fcode}: {f.text()}")
        say(f"  victim exit {vcode}: {v.text()}")
        time.sleep(1.0)
        new = [e for e in events() if e["fault_id"] not in known]
        hits = [e for e in new if e["hit_jobs"]]
        RESULTS["cases"].setdefault(case, {})["events"] = new
        kx = kmsg.xids_since(t_fault)
        RESULTS["cases"][case]["kmsg"] = [m for _, m in kx]
        say(f"  kernel lines: {[m for _, m in kx]}")
        for e in new:
            say(f"  decision: fault {e['fault_id']} xids {e['xids']} class {e['class']} sources {e['sources']} "
                f"kernel-pid {e['reported_pid']} culprit {e['culprit']} hit {e['hit_jobs']} actions {e['actions']} "
                f"outcome {e['outcome']}")
        if victim_dies:
            check(case, vcode not in (0, None), f"victim really died (exit {vcode})")
            check(case, len(hits) == 1, f"one decision with hit jobs (got {len(hits)})")
            if hits:
                e = hits[0]
                check(case, e["class"] == cls, f"class {e['class']} == {cls}")
                check(case, bool(set(e["xids"]) & xids), f"xids {e['xids']} include one of {sorted(xids)}")
                check(case, set(e["hit_jobs"]) == {vj, fj}, f"hit set {e['hit_jobs']} == every job on the GPU {[vj, fj]}")
                check(case, e["culprit"] is None, "culprit recorded as unknown (stock driver)")
                check(case, f"requeue job {vj}" in e["actions"] and f"requeue job {fj}" in e["actions"],
                      f"actions requeue both: {e['actions']}")
        else:
            check(case, vcode == 0, f"victim survived (exit {vcode})")
            check(case, not hits, f"no job hit ({[e['hit_jobs'] for e in hits]})")
        dt, st = wait_server_ready()
        check(case, dt is not None, f"MPS server ACTIVE/idle again ({st}) after {dt if dt is None else round(dt, 3)} s")
        fresh = Proc("victim", 0.5, pipe, logd)
        code = fresh.wait(60)
        check(case, code == 0, f"a new client runs afterwards (exit {code}: {fresh.text()})")

    # --- terminate_client -----------------------------------------------------------------------
    case = "terminate_client"
    say(f"=== case {case}")
    a, b = Proc("victim", 10, pipe, logd), Proc("victim", 10, pipe, logd)
    if a.wait_line("READY", 60) and b.wait_line("READY", 60):
        r = ctl("terminate", "--gpu", 0, "--pid", a.pid)
        check(case, r.returncode == 0, f"terminate_client {a.pid}: {r.stdout.strip()} {r.stderr.strip()}")
        ca = a.wait(15)
        check(case, ca not in (0, None), f"terminated client ended (exit {ca}: {a.text()})")
        cb = b.wait(20)
        check(case, cb == 0, f"the other client ran on unharmed (exit {cb}: {b.text()})")
    else:
        check(case, False, f"clients attached ({a.text()} / {b.text()})")

    # --- agent crash mid-run ---------------------------------------------------------------------
    case = "agent_restart"
    say(f"=== case {case}")
    v = Proc("victim", 20, pipe, logd)
    if v.wait_line("READY", 60):
        register(401, v.pid)
        agent.kill()
        agent.wait()
        time.sleep(0.5)
        check(case, v.p.poll() is None, "client still running while the agent is dead (MPS daemon kept)")
        agent = start_agent(cfg, agent_log)
        tasks = status().get("tasks", [])
        check(case, any(t["job_id"] == 401 for t in tasks), f"registration recovered after the crash: {tasks}")
        known = {e["fault_id"] for e in events()}
        f = Proc("trap", 1.0, pipe, logd)
        if f.wait_line("ATTACHED", 30):
            register(402, f.pid)
        fc, vc = f.wait(30), v.wait(30)
        deregister(401, v.pid, vc or 0)
        deregister(402, f.pid, fc or 0)
        time.sleep(1.0)
        hits = [e for e in events() if e["fault_id"] not in known and e["hit_jobs"]]
        check(case, vc not in (0, None), f"victim killed by the fault after the restart (exit {vc})")
        check(case, len(hits) == 1 and set(hits[0]["hit_jobs"]) == {401, 402},
              f"restarted agent decided with the recovered registry: {[h['hit_jobs'] for h in hits]}")
        wait_server_ready()
    else:
        check(case, False, f"victim attached ({v.text()})")

    # --- detection latency ----------------------------------------------------------------------
    case = "latency"
    say(f"=== case {case} (20 Xid 31 faults)")
    lat = []
    for k in range(20):
        known = {e["fault_id"] for e in events()}
        t0 = time.time()
        f = Proc("illegal", 0, pipe, logd)
        f.wait(30)
        time.sleep(0.6)
        new = [e for e in events() if e["fault_id"] not in known]
        kx = kmsg.xids_since(t0)
        if new and kx:
            e = new[0]
            k_wall = min(w for w, m in kx if " 31," in m or "Xid" in m)
            detect = e["at_ms"] / 1000 - k_wall
            lat.append({"kernel_to_event_ms": detect * 1000, "event_to_decision_ms": e["decide_us"] / 1000,
                        "kernel_to_decision_ms": detect * 1000 + e["decide_us"] / 1000, "sources": e["sources"]})
        elif new:
            lat.append({"kernel_to_event_ms": None, "event_to_decision_ms": new[0]["decide_us"] / 1000,
                        "sources": new[0]["sources"]})
        wait_server_ready()
    RESULTS["latency"] = lat

    def pct(vals, q):
        vals = sorted(v for v in vals if v is not None)
        return round(vals[min(len(vals) - 1, int(q * len(vals)))], 3) if vals else None

    for key in ("kernel_to_event_ms", "event_to_decision_ms", "kernel_to_decision_ms"):
        vals = [l.get(key) for l in lat]
        say(f"  {key}: n={len([v for v in vals if v is not None])} p50={pct(vals, .5)} p99={pct(vals, .99)} max={pct(vals, 1.0)}")
    check(case, len(lat) >= 20, f"{len(lat)} faults decided out of 20")

    # --- overhead ---------------------------------------------------------------------------------
    case = "overhead"
    say(f"=== case {case}")
    rates = {"with_agent": [], "without_agent": []}
    for rnd in range(2):
        for mode in ("with_agent", "without_agent"):
            if mode == "without_agent" and agent and agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
                agent.wait(30)
            if mode == "with_agent" and (agent is None or agent.poll() is not None):
                agent = start_agent(cfg, agent_log)
            p = Proc("load", 8, pipe, logd)
            p.wait(60)
            m = p.wait_line("LOAD_RATE", 1)
            if m:
                rates[mode].append(float(m[1].split()[1]))
            say(f"  round {rnd} {mode}: {p.text()}")
    if agent is None or agent.poll() is not None:
        agent = start_agent(cfg, agent_log)
    RESULTS["throughput"] = rates
    if rates["with_agent"] and rates["without_agent"]:
        ratio = (sum(rates["with_agent"]) / len(rates["with_agent"])) / (sum(rates["without_agent"]) / len(rates["without_agent"]))
        RESULTS["throughput_ratio"] = ratio
        say(f"  throughput with/without agent: {ratio:.4f}")
    # Agent CPU while idle (one GPU, default sampling).
    time.sleep(1)
    def ticks():
        f = open(f"/proc/{agent.pid}/stat").read().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])
    t0, c0 = time.time(), ticks()
    time.sleep(10)
    cpu = (ticks() - c0) / os.sysconf("SC_CLK_TCK") / (time.time() - t0) * 100
    RESULTS["agent_idle_cpu_pct_per_gpu"] = cpu
    rss = [l for l in open(f"/proc/{agent.pid}/status") if l.startswith("VmRSS")]
    RESULTS["agent_rss"] = rss[0].strip() if rss else None
    say(f"  agent idle CPU {cpu:.3f} % of one core (1 GPU), {RESULTS['agent_rss']}")

    agent.send_signal(signal.SIGTERM)
    agent.wait(30)
    return finish()


def finish():
    return g.finish_common("gpu_proof.json")


if __name__ == "__main__":
    sys.exit(main())
