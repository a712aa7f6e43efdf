"""Imports a command will need, made in its start-up phase (``qckpt.phases``).

qckpt imports torch, transformers and its own heavy modules lazily, so that commands which need
none of them (``--help``, ``check``, ``inspect`` of an HF dir, a refused recipe) start in a
fraction of a second. A command that will need them pays for them once either way; importing
them up front only moves that time into ``startup``, where a user expects it, instead of
leaving it inside ``build`` or ``plan`` as if it were work.

The model's code is imported first, then the command's own modules, so that the start-up's
parts (``phases.MODEL_CODE``, ``phases.QCKPT_MODULES``) charge a module both need (DTensor,
sympy, dynamo: transformers' modeling code imports them) to the model, and what qckpt adds on
top of it to qckpt.
"""

from __future__ import annotations

import contextvars
import importlib
import os
import threading
from dataclasses import dataclass
from typing import Any

from qckpt import phases

# the fast read's sizes without its engine (which imports torch.distributed.checkpoint)
from qckpt.read import read_sizes

# the CLI's switch for the start-up's CUDA warm-up (on for CUDA commands; 0 turns it off)
CUDA_WARMUP_ENV = "QCKPT_CUDA_WARMUP"


# Nominal shapes the warm-up quantizes: a 2-D weight and a 3-D fused-experts weight. Triton
# specializes a kernel on its integer arguments (== 1, % 16 == 0), its pointers' 16-byte
# alignment and its constexprs (the 1-D kernels' EVEN: numel a multiple of 65536 here, as in
# the dims models use; mxfp8's blocks per row: 64, a multiple of 16, and 24, not one)
WARM_SHAPES = ((256, 2048), (2, 128, 768))


@dataclass(frozen=True, kw_only=True)
class CudaWarmup:
    """What the start-up's CUDA thread makes ready while the model's code imports.

    ``params``: the format the load quantizes its destinations to ("none": no quantize), once
    on small tensors of ``dtype`` (the model's) through the same calls as the planner's commit,
    so that Triton's kernels are compiled (or loaded from its cache) then, not at the load's
    first quantized destination; ``whole_amax``: also the sharded load's whole-tensor amax path.
    ``pinned_buffers`` of ``pinned_bytes``: pinned host buffers made and freed at once, so that
    torch's host caching allocator hands them to the fast read's pool without pinning pages
    then (no more of them than that read makes: the host peak stays the load's own)."""

    params: str = "none"
    dtype: str = "bfloat16"
    whole_amax: bool = False
    pinned_buffers: int = 0
    pinned_bytes: int = read_sizes.CHUNK_BYTES


def warm_imports(
    source: str | None, *modules: str, cuda_first_use: bool | CudaWarmup = False
) -> None:
    """Import the transformers modeling code of ``source``'s architecture (a built-in name or a
    model dir), then ``modules`` (dotted names). A source that cannot be read is left to the
    command, which reports it where it always has.

    ``cuda_first_use`` (True, or a :class:`CudaWarmup` saying what else to warm): meanwhile,
    make this rank's first CUDA tensor on a thread (CUDA's context, 0.3-0.9 s on an H200, is
    created with the GIL released, so it overlaps the imports), then the warm-up's quantize and
    pinned buffers there; joined before returning, and this thread's device then set to that
    rank's GPU, before any phase boundary synchronizes one. Any failure there is swallowed: the
    world's set-up or the load meets it again and reports it as it always has."""
    plan = cuda_first_use if isinstance(cuda_first_use, CudaWarmup) else CudaWarmup()
    first_use = _start_first_use(plan) if cuda_first_use else None
    try:
        if source is not None:
            with phases.startup_part(phases.MODEL_CODE):
                _model_code(source)
    finally:
        # joined before qckpt's own modules are imported: those imports are not guarded as the
        # model code's are, and two threads importing modules that import each other can get a
        # partly initialised module; the thread's imports (formats, Triton) are done by then
        if first_use is not None:
            _finish_first_use(*first_use)
    with phases.startup_part(phases.QCKPT_MODULES):
        for name in modules:
            importlib.import_module(name)


def _start_first_use(plan: CudaWarmup) -> tuple[threading.Thread, int]:
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    # the caller's context: its kernel policy (a context variable) picks the kernels warmed
    ctx = contextvars.copy_context()

    def first_use() -> None:
        try:
            # no CUDA here, or no such GPU: the world's set-up decides and words the error
            if not (torch.cuda.is_available() and local < torch.cuda.device_count()):
                return
            dev = torch.device("cuda", local)
            # not set_device first: it would create the context holding the GIL; a tensor's
            # allocation creates it inside the op, where torch has released the GIL
            torch.empty(1, device=dev)
            # this thread's kernels (Triton launches on the current device) on this rank's GPU
            torch.cuda.set_device(dev)
        except Exception:  # noqa: BLE001 - the world's set-up meets it again and reports it
            return
        for step in (warm_quantize, warm_pinned):
            try:
                step(plan, dev)
            except Exception:  # noqa: BLE001 - a warm-up only: the load meets it and reports it
                pass

    t = threading.Thread(target=ctx.run, args=(first_use,), name="qckpt-cuda-first-use")
    t.daemon = True
    t.start()
    return t, local


