"""The two-phase scheme (signsgd, terngrad, qsgd, topk): a compressed allreduce whose bytes per rank do
not grow with the world size W.

The bucket is cut into W chunks (balanced: the first numel % W chunks hold one element more), and
chunk j belongs to rank j.
    1. Every rank encodes each chunk as a payload of its own (with its error-feedback residual), and an
       all-to-all sends chunk j's payload to rank j.
    2. Rank j decodes and sums the W payloads of its chunk, times 1/W, and encodes that average again:
       with an owner-side residual of its own when the codec keeps error feedback (signsgd, topk), with
       fresh randomness when it is unbiased (terngrad, qsgd). topk keeps ceil(ratio * chunk) values of
       each chunk, so every payload has a fixed size. signsgd summing signs re-encodes with the root
       mean square of each block of the average as its scale, not the mean |.| its workers use: where the ranks'
       signs cancel, the average's magnitudes spread, and the mean would shrink the step of every
       element (at 8 ranks on MNIST-1D, 89.2% against 94.3% uncompressed; benchmarks/README.md).
    3. An all-gather of the re-encoded chunks, padded to the largest chunk payload, gives every rank
       every chunk's average, decoded in place.
The three steps are one op each (encode_chunks, reencode_sum, decode_chunks: csrc/torch/ops.cpp).
Each rank sends about 2(W-1)/W payloads of the bucket plus 2(W-1) headers, against (W-1) payloads for
the allgather scheme. The all-gather is started from a callback, so it goes through the step's
sequencer, which issues the buckets' second collectives in one order on every rank.

Randomness: stochastic codecs draw their keys per payload, as the rank argument of encode: chunk j of
rank r uses r * W + j, rank r's re-encode of its own chunk uses W * W + r; no two payloads of a step
and bucket share a stream.

Non-finite data: a NaN or Inf in a rank's chunk shows in that chunk payload's scale, norms or values;
the owner's average of it is non-finite, and so is its re-encoded payload's field, which every rank
receives. Every rank reads the same verdict from the gathered payloads, and keeps both its residuals
as they were when it is not finite.
"""

from __future__ import annotations

import time

import torch

from .._futures import value_or_raise
from ..codecs import chunk_bounds
from .._tensors import keep_if_finite
from .base import ResidualPlan, copy_into_spare, ring_crosses


def chunk_stream(rank: int, chunk: int, world: int) -> int:
    """The stream key (encode's rank argument) of chunk's payload from rank."""
    return rank * world + chunk


def owner_stream(rank: int, world: int) -> int:
    """The stream key of rank's re-encode of the chunk it owns."""
    return world * world + rank


MAX_WORLD = 65535  # world * world + rank must fit encode's 32-bit rank key
# What an owner whose re-encode failed sends in place of its chunk's payload, followed by its error: the other ranks
# then say what failed there, rather than that its row is not a payload.
OWNER_FAILED = b"gradcomp: owner failed: "


def _payload_sizes(codec, numel: int, dtype: torch.dtype, world: int) -> list[int]:
    return [codec.payload_nbytes(end - start, dtype) for start, end in chunk_bounds(numel, world)]


