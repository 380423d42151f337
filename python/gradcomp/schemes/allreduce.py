"""The allreduce scheme (none, fp16, bf16, randomk): payload values that can be summed as they are.

Encode, divide the values by the world size (as plain DDP does, so fp16 sums stay in range), one
allreduce, decode in place. randomk's values cover only k elements: one more value, 0 or NaN, carries
the verdict of the elements it leaves out (the codec's with_flag / apply_flag)."""

from __future__ import annotations

import time

import torch

from .._futures import value_or_raise
from .._tensors import keep_if_finite
from .base import ResidualPlan, ring_allreduce_bytes


class AllreduceBucket(ResidualPlan):
    scheme = "allreduce"

    @staticmethod
    def summed_bytes(codec, numel: int, dtype: torch.dtype) -> int:
        return (codec.value_count(numel) + codec.flag_count) * codec.wire_dtype(dtype).itemsize

    @classmethod
    def expected_sent(cls, codec, numel: int, dtype: torch.dtype, world: int) -> int:
        return ring_allreduce_bytes(cls.summed_bytes(codec, numel, dtype), world)

    def traffic(self, world: int, rank: int) -> tuple[int, int]:
        sent = self.expected_sent(self.codec, self.numel, self.dtype, world)
        return sent, sent

    def payload_bytes(self) -> int:
        return self.summed_bytes(self.codec, self.numel, self.dtype)

    def launch(self, step, flat: torch.Tensor, views) -> torch.futures.Future:
        started = time.perf_counter()
        codec = self.codec
        work = self._working_residual()
        payload = codec.encode(flat, work, step=step.step, bucket=self.index, rank=step.rank)
        values = codec.summable_view(payload, self.numel, self.dtype)
        sent = codec.with_flag(values, work if work is not None else flat)
        sent.div_(step.world)  # averaged before the sum (no fp16 overflow), as plain DDP does
        summed = step.allreduce(sent)
        step.add("encode_s", time.perf_counter() - started)

        def decode(done):
            started = time.perf_counter()
            value_or_raise(done)
            finite = torch.isfinite(sent).all()  # any rank's NaN or Inf survived the sum
            codec.apply_flag(sent, values)
            codec.decode_sum(payload, flat, 1.0, status=step.decode_status)
            if work is not None:
                self.residual, self._spare = keep_if_finite(finite, work, self.residual)
            step.count_nonfinite(finite)
            step.add("decode_s", time.perf_counter() - started)
            return flat

        return summed.then(decode)
