#!/usr/bin/env python3
"""Standby proof on a real GPU (issues 21 and 34): the agent (nvml backend, real MPS, the state
keeper); a resume-mode task under mpsr-run with a hot standby (MPSR_STANDBY=1, as `--mps-standby`
sets it; waiting in mpsr_state_ready() with its CUDA context) or a warm one (MPSR_STANDBY=warm,
`--mps-standby=warm`; waiting in mpsr_state_before_cuda() with none) in the GPU's standby domain;
another job's fault in the shared server. Measured on one wall clock, from the culprit's launch of
its faulting kernel to the hit task's first kernel on its kept state: the hot and the warm
standby's takeover and the restart path (the same task without a standby) in the same run (N
faults per kind: Xid 43, 13+43, 31), with p50/p99; the kernel's Xid record time; a PyTorch model
served in a loop (the longest gap between answers across the fault: hot, warm, restart with kept
weights, restart without); the cost of waiting standbys, hot and warm (throughput of two busy
clients of the shared server with 0, 4 and 16 standbys waiting; GPU memory and host RSS per
standby; the driver's report time of a fault beside them).

    MPSR_BIN=<dir with mpsr-agent, mpsrctl, mpsr-run, mpsr-keeper, libmpsr_state.so> \\
        python3 tests/gpu/standby_proof.py [N_PER_KIND]

STANDBY_PROOF_ONLY=takeover,serving,cost picks the parts (default all); SERVE_RUNS (default 5),
SERVE_SECONDS (30); TAKEOVER_MODES (standby,warm,restart,restart_own: restart may move the task to
the standby domain at once, restart_own waits for its own server), TAKEOVER_KINDS
(xid43,xid13_43,xid31), APP_MIB (the kept state of the C task, 64); SERVE_MODES
(standby,warm,restart,plain; warm_init: a warm standby that ran cuInit before waiting, an
experiment); COST_KINDS (hot,warm). A build before 0.3 (no warm standby) runs with
TAKEOVER_MODES=restart.
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import gpucommon as g
from gpucommon import Output, Task, check, ctl, say, sh, start_agent, wait_server_ready

RESULTS = g.RESULTS


class Supervised(Output):
    """A resume-mode task as slurmstepd starts it: registered first (the shell waits), then it
    execs into mpsr-run, which runs the command (and, with `standby` "hot" or "warm", its
    standby)."""

    WAIT = 60

    def __init__(self, job, argv, standby, env=None, run_args=""):
        e = dict(os.environ)
        e.update(
            SLURM_JOB_ID=str(job), SLURM_STEP_ID="0", MPSR_SOCKET=str(g.SOCK),
            MPSR_KEEPER_SOCKET=str(g.W / "run/gpu0/keeper.sock"),
            CUDA_MPS_PIPE_DIRECTORY=str(g.W / "run/gpu0/pipe"), CUDA_MPS_LOG_DIRECTORY=str(g.W / "run/gpu0/log"),
            CUDA_VISIBLE_DEVICES="0", MPSR_STATE_LIB=str(g.BIN / "libmpsr_state.so"),
            PYTHONPATH=str(g.ROOT / "state-lib/python"), PYTHONUNBUFFERED="1",
        )
        if standby:
            e["MPSR_STANDBY"] = "1" if standby == "hot" else standby
        e.update(env or {})
        cmd = " ".join(map(str, argv))
        self.p = subprocess.Popen(["/bin/sh", "-c", f"read go; exec {g.BIN}/mpsr-run --backoff-ms 0 {run_args} -- {cmd}"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=e)
        self.pid = self.p.pid
        self.job = job
        self.lines = []
        r = ctl("register", "--job", job, "--step", 0, "--pid", self.pid, "--gpus", 0, "--mode", "resume")
        self.registered = r.returncode == 0
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        threading.Thread(target=self._read, daemon=True).start()

    def lines_with(self, word):
        return [(t, l) for t, l in self.lines if word in l]

    def stop(self):
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if self.wait(20) is None:
            self.p.kill()
            self.wait(5)
        ctl("job-end", self.job)


def field(line, key):
    for w in line.split():
        if w.startswith(key + "="):
            return w.split("=", 1)[1]
    return None


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (k - lo), 1)


def summary(xs):
    return {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99), "min": pct(xs, 0), "max": pct(xs, 100)}


def server_fatal_line_after(t):
    """Wall time of the shared server's first fatal-error line at or after `t` (its log stamps
    are local wall-clock times with milliseconds), or None."""
    import datetime
    try:
        text = (g.W / "run/gpu0/log/server.log").read_text(errors="replace")
    except OSError:
        return None
    for l in text.splitlines():
        if "fatal GPU error" not in l or not l.startswith("["):
            continue
        try:
            stamp = datetime.datetime.strptime(l[1:24], "%Y-%m-%d %H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        if stamp >= t - 0.002:
            return stamp
    return None


def outcomes_for(job):
    """The kinds of typed outcome the agent recorded for `job` (e.g. "restarted_elsewhere":
    restarted at once in another domain; "standby_took_over": a hot or warm standby released)."""
    return {o.get("kind") for e in g.events() for o in e.get("outcomes", []) if o.get("job") == job}


def one_fault(kmsg, job, kind, standby, app, run_args=""):
    """One resume task (with a "hot" or "warm" standby, or none), a culprit job in the same shared
    server that faults; returns the measurements or None."""
    t = Supervised(job, app, standby, run_args=run_args)
    if not t.registered:
        say(f"  register failed for job {job}")
        t.stop()
        return None
    want = 2 if standby else 1
    end = time.time() + 60
    while len(t.lines_with("READY role=")) < want and time.time() < end and t.p.poll() is None:
        time.sleep(0.01)
    if len(t.lines_with("READY role=")) < want:
        say(f"  job {job}: not ready: {t.text()[-600:]}")
        t.stop()
        return None
    time.sleep(0.2)
    culprit = Task(job + 5000, None, [g.W / "standby_app", "fault", kind, "0.3"])
    faulting = culprit.wait_line("FAULTING", 30)
    how = "takeover" if standby else "restart"
    end = time.time() + 60
    first = None
    while time.time() < end:
        first = next((l for _, l in t.lines_with("FIRST_KERNEL") if f"how={how}" in l), None)
        if first or t.p.poll() is not None:
            break
        time.sleep(0.005)
    culprit.wait(10)
    culprit.done(1)
    res = None
    if faulting and first:
        t_fault = float(field(faulting[1], "wall"))
        xid = [r for r in kmsg.records if r[0] >= t_fault - 0.01 and "Xid" in r[1]]
        line = server_fatal_line_after(t_fault)
        done = outcomes_for(job)
        res = {
            "server_line_ms": round((line - t_fault) * 1000, 1) if line else None,
            "fault_to_first_kernel_ms": round((float(field(first, "done")) - t_fault) * 1000, 1),
            "fault_to_release_ms": round((float(field(first, "released")) - t_fault) * 1000, 1),
            "xid_record_ms": round((xid[0][0] - t_fault) * 1000, 1) if xid else None,
            "bad_words": int(field(first, "bad")), "redo": int(field(first, "redo")),
            # What the agent did, from its typed outcomes on the fault: a standby released, or
            # a restart at once in the standby domain.
            "took_over": "standby_took_over" in done,
            "moved": "restarted_elsewhere" in done,
        }
        # Where the time went, from the fault: the incarnation's process start (a restart's; a
        # standby's was long before), its CUDA context, its kept state attached.
        for k in ("began", "ctx", "attached"):
            v = field(first, k)
            res[f"{k}_ms"] = round((float(v) - t_fault) * 1000, 1) if v else None
    else:
        say(f"  job {job}: no measurement: culprit {culprit.text()[-300:]} | task {t.text()[-800:]}")
    t.stop()
    wait_server_ready(20)
    return res


def takeover_cases(kmsg, n):
    kinds = {"xid43": "trap", "xid13_43": "misaligned", "xid31": "illegal"}
    picked = os.environ.get("TAKEOVER_KINDS", ",".join(kinds)).split(",")
    kinds = {k: v for k, v in kinds.items() if k in picked}
    modes = os.environ.get("TAKEOVER_MODES", "standby,warm,restart,restart_own").split(",")
    app = [g.W / "standby_app", "serve", int(os.environ.get("APP_MIB", "64")), 20]
    out = {}
    job = 3000
    sb = {"standby": "hot", "warm": "warm", "restart": None, "restart_own": None}
    # restart: the agent may restart the task at once in the GPU's standby domain (its server
    # runs: the earlier modes started it); restart_own: only in its own domain once ACTIVE.
    run_args = {"restart_own": "--same-domain"}
    for name, kind in kinds.items():
        for mode in modes:
            if mode.startswith("restart") and name != "xid43" and n > 5:
                runs = max(5, n // 4)  # the restart path is the baseline: fewer runs of the slower kinds
            else:
                runs = n
            rows = []
            say(f"=== {name} {mode}: {runs} faults")
            for i in range(runs):
                job += 1
                r = one_fault(kmsg, job, kind, sb[mode], app, run_args.get(mode, ""))
                if r:
                    rows.append(r)
            out[f"{name}_{mode}"] = {
                "rows": rows,
                "fault_to_first_kernel_ms": summary([r["fault_to_first_kernel_ms"] for r in rows]),
                "xid_record_ms": summary([r["xid_record_ms"] for r in rows if r["xid_record_ms"] is not None]),
                "server_line_ms": summary([r["server_line_ms"] for r in rows if r["server_line_ms"] is not None]),
            }
            for k in ("fault_to_release", "began", "ctx", "attached"):
                xs = [r[f"{k}_ms"] for r in rows if r.get(f"{k}_ms") is not None]
                if xs:
                    out[f"{name}_{mode}"][f"{k}_ms"] = summary(xs)
            s = out[f"{name}_{mode}"]
            say(f"  {name} {mode}: fault -> first kernel on kept state {s['fault_to_first_kernel_ms']}; "
                f"Xid record {s['xid_record_ms']}; server's fatal line {s['server_line_ms']}")
            if mode == "restart":
                s["moved"] = sum(r["moved"] for r in rows)
            p50 = lambda k: (s.get(f"{k}_ms") or {}).get("p50")
            say(f"  {name} {mode} p50 from the fault: release {p50('fault_to_release')}, process start "
                f"{p50('began')}, context {p50('ctx')}, attached {p50('attached')}, first kernel "
                f"{s['fault_to_first_kernel_ms']['p50']} ms; moved to the standby domain: {s.get('moved', '-')}")
            check(f"{name}_{mode}", len(rows) >= max(1, runs * 3 // 4), f"{len(rows)}/{runs} faults measured")
            check(f"{name}_{mode}", all(r["bad_words"] == 0 for r in rows), "the kept state was consistent every time")
            if not mode.startswith("restart"):
                check(f"{name}_{mode}", all(r["took_over"] for r in rows), "no restart: the standby took over")
            if mode == "restart_own":
                check(f"{name}_{mode}", not any(r["moved"] for r in rows), "restarted in its own domain")
    return out


def serving_case(kmsg, runs):
    """The longest gap between answers of a PyTorch model across a neighbour's Xid 43."""
    out = {}
    job = 6000
    secs = int(os.environ.get("SERVE_SECONDS", "30"))
    for mode in os.environ.get("SERVE_MODES", "standby,warm,restart,plain").split(","):
        gaps, nexts, phases, waiting_mib = [], [], [], []
        for i in range(runs):
            job += 1
            args = [sys.executable, g.ROOT / "tests/gpu/serve_standby.py", secs] + (["plain"] if mode == "plain" else [])
            # warm_init: a warm standby that initialized the driver (cuInit) before waiting.
            env = {"SERVE_WARM_INIT": "1"} if mode == "warm_init" else None
            t = Supervised(job, args, {"standby": "hot", "warm": "warm", "warm_init": "warm"}.get(mode), env=env)
            # The primary serves; a standby has printed READY and waits.
            want = 2 if mode in ("standby", "warm", "warm_init") else 1
            end = time.time() + 120
            while (len(t.lines_with("READY role=")) < want or not t.lines_with("SERVING")) \
                    and time.time() < end and t.p.poll() is None:
                time.sleep(0.02)
            if len(t.lines_with("READY role=")) < want or not t.lines_with("SERVING"):
                say(f"  serve {mode}: not serving: {t.text()[-600:]}")
                t.stop()
                continue
            time.sleep(1.0)
            # What a waiting warm standby holds on the GPU (nvidia-smi lists it only with memory).
            w = [field(l, "pid") for _, l in t.lines_with("READY role=warm")]
            if w and w[0]:
                mem = sh("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits").stdout
                waiting_mib.append(sum(int(m.split(",")[1]) for m in mem.splitlines()
                                       if m.split(",")[0].strip() == w[0]))
            culprit = Task(job + 5000, None, [g.W / "standby_app", "fault", "trap", "0.3"])
            faulting = culprit.wait_line("FAULTING", 30)
            # Answers again after the fault for a second.
            end = time.time() + 90
            while time.time() < end:
                later = [x for x, l in t.lines if l.startswith("ANSWER") and faulting and x > float(field(faulting[1], "wall")) + 1.0]
                if later or t.p.poll() is not None:
                    break
                time.sleep(0.02)
            culprit.wait(10)
            culprit.done(1)
            # Two incarnations and mpsr-run share one pipe: a line may hold two writes.
            answers = [float(m) for _, l in t.lines for m in re.findall(r"ANSWER (\d+\.\d+)", l)]
            if faulting and answers:
                tf = float(field(faulting[1], "wall"))
                # From the last answer before the fault to one second of answers after it.
                window = [a for a in answers if a > tf - 0.5]
                window = [a for a in window if a <= max(window) and a < tf + 30]
                before = [a for a in answers if a <= tf]
                if before and len(window) > 1 and window[-1] > tf + 1.0:
                    diffs = [b - a for a, b in zip(window, window[1:])]
                    gap = round(max(diffs) * 1000, 1)
                    gaps.append(gap)
                    after = [a for a in answers if a > tf]
                    nexts.append(round((after[0] - tf) * 1000, 1))
                    # A warm start's split, from the fault: released, context + attach, torch's
                    # view, the input, the reference pass, the first answer.
                    rel = [float(field(l, "wall")) for _, l in t.lines_with("RELEASED") if float(field(l, "wall")) > tf]
                    ph = [l for _, l in t.lines_with("PHASES") if float(field(l, "attach_s")) > tf]
                    if rel and ph:
                        ms = lambda x: round((x - tf) * 1000, 1)
                        phases.append({"released": ms(rel[0]), "attached": ms(float(field(ph[0], "attach_s"))),
                                       "torch": ms(float(field(ph[0], "torch_s"))), "input": ms(float(field(ph[0], "input_s"))),
                                       "reference": ms(float(field(ph[0], "ref_s"))), "answer": ms(after[0])})
                        say(f"  serve {mode} #{i}: from the fault (ms): {phases[-1]}")
                    took = "standby_took_over" in outcomes_for(job)
                    restarted = any(int(field(l, "restarts") or 0) > 0 for _, l in t.lines_with("SERVING "))
                    say(f"  serve {mode} #{i}: longest gap between answers across the fault {gap} ms, "
                        f"fault -> next answer {nexts[-1]} ms "
                        f"(took over: {took}, restarted: {restarted})")
            t.stop()
            wait_server_ready(20)
        out[mode] = {"gaps_ms": gaps, **summary(gaps), "fault_to_next_answer_ms": summary(nexts)}
        if phases:
            out[mode]["phases_ms"] = {k: summary([p[k] for p in phases]) for k in phases[0]}
        if waiting_mib:
            out[mode]["waiting_gpu_mib"] = waiting_mib
            say(f"  serve {mode}: a waiting warm standby's GPU memory (MiB): {waiting_mib}")
        check(f"serve_{mode}", len(gaps) >= max(1, runs - 1), f"{len(gaps)}/{runs} serving gaps measured")
    return out


