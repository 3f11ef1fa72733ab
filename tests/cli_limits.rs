//! `tierzero train` against the machine's limits, as the built binary: a
//! second run on the same nvme_path (refused, exit 2, naming the lock and
//! the holder), pinned buffers above `RLIMIT_MEMLOCK` (exit 2 with the
//! numbers under `tierzero.memlock = "require"`, one warning under
//! `"auto"`), a file-size limit standing in for a full disk (an error
//! naming the file and the operation, exit 2, no panic), and an nvme_path
//! that refuses O_DIRECT (one warning under `direct_io: "auto"`, exit 2
//! naming the fix under `"require"`), and a model whose pinned pages and
//! host-memory optimizer state exceed the machine's memory (exit 2 with
//! the numbers, before anything is mapped), and swap files beyond the
//! disk's free space (exit 2 with the numbers, before any is allocated).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod cli_support;
use cli_support::Out;

fn scratch(tag: &str) -> PathBuf {
    cli_support::scratch("cli-limits", tag)
}

/// A tiny GPT-2, a text file and a ds_config with both offloads on NVMe in
/// `swap` (created if missing).
fn tiny_setup(tag: &str, swap: &Path, tierzero: Value) -> PathBuf {
    let d = scratch(tag);
    std::fs::create_dir_all(d.join("model")).unwrap();
    std::fs::create_dir_all(swap).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let text = "the engine streams every layer from nvme while adam steps on the cpu. ".repeat(60);
    std::fs::write(d.join("data.txt"), text).unwrap();
    let swap = swap.to_str().unwrap();
    let cfg = json!({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap, "buffer_count": 4,
                "buffer_size": 20000, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "sub_group_size": 10000,
            "stage3_param_persistence_threshold": 0
        },
        "tierzero": tierzero
    });
    std::fs::write(d.join("ds_config.json"), cfg.to_string()).unwrap();
    d
}

fn tiny_args(steps: &str) -> Vec<&str> {
    vec![
        "train",
        "--config",
        "ds_config.json",
        "--model",
        "model",
        "--data",
        "data.txt",
        "--seq-len",
        "16",
        "--steps",
        steps,
    ]
}

