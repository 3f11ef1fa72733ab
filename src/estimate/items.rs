//! The per-rank accounting of one choice: every buffer, tier and extent
//! the engine's sizing policy (`crate::engine::sizing`) would give it, as
//! items with their formulas.

use super::*;

fn mul(a: u64, b: u64, what: &str) -> Result<u64, EstimateError> {
    a.checked_mul(b).ok_or_else(|| EstimateError::Overflow {
        what: what.to_owned(),
    })
}

/// What the speculation pool's row is called.
pub(super) const SPECULATION_POOL: &str = "speculation pool (state slots)";

/// Per-rank accounting of one choice (see the module docs), with no
/// known limit on NVMe space: [`items_within`] with `None`.
pub fn items(inp: &Inputs, c: Choice) -> Result<Vec<Item>, EstimateError> {
    items_within(inp, c, None)
}

/// Per-rank accounting of one choice, with `nvme_room_bytes` the NVMe
/// space a rank has beside its other extents, when known: it bounds the
/// auto speculation pool as the run bounds it
/// ([`sizing::speculation_pool_slots`]).
pub fn items_within(
    inp: &Inputs,
    c: Choice,
    nvme_room_bytes: Option<u64>,
) -> Result<Vec<Item>, EstimateError> {
    let n = inp.total_numel;
    let r = inp.ranks;
    let s = n.div_ceil(r);
    let p = inp.param_elem_bytes;
    let l = inp.largest_unit_numel;
    let sw = &inp.swap;
    let mut v = Vec::new();
    let mut push = |tier, what, bytes, formula: String| {
        v.push(Item {
            tier,
            what,
            bytes,
            formula,
        })
    };
    let part = |partitioned: bool| -> (u64, String) {
        if partitioned && r > 1 {
            (s, format!("⌈{n}/{r}⌉"))
        } else {
            (n, format!("{n}"))
        }
    };

    // 16-bit params.
    let (pn, ps) = part(c.stage == Stage::Parameters);
    let param_bytes = mul(pn, p, "16-bit params")?;
    match c.params {
        Offload::None => push(
            Tier::Device,
            "16-bit params",
            param_bytes,
            format!("{ps} × {p} B"),
        ),
        Offload::Cpu => push(
            pinned_or(sw.param_pin_memory),
            "16-bit param partition",
            param_bytes,
            format!("{ps} × {p} B"),
        ),
        Offload::Nvme => {
            // The first `max_in_cpu` elements stay in host memory and the
            // rest go to NVMe (the engine's home tiers, param by param);
            // the swap-in buffers exist only for those on NVMe.
            let cached = sw.param_max_in_cpu_numel.min(pn);
            let on_nvme = pn - cached;
            if on_nvme > 0 {
                push(
                    Tier::Nvme,
                    "16-bit param partition",
                    mul(on_nvme, p, "16-bit params on NVMe")?,
                    if cached > 0 {
                        format!("({ps} − max_in_cpu {}) × {p} B", sw.param_max_in_cpu_numel)
                    } else {
                        format!("{ps} × {p} B")
                    },
                );
                let bufs = sizing::param_buffers(sw.param_buffer_count, sw.param_buffer_numel, p);
                push(
                    pinned_or(sw.param_pin_memory),
                    "param swap-in buffers",
                    mul(bufs.count, bufs.bytes_each, "param buffers")?,
                    format!(
                        "buffer_count {} × buffer_size {} × {p} B, 4 KiB-aligned",
                        bufs.count, sw.param_buffer_numel
                    ),
                );
            }
            if cached > 0 {
                push(
                    pinned_or(sw.param_pin_memory),
                    "param host cache (max_in_cpu)",
                    mul(cached, p, "param host cache")?,
                    format!(
                        "min(max_in_cpu {}, {ps}) × {p} B",
                        sw.param_max_in_cpu_numel
                    ),
                );
            }
        }
    }
    if c.stage == Stage::Parameters && !(r == 1 && c.params == Offload::None) {
        push(
            Tier::Device,
            "gathered units (current + prefetched)",
            mul(mul(2, l, "gathered units")?, p, "gathered units")?,
            format!("2 × {l} × {p} B"),
        );
    }
    if c.stage >= Stage::Gradients || c.optimizer != Offload::None {
        push(
            Tier::Device,
            "one unit's 16-bit grads",
            mul(l, p, "unit grads")?,
            format!("{l} × {p} B"),
        );
    }

    // fp32 gradient accumulators, where the optimizer runs. With the
    // state on NVMe they are bounded below (after the state's items).
    let (gn, gs) = part(c.stage >= Stage::Gradients);
    let grad_bytes = mul(gn, 4, "fp32 grads")?;
    match c.optimizer {
        Offload::None => push(
            Tier::Device,
            "fp32 grad accumulators",
            grad_bytes,
            format!("{gs} × 4 B"),
        ),
        // The host optimizer's sums are heap memory, never pinned (the
        // plan's grads row); bf16 where the run holds each gradient as it
        // came (`sizing::bf16_grad_numel`, one rank only).
        Offload::Cpu => {
            let b = inp.bf16_grad_numel.min(gn);
            let bytes = mul(gn - b, 4, "fp32 grads")?
                .checked_add(mul(b, 2, "bf16 grads")?)
                .ok_or(EstimateError::Overflow {
                    what: "host grads".into(),
                })?;
            let (what, formula) = match b {
                0 => ("fp32 grad accumulators", format!("{gs} × 4 B")),
                b if b == gn => ("bf16 gradients (held as they came)", format!("{gs} × 2 B")),
                b => (
                    "grad accumulators (fp32; bf16 as they came)",
                    format!(
                        "{} × 4 B (fp32 sums: groups of params several units share) + {b} × 2 B",
                        gn - b
                    ),
                ),
            };
            push(Tier::Pageable, what, bytes, formula)
        }
        Offload::Nvme => {}
    }

    // What backward stages beside the sums on the host (the optimizer's
    // side): a tied param's whole sum, the reduce's unit buffer with
    // several ranks (`sizing::backward_staging_bytes`).
    if c.optimizer != Offload::None {
        let staged = sizing::backward_staging_bytes(inp.tied_numel, l, r);
        if staged > 0 {
            push(
                Tier::Pageable,
                "fp32 grads staged in backward (tied sums, reduce buffer)",
                staged,
                format!(
                    "({} tied{}) × 4 B",
                    inp.tied_numel,
                    if r > 1 {
                        format!(" + largest unit {l}")
                    } else {
                        String::new()
                    }
                ),
            );
        }
    }

    // Optimizer state.
    let (on, os) = part(c.stage >= Stage::OptimizerStates);
    let per = 4 + 2 * inp.moment_elem_bytes;
    let state_tier = match c.optimizer {
        Offload::None => Tier::Device,
        Offload::Cpu => Tier::Pageable,
        Offload::Nvme => Tier::Nvme,
    };
    let state_bytes = mul(on, per, "optimizer state")?;
    // The largest sub-group as the sizing policy sees a model known by its
    // size: a param larger than `sub_group_size` is tiled, so at most
    // `sub_group_size`.
    let largest_group =
        Shape::estimated(on, inp.largest_tensor_numel, sw.sub_group_numel).max_sub_group_numel();
    // With NVMe state, the sub-groups of the first forward units stay in
    // host memory (`tierzero.optimizer_resident_bytes`; auto: one
    // sub-group's state, at most one prefetch bucket's). The engine keeps only whole sub-groups holding those units'
    // params, so this counts the budget when one group's state fits it
    // (at the most), and nothing when it does not.
    let resident_bytes = if c.optimizer == Offload::Nvme {
        let one_group = largest_group.saturating_mul(per);
        // "auto" never keeps every group (`sizing::resident_groups`): at
        // most all but one group's state stays in memory, so a one-group
        // model's none.
        let cap = match sw.optimizer_resident_bytes {
            None => state_bytes.saturating_sub(one_group),
            Some(_) => state_bytes,
        };
        let budget = sw
            .optimizer_resident_bytes
            .unwrap_or_else(|| {
                sizing::auto_optimizer_resident_bytes(
                    sw.prefetch_bucket_numel,
                    sw.sub_group_numel,
                    per,
                )
            })
            .min(cap);
        if one_group <= budget {
            budget
        } else {
            0
        }
    } else {
        0
    };
    push(
        state_tier,
        "fp32 master + Adam m, v",
        state_bytes - resident_bytes,
        if resident_bytes > 0 {
            format!(
                "{os} × (4 + 2 × {}) B, less the resident part",
                inp.moment_elem_bytes
            )
        } else {
            format!("{os} × (4 + 2 × {}) B", inp.moment_elem_bytes)
        },
    );
    if resident_bytes > 0 {
        push(
            Tier::Pageable,
            "optimizer state kept resident (at most)",
            resident_bytes,
            match sw.optimizer_resident_bytes {
                Some(b) => format!("tierzero.optimizer_resident_bytes {b} B"),
                None => format!(
                    "min(stage3_prefetch_bucket_size {}, sub_group_size {}) × {per} B",
                    sw.prefetch_bucket_numel, sw.sub_group_numel
                ),
            },
        );
    }
    let tile = sw.sub_group_numel.min(on);
    if c.optimizer == Offload::Nvme {
        nvme_state_grads(
            inp,
            (on, &os),
            largest_group,
            resident_bytes > 0,
            nvme_room_bytes,
            &mut push,
        )?;
    }
    if c.optimizer == Offload::Nvme {
        let (bufs, why) = optimizer_buffer_count(sw, largest_group);
        push(
            pinned_or(sw.optimizer_pin_memory),
            "optimizer swap buffers",
            mul(bufs.count, bufs.bytes_each, "optimizer buffers")?,
            format!(
                "{} buffers ({why}) × min(sub_group_size {}, {os}) × 4 B (a larger tensor is tiled), 4 KiB-aligned",
                bufs.count, sw.sub_group_numel
            ),
        );
    }
    if c.optimizer != Offload::None {
        // A stepped sub-group's new 16-bit values, on their way to the
        // params' homes: heap memory (`StepValues`, one kept spare), for
        // any offloaded optimizer.
        push(
            Tier::Pageable,
            "16-bit new values of a stepped sub-group",
            mul(tile, p, "new values")?,
            format!("min(sub_group_size {}, {os}) × {p} B", sw.sub_group_numel),
        );
    }
    Ok(v)
}

