//! The CUDA AdamW kernel's reference (`tierzero_gpu::reference::adamw`,
//! the kernel's arithmetic) gives the CPU kernel's bits: on every SIMD
//! path, at awkward sizes, with the bf16 parameter copy, so Adam on the GPU
//! (optimizer not offloaded) trains as Adam on the CPU does.
#![allow(clippy::unwrap_used)]

use std::num::NonZeroUsize;

use half::bf16;
use tierzero::optim::{AdamHyper, CpuAdam, GradScale, Isa, LowPrecisionOut, Moments};
use tierzero_gpu::reference as r;

fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn the_cuda_adamw_reference_gives_the_cpu_kernels_bits() {
    let h = AdamHyper {
        lr: 3e-3,
        weight_decay: 0.1,
        ..AdamHyper::default()
    };
    for isa in Isa::available() {
        let adam = CpuAdam::with_isa(h, NonZeroUsize::new(2).unwrap(), isa).unwrap();
        for n in [1usize, 7, 15, 16, 17, 1023, 4097] {
            let (mut p_cpu, mut m_cpu, mut v_cpu) = (data(n, 1), vec![0f32; n], vec![0f32; n]);
            let (mut p_ref, mut m_ref, mut v_ref) = (p_cpu.clone(), m_cpu.clone(), v_cpu.clone());
            let (mut o_cpu, mut o_ref) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
            for step in 1..=5u64 {
                let g = data(n, 100 + step as u32);
                let scale = if step == 3 { 0.25 } else { 1.0 };
                let moments = Moments::F32 {
                    m: &mut m_cpu,
                    v: &mut v_cpu,
                };
                let out = Some(LowPrecisionOut::Bf16(&mut o_cpu));
                adam.step(step, &mut p_cpu, &g, moments, out, GradScale(scale))
                    .unwrap();
                let s = tierzero::optim::gpu_step_scalars(&h, step, GradScale(scale))
                    .unwrap()
                    .unwrap();
                r::adamw(&mut p_ref, &mut m_ref, &mut v_ref, &g, Some(&mut o_ref), s);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let what = format!("{isa:?}, {n} elements");
            assert_eq!(bits(&p_cpu), bits(&p_ref), "{what}: params");
            assert_eq!(bits(&m_cpu), bits(&m_ref), "{what}: m");
            assert_eq!(bits(&v_cpu), bits(&v_ref), "{what}: v");
            assert_eq!(o_cpu, o_ref, "{what}: bf16 copy");
        }
    }
}
