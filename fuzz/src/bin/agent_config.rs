//! The agent's TOML configuration: any text gives a config or a typed error, never a panic.
fn main() {
    afl::fuzz!(|data: &[u8]| {
        if let Ok(text) = std::str::from_utf8(data) {
            let path = std::path::Path::new("agent.toml");
            if let Ok(cfg) = mpsr_agent::config::Config::parse(text, path) {
                let _ = cfg.xid_overrides(path);
                let _ = cfg.policy_overrides(path);
            }
        }
    });
}
