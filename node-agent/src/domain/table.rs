//! The domain table: placement of jobs into domains, the per-GPU cap, linger and quarantine.

use mpsr_proto::{DomainId, Isolation};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Whose domain it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", content = "id", rename_all = "snake_case")]
pub enum Tenancy {
    Shared,
    Job(u32),
    User(u32),
    /// Where the hot standbys of the GPU's tasks wait (and run once they took over).
    Standby,
}

impl std::fmt::Display for Tenancy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tenancy::Shared => f.write_str("shared"),
            Tenancy::Job(j) => write!(f, "job {j}"),
            Tenancy::User(u) => write!(f, "uid {u}"),
            Tenancy::Standby => f.write_str("standby"),
        }
    }
}

/// Pipe and log directory of a domain. The shared domain keeps the one-daemon-per-GPU layout
/// (`<run_dir>/gpuN/{pipe,log}`), so a running daemon of an older agent is adopted as it is.
pub fn paths(run_dir: &Path, d: DomainId) -> (PathBuf, PathBuf) {
    let gpu = run_dir.join(format!("gpu{}", d.gpu));
    let base = if d.is_shared() {
        gpu
    } else {
        gpu.join(format!("d{}", d.slot))
    };
    (base.join("pipe"), base.join("log"))
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainRecord {
    pub id: DomainId,
    pub tenancy: Tenancy,
    /// The uid whose processes alone may open the pipe directory.
    pub owner_uid: Option<u32>,
    pub thread_pct: Option<u8>,
    pub mem_limit: Option<u64>,
    /// Unix ms since when no registered task uses it; it is stopped `linger` after.
    #[serde(default)]
    pub empty_since_ms: Option<u64>,
}

pub use crate::config::QuarantineRule;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", content = "id", rename_all = "snake_case")]
pub enum Quarantined {
    Job(u32),
    User(u32),
}

/// The admin's placement rules (agent TOML `[mps]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub default: Isolation,
    pub allowed: BTreeSet<Isolation>,
    /// Domains per GPU, the shared one included.
    pub max_per_gpu: u32,
    pub quarantine: QuarantineRule,
    pub quarantine_ms: u64,
}

impl Policy {
    /// The placement rules of the agent's `[mps]` table.
    pub fn from_config(m: &crate::config::MpsConfig) -> Policy {
        Policy {
            default: m.isolation_default,
            allowed: m.isolation_allowed.iter().copied().collect(),
            max_per_gpu: m.max_domains_per_gpu,
            quarantine: m.quarantine,
            quarantine_ms: m.quarantine_s.saturating_mul(1000),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    #[error("isolation '{asked}' is not allowed on this node (allowed: {allowed})")]
    NotAllowed { asked: Isolation, allowed: String },
    #[error("gpu{gpu} already has {max} fault domains (mps.max_domains_per_gpu), all in use")]
    Full { gpu: u32, max: u32 },
    /// Its MPS server stayed in FAULT through every escalation: a task started there would die
    /// of CUDA error 807, so none is.
    #[error("{domain} is fenced: its MPS server could not be brought back after a fault (see `mpsrctl status`); no task is started there")]
    Fenced { domain: DomainId },
}

/// Where a task was placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub id: DomainId,
    pub isolation: Isolation,
    /// Placed apart because the job or its user was the culprit of an earlier fault.
    pub quarantined: bool,
    /// The job is quarantined, but every domain of the GPU is in use: it runs where it asked
    /// to (a requeued job must not fail for want of a domain) and its report says so.
    pub quarantine_waived: bool,
    /// A new (or re-assigned) domain whose daemon must be started with this before use.
    pub start: Option<DomainRecord>,
}

/// Every non-shared domain and the quarantine list (durable).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainTable {
    domains: Vec<DomainRecord>,
    #[serde(default)]
    quarantine: Vec<(Quarantined, u64)>,
    /// Domains whose server could not be brought back after a fault (escalation's last rung).
    #[serde(default)]
    fenced: Vec<DomainId>,
}

impl DomainTable {
    pub fn fence(&mut self, id: DomainId) {
        if !self.fenced.contains(&id) {
            self.fenced.push(id);
        }
    }

    /// Whether it was fenced.
    pub fn unfence(&mut self, id: DomainId) -> bool {
        let before = self.fenced.len();
        self.fenced.retain(|d| *d != id);
        self.fenced.len() != before
    }

    pub fn is_fenced(&self, id: DomainId) -> bool {
        self.fenced.contains(&id)
    }

