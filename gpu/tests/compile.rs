//! Every kernel module compiles with NVRTC, no GPU needed: CUBINs for
//! sm_80 and sm_90 and PTX for compute_80; ptxas's report names exactly
//! the entry points the module lists, and no kernel spills. The report
//! (registers, spills, stack, shared memory per entry and architecture) is
//! `gpu/kernel-resources.txt`; this test fails when it is out of date for
//! the NVRTC version it was written with (regenerate with
//! `TIERZERO_KERNEL_REPORT=write cargo test -p tierzero-gpu --test compile`).
//!
//! NVRTC comes from the `nvidia-cuda-nvrtc` wheel (`.ci/run` installs it
//! and sets `LD_LIBRARY_PATH`). Without it the test says so and passes,
//! unless `TIERZERO_REQUIRE_NVRTC=1` (CI), where it fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::fmt::Write as _;

use tierzero_gpu::cache::{KernelCache, Lookup};
use tierzero_gpu::kernels::MODULES;
use tierzero_gpu::nvrtc::{self, Target};

const REPORT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/kernel-resources.txt");

fn nvrtc_or_skip() -> Option<(i32, i32)> {
    match nvrtc::version() {
        Ok(v) => Some(v),
        Err(e) => {
            if std::env::var("TIERZERO_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
                panic!("TIERZERO_REQUIRE_NVRTC=1 but NVRTC is not usable: {e}");
            }
            skipped(&e);
            None
        }
    }
}

#[test]
fn every_kernel_compiles_for_sm80_sm90_and_to_ptx_without_spills() {
    let Some((major, minor)) = nvrtc_or_skip() else {
        return;
    };
    let mut report = format!(
        "# ptxas resources of every kernel entry point (NVRTC {major}.{minor}, options {:?})\n\
         # module entry arch registers spill_store_bytes spill_load_bytes stack_bytes smem_bytes\n",
        nvrtc::OPTIONS
    );
    let mut spills = Vec::new();
    for m in MODULES {
        let want: BTreeSet<String> = m.entries().into_iter().collect();
        for arch in [80, 90] {
            let c = nvrtc::compile(m, Target::Cubin(arch)).unwrap_or_else(|e| panic!("{e}"));
            assert!(c.image.len() > 100, "{}: empty CUBIN", m.name);
            let res = c.resources();
            let got: BTreeSet<String> = res.iter().map(|r| r.entry.clone()).collect();
            assert_eq!(got, want, "{} sm_{arch}: entry points", m.name);
            for r in res {
                if r.spill_store_bytes + r.spill_load_bytes > 0 {
                    spills.push(format!("{} sm_{arch}", r.entry));
                }
                writeln!(
                    report,
                    "{} {} sm_{arch} {} {} {} {} {}",
                    m.name,
                    r.entry,
                    r.registers,
                    r.spill_store_bytes,
                    r.spill_load_bytes,
                    r.stack_bytes,
                    r.smem_bytes
                )
                .unwrap();
            }
        }
        let ptx = nvrtc::compile(m, Target::Ptx(80)).unwrap_or_else(|e| panic!("{e}"));
        let text = String::from_utf8_lossy(&ptx.image);
        for e in &want {
            assert!(
                text.contains(&format!(".entry {e}(")),
                "{}: PTX lacks {e}",
                m.name
            );
        }
    }
    assert!(spills.is_empty(), "kernels spill: {spills:?}");
    if std::env::var("TIERZERO_KERNEL_REPORT").is_ok_and(|v| v == "write") {
        std::fs::write(REPORT, &report).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(REPORT).unwrap_or_default();
    if committed.lines().next() == report.lines().next() {
        assert!(
            committed == report,
            "{REPORT} is out of date: rerun with TIERZERO_KERNEL_REPORT=write\n{report}"
        );
    } else {
        eprintln!("{REPORT} was written by another NVRTC; this one reports:\n{report}");
    }
}

#[test]
fn a_module_compiles_once_then_comes_from_the_cache() {
    if nvrtc_or_skip().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = KernelCache::new(dir.path());
    let m = tierzero_gpu::kernels::module("rope").unwrap();
    let (a, first) = cache.get(m, Target::Cubin(90)).unwrap();
    let (b, second) = cache.get(m, Target::Cubin(90)).unwrap();
    assert_eq!((first, second), (Lookup::Compiled, Lookup::Hit));
    assert_eq!(a, b);
    let (_, other) = cache.get(m, Target::Cubin(80)).unwrap();
    assert_eq!(other, Lookup::Compiled);
}

#[test]
fn an_architecture_nvrtc_cannot_target_is_a_clear_error() {
    if nvrtc_or_skip().is_none() {
        return;
    }
    let m = tierzero_gpu::kernels::module("cast").unwrap();
    let e = nvrtc::compile(m, Target::Cubin(35))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot target sm_35"), "{e}");
}

/// NVRTC without its builtins library (`libnvrtc-builtins.so.13.*`, which
/// it opens at the first compile: a copy of libnvrtc.so.13 alone on
/// LD_LIBRARY_PATH) is a setup error on one line naming it, not a kernel
/// that did not compile (an internal error, exit 1, NVRTC's two-line log).
/// Run in a child of this test binary, whose LD_LIBRARY_PATH is that copy's
/// directory (the loader reads it at start-up).
#[test]
fn nvrtc_without_its_builtins_is_a_setup_error_on_one_line() {
    const CHILD: &str = "TIERZERO_TEST_NVRTC_ALONE";
    if std::env::var_os(CHILD).is_some() {
        let e = nvrtc::compile(&MODULES[0], Target::Ptx(80)).unwrap_err();
        assert!(
            matches!(e, tierzero_gpu::GpuError::BuiltinsMissing { .. }),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("libnvrtc-builtins.so.13") && !text.contains('\n'),
            "{text}"
        );
        return;
    }
    if nvrtc_or_skip().is_none() {
        return;
    }
    let lib = std::env::var_os("LD_LIBRARY_PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join("libnvrtc.so.13"))
        .find(|p| p.is_file());
    let Some(lib) = lib else {
        skipped("NVRTC loads, but not from a directory on LD_LIBRARY_PATH");
        return;
    };
    let alone = std::env::temp_dir().join(format!("tz-nvrtc-alone-{}", std::process::id()));
    std::fs::create_dir_all(&alone).unwrap();
    std::fs::copy(&lib, alone.join("libnvrtc.so.13")).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "nvrtc_without_its_builtins_is_a_setup_error_on_one_line",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", &alone)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&alone).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A test that cannot run here says so where CI's log shows it (the
/// harness captures a passing test's `eprintln!`: a skip showed as `ok`).
fn skipped(why: impl std::fmt::Display) {
    use std::io::Write as _;
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}
