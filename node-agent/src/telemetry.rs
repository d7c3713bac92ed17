//! The telemetry thread: a round from the backend's source every `telemetry.interval_ms`, each
//! client mapped to its job from the registry, the pathology rules run, findings logged (events,
//! job reports, durable) and the latest round published for `/metrics` and `mpsrctl top`. It
//! never takes part in the fault path: it only reads the state lock briefly.

use crate::config::Config;
use crate::gpu::GpuBackend;
use crate::store::Store;
use crate::sys::lock;
use crate::sys::procfs;
use mpsr_proto::PathologyRecord;
use mpsr_telemetry::source::{Attached, Source};
use mpsr_telemetry::{
    ClientSample, Detector, Finding, FindingState, Owner, Severity, Snapshot, Tick,
};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// CPU time of the calling thread.
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID needs nothing else.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The telemetry thread and the handles it needs.
pub struct Telemetry {
    cfg: Arc<Config>,
    node: String,
    store: Arc<Store>,
    backend: Arc<dyn GpuBackend>,
    exporter: mpsr_telemetry::metrics::Exporter,
}

impl Telemetry {
    pub fn new(
        cfg: Arc<Config>,
        node: String,
        store: Arc<Store>,
        backend: Arc<dyn GpuBackend>,
        exporter: mpsr_telemetry::metrics::Exporter,
    ) -> Telemetry {
        Telemetry {
            cfg,
            node,
            store,
            backend,
            exporter,
        }
    }

    /// The backend's source and a detector with the configured rules, its findings restored.
    pub fn prepare(&self) -> (Box<dyn Source>, Detector) {
        // Validated at config load; an error here would be a bug, so it falls back to the table.
        let rules = self
            .cfg
            .telemetry
            .rules()
            .unwrap_or_else(|_| mpsr_telemetry::RULES.to_vec());
        let mut det = Detector::new(rules);
        det.restore(self.store.lock().telemetry.active.clone());
        (self.backend.telemetry_source(), det)
    }

    /// Runs until the process ends.
    pub fn run(&self, mut source: Box<dyn Source>, mut det: Detector) {
        let cfg = self.cfg.telemetry.clone();
        let interval = Duration::from_millis(cfg.interval_ms);
        let started = Instant::now();
        let mut round: u64 = 0;
        let mut nics = Vec::new();
        let mut steps = mpsr_telemetry::steps::StepReader::new(&cfg.step_dir);
        loop {
            let t0 = Instant::now();
            let slow = round.is_multiple_of(cfg.slow_every as u64);
            let attached = self.attached();
            let (gpus, mut clients) = source.read(slow, &attached);
            self.own(&mut clients, &attached);
            // Step times of the processes that mark them, read as their job's user wrote them.
            for c in &mut clients {
                c.steps = c.owner.and_then(|o| steps.read(c.pid, o.uid));
            }
            steps.retain(&clients.iter().map(|c| c.pid).collect());
            // A few sysfs files per port: every round (an error burst is seen in seconds).
            if cfg.nic {
                nics = mpsr_telemetry::nic::read(&cfg.sysfs);
            }
            let tick = Tick {
                t: started.elapsed().as_secs_f64(),
                gpus,
                clients,
                nics: nics.clone(),
            };
            let changes = det.observe(&tick);
            round += 1;
            let active = det.active();
            self.record(&changes, &active);
            *lock(&self.exporter.0) = Snapshot {
                node: self.node.clone(),
                simulated: self.backend.simulated(),
                tick,
                findings: active,
                rounds: round,
                cpu_seconds: thread_cpu_seconds(),
                pid_labels: cfg.pid_labels,
            };
            std::thread::sleep(interval.saturating_sub(t0.elapsed()));
        }
    }

    /// The clients each domain's daemon reports, for a source that cannot see processes (the
    /// simulator). NVML sees them itself.
    fn attached(&self) -> Vec<Attached> {
        if !self.backend.simulated() {
            return Vec::new();
        }
        let domains = self
            .store
            .lock()
            .all_domains(self.backend.gpus().iter().map(|g| g.index));
        domains
            .into_iter()
            .flat_map(|d| {
                self.backend
                    .clients(d)
                    .into_iter()
                    .map(move |pid| Attached {
                        gpu: d.gpu,
                        slot: d.slot,
                        pid,
                        owner: None,
                    })
            })
            .collect()
    }

