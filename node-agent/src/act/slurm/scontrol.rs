//! Slurm actions carried out through `scontrol`, each call bounded in time; what a refusal means is
//! read from what Slurm then lists (the job's or node's fields, `squeue`/`sinfo`: [`listing`]),
//! never from the refusal's words.

use super::listing::{self, admin_comment_from_json, JobFacts, NodeState};
use crate::config::SlurmConfig;
use crate::store::queue::SlurmOp;
use crate::sys::process::{run_bounded, RunError};
use std::process::Command;
use std::time::Duration;

/// Result of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Done(String),
    /// Will not succeed by retrying (e.g. not a batch job, job gone).
    Permanent(String),
    Retry(String),
}

pub struct Scontrol {
    cfg: SlurmConfig,
}

impl Scontrol {
    pub fn new(cfg: SlurmConfig) -> Self {
        Scontrol { cfg }
    }

    /// (exit 0, what it printed), or why scontrol gave no answer.
    fn run(&self, args: &[&str]) -> Result<(bool, String), RunError> {
        self.run_tool(&self.cfg.scontrol, args)
    }

    fn run_tool(&self, tool: &std::path::Path, args: &[&str]) -> Result<(bool, String), RunError> {
        let mut c = Command::new(tool);
        c.args(args);
        if let Some(conf) = &self.cfg.slurm_conf {
            c.env("SLURM_CONF", conf);
        }
        run_bounded(
            c,
            None,
            Duration::from_millis(self.cfg.timeout_ms),
            &format!("{} {}", tool.display(), args.join(" ")),
        )
    }

    /// The job's AdminComment, `None` when Slurm does not list the job. Read where no field a
    /// user chooses can stand in for it: `squeue --json` (its `admin_comment`), else
    /// `squeue -O admin_comment` (that field alone), in any state (Slurm 24.11's squeue lists an
    /// ended job only with `--states=all`). Never from `scontrol show job`: a job name or
    /// work directory holding a newline and `AdminComment=` forged a line there, which root then
    /// wrote back into the real AdminComment.
    fn admin_comment_of(&self, job_id: u32) -> Result<Option<String>, RunError> {
        let id = job_id.to_string();
        if let Ok((true, out)) =
            self.run_tool(&self.cfg.squeue, &["--json", "--states=all", "-j", &id])
        {
            if let Some(c) = admin_comment_from_json(&out, job_id) {
                return Ok(c);
            }
        }
        let width = format!("admin_comment:{}", ADMIN_COMMENT_MAX * 4);
        match self.run_tool(
            &self.cfg.squeue,
            &["-h", "--states=all", "-j", &id, "-O", &width],
        )? {
            (true, out) => Ok(Some(
                out.trim_end_matches(['\n', ' '])
                    .to_string()
                    .replace("(null)", ""),
            )),
            // squeue fails on a job id it does not know: the full list tells gone from down.
            (false, out) => match self.listed(&["show", "job", "-o"], "JobId", &id) {
                Ok(false) => Ok(None),
                _ => Err(RunError::Failed {
                    command: format!("squeue -j {id}"),
                    output: out,
                }),
            },
        }
    }

    /// What scontrol printed when it exited 0; a non-zero exit is an error.
    fn answer(&self, args: &[&str]) -> Result<String, RunError> {
        match self.run(args)? {
            (true, out) => Ok(out),
            (false, output) => Err(RunError::Failed {
                command: format!("scontrol {}", args.join(" ")),
                output,
            }),
        }
    }

