#!/usr/bin/env bash
# The one prepared GPU check (the developers' guide asks for one script): run it in one go on a machine
# with an NVIDIA GPU. It never fails half-way: every step's outcome goes
# into one JSON object on stdout (and $OUT/gpu_check.json when $OUT is set);
# the exit status is 0 when every step that applies passed, 1 otherwise.
#
# Steps:
#   1. the binary: $TIERZERO_BIN if set (a release build made elsewhere with
#      `cargo build --release --features gpu`: it loads libcuda/libnccl at
#      run time, so it runs on any x86_64 Linux with the driver), else
#      `cargo build --release --features gpu` here (timed);
#   2. nvidia-smi -L, when present;
#   3. `tierzero gpu-info --json` (the probe: devices, memory, NCCL);
#   4. the NCCL self-test on one rank (cuda:0): every collective the engine
#      uses, bit-checked, plus a timed all-gather;
#   5. two ranks through the TCP rendezvous (TIERZERO_NCCL_ADDR on
#      127.0.0.1): on cuda:0 and cuda:1 when there are two GPUs; with one
#      GPU both ranks on cuda:0, which NCCL is expected to refuse
#      ("Duplicate GPU detected"): recorded as such, not counted as a failure;
#   6. `train --device cuda` (the units on the GPU) against `train
#      --device cpu`, 20 fp32 steps of a GPT-2 and of a Llama: losses
#      within 1e-3 relative at every step, and a second GPU run with the
#      same bits;
#   6b. the Python package's AdamW over CUDA params against CPU params, bit
#      for bit (python/tests/test_adamw_cuda.py, with the machine's
#      PyTorch; the wheel from $TIERZERO_WHEEL or target/wheels/);
#   6c. every CUDA kernel against its CPU reference (gpu/examples/
#      kernel_check, $KERNEL_CHECK_BIN), with PyTorch's cuBLAS and NVRTC;
#   6d. a small GPT-2 trained 20 steps on the GPU against the same units
#      on the kernels' references, and twice on the GPU (gpu/examples/
#      train_check, $TRAIN_CHECK_BIN);
#   6e. throughput of a ~350M GPT-2 in GPU memory, bf16 GEMMs, seq 1024,
#      each block's forward kept for its backward, against PyTorch eager
#      on the same shape (a measurement);
#   6f. the device tier: `train --device cuda` with cpu offload and with
#      a 1 GiB device cache, each bit-identical (losses, weight_sha256) to
#      step 6's GPU run with NVMe offload, and at stage 0 with nothing
#      offloaded (training in GPU memory, Adam on the GPU) within 1e-4
#      (it clips on the device's Σg²); the runs' h2d/d2h bytes and waits;
#   6g. bf16: the embedded GPT-2 20 steps in bf16 on the GPU against the
#      CPU in bf16, losses within 1e-2 relative;
#   6h. throughput with offload (a measurement): a Llama layout of ~850M
#      params in bf16, seq 1024, stage 3 with params and optimizer on the
#      CPU and a 4 GiB device budget (so the tier streams the params),
#      (the CPU Adam on half the cores, --threads), against PyTorch FSDP2
#      with CPUOffloadPolicy on the same config,
#      batch and precision (scripts/fsdp2_offload_throughput.py); the
#      issue's goal is a ratio of at least 1.5;
#   6i. overlap on the GPU (a measurement): examples/device_overlap
#      ($DEVICE_OVERLAP_BIN), the step of a GPT-2 (6 layers, hidden 1024,
#      seq 256) whose params and optimizer state live in host memory
#      (TIER=cpu), then on NVMe, streamed to the GPU, against each phase
#      alone in the same process (compute with everything resident on
#      the GPU, the params' h2d, the gradients' d2h, the tier's I/O, the
#      CPU Adam); MICRO calibrated first (1, 2, 4, ... until compute
#      alone passes h2d alone; the closest kept); the issue's aim is a
#      ratio of at most 1.15;
#   7. the overlap ratio (docs/decisions/overlap.md) on this machine's cores and disk (a
#      measurement, never a failure): `examples/overlap` (built with the
#      binary in step 1; skipped with TIERZERO_BIN unless OVERLAP_BIN
#      names one). With more than 2 cores it first times compute alone at
#      1, 2, 4, 8 and cores-1 ("auto") compute threads (MICRO=2; and at 1,
#      4 and auto on a 4-layer hidden-512 model, MICRO=8) and keeps the
#      fastest; then calibrates MICRO (1 round of 4 steps at 2, 4, 8, ...
#      until compute alone passes I/O alone), picks the MICRO whose
#      compute alone is closest to its I/O alone, and runs 6 interleaved
#      rounds of 6 steps there, with the harness's limits and again with
#      LIVE_H2=72 REUSE_H2=24 (max-live 6 blocks, reuse 2 blocks); last,
#      MICRO=2 with the "auto" threads. The balanced and MICRO=2 runs are
#      repeated with PIN=off (tierzero.pin_threads: false) beside them. Each run is skipped when too
#      little of the budget is left. Swap files go under OVERLAP_DIR
#      (default ./overlap-check, on the disk rather than a tmpfs /tmp),
#      removed afterwards.
#
# Run on one H200 machine (16 cores) on 2026-11-30, in its version of
# that day (steps 1-5, a 3-step train --device cuda that carried only the
# collectives, and 7): every step passed; two ranks on its one GPU were
# refused (ncclInvalidUsage, now an exit-2 hint). Steps 6-6i have not run
# on a GPU; run here without one (2026-12-03), with the carried binaries,
# each CPU side trains and each CUDA run exits 2 naming libcuda.
#
# Environment: TIERZERO_BIN, KERNEL_CHECK_BIN, TRAIN_CHECK_BIN, THROUGHPUT_BIN, DEVICE_OVERLAP_BIN,
# TIERZERO_WHEEL, TIERZERO_PY,
# OVERLAP_BIN, OVERLAP_DIR, GPU_CHECK_PORT
# (default 29517), GPU_CHECK_BYTES (timed all-gather per rank, default
# 256M), GPU_CHECK_BUDGET_S (default 300: the overlap measurement uses
# what steps 1-6 leave of it, so the whole check fits a short device
# lease), OUT (the JSON and every step's log, logs.txt, go there).
#
# Libraries: cudarc loads the unversioned libnccl.so, which only NCCL's
# development files install; a machine with the runtime alone (the
# libnccl2 package, or the nvidia-nccl wheel that PyTorch brings) has
# libnccl.so.2. Step 3 first probes as the machine is (what a user sees:
# with the fix `tierzero` prints for that case), then, if NCCL was not
# loadable, finds a libnccl.so.N, links it as $WORK/lib/libnccl.so, puts
# that first on LD_LIBRARY_PATH and probes again; the JSON records both.
set -uo pipefail
cd "$(dirname "$0")/.."

