/* mps-resilient driver patch, phase B: pure logic of containment (see mpsr_contain.h).
 * SPDX-License-Identifier: MIT */
#include "mpsr_contain.h"

enum mpsr_verdict mpsr_contain_decide(const struct mpsr_contain_query *q,
				      const struct mpsr_budget *b, u32 max)
{
	if (!q || !b || !q->enabled)
		return MPSR_NO_DISABLED;
	if (!q->engine_graphics)
		return MPSR_NO_ENGINE;
	if (!q->invalid_address)
		return MPSR_NO_REASON;
	if (!q->unmapped)
		return MPSR_NO_TYPE;
	if (q->ats)
		return MPSR_NO_ATS;
	if (!q->shared_tsg)
		return MPSR_NO_ALONE;
	if (b->failed)
		return MPSR_NO_FAILED;
	if (b->used >= max)
		return MPSR_NO_BUDGET;
	return MPSR_CONTAIN;
}

const char *mpsr_verdict_name(enum mpsr_verdict v)
{
	switch (v) {
	case MPSR_CONTAIN: return "contain";
	case MPSR_NO_DISABLED: return "disabled";
	case MPSR_NO_ENGINE: return "engine";
	case MPSR_NO_REASON: return "reason";
	case MPSR_NO_TYPE: return "type";
	case MPSR_NO_ATS: return "ats";
	case MPSR_NO_ALONE: return "alone";
	case MPSR_NO_BUDGET: return "budget";
	case MPSR_NO_FAILED: return "failed";
	}
	return "unknown";
}

enum mpsr_defer_result mpsr_defer_add(struct mpsr_deferred *d, u64 page)
{
	u32 i;

	for (i = 0; i < d->n && i < MPSR_DEFER_MAX; i++)
		if (d->page[i] == page)
			return MPSR_DEFER_DUPLICATE;
	if (d->n >= MPSR_DEFER_MAX)
		return MPSR_DEFER_FULL;
	d->page[d->n++] = page;
	return MPSR_DEFER_ADDED;
}

static int pow2(u64 x)
{
	return x && !(x & (x - 1));
}

int mpsr_contain_region(u64 addr, u64 page, u64 max_size,
			int (*is_free)(u64 start, u64 end, void *ctx), void *ctx,
			u64 *start, u64 *size)
{
	u64 s;

	if (!is_free || !start || !size || !pow2(page))
		return -1;
	if (!pow2(max_size) || max_size < page)
		max_size = page;
	for (s = max_size; s >= page; s >>= 1) {
		u64 base = addr & ~(s - 1);

		/* The top of the address space: base + s would wrap. */
		if (base + s - 1 < base)
			continue;
		if (is_free(base, base + s - 1, ctx)) {
			*start = base;
			*size = s;
			return 0;
		}
	}
	return -1;
}
