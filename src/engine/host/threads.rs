//! How many threads the CPU compute kernels get.
//!
//! # Why this exists
//!
//! A step on the CPU runs three kinds of work at once: the compute threads
//! (forward and backward through candle, on the trainer's
//! [`ComputePool`]), the optimizer thread (CPU Adam, `--threads` of them)
//! and the swap engines' ring threads. candle's CPU matmuls split across
//! `RAYON_NUM_THREADS` threads.
//!
//! # The rule
//!
//! `tierzero.compute_threads`:
//!
//! * a number: that many threads, whatever the environment says;
//! * `"auto"` (the default): `RAYON_NUM_THREADS` if the environment sets
//!   it (the user's choice wins over our guess); otherwise every core,
//!   offloaded or not.
//!
//! Until session 7 "auto" kept a core per Adam thread when anything was
//! offloaded: with the compute's splits injected into rayon's global pool
//! (see [`ComputePool`]), an Adam or ring thread that preempted a compute
//! thread stalled every join, and an offloaded step's compute ran 10-20%
//! slower on 2 cores. On the pool, a preempted worker's splits are stolen
//! by the others, and the second core paid off: the GPT-2 of
//! `scripts/compare_torch.py`'s `tz_nvme` arm (params and optimizer state
//! on NVMe, 8 × 128 tokens, clipping 1.0), 25 steps alternating, ran at
//! 4,547-4,591 tokens/s with one compute thread (pinned) and 6,354-6,412
//! with two; `scripts/overlap_ab.sh 2` (`examples/overlap`, I/O-bound:
//! I/O alone 0.074-0.077 s, compute alone 0.044) gave steps of 0.0855 s
//! with one and 0.0832 s with two. Pinning (below) then needs
//! `compute_threads` below the CPU count.
//!
//! Only CPU compute is affected: on a device (the CUDA units, the device
//! tier, the simulated device: [`crate::model::exec_units::UnitCompute::on_device`])
//! the setting is ignored, no compute pool is made and nothing is pinned.
//! The host's own parallel work there (the gradients' adds into the
//! optimizer's sums, the seeded init) runs on an unpinned pool of a
//! thread a core instead ([`ComputePool::for_host_work`]), never on
//! rayon's global pool.
//!
//! # CPU Adam's threads (`--threads`)
//!
//! [`adam_threads`]: a number is that many; `auto` (the default) is one
//! when the compute is on the CPU (the compute threads have the cores;
//! the optimizer overlaps them) and half the cores when it is on a
//! device. There the host's cores are left to the helpers, and CPU Adam
//! over the whole model's fp32 state is the longest of them. The other
//! half is for the copies to and from the device's staging buffers
//! (`tierzero_gpu::host_copy`), the param copy and I/O threads and the
//! thread that drives the device. DeepSpeed's CPU Adam takes every core
//! (OpenMP); half keeps the copies that feed the device from waiting on
//! it.
//!
//! # How it is applied
//!
//! candle reads the thread count of its CPU kernels from the
//! `RAYON_NUM_THREADS` environment variable at every matmul; it has no
//! other knob. [`apply`] therefore sets that variable for the process,
//! unless it came from the environment already. Rust's own environment
//! accesses are serialised by the standard library, and candle reads the
//! variable through `std::env::var`; C code that calls `getenv` on another
//! thread at the same moment is the one case the standard library cannot
//! order, which is why the trainer sets it once, while it is being built,
//! before its own threads start. The user's own value is remembered from
//! the first look ([`user_env`]), so a trainer built after another one does
//! not mistake the first one's setting for the user's. Embedders that run
//! several trainers in one process at once get the setting of the last one
//! built.

//!
//! # Where the threads run (`tierzero.pin_threads`)
//!
//! Counting threads is not enough: with one compute thread and three
//! helpers (ring, param copy, optimizer) on 2 cores, the scheduler still
//! moved the compute thread between the cores and let helpers preempt it,
//! and an offloaded step's compute ran about 8% longer than the same
//! compute alone. Keeping the compute on its cores and the helpers on the
//! rest removed that: `examples/overlap` at MICRO=3, ABBA, steps 0.93× as
//! long (13 of 16 rounds shorter), ratio to max(compute, I/O) 1.21 → 1.05.
//!
//! [`place`] splits the CPUs the building thread may use (its affinity
//! mask, so `taskset` and cgroup cpusets are respected): the first
//! `compute_threads` CPUs for compute, the rest for the helpers. The
//! helpers pin themselves when they start (the swap engines' threads
//! through `EngineConfig::thread_cpus`, the param copy and optimizer
//! threads in this crate; the optimizer's scoped Adam threads inherit its
//! mask). The compute threads are the [`ComputePool`]'s (below): they
//! pin themselves to the compute CPUs when they start, so an embedding
//! program's own thread is left as it was.
//!
//! `"auto"` (the default) pins when compute is on the CPU, something is
//! offloaded (there are helpers to keep apart), this is the only rank
//! (ranks of one machine started without binding would all pick the same
//! CPUs) and at least one CPU is left for the helpers. `true` pins
//! whenever a CPU is left; `false` never.

