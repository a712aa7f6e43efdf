"""A blockwise-FP8 source beside its BF16 original: load into FP8 params and export to NVFP4.

    python -m bench.quantized_source --layers 2 --small          # CPU smoke run (seconds)
    python -m bench.quantized_source --layers 16 --json qs.json  # Qwen3-30B-A3B shape, 16 layers

Setup (not timed): a Qwen3-MoE checkpoint of the Qwen3-30B-A3B shape (hidden 2048, 128 experts
of 768, 32/4 heads of 128, vocab 151936; ``--layers`` of its 48) with random BF16 weights, then
its DeepSeek-style blockwise-FP8 copy made with qckpt itself (``qckpt.formats`` ``fp8_block``,
128x128, float32 ``weight_scale_inv``; routers, norms, embeddings and lm_head stay BF16), shard
by shard, and a calibration file per source (weight amax of that source's values, input amax
4.0).

Measured, each in a fresh subprocess (so that every peak is its own), for both sources:

* ``load fp8``: ``load_checkpoint`` into per-tensor FP8 params (streaming; on CUDA when there is
  one): a blockwise source is dequantized on the fly into the planner's scratch.
* ``load fp8_block``: into 128x128 blockwise-FP8 params: from the blockwise source the codes and
  scales are copied as they are (``copied`` tensors), from BF16 they are quantized.
* ``export nvfp4``: ``export_checkpoint`` to the ModelOpt NVFP4 layout (host, one tensor in
  flight).

Reported: seconds, bytes read, and two peaks each for the device (CUDA allocator) and the host
(RSS): the phase's peak above the state before it (the counters are reset after the build), and
the whole child's peak (imports and the seeded BF16 build included; read before that reset), as
a table and as JSON. The whole-child figure is what a user's command costs; the phase figure
isolates the load or export itself.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._memory import reset_peak_rss
from qckpt.memory import peak_rss

REPO = Path(__file__).resolve().parents[1]
IGNORE = ["lm_head", "*.mlp.gate"]
BLOCK = (128, 128)
GB = 1e9


def _config(layers: int, small: bool):
    from transformers import Qwen3MoeConfig

    if small:
        dims = {"hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8}
        dims |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
        dims |= {"vocab_size": 1024, "intermediate_size": 512}
    else:  # Qwen3-30B-A3B
        dims = {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128}
        dims |= {"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
        dims |= {"vocab_size": 151936, "intermediate_size": 6144}
    return Qwen3MoeConfig(
        num_hidden_layers=layers,
        num_experts_per_tok=8,
        tie_word_embeddings=False,
        dtype="bfloat16",
        **dims,
    )


def _tensors(cfg):
    """(name, shape) of every checkpoint tensor, in file order (per-expert names)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, inter = (
        cfg.num_attention_heads * hd,
        cfg.num_key_value_heads * hd,
        cfg.moe_intermediate_size,
    )
    yield "model.embed_tokens.weight", (cfg.vocab_size, h)
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}"
        for n, s in (
            ("q_proj", (q, h)),
            ("k_proj", (kv, h)),
            ("v_proj", (kv, h)),
            ("o_proj", (h, q)),
        ):
            yield f"{p}.self_attn.{n}.weight", s
        yield f"{p}.self_attn.q_norm.weight", (hd,)
        yield f"{p}.self_attn.k_norm.weight", (hd,)
        yield f"{p}.mlp.gate.weight", (cfg.num_experts, h)
        for e in range(cfg.num_experts):
            for n, s in (
                ("gate_proj", (inter, h)),
                ("up_proj", (inter, h)),
                ("down_proj", (h, inter)),
            ):
                yield f"{p}.mlp.experts.{e}.{n}.weight", s
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (cfg.vocab_size, h)


def _quantized(name: str) -> bool:
    return name.endswith("_proj.weight")


