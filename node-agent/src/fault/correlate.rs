//! Raw fault signals from each intake source, and their correlation into one fault event.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

pub use crate::signal::{GpuRef, Signal, Source};

/// One fault on one GPU, merged from every signal seen within the correlation window.
#[derive(Debug, Clone)]
pub struct FaultEvent {
    pub id: u64,
    pub gpu: u32,
    pub xids: Vec<u32>,
    pub sources: BTreeSet<Source>,
    pub reported_pid: Option<u32>,
    pub culprit: Option<u32>,
    /// The isolation line says the fault was contained to the culprit: a claim, see
    /// [`FaultEvent::contained`].
    pub claims_contained: bool,
    /// Slots of the GPU's fault domains whose servers showed this fault.
    pub domains: BTreeSet<u32>,
    pub first: Instant,
    pub first_ms: u64,
    pub last: Instant,
    pub detail: String,
    /// Some of its evidence was read after an agent restart (it happened while the agent was down).
    pub replayed: bool,
    /// The latest recovery action an Xid 154 line of this fault named.
    pub recovery: Option<mpsr_proto::fault::RecoveryAction>,
}

impl FaultEvent {
    fn from_signal(id: u64, gpu: u32, s: &Signal) -> FaultEvent {
        let mut e = FaultEvent {
            id,
            gpu,
            xids: Vec::new(),
            sources: BTreeSet::new(),
            reported_pid: None,
            culprit: None,
            claims_contained: false,
            domains: BTreeSet::new(),
            first: s.at,
            first_ms: s.at_ms,
            last: s.at,
            detail: String::new(),
            replayed: false,
            recovery: None,
        };
        e.absorb(s);
        e
    }

    /// Whether the fault stands as contained: the isolation line says so and nothing shows it was
    /// cancelled after all. A contained fault is never cancelled, so the firmware reports no Xid
    /// (kernel line, NVML) and no server logs or shows a fault: any of these refutes the claim
    /// (a line that lies, or a containment that ran out).
    pub fn contained(&self) -> bool {
        self.claims_contained
            && self.domains.is_empty()
            && !self.sources.iter().any(|s| {
                matches!(
                    s,
                    Source::Kmsg | Source::Nvml | Source::MpsLog | Source::MpsStatus
                )
            })
    }

    fn absorb(&mut self, s: &Signal) {
        if let Some(x) = s.xid {
            if !self.xids.contains(&x) {
                self.xids.push(x);
            }
        }
        self.sources.insert(s.source);
        self.domains.extend(s.domain);
        self.replayed |= s.replayed;
        if s.recovery.is_some() {
            self.recovery = s.recovery;
        }
        if self.reported_pid.is_none() {
            self.reported_pid = s.reported_pid;
        }
        if let Some((pid, contained)) = s.culprit {
            self.culprit = Some(pid);
            self.claims_contained = contained;
        }
        if self.detail.is_empty() && !s.detail.is_empty() {
            self.detail = s.detail.clone();
        }
        if s.at > self.last {
            self.last = s.at;
        }
    }
}

/// What merging a signal did.
#[derive(Debug, PartialEq, Eq)]
pub enum Merge {
    /// A new fault started (its id).
    New(u64),
    /// Added to an open fault; `changed` is true when it brought a new Xid, culprit or domain.
    Joined { id: u64, changed: bool },
    /// The signal has no Xid and no open fault to join (e.g. a stray client exit): not a fault.
    Ignored,
}

/// Dedupes signals into faults: same GPU within `window` of the fault's latest signal.
pub struct Correlator {
    window: Duration,
    open: Vec<FaultEvent>,
}

impl Correlator {
    pub fn new(window: Duration) -> Self {
        Correlator {
            window,
            open: Vec::new(),
        }
    }

    pub fn merge(&mut self, gpu: u32, s: &Signal, next_id: impl FnOnce() -> u64) -> Merge {
        let window = self.window;
        self.open
            .retain(|e| s.at.saturating_duration_since(e.last) <= window);
        if let Some(e) = self.open.iter_mut().find(|e| e.gpu == gpu) {
            let before = (e.xids.len(), e.culprit, e.domains.len(), e.contained());
            e.absorb(s);
            let changed = (e.xids.len(), e.culprit, e.domains.len(), e.contained()) != before;
            return Merge::Joined { id: e.id, changed };
        }
        // A domain's server in FAULT is a fault even before its Xid arrives.
        if s.xid.is_none() && s.culprit.is_none() && s.domain.is_none() {
            return Merge::Ignored;
        }
        let id = next_id();
        self.open.push(FaultEvent::from_signal(id, gpu, s));
        Merge::New(id)
    }

