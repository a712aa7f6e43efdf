"""Calibration forward speed: the plain forward beside the instrumented ones, same model and data.

    python -m bench.calibrate_speed forward --preset tiny                      # CPU, seconds
    python -m bench.calibrate_speed forward --preset qwen3-30b-a3b --device cuda --json f.json
    python -m bench.calibrate_speed dp RECIPE --nproc 2 --json dp.json [--set key=value ...]
    python -m bench.calibrate_speed ops [--experts 128 --top-k 8]              # CPU, seconds

``forward`` builds a Qwen3-MoE-shaped model from its config with random BF16 weights on the
device (no checkpoint: the speed does not depend on the values; ``--checkpoint DIR`` loads a
checkpoint instead) and times, on the same token batches, one after the other:

* ``plain_eager``: the model as transformers runs it with ``experts_implementation="eager"``;
* ``plain_grouped``: the same with transformers' ``grouped_mm`` experts (its default);
* ``instr_eager``: quantizers in (``calibrate.moe_forward: eager``), the forwards, the settle
  that folds the deferred amaxes in (one host sync) — what ``calibrate`` runs per batch;
* ``instr_grouped``: the same with ``calibrate.moe_forward: grouped``;
* ``instr_auto``: the same with ``calibrate.moe_forward: auto``, the default (what it chose is
  printed; its once-per-process check made again: the verdicts forgotten first).

Each: one warm-up batch, then every batch, synchronized, best of ``--repeats``; tokens/s. The
warm-up of an instrumented variant's first repeat is timed too (``first_batch_seconds``: auto's
check, the Triton combine's compile on CUDA, cuBLAS's first calls) and
``tokens_per_s_with_first`` counts it with the batches: what one process pays. The
ratios: instr_eager / plain_eager and instr_grouped / plain_grouped time (target <= 1.15),
instr_grouped / instr_eager tokens/s (target >= 3). Then the amaxes of the two instrumented
runs compared: bit-identical or not, per kind (dense inputs, experts' gate_up inputs, down_proj
inputs), the first MoE layer's expert inputs apart (the same hidden states reach them), and the
largest relative difference.

``dp`` runs ``python -m qckpt calibrate RECIPE --json`` as a whole process with 1 rank, then
with ``--nproc-per-node N`` (same recipe and data: the batches are split over the ranks), on
the workload :data:`WORKLOAD` (512 samples x 2,048 tokens unless ``--set`` says otherwise),
and prints each fixed cost beside the other run's (the phases of the slowest rank; inside the
forward: quantizers in, weight amaxes, the first batch, the other batches, the settle), the
scaling ratios (targets: forward >= 1.9x, whole command >= 1.8x on 2 GPUs), whether both
wrote the same file, and how long the batches would have to run for the whole command to
reach 1.8x at the measured fixed costs. ``--nproc 1`` runs the one-process side alone (a
machine of one GPU): its fixed costs and its batches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.whole_command import PRESETS as WHOLE_PRESETS

PRESETS = {
    # Qwen3-30B-A3B's shape: the one bench.whole_command makes checkpoints of
    "qwen3-30b-a3b": {**WHOLE_PRESETS["qwen3-30b-a3b"], "norm_topk_prob": True},
    "tiny": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=512,
        norm_topk_prob=True,
    ),  # fmt: skip
}
VARIANTS = ("plain_eager", "plain_grouped", "instr_eager", "instr_grouped", "instr_auto")


def _model(args):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    dev = torch.device(args.device)
    if args.checkpoint:
        return AutoModelForCausalLM.from_pretrained(
            args.checkpoint, dtype=torch.bfloat16, device_map=str(dev)
        ).eval()
    fields = dict(PRESETS[args.preset])
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    cfg = Qwen3MoeConfig(**fields)
    torch.manual_seed(args.seed)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def _experts_impl(model, name: str) -> None:
    """transformers' own experts forward for the plain runs (older versions: the config key)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(name)
    else:
        model.config._experts_implementation = name


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(model, batches, variant: str, repeats: int) -> tuple[float, dict, dict]:
    """Best wall seconds over ``repeats`` of every batch's forward; amaxes of the last repeat;
    the first repeat's warm-up seconds and (instrumented) which experts forward ran."""
    import torch

    from qckpt.calib.instrument import insert_quantizers, instrumentation, remove_quantizers, settle
    from qckpt.calib.moe_forward import forget_verdicts
    from qckpt.recipe import QuantConfig

    kind, moe = variant.split("_")
    dev = next(model.parameters()).device
    _experts_impl(model, "eager" if moe == "eager" else "grouped_mm")
    best, amax, extra = float("inf"), {}, {}
    for rep in range(repeats):
        if kind == "instr":
            if moe == "auto" and rep == 0:
                forget_verdicts()  # its check is what a process pays once: timed below
            qs = insert_quantizers(model, QuantConfig(), moe_forward=moe)
        with torch.no_grad():
            _sync(dev)
            t0 = time.perf_counter()
            model(input_ids=batches[0], use_cache=False)  # warm-up (kernels, allocator)
            if kind == "instr":  # the warm-up's amaxes: forget them
                settle(model)
                extra["moe_forward"] = instrumentation(model).moe.report(True)
                for q in qs.values():
                    q.reset()
            _sync(dev)
            if rep == 0:
                extra["first_batch_seconds"] = round(time.perf_counter() - t0, 4)
            t0 = time.perf_counter()
            for b in batches:
                model(input_ids=b, use_cache=False)
            if kind == "instr":
                settle(model)
            _sync(dev)
            best = min(best, time.perf_counter() - t0)
        if kind == "instr":
            amax = {k: q.amax.float().cpu() for k, q in qs.items() if q.amax is not None}
            remove_quantizers(model)
    return best, amax, extra


