#!/usr/bin/env python3
"""Probe (issue 21; measures, asserts nothing): how long the driver takes to report an SM exception
(Xid 43, `__trap`) of a client of MPS server A, depending on what else holds a context on the GPU:
nothing, an idle client of a second MPS server B (where the hot standby waits), idle plain (non-MPS)
contexts (what the state keeper is), or both. The first idle process is released by server A's
fatal-error line, as the agent does, and its first kernel is timed. One wall clock, from the
culprit's launch of its faulting kernel.

    OUT=<dir> python3 tests/gpu/report_time_probe.py [REPS]

Starts and stops its own two MPS control daemons in /tmp/mpsr-rtp; compiles cuda/standby_probe.cu.
"""
import json
import os
import pathlib
import select
import statistics
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
OUT = pathlib.Path(os.environ.get("OUT", "/tmp/mpsr-rtp-out"))
OUT.mkdir(parents=True, exist_ok=True)
W = pathlib.Path("/tmp/mpsr-rtp")
W.mkdir(exist_ok=True)
LOG = open(OUT / "report_time_probe.log", "w")


def say(m):
    line = f"[{time.strftime('%H:%M:%S')}] {m}"
    print(line, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


def env_of(name, mps=True):
    d = W / name
    (d / "pipe").mkdir(parents=True, exist_ok=True)
    (d / "log").mkdir(parents=True, exist_ok=True)
    # A pipe directory no control daemon serves: CUDA makes a plain context.
    return dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(d / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(d / "log"),
                CUDA_VISIBLE_DEVICES="0")


class P:
    def __init__(self, argv, env):
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines = []
        threading.Thread(target=self._rd, daemon=True).start()

    def _rd(self):
        for line in self.p.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def wait_for(self, w, t=60):
        end = time.time() + t
        while time.time() < end:
            if any(w in ln for _, ln in self.lines):
                return True
            if self.p.poll() is not None:
                time.sleep(0.05)
                return any(w in ln for _, ln in self.lines)
            time.sleep(0.005)
        return False

    def line(self, w):
        return next((ln for _, ln in self.lines if w in ln), None)

    def wait(self, t=60):
        try:
            return self.p.wait(t)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return None


KM, SRV = [], []


def kmsg_reader():
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    os.lseek(fd, 0, os.SEEK_END)
    while True:
        select.select([fd], [], [], 1.0)
        try:
            while True:
                b = os.read(fd, 8192)
                if not b:
                    break
                KM.append((time.time(), b.decode(errors="replace").split(";", 1)[-1].strip()))
        except OSError:
            pass


def server_log_tail(path):
    while not path.exists():
        time.sleep(0.01)
    with open(path) as fh:
        fh.seek(0, 2)
        while True:
            ln = fh.readline()
            if ln:
                SRV.append((time.time(), ln.strip()))
            else:
                time.sleep(0.0002)


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    exe = W / "standby_probe"
    r = subprocess.run(["nvcc", "-O2", "-arch=sm_90", "-o", str(exe), str(HERE / "cuda/standby_probe.cu")],
                       capture_output=True, text=True)
    if r.returncode:
        say("nvcc failed: " + r.stderr)
        return 1
    EA, EB, EP = env_of("A"), env_of("B"), env_of("plain")
    for e in (EA, EB):
        r = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=e, capture_output=True, text=True)
        say(f"MPS control daemon {e['CUDA_MPS_PIPE_DIRECTORY']}: rc {r.returncode}")
    threading.Thread(target=kmsg_reader, daemon=True).start()
    try:
        P([str(exe), "work", "0.05"], EA).wait(60)
        threading.Thread(target=server_log_tail, args=(W / "A/log/server.log",), daemon=True).start()
        res = {}
        # Each case: the idle contexts beside server A ("b": a client of server B, "plain": a
        # non-MPS context); the first one is released by the fatal line.
        cases = {"alone": [], "idle_in_mps_server_b": ["b"], "idle_plain_context": ["plain"],
                 "b_and_one_plain": ["b", "plain"], "b_and_two_plain": ["b", "plain", "plain"],
                 "b_and_four_plain": ["b"] + ["plain"] * 4, "five_in_mps_server_b": ["b"] * 5}
        for case, kinds in cases.items():
            res[case] = []
            for rep in range(reps):
                k0, s0 = len(KM), len(SRV)
                idle, fifo, others = None, W / "go", []
                for j, kind in enumerate(kinds):
                    fj = W / f"go{j}"
                    fj.exists() and fj.unlink()
                    os.mkfifo(fj)
                    pj = P([str(exe), "idle", str(fj)], EB if kind == "b" else EP)
                    pj.wait_for("READY")
                    if j == 0:
                        idle, fifo = pj, fj
                    else:
                        others.append((pj, fj))
                if idle:

                    def release(s0=s0, fifo=fifo):
                        end = time.time() + 20
                        while time.time() < end and not any("atal" in ln for _, ln in SRV[s0:]):
                            time.sleep(0.0002)
                        with open(fifo, "w") as fh:
                            fh.write("g")
                    threading.Thread(target=release, daemon=True).start()
                v = P([str(exe), "work", "30"], EA)
                v.wait_for("READY")
                f = P([str(exe), "trap", "500"], EA)
                f.wait(30)
                v.wait(30)
                if idle:
                    idle.wait(30)
                for pj, fj in others:
                    with open(fj, "w") as fh:
                        fh.write("g")
                    pj.wait(30)
                time.sleep(0.3)
                tf = float(f.line("FAULTING").split()[-1])
                xid = next((t for t, ln in KM[k0:] if "Xid" in ln), None)
                fatal = next((t for t, ln in SRV[s0:] if "atal" in ln), None)
                tk = idle.line("TAKEOVER") if idle else None
                row = {"xid_ms": round((xid - tf) * 1e3, 1) if xid else None,
                       "server_line_ms": round((fatal - tf) * 1e3, 1) if fatal else None,
                       "idle_first_kernel_ms": round((float(tk.split()[4]) - tf) * 1e3, 1) if tk else None}
                say(f"{case} #{rep}: {row}")
                res[case].append(row)
                # Server A takes new clients again once the fault is handled.
                for _ in range(100):
                    if P([str(exe), "work", "0.02"], EA).wait(20) == 0:
                        break
                    time.sleep(0.05)
        summary = {}
        for case, rows in res.items():
            summary[case] = {k: statistics.median([r[k] for r in rows if r[k] is not None])
                             for k in ("xid_ms", "server_line_ms", "idle_first_kernel_ms")
                             if any(r[k] is not None for r in rows)}
            say(f"{case}: medians {summary[case]}")
        (OUT / "report_time_probe.json").write_text(json.dumps({"rows": res, "medians": summary}, indent=1))
    finally:
        for e in (EA, EB):
            subprocess.run(["sh", "-c", "echo quit | nvidia-cuda-mps-control"], env=e, capture_output=True, timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
