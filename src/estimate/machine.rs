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
    (
        meminfo_field(text, "MemTotal"),
        meminfo_field(text, "MemAvailable"),
    )
}

/// One `/proc/meminfo` field in bytes.
fn meminfo_field(text: &str, key: &str) -> Option<u64> {
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
}

/// `SwapFree` from `/proc/meminfo`, if readable: where pageable memory
/// beyond `MemAvailable` can still go (slowly).
pub fn probe_swap_free() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| meminfo_field(&t, "SwapFree"))
}

/// A memory cgroup's limit on this process, the tightest of its own and
/// its ancestors' (a container's, a SLURM job's, a systemd scope's):
/// `/proc/meminfo` shows the whole host's memory, which a process limited
/// to less is killed for using.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupMemory {
    /// The limit, in bytes.
    pub limit_bytes: u64,
    /// What is left under it: the limit less the usage, the usage not
    /// counting inactive file pages (page cache the kernel reclaims before
    /// it kills), at the cgroup where that is least.
    pub room_bytes: u64,
}

/// The memory cgroup limit on this process, if one is set (v2's
/// `memory.max`, v1's `memory.limit_in_bytes`, under `/sys/fs/cgroup`).
pub fn cgroup_memory() -> Option<CgroupMemory> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_memory_under(Path::new("/sys/fs/cgroup"), &own)
}

/// [`cgroup_memory`] for a cgroup file system mounted at `root`, with
/// `proc_self_cgroup` the text of `/proc/self/cgroup`: the process's
/// cgroup and every ancestor up to `root` (in a cgroup namespace, the
/// container's own is `root`), v2 where its line (`0::PATH`) is, else
/// v1's memory controller (`N:memory:PATH`, or a line naming it among
/// others). A limit of `max` (v2) or of 2^63 rounded down to a page (v1,
/// any page size) is none.
pub fn cgroup_memory_under(root: &Path, proc_self_cgroup: &str) -> Option<CgroupMemory> {
    let read = |dir: &Path, name: &str| -> Option<u64> {
        let t = std::fs::read_to_string(dir.join(name)).ok()?;
        t.trim().parse().ok()
    };
    let inactive_file = |dir: &Path, key: &str| -> u64 {
        std::fs::read_to_string(dir.join("memory.stat"))
            .ok()
            .and_then(|t| {
                t.lines().find_map(|l| {
                    let rest = l.strip_prefix(key)?.strip_prefix(' ')?;
                    rest.trim().parse().ok()
                })
            })
            .unwrap_or(0)
    };
    let v2 = proc_self_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .filter(|_| root.join("cgroup.controllers").exists());
    let (base, rel, files) = match v2 {
        Some(rel) => (
            root.to_path_buf(),
            rel,
            ("memory.max", "memory.current", "inactive_file"),
        ),
        None => {
            let rel = proc_self_cgroup.lines().find_map(|l| {
                let mut it = l.splitn(3, ':');
                let (_, controllers, path) = (it.next()?, it.next()?, it.next()?);
                controllers
                    .split(',')
                    .any(|c| c == "memory")
                    .then_some(path)
            })?;
            (
                root.join("memory"),
                rel,
                (
                    "memory.limit_in_bytes",
                    "memory.usage_in_bytes",
                    "total_inactive_file",
                ),
            )
        }
    };
    // v1's "no limit" is i64::MAX rounded down to a page (4 KiB or
    // 64 KiB): anything from 2^62 up is none.
    const UNLIMITED: u64 = 1 << 62;
    let mut best: Option<CgroupMemory> = None;
    let mut dir = base.join(rel.trim_start_matches('/'));
    loop {
        if let Some(limit) = read(&dir, files.0).filter(|&l| l < UNLIMITED) {
            let used = read(&dir, files.1)
                .unwrap_or(0)
                .saturating_sub(inactive_file(&dir, files.2));
            let here = CgroupMemory {
                limit_bytes: limit,
                room_bytes: limit.saturating_sub(used),
            };
            best = Some(match best {
                Some(b) => CgroupMemory {
                    limit_bytes: b.limit_bytes.min(here.limit_bytes),
                    room_bytes: b.room_bytes.min(here.room_bytes),
                },
                None => here,
            });
        }
        if dir == base || !dir.pop() || !dir.starts_with(&base) {
            break;
        }
    }
    best
}

