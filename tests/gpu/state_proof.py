#!/usr/bin/env python3
"""Kept-state proof on a real GPU (issue 5): the agent (nvml backend) starts the state keeper
outside MPS; job A keeps N GiB of state through libmpsr_state.so under mpsr-run; job B faults
(Xid 43, then Xid 31) and kills A (stock MPS); mpsr-run restarts A in place once the server is
ACTIVE and A finds its state intact. Measured: fault -> A running again with verified state, against
a cold restart that reloads the same state from a local file and against re-upload from host
memory; kept-memory bandwidth against cudaMalloc; snapshot checkpoint/restore after the keeper's
memory is lost; another user cannot get A's state; the keeper holds the state without a CUDA
context.

    MPSR_BIN=<dir with mpsr-agent, mpsrctl, mpsr-run, mpsr-keeper, libmpsr_state.so> \\
        python3 tests/gpu/state_proof.py [GIB ...]
"""

import os
import signal
import sys
import time

import gpucommon as g
from gpucommon import Proc, check, ctl, say, sh, start_agent, wait_server_ready

RESULTS = g.RESULTS
PAT = "0x1234abcd"


def keeper_pid():
    return g.keeper_pid(g.W / "run/gpu0/keeper.sock")


def main():
    sizes = [float(a) for a in sys.argv[1:]] or [1, 8, 32]
    W = g.setup("state_proof.log", "/tmp/mpsr-gpu2")
    say(f"GPU: {sh('nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader').stdout.strip()}")
    inc = g.ROOT / "state-lib/include"
    nv = sh(f"nvcc -O2 -arch=sm_90 -I{inc} -o {W}/state_client {g.ROOT}/tests/gpu/cuda/state_client.cu "
            f"-L{g.BIN} -lmpsr_state -Xlinker -rpath={g.BIN}", timeout=300)
    nv2 = sh(f"nvcc -O2 -arch=sm_90 -o {W}/mpsr_probe {g.ROOT}/tests/gpu/cuda/mpsr_probe.cu", timeout=300)
    if nv.returncode or nv2.returncode:
        say("nvcc failed: " + nv.stderr + nv2.stderr)
        return g.finish_common("state_proof.json")
    cfg = g.write_agent_config(f'[keeper]\nmax_bytes_per_job = "40G"\nsnapshot_dir = "{W}/snapshots"\n')
    log = open(g.OUT / "agent.log", "a")
    agent = start_agent(cfg, log)
    end = time.time() + 30
    while keeper_pid() is None and time.time() < end:
        time.sleep(0.2)
    check("setup", keeper_pid() is not None, "the agent started a state keeper for gpu0")
    pipe, logd = f"{W}/run/gpu0/pipe", f"{W}/run/gpu0/log"
    keeper_sock = f"{W}/run/gpu0/keeper.sock"
    ks = sh(f"cat /proc/{keeper_pid()}/environ | tr '\\0' '\\n' | grep CUDA_MPS_PIPE").stdout.strip()
    say(f"keeper environment: {ks} (no MPS daemon there: the keeper is not an MPS client)")
    base = {"MPSR_KEEPER_SOCKET": keeper_sock, "MPSR_SOCKET": str(g.SOCK)}

    # The state file for the cold-restart baseline (largest size; smaller ones read a prefix).
    big = max(sizes)
    datafile = W / "state.bin"
    wf = Proc("write", 0, pipe, logd, argv=[str(W / "state_client"), "writefile", str(datafile), str(big), PAT])
    wf.wait(600)
    say(f"state file: {wf.text()}")

    RESULTS["resume"] = []
    for i, gib in enumerate(sizes):
        for xid_mode in (["trap", "illegal"] if gib == sizes[0] else ["trap"]):
            case = f"resume_{gib:g}GiB_{xid_mode}"
            say(f"=== case {case}")
            job = 700 + 10 * i + (xid_mode == "illegal")
            script = (f"if [ $MPSR_RESTARTS = 0 ]; then exec {W}/state_client keep weights {gib} {PAT}; "
                      f"else exec {W}/state_client verify weights {gib} {PAT}; fi")
            env = dict(base, SLURM_JOB_ID=str(job), SLURM_STEP_ID="0")
            a = Proc("A", 0, pipe, logd, argv=[str(g.BIN / "mpsr-run"), "--backoff-ms", "0", "--", "sh", "-c", script],
                     env=env)
            # mpsr-run is the job's task (as the SPANK plugin registers it).
            r = ctl("register", "--job", job, "--step", 0, "--pid", a.pid, "--gpus", 0, "--mode", "resume")
            check(case, r.returncode == 0, f"A (mpsr-run pid {a.pid}) registered as job {job} in resume mode")
            ready = a.wait_line("READY", 120)
            if not ready:
                check(case, False, f"A attached and filled its state: {a.text()}")
                continue
            say(f"  A: {ready[1]}")
            if i == 0 and xid_mode == "trap":
                # The keeper holds A's memory but no CUDA context: each context on the GPU delays
                # the driver's report of an SM exception (~10 ms), which hot standbys wait for.
                apps = sh("nvidia-smi --query-compute-apps=pid --format=csv,noheader").stdout.split()
                kp = keeper_pid()
                say(f"  compute processes on the GPU: {apps}; keeper pid {kp}")
                check("keeper_no_context", kp is not None and str(kp) not in apps,
                      f"the keeper (pid {kp}) holds {gib:g} GiB for A without a CUDA context "
                      "(not among the GPU's compute processes)")
            b = Proc(xid_mode, 0.5, pipe, logd)
            ctl("register", "--job", job + 100, "--step", 0, "--pid", b.pid, "--gpus", 0, "--mode", "requeue")
            b.wait(30)
            died = a.wait_line("KEEP_ERROR", 30)
            verified = a.wait_line("VERIFIED", 120)
            code = a.wait(60)
            say(f"  A: {a.text()}")
            if not (died and verified):
                check(case, False, "A died of the fault and came back with verified state")
                continue
            t_fault = float(died[1].split("wall=")[1])
            t_ok = float(verified[1].split("wall=")[1])
            fields = dict(kv.split("=") for kv in verified[1].split()[1:])
            res = {"gib": gib, "xid": xid_mode, "fault_to_verified_ms": round((t_ok - t_fault) * 1000, 1),
                   "new_process_total_ms": float(fields["total_ms"]), "attach_ms": float(fields["attach_ms"]),
                   "verify_ms": float(fields["verify_ms"]), "origin": fields["origin"]}
            check(case, fields["origin"] == "1" and fields["bad"] == "0",
                  f"restarted A found its {gib:g} GiB kept (origin 1) and intact (0 bad elements)")
            check(case, code == 0, f"mpsr-run ended with A's status 0 (got {code})")
            say(f"  fault -> A running again with verified state: {res['fault_to_verified_ms']} ms "
                f"(new process {res['new_process_total_ms']} ms: attach {res['attach_ms']} ms, verify {res['verify_ms']} ms)")
            ctl("job-end", job)
            ctl("job-end", job + 100)
            wait_server_ready()
            # Baselines for the same size: cold restart from the local file, re-upload from host memory.
            if xid_mode == "trap":
                dc = sh("sync; echo 3 > /proc/sys/vm/drop_caches")
                res["page_cache_dropped"] = dc.returncode == 0
                cold = Proc("cold", 0, pipe, logd,
                            argv=[str(W / "state_client"), "cold", str(datafile), str(gib), PAT])
                cold.wait(600)
                host = Proc("host", 0, pipe, logd,
                            argv=[str(W / "state_client"), "host", str(datafile), str(gib), PAT])
                host.wait(600)
                for name, p in (("cold_restart_ms", cold), ("host_reupload_ms", host)):
                    m = p.wait_line("BASELINE", 1)
                    if m:
                        res[name] = float(dict(kv.split("=") for kv in m[1].split()[2:])["total_ms"])
                    say(f"  {name}: {p.text()}")
                if "cold_restart_ms" in res:
                    res["speedup_vs_cold"] = round(res["cold_restart_ms"] / res["fault_to_verified_ms"], 1)
                if "host_reupload_ms" in res:
                    res["speedup_vs_host"] = round(res["host_reupload_ms"] / res["fault_to_verified_ms"], 1)
                say(f"  speedup vs cold restart: {res.get('speedup_vs_cold')}x, vs host re-upload: {res.get('speedup_vs_host')}x")
            RESULTS["resume"].append(res)

    # Steady-state overhead: bandwidth on kept memory vs cudaMalloc.
    case = "bandwidth"
    env = dict(base, SLURM_JOB_ID="800")
    p = Proc("bw", 0, pipe, logd, argv=["sh", "-c", f"sleep 0.3; exec {W}/state_client bw bwtest 8"], env=env)
    ctl("register", "--job", 800, "--step", 0, "--pid", p.pid, "--gpus", 0, "--mode", "resume")
    p.wait(120)
    m = p.wait_line("BW", 1)
    say(f"  {p.text()}")
    if m:
        ratio = float(m[1].split("ratio=")[1])
        RESULTS["bandwidth"] = m[1]
        check(case, ratio >= 0.97, f"kept-memory bandwidth / cudaMalloc bandwidth = {ratio} (target >= 0.99)")
    ctl("job-end", 800)

    # Snapshot: checkpoint 1 GiB, lose the keeper (as after a GPU reset), restore on attach.
    case = "snapshot"
    env = dict(base, SLURM_JOB_ID="810")
    # Each client runs under a shell registered as a task of job 810 (as under slurmstepd).
    sh_task = Proc("task", 0, pipe, logd, argv=["sh", "-c", f"sleep 0.5; {W}/state_client checkpoint snap 1 {PAT}"],
                   env=env)
    ctl("register", "--job", 810, "--step", 1, "--pid", sh_task.pid, "--gpus", 0, "--mode", "resume")
    sh_task.wait(120)
    say(f"  checkpoint: {sh_task.text()}")
    old = keeper_pid()
    if old:
        os.kill(old, signal.SIGKILL)
    end = time.time() + 20
    while (keeper_pid() in (None, old)) and time.time() < end:
        time.sleep(0.2)
    check(case, keeper_pid() not in (None, old), "the agent started a fresh keeper (GPU memory of the old one is gone)")
    t2 = Proc("task2", 0, pipe, logd, argv=["sh", "-c", f"sleep 0.5; exec {W}/state_client verify snap 1 {PAT}"],
              env=env)
    ctl("register", "--job", 810, "--step", 2, "--pid", t2.pid, "--gpus", 0, "--mode", "resume")
    t2.wait(120)
    v = t2.wait_line("VERIFIED", 1)
    say(f"  restore: {t2.text()}")
    check(case, bool(v) and "origin=2" in v[1] and "bad=0" in v[1],
          "after the keeper's memory was lost, attach restored 1 GiB from the snapshot, intact")
    RESULTS["snapshot"] = {"checkpoint": sh_task.text(), "restore": t2.text()}
    ctl("job-end", 810)

    # Security: a process of another uid, even one started under the job's own task, gets nothing.
    case = "security"
    sh("id mpsrtest >/dev/null 2>&1 || useradd -M -s /bin/sh mpsrtest")
    sh(f"mkdir -p {W}/no-mps; cp {g.BIN}/libmpsr_state.so {W}/; chmod 755 {W} {W}/run {W}/run/gpu0 {W}/no-mps "
       f"{W}/state_client {W}/libmpsr_state.so")
    env = dict(base, SLURM_JOB_ID="820")
    keep = " ".join(f"{k}={v}" for k, v in env.items())
    script = (f"sleep 0.5; {W}/state_client checkpoint secret 0.5 {PAT}; "
              # Not through the root-owned MPS server (legacy MPS would queue another uid's client);
              # the keeper's check does not depend on MPS.
              f"su -s /bin/sh mpsrtest -c 'env {keep} CUDA_MPS_PIPE_DIRECTORY={W}/no-mps LD_LIBRARY_PATH={W} "
              f"{W}/state_client verify secret 0.5 {PAT}'")
    owner = Proc("own", 0, pipe, logd, argv=["sh", "-c", script], env=env)
    ctl("register", "--job", 820, "--step", 0, "--pid", owner.pid, "--gpus", 0, "--mode", "resume")
    owner.wait(90)
    say(f"  owner then other user: {owner.text()}")
    check(case, "CHECKPOINT rc=0" in owner.text(), "the job's own process attached and checkpointed its state")
    check(case, "ATTACH_ERROR" in owner.text() and "VERIFIED" not in owner.text(),
          "a process of another uid under the job's task cannot attach the job's state")
    ctl("job-end", 820)
    # The documented Python example (PyTorch): first run loads, second run finds the weights kept.
    case = "python_example"
    env = dict(base, SLURM_JOB_ID="830", MPSR_STATE_LIB=f"{g.BIN}/libmpsr_state.so",
               PYTHONPATH=f"{g.ROOT}/state-lib/python")
    ex = f"{g.ROOT}/state-lib/examples/keep_weights.py"
    t = Proc("py", 0, pipe, logd, argv=["sh", "-c", f"sleep 0.5; python3 {ex} - 0.5 10; python3 {ex} - 0.5 10"], env=env)
    ctl("register", "--job", 830, "--step", 0, "--pid", t.pid, "--gpus", 0, "--mode", "resume")
    t.wait(180)
    say(f"  {t.text()}")
    lines = [l for _, l in t.lines if l.startswith("weights:")]
    check(case, len(lines) == 2 and "weights: new" in lines[0] and "weights: kept" in lines[1]
          and lines[0].split("checksum")[1] == lines[1].split("checksum")[1],
          "second run found the weights kept, same checksum, without loading them")
    ctl("job-end", 830)

    stats = g.keeper_call(keeper_sock, {"op": "stats"})
    say(f"keeper holds after all jobs ended: {stats}")
    check("cleanup", stats is not None and stats.get("total_bytes") == 0, "the keeper holds nothing once every job ended")
    agent.send_signal(signal.SIGTERM)
    agent.wait(30)
    return g.finish_common("state_proof.json")


if __name__ == "__main__":
    sys.exit(main())
