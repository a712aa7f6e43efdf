#!/usr/bin/env bash
# The lead's batched GPU round (nvidia-h200-x2): make the Qwen3-30B-A3B-shaped checkpoints if
# they are absent, run the benchmarks, and collect every result under $OUT.
#
#   bash bench/h200_round.sh                 # every step, in order
#   bash bench/h200_round.sh env ckpt_8l whole_8l    # only these steps (e.g. to split calls)
#   bash bench/h200_round.sh --list          # the steps
#
# One function per step (step_NAME), each run under its own timeout; a failed step is recorded
# and the round goes on. To add a step: write a step_NAME function, add NAME and its limit in
# seconds to STEPS below. A step writes what it measured to "$RES/NAME.json" (or .txt); its
# stdout and stderr go to "$RES/NAME.log" by themselves.
#
# What comes back ($OUT holds at most 8 files): $OUT/summary.txt (each step's exit code and
# seconds, then the tail of each log), $OUT/results.json (every step's JSON, by step name) and
# $OUT/round.tar.gz (all of $RES: every log and result whole).
#
# Checkpoints live in $WORK (default /tmp/qckpt-round), outside the repo, so they are not sent
# back; on a machine still warm from an earlier call they are found and kept.
set -u
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (the device README asks for it, also in child environments)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
OUT=${OUT:-$PWD/round-out}
WORK=${QCKPT_ROUND_WORK:-/tmp/qckpt-round}
RES="$WORK/results"
# the GPU a one-GPU step runs on (QCKPT_ROUND_GPU=1: the second, while the first runs the tests)
GPU=${QCKPT_ROUND_GPU:-0}
CKPT48="${QCKPT_CKPT48:-$WORK/qwen3-30b-a3b}"  # /dev/shm/... beside other work on the disk
CKPT8="${QCKPT_CKPT8:-$WORK/qwen3-30b-a3b-8l}"  # /dev/shm/... where the disk holds only the 48 layers
mkdir -p "$OUT" "$RES"
# PYC=1: Python's bytecode caches kept in $WORK/pyc (the device sets PYTHONDONTWRITEBYTECODE=1, so
# without this every process compiles torch, sympy and transformers from source again: a normal
# install has its caches). Applies to every contender alike; step pyc_warm fills the caches.
if [ -n "${PYC:-}" ]; then
  export PYTHONPYCACHEPREFIX="$WORK/pyc"
  unset PYTHONDONTWRITEBYTECODE
fi

# name:limit_s, in the order a full round runs them
STEPS=(
  env:60
  gpu_phases:300
  meta_tests:240
  ckpt_8l:240
  whole_8l:300
  meta_8l:240
  ckpt_48l:420
  whole_48l:540
  fastread_48l:540
  meta_48l:420
  resident_tests:300
  resident_8l:420
  resident_48l:600
  offload_ref_48l:540
  offload_48l:540
  fastread_tests:240
  load_bench:480
  calib_tests:240
  calib_speed:300
  calib_dp:540
  calib_dp_pyc:600
  calib_dp_48l:600
  calib_dp_48l_pyc:600
  export_tests:300
  export_48l:600
  export_shm_48l:600
  disk_quick:120
  plan_48l:300
  disk:240
  profile_8l:480
  profile_48l:540
  calib_prof_48l:300
  loadprof_8l:300
  knobs_8l:300
  knobs_48l:360
  loadprof_48l:240
  pyc_warm:180
  moe_model:300
  llmc:900
  gptq_tests:300
  gptq_8l:600
  gptq_48l:1500
  gptq_off_48l:1700
  quality_algos:1200
  quality_mixes:900
  quality_w4a16:1500
  imports:120
  startup_8l:240
  export_lanes_48l:300
  write_ceiling:120
  export_shm_8l:300
  megatron_48l:500
  plan_export_host_48l:150
  peh_48l:300
)

# the disk under $WORK: dd of 8 GB with and without fsync, one writer and two at once
step_disk() {
  local n
  for n in 1 2; do
    echo "== $n writer(s), no fsync"
    for i in $(seq $n); do dd if=/dev/zero of="$WORK/dd$i" bs=64M count=128 2>&1 | tail -1 & done; wait
    rm -f "$WORK"/dd*
    echo "== $n writer(s), fsync"
    for i in $(seq $n); do dd if=/dev/zero of="$WORK/dd$i" bs=64M count=128 conv=fsync 2>&1 | tail -1 & done; wait
    rm -f "$WORK"/dd*
  done
}

