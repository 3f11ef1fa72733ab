//! [`MpiComm`]: the [`Comm`] collectives over MPI (OpenMPI through the `mpi`
//! crate; feature `mpi`), one process per rank under `mpirun`.
//!
//! # Design
//!
//! * **One MPI thread.** MPI is initialised on a dedicated thread that owns
//!   the `Universe` and makes every collective call; [`MpiComm`] holds only
//!   channels to it. The engine needs a `Comm` that is `Send + Sync`, and
//!   MPI handles are not (raw pointers, and the main crate allows no
//!   `unsafe` outside its CPU kernels to assert otherwise); a thread that
//!   owns them is the safe way. The
//!   engine's compute thread sends one operation and waits for its reply
//!   (one collective at a time, in call order: a mutex serialises callers,
//!   so collectives are issued in the same order on every rank as long as
//!   the engine calls them in the same order, which it does).
//! * **Deterministic reductions.** Nothing is summed by MPI: gradients go
//!   through `MPI_Alltoallv` (each rank receives every rank's chunk of its
//!   own shard) and are added into the accumulator in rank order 0..N;
//!   scalars are all-gathered (`MPI_Allgather`) and summed in rank order by
//!   the caller ([`Comm::all_reduce_sum_f64`]). Results cannot depend on
//!   timing or on OpenMPI's choice of reduction algorithm.
//! * **A peer that dies.** Under `mpirun`, OpenMPI tears the whole job down
//!   when a rank exits abnormally (measured: a SIGKILLed rank's peers are
//!   gone within about a second, and `mpirun` names the rank and signal).
//!   A peer that *hangs* (stopped, deadlocked, a launcher that does not tear
//!   down) would leave the others blocked in a collective forever, so every
//!   collective is bounded by a timeout ([`MpiComm::timeout`], default
//!   [`DEFAULT_TIMEOUT`], `TIERZERO_COMM_TIMEOUT_S` in the CLI): past it the
//!   caller gets [`EngineError::Comm`] naming the collective, the rank and
//!   the wait, and the communicator is marked broken (the MPI thread is
//!   stuck in the call; it is not joined). [`Comm::abort`] then ends the
//!   whole job with `MPI_Abort` (called from the caller's thread when MPI
//!   granted `MPI_THREAD_MULTIPLE`, else the process exits by itself and
//!   `mpirun` tears the rest down).
//! * **Finalize.** Dropping the last [`MpiComm`] stops the thread, which
//!   drops the `Universe` (`MPI_Finalize`). A process must do that before
//!   it exits, or `mpirun` reports the rank as failed.

use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};
use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;
use mpi::Threading;

use crate::engine::comm::owner::{CallFailure, OwnerThread};
use crate::engine::comm::{add_chunks_in_rank_order, check_counts, Comm};
use crate::engine::{EngineError, Result};

/// How long a collective waits for the other ranks by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// Work for the MPI thread.
#[derive(Debug)]
enum Op {
    GatherBytes { shard: Vec<u8>, counts: Vec<i32> },
    AllToAllF32 { full: Vec<f32>, counts: Vec<i32> },
    GatherF64(Vec<f64>),
    Barrier,
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::GatherBytes { .. } => "all-gather",
            Op::AllToAllF32 { .. } => "reduce-scatter (all-to-all)",
            Op::GatherF64(_) => "all-gather of scalars",
            Op::Barrier => "barrier",
        }
    }
}

#[derive(Debug)]
enum Reply {
    Bytes(Vec<u8>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Done,
}

/// N ranks over MPI (see the module docs).
#[derive(Debug)]
pub struct MpiComm {
    rank: usize,
    world: usize,
    threading_multiple: bool,
    owner: OwnerThread<Op, Reply>,
}

fn count(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| {
        EngineError::internal(format!(
            "{what}: {n} elements exceed MPI's 32-bit counts; lower sub_group_size or use more ranks"
        ))
    })
}

fn displs(counts: &[i32]) -> Vec<i32> {
    counts
        .iter()
        .scan(0i32, |acc, &c| {
            let d = *acc;
            *acc = acc.saturating_add(c);
            Some(d)
        })
        .collect()
}

