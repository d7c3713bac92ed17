//! The SPANK C API (bindgen output from the system `slurm/spank.h`) and the few safe wrappers the
//! plugin uses. Every `unsafe` block in the plugin that touches Slurm lives here.

#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    clippy::all
)]
pub mod ffi {
    include!(concat!(env!("OUT_DIR"), "/spank_sys.rs"));

    pub type spank_opt_cb_f = Option<
        unsafe extern "C" fn(
            val: std::os::raw::c_int,
            optarg: *const std::os::raw::c_char,
            remote: std::os::raw::c_int,
        ) -> std::os::raw::c_int,
    >;

    /// `struct spank_option` with const pointers: our table lives in static, read-only memory and
    /// Slurm keeps a pointer to it (it does not copy), so it must be `'static`.
    #[repr(C)]
    pub struct spank_option {
        pub name: *const std::os::raw::c_char,
        pub arginfo: *const std::os::raw::c_char,
        pub usage: *const std::os::raw::c_char,
        pub has_arg: std::os::raw::c_int,
        pub val: std::os::raw::c_int,
        pub cb: spank_opt_cb_f,
    }
}

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int};

/// SPANK context of the process the plugin was loaded into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Context {
    /// srun
    Local,
    /// slurmstepd
    Remote,
    /// sbatch / salloc
    Allocator,
    Slurmd,
    /// prolog / epilog helper
    JobScript,
    Unknown,
}

pub fn context() -> Context {
    // SAFETY: spank_context takes no arguments and only reads Slurm's global state.
    match unsafe { ffi::spank_context() } {
        ffi::S_CTX_LOCAL => Context::Local,
        ffi::S_CTX_REMOTE => Context::Remote,
        ffi::S_CTX_ALLOCATOR => Context::Allocator,
        ffi::S_CTX_SLURMD => Context::Slurmd,
        ffi::S_CTX_JOB_SCRIPT => Context::JobScript,
        _ => Context::Unknown,
    }
}

/// A SPANK error code with Slurm's text for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpankError {
    pub code: u32,
    pub what: &'static str,
}

impl std::fmt::Display for SpankError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: spank_strerror returns a pointer to a static string (or NULL).
        let p = unsafe { ffi::spank_strerror(self.code) };
        let text = if p.is_null() {
            "unknown SPANK error".into()
        } else {
            // SAFETY: non-NULL, NUL-terminated static string from Slurm.
            unsafe { CStr::from_ptr(p) }.to_string_lossy()
        };
        write!(f, "{}: {} ({})", self.what, text, self.code)
    }
}

fn check(code: ffi::spank_err_t, what: &'static str) -> Result<(), SpankError> {
    if code == ffi::ESPANK_SUCCESS {
        Ok(())
    } else {
        Err(SpankError { code, what })
    }
}

/// The handle Slurm passes to every callback; valid only for the duration of that callback.
#[derive(Clone, Copy)]
pub struct Spank(ffi::spank_t);

impl Spank {
    /// # Safety
    /// `sp` must be the handle Slurm passed to the running callback.
    pub unsafe fn from_raw(sp: ffi::spank_t) -> Spank {
        Spank(sp)
    }

    fn item_u32(&self, item: ffi::spank_item_t, what: &'static str) -> Result<u32, SpankError> {
        let mut v: u32 = 0;
        // SAFETY: for the u32-valued items used here, spank_get_item writes one uint32_t (or uid_t,
        // also 32-bit) through the pointer; v outlives the call.
        let rc = unsafe { ffi::spank_get_item(self.0, item, &mut v as *mut u32) };
        check(rc, what)?;
        Ok(v)
    }

    fn item_int(&self, item: ffi::spank_item_t, what: &'static str) -> Result<i32, SpankError> {
        let mut v: c_int = 0;
        // SAFETY: S_TASK_ID / S_TASK_EXIT_STATUS / S_TASK_PID write one int (pid_t is int) through
        // the pointer; v outlives the call.
        let rc = unsafe { ffi::spank_get_item(self.0, item, &mut v as *mut c_int) };
        check(rc, what)?;
        Ok(v)
    }

