//! `tierzero estimate`: memory needs per ZeRO stage and offload choice, and
//! what fits on this machine.
//!
//! The arithmetic is in `tierzero::estimate` (see its docs for every
//! formula and DeepSpeed's for comparison). This file gathers the inputs
//! (the parameter count from `--params` or a model's `config.json`, swap
//! settings and precision from `--config`, the machine from `/proc` and
//! `statvfs`) and prints a table or JSON.
//!
//! Numeric options are taken as strings and parsed here, so that a bad value
//! (`--params banana`, `--ranks 0`) is one line naming the option, exit 2.
//!
//! From a config only the things that size memory are used: precision and
//! the `offload_param` / `offload_optimizer` / `sub_group_size` settings
//! (`tierzero::estimate::load_config` drops batch sizes and the scheduler).
//! Without `--config`, DeepSpeed's defaults size the buffers and params are
//! taken as 16-bit.
//!
//! The table estimates every choice from the model's size. With `--model`
//! and `--config` together, the config's own choice is also printed as the
//! plan `tierzero train` prints at start-up (`train_plan` in the JSON): the
//! real layout through the one sizing policy, rendered by the same code,
//! so it is what the run allocates (`tests/cli_estimate.rs` compares it
//! with train's, row for row). The table's row for that choice is an
//! estimate and can differ from it (its sub-groups, resident state and
//! swap buffers come from the size alone).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::anyhow;
use clap::{Args, ValueEnum};
use serde::Serialize;
use tierzero::config::Stage;
use tierzero::estimate::{
    self, Choice, Estimate, Inputs, LargestSource, Memlock, Report, SwapSettings, Verdict,
};
use tierzero::model::{Model, ModelConfig, UnknownKeys};
use tierzero::units::{format_bytes, parse_bytes, parse_count};

use super::Failure;

/// Precision of the Adam moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Moments {
    /// fp32 m and v (8 bytes per param).
    Fp32,
    /// bf16 m and v (4 bytes per param), as the CPU AdamW kernels support;
    /// an estimate only: ds_config has no key for the moments' dtype, so
    /// `tierzero train` keeps them in fp32.
    Bf16,
}

/// Arguments of `tierzero estimate`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  tierzero estimate --params 7B\n  tierzero estimate --params 13B --largest-layer 400M --ranks 8 --device-memory 80GiB\n  tierzero estimate --model ./gpt2 --config ds_config.json --json"
)]
pub struct EstimateArgs {
    /// Model size in parameters: 7B, 350M, 1.3e9.
    #[arg(
        long,
        value_name = "COUNT",
        required_unless_present = "model",
        conflicts_with = "model",
        allow_negative_numbers = true
    )]
    params: Option<String>,
    /// Params of the largest unit gathered at once (a transformer block);
    /// assumed from --params when omitted.
    #[arg(
        long,
        value_name = "COUNT",
        conflicts_with = "model",
        allow_negative_numbers = true
    )]
    largest_layer: Option<String>,
    /// HF model directory (or its config.json): exact parameter count,
    /// largest unit and largest tensor.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Data-parallel ranks, all on this machine.
    #[arg(
        long,
        value_name = "N",
        default_value = "1",
        allow_negative_numbers = true
    )]
    ranks: String,
    /// ds_config.json giving precision and swap buffer settings
    /// (DeepSpeed's defaults and 16-bit params without it).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Precision of the Adam moments.
    #[arg(long, value_enum, default_value = "fp32")]
    moments: Moments,
    /// Accelerator memory per rank, e.g. 80GiB. Without it the CPU is
    /// taken as the compute device (its memory is the RAM).
    #[arg(long, value_name = "SIZE", allow_negative_numbers = true)]
    device_memory: Option<String>,
    /// Directory NVMe swap would use, for its free space (default: the
    /// config's nvme_path, else the current directory).
    #[arg(long, value_name = "DIR")]
    nvme_path: Option<PathBuf>,
    /// Print the full report as JSON.
    #[arg(long)]
    json: bool,
}

fn bad(msg: String) -> Failure {
    Failure::BadInput(anyhow!(msg))
}

struct ModelSize {
    total_numel: u64,
    largest_unit_numel: u64,
    largest_tensor_numel: u64,
    /// The model, for the rules that need its params (which the units
    /// share).
    model: Model,
}

