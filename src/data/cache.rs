//! The token cache: an encoded text corpus kept next to its data, so the
//! next run starts at once.
//!
//! A corpus `DIR/corpus.jsonl` encoded with some tokenizer is written to
//! `DIR/.corpus.jsonl.tz-<key>.u16` (or `.u32`: the narrowest width for the
//! model's vocabulary), a flat little-endian token file, and described by
//! the sidecar `DIR/.corpus.jsonl.tz-<key>.u16.json`. The key is the
//! SHA-256 of everything the ids depend on: the `tokenizer.json` bytes, the
//! data's length and CRC-32C (its whole content, read once; hardware CRC
//! runs at memory speed), the format (documents, JSONL field), the EOS id,
//! the width and the `tokenizers` version. So an edited corpus, another
//! tokenizer or another EOS is a miss and re-encodes; nothing stale is
//! ever read.
//!
//! Both files are written with [`crate::durable`] (temporary file, fsync,
//! rename), the token file first: a crash leaves no sidecar, which is a
//! miss. A hit needs the sidecar's key and token count to match the token
//! file's size, and the file's CRC-32C and largest id to be the ones the
//! sidecar recorded (the file is read once, at memory speed: damage or an
//! edit in place is a miss, encoded again). The encode reads the data
//! through a CRC tally ([`Tally`]): data changed between the key's read
//! and the encode's is not cached.
//!
//! An entry of an earlier content of the data can never hit again (its
//! key holds the content's CRC), yet is as large as the cache: when a new
//! entry is written next to the data, the entries beside it of the same
//! file name whose sidecar records other data are removed
//! ([`remove_superseded`]). Entries of other tokenizers or formats of the
//! same content stay (switching back hits), and so do entries in a shared
//! cache directory, where one file name may be several corpora's.
//!
//! Where the data's directory is not writable (a read-only dataset mount)
//! the entry goes to the user's cache directory ([`user_dir`]), and
//! `--data-cache-dir` names another: without one, every rank would hold
//! its corpus on the heap, 4 bytes a token. Where no directory takes it,
//! the tokens stay in memory, said in the report.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::format::{DataFormat, TokenWidth};
use crate::engine::{EngineError, Result};
use crate::sha256::Sha256;

/// Bumped when the meaning of a cached file changes.
const CACHE_VERSION: u32 = 1;

/// The data file's length and CRC-32C.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataIdentity {
    /// Bytes.
    pub bytes: u64,
    /// CRC-32C of all of them.
    pub crc32c: u32,
    /// Whether the file starts with a UTF-8 byte-order mark, which the
    /// encode drops (a cache of such a file from before that is a miss).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub utf8_bom: bool,
}

impl DataIdentity {
    /// Reads `path` once.
    pub fn of(path: &Path) -> Result<DataIdentity> {
        let io = |source| EngineError::Io {
            path: path.to_owned(),
            source,
        };
        let mut f = std::fs::File::open(path).map_err(io)?;
        let mut buf = vec![0u8; 1 << 20];
        let (mut bytes, mut crc) = (0u64, 0u32);
        let mut head = Vec::with_capacity(3);
        loop {
            let n = f.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            if head.len() < 3 {
                let more = (3 - head.len()).min(n);
                head.extend_from_slice(&buf[..more]);
            }
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            bytes += n as u64;
        }
        Ok(DataIdentity {
            bytes,
            crc32c: crc,
            utf8_bom: head == super::encode::UTF8_BOM,
        })
    }
}

/// A reader that keeps the length and CRC-32C of what passed through
/// it: the encode reads the data through one, so an entry is written only
/// for the content [`DataIdentity::of`] keyed it by ([`Tally::check`]).
#[derive(Debug)]
pub struct Tally<R> {
    inner: R,
    bytes: u64,
    crc32c: u32,
}

impl<R> Tally<R> {
    /// Counts what is read from `inner`.
    pub fn new(inner: R) -> Self {
        Tally {
            inner,
            bytes: 0,
            crc32c: 0,
        }
    }

