//! The state's tiers against each other and against the kernel run on
//! plain slices, for both moment dtypes.
#![allow(clippy::unwrap_used)] // tests: a failure is a panic

use std::num::NonZeroUsize;

use tierzero_swap::{
    ArenaConfig, Engine, EngineConfig, LockPolicy, PinnedArena, SpaceConfig, SwapSpace,
};

use super::*;
use crate::optim::AdamHyper;

/// Awkward sizes: empty, one element, odd, across a block boundary.
const NUMEL: [usize; 5] = [0, 1, 1023, 1025, 3000];

/// NVMe state I/O over `buffers` pinned buffers of `largest` elements' fp32.
fn nvme(dir: &std::path::Path, buffers: u64, largest: u64) -> NvmeOptim {
    std::fs::create_dir_all(dir).unwrap();
    let buf_bytes = (largest * 4).next_multiple_of(4096);
    let space = SwapSpace::create(SpaceConfig::new(dir, 8 << 20)).unwrap();
    let mut ac = ArenaConfig::new(buf_bytes * buffers, buf_bytes);
    ac.lock = LockPolicy::Off;
    let arena = PinnedArena::new(ac).unwrap();
    let read = Engine::new(space.clone(), arena.clone(), EngineConfig::default()).unwrap();
    let write = Engine::new(space, arena.clone(), EngineConfig::default()).unwrap();
    NvmeOptim { read, write, arena }
}

fn adam() -> CpuAdam {
    CpuAdam::new(
        AdamHyper {
            lr: 1e-2,
            weight_decay: 0.1,
            ..AdamHyper::default()
        },
        NonZeroUsize::new(2).unwrap(),
    )
    .unwrap()
}

/// Deterministic values in about [-1, 1] (a small LCG).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Five steps of every group (the third speculative, then committed),
/// returning each group's master, m and v.
fn run(state: &mut OptimizerState) -> Vec<[Vec<f32>; 3]> {
    let adam = adam();
    for (i, &n) in NUMEL.iter().enumerate() {
        let zeros = vec![0f32; n];
        state
            .load_group(SubGroupId(i), [&values(n, i as u64), &zeros, &zeros])
            .unwrap();
    }
    for step in 1..=5u64 {
        let speculative = step == 3 && state.is_nvme();
        let mut stepped = Vec::new();
        for (i, &n) in NUMEL.iter().enumerate() {
            let sg = SubGroupId(i);
            state.prefetch(sg).unwrap();
            let g = values(n, 100 * step + i as u64);
            state
                .step(
                    sg,
                    &adam,
                    step,
                    Some((&g).into()),
                    GradScale::ONE,
                    None,
                    &mut |_| Ok(()),
                    speculative && !state.in_memory(sg),
                )
                .unwrap();
            state.retire_behind().unwrap();
            if speculative && !state.in_memory(sg) {
                stepped.push(sg);
            }
        }
        state.commit(&stepped).unwrap();
    }
    (0..NUMEL.len())
        .map(|i| state.group_states(SubGroupId(i)).unwrap())
        .collect()
}

/// The kernel alone on slices: the reference for [`run`].
fn reference(moments: MomentDtype) -> Vec<[Vec<f32>; 3]> {
    let adam = adam();
    NUMEL
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut master = values(n, i as u64);
            let (mut m32, mut v32) = (vec![0f32; n], vec![0f32; n]);
            let (mut m16, mut v16) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
            for step in 1..=5u64 {
                let g = values(n, 100 * step + i as u64);
                let mom = match moments {
                    MomentDtype::F32 => Moments::F32 {
                        m: &mut m32,
                        v: &mut v32,
                    },
                    MomentDtype::Bf16 => Moments::Bf16 {
                        m: &mut m16,
                        v: &mut v16,
                    },
                };
                adam.step(step, &mut master, &g, mom, None, GradScale::ONE)
                    .unwrap();
            }
            match moments {
                MomentDtype::F32 => [master, m32, v32],
                MomentDtype::Bf16 => [
                    master,
                    m16.iter().map(|x| x.to_f32()).collect(),
                    v16.iter().map(|x| x.to_f32()).collect(),
                ],
            }
        })
        .collect()
}

