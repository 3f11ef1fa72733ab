//! `--device cuda` and `gpu-info` through the built binary. Without the
//! `gpu` feature both refuse with exit 2 and the rebuild command. With it,
//! on a machine without the NVIDIA driver (this CI), both exit 2 with one
//! line naming the missing driver, and never show cudarc's panic; on a
//! machine with a driver, `gpu-info` lists the devices.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::path::Path;
use std::process::{Command, Output};

fn tierzero(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(args)
        .current_dir(cwd)
        .env_remove("TIERZERO_NCCL_ADDR")
        .env_remove("TIERZERO_LOG")
        .output()
        .expect("run tierzero")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn scratch(tag: &str) -> std::path::PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("gpu-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// One error line on stderr, no panic text, nothing on stdout, exit 2.
fn assert_one_line_refusal(out: &Output, needle: &str) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "stderr: {err}");
    assert!(err.starts_with("error: "), "stderr: {err}");
    assert!(err.contains(needle), "wanted {needle:?} in: {err}");
    assert!(!err.contains("panick"), "stderr: {err}");
    assert!(out.stdout.is_empty(), "stdout: {}", text(&out.stdout));
}

#[test]
fn a_bad_device_is_one_line() {
    let d = scratch("bad");
    let out = tierzero(&d, &["train", "--device", "cuda:x"]);
    assert_one_line_refusal(&out, "--device cuda:x: give cpu, cuda");
}

#[cfg(not(feature = "gpu"))]
mod without_the_feature {
    use super::*;

    #[test]
    fn train_on_cuda_says_how_to_build_it_and_trains_nothing() {
        let d = scratch("nofeature");
        for dev in ["cuda", "cuda:1"] {
            let out = tierzero(&d, &["train", "--device", dev, "--steps", "1"]);
            assert_one_line_refusal(&out, "--features gpu");
        }
        // Refused before the swap directory is made.
        assert!(!d.join("tierzero-swap").exists());
    }

    #[test]
    fn gpu_info_says_how_to_build_it() {
        let d = scratch("nofeature-info");
        let out = tierzero(&d, &["gpu-info"]);
        assert_one_line_refusal(&out, "--features gpu");
    }
}

#[cfg(feature = "gpu")]
mod with_the_feature {
    use super::*;

    /// Whether the dynamic loader can see a libcuda (the driver's library).
    fn driver_visible() -> bool {
        let ld_cache = Command::new("ldconfig")
            .arg("-p")
            .output()
            .map(|o| text(&o.stdout).contains("libcuda.so"))
            .unwrap_or(false);
        let in_path = std::env::var("LD_LIBRARY_PATH")
            .unwrap_or_default()
            .split(':')
            .filter(|p| !p.is_empty())
            .any(|dir| {
                std::fs::read_dir(dir).is_ok_and(|rd| {
                    rd.flatten()
                        .any(|e| e.file_name().to_string_lossy().starts_with("libcuda.so"))
                })
            });
        ld_cache || in_path
    }

    #[test]
    fn without_a_driver_train_on_cuda_names_the_driver() {
        if driver_visible() {
            eprintln!("libcuda is present: the no-driver case does not apply here");
            return;
        }
        let d = scratch("nodriver");
        for dev in ["cuda", "cuda:0"] {
            let out = tierzero(&d, &["train", "--device", dev, "--steps", "1"]);
            assert_one_line_refusal(
                &out,
                &format!("--device {dev}: libcuda.so not found: install the NVIDIA driver"),
            );
        }
        assert!(!d.join("tierzero-swap").exists());
    }

