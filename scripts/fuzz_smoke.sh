#!/usr/bin/env bash
# Smoke-runs every cargo-fuzz target for SECONDS (default 30) each, from the
# committed corpus, without adding to it (new inputs go to a temp dir).
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain, or
# a stable one with RUSTC_BOOTSTRAP=1 (set below when no nightly exists).
# Exit status is non-zero if any target finds a crash; the crashing input
# is left in fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH="${1:-30}"
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  TOOLCHAIN=(+nightly)
else
  TOOLCHAIN=()
  export RUSTC_BOOTSTRAP=1
fi
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz not installed: cargo install cargo-fuzz" >&2; exit 2; }
status=0
for target in ds_config hf_config safetensors_header manifest; do
  scratch="$(mktemp -d)"
  echo "== $target: ${SECONDS_EACH}s"
  log="$scratch.log"
  rc=0
  cargo "${TOOLCHAIN[@]}" fuzz run -O "$target" "$scratch" "fuzz/corpus/$target" -- \
      -max_total_time="$SECONDS_EACH" -max_len=16384 -rss_limit_mb=2048 -timeout=10 \
      -print_final_stats=1 >"$log" 2>&1 || rc=$?
  grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|SUMMARY)|panicked|ERROR' "$log" || true
  if [ "$rc" -ne 0 ]; then status=1; tail -40 "$log" >&2; echo "== $target FAILED" >&2; fi
  rm -f "$log"
  rm -rf "$scratch"
done
exit "$status"