# where the time goes (bench/profile.py: every thread's stack sampled every 5 ms): export of the
# 8-layer model, one process on the GPU and on the CPU; the fast FP8 load on cuda:0
profile_cmds() {  # CKPT TAG
  local rc=0
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.export --src "$1" --calib "$WORK/export_calib_$2.safetensors" \
    --nprocs 1 --workdir "$WORK/export_prof" --profile "$RES/prof_export_$2.txt" \
    --json "$RES/prof_export_$2.json" || rc=1
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.profile --out "$RES/prof_load_$2.txt" -- -m qckpt load \
    configs/tiny-moe.yaml --set model.source="$1" --set checkpoint.path="$1" \
    --set checkpoint.format=safetensors --set load.params=fp8 --set load.device=cuda \
    --json "$RES/prof_load_$2.json" || rc=1
  return $rc
}
step_profile_8l() {
  profile_cmds "$CKPT8" 8l
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.export --src "$CKPT8" --calib "$WORK/export_calib_8l.safetensors" \
    --nprocs 1 --device cpu --workdir "$WORK/export_prof" --profile "$RES/prof_export_cpu_8l.txt" \
    --json "$RES/prof_export_cpu_8l.json"
}
# the FP8 load of the 8-layer model profiled twice (the first run compiles the Triton kernels),
# beside the host's read ceiling for the same files
step_loadprof_8l() {
  local i rc=0
  df -h /dev/shm /tmp
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.read_ceiling "$CKPT8" --device cuda --warm \
    | tee "$RES/ceiling_8l.json" || rc=1
  for i in 1 2; do
    CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.profile --out "$RES/prof_load_8l_$i.txt" -- -m qckpt \
      load configs/tiny-moe.yaml --set model.source="$CKPT8" --set checkpoint.path="$CKPT8" \
      --set checkpoint.format=safetensors --set load.params=fp8 --set load.device=cuda \
      --json "$RES/prof_load_8l_$i.json" || rc=1
  done
  return $rc
}
# the fast read's knobs (threads, switch interval, max_inflight, piece size) in one process
step_knobs_8l() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.read_knobs configs/tiny-moe.yaml \
    --set model.source="$CKPT8" --set checkpoint.path="$CKPT8" \
    --set checkpoint.format=safetensors --set load.params=fp8 --set load.device=cuda \
    ${KNOBS_ONLY:+--only "$KNOBS_ONLY"} --json "$RES/knobs_8l.json"
}
# the FP8 load of the 48-layer model, profiled (where the calling thread and the readers wait)
step_loadprof_48l() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.profile --out "$RES/prof_load_48l.txt" -- -m qckpt load \
    configs/tiny-moe.yaml --set model.source="$CKPT48" --set checkpoint.path="$CKPT48" \
    --set checkpoint.format=safetensors --set load.params=fp8 --set load.device=cuda \
    --json "$RES/prof_load_48l.json"
}
step_profile_48l() {
  profile_cmds "$CKPT48" 48l
}
# where calibrate's first batch spends its host time (48 layers: ~3.3 s over a steady batch,
# all of it before the forward returns): a two-batch calibrate under the sampling profiler
step_calib_prof_48l() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.profile --out "$RES/prof_calib_48l.txt" -- -m qckpt \
    calibrate configs/tiny-moe.yaml --set model.source="$CKPT48" --set checkpoint.path="$CKPT48" \
    --set checkpoint.format=safetensors --set load.device=cuda --set calibrate.data.num_samples=16 \
    --set calibrate.data.seq_len=2048 --set calibrate.data.batch_size=8 \
    --set calibrate.output="$WORK/prof_calib.safetensors" --json "$RES/prof_calib_48l.json"
}


# calibrate.algorithm gptq (issue 27): the CPU tests of the algorithms on CUDA's host, then the
# GPTQ pass on one H200, NVFP4 weights and inputs, 128 x 2,048 tokens (llm-compressor's
# published Qwen3-30B-A3B GPTQ on one GPU: 14,207 s), each a whole `qckpt calibrate` process
# with its --json (forward_parts: gptq_capture / gptq_layers; layers.*.gptq.seconds per layer;
# gptq_hessian_bytes; the phases' device peaks) and `qckpt plan`'s prediction (gptq_bytes)
# beside it. gptq_8l: the 8-layer checkpoint (per-layer seconds to extrapolate from);
# gptq_48l: the 48-layer one (an MoE layer's experts go through GPTQ side by side, gptq_batch)
GPTQ_SETS=(--set checkpoint.format=safetensors --set load.device=cuda
  --set calibrate.algorithm=gptq --set quant.weights.format=nvfp4 --set quant.inputs.format=nvfp4
  --set calibrate.data.num_samples=128 --set calibrate.data.seq_len=2048
  --set calibrate.data.batch_size=8)
step_gptq_tests() {
  "$PY" -m pytest -q tests/unit/test_algorithms_math.py tests/unit/test_gptq_pipeline.py
}
gpu_gib() {  # this GPU's memory in GiB, for qckpt plan's fit
  nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "${GPU:-0}" \
    | awk '{printf "%dGiB", $1 / 1024}'
}
gptq_on() {  # $1 checkpoint, $2 name, then more --set pairs (e.g. calibrate.offload=layer)
  local rc=0 ck=$1 name=$2 out=${GPTQ_OUT:-$WORK}
  shift 2
  "$PY" -m qckpt plan configs/tiny-moe.yaml --set model.source="$ck" --set checkpoint.path="$ck" \
    "${GPTQ_SETS[@]}" "$@" --nproc-per-node 1 --gpu-memory "$(gpu_gib)" \
    --json "$RES/plan_$name.json" || rc=1
  CUDA_VISIBLE_DEVICES=$GPU QCKPT_TRACE=1 "$PY" -m qckpt calibrate configs/tiny-moe.yaml \
    --set model.source="$ck" --set checkpoint.path="$ck" "${GPTQ_SETS[@]}" "$@" \
    --set calibrate.output="$out/$name.safetensors" --json "$RES/$name.json" || rc=1
  du -sh "$out/$name.safetensors.gptq" 2>/dev/null
  rm -rf "$out/$name.safetensors.gptq"  # a whole model's GPTQ'd weights: make room again
  return $rc
}
step_gptq_8l() { gptq_on "$CKPT8" gptq_8l; }
step_gptq_48l() { gptq_on "$CKPT48" gptq_48l; }
# the 48 layers with calibrate.offload: layer (fits an 80 GB GPU), and qckpt plan of the
# resident run beside it; GPTQ_OUT=/dev/shm when the checkpoint is on the disk (the sidecar is
# the whole model's weights again: the 64 GiB disk holds one of the two)
step_gptq_off_48l() {
  "$PY" -m qckpt plan configs/tiny-moe.yaml --set model.source="$CKPT48" \
    --set checkpoint.path="$CKPT48" "${GPTQ_SETS[@]}" --nproc-per-node 1 \
    --gpu-memory "$(gpu_gib)" --json "$RES/plan_gptq_48l.json"
  gptq_on "$CKPT48" gptq_off_48l --set calibrate.offload=layer
}

