//! `tierzero::run::Plan` against the engine: the plan prints the sizing the
//! trainer was built with, its pinned total is the bytes the arenas mapped
//! (for many configs), that total is exactly what the engine needs (a
//! budget of that size starts with every param slot, one byte less costs a
//! slot, down to `buffer_count` of them, and below that it is refused), and
//! the NVMe and tier numbers follow the layout.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::data::TokenData;
use tierzero::engine::{EngineError, Trainer, TrainerOptions};
use tierzero::model::ModelDir;
use tierzero::run::Plan;

mod cli_support;

fn scratch(tag: &str) -> PathBuf {
    let d = cli_support::scratch("run-plan", tag);
    std::fs::create_dir_all(d.join("model")).unwrap();
    std::fs::create_dir_all(d.join("swap")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    d
}

fn ds(d: &Path, clip: bool, budget: Option<u64>) -> Value {
    let swap = d.join("swap");
    let mut v = json!({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap, "buffer_count": 4,
                "buffer_size": 20000, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap,
                "pipeline_read": true, "pipeline_write": true},
            "sub_group_size": 10000,
            "stage3_param_persistence_threshold": 0
        },
        "tierzero": {"checksums": false}
    });
    // Written either way: absent is DeepSpeed's default, 1.0.
    v["gradient_clipping"] = json!(if clip { 1.0 } else { 0.0 });
    if let Some(b) = budget {
        v["tierzero"]["pinned_budget_bytes"] = json!(b);
    }
    v
}

