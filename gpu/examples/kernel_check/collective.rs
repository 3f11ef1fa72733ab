//! The device check of the gradients' reduce-scatter on the device
//! ([`check_collective`]), a part of `kernel_check`: the `add_chunks`
//! kernel against its reference bit for bit, and one rank's
//! [`DeviceComm`] (NCCL with one rank: the lent machines have one GPU)
//! through pack, reduce and the sums' download, and through a param's
//! gather (its shard's upload, the exchange's event, the compute
//! ordered after it).

use std::sync::Arc;

use half::{bf16, f16};
use tierzero_gpu::collective::{add_chunks_on, DeviceComm};
use tierzero_gpu::device::Device;
use tierzero_gpu::link::{Downloaded, Downloads, Uploads, Wire};
use tierzero_gpu::ops::Elem;
use tierzero_gpu::reference as r;
use tierzero_gpu::unit::DevBuf;
use tierzero_gpu::Result;

use super::{data, poisoned, typed, Report};

/// `got` and `want` the same bits, reported as `kernel`.
fn same_bits(rep: &mut Report, kernel: &str, size: &str, got: &[f32], want: &[f32]) {
    let differ = got
        .iter()
        .zip(want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    let ok = got.len() == want.len() && !want.is_empty() && differ == 0;
    rep.check(
        kernel,
        size,
        ok,
        &format!(
            "{differ} of {} elements differ from the reference",
            want.len()
        ),
    );
}

fn add_chunks_case<T: Elem>(
    dev: &Device,
    rep: &mut Report,
    n: usize,
    world: usize,
    with_acc: bool,
) -> Result<()> {
    let chunks: Vec<T> = typed(&data(n * world, 90 + world as u64));
    let acc = with_acc.then(|| data(n, 91));
    let d_chunks = dev.upload("chunks", &chunks)?;
    let d_acc = acc
        .as_ref()
        .map(|a| dev.upload("running sums", a))
        .transpose()?;
    let mut out = poisoned::<f32>(dev, n)?;
    add_chunks_on::<T>(
        dev,
        &dev.compute,
        &mut out,
        d_acc.as_ref(),
        &d_chunks,
        world,
    )?;
    let want = r::add_chunks::<T>(acc.as_deref(), &chunks, n);
    same_bits(
        rep,
        &format!("add_chunks_{}", T::SUFFIX),
        &format!("{world}x{n}{}", if with_acc { "+acc" } else { "" }),
        &dev.download(&out)?,
        &want,
    );
    Ok(())
}

/// One rank's reduce-scatter of three gradients of awkward sizes, packed
/// as `T` (`wire`): pack on the compute stream, reduce on the
/// collective's stream, the sums' download after its event only.
fn one_rank<T: Elem>(
    dev: &Arc<Device>,
    comm: &DeviceComm,
    downloads: &Downloads,
    rep: &mut Report,
    wire: Wire,
    with_acc: bool,
) -> Result<()> {
    let sizes = [257usize, 1, 4099];
    let grads: Vec<Vec<f32>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| data(n, 95 + i as u64))
        .collect();
    let bufs = grads
        .iter()
        .map(|g| dev.upload("gradient", g))
        .collect::<Result<Vec<_>>>()?;
    let counts: Vec<Vec<usize>> = sizes.iter().map(|&n| vec![n]).collect();
    let packed = comm.pack(dev, &bufs.iter().collect::<Vec<_>>(), &counts, wire)?;
    drop(bufs);
    let total: usize = sizes.iter().sum();
    let acc = with_acc.then(|| data(total, 99));
    let reduced = comm.wait(
        comm.reduce(dev, packed, acc.as_deref())?,
        std::time::Duration::from_secs(60),
    )?;
    let d = downloads.start_reduced("sums", reduced)?;
    let got = match downloads.finish(d)? {
        Downloaded::F32(v) => v,
        other => panic!("the sums came down as {other:?}"),
    };
    let flat: Vec<f32> = grads.concat();
    same_bits(
        rep,
        &format!("reduce_scatter.one_rank_{}", T::SUFFIX),
        &format!("{total}{}", if with_acc { "+acc" } else { "" }),
        &got,
        &r::add_chunks::<T>(acc.as_deref(), &typed::<T>(&flat), total),
    );
    Ok(())
}