//!
//! # Where a step's compute runs ([`ComputePool`])
//!
//! candle's matmuls (through gemm) and this crate's fused ops split their
//! work on rayon's *current* pool. Called from a thread outside any pool,
//! each split injects its jobs into rayon's global pool and puts the
//! caller to sleep until a worker has run them: two wake-ups a split.
//! gemm splits every cache block of every matmul, so a stage-0 step of the
//! embedded GPT-2 did about 10,000 of them. On this project's development
//! VM (KVM, 2 cores), whose wake-ups became slow between sessions, that
//! halved the speed: `perf stat` of `tierzero train` (stage 0, 8 × 128
//! tokens, 25 steps) counted 240,000-260,000 context switches and
//! 4,762-4,996 tokens/s, with 1.26 CPUs busy.
//!
//! So each `Trainer::step` runs on a pool of its own, of the compute
//! thread count, through `install`: the step runs on a pool thread, a
//! split pushes its jobs onto that thread's own deque, and the thread runs
//! them itself when the other workers are slow to wake; nobody sleeps on
//! the caller's side. The same runs: 10,000 context switches and
//! 5,976-6,187 tokens/s, alternating; the losses are the same, step by
//! step. The caller's thread waits for the step (one wake-up a step).
//!
//! Keeping the other workers awake for the length of a step (a broadcast
//! job polling `rayon::yield_now`, as OpenMP's spin-wait does) was tried
//! and dropped: it took 1.94 CPUs and ran slower, 5,285-5,923 tokens/s
//! against 5,703-6,262 alternating, since what keeps the second core idle
//! is the step's serial work (candle's gradient accumulation), not late
//! wake-ups.
//!
//! The pool is the trainer's, not rayon's global one, so an embedding
//! program's own use of the global pool keeps its size and its threads'
//! masks.

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::{Arc, OnceLock};

/// The environment variable candle (and rayon) read.
pub const ENV: &str = "RAYON_NUM_THREADS";

/// Where the thread count came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadsSource {
    /// `tierzero.compute_threads` in the config.
    Config,
    /// `RAYON_NUM_THREADS` in the environment (config said `"auto"`).
    Env,
    /// `"auto"`: every core.
    AutoAll {
        /// Cores of the machine.
        cores: usize,
    },
    /// Compute is not on the CPU; nothing set.
    NotCpu,
}

/// The resolved count and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeThreads {
    /// Threads of the CPU compute kernels (0 when compute is not on the
    /// CPU).
    pub threads: usize,
    /// Where it came from.
    pub source: ThreadsSource,
}

/// The most compute threads a run starts (`tierzero.compute_threads`' bound,
/// and `RAYON_NUM_THREADS`' cap).
pub const MAX_COMPUTE_THREADS: usize = 1024;

/// Resolves the count. `configured` is `tierzero.compute_threads`
/// (`None` = auto); `env` the value of `RAYON_NUM_THREADS`, if any (an
/// unparsable or zero value counts as unset, as candle and rayon treat it);
/// `cpu` whether compute is on the CPU.
pub fn resolve(
    configured: Option<u32>,
    env: Option<&str>,
    cores: usize,
    cpu: bool,
) -> ComputeThreads {
    if !cpu {
        return ComputeThreads {
            threads: 0,
            source: ThreadsSource::NotCpu,
        };
    }
    let cores = cores.max(1);
    if let Some(n) = configured {
        return ComputeThreads {
            threads: (n as usize).max(1),
            source: ThreadsSource::Config,
        };
    }
    if let Some(n) = env
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        // `tierzero.compute_threads`' bound: 100000 threads, whose
        // spinning starved their own pool's start, never finished the
        // build (nor stopped at a signal).
        if n > MAX_COMPUTE_THREADS {
            tracing::warn!(
                RAYON_NUM_THREADS = n,
                threads = MAX_COMPUTE_THREADS,
                cores,
                "RAYON_NUM_THREADS is above the most compute threads tierzero starts; using \
                 that many (unset it to use every core)"
            );
        }
        return ComputeThreads {
            threads: n.min(MAX_COMPUTE_THREADS),
            source: ThreadsSource::Env,
        };
    }
    ComputeThreads {
        threads: cores,
        source: ThreadsSource::AutoAll { cores },
    }
}

