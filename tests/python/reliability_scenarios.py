"""What each rank runs in the reliability tests (test_reliability.py): non-finite gradients, ranks that
die or stall, DDP's less common settings, and memory over many steps. See ddp_harness.run_ranks."""

from __future__ import annotations

import gc
import os
import time
import warnings

import torch
import torch.nn as nn

import gradcomp
from ddp_scenarios import FEATURES, CLASSES, batch, gradients, make_model, train, wrap

NAN_AT, INF_AT = (0, 0), (1, 1)  # in the middle layer's weight: NaN from the last rank, +Inf from rank 0


def _plan_tensors(state, index):
    plan = state._plans.get(index)
    return {} if plan is None else {k: t.clone() for k, t in plan.tensors().items() if t is not None}


def nonfinite(rank, world, specs, bad_step, steps):
    """At bad_step the last rank's gradient gets a NaN and rank 0's a +Inf (the same element of every
    spec's model). Trains under AMP's GradScaler, which must see them and skip that step.

    Returns per spec: each bucket's gradient and averaged output at bad_step (with the bucket's state
    just before and just after), the parameters after every step, the losses, the scale and stats."""
    out = {}
    for spec in specs:
        model = make_model()
        ddp = wrap(model)
        state = gradcomp.CompressionState(spec, model=model)
        current = {"step": 0}

        def poison(grad):
            if current["step"] != bad_step:
                return grad
            grad = grad.clone()
            if rank == world - 1:
                grad[NAN_AT] = float("nan")
            if rank == 0:
                grad[INF_AT] = float("inf")
            return grad

        model[2].weight.register_hook(poison)
        buckets = {}

        def recording_hook(state, bucket):
            if state.iter != bad_step:
                return gradcomp.hook(state, bucket)
            index, grad = bucket.index(), bucket.buffer().clone()
            before = _plan_tensors(state, index)

            def record(done):
                result = done.value()
                result = result[0] if isinstance(result, list) else result
                buckets[index] = {"grad": grad, "out": result.clone(), "before": before}
                return result

            return gradcomp.hook(state, bucket).then(record)

        ddp.register_comm_hook(state, recording_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10_000)
        losses, params = [], []
        for step in range(steps):
            current["step"] = step
            x, y = batch(step, 0, rank)
            loss = nn.functional.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()
            if step == bad_step:
                for index, record in buckets.items():
                    record["after"] = _plan_tensors(state, index)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            losses.append(loss.item())
            params.append([p.detach().clone() for p in model.parameters()])
        out[spec] = {"buckets": buckets, "losses": losses, "params": params, "scale": scaler.get_scale(),
                     "stats": state.stats()["total"]}
    return out


