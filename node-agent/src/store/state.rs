//! What the agent keeps: the durable part (survives restarts) and the in-memory part of its state.

use crate::domain::DomainTable;
use crate::fault::correlate::Correlator;
use crate::store::queue::PendingAction;
use crate::store::registry::Registry;
use mpsr_proto::FaultClass;
use mpsr_proto::{DecisionRecord, DomainId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

pub const DONE_KEYS_KEPT: usize = 10_000;
const OUTCOME_JOBS_KEPT: usize = 2_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeEntry {
    pub fault_id: u64,
    pub gpu: u32,
    /// The task's domain on that GPU: its server must be ACTIVE again before a restart.
    #[serde(default)]
    pub slot: u32,
    /// Set for culprits and tasks on an unusable GPU: their supervisor is told to fail.
    pub fail: Option<String>,
    /// The task's standby was released to take over (its supervisor is told so, not to
    /// restart).
    #[serde(default)]
    pub takeover: Option<Takeover>,
    /// The kind of that standby (absent before 0.3: hot).
    #[serde(default)]
    pub standby_kind: mpsr_proto::standby::Kind,
    /// The task's supervisor has had its verdict. Kept (not removed) so that a re-decision of the
    /// same fault (its Xid after the server's line) sees what was done and hands nothing out again.
    #[serde(default)]
    pub consumed: bool,
}

/// Where a hit task's standby release stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "pid")]
pub enum Takeover {
    /// Decided; the agent is ending the primary and writing the release.
    Releasing(u32),
    /// The standby (this pid) was released and runs the task now.
    Released(u32),
    /// The standby could not be released (gone): the task is restarted as without one.
    Unavailable,
}

/// A task's hot standby: prepared by its supervisor in `domain`, armed once it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Standby {
    pub task: crate::store::registry::TaskKey,
    pub uid: u32,
    /// Where the standby waits: a fault domain other than the task's.
    pub domain: DomainId,
    /// The FIFO it waits on; the agent made it (root's directory, owned by `uid`).
    pub fifo: std::path::PathBuf,
    pub armed: Option<Armed>,
    /// Hot (absent in the states of agents before 0.3) or warm.
    #[serde(default)]
    pub kind: mpsr_proto::standby::Kind,
}

impl Standby {
    /// The standby's pid (0 while it is not armed).
    pub fn pid(&self) -> u32 {
        self.armed.map_or(0, |a| a.standby.0)
    }
}

/// Removes the FIFOs of standbys that are gone (outside the state lock).
pub fn remove_fifos(gone: &[Standby]) {
    for s in gone {
        let _ = std::fs::remove_file(&s.fifo);
    }
}

/// The two incarnations of an armed task, each a pid and its start time (/proc), so that a pid
/// reused by another process is never killed nor taken for the standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Armed {
    pub primary: (u32, Option<u64>),
    pub standby: (u32, Option<u64>),
}

impl ResumeEntry {
    pub fn domain(&self) -> DomainId {
        DomainId {
            gpu: self.gpu,
            slot: self.slot,
        }
    }
}
/// The resume board: a hit task's verdict, by task. On disk a list of `[job, step, pid, entry]`;
/// the map `"job.step.pid" -> entry` of older state files is read too.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResumeBoard(BTreeMap<crate::store::registry::TaskKey, ResumeEntry>);

impl ResumeBoard {
    pub fn get(&self, k: crate::store::registry::TaskKey) -> Option<&ResumeEntry> {
        self.0.get(&k)
    }
    pub fn get_mut(&mut self, k: crate::store::registry::TaskKey) -> Option<&mut ResumeEntry> {
        self.0.get_mut(&k)
    }
    pub fn insert(&mut self, k: crate::store::registry::TaskKey, e: ResumeEntry) {
        self.0.insert(k, e);
    }
    pub fn remove(&mut self, k: crate::store::registry::TaskKey) -> Option<ResumeEntry> {
        self.0.remove(&k)
    }
    /// A takeover under way or done for a task of `job` hit by fault `fault_id`.
    pub fn get_job_takeover(&self, job: u32, fault_id: u64) -> Option<Takeover> {
        self.0
            .iter()
            .filter(|((j, _, _), e)| *j == job && e.fault_id == fault_id)
            .find_map(|(_, e)| e.takeover)
    }

