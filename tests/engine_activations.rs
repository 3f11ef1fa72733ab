//! The activation policy (`tierzero.activation_budget_bytes`): a block
//! whose forward graph fits the budget keeps it for its backward, the
//! others are recomputed from their saved inputs. Keeping and recomputing
//! give the same bits: every loss and the final weights are identical for
//! every budget, and the budget decides only which blocks are kept (and so
//! how many params backward fetches again).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use engine_support::{assert_identical, tiny_gpt2_dir, tiny_llama_dir, train, Knobs, Run};

const STEPS: u64 = 6;
const SEQ: usize = 16;

fn with_budget(k: &Knobs, budget: u64) -> Knobs {
    Knobs {
        activation_budget: Some(budget),
        ..k.clone()
    }
}

fn kept(r: &Run) -> usize {
    r.activations.as_ref().map_or(0, |d| d.kept())
}

/// Budgets 0 (recompute every block), one block's graph (measured by a
/// run keeping all) and unbounded: the same bits, and 0, 1 and every
/// block kept.
fn check(tag: &str, dir: &std::path::Path, k: &Knobs, blocks: usize) {
    let all = train(dir, &with_budget(k, u64::MAX), 3, STEPS, |_| SEQ);
    let d = all.activations.clone().expect("a decision");
    assert_eq!((d.kept(), d.blocks), (blocks, blocks), "{tag}: all kept");
    let per_block: Vec<u64> = d
        .keep
        .iter()
        .zip(&d.held_bytes)
        .filter(|(k, _)| **k)
        .map(|(_, b)| *b)
        .collect();
    assert!(per_block.iter().all(|&b| b > 0), "{tag}: {per_block:?}");
    let none = train(dir, &with_budget(k, 0), 3, STEPS, |_| SEQ);
    assert_eq!(kept(&none), 0, "{tag}: budget 0 keeps nothing");
    assert!(
        none.activations.is_none(),
        "{tag}: budget 0 measures nothing"
    );
    // The first block's graph fits, the first two do not.
    let one_budget = per_block[0] + per_block[1] / 2;
    let one = train(dir, &with_budget(k, one_budget), 3, STEPS, |_| SEQ);
    assert_eq!(kept(&one), 1, "{tag}: budget {one_budget}");
    // The second block's graph, as large as the first, is not recorded to
    // be measured: that held it beside the first, past the budget.
    let measured = one
        .activations
        .as_ref()
        .map_or(0, |d| d.held_bytes.iter().filter(|b| **b > 0).count());
    assert_eq!(measured, 1, "{tag}: only the kept block was recorded");
    assert_identical(&all, &none, &format!("{tag}: keep all vs recompute all"));
    assert_identical(&one, &none, &format!("{tag}: keep one vs recompute all"));
    // "auto" (half the available memory: every block here).
    let auto = train(dir, k, 3, STEPS, |_| SEQ);
    assert_eq!(kept(&auto), blocks, "{tag}: auto");
    assert_identical(&auto, &none, &format!("{tag}: auto vs recompute all"));
}

#[test]
fn keeping_or_recomputing_gives_the_same_bits_in_memory() {
    let dir = tiny_gpt2_dir("act-stage0", 3, 32);
    check("stage 0 fp32", &dir, &Knobs::default(), 3);
    let bf16 = Knobs {
        precision: "bf16",
        clip: 1.0,
        gas: 2,
        ..Knobs::default()
    };
    check("stage 0 bf16 GA 2 clip", &dir, &bf16, 3);
}

#[test]
fn keeping_or_recomputing_gives_the_same_bits_offloaded() {
    let dir = tiny_gpt2_dir("act-nvme", 3, 32);
    let nvme = Knobs {
        precision: "bf16",
        clip: 1.0,
        gas: 2,
        ..Knobs::nvme()
    };
    check("stage 3 nvme bf16 GA 2 clip", &dir, &nvme, 3);
    let llama = tiny_llama_dir("act-llama");
    let fp16 = Knobs {
        precision: "fp16",
        ..Knobs::cpu()
    };
    check("llama stage 3 cpu fp16", &llama, &fp16, 2);
}

/// A kept block needs no params in backward: with params on NVMe, keeping
/// every block reads fewer param bytes than recomputing every block.
#[test]
fn kept_blocks_are_not_fetched_again_in_backward() {
    let dir = tiny_gpt2_dir("act-reads", 3, 32);
    let k = Knobs::nvme();
    let all = train(&dir, &with_budget(&k, u64::MAX), 3, STEPS, |_| SEQ);
    let none = train(&dir, &with_budget(&k, 0), 3, STEPS, |_| SEQ);
    assert_identical(&all, &none, "reads");
    assert!(
        all.nvme_read_bytes() < none.nvme_read_bytes(),
        "kept {} B read, recomputed {} B",
        all.nvme_read_bytes(),
        none.nvme_read_bytes()
    );
}
