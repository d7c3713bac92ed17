//! The kernel log parser: /dev/kmsg records and NVRM lines (Xid, mpsr-isolate) from any bytes.
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let text = String::from_utf8_lossy(data);
        if let Some(rec) = mpsr_agent::intake::kernel_line::parse_kmsg_record(&text) {
            let _ = mpsr_agent::intake::kernel_line::parse_line(rec.message);
        }
        for line in text.lines() {
            let _ = mpsr_agent::intake::kernel_line::parse_line(line);
        }
    });
}
