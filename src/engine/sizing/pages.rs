//! The cpu tier's pinned pages: their size and count, and where each
//! param's shard goes in them (first fit, in `ParamId` order).

use super::Buffers;

/// Page size and count for the cpu tier: pages of 64 MiB, or the largest
/// cpu-tier shard where that is larger (or the whole tier where that is
/// smaller), as many as [`cpu_page_places`] fills.
pub fn cpu_page_plan(shard_bytes: &[u64]) -> Buffers {
    let largest = shard_bytes.iter().copied().max().unwrap_or(0);
    if largest == 0 {
        return Buffers::NONE;
    }
    let total: u64 = shard_bytes.iter().sum();
    let page = largest.max(total.min(64 << 20)).div_ceil(4096) * 4096;
    let pages = cpu_page_places(shard_bytes, page)
        .iter()
        .map(|&(p, _)| p as u64 + 1)
        .max()
        .unwrap_or(1);
    Buffers {
        count: pages,
        bytes_each: page,
    }
}

/// Where each cpu-tier shard (`shard_bytes`, `ParamId` order) goes in
/// pages of `page_bytes`: (page, offset) by first fit, each shard in the
/// first page with room at its end, a new page when none has. A shard
/// never straddles a page. Next fit (a new page whenever the next shard
/// did not fit the current one) left a page's tail empty each time: a
/// 7.5 GiB GPT-2 of width 4096 took 12.8 GiB of pinned pages. The param
/// store places its params by this; [`cpu_page_plan`] counts the pages.
pub fn cpu_page_places(shard_bytes: &[u64], page_bytes: u64) -> Vec<(usize, u64)> {
    let mut used: Vec<u64> = Vec::new();
    shard_bytes
        .iter()
        .map(|&b| match used.iter().position(|&u| u + b <= page_bytes) {
            Some(p) => {
                let offset = used[p];
                used[p] += b;
                (p, offset)
            }
            None => {
                used.push(b);
                (used.len() - 1, 0)
            }
        })
        .collect()
}
