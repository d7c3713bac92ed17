/* mps-resilient driver patch: culprit attribution of fatal GPU faults in nvidia-uvm.
 * SPDX-License-Identifier: MIT */
#ifndef __UVM_MPSR_H__
#define __UVM_MPSR_H__

#include "uvm_forward_decl.h"
#include "mpsr_isolate.h"
#include "mpsr_contain.h"

/* Kept in each VA space: who created it (under MPS, the client process), which of its reports
 * were printed (bits: mpsr_report_bit), and its containment budget (uvm_mpsr_contain.c). */
typedef struct {
	int tgid;
	char comm[MPSR_COMM_MAX];
	unsigned long reported;
	struct mpsr_budget budget;
} uvm_mpsr_va_space_t;

/* uvm_mpsr_attribution=1 */
bool uvm_mpsr_attribution_enabled(void);

/* Called in the creating process's context (open/UVM_INITIALIZE of /dev/nvidia-uvm). */
void uvm_mpsr_va_space_init(uvm_mpsr_va_space_t *m);

/* A fatal fault of `entry` is about to be cancelled (contained = 0) or was contained (1): prints
 * the mpsr-isolate line for its VA space, once per VA space and value of `contained`, rate
 * limited, if uvm_mpsr_attribution=1. Faults the process's own access did not cause (a global
 * cancel for OOM or an internal error) are not attributed. */
void uvm_mpsr_report_fatal(uvm_parent_gpu_t *parent_gpu, uvm_va_space_t *va_space,
			   const uvm_fault_buffer_entry_t *entry, int contained);

#endif
