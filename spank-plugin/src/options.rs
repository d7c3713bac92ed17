//! The plugin's options: one table, one callback, values parsed and validated here.
//!
//! `--mps-resilient[=MODE]`, `--mps-threads=PCT`, `--mps-mem=SIZE`, `--mps-isolation=KIND`,
//! `--mps-standby[=KIND]`. Bad values are refused in
//! srun/sbatch (the callback returns -1, so the command exits non-zero with the message).

use crate::sys::{ffi, OptionEntry};
use mpsr_proto::standby::Kind as StandbyKind;
use mpsr_proto::{Isolation, Mode};
use std::os::raw::{c_char, c_int};
use std::sync::Mutex;

pub const OPT_MODE: c_int = 0;
pub const OPT_THREADS: c_int = 1;
pub const OPT_MEM: c_int = 2;
pub const OPT_ISOLATION: c_int = 3;
pub const OPT_STANDBY: c_int = 4;

pub static OPTIONS: [OptionEntry; 5] = [
    OptionEntry::new(
        c"mps-resilient",
        Some(c"MODE"),
        c"[mps-resilient] share GPUs through per-GPU MPS with fault protection. MODE: requeue (batch jobs are requeued when a GPU fault hits them), resume (hit tasks restart in place; run them under mpsr-run), off (MPS only). Default set by the admin (usually requeue).",
        2,
        OPT_MODE,
        Some(option_cb),
    ),
    OptionEntry::new(
        c"mps-threads",
        Some(c"PCT"),
        c"[mps-resilient] MPS active thread percentage for this job's GPU clients (1-100).",
        1,
        OPT_THREADS,
        Some(option_cb),
    ),
    OptionEntry::new(
        c"mps-mem",
        Some(c"SIZE"),
        c"[mps-resilient] pinned device memory limit per GPU client, e.g. 8G or 512M.",
        1,
        OPT_MEM,
        Some(option_cb),
    ),
    OptionEntry::new(
        c"mps-isolation",
        Some(c"KIND"),
        c"[mps-resilient] who shares this job's MPS server, i.e. whose GPU fault can kill it. shared: every job on the GPU (fastest: all run concurrently); job: this job's tasks only (other jobs are time-sliced against it); user: your jobs only. What is allowed and the default are set by the admin.",
        1,
        OPT_ISOLATION,
        Some(option_cb),
    ),
    OptionEntry::new(
        c"mps-standby",
        Some(c"KIND"),
        c"[mps-resilient] with --mps-resilient=resume: keep a standby of each task that takes over when a GPU fault hits it, instead of a restart (mpsr-run starts it). KIND hot (default): prepared up to its first computation in another MPS server, waiting in mpsr_state_ready(); back ~20 ms after a fault; costs the GPU memory of a second CUDA context per task. warm: prepared up to its first CUDA call, waiting in mpsr_state_before_cuda(); no GPU memory; back after its CUDA set-up (~0.2-0.3 s).",
        2,
        OPT_STANDBY,
        Some(option_cb),
    ),
];

/// What the user asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OptValues {
    /// `Some(None)`: `--mps-resilient` without a value (the admin's default mode applies).
    pub mode: Option<Option<Mode>>,
    pub threads: Option<u8>,
    pub mem: Option<u64>,
    pub isolation: Option<Isolation>,
    /// `--mps-standby[=KIND]`: a standby per task (resume mode).
    pub standby: Option<StandbyKind>,
}

impl OptValues {
    pub fn enabled(&self) -> bool {
        self.mode.is_some()
    }

    pub fn mode(&self, default: Mode) -> Option<Mode> {
        self.mode.map(|m| m.unwrap_or(default))
    }

    /// Limits without the main flag are a mistake worth telling the user about.
    pub fn check(&self) -> Result<(), String> {
        if self.mode.is_none()
            && (self.threads.is_some()
                || self.mem.is_some()
                || self.isolation.is_some()
                || self.standby.is_some())
        {
            return Err(
                "--mps-threads/--mps-mem/--mps-isolation/--mps-standby need --mps-resilient".into(),
            );
        }
        if self.standby.is_some() && matches!(self.mode, Some(Some(m)) if m != Mode::Resume) {
            return Err(
                "--mps-standby needs --mps-resilient=resume (a standby takes over in place)".into(),
            );
        }
        Ok(())
    }

