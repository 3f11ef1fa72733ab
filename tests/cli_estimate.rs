//! `tierzero estimate` and `tierzero inspect`, run as the built binary.
//!
//! Numbers checked here are derived by hand from the formulas in
//! `tierzero::estimate` (and DeepSpeed's, for its comparison column); the
//! machine-dependent parts (RAM, free disk, the recommendation) are only
//! checked for presence and consistency.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::path::Path;

use serde_json::Value;

mod cli_support;
use cli_support::Out;

fn tierzero(args: &[&str]) -> Out {
    cli_support::run_tierzero(None, args)
}

fn json(args: &[&str]) -> Value {
    let out = tierzero(args);
    assert_eq!(out.code, 0, "{args:?}: {}", out.stderr);
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

fn estimate_of<'a>(report: &'a Value, stage: u64, optimizer: &str, params: &str) -> &'a Value {
    report["estimates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| {
            e["choice"]["stage"] == stage
                && e["choice"]["optimizer"] == optimizer
                && e["choice"]["params"] == params
        })
        .unwrap_or_else(|| panic!("no estimate for stage {stage} {optimizer} {params}"))
}

/// `estimate --model <model> --config <cfg> <extra> --json`.
fn estimate_model(model: &std::path::Path, cfg: &std::path::Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "estimate",
        "--model",
        model.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
    ];
    args.extend(extra);
    args.push("--json");
    json(&args)
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a u64: {v}"))
}

#[test]
fn estimate_table_lists_every_choice_and_a_verdict() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    let out = tierzero(&[
        "estimate",
        "--params",
        "7B",
        "--device-memory",
        "80GiB",
        "--nvme-path",
        dir,
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let s = &out.stdout;
    assert!(s.starts_with("model: 7.00B params (7000000000)"), "{s}");
    assert!(s.contains("largest unit 212.1M params (assumed)"), "{s}");
    assert!(s.contains("device 80 GiB per rank"), "{s}");
    assert!(s.contains("DeepSpeed CPU / GPU"), "{s}");
    let rows: Vec<&str> = s
        .lines()
        .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()))
        .collect();
    assert_eq!(rows.len(), 14, "{s}");
    // Stage 0 on a GPU runs Adam there: bf16 weights 2 B, fp32 masters 4,
    // m and v 8, gradient sums 4 a param, and a workspace of the largest
    // unit and three largest params (the device optimizer's own rule):
    // 120.5 GiB > 80 GiB; the host keeps a copy of the state and the
    // params (91.3 GiB).
    assert!(
        rows[0].starts_with("0     none      -      |    120.5 GiB |         0 B    91.3 GiB"),
        "{}",
        rows[0]
    );
    assert!(rows[0].contains("no: device"), "{}", rows[0]);
    // With params offloaded, Adam runs on the host: as offload_optimizer cpu.
    let row = |prefix: &str| {
        rows.iter()
            .find(|r| r.starts_with(prefix))
            .unwrap()
            .to_owned()
    };
    let cols = |r: &str| r.split('|').take(3).skip(1).collect::<Vec<_>>().join("|");
    assert_eq!(
        cols(row("3     none      cpu")),
        cols(row("3     cpu       cpu"))
    );
    // Stage 3, all on the CPU: DeepSpeed's 18N·1.5 = 176.0 GiB per node.
    let cpu_cpu = rows
        .iter()
        .find(|r| r.starts_with("3     cpu       cpu"))
        .unwrap();
    assert!(cpu_cpu.contains("176.0 GiB / "), "{cpu_cpu}");
    assert!(s.contains("\nrecommended: "), "{s}");
    assert!(s.contains("note: largest unit assumed"), "{s}");
}

/// An "auto" gradient accumulation (train's --grad-accum) is estimated as
/// 1, and said where it matters: with the optimizer state on NVMe a run
/// with more micro-batches also parks its sums there.
#[test]
fn an_auto_accumulation_with_nvme_state_is_said() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("ds.json");
    let write = |ga: &str, device: &str| {
        std::fs::write(
            &cfg,
            format!(
                r#"{{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": {ga},
                    "zero_optimization": {{"stage": 3, "offload_optimizer":
                    {{"device": "{device}", "nvme_path": "{}"}}}}}}"#,
                tmp.path().display()
            ),
        )
        .unwrap();
    };
    let note = "gradient_accumulation_steps is \"auto\"";
    for (ga, device, said) in [
        ("\"auto\"", "nvme", true),
        ("4", "nvme", false),
        ("\"auto\"", "cpu", false),
    ] {
        write(ga, device);
        let out = tierzero(&[
            "estimate",
            "--params",
            "1B",
            "--config",
            cfg.to_str().unwrap(),
        ]);
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert_eq!(
            out.stderr.contains(note),
            said,
            "{ga} {device}: {}",
            out.stderr
        );
    }
}

