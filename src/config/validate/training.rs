//! The training keys resolved and validated: the batch sizes (with HF
//! Trainer's `"auto"` rules and the product check), precision and loss
//! scaling, the optimizer and the learning-rate schedule.

use super::*;

pub(super) fn resolve_batch(ds: &DsConfig, r: &mut Resolver<'_>) -> Result<Batch, ConfigError> {
    let run = r.run;
    let ranks = run.ranks;
    if ranks == 0 {
        return Err(range(
            "ranks (run context)",
            0,
            "at least 1",
            "pass the world size, 1 for a single process",
        ));
    }
    let micro_key = "train_micro_batch_size_per_gpu";
    let gas_key = "gradient_accumulation_steps";
    let train_key = "train_batch_size";
    let mut micro = r.u64_opt(
        micro_key,
        ds.train_micro_batch_size_per_gpu,
        run.micro_batch_size,
        "micro_batch_size",
        hf_defaults::MICRO_BATCH_SIZE,
    )?;
    let mut gas = r.u64_opt(
        gas_key,
        ds.gradient_accumulation_steps,
        run.gradient_accumulation_steps,
        "gradient_accumulation_steps",
        hf_defaults::GRADIENT_ACCUMULATION_STEPS,
    )?;
    for (key, v) in [(micro_key, micro), (gas_key, gas)] {
        if v == Some(0) {
            return Err(range(key, 0, "at least 1", "use 1 or more"));
        }
    }
    let overflow = || {
        range(
            train_key,
            "micro × accumulation × ranks",
            "below 2^64",
            "use smaller batch sizes",
        )
    };
    let mut train = match ds.train_batch_size {
        Some(AutoOr::Value(0)) => {
            return Err(range(
                train_key,
                0,
                "at least 1",
                "use 1 or more, or \"auto\"",
            ))
        }
        Some(AutoOr::Value(v)) => Some(v),
        Some(AutoOr::Auto) => {
            // HF: train = world_size × per_device × accumulation, with the
            // HF defaults standing in for unset values.
            let m = *micro.get_or_insert_with(|| {
                r.resolved.push(Resolved {
                    key: micro_key.to_owned(),
                    value: hf_defaults::MICRO_BATCH_SIZE.to_string(),
                    source: Source::HfDefault,
                });
                hf_defaults::MICRO_BATCH_SIZE
            });
            let g = *gas.get_or_insert(hf_defaults::GRADIENT_ACCUMULATION_STEPS);
            let t = m
                .checked_mul(g)
                .and_then(|x| x.checked_mul(ranks))
                .ok_or_else(overflow)?;
            r.record(
                train_key,
                t.to_string(),
                Source::Derived(format!("micro {m} × accumulation {g} × ranks {ranks}")),
            );
            Some(t)
        }
        None => None,
    };

    let indivisible =
        |missing: &'static str, t: u64, desc: String, d: u64| ConfigError::BatchIndivisible {
            missing,
            train_batch_size: t,
            divisor_desc: desc,
            divisor: d,
            // The next multiple, or the largest one when that overflows.
            suggestion: t.div_ceil(d).checked_mul(d).unwrap_or(t / d * d),
        };
    let (t, m, g) = match (train, micro, gas) {
        (Some(t), Some(m), Some(g)) => (t, m, g),
        (Some(t), Some(m), None) => {
            let d = m.checked_mul(ranks).ok_or_else(overflow)?;
            if t % d != 0 {
                return Err(indivisible(
                    gas_key,
                    t,
                    format!("micro {m} × ranks {ranks}"),
                    d,
                ));
            }
            r.record(gas_key, (t / d).to_string(), Source::Inferred);
            (t, m, t / d)
        }
        (Some(t), None, Some(g)) => {
            let d = g.checked_mul(ranks).ok_or_else(overflow)?;
            if t % d != 0 {
                return Err(indivisible(
                    micro_key,
                    t,
                    format!("accumulation {g} × ranks {ranks}"),
                    d,
                ));
            }
            r.record(micro_key, (t / d).to_string(), Source::Inferred);
            (t, t / d, g)
        }
        (None, Some(m), Some(g)) => {
            let t = m
                .checked_mul(g)
                .and_then(|x| x.checked_mul(ranks))
                .ok_or_else(overflow)?;
            r.record(train_key, t.to_string(), Source::Inferred);
            (t, m, g)
        }
        (Some(t), None, None) => {
            if t % ranks != 0 {
                return Err(indivisible(micro_key, t, format!("ranks {ranks}"), ranks));
            }
            r.record(gas_key, "1".to_owned(), Source::Inferred);
            r.record(micro_key, (t / ranks).to_string(), Source::Inferred);
            (t, t / ranks, 1)
        }
        (None, Some(m), None) => {
            let t = m.checked_mul(ranks).ok_or_else(overflow)?;
            r.record(gas_key, "1".to_owned(), Source::Inferred);
            r.record(train_key, t.to_string(), Source::Inferred);
            (t, m, 1)
        }
        (None, None, _) => return Err(ConfigError::BatchMissing),
    };
    train = Some(t);
    let product = m
        .checked_mul(g)
        .and_then(|x| x.checked_mul(ranks))
        .ok_or_else(overflow)?;
    if train != Some(product) {
        let d = m * ranks;
        // A size that was "auto" with no run value took HF's default: the
        // fix is the run's value, not the config key it already has as
        // "auto" ("or use \"auto\"" was the advice).
        let defaulted: Vec<&str> = [micro_key, gas_key]
            .into_iter()
            .filter(|k| {
                r.resolved
                    .iter()
                    .any(|x| x.key == *k && x.source == Source::HfDefault)
            })
            .collect();
        let fix = if !defaulted.is_empty() {
            let e_g = match (t % d, t % (g * ranks)) {
                (0, _) => format!(", e.g. --grad-accum {}", t / d),
                (_, 0) => format!(", e.g. --micro-batch {}", t / (g * ranks)),
                _ => String::new(),
            };
            let keys: Vec<String> = defaulted.iter().map(|k| format!("`{k}`")).collect();
            format!(
                "{} {} \"auto\" with no run value and took HF's default; give the run's \
                 micro-batch and accumulation (tierzero train --micro-batch / --grad-accum, HF's \
                 per_device_train_batch_size / gradient_accumulation_steps) that make {t}{e_g}, \
                 or set `train_batch_size` to {product} or \"auto\"",
                keys.join(" and "),
                if keys.len() > 1 { "are" } else { "is" }
            )
        } else if t % d == 0 {
            format!("set `train_batch_size` to {product}, or `gradient_accumulation_steps` to {}, or use \"auto\"", t / d)
        } else {
            format!("set `train_batch_size` to {product} or to \"auto\"")
        };
        return Err(ConfigError::BatchMismatch {
            train_batch_size: t,
            micro_batch_size: m,
            gradient_accumulation_steps: g,
            ranks,
            product,
            fix,
        });
    }
    Ok(Batch {
        train_batch_size: t,
        micro_batch_size: m,
        gradient_accumulation_steps: g,
        ranks,
    })
}

