/* User-space unit test of driver-patch/src/mpsr_contain.c (built and run by driver-patch/build.sh
 * and scripts/test.sh). SPDX-License-Identifier: MIT */
#include "../src/mpsr_contain.h"
#include "check.h"

#include <stdio.h>
#include <string.h>


static struct mpsr_contain_query containable(void)
{
	struct mpsr_contain_query q = {
		.enabled = 1, .engine_graphics = 1, .invalid_address = 1, .unmapped = 1, .ats = 0, .shared_tsg = 1,
	};
	return q;
}

static void test_decide(void)
{
	struct mpsr_budget b = { 0, 0 };
	struct mpsr_contain_query q = containable();

	CHECK(mpsr_contain_decide(&q, &b, 16) == MPSR_CONTAIN, "a wild graphics access is contained");
	q.enabled = 0;
	CHECK(mpsr_contain_decide(&q, &b, 16) == MPSR_NO_DISABLED, "off unless the parameter is 1");
	q = containable();
	q.engine_graphics = 0;
	CHECK(mpsr_contain_decide(&q, &b, 16) == MPSR_NO_ENGINE, "copy-engine faults are not");
	q = containable();
	q.invalid_address = 0;
	CHECK(mpsr_contain_decide(&q, &b, 16) == MPSR_NO_REASON, "OOM/permission reasons are not");
	q = containable();
	q.unmapped = 0;
	CHECK(mpsr_contain_decide(&q, &b, 16) == MPSR_NO_TYPE, "write to read-only is not");
	q = containable();
	q.ats = 1;
	CHECK(mpsr_contain_decide(&q, &b, 16) == MPSR_NO_ATS, "ATS spaces are not");
	q = containable();
	q.shared_tsg = 0;
	CHECK(mpsr_contain_decide(&q, &b, 16) == MPSR_NO_ALONE,
	      "a process alone in its TSG (no MPS) gets the cancel that ends only itself");
	q = containable();
	b.used = 16;
	CHECK(mpsr_contain_decide(&q, &b, 16) == MPSR_NO_BUDGET, "budget spent");
	b.used = 15;
	CHECK(mpsr_contain_decide(&q, &b, 16) == MPSR_CONTAIN, "last of the budget");
	CHECK(mpsr_contain_decide(&q, &b, 0) == MPSR_NO_BUDGET, "budget 0 contains nothing");
	b.failed = 1;
	CHECK(mpsr_contain_decide(&q, &b, 16) == MPSR_NO_FAILED, "a failed mapping ends containment");
	CHECK(mpsr_contain_decide(NULL, &b, 16) == MPSR_NO_DISABLED, "no query");
	CHECK(mpsr_contain_decide(&q, NULL, 16) == MPSR_NO_DISABLED, "no budget");
	CHECK(strcmp(mpsr_verdict_name(MPSR_NO_BUDGET), "budget") == 0, "verdict names");
	CHECK(strcmp(mpsr_verdict_name((enum mpsr_verdict)99), "unknown") == 0, "unknown verdict");
}

static void test_defer(void)
{
	struct mpsr_deferred d;
	unsigned i;

	memset(&d, 0, sizeof(d));
	CHECK(!mpsr_defer_apply(&d), "nothing deferred, nothing to map");
	CHECK(mpsr_defer_add(&d, 0x1000) == MPSR_DEFER_ADDED, "first page");
	CHECK(mpsr_defer_apply(&d), "a deferred page is mapped at the end of the pass");
	d.cancelled = 1;
	CHECK(!mpsr_defer_apply(&d), "another entry was cancelled: the TSG goes down anyway");
	d.cancelled = 0;
	CHECK(mpsr_defer_add(&d, 0x1000) == MPSR_DEFER_DUPLICATE, "same page from another warp");
	CHECK(d.n == 1, "one entry per page");
	for (i = 1; i < MPSR_DEFER_MAX; i++)
		CHECK(mpsr_defer_add(&d, 0x1000 + i * 0x1000ULL) == MPSR_DEFER_ADDED, "room");
	CHECK(mpsr_defer_add(&d, 0x999000) == MPSR_DEFER_FULL, "full: stock cancel");
	CHECK(mpsr_defer_add(&d, 0x2000) == MPSR_DEFER_DUPLICATE, "full, but a duplicate is still one");
	CHECK(d.n == MPSR_DEFER_MAX, "bounded");
}

