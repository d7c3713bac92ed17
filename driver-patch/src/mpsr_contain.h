/* mps-resilient driver patch, phase B: the pure logic of MMU-fault containment (which fatal fault
 * may be contained, the per-VA-space budget, the faults deferred in one servicing pass, the
 * region a scratch mapping covers), without kernel headers, so that the same file is built into
 * nvidia-uvm.ko and into a user-space unit test (driver-patch/test/test_mpsr_contain.c).
 * SPDX-License-Identifier: MIT */
#ifndef MPSR_CONTAIN_H
#define MPSR_CONTAIN_H

#ifdef __KERNEL__
#include <linux/types.h>
#else
#include <stddef.h>
#include <stdint.h>
typedef uint64_t u64;
typedef uint32_t u32;
#endif

/* What nvidia-uvm knows of a fatal replayable fault when it is about to cancel it. */
struct mpsr_contain_query {
	/* uvm_mpsr_containment=1 */
	int enabled;
	/* From the graphics engine (SM/GPC): the access of one warp of one client. Copy-engine and
	 * host faults are not replayable this way and are never contained. */
	int engine_graphics;
	/* The driver found nothing mapped there (fatal reason InvalidAddress) ... */
	int invalid_address;
	/* ... and the MMU says so (fault type INVALID_PDE or INVALID_PTE), not a permission,
	 * atomic or privilege violation on something that is mapped. */
	int unmapped;
	/* The GPU's MMU translates through the CPU's page tables (ATS): an address with no UVM range
	 * may still be the CPU's, so nothing is mapped over it. (HMM is fine: a fault there with
	 * reason invalid address found no CPU mapping either, and a new range reclaims HMM blocks.) */
	int ats;
	/* The faulting channel's TSG holds another VA space's subcontext (under MPS: another client
	 * of the server): only then does the cancel hurt anyone but the culprit. A process alone in
	 * its TSG gets the stock cancel, which ends just its own context, rather than run on with
	 * scratch data. */
	int shared_tsg;
};

/* Per VA space. Written only under the VA space lock taken for write (mapping time); read
 * without it at decision time, where a stale value only makes the later check under the lock
 * refuse. */
struct mpsr_budget {
	/* Scratch mappings made in this VA space. */
	u32 used;
	/* A mapping failed: every later fatal fault of this VA space gets the stock cancel. */
	u32 failed;
};

enum mpsr_verdict {
	MPSR_CONTAIN = 0,
	MPSR_NO_DISABLED,
	MPSR_NO_ENGINE,
	MPSR_NO_REASON,
	MPSR_NO_TYPE,
	MPSR_NO_ATS,
	MPSR_NO_ALONE,
	MPSR_NO_BUDGET,
	MPSR_NO_FAILED,
};

/* Whether this fatal fault may be contained instead of cancelled; `max` is the budget
 * (uvm_mpsr_contain_budget, mappings per VA space; 0 contains nothing). */
enum mpsr_verdict mpsr_contain_decide(const struct mpsr_contain_query *q,
				      const struct mpsr_budget *b, u32 max);

/* For the log: a word naming the verdict. */
const char *mpsr_verdict_name(enum mpsr_verdict v);

/* The fatal faults of one VA space deferred in one servicing pass (instead of their cancels),
 * one entry per page: the warps of a kernel that all hit the same bad page are one fault. */
#define MPSR_DEFER_MAX 8
struct mpsr_deferred {
	u32 n;
	/* Another fatal entry of the VA space got the stock cancel in this pass: the TSG goes down
	 * anyway, so nothing is mapped and nothing is reported contained. */
	u32 cancelled;
	u64 page[MPSR_DEFER_MAX];
};

enum mpsr_defer_result {
	/* A new page: the caller keeps its fault entry at index (n - 1). */
	MPSR_DEFER_ADDED = 0,
	/* The page is deferred already: this entry is a duplicate, nothing to cancel. */
	MPSR_DEFER_DUPLICATE,
	/* No room: the caller cancels this entry (stock). */
	MPSR_DEFER_FULL,
};

enum mpsr_defer_result mpsr_defer_add(struct mpsr_deferred *d, u64 page);

/* Whether the deferred pages are to be mapped at the end of the pass. */
static inline int mpsr_defer_apply(const struct mpsr_deferred *d)
{
	return d->n > 0 && !d->cancelled;
}

/* The region a scratch mapping covers: the largest naturally aligned block of at most
 * `max_size` bytes (a power of two, >= page) that holds `addr` and is free (no range of the VA
 * space overlaps it, and the GPU can address it), else the page alone if that is free. Mapping
 * the whole block to one scratch page means a kernel walking off its buffer costs one mapping per
 * block, not one per page. `is_free(start, end_inclusive, ctx)` answers for the VA space.
 * Returns 0 and fills start/size, or -1 when not even the page is free. */
int mpsr_contain_region(u64 addr, u64 page, u64 max_size,
			int (*is_free)(u64 start, u64 end, void *ctx), void *ctx,
			u64 *start, u64 *size);

/* Whether a mapped block [start, start + size) holds `page`. */
static inline int mpsr_region_covers(u64 start, u64 size, u64 page)
{
	return size > 0 && page >= start && page - start < size;
}

/* Which report a VA space may still print: bit 0 for the contained=1 line, bit 1 for the
 * contained=0 line. Each is printed once, so a contained culprit whose containment later runs out
 * is reported once more, as not contained. */
static inline int mpsr_report_bit(int contained)
{
	return contained ? 0 : 1;
}

#endif
