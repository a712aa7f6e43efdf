"""``qckpt export`` straight from a Megatron-Core checkpoint vs the two-step path through HF BF16.

    python -m bench.megatron_export --work /data/mc --json megatron_export.json            # 61 GB
    python -m bench.megatron_export --work /data/mc --layers 12 --json megatron_export.json  # 16 GB

1. A Qwen3-30B-A3B-shaped checkpoint (hidden 2048, 48 layers, 32 heads / 4 KV groups of 128,
   128 experts of 768, vocab 151936 padded to 152064; 61 GB BF16) is written in the layout
   megatron-core 0.16.1 writes for it (tests/fixtures/megatron: stacked layers, TE norm names,
   experts on an expert axis with fc1 in two row fragments, embeddings TP2-split), one chunk at
   a time straight into ``.distcp`` files (plain DCP: ``torch.save`` records and a pickled
   ``Metadata``), so writing it needs no model in memory. Values: one random base per chunk
   shape, scaled per chunk (cheap, finite, distinct); norms are ones.
2. A calibration file from the checkpoint's metadata (every weight amax 0.25, inputs 4.0: no read).
3. One step: ``qckpt export`` with ``checkpoint.format: megatron`` (timed, its ``--json`` report:
   seconds, peak host RSS / anonymous memory, device peak).
4. Two steps: ``qckpt convert MC HF --to hf --model CFG`` (the BF16 HF copy, timed, peak RSS),
   then ``qckpt export`` from it; the HF copy is deleted after.
5. Both exports' files are hashed: they must be byte-identical ("same_files").

``--open-only``: the checkpoint's ``.metadata`` alone (no data), and the seconds that opening it
as a source takes (the export's planning), at any ``--layers`` in seconds of disk.

Disk: the checkpoint (61 GB at 48 layers), one export at a time (FP8: ~31 GB) and, during
step 4, the HF copy (61 GB): about 155 GB. On one H200 (64 GB disk, 128 GiB memory):
``--work /dev/shm/mc`` (the checkpoint and, by default, the exports in tmpfs: ~92 GB) and
``--hf-dir /tmp/mc-hf`` (the HF copy alone on the disk). The run checks the room first.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def qwen3_30b_config(layers: int, tiny: bool = False):
    from transformers import Qwen3MoeConfig

    if tiny:  # the same code path at a size a CPU test runs in seconds
        return Qwen3MoeConfig(
            vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            norm_topk_prob=True, tie_word_embeddings=False, dtype="bfloat16",
        )  # fmt: skip
    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6, dtype="bfloat16",
    )  # fmt: skip


def _layout(cfg, tp: int, ep: int) -> list[tuple[str, tuple, list[tuple[tuple, tuple]]]]:
    """(stored name, global shape, [(chunk offsets, chunk sizes)]) as megatron-core saves them."""
    L, H, E = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts
    F, D = cfg.moe_intermediate_size, cfg.head_dim
    rows_qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D
    vp = -(-cfg.vocab_size // (128 * tp)) * 128 * tp
    out = []

    def split(name, shape, lead, axis, parts):  # noqa: ANN001, ANN202
        chunks = []
        idx = [()]
        for n in shape[:lead]:
            idx = [(*a, j) for a in idx for j in range(n)]
        local = shape[lead:]
        for ix in idx:
            size = local[axis] // parts
            for p in range(parts):
                offs = [0] * len(local)
                offs[axis] = p * size
                sizes = list(local)
                sizes[axis] = size
                chunks.append(((*ix, *offs), (*(1,) * lead, *sizes)))
        out.append((name, tuple(shape), chunks))

    split("embedding.word_embeddings.weight", (vp, H), 0, 0, tp)
    split("output_layer.weight", (vp, H), 0, 0, tp)
    split("decoder.final_layernorm.weight", (H,), 0, 0, 1)
    pre = "decoder.layers."
    split(pre + "self_attention.linear_qkv.layer_norm_weight", (L, H), 1, 0, 1)
    split(pre + "self_attention.linear_qkv.weight", (L, rows_qkv, H), 1, 0, tp)
    split(pre + "self_attention.linear_proj.weight", (L, H, cfg.num_attention_heads * D), 1, 1, tp)
    split(pre + "self_attention.q_layernorm.weight", (L, D), 1, 0, 1)
    split(pre + "self_attention.k_layernorm.weight", (L, D), 1, 0, 1)
    split(pre + "mlp.linear_fc1.layer_norm_weight", (L, H), 1, 0, 1)
    split(pre + "mlp.router.weight", (L, E, H), 1, 0, 1)
    # experts: one chunk per (layer, expert), fc1 in two row fragments (the swiglu factory)
    split(pre + "mlp.experts.experts.linear_fc1.weight", (L, E, 2 * F, H), 2, 0, 2)
    split(pre + "mlp.experts.experts.linear_fc2.weight", (L, E, H, F), 2, 0, 1)
    del ep  # expert parallelism changes which rank wrote a chunk, not the chunks
    return out


def save_metadata(out: Path, layout: list, storage: dict) -> None:
    """``.metadata`` (plain DCP: a pickled ``Metadata``) and Megatron's ``metadata.json`` for
    ``layout`` (``_layout``'s rows), its chunks where ``storage`` says."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    sd_md = {
        name: TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16),
            torch.Size(shape),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z in chunks],
        )
        for name, shape, chunks in layout
    }
    md = Metadata(state_dict_metadata=sd_md, storage_data=storage, storage_meta=StorageMeta())
    (out / ".metadata").write_bytes(pickle.dumps(md))
    (out / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1,
    }))  # fmt: skip