def _compare(a: dict, b: dict, first_moe: str) -> dict:
    """Bit equality and the largest relative difference of two amax maps, per kind."""
    import torch

    def kind(k: str) -> str:
        if ".experts." not in k:
            return "dense"
        part = "down_input" if ".down_proj.input" in k else "gate_up_input"
        return f"{part}_first_moe" if k.startswith(first_moe) else part

    out: dict = {}
    for k in sorted(set(a) | set(b)):
        row = out.setdefault(kind(k), {"n": 0, "identical": 0, "max_rel_diff": 0.0, "missing": 0})
        row["n"] += 1
        if k not in a or k not in b:
            row["missing"] += 1
            continue
        if torch.equal(a[k], b[k]):
            row["identical"] += 1
        else:
            rel = ((a[k] - b[k]).abs() / a[k].abs().clamp_min(1e-30)).max().item()
            row["max_rel_diff"] = max(row["max_rel_diff"], rel)
    return out


def forward(args) -> dict:
    import torch

    model = _model(args)
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(args.seed + 1)
    vocab = model.config.vocab_size
    shape = (args.batch_size, args.seq_len)
    batches = [torch.randint(0, vocab, shape, generator=g).to(dev) for _ in range(args.batches)]
    tokens = args.batches * args.batch_size * args.seq_len
    res: dict = {"device": str(dev), "tokens": tokens, "layers": model.config.num_hidden_layers}
    if dev.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(dev)
    amax = {}
    for v in args.variants.split(","):
        secs, amax[v], extra = _time(model, batches, v, args.repeats)
        res[v] = {"seconds": round(secs, 4), "tokens_per_s": round(tokens / secs, 1), **extra}
        first = extra["first_batch_seconds"]
        with_first = (tokens + batches[0].numel()) / (secs + first)
        res[v]["tokens_per_s_with_first"] = round(with_first, 1)
        used = extra.get("moe_forward", {}).get("used")
        how = f"  ({used}{': ' + extra['moe_forward']['why'] if used == 'eager' else ''})"
        print(
            f"{v:14s} {secs:9.3f} s {tokens / secs:12.1f} tokens/s   first batch {first:.3f} s,"
            f" {with_first:10.1f} tokens/s with it" + (how if v == "instr_auto" else ""),
            flush=True,
        )
    sec = {v: res[v]["seconds"] for v in VARIANTS if v in res}
    ratios = {}
    for num, den in (("instr_eager", "plain_eager"), ("instr_grouped", "plain_grouped"),
                     ("instr_eager", "plain_grouped"), ("plain_eager", "plain_grouped")):  # fmt: skip
        if num in sec and den in sec:
            ratios[f"{num}/{den}_time"] = round(sec[num] / sec[den], 3)
    if "instr_eager" in sec and "instr_grouped" in sec:
        ratios["instr_grouped/instr_eager_speed"] = round(
            sec["instr_eager"] / sec["instr_grouped"], 3
        )
        first = next(n for n, _ in model.named_modules() if n.endswith("mlp.experts"))
        res["amax_grouped_vs_eager"] = _compare(amax["instr_eager"], amax["instr_grouped"], first)
    if "instr_eager" in sec and "instr_auto" in sec:
        ratios["instr_auto/instr_eager_speed"] = round(sec["instr_eager"] / sec["instr_auto"], 3)
        first = next(n for n, _ in model.named_modules() if n.endswith("mlp.experts"))
        res["amax_auto_vs_eager"] = _compare(amax["instr_eager"], amax["instr_auto"], first)
    res["ratios"] = ratios
    amaxes = {k: res[k] for k in ("amax_grouped_vs_eager", "amax_auto_vs_eager") if k in res}
    print(json.dumps({"ratios": ratios, **amaxes}, indent=1))
    return res


