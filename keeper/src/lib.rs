//! mps-resilient state keeper: one process per GPU, outside MPS (not an MPS client, so a fault that
//! kills the GPU's MPS clients does not touch it, and it does not block the server's recovery). It
//! holds named GPU allocations per job and hands them to the job's processes as fds; a process that
//! dies of a GPU fault leaves them intact for its restarted self (KNOWLEDGE.md: measured on an H200).

pub mod memory;
pub mod server;
pub mod snapshot;
pub mod store;
