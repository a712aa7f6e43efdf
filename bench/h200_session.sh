#!/usr/bin/env bash
# A device session's whole GPU round in calls of at most 600 s: the full `pytest tests/gpu` (one
# process, no -x, vLLM carried, the shared quality files present) and bench/h200_round.sh steps
# run in the background (setsid: they outlive a call while the machine stays warm, 30 s between
# calls), each call after the start waiting on them and sending back what they wrote so far.
#
#   call 1  carry [.vllm/c0]                                  bash .vllm/c0/stash.sh
#   call 2  carry [.vllm/c1]                                  bash .vllm/c1/stash.sh
#   call 3  carry [.vllm/c2, .quality]                        bash bench/h200_session.sh go
#   call 4+ (no carry)                                        bash bench/h200_session.sh wait 570
#
# .quality holds llama.tar.xz (the shared Llama's dir as llama/), data/{calib,heldout,train64}.bin.xz
# and train_textlm.py (the Qwen3-MoE is trained there by the round's moe_model step: its weights
# do not travel). Send each call as soon as the last returns. `go` installs vLLM, stages the
# files and starts; it then waits (up to START_WAIT s, default 420).
# Two GPUs: the tests take all of them (the two-GPU NCCL tests run) and the round's chains run on
# the second. One GPU: the chains run beside the tests on it (device time is what a session is
# short of; the tests' vLLM engines size their KV cache outright, so engines beside them start).
# CHAINS (default "moe_model quality_algos;ckpt_48l gptq_48l"): ';' between chains that run at
# the same time, steps of a chain in order. The 48-layer checkpoint goes to /dev/shm.
# What comes back ($OUT, 8 files): gpu.log, gpu-junit.xml, status.txt (each part's exit code),
# each chain's summary and results (chain-N-summary.txt, chain-N-results.json; the last chain's
# results are left out where 8 would be passed) and QUALITY.md once written.
set -u
Q=/tmp/shared/quality   # bench.quality's and the quality tests' default: ../shared/quality
REPO=/tmp/repo          # a copy: the next call replaces the working tree under the runs
S=/tmp/session
CHAINS=${CHAINS:-moe_model quality_algos;ckpt_48l gptq_48l}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

install() {
  bash .vllm/c2/stash.sh && bash .vllm/c2/install.sh
}

stage() {
  [ -d /tmp/site/vllm ] || { echo "no vLLM in /tmp/site: the install call did not run"; return 1; }
  mkdir -p "$Q/models"
  rm -rf "$Q/models/llama-textlm" "$Q/models/llama"
  tar -xJf .quality/llama.tar.xz -C "$Q/models" && mv "$Q/models/llama" "$Q/models/llama-textlm"
  local f
  for f in calib heldout train64; do xz -dc ".quality/data/$f.bin.xz" >"$Q/$f.bin" || return 1; done
  cp .quality/train_textlm.py "$Q/"
  rm -rf "$REPO" && mkdir -p "$REPO"
  tar --exclude=./.quality --exclude=./.vllm -cf - . | tar -xf - -C "$REPO"
}