pub(super) fn resolve_precision(
    ds: &DsConfig,
    r: &mut Resolver<'_>,
) -> Result<Precision, ConfigError> {
    let mp = r.run.mixed_precision;
    let fp16 = r.bool(
        "fp16.enabled",
        ds.fp16.enabled,
        mp.map(|m| m == MixedPrecision::Fp16),
        "mixed_precision",
    )?;
    let bf16 = r.bool(
        "bf16.enabled",
        ds.bf16.enabled,
        mp.map(|m| m == MixedPrecision::Bf16),
        "mixed_precision",
    )?;
    match (fp16, bf16) {
        (true, true) => Err(ConfigError::PrecisionConflict),
        (false, true) => Ok(Precision::Bf16),
        (false, false) => Ok(Precision::Fp32),
        (true, false) => {
            let f = &ds.fp16;
            if f.loss_scale < 0.0 {
                return Err(range(
                    "fp16.loss_scale",
                    f.loss_scale,
                    "0 (dynamic) or positive",
                    "use 0 for dynamic loss scaling",
                ));
            }
            // DeepSpeed's field is an int (pydantic refuses a fraction),
            // whatever the scaler.
            if f.min_loss_scale.fract() != 0.0 {
                return Err(range(
                    "fp16.min_loss_scale",
                    f.min_loss_scale,
                    "a whole number (DeepSpeed's fp16.min_loss_scale is an integer)",
                    "use 1",
                ));
            }
            let loss_scale = if f.loss_scale == 0.0 {
                // Checked only for the dynamic scaler, as DeepSpeed does
                // (a static scale never reads it).
                if f.min_loss_scale <= 0.0 {
                    return Err(range(
                        "fp16.min_loss_scale",
                        f.min_loss_scale,
                        "positive",
                        "use 1",
                    ));
                }
                LossScale::Dynamic {
                    initial_scale_power: f.initial_scale_power,
                    window: positive("fp16.loss_scale_window", f.loss_scale_window, "use 1000")?,
                    // DeepSpeed's scaler lowers the scale when its count
                    // reaches 1; from 0 it only counts down, so after the
                    // first overflow it would skip every step.
                    hysteresis: positive(
                        "fp16.hysteresis",
                        f.hysteresis,
                        "use 2 (DeepSpeed's default) or 1 (lower the scale at the first \
                         overflow); DeepSpeed never lowers the scale from 0, so every step \
                         after an overflow would be skipped",
                    )?,
                    min_scale: f.min_loss_scale,
                    consecutive_hysteresis: f.consecutive_hysteresis,
                }
            } else if !(STATIC_SCALE_MIN..=STATIC_SCALE_MAX).contains(&f.loss_scale) {
                // The scale and its reciprocal multiply f32 gradients: 2e-39
                // made the gradient scale inf (exit 1 after a step), 1e39 an
                // inf loss scale that skipped every step.
                return Err(range(
                    "fp16.loss_scale",
                    f.loss_scale,
                    "0 (dynamic) or a static scale within f32's normal range, 2^-126 to 2^127 \
                     (the gradients are scaled by it and by its reciprocal in f32)",
                    "use 0 for dynamic loss scaling, or a power of two such as 1024",
                ));
            } else {
                LossScale::Static(f.loss_scale)
            };
            Ok(Precision::Fp16 { loss_scale })
        }
    }
}

