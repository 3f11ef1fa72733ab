#!/usr/bin/env bash
# Compare `tierzero bench-io` with fio on the same file, same settings.
#
#   scripts/compare_fio.sh DIR [SIZE] [ROUNDS] [BLOCK] [QD]
#
# fio: ioengine=io_uring, direct=1, one job, sequential read, then write.
# tierzero: bench-io --file on the very same file, same block size and queue
# depth, same number of bytes (the whole file once). The two tools alternate
# ROUNDS times (default 3); the medians and their ratio are printed. The file
# DIR/tierzero-fio-compare.dat is created by fio and removed at the end.
#
# Buffers: fio's are malloc'd 4 KiB pages, so a large request may be split
# at the device's segment limit (virtio-blk: 254 segments; a 1 MiB request
# went to the disk as two of ~512 KiB, and tierzero measured 2.3x fio on a
# VM disk), where tierzero's arena is contiguous. FIO_IOMEM=mmaphuge (with
# huge pages reserved: sysctl vm.nr_hugepages) gives fio like buffers.
set -euo pipefail
dir=${1:?usage: scripts/compare_fio.sh DIR [SIZE] [ROUNDS] [BLOCK] [QD]}
size=${2:-4G}
rounds=${3:-3}
bs=${4:-1M}
qd=${5:-32}
command -v fio >/dev/null || { echo "fio is not installed (apt-get install fio)" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${TIERZERO_BIN:-}
if [ -z "$bin" ]; then
  (cd "$root" && cargo build --release --quiet)
  bin="${CARGO_TARGET_DIR:-$root/target}/release/tierzero"
fi
file="$dir/tierzero-fio-compare.dat"
trap 'rm -f "$file"' EXIT
fio_run() { # op -> bytes/s
  fio --name=cmp --filename="$file" --size="$size" --rw="$1" --bs="$bs" --iodepth="$qd" \
      --direct=1 --ioengine=io_uring --numjobs=1 ${FIO_IOMEM:+--iomem="$FIO_IOMEM"} \
      --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; op=sys.argv[1]; print(j[op]["bw_bytes"]/1e9)' "$1"
}
tz_run() { # op -> GB/s
  "$bin" bench-io --file "$file" --no-fill --rw "$1" --block-size "$bs" --queue-depth "$qd" --seconds 1000 --json |
    python3 -c 'import json,sys; j=json.load(sys.stdin); print(j[sys.argv[1]+"_gbps"])' "$1"
}
echo "laying out $size at $file with fio..." >&2
fio --name=layout --filename="$file" --size="$size" --rw=write --bs=1M --iodepth=32 --direct=1 \
    --ioengine=io_uring --output-format=json >/dev/null 2>&1
declare -a fr fw tr tw
for i in $(seq 1 "$rounds"); do
  fr+=("$(fio_run read)");  tr+=("$(tz_run read)")
  fw+=("$(fio_run write)"); tw+=("$(tz_run write)")
  echo "round $i: read fio ${fr[-1]} tierzero ${tr[-1]} | write fio ${fw[-1]} tierzero ${tw[-1]} (GB/s)" >&2
done
python3 - "$bs" "$qd" "$size" "${fr[*]}" "${tr[*]}" "${fw[*]}" "${tw[*]}" <<'PY'
import statistics as st, sys
bs, qd, size = sys.argv[1:4]
fr, tr, fw, tw = ([float(x) for x in a.split()] for a in sys.argv[4:8])
mr, mtr, mw, mtw = map(st.median, (fr, tr, fw, tw))
print(f"block {bs}, queue depth {qd}, {size} file, {len(fr)} alternating rounds (medians, GB/s)")
print(f"{'':6} {'fio':>8} {'tierzero':>9} {'ratio':>7}")
print(f"{'read':6} {mr:8.3f} {mtr:9.3f} {mtr/mr:7.3f}")
print(f"{'write':6} {mw:8.3f} {mtw:9.3f} {mtw/mw:7.3f}")
PY
