"""QuantizedTensor op handlers, Parameter-in-Linear, serialization, copy_ semantics."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from qckpt.errors import FormatError
from qckpt.formats import QuantizedTensor, UnsupportedOpError, quantize
from tests._bits import bits

E4 = torch.float8_e4m3fn


def same(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    return (
        a.fmt == b.fmt
        and tuple(a.shape) == tuple(b.shape)
        and all(
            torch.equal(bits(getattr(a, k).contiguous()), bits(getattr(b, k).contiguous()))
            for k in a.spec.tensor_fields
        )
    )


@pytest.fixture
def q() -> QuantizedTensor:
    torch.manual_seed(0)
    return quantize(torch.randn(32, 16, dtype=torch.bfloat16), "fp8")


def test_detach_alias_share_storage(q: QuantizedTensor) -> None:
    for t in (q.detach(), torch.ops.aten.alias.default(q)):
        assert isinstance(t, QuantizedTensor) and same(t, q)
        assert t.qdata.data_ptr() == q.qdata.data_ptr()


def test_clone_is_deep(q: QuantizedTensor) -> None:
    c = q.clone()
    assert same(c, q) and c.qdata.data_ptr() != q.qdata.data_ptr()
    c.qdata.zero_()
    assert not torch.equal(bits(c.qdata), bits(q.qdata))


def test_to_device_and_nominal_dtype(q: QuantizedTensor) -> None:
    t = q.to("cpu")
    assert isinstance(t, QuantizedTensor) and same(t, q)
    f = q.to(torch.float32)
    assert isinstance(f, QuantizedTensor) and f.dtype == torch.float32 and same(f, q)
    assert torch.equal(f.dequantize(None), q.dequantize(torch.float32))
    with pytest.raises(NotImplementedError):
        q.to(torch.int8)


def test_views_keep_codes(q: QuantizedTensor) -> None:
    ref = q.dequantize(torch.float32)
    for t, r in [
        (q.view(16, 32), ref.view(16, 32)),
        (q.reshape(-1), ref.reshape(-1)),
        (q.view(1, 32, 16), ref.view(1, 32, 16)),
        (q.unsqueeze(0), ref.unsqueeze(0)),
        (q.view(1, 32, 16).squeeze(0), ref),
        (q.view(1, 32, 16)[0], ref),
        (q.t(), ref.t()),
        (q.transpose(0, 1), ref.t()),
        (q[:, :], ref),
    ]:
        assert isinstance(t, QuantizedTensor)
        assert t.shape == r.shape
        assert t.qdata.untyped_storage().data_ptr() == q.qdata.untyped_storage().data_ptr()
        assert torch.equal(t.dequantize(torch.float32), r)


def test_partial_slice_and_select_refused(q: QuantizedTensor) -> None:
    with pytest.raises(NotImplementedError, match="partial"):
        q[:3]
    with pytest.raises(UnsupportedOpError, match="select"):
        q[0]


def test_channel_views() -> None:
    x = torch.randn(6, 4, 2)
    q = quantize(x, "fp8", granularity="channel")
    ref = q.dequantize(torch.float32)
    assert torch.equal(q.view(6, 8).dequantize(torch.float32), ref.view(6, 8))
    assert torch.equal(q.view(1, 6, 4, 2).dequantize(torch.float32), ref.view(1, 6, 4, 2))
    q2 = q.view(6, 8)
    assert torch.equal(q2.t().dequantize(torch.float32), ref.view(6, 8).t())
    with pytest.raises(UnsupportedOpError, match="channel"):
        q.view(12, 4)


def test_missing_op_names_op_and_format(q: QuantizedTensor) -> None:
    with pytest.raises(NotImplementedError, match=r"aten\.add\.Tensor.*fp8"):
        q + 1
    with pytest.raises(NotImplementedError, match=r"aten\.sum.*fp8"):
        q.sum()
    with pytest.raises(FormatError):
        torch.cat([q, q])


def test_copy_semantics(q: QuantizedTensor) -> None:
    torch.manual_seed(1)
    src = torch.randn(32, 16, dtype=torch.bfloat16) * 5
    dst = q.clone()
    ptr = dst.qdata.data_ptr()
    dst.copy_(src)  # plain source: quantize_ with a fresh scale
    assert dst.qdata.data_ptr() == ptr
    assert same(dst, quantize(src, "fp8"))
    other = quantize(torch.randn(32, 16), "fp8")
    dst.copy_(other)  # same format: copy fields
    assert same(dst, other)
    plain = torch.empty(32, 16)
    plain.copy_(other)  # quantized source into a plain tensor: dequantize
    assert torch.equal(plain, other.dequantize(torch.float32))
    with pytest.raises(UnsupportedOpError, match="shape"):
        dst.quantize_(torch.randn(16, 32))


@pytest.mark.parametrize("g", ["tensor", "channel"])
def test_copy_into_transposed_view(g: str) -> None:
    x = torch.randn(8, 4)
    q = quantize(x, "fp8", granularity=g)
    qt = q.t()
    y = torch.randn(4, 8) * torch.arange(1, 9)  # columns of different magnitude
    qt.copy_(y)
    # the transposed view writes through to the original codes; a per-channel scale stays per
    # row of the original (= per column of the view)
    ref = quantize(y.t().contiguous(), "fp8", granularity=g)
    assert torch.equal(q.dequantize(torch.float32), ref.dequantize(torch.float32))
    assert torch.equal(q.scale, ref.scale)


@pytest.mark.parametrize(
    "fmt,opts", [("fp8", {}), ("fp8", {"granularity": "channel"}), ("fp8_delayed", {})]
)
def test_parameter_in_linear(fmt: str, opts: dict) -> None:
    torch.manual_seed(2)
    lin = torch.nn.Linear(16, 24).to(torch.bfloat16)
    w = lin.weight.detach().clone()
    lin.weight = torch.nn.Parameter(quantize(w, fmt, **opts), requires_grad=False)
    assert isinstance(lin.weight, torch.nn.Parameter) and isinstance(lin.weight, QuantizedTensor)
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    y = lin(x)
    ref = F.linear(x, lin.weight.dequantize(torch.bfloat16), lin.bias)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, 24)
    assert torch.equal(y, ref)
    # and close to the unquantized layer
    assert (y.float() - F.linear(x, w, lin.bias).float()).abs().max() < 0.1
    # x @ W.t() goes through aten.t + mm
    assert torch.allclose((x @ lin.weight.t()).float(), (x @ lin.weight.dequantize().t()).float())

    sd = lin.state_dict()
    assert isinstance(sd["weight"], QuantizedTensor)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    sd2 = torch.load(buf, weights_only=True)
    assert isinstance(sd2["weight"], QuantizedTensor) and same(sd2["weight"], lin.weight)
    assert sd2["weight"].opts == lin.weight.opts and sd2["weight"].dtype == torch.bfloat16

    # load_state_dict with a plain bf16 weight quantizes into the parameter in place
    lin2 = torch.nn.Linear(16, 24).to(torch.bfloat16)
    lin2.weight = torch.nn.Parameter(
        quantize(lin2.weight.detach(), fmt, **opts), requires_grad=False
    )
    lin2.load_state_dict({"weight": w, "bias": lin.bias.detach()})
    if fmt != "fp8_delayed":
        assert same(lin2.weight, quantize(w, fmt, **opts))


def test_repr_does_not_dequantize(q: QuantizedTensor) -> None:
    assert "fp8" in repr(q) and "(32, 16)" in repr(q)


def test_quantized_nbytes() -> None:
    q = quantize(torch.randn(64, 32, dtype=torch.bfloat16), "mxfp8")
    assert q.quantized_nbytes() == 64 * 32 + 64 * 1
    assert quantize(torch.randn(10, 32), "nvfp4").quantized_nbytes() == 10 * 16 + 10 * 2 + 4


def test_every_registered_op_handler() -> None:
    """Each aten op in the handler table, called directly, gives the expected value."""
    aten = torch.ops.aten
    torch.manual_seed(3)
    x = torch.randn(4, 8)
    q = quantize(x, "fp8")
    d = q.dequantize(torch.float32)
    q3 = q.view(1, 4, 8)
    b = torch.randn(2, 8, 3)

    def deq(t: torch.Tensor) -> torch.Tensor:
        assert isinstance(t, QuantizedTensor)
        return t.dequantize(torch.float32)

    checks = {
        aten.detach.default: lambda: torch.equal(deq(aten.detach.default(q)), d),
        aten.alias.default: lambda: torch.equal(deq(aten.alias.default(q)), d),
        aten.clone.default: lambda: torch.equal(deq(aten.clone.default(q)), d),
        aten._to_copy.default: lambda: torch.equal(
            deq(aten._to_copy.default(q, dtype=torch.float16)), d
        ),
        aten.copy_.default: lambda: torch.equal(
            deq(aten.copy_.default(q.clone(), d)), quantize(d, "fp8").dequantize(torch.float32)
        ),
        aten.view.default: lambda: torch.equal(deq(aten.view.default(q, [8, 4])), d.view(8, 4)),
        aten._unsafe_view.default: lambda: torch.equal(
            deq(aten._unsafe_view.default(q, [32])), d.view(32)
        ),
        aten.reshape.default: lambda: torch.equal(
            deq(aten.reshape.default(q, [2, 16])), d.view(2, 16)
        ),
        aten.unsqueeze.default: lambda: torch.equal(
            deq(aten.unsqueeze.default(q, -1)), d.unsqueeze(-1)
        ),
        aten.squeeze.default: lambda: torch.equal(deq(aten.squeeze.default(q3)), d),
        aten.squeeze.dim: lambda: torch.equal(deq(aten.squeeze.dim(q3, 0)), d),
        aten.squeeze.dims: lambda: torch.equal(deq(aten.squeeze.dims(q3, [0])), d),
        aten.select.int: lambda: torch.equal(deq(aten.select.int(q3, 0, 0)), d),
        aten.slice.Tensor: lambda: torch.equal(deq(aten.slice.Tensor(q, 1, 0, 8)), d),
        aten.t.default: lambda: torch.equal(deq(aten.t.default(q)), d.t()),
        aten.transpose.int: lambda: torch.equal(deq(aten.transpose.int(q, 1, 0)), d.t()),
        aten.mm.default: lambda: torch.allclose(aten.mm.default(q, b[0]), d @ b[0]),
        aten.bmm.default: lambda: torch.allclose(
            aten.bmm.default(q3.view(1, 4, 8), b[:1]), (d @ b[0]).unsqueeze(0)
        ),
        aten.matmul.default: lambda: torch.allclose(aten.matmul.default(q, b[0]), d @ b[0]),
        aten.addmm.default: lambda: torch.allclose(
            aten.addmm.default(torch.ones(3), q, b[0]), d @ b[0] + 1
        ),
        aten.linear.default: lambda: torch.allclose(
            aten.linear.default(b[0].t(), q), b[0].t() @ d.t()
        ),
        aten.is_pinned.default: lambda: aten.is_pinned.default(q) is False,
        aten.empty_like.default: lambda: torch.equal(
            deq(aten.empty_like.default(q, device="cpu")), torch.zeros_like(d)
        ),
        aten._has_compatible_shallow_copy_type.default: lambda: (
            aten._has_compatible_shallow_copy_type.default(q, q.clone()) is True
        ),
    }
    assert set(checks) == set(QuantizedTensor._OPS), set(QuantizedTensor._OPS) ^ set(checks)
    for op, check in checks.items():
        assert check(), op


@pytest.mark.parametrize(
    "fmt,opts",
    [("fp8", {}), ("fp8", {"granularity": "channel"}), ("fp8_block", {"block_size": (1, 32)})],
)
def test_contiguous_of_transposed_view(fmt: str, opts: dict) -> None:
    x = torch.randn(48, 64)
    qt = quantize(x, fmt, **opts).t()
    assert not qt.is_contiguous() and not qt.qdata.is_contiguous()
    c = qt.contiguous()
    assert isinstance(c, QuantizedTensor) and c.is_contiguous() and c.qdata.is_contiguous()
    assert torch.equal(c.dequantize(torch.float32), qt.dequantize(torch.float32))
    y = torch.randn(48, 64) * torch.arange(1, 49).view(48, 1)
    c.copy_(y.t())  # contiguous now: quantized straight into the codes, same semantics
    expect = quantize(y, fmt, **opts).dequantize(torch.float32).t()
    assert torch.equal(c.dequantize(torch.float32), expect)