PORT="${GPU_CHECK_PORT:-29517}"
BYTES="${GPU_CHECK_BYTES:-256M}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-300}"
WORK="$(mktemp -d)"
LOGS="${OUT:-$WORK}/logs.txt"
# Every step's files go into logs.txt on the way out.
trap 'for f in $(find "$WORK" -maxdepth 2 -type f \( -name "*.txt" -o -name "*.err" -o -name "*.json" -o -name "*.log" \) | sort); do printf "\n===== %s\n" "${f#$WORK/}"; tail -c 20000 "$f"; done >"$LOGS" 2>/dev/null; rm -rf "$WORK"' EXIT
export TIERZERO_COMM_TIMEOUT_S="${TIERZERO_COMM_TIMEOUT_S:-60}"
unset TIERZERO_NCCL_ADDR TIERZERO_RANK TIERZERO_WORLD_SIZE
failed=0
# Seconds left of the budget (never below 1).
left() { local l=$(( BUDGET_S - SECONDS )); [ "$l" -ge 1 ] && echo "$l" || echo 1; }
# A timeout no longer than `left`.
cap() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }

# A JSON string from a file's text (escapes \ " and tabs, drops terminal
# colour codes and the other control characters; the last 4000 bytes).
json_str() {
  tail -c 4000 "$1" | sed -e 's/\x1b\[[0-9;]*[A-Za-z]//g' | tr -d '\000-\010\013-\037' \
    | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/\t/\\t/g' -e 's/\r//g' \
    | awk 'BEGIN{ORS=""; print "\""} NR>1{print "\\n"} {print} END{print "\""}'
}
# A JSON value: the last line of a file if it is an object, else null.
json_obj() {
  local last
  last="$(grep -E '^\{' "$1" 2>/dev/null | tail -n 1)"
  if [ -n "$last" ]; then printf '%s' "$last"; else printf 'null'; fi
}

# 0. The machine.
{ echo "nproc: $(nproc)"; uname -r; free -g; df -h .; ldconfig -p | grep -E 'libcuda\.so|libnccl' ; } >"$WORK/machine.txt" 2>&1

# 1. Binary.
build_s=null
build_log="$WORK/build.log"; : >"$build_log"
if [ -n "${TIERZERO_BIN:-}" ] && [ -x "$TIERZERO_BIN" ]; then
  BIN="$TIERZERO_BIN"
elif command -v cargo >/dev/null; then
  t0=$(date +%s)
  if cargo build --release --features gpu --bin tierzero --example overlap --example device_overlap >"$build_log" 2>&1; then
    build_s=$(( $(date +%s) - t0 ))
    BIN="${CARGO_TARGET_DIR:-target}/release/tierzero"
    OVERLAP_BIN="${OVERLAP_BIN:-${CARGO_TARGET_DIR:-target}/release/examples/overlap}"
    DEVICE_OVERLAP_BIN="${DEVICE_OVERLAP_BIN:-${CARGO_TARGET_DIR:-target}/release/examples/device_overlap}"
  else
    BIN=""
  fi
else
  echo "no TIERZERO_BIN and no cargo" >"$build_log"
  BIN=""
fi
if [ -z "$BIN" ]; then
  printf '{"ok":false,"step":"build","log":%s}\n' "$(json_str "$build_log")" | tee "${OUT:-$WORK}/gpu_check.json"
  exit 1
fi
# Every binary by its absolute path: several steps run them from a run
# directory of their own (cd "$d"), where a relative path such as the
# documented TIERZERO_BIN=target/gpu-carry/tierzero is not found.
abs() { if [ -n "$1" ] && [ -e "$1" ]; then echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; else echo "$1"; fi; }
BIN=$(abs "$BIN")
for v in OVERLAP_BIN DEVICE_OVERLAP_BIN KERNEL_CHECK_BIN TRAIN_CHECK_BIN THROUGHPUT_BIN TIERZERO_WHEEL; do
  if [ -n "${!v:-}" ]; then printf -v "$v" '%s' "$(abs "${!v}")"; fi
done

# 2. nvidia-smi.
smi="$WORK/smi.txt"
if command -v nvidia-smi >/dev/null; then nvidia-smi -L >"$smi" 2>&1; else echo "nvidia-smi not found" >"$smi"; fi

# 3. Probe: first as the machine is, then (if NCCL did not load) with a
# libnccl.so link to the libnccl.so.N the machine has.
probe_plain="$WORK/probe_plain.json"
timeout "$(cap 120)" "$BIN" gpu-info --json >"$probe_plain" 2>"$WORK/probe_plain.err"; probe_plain_rc=$?
nccl_link=null
if ! grep -q '"nccl":{"version"' "$probe_plain"; then
  lib=$(ldconfig -p 2>/dev/null | grep -o '/[^ ]*/libnccl\.so\.[0-9][0-9.]*$' | head -n 1)
  if [ -z "$lib" ]; then
    lib=$(timeout 60 find / -xdev \( -path /proc -o -path /sys \) -prune -o -name 'libnccl.so.[0-9]*' -print 2>/dev/null | sort | head -n 1)
  fi
  if [ -n "$lib" ]; then
    mkdir -p "$WORK/lib" && ln -sf "$lib" "$WORK/lib/libnccl.so"
    export LD_LIBRARY_PATH="$WORK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    nccl_link="\"$lib\""
  fi
fi
probe_out="$WORK/probe.json"; probe_err="$WORK/probe.err"
if [ "$nccl_link" = null ]; then
  # Nothing changed: the probe as installed is the probe.
  cp "$probe_plain" "$probe_out"; cp "$WORK/probe_plain.err" "$probe_err"; probe_rc=$probe_plain_rc
else
  timeout "$(cap 120)" "$BIN" gpu-info --json >"$probe_out" 2>"$probe_err"; probe_rc=$?
fi
[ "$probe_rc" -eq 0 ] || failed=1
ngpu=$(grep -o '"ordinal":[0-9]*' "$probe_out" | wc -l)

# 4. One rank.
one_out="$WORK/one.json"; one_err="$WORK/one.err"
timeout "$(cap 120)" "$BIN" gpu-info --json --nccl-test --device cuda:0 --test-bytes "$BYTES" \
  >"$one_out" 2>"$one_err"; one_rc=$?
[ "$one_rc" -eq 0 ] || failed=1

