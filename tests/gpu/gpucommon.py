"""Helpers shared by the GPU proof scripts (gpu_proof.py, state_proof.py): logging with PASS/FAIL
checks, mpsrctl calls, CUDA client processes with timestamped output, the agent, /dev/kmsg."""

import json
import os
import pathlib
import shutil
import subprocess
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(os.environ.get("MPSR_BIN", ROOT / "gpu-bin"))
OUT = pathlib.Path(os.environ.get("OUT") or ROOT / "tests/gpu/results/latest")
W = pathlib.Path("/tmp/mpsr-gpu")
SOCK = W / "run/agent.sock"
LOG = None
RESULTS = {"cases": {}, "failures": []}
BATCH = 4294967291  # Slurm's batch step id


def setup(log_name, work):
    """Sets the log file and the work dir (the agent's run/state dirs live there)."""
    global LOG, W, SOCK
    OUT.mkdir(parents=True, exist_ok=True)
    LOG = open(OUT / log_name, "w")
    W = pathlib.Path(os.environ.get("MPSR_WORK", work))
    SOCK = W / "run/agent.sock"
    if W.exists():
        shutil.rmtree(W)
    (W / "run").mkdir(parents=True)
    return W


def say(msg):
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


def check(case, cond, what):
    RESULTS["cases"].setdefault(case, {"checks": []})["checks"].append({"ok": bool(cond), "what": what})
    say(f"  {'PASS' if cond else 'FAIL'} [{case}] {what}")
    if not cond:
        RESULTS["failures"].append(f"{case}: {what}")


def sh(cmd, timeout=60, **kw):
    return subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout, **kw)


def ctl(*args, timeout=15):
    return sh([str(BIN / "mpsrctl"), "--socket", str(SOCK), *map(str, args)], timeout=timeout)


def ctl_json(*args):
    r = ctl("--json", *args)
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError:
        return {"error": r.stdout + r.stderr}


def status():
    return ctl_json("status")


def gpu0():
    s = status()
    for k in ("Status",):
        s = s.get(k, s)
    return next((g for g in s.get("gpus", []) if g["gpu"] == 0), {})


def events():
    e = ctl_json("events", "--limit", "1000")
    return e.get("events", []) if isinstance(e, dict) else []


class Output:
    """A child process whose output lines are read, timestamped, in a thread (`self.p`,
    `self.lines`); `WAIT` is the default wait for a line."""

    WAIT = 30

    def _read(self):
        for line in self.p.stdout:
            self.lines.append((time.time(), line.strip()))

    def wait_line(self, prefix, timeout=None):
        end = time.time() + (timeout or self.WAIT)
        while time.time() < end:
            for t, l in self.lines:
                if l.startswith(prefix):
                    return t, l
            if self.p.poll() is not None:
                time.sleep(0.1)  # let the reader take the last lines
                return next(((t, l) for t, l in self.lines if l.startswith(prefix)), None)
            time.sleep(0.01)
        return None

    def wait(self, timeout=30):
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def text(self):
        return " | ".join(l for _, l in self.lines)


class Proc(Output):
    """A CUDA client of GPU 0's MPS server, its output lines timestamped. `argv` overrides the
    default mpsr_probe command line; `env` adds variables."""

    def __init__(self, mode, secs, pipe_dir, log_dir, argv=None, env=None, user=None):
        e = dict(os.environ)
        e.update(
            CUDA_MPS_PIPE_DIRECTORY=pipe_dir,
            CUDA_MPS_LOG_DIRECTORY=log_dir,
            CUDA_VISIBLE_DEVICES="0",  # what the plugin sets: the GPU's server shows it as device 0
        )
        e.update(env or {})
        self.mode = mode
        argv = argv or [str(W / "mpsr_probe"), mode, str(secs)]
        if user:
            keep = " ".join(f"{k}={v}" for k, v in e.items() if k.startswith(("CUDA_", "MPSR_", "SLURM_")))
            argv = ["su", "-s", "/bin/sh", user, "-c", f"env {keep} " + " ".join(argv)]
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e)
        self.pid = self.p.pid
        self.lines = []
        threading.Thread(target=self._read, daemon=True).start()