# the Qwen3-MoE that learned real text (../shared/quality/train_textlm.py --arch qwen3moe, 150 s),
# made again on a machine that lacks it (its weights do not travel back); the script and the
# training text are where bench/h200_session.sh stages them
step_moe_model() {
  local q=${QCKPT_QUALITY:-$PWD/../shared/quality}
  [ -f "$q/models/qwen3moe-textlm/config.json" ] && { echo "have $q/models/qwen3moe-textlm"; return 0; }
  CUDA_VISIBLE_DEVICES=$GPU "$PY" "$q/train_textlm.py" --arch qwen3moe --out "$q/models/qwen3moe-textlm" \
    --train "$q/train64.bin" --heldout "$q/heldout.bin" --seconds 150
}

# issue 42's baselines: llm-compressor 0.14's W4A16 GPTQ and W8A8 (SmoothQuant + GPTQ) of both
# trained models from bench.quality's calibration windows (bench/llmcompressor_export.py), into
# $WORK/llmc/MODEL-SCHEME; llm-compressor's site (.llmc/, bench/llmc_bundle.sh) is installed into
# /tmp/lcsite and put first on PYTHONPATH for these processes only (/tmp/site, vLLM's, has its own
# compressed-tensors). LLMC_DEVICE=cpu LLMC_MODELS=llama: the Llama alone on a CPU, to try it.
step_llmc() {
  local q=${QCKPT_QUALITY:-$PWD/../shared/quality} site=${LCSITE:-/tmp/lcsite} m s rc=0
  if [ ! -d "$site/llmcompressor" ]; then
    [ -x .llmc/install.sh ] || { echo "no .llmc/ (bash bench/llmc_bundle.sh, then carry .llmc)"; return 1; }
    LCSITE="$site" PY="$PY" bash .llmc/install.sh || return 1
  fi
  for m in ${LLMC_MODELS:-llama qwen3moe}; do
    local dir="$q/models/$m-textlm"
    [ -f "$dir/config.json" ] || { echo "no $dir"; rc=1; continue; }
    for s in w4a16 w8a8; do
      CUDA_VISIBLE_DEVICES=$GPU PYTHONPATH="$site:$PWD" "$PY" -m bench.llmcompressor_export \
        --model "$dir" --calib "$q/calib.bin" --out "$WORK/llmc/$m-$s" --scheme "$s" \
        --device "${LLMC_DEVICE:-cuda}" 2>&1 | grep -v -E "it/s\]|s/it\]|METRIC|Quantizing 1 module" || rc=1
      [ -f "$WORK/llmc/$m-$s/config.json" ] || rc=1
    done
  done
  return $rc
}

# the --extra rows of step_llmc's exports (bench.quality gives each to the model whose config matches)
llmc_extras() {
  local m s name
  for m in llama qwen3moe; do
    for s in w4a16 w8a8; do
      name=lc-w8a8; [ "$s" = w4a16 ] && name=lc-w4a16-gptq
      [ -f "$WORK/llmc/$m-$s/config.json" ] && printf -- '--extra %s=%s ' "$m-$name" "$WORK/llmc/$m-$s"
    done
  done
}

# issue 27's table: bench.quality --algorithms on both trained models (NVFP4 W4A4 per
# calibrate.algorithm; qckpt eval, transformers and vLLM side by side; vLLM carried in /tmp/site),
# the updated docs/QUALITY.md kept beside the JSON
step_quality_algos() {
  local q=${QCKPT_QUALITY:-$PWD/../shared/quality}
  CUDA_VISIBLE_DEVICES=$GPU QCKPT_VLLM_SITE=${QCKPT_VLLM_SITE:-/tmp/site} "$PY" -m bench.quality \
    --algorithms max,mse,awq,gptq,gptq+mse --model "llama=$q/models/llama-textlm" \
    --model "qwen3moe=$q/models/qwen3moe-textlm" --calib "$q/calib.bin" --heldout "$q/heldout.bin" \
    --work "$WORK/quality-algos" --vllm-parallel 5 --json "$RES/quality_algos.json"
  local rc=$?
  cp docs/QUALITY.md "$RES/QUALITY.md"
  return $rc
}

# the trained models that are there (the Qwen3-MoE is trained by moe_model, which a short round
# may leave out), as bench.quality's --model arguments
trained_models() {
  local m
  for m in llama qwen3moe; do
    [ -f "$1/models/$m-textlm/config.json" ] && printf -- '--model %s=%s ' "$m" "$1/models/$m-textlm"
  done
}

