//! Unit newtypes used by the validated configuration.
//!
//! DeepSpeed mixes two units under similar-looking keys: `aio.block_size` is
//! in **bytes**, while `offload_param.buffer_size`, `sub_group_size`,
//! `reduce_bucket_size`, `stage3_prefetch_bucket_size`, `max_in_cpu` and the
//! `stage3_*` thresholds count **elements** (the byte size depends on the
//! dtype). Mixing them up is an easy factor-2/4 bug, so the validated config
//! never holds a bare `u64` for a size: element counts are [`Numel`] and byte
//! counts are [`Bytes`]. Converting one into the other needs an explicit
//! element size ([`Numel::bytes_at`]).
//!
//! Our own `tierzero` block accepts byte sizes either as integers or as
//! strings with a binary or decimal suffix (`"256MiB"`, `"4GB"`), parsed by
//! [`parse_bytes_str`]. DeepSpeed keys keep DeepSpeed's number forms only.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A count of tensor elements (not bytes). DeepSpeed's `buffer_size`,
/// `sub_group_size`, bucket sizes, `max_in_cpu` and the `stage3_*` limits are
/// element counts.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Numel(pub u64);

/// A count of bytes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Bytes(pub u64);

impl Numel {
    /// Byte size of this many elements of `elem_bytes` bytes each, or `None`
    /// on overflow.
    pub fn bytes_at(self, elem_bytes: u64) -> Option<Bytes> {
        self.0.checked_mul(elem_bytes).map(Bytes)
    }
}

impl fmt::Display for Numel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} elements", self.0)
    }
}

impl Bytes {
    /// Human-readable binary size, e.g. `953.7 MiB`.
    pub fn human(self) -> String {
        crate::units::format_bytes(self.0)
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 < 1024 {
            write!(f, "{} bytes", self.0)
        } else {
            write!(f, "{} bytes ({})", self.0, self.human())
        }
    }
}

/// Parses a byte size written as a string: a non-negative number followed by
/// an optional unit, with spaces and `_` allowed (`"256MiB"`, `"4 GB"`,
/// `"1_048_576"`). The units are those of [`crate::units::parse_bytes`]:
/// `K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB` are powers of 1024 (as in fio),
/// `KB`, `MB`, `GB`, `TB` powers of 1000. Returns `None` for anything else.
pub fn parse_bytes_str(s: &str) -> Option<u64> {
    let cleaned: String = s.chars().filter(|c| *c != ' ' && *c != '_').collect();
    crate::units::parse_bytes(&cleaned).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_byte_strings() {
        assert_eq!(parse_bytes_str("256MiB"), Some(256 << 20));
        assert_eq!(parse_bytes_str("4 GB"), Some(4_000_000_000));
        assert_eq!(parse_bytes_str("1.5GiB"), Some(3 << 29));
        assert_eq!(parse_bytes_str("4096"), Some(4096));
        assert_eq!(parse_bytes_str("1e9"), Some(1_000_000_000));
        assert_eq!(parse_bytes_str("1_048_576 B"), Some(1_048_576));
        assert_eq!(parse_bytes_str("12 parsecs"), None);
        assert_eq!(parse_bytes_str("-1GiB"), None);
        assert_eq!(parse_bytes_str("0.3B"), None);
        assert_eq!(parse_bytes_str(""), None);
        assert_eq!(parse_bytes_str("99999999999TiB"), None);
    }

    #[test]
    fn numel_to_bytes_and_display() {
        assert_eq!(Numel(100).bytes_at(2), Some(Bytes(200)));
        assert_eq!(Numel(u64::MAX).bytes_at(2), None);
        assert_eq!(
            Bytes(1_000_000_000).to_string(),
            "1000000000 bytes (953.7 MiB)"
        );
        assert_eq!(Bytes(512).to_string(), "512 bytes");
        assert_eq!(Numel(5).to_string(), "5 elements");
    }
}
