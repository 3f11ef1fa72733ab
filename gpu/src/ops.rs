//! Typed launches of every kernel in [`crate::kernels`] on a [`Device`]'s
//! compute stream.
//!
//! Each function checks every buffer's length against the shape it is
//! given before it launches (an error names the buffer, its length and the
//! length needed), so the kernel reads and writes only inside its buffers:
//! that check and the argument list matching the kernel's signature
//! (types and order, in `src/kernels/*.cu`) are the `SAFETY` of every
//! launch. Optional pointers (a bias, a gradient output) are passed as
//! null. Nothing here waits for the GPU, except [`norm_sq_sums`], which
//! reads its sums back.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::{bf16, f16};

use crate::device::{Device, DeviceBuffer};
use crate::kernels::{BLOCK_THREADS, ROW_CHUNK};
use crate::norm::{NormGroup, NormPlan, NORM_LANES};
use crate::reference::{AdamScalars, HeadsShape, KvShape, RopeShape, Storage};
use crate::{GpuError, Result};

mod gemm;
mod heads;
pub use gemm::{matmul, matmul_16_f32, Half16, MatmulShape};
pub use heads::{add, heads_from_rows, repeat_kv, rows_from_heads, sum_kv};

mod sealed {
    /// Only this crate's three storage dtypes are [`super::Elem`]s.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A storage dtype the kernels take (its entry-point suffix). Sealed:
/// f32, bf16 and f16 only, whose every bit pattern is a valid value
/// ([`Device::alloc_output`] relies on it).
pub trait Elem:
    Storage + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + sealed::Sealed
{
    /// `f32`, `bf16` or `f16`.
    const SUFFIX: &'static str;
}

impl Elem for f32 {
    const SUFFIX: &'static str = "f32";
}
impl Elem for bf16 {
    const SUFFIX: &'static str = "bf16";
}
impl Elem for f16 {
    const SUFFIX: &'static str = "f16";
}

/// Most blocks a grid-stride kernel is launched with.
const MAX_GRID: u64 = 1 << 16;

/// One block per row.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid-stride launch over `n` items.
pub(crate) fn per_item(n: usize) -> LaunchConfig {
    let blocks = (n as u64).div_ceil(BLOCK_THREADS as u64).clamp(1, MAX_GRID);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Most blocks along a grid's y axis (CUDA's limit).
const MAX_GRID_Y: u64 = 65_535;

/// Pass 1 of a column sum: x over tiles of [`BLOCK_THREADS`] columns, y
/// over chunks of [`ROW_CHUNK`] rows (the kernel strides past
/// [`MAX_GRID_Y`]).
fn per_col_chunk(cols: usize, chunks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            (cols as u64).div_ceil(BLOCK_THREADS as u64).max(1) as u32,
            (chunks as u64).clamp(1, MAX_GRID_Y) as u32,
            1,
        ),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A column sum's chunks of [`ROW_CHUNK`] rows, and a buffer for their
/// sums (`chunks × cols`, every element written by pass 1).
fn chunk_sums(
    dev: &Device,
    what: &str,
    rows: usize,
    cols: usize,
) -> Result<(usize, DeviceBuffer<f32>)> {
    let chunks = rows.div_ceil(ROW_CHUNK);
    let part = dev.alloc_output::<f32>(what, product(what, chunks, cols)?)?;
    Ok((chunks, part))
}

/// Pass 2 of a column sum: `acc[c] +=` the chunk sums of column `c` in
/// chunk order (`col_sums_finish`).
fn col_sums_finish(
    dev: &Device,
    acc: &mut DeviceBuffer<f32>,
    part: &DeviceBuffer<f32>,
    chunks: usize,
) -> Result<()> {
    let k = "col_sums_finish".to_string();
    let cols = acc.len();
    need(&k, "chunk sums", part.len(), product(&k, chunks, cols)?)?;
    if chunks == 0 {
        return Ok(());
    }
    let (n, c) = (chunks as i64, int(&k, "cols", cols)?);
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(acc.slice_mut()).arg(part.slice()).arg(&n).arg(&c);
    // SAFETY: part is chunks x cols, acc is cols (checked, chunks >= 1);
    // arguments as col_sums_finish's.
    unsafe { fire(&mut a, per_item(cols), k) }
}

fn shape_err(kernel: &str, detail: String) -> GpuError {
    GpuError::Shape {
        kernel: kernel.to_string(),
        detail,
    }
}

/// `what` has `len` elements where the shape needs `want`.
fn need(kernel: &str, what: &str, len: usize, want: usize) -> Result<()> {
    if len == want {
        Ok(())
    } else {
        Err(shape_err(
            kernel,
            format!("{what} has {len} elements, the shape needs {want}"),
        ))
    }
}

/// The most an `int` size a kernel takes may be: its row loops step
/// `for (int c = threadIdx.x; c < n; c += blockDim.x)`, so `n` plus a
/// block (at most 1024 threads) must stay within `i32`.
const MAX_INT_ARG: usize = i32::MAX as usize - 1024;

/// `v` as a kernel's `int` argument, at most [`MAX_INT_ARG`].
fn int(kernel: &str, what: &str, v: usize) -> Result<i32> {
    if v > MAX_INT_ARG {
        return Err(shape_err(
            kernel,
            format!("{what} = {v} is past {MAX_INT_ARG} (i32, less a block)"),
        ));
    }
    i32::try_from(v).map_err(|_| shape_err(kernel, format!("{what} = {v} is past i32")))
}

/// Rows × cols as a product that cannot overflow.
fn product(kernel: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| shape_err(kernel, format!("{a} x {b} overflows")))
}