    /// Runs one action. `verify`: it may have run already; check Slurm's state first so it is not
    /// done twice.
    pub fn execute(&self, op: &SlurmOp, verify: bool) -> Outcome {
        match op {
            SlurmOp::Requeue {
                job_id,
                restarts_before,
            } => {
                if let (true, Some(before)) = (verify, restarts_before) {
                    if let Ok(Some(JobFacts {
                        restarts: Some(now),
                        ..
                    })) = self.job_facts(*job_id)
                    {
                        if now > *before {
                            return Outcome::Done(format!(
                                "job {job_id} already requeued (Restarts={now})"
                            ));
                        }
                    }
                }
                let id = job_id.to_string();
                match self.run(&["requeue", &id]) {
                    Ok((true, _)) => Outcome::Done(format!("requeued job {job_id}")),
                    // Why it failed is read from the job's fields, not from the error's words.
                    Ok((false, out)) => after_failed_requeue(*job_id, out, self.job_facts(*job_id)),
                    Err(e) => Outcome::Retry(e.to_string()),
                }
            }
            SlurmOp::Annotate { job_id, line, .. } => self.annotate(*job_id, line),
            SlurmOp::Drain { node, reason } => {
                // Never take over a node someone else drained: keep their reason.
                match self.node_state(node) {
                    Ok(Some(n)) if n.drained() && !n.reason.starts_with(super::DRAIN_PREFIX) => {
                        return Outcome::Done(format!(
                            "node {node} already drained by someone else (reason \"{}\"); left as is",
                            n.reason
                        ));
                    }
                    Ok(_) => {}
                    Err(e) => return self.drain_failed(node, e.to_string()),
                }
                let reason_arg = format!("Reason={reason}");
                let node_arg = format!("NodeName={node}");
                match self.run(&["update", &node_arg, "State=DRAIN", &reason_arg]) {
                    Ok((true, _)) => Outcome::Done(format!("drained node {node}")),
                    Ok((false, out)) => self.drain_failed(node, out),
                    Err(e) => Outcome::Retry(e.to_string()),
                }
            }
        }
    }

    /// Appends `line` to the job's AdminComment, keeping what a site put there; done already
    /// when the comment holds the line (a retry after a crash adds it once).
    fn annotate(&self, job_id: u32, line: &str) -> Outcome {
        let old = match self.admin_comment_of(job_id) {
            Ok(Some(c)) => c,
            Ok(None) => return Outcome::Permanent(format!("job {job_id} no longer exists")),
            Err(e) => return Outcome::Retry(e.to_string()),
        };
        let new = match appended(&old, line) {
            Appended::Already => {
                return Outcome::Done(format!("job {job_id}'s AdminComment has the fault line"))
            }
            Appended::Full => {
                return Outcome::Permanent(format!(
                "job {job_id}'s AdminComment is full ({} bytes); the fault line is in its report",
                old.len()
            ))
            }
            Appended::To(s) => s,
        };
        let arg = format!("AdminComment={new}");
        match self.run(&["update", &format!("JobId={job_id}"), &arg]) {
            Ok((true, _)) => Outcome::Done(format!("job {job_id}'s AdminComment: {line}")),
            // Slurm takes no update of a finished job: judged by its state, not the words.
            Ok((false, out)) => match self.job_facts(job_id) {
                Ok(Some(f)) if f.finished() => Outcome::Permanent(
                    format!("job {job_id} ended before its fault line was written; its report has the fault"),
                ),
                _ => Outcome::Retry(out),
            },
            Err(e) => Outcome::Retry(e.to_string()),
        }
    }

    /// What Slurm says of a job (`squeue -O`, fields no user chooses): `None` when Slurm answers
    /// and does not list it (gone); an error when Slurm cannot be asked.
    pub fn job_facts(&self, job_id: u32) -> Result<Option<JobFacts>, RunError> {
        let id = job_id.to_string();
        let args = ["-h", "--states=all", "-j", &id, "-O", listing::JOB_FORMAT];
        match self.run_tool(&self.cfg.squeue, &args)? {
            (true, out) => Ok(JobFacts::parse(&out, job_id)),
            // squeue fails on a job id it does not know: the full list tells gone from down.
            (false, output) => match self.listed(&["show", "job", "-o"], "JobId", &id) {
                Ok(false) => Ok(None),
                _ => Err(RunError::Failed {
                    command: format!("squeue -j {id}"),
                    output,
                }),
            },
        }
    }

    /// A requeue read back after an agent restart whose job Slurm says ended well after the fault
    /// (it ran on, and ended for its own reasons): not sent, or a finished job would be brought
    /// back. A job that ended within [`RAN_ON_MS`] of the fault may have ended of it: requeued.
    pub fn stale_requeue(&self, job_id: u32, fault_at_ms: u64) -> Option<Outcome> {
        let f = self.job_facts(job_id).ok()??;
        let end = f.end_time.as_deref()?;
        if !f.finished() {
            return None;
        }
        let ran_on = local_time(fault_at_ms.saturating_add(RAN_ON_MS))?;
        // Both in this node's local time, as scontrol prints it: the text order is time order.
        (end > ran_on.as_str()).then(|| {
            Outcome::Permanent(format!(
                "job {job_id} ran on after the fault and ended at {end}: a requeue read back after an agent restart is not sent"
            ))
        })
    }

    /// A node Slurm answers for and does not list will not appear by retrying.
    fn drain_failed(&self, node: &str, out: String) -> Outcome {
        match self.listed(&["show", "node", "-o"], "NodeName", node) {
            Ok(false) => {
                Outcome::Permanent(format!("drain {node}: Slurm has no such node ({out})"))
            }
            _ => Outcome::Retry(out),
        }
    }

