/* mps-resilient driver patch, phase B: containment of MMU faults on unmapped addresses.
 *
 * The stock driver answers a fatal replayable fault with a precise cancel; the SM gets a NACK,
 * raises a GR exception, and the GSP firmware tears down the whole TSG: under MPS every client of
 * the server dies (Xid 31). For a graphics-engine access to an address nothing is mapped at, this
 * maps a zeroed scratch page there instead (uvm_va_range_create_mpsr_scratch(): a
 * SKED-reflected-type range of the VA space whose PTEs all point to it), lets the replay complete
 * the access, and prints `contained=1`: the culprit goes on with wrong data until the node agent
 * ends it (MPS terminate_client, measured to spare the other clients), the other clients never
 * notice. Only where the cancel would hurt another VA space (a shared TSG, i.e. MPS). Budget per
 * VA space; any failure falls back to the stock cancel. Off unless uvm_mpsr_containment=1.
 * SPDX-License-Identifier: MIT */
#include "uvm_mpsr_contain.h"
#include "uvm_mpsr.h"

#include "uvm_common.h"
#include "uvm_gpu.h"
#include "uvm_hal_types.h"
#include "uvm_hmm.h"
#include "uvm_mem.h"
#include "uvm_mmu.h"
#include "uvm_range_tree.h"
#include "uvm_va_range.h"
#include "uvm_va_space.h"
#include "uvm_va_space_mm.h"

static unsigned int uvm_mpsr_containment = 0;
module_param(uvm_mpsr_containment, uint, S_IRUGO);
MODULE_PARM_DESC(uvm_mpsr_containment,
		 "mps-resilient: 1 = contain a graphics-engine MMU fault on an unmapped address to its "
		 "process (map a scratch page, replay, print contained=1) instead of the cancel that "
		 "kills every client of its MPS server; needs uvm_mpsr_attribution=1; 0 = stock cancel "
		 "(default)");

static unsigned int uvm_mpsr_contain_budget = 16;
module_param(uvm_mpsr_contain_budget, uint, S_IRUGO);
MODULE_PARM_DESC(uvm_mpsr_contain_budget,
		 "mps-resilient: scratch mappings per VA space (each up to 2 MiB) before its faults get "
		 "the stock cancel again (default 16)");

/* The largest block one mapping covers: one PDE's worth of 4K PTEs. */
#define MPSR_CONTAIN_BLOCK (2ULL * 1024 * 1024)

static bool unmapped_type(uvm_fault_type_t type)
{
	return type == UVM_FAULT_TYPE_INVALID_PDE || type == UVM_FAULT_TYPE_INVALID_PTE;
}

static bool defer(uvm_gpu_t *gpu, uvm_va_space_t *va_space, uvm_fault_buffer_entry_t *entry,
		  uvm_mpsr_deferred_t *d)
{
	struct mpsr_contain_query q;
	enum mpsr_verdict verdict;
	struct mpsr_budget budget;

	if (!gpu || !va_space || !entry)
		return false;
	/* Containment without the line would leave the culprit running on scratch data unseen:
	 * both parameters must be on. */
	q.enabled = uvm_mpsr_containment && uvm_mpsr_attribution_enabled();
	q.engine_graphics = entry->fault_source.mmu_engine_type == UVM_MMU_ENGINE_TYPE_GRAPHICS;
	q.invalid_address = entry->fatal_reason == UvmEventFatalReasonInvalidAddress;
	q.unmapped = unmapped_type(entry->fault_type);
	/* Pageable access without HMM is ATS. */
	q.ats = uvm_va_space_pageable_mem_access_supported(va_space) && !uvm_hmm_is_enabled(va_space);
	q.shared_tsg = uvm_gpu_fault_entry_tsg_shared(gpu, entry);
	/* Read under the VA space lock for read; written only under it for write. */
	budget = va_space->mpsr.budget;
	verdict = mpsr_contain_decide(&q, &budget, uvm_mpsr_contain_budget);
	if (verdict == MPSR_NO_BUDGET || verdict == MPSR_NO_FAILED)
		/* Containment was on for this VA space and ends here: say why the cancel follows. */
		pr_info_ratelimited("NVRM: mpsr-contain: pid %d: stock cancel (%s)\n",
				    va_space->mpsr.tgid, mpsr_verdict_name(verdict));
	if (verdict != MPSR_CONTAIN)
		return false;
	switch (mpsr_defer_add(&d->pages, entry->fault_address)) {
	case MPSR_DEFER_ADDED:
		d->entry[d->pages.n - 1] = entry;
		return true;
	case MPSR_DEFER_DUPLICATE:
		return true;
	case MPSR_DEFER_FULL:
	default:
		return false;
	}
}

bool uvm_mpsr_contain_defer(uvm_gpu_t *gpu, uvm_va_space_t *va_space,
			    uvm_fault_buffer_entry_t *entry, uvm_mpsr_deferred_t *d)
{
	if (!d)
		return false;
	if (defer(gpu, va_space, entry, d))
		return true;
	/* The caller cancels this entry now. */
	d->pages.cancelled = 1;
	return false;
}

