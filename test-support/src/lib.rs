//! What the workspace's tests share. A test that cannot run here (no root, no GPU, no promtool)
//! calls [`skip`] and returns: it is listed as skipped (stderr, and `$MPSR_SKIP_LOG`, which the
//! test command prints at its end), never counted as passed silently.

use std::io::Write;

/// Says why the calling test did not run: on stderr and as `<test name>: <why>` in the file
/// `$MPSR_SKIP_LOG` names (when set).
pub fn skip(why: &str) {
    eprintln!("SKIPPED: {why}");
    if let Ok(p) = std::env::var("MPSR_SKIP_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
        {
            let name = std::thread::current().name().unwrap_or("?").to_string();
            let _ = writeln!(f, "{name}: {why}");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_skip_is_written_with_the_tests_name() {
        let p = std::env::temp_dir().join(format!("mpsr-skip-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        // This process's environment; no other test here reads it.
        std::env::set_var("MPSR_SKIP_LOG", &p);
        super::skip("no GPU here");
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(
            text,
            "tests::a_skip_is_written_with_the_tests_name: no GPU here\n"
        );
        let _ = std::fs::remove_file(&p);
    }
}