/// The least static `fp16.loss_scale`: f32's least normal number.
const STATIC_SCALE_MIN: f64 = f32::MIN_POSITIVE as f64;
/// The largest static `fp16.loss_scale`: 2^127, whose reciprocal is
/// normal in f32 too.
const STATIC_SCALE_MAX: f64 = 1.7014118346046923e38;

pub(super) fn resolve_optimizer(
    ds: &DsConfig,
    r: &mut Resolver<'_>,
) -> Result<Optimizer, ConfigError> {
    let run = r.run;
    // No optimizer block: behave like HF Trainer's own AdamW, i.e. as if
    // every param were "auto".
    let (kind, params) = match &ds.optimizer {
        Some(o) => {
            let kind = if o.kind.eq_ignore_ascii_case("adamw") {
                OptimizerKind::AdamW
            } else if o.kind.eq_ignore_ascii_case("adam") {
                OptimizerKind::Adam
            } else {
                return Err(ConfigError::UnsupportedOptimizer {
                    value: crate::config::error::render(&serde_json::Value::String(o.kind.clone())),
                });
            };
            (kind, o.params.clone())
        }
        None => (
            OptimizerKind::AdamW,
            crate::config::ds::DsAdamParams {
                lr: Some(AutoOr::Auto),
                betas: Some(AutoOr::Auto),
                eps: Some(AutoOr::Auto),
                weight_decay: Some(AutoOr::Auto),
                adam_w_mode: true,
                bias_correction: true,
                torch_adam: false,
                amsgrad: false,
                fp32_optimizer_states: None,
            },
        ),
    };
    if params.amsgrad {
        return Err(range(
            "optimizer.params.amsgrad",
            true,
            "false",
            "remove it: tierzero's Adam has no AMSGrad variant (nor have DeepSpeed's CPU and \
             fused Adam; only torch_adam's torch.optim.Adam takes it)",
        ));
    }
    let decoupled_weight_decay = kind == OptimizerKind::AdamW || params.adam_w_mode;
    let lr = r.f64(
        "optimizer.params.lr",
        params.lr,
        run.learning_rate,
        "learning_rate",
        hf_defaults::LEARNING_RATE,
        1e-3,
    )?;
    if lr < 0.0 {
        return Err(range(
            "optimizer.params.lr",
            lr,
            "0 or positive",
            "use a positive learning rate such as 1e-4",
        ));
    }
    let betas = match (params.betas, run.adam_betas) {
        (Some(AutoOr::Auto), Some(b)) | (None, Some(b)) => {
            r.record(
                "optimizer.params.betas",
                format!("[{:?}, {:?}]", b[0], b[1]),
                Source::Run("adam_betas"),
            );
            b
        }
        (Some(AutoOr::Auto), None) => {
            let b = hf_defaults::ADAM_BETAS;
            r.record(
                "optimizer.params.betas",
                format!("[{:?}, {:?}]", b[0], b[1]),
                Source::HfDefault,
            );
            b
        }
        (Some(AutoOr::Value(v)), Some(b)) if !(close(v[0], b[0]) && close(v[1], b[1])) => {
            return Err(ConfigError::RunMismatch {
                key: "optimizer.params.betas".to_owned(),
                config_value: format!("[{:?}, {:?}]", v[0], v[1]),
                run_value: format!("[{:?}, {:?}]", b[0], b[1]),
                run_source: "adam_betas".to_owned(),
            })
        }
        (Some(AutoOr::Value(v)), _) => v,
        (None, None) => [0.9, 0.999],
    };
    for (i, b) in betas.iter().enumerate() {
        if !(0.0..1.0).contains(b) {
            return Err(range(
                &format!("optimizer.params.betas[{i}]"),
                b,
                "in [0, 1)",
                "use the usual [0.9, 0.999] (or 0.95 for beta2)",
            ));
        }
    }
    let eps = r.f64(
        "optimizer.params.eps",
        params.eps,
        run.adam_eps,
        "adam_eps",
        hf_defaults::ADAM_EPS,
        1e-8,
    )?;
    if eps < 0.0 {
        return Err(range(
            "optimizer.params.eps",
            eps,
            "0 or positive",
            "use 1e-8",
        ));
    }
    // With torch_adam, DeepSpeed passes the params to torch.optim.AdamW,
    // whose default is 0.01 (torch.optim.Adam's, without adam_w_mode, 0).
    let weight_decay = r.f64(
        "optimizer.params.weight_decay",
        params.weight_decay,
        run.weight_decay,
        "weight_decay",
        hf_defaults::WEIGHT_DECAY,
        if params.torch_adam && decoupled_weight_decay {
            0.01
        } else {
            0.0
        },
    )?;
    if weight_decay < 0.0 {
        return Err(range(
            "optimizer.params.weight_decay",
            weight_decay,
            "0 or positive",
            "use 0.0 or e.g. 0.01",
        ));
    }
    Ok(Optimizer {
        kind,
        lr,
        betas,
        eps,
        weight_decay,
        decoupled_weight_decay,
        bias_correction: params.bias_correction,
    })
}

