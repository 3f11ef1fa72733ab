//! The head's logits on the host: their bytes and the start-up check that
//! they fit the memory available (train and eval on the CPU).

/// Bytes of one fp32 logits tensor of `rows` token positions over `vocab`.
pub fn logits_bytes(rows: u64, vocab: u64) -> u64 {
    rows.saturating_mul(vocab).saturating_mul(4)
}

/// Logits-sized fp32 tensors the head's loss holds at once when it trains
/// on the CPU: the logits, the shifted logits, their `exp` and the
/// log-probabilities, which candle's graph keeps for the backward (which
/// then adds their gradients): a floor, not the peak.
pub const TRAIN_LOGITS_COPIES: u64 = 4;

/// Refuses a head whose `copies` fp32 logits tensors of `rows` token
/// positions over `vocab` exceed `available_bytes` (`None`: unknown, not
/// checked): the allocation aborted the process (32 GB of logits for a
/// vocab of 2M at 4 × 1024 tokens), where this names the numbers and
/// `fix`.
pub fn check_logits_memory(
    rows: u64,
    vocab: u64,
    copies: u64,
    available_bytes: Option<u64>,
    fix: &str,
) -> crate::engine::Result<()> {
    let Some(available) = available_bytes else {
        return Ok(());
    };
    let each = logits_bytes(rows, vocab);
    let need = each.saturating_mul(copies);
    if need <= available {
        return Ok(());
    }
    let f = crate::units::format_bytes;
    Err(crate::engine::EngineError::config(format!(
        "the head's fp32 logits of {rows} token positions x vocab_size {vocab} take {} each, \
         and its loss holds at least {copies} of them ({}) where {} of host memory is \
         available; {fix}",
        f(each),
        f(need),
        f(available)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The logits check: `copies` tensors of rows x vocab x 4 B against
    /// what is available, the numbers in the refusal; unknown memory is
    /// not checked.
    #[test]
    fn logits_past_the_memory_available_are_refused_with_the_numbers() {
        assert_eq!(logits_bytes(4096, 2_000_000), 32_768_000_000);
        let fix = "lower it";
        assert!(check_logits_memory(4096, 1000, 4, Some(4096 * 1000 * 16), fix).is_ok());
        let e = match check_logits_memory(4096, 1000, 4, Some(4096 * 1000 * 16 - 1), fix) {
            Err(e) => e.to_string(),
            Ok(()) => panic!("past the memory available"),
        };
        assert!(
            e.contains("4096 token positions x vocab_size 1000")
                && e.contains("at least 4 of them")
                && e.ends_with(fix),
            "{e}"
        );
        assert!(check_logits_memory(u64::MAX, u64::MAX, 4, None, fix).is_ok());
    }
}