    /// The kind of the standby released for a task of `job` at fault `fault_id`, if one was.
    pub fn job_takeover_kind(&self, job: u32, fault_id: u64) -> Option<mpsr_proto::standby::Kind> {
        self.0
            .iter()
            .filter(|((j, _, _), e)| *j == job && e.fault_id == fault_id && e.takeover.is_some())
            .map(|(_, e)| e.standby_kind)
            .next()
    }
    /// Forgets every task of a job (its next run starts clean).
    pub fn remove_job(&mut self, job: u32) {
        self.0.retain(|(j, _, _), _| *j != job);
    }
}

impl Serialize for ResumeBoard {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|((j, st, p), e)| (j, st, p, e)))
    }
}

impl<'de> Deserialize<'de> for ResumeBoard {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OnDisk {
            List(Vec<(u32, u32, u32, ResumeEntry)>),
            Keyed(BTreeMap<String, ResumeEntry>),
        }
        Ok(ResumeBoard(match OnDisk::deserialize(d)? {
            OnDisk::List(l) => l.into_iter().map(|(j, s, p, e)| ((j, s, p), e)).collect(),
            OnDisk::Keyed(m) => m
                .into_iter()
                .filter_map(|(k, e)| {
                    let mut it = k.split('.').map(|x| x.parse::<u32>().ok());
                    match (it.next(), it.next(), it.next(), it.next()) {
                        (Some(Some(j)), Some(Some(s)), Some(Some(p)), None) => Some(((j, s, p), e)),
                        _ => None,
                    }
                })
                .collect(),
        }))
    }
}

/// Everything that must survive an agent restart.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Durable {
    pub registry: Registry,
    /// Job and user fault domains, and who is quarantined.
    #[serde(default)]
    pub domains: DomainTable,
    pub next_fault_id: u64,
    pub pending: Vec<PendingAction>,
    pub done_keys: VecDeque<crate::store::queue::ActionKey>,
    /// job -> outcome lines (requeue done, resume handed over, ...).
    pub outcomes: BTreeMap<u32, Vec<String>>,
    /// Hit task -> what its resume supervisor is told.
    pub resume: ResumeBoard,
    /// gpu -> why it is unhealthy (hardware fault class).
    pub unhealthy: BTreeMap<u32, (FaultClass, String)>,
    /// Reports of jobs that ended here, with their owner uid, for `mpsrctl report` afterwards.
    #[serde(default)]
    pub finished: BTreeMap<u32, (u32, mpsr_proto::JobReport)>,
    /// The last registry journal entry this state file includes.
    #[serde(default)]
    pub journal_seq: u64,
    /// Owner uid of each job seen here (prolog, or slurmstepd's registration): a job's report and
    /// events stay readable to its owner after its tasks are gone.
    #[serde(default)]
    pub owners: BTreeMap<u32, u32>,
    /// Jobs whose requeue Slurm carried out (or had already done), with the fault: at job end their
    /// kept GPU state waits for the next run.
    #[serde(default)]
    pub requeued: BTreeMap<u32, u64>,
    /// Jobs Slurm runs on this node now, as Slurm itself said (the prolog's job start, a
    /// registration by slurmstepd), until the epilog's job end: the only jobs a user may register
    /// a process into, and only as the job's owner.
    #[serde(default)]
    pub running: BTreeMap<u32, JobRun>,
    /// Hot standbys of resume-mode tasks.
    #[serde(default)]
    pub standbys: Vec<Standby>,
    /// Jobs this agent requeued: the restart count their next run has at least. Slurm skips the
    /// prolog of a requeued job that starts again here while its credential is still cached, and
    /// the SPANK item and environment read 0 in a batch step on 22.05: without this, such a run
    /// looked like the one already requeued and was left to die when hit.
    #[serde(default)]
    pub next_run: BTreeMap<u32, u32>,
    /// Jobs whose kept GPU state waits for their requeued next run (until, unix ms): freed at
    /// once when Slurm says the job will not run again (cancelled or ended while pending).
    #[serde(default)]
    pub kept_for_requeue: BTreeMap<u32, u64>,
    /// Where the kernel-log and MPS-log readers were, just past the last signal decided: a
    /// restarted agent reads on from there.
    #[serde(default)]
    pub cursors: crate::signal::Cursors,
}

