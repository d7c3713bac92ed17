//! tracing to stderr (interactive, tests), journald (production: structured, each event's fields
//! kept as journal fields) or syslog (hosts without journald).

use crate::config::{LogConfig, LogTarget};
use std::io::IsTerminal;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

pub fn init(cfg: &LogConfig, ident: &'static std::ffi::CStr) {
    let filter = EnvFilter::try_from_env("MPSR_LOG").unwrap_or_else(|_| EnvFilter::new(&cfg.level));
    let under_systemd =
        !std::io::stderr().is_terminal() && std::env::var_os("INVOCATION_ID").is_some();
    let (journald, syslog) = match cfg.target {
        LogTarget::Journald => (true, true),
        LogTarget::Syslog => (false, true),
        LogTarget::Stderr => (false, false),
        LogTarget::Auto => (under_systemd, under_systemd),
    };
    if journald {
        // Fields go as MPSR_<NAME> (journald names are upper case); the identifier as
        // SYSLOG_IDENTIFIER, so `journalctl -t mpsr-agent` finds them.
        match tracing_journald::layer() {
            Ok(layer) => {
                let layer = layer
                    .with_field_prefix(Some("MPSR".into()))
                    .with_syslog_identifier(ident.to_string_lossy().into_owned());
                if tracing_subscriber::registry()
                    .with(filter.clone())
                    .with(layer)
                    .try_init()
                    .is_ok()
                {
                    return;
                }
            }
            Err(e) => eprintln!(
                "{}: journald unavailable ({e}); logging to syslog",
                ident.to_string_lossy()
            ),
        }
    }
    if syslog {
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
