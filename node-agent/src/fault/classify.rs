//! Xid classification: a table (data) from Xid to class, and per class its blast radius and default
//! action. Sources: NVIDIA's Xid catalogue and what KNOWLEDGE.md measured under MPS on an H200.

use std::collections::BTreeMap;

pub use mpsr_proto::FaultClass;

pub use crate::signal::{BlastRadius, ClassPolicy, JobAction};

impl ClassPolicy {
    pub fn default_for(class: FaultClass) -> ClassPolicy {
        use BlastRadius as R;
        use JobAction as A;
        let p = |radius, action, drain, isolatable| ClassPolicy {
            radius,
            action,
            drain,
            isolatable,
        };
        match class {
            FaultClass::Info => p(R::None, A::None, false, false),
            FaultClass::Unknown => p(R::None, A::None, false, false),
            FaultClass::AppMemory => p(R::Domain, A::Recover, false, true),
            FaultClass::AppSm => p(R::Domain, A::Recover, false, false),
            FaultClass::AppServer => p(R::Domain, A::Recover, false, false),
            FaultClass::HwContained => p(R::Gpu, A::Recover, false, false),
            FaultClass::HwUncontained => p(R::Gpu, A::RequeueOnly, true, false),
            FaultClass::Interconnect => p(R::Gpu, A::RequeueOnly, true, false),
            FaultClass::DeviceLost => p(R::Gpu, A::RequeueOnly, true, false),
        }
    }
}

