//! Prints the default telemetry rules as a Markdown table (README's table is made from it).

use mpsr_telemetry::RULES;

/// A threshold as people read it (`> 0` for the smallest positive number).
fn num(v: f64) -> String {
    if v > 0.0 && v < 1e-9 {
        "> 0".into()
    } else {
        format!("{v}")
    }
}

fn main() {
    println!(
        "| rule | severity | raised when | raise / clear | window / clear | evidence | source |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in RULES {
        println!(
            "| {} | {:?} | {} | {} / {} | {} s / {} s | {:.0} % of readings | {} |",
            r.name,
            r.severity,
            r.what,
            num(r.raise),
            num(r.clear),
            r.window_s,
            r.clear_s,
            r.duty * 100.0,
            r.source.split_whitespace().collect::<Vec<_>>().join(" ")
        );
    }
}
