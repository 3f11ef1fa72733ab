//! Collectives between data-parallel ranks.
//!
//! ZeRO partitions every parameter, gradient and optimizer-state tensor into
//! per-rank shards (`crate::engine::layout`). A fetch gathers the shards into the
//! full tensor, a gradient is reduce-scattered so each rank keeps the sum of
//! its shard, and the global gradient norm and the loss are all-reduced.
//! The engine calls these through [`Comm`] only, so an MPI or NCCL backend
//! plugs in without touching the step. [`SingleRank`] is one rank (every
//! collective is a copy); `mpi::MpiComm` (feature `mpi`) runs N ranks
//! as N processes under `mpirun`.
//!
//! # Determinism
//!
//! Every reduction happens **in rank order 0..N on every rank**, so results
//! never depend on timing or on the transport's reduction tree:
//!
//! * [`Comm::reduce_scatter_add_f32`] is an all-to-all of chunks followed by
//!   a local `acc += chunk[r]` for `r` in 0..N (not `MPI_Reduce_scatter`,
//!   whose summation order is the library's choice). Adding each rank's
//!   chunk into the accumulator one after the other is exactly what one rank
//!   does when it accumulates the same micro-batches one after the other
//!   (see the trainer's docs for when that makes N ranks bit-identical to
//!   one).
//! * Scalars (loss, Σg²) are all-gathered and summed in rank order
//!   ([`Comm::all_reduce_sum_f64`]'s default), so every rank computes the
//!   same bits and takes the same decision (skip, clip).
//!
//! # Ordering contract
//!
//! Collectives are matched by call order, as in MPI: every rank must issue
//! the same collectives in the same order. The engine therefore calls them
//! only at points that are the same on every rank (a fetch in unit order, a
//! gradient in backward order, the step's decision), never from code whose
//! timing differs between ranks (I/O completions, the optimizer thread's
//! replies): see the "staged" state in [`crate::engine::params::store`].

use crate::engine::{EngineError, Result};

/// The collectives the engine needs.
pub trait Comm: Send + Sync + std::fmt::Debug {
    /// This rank, from 0.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Concatenates every rank's `shard` (rank order) into `out`.
    /// `counts_bytes[r]` is rank `r`'s shard length; `shard.len()` must be
    /// `counts_bytes[rank]` and `out.len()` their sum.
    fn all_gather_bytes(&self, shard: &[u8], counts_bytes: &[usize], out: &mut [u8]) -> Result<()>;
    /// Gradient reduce-scatter: `full` is this rank's contribution to a
    /// whole tensor, cut into per-rank chunks of `counts_numel[r]` elements
    /// (rank order). Adds every rank's chunk for *this* rank into `acc`
    /// (`counts_numel[rank]` elements) one rank after the other, in rank
    /// order: `acc += chunk_0; acc += chunk_1; ...`.
    fn reduce_scatter_add_f32(
        &self,
        full: &[f32],
        counts_numel: &[usize],
        acc: &mut [f32],
    ) -> Result<()>;
    /// Concatenates every rank's `local` (all of the same length) in rank
    /// order into `out` (`world × local.len()` values).
    fn all_gather_f64(&self, local: &[f64], out: &mut [f64]) -> Result<()>;
    /// Waits until every rank has reached this call.
    fn barrier(&self) -> Result<()>;
    /// Ends the whole job after a fatal error on this rank, so the other
    /// ranks do not wait for it in a collective (MPI: `MPI_Abort`). One
    /// rank: nothing to do, the caller exits.
    fn abort(&self, code: i32) {
        let _ = code;
    }
    /// The most memory its collectives stage through, beyond the
    /// engine's own (NCCL's host collectives: a pinned buffer and device
    /// buffers), for the start-up plan. None: none (MPI, one rank).
    fn staging_bytes(&self) -> Option<CommStaging> {
        None
    }
    /// Sums a scalar over ranks: all-gathered, then added from 0.0 in rank
    /// order, so every rank gets the same bits.
    fn all_reduce_sum_f64(&self, x: f64) -> Result<f64> {
        let mut all = vec![0f64; self.world_size()];
        self.all_gather_f64(&[x], &mut all)?;
        Ok(all.iter().fold(0f64, |s, v| s + v))
    }
}

/// What a [`Comm`]'s collectives stage through, at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommStaging {
    /// Pinned host bytes.
    pub pinned_bytes: u64,
    /// Device bytes.
    pub device_bytes: u64,
}

