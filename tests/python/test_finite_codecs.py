"""Finite gradients and residuals never give non-finite payloads, residuals or decode_sum outputs
(saturating residual and wire stores, saturating m = grad + residual, double-lane sums for the
signsgd scale and the qsgd norms, alpha applied before the ranks' values are added), while a real
NaN or Inf still shows (nothing clamps a non-finite input). Each case is also compared bit for bit
with the pure-PyTorch reference."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import gradcomp  # noqa: F401  (registers torch.ops.gradcomp)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import (  # noqa: E402
    HEADER_BYTES,
    _field,
    _layout,
    parse_header,
    ref_decode_sum,
    ref_encode,
)

from test_codecs import DTYPES, OPS, lib_decode, lib_encode  # noqa: E402

CODECS = ["none", "fp16", "bf16", "signsgd", "terngrad", "qsgd", "topk", "randomk"]
KEY = dict(seed=4321, step=3, bucket=1, rank=0)


def params_for(name: str, n: int) -> dict:
    if name == "topk":
        return {"k": max(1, n // 50)}
    if name == "randomk":
        return {"k": max(1, n // 20)}
    if name == "qsgd":
        return {"levels": 127, "block": 512}
    if name == "signsgd":
        return {"block": 256}
    return {}


def float_fields(payload: torch.Tensor) -> torch.Tensor:
    """Every floating-point field of a payload as fp32: scales, norms, wire values, sent values."""
    h = parse_header(payload)
    name = ["none", "fp16", "bf16", "signsgd", "terngrad", "qsgd", "topk", "randomk"][h["codec"]]
    dtype = DTYPES[h["dtype"]]
    n, p0, p1 = h["numel"], h["param0"], h["param1"]
    lay = _layout(h["codec"], h["dtype"], n, p0, p1)
    if name in ("none", "fp16", "bf16"):
        wire = {"none": dtype, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
        return _field(payload, HEADER_BYTES, n, wire).float()
    if name == "terngrad":
        return _field(payload, HEADER_BYTES, 1, torch.float32)
    if name in ("qsgd", "signsgd"):
        return _field(payload, HEADER_BYTES, -(-n // p1), torch.float32)
    if name == "topk":
        return _field(payload, lay["values"], p0, dtype).float()
    return _field(payload, HEADER_BYTES, p0, dtype).float()


def all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.float()).all())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that NaNs only need to be at the same places (their bits may differ)."""
    if a.dtype == torch.uint8:
        return torch.equal(a, b)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    view = {4: torch.int32, 2: torch.int16}[a.element_size()]
    differ = (a.contiguous().view(view) != b.contiguous().view(view)) & ~nan_a
    return torch.equal(nan_a, nan_b) and not bool(differ.any())


def encode_checked(name, grad, residual, kw, key=KEY, exact_payload=True):
    """The library's payload and new residual, checked bit for bit against the reference (with
    exact_payload=False, the payload's float fields are compared NaN-aware instead of its bytes)."""
    ref_payload, ref_residual = ref_encode(name, grad, residual, **kw, **key)
    lib_residual = residual.clone() if residual is not None else None
    payload = lib_encode(name, grad, lib_residual, **kw, **key)
    if exact_payload:
        assert same_bits(payload, ref_payload), f"{name} {grad.dtype}: payload differs from the reference"
    else:
        assert same_bits(float_fields(payload), float_fields(ref_payload)), f"{name} {grad.dtype}: payload fields"
    if residual is not None:
        assert same_bits(lib_residual, ref_residual), f"{name} {grad.dtype}: residual differs from the reference"
    return payload, lib_residual


def decode_checked(stack, dtype, n, alpha, vote=False):
    out = lib_decode(stack, dtype, n, alpha, vote)
    expected = ref_decode_sum(stack, dtype, alpha, vote)
    assert same_bits(out, expected), "decode_sum differs from the reference"
    return out


# (a) ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_residual", [False, True])
def test_signsgd_scale_of_opposite_huge_values_is_finite(with_residual):
    n = 1000
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.01
    grad[0], grad[32] = 3e38, -3e38  # the same summation lane of the first block
    residual = torch.zeros(n) if with_residual else None
    payload, new_residual = encode_checked("signsgd", grad, residual, params_for("signsgd", n))
    scales = float_fields(payload)
    assert all_finite(scales) and float(scales[0]) == pytest.approx(6e38 / 256, rel=1e-6)
    if with_residual:
        assert all_finite(new_residual)
    out = decode_checked(torch.stack([payload, payload]), torch.float32, n, 0.5)
    assert all_finite(out)
    out = decode_checked(torch.stack([payload, payload]), torch.float32, n, 0.5, vote=True)
    assert all_finite(out)


# (b) ------------------------------------------------------------------------------------------

def test_qsgd_norm_of_1e20_is_finite_under_error_feedback():
    n = 2000
    grad = torch.randn(n, generator=torch.Generator().manual_seed(2))
    grad[700] = 1e20
    residual = torch.zeros(n)
    kw = {"levels": 15, "block": 512}
    payload, new_residual = encode_checked("qsgd", grad, residual, kw)
    norms = float_fields(payload)
    assert all_finite(norms)
    assert float(norms[1]) == pytest.approx(1e20, rel=1e-6)
    assert all_finite(new_residual)
    out = decode_checked(torch.stack([payload, payload]), torch.float32, n, 0.5)
    assert all_finite(out)


# (c) ------------------------------------------------------------------------------------------

