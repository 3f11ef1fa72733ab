//! The build's checks, before anything is allocated: the run's shape,
//! the settings every rank must share, the head's logits, the pinned
//! budget's shortfall, host memory (with what a step holds) and
//! `RLIMIT_MEMLOCK`.

use super::*;

/// What every rank of a run must share, by name, for
/// [`crate::engine::comm::same_on_every_rank`]: the run's length, window
/// and seed, the config's numerics (batch, clipping, precision, optimizer,
/// scheduler, sub-group size, data order) and its ZeRO settings (the
/// `nvme_path`s aside: a node may mount its disk elsewhere), the model,
/// and the data's length and, with several ranks, its ids' crc32c
/// (`data_crc32c`: a node's other copy of the corpus, of the same length,
/// trained each rank on other windows and exited 0). The weights are
/// compared once loaded ([`same_weights_on_every_rank`]).
pub(super) fn rank_settings(
    config: &Config,
    model: &Model,
    data: &TokenData,
    data_crc32c: Option<u32>,
    opts: &TrainerOptions,
) -> Vec<(&'static str, String)> {
    let fp = super::checkpoint::config_fingerprint(config, opts.data_order);
    let numerics = |key: &str| fp.numerics.get(key).cloned().unwrap_or_default();
    let mut zero = config.zero.clone();
    for device in [
        &mut zero.offload_param.device,
        &mut zero.offload_optimizer.device,
    ] {
        if let crate::config::OffloadDevice::Nvme { path } = device {
            *path = std::path::PathBuf::new();
        }
    }
    let mut model_sha = crate::sha256::Sha256::new();
    model_sha.update(model.hf_config_value().to_string().as_bytes());
    vec![
        (
            "the run's steps (--steps)",
            opts.run_steps
                .map_or_else(|| "not given".to_owned(), |n| n.to_string()),
        ),
        ("the sequence length (--seq-len)", opts.seq_len.to_string()),
        ("the init seed (--seed)", opts.seed.to_string()),
        ("the data order", numerics("data_order")),
        (
            "the batch (the config's, with --micro-batch and --grad-accum)",
            format!(
                "train_batch_size {} = micro-batch {} x accumulation {} x {} ranks",
                config.batch.train_batch_size,
                config.batch.micro_batch_size,
                config.batch.gradient_accumulation_steps,
                config.batch.ranks
            ),
        ),
        ("gradient_clipping", numerics("gradient_clipping")),
        ("the precision (fp16/bf16)", numerics("precision")),
        ("check_grad_overflow", numerics("check_grad_overflow")),
        ("the optimizer (with --lr)", numerics("optimizer")),
        ("the scheduler (with --steps)", numerics("scheduler")),
        ("zero_optimization", format!("{zero:?}")),
        (
            "the model's config.json (its sha256)",
            model_sha.finish_hex(),
        ),
        ("the data's token count", data.len().to_string()),
        (
            "the data's token ids (their crc32c)",
            data_crc32c.map_or_else(String::new, |c| format!("{c:08x}")),
        ),
    ]
}

/// A param's digest on a rank that loaded none of it
/// ([`same_weights_on_every_rank`]).
pub(super) const NOT_LOADED: u64 = u64::MAX;

/// Every rank loaded the same weights: `digests[p]` is the crc32c of
/// param `p`'s values as this rank loaded them (the whole tensor, from its
/// own `--model` files or the seeded init), or [`NOT_LOADED`] where it
/// holds no piece of it (or resumes, loading the checkpoint's masters);
/// each param's digests are compared among the ranks that loaded it. Ranks
/// that read different files of one config (a node's stale copy of the
/// model) trained a mix of two models and exited 0. One all-gather; every
/// rank calls it with one digest per param.
pub(super) fn same_weights_on_every_rank(
    comm: &dyn crate::engine::comm::Comm,
    model: &Model,
    digests: &[u64],
) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mine: Vec<u8> = digests.iter().flat_map(|d| d.to_le_bytes()).collect();
    let ranks: Vec<Vec<u64>> = crate::engine::comm::all_gather_var(comm, &mine)?
        .iter()
        .map(|b| {
            b.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0xff; 8])))
                .collect()
        })
        .collect();
    for (p, spec) in model.params().iter().enumerate() {
        let held: Vec<(usize, u64)> = ranks
            .iter()
            .enumerate()
            .filter_map(|(r, d)| Some((r, *d.get(p)?)).filter(|(_, d)| *d != NOT_LOADED))
            .collect();
        let Some(&(_, first)) = held.first() else {
            continue;
        };
        if held.iter().all(|&(_, d)| d == first) {
            continue;
        }
        return Err(EngineError::RanksDisagree {
            setting: format!("the weights of {} (the crc32c of its values)", spec.name),
            values: crate::engine::comm::values_by_rank(
                held.iter().map(|&(r, d)| (r, format!("{d:08x}"))),
            ),
        });
    }
    Ok(())
}

