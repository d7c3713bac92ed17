#!/usr/bin/env python3
"""An inference process that keeps its weights in kept GPU state and skips reloading them after a
fault. Run it under `srun --mps-resilient=resume mpsr-run -- python3 keep_weights.py WEIGHTS.pt`:
the first run loads the weights from disk into kept memory; when a GPU fault (its own, or another
job's on the same GPU) kills it, mpsr-run restarts it and it finds the weights already on the GPU.

Without a file it makes random weights (for trying it out). Prints where the weights came from and
how long getting them took.
"""

import sys
import time

import torch

import mpsr_state

N = int(float(sys.argv[2]) * (1 << 30)) // 2 if len(sys.argv) > 2 else (256 << 20)  # fp16 elements

t0 = time.time()
torch.cuda.init()
ptr, origin = mpsr_state.attach("weights", N * 2)
weights = mpsr_state.as_torch(ptr, (N,), torch.float16)  # no copy: this tensor IS the kept memory
if origin == "new":
    src = torch.load(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "-" else torch.randn(N, dtype=torch.float16)
    weights.copy_(src.to("cuda").view(-1)[:N])
    torch.cuda.synchronize()
print(f"weights: {origin}, {N * 2 / 2**30:.2f} GiB ready in {(time.time() - t0) * 1000:.0f} ms, "
      f"checksum {weights.float().sum().item():.3f}", flush=True)

# "Serve": a matrix-vector product per request, until killed or done.
x = torch.randn(4096, dtype=torch.float16, device="cuda")
w = weights[: 4096 * 4096].view(4096, 4096)
for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 100):
    y = w @ x
    torch.cuda.synchronize()
print("served", flush=True)