class _ShardWriter:
    """safetensors shards of about ``limit`` bytes plus the index, written as tensors come."""

    def __init__(self, out: Path, limit: float = 2 * GB) -> None:
        self.out, self.limit = out, limit
        self.shard: dict = {}
        self.size = 0
        self.weight_map: dict[str, str] = {}
        self.files = 0

    def add(self, name: str, t) -> None:
        self.shard[name] = t
        self.size += t.numel() * t.element_size()
        if self.size >= self.limit:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.shard:
            name = f"model-{self.files:05d}.safetensors"
            save_file(self.shard, str(self.out / name), metadata={"format": "pt"})
            self.weight_map.update(dict.fromkeys(self.shard, name))
            self.files += 1
            self.shard, self.size = {}, 0

    def close(self) -> None:
        self.flush()
        index = {"metadata": {}, "weight_map": self.weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index))


def make_sources(work: Path, layers: int, small: bool) -> dict:
    """The BF16 dir, its blockwise-FP8 copy, and one NVFP4 calibration file per source."""
    import torch

    from qckpt import quantize, save_calibration
    from qckpt.calib.state_file import CalibrationState, model_fingerprint

    cfg = _config(layers, small)
    bf16, fp8 = work / "bf16", work / "fp8-blockwise"
    for d in (bf16, fp8):
        d.mkdir(parents=True)
        cfg.save_pretrained(d)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    qc["weight_block_size"] = list(BLOCK)
    cfg_json = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps(cfg_json | {"quantization_config": qc}))
    # random weights and their fp8_block quantization on the GPU when there is one (setup time)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    writers = {"bf16": _ShardWriter(bf16), "fp8": _ShardWriter(fp8)}
    amax: dict[str, dict] = {"bf16": {}, "fp8": {}}
    names: list = []
    for name, shape in _tensors(cfg):
        names.append((name, shape))
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
        writers["bf16"].add(name, t.cpu())
        if not (_quantized(name) and not name.endswith("mlp.gate.weight")):
            writers["fp8"].add(name, t.cpu())
            continue
        q = quantize(t, "fp8_block", block_size=BLOCK)
        writers["fp8"].add(name, q.qdata.cpu())
        writers["fp8"].add(f"{name}_scale_inv", q.scale.cpu())
        module = name[: -len(".weight")]
        amax["bf16"][f"{module}.weight_amax"] = t.float().abs().amax().cpu()
        amax["fp8"][f"{module}.weight_amax"] = q.dequantize(torch.float32).abs().amax().cpu()
        for kind in ("bf16", "fp8"):
            amax[kind][f"{module}.input_amax"] = torch.tensor(4.0)
    for w in writers.values():
        w.close()
    quant = {"weights": {"format": "nvfp4", "granularity": "tensor"}}
    quant["inputs"] = {"format": "nvfp4", "granularity": "tensor", "dynamic": False}
    cal = {}
    for kind in ("bf16", "fp8"):
        state = CalibrationState(
            amax=amax[kind],
            model_type="qwen3_moe",
            model_fingerprint=model_fingerprint(names),
            quant=quant,
        )
        cal[kind] = str(save_calibration(state, work / f"calib-{kind}.safetensors"))
    size = {
        k: sum(f.stat().st_size for f in d.glob("*.safetensors"))
        for k, d in (("bf16", bf16), ("fp8", fp8))
    }
    return {"bf16": str(bf16), "fp8": str(fp8), "calib": cal, "bytes": size}


# ---- children -------------------------------------------------------------------------------


