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
        const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut v = self.0 as f64;
        let mut unit = 0;
        while v >= 1024.0 && unit + 1 < UNITS.len() {
            v /= 1024.0;
            unit += 1;
        }
        if unit == 0 {
            format!("{} B", self.0)
        } else {
            format!("{v:.1} {}", UNITS[unit])
        }
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
/// an optional unit. Units: `B`, `K`/`KB` (10^3), `KiB` (2^10), `M`/`MB`,
/// `MiB`, `G`/`GB`, `GiB`, `T`/`TB`, `TiB` (case-insensitive, spaces and `_`
/// allowed). Fractions are allowed when the result is a whole number of
/// bytes (`"1.5GiB"`). Returns `None` for anything else.
pub fn parse_bytes_str(s: &str) -> Option<u64> {
    let cleaned: String = s.chars().filter(|c| *c != ' ' && *c != '_').collect();
    let split = cleaned
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E'))
        .unwrap_or(cleaned.len());
    let (num, unit) = cleaned.split_at(split);
    if num.is_empty() {
        return None;
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "tib" => 1 << 40,
        _ => return None,
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult);
    }
    let f: f64 = num.parse().ok()?;
    let total = f * mult as f64;
    if !total.is_finite() || total < 0.0 || total.fract() != 0.0 || total >= 2f64.powi(64) {
        return None;
    }
    Some(total as u64)
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