fn bits(states: &[[Vec<f32>; 3]]) -> Vec<Vec<u32>> {
    states
        .iter()
        .flat_map(|s| s.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

#[test]
fn every_tier_steps_as_the_kernel_does_for_both_moment_dtypes() {
    let dir = tempfile::tempdir().unwrap();
    for moments in [MomentDtype::F32, MomentDtype::Bf16] {
        let want = bits(&reference(moments));
        let groups = NUMEL.len();
        let resident = [false, true, false, false, true];
        let cases: [(&str, Option<NvmeOptim>, &[bool], usize); 3] = [
            ("memory", None, &[], 0),
            (
                "nvme",
                Some(nvme(&dir.path().join(moments.name()), 9, 3000)),
                &[],
                2,
            ),
            (
                "nvme + resident",
                Some(nvme(
                    &dir.path().join(format!("{}r", moments.name())),
                    9,
                    3000,
                )),
                &resident,
                2,
            ),
        ];
        for (what, io, resident, slots) in cases {
            let mut state = OptimizerState::new(
                NUMEL.to_vec(),
                io,
                resident,
                1,
                1,
                false,
                PoolSize {
                    slots: slots * groups,
                    kept_grads: 0,
                },
                moments,
            )
            .unwrap();
            assert_eq!(state.moment_dtype(), moments);
            assert_eq!(bits(&run(&mut state)), want, "{what}, {moments:?}");
        }
    }
}

#[test]
fn bf16_moments_move_two_thirds_of_the_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut moved = Vec::new();
    for moments in [MomentDtype::F32, MomentDtype::Bf16] {
        let io = nvme(&dir.path().join(moments.name()), 9, 4096);
        let mut state = OptimizerState::new(
            vec![4096],
            Some(io),
            &[],
            1,
            1,
            false,
            PoolSize::default(),
            moments,
        )
        .unwrap();
        let zeros = vec![0f32; 4096];
        state
            .load_group(SubGroupId(0), [&values(4096, 1), &zeros, &zeros])
            .unwrap();
        let c0 = state.counters();
        state
            .step(
                SubGroupId(0),
                &adam(),
                1,
                Some((&values(4096, 2)).into()),
                GradScale::ONE,
                None,
                &mut |_| Ok(()),
                false,
            )
            .unwrap();
        state.flush().unwrap();
        let c1 = state.counters();
        moved.push((
            c1.nvme_read_bytes - c0.nvme_read_bytes,
            c1.nvme_written_bytes - c0.nvme_written_bytes,
        ));
    }
    assert_eq!(moved[0], (3 * 16384, 3 * 16384));
    assert_eq!(moved[1], (2 * 16384, 2 * 16384));
}

/// Adam step `k` of `sg` (`n` elements) with the gradient `values(n, 50
/// + k)`, unscaled, no 16-bit copy, not speculative.
fn step_plain(state: &mut OptimizerState, adam: &CpuAdam, sg: SubGroupId, k: u64, n: usize) {
    state
        .step(
            sg,
            adam,
            k,
            Some((&values(n, 50 + k)).into()),
            GradScale::ONE,
            None,
            &mut |_| Ok(()),
            false,
        )
        .unwrap();
}

/// `sg`'s states are the kernel's after plain steps `1..=steps`
/// ([`step_plain`]) from `master` and zero moments.
fn assert_states_after_plain_steps(
    state: &mut OptimizerState,
    adam: &CpuAdam,
    sg: SubGroupId,
    mut master: Vec<f32>,
    steps: u64,
) {
    let n = master.len();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    for k in 1..=steps {
        adam.step(
            k,
            &mut master,
            &values(n, 50 + k),
            Moments::F32 {
                m: &mut m,
                v: &mut v,
            },
            None,
            GradScale::ONE,
        )
        .unwrap();
    }
    let [got, got_m, got_v] = state.group_states(sg).unwrap();
    assert_eq!(bits(&[[got, got_m, got_v]]), bits(&[[master, m, v]]));
}

/// A load between steps supersedes a read of the sub-group issued ahead
/// (and lands after its queued writes): the next step steps the loaded
/// state. (The Python optimizer's `load_state_dict` after it has stepped
/// with a read ahead in flight stepped the state from before the load.)
#[test]
fn a_load_supersedes_a_read_issued_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let n = 1025;
    let mut state = OptimizerState::new(
        vec![n],
        Some(nvme(dir.path(), 9, n as u64)),
        &[],
        1,
        1,
        false,
        PoolSize::default(),
        MomentDtype::F32,
    )
    .unwrap();
    let zeros = vec![0f32; n];
    let sg = SubGroupId(0);
    let adam = adam();
    let step = |state: &mut OptimizerState, k: u64| step_plain(state, &adam, sg, k, n);
    state
        .load_group(sg, [&values(n, 1), &zeros, &zeros])
        .unwrap();
    step(&mut state, 1);
    // The next step's read, issued ahead while the write may be queued.
    assert!(state.prefetch(sg).unwrap());
    let loaded = values(n, 2);
    state.load_group(sg, [&loaded, &zeros, &zeros]).unwrap();
    step(&mut state, 1);
    state.flush().unwrap();
    assert_states_after_plain_steps(&mut state, &adam, sg, loaded, 1);
}

