#!/usr/bin/env bash
# GPTQ's speed, the committed code against an older gptq.py (OLD, e.g. `git show REV:qckpt/calib/
# gptq.py > .old/gptq.py`), side by side in one run on one GPU: the same recipe as h200_round.sh's
# gptq_8l (NVFP4, 128 x 2,048 tokens, Qwen3-30B-A3B shape, 8 layers) for both, each a whole
# `qckpt calibrate` with its --json, then whether the two calibration files are byte-identical.
#   bash bench/gptq_ab.sh OLD_GPTQ_PY [OUT_DIR]
set -u
cd "$(dirname "$0")/.."
OLD=$1 OUT=${2:-${OUT:-/tmp/gptq-ab}}
W=/tmp/gptq-ab-work
CK=$W/qwen3-30b-a3b-8l
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 QCKPT_TRACE=1
[ -f "$CK/config.json" ] || python3 -m bench.whole_command make "$CK" --preset qwen3-30b-a3b \
  --layers 8 --device cuda >"$OUT/ckpt.json"
rm -rf "$W/old" && mkdir -p "$W/old" && cp -r qckpt "$W/old/" && cp "$OLD" "$W/old/qckpt/calib/gptq.py"
SETS=(--set model.source="$CK" --set checkpoint.path="$CK" --set checkpoint.format=safetensors
  --set load.device=cuda --set calibrate.algorithm=gptq --set quant.weights.format=nvfp4
  --set quant.inputs.format=nvfp4 --set calibrate.data.num_samples=128
  --set calibrate.data.seq_len=2048 --set calibrate.data.batch_size=8)
REPO=$PWD
for side in new old; do
  root=$REPO; [ "$side" = old ] && root=$W/old
  # run from the side's own tree: `python -m` puts the working directory first on sys.path
  (cd "$root" && PYTHONPATH=$root python3 -m qckpt calibrate "$REPO/configs/tiny-moe.yaml" \
    "${SETS[@]}" --set calibrate.output="$W/$side.safetensors" --json "$OUT/gptq_$side.json" \
    >"$OUT/gptq_$side.log" 2>&1)
  echo "$side rc=$? $(grep -E '^  time|peak device' "$OUT/gptq_$side.log" | tr -s ' ' | tr '\n' ' ')"
done
sha256sum "$W"/new.safetensors "$W"/old.safetensors | awk '{print $1}' | uniq | wc -l \
  | sed 's/^1$/calibration files: byte-identical/;s/^2$/calibration files: DIFFER/'
