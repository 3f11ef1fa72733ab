//! The offload sections validated: each device and its `nvme_path`, the
//! param and optimizer offload settings, the pinned budget against the
//! buffers the sizing policy needs, and the swap directories' checks.

use super::*;

pub(super) fn device(
    section: &str,
    dev: DsDevice,
    nvme_path: Option<&PathBuf>,
    sink: &mut Sink,
) -> Result<OffloadDevice, ConfigError> {
    let key = format!("zero_optimization.{section}.nvme_path");
    match (dev, nvme_path) {
        (DsDevice::Nvme, Some(p)) => Ok(OffloadDevice::Nvme { path: p.clone() }),
        (DsDevice::Nvme, None) => Err(ConfigError::NvmePathMissing {
            key,
            device_key: format!("zero_optimization.{section}.device"),
        }),
        (other, Some(_)) => {
            sink.note(
                &key,
                format!(
                    "ignored because device is \"{}\", not \"nvme\"",
                    other.as_str()
                ),
            );
            Ok(if other == DsDevice::Cpu {
                OffloadDevice::Cpu
            } else {
                OffloadDevice::None
            })
        }
        (DsDevice::Cpu, None) => Ok(OffloadDevice::Cpu),
        (DsDevice::None, None) => Ok(OffloadDevice::None),
    }
}

pub(super) fn validate_param_offload(
    p: Option<&DsOffloadParam>,
    stage: Stage,
    sink: &mut Sink,
) -> Result<ParamOffload, ConfigError> {
    let d = DsOffloadParam::default();
    let given = p.unwrap_or(&d);
    // Below stage 3 nothing partitions the params: DeepSpeed's stage 1
    // and 2 never read the block (a stage-3 config switched to stage 2
    // runs there), so it is ignored here too, and said.
    let p = if given.device != DsDevice::None && stage != Stage::Parameters {
        sink.note(
            "zero_optimization.offload_param",
            format!(
                "ignored: device \"{}\" offloads params at ZeRO stage 3 only, and the stage is \
                 {}; DeepSpeed ignores it too (set \"stage\": 3 to offload them)",
                given.device.as_str(),
                stage.number()
            ),
        );
        &d
    } else {
        given
    };
    let dev = device("offload_param", p.device, p.nvme_path.as_ref(), sink)?;
    if matches!(dev, OffloadDevice::Nvme { .. }) {
        within(
            "zero_optimization.offload_param.buffer_count",
            p.buffer_count,
            MAX_BUFFER_COUNT,
            "use DeepSpeed's default 5",
        )?;
        within(
            "zero_optimization.offload_param.buffer_size",
            p.buffer_size,
            MAX_SIZE_NUMEL,
            "use a size (in elements) at least as large as the largest parameter, e.g. 1e8",
        )?;
    }
    Ok(ParamOffload {
        device: dev,
        buffer_count: p.buffer_count,
        buffer_numel: Numel(p.buffer_size),
        max_in_cpu_numel: Numel(p.max_in_cpu),
        pin_memory: p.pin_memory,
    })
}

pub(super) fn validate_optimizer_offload(
    o: Option<&DsOffloadOptimizer>,
    stage: Stage,
    sink: &mut Sink,
) -> Result<OptimizerOffload, ConfigError> {
    let d = DsOffloadOptimizer::default();
    let o = o.unwrap_or(&d);
    let dev = device("offload_optimizer", o.device, o.nvme_path.as_ref(), sink)?;
    match (&dev, stage) {
        (OffloadDevice::Nvme { .. }, s) if s != Stage::Parameters => {
            return Err(ConfigError::NvmeOptimizerNeedsStage3 { stage: s.number() })
        }
        (OffloadDevice::Cpu, Stage::Disabled) => {
            return Err(range(
                "zero_optimization.offload_optimizer.device",
                "\"cpu\"",
                "\"none\" with zero_optimization.stage 0 (offload needs stage 1, 2 or 3)",
                "set zero_optimization.stage to 3 (or 1/2)",
            ))
        }
        (OffloadDevice::Nvme { .. }, _) if o.buffer_count < 4 || o.buffer_count > MAX_BUFFER_COUNT => return Err(range(
            "zero_optimization.offload_optimizer.buffer_count",
            o.buffer_count,
            &format!("at least 4 with nvme (fp32 params, Adam m and v, and gradients each take a buffer), at most {MAX_BUFFER_COUNT}"),
            "use DeepSpeed's default 4",
        )),
        _ => {}
    }
    twin_flow_ratio(o.ratio, &dev, stage, sink)?;
    Ok(OptimizerOffload {
        device: dev,
        buffer_count: o.buffer_count,
        pin_memory: o.pin_memory,
        pipeline_read: o.pipeline_read,
        pipeline_write: o.pipeline_write,
        fast_init: o.fast_init,
    })
}