# 5. Two ranks over the TCP rendezvous (short timeouts: with one GPU NCCL
# is expected to refuse at once, and a hang must not eat the lease).
if [ "$ngpu" -ge 2 ]; then dev1=cuda:1; two_expect="pass"; else dev1=cuda:0; two_expect="refused (one GPU)"; fi
two_t=$(cap 60)
for r in 0 1; do
  dev=cuda:0; [ "$r" -eq 1 ] && dev="$dev1"
  TIERZERO_COMM_TIMEOUT_S=30 TIERZERO_NCCL_ADDR="127.0.0.1:$PORT" TIERZERO_RANK=$r TIERZERO_WORLD_SIZE=2 \
    timeout "$two_t" "$BIN" gpu-info --json --nccl-test --device "$dev" --test-bytes "$BYTES" \
    >"$WORK/two$r.json" 2>"$WORK/two$r.err" &
  eval "pid$r=\$!"
done
wait "$pid0"; two_rc0=$?
wait "$pid1"; two_rc1=$?
if [ "$ngpu" -ge 2 ] && { [ "$two_rc0" -ne 0 ] || [ "$two_rc1" -ne 0 ]; }; then failed=1; fi

# 6. Training with the units on the GPU (--device cuda: tierzero-gpu's CUDA
# units, the engine and CPU Adam as on the CPU) against --device cpu, 20
# fp32 steps of the embedded GPT-2 and of a small Llama (config only,
# seeded init), the default ZeRO-3 NVMe config: every step's loss within
# 1e-3 relative, and a second GPU run with the same bits (losses and the
# weights' sha256). CUDA 13's cuBLAS and NVRTC come from the machine's
# PyTorch wheels (every nvidia/*/lib under /opt/torch/.venv goes on
# LD_LIBRARY_PATH; the JSON lists them).
nv_libs=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/*/lib 2>/dev/null | paste -sd: -)
mkdir -p "$WORK/llama"
cat >"$WORK/llama/config.json" <<'JSON'
{"model_type":"llama","vocab_size":256,"hidden_size":256,"intermediate_size":688,"num_hidden_layers":4,
 "num_attention_heads":8,"num_key_value_heads":4,"max_position_embeddings":256,"rope_theta":10000.0,
 "tie_word_embeddings":false}
JSON
train_same=true
for model in gpt2 llama; do
  margs=(); [ "$model" = llama ] && margs=(--model "$WORK/llama")
  for run in cpu cuda cuda2; do
    dev=cpu; [ "$run" != cpu ] && dev=cuda:0
    d="$WORK/train-$model-$run"; mkdir -p "$d"
    t0=$SECONDS
    (cd "$d" && LD_LIBRARY_PATH="${nv_libs}${nv_libs:+:}${LD_LIBRARY_PATH:-}" TIERZERO_KERNEL_CACHE="$WORK/kcache" \
      timeout "$(cap 150)" "$BIN" train --device "$dev" "${margs[@]}" --steps 20 --seq-len 128 \
      --metrics metrics.jsonl --json >out.json 2>err.txt); echo $? >"$d/rc"
    echo $(( SECONDS - t0 )) >"$d/secs"
  done
  # Per-step losses from the metrics lines, then the comparisons.
  for run in cpu cuda cuda2; do
    grep -o '"loss":[0-9.eE+-]*' "$WORK/train-$model-$run/metrics.jsonl" 2>/dev/null | cut -d: -f2 >"$WORK/train-$model-$run/losses"
  done
  worst=$(paste "$WORK/train-$model-cpu/losses" "$WORK/train-$model-cuda/losses" | awk '
    NF == 2 { d = ($2 - $1) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ }
    END { if (n >= 20) printf "%.3e", w; else print "null" }')
  sha_a=$(grep -o '"weight_sha256":"[0-9a-f]*"' "$WORK/train-$model-cuda/out.json" 2>/dev/null || true)
  sha_b=$(grep -o '"weight_sha256":"[0-9a-f]*"' "$WORK/train-$model-cuda2/out.json" 2>/dev/null || true)
  twice=false
  if [ -n "$sha_a" ] && [ "$sha_a" = "$sha_b" ] && cmp -s "$WORK/train-$model-cuda/losses" "$WORK/train-$model-cuda2/losses"; then twice=true; fi
  ok=false
  if [ "$worst" != null ] && awk -v w="$worst" 'BEGIN { exit !(w <= 1e-3) }' && [ "$twice" = true ]; then ok=true; fi
  [ "$ok" = true ] || { train_same=false; failed=1; }
  printf '{"model":"%s","ok":%s,"max_rel_loss_diff_cpu_vs_cuda":%s,"cuda_twice_same_bits":%s}\n' \
    "$model" "$ok" "$worst" "$twice" >"$WORK/train-$model.summary.json"
done

# 6f. The device tier (issue 23's equivalence): the same 20 steps on the
# GPU with everything in host memory at stage 0, with params and optimizer
# state offloaded to the CPU, and with a device cache of 1 GiB, each
# against step 6's GPU run (stage 3, params and state on NVMe): the same
# loss bits and weight_sha256. Each run's metrics carry h2d_bytes,
# d2h_bytes, h2d_wait_s, d2h_wait_s, and the compute, h2d and d2h
# streams' busy seconds from CUDA events (device_busy_s, h2d_busy_s,
# d2h_busy_s) and the upload thread's staging fills (h2d_fill_busy_s, the
# host's clock); the JSON keeps their totals with the steps' wall seconds,
# so wall / the busiest queue says how well copies and compute
# overlapped, and how many units the device computes launched ahead of
# the engine's call (forwards_ahead, backwards_ahead). With cpu offload the
# params cross from their registered pinned pages in place, with nvme from
# the registered swap buffers their reads landed in (h2d_direct_bytes
# of h2d_bytes; 0 means cuMemHostRegister was refused: see err.txt). The cpu-offload GPT-2
# run also writes a timeline of one step with the device lanes
# ($OUT/timeline-device-tier.json).
PYCFG=$(command -v python3 || echo /opt/torch/.venv/bin/python)
tier_same=true
for variant in stage0 cpu cache; do
  "$PYCFG" - "$variant" "$WORK/ds-$variant.json" <<'PY' 2>"$WORK/ds-$variant.err"
import json, sys
variant, out = sys.argv[1], sys.argv[2]
c = json.load(open("src/config/default.json"))
z = c["zero_optimization"]
if variant == "stage0":
    z["stage"] = 0
    z.pop("offload_param", None)
    z.pop("offload_optimizer", None)
elif variant == "cpu":
    z["offload_param"] = {"device": "cpu", "pin_memory": True}
    z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
else:
    c["tierzero"]["device_cache_bytes"] = 1 << 30
json.dump(c, open(out, "w"))
PY
done
# The configs made from src/config/default.json keep its nvme_path
# (./tierzero-swap, relative to the run directory), which must exist.
for model in gpt2 llama; do
  margs=(); [ "$model" = llama ] && margs=(--model "$WORK/llama")
  base="$WORK/train-$model-cuda"
  for variant in stage0 cpu cache; do
    d="$WORK/tier-$model-$variant"; mkdir -p "$d/tierzero-swap"
    t0=$SECONDS
    targs=(); [ "$variant" = cpu ] && targs=(--timeline timeline.json --timeline-steps 1)
    (cd "$d" && LD_LIBRARY_PATH="${nv_libs}${nv_libs:+:}${LD_LIBRARY_PATH:-}" TIERZERO_KERNEL_CACHE="$WORK/kcache" \
      timeout "$(cap 150)" "$BIN" train --device cuda:0 --config "$WORK/ds-$variant.json" "${margs[@]}" \
      --steps 20 --seq-len 128 --metrics metrics.jsonl "${targs[@]}" --json >out.json 2>err.txt); echo $? >"$d/rc"
    echo $(( SECONDS - t0 )) >"$d/secs"
    grep -o '"loss":[0-9.eE+-]*' "$d/metrics.jsonl" 2>/dev/null | cut -d: -f2 >"$d/losses"
    sha_v=$(grep -o '"weight_sha256":"[0-9a-f]*"' "$d/out.json" 2>/dev/null || true)
    sha_b=$(grep -o '"weight_sha256":"[0-9a-f]*"' "$base/out.json" 2>/dev/null || true)
    same=false
    if [ -n "$sha_v" ] && [ "$sha_v" = "$sha_b" ] && [ "$(wc -l <"$d/losses")" -ge 20 ] && cmp -s "$d/losses" "$base/losses"; then same=true; fi
    # stage0 has nothing offloaded: Adam runs on the device (ResidentUnits),
    # and the default config clips, on the device's own Σg² (a fixed-order
    # sum, not the host's): its losses within 1e-4 relative, not the bits.
    close=$same
    if [ "$variant" = stage0 ]; then
      close=$("$PYCFG" -c 'import sys; a=[float(x) for x in open(sys.argv[1])]; b=[float(x) for x in open(sys.argv[2])]; print(str(len(a)>=20 and len(a)==len(b) and all(abs(x-y)<=1e-4*abs(y) for x,y in zip(a,b))).lower())' "$d/losses" "$base/losses" 2>/dev/null || echo false)
    fi
    [ "$close" = true ] || { tier_same=false; failed=1; }
    totals=$(awk -F'[:,}]' '/"step":/ && NR > 1 { for (i = 1; i < NF; i++) { if ($i ~ /"h2d_bytes"/) h += $(i+1); if ($i ~ /"d2h_bytes"/) d += $(i+1); if ($i ~ /"h2d_wait_s"/) w += $(i+1); if ($i ~ /"d2h_wait_s"/) x += $(i+1);
        if ($i ~ /"device_busy_s"/) c += $(i+1); if ($i ~ /"h2d_busy_s"/) u += $(i+1); if ($i ~ /"d2h_busy_s"/) o += $(i+1); if ($i ~ /"h2d_fill_busy_s"/) f += $(i+1); if ($i ~ /"wall_s"/) s += $(i+1);
        if ($i ~ /"device_forwards_ahead"/) fa += $(i+1); if ($i ~ /"device_backwards_ahead"/) ba += $(i+1); if ($i ~ /"h2d_direct_bytes"/) hd += $(i+1); if ($i ~ /"param_buffers_let_go"/) lg += $(i+1) } }
      END { m = (c > u ? c : u); m = (o > m ? o : m); printf "{\"steps_after_first\":true,\"h2d_direct_bytes\":%d,\"param_buffers_let_go\":%d,\"h2d_bytes\":%d,\"d2h_bytes\":%d,\"h2d_wait_s\":%.4f,\"d2h_wait_s\":%.4f,\"device_busy_s\":%.4f,\"h2d_busy_s\":%.4f,\"d2h_busy_s\":%.4f,\"h2d_fill_busy_s\":%.4f,\"wall_s\":%.4f,\"wall_over_busiest_queue\":%s,\"forwards_ahead\":%d,\"backwards_ahead\":%d}", hd, lg, h, d, w, x, c, u, o, f, s, (m > 0 ? sprintf("%.3f", s / m) : "null"), fa, ba }' "$d/metrics.jsonl" 2>/dev/null || echo null)
    [ -n "${OUT:-}" ] && [ -f "$d/timeline.json" ] && [ "$model" = gpt2 ] && cp "$d/timeline.json" "$OUT/timeline-device-tier.json"
    printf '{"same_bits_as_nvme_stage3":%s,"within_1e-4_of_nvme_stage3":%s,"adam_on_device":%s,"traffic":%s}\n' \
      "$same" "$close" "$([ "$variant" = stage0 ] && echo true || echo false)" "$totals" >"$d/summary.json"
  done
done

# 6g. bf16 (bf16.enabled in the default ZeRO-3 NVMe config): the embedded
# GPT-2 20 steps with --device cuda (bf16 params, bf16 GEMM operands, fp32
# elsewhere) against --device cpu in bf16: every step's loss within 1e-2
# relative (the CPU units round linear outputs to bf16 too; on the
# simulated device the two agree within 1e-3).
"$PYCFG" - "$WORK/ds-bf16.json" <<'PY' 2>"$WORK/ds-bf16.err"
import json, sys
c = json.load(open("src/config/default.json"))
c["bf16"] = {"enabled": True}
json.dump(c, open(sys.argv[1], "w"))
PY
for run in cpu cuda; do
  dev=cpu; [ "$run" = cuda ] && dev=cuda:0
  d="$WORK/bf16-$run"; mkdir -p "$d/tierzero-swap"
  t0=$SECONDS
  (cd "$d" && LD_LIBRARY_PATH="${nv_libs}${nv_libs:+:}${LD_LIBRARY_PATH:-}" TIERZERO_KERNEL_CACHE="$WORK/kcache" \
    timeout "$(cap 150)" "$BIN" train --device "$dev" --config "$WORK/ds-bf16.json" --steps 20 --seq-len 128 \
    --metrics metrics.jsonl --json >out.json 2>err.txt); echo $? >"$d/rc"
  echo $(( SECONDS - t0 )) >"$d/secs"
  grep -o '"loss":[0-9.eE+-]*' "$d/metrics.jsonl" 2>/dev/null | cut -d: -f2 >"$d/losses"
done
bf16_worst=$(paste "$WORK/bf16-cpu/losses" "$WORK/bf16-cuda/losses" | awk '
  NF == 2 { d = ($2 - $1) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ }
  END { if (n >= 20) printf "%.3e", w; else print "null" }')
bf16_ok=false
if [ "$bf16_worst" != null ] && awk -v w="$bf16_worst" 'BEGIN { exit !(w <= 1e-2) }'; then bf16_ok=true; fi
[ "$bf16_ok" = true ] || failed=1

# 6b. The Python package over CUDA params (python/tests/test_adamw_cuda.py:
# gradients down and new params up through pinned buffers on a side
# stream, bit for bit against CPU params), with the machine's PyTorch. The
# wheel: $TIERZERO_WHEEL, else target/wheels/tierzero-*.whl (carry it);
# installed with --no-deps into a scratch directory.
py_log="$WORK/python_cuda.txt"; : >"$py_log"
PY="${TIERZERO_PY:-$(ls /opt/torch/.venv/bin/python 2>/dev/null || command -v python3)}"
WHEEL="${TIERZERO_WHEEL:-$(ls target/wheels/tierzero-*.whl 2>/dev/null | head -n 1)}"
py_rc=null; py_result=null
if [ -n "$WHEEL" ] && [ -n "$PY" ]; then
  if "$PY" -m pip install -q --no-deps --no-index --target "$WORK/py" "$WHEEL" >>"$py_log" 2>&1; then
    PYTHONPATH="$WORK/py" timeout "$(cap 150)" "$PY" python/tests/test_adamw_cuda.py "$WORK/pyt" >"$WORK/python_cuda.json" 2>>"$py_log"
    py_rc=$?
    py_result=$(json_obj "$WORK/python_cuda.json")
    rm -rf "$WORK/pyt"
  else
    py_rc=\"install\"
  fi
  [ "$py_rc" = 0 ] || failed=1
else
  echo "no wheel (TIERZERO_WHEEL, target/wheels) or no python" >"$py_log"
fi

# 6c. Every CUDA kernel against its CPU reference (tierzero-gpu's
# examples/kernel_check: fresh inputs, poisoned outputs, fp32 at 1e-5 and
# bf16 at 2e-2 relative, cuBLAS GEMMs, AdamW bit for bit). CUDA 13's cuBLAS
# and NVRTC come from the machine's PyTorch wheels: every nvidia/*/lib
# under /opt/torch/.venv goes on LD_LIBRARY_PATH for this step (the JSON
# lists them). The binary: $KERNEL_CHECK_BIN, else
# target/release/examples/kernel_check, else built here.
# run_example NAME BIN: runs tierzero-gpu's example NAME (BIN if given,
# else target/release/examples/NAME, else built here) with PyTorch's CUDA
# libraries; sets ex_bin, ex_rc and ex_result (the JSON it wrote); the log
# is $WORK/NAME.err.
run_example() {
  local name=$1 bin=$2 log="$WORK/$1.err"
  : >"$log"
  if [ -z "$bin" ] && [ -x "target/release/examples/$name" ]; then bin="target/release/examples/$name"; fi
  if [ -z "$bin" ] && command -v cargo >/dev/null; then
    cargo build --release -p tierzero-gpu --example "$name" >>"$log" 2>&1 && bin="target/release/examples/$name"
  fi
  ex_bin=$bin; ex_rc=null; ex_result=null
  if [ -n "$bin" ]; then
    LD_LIBRARY_PATH="${nv_libs}${nv_libs:+:}${LD_LIBRARY_PATH:-}" TIERZERO_KERNEL_CACHE="$WORK/kcache" \
      timeout "$(cap 180)" "$bin" "$WORK/$name.json" >/dev/null 2>>"$log"
    ex_rc=$?
    ex_result=$(json_obj "$WORK/$name.json")
    [ "$ex_rc" = 0 ] || failed=1
  else
    echo "no $name binary and no cargo" >>"$log"
    failed=1
  fi
}
run_example kernel_check "${KERNEL_CHECK_BIN:-}"
KC_BIN=$ex_bin; kc_rc=$ex_rc; kc_result=$ex_result; kc_log="$WORK/kernel_check.err"