/* A VA space with ranges [lo, hi] (inclusive). */
struct space {
	unsigned n;
	u64 lo[4], hi[4];
	u64 limit;
};

static int space_free(u64 start, u64 end, void *ctx)
{
	const struct space *s = ctx;
	unsigned i;

	if (end >= s->limit)
		return 0;
	for (i = 0; i < s->n; i++)
		if (start <= s->hi[i] && s->lo[i] <= end)
			return 0;
	return 1;
}

#define K4 0x1000ULL
#define M2 0x200000ULL

static void test_region(void)
{
	struct space s = { 0, { 0 }, { 0 }, 1ULL << 49 };
	u64 start = 0, size = 0;

	/* Nothing around: the whole 2 MiB block, one mapping for a kernel walking off its buffer. */
	CHECK(mpsr_contain_region(0x7f0000012345ULL, K4, M2, space_free, &s, &start, &size) == 0,
	      "empty space");
	CHECK(start == 0x7f0000000000ULL && size == M2, "2 MiB block");

	/* A buffer ends just below: the largest aligned free block above it. */
	s.n = 1;
	s.lo[0] = 0x7f0000000000ULL;
	s.hi[0] = 0x7f00000fffffULL;
	CHECK(mpsr_contain_region(0x7f0000100010ULL, K4, M2, space_free, &s, &start, &size) == 0,
	      "after a buffer");
	CHECK(start == 0x7f0000100000ULL && size == 0x100000ULL, "1 MiB block after it");

	/* Ranges on both sides of one free page. */
	s.n = 2;
	s.lo[0] = 0x10000000ULL;
	s.hi[0] = 0x10000fffULL;
	s.lo[1] = 0x10002000ULL;
	s.hi[1] = 0x10002fffULL;
	CHECK(mpsr_contain_region(0x10001800ULL, K4, M2, space_free, &s, &start, &size) == 0,
	      "one free page");
	CHECK(start == 0x10001000ULL && size == K4, "just the page");

	/* The address itself is covered: nothing (the fault was not an unmapped one after all). */
	CHECK(mpsr_contain_region(0x10000010ULL, K4, M2, space_free, &s, &start, &size) == -1,
	      "covered page");

	/* Beyond what the GPU addresses. */
	CHECK(mpsr_contain_region(1ULL << 50, K4, M2, space_free, &s, &start, &size) == -1,
	      "outside the GPU's VA");

	/* The top of a 64-bit space does not wrap. */
	s.limit = ~0ULL;
	s.n = 0;
	CHECK(mpsr_contain_region(~0ULL - 5, K4, M2, space_free, &s, &start, &size) == -1 ||
		      start + size - 1 >= start,
	      "no wrap at the top");

	/* A bad max size or page size. */
	s.limit = 1ULL << 49;
	CHECK(mpsr_contain_region(0x5000, K4, 3, space_free, &s, &start, &size) == 0 && size == K4,
	      "max not a power of two: the page");
	CHECK(mpsr_contain_region(0x5000, 3, M2, space_free, &s, &start, &size) == -1, "bad page");
	CHECK(mpsr_contain_region(0x5000, K4, M2, NULL, &s, &start, &size) == -1, "no callback");
}

static void test_bits(void)
{
	CHECK(mpsr_region_covers(0x200000, M2, 0x3ff000), "last page of a block");
	CHECK(!mpsr_region_covers(0x200000, M2, 0x400000), "first page after it");
	CHECK(!mpsr_region_covers(0x200000, M2, 0x1ff000), "last page before it");
	CHECK(!mpsr_region_covers(0x200000, 0, 0x200000), "an empty block holds nothing");
	CHECK(mpsr_region_covers(~0ULL - K4 + 1, K4, ~0ULL - K4 + 1), "the top page, no wrap");
	CHECK(mpsr_report_bit(1) != mpsr_report_bit(0), "contained and not contained print once each");
}

int main(void)
{
	test_decide();
	test_defer();
	test_region();
	test_bits();
	return check_verdict("mpsr_contain");
}
