//! Power loss during a checkpoint save, tested: every crash point of the
//! save sequence, with every write that was not yet fsynced lost.
//!
//! In the style of ALICE / CrashMonkey. The file-system operations of three
//! saves (the first into an empty save dir, a second of a later step, and
//! a third that replaces that step dir) are recorded in order by
//! `tierzero::durable::record` (creates, writes, resizes, fsyncs with the
//! file's bytes, renames, directory fsyncs, removals: every operation of
//! `durable` and of the checkpoint writer). A model of the file system
//! then rebuilds, for a crash after every prefix of that log, what the disk
//! may hold:
//!
//! * a file's contents are durable only as of its last fsync (never
//!   synced: nothing);
//! * a create, rename or removal is durable only once its directory has
//!   been fsynced after it.
//!
//! Each crash point is checked in two images, the two extremes of what the
//! rules allow: **synced** (only what the rules make durable), and
//! **+metadata** (every create and rename reached the disk too, as a
//! journal may commit them, but no unsynced data: such files hold zeros of
//! their length). In both:
//!
//! * `Checkpoint::open` of the save dir either opens a checkpoint that
//!   verifies (every crc) or refuses; it refuses only while no save has
//!   completed, and once a save of step N has returned it opens step N or
//!   later (nothing that was saved is lost);
//! * `tierzero inspect --verify` and `tierzero train --resume` on the image
//!   (the binary, once per distinct image) agree: they open that checkpoint
//!   (inspect exits 0, train says "resuming at step N"), or refuse with a
//!   one-line error (exit 2).
//!
//! `--nocapture` prints the table of crash points.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

mod engine_support;

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash as _, Hasher as _};
use std::path::{Path, PathBuf};
use std::process::Command;

use engine_support::{build, ds_config, scratch, tiny_gpt2_dir, Knobs};
use tierzero::checkpoint::{Checkpoint, SaveDirLock};
use tierzero::durable::record::{self, FsOp};

#[derive(Debug, Clone)]
enum Node {
    File {
        len: u64,
        /// Contents as of the last fsync.
        synced: Option<Vec<u8>>,
    },
    Dir {
        /// Entries now.
        cur: BTreeMap<String, usize>,
        /// Entries as of the last fsync of the directory.
        dur: BTreeMap<String, usize>,
    },
}

/// The file-system model of one directory tree (the save dir).
#[derive(Debug, Clone)]
struct Fs {
    root: PathBuf,
    nodes: Vec<Node>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Image {
    /// Only what fsyncs made durable.
    Synced,
    /// Also every create and rename, but no unsynced data.
    Metadata,
}

impl Fs {
    /// Everything under `root` as it is now, all durable.
    fn load(root: &Path) -> Fs {
        let mut fs = Fs {
            root: root.to_path_buf(),
            nodes: Vec::new(),
        };
        fs.load_dir(root);
        fs
    }

    fn load_dir(&mut self, dir: &Path) -> usize {
        let id = self.nodes.len();
        self.nodes.push(Node::Dir {
            cur: BTreeMap::new(),
            dur: BTreeMap::new(),
        });
        let mut entries = BTreeMap::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let child = if e.file_type().unwrap().is_dir() {
                self.load_dir(&e.path())
            } else {
                let bytes = std::fs::read(e.path()).unwrap();
                self.nodes.push(Node::File {
                    len: bytes.len() as u64,
                    synced: Some(bytes),
                });
                self.nodes.len() - 1
            };
            entries.insert(name, child);
        }
        self.nodes[id] = Node::Dir {
            cur: entries.clone(),
            dur: entries,
        };
        id
    }

    /// `path`'s components below the root (`None`: not under it).
    fn rel(&self, path: &Path) -> Option<Vec<String>> {
        let r = path.strip_prefix(&self.root).ok()?;
        Some(
            r.components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect(),
        )
    }

    fn lookup(&self, parts: &[String]) -> usize {
        let mut id = 0;
        for p in parts {
            match &self.nodes[id] {
                Node::Dir { cur, .. } => id = cur[p],
                Node::File { .. } => panic!("{p}: not a directory"),
            }
        }
        id
    }

    fn entries(&mut self, dir: usize) -> &mut BTreeMap<String, usize> {
        match &mut self.nodes[dir] {
            Node::Dir { cur, .. } => cur,
            Node::File { .. } => panic!("not a directory"),
        }
    }