# 6d. Training on the GPU: a small fp32 GPT-2, 20 steps, the CUDA units
# against the same units on the kernels' CPU references (losses within 1e-3
# relative at every step), and twice on the GPU (the same bits).
run_example train_check "${TRAIN_CHECK_BIN:-}"
TC_BIN=$ex_bin; tc_rc=$ex_rc; tc_result=$ex_result; tc_log="$WORK/train_check.err"

# 6e. Throughput in GPU memory (a measurement: never sets `failed`): a
# GPT-2 of ~350M params, seq 1024, bf16 GEMMs, tierzero-gpu's
# examples/throughput against PyTorch eager (scripts/torch_gpt2_throughput.py
# with the machine's PyTorch, autocast bf16, eager attention, fused AdamW),
# the same shape and batch; the issue's goal is a ratio of at least 0.8.
# Each block's forward is kept for its backward, as eager's autograd keeps
# its graph (RECOMPUTE=1 in the environment recomputes it instead).
failed_before_tp=$failed
run_example throughput "${THROUGHPUT_BIN:-}"
tp_rc=$ex_rc; tp_result=$ex_result; tp_log="$WORK/throughput.err"
failed=$failed_before_tp
th_rc=null; th_result=null
if [ -n "$PY" ] && [ "$(left)" -ge 60 ]; then
  timeout "$(cap 240)" "$PY" scripts/torch_gpt2_throughput.py --out "$WORK/torch_throughput.json" \
    >/dev/null 2>"$WORK/torch_throughput.err"
  th_rc=$?
  th_result=$(json_obj "$WORK/torch_throughput.json")
