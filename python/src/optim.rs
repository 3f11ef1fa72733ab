//! `_OffloadAdam`: the state and step of `tierzero.torch.AdamW`.
//!
//! The Rust engine's own optimizer state ([`OptimizerState`]): fp32 master
//! weights, `m` and `v` (fp32 or bf16, `moments_dtype`) per sub-group, in host memory (`offload="none"` or
//! `"cpu"`: the CPU optimizer runs on the host either way) or on NVMe
//! (`"nvme"`: three extents per sub-group, streamed through pinned buffers
//! of `largest sub-group × 4` bytes by a read and a write engine), stepped
//! by the SIMD AdamW kernel ([`CpuAdam`]).
//!
//! ## The pipeline
//! Python calls `OffloadAdam::step_group` once per sub-group in order,
//! naming the next one: the state read of `i + 1` is issued before `i` is
//! stepped, and `i`'s write is retired only once `i + 1` has been stepped
//! (`write_behind` 1), so read `i+1`, step `i` and write `i-1` overlap. The
//! GIL is released for the whole call.
//!
//! ## Sizing
//! The pinned buffers are what [`sizing::buffers_needed`] says the pipeline
//! needs, the one rule the engine uses too; a `pinned_budget_bytes` below
//! that fails with the numbers (`OffloadAdam::plan` prints them).

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use tierzero::engine::optimizer::state::{NvmeOptim, OptimizerState, PoolSize};
use tierzero::engine::{sizing, SubGroupId};
use tierzero::optim::{AdamHyper, AdamMode, CpuAdam, GradScale, LowPrecisionOut, MomentDtype};
use tierzero_swap::{
    ArenaConfig, Engine, EngineConfig, LockPolicy, PinnedArena, SpaceConfig, SwapSpace,
};

use crate::dlpack;

/// An error with the OS's code behind it, if any.
trait OsErrno: std::fmt::Display {
    fn errno(&self) -> Option<i32>;
}

impl OsErrno for tierzero_swap::SwapError {
    fn errno(&self) -> Option<i32> {
        self.raw_os_error()
    }
}

impl OsErrno for tierzero::engine::EngineError {
    fn errno(&self) -> Option<i32> {
        match self {
            tierzero::engine::EngineError::Io { source, .. } => source.raw_os_error(),
            tierzero::engine::EngineError::Swap(s) => s.raw_os_error(),
            _ => None,
        }
    }
}

impl OsErrno for tierzero::optim::OptimError {
    fn errno(&self) -> Option<i32> {
        None
    }
}

/// `OSError(errno, message)` when the OS failed an operation (a state
/// write that met a full disk: `except OSError` catches it, as it does
/// `tierzero.aio`'s errors), else `RuntimeError`.
fn err(e: impl OsErrno) -> PyErr {
    match e.errno() {
        Some(n) => PyOSError::new_err((n, e.to_string())),
        None => PyRuntimeError::new_err(e.to_string()),
    }
}

/// A contiguous host float32 tensor (DLPack), with its owners.
fn f32_tensor(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<dlpack::HostTensor> {
    typed_tensor(obj, what, dlpack::DTYPE_F32)
}

/// A contiguous host tensor of `dtype`, aligned to its element size.
fn typed_tensor(
    obj: &Bound<'_, PyAny>,
    what: &str,
    dtype: (u8, u8, u16),
) -> PyResult<dlpack::HostTensor> {
    let t = dlpack::host_tensor(obj)?;
    check_dtype(&t, what, dtype)?;
    Ok(t)
}

/// `t` is of `dtype` and aligned to its element size.
fn check_dtype(t: &dlpack::HostTensor, what: &str, dtype: (u8, u8, u16)) -> PyResult<()> {
    if t.dtype != dtype {
        return Err(PyValueError::new_err(format!(
            "{what}: DLPack dtype {:?}, want {dtype:?} (float32 is (2, 32, 1), bfloat16 (4, 16, 1))",
            t.dtype
        )));
    }
    let align = usize::from(dtype.1 / 8).max(1);
    if !t.addr.is_multiple_of(align) {
        return Err(PyValueError::new_err(format!(
            "{what}: not {align}-byte aligned"
        )));
    }
    Ok(())
}

/// `threads`, or every CPU this process may use.
fn threads_or_all(threads: Option<usize>) -> PyResult<NonZeroUsize> {
    NonZeroUsize::new(
        threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, NonZeroUsize::get)),
    )
    .ok_or_else(|| PyValueError::new_err("threads must be >= 1"))
}

/// torch's AdamW settings (decoupled decay, bias correction), validated:
/// out-of-range values are torch's `ValueError`s.
fn torch_hyper(lr: f64, betas: [f64; 2], eps: f64, weight_decay: f64) -> PyResult<AdamHyper> {
    let hyper = AdamHyper {
        lr,
        beta1: betas[0],
        beta2: betas[1],
        eps,
        weight_decay,
        mode: AdamMode::AdamW,
        bias_correction: true,
    };
    hyper
        .validate()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(hyper)
}