# issue 42's rows: INT4 W4A16 (group 128), MXFP4A16, INT8 W8A8, NVFP4A16 and MXFP8, each with
# max and gptq (W4A16_ALGOS), on both trained models, served by vLLM (Marlin / Machete / CUTLASS int8 on Hopper)
step_quality_w4a16() {
  local q=${QCKPT_QUALITY:-$PWD/../shared/quality}
  CUDA_VISIBLE_DEVICES=$GPU QCKPT_VLLM_SITE=${QCKPT_VLLM_SITE:-/tmp/site} "$PY" -m bench.quality \
    --algorithms ${W4A16_ALGOS:-max,gptq,mse,awq} --algorithms-on ${W4A16_ON:-int4,mxfp4,int8,nvfp4a16,mxfp8,int4-fp8} \
    $(trained_models "$q") --calib "$q/calib.bin" --heldout "$q/heldout.bin" \
    --work "$WORK/quality-w4a16" --vllm-parallel 5 --json "$RES/quality_w4a16.json" $(llmc_extras)
  local rc=$?
  cp docs/QUALITY.md "$RES/QUALITY.md"
  return $rc
}

# issue 41's table: bench.quality --mixes on both trained models (NVFP4 MLP / experts + FP8
# attention in both layouts, beside all-FP8 and all-NVFP4; bits per weight, qckpt eval,
# transformers and vLLM side by side)
step_quality_mixes() {
  local q=${QCKPT_QUALITY:-$PWD/../shared/quality}
  CUDA_VISIBLE_DEVICES=$GPU QCKPT_VLLM_SITE=${QCKPT_VLLM_SITE:-/tmp/site} "$PY" -m bench.quality \
    --mixes --model "llama=$q/models/llama-textlm" --model "qwen3moe=$q/models/qwen3moe-textlm" \
    --calib "$q/calib.bin" --heldout "$q/heldout.bin" --work "$WORK/quality-mixes" \
    --vllm-parallel 4 --json "$RES/quality_mixes.json"
  local rc=$?
  cp docs/QUALITY.md "$RES/QUALITY.md"
  return $rc
}

# issue 29: `qckpt export` straight from a 61 GB Qwen3-30B-A3B-shaped checkpoint in Megatron-Core's
# torch_dist layout beside the two-step path (convert to HF BF16, then export). The checkpoint is on
# the disk ($WORK/mc); the exports and the HF copy go to tmpfs (the 64 GB disk holds one model),
# and the HF copy is kept for the next step.
MC_SCR=/dev/shm/mc
step_megatron_48l() {
  "$PY" -m bench.megatron_export --work "$WORK/mc" --scratch "$MC_SCR" --keep-hf --layers 48 \
    --device cuda --json "$RES/megatron_48l.json"
}
# issue 30: `qckpt plan`'s export host figure beside a measured export of the 48-layer model (the
# HF copy megatron_48l left in tmpfs, its calibration file), one GPU
step_plan_export_host_48l() {
  "$PY" -m bench.plan_export_host --model "$WORK/mc/hf-config" --src "$MC_SCR/hf-bf16" \
    --calib "$WORK/mc/calib-48l.safetensors" --out /dev/shm/peh --gpu-memory 139GiB \
    --json "$RES/plan_export_host_48l.json"
}

# the same check on the HF checkpoint ckpt_48l makes, calibrated on one short batch (the export's
# memory does not depend on the calibration's values)
step_peh_48l() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m qckpt calibrate configs/tiny-moe.yaml --set model.source="$CKPT48" \
    --set checkpoint.path="$CKPT48" --set checkpoint.format=safetensors --set load.device=cuda \
    --set calibrate.data.num_samples=2 --set calibrate.data.seq_len=64 \
    --set calibrate.data.batch_size=2 --set calibrate.output="$WORK/peh_calib.safetensors" \
    --json "$RES/peh_calib_48l.json" || return 1
  "$PY" -m bench.plan_export_host --model "$CKPT48" --src "$CKPT48" \
    --calib "$WORK/peh_calib.safetensors" --out /dev/shm/peh --gpu-memory 139GiB \
    --json "$RES/peh_48l.json"
}

step_env() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c 'import torch, transformers, sys; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count()); print("transformers", transformers.__version__)'
  free -g; df -h "$WORK"; nproc
}

# what start-up costs on this machine: each import in a fresh interpreter, twice (cold, warm), and
# the heaviest modules of `import torch, transformers` by cumulative time (python -X importtime)
step_imports() {
  local m i
  for m in torch transformers "transformers.models.qwen3_moe.modeling_qwen3_moe" \
      "torch.distributed.checkpoint" "qckpt.cli.app"; do
    for i in 1 2; do
      /usr/bin/time -f "import $m: %e s (run $i)" "$PY" -c "import $m" 2>&1 | tail -1
    done
  done
  "$PY" -X importtime -c "import torch, transformers.models.qwen3_moe.modeling_qwen3_moe" \
    2>"$RES/importtime.txt" || true
  sort -t"|" -k2 -n -r "$RES/importtime.txt" | head -25; return 0
}

