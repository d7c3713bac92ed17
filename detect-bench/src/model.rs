//! The SIMULATED node a case runs on: 8 GPUs like an H100 SXM (80 GB, 1980 MHz, slowdown at
//! 87 °C), the job ranks on them, and what the hardware is (ground truth) at each second, with
//! faults overlaid. Written apart from the agent's own simulator (mpsr_telemetry::replay), so the
//! rules are not scored against the generator they were tuned on.

/// splitmix64: small, deterministic.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x6d70_7372_6265_6e63)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
    /// Roughly normal (sum of uniforms), mean 0, sd 1.
    pub fn gauss(&mut self) -> f64 {
        (0..4).map(|_| self.unit()).sum::<f64>() * 3f64.sqrt() - 2.0 * 3f64.sqrt()
    }
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[(self.next_u64() % xs.len() as u64) as usize]
    }
}

pub const GPUS: u32 = 8;
pub const MEM_TOTAL: u64 = 85_520_809_984; // H100 80GB HBM3 as NVML reports it
pub const SM_MAX_MHZ: f64 = 1980.0;
pub const SLOWDOWN_C: f64 = 87.0;
const GIB: u64 = 1 << 30;

/// How a rank's work varies over time (healthy).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// Steady compute at this utilization.
    Steady(f64),
    /// Bursts (inference under traffic): busy `hi` for a random part of each minute, else `lo`.
    Bursty { lo: f64, hi: f64 },
    /// An inference server that idles for stretches of up to `max_idle_s` between bursts.
    IdleServer { max_idle_s: f64 },
    /// Training whose rank 0 writes a checkpoint every `every_s` for `pause_s` (its peers wait in
    /// a collective at full utilization meanwhile).
    Checkpointing { every_s: f64, pause_s: f64 },
}

#[derive(Debug, Clone)]
pub struct Rank {
    pub gpu: u32,
    pub pid: u32,
    pub job: u32,
    pub uid: u32,
    /// Rank index within its job (0 checkpoints).
    pub index: u32,
    pub load: Load,
    pub mem: u64,
    /// `--mps-threads` of its job (its intended share of the GPU), if set.
    pub thread_pct: Option<u8>,
    /// `--mps-mem` of its job, if set.
    pub mem_limit: Option<u64>,
    /// Present from .. until (job churn).
    pub from_s: f64,
    pub until_s: f64,
    /// Its usual step time where the application marks steps (`mpsr_step()`).
    pub step_s: Option<f64>,
}

/// What goes wrong (positives) or happens that must not alarm (healthy events).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// HW slowdown clock event, clocks at `1 - sev`.
    Throttle,
    /// Temperature `sev` °C below the slowdown threshold (sev 0..3).
    Thermal,
    /// Corrected ECC errors, `sev` per minute.
    EccStorm,
    /// One uncorrectable ECC error.
    EccDbe,
    RemapPending,
    /// PCIe replays at `sev` times the link's BER bound.
    Replays,
    /// Link width x16 -> x8.
    LinkWidth,
    /// Link generation 5 -> 3 while busy.
    LinkGen,
    /// NVLink errors, `sev` per minute.
    Nvlink,
    /// NVML: GPU lost.
    Lost,
    /// One GPU's SM clock at `sev` of the others (no clock-event bit).
    ClockSkew,
    /// Every GPU of the node at `sev` of its usual clock (no bit): the whole node is slow.
    NodeSlow,
    /// A rank's utilization at `sev` of its peers'.
    Straggler,
    /// A tensor-parallel rank computing at `sev` of its speed: its peers spin in NCCL at full
    /// utilization waiting for it (every rank reads ~100 %).
    TpSlowRank,
    /// A rank holding `sev` times its peers' memory.
    MemSkew,
    /// A job's memory growing toward its own limit (`sev` of it reached at the end).
    NearOom,
    /// A client without a thread limit takes the whole shared server; the others starve.
    Hog,
    /// A job hangs: every rank holds its memory and computes nothing.
    Hung,
    /// NIC errors, `sev` per minute.
    NicErrors,
    /// A replica's steps take `sev` times as long (independent replicas: its peers do not wait).
    StepSlow,
    /// A rank's step does not end while on (a host-side stall: data loader, CPU).
    StepStall,
    // Healthy events.
    /// The driver reloads: every counter restarts from 0.
    CounterReset,
    /// The GPU runs at its software power cap (SW_POWER_CAP, clocks down by `sev`).
    PowerCap,
    /// Congestion: transmit discards, `sev` per minute (not errors).
    Congestion,
}