fn model_size(path: &Path) -> Result<ModelSize, Failure> {
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    let text = tierzero::durable::read_regular_text(&file, tierzero::model::io::MAX_JSON_BYTES)
        .map_err(|e| bad(format!("--model: cannot read {}: {e}", file.display())))?;
    // Sizes only, nothing is trained or evaluated: an unknown key is warned
    // about (it could still mean tensors this estimate does not count).
    let (cfg, unknown) = ModelConfig::from_hf_json_with(&text, UnknownKeys::Allow)
        .map_err(|e| bad(format!("--model {}: {e}", file.display())))?;
    if !unknown.is_empty() {
        errln!(
            "warning: --model {}: config.json keys tierzero does not know ({}) are sized as if \
             absent (a quantization_config, for one, would make the weights smaller than shown); \
             train and eval refuse them without --allow-unknown-model-keys",
            file.display(),
            unknown.join(", ")
        );
    }
    let model = Model::new(cfg).map_err(|e| bad(format!("--model {}: {e}", file.display())))?;
    let params = model.params();
    let largest_unit_numel = model.largest_unit_numel();
    Ok(ModelSize {
        total_numel: model.numel() as u64,
        largest_unit_numel,
        largest_tensor_numel: params.iter().map(|p| p.numel as u64).max().unwrap_or(0),
        model,
    })
}

/// `p` if it is a directory, else its nearest ancestor that is.
fn existing_ancestor(p: &Path) -> Option<PathBuf> {
    let mut cur = p;
    loop {
        let dir = if cur.as_os_str().is_empty() {
            Path::new(".")
        } else {
            cur
        };
        if dir.is_dir() {
            return Some(dir.to_path_buf());
        }
        cur = cur.parent()?;
    }
}

/// What a config contributes.
struct FromConfig {
    swap: SwapSettings,
    param_elem_bytes: u64,
    /// [`Inputs::bf16_grad_numel`]: 0 without a config or a model.
    bf16_grad_numel: u64,
    nvme_path: Option<PathBuf>,
    choice: Choice,
    /// With a model and a config: the plan `tierzero train` prints for
    /// them ([`train_plan`]).
    train_plan: Option<String>,
    /// With a model: rank 0's shape under the config ([`Inputs::shape`]),
    /// and its largest unit's sub-groups ([`Inputs::largest_unit_groups`]).
    shape: Option<(tierzero::engine::sizing::Shape, u64)>,
    /// [`Inputs::device_adam_refusal`].
    device_adam_refusal: Option<String>,
    /// [`Inputs::bf16_params`].
    bf16_params: bool,
    /// [`Inputs::persistent`]: `(0, 0)` without a model.
    persistent: (u64, u64),
}

/// The start-up plan `tierzero train` prints for the config `text` and
/// `model` on rank 0 of `ranks`: the config resolved as train resolves it
/// (its `RunContext`: the model's hidden size, size and largest param, so
/// `"auto"` keys and the batch come out the same; no flags), the
/// trainer's layout and the one sizing policy's answer
/// ([`tierzero::engine::sizing::decide_within`], with the same free NVMe
/// space), rendered by the same [`tierzero::run::Plan`]; or the error
/// train would stop with. (The table above it estimates every choice from
/// the model's size; this is the config's own, as the run allocates it.)
fn train_plan(text: &str, model: &Model, ranks: u64) -> String {
    use tierzero::config::{parse_str, PathChecks, RunContext};
    use tierzero::engine::sizing::{decide_within, nvme_available_bytes, Shape};
    let resolved = parse_str(text).and_then(|parsed| {
        let total_steps = parsed
            .scheduler_total_steps()
            .unwrap_or(tierzero::run::DEFAULT_STEPS);
        parsed.resolve(&RunContext {
            total_steps: Some(total_steps),
            hidden_size: Some(model.config().hidden_size as u64),
            model_numel: Some(model.numel() as u64),
            largest_param_numel: model.params().iter().map(|p| p.numel as u64).max(),
            ranks,
            path_checks: PathChecks::Skip,
            ..RunContext::default()
        })
    });
    let config = match resolved {
        Ok(l) => l.config,
        Err(e) => return format!("tierzero train would refuse this config: {e}"),
    };
    let world = usize::try_from(ranks).unwrap_or(usize::MAX);
    let sub_group = usize::try_from(config.zero.sub_group_numel.0).unwrap_or(usize::MAX);
    let layout = tierzero::engine::Layout::new(model, 0, world, sub_group);
    let shape = Shape::of(&config, model, &layout);
    match decide_within(&config, &shape, nvme_available_bytes(&config, world)) {
        Ok(sizing) => tierzero::run::Plan::new(
            &config,
            model,
            &layout,
            &sizing,
            format!("cpu (rank 0 of {ranks})"),
        )
        .to_string(),
        Err(short) => format!(
            "tierzero train would stop at start-up: {}",
            tierzero::engine::EngineError::from(short)
        ),
    }
}

