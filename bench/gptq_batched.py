"""GPTQ batched over each MoE layer's experts against the per-expert reference, side by side in
one run: the same random Qwen3-MoE, the same data, ``calibrate.algorithm: gptq`` twice through
:func:`qckpt.calib.calibrate.calibrate_model`, once with ``gptq.REFERENCE`` (one Cholesky, one
block-update GEMM per linear, one Hessian GEMM per expert and batch) and once with the default
``gptq.BATCHING``; then whether the two runs' GPTQ'd weights and scales are bit-identical.

    python -m bench.gptq_batched                                  # CPU: 32 experts, hidden 256
    python -m bench.gptq_batched --preset qwen3-30b-a3b --layers 4 --device cuda \\
        --samples 128 --seq-len 2048 --batch-size 8 --probe --json gptqb.json

Per layer, each of the pass's four steps (the inputs' amaxes, the Hessians, the sweeps of
``_quantize_layer``, the outputs for the next layer; each timed with a device sync around it)
and their sum, reference / batched, with the ratio (> 1: batched faster); best of
``--repeats`` alternated runs. On CUDA wall seconds; on a CPU this process's CPU seconds (a
shared CPU's wall time is the other jobs' too: run with ``--threads 1`` there).
``--probe``: on the device, at the model's Hessian sizes, whether each
batched op gives each matrix the bits of one call on it alone (Cholesky, ``cholesky_inverse``,
the inverse's Cholesky, ``bmm`` against ``mm``) and its time both ways: what
``gptq.FACTOR_DEVICES`` / ``UPDATE_DEVICES`` may hold on this device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PRESETS = {
    # a tiny-but-not-trivial MoE for a CPU: 32 experts, hidden 256
    "moe32": {
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "norm_topk_prob": True,
    },
}
QUANTS = {
    "nvfp4": {"weights": {"format": "nvfp4"}, "inputs": {"format": "nvfp4"}},
    "fp8": {
        "weights": {"format": "fp8", "granularity": "channel"},
        "inputs": {"format": "fp8", "granularity": "tensor"},
    },
    "int4": {
        "weights": {"format": "int4", "granularity": "group", "block_size": [32]},
        "inputs": {"format": "none"},
    },
    "mxfp4": {"weights": {"format": "mxfp4"}, "inputs": {"format": "none"}},
}


def _fields(args) -> dict:
    if args.preset in PRESETS:
        fields = dict(PRESETS[args.preset])
    else:
        from bench.whole_command import PRESETS as WHOLE

        fields = {**WHOLE[args.preset], "norm_topk_prob": True}
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    for flag, key in (
        ("experts", "num_experts"),
        ("hidden", "hidden_size"),
        ("moe_inter", "moe_intermediate_size"),
        ("top_k", "num_experts_per_tok"),
    ):
        if getattr(args, flag):
            fields[key] = getattr(args, flag)
    return fields  # fmt: skip


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(fields: dict, device):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**fields), dtype=torch.bfloat16)
    return model.eval()


SLOTS = ("amax", "hessians", "sweeps", "outputs")  # a layer's steps (gptq_pass's module doc)


class _Timed:
    """A layer's four steps timed (device-synced) per call: wall and this process's CPU
    seconds (on a shared CPU the wall time is others' too; the CPU time is the run's own)."""

    def __init__(self, device) -> None:
        self.device = device
        self.got: dict[str, list[tuple[float, float]]] = {k: [] for k in SLOTS}

    def wrap(self, owner, name: str, slot: str):
        real = getattr(owner, name)

        def timed(*a, **kw):
            _sync(self.device)
            t0, c0 = time.perf_counter(), time.process_time()
            out = real(*a, **kw)
            _sync(self.device)
            self.got[slot].append((time.perf_counter() - t0, time.process_time() - c0))
            return out

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, real)


def _side(args, fields: dict, batching, device) -> dict:
    """One calibrate_model run with ``gptq.BATCHING = batching``: its rows and weights."""
    import torch

    from qckpt.calib import gptq, gptq_pass
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.parallel.mesh import Mesh
    from qckpt.pipeline.calibrate import algorithm_of
    from qckpt.recipe import recipe_from_dict

    data = {"source": "synthetic", "num_samples": args.samples, "seq_len": args.seq_len,
            "batch_size": args.batch_size}  # fmt: skip
    quant = {**QUANTS[args.format], "ignore": ["lm_head", "*.mlp.gate"]}
    r = recipe_from_dict({"quant": quant, "calibrate": {"data": data, "algorithm": "gptq"}})
    batches = calibration_batches(
        r.calibrate.data, vocab_size=fields["vocab_size"], data_rank=0, data_world=1
    )
    model = _model(fields, device)
    timed = _Timed(device)
    undo = [timed.wrap(gptq_pass, "_layer_amax", "amax"),
            timed.wrap(gptq_pass, "_layer_hessians", "hessians"),
            timed.wrap(gptq_pass, "_quantize_layer", "sweeps"),
            timed.wrap(gptq_pass.LayerIo, "outputs", "outputs")]  # fmt: skip
    old, gptq.BATCHING = gptq.BATCHING, batching
    try:
        state, report = calibrate_model(
            model, batches, r.quant, Mesh(), algorithm=algorithm_of(r),
            moe_forward=args.moe_forward,
        )  # fmt: skip
    finally:
        gptq.BATCHING = old
        for u in undo:
            u()
    rows = {k: v["gptq"] for k, v in report["layers"].items() if "gptq" in v}
    weights = {k: t.detach().cpu().contiguous().view(-1).view(torch.uint8)
               for k, t in state.weights.items()}  # fmt: skip
    del model, state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows, "weights": weights, **timed.got}


def _same(a: dict, b: dict) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _best(runs: list[dict]) -> dict:
    """Per layer and step the least (wall, CPU) seconds over the repeats, each apart; the
    layer's: the sum of its steps."""
    names = list(runs[0]["rows"])
    out: dict = {"names": names}
    for slot in SLOTS:
        out[slot] = [
            tuple(min(r[slot][i][j] for r in runs) for j in (0, 1)) for i in range(len(names))
        ]
    out["layer"] = [tuple(sum(out[k][i][j] for k in SLOTS) for j in (0, 1))
                    for i in range(len(names))]  # fmt: skip
    return out


