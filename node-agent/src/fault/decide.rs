//! The decision: given a fault event and the registry, which jobs were hit and what to do for each.
//! Pure (no I/O) so every class can be tested exhaustively.

use crate::domain::jobs_by_domain;
use crate::fault::classify::{BlastRadius, ClassPolicy, Classifier, FaultClass, JobAction};
use crate::fault::correlate::FaultEvent;
use crate::store::registry::Registry;
use mpsr_proto::{CulpritEvidence, DomainId, Mode};
use std::collections::{BTreeMap, BTreeSet};

/// What a decision does (typed; records carry it as the line people read).
pub use mpsr_proto::FaultAction as Action;

/// A step id as people read it.
pub use mpsr_proto::step_name;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub class: FaultClass,
    pub hit: BTreeSet<u32>,
    /// Registered jobs not hit (other domains, other GPUs, or spared by isolation).
    pub spared: BTreeSet<u32>,
    /// The domains whose clients the fault killed.
    pub hit_domains: BTreeSet<DomainId>,
    /// An application fault that no domain has shown yet: the agent asks each domain's server.
    pub awaiting_domain: bool,
    pub culprit: Option<(u32, CulpritEvidence)>,
    /// The driver patch contained the fault to the culprit (a standing claim of a registered
    /// task): no server faulted, nobody else was touched.
    pub contained: bool,
    pub actions: Vec<Action>,
}

impl Decision {
    pub fn culprit_job(&self) -> Option<u32> {
        self.culprit.map(|c| c.0)
    }
}

/// `owner_of(pid)`: the registered job a process belongs to (itself or an ancestor is a task).
///
/// Who was hit follows what the hardware showed, never the kernel line's pid (wrong under MPS):
/// an application fault hits the jobs of the domains whose servers showed it (server.log fatal
/// error line, server in FAULT); until one has, nobody is hit and the decision says it waits. A
/// hardware fault hits every domain of the GPU. An isolation source naming a registered task of
/// the GPU narrows an isolatable fault to that task's job.
pub fn decide(
    ev: &FaultEvent,
    reg: &Registry,
    classifier: &Classifier,
    node: &str,
    owner_of: impl Fn(u32) -> Option<u32>,
) -> Decision {
    let class = class_of(ev, classifier);
    let policy = classifier.policy(class);
    let by_domain = jobs_by_domain(reg.tasks(), ev.gpu);
    let domain_of_job = |job: u32| {
        by_domain
            .iter()
            .find(|(_, jobs)| jobs.contains(&job))
            .map(|(d, _)| *d)
    };
    // A culprit named by the isolation source counts only when it is a registered task here; its
    // domain is then known to have faulted. A contained fault of an isolatable class hit it alone.
    let named = ev
        .culprit
        .and_then(&owner_of)
        .filter(|j| domain_of_job(*j).is_some())
        .filter(|_| policy.radius != BlastRadius::None);
    let isolated = named.filter(|_| policy.isolatable && ev.contained());
    let mut culprit = named.map(|j| (j, CulpritEvidence::Isolation));
    let (hit_domains, awaiting_domain) = hit_domains(ev, policy, &by_domain, named, isolated);
    let hit: BTreeSet<u32> = match isolated {
        Some(job) => [job].into(),
        None => hit_domains
            .iter()
            .filter_map(|d| by_domain.get(d))
            .flatten()
            .copied()
            .collect(),
    };
    // One domain, one job: nobody else's work ran in that server, so the job faulted itself.
    if culprit.is_none() && policy.radius == BlastRadius::Domain && hit_domains.len() == 1 {
        if let [job] = hit.iter().copied().collect::<Vec<_>>()[..] {
            culprit = Some((job, CulpritEvidence::SoleTenant));
        }
    }
    let mut actions = Vec::new();
    // Only a registered task of this GPU is ended: a pid named by a line that lies about who
    // faulted is nobody's business here.
    if let (Some(pid), Some(job)) = (ev.culprit, named) {
        if let Some(domain) = domain_of_job(job) {
            actions.push(Action::TerminateClient { domain, pid });
        }
    }

    for &job in &hit {
        actions.extend(actions_for_job(reg, ev.gpu, job, culprit, policy, class));
    }
    if policy.drain && class.is_hardware() {
        let xids: Vec<String> = ev.xids.iter().map(|x| x.to_string()).collect();
        actions.push(Action::DrainNode {
            reason: format!(
                "{} xid {} ({class}) on gpu{} of {node}",
                mpsr_proto::fault::SLURM_TEXT_PREFIX,
                xids.join("+"),
                ev.gpu
            ),
        });
    }

    let spared = reg.jobs().difference(&hit).copied().collect();
    Decision {
        class,
        hit,
        spared,
        hit_domains,
        awaiting_domain,
        culprit,
        contained: isolated.is_some(),
        actions,
    }
}

