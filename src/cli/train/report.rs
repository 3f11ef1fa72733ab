//! What `tierzero train` prints: the start-up banner, the progress (an
//! indicatif bar on a terminal, lines otherwise), checkpoint sizes and
//! rates, and the summary (lines, or one JSON object with `--json`).

use super::*;

/// Where the progress goes.
pub(super) enum Progress {
    Bar(ProgressBar),
    Lines { every: u64 },
}

fn gbps(bytes: Option<&u64>, seconds: f64) -> f64 {
    match bytes {
        Some(&b) if seconds > 0.0 => b as f64 / seconds / 1e9,
        _ => 0.0,
    }
}

fn progress_text(m: &StepMetrics, steps: u64) -> String {
    format!(
        "step {}/{steps} loss {:.4} {:.0} tok/s nvme r {:.2} GB/s w {:.2} GB/s overlap {:.2}{}",
        m.step,
        m.loss,
        m.tokens_per_s,
        gbps(m.bytes_read.get("nvme"), m.wall_s),
        gbps(m.bytes_written.get("nvme"), m.wall_s),
        m.overlap_efficiency,
        skipped_text(m)
    )
}

/// A skipped step said where its progress is (the weights unchanged:
/// DeepSpeed says each overflow too); empty for a step applied.
fn skipped_text(m: &StepMetrics) -> String {
    match (m.skipped, m.loss_scale != 1.0) {
        (false, _) => String::new(),
        (true, true) => format!(
            " skipped (gradients not all finite at loss scale {}: not applied)",
            m.loss_scale
        ),
        (true, false) => " skipped (gradients not all finite: not applied)".to_owned(),
    }
}

impl Progress {
    pub(super) fn new(steps: u64, every: u64) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress::Lines {
                every: every.max(1),
            };
        }
        let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
        let style = ProgressStyle::with_template(
            "{bar:30.cyan/blue} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        Progress::Bar(bar)
    }

    pub(super) fn step(&self, m: &StepMetrics, steps: u64) {
        match self {
            Progress::Bar(bar) => {
                bar.set_message(format!(
                    "loss {:.4} | {:.0} tok/s | nvme r {:.2} w {:.2} GB/s | overlap {:.2}{}",
                    m.loss,
                    m.tokens_per_s,
                    gbps(m.bytes_read.get("nvme"), m.wall_s),
                    gbps(m.bytes_written.get("nvme"), m.wall_s),
                    m.overlap_efficiency,
                    skipped_text(m)
                ));
                bar.set_position(m.step);
            }
            Progress::Lines { every } => {
                // A skipped step is said whenever it happens.
                if m.step == 1 || m.step.is_multiple_of(*every) || m.step == steps || m.skipped {
                    errln!("{}", progress_text(m, steps));
                }
            }
        }
    }

    /// A line between progress updates.
    pub(super) fn println(&self, line: &str) {
        match self {
            Progress::Bar(bar) => bar.println(line),
            Progress::Lines { .. } => errln!("{line}"),
        }
    }

    pub(super) fn finish(&self) {
        if let Progress::Bar(bar) = self {
            if !bar.is_finished() {
                bar.finish();
                // The bar leaves the cursor at the end of its line.
                errln!();
            }
        }
    }
}

/// The summary `--json` prints.
#[derive(serde::Serialize)]
struct JsonSummary<'a> {
    steps: u64,
    skipped_steps: u64,
    first_loss: f32,
    final_loss: f32,
    final_step: u64,
    weight_sha256: &'a str,
    tokens_per_step: u64,
    tokens_per_s: f64,
    train_s: f64,
    /// Of `train_s`: checkpoint saves (left out of `tokens_per_s`).
    save_s: f64,
    total_s: f64,
    /// Before the first step, by part.
    startup: Startup,
    /// After the last step.
    finish_s: f64,
    nvme_read_bytes: u64,
    nvme_written_bytes: u64,
    peak_rss_bytes: u64,
    trace_rerecords: u64,
    metrics: Option<String>,
    /// `"signal"` when a signal stopped the run early; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    stopped: Option<&'a str>,
    /// `"SIGINT"`, `"SIGTERM"` or `"SIGHUP"`, with `stopped`.
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_signal: Option<&'a str>,
    /// With `stopped`: the step of the checkpoint that continues the run
    /// (`null`: none was saved, or no --save-dir).
    #[serde(skip_serializing_if = "Option::is_none")]
    checkpoint_step: Option<Option<u64>>,
    /// A run that trained to its end and then failed (its `--metrics` or
    /// `--timeline` could not be written): the failure, as a failure's
    /// object has it; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// With `error`: `"bad_input"` or `"internal"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    failure: Option<&'static str>,
    /// With `error`: the exit code (2 or 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    exit_code: Option<i32>,
}

