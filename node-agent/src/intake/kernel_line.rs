//! Parser for the NVIDIA kernel driver's Xid lines (`NVRM: Xid (...)`) as they appear in `/dev/kmsg`
//! records or `dmesg` output, and for the isolation line of the mps-resilient driver patch.
//!
//! The pid in an Xid line is the channel owner's, which under MPS is *not* the faulting process
//! (KNOWLEDGE.md: Xid 31 named the first client, Xid 43 the MPS server). It is kept only as
//! "reported pid" and never acted on alone.

pub use crate::signal::PciAddr;

/// One parsed kernel line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelLine {
    Xid(KernelXid),
    /// `NVRM: mpsr-isolate (PCI:…): xid=31 culprit_pid=N contained=1` (driver-patch/).
    Isolation {
        pci: PciAddr,
        xid: u32,
        culprit_pid: u32,
        contained: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelXid {
    pub pci: PciAddr,
    /// MIG GPU instance (`GPU-I:05`), if any.
    pub gpu_instance: Option<u32>,
    pub xid: u32,
    /// As printed; `None` for `pid='<unknown>'` or when absent. Unreliable under MPS.
    pub pid: Option<u32>,
    pub name: Option<String>,
    /// The line says it was caused by a previous Xid.
    pub secondary: bool,
    /// Xid 154's new recovery action code (`... changed from 0x0 (None) to 0x2 (...)`).
    pub recovery_code: Option<u32>,
    /// Text after the Xid number, for the log.
    pub detail: String,
}

/// A `/dev/kmsg` record: `pri,seq,ts_usec,flags[,...];message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KmsgRecord<'a> {
    /// syslog facility (`pri >> 3`): 0 is the kernel's own. A record written into /dev/kmsg by
    /// a process gets another one (the kernel turns a claimed 0 into LOG_USER).
    pub facility: u32,
    pub seq: u64,
    pub ts_usec: u64,
    pub message: &'a str,
}

impl KmsgRecord<'_> {
    /// Printed by the kernel (a driver), not written by a process: only those are evidence.
    pub fn from_kernel(&self) -> bool {
        self.facility == 0
    }
}

pub fn parse_kmsg_record(rec: &str) -> Option<KmsgRecord<'_>> {
    let (head, msg) = rec.split_once(';')?;
    let mut f = head.split(',');
    let pri: u32 = f.next()?.trim().parse().ok()?;
    let seq = f.next()?.trim().parse().ok()?;
    let ts_usec = f.next()?.trim().parse().ok()?;
    // Continuation lines of a record start with a space and carry KEY=value dictionary data.
    let message = msg.lines().next().unwrap_or("");
    Some(KmsgRecord {
        facility: pri >> 3,
        seq,
        ts_usec,
        message,
    })
}

/// Parses a message (kmsg payload, or a dmesg/journal line with any prefix before `NVRM:`).
/// Returns `None` for anything that is not an NVRM Xid or isolation line; never panics.
pub fn parse_line(line: &str) -> Option<KernelLine> {
    let at = line.find("NVRM: ")?;
    let rest = &line[at + 6..];
    if let Some(r) = rest.strip_prefix("mpsr-isolate ") {
        return parse_isolation(r);
    }
    let rest = rest.strip_prefix("Xid ")?;
    // "(PCI:0000:00:06): 31, ..." or "(PCI:0000:3b:00 GPU-I:05): ..." or old "(0000:01:00): 79, ..."
    let rest = rest.strip_prefix('(')?;
    let (addr, after) = rest.split_once(')')?;
    let mut words = addr.split_whitespace();
    let pci_word = words.next()?;
    let pci = PciAddr::parse(pci_word.strip_prefix("PCI:").unwrap_or(pci_word))?;
    let mut gpu_instance = None;
    for w in words {
        if let Some(gi) = w.strip_prefix("GPU-I:") {
            gpu_instance = gi.parse().ok();
        }
    }
    let after = after.strip_prefix(':')?.trim_start();
    let num_end = after
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(after.len());
    let xid: u32 = after[..num_end].parse().ok()?;
    let detail = after[num_end..].trim_start_matches(',').trim().to_string();
    let pid = field(&detail, "pid=").and_then(|v| v.parse().ok());
    let name = field(&detail, "name=")
        .filter(|v| *v != "<unknown>")
        .map(str::to_string);
    let lower = detail.to_ascii_lowercase();
    let secondary = lower.contains("previous xid") || lower.contains("due to previous");
    let recovery_code = (xid == 154).then(|| recovery_code(&detail)).flatten();
    Some(KernelLine::Xid(KernelXid {
        pci,
        gpu_instance,
        xid,
        pid,
        name,
        secondary,
        recovery_code,
        detail,
    }))
}