/// The kernel on `threads` threads with `hyper`.
fn cpu_adam(hyper: AdamHyper, threads: NonZeroUsize) -> PyResult<CpuAdam> {
    CpuAdam::new(hyper, threads).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The base of a slice of `n` elements at `addr`, a checked host tensor's
/// first byte: a tensor of no elements may have a null data pointer
/// (torch's `empty(0)` exports one), which no slice may have, so a
/// dangling aligned pointer then (never read: the slice is empty).
fn slice_base<T>(addr: usize, n: usize) -> *mut T {
    match n {
        0 => std::ptr::NonNull::<T>::dangling().as_ptr(),
        _ => addr as *mut T,
    }
}

/// The optimizer state of `tierzero.torch.AdamW`.
///
/// Its methods read and write the caller's tensors with the GIL released
/// (other Python threads run while NVMe is read): the caller must not
/// write, resize or free a tensor it passed while the call runs.
#[pyclass(name = "_OffloadAdam", module = "tierzero._native")]
#[derive(Debug)]
pub struct OffloadAdam {
    state: Mutex<OptimizerState>,
    numel: Vec<usize>,
    threads: NonZeroUsize,
    plan: String,
}

#[pymethods]
impl OffloadAdam {
    /// Sub-groups of `numel` elements; `offload` "none", "cpu" or "nvme"
    /// (then `nvme_path`, a directory); `pinned_budget_bytes` caps the
    /// pinned buffers (None: exactly what the pipeline needs);
    /// `moments_dtype` "float32" or "bfloat16" (`m` and `v` as stored, in
    /// memory and on NVMe).
    #[new]
    #[pyo3(signature = (numel, offload, nvme_path=None, pinned_budget_bytes=None, threads=None, moments_dtype="float32"))]
    fn new(
        py: Python<'_>,
        numel: Vec<usize>,
        offload: &str,
        nvme_path: Option<PathBuf>,
        pinned_budget_bytes: Option<u64>,
        threads: Option<usize>,
        moments_dtype: &str,
    ) -> PyResult<Self> {
        let threads = threads_or_all(threads)?;
        let moments = match moments_dtype {
            "float32" => MomentDtype::F32,
            "bfloat16" => MomentDtype::Bf16,
            other => {
                return Err(PyValueError::new_err(format!(
                    "moments_dtype {other:?}: expected \"float32\" or \"bfloat16\""
                )))
            }
        };
        let per_elem = 4 + 2 * moments.bytes_per_elem();
        let (read_ahead, write_behind) = (1usize, 1usize);
        // Saturating: a count no memory holds is refused below (the
        // allocation, the pinned budget, the swap file), not a panic here.
        let largest_bytes = numel
            .iter()
            .map(|&n| (n.max(1) as u64).saturating_mul(4))
            .max()
            .unwrap_or(4096);
        let total_elems: u64 = numel
            .iter()
            .fold(0u64, |sum, &n| sum.saturating_add(n as u64));
        // The state's bytes by the engine's one rule (`sizing::state_bytes`).
        let host_state_bytes = numel
            .iter()
            .flat_map(|&n| sizing::state_bytes(n, moments))
            .fold(0u64, u64::saturating_add);
        if matches!(offload, "none" | "cpu") {
            // Refused with the numbers before any of it is allocated: the
            // allocation of a state no memory holds aborted the process,
            // or (touched) drew the OOM killer.
            let swap_free_bytes = tierzero::estimate::probe_swap_free().unwrap_or(0);
            if let Some(available_bytes) = sizing::mem_available_bytes() {
                if host_state_bytes > available_bytes.saturating_add(swap_free_bytes) {
                    return Err(pyo3::exceptions::PyMemoryError::new_err(format!(
                        "the optimizer state of {total_elems} elements takes {host_state_bytes} bytes of host memory (fp32 master, {} m and v: {per_elem} bytes per element) and {available_bytes} bytes are available ({swap_free_bytes} more as swap); keep it on NVMe (offload=\"nvme\"), use moments_dtype=torch.bfloat16, or step fewer params",
                        moments.name()
                    )));
                }
            }
        }
        let (nvme, plan) = match offload {
            "none" | "cpu" => (
                None,
                format!(
                    "optimizer state in host memory ({offload}): {} sub-groups, {} elements, {} bytes (fp32 master, {} m and v)",
                    numel.len(),
                    total_elems,
                    host_state_bytes,
                    moments.name(),
                ),
            ),
            "nvme" => {
                let dir = nvme_path.ok_or_else(|| {
                    PyValueError::new_err("offload=\"nvme\" needs nvme_path (a directory on the NVMe)")
                })?;
                let align = tierzero_swap::Alignment::for_path(&dir);
                let buf_bytes = align.round_up(largest_bytes);
                let need = sizing::buffers_needed(read_ahead, write_behind, false) as u64;
                let need_bytes = need.saturating_mul(buf_bytes);
                let budget = pinned_budget_bytes.unwrap_or(need_bytes);
                if budget < need_bytes {
                    return Err(PyValueError::new_err(format!(
                        "pinned_budget_bytes = {budget} is too small: the optimizer pipeline needs {need} buffers of {buf_bytes} bytes (3 states x 3 stages: read ahead, step, write behind, of the largest sub-group's {largest_bytes} bytes) = {need_bytes} bytes; raise pinned_budget_bytes to at least {need_bytes} or lower sub_group_size"
                    )));
                }
                let capacity: u64 = numel
                    .iter()
                    .flat_map(|&n| sizing::state_bytes(n, moments))
                    .map(|b| align.round_up(b))
                    .fold(1u64 << 20, u64::saturating_add);
                let built = py.detach(|| -> tierzero_swap::Result<NvmeOptim> {
                    std::fs::create_dir_all(&dir).map_err(|source| tierzero_swap::SwapError::Setup {
                        what: format!("creating {}", dir.display()),
                        source,
                    })?;
                    let space = SwapSpace::create(SpaceConfig::new(&dir, capacity))?;
                    let mut ac = ArenaConfig::new(budget, buf_bytes);
                    ac.lock = LockPolicy::BestEffort;
                    let arena = PinnedArena::new(ac)?;
                    let read = Engine::new(space.clone(), arena.clone(), EngineConfig::default())?;
                    let write = Engine::new(space, arena.clone(), EngineConfig::default())?;
                    Ok(NvmeOptim { read, write, arena })
                });
                let io = built.map_err(err)?;
                let plan = format!(
                    "optimizer state on NVMe at {}: {} sub-groups, {} elements, {} bytes on disk (fp32 master, {} m and v); pinned: {} buffers of {} bytes = {} bytes (budget {}; the pipeline needs {need}: 3 states x (read ahead 1 + step + write behind 1))",
                    dir.display(),
                    numel.len(),
                    total_elems,
                    capacity,
                    moments.name(),
                    io.arena.count(),
                    buf_bytes,
                    io.arena.count() as u64 * buf_bytes,
                    budget,
                );
                (Some(io), plan)
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "offload {other:?}: expected \"none\", \"cpu\" or \"nvme\""
                )))
            }
        };
        let resident = vec![false; numel.len()];
        let state = OptimizerState::new(
            numel.clone(),
            nvme,
            &resident,
            read_ahead,
            write_behind,
            false,
            PoolSize::default(),
            moments,
        )
        .map_err(err)?;
        Ok(OffloadAdam {
            state: Mutex::new(state),
            numel,
            threads,
            plan,
        })
    }

    /// Where the state lives and what the pinned buffers are.
    fn plan(&self) -> String {
        self.plan.clone()
    }

    /// Sub-groups.
    fn __len__(&self) -> usize {
        self.numel.len()
    }

    /// Sets sub-group `sg`'s master, `m` and `v` (float32 host tensors of
    /// its numel; `m`/`v` None: zeros).
    #[pyo3(signature = (sg, master, m=None, v=None))]
    fn load(
        &self,
        py: Python<'_>,
        sg: usize,
        master: &Bound<'_, PyAny>,
        m: Option<&Bound<'_, PyAny>>,
        v: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let n = self.numel_of(sg)?;
        let master = f32_tensor(master, "master")?;
        let m = m.map(|t| f32_tensor(t, "m")).transpose()?;
        let v = v.map(|t| f32_tensor(t, "v")).transpose()?;
        for (t, name) in [
            (Some(&master), "master"),
            (m.as_ref(), "m"),
            (v.as_ref(), "v"),
        ] {
            if let Some(t) = t {
                if t.nbytes != n * 4 {
                    return Err(PyValueError::new_err(format!(
                        "{name} of sub-group {sg}: {} bytes, want {} (float32 x {n})",
                        t.nbytes,
                        n * 4
                    )));
                }
            }
        }
        let zeros = vec![0f32; if m.is_none() || v.is_none() { n } else { 0 }];
        let view = |t: &Option<dlpack::HostTensor>| -> &[f32] {
            match t {
                // SAFETY: a contiguous float32 host tensor of n elements,
                // 4-byte aligned (checked; of none, a dangling aligned base:
                // `slice_base`), kept alive by its owners for this call; the
                // Python caller does not write it while the call runs (the
                // GIL is released while it is read: the class's contract).
                Some(t) => unsafe { std::slice::from_raw_parts(slice_base::<f32>(t.addr, n), n) },
                None => &zeros,
            }
        };
        // SAFETY: as above, for the master tensor.
        let master_s = unsafe { std::slice::from_raw_parts(slice_base::<f32>(master.addr, n), n) };
        let (ms, vs) = (view(&m), view(&v));
        py.detach(|| self.locked().load_group(SubGroupId(sg), [master_s, ms, vs]))
            .map_err(err)
    }

    /// Writes sub-group `sg`'s master, `m` and `v` into three float32 host
    /// tensors of its numel.
    fn read_state(
        &self,
        py: Python<'_>,
        sg: usize,
        master: &Bound<'_, PyAny>,
        m: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let n = self.numel_of(sg)?;
        let outs = [
            f32_tensor(master, "master")?,
            f32_tensor(m, "m")?,
            f32_tensor(v, "v")?,
        ];
        if outs.iter().any(|t| t.nbytes != n * 4 || t.read_only) {
            return Err(PyValueError::new_err(format!(
                "read_state of sub-group {sg}: want three writable float32 tensors of {n} elements"
            )));
        }
        let addrs = outs.map(|t| t.addr);
        let overlap = |a: usize, b: usize| a < b + n * 4 && b < a + n * 4;
        if n > 0
            && (overlap(addrs[0], addrs[1])
                || overlap(addrs[0], addrs[2])
                || overlap(addrs[1], addrs[2]))
        {
            return Err(PyValueError::new_err(format!(
                "read_state of sub-group {sg}: master, m and v must be three distinct tensors"
            )));
        }
        // Straight into the caller's tensors, without the GIL: no second
        // copy of the sub-group's state, and other Python threads run
        // while NVMe is read.
        py.detach(|| {
            // SAFETY: each a writable, contiguous float32 host tensor of n
            // elements (checked), the three not overlapping (checked),
            // alive for this call (the caller holds them).
            let [a, b, c] = addrs.map(|addr| unsafe {
                std::slice::from_raw_parts_mut(slice_base::<f32>(addr, n), n)
            });
            self.locked().group_states_into(SubGroupId(sg), [a, b, c])
        })
        .map_err(err)
    }

    /// One AdamW step (1-based `step`) of sub-group `sg` with `grad` (float32
    /// host tensor of its numel), writing the updated master into `out` (a
    /// host tensor of its numel): float32, or bfloat16 / float16, which the
    /// kernel writes in the same pass as the step (the fused low-precision
    /// copy: round to nearest even, as torch's cast). `next`: the sub-group stepped
    /// after this one, whose state read is issued first. `grad_scale`
    /// multiplies the gradient.
    #[allow(
        clippy::too_many_arguments,
        reason = "the hyper-parameters of torch's param group"
    )]
    #[pyo3(signature = (sg, step, lr, beta1, beta2, eps, weight_decay, grad, out, next=None, grad_scale=1.0))]
    fn step_group(
        &self,
        py: Python<'_>,
        sg: usize,
        step: u64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        grad: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        next: Option<usize>,
        grad_scale: f32,
    ) -> PyResult<()> {
        let n = self.numel_of(sg)?;
        if let Some(nx) = next {
            self.numel_of(nx)?;
        }
        if step == 0 {
            return Err(PyValueError::new_err("step is 1-based"));
        }
        let adam = cpu_adam(
            torch_hyper(lr, [beta1, beta2], eps, weight_decay)?,
            self.threads,
        )?;
        let g = f32_tensor(grad, "grad")?;
        let o = dlpack::host_tensor(out)?;
        let out_dtype = o.dtype;
        if ![dlpack::DTYPE_F32, dlpack::DTYPE_BF16, dlpack::DTYPE_F16].contains(&out_dtype) {
            return Err(PyValueError::new_err(format!(
                "out: DLPack dtype {out_dtype:?}: float32, bfloat16 or float16"
            )));
        }
        check_dtype(&o, "out", out_dtype)?;
        let out_bytes = n * usize::from(out_dtype.1 / 8);
        if g.nbytes != n * 4 || o.nbytes != out_bytes || o.read_only {
            return Err(PyValueError::new_err(format!(
                "step of sub-group {sg}: grad (float32) and a writable out must have {n} elements (got {} and {} bytes)",
                g.nbytes, o.nbytes
            )));
        }
        if n > 0 && g.addr < o.addr + out_bytes && o.addr < g.addr + n * 4 {
            return Err(PyValueError::new_err("grad and out overlap"));
        }
        // SAFETY: a contiguous float32 host tensor of n elements (checked),
        // alive for this call (its owners are held by `g`); the Python
        // caller does not touch it while the call runs.
        let grad_s = unsafe { std::slice::from_raw_parts(slice_base::<f32>(g.addr, n), n) };
        // `out` as the kernel's fused copy, or as the fp32 master's target.
        let (mut out_f32, low) = if out_dtype == dlpack::DTYPE_F32 {
            // SAFETY: as above, float32 and 4-byte aligned; writable and
            // distinct from `grad` (checked before either slice exists).
            (
                Some(unsafe { std::slice::from_raw_parts_mut(slice_base::<f32>(o.addr, n), n) }),
                None,
            )
        } else if out_dtype == dlpack::DTYPE_BF16 {
            // SAFETY: as above; `half::bf16` is a transparent u16 and the
            // tensor is 2-byte aligned (checked).
            let s =
                unsafe { std::slice::from_raw_parts_mut(slice_base::<half::bf16>(o.addr, n), n) };
            (None, Some(LowPrecisionOut::Bf16(s)))
        } else {
            // SAFETY: as for bfloat16; `half::f16` is a transparent u16.
            let s =
                unsafe { std::slice::from_raw_parts_mut(slice_base::<half::f16>(o.addr, n), n) };
            (None, Some(LowPrecisionOut::F16(s)))
        };
        py.detach(|| -> tierzero::engine::Result<()> {
            let mut st = self.locked();
            // A read issued for another sub-group (the caller's guess of the
            // next one was wrong, as it can be when stepping in backward):
            // drop it; the state on disk is unchanged.
            if st.next_read().is_some_and(|g| g != SubGroupId(sg)) {
                st.cancel_reads()?;
            }
            st.prefetch(SubGroupId(sg))?;
            if let Some(nx) = next {
                st.prefetch(SubGroupId(nx))?;
            }
            st.step(
                SubGroupId(sg),
                &adam,
                step,
                Some(grad_s.into()),
                GradScale(grad_scale),
                low,
                &mut |master| {
                    if let Some(o) = out_f32.as_mut() {
                        o.copy_from_slice(master);
                    }
                    Ok(())
                },
                false,
            )?;
            st.retire_behind()?;
            if let Some(nx) = next {
                st.prefetch(SubGroupId(nx))?;
            }
            Ok(())
        })
        .map_err(err)
    }

    /// Waits for every state write.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.locked().flush()).map_err(err)
    }

    /// Bytes of state read from and written to NVMe so far.
    fn io_bytes(&self) -> (u64, u64) {
        let c = self.locked().counters();
        (c.nvme_read_bytes, c.nvme_written_bytes)
    }
}

