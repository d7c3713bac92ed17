#!/usr/bin/env python3
"""What NVML really reports per MPS client on this driver (issue 13), without the agent.

Starts its own MPS control daemon (own pipe/log dirs), runs PyTorch clients under it and samples
NVML through ctypes once a second: compute and MPS process lists (per-client memory), per-process
utilization (v1 nvmlDeviceGetProcessUtilization and v2 nvmlDeviceGetProcessesUtilizationInfo), and
device counters (utilization, clocks-event reasons, power, PCIe throughput). Phases: a small client
alone; beside a bf16 GEMM hog; beside the hog limited with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; a
near-OOM allocation; host<->device copies. Writes nvml_mps_probe.json under $OUT.

Never changes clocks, power limits, ECC, MIG or compute mode; stops only the daemon it started."""

import ctypes
import json
import os
import pathlib
import subprocess
import sys
import time

OUT = pathlib.Path(os.environ.get("OUT", "/tmp/mpsr-probe-out"))
W = pathlib.Path("/tmp/mpsr-nvml-probe")

nv = ctypes.CDLL("libnvidia-ml.so.1")


class ProcInfo(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("mem", ctypes.c_ulonglong), ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]


class UtilSample(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("ts", ctypes.c_ulonglong), ("sm", ctypes.c_uint), ("mem", ctypes.c_uint),
                ("enc", ctypes.c_uint), ("dec", ctypes.c_uint)]


class UtilInfoV1(ctypes.Structure):
    _fields_ = [("ts", ctypes.c_ulonglong), ("pid", ctypes.c_uint), ("sm", ctypes.c_uint), ("mem", ctypes.c_uint),
                ("enc", ctypes.c_uint), ("dec", ctypes.c_uint), ("jpg", ctypes.c_uint), ("ofa", ctypes.c_uint)]


class ProcsUtilInfo(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("count", ctypes.c_uint), ("last_seen", ctypes.c_ulonglong),
                ("arr", ctypes.POINTER(UtilInfoV1))]


class Util(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("mem", ctypes.c_uint)]