/// The code after `to 0x` in Xid 154's `GPU recovery action changed from 0x0 (None) to 0x2 (Node
/// Reboot Required)`: the number the driver prints, not the words beside it.
fn recovery_code(detail: &str) -> Option<u32> {
    let (_, after) = detail.split_once(" to 0x")?;
    let hex: String = after
        .chars()
        .take_while(|c| c.is_ascii_hexdigit())
        .collect();
    u32::from_str_radix(&hex, 16).ok()
}

/// Value of `key` up to the next `,` or space, with quotes removed.
fn field<'a>(s: &'a str, key: &str) -> Option<&'a str> {
    let mut from = 0;
    while let Some(i) = s[from..].find(key) {
        let start = from + i;
        // Require a word boundary so "ppid=" does not match "pid=".
        let boundary = start == 0
            || !s.as_bytes()[start - 1].is_ascii_alphanumeric() && s.as_bytes()[start - 1] != b'_';
        let v = &s[start + key.len()..];
        if boundary {
            let end = v.find([',', ' ']).unwrap_or(v.len());
            return Some(v[..end].trim_matches('\''));
        }
        from = start + key.len();
    }
    None
}

fn parse_isolation(r: &str) -> Option<KernelLine> {
    let r = r.strip_prefix('(')?;
    let (addr, after) = r.split_once(')')?;
    let pci = PciAddr::parse(addr.strip_prefix("PCI:").unwrap_or(addr))?;
    let after = after.strip_prefix(':')?;
    Some(KernelLine::Isolation {
        pci,
        xid: field(after, "xid=")?.parse().ok()?,
        culprit_pid: field(after, "culprit_pid=")?.parse().ok()?,
        contained: field(after, "contained=") == Some("1"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xid(line: &str) -> KernelXid {
        match parse_line(line) {
            Some(KernelLine::Xid(x)) => x,
            other => panic!("not an xid line: {line:?} -> {other:?}"),
        }
    }

    const PCI6: PciAddr = PciAddr {
        domain: 0,
        bus: 0,
        device: 6,
    };

    #[test]
    fn xid_154_names_its_recovery_action_by_code() {
        let x = xid("NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)");
        assert_eq!((x.xid, x.recovery_code), (154, Some(2)));
        let x = xid("NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)");
        assert_eq!(x.recovery_code, Some(0));
        assert_eq!(
            xid("NVRM: Xid (PCI:0000:3b:00): 154, something else").recovery_code,
            None
        );
        let x = xid("NVRM: Xid (PCI:0000:3b:00): 31, pid=1, name=x, ... to 0x2 ...");
        assert_eq!(x.recovery_code, None, "only Xid 154 carries one");
    }

    #[test]
    fn knowledge_sample_xid31() {
        let x = xid("NVRM: Xid (PCI:0000:00:06): 31, pid=494, name=probe, channel 0x0000000e, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC1 GPCCLIENT_T1_8 faulted @ 0x0_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE");
        assert_eq!(x.pci, PCI6);
        assert_eq!(x.xid, 31);
        assert_eq!(x.pid, Some(494));
        assert_eq!(x.name.as_deref(), Some("probe"));
        assert!(!x.secondary);
        assert!(x.detail.contains("FAULT_PDE"));
    }

    #[test]
    fn knowledge_sample_xid43_names_mps_server() {
        let x = xid(
            "NVRM: Xid (PCI:0000:00:06): 43, pid=566, name=nvidia-cuda-mps, channel 0x0000000a",
        );
        assert_eq!((x.xid, x.pid), (43, Some(566)));
        assert_eq!(x.name.as_deref(), Some("nvidia-cuda-mps"));
    }

    #[test]
    fn knowledge_sample_xid13_without_pid() {
        let x = xid("NVRM: Xid (PCI:0000:00:06): 13, Graphics SM Warp Exception on (GPC 1, TPC 4, SM 0): Misaligned Address");
        assert_eq!((x.xid, x.pid), (13, None));
        assert!(x.detail.contains("Misaligned Address"));
    }

    #[test]
    fn kmsg_record_wrapping() {
        let rec = "3,1234,5678901,-;NVRM: Xid (PCI:0000:00:06): 31, pid=494, name=probe, channel 0x0000000e\n SUBSYSTEM=pci\n DEVICE=+pci:0000:00:06.0";
        let r = parse_kmsg_record(rec).unwrap();
        assert_eq!((r.seq, r.ts_usec), (1234, 5678901));
        assert_eq!(xid(r.message).xid, 31);
        assert!(parse_kmsg_record("garbage").is_none());
        assert!(parse_kmsg_record("a,b,c;x").is_none());
    }

    #[test]
    fn only_the_kernels_own_records_count() {
        // pri 3 = facility 0 (kernel), level 3: what nvidia.ko prints.
        let k = parse_kmsg_record(
            "3,1,2,-;NVRM: mpsr-isolate (PCI:0000:00:06): xid=31 culprit_pid=5 contained=1",
        )
        .unwrap();
        assert!(k.from_kernel());
        // `echo '<3>NVRM: ...' > /dev/kmsg` by root arrives as LOG_USER (pri 11): a forged line.
        let u = parse_kmsg_record(
            "11,2,3,-;NVRM: mpsr-isolate (PCI:0000:00:06): xid=31 culprit_pid=5 contained=1",
        )
        .unwrap();
        assert_eq!(u.facility, 1);
        assert!(!u.from_kernel());
        assert!(
            parse_line(u.message).is_some(),
            "the text alone cannot tell"
        );
    }

    #[test]
    fn dmesg_prefix_and_mig() {
        let x = xid("[  123.456789] NVRM: Xid (PCI:0000:3b:00 GPU-I:05): 31, pid=1234, name=python3, Ch 00000008");
        assert_eq!(x.pci, PciAddr::parse("0000:3b:00").unwrap());
        assert_eq!(x.gpu_instance, Some(5));
        assert_eq!(x.pid, Some(1234));
    }

    #[test]
    fn unknown_pid() {
        let x = xid("NVRM: Xid (PCI:0000:00:06): 43, pid='<unknown>', name=<unknown>, Ch 00000010");
        assert_eq!(x.pid, None);
        assert_eq!(x.name, None);
    }

    #[test]
    fn caused_by_previous_xid() {
        let x = xid("NVRM: Xid (PCI:0000:00:06): 45, pid=77, name=app, Ch 00000010, Preemptive Cleanup, due to previous errors in Ch 0x00000010");
        assert!(x.secondary);
        let y = xid("NVRM: Xid (PCI:0000:00:06): 43, pid=12, name=x, this event was caused by previous Xid 31");
        assert!(y.secondary);
    }

    #[test]
    fn old_formats() {
        let x = xid("NVRM: Xid (0000:01:00): 79, GPU has fallen off the bus.");
        assert_eq!(x.xid, 79);
        assert_eq!(x.pci, PciAddr::parse("0000:01:00").unwrap());
        let y = xid("NVRM: Xid (PCI:0000:c1:00): 43, Ch 00000008");
        assert_eq!((y.xid, y.pid), (43, None));
    }

    #[test]
    fn isolation_line() {
        assert_eq!(
            parse_line("NVRM: mpsr-isolate (PCI:0000:00:06): xid=31 culprit_pid=901 contained=1"),
            Some(KernelLine::Isolation {
                pci: PCI6,
                xid: 31,
                culprit_pid: 901,
                contained: true
            })
        );
        // The driver patch's full line (driver-patch/src/mpsr_isolate.c), with the process name
        // last and sanitized: a name that spells a field cannot change the real one.
        assert_eq!(
            parse_line("NVRM: mpsr-isolate (PCI:0000:00:06): xid=31 culprit_pid=902 contained=0 engine=GRAPHICS veid=3 addr=0x10 access=WRITE type=INVALID_PDE comm=x_contained_1_"),
            Some(KernelLine::Isolation {
                pci: PCI6,
                xid: 31,
                culprit_pid: 902,
                contained: false
            })
        );
        // Lying or garbled fields: no isolation line at all (the Xid alone then decides).
        for bad in [
            "NVRM: mpsr-isolate (PCI:0000:00:06): xid=31 culprit_pid=-4 contained=1",
            "NVRM: mpsr-isolate (PCI:0000:00:06): xid=31 culprit_pid=abc contained=1",
            "NVRM: mpsr-isolate (PCI:0000:00:06): xid=x31 culprit_pid=1 contained=1",
            "NVRM: mpsr-isolate (PCI:0000:00:06) xid=31 culprit_pid=1 contained=1",
            "NVRM: mpsr-isolate PCI:0000:00:06: xid=31 culprit_pid=1 contained=1",
            "NVRM: mpsr-isolate (PCI:0000:00:06): xid=31 ppid=1 contained=1",
        ] {
            assert_eq!(parse_line(bad), None, "{bad}");
        }
        // Anything but exactly 1 is not contained.
        assert!(matches!(
            parse_line("NVRM: mpsr-isolate (PCI:0000:00:06): xid=31 culprit_pid=5 contained=yes"),
            Some(KernelLine::Isolation {
                contained: false,
                ..
            })
        ));
    }

    #[test]
    fn garbage_is_ignored_never_panics() {
        for g in [
            "",
            "NVRM:",
            "NVRM: Xid",
            "NVRM: Xid (",
            "NVRM: Xid (PCI:zz:00): 31",
            "NVRM: Xid (PCI:0000:00:06)",
            "NVRM: Xid (PCI:0000:00:06): ",
            "NVRM: Xid (PCI:0000:00:06): abc",
            "NVRM: Xid (PCI:0000:00:06): 99999999999999999999",
            "NVRM: mpsr-isolate (PCI:0000:00:06): xid=31",
            "NVRM: loading NVIDIA UNIX Open Kernel Module",
            "usb 1-1: new device \u{fffd}\u{0}",
            "NVRM: Xid (PCI:0000:00:06): 31, pid=",
        ] {
            let _ = parse_line(g);
        }
        assert!(parse_line("NVRM: Xid (PCI:0000:00:06): abc").is_none());
        assert!(parse_line("NVRM: loading NVIDIA UNIX Open Kernel Module").is_none());
        // A pid field that is not a number is dropped, the Xid kept.
        assert_eq!(xid("NVRM: Xid (PCI:0000:00:06): 31, pid=").pid, None);
    }

    #[test]
    fn pci_forms_agree() {
        let a = PciAddr::parse("00000000:00:06.0").unwrap();
        assert_eq!(a, PCI6);
        assert_eq!(a.to_string(), "0000:00:06");
        assert!(PciAddr::parse("1:2:3:4").is_none());
    }
}
