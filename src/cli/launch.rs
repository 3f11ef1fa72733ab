//! `tierzero launch`: N ranks of `tierzero train` as N processes, and the
//! rank's communicator that `train` uses.
//!
//! Design:
//! * **mpirun, not a home-made launcher.** `tierzero launch --nproc N --
//!   train ARGS` runs `mpirun -np N --bind-to none [--oversubscribe]
//!   <this executable> train ARGS` and returns its status. Everything
//!   multi-node (hostfiles, remote start-up, environment forwarding with
//!   `-x`) is OpenMPI's; `--hostfile` is passed through, and `mpirun -np N
//!   tierzero train ...` directly is equivalent. `--oversubscribe` is added
//!   without a hostfile (one node: more ranks than cores is allowed, as on a
//!   2-core laptop, up to 4 a CPU), `--bind-to none` because each rank runs several
//!   threads (compute, optimizer, I/O). As root, OpenMPI refuses to start
//!   unless told: the two `OMPI_ALLOW_RUN_AS_ROOT*` variables are set then.
//! * **Which communicator.** [`rank_comm_on`] looks at what the launcher put
//!   in the environment (`OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`): more than one
//!   rank means MPI (`MpiComm`, feature `mpi`); otherwise one rank
//!   (`SingleRank`, MPI is not even initialised). A binary built without
//!   the `mpi` feature refuses to run as one of N ranks (each would train
//!   alone on the same data and write the same files) with the fix.
//! * **`--device cuda`** ([`rank_comm_on`]) makes the communicator NCCL
//!   (`NcclComm`, feature `gpu`): with `TIERZERO_NCCL_ADDR=host:port` the
//!   NCCL id goes through a TCP rendezvous (rank and size from
//!   `TIERZERO_RANK` / `TIERZERO_WORLD_SIZE`, else the launcher's), under
//!   `mpirun` through MPI, otherwise there is one rank. Without the feature
//!   it is refused with the rebuild command; without a driver, with the
//!   driver named (both exit 2). Compute stays on the CPU either way.
//! * **One communicator per process**, kept in a global: MPI can be
//!   initialised once per process, [`abort_ranks`] must reach it after an
//!   error, and [`finalize`] must drop it (MPI_Finalize) before the process
//!   exits.
//! * **A rank that fails** prints its error and calls [`abort_ranks`]
//!   (`MPI_Abort`), so the other ranks stop at once instead of waiting for
//!   it in a collective; a rank that dies or hangs is caught by `mpirun`
//!   (it tears the job down) or by the collectives' timeout
//!   (`TIERZERO_COMM_TIMEOUT_S`, default 600 s).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::anyhow;
use clap::Args;
use tierzero::engine::comm::launcher_world_size;
use tierzero::engine::{Comm, SingleRank};
use tierzero::gpu::{DeviceChoice, GpuError};

use super::Failure;

const EXAMPLES: &str = "\
Examples:
  tierzero launch --nproc 2 -- train --steps 50 --metrics metrics.jsonl
      two ranks on this machine; rank 0 writes the metrics and the progress
  tierzero launch --nproc 8 --hostfile hosts -- train --config ds_config.json
      eight ranks over the nodes of an OpenMPI hostfile
  mpirun -np 2 --bind-to none tierzero train --steps 50
      the same as the first, started by hand (without --bind-to none OpenMPI
      binds each rank of a small job to one core)
";

/// `tierzero launch` options.
#[derive(Debug, Args)]
#[command(after_help = EXAMPLES)]
pub struct LaunchArgs {
    /// Number of ranks (processes).
    #[arg(long, value_name = "N")]
    nproc: String,
    /// OpenMPI hostfile for ranks on several nodes (passed to mpirun).
    #[arg(long, value_name = "FILE")]
    hostfile: Option<PathBuf>,
    /// The mpirun to use.
    #[arg(long, value_name = "PATH", default_value = "mpirun")]
    mpirun: PathBuf,
    /// The tierzero command each rank runs (after `--`), e.g. `train --steps 50`.
    // `OsString`: a path that is not UTF-8 is passed on as is, as `train`
    // takes it (clap refused it as "invalid UTF-8").
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<std::ffi::OsString>,
}