fn load_config(
    path: Option<&Path>,
    ranks: u64,
    total_numel: u64,
    model: Option<&Model>,
) -> Result<FromConfig, Failure> {
    let text = match path {
        Some(p) => super::read_config_text(p)?,
        None => "{}".to_owned(),
    };
    let loaded = match model {
        Some(m) => estimate::load_config_for_model(&text, ranks, m),
        None => estimate::load_config(&text, ranks, total_numel),
    }
    .map_err(|e| bad(format!("--config: {e}")))?;
    // Before the layouts below (each would take the memory); with
    // --params too (its rows were sized as if sub_group_size were larger,
    // and said it fits a config train refuses).
    tierzero::engine::check_sub_group_count(
        model.map_or(total_numel, |m| m.numel() as u64),
        usize::try_from(ranks).unwrap_or(usize::MAX),
        loaded.config.zero.sub_group_numel.0,
    )
    .map_err(|e| bad(format!("--config: {e}")))?;
    // As train says them (one "warning:" line each).
    for w in &loaded.warnings {
        errln!("warning: {w}");
    }
    let c = &loaded.config;
    // An "auto" accumulation is train's --grad-accum: above 1 with the
    // optimizer state on NVMe it parks sums there, which the rows then
    // leave out. Said (it was taken as 1 without a word).
    if loaded.resolved.iter().any(|r| {
        r.key == "gradient_accumulation_steps" && r.source == tierzero::config::Source::HfDefault
    }) && c.zero.offload_optimizer.device.nvme_path().is_some()
    {
        errln!(
            "note: gradient_accumulation_steps is \"auto\" (train's --grad-accum fills it): \
             estimated as 1; above 1, with the optimizer state on NVMe, a run also parks its \
             gradient sums there (4 B a param) through {} pinned buffers of a sub-group: set \
             it in the config to estimate that",
            tierzero::engine::sizing::park_buffers(0).count
        );
    }
    // A config's nvme_path that does not exist: train refuses it (the
    // estimate said the config fits, and measured the nearest existing
    // directory's free space without a word).
    for (key, dir) in [
        (
            "zero_optimization.offload_param.nvme_path",
            c.zero.offload_param.device.nvme_path(),
        ),
        (
            "zero_optimization.offload_optimizer.nvme_path",
            c.zero.offload_optimizer.device.nvme_path(),
        ),
    ] {
        // (The embedded default's ./tierzero-swap/ is made by train.)
        if let Some(dir) = dir.filter(|d| path.is_some() && !d.exists()) {
            errln!(
                "note: {}; train refuses the config until it exists (its free space here is the \
                 nearest existing directory's)",
                tierzero::config::ConfigError::NvmePathNotFound {
                    key: key.to_owned(),
                    dir: dir.to_path_buf(),
                }
            );
        }
    }
    let nvme_path = nvme_path_of(c);
    Ok(FromConfig {
        swap: SwapSettings::from_config(c),
        param_elem_bytes: if path.is_some() {
            c.precision.param_elem_bytes()
        } else {
            2
        },
        bf16_grad_numel: match (path, model) {
            (Some(_), Some(m)) => tierzero::engine::sizing::bf16_grad_numel(
                c,
                m,
                usize::try_from(ranks).unwrap_or(usize::MAX),
            ),
            _ => 0,
        },
        nvme_path,
        choice: estimate::choice_of_config(c),
        train_plan: match (path, model) {
            (Some(_), Some(m)) => Some(train_plan(&text, m, ranks)),
            _ => None,
        },
        device_adam_refusal: {
            // As train decides it with nothing offloaded, its devices
            // joined by NCCL (several ranks on CUDA always are).
            let mut none = c.clone();
            none.zero.offload_optimizer.device = tierzero::config::OffloadDevice::None;
            none.zero.offload_param.device = tierzero::config::OffloadDevice::None;
            let world = usize::try_from(ranks).unwrap_or(usize::MAX);
            tierzero::engine::device::trains_resident(&none, world, world).err()
        },
        // Without a config the params are taken as 16-bit (2 B, above):
        // bf16, the 16-bit precision Adam on the device takes.
        bf16_params: path.is_none() || matches!(c.precision, tierzero::config::Precision::Bf16),
        persistent: model.map_or((0, 0), |m| {
            let persistent = tierzero::engine::sizing::persistent_params(
                m,
                c.zero.param_persistence_threshold_numel.0,
                c.zero.model_persistence_threshold_numel.0,
            );
            let (numel, count) = tierzero::engine::sizing::persistent_total(m, &persistent, None);
            (numel, count as u64)
        }),
        shape: model.map(|m| {
            let world = usize::try_from(ranks).unwrap_or(usize::MAX);
            let sub_group = usize::try_from(c.zero.sub_group_numel.0).unwrap_or(usize::MAX);
            let layout = tierzero::engine::Layout::new(m, 0, world, sub_group);
            (
                tierzero::engine::sizing::Shape::of(c, m, &layout),
                tierzero::engine::sizing::largest_unit_groups(m, &layout),
            )
        }),
    })
}

