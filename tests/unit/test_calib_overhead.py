"""What the calibration instrumentation adds to a forward: aten ops and host syncs per layer.

A GPU calibration forward is bound by kernel launches and host syncs, not FLOPs, so the
instrumented grouped forward must add a few ops per decoder layer, however many experts there
are (a per-expert Python loop or hook adds one op or more per expert), and no host sync. The
counts come from a dispatch mode on CPU: the same ops a GPU forward launches (the CPU's own
activation per expert, which exactness needs there, set aside: ``ELEMENTWISE_ALIKE``).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from qckpt.calib import moe_forward
from qckpt.calib.instrument import insert_quantizers, remove_quantizers, settle
from qckpt.calib.quantizer import AmaxStore, TensorQuantizer
from qckpt.errors import CalibrationError
from qckpt.recipe import QuantConfig

# measured: 10 extra ops per layer at top-k 4 (4 of them: the combine adds a token's k slots
# one bf16 addition at a time, as the eager loop does); the old forward added 71 and one sync
EXTRA_OPS_BOUND = 14
# what makes the host wait for a CUDA device (bincount reads its input's max on the host)
SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "_unique2", "item"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.syncs += func.overloadpacket.__name__ in SYNCS
        return func(*args, **(kwargs or {}))


def _model(layers: int, experts: int):
    cfg = Qwen3MoeConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_experts=experts, num_experts_per_tok=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=128, max_position_embeddings=64, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.set_experts_implementation("grouped_mm")  # transformers' own grouped forward
    return model


def _count(model, batch, instrumented: bool) -> tuple[int, int]:
    if instrumented:
        insert_quantizers(model, QuantConfig(), moe_forward="grouped")
    try:
        with torch.no_grad():
            model(input_ids=batch, use_cache=False)  # lazy accumulators made: steady state
            with _Count() as c:
                model(input_ids=batch, use_cache=False)
            if instrumented:
                settle(model)
    finally:
        remove_quantizers(model)
    return c.ops, c.syncs


def _extra_per_layer(experts: int) -> tuple[int, int]:
    batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    per = {}
    for instrumented in (False, True):
        one = _count(_model(1, experts), batch, instrumented)
        two = _count(_model(2, experts), batch, instrumented)
        per[instrumented] = (two[0] - one[0], two[1] - one[1])
    return per[True][0] - per[False][0], per[True][1]


def test_instrumented_grouped_forward_adds_few_ops_per_layer_and_no_sync(monkeypatch):
    # count the ops of CUDA's grouped forward: its activation is one kernel over all rows
    monkeypatch.setattr(moe_forward, "ELEMENTWISE_ALIKE", {"cuda", "cpu"})
    ops16, syncs16 = _extra_per_layer(16)
    ops64, syncs64 = _extra_per_layer(64)
    assert ops16 == ops64  # nothing per expert
    assert 0 < ops64 <= EXTRA_OPS_BOUND
    assert syncs16 == syncs64 == 0


def _pair():
    store = AmaxStore()
    a, b = (TensorQuantizer(n, "input", shape=(4,), store=store) for n in ("a", "b"))
    return a, b


def test_a_shared_input_changed_in_place_between_hooks_is_reduced_again():
    a, b = _pair()
    x = torch.tensor([1.0, -3.0, 2.0, 0.5])
    a.observe(x)
    b.observe(x)  # the same tensor, unchanged: a's reduction reused
    x.mul_(2)
    b.observe(x)  # changed in place since: reduced again
    assert a.amax.item() == 3.0 and b.amax.item() == 6.0


def test_setting_an_amax_comes_after_what_the_hooks_deferred():
    a, b = _pair()
    a.observe(torch.full((4,), 5.0))
    a.reset()  # the deferred 5.0 is folded first, then forgotten
    assert a.amax is None
    b.observe(torch.tensor([1.0, float("inf"), 0.0, 0.0]))
    with pytest.raises(CalibrationError, match=r"^b: non-finite input"):
        b.amax  # noqa: B018 - reading settles


def test_deferred_hook_amaxes_equal_collect_bit_for_bit():
    # what observe() defers and folds at settle is what collect() folds at once: values and
    # dtypes, over mixed input and calibrator dtypes, repeated, shared and empty inputs
    g = torch.Generator().manual_seed(3)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    stores = AmaxStore(), AmaxStore()
    made = [
        [TensorQuantizer(f"m{i}", "input", shape=(8,), store=s, calib_dtype=dtypes[i % 3])
         for i in range(6)]
        for s in stores
    ]  # fmt: skip
    for step in range(40):
        x = (torch.randn(3, 8, generator=g, dtype=torch.float64) * 1e3).to(dtypes[step % 3])
        if step == 7:
            x = x[:0]  # an empty input: amax 0
        for i in torch.randint(0, 6, (3,), generator=g).tolist():
            made[0][i].collect(x, check=False)
            made[1][i].observe(x)
    for eager, deferred in zip(*made, strict=True):
        a, b = eager.amax, deferred.amax
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)
            # the bank's float32 value too (the sync packs it as it is)
            assert torch.equal(eager.bank.values[eager.slot], deferred.bank.values[deferred.slot])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_triton_combine_adds_as_the_torch_loop_bit_for_bit_in_the_interpreter():
    # the kernel the grouped forward uses on CUDA, run by Triton's CPU interpreter (chosen when
    # triton is imported: a subprocess), against the torch loop; -0, subnormals, inf, NaN, and
    # sums that overflow included
    script = Path(__file__).with_name("_combine_interpret_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(out) == 9
    assert all(n == 0 for n in out.values()), out
