// mpsr_probe: small CUDA programs for the GPU proof (tests/gpu/gpu_proof.py).
//   mpsr_probe victim SECONDS     small kernels in a loop; prints READY, then VICTIM_OK or VICTIM_ERROR
//   mpsr_probe illegal|trap|misaligned|assert   one faulting kernel (Xid 31 / 43 / 13+43 / none)
//   mpsr_probe load SECONDS       GPU-bound kernels; prints LOAD_RATE <kernels per second>
//   mpsr_probe idle SECONDS       a context and memory, one kernel, then no CUDA call for SECONDS
//                                 (prints READY), then one more kernel (IDLE_OK or IDLE_ERROR)
//   mpsr_probe rate SECONDS BLOCKS START_UNIX [BURST]   small kernels (BLOCKS x 256 threads), a
//                                 sync after every BURST (default 1) from wall time START_UNIX on;
//                                 prints RATE <kernels per second>
// Every line is flushed so the driver script sees it at once.
#include <cassert>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <cuda_runtime.h>
#include <unistd.h>

__global__ void inc(float *a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) a[i] += 1.0f;
}

__global__ void store_to(int *p) { *p = 42; }

__global__ void trap_kernel() { __trap(); }

__global__ void misaligned(char *p) { *(int *)(p + 1) = 7; }

__global__ void assert_kernel(int x) { assert(x == 0); }

__global__ void burn(float *a, int n, int iters) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = a[i];
  for (int k = 0; k < iters; k++) v = v * 1.000001f + 0.5f;
  a[i] = v;
}

static double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static int report(const char *what, cudaError_t e) {
  printf("%s %d %s\n", what, (int)e, cudaGetErrorString(e));
  fflush(stdout);
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: mpsr_probe victim|load SECONDS | illegal|trap|misaligned|assert\n");
    return 2;
  }
  const char *mode = argv[1];
  double secs = argc > 2 ? atof(argv[2]) : 0.0;
  cudaError_t e = cudaFree(0);  // create the context (attaches to the MPS server)
  if (e != cudaSuccess) return report("INIT_ERROR", e);
  printf("ATTACHED pid %d\n", (int)getpid());
  fflush(stdout);
  if (!strcmp(mode, "victim") || !strcmp(mode, "load")) {
    bool load = !strcmp(mode, "load");
    int n = 1 << 20;
    float *a;
    if ((e = cudaMalloc(&a, n * sizeof(float))) != cudaSuccess) return report("VICTIM_ERROR", e);
    cudaMemset(a, 0, n * sizeof(float));
    double end = now_s() + secs;
    long k = 0;
    bool ready = false;
    double t0 = now_s();
    while (now_s() < end) {
      if (load)
        burn<<<n / 256, 256>>>(a, n, 2000);
      else
        inc<<<n / 256, 256>>>(a, n);
      e = cudaDeviceSynchronize();
      if (e == cudaSuccess) e = cudaGetLastError();
      if (e != cudaSuccess) return report(load ? "LOAD_ERROR" : "VICTIM_ERROR", e);
      k++;
      if (!ready) {
        printf("READY\n");
        fflush(stdout);
        ready = true;
      }
    }
    if (load)
      printf("LOAD_RATE %.3f\n", k / (now_s() - t0));
    else
      printf("VICTIM_OK %ld\n", k);
    fflush(stdout);
    return 0;
  }
  if (!strcmp(mode, "idle")) {
    int n = 1 << 20;
    float *a;
    if ((e = cudaMalloc(&a, n * sizeof(float))) != cudaSuccess) return report("IDLE_ERROR", e);
    inc<<<n / 256, 256>>>(a, n);
    if ((e = cudaDeviceSynchronize()) != cudaSuccess) return report("IDLE_ERROR", e);
    printf("READY\n");
    fflush(stdout);
    usleep((useconds_t)(secs * 1e6));  // not calling CUDA: a fault elsewhere poisons it silently
    inc<<<n / 256, 256>>>(a, n);
    if ((e = cudaDeviceSynchronize()) != cudaSuccess) return report("IDLE_ERROR", e);
    printf("IDLE_OK\n");
    fflush(stdout);
    return 0;
  }
  if (!strcmp(mode, "rate")) {
    int blocks = argc > 3 ? atoi(argv[3]) : 66;
    double start = argc > 4 ? atof(argv[4]) : 0.0;
    int burst = argc > 5 ? atoi(argv[5]) : 1;
    if (burst < 1) burst = 1;
    int n = blocks * 256;
    float *a;
    if ((e = cudaMalloc(&a, n * sizeof(float))) != cudaSuccess) return report("RATE_ERROR", e);
    cudaMemset(a, 0, n * sizeof(float));
    burn<<<blocks, 256>>>(a, n, 1);  // warm up
    cudaDeviceSynchronize();
    printf("READY\n");
    fflush(stdout);
    // Every client starts at the same wall-clock moment so their runs overlap fully.
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double wall = ts.tv_sec + ts.tv_nsec / 1e9;
    if (start > wall) usleep((useconds_t)((start - wall) * 1e6));
    double t0 = now_s(), end = t0 + secs;
    long k = 0;
    while (now_s() < end) {
      for (int b = 0; b < burst; b++) burn<<<blocks, 256>>>(a, n, 64);
      if ((e = cudaDeviceSynchronize()) != cudaSuccess) return report("RATE_ERROR", e);
      k += burst;
    }
    printf("RATE %.1f\n", k / (now_s() - t0));
    fflush(stdout);
    return 0;
  }
  // Faulting modes: SECONDS is a delay before the fault (time to register the client).
  usleep((useconds_t)(secs * 1e6));
  if (!strcmp(mode, "illegal")) {
    store_to<<<1, 1>>>((int *)0x10);  // unmapped: MMU fault, Xid 31
  } else if (!strcmp(mode, "trap")) {
    trap_kernel<<<1, 1>>>();  // Xid 43
  } else if (!strcmp(mode, "misaligned")) {
    char *p;
    cudaMalloc(&p, 64);
    misaligned<<<1, 1>>>(p);  // Xid 13 (+43)
  } else if (!strcmp(mode, "assert")) {
    assert_kernel<<<1, 1>>>(1);  // device assert: no Xid
  } else {
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
  }
  e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return report("FAULTER_ERROR", e);
  printf("FAULTER_NO_ERROR\n");
  fflush(stdout);
  return 0;
}
