//! `mpsrctl job-skew <jobid>`: a job's ranks on every node it runs on, from each node's agent
//! (`/v1/jobs/<id>` on its telemetry address), compared with the straggler rule's threshold.

pub use mpsr_telemetry::skew::compare;
use mpsr_telemetry::skew::{JobView, RankVerdict};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::Command;
use std::time::Duration;

#[derive(Debug)]
pub enum SkewError {
    Nodes(String),
    Fetch { node: String, why: String },
}

impl std::fmt::Display for SkewError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SkewError::Nodes(w) => write!(f, "cannot find the job's nodes: {w}"),
            SkewError::Fetch { node, why } => write!(f, "{node}: {why}"),
        }
    }
}

/// The job's nodes from Slurm (`squeue -o %N`: that field alone, so no job name can stand in for
/// it as in `scontrol show job`'s line; then `scontrol show hostnames`).
pub fn nodes_of(job: u32, timeout: Duration) -> Result<Vec<String>, SkewError> {
    let run = |tool: &str, args: &[&str]| -> Result<String, SkewError> {
        let out = Command::new("timeout")
            .arg("-s")
            .arg("KILL")
            .arg(format!("{}", timeout.as_secs().max(1)))
            .arg(tool)
            .args(args)
            .output()
            .map_err(|e| SkewError::Nodes(format!("{tool}: {e}")))?;
        if !out.status.success() {
            return Err(SkewError::Nodes(
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let list = run("squeue", &["-h", "-j", &job.to_string(), "-o", "%N"])?;
    let list = list.lines().next().unwrap_or("").trim();
    if list.is_empty() || list == "(null)" {
        return Err(SkewError::Nodes(format!(
            "job {job} has no nodes (not running?)"
        )));
    }
    Ok(run("scontrol", &["show", "hostnames", list])?
        .lines()
        .map(str::to_string)
        .filter(|l| !l.is_empty())
        .collect())
}

/// `GET /v1/jobs/<id>` from one node's agent.
pub fn fetch(
    node: &str,
    port: u16,
    job: u32,
    token: Option<&str>,
    timeout: Duration,
) -> Result<JobView, SkewError> {
    let err = |why: String| SkewError::Fetch {
        node: node.to_string(),
        why,
    };
    let addr = (node, port)
        .to_socket_addrs()
        .map_err(|e| err(format!("resolving: {e}")))?
        .next()
        .ok_or_else(|| err("no address".into()))?;
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| {
        err(format!(
            "connecting to {addr}: {e} (is telemetry.listen set there?)"
        ))
    })?;
    s.set_read_timeout(Some(timeout)).ok();
    s.set_write_timeout(Some(timeout)).ok();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "GET /v1/jobs/{job} HTTP/1.0\r\nHost: {node}\r\n{auth}\r\n"
    )
    .map_err(|e| err(e.to_string()))?;
    let mut buf = Vec::new();
    s.take(16 << 20)
        .read_to_end(&mut buf)
        .map_err(|e| err(e.to_string()))?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| err("not an HTTP reply".into()))?;
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        return Err(err(format!("HTTP {status}: {}", body.trim())));
    }
    serde_json::from_str(body).map_err(|e| err(format!("bad reply: {e}")))
}

pub fn render(job: u32, verdicts: &[RankVerdict], errors: &[SkewError]) -> String {
    let mut out = format!("job {job}: {} rank(s)\n", verdicts.len());
    out += "NODE             GPU  PID      TASK     UTIL   VS PEERS  MEM GiB  SM MHz\n";
    for v in verdicts {
        let r = &v.rank;
        out += &format!(
            "{:<16} {:<4} {:<8} {:<8} {:>5} {:>9}  {:>7}  {:>6}{}\n",
            v.node,
            r.gpu,
            r.pid,
            r.task,
            r.util.map_or("-".into(), |u| format!("{:.0}%", u * 100.0)),
            v.relative.map_or("-".into(), |x| format!("{x:.2}")),
            r.mem_used_bytes.map_or("-".into(), |b| format!(
                "{:.1}",
                b as f64 / (1u64 << 30) as f64
            )),
            r.sm_clock_mhz.map_or("-".into(), |c| c.to_string()),
            if v.straggler { "  STRAGGLER" } else { "" }
        );
    }
    for e in errors {
        out += &format!("not compared: {e}\n");
    }
    out
}
