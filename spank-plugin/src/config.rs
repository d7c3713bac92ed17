//! plugstack.conf arguments: `key=value`, unknown keys rejected with the key named.
//!
//! ```text
//! required /usr/lib/x86_64-linux-gnu/slurm-wlm/mps_resilient.so agent_socket=/run/mps-resilient/agent.sock required_agent=no
//! ```

use mpsr_proto::{Isolation, Mode};
use std::path::PathBuf;
use std::time::Duration;

/// The keys, their defaults and meaning (printed in errors, kept in one place).
pub const KEYS: &[(&str, &str, &str)] = &[
    (
        "agent_socket",
        "/run/mps-resilient/agent.sock",
        "the node agent's socket; %n = Slurm node name",
    ),
    (
        "default_mode",
        "requeue",
        "mode of a bare --mps-resilient: requeue, resume or off",
    ),
    (
        "required_agent",
        "no",
        "yes: a protected job fails when the agent is unreachable; no: it runs unprotected with a warning",
    ),
    (
        "isolation",
        "",
        "fault domain of a job that does not give --mps-isolation: shared, job or user; empty = the agent's mps.isolation_default",
    ),
    ("timeout_ms", "2000", "bound on each call to the agent"),
    (
        "restart_wait_ms",
        "1000",
        "how long a call waits for an agent that is restarting (socket missing or refused), within timeout_ms; 0 = no wait",
    ),
    (
        "supervisor",
        "/usr/bin/mpsr-run",
        "resume supervisor prepended to tasks in resume mode (Slurm >= 23.11 only)",
    ),
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlugConfig {
    pub agent_socket: PathBuf,
    pub default_mode: Mode,
    pub required_agent: bool,
    pub timeout: Duration,
    /// A refused or missing socket is tried again this long (an agent restart), within `timeout`.
    pub restart_wait: Duration,
    pub supervisor: PathBuf,
    pub isolation: Option<Isolation>,
}

impl Default for PlugConfig {
    fn default() -> Self {
        PlugConfig {
            agent_socket: "/run/mps-resilient/agent.sock".into(),
            default_mode: Mode::Requeue,
            required_agent: false,
            timeout: Duration::from_millis(2000),
            restart_wait: Duration::from_millis(1000),
            supervisor: "/usr/bin/mpsr-run".into(),
            isolation: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigError {
    NotKeyValue(String),
    UnknownKey(String),
    BadValue {
        key: &'static str,
        value: String,
        expected: &'static str,
    },
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigError::NotKeyValue(a) => write!(
                f,
                "plugstack.conf argument '{a}' is not key=value (keys: {})",
                key_list()
            ),
            ConfigError::UnknownKey(k) => write!(
                f,
                "unknown plugstack.conf key '{k}' (known keys: {})",
                key_list()
            ),
            ConfigError::BadValue {
                key,
                value,
                expected,
            } => write!(
                f,
                "plugstack.conf key '{key}': bad value '{value}' (expected {expected})"
            ),
        }
    }
}

fn key_list() -> String {
    KEYS.iter().map(|k| k.0).collect::<Vec<_>>().join(", ")
}

/// Accepts what pyxis accepts for booleans.
pub fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "yes" | "y" | "true" => Some(true),
        "0" | "no" | "n" | "false" => Some(false),
        _ => None,
    }
}

impl PlugConfig {
    /// `%n` in `agent_socket` stands for the Slurm node name (several slurmd on one host, each
    /// with its own agent, as in the test cluster).
    pub fn for_node(&self, node: &str) -> PlugConfig {
        let mut c = self.clone();
        let p = c.agent_socket.display().to_string();
        if p.contains("%n") {
            c.agent_socket = p.replace("%n", node).into();
        }
        c
    }