# ops that make the host wait for the device on CUDA: a scalar read, a data-dependent output
# shape (nonzero and what calls it), bincount (CUDA reads the input's max to size its output)
SYNC_OPS = frozenset(
    ("_local_scalar_dense", "nonzero", "masked_select", "bincount", "_unique2", "unique_dim",
     "unique_consecutive", "repeat_interleave", "item", "equal", "is_nonzero")
)  # fmt: skip


class _OpCounter:
    """A dispatch mode counting aten ops by name, and host syncs (:data:`SYNC_OPS`, a boolean
    mask index, ``.tolist()``)."""

    def __new__(cls):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class Count(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.by_op: dict[str, int] = {}
                self.syncs = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                self.by_op[name] = self.by_op.get(name, 0) + 1
                self.syncs += name in SYNC_OPS
                if name == "index" and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
                ):  # a boolean mask index: nonzero underneath
                    self.syncs += 1
                return func(*args, **(kwargs or {}))

            def __enter__(self):
                self._tolist = tolist = torch.Tensor.tolist

                def counted(t):  # on CUDA a device-to-host read
                    self.syncs += 1
                    return tolist(t)

                torch.Tensor.tolist = counted
                return super().__enter__()

            def __exit__(self, *exc):
                torch.Tensor.tolist = self._tolist
                return super().__exit__(*exc)

        return Count()


def _op_counts(model, batch, variant: str) -> tuple[dict, dict]:
    """aten ops (by name) and host syncs of one forward of ``variant``, and of the settle that
    follows it (instrumented variants; a calibration settles once, here after two forwards)."""
    import torch

    from qckpt.calib.instrument import insert_quantizers, remove_quantizers, settle
    from qckpt.recipe import QuantConfig

    kind, moe = variant.split("_")
    _experts_impl(model, "eager" if moe == "eager" else "grouped_mm")
    if kind == "instr":
        insert_quantizers(model, QuantConfig(), moe_forward=moe)
    out = {}
    try:
        with torch.no_grad():
            # warm-up: the accumulators a calibration makes once (until it settles) are made
            model(input_ids=batch, use_cache=False)
            for phase in ("forward", "settle"):
                with _OpCounter() as c:
                    if phase == "forward":
                        model(input_ids=batch, use_cache=False)
                    elif kind == "instr":
                        settle(model)
                out[phase] = {"ops": sum(c.by_op.values()), "syncs": c.syncs, "by_op": c.by_op}
    finally:
        if kind == "instr":
            remove_quantizers(model)
    return out["forward"], out["settle"]


