//! The plugin's plugstack.conf arguments (`key=value` words) and its option values
//! (`--mps-resilient=MODE`, threads, memory, isolation).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let text = String::from_utf8_lossy(data);
        let args: Vec<String> = text.split_whitespace().map(str::to_string).collect();
        if let Ok(c) = mpsr_spank::config::PlugConfig::parse(&args) {
            let _ = c.for_node("n1");
        }
        let first = args.first().map(String::as_str).unwrap_or("");
        let _ = mpsr_spank::options::parse_mode(first);
        let _ = mpsr_spank::options::parse_threads(first);
        let _ = mpsr_spank::options::parse_mem(first);
        let _ = mpsr_spank::options::parse_isolation(first);
        let _ = mpsr_spank::config::parse_bool(first);
    });
}