fn trainer(d: &Path, cfg: &Value) -> Result<Trainer, EngineError> {
    let run = RunContext {
        path_checks: PathChecks::Check,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let md = ModelDir::open(d.join("model"), 1).unwrap();
    let text = "tiers of bytes: device, pinned host memory and nvme. ".repeat(20);
    let data = TokenData::from_bytes(text.as_bytes(), Path::new("<text>"));
    Trainer::new(&loaded.config, &md, data, TrainerOptions::cpu(1, 16))
}

fn plan_of(d: &Path, cfg: &Value) -> Plan {
    let run = RunContext {
        path_checks: PathChecks::Check,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let t = trainer(d, cfg).unwrap();
    Plan::new(
        &loaded.config,
        t.model(),
        t.layout(),
        t.sizing(),
        "cpu".into(),
    )
}

/// The plan's pinned total is the bytes the trainer's arenas mapped, and
/// its buffer counts are the arenas' (odd `buffer_size`, `buffer_count`
/// below what the pipeline needs and above it, clipping, GA > 1, params
/// and optimizer on cpu or nvme, a pinned budget that caps the buffers).
#[test]
fn plan_pinned_total_is_what_the_arenas_mapped() {
    let d = scratch("mapped");
    let swap = d.join("swap");
    let nvme = json!({"device": "nvme", "nvme_path": swap});
    let cases: Vec<(&str, Value)> = vec![
        ("as ds()", json!({})),
        (
            "odd buffer_size, buffer_count 1",
            json!({"zero_optimization": {"offload_param": {"buffer_size": 19_999, "buffer_count": 1}}}),
        ),
        (
            "optimizer buffer_count below the pipeline",
            json!({"zero_optimization": {"offload_optimizer": {"buffer_count": 4}}}),
        ),
        (
            "optimizer buffer_count above the pipeline",
            json!({"zero_optimization": {"offload_optimizer": {"buffer_count": 17}}}),
        ),
        ("clipping", json!({"gradient_clipping": 1.0})),
        (
            "clipping, GA 3, no pipelining",
            json!({"gradient_clipping": 1.0, "gradient_accumulation_steps": 3,
                   "zero_optimization": {"offload_optimizer": {"pipeline_read": false, "pipeline_write": false}}}),
        ),
        (
            "params on cpu",
            json!({"zero_optimization": {"offload_param": {"device": "cpu"}}}),
        ),
        (
            "params partly in cpu (max_in_cpu)",
            json!({"zero_optimization": {"offload_param": {"max_in_cpu": 9_000}}}),
        ),
        (
            "optimizer on cpu, params on nvme",
            json!({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
        ),
        (
            "nothing offloaded",
            json!({"zero_optimization": {"offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}}}),
        ),
        (
            "unpinned nvme buffers",
            json!({"zero_optimization": {"offload_param": nvme.clone(), "offload_optimizer": {"pin_memory": false}}}),
        ),
        (
            "a budget that caps the optimizer buffers",
            json!({"zero_optimization": {"offload_optimizer": {"buffer_count": 40}},
                   "tierzero": {"pinned_budget_bytes": 4 * align(20_000 * 4) + 10 * align(10_000 * 4) + 100}}),
        ),
    ];
    let mut seen_counts = std::collections::BTreeSet::new();
    for (name, patch) in cases {
        let mut cfg = ds(&d, false, None);
        merge(&mut cfg, &patch);
        let run = RunContext {
            path_checks: PathChecks::Check,
            ..RunContext::default()
        };
        let loaded = load_str(&cfg.to_string(), &run).unwrap();
        let t = trainer(&d, &cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
        let plan = Plan::new(
            &loaded.config,
            t.model(),
            t.layout(),
            t.sizing(),
            "cpu".into(),
        );
        assert_eq!(
            plan.pinned_total_bytes(),
            t.pinned_mapped_bytes(),
            "{name}: plan {plan:?}"
        );
        assert_eq!(
            plan.optimizer_buffers.0 * plan.optimizer_buffers.1,
            t.swap_usage().optimizer_buffers_bytes,
            "{name}"
        );
        seen_counts.insert((plan.param_buffers, plan.optimizer_buffers));
        drop(t);
    }
    // The cases really differ in what they map.
    assert!(seen_counts.len() >= 6, "{seen_counts:?}");
}

/// `patch` merged into `v`, objects key by key.
fn merge(v: &mut Value, patch: &Value) {
    match (v, patch) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, pv) in b {
                merge(a.entry(k.clone()).or_insert(Value::Null), pv);
            }
        }
        (slot, p) => *slot = p.clone(),
    }
}

fn align(b: u64) -> u64 {
    b.div_ceil(4096) * 4096
}

#[test]
fn plan_pinned_bytes_are_exactly_what_the_engine_needs() {
    for clip in [false, true] {
        let d = scratch("budget");
        let plan = plan_of(&d, &ds(&d, clip, None));
        // Every param is on NVMe; nothing in cpu-tier pages.
        assert_eq!(plan.params_per_tier[0] + plan.params_per_tier[1], 0);
        assert_eq!(plan.params.pinned_bytes, 0);
        // 4 configured buffers of 20,000 fp32 elements, cut into slots of
        // the largest shard: as many as fit in each.
        let largest = {
            let t = trainer(&d, &ds(&d, clip, None)).unwrap();
            let l = t.layout().params.iter().map(|p| p.shard_numel as u64).max();
            align(l.unwrap() * 4)
        };
        assert!(largest < align(20000 * 4));
        assert_eq!(
            plan.param_buffers,
            (4 * (align(20000 * 4) / largest), largest)
        );
        assert_eq!(plan.spill_grads, clip);
        // The first read_ahead + 1 = 2 NVMe sub-groups are read while
        // backward runs; their gradients are held, not spilled, and so are
        // those of the resident groups before them (auto keeps one: the
        // first units' group, state within one prefetch bucket's).
        let resident = {
            let t = trainer(&d, &ds(&d, clip, None)).unwrap();
            t.sizing().resident_groups.clone()
        };
        assert_eq!(resident.iter().filter(|r| **r).count(), 1, "{resident:?}");
        let first_nvme = resident.iter().position(|r| !r).unwrap();
        let held = resident
            .iter()
            .enumerate()
            .filter(|(_, r)| !**r)
            .nth(1)
            .map(|(i, _)| i + 1)
            .unwrap();
        assert!(held >= 2 && held > first_nvme);
        assert_eq!(plan.held_sub_groups, if clip { held } else { 0 });
        if clip {
            let text = plan.to_string();
            assert!(
                text.contains(&format!("grads (fp32; spilled but first {held} held)")),
                "{text}"
            );
        }
        // 3 states (4 with spilled grads) x (1 + read ahead + write behind).
        assert_eq!(plan.optimizer_buffers.0, if clip { 12 } else { 9 });
        let exact = plan.pinned_total_bytes();
        // The engine starts with exactly that budget and all its slots.
        let fits = ds(&d, clip, Some(exact));
        let with_budget = plan_of(&d, &fits);
        assert_eq!(with_budget.optimizer_buffers, plan.optimizer_buffers);
        assert_eq!(with_budget.param_buffers, plan.param_buffers);
        assert_eq!(with_budget.pinned_budget_bytes, Some(exact));
        // One byte less costs one param slot (the slots are a speed-up),
        // and so on down to offload_param.buffer_count = 4 of them; one
        // byte below that least is refused, naming it.
        let (slots, slot_bytes) = plan.param_buffers;
        let cut = plan_of(&d, &ds(&d, clip, Some(exact - 1)));
        assert_eq!(cut.param_buffers, (slots - 1, slot_bytes));
        assert_eq!(cut.optimizer_buffers, plan.optimizer_buffers);
        let least = exact - (slots - 4) * slot_bytes;
        let at_least = plan_of(&d, &ds(&d, clip, Some(least)));
        assert_eq!(at_least.param_buffers, (4, slot_bytes));
        assert!(trainer(&d, &ds(&d, clip, Some(least))).is_ok());
        match trainer(&d, &ds(&d, clip, Some(least - 1))) {
            Err(EngineError::PinnedBudget { required_bytes, .. }) => {
                assert_eq!(required_bytes, least);
            }
            other => panic!("clip {clip}: expected a pinned-budget error, got {other:?}"),
        }
    }
}

#[test]
fn plan_nvme_bytes_follow_the_layout() {
    let d = scratch("nvme");
    let cfg = ds(&d, true, None);
    let t = trainer(&d, &cfg).unwrap();
    let plan = plan_of(&d, &cfg);
    let params: u64 = t
        .layout()
        .params
        .iter()
        .map(|p| align(p.shard_numel as u64 * 4))
        .sum();
    // The groups whose state is on NVMe: all but the resident ones.
    let resident = &t.sizing().resident_groups;
    assert_eq!(resident.len(), t.layout().sub_groups.len());
    let nvme: Vec<u64> = t
        .layout()
        .sub_groups
        .iter()
        .zip(resident)
        .filter(|(_, r)| !**r)
        .map(|(g, _)| align(g.numel as u64 * 4))
        .collect();
    assert!(nvme.len() < resident.len(), "auto keeps a group resident");
    let groups: u64 = nvme.iter().sum();
    assert_eq!(plan.params.nvme_bytes, params);
    // Clipping with NVMe state speculates: auto, with the disk's room, a
    // pool slot for every NVMe group, each three extents of the largest
    // group; the pipeline's depth (read-ahead 1, write-behind 1, the step:
    // 3) of their gradients kept in memory.
    assert!(t.sizing().speculative);
    let slots = nvme.len();
    assert_eq!(t.sizing().speculation_slots, slots);
    assert_eq!(t.sizing().speculation_kept_grads, 3.min(slots));
    let largest = *nvme.iter().max().unwrap();
    let pool = slots as u64 * 3 * largest;
    assert_eq!(plan.speculation_pool, (slots, pool));
    assert_eq!(plan.speculation_pool_all, (nvme.len(), pool));
    assert!(
        plan.to_string()
            .contains("; every NVMe sub-group), committed"),
        "{plan}"
    );
    // A pool of one slot (what one slot's bytes buy): the plan names the
    // bytes that would give every NVMe group one, and they do.
    let mut one = cfg.clone();
    one["tierzero"]["speculation_pool_bytes"] = json!(3 * largest);
    let plan_one = plan_of(&d, &one);
    assert_eq!(plan_one.speculation_pool.0, 1);
    assert!(nvme.len() > 1);
    let all_bytes = nvme.len() as u64 * 3 * largest;
    assert_eq!(plan_one.speculation_pool_all, (nvme.len(), all_bytes));
    let text = plan_one.to_string();
    assert!(
        text.contains(&format!("1 of {} NVMe sub-groups speculate (", nvme.len()))
            && text.contains(&format!("tierzero.speculation_pool_bytes {all_bytes} (")),
        "{text}"
    );
    one["tierzero"]["speculation_pool_bytes"] = json!(all_bytes);
    let t1 = trainer(&d, &one).unwrap();
    assert_eq!(t1.sizing().speculation_slots, nvme.len());
    drop(t1);
    one["tierzero"]["speculation_pool_bytes"] = json!(all_bytes - 1);
    let t2 = trainer(&d, &one).unwrap();
    assert_eq!(t2.sizing().speculation_slots, nvme.len() - 1);
    drop(t2);
    assert_eq!(plan.optimizer.nvme_bytes, 3 * groups + pool);
    assert_eq!(plan.grads.nvme_bytes, groups);
    // And the two swap files' alignment room (params', optimizer's).
    assert_eq!(plan.swap_slack_bytes, 2 << 20);
    assert_eq!(
        plan.nvme_total_bytes(),
        params + 4 * groups + pool + plan.swap_slack_bytes
    );
    assert_eq!(plan.params_numel, t.model().numel() as u64);
    let text = plan.to_string();
    assert!(
        text.contains("NVMe swap: params, spilled gradients and optimizer state in"),
        "{text}"
    );
}

#[test]
fn plan_and_engine_agree_on_resident_optimizer_groups() {
    for clip in [false, true] {
        let d = scratch("resident");
        let mut cfg = ds(&d, clip, None);
        let t = trainer(&d, &cfg).unwrap();
        let groups: Vec<u64> = t
            .layout()
            .sub_groups
            .iter()
            .map(|g| g.numel as u64)
            .collect();
        drop(t);
        // Exactly the first sub-group's state (it holds the embedding, the
        // first unit's param); one byte less keeps nothing resident.
        for (budget, resident) in [(12 * groups[0], 1), (12 * groups[0] - 1, 0)] {
            cfg["tierzero"]["optimizer_resident_bytes"] = json!(budget);
            let plan = plan_of(&d, &cfg);
            assert_eq!(plan.resident_sub_groups, resident, "budget {budget}");
            let on_nvme: u64 = groups[resident..].iter().map(|&n| align(n * 4)).sum();
            let in_host: u64 = groups[..resident].iter().map(|&n| n * 12).sum();
            // With clipping, speculation keeps a pool slot for every NVMe
            // group (auto, with the disk's room), each three extents of
            // the largest NVMe group.
            let largest = groups[resident..]
                .iter()
                .map(|&n| align(n * 4))
                .max()
                .unwrap();
            let slots = (groups.len() - resident) as u64;
            let pool = if clip { slots * 3 * largest } else { 0 };
            assert_eq!(plan.optimizer.nvme_bytes, 3 * on_nvme + pool);
            assert_eq!(plan.optimizer.host_bytes, in_host);
            assert_eq!(plan.grads.nvme_bytes, if clip { on_nvme } else { 0 });
            // The read-ahead's two NVMe groups hold their gradients, and so
            // does a resident group before them.
            assert_eq!(
                plan.held_sub_groups,
                if clip { 2 + resident } else { 0 },
                "budget {budget}"
            );
            // The engine allocates exactly the NVMe bytes the plan shows
            // (its files are that and their alignment room).
            let t = trainer(&d, &cfg).unwrap();
            assert_eq!(
                t.swap_usage().allocated_bytes,
                plan.nvme_total_bytes() - plan.swap_slack_bytes
            );
            drop(t);
            let text = plan.to_string();
            assert_eq!(
                text.contains("optimizer state (1 group resident)"),
                resident == 1,
                "{text}"
            );
        }
    }
}

/// The auto speculation pool within a known free space: at most what half
/// the room left by the run's other extents buys, at least the pipeline's
/// depth; a byte count is taken as it is.
#[test]
fn the_auto_pool_takes_at_most_half_the_free_space() {
    use tierzero::engine::sizing::{decide_within, Shape};
    let d = scratch("room");
    let mut cfg = ds(&d, true, None);
    cfg["zero_optimization"]["sub_group_size"] = json!(2000);
    let t = trainer(&d, &cfg).unwrap();
    let run = RunContext {
        path_checks: PathChecks::Check,
        ..RunContext::default()
    };
    let config = load_str(&cfg.to_string(), &run).unwrap().config;
    let shape = Shape::of(&config, t.model(), t.layout());
    let full = decide_within(&config, &shape, None).unwrap();
    let groups = full.speculation_slots;
    assert!(groups > 5, "{groups} NVMe groups");
    let slot = full.speculation_pool_nvme_bytes / groups as u64;
    // What the run's swap spaces in the state's directory take without
    // the pool: their payloads and each one's alignment room.
    let dir = config.zero.offload_optimizer.device.nvme_path().unwrap();
    let others = full.swap_bytes_under(&config, dir) - full.speculation_pool_nvme_bytes;
    let payloads = full.param_nvme_bytes
        + full.optimizer_nvme_bytes
        + full.grad_spill_nvme_bytes
        + full.grad_park_nvme_bytes
        - full.speculation_pool_nvme_bytes;
    assert!(others > payloads, "{others} {payloads}");
    // Whatever the free space, a run whose state fits it without the pool
    // fits it with the pool auto gives (the pool once left out the swap
    // files' alignment room: on a disk with room for the state and the
    // least pool's payload but not both with that room, the run was
    // refused by the disk check its state alone passed).
    // And the pool takes at most half the room, the rest left for
    // checkpoints (a least pool raised to all of it left a save on that
    // disk no space).
    for avail in (others..others + 8 * slot).step_by(slot as usize / 7) {
        let s = decide_within(&config, &shape, Some(avail)).unwrap();
        let pool = s.swap_bytes_under(&config, dir) - others;
        assert!(
            others + pool <= avail && pool <= (avail - others) / 2,
            "{avail}: {} slots",
            s.speculation_slots
        );
    }
    let slots = |avail: u64| {
        decide_within(&config, &shape, Some(avail))
            .unwrap()
            .speculation_slots
    };
    assert_eq!(slots(others + 2 * groups as u64 * slot), groups);
    assert_eq!(slots(u64::MAX), groups);
    assert_eq!(slots(others + 8 * slot + 1), 4);
    assert_eq!(slots(others + 10 * slot - 1), 4);
    // Room for twice the pipeline's depth: the pipeline's depth.
    assert_eq!(slots(others + 6 * slot), 3);
    // No room for even that: auto speculation is off (the same bits, the
    // step waits for the norm), not a run refused for a disk its state
    // fits without the pool; the plan says so.
    // Not even that, half the room left for checkpoints: off (its least
    // pool once took all of a small disk, and a save there then failed).
    for avail in [others + 6 * slot - 1, others + 3 * slot, others, 0] {
        let s = decide_within(&config, &shape, Some(avail)).unwrap();
        assert_eq!(
            (
                s.speculative,
                s.speculation_slots,
                s.speculation_pool_nvme_bytes
            ),
            (false, 0, 0),
            "{avail}"
        );
        assert_eq!(s.speculation_off_for_room_bytes, Some(3 * slot), "{avail}");
    }
    assert_eq!(full.speculation_off_for_room_bytes, None);
    // Kept gradients stay the pipeline's depth whatever the pool.
    assert_eq!(
        decide_within(&config, &shape, Some(others + 6 * slot))
            .unwrap()
            .speculation_kept_grads,
        3
    );
    assert_eq!(full.speculation_kept_grads, 3);
    // Each of N ranks on a node sizes its pool from a share of the disk
    // (their shares add up to the free space, never N times it).
    use tierzero::engine::sizing::nvme_available_bytes;
    let (one, four) = (
        nvme_available_bytes(&config, 1).unwrap(),
        nvme_available_bytes(&config, 4).unwrap(),
    );
    // The free space may move between the two statvfs calls (other tests
    // write): within 1% of it, or 16 MiB. (Each rank took the whole free
    // space before: `four` was `one`, beyond that slack on any disk with
    // more than about 64 MiB free.)
    let slack = (one / 100).max(16 << 20);
    assert!(
        four <= one / 4 + slack && four + slack >= one / 4,
        "one rank {one}, four ranks {four} each"
    );
    let mut bytes = cfg.clone();
    bytes["tierzero"]["speculation_pool_bytes"] = json!(5 * slot);
    let config = load_str(&bytes.to_string(), &run).unwrap().config;
    assert_eq!(
        decide_within(&config, &shape, Some(0))
            .unwrap()
            .speculation_slots,
        5
    );
    // The params' swap in another directory of the same file system is
    // counted as it is in the shared one (it was left out: the pool took
    // its room, and the run was refused for space).
    let mut split = cfg.clone();
    std::fs::create_dir_all(d.join("swap-params")).unwrap();
    split["zero_optimization"]["offload_param"]["nvme_path"] = json!(d.join("swap-params"));
    let split = load_str(&split.to_string(), &run).unwrap().config;
    for avail in [others, others + 3 * slot, others + 8 * slot + 1, u64::MAX] {
        assert_eq!(
            decide_within(&split, &shape, Some(avail))
                .unwrap()
                .speculation_slots,
            slots(avail),
            "{avail}"
        );
    }
    // Asked for (`true`), speculation keeps its least pool without room:
    // its extents then fail at fallocate with the numbers.
    let mut on = cfg.clone();
    on["tierzero"]["speculative_step"] = json!(true);
    let config = load_str(&on.to_string(), &run).unwrap().config;
    let s = decide_within(&config, &shape, Some(0)).unwrap();
    assert_eq!((s.speculative, s.speculation_slots), (true, 3));
}

#[test]
fn the_plan_shows_what_the_collectives_stage_through_when_they_do() {
    let d = scratch("comm-staging");
    let mut plan = plan_of(&d, &ds(&d, false, None));
    assert!(
        !plan.to_string().contains("collectives' staging"),
        "one rank, MPI: no staging of their own"
    );
    plan.comm_staging = Some(tierzero::engine::comm::CommStaging {
        pinned_bytes: 64 << 20,
        device_bytes: 128 << 20,
    });
    let text = plan.to_string();
    assert!(
        text.contains(
            "collectives' staging (NCCL through the host, at most): 64 MiB pinned, 128 MiB on the device"
        ),
        "{text}"
    );
}

/// With bf16, one micro-batch and one rank the plan holds each sub-group's
/// gradients as the engine does ([`Trainer::grad_sum_dtypes`]): bf16 where
/// every element gets one (2 bytes), fp32 sums in the groups of the
/// tied wte (its gradients add over two units); its host bytes are those,
/// with the tied wte's whole fp32 sum held through backward beside them
/// (it was left out), and its line says how many groups hold which. With
/// two micro-batches, fp32 sums everywhere.
#[test]
fn the_plan_holds_bf16_gradients_where_each_element_gets_one() {
    use tierzero::engine::sizing::SumDtype;
    let d = scratch("bf16-grads");
    let mut cfg = ds(&d, true, None);
    cfg["bf16"] = json!({"enabled": true});
    cfg["zero_optimization"]["offload_optimizer"] = json!({"device": "cpu"});
    let t = trainer(&d, &cfg).unwrap();
    let plan = plan_of(&d, &cfg);
    let dtypes = t.grad_sum_dtypes();
    let groups = &t.layout().sub_groups;
    assert_eq!(dtypes.len(), groups.len());
    let bf16 = dtypes.iter().filter(|d| **d == SumDtype::Bf16).count();
    assert!(bf16 > 0 && bf16 < groups.len(), "{dtypes:?}");
    for (g, dt) in groups.iter().zip(dtypes) {
        let tied = g.param_ids().any(|p| !t.model().in_one_unit(p));
        assert_eq!(*dt == SumDtype::F32, tied, "group {}", g.id.0);
    }
    let bytes: u64 = groups
        .iter()
        .zip(dtypes)
        .map(|(g, dt)| g.numel as u64 * dt.bytes_per_elem())
        .sum();
    let tied: u64 = t
        .model()
        .params()
        .iter()
        .filter(|p| p.units.len() > 1)
        .map(|p| p.numel as u64 * 4)
        .sum();
    assert!(tied > 0);
    assert_eq!(plan.grads.host_bytes, bytes + tied);
    assert_eq!(plan.bf16_grad_sub_groups, bf16);
    // `tierzero estimate`'s count of the bf16 elements is the trainer's.
    let loaded = load_str(&cfg.to_string(), &RunContext::default()).unwrap();
    let bf16_numel: u64 = groups
        .iter()
        .zip(dtypes)
        .filter(|(_, dt)| **dt == SumDtype::Bf16)
        .map(|(g, _)| g.numel as u64)
        .sum();
    assert_eq!(
        tierzero::engine::sizing::bf16_grad_numel(&loaded.config, t.model(), 1),
        bf16_numel
    );
    assert_eq!(
        tierzero::engine::sizing::bf16_grad_numel(&loaded.config, t.model(), 2),
        0,
        "two ranks sum their gradients"
    );
    let text = plan.to_string();
    assert!(
        text.contains("grads (bf16+fp32, at most)")
            && text.contains(&format!(
                "gradients: held in bf16 as they came in {bf16} of {} sub-groups",
                groups.len()
            )),
        "{text}"
    );
    cfg["gradient_accumulation_steps"] = json!(2);
    let t2 = trainer(&d, &cfg).unwrap();
    assert!(t2.grad_sum_dtypes().iter().all(|d| *d == SumDtype::F32));
    let loaded2 = load_str(&cfg.to_string(), &RunContext::default()).unwrap();
    assert_eq!(
        tierzero::engine::sizing::bf16_grad_numel(&loaded2.config, t2.model(), 1),
        0
    );
    let plan2 = plan_of(&d, &cfg);
    assert_eq!(plan2.bf16_grad_sub_groups, 0);
    let text2 = plan2.to_string();
    assert!(text2.contains("grads (fp32, at most)") && !text2.contains("held in bf16"));
}

/// With NVMe optimizer state the host holds a pipeline's worth of
/// gradients; with `overlap_optimizer` off it holds every sub-group's
/// until the step, and the bound the plan prints (and the trainer's spare
/// sums) says so.
#[test]
fn without_the_overlap_the_gradient_bound_is_every_sub_group() {
    use tierzero::engine::sizing::{host_grad_bound_groups, Shape};
    let d = scratch("no-overlap");
    let run = RunContext {
        path_checks: PathChecks::Check,
        ..RunContext::default()
    };
    let mut bounds = Vec::new();
    for overlap in [true, false] {
        let mut cfg = ds(&d, false, None);
        cfg["zero_optimization"]["sub_group_size"] = json!(2000);
        cfg["tierzero"]["overlap_optimizer"] = json!(overlap);
        let t = trainer(&d, &cfg).unwrap();
        let config = load_str(&cfg.to_string(), &run).unwrap().config;
        let shape = Shape::of(&config, t.model(), t.layout());
        let groups = t.layout().sub_groups.len() as u64;
        assert!(groups > 8, "{groups} sub-groups");
        assert_eq!(t.sizing().grads_held_until_step, !overlap);
        bounds.push((host_grad_bound_groups(t.sizing(), &shape, true, 1), groups));
    }
    let ((overlapped, groups), (held, _)) = (bounds[0], bounds[1]);
    assert!(overlapped < groups, "{overlapped} of {groups}");
    assert_eq!(held, groups);
}

/// With params on the cpu tier and a pinned budget, the plan's pinned line
/// says which part the budget bounds (the swap buffers) and that the cpu
/// tier's pages are beside it (it printed the total "of a budget of" the
/// swap buffers' budget, which the pages can far exceed).
#[test]
fn the_pinned_line_sets_the_cpu_tier_pages_beside_the_budget() {
    let d = scratch("cpu-pages");
    let mut cfg = ds(&d, false, Some(64 << 20));
    cfg["zero_optimization"]["offload_param"] = json!({"device": "cpu"});
    let text = plan_of(&d, &cfg).to_string();
    let line = text
        .lines()
        .find(|l| l.contains("pinned total"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains("of a budget of 64 MiB") && line.contains("the cpu tier's pages"),
        "{line}"
    );
    // Without cpu pages, the line is as before.
    let text = plan_of(&d, &ds(&d, false, Some(64 << 20))).to_string();
    let line = text.lines().find(|l| l.contains("pinned total")).unwrap();
    assert!(!line.contains("cpu tier's pages"), "{line}");
}

/// `pin_memory: false` leaves the arenas pageable: the plan shows their
/// bytes as host memory and its pinned total as what is locked (it
/// showed every arena as pinned, with nothing locked).
#[test]
fn arenas_left_pageable_by_pin_memory_false_are_host_memory_in_the_plan() {
    let d = scratch("nopin");
    let pinned = plan_of(&d, &ds(&d, false, None));
    let mut cfg = ds(&d, false, None);
    cfg["zero_optimization"]["offload_param"]["pin_memory"] = json!(false);
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = json!(false);
    let pageable = plan_of(&d, &cfg);
    let arenas = pinned.pinned_total_bytes();
    assert!(arenas > 0);
    assert_eq!(pinned.pageable_arena_bytes(), 0);
    assert_eq!(pageable.pageable_arena_bytes(), arenas);
    let text = pageable.to_string();
    assert!(
        text.contains(&format!(
            "pinned total 0 B (and {} of arenas left pageable by pin_memory false)",
            tierzero::units::format_bytes(arenas)
        )),
        "{text}"
    );
    let swap_row = text
        .lines()
        .find(|l| l.trim_start().starts_with("param swap buffers"))
        .unwrap();
    // The table's columns: a label of 38, then four cells of 12 (device,
    // pinned host, host, NVMe), each after a space.
    let cell = |i: usize| swap_row.get(41 + 13 * i..53 + 13 * i).unwrap().trim();
    assert_eq!((cell(1), cell(2)), ("-", "256 KiB"), "{swap_row}");
    assert!(
        pinned.to_string().contains(&format!(
            "pinned total {}",
            tierzero::units::format_bytes(arenas)
        )),
        "{pinned}"
    );
}

/// Within `tierzero.pinned_budget_bytes` the param swap arena is cut into
/// as many shard slots as the budget holds, at least `buffer_count`: a
/// budget the config check passed (its `buffer_count` slots) was refused
/// by the engine for its 2-per-param slots. The weights do not change.
#[test]
fn param_slots_are_cut_to_the_pinned_budget_down_to_buffer_count() {
    let d = scratch("slot-budget");
    let mut cfg = ds(&d, false, None);
    cfg["zero_optimization"]["offload_optimizer"] = json!({"device": "cpu"});
    // DeepSpeed's default buffer_size: each buffer holds many shards.
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = json!(1e8);
    let md = ModelDir::open(d.join("model"), 1).unwrap();
    // As `tierzero train` loads it: the model's size known, so the config
    // check asks for `buffer_count` slots of the largest shard.
    let run = RunContext {
        path_checks: PathChecks::Check,
        model_numel: Some(md.model().numel() as u64),
        largest_param_numel: md.model().params().iter().map(|p| p.numel as u64).max(),
        ..RunContext::default()
    };
    let build = |cfg: &Value| {
        let config = load_str(&cfg.to_string(), &run)
            .map_err(|e| e.to_string())?
            .config;
        let text = "tiers of bytes: device, pinned host memory and nvme. ".repeat(20);
        let data = TokenData::from_bytes(text.as_bytes(), Path::new("<text>"));
        Trainer::new(&config, &md, data, TrainerOptions::cpu(1, 16)).map_err(|e| e.to_string())
    };
    let mut free = build(&cfg).unwrap();
    free.step().unwrap();
    let (n, slot) = (
        free.sizing().param_buffers.count,
        free.sizing().param_buffers.bytes_each,
    );
    assert!(n > 5, "{n} slots");
    let sha = free.weight_sha256().unwrap();
    for (budget, want) in [(4 * slot, 4), (5 * slot + slot / 2, 5), (n * slot, n)] {
        cfg["tierzero"]["pinned_budget_bytes"] = json!(budget);
        let mut t = build(&cfg).unwrap();
        assert_eq!(t.sizing().param_buffers.count, want, "budget {budget}");
        t.step().unwrap();
        assert_eq!(t.weight_sha256().unwrap(), sha);
    }
    // Below buffer_count slots: refused, with the least that works.
    cfg["tierzero"]["pinned_budget_bytes"] = json!(4 * slot - 1);
    let err = build(&cfg).err().unwrap();
    assert!(err.contains(&(4 * slot).to_string()), "{err}");
}

/// Persistent params (DeepSpeed's two thresholds) are whole tensors the
/// prefetcher never releases: the plan counts them as the params' host
/// bytes, and after a step the store holds exactly those. Every param of
/// this model is under the default threshold: the whole model stayed in
/// the heap while the plan said the params were on NVMe alone.
#[test]
fn the_plan_counts_the_persistent_params_the_store_keeps() {
    let d = scratch("persistent");
    let run = RunContext {
        path_checks: PathChecks::Check,
        ..RunContext::default()
    };
    let with = |threshold: u64, model_threshold: Option<u64>| {
        let mut cfg = ds(&d, false, None);
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = json!(threshold);
        if let Some(m) = model_threshold {
            cfg["zero_optimization"]["stage3_model_persistence_threshold"] = json!(m);
        }
        let config = load_str(&cfg.to_string(), &run).unwrap().config;
        let mut t = trainer(&d, &cfg).unwrap();
        let plan = Plan::new(&config, t.model(), t.layout(), t.sizing(), "cpu".into());
        t.step().unwrap();
        t.step().unwrap();
        (plan, t.store().resident_bytes(), t.model().numel() as u64)
    };
    // Every param persistent: all of them stay, and the plan says so.
    let (plan, resident, numel) = with(1_000_000_000, None);
    assert_eq!(plan.params.host_bytes, numel * 4);
    assert_eq!(resident, plan.params.host_bytes);
    assert_eq!(plan.persistent_params, plan.params_per_tier[2]);
    let text = plan.to_string();
    assert!(
        text.contains(&format!(
            "params (host: {} persistent)",
            plan.persistent_params
        )),
        "{text}"
    );
    assert!(plan.host_working_bytes() >= numel * 4);
    // None (the default of this file's config): no host row.
    let (plan, _, _) = with(0, None);
    assert_eq!((plan.params.host_bytes, plan.persistent_params), (0, 0));
    assert!(plan.to_string().contains("  params    "), "{plan}");
    // The model threshold bounds them (10 000 elements of 4 B): fewer
    // params, and the store keeps them and at most the first units'
    // updated params (written through for the next forward) beside.
    let (plan, resident, numel) = with(1_000_000_000, Some(10_000));
    assert!(
        plan.params.host_bytes > 0 && plan.params.host_bytes <= 40_000,
        "{plan}"
    );
    assert!(plan.persistent_params < plan.params_per_tier[2]);
    assert!(resident >= plan.params.host_bytes && resident < numel * 4);
}
