# Sourced by the one-call GPU benchmark scripts (after setting START and DEADLINE): `step`, which runs one command
# with its log in $OUT and a time limit that never passes the call's deadline.
# step NAME LIMIT TAIL CMD...: CMD with its output in $OUT/NAME.log, at most LIMIT seconds and never past the deadline;
# prints the log's last TAIL lines (progress-bar lines dropped) and how the step ended
step() {
  local name=$1 limit=$2 tail_n=$3 rc t left
  shift 3
  left=$((DEADLINE - (SECONDS - START)))
  if ((left < 15)); then echo "=== $name: SKIPPED, ${left} s left before the ${DEADLINE}-s deadline"; return 1; fi
  ((limit > left)) && limit=$left
  echo "=== $name ($((SECONDS - START)) s in, limit $limit s)"
  t=$SECONDS
  # SIGABRT at the limit: Python (PYTHONFAULTHANDLER, gpu_env.sh) prints every thread's stack into the log first
  timeout -s ABRT -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  grep -av 'it/s]\|tok/s]\|tensor/s]' "$OUT/$name.log" | tail -n "$tail_n"
  case $rc in
    0) ;;
    124 | 137) echo "--- $name: TIMED OUT after $limit s" ;;
    *) echo "--- $name: FAILED (exit $rc; $OUT/$name.log)" ;;
  esac
  echo "--- $name: $((SECONDS - t)) s"
  return $rc
}