    /// An error naming `path` unless what was read is the content `ident`
    /// describes: the file changed between the identity's read and the
    /// encode's (a prep script rewriting it), and an entry of what was
    /// read would be found under the other content's key.
    pub fn check(&self, ident: &DataIdentity, path: &Path) -> Result<()> {
        if self.bytes == ident.bytes && self.crc32c == ident.crc32c {
            return Ok(());
        }
        Err(EngineError::Data {
            path: path.to_owned(),
            reason: format!(
                "the file changed while it was read ({} bytes with crc32c {:#010x} when its \
                 cache key was taken, {} bytes with crc32c {:#010x} when it was encoded); \
                 nothing was cached. Run again once whatever writes it has finished",
                ident.bytes, ident.crc32c, self.bytes, self.crc32c
            ),
        })
    }
}

impl<R: Read> Read for Tally<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.crc32c = crc32c::crc32c_append(self.crc32c, &buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// What a cache entry says about itself (the sidecar).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheMeta {
    /// The cache format version (`CACHE_VERSION`).
    pub tierzero_token_cache: u32,
    /// The key (hex SHA-256).
    pub key: String,
    /// `uint16` or `uint32`.
    pub dtype: String,
    /// Token ids in the file.
    pub tokens: u64,
    /// Documents encoded.
    pub documents: u64,
    /// The data file, resolved (absolute, links followed); entries of
    /// older versions have it as given, relative to where that run
    /// started.
    pub source: String,
    /// The data file's resolved path, its bytes in hex, where they are not
    /// UTF-8 (`source` then shows it lossily, and an edit's old entries
    /// were never found as this file's to remove).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_hex: Option<String>,
    /// The data it was encoded from.
    pub data: DataIdentity,
    /// The format's name.
    pub format: String,
    /// The EOS id appended after each document.
    pub eos_id: Option<u32>,
    /// The largest id in the file: a hit is checked against the model's
    /// vocabulary without reading the file (older entries: `None`, read).
    #[serde(default)]
    pub max_id: Option<u32>,
    /// CRC-32C of the token file: a hit reads it once to check it
    /// ([`lookup`]), so tokens damaged or edited in place (their length
    /// kept) are re-encoded rather than trained on. Entries written before
    /// it (`None`) are misses, re-encoded once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_crc32c: Option<u32>,
}

impl CacheMeta {
    /// `source` and `source_hex` for the data file at `resolved`.
    pub fn source_fields(resolved: &Path) -> (String, Option<String>) {
        use std::os::unix::ffi::OsStrExt as _;
        let shown = resolved.display().to_string();
        let hex = resolved.to_str().is_none().then(|| {
            resolved
                .as_os_str()
                .as_bytes()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        });
        (shown, hex)
    }

    /// The data file this entry was encoded from, as recorded.
    pub fn source_path(&self) -> PathBuf {
        use std::os::unix::ffi::OsStringExt as _;
        let bytes = self.source_hex.as_deref().and_then(|h| {
            (h.len() % 2 == 0 && h.is_ascii())
                .then(|| {
                    (0..h.len())
                        .step_by(2)
                        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).ok())
                        .collect::<Option<Vec<u8>>>()
                })
                .flatten()
        });
        match bytes {
            Some(b) => PathBuf::from(std::ffi::OsString::from_vec(b)),
            None => PathBuf::from(&self.source),
        }
    }
}

/// The inputs of a cache key.
#[derive(Debug)]
pub struct KeyInputs<'a> {
    /// The `tokenizer.json` bytes.
    pub tokenizer_json: &'a [u8],
    /// The data.
    pub data: DataIdentity,
    /// Its format.
    pub format: &'a DataFormat,
    /// The EOS id.
    pub eos: Option<u32>,
    /// The stored width.
    pub width: TokenWidth,
}

/// The key of `k` (hex SHA-256).
pub fn key(k: &KeyInputs<'_>) -> String {
    let mut h = Sha256::new();
    let field = |h: &mut Sha256, b: &[u8]| {
        h.update(&(b.len() as u64).to_le_bytes());
        h.update(b);
    };
    field(
        &mut h,
        format!("tierzero-token-cache-v{CACHE_VERSION}").as_bytes(),
    );
    field(&mut h, b"tokenizers 0.23");
    field(&mut h, k.tokenizer_json);
    field(&mut h, &k.data.bytes.to_le_bytes());
    field(&mut h, &k.data.crc32c.to_le_bytes());
    field(&mut h, k.format.name().as_bytes());
    field(&mut h, format!("{:?}", k.eos).as_bytes());
    field(&mut h, k.width.dtype_name().as_bytes());
    if k.data.utf8_bom {
        // Only then: every other file's key is what it was.
        field(&mut h, b"utf-8 byte-order mark dropped");
    }
    h.finish_hex()
}