fn launch_err(entry: String) -> impl Fn(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver {
        call: "cuLaunchKernel",
        detail: format!("{entry}: {e}"),
    }
}

/// Launches `a` with `cfg`.
///
/// # Safety
/// As `LaunchArgs::launch`: the arguments pushed into `a` match the
/// kernel's parameters in type and order, and every buffer holds what the
/// kernel touches for the shape it is given.
unsafe fn fire(a: &mut cudarc::driver::LaunchArgs<'_>, cfg: LaunchConfig, k: String) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { a.launch(cfg) }.map_err(launch_err(k))?;
    Ok(())
}

/// [`fire`] with one block per row, and nothing for no rows: a grid is
/// never empty, so a launch over 0 rows would still run block 0, which
/// reads row 0 of its inputs and writes row 0 of its outputs (a
/// cross-entropy over no targets would write `loss_rows[0]` of an empty
/// buffer).
///
/// # Safety
/// As [`fire`]'s.
unsafe fn fire_rows(a: &mut cudarc::driver::LaunchArgs<'_>, rows: usize, k: String) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    // A grid has at most 2^31 - 1 blocks along x; `as u32` would cut
    // more rows to fewer blocks and leave the rest unwritten.
    int(&k, "rows (one block each)", rows)?;
    // SAFETY: the caller's contract.
    unsafe { fire(a, per_row(rows), k) }
}

/// Rows of `cols` in `what` (`len` elements, a whole number of rows).
fn rows_of(kernel: &str, what: &str, len: usize, cols: usize) -> Result<usize> {
    let rows = len / cols.max(1);
    need(kernel, what, len, product(kernel, rows, cols)?)?;
    Ok(rows)
}

/// The null device pointer, for an optional argument left out.
const NULL: u64 = 0;

/// `embedding_fwd`: `out[t] = table[ids[t]]` ([tokens, hidden] from
/// [vocab, hidden]).
pub fn embedding_fwd<T: Elem>(
    dev: &Device,
    out: &mut DeviceBuffer<T>,
    table: &DeviceBuffer<T>,
    ids: &DeviceBuffer<i32>,
    hidden: usize,
) -> Result<()> {
    let k = format!("embedding_fwd_{}", T::SUFFIX);
    let tokens = ids.len();
    let vocab = table.len() / hidden.max(1);
    need(&k, "table", table.len(), product(&k, vocab, hidden)?)?;
    need(&k, "out", out.len(), product(&k, tokens, hidden)?)?;
    let (t, h, v) = (
        int(&k, "tokens", tokens)?,
        int(&k, "hidden", hidden)?,
        int(&k, "vocab", vocab)?,
    );
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(out.slice_mut())
        .arg(table.slice())
        .arg(ids.slice())
        .arg(&t)
        .arg(&h)
        .arg(&v);
    // SAFETY: see the module docs: lengths checked above; the arguments are
    // embedding_fwd's (T*, const T*, const int*, int, int, int).
    unsafe { fire(&mut a, per_item(tokens * hidden), k) }
}

/// The host plan of `embedding_bwd` on the device
/// ([`crate::reference::embedding_runs`]).
#[derive(Debug)]
pub struct DeviceRuns {
    uniq: DeviceBuffer<i32>,
    starts: DeviceBuffer<i32>,
    order: DeviceBuffer<i32>,
    vocab: usize,
}