impl OffloadAdam {
    fn locked(&self) -> std::sync::MutexGuard<'_, OptimizerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn numel_of(&self, sg: usize) -> PyResult<usize> {
        self.numel.get(sg).copied().ok_or_else(|| {
            PyValueError::new_err(format!(
                "sub-group {sg} out of range ({} sub-groups)",
                self.numel.len()
            ))
        })
    }
}

/// The optimizer-offload settings of a `ds_config.json` (its text), read as
/// `tierzero train` reads it (hjson, duplicate keys refused, DeepSpeed's
/// names and defaults, "auto" resolved with HF's defaults): a dict of
/// `offload` ("none" / "cpu" / "nvme"), `nvme_path`, `sub_group_size`
/// (elements), `pinned_budget_bytes` (None: what the pipeline needs),
/// `pin_memory`; for the params `param_offload`, `param_nvme_path`,
/// `prefetch_bucket_size`, `max_live_parameters`,
/// `param_persistence_threshold` (elements: `"auto"` by HF's rule of the
/// model's `hidden_size` where given, else DeepSpeed's defaults) and
/// `model_persistence_threshold`;
/// `gradient_clipping` (None where absent or `"auto"`); and
/// `unknown_keys` (for a warning).
///
/// With `optimizer` (`tierzero.torch.AdamW`'s call), an `optimizer` block
/// of type Adam or AdamW is resolved as `tierzero train` resolves it, the
/// keywords `lr`, `betas`, `eps`, `weight_decay` given (not None) taking
/// the place of HF's `TrainingArguments` values (`"auto"` takes them; a
/// config value that differs is an error naming both; DeepSpeed's
/// defaults where the block leaves a key out): `optimizer` is then a dict
/// of `type`, `lr`, `betas`, `eps`, `weight_decay`,
/// `decoupled_weight_decay` and `bias_correction`, or None without a block;
/// a block of another type is left out, its type in `optimizer_ignored`.
#[pyfunction]
#[pyo3(signature = (text, optimizer=false, lr=None, betas=None, eps=None, weight_decay=None, hidden_size=None))]
#[allow(clippy::too_many_arguments, reason = "Python keywords")]
pub fn ds_offload_settings(
    py: Python<'_>,
    text: &str,
    optimizer: bool,
    lr: Option<f64>,
    betas: Option<(f64, f64)>,
    eps: Option<f64>,
    weight_decay: Option<f64>,
    hidden_size: Option<u64>,
) -> PyResult<Py<pyo3::types::PyDict>> {
    use tierzero::config::{AutoOr, OffloadDevice};
    // The batch sizes and the scheduler are the trainer's business here
    // (HF's, Lightning's: this process is one of its ranks), so they are
    // dropped before validation, as `tierzero estimate` drops them: a
    // multi-GPU `train_batch_size` or a scheduler's `"auto"` total would
    // otherwise refuse the config. So is the optimizer block but for
    // AdamW's own call of an Adam or AdamW block (another optimizer's is
    // the trainer's, and said). The rest is validated as `tierzero train`
    // validates it.
    let mut ignored = None;
    let mut with_block = false;
    let mut clipping = None;
    let loaded = tierzero::config::parse_str(text)
        .and_then(|mut parsed| {
            parsed.ds.train_batch_size = None;
            parsed.ds.train_micro_batch_size_per_gpu = Some(AutoOr::Auto);
            parsed.ds.gradient_accumulation_steps = Some(AutoOr::Auto);
            parsed.ds.scheduler = None;
            clipping = match parsed.ds.gradient_clipping {
                Some(AutoOr::Value(x)) => Some(x),
                Some(AutoOr::Auto) | None => None,
            };
            let adam = |k: &str| k.eq_ignore_ascii_case("adam") || k.eq_ignore_ascii_case("adamw");
            match parsed.ds.optimizer.take() {
                Some(o) if optimizer && adam(&o.kind) => {
                    with_block = true;
                    parsed.ds.optimizer = Some(o);
                }
                Some(o) if optimizer => ignored = Some(o.kind),
                _ => {}
            }
            parsed.resolve(&tierzero::config::RunContext {
                path_checks: tierzero::config::PathChecks::CreateMissing,
                micro_batch_size: Some(1),
                learning_rate: lr,
                adam_betas: betas.map(|(a, b)| [a, b]),
                adam_eps: eps,
                weight_decay,
                hidden_size,
                ..Default::default()
            })
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let c = &loaded.config;
    let d = pyo3::types::PyDict::new(py);
    let off = &c.zero.offload_optimizer;
    let (offload, path) = match &off.device {
        OffloadDevice::None => ("none", None),
        OffloadDevice::Cpu => ("cpu", None),
        OffloadDevice::Nvme { path } => ("nvme", Some(path.display().to_string())),
    };
    d.set_item("offload", offload)?;
    d.set_item("nvme_path", path)?;
    d.set_item("sub_group_size", c.zero.sub_group_numel.0)?;
    d.set_item(
        "pinned_budget_bytes",
        c.tierzero.pinned_budget_bytes.map(|b| b.0),
    )?;
    d.set_item("pin_memory", off.pin_memory)?;
    let (param_offload, param_path) = match &c.zero.offload_param.device {
        OffloadDevice::None => ("none", None),
        OffloadDevice::Cpu => ("cpu", None),
        OffloadDevice::Nvme { path } => ("nvme", Some(path.display().to_string())),
    };
    d.set_item("param_offload", param_offload)?;
    d.set_item("param_nvme_path", param_path)?;
    d.set_item("prefetch_bucket_size", c.zero.prefetch_bucket_numel.0)?;
    d.set_item("max_live_parameters", c.zero.max_live_parameters_numel.0)?;
    d.set_item(
        "param_persistence_threshold",
        c.zero.param_persistence_threshold_numel.0,
    )?;
    d.set_item(
        "model_persistence_threshold",
        c.zero.model_persistence_threshold_numel.0,
    )?;
    let resolved = if with_block {
        let o = &c.optimizer;
        let od = pyo3::types::PyDict::new(py);
        od.set_item(
            "type",
            match o.kind {
                tierzero::config::OptimizerKind::Adam => "Adam",
                tierzero::config::OptimizerKind::AdamW => "AdamW",
            },
        )?;
        od.set_item("lr", o.lr)?;
        od.set_item("betas", (o.betas[0], o.betas[1]))?;
        od.set_item("eps", o.eps)?;
        od.set_item("weight_decay", o.weight_decay)?;
        od.set_item("decoupled_weight_decay", o.decoupled_weight_decay)?;
        od.set_item("bias_correction", o.bias_correction)?;
        Some(od)
    } else {
        None
    };
    d.set_item("optimizer", resolved)?;
    d.set_item("optimizer_ignored", ignored)?;
    d.set_item("gradient_clipping", clipping)?;
    d.set_item("unknown_keys", loaded.unknown_keys())?;
    Ok(d.unbind())
}

/// One param's tensors for an in-place step, checked: `param`, `grad`, `m`
/// and `v` contiguous host tensors of one numel; float32, with `m` and `v`
/// both float32 or both bfloat16; `param`, `m` and `v` writable.
#[derive(Debug)]
struct InPlaceItem {
    hyper: AdamHyper,
    step: u64,
    /// param, grad, m, v: first byte and one past the last.
    spans: [(usize, usize); 4],
    numel: usize,
    bf16_moments: bool,
    /// The tensors this item imported, which keep its memory valid for the
    /// call (cached moments are kept by their [`InPlaceMoments`]).
    _held: Vec<dlpack::HostTensor>,
}

/// Hyper-parameters and step count of one item, checked.
fn item_hyper(step: u64, lr: f64, betas: [f64; 2], eps: f64, wd: f64) -> PyResult<AdamHyper> {
    if step == 0 {
        return Err(PyValueError::new_err("step is 1-based"));
    }
    torch_hyper(lr, betas, eps, wd)
}

/// The moments' dtype of `m` (float32, or bfloat16 for both).
fn moments_dtype(m: &dlpack::HostTensor) -> (u8, u8, u16) {
    if m.dtype == dlpack::DTYPE_BF16 {
        dlpack::DTYPE_BF16
    } else {
        dlpack::DTYPE_F32
    }
}

/// Checks one item's four tensors (see [`InPlaceItem`]); the caller makes
/// the item hold the ones it imported.
fn in_place_item(
    hyper: AdamHyper,
    step: u64,
    t: [&dlpack::HostTensor; 4],
) -> PyResult<InPlaceItem> {
    let mdt = moments_dtype(t[2]);
    for (k, what) in [(0, "param"), (1, "grad")] {
        check_dtype(t[k], what, dlpack::DTYPE_F32)?;
    }
    for (k, what) in [(2, "m"), (3, "v")] {
        check_dtype(t[k], what, mdt)?;
    }
    let n = t[0].nbytes / 4;
    let mbytes = n * usize::from(mdt.1 / 8);
    if t[1].nbytes != n * 4 || t[2].nbytes != mbytes || t[3].nbytes != mbytes {
        return Err(PyValueError::new_err(
            "param, grad, m and v must have one numel (param and grad float32; m and v both float32 or both bfloat16)",
        ));
    }
    if [0, 2, 3].iter().any(|&i| t[i].read_only) {
        return Err(PyValueError::new_err("param, m and v must be writable"));
    }
    Ok(InPlaceItem {
        hyper,
        step,
        spans: t.map(|t| (t.addr, t.addr + t.nbytes)),
        numel: n,
        bf16_moments: mdt == dlpack::DTYPE_BF16,
        _held: Vec::new(),
    })
}

/// Steps `items` in one call of the kernel (threads spawned once), with
/// the GIL released. Refuses any two tensors of any items that share
/// memory, before anything is stepped.
fn step_in_place(
    py: Python<'_>,
    items: &[InPlaceItem],
    threads: Option<usize>,
    grad_scale: f32,
) -> PyResult<()> {
    let mut spans: Vec<(usize, usize)> = items
        .iter()
        .filter(|it| it.numel > 0)
        .flat_map(|it| it.spans)
        .collect();
    spans.sort_unstable();
    if spans.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(PyValueError::new_err(
            "param, grad, m and v must not overlap (within a param or across the params of one call)",
        ));
    }
    // Each item carries its own hyper-parameters (`CpuAdam::step_many`).
    let adam = cpu_adam(AdamHyper::default(), threads_or_all(threads)?)?;
    let mut steps = Vec::with_capacity(items.len());
    for it in items.iter().filter(|it| it.numel > 0) {
        let (a, n) = (it.spans.map(|s| s.0), it.numel);
        // SAFETY: contiguous host tensors of n elements each, aligned to
        // their element size and of the dtypes checked by `in_place_item`,
        // pairwise disjoint across every item (checked above), kept alive
        // for this call by the item (`_held`) or by the `InPlaceMoments`
        // that caches them; the Python caller does not touch them while it
        // runs.
        let (master, grad) = unsafe {
            (
                std::slice::from_raw_parts_mut(a[0] as *mut f32, n),
                std::slice::from_raw_parts(a[1] as *const f32, n),
            )
        };
        let moments = if it.bf16_moments {
            // SAFETY: as above; `half::bf16` is a transparent u16, and the
            // tensors are 2-byte aligned (checked).
            let (ms, vs) = unsafe {
                (
                    std::slice::from_raw_parts_mut(a[2] as *mut half::bf16, n),
                    std::slice::from_raw_parts_mut(a[3] as *mut half::bf16, n),
                )
            };
            tierzero::optim::Moments::Bf16 { m: ms, v: vs }
        } else {
            // SAFETY: as above, float32 and 4-byte aligned.
            let (ms, vs) = unsafe {
                (
                    std::slice::from_raw_parts_mut(a[2] as *mut f32, n),
                    std::slice::from_raw_parts_mut(a[3] as *mut f32, n),
                )
            };
            tierzero::optim::Moments::F32 { m: ms, v: vs }
        };
        steps.push(tierzero::optim::StepItem {
            hyper: it.hyper,
            step: it.step,
            master,
            grad: grad.into(),
            moments,
            low_precision_out: None,
            grad_scale: GradScale(grad_scale),
        });
    }
    py.detach(|| adam.step_many(steps)).map_err(err)
}

/// The moments of the in-place host path, imported once: `tierzero.torch`
/// keeps its `m` and `v` tensors here (it never replaces them; it copies
/// into them), so a step imports only each param and its gradient.
#[pyclass(name = "_InPlaceMoments", module = "tierzero._native")]
#[derive(Debug)]
pub struct InPlaceMoments {
    m: Vec<dlpack::HostTensor>,
    v: Vec<dlpack::HostTensor>,
}

impl InPlaceMoments {
    /// One `(i, step, lr, beta1, beta2, eps, weight_decay, param, grad)`
    /// item on sub-group `i`'s cached moments, checked.
    fn item(&self, item: &Bound<'_, PyAny>) -> PyResult<InPlaceItem> {
        let at = |j: usize| item.get_item(j);
        let i: usize = at(0)?.extract()?;
        let (Some(m), Some(v)) = (self.m.get(i), self.v.get(i)) else {
            return Err(PyValueError::new_err(format!(
                "sub-group {i} of {}",
                self.m.len()
            )));
        };
        let step: u64 = at(1)?.extract()?;
        let hyper = item_hyper(
            step,
            at(2)?.extract()?,
            [at(3)?.extract()?, at(4)?.extract()?],
            at(5)?.extract()?,
            at(6)?.extract()?,
        )?;
        let p = dlpack::host_tensor(&at(7)?)?;
        let g = dlpack::host_tensor(&at(8)?)?;
        let checked = in_place_item(hyper, step, [&p, &g, m, v])?;
        Ok(InPlaceItem {
            _held: vec![p, g],
            ..checked
        })
    }
}

#[pymethods]
impl InPlaceMoments {
    /// `m[i]` and `v[i]`: sub-group `i`'s moments, float32 or bfloat16.
    #[new]
    fn new(m: Vec<Bound<'_, PyAny>>, v: Vec<Bound<'_, PyAny>>) -> PyResult<Self> {
        if m.len() != v.len() {
            return Err(PyValueError::new_err(format!(
                "{} m tensors and {} v tensors",
                m.len(),
                v.len()
            )));
        }
        let import = |ts: Vec<Bound<'_, PyAny>>| -> PyResult<Vec<dlpack::HostTensor>> {
            ts.iter().map(dlpack::host_tensor).collect()
        };
        Ok(InPlaceMoments {
            m: import(m)?,
            v: import(v)?,
        })
    }

    /// Steps the sub-groups of `items`, a list of `(i, step, lr, beta1,
    /// beta2, eps, weight_decay, param, grad)`, on their cached moments,
    /// in one native call: the kernel's threads are spawned once (a spawn
    /// costs more than stepping a small param: see `tierzero::optim::par`),
    /// and nothing is stepped if any item is refused. `&mut self`: the
    /// cached moments are written with the GIL released, so a second
    /// thread's call on the same object is refused by pyo3's borrow check
    /// ("Already borrowed") instead of writing the same memory at once.
    #[pyo3(signature = (items, threads=None, grad_scale=1.0))]
    fn step_many(
        &mut self,
        py: Python<'_>,
        items: &Bound<'_, PyAny>,
        threads: Option<usize>,
        grad_scale: f32,
    ) -> PyResult<()> {
        let mut checked = Vec::new();
        for (k, item) in items.try_iter()?.enumerate() {
            // The item's own error, of its own type (a TypeError stays
            // one; it was rewrapped as a ValueError), with which item.
            let item = self.item(&item?).map_err(|e| {
                let at = PyErr::from_type(e.get_type(py), format!("item {k}: {}", e.value(py)));
                at.set_cause(py, Some(e));
                at
            })?;
            checked.push(item);
        }
        step_in_place(py, &checked, threads, grad_scale)
    }
}