/// A collective's wait without `TIERZERO_COMM_TIMEOUT_S`: MPI's default,
/// and the same for NCCL.
#[cfg(feature = "mpi")]
const DEFAULT_COMM_TIMEOUT: std::time::Duration = tierzero::engine::comm::mpi::DEFAULT_TIMEOUT;
#[cfg(not(feature = "mpi"))]
const DEFAULT_COMM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Seconds a collective waits for the other ranks, from
/// `TIERZERO_COMM_TIMEOUT_S` (default 600).
pub(crate) fn comm_timeout() -> Result<std::time::Duration, Failure> {
    match std::env::var("TIERZERO_COMM_TIMEOUT_S") {
        Err(_) => Ok(DEFAULT_COMM_TIMEOUT),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 => std::time::Duration::try_from_secs_f64(s).map_err(|_| {
                Failure::BadInput(anyhow!(
                    "TIERZERO_COMM_TIMEOUT_S={v}: too many seconds; give a positive number a \
                     Duration holds (up to about 1.8e19)"
                ))
            }),
            _ => Err(Failure::BadInput(anyhow!(
                "TIERZERO_COMM_TIMEOUT_S={v}: give a positive number of seconds"
            ))),
        },
    }
}

static RANK_COMM: Mutex<Option<Arc<dyn Comm>>> = Mutex::new(None);

/// This process's communicator (created on first use; see the module
/// docs), for collectives on `device` (`None`: the CPU, MPI or one rank;
/// `Some`: NCCL on that GPU).
pub fn rank_comm_on(device: Option<DeviceChoice>) -> Result<Arc<dyn Comm>, Failure> {
    let mut slot = RANK_COMM.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = slot.as_ref() {
        return Ok(c.clone());
    }
    let world = launcher_world_size().unwrap_or(1);
    let comm: Arc<dyn Comm> = match device {
        None if world <= 1 => Arc::new(SingleRank),
        None => mpi_comm(world)?,
        Some(d) => nccl_comm(d, world)?,
    };
    *slot = Some(comm.clone());
    Ok(comm)
}

/// Exit 2 for what the user can fix (no driver, no NCCL, no such device,
/// ranks that do not meet, a build without the feature), 1 for the rest.
fn gpu_failure(device: DeviceChoice, e: GpuError) -> Failure {
    let user = matches!(
        e,
        GpuError::NotBuilt
            | GpuError::DriverMissing { .. }
            | GpuError::NcclMissing { .. }
            | GpuError::LibraryTooOld { .. }
            | GpuError::DriverInit(_)
            | GpuError::NoDevice
            | GpuError::BadOrdinal { .. }
            | GpuError::InitRefused { .. }
            | GpuError::PeerFailed { .. }
            | GpuError::Rendezvous(_)
    );
    if let GpuError::DriverMissing { detail } | GpuError::NcclMissing { detail, .. } = &e {
        tracing::debug!("{detail}");
    }
    let err = anyhow!("--device {device}: {e}");
    if user {
        Failure::BadInput(err)
    } else {
        Failure::Internal(err)
    }
}

#[cfg(not(feature = "gpu"))]
fn nccl_comm(device: DeviceChoice, _world: usize) -> Result<Arc<dyn Comm>, Failure> {
    Err(gpu_failure(device, GpuError::NotBuilt))
}

