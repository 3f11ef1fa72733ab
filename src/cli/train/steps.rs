//! The training loop of `tierzero train`: the steps with their progress
//! and checkpoints (every `--save-every`, at the end, and the step a stop
//! ended at, within the grace period).

use super::*;

/// The steps from `start_step` to `steps`, with progress and checkpoints
/// (every `--save-every` and at the end), or until a stop is requested
/// (the step it stopped at is saved, within the grace period). Returns the
/// first and last steps' metrics.
pub(super) fn train_steps(
    trainer: &mut Trainer,
    args: &TrainArgs,
    flags: &Flags,
    run: &RunInfo<'_>,
    say: &dyn Fn(&str) -> Result<(), Failure>,
) -> Result<Steps, Failure> {
    let (steps, start_step, save_every) = (run.steps, run.start_step, flags.save_every);
    let lead = run.lead;
    let progress = Progress::new(steps, run.steps_per_print);
    let mut first: Option<StepMetrics> = None;
    let mut last: Option<StepMetrics> = None;
    let mut saved_at: Option<u64> = None;
    let mut stop: Option<StopCause> = None;
    let mut said_activations: Option<[usize; 2]> = None;
    // Seconds in saves (their optimizer tails included): left out of the
    // steps' tokens/s.
    let save_s = std::cell::Cell::new(0.0f64);
    let save_timed = |trainer: &mut Trainer, dir: &Path| -> Result<(), Failure> {
        // The last step's optimizer tail first, so the time said is the
        // save's own; agreed, as the save's own settling is, so that a
        // rank whose tail failed does not leave the others in the save.
        let tail_started = Instant::now();
        trainer
            .settle_optimizer_all_ranks()
            .map_err(|e| save_failure(e, "saving a checkpoint", dir))?;
        let tail_s = tail_started.elapsed().as_secs_f64();
        let started = Instant::now();
        let p = trainer
            .save_checkpoint(dir)
            .map_err(|e| save_failure(e, "saving a checkpoint", dir))?;
        say(&format!(
            "checkpoint: step {} saved to {} ({}; after {tail_s:.1} s of the step's optimizer tail)\n",
            trainer.steps_done(),
            p.display(),
            size_and_time(&p, started.elapsed().as_secs_f64())
        ))
    };
    let save = |trainer: &mut Trainer, dir: &Path| -> Result<(), Failure> {
        let began = Instant::now();
        let r = save_timed(trainer, dir);
        save_s.set(save_s.get() + began.elapsed().as_secs_f64());
        r
    };
    for _ in start_step..steps {
        let step = trainer.steps_done() + 1;
        let report = trainer.step().map_err(|e| {
            progress.finish();
            run_failure(e, &format!("training step {step}"))
        })?;
        let m = report.metrics;
        // The activation policy decides in the first micro-batch of a batch
        // shape: say what it kept, once per decision.
        if lead {
            if let Some(d) = trainer.activation_decision() {
                if said_activations.as_ref() != Some(&d.shape) {
                    said_activations = Some(d.shape);
                    progress.println(&format!(
                        "activations: {} of {} blocks keep their forward graph for backward \
                         ({} held), the others are recomputed; {} x {} tokens a micro-batch",
                        d.kept(),
                        d.blocks,
                        tierzero::units::format_bytes(d.kept_bytes()),
                        d.shape[0],
                        d.shape[1]
                    ));
                }
            }
        }
        if !m.loss.is_finite() {
            // Skipped or not, a loss that is not finite ends the run, but
            // under fp16's dynamic scale, which a skipped step lowers (and
            // which stops at min_loss_scale). Without one the weights stay
            // as they were and the next step meets them again: a model
            // initialised to NaN trained every step skipped and exited 0
            // (gradient clipping, on by default, skips a NaN loss's step).
            if !m.skipped || !trainer.dynamic_loss_scale() {
                progress.finish();
                // The run's hyperparameters, not a fault of ours: exit 2
                // with the fix, as for the user's other mistakes. Before
                // any update was applied (this run's first step of a
                // fresh model, or at lr 0), nothing diverged: the forward
                // of the weights as they were is not finite.
                let applied_here = if m.skipped { 0 } else { 1 };
                let nothing_applied = m.lr == 0.0 || trainer.adam_steps() == applied_here;
                return Err(Failure::BadInput(anyhow!(
                    "step {}: the loss is {}{}",
                    m.step,
                    m.loss,
                    if nothing_applied {
                        " before any update was applied: the forward of the weights as loaded \
                         (or initialised) is not finite; check the model's weights and \
                         initializer_range, and the data's token ids (fp16 overflows first: \
                         bf16 or fp32)"
                    } else {
                        " (diverged); lower the learning rate"
                    }
                )));
            }
            // fp16's dynamic scale: the engine skipped the step (its
            // gradients were not all finite) and lowered the scale; the
            // weights are the last step's, and the run goes on, as
            // DeepSpeed's does (the scaler stops it at `min_loss_scale`).
            if lead {
                progress.println(&format!(
                    "step {}: the loss is {}; the step was skipped (gradients not all finite), \
                     the weights are unchanged",
                    m.step, m.loss
                ));
            }
        }
        if lead {
            progress.step(&m, steps);
        }
        if let Some(cause) = report.stop {
            // Every rank stops here (the trainer agreed on it); the save of
            // this step follows, within the grace period.
            stop = Some(cause);
            if first.is_none() {
                first = Some(m.clone());
            }
            last = Some(m);
            break;
        }
        let mut stop_after_save = None;
        if let (Some(every), Some(dir)) = (save_every, &args.save_dir) {
            if m.step.is_multiple_of(every) {
                save(trainer, dir).inspect_err(|_| progress.finish())?;
                saved_at = Some(m.step);
                // A stop asked for during the save ends the run here, at
                // the step just saved (it went on to train the next step
                // and save again, past a scheduler's grace period). Every
                // rank saved this step, so every rank agrees here; after
                // the last step the run ends anyway, as a run done.
                if m.step < steps {
                    crate::cli::signals::request_caught(&trainer.stop_handle());
                    stop_after_save = trainer.agree_stop().map_err(|e| {
                        progress.finish();
                        run_failure(e, "agreeing on a stop after a save")
                    })?;
                }
            }
        }
        if first.is_none() {
            first = Some(m.clone());
        }
        last = Some(m);
        if let Some(cause) = stop_after_save {
            stop = Some(cause);
            break;
        }
    }
    progress.finish();
    let stopped = match (stop, &args.save_dir) {
        (None, Some(dir)) => {
            if saved_at != Some(trainer.steps_done()) {
                save(trainer, dir)?;
            }
            None
        }
        (None, None) => None,
        (Some(cause), dir) => {
            let step = trainer.steps_done();
            say(&format!(
                "stopping at step {step} of {steps} ({})\n",
                cause
                    .signal_name()
                    .unwrap_or_else(|| "requested".to_owned())
            ))?;
            let checkpoint_step = match dir {
                None => None,
                Some(_) if saved_at == Some(step) => Some(step),
                Some(dir) => {
                    let began = Instant::now();
                    let r = stop_save(trainer, dir, saved_at.or(run.resumed_from), say);
                    save_s.set(save_s.get() + began.elapsed().as_secs_f64());
                    r?
                }
            };
            Some(Stopped {
                cause,
                checkpoint_step,
            })
        }
    };
    match (first, last) {
        (Some(first), Some(last)) => Ok(Steps {
            first,
            last,
            stop: stopped,
            save_s: save_s.get(),
        }),
        _ => Err(Failure::Internal(anyhow!("no step ran"))),
    }
}

