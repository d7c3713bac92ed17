//! Where faults come in on a real node. What enters: `/dev/kmsg` records, each fault domain's MPS
//! logs (server.log, control.log). What leaves: `fault::correlate::Signal`s on the fault worker's
//! channel. (The NVML event thread lives with its backend in `gpu::nvml`; the server probe with
//! the domains' lifecycle.)
//!
//! - `kernel_line`: the NVRM Xid and isolation lines, parsed.
//! - `control_log`: the MPS daemons' log lines, parsed.
//! - `readers`: the kmsg reader thread and the log tails.
//! - `file_watch`: waiting for a log to change (inotify).

pub mod control_log;
pub mod file_watch;
pub mod kernel_line;
pub mod readers;
