#!/usr/bin/env bash
# One training call on the GPU machine (the device tool), as learned on 2026-11-30 (docs/tiny.md):
#
#   run(command="bash tools/device_train.sh 7.6 2400 '--seq 4096 --warmup 100'", carry=[".whl/train", ".out/tcache", ".out/init"])
#
# $1 minutes of training (leave ~1 min of the 10-minute call for start-up, the held-out pass and saving),
# $2 scheduled steps, $3 extra train_tiny.py arguments. Reads, when carried: .out/tcache/tcache.tar.xz.part-* (a Triton
# cache from an earlier call: without it fla's kernels compile and autotune for ~400 s on the first step) and
# .out/init (weights to continue from). Check the device tool's `status` first: a call runs for at most the device
# time left to the session, and is killed there. The weights and the log are saved every 2 minutes of training
# ($OUT/run/weights, $OUT/run/train_log.json), so a call killed early still brings back its latest weights; set
# TRAIN_LIMIT_S below the time left (the default 560 s leaves the 600-s call time to save). Do not pipe the call's
# output through `tail`: a killed pipeline prints nothing. Writes to $OUT: run/weights/* (5 files), meta.tar (train_log.json and
# heldout_rows.json) and the Triton cache as tcache.tar.xz.part-aa, -ab (parts of 15-16 MiB, when they fit beside the rest:
# at most 8 files of at most 16 MiB, 64 MiB in all, come back). Restore it next time with: mkdir -p .out/tcache && cp /work/.device/N/tcache.tar.xz.part-* .out/tcache/
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
# the data workers write each renamed project (tiny_data.RenamedCorpus) under $TMPDIR: keep those small files in
# memory when the machine has a tmpfs, not on its disk
if [ -w /dev/shm ]; then export TMPDIR=/dev/shm; fi
df -h /tmp /dev/shm 2>/dev/null | sed 's/^/# /'
mkdir -p /tmp/tc
if ls .out/tcache/tcache.tar.xz.part-* >/dev/null 2>&1; then cat .out/tcache/tcache.tar.xz.part-* | tar xJ -C /tmp; fi
init=()
if [ -d .out/init ]; then init=(--init .out/init); fi
# the call's own limit is 600 s: stop training in time to save
timeout "${TRAIN_LIMIT_S:-560}" python3 tools/train_tiny.py --out "$OUT/run" --steps "$steps" --minutes "$minutes" \
    --workers 14 --checkpoint-every 2 "${init[@]}" $extra
rc=$?
if [ -f "$OUT/run/train_log.json" ]; then
  tar cf "$OUT/meta.tar" -C "$OUT/run" train_log.json $(cd "$OUT/run" && ls heldout_rows.json 2>/dev/null)
  rm -f "$OUT/run/train_log.json" "$OUT/run/heldout_rows.json"
fi
# what comes back is at most 8 files and 64 MiB: the weights and meta.tar first, the Triton cache only in what is left
tar cf - -C /tmp tc | xz -T0 -2 > /tmp/tcache.tar.xz
used=$(du -sb "$OUT" | cut -f1); files=$(find "$OUT" -type f | wc -l)
size=$(stat -c %s /tmp/tcache.tar.xz); left=$(( 64 * 2**20 - used - 2**20 )); slots=$(( 8 - files ))
part=$(( (size + slots - 1) / (slots > 0 ? slots : 1) ))
if [ "$slots" -gt 0 ] && [ "$size" -le "$left" ] && [ "$part" -le $(( 16 * 2**20 - 4096 )) ]; then
  [ "$part" -lt $(( 15 * 2**20 )) ] && part=$(( 15 * 2**20 ))
  split -b "$part" /tmp/tcache.tar.xz "$OUT/tcache.tar.xz.part-"
else
  echo "# Triton cache ($size bytes) left behind: $left bytes and $slots files left of what comes back"
fi
exit $rc