/// `offload_optimizer.ratio` (DeepSpeed: 0 to 1, default 1.0, read by
/// its stage-3 optimizer when the optimizer is offloaded: of the n
/// sub-groups, the first `int((1 - ratio) x n)` are stepped on the GPU
/// and the rest on the CPU, ZeRO-Offload++'s Twin-Flow, documented for
/// `device: "cpu"`). tierzero steps all of the offloaded state on the
/// CPU, which is 1.0: a smaller ratio trains the same math here, with
/// all of Adam's time on the host, and says so.
fn twin_flow_ratio(
    ratio: f64,
    dev: &OffloadDevice,
    stage: Stage,
    sink: &mut Sink,
) -> Result<(), ConfigError> {
    const KEY: &str = "zero_optimization.offload_optimizer.ratio";
    if !(0.0..=1.0).contains(&ratio) {
        return Err(range(
            KEY,
            ratio,
            "a share from 0 to 1",
            "use DeepSpeed's default 1.0 (all of the optimizer state on the CPU)",
        ));
    }
    if ratio < 1.0 && stage != Stage::Parameters {
        // DeepSpeed's `offload_ratio_check` asserts it, whatever the device.
        return Err(range(
            KEY,
            ratio,
            "1.0 below stage 3 (DeepSpeed: \"Partial offloading only supported for ZeRO Stage 3\")",
            "remove ratio, or use zero_optimization.stage 3",
        ));
    }
    if ratio < 1.0 {
        let msg = match dev {
            OffloadDevice::None => "has no effect without optimizer offload".to_owned(),
            OffloadDevice::Nvme { .. } => format!(
                "{ratio} asks DeepSpeed to step the first {:.2} of the optimizer's sub-groups on \
                 the GPU (ZeRO-Offload++ Twin-Flow, documented for device \"cpu\"); tierzero \
                 steps all of them on the CPU, from NVMe",
                1.0 - ratio
            ),
            OffloadDevice::Cpu => format!(
                "{ratio} asks DeepSpeed to step the first {:.2} of the optimizer's sub-groups on \
                 the GPU and the rest on the CPU (ZeRO-Offload++ Twin-Flow); tierzero steps all \
                 of them on the CPU: the same results, with all of Adam's time on the host",
                1.0 - ratio
            ),
        };
        sink.note(KEY, msg);
    }
    Ok(())
}

