"""``qckpt eval``'s work: the source and the export (emulated as a serving stack runs it) on the
same held-out windows, batch by batch, and the figures of :mod:`qckpt.evaluate.metrics`.

Both models are resident on the device at once (the export's quantized linears in float32).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qckpt.errors import UsageError
from qckpt.evaluate import metrics
from qckpt.evaluate.build import load_emulated, load_model
from qckpt.evaluate.cpu_linear import half_linears_in_float32
from qckpt.evaluate.options import EvalOptions
from qckpt.evaluate.scheme import as_on_hopper, inputs_only, read_scheme, weights_only
from qckpt.evaluate.windows import Windows, data_section, make_windows, tokenizer_of
from qckpt.layouts.source_layout import model_dtype, read_json_if_any
from qckpt.models.naming import refuse_experts_layout

# past these the report says the export is broken, not merely lossy
WARN_INCREASE = 0.10
WARN_TOP1 = 0.90
_SAME_ARCH = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    return torch.device(device)


def _check_same_model(export_dir: Path, source_dir: Path) -> dict[str, Any]:
    exp = read_json_if_any(export_dir / "config.json") or {}
    src = read_json_if_any(source_dir / "config.json")
    if src is None:
        raise UsageError(f"{source_dir}: no config.json (the source must be an HF model dir)")
    diff = [k for k in _SAME_ARCH if k in src and k in exp and src[k] != exp[k]]
    if diff:
        what = ", ".join(f"{k} {src[k]} vs {exp[k]}" for k in diff)
        raise UsageError(f"{export_dir} is not an export of {source_dir}: {what}")
    return src


class _LayerTap:
    """The decoder layers' outputs of one forward, in layer order."""

    def __init__(self, model: nn.Module) -> None:
        from qckpt.calib.layerwise import decoder_layers

        self.outputs: list[torch.Tensor] = []
        _, layers = decoder_layers(model)
        self.handles = [layer.register_forward_hook(self._hook) for layer in layers]

    def _hook(self, mod: nn.Module, args: Any, out: Any) -> None:
        self.outputs.append((out[0] if isinstance(out, tuple) else out).detach())

    def take(self) -> list[torch.Tensor]:
        got, self.outputs = self.outputs, []
        return got

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def quality_warnings(fig: dict[str, Any], unit: str) -> list[str]:
    out = []
    inc = fig.get("relative_increase")
    if inc is not None and inc > WARN_INCREASE:
        out.append(
            f"the export's bits per {unit} are {inc * 100:.1f} % above the source's (more than "
            f"{WARN_INCREASE * 100:.0f} %): it does not compute what the source computes; check "
            "its scales and codes"
        )
    if fig["top1_agreement"] < WARN_TOP1:
        out.append(
            f"top-1 agreement with the source is {fig['top1_agreement'] * 100:.1f} % (below "
            f"{WARN_TOP1 * 100:.0f} %)"
        )
    return out


def _run(
    src: Callable[[], nn.Module],
    exp: nn.Module,
    win: Windows,
    opts: EvalOptions,
    dev: torch.device,
    step: Any,
    cache: dict | None,
) -> metrics.Sums:
    """Batch by batch: the source's logits and layer outputs (from ``cache`` when it holds
    them, else computed, and kept there when a cache is given), then the export's."""
    sums = metrics.Sums()
    tap_e, tap_s, model = _LayerTap(exp), None, None
    try:
        with torch.no_grad(), half_linears_in_float32(dev):
            for i in range(0, win.ids.shape[0], opts.batch_size):
                batch = win.ids[i : i + opts.batch_size].to(dev)
                key = (i, tuple(win.starts[i : i + opts.batch_size]))
                got = None if cache is None else cache.get(key)
                if got is None:
                    if model is None:
                        model = src()
                        tap_s = _LayerTap(model)
                    got = (model(batch[:, :-1]).logits, tap_s.take())
                    if cache is not None:
                        cache[key] = got
                le = exp(batch[:, :-1]).logits
                sums.add_logits(got[0], le, batch[:, 1:])
                for j, (hs, he) in enumerate(zip(got[1], tap_e.take(), strict=True)):
                    sums.add_layer(j, hs, he)
                sums.nbytes += sum(win.nbytes[i : i + opts.batch_size])
                step(int(batch.shape[0]))
    finally:
        for t in (tap_e, tap_s):
            if t is not None:
                t.close()
    return sums