/// CPU Adam's thread count and why ([`adam_threads`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdamThreads {
    /// Threads of the CPU Adam kernel.
    pub threads: NonZeroUsize,
    /// Where it came from.
    pub source: AdamSource,
}

/// Where CPU Adam's thread count came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdamSource {
    /// Given (`--threads N`, [`crate::engine::TrainerOptions::adam_threads`]).
    Given,
    /// `auto` with compute on the CPU: one, beside the compute threads.
    AutoBesideCompute,
    /// `auto` with compute on a device: half of `cores`.
    AutoHalf {
        /// Cores of the machine.
        cores: usize,
    },
}

/// CPU Adam's threads (see the module docs): `given` wins; `auto`
/// (`None`) is one beside CPU compute, half the cores (at least one)
/// beside a device's.
pub fn adam_threads(
    given: Option<NonZeroUsize>,
    compute: &ComputeThreads,
    cores: usize,
) -> AdamThreads {
    match given {
        Some(threads) => AdamThreads {
            threads,
            source: AdamSource::Given,
        },
        None if compute.source != ThreadsSource::NotCpu => AdamThreads {
            threads: NonZeroUsize::MIN,
            source: AdamSource::AutoBesideCompute,
        },
        None => AdamThreads {
            threads: NonZeroUsize::new(cores / 2).unwrap_or(NonZeroUsize::MIN),
            source: AdamSource::AutoHalf { cores },
        },
    }
}

impl fmt::Display for AdamThreads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.threads.get();
        let s = if n == 1 { "" } else { "s" };
        match self.source {
            AdamSource::Given => write!(f, "{n} Adam thread{s} (--threads)"),
            AdamSource::AutoBesideCompute => write!(
                f,
                "{n} Adam thread{s} (--threads auto: the compute threads have the cores)"
            ),
            AdamSource::AutoHalf { cores } => write!(
                f,
                "{n} Adam thread{s} (--threads auto: half of {cores} cores, compute on the device)"
            ),
        }
    }
}

/// `RAYON_NUM_THREADS` as the process found it, before [`apply`] ever set
/// it: read once, on first use, so that a trainer built after another one
/// does not take the first one's setting for the user's.
pub fn user_env() -> Option<String> {
    static FOUND: OnceLock<Option<String>> = OnceLock::new();
    FOUND.get_or_init(|| std::env::var(ENV).ok()).clone()
}

/// `CANDLE_NUM_THREADS` as the process found it (see [`user_env`]).
pub fn user_candle_env() -> Option<String> {
    static FOUND: OnceLock<Option<String>> = OnceLock::new();
    FOUND.get_or_init(|| std::env::var(CANDLE_ENV).ok()).clone()
}

/// Cores the process may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// candle's own pool for elementwise ops (its "barrier pool"): its size
/// is read once, when the pool is first used.
pub const CANDLE_ENV: &str = "CANDLE_NUM_THREADS";