pub(super) fn resolve_scheduler(
    s: Option<&DsScheduler>,
    lr: f64,
    r: &mut Resolver<'_>,
    sink: &mut Sink,
) -> Result<Scheduler, ConfigError> {
    let Some(s) = s else {
        return Ok(Scheduler::Constant);
    };
    let run = r.run;
    let p = &s.params;
    let warmup_type = match p.warmup_type.as_deref() {
        Some("linear") => WarmupType::Linear,
        _ => WarmupType::Log,
    };
    let lr_key = |r: &mut Resolver<'_>,
                  key: &str,
                  v: Option<AutoOr<f64>>,
                  auto: f64,
                  auto_desc: &str,
                  dflt: f64| {
        let v = match v {
            Some(AutoOr::Auto) => {
                r.record(
                    key,
                    format!("{auto:?}"),
                    Source::Derived(auto_desc.to_owned()),
                );
                auto
            }
            Some(AutoOr::Value(v)) => v,
            None => dflt,
        };
        if v < 0.0 {
            return Err(range(
                key,
                v,
                "0 or positive",
                "use a non-negative learning rate",
            ));
        }
        Ok(v)
    };
    // The schedule's peak is the lr the run trains at: a value the run's
    // learning rate (`--lr`) contradicts is refused, as HF Trainer's
    // fill_match refuses it; one the key's absence leaves at another
    // value than the optimizer's (WarmupDecayLR's 0.001) is said.
    let peak_lr = |v: f64, sink: &mut Sink| -> Result<f64, ConfigError> {
        let key = "scheduler.params.warmup_max_lr";
        match (p.warmup_max_lr, run.learning_rate) {
            (Some(AutoOr::Value(c)), Some(run_lr)) if !close(c, run_lr) => {
                Err(ConfigError::RunMismatch {
                    key: key.to_owned(),
                    config_value: format!("{c:?}"),
                    run_value: format!("{run_lr:?}"),
                    run_source: "learning_rate".to_owned(),
                })
            }
            (None, _) if !close(v, lr) => {
                sink.note(
                    key,
                    format!(
                        "absent: the schedule peaks at DeepSpeed's default {v:?} for {}, not at \
                         the optimizer's lr {lr:?}; set it to \"auto\" to peak at the optimizer's lr",
                        s.kind
                    ),
                );
                Ok(v)
            }
            _ => Ok(v),
        }
    };
    let warmup_key = "scheduler.params.warmup_num_steps";
    let warmup_steps = match r.u64_fill(
        warmup_key,
        p.warmup_num_steps,
        run.warmup_steps,
        "warmup_steps",
        sink,
    ) {
        Some(w) => w,
        None if p.warmup_num_steps == Some(AutoOr::Auto) => {
            r.record(
                warmup_key,
                hf_defaults::WARMUP_STEPS.to_string(),
                Source::HfDefault,
            );
            hf_defaults::WARMUP_STEPS
        }
        None => 1000,
    };
    if warmup_steps == 0 {
        // DeepSpeed's schedules use max(2, warmup_num_steps) throughout
        // (`optim::schedule`), and since 0.19 refuse 0 outright.
        sink.note(
            warmup_key,
            "0 warms up over 2 steps, as DeepSpeed's schedules take max(2, warmup_num_steps) \
             (DeepSpeed 0.19 refuses 0)",
        );
    }
    let total = |r: &mut Resolver<'_>, sink: &mut Sink| -> Result<u64, ConfigError> {
        let key = "scheduler.params.total_num_steps";
        match r.u64_fill(key, p.total_num_steps, run.total_steps, "total_steps", sink) {
            Some(t) => Ok(t),
            None if p.total_num_steps == Some(AutoOr::Auto) => Err(ConfigError::AutoUnresolved {
                key: key.to_owned(),
                needs: "the total number of optimizer steps is not known".to_owned(),
                fix: "pass --steps N, or write the number into the config".to_owned(),
            }),
            None => Err(ConfigError::MissingKey {
                key: key.to_owned(),
                why: format!("scheduler type {} needs it", s.kind),
                fix: "add \"total_num_steps\": N, or \"auto\" with --steps N".to_owned(),
            }),
        }
    };
    let check_total = |sink: &mut Sink, total: u64| {
        // DeepSpeed compares with its max(2, warmup_num_steps).
        let warmup = crate::optim::schedule::warmup_len(warmup_steps);
        if total < warmup {
            sink.note(
                "scheduler.params.total_num_steps",
                format!("{total} is less than the warmup's {warmup} steps; the run ends inside the warmup"),
            );
        }
    };
    if s.kind == "WarmupLR" && p.warmup_max_lr.is_none() {
        // An older DeepSpeed (before #7360) peaked at 0.001 here.
        r.record(
            "scheduler.params.warmup_max_lr",
            format!("{lr:?}"),
            Source::DeepSpeedDefaultSince {
                version: "0.17.2 (the optimizer's lr)",
                before: "0.001",
            },
        );
    }
    match s.kind.as_str() {
        "WarmupLR" => Ok(Scheduler::WarmupLr {
            min_lr: lr_key(
                r,
                "scheduler.params.warmup_min_lr",
                p.warmup_min_lr,
                0.0,
                "HF: 0",
                0.0,
            )?,
            // Absent: the optimizer's lr, as DeepSpeed's WarmupLR takes
            // it since #7360 (WarmupDecayLR keeps 0.001).
            max_lr: peak_lr(
                lr_key(
                    r,
                    "scheduler.params.warmup_max_lr",
                    p.warmup_max_lr,
                    lr,
                    "HF: optimizer lr",
                    lr,
                )?,
                sink,
            )?,
            warmup_steps,
            warmup_type,
        }),
        "WarmupDecayLR" => {
            let min_lr = lr_key(
                r,
                "scheduler.params.warmup_min_lr",
                p.warmup_min_lr,
                0.0,
                "HF: 0",
                0.0,
            )?;
            let max_lr = peak_lr(
                lr_key(
                    r,
                    "scheduler.params.warmup_max_lr",
                    p.warmup_max_lr,
                    lr,
                    "HF: optimizer lr",
                    0.001,
                )?,
                sink,
            )?;
            let total_steps = total(r, sink)?;
            check_total(sink, total_steps);
            Ok(Scheduler::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup_type,
                total_steps,
            })
        }
        "WarmupCosineLR" => {
            let total_steps = total(r, sink)?;
            check_total(sink, total_steps);
            let ratio = |key: &str, v: Option<f64>, dflt: f64| {
                let v = v.unwrap_or(dflt);
                if (0.0..=1.0).contains(&v) {
                    Ok(v)
                } else {
                    Err(range(
                        key,
                        v,
                        "in [0, 1]",
                        "use a ratio of the optimizer lr, e.g. 0.1",
                    ))
                }
            };
            Ok(Scheduler::WarmupCosineLr {
                total_steps,
                warmup_min_ratio: ratio(
                    "scheduler.params.warmup_min_ratio",
                    p.warmup_min_ratio,
                    0.0,
                )?,
                warmup_steps,
                cos_min_ratio: ratio("scheduler.params.cos_min_ratio", p.cos_min_ratio, 0.0001)?,
                warmup_type,
            })
        }
        other => Err(ConfigError::UnsupportedScheduler {
            value: crate::config::error::render(&serde_json::Value::String(other.to_owned())),
            fix: "use WarmupLR, WarmupDecayLR or WarmupCosineLR".to_owned(),
        }),
    }
}
