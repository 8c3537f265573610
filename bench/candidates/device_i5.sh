#!/usr/bin/env bash
# One device call for issue 5 (kernels), each step under its own time limit so a fault or a slow step cannot take
# the others down:
#
#   run(command="bash bench/candidates/device_i5.sh", carry=[".whl/train"])
#
# 1. the engine's CUDA-graph decode against eager on the GPU (tests/model/test_cuda_graph_decode.py -k cuda), which
#    goes through the MLA "tokens" form (every batch since run O), and the Gluon MLA split kernel's gpu tests;
# 2. MLA decode: both forms checked against the twin (N 1 and 32, P 16 and 64) and timed (1 x 32K / 128K / 1M,
#    32 x 32K), `bench/kernels.py --only checkmla,mla`;
# 3. chunk_kda: the shipped kernel checked and timed with a few launch variants (CHUNK_OLD / CHUNK_TUNE: other
#    chunk.py files and variants; fla is not timed: its autotuning takes minutes, see docs/benchmarks.md run C).
#    The default variants: the diagonal kernel's earlier launch (2 heads per program, 1 warp, chunks fastest), and
#    the bounded fused gate on the midpoint diagonal kernel (``diag_mid`` 1; its "bounded gate fused" line).
# I5_TESTS=0 skips step 1, I5_MLA=0 step 2; CHUNK_ONLY=check skips the chunk timings; MLA_EXTRA (JSON list) adds MLA launch parameters.
# CHUNK_FLA=1 times fla-core 0.6.0 in the same run (and profiles it beside ours at 32K): it autotunes in a process
# of its own while our kernels compile and are checked (about 2 minutes), so step 3 gets 400 s instead of 250.
# Results: $OUT/mla.json, $OUT/chunk.json and the logs beside them.
set -uo pipefail
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/train/*.whl \
    && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
# the package itself (kda_sessions.kernels and .storage are mapped folders): the tests import it installed
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1 || echo "editable install failed"
if [ "${I5_TESTS:-1}" = 1 ]; then
echo "== graph decode vs eager"
timeout 160 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model/test_cuda_graph_decode.py \
    tests/kernels/test_kda_triton.py tests/kernels/test_mla_gluon.py 2>&1 | tail -15
fi
if [ "${I5_MLA:-1}" = 1 ]; then
echo "== mla"
timeout 220 python3 bench/kernels.py --only checkmla,mla --warm-procs 12 --out "$OUT/mla.json" > /dev/null 2> "$OUT/mla.err"
grep -E "^(mla |check_mla)" "$OUT/mla.err" || tail -20 "$OUT/mla.err"
fi
echo "== chunk"
tune=${CHUNK_TUNE:-'{"chunk":[{"tok_bh":2,"tok_warps":1,"tok_order":0},{"diag_mid":1}]}'}
if [ "${CHUNK_FLA:-0}" = 1 ]; then fla=(--fla-bg --fla-wait 170); limit=400; else fla=(--no-fla); limit=250; fi
timeout $limit python3 bench/kernels.py --only ${CHUNK_ONLY:-check,chunk} "${fla[@]}" --warm-procs 12 --deadline $((limit - 20)) \
    --old ${CHUNK_OLD:-kernels/kda/chunk.py} --old-tune "$tune" \
    --out "$OUT/chunk.json" > /dev/null 2> "$OUT/chunk.err"
grep -E "^(chunk|check)" "$OUT/chunk.err" || tail -30 "$OUT/chunk.err"