/// The MPI thread's loop: one collective per operation, until the channel
/// closes.
fn serve(world: &SimpleCommunicator, ops: &Receiver<Op>, replies: &Sender<Reply>) {
    let me = world.rank() as usize;
    while let Ok(op) = ops.recv() {
        let reply = match op {
            Op::GatherBytes { shard, counts } => {
                let total: i32 = counts.iter().sum();
                let mut out = vec![0u8; total.max(0) as usize];
                let d = displs(&counts);
                let mut part = PartitionMut::new(&mut out[..], &counts[..], &d[..]);
                world.all_gather_varcount_into(&shard[..], &mut part);
                Reply::Bytes(out)
            }
            Op::AllToAllF32 { full, counts } => {
                let mine = counts.get(me).copied().unwrap_or(0);
                let n = counts.len();
                let recv_counts = vec![mine; n];
                let recv_displs = displs(&recv_counts);
                let send_displs = displs(&counts);
                let mut out = vec![0f32; mine.max(0) as usize * n];
                let send = Partition::new(&full[..], &counts[..], &send_displs[..]);
                let mut recv = PartitionMut::new(&mut out[..], &recv_counts[..], &recv_displs[..]);
                world.all_to_all_varcount_into(&send, &mut recv);
                Reply::F32(out)
            }
            Op::GatherF64(local) => {
                let mut out = vec![0f64; local.len() * world.size() as usize];
                world.all_gather_into(&local[..], &mut out[..]);
                Reply::F64(out)
            }
            Op::Barrier => {
                world.barrier();
                Reply::Done
            }
        };
        if replies.send(reply).is_err() {
            break;
        }
    }
}

