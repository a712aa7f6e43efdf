"""Tensor quantizers: what calibration observes and what the amax sync moves between ranks.

A :class:`TensorQuantizer` does not change the model's numbers; during calibration it only
records the running max of ``|x|`` (max calibration), at the granularity the recipe asks for.
Its amax is ``None`` until it has seen data: the sync tells "never calibrated" from "calibrated
to zero" by presence, never by value.

The amax is not a registered buffer: instrumenting a model must not change its ``state_dict``.
A per-tensor amax (one number; the vast majority of quantizers) lives in a slot of an
:class:`AmaxBank`, one float32 tensor shared by many quantizers, with its presence, dtype and
"shared from the layer" flags in byte arrays beside it. The sync packs and unpacks 10,000s of
amaxes; with one tensor per quantizer that is per-quantizer Python and kernel launches, which
costs more than the collectives themselves. With a bank it is a few vector operations.
Per-channel and per-block amaxes are tensors of their own (few, and large).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from qckpt.errors import CalibrationError
from qckpt.formats.scheme import SCHEMES, Scheme
from qckpt.formats.shapes import SCALAR_GRANULARITIES, amax_shape, weight_block

GRANULARITIES = ("tensor", "channel", "block", "dynamic_block")
# calibrator dtypes an amax may have, by code; the order is the preference when ranks that
# calibrated a quantizer in different dtypes meet a rank that must adopt one
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}
# "output": a linear's output, per tensor (k_proj/v_proj for the KV-cache scales)
# "weight_clip" / "input_clip": the mse algorithm's searched amaxes (qckpt/calib/mse_pass.py)
KINDS = ("weight", "input", "output", "weight_clip", "input_clip")


class AmaxBank:
    """Per-tensor amaxes of many quantizers: one float32 tensor plus byte flags per slot.

    Values are stored in float32 (the sync's wire format, exact for bfloat16/float16 values);
    ``codes`` keeps each slot's calibrator dtype, which :attr:`TensorQuantizer.amax` restores.
    """

    def __init__(self, device: torch.device | str = "cpu", capacity: int = 64) -> None:
        self.device = torch.device(device)
        capacity = max(1, capacity)
        self.values = torch.zeros(capacity, dtype=torch.float32, device=self.device)
        self.present = bytearray(capacity)
        self.codes = bytearray(capacity)
        self.shared = bytearray(capacity)
        self.size = 0

    def allocate(self) -> int:
        if self.size == len(self.present):
            n = len(self.present)
            grown = torch.zeros(2 * n, dtype=torch.float32, device=self.device)
            grown[:n] = self.values
            self.values = grown
            # new objects rather than extend(): a byte array viewed by a tensor cannot be resized
            self.present = self.present + bytearray(n)
            self.codes = self.codes + bytearray(n)
            self.shared = self.shared + bytearray(n)
        self.size += 1
        return self.size - 1

    def view(self, name: str) -> torch.Tensor:
        """A uint8 tensor over one of the flag arrays (no copy: writes go to the bank)."""
        return torch.frombuffer(getattr(self, name), dtype=torch.uint8)

    def fold_max(self, slots: list[int], new: torch.Tensor, code: int) -> None:
        """Max ``new`` (one value per slot, exact in float32) into distinct ``slots``; an
        absent slot takes its value and the calibrator dtype ``code``. One gather and one
        scatter for all of them (max keeps a NaN, the store checks it after)."""
        index = torch.tensor(slots, device=self.device)
        present = torch.tensor([self.present[s] for s in slots], dtype=torch.bool)
        new = new.to(device=self.device, dtype=torch.float32)
        cur = self.values.index_select(0, index)
        self.values.index_copy_(
            0, index, torch.where(present.to(self.device), torch.maximum(cur, new), new)
        )
        for s in slots:
            if not self.present[s]:
                self.codes[s] = code
                self.present[s] = 1


class PendingAmax:
    """Per-tensor amaxes the forward hooks took, waiting to be folded into their banks.

    A hook's whole cost is one reduction kernel: ``|x|``'s max as one fused ``vector_norm``
    (inf), kept on the device in the input's dtype (exact) and appended here. No fold into the
    bank per call (a gather, a max and a scatter, each a kernel launch a GPU forward pays) and
    no host sync: :meth:`fold` takes the max of every quantizer's pending values at once when
    the store settles. Linears that read the same tensor (q/k/v, gate/up) share one reduction:
    the last input is recognised by identity and version (an in-place change bumps it).
    """

    # pending values before a fold without settling: bounds the memory of a long run
    LIMIT = 1 << 14

    def __init__(self, store: AmaxStore) -> None:
        self.store = store
        self.values: list[torch.Tensor] = []
        self.quantizers: list[TensorQuantizer] = []
        self.last: tuple = (None, -1, None)  # (weak reference to the input, version, amax)

    def add(self, q: TensorQuantizer, x: torch.Tensor) -> None:
        ref, version, a = self.last
        if ref is None or ref() is not x or x._version != version:
            t = x.detach() if x.requires_grad else x
            # one kernel, no |x| temporary; exact (a max) and keeps a NaN, as amax does
            a = torch.linalg.vector_norm(t, float("inf")) if t.numel() else t.new_zeros(())
            self.last = (weakref.ref(x), x._version, a)
        if not self.quantizers:
            self.store.defer(self.fold)
            self.store.unchecked = True
        self.values.append(a)
        self.quantizers.append(q)
        if len(self.quantizers) >= self.LIMIT:
            self.fold()

    def fold(self) -> None:
        """Fold every pending value in (its device's values apart: one stack per device)."""
        qs, vals = self.quantizers, self.values
        self.quantizers, self.values, self.last = [], [], (None, -1, None)
        by_device: dict[torch.device, list[int]] = {}
        for i, v in enumerate(vals):
            by_device.setdefault(v.device, []).append(i)
        for ix in by_device.values():
            _fold_pending([qs[i] for i in ix], [vals[i] for i in ix])


def _fold_pending(qs: list[TensorQuantizer], vals: list[torch.Tensor]) -> None:
    """Each quantizer's pending values (on one device) maxed (one ``amax`` over a padded
    gather), rounded to its calibrator dtype as :meth:`TensorQuantizer.reduce` rounds (rounding
    is monotone: rounding the max equals the max of the rounded) and folded into its bank."""
    rows: dict[int, list[int]] = {}
    uniq: list[TensorQuantizer] = []
    for i, q in enumerate(qs):
        if id(q) not in rows:
            rows[id(q)] = []
            uniq.append(q)
        rows[id(q)].append(i)
    dtype = vals[0].dtype
    for v in vals:
        dtype = torch.promote_types(dtype, v.dtype)
    flat = torch.stack([v.to(dtype) for v in vals])
    flat = torch.cat([flat, flat.new_full((1,), float("-inf"))])  # the padding
    width = max(len(r) for r in rows.values())
    index = [r + [len(vals)] * (width - len(r)) for r in (rows[id(q)] for q in uniq)]
    m = flat[torch.tensor(index, device=flat.device)].amax(dim=1)
    groups: dict[tuple, list[int]] = {}
    for j, q in enumerate(uniq):
        groups.setdefault((id(q.bank), q.calib_dtype), []).append(j)
    for js in groups.values():
        first = uniq[js[0]]
        sel = m[torch.tensor(js, device=m.device)] if len(js) < len(uniq) else m
        sel = sel.to(first.calib_dtype)
        first.bank.fold_max([uniq[j].slot for j in js], sel, DTYPE_CODE[first.calib_dtype])


class AmaxStore:
    """The owner of a set of quantizers' amaxes, and of what a sync may cache about them.

    It holds one :class:`AmaxBank` per device for the per-tensor amaxes, a list of the static
    (per-channel / per-block) amaxes, and a ``version`` that every change of the layout bumps (a
    quantizer enabled or disabled, a static amax reshaped by the TP gather). The sync caches its
    packing plan here (:meth:`cached_plan` / :meth:`keep_plan`) and the plan is reused only while
    the version of every store it covers is unchanged, so no code path can forget to invalidate it.
    ``insert_quantizers`` makes one store per model; a quantizer made alone gets its own.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self.banks: dict[torch.device, AmaxBank] = {}
        self.static: list[torch.Tensor | None] = []
        self.static_shared: list[bool] = []
        self.version = 0
        self._plan: tuple | None = None  # (quantizers, [(store, version)], plan)
        # deferred work (calibration forwards avoid host syncs): per-expert amaxes accumulated
        # on the device wait in ``pending`` until :meth:`settle`; ``unchecked``: amaxes folded
        # without the finiteness check (one check over the banks at settle instead of one sync
        # per hook call). ``dirty`` says either is there; reading an amax settles first.
        self.pending: list = []
        self.unchecked = False
        self.dirty = False
        self.members: list[TensorQuantizer] = []
        self.hooks = PendingAmax(self)

    def scalar_slot(self, device: torch.device) -> tuple[AmaxBank, int]:
        bank = self.banks.get(device)
        if bank is None:
            bank = self.banks[device] = AmaxBank(device, capacity=self.capacity)
        return bank, bank.allocate()

    def static_slot(self) -> int:
        self.static.append(None)
        self.static_shared.append(False)
        return len(self.static) - 1

    def set_static(self, i: int, value: torch.Tensor | None, shared: bool | None = False) -> None:
        """Replace static amax ``i`` (a new tensor: the old one may be a view a caller holds);
        ``shared=None`` keeps its "shared from the layer" flag."""
        self.static[i] = value
        if shared is not None:
            self.static_shared[i] = bool(shared)

    def defer(self, settle) -> None:
        """Run ``settle()`` before any amax of this store is read next."""
        self.pending.append(settle)
        self.dirty = True

    def settle(self) -> None:
        """Fold the deferred per-expert amaxes in, then check what was folded unchecked: a
        non-finite amax is the error :meth:`TensorQuantizer.collect` raises, naming the module."""
        self.dirty = False
        pending, self.pending = self.pending, []
        for fn in pending:
            fn()
        if not self.unchecked:
            return
        self.unchecked = False
        bad = [b for b in self.banks.values() if not bool(torch.isfinite(b.values[: b.size]).all())]
        statics = [a for a in self.static if a is not None]
        if not bad and all(bool(torch.isfinite(a).all()) for a in statics):
            return
        for q in self.members:
            a = q.amax
            if q.enabled and a is not None and not bool(torch.isfinite(a).all()):
                raise q.non_finite()

    def changed(self) -> None:
        """The layout changed: a cached plan covering this store is stale."""
        self.version += 1

    def cached_plan(self, quantizers: list):
        c = self._plan
        # list ==, not a tuple: it compares the pointers without touching 10^4 objects
        if c is not None and c[0] == quantizers and all(s.version == v for s, v in c[1]):
            return c[2]
        return None

    def keep_plan(self, quantizers: list, stores, plan) -> None:
        # a copy of the list: the caller may change its own
        self._plan = (list(quantizers), [(s, s.version) for s in stores], plan)


class TensorQuantizer:
    """One quantizer of one tensor (a linear's weight or its input).

    ``name`` is the HF checkpoint module name (``model.layers.0.mlp.experts.3.gate_proj``) and
    ``kind`` is ``"weight"`` or ``"input"``; ``key`` (``{name}.{kind}_amax``) is its entry in the
    calibration file. ``amax_shape`` is fixed at construction from the module's shapes, so every
    rank lays out the sync buffers identically even for quantizers it never calibrated.

    Granularities: ``tensor`` (one amax), ``channel`` (one per index of ``axis`` of a 2-D weight),
    ``block`` (static per block of ``block_size``; for inputs, blocks of the last dim), and
    ``dynamic_block`` (NVFP4: block scales are computed at quantization time; only the per-tensor
    global amax is calibrated, so it syncs exactly like ``tensor``).

    A plain object, not an ``nn.Module``: it is never registered in the model, and a model of
    thousands of experts makes thousands of them on every rank (an ``nn.Module``'s init and
    attribute hooks were most of ``insert_quantizers``' time, a start-up cost of every forward).
    """

    def __init__(
        self,
        name: str,
        kind: str,
        *,
        shape: Sequence[int],
        granularity: str = "tensor",
        fmt: str = "fp8",
        axis: int = 0,
        block_size: Sequence[int] = (128, 128),
        enabled: bool = True,
        calib_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        store: AmaxStore | None = None,
        local: bool = True,
        share_group: str | None = None,
        expert_layer: str | None = None,
        expert: int | None = None,
        scheme: Scheme | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.name = name
        self.kind = kind
        self.shape = tuple(
            int(s) for s in shape
        )  # the observed tensor's shape ([..., in] for inputs)
        self.granularity = granularity
        # what this quantizer's tensor becomes: every question about the format goes to it
        self.scheme = scheme if scheme is not None else _scheme_named(fmt, granularity, block_size)
        self.format = self.scheme.name  # the calibration file's "format" entry
        self.axis = axis
        self.block_size = tuple(int(b) for b in block_size)
        self.store = store if store is not None else AmaxStore(capacity=1)
        self.enabled = enabled
        self.calib_dtype = calib_dtype
        self.device = torch.device(device)
        # False for a routed expert that another EP rank holds: this rank keeps the quantizer so
        # that every rank's sync layout is the same, but is not expected to calibrate it
        self.local = local
        # routed-expert inputs that opt in to sharing: the key of their layer's sharing group
        self.share_group = share_group
        # routed-expert quantizers: the experts module and the global expert index (for messages)
        self.expert_layer = expert_layer
        self.expert = expert
        if calib_dtype not in DTYPE_CODE:
            raise ValueError(f"calib_dtype must be one of {DTYPES}, got {calib_dtype}")
        # plain attributes, not properties: the sync reads them for every quantizer
        self.is_scalar = granularity in SCALAR_GRANULARITIES
        self.amax_shape = self._amax_shape()
        # where the amax lives in the store: a bank slot (per tensor) or a static index
        self.bank: AmaxBank | None = None
        self.slot = -1
        self.static_ix = -1
        if self.is_scalar:
            self.bank, self.slot = self.store.scalar_slot(self.device)
        else:
            self.static_ix = self.store.static_slot()
        self.store.members.append(self)

    # -- properties -----------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return f"{self.name}.{self.kind}_amax"

    @property
    def amax(self) -> torch.Tensor | None:
        if self.store.dirty:
            self.store.settle()
        b = self.bank
        if b is None:
            return self.store.static[self.static_ix]
        s = self.slot
        if not b.present[s]:
            return None
        # a copy, so that a later sync writing into the bank does not change it under the caller
        return b.values[s].to(DTYPES[b.codes[s]], copy=True)

    @amax.setter
    def amax(self, value: torch.Tensor | None) -> None:
        if self.store.dirty:  # what the forwards deferred comes first, then this value
            self.store.settle()
        if value is not None and tuple(value.shape) != self.amax_shape:
            raise ValueError(
                f"{self.key}: amax of shape {tuple(value.shape)}, expected {self.amax_shape}"
            )
        if value is not None and value.dtype not in DTYPE_CODE:
            raise ValueError(f"{self.key}: amax dtype {value.dtype} is not one of {DTYPES}")
        b = self.bank
        if b is None:
            self.store.set_static(self.static_ix, value)
            return
        s = self.slot
        b.shared[s] = 0
        if value is None:
            b.present[s] = 0
            return
        b.values[s] = value.detach().to(device=b.device, dtype=torch.float32)
        b.codes[s] = DTYPE_CODE[value.dtype]
        b.present[s] = 1

    @property
    def shared_from_layer(self) -> bool:
        """True when this routed expert saw no tokens and took its layer's input amax."""
        b = self.bank
        if b is not None:
            return bool(b.shared[self.slot])
        return self.store.static_shared[self.static_ix]

    @shared_from_layer.setter
    def shared_from_layer(self, value: bool) -> None:
        b = self.bank
        if b is not None:
            b.shared[self.slot] = 1 if value else 0
        else:
            self.store.static_shared[self.static_ix] = bool(value)

    @property
    def enabled(self) -> bool:
        return self.__dict__["_enabled"]

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.__dict__["_enabled"] = bool(value)
        self.store.changed()

    @property
    def is_enabled(self) -> bool:
        return self.__dict__["_enabled"]

    def reset(self) -> None:
        self.amax = None

    def _amax_shape(self) -> tuple[int, ...]:
        try:
            return amax_shape(self.granularity, self.kind, self.shape, self.block_size, self.axis)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None

    # -- calibration ----------------------------------------------------------------------------
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The max of ``|x|`` at this quantizer's granularity, in ``calib_dtype``.

        ``abs`` and ``amax`` are exact in any float dtype, so reducing in the tensor's own dtype
        and converting the (small) result afterwards gives the same bits as upcasting first,
        without a full-size float32 temporary.
        """
        x = x.detach()
        if self.granularity in SCALAR_GRANULARITIES:
            a = x.abs().amax() if x.numel() else x.new_zeros(())
        elif self.granularity == "channel":
            other = 1 - (self.axis % 2)
            a = x.abs().amax(dim=other)
        elif self.kind == "input":
            b = self.block_size[-1]
            flat = x.reshape(-1, x.shape[-1])
            n = self.amax_shape[0]
            pad = n * b - flat.shape[-1]
            if pad:
                flat = torch.nn.functional.pad(flat, (0, pad))
            a = flat.abs().reshape(flat.shape[0], n, b).amax(dim=(0, 2))
        else:
            r, c = x.shape
            n0, n1 = self.amax_shape
            b0, b1 = weight_block(self.block_size)
            padded = torch.nn.functional.pad(x, (0, n1 * b1 - c, 0, n0 * b0 - r))
            a = padded.abs().reshape(n0, b0, n1, b1).amax(dim=(1, 3))
        return a.to(self.calib_dtype)

    def non_finite(self) -> CalibrationError:
        return CalibrationError(
            f"{self.name}: non-finite {self.kind} during calibration (NaN or Inf in the "
            f"{'weight' if self.kind == 'weight' else 'activations'}); amax would be meaningless"
        )

    def collect(self, x: torch.Tensor, *, check: bool = True) -> None:
        """Fold ``x`` into the running max; a non-finite value is an error naming the module.

        ``check=False`` (the forward hooks): no host sync here; the running max keeps a NaN or
        Inf (max propagates both) and :meth:`AmaxStore.settle` raises the same error later.
        """
        if self.enabled:
            self.fold(self.reduce(x), check=check)

    def observe(self, x: torch.Tensor) -> None:
        """A forward hook's :meth:`collect` without a check: per-tensor amaxes wait, on the
        device, for the store's settle (:class:`PendingAmax`), the others fold now."""
        if not self.__dict__["_enabled"]:
            return
        if self.bank is not None:
            self.store.hooks.add(self, x)
        else:
            self.fold(self.reduce(x), check=False)

    def fold(self, a: torch.Tensor, *, check: bool = True) -> None:
        """Fold an already reduced amax ``a`` (``calib_dtype``, ``amax_shape``) into the max."""
        if not check:
            self.store.unchecked = self.store.dirty = True
        elif not bool(torch.isfinite(a).all()):
            raise self.non_finite()
        b = self.bank
        if b is not None:
            s = self.slot
            a32 = a.to(device=b.device, dtype=torch.float32)  # exact: a is a calib_dtype value
            if b.present[s]:
                b.values[s] = torch.maximum(b.values[s], a32)
            else:
                b.values[s] = a32
                b.codes[s] = DTYPE_CODE[self.calib_dtype]
                b.present[s] = 1
            return
        a = a.to(self.device)
        cur = self.store.static[self.static_ix]
        # not in place: a synced amax may be a view into the sync's buffer
        new = a if cur is None else torch.maximum(cur, a.to(cur.dtype))
        self.store.set_static(self.static_ix, new, shared=None)

    def make_whole(self, shape: Sequence[int], value: torch.Tensor | None) -> None:
        """Become the quantizer of the whole tensor of ``shape`` (after the TP gather) with the
        whole static amax ``value`` (None: keep none)."""
        self.shape = tuple(int(s) for s in shape)
        self.amax_shape = self._amax_shape()
        self.store.set_static(self.static_ix, None)
        if value is not None:
            self.amax = value
        self.store.changed()  # the sync's cached layout knew the local shapes

    def __repr__(self) -> str:
        return f"TensorQuantizer({self.extra_repr()})"

    def extra_repr(self) -> str:
        amax = self.amax
        if amax is None:
            val = "None"
        elif amax.numel() == 1:
            val = f"{float(amax):.4g}"
        else:
            val = f"[{tuple(amax.shape)}] max={float(amax.max()):.4g}"
        return (
            f"{self.key}, {self.granularity}, {self.format}, enabled={self.enabled}, amax={val}"
            + (", shared_from_layer" if self.shared_from_layer else "")
        )

    def describe(self, amax: torch.Tensor | None | object = ...) -> dict:
        """The calibration file's metadata entry for this quantizer (``amax``: its value when
        the caller already has it, e.g. from :func:`host_amaxes`; else read here)."""
        if amax is ...:
            amax = self.amax
        d = {
            "module": self.name,
            "kind": self.kind,
            "granularity": self.granularity,
            "format": self.format,
            "enabled": self.enabled,
            "calibrated": amax is not None,
            "shared": self.shared_from_layer,
            "dtype": str(amax.dtype if amax is not None else self.calib_dtype).replace(
                "torch.", ""
            ),
            "amax_shape": list(self.amax_shape),
        }
        if self.granularity == "channel":
            d["axis"] = self.axis
        if self.granularity == "block":
            d["block_size"] = list(self.block_size)
        if self.expert is not None:
            d["expert"] = self.expert
        return d


def _scheme_named(fmt: str, granularity: str, block: Sequence[int]) -> Scheme:
    """The scheme of a quantizer made from a format name (a caller that gave no scheme)."""
    cls = SCHEMES.get(fmt)
    if cls is None:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(SCHEMES)}")
    b = tuple(int(x) for x in block) or (128, 128)
    gran = "tensor" if granularity == "dynamic_block" else granularity
    return cls(granularity=gran, block=b if len(b) == 2 else (b[0], b[0]))


def host_amaxes(quantizers: Sequence[TensorQuantizer]) -> list[torch.Tensor | None]:
    """Every quantizer's :attr:`~TensorQuantizer.amax` (same values, dtypes and shapes), on the
    host, in a few copies: one per bank of per-tensor amaxes (the float32 ones are views of
    it, which nothing writes) and one for all the static ones.
    Reading them one by one costs a kernel and a device-to-host wait per quantizer (three per
    quantizer for the file and the report: about 0.8 s for 6,208 of them on an H200)."""
    for store in {id(q.store): q.store for q in quantizers}.values():
        if store.dirty:
            store.settle()
    banks = {id(q.bank): q.bank for q in quantizers if q.bank is not None}
    # one host copy per bank, seen as 0-d views made in one call (a tensor made per amax cost
    # ~4 us each: 0.15 s of a 48-layer MoE's 37k)
    values = {i: b.values[: b.size].cpu().unbind() for i, b in banks.items()}
    statics = [q.store.static[q.static_ix] for q in quantizers if q.bank is None]
    statics = _to_host([a for a in statics if a is not None])
    out: list[torch.Tensor | None] = []
    for q in quantizers:
        b = q.bank
        if b is None:
            a = q.store.static[q.static_ix]
            out.append(None if a is None else statics[id(a)])
        elif not b.present[q.slot]:
            out.append(None)
        else:
            # the property's own conversion (none for float32), on the host copy: the same bits
            v, dtype = values[id(b)][q.slot], DTYPES[b.codes[q.slot]]
            out.append(v if dtype is torch.float32 else v.to(dtype))
    return out


def _to_host(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """id(t) -> a host copy of t, one device-to-host copy per (device, dtype)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    out: dict[int, torch.Tensor] = {}
    for ts in groups.values():
        if ts[0].device.type == "cpu":
            out.update((id(t), t.detach().clone()) for t in ts)
            continue
        flat = torch.cat([t.detach().reshape(-1) for t in ts]).cpu()
        for t, piece in zip(ts, flat.split([t.numel() for t in ts]), strict=True):
            out[id(t)] = piece.view(t.shape).clone()
    return out
