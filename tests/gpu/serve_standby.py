#!/usr/bin/env python3
"""A small PyTorch model served in a loop, for the standby proof (tests/gpu/standby_proof.py): its
weights are kept by the state keeper (mpsr_state.attach, no copy), it runs one warm-up forward
pass, waits in mpsr_state.ready() (at once in a primary; until a fault in a hot standby), then
answers "requests" (one forward pass each) for SECONDS, printing `ANSWER <wall>` per answer. A warm
standby (MPSR_ROLE=warm) waits in mpsr_state.before_cuda() right after the imports, before CUDA is
touched, and does the rest once released. After a fault (a warm standby released, a restart) its
reference pass answers the first request.

    serve_standby.py SECONDS [plain]

`plain`: weights in ordinary GPU memory, made again at every start (a restart without kept state).
"""
import os
import sys
import time

t_start = time.time()
import torch  # noqa: E402

import mpsr_state  # noqa: E402

if os.environ.get("MPSR_ROLE") == "warm":
    if os.environ.get("SERVE_WARM_INIT") == "1":
        # An experiment: the driver initialized (cuInit) before waiting, no context made. Does
        # it cost GPU memory or make the process an MPS client, and what does it save?
        import ctypes
        t0 = time.time()
        rc = ctypes.CDLL("libcuda.so.1").cuInit(0)
        print(f"CUINIT rc={rc} s={time.time() - t0:.3f}", flush=True)
    print(f"READY role=warm pid={os.getpid()} wall={time.time():.6f} import_s={time.time() - t_start:.3f}", flush=True)
    mpsr_state.before_cuda()
    print(f"RELEASED wall={time.time():.6f}", flush=True)

H, LAYERS, BATCH = 4096, 4, 32
secs = float(sys.argv[1])
plain = len(sys.argv) > 2 and sys.argv[2] == "plain"
shape = (LAYERS, H, H)
if plain:
    origin = "none"
    w = torch.empty(shape, device="cuda", dtype=torch.float16)
else:
    ptr, origin = mpsr_state.attach("weights", LAYERS * H * H * 2)
    t_attached = time.time()
    w = mpsr_state.as_torch(ptr, shape, torch.float16)
    t_torch = time.time()
if origin != "kept":
    # "Loading the model": deterministic weights, as a checkpoint would give them.
    g = torch.Generator(device="cuda").manual_seed(7)
    w.copy_(torch.randn(shape, device="cuda", dtype=torch.float16, generator=g) * 0.02)
x = torch.randn(BATCH, H, device="cuda", dtype=torch.float16, generator=torch.Generator(device="cuda").manual_seed(1))


def forward():
    y = x
    for layer in range(LAYERS):
        y = torch.nn.functional.linear(y, w[layer]).relu()
    return y


t_input = time.time()
with torch.no_grad():
    ref = forward()
    torch.cuda.synchronize()
t_ref = time.time()
if not plain:
    # Where a start's time goes (a warm standby's after its release): context + attach, torch's
    # view of the weights, the input, the first forward pass (libraries, kernels loaded).
    print(f"PHASES attach_s={t_attached:.6f} torch_s={t_torch:.6f} input_s={t_input:.6f} ref_s={t_ref:.6f}", flush=True)
role_env = os.environ.get("MPSR_ROLE", "primary")
restarts = int(os.environ.get("MPSR_RESTARTS", "0") or 0)
if role_env == "warm" or restarts > 0:
    # An incarnation after a fault: its reference pass was a forward pass on the request, so it
    # is the first answer (a server would not compute the same answer twice before replying).
    print(f"ANSWER {t_ref:.6f}", flush=True)
if role_env != "warm":
    print(f"READY role={role_env} origin={origin} wall={time.time():.6f}", flush=True)
role = mpsr_state.ready() if not plain else "primary"
t_ready = time.time()
print(f"SERVING role={role} origin={origin} restarts={restarts} start_to_ready_s={t_ready - t_start:.3f} wall={t_ready:.6f}", flush=True)
end = time.time() + secs
with torch.no_grad():
    while time.time() < end:
        y = forward()
        torch.cuda.synchronize()
        if not torch.equal(y, ref):
            print("WRONG_ANSWER", flush=True)
            sys.exit(3)
        print(f"ANSWER {time.time():.6f}", flush=True)
        time.sleep(0.002)
print("DONE", flush=True)
