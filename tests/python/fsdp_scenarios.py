"""Scenarios of gradcomp.fsdp on several gloo ranks (run by ddp_harness): FSDP2 (fully_shard) on the CPU, also where
a GPU is there (fully_shard without a mesh would take the accelerator's)."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import gradcomp.fsdp
from ddp_scenarios import batch

FEATURES, CLASSES = 24, 5


def cpu_mesh():
    """Every rank on the CPU: fully_shard's default mesh is on the accelerator wherever there is one."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dist.get_world_size(),))


def make_model() -> nn.Module:
    """Three Linear layers, each its own FSDP module, and the root (which then holds no parameter of its own). 45
    and 41 outputs: sizes no world size here divides, so FSDP pads the rows."""
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(FEATURES, 45), nn.Tanh(), nn.Linear(45, 41), nn.Tanh(), nn.Linear(41, CLASSES))
    mesh = cpu_mesh()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model, step: int, rank: int) -> None:
    x, y = batch(step, 0, rank)
    nn.functional.cross_entropy(model(x), y).backward()


def gradients(rank, world, specs):
    """The full gradients after one backward, of plain FSDP2 and of FSDP2 with each of gradcomp's specs, with the
    stats: {"plain": [...], spec: {"grads": [...], "stats": ...}}."""
    model = make_model()
    _step(model, 0, rank)
    out = {"plain": [p.grad.full_tensor() for p in model.parameters()]}
    for spec in specs:
        model = make_model()
        state = gradcomp.fsdp.register(model, spec, start_iter=0)
        _step(model, 0, rank)
        out[spec] = {"grads": [p.grad.full_tensor() for p in model.parameters()], "stats": state.stats()}
    model = make_model()  # start_iter=1: the first step plain, the second compressed
    state = gradcomp.fsdp.register(model, "signsgd", start_iter=1)
    _step(model, 0, rank)
    out["start_iter"] = {"grads": [p.grad.full_tensor() for p in model.parameters()], "first": state.stats()}
    model.zero_grad()
    _step(model, 1, rank)
    out["start_iter"]["second"] = state.stats()
    return out


def error_feedback(rank, world, spec, steps, nan_at=None):
    """The reduce-scatter alone, on random rows: per step this rank's input, residual before and after, and output.
    nan_at: (step, rank, row) whose input gets a NaN."""
    state = gradcomp.fsdp.FSDPCompression(spec, start_iter=0)
    generator = torch.Generator().manual_seed(rank)
    shard = 37
    records = []
    for step in range(steps):
        flat = torch.randn(world * shard, generator=generator)
        if nan_at is not None and nan_at[:2] == (step, rank):
            flat[nan_at[2] * shard + 5] = float("nan")
        before = state.residuals.get(0, torch.zeros_like(flat)).clone()
        output = torch.empty(shard)
        state.reduce_scatter(0, output, flat.clone(), dist.group.WORLD)
        records.append({"input": flat, "before": before, "after": state.residuals[0].clone(), "output": output})
    return records


def _train_resumable(model, state, rank, steps, stop_at, saved_by_rank, every_rank=False) -> dict:
    """SGD steps of model under gradcomp's state, from saved_by_rank[rank] (this rank's model shards, gradcomp state
    and step, as a run with stop_at saved them) when given: this rank's shards and what it saved at stop_at.
    every_rank: gradcomp's state saved and loaded through gradcomp.every_rank (every rank's in each file)."""
    saving = gradcomp.every_rank(state) if every_rank else state
    first = 0
    if saved_by_rank is not None:
        shards, compression, first = torch.load(io.BytesIO(saved_by_rank[rank]), weights_only=True)
        with torch.no_grad():
            for p, local in zip(model.parameters(), shards):
                p.to_local().copy_(local)
        saving.load_state_dict(compression)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for step in range(first, steps):
        _step(model, step, rank)
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == stop_at:
            buffer = io.BytesIO()
            torch.save(([p.to_local().clone() for p in model.parameters()], saving.state_dict(), step + 1), buffer)
            out["saved"] = buffer.getvalue()
    out["shards"] = [p.to_local().clone() for p in model.parameters()]
    return out