/// Makes candle's CPU kernels use `t.threads` threads (see the module
/// docs). Does nothing when the count came from the environment or compute
/// is not on the CPU.
///
/// It also sets `CANDLE_NUM_THREADS=1` (unless the environment sets it):
/// candle's elementwise ops then run on the calling thread instead of its
/// barrier pool, whose workers spin for tens of microseconds after every
/// op. The heavy elementwise work runs in this crate's fused ops
/// (`crate::model::fused`) and the matmuls on rayon's pool
/// (`RAYON_NUM_THREADS`), so on 2 cores the spinning worker only took a
/// core from them: 25% of the samples of a stage-0 step. Alternating
/// `scripts/compare_torch.py --arms tz --rounds 1` with and without
/// `CANDLE_NUM_THREADS=2` (the pool on): 9,316-9,624 tokens/s without the
/// pool, 8,594-8,746 with it.
pub fn apply(t: &ComputeThreads) {
    // Set only where it differs: a second trainer in the process (threads
    // of the first, MPI's, CUDA's may run and read the environment) finds
    // it set already.
    if t.source != ThreadsSource::NotCpu
        && user_candle_env().is_none()
        && std::env::var(CANDLE_ENV).ok().as_deref() != Some("1")
    {
        std::env::set_var(CANDLE_ENV, "1");
    }
    // The user's own value stays, unless it was capped ([`resolve`]).
    if t.source != ThreadsSource::NotCpu
        && std::env::var(ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            != Some(t.threads)
    {
        std::env::set_var(ENV, t.threads.to_string());
    }
}

/// Which CPUs the step's threads run on (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Compute on `compute_cpus`, every helper thread on `helper_cpus`.
    Pinned {
        /// CPUs of the compute thread and candle's pool.
        compute_cpus: Arc<[usize]>,
        /// CPUs of the ring, param copy and optimizer threads.
        helper_cpus: Arc<[usize]>,
    },
    /// Left to the scheduler, and why.
    Unpinned(&'static str),
}

impl Placement {
    /// The helpers' CPUs, when pinned.
    pub fn helper_cpus(&self) -> Option<Arc<[usize]>> {
        match self {
            Placement::Pinned { helper_cpus, .. } => Some(helper_cpus.clone()),
            Placement::Unpinned(_) => None,
        }
    }

    /// The compute thread's CPUs, when pinned.
    pub fn compute_cpus(&self) -> Option<&[usize]> {
        match self {
            Placement::Pinned { compute_cpus, .. } => Some(compute_cpus),
            Placement::Unpinned(_) => None,
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use tierzero_swap::affinity::format_cpu_list;
        match self {
            Placement::Pinned {
                compute_cpus,
                helper_cpus,
            } => write!(
                f,
                "threads pinned: compute on CPU {}, I/O, copy and optimizer threads on CPU {} \
                 (tierzero.pin_threads)",
                format_cpu_list(compute_cpus),
                format_cpu_list(helper_cpus)
            ),
            Placement::Unpinned(why) => write!(f, "threads not pinned: {why}"),
        }
    }
}

/// Splits `allowed` (the CPUs the building thread may use, ascending)
/// between compute and helpers. `setting` is `tierzero.pin_threads`
/// (`None` = auto), `world` the number of ranks, `offloaded` whether
/// params or optimizer state leave the compute device.
pub fn place(
    setting: Option<bool>,
    allowed: &[usize],
    compute: &ComputeThreads,
    world: usize,
    offloaded: bool,
) -> Placement {
    if compute.source == ThreadsSource::NotCpu {
        return Placement::Unpinned("compute is not on the CPU");
    }
    match setting {
        Some(false) => return Placement::Unpinned("tierzero.pin_threads is false"),
        Some(true) => {}
        None if !offloaded => {
            return Placement::Unpinned("nothing offloaded, so no helper threads to keep apart")
        }
        None if world > 1 => {
            return Placement::Unpinned(
                "several ranks (each would pick the same CPUs; set tierzero.pin_threads: true \
                 only when each rank has CPUs of its own)",
            )
        }
        None => {}
    }
    let n = compute.threads.max(1);
    if allowed.len() <= n {
        return Placement::Unpinned(
            "no CPU left for the helper threads (compute threads >= CPUs this process may use)",
        );
    }
    Placement::Pinned {
        compute_cpus: allowed[..n].into(),
        helper_cpus: allowed[n..].into(),
    }
}

/// The threads a step's CPU compute runs on (see the module docs): a
/// rayon pool of the compute thread count, whose threads pin themselves to
/// the compute CPUs when the placement has them. A thread that cannot be
/// pinned runs unpinned (logged).
pub struct ComputePool {
    pool: rayon::ThreadPool,
}

impl fmt::Debug for ComputePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ComputePool")
            .field("threads", &self.threads())
            .finish()
    }
}

