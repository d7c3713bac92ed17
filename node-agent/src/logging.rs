//! tracing to stderr (interactive, tests) or syslog (production; journald collects it).

use crate::config::LogConfig;
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

pub fn init(cfg: &LogConfig, ident: &'static std::ffi::CStr) {
    let filter = EnvFilter::try_from_env("MPSR_LOG").unwrap_or_else(|_| EnvFilter::new(&cfg.level));
    let to_syslog = match cfg.target.as_str() {
        "syslog" => true,
        "stderr" => false,
        _ => !std::io::stderr().is_terminal() && std::env::var_os("INVOCATION_ID").is_some(),
    };
    if to_syslog {
        if let Some(sys) = syslog_tracing::Syslog::new(
            ident,
            syslog_tracing::Options::LOG_PID,
            syslog_tracing::Facility::Daemon,
        ) {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(sys)
                .with_ansi(false)
                .without_time()
                .try_init();
            return;
        }
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}
