//! Handing NCCL's unique id from rank 0 to every rank, and learning which
//! ranks could start CUDA at all.
//!
//! NCCL needs one `ncclUniqueId` (128 opaque bytes, made by rank 0's
//! `ncclGetUniqueId`) on every rank before `ncclCommInitRank`; it leaves the
//! transport of those bytes to the caller. Two transports:
//!
//! * **An existing communicator** ([`comm_exchange`]): under `mpirun` with
//!   the `mpi` feature, every rank all-gathers a 129-byte record through
//!   the MPI communicator (`Comm::all_gather_bytes`): a "ready" byte, and
//!   on rank 0 the id.
//! * **TCP** ([`tcp_exchange`], `TIERZERO_NCCL_ADDR=host:port`, ranks from
//!   `TIERZERO_RANK` / `TIERZERO_WORLD_SIZE`): rank 0 listens on the
//!   address, every other rank connects (retrying until rank 0 is up) and
//!   sends a hello (magic, rank, world, ready); once all `world - 1` hellos
//!   are in, rank 0 answers each with the failed ranks and the id. No
//!   authentication (like torch's TCPStore): use a port on a trusted
//!   network. A connection whose first bytes are not our magic is dropped
//!   and the rendezvous keeps waiting; a hello with another world size or a
//!   duplicate rank fails rank 0, and its closed sockets fail the others.
//!
//! **Why every rank reports "ready"**: a rank that cannot load CUDA or NCCL
//! must still take part, or the others would wait in `ncclCommInitRank`
//! until their timeout. After the exchange every rank knows who failed and
//! returns an error at once; only the failed rank's own error says why.
//!
//! Every wait is bounded by the caller's timeout (`TIERZERO_COMM_TIMEOUT_S`
//! in the CLI): a rank that never shows up is an error naming the missing
//! ranks, not a hang.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::engine::comm::Comm;
use crate::engine::{EngineError, Result};

/// Bytes of an `ncclUniqueId`.
pub const ID_BYTES: usize = 128;

const MAGIC: &[u8; 8] = b"TZNCCL01";
const HELLO_BYTES: usize = 8 + 4 + 4 + 1;

/// What every rank learns from the exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchange {
    /// Rank 0's id (zeros when rank 0 failed).
    pub id: [u8; ID_BYTES],
    /// Ranks that could not start CUDA or NCCL, ascending.
    pub failed_ranks: Vec<usize>,
}

fn err(rank: usize, world: usize, reason: String) -> EngineError {
    EngineError::Comm {
        rank,
        world,
        op: "NCCL rendezvous",
        reason,
    }
}

/// The exchange over an existing communicator (see the module docs).
/// `id` is rank 0's (required there when `ready`).
pub fn comm_exchange(
    comm: &dyn Comm,
    ready: bool,
    id: Option<&[u8; ID_BYTES]>,
) -> Result<Exchange> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let record = 1 + ID_BYTES;
    let mut mine = vec![0u8; record];
    mine[0] = u8::from(ready);
    if let (0, Some(id)) = (rank, id) {
        mine[1..].copy_from_slice(id);
    }
    let counts = vec![record; world];
    let mut all = vec![0u8; record * world];
    comm.all_gather_bytes(&mine, &counts, &mut all)?;
    let failed_ranks = all
        .chunks_exact(record)
        .enumerate()
        .filter(|(_, r)| r[0] != 1)
        .map(|(i, _)| i)
        .collect();
    let mut id = [0u8; ID_BYTES];
    id.copy_from_slice(&all[1..record]);
    Ok(Exchange { id, failed_ranks })
}

/// The exchange over TCP (see the module docs): rank 0 listens on `addr`,
/// the others connect to it. Every wait ends by `timeout` after the call.
pub fn tcp_exchange(
    addr: &str,
    rank: usize,
    world: usize,
    ready: bool,
    id: Option<&[u8; ID_BYTES]>,
    timeout: Duration,
) -> Result<Exchange> {
    if world == 0 || rank >= world {
        return Err(err(
            rank,
            world,
            format!("rank {rank} of {world}: give TIERZERO_RANK below TIERZERO_WORLD_SIZE"),
        ));
    }
    let deadline = Instant::now() + timeout;
    if rank == 0 {
        serve(addr, world, ready, id, deadline, timeout)
    } else {
        join(addr, rank, world, ready, deadline, timeout)
    }
}

fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