/// Runs `tierzero estimate`.
pub fn run(a: EstimateArgs) -> Result<(), Failure> {
    super::json_object_on_failure(a.json);
    let ranks: u64 = a
        .ranks
        .trim()
        .parse()
        .map_err(|_| bad(format!("--ranks: {:?} is not a whole number", a.ranks)))?;
    if ranks == 0 {
        return Err(bad("--ranks must be at least 1 (got 0)".to_owned()));
    }
    // Every rank is counted on this machine (before the model is read).
    if ranks > estimate::MAX_RANKS {
        return Err(bad(
            estimate::EstimateError::TooManyRanks { ranks }.to_string()
        ));
    }
    let mut model = None;
    let (total_numel, largest_unit_numel, largest_source, largest_tensor_numel) =
        match (&a.model, &a.params) {
            (Some(dir), _) => {
                let m = model_size(dir)?;
                let sizes = (
                    m.total_numel,
                    m.largest_unit_numel,
                    LargestSource::Model,
                    Some(m.largest_tensor_numel),
                );
                model = Some(m.model);
                sizes
            }
            (None, Some(p)) => {
                let n = parse_count(p).map_err(|e| bad(format!("--params: {e}")))?;
                if n == 0 {
                    return Err(bad("--params must be at least 1 (got 0)".to_owned()));
                }
                // Byte counts of a model beyond 2^48 params (times the
                // bytes a param takes, over the tiers) would not fit in 64
                // bits: no machine holds one.
                let max = tierzero::config::MAX_SIZE_NUMEL;
                if n > max {
                    return Err(bad(format!(
                        "--params {n} is beyond what can be estimated (at most {max}, 2^48)"
                    )));
                }
                match &a.largest_layer {
                    Some(l) => {
                        let l = parse_count(l).map_err(|e| bad(format!("--largest-layer: {e}")))?;
                        (n, l, LargestSource::Given, None)
                    }
                    None => (
                        n,
                        estimate::assumed_largest_unit_numel(n),
                        LargestSource::Assumed,
                        None,
                    ),
                }
            }
            (None, None) => return Err(bad("give --params COUNT or --model DIR".to_owned())),
        };
    let device_bytes = match &a.device_memory {
        Some(s) => {
            let b = parse_bytes(s).map_err(|e| bad(format!("--device-memory: {e}")))?;
            if b == 0 {
                return Err(bad("--device-memory must be above 0".to_owned()));
            }
            // A bare count below a MiB is a unit left out ("80" for 80 GiB:
            // it sized a device of 80 bytes).
            // (`1e3` too: a number without a unit letter.)
            if b < 1 << 20
                && s.trim()
                    .bytes()
                    .all(|c| c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'E' | b'+'))
            {
                return Err(bad(format!(
                    "--device-memory {s}: {s} bytes; give the unit, e.g. --device-memory {s}GiB"
                )));
            }
            Some(b)
        }
        None => None,
    };
    let cfg = load_config(a.config.as_deref(), ranks, total_numel, model.as_ref())?;
    let nvme_dir = match &a.nvme_path {
        Some(p) => {
            if !p.is_dir() {
                return Err(bad(format!(
                    "--nvme-path {} is not an existing directory",
                    p.display()
                )));
            }
            p.clone()
        }
        None => match &cfg.nvme_path {
            // A config's nvme_path may not exist yet (a run creates it):
            // measure the file system it would be created on.
            Some(p) => existing_ancestor(p).unwrap_or_else(|| p.clone()),
            None => PathBuf::from("."),
        },
    };
    let inputs = Inputs {
        total_numel,
        largest_unit_numel,
        largest_source,
        largest_tensor_numel,
        ranks,
        param_elem_bytes: cfg.param_elem_bytes,
        moment_elem_bytes: match a.moments {
            Moments::Fp32 => 4,
            Moments::Bf16 => 2,
        },
        bf16_grad_numel: cfg.bf16_grad_numel,
        tied_numel: model
            .as_ref()
            .map_or(0, tierzero::engine::sizing::tied_numel),
        swap: cfg.swap,
        device_adam_refusal: cfg.device_adam_refusal,
        bf16_params: cfg.bf16_params,
        persistent: cfg.persistent,
        largest_unit_groups: cfg.shape.as_ref().map(|s| s.1),
        shape: cfg.shape.map(|s| s.0),
    };
    let machine = estimate::probe_machine(&nvme_dir, device_bytes);
    let mut report = estimate::estimate(&inputs, &machine).map_err(|e| bad(e.to_string()))?;
    if machine.nvme_free_bytes.is_none() {
        report.notes.push(format!(
            "free space of {} is unknown (it may not exist yet): NVMe choices are not counted as fitting; pass --nvme-path",
            nvme_dir.display()
        ));
    }
    if a.json {
        let out = JsonOut {
            report: &report,
            config_choice: a.config.as_ref().map(|_| cfg.choice),
            train_plan: cfg.train_plan.as_deref(),
        };
        let text = serde_json::to_string_pretty(&out)
            .map_err(|e| Failure::Internal(anyhow!("serialising the report: {e}")))?;
        super::emit(&format!("{text}\n"))?;
    } else {
        let text = render_table(&report, a.config.as_ref().map(|_| cfg.choice))
            .map_err(|e| Failure::Internal(anyhow!("formatting the report: {e}")))?;
        super::emit(&text)?;
        if let Some(plan) = &cfg.train_plan {
            // The plan is the host's run: a device's tier (its params,
            // staging, registered buffers) is in the table's device
            // column alone; said, not passed off as the GPU run's plan.
            let run = match &a.device_memory {
                Some(_) => {
                    "`tierzero train` computing on the CPU (`--device cpu`) allocates \
                            (its start-up plan, the same sizing; with a device, its tier's rows \
                            are not shown here: see the device column above)"
                }
                None => "`tierzero train` allocates (its start-up plan, the same sizing)",
            };
            super::emit(&format!("\nWith this config and model, {run}:\n{plan}\n"))?;
        }
    }
    Ok(())
}