# where a whole command's start-up goes on this machine: the imports of a real load and a real
# calibrate (-X importtime, top modules by cumulative time), CUDA's first use, and a process group
# of 2 over NCCL
step_startup_8l() {
  local rc=0
  /usr/bin/time -f "python -c pass: %e s" "$PY" -c pass
  /usr/bin/time -f "import torch + cuda init: %e s" "$PY" -c 'import torch; torch.zeros(1, device="cuda")'
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -X importtime -m qckpt load configs/tiny-moe.yaml \
    --set model.source="$CKPT8" --set checkpoint.path="$CKPT8" --set checkpoint.format=safetensors \
    --set load.params=fp8 --set load.device=cuda --json "$RES/startup_load.json" \
    2>"$RES/importtime_load.txt" >/dev/null || rc=1
  grep '^import time' "$RES/importtime_load.txt" | sort -t"|" -k2 -n -r | head -30
  "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print("load phases", d.get("phases"))' \
    "$RES/startup_load.json" || true
  "$PY" -X importtime -m qckpt calibrate configs/tiny-moe.yaml --set model.source="$CKPT8" \
    --set checkpoint.path="$CKPT8" --set checkpoint.format=safetensors --set load.device=cuda \
    --set calibrate.data.num_samples=8 --set calibrate.output="$WORK/startup_amax.safetensors" \
    --json "$RES/startup_calib.json" \
    2>"$RES/importtime_calib.txt" >/dev/null || rc=1
  grep '^import time' "$RES/importtime_calib.txt" | sort -t"|" -k2 -n -r | head -30
  "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print("calib phases", d.get("phases"))' \
    "$RES/startup_calib.json" || true
  return $rc
}

# one export process with 1 and 4 lanes (shard files written at once) beside the default 2 of
# export_shm_48l, into tmpfs; and the host's own write ceiling into tmpfs (threads into one file
# vs one file each; pages allocated first or not)
step_export_lanes_48l() {
  "$PY" -m bench.export --src "$CKPT48" --calib "$WORK/export_calib.safetensors" --nprocs 1 \
    --lanes "${LANES_AB:-1,4}" --workdir /dev/shm/qckpt-export --json "$RES/export_shm_48l_lanes.json"
  local rc=$?
  rm -rf /dev/shm/qckpt-export
  return $rc
}
step_write_ceiling() {
  "$PY" -m bench.write_ceiling --dir /dev/shm --gb 4 --repeat 2 --how pwrite,prealloc \
    --json "$RES/write_ceiling.json"
}

# bytecode caches for the packages every contender imports (with PYC=1: into $WORK/pyc)
step_pyc_warm() {
  local dirs
  # the whole site-packages torch lives in (every contender's imports), and qckpt's checkout
  dirs=$("$PY" -c 'import os, importlib.util as u; print(os.path.dirname(os.path.dirname(u.find_spec("torch").origin)), os.path.dirname(u.find_spec("qckpt").origin))')
  echo "PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-} compiling: $dirs"
  "$PY" -m compileall -q -j 0 $dirs >/dev/null 2>&1
  /usr/bin/time -f "import torch + cuda init: %e s" "$PY" -c 'import torch; torch.zeros(1, device="cuda")'
  return 0
}

# the fast read's knobs on the 48-layer model (default twice: the first load in a process on a
# fresh machine, and again), with the Triton cache's size before and after (a cold cache compiles)
step_knobs_48l() {
  local tc="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
  echo "triton cache entries before: $(ls "$tc" 2>/dev/null | wc -l)"
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.read_knobs configs/tiny-moe.yaml \
    --set model.source="$CKPT48" --set checkpoint.path="$CKPT48" \
    --set checkpoint.format=safetensors --set load.params=fp8 --set load.device=cuda \
    --only "${KNOBS_ONLY:-default,default again,ahead 0,ahead 64 MiB,ahead 1 GiB,inflight 2}" \
    --json "$RES/knobs_48l.json"
  local rc=$?
  echo "triton cache entries after: $(ls "$tc" 2>/dev/null | wc -l)"
  return $rc
}

# whole-command device peaks and exact load windows on CUDA (tests/gpu, skipped on CPU)
step_gpu_phases() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m pytest -x -q -p no:cacheprovider \
    tests/gpu/test_phases_gpu.py tests/gpu/test_load_gpu.py
}

# the 8-layer version (11 GB) and the whole 48 layers (61 GB), made on the GPU, kept if present
step_ckpt_8l() {
  "$PY" -m bench.whole_command make "$CKPT8" --preset qwen3-30b-a3b --layers 8 --device cuda \
    | tee "$RES/ckpt_8l.json"
}
step_ckpt_48l() {
  "$PY" -m bench.whole_command make "$CKPT48" --preset qwen3-30b-a3b --device cuda \
    | tee "$RES/ckpt_48l.json" && touch "$CKPT48.written"  # what TESTS_AFTER waits for
}

# qckpt load (FP8) beside transformers' BF16 and FP8 loads, whole processes, on cuda:0; and
# qckpt load with EP2 over both GPUs (each rank's whole-command peak against the one-GPU one)
step_whole_8l() {
  "$PY" -m bench.whole_command run "$CKPT8" --device cuda --ep 2 --json "$RES/whole_8l.json"
}
step_whole_48l() {
  "$PY" -m bench.whole_command run "$CKPT48" --device cuda --ep "${WHOLE_EP:-2}" --json "$RES/whole_48l.json"
}