def ops(args) -> dict:
    """Per decoder layer: aten ops and host syncs the instrumentation adds to one forward (the
    count at ``layers + 1`` minus the count at ``layers``), on a small Qwen3-MoE on CPU. A GPU
    forward of this size is bound by launches and syncs, not FLOPs: these are what it pays."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    fields = dict(PRESETS["tiny"], num_experts=args.experts, num_experts_per_tok=args.top_k)
    g = torch.Generator().manual_seed(args.seed + 1)
    batch = torch.randint(0, fields["vocab_size"], (args.batch_size, args.seq_len), generator=g)
    variants = args.variants.split(",")
    counts: dict = {}
    for n in (args.layers, args.layers + 1):
        torch.manual_seed(args.seed)
        cfg = Qwen3MoeConfig(**{**fields, "num_hidden_layers": n})
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        for v in variants:
            counts[(n, v)] = _op_counts(model, batch, v)
    res: dict = {"experts": args.experts, "top_k": args.top_k, "tokens": batch.numel()}
    n0, n1 = args.layers, args.layers + 1
    for v in variants:
        (f0, s0), (f1, _) = counts[(n0, v)], counts[(n1, v)]
        ops1 = {k: n - f0["by_op"].get(k, 0) for k, n in f1["by_op"].items()}
        res[v] = {
            "ops_per_layer": f1["ops"] - f0["ops"],
            "syncs_per_layer": f1["syncs"] - f0["syncs"],
            "by_op_per_layer": {k: n for k, n in sorted(ops1.items()) if n},
            f"settle_{n0}_layers": {k: s0[k] for k in ("ops", "syncs")},
        }
        r = res[v]
        print(
            f"{v:14s} per layer: {r['ops_per_layer']:5d} ops {r['syncs_per_layer']:4d} syncs"
            f"   settle ({n0} layers): {r[f'settle_{n0}_layers']}"
        )
    for moe in ("eager", "grouped"):
        p, i = res.get(f"plain_{moe}"), res.get(f"instr_{moe}")
        if p and i:
            names = set(p["by_op_per_layer"]) | set(i["by_op_per_layer"])
            diff = {
                k: i["by_op_per_layer"].get(k, 0) - p["by_op_per_layer"].get(k, 0) for k in names
            }
            res[f"extra_{moe}"] = {
                "ops_per_layer": i["ops_per_layer"] - p["ops_per_layer"],
                "syncs_per_layer": i["syncs_per_layer"] - p["syncs_per_layer"],
                "by_op": {k: n for k, n in sorted(diff.items()) if n},
            }
            print(f"extra_{moe}: {json.dumps(res[f'extra_{moe}'])}")
    return res


# the calibration workload of ``dp`` (issue 18 is silent on it): what a user calibrating a 30B
# MoE runs, 512 samples of 2,048 tokens (llm-compressor's and ModelOpt's MoE examples use a few
# hundred samples of 512-2,048 tokens), 8 samples a batch; ``--set calibrate.data.*`` overrides
WORKLOAD = {"num_samples": 512, "seq_len": 2048, "batch_size": 8}
PHASES = ("startup", "world", "build", "read", "data", "forward", "sync", "write", "report")
# the forward's parts (they add up to the forward phase), then two figures inside them:
# first_batch_host (the first batch until its forward returned) and second_batch (in batches)
PARTS = ("insert", "weight_amax", "first_batch", "batches", "settle", "after_sync")
INSIDE = ("first_batch_host", "second_batch")
WHOLE_TARGET, FORWARD_TARGET = 1.8, 1.9


def _calibrate(recipe: str, sets: list[str], nproc: int, tmp: Path) -> dict:
    js = tmp / f"calib-{nproc}.json"
    cmd = [sys.executable, "-m", "qckpt", "calibrate", recipe, "--json", str(js)]
    if nproc > 1:  # the CLI's own launcher, as a user runs it
        cmd += ["--nproc-per-node", str(nproc)]
    for s in [*sets, f"calibrate.output={tmp / f'calib-{nproc}.safetensors'}"]:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    wall, ended = time.perf_counter() - t0, time.time()
    if r.returncode != 0 or not js.is_file():
        return {"error": f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-600:]}"}
    rep = json.loads(js.read_text())
    file = tmp / f"calib-{nproc}.safetensors"
    return {
        "wall_seconds": round(wall, 3),
        # from the main rank's --json (written at the end of the report phase) to the exit of
        # the command: the world's teardown, the interpreters' and CUDA's exits, the launcher
        "after_report_seconds": round(ended - js.stat().st_mtime, 3),
        "forward_seconds": _forward_seconds(rep),
        "phases": _slowest_phases(rep),
        "forward_parts": _slowest_parts(rep),
        "per_rank": [
            {k: r.get(k) for k in ("rank", "forward_parts", "tokens_this_rank", "read")}
            for r in rep.get("ranks") or []
        ],
        "weight_amax_here": rep.get("weight_amax_here"),
        "tokens_this_rank": rep.get("tokens_this_rank"),
        "file_digest": _content_digest(file),
        "report": rep,
    }


def _content_digest(path: Path) -> str:
    """A digest of a calibration file's tensors (names, dtypes, shapes, bytes) and metadata,
    sorted: safetensors writes the metadata's keys in a per-process order, so the raw bytes
    of two equal files can differ."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(path), "pt") as f:
        h.update(json.dumps(f.metadata(), sort_keys=True).encode())
        for k in sorted(f.keys()):
            t = f.get_tensor(k).contiguous()
            h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _forward_seconds(rep: dict) -> float | None:
    """The calibration forward's seconds in a calibrate --json report (wherever it sits)."""
    stack = [rep]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            if "forward_seconds" in d:
                return d["forward_seconds"]
            stack.extend(d.values())
    return None