/// The smallest of every rank's `own` (a collective: every rank calls it
/// at the same point; one rank: `own`). For budgets that decide which
/// collectives a rank issues (the device tier's, the kept activations'):
/// every rank must take the same decisions, so they take the smallest
/// rank's budget.
pub fn least_among_ranks(comm: &dyn Comm, own: u64) -> Result<u64> {
    if comm.world_size() == 1 {
        return Ok(own);
    }
    let mut all = vec![0f64; comm.world_size()];
    // Exact below 2^53 (memory budgets); larger values round the same way
    // on every rank and convert back saturating.
    comm.all_gather_f64(&[own as f64], &mut all)?;
    Ok(all.iter().map(|&b| b as u64).min().unwrap_or(own))
}

/// Every rank's `own`, in rank order (one collective; every rank must
/// call it).
pub fn all_gather_u64(comm: &dyn Comm, own: u64) -> Result<Vec<u64>> {
    let world = comm.world_size();
    if world == 1 {
        return Ok(vec![own]);
    }
    let mut all = vec![0u8; 8 * world];
    comm.all_gather_bytes(&own.to_le_bytes(), &vec![8; world], &mut all)?;
    Ok(all
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect())
}

/// Every rank's bytes (`mine` on this rank; lengths may differ), in rank
/// order: the lengths are all-gathered first, then the bytes. Two
/// collectives; every rank must call it.
pub fn all_gather_var(comm: &dyn Comm, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let world = comm.world_size();
    let mut lens = vec![0f64; world];
    // Exact: lengths are far below 2^53.
    comm.all_gather_f64(&[mine.len() as f64], &mut lens)?;
    let counts: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
    let mut all = vec![0u8; counts.iter().sum()];
    comm.all_gather_bytes(mine, &counts, &mut all)?;
    let mut out = Vec::with_capacity(world);
    let mut at = 0usize;
    for c in counts {
        out.push(all[at..at + c].to_vec());
        at += c;
    }
    Ok(out)
}

/// Makes every rank agree on the outcome of a local phase of a collective
/// operation (a checkpoint save): each rank's result is all-gathered, and
/// if any rank failed, every rank returns an error (its own, or one naming
/// the first rank that failed and that rank's message). So a rank that
/// fails does not leave the others waiting in the operation's next
/// collective. One rank: `local` itself.
pub fn agree<T>(comm: &dyn Comm, what: &'static str, local: Result<T>) -> Result<T> {
    if comm.world_size() == 1 {
        return local;
    }
    let mine = match &local {
        Ok(_) => Vec::new(),
        Err(e) => format!("!{e}").into_bytes(),
    };
    let all = all_gather_var(comm, &mine)?;
    let local = local?;
    match all.iter().enumerate().find(|(_, m)| !m.is_empty()) {
        None => Ok(local),
        Some((peer, msg)) => Err(EngineError::Comm {
            rank: comm.rank(),
            world: comm.world_size(),
            op: what,
            reason: format!(
                "rank {peer} failed: {}",
                String::from_utf8_lossy(msg.get(1..).unwrap_or_default())
            ),
        }),
    }
}

/// Refuses a run whose ranks were started with different settings: each
/// `(name, value)` of `settings` is compared with every rank's, and the
/// first that differs is [`EngineError::RanksDisagree`], on every rank
/// alike (each sees every rank's values). One all-gather of each rank's
/// settings; every rank must call it with the same names in the same
/// order. Without it a rank that runs another `--steps` or
/// `--grad-accum` meets the others in another collective, with counts
/// each rank computed alone: a hang, or worse.
pub fn same_on_every_rank(comm: &dyn Comm, settings: &[(&str, String)]) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let all = all_gather_var(comm, &encode_settings(settings))?;
    let ranks: Vec<Vec<(String, String)>> = all.iter().map(|b| decode_settings(b)).collect();
    let longest = ranks.iter().map(Vec::len).max().unwrap_or(0);
    for i in 0..longest {
        let of = |r: &Vec<(String, String)>| r.get(i).cloned();
        let first = of(&ranks[0]);
        if ranks.iter().all(|r| of(r) == first) {
            continue;
        }
        let setting = ranks
            .iter()
            .find_map(|r| r.get(i).map(|(n, _)| n.clone()))
            .unwrap_or_default();
        let each: Vec<(usize, String)> = ranks
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let value = match r.get(i) {
                    Some((n, v)) if *n == setting => v.clone(),
                    Some((n, _)) => format!("(another setting: {n})"),
                    None => "(not given)".to_owned(),
                };
                (rank, value)
            })
            .collect();
        let values = values_by_rank(where_they_differ(each));
        return Err(EngineError::RanksDisagree { setting, values });
    }
    Ok(())
}