impl ComputePool {
    /// The pool for `t` threads on `placement`'s compute CPUs; `None` when
    /// compute is not on the CPU.
    pub fn new(
        t: &ComputeThreads,
        placement: &Placement,
    ) -> Result<Option<ComputePool>, rayon::ThreadPoolBuildError> {
        if t.source == ThreadsSource::NotCpu {
            return Ok(None);
        }
        let threads = t.threads.max(1);
        let cpus: Option<Arc<[usize]>> = placement.compute_cpus().map(Arc::from);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("tierzero-cpu-{i}"))
            .start_handler(move |_| {
                if let Some(cpus) = &cpus {
                    if let Err(e) = tierzero_swap::affinity::pin_current_thread(cpus) {
                        tracing::warn!(error = %e, "could not pin a compute thread");
                    }
                }
            })
            .build()?;
        Ok(Some(ComputePool { pool }))
    }

    /// The pool for the host's own parallel work when compute is not on
    /// the CPU (a device computes): adding the gradients that came down
    /// into the optimizer's sums, the seeded init. One unpinned thread a
    /// core this process may use: that work runs while CPU Adam waits for
    /// the step's norm, or beside the forward's few staging copies. It
    /// keeps rayon's global pool unmade, as on the CPU (an embedding
    /// program's own `build_global` still works).
    pub fn for_host_work() -> Result<ComputePool, rayon::ThreadPoolBuildError> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("tierzero-host-{i}"))
            .build()?;
        Ok(ComputePool { pool })
    }

    /// Runs `f` on one of the pool's threads, the caller waiting; rayon
    /// splits inside `f` (gemm's, the fused ops') stay on the pool.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Threads in the pool.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
}

