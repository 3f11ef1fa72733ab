//! The parameter store: one home tier per parameter and one state map per
//! tensor.
//!
//! # Tiers
//!
//! * [`Tier::Device`]: the tensor is built once and stays resident (stage
//!   0-2, or `offload_param.device = none`), except on several ranks
//!   whose fetches gather it (below).
//! * [`Tier::Cpu`]: the bytes live in pinned host memory (a [`PinnedArena`]
//!   whose buffers are pages; params are packed first-fit in `ParamId`
//!   order, [`crate::engine::sizing::cpu_page_places`], and never
//!   straddle a page). A prefetch has the param copy
//!   thread build the tensor from the page (the page read-locked while it
//!   copies; a write-back of another param in that page waits for it), so
//!   the copy of the next unit's params is off the engine's thread, which
//!   on a device launches this unit meanwhile; a fetch of a param not
//!   prefetched (the unit wanted now) copies it on the calling thread.
//!   A page is a [`SharedBuffer`]: its read locks are owned pins
//!   ([`ParamStore::pin_home`]) that may travel with a device's copy out
//!   of the page in place, and a write-back into the page waits for every
//!   pin of it.
//!   With `offload_param.device = nvme`, the first `max_in_cpu` elements
//!   (in `ParamId` order) also live here: DeepSpeed's fp16 CPU cache.
//! * [`Tier::Nvme`]: one [`Extent`] per parameter shard in the swap space.
//!   A fetch reads it into a pinned swap buffer (one of
//!   `offload_param.buffer_count` buffers of `buffer_size` elements) on the
//!   I/O engine's thread; the param copy thread (`crate::engine::params::copier`) builds
//!   the tensor from it as it lands and returns the buffer to the pool at
//!   once. The buffers therefore bound the reads *in flight*, not the
//!   params resident: residency is bounded by the prefetcher (max-live,
//!   which counts reads in flight, and the device-cache budget), unless
//!   the buffers are kept for a device (below).
//!
//! # Swap buffers kept for the device
//!
//! With units computed on a device that copies from registered host
//! memory in place, the trainer maps the swap buffers with its registrar
//! (one rank, or several when the store hands out shards: the buffer then
//! holds this rank's shard, what the device gathers from). A landed
//! read's buffer is then **kept**: the copy thread
//! still builds the tensor, and hands the buffer back in the result as a
//! [`ReadPin`] of the param's bytes, which the `Resident` slot holds next
//! to the tensor built from them ([`ParamEvent::Landed`]). When the engine
//! stages or loads the param's unit, [`ParamStore::pin_home`] shares the
//! pin with the upload, so the copy engine reads the param straight from
//! the buffer the disk wrote: one DMA, no staging fill. Once the unit is
//! loaded the engine lets the store's pin go
//! ([`ParamStore::let_go_kept`]); the buffer goes back to the pool when
//! the last copy's pin is dropped, i.e. when that copy is done.
//!
//! Kept buffers must not starve the reads, so they yield: a prefetch that
//! finds no free buffer lets the **newest** kept buffer go (the param used
//! last, which would hold its buffer longest) and reads into it; an
//! acquire lets kept buffers go before it waits for a write or a read;
//! and when every buffer is with a copy, it waits for a copy to end,
//! which needs nothing from this thread. A param whose buffer was let go
//! stays resident and crosses through staging, as without registration.
//! Releasing, updating or staging a param drops its kept buffer with its
//! tensor: the buffer holds the bytes the tensor was built from, never
//! newer ones. A param that stays resident from an update (written
//! through, for the next forward's first units) gets the write-back's
//! buffer as its kept buffer once the write is retired: those are its
//! new bytes, and its tensor was built from them. So no sizing rule ties `buffer_count` to the prefetch
//! window: more buffers only mean more params cross in place.
//!
//! Stored bytes are the training precision's bits (bf16 or fp16 when
//! enabled, else fp32), little-endian, this rank's shard only; a fetch
//! gathers the shards through [`Comm`] and builds the tensor with
//! `Tensor::from_raw_buffer`, so the same bytes give the same tensor in
//! every tier (the base of the bit-identity tests).
//!
//! # State map
//!
//! Each param has exactly one slot (a private `Slot` holding the ticket or tensor), and it changes only in
//! [`ParamStore::apply`], by a [`ParamEvent`] (a closed enum), and in
//! `take_read`, which takes an `InFlight` slot's read out to wait on it,
//! leaving the slot `OnDisk` until the read's outcome is applied (a failed
//! read leaves it there: its bytes are still at home). The allowed
//! transitions:
//!
//! ```text
//!   OnDisk   --ReadIssued(read)---->  InFlight
//!   InFlight --take_read----------->  OnDisk        (its read taken to wait on)
//!   OnDisk   --Materialized(t)----->  Resident      (read completed, or a synchronous fetch)
//!   OnDisk   --Landed(t, pin)------>  Resident      (read completed, its buffer kept)
//!   Resident --Kept(pin)----------->  Resident      (its write-back's buffer kept)
//!   Resident --LetGo--------------->  Resident      (the kept buffer let go)
//!   Resident --Released------------>  OnDisk
//!   OnDisk   --Updated(None)------->  OnDisk        (new bytes at home)
//!   OnDisk   --Updated(Some(t))---->  Resident      (new bytes, kept: written through)
//!   Resident --Updated(Some(t))---->  Resident      (new bytes, cache kept coherent)
//!   Resident --Updated(None)------->  OnDisk        (new bytes at home, not kept)
//!   OnDisk | Resident | Staged --Staged(bytes)--> Staged   (several ranks)
//!   Staged   --Materialized(t)----->  Resident      (gathered in a fetch)
//!   Staged   --Updated(None)------->  OnDisk
//! ```
//!
//! Anything else is [`EngineError::BadTransition`], never a silent fix-up:
//! e.g. updating a param with a read in flight would let stale bytes
//! become resident, so the caller must complete the read first.
//! "OnDisk" means "only at home" (pinned host memory for the cpu tier).
//! Device-tier params are always `Resident` (or `Staged`, see below),
//! but for those with a `Host` home (next section).
//!
//! # Device-tier params on several ranks
//!
//! At stage 3 with `offload_param.device = none` on several ranks whose
//! fetches gather (the compute does not gather on its device), the trainer
//! calls [`ParamStore::partition_device_params`]: a param's
//! home is this rank's shard in ordinary host memory (`Home::Host`, the
//! compute's own memory on the CPU; DeepSpeed's `ds_tensor` partition).
//! A fetch gathers the whole from it and a release drops the whole, as
//! for the cpu tier, so the whole params live only as the prefetcher's
//! release policy allows (`stage3_max_live_parameters`, the reuse
//! distance, persistence): the params' host bytes per rank are the
//! shards plus that, not every whole param (before, these params were
//! gathered once and never released: `N·p` per rank where the plan
//! counted `S·p`).
//!
//! # Several ranks: the gather happens in `fetch` only
//!
//! Building a tensor from this rank's shard is a collective (an all-gather
//! of every rank's shard, [`Comm::all_gather_bytes`]), and collectives must
//! be issued in the same order on every rank. Read completions and
//! write-backs of the optimizer's new bytes happen at times that differ
//! between ranks (a read completed early to free a swap buffer, a stepped
//! sub-group's reply arriving at a different unit boundary), so with more
//! than one rank they never gather: the shard bytes are kept in host memory
//! as `Staged`, and the next [`ParamStore::fetch_many`] (called with a
//! unit's params in unit order, the same on every rank) gathers them, all
//! of the unit's in one collective. With one rank the gather is a copy
//! and tensors are built at once, as before.
//!
//! A compute that gathers the params on its device (NCCL between the
//! GPUs) wants the shards, not the whole: after
//! [`ParamStore::hand_out_shards`], a param's tensor is this rank's
//! shard, 1-D, built with no collective, so nothing is deferred: the
//! store works as with one rank (reads build the tensor on the copy
//! thread, a read's swap buffer may be kept for the device, a page's
//! range is pinned), and the compute's own gather (issued in unit order
//! from the engine's thread) makes the whole on the device. Residency
//! and its counts are unchanged: a resident shard stands for its param.
//!
//! # Write-after-read and read-after-write
//!
//! After the optimizer step, new bytes are written to the param's home.
//! NVMe writes are asynchronous and queued FIFO; a read of a param whose
//! write is still queued first waits for that write, so a fetch can never
//! see old bytes. Reads and writes hold swap buffers only while the kernel
//! works on them (but a landed read's buffer kept for a device's copy in
//! place: see the kept buffers below); when none is free, a blocking
//! acquire retires the oldest write or completes the oldest in-flight read
//! (never waits on something that nobody will complete, so it cannot
//! deadlock).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use tierzero_swap::{Buffer, Engine, Extent, PinnedArena, ReadPin, SharedBuffer, Ticket};

use crate::engine::comm::Comm;
use crate::engine::layout::Layout;
use crate::engine::params::copier::{Copier, PendingRead, Unpack, Unpacked};
use crate::engine::{EngineError, Result};
use crate::model::{Model, ParamId};