/// With the optimizer state on NVMe, where the fp32 gradients are (the
/// sizing policy's rules, `crate::engine::sizing`): host memory holds at
/// most the sums of the largest unit's sub-groups, the groups held for the
/// step (with clipping or an overflow check), the speculated ones and the steps handed
/// to the optimizer thread, each one largest sub-group; with clipping or
/// fp16 the final gradients spill to NVMe; with gradient accumulation the
/// partial sums are parked on NVMe between micro-batches, through pinned
/// buffers; speculation writes new state into a pool of slots on NVMe.
///
/// `(on, os)` is the optimizer state's partition, elements and formula.
fn nvme_state_grads(
    inp: &Inputs,
    (on, os): (u64, &str),
    largest_group: u64,
    one_resident: bool,
    nvme_room_bytes: Option<u64>,
    push: &mut impl FnMut(Tier, &'static str, u64, String),
) -> Result<(), EstimateError> {
    let sw = &inp.swap;
    let shape = Shape::estimated(on, inp.largest_tensor_numel, sw.sub_group_numel);
    let sub_groups = shape.sub_groups.len() as u64;
    let g = largest_group.max(1);
    let (ra, wb) = (
        usize::from(sw.pipeline_read),
        usize::from(sw.pipeline_write),
    );
    let spill = sw.spill_grads_with_nvme_state;
    // The largest unit's params touch at most its elements' worth of
    // groups plus one at each end (a tiled tensor starts a group of its
    // own, and a unit's other params may sit in the groups on either side).
    let unit_groups = (inp.largest_unit_numel.div_ceil(g) + 2).min(sub_groups);
    let resident = u64::from(one_resident);
    let held = if spill {
        (ra as u64 + 1 + resident).min(sub_groups)
    } else {
        0
    };
    let per = 4 + 2 * inp.moment_elem_bytes;
    let slots = sizing::speculation_pool_slots(
        sw.speculative_with_nvme_state,
        ra,
        wb,
        sub_groups.saturating_sub(resident) as usize,
        sw.speculation_pool_bytes,
        per.saturating_mul(g),
        nvme_room_bytes,
    ) as u64;
    let kept = sizing::speculation_kept_grads(ra, wb, slots as usize) as u64;
    let in_flight = sizing::grads_in_flight(ra, wb);
    // Each group's sum at most the largest group's: 2 bytes an element
    // where every group holds its gradients as they came, in bf16.
    let (what, elem_bytes) = if on > 0 && inp.bf16_grad_numel >= on {
        ("bf16 gradients in host memory (at most)", 2)
    } else {
        ("fp32 grads in host memory (at most)", 4)
    };
    if sw.overlap_optimizer {
        push(
            Tier::Pageable,
            what,
            sizing::nvme_state_grad_bound_bytes(
                unit_groups + held + kept,
                ra,
                wb,
                sub_groups,
                mul(g, elem_bytes, "host grads")?,
            ),
            format!(
                "min((unit {unit_groups} + held {held} + speculated {kept} + handed over {in_flight}) sub-groups, {sub_groups}) × {g} × {elem_bytes} B"
            ),
        );
    } else {
        // The engine's rule (`host_grad_bound_bytes`): not overlapped,
        // every sub-group's gradients wait in host memory for the step.
        push(
            Tier::Pageable,
            what,
            mul(on, elem_bytes, "host grads")?,
            format!(
                "{os} × {elem_bytes} B (tierzero.overlap_optimizer false: all held for the step)"
            ),
        );
    }
    if spill {
        push(
            Tier::Nvme,
            "final fp32 grads spilled (clipping / fp16)",
            mul(on, 4, "spilled grads")?,
            format!("{os} × 4 B"),
        );
    }
    if sw.gradient_accumulation_steps > 1 {
        push(
            Tier::Nvme,
            "fp32 grad sums parked between micro-batches",
            mul(on, 4, "parked grads")?,
            format!(
                "{os} × 4 B (gradient_accumulation_steps {})",
                sw.gradient_accumulation_steps
            ),
        );
        let bufs = sizing::park_buffers(g);
        push(
            pinned_or(sw.optimizer_pin_memory),
            "grad park buffers",
            mul(bufs.count, bufs.bytes_each, "park buffers")?,
            format!("{} × {g} × 4 B, 4 KiB-aligned", bufs.count),
        );
    }
    if slots > 0 {
        let nvme_groups = sub_groups.saturating_sub(resident);
        let why = match sw.speculation_pool_bytes {
            Some(b) => format!("tierzero.speculation_pool_bytes {b}"),
            None if slots == nvme_groups => "auto: every NVMe sub-group".to_owned(),
            None => format!(
                "auto: of {nvme_groups} NVMe sub-groups, what half the free space left buys"
            ),
        };
        push(
            Tier::Nvme,
            SPECULATION_POOL,
            mul(mul(slots, per, "speculation pool")?, g, "speculation pool")?,
            format!("{slots} slots × {g} × {per} B ({why})"),
        );
    }
    Ok(())
}

/// Where a buffer the config may pin lives: pinned, or pageable with
/// `pin_memory: false`.
fn pinned_or(pin: bool) -> Tier {
    if pin {
        Tier::Pinned
    } else {
        Tier::Pageable
    }
}

/// The optimizer swap buffers the engine maps (the sizing policy's rule,
/// [`sizing::optimizer_buffers`]) for a largest sub-group of
/// `largest_group_numel` elements, and why that many.
fn optimizer_buffer_count(sw: &SwapSettings, largest_group_numel: u64) -> (Buffers, &'static str) {
    let (bufs, needed) = sizing::optimizer_buffers(
        sw.optimizer_buffer_count,
        usize::from(sw.pipeline_read),
        usize::from(sw.pipeline_write),
        sw.spill_grads_with_nvme_state,
        largest_group_numel,
    );
    let why = if bufs.count == needed && needed > sw.optimizer_buffer_count {
        "what the pipeline needs"
    } else {
        "buffer_count"
    };
    (bufs, why)
}
