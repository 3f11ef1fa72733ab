#!/usr/bin/env bash
# What OpenMPI's mpirun does with a signal sent to it, measured with a
# rank that traps the signals and takes 2 s to "save" (the reason
# `tierzero launch` passes a stop on as SIGUSR1/SIGUSR2; see
# src/cli/signals.rs, "Under mpirun"). Prints, per case, what the ranks
# saw and mpirun's exit code.
#   1. SIGINT to mpirun: OpenMPI sends the ranks SIGTERM and, after
#      odls_base_sigkill_timeout (1 s by default), SIGKILL.
#   2. The same with --mca odls_base_sigkill_timeout 10: the ranks' SIGTERM
#      comes that much later (the timeout delays the stop; it is no fix).
#   3. SIGUSR1 to mpirun: forwarded to every rank untouched.
# Times are seconds since the signal was sent.
# Usage: scripts/mpirun_signals.sh   (needs mpirun; about 10 s)
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
rank=$(mktemp)
trap 'rm -f "$rank"' EXIT
cat > "$rank" <<'RANK'
#!/usr/bin/env bash
for s in TERM USR1; do
  trap "echo \"rank \$OMPI_COMM_WORLD_RANK got $s at \$(date +%s.%N)\"; sleep 2; echo \"rank \$OMPI_COMM_WORLD_RANK saved\"; exit 130" $s
done
sleep 30 & wait
RANK
chmod +x "$rank"
run() {
  local sig=$1
  shift
  echo "== SIG$sig to mpirun -np 2 $*"
  mpirun -np 2 --oversubscribe "$@" "$rank" 2>/dev/null > "$rank.out" &
  local mp=$!
  sleep 2
  local sent
  sent=$(date +%s.%N)
  kill -"$sig" "$mp"
  wait "$mp"
  local rc=$?
  awk -v t0="$sent" '/ got / {printf "%s %s %s: %.1f s after the signal\n", $1, $2, $4, $6 - t0; next} {print}' "$rank.out"
  echo "mpirun exit code $rc"
}
run INT
run INT --mca odls_base_sigkill_timeout 10
run USR1
rm -f "$rank.out"