    /// Whether the one-line-per-entry listing `args` (exit 0) has an entry whose `key=` field
    /// is `value`; an error when the listing fails.
    fn listed(&self, args: &[&str], key: &str, value: &str) -> Result<bool, RunError> {
        Ok(self
            .answer(args)?
            .lines()
            .any(|l| field(l, key).is_some_and(|v| v == value)))
    }

    /// A node's state and reason (`sinfo -O`); `None` when sinfo lists no such node.
    pub fn node_state(&self, node: &str) -> Result<Option<NodeState>, RunError> {
        let args = ["-h", "-N", "-n", node, "-O", listing::NODE_FORMAT];
        match self.run_tool(&self.cfg.sinfo, &args)? {
            (true, out) => Ok(NodeState::parse(&out)),
            (false, output) => Err(RunError::Failed {
                command: format!("sinfo -n {node}"),
                output,
            }),
        }
    }

    pub fn resume_node(&self, node: &str) -> Result<(), RunError> {
        let node_arg = format!("NodeName={node}");
        self.answer(&["update", &node_arg, "State=RESUME"])
            .map(drop)
    }

    pub fn backoff(&self, attempts: u32) -> Duration {
        let ms = self
            .cfg
            .retry_backoff_ms
            .saturating_mul(1u64 << attempts.min(10));
        Duration::from_millis(ms.min(60_000))
    }

    pub fn max_attempts(&self) -> u32 {
        self.cfg.max_attempts
    }
}

/// A job that ended this long after the fault that hit it ran on (it did not end of the fault).
pub const RAN_ON_MS: u64 = 60_000;

/// Unix ms as scontrol prints a time (`2026-12-06T07:55:01`, this node's local time).
fn local_time(ms: u64) -> Option<String> {
    let t = (ms / 1000) as libc::time_t;
    // SAFETY: an all-zero tm is a valid value for localtime_r to overwrite.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call; localtime_r is the thread-safe variant.
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        return None;
    }
    Some(format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    ))
}

/// The longest AdminComment the agent writes (Slurm's own limit is larger; a comment that long is
/// a site's business, not a place for more lines).
const ADMIN_COMMENT_MAX: usize = 1024;

#[derive(Debug, PartialEq, Eq)]
enum Appended {
    Already,
    Full,
    To(String),
}

/// `old` with `line` appended (" | " between lines).
fn appended(old: &str, line: &str) -> Appended {
    if old.contains(line) {
        return Appended::Already;
    }
    let new = if old.is_empty() {
        line.to_string()
    } else {
        format!("{old} | {line}")
    };
    if new.len() > ADMIN_COMMENT_MAX {
        return Appended::Full;
    }
    Appended::To(new)
}

/// The value of `key=` on a `key=value ...` line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|t| t.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