def test_fp16_signsgd_residual_saturates_instead_of_overflowing():
    n = 1000
    residual = torch.zeros(n, dtype=torch.float16)
    for step in range(10):
        grad = (torch.randn(n, generator=torch.Generator().manual_seed(step)) * 0.01).to(torch.float16)
        grad[5] = 30000.0
        payload, residual = encode_checked("signsgd", grad, residual, params_for("signsgd", n), dict(KEY, step=step))
        assert all_finite(float_fields(payload)), f"step {step}: scale"
        assert all_finite(residual), f"step {step}: residual"
        out = decode_checked(torch.stack([payload, payload]), torch.float16, n, 0.5)
        assert all_finite(out), f"step {step}: decode"
    assert float(residual[5]) == 65504.0  # saturated where it would have overflowed


# (d) ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["topk", "terngrad"])
def test_alpha_applies_before_the_ranks_are_added(name):
    n = 300
    grad = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 0.01
    grad[17] = 2e38
    kw = params_for(name, n)
    payloads = [encode_checked(name, grad, None, kw, dict(KEY, rank=r))[0] for r in range(2)]
    out = decode_checked(torch.stack(payloads), torch.float32, n, 0.5)
    assert all_finite(out)
    assert float(out[17]) == pytest.approx(2e38, rel=1e-6)


# (e) ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_residual", [False, True])
def test_fp16_wire_of_a_large_fp32_value_saturates(with_residual):
    grad = torch.tensor([1e5, -1e5, 1.0, 70000.0, 65519.0])
    residual = torch.zeros(5) if with_residual else None
    payload, new_residual = encode_checked("fp16", grad, residual, {})
    wire = float_fields(payload)
    assert wire.tolist() == [65504.0, -65504.0, 1.0, 65504.0, 65504.0]
    if with_residual:
        assert new_residual.tolist() == [1e5 - 65504.0, -(1e5 - 65504.0), 0.0, 70000.0 - 65504.0, 15.0]
    out = decode_checked(torch.stack([payload, payload]), torch.float32, 5, 0.5)
    assert out.tolist() == wire.tolist()


# (f) ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["grad", "residual"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CODECS)
def test_nan_and_inf_still_show(name, dtype, where, bad):
    n = 600
    at = 123
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(6)) * 0.1).to(dtype)
    residual = torch.zeros(n, dtype=dtype)
    (grad if where == "grad" else residual)[at] = bad
    kw = {"k": n} if name in ("topk", "randomk") else params_for(name, n)
    payload, new_residual = encode_checked(name, grad, residual, kw, exact_payload=False)
    fields = float_fields(payload)
    if name in ("none", "fp16", "bf16"):
        assert not bool(torch.isfinite(fields[at]))
    elif name == "topk":  # k = n: every element is sent, in index order
        assert not bool(torch.isfinite(fields[at]))
    elif name == "randomk":  # k = n: every element is sent, in permuted order
        assert int((~torch.isfinite(fields)).sum()) == 1
    elif name == "qsgd":
        assert not bool(torch.isfinite(fields[at // kw["block"]]))
    else:
        assert not bool(torch.isfinite(fields[0]))
    out = decode_checked(torch.stack([payload, payload]), dtype, n, 0.5)
    assert not bool(torch.isfinite(out[at]))


# (g) ------------------------------------------------------------------------------------------

def test_codec_name_with_embedded_nul_is_refused():
    grad = torch.randn(64)
    payload = lib_encode("none", grad)
    out = torch.zeros(64)
    with pytest.raises(ValueError, match=r"unknown codec 'none\\x00junk'.*valid codecs: none, fp16"):
        OPS.decode_sum(payload, out, 1.0, False, "none\x00junk")
    with pytest.raises(ValueError, match="unknown codec"):
        OPS.decode_sum(payload, out, 1.0, False, "none\x00")
    with pytest.raises(ValueError, match="unknown codec"):
        OPS.encode(grad, None, "none\x00junk")
    with pytest.raises(ValueError, match="unknown codec"):
        OPS.encode(grad, None, "non")
    OPS.decode_sum(payload, out, 1.0, False, "none")  # the exact name still works
    assert torch.equal(out, grad)


# (h) ------------------------------------------------------------------------------------------

def huge_values(n: int, dtype: torch.dtype, top: float, seed: int) -> torch.Tensor:
    """Random signs and magnitudes spread over many decades up to top, plus a few at top itself."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    decades = torch.rand(n, generator=gen).double() * 8
    x = sign * top * torch.rand(n, generator=gen).double() * torch.pow(10.0, -decades)
    x[::97] = sign[::97] * top
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CODECS)
def test_sweep_finite_inputs_give_finite_outputs(name, dtype):
    n = 2500
    kw = params_for(name, n)
    top = torch.finfo(dtype).max
    residuals = [huge_values(n, dtype, top, seed=100 + r) for r in range(2)]
    for step in range(4):
        payloads = []
        for rank in range(2):
            grad = huge_values(n, dtype, top / 4, seed=10 * step + rank)
            assert all_finite(grad) and all_finite(residuals[rank])
            payload, residuals[rank] = encode_checked(name, grad, residuals[rank], kw,
                                                      dict(KEY, step=step, rank=rank))
            assert all_finite(float_fields(payload)), f"step {step} rank {rank}: payload"
            assert all_finite(residuals[rank]), f"step {step} rank {rank}: residual"
            payloads.append(payload)
        out = decode_checked(torch.stack(payloads), dtype, n, 0.5)
        assert all_finite(out), f"step {step}: decode_sum"
        if name == "signsgd":
            assert all_finite(decode_checked(torch.stack(payloads), dtype, n, 0.5, vote=True))
