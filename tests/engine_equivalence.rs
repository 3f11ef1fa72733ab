//! THE equivalence test of the engine: the same tiny GPT, data and seed
//! trained (a) at stage 0 with everything in memory and (b) at stage 3 with
//! parameters and optimizer state offloaded (NVMe: pipelined and
//! overlapped; cpu), for 20 steps. Every step's loss and the final sha256
//! of the fp32 masters must be bit-identical. Repeated with gradient
//! accumulation 4, bf16, fp16 dynamic loss scaling and clipping.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use engine_support::{assert_identical, tiny_gpt2_dir, tiny_llama_dir, train, Knobs};

const STEPS: u64 = 20;
const SEQ: usize = 16;

fn pair(tag: &str, base: Knobs, offload: Knobs) {
    let dir = tiny_gpt2_dir(tag, 2, 32);
    let a = train(&dir, &base, 7, STEPS, |_| SEQ);
    let b = train(&dir, &offload, 7, STEPS, |_| SEQ);
    // The run must actually train (losses move) ...
    let first = a.steps[0].loss;
    let last = a.steps.last().unwrap().loss;
    assert!(
        last < first,
        "{tag}: loss did not decrease ({first} -> {last})"
    );
    // ... and the offloaded run must actually use its tier.
    match offload.param {
        "nvme" => assert!(b.nvme_read_bytes() > 0, "{tag}: no NVMe reads"),
        "cpu" => assert!(b.cpu_read_bytes() > 0, "{tag}: no pinned-host reads"),
        _ => {}
    }
    assert_identical(&a, &b, tag);
}

#[test]
fn fp32_stage0_vs_stage3_nvme_pipelined_overlapped() {
    pair("fp32-nvme", Knobs::default(), Knobs::nvme());
}

#[test]
fn overlapped_optimizer_steps_during_backward_and_matches_non_overlapped() {
    let dir = tiny_gpt2_dir("overlap", 2, 32);
    let over = train(&dir, &Knobs::nvme(), 11, 6, |_| SEQ);
    let plain = Knobs {
        overlap: false,
        pipeline: false,
        ..Knobs::nvme()
    };
    let seq = train(&dir, &plain, 11, 6, |_| SEQ);
    // Every sub-group but the embedding's becomes final before backward
    // ends and is handed to the optimizer thread then.
    for s in &over.steps {
        assert!(s.sub_groups_stepped_during_backward > 0);
    }
    for s in &seq.steps {
        assert_eq!(s.sub_groups_stepped_during_backward, 0);
    }
    assert_identical(&over, &seq, "overlapped vs sequential optimizer");
}

#[test]
fn fp32_stage0_vs_stage3_cpu_offload() {
    pair("fp32-cpu", Knobs::default(), Knobs::cpu());
}

#[test]
fn grad_accumulation_4_nvme() {
    let base = Knobs {
        gas: 4,
        ..Knobs::default()
    };
    let off = Knobs {
        gas: 4,
        ..Knobs::nvme()
    };
    pair("gas4-nvme", base, off);
}

#[test]
fn bf16_nvme() {
    let base = Knobs {
        precision: "bf16",
        ..Knobs::default()
    };
    let off = Knobs {
        precision: "bf16",
        ..Knobs::nvme()
    };
    pair("bf16-nvme", base, off);
}

#[test]
fn fp16_dynamic_loss_scaling_nvme_with_skipped_steps() {
    // 2^24 overflows fp16 gradients at first: the first steps are skipped
    // and the scale comes down, in both runs alike.
    let base = Knobs {
        precision: "fp16",
        initial_scale_power: 24,
        ..Knobs::default()
    };
    let off = Knobs {
        precision: "fp16",
        initial_scale_power: 24,
        ..Knobs::nvme()
    };
    let dir = tiny_gpt2_dir("fp16", 2, 32);
    let a = train(&dir, &base, 7, STEPS, |_| SEQ);
    let b = train(&dir, &off, 7, STEPS, |_| SEQ);
    let skipped = a.steps.iter().filter(|s| s.skipped).count();
    assert!(skipped >= 1, "no step overflowed at scale 2^24");
    assert!(skipped < STEPS as usize, "every step overflowed");
    assert!(a.steps.last().unwrap().loss_scale < 2f64.powi(24));
    let sb: Vec<bool> = b.steps.iter().map(|s| s.skipped).collect();
    let sa: Vec<bool> = a.steps.iter().map(|s| s.skipped).collect();
    assert_eq!(sa, sb, "skipped steps differ");
    assert_identical(&a, &b, "fp16-nvme");
}