#[test]
fn estimate_json_matches_the_formulas() {
    let tmp = tempfile::tempdir().unwrap();
    // DeepSpeed's memory.rst example: 2851M params, 32M largest layer, 8 GPUs.
    let r = json(&[
        "estimate",
        "--params",
        "2851M",
        "--largest-layer",
        "32M",
        "--ranks",
        "8",
        "--nvme-path",
        tmp.path().to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(r["inputs"]["total_numel"], 2_851_000_000u64);
    assert_eq!(r["inputs"]["largest_source"], "given");
    assert_eq!(r["inputs"]["ranks"], 8);
    assert_eq!(r["estimates"].as_array().unwrap().len(), 14);
    for key in ["ram_bytes", "nvme_free_bytes", "memlock", "device_bytes"] {
        assert!(r["machine"].get(key).is_some(), "machine.{key} missing");
    }
    assert!(r["machine"]["device_bytes"].is_null());
    assert!(r.get("recommended").is_some() && r["notes"].is_array());

    let (n, l, ranks) = (2_851_000_000u64, 32_000_000u64, 8u64);
    let s = n.div_ceil(ranks);
    let e = estimate_of(&r, 3, "cpu", "cpu");
    // DeepSpeed (zero_init=1): CPU 18·N·1.5, GPU 4·L.
    assert_eq!(u(&e["deepspeed"]["cpu_bytes"]), 76_977_000_000);
    assert_eq!(u(&e["deepspeed"]["gpu_bytes"]), 4 * l);
    // Ours, per rank: two gathered units + one unit's grads on the device;
    // pinned 16-bit params; pageable fp32 grads (the CPU optimizer's sums,
    // heap memory), master + m + v, stepped sub-groups' new 16-bit values
    // (the one sub-group of min(1e9, S) lent, and the spare), and the
    // reduce's fp32 buffer of one unit's gradients (8 ranks).
    assert_eq!(u(&e["per_rank"]["device_bytes"]), 2 * l * 2 + l * 2);
    assert_eq!(u(&e["per_rank"]["pinned_bytes"]), s * 2);
    assert_eq!(
        u(&e["per_rank"]["pageable_bytes"]),
        s * 4 + s * 12 + 2 * s.min(1_000_000_000) * 2 + l * 4
    );
    assert_eq!(u(&e["per_node"]["pinned_bytes"]), ranks * s * 2);
    let items = e["items"].as_array().unwrap();
    assert!(items.iter().any(|i| i["what"] == "fp32 master + Adam m, v"
        && i["formula"] == "⌈2851000000/8⌉ × (4 + 2 × 4) B"));
    // NVMe optimizer offload: DeepSpeed's default swap buffers (no config):
    // 4 × min(sub_group_size 1e9, S) × 4 B pinned, each rounded up to 4 KiB
    // as the engine maps it.
    let e = estimate_of(&r, 3, "nvme", "nvme");
    assert!(e["deepspeed"].is_null());
    let opt = items_named(e, "optimizer swap buffers");
    assert_eq!(u(&opt["bytes"]), 4 * align(s.min(1_000_000_000) * 4));
    // DeepSpeed's default clipping (1.0) and GA 1: nothing parks, but the
    // final gradients spill (fp32) and the speculation pool has a slot
    // for every NVMe sub-group, here the only one, so NVMe holds the
    // state, the spill and a slot (the params, under DeepSpeed's default
    // max_in_cpu of 1e9 elements, stay in host memory, as train puts
    // them); host memory holds the fp32 sums of at most that one
    // sub-group.
    // (Every extent is 4 KiB-aligned, as the engine allocates them: the
    // state's three, the spill's, the slot's three; and its one swap
    // file's 1 MiB of alignment room.) Where half the disk's free space,
    // shared by the 8 ranks, has no room for that slot beside the rest,
    // auto speculation is off, as the run turns it off: no slot.
    let others = 4 * align(s * 4) + (1 << 20);
    let free = u(&r["machine"]["nvme_free_bytes"]);
    let room = free.saturating_sub(others * ranks) / ranks;
    let slot = 3 * align(s * 4);
    let pool = items_named(e, "speculation pool (state slots)");
    if room / 2 >= slot {
        assert_eq!(u(&pool["bytes"]), slot);
    } else {
        assert_eq!(u(&pool["bytes"]), 0);
        assert!(
            pool["formula"]
                .as_str()
                .unwrap()
                .starts_with(&format!("auto off: its least pool, {slot} B, does not fit")),
            "{pool}"
        );
    }
    assert_eq!(
        u(&e["per_rank"]["nvme_bytes"]),
        others + if room / 2 >= slot { slot } else { 0 }
    );
    assert_eq!(
        u(&items_named(e, "swap files' alignment room")["bytes"]),
        1 << 20
    );
    assert_eq!(
        u(&items_named(e, "param host cache (max_in_cpu)")["bytes"]),
        s * 2
    );
    let grads = items_named(e, "fp32 grads in host memory (at most)");
    assert_eq!(grads["tier"], "pageable");
    assert_eq!(u(&grads["bytes"]), s * 4);
}

/// Bytes rounded up to 4 KiB, as the engine maps its swap buffers.
fn align(bytes: u64) -> u64 {
    bytes.div_ceil(4096) * 4096
}

fn items_named<'a>(e: &'a Value, what: &str) -> &'a Value {
    e["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["what"] == what)
        .unwrap_or_else(|| panic!("no item {what}"))
}

const GPT2_CONFIG: &str = r#"{"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
    "n_embd": 768, "n_layer": 12, "n_head": 12}"#;