/// RAM this process has, `(total, available)` in bytes: `MemTotal` and
/// `MemAvailable` from `/proc/meminfo`, each within this process's memory
/// cgroup limit where one is set ([`cgroup_memory`]: under it, the limit
/// is the RAM the process has). `None` where nothing could be read.
pub fn probe_ram() -> (Option<u64>, Option<u64>) {
    let (total, available) = std::fs::read_to_string("/proc/meminfo")
        .map(|t| parse_meminfo(&t))
        .unwrap_or((None, None));
    match cgroup_memory() {
        Some(c) => (
            Some(total.map_or(c.limit_bytes, |r| r.min(c.limit_bytes))),
            Some(available.map_or(c.room_bytes, |r| r.min(c.room_bytes))),
        ),
        None => (total, available),
    }
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

/// Reads RAM and memlock from `/proc` (RAM within the memory cgroup's
/// limit, [`probe_ram`]; memlock unlimited with `CAP_IPC_LOCK`), the free
/// space of `nvme_dir`, and
/// takes `device_bytes` as given (no GPU driver is queried). Anything that
/// cannot be read is `None`.
pub fn probe_machine(nvme_dir: &Path, device_bytes: Option<u64>) -> Machine {
    let (ram_bytes, ram_available_bytes) = probe_ram();
    // CAP_IPC_LOCK lifts the limit, as the arena honours it (root here
    // was told to raise a limit that did not bind it).
    let memlock = if tierzero_swap::MemlockInfo::current().has_ipc_lock {
        Some(Memlock::Unlimited)
    } else {
        std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|t| parse_memlock(&t))
    };
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    fn put(root: &Path, rel: &str, name: &str, text: &str) {
        let d = root.join(rel);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(name), text).unwrap();
    }

    /// v2: the tightest room of the cgroup and its ancestors, inactive
    /// file pages not counted as used; "max" is no limit.
    #[test]
    fn cgroup_v2_takes_the_tightest_ancestor() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        put(r, "", "cgroup.controllers", "cpu memory");
        put(r, "", "memory.max", "max");
        put(r, "job", "memory.max", "2000000");
        put(r, "job", "memory.current", "1900000");
        put(r, "job", "memory.stat", "anon 1\ninactive_file 300000\n");
        put(r, "job/step", "memory.max", "1000000");
        put(r, "job/step", "memory.current", "100000");
        put(r, "job/step/task", "memory.max", "max");
        let c = cgroup_memory_under(r, "0::/job/step/task\n").unwrap();
        // job: 2000000 - (1900000 - 300000) = 400000; step: 900000.
        assert_eq!(
            c,
            CgroupMemory {
                limit_bytes: 1_000_000,
                room_bytes: 400_000
            }
        );
        // No limit on the way up: none.
        assert_eq!(cgroup_memory_under(r, "0::/\n"), None);
    }

    /// v1: the memory controller's line (alone or among others), and its
    /// "no limit" value, i64::MAX rounded down to a page.
    #[test]
    fn cgroup_v1_reads_the_memory_controller() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        put(r, "memory", "memory.limit_in_bytes", "9223372036854771712");
        put(r, "memory/ns", "memory.limit_in_bytes", "4096000");
        put(r, "memory/ns", "memory.usage_in_bytes", "1000000");
        put(
            r,
            "memory/ns",
            "memory.stat",
            "total_inactive_file 500000\n",
        );
        put(
            r,
            "memory/ns/box",
            "memory.limit_in_bytes",
            "9223372036854771712",
        );
        put(r, "memory/ns/box", "memory.usage_in_bytes", "1000000");
        let text = "5:cpu,cpuacct:/ns\n4:memory:/ns/box\n0::/\n";
        assert_eq!(
            cgroup_memory_under(r, text),
            Some(CgroupMemory {
                limit_bytes: 4_096_000,
                room_bytes: 3_596_000
            })
        );
        let joined = "3:cpu,memory:/ns\n";
        assert_eq!(
            cgroup_memory_under(r, joined).unwrap().limit_bytes,
            4_096_000
        );
        assert_eq!(cgroup_memory_under(r, "4:memory:/\n"), None);
        // 64 KiB pages' "no limit".
        put(r, "memory", "memory.limit_in_bytes", "9223372036854710272");
        assert_eq!(cgroup_memory_under(r, "4:memory:/\n"), None);
        assert_eq!(cgroup_memory_under(r, "1:cpu:/\n"), None);
    }
}