fi
tp_ratio=$(awk -v a="$(grep -o '"tokens_per_s":[0-9.]*' "$WORK/throughput.json" 2>/dev/null | cut -d: -f2)" \
  -v b="$(grep -o '"tokens_per_s": *[0-9.]*' "$WORK/torch_throughput.json" 2>/dev/null | sed 's/.*: *//')" \
  'BEGIN { if (a > 0 && b > 0) printf "%.3f", a / b; else printf "null" }')

# 6h. Throughput with offload (issue 23's third check; a measurement: never
# sets `failed`): a Llama layout that does not fit the device budget it is
# given (~850M params: hidden 2048, 16 layers, 16 heads over 4 kv heads,
# MLP 5632, vocabulary 32000), bf16, micro-batch 2 at seq 1024, stage 3
# with params and optimizer state in host memory (offload to cpu) and
# tierzero.device_budget_bytes 4 GiB, 5 steps (the last 3 timed), against
# FSDP2 with CPUOffloadPolicy on the same config.json, batch and
# precision, with the machine's PyTorch.
OFF_MODEL="$WORK/llama-offload"; mkdir -p "$OFF_MODEL"
cat >"$OFF_MODEL/config.json" <<'JSON'
{"model_type":"llama","vocab_size":32000,"hidden_size":2048,"intermediate_size":5632,"num_hidden_layers":16,
 "num_attention_heads":16,"num_key_value_heads":4,"max_position_embeddings":2048,"rope_theta":10000.0,
 "rms_norm_eps":1e-5,"tie_word_embeddings":false}