class Mem(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


assert nv.nvmlInit_v2() == 0
dev = ctypes.c_void_p()
assert nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0


def procs(fn):
    n = ctypes.c_uint(64)
    arr = (ProcInfo * 64)()
    r = getattr(nv, fn)(dev, ctypes.byref(n), arr)
    if r != 0:
        return {"error": r}
    return [{"pid": arr[i].pid, "mem_mib": arr[i].mem // (1 << 20)} for i in range(n.value)]


last_v1 = ctypes.c_ulonglong(0)
last_v2 = 0


def putil_v1():
    global last_v1
    n = ctypes.c_uint(64)
    arr = (UtilSample * 64)()
    r = nv.nvmlDeviceGetProcessUtilization(dev, arr, ctypes.byref(n), last_v1)
    if r != 0:
        return {"error": r}
    out = [{"pid": arr[i].pid, "sm": arr[i].sm, "mem": arr[i].mem} for i in range(n.value)]
    if n.value:
        last_v1 = ctypes.c_ulonglong(max(arr[i].ts for i in range(n.value)))
    return out


def putil_v2():
    global last_v2
    arr = (UtilInfoV1 * 64)()
    info = ProcsUtilInfo(ctypes.sizeof(ProcsUtilInfo) | (1 << 24), 64, last_v2, arr)
    fn = getattr(nv, "nvmlDeviceGetProcessesUtilizationInfo", None)
    if fn is None:
        return {"error": "absent"}
    r = fn(dev, ctypes.byref(info))
    if r != 0:
        return {"error": r}
    out = [{"pid": arr[i].pid, "sm": arr[i].sm, "mem": arr[i].mem} for i in range(info.count)]
    if info.count:
        last_v2 = max(arr[i].ts for i in range(info.count))
    return out


def device():
    u = Util()
    m = Mem()
    reasons = ctypes.c_ulonglong()
    p = ctypes.c_uint()
    sm = ctypes.c_uint()
    tx = ctypes.c_uint()
    rx = ctypes.c_uint()
    rep = ctypes.c_uint()
    d = {
        "util": nv.nvmlDeviceGetUtilizationRates(dev, ctypes.byref(u)) or [u.gpu, u.mem],
        "mem": nv.nvmlDeviceGetMemoryInfo(dev, ctypes.byref(m)) or [m.used >> 20, m.total >> 20],
        "events": nv.nvmlDeviceGetCurrentClocksEventReasons(dev, ctypes.byref(reasons)) or hex(reasons.value),
        "power_w": nv.nvmlDeviceGetPowerUsage(dev, ctypes.byref(p)) or p.value / 1000,
        "sm_mhz": nv.nvmlDeviceGetClockInfo(dev, 1, ctypes.byref(sm)) or sm.value,
        "pcie_tx_kbs": nv.nvmlDeviceGetPcieThroughput(dev, 0, ctypes.byref(tx)) or tx.value,
        "pcie_rx_kbs": nv.nvmlDeviceGetPcieThroughput(dev, 1, ctypes.byref(rx)) or rx.value,
        "pcie_replays": nv.nvmlDeviceGetPcieReplayCounter(dev, ctypes.byref(rep)) or rep.value,
    }
    return d


def pmon():
    r = subprocess.run(["nvidia-smi", "pmon", "-c", "1", "-s", "um"], capture_output=True, text=True, timeout=20)
    return [l for l in r.stdout.splitlines() if l and not l.startswith("#")]


SMALL = r"""
import sys, time, torch
x = torch.ones(1 << 16, device='cuda'); torch.cuda.synchronize()
print('ready', flush=True)
end = time.time() + float(sys.argv[1]); n = 0; t0 = time.time(); lat = []
while time.time() < end:
    s = time.perf_counter(); x.add_(1); torch.cuda.synchronize(); lat.append(time.perf_counter() - s); n += 1
    if n % 200 == 0: time.sleep(0.001)
lat.sort()
print('rate', n / (time.time() - t0), 'p50_us', lat[len(lat)//2] * 1e6, 'p99_us', lat[int(len(lat)*0.99)] * 1e6, flush=True)
"""

HOG = r"""
import sys, time, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a); torch.cuda.synchronize()
print('ready', flush=True)
end = time.time() + float(sys.argv[1]); n = 0; t0 = time.time()
while time.time() < end:
    for _ in range(8): c = a @ b
    torch.cuda.synchronize(); n += 8
print('tflops', n * 2 * 8192**3 / (time.time() - t0) / 1e12, flush=True)
"""

OOM = r"""
import sys, time, torch
free, total = torch.cuda.mem_get_info()
x = torch.empty(int(free * 0.96) // 4, dtype=torch.float32, device='cuda'); x.fill_(1); torch.cuda.synchronize()
print('ready', free >> 20, total >> 20, flush=True)
time.sleep(float(sys.argv[1]))
"""

COPY = r"""
import sys, time, torch
h = torch.empty(1 << 28, dtype=torch.float32).pin_memory(); d = torch.empty_like(h, device='cuda')
print('ready', flush=True)
end = time.time() + float(sys.argv[1]); n = 0; t0 = time.time()
while time.time() < end:
    d.copy_(h, non_blocking=True); h.copy_(d, non_blocking=True); torch.cuda.synchronize(); n += 2
print('gbs', n * (1 << 30) / (time.time() - t0) / 1e9, flush=True)
"""


def client(code, secs, env=None):
    e = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(W / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(W / "log"),
             CUDA_VISIBLE_DEVICES="0")
    e.update(env or {})
    p = subprocess.Popen([sys.executable, "-c", code, str(secs)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=e)
    line = p.stdout.readline().strip()
    return p, line


def sample(n, label, res):
    rows = []
    for _ in range(n):
        rows.append({"t": time.time(), "dev": device(), "compute": procs("nvmlDeviceGetComputeRunningProcesses_v3"),
                     "mps": procs("nvmlDeviceGetMPSComputeRunningProcesses_v3"), "putil_v1": putil_v1(),
                     "putil_v2": putil_v2()})
        time.sleep(1)
    rows[-1]["pmon"] = pmon()
    res["phases"][label] = {"samples": rows}
    return rows


def finish(p):
    out = p.communicate(timeout=120)[0]
    return out.strip().splitlines()[-1:] if out else []


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(W)])
    (W / "pipe").mkdir(parents=True)
    (W / "log").mkdir()
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(W / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(W / "log"))
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
    res = {"phases": {}, "results": {}}
    try:
        p, r = client(SMALL, 8)
        sample(6, "small_alone", res)
        res["results"]["small_alone"] = finish(p)
        for label, henv in (("hog_unlimited", {}), ("hog_thread_pct_50", {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}),
                            ("hog_thread_pct_25", {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"})):
            h, _ = client(HOG, 14, henv)
            time.sleep(1)
            s, _ = client(SMALL, 10)
            sample(8, label, res)
            res["results"][label] = {"small": finish(s), "hog": finish(h)}
        p, r = client(OOM, 6)
        res["results"]["near_oom_ready"] = r
        sample(4, "near_oom", res)
        finish(p)
        p, r = client(COPY, 8)
        sample(6, "copies", res)
        res["results"]["copies"] = finish(p)
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env, timeout=30)
        (OUT / "nvml_mps_probe.json").write_text(json.dumps(res, indent=1))
        subprocess.run(["cp", "-r", str(W / "log"), str(OUT / "mps_log")])
    for k, v in res["results"].items():
        print(k, v)
    for k, v in res["phases"].items():
        s = v["samples"][-1]
        print(k, "dev", s["dev"], "compute", s["compute"], "mps", s["mps"], "v1", s["putil_v1"], "v2", s["putil_v2"])
        print("  pmon", v["samples"][-1].get("pmon"))


if __name__ == "__main__":
    main()