/// A read of a sub-group issued ahead right after its own step (its state
/// write still queued) waits for that write: the next step steps the new
/// state. (The Python optimizer's `step_group(A, next=B)` then
/// `step_group(B, next=A)` read A behind its queued write, through another
/// ring, and could step A's state from before its last step.)
#[test]
fn a_read_ahead_of_a_group_waits_for_its_own_queued_write() {
    let dir = tempfile::tempdir().unwrap();
    let n = 1025;
    let mut state = OptimizerState::new(
        vec![n, n],
        Some(nvme(dir.path(), 12, n as u64)),
        &[],
        1,
        2,
        false,
        PoolSize::default(),
        MomentDtype::F32,
    )
    .unwrap();
    let zeros = vec![0f32; n];
    let (a, b) = (SubGroupId(0), SubGroupId(1));
    let adam = adam();
    let step =
        |state: &mut OptimizerState, sg: SubGroupId, k: u64| step_plain(state, &adam, sg, k, n);
    for sg in [a, b] {
        state
            .load_group(sg, [&values(n, 1), &zeros, &zeros])
            .unwrap();
    }
    // step_group(a, next=b), then step_group(b, next=a), with two writes
    // behind.
    step(&mut state, a, 1);
    assert!(state.prefetch(b).unwrap());
    step(&mut state, b, 1);
    assert_eq!(state.writes_queued(), 2);
    assert!(state.prefetch(a).unwrap());
    // a's write retired before its read (b's may have too, if done).
    assert!(state.writes_queued() <= 1, "{}", state.writes_queued());
    step(&mut state, a, 2);
    state.flush().unwrap();
    assert_states_after_plain_steps(&mut state, &adam, a, values(n, 1), 2);
}

/// One in-memory sub-group of 4 elements with bf16 moments.
fn bf16_in_memory_4() -> OptimizerState {
    OptimizerState::new(
        vec![4],
        None,
        &[],
        1,
        1,
        false,
        PoolSize::default(),
        MomentDtype::Bf16,
    )
    .unwrap()
}