    /// The directory holding `path` and `path`'s name (`None`: outside the
    /// root, or the root itself).
    fn parent_of(&self, path: &Path) -> Option<(usize, String)> {
        let parts = self.rel(path)?;
        let (name, dirs) = parts.split_last()?;
        Some((self.lookup(dirs), name.clone()))
    }

    fn apply(&mut self, op: &FsOp) {
        match op {
            FsOp::CreateFile(p) | FsOp::CreateDir(p) => {
                let Some((dir, name)) = self.parent_of(p) else {
                    return;
                };
                self.nodes.push(match op {
                    FsOp::CreateFile(_) => Node::File {
                        len: 0,
                        synced: None,
                    },
                    _ => Node::Dir {
                        cur: BTreeMap::new(),
                        dur: BTreeMap::new(),
                    },
                });
                let id = self.nodes.len() - 1;
                self.entries(dir).insert(name, id);
            }
            FsOp::Write { path, offset, len } => {
                if let Some(parts) = self.rel(path) {
                    let id = self.lookup(&parts);
                    if let Node::File { len: l, .. } = &mut self.nodes[id] {
                        *l = (*l).max(offset + len);
                    }
                }
            }
            FsOp::SetLen { path, len } => {
                if let Some(parts) = self.rel(path) {
                    let id = self.lookup(&parts);
                    if let Node::File { len: l, .. } = &mut self.nodes[id] {
                        *l = *len;
                    }
                }
            }
            FsOp::Fsync { path, contents } => {
                if let Some(parts) = self.rel(path) {
                    let id = self.lookup(&parts);
                    self.nodes[id] = Node::File {
                        len: contents.len() as u64,
                        synced: Some(contents.clone()),
                    };
                }
            }
            FsOp::FsyncDir(p) => {
                if let Some(parts) = self.rel(p) {
                    let id = self.lookup(&parts);
                    if let Node::Dir { cur, dur } = &mut self.nodes[id] {
                        *dur = cur.clone();
                    }
                }
            }
            FsOp::Rename { from, to } => {
                let (Some((fd, fname)), Some((td, tname))) =
                    (self.parent_of(from), self.parent_of(to))
                else {
                    return;
                };
                let id = self.entries(fd).remove(&fname).unwrap();
                self.entries(td).insert(tname, id);
            }
            FsOp::Remove(p) => {
                if let Some((dir, name)) = self.parent_of(p) {
                    self.entries(dir).remove(&name);
                }
            }
        }
    }

    /// Writes what a crash would leave (`image`) into `out`.
    fn materialize(&self, image: Image, out: &Path) {
        let _ = std::fs::remove_dir_all(out);
        self.write_node(0, image, out);
    }

    fn write_node(&self, id: usize, image: Image, out: &Path) {
        match &self.nodes[id] {
            Node::Dir { cur, dur } => {
                std::fs::create_dir_all(out).unwrap();
                let entries = match image {
                    Image::Synced => dur,
                    Image::Metadata => cur,
                };
                for (name, &child) in entries {
                    self.write_node(child, image, &out.join(name));
                }
            }
            Node::File { len, synced } => {
                let bytes = match (synced, image) {
                    (Some(b), _) => b.clone(),
                    (None, Image::Synced) => Vec::new(),
                    (None, Image::Metadata) => vec![0u8; *len as usize],
                };
                std::fs::write(out, bytes).unwrap();
            }
        }
    }
}

/// A hash of every path and byte under `dir` (distinct images only are
/// run through the binary).
fn fingerprint(dir: &Path) -> u64 {
    fn walk(d: &Path, base: &Path, h: &mut std::collections::hash_map::DefaultHasher) {
        let mut names: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        for p in names {
            p.strip_prefix(base).unwrap().hash(h);
            if p.is_dir() {
                walk(&p, base, h);
            } else {
                std::fs::read(&p).unwrap().hash(h);
            }
        }
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    walk(dir, dir, &mut h);
    h.finish()
}

/// Short names: `step-00000002` → `step-2`, the pid → `<pid>`.
fn short(name: &str) -> String {
    let pid = std::process::id().to_string();
    let mut s = name.replace(&pid, "<pid>");
    while let Some(i) = s.find("step-0") {
        s.replace_range(i + 5..i + 6, "");
    }
    s
}

/// What is on disk in an image, in a few words.
fn describe(dir: &Path) -> String {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".lock")
        .collect();
    names.sort();
    let mut parts = Vec::new();
    for n in names {
        let p = dir.join(&n);
        if n == "latest" {
            let t = std::fs::read_to_string(&p).unwrap_or_default();
            parts.push(if t.trim().is_empty() {
                "latest(empty)".to_owned()
            } else {
                format!("latest={}", short(t.trim()))
            });
        } else if n.starts_with("step-") {
            let ok = Checkpoint::open(&p).is_ok_and(|c| c.verify().ok());
            parts.push(format!("{}{}", short(&n), if ok { "" } else { "(BAD)" }));
        } else if p.is_dir() {
            let manifest = p.join("manifest.json").exists();
            parts.push(format!(
                "{}{}",
                short(&n),
                if manifest { "(+manifest)" } else { "" }
            ));
        } else {
            parts.push(short(&n));
        }
    }
    if parts.is_empty() {
        "(empty)".to_owned()
    } else {
        parts.join(" ")
    }
}