/// The config is resolved with the model's hidden size, as train resolves
/// it: `stage3_prefetch_bucket_size: "auto"` is 0.9 × 768² for GPT-2 small
/// (it was DeepSpeed's 5e7 default), which decides the resident groups.
#[test]
fn auto_keys_resolve_with_the_model_s_hidden_size() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("gpt2");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("config.json"), GPT2_CONFIG).unwrap();
    let cfg = tmp.path().join("ds.json");
    std::fs::write(
        &cfg,
        format!(
            r#"{{"zero_optimization": {{"stage": 3, "sub_group_size": 1e7,
                "stage3_prefetch_bucket_size": "auto",
                "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}}}}}}"#,
            tmp.path().display()
        ),
    )
    .unwrap();
    let r = estimate_model(&model, &cfg, &[]);
    assert_eq!(r["inputs"]["swap"]["prefetch_bucket_numel"], 530_841u64);
    // The plan train prints for the config keeps no group resident (the
    // first units' group holds more than one bucket's state): so does the
    // estimate of the config's choice.
    let e = estimate_of(&r, 3, "nvme", "none");
    assert!(
        e["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["what"] != "optimizer state kept resident"),
        "{e}"
    );
}

#[test]
fn estimate_from_model_and_config() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("gpt2");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("config.json"), GPT2_CONFIG).unwrap();
    let swap = tmp.path().join("swap");
    std::fs::create_dir(&swap).unwrap();
    let cfg = tmp.path().join("ds.json");
    std::fs::write(
        &cfg,
        format!(
            r#"{{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                "gradient_clipping": 0, "bf16": {{"enabled": true, "check_grad_overflow": false}},
                "scheduler": {{"type": "WarmupDecayLR", "params": {{"total_num_steps": "auto"}}}},
                "zero_optimization": {{"stage": 3, "sub_group_size": 1e7,
                  "offload_param": {{"device": "nvme", "nvme_path": "{p}", "buffer_count": 4, "buffer_size": 1e7, "max_in_cpu": {max_in_cpu}}},
                  "offload_optimizer": {{"device": "nvme", "nvme_path": "{p}", "pipeline_read": true, "buffer_count": 12}}}}}}"#,
            p = swap.display(),
            max_in_cpu = 0
        ),
    )
    .unwrap();
    let r = estimate_model(&model, &cfg, &["--moments", "bf16"]);
    // GPT-2 small: 124,439,808 params (tied embedding counted once); the
    // largest unit is the embedding, wte + wpe = (50257 + 1024) × 768.
    assert_eq!(r["inputs"]["total_numel"], 124_439_808u64);
    assert_eq!(r["inputs"]["largest_unit_numel"], 39_383_808u64);
    assert_eq!(r["inputs"]["largest_tensor_numel"], 50257u64 * 768);
    assert_eq!(r["inputs"]["largest_source"], "model");
    assert_eq!(r["inputs"]["param_elem_bytes"], 2);
    assert_eq!(r["inputs"]["moment_elem_bytes"], 2);
    assert_eq!(r["inputs"]["swap"]["sub_group_numel"], 10_000_000u64);
    // Persistent params (at most 1e5 elements each, DeepSpeed's default
    // threshold): the biases and layer norms, 8 params of 9984 elements a
    // block (ln_1's two 1536, c_attn's bias 2304, c_proj's 768, ln_2's two
    // 1536, c_fc's 3072, mlp c_proj's 768) and ln_f's two, 1536; every
    // weight is larger.
    // Whole bf16 tensors in host memory for the run.
    assert_eq!(
        r["inputs"]["persistent"],
        serde_json::json!([12 * 9984 + 1536, 12 * 8 + 2])
    );
    let held = items_named(
        estimate_of(&r, 3, "nvme", "nvme"),
        "persistent params (whole, never released)",
    );
    assert_eq!(u(&held["bytes"]), (12 * 9984 + 1536) * 2, "{held}");
    assert_eq!(held["tier"], "pageable");
    // bf16, one rank, one micro-batch: the host holds each gradient as it
    // came, but in the groups of the tied wte (its two units' gradients
    // add up): those hold fp32 sums, the wte and at most its neighbours
    // in its first and last groups.
    let (n, wte) = (124_439_808u64, 50257u64 * 768);
    let b = u(&r["inputs"]["bf16_grad_numel"]);
    assert!(b <= n - wte && b + 2 * 10_000_000 >= n - wte, "{b}");
    let grads = items_named(
        estimate_of(&r, 3, "cpu", "cpu"),
        "grad accumulators (fp32; bf16 as they came)",
    );
    assert_eq!(u(&grads["bytes"]), (n - b) * 4 + b * 2, "{grads}");
    assert_eq!(grads["tier"], "pageable");
    assert_eq!(r["machine"]["nvme_dir"], swap.to_str().unwrap());
    assert_eq!(
        r["config_choice"],
        serde_json::json!({"stage": 3, "optimizer": "nvme", "params": "nvme"})
    );
    let e = estimate_of(&r, 3, "nvme", "nvme");
    assert_eq!(
        u(&items_named(e, "param swap-in buffers")["bytes"]),
        4 * align(10_000_000 * 2)
    );
    // The embedding (50257 × 768) is larger than sub_group_size: it is
    // tiled, and the optimizer buffers hold one sub-group's state.
    assert_eq!(
        u(&items_named(e, "optimizer swap buffers")["bytes"]),
        12 * align(10_000_000 * 4)
    );
    // bf16 moments: master 4 + m 2 + v 2 bytes per param, less one
    // sub-group's kept resident (the embedding's first tile), each NVMe
    // group's three extents 4 KiB-aligned (the model's 13 groups of at
    // most 1e7 elements).
    let state = u(&items_named(e, "fp32 master + Adam m, v")["bytes"]);
    let unaligned = 124_439_808 * 8 - 10_000_000 * 8;
    assert!(
        state > unaligned && state < unaligned + 13 * 3 * 4096,
        "{state}"
    );
    assert_eq!(
        u(&items_named(e, "optimizer state kept resident")["bytes"]),
        10_000_000 * 8
    );
    // Host fp32 grads bounded by sub-groups: the largest unit's (the
    // layout's: the embedding's 38.6M tiled over groups of 1e7 and the wpe
    // beside it touch 5) and 3 handed over (2 + read ahead): 8 groups of
    // 1e7. Without clipping or an overflow check (bf16's is off here) none
    // is held for the norm, none spills, and there is no speculation pool;
    // GA 1: no park.
    let grads = items_named(e, "fp32 grads in host memory (at most)");
    assert!(
        grads["formula"].as_str().unwrap().contains("unit 5 "),
        "{grads}"
    );
    assert_eq!(u(&grads["bytes"]), 8 * 10_000_000 * 4, "{grads}");
    for what in [
        "final fp32 grads spilled (clipping / fp16)",
        "fp32 grad sums parked between micro-batches",
        "speculation pool (state slots)",
    ] {
        assert!(
            e["items"]
                .as_array()
                .unwrap()
                .iter()
                .all(|i| i["what"] != what),
            "{what}"
        );
    }
    // buffer_size 1e7 is below the largest tensor (38.6M): flagged.
    let notes = r["notes"].as_array().unwrap();
    assert!(
        notes.iter().any(|n| n
            .as_str()
            .unwrap()
            .contains("raise buffer_size to at least 38597376")),
        "{notes:?}"
    );

    // DeepSpeed's default max_in_cpu (1e9) holds all of GPT-2's params in
    // host memory, as train puts them: nothing on NVMe, no swap-in
    // buffers, no buffer_size note (they were all counted, and the params
    // twice).
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("\"max_in_cpu\": 0", "\"max_in_cpu\": 1e9");
    std::fs::write(&cfg, text).unwrap();
    let r = estimate_model(&model, &cfg, &[]);
    let e = estimate_of(&r, 3, "nvme", "nvme");
    let names: Vec<&str> = e["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["what"].as_str().unwrap())
        .collect();
    assert!(!names.contains(&"param swap-in buffers"), "{names:?}");
    assert!(!names.contains(&"param partition"), "{names:?}");
    // In pinned pages as train maps them: pages of the largest shard (the
    // 77.2 MB wte, above 64 MiB), 4 KiB-aligned, filled first-fit in
    // ParamId order: the wte alone, then the wpe and the blocks' params
    // (14.2 MB a block), the 248.9 MB in all in the fewest pages, four.
    let page = align(50257 * 768 * 2);
    assert_eq!(
        u(&items_named(e, "param host cache (max_in_cpu)")["bytes"]),
        4 * page
    );
    let notes = r["notes"].as_array().unwrap();
    assert!(
        notes
            .iter()
            .all(|n| !n.as_str().unwrap().contains("raise buffer_size")),
        "{notes:?}"
    );
}