class TwoPhaseBucket(ResidualPlan):
    scheme = "two-phase"

    def __init__(self, codec, index, keys, shapes, dtype, device, *, world: int = 1, rank: int = 0):
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"gradcomp: the two-phase scheme takes 1 to {MAX_WORLD} ranks, not {world}; "
                             f"use scheme='allgather'")
        super().__init__(codec, index, keys, shapes, dtype, device, world=world, rank=rank)
        self.bounds = chunk_bounds(self.numel, world)
        self.sizes = _payload_sizes(codec, self.numel, dtype, world)
        self.width = max(self.sizes)  # every re-encoded chunk travels in a row of this many bytes
        self.total_size = sum(self.sizes)  # once: traffic() is asked per bucket and step, sizes hold W entries
        start, end = self.bounds[rank]
        # The owner's residual: what re-encoding the average of its chunk left out (biased codecs only).
        self.owner_residual = torch.zeros(end - start, dtype=dtype, device=device) if codec.error_feedback else None
        self._owner_spare = None

    @staticmethod
    def expected_sent(codec, numel: int, dtype: torch.dtype, world: int) -> int:
        """Bytes a rank sends, averaged over the ranks (the chunks' payloads differ by at most one element)."""
        sizes = _payload_sizes(codec, numel, dtype, world)
        return (world - 1) * sum(sizes) // world + (world - 1) * max(sizes)

    def traffic(self, world: int, rank: int) -> tuple[int, int]:
        sent = self.total_size - self.sizes[rank] + (world - 1) * self.width
        received = (world - 1) * self.sizes[rank] + (world - 1) * self.width
        return sent, received

    def traffic_across(self, world: int, rank: int, nodes) -> int:
        """The chunk payloads for owners on other nodes (a pairwise all-to-all), and the gathered rows when this rank's
        successor in the all-gather's ring is on another node."""
        node = rank // nodes.node_size
        to_owners = sum(size for owner, size in enumerate(self.sizes) if owner // nodes.node_size != node)
        return to_owners + ((world - 1) * self.width if ring_crosses(rank, world, nodes) else 0)

    def payload_bytes(self) -> int:
        return self.total_size

    def launch(self, step, flat: torch.Tensor, views) -> torch.futures.Future:
        started = time.perf_counter()
        codec, world, rank = self.codec, step.world, step.rank
        if (world, rank) != (self.world, self.rank):
            raise RuntimeError(f"gradcomp: bucket {self.index} was laid out for rank {self.rank} of {self.world}, "
                               f"this is rank {rank} of {world}")
        work = self._working_residual()
        sent = codec.encode_chunks(flat, work, world, step=step.step, bucket=self.index,
                                   first_rank=chunk_stream(rank, 0, world))
        mine = torch.empty((world, self.sizes[rank]), dtype=torch.uint8, device=flat.device)
        row = torch.zeros(self.width, dtype=torch.uint8, device=flat.device)
        rows = torch.empty((world, self.width), dtype=torch.uint8, device=flat.device)
        owner_work = self._owner_spare = copy_into_spare(self.owner_residual, self._owner_spare)
        result = step.new_future(flat.device)
        reencode_failed = []  # the owner's error, raised once its notice has gone out in the all-gather

        def reencode(exchanged):
            started = time.perf_counter()
            value_or_raise(exchanged)
            a, b = self.bounds[rank]
            average = torch.empty(b - a, dtype=self.dtype, device=flat.device)
            try:
                again = codec.reencode_sum(mine, average, owner_work, 1.0 / world, step=step.step, bucket=self.index,
                                           rank=owner_stream(rank, world), status=step.decode_status)
            except Exception as error:  # raised in decode instead: raised here, it could end this rank's step (and
                # process) before the all-gather has carried the notice to the ranks that wait in it
                notice = (OWNER_FAILED + str(error).encode(errors="replace"))[: self.width]
                row[: len(notice)].copy_(torch.frombuffer(bytearray(notice), dtype=torch.uint8))
                reencode_failed.append(error)
                return
            row[: again.numel()].copy_(again)
            step.add("decode_s", time.perf_counter() - started)

        def decode(gathered):
            started = time.perf_counter()
            if reencode_failed:
                raise reencode_failed[0]
            gathered.value()
            if result.done():  # this rank failed earlier in the step
                return
            if not rows.is_cuda:  # on CUDA the device checks report such a row (it is not a payload)
                self._raise_for_failed_owners(rows, step.step)
            finite = self._all_finite(rows)
            codec.decode_chunks(rows, flat, status=step.decode_status)
            if work is not None:
                self.residual, self._spare = keep_if_finite(finite, work, self.residual)
            if owner_work is not None:
                self.owner_residual, self._owner_spare = keep_if_finite(finite, owner_work, self.owner_residual)
            step.count_nonfinite(finite)
            step.add("decode_s", time.perf_counter() - started)
            result.set_result(flat)

        step.add("encode_s", time.perf_counter() - started)
        step.chain_in_order(lambda: step.all_to_all(mine, sent, [self.sizes[rank]] * world, self.sizes), reencode,
                            lambda: step.all_gather(rows, row), decode, result, flat.device)
        return result.then(value_or_raise)  # result may fail by set_exception(): see value_or_raise

    def _raise_for_failed_owners(self, rows: torch.Tensor, step: int) -> None:
        marker = torch.frombuffer(bytearray(OWNER_FAILED), dtype=torch.uint8)
        failed = (rows[:, : len(OWNER_FAILED)] == marker).all(dim=1).nonzero().flatten().tolist()
        if failed:
            owner = failed[0]
            said = bytes(rows[owner, len(OWNER_FAILED):].tolist()).rstrip(b"\0").decode(errors="replace")
            raise RuntimeError(f"gradcomp: rank {owner}, which owns chunk {owner} of bucket {self.index} in the "
                               f"two-phase scheme, could not re-encode it in step {step}: {said}")

    def _all_finite(self, rows: torch.Tensor) -> torch.Tensor:
        """Whether every re-encoded chunk's magnitude fields are finite (rows of equal chunks checked together)."""
        verdicts, j = [], 0
        while j < len(self.bounds):
            n = self.bounds[j][1] - self.bounds[j][0]
            end = j
            while end < len(self.bounds) and self.bounds[end][1] - self.bounds[end][0] == n:
                end += 1
            fields = self.codec.magnitude_fields(rows[j:end, : self.sizes[j]], n, self.dtype)
            verdicts.append(torch.isfinite(fields).all())
            j = end
        return torch.stack(verdicts).all()

    def pieces(self) -> dict:
        """Per parameter, the residual a new layout or scheme takes over, with the owner's residual folded in: W times
        it on this rank's chunk (the ranks' residuals count 1/W each in the average, the owner's whole), so nothing
        that error feedback held back is lost."""
        if self.residual is None:
            return {}
        folded = self.residual.clone()
        if self.owner_residual is not None:
            start, end = self.bounds[self.rank]
            folded[start:end].add_(self.owner_residual, alpha=self.world)
        return {key: {"residual": folded[o: o + n]} for key, o, n in self._offsets()}

    def _states(self) -> list:
        start, end = self.bounds[self.rank]
        return [*super()._states(), (self.owner_residual, self._owner_spare, slice(start, end))]

    def tensors(self) -> dict:
        return {"residual": self.residual, "owner_residual": self.owner_residual}

    def spares(self) -> list:
        return [self._spare, self._owner_spare]

    def _expected_tensors(self) -> dict:
        start, end = self.bounds[self.rank]
        owner = ((end - start,), self.dtype) if self.codec.error_feedback else (None, None)
        return {**super()._expected_tensors(), "owner_residual": owner}

    def load_tensors(self, tensors: dict) -> None:
        super().load_tensors(tensors)
        owner = tensors.get("owner_residual")
        self.owner_residual = None if owner is None else owner.clone()

    def to(self, device) -> None:
        super().to(device)
        self.owner_residual = None if self.owner_residual is None else self.owner_residual.to(device)
        self._owner_spare = None

    def __getstate__(self):
        return {**super().__getstate__(), "_owner_spare": None}
