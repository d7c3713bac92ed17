#!/usr/bin/env python3
"""Site proof of driver-patch/ (NOT run here: the lent H200 cannot load kernel modules). Run on
your own GPU node after loading the patched nvidia-uvm with uvm_mpsr_attribution=1 (phase A) and,
for phase B, uvm_mpsr_containment=1, as root:

    MPSR_BIN=<dir with mpsr-agent, mpsrctl> python3 tests/gpu/driver_patch_proof.py

A victim and a culprit (store to an unmapped address, Xid 31) share GPU 0's MPS server, each
registered as a job. Expected: the kernel log has `NVRM: mpsr-isolate ... culprit_pid=<culprit>`
before the Xid line; the agent records the culprit's job as the culprit (evidence "isolation") and
fails it instead of restarting it. Phase A only (contained=0): the victim dies with the server
and is requeued. With containment (contained=1): no Xid line follows (nothing was cancelled), the
victim runs to completion, only the culprit's job is hit and the agent terminates the culprit.
Writes driver_patch_proof.log/.json to $OUT; exit 0 only if every check passed, 2 if the patched
module is not loaded.
"""

import pathlib
import sys
import time

import gpucommon as g
from gpucommon import Kmsg, Proc, check, deregister, events, register, say, sh, start_agent

PARAM = pathlib.Path("/sys/module/nvidia_uvm/parameters/uvm_mpsr_attribution")
CONTAIN = pathlib.Path("/sys/module/nvidia_uvm/parameters/uvm_mpsr_containment")


def main():
    g.setup("driver_patch_proof.log", "/tmp/mpsr-gpu-driver")
    if not PARAM.exists() or PARAM.read_text().strip() != "1":
        say(f"{PARAM}: {PARAM.read_text().strip() if PARAM.exists() else 'missing'}: the patched nvidia-uvm "
            "with uvm_mpsr_attribution=1 is not loaded (driver-patch/README.md)")
        return 2
    containment = CONTAIN.exists() and CONTAIN.read_text().strip() == "1"
    g.RESULTS["containment"] = containment
    g.RESULTS["gpu"] = sh("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader").stdout.strip()
    probe = g.W / "mpsr_probe"
    nv = sh(f"nvcc -O2 -o {probe} {g.ROOT}/tests/gpu/cuda/mpsr_probe.cu", timeout=300)
    if nv.returncode != 0:
        say("nvcc failed: " + nv.stderr)
        return g.finish_common("driver_patch_proof.json")
    cfg = g.write_agent_config("[keeper]\nenabled = false\n")
    agent = start_agent(cfg, open(g.OUT / "agent.log", "a"))
    if agent is None:
        say("agent did not start")
        return g.finish_common("driver_patch_proof.json")
    kmsg = Kmsg()
    pipe, logd = f"{g.W}/run/gpu0/pipe", f"{g.W}/run/gpu0/log"
    case = "containment" if containment else "attribution"
    v = Proc("victim", 15, pipe, logd)
    if not v.wait_line("READY", 60):
        check(case, False, f"victim attached ({v.text()})")
        return g.finish_common("driver_patch_proof.json")
    register(501, v.pid)
    t0 = time.time()
    f = Proc("illegal", 1.5, pipe, logd)
    if f.wait_line("ATTACHED", 30):
        register(502, f.pid)
    fc, vc = f.wait(30), v.wait(30)
    time.sleep(1.5)
    lines = [m for w, m in kmsg.records if w >= t0 - 1]
    g.RESULTS["kmsg"] = lines
    iso = [i for i, m in enumerate(lines) if "mpsr-isolate" in m]
    xid = [i for i, m in enumerate(lines) if "Xid" in m]
    check(case, bool(iso), f"an mpsr-isolate line was printed ({lines})")
    if iso:
        line = lines[iso[0]]
        check(case, f"culprit_pid={f.pid} " in line, f"it names the culprit pid {f.pid}: {line}")
        check(case, not xid or iso[0] < xid[0], "it comes before the Xid line")
        contained = " contained=1 " in line
        check(case, contained == containment,
              f"contained={int(contained)} as uvm_mpsr_containment={int(containment)} asks")
        if contained:
            check(case, not xid, f"contained: no Xid followed (nothing was cancelled): {[lines[i] for i in xid]}")
            check(case, vc == 0, f"contained: the victim survived (exit {vc})")
        else:
            check(case, vc not in (0, None), f"not contained: the victim died with the server (exit {vc})")
        g.RESULTS["culprit_exit"] = fc
    hits = [e for e in events() if e["hit_jobs"]]
    g.RESULTS["events"] = hits
    check(case, len(hits) == 1, f"one decision with hit jobs ({len(hits)})")
    if hits:
        e = hits[0]
        check(case, e.get("culprit_job") == 502 and e.get("culprit_evidence") == "isolation",
              f"culprit job {e.get('culprit_job')} ({e.get('culprit_evidence')})")
        check(case, any(a.startswith("fail job 502") for a in e["actions"]), f"the culprit is failed: {e['actions']}")
        if containment:
            check(case, e["hit_jobs"] == [502] and 501 in e["spared_jobs"],
                  f"only the culprit's job is hit: hit {e['hit_jobs']} spared {e['spared_jobs']}")
            check(case, any(a.startswith("terminate_client") for a in e["actions"]),
                  f"the agent terminates the culprit: {e['actions']}")
    deregister(501, v.pid, vc or 0)
    deregister(502, f.pid, fc or 0)
    agent.terminate()
    agent.wait(30)
    return g.finish_common("driver_patch_proof.json")


if __name__ == "__main__":
    sys.exit(main())