def register(job, pid):
    r = ctl("register", "--job", job, "--step", 4294967291, "--pid", pid, "--gpus", 0, "--mode", "requeue", "--batch")
    return r.returncode == 0


def deregister(job, pid, code):
    ctl("deregister", "--job", job, "--step", 4294967291, "--pid", pid, "--exit-status", code)


def start_agent(cfg, log):
    a = subprocess.Popen([str(BIN / "mpsr-agent"), "--config", str(cfg)], stdout=log, stderr=log)
    end = time.time() + 60
    while time.time() < end:
        if ctl("status").returncode == 0:
            return a
        if a.poll() is not None:
            return None
        time.sleep(0.1)
    return a


def wait_server_ready(timeout=15):
    t0 = time.time()
    while time.time() - t0 < timeout:
        st = gpu0().get("state")
        if st in ("active", "idle"):
            return time.time() - t0, st
        time.sleep(0.05)
    return None, gpu0().get("state")


class Kmsg:
    """Reads NVRM Xid records from /dev/kmsg. Kernel timestamps are monotonic microseconds on the
    kernel's clock; a marker line written to /dev/kmsg at a known wall-clock time calibrates them
    (CLOCK_MONOTONIC differs from the printk clock by a constant that is not small in a VM)."""

    def __init__(self):
        self.records = []
        self.offset = None
        self.token = f"mpsr-gpu-proof calibration {os.getpid()} {time.time()}"
        try:
            self.f = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.f, 0, os.SEEK_END)
            threading.Thread(target=self._read, daemon=True).start()
            self.ok = True
        except OSError as e:
            say(f"/dev/kmsg not readable: {e}")
            self.ok = False
            return
        try:
            w = os.open("/dev/kmsg", os.O_WRONLY)
            self.t_mark = time.time()
            os.write(w, self.token.encode())
            self.t_mark = (self.t_mark + time.time()) / 2
            os.close(w)
        except OSError as e:
            say(f"/dev/kmsg not writable ({e}): kernel timestamps uncalibrated")
        end = time.time() + 2
        while self.offset is None and time.time() < end:
            time.sleep(0.01)
        say(f"kmsg clock calibration: wall - kernel = {self.offset}")

    def _read(self):
        while True:
            try:
                rec = os.read(self.f, 8192).decode(errors="replace")
            except (BlockingIOError, OSError):
                time.sleep(0.002)
                continue
            head, _, msg = rec.partition(";")
            parts = head.split(",")
            if len(parts) < 3:
                continue
            mono = int(parts[2]) / 1e6
            if self.token in msg:
                self.offset = self.t_mark - mono
            elif "NVRM" in msg:
                off = self.offset if self.offset is not None else time.time() - time.monotonic()
                self.records.append((mono + off, msg.strip()))

    def xids_since(self, t):
        return [(w, m) for w, m in self.records if w >= t - 1 and "Xid" in m]


def write_agent_config(extra=""):
    """Agent config for the nvml backend in the work dir; scontrol is a recording shim (no Slurm on
    the GPU machine)."""
    shim = W / "scontrol"
    shim.write_text(f"#!/bin/sh\necho \"$@\" >> {W}/scontrol.log\n"
                    "case \"$1\" in show) echo 'NodeName=gpu-node State=IDLE JobId=0 Restarts=0';; esac\nexit 0\n")
    shim.chmod(0o755)
    squeue = W / "squeue"
    squeue.write_text('#!/bin/sh\n[ "$1" = --json ] && echo "{\\"jobs\\":[{\\"job_id\\":$4,\\"admin_comment\\":\\"\\"}]}"\n')
    squeue.chmod(0o755)
    cfg = W / "agent.toml"
    cfg.write_text(f"""backend = "nvml"
socket = "{SOCK}"
state_dir = "{W}/state"
run_dir = "{W}/run"
node_name = "gpu-node"
[log]
target = "stderr"
level = "info"
[slurm]
scontrol = "{shim}"
squeue = "{squeue}"
[mps]
fault_grace_ms = 2000
quit_on_shutdown = false
[faults]
kmsg = true
{extra}""")
    return cfg


