//! srun (local) and sbatch/salloc (allocator) contexts: register and validate the options, refuse
//! bad plugstack.conf lines loudly, and tell the prolog/epilog that the job is protected.

use crate::config;
use crate::options::{self, OPTIONS};
use crate::sys::{self, Spank};

/// Variable in the job-control environment; the prolog/epilog see it as `SPANK_MPSR_MODE`.
pub const MODE_VAR: &str = "MPSR_MODE";

pub fn init(sp: Spank, args: &[String]) -> i32 {
    if let Err(e) = config::load(args) {
        sys::log_error(&e.to_string());
        return -1;
    }
    for o in &OPTIONS {
        if let Err(e) = sp.register_option(o) {
            sys::log_error(&format!("cannot register option: {e}"));
            return -1;
        }
    }
    0
}

pub fn init_post_opt(sp: Spank) -> i32 {
    let v = options::seen();
    if let Err(e) = v.check() {
        sys::log_error(&e);
        return -1;
    }
    // init() already refused a bad config.
    let default = config::loaded().unwrap_or_default().default_mode;
    if let Some(mode) = v.mode(default) {
        if let Err(e) = sp.job_control_setenv(MODE_VAR, &mode.to_string()) {
            sys::log_verbose(&format!("job_control_setenv {MODE_VAR}: {e}"));
        }
    }
    0
}