#[test]
fn clipping_nvme_and_non_overlapped_optimizer() {
    // With clipping the step waits for the global norm (state reads and
    // norms overlap backward); a non-overlapped, non-pipelined run must
    // give the same bits too.
    let base = Knobs {
        clip: 0.05,
        ..Knobs::default()
    };
    let off = Knobs {
        clip: 0.05,
        ..Knobs::nvme()
    };
    let plain = Knobs {
        clip: 0.05,
        overlap: false,
        pipeline: false,
        ..Knobs::nvme()
    };
    let dir = tiny_gpt2_dir("clip", 2, 32);
    let a = train(&dir, &base, 7, STEPS, |_| SEQ);
    let b = train(&dir, &off, 7, STEPS, |_| SEQ);
    let c = train(&dir, &plain, 7, STEPS, |_| SEQ);
    // Clipping is active: some reported norm is above the threshold.
    assert!(a
        .steps
        .iter()
        .any(|s| s.grad_norm.is_some_and(|n| n > 0.05)));
    // The overlapped run spills the final gradients to NVMe (read back at
    // the step): it writes more than the plain run, which holds them.
    let wb = b.nvme_written_bytes();
    let wc = c.nvme_written_bytes();
    assert!(wb > wc, "no gradient spill seen ({wb} vs {wc} bytes)");
    assert_identical(&a, &b, "clip overlapped");
    assert_identical(&a, &c, "clip non-overlapped");
}

#[test]
fn resident_optimizer_groups_change_the_bytes_not_the_bits() {
    // `tierzero.optimizer_resident_bytes`: none (every sub-group's state
    // on NVMe), some (the first three sub-groups: 8192 + 1088 + 3072
    // elements × 12 bytes fit 150 000) and all of it. (Auto keeps at most a
    // quarter of the state, less than this model's first group.) With
    // clipping, so resident groups also take the gradient-spill path
    // (their spilled gradient stays in memory).
    let dir = tiny_gpt2_dir("resident", 2, 32);
    let base = Knobs {
        clip: 0.05,
        ..Knobs::default()
    };
    // A prefetch bucket that covers the whole model, so every sub-group
    // holds params of "the first units" and all can be resident.
    let nvme = |resident: Option<u64>| Knobs {
        clip: 0.05,
        optimizer_resident_bytes: resident,
        prefetch_bucket: 50_000,
        max_live: 200_000,
        ..Knobs::nvme()
    };
    let a = train(&dir, &base, 7, STEPS, |_| SEQ);
    let none = train(&dir, &nvme(Some(0)), 7, STEPS, |_| SEQ);
    let some = train(&dir, &nvme(Some(150_000)), 7, STEPS, |_| SEQ);
    let all = train(&dir, &nvme(Some(1 << 30)), 7, STEPS, |_| SEQ);
    assert_identical(&a, &none, "no resident groups");
    assert_identical(&a, &some, "some resident groups");
    assert_identical(&a, &all, "all groups resident");
    // Resident groups are never read or written: some move fewer bytes
    // than none, and with every group resident only params (and nothing of
    // the optimizer) touch NVMe.
    let (rn, rs, rl) = (
        none.nvme_read_bytes(),
        some.nvme_read_bytes(),
        all.nvme_read_bytes(),
    );
    let (wn, ws, wl) = (
        none.nvme_written_bytes(),
        some.nvme_written_bytes(),
        all.nvme_written_bytes(),
    );
    assert!(rn > rs && rs > rl, "reads: none {rn}, some {rs}, all {rl}");
    assert!(wn > ws && ws > wl, "writes: none {wn}, some {ws}, all {wl}");
    let params_only = train(
        &dir,
        &Knobs {
            clip: 0.05,
            optim: "cpu",
            prefetch_bucket: 50_000,
            max_live: 200_000,
            ..Knobs::nvme()
        },
        7,
        STEPS,
        |_| SEQ,
    );
    assert_eq!(rl, params_only.nvme_read_bytes(), "all resident: reads");
    assert_eq!(wl, params_only.nvme_written_bytes(), "all resident: writes");
}