    /// Applies one option occurrence. Slurm may call us twice with the same value; a conflicting
    /// repeat is an error.
    pub fn apply(&mut self, val: c_int, arg: Option<&str>) -> Result<(), String> {
        match val {
            OPT_MODE => {
                let m = match arg {
                    None | Some("") | Some("(null)") => None,
                    Some(a) => Some(parse_mode(a)?),
                };
                if let (Some(Some(prev)), Some(new)) = (self.mode, m) {
                    if prev != new {
                        return Err("--mps-resilient given twice with different modes".into());
                    }
                }
                if m.is_some() || self.mode.is_none() {
                    self.mode = Some(m);
                }
            }
            OPT_THREADS => self.threads = Some(parse_threads(arg.unwrap_or(""))?),
            OPT_MEM => self.mem = Some(parse_mem(arg.unwrap_or(""))?),
            OPT_ISOLATION => self.isolation = Some(parse_isolation(arg.unwrap_or(""))?),
            OPT_STANDBY => {
                let k = match arg {
                    None | Some("") | Some("(null)") => StandbyKind::Hot,
                    Some(a) => parse_standby(a)?,
                };
                if self.standby.is_some_and(|prev| prev != k) {
                    return Err("--mps-standby given twice with different kinds".into());
                }
                self.standby = Some(k);
            }
            other => return Err(format!("unknown option index {other}")),
        }
        Ok(())
    }
}

pub fn parse_standby(s: &str) -> Result<StandbyKind, String> {
    match s.trim() {
        "hot" => Ok(StandbyKind::Hot),
        "warm" => Ok(StandbyKind::Warm),
        _ => Err(format!("--mps-standby={s}: expected hot or warm")),
    }
}

pub fn parse_mode(s: &str) -> Result<Mode, String> {
    s.parse::<Mode>()
        .map_err(|_| format!("--mps-resilient={s}: expected requeue, resume or off"))
}

pub fn parse_threads(s: &str) -> Result<u8, String> {
    s.trim()
        .parse::<u8>()
        .ok()
        .filter(|p| (1..=100).contains(p))
        .ok_or_else(|| format!("--mps-threads={s}: expected a percentage in 1..100"))
}

pub fn parse_mem(s: &str) -> Result<u64, String> {
    mpsr_proto::parse_size(s)
        .ok_or_else(|| format!("--mps-mem={s}: expected a size such as 8G, 512M or 1073741824"))
}

pub fn parse_isolation(s: &str) -> Result<Isolation, String> {
    s.trim()
        .parse::<Isolation>()
        .map_err(|_| format!("--mps-isolation={s}: expected shared, job or user"))
}

/// Values seen by the option callback in this process (srun/sbatch, or slurmstepd).
pub static SEEN: Mutex<OptValues> = Mutex::new(OptValues {
    mode: None,
    threads: None,
    mem: None,
    isolation: None,
    standby: None,
});

pub fn seen() -> OptValues {
    SEEN.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The one callback for every option. Never unwinds into Slurm.
unsafe extern "C" fn option_cb(val: c_int, optarg: *const c_char, _remote: c_int) -> c_int {
    let arg = if optarg.is_null() {
        None
    } else {
        // SAFETY: Slurm passes a NUL-terminated string valid for the duration of the callback.
        Some(
            unsafe { std::ffi::CStr::from_ptr(optarg) }
                .to_string_lossy()
                .into_owned(),
        )
    };
    let r = std::panic::catch_unwind(|| {
        SEEN.lock()
            .unwrap_or_else(|p| p.into_inner())
            .apply(val, arg.as_deref())
    });
    match r {
        Ok(Ok(())) => 0,
        Ok(Err(msg)) => {
            crate::sys::log_error(&msg);
            -1
        }
        Err(_) => -1,
    }
}

/// The option entry for an index (for `spank_option_getopt`).
pub fn entry(val: c_int) -> &'static OptionEntry {
    &OPTIONS[val as usize]
}