    pub fn fenced(&self) -> impl Iterator<Item = DomainId> + '_ {
        self.fenced.iter().copied()
    }

    pub fn records(&self) -> impl Iterator<Item = &DomainRecord> {
        self.domains.iter()
    }

    pub fn get(&self, id: DomainId) -> Option<&DomainRecord> {
        self.domains.iter().find(|r| r.id == id)
    }

    pub fn tenancy(&self, id: DomainId) -> Tenancy {
        self.get(id).map_or(Tenancy::Shared, |r| r.tenancy)
    }

    pub fn remove(&mut self, id: DomainId) -> Option<DomainRecord> {
        let i = self.domains.iter().position(|r| r.id == id)?;
        Some(self.domains.remove(i))
    }

    /// Chooses the domain for a job's task on `gpu`. Tasks of one job on one GPU share a domain;
    /// a quarantined job or user gets one of its own whatever was asked, while one is free.
    #[allow(clippy::too_many_arguments)]
    pub fn place(
        &mut self,
        policy: &Policy,
        gpu: u32,
        job: u32,
        uid: u32,
        asked: Option<Isolation>,
        limits: (Option<u8>, Option<u64>),
        now_ms: u64,
    ) -> Result<Placed, PlaceError> {
        let isolation = asked.unwrap_or(policy.default);
        if !policy.allowed.contains(&isolation) {
            return Err(PlaceError::NotAllowed {
                asked: isolation,
                allowed: policy
                    .allowed
                    .iter()
                    .map(|i| i.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        // Wall clock, since quarantine outlives agent restarts; a clock stepped back must not
        // stretch it past its configured length.
        let longest = now_ms.saturating_add(policy.quarantine_ms);
        for (_, until) in &mut self.quarantine {
            *until = (*until).min(longest);
        }
        self.quarantine.retain(|(_, until)| *until > now_ms);
        let quarantined = self
            .quarantine
            .iter()
            .any(|(q, _)| *q == Quarantined::Job(job) || *q == Quarantined::User(uid));
        let tenancy = |quarantined| match (quarantined, isolation) {
            (true, _) | (false, Isolation::Job) => Tenancy::Job(job),
            (false, Isolation::User) => Tenancy::User(uid),
            (false, Isolation::Shared) => Tenancy::Shared,
        };
        let placed = |(id, start), quarantined, quarantine_waived| Placed {
            id,
            isolation: if quarantined {
                Isolation::Job
            } else {
                isolation
            },
            quarantined,
            quarantine_waived,
            start,
        };
        match self.place_as(policy, gpu, tenancy(quarantined), uid, limits) {
            Ok(p) => Ok(placed(p, quarantined, false)),
            // Quarantine is imposed, not asked for: with no domain free the job runs where it
            // asked rather than fail its requeued run (a domain it asked for itself is refused).
            Err(PlaceError::Full { .. }) if quarantined && isolation != Isolation::Job => {
                let p = self.place_as(policy, gpu, tenancy(false), uid, limits)?;
                Ok(placed(p, false, true))
            }
            Err(e) => Err(e),
        }
    }

    /// The domain of `tenancy` on `gpu`: its existing one, a new one, or one that is empty
    /// taken over; with the domain record to start when the daemon must be (re)started.
    fn place_as(
        &mut self,
        policy: &Policy,
        gpu: u32,
        tenancy: Tenancy,
        uid: u32,
        limits: (Option<u8>, Option<u64>),
    ) -> Result<(DomainId, Option<DomainRecord>), PlaceError> {
        if tenancy == Tenancy::Shared {
            let id = DomainId::shared(gpu);
            if self.is_fenced(id) {
                return Err(PlaceError::Fenced { domain: id });
            }
            return Ok((id, None));
        }
        let fenced = &self.fenced;
        if let Some(r) = self
            .domains
            .iter_mut()
            .find(|r| r.id.gpu == gpu && r.tenancy == tenancy && !fenced.contains(&r.id))
        {
            r.empty_since_ms = None;
            return Ok((r.id, None));
        }
        let record = |id| DomainRecord {
            id,
            tenancy,
            // The standby domain is every user's, like the shared one.
            owner_uid: (tenancy != Tenancy::Standby).then_some(uid),
            thread_pct: limits.0,
            mem_limit: limits.1,
            empty_since_ms: None,
        };
        let used: BTreeSet<u32> = self
            .domains
            .iter()
            .filter(|r| r.id.gpu == gpu)
            .map(|r| r.id.slot)
            .collect();
        if let Some(slot) = (1..policy.max_per_gpu).find(|s| !used.contains(s)) {
            let r = record(DomainId { gpu, slot });
            self.domains.push(r.clone());
            return Ok((r.id, Some(r)));
        }
        // Full: take over the domain that has been empty longest (its daemon keeps running); a
        // fenced one keeps its slot and is never taken.
        let fenced = &self.fenced;
        let reuse = self
            .domains
            .iter_mut()
            .filter(|r| r.id.gpu == gpu && r.empty_since_ms.is_some() && !fenced.contains(&r.id))
            .min_by_key(|r| r.empty_since_ms);
        match reuse {
            Some(r) => {
                *r = record(r.id);
                Ok((r.id, Some(r.clone())))
            }
            None => Err(PlaceError::Full {
                gpu,
                max: policy.max_per_gpu,
            }),
        }
    }

    /// Where a hot standby of a task in domain `of` waits: never in `of` itself (a fault there
    /// must not reach it). The GPU's standby domain (made on first use, within the cap), or, for
    /// a task running in the standby domain (one that took over), the shared domain. With the
    /// domain record to start when its daemon must be started.
    pub fn standby_domain(
        &mut self,
        policy: &Policy,
        of: DomainId,
    ) -> Result<(DomainId, Option<DomainRecord>), PlaceError> {
        if self.tenancy(of) == Tenancy::Standby {
            return Ok((DomainId::shared(of.gpu), None));
        }
        self.place_as(policy, of.gpu, Tenancy::Standby, 0, (None, None))
    }

    /// Where a task hit in domain `of` may restart while `of` recovers, as its standby would
    /// have waited: from the shared domain, the GPU's existing standby domain; from the standby
    /// domain (a task that took over or restarted there), the shared one. Never a fenced one.
    /// None for a task in a job's or a user's own server (it keeps the isolation it was placed
    /// for) and where the GPU has no standby domain (one is not made for a restart: a new server
    /// starts no sooner than the old one recovers).
    pub fn restart_elsewhere(&self, of: DomainId) -> Option<DomainId> {
        let to = match self.tenancy(of) {
            Tenancy::Shared => {
                self.domains
                    .iter()
                    .find(|r| r.id.gpu == of.gpu && r.tenancy == Tenancy::Standby)?
                    .id
            }
            Tenancy::Standby => DomainId::shared(of.gpu),
            Tenancy::Job(_) | Tenancy::User(_) => return None,
        };
        (!self.is_fenced(to)).then_some(to)
    }

    /// The last registered task of domain `id` left: it is empty from now on, so placement may
    /// take it over at once (the linger loop only stops its daemon later).
    pub fn mark_empty(&mut self, id: DomainId, now_ms: u64) {
        if let Some(r) = self.domains.iter_mut().find(|r| r.id == id) {
            r.empty_since_ms.get_or_insert(now_ms);
        }
    }

    /// Remembers a fault's culprit so that its next run is placed apart; returns who, when newly
    /// quarantined (a re-decision of the same fault only extends it).
    pub fn quarantine(
        &mut self,
        policy: &Policy,
        job: u32,
        uid: u32,
        now_ms: u64,
    ) -> Option<Quarantined> {
        let who = match policy.quarantine {
            QuarantineRule::Off => return None,
            QuarantineRule::Job => Quarantined::Job(job),
            QuarantineRule::User => Quarantined::User(uid),
        };
        let until = now_ms + policy.quarantine_ms;
        let before = self.quarantine.len();
        self.quarantine.retain(|(q, _)| *q != who);
        let new = self.quarantine.len() == before;
        self.quarantine.push((who, until));
        new.then_some(who)
    }

    pub fn quarantined(&self) -> impl Iterator<Item = &(Quarantined, u64)> {
        self.quarantine.iter()
    }

    /// Updates emptiness from `in_use` and returns the domains empty for longer than `linger_ms`.
    pub fn expired(
        &mut self,
        in_use: impl Fn(DomainId) -> bool,
        now_ms: u64,
        linger_ms: u64,
    ) -> Vec<DomainId> {
        let mut out = Vec::new();
        for r in &mut self.domains {
            // A fenced domain is not stopped: its slot stays taken until it answers again.
            if self.fenced.contains(&r.id) {
                continue;
            }
            if in_use(r.id) {
                r.empty_since_ms = None;
            } else {
                let since = r.empty_since_ms.get_or_insert(now_ms);
                // A clock stepped back: count the linger from now, not from a time still ahead.
                if *since > now_ms {
                    *since = now_ms;
                }
                if now_ms.saturating_sub(*since) >= linger_ms {
                    out.push(r.id);
                }
            }
        }
        out
    }
}

/// The domains of each GPU that a set of tasks uses, with their jobs.
pub fn jobs_by_domain<'a>(
    tasks: impl Iterator<Item = &'a crate::store::registry::Task>,
    gpu: u32,
) -> BTreeMap<DomainId, BTreeSet<u32>> {
    let mut m: BTreeMap<DomainId, BTreeSet<u32>> = BTreeMap::new();
    for t in tasks {
        if let Some(d) = t.domain_on(gpu) {
            m.entry(d).or_default().insert(t.job_id);
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(max: u32) -> Policy {
        Policy {
            default: Isolation::Shared,
            allowed: Isolation::ALL.into_iter().collect(),
            max_per_gpu: max,
            quarantine: QuarantineRule::Job,
            quarantine_ms: 1000,
        }
    }

    #[test]
    fn a_fenced_domain_is_never_placed_into_nor_taken_over() {
        let p = policy(3);
        let mut t = DomainTable::default();
        let none = (None, None);
        let job = Some(Isolation::Job);
        let a = t.place(&p, 0, 1, 100, job, none, 0).unwrap().id;
        t.fence(a);
        t.fence(DomainId::shared(0));
        assert!(matches!(
            t.place(&p, 0, 2, 100, None, none, 0),
            Err(PlaceError::Fenced { .. })
        ));
        // The shared domain of another GPU serves on.
        assert_eq!(
            t.place(&p, 1, 2, 100, None, none, 0).unwrap().id,
            DomainId::shared(1)
        );
        // Job 1's fenced domain is not handed out again, to it or to another job, even empty.
        t.mark_empty(a, 0);
        let b = t.place(&p, 0, 3, 100, job, none, 0).unwrap().id;
        assert_ne!(b, a);
        t.mark_empty(b, 0);
        let c = t.place(&p, 0, 4, 100, job, none, 10).unwrap().id;
        assert_eq!(
            c, b,
            "the empty unfenced one is taken over, not the fenced one"
        );
        assert!(
            t.expired(|_| false, 1_000_000, 1).iter().all(|d| *d != a),
            "never stopped"
        );
        assert!(t.unfence(a) && !t.is_fenced(a));
    }

    #[test]
    fn placement_by_isolation() {
        let p = policy(4);
        let mut t = DomainTable::default();
        let none = (None, None);
        let shared = t.place(&p, 0, 1, 100, None, none, 0).unwrap();
        assert_eq!(shared.id, DomainId::shared(0));
        assert!(shared.start.is_none());
        let a = t
            .place(&p, 0, 2, 100, Some(Isolation::Job), (Some(50), None), 0)
            .unwrap();
        assert_eq!(a.id, DomainId { gpu: 0, slot: 1 });
        assert_eq!(a.start.as_ref().unwrap().thread_pct, Some(50));
        // Another task of the same job joins its domain; nothing to start.
        let a2 = t
            .place(&p, 0, 2, 100, Some(Isolation::Job), none, 0)
            .unwrap();
        assert_eq!((a2.id, a2.start), (a.id, None));
        let b = t
            .place(&p, 0, 3, 100, Some(Isolation::Job), none, 0)
            .unwrap();
        assert_eq!(b.id.slot, 2);
        let u1 = t
            .place(&p, 0, 4, 200, Some(Isolation::User), none, 0)
            .unwrap();
        let u2 = t
            .place(&p, 0, 5, 200, Some(Isolation::User), none, 0)
            .unwrap();
        assert_eq!(u1.id, u2.id, "one domain per user");
        assert_eq!(t.get(u1.id).unwrap().owner_uid, Some(200));
        // The same job on another GPU gets a domain there.
        let other = t
            .place(&p, 1, 2, 100, Some(Isolation::Job), none, 0)
            .unwrap();
        assert_eq!(other.id, DomainId { gpu: 1, slot: 1 });
    }

    #[test]
    fn cap_refuses_unless_an_empty_domain_can_be_taken_over() {
        let p = policy(2);
        let mut t = DomainTable::default();
        let none = (None, None);
        let a = t
            .place(&p, 0, 1, 100, Some(Isolation::Job), none, 0)
            .unwrap();
        let e = t
            .place(&p, 0, 2, 100, Some(Isolation::Job), none, 0)
            .unwrap_err();
        assert_eq!(e, PlaceError::Full { gpu: 0, max: 2 });
        assert!(e.to_string().contains("mps.max_domains_per_gpu"));
        // Job 1's last task left: its domain is empty at once, so job 2 takes it over (without
        // waiting for the linger loop to notice).
        t.mark_empty(a.id, 10);
        let b = t
            .place(&p, 0, 2, 100, Some(Isolation::Job), none, 20)
            .unwrap();
        assert_eq!(b.id, a.id);
        assert_eq!(b.start.unwrap().tenancy, Tenancy::Job(2));
    }

    #[test]
    fn a_quarantined_job_with_no_domain_free_runs_where_it_asked() {
        let p = policy(2);
        let mut t = DomainTable::default();
        let none = (None, None);
        let busy = t
            .place(&p, 0, 1, 100, Some(Isolation::Job), none, 0)
            .unwrap();
        assert!(t.quarantine(&p, 7, 200, 0).is_some());
        // Job 7 (quarantined) comes back asking for the shared domain: none free, so shared.
        let q = t.place(&p, 0, 7, 200, None, none, 10).unwrap();
        assert!(
            q.id.is_shared() && !q.quarantined && q.quarantine_waived,
            "{q:?}"
        );
        assert_eq!(q.isolation, Isolation::Shared);
        // Once a domain is free, the quarantine holds again.
        t.mark_empty(busy.id, 20);
        let q = t.place(&p, 0, 7, 200, None, none, 30).unwrap();
        assert!(
            q.quarantined && !q.quarantine_waived && q.id == busy.id,
            "{q:?}"
        );
        // A job that asks for a domain of its own with none free is refused, quarantined or not.
        assert!(t.quarantine(&p, 8, 200, 40).is_some());
        assert_eq!(
            t.place(&p, 0, 8, 200, Some(Isolation::Job), none, 50),
            Err(PlaceError::Full { gpu: 0, max: 2 })
        );
    }

    #[test]
    fn a_hit_task_restarts_elsewhere_only_from_the_shared_or_the_standby_domain() {
        let p = policy(4);
        let mut t = DomainTable::default();
        let shared = DomainId::shared(0);
        assert_eq!(t.restart_elsewhere(shared), None, "no standby domain yet");
        let (sb, _) = t.standby_domain(&p, shared).unwrap();
        assert_eq!(t.restart_elsewhere(shared), Some(sb));
        assert_eq!(t.restart_elsewhere(sb), Some(shared));
        assert_eq!(
            t.restart_elsewhere(DomainId::shared(1)),
            None,
            "another GPU"
        );
        let job = t
            .place(&p, 0, 5, 100, Some(Isolation::Job), (None, None), 0)
            .unwrap();
        assert_eq!(t.restart_elsewhere(job.id), None, "its own server");
        t.fence(sb);
        assert_eq!(t.restart_elsewhere(shared), None);
        t.fence(shared);
        assert_eq!(t.restart_elsewhere(sb), None);
    }

    #[test]
    fn a_standby_waits_in_another_domain_than_its_task() {
        let p = policy(3);
        let mut t = DomainTable::default();
        let (sb, start) = t.standby_domain(&p, DomainId::shared(0)).unwrap();
        assert!(!sb.is_shared());
        let rec = start.expect("a new domain to start");
        assert_eq!((rec.tenancy, rec.owner_uid), (Tenancy::Standby, None));
        // One standby domain per GPU, for the tasks of every other domain.
        let job = t
            .place(&p, 0, 5, 100, Some(Isolation::Job), (None, None), 0)
            .unwrap();
        assert_eq!(t.standby_domain(&p, job.id).unwrap(), (sb, None));
        // A task that took over runs in the standby domain: its own standby waits in the shared.
        assert_eq!(
            t.standby_domain(&p, sb).unwrap(),
            (DomainId::shared(0), None)
        );
        // Another GPU gets its own.
        assert_eq!(t.standby_domain(&p, DomainId::shared(1)).unwrap().0.gpu, 1);
    }

    #[test]
    fn not_allowed_is_refused_with_the_allowed_list() {
        let mut p = policy(4);
        p.allowed = [Isolation::Shared].into_iter().collect();
        let mut t = DomainTable::default();
        let e = t
            .place(&p, 0, 1, 100, Some(Isolation::Job), (None, None), 0)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "isolation 'job' is not allowed on this node (allowed: shared)"
        );
    }

    #[test]
    fn a_clock_stepped_back_stretches_neither_quarantine_nor_linger() {
        let p = policy(4);
        let hour = 3_600_000;
        let mut t = DomainTable::default();
        let day = 86_400_000;
        assert!(t.quarantine(&p, 7, 100, day).is_some());
        // The clock goes back an hour: still quarantined, but for quarantine_ms from now at most.
        assert!(
            t.place(&p, 0, 7, 100, None, (None, None), day - hour)
                .unwrap()
                .quarantined
        );
        let after = day - hour + p.quarantine_ms;
        assert!(
            !t.place(&p, 0, 7, 100, None, (None, None), after)
                .unwrap()
                .quarantined,
            "over once quarantine_ms has passed on the new clock"
        );
        // An empty domain whose emptiness began "in the future" lingers linger_ms from now.
        let q = t
            .place(&p, 0, 8, 100, Some(Isolation::Job), (None, None), day)
            .unwrap();
        assert!(t.expired(|_| false, day, 1_000).is_empty());
        assert!(t.expired(|_| false, day - hour, 1_000).is_empty());
        assert!(t
            .expired(|_| false, day - hour + 1_000, 1_000)
            .contains(&q.id));
    }

    #[test]
    fn quarantined_job_goes_apart_until_it_expires() {
        let p = policy(4);
        let mut t = DomainTable::default();
        assert_eq!(t.quarantine(&p, 7, 100, 0), Some(Quarantined::Job(7)));
        assert_eq!(t.quarantine(&p, 7, 100, 5), None, "extended, not new");
        let q = t.place(&p, 0, 7, 100, None, (None, None), 10).unwrap();
        assert!(q.quarantined);
        assert_eq!(q.isolation, Isolation::Job);
        assert_eq!(t.tenancy(q.id), Tenancy::Job(7));
        // Another job of the same user is not affected by a job quarantine.
        let other = t.place(&p, 0, 8, 100, None, (None, None), 10).unwrap();
        assert!(other.id.is_shared());
        // Expired: shared again.
        let later = t.place(&p, 0, 7, 100, None, (None, None), 2_000).unwrap();
        assert!(!later.quarantined && later.id.is_shared());
        let mut pu = p.clone();
        pu.quarantine = QuarantineRule::User;
        assert!(t.quarantine(&pu, 7, 100, 3_000).is_some());
        assert!(
            t.place(&pu, 0, 9, 100, None, (None, None), 3_001)
                .unwrap()
                .quarantined
        );
        let mut off = p;
        off.quarantine = QuarantineRule::Off;
        assert!(t.quarantine(&off, 10, 300, 3_000).is_none());
        assert!(
            !t.place(&off, 0, 10, 300, None, (None, None), 3_001)
                .unwrap()
                .quarantined
        );
    }

    #[test]
    fn empty_domains_expire_after_linger() {
        let p = policy(4);
        let mut t = DomainTable::default();
        let a = t
            .place(&p, 0, 1, 100, Some(Isolation::Job), (None, None), 0)
            .unwrap();
        assert!(t.expired(|_| true, 0, 100).is_empty());
        assert!(
            t.expired(|_| false, 1_000, 100).is_empty(),
            "starts lingering"
        );
        assert_eq!(t.expired(|_| false, 1_100, 100), vec![a.id]);
        // In use again: lingering stops.
        assert!(t.expired(|_| true, 1_200, 100).is_empty());
        assert!(t.expired(|_| false, 1_250, 100).is_empty());
    }

    #[test]
    fn paths_keep_the_shared_layout() {
        let run = Path::new("/run/m");
        assert_eq!(
            paths(run, DomainId::shared(1)),
            ("/run/m/gpu1/pipe".into(), "/run/m/gpu1/log".into())
        );
        assert_eq!(
            paths(run, DomainId { gpu: 1, slot: 3 }).0,
            PathBuf::from("/run/m/gpu1/d3/pipe")
        );
    }

    #[test]
    fn table_roundtrips() {
        let p = policy(4);
        let mut t = DomainTable::default();
        t.place(
            &p,
            0,
            1,
            100,
            Some(Isolation::Job),
            (Some(30), Some(1 << 30)),
            0,
        )
        .unwrap();
        let _ = t.quarantine(&p, 1, 100, 0);
        let s = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<DomainTable>(&s).unwrap(), t);
    }
}
