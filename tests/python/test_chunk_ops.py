"""The two-phase scheme's ops (encode_chunks, reencode_sum, decode_chunks) against what they stand for:
encode and decode_sum of each chunk on its own, with torch.tensor_split's balanced chunks."""

from __future__ import annotations

import math

import pytest
import torch

import gradcomp
from gradcomp.codecs import HEADER_BYTES
from reference import ref_encode

SPECS = ["signsgd", "signsgd:vote=true", "signsgd:block=100", "terngrad", "qsgd:levels=7,block=16", "topk:ratio=0.1",
         "terngrad:error_feedback=true"]


def _pieces(tensor, world):
    return torch.tensor_split(tensor, world)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("numel, world", [(1000, 4), (1003, 3), (7, 5), (2, 4), (0, 3), (50, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_chunks_equals_each_chunk_encoded_on_its_own(spec, numel, world, dtype):
    codec = gradcomp.codec(spec)
    grad = torch.randn(numel).to(dtype)
    residual = torch.randn(numel).to(dtype) if codec.error_feedback else None
    expected_residual = None if residual is None else residual.clone()  # its chunks are views, updated in place
    residual_pieces = [None] * world if residual is None else _pieces(expected_residual, world)
    expected = torch.cat([codec.encode(g, r, step=9, bucket=2, rank=40 + j)
                          for j, (g, r) in enumerate(zip(_pieces(grad, world), residual_pieces))])
    got = codec.encode_chunks(grad, residual, world, step=9, bucket=2, first_rank=40)
    assert torch.equal(got, expected)
    if residual is not None:
        assert torch.equal(residual, expected_residual)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("numel, world", [(1003, 3), (3, 4)])
def test_decode_chunks_decodes_each_row_into_its_chunk(spec, numel, world):
    codec = gradcomp.codec(spec)
    grads = _pieces(torch.randn(numel), world)
    payloads = [codec.encode(g.clone(), None, rank=j) for j, g in enumerate(grads)]
    rows = torch.zeros(world, max(p.numel() for p in payloads), dtype=torch.uint8)
    for j, payload in enumerate(payloads):
        rows[j, : payload.numel()] = payload
    expected = torch.cat([codec.decode_sum(p, torch.empty(g.numel())) for p, g in zip(payloads, grads)])
    out = torch.full((numel,), 7.0)
    codec.decode_chunks(rows, out)
    assert torch.equal(out, expected)


def test_decode_chunks_refuses_rows_that_do_not_fit():
    codec = gradcomp.codec("signsgd")
    rows = torch.zeros(3, 48, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"one row per chunk: rows of shape \[2, bytes\]"):
        torch.ops.gradcomp.decode_chunks(rows, torch.empty(100), False, "signsgd", [0, 0])
    with pytest.raises(ValueError, match="chunk 0's payload takes 80 bytes, but the rows hold 48"):
        codec.decode_chunks(rows, torch.empty(300))
    rows = torch.zeros(2, 96, dtype=torch.uint8)
    for name, param1 in (("signsgd", 0), ("qsgd", 0)):  # a block of 0 is refused, not divided by
        with pytest.raises(ValueError, match=f"{name} block outside"):
            torch.ops.gradcomp.decode_chunks(rows, torch.empty(100), False, name, [15 if name == "qsgd" else 0] * 2,
                                             param1)


def block_root_mean_squares(values: torch.Tensor, block: int) -> torch.Tensor:
    """sqrt(sum of squares / length) of each block of `block` elements, as float32: the sum exact
    (math.fsum), the rest in double. What signsgd's scales are when it re-encodes a sum of signs."""
    roots = []
    for part in values.split(block) if values.numel() else ():
        squares = [v * v for v in part.double().tolist()]
        roots.append(math.sqrt(math.fsum(squares) / len(squares)))
    return torch.tensor(roots, dtype=torch.float32)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("numel", [1, 257, 4000])
def test_reencode_sum_is_decode_sum_then_encode(spec, numel):
    codec = gradcomp.codec(spec)
    payloads = torch.stack([codec.encode(torch.randn(numel) * (r + 1), None, rank=r) for r in range(3)])
    owner = torch.randn(numel) if codec.error_feedback else None
    average = torch.empty(numel)
    kept = None if owner is None else owner.clone()
    got = codec.reencode_sum(payloads, average, kept, 1 / 3, step=4, bucket=1, rank=9)

    expected_average = codec.decode_sum(payloads, torch.empty(numel), 1 / 3)
    assert torch.equal(average, expected_average)
    m = expected_average + owner if owner is not None else expected_average
    expected = codec.encode(m.clone(), None, step=4, bucket=1, rank=9)
    if codec.name == "signsgd" and not codec.vote:  # each block's root mean square is its scale, the signs are m's
        scales = block_root_mean_squares(m, codec.block)
        expected[HEADER_BYTES: HEADER_BYTES + 4 * scales.numel()] = scales.view(torch.uint8)
        reference = ref_encode("signsgd", m, block=codec.block, norm_scale=True, step=4, bucket=1, rank=9)[0]
        assert torch.equal(got, reference)  # the canonical summation order, bit for bit
    assert torch.equal(got, expected)
    if owner is not None:
        assert torch.equal(kept, m - codec.decode_sum(expected, torch.empty(numel)))


def test_reencode_sum_checks_its_payloads_before_anything_is_kept():
    codec = gradcomp.codec("signsgd")
    payloads = torch.stack([codec.encode(torch.randn(64), step=1), codec.encode(torch.randn(64), step=2)])
    owner = torch.randn(64)
    before = owner.clone()
    with pytest.raises(ValueError, match="cannot decode"):
        codec.reencode_sum(payloads, torch.empty(64), owner, 0.5)
    assert torch.equal(owner, before)


def _gathered(codec, numel, world, step=0, bucket=0):
    grads = _pieces(torch.randn(numel), world)
    payloads = [codec.encode(g.clone(), None, step=step, bucket=bucket, rank=j) for j, g in enumerate(grads)]
    rows = torch.zeros(world, max(p.numel() for p in payloads), dtype=torch.uint8)
    for j, payload in enumerate(payloads):
        rows[j, : payload.numel()] = payload
    return rows


@pytest.mark.parametrize("spec", ["signsgd", "topk:ratio=0.1", "topk:ratio=0.1,compact=true", "qsgd"])
def test_decode_chunks_refuses_a_bad_row_by_name_before_writing_anything(spec):
    codec = gradcomp.codec(spec)
    numel, world = 1001, 3
    rows = _gathered(codec, numel, world, step=4, bucket=2)
    out = torch.full((numel,), 7.0)
    broken = rows.clone()
    broken[2, 0] ^= 0xFF  # the last row's magic
    with pytest.raises(ValueError, match="row 2 of 3 \\(chunk 2\\): payload 0: bad magic.*nothing was written"):
        codec.decode_chunks(broken, out)
    assert torch.all(out == 7.0), "chunks before the bad row were written"
    other_step = rows.clone()
    other_step[1] = _gathered(codec, numel, world, step=5, bucket=2)[1]  # row 1 from another step
    with pytest.raises(ValueError, match="row 1 of 3 carries seed 0, step 5, bucket 2 but row 0 seed 0, step 4, "
                                         "bucket 2"):
        codec.decode_chunks(other_step, out)
    other_bucket = rows.clone()
    other_bucket[2] = _gathered(codec, numel, world, step=4, bucket=3)[2]
    with pytest.raises(ValueError, match="row 2 of 3 carries .* bucket 3"):
        codec.decode_chunks(other_bucket, out)
    assert torch.all(out == 7.0)
    if codec.name == "topk":  # the middle row's first index out of range (wide), or its first count past k (compact)
        bad_index = rows.clone()
        bad_index[1, HEADER_BYTES: HEADER_BYTES + 4] = torch.tensor([255, 255, 255, 127], dtype=torch.uint8)
        with pytest.raises(ValueError, match="row 1 of 3 \\(chunk 1\\): payload 0: (index 2147483647|the counts)"):
            codec.decode_chunks(bad_index, out)
        assert torch.all(out == 7.0)
    codec.decode_chunks(rows, out)  # the rows as gathered decode
    assert not torch.any(out == 7.0)