/// Runs `wrapper... tierzero args...` in `cwd`.
fn run_wrapped(cwd: &Path, wrapper: &[&str], args: &[&str]) -> Out {
    if wrapper.is_empty() {
        return cli_support::run_tierzero(Some(cwd), args);
    }
    let out = Command::new(wrapper[0])
        .args(&wrapper[1..])
        .arg(env!("CARGO_BIN_EXE_tierzero"))
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn assert_no_panic(o: &Out) {
    assert!(
        !o.stderr.contains("panicked") && !o.stderr.contains("RUST_BACKTRACE"),
        "{}",
        o.stderr
    );
}

fn our_swap_files(swap: &Path, pid: u32) -> Vec<String> {
    std::fs::read_dir(swap.join("tierzero"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&format!("swap-{pid}-")))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_second_run_on_the_same_nvme_path_exits_2_naming_the_lock_and_its_holder() {
    let swap = scratch("shared-swap");
    let d = tiny_setup("lock", &swap, json!({}));
    let lock = swap.join("tierzero").join("lock");
    let mut first = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(tiny_args("1000000"))
        .current_dir(&d)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let holder = first.id();
    // Wait until the first run holds the lock and has its swap files.
    let t0 = Instant::now();
    while std::fs::read_to_string(&lock).unwrap_or_default().trim() != holder.to_string()
        || our_swap_files(&swap, holder).len() < 2
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "first run never locked"
        );
        if let Some(s) = first.try_wait().unwrap() {
            panic!("first run exited early: {s}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let files_before = our_swap_files(&swap, holder);

    let second = run_wrapped(&d, &[], &tiny_args("1"));
    assert_eq!(second.code, 2, "{}", second.stderr);
    let lines: Vec<&str> = second.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{}", second.stderr);
    assert!(
        lines[0].contains(&lock.display().to_string())
            && lines[0].contains(&format!("pid {holder}"))
            && lines[0].contains("locked"),
        "{}",
        lines[0]
    );
    // The first run is untouched and still training.
    assert!(first.try_wait().unwrap().is_none(), "the first run died");
    assert_eq!(our_swap_files(&swap, holder), files_before);

    // Killed with SIGKILL, it leaves a stale lock file that does not block.
    first.kill().unwrap();
    first.wait().unwrap();
    let third = run_wrapped(&d, &[], &tiny_args("1"));
    assert_eq!(third.code, 0, "{}", third.stderr);
    assert!(
        our_swap_files(&swap, holder).is_empty(),
        "the killed run's files were reclaimed"
    );
    let _ = std::fs::remove_dir_all(&d);
    let _ = std::fs::remove_dir_all(&swap);
}

/// A 65B-param GPT-2 shape (its config only) and a short text in a new
/// scratch dir.
fn big_gpt2(tag: &str) -> PathBuf {
    let d = scratch(tag);
    std::fs::create_dir_all(d.join("model")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 32000, "n_positions": 32,
        "n_embd": 8192, "n_layer": 80, "n_head": 64, "tie_word_embeddings": true});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let text = "the engine streams every layer from nvme while adam steps on the cpu. ".repeat(60);
    std::fs::write(d.join("data.txt"), text).unwrap();
    d
}

/// One step of `d`'s model under `cfg`, refused (exit 2, no panic): its
/// error line, and when the run began.
fn refused_with(d: &Path, cfg: &Value) -> (String, Instant) {
    std::fs::write(d.join("ds_config.json"), cfg.to_string()).unwrap();
    let started = Instant::now();
    let o = run_wrapped(d, &[], &tiny_args("1"));
    assert_no_panic(&o);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let line = o.stderr.lines().find(|l| l.starts_with("error:")).unwrap();
    (line.to_owned(), started)
}

/// A model whose pinned param pages and host-memory optimizer state need
/// far more than this machine's memory (a 65B-param GPT-2 shape, both
/// offloads on the CPU; then nothing offloaded) is refused at start-up
/// with the numbers and the fix, exit 2: the pinned arena's mapping
/// failed as an internal error naming NVMe swap (exit 1), and with
/// nothing offloaded the optimizer state's allocation aborted the
/// process (or the OOM killer took it).
#[test]
fn a_run_larger_than_host_memory_is_refused_with_the_numbers() {
    let d = big_gpt2("host-memory");
    for (offload, pinned) in [
        (json!({"device": "cpu"}), true),
        (json!({"device": "none"}), false),
    ] {
        let cfg = json!({
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "offload_param": offload,
                "offload_optimizer": {"device": "cpu"}},
        });
        let (line, started) = refused_with(&d, &cfg);
        for want in [
            "of optimizer state in host memory",
            "of host memory is available",
            "NVMe",
        ] {
            assert!(line.contains(want), "{want}: {line}");
        }
        assert_eq!(
            !line.contains("needs 0 B of pinned"),
            pinned,
            "pinned pages counted: {line}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
    }
}

/// Swap files larger than the free space of the nvme_path's file system
/// are refused before any is allocated, naming the file, the numbers, this
/// rank's total there and the keys to change (exit 2, nothing left on
/// disk). The allocation's `ENOSPC` was reported as a failed write of the
/// file (no total, no fix), and so it was as a root without
/// `CAP_SYS_RESOURCE` whose check counted the file system's reserve. A
/// GPT-2 shape of 55B params in 1,100 narrow layers needs 221 GB for its
/// params' file alone, and its host memory fits this machine (a wide 65B
/// shape is refused for that first).
#[test]
fn swap_beyond_the_free_disk_space_is_refused_with_the_numbers() {
    let d = scratch("nvme-space");
    std::fs::create_dir_all(d.join("model")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 32000, "n_positions": 32,
        "n_embd": 2048, "n_layer": 1100, "n_head": 16, "tie_word_embeddings": true});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let text = "the engine streams every layer from nvme while adam steps on the cpu. ".repeat(60);
    std::fs::write(d.join("data.txt"), text).unwrap();
    std::fs::create_dir_all(d.join("swap")).unwrap();
    // A small tmpfs where we may mount one (root, as CI): the refusal is
    // then tested on any machine, not only where the disk has under
    // 200 GiB free (elsewhere it skipped).
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount =
        mount("tmpfs", "size=64m,mode=0700", &d.join("swap")).then(|| Unmount(d.join("swap")));
    let fs = tierzero_swap::space::filesystem_space(&d.join("swap")).unwrap();
    if fs.usable_bytes() > 200 << 30 {
        assert!(
            std::env::var("TIERZERO_REQUIRE_NO_ODIRECT").as_deref() != Ok("1"),
            "CI mounts file systems (TIERZERO_REQUIRE_NO_ODIRECT=1), but a tmpfs could not be \
             mounted at {}",
            d.join("swap").display()
        );
        cli_support::skipped(format_args!("{fs:?} under {}", d.display()));
        return;
    }
    let cfg = json!({
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "sub_group_size": 10_000_000,
            "offload_param": {"device": "nvme", "nvme_path": "swap", "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": "swap"}},
    });
    let (line, started) = refused_with(&d, &cfg);
    for want in [
        "the swap file for the params (swap/tierzero/swap-",
        "and its file system has",
        "this rank's swap under zero_optimization.offload_param.nvme_path = swap needs",
        "point zero_optimization.offload_param.nvme_path at a drive with more room",
        "zero_optimization.offload_param.device \"cpu\"",
    ] {
        assert!(line.contains(want), "{want}: {line}");
    }
    let left: Vec<_> = std::fs::read_dir(d.join("swap"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "left on disk: {left:?}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

/// A head whose fp32 logits (micro-batch x seq x vocab) cannot fit the
/// machine's memory is refused before anything is allocated, naming the
/// numbers and the flag, in train and in eval: the allocation aborted the
/// process ("memory allocation of 32768000000 bytes failed", exit 134).
/// A vocab of 16M at 16 x 1024 tokens is 1 TB a copy.
#[test]
fn logits_larger_than_host_memory_are_refused_with_the_numbers() {
    let d = scratch("logits-memory");
    std::fs::create_dir_all(d.join("model")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 16_000_000, "n_positions": 1024,
        "n_embd": 8, "n_layer": 1, "n_head": 1});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    // 16 windows of 1024 bytes (tokens) and more.
    let text = "the engine streams every layer from nvme while adam steps on the cpu. ".repeat(240);
    std::fs::write(d.join("data.txt"), text).unwrap();
    let cfg = json!({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 0}});
    std::fs::write(d.join("ds_config.json"), cfg.to_string()).unwrap();
    let mut train = tiny_args("1");
    let at = train.iter().position(|a| *a == "16").unwrap();
    train[at] = "1024";
    let eval = [
        "eval",
        "--model",
        "model",
        "--data",
        "data.txt",
        "--seq-len",
        "1024",
        "--batch",
        "16",
    ];
    // A text shorter than one window is one partial window, its logits
    // counted too (they were not: the allocation aborted the process).
    std::fs::write(d.join("short.txt"), "x".repeat(1000)).unwrap();
    let mut short = eval;
    short[4] = "short.txt";
    for (args, want) in [
        (&train[..], "lower train_micro_batch_size_per_gpu"),
        (
            &eval[..],
            "--batch: a batch of 16 windows of 1024 positions",
        ),
        (
            &short[..],
            "--seq-len: a batch of 1 windows of 1000 positions",
        ),
    ] {
        let started = Instant::now();
        let o = run_wrapped(&d, &[], args);
        assert_no_panic(&o);
        assert_eq!(o.code, 2, "{args:?}: {}", o.stderr);
        assert!(o.stderr.contains(want), "{want}: {}", o.stderr);
        assert!(
            o.stderr.contains("of host memory is available"),
            "{}",
            o.stderr
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
    }
}

fn have_setpriv_prlimit() -> bool {
    Path::new("/usr/bin/setpriv").exists() && Path::new("/usr/bin/prlimit").exists()
}

#[test]
fn pinned_buffers_above_rlimit_memlock_refuse_or_warn_by_policy() {
    if !have_setpriv_prlimit() {
        cli_support::skipped("setpriv/prlimit not installed");
        return;
    }
    // No CAP_IPC_LOCK, and a 64 KiB limit: the tiny run pins ~700 KB.
    let wrapper = [
        "/usr/bin/setpriv",
        "--inh-caps=-ipc_lock",
        "--bounding-set=-ipc_lock",
        "/usr/bin/prlimit",
        "--memlock=65536:65536",
    ];
    let swap = scratch("memlock-swap");
    let d = tiny_setup("memlock-require", &swap, json!({"memlock": "require"}));
    let o = run_wrapped(&d, &wrapper, &tiny_args("1"));
    assert_no_panic(&o);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let lines: Vec<&str> = o.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{}", o.stderr);
    // The numbers, and fixes that work for what the run locks: the limit,
    // running unlocked, fewer or smaller swap buffers (the message named
    // "the pinned budget", which sizes nothing here, under a prefix that
    // said NVMe swap also for the cpu tier's pages).
    for want in [
        "the run page-locks",
        "RLIMIT_MEMLOCK allows 64 KiB more (65536 bytes, 0 locked already)",
        "ulimit -l",
        "tierzero.memlock \"auto\"",
        "pin_memory false",
        "offload_param.buffer_count",
    ] {
        assert!(lines[0].contains(want), "{want}: {}", lines[0]);
    }
    assert!(!lines[0].contains("NVMe swap"), "{}", lines[0]);

    let d = tiny_setup("memlock-auto", &swap, json!({"memlock": "auto"}));
    let o = run_wrapped(&d, &wrapper, &tiny_args("1"));
    assert_no_panic(&o);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let warnings = o
        .stderr
        .lines()
        .filter(|l| l.contains("RLIMIT_MEMLOCK"))
        .count();
    assert_eq!(warnings, 1, "{}", o.stderr);
}

#[test]
fn a_file_size_limit_is_an_error_naming_the_file_and_the_operation() {
    if !have_setpriv_prlimit() {
        cli_support::skipped("prlimit not installed");
        return;
    }
    // 64 KiB: smaller than either swap file, so preallocation hits it.
    let swap = scratch("fsize-swap");
    let d = tiny_setup("fsize", &swap, json!({}));
    let o = run_wrapped(&d, &["/usr/bin/prlimit", "--fsize=65536"], &tiny_args("1"));
    assert_no_panic(&o);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let lines: Vec<&str> = o.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{}", o.stderr);
    assert!(
        lines[0].contains(".tzswap")
            && lines[0].contains("write")
            && lines[0].contains("offset")
            && lines[0].contains("File too large")
            && lines[0].contains("ulimit -f"),
        "{}",
        lines[0]
    );
    // Nothing is left behind.
    let left: Vec<_> = std::fs::read_dir(&swap)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // A checkpoint save that hits it is the user's to fix too (exit 2; it
    // was an internal error, exit 1), naming the way back. No swap files
    // here: only the save writes files larger than 64 KiB.
    let cfg = json!({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"}},
    });
    std::fs::write(d.join("ds_config.json"), cfg.to_string()).unwrap();
    let args = [&tiny_args("1")[..], &["--save-dir", "ck"]].concat();
    let o = run_wrapped(&d, &["/usr/bin/prlimit", "--fsize=65536"], &args);
    assert_no_panic(&o);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let line = o.stderr.lines().find(|l| l.starts_with("error:")).unwrap();
    // The run's first save: nothing to resume.
    for want in [
        "saving a checkpoint",
        "File too large",
        "holds no checkpoint to resume",
    ] {
        assert!(line.contains(want), "{want}: {line}");
    }
}

/// The open-file limit, met wherever the run is when it runs out (a
/// ring's setup, a swap file, a checkpoint file), is exit 2 naming the
/// limit and the fix (it was an internal error), and a save it fails
/// names the way back; a limit the run fits in trains. The limits are
/// hard ones (`prlimit --nofile=N` sets both), which tierzero cannot raise.
#[test]
fn the_open_file_limit_is_the_users_to_raise_wherever_it_is_met() {
    if !have_setpriv_prlimit() {
        cli_support::skipped("prlimit not installed");
        return;
    }
    let swap = scratch("nofile-swap");
    let d = tiny_setup("nofile", &swap, json!({}));
    let args = [&tiny_args("2")[..], &["--save-dir", "ck"]].concat();
    let mut refused = 0;
    let mut at_save = 0;
    for n in [6, 8, 10, 12, 14, 16, 64] {
        let _ = std::fs::remove_dir_all(d.join("ck"));
        let limit = format!("--nofile={n}");
        let o = run_wrapped(&d, &["/usr/bin/prlimit", &limit], &args);
        assert_no_panic(&o);
        match o.code {
            0 => continue,
            2 => {}
            c => panic!("--nofile={n}: exit {c}: {}", o.stderr),
        }
        refused += 1;
        let line = o.stderr.lines().find(|l| l.starts_with("error:")).unwrap();
        for want in [
            "Too many open files",
            &format!("ulimit -n: soft {n}, hard {n}"),
            "raise the hard limit",
        ] {
            assert!(line.contains(want), "--nofile={n}: {want}: {line}");
        }
        if line.contains("saving a checkpoint") {
            at_save += 1;
            // The way back: a checkpoint to resume, or none yet.
            assert!(
                line.contains("--resume") || line.contains("holds no checkpoint to resume"),
                "{line}"
            );
        }
    }
    assert!(refused >= 2, "the least limits must be met");
    assert!(at_save >= 1, "one of the limits must be met by the save");
    // 64 is many times what this run holds at once.
    assert!(d.join("ck/latest").exists());
}

/// Whether `dir` accepts O_DIRECT.
fn accepts_o_direct(dir: &Path) -> bool {
    let p = dir.join(".tz-odirect-probe");
    let r = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p);
    let _ = std::fs::remove_file(&p);
    r.is_ok()
}

/// Mounts a file system of type `fs` with `options` at `dir` (root only):
/// whether it did.
fn mount(fs: &str, options: &str, dir: &Path) -> bool {
    Command::new("mount")
        .args(["-t", fs, "-o", options, fs])
        .arg(dir)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A directory on a file system that refuses O_DIRECT: tmpfs on older
/// kernels, else a ramfs mounted for the test (root only; unmounted on drop).
struct NoDirectDir {
    path: PathBuf,
    mounted: bool,
}

impl NoDirectDir {
    fn new() -> Option<NoDirectDir> {
        // The one CI mounted for the tests (`.ci/run`), else /dev/shm.
        let candidates = std::env::var_os("TIERZERO_TEST_NO_ODIRECT_DIR")
            .map(PathBuf::from)
            .into_iter()
            .chain([PathBuf::from("/dev/shm")]);
        for base in candidates {
            if let Ok(t) = tempfile::tempdir_in(&base) {
                let path = t.keep();
                if !accepts_o_direct(&path) {
                    return Some(NoDirectDir {
                        path,
                        mounted: false,
                    });
                }
                let _ = std::fs::remove_dir_all(&path);
            }
        }
        // tmpfs does O_DIRECT since Linux 6.6; ramfs never does.
        let path = scratch("ramfs");
        if !mount("ramfs", "mode=0700", &path) {
            return None;
        }
        let d = NoDirectDir {
            path,
            mounted: true,
        };
        (!accepts_o_direct(&d.path)).then_some(d)
    }
}

impl Drop for NoDirectDir {
    fn drop(&mut self) {
        if self.mounted {
            // Lazy: a process of a concurrent test may still hold it for a
            // moment; it goes away when the last user does.
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[test]
fn an_nvme_path_without_o_direct_warns_once_or_refuses_by_policy() {
    let Some(nd) = NoDirectDir::new() else {
        let why = "no file system without O_DIRECT available (tmpfs does O_DIRECT here and ramfs cannot be mounted)";
        assert!(
            std::env::var("TIERZERO_REQUIRE_NO_ODIRECT").as_deref() != Ok("1"),
            "TIERZERO_REQUIRE_NO_ODIRECT=1, but {why}"
        );
        cli_support::skipped(why);
        return;
    };
    let swap = nd.path.join("swap");
    let d = tiny_setup("nodirect-auto", &swap, json!({"direct_io": "auto"}));
    let o = run_wrapped(&d, &[], &tiny_args("2"));
    assert_no_panic(&o);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let warnings: Vec<&str> = o.stderr.lines().filter(|l| l.contains("WARN")).collect();
    // One for O_DIRECT; and where the file system cannot preallocate
    // (ramfs), one saying the swap files are sparse, unreserved (it was
    // silent while `preallocate` promised the room).
    let probe = nd.path.join("fallocate-probe");
    let preallocates = Command::new("fallocate")
        .args(["-l", "4096"])
        .arg(&probe)
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success());
    let _ = std::fs::remove_file(&probe);
    if let Ok(p) = preallocates {
        assert_eq!(warnings.len(), 1 + usize::from(!p), "{}", o.stderr);
    }
    assert!(warnings[0].contains("O_DIRECT"), "{}", warnings[0]);
    for w in &warnings[1..] {
        assert!(
            w.contains("cannot preallocate") && w.contains("sparse"),
            "{w}"
        );
    }

    let d = tiny_setup("nodirect-require", &swap, json!({"direct_io": "require"}));
    let o = run_wrapped(&d, &[], &tiny_args("1"));
    assert_no_panic(&o);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let lines: Vec<&str> = o.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{}", o.stderr);
    assert!(
        lines[0].contains("does not support O_DIRECT")
            && lines[0].contains("direct_io")
            && lines[0].contains("auto"),
        "{}",
        lines[0]
    );
    drop(nd);
}

/// A report written into a closed pipe (`tierzero bench-io ... | head`)
/// ends quietly: it panicked on `println!` (exit 101).
#[test]
fn a_bench_report_into_a_closed_pipe_does_not_panic() {
    let d = cli_support::scratch("limits", "pipe");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args([
            "bench-io",
            "--path",
            ".",
            "--size",
            "1M",
            "--block-size",
            "128K",
            "--queue-depth",
            "1",
            "--seconds",
            "0.2",
            "--json",
        ])
        .current_dir(&d)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run tierzero");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// SIGTERM (or Ctrl-C) during `bench-io` removes the file it made and
/// its lock: the signal's default action left them (4 GiB by default)
/// until the next run in that directory.
#[test]
fn a_signal_during_bench_io_removes_its_file() {
    let d = cli_support::scratch("limits", "bench-signal");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(["bench-io", "--path", ".", "--size", "64M"])
        .args([
            "--block-size",
            "4K",
            "--queue-depth",
            "1,2",
            "--seconds",
            "10",
        ])
        .current_dir(&d)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tierzero");
    // Its file, filled, then the runs: signalled once the file is there.
    let t0 = Instant::now();
    let made = |d: &Path| {
        std::fs::read_dir(d.join("tierzero")).is_ok_and(|mut e| {
            e.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".tzswap")))
        })
    };
    while !made(&d) {
        assert!(t0.elapsed() < Duration::from_secs(60), "no benchmark file");
        assert!(child.try_wait().unwrap().is_none(), "ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{stderr}");
    assert!(
        stderr.contains("SIGTERM received: removing the benchmark file"),
        "{stderr}"
    );
    assert!(
        !d.join("tierzero").exists(),
        "left behind: {:?}",
        std::fs::read_dir(d.join("tierzero")).map(|e| e.count())
    );
}

/// A --size that is not whole O_DIRECT blocks is rounded up, not down: a
/// --size of 5000 measured a 4 KiB file.
#[test]
fn a_bench_size_is_rounded_up_to_whole_blocks() {
    let d = cli_support::scratch("limits", "bench-size-up");
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args([
            "bench-io",
            "--path",
            ".",
            "--size",
            "5000",
            "--block-size",
            "4K",
        ])
        .args(["--queue-depth", "1", "--seconds", "0.05"])
        .current_dir(&d)
        .output()
        .expect("run tierzero");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("(8 KiB, "), "{stdout}");
}

/// A sparse --file larger than its disk's free space is refused before
/// any write, with the numbers (the write runs filled the disk and failed
/// as a poisoned swap space); reads alone are the way to measure it.
#[test]
fn a_sparse_bench_file_the_disk_cannot_fill_is_refused() {
    let d = cli_support::scratch("limits", "bench-sparse");
    let f = std::fs::File::create(d.join("sparse.bin")).unwrap();
    if f.set_len(10 << 40).is_err() {
        cli_support::skipped("no 10 TiB sparse file here");
        return;
    }
    drop(f);
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(["bench-io", "--file", "sparse.bin", "--block-size", "4K"])
        .args(["--queue-depth", "1", "--seconds", "0.05"])
        .current_dir(&d)
        .output()
        .expect("run tierzero");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for want in ["is sparse", "not allocated", "free", "--rw read --no-fill"] {
        assert!(stderr.contains(want), "{want}: {stderr}");
    }
    assert_eq!(
        std::fs::metadata(d.join("sparse.bin")).unwrap().len(),
        10 << 40
    );
    let _ = std::fs::remove_file(d.join("sparse.bin"));
    // Reads alone of a sparse file run, warned about: its holes read as
    // zeros without touching the device (34 GB/s on a 2 GB/s disk).
    std::fs::File::create(d.join("holes.bin"))
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args([
            "bench-io",
            "--file",
            "holes.bin",
            "--rw",
            "read",
            "--no-fill",
        ])
        .args([
            "--block-size",
            "1M",
            "--queue-depth",
            "1",
            "--seconds",
            "0.05",
        ])
        .current_dir(&d)
        .output()
        .expect("run tierzero");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("warning: --file holes.bin: 8 MiB of its 8 MiB hold no data"),
        "{stderr}"
    );
}

/// A signal that comes while the file is being made, before the watcher
/// that removes it runs (the failpoint stops the process there), still
/// removes it and exits 128 + the signal: its default action killed the
/// process and left the whole --size file.
#[test]
fn a_signal_while_bench_io_makes_its_file_removes_it() {
    let d = cli_support::scratch("limits", "bench-early-signal");
    let child = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args([
            "bench-io",
            "--path",
            ".",
            "--size",
            "64M",
            "--block-size",
            "4K",
        ])
        .args(["--queue-depth", "1", "--seconds", "10"])
        .env("TIERZERO_FAILPOINT", "bench.file_made:1:stop")
        .current_dir(&d)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tierzero");
    let t0 = Instant::now();
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap();
        if stat.rsplit(')').next().unwrap().split_whitespace().next() == Some("T") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "never stopped");
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = child.id().to_string();
    for sig in ["-INT", "-CONT"] {
        assert!(Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    }
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("SIGINT received: removing the benchmark file"),
        "{stderr}"
    );
    assert!(!d.join("tierzero").exists(), "left behind");
}