def write_layout(out: Path, cfg, tp: int = 2, ep: int = 8, files: int = 8) -> int:
    """The checkpoint at ``out``, streamed chunk by chunk; returns its bytes.

    One writer thread per ``.distcp`` file (chunk ``k`` goes to file ``k % files``, in order), so
    the pickling and the disk overlap; the values do not depend on the threads (each chunk's base
    is drawn up front in chunk order, its scale comes from ``k``).
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        MetadataIndex,
    )

    out.mkdir(parents=True, exist_ok=True)
    layout = _layout(cfg, tp, ep)
    g = torch.Generator().manual_seed(0)
    bases: dict[tuple, torch.Tensor] = {}
    per_file: list[list[tuple]] = [[] for _ in range(files)]
    k = 0
    for name, _shape, chunks in layout:
        for offs, sizes in chunks:
            if "norm" not in name and sizes not in bases:
                bases[sizes] = (torch.randn(sizes, generator=g) * 0.02).to(torch.bfloat16)
            per_file[k % files].append((k, name, offs, sizes))
            k += 1

    def write_file(r: int) -> list[tuple]:
        placed = []
        with open(out / f"__{r}_0.distcp", "wb") as f:
            for k, name, offs, sizes in per_file[r]:
                if "norm" in name:
                    t = torch.ones(sizes, dtype=torch.bfloat16)
                else:
                    t = bases[sizes] * (1.0 + (k % 97) / 97.0)
                buf = io.BytesIO()
                torch.save(t.contiguous(), buf)
                data = buf.getbuffer()
                pos = f.tell()
                f.write(data)
                placed.append((name, offs, _StorageInfo(f"__{r}_0.distcp", pos, len(data))))
        return placed

    storage = {}
    with ThreadPoolExecutor(files) as pool:
        for placed in pool.map(write_file, range(files)):
            for name, offs, info in placed:
                storage[MetadataIndex(name, torch.Size(offs))] = info
    save_metadata(out, layout, storage)
    return sum(math.prod(z) * 2 for _, _, chunks in layout for _, z in chunks)


def open_seconds(work: Path, cfg) -> dict:
    """``--open-only``: the checkpoint's ``.metadata`` alone (every chunk's record pointing into
    one sparse file), then the seconds that opening it as a source and listing its HF entries
    take (the export's planning of a training checkpoint, the meta-model build included)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        MetadataIndex,
    )

    from qckpt.read.training_sources import TrainingSource

    out = work / f"meta-{cfg.num_hidden_layers}l"
    out.mkdir(parents=True, exist_ok=True)
    layout, storage, pos = _layout(cfg, 2, 8), {}, 0
    for name, _, chunks in layout:
        for o, _ in chunks:
            storage[MetadataIndex(name, torch.Size(o))] = _StorageInfo("__0_0.distcp", pos, 64)
            pos += 64
    save_metadata(out, layout, storage)
    with open(out / "__0_0.distcp", "wb") as f:
        f.truncate(pos)
    t0 = time.perf_counter()
    n = len(TrainingSource(out, "megatron", cfg).entries())
    return {"entries": n, "open_seconds": round(time.perf_counter() - t0, 2)}


