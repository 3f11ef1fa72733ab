//! The device check's 16-bit param checks ([`check_params16`]), a part of
//! `kernel_check`.

use half::{bf16, f16};
use tierzero_gpu::device::Device;
use tierzero_gpu::ops::MatmulShape;
use tierzero_gpu::reference as r;
use tierzero_gpu::unit::{CudaExec, DevBuf, Exec, GemmDtype};
use tierzero_gpu::Result;

use super::{data, Report};

/// Params kept in bf16 or fp16 on the device (`DevBuf::Bf16`,
/// `DevBuf::F16`, as the engine's links keep a 16-bit upload) give the
/// units the same bits as the same values in fp32: the GEMMs of their
/// dtype read them as they are (others widened), the other kernels
/// through an exact widening, and the device optimizer's rounding writes
/// bf16 ones directly. Reported as `param16.*`.
pub(super) fn check_params16(dev: &Device, rep: &mut Report) -> Result<()> {
    let same = |rep: &mut Report, what: &str, size: &str, a: Vec<f32>, b: Vec<f32>| {
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        let ok = a.len() == b.len() && !a.is_empty() && differ == 0;
        rep.check(
            &format!("param16.{what}"),
            size,
            ok,
            &format!(
                "{differ} of {} elements differ from an fp32 param's",
                a.len()
            ),
        );
    };
    let (rows, cols, out) = (37usize, 129usize, 65usize);
    let w16: Vec<bf16> = r::cast(&data(cols * out, 70));
    let w32: Vec<f32> = r::cast(&w16);
    let x = data(rows * cols, 71);
    let narrow = |v: &[f32]| -> Result<DevBuf> {
        Ok(DevBuf::Bf16(
            dev.upload("bf16 param", &r::cast::<f32, bf16>(v))?,
        ))
    };
    let wide = |v: &[f32]| -> Result<DevBuf> { Ok(DevBuf::F32(dev.upload("fp32 param", v)?)) };
    let size = format!("{rows}x{out}x{cols}");
    for gemm in [GemmDtype::F32, GemmDtype::Bf16, GemmDtype::F16] {
        let got = gemm_out(dev, gemm, &x, narrow(&w32)?, (rows, out, cols))?;
        let want = gemm_out(dev, gemm, &x, wide(&w32)?, (rows, out, cols))?;
        same(rep, &format!("matmul_{gemm:?}"), &size, got, want);
    }
    let e = CudaExec {
        dev,
        gemm: GemmDtype::Bf16,
    };
    let gx = e.upload("x", &x)?;
    let (g16, b16): (Vec<bf16>, Vec<bf16>) = (r::cast(&data(cols, 72)), r::cast(&data(cols, 73)));
    let (g, b): (Vec<f32>, Vec<f32>) = (r::cast(&g16), r::cast(&b16));
    let size = format!("{rows}x{cols}");
    let [y1, mean, rstd] = e.layernorm_fwd(&gx, &narrow(&g)?, &narrow(&b)?, cols, 1e-5)?;
    let [y2, ..] = e.layernorm_fwd(&gx, &wide(&g)?, &wide(&b)?, cols, 1e-5)?;
    same(
        rep,
        "layernorm_fwd",
        &size,
        e.download(&y1)?,
        e.download(&y2)?,
    );
    let dy = e.upload("dy", &data(rows * cols, 76))?;
    let mut back = Vec::new();
    for w in [narrow(&g)?, wide(&g)?] {
        let (mut dw, mut db) = (e.zeros("dw", cols)?, e.zeros("db", cols)?);
        let dx = e.layernorm_bwd(&dy, &gx, &w, [&mean, &rstd], &mut dw, &mut db, cols)?;
        back.push((e.download(&dx)?, e.download(&dw)?));
    }
    let (dx2, dw2) = back.pop().unwrap_or_default();
    let (dx1, dw1) = back.pop().unwrap_or_default();
    same(rep, "layernorm_bwd.dx", &size, dx1, dx2);
    same(rep, "layernorm_bwd.dw", &size, dw1, dw2);
    let [y1, rstd] = e.rmsnorm_fwd(&gx, &narrow(&g)?, cols, 1e-6)?;
    let [y2, _] = e.rmsnorm_fwd(&gx, &wide(&g)?, cols, 1e-6)?;
    same(
        rep,
        "rmsnorm_fwd",
        &size,
        e.download(&y1)?,
        e.download(&y2)?,
    );
    let mut back = Vec::new();
    for w in [narrow(&g)?, wide(&g)?] {
        let mut dw = e.zeros("dw", cols)?;
        let dx = e.rmsnorm_bwd(&dy, &gx, &w, &rstd, &mut dw, cols)?;
        back.push(e.download(&dx)?);
    }
    let dx2 = back.pop().unwrap_or_default();
    same(
        rep,
        "rmsnorm_bwd.dx",
        &size,
        back.pop().unwrap_or_default(),
        dx2,
    );
    let (mut y1, mut y2) = (e.upload("y", &x)?, e.upload("y", &x)?);
    e.bias_add(&mut y1, &narrow(&b)?)?;
    e.bias_add(&mut y2, &wide(&b)?)?;
    same(rep, "bias_add", &size, e.download(&y1)?, e.download(&y2)?);
    let vocab = 101;
    let table: Vec<f32> = r::cast(&r::cast::<f32, bf16>(&data(vocab * cols, 74)));
    let ids: Vec<i32> = (0..rows).map(|i| ((i * 37) % vocab) as i32).collect();
    let gids = e.ids(&ids, vocab)?;
    let y1 = e.embedding_fwd(&narrow(&table)?, &gids, cols)?;
    let y2 = e.embedding_fwd(&wide(&table)?, &gids, cols)?;
    same(
        rep,
        "embedding_fwd",
        &format!("{rows} of {vocab}x{cols}"),
        e.download(&y1)?,
        e.download(&y2)?,
    );
    // fp16 params (fp16 storage) the same way: kept in fp16, read as they
    // are by fp16 GEMMs, widened by the rest.
    let h16: Vec<f16> = r::cast(&data(cols * out, 77));
    let h32: Vec<f32> = r::cast(&h16);
    let half16 = |v: &[f32]| -> Result<DevBuf> {
        Ok(DevBuf::F16(
            dev.upload("fp16 param", &r::cast::<f32, f16>(v))?,
        ))
    };
    let size = format!("{rows}x{out}x{cols}");
    for gemm in [GemmDtype::F32, GemmDtype::F16] {
        let got = gemm_out(dev, gemm, &x, half16(&h32)?, (rows, out, cols))?;
        let want = gemm_out(dev, gemm, &x, wide(&h32)?, (rows, out, cols))?;
        same(rep, &format!("f16.matmul_{gemm:?}"), &size, got, want);
    }
    let g16: Vec<f32> = r::cast(&r::cast::<f32, f16>(&g));
    let b16: Vec<f32> = r::cast(&r::cast::<f32, f16>(&b));
    let [y1, ..] = e.layernorm_fwd(&gx, &half16(&g16)?, &half16(&b16)?, cols, 1e-5)?;
    let [y2, ..] = e.layernorm_fwd(&gx, &wide(&g16)?, &wide(&b16)?, cols, 1e-5)?;
    same(
        rep,
        "f16.layernorm_fwd",
        &format!("{rows}x{cols}"),
        e.download(&y1)?,
        e.download(&y2)?,
    );
    let table16: Vec<f32> = r::cast(&r::cast::<f32, f16>(&data(vocab * cols, 78)));
    let y1 = e.embedding_fwd(&half16(&table16)?, &gids, cols)?;
    let y2 = e.embedding_fwd(&wide(&table16)?, &gids, cols)?;
    same(
        rep,
        "f16.embedding_fwd",
        &format!("{rows} of {vocab}x{cols}"),
        e.download(&y1)?,
        e.download(&y2)?,
    );
    // The device optimizer's new weights: the master rounded, written
    // into a bf16 param, or into an fp32 one as its widened value.
    let master = e.upload("master", &data(100_003, 75))?;
    let mut w1 = narrow(&vec![0.0; 100_003])?;
    let mut w2 = wide(&vec![0.0; 100_003])?;
    e.round_bf16(&mut w1, &master)?;
    e.round_bf16(&mut w2, &master)?;
    same(
        rep,
        "round_bf16",
        "100003",
        e.download(&w1)?,
        e.download(&w2)?,
    );
    Ok(())
}

/// `x` [rows, k] times the param `w` [k, n] on an executor with `gemm`
/// operands, downloaded.
fn gemm_out(
    dev: &Device,
    gemm: GemmDtype,
    x: &[f32],
    w: DevBuf,
    (rows, n, k): (usize, usize, usize),
) -> Result<Vec<f32>> {
    let e = CudaExec { dev, gemm };
    let gx = e.upload("x", x)?;
    let s = MatmulShape {
        batch: 1,
        m: rows,
        n,
        k,
        trans_a: false,
        trans_b: false,
    };
    let mut c = e.output("c", rows * n)?;
    e.matmul(&mut c, &gx, &w, s, 0.0)?;
    e.download(&c)
}