impl MpiComm {
    /// Initialises MPI on its own thread and returns this rank's
    /// communicator over `MPI_COMM_WORLD`. Fails if MPI was initialised
    /// before in this process.
    pub fn init(timeout: Duration) -> Result<MpiComm> {
        let (init_tx, init_rx) = bounded::<std::result::Result<(usize, usize, bool), String>>(1);
        let (op_tx, op_rx) = bounded::<Op>(1);
        let (reply_tx, reply_rx) = bounded::<Reply>(1);
        let thread = std::thread::Builder::new()
            .name("tierzero-mpi".into())
            .spawn(move || {
                let Some((universe, threading)) =
                    mpi::initialize_with_threading(Threading::Multiple)
                else {
                    let _ = init_tx.send(Err("MPI is already initialised in this process".into()));
                    return;
                };
                let world = universe.world();
                let info = (
                    world.rank() as usize,
                    world.size() as usize,
                    threading == Threading::Multiple,
                );
                if init_tx.send(Ok(info)).is_err() {
                    return;
                }
                serve(&world, &op_rx, &reply_tx);
                drop(world);
                drop(universe);
            })
            .map_err(|e| EngineError::internal(format!("spawning the MPI thread: {e}")))?;
        let (rank, world, threading_multiple) = match init_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(reason)) => {
                let _ = thread.join();
                return Err(EngineError::Comm {
                    rank: 0,
                    world: 0,
                    op: "init",
                    reason,
                });
            }
            Err(_) => {
                let _ = thread.join();
                return Err(EngineError::Comm {
                    rank: 0,
                    world: 0,
                    op: "init",
                    reason: "the MPI thread ended during MPI_Init_thread".into(),
                });
            }
        };
        Ok(MpiComm {
            rank,
            world,
            threading_multiple,
            owner: OwnerThread::new(op_tx, reply_rx, Some(thread), timeout),
        })
    }

    /// How long a collective waits for the other ranks.
    pub fn timeout(&self) -> Duration {
        self.owner.timeout()
    }

    fn comm_error(&self, op: &'static str, reason: String) -> EngineError {
        EngineError::Comm {
            rank: self.rank,
            world: self.world,
            op,
            reason,
        }
    }

    /// Runs one collective on the MPI thread and waits for it, at most the
    /// timeout.
    fn call(&self, op: Op) -> Result<Reply> {
        let name = op.name();
        self.owner.call(op).map_err(|f| {
            let reason = match f {
                CallFailure::Broken => {
                    "an earlier collective failed; the communicator is unusable".into()
                }
                CallFailure::Poisoned => "the communicator lock is poisoned".into(),
                CallFailure::ShutDown => "the communicator is shut down".into(),
                CallFailure::Ended => "the MPI thread has ended".into(),
                CallFailure::Timeout(waited_s) => format!(
                    "got no answer from the other ranks within {waited_s:.0} s: a rank has died \
                     or hangs, or is still starting (at start-up: encoding a corpus its node has \
                     no token cache of); stopping (set TIERZERO_COMM_TIMEOUT_S to wait longer)"
                ),
            };
            self.comm_error(name, reason)
        })
    }

    fn counts_i32(&self, counts: &[usize], what: &str) -> Result<Vec<i32>> {
        if counts.len() != self.world {
            return Err(EngineError::internal(format!(
                "{what}: {} counts for {} ranks",
                counts.len(),
                self.world
            )));
        }
        counts.iter().map(|&c| count(c, what)).collect()
    }
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather_bytes(&self, shard: &[u8], counts_bytes: &[usize], out: &mut [u8]) -> Result<()> {
        check_counts(
            "all_gather",
            self.rank,
            counts_bytes,
            shard.len(),
            out.len(),
        )?;
        if out.is_empty() {
            // Nothing to move, and every rank knows it (the counts are the
            // same everywhere), so no rank calls MPI: an all-gather of zero
            // bytes in all failed here with MPI_ERR_ARG (OpenMPI, measured).
            return Ok(());
        }
        let counts = self.counts_i32(counts_bytes, "all_gather")?;
        count(out.len(), "all_gather")?;
        match self.call(Op::GatherBytes {
            shard: shard.to_vec(),
            counts,
        })? {
            Reply::Bytes(b) if b.len() == out.len() => {
                out.copy_from_slice(&b);
                Ok(())
            }
            other => Err(EngineError::internal(format!(
                "all_gather: unexpected reply {other:?}"
            ))),
        }
    }

    fn reduce_scatter_add_f32(
        &self,
        full: &[f32],
        counts_numel: &[usize],
        acc: &mut [f32],
    ) -> Result<()> {
        check_counts(
            "reduce_scatter",
            self.rank,
            counts_numel,
            acc.len(),
            full.len(),
        )?;
        let counts = self.counts_i32(counts_numel, "reduce_scatter")?;
        // The same check on every rank (this rank's own block size would
        // let a later rank, whose block is smaller, into the collective
        // that an earlier one refused): the largest block times the ranks
        // bounds both this rank's receive (`acc.len()` per rank) and the
        // send's displacements (their sum).
        let largest = counts_numel.iter().copied().max().unwrap_or(0);
        count(largest.saturating_mul(self.world), "reduce_scatter")?;
        let chunks = match self.call(Op::AllToAllF32 {
            full: full.to_vec(),
            counts,
        })? {
            Reply::F32(v) if v.len() == acc.len() * self.world => v,
            other => {
                return Err(EngineError::internal(format!(
                    "reduce_scatter: unexpected reply {other:?}"
                )))
            }
        };
        add_chunks_in_rank_order(acc, &chunks);
        Ok(())
    }

    fn all_gather_f64(&self, local: &[f64], out: &mut [f64]) -> Result<()> {
        if out.len() != local.len() * self.world {
            return Err(EngineError::internal("all_gather_f64: lengths"));
        }
        count(out.len(), "all_gather_f64")?;
        match self.call(Op::GatherF64(local.to_vec()))? {
            Reply::F64(v) if v.len() == out.len() => {
                out.copy_from_slice(&v);
                Ok(())
            }
            other => Err(EngineError::internal(format!(
                "all_gather_f64: unexpected reply {other:?}"
            ))),
        }
    }

    fn barrier(&self) -> Result<()> {
        match self.call(Op::Barrier)? {
            Reply::Done => Ok(()),
            other => Err(EngineError::internal(format!(
                "barrier: unexpected reply {other:?}"
            ))),
        }
    }

    fn abort(&self, code: i32) {
        if self.threading_multiple {
            // MPI_THREAD_MULTIPLE: legal from this thread even while the
            // MPI thread is blocked in a collective.
            SimpleCommunicator::world().abort(code);
        }
        // Otherwise exit without finalising: mpirun sees a rank fail and
        // tears the job down.
        std::process::exit(code);
    }
}