fn u32_le(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

/// Rank 0: accepts `world - 1` hellos, then answers them.
fn serve(
    addr: &str,
    world: usize,
    ready: bool,
    id: Option<&[u8; ID_BYTES]>,
    deadline: Instant,
    timeout: Duration,
) -> Result<Exchange> {
    let e = |reason: String| err(0, world, reason);
    let mut failed = if ready { vec![] } else { vec![0] };
    let id = match (ready, id) {
        (true, Some(id)) => *id,
        (true, None) => return Err(e("rank 0 is ready but has no NCCL id".into())),
        (false, _) => [0u8; ID_BYTES],
    };
    if world == 1 {
        return Ok(Exchange {
            id,
            failed_ranks: failed,
        });
    }
    let listener = TcpListener::bind(addr).map_err(|x| {
        e(format!(
            "listening on TIERZERO_NCCL_ADDR={addr}: {x}; give a free port on an address of \
             this host"
        ))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|x| e(format!("listener: {x}")))?;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut joined = 0usize;
    while joined < world - 1 {
        let Some(left) = remaining(deadline) else {
            let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
            return Err(e(format!(
                "ranks {missing:?} did not connect to {addr} within {:.0} s; start every rank \
                 with the same TIERZERO_NCCL_ADDR and TIERZERO_WORLD_SIZE={world} (or set \
                 TIERZERO_COMM_TIMEOUT_S to wait longer)",
                timeout.as_secs_f64()
            )));
        };
        let mut stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(x) if x.kind() == ErrorKind::WouldBlock || x.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(10).min(left));
                continue;
            }
            Err(x) => return Err(e(format!("accepting on {addr}: {x}"))),
        };
        let mut hello = [0u8; HELLO_BYTES];
        let read = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(left.min(Duration::from_secs(10)))))
            .and_then(|()| stream.read_exact(&mut hello));
        if read.is_err() || &hello[..8] != MAGIC {
            tracing::warn!(
                "NCCL rendezvous on {addr}: dropped a connection that is not a tierzero rank"
            );
            continue;
        }
        let (r, w, r_ready) = (
            u32_le(&hello[8..]) as usize,
            u32_le(&hello[12..]) as usize,
            hello[16] == 1,
        );
        if w != world {
            return Err(e(format!(
                "rank {r} says the world has {w} ranks, rank 0 says {world}; give every rank \
                 the same TIERZERO_WORLD_SIZE"
            )));
        }
        if r == 0 || r >= world || peers[r].is_some() {
            return Err(e(format!(
                "two ranks claim rank {r} (or it is out of 1..{world}); give every rank its own \
                 TIERZERO_RANK"
            )));
        }
        if !r_ready {
            failed.push(r);
        }
        peers[r] = Some(stream);
        joined += 1;
    }
    failed.sort_unstable();
    let mut reply = Vec::with_capacity(8 + 4 + 4 * failed.len() + ID_BYTES);
    reply.extend_from_slice(MAGIC);
    reply.extend_from_slice(&(failed.len() as u32).to_le_bytes());
    for &f in &failed {
        reply.extend_from_slice(&(f as u32).to_le_bytes());
    }
    reply.extend_from_slice(&id);
    for (r, s) in peers.iter_mut().enumerate() {
        if let Some(s) = s {
            s.set_write_timeout(remaining(deadline).or(Some(Duration::from_millis(1))))
                .and_then(|()| s.write_all(&reply))
                .and_then(|()| s.flush())
                .map_err(|x| e(format!("answering rank {r}: {x}")))?;
        }
    }
    Ok(Exchange {
        id,
        failed_ranks: failed,
    })
}

