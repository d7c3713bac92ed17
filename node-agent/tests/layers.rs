//! The agent's folders import one way: each module may use only those below it in `LAYERS` (what
//! lib.rs describes). A `crate::x` path in a module's non-test code is an arrow; one that runs back
//! up fails here unless it is one of the `ALLOWED` ones, each with why.

use std::collections::BTreeSet;
use std::path::Path;

/// Bottom first.
const LAYERS: &[&str] = &[
    "sys",
    "signal",
    "config",
    "logging",
    "intake",
    "gpu",
    "store",
    "domain",
    "act",
    "fault",
    "telemetry",
    "agent",
    "api",
    "wiring",
];

/// Arrows that run back up, on purpose.
const ALLOWED: &[(&str, &str, &str)] = &[
    (
        "store",
        "domain",
        "the durable state holds the domain table (pure data, placement decided on it)",
    ),
    (
        "store",
        "fault",
        "the state holds the fault correlator (open faults live under the state lock)",
    ),
];

fn module_of(rel: &Path) -> String {
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

fn arrows(dir: &Path, root: &Path, out: &mut BTreeSet<(String, String, String)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            arrows(&p, root, out);
            continue;
        }
        let rel = p.strip_prefix(root).unwrap();
        let name = rel.to_string_lossy().to_string();
        if p.extension().is_none_or(|x| x != "rs")
            || name.starts_with("bin/")
            || name == "lib.rs"
            || name.ends_with("/tests.rs")
        {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
        let me = module_of(rel);
        for (i, _) in code.match_indices("crate::") {
            let to: String = code[i + 7..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !to.is_empty() && to != me {
                out.insert((me.clone(), to, name.clone()));
            }
        }
    }
}

#[test]
fn folder_arrows_run_one_way() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = BTreeSet::new();
    arrows(&root, &root, &mut found);
    assert!(found.len() > 40, "the scan found too few arrows: {found:?}");
    let at = |m: &str| {
        LAYERS
            .iter()
            .position(|l| *l == m)
            .unwrap_or_else(|| panic!("module `{m}` is not placed in LAYERS"))
    };
    let mut back = Vec::new();
    for (from, to, file) in &found {
        if at(to) > at(from) && !ALLOWED.iter().any(|(f, t, _)| f == from && t == to) {
            back.push(format!("{file}: {from} -> {to}"));
        }
    }
    assert!(back.is_empty(), "arrows that run back up: {back:#?}");
    // An allowed arrow that is gone should leave the list too.
    for (f, t, why) in ALLOWED {
        assert!(
            found.iter().any(|(a, b, _)| a == f && b == t),
            "{f} -> {t} ({why}) is allowed but no longer exists: remove it from ALLOWED"
        );
    }
}

/// The fault core decides from its inputs alone: no threads, clocks, files, processes or GPU
/// backends in its non-test code (time comes with the signal, process facts through `Ctx`); it
/// logs its decisions, nothing more.
#[test]
fn the_fault_core_is_pure() {
    const CORE: &[&str] = &[
        "fault/core.rs",
        "fault/decide.rs",
        "fault/correlate.rs",
        "fault/classify.rs",
    ];
    const IMPURE: &[&str] = &[
        "std::thread",
        "Instant::now",
        "SystemTime",
        "now_ms",
        "std::fs",
        "std::process",
        "libc::",
        "crate::gpu",
        "procfs",
    ];
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for f in CORE {
        let text = std::fs::read_to_string(root.join(f)).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
        for (n, line) in code.lines().enumerate() {
            let line = line.split("//").next().unwrap();
            for w in IMPURE {
                if line.contains(w) {
                    found.push(format!("{f}:{}: {w}", n + 1));
                }
            }
        }
    }
    assert!(found.is_empty(), "the fault core reaches out: {found:#?}");
}
