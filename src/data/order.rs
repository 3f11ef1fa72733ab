//! The order a pass reads its windows in: file order, or a seeded
//! shuffle that is another one every pass.
//!
//! # Why and how
//!
//! A corpus made of concatenated sources (a code file after a novel after
//! a chat log) read in file order gives each step's batch one source, and
//! the loss curve the sources' order. HF's Trainer and DeepSpeed's data
//! loader (`DistributedSampler(shuffle=True)`) shuffle the samples every
//! epoch with a seeded permutation; so does tierzero by default
//! ([`DataOrder::Shuffled`]), with the windows of a pass (see "Windows" in
//! the module docs of [`crate::data`]) as the samples.
//!
//! A pass of at most [`SMALL_PASS`] windows is shuffled by Fisher–Yates
//! with a seeded stream, recomputed for each sample (at most 63 swaps): a
//! Feistel network on so few bits makes only some permutations (on 4-bit
//! halves, only even permutations of 16 values), and cycle walking maps
//! them unevenly onto `0..W` (a review measured χ²/df 6.7 over the
//! permutations of 5 windows). Larger passes: the permutation is a Feistel network on the
//! smallest even number of bits that holds `W − 1`, keyed by the seed and
//! the pass, walked until it lands below `W` (cycle walking: the network
//! permutes its `2^bits` values, so following it from a value below `W`
//! reaches the next value below `W` on the same cycle, and the walk from
//! each of the `W` values lands on a distinct one). The domain is at most
//! four times `W`, so a walk takes fewer than four rounds of the network
//! on average. Nothing is stored: sample `s`'s window is computed from
//! `s`, so memory is O(1) whatever the corpus, and a resume needs only
//! the sample count and the order, which the checkpoint records
//! ([`crate::checkpoint::DataPosition`]).
//!
//! Within a pass every window is read exactly once, as in file order; the
//! pass's offset (which tokens a pass leaves out) is the same in both
//! orders. Samples of one read (a micro-batch) that span two passes may
//! hold the same window twice (or, where the passes' offsets differ, two
//! windows a few tokens apart): as an epoch's last batch and the next
//! one's first may. With `W` windows a pass it happens at most once a pass,
//! to about `rows² / W` rows. Ranks read disjoint samples of the global order, so the data of
//! a step does not depend on the rank count. The order is a pure function
//! of `(seed, pass, W)`, not of the platform: the arithmetic is `u64`
//! wrapping multiplications and shifts.

use serde::{Deserialize, Serialize};

/// The order the windows of each pass are read in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataOrder {
    /// File order: sample `s` is window `s mod W` of its pass.
    Sequential,
    /// Each pass's windows in a pseudo-random order of `seed` and the
    /// pass (another one every pass).
    Shuffled {
        /// The shuffle's seed.
        seed: u64,
    },
}

impl DataOrder {
    /// The window (`0..per_pass`) that the `k`-th sample of pass `pass`
    /// reads (`k < per_pass`).
    pub fn window(self, pass: u64, k: u64, per_pass: u64) -> u64 {
        debug_assert!(k < per_pass);
        match self {
            DataOrder::Sequential => k,
            DataOrder::Shuffled { seed } => permute(k, per_pass, pass_key(seed, pass)),
        }
    }

    /// How the order is named in a checkpoint's config fingerprint and in
    /// the run's plan: `in file order` or `shuffled each pass (seed N)`.
    pub fn describe(self) -> String {
        match self {
            DataOrder::Sequential => "in file order".to_owned(),
            DataOrder::Shuffled { seed } => format!("shuffled each pass (seed {seed})"),
        }
    }
}

/// The most windows a pass may have to be shuffled by Fisher–Yates (see
/// the module docs).
pub const SMALL_PASS: u64 = 64;

/// Rounds of the Feistel network: enough for the order to look random
/// to a training run (each output bit depends on every input bit after
/// three; six is twice that).
const ROUNDS: u64 = 6;

/// splitmix64's finaliser: a bijective mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of one pass's permutation.
fn pass_key(seed: u64, pass: u64) -> u64 {
    mix(mix(seed ^ 0x7469_6572_7a65_726f) ^ pass)
}