    pub fn job_id(&self) -> Result<u32, SpankError> {
        self.item_u32(ffi::S_JOB_ID, "job id")
    }
    pub fn step_id(&self) -> Result<u32, SpankError> {
        self.item_u32(ffi::S_JOB_STEPID, "step id")
    }
    pub fn job_uid(&self) -> Result<u32, SpankError> {
        self.item_u32(ffi::S_JOB_UID, "job uid")
    }
    pub fn restart_count(&self) -> Result<u32, SpankError> {
        self.item_u32(ffi::S_SLURM_RESTART_COUNT, "restart count")
    }
    pub fn local_task_count(&self) -> Result<u32, SpankError> {
        self.item_u32(ffi::S_JOB_LOCAL_TASK_COUNT, "local task count")
    }
    pub fn task_id(&self) -> Result<i32, SpankError> {
        self.item_int(ffi::S_TASK_ID, "task id")
    }
    pub fn task_pid(&self) -> Result<i32, SpankError> {
        self.item_int(ffi::S_TASK_PID, "task pid")
    }
    pub fn task_exit_status(&self) -> Result<i32, SpankError> {
        self.item_int(ffi::S_TASK_EXIT_STATUS, "task exit status")
    }

    /// The task's command line (`S_JOB_ARGV`).
    pub fn job_argv(&self) -> Result<Vec<String>, SpankError> {
        let mut argc: c_int = 0;
        let mut argv: *mut *mut c_char = std::ptr::null_mut();
        // SAFETY: S_JOB_ARGV writes an int and a char** that Slurm owns; both copied at once.
        let rc = unsafe {
            ffi::spank_get_item(self.0, ffi::S_JOB_ARGV, &mut argc as *mut c_int, &mut argv)
        };
        check(rc, "job argv")?;
        // SAFETY: argv has argc valid C strings (owned by Slurm for this callback).
        Ok(unsafe { args(argc, argv) })
    }

    /// Puts `argv` in front of the task's command (Slurm >= 23.11, task_init only).
    #[cfg(mpsr_have_prepend_argv)]
    pub fn prepend_task_argv(&self, argv: &[&str]) -> Result<(), SpankError> {
        let owned: Vec<CString> = argv
            .iter()
            .map(|a| CString::new(*a))
            .collect::<Result<_, _>>()
            .map_err(|_| SpankError {
                code: ffi::ESPANK_BAD_ARG,
                what: "prepend_task_argv",
            })?;
        let mut ptrs: Vec<*const c_char> = owned.iter().map(|c| c.as_ptr()).collect();
        // SAFETY: ptrs holds argv.len() valid C strings that outlive the call; Slurm copies them.
        check(
            unsafe { ffi::spank_prepend_task_argv(self.0, ptrs.len() as c_int, ptrs.as_mut_ptr()) },
            "prepend_task_argv",
        )
    }

    /// The job's environment variable (remote context only). `Ok(None)` when unset.
    pub fn getenv(&self, name: &str) -> Result<Option<String>, SpankError> {
        let Ok(cname) = CString::new(name) else {
            return Ok(None);
        };
        let mut len = 1024usize;
        while len <= 1 << 20 {
            let mut buf = vec![0u8; len];
            // SAFETY: buf has len writable bytes; Slurm NUL-terminates within len or returns NOSPACE.
            let rc = unsafe {
                ffi::spank_getenv(
                    self.0,
                    cname.as_ptr(),
                    buf.as_mut_ptr() as *mut c_char,
                    len as c_int,
                )
            };
            match rc {
                ffi::ESPANK_ENV_NOEXIST => return Ok(None),
                ffi::ESPANK_NOSPACE => len *= 4,
                rc => {
                    check(rc, "getenv")?;
                    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
                    return Ok(Some(String::from_utf8_lossy(&buf[..end]).into_owned()));
                }
            }
        }
        Err(SpankError {
            code: ffi::ESPANK_NOSPACE,
            what: "getenv",
        })
    }

    /// Sets a variable in the job's (or, in task callbacks, the task's) environment.
    pub fn setenv(&self, name: &str, value: &str) -> Result<(), SpankError> {
        let (Ok(n), Ok(v)) = (CString::new(name), CString::new(value)) else {
            return Err(SpankError {
                code: ffi::ESPANK_BAD_ARG,
                what: "setenv",
            });
        };
        // SAFETY: both strings are valid and NUL-terminated for the call; 1 = overwrite.
        check(
            unsafe { ffi::spank_setenv(self.0, n.as_ptr(), v.as_ptr(), 1) },
            "setenv",
        )
    }

