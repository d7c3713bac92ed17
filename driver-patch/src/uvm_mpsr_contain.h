/* mps-resilient driver patch, phase B: containment of MMU faults on unmapped addresses in
 * nvidia-uvm (replayable faults of the graphics engine).
 * SPDX-License-Identifier: MIT */
#ifndef __UVM_MPSR_CONTAIN_H__
#define __UVM_MPSR_CONTAIN_H__

#include "uvm_forward_decl.h"
#include "mpsr_contain.h"

#include <linux/string.h>

/* The fatal faults of one VA space deferred in one pass of service_fault_batch_for_cancel(): the
 * pages (pure logic) and, at the same index, the fault entry each came from (valid until the
 * fault buffer is fetched again, i.e. through the replay that ends the pass). */
typedef struct {
	struct mpsr_deferred pages;
	uvm_fault_buffer_entry_t *entry[MPSR_DEFER_MAX];
} uvm_mpsr_deferred_t;

static inline void uvm_mpsr_deferred_init(uvm_mpsr_deferred_t *d)
{
	memset(d, 0, sizeof(*d));
}

/* Instead of cancel_fault_precise_va() for a fatal `entry` of `va_space` (VA space lock held
 * for read). true: nothing to cancel now (deferred, or a duplicate of a deferred page); false:
 * cancel it as the stock driver does. Always false unless uvm_mpsr_containment=1. */
bool uvm_mpsr_contain_defer(uvm_gpu_t *gpu, uvm_va_space_t *va_space,
			    uvm_fault_buffer_entry_t *entry, uvm_mpsr_deferred_t *d);

/* After the VA space lock was dropped and before the replay: maps each deferred page (and the
 * free block around it) to a zeroed scratch page of its own and reports the fault contained. A
 * page that cannot be mapped ends containment in this VA space: its replay faults again and is
 * cancelled then, reported with contained=0. */
void uvm_mpsr_contain_apply(uvm_gpu_t *gpu, uvm_va_space_t *va_space, uvm_mpsr_deferred_t *d);

#endif
