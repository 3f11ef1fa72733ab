//! The `gpu` feature on a machine without the NVIDIA driver (this CI): the
//! probe and the NCCL communicator return a clean `GpuError` naming the
//! missing library, never a panic, and a 2-rank TCP bootstrap where every
//! rank lacks the driver ends on every rank at once (no rank left waiting
//! for the others). Skipped where a libcuda is visible (a GPU machine runs
//! `scripts/gpu_check.sh` instead).
#![cfg(feature = "gpu")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::process::Command;
use std::time::{Duration, Instant};

use tierzero::engine::comm::nccl::{Bootstrap, NcclComm, NcclOptions};
use tierzero::gpu::{self, DeviceChoice, GpuError};

fn driver_visible() -> bool {
    let cache = Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so"))
        .unwrap_or(false);
    cache
        || std::env::var("LD_LIBRARY_PATH").is_ok_and(|p| {
            p.split(':').filter(|d| !d.is_empty()).any(|d| {
                std::fs::read_dir(d).is_ok_and(|rd| {
                    rd.flatten()
                        .any(|e| e.file_name().to_string_lossy().starts_with("libcuda.so"))
                })
            })
        })
}

fn opts(bootstrap: Bootstrap) -> NcclOptions {
    NcclOptions {
        device: DeviceChoice::Auto,
        local_rank: 0,
        timeout: Duration::from_secs(20),
        bootstrap,
    }
}

#[test]
fn probe_without_a_driver_is_a_clean_error() {
    if driver_visible() {
        return;
    }
    // Twice: cudarc's loader is retried, not poisoned, and still no panic.
    for _ in 0..2 {
        match gpu::probe() {
            Err(GpuError::DriverMissing { detail }) => {
                assert!(detail.contains("libcuda.so"), "{detail}")
            }
            other => panic!("expected DriverMissing, got {other:?}"),
        }
        // The count `train --device cuda` takes, the same way.
        match gpu::device_count() {
            Err(GpuError::DriverMissing { detail }) => {
                assert!(detail.contains("libcuda.so"), "{detail}")
            }
            other => panic!("expected DriverMissing, got {other:?}"),
        }
    }
}

#[test]
fn nccl_comm_without_a_driver_is_a_clean_error() {
    if driver_visible() {
        return;
    }
    let one = Bootstrap::Tcp {
        addr: String::new(),
        rank: 0,
        world: 1,
    };
    let e = NcclComm::new(opts(one)).unwrap_err();
    assert!(matches!(e, GpuError::DriverMissing { .. }), "{e:?}");
    assert!(e.to_string().starts_with("libcuda.so not found"), "{e}");
}

#[test]
fn two_ranks_without_a_driver_both_stop_at_once() {
    if driver_visible() {
        return;
    }
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let t0 = Instant::now();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let addr = addr.clone();
                s.spawn(move || {
                    NcclComm::new(opts(Bootstrap::Tcp {
                        addr,
                        rank,
                        world: 2,
                    }))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        let e = r.unwrap_err();
        // Each rank reports its own failure (not a timeout).
        assert!(matches!(e, GpuError::DriverMissing { .. }), "{e:?}");
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}