/// Where a parameter lives between uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Always resident on the compute device.
    Device,
    /// Pinned host memory.
    Cpu,
    /// NVMe swap extents.
    Nvme,
}

/// The public view of a parameter's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamState {
    /// Only at home (NVMe, or pinned host memory).
    OnDisk,
    /// A read of the home copy is in flight.
    InFlight,
    /// Built on the compute device.
    Resident,
    /// This rank's shard is in host memory; the gather into the full tensor
    /// waits for the next fetch (several ranks only).
    Staged,
}

/// What can happen to a parameter (see the module docs for the table).
#[derive(Debug)]
pub enum ParamEvent {
    /// An asynchronous read was submitted; the copy thread takes it out of
    /// its swap buffer when it lands (see `crate::engine::params::copier`).
    ReadIssued(PendingRead),
    /// The tensor is on the device.
    Materialized(Tensor),
    /// A read landed: its tensor, and its swap buffer kept as a pin of the
    /// same bytes for a device to copy from in place (see "Swap buffers
    /// kept for the device").
    Landed(Tensor, ReadPin),
    /// A finished write-back's buffer, kept for the resident param whose
    /// tensor was built from the bytes it wrote.
    Kept(ReadPin),
    /// The kept buffer let go (its unit loaded, or a read or write wants
    /// a buffer); the tensor stays.
    LetGo,
    /// The device copy is dropped.
    Released,
    /// New bytes were stored at home; `Some` keeps this tensor resident.
    Updated(Option<Tensor>),
    /// This rank's shard bytes are held for the gather of the next fetch.
    Staged(Vec<u8>),
}

impl ParamEvent {
    fn name(&self) -> &'static str {
        match self {
            ParamEvent::ReadIssued(_) => "ReadIssued",
            ParamEvent::Materialized(_) => "Materialized",
            ParamEvent::Landed(..) => "Landed",
            ParamEvent::Kept(_) => "Kept",
            ParamEvent::LetGo => "LetGo",
            ParamEvent::Released => "Released",
            ParamEvent::Updated(_) => "Updated",
            ParamEvent::Staged(_) => "Staged",
        }
    }
}

/// A parameter's state with the data each state owns.
#[derive(Debug)]
enum Slot {
    OnDisk,
    InFlight(PendingRead),
    /// The tensor, and the swap buffer its read landed in when kept for a
    /// device's copy in place.
    Resident(Tensor, Option<Kept>),
    /// This rank's shard bytes for the next fetch's gather (several
    /// ranks), and whether the param was resident when they came (an
    /// update of a resident param): it counts in
    /// [`ParamStore::live_bytes`].
    Staged(Vec<u8>, bool),
}

/// A landed read's swap buffer, kept: a pin of the param's bytes in it
/// (the buffer goes back to the pool when this and every pin shared from
/// it are gone), and when it landed, for [`ParamStore::evict_kept`].
#[derive(Debug)]
struct Kept {
    pin: ReadPin,
    landed_seq: u64,
}

impl Slot {
    fn state(&self) -> ParamState {
        match self {
            Slot::OnDisk => ParamState::OnDisk,
            Slot::InFlight(_) => ParamState::InFlight,
            Slot::Resident(..) => ParamState::Resident,
            Slot::Staged(..) => ParamState::Staged,
        }
    }
    fn name(&self) -> &'static str {
        match self {
            Slot::OnDisk => "OnDisk",
            Slot::InFlight(_) => "InFlight",
            Slot::Resident(..) => "Resident",
            Slot::Staged(..) => "Staged",
        }
    }
}

/// Whether a param's home bytes are the latest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// The home bytes are the param's latest value.
    Current,
    /// An optimizer step of its sub-group is running (or several: a
    /// speculative step and its re-step): new bytes are coming, so a read
    /// of the home copy now would be wasted and a fetch must wait for them
    /// ([`ParamStore::expect_update`]).
    UpdateComing,
}

/// A param's entry in the state map: its tensor's slot, and how many
/// updates of it are coming (a speculative step and its re-step can both
/// be in flight).
#[derive(Debug)]
struct Entry {
    slot: Slot,
    updates_coming: u32,
    /// A tiled param's new shard bytes, assembled piece by piece until the
    /// last expected update arrives ([`ParamStore::update_piece`]).
    assembling: Option<Assembly>,
}

impl Entry {
    fn new() -> Entry {
        Entry {
            slot: Slot::OnDisk,
            updates_coming: 0,
            assembling: None,
        }
    }

    fn freshness(&self) -> Freshness {
        if self.updates_coming == 0 {
            Freshness::Current
        } else {
            Freshness::UpdateComing
        }
    }
}

#[derive(Debug)]
enum Home {
    /// Always resident: the whole param (one rank), or this rank's shard
    /// (several ranks, handing out shards).
    Device,
    /// A device-tier param on several ranks whose fetches gather it: this
    /// rank's shard in ordinary host memory (DeepSpeed's `ds_tensor`
    /// partition), the whole gathered from it at a fetch and dropped at a
    /// release (see "Device-tier params on several ranks").
    Host {
        shard: Vec<u8>,
    },
    Cpu {
        page: usize,
        offset_bytes: usize,
    },
    Nvme {
        extent: Extent,
    },
}

#[derive(Debug)]
struct ParamInfo {
    name: String,
    shape: Vec<usize>,
    numel: usize,
    shard_numel: usize,
    /// Every rank's shard in bytes (rank order), for the gather.
    counts_bytes: Vec<usize>,
    tier: Tier,
}

/// The NVMe side of the store.
#[derive(Debug)]
pub struct NvmeParams {
    /// The engine that reads and writes param extents.
    pub engine: Engine,
    /// Swap-in buffers (`buffer_count` x `buffer_size` elements).
    pub arena: Arc<PinnedArena>,
    /// Counts this store's reads on the disk, for the optimizer thread
    /// (`crate::engine::params::copier::ParamReadGate`).
    pub read_gate: Arc<crate::engine::params::copier::ParamReadGate>,
}

/// Byte and time counters, per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StoreCounters {
    /// Bytes copied out of pinned host memory.
    pub cpu_read_bytes: u64,
    /// Bytes copied into pinned host memory.
    pub cpu_written_bytes: u64,
    /// Bytes read from NVMe.
    pub nvme_read_bytes: u64,
    /// Bytes written to NVMe.
    pub nvme_written_bytes: u64,
    /// Time the compute thread waited on param I/O.
    pub io_wait: Duration,
    /// Part of `io_wait` spent waiting for write-backs: to free a buffer,
    /// before a read or a newer write of the same param, and at a flush.
    pub write_wait: Duration,
    /// Fetches that found the param resident already.
    pub hits: u64,
    /// Fetches that had to wait for a read issued on demand.
    pub sync_reads: u64,
    /// Reads issued ahead of use.
    pub prefetches: u64,
    /// Swap buffers kept for a device's copy in place that were let go
    /// before their unit was loaded, because a read or a write-back
    /// wanted a buffer (see "Swap buffers kept for the device" in the
    /// module docs).
    pub kept_buffers_evicted: u64,
    /// Swap buffers kept for a device's copy in place (landed reads and
    /// retired write-backs).
    pub kept_buffers: u64,
    /// Collectives that gathered params (several ranks; one per
    /// [`ParamStore::fetch_many`] that needed any, one per lone
    /// [`ParamStore::fetch`]).
    pub param_gathers: u64,
}

/// Parameters by home tier, with their state map.
#[derive(Debug)]
pub struct ParamStore {
    info: Vec<ParamInfo>,
    homes: Vec<Home>,
    /// One entry per param: where its tensor is, and whether new bytes
    /// are coming.
    slots: Vec<Entry>,
    dtype: DType,
    elem_bytes: usize,
    device: Device,
    comm: Arc<dyn Comm>,
    /// The cpu tier's pinned pages. A page is read by the copy thread
    /// (a prefetch builds a param's tensor there) while this thread may
    /// write another param's new bytes into it: the lock orders the two.
    pages: Vec<SharedBuffer>,
    /// Copies landed param reads out of their swap buffers, and cpu-tier
    /// params out of their pages (see [`crate::engine::params::copier`]).
    copier: Option<Copier>,
    nvme: Option<NvmeParams>,
    writes: VecDeque<writes::QueuedWrite>,
    resident_bytes: u64,
    /// Bytes of the params staged from residency ([`Slot::Staged`]'s
    /// flag), not yet gathered again.
    staged_resident_bytes: u64,
    counters: StoreCounters,
    /// [`StoreCounters::param_gathers`], counted where the store gathers
    /// through `&self`.
    gathers: std::sync::atomic::AtomicU64,
    /// Several ranks, computed on a device that gathers the params itself
    /// ([`ParamStore::hand_out_shards`]): a fetch builds each param's
    /// tensor from this rank's shard alone.
    shards_out: bool,
    /// Reads landed into a kept swap buffer so far (orders [`Kept`]).
    landed_seq: u64,
}