impl fmt::Display for ComputeThreads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.threads;
        let s = if n == 1 { "" } else { "s" };
        match self.source {
            ThreadsSource::Config => write!(f, "{n} compute thread{s} (tierzero.compute_threads)"),
            ThreadsSource::Env => write!(f, "{n} compute thread{s} (RAYON_NUM_THREADS)"),
            ThreadsSource::AutoAll { cores } => write!(
                f,
                "{n} compute thread{s} (all {cores} cores; tierzero.compute_threads: \"auto\")"
            ),
            ThreadsSource::NotCpu => write!(f, "compute not on the CPU"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn config_wins_over_env_and_auto() {
        let t = resolve(Some(3), Some("7"), 2, true);
        assert_eq!(t.threads, 3);
        assert_eq!(t.source, ThreadsSource::Config);
    }

    #[test]
    fn env_replaces_auto() {
        let t = resolve(None, Some(" 5 "), 2, true);
        assert_eq!(t.threads, 5);
        assert_eq!(t.source, ThreadsSource::Env);
        // Above tierzero.compute_threads' bound: capped at it.
        let t = resolve(None, Some("100000"), 2, true);
        assert_eq!(t.threads, MAX_COMPUTE_THREADS);
        // Zero or garbage is "unset", as candle and rayon read it.
        for bad in ["0", "x", ""] {
            let t = resolve(None, Some(bad), 4, true);
            assert_eq!(t.threads, 4, "{bad:?}");
        }
    }

    #[test]
    fn auto_is_every_core() {
        for cores in [1, 2, 16] {
            let t = resolve(None, None, cores, true);
            assert_eq!(
                (t.threads, t.source),
                (cores, ThreadsSource::AutoAll { cores })
            );
        }
        // Never below one.
        assert_eq!(resolve(None, None, 0, true).threads, 1);
    }

    #[test]
    fn not_cpu_sets_nothing() {
        let t = resolve(Some(4), None, 8, false);
        assert_eq!(t.source, ThreadsSource::NotCpu);
        assert_eq!(t.threads, 0);
    }

    #[test]
    fn adam_gets_one_thread_beside_cpu_compute_and_half_the_cores_beside_a_device() {
        let n = |v: usize| NonZeroUsize::new(v).unwrap();
        let cpu = resolve(None, None, 16, true);
        let gpu = resolve(None, None, 16, false);
        // Given wins on either.
        for c in [&cpu, &gpu] {
            let t = adam_threads(Some(n(3)), c, 16);
            assert_eq!((t.threads, t.source), (n(3), AdamSource::Given));
        }
        let t = adam_threads(None, &cpu, 16);
        assert_eq!((t.threads, t.source), (n(1), AdamSource::AutoBesideCompute));
        for (cores, want) in [(16, 8), (3, 1), (2, 1), (1, 1), (0, 1)] {
            let t = adam_threads(None, &gpu, cores);
            assert_eq!(
                (t.threads, t.source),
                (n(want), AdamSource::AutoHalf { cores }),
                "{cores} cores"
            );
        }
        let s = adam_threads(None, &gpu, 16).to_string();
        assert!(
            s.starts_with("8 Adam threads") && s.contains("half of 16"),
            "{s}"
        );
        assert!(adam_threads(None, &cpu, 2)
            .to_string()
            .starts_with("1 Adam thread "));
    }

    #[test]
    fn placement_splits_the_allowed_cpus_compute_first() {
        let auto1 = resolve(Some(1), None, 2, true);
        let p = place(None, &[0, 1], &auto1, 1, true);
        assert_eq!(p.compute_cpus(), Some(&[0][..]));
        assert_eq!(p.helper_cpus().as_deref(), Some(&[1][..]));
        // A restricted mask (taskset 2,3,5): its own CPUs, in order.
        let two = resolve(Some(2), None, 3, true);
        let p = place(Some(true), &[2, 3, 5], &two, 1, true);
        assert_eq!(p.compute_cpus(), Some(&[2, 3][..]));
        assert_eq!(p.helper_cpus().as_deref(), Some(&[5][..]));
        let s = p.to_string();
        assert!(
            s.contains("compute on CPU 2-3") && s.contains("on CPU 5"),
            "{s}"
        );
    }

    #[test]
    fn placement_stays_off_where_it_would_hurt_or_was_refused() {
        let auto1 = resolve(Some(1), None, 2, true);
        let unpinned = |p: Placement| matches!(p, Placement::Unpinned(_));
        assert!(unpinned(place(Some(false), &[0, 1], &auto1, 1, true)));
        // Auto: not with several ranks, not without offloading.
        assert!(unpinned(place(None, &[0, 1], &auto1, 2, true)));
        assert!(unpinned(place(None, &[0, 1], &auto1, 1, false)));
        // Forced: with several ranks too.
        assert!(!unpinned(place(Some(true), &[0, 1], &auto1, 2, true)));
        // No CPU left for helpers, even when forced.
        let all = resolve(Some(2), None, 2, true);
        assert!(unpinned(place(Some(true), &[0, 1], &all, 1, true)));
        assert!(unpinned(place(None, &[0], &auto1, 1, true)));
        // Auto's every core leaves none for the helpers.
        let auto = resolve(None, None, 2, true);
        assert!(unpinned(place(None, &[0, 1], &auto, 1, true)));
        let gpu = resolve(None, None, 2, false);
        assert!(unpinned(place(Some(true), &[0, 1], &gpu, 1, true)));
    }

    #[test]
    fn the_compute_pool_runs_the_step_and_its_splits_on_pinned_threads() {
        use rayon::prelude::*;
        let allowed = tierzero_swap::affinity::current_thread_cpus().unwrap();
        let first = allowed[0];
        let placement = Placement::Pinned {
            compute_cpus: vec![first].into(),
            helper_cpus: vec![first].into(),
        };
        let t = ComputeThreads {
            threads: 2,
            source: ThreadsSource::Config,
        };
        let pool = ComputePool::new(&t, &placement).unwrap().unwrap();
        assert_eq!(pool.threads(), 2);
        let before = tierzero_swap::affinity::current_thread_cpus().unwrap();
        let (outer, splits) = pool.run(|| {
            let me = std::thread::current().name().map(str::to_owned);
            let splits: Vec<(Option<String>, Vec<usize>)> = (0..8)
                .into_par_iter()
                .map(|_| {
                    (
                        std::thread::current().name().map(str::to_owned),
                        tierzero_swap::affinity::current_thread_cpus().unwrap(),
                    )
                })
                .collect();
            (me, splits)
        });
        assert!(outer.unwrap().starts_with("tierzero-cpu-"));
        for (name, cpus) in splits {
            assert!(name.unwrap().starts_with("tierzero-cpu-"));
            assert_eq!(cpus, vec![first]);
        }
        // The caller's own mask is untouched.
        assert_eq!(
            tierzero_swap::affinity::current_thread_cpus().unwrap(),
            before
        );
        // Not on the CPU: no pool.
        let gpu = resolve(None, None, 2, false);
        assert!(ComputePool::new(&gpu, &placement).unwrap().is_none());
    }

    #[test]
    fn display_names_the_source() {
        let t = resolve(None, None, 2, true);
        let s = t.to_string();
        assert!(s.starts_with("2 compute threads ("), "{s}");
        assert!(s.contains("all 2 cores") && s.contains("\"auto\""), "{s}");
        let one = resolve(None, Some("1"), 2, true).to_string();
        assert!(one.starts_with("1 compute thread ("), "{one}");
        assert!(resolve(Some(2), None, 2, true)
            .to_string()
            .contains("tierzero.compute_threads"));
    }
}