/// The run's shape checks: token ids within the vocabulary, a sequence
/// length the model can take, a rank within its world, and a config
/// resolved for this world.
pub(super) fn check_run(
    config: &Config,
    model: &Model,
    data: &TokenData,
    opts: &TrainerOptions,
) -> Result<()> {
    let mc = model.config();
    if data.vocab_needed() > mc.vocab_size {
        return Err(EngineError::config(format!(
            "the data has token ids up to {} but the model's vocab_size is {}",
            data.vocab_needed().saturating_sub(1),
            mc.vocab_size
        )));
    }
    if opts.seq_len == 0 || opts.seq_len > mc.max_seq_len {
        return Err(EngineError::config(format!(
            "seq_len {} must be in 1..={} (the model's max positions)",
            opts.seq_len, mc.max_seq_len
        )));
    }
    data.check_seq_len(opts.seq_len)?;
    let world = opts.comm.world_size();
    let rank = opts.comm.rank();
    if world == 0 || rank >= world {
        // A communicator the caller gave (`TrainerOptions::comm`).
        return Err(EngineError::config(format!(
            "TrainerOptions::comm says rank {rank} of a world of {world}: a rank must be below \
             the world size, which must be at least 1"
        )));
    }
    if config.batch.ranks != world as u64 {
        return Err(EngineError::config(format!(
            "the config was resolved for {} ranks but the communicator has {world}",
            config.batch.ranks
        )));
    }
    // Every rank's own memory, agreed: one refusing alone left the others
    // in their first collective.
    if opts.compute.is_none() && !opts.skip_compute {
        crate::engine::comm::agree(
            &*opts.comm,
            "checking the head's memory",
            check_head_memory(config, model, opts.seq_len),
        )?;
    }
    Ok(())
}

/// The head's logits of a micro-batch of `seq_len` tokens fit the host
/// memory available (the units compute on the CPU).
pub(in crate::engine::trainer) fn check_head_memory(
    config: &Config,
    model: &Model,
    seq_len: usize,
) -> Result<()> {
    sizing::check_logits_memory(
        config.batch.micro_batch_size.saturating_mul(seq_len as u64),
        model.config().vocab_size as u64,
        sizing::TRAIN_LOGITS_COPIES,
        sizing::mem_available_bytes(),
        "lower train_micro_batch_size_per_gpu (raise gradient_accumulation_steps to keep the \
         batch) or the sequence length",
    )
}

/// The sizing's budget shortfall as the engine reports it (and
/// `tierzero estimate`, which runs the same sizing).
impl From<BudgetShort> for EngineError {
    fn from(s: BudgetShort) -> EngineError {
        budget_error(s)
    }
}

pub(super) fn budget_error(s: BudgetShort) -> EngineError {
    EngineError::PinnedBudget {
        lower_keys: match (s.optimizer_buffers_needed.count, s.param_buffers.count) {
            (0, _) => "zero_optimization.offload_param.buffer_count / buffer_size",
            (_, 0) => "zero_optimization.sub_group_size",
            _ => "zero_optimization.sub_group_size or offload_param.buffer_count / buffer_size",
        },
        budget_bytes: s.budget_bytes,
        param_buffer_count: s.param_buffers.count,
        param_buffer_bytes: s.param_buffers.bytes_each,
        param_buffers_bytes: s.param_buffers.total_bytes(),
        optimizer_buffers_needed: s.optimizer_buffers_needed.count,
        optimizer_buffer_bytes: s.optimizer_buffers_needed.bytes_each,
        optimizer_stages: s.optimizer_stages,
        optimizer_stage_buffers: if s.optimizer_spills_grads {
            "3 states and the spilled gradient"
        } else {
            "3 states"
        },
        park_buffers_bytes: s.park_buffers.total_bytes(),
        required_bytes: s.required_bytes,
    }
}

