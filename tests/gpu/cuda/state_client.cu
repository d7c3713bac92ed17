// state_client: kept-state proof program (tests/gpu/state_proof.py), linked with libmpsr_state.so.
//   state_client keep NAME GIB PAT      attach, fill (if new), then run small kernels until killed
//   state_client verify NAME GIB PAT    attach, verify every element; prints times
//   state_client cold FILE GIB PAT      baseline: read FILE from disk, upload, verify
//   state_client host FILE GIB PAT      baseline: FILE already in (pinned) host memory; upload, verify
//   state_client writefile FILE GIB PAT write the pattern to FILE (for the baselines)
//   state_client bw NAME GIB            bandwidth kernel over kept memory vs cudaMalloc (ratio)
//   state_client checkpoint NAME GIB PAT attach, fill, checkpoint to a host snapshot
// Element i (uint32) = (i * 2654435761u) ^ PAT.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>
#include "mpsr_state.h"

static double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static double wall_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

__global__ void fill(unsigned *p, size_t n, unsigned pat) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (unsigned)(i * 2654435761u) ^ pat;
}
__global__ void check(const unsigned *p, size_t n, unsigned pat, unsigned long long *bad) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    local += p[i] != ((unsigned)(i * 2654435761u) ^ pat);
  if (local) atomicAdd(bad, local);
}
__global__ void copyk(const float4 *a, float4 *b, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) b[i] = a[i];
}
__global__ void spin(float *x) { x[threadIdx.x] += 1.0f; }

#define CK(e) do { cudaError_t _e = (e); if (_e != cudaSuccess) { printf("CUDA_ERROR %d %s at %d\n", (int)_e, cudaGetErrorString(_e), __LINE__); fflush(stdout); return 1; } } while (0)

static unsigned long long verify(const unsigned *p, size_t n, unsigned pat) {
  unsigned long long *bad;
  cudaMalloc(&bad, 8);
  cudaMemset(bad, 0, 8);
  check<<<1056, 512>>>(p, n, pat, bad);
  unsigned long long h = ~0ull;
  cudaMemcpy(&h, bad, 8, cudaMemcpyDeviceToHost);
  cudaFree(bad);
  return h;
}