def keeper_call(sock, req):
    """One request to a state keeper (4-byte length + JSON); None when it does not answer."""
    import socket
    import struct
    try:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(str(sock))
        b = json.dumps(req).encode()
        s.sendall(struct.pack(">I", len(b)) + b)
        n = struct.unpack(">I", s.recv(4))[0]
        data = b""
        while len(data) < n:
            data += s.recv(n - len(data))
        return json.loads(data)
    except (OSError, ValueError, struct.error):
        return None


def keeper_pid(sock):
    r = keeper_call(sock, {"op": "ping"})
    return r.get("pid") if r else None


def finish_common(json_name):
    """Stops what this script started (its keepers, its MPS daemon, and only those), keeps the logs."""
    for sock in sorted((W / "run").glob("gpu*/keeper.sock")):
        pid = keeper_pid(sock)
        if pid:
            os.kill(pid, 15)
        say(f"stopped keeper {sock} (pid {pid})")
    for d in sorted((W / "run").glob("gpu*/pipe")) + sorted((W / "run").glob("gpu*/d*/pipe")):
        r = sh(f"echo quit | CUDA_MPS_PIPE_DIRECTORY={d} nvidia-cuda-mps-control", timeout=30)
        say(f"quit MPS daemon {d}: rc {r.returncode} {r.stdout.strip()} {r.stderr.strip()}")
    for src in sorted((W / "run").glob("gpu*/log/*.log")) + sorted((W / "run").glob("gpu*/keeper.log")):
        shutil.copy(src, OUT / f"{src.parent.name if src.name == 'keeper.log' else 'mps-' + src.parent.parent.name}-{src.name}")
    for src in sorted((W / "run").glob("gpu*/d*/log/*.log")):
        shutil.copy(src, OUT / f"mps-{src.parent.parent.parent.name}-{src.parent.parent.name}-{src.name}")
    if (W / "scontrol.log").exists():
        shutil.copy(W / "scontrol.log", OUT / "scontrol.log")
    RESULTS["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    RESULTS["passed"] = not RESULTS["failures"] and bool(RESULTS["cases"])
    (OUT / json_name).write_text(json.dumps(RESULTS, indent=1, default=str))
    say(f"RESULT: {'ALL CASES MATCHED' if RESULTS['passed'] else 'FAILURES: ' + '; '.join(RESULTS['failures'])}")
    return 0 if RESULTS["passed"] else 1


class Task(Output):
    """A task as slurmstepd starts it: registered with the agent first (which places it in a fault
    domain), then it execs into the CUDA client with that domain's MPS directories (same pid)."""

    WAIT = 60

    def __init__(self, job, isolation, argv, uid=None):
        self.t_spawn = time.time()
        script = 'read p l; export CUDA_MPS_PIPE_DIRECTORY="$p" CUDA_MPS_LOG_DIRECTORY="$l" CUDA_VISIBLE_DEVICES=0; exec "$@"'
        kw = {"user": uid, "group": uid} if uid is not None else {}
        self.p = subprocess.Popen(["/bin/sh", "-c", script, "task", *map(str, argv)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
        self.pid = self.p.pid
        self.job = job
        self.lines = []
        args = ["--json", "register", "--job", job, "--step", BATCH, "--pid", self.pid, "--gpus", 0,
                "--mode", "requeue", "--batch"]
        if isolation:
            args += ["--isolation", isolation]
        if uid is not None:
            args += ["--uid", uid]
        t0 = time.time()
        r = ctl(*args)
        self.register_s = time.time() - t0
        try:
            self.ctx = json.loads(r.stdout)["contexts"][0]
        except (ValueError, KeyError, IndexError):
            self.ctx = None
            say(f"  register job {job} failed: {r.stdout} {r.stderr}")
            self.p.kill()
            return
        self.domain = self.ctx["domain"]
        self.t_go = time.time()
        self.p.stdin.write(f"{self.ctx['pipe_dir']} {self.ctx['log_dir']}\n")
        self.p.stdin.flush()
        threading.Thread(target=self._read, daemon=True).start()

    def done(self, code):
        ctl("deregister", "--job", self.job, "--step", BATCH, "--pid", self.pid, "--exit-status", code or 0)


def proc_cpu(pid):
    """User + system CPU seconds of a process (/proc/PID/stat)."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
