//! The fault core's stateful cases, each on a state built by hand and signals with set times.

use super::*;
use crate::config::FaultConfig;
use crate::domain::QuarantineRule;
use crate::fault::correlate::{GpuRef, Source};
use crate::store::queue::ActionKey;
use crate::store::state::State;
use mpsr_proto::{Isolation, Mode};
use std::collections::VecDeque;

const BATCH: u32 = mpsr_proto::BATCH_STEP;

struct World {
    st: State,
    classifier: Classifier,
    policy: Policy,
    faults: FaultConfig,
    t0: Instant,
}

fn ancestry(pid: u32) -> Vec<u32> {
    vec![pid]
}

impl World {
    fn new() -> World {
        let faults = FaultConfig::default();
        World {
            st: State::new(
                Durable::default(),
                VecDeque::new(),
                Default::default(),
                Duration::from_millis(faults.correlation_window_ms),
                Vec::new(),
                1,
            ),
            classifier: Classifier::default(),
            policy: Policy {
                default: Isolation::Shared,
                allowed: Isolation::ALL.into_iter().collect(),
                max_per_gpu: 4,
                quarantine: QuarantineRule::Job,
                quarantine_ms: 60_000,
            },
            faults,
            t0: Instant::now(),
        }
    }

    /// A batch task of `job` (uid 1000) in requeue mode on gpu0's shared domain, as slurmstepd
    /// registers it in run `restarts` of the job.
    fn batch_task(&mut self, job: u32, pid: u32, restarts: u32) {
        let n = self.st.durable.note_running(job, 1000, restarts);
        let t = Task {
            step_id: BATCH,
            restart_count: n,
            trusted: true,
            ..crate::store::registry::tests::task(job, pid, 1000, &[0])
        };
        self.st.durable.registry.register(t).unwrap();
    }