#[test]
fn bad_inputs_exit_2_with_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let bad_json = tmp.path().join("bad.json");
    std::fs::write(&bad_json, "{\"zero_optimization\": {\"stage\" 3}}").unwrap();
    let bad_stage = tmp.path().join("stage.json");
    std::fs::write(&bad_stage, r#"{"zero_optimization": {"stage": "three"}}"#).unwrap();
    // More sub-groups than the engine supports, with --params as with
    // --model (its rows were sized as if sub_group_size were larger).
    let tiny_groups = tmp.path().join("groups.json");
    std::fs::write(
        &tiny_groups,
        r#"{"zero_optimization": {"stage": 3, "sub_group_size": 100}}"#,
    )
    .unwrap();
    let budget = tmp.path().join("budget.json");
    std::fs::write(
        &budget,
        r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nonexistent"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent"}},
            "tierzero": {"pinned_budget_bytes": "1GiB"}}"#,
    )
    .unwrap();
    let bad_model = tmp.path().join("model.json");
    std::fs::write(&bad_model, r#"{"model_type": "bert"}"#).unwrap();
    let missing = tmp.path().join("missing");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--params", "banana"], "--params"),
        (vec!["--params", "0"], "--params"),
        (vec!["--params", "7B", "--ranks", "0"], "--ranks"),
        (vec!["--params", "7B", "--ranks", "-3"], "--ranks"),
        (
            vec![
                "--params",
                "7B",
                "--ranks",
                "100000",
                "--device-memory",
                "80GiB",
            ],
            "--ranks",
        ),
        (
            vec!["--params", "7B", "--largest-layer", "8B"],
            "--largest-layer",
        ),
        (
            vec!["--params", "7B", "--largest-layer", "wide"],
            "--largest-layer",
        ),
        (
            vec!["--params", "7B", "--device-memory", "lots"],
            "--device-memory",
        ),
        // A unit left out: it sized a device of 80 bytes.
        (
            vec!["--params", "7B", "--device-memory", "80"],
            "--device-memory 80GiB",
        ),
        (
            vec!["--params", "7B", "--device-memory", "1e3"],
            "--device-memory 1e3GiB",
        ),
        (vec!["--params", "-1"], "negative"),
        (vec!["--params", "1e-3"], "not a whole number"),
        (
            vec!["--params", "7B", "--config", missing.to_str().unwrap()],
            "--config",
        ),
        (
            vec!["--params", "7B", "--config", bad_json.to_str().unwrap()],
            "line 1",
        ),
        (
            vec!["--params", "7B", "--config", bad_stage.to_str().unwrap()],
            "zero_optimization.stage",
        ),
        (
            vec!["--params", "1B", "--config", tiny_groups.to_str().unwrap()],
            "raise sub_group_size to at least",
        ),
        (vec!["--model", missing.to_str().unwrap()], "--model"),
        (vec!["--model", bad_model.to_str().unwrap()], "bert"),
        (
            vec!["--params", "7B", "--nvme-path", missing.to_str().unwrap()],
            "--nvme-path",
        ),
        (vec!["--params", "1e300T"], "--params"),
        // Beyond 2^48: refused, also with a config whose pinned budget
        // the whole decision is checked against (it overflowed there).
        (vec!["--params", "9e18"], "at most 281474976710656"),
        (
            vec!["--params", "9e18", "--config", budget.to_str().unwrap()],
            "at most 281474976710656",
        ),
    ];
    for (args, needle) in cases {
        let mut full = vec!["estimate"];
        full.extend(&args);
        let out = tierzero(&full);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert_eq!(out.stdout, "", "{args:?}");
        let lines: Vec<&str> = out.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: {:?}", out.stderr);
        assert!(lines[0].starts_with("error: "), "{args:?}: {}", lines[0]);
        assert!(
            lines[0].contains(needle),
            "{args:?}: {} lacks {needle:?}",
            lines[0]
        );
        assert!(!out.stderr.contains("panicked"), "{args:?}");
    }
}