impl DeviceRuns {
    /// The runs of `ids` ([`crate::reference::embedding_runs`]: the
    /// distinct ids, each one's run of positions, the positions sorted by
    /// (id, position)) on `dev`, after every id is checked below `vocab`.
    /// Built here from the host's ids and nowhere else, so
    /// [`embedding_bwd`] can trust their contents: every start within the
    /// positions, every position a token's, every id a row of the table.
    pub fn new(dev: &Device, ids: &[i32], vocab: usize) -> Result<Self> {
        if let Some(bad) = ids.iter().find(|&&i| i < 0 || i as usize >= vocab) {
            return Err(shape_err(
                "embedding_bwd",
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        let runs = crate::reference::embedding_runs(ids);
        Ok(DeviceRuns {
            uniq: dev.upload("embedding runs", &runs.uniq)?,
            starts: dev.upload("embedding runs", &runs.starts)?,
            order: dev.upload("embedding runs", &runs.order)?,
            vocab,
        })
    }
}

/// `embedding_bwd`: `grad_table[id] += Σ grad_out` over the id's tokens
/// (fp32 [vocab, hidden]).
pub fn embedding_bwd<T: Elem>(
    dev: &Device,
    grad_table: &mut DeviceBuffer<f32>,
    grad_out: &DeviceBuffer<T>,
    runs: &DeviceRuns,
    vocab: usize,
    hidden: usize,
) -> Result<()> {
    let k = format!("embedding_bwd_{}", T::SUFFIX);
    if runs.vocab != vocab {
        return Err(shape_err(
            &k,
            format!(
                "runs of ids below {} for a table of {vocab} rows",
                runs.vocab
            ),
        ));
    }
    let n_uniq = runs.uniq.len();
    need(&k, "starts", runs.starts.len(), n_uniq + 1)?;
    need(
        &k,
        "grad_out",
        grad_out.len(),
        product(&k, runs.order.len(), hidden)?,
    )?;
    need(
        &k,
        "grad_table",
        grad_table.len(),
        product(&k, vocab, hidden)?,
    )?;
    let (u, h) = (int(&k, "distinct ids", n_uniq)?, int(&k, "hidden", hidden)?);
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(grad_table.slice_mut())
        .arg(grad_out.slice())
        .arg(runs.uniq.slice())
        .arg(runs.starts.slice())
        .arg(runs.order.slice())
        .arg(&u)
        .arg(&h);
    // SAFETY: lengths checked above; the runs' contents are
    // `reference::embedding_runs` of ids below `vocab` (DeviceRuns::new,
    // their only constructor): starts within `order`, positions below
    // its length (grad_out's rows), ids below `vocab` (grad_table's
    // rows); arguments as embedding_bwd's signature.
    unsafe { fire(&mut a, per_item(n_uniq * hidden), k) }
}

/// LayerNorm's forward outputs: `y`, and each row's mean and 1/std.
#[derive(Debug)]
pub struct NormOut<'a, T> {
    /// [rows, cols].
    pub y: &'a mut DeviceBuffer<T>,
    /// `[rows]` (LayerNorm only; RMSNorm ignores it).
    pub mean: Option<&'a mut DeviceBuffer<f32>>,
    /// `[rows]`.
    pub rstd: &'a mut DeviceBuffer<f32>,
}

/// `layernorm_fwd` over rows of `cols`.
pub fn layernorm_fwd<T: Elem>(
    dev: &Device,
    out: NormOut<'_, T>,
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    b: Option<&DeviceBuffer<T>>,
    cols: usize,
    eps: f32,
) -> Result<()> {
    let k = format!("layernorm_fwd_{}", T::SUFFIX);
    let rows = rows_of(&k, "x", x.len(), cols)?;
    need(&k, "y", out.y.len(), x.len())?;
    need(&k, "w", w.len(), cols)?;
    if let Some(b) = b {
        need(&k, "b", b.len(), cols)?;
    }
    let mean = out
        .mean
        .ok_or_else(|| shape_err(&k, "LayerNorm needs its mean buffer".into()))?;
    need(&k, "mean", mean.len(), rows)?;
    need(&k, "rstd", out.rstd.len(), rows)?;
    let c = int(&k, "cols", cols)?;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(out.y.slice_mut())
        .arg(mean.slice_mut())
        .arg(out.rstd.slice_mut())
        .arg(x.slice())
        .arg(w.slice());
    match b {
        Some(b) => a.arg(b.slice()),
        None => a.arg(&NULL),
    };
    a.arg(&c).arg(&eps);
    // SAFETY: lengths checked above; arguments as layernorm_fwd's.
    unsafe { fire_rows(&mut a, rows, k) }
}

/// A norm's saved statistics, for backward.
#[derive(Debug, Clone, Copy)]
pub struct NormStats<'a> {
    /// Each row's mean (LayerNorm).
    pub mean: Option<&'a DeviceBuffer<f32>>,
    /// Each row's 1/std (1/rms for RMSNorm).
    pub rstd: &'a DeviceBuffer<f32>,
}

/// `layernorm_bwd_dx`.
pub fn layernorm_bwd_dx<T: Elem>(
    dev: &Device,
    dx: &mut DeviceBuffer<T>,
    dy: &DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    stats: NormStats<'_>,
    cols: usize,
) -> Result<()> {
    let k = format!("layernorm_bwd_dx_{}", T::SUFFIX);
    let rows = rows_of(&k, "x", x.len(), cols)?;
    need(&k, "dx", dx.len(), x.len())?;
    need(&k, "dy", dy.len(), x.len())?;
    need(&k, "w", w.len(), cols)?;
    let mean = stats
        .mean
        .ok_or_else(|| shape_err(&k, "LayerNorm needs its mean".into()))?;
    need(&k, "mean", mean.len(), rows)?;
    need(&k, "rstd", stats.rstd.len(), rows)?;
    let c = int(&k, "cols", cols)?;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(dx.slice_mut())
        .arg(dy.slice())
        .arg(x.slice())
        .arg(w.slice())
        .arg(mean.slice())
        .arg(stats.rstd.slice())
        .arg(&c);
    // SAFETY: lengths checked above; arguments as layernorm_bwd_dx's.
    unsafe { fire_rows(&mut a, rows, k) }
}

/// `layernorm_bwd_wb`: `dw += Σ dy·xhat`, `db += Σ dy` (fp32, `[cols]`),
/// column sums in two passes (the chunks' sums, then `col_sums_finish`).
pub fn layernorm_bwd_wb<T: Elem>(
    dev: &Device,
    dw: &mut DeviceBuffer<f32>,
    db: Option<&mut DeviceBuffer<f32>>,
    dy: &DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    stats: NormStats<'_>,
    cols: usize,
) -> Result<()> {
    let k = format!("layernorm_bwd_wb_{}", T::SUFFIX);
    let rows = rows_of(&k, "x", x.len(), cols)?;
    need(&k, "dy", dy.len(), x.len())?;
    need(&k, "dw", dw.len(), cols)?;
    let mean = stats
        .mean
        .ok_or_else(|| shape_err(&k, "LayerNorm needs its mean".into()))?;
    need(&k, "mean", mean.len(), rows)?;
    need(&k, "rstd", stats.rstd.len(), rows)?;
    if let Some(db) = &db {
        need(&k, "db", db.len(), cols)?;
    }
    if rows == 0 {
        return Ok(());
    }
    let (r, c, chunk) = (rows as i64, int(&k, "cols", cols)?, ROW_CHUNK as i32);
    let (chunks, mut part_w) = chunk_sums(dev, "layernorm weight gradient chunks", rows, cols)?;
    let mut part_b = if db.is_some() {
        Some(chunk_sums(dev, "layernorm bias gradient chunks", rows, cols)?.1)
    } else {
        None
    };
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(part_w.slice_mut());
    match part_b.as_mut() {
        Some(p) => a.arg(p.slice_mut()),
        None => a.arg(&NULL),
    };
    a.arg(dy.slice())
        .arg(x.slice())
        .arg(mean.slice())
        .arg(stats.rstd.slice())
        .arg(&r)
        .arg(&c)
        .arg(&chunk);
    // SAFETY: lengths checked above (the chunk sums are chunks x cols, the
    // kernel's `ceil(rows / chunk_rows) x cols`); arguments as
    // layernorm_bwd_wb's.
    unsafe { fire(&mut a, per_col_chunk(cols, chunks), k) }?;
    col_sums_finish(dev, dw, &part_w, chunks)?;
    match (db, &part_b) {
        (Some(db), Some(p)) => col_sums_finish(dev, db, p, chunks),
        _ => Ok(()),
    }
}

/// `rmsnorm_fwd` (`out.mean` unused).
pub fn rmsnorm_fwd<T: Elem>(
    dev: &Device,
    out: NormOut<'_, T>,
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    cols: usize,
    eps: f32,
) -> Result<()> {
    let k = format!("rmsnorm_fwd_{}", T::SUFFIX);
    let rows = rows_of(&k, "x", x.len(), cols)?;
    need(&k, "y", out.y.len(), x.len())?;
    need(&k, "w", w.len(), cols)?;
    need(&k, "rstd", out.rstd.len(), rows)?;
    let c = int(&k, "cols", cols)?;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(out.y.slice_mut())
        .arg(out.rstd.slice_mut())
        .arg(x.slice())
        .arg(w.slice())
        .arg(&c)
        .arg(&eps);
    // SAFETY: lengths checked above; arguments as rmsnorm_fwd's.
    unsafe { fire_rows(&mut a, rows, k) }
}

/// `rmsnorm_bwd_dx`.
pub fn rmsnorm_bwd_dx<T: Elem>(
    dev: &Device,
    dx: &mut DeviceBuffer<T>,
    dy: &DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    rstd: &DeviceBuffer<f32>,
    cols: usize,
) -> Result<()> {
    let k = format!("rmsnorm_bwd_dx_{}", T::SUFFIX);
    let rows = rows_of(&k, "x", x.len(), cols)?;
    need(&k, "dx", dx.len(), x.len())?;
    need(&k, "dy", dy.len(), x.len())?;
    need(&k, "w", w.len(), cols)?;
    need(&k, "rstd", rstd.len(), rows)?;
    let c = int(&k, "cols", cols)?;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(dx.slice_mut())
        .arg(dy.slice())
        .arg(x.slice())
        .arg(w.slice())
        .arg(rstd.slice())
        .arg(&c);
    // SAFETY: lengths checked above; arguments as rmsnorm_bwd_dx's.
    unsafe { fire_rows(&mut a, rows, k) }
}

/// `rmsnorm_bwd_w`: `dw += Σ dy·xhat`, a column sum in two passes.
pub fn rmsnorm_bwd_w<T: Elem>(
    dev: &Device,
    dw: &mut DeviceBuffer<f32>,
    dy: &DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    rstd: &DeviceBuffer<f32>,
    cols: usize,
) -> Result<()> {
    let k = format!("rmsnorm_bwd_w_{}", T::SUFFIX);
    let rows = rows_of(&k, "x", x.len(), cols)?;
    need(&k, "dy", dy.len(), x.len())?;
    need(&k, "dw", dw.len(), cols)?;
    need(&k, "rstd", rstd.len(), rows)?;
    if rows == 0 {
        return Ok(());
    }
    let (r, c, chunk) = (rows as i64, int(&k, "cols", cols)?, ROW_CHUNK as i32);
    let (chunks, mut part) = chunk_sums(dev, "rmsnorm weight gradient chunks", rows, cols)?;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(part.slice_mut())
        .arg(dy.slice())
        .arg(x.slice())
        .arg(rstd.slice())
        .arg(&r)
        .arg(&c)
        .arg(&chunk);
    // SAFETY: lengths checked above (the chunk sums are chunks x cols);
    // arguments as rmsnorm_bwd_w's.
    unsafe { fire(&mut a, per_col_chunk(cols, chunks), k) }?;
    col_sums_finish(dev, dw, &part, chunks)
}

/// `rope`: `y` = `x` rotated by `sign`·θ ([batch, seq, heads, head_dim];
/// `cos`, `sin` [seq, head_dim / 2]).
pub fn rope<T: Elem>(
    dev: &Device,
    y: &mut DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
    s: RopeShape,
    sign: f32,
) -> Result<()> {
    let k = format!("rope_{}", T::SUFFIX);
    if !s.head_dim.is_multiple_of(2) {
        return Err(shape_err(&k, format!("head_dim {} is odd", s.head_dim)));
    }
    let n = product(
        &k,
        product(&k, s.batch, s.seq)?,
        product(&k, s.heads, s.head_dim)?,
    )?;
    need(&k, "x", x.len(), n)?;
    need(&k, "y", y.len(), n)?;
    need(&k, "cos", cos.len(), product(&k, s.seq, s.head_dim / 2)?)?;
    need(&k, "sin", sin.len(), cos.len())?;
    let (b, t, h, d) = (
        int(&k, "batch", s.batch)?,
        int(&k, "seq", s.seq)?,
        int(&k, "heads", s.heads)?,
        int(&k, "head_dim", s.head_dim)?,
    );
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(y.slice_mut())
        .arg(x.slice())
        .arg(cos.slice())
        .arg(sin.slice())
        .arg(&b)
        .arg(&t)
        .arg(&h)
        .arg(&d)
        .arg(&sign);
    // SAFETY: lengths checked above; arguments as rope's.
    unsafe { fire(&mut a, per_item(n / 2), k) }
}

/// `softmax_causal_fwd` over rows of `seq` scores.
pub fn softmax_causal_fwd<T: Elem>(
    dev: &Device,
    p: &mut DeviceBuffer<T>,
    s: &DeviceBuffer<T>,
    seq: usize,
    scale: f32,
) -> Result<()> {
    let k = format!("softmax_causal_fwd_{}", T::SUFFIX);
    let rows = rows_of(&k, "scores", s.len(), seq)?;
    need(&k, "p", p.len(), s.len())?;
    let t = int(&k, "seq", seq)?;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(p.slice_mut()).arg(s.slice()).arg(&t).arg(&scale);
    // SAFETY: lengths checked above; arguments as softmax_causal_fwd's.
    unsafe { fire_rows(&mut a, rows, k) }
}

/// `softmax_bwd`.
pub fn softmax_bwd<T: Elem>(
    dev: &Device,
    ds: &mut DeviceBuffer<T>,
    p: &DeviceBuffer<T>,
    dp: &DeviceBuffer<T>,
    seq: usize,
    scale: f32,
) -> Result<()> {
    let k = format!("softmax_bwd_{}", T::SUFFIX);
    let rows = rows_of(&k, "p", p.len(), seq)?;
    need(&k, "dp", dp.len(), p.len())?;
    need(&k, "ds", ds.len(), p.len())?;
    let t = int(&k, "seq", seq)?;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(ds.slice_mut())
        .arg(p.slice())
        .arg(dp.slice())
        .arg(&t)
        .arg(&scale);
    // SAFETY: lengths checked above; arguments as softmax_bwd's.
    unsafe { fire_rows(&mut a, rows, k) }
}

/// A pointwise kernel: `entry_T(out, ins..., n)` over equal-length buffers.
fn pointwise<T: Elem>(
    dev: &Device,
    name: &str,
    outs: &mut [&mut DeviceBuffer<T>],
    ins: &[&DeviceBuffer<T>],
) -> Result<()> {
    let k = format!("{name}_{}", T::SUFFIX);
    let n = outs.first().map_or(0, |o| o.len());
    for (i, o) in outs.iter().enumerate() {
        need(&k, &format!("output {i}"), o.len(), n)?;
    }
    for (i, b) in ins.iter().enumerate() {
        need(&k, &format!("input {i}"), b.len(), n)?;
    }
    let n64 = n as i64;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    for o in outs.iter_mut() {
        a.arg(o.slice_mut());
    }
    for b in ins {
        a.arg(b.slice());
    }
    a.arg(&n64);
    // SAFETY: every buffer has the n elements the kernel touches (checked
    // above); the callers below pass the outputs then the inputs in the
    // order of the kernel's signature (activation.cu, layout.cu), then n as
    // long long.
    unsafe { fire(&mut a, per_item(n), k) }
}

/// `gelu_tanh_fwd`.
pub fn gelu_tanh_fwd<T: Elem>(
    dev: &Device,
    y: &mut DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
) -> Result<()> {
    pointwise(dev, "gelu_tanh_fwd", &mut [y], &[x])
}

/// `gelu_tanh_bwd`.
pub fn gelu_tanh_bwd<T: Elem>(
    dev: &Device,
    dx: &mut DeviceBuffer<T>,
    dy: &DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
) -> Result<()> {
    pointwise(dev, "gelu_tanh_bwd", &mut [dx], &[dy, x])
}

/// `swiglu_fwd`.
pub fn swiglu_fwd<T: Elem>(
    dev: &Device,
    y: &mut DeviceBuffer<T>,
    gate: &DeviceBuffer<T>,
    up: &DeviceBuffer<T>,
) -> Result<()> {
    pointwise(dev, "swiglu_fwd", &mut [y], &[gate, up])
}

/// `swiglu_bwd`.
pub fn swiglu_bwd<T: Elem>(
    dev: &Device,
    dgate: &mut DeviceBuffer<T>,
    dup: &mut DeviceBuffer<T>,
    dy: &DeviceBuffer<T>,
    gate: &DeviceBuffer<T>,
    up: &DeviceBuffer<T>,
) -> Result<()> {
    pointwise(dev, "swiglu_bwd", &mut [dgate, dup], &[dy, gate, up])
}

/// `bias_add`: `y[r, c] += b[c]` in place.
pub fn bias_add<T: Elem>(dev: &Device, y: &mut DeviceBuffer<T>, b: &DeviceBuffer<T>) -> Result<()> {
    let k = format!("bias_add_{}", T::SUFFIX);
    let cols = b.len();
    let rows = rows_of(&k, "y", y.len(), cols)?;
    let (r, c) = (rows as i64, int(&k, "cols", cols)?);
    let cfg = per_item(y.len());
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(y.slice_mut()).arg(b.slice()).arg(&r).arg(&c);
    // SAFETY: y is rows x cols, b is cols (checked); arguments as bias_add's.
    unsafe { fire(&mut a, cfg, k) }
}

/// `bias_grad`: `db[c] += Σ_rows dy[r, c]`, a column sum in two passes.
pub fn bias_grad<T: Elem>(
    dev: &Device,
    db: &mut DeviceBuffer<f32>,
    dy: &DeviceBuffer<T>,
) -> Result<()> {
    let k = format!("bias_grad_{}", T::SUFFIX);
    let cols = db.len();
    let rows = rows_of(&k, "dy", dy.len(), cols)?;
    if rows == 0 {
        return Ok(());
    }
    let (r, c, chunk) = (rows as i64, int(&k, "cols", cols)?, ROW_CHUNK as i32);
    let (chunks, mut part) = chunk_sums(dev, "bias gradient chunks", rows, cols)?;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(part.slice_mut())
        .arg(dy.slice())
        .arg(&r)
        .arg(&c)
        .arg(&chunk);
    // SAFETY: dy is rows x cols, the chunk sums chunks x cols (checked);
    // arguments as bias_grad's.
    unsafe { fire(&mut a, per_col_chunk(cols, chunks), k) }?;
    col_sums_finish(dev, db, &part, chunks)
}

/// `cross_entropy` over rows of `vocab` logits: per-row losses, and with
/// `dlogits` the logits' gradient times `grad_scale`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy<T: Elem>(
    dev: &Device,
    loss_rows: &mut DeviceBuffer<f32>,
    dlogits: Option<&mut DeviceBuffer<T>>,
    logits: &DeviceBuffer<T>,
    targets: &DeviceBuffer<i32>,
    vocab: usize,
    ignore_index: i32,
    grad_scale: f32,
) -> Result<()> {
    let k = format!("cross_entropy_{}", T::SUFFIX);
    let rows = targets.len();
    need(&k, "logits", logits.len(), product(&k, rows, vocab)?)?;
    need(&k, "loss_rows", loss_rows.len(), rows)?;
    let v = int(&k, "vocab", vocab)?;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(loss_rows.slice_mut());
    match dlogits {
        Some(d) => {
            need(&k, "dlogits", d.len(), logits.len())?;
            a.arg(d.slice_mut())
        }
        None => a.arg(&NULL),
    };
    a.arg(logits.slice())
        .arg(targets.slice())
        .arg(&v)
        .arg(&ignore_index)
        .arg(&grad_scale);
    // SAFETY: lengths checked above; arguments as cross_entropy's.
    unsafe { fire_rows(&mut a, rows, k) }
}