def _slowest_phases(rep: dict) -> dict:
    """Each phase's seconds, the slowest rank's (the one the others wait for)."""
    rows = [r.get("phases") or {} for r in rep.get("ranks") or []] or [rep.get("phases") or {}]
    return {k: max(r.get(k, 0.0) for r in rows) for k in (*PHASES, "total")}


def _slowest_parts(rep: dict) -> dict:
    """Each part of the forward (quantizers in, weight amaxes, ...), the slowest rank's."""
    rows = [r.get("forward_parts") for r in rep.get("ranks") or []]
    rows = [r for r in rows if r] or [rep.get("forward_parts") or {}]
    return {k: max(r.get(k, 0.0) for r in rows) for k in rows[0]}


def _scaling(one: dict, many: dict, nproc: int) -> dict:
    """Ratios, fixed costs, and the forward a run would need for the whole-command target.

    The batches (first one included) are the work that divides over ranks; everything else in
    the wall time is a fixed cost of that run. With the same per-batch scaling, a calibration k
    times as long takes ``fixed + k * batches``; the whole-command ratio reaches the target at
    ``k >= (T * fixed_N - fixed_1) / (batches_1 - T * batches_N)`` (never, when the batches
    scale by no more than T).
    """
    b1, bn = _batches_seconds(one), _batches_seconds(many)
    f1, fn = one["wall_seconds"] - b1, many["wall_seconds"] - bn
    res = {
        "whole_speedup": round(one["wall_seconds"] / many["wall_seconds"], 3),
        "forward_speedup": round(one["phases"]["forward"] / many["phases"]["forward"], 3),
        "batches_speedup": round(b1 / bn, 3) if bn else None,
        "fixed_seconds": {"one": round(f1, 3), f"nproc{nproc}": round(fn, 3)},
        "same_file": one["file_digest"] == many["file_digest"],
    }
    res["whole_target_needs"] = _needs(one, b1, bn, f1, fn)
    # the same if the batches divided exactly over the ranks (fixed costs as measured)
    res["whole_target_needs_if_batches_scaled_nproc_x"] = _needs(one, b1, b1 / nproc, f1, fn)
    return res


def _batches_seconds(run: dict) -> float:
    """The batches' seconds (first one included) of the rank that ran them longest: with the
    batches dealt as the ranks come free, the ranks' first and other batches differ apart."""
    rows = [r.get("forward_parts") for r in run.get("per_rank") or []]
    rows = [r for r in rows if r] or [run["forward_parts"]]
    return max(r.get("first_batch", 0.0) + r.get("batches", 0.0) for r in rows)


def _needs(one: dict, b1: float, bn: float, f1: float, fn: float):
    """How much longer the batches must run for the whole command to reach the target."""
    t = WHOLE_TARGET
    if not bn or b1 <= t * bn:
        return f"unreachable: the batches scale {b1 / bn if bn else 0:.2f}x"
    k = max(0.0, (t * fn - f1) / (b1 - t * bn))
    return {
        "forward_batches_seconds_one_gpu": round(k * b1, 1),
        "tokens": int((one.get("tokens_this_rank") or 0) * k),
        "times_this_workload": round(k, 2),
    }


def _table(one: dict, many: dict, nproc: int) -> None:
    """The fixed costs beside each other: phases (slowest rank), then the forward's parts."""
    print(f"{'seconds':30s} {'1 process':>10s} {f'{nproc} ranks':>10s}")
    print(f"{'whole command':30s} {one['wall_seconds']:10.2f} {many['wall_seconds']:10.2f}")
    for k in PHASES:
        print(f"{k:30s} {one['phases'][k]:10.2f} {many['phases'][k]:10.2f}")
    a, b = one["after_report_seconds"], many["after_report_seconds"]
    print(f"{'after the report (exit)':30s} {a:10.2f} {b:10.2f}")
    for k in PARTS + INSIDE:
        a, b = one["forward_parts"].get(k), many["forward_parts"].get(k)
        if a is not None and b is not None:
            label = ("  forward: " if k in PARTS else "    of which ") + k
            print(f"{label:30s} {a:10.2f} {b:10.2f}")