#[test]
fn hash_depends_on_the_weights() {
    // Guard against a hash that ignores its input: another seed differs.
    let dir = tiny_gpt2_dir("seed", 2, 32);
    let a = train(&dir, &Knobs::default(), 7, 2, |_| SEQ);
    let b = train(&dir, &Knobs::default(), 8, 2, |_| SEQ);
    assert_ne!(a.sha256, b.sha256);
    assert_eq!(a.sha256.len(), 64);
}

#[test]
fn llama_bf16_nvme_with_persistent_small_params() {
    // Norm weights (32 elements) are below the persistence threshold and
    // stay resident; everything else streams from NVMe.
    let dir = tiny_llama_dir("eq");
    let base = Knobs {
        precision: "bf16",
        ..Knobs::default()
    };
    let off = Knobs {
        precision: "bf16",
        persistence: 100,
        ..Knobs::nvme()
    };
    let a = train(&dir, &base, 5, 10, |_| SEQ);
    let b = train(&dir, &off, 5, 10, |_| SEQ);
    assert!(b.nvme_read_bytes() > 0);
    assert!(a.steps.last().unwrap().loss < a.steps[0].loss);
    assert_identical(&a, &b, "llama bf16 nvme");
}

#[test]
fn nvme_with_max_in_cpu_cache_splits_params_over_two_tiers() {
    // The first 10000 elements of params (ParamId order: wte 8192, wpe
    // 1024, ...) stay in pinned host memory, the rest go to NVMe.
    let dir = tiny_gpt2_dir("maxincpu", 2, 32);
    let off = Knobs {
        max_in_cpu: 10_000,
        ..Knobs::nvme()
    };
    let a = train(&dir, &Knobs::default(), 9, 8, |_| SEQ);
    let b = train(&dir, &off, 9, 8, |_| SEQ);
    assert!(b.cpu_read_bytes() > 0, "nothing served from the host cache");
    assert!(b.nvme_read_bytes() > 0, "nothing served from NVMe");
    assert_identical(&a, &b, "max_in_cpu");
}

#[test]
fn tiling_a_param_larger_than_a_sub_group_changes_no_bit() {
    // wte (256 x 32 = 8192 elements) is tiled over three sub-groups of at
    // most 3000, and over none at 1e6. Adam is element-wise, so without
    // clipping (whose global norm sums per-group partial sums) the weights
    // are the same bits; the tiled run's params are assembled from pieces.
    let dir = tiny_gpt2_dir("tiling", 2, 32);
    for precision in ["fp32", "bf16"] {
        let tiled = Knobs {
            precision,
            gas: 2,
            ..Knobs::nvme()
        };
        let whole = Knobs {
            sub_group: 1_000_000,
            ..tiled.clone()
        };
        let a = train(&dir, &tiled, 5, 6, |_| SEQ);
        let b = train(&dir, &whole, 5, 6, |_| SEQ);
        assert_identical(&a, &b, &format!("tiling {precision}"));
    }
}

