//! Which tasks of which jobs use which GPU through the agent's MPS daemons.

use mpsr_proto::{DomainId, Mode, Registration, TaskStatus};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    pub job_id: u32,
    pub step_id: u32,
    pub pid: u32,
    pub uid: u32,
    pub gpus: Vec<u32>,
    pub mode: Mode,
    pub batch: bool,
    pub threads_pct: Option<u8>,
    pub mem_limit: Option<u64>,
    pub restart_count: u32,
    /// Process start time (clock ticks since boot, /proc/PID/stat field 22) to detect pid reuse.
    pub start_ticks: Option<u64>,
    /// Registered by slurmstepd/root (the plugin), not by the user: it says who owns the job.
    #[serde(default)]
    pub trusted: bool,
    /// The fault domain used on each GPU; a GPU not listed uses its shared domain.
    #[serde(default)]
    pub domains: Vec<DomainId>,
}

impl Task {
    pub fn from_registration(
        r: &Registration,
        uid: u32,
        start_ticks: Option<u64>,
        trusted: bool,
    ) -> Task {
        let mut gpus = r.gpus.clone();
        gpus.sort_unstable();
        gpus.dedup();
        Task {
            job_id: r.job_id,
            step_id: r.step_id,
            pid: r.pid,
            uid,
            gpus,
            mode: r.mode,
            batch: r.batch,
            threads_pct: r.threads_pct,
            mem_limit: r.mem_limit,
            restart_count: r.restart_count,
            start_ticks,
            trusted,
            domains: Vec::new(),
        }
    }

    /// The domain this task uses on `gpu`, if it uses that GPU.
    pub fn domain_on(&self, gpu: u32) -> Option<DomainId> {
        if !self.gpus.contains(&gpu) {
            return None;
        }
        Some(
            self.domains
                .iter()
                .copied()
                .find(|d| d.gpu == gpu)
                .unwrap_or(DomainId::shared(gpu)),
        )
    }

    pub fn in_domain(&self, d: DomainId) -> bool {
        self.domain_on(d.gpu) == Some(d)
    }

    pub fn status(&self) -> TaskStatus {
        TaskStatus {
            job_id: self.job_id,
            step_id: self.step_id,
            pid: self.pid,
            uid: self.uid,
            gpus: self.gpus.clone(),
            mode: self.mode,
            batch: self.batch,
            domains: self
                .gpus
                .iter()
                .filter_map(|g| self.domain_on(*g))
                .collect(),
            standby: None,
            standby_kind: None,
        }
    }
}

pub type TaskKey = (u32, u32, u32); // job, step, pid

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterError {
    /// The job is known with another owner.
    OtherOwner { job_id: u32, owner: u32 },
    /// Same job registered with different modes by two steps.
    ModeConflict { job_id: u32, existing: Mode },
}

impl std::fmt::Display for RegisterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegisterError::OtherOwner { job_id, .. } => {
                write!(f, "job {job_id} belongs to another user")
            }
            RegisterError::ModeConflict { job_id, existing } => {
                write!(f, "job {job_id} is already registered with mode {existing}")
            }
        }
    }
}

/// Tasks keyed by (job, step, pid): a job's tasks are one range, so per-job lookups on the
/// registration path do not scan the whole registry. Stored on disk as a map "job.step.pid" -> task.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registry {
    tasks: BTreeMap<TaskKey, Task>,
}

impl Serialize for Registry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Disk<'a> {
            tasks: BTreeMap<String, &'a Task>,
        }
        Disk {
            tasks: self
                .tasks
                .iter()
                .map(|(k, t)| (format!("{}.{}.{}", k.0, k.1, k.2), t))
                .collect(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Registry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Disk {
            tasks: BTreeMap<String, Task>,
        }
        let disk = Disk::deserialize(d)?;
        Ok(Registry {
            tasks: disk
                .tasks
                .into_values()
                .map(|t| ((t.job_id, t.step_id, t.pid), t))
                .collect(),
        })
    }
}

fn key(t: &Task) -> TaskKey {
    (t.job_id, t.step_id, t.pid)
}

impl Registry {
    fn job_tasks(&self, job: u32) -> impl Iterator<Item = &Task> {
        self.tasks
            .range((job, 0, 0)..=(job, u32::MAX, u32::MAX))
            .map(|(_, t)| t)
    }

    /// Registers a task. A job belongs to the uid that registered it first, except that a trusted
    /// registration (from Slurm itself) evicts a user's earlier claim on a job id that is not
    /// theirs; the evicted tasks are returned so the caller can log them.
    pub fn register(&mut self, t: Task) -> Result<Vec<Task>, RegisterError> {
        let mut evicted = Vec::new();
        let first = self.job_tasks(t.job_id).next().map(|o| (o.uid, o.mode));
        if let Some((owner, mode)) = first {
            if owner != t.uid {
                let squatted = t.trusted && !self.job_tasks(t.job_id).any(|o| o.trusted);
                if !squatted {
                    return Err(RegisterError::OtherOwner {
                        job_id: t.job_id,
                        owner,
                    });
                }
                evicted = self.remove_job(t.job_id);
            } else if mode != t.mode {
                return Err(RegisterError::ModeConflict {
                    job_id: t.job_id,
                    existing: mode,
                });
            }
        }
        self.tasks.insert(key(&t), t);
        Ok(evicted)
    }

    /// Inserts or replaces a task without checks (journal replay of an accepted registration).
    pub fn put(&mut self, t: Task) {
        self.tasks.insert(key(&t), t);
    }

