"""The PowerSGD scheme: each bucket's matrices travel as P and Q, two allreduces per step (the codec's
math is in gradcomp.powersgd)."""

from __future__ import annotations

import time

import torch

from .._futures import value_or_raise
from .._tensors import check_saved_tensors, idle_elements, keep_if_finite
from ..powersgd import PowerSGD
from .base import revert_unless, ring_allreduce_bytes, ring_crosses


def _grouped_offsets(groups, size_of):
    """Start of each group's block in a flat buffer where every group holds len(members) blocks of size_of(g)."""
    offsets, total = [], 0
    for group in groups:
        offsets.append(total)
        total += len(group[3]) * size_of(group)
    return offsets, total


class PowerSGDBucket:
    """One DDP bucket under PowerSGD: its matrices travel as P and Q, its 1-D and small tensors whole.

    Layout (fp32): the residual holds M = grad + residual for every compressed tensor, grouped by
    shape when batch_same_shape (so a group is one [b, rows, cols] block); P and Q likewise, and the
    whole tensors ride at the end of the P buffer, so a step is two allreduces: P (+ whole), then Q.
    """

    scheme = "powersgd"

    def __init__(self, codec: PowerSGD, index: int, keys, shapes, dtype: torch.dtype, device, *, world: int = 1,
                 rank: int = 0):
        self.codec, self.index, self.keys, self.dtype = codec, index, tuple(keys), dtype
        self.world, self.rank = world, rank
        self.shapes = [torch.Size(s) for s in shapes]
        self.numel = sum(s.numel() for s in self.shapes)
        groups: dict[tuple, list[int]] = {}
        for position, shape in enumerate(self.shapes):
            if codec.compresses(shape):
                rows, cols = codec.matrix_shape(shape)
                own_group = -1 if codec.batch_same_shape else position
                groups.setdefault((rows, cols, codec.effective_rank(shape), own_group), []).append(position)
        self.groups = [(rows, cols, r, members) for (rows, cols, r, _), members in groups.items()]
        compressed = {p for g in self.groups for p in g[3]}
        # The whole tensors ride at the end of the P buffer: (position, start, size) of each.
        self.whole, start = [], 0
        for position in (p for p in range(len(self.shapes)) if p not in compressed):
            self.whole.append((position, start, self.shapes[position].numel()))
            start += self.shapes[position].numel()
        self.whole_numel = start
        self.m_offsets, m_numel = _grouped_offsets(self.groups, lambda g: g[0] * g[1])
        self.p_offsets, self.p_numel = _grouped_offsets(self.groups, lambda g: g[0] * g[2])
        self.q_offsets, q_numel = _grouped_offsets(self.groups, lambda g: g[1] * g[2])
        self.m_numel, self.q_numel = m_numel, q_numel
        self.residual = torch.zeros(m_numel, device=device) if codec.error_feedback else None
        self.q = torch.empty(q_numel, device=device)
        # A step builds M = grad + residual, then the new residual, in _spare_m, and the new Q in _spare_q;
        # they become the state only when the step's data is finite (keep_if_finite).
        self._spare_m = self._spare_q = None
        self._draw_q(step=0)

    @property
    def device(self):
        return self.q.device

    @staticmethod
    def expected_sent(codec, numel, dtype, world) -> int:
        raise ValueError("powersgd's bytes depend on the bucket's shapes: build its plan and ask traffic()")

    @staticmethod
    def summed_numels(codec: PowerSGD, shapes) -> tuple[int, int]:
        """The fp32 elements of P (with the whole tensors) and of Q for tensors of these shapes: what travels."""
        p = q = 0
        for shape in map(torch.Size, shapes):
            if codec.compresses(shape):
                rows, cols = codec.matrix_shape(shape)
                p, q = p + rows * codec.effective_rank(shape), q + cols * codec.effective_rank(shape)
            else:
                p += shape.numel()
        return p, q

    @classmethod
    def traffic_of(cls, codec: PowerSGD, shapes, world: int) -> int:
        """Bytes a rank sends (and receives) per step for a bucket of these shapes: P's ring allreduce, then Q's."""
        p, q = cls.summed_numels(codec, shapes)
        return ring_allreduce_bytes(4 * p, world) + ring_allreduce_bytes(4 * q, world)

    def traffic(self, world: int, rank: int) -> tuple[int, int]:
        sent = self.traffic_of(self.codec, self.shapes, world)
        return sent, sent

    def payload_bytes(self) -> int:
        return 4 * (self.p_numel + self.whole_numel + self.q_numel)

    def traffic_across(self, world: int, rank: int, nodes) -> int:
        return self.traffic(world, rank)[0] if ring_crosses(rank, world, nodes) else 0

    def _block(self, flat: torch.Tensor, offsets, g: int, a: int, b: int) -> torch.Tensor:
        members = self.groups[g][3]
        return flat[offsets[g]: offsets[g] + len(members) * a * b].view(len(members), a, b)

    def _m(self, flat, g):
        return self._block(flat, self.m_offsets, g, self.groups[g][0], self.groups[g][1])

    def _p(self, flat, g):
        return self._block(flat, self.p_offsets, g, self.groups[g][0], self.groups[g][2])

    def _q(self, g, flat=None):
        return self._block(self.q if flat is None else flat, self.q_offsets, g, self.groups[g][1], self.groups[g][2])

    def _draw_q(self, step: int) -> None:
        for g, (_, _, _, members) in enumerate(self.groups):
            q = self._q(g)
            for j, position in enumerate(members):
                q[j].copy_(self.codec.initial_q(self.shapes[position], bucket=self.index, index=position, step=step,
                                                device=q.device))

    def redraw_dead_columns(self, step: int) -> None:
        """A column of Q that is all zero (a matrix whose gradient and residual were zero on every rank) or
        holds a NaN or Inf (a loaded checkpoint) would stay so under the warm start (P = MQ, Q = M^T P):
        draw it anew, the same on every rank (after each step, and when a state is loaded)."""
        dead = [(self._q(g) == 0).all(dim=1) | ~torch.isfinite(self._q(g)).all(dim=1) for g in range(len(self.groups))]
        if not dead or (not self.q.is_cuda and not any(bool(d.any()) for d in dead)):
            return  # the CPU looks before it draws; CUDA selects on the device, without a sync
        fresh = self.codec.redrawn_q(self.q.numel(), bucket=self.index, step=step, device=self.q.device)
        for g, columns in enumerate(dead):
            q = self._q(g)
            torch.where(columns.unsqueeze(1), self._q(g, fresh), q, out=q)

    def _make_spares(self) -> None:
        if self._spare_q is None or self._spare_q.device != self.q.device:
            self._spare_q = torch.empty_like(self.q)
        if self.residual is not None and (self._spare_m is None or self._spare_m.device != self.residual.device):
            self._spare_m = torch.empty_like(self.residual)

    def launch(self, step, flat: torch.Tensor, views) -> torch.futures.Future:
        """Starts P's allreduce; the future completes with flat holding the averaged gradient."""
        started = time.perf_counter()
        codec, world = self.codec, step.world
        self._make_spares()
        m = self._spare_m if self.residual is not None else torch.empty(self.m_numel, device=flat.device)
        q_new = self._spare_q
        for g, (rows, cols, _, members) in enumerate(self.groups):
            block = self._m(m, g)
            old = self._m(self.residual, g) if self.residual is not None else None
            for j, position in enumerate(members):
                source = views[position].reshape(rows, cols)
                torch.add(old[j], source, out=block[j]) if old is not None else block[j].copy_(source)
        if not codec.warm_start:
            self._draw_q(step.step)
        p = torch.empty(self.p_numel + self.whole_numel, device=flat.device)
        for g in range(len(self.groups)):
            torch.matmul(self._m(m, g), self._q(g), out=self._p(p, g))
        whole = p[self.p_numel:]
        for position, start, n in self.whole:
            whole[start: start + n].copy_(views[position].reshape(-1))
        p.div_(world)  # averaged before the sum, as plain DDP does (P's scale does not matter: it is orthogonalized)
        step.add("encode_s", time.perf_counter() - started)
        result = step.new_future(flat.device)

        def compute_q(summed_p):
            started = time.perf_counter()
            summed_p.value()
            for position, start, n in self.whole:
                views[position].copy_(whole[start: start + n].view(views[position].shape))
            for g in range(len(self.groups)):
                codec.compute_q(self._m(m, g), codec.orthogonalize(self._p(p, g)), self._q(g, q_new))
            q_new.div_(world)
            step.add("encode_s", time.perf_counter() - started)

        def after_q(summed_q):
            started = time.perf_counter()
            summed_q.value()
            if result.done():  # this rank failed earlier in the step
                return
            for g, (rows, cols, _, members) in enumerate(self.groups):
                approx = torch.empty(len(members), rows, cols, device=q_new.device)
                torch.ops.gradcomp.low_rank_product(self._p(p, g), self._q(g, q_new), approx)  # same bits on every rank
                block = self._m(m, g)
                for j, position in enumerate(members):
                    views[position].copy_(approx[j].view(views[position].shape))
                    if self.residual is not None:  # what was delivered, after rounding to the gradient's dtype
                        block[j].sub_(views[position].reshape(rows, cols))
            # A NaN or Inf in any rank's M (or whole tensors) survives both sums: every rank sees the same verdict.
            finite = torch.isfinite(p).all() & torch.isfinite(q_new).all()
            if self.residual is not None:
                self.residual, self._spare_m = keep_if_finite(finite, m, self.residual)
            self.q, self._spare_q = keep_if_finite(finite, q_new, self.q)
            self.redraw_dead_columns(step.step + 1)
            step.count_nonfinite(finite)
            step.add("decode_s", time.perf_counter() - started)
            result.set_result(flat)

        step.chain_in_order(lambda: step.allreduce(p), compute_q, lambda: step.allreduce(q_new), after_q, result,
                            q_new.device)
        return result.then(value_or_raise)  # result may fail by set_exception(): see value_or_raise

    def set_idle_aside(self, idle: torch.Tensor, flat: torch.Tensor) -> None:
        """As ResidualPlan.set_idle_aside: a parameter whose gradient was zero on every rank in this step gets an
        average of 0 and keeps the residual it had before the step (Q, which carries no gradient, moves on)."""
        mask = idle_elements(idle, self.shapes, self.numel)
        if mask is None:
            return
        flat.masked_fill_(mask, 0)
        self.restore_residuals(mask)

    def restore_residuals(self, mask: torch.Tensor) -> None:
        """The residuals before the step of the matrices whose elements mask (one bool per element of the bucket,
        alike over a parameter) marks."""
        if self.residual is None or not self.groups:
            return
        starts = [0]
        for shape in self.shapes[:-1]:
            starts.append(starts[-1] + shape.numel())
        matrices = [mask[starts[j]].expand(rows * cols) for rows, cols, _, members in self.groups for j in members]
        torch.where(torch.cat(matrices), self._spare_m, self.residual, out=self.residual)

    def revert_unless(self, finite: torch.Tensor) -> None:
        """Residual and Q back to before the step unless finite (a 0-d bool)."""
        revert_unless(finite, [(self.residual, self._spare_m), (self.q, self._spare_q)])

    def pieces(self) -> dict:
        """Per-parameter state (residual and Q views), so that a new bucket layout can take it over."""
        out: dict = {}
        for g, (rows, cols, _, members) in enumerate(self.groups):
            for j, position in enumerate(members):
                piece = out.setdefault(self.keys[position], {})
                piece["q"] = self._q(g)[j]
                if self.residual is not None:
                    piece["residual"] = self._m(self.residual, g)[j]
        return out

    def take(self, pool: dict) -> None:
        """Takes over the state of this bucket's parameters from pool (removing what it used)."""
        for g, (rows, cols, _, members) in enumerate(self.groups):
            for j, position in enumerate(members):
                piece = pool.pop(self.keys[position], None) or {}
                if "q" in piece and piece["q"].shape == self._q(g)[j].shape:
                    self._q(g)[j].copy_(piece["q"])
                if self.residual is not None and "residual" in piece and piece["residual"].numel() == rows * cols:
                    self._m(self.residual, g)[j].copy_(piece["residual"].reshape(rows, cols))

    @staticmethod
    def piece_layout(codec: PowerSGD, shape, dtype) -> dict:
        """(shape, dtype) of each per-parameter piece of state (pieces())."""
        if not codec.compresses(shape):
            return {}
        rows, cols = codec.matrix_shape(shape)
        layout = {"q": ((cols, codec.effective_rank(shape)), torch.float32)}
        if codec.error_feedback:
            layout["residual"] = ((rows, cols), torch.float32)
        return layout

    def tensors(self) -> dict:
        return {"q": self.q, "residual": self.residual}

    def spares(self) -> list:
        return [self._spare_q, self._spare_m]

    def load_tensors(self, tensors: dict) -> None:
        check_saved_tensors(tensors, {"q": ((self.q.numel(),), torch.float32),
                                      "residual": ((self.m_numel,), torch.float32) if self.codec.error_feedback
                                      else (None, None)}, self.index)
        self.q = tensors["q"].clone()
        self.residual = None if tensors.get("residual") is None else tensors["residual"].clone()

    def to(self, device) -> None:
        self.q = self.q.to(device)
        self.residual = None if self.residual is None else self.residual.to(device)
        self._spare_m = self._spare_q = None

    def __getstate__(self):
        return {**self.__dict__, "_spare_m": None, "_spare_q": None}

    def __setstate__(self, state):  # states pickled before there were spares (or world and rank) have none
        self.__dict__.update({"_spare_m": None, "_spare_q": None, "world": None, "rank": None, **state})
        self.__dict__.setdefault("q_numel", self.q.numel())
