/* mps-resilient kept GPU state: C interface (libmpsr_state.so).
 *
 * Inside a job started with --mps-resilient, a process attaches named GPU allocations that the
 * GPU's state keeper (a process outside MPS) holds for the job. When a GPU fault kills the process
 * (with MPS, another job's fault does), the allocations survive: the process restarted in place by
 * mpsr-run, or the requeued job back on the same node within the keep time, attaches them again
 * with their contents intact (*was_restored == 1) and can skip reloading them. Host snapshots
 * (mpsr_state_checkpoint) bring them back after faults that lose GPU memory (*was_restored == 2).
 *
 * Limits: the memory is device 0 of the process (its GPU's MPS server shows one GPU); the keeper
 * enforces a per-job byte quota; names are [A-Za-z0-9._-]{1,64}. Kept memory is an ordinary device
 * pointer for kernels and cudaMemcpy, but not cudaFree-able: use mpsr_state_release.
 *
 * Every function returns 0 or a negative MPSR_E* code; mpsr_state_last_error() says why.
 */
#ifndef MPSR_STATE_H
#define MPSR_STATE_H
#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif

#define MPSR_OK 0
#define MPSR_EINVAL (-1)       /* bad argument */
#define MPSR_EUNAVAILABLE (-2) /* no keeper: not in a protected job, or the keeper is down */
#define MPSR_EREFUSED (-3)     /* not your job's, over quota, or exists with a smaller size */
#define MPSR_ECUDA (-4)        /* importing/mapping the memory failed */
#define MPSR_EPROTO (-5)       /* unexpected reply */

/* Maps the job's allocation `name` of at least `bytes` (created zeroed on first use).
 * *was_restored: 0 new, 1 kept in GPU memory from an earlier process, 2 restored from a snapshot. */
int mpsr_state_attach(const char *name, size_t bytes, void **devptr, int *was_restored);
/* Unmaps it in this process; the keeper keeps it for the job. */
int mpsr_state_detach(const char *name);
/* Copies `name` (NULL: all of the job's allocations) to node-local snapshot files. */
int mpsr_state_checkpoint(const char *name);
/* Frees it for good (keeper memory and snapshot). */
int mpsr_state_release(const char *name);
/* Hot standby (srun --mps-resilient=resume --mps-standby): returns 0 at once in the task's
 * primary process. In its standby (the same program, started by mpsr-run in another MPS server)
 * it blocks until a GPU fault hits the task, then returns 1: the standby is the task from then on.
 * Call it once everything that can be prepared is (imports, CUDA context, model built, kept state
 * attached, one warm-up step: the first kernel after it must not load modules). Negative on error
 * (a standby that cannot wait should exit). Kept state attached before the wait is the primary's
 * memory as the fault left it: a write the fault interrupted may be half done (use read-only
 * state, or write a generation counter last and check it after the takeover). */
int mpsr_state_ready(void);
/* Warm standby (--mps-standby=warm): returns 0 at once in the task's primary process (and in a
 * hot standby). In a warm standby (the same program, started by mpsr-run beside the task) it
 * blocks until a GPU fault hits the task, then returns 1: the standby is the task from then on.
 * Call it after what needs no GPU (imports, reading input, parsing) and BEFORE the first CUDA call
 * (cudaSetDevice, cudaMalloc, a kernel, mpsr_state_attach): a warm standby holds no CUDA context,
 * so it costs no GPU memory and does not delay the driver's fault reports. Released, it creates
 * its context and attaches the kept state. Negative on error (it should exit). A program may call
 * both: mpsr_state_before_cuda() before CUDA, mpsr_state_ready() after its warm-up; each standby
 * waits in its own, and after a takeover both return 1. A warm standby of a program without this
 * call waits in mpsr_state_ready() instead (its CUDA context made by then). */
int mpsr_state_before_cuda(void);
/* Step time: call once at the end of every step of the application's loop (a training
 * iteration, a decode step, a served batch); the first call starts the clock. The agent reads the
 * step times each telemetry round: per-rank step-time skew against the job's other ranks, latency
 * spikes against the rank's own recent steps (a step under way counts as long as it has run: a
 * stall shows before it ends; see mpsr_step_idle), in /metrics (mpsr_rank_step_seconds) and the job's
 * report. A call costs a clock read and a few stores (the first creates /dev/shm/mpsr-steps.<pid>,
 * or under $MPSR_STEP_DIR). Works outside a protected job too (nothing reads it then). */
int mpsr_step(void);
/* No step is under way: call before waiting for requests, writing a checkpoint or evaluating, so
 * the wait is neither a long step nor a stall; the next mpsr_step() starts the clock again. */
int mpsr_step_idle(void);
/* Removes this process's step file; call at a clean exit (the agent removes a dead process's). */
void mpsr_step_finish(void);
/* This thread's last error message. */
const char *mpsr_state_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
