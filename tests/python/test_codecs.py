"""Every payload codec against the independent pure-PyTorch reference (tests/python/reference.py).

Deterministic codecs and the stochastic ones (whose generator is specified) must match the
reference byte for byte; decoded sums must match bit for bit (the spec fixes the order: fp32
accumulation over the payloads in order, then * alpha); residuals must match and satisfy the
error-feedback invariant; terngrad and qsgd are checked for unbiasedness and the QSGD variance
bound by Monte Carlo, with tolerances derived from the variance.

NaN sign and payload bits are not specified by IEEE 754 for arithmetic results, so tensors are
compared "same NaN positions, bit-identical elsewhere"; payload bytes are compared exactly.
"""

from __future__ import annotations

import math
import os
import sys
from statistics import NormalDist

import pytest
import torch

import gradcomp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import (  # noqa: E402
    CODEC_IDS,
    COMPACT_SPAN,
    HEADER_BYTES,
    TOPK_COMPACT,
    canonical_sum,
    parse_header,
    philox4x32_10,
    qsgd_code_bits,
    ref_decode_sum,
    ref_encode,
    ref_payload_nbytes,
    ref_randomk_indices,
    ref_topk_indices,
    ref_uniforms,
    ref_validate,
    saturated_norm,
)

OPS = torch.ops.gradcomp
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
N = 4999  # not a multiple of 8, 32, a qsgd block, nor of the 4096-element reduction chunk

