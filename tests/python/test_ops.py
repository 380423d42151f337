"""torch.library.opcheck for every op: schema (mutations declared), fake kernels, autograd
registration and AOT dispatch."""

import pytest
import torch
from torch.library import opcheck

import gradcomp

# codec, param0, param1 for a 300-element gradient
WIRE_CASES = [("none", 0, 0), ("fp16", 0, 0), ("bf16", 0, 0), ("signsgd", 0, 64), ("terngrad", 0, 0),
              ("qsgd", 15, 64), ("topk", 9, 0), ("topk", 9, 1), ("randomk", 9, 0)]  # topk 1: compact


@pytest.mark.parametrize("codec, param0, param1", WIRE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_encode(codec, param0, param1, dtype, with_residual):
    grad = torch.randn(300).to(dtype)
    residual = torch.randn(300).to(dtype) if with_residual else None
    opcheck(torch.ops.gradcomp.encode.default, (grad, residual, codec, param0, param1, 5, 3, 1, 0))


@pytest.mark.parametrize("codec, param0, param1", WIRE_CASES)
def test_decode_sum(codec, param0, param1):
    payloads = torch.stack([torch.ops.gradcomp.encode(torch.randn(300), None, codec, param0, param1, 5, 3, 1, rank)
                            for rank in range(3)])
    opcheck(torch.ops.gradcomp.decode_sum.default, (payloads, torch.empty(300), 1 / 3, False))
    # With the codec named, as PayloadCodec.decode_sum (and CUDA) calls it; a status the CPU leaves alone.
    status = torch.zeros(1, dtype=torch.int32)
    opcheck(torch.ops.gradcomp.decode_sum.default,
            (payloads, torch.empty(300), 1 / 3, False, codec, param0, param1, status))
    assert status.item() == 0


def test_decode_sum_refuses_payloads_of_another_codec_than_named():
    payloads = torch.ops.gradcomp.encode(torch.randn(300), None, "qsgd", 15, 64)
    with pytest.raises(ValueError, match=r"the payloads are qsgd \(param0=15, param1=64\) but codec=qsgd "
                                         r"\(param0=7, param1=64\) was expected"):
        torch.ops.gradcomp.decode_sum(payloads, torch.empty(300), 1.0, False, "qsgd", 7, 64)
    with pytest.raises(ValueError, match="payloads are qsgd .* but codec=topk"):
        gradcomp.codec("topk:ratio=0.03").decode_sum(payloads, torch.empty(300))
    with pytest.raises(ValueError, match="unknown codec 'nope'"):
        torch.ops.gradcomp.decode_sum(payloads, torch.empty(300), 1.0, False, "nope")


def test_decode_sum_vote():
    payloads = torch.stack([torch.ops.gradcomp.encode(torch.randn(64), None, "signsgd", 0, 16) for _ in range(3)])
    opcheck(torch.ops.gradcomp.decode_sum.default, (payloads, torch.empty(64), 0.5, True))


@pytest.mark.parametrize("shape", [(40, 4), (3, 30, 2)])
def test_orthogonalize(shape):
    opcheck(torch.ops.gradcomp.orthogonalize_.default, (torch.randn(shape), 0.0))


@pytest.mark.parametrize("batch", [(), (3,)])
def test_low_rank_product(batch):
    opcheck(torch.ops.gradcomp.low_rank_product.default,
            (torch.randn(*batch, 40, 4), torch.randn(*batch, 30, 4), torch.empty(*batch, 40, 30)))


@pytest.mark.parametrize("codec, param0, param1", [("signsgd", 0, 64), ("qsgd", 15, 64), ("topk", 9, 0)])
def test_two_phase_ops(codec, param0, param1):
    grad, residual = torch.randn(300), torch.randn(300)
    opcheck(torch.ops.gradcomp.encode_chunks.default, (grad, residual, codec, [param0] * 3, param1, 5, 3, 1, 6))
    payloads = torch.stack([torch.ops.gradcomp.encode(torch.randn(100), None, codec, param0, param1, 5, 3, 1, rank)
                            for rank in range(3)])
    for vote in (False, True) if codec == "signsgd" else (False,):
        opcheck(torch.ops.gradcomp.reencode_sum.default,
                (payloads, torch.empty(100), torch.randn(100), 1 / 3, vote, codec, param0, param1, 5, 3, 1, 9))
    opcheck(torch.ops.gradcomp.decode_chunks.default, (payloads, torch.empty(300), False, codec, [param0] * 3,
                                                       param1))