fn describe_op(op: &FsOp, root: &Path) -> String {
    let r = |p: &Path| {
        short(
            &p.strip_prefix(root)
                .map(|x| x.display().to_string())
                .unwrap_or_else(|_| p.display().to_string()),
        )
    };
    match op {
        FsOp::CreateFile(p) => format!("create {}", r(p)),
        FsOp::CreateDir(p) => format!("mkdir {}", r(p)),
        FsOp::Write { path, offset, len } => format!("write {} @{offset}+{len}", r(path)),
        FsOp::SetLen { path, len } => format!("set_len {} {len}", r(path)),
        FsOp::Fsync { path, .. } => format!("fsync {}", r(path)),
        FsOp::FsyncDir(p) => format!("fsync_dir {}", {
            let s = r(p);
            if s.is_empty() {
                ".".to_owned()
            } else {
                s
            }
        }),
        FsOp::Rename { from, to } => format!("rename {} -> {}", r(from), r(to)),
        FsOp::Remove(p) => format!("remove {}", r(p)),
    }
}

/// What the binary did with an image: `inspect --verify` and `--resume`.
#[derive(Debug, Clone)]
struct BinaryView {
    inspect_ok: bool,
    /// `Ok(step)`: resumed at that step; `Err(line)`: refused.
    resume: Result<u64, String>,
}

