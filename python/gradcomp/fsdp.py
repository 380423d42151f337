"""gradcomp under FSDP2 (torch's `fully_shard`): a compressed gradient reduce-scatter with error feedback.

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = gradcomp.fsdp.register(model, "topk", ratio=0.01)     # after fully_shard, before the first backward

FSDP gathers each `fully_shard` module's gradients into one flat buffer laid out rank-major: row j (S elements)
is what rank j keeps. gradcomp replaces the reduce-scatter of that buffer (FSDPModule.set_custom_reduce_scatter):
every rank encodes each row j, with its own error-feedback residual of that row, as a payload of its own (the
two-phase scheme's encode_chunks); one all_to_all_single sends row j's payload to rank j; rank j decodes and sums
the W - 1 payloads of the other ranks into its shard in one pass (decode_sum) and adds its own row exactly (gradient
+ residual: that row never crosses the wire, so it is not compressed, and its residual is spent). FSDP divides by
the world size afterwards (set_force_sum_reduction_for_comms). Every op runs on the current stream (FSDP's
reduce-scatter stream), with no host-device sync.

The first start_iter steps (2 by default, as the DDP hook's) go plain: FSDP's own reduce-scatter.

What it costs and keeps:
- the residual is per module, the size of its unsharded gradient (W rows of S) in the reduce dtype, and a spare
  of the same size (a step's residual is written there, then kept only for the rows that stayed finite):
  `memory_bytes()`. Codecs without error feedback (none, fp16, bf16, qsgd, terngrad by default) keep none.
- A row whose gradient + residual is not finite keeps the residual it had (no NaN is carried into later steps);
  its payload carries the NaN or Inf to the rank that owns it, whose shard then holds it (a GradScaler skips the
  step). Other rows' residuals take in that step's gradient, as the DDP hook's finite buckets do.
- The parameters' all-gathers are not compressed. Under FSDP's own HSDP (a 2-D mesh) neither is its all-reduce
  across replicas (in FSDP's reduce dtype); register's replicate_group compresses that exchange too (below).
  Under gradient accumulation that exchange runs at every micro-step (FSDP's set_requires_all_reduce governs
  its own HSDP only).
- Checkpoints: state_dict() is this rank's; gradcomp.every_rank(state) (or dcp_stateful) holds every rank's, for
  a checkpoint one rank writes. They load on the world size that saved them only (a row is a rank's shard).
- At each group's first exchange its ranks compare their configuration and steps (one gather of a small object,
  the one host-device sync): a mismatch raises on all of them.
- PowerSGD needs each parameter's matrix shape, which the flat buffer does not give: it is refused.
Needs FSDP2's FSDPModule.set_custom_reduce_scatter and set_force_sum_reduction_for_comms (public methods whose
protocol lives in a private module): register looks for them and names what is missing. Tested with torch 2.11 and
2.13.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
import torch.distributed as dist

from . import _ops
from .checkpoint import STATE_FORMAT, _to_cpu, every_rank_world_size, is_every_rank, this_ranks_entry
from .codecs import chunk_bounds, codec as make_codec
from .schemes.two_phase import OWNER_FAILED
from .step import collective_failure
from .powersgd import PowerSGD

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # torch without FSDP2, or with the seam elsewhere
    FSDPModule, ReduceScatter = None, object

SEAM = ("set_custom_reduce_scatter", "set_force_sum_reduction_for_comms")
# The plain steps' reduce-scatter: reduce_scatter_tensor's new name (torch 2.13 deprecates the old one)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def register(model: torch.nn.Module, spec: str = "topk", *, replicate_group: dist.ProcessGroup | None = None,
             start_iter: int = 2, **codec_params: Any) -> "FSDPCompression":
    """Installs gradcomp's reduce-scatter on every FSDP module of model (what fully_shard returned); returns the
    state (stats, memory_bytes, state_dict / load_state_dict). spec, codec_params: as gradcomp.codec takes them.

    start_iter: steps of each module's plain reduce-scatter (and exchange across replicas) first, as the DDP
    hook's start_iter (on the LM of benchmarks/lm.py under FSDP2 they changed topk's result little).

    replicate_group: HSDP with a compressed all-reduce across replicas. Shard the model with fully_shard on the
    1-D shard mesh (mesh["shard"] of init_device_mesh(device, (replicas, shards), mesh_dim_names=("replicate",
    "shard"))) and pass the group across replicas (mesh.get_group("replicate")): after each reduce-scatter, FSDP's
    all-reduce hook runs the two-phase exchange of the shard across the replicas, with error feedback at both
    ends (the sender's, the size of the shard, and the owner's of its chunk)."""
    if FSDPModule is None or not all(hasattr(FSDPModule, name) for name in SEAM):
        raise RuntimeError(f"gradcomp.fsdp needs FSDP2's custom reduce-scatter (FSDPModule.{SEAM[0]} and "
                           f"{SEAM[1]}, tested with torch 2.11 and 2.13), which torch {torch.__version__} lacks")
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise TypeError(f"gradcomp.fsdp.register takes a model sharded by fully_shard, and {type(model).__name__} "
                        f"holds no FSDP module: call torch.distributed.fsdp.fully_shard on its blocks and on the "
                        f"model first (for DistributedDataParallel, use gradcomp.register)")
    state = FSDPCompression(spec, start_iter=start_iter, **codec_params)
    for index, module in enumerate(modules):  # every module checked before any is changed
        if getattr(module, "_gradcomp_fsdp", None) is not None:
            raise RuntimeError(f"gradcomp.fsdp: module {index} ({type(module).__name__}) has gradcomp's "
                               f"reduce-scatter already")
        groups = _param_groups(index, module)
        if len(groups) > 1:
            raise ValueError(f"gradcomp.fsdp: module {index} ({type(module).__name__}) has {len(groups)} parameter "
                             f"groups (per-parameter meshes, shard_placement_fn); gradcomp's reduce-scatter takes one "
                             f"flat buffer per module: shard it without per-parameter meshes")
        _check_gradient_dtypes(index, module, groups)
        if replicate_group is not None and any(group._is_hsdp for group in groups):
            raise ValueError(f"gradcomp.fsdp: module {index} is sharded on a 2-D mesh (FSDP's own HSDP, whose "
                             f"all-reduce across replicas runs before any hook): for a compressed one, fully_shard "
                             f"on the 1-D shard mesh (mesh['shard']) and pass replicate_group")
    for index, module in enumerate(modules):
        module.set_custom_reduce_scatter(CompressedReduceScatter(state, index))
        module.set_force_sum_reduction_for_comms(True)
        if replicate_group is not None:
            module.set_all_reduce_hook(functools.partial(state.replica_all_reduce, index, replicate_group))
        module._gradcomp_fsdp = state
    state.modules = len(modules)
    state.replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
    return state


class FSDPCompression:
    """The codec and, per FSDP module, its residual and steps; the bytes each rank sent."""

    def __init__(self, spec: str = "topk", *, start_iter: int = 2, **codec_params: Any):
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"gradcomp.fsdp: start_iter={start_iter!r} must be an integer >= 0")
        self.start_iter = start_iter
        self.codec = make_codec(spec, **codec_params)
        if isinstance(self.codec, PowerSGD):
            raise ValueError("gradcomp.fsdp: powersgd compresses each parameter as a matrix, and FSDP's reduce-scatter "
                             "sees one flat buffer of many parameters' rows: use a codec that works on any vector "
                             "(topk, signsgd, qsgd, terngrad, randomk, fp16, bf16), or PowerSGD under DDP "
                             "(gradcomp.register)")
        self.spec = self.codec.spec()
        self.modules = 0
        self.residuals: dict[int, torch.Tensor] = {}  # module index -> residual of its W x S input
        self._spares: dict[int, torch.Tensor] = {}
        self.steps: dict[int, int] = {}  # module index -> reduce-scatters done
        self.replica_steps: dict[int, int] = {}  # module index -> exchanges across replicas done
        # HSDP's exchange across replicas: per module the sender's residual (of the shard) and the owner's (its chunk)
        self.replica_residuals: dict[int, torch.Tensor] = {}
        self.owner_residuals: dict[int, torch.Tensor] = {}
        self.total = {"wire_bytes": 0, "raw_bytes": 0, "reduce_scatters": 0, "replica_wire_bytes": 0,
                      "replica_raw_bytes": 0}
        self._checks: list = []  # CUDA: (pinned status, event, module, step, what) not read yet
        self.world_size: int | None = None  # all the ranks (the shard group's size times the replicas')
        self.replicas = 1  # HSDP: the replicas replicate_group spans (register sets it)
        self._verified: list = []  # the groups whose ranks compared their configuration (at their first exchange)

    # -- one module's reduce-scatter --------------------------------------------------------------------------------

    def reduce_scatter(self, index: int, output: torch.Tensor, flat: torch.Tensor, group) -> None:
        world = dist.get_world_size(group)
        if flat.numel() != world * output.numel():
            raise ValueError(f"gradcomp.fsdp: module {index}'s reduce-scatter input holds {flat.numel()} elements, "
                             f"not {world} x the {output.numel()} of its output")
        if flat.dtype not in _ops.DTYPE_IDS:
            raise ValueError(f"gradcomp.fsdp: module {index} reduces in {flat.dtype}; gradcomp's codecs take "
                             f"{', '.join(map(str, _ops.DTYPE_IDS))}")
        everyone, me = dist.get_world_size(), dist.get_rank()
        self.world_size = everyone
        self._verify(group, index)
        step = self.steps.get(index, 0)
        if step < self.start_iter:
            self._plain(self.residuals, index, flat)
            _reduce_scatter(output, flat, group=group)
            self.steps[index] = step + 1
            sent = (world - 1) * output.numel() * output.element_size()  # a ring reduce-scatter's
            self._count(wire_bytes=sent, raw_bytes=sent, reduce_scatters=1)
            return
        residual = self._residual(index, flat)
        # Each (sender, row) pair its own random stream, also across replicas: sender g's row j is g * W + j.
        payloads = self.codec.encode_chunks(flat, residual, world, step=step, bucket=index,
                                            first_rank=_stream(me * world, world))
        before = finite = None
        if residual is not None:  # a row whose gradient is not finite keeps its residual (the codec may not show it
            # there: topk sends a NaN and zeroes its place); the residual before was finite, and m = grad + residual
            # saturates, so the gradient's row decides
            rows, before = residual.view(world, -1), self._spares[index].view(world, -1)
            finite = torch.isfinite(flat.view(world, -1)).all(dim=1, keepdim=True)
            torch.where(finite, rows, before, out=rows)
        size = payloads.numel() // world  # the rows are of equal size: FSDP pads each parameter to W rows
        received = torch.empty_like(payloads)
        dist.all_to_all_single(received, payloads, group=group)
        status = self._status(output.device)
        received = received.view(world, size)
        if self.codec.vote:  # a majority vote counts every rank's sign, this rank's too
            self.codec.decode_sum(received, output, 1.0, status=status)
        else:
            self._sum_with_own_row(output, received, flat, residual, before, finite, dist.get_rank(group), status)
        self._defer(status, index, step, "reduce-scatter")
        self.steps[index] = step + 1
        self._count(wire_bytes=(world - 1) * size, raw_bytes=(world - 1) * output.numel() * output.element_size(),
                    reduce_scatters=1)

    def _sum_with_own_row(self, output: torch.Tensor, received: torch.Tensor, flat: torch.Tensor,
                          residual: torch.Tensor | None, before: torch.Tensor | None, finite: torch.Tensor | None,
                          row: int, status: torch.Tensor | None) -> None:
        """output = the other ranks' decoded payloads + this rank's own row exactly: that row never crosses the
        wire, so its gradient and the residual it had (before: the residuals' rows as they were) go into the sum
        whole, and its residual is spent where the row was finite (finite: per row), else kept, as every row's is."""
        world = received.shape[0]
        if world > 1:
            self.codec.decode_sum(torch.cat([received[:row], received[row + 1:]]), output, 1.0, status=status)
        else:
            output.zero_()
        own = flat.view(world, -1)[row]
        if residual is not None:
            own = own + before[row]
            kept = residual.view(world, -1)[row]
            torch.where(finite[row], torch.zeros_like(kept), before[row], out=kept)
        output.add_(own)

    def _plain(self, store: dict, index: int, flat: torch.Tensor) -> None:
        """Before start_iter: what a residual holds (a state resumed from compressed steps) goes with the plain
        gradient, and the residual is cleared, so nothing is lost."""
        residual = store.get(index)
        if residual is not None:
            flat.add_(residual.to(flat.device).view_as(flat))
            store[index] = torch.zeros_like(residual)

    def _count(self, **amounts: int) -> None:
        for key, amount in amounts.items():
            self.total[key] += amount

    def replica_all_reduce(self, index: int, group, shard: torch.Tensor) -> None:
        """HSDP: shard (this rank's reduce-scatter output) becomes its average over the replicas in group, by the
        two-phase exchange: chunk j of every replica's shard, encoded with the sender's residual, to replica j, which
        decodes their average and encodes it again with its owner residual; an all-gather of those gives every
        replica the same average (bit for bit)."""
        replicas, me = dist.get_world_size(group), dist.get_rank(group)
        if replicas == 1:
            return
        flat, codec = shard.view(-1), self.codec
        step = self.replica_steps.get(index, 0)  # its own count: with one rank per replica no reduce-scatter runs
        everyone, global_rank = dist.get_world_size(), dist.get_rank()
        self.world_size = everyone
        self._verify(group, index)
        if step < self.start_iter:
            self._plain(self.replica_residuals, index, flat)  # the owner's residual is empty before any exchange
            dist.all_reduce(flat, group=group)
            flat.div_(replicas)
            self.replica_steps[index] = step + 1
            sent = 2 * (replicas - 1) * flat.numel() * flat.element_size() // replicas  # a ring all-reduce's
            self._count(replica_wire_bytes=sent, replica_raw_bytes=sent)
            return
        # Random streams apart from the reduce-scatter's (which end below everyone * shards <= everyone ** 2).
        keys = everyone * everyone
        residual = self._kept(self.replica_residuals, index, flat.numel(), flat, "residual of the shard")
        before = None if residual is None else residual.clone()
        payloads = codec.encode_chunks(flat, residual, replicas, step=step, bucket=index,
                                       first_rank=_stream(keys + global_rank * replicas, replicas))
        bounds = chunk_bounds(flat.numel(), replicas)
        sizes = [codec.payload_nbytes(end - start, flat.dtype) for start, end in bounds]
        mine = torch.empty(replicas * sizes[me], dtype=torch.uint8, device=flat.device)
        dist.all_to_all_single(mine, payloads, [sizes[me]] * replicas, sizes, group=group)
        start, end = bounds[me]
        average = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
        owner = self._kept(self.owner_residuals, index, end - start, flat, "owner's residual of its chunk")
        owner_before = None if owner is None else owner.clone()
        width = max(sizes)
        row = torch.zeros(width, dtype=torch.uint8, device=flat.device)
        failed, status = None, self._status(flat.device)
        try:
            again = codec.reencode_sum(mine.view(replicas, sizes[me]), average, owner, 1.0 / replicas, step=step,
                                       bucket=index, rank=_stream(keys + everyone * replicas + global_rank, 1),
                                       status=status)
            row[: again.numel()].copy_(again)
        except Exception as error:  # the other replicas wait in the all-gather: they get a row saying so
            failed = error
            notice = (OWNER_FAILED + str(error).encode(errors="replace"))[:width]
            row[: len(notice)].copy_(torch.frombuffer(bytearray(notice), dtype=torch.uint8))
        rows = torch.empty((replicas, width), dtype=torch.uint8, device=flat.device)
        dist.all_gather(list(rows.unbind(0)), row, group=group)
        if failed is not None:
            raise failed
        if not rows.is_cuda:  # (on CUDA the device's checks refuse such a row: it is not a payload)
            marker = torch.frombuffer(bytearray(OWNER_FAILED), dtype=torch.uint8)
            owners = (rows[:, : len(OWNER_FAILED)] == marker).all(dim=1).nonzero().flatten().tolist()
            if owners:
                said = bytes(rows[owners[0], len(OWNER_FAILED):].tolist()).rstrip(b"\0").decode(errors="replace")
                raise RuntimeError(f"gradcomp.fsdp: replica {owners[0]}, which owns chunk {owners[0]} of module "
                                   f"{index}'s shard, could not re-encode it at step {step}: {said}")
        codec.decode_chunks(rows, flat, status=status)
        self._defer(status, index, step, "exchange across replicas")
        self.replica_steps[index] = step + 1
        for kept, was, finite in ((residual, before, torch.isfinite(flat).all()),
                                  (owner, owner_before, torch.isfinite(average).all())):
            if kept is not None:  # a non-finite exchange leaves the residuals as they were
                torch.where(finite, kept, was, out=kept)
        self._count(replica_wire_bytes=sum(sizes) - sizes[me] + (replicas - 1) * width,
                    replica_raw_bytes=2 * (replicas - 1) * flat.numel() * flat.element_size() // replicas)

    def _verify(self, group, index: int) -> None:
        """At the first exchange in group (the shard group's reduce-scatter, the replicas' exchange), its ranks
        compare their configuration and steps (one object gathered once per group): a rank registered with another
        codec, without replicate_group, or resumed from another step, raises on every rank of the group instead of
        hanging or decoding another codec's payloads."""
        if any(done is group for done in self._verified):
            return
        mine = json.dumps({**self.config(), "replicas": self.replicas, "steps": self.steps,
                           "replica_steps": self.replica_steps}, sort_keys=True)
        everyone: list[Any] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(everyone, mine, group=group)
        except Exception as error:
            raise collective_failure("comparison of the ranks' configuration", self.steps.get(index, 0),
                                     dist.get_rank(), len(everyone), error) from error
        if len(set(everyone)) > 1:
            listing = "\n".join(f"  rank {rank}: {config}" for rank, config in enumerate(everyone))
            raise RuntimeError(f"gradcomp.fsdp: the ranks are configured differently; every rank must register the "
                               f"same codec on the same model and resume from the same step (ranks of the group "
                               f"in its order):\n{listing}")
        self._verified.append(group)

    # On CUDA the payloads are checked on the device, into a status word read back a step later from pinned
    # memory (no host-device sync in the step; a malformed payload sets the output to NaN meanwhile).
    def _status(self, device: torch.device) -> torch.Tensor | None:
        if device.type != "cuda":
            return None  # the CPU's checks raise at once
        self._read_checks()
        return torch.zeros(1, dtype=torch.int32, device=device)

    def _defer(self, status: torch.Tensor | None, index: int, step: int, what: str) -> None:
        if status is None:
            return
        pinned = torch.empty(1, dtype=torch.int32, pin_memory=True)
        pinned.copy_(status, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._checks.append((pinned, event, index, step, what))

    def _read_checks(self) -> None:
        for entry in list(self._checks):
            pinned, event, index, step, what = entry
            if not event.query():
                continue
            self._checks.remove(entry)
            if int(pinned.item()):
                raise RuntimeError(f"gradcomp.fsdp: module {index}'s {what} at step {step} received a malformed "
                                   f"payload (problem bits {int(pinned.item()):#x}); that shard was set to NaN")

    def _kept(self, store: dict, index: int, numel: int, like: torch.Tensor, what: str) -> torch.Tensor | None:
        """store[index], a residual of numel elements like `like` (made, or moved to its device), under error
        feedback."""
        if not self.codec.error_feedback:
            return None
        kept = store.get(index)
        if kept is None:
            kept = store[index] = torch.zeros(numel, dtype=like.dtype, device=like.device)
        elif kept.numel() != numel or kept.dtype != like.dtype:
            raise ValueError(f"gradcomp.fsdp: module {index}'s {what} holds {kept.numel()} {kept.dtype}, and this "
                             f"step needs {numel} {like.dtype} (was the state saved for another model?)")
        elif kept.device != like.device:
            kept = store[index] = kept.to(like.device)
        return kept

    def _residual(self, index: int, flat: torch.Tensor) -> torch.Tensor | None:
        """This module's residual (its spare holding the one before this step), made or checked for flat."""
        if not self.codec.error_feedback:
            return None
        residual = self.residuals.get(index)
        if residual is None:
            residual = self.residuals[index] = torch.zeros_like(flat)
        elif residual.shape != flat.shape or residual.dtype != flat.dtype:
            raise ValueError(f"gradcomp.fsdp: module {index}'s residual is {list(residual.shape)} {residual.dtype}, "
                             f"its reduce-scatter input {list(flat.shape)} {flat.dtype} (was the state saved for "
                             f"another model?)")
        elif residual.device != flat.device:  # loaded on the CPU
            residual = self.residuals[index] = residual.to(flat.device)
        spare = self._spares.get(index)
        if spare is None or spare.shape != residual.shape or spare.device != residual.device:
            spare = self._spares[index] = torch.empty_like(residual)
        spare.copy_(residual)
        return residual

    # -- what it reports and keeps ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Bytes this rank sent ("wire_bytes": W-1 of its payloads per reduce-scatter) and what FSDP's ring
        reduce-scatter would have sent ("raw_bytes"), their ratio, and the reduce-scatters done; under HSDP the same
        for the exchange across replicas ("replica_wire_bytes", "replica_raw_bytes": a ring all-reduce of the
        shard, "replica_ratio")."""
        self._read_checks()
        total = dict(self.total)
        total["ratio"] = total["raw_bytes"] / total["wire_bytes"] if total["wire_bytes"] else 1.0
        if total["replica_wire_bytes"]:  # HSDP: the exchange across replicas against a ring all-reduce of the shard
            total["replica_ratio"] = total["replica_raw_bytes"] / total["replica_wire_bytes"]
        return {"world_size": self.world_size, "modules": self.modules, "total": total}

    def memory_bytes(self) -> int:
        """The residuals and their spares: two of each module's unsharded gradient under error feedback; under HSDP
        also the residuals of the shard and of the chunk it owns across replicas."""
        kept = [*self.residuals.values(), *self._spares.values(), *self.replica_residuals.values(),
                *self.owner_residuals.values()]
        return sum(t.numel() * t.element_size() for t in kept)

    def config(self) -> dict[str, Any]:
        return {"codec": self.spec, "start_iter": self.start_iter, "modules": self.modules,
                "world_size": self.world_size, "wire_format": _ops._C.format_version}

    @property
    def iter(self) -> int:
        """Steps done (the exchanges of the module that did most): names every_rank(state, directory)'s files."""
        return max([*self.steps.values(), *self.replica_steps.values()], default=0)

    def _group(self):
        return dist.group.WORLD  # every rank's residuals: the shard group's and, under HSDP, the replicas'

    def state_dict(self) -> dict[str, Any]:
        rank = dist.get_rank() if dist.is_initialized() else None
        return {"format": STATE_FORMAT, "kind": "fsdp", "config": self.config(), "rank": rank,
                "steps": dict(self.steps), "replica_steps": dict(self.replica_steps),
                "residuals": _to_cpu({k: v.clone() for k, v in self.residuals.items()}),
                "replica_residuals": _to_cpu({k: v.clone() for k, v in self.replica_residuals.items()}),
                "owner_residuals": _to_cpu({k: v.clone() for k, v in self.owner_residuals.items()}),
                "total": dict(self.total)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """What state_dict() saved on this rank, or this rank's entry of what gradcomp.every_rank(state) saved."""
        if is_every_rank(saved):
            if not dist.is_initialized():
                raise RuntimeError("gradcomp.fsdp: an every-rank state is loaded by each rank taking its own entry: "
                                   "load it after torch.distributed.init_process_group")
            world = dist.get_world_size()
            if every_rank_world_size(saved) != world:
                raise ValueError(f"gradcomp.fsdp: this every-rank state was saved by {saved['world_size']} ranks, and "
                                 f"this world has {world}: each residual row is a rank's shard of a module's "
                                 f"gradient, laid out anew on another world size (elastic resume is the DDP hook's "
                                 f"only); resume on {saved['world_size']} ranks, or start from a fresh state")
            saved = this_ranks_entry(saved, dist.get_rank())
        if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT or saved.get("kind") != "fsdp":
            found = (f"a dict of format {saved.get('format')!r}, kind {saved.get('kind')!r}" if isinstance(saved, dict)
                     else type(saved).__name__)
            raise ValueError(f"gradcomp.fsdp: not a state that gradcomp.fsdp saved (got {found}; a DDP hook's state "
                             f"loads into gradcomp.register's CompressionState)")
        mine = self.config()
        differing = {k: (saved["config"].get(k), v) for k, v in mine.items()
                     if k != "world_size" and saved["config"].get(k) != v}
        world = dist.get_world_size() if dist.is_initialized() else None
        if world is not None and saved["config"].get("world_size") not in (None, world):
            differing["world_size"] = (saved["config"]["world_size"], world)
        if differing:
            listing = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differing.items())
            raise ValueError(f"gradcomp.fsdp: the state was saved for another configuration ({listing})")
        rank = dist.get_rank() if dist.is_initialized() else None
        if None not in (rank, saved.get("rank")) and saved["rank"] != rank:
            raise ValueError(f"gradcomp.fsdp: this state holds rank {saved['rank']}'s residuals; this is rank {rank} "
                             f"(every rank loads the state it saved)")
        self.steps = {int(k): int(v) for k, v in saved["steps"].items()}
        self.replica_steps = {int(k): int(v) for k, v in saved.get("replica_steps", {}).items()}
        # On the CPU until the first reduce-scatter, which moves each to its input's device.
        self.residuals = {int(k): v.clone() for k, v in saved["residuals"].items()}
        self.replica_residuals = {int(k): v.clone() for k, v in saved.get("replica_residuals", {}).items()}
        self.owner_residuals = {int(k): v.clone() for k, v in saved.get("owner_residuals", {}).items()}
        self._spares = {}
        self._verified = []
        self.total = {**self.total, **saved["total"]}
        self.world_size = saved["config"].get("world_size")


def _param_groups(index: int, module) -> list:
    """The module's FSDP parameter groups, whose dtypes and meshes register checks: a list in torch 2.13 (per-parameter
    meshes), one group or None in torch 2.11. A torch that keeps them elsewhere is refused, not let through
    unchecked."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    raise RuntimeError(f"gradcomp.fsdp: cannot find the FSDP parameter groups of module {index} "
                       f"({type(module).__name__}) in torch {torch.__version__} (tested with torch 2.11 and 2.13)")


def _check_gradient_dtypes(index: int, module, groups) -> None:
    """FSDP reduces one flat buffer per module in one dtype: refuses, before any step, gradients of several dtypes
    in one module (FSDP's own assertion would name no remedy) and a reduce dtype gradcomp's codecs do not take."""
    for group in groups:
        dtypes = {p.dtype for p in (fsdp_param.sharded_param for fsdp_param in group.fsdp_params) if p.requires_grad}
        if len(dtypes) > 1:
            listing = ", ".join(sorted(map(str, dtypes)))
            raise ValueError(f"gradcomp.fsdp: module {index} ({type(module).__name__}) has gradients of several dtypes "
                             f"({listing}), and FSDP reduces each module's gradients as one flat buffer: give its "
                             f"parameters one dtype, or fully_shard the differing parameters' modules on their own")
        policy = group.mp_policy
        for dtype in dtypes:  # FSDP computes gradients in param_dtype and reduces them in reduce_dtype, where set
            reduce_dtype = policy.reduce_dtype or (policy.param_dtype if dtype.is_floating_point else None) or dtype
            if reduce_dtype not in _ops.DTYPE_IDS:
                raise ValueError(f"gradcomp.fsdp: module {index} ({type(module).__name__}) reduces its gradients in "
                                 f"{reduce_dtype}; gradcomp's codecs take {', '.join(map(str, _ops.DTYPE_IDS))} "
                                 f"(MixedPrecisionPolicy(reduce_dtype=torch.float32) is one way)")


def _stream(first: int, count: int) -> int:
    """first, checked: the random stream keys first .. first + count - 1 must stay below 2**32 - 1 (the last is
    the shared stream)."""
    if first + count >= 0xFFFFFFFF:
        raise ValueError(f"gradcomp.fsdp: {dist.get_world_size()} ranks need random stream keys beyond 2**32; gradcomp "
                         f"keys a stream per sender and row, which this world size exhausts")
    return first


class CompressedReduceScatter(ReduceScatter):
    """The ReduceScatter FSDP calls for one module: gradcomp's, with that module's state."""

    def __init__(self, state: FSDPCompression, index: int):
        self.state, self.index = state, index

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.RedOpType.SUM):
            raise ValueError(f"gradcomp.fsdp: FSDP asked for a reduce-scatter with {op}; gradcomp sums and leaves the "
                             f"division to FSDP (set_force_sum_reduction_for_comms(True), which register sets; was "
                             f"it turned off since?)")
        self.state.reduce_scatter(self.index, output_tensor, input_tensor, group)
        return None
