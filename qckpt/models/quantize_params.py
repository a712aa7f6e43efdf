"""Turn a model's weights into quantized parameters (the destinations of a streaming load).

Only the weights that a quantized GEMM consumes are replaced: every ``nn.Linear`` weight not
matched by one of the recipe's ``quant.ignore`` fnmatch patterns, and the fused routed-expert
parameters of MoE blocks (3-D ``experts.gate_up_proj`` / ``experts.down_proj``). Norms,
embeddings, routers and biases stay as they are. Each replaced weight becomes
``nn.Parameter(QuantizedTensor, requires_grad=False)``: quantized from its current value when
the weight has one (a seeded model is usable before a checkpoint is loaded into it), or, for a
weight on the meta device, a shape-only ``formats.empty`` that ``Module.to_empty`` allocates in
its final format (``qckpt.models.build.materialize``) for a checkpoint to fill: no
high-precision copy of it ever exists, nothing random is drawn for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: qckpt plan reads PLAIN_PARAMS / plain_params
    from torch import nn

from qckpt.errors import UsageError
from qckpt.models.naming import ignored, is_fused_experts_param

# ``load.params`` of a model left in its dtype (no quantized parameters)
PLAIN_PARAMS = "none"


def plain_params(params_fmt: str | None) -> bool:
    """Whether ``load.params`` (or a resident format) leaves the parameters plain."""
    return params_fmt in (None, "", PLAIN_PARAMS)


def quantizable_params(model: nn.Module, *, ignore: Iterable[str] = ()) -> list[str]:
    """Names of the parameters ``quantize_model_params`` would replace, in model order."""
    import torch
    from torch import nn

    ignore = list(ignore)
    out: list[str] = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            if not ignored(mod_name, ignore) and isinstance(mod.weight, torch.Tensor):
                out.append(f"{mod_name}.weight" if mod_name else "weight")
            continue
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if is_fused_experts_param(full) and p.dim() == 3 and not ignored(mod_name, ignore):
                out.append(full)
    return out


def quantize_model_params(
    model: nn.Module,
    params_fmt: str,
    *,
    ignore: Iterable[str] = (),
    backend: str = "native",
    **opts: Any,
) -> dict[str, str]:
    """Replace the quantizable weights of ``model`` in place; return ``{param name: format}``.

    ``params_fmt="none"`` leaves the model as is and returns ``{}``. ``opts`` go to
    ``qckpt.formats.quantize`` (e.g. ``block_size``).
    """
    import torch
    from torch import nn

    if plain_params(params_fmt):
        return {}
    if backend == "te":
        # Transformer Engine linears with TE quantized weights (qckpt.formats.te, issue 9)
        from qckpt.formats.te import build_te_linears

        return build_te_linears(model, params_fmt, skip=lambda name: ignored(name, ignore))
    if backend != "native":
        raise UsageError(f"load.backend: must be native or te; got {backend!r}")
    from qckpt import formats

    if params_fmt not in formats.FORMATS:
        known = ", ".join(sorted(formats.FORMATS)) or "none"
        raise UsageError(f"load.params: unknown format {params_fmt!r} (available: {known})")
    done: dict[str, str] = {}
    names = set(quantizable_params(model, ignore=ignore))
    for mod_name, mod in list(model.named_modules()):
        for p_name, p in list(mod.named_parameters(recurse=False)):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if full not in names or formats.is_quantized(p):
                continue
            if p.is_meta:
                q = formats.empty(p.shape, params_fmt, nominal_dtype=p.dtype, device="meta", **opts)
            else:
                with torch.no_grad():
                    q = formats.quantize(p.detach(), params_fmt, **opts)
            # frozen: a quantized weight has no gradient of its own (training keeps FP32 main
            # params elsewhere, see load_checkpoint(main_params="fp32"))
            setattr(mod, p_name, nn.Parameter(q, requires_grad=False))
            done[full] = params_fmt
    return done