/// One AdamW step in place over a param's own memory (`offload="cpu"` with
/// fp32 params: the param is the master weight, as with DeepSpeed's CPU
/// Adam): `param`, `grad`, `m` and `v` are contiguous host tensors of one
/// numel, in distinct memory: float32, with `m` and `v` both float32 or
/// both bfloat16. The GIL is released for the step.
#[allow(
    clippy::too_many_arguments,
    reason = "the hyper-parameters of torch's param group"
)]
#[pyfunction]
#[pyo3(signature = (step, lr, beta1, beta2, eps, weight_decay, param, grad, m, v, threads=None, grad_scale=1.0))]
pub fn adamw_step_inplace(
    py: Python<'_>,
    step: u64,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    param: &Bound<'_, PyAny>,
    grad: &Bound<'_, PyAny>,
    m: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    threads: Option<usize>,
    grad_scale: f32,
) -> PyResult<()> {
    let item = imported_item(
        step,
        lr,
        [beta1, beta2],
        eps,
        weight_decay,
        [param, grad, m, v],
    )?;
    step_in_place(py, &[item], threads, grad_scale)
}

/// An item whose four tensors are imported now.
fn imported_item(
    step: u64,
    lr: f64,
    betas: [f64; 2],
    eps: f64,
    weight_decay: f64,
    tensors: [&Bound<'_, PyAny>; 4],
) -> PyResult<InPlaceItem> {
    let hyper = item_hyper(step, lr, betas, eps, weight_decay)?;
    let held = tensors
        .iter()
        .map(|t| dlpack::host_tensor(t))
        .collect::<PyResult<Vec<_>>>()?;
    let item = in_place_item(hyper, step, [&held[0], &held[1], &held[2], &held[3]])?;
    Ok(InPlaceItem {
        _held: held,
        ..item
    })
}