#[test]
fn bf16_moments_load_rounded_as_the_kernel_stores_them() {
    let mut state = bf16_in_memory_4();
    // 1 + 2^-8, halfway between two bf16s, rounds to even (1.0); a
    // subnormal is stored as signed zero.
    let m = [1.0 + f32::EPSILON * 2f32.powi(15), -1e-40, 0.5, 3.0];
    state
        .load_group(SubGroupId(0), [&[1.0; 4], &m, &[2.0; 4]])
        .unwrap();
    let [_, m_out, v_out] = state.group_states(SubGroupId(0)).unwrap();
    assert_eq!(m_out[0].to_bits(), 1.0f32.to_bits());
    assert_eq!(m_out[1].to_bits(), (-0.0f32).to_bits());
    assert_eq!(&m_out[2..], &[0.5, 3.0]);
    assert_eq!(v_out, vec![2.0; 4]);
}

/// bf16 moments are refused by a checkpoint, whose moment files are fp32
/// (the trainer keeps fp32 moments today; this guards the day it does
/// not); the masters are saved.
#[test]
fn bf16_moments_are_not_saved_as_fp32() {
    let mut state = bf16_in_memory_4();
    state
        .load_group(SubGroupId(0), [&[1.0; 4], &[0.5; 4], &[2.0; 4]])
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state");
    let file = std::fs::File::create(&path).unwrap();
    state
        .save_state(SubGroupId(0), 0, &file, &path, 0, 4096)
        .unwrap();
    let e = state
        .save_state(SubGroupId(0), 1, &file, &path, 4096, 4096)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bf16 Adam moments"), "{e}");
}

/// A checkpoint region from memory: the state's bytes, zero padding to the
/// region's end, nothing outside it, and the crc of the whole region. At an
/// aligned offset the region goes past the page cache
/// (`tierzero_swap::DirectWriter`, more than one chunk here, where the file
/// system takes O_DIRECT); at an unaligned one through the file. Both ways
/// write the same bytes.
#[test]
fn a_checkpoint_region_is_written_whole_direct_or_through_the_file() {
    let data: Vec<u8> = (0..(9 << 20) + 10_000).map(|i| (i % 251) as u8).collect();
    let len = (data.len() as u64).next_multiple_of(4096) + 4096;
    let dir = tempfile::tempdir().unwrap();
    let mut regions = Vec::new();
    for off in [4096u64, 100] {
        let path = dir.path().join(format!("state-{off}.f32"));
        std::fs::write(&path, vec![7u8; (off + len + 4096) as usize]).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let crc = checkpoint::write_region(&f, &path, off, len, &data).unwrap();
        let back = std::fs::read(&path).unwrap();
        let (o, l) = (off as usize, len as usize);
        assert!(
            back[..o].iter().all(|&b| b == 7),
            "{path:?}: before the region"
        );
        assert_eq!(&back[o..o + data.len()], &data[..], "{path:?}");
        assert!(
            back[o + data.len()..o + l].iter().all(|&b| b == 0),
            "{path:?}: padding"
        );
        assert!(
            back[o + l..].iter().all(|&b| b == 7),
            "{path:?}: after the region"
        );
        assert_eq!(crc, crc32c::crc32c(&back[o..o + l]), "{path:?}");
        regions.push(back[o..o + l].to_vec());
    }
    assert!(regions[0] == regions[1]);
    // A region shorter than the state is refused, not cut.
    let path = dir.path().join("short");
    std::fs::write(&path, vec![0u8; 8192]).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    assert!(checkpoint::write_region(&f, &path, 0, 4096, &data).is_err());
}

/// Host-memory state the allocator has no room for is an error naming
/// the bytes, not an abort of the process (a Python caller's 2^50
/// elements ended it).
#[test]
fn host_state_too_large_to_allocate_is_an_error() {
    for moments in [MomentDtype::F32, MomentDtype::Bf16] {
        let e = OptimizerState::new(
            vec![16, 1 << 60],
            None,
            &[],
            1,
            1,
            false,
            PoolSize::default(),
            moments,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("fp32 master of 1152921504606846976 elements"),
            "{e}"
        );
        assert!(e.contains("4611686018427387904 bytes"), "{e}");
    }
}