/// One run of a job on this node, as Slurm reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRun {
    pub uid: u32,
    /// Slurm's restart count of this run (0 on the first run, n after n requeues).
    pub restart_count: u32,
    /// Said by the prolog (slurmd's own count): what a registration says then counts for
    /// nothing, since it may come from the job's environment, which is the user's.
    #[serde(default)]
    pub from_prolog: bool,
}

/// Slurm keeps a job's restart count in 16 bits: a larger count did not come from Slurm.
pub const MAX_RESTART_COUNT: u32 = u16::MAX as u32;

/// A restart count as reported (a registration's may come from the job's environment): one Slurm
/// cannot have is taken as unknown (0).
pub fn plausible_restart_count(n: u32) -> u32 {
    if n > MAX_RESTART_COUNT {
        0
    } else {
        n
    }
}

/// What telemetry found, kept in its own file (telemetry.json) so that the state file written on
/// every decision and job start/end does not carry it.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct TelemetryLog {
    /// Pathology findings (raised and cleared), most recent last.
    pub records: VecDeque<mpsr_proto::PathologyRecord>,
    /// Findings active when last saved: the detector resumes them after a restart, so a node
    /// drained for one is not resumed by the restart alone.
    pub active: Vec<mpsr_telemetry::Finding>,
}

impl Durable {
    /// The owner of a job: what Slurm said of its current run, else its live tasks, else what the
    /// prolog or a registration said of an earlier run.
    pub fn owner_of(&self, job: u32) -> Option<u32> {
        self.running
            .get(&job)
            .map(|r| r.uid)
            .or_else(|| self.registry.job_owner(job))
            .or_else(|| self.owners.get(&job).copied())
            .or_else(|| self.finished.get(&job).map(|f| f.0))
    }

    pub fn remember_owner(&mut self, job: u32, uid: u32) {
        self.owners.insert(job, uid);
        bound(&mut self.owners);
    }

    /// Tasks left the registry (deregistered, job ended, process gone): a job or user domain no
    /// remaining task uses is empty from now on, so placement may take it over at once.
    pub fn tasks_left<'a>(
        &mut self,
        left: impl IntoIterator<Item = &'a crate::store::registry::Task>,
        now_ms: u64,
    ) {
        let domains: BTreeSet<DomainId> = left
            .into_iter()
            .flat_map(|t| t.domains.iter().copied())
            .collect();
        for d in domains {
            if !self.registry.tasks().any(|t| t.in_domain(d)) {
                self.domains.mark_empty(d, now_ms);
            }
        }
    }

    /// Forgets the standbys `which` selects; returns them (their FIFOs are the caller's to
    /// remove, outside the lock).
    pub fn drop_standbys(&mut self, which: impl Fn(&Standby) -> bool) -> Vec<Standby> {
        let (gone, kept) = std::mem::take(&mut self.standbys)
            .into_iter()
            .partition(|s| which(s));
        self.standbys = kept;
        gone
    }

    /// Slurm says this run of the job is on this node (prolog, or slurmstepd's registration).
    /// Returns the run's restart count: the larger of what either said, since one of them may
    /// not know it (the SPANK item reads 0 in a requeued batch step on Slurm 22.05).
    /// A registration's count may come from the job's environment (the user's): Slurm's own, the
    /// prolog's, wins where there is one, and a count Slurm cannot have is ignored.
    pub fn note_running(&mut self, job: u32, uid: u32, restart_count: u32) -> u32 {
        let restart_count = plausible_restart_count(restart_count).max(self.next_run_of(job));
        let run = self.running.entry(job).or_insert(JobRun {
            uid,
            restart_count,
            from_prolog: false,
        });
        run.uid = uid;
        if !run.from_prolog {
            run.restart_count = run.restart_count.max(restart_count);
        }
        let n = run.restart_count;
        bound(&mut self.running);
        self.remember_owner(job, uid);
        n
    }

    /// A new run of the job starts here (the prolog): what is known of it is this run's.
    pub fn start_run(&mut self, job: u32, uid: u32, restart_count: u32) {
        let restart_count = plausible_restart_count(restart_count).max(self.next_run_of(job));
        self.running.insert(
            job,
            JobRun {
                uid,
                restart_count,
                from_prolog: true,
            },
        );
        bound(&mut self.running);
        self.remember_owner(job, uid);
    }

    /// Slurm carried out (or had done) the requeue of run `restarts_before` of the job.
    pub fn note_requeued(&mut self, job: u32, fault_id: u64, restarts_before: Option<u32>) {
        self.requeued.insert(job, fault_id);
        bound(&mut self.requeued);
        if let Some(r) = restarts_before {
            let next = self.next_run.entry(job).or_insert(0);
            *next = (*next).max(r.saturating_add(1));
            bound(&mut self.next_run);
        }
    }

    /// The least restart count a new run of the job has: one more than the last run requeued
    /// here, once that run's tasks are gone (a late task of the requeued run is still that run).
    fn next_run_of(&self, job: u32) -> u32 {
        match self.next_run.get(&job) {
            Some(n) if !self.registry.tasks().any(|t| t.job_id == job) => *n,
            _ => 0,
        }
    }

    /// Jobs of `uid` known here (live, or ended with their report kept).
    pub fn jobs_of(&self, uid: u32) -> std::collections::BTreeSet<u32> {
        self.registry
            .tasks()
            .filter(|t| t.uid == uid)
            .map(|t| t.job_id)
            .chain(
                self.owners
                    .iter()
                    .filter(|(_, u)| **u == uid)
                    .map(|(j, _)| *j),
            )
            .chain(
                self.finished
                    .iter()
                    .filter(|(_, f)| f.0 == uid)
                    .map(|(j, _)| *j),
            )
            .collect()
    }
}

