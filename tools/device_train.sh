#!/usr/bin/env bash
# One training call on the GPU machine (the device tool), as learned on 2026-11-30 (docs/tiny.md):
#
#   run(command="bash tools/device_train.sh 8.5 2000", carry=[".whl/train", ".out/tcache", ".out/init"])
#
# $1 minutes of training (leave ~1 min of the 10-minute call for start-up, the held-out pass and saving),
# $2 scheduled steps, $3 extra train_tiny.py arguments. Reads, when carried: .out/tcache/tcache.tar.xz (a Triton
# cache from an earlier call: without it fla's kernels compile and autotune for ~400 s on the first step) and
# .out/init (weights to continue from). Writes to $OUT: run/{train_log.json,heldout_rows.json,weights/*}
# and tcache.tar.xz (8 files at most come back: keep it that way).
#
# .whl/train holds the cp312 wheels the machine lacks: pydantic, pydantic-core, annotated-types,
# typing-inspection, typing-extensions, jinja2, markupsafe, safetensors, fla-core==0.6.0, einops
# (download commands: /work/.library/device/README.md).
set -uo pipefail
minutes=${1:-8.5}
steps=${2:-2000}
extra=${3:-}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/train/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc
if [ -f .out/tcache/tcache.tar.xz ]; then tar xJf .out/tcache/tcache.tar.xz -C /tmp; fi
init=()
if [ -d .out/init ]; then init=(--init .out/init); fi
# the call's own limit is 600 s: stop training in time to save
timeout 585 python3 tools/train_tiny.py --out "$OUT/run" --steps "$steps" --minutes "$minutes" --workers 14 \
    "${init[@]}" $extra
rc=$?
tar cJf "$OUT/tcache.tar.xz" -C /tmp tc
exit $rc