/// `add_chunks` in each dtype at awkward sizes, with and without running
/// sums; then one rank's [`DeviceComm`] (NCCL must load: the script links
/// `libnccl.so` before this step).
pub(super) fn check_collective(dev: &Arc<Device>, rep: &mut Report) -> Result<()> {
    for (n, world) in [(1usize, 1usize), (257, 2), (1000, 3), (4097, 8)] {
        for with_acc in [false, true] {
            add_chunks_case::<f32>(dev, rep, n, world, with_acc)?;
            add_chunks_case::<bf16>(dev, rep, n, world, with_acc)?;
            add_chunks_case::<f16>(dev, rep, n, world, with_acc)?;
        }
    }
    let comm = match DeviceComm::unique_id()
        .and_then(|id| DeviceComm::new(dev, &id, 0, 1))
        .and_then(|c| {
            c.warm_up(dev, std::time::Duration::from_secs(60))
                .map(|()| c)
        }) {
        Ok(c) => c,
        Err(e) => {
            rep.check("reduce_scatter.nccl_init", "1 rank", false, &e.to_string());
            return Ok(());
        }
    };
    let downloads = Downloads::new(dev.clone(), 64 << 20)?;
    for with_acc in [false, true] {
        one_rank::<f32>(dev, &comm, &downloads, rep, Wire::F32, with_acc)?;
        one_rank::<bf16>(dev, &comm, &downloads, rep, Wire::Bf16, with_acc)?;
    }
    one_rank::<f16>(dev, &comm, &downloads, rep, Wire::F16, true)?;
    let uploads = Uploads::new(dev.clone(), 64 << 20)?;
    for n in [1usize, 4099] {
        gather_one_rank(dev, &comm, &uploads, rep, n)?;
    }
    kept_one_rank(dev, &comm, &uploads, rep)?;
    Ok(())
}

/// One rank's sums kept on the device (the optimizer's there): two
/// reduces of a gradient, the second onto the first's sums, through
/// [`PendingUpload::collected`] and `finish`, against `add_chunks`'s
/// reference; then `gather_kept` of two wholes, fp32 and bf16, each its
/// shard's bits (copied; rounded to nearest even).
fn kept_one_rank(
    dev: &Arc<Device>,
    comm: &DeviceComm,
    uploads: &Uploads,
    rep: &mut Report,
) -> Result<()> {
    use tierzero_gpu::link::PendingUpload;
    let deadline = std::time::Duration::from_secs(60);
    let n = 4099usize;
    let (a, b) = (data(n, 141), data(n, 142));
    let mut acc: Option<tierzero_gpu::device::DeviceBuffer<f32>> = None;
    for g in [&a, &b] {
        // With a param of 5 elements, none with running sums, beside it.
        let (buf, other) = (dev.upload("gradient", g)?, dev.upload("other", &[1f32; 5])?);
        let counts = [vec![n], vec![5]];
        let packed = comm.pack(dev, &[&buf, &other], &counts, Wire::F32)?;
        let (mut sums, _) = comm.reduce_onto(dev, packed, vec![acc.take(), None], &counts)?;
        let (Some(Some((own, done))), Some(Some((five, _)))) = (
            sums.first_mut().map(Option::take),
            sums.get_mut(1).map(Option::take),
        ) else {
            rep.check("reduce_kept.one_rank", &n.to_string(), false, "no sums");
            return Ok(());
        };
        comm.wait_event(&done, deadline, "reduce_onto")?;
        let ones = dev.download(&five)?;
        rep.check(
            "reduce_kept.one_rank_beside",
            "5",
            ones == [1f32; 5],
            &format!("{ones:?}"),
        );
        let up = PendingUpload::collected(DevBuf::F32(own), done);
        acc = Some(
            uploads
                .finish(comm.wait_gathered(up, deadline)?)?
                .into_f32()?,
        );
    }
    let got = match &acc {
        Some(s) => dev.download(s)?,
        None => Vec::new(),
    };
    let first = r::add_chunks::<f32>(None, &a, n);
    same_bits(
        rep,
        "reduce_kept.one_rank_f32",
        &format!("{n}x2"),
        &got,
        &r::add_chunks::<f32>(Some(&first), &b, n),
    );
    let master = data(n, 143);
    let shard = DevBuf::F32(dev.upload("master shard", &master)?);
    let wholes = vec![
        DevBuf::F32(dev.upload("weights", &vec![0f32; n])?),
        DevBuf::Bf16(dev.upload("weights", &vec![bf16::ZERO; n])?),
    ];
    let tierzero_gpu::collective::Gathered { wholes, done, .. } = comm.gather_kept(
        dev,
        wholes,
        &[Some(&shard), Some(&shard)],
        &[vec![n], vec![n]],
    )?;
    comm.wait_event(&done, deadline, "gather_kept")?;
    for w in &wholes {
        let (kernel, got, want): (&str, Vec<f32>, Vec<f32>) = match w {
            DevBuf::F32(b) => ("gather_kept.one_rank_f32", dev.download(b)?, master.clone()),
            DevBuf::Bf16(b) => (
                "gather_kept.one_rank_bf16",
                dev.download(b)?.iter().map(|x| x.to_f32()).collect(),
                master.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
            ),
            DevBuf::F16(_) => continue,
        };
        same_bits(rep, kernel, &n.to_string(), &got, &want);
    }
    Ok(())
}

