"""Every rank's compression state in one checkpoint, for frameworks that write rank 0's file only.

Residuals belong to the rank that built them, but Lightning's ModelCheckpoint, Fabric's `save` and
Accelerate's `save_state` write what rank 0 holds. `every_rank(state)` wraps a CompressionState (or
gradcomp.fsdp's state, which loads on the world size that saved it only) so
that its `state_dict()` (called on every rank at the same moment, as those frameworks do) gathers
every rank's state into one object, and its `load_state_dict()` gives each rank its own entry:

    fabric.save(path, {"model": model, "gradcomp": gradcomp.every_rank(state)})
    fabric.load(path, {"model": model, "gradcomp": gradcomp.every_rank(state)})

With torch.distributed.checkpoint, `gradcomp.dcp_stateful(state)` is the same as a Stateful:

    dcp.save({"model": ..., "gradcomp": gradcomp.dcp_stateful(state)}, checkpoint_id=path)

`every_rank(state, directory=DIR)` keeps large states out of the checkpoint instead: each rank
writes DIR/gradcomp-step{S}-rank{R}-{ID}.pt, a new file at every save (ID is drawn per save, so that
another run in DIR, or a run resumed from an older checkpoint that passes step S again, never
overwrites the files an earlier checkpoint names), and the checkpoint holds each file's path and
SHA-256; a file whose contents changed since is refused at load. DIR must be reachable from every rank
that may take that rank's place on resume (shared storage across nodes); its files accumulate like the
checkpoints themselves: delete a checkpoint's files with it.
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from typing import Any

import torch
import torch.distributed as dist

EVERY_RANK_FORMAT = 1
STATE_FORMAT = 1  # of a CompressionState's state_dict()


def every_rank(state, directory: str | None = None) -> "EveryRankState":
    """A view of `state` whose state_dict() holds every rank's state (a collective: call it on every rank)."""
    return EveryRankState(state, directory)


class EveryRankState:
    """state_dict() / load_state_dict() of a CompressionState (or gradcomp.fsdp's state) over all its ranks (see
    the module docstring)."""

    __slots__ = ("state", "directory")

    def __init__(self, state, directory: str | None = None):
        from .fsdp import FSDPCompression  # both import this module's loader
        from .state import CompressionState
        if not isinstance(state, (CompressionState, FSDPCompression)):
            raise TypeError(f"gradcomp.every_rank takes a CompressionState or an FSDPCompression (what "
                            f"gradcomp.register or gradcomp.fsdp.register returns), got {type(state).__name__}")
        self.state, self.directory = state, directory

    def state_dict(self) -> dict[str, Any]:
        group = self.state._group()
        if not dist.is_initialized():
            raise RuntimeError("gradcomp.every_rank(state).state_dict() gathers every rank's state: call it after "
                               "torch.distributed.init_process_group, on every rank")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = _to_cpu(self.state.state_dict())
        if self.directory is not None:
            buffer = io.BytesIO()
            torch.save(mine, buffer)
            data = buffer.getvalue()
            path = os.path.join(self.directory, f"gradcomp-step{self.state.iter}-rank{rank}-{uuid.uuid4().hex[:12]}.pt")
            os.makedirs(self.directory, exist_ok=True)
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
            mine = {"file": path, "sha256": hashlib.sha256(data).hexdigest()}
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine, group=group)  # tensors on the CPU: any rank can unpickle them
        return {"format": EVERY_RANK_FORMAT, "gradcomp_every_rank": True, "world_size": world, "ranks": everyone}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state.load_state_dict(saved)


def dcp_stateful(state, directory: str | None = None) -> "DcpState":
    """every_rank(state) as torch.distributed.checkpoint's Stateful: dcp.save({"gradcomp": gradcomp.dcp_stateful(state)},
    ...) and dcp.load the same, on every rank (a CompressionState's also on another world size, with elastic=True;
    gradcomp.fsdp's state loads on the world size that saved it)."""
    return DcpState(state, directory)


class DcpState:
    """DCP loads into the structure the current state_dict() has, and a fresh state has none of the saved one's
    buckets: so every rank's state travels as one serialized object, which DCP saves once (it is the same on every
    rank) and hands back whole."""

    __slots__ = ("every_rank",)

    def __init__(self, state, directory: str | None = None):
        self.every_rank = EveryRankState(state, directory)

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.every_rank.state_dict(), buffer)
        return {"gradcomp_every_rank_serialized": buffer.getvalue()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        data = saved.get("gradcomp_every_rank_serialized") if isinstance(saved, dict) else None
        if not isinstance(data, bytes):
            raise ValueError(f"gradcomp.dcp_stateful: the checkpoint holds {type(data).__name__} under "
                             f"'gradcomp_every_rank_serialized', not what gradcomp.dcp_stateful(state) saved")
        self.every_rank.load_state_dict(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))


def is_every_rank(saved: Any) -> bool:
    return isinstance(saved, dict) and saved.get("gradcomp_every_rank") is True


def every_rank_world_size(saved: dict[str, Any]) -> int:
    """The number of ranks that saved an every-rank state, once its format and its list of entries are checked."""
    if saved.get("format") != EVERY_RANK_FORMAT:
        raise ValueError(f"gradcomp: an every-rank state of format {saved.get('format')!r}; this gradcomp reads "
                         f"format {EVERY_RANK_FORMAT}")
    world, ranks = saved.get("world_size"), saved.get("ranks")
    if not isinstance(world, int) or not isinstance(ranks, list) or len(ranks) != world:
        found = f"{len(ranks)} rank entries" if isinstance(ranks, list) else f"ranks of type {type(ranks).__name__}"
        raise ValueError(f"gradcomp: this every-rank state holds {found} for world_size {world!r}: it is incomplete "
                         f"or damaged; take another checkpoint with gradcomp.every_rank(state).state_dict(), called "
                         f"on every rank")
    return world


def this_ranks_entry(saved: dict[str, Any], rank: int | None) -> dict[str, Any]:
    """This rank's state out of an every-rank state saved by this world size (the caller checks it), read from
    its file when it was saved to one."""
    if rank is None:
        raise RuntimeError("gradcomp: an every-rank state is loaded by each rank taking its own entry: load it "
                           "after torch.distributed.init_process_group")
    entry = saved["ranks"][rank]
    if isinstance(entry, dict) and set(entry) in ({"file"}, {"file", "sha256"}):  # files without sha256: older saves
        if not os.path.exists(entry["file"]):
            raise FileNotFoundError(f"gradcomp: rank {rank}'s state was saved to {entry['file']}, which this rank "
                                    f"cannot find (per-rank files need storage that every node reaches)")
        with open(entry["file"], "rb") as f:
            data = f.read()
        if "sha256" in entry and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"gradcomp: rank {rank}'s state file {entry['file']} is not what this checkpoint saved "
                             f"there (it was written over since); load the checkpoint that wrote it, or start from a "
                             f"fresh CompressionState")
        entry = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return entry


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