def fault(rank, world, spec, register_kwargs, kind, fault_step):
    """The last rank dies (kind "die": before its step; "die in backward": once backward has reached the
    first layer, i.e. after the other buckets were launched) or stalls forever ("stall") at fault_step.
    The others train on and return the error their step ended with, and how long after the step began."""
    model = make_model()
    ddp = wrap(model)
    gradcomp.register(ddp, spec, **register_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    current = {"step": 0}
    if kind == "die in backward" and rank == world - 1:
        model[0].weight.register_hook(lambda grad: os._exit(3) if current["step"] == fault_step else grad)
    for step in range(fault_step + 1):
        current["step"], started = step, time.monotonic()
        if step == fault_step and rank == world - 1 and kind != "die in backward":
            if kind == "die":
                os._exit(3)
            time.sleep(3600)
        try:
            train(ddp, optimizer, 1, rank, first_step=step)
        except Exception as error:  # noqa: BLE001 - what the test checks
            return {"step": step, "error": f"{type(error).__name__}: {error}", "after_s": time.monotonic() - started}
    return {"step": fault_step, "error": None, "after_s": None}


class Branchy(nn.Module):
    """Two heads, one used on even steps and one on odd steps, and a parameter of 0 elements."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.trunk = nn.Linear(FEATURES, 32)
        self.even, self.odd = nn.Linear(32, CLASSES), nn.Linear(32, CLASSES)
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x, step):
        head = self.even if step % 2 == 0 else self.odd
        return head(torch.tanh(self.trunk(x))) + self.empty.sum()


def unused_parameters(rank, world, configs, steps):
    """find_unused_parameters=True on Branchy; configs as in ddp_scenarios.lossless. Returns per config
    the gradients after every step (None for a parameter no rank used) and the losses."""
    out = {}
    for name, config in configs.items():
        model = Branchy()
        ddp = wrap(model, find_unused_parameters=True)
        if config is not None:
            gradcomp.register(ddp, config[0], **config[1])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        grads, losses = [], []
        for step in range(steps):
            x, y = batch(step, 0, rank)
            loss = nn.functional.cross_entropy(ddp(x, step), y)
            loss.backward()
            grads.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[name] = {"grads": grads, "losses": losses}
    return out


def _live_tensors() -> int:
    time.sleep(0.02)
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def memory(rank, world, specs, steps):
    """Per spec: the state's memory_bytes() after every step, the live tensors in the process after step
    10 and after the last step, and the parameters' bytes."""
    out = {}
    for spec in specs:
        model = make_model()
        ddp = wrap(model)
        state = gradcomp.register(ddp, spec)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        held, live = [], {}

        def record(step, state=state):
            held.append(state.memory_bytes())
            if step in (10, steps - 1):
                live[step] = min(_live_tensors() for _ in range(5))  # what a collective's thread still held
                # a moment ago (a callback's frame) is gone by the next count; a leak stays in all of them

        train(ddp, optimizer, steps, rank, record=record)
        out[spec] = {"held": held, "live": live, "param_bytes": sum(p.numel() * 4 for p in model.parameters()),
                     "matrix_numel": sum(p.numel() for p in model.parameters() if p.dim() >= 2)}
        del ddp, state, optimizer, model
        gc.collect()
    return out


def load_elsewhere(rank, world, saved):
    """Loads a state saved by another world size; returns the error."""
    try:
        gradcomp.CompressionState(saved["config"]["codec"]).load_state_dict(saved)
    except ValueError as error:
        return str(error)
    return None


__all__ = ["nonfinite", "fault", "unused_parameters", "memory", "load_elsewhere", "gradients"]


class IdleHead(Branchy):
    """Branchy with a third head that no step uses."""

    def __init__(self):
        super().__init__()
        self.idle = nn.Linear(32, CLASSES)


def _per_parameter(plan, flat: torch.Tensor, start: int) -> dict:
    """The part of flat (elements start.. of the bucket's flat gradient) that falls in each parameter of plan,
    as a tensor of the parameter's size (zeros elsewhere)."""
    pieces, offset = {}, 0
    for key, shape in zip(plan.keys, plan.shapes):
        piece = torch.zeros(shape.numel(), dtype=flat.dtype)
        lo, hi = max(offset, start), min(offset + shape.numel(), start + flat.numel())
        if lo < hi:
            piece[lo - offset: hi - offset] = flat[lo - start: hi - start]
        pieces[key] = piece
        offset += shape.numel()
    return pieces


def hook_recording_sent(sent: list):
    """gradcomp's hook, recording into sent[-1] (a dict the caller appends per step) each parameter's gradient as it
    goes into the hook, flat, by the parameter's key."""

    def hook(state, bucket):
        keys = [state._param_keys[id(p)] for p in bucket.parameters()]
        sent[-1].update({k: g.detach().clone().reshape(-1) for k, g in zip(keys, bucket.gradients())})
        return gradcomp.hook(state, bucket)

    return hook


def residuals_per_parameter(state) -> tuple[dict, dict]:
    """Per parameter key, as tensors of the parameter's size on the CPU (zeros where this rank holds none): this
    rank's residual, and the owner residual of what it owns (two-phase, flat or between nodes). Under the
    hierarchical scheme, the residual of this rank's shard (powersgd: of its group of whole parameters)."""
    residual, owner = {}, {}
    for plan in state._plans.values():
        keeper, first, inside = plan, 0, plan.numel  # the plan holding the state; its first element in the bucket
        if plan.scheme == "hierarchical":
            keeper = plan.inner
            if plan.groups is None:
                first = (plan.rank % plan.node_size) * plan.shard
                inside = max(0, plan.numel - first)  # of the shard, what is not padding
        if keeper.scheme == "powersgd":  # residuals of whole matrices
            residual.update({k: piece["residual"].reshape(-1).cpu() for k, piece in keeper.pieces().items()
                             if "residual" in piece})
        elif keeper.residual is not None:
            residual.update(_per_parameter(plan, keeper.residual.cpu()[:inside], first))
        if getattr(keeper, "owner_residual", None) is not None:
            start, _ = keeper.bounds[keeper.rank]
            owner.update(_per_parameter(plan, keeper.owner_residual.cpu()[: max(0, inside - start)], first + start))
    return residual, owner


def unused_error_feedback(rank, world, configs, steps):
    """find_unused_parameters=True on IdleHead (a head unused on every rank at every other step, one unused at
    every step). configs: {name: (spec, scheme, DDP options, zero_grad's set_to_none[, more of the state's
    options])}. Returns per config, by
    parameter position: this rank's gradient going into the hook at each step, the gradient DDP left in .grad
    after each backward (zeros for None), and at the end this rank's residual and the two-phase owner residual
    of the elements this rank owns (zeros where it has none)."""
    out = {}
    for name, (spec, scheme, ddp_kwargs, set_to_none, *more) in configs.items():
        model = IdleHead()
        ddp = wrap(model, find_unused_parameters=True, **ddp_kwargs)
        state = gradcomp.CompressionState(spec, scheme=scheme, start_iter=1, min_bucket_ratio=0, model=model,
                                          **(more[0] if more else {}))
        sent: list[dict] = []
        ddp.register_comm_hook(state, hook_recording_sent(sent))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        applied = []
        for step in range(steps):
            sent.append({})
            x, y = batch(step, 0, rank)
            nn.functional.cross_entropy(ddp(x, step), y).backward()
            applied.append([torch.zeros(p.numel()) if p.grad is None else p.grad.detach().clone().reshape(-1)
                            for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
        residual, owner = residuals_per_parameter(state)
        count = len(list(model.parameters()))
        out[name] = {"sent": [[s.get(k) for k in range(count)] for s in sent], "applied": applied,
                     "residual": [residual.get(k) for k in range(count)], "owner": [owner.get(k) for k in range(count)],
                     "compressed": state.stats()["total"]["compressed_buckets"]}
    return out