JSON
"$PYCFG" - "$WORK/ds-offload-tp.json" <<'PY' 2>"$WORK/ds-offload-tp.err"
import json, sys
c = json.load(open("src/config/default.json"))
c["bf16"] = {"enabled": True}
c["train_micro_batch_size_per_gpu"] = 2
c["gradient_accumulation_steps"] = 1
c.pop("train_batch_size", None)
z = c["zero_optimization"]
z["stage"] = 3
z["offload_param"] = {"device": "cpu", "pin_memory": True}
z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
# Sub-groups of 50M elements; uploads up to two blocks ahead (a block is
# ~45M elements), at most ~1.2 GB of fp32 params live on the device.
z["sub_group_size"] = 5e7
z["stage3_prefetch_bucket_size"] = 1e8
z["stage3_max_live_parameters"] = 3e8
t = c.setdefault("tierzero", {})
t["device_budget_bytes"] = 4 << 30
# The cpu tier pins every param's pages: no cap below what they need.
t.pop("pinned_budget_bytes", None)
json.dump(c, open(sys.argv[1], "w"))
PY
otp_rc=null; otp_result=null; otp_tokens=null; otp_tflops=null
# The CPU Adam over ~850M params on half the cores (what --threads auto
# gives beside a device; said here so that the comparison does not move
# with the default. PyTorch's CPU optimizer uses every core's intra-op
# threads).
adam_threads=$(( $(nproc) > 3 ? $(nproc) / 2 : 1 ))
fsdp_rc=null; fsdp_result=null; otp_ratio=null
d="$WORK/offload-tp"; mkdir -p "$d"
if [ "$(left)" -ge 120 ]; then
  (cd "$d" && LD_LIBRARY_PATH="${nv_libs}${nv_libs:+:}${LD_LIBRARY_PATH:-}" TIERZERO_KERNEL_CACHE="$WORK/kcache" \
    timeout "$(cap 180)" "$BIN" train --device cuda:0 --config "$WORK/ds-offload-tp.json" --model "$OFF_MODEL" \
    --steps 5 --seq-len 1024 --threads "$adam_threads" --metrics metrics.jsonl --timeline timeline.json --timeline-steps 1 \
    --json >out.json 2>err.txt)
  otp_rc=$?
  otp_result=$(json_obj "$d/out.json")
  # Tokens/s over steps 3..5 (the first records the trace, the second
  # is the first of a steady state); model TFLOPS by the count above.
  read -r otp_tokens otp_tflops < <("$PYCFG" - "$d/metrics.jsonl" "$OFF_MODEL/config.json" <<'PY' 2>/dev/null || echo "null null"
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l]
c = json.load(open(sys.argv[2]))
h, i, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
params = 2 * V * h + L * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h
timed = steps[2:5]
if len(timed) < 3:
    print("null null")
else:
    tok = 3 * 2 * 1024 / sum(s["wall_s"] for s in timed)
    print("%.1f %.2f" % (tok, tok * (6 * params + 12 * L * h * 1024) / 1e12))
PY
)
  [ -n "${OUT:-}" ] && [ -f "$d/timeline.json" ] && cp "$d/timeline.json" "$OUT/timeline-offload-llama.json"
fi
PY="${TIERZERO_PY:-$(ls /opt/torch/.venv/bin/python 2>/dev/null || command -v python3)}"
if [ -n "$PY" ] && [ "$(left)" -ge 60 ]; then
  timeout "$(cap 180)" "$PY" scripts/fsdp2_offload_throughput.py --config "$OFF_MODEL/config.json" \
    --micro 2 --seq 1024 --steps 5 --out "$WORK/fsdp2.json" >/dev/null 2>"$WORK/fsdp2.err"
  fsdp_rc=$?
  fsdp_result=$(json_obj "$WORK/fsdp2.json")
fi
otp_ratio=$(awk -v a="$otp_tokens" -v b="$(grep -o '"tokens_per_s": *[0-9.]*' "$WORK/fsdp2.json" 2>/dev/null | sed 's/.*: *//')" \
  'BEGIN { if (a > 0 && b > 0) printf "%.3f", a / b; else printf "null" }')

# A summary line's field.
field() { grep -o "\"$2\":[0-9.eE+-]*" <<<"$1" | head -n 1 | cut -d: -f2; }
# calibrate RUN GROWS FIXED MICRO...: runs `RUN m` (a summary line or
# nothing) for each MICRO in turn. Field GROWS grows with MICRO and field
# FIXED does not: stop once GROWS passes FIXED. Sets `best` (the MICRO
# whose two fields are closest: |log(GROWS / FIXED)| least; empty if no
# run gave a line) and `calib` (each run's line, JSON).
calibrate() {
  local run=$1 grows=$2 fixed=$3 m line a b gap best_gap=""; shift 3
  best=""; calib=""
  for m in "$@"; do
    line=$($run "$m")
    [ -n "$line" ] || break
    calib="$calib${calib:+,}{\"micro\":$m,\"result\":$line}"
    a=$(field "$line" "$grows"); b=$(field "$line" "$fixed")
    gap=$(awk -v a="$a" -v b="$b" 'BEGIN { if (a > 0 && b > 0) { g = log(a / b); print (g < 0 ? -g : g) } }')
    if [ -n "$gap" ] && { [ -z "$best_gap" ] || awk -v g="$gap" -v b="$best_gap" 'BEGIN { exit !(g < b) }'; }; then
      best=$m; best_gap=$gap
    fi
    awk -v a="$a" -v b="$b" 'BEGIN { exit !(a > b) }' && break
  done
}

