#!/usr/bin/env bash
# Models of several sizes trained side by side from scratch in one call on the GPU machine (the device tool), for
# issue 31's curve of parameters against held-out accuracy at equal training time (docs/tiny.md, "Size"):
#
#   run(command="TRAIN_LIMIT_S=430 bash tools/device_train_sizes.sh 6.3 '<train_tiny.py args>' kda_sessions/builtin/tiny.json tools/tiny_sizes/tiny-h384.json",
#       carry=[".whl/train"])
#
# $1 minutes of training, $2 extra train_tiny.py arguments (the same for every size), $3... one model config each.
# The runs share the GPU and the data workers (14 split between them), so each gets part of what one run alone
# gets: the comparison is at equal time, not at one run's speed. Brings back, per config NAME (its file name without
# .json), NAME.tar (train_log.json, heldout_rows.json and the weights as bf16: tools/average_weights.py with one
# input), split into parts of at most 15 MiB when larger (at most 8 files and 64 MiB in all come back: two sizes up
# to ~20 M parameters fit). Unpack with: cat NAME.tar.part-* > NAME.tar (or NAME.tar as it is) && tar xf NAME.tar.
set -uo pipefail
minutes=$1
extra=$2
shift 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/train/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
# tools/average_weights.py imports the library from the checkout: its kernels and storage as the editable install maps them
ln -sfn "$PWD/kernels" kda_sessions/kernels
ln -sfn "$PWD/storage" kda_sessions/storage
if [ -w /dev/shm ]; then export TMPDIR=/dev/shm; fi
mkdir -p /tmp/tc /tmp/sizes
workers=$(( 14 / $# ))
pids=()
for cfg in "$@"; do
  name=$(basename "$cfg" .json)
  timeout "${TRAIN_LIMIT_S:-430}" python3 tools/train_tiny.py --out "/tmp/sizes/$name" --steps 100000 --minutes "$minutes" \
      --workers "$workers" --checkpoint-every 2 --config "$cfg" $extra > "/tmp/sizes/$name.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for cfg in "$@"; do
  name=$(basename "$cfg" .json)
  d=/tmp/sizes/$name
  tail -3 "/tmp/sizes/$name.log" | sed "s/^/# $name: /"
  [ -d "$d/weights" ] || continue
  mkdir -p "/tmp/sizes/pack/$name"
  python3 tools/average_weights.py --out "/tmp/sizes/pack/$name" --config "$cfg" "$d/weights" >/dev/null || continue
  cp "/tmp/sizes/$name.log" "/tmp/sizes/pack/$name/"
  for f in train_log.json heldout_rows.json; do [ -f "$d/$f" ] && cp "$d/$f" "/tmp/sizes/pack/$name/"; done
  tar cf "/tmp/sizes/$name.tar" -C /tmp/sizes/pack "$name"
  if [ "$(stat -c %s "/tmp/sizes/$name.tar")" -gt $(( 15 * 2**20 )) ]; then
    split -b $(( 15 * 2**20 )) "/tmp/sizes/$name.tar" "$OUT/$name.tar.part-"
  else
    cp "/tmp/sizes/$name.tar" "$OUT/"
  fi
done
exit $rc