/// What a resume that already reaches its end says: the checkpoint, its
/// step, and where the end `steps` came from (`--steps`, the saving run's
/// recorded end, or the config's `total_num_steps` else the default).
pub(super) fn nothing_to_do(
    args: &TrainArgs,
    ckpt: Option<&Checkpoint>,
    start_step: u64,
    steps: u64,
) -> String {
    let saved_end = ckpt.and_then(|c| c.manifest().run_steps);
    let end = match (&args.steps, saved_end) {
        (Some(_), _) => format!("--steps {steps}"),
        (None, Some(_)) => format!("the end of the run that saved it (step {steps})"),
        (None, None) => format!(
            "step {steps} (without --steps: the config's total_num_steps, else {DEFAULT_STEPS})"
        ),
    };
    format!(
        "the checkpoint {} is at step {start_step}, which already reaches {end}; \
         nothing to do (give a larger --steps to train further)\n",
        ckpt.map_or(String::new(), |c| c.dir().display().to_string())
    )
}

/// The start-up lines: model, data, config, run, and the plan.
pub(super) fn banner(
    args: &TrainArgs,
    ckpt: Option<&Checkpoint>,
    model_dir: Option<&ModelDir>,
    trainer: &Trainer,
    plan: &Plan,
    run: &RunInfo<'_>,
) -> String {
    let mc = trainer.model().config();
    let model_name = match (&args.model, ckpt) {
        (Some(d), _) => d.display().to_string(),
        (None, Some(c)) => format!("from checkpoint {}", c.dir().display()),
        (None, None) => "embedded default".to_owned(),
    };
    format!(
        "tierzero train: model {model_name} ({}, {} layers, hidden {}, {} params, {}), \
         data {}, config {}\n\
         run: {} steps x {} sequences x {} tokens = {} tokens/step, \
         seed {}, data {}, {}{}{}\n{}\n{plan}\n",
        mc.family.name(),
        mc.n_layer,
        mc.hidden_size,
        trainer.model().numel(),
        match (ckpt, model_dir) {
            (Some(_), _) => "resumed",
            (None, Some(md)) if md.has_weights() => "weights from safetensors",
            _ => "seeded init",
        },
        run.data_name,
        run.config_name,
        run.steps,
        run.train_batch_size,
        run.seq_len,
        run.tokens_per_step,
        run.seed,
        run.data_order.describe(),
        trainer.adam_threads(),
        match run.ranks {
            1 => String::new(),
            n => format!(", {n} ranks (plan: rank 0's shard)"),
        },
        trainer
            .malloc_tuning()
            .map_or(String::new(), |m| format!(", host malloc: {m}")),
        run.training,
    )
}

/// A checkpoint's size and how long it took to write or read, e.g.
/// "7.02 GiB in 12.4 s, 580 MiB/s": the bytes of every file under `dir`.
pub(super) fn size_and_time(dir: &Path, seconds: f64) -> String {
    fn bytes_under(p: &Path) -> u64 {
        match std::fs::read_dir(p) {
            Ok(entries) => entries
                .flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => bytes_under(&e.path()),
                    Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
                    _ => 0,
                })
                .sum(),
            Err(_) => 0,
        }
    }
    let bytes = bytes_under(dir);
    let rate = if seconds > 0.0 {
        format!(", {}/s", format_bytes((bytes as f64 / seconds) as u64))
    } else {
        String::new()
    };
    format!("{} in {seconds:.1} s{rate}", format_bytes(bytes))
}

