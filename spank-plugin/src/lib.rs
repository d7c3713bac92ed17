//! mps-resilient SPANK plugin: the one entry file. Each Slurm hook dispatches by context to one
//! module per context (`local`: srun and sbatch/salloc; `remote`: slurmstepd). Logic lives in the
//! node agent; this plugin only sets each task's MPS client context and registers it.
//!
//! Failure rules (see ../shared/research/spank.md): no panic crosses into Slurm (every hook runs
//! under `catch_unwind`); errors found in slurmstepd are deferred to `task_init`, which fails only
//! the job; `task_exit` never fails; no `job_prolog`/`task_post_fork` is exported, so nothing here
//! can drain a node.

pub mod agent;
pub mod config;
pub mod gpus;
pub mod local;
pub mod options;
pub mod remote;
pub mod sys;

use std::os::raw::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};
use sys::{ffi, Context, Spank};

#[no_mangle]
pub static plugin_name: [u8; 14] = *b"mps_resilient\0";
#[no_mangle]
pub static plugin_type: [u8; 6] = *b"spank\0";
/// Must equal the header's SLURM_VERSION_NUMBER (Slurm checks major.minor).
#[no_mangle]
pub static plugin_version: u32 = ffi::SLURM_VERSION_NUMBER;

/// Runs a hook body; a panic becomes `on_panic` and a log line instead of unwinding into C.
fn guard(hook: &str, on_panic: c_int, f: impl FnOnce() -> c_int) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(rc) => rc,
        Err(_) => {
            sys::log_error(&format!(
                "internal error in {hook} (a bug; please report it)"
            ));
            on_panic
        }
    }
}

/// # Safety
/// Called by Slurm with the handle (and arguments) of the running callback.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_init(
    sp: ffi::spank_t,
    ac: c_int,
    av: *mut *mut c_char,
) -> c_int {
    guard("init", 0, || {
        // SAFETY: sp and av come straight from Slurm for this callback.
        let (sp, args) = unsafe { (Spank::from_raw(sp), sys::args(ac, av)) };
        match sys::context() {
            Context::Local | Context::Allocator => local::init(sp, &args),
            Context::Remote => remote::init(sp, &args),
            Context::Slurmd => {
                // Never fail slurmd itself: a broken line is reported and jobs fail in task_init.
                if let Err(e) = config::PlugConfig::parse(&args) {
                    sys::log_error(&e.to_string());
                }
                0
            }
            Context::JobScript | Context::Unknown => 0,
        }
    })
}

/// # Safety
/// Called by Slurm with the handle (and arguments) of the running callback.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_init_post_opt(
    sp: ffi::spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guard("init_post_opt", -1, || {
        // SAFETY: sp comes straight from Slurm for this callback.
        let sp = unsafe { Spank::from_raw(sp) };
        match sys::context() {
            Context::Local | Context::Allocator => local::init_post_opt(sp),
            _ => 0,
        }
    })
}

/// # Safety
/// Called by Slurm with the handle (and arguments) of the running callback.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_user_init(
    sp: ffi::spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    // user_init errors do not fail an srun (Slurm bug 7573) and drain under sbatch: never fail here.
    guard("user_init", 0, || {
        // SAFETY: sp comes straight from Slurm for this callback.
        let sp = unsafe { Spank::from_raw(sp) };
        if sys::context() == Context::Remote {
            remote::user_init(sp);
        }
        0
    })
}

/// # Safety
/// Called by Slurm with the handle (and arguments) of the running callback.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_task_init_privileged(
    sp: ffi::spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guard("task_init_privileged", 0, || {
        // SAFETY: sp comes straight from Slurm for this callback.
        let sp = unsafe { Spank::from_raw(sp) };
        if sys::context() == Context::Remote {
            remote::task_init_privileged(sp);
        }
        0
    })
}

/// # Safety
/// Called by Slurm with the handle (and arguments) of the running callback.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_task_init(
    sp: ffi::spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guard("task_init", -1, || {
        // SAFETY: sp comes straight from Slurm for this callback.
        let sp = unsafe { Spank::from_raw(sp) };
        match sys::context() {
            Context::Remote => remote::task_init(sp),
            _ => 0,
        }
    })
}

/// # Safety
/// Called by Slurm with the handle (and arguments) of the running callback.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_task_exit(
    sp: ffi::spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guard("task_exit", 0, || {
        // SAFETY: sp comes straight from Slurm for this callback.
        let sp = unsafe { Spank::from_raw(sp) };
        if sys::context() == Context::Remote {
            remote::task_exit(sp);
        }
        0
    })
}
