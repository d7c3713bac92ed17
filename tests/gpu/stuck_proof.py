#!/usr/bin/env python3
"""Issue 31 on a real GPU: a domain never stays broken, and no user can make the root MPS control
daemon write where they choose.

Cases (the agent with the real nvml backend and real MPS control daemons on GPU 0):
- symlink_log_dir: a previous tenant's `control.log` symlink (to a root-owned file) left in a job
  domain's log directory and in the shared one: every daemon starts in fresh directories, the file
  is untouched; the log directory is root's (0755), the real server (run as `nobody`) writes
  `server.log` there all the same, and `nobody` cannot put a name there.
- stuck_client_of_no_job: a client of no job, SIGSTOPped so it can neither exit nor take a
  `terminate_client`, holds the shared server in FAULT after a neighbour's Xid 43: the escalation
  ladder ends the server and the domain serves again (a new client computes) within the bound.
- hung_control_daemon: the shared control daemon is SIGSTOPped right after an Xid 43: the ladder
  ends and restarts it; the domain serves again.
Times are from the culprit's start to each outcome the agent records. Writes stuck_proof.log/.json.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpucommon as g  # noqa: E402
from gpucommon import RESULTS, Task, check, events, say, sh, start_agent  # noqa: E402

STUCK_MS, STEP_MS = 6000, 4000


def outcomes_of(fault_id):
    for e in events():
        if e["fault_id"] == fault_id:
            return e.get("outcomes", [])
    return []


def new_fault(known, timeout=10):
    end = time.time() + timeout
    while time.time() < end:
        for e in events():
            if e["fault_id"] not in known:
                return e["fault_id"]
        time.sleep(0.05)
    return None


def wait_outcome(fault_id, kind, timeout):
    end = time.time() + timeout
    while time.time() < end:
        for o in outcomes_of(fault_id):
            if o.get("kind") == kind:
                return o
        time.sleep(0.1)
    return None


def new_client_computes(probe, shared_pipe, shared_log):
    try:
        p = subprocess.run([str(probe), "victim", "1"], capture_output=True, text=True, timeout=30,
                           env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": shared_pipe,
                                "CUDA_MPS_LOG_DIRECTORY": shared_log, "CUDA_VISIBLE_DEVICES": "0"})
    except subprocess.TimeoutExpired:
        return False, "no answer in 30 s"
    return p.returncode == 0 and "VICTIM_OK" in p.stdout, (p.stdout + p.stderr).strip()[-300:]


def control_daemon_pid(pipe_dir):
    for pid in sh("pgrep -f nvidia-cuda-mps-control").stdout.split():
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid != 1:
            continue  # one of the agent's queries, not the daemon (it daemonizes)
        if f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode() in env:
            return int(pid)
    return None


def symlink_case(probe, job):
    case = "symlink_log_dir"
    say(f"=== case {case}")
    victim = g.W / "victim-root-file"
    dom_log = g.W / "run/gpu0/d1/log"
    b = Task(job, "job", [probe, "victim", 4], uid=65534)
    ok = b.ctx and b.wait_line("READY", timeout=60)
    check(case, bool(ok), f"nobody's job-domain client up: {b.text()}")
    if not ok:
        return
    log_dir = pathlib.Path(b.ctx["log_dir"])
    b.wait(60)
    b.done(0)
    st = os.stat(log_dir)
    check(case, st.st_uid == 0 and (st.st_mode & 0o777) == 0o755,
          f"{log_dir} owned by uid {st.st_uid} mode {oct(st.st_mode & 0o777)} (root, 0755)")
    check(case, victim.read_text() == "precious\n",
          f"the root-owned file a planted symlink pointed at is untouched: {victim.read_text()!r}")
    for d in (log_dir, g.W / "run/gpu0/log"):
        cl = d / "control.log"
        check(case, cl.exists() and not cl.is_symlink(), f"{cl} is a plain file")
    sl = log_dir / "server.log"
    text = sl.read_text() if sl.exists() else ""
    check(case, sl.exists() and not sl.is_symlink() and len(text) > 0,
          f"the real server (as nobody) wrote {len(text)} bytes to server.log in the root-owned directory")
    RESULTS["server_log_owner"] = os.stat(sl).st_uid if sl.exists() else None
    r = sh(["su", "-s", "/bin/sh", "nobody", "-c", f"ln -s /etc/shadow {log_dir}/control.log.x"])
    check(case, r.returncode != 0, f"nobody cannot plant a name there: {r.stderr.strip()}")
    RESULTS["symlink_dom_log"] = str(dom_log)


def stuck_case(probe, job, shared_pipe, shared_log, hang_daemon):
    case = "hung_control_daemon" if hang_daemon else "stuck_client_of_no_job"
    say(f"=== case {case}")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": shared_pipe, "CUDA_MPS_LOG_DIRECTORY": shared_log,
           "CUDA_VISIBLE_DEVICES": "0"}
    stranger = None
    if not hang_daemon:
        stranger = subprocess.Popen([str(probe), "idle", "600"], env=env, stdout=subprocess.PIPE, text=True)
        line = stranger.stdout.readline()
        line += stranger.stdout.readline()
        check(case, "READY" in line, f"a client of no job attached: {line.strip()!r}")
        # Stopped only once the fault is decided: a stopped client blocks the attach of every new
        # client of its server (seen on this H100: the culprit's attach waited ~70 s).
    v = Task(job, None, [probe, "victim", 30])
    ok = v.ctx and v.wait_line("READY", timeout=60)
    check(case, bool(ok), f"victim job {job} up: {v.text()}")
    known = {e["fault_id"] for e in events()}
    t0 = time.time()
    c = Task(job + 1, None, [probe, "trap", 0.5])
    fault = new_fault(known)
    if stranger:
        os.kill(stranger.pid, signal.SIGSTOP)
        say(f"  client {stranger.pid} of no job SIGSTOPped {time.time() - t0:.2f} s after the culprit started")
    if hang_daemon:
        pid = control_daemon_pid(shared_pipe)
        if pid:
            os.kill(pid, signal.SIGSTOP)
        say(f"  control daemon {pid} SIGSTOPped {time.time() - t0:.2f} s after the culprit started")
        RESULTS.setdefault(case, {})["stopped_daemon"] = pid
    check(case, fault is not None, f"fault {fault} decided")
    bound = (STUCK_MS + 2 * STEP_MS) / 1000 + 15
    active = wait_outcome(fault, "server_active", bound) if fault else None
    t_active = time.time() - t0
    outs = outcomes_of(fault) if fault else []
    for o in outs:
        say(f"  outcome {o}")
    esc = [o for o in outs if o.get("kind") == "escalated"]
    check(case, bool(esc), f"escalated: {[(o['rung'], o['after_ms'], o.get('error')) for o in esc]}")
    check(case, active is not None, f"server ACTIVE again ({active}) {t_active:.1f} s after the culprit started")
    fenced = [o for o in outs if o.get("kind") == "domain_fenced"]
    check(case, not fenced, "not fenced (the domain came back)")
    ok, out = new_client_computes(probe, shared_pipe, shared_log)
    check(case, ok, f"a new client of the shared domain computes: {out}")
    RESULTS.setdefault(case, {}).update(
        {"fault": fault, "active_s": round(t_active, 2), "escalations": esc, "outcomes": outs})
    for t in (v, c):
        t.p.kill()
        t.done(1)
    if stranger:
        os.kill(stranger.pid, signal.SIGCONT)
        stranger.kill()
        stranger.wait()


def main():
    g.setup("stuck_proof.log", "/tmp/mpsr-gpu-stuck")
    RESULTS["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    RESULTS["gpu"] = sh("nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader").stdout.strip()
    say(f"GPU: {RESULTS['gpu']}")
    probe = g.W / "mpsr_probe"
    nv = sh(f"nvcc -O2 -arch=sm_90 -o {probe} {g.ROOT}/tests/gpu/cuda/mpsr_probe.cu", timeout=300)
    if nv.returncode != 0:
        say("nvcc failed: " + nv.stderr)
        return g.finish_common("stuck_proof.json")
    os.chmod(g.W, 0o755)
    # What a previous tenant left: control.log symlinks to a root-owned file, in a job domain's
    # log directory and in the shared one, and files in a pipe directory.
    victim = g.W / "victim-root-file"
    victim.write_text("precious\n")
    for d in (g.W / "run/gpu0/d1", g.W / "run/gpu0"):
        (d / "log").mkdir(parents=True, exist_ok=True)
        (d / "pipe").mkdir(parents=True, exist_ok=True)
        (d / "log/control.log").symlink_to(victim)
        (d / "pipe/left-behind").write_text("x")
        os.chown(d / "log", 65534, 65534)
    cfg = g.write_agent_config("[keeper]\nenabled = false\n")
    text = cfg.read_text().replace(
        "[mps]\n", f"[mps]\nfault_stuck_ms = {STUCK_MS}\nescalation_step_ms = {STEP_MS}\nquarantine = \"off\"\n")
    cfg.write_text(text)
    agent_log = open(g.OUT / "agent.log", "a")
    agent = start_agent(cfg, agent_log)
    if agent is None or agent.poll() is not None:
        say("agent did not start; see agent.log")
        return g.finish_common("stuck_proof.json")
    shared_pipe, shared_log = f"{g.W}/run/gpu0/pipe", f"{g.W}/run/gpu0/log"
    only = os.environ.get("STUCK_PROOF_ONLY", "symlink,client,daemon").split(",")
    if "symlink" in only:
        symlink_case(probe, 600)
    if "client" in only:
        stuck_case(probe, 610, shared_pipe, shared_log, hang_daemon=False)
    if "daemon" in only:
        stuck_case(probe, 620, shared_pipe, shared_log, hang_daemon=True)
    agent.terminate()
    agent.wait(30)
    return g.finish_common("stuck_proof.json")


if __name__ == "__main__":
    sys.exit(main())
