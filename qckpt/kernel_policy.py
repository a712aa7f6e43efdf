"""Which kernels a quantize (qckpt.formats) may use: a value, scoped with a context manager.

It lives outside qckpt.formats so that the CLI can read it before it imports torch.

The torch path (eager or ``torch.compile``d per-chunk kernels) runs everywhere; on CUDA the
hand-written Triton kernels (:mod:`qckpt.formats.triton_kernels`) take the cases they cover. Every path
gives the same bits, so the policy changes speed only. The library never reads the environment
for it: the CLI turns ``QCKPT_COMPILE`` / ``QCKPT_TRITON`` / ``QCKPT_TRITON_SOFT_CVT`` into a
policy (:meth:`KernelPolicy.from_env`) and scopes the command with it; a library caller passes
``policy=`` to :func:`qckpt.formats.quantize` or uses ``with kernel_policy(...)``.

A kernel that fails at run time turns its own path off for the process with one warning; that
is a learned fact about the machine, not a policy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads the policy before it imports torch
    import torch

COMPILE_MODES = ("auto", "always", "never")


@dataclass(frozen=True, kw_only=True)
class KernelPolicy:
    # torch.compile of the per-chunk kernels: auto = on CUDA only (inductor on CPU needs a C++
    # toolchain and minutes of compile time for little gain)
    compile: str = "auto"
    triton: bool = True  # the Triton kernels where they apply (CUDA sm >= 8.9, triton imports)
    # Triton's FP8 conversion by integer round-to-nearest-even instead of the hardware cast
    # (slower; for Triton's CPU interpreter, whose own fp8 cast drops mantissa carries)
    soft_fp8_cast: bool = False

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(
                f"KernelPolicy.compile: one of {', '.join(COMPILE_MODES)}, got {self.compile!r}"
            )

    def compiles(self, device: torch.device) -> bool:
        if self.compile == "auto":
            return device.type == "cuda"
        return self.compile == "always"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KernelPolicy:
        """``QCKPT_COMPILE`` (1 / 0 / auto), ``QCKPT_TRITON`` (0, false or off turn it off),
        ``QCKPT_TRITON_SOFT_CVT`` (1 turns it on); anything else keeps the default."""
        comp = {"1": "always", "0": "never"}.get(env.get("QCKPT_COMPILE", "auto").lower(), "auto")
        return cls(
            compile=comp,
            triton=env.get("QCKPT_TRITON", "1").lower() not in ("0", "false", "off"),
            soft_fp8_cast=env.get("QCKPT_TRITON_SOFT_CVT", "0") == "1",
        )


_DEFAULT = KernelPolicy()
_CURRENT: ContextVar[KernelPolicy | None] = ContextVar("qckpt_kernel_policy", default=None)


def current_policy() -> KernelPolicy:
    return _CURRENT.get() or _DEFAULT


@contextmanager
def kernel_policy(policy: KernelPolicy) -> Iterator[KernelPolicy]:
    """Quantize under ``policy`` inside the block (this thread / task only)."""
    token = _CURRENT.set(policy)
    try:
        yield policy
    finally:
        _CURRENT.reset(token)