/// The directory `data` is in.
pub fn data_dir(data: &Path) -> PathBuf {
    match data.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The user's cache directory for token caches whose data's directory is
/// not writable: `$XDG_CACHE_HOME/tierzero/tokens`, else
/// `$HOME/.cache/tierzero/tokens` (an absolute variable only, as the XDG
/// spec says), `None` without either.
pub fn user_dir() -> Option<PathBuf> {
    let abs = |v: &str| {
        std::env::var_os(v)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    // A home directory that is not there is not made (a service account's
    // HOME=/nonexistent was created as root).
    abs("XDG_CACHE_HOME")
        .or_else(|| abs("HOME").filter(|h| h.is_dir()).map(|h| h.join(".cache")))
        .map(|d| d.join("tierzero").join("tokens"))
}

/// Gives the cache entry's `files` the data's read permissions (the owner
/// keeps read and write): made `0600`, as every atomic rewrite is, they
/// were unreadable to the other users of a shared data directory, who
/// each encoded the corpus again and replaced the entry (or, in a sticky
/// directory, failed to). Best effort: the entry works for its owner
/// either way.
pub fn readable_as_the_data(data: &Path, files: &[&Path]) {
    use std::os::unix::fs::PermissionsExt as _;
    let Ok(meta) = std::fs::metadata(data) else {
        return;
    };
    let mode = (meta.permissions().mode() & 0o444) | 0o600;
    for f in files {
        if let Err(e) = std::fs::set_permissions(f, std::fs::Permissions::from_mode(mode)) {
            tracing::debug!(file = %f.display(), error = %e, "token cache: permissions left as made");
        }
    }
}

/// Whether `data` is a process's descriptor through `/dev` or `/proc`
/// (`--data /dev/stdin` redirected from a file is a regular file there):
/// no cache entry goes beside it, into `/dev`. Its directory is `/dev`
/// itself, `/dev/fd` or under `/proc`; a corpus on `/dev/shm` (a tmpfs) is
/// a file like any other.
pub fn is_read_through_dev_or_proc(data: &Path) -> bool {
    data_dir(data)
        .canonicalize()
        .is_ok_and(|d| d == Path::new("/dev") || d.starts_with("/dev/fd") || d.starts_with("/proc"))
}

/// The longest data file name (in bytes) an entry's names carry whole.
/// An entry's temporary sidecar (`durable::write_atomic`'s) adds 63 bytes
/// at most (`.`, `.tz-`, 16 hex digits, `.u32`, `.json`, `.tmp-`, the pid
/// and a random suffix): a name of 192 bytes or more did not fit a
/// file system's 255 and failed the run after its encode.
const NAME_KEPT_BYTES: usize = 150;

/// The data file's name as its cache entries carry it: whole up to
/// [`NAME_KEPT_BYTES`], else its first 120 bytes, `~` and 16 hex digits
/// of the whole name's SHA-256 (two long names of one beginning stay
/// apart).
fn entry_name(data: &Path) -> String {
    let name = data
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "data".into());
    if name.len() <= NAME_KEPT_BYTES {
        return name;
    }
    let mut cut = 120;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    format!("{}~{}", &name[..cut], &h.finish_hex()[..16])
}

/// The token file and sidecar of the cache entry `key` of `data` in `dir`
/// (the key tells two corpora of one name apart).
pub fn paths_in(dir: &Path, data: &Path, key: &str, width: TokenWidth) -> (PathBuf, PathBuf) {
    let dir = dir.to_path_buf();
    let name = entry_name(data);
    let ext = match width {
        TokenWidth::U16 => "u16",
        TokenWidth::U32 => "u32",
    };
    let tokens = dir.join(format!(".{name}.tz-{}.{ext}", &key[..16.min(key.len())]));
    let mut side = tokens.as_os_str().to_owned();
    side.push(".json");
    (tokens, PathBuf::from(side))
}

/// The entry's sidecar when it describes a whole token file of `key`
/// whose bytes are the ones it recorded (length and CRC-32C: the file is
/// read once) and whose largest id is the one it says. A mismatch is a
/// miss, said in a warning: the entry is encoded again in its place.
pub fn lookup(tokens: &Path, sidecar: &Path, key: &str, width: TokenWidth) -> Option<CacheMeta> {
    let text = std::fs::read_to_string(sidecar).ok()?;
    let meta: CacheMeta = serde_json::from_str(&text).ok()?;
    let len = std::fs::metadata(tokens).ok()?.len();
    let described = meta.tierzero_token_cache == CACHE_VERSION
        && meta.key == key
        && meta.dtype == width.dtype_name()
        && meta.tokens.checked_mul(width.bytes() as u64) == Some(len);
    if !described {
        return None;
    }
    let recorded = (meta.tokens_crc32c?, meta.max_id?);
    match tokens_check(tokens, width) {
        Ok(found) if found == recorded => Some(meta),
        Ok((crc, max_id)) => {
            tracing::warn!(
                cache = %tokens.display(),
                crc32c = crc,
                recorded_crc32c = recorded.0,
                max_id,
                recorded_max_id = recorded.1,
                "the cached tokens are not the ones recorded (damaged or edited in place): \
                 encoding the data again"
            );
            None
        }
        Err(e) => {
            tracing::warn!(cache = %tokens.display(), error = %e, "could not read the cached tokens: encoding the data again");
            None
        }
    }
}

/// The CRC-32C of a token file and its largest id (0 when empty).
pub fn tokens_check(tokens: &Path, width: TokenWidth) -> std::io::Result<(u32, u32)> {
    tokens_check_in(tokens, width, 1 << 20)
}

/// [`tokens_check`], reading about `buf_bytes` at a time (whole ids:
/// rounded up to the width), decoded as a token file's scan decodes them.
fn tokens_check_in(
    tokens: &Path,
    width: TokenWidth,
    buf_bytes: usize,
) -> std::io::Result<(u32, u32)> {
    let mut f = crate::durable::open_regular(tokens)?;
    let mut buf = vec![0u8; buf_bytes.max(1).next_multiple_of(width.bytes())];
    let (mut crc, mut max_id) = (0u32, 0u32);
    loop {
        let n = super::read_full(&mut f, &mut buf)?;
        if n == 0 {
            break;
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        max_id = super::decode(&buf[..n], width).fold(max_id, u32::max);
    }
    Ok((crc, max_id))
}

/// Removes the cache entries in `dir` of the data file named as `data`'s
/// whose sidecar records other data than `current` (an earlier content of
/// the file), both files each; returns the token files removed and their
/// bytes. Only for the data's own directory, and only entries whose
/// sidecar's source is this data file (the same file once both paths are
/// resolved: `--data-cache-dir` may put another corpus of the same name
/// here). An entry without a readable sidecar (being written, or damaged)
/// or whose source no longer resolves is left.
pub fn remove_superseded(dir: &Path, data: &Path, current: &DataIdentity) -> Vec<(PathBuf, u64)> {
    if data.file_name().is_none() {
        return Vec::new();
    }
    let name = entry_name(data);
    let Ok(data_resolved) = std::fs::canonicalize(data) else {
        return Vec::new();
    };
    let prefix = format!(".{name}.tz-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        // `.{name}.tz-{16 hex digits}.u16` exactly (`paths_in`): not the
        // entry of another file whose name begins `{name}.tz-`.
        let Some(rest) = file.strip_prefix(&prefix) else {
            continue;
        };
        let ours = rest.len() == 20
            && rest.is_char_boundary(16)
            && rest[..16].bytes().all(|b| b.is_ascii_hexdigit())
            && matches!(&rest[16..], ".u16" | ".u32");
        if !ours {
            continue;
        }
        let tokens = e.path();
        let mut side = tokens.as_os_str().to_owned();
        side.push(".json");
        let sidecar = PathBuf::from(side);
        let Some(meta) = std::fs::read_to_string(&sidecar)
            .ok()
            .and_then(|t| serde_json::from_str::<CacheMeta>(&t).ok())
        else {
            continue;
        };
        let same_file = std::fs::canonicalize(meta.source_path()).is_ok_and(|s| s == data_resolved);
        if meta.data == *current || !same_file {
            continue;
        }
        let bytes = e.metadata().map_or(0, |m| m.len());
        // The sidecar first: a token file without one is a miss, never read.
        if std::fs::remove_file(&sidecar).is_ok() && std::fs::remove_file(&tokens).is_ok() {
            removed.push((tokens, bytes));
        }
    }
    removed
}

/// Whether files can be created in `dir` (a probe file, created and
/// removed).
pub fn writable(dir: &Path) -> bool {
    let probe = dir.join(format!(".tierzero-cache-probe-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => std::fs::remove_file(&probe).is_ok(),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn only_a_process_descriptor_counts_as_read_through_dev_or_proc() {
        assert!(is_read_through_dev_or_proc(Path::new("/dev/stdin")));
        assert!(is_read_through_dev_or_proc(Path::new("/dev/fd/0")));
        assert!(is_read_through_dev_or_proc(Path::new("/proc/self/fd/0")));
        // A corpus on the /dev/shm tmpfs is cached like any other file.
        assert!(!is_read_through_dev_or_proc(Path::new(
            "/dev/shm/corpus.txt"
        )));
        assert!(!is_read_through_dev_or_proc(Path::new("/tmp/corpus.txt")));
    }

    /// An entry (token file and sidecar) in `dir` as `paths_in` names it,
    /// recording `source` and `data`.
    fn entry(dir: &Path, source: &Path, key: &str, data: DataIdentity) -> PathBuf {
        let (tokens, sidecar) = paths_in(dir, source, key, TokenWidth::U16);
        let (source, source_hex) = CacheMeta::source_fields(source);
        std::fs::write(&tokens, [0u8; 8]).unwrap();
        let meta = CacheMeta {
            tierzero_token_cache: CACHE_VERSION,
            key: key.to_owned(),
            dtype: "uint16".into(),
            tokens: 4,
            documents: 1,
            source,
            source_hex,
            data,
            format: "text".into(),
            eos_id: None,
            max_id: Some(0),
            tokens_crc32c: Some(crc32c::crc32c(&[0u8; 8])),
        };
        std::fs::write(&sidecar, serde_json::to_vec(&meta).unwrap()).unwrap();
        tokens
    }

    /// A hit reads the token file: tokens edited in place (the length
    /// kept), a sidecar whose largest id or crc is not the file's, and an
    /// entry without a crc are misses; the entry as written is a hit.
    #[test]
    fn a_hit_is_the_tokens_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let data = DataIdentity {
            bytes: 10,
            crc32c: 7,
            utf8_bom: false,
        };
        let key = "ab".repeat(32);
        let tokens = entry(dir.path(), Path::new("c.txt"), &key, data);
        let (_, sidecar) = paths_in(dir.path(), Path::new("c.txt"), &key, TokenWidth::U16);
        let hit = || lookup(&tokens, &sidecar, &key, TokenWidth::U16).is_some();
        assert!(hit());
        // Edited in place: a miss. Its (crc, largest id) of [0, 0, 0, 300],
        // also read in buffers of 3 and 1 bytes (rounded up to whole ids).
        let edited = [0, 0, 0, 0, 0, 0, 0x2c, 0x01];
        std::fs::write(&tokens, edited).unwrap();
        assert!(!hit());
        for buf_bytes in [1 << 20, 3, 1] {
            assert_eq!(
                tokens_check_in(&tokens, TokenWidth::U16, buf_bytes).unwrap(),
                (crc32c::crc32c(&edited), 300),
                "{buf_bytes}"
            );
        }
        let edit = |f: &dyn Fn(&mut CacheMeta)| {
            let mut m: CacheMeta =
                serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
            f(&mut m);
            std::fs::write(&sidecar, serde_json::to_vec(&m).unwrap()).unwrap();
        };
        std::fs::write(&tokens, [0u8; 8]).unwrap();
        edit(&|m| m.max_id = Some(5));
        assert!(!hit());
        edit(&|m| m.max_id = Some(0));
        assert!(hit());
        edit(&|m| m.tokens_crc32c = None);
        assert!(!hit());
    }

    /// A long data file name is cut in its entries' names, so that their
    /// temporary names fit a file system's 255 bytes; two long names of
    /// one beginning stay apart, and pruning finds the cut names.
    #[test]
    fn a_long_data_name_is_cut_in_its_entries_names() {
        let dir = std::env::temp_dir().join(format!("tz-cache-long-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let long = |tail: &str| format!("{}{tail}.txt", "é".repeat(100));
        let (a, b) = (dir.join(long("a")), dir.join(long("b")));
        assert!(a.file_name().unwrap().len() > 200);
        let (ta, _) = paths_in(&dir, &a, &"a".repeat(64), TokenWidth::U32);
        let (tb, _) = paths_in(&dir, &b, &"a".repeat(64), TokenWidth::U32);
        assert_ne!(ta, tb);
        let worst = ta.file_name().unwrap().len() + ".json.tmp-4194304-18446744073709551615".len();
        assert!(worst <= 255, "{worst}");
        // A short name is kept whole.
        let (short, _) = paths_in(&dir, Path::new("c.txt"), "ab", TokenWidth::U16);
        assert_eq!(short.file_name().unwrap(), ".c.txt.tz-ab.u16");
        std::fs::write(&a, "text").unwrap();
        let id = |crc| DataIdentity {
            bytes: 4,
            crc32c: crc,
            utf8_bom: false,
        };
        let old = entry(&dir, &a, &"c".repeat(64), id(1));
        let current = entry(&dir, &a, &"d".repeat(64), id(2));
        assert!(old.exists() && std::fs::read_dir(&dir).unwrap().count() == 5);
        assert_eq!(remove_superseded(&dir, &a, &id(2)), vec![(old.clone(), 8)]);
        assert!(!old.exists() && current.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_entries_of_the_file_s_earlier_contents_are_removed() {
        let dir = std::env::temp_dir().join(format!("tz-cache-prune-{}", std::process::id()));
        let elsewhere = dir.join("ro");
        std::fs::create_dir_all(&elsewhere).unwrap();
        let data = dir.join("c.txt");
        std::fs::write(&data, "text").unwrap();
        std::fs::write(elsewhere.join("c.txt"), "other text").unwrap();
        let id = |crc| DataIdentity {
            bytes: 10,
            crc32c: crc,
            utf8_bom: false,
        };
        let old = entry(&dir, &data, &"a".repeat(64), id(1));
        let current = entry(&dir, &data, &"b".repeat(64), id(2));
        // Another data file whose name begins `c.txt.tz-`: its entry starts
        // with the prefix too, and is not c.txt's.
        let other = entry(
            &dir,
            Path::new("c.txt.tz-0123456789abcdef.u16"),
            &"c".repeat(64),
            id(3),
        );
        // Another corpus of the same name, cached here by --data-cache-dir.
        let same_name = entry(&dir, &elsewhere.join("c.txt"), &"d".repeat(64), id(4));
        let removed = remove_superseded(&dir, &data, &id(2));
        assert_eq!(removed, vec![(old.clone(), 8)]);
        assert!(!old.exists() && current.exists() && other.exists() && same_name.exists());
        let mut side = old.into_os_string();
        side.push(".json");
        assert!(!PathBuf::from(side).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A data file whose name is not UTF-8: its entries record the name
    /// whole (`source_hex`; `source` shows it lossily), so an edit's
    /// earlier entry is found as the file's and removed.
    #[test]
    fn entries_of_a_data_file_named_in_other_bytes_than_utf8_are_found() {
        use std::os::unix::ffi::OsStrExt as _;
        let dir = std::env::temp_dir().join(format!("tz-cache-bytes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data = dir.join(std::ffi::OsStr::from_bytes(b"d\xff.txt"));
        std::fs::write(&data, "text").unwrap();
        let id = |crc| DataIdentity {
            bytes: 4,
            crc32c: crc,
            utf8_bom: false,
        };
        let old = entry(&dir, &data, &"a".repeat(64), id(1));
        let current = entry(&dir, &data, &"b".repeat(64), id(2));
        let mut side = old.clone().into_os_string();
        side.push(".json");
        let meta: CacheMeta =
            serde_json::from_slice(&std::fs::read(PathBuf::from(side)).unwrap()).unwrap();
        assert!(meta.source.contains('\u{fffd}'), "{}", meta.source);
        assert_eq!(meta.source_path(), data);
        assert_eq!(
            remove_superseded(&dir, &data, &id(2)),
            vec![(old.clone(), 8)]
        );
        assert!(!old.exists() && current.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