    /// Fills each client's owner: the registered task it is, or runs under.
    fn own(&self, clients: &mut [ClientSample], attached: &[Attached]) {
        let ancestry: Vec<Vec<u32>> = clients.iter().map(|c| procfs::ancestry(c.pid)).collect();
        let st = self.store.lock();
        for (c, anc) in clients.iter_mut().zip(ancestry) {
            let task = anc.iter().find_map(|p| st.durable.registry.task_by_pid(*p));
            c.owner = task.map(|t| Owner {
                job: t.job_id,
                step: t.step_id,
                task: t.pid,
                uid: t.uid,
            });
            // The job's own share of the GPU: what it may use is intended, not contention.
            c.thread_pct = task.and_then(|t| t.threads_pct);
            c.mem_limit_bytes = task.and_then(|t| t.mem_limit);
            // The server it is a client of: the daemon's list (sim), else its task's domain.
            c.slot = c
                .slot
                .or_else(|| {
                    attached
                        .iter()
                        .find(|a| a.gpu == c.gpu && a.pid == c.pid)
                        .map(|a| a.slot)
                })
                .or_else(|| task.and_then(|t| t.domain_on(c.gpu)).map(|d| d.slot));
        }
    }

    fn record(&self, changes: &[Finding], active: &[Finding]) {
        if changes.is_empty() {
            return;
        }
        for f in changes {
            let rule = f.rule.name();
            let job = f.owner.map(|o| o.job);
            let raised = f.state == FindingState::Raised;
            match (f.severity, raised) {
                (Severity::Hardware, true) => {
                    tracing::warn!(rule, gpu = f.gpu, value = f.value, detail = %f.detail, "pathology raised (hardware)")
                }
                (_, true) => {
                    tracing::info!(rule, gpu = f.gpu, job, value = f.value, detail = %f.detail, "pathology raised")
                }
                (_, false) => tracing::info!(rule, gpu = f.gpu, job, "pathology cleared"),
            }
        }
        let kept = self.cfg.telemetry.findings_kept.max(1);
        let mut st = self.store.lock();
        let log = &mut st.telemetry;
        for f in changes {
            log.records.push_back(PathologyRecord {
                at_ms: now_ms(),
                finding: f.clone(),
            });
        }
        while log.records.len() > kept {
            log.records.pop_front();
        }
        log.active = active.to_vec();
        drop(st);
        self.store.telemetry_changed();
    }
}

/// Reasons the node is unhealthy from telemetry (hardware findings), for the health check.
pub fn reasons(cfg: &Config, node: &str, active: &[Finding]) -> Vec<String> {
    if !cfg.telemetry.drain_on_hardware {
        return Vec::new();
    }
    active
        .iter()
        .filter(|f| f.severity == Severity::Hardware)
        .map(|f| {
            let on = f.gpu.map_or(String::new(), |g| format!(" on gpu{g}"));
            format!(
                "telemetry {}{on} of {}: {}",
                f.rule.name(),
                node,
                f.detail.replace(';', ",")
            )
        })
        .collect()
}

/// A finding as a user may see it: only when it concerns one of their jobs, naming no other job
/// or process (a hog of another job beside theirs shows as "a client on gpuN").
pub fn redact(f: &Finding, own: &std::collections::BTreeSet<u32>) -> Option<Finding> {
    if f.jobs().is_disjoint(own) {
        return None;
    }
    let mut f = f.clone();
    f.others.retain(|o| own.contains(&o.job));
    if f.owner.is_some_and(|o| !own.contains(&o.job)) {
        f.owner = None;
        f.detail = String::new();
        if let mpsr_telemetry::Subject::Client { gpu, .. } = f.subject {
            f.subject = mpsr_telemetry::Subject::Gpu { gpu };
        }
    }
    Some(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mpsr_telemetry::{RuleId, Subject};

    fn o(job: u32) -> Owner {
        Owner {
            job,
            step: 0,
            task: job * 10,
            uid: job,
        }
    }

    #[test]
    fn a_user_sees_a_hog_beside_their_job_but_not_whose_it_is() {
        let f = Finding {
            rule: RuleId::MpsHog,
            severity: Severity::Advisory,
            state: FindingState::Raised,
            subject: Subject::Client { gpu: 2, pid: 777 },
            gpu: Some(2),
            owner: Some(o(12)),
            others: vec![o(11), o(13)],
            value: 0.97,
            threshold: 0.9,
            t: 1.0,
            detail: "pid 777 takes 97 %".into(),
        };
        let mine = redact(&f, &[11].into()).unwrap();
        assert_eq!(mine.owner, None);
        assert_eq!(mine.others, vec![o(11)]);
        assert_eq!(mine.subject, Subject::Gpu { gpu: 2 });
        assert!(mine.detail.is_empty());
        assert_eq!(redact(&f, &[12].into()).unwrap().owner, Some(o(12)));
        assert_eq!(redact(&f, &[12].into()).unwrap().others, vec![]);
        assert!(redact(&f, &[99].into()).is_none());
    }
}
