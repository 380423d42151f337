"""The plain scheme: a bucket the time policy (gradcomp.policy) sends uncompressed, as plain DDP does
(grad / W, one ring allreduce).

Error feedback across a switch: a bucket that was compressed before (a decision taken anew, or a
checkpoint's residuals of its parameters) holds what its codec had not yet sent. The plain bucket takes
that residual over and sends gradient + residual once, in full precision; the residual then becomes 0
(kept as before when the step's data is not finite, like every scheme's), so nothing is lost, and is dropped at
the next step (on the CPU: release_if_spent). A bucket plain from the start keeps no residual at all."""

from __future__ import annotations

import torch

from .._futures import value_or_raise
from .._tensors import check_saved_tensors, keep_if_finite
from .base import ResidualPlan, ring_allreduce_bytes


class PlainBucket(ResidualPlan):
    scheme = "plain"
    _spent = False  # known without a read: the residual was sent in a finite step, nothing set aside since

    def __init__(self, codec, index: int, keys, shapes, dtype: torch.dtype, device, *, world: int = 1, rank: int = 0):
        super().__init__(codec, index, keys, shapes, dtype, device, world=world, rank=rank)
        self.residual = None  # only to carry over what a compressed bucket left (take)

    @staticmethod
    def expected_sent(codec, numel: int, dtype: torch.dtype, world: int) -> int:
        return ring_allreduce_bytes(numel * dtype.itemsize, world)

    def traffic(self, world: int, rank: int) -> tuple[int, int]:
        sent = self.expected_sent(self.codec, self.numel, self.dtype, world)
        return sent, sent

    def payload_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def take(self, pool: dict) -> None:
        """The residuals of its parameters that a compressed bucket left, to send with the next step."""
        carried = {key: pool.pop(key) for key, _, _ in self._offsets() if "residual" in pool.get(key, {})}
        if not carried:
            return
        device = next(iter(carried.values()))["residual"].device
        self.residual, self._spent = torch.zeros(self.numel, dtype=self.dtype, device=device), False
        for key, offset, count in self._offsets():
            piece = carried.get(key, {}).get("residual")
            if piece is not None and piece.numel() == count:
                self.residual[offset: offset + count].copy_(piece.reshape(-1))

    def release_if_spent(self) -> None:
        """Drops a residual that holds nothing any more (all zero: sent, and no parameter set aside), so that the
        bucket goes on as plain DDP's, without a pass over it per step. On the CPU only: on CUDA it would take a
        host-device sync, and the bucket keeps the residual (zeros) instead. A residual this bucket sent in a finite
        step is known spent without reading it (a pass that would weigh on the step after every switch to plain)."""
        if self.residual is not None and not self.residual.is_cuda and (self._spent or not bool(self.residual.any())):
            self.residual = self._spare = None
            self._spent = False

    def launch(self, step, flat: torch.Tensor, views) -> torch.futures.Future:
        work = self._working_residual()
        if work is not None:  # gradient + residual, once; the residual is then spent
            flat.add_(work)
            work.zero_()
        flat.div_(step.world)
        summed = step.allreduce(flat)

        def finish(done):
            value_or_raise(done)
            if work is not None:
                finite = torch.isfinite(flat).all()
                self.residual, self._spare = keep_if_finite(finite, work, self.residual)
                self._spent = not finite.is_cuda and bool(finite)  # zero now, unless set_idle_aside restores some
            return flat

        return summed.then(finish)

    def load_tensors(self, tensors: dict) -> None:
        residual = tensors.get("residual") if isinstance(tensors, dict) else None
        expected = {"residual": ((self.numel,), self.dtype) if residual is not None else (None, None)}
        check_saved_tensors(tensors, expected, self.index)
        self.residual, self._spent = None if residual is None else residual.clone(), False

    def restore_residuals(self, mask: torch.Tensor) -> None:
        super().restore_residuals(mask)
        self._spent = False  # an idle parameter's residual is back: it waits to be sent
