//! Read-only memory maps of whole files (token corpora).
//!
//! A [`MappedFile`] maps a file `PROT_READ`/`MAP_PRIVATE` through
//! `memmap2`, so a corpus of any size is read in place: pages come from
//! the page cache as they are touched and cost no heap. The mapping lives
//! as long as the `MappedFile`; the slice it hands out borrows from it.
//!
//! # What the mapping relies on
//!
//! The bytes of a mapping change if another process writes the file, and
//! touching a page past a concurrent truncation raises `SIGBUS`. Both are
//! outside what a library can rule out (the file is the user's), so the
//! contract is the one every reader of a mapped file has: **the file is
//! not modified or truncated while it is mapped**. tierzero maps only
//! token files: the user's, opened for reading, and its own cache files,
//! which are written once under a temporary name and renamed into place
//! (never rewritten in place).

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::SwapError;

/// A whole file mapped read-only.
#[derive(Debug)]
pub struct MappedFile {
    map: Option<memmap2::Mmap>,
    path: PathBuf,
}

impl MappedFile {
    /// Maps `path` read-only. An empty file gives an empty slice (nothing is
    /// mapped: a zero-length mapping is refused by the kernel).
    pub fn open(path: &Path) -> Result<MappedFile, SwapError> {
        let io = |what: &str, source: std::io::Error| SwapError::Setup {
            what: format!("{what} {}", path.display()),
            source,
        };
        let file = File::open(path).map_err(|e| io("opening", e))?;
        let len = file
            .metadata()
            .map_err(|e| io("reading the size of", e))?
            .len();
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the file is opened read-only and mapped read-only and
            // private; the module's contract (the file is neither modified
            // nor truncated while mapped) is what keeps the bytes stable
            // and every page backed. tierzero maps only token files that it
            // reads, and its own cache files, which are never rewritten in
            // place (they are renamed into place whole).
            let m = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io("mapping", e))?;
            Some(m)
        };
        Ok(MappedFile {
            map,
            path: path.to_owned(),
        })
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// The mapped file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn maps_whole_files_and_empty_ones() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.bin");
        std::fs::write(&p, [1u8, 2, 3, 4, 5]).unwrap();
        let m = MappedFile::open(&p).unwrap();
        assert_eq!(m.bytes(), &[1, 2, 3, 4, 5]);
        assert_eq!(m.path(), p);
        let e = d.path().join("e.bin");
        std::fs::write(&e, []).unwrap();
        assert!(MappedFile::open(&e).unwrap().bytes().is_empty());
        assert!(MappedFile::open(&d.path().join("missing")).is_err());
    }
}