/// The built-in Xid table: every Xid of NVIDIA's catalogue for Ampere and later that a current
/// driver can log (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, R580; codes the
/// catalogue marks unused are left out and read as unknown). The class follows the catalogue's
/// immediate action: RESTART_APP -> an application class (kills the clients of its MPS server, as
/// measured), RESET_GPU / RESTART_BM -> hardware (drain: memory errors `hw_uncontained`, a GPU
/// that stops answering `device_lost`), NVLink -> `interconnect`, IGNORE and notices -> `info`.
/// Xid 154 carries the recovery action the driver asks for: see [`RecoveryAction`].
pub const XID_TABLE: &[(u32, FaultClass, &str)] = &[
    (
        8,
        FaultClass::AppSm,
        "GPU stopped processing (FIFO idle timeout)",
    ),
    (
        11,
        FaultClass::AppSm,
        "invalid or corrupted push buffer stream",
    ),
    (13, FaultClass::AppSm, "graphics engine exception"),
    (14, FaultClass::Info, "fake error injected from user space"),
    (
        25,
        FaultClass::AppSm,
        "invalid or illegal push buffer stream",
    ),
    (31, FaultClass::AppMemory, "GPU memory page fault (MMU)"),
    (
        32,
        FaultClass::AppSm,
        "invalid or corrupted push buffer stream (PBDMA)",
    ),
    (
        37,
        FaultClass::Info,
        "driver firmware error (unimplemented method)",
    ),
    (
        38,
        FaultClass::Info,
        "driver firmware error (watchdog timeout)",
    ),
    (39, FaultClass::AppSm, "copy engine 0 exception"),
    (40, FaultClass::AppSm, "copy engine 1 exception"),
    (41, FaultClass::AppSm, "copy engine 2 exception"),
    (
        43,
        FaultClass::AppSm,
        "GPU stopped processing (reset channel)",
    ),
    (
        44,
        FaultClass::AppSm,
        "graphics engine fault during context switch",
    ),
    (
        45,
        FaultClass::AppSm,
        "preemptive cleanup, due to previous errors",
    ),
    (
        46,
        FaultClass::DeviceLost,
        "GPU stopped processing (GPU timeout)",
    ),
    (48, FaultClass::HwUncontained, "double bit ECC error"),
    (
        54,
        FaultClass::Info,
        "auxiliary power not connected to the board",
    ),
    (60, FaultClass::AppSm, "video processor (SEC2) exception"),
    (
        62,
        FaultClass::DeviceLost,
        "internal micro-controller (PMU) halt",
    ),
    (
        63,
        FaultClass::Info,
        "ECC page retirement or row remap recorded",
    ),
    (
        64,
        FaultClass::HwUncontained,
        "ECC page retirement or row remap failure",
    ),
    (
        66,
        FaultClass::Info,
        "illegal register access by the driver",
    ),
    (
        67,
        FaultClass::Info,
        "illegal access by the driver (verification)",
    ),
    (68, FaultClass::AppSm, "NVDEC0 exception"),
    (69, FaultClass::AppSm, "graphics engine class error"),
    (70, FaultClass::AppSm, "copy engine 3 exception"),
    (71, FaultClass::AppSm, "copy engine 4 exception"),
    (72, FaultClass::AppSm, "copy engine 5 exception"),
    (74, FaultClass::Interconnect, "NVLink error"),
    (75, FaultClass::AppSm, "copy engine 6 exception"),
    (76, FaultClass::AppSm, "copy engine 7 exception"),
    (77, FaultClass::AppSm, "copy engine 8 exception"),
    (78, FaultClass::Info, "vGPU start error"),
    (79, FaultClass::DeviceLost, "GPU has fallen off the bus"),
    (
        80,
        FaultClass::AppSm,
        "corrupted data sent to the GPU (push buffer CRC)",
    ),
    (82, FaultClass::AppSm, "NVJPG0 exception"),
    (83, FaultClass::AppSm, "NVDEC1 exception"),
    (84, FaultClass::AppSm, "NVDEC2 exception"),
    (85, FaultClass::AppSm, "copy engine 9 exception"),
    (86, FaultClass::AppSm, "OFA exception"),
    (88, FaultClass::AppSm, "NVDEC3 exception"),
    (89, FaultClass::AppSm, "NVDEC4 exception"),
    (92, FaultClass::Info, "high single-bit ECC error rate"),
    (93, FaultClass::Info, "InfoROM wear limit exceeded"),
    (94, FaultClass::HwContained, "contained ECC error"),
    (95, FaultClass::HwUncontained, "uncontained ECC error"),
    (96, FaultClass::AppSm, "NVDEC5 exception"),
    (97, FaultClass::AppSm, "NVDEC6 exception"),
    (98, FaultClass::AppSm, "NVDEC7 exception"),
    (99, FaultClass::AppSm, "NVJPG1 exception"),
    (100, FaultClass::AppSm, "NVJPG2 exception"),
    (101, FaultClass::AppSm, "NVJPG3 exception"),
    (102, FaultClass::AppSm, "NVJPG4 exception"),
    (103, FaultClass::AppSm, "NVJPG5 exception"),
    (104, FaultClass::AppSm, "NVJPG6 exception"),
    (105, FaultClass::AppSm, "NVJPG7 exception"),
    (106, FaultClass::Info, "SMBPBI test message"),
    (107, FaultClass::Info, "SMBPBI test message (silent)"),
    (
        108,
        FaultClass::Info,
        "NVLink remote translation error (unused)",
    ),
    (109, FaultClass::AppSm, "context switch timeout"),
    (110, FaultClass::DeviceLost, "security fault"),
    (119, FaultClass::DeviceLost, "GSP RPC timeout"),
    (120, FaultClass::DeviceLost, "GSP error"),
    (121, FaultClass::Info, "C2C link corrected errors"),
    (126, FaultClass::AppSm, "copy engine 10 exception"),
    (127, FaultClass::AppSm, "copy engine 11 exception"),
    (128, FaultClass::AppSm, "copy engine 12 exception"),
    (129, FaultClass::AppSm, "copy engine 13 exception"),
    (130, FaultClass::AppSm, "copy engine 14 exception"),
    (131, FaultClass::AppSm, "copy engine 15 exception"),
    (132, FaultClass::AppSm, "copy engine 16 exception"),
    (133, FaultClass::AppSm, "copy engine 17 exception"),
    (134, FaultClass::AppSm, "copy engine 18 exception"),
    (135, FaultClass::AppSm, "copy engine 19 exception"),
    (136, FaultClass::Interconnect, "NVLink training failed"),
    (
        137,
        FaultClass::AppSm,
        "NVLink privilege error (illegal peer access)",
    ),
    (139, FaultClass::AppSm, "OFA1 exception"),
    (140, FaultClass::HwUncontained, "unrecovered ECC error"),
    (141, FaultClass::Info, "CUDA fast path error"),
    (142, FaultClass::AppSm, "NVENC3 exception"),
    (143, FaultClass::DeviceLost, "GPU initialization error"),
    (144, FaultClass::Interconnect, "NVLink SAW error"),
    (145, FaultClass::Interconnect, "NVLink RLW error"),
    (146, FaultClass::Interconnect, "NVLink TLW error"),
    (147, FaultClass::Interconnect, "NVLink TREX error"),
    (148, FaultClass::Interconnect, "NVLink NVLPW control error"),
    (149, FaultClass::Interconnect, "NVLink NETIR error"),
    (150, FaultClass::Interconnect, "NVLink MSE error"),
    (
        151,
        FaultClass::DeviceLost,
        "key rotation error (confidential computing)",
    ),
    (152, FaultClass::Info, "DLA SMMU error"),
    (153, FaultClass::Info, "DLA timeout"),
    (154, FaultClass::DeviceLost, "GPU recovery action changed"),
    (
        155,
        FaultClass::Interconnect,
        "NVLink link down (software defined)",
    ),
    (
        156,
        FaultClass::HwUncontained,
        "resource retirement event (reset to apply)",
    ),
    (
        157,
        FaultClass::Info,
        "resource retirement failure (no spare resources)",
    ),
    (158, FaultClass::DeviceLost, "GPU fatal timeout"),
    (159, FaultClass::HwUncontained, "C2C CHI non-data error"),
    (160, FaultClass::Info, "channel retirement event"),
    (161, FaultClass::Info, "channel retirement failure"),
    (
        162,
        FaultClass::Info,
        "power smoothing circuitry re-engaged",
    ),
    (
        163,
        FaultClass::Info,
        "power smoothing circuitry disengaged",
    ),
    (
        164,
        FaultClass::Info,
        "power smoothing circuitry low lifetime",
    ),
    (
        165,
        FaultClass::Info,
        "power smoothing circuitry lifetime exhausted",
    ),
    (
        166,
        FaultClass::Interconnect,
        "NVLink traffic before encryption was set up (confidential computing)",
    ),
    (167, FaultClass::DeviceLost, "PCIe fatal timeout"),
    (
        168,
        FaultClass::Info,
        "reduced GPU memory capacity (errors in the write-protected region)",
    ),
    (
        169,
        FaultClass::DeviceLost,
        "internal micro-controller (SEC2) halt",
    ),
    (
        170,
        FaultClass::Interconnect,
        "NVLink interrupt in confidential computing mode",
    ),
    (
        171,
        FaultClass::HwUncontained,
        "uncorrectable DRAM error (detail of Xid 48)",
    ),
    (
        172,
        FaultClass::HwUncontained,
        "uncorrectable SRAM error (detail of Xid 48)",
    ),
];