/// Whether this process is the lead rank by mpirun's (or our NCCL
/// bootstrap's) environment, before the communicator exists: no rank
/// variable, or one that says 0.
pub(super) fn env_rank_is_lead() -> bool {
    matches!(
        env_count(&["TIERZERO_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]),
        Ok(None | Some(0))
    )
}

/// A count from the first of `keys` that is set; a set but malformed value
/// is an error naming it.
fn env_count(keys: &[&str]) -> Result<Option<usize>, Failure> {
    for k in keys {
        if let Ok(v) = std::env::var(k) {
            return v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| Failure::BadInput(anyhow!("{k}={v}: give a whole number")));
        }
    }
    Ok(None)
}

#[cfg(feature = "gpu")]
fn nccl_comm(device: DeviceChoice, world: usize) -> Result<Arc<dyn Comm>, Failure> {
    use tierzero::engine::comm::nccl::{Bootstrap, NcclComm, NcclOptions};
    let timeout = comm_timeout()?;
    let bootstrap = match std::env::var("TIERZERO_NCCL_ADDR") {
        Ok(addr) => {
            let world = env_count(&["TIERZERO_WORLD_SIZE"])?.unwrap_or(world);
            let rank =
                env_count(&["TIERZERO_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"])?.unwrap_or(0);
            if world == 0 || rank >= world {
                return Err(Failure::BadInput(anyhow!(
                    "TIERZERO_RANK={rank} with TIERZERO_WORLD_SIZE={world}: give each rank a \
                     number from 0 to the world size - 1"
                )));
            }
            Bootstrap::Tcp { addr, rank, world }
        }
        Err(_) if world > 1 => Bootstrap::Comm(mpi_comm(world)?),
        Err(_) => Bootstrap::Tcp {
            addr: String::new(),
            rank: 0,
            world: 1,
        },
    };
    let opts = NcclOptions {
        device,
        local_rank: tierzero::gpu::local_rank_from_env(),
        timeout,
        bootstrap,
    };
    let comm = NcclComm::new(opts).map_err(|e| gpu_failure(device, e))?;
    tracing::info!(
        "rank {} of {}: NCCL {} on cuda:{}",
        comm.rank(),
        comm.world_size(),
        comm.nccl_version(),
        comm.ordinal()
    );
    Ok(Arc::new(comm))
}

#[cfg(feature = "mpi")]
fn mpi_comm(world: usize) -> Result<Arc<dyn Comm>, Failure> {
    let c = tierzero::engine::comm::mpi::MpiComm::init(comm_timeout()?)
        .map_err(|e| Failure::Internal(anyhow!("starting MPI: {e}")))?;
    if c.world_size() != world {
        // The environment's count without the launcher that sets it (a
        // variable left exported, or a shell inside another job).
        let vars: Vec<String> = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"]
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| format!("{k}={v}")))
            .collect();
        return Err(Failure::BadInput(anyhow!(
            "the environment announces {world} ranks ({}) but MPI started {}: start the ranks \
             with mpirun or `tierzero launch`, or unset those variables for one rank",
            vars.join(", "),
            c.world_size()
        )));
    }
    Ok(Arc::new(c))
}

#[cfg(not(feature = "mpi"))]
fn mpi_comm(world: usize) -> Result<Arc<dyn Comm>, Failure> {
    Err(Failure::BadInput(anyhow!(
        "started as one of {world} ranks (mpirun), but this tierzero was built without MPI \
         support; rebuild with `cargo build --release --features mpi` (needs OpenMPI: \
         apt-get install libopenmpi-dev openmpi-bin libclang-dev)"
    )))
}

/// After a failed command: ends every rank's process (MPI_Abort) when this
/// process is one of several ranks. Returns when there is only one rank.
pub fn abort_ranks(code: i32) {
    let comm = RANK_COMM.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(c) = comm.filter(|c| c.world_size() > 1) {
        c.abort(code);
    }
}

/// Drops this process's communicator (MPI_Finalize) before it exits.
pub fn finalize() {
    let comm = RANK_COMM.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(comm);
}