# above every value write_layout draws (0.02-sigma bases scaled by at most 2): no code saturates
WEIGHT_AMAX = 0.25


def make_calibration(mc: Path, cfg_dir: Path, out: Path) -> Path:
    """A calibration file for the checkpoint from its metadata alone (no tensor is read).

    Every quantized linear gets weight amax ``WEIGHT_AMAX`` and input amax 4.0: the export's
    time and memory do not depend on the values, and both paths use the same file.
    """
    import torch

    from qckpt.calib.state_file import CalibrationState, model_fingerprint, save_calibration
    from qckpt.export.plan import model_linears
    from qckpt.models.build import load_config
    from qckpt.models.naming import ignored
    from qckpt.read.readers import open_source
    from qckpt.recipe import QuantConfig

    cfg = load_config(str(cfg_dir))
    mt, q = cfg.model_type, QuantConfig()
    src = open_source(mc, "megatron", config=cfg)
    linears, routers, _ = model_linears(cfg, mt)
    amax = {}
    for e in src.entries():
        module, _, leaf = e.name.rpartition(".")
        if leaf == "weight" and len(e.shape) == 2 and module in linears and module not in routers:
            if not ignored(module, q.ignore):
                amax[f"{module}.weight_amax"] = torch.tensor(WEIGHT_AMAX)
                amax[f"{module}.input_amax"] = torch.tensor(4.0)
    from dataclasses import asdict

    state = CalibrationState(
        amax=amax, model_type=mt, quant=asdict(q),
        model_fingerprint=model_fingerprint((e.name, e.shape) for e in src.entries()),
    )  # fmt: skip
    return save_calibration(state, out)


def _room_for(work: Path, scratch: Path, hf_dir: Path, cfg) -> None:
    """Stop before writing when the disks cannot hold the run: the checkpoint on ``work``, one
    FP8 export (about half the model) on ``scratch`` and the HF copy on ``hf_dir``, summed per
    file system. A full disk mid-write took a whole H200 machine down (2026-12-02)."""
    model = sum(math.prod(z) * 2 for _, _, chunks in _layout(cfg, 2, 8) for _, z in chunks)
    margin = 1 << 30
    need: dict[int, list] = {}
    for d, n in ((work, model), (scratch, model // 2), (hf_dir.parent, model)):
        dev = d.stat().st_dev
        need.setdefault(dev, [d, margin])[1] += n
    for d, n in need.values():
        free = shutil.disk_usage(d).free
        if free < n:
            raise SystemExit(
                f"megatron_export: {d} has {free / 1e9:.1f} GB free, the run needs "
                f"{n / 1e9:.1f} GB there (checkpoint {model / 1e9:.1f} GB; use --scratch / "
                "--hf-dir on another disk or tmpfs, or fewer --layers)"
            )


def _step(what: str, t0: float) -> None:
    print(
        f"[megatron_export] {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True
    )


def _cli(args: list[str], report: Path, cwd: Path) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qckpt", *args, "--json", str(report)],
                          cwd=cwd, capture_output=True, text=True, env=env)  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"qckpt {args[0]} failed:\n{proc.stderr[-3000:]}")
    return {"wall_seconds": round(wall, 3), "report": json.loads(report.read_text())}


def _recipe(work: Path, cfg_dir: Path, src: Path, fmt: str, cal: Path, out: Path, args) -> Path:
    r = work / f"export-{fmt}.yaml"
    r.write_text(
        f"model: {{source: {json.dumps(str(cfg_dir))}}}\n"
        f"checkpoint: {{path: {json.dumps(str(src))}, format: {fmt}}}\n"
        f"calibrate: {{output: {json.dumps(str(cal))}}}\n"
        f"export: {{output: {json.dumps(str(out))}, format: {args.format}, device: {args.device}}}\n"
    )
    return r