/// The checkpoint of the step a stopped run ended at, unless the grace
/// period has too little time left; returns the newest checkpoint's step
/// (`before` when skipped).
fn stop_save(
    trainer: &mut Trainer,
    dir: &Path,
    before: Option<u64>,
    say: &dyn Fn(&str) -> Result<(), Failure>,
) -> Result<Option<u64>, Failure> {
    let step = trainer.steps_done();
    let started = Instant::now();
    match trainer
        .save_on_stop(dir)
        .map_err(|e| save_failure(e, "saving a checkpoint after a stop", dir))?
    {
        StopSave::Saved(p) => {
            say(&format!(
                "checkpoint: step {step} saved to {} ({})\n",
                p.display(),
                size_and_time(&p, started.elapsed().as_secs_f64())
            ))?;
            Ok(Some(step))
        }
        StopSave::Skipped { needed_s, left_s } => {
            let grace = trainer.stop_grace().map_or(0.0, |g| g.as_secs_f64());
            errln!(
                "warning: the checkpoint of step {step} was skipped: a save takes about \
                 {needed_s:.1} s and {:.1} s of the {grace} s stop grace period \
                 (--stop-grace / tierzero.stop_grace_s) were left; {}",
                left_s.max(0.0),
                match before {
                    Some(b) => format!(
                        "this run's last checkpoint is step {b}'s, {}",
                        dir.join(tierzero::checkpoint::step_dir_name(b)).display()
                    ),
                    None => format!("{} holds no checkpoint of this run", dir.display()),
                }
            );
            Ok(before)
        }
    }
}