    /// Adds a task that already exited back into a decision's view (no ownership checks: it was
    /// registered before).
    pub fn insert_exited(&mut self, t: Task) {
        self.tasks.entry(key(&t)).or_insert(t);
    }

    /// The registered task of `job` that is `pid` or one of the given ancestors of it.
    pub fn task_in_ancestry(&self, job: u32, ancestry: &[u32]) -> Option<&Task> {
        ancestry
            .iter()
            .find_map(|p| self.job_tasks(job).find(|t| t.pid == *p))
    }

    pub fn get(&self, k: TaskKey) -> Option<&Task> {
        self.tasks.get(&k)
    }

    pub fn get_mut(&mut self, k: TaskKey) -> Option<&mut Task> {
        self.tasks.get_mut(&k)
    }

    pub fn remove(&mut self, k: TaskKey) -> Option<Task> {
        self.tasks.remove(&k)
    }

    pub fn remove_job(&mut self, job_id: u32) -> Vec<Task> {
        let keys: Vec<TaskKey> = self.job_tasks(job_id).map(key).collect();
        keys.iter().filter_map(|k| self.tasks.remove(k)).collect()
    }

    pub fn job_owner(&self, job_id: u32) -> Option<u32> {
        self.job_tasks(job_id).next().map(|t| t.uid)
    }

    pub fn tasks(&self) -> impl Iterator<Item = &Task> {
        self.tasks.values()
    }

    pub fn tasks_on_gpu(&self, gpu: u32) -> impl Iterator<Item = &Task> {
        self.tasks.values().filter(move |t| t.gpus.contains(&gpu))
    }

    pub fn jobs_on_gpu(&self, gpu: u32) -> BTreeSet<u32> {
        self.tasks_on_gpu(gpu).map(|t| t.job_id).collect()
    }

    pub fn jobs(&self) -> BTreeSet<u32> {
        self.tasks.values().map(|t| t.job_id).collect()
    }

    pub fn task_by_pid(&self, pid: u32) -> Option<&Task> {
        self.tasks.values().find(|t| t.pid == pid)
    }

    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// After a restart: drop tasks whose process is gone or whose pid was reused.
    pub fn reconcile(&mut self, alive: impl Fn(u32, Option<u64>) -> bool) -> Vec<Task> {
        let dead: Vec<TaskKey> = self
            .tasks
            .values()
            .filter(|t| !alive(t.pid, t.start_ticks))
            .map(key)
            .collect();
        dead.iter().filter_map(|k| self.tasks.remove(k)).collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A batch task in requeue mode, step 0, registered by the user (tests of this crate).
    pub(crate) fn task(job: u32, pid: u32, uid: u32, gpus: &[u32]) -> Task {
        Task {
            job_id: job,
            step_id: 0,
            pid,
            uid,
            gpus: gpus.to_vec(),
            mode: Mode::Requeue,
            batch: true,
            threads_pct: None,
            mem_limit: None,
            restart_count: 0,
            start_ticks: None,
            trusted: false,
            domains: Vec::new(),
        }
    }

    #[test]
    fn trusted_registration_evicts_a_squatter_but_not_the_reverse() {
        let mut r = Registry::default();
        // User 1001 claims job 9 before Slurm registers it for its real owner 1000.
        r.register(task(9, 90, 1001, &[0])).unwrap();
        let mut real = task(9, 91, 1000, &[0]);
        real.trusted = true;
        let evicted = r.register(real).unwrap();
        assert_eq!(evicted.len(), 1);
        assert_eq!(evicted[0].uid, 1001);
        assert_eq!(r.job_owner(9), Some(1000));
        // Now the squatter cannot get back in, trusted or not, as long as Slurm's tasks are there.
        assert!(r.register(task(9, 92, 1001, &[0])).is_err());
        let mut t = task(9, 93, 1001, &[0]);
        t.trusted = true;
        assert!(r.register(t).is_err());
        assert_eq!(r.task_in_ancestry(9, &[5, 91, 1]).map(|t| t.pid), Some(91));
        assert!(r.task_in_ancestry(8, &[91]).is_none());
    }

    #[test]
    fn other_users_job_refused() {
        let mut r = Registry::default();
        r.register(task(1, 10, 1000, &[0])).unwrap();
        assert_eq!(
            r.register(task(1, 11, 1001, &[0])),
            Err(RegisterError::OtherOwner {
                job_id: 1,
                owner: 1000
            })
        );
        r.register(task(1, 12, 1000, &[1])).unwrap();
        assert_eq!(r.jobs_on_gpu(0), [1].into());
        assert_eq!(r.jobs_on_gpu(1), [1].into());
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn reconcile_drops_dead() {
        let mut r = Registry::default();
        r.register(task(1, 10, 0, &[0])).unwrap();
        r.register(task(2, 20, 0, &[0])).unwrap();
        let dead = r.reconcile(|pid, _| pid == 10);
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].pid, 20);
        assert_eq!(r.jobs(), [1].into());
    }

    #[test]
    fn persisted_form_is_the_string_keyed_map_of_earlier_versions() {
        let mut r = Registry::default();
        r.register(task(12, 5, 7, &[0])).unwrap();
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert!(v["tasks"]["12.0.5"].is_object(), "{v}");
        let back: Registry = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn persisted_form_roundtrips() {
        let mut r = Registry::default();
        r.register(task(5, 50, 7, &[1, 0])).unwrap();
        let s = serde_json::to_string(&r).unwrap();
        let back: Registry = serde_json::from_str(&s).unwrap();
        assert_eq!(back, r);
    }
}
