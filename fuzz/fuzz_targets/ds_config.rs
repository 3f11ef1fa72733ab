//! The ds_config parser and validator on arbitrary text: parse, then
//! resolve against a fixed run context (no path checks, so the fuzzer never
//! creates directories). Any outcome but a panic, an abort or a hang is fine.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tierzero::config::{parse_str, PathChecks, RunContext};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(parsed) = parse_str(text) else {
        return;
    };
    let _ = parsed.unknown_keys();
    let run = RunContext {
        total_steps: Some(100),
        hidden_size: Some(64),
        model_numel: Some(1_000_000),
        path_checks: PathChecks::Skip,
        ..RunContext::default()
    };
    let _ = parsed.resolve(&run);
});
