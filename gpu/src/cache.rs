//! Compiled kernel images on disk, so that each module compiles once per
//! device architecture and NVRTC version.
//!
//! The key is the SHA-256 of NVRTC's version, the target, the compile
//! options and the full source; the file is
//! `DIR/{module}-{target}-{key[..16]}.bin`, holding a magic line, the
//! SHA-256 of the image and the image. A file whose hash does not match
//! (a torn write, a disk error) is compiled again and replaced. Writes go
//! to a temporary file in the same directory and are renamed into place,
//! so a reader sees a whole file or none; they are not fsynced: losing a
//! cache entry costs one compile, and the hash catches a torn one. A
//! cache that cannot be written is a warning, not an error: the run goes
//! on with the images it compiled.
//!
//! The directory: `$TIERZERO_KERNEL_CACHE`, else
//! `$XDG_CACHE_HOME/tierzero/kernels`, else `~/.cache/tierzero/kernels`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::kernels::Module;
use crate::nvrtc::{self, Target};
use crate::{GpuError, Result};

const MAGIC: &[u8] = b"tierzero kernel image 1\n";

/// A directory of compiled images.
#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: PathBuf,
}

/// Whether an image came from the cache or was compiled now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Read from the cache.
    Hit,
    /// Compiled (and stored).
    Compiled,
}

impl KernelCache {
    /// A cache in `dir` (made on first store).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        KernelCache { dir: dir.into() }
    }

    /// The cache in the default directory (see the module docs).
    pub fn in_default_dir() -> Self {
        let dir = std::env::var_os("TIERZERO_KERNEL_CACHE")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("XDG_CACHE_HOME")
                    .map(|d| PathBuf::from(d).join("tierzero").join("kernels"))
            })
            .or_else(|| {
                std::env::var_os("HOME").map(|h| {
                    PathBuf::from(h)
                        .join(".cache")
                        .join("tierzero")
                        .join("kernels")
                })
            })
            .unwrap_or_else(|| std::env::temp_dir().join("tierzero-kernels"));
        KernelCache::new(dir)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `module` compiled for `target`: from the cache, else by NVRTC (and
    /// stored).
    pub fn get(&self, module: &Module, target: Target) -> Result<(Vec<u8>, Lookup)> {
        let (major, minor) = nvrtc::version()?;
        let key = key(&format!("{major}.{minor}"), target, &module.source());
        self.get_or_insert_with(module.name, target, &key, || {
            nvrtc::compile(module, target).map(|c| c.image)
        })
    }

    /// The image stored under (`name`, `target`, `key`), else `compile()`'s,
    /// stored there.
    pub fn get_or_insert_with(
        &self,
        name: &str,
        target: Target,
        key: &str,
        compile: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Vec<u8>, Lookup)> {
        let path = self
            .dir
            .join(format!("{name}-{target}-{}.bin", &key[..key.len().min(16)]));
        if let Some(image) = read_entry(&path, key) {
            return Ok((image, Lookup::Hit));
        }
        let image = compile()?;
        // A cache that cannot be written (a read-only home, a full disk)
        // costs a compile at the next start, not this run.
        if let Err(e) = self.store(&path, key, &image) {
            tracing::warn!(error = %e, "the compiled kernels are not cached (set TIERZERO_KERNEL_CACHE to a writable directory)");
        }
        Ok((image, Lookup::Compiled))
    }

    fn store(&self, path: &Path, key: &str, image: &[u8]) -> Result<()> {
        let err = |p: &Path| {
            let p = p.to_path_buf();
            move |source| GpuError::Cache { path: p, source }
        };
        std::fs::create_dir_all(&self.dir).map_err(err(&self.dir))?;
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let tmp = self.dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let mut bytes = Vec::with_capacity(MAGIC.len() + key.len() + 33 + image.len());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(key.as_bytes());
        bytes.push(b'\n');
        bytes.extend_from_slice(&Sha256::digest(image));
        bytes.extend_from_slice(image);
        // A write that failed part-way (a full disk) leaves no temporary
        // file behind.
        std::fs::write(&tmp, &bytes).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            err(&tmp)(e)
        })?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            err(path)(e)
        })
    }
}

/// The image in `path` if it is whole and stored under `key`.
fn read_entry(path: &Path, key: &str) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    let rest = bytes.strip_prefix(MAGIC)?;
    let rest = rest.strip_prefix(key.as_bytes())?.strip_prefix(b"\n")?;
    if rest.len() < 32 {
        return None;
    }
    let (hash, image) = rest.split_at(32);
    (Sha256::digest(image).as_slice() == hash).then(|| image.to_vec())
}

/// The cache key of `source` compiled for `target` by NVRTC `version` with
/// [`nvrtc::OPTIONS`] (hex SHA-256).
pub fn key(version: &str, target: Target, source: &str) -> String {
    let mut h = Sha256::new();
    for part in [version, &target.to_string()]
        .into_iter()
        .chain(nvrtc::OPTIONS)
        .chain([source])
    {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn compiles_once_then_hits_and_recompiles_a_torn_entry() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(dir.path().join("k"));
        let k = key("13.0", Target::Cubin(90), "src");
        let mut compiles = 0;
        let mut get = || {
            cache
                .get_or_insert_with("m", Target::Cubin(90), &k, || {
                    compiles += 1;
                    Ok(vec![7u8; 1000])
                })
                .unwrap()
        };
        assert_eq!(get(), (vec![7u8; 1000], Lookup::Compiled));
        assert_eq!(get(), (vec![7u8; 1000], Lookup::Hit));
        // Tear the file: it is compiled again.
        let file = std::fs::read_dir(dir.path().join("k"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let len = std::fs::metadata(&file).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(len - 10)
            .unwrap();
        assert_eq!(get(), (vec![7u8; 1000], Lookup::Compiled));
        assert_eq!(get(), (vec![7u8; 1000], Lookup::Hit));
        assert_eq!(compiles, 2);
    }

    #[test]
    fn a_cache_that_cannot_be_written_still_gives_the_compiled_image() {
        let dir = tempfile::tempdir().unwrap();
        // The cache's directory would be under a regular file.
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        let cache = KernelCache::new(file.join("k"));
        let k = key("13.0", Target::Cubin(90), "src");
        let mut compiles = 0;
        for _ in 0..2 {
            let got = cache
                .get_or_insert_with("m", Target::Cubin(90), &k, || {
                    compiles += 1;
                    Ok(vec![3u8; 10])
                })
                .unwrap();
            assert_eq!(got, (vec![3u8; 10], Lookup::Compiled));
        }
        assert_eq!(compiles, 2, "nothing was cached");
    }

    #[test]
    fn the_key_changes_with_every_input() {
        let base = key("13.0", Target::Cubin(90), "a");
        assert_ne!(base, key("13.1", Target::Cubin(90), "a"));
        assert_ne!(base, key("13.0", Target::Cubin(80), "a"));
        assert_ne!(base, key("13.0", Target::Ptx(90), "a"));
        assert_ne!(base, key("13.0", Target::Cubin(90), "b"));
        assert_eq!(base, key("13.0", Target::Cubin(90), "a"));
    }
}
