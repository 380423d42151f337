"""The hierarchical scheme: full precision inside a node, the codec between nodes.

A GPU cluster's slow link is the one between nodes. With W = N x L ranks (N nodes of L ranks, numbered
together: gradcomp.nodes), a bucket of n elements goes in three steps:
    1. inside the node, a reduce-scatter of the bucket divided by L, in the gradient's dtype: local rank l
       then holds shard l of its node's average (ceil(n / L) elements; the bucket padded with zeros to L
       shards);
    2. between nodes, among the N ranks of local rank l (one per node): the codec's own exchange of shard l,
       as a flat scheme runs a bucket on N ranks (two-phase, or allgather where it sends fewer bytes, for
       the gathered codecs; allreduce for the summable ones), with its error feedback: the sender's residual
       of the shard, and the two-phase owner's of its chunk of it. PowerSGD's matrices do not split into
       shards of elements: its shards are groups of whole parameters, balanced by size, each padded to the
       largest, and shard l travels as a PowerSGD bucket of its parameters (P, then Q);
    3. inside the node, an all-gather of the decoded shards.
Each node then sends across its link the exchanges of its L shards, together one flat exchange of the bucket
on N ranks (about 2(N-1)/N payloads under two-phase), whatever L; a flat scheme sends about L of them.

The three steps go in order on every rank: the reduce-scatter is waited for on the hook's thread (on NCCL
the stream waits, not the host), so the exchanges between nodes start in bucket order; the all-gather
inside the node goes through the step's sequencer, in its second round.

Non-finite data: the bucket's verdict is read from the whole gathered bucket, which every rank of every node
holds alike, and a shard's state rolls back to the step before when it is not finite (the exchange of a
shard only sees its own shard's verdict). Random streams: shard l of bucket b draws as bucket b * L + l,
so no two shards share one.
"""

from __future__ import annotations

import time

import torch

from .._futures import value_or_raise
from .._tensors import idle_elements, views_of
from ..powersgd import PowerSGD
from .allgather import AllgatherBucket
from .allreduce import AllreduceBucket
from .powersgd import PowerSGDBucket
from .two_phase import TwoPhaseBucket


def parameter_groups(shapes, size: int) -> list[tuple[int, int]]:
    """(first, end) parameter positions of size contiguous groups, cut where the running total of elements first
    reaches each l/size of the whole: every group's share about equal (some may be empty)."""
    numels = [torch.Size(s).numel() for s in shapes]
    total, bounds, running, position = sum(numels), [0], 0, 0
    for local in range(1, size):
        cut = total * local / size
        while position < len(numels) and running + numels[position] <= cut:
            running += numels[position]
            position += 1
        if position < len(numels) and cut - running > running + numels[position] - cut:  # mostly below the cut
            running += numels[position]
            position += 1
        bounds.append(position)
    bounds.append(len(numels))
    return list(zip(bounds[:-1], bounds[1:]))


def inner_plan_class(codec, numel: int, dtype: torch.dtype, nodes: int) -> type:
    """The flat scheme the shards travel by between nodes (the same choice as scheme="auto" at N ranks)."""
    if isinstance(codec, PowerSGD):
        return PowerSGDBucket
    if codec.collective == "allreduce":
        return AllreduceBucket
    gather, two_phase = (plan.expected_sent(codec, numel, dtype, nodes) for plan in (AllgatherBucket, TwoPhaseBucket))
    return TwoPhaseBucket if two_phase < gather else AllgatherBucket


