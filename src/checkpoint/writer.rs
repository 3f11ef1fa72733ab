//! Writing a checkpoint: [`StagedCheckpoint`] builds the step dir under a
//! temporary name and commits it (see the module above for the sequence).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::manifest::{check_relative, FileEntry, Manifest, RegionCrc, MANIFEST_FILE};
use super::{io_err, CheckpointError, SaveDirLock};
use crate::durable;
use crate::failpoint::{self, Site};

/// The pointer file in a save dir.
pub const LATEST_FILE: &str = "latest";

/// An entry of `dir`, a step dir a save is about to replace, that no
/// checkpoint holds, when `dir` has no manifest: a directory a user made
/// under a step's name (a save removed it, and the files in it). With a
/// manifest it is a checkpoint (damaged or not), and so is a dir holding
/// only what checkpoints hold (one whose manifest was lost).
fn foreign_entry(dir: &Path) -> Option<String> {
    if dir.join(MANIFEST_FILE).exists() {
        return None;
    }
    let ours = |name: &str| {
        name.starts_with(MANIFEST_FILE)
            || name == "model.safetensors"
            || name == "config.json"
            || name
                .strip_prefix("rank")
                .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
    };
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| !ours(n))
}

/// `step-<NNNNNNNN>`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step of a `step-<digits>` name.
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The pid of a `.step-<N>.tmp-<pid>` or `.step-<N>.old-<pid>` name.
pub(crate) fn staging_owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(".step-")?;
    let (step, pid) = rest
        .split_once(".tmp-")
        .or_else(|| rest.split_once(".old-"))?;
    parse_step_dir_name(&format!("step-{step}"))?;
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// The `step-N` name of a `.step-N.old-<pid>` dir (a step a save moved
/// aside to replace it).
fn moved_aside_step(name: &str) -> Option<String> {
    let rest = name.strip_prefix(".step-")?;
    let (step, _) = rest.split_once(".old-")?;
    Some(format!("step-{step}"))
}

/// The staging dirs this process is writing (begun, neither committed
/// nor dropped; see [`tierzero_swap::process::OwnPaths`]).
static OWN_STAGING: tierzero_swap::process::OwnPaths = tierzero_swap::process::OwnPaths::new();

/// `.step-N.old-<pid>` at `path`, whose `step-N` is missing: a save that
/// replaced `step-N` moved it aside and died before its replacement
/// landed. It is the step's only copy, whole; it is renamed back to
/// `step-N` (what `Checkpoint::open` would read through it) when its
/// manifest validates as step N, and kept otherwise.
fn restore_moved_aside(save_dir: &Path, path: &Path, step_name: &str) {
    let whole = parse_step_dir_name(step_name).is_some_and(|step| {
        super::reader::Checkpoint::open_step_dir(path).is_ok_and(|c| c.step() == step)
    });
    if !whole {
        tracing::warn!(dir = %path.display(), "kept a moved-aside checkpoint whose manifest does not validate");
        return;
    }
    match durable::rename(path, &save_dir.join(step_name)) {
        Ok(()) => {
            tracing::warn!(dir = %path.display(), "restored a checkpoint that a save interrupted while replacing it had moved aside")
        }
        Err(err) => {
            tracing::warn!(dir = %path.display(), error = %err, "could not restore a moved-aside checkpoint")
        }
    }
}

/// Removes `.step-*.tmp-<pid>` / `.old-<pid>` dirs and `.latest.tmp-<pid>-*`
/// files of other processes and this process's where it is not writing
/// them, but an `.old` dir whose `step-N` is missing, which is renamed
/// back (see [`restore_moved_aside`]). Nothing else is touched. The caller
/// holds the save dir's lock, which every writer holds: another pid's
/// files are a dead writer's, whether or not the pid is alive now (reused,
/// another user's, a thread's, or another host's).
fn remove_stale(save_dir: &Path) {
    // This process writes `latest` only inside a commit, never while a
    // save begins: a half-written one of its own pid is a dead
    // incarnation's too.
    durable::remove_every_tmp(&save_dir.join(LATEST_FILE));
    let Ok(entries) = std::fs::read_dir(save_dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(staging_owner_pid) else {
            continue;
        };
        if pid == std::process::id() && OWN_STAGING.in_use(pid, &e.path()) {
            continue;
        }
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        // A step moved aside by a save that died before its replacement
        // landed is that step's only copy, and `latest` may name it
        // (`Checkpoint::open` reads through it): renamed back.
        if let Some(step) = moved_aside_step(name.to_str().unwrap_or_default()) {
            if !save_dir.join(&step).exists() {
                restore_moved_aside(save_dir, &e.path(), &step);
                continue;
            }
        }
        match std::fs::remove_dir_all(e.path()) {
            Ok(()) => {
                durable::record::remove(&e.path());
                tracing::warn!(dir = %e.path().display(), pid, "removed an unfinished checkpoint of a process that is gone")
            }
            Err(err) => {
                tracing::warn!(dir = %e.path().display(), error = %err, "could not remove an unfinished checkpoint")
            }
        }
    }
}

