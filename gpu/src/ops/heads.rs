//! Moves between a block's row layout and its attention heads (and the
//! grouped-query K/V repeats and their sums), and the elementwise add
//! (see the [`super`] docs: every length checked before the launch).

use super::*;

fn heads_args(k: &str, s: HeadsShape, slot: usize) -> Result<[i32; 6]> {
    if slot >= s.slots {
        return Err(shape_err(k, format!("slot {slot} of {} slots", s.slots)));
    }
    Ok([
        int(k, "batch", s.batch)?,
        int(k, "seq", s.seq)?,
        int(k, "heads", s.heads)?,
        int(k, "head_dim", s.head_dim)?,
        int(k, "slots", s.slots)?,
        int(k, "slot", slot)?,
    ])
}

/// `heads_from_rows` (`to_heads`) or `rows_from_heads`: one slot of rows
/// to heads or back.
fn heads_move<T: Elem>(
    dev: &Device,
    out: &mut DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    s: HeadsShape,
    slot: usize,
    to_heads: bool,
) -> Result<()> {
    let name = if to_heads {
        "heads_from_rows"
    } else {
        "rows_from_heads"
    };
    let k = format!("{name}_{}", T::SUFFIX);
    // Checked: a wrapped product would pass the length checks below.
    let n = product(
        &k,
        product(&k, product(&k, s.batch, s.heads)?, s.seq)?,
        s.head_dim,
    )?;
    let (heads, rows) = if to_heads {
        (out.len(), x.len())
    } else {
        (x.len(), out.len())
    };
    need(&k, "the heads", heads, n)?;
    need(&k, "the rows", rows, product(&k, n, s.slots)?)?;
    let args = heads_args(&k, s, slot)?;
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(out.slice_mut()).arg(x.slice());
    for v in &args {
        a.arg(v);
    }
    // SAFETY: the heads buffer holds one slot's heads and the rows buffer
    // every slot's rows (checked); both kernels take (T* out, const T* x,
    // int batch, seq, heads, head_dim, slots, slot).
    unsafe { fire(&mut a, per_item(n), k) }
}

/// `heads_from_rows`: slot `slot` of `x` (rows) into `out` (heads).
pub fn heads_from_rows<T: Elem>(
    dev: &Device,
    out: &mut DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    s: HeadsShape,
    slot: usize,
) -> Result<()> {
    heads_move(dev, out, x, s, slot, true)
}

/// `rows_from_heads`: `x` (heads) into slot `slot` of `out` (rows).
pub fn rows_from_heads<T: Elem>(
    dev: &Device,
    out: &mut DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    s: HeadsShape,
    slot: usize,
) -> Result<()> {
    heads_move(dev, out, x, s, slot, false)
}

/// `add`: `y = a + b`.
pub fn add<T: Elem>(
    dev: &Device,
    y: &mut DeviceBuffer<T>,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
) -> Result<()> {
    pointwise(dev, "add", &mut [y], &[a, b])
}

/// `repeat_kv` (`expand`) or `sum_kv`.
fn kv_move<T: Elem>(
    dev: &Device,
    out: &mut DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    s: KvShape,
    expand: bool,
) -> Result<()> {
    let name = if expand { "repeat_kv" } else { "sum_kv" };
    let k = format!("{name}_{}", T::SUFFIX);
    let kv = product(&k, product(&k, s.batch, s.kv_heads)?, s.n)?;
    let all = product(&k, kv, s.group)?;
    let (o, i) = if expand { (all, kv) } else { (kv, all) };
    need(&k, "out", out.len(), o)?;
    need(&k, "x", x.len(), i)?;
    let (b, h, g, n) = (
        int(&k, "batch", s.batch)?,
        int(&k, "kv_heads", s.kv_heads)?,
        int(&k, "group", s.group)?,
        s.n as i64,
    );
    let mut a = dev.compute.launch_builder(dev.function(&k)?);
    a.arg(out.slice_mut())
        .arg(x.slice())
        .arg(&b)
        .arg(&h)
        .arg(&g)
        .arg(&n);
    // SAFETY: out and x hold the two layouts' elements (checked); both
    // kernels take (T*, const T*, int batch, int kv_heads, int group,
    // long long n).
    unsafe { fire(&mut a, per_item(o), k) }
}

/// `repeat_kv`: [batch, kv_heads, n] to [batch, kv_heads · group, n].
pub fn repeat_kv<T: Elem>(
    dev: &Device,
    out: &mut DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    s: KvShape,
) -> Result<()> {
    kv_move(dev, out, x, s, true)
}

/// `sum_kv`: the way back, summing each group.
pub fn sum_kv<T: Elem>(
    dev: &Device,
    out: &mut DeviceBuffer<T>,
    x: &DeviceBuffer<T>,
    s: KvShape,
) -> Result<()> {
    kv_move(dev, out, x, s, false)
}
