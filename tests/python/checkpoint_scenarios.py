"""Scenarios of gradcomp.every_rank and of the wrappers register takes, run on several ranks by ddp_harness."""

from __future__ import annotations

import warnings

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


def load_every_rank_state(rank, world, spec, saved):
    """Loads an every-rank state into a fresh state registered on a fresh model; returns its state_dict."""
    fresh = gradcomp.CompressionState(spec)
    gradcomp.register(wrap(make_model()), fresh)
    gradcomp.every_rank(fresh).load_state_dict(saved)
    return fresh.state_dict()


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


def resume_around_start(rank, world, configs, total, workdir, phase):
    """configs: [(spec, register's options)]. Phase "full": each config trains `total` steps uninterrupted,
    saving a checkpoint after steps start_iter - 1, start_iter and start_iter + 1; phase "second": fresh
    processes load each of those checkpoints and train on to `total`. Returns the parameters at the end,
    {(config index, "full"): [tensors], (config index, step the run resumed at): ([tensors], [warnings])}."""
    from ddp_scenarios import _resumable

    out = {}
    for index, (spec, options) in enumerate(configs):
        start = options.get("start_iter", 2)
        splits = [split for split in (start - 1, start, start + 1) if split >= 1]
        path = f"{workdir}/ckpt.{index}.{{}}.rank{rank}.pt"
        if phase == "full":
            model, optimizer, state = _resumable((spec, options))
            for step in range(total):
                train(model, optimizer, 1, rank, first_step=step)
                if step + 1 in splits:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "gradcomp": state.state_dict()}, path.format(step + 1))
            out[(index, "full")] = [p.detach().clone() for p in model.parameters()]
            continue
        for split in splits:
            model, optimizer, state = _resumable((spec, options))
            checkpoint = torch.load(path.format(split), weights_only=False)
            model.module.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            state.load_state_dict(checkpoint["gradcomp"])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                train(model, optimizer, total - split, rank, first_step=split)
            out[(index, split)] = ([p.detach().clone() for p in model.parameters()], [str(w.message) for w in caught])
    return out


def trained_every_rank_state(rank, world, spec, options, steps):
    """Trains `steps` steps of spec (register options `options`) and returns every_rank(state).state_dict()."""
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.register(ddp, spec, **options)
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), steps, rank)
    return gradcomp.every_rank(state).state_dict()


def elastic_resume(rank, world, spec, options, saved, steps):
    """Loads an every-rank state saved on another world size with elastic=True into a fresh state on a fresh model;
    returns the per-parameter state it holds then (its pool) and after `steps` more steps of training, with the
    step it stood at."""
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.register(ddp, spec, elastic=True, **options)
    gradcomp.every_rank(state).load_state_dict(saved)
    loaded = state.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), steps, rank, first_step=loaded["iter"])
    return {"loaded": loaded, "after": state.state_dict()}


def dcp_save(rank, world, spec, steps, path):
    """Trains, saves gradcomp.dcp_stateful(state) with torch.distributed.checkpoint; returns every_rank's view."""
    import torch.distributed.checkpoint as dcp
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.register(ddp, spec)
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), steps, rank)
    dcp.save({"gradcomp": gradcomp.dcp_stateful(state)}, checkpoint_id=path)
    return {"saved": gradcomp.every_rank(state).state_dict(), "state": state.state_dict()}


def dcp_load(rank, world, spec, path, elastic):
    """A fresh state on a fresh model, loaded with torch.distributed.checkpoint; returns its state_dict."""
    import torch.distributed.checkpoint as dcp
    state = gradcomp.register(wrap(make_model()), spec, elastic=elastic)
    dcp.load({"gradcomp": gradcomp.dcp_stateful(state)}, checkpoint_id=path)
    return {"loaded": state.state_dict()}