    pub fn parse(args: &[String]) -> Result<PlugConfig, ConfigError> {
        let mut c = PlugConfig::default();
        for a in args {
            let Some((k, v)) = a.split_once('=') else {
                return Err(ConfigError::NotKeyValue(a.clone()));
            };
            let bad = |key: &'static str, expected: &'static str| ConfigError::BadValue {
                key,
                value: v.to_string(),
                expected,
            };
            match k {
                "agent_socket" => {
                    if !v.starts_with('/') {
                        return Err(bad("agent_socket", "an absolute path"));
                    }
                    c.agent_socket = v.into();
                }
                "default_mode" => {
                    c.default_mode = v
                        .parse()
                        .map_err(|_| bad("default_mode", "requeue, resume or off"))?
                }
                "required_agent" => {
                    c.required_agent =
                        parse_bool(v).ok_or_else(|| bad("required_agent", "yes or no"))?
                }
                "timeout_ms" => {
                    let ms: u64 = v
                        .parse()
                        .ok()
                        .filter(|ms| (1..=60_000).contains(ms))
                        .ok_or_else(|| bad("timeout_ms", "milliseconds in 1..=60000"))?;
                    c.timeout = Duration::from_millis(ms);
                }
                "restart_wait_ms" => {
                    let ms: u64 = v
                        .parse()
                        .ok()
                        .filter(|ms| *ms <= 60_000)
                        .ok_or_else(|| bad("restart_wait_ms", "milliseconds in 0..=60000"))?;
                    c.restart_wait = Duration::from_millis(ms);
                }
                "isolation" if v.is_empty() => c.isolation = None,
                "isolation" => {
                    c.isolation = Some(
                        v.parse()
                            .map_err(|_| bad("isolation", "shared, job or user"))?,
                    )
                }
                "supervisor" => {
                    if !v.starts_with('/') {
                        return Err(bad("supervisor", "an absolute path"));
                    }
                    c.supervisor = v.into();
                }
                other => return Err(ConfigError::UnknownKey(other.to_string())),
            }
        }
        Ok(c)
    }
}

/// The configuration parsed by this process's `init` (each Slurm process loads the plugin anew).
static LOADED: std::sync::Mutex<Option<Result<PlugConfig, ConfigError>>> =
    std::sync::Mutex::new(None);

/// Parses `args` and keeps the result for the later hooks of this process.
pub fn load(args: &[String]) -> Result<PlugConfig, ConfigError> {
    let r = PlugConfig::parse(args);
    *LOADED.lock().unwrap_or_else(|p| p.into_inner()) = Some(r.clone());
    r
}

/// What `load` found; defaults if it never ran.
pub fn loaded() -> Result<PlugConfig, ConfigError> {
    LOADED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_else(|| Ok(PlugConfig::default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<PlugConfig, ConfigError> {
        PlugConfig::parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn defaults_and_overrides() {
        assert_eq!(p(&[]).unwrap(), PlugConfig::default());
        let c = p(&[
            "agent_socket=/tmp/a.sock",
            "default_mode=resume",
            "required_agent=yes",
            "timeout_ms=500",
            "isolation=job",
        ])
        .unwrap();
        assert_eq!(c.isolation, Some(Isolation::Job));
        assert_eq!(c.agent_socket, PathBuf::from("/tmp/a.sock"));
        assert_eq!(c.default_mode, Mode::Resume);
        assert!(c.required_agent);
        assert_eq!(c.timeout, Duration::from_millis(500));
        let c = p(&["agent_socket=/run/mpsr/%n/agent.sock"]).unwrap();
        assert_eq!(
            c.for_node("n7").agent_socket,
            PathBuf::from("/run/mpsr/n7/agent.sock")
        );
    }

    #[test]
    fn unknown_and_bad_rejected_with_key_named() {
        let e = p(&["agent_sock=/x"]).unwrap_err();
        assert_eq!(e, ConfigError::UnknownKey("agent_sock".into()));
        assert!(e.to_string().contains("'agent_sock'"), "{e}");
        assert!(p(&["required_agent=maybe"])
            .unwrap_err()
            .to_string()
            .contains("required_agent"));
        assert!(p(&["timeout_ms=0"]).is_err());
        assert!(p(&["timeout_ms=abc"]).is_err());
        assert!(p(&["default_mode=Requeue"]).is_err());
        assert!(p(&["isolation=gpu"])
            .unwrap_err()
            .to_string()
            .contains("'isolation'"));
        assert!(p(&["agent_socket=relative.sock"]).is_err());
        assert!(matches!(
            p(&["verbose"]).unwrap_err(),
            ConfigError::NotKeyValue(_)
        ));
    }
}
