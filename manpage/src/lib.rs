//! Every mps-resilient binary renders its own man page from its clap definition when run with
//! `MPSR_MANPAGE=1` (scripts/manpages.sh does so for all of them): the page cannot drift from
//! the options the binary really takes.

use std::io::Write;

/// The variable that asks a binary for its man page instead of running.
pub const ENV: &str = "MPSR_MANPAGE";

/// Prints `cmd`'s man page (roff) and exits when `MPSR_MANPAGE` is set; returns otherwise.
pub fn print_if_asked(cmd: clap::Command) {
    if std::env::var_os(ENV).is_none() {
        return;
    }
    let mut out = Vec::new();
    let code = match clap_mangen::Man::new(cmd).render(&mut out) {
        Ok(()) => std::io::stdout().write_all(&out).map_or(1, |_| 0),
        Err(e) => {
            eprintln!("rendering the man page: {e}");
            1
        }
    };
    std::process::exit(code);
}
