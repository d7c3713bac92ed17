/* mps-resilient driver patch: pure logic of the mpsr-isolate line (see mpsr_isolate.h).
 * SPDX-License-Identifier: MIT */
#include "mpsr_isolate.h"

#ifdef __KERNEL__
#include <linux/kernel.h>
#include <linux/string.h>
#else
#include <stdio.h>
#include <string.h>
#endif

static const char *or_dash(const char *s)
{
	return (s && s[0]) ? s : "-";
}

/* Engine, access and type names come from the driver's tables; they never hold spaces or '=',
 * but a word is enforced anyway: the agent splits the line on spaces. */
static void word(char *out, size_t len, const char *s)
{
	size_t i;

	s = or_dash(s);
	for (i = 0; i + 1 < len && s[i]; i++)
		out[i] = (s[i] == ' ' || s[i] == '=' || s[i] < 0x21 || s[i] > 0x7e) ? '_' : s[i];
	out[i] = '\0';
}

void mpsr_isolate_sanitize_comm(char *out, const char *comm)
{
	word(out, MPSR_COMM_MAX, comm);
}

int mpsr_isolate_format(char *buf, size_t len, const struct mpsr_isolate_fault *f)
{
	char comm[MPSR_COMM_MAX], engine[32], access[32], type[48];
	int n;

	if (!buf || !f || len == 0)
		return -1;
	mpsr_isolate_sanitize_comm(comm, f->comm);
	word(engine, sizeof(engine), f->engine);
	word(access, sizeof(access), f->access);
	word(type, sizeof(type), f->type);
	n = snprintf(buf, len,
		     "mpsr-isolate (PCI:%04x:%02x:%02x): xid=%u culprit_pid=%d contained=%d engine=%s veid=%u addr=0x%llx access=%s type=%s comm=%s",
		     f->pci_domain, f->pci_bus, f->pci_device, f->xid, f->culprit_pid,
		     f->contained ? 1 : 0, engine, f->veid, (unsigned long long)f->address, access,
		     type, comm);
	if (n < 0 || (size_t)n >= len) {
		buf[0] = '\0';
		return -1;
	}
	return n;
}

void mpsr_rate_init(struct mpsr_rate *r, u32 burst, u64 interval_ns, u64 now_ns)
{
	r->interval_ns = interval_ns ? interval_ns : 1;
	r->burst = burst;
	r->tokens = burst;
	r->last_ns = now_ns;
	r->suppressed = 0;
}

int mpsr_rate_allow(struct mpsr_rate *r, u64 now_ns)
{
	if (now_ns > r->last_ns) {
		u64 refill = (now_ns - r->last_ns) / r->interval_ns;

		if (refill > 0) {
			u64 t = (u64)r->tokens + refill;

			r->tokens = t > r->burst ? r->burst : (u32)t;
			r->last_ns += refill * r->interval_ns;
		}
	}
	if (r->tokens == 0) {
		r->suppressed++;
		return 0;
	}
	r->tokens--;
	return 1;
}