/// Long values (a whole ZeRO section's, some 1500 characters) cut to where
/// they differ: the part between the prefix and the suffix all of them
/// share, with [`CONTEXT_CHARS`] of each around it, elided with `…`.
/// Short ones are kept whole.
fn where_they_differ(values: Vec<(usize, String)>) -> Vec<(usize, String)> {
    const LONG_CHARS: usize = 120;
    if values.iter().all(|(_, v)| v.chars().count() <= LONG_CHARS) {
        return values;
    }
    let chars: Vec<Vec<char>> = values.iter().map(|(_, v)| v.chars().collect()).collect();
    let shortest = chars.iter().map(Vec::len).min().unwrap_or(0);
    let same_at = |at: &dyn Fn(&Vec<char>) -> char| chars.iter().all(|c| at(c) == at(&chars[0]));
    let prefix = (0..shortest)
        .find(|&i| !same_at(&|c: &Vec<char>| c[i]))
        .unwrap_or(shortest);
    let suffix = (0..shortest - prefix)
        .find(|&i| !same_at(&|c: &Vec<char>| c[c.len() - 1 - i]))
        .unwrap_or(shortest - prefix);
    values
        .into_iter()
        .zip(&chars)
        .map(|((rank, _), c)| {
            let from = prefix.saturating_sub(CONTEXT_CHARS);
            let to = (c.len() - suffix + CONTEXT_CHARS).min(c.len());
            let mut cut = String::new();
            if from > 0 {
                cut.push('…');
            }
            cut.extend(&c[from..to]);
            if to < c.len() {
                cut.push('…');
            }
            (rank, cut)
        })
        .collect()
}

/// Characters of the shared parts kept around where values differ
/// ([`where_they_differ`]).
const CONTEXT_CHARS: usize = 40;

