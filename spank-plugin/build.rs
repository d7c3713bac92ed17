//! Generates SPANK bindings from the system `slurm/spank.h` (libslurm-dev). The plugin must be built
//! against the Slurm release it is loaded into: Slurm refuses a plugin whose major.minor differs.
//! Every header bindgen reads is a rerun trigger (its cargo callbacks), so a plugin rebuilt after
//! a libslurm-dev upgrade takes the new `SLURM_VERSION_NUMBER` (tests/plugin_rebuild.sh).

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=SLURM_INCLUDE_DIR");
    println!("cargo:rustc-check-cfg=cfg(mpsr_have_prepend_argv)");
    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("spank_.*")
        .allowlist_function("slurm_(info|error|verbose|debug|spank_log)")
        .allowlist_type("spank_.*")
        .allowlist_var("SLURM_VERSION_NUMBER|ESPANK_.*|SPANK_OPTION_MAXLEN")
        // spank_option is declared by hand with const pointers (the table lives in static memory).
        .blocklist_type("spank_option")
        .blocklist_type("spank_opt_cb_f")
        .prepend_enum_name(false)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    if let Ok(dir) = std::env::var("SLURM_INCLUDE_DIR") {
        b = b.clang_arg(format!("-I{dir}"));
    }
    let bindings = match b.generate() {
        Ok(b) => b,
        Err(e) => {
            eprintln!(
                "error: cannot generate SPANK bindings from slurm/spank.h ({e}).\n\
                 Install Slurm's development headers (Debian/Ubuntu: apt install libslurm-dev clang libclang-dev)\n\
                 or point SLURM_INCLUDE_DIR at the directory that holds slurm/spank.h."
            );
            std::process::exit(1);
        }
    };
    let text = bindings.to_string();
    // spank_prepend_task_argv exists from Slurm 23.11; older headers lack it.
    if text.contains("fn spank_prepend_task_argv") {
        println!("cargo:rustc-cfg=mpsr_have_prepend_argv");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("spank_sys.rs");
    std::fs::write(&out, text).expect("writing bindings");
}
