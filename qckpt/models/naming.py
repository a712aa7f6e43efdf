"""The model's own Hugging Face checkpoint names, as ``save_pretrained`` writes them.

transformers 5 keeps the routed experts of a MoE block fused in two 3-D parameters
(``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]) but writes them per expert
on save. Quantizers, the calibration file and exports all speak the per-expert names, so a user
can grep the export for the names they already know; this module is the one place that maps
between the two.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: qckpt plan and check read the names
    import torch

from qckpt.errors import UsageError

# model_type -> (prefix rename in the checkpoint, gate name, up name, down name)
_EXPERT_NAMES: dict[str, tuple[tuple[str, str] | None, str, str, str]] = {
    "qwen3_moe": (None, "gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": (None, "gate_proj", "up_proj", "down_proj"),
    "olmoe": (None, "gate_proj", "up_proj", "down_proj"),
    "mixtral": ((".mlp.experts", ".block_sparse_moe.experts"), "w1", "w3", "w2"),
}


# model types whose fused experts the calibration and the export cannot lay out per expert:
# gpt-oss holds them transposed ([E, in, out]), gate and up interleaved by column, with biases
_UNLAID_EXPERTS = {
    "gpt_oss": "fused experts (transposed [E, in, out], gate/up interleaved by column, biased)",
}


def refuse_experts_layout(model_type: str, command: str) -> None:
    """A one-line UsageError (exit 2) when ``command`` cannot run a model of ``model_type``'s
    experts: before any work, instead of per-expert names and slices that would be wrong."""
    why = _UNLAID_EXPERTS.get(model_type)
    if why is not None:
        raise UsageError(
            f"model_type {model_type}: qckpt {command} does not support its {why}; "
            "qckpt convert SRC DST --to hf dequantizes its checkpoint, and qckpt load and "
            "qckpt inspect read it"
        )


@dataclass(frozen=True)
class ExpertSlice:
    """One per-expert linear inside a fused experts parameter.

    ``hf_module`` is the checkpoint's module name (``model.layers.0.mlp.experts.3.gate_proj``);
    the weight is ``param[expert, row_start:row_start + rows]`` of the fused ``param_name``.
    """

    hf_module: str
    param_name: str
    expert: int
    row_start: int
    rows: int
    role: str  # "gate" | "up" | "down"

    def take(self, fused: torch.Tensor) -> torch.Tensor:
        return fused[self.expert].narrow(0, self.row_start, self.rows)


def _names(model_type: str) -> tuple[tuple[str, str] | None, str, str, str]:
    return _EXPERT_NAMES.get(model_type, (None, "gate_proj", "up_proj", "down_proj"))


def _hf_prefix(experts_prefix: str, model_type: str) -> str:
    """The checkpoint's name of a fused experts module (Mixtral renames ``mlp`` on save)."""
    rename = _names(model_type)[0]
    if rename and rename[0] in "." + experts_prefix:
        return ("." + experts_prefix).replace(rename[0], rename[1])[1:]
    return experts_prefix


def is_fused_experts(mod: torch.nn.Module) -> bool:
    """A transformers 5 fused routed-experts module: 3-D ``gate_up_proj`` plus ``down_proj``."""
    import torch

    gu = getattr(mod, "gate_up_proj", None)
    dn = getattr(mod, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3


def is_router(name: str, mod: torch.nn.Module) -> bool:
    """An MoE router (a linear by type in some models): it stays in the model dtype."""
    cls = type(mod).__name__.lower()
    return "router" in cls or name.endswith((".mlp.gate", ".block_sparse_moe.gate", ".router"))


def ignored(module_name: str, patterns: Iterable[str]) -> bool:
    """Whether ``quant.ignore`` (fnmatch patterns of module names) leaves a module unquantized."""
    return any(fnmatch.fnmatchcase(module_name, p) for p in patterns)


def ignore_matcher(patterns: Iterable[str]) -> Callable[[str], bool]:
    """:func:`ignored` with ``patterns`` made into one regex once: what a plan asks of tens of
    thousands of modules (one ``fnmatchcase`` per pattern per module cost ~0.3 s on 18k)."""
    pats = list(patterns)
    if not pats:
        return lambda _name: False
    match = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in pats)).match
    return lambda name: match(name) is not None


def expert_roles(model_type: str) -> dict[str, str]:
    """Per-expert linear name -> role ("gate" | "up" | "down") for a model type."""
    _, gate, up, down = _names(model_type)
    return {gate: "gate", up: "up", down: "down"}


def expert_slices(
    experts_prefix: str, model_type: str, gate_up_shape: torch.Size, down_shape: torch.Size
) -> list[ExpertSlice]:
    """Per-expert linears of a fused experts module at ``experts_prefix`` (``...mlp.experts``)."""
    _, gate, up, down = _names(model_type)
    hf_prefix = _hf_prefix(experts_prefix, model_type)
    num_experts, two_i, _ = gate_up_shape
    inter = two_i // 2
    out: list[ExpertSlice] = []
    for e in range(num_experts):
        base = f"{hf_prefix}.{e}"
        gu = f"{experts_prefix}.gate_up_proj"
        out.append(ExpertSlice(f"{base}.{gate}", gu, e, 0, inter, "gate"))
        out.append(ExpertSlice(f"{base}.{up}", gu, e, inter, inter, "up"))
        out.append(
            ExpertSlice(
                f"{base}.{down}", f"{experts_prefix}.down_proj", e, 0, down_shape[1], "down"
            )
        )
    return out


def is_fused_experts_param(name: str) -> bool:
    return name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj")


def hf_tensors(
    name: str, tensor: torch.Tensor, model_type: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Map one state-dict entry to the checkpoint entries ``save_pretrained`` would write.

    Fused experts give views, one per expert (no copies); everything else passes through.
    """
    if not is_fused_experts_param(name):
        yield name, tensor
        return
    prefix, _, leaf = name.rpartition(".")
    _, gate, up, down = _names(model_type)
    hf_prefix = _hf_prefix(prefix, model_type)
    if leaf == "gate_up_proj":
        inter = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{hf_prefix}.{e}.{gate}.weight", tensor[e, :inter]
            yield f"{hf_prefix}.{e}.{up}.weight", tensor[e, inter:]
    else:
        for e in range(tensor.shape[0]):
            yield f"{hf_prefix}.{e}.{down}.weight", tensor[e]