/// A fault in effect over [start, end), on for `duty` of each `period_s`.
#[derive(Debug, Clone)]
pub struct Overlay {
    pub fault: Fault,
    pub gpu: u32,
    pub pid: Option<u32>,
    pub job: Option<u32>,
    pub start: f64,
    pub end: f64,
    pub duty: f64,
    pub period_s: f64,
    pub sev: f64,
}

impl Overlay {
    pub fn on(&self, t: f64) -> bool {
        if t < self.start || t >= self.end {
            return false;
        }
        self.duty >= 1.0 || ((t - self.start) % self.period_s) < self.duty * self.period_s
    }
    /// Seconds it has been on up to `t`.
    pub fn on_for(&self, t: f64) -> f64 {
        if t <= self.start {
            return 0.0;
        }
        let span = t.min(self.end) - self.start;
        if self.duty >= 1.0 {
            return span;
        }
        let full = (span / self.period_s).floor();
        let rest = span - full * self.period_s;
        full * self.duty * self.period_s + rest.min(self.duty * self.period_s)
    }
}

/// One node: its ranks, faults and NIC ports.
#[derive(Debug, Clone)]
pub struct Node {
    pub seed: u64,
    pub ranks: Vec<Rank>,
    pub overlays: Vec<Overlay>,
    pub nics: Vec<String>,
    /// Background NIC errors per hour (healthy links see a few).
    pub nic_background_per_h: f64,
}

/// The hardware of one GPU at one moment.
#[derive(Debug, Clone, Default)]
pub struct GpuTruth {
    pub gpu: u32,
    pub lost: bool,
    pub util: f64,
    pub mem_used: u64,
    pub clock_mhz: f64,
    pub events: u64,
    pub temp_c: f64,
    pub power_w: f64,
    pub ecc_sbe: u64,
    pub ecc_dbe: u64,
    pub replays: u64,
    pub pcie_gen: u32,
    pub pcie_width: u32,
    pub nvlink_errors: u64,
    pub remap_pending: bool,
    pub sm_active: f64,
    pub sm_occupancy: f64,
    pub tensor_active: f64,
    pub dram_active: f64,
}

/// A rank's steps at one moment.
#[derive(Debug, Clone, Copy)]
pub struct StepTruth {
    /// The step time of its recent steps.
    pub step_s: f64,
    /// How long the step under way has been stalled; `None` when it is not.
    pub stalled_for: Option<f64>,
    /// The application said it is idle (`mpsr_step_idle()`: waiting for requests, checkpointing).
    pub idle: bool,
}

#[derive(Debug, Clone)]
pub struct ClientTruth {
    pub gpu: u32,
    pub pid: u32,
    pub job: u32,
    pub uid: u32,
    pub util: f64,
    pub mem: u64,
    pub thread_pct: Option<u8>,
    pub mem_limit: Option<u64>,
    pub step: Option<StepTruth>,
}

#[derive(Debug, Clone)]
pub struct NicTruth {
    pub port: String,
    pub errors: u64,
    pub discards: u64,
}

#[derive(Debug, Clone)]
pub struct Truth {
    pub t: f64,
    pub gpus: Vec<GpuTruth>,
    pub clients: Vec<ClientTruth>,
    pub nics: Vec<NicTruth>,
}

/// Keyed noise: the same (seed, t, stream) always gives the same value (-1..1).
fn noise(seed: u64, t: f64, stream: u64) -> f64 {
    let mut r =
        Rng::new(seed ^ ((t * 10.0) as u64).wrapping_mul(0x100_0193) ^ stream.wrapping_mul(0x9e37));
    r.unit() * 2.0 - 1.0
}

/// Slow noise: a value that drifts over `period_s` (interpolated between keyed points).
fn drift(seed: u64, t: f64, stream: u64, period_s: f64) -> f64 {
    let k = (t / period_s).floor();
    let f = t / period_s - k;
    let a = noise(seed, k * 1000.0, stream);
    let b = noise(seed, (k + 1.0) * 1000.0, stream);
    a + (b - a) * f
}

