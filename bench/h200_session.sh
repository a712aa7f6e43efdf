#!/usr/bin/env bash
# A device session's whole GPU round in calls of at most 600 s: the full `pytest tests/gpu` (one
# process, no -x, vLLM carried, the shared quality models present) and bench/h200_round.sh steps
# run in the background (setsid: they outlive a call while the machine stays warm, 30 s between
# calls), each call after the start waiting on them and sending back what they wrote so far.
#
#   call 1  carry [.vllm/c0]                                  bash .vllm/c0/stash.sh
#   call 2  carry [.vllm/c1]                                  bash .vllm/c1/stash.sh
#   call 3  carry [.vllm/c2, .quality/qwen3moe-textlm]        bash bench/h200_session.sh install
#   call 4  carry [.quality/llama.tar.xz, .quality/data]      bash bench/h200_session.sh start
#   call 5+ (no carry)                                        bash bench/h200_session.sh wait 570
#
# Send each call as soon as the last returns. `start` also waits (up to START_WAIT s, default
# 480). With two GPUs the tests take all of them (the two-GPU NCCL tests run) and the round's
# one-GPU steps run on the second at the same time; with one GPU the round starts when the tests
# end. ROUND_STEPS (default: ckpt_48l gptq_48l quality_algos) names the round's steps.
# What comes back ($OUT): gpu.log, gpu-junit.xml, gpu.rc, and the round's summary.txt,
# results.json, round.tar.gz and QUALITY.md once written.
set -u
Q=/tmp/shared/quality   # bench.quality's and the quality tests' default: ../shared/quality
REPO=/tmp/repo          # a copy: the next call replaces the working tree under the runs
S=/tmp/session
ROUND_STEPS=${ROUND_STEPS:-ckpt_48l gptq_48l quality_algos}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

install() {
  bash .vllm/c2/stash.sh && bash .vllm/c2/install.sh || return 1
  mkdir -p "$Q/models" && cp -r .quality/qwen3moe-textlm "$Q/models/"
}

stage() {
  [ -d /tmp/site/vllm ] || { echo "no vLLM in /tmp/site: the install call did not run"; return 1; }
  [ -d "$Q/models/qwen3moe-textlm" ] || { echo "no $Q/models/qwen3moe-textlm"; return 1; }
  rm -rf "$Q/models/llama-textlm" "$Q/models/llama"
  tar -xJf .quality/llama.tar.xz -C "$Q/models" && mv "$Q/models/llama" "$Q/models/llama-textlm"
  local f
  for f in calib heldout; do xz -dc ".quality/data/$f.bin.xz" >"$Q/$f.bin" || return 1; done
  rm -rf "$REPO" && mkdir -p "$REPO"
  tar --exclude=./.quality --exclude=./.vllm -cf - . | tar -xf - -C "$REPO"
}

start() {
  stage || return 1
  mkdir -p "$S"
  local gpus tests round
  gpus=$(nvidia-smi -L | wc -l)
  tests="python3 -m pytest tests/gpu -q -rs --durations=25 -p no:cacheprovider \
    --junitxml=$S/gpu-junit.xml >$S/gpu.log 2>&1; echo \$? >$S/gpu.rc"
  round="OUT=$S/round-out bash bench/h200_round.sh $ROUND_STEPS >$S/round.log 2>&1; \
    echo \$? >$S/round.rc"
  if [ "$gpus" -ge 2 ]; then
    round="QCKPT_ROUND_GPU=1 CUDA_VISIBLE_DEVICES=1 $round"
  else
    round="until [ -e $S/gpu.rc ]; do sleep 5; done; $round"
  fi
  local env="cd $REPO && export PYTHONPATH=$REPO QCKPT_QUALITY=$Q QCKPT_VLLM_SITE=/tmp/site \
    PYTHONUNBUFFERED=1"
  setsid nohup bash -c "$env && $tests" >/dev/null 2>&1 </dev/null &
  setsid nohup bash -c "$env && $round" >/dev/null 2>&1 </dev/null &
  echo "started on $gpus GPU(s): pytest tests/gpu; round: $ROUND_STEPS"
  wait_for "${START_WAIT:-480}"
}

send_back() {
  local f
  for f in gpu.log gpu-junit.xml gpu.rc round.rc; do [ -e "$S/$f" ] && cp "$S/$f" "$OUT/"; done
  for f in summary.txt results.json round.tar.gz; do
    [ -e "$S/round-out/$f" ] && cp "$S/round-out/$f" "$OUT/round-$f"
  done
  [ -e /tmp/qckpt-round/results/QUALITY.md ] && cp /tmp/qckpt-round/results/QUALITY.md "$OUT/"
  return 0
}

wait_for() {  # up to $1 seconds, until both the tests and the round have ended
  local end=$(($(date +%s) + $1))
  while [ "$(date +%s)" -lt "$end" ]; do
    [ -e "$S/gpu.rc" ] && [ -e "$S/round.rc" ] && break
    sleep 10
  done
  echo "--- pytest tests/gpu: $([ -e "$S/gpu.rc" ] && echo "ended, rc $(cat "$S/gpu.rc")" || echo running)"
  tail -n 5 "$S/gpu.log" 2>/dev/null
  echo "--- round: $([ -e "$S/round.rc" ] && echo "ended, rc $(cat "$S/round.rc")" || echo running)"
  cat /tmp/qckpt-round/results/summary.txt 2>/dev/null | tail -n 8
  [ -e "$S/gpu.rc" ] && [ -e "$S/round.rc" ] && echo "all done"
  send_back
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  wait) wait_for "${2:-570}" ;;
  *) echo "usage: bash bench/h200_session.sh install | start | wait [SECONDS]" >&2; exit 2 ;;
esac
