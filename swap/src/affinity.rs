//! Which CPUs a thread may run on (`sched_getaffinity` /
//! `sched_setaffinity` of the calling thread).
//!
//! # Why the swap crate has this
//!
//! An offloaded step runs one compute thread (or candle's pool of them)
//! beside helper threads: this crate's ring threads, and in the main crate
//! the param copy thread and the optimizer thread. When there are fewer
//! cores than threads that want one, the kernel's scheduler moves the
//! compute thread between cores and lets a helper preempt it in the middle
//! of a matmul; on the 2-core development VM the compute of a real
//! offloaded step ran about 8% longer than the same compute alone, and
//! keeping the helpers on one core and the compute on the other removed
//! that (`examples/overlap`, ABBA, 13 of 16 rounds shorter). The main
//! crate decides the placement (`tierzero::engine::host::threads`); the ring
//! threads are spawned here, so they place themselves
//! ([`crate::engine::EngineConfig::thread_cpus`]).
//!
//! A mask names CPUs by their kernel numbers, below [`MAX_CPUS`]
//! (`cpu_set_t`'s size). Setting one is per thread and never fatal to the
//! caller's work: a refused mask (a CPU outside the cgroup's cpuset, say)
//! is an error the caller logs and carries on without.

use std::io;

/// CPUs a `cpu_set_t` can name.
pub const MAX_CPUS: usize = libc::CPU_SETSIZE as usize;

/// The CPUs the calling thread may run on, ascending.
pub fn current_thread_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is a plain bit array, valid when zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live cpu_set_t and the size passed is its own;
    // pid 0 is the calling thread.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((0..MAX_CPUS)
        // SAFETY: every index is below CPU_SETSIZE, the set's capacity.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Restricts the calling thread to `cpus` (kernel CPU numbers). Refuses an
/// empty list or a number of [`MAX_CPUS`] or more without a system call.
pub fn pin_current_thread(cpus: &[usize]) -> io::Result<()> {
    if cpus.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "no CPU to pin to",
        ));
    }
    if let Some(&c) = cpus.iter().find(|&&c| c >= MAX_CPUS) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("CPU {c} is beyond the {MAX_CPUS} a mask can name"),
        ));
    }
    // SAFETY: cpu_set_t is a plain bit array, valid when zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `c < MAX_CPUS` (checked above), the set's capacity.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a live cpu_set_t and the size passed is its own;
    // pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Pins the calling thread to `cpus` when given; a refusal is logged (a
/// warning naming `thread`) and the thread runs unpinned.
pub fn place_current_thread(cpus: Option<&[usize]>, thread: &str) {
    if let Some(cpus) = cpus {
        if let Err(e) = pin_current_thread(cpus) {
            tracing::warn!(
                thread,
                cpus = %format_cpu_list(cpus),
                error = %e,
                "could not pin the thread; it runs wherever the scheduler puts it"
            );
        }
    }
}

/// `cpus` as the kernel's list syntax, e.g. `0-3,6`.
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            end += 1;
            i += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if end == start {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
        i += 1;
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn a_thread_pinned_to_one_cpu_reports_it_and_can_be_restored() {
        let before = current_thread_cpus().unwrap();
        assert!(!before.is_empty());
        let last = *before.last().unwrap();
        // On a thread of its own, so the test harness's thread keeps its mask.
        let (during, after) = std::thread::spawn(move || {
            pin_current_thread(&[last]).unwrap();
            let during = current_thread_cpus().unwrap();
            pin_current_thread(&before).unwrap();
            (during, current_thread_cpus().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(during, vec![last]);
        assert_eq!(after, current_thread_cpus().unwrap());
    }

    #[test]
    fn bad_masks_are_refused_without_a_syscall() {
        assert_eq!(
            pin_current_thread(&[]).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            pin_current_thread(&[MAX_CPUS]).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }

    #[test]
    fn cpu_lists_are_written_as_ranges() {
        assert_eq!(format_cpu_list(&[]), "");
        assert_eq!(format_cpu_list(&[1]), "1");
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
    }
}