pub use mpsr_proto::fault::{RecoveryAction, XID_RECOVERY_ACTION};

/// Xid -> class with config overrides applied, and class -> policy.
#[derive(Debug, Clone)]
pub struct Classifier {
    classes: BTreeMap<u32, FaultClass>,
    policies: BTreeMap<FaultClass, ClassPolicy>,
}

impl Default for Classifier {
    fn default() -> Self {
        Classifier::new(&BTreeMap::new(), &BTreeMap::new())
    }
}

impl Classifier {
    pub fn new(
        xid_overrides: &BTreeMap<u32, FaultClass>,
        policy_overrides: &BTreeMap<FaultClass, ClassPolicy>,
    ) -> Self {
        let mut classes: BTreeMap<u32, FaultClass> =
            XID_TABLE.iter().map(|(x, c, _)| (*x, *c)).collect();
        classes.extend(xid_overrides.iter().map(|(x, c)| (*x, *c)));
        let mut policies: BTreeMap<FaultClass, ClassPolicy> = FaultClass::ALL
            .iter()
            .map(|c| (*c, ClassPolicy::default_for(*c)))
            .collect();
        policies.extend(policy_overrides.iter().map(|(c, p)| (*c, *p)));
        Classifier { classes, policies }
    }

    pub fn class_of(&self, xid: u32) -> FaultClass {
        self.classes
            .get(&xid)
            .copied()
            .unwrap_or(FaultClass::Unknown)
    }

    /// The class of a fault made of several Xids: the most severe one.
    pub fn class_of_all(&self, xids: &[u32]) -> FaultClass {
        self.class_of_fault(xids, None)
    }

    /// As [`Self::class_of_all`], with the recovery action an Xid 154 line named deciding that
    /// Xid's class (unless the site classified 154 itself).
    pub fn class_of_fault(&self, xids: &[u32], recovery: Option<RecoveryAction>) -> FaultClass {
        let default_154 = XID_TABLE
            .iter()
            .find(|(x, _, _)| *x == XID_RECOVERY_ACTION)
            .map(|(_, c, _)| *c);
        let site_set_154 = self.classes.get(&XID_RECOVERY_ACTION).copied() != default_154;
        xids.iter()
            .map(|x| match recovery {
                Some(a) if *x == XID_RECOVERY_ACTION && !site_set_154 => a.class(),
                _ => self.class_of(*x),
            })
            .max_by_key(|c| c.severity())
            .unwrap_or(FaultClass::Unknown)
    }

    pub fn policy(&self, class: FaultClass) -> ClassPolicy {
        self.policies[&class]
    }

