"""gradcomp under FSDP2 (torch's `fully_shard`): a compressed gradient reduce-scatter with error feedback.

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = gradcomp.fsdp.register(model, "topk", ratio=0.01)     # after fully_shard, before the first backward

FSDP gathers each `fully_shard` module's gradients into one flat buffer laid out rank-major: row j (S elements)
is what rank j keeps. gradcomp replaces the reduce-scatter of that buffer (FSDPModule.set_custom_reduce_scatter):
every rank encodes each row j, with its own error-feedback residual of that row, as a payload of its own (the
two-phase scheme's encode_chunks); one all_to_all_single sends row j's payload to rank j; rank j decodes and sums
the W payloads it receives into its shard in one pass (decode_sum). FSDP divides by the world size afterwards
(set_force_sum_reduction_for_comms). Every op runs on the current stream (FSDP's reduce-scatter stream), with no
host-device sync.

What it costs and keeps:
- the residual is per module, the size of its unsharded gradient (W rows of S) in the reduce dtype, and a spare
  of the same size (a step's residual is written there, then kept only for the rows that stayed finite):
  `memory_bytes()`. Codecs without error feedback (none, fp16, bf16, qsgd, terngrad by default) keep none.
- A row whose gradient + residual is not finite keeps the residual it had (no NaN is carried into later steps);
  its payload carries the NaN or Inf to the rank that owns it, whose shard then holds it (a GradScaler skips the
  step). Other rows' residuals take in that step's gradient, as the DDP hook's finite buckets do.
- Only the reduce-scatter is compressed. Under HSDP (a 2-D mesh) the all-reduce across replicas that follows it
  stays FSDP's own, in full precision.
- PowerSGD needs each parameter's matrix shape, which the flat buffer does not give: it is refused.
Needs FSDP2's FSDPModule.set_custom_reduce_scatter and set_force_sum_reduction_for_comms (public methods whose
protocol lives in a private module): register looks for them and names what is missing. Tested with torch 2.13.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from . import _ops
from .checkpoint import STATE_FORMAT, _to_cpu
from .codecs import chunk_bounds, codec as make_codec
from .powersgd import PowerSGD

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # torch without FSDP2, or with the seam elsewhere
    FSDPModule, ReduceScatter = None, object

SEAM = ("set_custom_reduce_scatter", "set_force_sum_reduction_for_comms")


def register(model: torch.nn.Module, spec: str = "topk", *, replicate_group: dist.ProcessGroup | None = None,
             **codec_params: Any) -> "FSDPCompression":
    """Installs gradcomp's reduce-scatter on every FSDP module of model (what fully_shard returned); returns the
    state (stats, memory_bytes, state_dict / load_state_dict). spec, codec_params: as gradcomp.codec takes them.

    replicate_group: HSDP with a compressed all-reduce across replicas. Shard the model with fully_shard on the
    1-D shard mesh (mesh["shard"] of init_device_mesh(device, (replicas, shards), mesh_dim_names=("replicate",
    "shard"))) and pass the group across replicas (mesh.get_group("replicate")): after each reduce-scatter, FSDP's
    all-reduce hook runs the two-phase exchange of the shard across the replicas, with error feedback at both
    ends (the sender's, the size of the shard, and the owner's of its chunk)."""
    if FSDPModule is None or not all(hasattr(FSDPModule, name) for name in SEAM):
        raise RuntimeError(f"gradcomp.fsdp needs FSDP2's custom reduce-scatter (FSDPModule.{SEAM[0]} and "
                           f"{SEAM[1]}, tested with torch 2.13), which torch {torch.__version__} lacks")
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise TypeError(f"gradcomp.fsdp.register takes a model sharded by fully_shard, and {type(model).__name__} "
                        f"holds no FSDP module: call torch.distributed.fsdp.fully_shard on its blocks and on the "
                        f"model first (for DistributedDataParallel, use gradcomp.register)")
    state = FSDPCompression(spec, **codec_params)
    for index, module in enumerate(modules):
        if getattr(module, "_gradcomp_fsdp", None) is not None:
            raise RuntimeError(f"gradcomp.fsdp: module {index} ({type(module).__name__}) has gradcomp's "
                               f"reduce-scatter already")
        try:
            module.set_custom_reduce_scatter(CompressedReduceScatter(state, index))
        except ValueError as error:  # several parameter groups (per-parameter meshes)
            raise ValueError(f"gradcomp.fsdp: module {index} ({type(module).__name__}): {error}") from None
        module.set_force_sum_reduction_for_comms(True)
        if replicate_group is not None:
            if any(group._is_hsdp for group in module._get_fsdp_state()._fsdp_param_groups):
                raise ValueError(f"gradcomp.fsdp: module {index} is sharded on a 2-D mesh (FSDP's own HSDP, whose "
                                 f"all-reduce across replicas runs before any hook): for a compressed one, fully_shard "
                                 f"on the 1-D shard mesh (mesh['shard']) and pass replicate_group")
            module.set_all_reduce_hook(functools.partial(state.replica_all_reduce, index, replicate_group))
        module._gradcomp_fsdp = state
    state.modules = len(modules)
    return state


class FSDPCompression:
    """The codec and, per FSDP module, its residual and steps; the bytes each rank sent."""

    def __init__(self, spec: str = "topk", **codec_params: Any):
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
        # HSDP's exchange across replicas: per module the sender's residual (of the shard) and the owner's (its chunk)
        self.replica_residuals: dict[int, torch.Tensor] = {}
        self.owner_residuals: dict[int, torch.Tensor] = {}
        self.total = {"wire_bytes": 0, "raw_bytes": 0, "reduce_scatters": 0, "replica_wire_bytes": 0,
                      "replica_raw_bytes": 0}
        self.world_size: int | None = None

    # -- one module's reduce-scatter --------------------------------------------------------------------------------

    def reduce_scatter(self, index: int, output: torch.Tensor, flat: torch.Tensor, group) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if flat.numel() != world * output.numel():
            raise ValueError(f"gradcomp.fsdp: module {index}'s reduce-scatter input holds {flat.numel()} elements, "
                             f"not {world} x the {output.numel()} of its output")
        if flat.dtype not in _ops.DTYPE_IDS:
            raise ValueError(f"gradcomp.fsdp: module {index} reduces in {flat.dtype}; gradcomp's codecs take "
                             f"{', '.join(map(str, _ops.DTYPE_IDS))}")
        self.world_size = world
        residual = self._residual(index, flat)
        step = self.steps.get(index, 0)
        # Each (sender, row) pair its own random stream: sender r's row j is stream r * W + j.
        payloads = self.codec.encode_chunks(flat, residual, world, step=step, bucket=index, first_rank=rank * world)
        if residual is not None:  # a row whose gradient is not finite keeps its residual (the codec may not show it
            # there: topk sends a NaN and zeroes its place); the residual before was finite, and m = grad + residual
            # saturates, so the gradient's row decides
            rows, before = residual.view(world, -1), self._spares[index].view(world, -1)
            finite = torch.isfinite(flat.view(world, -1)).all(dim=1, keepdim=True)
            torch.where(finite, rows, before, out=rows)
        size = payloads.numel() // world  # the rows are of equal size: FSDP pads each parameter to W rows
        received = torch.empty_like(payloads)
        dist.all_to_all_single(received, payloads, group=group)
        self.codec.decode_sum(received.view(world, size), output, 1.0)
        self.steps[index] = step + 1
        self.total["wire_bytes"] += (world - 1) * size
        self.total["raw_bytes"] += (world - 1) * output.numel() * output.element_size()  # a ring reduce-scatter's
        self.total["reduce_scatters"] += 1

    def replica_all_reduce(self, index: int, group, shard: torch.Tensor) -> None:
        """HSDP: shard (this rank's reduce-scatter output) becomes its average over the replicas in group, by the
        two-phase exchange: chunk j of every replica's shard, encoded with the sender's residual, to replica j, which
        decodes their average and encodes it again with its owner residual; an all-gather of those gives every
        replica the same average (bit for bit)."""
        replicas, me = dist.get_world_size(group), dist.get_rank(group)
        if replicas == 1:
            return
        flat, codec = shard.view(-1), self.codec
        step = self.steps.get(index, 1) - 1  # the reduce-scatter just done counted this step
        keys = (self.world_size or 1) ** 2  # random streams apart from the reduce-scatter's
        residual = self._kept(self.replica_residuals, index, flat.numel(), flat)
        before = None if residual is None else residual.clone()
        payloads = codec.encode_chunks(flat, residual, replicas, step=step, bucket=index, first_rank=keys + me * replicas)
        bounds = chunk_bounds(flat.numel(), replicas)
        sizes = [codec.payload_nbytes(end - start, flat.dtype) for start, end in bounds]
        mine = torch.empty(replicas * sizes[me], dtype=torch.uint8, device=flat.device)
        dist.all_to_all_single(mine, payloads, [sizes[me]] * replicas, sizes, group=group)
        start, end = bounds[me]
        average = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
        owner = self._kept(self.owner_residuals, index, end - start, flat)
        owner_before = None if owner is None else owner.clone()
        again = codec.reencode_sum(mine.view(replicas, sizes[me]), average, owner, 1.0 / replicas, step=step,
                                   bucket=index, rank=keys + replicas * replicas + me)
        width = max(sizes)
        row = torch.zeros(width, dtype=torch.uint8, device=flat.device)
        row[: again.numel()].copy_(again)
        rows = [torch.empty_like(row) for _ in range(replicas)]
        dist.all_gather(rows, row, group=group)
        codec.decode_chunks(torch.stack(rows), flat)
        for kept, was, finite in ((residual, before, torch.isfinite(flat).all()),
                                  (owner, owner_before, torch.isfinite(average).all())):
            if kept is not None:  # a non-finite exchange leaves the residuals as they were
                torch.where(finite, kept, was, out=kept)
        self.total["replica_wire_bytes"] += sum(sizes) - sizes[me] + (replicas - 1) * width
        self.total["replica_raw_bytes"] += 2 * (replicas - 1) * flat.numel() * flat.element_size() // replicas

    def _kept(self, store: dict, index: int, numel: int, like: torch.Tensor) -> torch.Tensor | None:
        """store[index], a residual of numel elements like `like` (made, or moved to its device), under error
        feedback."""
        if not self.codec.error_feedback:
            return None
        kept = store.get(index)
        if kept is None:
            kept = store[index] = torch.zeros(numel, dtype=like.dtype, device=like.device)
        elif kept.numel() != numel or kept.dtype != like.dtype:
            raise ValueError(f"gradcomp.fsdp: module {index}'s residual across replicas is {kept.numel()} "
                             f"{kept.dtype}, its shard {numel} {like.dtype} (saved for another model?)")
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
        return {"codec": self.spec, "modules": self.modules, "world_size": self.world_size,
                "wire_format": _ops._C.format_version}

    def state_dict(self) -> dict[str, Any]:
        rank = dist.get_rank() if dist.is_initialized() else None
        return {"format": STATE_FORMAT, "kind": "fsdp", "config": self.config(), "rank": rank,
                "steps": dict(self.steps), "residuals": _to_cpu({k: v.clone() for k, v in self.residuals.items()}),
                "replica_residuals": _to_cpu({k: v.clone() for k, v in self.replica_residuals.items()}),
                "owner_residuals": _to_cpu({k: v.clone() for k, v in self.owner_residuals.items()}),
                "total": dict(self.total)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT or saved.get("kind") != "fsdp":
            raise ValueError("gradcomp.fsdp: not a state that gradcomp.fsdp saved")
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
        # On the CPU until the first reduce-scatter, which moves each to its input's device.
        self.residuals = {int(k): v.clone() for k, v in saved["residuals"].items()}
        self.replica_residuals = {int(k): v.clone() for k, v in saved.get("replica_residuals", {}).items()}
        self.owner_residuals = {int(k): v.clone() for k, v in saved.get("owner_residuals", {}).items()}
        self._spares = {}
        self.total = {**self.total, **saved["total"]}
        self.world_size = saved["config"].get("world_size")


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
