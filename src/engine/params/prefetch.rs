//! The prefetcher: unit trace, prefetch window, release policy.
//!
//! # Trace
//!
//! A step visits units in an order: forward over the embedding and blocks,
//! then backward over the head and the blocks in reverse. Each visit is
//! recorded with its pass and the activation shape (`[batch, seq]`), so a
//! change of sequence length or batch is a change of trace. The first step
//! records ([`TraceState::Record`]); at the next step the trace is frozen
//! ([`TraceState::Complete`]) and each visit is checked against it. On a
//! mismatch the prefetcher reports it (the trainer completes every
//! in-flight read so nothing is left holding a buffer or waiting), keeps
//! the visits that matched, and records the rest of this step: the next
//! step runs with the new trace. Prefetching only ever *issues* reads, and
//! every fetch completes its own read, so a wrong prediction costs I/O but
//! can never deadlock or change a value.
//!
//! # Prefetch window
//!
//! At visit `i`, the params of visits `i+1, i+2, …` that are not resident
//! or in flight are read ahead, in trace order, until one of:
//! * the elements issued in this call would exceed
//!   `stage3_prefetch_bucket_size` (the first param is always issued, so a
//!   param larger than the bucket is still prefetched);
//! * resident, in-flight, staged (several ranks: landed, waiting for the
//!   gather) and issued elements together would exceed
//!   `stage3_max_live_parameters` (a read in flight counts as live, as in
//!   DeepSpeed, whose count of available params grows when a fetch is
//!   issued: counting only resident params, each fetch could put another
//!   window's reads in flight on top of the last, and residency overshot
//!   the limit by up to the swap buffer count's worth of params);
//! * no swap buffer is free ([`crate::engine::ParamStore::prefetch`] returns false).
//!
//! Unlike DeepSpeed we do not stop at the first param still on NVMe: every
//! param in the window gets its own asynchronous read, so a read is never
//! queued behind another param's read.
//!
//! # Release
//!
//! After a visit, each of its params is kept resident when
//! * it is persistent: at most `stage3_param_persistence_threshold`
//!   elements, within `stage3_model_persistence_threshold` in all
//!   (DeepSpeed's rule, [`crate::engine::sizing::persistent_params`]; the
//!   plan counts their host bytes);
//! * it is in the device cache: the `tierzero.device_cache_bytes` budget is
//!   filled first-come by params as they are released, and a cached param
//!   stays resident across steps (the optimizer updates it in place);
//! * its next use in the trace is within `stage3_max_reuse_distance`
//!   elements (the elements of the params visited in between), or within
//!   one `stage3_prefetch_bucket_size` when that is larger: released, it
//!   would be read straight back by the prefetch window, which reaches a
//!   bucket ahead (DeepSpeed releases and re-reads it; at the turn from
//!   forward to backward that is the last block, read again right after
//!   its forward while the head computes);
//!
//! and, for the last two, the resident params (this one included) are
//! within `stage3_max_live_parameters` elements: residency is bounded by
//! the config, never by the model (DeepSpeed's default reuse distance,
//! 1e9 elements, would otherwise keep every block of a smaller model
//! resident from its forward to its backward).
//!
//! Otherwise it is released (for NVMe params nothing is written: the home
//! copy is unchanged during forward and backward).

use std::collections::HashSet;

use crate::engine::params::store::{ParamState, ParamStore};
use crate::model::{Model, ParamId, UnitId};

/// Forward or backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward.
    Forward,
    /// Backward (recompute).
    Backward,
}

/// One visit of a unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visit {
    /// The unit.
    pub unit: UnitId,
    /// The pass.
    pub pass: Pass,
    /// Activation shape `[batch, seq]`.
    pub shape: [usize; 2],
}

/// Where the trace stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceState {
    /// Recording the visits of this step.
    Record(Vec<Visit>),
    /// Frozen; `pos` visits of this step matched so far.
    Complete {
        /// The trace.
        visits: Vec<Visit>,
        /// Visits of the current step so far.
        pos: usize,
    },
}

/// Prefetcher limits (element counts except the cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `stage3_prefetch_bucket_size`.
    pub prefetch_bucket_numel: u64,
    /// `stage3_max_live_parameters`.
    pub max_live_numel: u64,
    /// `stage3_max_reuse_distance`.
    pub max_reuse_distance_numel: u64,
    /// `stage3_param_persistence_threshold`.
    pub persistence_threshold_numel: u64,
    /// `stage3_model_persistence_threshold`.
    pub model_persistence_threshold_numel: u64,
    /// `tierzero.device_cache_bytes`.
    pub device_cache_bytes: u64,
}

/// Elements of the first forward units whose optimizer updates stay
/// resident ([`Prefetcher::keep_after_update`]): what
/// `stage3_max_live_parameters` leaves beside one prefetch bucket (the
/// window the first fetch of a step reads ahead), and at least one bucket.
pub fn keep_bound_numel(limits: &Limits) -> u64 {
    limits
        .max_live_numel
        .saturating_sub(limits.prefetch_bucket_numel)
        .max(limits.prefetch_bucket_numel)
}