# the fast read path (issue 18) on the 48-layer model: whole qckpt load processes into FP8 on one
# GPU with load.reader fast and plain (reading GB/s, seconds, transient in each --json), and the
# host's own ceiling for the same files (parallel read into pinned memory, and on to the GPU)
step_fastread_48l() {
  local r rc=0
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.read_ceiling "$CKPT48" --device cuda --warm \
    | tee "$RES/ceiling_48l.json" || rc=1
  for r in fast plain; do
    CUDA_VISIBLE_DEVICES=$GPU "$PY" -m qckpt load configs/tiny-moe.yaml --set model.source="$CKPT48" \
      --set checkpoint.path="$CKPT48" --set checkpoint.format=safetensors --set load.params=fp8 \
      --set load.device=cuda --set load.reader=$r --json "$RES/fastread_48l_$r.json" || rc=1
  done
  return $rc
}
# fast reader on CUDA == plain for every format (pinned pieces, cast path, Triton kernels taken)
step_fastread_tests() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m pytest -x -q -p no:cacheprovider tests/gpu/test_fast_read_gpu.py
}
# bench/load.py at full size (48 x 8192^2 DCP, 6.4 GB): fast vs plain reader, stream vs plain on
# the same reader, host read ceiling, side by side; exit 1 if a target is missed
step_load_bench() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.load --dir "$WORK/loadbench" --json "$RES/load_bench.json"
}

# meta builds on CUDA: fresh quantized fields, meta build + load == seeded build + load
step_meta_tests() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m pytest -x -q -p no:cacheprovider tests/gpu/test_meta_build_gpu.py
}

# issue 17's bound for the whole qckpt load (meta build, one scratch: load.max_inflight=1):
# device peak (never reset) <= the FP8 model + 2*max(numel) + 64 MiB; exit 1 if over
step_meta_8l() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.load_bound "$CKPT8" --device cuda --json "$RES/meta_8l.json"
}
step_meta_48l() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.load_bound "$CKPT48" --device cuda \
    --json "$RES/meta_48l.json"
}

# calibrate.weights_resident (issue 17): tiny-moe on CUDA (weight amax identical to bf16, no
# _scaled_mm inside calibration), then the 48-layer model calibrated with BF16 and with FP8
# resident weights on one GPU, each a whole `qckpt calibrate` process: both device peaks
# (max_memory_allocated, never reset), the ratio (target <= 0.6), weight amaxes bit-identical
step_resident_tests() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m pytest -x -q -p no:cacheprovider tests/gpu/test_resident_gpu.py
}
resident_bench() {  # CKPT JSON [bench args]
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.resident_calibration configs/tiny-moe.yaml \
    --set model.source="$1" --set checkpoint.path="$1" \
    --set checkpoint.format=safetensors --set load.device=cuda --set parallel.timeout_s=600 \
    --set calibrate.data.num_samples=16 --set calibrate.data.seq_len=256 \
    --set calibrate.data.batch_size=4 --json "$2" "${@:3}"
}
# 8 layers: a quick first look (the BF16 embeddings and lm_head, 1.2 GB, weigh more here)
step_resident_8l() {
  resident_bench "$CKPT8" "$RES/resident_8l.json" --formats bf16,fp8,fp8_block
}
step_resident_48l() {
  resident_bench "$CKPT48" "$RES/resident_48l.json" --formats bf16,fp8 --max-ratio 0.6
}

# calibrate.offload: layer (issue 17) on the 48-layer model. offload_ref_48l: the resident
# references, EP2 over both GPUs and one whole GPU. offload_48l: one GPU capped at 20 GiB
# (set_per_process_memory_fraction inside the process: bench/calibrate_offload.py run),
# offload: layer, then EP2 with offload: layer; each file compared with the references bit for
# bit (bench/calibrate_offload.py compare: exit 0 iff identical)
OFF_SETS=(--set model.source="$CKPT48" --set checkpoint.path="$CKPT48"
  --set checkpoint.format=safetensors --set load.device=cuda --set parallel.timeout_s=600
  --set calibrate.data.num_samples=16 --set calibrate.data.seq_len=256
  --set calibrate.data.batch_size=4)
step_offload_ref_48l() {
  "$PY" -m qckpt calibrate configs/tiny-moe.yaml "${OFF_SETS[@]}" --nproc-per-node 2 \
    --set parallel.ep=2 --set calibrate.output="$RES/cal_ep2.safetensors" \
    --json "$RES/offload_ref_ep2.json" || return 1
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m qckpt calibrate configs/tiny-moe.yaml "${OFF_SETS[@]}" \
    --set calibrate.output="$RES/cal_1gpu.safetensors" --json "$RES/offload_ref_1gpu.json"
}
step_offload_48l() {
  local rc=0
  CUDA_VISIBLE_DEVICES=$GPU "$PY" bench/calibrate_offload.py run --gpu-mem-gib 20 \
    --json "$RES/offload_20g_run.json" -- configs/tiny-moe.yaml "${OFF_SETS[@]}" \
    --set calibrate.offload=layer --set calibrate.output="$RES/cal_off_20g.safetensors" \
    --json "$RES/offload_20g.json" || return 1
  "$PY" bench/calibrate_offload.py compare "$RES/cal_1gpu.safetensors" \
    "$RES/cal_off_20g.safetensors" | tee "$RES/offload_cmp_1gpu.json" || rc=1
  "$PY" bench/calibrate_offload.py compare "$RES/cal_ep2.safetensors" \
    "$RES/cal_off_20g.safetensors" | tee "$RES/offload_cmp_ep2.json" || rc=1
  "$PY" -m qckpt calibrate configs/tiny-moe.yaml "${OFF_SETS[@]}" --nproc-per-node 2 \
    --set parallel.ep=2 --set calibrate.offload=layer \
    --set calibrate.output="$RES/cal_off_ep2.safetensors" --json "$RES/offload_ep2.json" || rc=1
  "$PY" bench/calibrate_offload.py compare "$RES/cal_ep2.safetensors" \
    "$RES/cal_off_ep2.safetensors" | tee "$RES/offload_cmp_off_ep2.json" || rc=1
  return $rc
}