mod assembly;
mod bytes;
mod fetch;
mod gather;
mod kept;
mod pages;
mod reads;
mod writes;

pub use bytes::{cpu_tensor, tensor_bytes};

use assembly::Assembly;

fn dtype_bytes(dtype: DType) -> Result<usize> {
    match dtype {
        DType::BF16 | DType::F16 => Ok(2),
        DType::F32 => Ok(4),
        other => Err(EngineError::config(format!(
            "parameters must be stored as bf16, f16 or f32, not {other:?}"
        ))),
    }
}

impl ParamStore {
    /// Lays out every parameter in its tier. `tiers` is indexed by
    /// `ParamId`; `cpu_pages` gives the pinned host pages for the cpu tier
    /// (see [`crate::engine::sizing::cpu_page_plan`]); `nvme` is required when any
    /// tier is [`Tier::Nvme`]; `copier_cpus` are the CPUs of the param copy
    /// thread (`crate::engine::host::threads::Placement`; `None`:
    /// unpinned), started when a param is off the device. Nothing is stored yet: call
    /// [`ParamStore::store_initial`] for every param.
    #[allow(
        clippy::too_many_arguments,
        reason = "one constructor wiring the tiers; a builder would only rename them"
    )]
    pub fn new(
        model: &Model,
        layout: &Layout,
        tiers: &[Tier],
        dtype: DType,
        device: Device,
        comm: Arc<dyn Comm>,
        cpu_pages: Vec<Buffer>,
        nvme: Option<NvmeParams>,
        copier_cpus: Option<Arc<[usize]>>,
    ) -> Result<Self> {
        let elem_bytes = dtype_bytes(dtype)?;
        let n = model.params().len();
        if tiers.len() != n || layout.params.len() != n {
            return Err(EngineError::internal("tier list does not match the model"));
        }
        let mut info = Vec::with_capacity(n);
        let mut homes = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        let page_bytes = cpu_pages.first().map_or(0, |b| b.capacity_bytes() as usize);
        // The cpu tier's places, as the sizing policy packs them (the
        // store packed them again itself, next fit).
        let cpu_shard_bytes: Vec<u64> = model
            .params()
            .iter()
            .zip(&layout.params)
            .filter(|(p, _)| tiers[p.id.0] == Tier::Cpu)
            .map(|(_, slot)| (slot.shard_numel * elem_bytes) as u64)
            .collect();
        let mut cpu_places =
            crate::engine::sizing::cpu_page_places(&cpu_shard_bytes, page_bytes as u64).into_iter();
        for (p, slot) in model.params().iter().zip(&layout.params) {
            let tier = tiers[p.id.0];
            let shard_bytes = slot.shard_numel * elem_bytes;
            let home = match tier {
                // A `Host` home at stage 3 only
                // ([`ParamStore::partition_device_params`]).
                Tier::Device => Home::Device,
                Tier::Cpu => {
                    let place = cpu_places.next();
                    match place {
                        Some((page, offset))
                            if page < cpu_pages.len() && shard_bytes <= page_bytes =>
                        {
                            Home::Cpu {
                                page,
                                offset_bytes: offset as usize,
                            }
                        }
                        _ => {
                            return Err(EngineError::internal(format!(
                                "cpu page plan has no room for `{}`",
                                p.name
                            )))
                        }
                    }
                }
                Tier::Nvme => {
                    let nv = nvme
                        .as_ref()
                        .ok_or_else(|| EngineError::internal("nvme tier without a swap engine"))?;
                    if shard_bytes as u64 > nv.arena.buffer_bytes() {
                        // Named: the largest NVMe shard, so that one raise
                        // fits them all (the first too large one named
                        // took a round per param).
                        let (largest, numel) = model
                            .params()
                            .iter()
                            .zip(&layout.params)
                            .filter(|(q, _)| tiers[q.id.0] == Tier::Nvme)
                            .map(|(q, s)| (q, s.shard_numel))
                            .max_by_key(|&(_, n)| n)
                            .unwrap_or((p, slot.shard_numel));
                        return Err(EngineError::ParamTooLarge {
                            name: largest.name.clone(),
                            numel: numel as u64,
                            buffer_numel: nv.arena.buffer_bytes() / elem_bytes as u64,
                        });
                    }
                    Home::Nvme {
                        extent: nv.engine.space().allocate(shard_bytes as u64)?,
                    }
                }
            };
            info.push(ParamInfo {
                name: p.name.clone(),
                shape: p.shape.clone(),
                numel: p.numel,
                shard_numel: slot.shard_numel,
                counts_bytes: crate::engine::layout::shard_counts(p.numel, layout.world)
                    .iter()
                    .map(|c| c * elem_bytes)
                    .collect(),
                tier,
            });
            homes.push(home);
            slots.push(Entry::new());
        }
        Ok(ParamStore {
            info,
            homes,
            slots,
            dtype,
            elem_bytes,
            device,
            comm,
            copier: (nvme.is_some() || !cpu_pages.is_empty())
                .then(|| {
                    // Without NVMe nobody reads the gate: no read ever
                    // counts in.
                    let gate = nvme
                        .as_ref()
                        .map_or_else(crate::engine::params::copier::ParamReadGate::new, |n| {
                            n.read_gate.clone()
                        });
                    Copier::spawn(copier_cpus, gate)
                })
                .transpose()?,
            pages: cpu_pages.into_iter().map(SharedBuffer::new).collect(),
            nvme,
            writes: VecDeque::new(),
            resident_bytes: 0,
            staged_resident_bytes: 0,
            counters: StoreCounters::default(),
            gathers: std::sync::atomic::AtomicU64::new(0),
            shards_out: false,
            landed_seq: 0,
        })
    }

    /// Marks one more update of `id` as coming (a step of its sub-group
    /// was sent): `UpdateComing` until every one has arrived
    /// ([`ParamStore::update`]) or was dropped
    /// ([`ParamStore::update_dropped`]).
    pub fn expect_update(&mut self, id: ParamId) -> Result<()> {
        let e = self
            .slots
            .get_mut(id.0)
            .ok_or_else(|| EngineError::internal(format!("no param {id:?}")))?;
        e.updates_coming += 1;
        Ok(())
    }

    /// An expected update of `id` that will not come (its step was
    /// replaced or dropped). Dropping one that was not expected is an
    /// error.
    pub fn update_dropped(&mut self, id: ParamId) -> Result<()> {
        let name = &self.info[id.0].name;
        let e = self
            .slots
            .get_mut(id.0)
            .ok_or_else(|| EngineError::internal(format!("no param {id:?}")))?;
        if e.updates_coming == 0 {
            return Err(EngineError::BadTransition {
                param: name.clone(),
                from: "Current",
                event: "UpdateDropped",
            });
        }
        e.updates_coming -= 1;
        if e.updates_coming == 0 && e.assembling.is_some() {
            return self.finish_assembly(id);
        }
        Ok(())
    }

    /// Whether `id`'s home bytes are the latest.
    pub fn freshness(&self, id: ParamId) -> Freshness {
        self.slots
            .get(id.0)
            .map_or(Freshness::Current, Entry::freshness)
    }

    /// Whether any param's new bytes are still coming.
    pub fn any_update_coming(&self) -> bool {
        self.slots.iter().any(|e| e.updates_coming > 0)
    }

    /// The gate counting this store's NVMe param reads on the disk, for
    /// the optimizer thread (`crate::engine::params::copier::ParamReadGate`);
    /// `None` without NVMe params.
    pub fn read_gate(&self) -> Option<Arc<crate::engine::params::copier::ParamReadGate>> {
        self.nvme.as_ref().map(|n| n.read_gate.clone())
    }

    /// The state of `id`.
    pub fn state(&self, id: ParamId) -> ParamState {
        self.slots
            .get(id.0)
            .map_or(ParamState::OnDisk, |e| e.slot.state())
    }

    /// The home tier of `id`.
    pub fn tier(&self, id: ParamId) -> Tier {
        self.info.get(id.0).map_or(Tier::Device, |i| i.tier)
    }

    /// Bytes of the whole (gathered) param on the device.
    pub fn device_bytes(&self, id: ParamId) -> u64 {
        self.info
            .get(id.0)
            .map_or(0, |i| (i.numel * self.elem_bytes) as u64)
    }

    /// Bytes of one stored element.
    pub fn device_bytes_per_elem(&self) -> u64 {
        self.elem_bytes as u64
    }

    /// Bytes of params currently resident on the device (all tiers).
    pub fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    /// [`ParamStore::resident_bytes`], plus the params that were resident
    /// when their new bytes came and are staged for the next fetch's
    /// gather (several ranks): the bytes the trace has made live. Unlike
    /// the resident bytes, it does not move when an optimizer update is
    /// applied, which happens at a point that differs between ranks; the
    /// release decisions use it, so every rank makes the same ones (the
    /// next fetch's gathers must match). One rank: the resident bytes.
    pub fn live_bytes(&self) -> u64 {
        self.resident_bytes + self.staged_resident_bytes
    }

    /// Bytes of params with a read in flight (whole params, as they will
    /// be once resident).
    pub fn inflight_bytes(&self) -> u64 {
        self.slot_bytes(|slot| matches!(slot, Slot::InFlight(_)))
    }

    /// Bytes of params whose read landed and is staged for the next
    /// fetch's gather (several ranks) and that were not resident (whole
    /// params, as they will be once gathered).
    #[cfg(test)]
    fn staged_read_bytes(&self) -> u64 {
        self.slot_bytes(|slot| matches!(slot, Slot::Staged(_, false)))
    }

    /// What the prefetch window counts as live, in one pass over the
    /// params: the live bytes ([`ParamStore::live_bytes`]: the resident
    /// ones and, several ranks, those staged by an update of a resident
    /// param), the reads in flight, and (several ranks) the reads landed
    /// and staged for the gather of params that were not resident; each
    /// of the last two as whole params. (The updates staged from resident
    /// params were left out: the optimizer's tail stages the cached params
    /// during the next forward, and the window read that many bytes past
    /// `stage3_max_live_parameters`.)
    pub fn window_live_bytes(&self) -> u64 {
        self.live_bytes()
            + self.slot_bytes(|slot| matches!(slot, Slot::InFlight(_) | Slot::Staged(_, false)))
    }

    /// Whole-param bytes of the params whose slot `pick` takes.
    fn slot_bytes(&self, pick: impl Fn(&Slot) -> bool) -> u64 {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, e)| pick(&e.slot))
            .map(|(i, _)| self.device_bytes(ParamId(i)))
            .sum()
    }

    /// Counters so far.
    pub fn counters(&self) -> StoreCounters {
        StoreCounters {
            param_gathers: self.gathers.load(std::sync::atomic::Ordering::Relaxed),
            ..self.counters
        }
    }

    /// Busy seconds of the param I/O engine's workers (summed).
    pub fn io_busy_s(&self) -> f64 {
        self.nvme
            .as_ref()
            .map_or(0.0, |n| n.engine.stats().busy_s.iter().sum())
    }

    /// Several ranks, for a compute that gathers the params where it
    /// computes (`crate::model::exec_units::UnitCompute::gathers_params`):
    /// from now on [`ParamStore::fetch_many`] gathers nothing and gives
    /// each param as this rank's shard, a 1-D tensor of its elements (see
    /// "Several ranks" in the module docs). One rank: nothing changes.
    pub fn hand_out_shards(&mut self) {
        self.shards_out = self.comm.world_size() > 1;
    }

    /// Stage 3 (the params partitioned) on several ranks whose fetches
    /// gather: each device-tier param keeps this rank's shard in a `Host`
    /// home, its whole gathered at a fetch and dropped at a release (see
    /// "Device-tier params on several ranks"). At stages 0-2 the whole
    /// stays, as DeepSpeed keeps it; handing out shards, the tensor is the
    /// shard. Called before the initial bytes are stored; a no-op on one
    /// rank or after [`ParamStore::hand_out_shards`].
    pub fn partition_device_params(&mut self) {
        if !self.defer_gather() {
            return;
        }
        for (h, info) in self.homes.iter_mut().zip(&self.info) {
            if info.tier == Tier::Device && matches!(h, Home::Device) {
                *h = Home::Host { shard: Vec::new() };
            }
        }
    }

    /// The storage dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Takes `id`'s read in flight out of its slot, which is `OnDisk` until
    /// the read's outcome is applied (the state map's one change outside
    /// [`ParamStore::apply`]: the read is moved out to be waited on).
    /// `None`, the slot untouched: no read is in flight.
    pub(super) fn take_read(&mut self, id: ParamId) -> Option<PendingRead> {
        let entry = self.slots.get_mut(id.0)?;
        match std::mem::replace(&mut entry.slot, Slot::OnDisk) {
            Slot::InFlight(read) => Some(read),
            other => {
                entry.slot = other;
                None
            }
        }
    }

    /// The way a slot changes (see the transition table; and
    /// `ParamStore::take_read`).
    pub fn apply(&mut self, id: ParamId, event: ParamEvent) -> Result<()> {
        let bytes = self.device_bytes(id);
        let slot = self
            .slots
            .get_mut(id.0)
            .map(|e| &mut e.slot)
            .ok_or_else(|| EngineError::internal(format!("no param {id:?}")))?;
        let from = slot.name();
        let ev = event.name();
        let old = std::mem::replace(slot, Slot::OnDisk);
        let was_staged_resident = matches!(old, Slot::Staged(_, true));
        let (new, delta): (Slot, i64) = match (old, event) {
            (Slot::OnDisk, ParamEvent::ReadIssued(t)) => (Slot::InFlight(t), 0),
            (Slot::OnDisk, ParamEvent::Materialized(t)) => (Slot::Resident(t, None), bytes as i64),
            (Slot::OnDisk, ParamEvent::Landed(t, pin)) => {
                self.landed_seq += 1;
                self.counters.kept_buffers += 1;
                let kept = Kept {
                    pin,
                    landed_seq: self.landed_seq,
                };
                (Slot::Resident(t, Some(kept)), bytes as i64)
            }
            (Slot::Resident(t, None), ParamEvent::Kept(pin)) => {
                self.landed_seq += 1;
                self.counters.kept_buffers += 1;
                let kept = Kept {
                    pin,
                    landed_seq: self.landed_seq,
                };
                (Slot::Resident(t, Some(kept)), 0)
            }
            (Slot::Resident(t, Some(_)), ParamEvent::LetGo) => (Slot::Resident(t, None), 0),
            // A kept buffer goes with its tensor: it holds the old bytes.
            (Slot::Resident(..), ParamEvent::Released) => (Slot::OnDisk, -(bytes as i64)),
            (Slot::OnDisk, ParamEvent::Updated(None)) => (Slot::OnDisk, 0),
            (Slot::OnDisk, ParamEvent::Updated(Some(t))) => (Slot::Resident(t, None), bytes as i64),
            (Slot::Resident(..), ParamEvent::Updated(Some(t))) => (Slot::Resident(t, None), 0),
            (Slot::Resident(..), ParamEvent::Updated(None)) => (Slot::OnDisk, -(bytes as i64)),
            (Slot::Resident(..), ParamEvent::Staged(b)) => (Slot::Staged(b, true), -(bytes as i64)),
            (Slot::OnDisk, ParamEvent::Staged(b)) => (Slot::Staged(b, false), 0),
            (Slot::Staged(_, was), ParamEvent::Staged(b)) => (Slot::Staged(b, was), 0),
            (Slot::Staged(..), ParamEvent::Materialized(t)) => {
                (Slot::Resident(t, None), bytes as i64)
            }
            (Slot::Staged(..), ParamEvent::Updated(None)) => (Slot::OnDisk, 0),
            (old, _) => {
                // Put the old slot back untouched and report.
                *slot = old;
                return Err(EngineError::BadTransition {
                    param: self.info[id.0].name.clone(),
                    from,
                    event: ev,
                });
            }
        };
        // Into or out of the staged-from-resident count, from the slot
        // before and after.
        let staged_delta = bytes as i64
            * (i64::from(matches!(new, Slot::Staged(_, true))) - i64::from(was_staged_resident));
        *slot = new;
        self.resident_bytes = (self.resident_bytes as i64 + delta).max(0) as u64;
        self.staged_resident_bytes =
            (self.staged_resident_bytes as i64 + staged_delta).max(0) as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
    use super::*;
    use crate::engine::comm::SingleRank;
    use crate::model::ModelConfig;
    use tierzero_swap::{ArenaConfig, LockPolicy};

    #[test]
    fn tensor_bytes_are_little_endian_in_every_dtype() {
        let t = Tensor::new(&[1.0f32, -2.5], &Device::Cpu).unwrap();
        assert_eq!(
            tensor_bytes(&t).unwrap(),
            [0, 0, 0x80, 0x3f, 0, 0, 0x20, 0xc0]
        );
        let b = t.to_dtype(DType::BF16).unwrap().reshape((2, 1)).unwrap();
        assert_eq!(tensor_bytes(&b).unwrap(), [0x80, 0x3f, 0x20, 0xc0]);
        let h = t.to_dtype(DType::F16).unwrap();
        assert_eq!(tensor_bytes(&h).unwrap(), [0x00, 0x3c, 0x00, 0xc1]);
        let u = t.to_dtype(DType::U8).unwrap();
        assert!(tensor_bytes(&u).is_err());
    }

    #[test]
    fn a_long_tensor_split_over_threads_has_the_bits_of_one_copy() {
        let numel = tierzero_gpu::host_copy::PARALLEL_MIN_BYTES / 2 + 7;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let size = dtype.size_in_bytes();
            // 8-byte-aligned storage, viewed at byte 0 (aligned for the
            // elements: the split path) and at byte 1 (misaligned: the
            // one-copy path).
            let mut words = vec![0u64; (numel * size).div_ceil(8) + 1];
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = (i.wrapping_mul(2_654_435_761) >> 13) as u8;
            }
            let aligned = &bytes[..numel * size];
            let shifted = &bytes[1..=numel * size];
            assert!(bytemuck::try_cast_slice::<u8, half::f16>(aligned).is_ok());
            assert!(bytemuck::try_cast_slice::<u8, half::f16>(shifted).is_err());
            for view in [aligned, shifted] {
                let got = cpu_tensor(view, dtype, &[numel]).unwrap();
                let want =
                    Tensor::from_raw_buffer(&view[..numel * size], dtype, &[numel], &Device::Cpu)
                        .unwrap();
                assert_eq!(
                    tensor_bytes(&got).unwrap(),
                    tensor_bytes(&want).unwrap(),
                    "{dtype:?}"
                );
                assert_eq!(got.dims(), &[numel]);
            }
        }
    }

    fn tiny() -> Model {
        let text = r#"{"model_type":"gpt2","vocab_size":11,"n_positions":6,"n_embd":8,
            "n_layer":1,"n_head":2,"n_inner":12}"#;
        Model::new(ModelConfig::from_hf_json(text).unwrap().0).unwrap()
    }

    fn cpu_store(model: &Model) -> ParamStore {
        let layout = Layout::new(model, 0, 1, 1000);
        let tiers = vec![Tier::Cpu; model.params().len()];
        let shards: Vec<u64> = layout
            .params
            .iter()
            .map(|p| p.shard_numel as u64 * 2)
            .collect();
        let plan = crate::engine::sizing::cpu_page_plan(&shards);
        let (page, pages) = (plan.bytes_each, plan.count as usize);
        let mut ac = ArenaConfig::new(page * pages as u64, page);
        ac.lock = LockPolicy::Off;
        let arena = PinnedArena::new(ac).unwrap();
        let bufs = arena.try_acquire_n(pages).unwrap();
        seeded_store(model, &layout, &tiers, bufs, None, 7)
    }

    /// A bf16 store on one rank with every param's initial bytes
    /// `i % modulus`.
    fn seeded_store(
        model: &Model,
        layout: &Layout,
        tiers: &[Tier],
        cpu_pages: Vec<Buffer>,
        nvme: Option<NvmeParams>,
        modulus: usize,
    ) -> ParamStore {
        let mut s = ParamStore::new(
            model,
            layout,
            tiers,
            DType::BF16,
            Device::Cpu,
            Arc::new(SingleRank),
            cpu_pages,
            nvme,
            None,
        )
        .unwrap();
        for p in model.params() {
            let bytes: Vec<u8> = (0..p.numel * 2).map(|i| (i % modulus) as u8).collect();
            s.store_initial(p.id, &bytes).unwrap();
        }
        s
    }

    /// A bf16 store of rank 1 of two whose collectives are scripted (none
    /// is: one would fail).
    fn rank_1_of_2(model: &Model, layout: &Layout, tiers: &[Tier]) -> ParamStore {
        rank_1_of_2_with(
            model,
            layout,
            tiers,
            crate::engine::comm::scripted::Scripted::rank_of(1, 2),
        )
    }

    /// [`rank_1_of_2`] with `comm`'s collectives.
    fn rank_1_of_2_with(
        model: &Model,
        layout: &Layout,
        tiers: &[Tier],
        comm: crate::engine::comm::scripted::Scripted,
    ) -> ParamStore {
        ParamStore::new(
            model,
            layout,
            tiers,
            DType::BF16,
            Device::Cpu,
            Arc::new(comm),
            Vec::new(),
            None,
            None,
        )
        .unwrap()
    }

    #[test]
    fn handing_out_shards_builds_and_assembles_this_rank_s_shard_with_no_collective() {
        // Rank 1 of two, no collective scripted (one would fail), params
        // resident (the device tier's home).
        let model = tiny();
        let layout = Layout::new(&model, 1, 2, 1000);
        let tiers = vec![Tier::Device; model.params().len()];
        let mut s = rank_1_of_2(&model, &layout, &tiers);
        s.hand_out_shards();
        let p = ParamId(0);
        for q in model.params() {
            let len = s.shard_bytes(q.id).unwrap();
            let bytes: Vec<u8> = (0..len).map(|i| (i % 7) as u8).collect();
            s.store_initial(q.id, &bytes).unwrap();
        }
        let len = s.shard_bytes(p).unwrap();
        let numel = model.params()[0].numel;
        assert_eq!(len, crate::engine::layout::shard_counts(numel, 2)[1] * 2);
        // The tensor is this rank's shard, 1-D.
        let t = s.fetch_many(&[p]).unwrap().remove(0);
        assert_eq!(t.dims(), [len / 2]);
        // Two pieces expected, one comes, the other is dropped: the shard is
        // assembled from the piece and the resident shard's own bytes (not
        // a range of a whole param at this rank's offset).
        s.expect_update(p).unwrap();
        s.expect_update(p).unwrap();
        let half = len / 2 / 2 * 2;
        s.update_piece(p, 0, &vec![0xAB; half], true, None).unwrap();
        s.update_dropped(p).unwrap();
        let got = tensor_bytes(&s.fetch_many(&[p]).unwrap().remove(0)).unwrap();
        let want: Vec<u8> = (0..len)
            .map(|i| if i < half { 0xAB } else { (i % 7) as u8 })
            .collect();
        assert_eq!(got, want);
        assert_eq!(s.counters().param_gathers, 0);
    }

    /// Several ranks gathering in fetches (stage 3, params not offloaded,
    /// CPU compute): a device-tier param's home is this rank's shard, the
    /// whole is gathered at a fetch and dropped at a release, and gathered
    /// again from the shard (updates included) at the next fetch. Before,
    /// the whole stayed resident for good (`N·p` per rank).
    #[test]
    fn a_device_tier_param_gathered_on_several_ranks_is_released_to_its_shard() {
        // Rank 1 of two: rank 0's block reads 0xEE.
        fn gather(mine: &[u8], counts: &[usize], out: &mut [u8]) -> Result<()> {
            out[..counts[0]].fill(0xEE);
            out[counts[0]..].copy_from_slice(mine);
            Ok(())
        }
        let model = tiny();
        let layout = Layout::new(&model, 1, 2, 1000);
        let tiers = vec![Tier::Device; model.params().len()];
        let mut comm = crate::engine::comm::scripted::Scripted::rank_of(1, 2);
        comm.gather_bytes = Some(gather);
        let mut s = rank_1_of_2_with(&model, &layout, &tiers, comm);
        s.partition_device_params();
        let p = ParamId(0);
        let len = s.shard_bytes(p).unwrap();
        let counts = s.info[p.0].counts_bytes.clone();
        let whole = |mine: &[u8]| [vec![0xEE; counts[0]], mine.to_vec()].concat();
        let first: Vec<u8> = (0..len).map(|i| (i % 7) as u8).collect();
        s.store_initial(p, &first).unwrap();
        assert_eq!(s.state(p), ParamState::OnDisk);
        let t = s.fetch_many(&[p]).unwrap().remove(0);
        assert_eq!(tensor_bytes(&t).unwrap(), whole(&first));
        assert_eq!(s.resident_bytes(), s.device_bytes(p));
        s.release(p).unwrap();
        assert_eq!(s.state(p), ParamState::OnDisk);
        assert_eq!((s.resident_bytes(), s.live_bytes()), (0, 0));
        // Gathered again from the shard at home.
        let t = s.fetch_many(&[p]).unwrap().remove(0);
        assert_eq!(tensor_bytes(&t).unwrap(), whole(&first));
        // An update of the resident param is staged; of a released one,
        // written home and gathered from there.
        let second = vec![0x11; len];
        s.expect_update(p).unwrap();
        s.update(p, &second, false, None).unwrap();
        assert_eq!(s.state(p), ParamState::Staged);
        let t = s.fetch_many(&[p]).unwrap().remove(0);
        assert_eq!(tensor_bytes(&t).unwrap(), whole(&second));
        s.release(p).unwrap();
        let third = vec![0x22; len];
        s.expect_update(p).unwrap();
        s.update(p, &third, false, None).unwrap();
        assert_eq!(s.state(p), ParamState::OnDisk);
        let t = s.fetch_many(&[p]).unwrap().remove(0);
        assert_eq!(tensor_bytes(&t).unwrap(), whole(&third));
        assert_eq!(s.counters().param_gathers, 4);
    }

    /// With several ranks an update of a resident param stages it, at a
    /// point that differs between ranks: the resident bytes drop then,
    /// the live bytes (what release decisions read) do not, and a param
    /// staged from disk adds nothing until the fetch gathers it.
    #[test]
    fn staging_an_update_leaves_the_live_bytes_as_they_were() {
        let model = tiny();
        let layout = Layout::new(&model, 1, 2, 1000);
        // The transitions alone (no home is written): the tier does not
        // matter to them.
        let tiers = vec![Tier::Device; model.params().len()];
        let mut s = rank_1_of_2(&model, &layout, &tiers);
        let (p, q) = (ParamId(0), ParamId(1));
        let whole = |id: ParamId| {
            let shape = model.params()[id.0].shape.clone();
            Tensor::zeros(shape, DType::BF16, &Device::Cpu).unwrap()
        };
        s.apply(p, ParamEvent::Materialized(whole(p))).unwrap();
        let pb = s.device_bytes(p);
        assert_eq!((s.resident_bytes(), s.live_bytes()), (pb, pb));
        s.apply(p, ParamEvent::Staged(vec![1; 4])).unwrap();
        assert_eq!((s.resident_bytes(), s.live_bytes()), (0, pb));
        // The prefetch window counts it too.
        assert_eq!(s.window_live_bytes(), pb);
        // Staged again (a second update): still counted once.
        s.apply(p, ParamEvent::Staged(vec![2; 4])).unwrap();
        assert_eq!(s.live_bytes(), pb);
        s.apply(q, ParamEvent::Staged(vec![3; 4])).unwrap();
        assert_eq!(s.live_bytes(), pb);
        // q's staged shard counts in the window (as a whole param), not in
        // the live bytes.
        let qb = s.device_bytes(q);
        assert_eq!(s.window_live_bytes(), pb + qb);
        // The fetch's gather: p stays counted once, q now counts.
        s.apply(p, ParamEvent::Materialized(whole(p))).unwrap();
        s.apply(q, ParamEvent::Materialized(whole(q))).unwrap();
        let both = pb + s.device_bytes(q);
        assert_eq!((s.resident_bytes(), s.live_bytes()), (both, both));
    }

    /// Several ranks: a staged param whose fetch's gather fails keeps its
    /// staged bytes (they were taken out first, and the slot then offered
    /// an empty shard to the next fetch, which failed on this rank alone).
    #[test]
    fn a_failed_gather_of_a_staged_param_keeps_its_bytes() {
        let model = tiny();
        let layout = Layout::new(&model, 1, 2, 1000);
        let tiers = vec![Tier::Device; model.params().len()];
        // No collective scripted: the gather fails.
        let mut s = rank_1_of_2(&model, &layout, &tiers);
        let p = ParamId(0);
        s.apply(p, ParamEvent::Staged(vec![7; 4])).unwrap();
        assert!(s.fetch(p).is_err());
        assert_eq!(s.state(p), ParamState::Staged);
        match &s.slots[p.0].slot {
            Slot::Staged(b, _) => assert_eq!(b, &vec![7u8; 4]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn state_map_allows_only_the_table() {
        let model = tiny();
        let mut s = cpu_store(&model);
        let p = ParamId(0);
        assert_eq!(s.state(p), ParamState::OnDisk);
        // Released while OnDisk is not a transition.
        let e = s.apply(p, ParamEvent::Released).unwrap_err();
        assert!(matches!(
            e,
            EngineError::BadTransition {
                from: "OnDisk",
                event: "Released",
                ..
            }
        ));
        let t = s.fetch(p).unwrap();
        assert_eq!(s.state(p), ParamState::Resident);
        assert_eq!(s.resident_bytes(), s.device_bytes(p));
        // A second materialisation of a resident param is refused, and the
        // slot is left as it was.
        let e = s.apply(p, ParamEvent::Materialized(t)).unwrap_err();
        assert!(matches!(
            e,
            EngineError::BadTransition {
                from: "Resident",
                ..
            }
        ));
        assert_eq!(s.state(p), ParamState::Resident);
        // No kept buffer to let go; a kept buffer only for a resident
        // param that has none.
        let e = s.apply(p, ParamEvent::LetGo).unwrap_err();
        assert!(matches!(
            e,
            EngineError::BadTransition {
                from: "Resident",
                event: "LetGo",
                ..
            }
        ));
        let page = s.pages[0].clone();
        s.apply(p, ParamEvent::Kept(page.pin(0..2).unwrap()))
            .unwrap();
        assert_eq!((s.kept_now(), page.pins()), (1, 1));
        let e = s
            .apply(p, ParamEvent::Kept(page.pin(0..2).unwrap()))
            .unwrap_err();
        assert!(matches!(
            e,
            EngineError::BadTransition { event: "Kept", .. }
        ));
        assert_eq!(page.pins(), 1, "the refused pin dropped");
        s.apply(p, ParamEvent::LetGo).unwrap();
        assert_eq!((s.kept_now(), page.pins()), (0, 0));
        assert_eq!(s.resident_bytes(), s.device_bytes(p));
        s.release(p).unwrap();
        assert_eq!(s.state(p), ParamState::OnDisk);
        assert_eq!(s.resident_bytes(), 0);
        let e = s
            .apply(p, ParamEvent::Kept(page.pin(0..2).unwrap()))
            .unwrap_err();
        assert!(matches!(
            e,
            EngineError::BadTransition { from: "OnDisk", .. }
        ));
        // release is idempotent at the API level (no event when not resident).
        s.release(p).unwrap();
    }

    /// A cpu-tier prefetch builds the tensor on the copy thread from the
    /// param's page: the fetch takes it (same bits as a fetch that copies
    /// on this thread); an update while it is in flight completes it
    /// first, writes the page and keeps the copy coherent.
    #[test]
    fn a_cpu_tier_prefetch_is_copied_out_on_the_copy_thread() {
        let model = tiny();
        let mut direct = cpu_store(&model);
        let mut s = cpu_store(&model);
        for p in model.params() {
            assert!(s.prefetch(p.id).unwrap(), "{}", p.name);
            assert_eq!(s.state(p.id), ParamState::InFlight);
            // Once in flight (or resident) it is not issued again.
            assert!(!s.prefetch(p.id).unwrap());
        }
        assert_eq!(s.counters().prefetches, model.params().len() as u64);
        assert_eq!(
            s.inflight_bytes(),
            (0..model.params().len())
                .map(|i| s.device_bytes(ParamId(i)))
                .sum::<u64>()
        );
        for p in model.params() {
            let a = s.fetch(p.id).unwrap();
            let b = direct.fetch(p.id).unwrap();
            assert_eq!(
                a.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap(),
                b.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap(),
                "{}",
                p.name
            );
            assert_eq!(s.state(p.id), ParamState::Resident);
            s.release(p.id).unwrap();
        }
        let p = ParamId(1);
        let before = s.read_shard(p).unwrap(); // a fetch
        s.release(p).unwrap();
        assert!(s.prefetch(p).unwrap());
        let new: Vec<u8> = before.iter().map(|b| b.wrapping_add(3)).collect();
        s.update(p, &new, false, None).unwrap();
        // The read was completed first, and its copy kept coherent.
        assert_eq!(s.state(p), ParamState::Resident);
        assert_eq!(s.read_shard(p).unwrap(), new);
        s.release(p).unwrap();
        assert!(s.prefetch(p).unwrap());
        let t = s.fetch(p).unwrap();
        assert_eq!(t.dims(), model.params()[1].shape.as_slice());
        s.release(p).unwrap();
        assert_eq!(s.read_shard(p).unwrap(), new);
    }

    /// A store with every param on NVMe and `buffers` swap buffers.
    fn nvme_store(model: &Model, dir: &std::path::Path, buffers: u64) -> ParamStore {
        nvme_store_with(model, dir, buffers, None)
    }

    /// [`nvme_store`], its swap buffers registered through `registrar`.
    fn nvme_store_with(
        model: &Model,
        dir: &std::path::Path,
        buffers: u64,
        registrar: Option<Arc<dyn tierzero_swap::HostRegistrar>>,
    ) -> ParamStore {
        let layout = Layout::new(model, 0, 1, 1000);
        let tiers = vec![Tier::Nvme; model.params().len()];
        seeded_store(
            model,
            &layout,
            &tiers,
            Vec::new(),
            nvme_params(dir, buffers, registrar),
            5,
        )
    }

    /// The NVMe side of a store in `dir`: `buffers` swap buffers of 4 KiB.
    fn nvme_params(
        dir: &std::path::Path,
        buffers: u64,
        registrar: Option<Arc<dyn tierzero_swap::HostRegistrar>>,
    ) -> Option<NvmeParams> {
        std::fs::create_dir_all(dir).unwrap();
        let space = tierzero_swap::SwapSpace::create(tierzero_swap::SpaceConfig::new(dir, 1 << 20))
            .unwrap();
        let mut ac = ArenaConfig::new(4096 * buffers, 4096);
        ac.lock = LockPolicy::Off;
        ac.registrar = registrar;
        let arena = PinnedArena::new(ac).unwrap();
        let engine =
            Engine::new(space, arena.clone(), tierzero_swap::EngineConfig::default()).unwrap();
        Some(NvmeParams {
            engine,
            arena,
            read_gate: crate::engine::params::copier::ParamReadGate::new(),
        })
    }

    /// A prefetcher with `limits` that recorded one step of every unit's
    /// forward and has begun the next at its first unit.
    fn traced_prefetcher(
        model: &Model,
        limits: crate::engine::params::prefetch::Limits,
    ) -> crate::engine::params::prefetch::Prefetcher {
        use crate::engine::params::prefetch::{Pass, Prefetcher, Visit};
        let mut sched = Prefetcher::new(model, limits);
        let visits: Vec<Visit> = (0..model.units().len())
            .map(|u| Visit {
                unit: crate::model::UnitId(u),
                pass: Pass::Forward,
                shape: [1, 4],
            })
            .collect();
        sched.begin_step();
        for v in &visits {
            assert!(sched.visit(v.clone()));
        }
        sched.begin_step();
        assert!(sched.visit(visits[0].clone()));
        sched
    }

    /// A bucket of the whole model and half of it live at most.
    fn half_live_limits(model: &Model) -> crate::engine::params::prefetch::Limits {
        let total: u64 = model.params().iter().map(|p| p.numel as u64).sum();
        crate::engine::params::prefetch::Limits {
            prefetch_bucket_numel: total,
            max_live_numel: total / 2,
            max_reuse_distance_numel: 0,
            persistence_threshold_numel: 0,
            model_persistence_threshold_numel: u64::MAX,
            device_cache_bytes: 0,
        }
    }

    #[test]
    fn finished_write_backs_free_their_buffers_at_harvest_and_one_param_writes_once_at_a_time() {
        let model = tiny();
        let n = model.params().len() as u64;
        assert!(n >= 4, "{n}");
        let dir = std::env::temp_dir().join(format!("tz-store-writes-{}", std::process::id()));
        let mut s = nvme_store(&model, &dir, n);
        assert_eq!(s.free_buffers(), n as usize);
        // Every buffer carries a write-back.
        for p in model.params() {
            let bytes = vec![7u8; p.numel * 2];
            s.update(p.id, &bytes, false, None).unwrap();
        }
        assert_eq!(s.free_buffers(), 0);
        if let Some(nv) = &s.nvme {
            nv.engine.wait_idle();
        }
        // All finished: harvest frees every buffer, whichever finished first.
        s.harvest().unwrap();
        assert_eq!(s.free_buffers(), n as usize);
        assert!(s.writes.is_empty());
        // Two updates of one param: never two writes of it in flight.
        let p = ParamId(1);
        let numel = model.params()[1].numel;
        s.update(p, &vec![1u8; numel * 2], false, None).unwrap();
        s.update(p, &vec![2u8; numel * 2], false, None).unwrap();
        assert!(s.writes.iter().filter(|w| w.id == p).count() <= 1);
        assert_eq!(
            s.read_shard(p).unwrap(),
            vec![2u8; numel * 2],
            "the last one wins"
        );
        s.release(p).unwrap();
        // The window after a harvest issues reads for every free buffer.
        s.flush_writes().unwrap();
        let issued = model
            .params()
            .iter()
            .filter(|q| s.prefetch(q.id).unwrap())
            .count();
        assert_eq!(issued, n as usize);
        s.settle().unwrap();
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn update_rewrites_home_and_keeps_a_resident_copy_coherent() {
        let model = tiny();
        let mut s = cpu_store(&model);
        let p = ParamId(1);
        let before = s.read_shard(p).unwrap();
        let new: Vec<u8> = before.iter().map(|b| b.wrapping_add(1)).collect();
        // Resident: the device copy is replaced.
        s.update(p, &new, false, None).unwrap();
        assert_eq!(s.state(p), ParamState::Resident);
        assert_eq!(s.read_shard(p).unwrap(), new);
        // Released, then fetched again: the home copy has the new bytes.
        s.release(p).unwrap();
        assert_eq!(s.read_shard(p).unwrap(), new);
        // Not resident: an update goes home only, unless asked to stay.
        s.release(p).unwrap();
        let newer: Vec<u8> = new.iter().map(|b| b.wrapping_add(1)).collect();
        s.update(p, &newer, false, None).unwrap();
        assert_eq!(s.state(p), ParamState::OnDisk);
        let newest: Vec<u8> = newer.iter().map(|b| b.wrapping_add(1)).collect();
        s.update(p, &newest, true, None).unwrap();
        assert_eq!(s.state(p), ParamState::Resident);
        s.release(p).unwrap();
        assert_eq!(s.read_shard(p).unwrap(), newest, "written through");
        // A wrong length is an error, not a panic.
        assert!(s.update(p, &new[1..], false, None).is_err());
        // A tensor the optimizer thread built from the new bytes is the
        // one made resident (not a second copy)...
        let again: Vec<u8> = newest.iter().map(|b| b.wrapping_add(1)).collect();
        let built = s.tensor_from_shard(p, &again).unwrap();
        s.update(p, &again, true, Some(built.clone())).unwrap();
        assert_eq!(s.fetch(p).unwrap().id(), built.id());
        assert_eq!(s.read_shard(p).unwrap(), again);
        // ...and dropped when the param does not stay resident.
        s.release(p).unwrap();
        let last: Vec<u8> = again.iter().map(|b| b.wrapping_add(1)).collect();
        let built = s.tensor_from_shard(p, &last).unwrap();
        s.update(p, &last, false, Some(built)).unwrap();
        assert_eq!(s.state(p), ParamState::OnDisk);
        assert_eq!(s.read_shard(p).unwrap(), last);
    }

    /// `stage3_max_live_parameters` counts reads in flight: a second
    /// window issued before the first one's reads are harvested stays
    /// within the limit (counting resident params alone, it put a second
    /// window's reads in flight on top of the first).
    #[test]
    fn the_prefetch_window_counts_reads_in_flight_as_live() {
        let model = tiny();
        let n = model.params().len();
        let dir = std::env::temp_dir().join(format!("tz-store-live-{}", std::process::id()));
        let mut s = nvme_store(&model, &dir, n as u64);
        let limits = half_live_limits(&model);
        let sched = traced_prefetcher(&model, limits);
        let elem = s.device_bytes_per_elem();
        let live = |s: &ParamStore| (s.resident_bytes() + s.inflight_bytes()) / elem;
        for round in 0..2 {
            for p in sched.prefetch_candidates(&s) {
                assert!(s.prefetch(p).unwrap());
            }
            assert!(live(&s) > 0, "round {round}: nothing issued");
            assert!(
                live(&s) <= limits.max_live_numel,
                "round {round}: {} live elements, limit {}",
                live(&s),
                limits.max_live_numel
            );
        }
        s.settle().unwrap();
        assert_eq!(s.inflight_bytes(), 0);
        assert!(s.resident_bytes() / elem <= limits.max_live_numel);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// With no swap buffer free, a fetch completes the oldest disk read in
    /// flight (the first to land), not the lowest ParamId's: in backward,
    /// reads go out in falling ParamId order, so that was the newest.
    #[test]
    fn a_fetch_short_of_buffers_completes_the_oldest_read_in_flight() {
        let model = tiny();
        let dir = std::env::temp_dir().join(format!("tz-store-oldest-{}", std::process::id()));
        // Registered buffers: a landed read keeps its buffer (for a
        // device's copy in place), so none comes back to the pool however
        // fast the reads land, and the fetch must complete one.
        let mut s = nvme_store_with(&model, &dir, 3, Some(Arc::new(Registers)));
        // Backward order: 3, 2, 1 take the three buffers.
        for p in [3, 2, 1] {
            assert!(s.prefetch(ParamId(p)).unwrap());
        }
        assert_eq!(s.free_buffers(), 0);
        s.fetch_many(&[ParamId(0)]).unwrap();
        let states: Vec<ParamState> = [3, 2, 1].map(|p| s.state(ParamId(p))).to_vec();
        assert_eq!(
            states,
            [
                ParamState::Resident,
                ParamState::InFlight,
                ParamState::InFlight
            ],
            "the oldest read completed, the newer ones left in flight"
        );
        s.settle().unwrap();
        drop(s);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Several ranks: a read-ahead that landed is staged for the next
    /// fetch's gather, neither resident nor in flight; the prefetch window
    /// counts it as live all the same, so the staged shards stay within
    /// `stage3_max_live_parameters` (each fetch issued a bucket more past
    /// them, the staged bytes growing towards the rest of the trace).
    #[test]
    fn the_prefetch_window_counts_staged_shards_as_live_on_several_ranks() {
        let model = tiny();
        let n = model.params().len();
        let dir = std::env::temp_dir().join(format!("tz-store-staged-{}", std::process::id()));
        let layout = Layout::new(&model, 1, 2, 1000);
        let tiers = vec![Tier::Nvme; n];
        // Rank 1 of two, no collective scripted: reads and staging only.
        let mut s = ParamStore::new(
            &model,
            &layout,
            &tiers,
            DType::BF16,
            Device::Cpu,
            Arc::new(crate::engine::comm::scripted::Scripted::rank_of(1, 2)),
            Vec::new(),
            nvme_params(&dir, n as u64, None),
            None,
        )
        .unwrap();
        for p in model.params() {
            let len = s.shard_bytes(p.id).unwrap();
            let bytes: Vec<u8> = (0..len).map(|i| (i % 5) as u8).collect();
            s.store_initial(p.id, &bytes).unwrap();
        }
        let limits = half_live_limits(&model);
        let sched = traced_prefetcher(&model, limits);
        let elem = s.device_bytes_per_elem();
        let live = |s: &ParamStore| {
            (s.resident_bytes() + s.inflight_bytes() + s.staged_read_bytes()) / elem
        };
        for round in 0..3 {
            for p in sched.prefetch_candidates(&s) {
                assert!(s.prefetch(p).unwrap());
            }
            // Every read lands and is staged, as a fetch's harvest finds it.
            let t0 = std::time::Instant::now();
            while s.inflight_bytes() > 0 {
                s.harvest().unwrap();
                assert!(t0.elapsed().as_secs() < 30, "reads never landed");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            assert_eq!(s.resident_bytes(), 0);
            assert!(s.staged_read_bytes() > 0, "round {round}: nothing staged");
            assert!(
                live(&s) <= limits.max_live_numel,
                "round {round}: {} live elements, limit {}",
                live(&s),
                limits.max_live_numel
            );
        }
        drop(s);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The copy thread: read buffers come back to the pool as the reads
    /// land, before the store looks; the params stay in flight until
    /// harvested, with the right bytes; and a store dropped with every
    /// buffer in a read leaves the pool full.
    #[test]
    fn read_buffers_come_back_as_reads_land_and_a_store_dropped_mid_read_loses_none() {
        let model = tiny();
        let n = model.params().len();
        let dir = std::env::temp_dir().join(format!("tz-store-copier-{}", std::process::id()));
        let mut s = nvme_store(&model, &dir, n as u64);
        let want: Vec<Vec<u8>> = model
            .params()
            .iter()
            .map(|p| {
                let b = s.read_shard(p.id).unwrap();
                s.release(p.id).unwrap();
                b
            })
            .collect();
        let arena = s.nvme.as_ref().unwrap().arena.clone();
        // The optimizer's view of the param reads on the disk: none once
        // every buffer is back.
        let gate = s.nvme.as_ref().unwrap().read_gate.clone();
        let wait_full = |what: &str| {
            let t0 = Instant::now();
            while arena.free_count() < n {
                assert!(t0.elapsed() < Duration::from_secs(10), "{what}");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        for p in model.params() {
            assert!(s.prefetch(p.id).unwrap());
        }
        wait_full("buffers not back without a harvest");
        assert!(!gate.busy(), "landed reads still counted in flight");
        assert!(model
            .params()
            .iter()
            .all(|p| s.state(p.id) == ParamState::InFlight));
        assert_eq!(s.harvest().unwrap(), n);
        for (p, w) in model.params().iter().zip(&want) {
            assert_eq!(s.state(p.id), ParamState::Resident);
            assert_eq!(&s.read_shard(p.id).unwrap(), w, "{}", p.name);
            s.release(p.id).unwrap();
        }
        for p in model.params() {
            assert!(s.prefetch(p.id).unwrap());
        }
        drop(s);
        wait_full("a buffer lost with the store");
        assert!(
            !gate.busy(),
            "a dropped store's reads still counted in flight"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Registers nothing, but says it did: the swap buffers count as a
    /// device's registered memory.
    #[derive(Debug)]
    struct Registers;

    impl tierzero_swap::HostRegistrar for Registers {
        fn register(&self, _addr: usize, _len_bytes: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn unregister(&self, _addr: usize, _len_bytes: usize) {}
    }

    /// Polls `f` (harvesting) until it holds, for at most 10 s.
    fn eventually(s: &mut ParamStore, what: &str, mut f: impl FnMut(&mut ParamStore) -> bool) {
        let t0 = Instant::now();
        while !f(s) {
            assert!(t0.elapsed() < Duration::from_secs(10), "{what}");
            s.harvest().unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_registered_swap_buffer_is_kept_with_its_tensor_and_yields_to_reads_and_writes() {
        let model = tiny();
        let ids: Vec<ParamId> = model.params().iter().map(|p| p.id).collect();
        let dir = std::env::temp_dir().join(format!("tz-store-kept-{}", std::process::id()));
        let mut s = nvme_store_with(&model, &dir, 2, Some(Arc::new(Registers)));
        assert!(s.swap_buffers_registered() && s.homes_registered());
        assert!(!s.pages_registered());
        let want: Vec<Vec<u8>> = ids
            .iter()
            .map(|&p| {
                let b = s.read_shard(p).unwrap();
                s.release(p).unwrap();
                b
            })
            .collect();
        assert_eq!(
            (s.kept_now(), s.free_buffers()),
            (0, 2),
            "released with its tensor"
        );

        // A landed read keeps its buffer, pinned: the bytes its tensor was
        // built from, shared with a copy.
        assert!(s.prefetch(ids[0]).unwrap());
        let t = s.fetch(ids[0]).unwrap();
        assert_eq!((s.kept_now(), s.free_buffers()), (1, 1));
        let pin = s.pin_home(ids[0]).unwrap().expect("a kept buffer's pin");
        assert_eq!(pin.bytes(), &want[0][..]);
        assert_eq!(tensor_bytes(&t).unwrap(), want[0]);
        // Let go by the store, it stays with the copy until that is done.
        s.let_go_kept(&[ids[0]]).unwrap();
        assert_eq!(s.kept_now(), 0);
        assert!(s.pin_home(ids[0]).unwrap().is_none(), "let go");
        assert_eq!(s.free_buffers(), 1, "the copy's pin holds it");
        drop(pin);
        assert_eq!(s.free_buffers(), 2);
        s.release(ids[0]).unwrap();

        // Reads ahead are never starved by kept buffers: with two
        // buffers every param is read ahead, each landed buffer yielding
        // to the next read, newest first.
        for &p in &ids {
            eventually(&mut s, "a read ahead starved", |s| s.prefetch(p).unwrap());
            eventually(&mut s, "a read not landed", |s| {
                s.state(p) == ParamState::Resident
            });
        }
        assert_eq!(s.kept_now(), 2);
        assert_eq!(s.counters().kept_buffers_evicted, ids.len() as u64 - 2);
        // The two kept are the ones read last but one (each new read let the
        // newest go): the first param's and the last param's.
        assert!(s.pin_home(ids[0]).unwrap().is_some());
        assert!(s.pin_home(*ids.last().unwrap()).unwrap().is_some());
        for (&p, w) in ids.iter().zip(&want) {
            assert_eq!(&s.read_shard(p).unwrap(), w);
        }

        // A write-back takes a kept buffer, and an update drops the
        // updated param's own: it held the old bytes.
        let last = *ids.last().unwrap();
        let new: Vec<u8> = want.last().unwrap().iter().map(|b| b ^ 0x5a).collect();
        s.update(last, &new, true, None).unwrap();
        assert!(s.pin_home(last).unwrap().is_none(), "a stale kept buffer");
        assert_eq!(s.kept_now(), 1, "the first param's is left");
        // Once written, the write's buffer is kept for the param that
        // stayed resident from it: its new bytes, in place.
        s.flush_writes().unwrap();
        assert_eq!(s.pin_home(last).unwrap().unwrap().bytes(), &new[..]);
        assert_eq!(s.read_shard(last).unwrap(), new);
        assert_eq!(s.kept_now(), 2);
        // Not so for a param not resident after its update.
        let first = ids[0];
        s.release(first).unwrap();
        assert_eq!(s.kept_now(), 1, "let go with its tensor");
        s.update(first, &want[0], false, None).unwrap();
        s.flush_writes().unwrap();
        assert_eq!(s.state(first), ParamState::OnDisk);
        assert_eq!(s.kept_now(), 1);

        // With every buffer lent to copies (kept buffers shared, then let
        // go), a read waits for a copy to end, not for this thread.
        for &p in &ids {
            s.release(p).unwrap();
        }
        assert_eq!(s.free_buffers(), 2);
        let mut pins = Vec::new();
        for &p in &ids[..2] {
            s.fetch(p).unwrap();
            pins.push(s.pin_home(p).unwrap().unwrap());
        }
        s.let_go_kept(&ids[..2]).unwrap();
        assert_eq!((s.kept_now(), s.free_buffers()), (0, 0));
        // Timed from before the copies' thread starts: it holds the pins
        // at least 100 ms from here, however late this thread runs on.
        let t0 = Instant::now();
        let copies = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(pins);
        });
        assert_eq!(tensor_bytes(&s.fetch(ids[2]).unwrap()).unwrap(), want[2]);
        assert!(
            t0.elapsed() >= Duration::from_millis(90),
            "did not wait for a copy"
        );
        copies.join().unwrap();
        drop(s);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn unregistered_swap_buffers_are_never_kept() {
        let model = tiny();
        let dir = std::env::temp_dir().join(format!("tz-store-unkept-{}", std::process::id()));
        let mut s = nvme_store(&model, &dir, 2);
        assert!(!s.homes_registered());
        for p in model.params() {
            s.fetch(p.id).unwrap();
            assert!(s.pin_home(p.id).unwrap().is_none());
        }
        assert_eq!((s.kept_now(), s.free_buffers()), (0, 2));
        drop(s);
        std::fs::remove_dir_all(&dir).ok();
    }
}
