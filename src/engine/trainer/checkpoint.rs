use super::*;

/// The optimizer's settings as the checkpoints before `bias_correction`
/// was read wrote them (its `Debug` text then), with a note only when bias
/// correction is off: a checkpoint of the same settings then resumes
/// without a warning that they differ.
pub(super) fn optimizer_fingerprint(o: &config::Optimizer) -> String {
    let text = format!(
        "Optimizer {{ kind: {:?}, lr: {:?}, betas: {:?}, eps: {:?}, weight_decay: {:?}, \
         decoupled_weight_decay: {:?} }}",
        o.kind, o.lr, o.betas, o.eps, o.weight_decay, o.decoupled_weight_decay
    );
    if o.bias_correction {
        text
    } else {
        format!("{text} without bias correction")
    }
}

/// The settings that change the numbers, as text, and a hash of the whole
/// resolved config (see [`ConfigFingerprint`]); `order` is the run's data
/// order (file order is named as before the shuffle existed, so a
/// checkpoint of then resumes in file order without a warning).
pub fn config_fingerprint(config: &Config, order: crate::data::DataOrder) -> ConfigFingerprint {
    let mut numerics = BTreeMap::new();
    numerics.insert("batch".to_owned(), format!("{:?}", config.batch));
    numerics.insert(
        "gradient_clipping".to_owned(),
        format!("{:?}", config.gradient_clipping),
    );
    numerics.insert("precision".to_owned(), format!("{:?}", config.precision));
    numerics.insert(
        "check_grad_overflow".to_owned(),
        format!("{}", config.check_grad_overflow),
    );
    numerics.insert(
        "optimizer".to_owned(),
        optimizer_fingerprint(&config.optimizer),
    );
    numerics.insert("scheduler".to_owned(), format!("{:?}", config.scheduler));
    numerics.insert(
        "sub_group_size".to_owned(),
        format!("{}", config.zero.sub_group_numel.0),
    );
    let data_order = match order {
        crate::data::DataOrder::Sequential => crate::data::WINDOW_ORDER.to_owned(),
        shuffled => format!("{}, {}", crate::data::WINDOW_ORDER, shuffled.describe()),
    };
    numerics.insert("data_order".to_owned(), data_order);
    let mut h = Sha256::new();
    h.update(format!("{config:?}").as_bytes());
    ConfigFingerprint {
        numerics,
        full_sha256: h.finish_hex(),
    }
}

/// A setting that changes the numbers and differs between a checkpoint's
/// run and this one ([`numerics_differing`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumericsDiffer {
    /// The setting (a key of [`ConfigFingerprint::numerics`]).
    pub key: String,
    /// The checkpoint's, as text (`None`: not recorded).
    pub saved: Option<String>,
    /// This run's, as text.
    pub run: String,
}

impl std::fmt::Display for NumericsDiffer {
    /// The fields that differ where both values are one struct's
    /// (`scheduler (total_steps: checkpoint 4, this run 6)`), else both
    /// values whole.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self
            .saved
            .as_deref()
            .and_then(|saved| differing_fields(saved, &self.run))
        {
            Some(fields) => write!(f, "{} ({fields})", self.key),
            None => write!(
                f,
                "{} (checkpoint: {}; this run: {})",
                self.key,
                self.saved.as_deref().unwrap_or("(not recorded)"),
                self.run
            ),
        }
    }
}

/// The fields in which two `Debug` renderings of one struct
/// (`Name { a: 1, b: [2, 3] }`) differ, each as `a: checkpoint 1, this run
/// 4`; `None` where they are not one struct's with the same fields.
fn differing_fields(saved: &str, run: &str) -> Option<String> {
    let (saved_name, saved_fields) = debug_fields(saved)?;
    let (run_name, run_fields) = debug_fields(run)?;
    let same_shape = saved_name == run_name
        && saved_fields.len() == run_fields.len()
        && saved_fields
            .iter()
            .zip(&run_fields)
            .all(|(a, b)| a.0 == b.0);
    if !same_shape {
        return None;
    }
    let differ: Vec<String> = saved_fields
        .iter()
        .zip(&run_fields)
        .filter(|(a, b)| a.1 != b.1)
        .map(|(a, b)| format!("{}: checkpoint {}, this run {}", a.0, a.1, b.1))
        .collect();
    (!differ.is_empty()).then(|| differ.join("; "))
}