    #[test]
    fn gpu_info_names_the_driver_or_lists_devices() {
        let d = scratch("info");
        let out = tierzero(&d, &["gpu-info", "--json"]);
        if driver_visible() {
            let err = text(&out.stderr);
            assert!(!err.contains("panick"), "stderr: {err}");
            if out.status.success() {
                let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                assert!(!v["devices"].as_array().unwrap().is_empty(), "{v}");
            }
        } else {
            // With --json, stdout is the error object (it was empty).
            let v: serde_json::Value = serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|e| panic!("{e}: {}", text(&out.stdout)));
            assert_eq!(v["failure"], "bad_input", "{v}");
            assert_eq!(v["exit_code"], 2, "{v}");
            assert!(
                v["error"]
                    .as_str()
                    .unwrap()
                    .contains("libcuda.so not found"),
                "{v}"
            );
            let out = tierzero(&d, &["gpu-info"]);
            assert_one_line_refusal(&out, "libcuda.so not found: install the NVIDIA driver");
            let out = tierzero(&d, &["gpu-info", "--nccl-test"]);
            assert_one_line_refusal(&out, "libcuda.so not found");
        }
    }

    /// `gpu-info` and `train --device cuda` run in `d` with `lib` (a fake
    /// driver's directory) as LD_LIBRARY_PATH.
    fn gpu_commands_with_driver(d: &Path, lib: &Path) -> Vec<Output> {
        [
            &["gpu-info"][..],
            &["train", "--device", "cuda", "--steps", "1"][..],
        ]
        .into_iter()
        .map(|args| {
            Command::new(env!("CARGO_BIN_EXE_tierzero"))
                .args(args)
                .current_dir(d)
                .env("LD_LIBRARY_PATH", lib)
                .env_remove("TIERZERO_NCCL_ADDR")
                .env_remove("TIERZERO_LOG")
                .output()
                .expect("run tierzero")
        })
        .collect()
    }

    /// A `libcuda.so` whose `cuInit` answers `code`, built with the C
    /// compiler the Rust toolchain links with; `None` without one.
    fn fake_driver(d: &Path, code: i32) -> Option<std::path::PathBuf> {
        let dir = d.join(format!("libcuda-{code}"));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("fake.c");
        std::fs::write(
            &src,
            format!(
                "int cuInit(unsigned f) {{ (void)f; return {code}; }}\n\
                 int cuDeviceGetCount(int *c) {{ *c = 0; return {code}; }}\n\
                 int cuDriverGetVersion(int *v) {{ *v = 13000; return 0; }}\n\
                 int cuGetErrorString(int e, const char **s) {{ (void)e; *s = \"fake\"; return 0; }}\n\
                 int cuGetErrorName(int e, const char **s) {{ (void)e; *s = \"FAKE\"; return 0; }}\n"
            ),
        )
        .unwrap();
        let built = Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(dir.join("libcuda.so"))
            .arg(&src)
            .status()
            .ok()?;
        built.success().then_some(dir)
    }

    /// A driver that fails to initialise, with a code the bindings know (a
    /// stub library, a driver upgraded without a reboot) or one only a
    /// newer driver gives (917, CUDA 13.1's): one line naming the call,
    /// the code and the fix, exit 2. 917 used to end the process with
    /// SIGILL: cudarc's `CUresult` enum has no variant for it.
    #[test]
    fn a_driver_that_fails_to_initialise_is_one_line_with_the_fix() {
        let d = scratch("fake-driver");
        for (code, needle) in [
            (34, "CUDA_ERROR_STUB_LIBRARY (34); "),
            (803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH (803); "),
            (917, "cuInit returned CUDA error (917)"),
        ] {
            let Some(lib) = fake_driver(&d, code) else {
                eprintln!("no C compiler (cc): the fake driver cannot be built");
                return;
            };
            for out in gpu_commands_with_driver(&d, &lib) {
                assert_one_line_refusal(&out, needle);
                let err = text(&out.stderr);
                assert!(err.contains("did not initialise"), "{err}");
                assert!(err.contains(&lib.display().to_string()), "{err}");
            }
        }
        assert!(!d.join("tierzero-swap").exists());
    }

    /// A `libcuda.so` that is there but does not load (a library of its
    /// own missing) is named with the loader's reason, and one without
    /// `cuInit` as no driver, with its path: both said "not found" or
    /// "older than tierzero's bindings ... update it".
    #[test]
    fn a_driver_file_that_does_not_load_or_is_no_driver_is_named() {
        let d = scratch("broken-driver");
        // A shared library `out` of `inputs` (C sources and libraries).
        let cc = |out: &Path, inputs: &[&Path]| {
            Command::new("cc")
                .args(["-shared", "-fPIC", "-o"])
                .arg(out)
                .args(inputs)
                .status()
                .is_ok_and(|s| s.success())
        };
        let (dep, broken, empty) = (d.join("dep"), d.join("broken"), d.join("empty"));
        for dir in [&dep, &broken, &empty] {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(dep.join("dep.c"), "int nv_dep(void) { return 0; }\n").unwrap();
        std::fs::write(
            broken.join("cuda.c"),
            "int nv_dep(void);\nint cuInit(unsigned f) { (void)f; return nv_dep(); }\n\
             int cuDeviceGetCount(int *c) { *c = 1; return 0; }\n",
        )
        .unwrap();
        std::fs::write(empty.join("e.c"), "int not_cuda(void) { return 0; }\n").unwrap();
        let built = cc(&dep.join("libtzfakedep.so"), &[&dep.join("dep.c")])
            && cc(
                &broken.join("libcuda.so"),
                &[&broken.join("cuda.c"), &dep.join("libtzfakedep.so")],
            )
            && cc(&empty.join("libcuda.so"), &[&empty.join("e.c")]);
        if !built {
            eprintln!("no C compiler (cc): the fake drivers cannot be built");
            return;
        }
        // The dependency is linked by its path: moved away, the loader
        // names it. (Both driver names: a real driver's libcuda.so.1 must
        // not load after the fake libcuda.so was refused.)
        std::fs::rename(dep.join("libtzfakedep.so"), dep.join("gone.so")).unwrap();
        std::fs::copy(broken.join("libcuda.so"), broken.join("libcuda.so.1")).unwrap();
        for (lib, needles) in [
            (
                &broken,
                &["libcuda.so is there but does not load: ", "libtzfakedep.so"][..],
            ),
            (
                &empty,
                &[&format!(
                    "{} is not the NVIDIA driver's libcuda (it has no cuInit)",
                    empty.join("libcuda.so").display()
                )[..]][..],
            ),
        ] {
            for out in gpu_commands_with_driver(&d, lib) {
                for needle in needles {
                    assert_one_line_refusal(&out, needle);
                }
            }
        }
        assert!(!d.join("tierzero-swap").exists());
    }
}