# (codec, parameters): ratio for topk/randomk (k = count_for_ratio(ratio, n)), levels/block for qsgd,
# block for signsgd
CASES = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("signsgd", {"block": 256}),
    ("signsgd", {"block": 7}),  # blocks that start inside a byte of signs
    ("signsgd", {"block": 9000}),  # one block for every size here: one scale per bucket
    ("terngrad", {}),
    ("qsgd", {"levels": 15, "block": 512}),
    ("qsgd", {"levels": 1, "block": 97}),  # 2-bit codes
    ("qsgd", {"levels": 8, "block": 8192}),  # 5-bit codes across bytes; one block of 2 reduce chunks
    ("qsgd", {"levels": 32767, "block": 333}),  # 16-bit codes, the largest level count
    ("topk", {"ratio": 0.013}),
    ("topk", {"ratio": 0.013, "compact": True}),  # 16-bit indices per span, bf16 values for fp32
    ("randomk", {"ratio": 0.05}),
]
CASE_IDS = [name + "".join(f"-{k}{v}" for k, v in p.items()) for name, p in CASES]
KEY = dict(seed=(1 << 40) + 12345, step=7, bucket=3, rank=2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The kernels under test are single-threaded; torch's intra-op threads only slow the small
    reference ops down (several times over on a 2-core machine), so run this module on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def wire_kwargs(name: str, params: dict, n: int) -> dict:
    """Keyword arguments of ref_encode / ref_payload_nbytes for a case."""
    if name == "topk" and params.get("compact"):
        return {"k": gradcomp.count_for_ratio(params["ratio"], n), "compact": True}
    if name in ("topk", "randomk"):
        return {"k": gradcomp.count_for_ratio(params["ratio"], n)}
    if name == "qsgd":
        return {"levels": params["levels"], "block": params["block"]}
    if name == "signsgd":
        return {"block": params["block"]}
    return {}


def lib_encode(name, grad, residual=None, *, k=0, levels=0, block=0, compact=False, seed=0, step=0, bucket=0,
               rank=0):
    param0 = k if name in ("topk", "randomk") else levels
    param1 = TOPK_COMPACT if compact else block
    return OPS.encode(grad, residual, name, param0, param1, seed, step, bucket, rank)


def lib_decode(payloads, dtype, numel, alpha=1.0, vote=False):
    out = torch.full((numel,), 7.0, dtype=dtype)
    OPS.decode_sum(payloads, out, alpha, vote)
    return out


def make_grad(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal values with exact zeros (+0 and -0), duplicates, and magnitude ties that straddle
    the top-k cut (4 values at 2.5 max, then 200 at 1.5 max with alternating signs)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if n >= 400:
        top = float(x.abs().max())
        x[3], x[4] = 0.0, -0.0
        x[20:25] = x[7]
        x[[10, 11, 150, 151]] = torch.tensor([2.5, -2.5, 2.5, -2.5]) * top
        x[100:300] = torch.tensor([1.5, -1.5]).repeat(100) * top
        x[10:12] = torch.tensor([2.5, -2.5]) * top
    return x.to(dtype)


def make_residual(n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (0.1 * torch.randn(n, generator=gen)).to(dtype)


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same dtype and shape, NaN at the same positions, bit-identical everywhere else."""
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    if not torch.equal(nan_a, nan_e):
        i = int((nan_a != nan_e).nonzero()[0])
        pytest.fail(f"{what}: NaN positions differ, first at {i}: {actual.reshape(-1)[i]} vs {expected.reshape(-1)[i]}")
    bad = (int_view(actual) != int_view(expected)) & ~nan_a
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        pytest.fail(f"{what}: {int(bad.sum())} elements differ, first at {i}: "
                    f"{actual.reshape(-1)[i].item()!r} vs {expected.reshape(-1)[i].item()!r}")


def assert_payload_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == torch.uint8 and actual.dim() == 1
    assert actual.numel() == expected.numel(), (what, actual.numel(), expected.numel())
    if not torch.equal(actual, expected):
        i = int((actual != expected).nonzero()[0])
        pytest.fail(f"{what}: payload bytes differ ({int((actual != expected).sum())} bytes), "
                    f"first at byte {i}: {int(actual[i])} vs {int(expected[i])}")


def float_fields(name: str, n: int, kw: dict, dtype: torch.dtype) -> list[tuple[int, int, torch.dtype]]:
    """(offset, count, dtype) of the floating-point fields of a payload."""
    if name == "terngrad":
        return [(HEADER_BYTES, 1, torch.float32)]
    if name in ("qsgd", "signsgd"):
        return [(HEADER_BYTES, -(-n // kw["block"]), torch.float32)]
    if name == "topk" and kw.get("compact"):  # the values, after the counts and 16-bit indices
        spans = -(-n // COMPACT_SPAN)
        return [(HEADER_BYTES + 4 * spans + 2 * kw["k"], kw["k"], torch.bfloat16 if dtype == torch.float32 else dtype)]
    if name == "topk":
        return [(HEADER_BYTES + 4 * kw["k"], kw["k"], dtype)]
    if name == "randomk":
        return [(HEADER_BYTES, kw["k"], dtype)]
    wire = {"none": dtype, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
    return [(HEADER_BYTES, n, wire)]


def assert_payload_equal_nan_aware(actual, expected, name, n, kw, dtype, what=""):
    """Bytes equal, except that a NaN in a float field may carry any sign and payload bits: IEEE 754
    leaves them unspecified for arithmetic results (NaN + -NaN), and torch's and the C++ NaN
    conversions need not agree on them."""
    a, e = actual.clone(), expected.clone()
    assert a.numel() == e.numel()
    for offset, count, field_dtype in float_fields(name, n, kw, dtype):
        end = offset + count * torch.empty((), dtype=field_dtype).element_size()
        assert_same(a[offset:end].view(field_dtype), e[offset:end].view(field_dtype), what + " float field")
        a[offset:end] = 0
        e[offset:end] = 0
    assert_payload_equal(a, e, what)


def feedback_tolerance(m: torch.Tensor, decoded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound on |(g + r_old) - (decoded + r_new)|: M is rounded once to fp32, M - decoded once to
    fp32 and once to the residual's dtype, and decoded once to out's dtype; each rounding costs
    at most eps(dtype) relative (plus half the smallest subnormal of the dtype)."""
    eps = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).smallest_normal * eps
    return 2 * eps * (m.abs() + decoded.abs()) + tiny


# ----------------------------------------------------------------------------------------------
# The generator and the index permutation
# ----------------------------------------------------------------------------------------------

KATS = [
    ((0, 0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 6, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("args, expected", KATS)
def test_philox_known_answers(args, expected):
    assert tuple(int(w) for w in philox4x32_10(*args)) == expected


def test_philox_vectorized_matches_scalar():
    counters = torch.tensor([0, 1, 5, 0xFFFFFFFF, 0x243F6A88], dtype=torch.int64)
    words = philox4x32_10(counters, 3, counters * 7, 0xFFFFFFFF, 0xA4093822, 0x299F31D0)
    for i, c in enumerate(counters.tolist()):
        scalar = philox4x32_10(c, 3, (c * 7) & 0xFFFFFFFF, 0xFFFFFFFF, 0xA4093822, 0x299F31D0)
        assert tuple(int(w[i]) for w in words) == tuple(int(w) for w in scalar)
    # all three KATs in one vectorized call
    cols = [torch.tensor([a[j] for a, _ in KATS]) for j in range(6)]
    out = philox4x32_10(*cols)
    for i, (_, expected) in enumerate(KATS):
        assert tuple(int(w[i]) for w in out) == expected


def test_uniforms_are_24_bit_and_in_range():
    u = ref_uniforms(4001, seed=5, step=1, bucket=2, rank=3)
    assert u.dtype == torch.float32 and u.numel() == 4001
    assert bool((u >= 0).all()) and bool((u < 1).all())
    assert torch.equal(u * 2**24, torch.floor(u * 2**24))
    # tiles of 64: element e is word (e >> 4) & 3 of the block of group (e >> 6) * 16 + (e & 15)
    def coin(e):
        word = philox4x32_10((e >> 6) * 16 + (e & 15), 1, 2, 3, 5, 0)[(e >> 4) & 3]
        return float(int(word) >> 8) * 2.0**-24
    for e in (0, 1, 15, 16, 17, 31, 32, 48, 63, 64, 65, 79, 80, 127, 128, 4000):
        assert float(u[e]) == coin(e), e


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 1000, 4099, 65537])
def test_randomk_permutation_is_a_bijection(n):
    perm = ref_randomk_indices(n, n, seed=11, step=2, bucket=1)
    assert torch.equal(torch.sort(perm).values, torch.arange(n))


# ----------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 33, 1000, N])
def test_payload_nbytes(name, params, dtype, n):
    expected = ref_payload_nbytes(name, n, dtype, **wire_kwargs(name, params, n))
    c = gradcomp.codec(name, **params)
    assert c.payload_nbytes(n, dtype) == expected
    assert expected % 16 == 0 and expected >= HEADER_BYTES


def test_payload_nbytes_documented_values():
    f32, f16 = torch.float32, torch.float16
    assert ref_payload_nbytes("none", 1000, f32) == 48 + 4000
    assert ref_payload_nbytes("none", 1001, f16) == 48 + 2002 + 14
    assert ref_payload_nbytes("fp16", 1001, f32) == 48 + 2002 + 14
    assert ref_payload_nbytes("signsgd", N, f32, block=256) == 768  # 48 + 4 * 20 + 625 -> 753 -> 768
    assert ref_payload_nbytes("signsgd", N, f32, block=N) == 688  # 48 + 4 + 625 -> 677 -> 688
    assert ref_payload_nbytes("terngrad", N, f32) == 48 + 4 + 1250 + 10
    # 10 norms, 4999 codes of 1 + 4 bits
    assert ref_payload_nbytes("qsgd", N, f32, levels=15, block=512) == 48 + 40 + 3125 + 3
    assert ref_payload_nbytes("topk", N, f16, k=65) == 48 + 260 + 130 + 10
    assert ref_payload_nbytes("randomk", N, f32, k=250) == 48 + 1000 + 8
    assert ref_payload_nbytes("topk", 0, f32, k=0) == 48
    assert qsgd_code_bits(1) == 2 and qsgd_code_bits(7) == 4 and qsgd_code_bits(8) == 5
    assert qsgd_code_bits(32767) == 16


def test_count_for_ratio():
    assert gradcomp.count_for_ratio(0.01, 1000) == 10  # not 11: the ratio is read as 1/100 exactly
    assert gradcomp.count_for_ratio(0.1, 30) == 3
    assert gradcomp.count_for_ratio(0.013, N) == 65
    assert gradcomp.count_for_ratio(1e-9, 10) == 1
    assert gradcomp.count_for_ratio(1.0, 77) == 77
    assert gradcomp.count_for_ratio(0.5, 0) == 0


# ----------------------------------------------------------------------------------------------
# Encode: payload bytes and residual equal to the reference
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_encode_matches_reference(name, params, dtype, with_residual):
    kw = wire_kwargs(name, params, N)
    grad = make_grad(N, dtype)
    residual = make_residual(N, dtype) if with_residual else None
    grad_copy = grad.clone()
    residual_copy = residual.clone() if residual is not None else None

    expected, expected_residual = ref_encode(name, grad, residual, **kw, **KEY)
    # the reference leaves its inputs alone
    assert torch.equal(int_view(grad), int_view(grad_copy))
    if residual is not None:
        assert torch.equal(int_view(residual), int_view(residual_copy))

    lib_residual = residual.clone() if residual is not None else None
    payload = lib_encode(name, grad, lib_residual, **kw, **KEY)
    assert_payload_equal(payload, expected, f"{name} {dtype}")
    assert payload.numel() == ref_payload_nbytes(name, N, dtype, **kw)
    assert torch.equal(int_view(grad), int_view(grad_copy)), "encode must not write the gradient"
    if residual is None:
        assert expected_residual is None
    else:
        assert_same(lib_residual, expected_residual, "residual")

    h = parse_header(payload)
    assert h["magic"] == 0x504D4347 and bytes(payload[:4].tolist()) == b"GCMP"
    assert (h["version"], h["codec"], h["dtype"], h["reserved"]) == (1, CODEC_IDS[name], DTYPE_IDS[dtype], 0)
    assert (h["numel"], h["seed"], h["step"], h["bucket"]) == (N, KEY["seed"], KEY["step"], KEY["bucket"])
    # decoding our own payload with the reference and the library agrees
    assert_same(lib_decode(payload, dtype, N), ref_decode_sum(payload, dtype), "decode")


@pytest.mark.parametrize("name, params", [c for c in CASES if c[0] in ("terngrad", "qsgd")][:3])
@pytest.mark.parametrize("key", [
    dict(seed=0, step=0, bucket=0, rank=0),
    dict(seed=2**63 - 1, step=2**32 - 1, bucket=2**32 - 1, rank=2**32 - 1),
    dict(seed=2**32 + 1, step=1, bucket=0, rank=7),
    dict(seed=12345, step=99, bucket=5, rank=0),
])
def test_stochastic_codecs_follow_the_specified_generator(name, params, key):
    kw = wire_kwargs(name, params, 1237)
    grad = make_grad(1237, torch.float32, seed=4)
    assert_payload_equal(lib_encode(name, grad, **kw, **key), ref_encode(name, grad, **kw, **key)[0], str(key))


@pytest.mark.parametrize("name", ["terngrad", "qsgd"])
def test_rank_changes_the_coins_but_not_the_header(name):
    kw = {"levels": 4, "block": 100} if name == "qsgd" else {}
    grad = make_grad(1237, torch.float32, seed=4)
    a = lib_encode(name, grad, **kw, seed=1, step=2, bucket=3, rank=0)
    b = lib_encode(name, grad, **kw, seed=1, step=2, bucket=3, rank=1)
    assert torch.equal(a[:HEADER_BYTES], b[:HEADER_BYTES])
    assert not torch.equal(a, b)
    assert_payload_equal(b, ref_encode(name, grad, **kw, seed=1, step=2, bucket=3, rank=1)[0])


# ----------------------------------------------------------------------------------------------
# Decode-and-sum
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_decode_sum_matches_reference(name, params, dtype, count):
    n = 2011
    kw = wire_kwargs(name, params, n)
    payloads = []
    for rank in range(count):
        grad = make_grad(n, dtype, seed=10 + rank)
        payload = lib_encode(name, grad, **kw, seed=9, step=4, bucket=1, rank=rank)
        assert_payload_equal(payload, ref_encode(name, grad, **kw, seed=9, step=4, bucket=1, rank=rank)[0])
        payloads.append(payload)
    stack = torch.stack(payloads)
    for alpha in (1.0, 0.3):
        got = lib_decode(stack, dtype, n, alpha)
        assert_same(got, ref_decode_sum(stack, dtype, alpha), f"alpha={alpha}")
    # the sum of count payloads is the fp32 sum, in payload order, of their single decodes, each
    # already times alpha (alpha applies before the sum; checked with the library's own decodes)
    if dtype == torch.float32:
        for alpha in (1.0, 0.3):
            acc = torch.zeros(n)
            for p in payloads:
                acc = acc + lib_decode(p, dtype, n, alpha)
            assert_same(lib_decode(stack, dtype, n, alpha), acc, f"sequential sum of alpha={alpha} decodes")


@pytest.mark.parametrize("name", ["none", "topk", "randomk", "signsgd", "qsgd"])
def test_decode_sum_negative_alpha(name):
    n = 1003
    params = next(p for c, p in CASES if c == name)
    kw = wire_kwargs(name, params, n)
    for count in (1, 2):
        stack = torch.stack([lib_encode(name, make_grad(n, torch.float32, seed=r), **kw, rank=r) for r in range(count)])
        got = lib_decode(stack, torch.float32, n, -0.7)
        ref = ref_decode_sum(stack, torch.float32, -0.7)
        # equal as values; the sign of a zero (0 * alpha = -0 for a negative alpha, or +0 for an
        # element that no payload carries) is not part of the contract
        assert torch.equal(got, ref), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_signsgd_vote(dtype, count):
    n = 1001
    grads = [make_grad(n, dtype, seed=20 + r) for r in range(count)]
    if count == 4:  # force ties: two "+" and two "-" on the first 100 elements
        for r, g in enumerate(grads):
            g[:100] = 1.0 if r % 2 == 0 else -1.0
    block = 100  # 11 blocks, the last of one element
    stack = torch.stack([lib_encode("signsgd", g, block=block, rank=r) for r, g in enumerate(grads)])
    for alpha in (1.0, 0.25, 1 / 3):
        got = lib_decode(stack, dtype, n, alpha, vote=True)
        assert_same(got, ref_decode_sum(stack, dtype, alpha, vote=True), "vote")
        # explicit: per element, (sum of alpha * its block's scale, in payload order) * sign(sum of
        # signs), 0 on a tie
        magnitude = torch.zeros(n)
        votes = torch.zeros(n, dtype=torch.int64)
        for r, g in enumerate(grads):
            scales = stack[r, HEADER_BYTES:HEADER_BYTES + 4 * 11].clone().view(torch.float32)
            magnitude = magnitude + torch.tensor(alpha, dtype=torch.float32) * scales.repeat_interleave(block)[:n]
            votes += torch.where(g.float() < 0, -1, 1)
        expected = magnitude * torch.sign(votes).float()
        assert_same(got, expected.to(dtype), "explicit vote")
        if count == 4:
            assert bool((got[:100] == 0).all())


def test_signsgd_vote_needs_signsgd():
    p = lib_encode("none", torch.ones(10))
    out = torch.full((10,), 3.0)
    with pytest.raises((RuntimeError, ValueError), match="vote"):
        OPS.decode_sum(p, out, 1.0, True)
    assert bool((out == 3.0).all())


# ----------------------------------------------------------------------------------------------
# Error feedback
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_error_feedback_invariant(name, params, dtype):
    n = 3001
    kw = wire_kwargs(name, params, n)
    residual = torch.zeros(n, dtype=dtype)
    ref_residual = residual.clone()
    for step in range(3):
        grad = make_grad(n, dtype, seed=100 + step)
        old = residual.clone()
        payload = lib_encode(name, grad, residual, **kw, seed=3, step=step, rank=1)
        expected, ref_residual = ref_encode(name, grad, ref_residual, **kw, seed=3, step=step, rank=1)
        assert_payload_equal(payload, expected, f"step {step}")
        assert_same(residual, ref_residual, f"residual at step {step}")
        decoded = lib_decode(payload, dtype, n)
        m = grad.double() + old.double()
        rhs = decoded.double() + residual.double()
        err = (m - rhs).abs()
        tol = feedback_tolerance(m, decoded.double(), dtype)
        assert bool((err <= tol).all()), (
            f"step {step}: grad + old residual != decoded + new residual, worst excess "
            f"{float((err - tol).max())}")
    if name == "none" and dtype == torch.float32:
        assert bool((residual == 0).all())  # lossless: nothing left behind


def test_error_feedback_through_the_codec_api():
    """gradcomp.codec(spec).encode updates the residual in place and matches the reference."""
    n = 1500
    for spec, kw in [("topk:ratio=0.01", {"k": 15}), ("randomk:ratio=0.02,seed=9", {"k": 30, "seed": 9}),
                     ("signsgd:block=100", {"block": 100}), ("qsgd:levels=16,block=256,seed=5", {"levels": 16, "block": 256, "seed": 5}),
                     ("terngrad:seed=3", {"seed": 3}), ("fp16", {}), ("bf16", {}), ("none", {})]:
        c = gradcomp.codec(spec)
        grad = make_grad(n, torch.float32, seed=1)
        residual = make_residual(n, torch.float32)
        expected, expected_residual = ref_encode(c.name, grad, residual, **kw, step=5, bucket=2, rank=1)
        payload = c.encode(grad, residual, step=5, bucket=2, rank=1)
        assert_payload_equal(payload, expected, spec)
        assert_same(residual, expected_residual, spec)
        assert payload.numel() == c.payload_nbytes(n, torch.float32)
        out = torch.empty(n)
        c.decode_sum(torch.stack([payload, payload]), out, alpha=0.5)
        assert_same(out, ref_decode_sum(torch.stack([payload, payload]), torch.float32, 0.5), spec)


# ----------------------------------------------------------------------------------------------
# Monte Carlo: unbiasedness and the QSGD variance bound
# ----------------------------------------------------------------------------------------------

def _exact_moments(name, x, levels=0, block=0):
    """Per element: the exact mean and variance of the decoded value, and the largest jump b
    between the two values it can take. The coin is u = j * 2^-24, so P(u < a) = ceil(a 2^24) / 2^24;
    the arithmetic follows the spec in fp32."""
    n = x.numel()
    q = 2.0 ** 24
    if name == "terngrad":
        scale = x.abs().max()
        a = x.abs() * (torch.tensor(1.0) / scale)
        p = (torch.ceil(a.double() * q) / q).clamp(0, 1)
        low, high = torch.zeros(n, dtype=torch.float64), scale.double().expand(n)
    else:
        b = torch.arange(n) // block
        padded = torch.zeros(-(-n // block) * block)
        padded[:n] = x
        rows = padded.view(-1, block)
        rows64 = rows.double()
        norms = saturated_norm(canonical_sum(rows64 * rows64))  # the spec's norm (double sum and sqrt)
        s = torch.tensor(float(levels))
        step = (norms / s)[b]
        r = torch.minimum(x.abs() * (s / norms)[b], s)
        floor_r = torch.floor(r)
        p = torch.ceil((r - floor_r).double() * q) / q
        low = (floor_r * step).double()
        high = ((floor_r + 1) * step).double()
    sign = torch.where(x < 0, -1.0, 1.0).double()
    mean = sign * (low + p * (high - low))
    var = p * (1 - p) * (high - low) ** 2
    return mean, var, (high - low), p


def _mc_decodes(name, x, trials_per_step, steps, **kw):
    """Decoded values (float64) of trials_per_step ranks x steps independent encodings of x."""
    rows = []
    for step in range(steps):
        for rank in range(trials_per_step):
            p = lib_encode(name, x, **kw, seed=1000 + step, step=step, bucket=1, rank=rank)
            rows.append(lib_decode(p, torch.float32, x.numel()).double())
    return torch.stack(rows)


def _mc_x(kind: str, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(77)
    if kind == "ones":
        return torch.ones(n)
    x = torch.randn(n, generator=gen)
    x[5] = 0.0
    x[17] = 3 * float(x.abs().max())  # a spike: one dominant element, the rest small
    return x


@pytest.mark.parametrize("name, kw", [
    ("terngrad", {}),
    ("qsgd", {"levels": 1, "block": 100}),
    ("qsgd", {"levels": 4, "block": 333}),
    ("qsgd", {"levels": 15, "block": 1000}),
])
def test_monte_carlo_unbiased(name, kw):
    n, ranks, steps = 1000, 64, 24
    trials = ranks * steps
    x = _mc_x("randn", n)
    mean_exact, var, jump, p = _exact_moments(name, x, **kw)
    # 1. the exact mean differs from x only by the 24-bit coin and fp32 rounding
    ulp_scale = jump + x.abs().double()
    assert bool(((mean_exact - x.double()).abs() <= 8 * 2.0**-24 * ulp_scale + 1e-30).all())
    decodes = _mc_decodes(name, x, ranks, steps, **kw)
    mean = decodes.mean(0)
    # 2. per element, Bernstein: P(|mean - mu| >= t) <= 2 exp(-T t^2 / (2 var + 2 b t / 3)), with
    # |X - mu| <= b; at a family-wise level delta over the n elements
    delta = 1e-6
    L = math.log(2 * n / delta)
    t = jump * L / (3 * trials) + torch.sqrt((jump * L / (3 * trials)) ** 2 + 2 * var * L / trials)
    err = (mean - mean_exact).abs()
    assert bool((err <= t + 1e-12).all()), f"worst excess {float((err - t).max())} at {int((err - t).argmax())}"
    # 3. a systematic bias (e.g. shrinking toward 0) adds up across elements: the signed sum
    # sum_i sign(x_i) (mean_i - mu_i) has variance sum_i var_i / T and is close to normal (CLT)
    z = NormalDist().inv_cdf(1 - delta / 2)
    signed = float((torch.sign(x.double()) * (mean - mean_exact)).sum())
    assert abs(signed) <= z * math.sqrt(float(var.sum()) / trials), (signed, math.sqrt(float(var.sum()) / trials))
    # 4. jointly: S = sum of squared z-scores has mean d and variance sum(2 + (kappa - 3) / T),
    # kappa the kurtosis of a two-point variable; S is a sum of d independent terms, so it is
    # compared with a two-sided normal quantile at level delta
    live = var > 0
    z2 = (mean - mean_exact)[live] ** 2 / (var[live] / trials)
    pl = p[live]
    kappa = (1 - 3 * pl * (1 - pl)) / (pl * (1 - pl))
    var_s = float((2 + (kappa - 3) / trials).sum())
    d = int(live.sum())
    assert abs(float(z2.sum()) - d) <= z * math.sqrt(var_s), (float(z2.sum()), d, math.sqrt(var_s))


@pytest.mark.parametrize("kind", ["ones", "randn"])
@pytest.mark.parametrize("levels, block", [(1, 100), (2, 256), (4, 333), (15, 1000)])
def test_qsgd_variance_bound(levels, block, kind):
    n, ranks, steps = 1000, 64, 4
    trials = ranks * steps
    x = _mc_x(kind, n)
    _, var, _, _ = _exact_moments("qsgd", x, levels=levels, block=block)
    decodes = _mc_decodes("qsgd", x, ranks, steps, levels=levels, block=block)
    sq = (decodes - x.double()) ** 2
    nblocks = -(-n // block)
    z = NormalDist().inv_cdf(1 - 1e-6 / (2 * nblocks))
    for b in range(nblocks):
        lo, hi = b * block, min(n, (b + 1) * block)
        d = hi - lo
        norm2 = float((x[lo:hi].double() ** 2).sum())
        bound = min(d / levels**2, math.sqrt(d) / levels) * norm2
        exact = float(var[lo:hi].sum())  # E||Q(x) - x||^2 up to the 2^-24 bias, from the spec
        assert exact <= bound * (1 + 1e-6), (b, exact, bound)
        per_trial = sq[:, lo:hi].sum(1)
        mean, se = float(per_trial.mean()), float(per_trial.std()) / math.sqrt(trials)
        assert mean <= bound + z * se, (b, mean, bound, se)
        assert abs(mean - exact) <= z * se + 1e-9 * bound, (b, mean, exact, se)


# ----------------------------------------------------------------------------------------------
# Dtypes, layouts, sizes and non-finite values
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_non_contiguous_gradient(name, params, dtype):
    base = make_grad(41 * 53, dtype, seed=5).view(41, 53)
    grad = base.t()  # non-contiguous, 53 x 41
    assert not grad.is_contiguous()
    kw = wire_kwargs(name, params, grad.numel())
    residual = make_residual(grad.numel(), dtype).view(53, 41)
    lib_residual = residual.clone()
    payload = lib_encode(name, grad, lib_residual, **kw, **KEY)
    expected, expected_residual = ref_encode(name, grad, residual, **kw, **KEY)
    assert_payload_equal(payload, expected)
    assert_same(lib_residual, expected_residual, "residual")
    contiguous_residual = residual.clone()
    assert_payload_equal(lib_encode(name, grad.contiguous(), contiguous_residual, **kw, **KEY), payload)
    # every 3rd element of a longer vector
    strided = make_grad(3 * 1001, dtype, seed=6)[::3]
    kw = wire_kwargs(name, params, strided.numel())
    assert_payload_equal(lib_encode(name, strided, **kw, **KEY), ref_encode(name, strided, **kw, **KEY)[0])


def test_non_contiguous_residual_and_out_are_refused():
    grad = torch.randn(100)
    residual = torch.zeros(200)[::2]
    with pytest.raises((RuntimeError, ValueError), match="contiguous"):
        lib_encode("signsgd", grad, residual, block=256)
    payload = lib_encode("signsgd", grad, block=256)
    out = torch.full((200,), 5.0)
    with pytest.raises((RuntimeError, ValueError), match="contiguous"):
        OPS.decode_sum(payload, out[::2], 1.0, False)
    assert bool((out == 5.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_empty_and_single_element(name, params, dtype, n):
    kw = wire_kwargs(name, params, n)
    grad = make_grad(n, dtype, seed=8) * 3
    residual = make_residual(n, dtype)
    lib_residual = residual.clone()
    payload = lib_encode(name, grad, lib_residual, **kw, **KEY)
    expected, expected_residual = ref_encode(name, grad, residual, **kw, **KEY)
    assert_payload_equal(payload, expected)
    assert payload.numel() == ref_payload_nbytes(name, n, dtype, **kw)
    assert_same(lib_residual, expected_residual, "residual")
    stack = torch.stack([payload, payload])
    out = lib_decode(stack, dtype, n, 0.5)
    assert_same(out, ref_decode_sum(stack, dtype, 0.5))
    assert out.numel() == n
    lossless = name in ("none", "topk", "randomk") and not (kw.get("compact") and dtype == torch.float32)
    if n == 1 and lossless:
        assert_same(lib_decode(payload, dtype, 1), (grad.float() + residual.float()).to(dtype))
    elif n == 1 and name == "topk":  # compact: the value as bf16, the rest kept in the residual
        m = grad.float() + residual.float()
        assert_same(lib_decode(payload, dtype, 1), m.to(torch.bfloat16).float())
        assert_same(lib_decode(payload, dtype, 1) + lib_residual, m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, params", CASES, ids=CASE_IDS)
def test_nan_and_inf(name, params, dtype):
    """Observed (and specified) behaviour with non-finite values:
    none/fp16/bf16: element-wise, NaN and Inf travel as themselves (finite values stay finite).
    signsgd: a block's scale (mean |m|) is NaN where the block holds a NaN, and every element of
      the block decodes as NaN; in a block with Inf but no NaN the scale is Inf and every element
      decodes as +-Inf. Other blocks stay finite.
    terngrad: the scale (max |m|) is non-finite, every code is 0, and 0 * scale makes the whole
      bucket decode as NaN.
    qsgd: only the blocks holding NaN or Inf have a non-finite norm and decode as NaN.
    topk: NaN ranks above Inf above every finite value, so they are sent first, as themselves.
    randomk: sent as themselves where the permutation picks them.
    """
    n = 1500
    kw = wire_kwargs(name, params, n)
    grad = make_grad(n, dtype, seed=9)
    nan_at, inf_at, ninf_at, nnan_at = 10, 700, 1300, 1301
    grad[nan_at] = float("nan")
    grad[inf_at] = float("inf")
    grad[ninf_at] = -float("inf")
    grad[nnan_at] = -float("nan")
    residual = make_residual(n, dtype)
    for res in (None, residual):
        lib_res = res.clone() if res is not None else None
        payload = lib_encode(name, grad, lib_res, **kw, **KEY)
        expected, expected_res = ref_encode(name, grad, res, **kw, **KEY)
        assert_payload_equal_nan_aware(payload, expected, name, n, kw, dtype, "non-finite")
        if res is not None:
            assert_same(lib_res, expected_res, "residual")
        stack = torch.stack([payload, payload])
        out = lib_decode(stack, dtype, n, 0.5)
        assert_same(out, ref_decode_sum(stack, dtype, 0.5))
        single = lib_decode(payload, dtype, n)
        nan, finite = torch.isnan(single), torch.isfinite(single)
        if name in ("none", "bf16") or (name == "fp16" and dtype != torch.float32):
            assert torch.equal(nan, torch.isnan(grad))
            assert single[inf_at] == float("inf") and single[ninf_at] == -float("inf")
            assert int(finite.sum()) == n - 4
        elif name == "fp16":  # float32 values beyond 65504 would also overflow; here only the four
            assert torch.equal(nan, torch.isnan(grad)) and int(finite.sum()) == n - 4
        elif name == "terngrad":
            assert bool(nan.all()), "a non-finite scale makes the whole bucket NaN"
        elif name == "signsgd":
            blocks = torch.arange(n) // params["block"]
            in_nan = torch.isin(blocks, torch.tensor([nan_at // params["block"], nnan_at // params["block"]]))
            in_inf = torch.isin(blocks, torch.tensor([inf_at // params["block"], ninf_at // params["block"]]))
            assert bool(nan[in_nan].all()) and bool(torch.isinf(single[in_inf & ~in_nan]).all())
            assert bool(finite[~in_nan & ~in_inf].all())
        elif name == "qsgd":
            block = params["block"]
            bad_blocks = {i // block for i in (nan_at, inf_at, ninf_at, nnan_at)}
            blocks = torch.arange(n) // block
            in_bad = torch.tensor([int(b) in bad_blocks for b in blocks])
            assert bool(nan[in_bad].all()) and bool(finite[~in_bad].all())
        elif name == "topk":
            sent = ref_topk_indices(payload).tolist()
            assert {nan_at, nnan_at, inf_at, ninf_at} <= set(sent)
            assert bool(nan[[nan_at, nnan_at]].all()) and single[inf_at] == float("inf")
        else:  # randomk
            idx = ref_randomk_indices(n, kw["k"], KEY["seed"], KEY["step"], KEY["bucket"])
            assert torch.equal(torch.isnan(single[idx]), torch.isnan(grad[idx]))

    # Inf without NaN
    grad2 = make_grad(n, dtype, seed=9)
    grad2[inf_at] = float("inf")
    payload = lib_encode(name, grad2, **kw, **KEY)
    assert_payload_equal_nan_aware(payload, ref_encode(name, grad2, **kw, **KEY)[0], name, n, kw, dtype, "inf only")
    single = lib_decode(payload, dtype, n)
    if name == "signsgd":
        in_inf = torch.arange(n) // params["block"] == inf_at // params["block"]
        assert bool(torch.isinf(single[in_inf]).all()) and bool(torch.isfinite(single[~in_inf]).all())
    elif name == "terngrad":
        assert bool(torch.isnan(single).all())


# ----------------------------------------------------------------------------------------------
# Codec-specific behaviour, checked explicitly besides the reference
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [256, 9000, 70000])
def test_signsgd_large_buckets_on_two_threads_match_the_reference(block):
    """The paths the small cases above do not reach: many slices of blocks summed where they are
    signed (block 256), several large blocks summed first, across blocks (9000) and within each
    (70000); on two threads."""
    n = 200_003
    grad, residual = make_grad(n, torch.float32, seed=30), make_residual(n, torch.float32)
    other = make_grad(n, torch.float32, seed=31)
    torch.set_num_threads(2)
    try:
        lib_residual = residual.clone()
        payload = lib_encode("signsgd", grad, lib_residual, block=block, **KEY)
        stack = torch.stack([payload, lib_encode("signsgd", other, block=block, **dict(KEY, rank=3))])
        sums = [lib_decode(stack, torch.float32, n, 0.5, vote) for vote in (False, True)]
    finally:
        torch.set_num_threads(1)
    expected, expected_residual = ref_encode("signsgd", grad, residual, block=block, **KEY)
    assert_payload_equal(payload, expected)
    assert_same(lib_residual, expected_residual, "residual")
    for vote, got in zip((False, True), sums):
        assert_same(got, ref_decode_sum(stack, torch.float32, 0.5, vote), f"decode, vote={vote}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_signsgd_sign_bits_and_ties_at_zero(dtype):
    values = [0.0, -0.0, 1.0, -1.0, float("nan"), -2.0, 3.0, -0.0, 0.5, -0.5, 0.0]
    grad = torch.tensor(values, dtype=dtype)
    payload = lib_encode("signsgd", grad, block=len(values))  # one block: one scale, the signs at byte 52
    assert_payload_equal(payload, ref_encode("signsgd", grad, block=len(values))[0])
    bits = [(int(payload[52 + i // 8]) >> (i % 8)) & 1 for i in range(len(values))]
    assert bits == [1, 1, 1, 0, 1, 0, 1, 1, 1, 0, 1]  # "+" for m >= 0, -0 and NaN
    assert int(payload[53]) >> 3 == 0  # unused bits of the last byte are zero
    assert bool((payload[54:] == 0).all())  # zero padding


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_ties_lower_index_and_nan_above_inf(dtype):
    # magnitudes: NaN > Inf > 4 > 3 (x3 ties) > 1 > 0 == -0
    values = [1.0, -3.0, 0.0, 3.0, float("nan"), -float("inf"), 3.0, -0.0, 4.0, -1.0, 0.0]
    grad = torch.tensor(values, dtype=dtype)
    expected_sets = {1: [4], 2: [4, 5], 3: [4, 5, 8], 4: [1, 4, 5, 8], 5: [1, 3, 4, 5, 8],
                     6: [1, 3, 4, 5, 6, 8], 7: [0, 1, 3, 4, 5, 6, 8], 8: [0, 1, 3, 4, 5, 6, 8, 9],
                     9: [0, 1, 2, 3, 4, 5, 6, 8, 9], 10: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}
    for k, expected in expected_sets.items():
        residual = torch.zeros_like(grad)
        payload = lib_encode("topk", grad, residual, k=k)
        ref_payload, ref_residual = ref_encode("topk", grad, torch.zeros_like(grad), k=k)
        assert_payload_equal(payload, ref_payload, f"k={k}")
        assert_same(residual, ref_residual, f"k={k}")
        sent = payload[HEADER_BYTES:HEADER_BYTES + 4 * k].clone().view(torch.int32).tolist()
        assert sent == expected, k
        m = (grad.float() + 0.0).to(dtype)  # M = grad + residual: -0 + 0 is +0
        vals = payload[HEADER_BYTES + 4 * k:HEADER_BYTES + 4 * k + k * grad.element_size()].clone().view(dtype)
        assert_same(vals, m[expected], "values")
        left = m.clone()
        left[expected] = 0
        assert_same(residual, left, "residual keeps what was not sent")


def test_topk_ties_at_scale():
    """Many exactly equal magnitudes: the lowest indices among them win."""
    n = 3000
    grad = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    grad[2500] = 2.0
    payload = lib_encode("topk", grad, k=100)
    assert_payload_equal(payload, ref_encode("topk", grad, k=100)[0])
    sent = payload[HEADER_BYTES:HEADER_BYTES + 400].clone().view(torch.int32)
    assert sent.tolist() == list(range(99)) + [2500]


def test_qsgd_codes_explicit():
    """A block of [0.6, -0.8] has norm 1; with s = 4: r = 2.4 and 3.2, level in {2,3} / {3,4}."""
    grad = torch.tensor([0.6, -0.8])
    payload = lib_encode("qsgd", grad, levels=4, block=2)
    assert_payload_equal(payload, ref_encode("qsgd", grad, levels=4, block=2)[0])
    assert payload[48:52].clone().view(torch.float32).item() == pytest.approx(1.0, rel=1e-6)
    bits = int(payload[52]) | (int(payload[53]) << 8)
    c0, c1 = bits & 0xF, (bits >> 4) & 0xF  # 4-bit codes: level << 1 | negative
    assert c0 & 1 == 0 and (c0 >> 1) in (2, 3)
    assert c1 & 1 == 1 and (c1 >> 1) in (3, 4)


def test_terngrad_codes_explicit():
    grad = torch.tensor([2.0, -2.0, 0.0, 1.0, -1.0])
    payload = lib_encode("terngrad", grad, seed=3)
    assert_payload_equal(payload, ref_encode("terngrad", grad, seed=3)[0])
    assert payload[48:52].clone().view(torch.float32).item() == 2.0  # max |m|
    codes = [(int(payload[52 + i // 4]) >> (2 * (i % 4))) & 3 for i in range(5)]
    assert codes[0] == 0b01 and codes[1] == 0b11 and codes[2] == 0  # |m| = scale: always sent
    assert codes[3] in (0, 0b01) and codes[4] in (0, 0b11)


# ----------------------------------------------------------------------------------------------
# randomk indices
# ----------------------------------------------------------------------------------------------

def _lib_randomk_indices(n, k, seed, step, bucket, rank=0):
    """The library's indices, read back through values that equal their own index + 1."""
    grad = torch.arange(1, n + 1, dtype=torch.float32)
    payload = lib_encode("randomk", grad, k=k, seed=seed, step=step, bucket=bucket, rank=rank)
    return payload[HEADER_BYTES:HEADER_BYTES + 4 * k].clone().view(torch.float32).to(torch.int64) - 1


@pytest.mark.parametrize("n, k", [(1, 1), (2, 1), (3, 3), (5, 2), (17, 9), (1000, 10), (4099, 400), (65537, 655)])
def test_randomk_indices(n, k):
    idx = _lib_randomk_indices(n, k, seed=21, step=3, bucket=4)
    assert torch.equal(idx, ref_randomk_indices(n, k, 21, 3, 4))
    assert idx.numel() == k and len(set(idx.tolist())) == k, "distinct"
    assert bool((idx >= 0).all()) and bool((idx < n).all()), "in range"


def test_randomk_indices_shared_by_ranks_and_keyed_by_step():
    n, k = 2000, 50
    base = _lib_randomk_indices(n, k, seed=5, step=1, bucket=2, rank=0)
    for rank in (1, 3, 2**32 - 1):
        assert torch.equal(_lib_randomk_indices(n, k, seed=5, step=1, bucket=2, rank=rank), base)
    for other in (dict(seed=5, step=2, bucket=2), dict(seed=6, step=1, bucket=2), dict(seed=5, step=1, bucket=3)):
        assert set(_lib_randomk_indices(n, k, **other).tolist()) != set(base.tolist()), other
    # different gradients on different ranks: the decoded sum is supported on the shared indices
    stack = torch.stack([lib_encode("randomk", make_grad(n, torch.float32, seed=r) + 10, k=k, seed=5, step=1,
                                    bucket=2, rank=r) for r in range(4)])
    out = lib_decode(stack, torch.float32, n, 0.25)
    assert_same(out, ref_decode_sum(stack, torch.float32, 0.25))
    assert set(out.nonzero().flatten().tolist()) == set(base.tolist())


@pytest.mark.parametrize("dtype", DTYPES)
def test_randomk_ratio_one_is_lossless(dtype):
    n = 1234
    c = gradcomp.codec("randomk", ratio=1.0, seed=17)
    grad = make_grad(n, dtype, seed=2)
    residual = torch.zeros(n, dtype=dtype)
    payload = c.encode(grad, residual, step=3, bucket=1)
    idx = ref_randomk_indices(n, n, 17, 3, 1)
    assert torch.equal(torch.sort(idx).values, torch.arange(n)), "a permutation"
    assert_payload_equal(payload, ref_encode("randomk", grad, torch.zeros(n, dtype=dtype), k=n, seed=17, step=3,
                                             bucket=1)[0])
    out = torch.empty(n, dtype=dtype)
    c.decode_sum(payload, out)
    # lossless as values; a decoded -0 is +0 (the sum starts from +0, and +0 + -0 = +0)
    assert torch.equal(out, grad)
    assert_same(out, (grad.float() + 0.0).to(dtype), "lossless")
    assert bool((residual == 0).all())


# ----------------------------------------------------------------------------------------------
# Every CPU variant (base, AVX2, AVX-512; GRADCOMP_CPU_ISA caps the one picked at load time)
# ----------------------------------------------------------------------------------------------

def variant_mismatches() -> list[str]:
    """Every case, dtype and residual setting at sizes around tile, byte and chunk boundaries,
    encoded and decoded by this process's CPU variant and compared with the reference."""
    problems = []
    for n in (63, 129, 2049):
        for name, params in CASES:
            kw = wire_kwargs(name, params, n)
            for dtype in DTYPES:
                for with_residual in (False, True):
                    grad = make_grad(n, dtype, seed=n)
                    residual = make_residual(n, dtype) if with_residual else None
                    lib_residual = residual.clone() if residual is not None else None
                    payload = lib_encode(name, grad, lib_residual, **kw, **KEY)
                    expected, expected_residual = ref_encode(name, grad, residual, **kw, **KEY)
                    other = lib_encode(name, make_grad(n, dtype, seed=n + 1), **kw, **dict(KEY, rank=5))
                    stack = torch.stack([payload, other])
                    try:
                        assert_payload_equal(payload, expected)
                        if residual is not None:
                            assert_same(lib_residual, expected_residual)
                        assert_same(lib_decode(stack, dtype, n, 0.3), ref_decode_sum(stack, dtype, 0.3))
                        if name == "signsgd":
                            assert_same(lib_decode(stack, dtype, n, 0.3, True), ref_decode_sum(stack, dtype, 0.3, True))
                    except (AssertionError, pytest.fail.Exception) as e:
                        problems.append(f"{name} {params} {dtype} n={n} ef={with_residual}: {str(e)[:200]}")
    return problems


def test_default_cpu_variant_matches_reference():
    assert variant_mismatches() == []


@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_capped_cpu_variant_matches_reference(isa):
    if isa == "avx2" and gradcomp.cpu_isa() == "base":
        pytest.skip("this CPU has no AVX2 variant to cap to")
    import subprocess
    import json
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json, sys, torch, gradcomp; torch.set_num_threads(1); sys.path.insert(0, %r); "
            "import test_codecs as T; print(json.dumps([gradcomp.cpu_isa(), T.variant_mismatches()]))" % here)
    env = dict(os.environ, GRADCOMP_CPU_ISA=isa, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    picked, mismatches = json.loads(result.stdout.strip().splitlines()[-1])
    assert picked == isa  # the cap took effect
    assert mismatches == []


# ----------------------------------------------------------------------------------------------
# Decode refuses what it cannot trust, and then leaves out untouched
# ----------------------------------------------------------------------------------------------

def _valid(name="topk", n=1000, step=3):
    kw = {"k": 20} if name in ("topk", "randomk") else {"block": 256} if name == "signsgd" else {}
    return lib_encode(name, make_grad(n, torch.float32, seed=step), **kw, seed=1, step=step, bucket=2)


def _poke(payload, offset, value, fmt="<B"):
    import struct
    p = payload.clone()
    raw = struct.pack(fmt, value)
    p[offset:offset + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return p


def _topk_index_at(payload, j, value):
    return _poke(payload, HEADER_BYTES + 4 * j, value, "<i")


CORRUPTIONS = {
    "truncated": (lambda: _valid()[:-16], "truncated"),
    "shorter than header": (lambda: _valid()[:40], "shorter|truncated"),
    "extra padding": (lambda: torch.cat([_valid(), torch.zeros(16, dtype=torch.uint8)]), "padded|truncated"),
    "bad magic": (lambda: _poke(_valid(), 0, ord("X")), "magic"),
    "bad version": (lambda: _poke(_valid(), 4, 2), "version"),
    "bad codec id": (lambda: _poke(_valid(), 5, 8), "codec"),
    "bad dtype id": (lambda: _poke(_valid(), 6, 7), "dtype"),
    "reserved byte": (lambda: _poke(_valid(), 7, 1), "reserved"),
    "k above numel": (lambda: _poke(_valid(), 16, 5000, "<q"), "k outside"),
    "negative numel": (lambda: _poke(_valid(), 8, -4, "<q"), "negative"),
    "headers differ (step)": (lambda: torch.stack([_valid(step=3), _valid(step=4)]), "differs"),
    # signsgd over 1000 elements and terngrad over 500 both take 192 bytes
    "headers differ (codec)": (lambda: torch.stack([_valid("signsgd"), _valid("terngrad", n=500)]), "differs"),
    "topk index = numel": (lambda: _topk_index_at(_valid(), 19, 1000), "index 1000.*outside"),
    "topk index negative": (lambda: _topk_index_at(_valid(), 0, -1), "index -1.*outside"),
    "topk bad index in 2nd payload": (lambda: torch.stack([_valid(), _topk_index_at(_valid(), 5, 2**31 - 1)]),
                                      "payload 1.*outside"),
    "no payloads": (lambda: _valid().new_zeros((0, 1056)), "no payloads"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_decode_refuses_and_leaves_out_untouched(case):
    make, pattern = CORRUPTIONS[case]
    payloads = make()
    out = torch.full((1000,), 42.0)
    with pytest.raises((RuntimeError, ValueError), match=pattern):
        OPS.decode_sum(payloads, out, 1.0, False)
    assert bool((out == 42.0).all()), "out was written"
    # the reference refuses the same stack
    with pytest.raises(ValueError):
        ref_decode_sum(payloads, torch.float32)


@pytest.mark.parametrize("out", [
    torch.full((1000,), 42.0, dtype=torch.float16),
    torch.full((1000,), 42.0, dtype=torch.bfloat16),
    torch.full((1000,), 42.0, dtype=torch.float64),
    torch.full((999,), 42.0),
    torch.full((1001,), 42.0),
    torch.full((10, 100), 42.0).t(),
], ids=["f16", "bf16", "f64", "short", "long", "non-contiguous"])
def test_decode_refuses_wrong_out(out):
    payload = _valid("signsgd")
    before = out.clone()
    with pytest.raises((RuntimeError, ValueError), match="out|dtype|contiguous"):
        OPS.decode_sum(payload, out, 1.0, False)
    assert torch.equal(out, before)


def test_decode_error_messages_name_the_problem():
    out = torch.zeros(1000)
    with pytest.raises((RuntimeError, ValueError)) as info:
        OPS.decode_sum(torch.stack([_valid(step=3), _valid(step=4)]), out, 1.0, False)
    assert "payload 1" in str(info.value) and "differs" in str(info.value)
    with pytest.raises((RuntimeError, ValueError)) as info:
        OPS.decode_sum(_valid(), torch.zeros(1000, dtype=torch.float16), 1.0, False)
    assert "1000" in str(info.value) and "dtype" in str(info.value)


def test_topk_compact_saturates_fp32_values_beyond_bf16():
    """bf16's largest finite value is 3.3895e38: a finite fp32 above it is sent as that value, not as Inf,
    and error feedback keeps the difference."""
    grad = torch.tensor([3.4e38, -3.4e38, 1.0, 3e38, -1e-3])
    residual = torch.zeros(5)
    payload = lib_encode("topk", grad, residual, k=4, compact=True, **KEY)
    assert_payload_equal(payload, ref_encode("topk", grad, torch.zeros(5), k=4, compact=True, **KEY)[0])
    out = lib_decode(payload, torch.float32, 5)
    top = torch.finfo(torch.bfloat16).max
    assert out.tolist()[:2] == [top, -top] and bool(torch.isfinite(residual).all())
    assert torch.equal(out + residual, grad)


@pytest.mark.parametrize("defect", ["repeated", "descending"])
def test_decode_refuses_topk_indices_out_of_order(defect):
    payload = _valid()  # k = 20 over 1000 elements
    idx = payload[HEADER_BYTES:HEADER_BYTES + 80].clone().view(torch.int32)
    if defect == "repeated":
        idx[1] = idx[0]
    else:
        idx[0], idx[1] = int(idx[1]), int(idx[0])
    bad = payload.clone()
    bad[HEADER_BYTES:HEADER_BYTES + 80] = idx.view(torch.uint8)
    assert "ascending" in ref_validate(bad)  # in range: only the order is wrong
    out = torch.full((1000,), 42.0)
    with pytest.raises((RuntimeError, ValueError), match="ascending|order|repeat|duplicate"):
        OPS.decode_sum(bad, out, 1.0, False)
    assert bool((out == 42.0).all())


def test_fp16_overflow_saturates():
    """A finite fp32 value beyond the fp16 range travels as +-65504 under fp16 (where round to
    nearest even would overflow to +-Inf), and the error-feedback residual holds the rest."""
    grad = torch.tensor([1e5, -7e4, 65504.0, 65520.0, 1.0])
    residual = torch.zeros(5)
    payload = lib_encode("fp16", grad, residual)
    expected, expected_residual = ref_encode("fp16", grad, torch.zeros(5))
    assert_payload_equal(payload, expected)
    assert_same(residual, expected_residual)
    wire = payload[HEADER_BYTES:HEADER_BYTES + 10].clone().view(torch.float16).float()
    assert wire.tolist() == [65504.0, -65504.0, 65504.0, 65504.0, 1.0]
    assert residual.tolist() == [1e5 - 65504.0, -7e4 + 65504.0, 0.0, 16.0, 0.0]


def test_ref_validate_accepts_valid_stacks():
    for name in ("none", "fp16", "bf16", "signsgd", "terngrad", "topk", "randomk"):
        assert ref_validate(torch.stack([_valid(name), _valid(name)])) is None


@pytest.mark.parametrize("compact", [False, True], ids=["wide", "compact"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 1500, 45000])
def test_topk_above_the_sample_size_matches_reference(dtype, k, compact):
    """Tensors above 2^16 elements take the sampled-threshold path of the top-k selection; compact, they
    span 3 spans of 2^16, the middle one without a large element (k = 1: two empty spans)."""
    n = 150_001
    grad = make_grad(n, dtype, seed=k)
    grad[COMPACT_SPAN: 2 * COMPACT_SPAN] *= 1e-3
    residual = make_residual(n, dtype)
    lib_residual = residual.clone()
    payload = lib_encode("topk", grad, lib_residual, k=k, compact=compact, **KEY)
    expected, expected_residual = ref_encode("topk", grad, residual, k=k, compact=compact, **KEY)
    assert_payload_equal(payload, expected)
    stack = torch.stack([payload, lib_encode("topk", grad.flip(0), k=k, compact=compact, **dict(KEY, rank=3))])
    assert_same(lib_decode(stack, dtype, n, 0.5), ref_decode_sum(stack, dtype, 0.5))
    assert torch.equal(lib_residual.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       expected_residual.view(torch.int16 if dtype != torch.float32 else torch.int32))
