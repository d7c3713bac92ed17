/* mps-resilient driver patch: the pure logic of the `NVRM: mpsr-isolate` line (formatting, rate
 * limit), without kernel headers, so that the same file is built into nvidia-uvm.ko and into a
 * user-space unit test (driver-patch/test/). SPDX-License-Identifier: MIT */
#ifndef MPSR_ISOLATE_H
#define MPSR_ISOLATE_H

#ifdef __KERNEL__
#include <linux/types.h>
#else
#include <stddef.h>
#include <stdint.h>
typedef uint64_t u64;
typedef uint32_t u32;
#endif

/* Longest line, "NVRM: " excluded. */
#define MPSR_ISOLATE_LINE_MAX 256
/* Room for a process name (TASK_COMM_LEN). */
#define MPSR_COMM_MAX 16

/* One fatal fault attributed to the process that created the faulting VA space. */
struct mpsr_isolate_fault {
	u32 pci_domain, pci_bus, pci_device;
	u32 xid;
	int culprit_pid;
	/* 1: the fault was contained to the culprit; 0: the stock cancel ran. */
	int contained;
	const char *engine;
	u32 veid;
	u64 address;
	const char *access;
	const char *type;
	/* The culprit's process name: user-controlled, so printed last and sanitized. */
	const char *comm;
};

/* Writes the line (without "NVRM: ") into buf: `mpsr-isolate (PCI:dddd:bb:dd): xid=N
 * culprit_pid=N contained=0|1 engine=E veid=N addr=0x... access=A type=T comm=C`. Returns its
 * length, or -1 when it does not fit (nothing is printed then). */
int mpsr_isolate_format(char *buf, size_t len, const struct mpsr_isolate_fault *f);

/* Copies a process name with every character that could break the key=value line (space, '=',
 * control, non-ASCII) replaced by '_'; `out` has MPSR_COMM_MAX bytes. */
void mpsr_isolate_sanitize_comm(char *out, const char *comm);

/* Whether a cancelled fault names a culprit: it was fatal in itself (a global cancel also cancels
 * faults that were not) and its reason was the process's own access (not OOM or an internal
 * error of the driver). */
static inline int mpsr_isolate_attributable(int is_fatal, int own_access)
{
	return is_fatal && own_access;
}

/* Token bucket for the lines of the whole module: at most `burst` at once, one more per
 * `interval_ns`. The caller serializes calls (a spinlock in the kernel). */
struct mpsr_rate {
	u64 interval_ns;
	u32 burst;
	u32 tokens;
	u64 last_ns;
	/* Lines not printed because of the limit. */
	u64 suppressed;
};

void mpsr_rate_init(struct mpsr_rate *r, u32 burst, u64 interval_ns, u64 now_ns);
/* 1: print now; 0: suppressed (counted in r->suppressed). */
int mpsr_rate_allow(struct mpsr_rate *r, u64 now_ns);

#endif
