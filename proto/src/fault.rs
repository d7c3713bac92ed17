//! What a fault is, as every part of the product names it: its class (from its Xids) and the
//! sources of its signals. Serialized as their snake_case names, as decision records have always
//! carried them; a name a newer agent adds reads as `unknown` / `other` here.

use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultClass {
    /// Informational (e.g. 63 row remap recorded, 92 high SBE rate): nobody is hit.
    Info,
    /// Not in the table: logged, no action unless configured.
    Unknown,
    /// Application memory fault (31 MMU fault). Isolatable with the driver patch.
    AppMemory,
    /// Application SM/engine exception (13, 43, 45, 68, 109): handled in firmware; kills the GPU's clients.
    AppSm,
    /// A server's own fatal-error line (or the server seen in FAULT) before any Xid reached the
    /// agent: an application fault of that server, its Xid still to come. Decided at once (a hot
    /// standby is released on it); the Xid, when it comes, decides it again with its own class.
    AppServer,
    /// Hardware error contained by the GPU (94): hit clients die, the GPU stays usable.
    HwContained,
    /// Uncontained or memory hardware error (95, 48, 64, 140): GPU needs a reset; drain.
    HwUncontained,
    /// Interconnect errors (74 NVLink).
    Interconnect,
    /// The GPU is gone (79 fallen off the bus, 119/120 GSP, 154 reset required).
    DeviceLost,
}

impl FaultClass {
    pub const ALL: [FaultClass; 9] = [
        FaultClass::Info,
        FaultClass::Unknown,
        FaultClass::AppServer,
        FaultClass::AppMemory,
        FaultClass::AppSm,
        FaultClass::HwContained,
        FaultClass::HwUncontained,
        FaultClass::Interconnect,
        FaultClass::DeviceLost,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultClass::Info => "info",
            FaultClass::Unknown => "unknown",
            FaultClass::AppMemory => "app_memory",
            FaultClass::AppSm => "app_sm",
            FaultClass::AppServer => "app_server",
            FaultClass::HwContained => "hw_contained",
            FaultClass::HwUncontained => "hw_uncontained",
            FaultClass::Interconnect => "interconnect",
            FaultClass::DeviceLost => "device_lost",
        }
    }

    pub fn from_name(s: &str) -> Option<FaultClass> {
        FaultClass::ALL.into_iter().find(|c| c.name() == s)
    }

    /// Severity order used when several Xids of one fault are merged.
    pub fn severity(self) -> u8 {
        match self {
            FaultClass::Info => 0,
            FaultClass::Unknown => 1,
            FaultClass::AppServer => 2,
            FaultClass::AppMemory => 2,
            FaultClass::AppSm => 3,
            FaultClass::HwContained => 4,
            FaultClass::Interconnect => 5,
            FaultClass::HwUncontained => 6,
            FaultClass::DeviceLost => 7,
        }
    }

    /// Hardware classes are the only ones allowed to drain a node.
    pub fn is_hardware(self) -> bool {
        matches!(
            self,
            FaultClass::HwContained
                | FaultClass::HwUncontained
                | FaultClass::Interconnect
                | FaultClass::DeviceLost
        )
    }
}

impl fmt::Display for FaultClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A decision record's class as written, read forward-compatibly: a class this release does not
/// know (a newer agent's) is `unknown`.
pub fn class_or_unknown<'de, D: Deserializer<'de>>(d: D) -> Result<FaultClass, D::Error> {
    let name = String::deserialize(d)?;
    Ok(FaultClass::from_name(&name).unwrap_or(FaultClass::Unknown))
}

/// Where a fault signal came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SignalSource {
    Nvml,
    Kmsg,
    MpsLog,
    /// A domain's server seen in FAULT (`get_server_status`), probed after a GPU-wide signal.
    MpsStatus,
    ClientExit,
    /// The driver patch's isolation line.
    Isolation,
    Sim,
    /// A source this release does not know (a newer agent's).
    #[serde(other)]
    Other,
}

impl SignalSource {
    pub fn name(self) -> &'static str {
        match self {
            SignalSource::Nvml => "nvml",
            SignalSource::Kmsg => "kmsg",
            SignalSource::MpsLog => "mps_log",
            SignalSource::MpsStatus => "mps_status",
            SignalSource::ClientExit => "client_exit",
            SignalSource::Isolation => "isolation",
            SignalSource::Sim => "sim",
            SignalSource::Other => "other",
        }
    }
}

impl fmt::Display for SignalSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_on_the_wire_are_the_snake_case_ones_and_unknown_ones_read_forward() {
        for c in FaultClass::ALL {
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.name())
            );
        }
        assert_eq!(
            serde_json::to_string(&SignalSource::MpsLog).unwrap(),
            "\"mps_log\""
        );
        let s: SignalSource = serde_json::from_str("\"tomorrow\"").unwrap();
        assert_eq!(s, SignalSource::Other);
        #[derive(Deserialize)]
        struct R {
            #[serde(deserialize_with = "class_or_unknown")]
            class: FaultClass,
        }
        let r: R = serde_json::from_str(r#"{"class": "app_quantum"}"#).unwrap();
        assert_eq!(r.class, FaultClass::Unknown);
        let r: R = serde_json::from_str(r#"{"class": "app_sm"}"#).unwrap();
        assert_eq!(r.class, FaultClass::AppSm);
    }
}