# calibration forward speed (issue 18), cuda:0: plain (transformers eager and grouped_mm experts)
# vs instrumented (calibrate.moe_forward eager and grouped) forwards of the 48-layer shape built
# from its config (random weights, no checkpoint read), tokens/s and ratios, and the amaxes of
# the grouped run against the eager one (bit-identical or the measured difference)
# the grouped forward's Triton combine against torch's ordered additions, bit for bit
step_calib_tests() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m pytest -x -q -p no:cacheprovider tests/gpu/test_moe_combine_gpu.py
}
step_calib_speed() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m bench.calibrate_speed forward --preset qwen3-30b-a3b \
    --device cuda --batches 8 --batch-size 4 --seq-len 512 --json "$RES/calib_speed.json"
}
# DP scaling of `qckpt calibrate`: one process vs torchrun --nproc-per-node 2, same recipe and
# data (the batches dealt over the ranks), whole command and the calibration forward. Args: the
# checkpoint, the result's name; CALIB_NPROC=1 runs the one-GPU side alone (a machine of one GPU)
calib_dp_on() {
  "$PY" -m bench.calibrate_speed dp configs/tiny-moe.yaml --nproc "${CALIB_NPROC:-2}" \
    --set model.source="$1" --set checkpoint.path="$1" \
    --set checkpoint.format=safetensors --set load.device=cuda --set parallel.timeout_s=900 \
    --json "$RES/$2${CALIB_TAG:-}.json"
}
# the same with Python's bytecode caches kept (see PYC at the top): what start-up costs with an
# install's usual caches, every process of both runs alike
calib_dp_pyc_on() {
  (
    export PYTHONPYCACHEPREFIX="$WORK/pyc"
    unset PYTHONDONTWRITEBYTECODE
    step_pyc_warm
    CALIB_TAG=_pyc calib_dp_on "$@"
  )
}
step_calib_dp() { calib_dp_on "$CKPT8" calib_dp; }
step_calib_dp_pyc() { calib_dp_pyc_on "$CKPT8" calib_dp; }
# the benchmark of record for DP calibration (issue 18): the whole 48-layer model, 512 x 2,048
# tokens
step_calib_dp_48l() { calib_dp_on "$CKPT48" calib_dp_48l; }
step_calib_dp_48l_pyc() { calib_dp_pyc_on "$CKPT48" calib_dp_48l; }
# qckpt export on a GPU (issue 18): byte-identical to the CPU export for every layout, tiny
# models and 4096-wide ones
step_export_tests() {
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m pytest -x -q -p no:cacheprovider tests/gpu/test_export_gpu.py
}
# qckpt export of the 48-layer checkpoint (issues 17, 18), each a whole CLI process: one process
# on one GPU beside torchrun with 2 (a GPU each), every file compared by hash; GB/s, phases,
# whole-command peaks, RssAnon rise vs 2 x largest + 256 MiB. The calibration file is made once
# from the checkpoint's weights (kept in $WORK). exit 1 if the files differ, the bound is
# exceeded, one process is under 4 GB/s, or two are under 2x one
step_export_48l() {
  "$PY" -m bench.export --src "$CKPT48" --calib "$WORK/export_calib.safetensors" --nprocs "${EXPORT_NPROCS:-1,2}" \
    --workdir "${EXPORT_WORK:-$WORK/export}" --min-gbps 4 --min-speedup 2 \
    --json "$RES/export_48l${EXPORT_TAG:-}.json"
}
# the same into tmpfs (/dev/shm): what the export does when the disk is not the limit
step_export_shm_48l() {
  EXPORT_WORK=/dev/shm/qckpt-export EXPORT_TAG=_shm step_export_48l
  local rc=$?
  rm -rf /dev/shm/qckpt-export
  return $rc
}
# the same on the 8-layer checkpoint (11 GB): a quick check of the export's speed and scaling
step_export_shm_8l() {
  "$PY" -m bench.export --src "$CKPT8" --calib "$WORK/export_calib_8l.safetensors" --nprocs 1,2 \
    --workdir /dev/shm/qckpt-export8 --json "$RES/export_shm_8l.json"
  local rc=$?
  rm -rf /dev/shm/qckpt-export8
  return $rc
}
# the disk's own ceiling with fsync (what an export's commit asks of it): 4 GB, 1 and 2 writers
step_disk_quick() {
  local n i
  for n in 1 2; do
    echo "== $n writer(s), 4 GB each, fsync"
    for i in $(seq $n); do dd if=/dev/zero of="$WORK/dd$i" bs=64M count=64 conv=fsync 2>&1 | tail -1 & done; wait
    rm -f "$WORK"/dd*
  done
}