/// `sum_f32`: `out[0] = Σ x` (one block).
pub fn sum_f32(dev: &Device, out: &mut DeviceBuffer<f32>, x: &DeviceBuffer<f32>) -> Result<()> {
    let k = "sum_f32".to_string();
    need(&k, "out", out.len(), 1)?;
    let n = x.len() as i64;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(out.slice_mut()).arg(x.slice()).arg(&n);
    // SAFETY: out has 1 element, x has n; arguments as sum_f32's.
    unsafe { fire(&mut a, per_row(1), k) }
}

/// The `cast_S_D` kernels.
pub fn cast<S: Elem, D: Elem>(
    dev: &Device,
    dst: &mut DeviceBuffer<D>,
    src: &DeviceBuffer<S>,
) -> Result<()> {
    let k = format!("cast_{}_{}", S::SUFFIX, D::SUFFIX);
    need(&k, "dst", dst.len(), src.len())?;
    let n = src.len() as i64;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(dst.slice_mut()).arg(src.slice()).arg(&n);
    // SAFETY: equal lengths (checked); arguments as cast's (D*, const S*, long long).
    unsafe { fire(&mut a, per_item(src.len()), k) }
}

/// `sumsq_parts`: every part's Σ x² of `groups`, in plan order, into
/// `out` (one f64 per part: [`NormPlan::total_parts`]), in the host
/// optimizer's order ([`crate::norm`]). The plan is checked on the host
/// (every segment inside its group and its buffer) and goes up as two
/// tables: the parts, and each segment's address, length and flat start;
/// the caller adds the parts ([`crate::norm::fold_groups`]).
pub fn sumsq_parts(
    dev: &Device,
    out: &mut DeviceBuffer<f64>,
    groups: &[NormGroup<'_, DeviceBuffer<f32>>],
) -> Result<NormPlan> {
    let plan = NormPlan::new(groups, DeviceBuffer::len)?;
    launch_sumsq_parts(dev, out, groups, &plan)?;
    Ok(plan)
}

/// Each group's Σ x² ([`crate::norm`]'s order): [`sumsq_parts`] into a
/// buffer of its own, downloaded and folded, the plan made once.
pub fn norm_sq_sums(dev: &Device, groups: &[NormGroup<'_, DeviceBuffer<f32>>]) -> Result<Vec<f64>> {
    let plan = NormPlan::new(groups, DeviceBuffer::len)?;
    let n_parts = plan.total_parts();
    if n_parts == 0 {
        return Ok(vec![0.0; groups.len()]);
    }
    let mut out = dev.alloc_zeros::<f64>("sums of squares", n_parts)?;
    launch_sumsq_parts(dev, &mut out, groups, &plan)?;
    Ok(crate::norm::fold_groups(&plan, &dev.download(&out)?))
}

/// The `sumsq_parts` launch for `plan`, which [`NormPlan::new`] made
/// from these `groups` (its addresses are safe for them only).
fn launch_sumsq_parts(
    dev: &Device,
    out: &mut DeviceBuffer<f64>,
    groups: &[NormGroup<'_, DeviceBuffer<f32>>],
    plan: &NormPlan,
) -> Result<()> {
    use cudarc::driver::DevicePtr;
    let k = "sumsq_parts".to_string();
    let n_parts = plan.total_parts();
    need(&k, "out", out.len(), n_parts)?;
    if n_parts == 0 {
        return Ok(());
    }
    let stream = &dev.compute;
    // Each segment's address; its guard records the kernel's read on the
    // compute stream when it drops, after the launch.
    let mut guards = Vec::with_capacity(plan.segments.len());
    let mut segs = Vec::with_capacity(3 * plan.segments.len());
    for &(gi, si) in &plan.segments {
        let s = &groups[gi].segments[si];
        let (ptr, guard) = s.buf.slice().device_ptr(stream);
        guards.push(guard);
        let addr = ptr + (s.offset * std::mem::size_of::<f32>()) as u64;
        segs.extend([addr as i64, s.numel as i64, s.flat_start as i64]);
    }
    let parts = dev.upload("sum of squares parts", &plan.parts)?;
    let segs = dev.upload("sum of squares segments", &segs)?;
    let n = n_parts as i64;
    let mut a = stream.launch_builder(dev.function(&k)?);
    a.arg(out.slice_mut())
        .arg(parts.slice())
        .arg(&n)
        .arg(segs.slice());
    // SAFETY: out has one f64 per part (checked); `parts` and `segs` are
    // the plan's tables, whose every segment lies inside its buffer (each
    // address is its buffer's plus an offset with `numel` elements after
    // it: NormPlan::new checked both) and whose parts name only their
    // group's segments; the buffers are borrowed for this call and their
    // guards, held until after the launch, order it with their other uses
    // (cudarc's events). The kernel reads no element past a segment.
    // Arguments as sumsq_parts's (double*, const long long*, long long,
    // const long long*).
    unsafe { fire(&mut a, per_item(n_parts.saturating_mul(NORM_LANES)), k) }?;
    drop(guards);
    Ok(())
}

/// The state `adamw` steps.
#[derive(Debug)]
pub struct AdamState<'a> {
    /// fp32 master weights.
    pub master: &'a mut DeviceBuffer<f32>,
    /// First moments.
    pub m: &'a mut DeviceBuffer<f32>,
    /// Second moments.
    pub v: &'a mut DeviceBuffer<f32>,
}

/// `adamw`: one step of every element; `out` (optional) gets the new
/// params in `T`.
pub fn adamw<T: Elem>(
    dev: &Device,
    st: AdamState<'_>,
    grad: &DeviceBuffer<f32>,
    out: Option<&mut DeviceBuffer<T>>,
    s: AdamScalars,
) -> Result<()> {
    let k = format!("adamw_{}", T::SUFFIX);
    let n = st.master.len();
    need(&k, "m", st.m.len(), n)?;
    need(&k, "v", st.v.len(), n)?;
    need(&k, "grad", grad.len(), n)?;
    let n64 = n as i64;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(st.master.slice_mut())
        .arg(st.m.slice_mut())
        .arg(st.v.slice_mut())
        .arg(grad.slice());
    match out {
        Some(o) => {
            need(&k, "out", o.len(), n)?;
            a.arg(o.slice_mut())
        }
        None => a.arg(&NULL),
    };
    a.arg(&n64)
        .arg(&s.grad_scale)
        .arg(&s.beta1)
        .arg(&s.one_minus_beta1)
        .arg(&s.beta2)
        .arg(&s.one_minus_beta2)
        .arg(&s.eps)
        .arg(&s.neg_step_size)
        .arg(&s.inv_sqrt_bc2)
        .arg(&s.neg_lr_wd);
    // SAFETY: lengths checked above; arguments as adamw's.
    unsafe { fire(&mut a, per_item(n), k) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel's `int` size leaves room for one more block's step of its
    /// row loops (`c += blockDim.x`), which past it would overflow.
    #[test]
    fn int_sizes_leave_a_block_of_room_in_i32() {
        assert_eq!(int("k", "cols", 0).ok(), Some(0));
        assert_eq!(int("k", "cols", MAX_INT_ARG).ok(), Some(MAX_INT_ARG as i32));
        for v in [MAX_INT_ARG + 1, i32::MAX as usize, usize::MAX] {
            let e = int("k", "cols", v).err().map(|e| e.to_string());
            assert!(
                e.as_deref().is_some_and(|e| e.contains("cols")),
                "{v}: {e:?}"
            );
        }
    }
}