def warm_quantize(plan: CudaWarmup, dev: Any) -> None:
    """The planner's quantize at a destination's commit (``quantize_`` under
    ``defer_finite_checks``, then ``first_not_finite``) once per shape of ``WARM_SHAPES``, on
    tensors of its own: nothing the load holds is touched. Under the caller's kernel policy,
    but never ``torch.compile`` here (dynamo on a thread while the model's code imports it)."""
    if plan.params in ("none", "", None):
        return
    import dataclasses

    import torch

    from qckpt import formats
    from qckpt.formats.numerics import defer_finite_checks, first_not_finite
    from qckpt.kernel_policy import current_policy, kernel_policy

    dtype = getattr(torch, plan.dtype)
    amaxes: list[Any] = [None]
    if plan.whole_amax:
        amaxes.append(torch.ones((), dtype=torch.float32, device=dev))
    with kernel_policy(dataclasses.replace(current_policy(), compile="never")):
        for shape in WARM_SHAPES:
            src = torch.ones(shape, dtype=dtype, device=dev)
            q = formats.empty(shape, plan.params, nominal_dtype=dtype, device=dev)
            for amax in amaxes:
                try:
                    with defer_finite_checks() as checks:
                        if amax is None:
                            q.quantize_(src, update_state=False)
                        else:
                            q.quantize_(src, update_state=False, amax=amax)
                    first_not_finite(checks)
                except Exception:  # noqa: BLE001 - e.g. a per-block format refuses an amax
                    pass
    torch.cuda.synchronize(dev)


def warm_pinned(plan: CudaWarmup, dev: Any) -> None:
    """Pinned host buffers made and dropped: torch's host caching allocator keeps a freed
    pinned block and hands it to the next ``torch.empty(n, pin_memory=True)`` of its size."""
    import torch

    bufs = [
        torch.empty(plan.pinned_bytes, dtype=torch.uint8, pin_memory=True)
        for _ in range(plan.pinned_buffers)
    ]
    del bufs


def _finish_first_use(t: threading.Thread, local: int) -> None:
    import torch

    t.join()
    try:
        if torch.cuda.is_initialized():
            # this (main) thread's current device, before a phase boundary synchronizes it: the
            # default, GPU 0, would get a context of every rank
            torch.cuda.set_device(local)
    except Exception:  # noqa: BLE001 - the world's pick_device raises the worded error
        pass


def cuda_warmup_wanted(device: str, env: dict[str, Any]) -> bool:
    """The CLI's reading of ``QCKPT_CUDA_WARMUP`` for a command whose device is ``device``:
    on unless the recipe runs on the CPU or the variable is 0."""
    return device != "cpu" and env.get(CUDA_WARMUP_ENV, "1") != "0"


def cuda_warmup(recipe: Any, command: str, env: dict[str, Any]) -> CudaWarmup | None:
    """What ``command`` (``load`` or ``calibrate``) of ``recipe`` warms at its start-up, or
    None (a CPU recipe, or ``QCKPT_CUDA_WARMUP=0``)."""
    if not cuda_warmup_wanted(recipe.load.device, env):
        return None
    lo = recipe.load
    if command == "load":
        params = lo.params if lo.backend == "native" else "none"
    else:
        res = recipe.calibrate.weights_resident
        params = "none" if res == "bf16" else res
    par = getattr(recipe, "parallel", None)
    sharded = getattr(par, "ep", 1) * getattr(par, "tp", 1) > 1
    fast = lo.reader == "fast" and (command == "load" or recipe.calibrate.offload == "none")
    return CudaWarmup(
        params=params,
        dtype=recipe.model.dtype,
        whole_amax=sharded,
        pinned_buffers=pinned_buffers(recipe.checkpoint.path) if fast else 0,
    )


def pinned_buffers(path: str) -> int:
    """How many pinned buffers the fast read of ``path`` may make: its pool's (threads + 2,
    plus the read-ahead's staging), but no more than the checkpoint's files fill."""
    chunk = read_sizes.CHUNK_BYTES
    pool = read_sizes.default_threads() + 2 + max(1, read_sizes.READ_AHEAD_BYTES // chunk)
    try:
        with os.scandir(path) as it:
            size = sum(e.stat().st_size for e in it if e.is_file())
    except OSError:
        return 0  # the load reports the unreadable checkpoint
    return min(pool, -(-size // chunk))


def _model_code(source: str) -> None:
    try:
        from transformers import AutoModelForCausalLM

        from qckpt.models.build import load_config

        # looking the config class up imports its architecture's modeling module
        AutoModelForCausalLM._model_mapping[type(load_config(source))]
    except Exception:  # noqa: BLE001 - a warm-up only: the build raises the real error
        pass