def child_load(src: str, params: str) -> dict:
    import psutil
    import torch

    from qckpt import build_model, load_checkpoint
    from qckpt.models.quantize_params import quantize_model_params

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # seeded init on the device (the params are quantized from it before the load overwrites
    # them; materialize()'s uninitialized memory could hold NaNs)
    model = build_model(src, dtype="bfloat16", seed=0, device=dev)
    opts = {"block_size": BLOCK} if params == "fp8_block" else {}
    quantize_model_params(model, params, ignore=IGNORE, **opts)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    # the whole child's peaks so far (imports, the seeded build), read before the phase counters
    # are reset: the whole-command peak is the max of this and the load phase's peak
    build_dev = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
    build_host = peak_rss()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base_dev = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    reset_peak_rss()
    base = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    rep = load_checkpoint(model, src)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    return {
        "seconds": sec,
        "bytes_read": rep.bytes_read,
        "device": str(dev),
        "device_peak_above_params": (torch.cuda.max_memory_allocated() - base_dev)
        if dev.type == "cuda"
        else None,
        "device_peak_whole": max(build_dev, torch.cuda.max_memory_allocated())
        if dev.type == "cuda"
        else None,
        "transient_bytes": rep.transient_bytes,
        "host_peak_delta": peak_rss() - base,
        "host_peak_whole": max(build_host, peak_rss()),
        "copied": rep.copied_tensors,
        "layout": rep.source_layout,
    }


def child_export(src: str, cal: str, out: str) -> dict:
    import psutil

    from qckpt import export_checkpoint
    from qckpt.models.build import load_config
    from qckpt.recipe import ExportConfig, QuantConfig, TensorQuantConfig

    cfg = load_config(src)
    quant = QuantConfig(
        weights=TensorQuantConfig(format="nvfp4", granularity="tensor"),
        inputs=TensorQuantConfig(format="nvfp4", granularity="tensor", dynamic=False),
        ignore=list(IGNORE),
    )
    build_host = peak_rss()
    reset_peak_rss()
    base = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    rep = export_checkpoint(
        source=src,
        calibration=cal,
        output=out,
        model_type="qwen3_moe",
        model_config=cfg,
        quant=quant,
        export=ExportConfig(format="modelopt", output=out, max_shard_size="2GB"),
        source_dir=src,
    )
    return {
        "seconds": time.perf_counter() - t0,
        "bytes_written": rep.bytes_written,
        "host_peak_delta": peak_rss() - base,
        "host_peak_whole": max(build_host, peak_rss()),
    }


def _child(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.quantized_source", "--child", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if proc.returncode != 0:
        raise SystemExit(f"child {args[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(report: dict) -> str:
    rows = [
        (
            "source",
            "step",
            "seconds",
            "read/written GB",
            "device peak GB (phase / whole)",
            "host peak GB (phase / whole)",
            "copied",
        )
    ]
    for src in ("bf16", "fp8"):
        for step, r in report["runs"][src].items():
            dev = r.get("device_peak_above_params")
            dev_whole = r.get("device_peak_whole")
            rows.append(
                (
                    src,
                    step,
                    f"{r['seconds']:.2f}",
                    f"{(r.get('bytes_read') or r.get('bytes_written') or 0) / GB:.2f}",
                    "-" if dev is None else f"{dev / GB:.3f} / {dev_whole / GB:.3f}",
                    f"{r['host_peak_delta'] / GB:.3f} / {r['host_peak_whole'] / GB:.3f}",
                    str(r.get("copied", "-")),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16, help="layers of the 48 (default 16)")
    ap.add_argument("--small", action="store_true", help="tiny dims, for a CPU smoke run")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: temp)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        print(json.dumps(child_load(*rest) if kind == "load" else child_export(*rest)))
        return 0
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qckpt-bench-qsrc-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        info = make_sources(work, args.layers, args.small)
        report = {
            "layers": args.layers,
            "small": args.small,
            "setup_seconds": time.perf_counter() - t0,
        }
        report["source_bytes"] = info["bytes"]
        report["runs"] = {}
        for src in ("bf16", "fp8"):
            runs = {}
            for params in ("fp8", "fp8_block"):
                runs[f"load {params}"] = _child("load", info[src], params)
            out = work / f"nvfp4-from-{src}"
            runs["export nvfp4"] = _child("export", info[src], info["calib"][src], str(out))
            shutil.rmtree(out, ignore_errors=True)
            report["runs"][src] = runs
        print(_table(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
