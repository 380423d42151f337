"""What every bucket plan shares: its parameters, its bytes on the wire, and the error-feedback residual
of the codecs that speak the wire format (allreduce, allgather and two-phase keep it alike)."""

from __future__ import annotations

import torch

from .._tensors import check_saved_tensors, idle_elements


def ring_allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in a ring allreduce of nbytes: a reduce-scatter and an
    all-gather, each W-1 steps of 1/W of the tensor. What plain DDP sends for a bucket of nbytes."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


def ring_crosses(rank: int, world: int, nodes) -> bool:
    """Whether rank's successor in a ring over the world's ranks (rank + 1, as gloo's rings go) is on another node
    (nodes: gradcomp.nodes.NodeLayout): then all that rank sends in a ring collective crosses its node's link."""
    return nodes.nodes > 1 and (rank + 1) % nodes.node_size == 0


def revert_unless(finite: torch.Tensor, states) -> None:
    """Each (state, the same before the step) pair back to before unless finite (a 0-d bool; on CUDA selected on
    the device, without a sync). After keep_if_finite, a plan's spares hold the state before the step."""
    for state, before in states:
        if state is None:
            continue
        if state.is_cuda:
            torch.where(finite, state, before, out=state)
        elif not bool(finite):
            state.copy_(before)


def copy_into_spare(state: torch.Tensor | None, spare: torch.Tensor | None) -> torch.Tensor | None:
    """spare, holding a copy of state for a step to update (allocated anew when missing or on another
    device); None when there is no state."""
    if state is None:
        return None
    if spare is None or spare.device != state.device:
        spare = torch.empty_like(state)
    return spare.copy_(state)


class ResidualPlan:
    """A bucket under a wire-format codec, with its error-feedback residual (one element per gradient
    element), kept per parameter so that a new bucket layout takes it over.

    The interface every scheme's plan offers the hook:
        traffic(world, rank) -> (bytes sent, bytes received) by this rank per step;
        traffic_across(world, rank, nodes) -> the bytes of those that cross this rank's node's link;
        expected_sent(codec, numel, dtype, world) -> the same for any rank (the scheme choice);
        launch(step, flat, views) -> a Future that completes with flat holding the averaged gradient;
        pieces() / take(pool), tensors() / load_tensors(), spares(), piece_layout(), to(device): state.
    """

    scheme = "?"

    def __init__(self, codec, index: int, keys, shapes, dtype: torch.dtype, device, *, world: int = 1, rank: int = 0):
        self.codec, self.index, self.keys, self.dtype = codec, index, tuple(keys), dtype
        self.world, self.rank = world, rank
        self.shapes = [torch.Size(s) for s in shapes]
        self.numel = sum(s.numel() for s in self.shapes)
        self.residual = torch.zeros(self.numel, dtype=dtype, device=device) if codec.error_feedback else None
        self._spare = None  # the residual a step writes, kept only if the step's data is finite

    @property
    def device(self):
        return None if self.residual is None else self.residual.device

    def _working_residual(self) -> torch.Tensor | None:
        """A copy of the residual for this step's encode to update (the state until the step proves finite)."""
        self._spare = copy_into_spare(self.residual, self._spare)
        return self._spare

    def _offsets(self):
        offset = 0
        for key, shape in zip(self.keys, self.shapes):
            yield key, offset, shape.numel()
            offset += shape.numel()

    def traffic_across(self, world: int, rank: int, nodes) -> int:
        """Bytes this rank sends across its node's link per step: under a ring collective, all or nothing."""
        return self.traffic(world, rank)[0] if ring_crosses(rank, world, nodes) else 0

    def set_idle_aside(self, idle: torch.Tensor, flat: torch.Tensor) -> None:
        """idle: a bool per parameter, true where its gradient was zero on every rank in this step (a parameter
        that find_unused_parameters found unused everywhere among them, whose .grad DDP then leaves as it is).
        Such a parameter's average becomes 0 and its residuals what they were before the step: nothing of it was
        sent. Called once the step's future has completed, when the spares hold the residuals before the step."""
        mask = idle_elements(idle, self.shapes, self.numel)
        if mask is None:
            return
        flat.masked_fill_(mask, 0)
        self.restore_residuals(mask)

    def _states(self) -> list:
        """(state, the same before the step, the bucket's elements it covers) of each residual it keeps."""
        return [(self.residual, self._spare, slice(None))]

    def restore_residuals(self, mask: torch.Tensor) -> None:
        """The residuals before the step where mask (one bool per element of the bucket) is true."""
        for state, before, span in self._states():
            if state is not None:
                torch.where(mask[span], before, state, out=state)

    def revert_unless(self, finite: torch.Tensor) -> None:
        """Every residual back to before the step unless finite (a 0-d bool)."""
        revert_unless(finite, [(state, before) for state, before, _ in self._states()])

    def pieces(self) -> dict:
        if self.residual is None:
            return {}
        return {key: {"residual": self.residual[o: o + n]} for key, o, n in self._offsets()}

    def take(self, pool: dict) -> None:
        for key, o, n in self._offsets():
            piece = pool.pop(key, None) or {}
            if self.residual is not None and "residual" in piece and piece["residual"].numel() == n:
                self.residual[o: o + n].copy_(piece["residual"].reshape(-1))

    def tensors(self) -> dict:
        return {"residual": self.residual}

    def spares(self) -> list:
        return [self._spare]

    def _expected_tensors(self) -> dict:
        return {"residual": ((self.numel,), self.dtype) if self.codec.error_feedback else (None, None)}

    def load_tensors(self, tensors: dict) -> None:
        check_saved_tensors(tensors, self._expected_tensors(), self.index)
        self.residual = None if tensors.get("residual") is None else tensors["residual"].clone()

    @staticmethod
    def piece_layout(codec, shape, dtype) -> dict:
        """(shape, dtype) of each per-parameter piece of state (pieces())."""
        return {"residual": ((torch.Size(shape).numel(),), dtype)} if codec.error_feedback else {}

    def to(self, device) -> None:
        self.residual = None if self.residual is None else self.residual.to(device)
        self._spare = None

    def __getstate__(self):
        return {**self.__dict__, "_spare": None}

    def __setstate__(self, state):  # states pickled before there were spares, or ranks (not known then), have none
        self.__dict__.update({"_spare": None, "world": None, "rank": None, **state})
