"""Scenarios of gradcomp.every_rank and of the wrappers register takes, run on several ranks by ddp_harness."""

from __future__ import annotations

import torch

import gradcomp
from ddp_scenarios import make_model, train, wrap


def every_rank_round_trip(rank, world, spec, steps, directory):
    """Trains, saves every_rank(state) (into `directory` per rank when given), loads it into a fresh state on a
    fresh model. Returns this rank's state_dict before and after, and the every-rank object itself."""
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.register(ddp, spec)
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), steps, rank)
    saved = gradcomp.every_rank(state, directory).state_dict()
    fresh = gradcomp.CompressionState(spec)
    gradcomp.every_rank(fresh).load_state_dict(saved)  # before a model: applied when registered
    gradcomp.register(wrap(make_model()), fresh)
    return {"before": state.state_dict(), "after": fresh.state_dict(), "saved": saved}


def load_every_rank(rank, world, spec, saved):
    """Loads an every-rank state into this world; returns the error text, or None."""
    try:
        gradcomp.CompressionState(spec).load_state_dict(saved)
    except ValueError as error:
        return str(error)
    return None


def this_ranks_state_elsewhere(rank, world, spec, steps):
    """Rank 1 loads rank 0's own state_dict: the error it gets."""
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.register(ddp, spec)
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), steps, rank)
    rank0 = [state.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(rank0, src=0)
    try:
        state.load_state_dict(rank0[0])
    except ValueError as error:
        return str(error)
    return None


class _FabricLikeModule(torch.nn.Module):
    """What Fabric's setup returns: a module holding the DDP model as _forward_module."""

    def __init__(self, ddp):
        super().__init__()
        self._forward_module = ddp


def register_through_wrapper(rank, world, steps):
    """register() on a module holding DDP as Fabric's does; returns DDP's logged hook name and the stats."""
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.register(_FabricLikeModule(ddp), "topk")
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), steps, rank)
    return {"hook_name": ddp._get_ddp_logging_data().get("comm_hook"), "registered": ddp._gradcomp_state is state,
            "compressed": state.stats()["total"]["compressed_buckets"]}
