//! Which GPUs a step has, and which one each task uses.
//!
//! Slurm has no SPANK item for GPUs: they come from the step's environment. `SLURM_STEP_GPUS` /
//! `SLURM_JOB_GPUS` hold the node's GPU indexes (not renumbered by device cgroups), so they are
//! preferred over `CUDA_VISIBLE_DEVICES`; `GPU_DEVICE_ORDINAL` (same numbering as
//! `CUDA_VISIBLE_DEVICES`) is the last resort: with shards on some nodes and gres/mps on others,
//! Slurm 22.05 gives a shard step that one alone. The agent runs one MPS server per GPU, and an MPS client
//! talks to one server, so each task uses one GPU: task `i` gets `gpus[i % n]` (like
//! `--gpu-bind=single:1`).

/// Environment variables consulted, in order.
pub const SOURCES: [&str; 4] = [
    "SLURM_STEP_GPUS",
    "SLURM_JOB_GPUS",
    "CUDA_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuListError {
    /// GPU UUIDs or MIG names: the agent numbers GPUs by index.
    NotIndexes { var: &'static str, value: String },
}

impl std::fmt::Display for GpuListError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuListError::NotIndexes { var, value } => write!(
                f,
                "{var}={value} is not a list of GPU indexes (UUIDs and MIG devices are not supported)"
            ),
        }
    }
}

/// The first non-empty source wins. `Ok(empty)` = the step has no GPU.
pub fn from_env(
    get: impl Fn(&str) -> Option<String>,
) -> Result<(Vec<u32>, &'static str), GpuListError> {
    for var in SOURCES {
        let Some(v) = get(var) else { continue };
        let v = v.trim();
        if v.is_empty() || v == "NoDevFiles" {
            continue;
        }
        let mut out = Vec::new();
        for part in v.split(',') {
            match part.trim().parse::<u32>() {
                Ok(i) => {
                    if !out.contains(&i) {
                        out.push(i)
                    }
                }
                Err(_) => {
                    return Err(GpuListError::NotIndexes {
                        var,
                        value: v.to_string(),
                    })
                }
            }
        }
        return Ok((out, var));
    }
    Ok((Vec::new(), ""))
}

/// The GPU (position in `gpus`) a task with this local id uses.
pub fn for_task(gpus: &[u32], local_task_id: u32) -> Option<usize> {
    (!gpus.is_empty()).then(|| local_task_id as usize % gpus.len())
}

/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` for a client that sees one device (ordinal 0).
pub fn mem_limit_env(bytes: u64) -> String {
    const MIB: u64 = 1 << 20;
    if bytes.is_multiple_of(1 << 30) {
        format!("0={}G", bytes >> 30)
    } else {
        format!("0={}M", bytes.div_ceil(MIB))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn step_gpus_preferred_then_job_then_cuda() {
        let e = env(&[("SLURM_STEP_GPUS", "2,3"), ("CUDA_VISIBLE_DEVICES", "0,1")]);
        assert_eq!(from_env(e).unwrap(), (vec![2, 3], "SLURM_STEP_GPUS"));
        let e = env(&[("SLURM_JOB_GPUS", "1"), ("CUDA_VISIBLE_DEVICES", "0")]);
        assert_eq!(from_env(e).unwrap(), (vec![1], "SLURM_JOB_GPUS"));
        // A shard step of a cluster with shards and gres/mps (Slurm 22.05): that one alone.
        let e = env(&[("GPU_DEVICE_ORDINAL", "1"), ("SLURM_SHARDS_ON_NODE", "4")]);
        assert_eq!(from_env(e).unwrap(), (vec![1], "GPU_DEVICE_ORDINAL"));
        let e = env(&[("CUDA_VISIBLE_DEVICES", "0, 1,1")]);
        assert_eq!(from_env(e).unwrap().0, vec![0, 1]);
        assert_eq!(from_env(env(&[])).unwrap().0, Vec::<u32>::new());
        let e = env(&[("CUDA_VISIBLE_DEVICES", "NoDevFiles")]);
        assert!(from_env(e).unwrap().0.is_empty());
    }

    #[test]
    fn uuids_are_refused_clearly() {
        let e = env(&[("CUDA_VISIBLE_DEVICES", "GPU-8e2f-1234")]);
        let err = from_env(e).unwrap_err();
        assert!(err
            .to_string()
            .contains("CUDA_VISIBLE_DEVICES=GPU-8e2f-1234"));
    }

    #[test]
    fn tasks_round_robin_and_limits() {
        assert_eq!(for_task(&[4, 5], 0), Some(0));
        assert_eq!(for_task(&[4, 5], 3), Some(1));
        assert_eq!(for_task(&[], 0), None);
        assert_eq!(mem_limit_env(8 << 30), "0=8G");
        assert_eq!(mem_limit_env(512 << 20), "0=512M");
        assert_eq!(mem_limit_env(1000), "0=1M");
    }
}
