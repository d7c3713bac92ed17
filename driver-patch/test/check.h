/* The driver patch's user-space unit tests' one check macro and verdict (test_mpsr_*.c).
 * SPDX-License-Identifier: MIT */
#ifndef MPSR_TEST_CHECK_H
#define MPSR_TEST_CHECK_H

#include <stdio.h>

static int failures;

#define CHECK(cond, what)                                                        \
	do {                                                                     \
		if (!(cond)) {                                                   \
			fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, what); \
			failures++;                                              \
		}                                                                \
	} while (0)

/* main's exit status: 0 when every check passed. */
static inline int check_verdict(const char *name)
{
	if (failures) {
		fprintf(stderr, "%s: %d check(s) failed\n", name, failures);
		return 1;
	}
	printf("%s: all checks passed\n", name);
	return 0;
}

#endif
