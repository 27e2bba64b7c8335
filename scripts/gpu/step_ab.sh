# Sourced by the device calls' scripts (results/issue20/s*/run*.sh; issue 20): `step NAME TIMEOUT ARGS...` runs the
# decode step (TP=4, ctx 8k) with ARGS under TIMEOUT seconds, its rows straight to $OUT/NAME/decode_step.csv (kept
# when the timeout cuts it), its console to $OUT/NAME.log, and prints the rc, the seconds since T0 and the p50 lines
# (each --ab setting cut to 60 characters). Needs OUT, T0 and the repository root as the working directory.
step() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m ds4lab.harness.step --tp 4 --ctx 8192 --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? ($((SECONDS - T0)) s)"; grep -E "^TP=" "$OUT/$name.log" | sed -E 's/\[(.{60}).*\]/[\1...]/'
}