/// Keeps a per-job map as bounded as the outcome lines (oldest job ids go first).
fn bound<V>(m: &mut BTreeMap<u32, V>) {
    while m.len() > OUTCOME_JOBS_KEPT {
        let Some(first) = m.keys().next().copied() else {
            break;
        };
        m.remove(&first);
    }
}

/// A domain whose server is expected to be in FAULT after a decision.
pub struct Recovering {
    pub fault_id: u64,
    pub since: Instant,
    /// The jobs the fault hit: their clients may be ended to let the server recover.
    pub hit_jobs: BTreeSet<u32>,
    /// Clients ended with SIGKILL (terminate_client does not reach an idle client).
    pub killed: BTreeSet<u32>,
    /// When /proc was last searched for the hit tasks' CUDA processes (at most once a second:
    /// the health loop comes by every 50 ms).
    pub scanned_at: Option<Instant>,
    /// Clients of no hit job that still hold the server in FAULT (reported once).
    pub blockers_reported: BTreeSet<u32>,
    /// Processes the agent itself ended for this fault (a takeover's primary and its
    /// descendants, by pid and start time): hit clients until they are gone, whatever job the
    /// registry now says they belong to.
    pub fenced_pids: Vec<(u32, Option<u64>)>,
    /// Rungs of the escalation ladder climbed (`act::escalation`), and whether one is under way.
    pub climbed: usize,
    pub escalating: bool,
    /// The hit resume tasks' processes were ended at the start of the recovery (`act::recovery`).
    pub primaries_ended: bool,
}

pub struct State {
    pub durable: Durable,
    pub history: VecDeque<DecisionRecord>,
    pub telemetry: TelemetryLog,
    pub correlator: Correlator,
    pub recovering: BTreeMap<DomainId, Recovering>,
    /// Tasks that just exited abnormally. A fault kills its clients at about the moment its Xid is
    /// reported, so a victim may deregister before the fault's first signal arrives: it still
    /// counts as hit for a short while.
    pub recent_exits: VecDeque<(Instant, crate::store::registry::Task)>,
    /// Tasks whose standby took over during a fault still open: for that fault's re-decisions
    /// they are where the fault found them (the hit set of one fault does not change because a
    /// hit task moved to its standby's domain).
    pub moved: Vec<Moved>,
    /// What the agent did since it started, per GPU (Prometheus counters: they start at 0 again
    /// after a restart, which `rate()` and `increase()` handle).
    pub totals: BTreeMap<u32, FaultTotals>,
    /// Tasks that exited while the agent was down: victims of a fault read back after the
    /// restart (its evidence replayed), for as long as that catch-up can take.
    pub down_exits: DownExits,
    /// Rungs of the escalation ladder climbed since the agent started, per GPU (a counter).
    pub escalations: BTreeMap<(u32, mpsr_proto::EscalationRung), u64>,
    /// Xids seen in decided faults since the agent started, per (GPU, Xid, the Xid's class).
    pub xid_totals: BTreeMap<(u32, u32, mpsr_proto::FaultClass), u64>,
    /// Registry changes not yet in the journal file.
    pub journal_pending: Vec<crate::store::journal::Entry>,
    pub next_seq: u64,
}