/// The fault's class by its Xids. A server that showed the fault before any Xid came: its own
/// application fault, decided now (the Xid decides it again with its class).
fn class_of(ev: &FaultEvent, classifier: &Classifier) -> FaultClass {
    if ev.xids.is_empty() && !ev.domains.is_empty() {
        FaultClass::AppServer
    } else {
        classifier.class_of_fault(&ev.xids, ev.recovery)
    }
}

/// The domains the fault hit: none (a class with no radius), the isolated culprit's, every one
/// of the GPU, or those that showed it (their server's log, the named culprit's). Also whether a
/// domain fault showed in no domain yet (the servers are then asked).
fn hit_domains(
    ev: &FaultEvent,
    policy: ClassPolicy,
    by_domain: &BTreeMap<DomainId, BTreeSet<u32>>,
    named: Option<u32>,
    isolated: Option<u32>,
) -> (BTreeSet<DomainId>, bool) {
    let domain_of_job = |job: u32| {
        by_domain
            .iter()
            .find(|(_, jobs)| jobs.contains(&job))
            .map(|(d, _)| *d)
    };
    match (policy.radius, isolated) {
        (BlastRadius::None, _) => (BTreeSet::new(), false),
        (_, Some(job)) => (domain_of_job(job).into_iter().collect(), false),
        (BlastRadius::Gpu, None) => (by_domain.keys().copied().collect(), false),
        (BlastRadius::Domain, None) => {
            let shown: BTreeSet<DomainId> = ev
                .domains
                .iter()
                .map(|&slot| DomainId { gpu: ev.gpu, slot })
                .chain(named.and_then(domain_of_job))
                .collect();
            let awaiting = shown.is_empty() && !by_domain.is_empty();
            (shown, awaiting)
        }
    }
}

