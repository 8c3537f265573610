#!/usr/bin/env bash
# One device call for the MLA decode candidates (bench/candidates/README.md): each candidate's correctness check
# in a process of its own with CUDA_LAUNCH_BLOCKING=1 (a fault names its launch and cannot take the others down),
# then the timings and the sweep of those that passed, beside the shipped kernel.
#
#   run(command="bash bench/candidates/device_mla.sh v3 300")
#
# $1 candidates (stems after paged_decode_), $2 seconds for the timing step; MLA_CFGS (a JSON list of launch
# parameters) checks and times each candidate with those variants besides its defaults. Writes
# $OUT/check_<c>.json/.err, $OUT/mla.json, $OUT/mla.err. Carry .whl/train (pydantic and the rest) where the
# device lacks the package's dependencies.
set -uo pipefail
cands=${1:-v3}
budget=${2:-300}
source bench/candidates/device_env.sh
cfgs=()
if [ -n "${MLA_CFGS:-}" ]; then cfgs=(--mla-cfgs "$MLA_CFGS"); fi
passed=()
for c in ${cands//,/ }; do
  f=bench/candidates/paged_decode_$c.py
  CUDA_LAUNCH_BLOCKING=1 timeout 200 python3 bench/kernels.py --only checkmla --warm-procs 8 --mla-cand "$f" \
      "${cfgs[@]}" --out "$OUT/check_$c.json" > /dev/null 2> "$OUT/check_$c.err"
  ok=$(python3 - "$OUT/check_$c.json" "paged_decode_$c" <<'EOF'
import json, sys
try:
    res = json.load(open(sys.argv[1]))["check_mla"]
    rows = [v for k, v in res.items() if k.startswith(sys.argv[2] + " ")]
    good = rows and all(r["all_ran"] and r["max"] is not None and r["max"] < 2e-2 for r in rows)
    print("yes" if good else "no")
except Exception as e:
    print("no")
EOF
)
  echo "check $c: $ok" | tee -a "$OUT/summary.txt"
  if [ "$ok" = yes ]; then passed+=("$f"); fi
done
list=$(IFS=,; echo "${passed[*]:-}")
timeout "$budget" python3 bench/kernels.py --only mla,mlasweep --warm-procs 12 --deadline $((budget - 40)) \
    ${list:+--mla-cand "$list"} "${cfgs[@]}" --out "$OUT/mla.json" > /dev/null 2> "$OUT/mla.err"
echo "timings rc $?" | tee -a "$OUT/summary.txt"