    /// A variable for the job's prolog/epilog environment (`SPANK_<name>` there); srun/sbatch only.
    pub fn job_control_setenv(&self, name: &str, value: &str) -> Result<(), SpankError> {
        let (Ok(n), Ok(v)) = (CString::new(name), CString::new(value)) else {
            return Err(SpankError {
                code: ffi::ESPANK_BAD_ARG,
                what: "job_control_setenv",
            });
        };
        // SAFETY: both strings are valid and NUL-terminated for the call; 1 = overwrite.
        check(
            unsafe { ffi::spank_job_control_setenv(self.0, n.as_ptr(), v.as_ptr(), 1) },
            "job_control_setenv",
        )
    }

    pub fn register_option(&self, opt: &'static OptionEntry) -> Result<(), SpankError> {
        // SAFETY: opt points to a 'static spank_option whose strings are 'static C strings; Slurm
        // keeps the pointer and never writes through it.
        check(
            unsafe { ffi::spank_option_register(self.0, opt.0.get()) },
            "option register",
        )
    }

    /// Whether the option was given for this job, and its argument (remote and job-script contexts).
    pub fn getopt(&self, opt: &'static OptionEntry) -> Result<Option<Option<String>>, SpankError> {
        let mut arg: *mut c_char = std::ptr::null_mut();
        // SAFETY: opt is a registered 'static option; arg receives a pointer owned by Slurm, valid
        // until the callback returns, which we copy at once.
        let rc = unsafe { ffi::spank_option_getopt(self.0, opt.0.get(), &mut arg) };
        match rc {
            ffi::ESPANK_SUCCESS if arg.is_null() => Ok(Some(None)),
            ffi::ESPANK_SUCCESS => {
                // SAFETY: non-NULL, NUL-terminated string owned by Slurm (see above).
                let s = unsafe { CStr::from_ptr(arg) }
                    .to_string_lossy()
                    .into_owned();
                Ok(Some(if s == "(null)" { None } else { Some(s) }))
            }
            ffi::ESPANK_ERROR => Ok(None), // "option not used"
            rc => Err(SpankError {
                code: rc,
                what: "option getopt",
            }),
        }
    }
}

/// One `struct spank_option` in static memory.
pub struct OptionEntry(std::cell::UnsafeCell<ffi::spank_option>);

// SAFETY: the entries are written only at compile time; Slurm and we only read them.
unsafe impl Sync for OptionEntry {}

impl OptionEntry {
    pub const fn new(
        name: &'static CStr,
        arginfo: Option<&'static CStr>,
        usage: &'static CStr,
        has_arg: c_int,
        val: c_int,
        cb: ffi::spank_opt_cb_f,
    ) -> OptionEntry {
        OptionEntry(std::cell::UnsafeCell::new(ffi::spank_option {
            name: name.as_ptr(),
            arginfo: match arginfo {
                Some(a) => a.as_ptr(),
                None => std::ptr::null(),
            },
            usage: usage.as_ptr(),
            has_arg,
            val,
            cb,
        }))
    }
}

/// plugstack.conf arguments of this plugin.
///
/// # Safety
/// `av` must point to `ac` valid C strings (as Slurm passes them to callbacks).
pub unsafe fn args(ac: c_int, av: *mut *mut c_char) -> Vec<String> {
    if av.is_null() || ac <= 0 {
        return Vec::new();
    }
    (0..ac as usize)
        .filter_map(|i| {
            // SAFETY: i < ac, and the caller guarantees av has ac entries.
            let p = unsafe { *av.add(i) };
            // SAFETY: each non-NULL entry is a NUL-terminated string owned by Slurm.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        })
        .collect()
}

fn log_with(f: unsafe extern "C" fn(*const c_char, ...), msg: &str) {
    let m = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // SAFETY: printf-style function called with a constant "%s" format and one C string argument.
    unsafe { f(c"%s".as_ptr(), m.as_ptr()) }
}

/// To slurmd/slurmstepd's log (and srun's stderr in local context), at error level.
pub fn log_error(msg: &str) {
    log_with(ffi::slurm_error, &format!("mps-resilient: {msg}"))
}

pub fn log_info(msg: &str) {
    log_with(ffi::slurm_info, &format!("mps-resilient: {msg}"))
}

pub fn log_verbose(msg: &str) {
    log_with(ffi::slurm_verbose, &format!("mps-resilient: {msg}"))
}

/// To the user (no "error:" prefix): srun/sbatch's terminal.
pub fn log_user(msg: &str) {
    log_with(ffi::slurm_spank_log, &format!("mps-resilient: {msg}"))
}
