/* User-space unit test of driver-patch/src/mpsr_isolate.c (built and run by driver-patch/build.sh
 * and scripts/test.sh). SPDX-License-Identifier: MIT */
#include "../src/mpsr_isolate.h"
#include "check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>


static struct mpsr_isolate_fault fault(const char *comm)
{
	struct mpsr_isolate_fault f = {
		.pci_domain = 0, .pci_bus = 0, .pci_device = 6, .xid = 31, .culprit_pid = 901,
		.contained = 0, .engine = "GRAPHICS", .veid = 3, .address = 0x10,
		.access = "WRITE", .type = "INVALID_PDE", .comm = comm,
	};
	return f;
}

static void test_format(void)
{
	char buf[MPSR_ISOLATE_LINE_MAX];
	struct mpsr_isolate_fault f = fault("mpsr_probe");
	int n = mpsr_isolate_format(buf, sizeof(buf), &f);

	CHECK(n > 0, "formats");
	CHECK(strcmp(buf, "mpsr-isolate (PCI:0000:00:06): xid=31 culprit_pid=901 contained=0 "
			  "engine=GRAPHICS veid=3 addr=0x10 access=WRITE type=INVALID_PDE comm=mpsr_probe") == 0,
	      buf);
	CHECK((size_t)n == strlen(buf), "length returned");
	f.contained = 7;
	mpsr_isolate_format(buf, sizeof(buf), &f);
	CHECK(strstr(buf, " contained=1 ") != NULL, "contained is 0 or 1");
}

static void test_hostile_comm(void)
{
	char buf[MPSR_ISOLATE_LINE_MAX];
	/* A process naming itself to fake the agent's fields gets one harmless word, printed last. */
	struct mpsr_isolate_fault f = fault("x contained=1\n");
	mpsr_isolate_format(buf, sizeof(buf), &f);
	CHECK(strstr(buf, " contained=0 ") != NULL, "the real field stays");
	CHECK(strstr(buf, "comm=x_contained_1_") != NULL, buf);
	CHECK(strchr(buf, '\n') == NULL, "no newline");
	char out[MPSR_COMM_MAX];
	mpsr_isolate_sanitize_comm(out, "\xff\x01 ok=");
	CHECK(strcmp(out, "___ok_") == 0, out);
	mpsr_isolate_sanitize_comm(out, "0123456789abcdefXYZ");
	CHECK(strlen(out) == MPSR_COMM_MAX - 1, "truncated to the buffer");
	f = fault(NULL);
	f.engine = NULL;
	mpsr_isolate_format(buf, sizeof(buf), &f);
	CHECK(strstr(buf, "engine=- ") != NULL && strstr(buf, "comm=-") != NULL, buf);
}

static void test_too_small(void)
{
	char buf[40];
	struct mpsr_isolate_fault f = fault("p");
	CHECK(mpsr_isolate_format(buf, sizeof(buf), &f) == -1, "does not fit: -1");
	CHECK(buf[0] == '\0', "and prints nothing");
	CHECK(mpsr_isolate_format(NULL, 10, &f) == -1, "NULL buffer");
	CHECK(mpsr_isolate_format(buf, sizeof(buf), NULL) == -1, "NULL fault");
}

static void test_rate(void)
{
	struct mpsr_rate r;
	int i, allowed = 0;
	const unsigned long long ms = 1000000ULL;

	mpsr_rate_init(&r, 3, 100 * ms, 0);
	for (i = 0; i < 10; i++)
		allowed += mpsr_rate_allow(&r, 0);
	CHECK(allowed == 3, "a burst of 3");
	CHECK(r.suppressed == 7, "7 counted as suppressed");
	CHECK(mpsr_rate_allow(&r, 99 * ms) == 0, "no token before the interval");
	CHECK(mpsr_rate_allow(&r, 100 * ms) == 1, "one token after it");
	CHECK(mpsr_rate_allow(&r, 100 * ms) == 0, "only one");
	/* A long quiet time refills to the burst, not beyond. */
	allowed = 0;
	for (i = 0; i < 10; i++)
		allowed += mpsr_rate_allow(&r, 100000 * ms);
	CHECK(allowed == 3, "refilled to the burst only");
	/* A clock that goes back does not give tokens. */
	CHECK(mpsr_rate_allow(&r, 5 * ms) == 0, "time going back gives nothing");
	mpsr_rate_init(&r, 1, 0, 0);
	CHECK(mpsr_rate_allow(&r, 0) == 1 && r.interval_ns == 1, "zero interval is clamped");
}

int main(void)
{
	test_format();
	test_hostile_comm();
	test_too_small();
	test_rate();
	return check_verdict("mpsr_isolate");
}
