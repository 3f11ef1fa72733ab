//! Signals to other processes, for `tierzero launch` and mpirun (the
//! main crate denies unsafe code; `kill(2)` and `prctl(2)` are here, as
//! [`crate::space::process_alive`]'s `kill(pid, 0)` is in `space`).

/// Sends `signal` to process `pid` (`kill(2)`); the main crate denies
/// unsafe code, and `tierzero launch` passes a stop on to mpirun with it.
pub fn send_signal(pid: u32, signal: i32) -> std::io::Result<()> {
    let pid = i32::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: kill(2) takes plain integers and touches no memory of ours;
    // the pid is positive, so it names one process, never a group.
    let rc = unsafe { libc::kill(pid, signal) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Makes the process `cmd` spawns receive `signal` when the thread that
/// spawned it dies (Linux's `PR_SET_PDEATHSIG`): `tierzero launch` gives
/// mpirun SIGINT, its abort, so that the ranks do not outlive a launcher
/// killed with SIGKILL or by the OOM killer.
pub fn signal_with_parent(cmd: &mut std::process::Command, signal: i32) {
    use std::os::unix::process::CommandExt as _;
    let sig = libc::c_ulong::try_from(signal).unwrap_or(libc::SIGKILL as libc::c_ulong);
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed: it makes one `prctl` call
    // with integer arguments and touches no memory the parent owns.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
