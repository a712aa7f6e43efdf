#!/usr/bin/env bash
# The main job end to end on the built-in tiny MoE model, on CPU with 2 ranks (gloo):
# convert -> load (2 ranks) -> calibrate (2 ranks) -> export -> transformers loads the export.
set -euo pipefail
cd "$(dirname "$0")/.."
recipe=configs/tiny-moe.yaml
run=${QCKPT_DEMO_RUN:-runs/demo}  # where its files go (the demo test: a temp dir)
set_paths=(--set checkpoint.path=$run/dcp --set calibrate.output=$run/calib.safetensors
           --set export.output=$run/fp8 --set export.overwrite=true)
rm -rf "$run"
echo "== 1. convert: the recipe's model -> DCP checkpoint"
qckpt convert "$recipe" "$run/dcp" "${set_paths[@]}"
echo "== 2. load: stream the checkpoint into FP8 parameters on 2 ranks (bulk baseline alongside)"
qckpt load "$recipe" "${set_paths[@]}" --nproc-per-node 2 --compare --json "$run/load.json"
echo "== 3. calibrate: max calibration over 2 data-parallel ranks, amax synced"
qckpt calibrate "$recipe" "${set_paths[@]}" --nproc-per-node 2 --json "$run/amax.json"
echo "== 4. export: compressed-tensors FP8 safetensors"
qckpt export "$recipe" "${set_paths[@]}" --json "$run/export.json"
echo "== 5. check: the export's fields and scales, then transformers loads it (logits vs BF16)"
qckpt check "$run/fp8"
python -m qckpt.verify "$run/fp8" "$run/dcp" --min-cosine 0.99
