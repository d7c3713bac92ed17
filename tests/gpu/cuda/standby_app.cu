// standby_app: the hot-standby proof program (tests/gpu/standby_proof.py), linked with
// libmpsr_state.so. Every line is flushed; times are wall-clock seconds (one clock for all).
//
//   standby_app serve MIB SECONDS [idle]
//       Attaches the task's kept state "state" (MIB MiB: a generation counter, then data; zeroed
//       on first use), runs one warm-up kernel, then calls mpsr_state_ready(): at once in the
//       primary, after a fault in the (hot) standby. A warm standby (MPSR_ROLE=warm) waits in
//       mpsr_state_before_cuda() before all of that, holding no CUDA context, and does it all once
//       released, less the warm-up (a restart skips it too). Its first kernel then checks the
//       kept state, and it
//       runs small kernels on it (a step: data = gen + 1, then gen += 1, the counter written last)
//       until SECONDS have passed (`idle`: memory of its own instead of kept state, no kernels
//       after the wait; the cost case). Prints
//         READY role=<primary|standby> origin=<0|1|2> wall=<t>
//         READY role=warm wall=<t>                (a warm standby, before it waits)
//         FIRST_KERNEL how=<start|takeover|restart> released=<t> done=<t> gen=<g> bad=<n> redo=<0|1>
//                      began=<t> ctx=<t> attached=<t>   (process start, context made, state attached)
//         KEEP_ERROR <code> <text> wall=<t>       (the primary hit by a fault)
//   standby_app fault illegal|trap|misaligned DELAY
//       One faulting kernel after DELAY s (Xid 31 / 43 / 13+43); prints FAULTING wall=<t> just
//       before the launch.
//
// Why the counter: a fault may interrupt a step, so the standby may see data = gen + 1 partly
// written while gen is still the old value. Every data word must be gen or gen + 1; if any is
// gen + 1 the step was interrupted and is redone. A word outside {gen, gen + 1} is corruption.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <unistd.h>
#include "mpsr_state.h"

static double wall() {
  timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

__global__ void fill(unsigned *d, size_t n, unsigned v) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i < n; i += (size_t)gridDim.x * blockDim.x) d[i] = v;
}

// Counts words outside {gen, gen + 1} (bad) and words equal to gen + 1 (ahead).
__global__ void check(const unsigned *gen, const unsigned *d, size_t n, unsigned long long *out) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  unsigned g = *gen;
  unsigned long long bad = 0, ahead = 0;
  for (; i < n; i += (size_t)gridDim.x * blockDim.x) {
    bad += (d[i] != g && d[i] != g + 1);
    ahead += (d[i] == g + 1);
  }
  if (bad) atomicAdd(&out[0], bad);
  if (ahead) atomicAdd(&out[1], ahead);
}

__global__ void bump(unsigned *gen) { *gen += 1; }

__global__ void store_to(int *p) { *p = 42; }
__global__ void trap_kernel() { __trap(); }
__global__ void misaligned(char *p) { *(int *)(p + 1) = 7; }

#define OUT(...) do { printf(__VA_ARGS__); fflush(stdout); } while (0)

// Weak: the same program runs with a state library before 0.3 (the restart baseline), which has
// no warm standby.
extern "C" int mpsr_state_before_cuda(void) __attribute__((weak));

static const char *role_env() {
  const char *r = getenv("MPSR_ROLE");
  if (r && !strcmp(r, "standby")) return "standby";
  if (r && !strcmp(r, "warm")) return "warm";
  return "primary";
}