/// Ranks' values of one setting as [`EngineError::RanksDisagree`] names
/// them: each distinct value once, in the order met, with the ranks that
/// have it ("3 on rank 0, 4 on ranks 1, 2").
pub(crate) fn values_by_rank(values: impl IntoIterator<Item = (usize, String)>) -> String {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (rank, value) in values {
        match groups.iter_mut().find(|(v, _)| *v == value) {
            Some((_, rs)) => rs.push(rank),
            None => groups.push((value, vec![rank])),
        }
    }
    groups
        .iter()
        .map(|(v, rs)| {
            let rs: Vec<String> = rs.iter().map(usize::to_string).collect();
            let noun = if rs.len() == 1 { "rank" } else { "ranks" };
            format!("{v} on {noun} {}", rs.join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// [`same_on_every_rank`]'s settings as bytes: each name and value
/// after its length (a value may hold any byte).
fn encode_settings(settings: &[(&str, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in settings {
        for part in [name.as_bytes(), value.as_bytes()] {
            out.extend_from_slice(&(part.len() as u64).to_le_bytes());
            out.extend_from_slice(part);
        }
    }
    out
}

/// [`encode_settings`]'s bytes back as pairs (up to the first that does
/// not decode).
fn decode_settings(b: &[u8]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut at = 0usize;
    let mut take = || -> Option<String> {
        let len = usize::try_from(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?)).ok()?;
        let text = b.get(at + 8..(at + 8).checked_add(len)?)?;
        at += 8 + len;
        Some(String::from_utf8_lossy(text).into_owned())
    };
    while let (Some(n), Some(v)) = (take(), take()) {
        out.push((n, v));
    }
    out
}

/// Adds every rank's chunk of `chunks` (rank 0's first, `acc.len()`
/// elements each) into `acc`, in rank order: the one place the reduction
/// order of a reduce-scatter is fixed, so results never depend on timing or
/// on the backend.
pub fn add_chunks_in_rank_order(acc: &mut [f32], chunks: &[f32]) {
    if acc.is_empty() {
        return;
    }
    for chunk in chunks.chunks_exact(acc.len()) {
        for (a, b) in acc.iter_mut().zip(chunk) {
            *a += *b;
        }
    }
}

/// Several tensors' reduce-scatter as one: `parts[p]` cut into per-rank
/// chunks of `counts[p][r]` elements; returns every rank's chunks in rank
/// order, each rank's block holding its chunk of every part in order (the
/// `full` of [`Comm::reduce_scatter_add_f32`]), and each rank's block
/// length (its `counts_numel`). The layout is [`RankChunks`]'s.
pub fn rank_chunks(parts: &[&[f32]], counts: &[Vec<usize>]) -> Result<(Vec<f32>, Vec<usize>)> {
    let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    let layout = RankChunks::new(&lens, counts)?;
    let mut full = vec![0f32; layout.total_numel()];
    for (p, part) in parts.iter().enumerate() {
        for (to, from) in layout.chunks(p) {
            full[to.clone()].copy_from_slice(&part[from..from + to.len()]);
        }
    }
    Ok((full, layout.blocks))
}

/// Where [`rank_chunks`] puts each part's chunks: rank `r`'s block holds
/// chunk `r` of every part, in part order, and the blocks follow in rank
/// order. The one place that layout is decided: the trainer's
/// reduce-scatter of a unit's gradients (which widens each gradient
/// straight into its chunks) and the device's packing use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankChunks {
    /// `at[p][r]`: where chunk `r` of part `p` starts.
    at: Vec<Vec<usize>>,
    /// Each part's cut (`counts[p][r]` elements of part `p` for rank `r`).
    counts: Vec<Vec<usize>>,
    /// Each rank's block length.
    blocks: Vec<usize>,
}

impl RankChunks {
    /// The layout of parts of `lens` elements cut as `counts` (one count a
    /// rank each, summing to the part's length).
    pub fn new(lens: &[usize], counts: &[Vec<usize>]) -> Result<RankChunks> {
        let world = counts.first().map_or(0, Vec::len);
        if lens.len() != counts.len() {
            return Err(EngineError::internal(format!(
                "rank_chunks: {} parts but {} counts",
                lens.len(),
                counts.len()
            )));
        }
        for (&len, c) in lens.iter().zip(counts) {
            if c.len() != world || c.iter().sum::<usize>() != len {
                return Err(EngineError::internal(format!(
                    "rank_chunks: a part of {len} elements cut as {c:?} for {world} ranks"
                )));
            }
        }
        let blocks: Vec<usize> = (0..world)
            .map(|r| counts.iter().map(|c| c[r]).sum())
            .collect();
        let mut at = vec![vec![0usize; world]; counts.len()];
        let mut block_start = 0;
        for (r, block) in blocks.iter().enumerate() {
            let mut next = block_start;
            for (p, c) in counts.iter().enumerate() {
                at[p][r] = next;
                next += c[r];
            }
            block_start += block;
        }
        Ok(RankChunks {
            at,
            counts: counts.to_vec(),
            blocks,
        })
    }

    /// Elements of every block together.
    pub fn total_numel(&self) -> usize {
        self.blocks.iter().sum()
    }

    /// Each rank's block length.
    pub fn blocks(&self) -> &[usize] {
        &self.blocks
    }

    /// Part `p`'s chunks in rank order: where each goes (a range of the
    /// whole) and where it starts in the part; none for a part it does
    /// not have.
    pub fn chunks(&self, p: usize) -> impl Iterator<Item = (std::ops::Range<usize>, usize)> + '_ {
        let mut from = 0;
        let at = self.at.get(p).map_or(&[][..], Vec::as_slice);
        let counts = self.counts.get(p).map_or(&[][..], Vec::as_slice);
        at.iter().zip(counts).map(move |(&at, &n)| {
            let chunk = (at..at + n, from);
            from += n;
            chunk
        })
    }
}

/// One round of an all-to-all moved in rounds (elements `[from, from +
/// round)` of every rank's chunk, so that its staging stays bounded
/// whatever the collective's size): each peer's piece (`sent[p]`
/// elements, possibly none) and where it starts (`put[p]`) in this rank's
/// pieces laid one after the other in rank order. Counts are the same on
/// every rank, so every rank takes the same rounds, and a piece of none
/// here is a piece of none there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundPieces {
    /// Elements sent to each rank this round.
    pub sent: Vec<usize>,
    /// Where each rank's piece starts among this round's pieces.
    pub put: Vec<usize>,
}

impl RoundPieces {
    /// The round of `round` elements from element `from` of every chunk
    /// of `counts`.
    pub fn of(counts: &[usize], from: usize, round: usize) -> Self {
        let sent: Vec<usize> = counts
            .iter()
            .map(|&c| c.saturating_sub(from).min(round))
            .collect();
        let put = sent
            .iter()
            .scan(0usize, |acc, &c| {
                let o = *acc;
                *acc += c;
                Some(o)
            })
            .collect();
        RoundPieces { sent, put }
    }

    /// Elements of this round's pieces.
    pub fn total(&self) -> usize {
        self.sent.iter().sum()
    }

    /// This round's pieces of `full` (every rank's chunk, of `counts`, one
    /// after the other) into `dst` (at least [`Self::total`] long), one
    /// after the other in rank order.
    pub fn pack(&self, full: &[f32], counts: &[usize], from: usize, dst: &mut [f32]) {
        let mut start = 0usize;
        for ((&c, &n), &at) in counts.iter().zip(&self.sent).zip(&self.put) {
            let begin = start + from.min(c);
            dst[at..at + n].copy_from_slice(&full[begin..begin + n]);
            start += c;
        }
    }

    /// The pieces received this round (`world` of `got` elements each, rank
    /// order: this rank's `got = sent[me]`) into `out` (every rank's chunk
    /// for this rank, `mine` each, rank order).
    pub fn unpack(got_pieces: &[f32], got: usize, mine: usize, from: usize, out: &mut [f32]) {
        if got == 0 {
            return;
        }
        for (p, piece) in got_pieces.chunks_exact(got).enumerate() {
            out[p * mine + from..p * mine + from + got].copy_from_slice(piece);
        }
    }
}

/// Checks the shapes of a variable-count collective; returns this rank's
/// offset (elements before its chunk).
pub fn check_counts(
    what: &str,
    rank: usize,
    counts: &[usize],
    mine: usize,
    total: usize,
) -> Result<usize> {
    let sum: usize = counts.iter().sum();
    let expected = counts.get(rank).copied();
    if expected != Some(mine) || sum != total {
        return Err(EngineError::internal(format!(
            "{what}: rank {rank} has {mine} of {total} elements but the counts are {counts:?}"
        )));
    }
    Ok(counts[..rank].iter().sum())
}

/// The world size the process launcher announces in the environment
/// (`OMPI_COMM_WORLD_SIZE` under OpenMPI's `mpirun`, `PMI_SIZE` under
/// MPICH's Hydra), if any. Used to refuse running N copies of a binary built
/// without MPI as if each were alone.
pub fn launcher_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
}

/// One rank: collectives are copies.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleRank;

impl Comm for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather_bytes(&self, shard: &[u8], counts_bytes: &[usize], out: &mut [u8]) -> Result<()> {
        check_counts("all_gather", 0, counts_bytes, shard.len(), out.len())?;
        out.copy_from_slice(shard);
        Ok(())
    }
    fn reduce_scatter_add_f32(
        &self,
        full: &[f32],
        counts_numel: &[usize],
        acc: &mut [f32],
    ) -> Result<()> {
        check_counts("reduce_scatter", 0, counts_numel, acc.len(), full.len())?;
        add_chunks_in_rank_order(acc, full);
        Ok(())
    }
    fn all_gather_f64(&self, local: &[f64], out: &mut [f64]) -> Result<()> {
        if local.len() != out.len() {
            return Err(EngineError::internal("all_gather_f64: lengths"));
        }
        out.copy_from_slice(local);
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::scripted::Scripted;
    use super::*;

    /// A long value (a ZeRO section's Debug, ~1500 characters) is cut to
    /// where the ranks' values differ, with some context; short ones stay.
    #[test]
    fn long_values_are_cut_to_where_they_differ() {
        let long = |n: u64| {
            format!(
                "Zero {{ stage: Parameters, {} max_live_parameters_numel: Numel({n}), {} }}",
                "offload_param: Offload { device: Cpu }, ".repeat(20),
                "tail: 1, ".repeat(20)
            )
        };
        let cut = where_they_differ(vec![(0, long(1_000_000_000)), (1, long(2000))]);
        for (rank, n) in [(0, "1000000000"), (1, "2000")] {
            let v = &cut[rank].1;
            assert!(v.len() < 150, "{v}");
            assert!(v.starts_with('…') && v.ends_with('…'), "{v}");
            assert!(
                v.contains(&format!("max_live_parameters_numel: Numel({n})")),
                "{v}"
            );
        }
        let short = vec![(0, "3".to_owned()), (1, "4".to_owned())];
        assert_eq!(where_they_differ(short.clone()), short);
    }

    /// Rank 1's settings in [`settings_disagreeing_name_the_setting_and_each_rank`].
    fn peer_settings() -> Vec<u8> {
        encode_settings(&[("steps", "3".to_owned()), ("seed", "2".to_owned())])
    }

    #[test]
    fn settings_disagreeing_name_the_setting_and_each_rank() {
        let mut comm = Scripted::rank_of(0, 2);
        comm.gather_f64 = Some(|mine, out| {
            out[0] = mine[0];
            out[1] = peer_settings().len() as f64;
            Ok(())
        });
        comm.gather_bytes = Some(|mine, _, out| {
            out[..mine.len()].copy_from_slice(mine);
            out[mine.len()..].copy_from_slice(&peer_settings());
            Ok(())
        });
        let same = [("steps", "3".to_owned()), ("seed", "2".to_owned())];
        same_on_every_rank(&comm, &same).unwrap();
        let other_seed = [("steps", "3".to_owned()), ("seed", "1".to_owned())];
        match same_on_every_rank(&comm, &other_seed) {
            Err(EngineError::RanksDisagree { setting, values }) => {
                assert_eq!(setting, "seed");
                assert_eq!(values, "1 on rank 0, 2 on rank 1");
            }
            other => panic!("{other:?}"),
        }
        // One setting fewer on this rank: the first missing one is named.
        match same_on_every_rank(&comm, &[("steps", "3".to_owned())]) {
            Err(EngineError::RanksDisagree { setting, values }) => {
                assert_eq!(setting, "seed");
                assert_eq!(values, "(not given) on rank 0, 2 on rank 1");
            }
            other => panic!("{other:?}"),
        }
        // One rank alone agrees with itself, with no collective.
        same_on_every_rank(&Scripted::rank_of(0, 1), &other_seed).unwrap();
    }

    #[test]
    fn settings_round_trip_through_their_bytes() {
        let s = [("a", String::new()), ("b\n", "x\u{0}y".to_owned())];
        let back = decode_settings(&encode_settings(&s));
        assert_eq!(
            back,
            vec![
                ("a".into(), String::new()),
                ("b\n".into(), "x\u{0}y".into())
            ]
        );
        assert!(decode_settings(&[1, 2, 3]).is_empty());
        assert!(decode_settings(&u64::MAX.to_le_bytes()).is_empty());
    }

    #[test]
    fn single_rank_collectives_are_copies_and_check_shapes() {
        let c = SingleRank;
        let mut out = [0u8; 3];
        c.all_gather_bytes(&[1, 2, 3], &[3], &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
        assert!(c.all_gather_bytes(&[1, 2], &[3], &mut out).is_err());
        let mut acc = [1f32, 2.0];
        c.reduce_scatter_add_f32(&[0.5, 0.25], &[2], &mut acc)
            .unwrap();
        assert_eq!(acc, [1.5, 2.25]);
        assert!(c.reduce_scatter_add_f32(&[0.5], &[2], &mut acc).is_err());
        assert_eq!(c.all_reduce_sum_f64(2.5).unwrap(), 2.5);
        c.barrier().unwrap();
    }

    #[test]
    fn rank_chunks_puts_each_rank_s_chunk_of_every_part_in_its_block() {
        let (a, b) = ([1f32, 2.0, 3.0], [10f32, 20.0, 30.0, 40.0, 50.0]);
        let (full, blocks) = rank_chunks(&[&a, &b], &[vec![2, 1], vec![3, 2]]).unwrap();
        assert_eq!(full, [1.0, 2.0, 10.0, 20.0, 30.0, 3.0, 40.0, 50.0]);
        assert_eq!(blocks, [5, 3]);
        assert!(rank_chunks(&[&a], &[vec![2, 2]]).is_err());
        assert!(rank_chunks(&[&a, &b], &[vec![2, 1]]).is_err());
        // Three ranks, chunks of none among them: every element once, each
        // part's chunk r in block r after the earlier parts' chunk r.
        let counts = [vec![0, 2, 1], vec![3, 0, 0], vec![1, 1, 2]];
        let l = RankChunks::new(&[3, 3, 4], &counts).unwrap();
        assert_eq!(l.blocks(), [4, 3, 3]);
        assert_eq!(l.total_numel(), 10);
        let got: Vec<Vec<_>> = (0..3).map(|p| l.chunks(p).collect()).collect();
        assert_eq!(got[0], [(0..0, 0), (4..6, 0), (7..8, 2)]);
        assert_eq!(got[1], [(0..3, 0), (6..6, 3), (8..8, 3)]);
        assert_eq!(got[2], [(3..4, 0), (6..7, 1), (8..10, 2)]);
        assert!(RankChunks::new(&[3], &[vec![1, 1]]).is_err());
        assert_eq!(l.chunks(3).count(), 0, "no such part");
    }

    #[test]
    fn an_all_to_all_in_rounds_gives_every_rank_its_chunks_in_rank_order() {
        // Three ranks with uneven chunks (one empty), moved 2 elements of
        // each chunk a round: the rounds' pieces, exchanged as NCCL's
        // sends and receives would, give each rank exactly what one
        // all-to-all gives.
        let counts = [5usize, 3, 0];
        let world = counts.len();
        let total: usize = counts.iter().sum();
        // Rank s's contribution: element i of its chunk for rank d is
        // 1000 s + 100 d + i.
        let full: Vec<Vec<f32>> = (0..world)
            .map(|s| {
                (0..world)
                    .flat_map(|d| (0..counts[d]).map(move |i| (1000 * s + 100 * d + i) as f32))
                    .collect()
            })
            .collect();
        let mut out: Vec<Vec<f32>> = counts.iter().map(|&m| vec![f32::NAN; m * world]).collect();
        let round = 2;
        let rounds = (0..*counts.iter().max().unwrap()).step_by(round);
        for from in rounds {
            let pieces = RoundPieces::of(&counts, from, round);
            let packed: Vec<Vec<f32>> = full
                .iter()
                .map(|f| {
                    let mut dst = vec![f32::NAN; pieces.total()];
                    pieces.pack(f, &counts, from, &mut dst);
                    dst
                })
                .collect();
            for (me, out) in out.iter_mut().enumerate() {
                let got = pieces.sent[me];
                // From each rank p, its piece for `me`.
                let received: Vec<f32> = packed
                    .iter()
                    .flat_map(|p| p[pieces.put[me]..pieces.put[me] + got].to_vec())
                    .collect();
                RoundPieces::unpack(&received, got, counts[me], from, out);
            }
        }
        for (me, out) in out.iter().enumerate() {
            let want: Vec<f32> = (0..world)
                .flat_map(|s| (0..counts[me]).map(move |i| (1000 * s + 100 * me + i) as f32))
                .collect();
            assert_eq!(out, &want, "rank {me}");
        }
        assert_eq!(total, 8);
        assert_eq!(
            RoundPieces::of(&counts, 4, 2),
            RoundPieces {
                sent: vec![1, 0, 0],
                put: vec![0, 1, 1]
            }
        );
    }

    #[test]
    fn check_counts_gives_the_offset() {
        assert_eq!(check_counts("x", 2, &[3, 3, 2], 2, 8).unwrap(), 6);
        assert!(check_counts("x", 1, &[3, 3, 2], 2, 8).is_err());
        assert!(check_counts("x", 0, &[3, 3, 2], 3, 9).is_err());
    }

    /// Rank 1 of three whose peers report 3 GiB and 2 GiB.
    fn peers() -> scripted::Scripted {
        scripted::Scripted {
            gather_f64: Some(|local, out| {
                let gib = (1u64 << 30) as f64;
                out.copy_from_slice(&[3.0 * gib, local[0], 2.0 * gib]);
                Ok(())
            }),
            ..scripted::Scripted::rank_of(1, 3)
        }
    }

    #[test]
    fn every_rank_takes_the_smallest_budget() {
        let gib = 1u64 << 30;
        assert_eq!(least_among_ranks(&peers(), 5 * gib).unwrap(), 2 * gib);
        // Its own when it is the smallest, to the byte.
        assert_eq!(
            least_among_ranks(&peers(), gib + 12_345).unwrap(),
            gib + 12_345
        );
        assert_eq!(least_among_ranks(&SingleRank, 7).unwrap(), 7);
    }
}

pub mod check;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "gpu")]
pub mod nccl;
#[cfg(any(feature = "mpi", feature = "gpu"))]
mod owner;
#[cfg(any(feature = "gpu", test))]
pub(crate) mod rendezvous;
#[cfg(test)]
pub(crate) mod scripted;
