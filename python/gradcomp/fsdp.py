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
Supported: torch >= 2.9's FSDP2 (FSDPModule.set_custom_reduce_scatter and set_force_sum_reduction_for_comms).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import _ops
from .checkpoint import STATE_FORMAT, _to_cpu
from .codecs import codec as make_codec
from .powersgd import PowerSGD

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # torch without FSDP2, or with the seam elsewhere
    FSDPModule, ReduceScatter = None, object

SEAM = ("set_custom_reduce_scatter", "set_force_sum_reduction_for_comms")


def register(model: torch.nn.Module, spec: str = "topk", **codec_params: Any) -> "FSDPCompression":
    """Installs gradcomp's reduce-scatter on every FSDP module of model (what fully_shard returned); returns the
    state (stats, memory_bytes, state_dict / load_state_dict). spec, codec_params: as gradcomp.codec takes them."""
    if FSDPModule is None or not all(hasattr(FSDPModule, name) for name in SEAM):
        raise RuntimeError(f"gradcomp.fsdp needs FSDP2's custom reduce-scatter (FSDPModule.{SEAM[0]} and "
                           f"{SEAM[1]}, torch >= 2.9); this is torch {torch.__version__}")
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
        self.total = {"wire_bytes": 0, "raw_bytes": 0, "reduce_scatters": 0}
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
        reduce-scatter would have sent ("raw_bytes"), their ratio, and the reduce-scatters done."""
        total = dict(self.total)
        total["ratio"] = total["raw_bytes"] / total["wire_bytes"] if total["wire_bytes"] else 1.0
        return {"world_size": self.world_size, "modules": self.modules, "total": total}

    def memory_bytes(self) -> int:
        """The residuals and their spares: two of each module's unsharded gradient under error feedback."""
        return sum(t.numel() * t.element_size() for t in [*self.residuals.values(), *self._spares.values()])

    def config(self) -> dict[str, Any]:
        return {"codec": self.spec, "modules": self.modules, "world_size": self.world_size,
                "wire_format": _ops._C.format_version}

    def state_dict(self) -> dict[str, Any]:
        rank = dist.get_rank() if dist.is_initialized() else None
        return {"format": STATE_FORMAT, "kind": "fsdp", "config": self.config(), "rank": rank,
                "steps": dict(self.steps), "residuals": _to_cpu({k: v.clone() for k, v in self.residuals.items()}),
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
        self._spares = {}
        self.total = dict(saved["total"])
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