# 6i. Overlap on the GPU (issue 23's second check; a measurement: never
# sets `failed`). One run: TIER=$1 MICRO=$2 STEPS=$3 ROUNDS=$4, skipped
# when under $5 seconds are left; prints the summary line or nothing.
dov_dir="${OVERLAP_DIR:-$PWD/overlap-check}-device"
dov_log="$WORK/device_overlap.txt"; : >"$dov_log"
dov_calib=""; dov_micro=null; dov_cpu=null; dov_nvme=null
dov_run() {
  [ "$(left)" -ge "$5" ] || { echo "skipped TIER=$1 MICRO=$2 ($(left) s left)" >>"$dov_log"; return; }
  rm -rf "$dov_dir"; mkdir -p "$dov_dir"
  TIER=$1 MICRO=$2 SEQ_LEN=256 DEVICE=cuda:0 ADAM_THREADS=4 TIMELINE="$WORK/timeline-device-overlap-$1.json" \
    LD_LIBRARY_PATH="${nv_libs}${nv_libs:+:}${LD_LIBRARY_PATH:-}" TIERZERO_KERNEL_CACHE="$WORK/kcache" \
    timeout "$(cap 90)" "$DEVICE_OVERLAP_BIN" 6 1024 "$3" "$4" "$dov_dir" 2>>"$dov_log" \
    | tee -a "$dov_log" | grep '"summary"' | tail -n 1
}
dov_calibration_run() { dov_run cpu "$1" 3 1 45; }
if [ -n "${DEVICE_OVERLAP_BIN:-}" ] && [ -x "$DEVICE_OVERLAP_BIN" ]; then
  # Compute grows with MICRO and the params' h2d does not.
  calibrate dov_calibration_run compute_alone_s h2d_alone_s 1 2 4 8 16 32
  dov_calib=$calib
  if [ -n "$best" ]; then
    dov_micro=$best
    dov_cpu=$(dov_run cpu "$best" 5 3 40); [ -n "$dov_cpu" ] || dov_cpu=null
    dov_nvme=$(dov_run nvme "$best" 4 2 60); [ -n "$dov_nvme" ] || dov_nvme=null
  fi
  rm -rf "$dov_dir"
  for t in cpu nvme; do
    [ -n "${OUT:-}" ] && [ -f "$WORK/timeline-device-overlap-$t.json" ] && cp "$WORK/timeline-device-overlap-$t.json" "$OUT/"
  done
else
  echo "no device overlap binary (DEVICE_OVERLAP_BIN)" >"$dov_log"
fi

# 7. Overlap (a measurement: never sets `failed`), in what is left of the
# budget.
ov_dir="${OVERLAP_DIR:-$PWD/overlap-check}"
ov_log="$WORK/overlap.txt"; : >"$ov_log"
ov_calib=""; ov_micro=null; ov_balanced=null; ov_roomy=null; ov_default=null
ov_balanced_unpinned=null; ov_default_unpinned=null
# One run: MICRO=$1 STEPS=$2 ROUNDS=$3 (extra env before the call); prints
# the summary line or nothing; skipped when under $4 seconds are left.
# OV_LAYERS and OV_HIDDEN (default 6 and 256) set the model.
ov_run() {
  [ "$(left)" -ge "$4" ] || { echo "skipped MICRO=$1 ($(left) s left)" >>"$ov_log"; return; }
  MICRO=$1 SEQ_LEN=32 timeout "$(cap 150)" "$OVERLAP_BIN" "${OV_LAYERS:-6}" "${OV_HIDDEN:-256}" "$2" "$3" "$ov_dir" 2>>"$ov_log" \
    | grep '"summary"' | tail -n 1
}
ov_calibration_run() { ov_run "$1" 4 1 40; }
ov_threads=""; ov_threads_big=""; ov_t=null
if [ -n "${OVERLAP_BIN:-}" ] && [ -x "$OVERLAP_BIN" ]; then
  mkdir -p "$ov_dir"
  # Compute threads: "auto" leaves one core to the helpers and gives the
  # rest to candle. On a small model more threads can be slower; scan
  # them (compute alone, MICRO=2) and calibrate with the fastest.
  if [ "$(nproc)" -gt 2 ]; then
    auto=$(( $(nproc) - 1 )); best_c=""
    for t in 1 2 4 8 "$auto"; do
      line=$(COMPUTE_THREADS=$t ov_run 2 4 1 40)
      [ -n "$line" ] || continue
      c=$(field "$line" compute_alone_s)
      ov_threads="$ov_threads${ov_threads:+,}{\"threads\":$t,\"compute_alone_s\":$c,\"io_alone_s\":$(field "$line" io_alone_s)}"
      if [ -z "$best_c" ] || awk -v c="$c" -v b="$best_c" 'BEGIN { exit !(c < b) }'; then best_c=$c; ov_t=$t; fi
    done
    # The same on a model 4x as wide per layer (4 layers, hidden 512, MICRO=8).
    for t in 1 4 "$auto"; do
      line=$(OV_LAYERS=4 OV_HIDDEN=512 COMPUTE_THREADS=$t ov_run 8 4 1 60)
      [ -n "$line" ] || continue
      ov_threads_big="$ov_threads_big${ov_threads_big:+,}{\"threads\":$t,\"compute_alone_s\":$(field "$line" compute_alone_s),\"io_alone_s\":$(field "$line" io_alone_s),\"step_s\":$(field "$line" step_s)}"
    done
    [ "$ov_t" = null ] || export COMPUTE_THREADS=$ov_t
  fi
  # Compute grows with MICRO and I/O does not.
  calibrate ov_calibration_run compute_alone_s io_alone_s 2 4 8 16 32 64 128
  ov_calib=$calib
  if [ -n "$best" ]; then
    ov_micro=$best
    ov_balanced=$(ov_run "$best" 6 6 30); [ -n "$ov_balanced" ] || ov_balanced=null
    ov_balanced_unpinned=$(PIN=off ov_run "$best" 6 6 30); [ -n "$ov_balanced_unpinned" ] || ov_balanced_unpinned=null
    ov_roomy=$(LIVE_H2=72 REUSE_H2=24 ov_run "$best" 6 6 30); [ -n "$ov_roomy" ] || ov_roomy=null
  fi
  # MICRO=2 with the threads "auto" gives, as a user would run it.
  unset COMPUTE_THREADS
  ov_default=$(ov_run 2 6 4 20)
  [ -n "$ov_default" ] || ov_default=null
  ov_default_unpinned=$(PIN=off ov_run 2 6 4 20)
  [ -n "$ov_default_unpinned" ] || ov_default_unpinned=null
  rm -rf "$ov_dir"
else
  echo "no overlap binary (OVERLAP_BIN)" >"$ov_log"