/// The JSON output: the report, and the choice `--config` selects.
#[derive(Serialize)]
struct JsonOut<'a> {
    #[serde(flatten)]
    report: &'a Report,
    config_choice: Option<Choice>,
    /// With `--model` and `--config`: the plan `tierzero train` prints.
    train_plan: Option<&'a str>,
}

fn count(n: u64) -> String {
    let f = n as f64;
    if f >= 1e12 {
        format!("{:.2}T", f / 1e12)
    } else if f >= 1e9 {
        format!("{:.2}B", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.1}M", f / 1e6)
    } else if f >= 1e3 {
        format!("{:.1}K", f / 1e3)
    } else {
        format!("{n}")
    }
}

fn opt_bytes(b: Option<u64>) -> String {
    b.map(format_bytes).unwrap_or_else(|| "unknown".to_owned())
}

fn fit_text(e: &Estimate, device_known: bool) -> String {
    if e.fit.fits {
        return if e.fit.pinned_over_memlock {
            "yes (raise memlock)".to_owned()
        } else {
            "yes".to_owned()
        };
    }
    let mut why = Vec::new();
    let mut unknown = Vec::new();
    let mut check = |v: Verdict, name: &'static str| match v {
        Verdict::TooSmall => why.push(name),
        Verdict::Unknown => unknown.push(name),
        Verdict::Fits => {}
    };
    if device_known {
        check(e.fit.device, "device");
    }
    check(e.fit.host, "RAM");
    check(e.fit.nvme, "NVMe");
    if e.refused.is_some() {
        // Train refuses the config, whatever the machine (the notes say
        // why and the fix).
        why.push("param buffer");
    }
    if why.is_empty() {
        format!("? ({} unknown)", unknown.join(", "))
    } else {
        format!("no: {}", why.join(", "))
    }
}

