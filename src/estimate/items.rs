//! The per-rank accounting of one choice: every buffer, tier and extent
//! the engine's sizing policy (`crate::engine::sizing`) would give it, as
//! items with their formulas.

use super::*;

fn mul(a: u64, b: u64, what: &str) -> Result<u64, EstimateError> {
    a.checked_mul(b).ok_or_else(|| EstimateError::Overflow {
        what: what.to_owned(),
    })
}

/// Appends to `v` an item of its parts (tier, what, bytes, formula): what
/// every builder of items pushes through.
fn pusher(v: &mut Vec<Item>) -> impl FnMut(Tier, &'static str, u64, String) + '_ {
    move |tier, what, bytes, formula| {
        v.push(Item {
            tier,
            what,
            bytes,
            formula,
        })
    }
}

/// `n` elements over `r` ranks: one rank's share `⌈n/r⌉` with its formula
/// where `partitioned` (and `r > 1`), else all `n`.
fn share(n: u64, r: u64, partitioned: bool) -> (u64, String) {
    if partitioned && r > 1 {
        (n.div_ceil(r), format!("⌈{n}/{r}⌉"))
    } else {
        (n, format!("{n}"))
    }
}

/// What the speculation pool's row is called.
pub(super) const SPECULATION_POOL: &str = "speculation pool (state slots)";

/// Per-rank accounting of one choice (see the module docs), with no
/// known limit on NVMe space: [`items_within`] with `None`.
pub fn items(inp: &Inputs, c: Choice) -> Result<Vec<Item>, EstimateError> {
    items_within(inp, c, None)
}

/// Per-rank accounting of one choice on a GPU (`gpu`) or on the CPU as
/// the device: on a GPU, `offload_optimizer: none` is accounted as
/// `gpu_adam_items` does; on the CPU, where train runs Adam on the host
/// with or without the offload (the same plan), as `offload_optimizer:
/// cpu` (its new param values and staged gradients were left out: a row
/// recommended for 19.7 GiB was refused by train for ~31); else as
/// [`items_within`].
pub fn items_on(
    inp: &Inputs,
    c: Choice,
    gpu: bool,
    nvme_room_bytes: Option<u64>,
) -> Result<Vec<Item>, EstimateError> {
    let mut v = match (gpu, c.optimizer) {
        (true, Offload::None) => gpu_adam_items(inp, c, nvme_room_bytes)?,
        (false, Offload::None) => {
            let mut v = host_adam_items(inp, c, nvme_room_bytes)?;
            // Nothing is offloaded from the CPU as the device: what the
            // host optimizer holds in pageable memory is the device's.
            for it in &mut v {
                if it.tier == Tier::Pageable {
                    it.tier = Tier::Device;
                }
            }
            v
        }
        _ => items_within(inp, c, nvme_room_bytes)?,
    };
    if gpu && c.params == Offload::None {
        // The param store keeps the params whose home is the device as
        // host tensors too: this rank's shards with several ranks (they
        // are handed out and gathered), every param with one. (On the CPU
        // as the device, they are the device's bytes.)
        let p = inp.param_elem_bytes;
        let (pn, ps) = share(inp.total_numel, inp.ranks, true);
        pusher(&mut v)(
            Tier::Pageable,
            "params host copy (the param store)",
            mul(pn, p, "host param copy")?,
            format!("{ps} × {p} B"),
        );
    }
    Ok(v)
}

/// Choice `c` with Adam on the host, as `offload_optimizer: cpu` runs it:
/// where train steps on the host though the config offloads nothing.
fn host_adam_items(
    inp: &Inputs,
    c: Choice,
    nvme_room_bytes: Option<u64>,
) -> Result<Vec<Item>, EstimateError> {
    items_within(
        inp,
        Choice {
            optimizer: Offload::Cpu,
            ..c
        },
        nvme_room_bytes,
    )
}

/// `offload_optimizer: none` on a GPU, as `tierzero train` runs it. Adam
/// runs on the device only with nothing offloaded, where it can
/// ([`crate::engine::device::trains_resident`]: not fp16, `adam_w_mode`
/// on); the device then holds what the device optimizer's own rule says
/// ([`crate::engine::device::resident_state_bytes`]: the weights, fp32
/// masters beside bf16 ones, fp32 m and v, the gradient sums and its
/// workspace), and host memory keeps its copy of the state (master, m and
/// v: loaded into the device, written back at saves; [`items_on`] adds the
/// param store's copy of the params). Otherwise Adam runs on the host as with
/// `offload_optimizer: cpu`, and so is accounted as that.
pub fn gpu_adam_items(
    inp: &Inputs,
    c: Choice,
    nvme_room_bytes: Option<u64>,
) -> Result<Vec<Item>, EstimateError> {
    let why_host = match (&inp.device_adam_refusal, c.params) {
        (Some(why), _) => Some(why.clone()),
        (None, Offload::None) => None,
        (None, p) => Some(format!("offload_param.device is {}", p.name())),
    };
    if let Some(why) = why_host {
        let mut v = host_adam_items(inp, c, nvme_room_bytes)?;
        for it in &mut v {
            if it.tier == Tier::Pageable {
                it.formula = format!("{} (Adam on the host: {why})", it.formula);
            }
        }
        return Ok(v);
    }
    let n = inp.total_numel;
    let r = inp.ranks;
    let l = inp.largest_unit_numel;
    // Params of the largest one's size stand for them (their shards
    // differ from the real ones' by at most an element a param); at most
    // 2^16 of them (a larger stand-in, at most n / 2^16 elements, moves
    // the workspace's largest-param term by under 0.02% of n).
    let t = inp.largest_tensor_numel.unwrap_or(l).clamp(1, n);
    let chunk = t.max(n.div_ceil(1 << 16));
    let numels: Vec<u64> = (0..n.div_ceil(chunk))
        .map(|i| chunk.min(n - i * chunk))
        .collect();
    let world = usize::try_from(r).unwrap_or(usize::MAX);
    let partition = c.stage == Stage::Parameters;
    let [weights, masters, moments, work] = crate::engine::device::resident_state_bytes(
        &numels,
        inp.bf16_params,
        0,
        world,
        &[l],
        partition,
    );
    let s = n.div_ceil(r);
    let mut v = Vec::new();
    let mut push = pusher(&mut v);
    let p = inp.param_elem_bytes;
    push(
        Tier::Device,
        "params (Adam on the device)",
        weights,
        if partition && r > 1 {
            format!("2 gathered units × {l} × {p} B")
        } else {
            format!("{n} × {p} B")
        },
    );
    if masters > 0 {
        push(
            Tier::Device,
            "fp32 masters",
            masters,
            format!("⌈{n}/{r}⌉ × 4 B"),
        );
    }
    push(
        Tier::Device,
        "Adam m, v (fp32)",
        moments,
        format!("⌈{n}/{r}⌉ × 8 B"),
    );
    push(
        Tier::Device,
        "fp32 grad sums and workspace",
        work,
        if r > 1 {
            format!(
                "(sums ⌈{n}/{r}⌉ + largest param {t} + 3 × largest unit {l} + 2 × ({r} + 3) × ⌈{l}/{r}⌉) × 4 B (engine::device::resident_state_bytes)"
            )
        } else {
            format!(
                "(sums {n} + largest unit {l} + 3 × largest param {t}) × 4 B (engine::device::resident_state_bytes)"
            )
        },
    );
    push(
        Tier::Pageable,
        "optimizer state host copy (master, m, v)",
        mul(s, 12, "host state copy")?,
        format!("⌈{n}/{r}⌉ × 12 B (loaded into the device, written back at saves)"),
    );
    drop(push); // its borrow of `v`
    Ok(v)
}

/// Per-rank accounting of one choice, with `nvme_room_bytes` the NVMe
/// space a rank has beside its other extents, when known: it bounds the
/// auto speculation pool as the run bounds it
/// ([`sizing::speculation_pool`]).
pub fn items_within(
    inp: &Inputs,
    c: Choice,
    nvme_room_bytes: Option<u64>,
) -> Result<Vec<Item>, EstimateError> {
    let n = inp.total_numel;
    let r = inp.ranks;
    let p = inp.param_elem_bytes;
    let l = inp.largest_unit_numel;
    let sw = &inp.swap;
    let mut v = Vec::new();
    let mut push = pusher(&mut v);
    let part = |partitioned: bool| share(n, r, partitioned);

    // 16-bit params.
    let (pn, ps) = part(c.stage == Stage::Parameters);
    let param_bytes = mul(pn, p, "params")?;
    match (c.params, inp.shape.as_ref()) {
        // The model's own shards: the sizing policy's pages and homes.
        (Offload::Cpu | Offload::Nvme, Some(shape)) => {
            offloaded_param_items(inp, c, shape, &mut push)?
        }
        (Offload::None, _) => push(Tier::Device, "params", param_bytes, format!("{ps} × {p} B")),
        (Offload::Cpu, _) => push(
            pinned_or(sw.param_pin_memory),
            "param partition",
            param_bytes,
            format!("{ps} × {p} B"),
        ),
        (Offload::Nvme, _) => {
            // The first `max_in_cpu` elements stay in host memory and the
            // rest go to NVMe (the engine's home tiers, param by param);
            // the swap-in buffers exist only for those on NVMe.
            let cached = sw.param_max_in_cpu_numel.min(pn);
            let on_nvme = pn - cached;
            if on_nvme > 0 {
                push(
                    Tier::Nvme,
                    "param partition",
                    mul(on_nvme, p, "params on NVMe")?,
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
    // Persistent params (the model's, when known): whole tensors in the
    // heap beside their homes for the run (the plan's params host bytes).
    let (persistent_numel, persistent_count) = inp.persistent;
    if c.stage == Stage::Parameters && c.params != Offload::None && persistent_numel > 0 {
        push(
            Tier::Pageable,
            "persistent params (whole, never released)",
            mul(persistent_numel, p, "persistent params")?,
            format!(
                "{persistent_count} params of at most stage3_param_persistence_threshold \
                 elements, {persistent_numel} in all × {p} B"
            ),
        );
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
            "one unit's grads (param dtype)",
            mul(l, p, "unit grads")?,
            format!("{l} × {p} B"),
        );
    }

    // fp32 gradient accumulators, where the optimizer runs, sharded over
    // the ranks at every stage. With the state on NVMe they are bounded
    // below (after the state's items).
    let (gn, gs) = part(true);
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

    // Optimizer state, sharded over the ranks at every stage as the
    // gradient sums are (the trainer's layout, `crate::engine::layout`).
    let (on, os) = part(true);
    let per = 4 + 2 * inp.moment_elem_bytes;
    let state_tier = match c.optimizer {
        Offload::None => Tier::Device,
        Offload::Cpu => Tier::Pageable,
        Offload::Nvme => Tier::Nvme,
    };
    // The sub-groups: the model's, or the sizing policy's stand-in for a
    // model known by its size (a param larger than `sub_group_size` is
    // tiled, so none is larger).
    let estimated;
    let shape = match &inp.shape {
        Some(s) => s,
        None => {
            estimated = Shape::estimated(on, inp.largest_tensor_numel, sw.sub_group_numel);
            &estimated
        }
    };
    let largest_group = shape.max_sub_group_numel();
    // With NVMe state, the sub-groups holding the first forward units'
    // params stay in host memory while their state fits
    // `tierzero.optimizer_resident_bytes` (auto: one sub-group's, at most
    // one prefetch bucket's): the engine's rule, on the same shape.
    let resident = match c.optimizer {
        Offload::Nvme => sizing::resident_groups_within(
            shape,
            sw.optimizer_resident_bytes,
            sw.prefetch_bucket_numel,
            sw.sub_group_numel,
        ),
        _ => vec![false; shape.sub_groups.len()],
    };
    let resident_groups = resident.iter().filter(|r| **r).count() as u64;
    let resident_numel: u64 = shape
        .sub_groups
        .iter()
        .zip(&resident)
        .filter(|(_, r)| **r)
        .map(|(g, _)| g.numel)
        .sum();
    let resident_bytes = mul(resident_numel, per, "resident state")?;
    let m = inp.moment_elem_bytes;
    if c.optimizer == Offload::Nvme {
        // Each NVMe sub-group's master, m and v: an extent each, 4 KiB-aligned.
        let nvme_state = shape
            .sub_groups
            .iter()
            .zip(&resident)
            .filter(|(_, r)| !**r)
            .try_fold(0u64, |a, (g, _)| {
                let one = sizing::align_up(g.numel.checked_mul(4)?)
                    .checked_add(sizing::align_up(g.numel.checked_mul(m)?).checked_mul(2)?)?;
                a.checked_add(one)
            })
            .ok_or_else(|| EstimateError::Overflow {
                what: "optimizer state on NVMe".into(),
            })?;
        push(
            Tier::Nvme,
            "fp32 master + Adam m, v",
            nvme_state,
            format!(
                "{} sub-groups' (4 + 2 × {m}) B an element{}, each extent 4 KiB-aligned",
                shape.sub_groups.len() as u64 - resident_groups,
                if resident_groups > 0 {
                    ", less the resident groups"
                } else {
                    ""
                }
            ),
        );
    } else {
        push(
            state_tier,
            "fp32 master + Adam m, v",
            mul(on, per, "optimizer state")?,
            format!("{os} × (4 + 2 × {m}) B"),
        );
    }
    if resident_bytes > 0 {
        push(
            Tier::Pageable,
            "optimizer state kept resident",
            resident_bytes,
            format!(
                "{resident_groups} sub-group(s) of the first forward units, {resident_numel} × {per} B, within {}",
                match sw.optimizer_resident_bytes {
                    Some(b) => format!("tierzero.optimizer_resident_bytes {b} B"),
                    None => format!(
                        "min(stage3_prefetch_bucket_size {}, sub_group_size {}) × {per} B",
                        sw.prefetch_bucket_numel, sw.sub_group_numel
                    ),
                }
            ),
        );
    }
    let tile = sw.sub_group_numel.min(on);
    if c.optimizer == Offload::Nvme {
        nvme_state_grads(inp, (on, &os), shape, &resident, nvme_room_bytes, &mut push)?;
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
        // Stepped sub-groups' new 16-bit values, on their way to the
        // params' homes: heap memory (`StepValues`), as many as the
        // optimizer thread lends at once and the spare it keeps, for any
        // offloaded optimizer.
        let unit_groups = unit_groups(inp, shape);
        let buffers = sizing::values_buffers(
            usize::from(sw.pipeline_read),
            usize::from(sw.pipeline_write),
            unit_groups as usize,
            shape.sub_groups.len(),
        ) as u64;
        push(
            Tier::Pageable,
            "new param values of stepped sub-groups",
            mul(buffers, mul(tile, p, "new values")?, "new values")?,
            format!(
                "({} lent (a unit's {unit_groups} sub-groups and the hand-over's, at most all) + 1 spare) × min(sub_group_size {}, {os}) × {p} B",
                buffers - 1,
                sw.sub_group_numel
            ),
        );
    }
    drop(push); // its borrow of `v`
    swap_slack_item(&mut v, c.optimizer == Offload::Nvme);
    Ok(v)
}

/// The NVMe items of the swap spaces other than the optimizer state's
/// (the params', the parked gradients'): each space is made when one of
/// its items has bytes. The optimizer state's space is made whenever its
/// offload is NVMe, even empty (every sub-group resident, nothing
/// spilled). Each gets [`sizing::SWAP_SLACK_BYTES`] beyond its items, as
/// the engine sizes it ([`crate::engine::Sizing::swap_space_bytes`]):
/// without it, a disk the estimate said fits could refuse the run by that
/// much.
const OTHER_SWAP_SPACES: [&str; 2] = [
    "param partition",
    "fp32 grad sums parked between micro-batches",
];

/// Adds the swap spaces' alignment room to `items`, with
/// `optimizer_on_nvme` the optimizer state's space.
fn swap_slack_item(items: &mut Vec<Item>, optimizer_on_nvme: bool) {
    let others = OTHER_SWAP_SPACES
        .iter()
        .filter(|name| {
            items
                .iter()
                .any(|i| i.tier == Tier::Nvme && i.bytes > 0 && i.what == **name)
        })
        .count() as u64;
    let spaces = others + u64::from(optimizer_on_nvme);
    if spaces > 0 {
        items.push(Item {
            tier: Tier::Nvme,
            what: "swap files' alignment room",
            bytes: spaces * sizing::SWAP_SLACK_BYTES,
            formula: format!(
                "{spaces} swap file(s) × {} B for their extents' alignment",
                sizing::SWAP_SLACK_BYTES
            ),
        });
    }
}

/// The sub-groups the largest unit's params touch: the layout's
/// (`sizing::largest_unit_groups`, with the model), else at most its
/// elements' worth plus one at each end (a tiled tensor starts a group of
/// its own, and a unit's other params may sit in the groups on either
/// side); never more than the sub-groups.
fn unit_groups(inp: &Inputs, shape: &Shape) -> u64 {
    let g = shape.max_sub_group_numel().max(1);
    inp.largest_unit_groups
        .unwrap_or_else(|| inp.largest_unit_numel.div_ceil(g) + 2)
        .min(shape.sub_groups.len() as u64)
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
    shape: &Shape,
    resident_groups: &[bool],
    nvme_room_bytes: Option<u64>,
    push: &mut impl FnMut(Tier, &'static str, u64, String),
) -> Result<(), EstimateError> {
    let sw = &inp.swap;
    let sub_groups = shape.sub_groups.len() as u64;
    let g = shape.max_sub_group_numel().max(1);
    let (ra, wb) = (
        usize::from(sw.pipeline_read),
        usize::from(sw.pipeline_write),
    );
    let spill = sw.spill_grads_with_nvme_state;
    let unit_groups = unit_groups(inp, shape);
    let held = if spill {
        sizing::held_grad_bound(resident_groups, ra + 1) as u64
    } else {
        0
    };
    let resident = resident_groups.iter().filter(|r| **r).count() as u64;
    // Each NVMe sub-group's extents, 4 KiB-aligned, as the engine sizes
    // them: its fp32 gradient's (spilled, parked) and its state's.
    let aligned = |numel: u64, elem: u64| sizing::align_up(numel.saturating_mul(elem));
    let nvme_groups = || {
        shape
            .sub_groups
            .iter()
            .zip(resident_groups)
            .filter(|(_, r)| !**r)
            .map(|(g, _)| g.numel)
    };
    let m = inp.moment_elem_bytes;
    let slot_bytes = nvme_groups().max().map_or(0, |n| {
        aligned(n, 4).saturating_add(aligned(n, m).saturating_mul(2))
    });
    let per = 4 + 2 * m;
    let pool = sizing::speculation_pool(
        sw.speculation_with_nvme_state,
        ra,
        wb,
        sub_groups.saturating_sub(resident) as usize,
        slot_bytes,
        nvme_room_bytes,
    );
    let slots = pool.slots as u64;
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
            nvme_groups().fold(0u64, |a, n| a.saturating_add(aligned(n, 4))),
            format!(
                "the {} NVMe sub-groups' × 4 B, each 4 KiB-aligned",
                sub_groups - resident
            ),
        );
    }
    if sw.gradient_accumulation_steps > 1 {
        push(
            Tier::Nvme,
            "fp32 grad sums parked between micro-batches",
            shape
                .sub_groups
                .iter()
                .fold(0u64, |a, g| a.saturating_add(aligned(g.numel, 4))),
            format!(
                "{os} × 4 B, each sub-group's 4 KiB-aligned (gradient_accumulation_steps {})",
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
        let why = match sw.speculation_with_nvme_state {
            sizing::SpeculationAsk::PoolBytes(b) => format!("tierzero.speculation_pool_bytes {b}"),
            _ if slots == nvme_groups => "auto: every NVMe sub-group".to_owned(),
            _ => format!(
                "auto: of {nvme_groups} NVMe sub-groups, what half the free space left buys"
            ),
        };
        push(
            Tier::Nvme,
            SPECULATION_POOL,
            mul(slots, slot_bytes, "speculation pool")?,
            format!("{slots} slots × {slot_bytes} B (the largest NVMe sub-group's {per} B an element, 4 KiB-aligned extents; {why})"),
        );
    }
    if let (Some(least), Some(room)) = (pool.off_for_room_bytes, nvme_room_bytes) {
        push(
            Tier::Nvme,
            SPECULATION_POOL,
            0,
            format!("auto off: its least pool, {least} B, does not fit half the {room} B left (the rest is left for checkpoints); the step waits for the norm (same bits)"),
        );
    }
    Ok(())
}

/// This rank's offloaded 16-bit params from the model's own shards
/// (`shape`, stage 3), as the sizing policy homes and packs them
/// ([`sizing::decide_within`]): `cpu` packs every shard into pinned pages
/// ([`sizing::cpu_page_plan`]: first-fit in `ParamId` order, a page's
/// tail left empty only where no later shard fits it); `nvme` keeps the shards
/// `max_in_cpu` holds in such pages ([`sizing::nvme_param_homes`]) and the
/// rest on NVMe, each extent 4 KiB-aligned, through the swap-in buffers
/// cut into slots of the largest ([`sizing::param_slots`]).
fn offloaded_param_items(
    inp: &Inputs,
    c: Choice,
    shape: &Shape,
    push: &mut impl FnMut(Tier, &'static str, u64, String),
) -> Result<(), EstimateError> {
    let params = c.params;
    let sw = &inp.swap;
    let p = inp.param_elem_bytes;
    let (cpu_bytes, nvme_bytes) = param_homes(inp, params, shape)?;
    let pages = sizing::cpu_page_plan(&cpu_bytes);
    if pages.count > 0 {
        let (what, why) = match params {
            Offload::Cpu => ("param partition", String::new()),
            _ => (
                "param host cache (max_in_cpu)",
                format!(", those max_in_cpu {} holds", sw.param_max_in_cpu_numel),
            ),
        };
        push(
            pinned_or(sw.param_pin_memory),
            what,
            mul(pages.count, pages.bytes_each, "param pages")?,
            format!(
                "{} pages × {} B: {} shards{why} × {p} B packed in ParamId order",
                pages.count,
                pages.bytes_each,
                cpu_bytes.len()
            ),
        );
    }
    if !nvme_bytes.is_empty() {
        let on_nvme = nvme_bytes
            .iter()
            .try_fold(0u64, |a, &b| a.checked_add(sizing::align_up(b)))
            .ok_or_else(|| EstimateError::Overflow {
                what: "params on NVMe".into(),
            })?;
        push(
            Tier::Nvme,
            "param partition",
            on_nvme,
            format!("{} shards × {p} B, each 4 KiB-aligned", nvme_bytes.len()),
        );
        let configured = sizing::param_buffers(sw.param_buffer_count, sw.param_buffer_numel, p);
        let largest = nvme_bytes.iter().copied().max().unwrap_or(0);
        let cut = sizing::param_slots(configured, largest, nvme_bytes.len() as u64);
        // Within a pinned budget, what it leaves beside the optimizer's
        // least and the parked sums' buffers, as the run cuts them (this
        // row said 65 slots where the run, and its plan, took 10).
        let opt_nvme = c.optimizer == Offload::Nvme;
        let largest_group = shape.max_sub_group_numel();
        let beside = if opt_nvme {
            let (bufs, needed) = optimizer_buffers_of(sw, largest_group);
            let park = if sw.gradient_accumulation_steps > 1 {
                sizing::park_buffers(largest_group).total_bytes()
            } else {
                0
            };
            needed.saturating_mul(bufs.bytes_each).saturating_add(park)
        } else {
            0
        };
        let slots =
            sizing::param_slots_within(cut, configured.count, sw.pinned_budget_bytes, beside);
        let within = match (sw.pinned_budget_bytes, slots.count < cut.count) {
            (Some(b), true) => format!(" (pinned_budget_bytes {b} holds {} of them)", slots.count),
            _ => String::new(),
        };
        push(
            pinned_or(sw.param_pin_memory),
            "param swap-in buffers",
            mul(slots.count, slots.bytes_each, "param buffers")?,
            format!(
                "buffer_count {} × buffer_size {} × {p} B, 4 KiB-aligned, cut into {} slots of the largest shard{within}",
                configured.count, sw.param_buffer_numel, cut.count
            ),
        );
    }
    Ok(())
}

/// The bytes of this rank's 16-bit param shards (`shape`) that stay in
/// host memory and that go to NVMe, in `ParamId` order, under `params`.
fn param_homes(
    inp: &Inputs,
    params: Offload,
    shape: &Shape,
) -> Result<(Vec<u64>, Vec<u64>), EstimateError> {
    let p = inp.param_elem_bytes;
    let homes = match params {
        Offload::Nvme => {
            sizing::nvme_param_homes(&shape.param_shard_numel, inp.swap.param_max_in_cpu_numel)
        }
        _ => vec![false; shape.param_shard_numel.len()],
    };
    let (mut cpu, mut nvme) = (Vec::new(), Vec::new());
    for (&n, on_nvme) in shape.param_shard_numel.iter().zip(homes) {
        let b = mul(n, p, "a param shard")?;
        if on_nvme {
            nvme.push(b);
        } else {
            cpu.push(b);
        }
    }
    Ok((cpu, nvme))
}

/// Why `tierzero train` would stop at start-up with choice `c`, where the
/// estimate can tell: a param shard homed on NVMe larger than one param
/// swap-in buffer (the param store refuses it, `EngineError::ParamTooLarge`:
/// a shard is read whole into one buffer). Needs the model's shards
/// ([`Inputs::shape`]).
pub(super) fn refusal(inp: &Inputs, c: Choice) -> Result<Option<String>, EstimateError> {
    let Some(shape) = inp.shape.as_ref().filter(|_| c.params == Offload::Nvme) else {
        return Ok(None);
    };
    let (_, nvme) = param_homes(inp, c.params, shape)?;
    let p = inp.param_elem_bytes;
    let buffer = sizing::param_buffers(1, inp.swap.param_buffer_numel, p).bytes_each;
    Ok(nvme.iter().copied().max().filter(|&b| b > buffer).map(|b| {
        format!(
            "a param shard of {} elements ({b} B) goes to NVMe, and a param swap-in buffer \
             (offload_param.buffer_size {}) holds {buffer} B: tierzero train refuses it; raise \
             buffer_size to at least {}",
            b / p,
            inp.swap.param_buffer_numel,
            b / p
        )
    }))
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

/// [`sizing::optimizer_buffers`] of these settings: the buffers mapped
/// and the pipeline's least count.
fn optimizer_buffers_of(sw: &SwapSettings, largest_group_numel: u64) -> (Buffers, u64) {
    sizing::optimizer_buffers(
        sw.optimizer_buffer_count,
        usize::from(sw.pipeline_read),
        usize::from(sw.pipeline_write),
        sw.spill_grads_with_nvme_state,
        largest_group_numel,
    )
}

/// The optimizer swap buffers the engine maps (the sizing policy's rule,
/// [`sizing::optimizer_buffers`]) for a largest sub-group of
/// `largest_group_numel` elements, and why that many.
fn optimizer_buffer_count(sw: &SwapSettings, largest_group_numel: u64) -> (Buffers, &'static str) {
    let (bufs, needed) = optimizer_buffers_of(sw, largest_group_numel);
    let why = if bufs.count == needed && needed > sw.optimizer_buffer_count {
        "what the pipeline needs"
    } else {
        "buffer_count"
    };
    (bufs, why)
}