static int serve(size_t mib, double secs, bool idle) {
  double began = wall();
  // A warm standby waits here, before its first CUDA call: no context, no GPU memory.
  int warm = 0;
  double released = 0;
  if (!strcmp(role_env(), "warm")) {
    if (getenv("STANDBY_WARM_INIT")) {
      // An experiment (standby_proof's warm_init): the driver initialized before waiting, no
      // context made. Looked up at run time: the program links no libcuda.
      void *cu = dlopen("libcuda.so.1", RTLD_NOW);
      int (*init)(unsigned) = cu ? (int (*)(unsigned))dlsym(cu, "cuInit") : 0;
      OUT("CUINIT rc=%d\n", init ? init(0) : -1);
    }
    OUT("READY role=warm wall=%.6f\n", wall());
    warm = mpsr_state_before_cuda ? mpsr_state_before_cuda() : 0;
    released = wall();
    if (warm < 0) { OUT("READY_ERROR %s\n", mpsr_state_last_error()); return 1; }
  }
  cudaError_t e = cudaFree(0);
  if (e) { OUT("INIT_ERROR %d %s\n", (int)e, cudaGetErrorString(e)); return 1; }
  double ctx = wall();
  void *p; int origin = 0;
  size_t bytes = mib << 20;
  if (idle) {
    // The cost case: a waiting standby with memory of its own (no keeper, no registered task).
    if (cudaMalloc(&p, bytes) || cudaMemset(p, 0, bytes)) { OUT("MALLOC_ERROR\n"); return 1; }
  } else if (mpsr_state_attach("state", bytes, &p, &origin)) {
    OUT("ATTACH_ERROR %s\n", mpsr_state_last_error());
    return 1;
  }
  double attached = wall();
  unsigned *gen = (unsigned *)p, *d = gen + 64;  // the counter in its own 256-byte line
  size_t n = bytes / 4 - 64;
  unsigned long long *cnt;
  cudaMalloc(&cnt, 2 * sizeof(unsigned long long));
  // A new allocation is zeroed by the keeper: generation 0, every word 0, already consistent
  // (so neither incarnation initializes it, whichever attached first).
  // Warm-up: the kernels are loaded and the context is set up before anyone waits on it. An
  // incarnation after a fault (a released warm standby, a restart) skips it: nobody waits on
  // it, and its first kernel below is the same check (a real app would not check twice).
  bool restarted = getenv("MPSR_RESTARTS") && atoi(getenv("MPSR_RESTARTS")) > 0;
  bool after_fault = warm == 1 || restarted;
  if (!after_fault) {
    cudaMemset(cnt, 0, 16);
    check<<<264, 256>>>(gen, d, n, cnt);
    e = cudaDeviceSynchronize();
    if (e) { OUT("WARMUP_ERROR %d %s\n", (int)e, cudaGetErrorString(e)); return 1; }
  }
  if (!warm) OUT("READY role=%s origin=%d wall=%.6f\n", role_env(), origin, wall());
  int r = mpsr_state_ready();
  if (!warm) released = wall();
  if (r < 0) { OUT("READY_ERROR %s\n", mpsr_state_last_error()); return 1; }
  const char *how = (r == 1 || warm == 1) ? "takeover" : (restarted ? "restart" : "start");
  // The first kernel on the kept state: check it, and redo a step the fault interrupted.
  unsigned long long h[2];
  cudaMemset(cnt, 0, 16);
  check<<<264, 256>>>(gen, d, n, cnt);
  e = cudaMemcpy(h, cnt, 16, cudaMemcpyDeviceToHost);
  double done = wall();
  unsigned g = 0;
  cudaMemcpy(&g, gen, 4, cudaMemcpyDeviceToHost);
  if (e) { OUT("KEEP_ERROR %d %s wall=%.6f\n", (int)e, cudaGetErrorString(e), wall()); return 1; }
  int redo = h[1] > 0;
  if (redo) { fill<<<264, 256>>>(d, n, g + 1); bump<<<1, 1>>>(gen); }
  OUT("FIRST_KERNEL how=%s released=%.6f done=%.6f gen=%u bad=%llu redo=%d began=%.6f ctx=%.6f attached=%.6f\n",
      how, released, done, g, h[0], redo, began, ctx, attached);
  double end = wall() + secs;
  while (wall() < end) {
    if (idle) { usleep(100000); continue; }
    cudaMemcpy(&g, gen, 4, cudaMemcpyDeviceToHost);
    fill<<<264, 256>>>(d, n, g + 1);
    bump<<<1, 1>>>(gen);
    e = cudaDeviceSynchronize();
    if (e) { OUT("KEEP_ERROR %d %s wall=%.6f\n", (int)e, cudaGetErrorString(e), wall()); return 1; }
  }
  OUT("DONE\n");
  return 0;
}

static int fault(const char *mode, double delay) {
  cudaError_t e = cudaFree(0);
  if (e) { OUT("INIT_ERROR %d %s\n", (int)e, cudaGetErrorString(e)); return 1; }
  char *m;
  cudaMalloc(&m, 64);
  usleep((useconds_t)(delay * 1e6));
  OUT("FAULTING wall=%.6f\n", wall());
  if (!strcmp(mode, "illegal")) store_to<<<1, 1>>>((int *)0x10);
  else if (!strcmp(mode, "trap")) trap_kernel<<<1, 1>>>();
  else misaligned<<<1, 1>>>(m);
  e = cudaDeviceSynchronize();
  OUT("FAULTER %d %s wall=%.6f\n", (int)e, cudaGetErrorString(e), wall());
  return 1;
}

int main(int argc, char **argv) {
  if (argc >= 4 && !strcmp(argv[1], "serve")) return serve(atol(argv[2]), atof(argv[3]), argc > 4 && !strcmp(argv[4], "idle"));
  if (argc >= 4 && !strcmp(argv[1], "fault")) return fault(argv[2], atof(argv[3]));
  fprintf(stderr, "see the header comment\n");
  return 2;
}