/// Tasks that exited while the agent was down, kept for the catch-up after its start.
#[derive(Debug, Clone)]
pub struct DownExits {
    pub tasks: Vec<crate::store::registry::Task>,
    /// After this the catch-up is over (the readers have read their backlog long since).
    pub until: Instant,
}

impl DownExits {
    /// How long after the start a replayed fault may still name them.
    pub const CATCH_UP: std::time::Duration = std::time::Duration::from_secs(120);

    pub fn new(tasks: Vec<crate::store::registry::Task>) -> DownExits {
        DownExits {
            tasks,
            until: Instant::now() + Self::CATCH_UP,
        }
    }

    /// The tasks on `gpu`, while the catch-up lasts.
    pub fn on_gpu(
        &self,
        gpu: u32,
        now: Instant,
    ) -> impl Iterator<Item = &crate::store::registry::Task> {
        let live = now < self.until;
        self.tasks
            .iter()
            .filter(move |t| live && t.gpus.contains(&gpu))
    }
}

impl Default for DownExits {
    fn default() -> Self {
        DownExits::new(Vec::new())
    }
}

/// Counts of one GPU since the agent started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultTotals {
    /// Faults decided (each once, however often it was decided again).
    pub faults: u64,
    /// Jobs those faults hit (a job counted once per fault).
    pub hit_jobs: u64,
    /// Hot standbys that took over a hit task.
    pub takeovers: u64,
}

/// A task that moved (its standby took over, or it restarted elsewhere) from `from` while fault
/// `fault_id` was being decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    pub fault_id: u64,
    pub task: crate::store::registry::TaskKey,
    pub from: DomainId,
}

impl State {
    /// The state over what was read back (the durable part, the decision history, the telemetry
    /// log, the tasks that exited while the agent was down), with nothing in flight; faults'
    /// signals within `window` are one fault; the registry journal goes on at `next_seq`.
    pub fn new(
        durable: Durable,
        history: VecDeque<mpsr_proto::DecisionRecord>,
        telemetry: TelemetryLog,
        window: Duration,
        gone: Vec<crate::store::registry::Task>,
        next_seq: u64,
    ) -> State {
        State {
            durable,
            history,
            telemetry,
            correlator: Correlator::new(window),
            recovering: BTreeMap::new(),
            recent_exits: VecDeque::new(),
            moved: Vec::new(),
            totals: Default::default(),
            escalations: Default::default(),
            xid_totals: Default::default(),
            down_exits: DownExits::new(gone),
            journal_pending: Vec::new(),
            next_seq,
        }
    }

    /// Every domain of these GPUs.
    pub fn all_domains(&self, gpus: impl IntoIterator<Item = u32>) -> Vec<DomainId> {
        gpus.into_iter()
            .flat_map(|g| self.domains_of_gpu(g))
            .collect()
    }

    /// Task `task` runs in domain `to` from now on (its standby there took over, or it restarted
    /// there): its next fault is that domain's. Fault `fault_id`'s re-decisions still see it where
    /// the fault found it.
    pub fn move_task(
        &mut self,
        fault_id: u64,
        task: crate::store::registry::TaskKey,
        to: DomainId,
    ) {
        let Some(t) = self.durable.registry.get_mut(task) else {
            return;
        };
        let from = t.domain_on(to.gpu).unwrap_or(DomainId::shared(to.gpu));
        t.domains.retain(|x| x.gpu != to.gpu);
        if !to.is_shared() {
            t.domains.push(to);
        }
        self.moved.push(Moved {
            fault_id,
            task,
            from,
        });
    }