/// A requeue scontrol refused, judged by what Slurm says of the job afterwards (its fields), not
/// by the refusal's wording: gone, not a batch job or not requeueable will not change by retrying;
/// pending means it was requeued already; anything else (or no answer) is retried.
pub fn after_failed_requeue(
    job_id: u32,
    out: String,
    facts: Result<Option<JobFacts>, RunError>,
) -> Outcome {
    match facts {
        Ok(None) => Outcome::Permanent(format!("job {job_id} no longer exists")),
        Ok(Some(f)) if f.batch == Some(false) => Outcome::Permanent(format!(
            "job {job_id} is not a batch job; Slurm cannot requeue it"
        )),
        Ok(Some(f)) if f.state.as_deref() == Some("PENDING") => {
            Outcome::Done(format!("job {job_id} already pending (requeued before)"))
        }
        Ok(Some(f)) if f.requeueable == Some(false) => Outcome::Permanent(format!(
            "job {job_id} is not requeueable (Requeue=0): {out}"
        )),
        Ok(Some(_)) | Err(_) => Outcome::Retry(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requeue_read_back_after_a_restart_is_not_sent_for_a_job_that_ran_on_and_ended() {
        let fault_at = 1_796_000_000_000u64;
        let shim = |end_ms: u64, state: &str| {
            let end = local_time(end_ms).unwrap();
            Shim::new(
                &format!("stale-{state}-{end_ms}"),
                &format!("echo '{}'", listing::job_line(7, state, &end, 1, 1, 0)),
            )
        };
        // Ended 10 minutes after the fault: it ran on; the requeue is stale.
        let s = shim(fault_at + 600_000, "FAILED");
        assert!(matches!(
            s.scontrol.stale_requeue(7, fault_at),
            Some(Outcome::Permanent(m)) if m.contains("ran on after the fault")
        ));
        // Ended 5 s after it (died of it): requeued as usual.
        assert_eq!(
            shim(fault_at + 5_000, "FAILED")
                .scontrol
                .stale_requeue(7, fault_at),
            None
        );
        // Still running: requeued as usual.
        assert_eq!(
            shim(fault_at + 600_000, "RUNNING")
                .scontrol
                .stale_requeue(7, fault_at),
            None
        );
    }

    #[test]
    fn a_fault_line_is_appended_to_what_the_site_put_in_the_admin_comment() {
        // squeue --json of Slurm 22.05 (openapi v0.0.38): a name with a newline and a forged
        // `AdminComment=` stays inside its own string.
        let json = r#"{"meta":{},"errors":[],"jobs":[{"admin_comment":"site: billing code 42","job_id":7,"name":"x\n   AdminComment=forged by name"}]}"#;
        assert_eq!(
            admin_comment_from_json(json, 7),
            Some(Some("site: billing code 42".into()))
        );
        assert_eq!(admin_comment_from_json(json, 8), Some(None), "not listed");
        assert_eq!(
            admin_comment_from_json(r#"{"jobs":[{"job_id":7}]}"#, 7),
            Some(Some(String::new()))
        );
        assert_eq!(admin_comment_from_json("JobId=7 AdminComment=x", 7), None);
        assert_eq!(
            appended("site: billing code 42", "mpsr: fault 3"),
            Appended::To("site: billing code 42 | mpsr: fault 3".into())
        );
        assert_eq!(
            appended("", "mpsr: fault 3"),
            Appended::To("mpsr: fault 3".into())
        );
        assert_eq!(
            appended("x | mpsr: fault 3", "mpsr: fault 3"),
            Appended::Already
        );
        assert_eq!(appended(&"s".repeat(1020), "mpsr: fault 3"), Appended::Full);
    }

    #[test]
    fn a_refused_requeue_is_judged_by_the_jobs_fields() {
        let facts = |state: &str, batch: u8, requeue: u8| {
            Ok(JobFacts::parse(
                &listing::job_line(3, state, "N/A", batch, requeue, 0),
                3,
            ))
        };
        let err = || "whatever scontrol said".to_string();
        assert!(matches!(
            after_failed_requeue(3, err(), Ok(None)),
            Outcome::Permanent(_)
        ));
        assert!(matches!(
            after_failed_requeue(3, err(), facts("RUNNING", 0, 1)),
            Outcome::Permanent(m) if m.contains("not a batch job")
        ));
        assert!(matches!(
            after_failed_requeue(3, err(), facts("PENDING", 1, 1)),
            Outcome::Done(_)
        ));
        assert!(matches!(
            after_failed_requeue(3, err(), facts("RUNNING", 1, 0)),
            Outcome::Permanent(m) if m.contains("Requeue=0")
        ));
        // Requeueable, running, batch: the refusal was something passing; no answer at all too.
        assert!(matches!(
            after_failed_requeue(3, err(), facts("RUNNING", 1, 1)),
            Outcome::Retry(_)
        ));
        assert!(matches!(
            after_failed_requeue(
                3,
                err(),
                Err(RunError::Timeout {
                    command: "squeue -j 3".into(),
                    ms: 5000
                })
            ),
            Outcome::Retry(_)
        ));
        // Fields Slurm did not print decide nothing.
        assert!(matches!(
            after_failed_requeue(3, err(), Ok(JobFacts::parse("3||||||", 3))),
            Outcome::Retry(_)
        ));
        assert_eq!(field("JobId=3 JobIdRaw=4 Restarts=2", "JobId"), Some("3"));
        assert_eq!(field("JobIdRaw=4", "JobId"), None);
    }

    #[test]
    fn scontrol_missing_is_retry_not_panic() {
        let s = Scontrol::new(SlurmConfig {
            scontrol: "/nonexistent/scontrol".into(),
            ..SlurmConfig::default()
        });
        assert!(matches!(
            s.execute(
                &SlurmOp::Requeue {
                    job_id: 1,
                    restarts_before: None
                },
                false
            ),
            Outcome::Retry(_)
        ));
        assert_eq!(s.backoff(0), Duration::from_millis(500));
        assert_eq!(s.backoff(30), Duration::from_millis(60_000));
    }

    /// scontrol, squeue and sinfo stand-ins running `body` (sh; `$T` is which one), in a
    /// directory of its own (removed on drop).
    struct Shim {
        dir: std::path::PathBuf,
        scontrol: Scontrol,
    }

    impl Shim {
        fn new(name: &str, body: &str) -> Shim {
            let dir =
                std::env::temp_dir().join(format!("mpsr-slurm-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            for tool in ["scontrol", "squeue", "sinfo"] {
                let shim = dir.join(tool);
                let text = format!("#!/bin/sh\nD={}\nT={tool}\n{body}\n", dir.display());
                std::fs::write(&shim, text).unwrap();
                std::fs::set_permissions(
                    &shim,
                    std::os::unix::fs::PermissionsExt::from_mode(0o755),
                )
                .unwrap();
            }
            let scontrol = Scontrol::new(SlurmConfig {
                scontrol: dir.join("scontrol"),
                squeue: dir.join("squeue"),
                sinfo: dir.join("sinfo"),
                ..SlurmConfig::default()
            });
            Shim { dir, scontrol }
        }
    }

    impl Drop for Shim {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// `requeue` and `show job ID` fail; `show job` (all) lists `listing` or, with `None`, fails
    /// like a controller that does not answer.
    fn refusing_scontrol(name: &str, listing: Option<&str>) -> Shim {
        let all = match listing {
            Some(l) => format!("echo '{l}'; exit 0"),
            None => "echo 'Unable to contact slurm controller' >&2; exit 1".into(),
        };
        Shim::new(
            name,
            &format!("if [ \"$1 $2 $3\" = 'show job -o' ]; then {all}; fi\necho 'some error' >&2\nexit 1"),
        )
    }

    #[test]
    fn a_job_slurm_no_longer_lists_is_gone_only_when_slurm_answers() {
        let op = SlurmOp::Requeue {
            job_id: 9,
            restarts_before: None,
        };
        let gone = refusing_scontrol("gone", Some("JobId=8 JobState=RUNNING BatchFlag=1"));
        assert!(
            matches!(gone.scontrol.execute(&op, false), Outcome::Permanent(m) if m.contains("no longer exists"))
        );
        let listed = refusing_scontrol("listed", Some("JobId=9 JobState=RUNNING BatchFlag=1"));
        assert!(matches!(
            listed.scontrol.execute(&op, false),
            Outcome::Retry(_)
        ));
        let down = refusing_scontrol("down", None);
        assert!(matches!(
            down.scontrol.execute(&op, false),
            Outcome::Retry(_)
        ));
    }

    #[test]
    fn a_node_slurm_does_not_list_is_not_drained_again_and_again() {
        let shim = Shim::new(
            "node",
            "[ $T = sinfo ] && [ \"$4\" = n1 ] && { echo 'idle|none|'; exit 0; }\n[ $T = sinfo ] && exit 0\nif [ \"$1 $2 $3\" = 'show node -o' ]; then echo 'NodeName=n1 State=IDLE'; exit 0; fi\nexit 1",
        );
        let drain = |node: &str| SlurmOp::Drain {
            node: node.into(),
            reason: "mpsr: test".into(),
        };
        assert!(
            matches!(shim.scontrol.execute(&drain("n7"), false), Outcome::Permanent(m) if m.contains("no such node"))
        );
        // Listed: a refusal is retried.
        assert!(matches!(
            shim.scontrol.execute(&drain("n1"), false),
            Outcome::Retry(_)
        ));
    }

    #[test]
    fn a_requeue_that_may_have_run_is_verified_and_not_repeated() {
        // Slurm already shows the job requeued once; a requeue call is recorded.
        let shim = Shim::new(
            "verify",
            "[ $T = squeue ] && { echo '7|PENDING|N/A|1|1|1|'; exit 0; }\necho \"$@\" >> $D/calls",
        );
        let op = SlurmOp::Requeue {
            job_id: 7,
            restarts_before: Some(0),
        };
        let s = &shim.scontrol;
        assert!(matches!(s.execute(&op, true), Outcome::Done(m) if m.contains("already requeued")));
        assert!(
            !shim.dir.join("calls").exists(),
            "requeue must not run again"
        );
        // A fresh action is not verified (no extra scontrol call on the fast path).
        assert!(matches!(s.execute(&op, false), Outcome::Done(_)));
        assert!(std::fs::read_to_string(shim.dir.join("calls"))
            .unwrap()
            .contains("requeue 7"));
    }
}