    pub fn description(xid: u32) -> &'static str {
        XID_TABLE
            .iter()
            .find(|(x, _, _)| *x == xid)
            .map(|(_, _, d)| *d)
            .unwrap_or("unknown Xid")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_classes_match_knowledge() {
        let c = Classifier::default();
        assert_eq!(c.class_of(31), FaultClass::AppMemory);
        for x in [13, 43, 45, 68, 109] {
            assert_eq!(c.class_of(x), FaultClass::AppSm, "xid {x}");
        }
        assert_eq!(c.class_of(94), FaultClass::HwContained);
        for x in [95, 48, 64, 140] {
            assert_eq!(c.class_of(x), FaultClass::HwUncontained, "xid {x}");
        }
        for x in [79, 119, 120] {
            assert_eq!(c.class_of(x), FaultClass::DeviceLost, "xid {x}");
        }
        for x in [63, 92] {
            assert_eq!(c.class_of(x), FaultClass::Info, "xid {x}");
        }
        assert_eq!(c.class_of(9999), FaultClass::Unknown);
    }

    #[test]
    fn only_hardware_classes_drain_by_default() {
        let c = Classifier::default();
        for class in FaultClass::ALL {
            let p = c.policy(class);
            assert_eq!(
                p.drain,
                class.is_hardware() && class != FaultClass::HwContained
            );
            if p.drain {
                assert!(class.is_hardware());
            }
        }
        assert!(c.policy(FaultClass::AppMemory).isolatable);
        assert!(!c.policy(FaultClass::AppSm).isolatable);
        assert_eq!(c.policy(FaultClass::Info).radius, BlastRadius::None);
    }

    #[test]
    fn merged_xids_take_most_severe() {
        let c = Classifier::default();
        assert_eq!(c.class_of_all(&[13, 43]), FaultClass::AppSm);
        assert_eq!(c.class_of_all(&[31, 79]), FaultClass::DeviceLost);
        assert_eq!(c.class_of_all(&[]), FaultClass::Unknown);
    }

    /// Every Xid of NVIDIA's catalogue a current driver logs on Ampere or later has a class; the
    /// ones it marks unused read as unknown.
    #[test]
    fn the_catalogue_is_classified_whole() {
        let c = Classifier::default();
        for x in [144, 145, 146, 147, 148, 149, 150, 155, 166, 170] {
            assert_eq!(c.class_of(x), FaultClass::Interconnect, "xid {x}");
        }
        for x in [158, 167, 143, 169, 46] {
            assert_eq!(c.class_of(x), FaultClass::DeviceLost, "xid {x}");
        }
        for x in [171, 172, 156] {
            assert_eq!(c.class_of(x), FaultClass::HwUncontained, "xid {x}");
        }
        for x in [8, 11, 32, 39, 126, 135, 137] {
            assert_eq!(c.class_of(x), FaultClass::AppSm, "xid {x}");
        }
        for x in [162, 163, 164, 165, 160, 157, 121] {
            assert_eq!(c.class_of(x), FaultClass::Info, "xid {x}");
        }
        for x in [1, 9, 47, 91, 173] {
            assert_eq!(c.class_of(x), FaultClass::Unknown, "xid {x}");
        }
        assert!(XID_TABLE.len() > 100);
        assert!(
            XID_TABLE.windows(2).all(|w| w[0].0 < w[1].0),
            "sorted, no repeats"
        );
    }

    /// Xid 154 is classed by the action its line names; without one (NVML) it stays
    /// `device_lost`; a site's own class for 154 wins.
    #[test]
    fn xid_154_is_classed_by_its_recovery_action() {
        let c = Classifier::default();
        let of = |a| c.class_of_fault(&[154], RecoveryAction::from_code(a));
        assert_eq!(of(0), FaultClass::Info);
        assert_eq!(of(1), FaultClass::DeviceLost);
        assert_eq!(of(2), FaultClass::DeviceLost);
        assert_eq!(of(3), FaultClass::Interconnect);
        assert_eq!(of(4), FaultClass::HwUncontained);
        assert_eq!(
            of(9),
            FaultClass::DeviceLost,
            "unknown code: the table's class"
        );
        assert_eq!(
            c.class_of_fault(&[31, 154], RecoveryAction::from_code(0)),
            FaultClass::AppMemory,
            "the Xid it summarizes decides"
        );
        let mut xo = BTreeMap::new();
        xo.insert(154, FaultClass::Info);
        let site = Classifier::new(&xo, &BTreeMap::new());
        assert_eq!(
            site.class_of_fault(&[154], RecoveryAction::from_code(2)),
            FaultClass::Info
        );
    }

    #[test]
    fn overrides_apply() {
        let mut xo = BTreeMap::new();
        xo.insert(63, FaultClass::HwContained);
        xo.insert(500, FaultClass::AppSm);
        let c = Classifier::new(&xo, &BTreeMap::new());
        assert_eq!(c.class_of(63), FaultClass::HwContained);
        assert_eq!(c.class_of(500), FaultClass::AppSm);
        assert_eq!(c.class_of(31), FaultClass::AppMemory);
    }
}
