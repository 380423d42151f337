"""The allgather scheme (signsgd, terngrad, qsgd, topk): every rank's whole payload to every rank.

Encode, all-gather the fixed-size payloads, one fused decode-and-sum of all W of them times 1/W, in
place. Each rank sends W-1 payloads and receives as many, so the saving against plain DDP's ring
allreduce (2(W-1)/W of the bucket) falls as 1/W: right for few ranks, where it is one collective and
no re-compression."""

from __future__ import annotations

import time

import torch

from .._futures import value_or_raise
from .._tensors import keep_if_finite
from .base import ResidualPlan


class AllgatherBucket(ResidualPlan):
    scheme = "allgather"

    @staticmethod
    def expected_sent(codec, numel: int, dtype: torch.dtype, world: int) -> int:
        return (world - 1) * codec.payload_nbytes(numel, dtype)

    def traffic(self, world: int, rank: int) -> tuple[int, int]:
        sent = self.expected_sent(self.codec, self.numel, self.dtype, world)
        return sent, sent

    def payload_bytes(self) -> int:
        return self.codec.payload_nbytes(self.numel, self.dtype)

    def launch(self, step, flat: torch.Tensor, views) -> torch.futures.Future:
        started = time.perf_counter()
        codec = self.codec
        work = self._working_residual()
        payload = codec.encode(flat, work, step=step.step, bucket=self.index, rank=step.rank)
        received = torch.empty((step.world, payload.numel()), dtype=torch.uint8, device=flat.device)
        gathered = step.all_gather(received, payload)
        step.add("encode_s", time.perf_counter() - started)

        def decode(done):
            started = time.perf_counter()
            value_or_raise(done)
            finite = torch.isfinite(codec.magnitude_fields(received, self.numel, self.dtype)).all()
            codec.decode_sum(received, flat, 1.0 / step.world, status=step.decode_status)
            if work is not None:
                self.residual, self._spare = keep_if_finite(finite, work, self.residual)
            step.count_nonfinite(finite)
            step.add("decode_s", time.perf_counter() - started)
            return flat

        return gathered.then(decode)
