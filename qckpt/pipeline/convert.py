"""``qckpt convert``'s body: a recipe's model, an HF dir or a DCP dir written as DCP or HF.

Every rank calls ``convert``: the main rank makes one temp dir beside DST and tells the others
its name, each writes its part, and the main rank renames it into place once all are done; on
any failure the temp dir goes and DST is untouched.
"""

from __future__ import annotations

from pathlib import Path

from qckpt import phases
from qckpt.atomic import AtomicDir, atomic_dir, write_error
from qckpt.errors import OutputError, UsageError
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.model import build
from qckpt.recipe import Recipe


def convert(
    *,
    kind: str,
    to: str,
    src: Path,
    dst: Path,
    recipe: Recipe,
    mesh: Mesh,
    model_config: str | None = None,
) -> None:
    """Write ``src`` (``kind``: recipe | hf | dcp) to ``dst`` as ``to`` (dcp | hf).

    ``model_config``: where a DCP dir without config.json takes its model config from.
    """
    out = AtomicDir(dst, key="DST", replace=True, may_replace=empty_dir)
    tmp = _begin_all(out, mesh)
    try:
        with phases.phase(phases.WRITE):  # a model's build inside is charged to build
            if kind == "dcp":
                _dcp_to_hf(src, tmp, mesh, model_config)
            else:
                _model_to(to, kind, src, tmp, recipe, mesh)
        _barrier(mesh)
        if mesh.is_main:  # written whole, then renamed: a failure leaves no half checkpoint
            out.commit()
    except BaseException as exc:
        if mesh.is_main:  # nothing half-written stays behind
            out.abort()
        err = write_error(exc, out.target, "DST", None)
        if err is not None:
            raise err from exc
        raise


def _dcp_to_hf(src: Path, tmp: Path, mesh: Mesh, model_config: str | None) -> None:
    from qckpt.convert.dcp import dcp_to_hf_dir
    from qckpt.models.build import load_config

    cfg_src = model_config or (str(src) if (src / "config.json").is_file() else None)
    if cfg_src is None:
        raise UsageError(f"{src}: has no config.json; pass --model SOURCE for the model config")
    if mesh.is_main:
        files_from = model_config if model_config and Path(model_config).is_dir() else src
        dcp_to_hf_dir(src, tmp, load_config(cfg_src), model_files_from=files_from)


def _model_to(to: str, kind: str, src: Path, tmp: Path, recipe: Recipe, mesh: Mesh) -> None:
    """A recipe's seeded model (or an HF dir's weights, ``kind="hf"``) into ``tmp``."""
    from qckpt.convert.dcp import hf_dir_to_dcp, save_model_dcp
    from qckpt.storage.model_files import copy_model_files

    # the whole model on every rank: save_model_dcp splits the rows over the ranks itself
    m = recipe.model
    built = build(m.source, mesh, dtype=m.dtype, seed=m.seed, seeded=True, sharded=False).model
    if to == "hf":  # a recipe's seeded model, written the way transformers writes it
        if mesh.is_main:
            built.save_pretrained(str(tmp))
    else:
        if kind == "hf":
            hf_dir_to_dcp(src, tmp, built)
        else:
            save_model_dcp(built, tmp, mesh=mesh)
        if mesh.is_main:
            # the DCP dir carries its model config so that `--to hf` and `inspect` need no recipe
            (tmp / "config.json").write_text(built.config.to_json_string())
    if mesh.is_main and Path(m.source).is_dir():
        # tokenizer, generation config, chat template: what `--to hf` carries on
        copy_model_files(m.source, tmp)


def dequantize_hf(src: Path, dst: Path, dtype: str) -> dict:
    """A quantized HF dir -> a plain HF dir of ``dtype``, streaming, written then renamed;
    returns ``dequantize_dir``'s counts."""
    from qckpt.convert.dequantize import DTYPES, dequantize_dir

    with (
        phases.phase(phases.WRITE),
        atomic_dir(dst, key="DST", replace=True, may_replace=empty_dir) as tmp,
    ):
        return dequantize_dir(src, tmp, dtype=DTYPES[dtype])


def empty_dir(path: Path) -> None:
    """DST may be an empty dir (replaced), never anything else: checked again at the swap."""
    if not path.is_dir() or path.is_symlink() or any(path.iterdir()):
        raise OutputError(
            f"DST: {path} appeared while this command wrote it; refusing to replace it"
        )


def _begin_all(out: AtomicDir, mesh: Mesh) -> Path:
    """One temp dir for all ranks: the main rank makes it, the others learn its name (or that
    it failed, so that nobody waits for a dir that will never come)."""
    if mesh.world_size == 1:
        return out.begin()
    import torch.distributed as dist

    box: list[str | None] = [None]
    try:
        if mesh.is_main:
            box[0] = str(out.begin())
    finally:
        dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        raise OutputError(f"DST: the main rank could not create a temp dir beside {out.target}")
    return Path(box[0])


@phases.timed(phases.SYNC)
def _barrier(mesh: Mesh) -> None:
    if mesh.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