/// `.step-<N>.tmp-<pid>`: the staging dir of `pid`'s save of `step`.
fn staging_dir_name(step: u64, pid: u32) -> String {
    format!(".{}.tmp-{pid}", step_dir_name(step))
}

/// A checkpoint being written.
///
/// Several ranks: rank 0 [`begin`](Self::begin)s (owns) the staging dir,
/// the other ranks [`join`](Self::join) it to write their own `rank<R>/`
/// files, [`sync_own`](Self::sync_own) them, and hand their entries to
/// rank 0 ([`add_entries`](Self::add_entries)), which commits. Only the
/// owner removes an uncommitted staging dir when dropped.
#[derive(Debug)]
pub struct StagedCheckpoint {
    save_dir: PathBuf,
    tmp_dir: PathBuf,
    step: u64,
    files: Vec<FileEntry>,
    dirs: Vec<PathBuf>,
    committed: bool,
    owner: bool,
}

impl StagedCheckpoint {
    /// Removes the staging dirs that no save is writing and creates this
    /// save's, in `save_dir`, whose lock `lock` is: holding it proves that
    /// no other process is writing there.
    pub fn begin(save_dir: &Path, step: u64, lock: &SaveDirLock) -> Result<Self, CheckpointError> {
        if !lock.covers(save_dir) {
            return Err(CheckpointError::Io {
                op: "locking",
                path: save_dir.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "the lock given is {}'s (an engine bug)",
                        lock.dir().display()
                    ),
                ),
            });
        }
        remove_stale(save_dir);
        let tmp_dir = save_dir.join(staging_dir_name(step, std::process::id()));
        if tmp_dir.exists() {
            // Ours, from an earlier failed save in this process.
            std::fs::remove_dir_all(&tmp_dir).map_err(io_err("removing", &tmp_dir))?;
            durable::record::remove(&tmp_dir);
        }
        durable::create_dir(&tmp_dir)?;
        OWN_STAGING.add(tmp_dir.clone());
        Ok(StagedCheckpoint {
            save_dir: save_dir.to_path_buf(),
            tmp_dir,
            step,
            files: Vec::new(),
            dirs: Vec::new(),
            committed: false,
            owner: true,
        })
    }

    /// Joins the staging dir that process `owner_pid` (rank 0) created
    /// with [`begin`](Self::begin) for `step`, to write this rank's files
    /// into it. Fails when it is not there (a save dir that is not on a
    /// file system shared by the ranks). A joined checkpoint is never
    /// committed and never removes the staging dir.
    pub fn join(save_dir: &Path, step: u64, owner_pid: u32) -> Result<Self, CheckpointError> {
        let tmp_dir = save_dir.join(staging_dir_name(step, owner_pid));
        match std::fs::symlink_metadata(&tmp_dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(CheckpointError::Manifest {
                    path: tmp_dir,
                    reason: "rank 0's staging path is not a directory".into(),
                })
            }
            Err(e) => {
                return Err(CheckpointError::Io {
                    op: "opening rank 0's staging dir (is the save dir on a file system every \
                         rank shares?)",
                    path: tmp_dir,
                    source: e,
                })
            }
        }
        Ok(StagedCheckpoint {
            save_dir: save_dir.to_path_buf(),
            tmp_dir,
            step,
            files: Vec::new(),
            dirs: Vec::new(),
            committed: false,
            owner: false,
        })
    }

    /// Syncs the files and directories recorded by this handle (what a
    /// joined rank wrote); [`commit`](Self::commit) does the same for the
    /// owner.
    pub fn sync_own(&self) -> Result<(), CheckpointError> {
        for f in &self.files {
            let p = self.tmp_dir.join(&f.path);
            let file = File::open(&p).map_err(io_err("opening", &p))?;
            durable::sync_file(&file, &p)?;
        }
        for d in &self.dirs {
            durable::sync_dir(d)?;
        }
        Ok(())
    }

    /// Records files another rank wrote into this staging dir (their
    /// entries, with crcs, as that rank recorded them). Their paths must be
    /// relative, and the files there with the recorded length.
    pub fn add_entries(&mut self, entries: Vec<FileEntry>) -> Result<(), CheckpointError> {
        for e in &entries {
            check_relative(&e.path)?;
            let p = self.tmp_dir.join(&e.path);
            let len = std::fs::metadata(&p).map_err(io_err("stat", &p))?.len();
            if len != e.bytes {
                return Err(CheckpointError::Size {
                    path: p,
                    expected_bytes: e.bytes,
                    got_bytes: len,
                });
            }
        }
        self.files.extend(entries);
        Ok(())
    }

    /// The staging dir.
    pub fn path(&self) -> &Path {
        &self.tmp_dir
    }

    /// Creates a subdirectory (0700).
    pub fn create_dir(&mut self, rel: &str) -> Result<PathBuf, CheckpointError> {
        check_relative(rel)?;
        let p = self.tmp_dir.join(rel);
        durable::create_dir(&p)?;
        self.dirs.push(p.clone());
        Ok(p)
    }

    /// Creates a new file (0600) at `rel`.
    pub fn create_file(&self, rel: &str) -> Result<(File, PathBuf), CheckpointError> {
        check_relative(rel)?;
        let p = self.tmp_dir.join(rel);
        let f = durable::create_file(&p)?;
        Ok((f, p))
    }

    /// Records a file whose regions' crcs are known; the whole-file crc is
    /// combined from them (the regions must tile the file from 0).
    pub fn add_file_with_regions(
        &mut self,
        rel: &str,
        regions: Vec<RegionCrc>,
    ) -> Result<(), CheckpointError> {
        let mut crc = 0u32;
        let mut pos = 0u64;
        for r in &regions {
            if r.offset_bytes != pos {
                return Err(CheckpointError::Manifest {
                    path: self.tmp_dir.join(rel),
                    reason: format!("regions leave a gap at byte {pos}"),
                });
            }
            crc = crc32c::crc32c_combine(crc, r.crc32c, r.len_bytes as usize);
            pos += r.len_bytes;
        }
        let p = self.tmp_dir.join(rel);
        let len = std::fs::metadata(&p).map_err(io_err("stat", &p))?.len();
        if len != pos {
            return Err(CheckpointError::Size {
                path: p,
                expected_bytes: pos,
                got_bytes: len,
            });
        }
        self.files.push(FileEntry {
            path: rel.to_owned(),
            bytes: pos,
            crc32c: crc,
            regions,
        });
        Ok(())
    }

    /// Records a file, computing its length and crc by reading it.
    pub fn add_file(&mut self, rel: &str) -> Result<(), CheckpointError> {
        let p = self.tmp_dir.join(rel);
        let (bytes, crc32c) = crc_of_file(&p)?;
        self.files.push(FileEntry {
            path: rel.to_owned(),
            bytes,
            crc32c,
            regions: Vec::new(),
        });
        Ok(())
    }

    /// The files recorded so far.
    pub fn files(&self) -> &[FileEntry] {
        &self.files
    }

    /// Makes it durable and visible: syncs every file and directory, writes
    /// the manifest (with the recorded files) last, renames the staging dir
    /// to `step-<N>` (replacing an existing one), syncs the save dir and
    /// rewrites `latest`. Returns the step dir.
    pub fn commit(mut self, mut manifest: Manifest) -> Result<PathBuf, CheckpointError> {
        for f in &self.files {
            let p = self.tmp_dir.join(&f.path);
            let file = File::open(&p).map_err(io_err("opening", &p))?;
            durable::sync_file(&file, &p)?;
        }
        for d in &self.dirs {
            durable::sync_dir(d)?;
        }
        manifest.files = self.files.clone();
        let text = manifest.to_json_bytes(&self.tmp_dir.join(MANIFEST_FILE))?;
        // Atomic within the staging dir; syncs the staging dir too.
        durable::write_atomic_with(
            &self.tmp_dir.join(MANIFEST_FILE),
            &text,
            Some(Site::CkptManifestWrite),
        )?;
        failpoint::kill_point(Site::CkptBeforeRename);
        let name = step_dir_name(self.step);
        let final_dir = self.save_dir.join(&name);
        let old = self
            .save_dir
            .join(format!(".{name}.old-{}", std::process::id()));
        let replaced = match std::fs::symlink_metadata(&final_dir) {
            Ok(_) => {
                if let Some(entry) = foreign_entry(&final_dir) {
                    return Err(CheckpointError::NotACheckpoint {
                        dir: final_dir,
                        entry,
                    });
                }
                durable::rename(&final_dir, &old)?;
                true
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => return Err(io_err("stat", &final_dir)(e)),
        };
        durable::rename(&self.tmp_dir, &final_dir)?;
        self.committed = true;
        self.forget_live();
        failpoint::kill_point(Site::CkptBeforeLatest);
        durable::write_atomic_with(
            &self.save_dir.join(LATEST_FILE),
            format!("{name}\n").as_bytes(),
            Some(Site::CkptLatestWrite),
        )?;
        if replaced {
            // The save is whole and `latest` names it: failing to remove
            // the copy it replaced is not a failed save (the next save's
            // `remove_stale` tries again).
            match std::fs::remove_dir_all(&old) {
                Ok(()) => {
                    durable::record::remove(&old);
                    if let Err(e) = durable::sync_dir(&self.save_dir) {
                        tracing::warn!(error = %e, "syncing the save dir after removing a replaced checkpoint");
                    }
                }
                Err(e) => {
                    tracing::warn!(dir = %old.display(), error = %e, "could not remove the checkpoint this save replaced")
                }
            }
        }
        Ok(final_dir)
    }

    /// Drops this save's staging dir from the live list (committed, or
    /// dropped: see [`OWN_STAGING`]).
    fn forget_live(&self) {
        if self.owner {
            OWN_STAGING.remove(&self.tmp_dir);
        }
    }
}

