//! Xid classification: a table (data) from Xid to class, and per class its blast radius and default
//! action. Sources: NVIDIA's Xid catalogue and what KNOWLEDGE.md measured under MPS on an H200.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use mpsr_proto::FaultClass;

/// Who a fault of a class hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlastRadius {
    /// Nobody.
    None,
    /// Every client of the MPS server the fault happened in (measured: an application fault kills
    /// its server's clients; other servers of the same GPU run on), narrowed to the culprit only
    /// when an isolation source names it and the class is isolatable.
    Domain,
    /// Every client of every fault domain of the GPU (hardware).
    Gpu,
}

/// What to do with the hit jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobAction {
    /// Log only.
    None,
    /// Per the job's mode: requeue (batch) or resume in place.
    Recover,
    /// Requeue only (resume in place is impossible, e.g. the GPU is gone).
    RequeueOnly,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassPolicy {
    pub radius: BlastRadius,
    pub action: JobAction,
    /// Drain the node (hardware classes only; refused for others at config load).
    pub drain: bool,
    /// A culprit named by an isolation source can be terminated alone (memory faults with the patch).
    pub isolatable: bool,
}

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

/// The built-in Xid table.
pub const XID_TABLE: &[(u32, FaultClass, &str)] = &[
    (13, FaultClass::AppSm, "graphics engine exception"),
    (31, FaultClass::AppMemory, "GPU memory page fault (MMU)"),
    (
        43,
        FaultClass::AppSm,
        "GPU stopped processing (reset channel)",
    ),
    (
        45,
        FaultClass::AppSm,
        "preemptive cleanup, due to previous errors",
    ),
    (48, FaultClass::HwUncontained, "double bit ECC error"),
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
    (68, FaultClass::AppSm, "NVDEC0 exception"),
    (74, FaultClass::Interconnect, "NVLink error"),
    (79, FaultClass::DeviceLost, "GPU has fallen off the bus"),
    (92, FaultClass::Info, "high single-bit ECC error rate"),
    (94, FaultClass::HwContained, "contained ECC error"),
    (95, FaultClass::HwUncontained, "uncontained ECC error"),
    (109, FaultClass::AppSm, "context switch timeout"),
    (119, FaultClass::DeviceLost, "GSP RPC timeout"),
    (120, FaultClass::DeviceLost, "GSP error"),
    (140, FaultClass::HwUncontained, "unrecovered ECC error"),
    (154, FaultClass::DeviceLost, "GPU recovery action required"),
];

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
        xids.iter()
            .map(|x| self.class_of(*x))
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
