/* mps-resilient driver patch: culprit attribution of fatal GPU faults in nvidia-uvm.
 * SPDX-License-Identifier: MIT */
#ifndef __UVM_MPSR_H__
#define __UVM_MPSR_H__

#include "uvm_forward_decl.h"
#include "mpsr_isolate.h"

/* Kept in each VA space: who created it (under MPS, the client process) and whether its fatal
 * fault was reported already. */
typedef struct {
	int tgid;
	char comm[MPSR_COMM_MAX];
	unsigned long reported;
} uvm_mpsr_va_space_t;

/* Called in the creating process's context (open/UVM_INITIALIZE of /dev/nvidia-uvm). */
void uvm_mpsr_va_space_init(uvm_mpsr_va_space_t *m);

/* A fatal fault of `entry` is about to be cancelled (or was contained): prints the mpsr-isolate
 * line for its VA space, once per VA space and rate limited, if uvm_mpsr_attribution=1. */
void uvm_mpsr_report_fatal(uvm_parent_gpu_t *parent_gpu, uvm_va_space_t *va_space,
			   const uvm_fault_buffer_entry_t *entry, int contained);

#endif
