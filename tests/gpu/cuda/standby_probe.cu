// For report_time_probe.py: one small process per role, times on the wall clock (CLOCK_REALTIME).
//   standby_probe work SECONDS    small kernels, a sync after each, until SECONDS pass ("READY" first)
//   standby_probe idle FIFO       a context and memory, "READY", waits for a byte on FIFO, then one
//                                 kernel: "TAKEOVER go <t> first-kernel-done <t>"
//   standby_probe trap DELAY_MS   after DELAY_MS, "FAULTING at <t>" and a __trap kernel (Xid 43)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <unistd.h>
#include <cuda_runtime.h>

__global__ void step(float *a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) a[i] = a[i] * 0.5f + 1.0f;
}
__global__ void trap_kernel() { __trap(); }

static double wall() {
  timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: standby_probe work SECONDS | idle FIFO | trap DELAY_MS\n");
    return 4;
  }
  const int n = 64 * 256;
  float *a;
  cudaError_t e = cudaMalloc(&a, n * sizeof(float));
  if (e) {
    printf("ERR init %d at %.6f\n", e, wall());
    return 2;
  }
  if (!strcmp(argv[1], "work")) {
    double end = wall() + atof(argv[2]);
    printf("READY\n");
    fflush(stdout);
    while (wall() < end) {
      step<<<64, 256>>>(a, n);
      if ((e = cudaDeviceSynchronize())) {
        printf("ERR %d at %.6f\n", e, wall());
        return 1;
      }
    }
    return 0;
  }
  if (!strcmp(argv[1], "idle")) {
    printf("READY\n");
    fflush(stdout);
    int fd = open(argv[2], O_RDONLY);
    char c;
    if (fd < 0 || read(fd, &c, 1) != 1) return 3;
    double go = wall();
    step<<<64, 256>>>(a, n);
    e = cudaDeviceSynchronize();
    printf("TAKEOVER go %.6f first-kernel-done %.6f err %d\n", go, wall(), e);
    return e ? 1 : 0;
  }
  if (!strcmp(argv[1], "trap")) {
    usleep(atoi(argv[2]) * 1000);
    printf("FAULTING at %.6f\n", wall());
    fflush(stdout);
    trap_kernel<<<1, 1>>>();
    e = cudaDeviceSynchronize();
    printf("ERR %d at %.6f\n", e, wall());
    return 1;
  }
  return 4;
}
