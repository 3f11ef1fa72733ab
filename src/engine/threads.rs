//! How many threads the CPU compute kernels get.
//!
//! # Why this exists
//!
//! A step on the CPU runs three kinds of work at once: the compute thread
//! (forward and backward through candle), the optimizer thread (CPU Adam,
//! `--threads` of them) and the swap engines' ring threads. candle's CPU
//! matmuls split across `RAYON_NUM_THREADS` threads, by default one per
//! core. With offloading on, those compute threads then share every core
//! with the Adam and ring threads, and each preemption stalls a matmul
//! whose other half waits at the join. On the 2-core development machine
//! the compute of a real offloaded step ran 10–20% slower than the same
//! compute alone, and the small matmuls of a transformer block gain little
//! from a second thread anyway (`examples/overlap.rs`: compute alone took
//! about the same time on one thread as on two).
//!
//! # The rule
//!
//! `tierzero.compute_threads`:
//!
//! * a number: that many threads, whatever the environment says;
//! * `"auto"` (the default): `RAYON_NUM_THREADS` if the environment sets
//!   it (the user's choice wins over our guess); otherwise, when parameters
//!   or optimizer state are offloaded (the Adam and ring threads run beside
//!   compute), `cores − adam_threads`, at least 1; otherwise every core.
//!
//! Only CPU compute is affected: on a CUDA device the setting is ignored.
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

use std::fmt;
use std::sync::OnceLock;

/// The environment variable candle (and rayon) read.
pub const ENV: &str = "RAYON_NUM_THREADS";

/// Where the thread count came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadsSource {
    /// `tierzero.compute_threads` in the config.
    Config,
    /// `RAYON_NUM_THREADS` in the environment (config said `"auto"`).
    Env,
    /// `"auto"` with offloading: cores minus the Adam threads.
    AutoOffload {
        /// Cores of the machine.
        cores: usize,
        /// Adam threads kept a core each.
        adam_threads: usize,
    },
    /// `"auto"` without offloading: every core.
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

/// Resolves the count. `configured` is `tierzero.compute_threads`
/// (`None` = auto); `env` the value of `RAYON_NUM_THREADS`, if any (an
/// unparsable or zero value counts as unset, as candle and rayon treat it);
/// `offloaded` whether params or optimizer state leave the compute device.
pub fn resolve(
    configured: Option<u32>,
    env: Option<&str>,
    cores: usize,
    offloaded: bool,
    adam_threads: usize,
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
        return ComputeThreads {
            threads: n,
            source: ThreadsSource::Env,
        };
    }
    if offloaded {
        ComputeThreads {
            threads: cores.saturating_sub(adam_threads).max(1),
            source: ThreadsSource::AutoOffload {
                cores,
                adam_threads,
            },
        }
    } else {
        ComputeThreads {
            threads: cores,
            source: ThreadsSource::AutoAll { cores },
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

/// Cores the process may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Makes candle's CPU kernels use `t.threads` threads (see the module
/// docs). Does nothing when the count came from the environment or compute
/// is not on the CPU.
pub fn apply(t: &ComputeThreads) {
    match t.source {
        ThreadsSource::Env | ThreadsSource::NotCpu => {}
        _ => {
            if std::env::var(ENV).ok().as_deref() != Some(t.threads.to_string().as_str()) {
                std::env::set_var(ENV, t.threads.to_string());
            }
        }
    }
}

impl fmt::Display for ComputeThreads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.threads;
        let s = if n == 1 { "" } else { "s" };
        match self.source {
            ThreadsSource::Config => write!(f, "{n} compute thread{s} (tierzero.compute_threads)"),
            ThreadsSource::Env => write!(f, "{n} compute thread{s} (RAYON_NUM_THREADS)"),
            ThreadsSource::AutoOffload {
                cores,
                adam_threads,
            } => write!(
                f,
                "{n} compute thread{s} ({cores} cores, {} kept for the {adam_threads} Adam \
                 thread(s) and the I/O threads; tierzero.compute_threads: \"auto\")",
                cores - n.min(cores)
            ),
            ThreadsSource::AutoAll { cores } => {
                write!(
                    f,
                    "{n} compute thread{s} (all {cores} cores; nothing offloaded)"
                )
            }
            ThreadsSource::NotCpu => write!(f, "compute not on the CPU"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_wins_over_env_and_auto() {
        let t = resolve(Some(3), Some("7"), 2, true, 1, true);
        assert_eq!(t.threads, 3);
        assert_eq!(t.source, ThreadsSource::Config);
    }

    #[test]
    fn env_replaces_auto() {
        let t = resolve(None, Some(" 5 "), 2, true, 1, true);
        assert_eq!(t.threads, 5);
        assert_eq!(t.source, ThreadsSource::Env);
        // Zero or garbage is "unset", as candle and rayon read it.
        for bad in ["0", "x", ""] {
            let t = resolve(None, Some(bad), 4, true, 1, true);
            assert_eq!(t.threads, 3, "{bad:?}");
        }
    }

    #[test]
    fn auto_keeps_cores_for_adam_when_offloading() {
        assert_eq!(resolve(None, None, 2, true, 1, true).threads, 1);
        assert_eq!(resolve(None, None, 16, true, 2, true).threads, 14);
        // Never below one.
        assert_eq!(resolve(None, None, 1, true, 1, true).threads, 1);
        assert_eq!(resolve(None, None, 2, true, 4, true).threads, 1);
        // Nothing offloaded: every core.
        let t = resolve(None, None, 8, false, 1, true);
        assert_eq!(
            (t.threads, t.source),
            (8, ThreadsSource::AutoAll { cores: 8 })
        );
    }

    #[test]
    fn not_cpu_sets_nothing() {
        let t = resolve(Some(4), None, 8, true, 1, false);
        assert_eq!(t.source, ThreadsSource::NotCpu);
        assert_eq!(t.threads, 0);
    }

    #[test]
    fn display_names_the_source() {
        let t = resolve(None, None, 2, true, 1, true);
        let s = t.to_string();
        assert!(s.starts_with("1 compute thread ("), "{s}");
        assert!(s.contains("2 cores, 1 kept"), "{s}");
        assert!(resolve(Some(2), None, 2, true, 1, true)
            .to_string()
            .contains("tierzero.compute_threads"));
    }
}
