//! Human-readable sizes and counts on the command line.
//!
//! Byte sizes take binary suffixes (`K`, `KiB`, `M`, `MiB`, `G`, `GiB`,
//! `T`, `TiB`: powers of 1024) and decimal ones (`KB`, `MB`, `GB`, `TB`:
//! powers of 1000). Counts (`--params 100M`, `7B`) are decimal, as model
//! sizes are quoted: `K` = 10^3, `M` = 10^6, `B`/`G` = 10^9, `T` = 10^12.
//! Plain numbers may be written as floats (`5e8`), as in ds_config files.

use thiserror::Error;

/// A size or count that could not be parsed.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("cannot parse {input:?} as {what}: {why}")]
pub struct ParseUnitError {
    /// What was given.
    pub input: String,
    /// What was expected.
    pub what: &'static str,
    /// Why it failed.
    pub why: &'static str,
}

fn split_number(s: &str) -> (&str, &str) {
    // The exponent's sign belongs to the number (`1e-3` is a number that
    // is not whole, not an unknown suffix `e-3`).
    let exponent_at = |i: usize| {
        let rest = &s[i + 1..];
        let rest = rest.strip_prefix(['+', '-']).unwrap_or(rest);
        rest.starts_with(|d: char| d.is_ascii_digit())
    };
    let end = s
        .char_indices()
        .find(|(i, c)| {
            !(c.is_ascii_digit()
                || *c == '.'
                || ((*c == 'e' || *c == 'E') && *i > 0 && exponent_at(*i))
                || ((*c == '+' || *c == '-')
                    && *i > 0
                    && matches!(s.as_bytes()[i - 1], b'e' | b'E')))
        })
        .map(|(i, _)| i)
        .unwrap_or(s.len());
    (&s[..end], s[end..].trim())
}

fn scaled(input: &str, what: &'static str, mult: f64, num: &str) -> Result<u64, ParseUnitError> {
    let err = |why| ParseUnitError {
        input: input.to_string(),
        what,
        why,
    };
    let v: f64 = num.parse().map_err(|_| err("not a number"))?;
    let total = v * mult;
    if !total.is_finite() || total < 0.0 {
        return Err(err("out of range"));
    }
    // `u64::MAX as f64` is 2^64 (rounded up): 2^64 itself is too large
    // (`as u64` would clamp it to 2^64 - 1).
    if total >= u64::MAX as f64 {
        return Err(err("too large"));
    }
    if total.fract() != 0.0 {
        return Err(err("not a whole number"));
    }
    Ok(total as u64)
}

/// Parses a byte size such as `4GiB`, `512M`, `1MB` or `1048576`.
pub fn parse_bytes(input: &str) -> Result<u64, ParseUnitError> {
    let s = input.trim();
    // A plain integer is taken exactly (through f64 the largest counts
    // round to 2^64, which is too large).
    if let Ok(v) = s.parse::<u64>() {
        return Ok(v);
    }
    if s.starts_with('-') {
        return Err(ParseUnitError {
            input: input.to_string(),
            what: "a byte size",
            why: "negative",
        });
    }
    let (num, suffix) = split_number(s);
    let mult = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(ParseUnitError {
            input: input.to_string(),
            what: "a byte size",
            why:
                "unknown suffix (use K/KiB, M/MiB, G/GiB, T/TiB, or KB/MB/GB/TB for powers of 1000)",
        }),
    };
    scaled(input, "a byte size", mult, num)
}