/// The prefetcher.
#[derive(Debug, Clone)]
pub struct Prefetcher {
    state: TraceState,
    limits: Limits,
    unit_params: Vec<Vec<ParamId>>,
    numel: Vec<u64>,
    cached: HashSet<ParamId>,
    cache_bytes: u64,
    rerecords: u64,
    /// Params of the first forward units, up to [`keep_bound_numel`]
    /// elements (at least the first unit): see [`Prefetcher::keep_after_update`].
    first_units: Vec<bool>,
    /// Per param: persistent, never released
    /// ([`crate::engine::sizing::persistent_params`]).
    persistent: Vec<bool>,
}

impl Prefetcher {
    /// A prefetcher for `model` that starts by recording.
    pub fn new(model: &Model, limits: Limits) -> Self {
        let unit_params: Vec<Vec<ParamId>> =
            model.units().iter().map(|u| u.params.clone()).collect();
        let numel: Vec<u64> = model.params().iter().map(|p| p.numel as u64).collect();
        let first_units = Self::first_units(model, keep_bound_numel(&limits));
        let persistent = crate::engine::sizing::persistent_params(
            model,
            limits.persistence_threshold_numel,
            limits.model_persistence_threshold_numel,
        );
        Prefetcher {
            state: TraceState::Record(Vec::new()),
            limits,
            unit_params,
            numel,
            cached: HashSet::new(),
            cache_bytes: 0,
            rerecords: 0,
            first_units,
            persistent,
        }
    }

    /// Per param: whether it belongs to the units the next forward needs
    /// first: the first units in model order, up to `bucket_numel`
    /// elements (at least the first unit). Their optimizer updates stay
    /// resident ([`Prefetcher::keep_after_update`]), and their sub-groups'
    /// state may stay in host memory (`tierzero.optimizer_resident_bytes`).
    pub fn first_units(model: &Model, bucket_numel: u64) -> Vec<bool> {
        let numel: Vec<u64> = model.params().iter().map(|p| p.numel as u64).collect();
        let mut first_units = vec![false; numel.len()];
        let mut kept = 0u64;
        for (i, u) in model.units().iter().enumerate() {
            let n: u64 = u
                .params
                .iter()
                .map(|p| numel.get(p.0).copied().unwrap_or(0))
                .sum();
            if i > 0 && kept + n > bucket_numel {
                break;
            }
            kept += n;
            for p in &u.params {
                if let Some(f) = first_units.get_mut(p.0) {
                    *f = true;
                }
            }
        }
        first_units
    }

    /// Whether `p`'s optimizer update should stay resident (written
    /// through): it belongs to the units the next forward needs first
    /// ([`keep_bound_numel`] elements of them, from the model's unit
    /// order: what `stage3_max_live_parameters` leaves beside the first
    /// fetch's prefetch bucket), so writing it and reading it straight back
    /// would stall that forward. Their updates are the last of a step (the
    /// optimizer's tail): read back, they queued behind the tail's writes.
    /// Decided from the model and the limits, never from timing, so a
    /// step's read count is fixed.
    pub fn keep_after_update(&self, p: ParamId) -> bool {
        self.first_units.get(p.0).copied().unwrap_or(false)
    }

    /// The trace state.
    pub fn state(&self) -> &TraceState {
        &self.state
    }

    /// How many times a frozen trace was invalidated.
    pub fn rerecords(&self) -> u64 {
        self.rerecords
    }

    /// Start of a step: freeze a recorded trace.
    pub fn begin_step(&mut self) {
        self.state = match std::mem::replace(&mut self.state, TraceState::Record(Vec::new())) {
            TraceState::Record(v) if !v.is_empty() => TraceState::Complete { visits: v, pos: 0 },
            TraceState::Record(v) => TraceState::Record(v),
            TraceState::Complete { visits, .. } => TraceState::Complete { visits, pos: 0 },
        };
    }

    /// Records or checks a visit. Returns false when it contradicts the
    /// frozen trace (which then switches to recording).
    pub fn visit(&mut self, v: Visit) -> bool {
        match &mut self.state {
            TraceState::Record(list) => {
                list.push(v);
                true
            }
            TraceState::Complete { visits, pos } => {
                if visits.get(*pos) == Some(&v) {
                    *pos += 1;
                    true
                } else {
                    let mut kept: Vec<Visit> = visits[..*pos].to_vec();
                    kept.push(v);
                    self.state = TraceState::Record(kept);
                    self.rerecords += 1;
                    false
                }
            }
        }
    }

    fn upcoming(&self) -> &[Visit] {
        match &self.state {
            TraceState::Complete { visits, pos } => visits.get(*pos..).unwrap_or(&[]),
            TraceState::Record(_) => &[],
        }
    }

