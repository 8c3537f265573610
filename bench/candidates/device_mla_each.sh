#!/usr/bin/env bash
# One device call for an MLA decode candidate's launch variants, each checked in a process of its own first
# (CUDA_LAUNCH_BLOCKING=1, bench/candidates/mla_one.py: P 64 over lengths 33000,1000,5,1 and P 16 over 1000,37),
# so a variant that faults is named and dropped instead of taking the run down; then the variants that passed
# are timed beside the shipped kernel (bench/kernels.py --only mla).
#
#   MLA_CFGS='[{"BN": 64, "num_stages": 2}, {...}]' bash bench/candidates/device_mla_each.sh v7 300
#
# $1 the candidate (stem after paged_decode_), $2 seconds for the timings. Writes $OUT/each.jsonl (one check per
# line), $OUT/mla.json, $OUT/mla.err, $OUT/summary.txt. Carry .whl/train where the device lacks the dependencies.
set -uo pipefail
cand=bench/candidates/paged_decode_${1:-v7}.py
budget=${2:-300}
source bench/candidates/device_env.sh
python3 -c 'import json, os; [print(json.dumps(c)) for c in json.loads(os.environ.get("MLA_CFGS", "[{}]"))]' \
    > /tmp/cfgs.txt
i=0
while read -r cfg; do
  i=$((i + 1))
  ( CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 bench/candidates/mla_one.py "$cand" "$cfg" 64 33000,1000,5,1 \
        > "/tmp/each_$i.a" 2>&1
    CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 bench/candidates/mla_one.py "$cand" "$cfg" 16 1000,37 \
        > "/tmp/each_$i.b" 2>&1 ) &
done < /tmp/cfgs.txt
wait
good=$(python3 - "$i" <<'PY'
import json, sys
good = []
for i in range(1, int(sys.argv[1]) + 1):
    rows = []
    for part in "ab":
        lines = [ln for ln in open(f"/tmp/each_{i}.{part}").read().splitlines() if ln.startswith("{")]
        rows.append(json.loads(lines[-1]) if lines else {"error": "no result (crash or timeout)"})
    with open(__import__("os").environ["OUT"] + "/each.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if all("rel" in r and r["rel"] < 2e-2 for r in rows):
        good.append(rows[0]["cfg"])
print(json.dumps(good))
PY
)
echo "passed: $good" | tee -a "$OUT/summary.txt"
MLA_CAND_CFGS="$good" timeout "$budget" python3 bench/kernels.py --only mla --warm-procs 12 --deadline $((budget - 40)) \
    --mla-cand "$cand" --mla-cfgs "$good" --out "$OUT/mla.json" > /dev/null 2> "$OUT/mla.err"
echo "timings rc $?" | tee -a "$OUT/summary.txt"