    /// Every domain of a GPU whose daemon the agent runs (the shared one first).
    pub fn domains_of_gpu(&self, gpu: u32) -> Vec<DomainId> {
        std::iter::once(DomainId::shared(gpu))
            .chain(
                self.durable
                    .domains
                    .records()
                    .map(|r| r.id)
                    .filter(|d| d.gpu == gpu),
            )
            .collect()
    }

    /// Adds an outcome to a fault's decision record (if it is still in the history).
    pub fn add_outcome(&mut self, fault_id: u64, outcome: mpsr_proto::FaultOutcome) {
        if let Some(r) = self
            .history
            .iter_mut()
            .rev()
            .find(|r| r.fault_id == fault_id)
        {
            r.outcome.push(outcome.to_string());
            r.outcomes.push(outcome);
        }
    }

    /// Records a registry change for the journal (the change itself is already applied).
    pub fn journal(&mut self, op: crate::store::journal::Op) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.journal_pending
            .push(crate::store::journal::Entry { seq, op });
    }

    /// Notes an abnormal task exit (see `recent_exits`).
    pub fn note_exit(&mut self, t: crate::store::registry::Task, keep: Duration) {
        self.recent_exits.retain(|(at, _)| at.elapsed() < keep);
        self.recent_exits.push_back((Instant::now(), t));
        while self.recent_exits.len() > 10_000 {
            self.recent_exits.pop_front();
        }
    }
}

/// Keeps a finished job's report (bounded like the outcome lines).
pub fn archive_report(d: &mut Durable, owner: u32, report: mpsr_proto::JobReport) {
    d.finished.insert(report.job_id, (owner, report));
    while d.finished.len() > OUTCOME_JOBS_KEPT {
        let Some(first) = d.finished.keys().next().copied() else {
            break;
        };
        d.finished.remove(&first);
    }
}

pub fn push_outcome(outcomes: &mut BTreeMap<u32, Vec<String>>, job: u32, line: String) {
    outcomes.entry(job).or_default().push(line);
    while outcomes.len() > OUTCOME_JOBS_KEPT {
        let Some(first) = outcomes.keys().next().copied() else {
            break;
        };
        outcomes.remove(&first);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forged_restart_count_neither_overflows_nor_outvotes_slurms_own() {
        let mut d = Durable::default();
        // No prolog record: a count Slurm cannot have (16 bits) counts as unknown.
        assert_eq!(d.note_running(5, 1000, u32::MAX), 0);
        d.note_requeued(5, 1, Some(u32::MAX));
        assert_eq!(
            d.next_run.get(&5),
            Some(&u32::MAX),
            "saturated, no overflow"
        );
        // The prolog said run 1 (slurmd's count): the job's environment cannot raise it.
        let mut d = Durable::default();
        d.start_run(6, 1000, 1);
        assert_eq!(d.note_running(6, 1000, 40_000), 1);
        // Without a prolog (its credential cached), the count the agent requeued still counts.
        let mut d = Durable::default();
        d.note_requeued(7, 1, Some(0));
        assert_eq!(d.note_running(7, 1000, 0), 1);
    }

    #[test]
    fn resume_board_roundtrips_and_reads_the_older_keyed_form() {
        let e = ResumeEntry {
            fault_id: 3,
            gpu: 0,
            slot: 1,
            fail: None,
            takeover: None,
            standby_kind: Default::default(),
            consumed: false,
        };
        let mut b = ResumeBoard::default();
        b.insert((7, 0, 42), e.clone());
        b.insert((8, 0, 43), e.clone());
        let json = serde_json::to_string(&b).unwrap();
        assert_eq!(serde_json::from_str::<ResumeBoard>(&json).unwrap(), b);
        let old = r#"{"7.0.42":{"fault_id":3,"gpu":0,"slot":1,"fail":null},"bad.key":{"fault_id":1,"gpu":0,"fail":null}}"#;
        let b2: ResumeBoard = serde_json::from_str(old).unwrap();
        assert_eq!(b2.get((7, 0, 42)), Some(&e));
        b.remove_job(7);
        assert!(b.get((7, 0, 42)).is_none() && b.get((8, 0, 43)).is_some());
    }
}