/// `k`'s image under the seeded permutation of `0..n` (`k < n`).
fn permute(k: u64, n: u64, key: u64) -> u64 {
    if n <= 1 {
        return k;
    }
    if n <= SMALL_PASS {
        return small_permute(k, n, key);
    }
    // The fewest bits that hold n - 1, rounded up to even: 2·half ≤ 64.
    let bits = u64::BITS - (n - 1).leading_zeros();
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let mut x = k;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..ROUNDS {
            let f = mix(r ^ mix(key.wrapping_add(round))) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}

/// `k`'s image under a seeded Fisher–Yates shuffle of `0..n`
/// (`1 < n <= SMALL_PASS`, `k < n`). The draw `x mod (i + 1)` of a 64-bit
/// `x` is biased by under 2^-57.
fn small_permute(k: u64, n: u64, key: u64) -> u64 {
    let mut order = [0u8; SMALL_PASS as usize];
    let n = n as usize;
    for (i, o) in order.iter_mut().enumerate().take(n) {
        *o = i as u8;
    }
    let mut state = key;
    for i in (1..n).rev() {
        state = mix(state.wrapping_add(0x9e37_79b9_7f4a_7c15));
        let j = (state % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    u64::from(order[k as usize])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use proptest::prelude::*;

    fn images(n: u64, key: u64) -> Vec<u64> {
        (0..n).map(|k| permute(k, n, key)).collect()
    }

    proptest! {
        /// A permutation of `0..n` for every size and key: every window
        /// read once per pass.
        #[test]
        fn every_window_once_per_pass(n in 1u64..3000, key: u64) {
            let mut seen = images(n, key);
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn awkward_sizes_are_permutations() {
        // Powers of two and their neighbours: where the bit count and the
        // cycle walk's domain change.
        for n in [
            2u64, 3, 4, 5, 7, 8, 9, 15, 16, 17, 255, 256, 257, 4095, 4096, 4097,
        ] {
            for key in [0, 1, u64::MAX] {
                let mut seen = images(n, key);
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n {n} key {key}");
            }
        }
        // The largest sizes: the network on 64 bits, values near u64::MAX.
        for n in [u64::MAX, (1 << 63) + 1, 1 << 62] {
            for k in [0, 1, n / 2, n - 1] {
                assert!(permute(k, n, 7) < n);
            }
        }
    }

    #[test]
    fn shuffled_passes_differ_from_file_order_and_each_other() {
        let n = 1000;
        let order = DataOrder::Shuffled { seed: 1 };
        let pass = |p: u64| -> Vec<u64> { (0..n).map(|k| order.window(p, k, n)).collect() };
        let (p0, p1) = (pass(0), pass(1));
        let fixed = |v: &[u64]| {
            v.iter()
                .enumerate()
                .filter(|(i, w)| *i as u64 == **w)
                .count()
        };
        // A random permutation of 1000 has one fixed point on average.
        assert!(fixed(&p0) < 10, "{} windows in place", fixed(&p0));
        assert!(p0.iter().zip(&p1).filter(|(a, b)| a == b).count() < 10);
        // Neighbouring samples are not neighbouring windows.
        let near = p0.windows(2).filter(|w| w[0].abs_diff(w[1]) <= 2).count();
        assert!(near < 20, "{near} neighbouring pairs");
        // The seed decides it; file order is the identity.
        let other: Vec<u64> = (0..n)
            .map(|k| DataOrder::Shuffled { seed: 2 }.window(0, k, n))
            .collect();
        assert_ne!(p0, other);
        assert_eq!(p0, pass(0));
        assert!((0..n).all(|k| DataOrder::Sequential.window(5, k, n) == k));
    }

    /// Small passes: every permutation about equally likely (120 of 5
    /// windows, over 24000 keys: 200 each; a χ² of 119 degrees of freedom
    /// is above 180 with a probability under 0.03%).
    #[test]
    fn small_passes_draw_every_permutation_alike() {
        let mut counts = std::collections::HashMap::new();
        let keys = 24_000u64;
        for key in 0..keys {
            let p: Vec<u64> = (0..5).map(|k| permute(k, 5, pass_key(1, key))).collect();
            *counts.entry(p).or_insert(0u64) += 1;
        }
        assert_eq!(counts.len(), 120);
        let want = keys as f64 / 120.0;
        let chi2: f64 = counts
            .values()
            .map(|&c| (c as f64 - want).powi(2) / want)
            .sum();
        assert!(chi2 < 180.0, "χ² {chi2}");
    }

    #[test]
    fn the_order_is_pinned() {
        // A change of the permutation changes every resumed run's data:
        // it must come with a new name in the fingerprint.
        let order = DataOrder::Shuffled { seed: 1 };
        let small: Vec<u64> = (0..8).map(|k| order.window(0, k, 10)).collect();
        assert_eq!(small, [2, 9, 4, 0, 3, 7, 6, 8]);
        let large: Vec<u64> = (0..4).map(|k| order.window(3, k, 1000)).collect();
        assert_eq!(large, [560, 378, 466, 149]);
    }

    #[test]
    fn serialized_as_the_manifest_keeps_it() {
        for o in [DataOrder::Sequential, DataOrder::Shuffled { seed: 9 }] {
            let text = serde_json::to_string(&o).unwrap();
            assert_eq!(serde_json::from_str::<DataOrder>(&text).unwrap(), o);
        }
        assert_eq!(
            serde_json::to_string(&DataOrder::Shuffled { seed: 9 }).unwrap(),
            r#"{"shuffled":{"seed":9}}"#
        );
    }
}