/// A swap file's blocks are free when the process that made it has
/// exited: a second `bench-io` right after the first, on a tmpfs that
/// holds one file, runs. The io_uring rings kept the files registered and
/// the kernel tore them down after the exit, so the second run was refused
/// for room (3 of 3 runs). Root only (mounts a tmpfs), else skipped.
#[test]
fn a_second_run_right_after_the_first_finds_its_room() {
    let dir = scratch("room-after-exit");
    if !mount("tmpfs", "size=48m,mode=0700", &dir) {
        // CI mounts its ramfs (TIERZERO_REQUIRE_NO_ODIRECT=1): there a
        // failed mount is a failure, not a skip.
        assert!(
            std::env::var("TIERZERO_REQUIRE_NO_ODIRECT").as_deref() != Ok("1"),
            "TIERZERO_REQUIRE_NO_ODIRECT=1, but a tmpfs could not be mounted at {}",
            dir.display()
        );
        cli_support::skipped(format_args!("cannot mount a tmpfs at {}", dir.display()));
        return;
    }
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(self.0).status();
        }
    }
    let _unmount = Unmount(&dir);
    let path = dir.to_str().unwrap();
    for run in 1..=3 {
        let o = cli_support::run_tierzero(
            Some(&dir),
            &[
                "bench-io",
                "--path",
                path,
                "--size",
                "40MiB",
                "--seconds",
                "0.05",
                "--block-size",
                "1M",
                "--queue-depth",
                "4",
            ],
        );
        assert_no_panic(&o);
        assert_eq!(o.code, 0, "run {run}: {}", o.stderr);
    }
}

