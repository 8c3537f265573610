#!/usr/bin/env bash
# Which launch forms of the v3 MLA candidate run clean on the device, each in a process of its own (a fault
# cannot take the others down), then the timings of those that did beside the shipped kernel.
#   run(command="bash bench/candidates/device_v3_cfgs.sh 150")
set -uo pipefail
budget=${1:-150}
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
f=bench/candidates/paged_decode_v3.py
good=()
for cfg in '{"tma": true, "num_stages": 1}' '{"tma": true, "num_warps": 4, "num_stages": 2}' \
           '{"tma": true, "BN": 32, "num_stages": 2}' '{"tma": true, "BN": 32, "num_stages": 1}' \
           '{"tma": true, "num_stages": 2}' '{"tma": false, "trans": true}' '{"tma": false, "trans": true, "part_bf16": true}'; do
  ok=yes
  for lens in 1000,37 1,1000,5000,33000; do
    line=$(CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 bench/candidates/mla_one.py $f "$cfg" 64 $lens 2>/dev/null | tail -1)
    echo "$cfg $lens: $line" | cut -c1-200 | tee -a "$OUT/summary.txt"
    python3 -c "import json,sys; r=json.loads(sys.argv[1]); sys.exit(0 if r.get('rel', 1) < 2e-2 else 1)" "$line" || ok=no
  done
  if [ $ok = yes ]; then good+=("$cfg"); fi
done
list="[$(IFS=,; echo "${good[*]:-}")]"
echo "passed: $list" | tee -a "$OUT/summary.txt"
[ "$list" = "[]" ] && exit 0
timeout "$budget" python3 bench/kernels.py --only mla --warm-procs 12 --mla-cand $f --mla-cfgs "$list" \
    --out "$OUT/mla.json" > /dev/null 2> "$OUT/mla.err"
grep "^mla " "$OUT/mla.err"