    fn at(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    fn signal(&self, source: Source, xid: Option<u32>, domain: Option<u32>, ms: u64) -> Signal {
        let mut s = Signal::new(source, GpuRef::Index(0), xid);
        s.domain = domain;
        s.at = self.at(ms);
        s.at_ms = 1_000_000 + ms;
        s
    }

    fn feed(&mut self, s: Signal) -> Vec<Effect> {
        let ctx = Ctx {
            classifier: &self.classifier,
            policy: &self.policy,
            node: "n1",
            faults: &self.faults,
            quarantine_s: 60,
            simulated: true,
            ancestry: &ancestry,
            now: s.at,
        };
        on_signal(&mut self.st, &ctx, 0, &s)
    }

    /// An Xid 31 whose server.log line came from the shared domain, `ms` after t0.
    fn shared_fault(&mut self, ms: u64) -> Vec<Effect> {
        let mut e = self.feed(self.signal(Source::Kmsg, Some(31), None, ms));
        e.extend(self.feed(self.signal(Source::MpsLog, None, Some(0), ms + 5)));
        e
    }

    fn requeues(&self) -> Vec<(u32, Option<u32>)> {
        self.st
            .durable
            .pending
            .iter()
            .filter_map(|p| match p.op {
                SlurmOp::Requeue {
                    job_id,
                    restarts_before,
                } => Some((job_id, restarts_before)),
                SlurmOp::Drain { .. } | SlurmOp::Annotate { .. } => None,
            })
            .collect()
    }

    /// What the Slurm worker records when a requeue is done.
    fn requeue_done(&mut self) {
        let (done, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.st.durable.pending)
            .into_iter()
            .partition(|p| matches!(p.op, SlurmOp::Requeue { .. }));
        self.st.durable.pending = later;
        for p in done {
            if let SlurmOp::Requeue {
                job_id,
                restarts_before,
            } = p.op
            {
                self.st
                    .durable
                    .note_requeued(job_id, p.fault_id, restarts_before);
            }
            self.st.durable.done_keys.extend(p.op.run_key());
            self.st.durable.done_keys.push_back(p.key);
        }
    }
}

#[test]
fn an_app_fault_no_domain_has_shown_yet_asks_the_servers_and_hits_nobody() {
    let mut w = World::new();
    w.batch_task(1, 100, 0);
    let e = w.feed(w.signal(Source::Kmsg, Some(31), None, 0));
    assert!(
        e.iter()
            .any(|e| matches!(e, Effect::Probe(p) if p.domains.contains(&DomainId::shared(0)))),
        "{e:?}"
    );
    assert!(w.st.durable.pending.is_empty());
    assert!(w.st.history[0].awaiting_domain);
    // The server's log line names the domain: decided again, job 1 requeued.
    let e = w.feed(w.signal(Source::MpsLog, None, Some(0), 40));
    assert!(e.contains(&Effect::Persist) && e.contains(&Effect::History));
    assert_eq!(w.requeues(), vec![(1, Some(0))]);
    assert_eq!(w.st.history.len(), 1, "re-decided, not a second fault");
    // Another source of the same fault adds nothing to decide: only the history changes.
    let e = w.feed(w.signal(Source::Nvml, Some(31), None, 60));
    assert_eq!(e, vec![Effect::History]);
    assert_eq!(
        w.st.history[0].sources,
        vec![Source::Kmsg, Source::MpsLog, Source::Nvml]
    );
}

#[test]
fn a_storm_requeues_each_run_of_a_job_once() {
    let mut w = World::new();
    w.batch_task(1, 100, 0);
    // Fifty faults a second apart (each its own fault): one requeue in flight.
    for i in 0..50 {
        w.shared_fault(i * 1000);
    }
    assert_eq!(w.requeues(), vec![(1, Some(0))]);
    assert_eq!(w.st.history.len(), 50, "each fault still recorded");
    let coalesced = w.st.durable.outcomes[&1]
        .iter()
        .filter(|l| l.contains("already under way"))
        .count();
    assert_eq!(coalesced, 49);
    // Done: later faults of the same run (its task lingering) queue nothing.
    w.requeue_done();
    w.shared_fault(60_000);
    assert!(w.requeues().is_empty());
    // The next run (restart 1, as the prolog says even where slurmstepd says 0) is requeued
    // when hit: once again, however often the job was requeued before.
    w.st.durable.registry.remove_job(1);
    w.st.durable.start_run(1, 1000, 1);
    w.batch_task(1, 101, 0);
    w.shared_fault(70_000);
    assert_eq!(w.requeues(), vec![(1, Some(1))]);
}

#[test]
fn a_requeued_run_that_comes_back_without_a_prolog_is_requeued_again() {
    // Slurm runs no prolog for a requeued job that starts again while its credential is cached,
    // and slurmstepd says restart 0: the run after a requeue done here is still a new one.
    let mut w = World::new();
    w.batch_task(1, 100, 0);
    w.shared_fault(0);
    assert_eq!(w.requeues(), vec![(1, Some(0))]);
    w.requeue_done();
    // A late registration of the requeued run (its task still there) is that run.
    w.batch_task(1, 102, 0);
    w.shared_fault(5_000);
    assert!(w.requeues().is_empty(), "the same run: not requeued twice");
    // The epilog ends the run; the next one registers (restart 0 said) and is hit.
    w.st.durable.registry.remove_job(1);
    w.st.durable.running.remove(&1);
    w.batch_task(1, 101, 0);
    w.shared_fault(60_000);
    assert_eq!(w.requeues(), vec![(1, Some(1))]);
    w.requeue_done();
    w.st.durable.registry.remove_job(1);
    w.st.durable.running.remove(&1);
    w.batch_task(1, 103, 0);
    w.shared_fault(120_000);
    assert_eq!(w.requeues(), vec![(1, Some(2))], "and the run after that");
}

#[test]
fn a_contained_claim_refuted_by_an_xid_is_a_whole_server_fault() {
    let mut w = World::new();
    w.batch_task(1, 100, 0);
    w.batch_task(2, 200, 0);
    let mut s = w.signal(Source::Isolation, Some(31), None, 0);
    s.culprit = Some((200, true));
    let e = w.feed(s);
    // Contained: the culprit's client alone is ended; nobody else is hit, no server watched.
    assert!(e.contains(&Effect::Terminate {
        domain: DomainId::shared(0),
        pid: 200,
        // Its job's line in Slurm's views first: a finished job's cannot be written.
        after: Some(ActionKey::Annotate { fault: 1, job: 2 }),
    }));
    assert!(w.st.history[0].contained);
    assert_eq!(w.st.history[0].hit_jobs, vec![2]);
    assert!(w.st.recovering.is_empty());
    // The Xid follows: the firmware cancelled after all; the whole server was hit.
    w.feed(w.signal(Source::Kmsg, Some(31), None, 30));
    let r = &w.st.history[0];
    assert!(!r.contained, "{r:?}");
    assert_eq!(r.hit_jobs, vec![1, 2]);
    assert!(w.st.recovering.contains_key(&DomainId::shared(0)));
    assert_eq!(
        w.requeues(),
        vec![(1, Some(0))],
        "the culprit is failed, the victim requeued"
    );
}

#[test]
fn the_sole_tenant_of_a_faulting_domain_is_quarantined() {
    let mut w = World::new();
    w.batch_task(7, 700, 0);
    w.shared_fault(0);
    assert_eq!(
        w.st.history[0].culprit_evidence,
        Some(mpsr_proto::CulpritEvidence::SoleTenant)
    );
    let q: Vec<_> =
        w.st.durable
            .domains
            .quarantined()
            .map(|(q, _)| *q)
            .collect();
    assert_eq!(q, vec![crate::domain::Quarantined::Job(7)]);
    // Its next run is placed apart.
    let p =
        w.st.durable
            .domains
            .place(&w.policy, 0, 7, 1000, None, (None, None), 1_000_100)
            .unwrap();
    assert!(p.quarantined && !p.id.is_shared(), "{p:?}");
}

#[test]
fn an_exit_just_before_the_fault_is_a_victim_and_an_earlier_one_is_not() {
    let mut w = World::new();
    w.batch_task(1, 100, 0);
    w.batch_task(2, 200, 0);
    w.batch_task(3, 300, 0);
    // Job 2 failed on its own 450 ms before the fault; job 3's task died of it 100 ms before the
    // agent heard of it.
    for (job, pid, ms) in [(2, 200, 1_550), (3, 300, 1_900)] {
        let t = w.st.durable.registry.remove((job, BATCH, pid)).unwrap();
        let at = w.at(ms);
        w.st.recent_exits.push_back((at, t));
    }
    w.shared_fault(2_000);
    assert_eq!(w.st.history[0].hit_jobs, vec![1, 3]);
    assert_eq!(w.requeues(), vec![(1, Some(0)), (3, Some(0))]);
}

#[test]
fn a_hardware_fault_drains_once_per_gpu_and_class() {
    let mut w = World::new();
    w.batch_task(1, 100, 0);
    w.feed(w.signal(Source::Kmsg, Some(79), None, 0));
    let drains = |w: &World| {
        w.st.durable
            .pending
            .iter()
            .filter(|p| matches!(p.op, SlurmOp::Drain { .. }))
            .count()
    };
    assert_eq!(drains(&w), 1);
    assert_eq!(w.requeues(), vec![(1, Some(0))]);
    // Every domain of the GPU is watched back.
    assert!(w.st.recovering.contains_key(&DomainId::shared(0)));
    w.feed(w.signal(Source::Kmsg, Some(79), None, 5_000));
    assert_eq!(drains(&w), 1, "drained already for gpu0 and this class");
}

#[test]
fn a_signal_for_no_open_fault_without_an_xid_is_not_a_fault() {
    let mut w = World::new();
    w.batch_task(1, 100, 0);
    let e = w.feed(w.signal(Source::ClientExit, None, None, 0));
    assert!(e.is_empty());
    assert!(w.st.history.is_empty() && w.st.durable.pending.is_empty());
}

impl World {
    /// An srun task of `job` in resume mode on gpu0's shared domain, with an armed standby in
    /// the standby domain (slot 1).
    fn resume_task_with_standby(&mut self, job: u32, pid: u32) {
        let t = Task {
            mode: Mode::Resume,
            batch: false,
            trusted: true,
            ..crate::store::registry::tests::task(job, pid, 1000, &[0])
        };
        self.st.durable.registry.register(t).unwrap();
        let (domain, _) = self
            .st
            .durable
            .domains
            .standby_domain(&self.policy, DomainId::shared(0))
            .unwrap();
        assert_eq!(domain, DomainId { gpu: 0, slot: 1 });
        self.st.durable.standbys.push(crate::store::state::Standby {
            task: (job, 0, pid),
            uid: 1000,
            domain,
            fifo: format!("/run/x/{job}").into(),
            armed: Some(crate::store::state::Armed {
                primary: (pid + 1, Some(1)),
                standby: (pid + 2, Some(2)),
            }),
            kind: Default::default(),
        });
    }
}

#[test]
fn a_hit_task_with_an_armed_standby_is_released_first() {
    let mut w = World::new();
    w.resume_task_with_standby(1, 100);
    w.batch_task(2, 200, 0);
    w.feed(w.signal(Source::Kmsg, Some(31), None, 0));
    // The server's line names the shared domain: the decision that hits job 1.
    let e = w.feed(w.signal(Source::MpsLog, None, Some(0), 5));
    let releases: Vec<_> = e
        .iter()
        .filter_map(|e| match e {
            Effect::Release(r) => Some(r.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(releases.len(), 1, "{e:?}");
    assert_eq!(releases[0].task, (1, 0, 100));
    assert_eq!(releases[0].standby.pid(), 102);
    // The release is the first effect of the decision that made it.
    assert!(matches!(e[0], Effect::Release(_)), "{e:?}");
    let entry = w.st.durable.resume.get((1, 0, 100)).unwrap();
    assert_eq!(
        entry.takeover,
        Some(crate::store::state::Takeover::Releasing(102))
    );
    assert!(
        w.st.durable.standbys.is_empty(),
        "a standby is released once"
    );
    assert_eq!(w.requeues(), vec![(2, Some(0))]);
}

#[test]
fn the_culprits_standby_is_never_released() {
    let mut w = World::new();
    // Alone in the shared domain: the fault's sole tenant, so its culprit.
    w.resume_task_with_standby(1, 100);
    let e = w.shared_fault(0);
    assert!(!e.iter().any(|x| matches!(x, Effect::Release(_))), "{e:?}");
    assert_eq!(w.st.history[0].culprit_job, Some(1));
    assert_eq!(w.st.durable.resume.get((1, 0, 100)).unwrap().takeover, None);
}

#[test]
fn standbys_in_a_faulted_server_are_ended() {
    let mut w = World::new();
    w.resume_task_with_standby(1, 100);
    w.batch_task(2, 200, 0);
    // A hardware fault: every server of the GPU, the standbys' one included, is in FAULT.
    let e = w.feed(w.signal(Source::Kmsg, Some(79), None, 0));
    assert!(
        e.iter()
            .any(|x| matches!(x, Effect::EndStandby(s) if s.pid() == 102)),
        "{e:?}"
    );
    assert!(!e.iter().any(|x| matches!(x, Effect::Release(_))));
    assert!(w.st.durable.standbys.is_empty());
}

/// A warm standby holds no CUDA context: a fault of the server it would use touches it not.
#[test]
fn a_warm_standby_is_not_ended_by_a_fault_of_its_server() {
    let mut w = World::new();
    w.resume_task_with_standby(1, 100);
    w.st.durable.standbys[0].kind = mpsr_proto::standby::Kind::Warm;
    w.batch_task(2, 200, 0);
    let e = w.feed(w.signal(Source::Kmsg, Some(79), None, 0));
    assert!(
        !e.iter().any(|x| matches!(x, Effect::EndStandby(_))),
        "{e:?}"
    );
    assert_eq!(w.st.durable.standbys.len(), 1);
}

#[test]
fn the_servers_line_releases_the_standby_and_the_xid_keeps_the_hit_set() {
    let mut w = World::new();
    w.resume_task_with_standby(1, 100);
    w.batch_task(2, 200, 0);
    // The server's fatal-error line comes before any Xid: decided at once.
    let e = w.feed(w.signal(Source::MpsLog, None, Some(0), 0));
    assert!(matches!(e[0], Effect::Release(_)), "{e:?}");
    assert_eq!(w.st.history[0].class, FaultClass::AppServer);
    // What the worker records once the standby runs: the task is in the standby's domain now.
    let sb_domain = DomainId { gpu: 0, slot: 1 };
    w.st.durable.registry.get_mut((1, 0, 100)).unwrap().domains = vec![sb_domain];
    w.st.moved.push(crate::store::state::Moved {
        fault_id: 1,
        task: (1, 0, 100),
        from: DomainId::shared(0),
    });
    w.st.durable.resume.get_mut((1, 0, 100)).unwrap().takeover =
        Some(crate::store::state::Takeover::Released(102));
    // The Xid decides the same fault again: the same two jobs were hit, nobody is its culprit,
    // and the task's takeover stands (its supervisor is not told to restart it).
    w.feed(w.signal(Source::Kmsg, Some(43), None, 20));
    assert_eq!(
        w.st.durable.resume.get((1, 0, 100)).unwrap().takeover,
        Some(crate::store::state::Takeover::Released(102))
    );
    let r = &w.st.history[0];
    assert_eq!(
        (r.class, r.hit_jobs.clone()),
        (FaultClass::AppSm, vec![1, 2])
    );
    assert_eq!(r.culprit_job, None);
    // A later fault of the standby domain is the task's.
    w.feed(w.signal(Source::MpsLog, None, Some(1), 5_000));
    assert_eq!(w.st.history[1].hit_jobs, vec![1]);
}

#[test]
fn each_run_of_a_hit_job_gets_one_settled_line_for_slurms_views() {
    let mut w = World::new();
    w.batch_task(1, 100, 0);
    w.batch_task(2, 200, 0);
    let lines = |w: &World| -> Vec<(u32, String, Option<u64>)> {
        w.st.durable
            .pending
            .iter()
            .filter_map(|p| match &p.op {
                SlurmOp::Annotate { job_id, line, .. } => {
                    Some((*job_id, line.clone(), p.not_before_ms))
                }
                _ => None,
            })
            .collect()
    };
    // The server's line first: decided as app_server, the line waits (at most the correlation
    // window) for the Xid, which settles the class and sends it.
    w.feed(w.signal(Source::MpsLog, None, Some(0), 0));
    assert_eq!(lines(&w)[0].2, Some(1_000_000 + 500), "{:?}", lines(&w));
    w.feed(w.signal(Source::Kmsg, Some(43), None, 20));
    let l = lines(&w);
    assert_eq!(l.len(), 2, "{l:?}");
    assert_eq!(
        l[0],
        (
            1,
            "mpsr: fault 1 xid 43 (app_sm) on n1 gpu0: victim; requeued".to_string(),
            None
        )
    );
    // A storm: later faults of the same run add no line.
    for i in 1..20 {
        w.shared_fault(i * 1000);
    }
    assert_eq!(lines(&w).len(), 2);
}

#[test]
fn a_verdict_taken_before_the_xid_is_not_handed_out_again_and_the_line_says_took_over() {
    let mut w = World::new();
    w.resume_task_with_standby(1, 100);
    w.batch_task(2, 200, 0);
    let e = w.feed(w.signal(Source::MpsLog, None, Some(0), 0));
    assert!(matches!(e[0], Effect::Release(_)), "{e:?}");
    // The standby ran and its supervisor had the verdict (under load, before the Xid came).
    let entry = w.st.durable.resume.get_mut((1, 0, 100)).unwrap();
    entry.takeover = Some(crate::store::state::Takeover::Released(102));
    entry.consumed = true;
    w.feed(w.signal(Source::Kmsg, Some(43), None, 20));
    let entry = w.st.durable.resume.get((1, 0, 100)).unwrap();
    assert!(
        entry.consumed,
        "the re-decision hands the verdict out again"
    );
    assert_eq!(
        entry.takeover,
        Some(crate::store::state::Takeover::Released(102))
    );
    let line =
        w.st.durable
            .pending
            .iter()
            .find_map(|p| match &p.op {
                SlurmOp::Annotate {
                    job_id: 1, line, ..
                } => Some(line.clone()),
                _ => None,
            })
            .expect("job 1's line is queued");
    assert!(
        line.ends_with("victim; its hot standby took over"),
        "{line}"
    );
}

/// Every Xid of a decided fault is counted once by its own class, an unknown one too (it is
/// surfaced in `mpsr_xids_total{class="unknown"}`, not only logged); Xid 154 by the recovery
/// action its line names.
#[test]
fn each_xid_is_counted_once_by_its_class_unknown_ones_too() {
    let mut w = World::new();
    w.batch_task(7, 100, 0);
    w.feed(w.signal(Source::Kmsg, Some(4242), None, 0));
    w.feed(w.signal(Source::Nvml, Some(4242), None, 1));
    assert_eq!(
        w.st.xid_totals.get(&(0, 4242, FaultClass::Unknown)),
        Some(&1),
        "{:?}",
        w.st.xid_totals
    );
    assert!(w.requeues().is_empty(), "an unknown Xid hits nobody");
    let mut s = w.signal(Source::Kmsg, Some(154), None, 60_000);
    s.recovery = mpsr_proto::fault::RecoveryAction::from_code(0);
    w.feed(s);
    assert_eq!(w.st.xid_totals.get(&(0, 154, FaultClass::Info)), Some(&1));
    assert_eq!(w.st.history.back().map(|r| r.class), Some(FaultClass::Info));
    assert!(w.requeues().is_empty(), "recovery action None: nobody hit");
}

/// A cold standby (the supervisor's own waiter: nothing of the task runs in its domain) is
/// released at the decision like any other, so that the next incarnation starts while the hit
/// server recovers; it is recorded as such.
#[test]
fn a_cold_standby_is_released_at_the_decision_where_its_domain_runs() {
    let mut w = World::new();
    w.resume_task_with_standby(1, 100);
    w.st.durable.standbys[0].kind = mpsr_proto::standby::Kind::Cold;
    w.batch_task(2, 200, 0);
    let e = w.feed(w.signal(Source::MpsLog, None, Some(0), 0));
    assert!(
        matches!(&e[0], Effect::Release(r) if r.standby.kind == mpsr_proto::standby::Kind::Cold && r.task == (1, 0, 100)),
        "{e:?}"
    );
    let entry = w.st.durable.resume.get((1, 0, 100)).unwrap();
    assert_eq!(
        entry.takeover,
        Some(crate::store::state::Takeover::Releasing(102))
    );
    assert_eq!(entry.standby_kind, mpsr_proto::standby::Kind::Cold);
    assert!(w.st.durable.standbys.is_empty());
}

/// A cold standby whose domain is itself held by a fault, or is no longer where a task of the
/// hit domain may restart, is ended: its task restarts once its own server is ACTIVE again.
#[test]
fn a_cold_standby_that_cannot_restart_the_task_at_once_is_ended() {
    for case in ["its domain recovers", "its domain is gone"] {
        let mut w = World::new();
        w.resume_task_with_standby(1, 100);
        w.st.durable.standbys[0].kind = mpsr_proto::standby::Kind::Cold;
        let sb_domain = w.st.durable.standbys[0].domain;
        if case == "its domain recovers" {
            w.st.recovering.insert(
                sb_domain,
                crate::store::state::Recovering {
                    fault_id: 99,
                    since: std::time::Instant::now(),
                    hit_jobs: Default::default(),
                    killed: Default::default(),
                    scanned_at: None,
                    blockers_reported: Default::default(),
                    fenced_pids: Vec::new(),
                    climbed: 0,
                    escalating: false,
                    primaries_ended: false,
                },
            );
        } else {
            w.st.durable.domains.remove(sb_domain);
        }
        w.batch_task(2, 200, 0);
        let e = w.feed(w.signal(Source::MpsLog, None, Some(0), 0));
        assert!(
            !e.iter().any(|x| matches!(x, Effect::Release(_))),
            "{case}: {e:?}"
        );
        assert!(
            e.iter()
                .any(|x| matches!(x, Effect::EndStandby(s) if s.pid() == 102)),
            "{case}: {e:?}"
        );
        let entry = w.st.durable.resume.get((1, 0, 100)).unwrap();
        assert_eq!(entry.takeover, None, "{case}: restarted as without one");
        assert!(w.st.durable.standbys.is_empty());
    }
}
