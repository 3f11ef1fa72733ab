//! DeepSpeed's deprecated forms of `ds_config.json` keys, read as
//! DeepSpeed reads them, each with a deprecation warning: the top-level
//! `bfloat16` (`bf16`'s old name), `zero_optimization` as a boolean, and
//! its `cpu_offload` and `cpu_offload_param` flags (the offload blocks
//! they stand for) and `cpu_offload_use_pin_memory` (ignored, as DeepSpeed
//! ignores it).

use super::super::error::ConfigError;
use super::super::reader::{ConfigWarning, Field, Obj, Sink};
use super::{DsBf16, DsConfig, DsOffloadOptimizer, DsOffloadParam, DsZero};

/// The offload blocks that the deprecated `cpu_offload*` flags stand for.
trait OffloadBlock: Sized {
    /// The block's key in `zero_optimization`.
    const KEY: &'static str;
    /// Reads the block ([`section!`]'s `read`).
    fn read_block(f: &Field<'_>, sink: &mut Sink) -> Result<Self, ConfigError>;
}

impl OffloadBlock for DsOffloadParam {
    const KEY: &'static str = "offload_param";
    fn read_block(f: &Field<'_>, sink: &mut Sink) -> Result<Self, ConfigError> {
        Self::read(f, sink)
    }
}

impl OffloadBlock for DsOffloadOptimizer {
    const KEY: &'static str = "offload_optimizer";
    fn read_block(f: &Field<'_>, sink: &mut Sink) -> Result<Self, ConfigError> {
        Self::read(f, sink)
    }
}

/// A deprecated `cpu_offload` / `cpu_offload_param` flag: warns, refuses
/// if the block it stands for is also written (whatever its value), and
/// when true fills `slot` with that block, `{"device": "cpu"}`.
fn cpu_offload_flag<T: OffloadBlock>(
    o: &mut Obj<'_>,
    flag: &str,
    slot: &mut Option<T>,
    sink: &mut Sink,
) -> Result<(), ConfigError> {
    let Some(f) = o.take(flag) else {
        return Ok(());
    };
    let on = f.bool()?;
    // What the flag stands for: `false` is the default, no offload (the
    // advice for `true` would turn offload on).
    let device = if on { "cpu" } else { "none" };
    sink.warnings.push(ConfigWarning::Deprecated {
        key: f.key.clone(),
        replacement: format!("\"{}\": {{\"device\": \"{device}\"}}", T::KEY),
    });
    // Written beside its block, either value is refused, as DeepSpeed
    // refuses it ("Cannot provide deprecated parameter ... and replacing
    // parameter ... together"): a `false` would advise removing the block.
    let key = o.key_path(T::KEY);
    if slot.is_some() {
        return Err(ConfigError::ConflictingAlias {
            old: f.key.clone(),
            new: key,
        });
    }
    if !on {
        return Ok(());
    }
    let value = serde_json::json!({"device": "cpu"});
    *slot = Some(T::read_block(&Field { key, value: &value }, sink)?);
    Ok(())
}

/// The top-level `bfloat16`, `bf16`'s old name: read where `bf16` is
/// absent (with a deprecation warning), and ignored with a note where it
/// is present, as DeepSpeed's `get_bfloat16_config` does.
pub(super) fn bfloat16_old_name(
    o: &mut Obj<'_>,
    c: &mut DsConfig,
    sink: &mut Sink,
) -> Result<(), ConfigError> {
    let has_bf16 = o.has("bf16");
    let Some(old) = o.take("bfloat16") else {
        return Ok(());
    };
    if has_bf16 {
        sink.note(
            &old.key,
            "ignored: `bf16` is given too, and DeepSpeed reads `bf16` alone then; remove one",
        );
    } else {
        sink.warnings.push(ConfigWarning::Deprecated {
            key: old.key.clone(),
            replacement: "`bf16`".to_owned(),
        });
        c.bf16 = DsBf16::read(&old, sink)?;
    }
    Ok(())
}

/// `zero_optimization`: the object, or DeepSpeed's deprecated boolean
/// (`read_zero_config_deprecated`: `true` is stage 1, `false` stage 0).
pub(super) fn read_zero(f: &Field<'_>, sink: &mut Sink) -> Result<DsZero, ConfigError> {
    let Some(on) = f.value.as_bool() else {
        return DsZero::read(f, sink);
    };
    let stage = u64::from(on);
    sink.warnings.push(ConfigWarning::Deprecated {
        key: f.key.clone(),
        replacement: format!("{{\"stage\": {stage}}}"),
    });
    Ok(DsZero {
        stage,
        ..DsZero::default()
    })
}

/// `zero_optimization`'s deprecated boolean forms: `cpu_offload`,
/// `cpu_offload_param` and `cpu_offload_use_pin_memory`. The last is read
/// (a boolean) and ignored, as DeepSpeed ignores it: its deprecated field
/// sets no new param (`"set_new_param": False` in
/// `deepspeed/runtime/zero/config.py`), so the blocks' `pin_memory`
/// default stands.
pub(super) fn deprecated_cpu_offload(
    o: &mut Obj<'_>,
    z: &mut DsZero,
    sink: &mut Sink,
) -> Result<(), ConfigError> {
    if let Some(f) = o.take("cpu_offload_use_pin_memory") {
        f.bool()?;
        sink.note(
            &f.key,
            "ignored, as DeepSpeed ignores it (deprecated: it sets nothing); set \"pin_memory\" \
             inside offload_param / offload_optimizer",
        );
    }
    cpu_offload_flag(o, "cpu_offload", &mut z.offload_optimizer, sink)?;
    cpu_offload_flag(o, "cpu_offload_param", &mut z.offload_param, sink)?;
    Ok(())
}
