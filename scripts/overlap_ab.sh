#!/usr/bin/env bash
# Side-by-side overlap measurement of several builds of examples/overlap:
# invocations alternate build by build, in an order that reverses every
# other pass (so the VM's drift and the position hit them alike),
# each doing 3 rounds of 12 steps, then one line per build with the medians
# over all its rounds.
#
#   scripts/overlap_ab.sh N OUT BIN [BIN...]
#
# N: invocations per build; OUT: the round lines (JSON, prefixed by the
# binary's name); BIN: overlap binaries (e.g. a copy of
# target/release/examples/overlap per commit; a wrapper script that sets an
# env knob such as OPT_BUFFERS and execs a binary works too). MICRO
# (default 2), SEQ_LEN (32), CLIP (0) and MODE pass through; LAYERS (6),
# HIDDEN (256), STEPS (12) and ROUNDS (3) are the harness's arguments;
# DIR (default overlap-ab) holds the model and swap files.
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
n=$1; out=$2; shift 2
dir=${DIR:-overlap-ab}
: > "$out"
bins=("$@")
for i in $(seq "$n"); do
  # The order reverses every other invocation (ABBA...), so a position
  # effect cannot favour one build. (An A/A run, one binary under two
  # names, showed none beyond the noise: per-pass ratios 0.92-1.14,
  # median 0.994. The noise is why N should be 4 or more.)
  order=("${bins[@]}")
  if [ $((i % 2)) -eq 0 ]; then
    order=()
    for ((k = ${#bins[@]} - 1; k >= 0; k--)); do order+=("${bins[k]}"); done
  fi
  for b in "${order[@]}"; do
    MICRO=${MICRO:-2} SEQ_LEN=${SEQ_LEN:-32} CLIP=${CLIP:-0} "$b" "${LAYERS:-6}" "${HIDDEN:-256}" "${STEPS:-12}" "${ROUNDS:-3}" "$dir" 2>/dev/null \
      | grep '"round"' | sed "s|^|$(basename "$b") |" >> "$out"
  done
done
python3 - "$out" <<'PY'
import collections, json, statistics as st, sys
rounds = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, obj = line.split(" ", 1)
    rounds[name].append(json.loads(obj))
for name, rs in rounds.items():
    med = lambda k: st.median(r[k] for r in rs)
    ok = sum(r["ratio"] <= 1.15 for r in rs)
    print(f"{name}: {len(rs)} rounds; step {med('step_s'):.4f} s, compute alone "
          f"{med('compute_alone_s'):.4f}, I/O alone {med('io_alone_s'):.4f}, ratio "
          f"{med('ratio'):.3f} ({ok} rounds <= 1.15), overlap_efficiency "
          f"{med('overlap_efficiency'):.3f}, step / disk busy "
          f"{st.median(r['step_s'] / r['step_io_busy_s'] for r in rs):.3f}")
PY