def _ranks_table(many: dict) -> None:
    """Each rank of the DP run: batches it ran (dealt as the ranks came free), its forward's
    work, its read split into its own share and the broadcasts, its wait in the sync."""
    for r in many.get("per_rank") or []:
        row = next((x for x in many["report"].get("ranks") or [] if x.get("rank") == r["rank"]), {})
        fp, rd, ph = r.get("forward_parts") or {}, r.get("read") or {}, row.get("phases") or {}
        print(
            f"rank {r['rank']}: batches {row.get('batches', '?')} in "
            f"{fp.get('first_batch', 0) + fp.get('batches', 0):.2f} s, read "
            f"{rd.get('load_seconds', 0):.2f} s + broadcast {rd.get('broadcast_seconds', 0):.2f} s, "
            f"sync {ph.get('sync', 0):.2f} s, world {ph.get('world', 0):.2f} s"
        )


def _one_table(one: dict) -> None:
    """One process's phases and forward parts (``--nproc 1``: a machine of one GPU)."""
    print(f"{'seconds':30s} {'1 process':>10s}")
    print(f"{'whole command':30s} {one['wall_seconds']:10.2f}")
    for k in PHASES:
        print(f"{k:30s} {one['phases'][k]:10.2f}")
    print(f"{'after the report (exit)':30s} {one['after_report_seconds']:10.2f}")
    for k in PARTS + INSIDE:
        if one["forward_parts"].get(k) is not None:
            label = ("  forward: " if k in PARTS else "    of which ") + k
            print(f"{label:30s} {one['forward_parts'][k]:10.2f}")
    b = _batches_seconds(one)
    print(
        json.dumps(
            {"batches_seconds": round(b, 3), "fixed_seconds": round(one["wall_seconds"] - b, 3)}
        )
    )


def dp(args) -> dict:
    sets = [f"calibrate.data.{k}={v}" for k, v in WORKLOAD.items()] + list(args.set)
    if args.nproc == 1:  # the one-GPU side alone: its fixed costs and batches
        with tempfile.TemporaryDirectory() as t:
            one = _calibrate(args.recipe, sets, 1, Path(t))
        if "error" in one:
            print(f"one      {one['error']}")
        else:
            _one_table(one)
        return {"workload_sets": sets, "one": one}
    with tempfile.TemporaryDirectory() as t:
        one = _calibrate(args.recipe, sets, 1, Path(t))
        many = _calibrate(args.recipe, sets, args.nproc, Path(t))
    key = f"nproc{args.nproc}"
    res = {"workload_sets": sets, "one": one, key: many}
    for k in ("one", key):
        if "error" in res[k]:
            print(f"{k:8s} {res[k]['error']}")
    if "error" not in one and "error" not in many:
        _table(one, many, args.nproc)
        _ranks_table(many)
        res.update(_scaling(one, many, args.nproc))
        print(json.dumps({k: v for k, v in res.items() if k not in ("one", key)}))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    fw = sub.add_parser("forward")
    fw.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    fw.add_argument("--layers", type=int, default=0)
    fw.add_argument("--checkpoint", default="")
    fw.add_argument("--device", default="cpu")
    fw.add_argument("--batches", type=int, default=4)
    fw.add_argument("--batch-size", type=int, default=4)
    fw.add_argument("--seq-len", type=int, default=128)
    fw.add_argument("--repeats", type=int, default=1)
    fw.add_argument("--seed", type=int, default=0)
    fw.add_argument("--variants", default=",".join(VARIANTS))
    fw.add_argument("--json", default="")
    o = sub.add_parser("ops")
    o.add_argument("--experts", type=int, default=128)
    o.add_argument("--top-k", type=int, default=8)
    o.add_argument("--layers", type=int, default=2)
    o.add_argument("--batch-size", type=int, default=2)
    o.add_argument("--seq-len", type=int, default=64)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--variants", default=",".join(VARIANTS))
    o.add_argument("--json", default="")
    d = sub.add_parser("dp")
    d.add_argument("recipe")
    d.add_argument("--nproc", type=int, default=2)
    d.add_argument("--set", action="append", default=[])
    d.add_argument("--json", default="")
    args = ap.parse_args(argv)
    res = {"forward": forward, "ops": ops, "dp": dp}[args.cmd](args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