def training(rank, world, spec, steps, stop_at=None, saved_by_rank=None, every_rank=False):
    """SGD steps under FSDP2 with gradcomp; from saved_by_rank[rank] (this rank's model shards and gradcomp state,
    as a run with stop_at saved them) when given. Returns this rank's shards and what it saved at stop_at."""
    model = make_model()
    state = gradcomp.fsdp.register(model, spec)
    out = _train_resumable(model, state, rank, steps, stop_at, saved_by_rank, every_rank)
    out["stats"] = state.stats()
    out["memory"] = state.memory_bytes()
    return out


def make_hsdp_model(mesh, native: bool) -> nn.Module:
    """make_model's layers sharded over the 'shard' dimension of a (replicate, shard) mesh: natively (FSDP's own
    HSDP, the 2-D mesh), or on the 1-D shard mesh, for gradcomp's exchange across replicas."""
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(FEATURES, 45), nn.Tanh(), nn.Linear(45, 41), nn.Tanh(), nn.Linear(41, CLASSES))
    where = mesh if native else mesh["shard"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=where)
    fully_shard(model, mesh=where)
    return model


def hsdp(rank, world, specs, steps):
    """2 replicas of 2 shards: the gradients of one backward under FSDP's own HSDP, and per spec under gradcomp
    (reduce-scatter and exchange across replicas compressed) then `steps` SGD steps: this rank's shards."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_hsdp_model(mesh, native=True)
    _step(model, 0, rank)
    out = {"native": [p.grad.to_local().clone() for p in model.parameters()]}
    try:
        gradcomp.fsdp.register(model, "topk", replicate_group=mesh.get_group("replicate"))
        out["native_refused"] = "not refused"
    except ValueError as error:
        out["native_refused"] = str(error)
    for spec in specs:
        model = make_hsdp_model(mesh, native=False)
        state = gradcomp.fsdp.register(model, spec, replicate_group=mesh.get_group("replicate"), start_iter=0)
        _step(model, 0, rank)
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(1, steps + 1):
            optimizer.step()
            optimizer.zero_grad()
            _step(model, step, rank)
        out[spec] = {"grads": grads, "shards": [p.to_local().clone() for p in model.parameters()],
                     "stats": state.stats(), "memory": state.memory_bytes()}
    return out


def hsdp_resume(rank, world, spec, shards, steps, stop_at=None, saved_by_rank=None):
    """SGD steps under gradcomp's HSDP on world // shards replicas of `shards` ranks, saved at stop_at or resumed from
    saved_by_rank[rank]: this rank's shards, steps counted and what it saved."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("replicate", "shard"))
    model = make_hsdp_model(mesh, native=False)
    # start_iter=1: a plain exchange, then compressed ones; a save after step 2 holds residuals
    state = gradcomp.fsdp.register(model, spec, replicate_group=mesh.get_group("replicate"), start_iter=1)
    out = _train_resumable(model, state, rank, steps, stop_at, saved_by_rank)
    out["replica_steps"] = dict(state.replica_steps)
    return out


def refusals(rank, world):
    """What register and the first exchange refuse on live ranks: {case: the message} (or "not refused")."""
    def refused(case):
        try:
            case()
            return "not refused"
        except (ValueError, RuntimeError) as error:
            return str(error)

    def one_module(*layers):
        model = nn.Sequential(*layers)
        fully_shard(model, mesh=cpu_mesh())
        return model

    out = {}
    out["float64"] = refused(lambda: gradcomp.fsdp.register(one_module(nn.Linear(4, 6).double()), "topk"))
    out["mixed"] = refused(lambda: gradcomp.fsdp.register(one_module(nn.Linear(4, 6), nn.Linear(6, 2).half()), "topk"))
    # An every-rank state saved by another world size: its rows are other shards.
    state = gradcomp.fsdp.FSDPCompression("topk")
    entries = [state.state_dict() for _ in range(world + 1)]
    out["other_world"] = refused(lambda: gradcomp.every_rank(state).load_state_dict(
        {"format": 1, "gradcomp_every_rank": True, "world_size": world + 1, "ranks": entries}))
    # Rank 0 registers another codec: the first reduce-scatter raises on every rank, naming each rank's.
    model = make_model()
    gradcomp.fsdp.register(model, "signsgd" if rank == 0 else "topk")
    out["other_codec"] = refused(lambda: _step(model, 0, rank))
    return out
