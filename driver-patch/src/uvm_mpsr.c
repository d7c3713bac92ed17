/* mps-resilient driver patch: culprit attribution of fatal GPU faults in nvidia-uvm.
 *
 * Under MPS the kernel's Xid line names the wrong process (the channel's allocator: the first
 * client for Xid 31, the MPS server for Xid 43). nvidia-uvm is the one open place that knows the
 * faulting subcontext's VA space, and a VA space is created by its client process. This prints,
 * before the cancel that makes the firmware report the Xid:
 *
 *   NVRM: mpsr-isolate (PCI:0000:00:06): xid=31 culprit_pid=N contained=0 engine=... comm=...
 *
 * for the node agent (node-agent/src/kmsg.rs), with contained=1 when uvm_mpsr_contain.c mapped the
 * fault instead. Off unless uvm_mpsr_attribution=1.
 * SPDX-License-Identifier: MIT */
#include "uvm_mpsr.h"

#include "uvm_common.h"
#include "uvm_gpu.h"
#include "uvm_hal_types.h"
#include "uvm_va_space.h"

#include <linux/bitops.h>
#include <linux/ktime.h>
#include <linux/pci.h>
#include <linux/sched.h>
#include <linux/spinlock.h>

static unsigned int uvm_mpsr_attribution = 0;
module_param(uvm_mpsr_attribution, uint, S_IRUGO);
MODULE_PARM_DESC(uvm_mpsr_attribution,
		 "mps-resilient: 1 = print an 'NVRM: mpsr-isolate' line naming the process of each fatal "
		 "MMU fault (once per VA space, at most 20 lines per second); 0 = off (default)");

/* At most a burst of 20 lines, then one per 50 ms, for the whole module. */
#define MPSR_RATE_BURST 20
#define MPSR_RATE_INTERVAL_NS (50ULL * 1000 * 1000)

static DEFINE_SPINLOCK(mpsr_rate_lock);
static struct mpsr_rate mpsr_rate;
static int mpsr_rate_ready;

/* The fault's reason is the process's own access (a wild or forbidden address), not the
 * driver's state (OOM, an internal error) that makes it cancel a whole batch. */
static int own_access(UvmEventFatalReason reason)
{
	switch (reason) {
	case UvmEventFatalReasonInvalidAddress:
	case UvmEventFatalReasonInvalidPermissions:
	case UvmEventFatalReasonInvalidFaultType:
	case UvmEventFatalReasonInvalidOperation:
		return 1;
	default:
		return 0;
	}
}

bool uvm_mpsr_attribution_enabled(void)
{
	return uvm_mpsr_attribution != 0;
}

void uvm_mpsr_va_space_init(uvm_mpsr_va_space_t *m)
{
	m->tgid = task_tgid_nr(current);
	get_task_comm(m->comm, current);
	m->reported = 0;
	m->budget.used = 0;
	m->budget.failed = 0;
}

void uvm_mpsr_report_fatal(uvm_parent_gpu_t *parent_gpu, uvm_va_space_t *va_space,
			   const uvm_fault_buffer_entry_t *entry, int contained)
{
	struct mpsr_isolate_fault f;
	char line[MPSR_ISOLATE_LINE_MAX];
	unsigned long flags;
	int allow;

	if (!uvm_mpsr_attribution || !va_space || !entry || !parent_gpu || !parent_gpu->pci_dev)
		return;
	if (!mpsr_isolate_attributable(entry->is_fatal, own_access(entry->fatal_reason)))
		return;
	/* Once per VA space and outcome: the first fatal fault is the one that names the culprit;
	 * a contained culprit whose containment runs out is named once more, not contained. */
	if (test_and_set_bit(mpsr_report_bit(contained), &va_space->mpsr.reported))
		return;

	spin_lock_irqsave(&mpsr_rate_lock, flags);
	if (!mpsr_rate_ready) {
		mpsr_rate_init(&mpsr_rate, MPSR_RATE_BURST, MPSR_RATE_INTERVAL_NS, ktime_get_ns());
		mpsr_rate_ready = 1;
	}
	allow = mpsr_rate_allow(&mpsr_rate, ktime_get_ns());
	spin_unlock_irqrestore(&mpsr_rate_lock, flags);
	if (!allow)
		return;

	f.pci_domain = pci_domain_nr(parent_gpu->pci_dev->bus);
	f.pci_bus = parent_gpu->pci_dev->bus->number;
	f.pci_device = PCI_SLOT(parent_gpu->pci_dev->devfn);
	/* An MMU fault: the firmware reports it as Xid 31. */
	f.xid = 31;
	f.culprit_pid = va_space->mpsr.tgid;
	f.contained = contained;
	f.engine = uvm_mmu_engine_type_string(entry->fault_source.mmu_engine_type);
	f.veid = entry->fault_source.ve_id;
	f.address = entry->fault_address;
	f.access = uvm_fault_access_type_string(entry->fault_access_type);
	f.type = uvm_fault_type_string(entry->fault_type);
	f.comm = va_space->mpsr.comm;
	if (mpsr_isolate_format(line, sizeof(line), &f) > 0)
		printk(KERN_ERR "NVRM: %s\n", line);
}