/// bench-io under an RLIMIT_MEMLOCK below its largest run's buffers (the
/// fill alone maps 64 MiB) measures with pageable buffers, said once,
/// rather than failing every sweep (the default limit is 8 MiB).
#[test]
fn bench_io_under_a_low_memlock_limit_measures_with_pageable_buffers() {
    if !have_setpriv_prlimit() {
        cli_support::skipped("setpriv/prlimit not installed");
        return;
    }
    let d = cli_support::scratch("limits", "bench-memlock");
    let o = run_wrapped(
        &d,
        &[
            "/usr/bin/setpriv",
            "--inh-caps=-ipc_lock",
            "--bounding-set=-ipc_lock",
            "/usr/bin/prlimit",
            "--memlock=8388608:8388608",
        ],
        &[
            "bench-io",
            "--path",
            ".",
            "--size",
            "4MiB",
            "--block-size",
            "64K",
            "--queue-depth",
            "1,4",
            "--seconds",
            "0.05",
            "--json",
        ],
    );
    assert_no_panic(&o);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let warned: Vec<&str> = o
        .stderr
        .lines()
        .filter(|l| l.contains("RLIMIT_MEMLOCK") || l.contains("WARN"))
        .collect();
    assert_eq!(warned.len(), 1, "{}", o.stderr);
    assert!(warned[0].contains("pageable buffers"), "{}", warned[0]);
    let v: Value = serde_json::from_str(o.stdout.trim()).unwrap();
    assert_eq!(v["settings"].as_array().unwrap().len(), 2, "{v}");
}