fn binary_view(img: &Path, work: &Path, opened: Option<u64>) -> BinaryView {
    let bin = env!("CARGO_BIN_EXE_tierzero");
    let inspect = Command::new(bin)
        .args(["inspect", "--verify"])
        .arg(img)
        .output()
        .unwrap();
    let steps = opened.map_or(1, |s| s + 1).to_string();
    let out = Command::new(bin)
        .current_dir(work)
        .args(["train", "--config", "ds.json", "--data", "data.txt"])
        .args(["--seq-len", "16", "--steps", &steps, "--resume"])
        .arg(img)
        .env_remove("TIERZERO_FAILPOINT")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let resume = match out.status.code() {
        Some(0) => {
            let step = stdout
                .lines()
                .find_map(|l| l.strip_prefix("resuming at step "))
                .and_then(|l| l.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{}: no resume line: {stdout}", img.display()));
            Ok(step)
        }
        Some(2) => {
            let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
            assert_eq!(lines.len(), 1, "not one line: {stderr}");
            assert!(lines[0].starts_with("error: --resume "), "{stderr}");
            Err(lines[0].to_owned())
        }
        c => panic!("{}: --resume exited {c:?}: {stderr}", img.display()),
    };
    BinaryView {
        inspect_ok: inspect.status.success(),
        resume,
    }
}

#[test]
fn power_loss_at_every_point_of_a_save_opens_the_last_complete_checkpoint() {
    let t0 = std::time::Instant::now();
    let model = tiny_gpt2_dir("power-loss", 2, 32);
    let k = Knobs::nvme();
    let save = scratch("power-loss-save");
    let mut t = build(&model, &k, 3, 16, 4);
    t.adopt_save_dir_lock(SaveDirLock::acquire(&save).unwrap());
    let initial = Fs::load(&save);

    // Three saves: into an empty save dir (step 1), a later step (2), and
    // step 2 again (the step dir is replaced).
    record::start();
    let mut done_at: Vec<(usize, u64)> = Vec::new();
    t.step().unwrap();
    t.save_checkpoint(&save).unwrap();
    done_at.push((record::snapshot().len(), 1));
    t.step().unwrap();
    t.save_checkpoint(&save).unwrap();
    done_at.push((record::snapshot().len(), 2));
    t.save_checkpoint(&save).unwrap();
    done_at.push((record::snapshot().len(), 2));
    let ops = record::finish();
    drop(t);

    // The binary's run dir: a config and data for `--resume`.
    let work = scratch("power-loss-work");
    std::fs::create_dir_all(work.join("swap")).unwrap();
    std::fs::write(
        work.join("ds.json"),
        ds_config(&k, &work.join("swap"), 4).to_string(),
    )
    .unwrap();
    std::fs::write(
        work.join("data.txt"),
        "power is lost at every point of a save. ".repeat(40),
    )
    .unwrap();

    let img = work.join("image");
    let mut fs = initial.clone();
    let mut seen: HashMap<u64, BinaryView> = HashMap::new();
    let mut rows = Vec::new();
    let mut binary_runs = 0;
    for i in 0..=ops.len() {
        if i > 0 {
            fs.apply(&ops[i - 1]);
        }
        // The newest save that had returned before this crash.
        let saved = done_at
            .iter()
            .filter(|(n, _)| *n <= i)
            .map(|&(_, s)| s)
            .max();
        let mut cells = Vec::new();
        for image in [Image::Synced, Image::Metadata] {
            fs.materialize(image, &img);
            let what = format!(
                "crash after op {i} ({}), {image:?} image",
                if i == 0 {
                    "none".to_owned()
                } else {
                    describe_op(&ops[i - 1], &save)
                }
            );
            let disk = describe(&img);
            let opened = match Checkpoint::open(&img) {
                Ok(c) => {
                    let report = c.verify();
                    assert!(
                        report.ok(),
                        "{what}: opened a checkpoint that does not verify: {disk}: {report:?}"
                    );
                    assert!(
                        Some(c.step()) >= saved,
                        "{what}: the save of step {saved:?} had returned, but the save dir \
                         opens at step {}: {disk}",
                        c.step()
                    );
                    Some(c.step())
                }
                Err(e) => {
                    assert!(
                        saved.is_none(),
                        "{what}: the save of step {saved:?} had returned, but the save dir \
                         does not open: {e}: {disk}"
                    );
                    None
                }
            };
            let fp = fingerprint(&img);
            let view = match seen.get(&fp) {
                Some(v) => v.clone(),
                None => {
                    binary_runs += 1;
                    let v = binary_view(&img, &work, opened);
                    seen.insert(fp, v.clone());
                    v
                }
            };
            assert_eq!(
                view.inspect_ok,
                opened.is_some(),
                "{what}: inspect --verify"
            );
            assert_eq!(
                view.resume.as_ref().ok().copied(),
                opened,
                "{what}: --resume"
            );
            let resumed = match &view.resume {
                Ok(s) => format!("resumes at step {s}"),
                Err(line) if line.contains("not a checkpoint") => {
                    "refuses: not a checkpoint (exit 2)".to_owned()
                }
                Err(line) => format!("refuses: {line} (exit 2)"),
            };
            cells.push((disk, resumed));
        }
        rows.push((
            i,
            if i == 0 {
                "(before the first save)".to_owned()
            } else {
                describe_op(&ops[i - 1], &save)
            },
            cells,
        ));
    }
    let _ = std::fs::remove_dir_all(&img);

    // Consecutive crash points with the same outcome share a row.
    println!("| crash after op | the op | on disk (synced) | --resume | on disk (+metadata) | --resume |");
    println!("|---|---|---|---|---|---|");
    let mut r = 0;
    while r < rows.len() {
        let mut end = r;
        while end + 1 < rows.len() && rows[end + 1].2 == rows[r].2 {
            end += 1;
        }
        let (i, op, cells) = &rows[r];
        let same = cells[0] == cells[1];
        println!(
            "| {} | {op}{} | {} | {} | {} | {} |",
            if end > r {
                format!("{i}-{}", rows[end].0)
            } else {
                i.to_string()
            },
            if end > r {
                format!(" ... {}", rows[end].1)
            } else {
                String::new()
            },
            cells[0].0,
            cells[0].1,
            if same { "same" } else { &cells[1].0 },
            if same { "" } else { &cells[1].1 },
        );
        r = end + 1;
    }
    println!(
        "power_loss: {} operations in 3 saves, {} crash points x 2 images, {} distinct images \
         run through inspect --verify and --resume, {:.1} s",
        ops.len(),
        rows.len(),
        binary_runs,
        t0.elapsed().as_secs_f64()
    );
    assert!(rows.len() >= 20, "only {} crash points", rows.len());
    std::fs::remove_dir_all(&save).unwrap();
    std::fs::remove_dir_all(&work).unwrap();
    std::fs::remove_dir_all(&model).unwrap();
}