/// A struct's `Debug` rendering cut into its name and its top-level
/// `field: value` pairs.
fn debug_fields(text: &str) -> Option<(&str, Vec<(&str, &str)>)> {
    let open = text.find(" { ")?;
    let body = text.strip_suffix(" }")?.get(open + 3..)?;
    let mut fields = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, b) in body.bytes().enumerate() {
        match b {
            b'[' | b'{' | b'(' => depth += 1,
            b']' | b'}' | b')' => depth -= 1,
            b',' if depth == 0 => {
                fields.push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    fields.push(&body[start..]);
    let pairs = fields
        .into_iter()
        .map(|f| f.trim().split_once(": "))
        .collect::<Option<Vec<_>>>()?;
    Some((&text[..open], pairs))
}

/// The settings that change the numbers in which `config` (with data
/// order `order`) differs from the run that saved `m`. Another rank count
/// with the same global batch and micro-batch size does the same
/// arithmetic (N ranks with accumulation G are one rank with G·N) and
/// reads the same data: not a difference.
pub fn numerics_differing(
    config: &Config,
    order: crate::data::DataOrder,
    m: &crate::checkpoint::Manifest,
) -> Vec<NumericsDiffer> {
    let run_fp = config_fingerprint(config, order);
    let same_global_batch = m.data.micro_batch_size == config.batch.micro_batch_size
        && m.data
            .micro_batch_size
            .checked_mul(m.data.gradient_accumulation_steps)
            .and_then(|x| x.checked_mul(m.world_size as u64))
            == Some(config.batch.train_batch_size);
    run_fp
        .numerics
        .into_iter()
        .filter(|(k, v)| m.config.numerics.get(k) != Some(v))
        .filter(|(k, _)| !(k.as_str() == "batch" && same_global_batch))
        .map(|(key, run)| NumericsDiffer {
            saved: m.config.numerics.get(&key).cloned(),
            key,
            run,
        })
        .collect()
}

impl Trainer {
    /// A trainer that continues from `ckpt`: the model is the checkpoint's,
    /// masters and moments are loaded (crc-verified) and the params
    /// re-encoded from the masters; step counters, the loss scaler and so
    /// the lr schedule and data position continue where it stopped. With the
    /// same config and data order, the run continues bit-identically. The
    /// order is `opts.data_order`, this run's: to continue the saved one,
    /// pass `ckpt.manifest().data.order_or_file()` (`tierzero train` does
    /// unless told another); another is warned about (`data_order`).
    ///
    /// Refused ([`crate::checkpoint::CheckpointError::Mismatch`]) when the run cannot use the
    /// checkpoint; warned about when the config's numerics, the seq_len or
    /// the precision of the loss scaler differ.
    pub fn resume(
        config: &Config,
        ckpt: &Checkpoint,
        data: TokenData,
        opts: TrainerOptions,
    ) -> Result<Self> {
        let m = ckpt.manifest();
        let differing: Vec<String> = numerics_differing(config, opts.data_order, m)
            .into_iter()
            .map(|d| d.to_string())
            .collect();
        let world = opts.comm.world_size();
        same_step_on_every_rank(&*opts.comm, m.step)?;
        if m.world_size != world && opts.comm.rank() == 0 {
            tracing::info!(
                checkpoint_ranks = m.world_size,
                ranks = world,
                "resharding the checkpoint: each rank loads its own shard of every parameter"
            );
        }
        if !differing.is_empty() {
            tracing::warn!(
                settings = %differing.join("; "),
                "the training config differs from the checkpoint's in settings that change the \
                 numbers; the resumed run will not match an uninterrupted one"
            );
        }
        if let Some(saved) = m.data.tokens.filter(|&n| n != data.len() as u64) {
            tracing::warn!(
                checkpoint = saved,
                run = data.len(),
                "the data has another number of tokens than the checkpoint's (other text at the \
                 same path, another tokenizer or format): the samples from the checkpoint's \
                 position on are not the ones an uninterrupted run would see"
            );
        } else if let Some(saved) = m.data.ids_crc32c {
            let run = data.ids_crc32c();
            if run != saved {
                tracing::warn!(
                    checkpoint = format!("{saved:#010x}"),
                    run = format!("{run:#010x}"),
                    "the data has the checkpoint's number of tokens but other ids (the text \
                     edited, another tokenizer of the same length): the samples from the \
                     checkpoint's position on are not the ones an uninterrupted run would see"
                );
            }
        }
        if m.seq_len != opts.seq_len {
            tracing::warn!(
                checkpoint = m.seq_len,
                run = opts.seq_len,
                "seq_len differs from the checkpoint's: the data position moves"
            );
        }
        let mut t = Self::build(
            config,
            ckpt.model().clone(),
            WeightSource::Checkpoint(ckpt),
            data,
            opts,
        )?;
        t.steps_done = m.step;
        // The model's init seed is the checkpoint's (the weights come from
        // it; this run's seed initialised nothing): later checkpoints say
        // the seed the run began with, not a resume's default.
        t.opts.seed = m.seed;
        // The data continue at the sample the checkpoint reached, whatever
        // this run's global batch.
        let mut lineage = m.lineage.clone();
        lineage.push(crate::checkpoint::LineageEntry::new_run(m.step));
        t.data_base = super::DataBase {
            step: m.step,
            samples: m.data.samples_consumed,
            lineage,
        };
        t.adam_steps = m.adam_steps;
        t.skipped = m.skipped_steps;
        match (
            &m.loss_scaler,
            matches!(config.precision, Precision::Fp16 { .. }),
        ) {
            (Some(s), true) => t.scaler.restore(s),
            (None, true) => tracing::warn!(
                "the checkpoint has no loss-scaler state (not fp16): starting from the config's"
            ),
            _ => {}
        }
        Ok(t)
    }

    /// Hands the trainer a save-dir lock taken earlier (the CLI takes it at
    /// start-up, to refuse before training rather than at the first save).
    /// [`Trainer::save_checkpoint`] takes one itself when it has none for
    /// its save dir.
    pub fn adopt_save_dir_lock(&mut self, lock: crate::checkpoint::SaveDirLock) {
        self.save_lock = Some(lock);
    }

    /// One writer per save dir (rank 0 writes everything outside the rank
    /// dirs): the `flock` on `<save_dir>/.lock`, held until the trainer is
    /// dropped.
    pub(super) fn take_save_lock(
        &mut self,
        save_dir: &std::path::Path,
    ) -> Result<&crate::checkpoint::SaveDirLock> {
        if !self.save_lock.as_ref().is_some_and(|l| l.covers(save_dir)) {
            crate::durable::create_dir_all(save_dir)
                .map_err(crate::checkpoint::CheckpointError::from)?;
            self.save_lock = Some(crate::checkpoint::SaveDirLock::acquire(save_dir)?);
        }
        self.save_lock
            .as_ref()
            .ok_or_else(|| EngineError::internal("the save dir lock was just taken"))
    }

    /// Writes a checkpoint of the current state to
    /// `<save_dir>/step-<N>/` and points `<save_dir>/latest` at it; returns
    /// the step dir. See [`crate::checkpoint`] for the format and the
    /// write sequence. Pending parameter writes and the optimizer pipeline
    /// are drained first; NVMe optimizer extents are copied by the swap
    /// space (O_DIRECT through a bounce buffer, or a reflink), memory tiers
    /// written from memory.
    ///
    /// Several ranks: a collective, called by every rank at the same step.
    /// Rank 0 creates the staging dir (named after its pid, which every
    /// rank learns through an all-gather); every rank writes and fsyncs its
    /// own `rank<RRRR>/` files in parallel; the ranks' layouts and file
    /// records (crcs) are all-gathered; rank 0 writes the consolidated
    /// 16-bit weights if configured (each param gathered from all ranks),
    /// the manifest last, renames the dir into place and rewrites
    /// `latest`. Only rank 0 touches anything outside its own rank dir.
    /// After each phase the ranks agree on the outcome
    /// ([`crate::engine::comm::agree`]), so a rank that fails makes every rank fail
    /// with an error naming it instead of leaving them waiting, and no rank
    /// returns before the checkpoint is visible (or the save has failed
    /// everywhere).
    pub fn save_checkpoint(&mut self, save_dir: &std::path::Path) -> Result<PathBuf> {
        let started = Instant::now();
        let r = self.save_checkpoint_inner(save_dir);
        let took = started.elapsed();
        if r.is_ok() && self.slowest_save.is_none_or(|s| s < took) {
            self.slowest_save = Some(took);
        }
        r
    }

    fn save_checkpoint_inner(&mut self, save_dir: &std::path::Path) -> Result<PathBuf> {
        let comm = self.opts.comm.clone();
        let world = comm.world_size();
        let rank = comm.rank();
        let step = self.steps_done;
        // A stopped trainer's state is not trustworthy: never save it.
        // Then the last step's optimizer tail (its Flush included), and the
        // param writes it caused.
        // A failure there is the trainer's (its state is not written),
        // not the save's: both latch it.
        let ready = self.check_usable().and_then(|()| {
            self.settle_optimizer()?;
            let r = self.store.flush_writes();
            self.latch(r)
        });
        agree(&*comm, "saving a checkpoint (preparing)", ready)?;

        // Rank 0's pid names the staging dir; everyone learns it.
        let pids = crate::engine::comm::all_gather_u64(&*comm, std::process::id().into())?;
        let owner_pid = pids
            .first()
            .and_then(|p| u32::try_from(*p).ok())
            .unwrap_or_else(std::process::id);
        let begun = if rank == 0 {
            self.take_save_lock(save_dir).and_then(|lock| {
                StagedCheckpoint::begin(save_dir, step, lock)
                    .map(Some)
                    .map_err(EngineError::from)
            })
        } else {
            Ok(None)
        };
        // Also the barrier before the other ranks write into the dir.
        let mut staged = agree(&*comm, "saving a checkpoint (staging dir)", begun)?;

        // Every rank: its own state files. A failure anywhere fails every
        // rank, after all have stopped writing (rank 0 then removes the
        // staging dir when `staged` drops).
        let part = self.save_rank_part(&mut staged, save_dir, owner_pid);
        let layout = agree(&*comm, "saving a checkpoint (state files)", part)?;

        // The ranks' layouts and file records, to rank 0 (all-gathered).
        let own_files = match &staged {
            Some(s) if rank != 0 => s.files().to_vec(),
            _ => Vec::new(),
        };
        let record = serde_json::to_vec(&(&layout, &own_files))
            .map_err(|e| EngineError::internal(format!("serialising a rank record: {e}")))?;
        let records = all_gather_var(&*comm, &record)?;

        // Consolidated 16-bit weights (a collective), then rank 0 commits.
        let hf = self.save_hf_weights(if rank == 0 { staged.as_mut() } else { None });
        let done = match (rank, hf) {
            (0, Ok(hf_weights)) => match staged.take() {
                Some(s) => self.commit_checkpoint(s, layout, &records, hf_weights),
                None => Err(EngineError::internal("rank 0 has no staging dir")),
            },
            (_, Ok(_)) => Ok(save_dir.join(step_dir_name(step))),
            (_, Err(e)) => Err(e),
        };
        // No rank returns before the checkpoint is complete.
        let dir = agree(&*comm, "saving a checkpoint (commit)", done)?;
        if rank == 0 {
            tracing::info!(dir = %dir.display(), name = %step_dir_name(step), ranks = world, "checkpoint saved");
        }
        Ok(dir)
    }

    /// This rank's part of a save: joins rank 0's staging dir (other
    /// ranks), writes `rank<RRRR>/{master,exp_avg,exp_avg_sq}.f32`, records
    /// them with their region crcs and (other ranks) fsyncs them. Returns
    /// this rank's layout for the manifest.
    pub(super) fn save_rank_part(
        &mut self,
        staged: &mut Option<StagedCheckpoint>,
        save_dir: &std::path::Path,
        owner_pid: u32,
    ) -> Result<RankLayout> {
        let rank = self.opts.comm.rank();
        if staged.is_none() {
            *staged = Some(StagedCheckpoint::join(
                save_dir,
                self.steps_done,
                owner_pid,
            )?);
        }
        let staged = staged
            .as_mut()
            .ok_or_else(|| EngineError::internal("no staging dir"))?;
        let rank_dir = format!("rank{rank:04}");
        staged.create_dir(&rank_dir)?;

        // Regions: the same in the three state files.
        let mut regions: Vec<(u64, u64)> = Vec::with_capacity(self.layout.sub_groups.len());
        let mut offset = 0u64;
        for g in &self.layout.sub_groups {
            let len = align_state_bytes(g.numel as u64 * 4)
                .ok_or_else(|| EngineError::internal("sub-group size overflows"))?;
            regions.push((offset, len));
            offset += len;
        }
        let total_bytes = offset;
        let mut files = Vec::with_capacity(3);
        for kind in StateKind::ALL {
            let rel = format!("{rank_dir}/{}.f32", kind.name());
            let (f, path) = staged.create_file(&rel)?;
            f.set_len(total_bytes)
                .map_err(crate::checkpoint::io_err("sizing", &path))?;
            crate::durable::record::note(|| crate::durable::record::FsOp::SetLen {
                path: path.clone(),
                len: total_bytes,
            });
            files.push((kind, rel, f, path));
        }
        // The copies run on the optimizer thread, which owns the state.
        let job_regions = regions.clone();
        let job_files: Vec<(usize, std::fs::File, PathBuf)> = files
            .iter()
            .map(|(k, _, f, p)| {
                f.try_clone()
                    .map(|f| (k.index(), f, p.clone()))
                    .map_err(|source| EngineError::Io {
                        path: p.clone(),
                        source,
                    })
            })
            .collect::<Result<_>>()?;
        let crcs: Vec<Vec<u32>> = self.exclusive(move |st| {
            let mut crcs: Vec<Vec<u32>> = Vec::with_capacity(3);
            for (k, f, p) in &job_files {
                let mut v = Vec::with_capacity(job_regions.len());
                for (i, &(off, len)) in job_regions.iter().enumerate() {
                    v.push(st.save_state(SubGroupId(i), *k, f, p, off, len)?);
                }
                crcs.push(v);
            }
            Ok(crcs)
        })?;
        for ((_, rel, _, _), crc) in files.iter().zip(&crcs) {
            let rc = regions
                .iter()
                .zip(crc)
                .map(|(&(offset_bytes, len_bytes), &crc32c)| RegionCrc {
                    offset_bytes,
                    len_bytes,
                    crc32c,
                })
                .collect();
            staged.add_file_with_regions(rel, rc)?;
        }
        drop(files);
        if rank != 0 {
            // Rank 0's commit syncs its own (and again everyone's).
            staged.sync_own()?;
        }

        let mut states = std::collections::BTreeMap::new();
        for kind in StateKind::ALL {
            states.insert(
                kind.name().to_owned(),
                format!("{rank_dir}/{}.f32", kind.name()),
            );
        }
        let sub_groups = self
            .layout
            .sub_groups
            .iter()
            .zip(&regions)
            .map(|(g, &(offset_bytes, len_bytes))| SubGroupEntry {
                numel: g.numel as u64,
                offset_bytes,
                len_bytes,
                params: g
                    .pieces
                    .iter()
                    .map(|pc| {
                        let pid = pc.param;
                        let slot = &self.layout.params[pid.0];
                        ParamEntry {
                            name: self
                                .model
                                .param(pid)
                                .map(|p| p.name.clone())
                                .unwrap_or_default(),
                            numel: slot.numel as u64,
                            shard_start: (slot.shard_start + pc.offset_in_shard) as u64,
                            shard_numel: pc.numel as u64,
                            offset_in_group: pc.offset_in_group as u64,
                        }
                    })
                    .collect(),
            })
            .collect();
        Ok(RankLayout {
            rank,
            states,
            sub_groups,
        })
    }

    /// Consolidated 16-bit weights (`stage3_gather_16bit_weights_on_model_save`):
    /// every param is gathered from all ranks in `ParamId` order (a
    /// collective on every rank); rank 0 (`staged` is `Some`) streams them
    /// into `model.safetensors` and writes `config.json`. If rank 0's
    /// writing fails part-way, it still takes part in the remaining
    /// gathers, so the other ranks are not left waiting, and then fails.
    pub(super) fn save_hf_weights(
        &mut self,
        staged: Option<&mut StagedCheckpoint>,
    ) -> Result<Option<crate::checkpoint::HfWeights>> {
        if !self.config.zero.gather_16bit_weights_on_model_save {
            return Ok(None);
        }
        let model = self.model.clone();
        let mut cache: Option<(SubGroupId, Vec<f32>)> = None;
        let Some(staged) = staged else {
            // Rank 0 writes them: the others only take part.
            self.walk_masters(drop)?;
            return Ok(None);
        };
        let dtype = self.store.dtype();
        let mut fetched = 0usize;
        // (The error, and whether it is rank 0's own read's, after which
        // the others still gather the rest.)
        let mut gather_err: Option<(EngineError, bool)> = None;
        let written = staged
            .create_file("model.safetensors")
            .map_err(EngineError::from)
            .and_then(|(f, path)| {
                crate::model::write_safetensors(f, &path, &model, dtype, |pid| {
                    fetched += 1;
                    let shape = model
                        .param(pid)
                        .map(|p| p.shape.clone())
                        .unwrap_or_default();
                    let (e, own) = match self.gather_master_joined(pid, &mut cache) {
                        Ok(Ok(v)) => {
                            return Ok(Tensor::from_vec(v, shape.as_slice(), &Device::Cpu)?)
                        }
                        Ok(Err(e)) => (e, true),
                        Err(e) => (e, false),
                    };
                    let text = e.to_string();
                    gather_err = Some((e, own));
                    Err(crate::model::ModelError::Unsupported { what: text })
                })
                .map_err(EngineError::Model)
            });
        let failed = match (gather_err, written) {
            // The collective failed: no more of them.
            (Some((e, false)), _) => return Err(e),
            (Some((e, true)), _) => Some(e),
            (None, Err(e)) => Some(e),
            // (The written file is closed here, with the tuple.)
            (None, Ok(_)) => None,
        };
        if let Some(e) = failed {
            // The others still gather the params rank 0 did not fetch.
            for p in model.params().iter().skip(fetched) {
                let _ = self.gather_master_joined(p.id, &mut cache)?;
            }
            return Err(e);
        }
        let (cf, cpath) = staged.create_file("config.json")?;
        let text = crate::model::hf_config_text(&self.model, dtype)?;
        {
            use std::io::Write as _;
            let mut cf = cf;
            cf.write_all(text.as_bytes())
                .map_err(|source| EngineError::Io {
                    path: cpath.clone(),
                    source,
                })?;
            crate::durable::record::write(&cpath, 0, text.len() as u64);
        }
        staged.add_file("model.safetensors")?;
        staged.add_file("config.json")?;
        Ok(Some(crate::checkpoint::manifest_hf_weights(
            "model.safetensors",
            "config.json",
            match dtype {
                DType::BF16 => "bf16",
                DType::F16 => "fp16",
                _ => "fp32",
            },
        )))
    }

    /// Rank 0: records the other ranks' files, writes the manifest (every
    /// rank's layout, in rank order) last and makes the step dir visible.
    pub(super) fn commit_checkpoint(
        &self,
        mut staged: StagedCheckpoint,
        own: RankLayout,
        records: &[Vec<u8>],
        hf_weights: Option<crate::checkpoint::HfWeights>,
    ) -> Result<PathBuf> {
        let world = self.opts.comm.world_size();
        let mut ranks = Vec::with_capacity(world);
        ranks.push(own);
        for (r, bytes) in records.iter().enumerate().skip(1) {
            let (layout, files): (RankLayout, Vec<FileEntry>) = serde_json::from_slice(bytes)
                .map_err(|e| EngineError::internal(format!("rank {r}'s record: {e}")))?;
            if layout.rank != r {
                return Err(EngineError::internal(format!(
                    "rank {r}'s record says rank {}",
                    layout.rank
                )));
            }
            staged.add_entries(files)?;
            ranks.push(layout);
        }
        let gas = self.config.batch.gradient_accumulation_steps.max(1);
        let mb = self.config.batch.micro_batch_size.max(1);
        let manifest = Manifest {
            format: FORMAT_NAME.to_owned(),
            version: FORMAT_VERSION,
            step: self.steps_done,
            adam_steps: self.adam_steps,
            skipped_steps: self.skipped,
            loss_scaler: matches!(self.config.precision, Precision::Fp16 { .. })
                .then(|| self.scaler.state()),
            seed: self.opts.seed,
            seq_len: self.opts.seq_len,
            run_steps: self.opts.run_steps,
            data: DataPosition {
                source: self.data_name.clone(),
                samples_consumed: self.samples_consumed(),
                micro_batch_size: mb,
                gradient_accumulation_steps: gas,
                tokens: Some(self.data.len() as u64),
                ids_crc32c: Some(self.data.ids_crc32c()),
                order: Some(self.opts.data_order),
            },
            precision: self.config.precision.name().to_owned(),
            world_size: world,
            model: self.model.hf_config_value(),
            config: config_fingerprint(&self.config, self.opts.data_order),
            ranks,
            hf_weights,
            files: Vec::new(),
            lineage: self.data_base.lineage.clone(),
        };
        Ok(staged.commit(manifest)?)
    }
}

/// Every rank resumes from step `step`: each opens the checkpoint itself,
/// and one whose view of the save dir differs (a file system's cache, a
/// damaged step one rank fell back from) would train from another step,
/// silently. Refused with each rank's step. One collective: every rank
/// calls it ([`Trainer::resume`] does; `tierzero train` also before it
/// decides there is nothing left to run, which a rank would decide alone).
pub fn same_step_on_every_rank(comm: &dyn crate::engine::comm::Comm, step: u64) -> Result<()> {
    let steps = crate::engine::comm::all_gather_u64(comm, step)?;
    if steps.iter().all(|s| *s == step) {
        return Ok(());
    }
    let each: Vec<String> = steps
        .iter()
        .enumerate()
        .map(|(r, s)| format!("rank {r}: step {s}"))
        .collect();
    Err(EngineError::Checkpoint(
        crate::checkpoint::CheckpointError::Mismatch {
            what: "the step each rank resumes from".into(),
            checkpoint: each.join(", "),
            run: "ranks that must resume one step: give every rank --resume of the same \
                  step-<N> directory, on a file system they all see alike"
                .into(),
        },
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use crate::engine::comm::scripted::Scripted;

    #[test]
    fn ranks_resuming_from_different_steps_are_refused_with_each_step() {
        let mut comm = Scripted::rank_of(0, 2);
        comm.gather_bytes = Some(|shard, _, out| {
            out[..8].copy_from_slice(shard);
            out[8..].copy_from_slice(&4u64.to_le_bytes());
            Ok(())
        });
        same_step_on_every_rank(&comm, 4).unwrap();
        let e = same_step_on_every_rank(&comm, 6).unwrap_err().to_string();
        assert!(e.contains("rank 0: step 6, rank 1: step 4"), "{e}");
        same_step_on_every_rank(&Scripted::rank_of(0, 1), 9).unwrap();
    }

    /// A differing setting names the fields that differ, not two whole
    /// `Debug` renderings; values that are not one struct's are shown whole.
    #[test]
    fn a_differing_setting_names_its_fields() {
        let differ = |saved: &str, run: &str| {
            NumericsDiffer {
                key: "scheduler".into(),
                saved: Some(saved.into()),
                run: run.into(),
            }
            .to_string()
        };
        let a = "WarmupDecayLr { min_lr: 0.0, max_lr: 0.001, betas: [0.9, 0.95], total_steps: 4 }";
        let b = "WarmupDecayLr { min_lr: 0.0, max_lr: 0.001, betas: [0.9, 0.999], total_steps: 6 }";
        assert_eq!(
            differ(a, b),
            "scheduler (betas: checkpoint [0.9, 0.95], this run [0.9, 0.999]; total_steps: \
             checkpoint 4, this run 6)"
        );
        assert_eq!(
            differ("None", "Constant { lr: 1.0 }"),
            "scheduler (checkpoint: None; this run: Constant { lr: 1.0 })"
        );
        assert_eq!(
            differ("A { x: 1 }", "B { x: 2 }"),
            "scheduler (checkpoint: A { x: 1 }; this run: B { x: 2 })"
        );
        let adam = config::Optimizer {
            kind: config::OptimizerKind::AdamW,
            lr: 1e-3,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled_weight_decay: true,
            bias_correction: true,
        };
        let other = config::Optimizer { lr: 0.5, ..adam };
        let shown = differ(
            &optimizer_fingerprint(&adam),
            &optimizer_fingerprint(&other),
        );
        assert!(
            shown.starts_with("scheduler (lr: checkpoint ") && shown.ends_with("this run 0.5)"),
            "{shown}"
        );
    }
}