/// bf16 gradients held as they came (one each: one rank, gas 1, a param
/// of one unit; [`tierzero::engine::sizing::grad_sum_dtype`]) train the
/// same bits as fp32 sums of them: params and optimizer in host memory
/// with clipping (the norm and the step read the bf16), and without
/// (each group stepped during backward); on NVMe with clipping, their
/// gradients spilled in bf16 (half the bytes written and read), or kept
/// in bf16 for a speculative step's re-step; with spares at every size. The GPT-2's tied wte keeps
/// its sub-groups' fp32 sums (its gradients add over two units), so a
/// run holds both.
#[test]
fn bf16_gradients_held_as_they_came_change_no_bit() {
    use engine_support::{build_with, train_with};
    use tierzero::engine::sizing::SumDtype;
    use tierzero::engine::TrainerOptions;
    let dir = tiny_gpt2_dir("bf16-sums", 2, 32);
    let bf16 = Knobs {
        precision: "bf16",
        ..Knobs::cpu()
    };
    let cases = [
        (
            "cpu clip",
            Knobs {
                clip: 0.5,
                ..bf16.clone()
            },
            None,
        ),
        ("cpu no clip", bf16.clone(), None),
        (
            "cpu clip, spares",
            Knobs {
                clip: 0.5,
                ..bf16.clone()
            },
            Some(0),
        ),
        (
            "nvme clip spilled",
            Knobs {
                clip: 0.5,
                precision: "bf16",
                speculative: Some(false),
                ..Knobs::nvme()
            },
            None,
        ),
        (
            "nvme clip speculative",
            Knobs {
                clip: 0.5,
                precision: "bf16",
                speculative: Some(true),
                ..Knobs::nvme()
            },
            None,
        ),
    ];
    for (tag, k, spare_min) in cases {
        let mut f32_opts = TrainerOptions::cpu(9, SEQ);
        f32_opts.f32_grad_sums = true;
        f32_opts.spare_sum_min_bytes = spare_min;
        let mut opts = TrainerOptions::cpu(9, SEQ);
        opts.spare_sum_min_bytes = spare_min;
        let t = build_with(&dir, &k, opts.clone(), 6);
        let dtypes = t.grad_sum_dtypes().to_vec();
        drop(t);
        assert!(
            dtypes.contains(&SumDtype::Bf16) && dtypes.contains(&SumDtype::F32),
            "{tag}: {dtypes:?}"
        );
        let sums = train_with(&dir, &k, f32_opts, 6, |_| SEQ);
        let held = train_with(&dir, &k, opts, 6, |_| SEQ);
        assert_identical(&sums, &held, tag);
        if tag.contains("spilled") {
            // Spilled as held: the bf16 groups' gradients are half the
            // bytes written and read back.
            let (w, r) = (held.nvme_written_bytes(), held.nvme_read_bytes());
            let (w32, r32) = (sums.nvme_written_bytes(), sums.nvme_read_bytes());
            assert!(
                w < w32 && r < r32,
                "{tag}: written {w} vs {w32}, read {r} vs {r32}"
            );
        }
    }
    // fp32 sums where an element gets several gradients: gas 2, fp32.
    for (tag, k) in [
        (
            "gas 2",
            Knobs {
                gas: 2,
                ..bf16.clone()
            },
        ),
        ("fp32", Knobs::cpu()),
    ] {
        let t = build_with(&dir, &k, TrainerOptions::cpu(9, SEQ), 6);
        assert!(
            t.grad_sum_dtypes().iter().all(|d| *d == SumDtype::F32),
            "{tag}"
        );
    }
}

/// Gradient sums made from the last step's spares at every size (each
/// piece's first gradient set into the spare's stale values, what no piece
/// wrote zeroed when the sum is read) train the same bits as new zeroed
/// sums: params and optimizer in host memory with clipping, at gas 1 and
/// 2 (the sums stay in memory between micro-batches); on NVMe at gas 2
/// (sums parked between micro-batches) in bf16 with speculation. The
/// GPT-2's wte, tied to the head, comes through the reduce path and is
/// tiled over three sub-groups.
#[test]
fn spare_gradient_sums_at_every_size_change_no_bit() {
    use engine_support::train_with;
    use tierzero::engine::TrainerOptions;
    let dir = tiny_gpt2_dir("spare-sums", 2, 32);
    let cases = [
        (
            "cpu clip gas1",
            Knobs {
                clip: 0.5,
                ..Knobs::cpu()
            },
        ),
        (
            "cpu clip gas2",
            Knobs {
                clip: 0.5,
                gas: 2,
                ..Knobs::cpu()
            },
        ),
        (
            "nvme bf16 clip gas2",
            Knobs {
                clip: 0.5,
                gas: 2,
                precision: "bf16",
                ..Knobs::nvme()
            },
        ),
    ];
    for (tag, k) in cases {
        let fresh = train(&dir, &k, 9, 6, |_| SEQ);
        let mut opts = TrainerOptions::cpu(9, SEQ);
        opts.spare_sum_min_bytes = Some(0);
        let spared = train_with(&dir, &k, opts, 6, |_| SEQ);
        assert_identical(&fresh, &spared, tag);
    }
}