def _probe(fields: dict, device) -> dict:
    """Batched vs one call per matrix, bits and seconds, at the model's Hessian sizes."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    m = min(fields["num_experts"], 16)
    out: dict = {}
    for n in sorted({fields["hidden_size"], fields["moe_intermediate_size"]}):
        x = torch.round(torch.randn(m, 2 * n, n, generator=g, dtype=torch.float64) * 1000)
        h = (x.transpose(1, 2) @ x).to(device)
        h += 0.01 * torch.eye(n, dtype=h.dtype, device=device)
        e1 = torch.randn(m, fields["moe_intermediate_size"], 128, generator=g).to(device)
        steps = {
            "cholesky": lambda a: torch.linalg.cholesky(a),
            "cholesky_inverse": lambda a: torch.cholesky_inverse(torch.linalg.cholesky(a)),
            "cholesky_upper": lambda a: torch.linalg.cholesky(a, upper=True),
        }
        row = {}
        for name, fn in steps.items():
            b, tb = _timed_call(device, fn, h)
            one, t1 = _timed_call(device, lambda a, fn=fn: torch.stack([fn(y) for y in a]), h)
            row[name] = {"equal": bool(torch.equal(b, one)), "batched_s": tb, "looped_s": t1}
        if n > 128:
            u = torch.linalg.cholesky(h).float().transpose(1, 2).contiguous()
            b, tb = _timed_call(device, lambda a, e: torch.bmm(e, a[:, :128, 128:]), u, e1)
            one, t1 = _timed_call(
                device, lambda a, e: torch.stack([e[k] @ a[k, :128, 128:] for k in range(m)]), u, e1
            )
            row["bmm"] = {"equal": bool(torch.equal(b, one)), "batched_s": tb, "looped_s": t1}
        out[f"n={n} m={m}"] = row
    return out


def _timed_call(device, fn, *a):
    fn(*a)  # warm-up (cuSOLVER handles, workspaces)
    _sync(device)
    t0 = time.perf_counter()
    got = fn(*a)
    _sync(device)
    return got, round(time.perf_counter() - t0, 6)


def run(args) -> dict:
    import torch

    from qckpt.calib import gptq

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    fields = _fields(args)
    ref_runs, new_runs = [], []
    for _ in range(args.repeats):  # alternated, so neither side always runs warm
        ref_runs.append(_side(args, fields, gptq.REFERENCE, device))
        new_runs.append(_side(args, fields, gptq.Batching(), device))
    same = all(_same(r["weights"], n["weights"]) for r, n in zip(ref_runs, new_runs, strict=True))
    rows_same = all(
        {k: {f: v for f, v in row.items() if f != "seconds"} for k, row in r["rows"].items()}
        == {k: {f: v for f, v in row.items() if f != "seconds"} for k, row in n["rows"].items()}
        for r, n in zip(ref_runs, new_runs, strict=True)
    )
    ref, new = _best(ref_runs), _best(new_runs)
    res = {"device": str(device), "format": args.format, "fields": fields,
           "tokens": args.samples * args.seq_len, "moe_forward": args.moe_forward,
           "threads": torch.get_num_threads(), "repeats": args.repeats,
           "identical_weights": same, "identical_rows": rows_same, "layers": {}}  # fmt: skip
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
    clock = 0 if device.type == "cuda" else 1  # CUDA: wall (the host waits); CPU: CPU time
    res["clock"] = ("wall", "cpu")[clock]
    print(f"seconds ({res['clock']}), reference / batched, best of {args.repeats}:")
    print(f"{'layer':18s} {'whole':>16s} {'ratio':>6s}" + "".join(f" {k:>15s}" for k in SLOTS))
    for i, name in enumerate(ref["names"]):
        one = {k: {"reference": ref[k][i], "batched": new[k][i]} for k in ("layer", *SLOTS)}
        res["layers"][name] = one
        a, b = ref["layer"][i][clock], new["layer"][i][clock]
        cells = "".join(f" {ref[k][i][clock]:7.3f}/{new[k][i][clock]:<7.3f}" for k in SLOTS)
        print(f"{name:18s} {a:8.3f}/{b:<7.3f} {a / b:6.2f}{cells}")
    tot = {k: (sum(x[clock] for x in ref[k]), sum(x[clock] for x in new[k]))
           for k in ("layer", *SLOTS)}  # fmt: skip
    res["total"] = {k: {"reference": a, "batched": b, "ratio": a / b} for k, (a, b) in tot.items()}
    a, b = tot["layer"]
    n = len(ref["names"])
    print(f"gptq per layer ({res['clock']} s): reference {a / n:.3f}, batched {b / n:.3f}, ratio "
          f"{a / b:.2f} (hessians {tot['hessians'][0] / tot['hessians'][1]:.2f}, sweeps "
          f"{tot['sweeps'][0] / tot['sweeps'][1]:.2f}); GPTQ'd weights and scales "
          f"{'bit-identical' if same else 'DIFFER'}, report rows "
          f"{'identical' if rows_same else 'DIFFER'}")  # fmt: skip
    if args.probe:
        res["probe"] = _probe(fields, device)
        for size, row in res["probe"].items():
            print(size, "  ".join(f"{k}: {'same bits' if v['equal'] else 'OTHER BITS'} "
                                  f"{v['batched_s']:.4f} s batched / {v['looped_s']:.4f} s looped"
                                  for k, v in row.items()))  # fmt: skip
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="moe32", choices=["moe32", "qwen3-30b-a3b", "tiny"])
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--moe-inter", dest="moe_inter", type=int, default=0)
    ap.add_argument("--top-k", dest="top_k", type=int, default=0)
    ap.add_argument("--format", choices=sorted(QUANTS), default="nvfp4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--moe-forward", choices=["eager", "grouped"], default="eager")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: as is)")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["identical_weights"] and res["identical_rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