# qckpt plan's predictions (issue 17) beside the measured whole-command peaks of the runs above:
# the load on one GPU and with EP2 (from whole_48l), calibrate resident on one GPU and EP2, and
# offload: layer under the 20 GiB cap (from offload_ref_48l / offload_48l)
step_plan_48l() {
  local rc=0 lr="$WORK/plan_load.yaml"
  printf '%s\n' "model: {source: \"$CKPT48\", dtype: bfloat16}" \
    "checkpoint: {path: \"$CKPT48\", format: safetensors}" \
    "load: {params: fp8, device: cuda}" 'quant: {ignore: ["lm_head", "*.mlp.gate"]}' >"$lr"
  "$PY" - "$RES/whole_48l.json" "$RES" <<'PYEOF'
import json, sys
from pathlib import Path
runs = json.loads(Path(sys.argv[1]).read_text()).get("runs", {})
for name in ("qckpt", "qckpt_ep2"):
    if name in runs:
        (Path(sys.argv[2]) / f"measured_{name}.json").write_text(json.dumps(runs[name]))
PYEOF
  "$PY" -m qckpt plan "$lr" --nproc-per-node 1 --gpu-memory 139GiB --json "$RES/plan_load1.json" || rc=1
  "$PY" -m qckpt plan "$lr" --nproc-per-node 2 --set parallel.ep=2 --gpu-memory 139GiB \
    --json "$RES/plan_load2.json" || rc=1
  "$PY" -m qckpt plan configs/tiny-moe.yaml "${OFF_SETS[@]}" --nproc-per-node 1 \
    --gpu-memory 139GiB --json "$RES/plan_cal1.json" || rc=1
  "$PY" -m qckpt plan configs/tiny-moe.yaml "${OFF_SETS[@]}" --nproc-per-node 2 \
    --set parallel.ep=2 --gpu-memory 139GiB --json "$RES/plan_cal2.json" || rc=1
  "$PY" -m qckpt plan configs/tiny-moe.yaml "${OFF_SETS[@]}" --nproc-per-node 1 \
    --set calibrate.offload=layer --gpu-memory 20GiB --json "$RES/plan_off.json" || rc=1
  local pair
  for pair in "plan_load1 load measured_qckpt" "plan_load2 load measured_qckpt_ep2" \
    "plan_cal1 calibrate offload_ref_1gpu" "plan_cal2 calibrate offload_ref_ep2" \
    "plan_off calibrate offload_20g"; do
    set -- $pair
    if [[ -f "$RES/$1.json" && -f "$RES/$3.json" ]]; then
      echo "== $1 vs $3"
      "$PY" scripts/plan_vs_measured.py "$RES/$1.json" "$2" "$RES/$3.json" || rc=1
    else
      echo "== $1 vs $3: missing"
    fi
  done
  return $rc
}

# ---- the runner ---------------------------------------------------------------------------------

limit_of() {
  local s
  for s in "${STEPS[@]}"; do
    if [[ "${s%%:*}" == "$1" ]]; then echo "${s##*:}"; return 0; fi
  done
  return 1
}

run_step() {
  local name=$1 limit t0 rc
  limit=$(limit_of "$name") || { echo "unknown step: $name" | tee -a "$RES/summary.txt"; return; }
  echo "=== $name (limit ${limit}s)"
  t0=$(date +%s)
  # this script again, running that one step: a step's failure (or `exit`) cannot end the round
  timeout --kill-after=15 "$limit" bash "$SELF" --one "$name" >"$RES/$name.log" 2>&1
  rc=$?
  [[ $rc -eq 124 || $rc -eq 137 ]] && echo "(timed out after ${limit}s)" >>"$RES/$name.log"
  printf '%-12s rc=%-4s %5ss\n' "$name" "$rc" "$(($(date +%s) - t0))" | tee -a "$RES/summary.txt"
}

collect() {
  {
    cat "$RES/summary.txt"
    for f in "$RES"/*.log; do
      echo; echo "----- $(basename "$f") (last 40 lines)"; tail -n 40 "$f"
    done
  } >"$OUT/summary.txt"
  "$PY" - "$RES" "$OUT/results.json" <<'EOF'
import json, sys
from pathlib import Path
res, out = Path(sys.argv[1]), Path(sys.argv[2])
merged = {}
for f in sorted(res.glob("*.json")):
    try:
        merged[f.stem] = json.loads(f.read_text())
    except ValueError:
        merged[f.stem] = {"unreadable": f.read_text()[-2000:]}
out.write_text(json.dumps(merged, indent=2) + "\n")
EOF
  tar -czf "$OUT/round.tar.gz" -C "$WORK" results
}

if [[ "${1:-}" == "--collect" ]]; then collect; exit 0; fi
if [[ "${1:-}" == "--list" ]]; then printf '%s\n' "${STEPS[@]}"; exit 0; fi
if [[ "${1:-}" == "--one" ]]; then set -o pipefail; "step_$2"; exit $?; fi
echo "round $(date -u +%FT%TZ): ${*:-all steps}" >>"$RES/summary.txt"
if [[ $# -gt 0 ]]; then todo=("$@"); else todo=(); for s in "${STEPS[@]}"; do todo+=("${s%%:*}"); done; fi
for name in "${todo[@]}"; do run_step "$name"; done
collect