/// Refuses a run whose pinned buffers and pages and host-memory optimizer
/// state, held from its start, cannot fit: the page-locked ones beyond
/// `available_bytes` (`MemAvailable`; `None`: unknown, not checked), or
/// all of them beyond it and `swap_free_bytes` (pageable memory may go to
/// swap). They failed later: a mapping as an internal error naming NVMe
/// swap, an allocation as an abort, or the kernel's OOM killer. Only
/// these, which are certain: the rest of the plan is "at most", and the
/// activations adapt to what is left.
#[allow(
    clippy::too_many_arguments,
    reason = "one check over the build's facts"
)]
pub(super) fn check_host_memory(
    config: &Config,
    sizing: &Sizing,
    shape: &Shape,
    working_bytes: u64,
    lockable: bool,
    available_bytes: Option<u64>,
    swap_free_bytes: Option<u64>,
) -> Result<()> {
    let Some(available_bytes) = available_bytes else {
        return Ok(());
    };
    let swap_free_bytes = swap_free_bytes.unwrap_or(0);
    let opt_nvme = config.zero.offload_optimizer.device.nvme_path().is_some();
    let pinned_bytes = sizing.pinned_total_bytes();
    let locked_bytes = if lockable { sizing.lock_bytes } else { 0 };
    let state_bytes = sizing.optimizer_host_bytes(shape, opt_nvme);
    let all = pinned_bytes
        .saturating_add(state_bytes)
        .saturating_add(working_bytes);
    if locked_bytes <= available_bytes && all <= available_bytes.saturating_add(swap_free_bytes) {
        return Ok(());
    }
    let params_nvme = config.zero.offload_param.device.nvme_path().is_some();
    let fix = match (params_nvme, opt_nvme) {
        (true, true) => "lower zero_optimization.sub_group_size (the gradients and new values \
                         the host holds are counted in sub-groups), lower \
                         offload_param.buffer_count / buffer_size or \
                         offload_optimizer.buffer_count, or run fewer ranks on this machine"
            .to_owned(),
        _ => "offload the params and the optimizer state to NVMe \
              (zero_optimization.offload_param / offload_optimizer device \"nvme\"), lower \
              offload_param.buffer_count / buffer_size or offload_optimizer.buffer_count, or run \
              fewer ranks on this machine"
            .to_owned(),
    };
    Err(EngineError::HostMemory {
        working_bytes,
        fix,
        pinned_bytes,
        locked_bytes,
        state_bytes,
        available_bytes,
        swap_free_bytes,
    })
}

/// What the host holds beside its start-up allocations, as the start-up
/// plan shows it. With CPU compute (no device units), while a step runs:
/// the params it computes with, the gradients it holds at most, the
/// optimizer's new-values buffers and the parked sums' host part (the
/// plan's rows, [`crate::run::Plan::host_working_bytes`]). With a device
/// (`on_device`), whose own budget holds the step's working set: the
/// param store's host copy of the params homed on the device, held from
/// the start (the plan's "home on the device: host copy" row; it was not
/// counted, so a model too large for the host passed the check and met
/// the OOM killer).
pub(super) fn host_working_bytes(
    config: &Config,
    model: &Model,
    layout: &Layout,
    sizing: &Sizing,
    on_device: bool,
) -> u64 {
    let plan = crate::run::Plan::new(config, model, layout, sizing, String::new());
    if on_device {
        return plan.params.device_bytes;
    }
    plan.host_working_bytes()
}

/// Whether everything the sizing would page-lock fits `RLIMIT_MEMLOCK`,
/// checked before anything is mapped. `tierzero.memlock = "require"`
/// refuses when it does not; `"auto"` warns and runs unlocked.
pub(super) fn check_memlock(config: &Config, sizing: &Sizing) -> Result<bool> {
    let lock_bytes = sizing.lock_bytes;
    let info = MemlockInfo::current();
    let lockable = lock_bytes == 0 || info.check(lock_bytes).is_ok();
    if !lockable {
        if config.tierzero.memlock == config::Memlock::Require {
            return Err(EngineError::Memlock {
                lock_bytes,
                cpu_pages_bytes: if config.zero.offload_param.pin_memory {
                    sizing.cpu_pages.total_bytes()
                } else {
                    0
                },
                limit_bytes: info.limit_bytes,
                locked_bytes: info.locked_bytes,
            });
        }
        tracing::warn!(
            pinned_bytes = lock_bytes,
            memlock_limit_bytes = info.limit_bytes,
            "the pinned buffers exceed RLIMIT_MEMLOCK; running with unlocked buffers (fix: \
             `ulimit -l unlimited` or lower the buffers; tierzero.memlock = \"require\" \
             refuses instead)"
        );
    }
    Ok(lockable)
}
