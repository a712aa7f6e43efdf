"""Writing checkpoints: a model (or state dict) to DCP, HF safetensors dir <-> DCP.

* ``save_model_dcp`` writes a DCP dir from one process or from every rank of a process group. On
  N ranks each tensor with at least N rows is saved as a ``Shard(0)`` DTensor, so every rank
  writes its own rows into its own file: a truly sharded checkpoint, which is what makes an
  N -> M resharded load (several read items per destination, from several files) real.
* ``hf_dir_to_dcp`` / ``dcp_to_hf_dir`` go through the model's state-dict names; the HF side
  uses the per-expert names of ``qckpt.models.naming.hf_tensors`` (what ``save_pretrained``
  writes), so transformers' ``from_pretrained`` loads our HF dirs.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qckpt.errors import CheckpointError
from qckpt.load.destination import destination_of


def _plain_state_dict(model_or_state_dict: nn.Module | dict[str, Any]) -> dict[str, Any]:
    sd = (
        model_or_state_dict.state_dict(keep_vars=True)
        if isinstance(model_or_state_dict, nn.Module)
        else dict(model_or_state_dict)
    )
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            # checkpoints hold high-precision values (as TE's save path does): a quantized
            # param is saved as its dequantized nominal-dtype value
            dest = destination_of(v)
            v = dest.dequantize(dest.dtype) if dest is not None else v.detach()
        out[k] = v
    return out


def _world(mesh: Any) -> tuple[Any, int, int]:
    group = getattr(mesh, "world_group", None)
    if dist.is_available() and dist.is_initialized():
        g = group if group is not None else dist.group.WORLD
        return g, dist.get_world_size(g), dist.get_rank(g)
    return None, 1, 0


def _shard_rows(t: torch.Tensor, world: int) -> bool:
    """Shard along dim 0 only where torch.chunk gives every rank at least one row."""
    if t.dim() == 0 or world <= 1:
        return False
    n = t.shape[0]
    per = -(-n // world)
    return per * (world - 1) < n


def save_model_dcp(
    model_or_state_dict: nn.Module | dict[str, Any],
    out_dir: str | os.PathLike,
    mesh: Any = None,
) -> Path:
    """Write a DCP checkpoint of the model's (or state dict's) values into ``out_dir``.

    Collective when a process group runs (every rank calls it with the same values); then each
    rank writes the rows ``torch.chunk`` gives it of every tensor it can shard.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    sd = _plain_state_dict(model_or_state_dict)
    group, world, rank = _world(mesh)
    out = Path(out_dir)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        dev_type = next((v.device.type for v in sd.values() if isinstance(v, torch.Tensor)), "cpu")
        dmesh = init_device_mesh(dev_type, (world,))
        for k, v in list(sd.items()):
            if isinstance(v, torch.Tensor) and _shard_rows(v, world):
                local = torch.chunk(v, world, dim=0)[rank].contiguous()
                sd[k] = DTensor.from_local(
                    local, dmesh, [Shard(0)], run_check=False, shape=v.shape, stride=v.stride()
                )
    else:
        out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save(
            sd,
            storage_writer=FileSystemWriter(str(out)),
            process_group=group,
            no_dist=world <= 1,
        )
    return out


def hf_dir_to_dcp(
    hf_dir: str | os.PathLike, out_dir: str | os.PathLike, model: nn.Module | None = None
) -> Path:
    """Convert an HF safetensors dir into a DCP dir in the model's state-dict names.

    ``model`` tells how per-expert tensors fuse (its state-dict shapes and model type); without
    it, complete per-expert groups are fused as naming says. Holds the state dict in memory.
    """
    from qckpt.read.readers import iter_checkpoint_tensors, open_reader

    if model is not None:
        reader = open_reader(hf_dir, "safetensors", model=model)
        md = reader.read_metadata()
        sd: dict[str, Any] = {}
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        for name, tmd in md.state_dict_metadata.items():
            sd[name] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_load(sd, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    else:
        sd = dict(iter_checkpoint_tensors(hf_dir, "safetensors"))
    return save_model_dcp(sd, out_dir)


def _config_dict(model_config: Any) -> dict[str, Any]:
    cfg = getattr(model_config, "config", model_config)
    if isinstance(cfg, dict):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):
        return json.loads(cfg.to_json_string()) if hasattr(cfg, "to_json_string") else cfg.to_dict()
    raise CheckpointError(f"dcp_to_hf_dir: cannot write a config.json from {type(cfg).__name__}")


def _check_fits(dcp_dir: str | os.PathLike, config: Any) -> None:
    """The checkpoint holds exactly the model's tensors, names and shapes, or a one-line error
    naming the first that does not fit (before anything is written)."""
    from transformers import AutoModelForCausalLM

    from qckpt.models import naming
    from qckpt.read.readers import checkpoint_names_shapes

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    want = {
        n: tuple(t.shape)
        for k, v in model.state_dict().items()
        for n, t in naming.hf_tensors(k, v, config.model_type)
    }
    have = {}
    for k, (shape, _dtype) in checkpoint_names_shapes(dcp_dir, "dcp").items():
        meta = torch.empty(tuple(shape), device="meta")
        for n, t in naming.hf_tensors(k, meta, config.model_type):
            have[n] = tuple(t.shape)
    tied = getattr(config, "tie_word_embeddings", False)
    for n, shape in want.items():
        if n not in have:
            if tied and n == "lm_head.weight":
                continue
            raise CheckpointError(
                f"{n}: the model ({config.model_type}) has it, the checkpoint does not"
            )
        if have[n] != shape:
            raise CheckpointError(f"{n}: shape {have[n]} in the checkpoint, {shape} in the model")
    extra = sorted(set(have) - set(want))
    if extra:
        raise CheckpointError(
            f"{extra[0]}: in the checkpoint but not in the model ({config.model_type})"
        )


def dcp_to_hf_dir(
    dcp_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    model_config: Any,
    *,
    max_shard_bytes: int | None = None,
    model_files_from: str | os.PathLike | None = None,
) -> Path:
    """Write the DCP checkpoint as an HF safetensors dir (per-expert names) + ``config.json``.

    One ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``, written by the shard writer that
    export uses: one checkpoint tensor in memory at a time. The tokenizer, generation config
    and chat template of ``model_files_from`` (a model dir) are copied along, as export does.
    """
    from qckpt.read.detect import TRAINING_FORMATS, resolve_format
    from qckpt.read.hf_names import hf_entries, iter_hf_tensors
    from qckpt.read.readers import open_source
    from qckpt.read.sources import DCPSource
    from qckpt.storage.files import write_json
    from qckpt.storage.model_files import copy_model_files
    from qckpt.storage.shards import plan_shards, write_shards

    cfg = _config_dict(model_config)
    model_type = str(cfg.get("model_type", ""))
    fmt = resolve_format(dcp_dir)
    if fmt in TRAINING_FORMATS:  # in HF names already; the mapping checks the fit
        src = open_source(dcp_dir, fmt, config=model_config)
    else:
        if hasattr(model_config, "to_json_string"):
            _check_fits(dcp_dir, model_config)
        src = DCPSource(dcp_dir)
    entries = hf_entries(src.entries(), model_type)
    plan = plan_shards(([e] for e in entries), max_shard_bytes, single_file_name=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = ((he.name, t) for he, t in iter_hf_tensors(src, entries, model_type))
    write_shards(out, plan, tensors, metadata={"format": "pt"})
    write_json(out / "config.json", cfg)
    if model_files_from is not None:
        copy_model_files(model_files_from, out)
    return out