/// A pid above the kernel's `pid_max` limit (at most 2^22): never alive.
const DEAD_PID: u32 = (1 << 23) - 1;

fn swap_report(dir: &Path) -> Value {
    json(&["inspect", dir.to_str().unwrap(), "--json"])
}

#[test]
fn inspect_lists_live_and_stale_swap_files() {
    use tierzero_swap::{SpaceConfig, SwapSpace};
    let tmp = tempfile::tempdir().unwrap();
    let space = SwapSpace::create(SpaceConfig::new(tmp.path(), 1 << 20)).unwrap();
    let swap_dir = tmp.path().join("tierzero");
    // Created after the space: a space reclaims stale files when created.
    let stale = swap_dir.join(format!("swap-{DEAD_PID}-0-0.tzswap"));
    std::fs::write(&stale, vec![0u8; 8192]).unwrap();
    std::fs::write(swap_dir.join("notes.txt"), "not ours").unwrap();
    std::fs::write(swap_dir.join("swap-12-x-0.tzswap"), "not our pattern").unwrap();

    let live_name = space.files()[0]
        .path()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let me = std::process::id();
    for dir in [tmp.path(), swap_dir.as_path()] {
        let r = swap_report(dir);
        assert_eq!(r["kind"], "swap");
        assert_eq!(r["dir_mode"], "0700");
        assert_eq!(r["live_files"], 1);
        assert_eq!(r["stale_files"], 1);
        assert_eq!(r["stale_bytes"], 8192);
        assert_eq!(r["live_bytes"], 1u64 << 20);
        assert_eq!(r["total_bytes"], (1u64 << 20) + 8192);
        assert_eq!(r["other_entries"], 2);
        let files = r["files"].as_array().unwrap();
        assert_eq!(files.len(), 2);
        let live = files
            .iter()
            .find(|f| f["name"] == live_name.as_str())
            .unwrap();
        assert_eq!(live["pid"], me);
        assert_eq!(live["alive"], true);
        assert_eq!(live["mode"], "0600");
        let dead = files.iter().find(|f| f["pid"] == DEAD_PID).unwrap();
        assert_eq!(dead["alive"], false);
    }

    let out = tierzero(&["inspect", tmp.path().to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let s = &out.stdout;
    let live_line = s.lines().find(|l| l.ends_with(&live_name)).unwrap();
    assert!(live_line.contains(" live "), "{live_line}");
    assert!(live_line.contains("0600"), "{live_line}");
    let stale_line = s
        .lines()
        .find(|l| l.contains(&format!("swap-{DEAD_PID}-")))
        .unwrap();
    assert!(stale_line.contains(" stale "), "{stale_line}");
    assert!(s.contains("total: 2 swap files"), "{s}");
    assert!(s.contains("stale: 1 file, 8 KiB reclaimable"), "{s}");
    assert!(
        s.contains("ignored: 2 entries that are not tierzero swap files"),
        "{s}"
    );

    // A file named with a live pid that does not hold the lock (a reused
    // pid, a zombie rank): stale, as the next run's reclaim takes it (it
    // was called live while that pid lived).
    let mut sleeper = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let reused = swap_dir.join(format!("swap-{}-0-0.tzswap", sleeper.id()));
    std::fs::write(&reused, b"old").unwrap();
    let r = swap_report(tmp.path());
    assert_eq!(
        (r["live_files"].as_u64(), r["stale_files"].as_u64()),
        (Some(1), Some(2)),
        "{r}"
    );
    assert_eq!(r["lock_alive"], true, "{r}");
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    std::fs::remove_file(&reused).unwrap();

    // Once the space is dropped its file is gone; the stale one stays.
    drop(space);
    let r = swap_report(tmp.path());
    assert_eq!(r["live_files"], 0);
    assert_eq!(r["stale_files"], 1);
    // A lock file nobody holds (a killed run's): every file is stale,
    // and the lock is reported as not held, whatever pid it names.
    std::fs::write(swap_dir.join("lock"), format!("{}\n", std::process::id())).unwrap();
    std::fs::write(
        swap_dir.join(format!("swap-{}-5-0.tzswap", std::process::id())),
        b"x",
    )
    .unwrap();
    let r = swap_report(tmp.path());
    assert_eq!(
        (r["live_files"].as_u64(), r["stale_files"].as_u64()),
        (Some(0), Some(2)),
        "{r}"
    );
    assert_eq!(r["lock_alive"], false, "{r}");
}

/// An nvme_path shared by ranks holds `rank<R>/tierzero/`: each is
/// reported, in rank order; `--verify` on swap is refused, not ignored.
#[test]
fn inspect_reports_every_rank_s_swap_directory() {
    let tmp = tempfile::tempdir().unwrap();
    for r in [1, 0] {
        let d = tmp.path().join(format!("rank{r}/tierzero"));
        std::fs::create_dir_all(&d).unwrap();
        let f = d.join(format!("swap-{DEAD_PID}-{r}-0.tzswap"));
        std::fs::write(f, vec![0u8; 4096 * (r + 1)]).unwrap();
    }
    let out = tierzero(&["inspect", tmp.path().to_str().unwrap(), "--json"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["kind"], "rank_swaps");
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for (r, report) in ranks.iter().enumerate() {
        assert!(report["dir"]
            .as_str()
            .unwrap()
            .ends_with(&format!("rank{r}/tierzero")));
        assert_eq!(report["stale_bytes"], 4096 * (r as u64 + 1));
    }
    let out = tierzero(&["inspect", tmp.path().to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        out.stdout.matches("swap directory ").count(),
        2,
        "{}",
        out.stdout
    );
    let out = tierzero(&["inspect", tmp.path().to_str().unwrap(), "--verify"]);
    cli_support::assert_bad_input(&out, "verify on swap", &["--verify", "drop --verify"]);
}

#[test]
fn inspect_rejects_what_is_not_a_swap_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let missing = tmp.path().join("missing");
    for (dir, needle) in [
        (tmp.path(), "is not a swap directory"),
        (file.as_path(), "is not a directory"),
        (missing.as_path(), "No such file"),
    ] {
        let out = tierzero(&["inspect", dir.to_str().unwrap()]);
        assert_eq!(out.code, 2, "{dir:?}: {}", out.stderr);
        let lines: Vec<&str> = out.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{:?}", out.stderr);
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains(needle),
            "{}",
            lines[0]
        );
    }
    // An empty directory (an nvme_path after runs that ended and removed
    // their tierzero/) has no swap files: said so, exit 0 (it was refused).
    let empty = tmp.path().join("nvme");
    std::fs::create_dir(&empty).unwrap();
    let out = tierzero(&["inspect", empty.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("no tierzero swap files"),
        "{}",
        out.stdout
    );
    std::fs::remove_dir(&empty).unwrap();
    // An empty swap directory is fine.
    std::fs::create_dir(tmp.path().join("tierzero")).unwrap();
    let out = tierzero(&["inspect", tmp.path().to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("no tierzero swap files"),
        "{}",
        out.stdout
    );
}

/// With `--model` and `--config`, estimate prints the plan `train` prints
/// for them (the same layout, sizing and renderer), row for row.
#[test]
fn estimate_prints_the_plan_train_allocates() {
    let d = cli_support::scratch("estimate", "plan");
    std::fs::create_dir_all(d.join("m")).unwrap();
    std::fs::write(
        d.join("m/config.json"),
        r#"{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 64,
            "n_layer": 2, "n_head": 2, "tie_word_embeddings": false}"#,
    )
    .unwrap();
    std::fs::create_dir_all(d.join("swap")).unwrap();
    let rows = |text: &str| -> Vec<String> {
        let start = text
            .find("  param homes")
            .unwrap_or_else(|| panic!("{text}"));
        text[start..]
            .lines()
            .take_while(|l| !l.starts_with("  NVMe per step"))
            .map(str::to_owned)
            .collect()
    };
    // Explicit values; then a global batch that implies accumulation (the
    // gradient park) and "auto" sizes that train resolves from the model.
    let explicit = serde_json::json!({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "sub_group_size": 20000,
            "offload_param": {"device": "nvme", "nvme_path": "swap", "buffer_count": 8,
                "buffer_size": 20000},
            "offload_optimizer": {"device": "nvme", "nvme_path": "swap"}},
        "tierzero": {"pinned_budget_bytes": "64MiB"}
    });
    let mut derived = explicit.clone();
    derived["train_batch_size"] = 8.into();
    derived
        .as_object_mut()
        .unwrap()
        .remove("gradient_accumulation_steps");
    derived["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto".into();
    derived["zero_optimization"]["stage3_param_persistence_threshold"] = "auto".into();
    for (what, cfg) in [("explicit", explicit), ("derived", derived)] {
        std::fs::write(d.join("ds.json"), cfg.to_string()).unwrap();
        let e = cli_support::run_tierzero(
            Some(&d),
            &["estimate", "--model", "m", "--config", "ds.json"],
        );
        assert_eq!(e.code, 0, "{what}: {}", e.stderr);
        let t = cli_support::run_tierzero(
            Some(&d),
            &[
                "train",
                "--model",
                "m",
                "--config",
                "ds.json",
                "--steps",
                "1",
                "--seq-len",
                "16",
            ],
        );
        assert_eq!(t.code, 0, "{what}: {}", t.stderr);
        let (got, want) = (rows(&e.stdout), rows(&t.stdout));
        assert!(
            want.len() >= 6 && want.iter().any(|l| l.contains("pinned total")),
            "{what}: {want:?}"
        );
        assert_eq!(got, want, "{what}");
    }
    let j = json(&[
        "estimate",
        "--model",
        d.join("m").to_str().unwrap(),
        "--config",
        d.join("ds.json").to_str().unwrap(),
        "--json",
    ]);
    assert!(
        j["train_plan"]
            .as_str()
            .is_some_and(|p| p.contains("pinned total")),
        "{j}"
    );
    // With --device-memory the plan shown is still the host's run: said so
    // (it was passed off as the GPU run's, without its device tier rows).
    let e = cli_support::run_tierzero(
        Some(&d),
        &[
            "estimate",
            "--model",
            "m",
            "--config",
            "ds.json",
            "--device-memory",
            "1GiB",
        ],
    );
    assert_eq!(e.code, 0, "{}", e.stderr);
    assert!(
        e.stdout
            .contains("`tierzero train` computing on the CPU (`--device cpu`) allocates"),
        "{}",
        e.stdout
    );
}

/// A pinned budget that cuts the param swap-in slots cuts them in the
/// table's rows too, as the plan (and train) cut them: the row of the
/// config counted every slot the buffers cut into (65 where the run took
/// 10), and judged its fit on that.
#[test]
fn the_rows_cut_the_param_slots_to_the_pinned_budget() {
    let d = cli_support::scratch("estimate", "budget-slots");
    std::fs::create_dir_all(d.join("m")).unwrap();
    std::fs::create_dir_all(d.join("swap")).unwrap();
    std::fs::write(
        d.join("m/config.json"),
        r#"{"model_type": "gpt2", "vocab_size": 256, "n_positions": 256, "n_embd": 192,
            "n_layer": 4, "n_head": 4, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let mut seen = Vec::new();
    for budget in ["92MiB", "100MiB", "1GiB"] {
        // The embedded default's config (clipping: gradients spill with
        // the state), its param buffers made large and few.
        let mut cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("src/config/default.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let z = &mut cfg["zero_optimization"];
        z["offload_param"]["nvme_path"] = "swap".into();
        z["offload_param"]["buffer_count"] = 5.into();
        z["offload_param"]["buffer_size"] = 2e6.into();
        z["offload_optimizer"]["nvme_path"] = "swap".into();
        cfg["tierzero"]["pinned_budget_bytes"] = budget.into();
        std::fs::write(d.join("ds.json"), cfg.to_string()).unwrap();
        let j = estimate_model(&d.join("m"), &d.join("ds.json"), &[]);
        let plan = j["train_plan"].as_str().unwrap();
        let at = plan
            .find("param swap buffers (")
            .unwrap_or_else(|| panic!("{plan}"));
        let plan_slots: u64 = plan[at + "param swap buffers (".len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let row = estimate_of(&j, 3, "nvme", "nvme");
        let item = items_named(row, "param swap-in buffers");
        let bytes = u(&item["bytes"]);
        let detail = item["formula"].as_str().unwrap();
        let cut: u64 = detail
            .split("cut into ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{detail}"));
        seen.push((plan_slots, cut, bytes));
    }
    // The largest budget leaves every slot (and so gives a slot's bytes);
    // the two smaller cut them, as the plan does, row and plan alike.
    let (full_slots, full_cut, full_bytes) = seen[2];
    assert_eq!(full_slots, full_cut, "{seen:?}");
    let slot_bytes = full_bytes / full_cut;
    assert!(seen[0].0 < seen[1].0 && seen[1].0 < full_cut, "{seen:?}");
    for (plan_slots, _, bytes) in &seen {
        assert_eq!(*bytes, plan_slots * slot_bytes, "{seen:?}");
    }
}

/// A config whose nvme_path does not exist is estimated with a note that
/// train refuses it until it does (it was said to fit without a word),
/// with the fix; an existing one gets none.
#[test]
fn a_missing_nvme_path_is_noted() {
    let d = cli_support::scratch("estimate", "missing-nvme");
    std::fs::create_dir_all(d.join("there")).unwrap();
    for (dir, noted) in [("not there", true), ("there", false)] {
        let cfg = serde_json::json!({
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": dir},
                "offload_optimizer": {"device": "nvme", "nvme_path": dir}}
        });
        std::fs::write(d.join("ds.json"), cfg.to_string()).unwrap();
        let out = cli_support::run_tierzero(
            Some(&d),
            &["estimate", "--params", "1e6", "--config", "ds.json"],
        );
        assert_eq!(out.code, 0, "{}", out.stderr);
        let notes = out
            .stderr
            .lines()
            .filter(|l| l.contains("directory does not exist") && l.contains("train refuses"))
            .count();
        assert_eq!(notes, if noted { 2 } else { 0 }, "{dir}: {}", out.stderr);
        if noted {
            assert!(
                out.stderr.contains("mkdir -p 'not there'"),
                "{}",
                out.stderr
            );
        }
    }
}

/// "auto" keeps optimizer state resident as train does: never every
/// sub-group, so a model of one sub-group keeps all its state on NVMe (it
/// was counted all resident, in pageable memory), and one of several
/// keeps at most one sub-group's.
#[test]
fn auto_resident_state_is_never_every_sub_group() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("ds.json");
    std::fs::write(
        &cfg,
        format!(
            r#"{{"zero_optimization": {{"stage": 3, "sub_group_size": 1e7,
                "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}}}}}}"#,
            tmp.path().display()
        ),
    )
    .unwrap();
    let nvme = |params: &str| {
        let r = json(&[
            "estimate",
            "--params",
            params,
            "--config",
            cfg.to_str().unwrap(),
            "--json",
        ]);
        let e = estimate_of(&r, 3, "nvme", "none").clone();
        let resident = e["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["what"] == "optimizer state kept resident")
            .map_or(0, |i| u(&i["bytes"]));
        (
            u(&items_named(&e, "fp32 master + Adam m, v")["bytes"]),
            resident,
        )
    };
    // One sub-group of 1e7: all of its state on NVMe (three extents of
    // 4e7 B, 4 KiB-aligned).
    let group_nvme = 3 * align(10_000_000 * 4);
    assert_eq!(nvme("1e7"), (group_nvme, 0));
    // Three: auto keeps one group's (min(prefetch bucket 5e7, 1e7)
    // elements), the rest on NVMe.
    assert_eq!(nvme("3e7"), (2 * group_nvme, 10_000_000 * 12));
}

/// A `sub_group_size` that would cut the model into millions of optimizer
/// sub-groups is refused before any layout is made (`sub_group_size: 10`
/// on GPT-2 small took gigabytes and was killed), naming the smallest
/// size that works.
#[test]
fn a_sub_group_size_cutting_millions_of_groups_is_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("gpt2");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(
        model.join("config.json"),
        r#"{"model_type":"gpt2","vocab_size":50257,"n_positions":1024,"n_embd":768,"n_layer":12,"n_head":12}"#,
    )
    .unwrap();
    let cfg = tmp.path().join("ds.json");
    std::fs::write(
        &cfg,
        r#"{"train_micro_batch_size_per_gpu":1,"zero_optimization":{"stage":3,"sub_group_size":10}}"#,
    )
    .unwrap();
    let started = std::time::Instant::now();
    let out = tierzero(&[
        "estimate",
        "--model",
        model.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
    ]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("12443981 optimizer sub-groups")
            && out.stderr.contains("raise sub_group_size to at least 119"),
        "{}",
        out.stderr
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
}

/// stdout on a full disk (`> /dev/full`) is the user's to fix: exit 2 with
/// one line, not an internal error (exit 1). A `--config` that is a device
/// is named as one (`/dev/zero` was read until memory ran out).
#[test]
fn output_to_a_full_disk_and_a_device_config_are_the_user_s() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        cli_support::skipped("no /dev/full");
        return;
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(["estimate", "--params", "1M"])
        .stdout(full)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error: writing to stdout: No space left on device"),
        "{stderr}"
    );
    // The benches' reports too (they lost their output and exited 0).
    let bench = tempfile::tempdir().unwrap();
    let bench_dir = bench.path().to_str().unwrap();
    for args in [
        &[
            "bench-adam",
            "--params",
            "1K",
            "--steps",
            "1",
            "--repeats",
            "1",
            "--threads",
            "1",
        ][..],
        &[
            "bench-io",
            "--path",
            bench_dir,
            "--size",
            "4MiB",
            "--seconds",
            "0.05",
            "--block-size",
            "1M",
            "--queue-depth",
            "1",
        ][..],
    ] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
            .args(args)
            .stdout(full)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("error: writing to stdout: No space left on device"),
            "{args:?}: {stderr}"
        );
    }
    // bench-adam --json prints its failure object as the others do.
    let out = tierzero(&["bench-adam", "--json", "--params", "0"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    let obj: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(obj["failure"], "bad_input", "{obj}");
    let out = tierzero(&["estimate", "--params", "1M", "--config", "/dev/zero"]);
    cli_support::assert_bad_input(&out, "device config", &["is a character device"]);
}