impl Node {
    fn on(&self, t: f64, gpu: u32, f: Fault) -> Option<&Overlay> {
        self.overlays
            .iter()
            .find(|o| o.fault == f && o.gpu == gpu && o.on(t))
    }
    fn node_on(&self, t: f64, f: Fault) -> Option<&Overlay> {
        self.overlays.iter().find(|o| o.fault == f && o.on(t))
    }
    fn rank_on(&self, t: f64, r: &Rank, f: Fault) -> Option<&Overlay> {
        self.overlays
            .iter()
            .find(|o| o.fault == f && o.on(t) && (o.pid == Some(r.pid) || o.job == Some(r.job)))
    }
    /// Events a fault added up to `t`: `sev` (times `scale`) per minute while on.
    fn count(&self, t: f64, gpu: u32, f: Fault, scale: f64) -> f64 {
        self.overlays
            .iter()
            .filter(|o| o.fault == f && o.gpu == gpu)
            .map(|o| o.on_for(t) * o.sev * scale / 60.0)
            .sum()
    }

    /// The rank's own utilization (its work), before faults of other ranks.
    fn base_util(&self, r: &Rank, t: f64) -> f64 {
        let n = 0.03 * noise(self.seed, t, 100 + r.pid as u64);
        match r.load {
            Load::Steady(u) => (u + n).clamp(0.0, 1.0),
            Load::Bursty { lo, hi } => {
                let busy = drift(self.seed, t, 200 + r.job as u64, 45.0) > 0.0;
                (if busy { hi } else { lo } + n).clamp(0.0, 1.0)
            }
            Load::IdleServer { max_idle_s } => {
                // Alternating idle stretches (up to max_idle_s) and bursts of traffic.
                let period = max_idle_s + 300.0;
                let phase = (t + (r.job as f64) * 97.0) % period;
                if phase
                    < max_idle_s
                        * (0.5
                            + 0.5
                                * noise(self.seed, (t / period).floor(), 300 + r.job as u64).abs())
                {
                    0.0
                } else {
                    (0.55 + n).clamp(0.0, 1.0)
                }
            }
            Load::Checkpointing { every_s, pause_s } => {
                let phase = (t + r.job as f64 * 31.0) % every_s;
                let in_pause = phase < pause_s;
                match (in_pause, r.index) {
                    (true, 0) => (0.01 + 0.01 * n.abs()).clamp(0.0, 1.0),
                    // Its peers wait in a collective: NCCL spins at full utilization.
                    (true, _) => (0.99 + 0.01 * n).clamp(0.0, 1.0),
                    (false, _) => (0.9 + n).clamp(0.0, 1.0),
                }
            }
        }
    }

    /// A rank's steps: its usual time, longer under load (bigger batches) and with jitter;
    /// idle when it computes nothing (a server between requests, a checkpoint: the application
    /// says so); slow or stalled where a fault says.
    fn step_truth(&self, r: &Rank, t: f64, util: f64) -> Option<StepTruth> {
        let base = r.step_s?;
        let n = noise(self.seed, t, 5000 + r.pid as u64);
        let mut step_s = base * (0.9 + 0.2 * util) * (1.0 + 0.1 * n);
        if let Some(o) = self.rank_on(t, r, Fault::StepSlow) {
            step_s *= o.sev;
        }
        let stalled_for = self.rank_on(t, r, Fault::StepStall).map(|o| {
            if o.duty >= 1.0 {
                t - o.start
            } else {
                (t - o.start) % o.period_s
            }
        });
        let checkpoint = matches!(r.load, Load::Checkpointing { every_s, pause_s }
            if (t + r.job as f64 * 31.0) % every_s < pause_s);
        Some(StepTruth {
            step_s,
            stalled_for,
            idle: stalled_for.is_none() && (util < 0.05 || checkpoint),
        })
    }

