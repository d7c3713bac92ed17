#!/usr/bin/env python3
"""GPU proof of fault domains: the agent (real nvml backend) runs one MPS control daemon per fault
domain on GPU 0. Two jobs, each in a domain of its own (isolation "job"), registered as slurmstepd
does (register first, then the task becomes the MPS client of its domain's server). For faults Xid
31, 43 and 13+43 in one job's domain: the other job's process survives and its server stays ACTIVE;
the faulting job's second client dies with it; the agent's hit set is exactly the culprit's domain
and names the culprit job. Also: two clients in one server vs two servers vs no MPS (small and large
kernels), a new domain's start-up (register + first client), GPU memory per domain, a domain whose
pipe directory belongs to an unprivileged user, and an agent SIGKILL with three domains.

    MPSR_BIN=<dir with mpsr-agent, mpsrctl> python3 tests/gpu/domain_proof.py

Writes domain_proof.log / domain_proof.json (+ MPS logs) to $OUT; exit 0 only if every check passed.
Starts and stops only the MPS daemons of its own run dir.
"""

import json
import os
import subprocess
import sys
import threading
import time

import gpucommon as g
from gpucommon import BATCH, Kmsg, Task, check, ctl, ctl_json, events, say, sh, start_agent, status

RESULTS = g.RESULTS


def domains():
    gpus = status().get("gpus", [])
    return {(d["domain"]["gpu"], d["domain"]["slot"]): d for d in (gpus[0]["domains"] if gpus else [])}


def dom_key(d):
    return (d["gpu"], d["slot"])