impl Drop for StagedCheckpoint {
    fn drop(&mut self) {
        self.forget_live();
        if !self.committed && self.owner {
            // A failed save: the staging dir is never read; remove it now
            // rather than at the next save. Where that fails too (the
            // open-file limit that failed the save leaves no fd for the
            // walk), it is said, and the next save in this dir removes it.
            match std::fs::remove_dir_all(&self.tmp_dir) {
                Ok(()) => durable::record::remove(&self.tmp_dir),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(
                    dir = %self.tmp_dir.display(),
                    error = %e,
                    "could not remove the failed save's unfinished checkpoint; the next save in \
                     this directory removes it"
                ),
            }
        }
    }
}

/// Length and crc32c of a file, read in 1 MiB chunks.
pub(crate) fn crc_of_file(p: &Path) -> Result<(u64, u32), CheckpointError> {
    let f = File::open(p).map_err(io_err("opening", p))?;
    crc_of_range(&f, p, 0, None)
}

/// crc32c of `len` bytes at `offset` (to the end when `None`).
pub(crate) fn crc_of_range(
    f: &File,
    p: &Path,
    offset: u64,
    len: Option<u64>,
) -> Result<(u64, u32), CheckpointError> {
    let mut buf = vec![0u8; 1 << 20];
    let mut crc = 0u32;
    let mut pos = 0u64;
    loop {
        let want = match len {
            Some(l) if pos >= l => break,
            Some(l) => ((l - pos) as usize).min(buf.len()),
            None => buf.len(),
        };
        let n = f
            .read_at(&mut buf[..want], offset + pos)
            .map_err(io_err("reading", p))?;
        if n == 0 {
            if let Some(l) = len {
                return Err(CheckpointError::Size {
                    path: p.to_path_buf(),
                    expected_bytes: offset + l,
                    got_bytes: offset + pos,
                });
            }
            break;
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        pos += n as u64;
    }
    Ok((pos, crc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(step_dir_name(4), "step-00000004");
        assert_eq!(parse_step_dir_name("step-00000004"), Some(4));
        assert_eq!(parse_step_dir_name("step-"), None);
        assert_eq!(parse_step_dir_name("step-1x"), None);
        assert_eq!(parse_step_dir_name("../step-1"), None);
        assert_eq!(staging_owner_pid(".step-00000004.tmp-123"), Some(123));
        assert_eq!(staging_owner_pid(".step-00000004.old-9"), Some(9));
        assert_eq!(staging_owner_pid(".step-x.tmp-9"), None);
        assert_eq!(staging_owner_pid("step-00000004"), None);
        let latest_tmp = |n: &str| durable::tmp_owner_pid(n, LATEST_FILE);
        assert_eq!(latest_tmp(".latest.tmp-77-0"), Some(77));
        assert_eq!(latest_tmp(".latest.tmp-77"), None);
        assert_eq!(latest_tmp(".latest.tmp-77-x"), None);
        assert_eq!(latest_tmp(".manifest.json.tmp-77-0"), None);
    }
}