    pub fn truth(&self, t: f64) -> Truth {
        let live: Vec<&Rank> = self
            .ranks
            .iter()
            .filter(|r| t >= r.from_s && t < r.until_s)
            .collect();
        let node_slow = self.node_on(t, Fault::NodeSlow).map(|o| o.sev);
        let mut clients = Vec::new();
        let mut gpus = Vec::new();
        for gpu in 0..GPUS {
            let ranks: Vec<&&Rank> = live.iter().filter(|r| r.gpu == gpu).collect();
            let hog = ranks
                .iter()
                .find(|r| self.rank_on(t, r, Fault::Hog).is_some())
                .map(|r| r.pid);
            let mut spin = false;
            let mut tensor_scale = 1.0;
            let utils: Vec<f64> =
                ranks
                    .iter()
                    .map(|r| {
                        let mut u = self.base_util(r, t);
                        if let Some(o) = self.rank_on(t, r, Fault::Straggler) {
                            u *= o.sev;
                        }
                        if self.rank_on(t, r, Fault::Hung).is_some() {
                            u = 0.0;
                        }
                        // A TP job with one slow rank: every rank busy (the peers spin in NCCL),
                        // the slow one with its tensor cores busy, the others' mostly idle.
                        if let Some(o) = self.overlays.iter().find(|o| {
                            o.fault == Fault::TpSlowRank && o.job == Some(r.job) && o.on(t)
                        }) {
                            u = 0.99;
                            if o.pid == Some(r.pid) {
                                tensor_scale = 1.0;
                            } else {
                                spin = true;
                                tensor_scale = o.sev;
                            }
                        }
                        match hog {
                            Some(h) if h == r.pid => 0.99,
                            Some(_) => 0.02,
                            None => u,
                        }
                    })
                    .collect();
            let busy = 1.0 - utils.iter().map(|u| 1.0 - u).product::<f64>();
            let lost = self.on(t, gpu, Fault::Lost).is_some();
            let g = gpu as u64 * 64;
            let util = if ranks.is_empty() || busy < 0.005 {
                0.0
            } else {
                (busy + 0.015 * noise(self.seed, t, g + 1)).clamp(0.0, 1.0)
            };
            let mut clock = SM_MAX_MHZ - 15.0 * noise(self.seed, t, g + 2).abs();
            let mut events = if util < 0.05 { 0x1 } else { 0 };
            if let Some(o) = self.on(t, gpu, Fault::PowerCap) {
                events |= 0x4;
                clock *= 1.0 - o.sev;
            } else if util > 0.6 && noise(self.seed, t, g + 3) > 0.7 {
                events |= 0x4; // brief power capping under load is normal
                clock -= 45.0;
            }
            if let Some(o) = self.on(t, gpu, Fault::Throttle) {
                events |= 0x8;
                clock *= 1.0 - o.sev;
            }
            if let Some(o) = self.on(t, gpu, Fault::ClockSkew) {
                clock *= o.sev;
            }
            if let Some(f) = node_slow {
                clock *= f;
            }
            let temp = match self.on(t, gpu, Fault::Thermal) {
                Some(o) => SLOWDOWN_C - o.sev + 0.7 * noise(self.seed, t, g + 4),
                None => 38.0 + 28.0 * util + 3.0 * drift(self.seed, t, g + 4, 120.0),
            };
            let mem_used: u64 = ranks.iter().map(|r| self.rank_mem(r, t)).sum::<u64>()
                + if ranks.is_empty() { 0 } else { 520 << 20 };
            // Counters since the last reset on this GPU.
            let reset = self
                .overlays
                .iter()
                .filter(|o| o.fault == Fault::CounterReset && o.gpu == gpu && t >= o.start)
                .map(|o| o.start)
                .fold(0.0, f64::max);
            let since = |f: Fault, scale: f64, bg_per_h: f64, stream: u64| -> u64 {
                let c = |at: f64| -> f64 {
                    let phase = Rng::new(self.seed ^ stream).unit();
                    (at * bg_per_h / 3600.0 + phase).floor() + self.count(at, gpu, f, scale).floor()
                };
                (c(t) - if reset > 0.0 { c(reset) } else { 0.0 }).max(0.0) as u64
            };
            let width = if self.on(t, gpu, Fault::LinkWidth).is_some() {
                8
            } else {
                16
            };
            let gen = if util < 0.05 {
                1
            } else if self.on(t, gpu, Fault::LinkGen).is_some() {
                3
            } else {
                5
            };
            // DCGM's bound for Gen5 x16 is 31 replays a minute; a healthy link sees a few an hour.
            let replays = since(Fault::Replays, 31.0, 20.0, g + 7);
            let tensor = if spin {
                0.25 * tensor_scale
            } else {
                0.65 * util
            };
            gpus.push(GpuTruth {
                gpu,
                lost,
                util,
                mem_used,
                clock_mhz: clock.max(0.0),
                events,
                temp_c: temp,
                power_w: 85.0
                    + 590.0 * util * clock / SM_MAX_MHZ
                    + 12.0 * noise(self.seed, t, g + 5),
                ecc_sbe: since(Fault::EccStorm, 1.0, 0.3, g + 6),
                ecc_dbe: self
                    .overlays
                    .iter()
                    .any(|o| o.fault == Fault::EccDbe && o.gpu == gpu && t >= o.start && t >= reset)
                    as u64,
                replays,
                pcie_gen: gen,
                pcie_width: width,
                nvlink_errors: since(Fault::Nvlink, 1.0, 0.0, g + 8),
                remap_pending: self.on(t, gpu, Fault::RemapPending).is_some(),
                sm_active: (util * 0.92).clamp(0.0, 1.0),
                sm_occupancy: (util * 0.45 + 0.02 * noise(self.seed, t, g + 9)).clamp(0.0, 1.0),
                tensor_active: (tensor + 0.02 * noise(self.seed, t, g + 10)).clamp(0.0, 1.0),
                dram_active: (util * 0.4).clamp(0.0, 1.0),
            });
            for (r, u) in ranks.iter().zip(utils) {
                clients.push(ClientTruth {
                    gpu,
                    pid: r.pid,
                    job: r.job,
                    uid: r.uid,
                    util: u,
                    mem: self.rank_mem(r, t),
                    thread_pct: r.thread_pct,
                    mem_limit: r.mem_limit,
                    step: self.step_truth(r, t, u),
                });
            }
        }
        let nics = self
            .nics
            .iter()
            .enumerate()
            .map(|(i, port)| {
                let i = i as u32;
                let bg = (t * self.nic_background_per_h / 3600.0
                    + Rng::new(self.seed ^ 0xa11c ^ i as u64).unit())
                .floor() as u64;
                NicTruth {
                    port: port.clone(),
                    errors: bg + self.count(t, i, Fault::NicErrors, 1.0) as u64,
                    discards: self.count(t, i, Fault::Congestion, 1.0) as u64,
                }
            })
            .collect();
        Truth {
            t,
            gpus,
            clients,
            nics,
        }
    }

