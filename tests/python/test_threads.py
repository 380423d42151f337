"""The codecs spread large buckets over torch's intra-op threads and give the same bits."""

import pytest
import torch

import gradcomp

SPECS = ["none", "fp16", "bf16", "signsgd", "signsgd:vote=true", "terngrad", "qsgd", "qsgd:block=100000",
         "qsgd:levels=3,block=77", "topk:ratio=0.01", "topk:ratio=0.9", "randomk:ratio=0.01"]


def run(codec, grad, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        residual = torch.full_like(grad, 0.1)
        payload = codec.encode(grad, residual, step=3, bucket=1, rank=1)
        out = torch.empty_like(grad)
        codec.decode_sum(torch.stack([payload, payload]), out, 0.5)
        return payload, residual, out
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_bits_on_one_and_two_threads(spec, dtype):
    grad = torch.randn(1_000_003, generator=torch.Generator().manual_seed(7)).to(dtype)
    codec = gradcomp.codec(spec)
    one, two = run(codec, grad, 1), run(codec, grad, 2)
    for a, b in zip(one, two):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