def _peaks(rep: dict) -> dict:
    peaks = rep.get("peaks", {})
    keys = ("seconds", "gbps", "peak_rss_bytes", "peak_rss_anon_bytes", "write_rss_anon_bytes",
            "host_bound_bytes", "device_peak_bytes")  # fmt: skip
    out = {k: rep[k] for k in keys if k in rep}
    out.update({k: v for k, v in peaks.items() if "peak" in k})
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.export import file_digests

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work", required=True, help="a dir on the disk to measure (kept: the checkpoint)"
    )
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument(
        "--format", default="compressed-tensors", choices=["compressed-tensors", "modelopt"]
    )
    ap.add_argument(
        "--scratch",
        default=None,
        help="where the exports and the HF copy go (default: --work); e.g. tmpfs when the disk "
        "holds only the checkpoint",
    )
    ap.add_argument(
        "--hf-dir",
        default=None,
        help="where the two-step path's HF BF16 copy goes (default: SCRATCH/hf-bf16); on one "
        "H200 the checkpoint and exports fit in tmpfs and the copy on the disk",
    )
    ap.add_argument(
        "--keep-hf", action="store_true", help="keep the HF BF16 copy (scratch/hf-bf16) after"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="a small model: checks the script on a CPU")
    ap.add_argument(
        "--open-only",
        action="store_true",
        help="only time opening the checkpoint (its .metadata alone, no data): the planning",
    )
    args = ap.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    scratch = Path(args.scratch).resolve() if args.scratch else work
    scratch.mkdir(parents=True, exist_ok=True)
    hf = Path(args.hf_dir).resolve() if args.hf_dir else scratch / "hf-bf16"
    hf.parent.mkdir(parents=True, exist_ok=True)
    cfg = qwen3_30b_config(args.layers, args.tiny)
    cfg_dir, mc = work / "hf-config", work / f"mc-{args.layers}l"
    cfg_dir.mkdir(exist_ok=True)
    (cfg_dir / "config.json").write_text(cfg.to_json_string())
    result: dict = {"layers": args.layers}
    if args.open_only:
        print(json.dumps({**result, **open_seconds(work, cfg)}))
        return 0
    if not (mc / ".metadata").exists():
        _room_for(work, scratch, hf, cfg)
        t0 = time.perf_counter()
        result["checkpoint_bytes"] = write_layout(mc, cfg)
        result["write_layout_seconds"] = round(time.perf_counter() - t0, 1)
        _step("checkpoint written", t0)
    cal = work / f"calib-{args.layers}l.safetensors"
    if not cal.exists():
        make_calibration(mc, cfg_dir, cal)
    out1 = scratch / "export-one-step"
    shutil.rmtree(out1, ignore_errors=True)
    t0 = time.perf_counter()
    one = _cli(
        ["export", str(_recipe(work, cfg_dir, mc, "megatron", cal, out1, args))],
        work / "one.json",
        work,
    )
    result["one_step"] = {"export": {"wall_seconds": one["wall_seconds"], **_peaks(one["report"])}}
    _step("one-step export", t0)
    d1 = file_digests(out1)
    _step("one-step export hashed", t0)
    shutil.rmtree(out1)
    out2 = scratch / "export-two-step"
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(out2, ignore_errors=True)
    t0 = time.perf_counter()
    conv = _cli(
        ["convert", str(mc), str(hf), "--to", "hf", "--model", str(cfg_dir)],
        work / "conv.json",
        work,
    )
    _step("convert to HF BF16", t0)
    two = _cli(
        ["export", str(_recipe(work, cfg_dir, hf, "safetensors", cal, out2, args))],
        work / "two.json",
        work,
    )
    result["two_step"] = {
        "convert": {"wall_seconds": conv["wall_seconds"], **_peaks(conv["report"])},
        "export": {"wall_seconds": two["wall_seconds"], **_peaks(two["report"])},
        "hf_copy_bytes": sum(p.stat().st_size for p in hf.iterdir()),
    }
    _step("two-step export", t0)
    result["same_files"] = file_digests(out2) == d1
    _step("two-step export hashed", t0)
    result["scratch"], result["hf_dir"] = str(scratch), str(hf)
    if not args.keep_hf:
        shutil.rmtree(hf)
    shutil.rmtree(out2)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if result["same_files"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