int main(int argc, char **argv) {
  double t_start = now_ms();
  if (argc < 3) { fprintf(stderr, "see the header comment\n"); return 2; }
  const char *mode = argv[1], *name = argv[2];
  double gib = argc > 3 ? atof(argv[3]) : 1;
  unsigned pat = argc > 4 ? (unsigned)strtoul(argv[4], 0, 0) : 0x5a5a;
  size_t bytes = (size_t)(gib * (1ull << 30)), n = bytes / 4;
  CK(cudaFree(0));
  double t_ctx = now_ms();
  if (!strcmp(mode, "keep") || !strcmp(mode, "verify") || !strcmp(mode, "checkpoint")) {
    void *p = 0;
    int origin = -1;
    double t0 = now_ms();
    int rc = mpsr_state_attach(name, bytes, &p, &origin);
    double t_att = now_ms();
    if (rc) { printf("ATTACH_ERROR %d %s\n", rc, mpsr_state_last_error()); fflush(stdout); return 1; }
    if (!strcmp(mode, "verify")) {
      unsigned long long bad = verify((unsigned *)p, n, pat);
      double t_v = now_ms();
      printf("VERIFIED origin=%d bad=%llu ctx_ms=%.1f attach_ms=%.1f verify_ms=%.1f total_ms=%.1f wall=%.6f\n", origin, bad,
             t_ctx - t_start, t_att - t0, t_v - t_att, t_v - t_start, wall_s());
      fflush(stdout);
      return bad ? 1 : 0;
    }
    if (origin == 0) { fill<<<1056, 512>>>((unsigned *)p, n, pat); CK(cudaDeviceSynchronize()); }
    if (!strcmp(mode, "checkpoint")) {
      double c0 = now_ms();
      rc = mpsr_state_checkpoint(name);
      printf("CHECKPOINT rc=%d ms=%.1f %s\n", rc, now_ms() - c0, rc ? mpsr_state_last_error() : "");
      fflush(stdout);
      return rc ? 1 : 0;
    }
    printf("READY origin=%d attach_ms=%.1f\n", origin, t_att - t0);
    fflush(stdout);
    float *x;
    CK(cudaMalloc(&x, 4096));
    for (;;) {  // busy: a fault on the GPU kills this client
      spin<<<1, 256>>>(x);
      cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) { printf("KEEP_ERROR %d %s wall=%.6f\n", (int)e, cudaGetErrorString(e), wall_s()); fflush(stdout); return 1; }
      usleep(2000);
    }
  }
  if (!strcmp(mode, "writefile")) {
    unsigned *h = (unsigned *)malloc(64 << 20);
    int fd = open(name, O_CREAT | O_TRUNC | O_WRONLY, 0644);
    for (size_t off = 0; off < n; off += (64 << 20) / 4) {
      size_t m = (n - off < (64 << 20) / 4) ? n - off : (64 << 20) / 4;
      for (size_t i = 0; i < m; i++) h[i] = (unsigned)((off + i) * 2654435761u) ^ pat;
      if (write(fd, h, m * 4) != (ssize_t)(m * 4)) { printf("WRITE_ERROR\n"); return 1; }
    }
    fsync(fd);
    close(fd);
    printf("WROTE %zu bytes in %.1f ms\n", bytes, now_ms() - t_start);
    return 0;
  }
  if (!strcmp(mode, "cold") || !strcmp(mode, "host")) {
    // cold: an ordinary restart reads the file into pageable memory and uploads it (all timed,
    // from process start). host: the data is already in pinned host memory (not timed).
    bool host = !strcmp(mode, "host");
    unsigned *h;
    if (host) {
      CK(cudaMallocHost(&h, bytes));
    } else {
      h = (unsigned *)malloc(bytes);
      if (!h) { printf("MALLOC_ERROR\n"); return 1; }
    }
    double t_read0 = now_ms();
    int fd = open(name, O_RDONLY);
    size_t got = 0;
    while (got < bytes) {
      ssize_t r = read(fd, (char *)h + got, bytes - got > (1 << 30) ? (1 << 30) : bytes - got);
      if (r <= 0) break;
      got += r;
    }
    close(fd);
    double t_read = now_ms();
    unsigned *d;
    CK(cudaMalloc(&d, bytes));
    CK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    double t_up = now_ms();
    unsigned long long bad = verify(d, n, pat);
    double t_v = now_ms();
    // "host": the data was already in host memory; count from the upload.
    double total = host ? (t_v - t_read) : (t_v - t_start);
    printf("BASELINE %s read_ms=%.1f upload_ms=%.1f verify_ms=%.1f total_ms=%.1f bad=%llu got=%zu\n", mode, t_read - t_read0,
           t_up - t_read, t_v - t_up, total, bad, got);
    fflush(stdout);
    return bad ? 1 : 0;
  }
  if (!strcmp(mode, "bw")) {
    void *p = 0;
    int origin;
    int rc = mpsr_state_attach(name, bytes, &p, &origin);
    if (rc) { printf("ATTACH_ERROR %d %s\n", rc, mpsr_state_last_error()); return 1; }
    float4 *a, *b, *c;
    CK(cudaMalloc(&a, bytes / 2));
    CK(cudaMalloc(&b, bytes / 2));
    c = (float4 *)p;  // kept memory: second half used as destination
    size_t m = bytes / 2 / sizeof(float4);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    float best_kept = 1e9, best_plain = 1e9;
    for (int r = 0; r < 20; r++) {
      float ms;
      cudaEventRecord(e0);
      copyk<<<2112, 512>>>((const float4 *)c, (float4 *)((char *)p + bytes / 2), m);
      cudaEventRecord(e1);
      CK(cudaEventSynchronize(e1));
      cudaEventElapsedTime(&ms, e0, e1);
      if (ms < best_kept) best_kept = ms;
      cudaEventRecord(e0);
      copyk<<<2112, 512>>>(a, b, m);
      cudaEventRecord(e1);
      CK(cudaEventSynchronize(e1));
      cudaEventElapsedTime(&ms, e0, e1);
      if (ms < best_plain) best_plain = ms;
    }
    double gbs_k = 2.0 * (bytes / 2) / (best_kept * 1e6), gbs_p = 2.0 * (bytes / 2) / (best_plain * 1e6);
    printf("BW kept_GBps=%.1f plain_GBps=%.1f ratio=%.4f\n", gbs_k, gbs_p, gbs_k / gbs_p);
    fflush(stdout);
    return 0;
  }
  fprintf(stderr, "unknown mode %s\n", mode);
  return 2;
}
