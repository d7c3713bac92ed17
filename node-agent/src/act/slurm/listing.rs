//! What Slurm lists of a job or a node, read from fields no user chooses: `squeue -O` and
//! `sinfo -O` asked for those fields alone, one record per line, `|` after each field. Never from
//! `scontrol show ... -o`, whose `Key=Value` line puts the job's name (and a node's reason)
//! among the fields: a job named `x Restarts=99 JobState=COMPLETED` read as finished, with 99
//! restarts, and its requeue was never sent.

/// `squeue -h --states=all -j ID -O` for [`JobFacts`].
pub const JOB_FORMAT: &str = "JobID:|,State:|,EndTime:|,BatchFlag:|,Requeue:|,RestartCnt:|";
/// `sinfo -h -N -n NODE -O` for [`NodeState`]: the reason last, so a `|` in it stays in it.
pub const NODE_FORMAT: &str = "StateComplete:|,Reason:|";

/// The fields of a job a requeue depends on; `None` where Slurm did not say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFacts {
    pub state: Option<String>,
    /// `EndTime` as Slurm prints it (local time, `YYYY-MM-DDTHH:MM:SS`); `None` while unknown.
    pub end_time: Option<String>,
    pub batch: Option<bool>,
    pub requeueable: Option<bool>,
    pub restarts: Option<u32>,
}

impl JobFacts {
    /// Slurm says the job has ended (it will not run again unless someone requeues it).
    pub fn finished(&self) -> bool {
        self.state.as_deref().is_some_and(finished)
    }

    /// The record of `job_id` in `squeue -O JOB_FORMAT` output; `None` when it lists no such job.
    pub fn parse(out: &str, job_id: u32) -> Option<JobFacts> {
        let id = job_id.to_string();
        out.lines().find_map(|l| {
            let f: Vec<&str> = l.split('|').map(str::trim).collect();
            if f.len() < 6 || f[0] != id {
                return None;
            }
            let flag = |v: &str| known(v)?.parse::<u32>().ok().map(|n| n != 0);
            Some(JobFacts {
                state: known(f[1]).map(str::to_string),
                end_time: known(f[2])
                    .filter(|t| t.starts_with(|c: char| c.is_ascii_digit()))
                    .map(str::to_string),
                batch: flag(f[3]),
                requeueable: flag(f[4]),
                restarts: known(f[5]).and_then(|v| v.parse().ok()),
            })
        })
    }
}

/// A node's state flags and reason, as `sinfo -O NODE_FORMAT` prints them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeState {
    /// Upper case, `+` between flags: `IDLE+DRAIN`.
    pub state: String,
    /// Empty when the node has none.
    pub reason: String,
}

impl NodeState {
    pub fn drained(&self) -> bool {
        self.state.split('+').any(|f| f.starts_with("DRAIN"))
    }

    /// The first line (a node in several partitions is listed once per partition); `None` when
    /// sinfo listed nothing (no such node).
    pub fn parse(out: &str) -> Option<NodeState> {
        let line = out.lines().find(|l| !l.trim().is_empty())?;
        let (state, rest) = line.split_once('|')?;
        let reason = rest.strip_suffix('|').unwrap_or(rest).trim();
        Some(NodeState {
            state: state.trim().to_ascii_uppercase(),
            reason: if reason == "none" || reason == "(null)" {
                String::new()
            } else {
                reason.to_string()
            },
        })
    }
}

/// A field's value, `None` where Slurm printed none.
fn known(v: &str) -> Option<&str> {
    (!v.is_empty() && v != "N/A" && v != "(null)").then_some(v)
}

/// Whether a job state is a finished one.
pub fn finished(state: &str) -> bool {
    matches!(
        state,
        "COMPLETED"
            | "FAILED"
            | "CANCELLED"
            | "TIMEOUT"
            | "NODE_FAIL"
            | "PREEMPTED"
            | "OUT_OF_MEMORY"
            | "BOOT_FAIL"
            | "DEADLINE"
    )
}

/// `Some(comment)` of `job_id` from `squeue --json` output (`Some("")` when unset), `Some(None)`
/// when the listing has no such job, `None` when the output is not that JSON.
pub fn admin_comment_from_json(out: &str, job_id: u32) -> Option<Option<String>> {
    let v: serde_json::Value = serde_json::from_str(out).ok()?;
    let jobs = v.get("jobs")?.as_array()?;
    let Some(job) = jobs
        .iter()
        .find(|j| j.get("job_id").and_then(|i| i.as_u64()) == Some(u64::from(job_id)))
    else {
        return Some(None);
    };
    Some(Some(
        job.get("admin_comment")
            .and_then(|c| c.as_str())
            .unwrap_or("")
            .to_string(),
    ))
}

/// A line of `squeue -O JOB_FORMAT` (tests and shims).
#[cfg(test)]
pub fn job_line(id: u32, state: &str, end: &str, batch: u8, requeue: u8, restarts: u32) -> String {
    format!("{id}|{state}|{end}|{batch}|{requeue}|{restarts}|")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Slurm 22.05 printed for a job named `x Restarts=99 JobState=COMPLETED`: scontrol's
    /// line put the name's fields before the real ones; squeue's record has only real ones.
    #[test]
    fn a_hostile_job_name_cannot_stand_in_for_the_jobs_fields() {
        let scontrol = "JobId=1 JobName=x Restarts=99 JobState=COMPLETED UserId=root(0) JobState=RUNNING Requeue=1 Restarts=0 BatchFlag=1";
        assert_eq!(JobFacts::parse(scontrol, 1), None, "not this format");
        let f = JobFacts::parse("1|RUNNING|2027-12-06T17:13:45|1|1|0|\n", 1).unwrap();
        assert_eq!(
            f,
            JobFacts {
                state: Some("RUNNING".into()),
                end_time: Some("2027-12-06T17:13:45".into()),
                batch: Some(true),
                requeueable: Some(true),
                restarts: Some(0)
            }
        );
        assert!(!f.finished());
        assert_eq!(
            JobFacts::parse("12|RUNNING|N/A|1|1|0|", 1),
            None,
            "another job"
        );
        let p = JobFacts::parse("1|PENDING|N/A|1|0||", 1).unwrap();
        assert_eq!(
            (p.end_time, p.requeueable, p.restarts),
            (None, Some(false), None)
        );
    }

    #[test]
    fn a_node_reason_with_spaces_and_bars_is_read_whole() {
        assert_eq!(
            NodeState::parse(
                "idle+drain|mpsr: xid 79 (device_lost) on gpu0 | again|\nidle+drain|x|\n"
            ),
            Some(NodeState {
                state: "IDLE+DRAIN".into(),
                reason: "mpsr: xid 79 (device_lost) on gpu0 | again".into()
            })
        );
        let n = NodeState::parse("mixed|none|").unwrap();
        assert_eq!((n.drained(), n.reason.as_str()), (false, ""));
        assert!(NodeState::parse("drained|admin: a b  c|")
            .unwrap()
            .drained());
        assert!(NodeState::parse("allocated+draining|x|").unwrap().drained());
        assert_eq!(NodeState::parse(""), None);
    }
}