fn choice_text(c: Choice) -> String {
    let mut s = format!(
        "stage {}, offload_optimizer {}",
        c.stage.number(),
        c.optimizer.name()
    );
    if c.stage == Stage::Parameters {
        s.push_str(&format!(", offload_param {}", c.params.name()));
    }
    s
}

fn render_table(r: &Report, config_choice: Option<Choice>) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    let i = &r.inputs;
    let m = &r.machine;
    let device_known = m.device_bytes.is_some();
    let largest = match i.largest_source {
        LargestSource::Given => "given",
        LargestSource::Model => "from the model",
        LargestSource::Assumed => "assumed",
    };
    writeln!(
        out,
        "model: {} params ({}), largest unit {} params ({largest}); {} rank{} on this machine",
        count(i.total_numel),
        i.total_numel,
        count(i.largest_unit_numel),
        i.ranks,
        if i.ranks == 1 { "" } else { "s" }
    )?;
    // With the optimizer state in host memory (the rows name the bytes).
    let grads = match i.bf16_grad_numel {
        0 => "fp32 grads 4 B".to_owned(),
        b if b >= i.total_numel => {
            "fp32 grads 4 B (on the host: 2 B, bf16 as they came)".to_owned()
        }
        b => format!(
            "fp32 grads 4 B (on the host: 2 B, bf16 as they came, for {} params)",
            count(b)
        ),
    };
    writeln!(out,
        "per param: params {} B, {grads}, fp32 master + m + v {} B; activations not included \
         (the blocks' kept forward graphs take at most tierzero.activation_budget_bytes, by default \
         half the memory left once the run is built; the rest are recomputed)",
        i.param_elem_bytes,
        4 + 2 * i.moment_elem_bytes
    )?;
    let memlock = match m.memlock {
        Some(Memlock::Unlimited) => "unlimited".to_owned(),
        Some(Memlock::Bytes(b)) => format_bytes(b),
        None => "unknown".to_owned(),
    };
    writeln!(
        out,
        "machine: RAM {} ({} available), memlock {memlock}, NVMe free {} at {}, device {}",
        opt_bytes(m.ram_bytes),
        opt_bytes(m.ram_available_bytes),
        opt_bytes(m.nvme_free_bytes),
        m.nvme_dir.as_deref().unwrap_or("?"),
        match m.device_bytes {
            Some(b) => format!("{} per rank", format_bytes(b)),
            None => "= CPU (GPU memory unknown; see --device-memory)".to_owned(),
        }
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "{:<5} {:<9} {:<6} | {:>12} | {:>11} {:>11} {:>11} | {:>21} | fits",
        "stage",
        "optimizer",
        "params",
        "device/rank",
        "pinned",
        "pageable",
        "NVMe",
        "DeepSpeed CPU / GPU"
    )?;
    writeln!(
        out,
        "{:<22} | {:>12} | {:^35} | {:>21} |",
        "", "", "(all ranks)", ""
    )?;
    for e in &r.estimates {
        let c = e.choice;
        let ds = e
            .deepspeed
            .map(|d| {
                format!(
                    "{} / {}",
                    format_bytes(d.cpu_bytes),
                    format_bytes(d.gpu_bytes)
                )
            })
            .unwrap_or_else(|| "-".to_owned());
        let mut mark = String::new();
        if r.recommended == Some(c) {
            mark.push_str("  <- recommended");
        }
        if config_choice == Some(c) {
            mark.push_str("  <- your config");
        }
        writeln!(
            out,
            "{:<5} {:<9} {:<6} | {:>12} | {:>11} {:>11} {:>11} | {:>21} | {}{mark}",
            c.stage.number(),
            c.optimizer.name(),
            if c.stage == Stage::Parameters {
                c.params.name()
            } else {
                "-"
            },
            format_bytes(e.per_rank.device_bytes),
            format_bytes(e.per_node.pinned_bytes),
            format_bytes(e.per_node.pageable_bytes),
            format_bytes(e.per_node.nvme_bytes),
            ds,
            fit_text(e, device_known)
        )?;
    }
    writeln!(out)?;
    match r.recommended {
        Some(c) => {
            writeln!(out, "recommended: {}", choice_text(c))?;
            if let Some(e) = r.estimates.iter().find(|e| e.choice == c) {
                writeln!(out, "  per rank:")?;
                for it in &e.items {
                    writeln!(
                        out,
                        "    {:<8} {:>11}  {} = {}",
                        format!("{:?}", it.tier).to_lowercase(),
                        format_bytes(it.bytes),
                        it.what,
                        it.formula
                    )?;
                }
            }
        }
        None => {
            write!(out, "recommended: nothing fits on this machine")?;
            let closest = r
                .closest
                .and_then(|c| r.estimates.iter().find(|e| e.choice == c));
            if let Some(e) = closest {
                let m = &r.machine;
                write!(
                    out,
                    "; closest: {} needs RAM {} (usable {}), NVMe {} (free {})",
                    choice_text(e.choice),
                    format_bytes(e.node_ram_bytes),
                    opt_bytes(m.ram_bytes.map(|b| b / 100 * estimate::HOST_USABLE_PERCENT)),
                    format_bytes(e.per_node.nvme_bytes),
                    opt_bytes(m.nvme_free_bytes)
                )?;
                if let Some(d) = m.device_bytes {
                    write!(
                        out,
                        ", device {} per rank (usable {})",
                        format_bytes(e.per_rank.device_bytes),
                        format_bytes(d / 100 * estimate::DEVICE_USABLE_PERCENT)
                    )?;
                }
            }
            writeln!(out)?;
        }
    }
    for n in &r.notes {
        writeln!(out, "note: {n}")?;
    }
    Ok(out)
}