/// `bench-io --file` on a swap file of a running tierzero (its directory's
/// lock held: here by this test) is refused naming the holder: its write
/// runs overwrote the run's swap file, whose next read failed its checksum.
#[test]
fn bench_io_refuses_a_file_under_a_held_swap_lock() {
    let d = cli_support::scratch("limits", "bench-locked");
    std::fs::write(d.join("f.dat"), vec![0u8; 1 << 20]).unwrap();
    let lock = tierzero_swap::lock::DirLock::acquire(&d).unwrap();
    assert!(lock.is_some(), "no lock on {}", d.display());
    let o = cli_support::run_tierzero(
        Some(&d),
        &["bench-io", "--file", "f.dat", "--no-fill", "--rw", "write"],
    );
    assert_eq!(o.code, 2, "{}", o.stderr);
    let pid = format!("(pid {})", std::process::id());
    assert!(
        o.stderr.contains("--file f.dat") && o.stderr.contains(&pid),
        "{}",
        o.stderr
    );
    drop(lock);
    // A --path whose tierzero/ another process uses: named with its flag
    // (it said "give this run its own nvme_path").
    std::fs::create_dir_all(d.join("tierzero")).unwrap();
    let lock = tierzero_swap::lock::DirLock::acquire(&d.join("tierzero")).unwrap();
    assert!(lock.is_some());
    let o = cli_support::run_tierzero(Some(&d), &["bench-io", "--path", ".", "--size", "1M"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr.contains("--path .: another tierzero process") && o.stderr.contains(&pid),
        "{}",
        o.stderr
    );
    drop(lock);
    let o = cli_support::run_tierzero(
        Some(&d),
        &[
            "bench-io",
            "--file",
            "f.dat",
            "--no-fill",
            "--rw",
            "write",
            "--block-size",
            "64K",
            "--queue-depth",
            "1",
            "--seconds",
            "0.05",
        ],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
}

/// `bench-io` does not write into a checkpoint: `--file` on a step's state
/// file with writes (the fill or a write run overwrote its master weights,
/// found only at the next `inspect --verify`), and a `--path` inside a step
/// dir, are refused naming the checkpoint; reading it alone is fine.
#[test]
fn bench_io_does_not_write_into_a_checkpoint() {
    let d = cli_support::scratch("limits", "bench-checkpoint");
    let step = d.join("ck").join("step-00000002");
    std::fs::create_dir_all(step.join("rank0000")).unwrap();
    std::fs::write(step.join("manifest.json"), b"{}").unwrap();
    let state = vec![5u8; 1 << 20];
    std::fs::write(step.join("rank0000/master.f32"), &state).unwrap();
    let quick = [
        "--block-size",
        "64K",
        "--queue-depth",
        "1",
        "--seconds",
        "0.05",
    ];
    let file = "ck/step-00000002/rank0000/master.f32";
    for extra in [&["--rw", "write", "--no-fill"][..], &["--rw", "read"][..]] {
        let o = cli_support::run_tierzero(
            Some(&d),
            &[&["bench-io", "--file", file][..], extra, &quick].concat(),
        );
        assert_eq!(o.code, 2, "{extra:?}: {}", o.stderr);
        assert!(
            o.stderr.contains("is inside the checkpoint directory")
                && o.stderr.contains("step-00000002"),
            "{}",
            o.stderr
        );
    }
    assert_eq!(
        std::fs::read(step.join("rank0000/master.f32")).unwrap(),
        state
    );
    let o = cli_support::run_tierzero(
        Some(&d),
        &[
            &["bench-io", "--file", file, "--rw", "read", "--no-fill"][..],
            &quick,
        ]
        .concat(),
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = cli_support::run_tierzero(
        Some(&d),
        &["bench-io", "--path", "ck/step-00000002", "--size", "1M"],
    );
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr.contains("--path ck/step-00000002: is inside"),
        "{}",
        o.stderr
    );
    assert!(!step.join("tierzero").exists());
}

/// `--rw read --no-fill` opens `--file` read-only, so a file the user may
/// only read is measured (it was opened read-write: "Permission denied");
/// with writes the refusal says so and names the read-only way. Root
/// only (runs as nobody), else skipped.
#[test]
fn bench_io_reads_a_file_it_may_not_write() {
    if !Path::new("/usr/bin/setpriv").exists() || !running_as_root() {
        cli_support::skipped("needs root and setpriv");
        return;
    }
    let t = tempfile::Builder::new()
        .prefix("tz-ro-")
        .tempdir_in("/tmp")
        .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let f = t.path().join("f.dat");
    std::fs::write(&f, vec![7u8; 1 << 20]).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    let nobody = [
        "/usr/bin/setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
    ];
    let file = f.to_str().unwrap();
    let base = [
        "bench-io",
        "--file",
        file,
        "--block-size",
        "64K",
        "--queue-depth",
        "1",
        "--seconds",
        "0.05",
    ];
    let o = run_wrapped(
        t.path(),
        &nobody,
        &[&base[..], &["--rw", "read", "--no-fill"]].concat(),
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = run_wrapped(t.path(), &nobody, &base);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr.contains("opened read-write") && o.stderr.contains("--rw read --no-fill"),
        "{}",
        o.stderr
    );
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|u| u.split_whitespace().nth(1).map(|e| e == "0"))
        .unwrap_or(false)
}

/// bench-io flags that would give wrong numbers or be ignored are refused
/// (exit 2) before any file is made: `--no-fill` on the new file under
/// `--path` (its reads would measure unwritten extents, which return zeros
/// without touching the device), `--size` with `--file` (the file's own
/// length is measured), and `--seconds 0` (checked only after a fill of
/// up to 4 GiB before).
#[test]
fn bench_io_refuses_flags_that_would_mislead() {
    let d = cli_support::scratch("limits", "bench-flags");
    std::fs::write(d.join("f.dat"), vec![0u8; 1 << 20]).unwrap();
    for (args, words) in [
        (
            vec!["--path", ".", "--no-fill"],
            vec!["--no-fill", "--path"],
        ),
        (
            vec!["--file", "f.dat", "--size", "1M"],
            vec!["--size", "--file"],
        ),
        (
            vec!["--path", ".", "--size", "1M", "--seconds", "0"],
            vec!["--seconds"],
        ),
        (
            vec!["--path", ".", "--size", "1M", "--queue-depth", "0"],
            vec!["queue depths >= 1"],
        ),
        (
            vec!["--path", ".", "--size", "1M", "--block-size", "1000"],
            vec!["--block-size 1000", "multiple of 4096"],
        ),
        // Past what a ring or a request takes: refused before the fill
        // too (they were refused after it, and the rows before them were
        // lost).
        (
            vec!["--path", ".", "--size", "1M", "--queue-depth", "1,4097"],
            vec!["--queue-depth 4097", "at most 4096"],
        ),
        (
            vec!["--path", ".", "--size", "1M", "--block-size", "1M,2G"],
            vec!["--block-size 2 GiB", "at most 2147479552"],
        ),
        (
            vec!["--path", "no-such-dir", "--size", "1M"],
            vec!["--path no-such-dir: no such directory"],
        ),
        (
            vec!["--path", ".", "--size", "1M", "--seconds", "inf"],
            vec!["--seconds inf", "finite"],
        ),
        (vec!["--path", ".", "--size", "0"], vec!["--size 0"]),
        (
            vec!["--path", ".", "--size", "1000TiB"],
            vec!["--size 1000 TiB", "free", "smaller --size"],
        ),
    ] {
        let mut all = vec!["bench-io"];
        all.extend(&args);
        let out = cli_support::run_tierzero(Some(&d), &all);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
        assert!(
            !out.stderr.contains("writing 1 MiB once"),
            "{args:?}: filled first: {}",
            out.stderr
        );
        for w in words {
            assert!(
                out.stderr.contains(w),
                "{args:?}: `{w}` missing: {}",
                out.stderr
            );
        }
    }
    assert!(
        !d.join("tierzero").exists()
            || std::fs::read_dir(d.join("tierzero"))
                .unwrap()
                .next()
                .is_none(),
        "a benchmark file was left"
    );
}

/// `bench-adam --isa` naming an instruction set this CPU lacks is bad
/// input (exit 2, one line), not an internal error (it was exit 1).
#[test]
fn an_isa_this_cpu_lacks_is_bad_input() {
    use tierzero::optim::Isa;
    let Some((flag, _)) = [("avx512bf16", Isa::Avx512Bf16), ("avx512", Isa::Avx512)]
        .into_iter()
        .find(|(_, isa)| !isa.is_supported())
    else {
        cli_support::skipped("this CPU supports every --isa");
        return;
    };
    let out = cli_support::run_tierzero(
        None,
        &[
            "bench-adam",
            "--params",
            "1K",
            "--isa",
            flag,
            "--steps",
            "1",
            "--repeats",
            "1",
        ],
    );
    cli_support::assert_bad_input(&out, "isa", &["--isa", "does not support"]);
}

/// A timeline the disk has no room for at the end of a run is the user's,
/// as a --metrics file's is: exit 2 after the summary, naming the fix (it
/// was exit 1, "internal error"). Root only (mounts a full tmpfs).
#[test]
fn a_timeline_the_disk_cannot_hold_is_the_user_s() {
    let full = scratch("timeline-full");
    if !mount("tmpfs", "size=1m,mode=0700", &full) {
        assert!(
            std::env::var("TIERZERO_REQUIRE_NO_ODIRECT").as_deref() != Ok("1"),
            "TIERZERO_REQUIRE_NO_ODIRECT=1, but a tmpfs could not be mounted at {}",
            full.display()
        );
        cli_support::skipped(format_args!("cannot mount a tmpfs at {}", full.display()));
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(full.clone());
    // Filled, a page short of the end.
    let _ = std::fs::write(full.join("fill"), vec![0u8; 1 << 20]);
    let swap = scratch("timeline-full-swap");
    let d = tiny_setup("timeline-full-run", &swap, json!({}));
    let timeline = full.join("t.json");
    let mut args = tiny_args("2");
    args.extend(["--timeline", timeline.to_str().unwrap()]);
    let o = run_wrapped(&d, &[], &args);
    assert_no_panic(&o);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr.contains("--timeline: writing") && o.stderr.contains("free space there"),
        "{}",
        o.stderr
    );
    assert!(!o.stderr.contains("internal error"), "{}", o.stderr);
    assert!(
        o.stdout.contains("done: 2 steps"),
        "the summary: {}",
        o.stdout
    );
    // With --json, stdout's one object, the summary, says it failed too
    // (it read as a success under exit 2).
    args.push("--json");
    let o = run_wrapped(&d, &[], &args);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let obj: Value = serde_json::from_str(o.stdout.trim()).unwrap();
    assert_eq!(obj["steps"], 2, "{obj}");
    assert_eq!(obj["exit_code"], 2, "{obj}");
    assert_eq!(obj["failure"], "bad_input", "{obj}");
    assert!(
        obj["error"]
            .as_str()
            .unwrap()
            .contains("--timeline: writing"),
        "{obj}"
    );
}