/// The summary on stdout: one JSON object with `--json`, else lines.
pub(super) fn print_summary(
    args: &TrainArgs,
    run: &RunInfo<'_>,
    summary: &Summary,
    ran: &Steps,
    timing: Timing,
    timeline: Option<&Timeline>,
    ending_failure: Option<&Failure>,
) -> Result<(), Failure> {
    let (first, last) = (&ran.first, &ran.last);
    let (tokens_per_step, start_step, train_s) =
        (run.tokens_per_step, run.start_step, timing.train_s);
    // The run's totals (initial weights and the last optimizer tail
    // included), not a sum of step lines.
    let nvme_read = summary.bytes_read.get("nvme").copied().unwrap_or(0);
    let nvme_written = summary.bytes_written.get("nvme").copied().unwrap_or(0);
    // The steps' rate: the time in checkpoint saves (`save_s`) is not
    // the steps'.
    let steps_s = (train_s - ran.save_s).max(0.0);
    let tokens_per_s = (tokens_per_step * (summary.steps - start_step)) as f64 / steps_s.max(1e-9);
    if args.json {
        // A struct, not json!: the losses keep their f32 form (shortest
        // repr), exactly as the metrics file writes them.
        let obj = JsonSummary {
            steps: summary.steps,
            skipped_steps: summary.skipped_steps,
            first_loss: first.loss,
            final_loss: last.loss,
            final_step: last.step,
            weight_sha256: &summary.weight_sha256,
            tokens_per_step,
            tokens_per_s,
            train_s,
            save_s: ran.save_s,
            total_s: timing.total_s,
            startup: timing.startup,
            finish_s: timing.finish_s,
            nvme_read_bytes: nvme_read,
            nvme_written_bytes: nvme_written,
            peak_rss_bytes: summary.peak_rss_bytes,
            trace_rerecords: summary.trace_rerecords,
            metrics: args.metrics.as_ref().map(|p| p.display().to_string()),
            stopped: ran.stop.as_ref().map(|s| s.cause.kind()),
            stop_signal: summary.stop_signal.as_deref(),
            checkpoint_step: ran.stop.as_ref().map(|s| s.checkpoint_step),
            error: ending_failure.map(|f| format!("{:#}", f.error())),
            failure: ending_failure.map(Failure::kind),
            exit_code: ending_failure.map(Failure::exit_code),
        };
        let obj = serde_json::to_string(&obj)
            .map_err(|e| Failure::Internal(anyhow!("writing the JSON summary: {e}")))?;
        // stdout is this one object; a later failure is said on stderr.
        super::super::json_object_on_failure(false);
        return emit(&format!("{obj}\n"));
    }
    let st = timing.startup;
    emit(&format!(
        "done: {} steps{} in {train_s:.1} s ({tokens_per_s:.0} tokens/s{}), total {:.1} s \
         (start-up {:.1} s: {:.1} s before the trainer, {:.1} s its threads and tiers, \
         {:.1} s {}; {:.1} s after the steps)\n\
         loss: {:.4} at step {} -> {:.4} at step {}\n\
         weight_sha256: {}\n\
         NVMe: read {}, written {}; peak RSS {}{}\n",
        summary.steps - start_step,
        match summary.skipped_steps {
            0 => String::new(),
            k => format!(
                " ({k} skipped in all: gradients not all finite, their updates not applied)"
            ),
        },
        if ran.save_s > 0.0 {
            format!(
                " over the {steps_s:.1} s outside {:.1} s of saves",
                ran.save_s
            )
        } else {
            String::new()
        },
        timing.total_s,
        st.startup_s,
        st.before_trainer_s,
        st.tiers_s,
        st.initial_s,
        if start_step > 0 {
            "the checkpoint's state loaded"
        } else {
            "the initial weights and optimizer state stored"
        },
        timing.finish_s,
        first.loss,
        first.step,
        last.loss,
        last.step,
        summary.weight_sha256,
        format_bytes(nvme_read),
        format_bytes(nvme_written),
        format_bytes(summary.peak_rss_bytes),
        match &args.metrics {
            Some(p) => format!("; metrics in {}", p.display()),
            None => String::new(),
        }
    ))?;
    if let Some(s) = &ran.stop {
        emit(&format!(
            "stopped by {} at step {} of {}{}\n",
            s.cause
                .signal_name()
                .unwrap_or_else(|| "request".to_owned()),
            summary.steps,
            run.steps,
            match (&args.save_dir, s.checkpoint_step) {
                // --steps named: without it the resumed run would be the
                // default length, and its lr schedule rebuilt for that.
                // The save dir where its `latest` names the step, else the
                // step's own dir (a stop that skipped its save in a run
                // resumed from an older step: `latest` still names the
                // branch it stepped away from).
                (Some(d), Some(c)) => format!(
                    "; checkpoint of step {c} in {}: continue with the same flags plus \
                     --resume {} (and --steps {}, where they do not give it)",
                    d.display(),
                    if tierzero::checkpoint::latest_step(d) == Some(c) {
                        d.clone()
                    } else {
                        d.join(tierzero::checkpoint::step_dir_name(c))
                    }
                    .display(),
                    run.steps
                ),
                (Some(d), None) => format!("; no checkpoint in {}", d.display()),
                (None, _) => "; no checkpoint (no --save-dir)".to_owned(),
            }
        ))?;
    }
    if let (Some(tl), Some(path)) = (timeline, &args.timeline) {
        emit(&match tl.recorded_steps() {
            Some((a, b)) => format!(
                "timeline of steps {a}..={b} in {} (open it in ui.perfetto.dev)\n",
                path.display()
            ),
            None => format!(
                "timeline in {}: no step of its window ran\n",
                path.display()
            ),
        })?;
    }
    Ok(())
}

/// How `tierzero train` ended (its exit code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Every step ran (exit 0).
    Done,
    /// A signal stopped it at a step boundary: exit 130 (SIGINT) or 143
    /// (SIGTERM).
    Stopped {
        /// 128 + the signal's number.
        exit_code: i32,
    },
}

impl Ended {
    /// The process's exit code.
    pub fn exit_code(self) -> i32 {
        match self {
            Ended::Done => 0,
            Ended::Stopped { exit_code } => exit_code,
        }
    }
}
