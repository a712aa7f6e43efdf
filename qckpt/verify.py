"""Does an export load in Hugging Face transformers, and do its logits stay close to BF16?

The measure: next-token logits at the last position of ``num_seqs`` seeded random sequences,
export vs the unquantized reference model read from the DCP checkpoint. We report the minimum
cosine similarity over the sequences and the top-1 agreement; ``min_cosine`` (default 0.99) is
the pass threshold. Usage: ``python -m qckpt.verify EXPORT_DIR REFERENCE_DCP [--min-cosine X]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # a command: quiet the libraries before torch (and tqdm) load
    from qckpt.term import quiet_third_party

    quiet_third_party()

import torch  # noqa: E402


def reference_model(dcp_dir: str | Path, model_source: str | None = None, dtype=torch.bfloat16):
    """The unquantized model with the checkpoint's own values (read through the safe reader)."""
    import torch.distributed.checkpoint as dcp

    from qckpt.models.build import build_model, materialize
    from qckpt.storage.dcp_metadata import SafeFileSystemReader

    source = model_source or str(dcp_dir)
    # on meta, then allocated: the checkpoint fills every tensor (DCP refuses one it lacks),
    # so no random init is drawn for it
    model = materialize(build_model(source, dtype=dtype, device="meta"), "cpu")
    sd = model.state_dict()
    dcp.load(sd, storage_reader=SafeFileSystemReader(str(dcp_dir)), no_dist=True)
    model.load_state_dict(sd)
    return model.eval()


@torch.no_grad()
def compare_logits(
    export_dir: str | Path,
    reference: torch.nn.Module,
    *,
    num_seqs: int = 8,
    seq_len: int = 16,
    seed: int = 1234,
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    quant = AutoModelForCausalLM.from_pretrained(
        str(export_dir), dtype=torch.bfloat16, trust_remote_code=False
    ).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, reference.config.vocab_size, (num_seqs, seq_len), generator=g)
    a = reference(ids).logits[:, -1].float()
    b = quant(ids).logits[:, -1].float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return {
        "min_cosine": float(cos.min()),
        "mean_cosine": float(cos.mean()),
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "max_abs_diff": float((a - b).abs().max()),
        "num_seqs": num_seqs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qckpt.verify", description=__doc__)
    ap.add_argument("export_dir")
    ap.add_argument("reference_dcp")
    ap.add_argument(
        "--model", default=None, help="model source when the DCP dir has no config.json"
    )
    ap.add_argument("--min-cosine", type=float, default=0.99)
    args = ap.parse_args(argv)
    from qckpt.term import quiet_third_party, quiet_torch_logs

    quiet_third_party()
    quiet_torch_logs()
    from qckpt.term import third_party_stderr_muted

    with third_party_stderr_muted():  # compressed-tensors' progress bars ignore every switch
        ref = reference_model(args.reference_dcp, args.model)
        m = compare_logits(args.export_dir, ref)
    ok = m["min_cosine"] >= args.min_cosine
    print(
        f"export {args.export_dir}: next-token logits vs BF16: min cosine {m['min_cosine']:.5f} "
        f"(threshold {args.min_cosine}), mean {m['mean_cosine']:.5f}, "
        f"top-1 agreement {m['top1_agreement']:.0%} -> {'OK' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