/// `tierzero.pinned_budget_bytes` against the swap buffers, with the
/// engine's own sizing policy ([`crate::engine::sizing`]): on a model
/// known by its size (`run.model_numel`) the whole decision, else the
/// param swap-in buffers alone (the optimizer's depend on the model's
/// sub-groups). The engine checks again with the real layout at build.
///
/// The engine cuts the param swap-in buffers into slots of the largest
/// NVMe shard ([`sizing::param_slots`], never fewer than `buffer_count`),
/// which an estimated shape does not know: with the largest param known,
/// a budget that holds `buffer_count` slots of its shard passes here (the
/// least the engine maps when that param goes to NVMe; where `max_in_cpu`
/// keeps it in host memory the engine's slots are smaller still, and this
/// check can refuse a budget the build would take). The build's check,
/// with the real shards, has the last word and the numbers.
pub(super) fn check_pinned_budget(c: &Config, run: &RunContext) -> Result<(), ConfigError> {
    use crate::engine::sizing::{self, Shape};
    let Some(budget) = c.tierzero.pinned_budget_bytes else {
        return Ok(());
    };
    let p = &c.zero.offload_param;
    let elem = c.precision.param_elem_bytes();
    let short = match run.model_numel {
        // Beyond any machine (and 64-bit byte counts): the estimate
        // refuses such a model; the run's own check has the real layout.
        Some(model) if model > MAX_SIZE_NUMEL => None,
        Some(model) => {
            let ranks = c.batch.ranks.max(1);
            let per_rank = model.div_ceil(ranks);
            // The largest parameter's shard is a sub-group of its own when
            // it exceeds sub_group_size, as in the engine's layout.
            let largest = run.largest_param_numel.map(|l| l.div_ceil(ranks));
            let shape = Shape::estimated(per_rank, largest, c.zero.sub_group_numel.0);
            sizing::decide(c, &shape).err().and_then(|short| {
                let Some(l) = largest else { return Some(short) };
                let least = sizing::param_slots(short.param_buffers, l.saturating_mul(elem), 1);
                let required = (short
                    .required_bytes
                    .saturating_sub(short.param_buffers.total_bytes()))
                .saturating_add(least.total_bytes());
                (required > budget.0).then_some(sizing::BudgetShort {
                    param_buffers: least,
                    required_bytes: required,
                    ..short
                })
            })
        }
        None => {
            let bufs = sizing::param_buffers(p.buffer_count, p.buffer_numel.0, elem);
            let nvme =
                c.zero.stage == Stage::Parameters && matches!(p.device, OffloadDevice::Nvme { .. });
            (nvme && bufs.total_bytes() > budget.0).then_some(sizing::BudgetShort {
                budget_bytes: budget.0,
                param_buffers: bufs,
                optimizer_buffers_needed: sizing::Buffers::NONE,
                optimizer_stages: 0,
                optimizer_spills_grads: false,
                park_buffers: sizing::Buffers::NONE,
                required_bytes: bufs.total_bytes(),
            })
        }
    };
    let Some(short) = short else {
        return Ok(());
    };
    let mut what = Vec::new();
    let mut parts = Vec::new();
    let mut lower = Vec::new();
    if short.param_buffers.count > 0 {
        what.push("offload_param");
        // The config check sizes an estimated shape: the configured
        // buffers, or (the largest param known) the fewest slots of its
        // shard they can be cut into, the least the engine maps.
        let whole = sizing::param_buffers(p.buffer_count, p.buffer_numel.0, elem).bytes_each;
        parts.push(if short.param_buffers.bytes_each < whole {
            format!(
                "at least buffer_count {} slots of the largest param's shard ({} bytes each, cut from buffers of buffer_size {} elements × {elem} bytes)",
                short.param_buffers.count, short.param_buffers.bytes_each, p.buffer_numel.0
            )
        } else {
            format!(
                "buffer_count {} × buffer_size {} elements × {elem} bytes, 4 KiB-aligned ({} bytes each)",
                short.param_buffers.count, p.buffer_numel.0, short.param_buffers.bytes_each
            )
        });
        lower.push("zero_optimization.offload_param.buffer_count / buffer_size");
    }
    if short.optimizer_buffers_needed.count > 0 {
        what.push("offload_optimizer");
        parts.push(format!(
            "{} buffers (what the optimizer pipeline needs) × {} bytes (the largest sub-group's fp32 state, 4 KiB-aligned; sub_group_size {})",
            short.optimizer_buffers_needed.count,
            short.optimizer_buffers_needed.bytes_each,
            c.zero.sub_group_numel.0
        ));
        lower.push("zero_optimization.sub_group_size");
    }
    if short.park_buffers.count > 0 {
        parts.push(format!(
            "{} gradient park buffers × {} bytes (partial sums between micro-batches; the largest sub-group's fp32 gradient)",
            short.park_buffers.count, short.park_buffers.bytes_each
        ));
    }
    Err(ConfigError::PinnedBudgetTooSmall {
        budget_bytes: budget.0,
        required_bytes: short.required_bytes,
        what: what.join(" + "),
        breakdown: parts.join(" + "),
        lower_keys: lower.join(" or "),
    })
}

/// Checks that `dir` is an existing, writable directory (creating it first
/// with [`PathChecks::CreateMissing`]). Writability is tested by creating
/// and removing a probe file, which also catches read-only mounts that
/// permission bits do not show.
pub(super) fn check_dir(key: &str, dir: &Path, mode: PathChecks) -> Result<(), ConfigError> {
    let not_writable = |reason: String| ConfigError::NvmePathNotWritable {
        key: key.to_owned(),
        dir: dir.to_owned(),
        reason: crate::config::error::truncate(&reason),
    };
    match mode {
        PathChecks::Skip => return Ok(()),
        PathChecks::CreateMissing if !dir.exists() => {
            std::fs::create_dir_all(dir)
                .map_err(|e| not_writable(format!("cannot create it: {e}")))?;
        }
        _ => {}
    }
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ConfigError::NvmePathNotFound {
                key: key.to_owned(),
                dir: dir.to_owned(),
            })
        }
        Err(e) => return Err(not_writable(e.to_string())),
        Ok(m) if !m.is_dir() => {
            return Err(ConfigError::NvmePathNotDir {
                key: key.to_owned(),
                dir: dir.to_owned(),
            })
        }
        Ok(_) => {}
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let probe = dir.join(format!(
        ".tierzero-write-probe-{}-{nanos}",
        std::process::id()
    ));
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe);
    match created {
        Ok(f) => {
            drop(f);
            std::fs::remove_file(&probe)
                .map_err(|e| not_writable(format!("cannot remove probe file: {e}")))?;
            Ok(())
        }
        Err(e) => Err(not_writable(format!("cannot create a file there: {e}"))),
    }
}