/// Parses a count such as `100M`, `7B`, `1.5e9` or `1000`.
pub fn parse_count(input: &str) -> Result<u64, ParseUnitError> {
    let s = input.trim();
    // A plain integer is taken exactly (through f64 a seed above 2^53
    // would round to another seed).
    if let Ok(v) = s.parse::<u64>() {
        return Ok(v);
    }
    if s.starts_with('-') {
        return Err(ParseUnitError {
            input: input.to_string(),
            what: "a count",
            why: "negative",
        });
    }
    let (num, suffix) = split_number(s);
    let mult = match suffix.to_ascii_uppercase().as_str() {
        "" => 1.0,
        "K" => 1e3,
        "M" => 1e6,
        "B" | "G" => 1e9,
        "T" => 1e12,
        _ => {
            return Err(ParseUnitError {
                input: input.to_string(),
                what: "a count",
                why: "unknown suffix (use K, M, B or G, T)",
            })
        }
    };
    scaled(input, "a count", mult, num)
}

/// Formats bytes with a binary suffix, e.g. `1.5 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Two byte counts compared in one message (needed against available):
/// as [`format_bytes`] each, or in bytes where those read the same and
/// the counts differ ("needs 1.2 MiB and has 1.2 MiB free").
pub fn format_bytes_against(a: u64, b: u64) -> (String, String) {
    let (fa, fb) = (format_bytes(a), format_bytes(b));
    if fa == fb && a != b {
        (format!("{a} bytes"), format!("{b} bytes"))
    } else {
        (fa, fb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_compared_apart() {
        assert_eq!(
            format_bytes_against(1_257_472, 1_220_608),
            ("1257472 bytes".to_owned(), "1220608 bytes".to_owned())
        );
        assert_eq!(
            format_bytes_against(2 << 20, 1 << 20),
            ("2 MiB".to_owned(), "1 MiB".to_owned())
        );
        assert_eq!(
            format_bytes_against(1 << 20, 1 << 20),
            ("1 MiB".to_owned(), "1 MiB".to_owned())
        );
    }

    #[test]
    fn bytes() {
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("4G"), Ok(4 << 30));
        assert_eq!(parse_bytes("128K"), Ok(128 << 10));
        assert_eq!(parse_bytes("1MB"), Ok(1_000_000));
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("1.5KiB"), Ok(1536));
        assert_eq!(parse_bytes("5e8"), Ok(500_000_000));
        assert!(parse_bytes("12 apples").is_err());
        assert!(parse_bytes("-1G").is_err());
        assert!(parse_bytes("0.3").is_err());
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("1e300T").is_err());
    }

    #[test]
    fn counts() {
        assert_eq!(parse_count("100M"), Ok(100_000_000));
        assert_eq!(parse_count("7B"), Ok(7_000_000_000));
        assert_eq!(parse_count("1.5e9"), Ok(1_500_000_000));
        assert_eq!(parse_count("3"), Ok(3));
        // Exact above 2^53 (a seed), and up to u64::MAX.
        assert_eq!(parse_count("9007199254740993"), Ok(9_007_199_254_740_993));
        assert_eq!(parse_count("18446744073709551615"), Ok(u64::MAX));
        // 2^64 is too large, not clamped to u64::MAX (it went through f64).
        assert!(matches!(parse_count("18446744073709551616"), Err(e) if e.why == "too large"));
        assert!(matches!(parse_bytes("16777216TiB"), Err(e) if e.why == "too large"));
        assert_eq!(parse_bytes("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(parse_bytes(" 4096 "), Ok(4096));
        assert!(parse_count("1Q").is_err());
        // An exponent's sign is the number's; a negative count says so.
        assert_eq!(parse_count("1e+3"), Ok(1000));
        assert!(matches!(parse_count("1e-3"), Err(e) if e.why == "not a whole number"));
        assert!(matches!(parse_count("-1"), Err(e) if e.why == "negative"));
        assert!(matches!(parse_bytes("-1M"), Err(e) if e.why == "negative"));
        assert_eq!(parse_bytes("1.5e3"), Ok(1500));
        assert!(matches!(parse_count("7B-"), Err(e) if e.why.starts_with("unknown suffix")));
    }

    #[test]
    fn format() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1 << 20), "1 MiB");
        assert_eq!(format_bytes(3 << 29), "1.5 GiB");
        assert_eq!(format_bytes(1_000_000_000), "953.7 MiB");
    }
}
