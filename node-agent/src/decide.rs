//! The decision: given a fault event and the registry, which jobs were hit and what to do for each.
//! Pure (no I/O) so every class can be tested exhaustively.

use crate::event::FaultEvent;
use crate::registry::Registry;
use crate::xid::{BlastRadius, Classifier, FaultClass, JobAction};
use mpsr_proto::Mode;
use std::collections::BTreeSet;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    /// End only this MPS client (`terminate_client`); the others keep running.
    TerminateClient { gpu: u32, pid: u32 },
    /// `scontrol requeue` a batch job.
    Requeue { job_id: u32 },
    /// Hand the task to the resume path (restart in place once the server is ACTIVE).
    Resume { job_id: u32, step_id: u32, pid: u32 },
    /// The task must not be resumed (culprit, or GPU unusable): its supervisor is told to fail it.
    FailTask {
        job_id: u32,
        step_id: u32,
        pid: u32,
        why: String,
    },
    /// `scontrol update State=DRAIN Reason="mpsr: ..."` (hardware classes only).
    DrainNode { reason: String },
    /// Hit, but nothing to do; said why.
    None { job_id: u32, why: String },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::TerminateClient { gpu, pid } => {
                write!(f, "terminate_client gpu{gpu} pid {pid}")
            }
            Action::Requeue { job_id } => write!(f, "requeue job {job_id}"),
            Action::Resume {
                job_id,
                step_id,
                pid,
            } => write!(
                f,
                "resume job {job_id} step {} task pid {pid}",
                step_name(*step_id)
            ),
            Action::FailTask {
                job_id, pid, why, ..
            } => write!(f, "fail job {job_id} task pid {pid} ({why})"),
            Action::DrainNode { reason } => write!(f, "drain node \"{reason}\""),
            Action::None { job_id, why } => write!(f, "none for job {job_id} ({why})"),
        }
    }
}

pub fn step_name(step: u32) -> String {
    if step == mpsr_proto::BATCH_STEP {
        "batch".into()
    } else {
        step.to_string()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub class: FaultClass,
    pub hit: BTreeSet<u32>,
    /// Registered jobs not hit (other GPUs, or spared by isolation).
    pub spared: BTreeSet<u32>,
    pub culprit_job: Option<u32>,
    pub actions: Vec<Action>,
}

/// `owner_of(pid)`: the registered job a process belongs to (itself or an ancestor is a task).
pub fn decide(
    ev: &FaultEvent,
    reg: &Registry,
    classifier: &Classifier,
    node: &str,
    owner_of: impl Fn(u32) -> Option<u32>,
) -> Decision {
    let class = classifier.class_of_all(&ev.xids);
    let policy = classifier.policy(class);
    let on_gpu = reg.jobs_on_gpu(ev.gpu);
    let all = reg.jobs();
    let culprit_job = ev.culprit.and_then(&owner_of);
    let mut actions = Vec::new();

    let hit: BTreeSet<u32> = match policy.radius {
        BlastRadius::None => BTreeSet::new(),
        // Only an isolation source may narrow the hit set; the kernel's Xid pid never does.
        BlastRadius::Gpu if policy.isolatable && ev.contained && ev.culprit.is_some() => {
            culprit_job.into_iter().collect()
        }
        BlastRadius::Gpu => on_gpu.clone(),
    };

    if let Some(pid) = ev.culprit {
        if policy.radius == BlastRadius::Gpu {
            actions.push(Action::TerminateClient { gpu: ev.gpu, pid });
        }
    }

    for &job in &hit {
        let tasks: Vec<_> = reg
            .tasks_on_gpu(ev.gpu)
            .filter(|t| t.job_id == job)
            .collect();
        let Some(first) = tasks.first() else { continue };
        let (mode, batch) = (first.mode, reg.tasks().any(|t| t.job_id == job && t.batch));
        if Some(job) == culprit_job {
            // Restarting the culprit would fault again.
            for t in &tasks {
                actions.push(Action::FailTask {
                    job_id: job,
                    step_id: t.step_id,
                    pid: t.pid,
                    why: "culprit of the fault".into(),
                });
            }
            continue;
        }
        match (policy.action, mode) {
            (_, Mode::Off) => actions.push(Action::None {
                job_id: job,
                why: "mode off".into(),
            }),
            (JobAction::None, _) => actions.push(Action::None {
                job_id: job,
                why: format!("no action for class {class}"),
            }),
            (JobAction::RequeueOnly, _) if batch => actions.push(Action::Requeue { job_id: job }),
            (JobAction::RequeueOnly, _) => {
                for t in &tasks {
                    actions.push(Action::FailTask {
                        job_id: job,
                        step_id: t.step_id,
                        pid: t.pid,
                        why: format!("{class}: GPU unusable and job is not a batch job"),
                    });
                }
            }
            (JobAction::Recover, Mode::Requeue) if batch => {
                actions.push(Action::Requeue { job_id: job })
            }
            // Requeue asked for a job Slurm cannot requeue (srun-only): resume in place instead.
            (JobAction::Recover, Mode::Requeue | Mode::Resume) => {
                for t in &tasks {
                    actions.push(Action::Resume {
                        job_id: job,
                        step_id: t.step_id,
                        pid: t.pid,
                    });
                }
            }
        }
    }

    if policy.drain && class.is_hardware() {
        let xids: Vec<String> = ev.xids.iter().map(|x| x.to_string()).collect();
        actions.push(Action::DrainNode {
            reason: format!(
                "mpsr: xid {} ({class}) on gpu{} of {node}",
                xids.join("+"),
                ev.gpu
            ),
        });
    }

    let spared = all.difference(&hit).copied().collect();
    Decision {
        class,
        hit,
        spared,
        culprit_job,
        actions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{FaultEvent, Source};
    use crate::registry::Task;
    use std::time::Instant;

    fn task(job: u32, pid: u32, gpus: &[u32], mode: Mode, batch: bool) -> Task {
        Task {
            job_id: job,
            step_id: if batch { mpsr_proto::BATCH_STEP } else { 0 },
            pid,
            uid: 1000,
            gpus: gpus.to_vec(),
            mode,
            batch,
            threads_pct: None,
            mem_limit: None,
            restart_count: 0,
            start_ticks: None,
            trusted: true,
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
            contained: false,
            first: Instant::now(),
            first_ms: 0,
            last: Instant::now(),
            detail: String::new(),
        }
    }

    fn owner(pid: u32) -> Option<u32> {
        Some(pid / 100).filter(|j| (1..=5).contains(j))
    }

    fn run(e: &FaultEvent) -> Decision {
        decide(e, &reg(), &Classifier::default(), "n1", owner)
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
        assert_eq!(d.culprit_job, None);
    }

    #[test]
    fn xid31_with_isolation_hits_only_the_culprit() {
        let mut e = ev(0, &[31]);
        e.culprit = Some(201);
        e.contained = true;
        let d = run(&e);
        assert_eq!(d.hit, [2].into());
        assert_eq!(d.spared, [1, 3, 4, 5].into());
        assert_eq!(
            d.actions,
            vec![
                Action::TerminateClient { gpu: 0, pid: 201 },
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
        e.contained = true;
        let d = run(&e);
        assert_eq!(d.class, FaultClass::AppSm);
        assert_eq!(d.hit, [1, 2, 3, 5].into());
        assert!(d
            .actions
            .contains(&Action::TerminateClient { gpu: 0, pid: 101 }));
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
}
