#!/usr/bin/env bash
# The host side of an offloaded bf16 step, without a GPU: two tierzero
# binaries, alternating, on the simulated device (--device sim) with the
# shape of scripts/gpu_check.sh's step 6h (a Llama of hidden 2048, 16 heads
# over 4 KV heads, intermediate 5632, vocab 32000; stage 3, params and
# optimizer in pinned host memory, bf16, sub-groups of 50M elements,
# clipping 1.0), 4 layers instead of 16 (311M params: 311445504 in the plan line), micro 1 and seq 2
# so that the simulator's reference GEMMs stay short.
#
#   scripts/sim_offload_ab.sh OLD_BIN NEW_BIN [ROUNDS]   (default 2 rounds)
#   SUB_GROUP_SIZE=1e9 scripts/sim_offload_ab.sh ...       (DeepSpeed's default:
#                                                          one sub-group)
#   STEPS=4 scripts/sim_offload_ab.sh ...                  (steps a run, default 2)
#   RANKS=2 scripts/sim_offload_ab.sh ...                  (ranks through `tierzero
#                                                          launch`, each its own
#                                                          simulated device whose
#                                                          collectives reduce-scatter
#                                                          the gradients; needs
#                                                          binaries built with
#                                                          --features mpi; rank 0's
#                                                          figures)
#
# An arm is a command, split at spaces, so it may set the environment:
#   scripts/sim_offload_ab.sh "env GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824:glibc.malloc.arena_max=1 target/release/tierzero" target/release/tierzero
# (tierzero's heap settings but the old 1 GiB trim threshold, against
# them as they are: docs/decisions/host-heap.md's table).
#
# The binaries take turns going first (old first in odd rounds).
#
# Per run, one line: the binary, start-up seconds (--json's
# startup.startup_s; for a binary without it, total_s - train_s, which
# holds the finish too), the seconds after the last step (finish_s), the
# second step's wall seconds and its tail (from the end of the
# last unit's backward on the compute lane to the step's end, from
# --timeline), the spans of the gradients' adds into the sums (`grads uN`
# on the compute lane), of the optimizer and of the store (each
# sub-group's step on the optimizer thread, and its new values stored):
# their sum, count and median; train_s, the peak RSS and each step's
# minor page faults (--metrics); and weight_sha256 (the two binaries must
# agree). The step
# is mostly the simulator's reference GEMMs; the tail and the start-up
# are host work: the gradients' adds and the seeded init.
set -euo pipefail
old=${1:?usage: $0 OLD_BIN NEW_BIN [ROUNDS]}
new=${2:?usage: $0 OLD_BIN NEW_BIN [ROUNDS]}
rounds=${3:-2}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 scripts/offload_llama_6h.py "$work/llama" "$work/ds.json" 1 4
# SUB_GROUP_SIZE=N: sub-groups of N elements instead of the script's.
if [ -n "${SUB_GROUP_SIZE:-}" ]; then
  python3 - "$work/ds.json" "$SUB_GROUP_SIZE" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["zero_optimization"]["sub_group_size"] = int(float(sys.argv[2]))
json.dump(c, open(sys.argv[1], "w"))
PY
fi
# ABBA: the first run of a round is slower whichever binary it is (the
# same binary twice gave tails of 1017 and 134 ms), so the order turns.
launch=()
if [ "${RANKS:-1}" -gt 1 ]; then launch=(launch --nproc "$RANKS" --); fi
for r in $(seq 1 "$rounds"); do
  order=("$old" "$new")
  if [ $((r % 2)) = 0 ]; then order=("$new" "$old"); fi
  for b in "${order[@]}"; do
    read -ra cmd <<<"$b"
    (cd "$work" && "${cmd[@]}" ${launch[@]+"${launch[@]}"} train --model llama --config ds.json --device sim --seq-len 2 \
      --steps "${STEPS:-2}" --threads 2 --json --metrics m.jsonl --timeline tl.json --timeline-steps 1 \
      >out.json 2>err.txt) \
      || { echo "$b failed:"; tail -5 "$work/err.txt"; exit 1; }
    python3 - "$b" "$r" "$work/out.json" "$work/tl.json" "$work/m.jsonl" <<'PY'
import json, sys
b, r, out, tl, metrics = sys.argv[1:]
o = json.load(open(out))
steps = [json.loads(l) for l in open(metrics) if '"step"' in l]
t = json.load(open(tl))
lanes = {e["tid"]: e["args"]["name"] for e in t["traceEvents"] if e.get("ph") == "M"}
spans = [e for e in t["traceEvents"] if e.get("ph") == "X"]
step = next(e for e in spans if e["name"].startswith("step"))
end = step["ts"] + step["dur"]
last_bwd = max(e["ts"] + e["dur"] for e in spans
               if lanes[e["tid"]] == "compute" and e["name"].startswith("bwd u") and e["ts"] < end)
def lane_ms(name, prefix=""):
    d = sorted(e["dur"] / 1e3 for e in spans if lanes[e["tid"]] == name and e["name"].startswith(prefix))
    return f"{sum(d):.0f} ms in {len(d)} (median {d[len(d) // 2]:.1f})" if d else "none"
# With RANKS > 1: the host's part of the gradients' spans, each `grads uN`
# less the time from its unit's collective's start to the end of its
# download (the device's reduce-scatter, which waits for the other ranks).
def unit_spans(lane, prefix):
    return {int(e["name"].split()[1].lstrip("u")): e for e in spans
            if lanes[e["tid"]] == lane and e["name"].startswith(prefix)}
grads, coll, down = (unit_spans("compute", "grads u"), unit_spans("device: collective", "unit "),
                     unit_spans("device: d2h", "unit "))
host = [(coll[u]["ts"] - g["ts"]) + (g["ts"] + g["dur"] - down[u]["ts"] - down[u]["dur"])
        for u, g in grads.items() if u in coll and u in down]
grads_host = f", grads' host part {sum(host) / 1e3:.1f} ms in {len(host)}" if host else ""
startup = o.get('startup', {}).get('startup_s', o['total_s'] - o['train_s'])
print(f"round {r} {b}: start-up {startup:.1f} s, finish {o.get('finish_s', float('nan')):.1f} s, step {step['dur'] / 1e6:.2f} s, "
      f"tail {(end - last_bwd) / 1e3:.0f} ms, grads {lane_ms('compute', 'grads')}{grads_host}, optimizer {lane_ms('optimizer')}, "
      f"store {lane_ms('store')}, train_s {o['train_s']:.1f}, peak RSS {o['peak_rss_bytes'] / 1e9:.2f} GB, "
      f"minor faults {'/'.join(str(s['minor_faults']) for s in steps)}, "
      f"weight_sha256 {o['weight_sha256'][:16]}")
PY
  done
done