struct region_ctx {
	uvm_gpu_t *gpu;
	uvm_va_space_t *va_space;
};

static int region_free(u64 start, u64 end, void *ctx)
{
	struct region_ctx *c = ctx;

	return uvm_gpu_can_address(c->gpu, start, end - start + 1) &&
	       !uvm_range_tree_iter_first(&c->va_space->va_range_tree, start, end);
}

/* VA space lock held for write. */
static NV_STATUS contain_page(uvm_gpu_t *gpu, uvm_va_space_t *va_space, struct mm_struct *mm,
			      NvU64 addr, u64 *start_out, u64 *size_out)
{
	struct region_ctx ctx = { gpu, va_space };
	uvm_mem_alloc_params_t params = { 0 };
	uvm_gpu_va_space_t *gpu_va_space;
	uvm_mem_t *scratch = NULL;
	u64 start, size;
	NV_STATUS status;

	if (va_space->mpsr.budget.failed || va_space->mpsr.budget.used >= uvm_mpsr_contain_budget)
		return NV_ERR_INSUFFICIENT_RESOURCES;
	gpu_va_space = uvm_gpu_va_space_get(va_space, gpu);
	if (!gpu_va_space)
		return NV_ERR_INVALID_DEVICE;
	if (!uvm_mmu_page_size_supported(&gpu_va_space->page_tables, UVM_PAGE_SIZE_4K))
		return NV_ERR_NOT_SUPPORTED;
	/* Checked again under the lock for write: a range may have been mapped meanwhile (then the
	 * replay simply succeeds or faults as a normal fault). */
	/* With HMM the block around the page may hold CPU memory the GPU reaches through HMM (its
	 * va_blocks are not in the range tree): there only the faulting page, which no vma covers. */
	if (mpsr_contain_region(addr, UVM_PAGE_SIZE_4K,
				uvm_hmm_is_enabled(va_space) ? UVM_PAGE_SIZE_4K : MPSR_CONTAIN_BLOCK,
				region_free, &ctx, &start, &size) != 0)
		return NV_ERR_UVM_ADDRESS_IN_USE;

	/* Zeroed system memory of its own: nothing of another tenant can be read through it. */
	params.size = UVM_PAGE_SIZE_4K;
	params.backing_gpu = NULL;
	params.page_size = UVM_PAGE_SIZE_DEFAULT;
	params.zero = true;
	status = uvm_mem_alloc(&params, &scratch);
	if (status != NV_OK)
		return status;
	status = uvm_mem_map_gpu_phys(scratch, gpu);
	if (status != NV_OK) {
		uvm_mem_free(scratch);
		return status;
	}

	*start_out = start;
	*size_out = size;
	/* The range (uvm_va_range.c, per driver branch) takes the scratch page over. */
	return uvm_va_range_create_mpsr_scratch(va_space, mm, gpu_va_space, start, size, scratch);
}

void uvm_mpsr_contain_apply(uvm_gpu_t *gpu, uvm_va_space_t *va_space, uvm_mpsr_deferred_t *d)
{
	bool mapped[MPSR_DEFER_MAX] = { false };
	u64 start[MPSR_DEFER_MAX] = { 0 }, size[MPSR_DEFER_MAX] = { 0 };
	struct mm_struct *mm;
	NvU32 i, j;

	/* Nothing deferred, or the stock cancel of another entry of this VA space ends the TSG
	 * anyway (reported contained=0): the deferred faults are replayed, fault again and are
	 * cancelled with it. */
	if (!d || !mpsr_defer_apply(&d->pages))
		return;
	/* The VA space outlives this: it cannot be destroyed while its GPU's fault servicing (whose
	 * ISR lock the caller holds) is running. Same lock order as the caller's: mmap lock, then
	 * the VA space lock. */
	mm = uvm_va_space_mm_retain_lock(va_space);
	uvm_va_space_down_write(va_space);
	for (i = 0; i < d->pages.n; i++) {
		NV_STATUS status;
		bool covered = false;

		/* A block mapped for an earlier page of this pass may hold this one too. */
		for (j = 0; j < i && !covered; j++)
			covered = mapped[j] && mpsr_region_covers(start[j], size[j], d->pages.page[i]);
		if (covered)
			continue;
		status = contain_page(gpu, va_space, mm, d->pages.page[i], &start[i], &size[i]);
		if (status == NV_OK) {
			va_space->mpsr.budget.used++;
			mapped[i] = true;
		} else {
			va_space->mpsr.budget.failed = 1;
			pr_err_ratelimited("NVRM: mpsr-contain: VA 0x%llx of pid %d not contained (%s): stock cancel follows\n",
					   d->pages.page[i], va_space->mpsr.tgid,
					   nvstatusToString(status));
		}
	}
	uvm_va_space_up_write(va_space);
	uvm_va_space_mm_release_unlock(va_space, mm);

	for (i = 0; i < d->pages.n; i++)
		if (mapped[i])
			uvm_mpsr_report_fatal(gpu->parent, va_space, d->entry[i], 1);
}