/// What is done for one hit job: by the class's policy and the job's mode; the culprit named by
/// the isolation source is failed (restarting it would fault again).
fn actions_for_job(
    reg: &Registry,
    gpu: u32,
    job: u32,
    culprit: Option<(u32, CulpritEvidence)>,
    policy: ClassPolicy,
    class: FaultClass,
) -> Vec<Action> {
    let tasks: Vec<_> = reg.tasks_on_gpu(gpu).filter(|t| t.job_id == job).collect();
    let Some(first) = tasks.first() else {
        return Vec::new();
    };
    let (mode, batch) = (first.mode, reg.tasks().any(|t| t.job_id == job && t.batch));
    let fail_each = |why: String| -> Vec<Action> {
        tasks
            .iter()
            .map(|t| Action::FailTask {
                job_id: job,
                step_id: t.step_id,
                pid: t.pid,
                why: why.clone(),
            })
            .collect()
    };
    if culprit == Some((job, CulpritEvidence::Isolation)) {
        return fail_each("culprit of the fault".into());
    }
    match (policy.action, mode) {
        (_, Mode::Off) => vec![Action::None {
            job_id: job,
            why: "mode off".into(),
        }],
        (JobAction::None, _) => vec![Action::None {
            job_id: job,
            why: format!("no action for class {class}"),
        }],
        (JobAction::RequeueOnly, _) if batch => vec![Action::Requeue { job_id: job }],
        (JobAction::RequeueOnly, _) => {
            fail_each(format!("{class}: GPU unusable and job is not a batch job"))
        }
        (JobAction::Recover, Mode::Requeue) if batch => vec![Action::Requeue { job_id: job }],
        // Requeue asked for a job Slurm cannot requeue (srun-only): resume in place instead.
        (JobAction::Recover, Mode::Requeue | Mode::Resume) => tasks
            .iter()
            .map(|t| Action::Resume {
                job_id: job,
                step_id: t.step_id,
                pid: t.pid,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::correlate::{FaultEvent, Source};
    use crate::store::registry::Task;
    use std::time::Instant;

    fn task(job: u32, pid: u32, gpus: &[u32], mode: Mode, batch: bool) -> Task {
        Task {
            step_id: if batch { mpsr_proto::BATCH_STEP } else { 0 },
            mode,
            batch,
            trusted: true,
            ..crate::store::registry::tests::task(job, pid, 1000, gpus)
        }
    }

    /// Jobs 1,2,3 on GPU 0 (requeue batch, resume srun, off); job 4 on GPU 1; job 5 spans both.
    fn reg() -> Registry {
        let mut r = Registry::default();
        r.register(task(1, 101, &[0], Mode::Requeue, true)).unwrap();
        r.register(task(2, 201, &[0], Mode::Resume, false)).unwrap();
        r.register(task(3, 301, &[0], Mode::Off, true)).unwrap();
        r.register(task(4, 401, &[1], Mode::Requeue, true)).unwrap();
        r.register(task(5, 501, &[0, 1], Mode::Requeue, true))
            .unwrap();
        r
    }

    fn ev(gpu: u32, xids: &[u32]) -> FaultEvent {
        FaultEvent {
            id: 9,
            gpu,
            xids: xids.to_vec(),
            sources: [Source::Nvml].into(),
            reported_pid: Some(101),
            culprit: None,
            claims_contained: false,
            // The shared domain's server.log showed the fault (as on a real node).
            domains: [0].into(),
            first: Instant::now(),
            first_ms: 0,
            last: Instant::now(),
            detail: String::new(),
            replayed: false,
            recovery: None,
        }
    }

    fn owner(pid: u32) -> Option<u32> {
        Some(pid / 100).filter(|j| (1..=5).contains(j))
    }

    fn run(e: &FaultEvent) -> Decision {
        decide(e, &reg(), &Classifier::default(), "n1", owner)
    }

    #[test]
    fn a_servers_fatal_line_before_any_xid_is_decided_as_its_application_fault() {
        let mut e = ev(0, &[]);
        e.sources = [Source::MpsLog].into();
        let d = run(&e);
        assert_eq!(d.class, FaultClass::AppServer);
        assert_eq!(d.hit, [1, 2, 3, 5].into());
        assert!(d.actions.contains(&Action::Requeue { job_id: 1 }));
        assert!(d.actions.contains(&Action::Resume {
            job_id: 2,
            step_id: 0,
            pid: 201
        }));
        assert!(!d
            .actions
            .iter()
            .any(|a| matches!(a, Action::DrainNode { .. })));
        // No server showed anything and no Xid: not a fault to act on.
        let mut e = ev(0, &[]);
        e.domains.clear();
        assert!(run(&e).hit.is_empty());
    }

    #[test]
    fn xid31_stock_driver_hits_every_job_on_the_gpu() {
        let d = run(&ev(0, &[31]));
        assert_eq!(d.class, FaultClass::AppMemory);
        assert_eq!(d.hit, [1, 2, 3, 5].into());
        assert_eq!(d.spared, [4].into());
        assert_eq!(
            d.actions,
            vec![
                Action::Requeue { job_id: 1 },
                Action::Resume {
                    job_id: 2,
                    step_id: 0,
                    pid: 201
                },
                Action::None {
                    job_id: 3,
                    why: "mode off".into()
                },
                Action::Requeue { job_id: 5 },
            ]
        );
        // The kernel's pid (101) did not make job 1 a culprit.
        assert_eq!(d.culprit_job(), None);
    }

    /// A contained fault as the patched driver reports it: its isolation line alone (no Xid, no
    /// server saw it).
    fn contained_ev(gpu: u32, culprit: u32) -> FaultEvent {
        let mut e = ev(gpu, &[31]);
        e.sources = [Source::Isolation].into();
        e.domains.clear();
        e.culprit = Some(culprit);
        e.claims_contained = true;
        e
    }

    #[test]
    fn xid31_with_isolation_hits_only_the_culprit() {
        let e = contained_ev(0, 201);
        let d = run(&e);
        assert_eq!(d.hit, [2].into());
        assert_eq!(d.spared, [1, 3, 4, 5].into());
        assert_eq!(
            d.actions,
            vec![
                Action::TerminateClient {
                    domain: DomainId::shared(0),
                    pid: 201
                },
                Action::FailTask {
                    job_id: 2,
                    step_id: 0,
                    pid: 201,
                    why: "culprit of the fault".into()
                },
            ]
        );
    }

    #[test]
    fn sm_fault_is_not_isolatable_even_with_culprit() {
        let mut e = ev(0, &[13, 43]);
        e.culprit = Some(101);
        e.claims_contained = true;
        let d = run(&e);
        assert_eq!(d.class, FaultClass::AppSm);
        assert_eq!(d.hit, [1, 2, 3, 5].into());
        assert!(d.actions.contains(&Action::TerminateClient {
            domain: DomainId::shared(0),
            pid: 101
        }));
        // Culprit job failed, not requeued; the others recovered.
        assert!(!d.actions.contains(&Action::Requeue { job_id: 1 }));
        assert!(d.actions.contains(&Action::Requeue { job_id: 5 }));
        assert!(!d
            .actions
            .iter()
            .any(|a| matches!(a, Action::DrainNode { .. })));
    }

    #[test]
    fn device_lost_drains_and_requeues_only() {
        let d = run(&ev(0, &[79]));
        assert_eq!(d.class, FaultClass::DeviceLost);
        assert_eq!(d.hit, [1, 2, 3, 5].into());
        assert!(d.actions.contains(&Action::Requeue { job_id: 1 }));
        assert!(d.actions.contains(&Action::FailTask {
            job_id: 2,
            step_id: 0,
            pid: 201,
            why: "device_lost: GPU unusable and job is not a batch job".into()
        }));
        assert!(d.actions.contains(&Action::DrainNode {
            reason: "mpsr: xid 79 (device_lost) on gpu0 of n1".into()
        }));
    }

    #[test]
    fn each_hw_class() {
        for (xid, drain) in [
            (94, false),
            (95, true),
            (48, true),
            (64, true),
            (140, true),
            (74, true),
            (119, true),
            (120, true),
        ] {
            let d = run(&ev(1, &[xid]));
            assert_eq!(d.hit, [4, 5].into(), "xid {xid}");
            assert_eq!(
                d.actions
                    .iter()
                    .any(|a| matches!(a, Action::DrainNode { .. })),
                drain,
                "xid {xid}"
            );
            assert!(
                d.actions.contains(&Action::Requeue { job_id: 4 }),
                "xid {xid}"
            );
        }
    }

    #[test]
    fn info_and_unknown_hit_nobody() {
        for x in [63, 92, 4242] {
            let d = run(&ev(0, &[x]));
            assert!(d.hit.is_empty(), "xid {x}");
            assert!(d.actions.is_empty(), "xid {x}");
            assert_eq!(d.spared.len(), 5);
        }
    }

    #[test]
    fn requeue_mode_srun_job_falls_back_to_resume() {
        let mut r = Registry::default();
        r.register(task(7, 701, &[0], Mode::Requeue, false))
            .unwrap();
        let d = decide(&ev(0, &[43]), &r, &Classifier::default(), "n1", |_| None);
        assert_eq!(
            d.actions,
            vec![Action::Resume {
                job_id: 7,
                step_id: 0,
                pid: 701
            }]
        );
    }

    #[test]
    fn batch_job_with_srun_step_is_requeued_once() {
        let mut r = Registry::default();
        r.register(task(8, 801, &[0], Mode::Requeue, true)).unwrap();
        let mut step = task(8, 802, &[0], Mode::Requeue, false);
        step.step_id = 0;
        r.register(step).unwrap();
        let d = decide(&ev(0, &[31]), &r, &Classifier::default(), "n1", |_| None);
        assert_eq!(d.actions, vec![Action::Requeue { job_id: 8 }]);
    }

    fn in_domain(mut t: Task, slot: u32) -> Task {
        t.domains = t.gpus.iter().map(|&gpu| DomainId { gpu, slot }).collect();
        t
    }

    /// GPU 0: jobs 11 and 12 in domains of their own (slots 1, 2); jobs 13 and 14 shared.
    fn domains_reg() -> Registry {
        let mut r = Registry::default();
        r.register(in_domain(task(11, 1101, &[0], Mode::Requeue, true), 1))
            .unwrap();
        r.register(in_domain(task(12, 1201, &[0], Mode::Requeue, true), 2))
            .unwrap();
        r.register(task(13, 1301, &[0], Mode::Requeue, true))
            .unwrap();
        r.register(task(14, 1401, &[0], Mode::Resume, false))
            .unwrap();
        r
    }

    fn run_domains(xids: &[u32], shown: &[u32]) -> Decision {
        let mut e = ev(0, xids);
        e.domains = shown.iter().copied().collect();
        decide(&e, &domains_reg(), &Classifier::default(), "n1", |_| None)
    }

    #[test]
    fn app_fault_hits_only_the_domain_that_showed_it_and_names_a_sole_tenant() {
        for xid in [31, 43, 13] {
            let d = run_domains(&[xid], &[1]);
            assert_eq!(d.hit, [11].into(), "xid {xid}");
            assert_eq!(d.hit_domains, [DomainId { gpu: 0, slot: 1 }].into());
            assert_eq!(d.spared, [12, 13, 14].into());
            assert_eq!(d.culprit, Some((11, CulpritEvidence::SoleTenant)));
            assert_eq!(d.actions, vec![Action::Requeue { job_id: 11 }]);
        }
        let d = run_domains(&[13, 43], &[0]);
        assert_eq!(d.hit, [13, 14].into());
        assert_eq!(d.culprit, None, "two tenants: not known");
        assert!(!d.awaiting_domain);
    }

    #[test]
    fn app_fault_no_domain_showed_hits_nobody_and_waits() {
        let d = run_domains(&[31], &[]);
        assert!(d.hit.is_empty() && d.actions.is_empty());
        assert!(d.awaiting_domain);
        assert!(d.hit_domains.is_empty());
        // The kernel's pid is never evidence.
        let mut e = ev(0, &[31]);
        e.domains.clear();
        e.reported_pid = Some(1101);
        let d = decide(&e, &domains_reg(), &Classifier::default(), "n1", |p| {
            Some(p / 100)
        });
        assert!(d.hit.is_empty() && d.awaiting_domain);
    }

    #[test]
    fn hardware_fault_hits_every_domain_of_the_gpu() {
        let d = run_domains(&[79], &[]);
        assert_eq!(d.hit, [11, 12, 13, 14].into());
        assert_eq!(d.hit_domains.len(), 3);
        assert!(!d.awaiting_domain);
        assert_eq!(d.culprit, None);
    }

    #[test]
    fn isolation_culprit_counts_only_when_registered_on_that_gpu() {
        // Named and registered: it alone, failed; its domain is the evidence.
        let mut e = contained_ev(0, 1201);
        let d = decide(&e, &domains_reg(), &Classifier::default(), "n1", |p| {
            Some(p / 100)
        });
        assert_eq!(d.hit, [12].into());
        assert_eq!(d.culprit, Some((12, CulpritEvidence::Isolation)));
        assert!(matches!(d.actions[1], Action::FailTask { job_id: 12, .. }));
        // A pid that is no registered task here: falls back to what the domains show.
        e.culprit = Some(999_999);
        e.domains = [0].into();
        let d = decide(&e, &domains_reg(), &Classifier::default(), "n1", |_| None);
        assert_eq!(d.hit, [13, 14].into());
        assert_eq!(d.culprit, None);
        // Not contained (SM fault): the culprit's whole domain is hit, the culprit failed.
        let mut e = ev(0, &[43]);
        e.domains.clear();
        e.culprit = Some(1101);
        let d = decide(&e, &domains_reg(), &Classifier::default(), "n1", |p| {
            Some(p / 100)
        });
        assert_eq!(d.hit, [11].into());
        assert_eq!(d.hit_domains, [DomainId { gpu: 0, slot: 1 }].into());
        assert!(matches!(d.actions[1], Action::FailTask { job_id: 11, .. }));
    }

    #[test]
    fn a_contained_claim_is_refuted_by_an_xid_or_a_server_that_saw_the_fault() {
        // Standing: the culprit alone.
        let d = run(&contained_ev(0, 201));
        assert_eq!(d.hit, [2].into());
        assert!(d.contained);
        // The firmware reported the Xid after all (kernel line or NVML): the cancel ran, so the
        // fault took the culprit's server down with everyone in it; the culprit is still named.
        for src in [Source::Kmsg, Source::Nvml] {
            let mut e = contained_ev(0, 201);
            e.sources.insert(src);
            assert!(!e.contained(), "{src:?}");
            let d = run(&e);
            assert!(!d.contained);
            assert_eq!(d.hit, [1, 2, 3, 5].into(), "{src:?}");
            assert_eq!(d.culprit, Some((2, CulpritEvidence::Isolation)));
            assert!(d.actions.contains(&Action::Requeue { job_id: 1 }));
            assert!(d.actions.iter().any(
                |a| matches!(a, Action::FailTask { job_id: 2, why, .. } if why == "culprit of the fault")
            ));
        }
        // A server logged the fault (or was seen in FAULT).
        let mut e = contained_ev(0, 201);
        e.sources.insert(Source::MpsLog);
        e.domains = [0].into();
        assert_eq!(run(&e).hit, [1, 2, 3, 5].into());
        // A later line of the same VA space saying contained=0 (containment ran out) wins.
        let mut e = contained_ev(0, 201);
        e.claims_contained = false;
        assert_eq!(run(&e).hit, [1, 2, 3, 5].into());
    }

    #[test]
    fn a_line_naming_a_pid_that_is_no_task_here_ends_nobody() {
        // Not registered at all, or registered on another GPU (job 4 is on GPU 1): treated as
        // not contained, nobody terminated for it, the domains decide.
        for pid in [777_777, 401] {
            let mut e = contained_ev(0, pid);
            e.domains = [0].into();
            e.sources.insert(Source::MpsLog);
            let d = run(&e);
            assert!(
                !d.actions
                    .iter()
                    .any(|a| matches!(a, Action::TerminateClient { .. })),
                "pid {pid}: {:?}",
                d.actions
            );
            assert_eq!(d.culprit_job(), None, "pid {pid}");
            assert_eq!(d.hit, [1, 2, 3, 5].into());
        }
        // Alone (no server saw anything): nobody is hit.
        let d = run(&contained_ev(0, 777_777));
        assert!(d.hit.is_empty() && d.actions.is_empty(), "{d:?}");
    }
}