def standby_domain_pipe():
    for d in g.gpu0().get("domains", []):
        if d.get("tenancy") == "standby":
            slot = d["domain"]["slot"]
            return g.W / f"run/gpu0/d{slot}/pipe", g.W / f"run/gpu0/d{slot}/log"
    return None, None


def rss_kib(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def report_times(kmsg, job, reps):
    """The driver's report of a culprit's Xid 43 in the shared server (its server.log fatal line,
    the kernel's Xid record), `reps` times."""
    lines, xids = [], []
    for i in range(reps):
        culprit = Task(job + i, None, [g.W / "standby_app", "fault", "trap", "0.2"])
        faulting = culprit.wait_line("FAULTING", 30)
        culprit.wait(10)
        culprit.done(1)
        wait_server_ready(20)
        if not faulting:
            continue
        tf = float(field(faulting[1], "wall"))
        time.sleep(0.3)
        line = server_fatal_line_after(tf)
        if line:
            lines.append(round((line - tf) * 1000, 1))
        x = [r for r in kmsg.records if r[0] >= tf - 0.01 and "Xid" in r[1]]
        if x:
            xids.append(round((x[0][0] - tf) * 1000, 1))
    return {"server_line_ms": summary(lines), "xid_record_ms": summary(xids)}


def cost_case(kmsg):
    """Two busy clients of the shared server with 0, 4, 16 standbys waiting for the standby
    domain: hot ones (in mpsr_state_ready, their CUDA context made) and warm ones (in
    mpsr_state_before_cuda, none), each on a FIFO nobody writes; with each, the driver's report
    time of a fault in the shared server."""
    pipe, logd = standby_domain_pipe()
    check("cost", pipe is not None, "the standby domain exists")
    if pipe is None:
        return {}
    out = {}
    sp, sl = str(g.W / "run/gpu0/pipe"), str(g.W / "run/gpu0/log")
    job = 8000
    for kind in os.environ.get("COST_KINDS", "hot,warm").split(","):
        # warm_init: warm ones that ran cuInit before waiting (an experiment: GPU memory, report).
        role = {"hot": "standby", "warm": "warm", "warm_init": "warm"}[kind]
        for n in (0, 4, 16):
            if n == 0 and kind != "hot" and "hot_standbys_0" in out:
                out[f"{kind}_standbys_0"] = out["hot_standbys_0"]
                continue
            standbys = []
            for i in range(n):
                fifo = g.W / f"cost-fifo-{kind}-{n}-{i}"
                if fifo.exists():
                    fifo.unlink()
                os.mkfifo(fifo)
                e = {"MPSR_ROLE": role, "MPSR_STANDBY_FIFO": str(fifo)}
                if kind == "warm_init":
                    e["STANDBY_WARM_INIT"] = "1"
                standbys.append(g.Proc("standby", 0, str(pipe), str(logd),
                                       argv=[str(g.W / "standby_app"), "serve", "64", "60", "idle"], env=e))
            for p in standbys:
                p.wait_line("READY", 60)
            time.sleep(0.5)
            mem = sh("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits").stdout
            per = {int(a): int(b) for a, b in (l.split(",") for l in mem.strip().splitlines() if "," in l)}
            sb_mem = [per.get(p.pid, 0) for p in standbys]
            sb_rss = [rss_kib(p.pid) for p in standbys if rss_kib(p.pid)]
            start = time.time() + 2.0
            busy = [g.Proc("rate", 0, sp, sl, argv=[str(g.W / "mpsr_probe"), "rate", "5", "66", f"{start:.3f}"])
                    for _ in range(2)]
            rates = []
            for b in busy:
                line = b.wait_line("RATE", 60)
                if line:
                    rates.append(float(line[1].split()[1]))
            for b in busy:
                b.wait(10)
            job += 10
            report = report_times(kmsg, job, 3)
            for p in standbys:
                p.p.kill()
                p.wait(10)
            key = f"{kind}_standbys_{n}"
            out[key] = {
                "busy_kernels_per_s": rates, "sum": round(sum(rates), 1),
                "gpu_mib_per_standby": round(statistics.mean(sb_mem), 1) if sb_mem else None,
                "host_rss_mib_per_standby": round(statistics.mean(sb_rss) / 1024, 1) if sb_rss else None,
                "report": report,
            }
            say(f"  {n} {kind} standbys: busy clients {rates} kernels/s; per standby "
                f"{out[key]['gpu_mib_per_standby']} MiB GPU, {out[key]['host_rss_mib_per_standby']} MiB RSS; "
                f"fault report: server line {report['server_line_ms']}, Xid record {report['xid_record_ms']}")
            if kind == "warm" and n:
                check(f"cost_{key}", out[key]["gpu_mib_per_standby"] == 0, "a warm standby holds no GPU memory")
    for kind in ("hot", "warm", "warm_init"):
        base = out.get(f"{kind}_standbys_0", {}).get("sum")
        for n in (4, 16):
            k = f"{kind}_standbys_{n}"
            if base and out.get(k, {}).get("sum"):
                out[k]["ratio_to_none"] = round(out[k]["sum"] / base, 3)
    return out


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    serve_runs = int(os.environ.get("SERVE_RUNS", "5"))
    W = g.setup("standby_proof.log", "/tmp/mpsr-gpu3")
    say(f"GPU: {sh('nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader').stdout.strip()}")
    inc = g.ROOT / "state-lib/include"
    nv = sh(f"nvcc -O2 -arch=sm_90 -I{inc} -o {W}/standby_app {g.ROOT}/tests/gpu/cuda/standby_app.cu "
            f"-L{g.BIN} -lmpsr_state -ldl -Xlinker -rpath={g.BIN}", timeout=300)
    nv2 = sh(f"nvcc -O2 -arch=sm_90 -o {W}/mpsr_probe {g.ROOT}/tests/gpu/cuda/mpsr_probe.cu", timeout=300)
    if nv.returncode or nv2.returncode:
        say("nvcc failed: " + nv.stderr + nv2.stderr)
        return g.finish_common("standby_proof.json")
    cfg = g.write_agent_config(f'[keeper]\nmax_bytes_per_job = "9G"\nsnapshot_dir = "{W}/snapshots"\n'
                               '[standby]\nmax_per_gpu = 32\n')
    # The standby domain must outlive the takeover cases for the cost case.
    cfg.write_text(cfg.read_text().replace("[mps]\n", "[mps]\ndomain_linger_s = 3600\n"))
    log = open(g.OUT / "agent.log", "a")
    agent = start_agent(cfg, log)
    end = time.time() + 30
    while g.keeper_pid(W / "run/gpu0/keeper.sock") is None and time.time() < end:
        time.sleep(0.2)
    check("setup", agent is not None and g.keeper_pid(W / "run/gpu0/keeper.sock") is not None,
          "agent and state keeper up")
    kmsg = g.Kmsg()
    only = os.environ.get("STANDBY_PROOF_ONLY", "takeover,serving,cost").split(",")
    try:
        if "takeover" in only:
            RESULTS["takeover"] = takeover_cases(kmsg, n)
        if "serving" in only and serve_runs:
            say("=== PyTorch serving across a neighbour's Xid 43")
            RESULTS["serving"] = serving_case(kmsg, serve_runs)
        if "cost" in only:
            say("=== cost of waiting standbys")
            if standby_domain_pipe()[0] is None:
                # Made by the first standby prepared: one short takeover case makes it.
                one_fault(kmsg, 2999, "trap", "hot", [g.W / "standby_app", "serve", 64, 5])
            RESULTS["cost"] = cost_case(kmsg)
    finally:
        if agent:
            agent.terminate()
            agent.wait(20)
        rc = g.finish_common("standby_proof.json")
    print(json.dumps({k: v for k, v in RESULTS.items() if k != "cases"}, indent=1, default=str)[:20000])
    return rc


if __name__ == "__main__":
    sys.exit(main())