    fn rank_mem(&self, r: &Rank, t: f64) -> u64 {
        let mut m = r.mem as f64 * (1.0 + 0.002 * noise(self.seed, t / 30.0, 500 + r.pid as u64));
        if let Some(o) = self.rank_on(t, r, Fault::MemSkew) {
            m *= o.sev;
        }
        if let Some(o) = self.rank_on(t, r, Fault::NearOom) {
            // Growing from its usual size toward `sev` of its limit over the overlay.
            let limit = r.mem_limit.unwrap_or(MEM_TOTAL) as f64;
            let f = ((t - o.start) / (o.end - o.start).max(1.0)).clamp(0.0, 1.0);
            m = m + (limit * o.sev - m).max(0.0) * f.sqrt();
        }
        m as u64
    }
}

/// Ranks of one job, one per GPU on `gpus`.
#[allow(clippy::too_many_arguments)]
pub fn job(
    job: u32,
    uid: u32,
    gpus: &[u32],
    load: Load,
    mem_gib: f64,
    thread_pct: Option<u8>,
    mem_limit_gib: Option<f64>,
    span: (f64, f64),
) -> Vec<Rank> {
    gpus.iter()
        .enumerate()
        .map(|(i, g)| Rank {
            gpu: *g,
            pid: job * 100 + i as u32,
            job,
            uid,
            index: i as u32,
            load,
            mem: (mem_gib * GIB as f64) as u64,
            thread_pct,
            mem_limit: mem_limit_gib.map(|m| (m * GIB as f64) as u64),
            from_s: span.0,
            until_s: span.1,
            step_s: None,
        })
        .collect()
}

/// Ranks that mark their steps, `step_s` each as usual.
pub fn stepping(mut ranks: Vec<Rank>, step_s: f64) -> Vec<Rank> {
    for r in &mut ranks {
        r.step_s = Some(step_s);
    }
    ranks
}
