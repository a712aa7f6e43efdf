"""The figures ``qckpt eval`` reports, accumulated batch by batch in float64 sums.

* NLL: cross-entropy of each predicted token (float32 logits), summed in nats; bits per byte =
  total NLL / ln 2 / bytes; perplexity = exp(mean NLL per token).
* KL(source || export) per predicted token: ``sum_v p_s(v) (log p_s(v) - log p_e(v))``, mean.
* top-1 agreement: the share of predicted positions where both models' argmax is the same.
* layer error: per decoder layer, ``||h_e - h_s|| / ||h_s||`` of its output hidden states over
  all predicted positions (the L2 norms over every element).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class Sums:
    tokens: int = 0
    nbytes: int = 0
    nll_source: float = 0.0
    nll_export: float = 0.0
    kl: float = 0.0
    kl_max: float = 0.0
    agree: int = 0
    layer_err: dict[int, float] = field(default_factory=dict)
    layer_ref: dict[int, float] = field(default_factory=dict)

    def add_logits(self, src: torch.Tensor, exp: torch.Tensor, targets: torch.Tensor) -> None:
        """``src``/``exp``: [b, t, vocab] logits; ``targets``: [b, t] next-token ids."""
        ls = F.log_softmax(src.float(), dim=-1).flatten(0, 1)
        le = F.log_softmax(exp.float(), dim=-1).flatten(0, 1)
        tgt = targets.reshape(-1).to(ls.device)
        self.nll_source += float(-ls.gather(1, tgt[:, None]).sum())
        self.nll_export += float(-le.gather(1, tgt[:, None]).sum())
        kl = (ls.exp() * (ls - le)).sum(-1)
        self.kl += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.agree += int((ls.argmax(-1) == le.argmax(-1)).sum())
        self.tokens += int(tgt.numel())

    def add_layer(self, i: int, src: torch.Tensor, exp: torch.Tensor) -> None:
        d = exp.float() - src.float()
        self.layer_err[i] = self.layer_err.get(i, 0.0) + float((d * d).sum())
        self.layer_ref[i] = self.layer_ref.get(i, 0.0) + float((src.float() ** 2).sum())


def per_byte(nll_nats: float, nbytes: int) -> float:
    return nll_nats / math.log(2) / max(nbytes, 1)


def figures(s: Sums, unit: str, top_layers: int) -> dict[str, Any]:
    """The report's numbers from the sums (``unit``: "byte" or "token")."""
    src_bits = per_byte(s.nll_source, s.nbytes)
    exp_bits = per_byte(s.nll_export, s.nbytes)
    layers = [
        {"layer": i, "rel_l2": math.sqrt(s.layer_err[i] / s.layer_ref[i])}
        for i in sorted(s.layer_err)
        if s.layer_ref.get(i, 0.0) > 0
    ]
    moved = sorted(layers, key=lambda r: -r["rel_l2"])[:top_layers]
    return {
        f"source_bits_per_{unit}": src_bits,
        f"export_bits_per_{unit}": exp_bits,
        "relative_increase": exp_bits / src_bits - 1.0 if src_bits > 0 else None,
        "source_perplexity": math.exp(s.nll_source / max(s.tokens, 1)),
        "export_perplexity": math.exp(s.nll_export / max(s.tokens, 1)),
        "kl_mean": s.kl / max(s.tokens, 1),
        "kl_max": s.kl_max,
        "top1_agreement": s.agree / max(s.tokens, 1),
        "tokens": s.tokens,
        "bytes": s.nbytes,
        "layers": layers,
        "layers_moved_most": moved,
    }
