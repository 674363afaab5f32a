# Sourced by the device-call scripts (gpu_engine.sh, gpu_demo.sh): a step under its own time
# limit, and packing the results after each. Set before sourcing: RES (results and logs),
# OUT (what comes back from the device), ARCHIVE (the .tgz name under $OUT) and STEP_LINES
# (an extended regex of the log lines worth printing).

pack() { tar czf "$OUT/$ARCHIVE" -C "$RES" . ; }

step() {  # step NAME LIMIT_S COMMAND...: runs it, logs to $RES/NAME.log, prints its tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $* (limit ${limit} s)"
  timeout --signal=INT --kill-after=10 "$limit" "$@" >"$RES/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc $rc after $((SECONDS - t0)) s"
  grep -E "$STEP_LINES" "$RES/$name.log" | grep -v '^|---' | cut -c1-400 | tail -n 24
  pack
  return $rc
}