/// The swap path whose free space the estimate checks the NVMe total
/// against: the params' or the optimizer's `nvme_path`, and where they are
/// on two file systems the one with less free space, said (the params'
/// path alone was taken: a run whose optimizer state did not fit its own
/// disk was said to fit, and the reverse).
fn nvme_path_of(c: &tierzero::config::Config) -> Option<PathBuf> {
    let params = c.zero.offload_param.device.nvme_path();
    let optimizer = c.zero.offload_optimizer.device.nvme_path();
    let free = tierzero::engine::sizing::available_bytes_at;
    match (params, optimizer) {
        (Some(p), Some(o)) if !tierzero::engine::sizing::same_file_system(p, o) => {
            let smaller = match (free(p), free(o)) {
                (Some(fp), Some(fo)) if fo < fp => o,
                _ => p,
            };
            errln!(
                "note: the params' nvme_path {} and the optimizer's {} are on two file systems; \
                 the NVMe total is checked against the one with less free space, {}",
                p.display(),
                o.display(),
                smaller.display()
            );
            Some(smaller.to_path_buf())
        }
        (p, o) => p.or(o).map(Path::to_path_buf),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierzero::estimate::Offload;

    #[test]
    fn nvme_path_falls_back_to_an_existing_ancestor() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let deep = tmp.path().join("a/b/c");
        assert_eq!(existing_ancestor(&deep), Some(tmp.path().to_path_buf()));
        assert_eq!(
            existing_ancestor(tmp.path()),
            Some(tmp.path().to_path_buf())
        );
        assert_eq!(
            existing_ancestor(Path::new("no-such-dir-here")),
            Some(PathBuf::from("."))
        );
    }

    #[test]
    fn counts_read_well() {
        assert_eq!(count(7_000_000_000), "7.00B");
        assert_eq!(count(124_439_808), "124.4M");
        assert_eq!(count(999), "999");
    }

    #[test]
    fn offload_names() {
        assert_eq!(
            choice_text(Choice {
                stage: Stage::Parameters,
                optimizer: Offload::Nvme,
                params: Offload::Cpu
            }),
            "stage 3, offload_optimizer nvme, offload_param cpu"
        );
    }
}