fi

{
  printf '{"ok":%s,' "$([ "$failed" -eq 0 ] && echo true || echo false)"
  printf '"build_s":%s,"nvidia_smi":%s,' "$build_s" "$(json_str "$smi")"
  printf '"elapsed_s":%s,"budget_s":%s,"machine":%s,' "$SECONDS" "$BUDGET_S" "$(json_str "$WORK/machine.txt")"
  printf '"probe_as_installed":{"rc":%s,"result":%s,"stderr":%s},"nccl_linked_from":%s,' \
    "$probe_plain_rc" "$(json_obj "$probe_plain")" "$(json_str "$WORK/probe_plain.err")" "$nccl_link"
  printf '"probe":{"rc":%s,"result":%s,"stderr":%s},' "$probe_rc" "$(json_obj "$probe_out")" "$(json_str "$probe_err")"
  printf '"nccl_one_rank":{"rc":%s,"result":%s,"stderr":%s},' "$one_rc" "$(json_obj "$one_out")" "$(json_str "$one_err")"
  printf '"nccl_two_ranks":{"gpus":%s,"expected":"%s","rank0":{"rc":%s,"result":%s,"stderr":%s},"rank1":{"rc":%s,"result":%s,"stderr":%s}},' \
    "$ngpu" "$two_expect" "$two_rc0" "$(json_obj "$WORK/two0.json")" "$(json_str "$WORK/two0.err")" \
    "$two_rc1" "$(json_obj "$WORK/two1.json")" "$(json_str "$WORK/two1.err")"
  printf '"train":{"ok":%s,"cuda_libs":"%s","gpt2":%s,"llama":%s,"runs":{' "$train_same" "$nv_libs" \
    "$(json_obj "$WORK/train-gpt2.summary.json")" "$(json_obj "$WORK/train-llama.summary.json")"
  sep=""
  for model in gpt2 llama; do for run in cpu cuda cuda2; do
    d="$WORK/train-$model-$run"
    printf '%s"%s_%s":{"rc":%s,"secs":%s,"result":%s,"stderr":%s}' "$sep" "$model" "$run" \
      "$(cat "$d/rc" 2>/dev/null || echo null)" "$(cat "$d/secs" 2>/dev/null || echo null)" "$(json_obj "$d/out.json")" "$(json_str "$d/err.txt")"
    sep=","
  done; done
  printf '}},'
  printf '"device_tier":{"ok":%s,"runs":{' "$tier_same"
  sep=""
  for model in gpt2 llama; do for variant in stage0 cpu cache; do
    d="$WORK/tier-$model-$variant"
    printf '%s"%s_%s":{"rc":%s,"secs":%s,"summary":%s,"result":%s,"stderr":%s}' "$sep" "$model" "$variant" \
      "$(cat "$d/rc" 2>/dev/null || echo null)" "$(cat "$d/secs" 2>/dev/null || echo null)" "$(json_obj "$d/summary.json")" \
      "$(json_obj "$d/out.json")" "$(json_str "$d/err.txt")"
    sep=","
  done; done
  printf '}},'
  printf '"bf16":{"ok":%s,"max_rel_loss_diff_cpu_vs_cuda":%s,"cuda":{"rc":%s,"secs":%s,"result":%s,"stderr":%s},"cpu":{"rc":%s,"result":%s}},' \
    "$bf16_ok" "$bf16_worst" "$(cat "$WORK/bf16-cuda/rc" 2>/dev/null || echo null)" "$(cat "$WORK/bf16-cuda/secs" 2>/dev/null || echo null)" \
    "$(json_obj "$WORK/bf16-cuda/out.json")" "$(json_str "$WORK/bf16-cuda/err.txt")" \
    "$(cat "$WORK/bf16-cpu/rc" 2>/dev/null || echo null)" "$(json_obj "$WORK/bf16-cpu/out.json")"
  printf '"kernels":{"bin":"%s","cuda_libs":"%s","rc":%s,"result":%s,"log":%s},' \
    "$KC_BIN" "$nv_libs" "$kc_rc" "$kc_result" "$(json_str "$kc_log")"
  printf '"throughput":{"tierzero":{"rc":%s,"result":%s,"log":%s},"torch_eager":{"rc":%s,"result":%s,"log":%s},"ratio":%s},' \
    "$tp_rc" "$tp_result" "$(json_str "$tp_log")" "$th_rc" "$th_result" "$(json_str "$WORK/torch_throughput.err")" "$tp_ratio"
  printf '"offload_throughput":{"tierzero":{"rc":%s,"tokens_per_s":%s,"model_tflops":%s,"result":%s,"stderr":%s},"fsdp2_cpu_offload":{"rc":%s,"result":%s,"log":%s},"ratio":%s},' \
    "$otp_rc" "$otp_tokens" "$otp_tflops" "$otp_result" "$(json_str "$WORK/offload-tp/err.txt")" \
    "$fsdp_rc" "$fsdp_result" "$(json_str "$WORK/fsdp2.err")" "$otp_ratio"
  printf '"device_overlap":{"calibration":[%s],"micro":%s,"cpu_tier":%s,"nvme_tier":%s,"log":%s},' \
    "$dov_calib" "$dov_micro" "$dov_cpu" "$dov_nvme" "$(json_str "$dov_log")"
  printf '"gpu_train":{"bin":"%s","rc":%s,"result":%s,"log":%s},' \
    "$TC_BIN" "$tc_rc" "$tc_result" "$(json_str "$tc_log")"
  printf '"python_cuda":{"wheel":"%s","python":"%s","rc":%s,"result":%s,"log":%s},' \
    "$WHEEL" "$PY" "$py_rc" "$py_result" "$(json_str "$py_log")"
  printf '"overlap":{"cores":%s,"threads_scan_micro2":[%s],"threads_scan_h512_micro8":[%s],"compute_threads":%s,"calibration":[%s],"balanced_micro":%s,"balanced":%s,"balanced_unpinned":%s,"balanced_live72_reuse24":%s,"micro_2":%s,"micro_2_unpinned":%s,"log":%s}}\n' \
    "$(nproc)" "$ov_threads" "$ov_threads_big" "$ov_t" "$ov_calib" "$ov_micro" "$ov_balanced" "$ov_balanced_unpinned" "$ov_roomy" "$ov_default" "$ov_default_unpinned" "$(json_str "$ov_log")"
} >"$WORK/result.json"
[ -n "${OUT:-}" ] && cp "$WORK/result.json" "$OUT/gpu_check.json"
cat "$WORK/result.json"
exit "$failed"
