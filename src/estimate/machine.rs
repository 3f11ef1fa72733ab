//! What the machine offers (RAM, `RLIMIT_MEMLOCK`, the swap path's free
//! space, the device's memory), as `tierzero estimate` probes it.

use std::path::Path;

use serde::Serialize;

/// `RLIMIT_MEMLOCK`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Memlock {
    /// No limit.
    Unlimited,
    /// This many bytes.
    Bytes(u64),
}

/// What the machine offers. `None` = unknown.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Machine {
    /// `MemTotal`.
    pub ram_bytes: Option<u64>,
    /// `MemAvailable` (informational).
    pub ram_available_bytes: Option<u64>,
    /// `RLIMIT_MEMLOCK` of this process.
    pub memlock: Option<Memlock>,
    /// Directory whose free space was measured.
    pub nvme_dir: Option<String>,
    /// Free bytes there.
    pub nvme_free_bytes: Option<u64>,
    /// Accelerator memory per rank; `None`: the CPU is the device.
    pub device_bytes: Option<u64>,
}

/// Parses `/proc/meminfo` text: `(MemTotal, MemAvailable)` in bytes.
pub fn parse_meminfo(text: &str) -> (Option<u64>, Option<u64>) {
    let field = |key: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(':')?;
            let mut it = rest.split_whitespace();
            let v: u64 = it.next()?.parse().ok()?;
            match it.next() {
                Some("kB") => v.checked_mul(1024),
                None => Some(v),
                Some(_) => None,
            }
        })
    };
    (field("MemTotal"), field("MemAvailable"))
}

/// Parses the soft `Max locked memory` limit from `/proc/self/limits` text.
pub fn parse_memlock(text: &str) -> Option<Memlock> {
    let line = text.lines().find(|l| l.starts_with("Max locked memory"))?;
    let soft = line
        .strip_prefix("Max locked memory")?
        .split_whitespace()
        .next()?;
    if soft == "unlimited" {
        Some(Memlock::Unlimited)
    } else {
        soft.parse().ok().map(Memlock::Bytes)
    }
}

/// Reads RAM and memlock from `/proc`, the free space of `nvme_dir`, and
/// takes `device_bytes` as given (no GPU driver is queried). Anything that
/// cannot be read is `None`.
pub fn probe_machine(nvme_dir: &Path, device_bytes: Option<u64>) -> Machine {
    let (ram_bytes, ram_available_bytes) = std::fs::read_to_string("/proc/meminfo")
        .map(|t| parse_meminfo(&t))
        .unwrap_or((None, None));
    let memlock = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| parse_memlock(&t));
    let nvme_free_bytes = tierzero_swap::space::filesystem_space(nvme_dir)
        .ok()
        .map(|s| s.available_bytes);
    Machine {
        ram_bytes,
        ram_available_bytes,
        memlock,
        nvme_dir: Some(nvme_dir.display().to_string()),
        nvme_free_bytes,
        device_bytes,
    }
}