/// One rank's gather of a param of `n` elements, fp32 and bf16: the shard
/// (the whole, with one rank) uploaded into its range, the exchange's
/// event waited for with a deadline (`wait_gathered` refuses an upload
/// without it), the buffer the compute gets has the shard's bits.
fn gather_one_rank(
    dev: &Arc<Device>,
    comm: &DeviceComm,
    uploads: &Uploads,
    rep: &mut Report,
    n: usize,
) -> Result<()> {
    let v = data(n, 131);
    let deadline = std::time::Duration::from_secs(60);
    let up = uploads.start_shard("param shard", &v, 0, n)?;
    let (up, _) = comm.gather(dev, up, &[n])?;
    let got = match uploads.finish(comm.wait_gathered(up, deadline)?)? {
        DevBuf::F32(b) => dev.download(&b)?,
        _ => Vec::new(),
    };
    same_bits(rep, "gather.one_rank_f32", &n.to_string(), &got, &v);
    let h: Vec<bf16> = typed(&v);
    let up = uploads.start_shard_bf16("param shard", &h, 0, n)?;
    let (up, _) = comm.gather(dev, up, &[n])?;
    let got: Vec<f32> = match uploads.finish(comm.wait_gathered(up, deadline)?)? {
        DevBuf::Bf16(b) => dev.download(&b)?.iter().map(|x| x.to_f32()).collect(),
        _ => Vec::new(),
    };
    let want: Vec<f32> = h.iter().map(|x| x.to_f32()).collect();
    same_bits(rep, "gather.one_rank_bf16", &n.to_string(), &got, &want);
    gather_pinned_one_rank(dev, comm, uploads, rep, &v)
}

/// One rank's gather of `v` with its shard copied in place from a page of
/// a registered arena ([`Uploads::start_shard_pinned`]), the page written
/// only after the pin (with the copy) is gone.
fn gather_pinned_one_rank(
    dev: &Arc<Device>,
    comm: &DeviceComm,
    uploads: &Uploads,
    rep: &mut Report,
    v: &[f32],
) -> Result<()> {
    use tierzero_swap::{ArenaConfig, PinnedArena, SharedBuffer};
    let n = v.len();
    let page_bytes = (n * 4).div_ceil(4096) * 4096;
    let mut ac = ArenaConfig::new(page_bytes as u64, page_bytes as u64);
    ac.registrar = Some(Arc::new(
        tierzero_gpu::host_register::HostRegistration::new(dev.clone()),
    ));
    let mut page = match PinnedArena::new(ac).and_then(|a| a.try_acquire()) {
        Ok(b) => b,
        Err(e) => {
            rep.check("gather.pinned", &n.to_string(), false, &e.to_string());
            return Ok(());
        }
    };
    for (dst, x) in page.as_mut_slice().chunks_exact_mut(4).zip(v) {
        dst.copy_from_slice(&x.to_le_bytes());
    }
    let page = SharedBuffer::new(page);
    let pin = page
        .pin(0..n * 4)
        .map_err(|e| tierzero_gpu::GpuError::Driver {
            call: "pin",
            detail: e.to_string(),
        })?;
    let up = uploads.start_shard_pinned("param shard in place", pin, Wire::F32, 0, n)?;
    let (up, _) = comm.gather(dev, up, &[n])?;
    let got = match uploads.finish(comm.wait_gathered(up, std::time::Duration::from_secs(60))?)? {
        DevBuf::F32(b) => dev.download(&b)?,
        _ => Vec::new(),
    };
    same_bits(rep, "gather.pinned_f32", &n.to_string(), &got, v);
    Ok(())
}