/// Ranks 1..: connects to rank 0 (retrying until it listens), says hello,
/// waits for the answer.
fn join(
    addr: &str,
    rank: usize,
    world: usize,
    ready: bool,
    deadline: Instant,
    timeout: Duration,
) -> Result<Exchange> {
    let e = |reason: String| err(rank, world, reason);
    let late = || {
        e(format!(
            "rank 0 did not answer on {addr} within {:.0} s: it is not running, failed, or waits \
             for other ranks (set TIERZERO_COMM_TIMEOUT_S to wait longer)",
            timeout.as_secs_f64()
        ))
    };
    let mut last_error = String::new();
    let mut stream = loop {
        let Some(left) = remaining(deadline) else {
            return Err(e(format!(
                "could not reach rank 0 at {addr} within {:.0} s ({last_error})",
                timeout.as_secs_f64()
            )));
        };
        let addrs = addr.to_socket_addrs().map_err(|x| {
            e(format!(
                "TIERZERO_NCCL_ADDR={addr}: {x}; give host:port of rank 0"
            ))
        })?;
        let mut connected = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(2))) {
                Ok(s) => {
                    connected = Some(s);
                    break;
                }
                Err(x) => last_error = x.to_string(),
            }
        }
        match connected {
            Some(s) => break s,
            None => std::thread::sleep(Duration::from_millis(50).min(left)),
        }
    };
    let mut hello = Vec::with_capacity(HELLO_BYTES);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(world as u32).to_le_bytes());
    hello.push(u8::from(ready));
    let left = remaining(deadline).ok_or_else(late)?;
    stream
        .set_write_timeout(Some(left))
        .and_then(|()| stream.write_all(&hello))
        .map_err(|x| e(format!("sending to rank 0 at {addr}: {x}")))?;
    stream
        .set_read_timeout(Some(left))
        .map_err(|x| e(format!("socket: {x}")))?;
    let read_err = |x: std::io::Error| match x.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => late(),
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset => e(format!(
            "rank 0 closed the rendezvous at {addr} (it failed; see its message)"
        )),
        _ => e(format!("reading from rank 0 at {addr}: {x}")),
    };
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).map_err(read_err)?;
    if &head[..8] != MAGIC {
        return Err(e(format!(
            "{addr} is not a tierzero rank 0 (wrong answer); check TIERZERO_NCCL_ADDR"
        )));
    }
    let n_failed = u32_le(&head[8..]) as usize;
    if n_failed > world {
        return Err(e(format!(
            "rank 0 sent {n_failed} failed ranks for {world}"
        )));
    }
    let mut rest = vec![0u8; 4 * n_failed + ID_BYTES];
    stream.read_exact(&mut rest).map_err(read_err)?;
    let failed_ranks = rest[..4 * n_failed]
        .chunks_exact(4)
        .map(|c| u32_le(c) as usize)
        .collect();
    let mut id = [0u8; ID_BYTES];
    id.copy_from_slice(&rest[4 * n_failed..]);
    Ok(Exchange { id, failed_ranks })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use crate::engine::SingleRank;

    /// A free port on localhost (bound then released).
    fn free_addr() -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    }

    fn run_ranks(
        addr: &str,
        world: usize,
        ready: impl Fn(usize) -> bool,
        timeout: Duration,
    ) -> Vec<Result<Exchange>> {
        let id: [u8; ID_BYTES] = std::array::from_fn(|i| i as u8 ^ 0x5a);
        std::thread::scope(|s| {
            // Peers first: they must retry until rank 0 listens.
            let handles: Vec<_> = (0..world)
                .rev()
                .map(|r| {
                    let ok = ready(r);
                    s.spawn(move || tcp_exchange(addr, r, world, ok, Some(&id), timeout))
                })
                .collect();
            let mut out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            out.reverse();
            out
        })
    }

    #[test]
    fn three_ranks_get_rank_0s_id() {
        let addr = free_addr();
        let out = run_ranks(&addr, 3, |_| true, Duration::from_secs(20));
        let want: [u8; ID_BYTES] = std::array::from_fn(|i| i as u8 ^ 0x5a);
        for r in out {
            let x = r.unwrap();
            assert_eq!(x.id, want);
            assert!(x.failed_ranks.is_empty());
        }
    }

    #[test]
    fn every_rank_learns_which_ranks_failed() {
        let addr = free_addr();
        let out = run_ranks(&addr, 4, |r| r != 2 && r != 0, Duration::from_secs(20));
        for r in out {
            assert_eq!(r.unwrap().failed_ranks, vec![0, 2]);
        }
    }

    #[test]
    fn a_missing_rank_is_a_timeout_naming_it_not_a_hang() {
        let addr = free_addr();
        let t0 = Instant::now();
        let id = [1u8; ID_BYTES];
        let a = addr.clone();
        let peer = std::thread::spawn(move || {
            tcp_exchange(&a, 1, 3, true, None, Duration::from_millis(1500))
        });
        let r0 = tcp_exchange(&addr, 0, 3, true, Some(&id), Duration::from_millis(1500));
        let msg = r0.unwrap_err().to_string();
        assert!(msg.contains("ranks [2] did not connect"), "{msg}");
        // Rank 0 gave up and closed: the peer fails too, in bounded time.
        let msg = peer.join().unwrap().unwrap_err().to_string();
        assert!(
            msg.contains("closed the rendezvous") || msg.contains("did not answer"),
            "{msg}"
        );
        assert!(t0.elapsed() < Duration::from_secs(10));
        // A peer alone, with no rank 0 at all.
        let msg = tcp_exchange(&free_addr(), 1, 2, true, None, Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("could not reach rank 0"), "{msg}");
    }

    #[test]
    fn strangers_are_dropped_and_mismatched_worlds_refused() {
        let addr = free_addr();
        let a = addr.clone();
        let t = std::thread::spawn(move || {
            // A stray client first (not our magic), then a rank 1 that
            // believes in another world size.
            let stray = loop {
                if let Ok(s) = TcpStream::connect(&a) {
                    break s;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            let mut stray = stray;
            stray.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
            tcp_exchange(&a, 1, 3, true, None, Duration::from_secs(10))
        });
        let r0 = tcp_exchange(
            &addr,
            0,
            2,
            true,
            Some(&[0; ID_BYTES]),
            Duration::from_secs(10),
        );
        let msg = r0.unwrap_err().to_string();
        assert!(
            msg.contains("the world has 3 ranks, rank 0 says 2"),
            "{msg}"
        );
        assert!(t.join().unwrap().is_err());
    }

    #[test]
    fn one_rank_needs_no_network_and_comm_exchange_works() {
        let id = [9u8; ID_BYTES];
        let x = tcp_exchange("unused:0", 0, 1, true, Some(&id), Duration::from_secs(1)).unwrap();
        assert_eq!(x.id, id);
        let x = comm_exchange(&SingleRank, true, Some(&id)).unwrap();
        assert_eq!((x.id, x.failed_ranks.is_empty()), (id, true));
        let x = comm_exchange(&SingleRank, false, None).unwrap();
        assert_eq!(x.failed_ranks, vec![0]);
        assert!(tcp_exchange("x:1", 2, 2, true, None, Duration::from_secs(1)).is_err());
    }
}