class HierarchicalBucket:
    scheme = "hierarchical"

    def __init__(self, codec, index: int, keys, shapes, dtype: torch.dtype, device, *, world: int = 1,
                 rank: int = 0, node_size: int = 1):
        if node_size < 1 or world % node_size:
            raise ValueError(f"gradcomp: the hierarchical scheme needs nodes of equal size: node_size={node_size} "
                             f"does not divide the world size {world}")
        self.codec, self.index, self.keys, self.dtype = codec, index, tuple(keys), dtype
        self.world, self.rank, self.node_size = world, rank, node_size
        self.shapes = [torch.Size(s) for s in shapes]
        self.numel = sum(s.numel() for s in self.shapes)
        nodes, node, local = world // node_size, rank // node_size, rank % node_size
        starts = [0]
        for shape in self.shapes:
            starts.append(starts[-1] + shape.numel())
        if isinstance(codec, PowerSGD):  # shards of whole parameters
            self.groups = parameter_groups(self.shapes, node_size)
            self.spans = [(starts[a], starts[b]) for a, b in self.groups]
        else:  # shards of elements: ceil(n / L) each, the last ones padded
            self.groups = None
            size = -(-self.numel // node_size)
            self.spans = [(min(l * size, self.numel), min((l + 1) * size, self.numel)) for l in range(node_size)]
        self.shard = max(max(end - start for start, end in self.spans), -(-self.numel // node_size))
        if self.groups is None:
            inner_keys, inner_shapes = (index,), [(self.shard,)]
        else:
            first, end = self.groups[local]
            inner_keys, inner_shapes = self.keys[first:end], self.shapes[first:end]
        inner_type = inner_plan_class(codec, self.shard, dtype, nodes)
        self.inner = inner_type(codec, index * node_size + local, inner_keys, inner_shapes, dtype, device,
                                world=nodes, rank=node)
        self.carried = None  # a flat scheme's residual of this rank, taken over: sent once with the next step

    @property
    def device(self):
        return self.inner.device

    def traffic_by_level(self, world: int, rank: int) -> dict[str, tuple[int, int]]:
        """Bytes a rank sends and receives per step inside its node (the reduce-scatter and the all-gather,
        rings of L ranks) and across nodes (its shard's exchange: powersgd's shards differ by local rank)."""
        inside = 2 * (self.node_size - 1) * self.shard * self.dtype.itemsize
        nodes, node, local = world // self.node_size, rank // self.node_size, rank % self.node_size
        if self.groups is None:
            across = self.inner.traffic(nodes, node)
        else:
            first, end = self.groups[local]
            sent = PowerSGDBucket.traffic_of(self.codec, self.shapes[first:end], nodes) if end > first else 0
            across = (sent, sent)
        return {"inside": (inside, inside), "across": across}

    def traffic(self, world: int, rank: int) -> tuple[int, int]:
        levels = self.traffic_by_level(world, rank)
        return tuple(a + b for a, b in zip(levels["inside"], levels["across"]))

    def traffic_across(self, world: int, rank: int, nodes) -> int:
        return self.traffic_by_level(world, rank)["across"][0]

    def weighed_bytes(self, world: int, plain_bytes: int) -> tuple[int, int]:
        """(plain DDP, this scheme) for the choice whether to compress: the bytes that cross a node's link. Plain
        DDP's ring crosses each node boundary once per ring step, 2(W-1)/W of the bucket per node."""
        across = sum(self.traffic_across(world, local, None) for local in range(self.node_size))
        return plain_bytes, across

    def payload_bytes(self) -> int:
        return self.inner.payload_bytes()

    def launch(self, step, flat: torch.Tensor, views) -> torch.futures.Future:
        started = time.perf_counter()
        layout = step.nodes
        if layout is None or (step.world, step.rank, layout.node_size) != (self.world, self.rank, self.node_size):
            found = "no node layout" if layout is None else f"nodes of {layout.node_size}"
            raise RuntimeError(f"gradcomp: bucket {self.index} was laid out for rank {self.rank} of {self.world} in "
                               f"nodes of {self.node_size}; this is rank {step.rank} of {step.world} with {found}")
        size = self.node_size
        carried = self.carried
        if carried is not None:  # what a flat scheme held back: in the node's sum, and so in the average, once
            flat.add_(carried.to(flat.device))
        padded = flat.new_zeros(size, self.shard)
        for row, (start, end) in zip(padded, self.spans):  # divided first, as plain DDP divides: sums stay in range
            torch.div(flat[start:end], size, out=row[: end - start])
        shard = flat.new_empty(self.shard)
        inside = step.on(layout.inside, size, layout.local_rank)
        inside.reduce_scatter_now(shard, padded.view(-1))
        step.add("encode_s", time.perf_counter() - started)
        exchanged = self._exchange(step.on(layout.across, layout.nodes, layout.node), shard, layout.local_rank)
        gathered = flat.new_empty(size, self.shard)
        result = step.new_future(flat.device)

        def finish(all_gathered):
            started = time.perf_counter()
            all_gathered.value()
            if result.done():  # this rank failed earlier in the step
                return
            for row, (start, end) in zip(gathered, self.spans):
                flat[start:end].copy_(row[: end - start])
            finite = torch.isfinite(flat).all()  # every rank of every node holds this same bucket
            self.inner.revert_unless(finite)
            if carried is not None and (carried.is_cuda or bool(finite)):  # kept for the next step where not finite
                self.carried = None if not carried.is_cuda else torch.where(finite, 0, carried)
            step.count_nonfinite(finite)
            step.add("decode_s", time.perf_counter() - started)
            result.set_result(flat)

        step.chain_in_order(lambda: exchanged, value_or_raise, lambda: inside.all_gather(gathered, shard), finish,
                            result, flat.device, round_=2)
        return result.then(value_or_raise)  # result may fail by set_exception(): see value_or_raise

    def _exchange(self, across, shard: torch.Tensor, local: int) -> torch.futures.Future:
        """The shard's exchange between nodes: the inner plan on the shard (powersgd: on its parameters' views of
        it); an empty group of parameters has nothing to send, alike on every node."""
        if self.groups is None:
            return self.inner.launch(across, shard, [shard])
        first, end = self.groups[local]
        if first == end:
            done = across.new_future(shard.device)
            done.set_result(shard)
            return done
        group_numel = self.spans[local][1] - self.spans[local][0]
        return self.inner.launch(across, shard[:group_numel], views_of(shard[:group_numel], self.shapes[first:end]))

    def set_idle_aside(self, idle: torch.Tensor, flat: torch.Tensor) -> None:
        """As ResidualPlan.set_idle_aside, for the elements of this rank's shard."""
        mask = idle_elements(idle, self.shapes, self.numel)
        if mask is None:
            return
        flat.masked_fill_(mask, 0)
        start, end = self.spans[self.rank % self.node_size]
        shard = torch.zeros(self.shard, dtype=torch.bool, device=mask.device)  # the padding: never idle
        shard[: end - start] = mask[start:end]
        self.inner.restore_residuals(shard)

    def pieces(self) -> dict:
        """This rank's residuals as a flat scheme's, so that a new layout or scheme takes them over and nothing is lost:
        the exchange between nodes keeps its residual of shard l in units of the node's average, which counts 1/N in
        the average, where a rank's residual in a flat scheme counts 1/W: it moves over as L times itself, on the
        shard's elements (0 elsewhere; the inner two-phase owner's is folded in by the inner plan)."""
        inner = self.inner.pieces()
        if self.carried is None and not any("residual" in piece for piece in inner.values()):
            return {}
        local = self.rank % self.node_size
        flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device) if self.carried is None \
            else self.carried.clone()
        start, end = self.spans[local]
        if self.groups is None:
            flat[start:end].add_(inner[self.inner.keys[0]]["residual"][: end - start], alpha=self.node_size)
        else:  # powersgd: its group's residuals (PowerSGD's Q stays: other ranks' groups hold other Qs)
            first, _ = self.groups[local]
            offset = start
            for position, key in enumerate(self.inner.keys):
                count = self.shapes[first + position].numel()
                if "residual" in inner.get(key, {}):
                    flat[offset: offset + count].add_(inner[key]["residual"].reshape(-1), alpha=self.node_size)
                offset += count
        pieces, offset = {}, 0
        for key, shape in zip(self.keys, self.shapes):
            pieces[key] = {"residual": flat[offset: offset + shape.numel()]}
            offset += shape.numel()
        return pieces

    def take(self, pool: dict) -> None:
        """The residuals a flat scheme (or another layout) left for these parameters: added to the bucket at the next
        step, before the reduce-scatter, so the node's sum carries them once."""
        carried = [(pool.pop(key, None) or {}).get("residual") for key in self.keys]
        if all(piece is None for piece in carried):
            return
        self.carried = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        offset = 0
        for piece, shape in zip(carried, self.shapes):
            if piece is not None and piece.numel() == shape.numel():
                self.carried[offset: offset + shape.numel()].copy_(piece.reshape(-1))
            offset += shape.numel()

    def tensors(self) -> dict:
        return self.inner.tensors()

    def spares(self) -> list:
        return self.inner.spares()

    def load_tensors(self, tensors: dict) -> None:
        self.inner.load_tensors(tensors)

    @staticmethod
    def piece_layout(codec, shape, dtype) -> dict:
        return {}

    def to(self, device) -> None:
        self.inner.to(device)