/// Whether this process runs as root (OpenMPI then needs to be told).
#[cfg(feature = "mpi")]
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    // /proc/self belongs to the process's effective uid.
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Runs `tierzero launch`; returns the exit code (0, or 130 / 143 / 129
/// when the ranks stopped on a signal).
pub fn run(args: LaunchArgs) -> Result<i32, Failure> {
    let nproc = match tierzero::units::parse_count(&args.nproc) {
        Ok(n) if (1..=1 << 20).contains(&n) => n,
        _ => {
            return Err(Failure::BadInput(anyhow!(
                "--nproc {}: give a whole number of ranks from 1 to {}, such as --nproc 2",
                args.nproc,
                1u64 << 20
            )))
        }
    };
    // Inside a batch scheduler's allocation, mpirun places the ranks on
    // its nodes without a hostfile.
    let allocated = ["SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if args.hostfile.is_none() && !allocated {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        check_local_ranks(nproc, cpus)?;
    }
    if args.command.first().is_none_or(|c| c != "train") {
        let given: Vec<String> = args
            .command
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        return Err(Failure::BadInput(anyhow!(
            "launch runs `tierzero train` on every rank: give `-- train [ARGS]`, not `-- {}`",
            given.join(" ")
        )));
    }
    launch(nproc, &args)
}

/// Ranks a CPU of this machine may take without a hostfile: more than
/// the cores is allowed (a laptop's 2 cores run 2 ranks and their
/// threads), beyond this many is a typo, not a run.
const MAX_LOCAL_RANKS_PER_CPU: u64 = 4;

/// Refuses `nproc` ranks on this machine alone (no hostfile and no
/// Slurm/PBS/LSF allocation: mpirun starts every rank here,
/// oversubscribed) beyond
/// [`MAX_LOCAL_RANKS_PER_CPU`] a CPU of its `cpus`.
fn check_local_ranks(nproc: u64, cpus: usize) -> Result<(), Failure> {
    let most = MAX_LOCAL_RANKS_PER_CPU.saturating_mul(cpus.max(1) as u64);
    if nproc <= most {
        return Ok(());
    }
    Err(Failure::BadInput(anyhow!(
        "--nproc {nproc}: without --hostfile every rank runs on this machine, and it has {cpus} \
         CPUs (at most {most} ranks, {MAX_LOCAL_RANKS_PER_CPU} a CPU: each rank runs compute, \
         optimizer and I/O threads); give fewer ranks, or a --hostfile to spread them over \
         several nodes"
    )))
}

#[cfg(not(feature = "mpi"))]
fn launch(nproc: u64, _args: &LaunchArgs) -> Result<i32, Failure> {
    Err(Failure::BadInput(anyhow!(
        "this tierzero was built without MPI support, so it cannot start ranks through mpirun{}; \
         rebuild with `cargo build --release --features mpi` (needs OpenMPI: apt-get install \
         libopenmpi-dev openmpi-bin libclang-dev)",
        match nproc {
            1 => " (for one rank, run the command itself: `tierzero train ...`)",
            _ => "",
        }
    )))
}

#[cfg(feature = "mpi")]
fn launch(nproc: u64, args: &LaunchArgs) -> Result<i32, Failure> {
    use std::process::Command;
    let exe = std::env::current_exe()
        .map_err(|e| Failure::Internal(anyhow!("finding this executable: {e}")))?;
    let mut cmd = Command::new(&args.mpirun);
    cmd.arg("-np").arg(nproc.to_string());
    cmd.args(["--bind-to", "none"]);
    match &args.hostfile {
        Some(h) => {
            if !h.is_file() {
                return Err(Failure::BadInput(anyhow!(
                    "--hostfile {}: no such file; give an OpenMPI hostfile",
                    h.display()
                )));
            }
            cmd.arg("--hostfile").arg(h);
        }
        None => {
            cmd.arg("--oversubscribe");
        }
    }
    if is_root() {
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    // Our variables reach the ranks on other nodes too (mpirun hands its
    // environment to local ranks alone; a hostfile's remote ranks got
    // none of TIERZERO_COMM_TIMEOUT_S, TIERZERO_LOG...).
    for name in forwarded_env(std::env::vars_os().map(|(k, _)| k)) {
        cmd.arg("-x").arg(name);
    }
    cmd.arg(&exe).args(&args.command);
    // A stop goes to the ranks through mpirun as SIGUSR1/SIGUSR2 (its own
    // SIGINT handling kills them 1 s after a SIGTERM): see
    // `signals::run_mpirun`.
    let end = super::signals::run_mpirun(cmd)?.map_err(|e| {
        Failure::BadInput(anyhow!(
            "running {}: {e}; install OpenMPI (apt-get install openmpi-bin) or give --mpirun",
            args.mpirun.display()
        ))
    })?;
    // The ranks stopped at a step boundary on the signal the launcher got.
    if let Some(code) = end.code() {
        return Ok(code);
    }
    let status = end.status;
    match status.code() {
        Some(0) => Ok(0),
        // The ranks stopped at a step boundary on a signal (sent to mpirun
        // by hand).
        Some(c) if super::signals::is_stop_code(c) => Ok(c),
        Some(2) => Err(Failure::BadInput(anyhow!(
            "a rank refused its input (mpirun exited with 2); see its message above"
        ))),
        // Any other ending is mpirun's code, passed on as README says (a
        // rank killed by SIGKILL: mpirun's 137), with one line saying so.
        Some(c) => {
            errln!(
                "tierzero launch: mpirun exited with {c}; see the messages above (the ranks', or \
                 mpirun's own where it did not start them)"
            );
            Ok(c)
        }
        None => {
            use std::os::unix::process::ExitStatusExt as _;
            let signal = status.signal().unwrap_or(0);
            errln!("tierzero launch: mpirun was killed by signal {signal}");
            Ok(128 + signal)
        }
    }
}

/// The variables `tierzero launch` forwards to every rank with mpirun's
/// `-x`: ours (`TIERZERO_*`) and `RUST_LOG`, of those set.
#[cfg(feature = "mpi")]
fn forwarded_env(names: impl Iterator<Item = std::ffi::OsString>) -> Vec<String> {
    let mut out: Vec<String> = names
        .filter_map(|n| n.into_string().ok())
        .filter(|n| n.starts_with("TIERZERO_") || n == "RUST_LOG")
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a hostfile, up to 4 ranks a CPU start; more is refused
    /// naming the CPUs and the fix.
    #[test]
    fn ranks_on_this_machine_alone_are_bounded_by_its_cpus() {
        assert!(check_local_ranks(8, 2).is_ok());
        assert!(check_local_ranks(1, 0).is_ok());
        match check_local_ranks(9, 2) {
            Err(Failure::BadInput(e)) => {
                let e = e.to_string();
                assert!(e.contains("--nproc 9: without --hostfile"), "{e}");
                assert!(e.contains("it has 2 CPUs (at most 8 ranks"), "{e}");
            }
            Err(Failure::Internal(e)) => panic!("internal: {e}"),
            Ok(()) => panic!("9 ranks on 2 CPUs accepted"),
        }
    }

    /// Ours and RUST_LOG are forwarded to the ranks with -x; nothing else.
    #[cfg(feature = "mpi")]
    #[test]
    fn our_variables_are_forwarded_to_every_rank() {
        let names = [
            "PATH",
            "TIERZERO_LOG",
            "RUST_LOG",
            "TIERZERO_COMM_TIMEOUT_S",
            "TIERZEROX",
        ];
        assert_eq!(
            forwarded_env(names.iter().map(std::ffi::OsString::from)),
            ["RUST_LOG", "TIERZERO_COMM_TIMEOUT_S", "TIERZERO_LOG"]
        );
    }
}