    pub fn get(&self, id: u64) -> Option<&FaultEvent> {
        self.open.iter().find(|e| e.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(src: Source, xid: Option<u32>, at: Instant) -> Signal {
        let mut s = Signal::new(src, GpuRef::Index(0), xid);
        s.at = at;
        s
    }

    #[test]
    fn an_xid_after_a_contained_line_is_news() {
        // The isolation line (xid=31, contained=1) decides first; the firmware's own Xid 31 a
        // moment later brings no new Xid, yet refutes the containment: it must be re-decided.
        let mut c = Correlator::new(Duration::from_millis(500));
        let t = Instant::now();
        let mut n = 0;
        let mut id = || {
            n += 1;
            n
        };
        let mut iso = sig(Source::Isolation, Some(31), t);
        iso.culprit = Some((4242, true));
        assert_eq!(c.merge(0, &iso, &mut id), Merge::New(1));
        assert!(c.get(1).unwrap().contained());
        assert_eq!(
            c.merge(
                0,
                &sig(Source::Kmsg, Some(31), t + Duration::from_millis(2)),
                &mut id
            ),
            Merge::Joined {
                id: 1,
                changed: true
            }
        );
        assert!(!c.get(1).unwrap().contained());
        assert_eq!(c.get(1).unwrap().culprit, Some(4242));
    }

    #[test]
    fn nvml_and_kmsg_of_one_fault_merge() {
        let mut c = Correlator::new(Duration::from_millis(500));
        let t = Instant::now();
        let mut n = 0;
        let mut id = || {
            n += 1;
            n
        };
        assert_eq!(
            c.merge(0, &sig(Source::Nvml, Some(31), t), &mut id),
            Merge::New(1)
        );
        let mut k = sig(Source::Kmsg, Some(31), t + Duration::from_millis(3));
        k.reported_pid = Some(494);
        assert_eq!(
            c.merge(0, &k, &mut id),
            Merge::Joined {
                id: 1,
                changed: false
            }
        );
        let e = c.get(1).unwrap();
        assert_eq!(e.xids, vec![31]);
        assert_eq!(e.reported_pid, Some(494));
        assert_eq!(e.sources.len(), 2);
        // Xid 13 then 43 (misaligned store) are one fault.
        assert_eq!(
            c.merge(
                0,
                &sig(Source::Kmsg, Some(43), t + Duration::from_millis(5)),
                &mut id
            ),
            Merge::Joined {
                id: 1,
                changed: true
            }
        );
    }

    #[test]
    fn other_gpu_or_later_is_new() {
        let mut c = Correlator::new(Duration::from_millis(500));
        let t = Instant::now();
        let mut n = 0;
        let mut id = || {
            n += 1;
            n
        };
        c.merge(0, &sig(Source::Nvml, Some(31), t), &mut id);
        assert_eq!(
            c.merge(1, &sig(Source::Nvml, Some(31), t), &mut id),
            Merge::New(2)
        );
        assert_eq!(
            c.merge(
                0,
                &sig(Source::Nvml, Some(31), t + Duration::from_secs(2)),
                &mut id
            ),
            Merge::New(3)
        );
        // A client exit alone is not a fault.
        assert_eq!(
            c.merge(
                5,
                &sig(Source::ClientExit, None, t + Duration::from_secs(2)),
                &mut id
            ),
            Merge::Ignored
        );
    }

    #[test]
    fn a_domain_in_fault_opens_a_fault_and_a_new_domain_changes_it() {
        let mut c = Correlator::new(Duration::from_millis(500));
        let t = Instant::now();
        let mut n = 0;
        let mut id = || {
            n += 1;
            n
        };
        let mut log = sig(Source::MpsLog, None, t);
        log.domain = Some(2);
        assert_eq!(c.merge(0, &log, &mut id), Merge::New(1));
        let nv = sig(Source::Nvml, Some(31), t + Duration::from_millis(1));
        assert_eq!(
            c.merge(0, &nv, &mut id),
            Merge::Joined {
                id: 1,
                changed: true
            }
        );
        // The same domain again changes nothing; another one does.
        let mut again = sig(Source::MpsStatus, None, t + Duration::from_millis(2));
        again.domain = Some(2);
        assert_eq!(
            c.merge(0, &again, &mut id),
            Merge::Joined {
                id: 1,
                changed: false
            }
        );
        again.domain = Some(0);
        assert_eq!(
            c.merge(0, &again, &mut id),
            Merge::Joined {
                id: 1,
                changed: true
            }
        );
        assert_eq!(
            c.get(1)
                .unwrap()
                .domains
                .iter()
                .copied()
                .collect::<Vec<_>>(),
            vec![0, 2]
        );
    }
}