// Keep the C type in sync with the hand-written declaration.
const _: ffi::spank_opt_cb_f = Some(option_cb);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_and_validate() {
        let mut v = OptValues::default();
        assert!(!v.enabled());
        v.apply(OPT_MODE, None).unwrap();
        assert_eq!(v.mode(Mode::Requeue), Some(Mode::Requeue));
        v.apply(OPT_MODE, Some("resume")).unwrap();
        assert_eq!(v.mode(Mode::Requeue), Some(Mode::Resume));
        // Same value twice is fine (Slurm does that); a different one is not.
        v.apply(OPT_MODE, Some("resume")).unwrap();
        assert!(v.apply(OPT_MODE, Some("off")).is_err());
        v.apply(OPT_THREADS, Some("30")).unwrap();
        v.apply(OPT_MEM, Some("8G")).unwrap();
        v.apply(OPT_ISOLATION, Some("job")).unwrap();
        assert_eq!(v.isolation, Some(Isolation::Job));
        assert_eq!(v.threads, Some(30));
        assert_eq!(v.mem, Some(8 << 30));
        v.check().unwrap();
    }

    #[test]
    fn a_standby_needs_resume_mode() {
        let mut v = OptValues::default();
        v.apply(OPT_STANDBY, None).unwrap();
        assert!(v.check().unwrap_err().contains("need --mps-resilient"));
        v.apply(OPT_MODE, Some("requeue")).unwrap();
        assert!(v.check().unwrap_err().contains("--mps-resilient=resume"));
        let mut v = OptValues::default();
        v.apply(OPT_MODE, Some("resume")).unwrap();
        v.apply(OPT_STANDBY, None).unwrap();
        assert!(v.check().is_ok() && v.standby == Some(StandbyKind::Hot));
        let mut v = OptValues::default();
        v.apply(OPT_MODE, Some("resume")).unwrap();
        v.apply(OPT_STANDBY, Some("warm")).unwrap();
        assert_eq!(v.standby, Some(StandbyKind::Warm));
        assert!(
            v.apply(OPT_STANDBY, Some("hot")).is_err(),
            "conflicting repeat"
        );
        assert!(
            v.apply(OPT_STANDBY, Some("warm")).is_ok(),
            "the same repeat"
        );
        assert!(v
            .apply(OPT_STANDBY, Some("cold"))
            .unwrap_err()
            .contains("hot or warm"));
        // The admin's default mode is checked on the node (a warning there, not a refusal).
        let mut v = OptValues::default();
        v.apply(OPT_MODE, None).unwrap();
        v.apply(OPT_STANDBY, None).unwrap();
        assert!(v.check().is_ok());
    }

    #[test]
    fn bad_values_rejected_with_the_option_named() {
        let mut v = OptValues::default();
        let e = v.apply(OPT_MODE, Some("sometimes")).unwrap_err();
        assert!(e.contains("--mps-resilient=sometimes"), "{e}");
        assert!(v.apply(OPT_THREADS, Some("0")).is_err());
        assert!(v.apply(OPT_THREADS, Some("101")).is_err());
        assert!(v.apply(OPT_THREADS, Some("")).is_err());
        assert!(v
            .apply(OPT_MEM, Some("lots"))
            .unwrap_err()
            .contains("--mps-mem"));
        let e = v.apply(OPT_ISOLATION, Some("gpu")).unwrap_err();
        assert!(e.contains("--mps-isolation=gpu"), "{e}");
        let mut only_iso = OptValues::default();
        only_iso.apply(OPT_ISOLATION, Some("user")).unwrap();
        assert!(only_iso.check().is_err());
        let mut only_limits = OptValues::default();
        only_limits.apply(OPT_THREADS, Some("50")).unwrap();
        assert!(only_limits.check().is_err());
    }
}
