//! What a fault does to the simulated hardware: who dies and what each client sees. A table of
//! measured effects (H200, driver 580, KNOWLEDGE.md; hardware rows from NVIDIA's Xid catalogue),
//! kept apart from the agent's Xid classification on purpose: the agent must infer from what the
//! hardware shows, and tests compare its inference with this table.

/// The reach of one fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Nothing dies (informational Xids, a device-side assert).
    Nobody,
    /// The faulting MPS server's clients: busy ones die at once; idle ones fail at their next GPU
    /// call and hold the server in FAULT until they are gone. Other servers of the GPU run on.
    Server,
    /// Every server of the GPU, as above (hardware errors).
    Gpu,
    /// The GPU falls off: every client of every server dies and the GPU stays lost until reset.
    Lost,
}

/// One row: the Xid, its reach, the CUDA error a dying client prints, and the kernel-log text.
pub struct Effect {
    pub xid: u32,
    pub reach: Reach,
    pub cuda: (u32, &'static str),
    pub kernel_text: &'static str,
}

const GPU_LOST: (u32, &str) = (999, "unknown error (GPU lost)");
const ECC: (u32, &str) = (214, "uncorrectable ECC error encountered");

pub const TABLE: &[Effect] = &[
    Effect { xid: 13, reach: Reach::Server, cuda: (716, "misaligned address"), kernel_text: "Graphics SM Warp Exception on (GPC 1, TPC 4, SM 0): Misaligned Address" },
    Effect { xid: 31, reach: Reach::Server, cuda: (700, "an illegal memory access was encountered"), kernel_text: "MMU Fault: ENGINE GRAPHICS GPC1 GPCCLIENT_T1_8 faulted @ 0x0_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE" },
    Effect { xid: 43, reach: Reach::Server, cuda: (719, "unspecified launch failure"), kernel_text: "channel 0x0000000a" },
    Effect { xid: 45, reach: Reach::Server, cuda: (719, "unspecified launch failure"), kernel_text: "Preemptive cleanup, due to previous errors" },
    Effect { xid: 68, reach: Reach::Server, cuda: (719, "unspecified launch failure"), kernel_text: "NVDEC0 Exception" },
    Effect { xid: 109, reach: Reach::Server, cuda: (719, "unspecified launch failure"), kernel_text: "Context Switch Timeout Error" },
    Effect { xid: 48, reach: Reach::Gpu, cuda: ECC, kernel_text: "An uncorrectable double bit error (DBE) has been detected" },
    Effect { xid: 64, reach: Reach::Gpu, cuda: ECC, kernel_text: "ECC page retirement or row remapping recording failure" },
    Effect { xid: 74, reach: Reach::Gpu, cuda: (719, "unspecified launch failure"), kernel_text: "NVLink Error" },
    Effect { xid: 94, reach: Reach::Gpu, cuda: ECC, kernel_text: "Contained ECC error" },
    Effect { xid: 95, reach: Reach::Gpu, cuda: ECC, kernel_text: "Uncontained ECC error" },
    Effect { xid: 140, reach: Reach::Gpu, cuda: ECC, kernel_text: "Unrecovered ECC error" },
    Effect { xid: 79, reach: Reach::Lost, cuda: GPU_LOST, kernel_text: "GPU has fallen off the bus." },
    Effect { xid: 119, reach: Reach::Lost, cuda: GPU_LOST, kernel_text: "Timeout waiting for RPC from GSP" },
    Effect { xid: 120, reach: Reach::Lost, cuda: GPU_LOST, kernel_text: "GSP Error" },
    Effect { xid: 154, reach: Reach::Lost, cuda: GPU_LOST, kernel_text: "GPU recovery action changed: GPU Reset Required" },
    Effect { xid: 63, reach: Reach::Nobody, cuda: (0, ""), kernel_text: "Row remapping event" },
    Effect { xid: 92, reach: Reach::Nobody, cuda: (0, ""), kernel_text: "High single-bit ECC error rate" },
];

const UNLISTED: Effect = Effect {
    xid: 0,
    reach: Reach::Nobody,
    cuda: (0, ""),
    kernel_text: "unlisted Xid",
};

/// When a fault shows, after the faulting kernel's launch: the driver's report (the kernel's Xid
/// record, the NVML event, the server's fatal-error line, the server in FAULT) and the victims'
/// CUDA error. Measured on an H200 (KNOWLEDGE.md, 3 repetitions each): Xid 31 reported after
/// 88-126 ms, victims' error 108-146 ms; Xid 43 reported after 13.6-16.1 ms (server.log 11-12 ms),
/// victims' error 92-346 ms. The hardware classes were not measured: reported at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub report_ms: u64,
    pub victims_ms: u64,
}

pub fn timing(xid: u32) -> Timing {
    match xid {
        31 => Timing {
            report_ms: 100,
            victims_ms: 125,
        },
        13 | 43 | 45 | 68 | 109 => Timing {
            report_ms: 14,
            victims_ms: 150,
        },
        _ => Timing {
            report_ms: 0,
            victims_ms: 0,
        },
    }
}

/// The effect of an Xid; one not in the table kills nobody (it is still reported).
pub fn effect(xid: u32) -> &'static Effect {
    TABLE.iter().find(|e| e.xid == xid).unwrap_or(&UNLISTED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_rows() {
        // KNOWLEDGE.md: 31, 43 and 13(+43) killed the other client of the same server.
        for x in [13, 31, 43] {
            assert_eq!(effect(x).reach, Reach::Server, "xid {x}");
        }
        assert_eq!(effect(31).cuda.0, 700);
        assert_eq!(effect(79).reach, Reach::Lost);
        assert_eq!(effect(95).reach, Reach::Gpu);
        assert_eq!(effect(63).reach, Reach::Nobody);
        assert_eq!(effect(4242).reach, Reach::Nobody);
        let mut xids: Vec<u32> = TABLE.iter().map(|e| e.xid).collect();
        xids.sort_unstable();
        xids.dedup();
        assert_eq!(xids.len(), TABLE.len(), "one row per Xid");
    }
}