    /// Params to read ahead now, in trace order (see the module docs).
    pub fn prefetch_candidates(&self, store: &ParamStore) -> Vec<ParamId> {
        let elem = store.device_bytes_per_elem();
        // Resident, in flight, and landed but staged for a gather (several
        // ranks): every read the window has made counts until released.
        let live = store.window_live_bytes() / elem.max(1);
        let mut issued = 0u64;
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for v in self.upcoming() {
            for &p in self.unit_params.get(v.unit.0).map_or(&[][..], |x| x) {
                if !seen.insert(p) || store.state(p) != ParamState::OnDisk {
                    continue;
                }
                let n = self.numel.get(p.0).copied().unwrap_or(0);
                // The first param always fits the bucket (as in DeepSpeed,
                // which adds before it checks); max-live is a hard limit.
                let over_bucket = !out.is_empty() && issued + n > self.limits.prefetch_bucket_numel;
                if over_bucket || live + issued + n > self.limits.max_live_numel {
                    return out;
                }
                issued += n;
                out.push(p);
            }
        }
        out
    }

    /// Whether `p`, just used, stays resident.
    pub fn keep(&mut self, p: ParamId, bytes: u64, live_numel: u64) -> bool {
        let persistent = self.persistent.get(p.0).copied().unwrap_or(false);
        if persistent || self.cached.contains(&p) {
            return true;
        }
        // Kept, it stays live: never past `stage3_max_live_parameters`
        // (the live elements include `p`'s own), so resident params are
        // bounded by the config whatever the model's size.
        if live_numel > self.limits.max_live_numel {
            return false;
        }
        // Next use within the reuse distance, or within the window the
        // prefetcher would read it back in?
        let reach = self
            .limits
            .max_reuse_distance_numel
            .max(self.limits.prefetch_bucket_numel);
        let mut dist = 0u64;
        for v in self.upcoming() {
            let ps = self.unit_params.get(v.unit.0).map_or(&[][..], |x| x);
            if ps.contains(&p) {
                return true;
            }
            dist += ps
                .iter()
                .map(|q| self.numel.get(q.0).copied().unwrap_or(0))
                .sum::<u64>();
            if dist > reach {
                break;
            }
        }
        if self.cache_bytes + bytes <= self.limits.device_cache_bytes {
            self.cache_bytes += bytes;
            self.cached.insert(p);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic
    use super::*;
    use crate::model::ModelConfig;

    fn gpt2(layers: usize, hidden: usize) -> Model {
        let json = serde_json::json!({"model_type": "gpt2", "vocab_size": 256,
            "n_positions": 32, "n_embd": hidden, "n_layer": layers, "n_head": 2,
            "tie_word_embeddings": true});
        let (cfg, _) = ModelConfig::from_hf_json(&json.to_string()).unwrap();
        Model::new(cfg).unwrap()
    }

    /// One step's visits: forward over the embedding and blocks, the head
    /// (forward and backward at once), backward over the blocks and the
    /// embedding.
    fn step_visits(model: &Model) -> Vec<Visit> {
        let n = model.units().len();
        let visit = |u: usize, pass| Visit {
            unit: UnitId(u),
            pass,
            shape: [2, 16],
        };
        let mut v: Vec<Visit> = (0..n - 1).map(|u| visit(u, Pass::Forward)).collect();
        v.extend((0..n).rev().map(|u| visit(u, Pass::Backward)));
        v
    }

    /// Whether, after each forward visit, its unit's params are kept.
    fn kept_after_forward(model: &Model, bucket_numel: u64) -> Vec<bool> {
        let limits = Limits {
            prefetch_bucket_numel: bucket_numel,
            max_live_numel: u64::MAX,
            max_reuse_distance_numel: 0,
            persistence_threshold_numel: 0,
            model_persistence_threshold_numel: u64::MAX,
            device_cache_bytes: 0,
        };
        let mut s = Prefetcher::new(model, limits);
        let visits = step_visits(model);
        s.begin_step();
        for v in &visits {
            assert!(s.visit(v.clone()));
        }
        s.begin_step();
        let mut kept = Vec::new();
        for v in &visits {
            assert!(s.visit(v.clone()));
            if v.pass == Pass::Forward {
                let ps = model.units()[v.unit.0].params.clone();
                let bytes = |p: ParamId| model.params()[p.0].numel as u64 * 4;
                kept.push(ps.iter().all(|&p| s.keep(p, bytes(p), 0)));
            }
        }
        kept
    }

    /// At `stage3_max_reuse_distance` 0 a param is still kept when its next
    /// use lies within the prefetch window (which would read it straight
    /// back): the last block, whose backward follows its forward after the
    /// head alone. The others, used again much later, are released.
    #[test]
    fn a_param_the_prefetcher_would_read_straight_back_is_kept() {
        let model = gpt2(4, 64);
        // The head's params between the last block's two visits: the final
        // norm and the tied embedding (256 × 64).
        let head: u64 = model.units()[5]
            .params
            .iter()
            .map(|p| model.params()[p.0].numel as u64)
            .sum();
        assert!(head > 16_000 && head < 20_000, "head {head}");
        assert_eq!(
            kept_after_forward(&model, 20_000),
            vec![false, false, false, false, true]
        );
        // A bucket smaller than the head: released, as DeepSpeed does.
        assert_eq!(kept_after_forward(&model, 10_000), vec![false; 5]);
    }
}