start() {
  stage || return 1
  mkdir -p "$S"
  local gpus tests env chain n=0 where=""
  gpus=$(nvidia-smi -L | wc -l)
  [ "$gpus" -ge 2 ] && where="QCKPT_ROUND_GPU=1 CUDA_VISIBLE_DEVICES=1"
  env="cd $REPO && export PYTHONPATH=$REPO QCKPT_QUALITY=$Q QCKPT_VLLM_SITE=/tmp/site \
    QCKPT_CKPT48=${QCKPT_CKPT48:-/dev/shm/qwen3-30b-a3b} GPTQ_OUT=${GPTQ_OUT:-} PYTHONUNBUFFERED=1 QCKPT_VLLM_LOCK=/tmp/qckpt-vllm.lock"
  tests="python3 -m pytest tests/gpu -q -rs --durations=25 -p no:cacheprovider \
    --junitxml=$S/gpu-junit.xml >$S/gpu.log 2>&1; echo \$? >$S/gpu.rc"
  # TESTS_AFTER=FILE: the tests wait (up to 600 s) for a chain to make it, e.g. the 48-layer
  # checkpoint, which transformers builds on the GPU (61 GB) before anything else may share it
  [ -n "${TESTS_AFTER:-}" ] && tests="for i in \$(seq 120); do [ -e $TESTS_AFTER ] && break; \
    sleep 5; done; $tests"
  setsid nohup bash -c "$env && $tests" >/dev/null 2>&1 </dev/null &
  IFS=';' read -ra chains <<<"$CHAINS"
  for chain in "${chains[@]}"; do
    n=$((n + 1))
    setsid nohup bash -c "$env && $where OUT=$S/chain-$n bash bench/h200_round.sh $chain \
      >$S/chain-$n.log 2>&1; echo \$? >$S/chain-$n.rc" >/dev/null 2>&1 </dev/null &
  done
  echo "$n" >"$S/chains"
  echo "started on $gpus GPU(s): pytest tests/gpu; chains: $CHAINS"
  wait_for "${START_WAIT:-420}"
}

send_back() {
  local n i
  n=$(cat "$S/chains" 2>/dev/null || echo 0)
  for f in gpu.log gpu-junit.xml; do [ -e "$S/$f" ] && cp "$S/$f" "$OUT/"; done
  {
    echo "tests: $(cat "$S/gpu.rc" 2>/dev/null || echo running)"
    for i in $(seq "$n"); do echo "chain $i: $(cat "$S/chain-$i.rc" 2>/dev/null || echo running)"; done
    df -h /dev/shm /tmp 2>/dev/null; nvidia-smi --query-gpu=memory.used --format=csv 2>/dev/null
  } >"$OUT/status.txt"
  for i in $(seq "$n"); do
    # a chain still running has not collected: its summary so far, from the shared results dir
    OUT="$S/chain-$i" bash bench/h200_round.sh --collect >/dev/null 2>&1
    [ -e "$S/chain-$i/summary.txt" ] && cp "$S/chain-$i/summary.txt" "$OUT/chain-$i-summary.txt"
  done
  [ -e "$S/chain-1/results.json" ] && cp "$S/chain-1/results.json" "$OUT/results.json"
  [ -e /tmp/qckpt-round/results/QUALITY.md ] && cp /tmp/qckpt-round/results/QUALITY.md "$OUT/"
  return 0
}

ended() {  # the tests and every chain
  local n i
  [ -e "$S/gpu.rc" ] || return 1
  n=$(cat "$S/chains" 2>/dev/null || echo 0)
  for i in $(seq "$n"); do [ -e "$S/chain-$i.rc" ] || return 1; done
}

wait_for() {  # up to $1 seconds, until the tests and the chains have ended
  local end=$(($(date +%s) + $1))
  while [ "$(date +%s)" -lt "$end" ]; do
    ended && break
    sleep 10
  done
  echo "--- pytest tests/gpu: $([ -e "$S/gpu.rc" ] && echo "ended, rc $(cat "$S/gpu.rc")" || echo running)"
  tail -n 5 "$S/gpu.log" 2>/dev/null
  echo "--- round"
  cat /tmp/qckpt-round/results/summary.txt 2>/dev/null | tail -n 12
  tail -n 3 /tmp/qckpt-round/results/gptq_48l.log /tmp/qckpt-round/results/gptq_off_48l.log 2>/dev/null
  ended && echo "all done"
  send_back
}

case "${1:-}" in
  go) install && start ;;
  install) install ;;
  start) start ;;
  wait) wait_for "${2:-570}" ;;
  *) echo "usage: bash bench/h200_session.sh go | install | start | wait [SECONDS]" >&2; exit 2 ;;
esac