def evaluate(
    export_dir: Path,
    source_dir: Path,
    data: Path,
    opts: EvalOptions,
    progress: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
    cache: dict | None = None,
) -> dict[str, Any]:
    """The report of ``qckpt eval`` (a JSON-able dict). ``cache``: a dict kept by the caller
    across calls with the same source, data and options (the source's outputs are computed
    once; a benchmark of several exports uses it)."""
    t0 = time.perf_counter()
    source_type = (read_json_if_any(source_dir / "config.json") or {}).get("model_type")
    refuse_experts_layout(str(source_type or ""), "eval")
    scheme = read_scheme(export_dir, opts.fused)
    if opts.inputs == "unquantized":
        scheme = weights_only(scheme)
    elif opts.inputs == "hopper":
        scheme = as_on_hopper(scheme)
    if opts.weights == "unquantized":
        scheme = inputs_only(scheme, source_dir)
    src_cfg = _check_same_model(export_dir, source_dir)
    tok = tokenizer_of(source_dir) or tokenizer_of(export_dir)
    win = make_windows(
        data,
        vocab_size=int(src_cfg.get("vocab_size") or 0),
        tokenizer=tok,
        windows=opts.windows,
        seq_len=opts.seq_len,
        seed=opts.seed,
    )
    dev = pick_device(opts.device)
    dtype = model_dtype(src_cfg)
    (log or (lambda m: None))(
        f"source {source_dir}, export {export_dir} ({scheme.layout.describe()}); "
        f"{win.ids.shape[0]} windows of {win.ids.shape[1]} from {data}; {dtype} on {dev}"
    )
    step = progress or (lambda n: None)
    if opts.offload == "layer":
        from qckpt.evaluate.layerwise import run_layerwise

        t_load = time.perf_counter()
        sums, counts = run_layerwise(
            source_dir, scheme, win.ids, win.nbytes, opts.batch_size, dtype, dev, step
        )
    else:
        exp, counts = load_emulated(scheme, dtype, dev)
        t_load = time.perf_counter()
        if cache is not None:
            cache = cache.setdefault((str(source_dir), str(data), str(dev), str(dtype)), {})
        sums = _run(lambda: load_model(source_dir, dtype, dev), exp, win, opts, dev, step, cache)
    unit = "token" if win.kind == "tokens" else "byte"
    fig = metrics.figures(sums, unit, opts.top_layers)
    return {
        "client": "qckpt",
        "export": str(export_dir),
        "source": str(source_dir),
        "data": data_section(win, data),
        "unit": unit,
        "scheme": scheme.summary(),
        "emulated": counts,
        "device": str(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "options": asdict(opts),
        **fig,
        "warnings": scheme.notes + quality_warnings(fig, unit),
        "seconds": {"load": t_load - t0, "forward": time.perf_counter() - t_load},
    }


def score_model(model_dir: Path, data: Path, opts: EvalOptions) -> dict[str, Any]:
    """One model's bits per byte (per token for token-id data) and perplexity on the windows:
    a plain dir as transformers computes it, a quantized one with its weights dequantized
    (weight-only: inputs unquantized)."""
    cfg = read_json_if_any(model_dir / "config.json") or {}
    win = make_windows(
        data,
        vocab_size=int(cfg.get("vocab_size") or 0),
        tokenizer=tokenizer_of(model_dir),
        windows=opts.windows,
        seq_len=opts.seq_len,
        seed=opts.seed,
    )
    dev = pick_device(opts.device)
    model = load_model(model_dir, model_dtype(cfg), dev)
    nll, tokens = 0.0, 0
    with torch.no_grad(), half_linears_in_float32(dev):
        for i in range(0, win.ids.shape[0], opts.batch_size):
            b = win.ids[i : i + opts.batch_size].to(dev)
            logits = model(b[:, :-1]).logits.float()
            nll += float(
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), b[:, 1:].reshape(-1), reduction="sum"
                )
            )
            tokens += int(b[:, 1:].numel())
    unit = "token" if win.kind == "tokens" else "byte"
    return {
        f"bits_per_{unit}": metrics.per_byte(nll, sum(win.nbytes)),
        "perplexity": math.exp(nll / max(tokens, 1)),
        "tokens": tokens,
        "unit": unit,
    }