def main():
    g.setup("domain_proof.log", "/tmp/mpsr-gpu-dom")
    RESULTS["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    RESULTS["gpu"] = sh("nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader").stdout.strip()
    say(f"GPU: {RESULTS['gpu']}")
    probe = g.W / "mpsr_probe"
    nv = sh(f"nvcc -O2 -arch=sm_90 -o {probe} {g.ROOT}/tests/gpu/cuda/mpsr_probe.cu", timeout=300)
    if nv.returncode != 0:
        say("nvcc failed: " + nv.stderr)
        return g.finish_common("domain_proof.json")
    os.chmod(g.W, 0o755)
    # The linger is short so that each fault case's domains are gone before the next case.
    cfg = g.write_agent_config("[keeper]\nenabled = false\n")
    text = cfg.read_text().replace("[mps]\n", "[mps]\nmax_domains_per_gpu = 8\ndomain_linger_s = 2\nquarantine = \"off\"\n")
    cfg.write_text(text)
    agent_log = open(g.OUT / "agent.log", "a")
    agent = start_agent(cfg, agent_log)
    if agent is None or agent.poll() is not None:
        say("agent did not start; see agent.log")
        return g.finish_common("domain_proof.json")
    kmsg = Kmsg()
    say(f"agent up; domains {list(domains())}")
    shared_pipe, shared_log = f"{g.W}/run/gpu0/pipe", f"{g.W}/run/gpu0/log"

    only = os.environ.get("DOMAIN_PROOF_ONLY", "")
    job = 300
    if only == "idle":
        idle_client(probe, job)
        agent.terminate()
        agent.wait(30)
        return g.finish_common("domain_proof.json")
    # --- faults in one of two domains ---------------------------------------------------------------
    for mode, xids, cls in ([] if only else  (("illegal", {31}, "app_memory"), ("trap", {43}, "app_sm"),
                            ("misaligned", {13, 43}, "app_sm"))):
        case = f"domain_fault_{mode}"
        say(f"=== case {case}")
        jx, jy = job, job + 1
        job += 2
        known = {e["fault_id"] for e in events()}
        y = Task(jy, "job", [probe, "victim", 14])
        x2 = Task(jx, "job", [probe, "victim", 14])
        if not (y.ctx and x2.ctx and y.wait_line("READY") and x2.wait_line("READY")):
            check(case, False, f"clients attached (y: {y.text()} x2: {x2.text()})")
            continue
        x = Task(jx, "job", [probe, mode, 1.0])
        check(case, x.ctx is not None and x.domain == x2.domain, f"both tasks of job {jx} in one domain {x2.domain}")
        check(case, x2.domain != y.domain, f"job {jx} in {x2.domain}, job {jy} in {y.domain}")
        # Watch the survivor's server while the fault happens.
        seen, stop = [], []

        def watch():
            while not stop:
                d = domains().get(dom_key(y.domain))
                seen.append(d["state"] if d else "missing")
                time.sleep(0.05)
        w = threading.Thread(target=watch, daemon=True)
        w.start()
        xc = x.wait(30)
        x2c = x2.wait(20)
        time.sleep(1.0)
        stop.append(1)
        w.join()
        yc = y.wait(30)
        for t, c in ((x, xc), (x2, x2c), (y, yc)):
            t.done(c)
        say(f"  faulter exit {xc}: {x.text()}")
        say(f"  faulter's co-client exit {x2c}: {x2.text()}")
        say(f"  other domain's client exit {yc}: {y.text()}")
        check(case, yc == 0 and "VICTIM_OK" in y.text(), f"the other job's process ran to completion (exit {yc})")
        check(case, x2c not in (0, None), f"the culprit job's other client died with its server (exit {x2c})")
        check(case, seen and all(s == "active" for s in seen),
              f"the other domain's server stayed ACTIVE ({len(seen)} samples: {sorted(set(seen))})")
        time.sleep(0.5)
        new = [e for e in events() if e["fault_id"] not in known]
        RESULTS["cases"].setdefault(case, {"checks": []})["events"] = new
        RESULTS["cases"][case]["kmsg"] = [m for _, m in kmsg.xids_since(x.t_spawn)]
        for e in new:
            say(f"  decision: fault {e['fault_id']} xids {e['xids']} class {e['class']} sources {e['sources']} "
                f"hit_domains {e.get('hit_domains')} hit {e['hit_jobs']} culprit_job {e.get('culprit_job')} "
                f"({e.get('culprit_evidence')}) spared {e['spared_jobs']} actions {e['actions']} outcome {e['outcome']}")
        hits = [e for e in new if e["hit_jobs"]]
        check(case, len(hits) == 1, f"one decision with hit jobs (got {len(hits)})")
        if hits:
            e = hits[0]
            check(case, e["class"] == cls and bool(set(e["xids"]) & xids), f"class {e['class']} xids {e['xids']}")
            check(case, e["hit_jobs"] == [jx], f"hit set {e['hit_jobs']} == [{jx}]")
            check(case, [dom_key(d) for d in e["hit_domains"]] == [dom_key(x.domain)],
                  f"hit domains {e['hit_domains']} == the culprit's {x.domain}")
            check(case, e.get("culprit_job") == jx and e.get("culprit_evidence") == "sole_tenant",
                  f"culprit job {e.get('culprit_job')} ({e.get('culprit_evidence')})")
            check(case, jy in e["spared_jobs"], f"job {jy} spared")
        scl = (g.W / "scontrol.log").read_text() if (g.W / "scontrol.log").exists() else ""
        check(case, f"requeue {jx}" in scl and f"requeue {jy}" not in scl, f"requeued {jx} only")
        # The culprit's domain recovers (no client left) and is stopped after the linger.
        end = time.time() + 20
        while time.time() < end and dom_key(x.domain) in domains():
            time.sleep(0.2)
        check(case, dom_key(x.domain) not in domains(), "empty domains stopped after the linger time")

    if only != "throughput":
        startup_memory_restart(probe, shared_pipe, shared_log, cfg, agent_log, agent, job)
        job += 100
    agent = agent if only == "throughput" else g.AGENT
    throughput(probe, shared_pipe, shared_log, job)
    agent.terminate()
    agent.wait(30)
    return g.finish_common("domain_proof.json")


def idle_client(probe, job):
    # --- a hit client that is not calling CUDA holds its server in FAULT ----------------------------
    case = "idle_client"
    say(f"=== case {case}")
    known = {e["fault_id"] for e in events()}
    idle = Task(job, "job", [probe, "idle", 30])
    if not (idle.ctx and idle.wait_line("READY")):
        check(case, False, f"idle client up ({idle.text()})")
        return
    t0 = time.time()
    f = Task(job, "job", [probe, "illegal", 0.5])
    f.wait(30)
    code = idle.wait(40)
    t_dead = time.time()
    idle.done(code)
    f.done(1)
    say(f"  idle client exit {code} after {t_dead - t0:.2f} s: {idle.text()}")
    back = None
    end = time.time() + 30
    while time.time() < end:
        new = [e for e in events() if e["fault_id"] not in known and e["hit_jobs"]]
        lines = [o for e in new for o in e["outcome"]]
        act = [o for o in lines if "ACTIVE again" in o]
        if act:
            back = act[0]
            break
        time.sleep(0.2)
    new = [e for e in events() if e["fault_id"] not in known]
    RESULTS["cases"].setdefault(case, {"checks": []})["events"] = new
    for e in new:
        say(f"  decision: fault {e['fault_id']} hit {e['hit_jobs']} outcome {e['outcome']}")
    outcome = [o for e in new for o in e["outcome"]]
    check(case, code == -9, f"the idle hit client was ended with SIGKILL (exit {code})")
    check(case, any("ended with SIGKILL" in o for o in outcome), "the event says so")
    check(case, back is not None, f"its server ACTIVE again: {back}")


def startup_memory_restart(probe, shared_pipe, shared_log, cfg, agent_log, agent, job):
    # --- new domain start-up, and first client in a warm server ---------------------------------------
    case = "startup"
    say(f"=== case {case}")
    warm = subprocess.Popen([str(probe), "victim", "60"], env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": shared_pipe,
                            "CUDA_MPS_LOG_DIRECTORY": shared_log, "CUDA_VISIBLE_DEVICES": "0"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(3)
    rows = []
    for k in range(3):
        for iso in ("job", "shared"):
            t = Task(job, iso, [probe, "victim", 0.2])
            job += 1
            a = t.wait_line("ATTACHED", 60)
            t.wait(30)
            t.done(0)
            rows.append({"isolation": iso, "register_ms": t.register_s * 1000,
                         "first_client_attach_ms": (a[0] - t.t_go) * 1000 if a else None})
            say(f"  {iso}: register {t.register_s * 1000:.1f} ms, first client attached "
                f"{(a[0] - t.t_go) * 1000 if a else float('nan'):.1f} ms after it got its context")
    warm.kill()
    warm.wait()
    RESULTS["startup"] = rows
    check(case, all(r["first_client_attach_ms"] is not None for r in rows), "every client attached")

    # --- memory per domain, unprivileged owner, agent crash with three domains ------------------------
    case = "memory_owner_restart"
    say(f"=== case {case}")
    time.sleep(5)  # the start-up case's domains linger 2 s, then stop
    a = Task(job, "job", [probe, "victim", 40])
    b = Task(job + 1, "job", [probe, "victim", 40], uid=65534)
    c = subprocess.Popen([str(probe), "victim", "40"], env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": shared_pipe,
                         "CUDA_MPS_LOG_DIRECTORY": shared_log, "CUDA_VISIBLE_DEVICES": "0"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job += 2
    ok = a.ctx and b.ctx and a.wait_line("READY") and b.wait_line("READY")
    check(case, bool(ok), f"job-domain clients up (root: {a.text()}; nobody: {b.text()})")
    if ok:
        st = os.stat(b.ctx["pipe_dir"])
        check(case, st.st_uid == 65534 and (st.st_mode & 0o777) == 0o700,
              f"nobody's pipe dir owned by uid {st.st_uid} mode {oct(st.st_mode & 0o777)}")
        time.sleep(2)
        smi = sh("nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader").stdout
        RESULTS["compute_apps"] = smi
        say("  nvidia-smi compute apps:\n" + smi)
        servers = [l for l in smi.splitlines() if "mps-server" in l]
        RESULTS["servers_mib"] = servers
        check(case, len(servers) >= 3, f"{len(servers)} MPS servers (shared + two job domains)")
        doms = domains()
        RESULTS["domain_status"] = list(doms.values())
        for k, d in doms.items():
            say(f"  domain {k} {d['tenancy']} {d['state']} clients {d['clients']} memory {d['memory_bytes']}")
        before = {k: (d["state"], sorted(d["clients"])) for k, d in doms.items()}
        agent.kill()
        agent.wait()
        time.sleep(0.5)
        agent = start_agent(cfg, agent_log)
        after = {k: (d["state"], sorted(d["clients"])) for k, d in domains().items()}
        check(case, after == before and len(after) == 3, f"after an agent SIGKILL + restart: {after} == {before}")
        check(case, a.p.poll() is None and b.p.poll() is None and c.poll() is None, "every client still running")
    for t in (a, b):
        t.p.kill()
        t.wait()
        t.done(0)
    c.kill()
    c.wait()
    g.AGENT = agent


def throughput(probe, shared_pipe, shared_log, job):
    # --- throughput: one server vs two servers vs no MPS ----------------------------------------------
    case = "throughput"
    say(f"=== case {case}")
    time.sleep(4)
    table = {}
    nomps = g.W / "no-mps"
    nomps.mkdir(exist_ok=True)
    # A sync after every kernel (latency-bound work) and after bursts of 100 (throughput-bound).
    for blocks, burst in ((66, 1), (264, 1), (66, 100), (264, 100)):
        for setup in ("alone", "one_server", "two_servers", "no_mps"):
            start = time.time() + 8
            argv = [probe, "rate", 5, blocks, f"{start:.3f}", burst]
            procs = []
            n = 1 if setup == "alone" else 2
            for i in range(n):
                if setup == "two_servers":
                    procs.append(Task(job, "job", argv))
                    job += 1
                else:
                    pipe = str(nomps) if setup == "no_mps" else shared_pipe
                    p = subprocess.Popen([str(x) for x in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe,
                                              "CUDA_MPS_LOG_DIRECTORY": str(nomps) if setup == "no_mps" else shared_log,
                                              "CUDA_VISIBLE_DEVICES": "0"})
                    procs.append(p)
            rates = []
            for p in procs:
                if isinstance(p, Task):
                    p.wait(60)
                    m = p.wait_line("RATE", 1)
                    rates.append(float(m[1].split()[1]) if m else None)
                    p.done(0)
                else:
                    out, _ = p.communicate(timeout=60)
                    m = [l for l in out.splitlines() if l.startswith("RATE")]
                    rates.append(float(m[0].split()[1]) if m else None)
                    if not m:
                        say(f"  {setup}: {out.strip()}")
            table[f"{blocks}_blocks_sync_every_{burst}_{setup}"] = rates
            total = sum(r for r in rates if r) if all(rates) else None
            say(f"  {blocks} blocks, sync every {burst}, {setup}: per client {rates} total {total}")
    RESULTS["throughput"] = table
    check(case, all(all(v) for v in table.values()), "every throughput run reported a rate")


if __name__ == "__main__":
    sys.exit(main())
