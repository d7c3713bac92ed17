"""mps-resilient kept GPU state for Python (over libmpsr_state.so).

    import mpsr_state, torch
    ptr, origin = mpsr_state.attach("weights", nbytes)
    w = mpsr_state.as_torch(ptr, (n,), torch.float16)     # no copy: the tensor IS the kept memory
    if origin == "new":
        w.copy_(load_weights_from_disk())                   # only on the first run
    # after a GPU fault kills this process, its restart finds origin == "kept" and skips the load

CuPy: `mpsr_state.as_cupy(ptr, nbytes, shape, dtype)`. The library is found through MPSR_STATE_LIB
or the loader path (libmpsr_state.so). The memory stays the job's until it ends (or release());
do not free it with torch/cupy allocators.
"""

import ctypes
import os

ORIGINS = {0: "new", 1: "kept", 2: "snapshot"}


class MpsrStateError(RuntimeError):
    def __init__(self, code, message):
        super().__init__(f"{message} (code {code})")
        self.code = code


_lib = None


def _load():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(os.environ.get("MPSR_STATE_LIB", "libmpsr_state.so"))
        lib.mpsr_state_attach.argtypes = [ctypes.c_char_p, ctypes.c_size_t,
                                          ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)]
        lib.mpsr_state_attach.restype = ctypes.c_int
        for f in ("mpsr_state_detach", "mpsr_state_checkpoint", "mpsr_state_release"):
            getattr(lib, f).argtypes = [ctypes.c_char_p]
            getattr(lib, f).restype = ctypes.c_int
        lib.mpsr_state_last_error.restype = ctypes.c_char_p
        lib.mpsr_state_ready.argtypes = []
        lib.mpsr_state_ready.restype = ctypes.c_int
        lib.mpsr_state_before_cuda.argtypes = []
        lib.mpsr_state_before_cuda.restype = ctypes.c_int
        lib.mpsr_step.argtypes = []
        lib.mpsr_step.restype = ctypes.c_int
        lib.mpsr_step_idle.argtypes = []
        lib.mpsr_step_idle.restype = ctypes.c_int
        lib.mpsr_step_finish.argtypes = []
        lib.mpsr_step_finish.restype = None
        _lib = lib
    return _lib


def _check(rc):
    if rc != 0:
        raise MpsrStateError(rc, _load().mpsr_state_last_error().decode(errors="replace"))


def attach(name, nbytes):
    """Returns (pointer, origin) with origin "new", "kept" or "snapshot"."""
    ptr, restored = ctypes.c_void_p(), ctypes.c_int()
    _check(_load().mpsr_state_attach(name.encode(), nbytes, ctypes.byref(ptr), ctypes.byref(restored)))
    return ptr.value, ORIGINS.get(restored.value, "new")


def ready():
    """Hot standby: returns "primary" at once in the task's primary process; in its standby, blocks
    until a GPU fault hits the task and returns "takeover". Call it after the warm-up (imports,
    model built, kept state attached, one forward pass)."""
    rc = _load().mpsr_state_ready()
    if rc < 0:
        _check(rc)
    return "takeover" if rc == 1 else "primary"


def before_cuda():
    """Warm standby: returns "primary" at once in the task's primary process (and in a hot
    standby); in a warm standby, blocks until a GPU fault hits the task and returns "takeover".
    Call it after the imports (`import torch` creates no CUDA context) and before anything touches
    the GPU (`torch.cuda`, `.cuda()`, `attach`): the standby then holds no GPU memory."""
    rc = _load().mpsr_state_before_cuda()
    if rc < 0:
        _check(rc)
    return "takeover" if rc == 1 else "primary"


def step():
    """Marks the end of one step (a training iteration, a decode step, a served batch): the agent
    reads per-rank step times for skew and latency spikes. The first call starts the clock."""
    _check(_load().mpsr_step())


def step_idle():
    """No step is under way (waiting for requests, a checkpoint, an evaluation): the wait is
    neither a long step nor a stall; the next step() starts the clock again."""
    _check(_load().mpsr_step_idle())


def step_finish():
    """Removes this process's step file (at a clean exit)."""
    _load().mpsr_step_finish()


def detach(name):
    _check(_load().mpsr_state_detach(name.encode()))


def checkpoint(name=None):
    _check(_load().mpsr_state_checkpoint(name.encode() if name else None))


def release(name):
    _check(_load().mpsr_state_release(name.encode()))


class _CudaArray:
    """Exposes kept memory through __cuda_array_interface__ (no copy)."""

    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, False), "version": 3, "strides": None}


def as_torch(ptr, shape, dtype):
    import torch
    typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<V2", torch.int32: "<i4",
               torch.int64: "<i8", torch.uint8: "|u1", torch.float64: "<f8"}[dtype]
    if dtype == torch.bfloat16:  # no typestr for bf16: view 16-bit storage
        t = torch.as_tensor(_CudaArray(ptr, shape, "<i2"), device="cuda")
        return t.view(torch.bfloat16)
    return torch.as_tensor(_CudaArray(ptr, shape, typestr), device="cuda")


def as_cupy(ptr, nbytes, shape, dtype):
    import cupy
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))
